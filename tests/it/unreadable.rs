//! Requests that cannot be read, sent as hand-made gRPC bodies over a real HTTP/2 call: bytes
//! that are not the message, a message over the 4 MiB limit, no message, a frame cut short.
//! Each gets INVALID_ARGUMENT naming the request, never tonic's INTERNAL or OUT_OF_RANGE, and
//! is counted. In its own test binary because it reads process-wide counters.
// A test crate's helpers are `pub` for its modules, not an API: nothing outside reaches them.
#![allow(unreachable_pub)]

#[path = "common/mod.rs"]
mod common;

use common::*;
use http_body_util::{BodyExt, Full};
use prost::Message;
use retrace::pb;
use std::time::Duration;
use tonic::codegen::{Bytes, Service, http};
use tonic::transport::Channel;
use tonic::{Code, Status};

/// One gRPC message frame: uncompressed, its length, its bytes.
fn frame(message: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8];
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

/// POSTs `body` as-is to `path` and returns the call's status (from the headers of a
/// trailers-only answer, else from the trailers) and how many bytes of messages came back.
async fn raw_call(channel: &Channel, path: &str, body: Vec<u8>) -> (Status, usize) {
    let request = http::Request::builder()
        .method("POST")
        .uri(path)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(Full::new(Bytes::from(body))))
        .unwrap();
    let mut channel = channel.clone();
    std::future::poll_fn(|cx| channel.poll_ready(cx))
        .await
        .unwrap();
    let response = channel.call(request).await.expect("an HTTP/2 response");
    assert_eq!(response.status(), 200, "gRPC answers HTTP 200");
    if let Some(status) = Status::from_header_map(response.headers()) {
        return (status, 0);
    }
    let collected = response.into_body().collect().await.unwrap();
    let trailers = collected.trailers().cloned().expect("trailers");
    let data = collected.to_bytes().len();
    (
        Status::from_header_map(&trailers).expect("a grpc-status trailer"),
        data,
    )
}

fn evaluate_request(question: &str) -> pb::EvaluateRequest {
    request("r", "", steps_trace(question, &["fine"]))
}

const EVALUATE: &str = "/retrace.v1.Evaluator/Evaluate";
const RANK: &str = "/retrace.v1.Evaluator/Rank";

#[tokio::test]
async fn unary_requests_that_cannot_be_read_get_invalid_argument_naming_the_request() {
    let counters = std::sync::Arc::new(Counters::default());
    let loader = fake_loader(Duration::from_millis(1), counters.clone(), None);
    let s = TestServer::start(config("", &[("a", "")]), loader).await;
    s.ready().await;
    let channel = s.channel().await;

    // Field 3 (trace) holding field 1 (question) with two bytes that are not UTF-8.
    let not_utf8 = [0x1a, 0x04, 0x0a, 0x02, 0xff, 0xfe];
    let over = evaluate_request(&"q".repeat(5 << 20)).encode_to_vec();
    let rank_over = pb::RankRequest {
        question: "q".repeat(5 << 20),
        candidates: vec![steps_trace("", &["fine"])],
        ..Default::default()
    }
    .encode_to_vec();
    let cut = {
        let whole = frame(&evaluate_request("what is 2+2?").encode_to_vec());
        whole[..whole.len() - 4].to_vec()
    };
    let cases: Vec<(&str, Vec<u8>, String)> = vec![
        (
            EVALUATE,
            frame(&not_utf8),
            "request: could not be decoded as retrace.v1.EvaluateRequest: trace.question: \
             invalid string value: data is not UTF-8 encoded"
                .into(),
        ),
        (
            // Wire type 7 does not exist.
            RANK,
            frame(&[0x0f]),
            "request: could not be decoded as retrace.v1.RankRequest: invalid wire type value: 7"
                .into(),
        ),
        (
            EVALUATE,
            frame(&over),
            format!(
                "request: message of {} bytes exceeds the 4 MiB limit",
                over.len()
            ),
        ),
        (
            RANK,
            frame(&rank_over),
            format!(
                "request: message of {} bytes exceeds the 4 MiB limit",
                rank_over.len()
            ),
        ),
        (
            EVALUATE,
            Vec::new(),
            "request: is missing: the call carried no message".into(),
        ),
        (
            EVALUATE,
            cut,
            "request: is cut short: the body ended inside a message".into(),
        ),
    ];
    for (path, body, want) in &cases {
        let (status, _) = raw_call(&channel, path, body.clone()).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{path}: {status:?}");
        assert_eq!(status.message(), want, "{path}");
    }
    assert_eq!(
        counters.started(),
        0,
        "nothing unreadable reached the model"
    );

    // The same hand-made framing of a good request is answered: the path above is the real one.
    let (status, data) = raw_call(
        &channel,
        EVALUATE,
        frame(&evaluate_request("what is 2+2?").encode_to_vec()),
    )
    .await;
    assert_eq!(status.code(), Code::Ok, "{status:?}");
    assert!(data > 0, "a response message came back");
    // A status our handler gives passes through as it was.
    let (status, _) = raw_call(
        &channel,
        EVALUATE,
        frame(&evaluate_request("").encode_to_vec()),
    )
    .await;
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(status.message(), "trace.question: is required");

    let metrics = s.scrape().await;
    let count = |rpc| {
        sample(
            &metrics,
            "retrace_requests_total",
            &[
                ("rpc", rpc),
                ("evaluator", "unknown"),
                ("outcome", "invalid_argument"),
            ],
        )
    };
    assert_eq!(count("Evaluate"), Some(4.0), "{metrics}");
    assert_eq!(count("Rank"), Some(2.0), "{metrics}");
    s.stop().await.unwrap();
}

/// On a stream, the item that cannot be read ends the stream (after the items before it are
/// answered) in the same words a unary call gets.
#[tokio::test]
async fn a_stream_item_that_cannot_be_read_is_named_in_the_same_words() {
    let counters = std::sync::Arc::new(Counters::default());
    let loader = fake_loader(Duration::from_millis(1), counters.clone(), None);
    let s = TestServer::start(config("", &[("a", "")]), loader).await;
    s.ready().await;
    let channel = s.channel().await;
    let mut body = frame(&evaluate_request("what is 2+2?").encode_to_vec());
    body.extend(frame(&[0x1a, 0x04, 0x0a, 0x02, 0xff, 0xfe]));
    let (status, data) = raw_call(&channel, "/retrace.v1.Evaluator/EvaluateStream", body).await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert_eq!(
        status.message(),
        "request stream: item 1 could not be read (could not be decoded as \
         retrace.v1.EvaluateRequest: trace.question: invalid string value: data is not UTF-8 \
         encoded); the 1 before it were answered"
    );
    assert!(data > 0, "the first item was answered");
    s.stop().await.unwrap();
}
