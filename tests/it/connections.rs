//! A gRPC connection's life (`max_connection_age_s`, `max_connection_age_grace_s`): past its
//! age the server sends GOAWAY and a call in flight still finishes; past the grace too, what
//! still runs is cut off and the client's next call goes out on a new connection.

use crate::common;

use common::*;
use futures::future::BoxFuture;
use prost::Message;
use retrace::Judgement;
use retrace::pb;
use retrace::{Description, EngineError, Evaluator, Job};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tonic::Code;

/// Holds every job until the test lets one through.
struct Held {
    gate: Arc<Semaphore>,
    started: Arc<Count>,
}

impl Evaluator for Held {
    fn describe(&self) -> Description {
        Description {
            kind: "prm".into(),
            family: "fake".into(),
            model: "held".into(),
        }
    }

    fn evaluate(&self, job: Job) -> BoxFuture<'_, Result<Judgement, EngineError>> {
        Box::pin(async move {
            self.started.add(1);
            let permit = self.gate.acquire().await.expect("gate open");
            permit.forget();
            Ok(Judgement::from_scores(
                vec![0.9; job.trace.steps.len()],
                0.5,
            ))
        })
    }
}

/// A server whose evaluator `held` holds its jobs at `gate` and whose `quick` answers at once.
async fn server(server_extra: &str) -> (TestServer, Arc<Semaphore>, Arc<Count>) {
    let (gate, started) = (Arc::new(Semaphore::new(0)), Arc::new(Count::default()));
    let quick = fake_loader(Duration::from_millis(1), Arc::default(), None);
    let loader: retrace::EvaluatorLoader = {
        let (gate, started) = (gate.clone(), started.clone());
        Arc::new(move |cfg, loaded| match cfg.name.as_str() {
            "held" => Ok(Arc::new(Held {
                gate: gate.clone(),
                started: started.clone(),
            }) as Arc<dyn Evaluator>),
            _ => quick(cfg, loaded),
        })
    };
    let config = config(server_extra, &[("held", ""), ("quick", "")]);
    let s = TestServer::start(config, loader).await;
    s.ready().await;
    (s, gate, started)
}

/// Waits (up to a bound far past the age, never a measure of it) until `started` reaches 1.
async fn until_started(started: &Count) {
    let within = Duration::from_secs(10);
    started
        .reach(1, within, "held calls at the evaluator")
        .await;
}

#[tokio::test]
async fn a_connection_past_its_age_gets_goaway_and_its_call_in_flight_finishes() {
    let (s, gate, started) =
        server("max_connection_age_s = 1\nmax_connection_age_grace_s = 60").await;
    let mut connection = http2::connect(s.addr).await;
    let call = request("in-flight", "held", steps_trace("q", &["s"]));
    let response = http2::unary(
        &mut connection,
        s.addr,
        "/retrace.v1.Evaluator/Evaluate",
        &call,
    )
    .unwrap();
    until_started(&started).await;

    // GOAWAY: the connection takes no new call; the client would open another.
    let mut goaway = None;
    for _ in 0..1000 {
        match connection.send.clone().ready().await {
            Err(e) => {
                goaway = Some(e);
                break;
            }
            Ok(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    let goaway = goaway.expect("a GOAWAY from the server");
    assert!(goaway.is_go_away() && goaway.is_remote(), "{goaway:?}");
    assert_eq!(goaway.reason(), Some(h2::Reason::NO_ERROR));
    assert!(
        !connection.closed.is_finished(),
        "a call is still in flight"
    );

    // The call in flight when the GOAWAY went out is answered in full...
    gate.add_permits(1);
    let (status, data) = http2::finish(response).await.unwrap();
    assert_eq!(status.code(), Code::Ok, "{status:?}");
    let answer = pb::EvaluateResponse::decode(&data[5..]).unwrap();
    assert_eq!(answer.id, "in-flight");
    // ...and then the server closes the connection.
    let closed = tokio::time::timeout(Duration::from_secs(30), connection.closed).await;
    assert!(
        matches!(closed, Ok(Ok(Ok(())))),
        "the server closed the connection cleanly: {closed:?}"
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn a_call_still_running_after_the_grace_is_cut_off_and_the_client_reconnects() {
    let (s, _gate, started) =
        server("max_connection_age_s = 1\nmax_connection_age_grace_s = 1\nshutdown_grace_s = 1")
            .await;
    let client = s.client().await;
    let held = {
        let mut c = client.clone();
        tokio::spawn(async move {
            c.evaluate(request("held", "held", steps_trace("q", &["s"])))
                .await
        })
    };
    until_started(&started).await;
    let status = held.await.unwrap().expect_err("the held call is cut off");
    // A connection dropped under a call: tonic's client says UNKNOWN ("transport error"),
    // gRPC's C core (the Python client) UNAVAILABLE, which it retries.
    assert!(
        matches!(status.code(), Code::Unknown | Code::Unavailable),
        "{status:?}"
    );
    // The same channel carries on over a new connection.
    let r = client
        .clone()
        .evaluate(request("next", "quick", steps_trace("q", &["s"])))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.id, "next");
    s.stop().await.unwrap();
}
