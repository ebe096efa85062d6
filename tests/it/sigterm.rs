//! SIGTERM with requests in flight: they complete, health turns NOT_SERVING, the server returns Ok.
//! In its own test binary because it signals its own process.
// A test crate's helpers are `pub` for its modules, not an API: nothing outside reaches them.
#![allow(unreachable_pub)]

#[path = "common/mod.rs"]
mod common;

use common::*;
use std::sync::Arc;
use std::time::Duration;

#[tokio::test]
async fn sigterm_drains_requests_in_flight() {
    let counters = Arc::new(Counters::default());
    let loader = fake_loader(Duration::from_millis(600), counters.clone(), None);
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = grpc.local_addr().unwrap();
    let listeners = retrace::Listeners {
        grpc,
        http: None,
        metrics: None,
    };
    let server = tokio::spawn(retrace::serve(
        config("shutdown_grace_s = 10", &[("a", "")]),
        loader,
        listeners,
        retrace::shutdown_signal(),
    ));
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}")).unwrap();
    // The listener is bound, so the connection is taken at once.
    let channel = channel.connect().await.unwrap();
    let within = Duration::from_secs(5);
    assert!(until_health(channel.clone(), "", ServingStatus::Serving, within).await);
    let client = retrace::pb::evaluator_client::EvaluatorClient::new(channel.clone());
    let in_flight: Vec<_> = (0..5)
        .map(|i| {
            let mut c = client.clone();
            tokio::spawn(async move {
                c.evaluate(request(
                    &i.to_string(),
                    "",
                    steps_trace("q", &["s", "wrong"]),
                ))
                .await
            })
        })
        .collect();
    counters.until_started(5).await;
    nix::sys::signal::raise(nix::sys::signal::Signal::SIGTERM).unwrap();
    for h in in_flight {
        let r = h
            .await
            .unwrap()
            .expect("in-flight request completes after SIGTERM")
            .into_inner();
        assert_eq!(r.first_error_index, 1);
    }
    assert_eq!(counters.finished(), 5);
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("server stops after draining")
        .unwrap()
        .expect("clean exit");
}
