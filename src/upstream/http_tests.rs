use super::*;

#[test]
fn error_reasons_come_from_each_common_shape() {
    let cases: &[(&[u8], &str)] = &[
        (
            br#"{"error":{"message":"Invalid API Key","type":"authentication_error","code":401}}"#,
            "Invalid API Key",
        ),
        (br#"{"message":"model not found"}"#, "model not found"),
        (br#"{"error":"overloaded"}"#, "overloaded"),
        (br#"{"detail":"Not Found"}"#, "Not Found"),
        (b"upstream connect error", "upstream connect error"),
        (
            br#"{"object":"error","message":"This model's maximum context length is 4096 tokens","type":"BadRequestError","param":null,"code":400}"#,
            "This model's maximum context length is 4096 tokens",
        ),
        (
            br#"{"detail":[{"loc":["body","input"],"msg":"Field required","type":"missing"}]}"#,
            "Field required",
        ),
        (b"", "(empty body)"),
    ];
    for (body, want) in cases {
        assert_eq!(error_reason(body), *want);
    }
    let long = "x".repeat(1000);
    assert_eq!(
        error_reason(long.as_bytes()).chars().count(),
        REASON_CHARS + 3
    );
}

#[test]
fn retry_and_breaker_classes() {
    let status = |code| AttemptError::Status {
        code,
        retry_after: None,
        reason: String::new(),
    };
    let table = [
        (
            AttemptError::Connect("refused".into()),
            true,
            true,
            "connect_error",
        ),
        (AttemptError::Timeout, false, true, "timeout"),
        (AttemptError::Stalled(10), false, true, "timeout"),
        (
            AttemptError::CutOff("reset".into()),
            true,
            true,
            "connect_error",
        ),
        (status(429), true, true, "http_4xx"),
        (status(503), true, true, "http_5xx"),
        (status(401), false, false, "http_4xx"),
        (status(400), false, false, "http_4xx"),
        (
            AttemptError::BadResponse("x".into()),
            false,
            false,
            "bad_response",
        ),
    ];
    for (e, retry, unwell, outcome) in table {
        assert_eq!(
            (e.retryable(), e.upstream_unwell(), e.outcome()),
            (retry, unwell, outcome),
            "{e:?}"
        );
    }
}
