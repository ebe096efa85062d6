//! A judge against an upstream broken at the socket level (tests/common/wire.rs): silent,
//! stalled mid-body, reset, cut off, flooding, answering no choices or only reasoning. Each request
//! ends inside its deadline with a status that says what happened, and the judge leaves no
//! connection to that upstream open.

use crate::common;

use common::wire::{Wire, WireUpstream};
use common::{TestServer, evaluate_within, steps_trace};
use retrace::Config;
use retrace::pb;
use std::time::Duration;
use tonic::Code;

/// Every request's gRPC deadline.
const DEADLINE: Duration = Duration::from_secs(2);
/// Past the deadline, the most a loaded 2-core machine may take to deliver the status.
const SLACK: Duration = Duration::from_secs(3);
/// How long the judge may take to close a connection once the request ended.
const CLOSE_WITHIN: Duration = Duration::from_secs(3);

async fn judge_server(name: &str, upstream: &WireUpstream, extra: &str) -> TestServer {
    let text = format!(
        "[[evaluator]]\nname = \"{name}\"\nkind = \"judge\"\nbase_url = \"{}\"\nmodel = \"fake\"\n\
         output = \"text\"\ncache_entries = 0\n{extra}\n",
        upstream.base_url()
    );
    let config = Config::parse(&text, "test config", &[]).expect("valid config");
    let s = TestServer::start(config, retrace::default_loader()).await;
    s.ready().await;
    s
}

/// One Evaluate with `DEADLINE` in its header (the server enforces it); fails the test if no
/// status came back within the deadline and the slack.
async fn judge(s: &TestServer, evaluator: &str) -> Result<pb::EvaluateResponse, tonic::Status> {
    let trace = steps_trace("What is 2 + 3?", &["2 + 3 = 5.", "5 is even.", "So 5."]);
    evaluate_within(s, evaluator, trace, DEADLINE, SLACK).await
}

/// The request's status, which must be an error with `code` whose message holds every needle.
async fn fails(s: &TestServer, evaluator: &str, code: Code, needles: &[&str]) -> tonic::Status {
    let status = judge(s, evaluator).await.unwrap_err();
    println!("{evaluator}: {:?}: {}", status.code(), status.message());
    assert_eq!(status.code(), code, "{status:?}");
    for needle in needles {
        assert!(
            status.message().to_lowercase().contains(needle),
            "{needle:?} not in {:?}",
            status.message()
        );
    }
    status
}

async fn assert_closed(up: &WireUpstream) {
    assert!(
        up.wait_closed(CLOSE_WITHIN).await,
        "{} upstream connection(s) still open",
        up.open()
    );
}

#[tokio::test]
async fn an_upstream_that_never_answers_is_cut_at_the_deadline() {
    let up = WireUpstream::start(Wire::Silent).await;
    let s = judge_server("w-silent", &up, "retries = 3").await;
    fails(
        &s,
        "w-silent",
        Code::DeadlineExceeded,
        &["w-silent", "did not answer in time"],
    )
    .await;
    assert_eq!(up.requests(), 1, "a timeout is not retried");
    assert_closed(&up).await;
    s.stop().await.unwrap();
}

#[tokio::test]
async fn an_upstream_that_stalls_mid_body_is_cut_at_the_deadline() {
    let up = WireUpstream::start(Wire::Stall).await;
    let s = judge_server("w-stall", &up, "retries = 3").await;
    fails(
        &s,
        "w-stall",
        Code::DeadlineExceeded,
        &["w-stall", "stalled mid-reply", "bytes of body came"],
    )
    .await;
    assert_eq!(up.requests(), 1, "a stall is not retried");
    assert_closed(&up).await;
    s.stop().await.unwrap();
}

