//! Admission control: past max_in_flight, RESOURCE_EXHAUSTED at once, and the in-flight gauge
//! moves beside the max_in_flight gauge. In its own test binary because the in-flight gauge is process-wide.
// A test crate's helpers are `pub` for its modules, not an API: nothing outside reaches them.
#![allow(unreachable_pub)]

#[path = "common/mod.rs"]
mod common;

use common::*;
use retrace::pb;
use std::sync::Arc;
use std::time::Duration;
use tonic::Code;

#[tokio::test]
async fn overload_is_refused_at_once() {
    let counters = Arc::new(Counters::default());
    let loader = fake_loader(Duration::from_millis(1500), counters.clone(), None);
    let s = TestServer::start(config("max_in_flight = 2", &[("ov", "")]), loader).await;
    s.ready().await;
    let c = s.client().await;
    let slow: Vec<_> = (0..2)
        .map(|i| {
            let mut c = c.clone();
            tokio::spawn(async move {
                c.evaluate(request(&format!("{i}"), "", steps_trace("q", &["s"])))
                    .await
            })
        })
        .collect();
    counters.until_started(2).await;
    let metrics = s.scrape().await;
    assert_eq!(
        sample(&metrics, "retrace_in_flight_requests", &[]),
        Some(2.0),
        "{metrics}"
    );
    // The bound beside the count, so a dashboard or an autoscaler reads their ratio.
    assert_eq!(sample(&metrics, "retrace_max_in_flight", &[]), Some(2.0));
    let status = c
        .clone()
        .evaluate(request("x", "", steps_trace("q", &["s"])))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    // Refused while both admitted requests still run: it did not wait for a slot to free.
    assert_eq!(counters.finished(), 0, "refused only after a slot freed");
    // Rank needs one slot per candidate, all or none.
    let status = c
        .clone()
        .rank(pb::RankRequest {
            question: "q".into(),
            candidates: vec![steps_trace("", &["s"]); 2],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    for h in slow {
        h.await.unwrap().unwrap();
    }
    let metrics = s.scrape().await;
    assert_eq!(
        sample(&metrics, "retrace_in_flight_requests", &[]),
        Some(0.0)
    );
    assert_eq!(
        sample(
            &metrics,
            "retrace_requests_total",
            &[
                ("rpc", "Evaluate"),
                ("evaluator", "ov"),
                ("outcome", "resource_exhausted")
            ]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &metrics,
            "retrace_requests_total",
            &[("rpc", "Evaluate"), ("evaluator", "ov"), ("outcome", "ok")]
        ),
        Some(2.0)
    );
    assert!(
        metrics.contains(
            "retrace_request_duration_seconds_bucket{rpc=\"Evaluate\",evaluator=\"ov\",le=\"0.5\"}"
        ),
        "{metrics}"
    );
    s.stop().await.unwrap();
}
