//! The one table from engine errors to gRPC status codes, and the outcome label metrics use.

use crate::engine::EngineError;
use std::time::Duration;
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

/// Most bytes of an error message a status carries: a message echoes the caller's input (an
/// evaluator name, a field), and one past the transport's header limit would replace the status
/// with the transport's own "metadata size exceeds limit".
pub(super) const MAX_MESSAGE_BYTES: usize = 1024;

/// Maps an engine error to its gRPC status: validation -> INVALID_ARGUMENT, overload ->
/// RESOURCE_EXHAUSTED, not ready or upstream down -> UNAVAILABLE, deadline -> DEADLINE_EXCEEDED,
/// caller gone -> CANCELLED, an operator's request the state refuses -> FAILED_PRECONDITION,
/// anything else -> INTERNAL.
pub fn to_status(error: &EngineError) -> Status {
    let code = match error {
        EngineError::Invalid { .. } | EngineError::TooLarge { .. } => Code::InvalidArgument,
        EngineError::Overloaded { .. } => Code::ResourceExhausted,
        EngineError::Unavailable(_) => Code::Unavailable,
        EngineError::DeadlineExceeded(_) => Code::DeadlineExceeded,
        EngineError::Cancelled => Code::Cancelled,
        EngineError::Refused(_) => Code::FailedPrecondition,
        EngineError::Internal(_) => Code::Internal,
    };
    let mut status = Status::new(code, capped(error.to_string()));
    if code == Code::ResourceExhausted {
        // gRPC's retry pushback: clients that honour it come back when the work ahead has
        // drained instead of spinning on their own backoff.
        let ms = retry_after(error).as_millis().to_string();
        if let Ok(value) = MetadataValue::try_from(ms) {
            status.metadata_mut().insert(PUSHBACK, value);
        }
    }
    status
}

/// The trailer that carries gRPC's retry pushback, in milliseconds.
pub(super) const PUSHBACK: &str = "grpc-retry-pushback-ms";
/// When an overload's source cannot say when it passes (its pace not measured yet).
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);
/// A wait is never shorter than this (a retry at once only adds to the queue) nor longer (a
/// pace measured on a slowed machine can read hours).
const RETRY_AFTER_RANGE: (Duration, Duration) =
    (Duration::from_millis(50), Duration::from_secs(60));

/// When a caller refused for overload should come back: the pace's estimate of when the work
/// ahead drains, within `RETRY_AFTER_RANGE`, else `DEFAULT_RETRY_AFTER`.
pub(super) fn retry_after(error: &EngineError) -> Duration {
    let estimate = match error {
        EngineError::Overloaded { retry_after, .. } => *retry_after,
        _ => None,
    };
    let (low, high) = RETRY_AFTER_RANGE;
    estimate.map_or(DEFAULT_RETRY_AFTER, |d| d.clamp(low, high))
}

/// `message` cut to `MAX_MESSAGE_BYTES` at a character boundary, saying how much was cut.
pub(super) fn capped(mut message: String) -> String {
    if message.len() <= MAX_MESSAGE_BYTES {
        return message;
    }
    let total = message.len();
    let mut end = MAX_MESSAGE_BYTES;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    message.truncate(end);
    message.push_str(&format!("… ({} more bytes cut)", total - end));
    message
}

/// The status table's HTTP column: what the JSON edge answers for each code.
pub(super) fn http_status(code: Code) -> u16 {
    match code {
        Code::Ok => 200,
        Code::InvalidArgument => 400,
        Code::Unauthenticated => 401,
        Code::PermissionDenied => 403,
        Code::ResourceExhausted => 429,
        Code::Unavailable => 503,
        Code::DeadlineExceeded => 504,
        // nginx's "client closed request": only the logs see it, the caller has gone.
        Code::Cancelled => 499,
        Code::FailedPrecondition => 409,
        _ => 500,
    }
}

/// The code's name as gRPC spells it, for JSON error bodies.
pub(super) fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::Unauthenticated => "UNAUTHENTICATED",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::Unavailable => "UNAVAILABLE",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::Cancelled => "CANCELLED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        _ => "INTERNAL",
    }
}

/// The `outcome` label for a request's result: a bounded set of snake_case code names.
pub(crate) fn outcome(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::InvalidArgument => "invalid_argument",
        Code::ResourceExhausted => "resource_exhausted",
        Code::Unavailable => "unavailable",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::Cancelled => "cancelled",
        Code::Unauthenticated => "unauthenticated",
        Code::PermissionDenied => "permission_denied",
        Code::FailedPrecondition => "failed_precondition",
        _ => "internal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table() {
        let cases = [
            (
                EngineError::invalid("trace.question", "is required"),
                Code::InvalidArgument,
            ),
            (EngineError::overloaded("full"), Code::ResourceExhausted),
            (
                EngineError::Unavailable("loading".into()),
                Code::Unavailable,
            ),
            (
                EngineError::DeadlineExceeded("late".into()),
                Code::DeadlineExceeded,
            ),
            (EngineError::Cancelled, Code::Cancelled),
            (
                EngineError::Refused("bad head".into()),
                Code::FailedPrecondition,
            ),
            (EngineError::Internal("bug".into()), Code::Internal),
        ];
        for (err, code) in cases {
            let status = to_status(&err);
            assert_eq!(status.code(), code, "{err}");
            assert_eq!(status.message(), err.to_string());
        }
        assert_eq!(
            to_status(&EngineError::invalid("trace.steps[2]", "is empty")).message(),
            "trace.steps[2]: is empty"
        );
        let long = EngineError::invalid("evaluator", "é".repeat(4000));
        let message = to_status(&long).message().to_string();
        assert!(message.len() < MAX_MESSAGE_BYTES + 64, "{}", message.len());
        assert!(message.ends_with("more bytes cut)"), "{message}");
        assert_eq!(outcome(Code::Ok), "ok");
        let http: Vec<u16> = [
            Code::InvalidArgument,
            Code::Unauthenticated,
            Code::ResourceExhausted,
            Code::Unavailable,
            Code::DeadlineExceeded,
            Code::FailedPrecondition,
            Code::Internal,
        ]
        .into_iter()
        .map(http_status)
        .collect();
        assert_eq!(http, [400, 401, 429, 503, 504, 409, 500]);
        assert_eq!(code_name(Code::ResourceExhausted), "RESOURCE_EXHAUSTED");
        let pushback = |e: &EngineError| {
            let status = to_status(e);
            let value = status.metadata().get(PUSHBACK)?.to_str().ok()?.to_string();
            Some(value)
        };
        let measured = EngineError::Overloaded {
            message: "busy".into(),
            retry_after: Some(Duration::from_millis(1234)),
        };
        assert_eq!(pushback(&measured).as_deref(), Some("1234"));
        assert_eq!(
            pushback(&EngineError::overloaded("busy")).as_deref(),
            Some("1000")
        );
        let hours = EngineError::Overloaded {
            message: "slow".into(),
            retry_after: Some(Duration::from_secs(7200)),
        };
        assert_eq!(pushback(&hours).as_deref(), Some("60000"));
        assert_eq!(pushback(&EngineError::Unavailable("down".into())), None);
        assert_eq!(outcome(Code::DataLoss), "internal");
    }
}