#[tokio::test]
async fn a_reset_or_a_close_mid_body_is_retried_then_unavailable() {
    let up = WireUpstream::start(Wire::Reset).await;
    // Six failed exchanges in a row: keep the breaker out of it.
    let s = judge_server("w-reset", &up, "retries = 2\nbreaker_failures = 100").await;
    // The reset may reach the judge before or after it read the headers: either way it says so.
    fails(
        &s,
        "w-reset",
        Code::Unavailable,
        &["w-reset", "reset", "after 3 attempt(s)"],
    )
    .await;
    assert_eq!(up.requests(), 3, "one try and two retries");
    assert_closed(&up).await;

    up.set(Wire::Close);
    fails(
        &s,
        "w-reset",
        Code::Unavailable,
        &["reply was cut off", "after 3 attempt(s)"],
    )
    .await;
    assert_eq!(up.requests(), 6);
    assert_closed(&up).await;
    s.stop().await.unwrap();
}

/// 50 MB with no Content-Length: refused once 4 MiB have come, so the upstream's writes stop
/// near the cap (plus what the sockets' buffers hold), far short of the whole body.
#[tokio::test]
async fn a_flood_is_cut_at_the_cap_while_reading() {
    const FLOOD: usize = 50_000_000;
    let up = WireUpstream::start(Wire::Flood(FLOOD)).await;
    let s = judge_server("w-flood", &up, "retries = 3").await;
    fails(
        &s,
        "w-flood",
        Code::Unavailable,
        &["w-flood", "the body is over 4 mib"],
    )
    .await;
    assert_eq!(up.requests(), 1, "a broken body is not retried");
    assert_closed(&up).await;
    let written = up.written();
    println!("w-flood: the upstream wrote {written} of {FLOOD} bytes");
    assert!(
        (4 << 20..FLOOD / 2).contains(&written),
        "the upstream wrote {written} bytes"
    );
    s.stop().await.unwrap();
}

/// Well-formed HTTP with an unusable reply: the connection goes back to the judge's pool (one
/// for both requests), and closes with the judge.
#[tokio::test]
async fn no_choices_is_unavailable_and_not_retried() {
    let up = WireUpstream::start(Wire::Json(r#"{"choices": []}"#.into())).await;
    let s = judge_server("w-empty", &up, "retries = 3").await;
    for _ in 0..2 {
        fails(
            &s,
            "w-empty",
            Code::Unavailable,
            &["w-empty", "not a chat completion", "no choices"],
        )
        .await;
    }
    assert_eq!(up.requests(), 2, "not retried");
    assert!(up.open() <= 1, "{} connections open", up.open());
    s.stop().await.unwrap();
    assert_closed(&up).await;
}

fn reasoning_only(reasoning: &str, finish_reason: &str) -> Wire {
    let body = serde_json::json!({
        "choices": [{"index": 0, "finish_reason": finish_reason, "message": {
            "role": "assistant", "content": "", "reasoning_content": reasoning}}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 1024},
    });
    Wire::Json(body.to_string())
}

/// A reasoning model's reply with empty `content`: a verdict boxed in its reasoning counts; one
/// that ran out of tokens while thinking is unavailable, and the message says to raise max_tokens.
#[tokio::test]
async fn a_reply_with_only_reasoning_content() {
    let verdict = "Paragraph 1 is false.\n\\boxed{1}\nCategory: Hallucination";
    let up = WireUpstream::start(reasoning_only(verdict, "stop")).await;
    let s = judge_server("w-think", &up, "").await;
    let r = judge(&s, "w-think").await.unwrap();
    assert_eq!(r.first_error_index, 1);
    assert_eq!(r.category, pb::ErrorCategory::Hallucination as i32);

    up.set(reasoning_only(
        "Let me check paragraph 0 first. 2 + 3 is",
        "length",
    ));
    fails(
        &s,
        "w-think",
        Code::Unavailable,
        &[
            "no readable verdict",
            "content is empty",
            "reasoning_content gives no verdict",
            "raise max_tokens",
        ],
    )
    .await;
    // The reply, then the one repair turn.
    assert_eq!(up.requests(), 3);
    s.stop().await.unwrap();
    assert_closed(&up).await;
}
