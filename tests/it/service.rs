//! Integration tests for the gRPC service with fake evaluators: every RPC, bad input, health,
//! reflection, metrics, overload, deadlines, stream cancellation and auth.

use crate::common;

use common::*;
use futures::StreamExt;
use retrace::pb;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tonic::Code;

const MS: Duration = Duration::from_millis(1);

async fn quick_server(
    evaluators: &[(&str, &str)],
    server_extra: &str,
) -> (TestServer, Arc<Counters>) {
    let counters = Arc::new(Counters::default());
    let s = TestServer::start(
        config(server_extra, evaluators),
        fake_loader(MS, counters.clone(), None),
    )
    .await;
    s.ready().await;
    (s, counters)
}

#[tokio::test]
async fn evaluate_steps_and_text() {
    let (s, _) = quick_server(
        &[("a", ""), ("b", "threshold = 0.95\naggregate = \"mean\"")],
        "",
    )
    .await;
    let mut c = s.client().await;

    let r = c
        .evaluate(request(
            "r1",
            "",
            steps_trace("2+2?", &["2+2=4", "so wrong 5", "answer 5"]),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.id, "r1");
    assert_eq!(r.evaluator, "a");
    assert_eq!(r.first_error_index, 1);
    assert_eq!(r.category, pb::ErrorCategory::Unspecified as i32);
    assert_eq!(
        r.steps.iter().map(|s| s.score).collect::<Vec<_>>(),
        vec![0.9, 0.1, 0.9]
    );
    assert!((r.trace_score - 0.1).abs() < 1e-6);
    assert_eq!(r.threshold, 0.5);
    let t = r.timing.unwrap();
    assert!(t.total_s >= t.queue_s && t.total_s > 0.0);

    // Raw text is segmented and offsets point into it.
    let text = "Add them.\n\n2+2 = 4.\n\nThe answer is 4.";
    let trace = pb::Trace {
        question: "2+2?".into(),
        text: text.into(),
        ..Default::default()
    };
    let r = c
        .evaluate(request("r2", "b", trace))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.evaluator, "b");
    assert_eq!(r.steps.len(), 3);
    for st in &r.steps {
        assert_eq!(&text[st.start as usize..st.end as usize], st.text);
    }
    // threshold 0.95 from config: every 0.9 step is an error.
    assert_eq!(r.first_error_index, 0);
    assert!((r.trace_score - 0.9).abs() < 1e-6, "mean aggregate");

    // Per-request threshold override; all steps hold -> -1 and NONE.
    let mut req = request("r3", "b", steps_trace("q", &["fine", "fine"]));
    req.threshold = Some(0.5);
    let r = c.evaluate(req).await.unwrap().into_inner();
    assert_eq!(r.first_error_index, -1);
    assert_eq!(r.category, pb::ErrorCategory::None as i32);
    assert_eq!(r.threshold, 0.5);
    s.stop().await.unwrap();
}

#[tokio::test]
async fn bad_input_is_invalid_argument_naming_the_field() {
    let (s, _) = quick_server(&[("a", "max_steps = 3")], "max_trace_bytes = 200").await;
    let mut c = s.client().await;
    let mut bad_threshold = request("x", "", steps_trace("q", &["s"]));
    bad_threshold.threshold = Some(1.5);
    let cases = vec![
        (request("x", "", steps_trace("", &["s"])), "trace.question"),
        (request("x", "", steps_trace("q", &[])), "trace.steps"),
        (
            request("x", "", steps_trace("q", &["ok", "  "])),
            "trace.steps[1]",
        ),
        (
            request("x", "", steps_trace("q", &["1", "2", "3", "4"])),
            "trace.steps",
        ),
        (
            request("x", "", steps_trace("q", &[&"x".repeat(300)])),
            "trace: 301 bytes",
        ),
        (request("x", "nope", steps_trace("q", &["s"])), "evaluator"),
        (bad_threshold, "threshold"),
        (
            pb::EvaluateRequest {
                id: "x".into(),
                ..Default::default()
            },
            "trace",
        ),
    ];
    for (req, field) in cases {
        let status = c.evaluate(req.clone()).await.unwrap_err();
        assert_eq!(status.code(), Code::InvalidArgument, "{req:?}: {status:?}");
        assert!(
            status.message().starts_with(field),
            "want {field:?}, got {:?}",
            status.message()
        );
    }
    // Rank with no candidates, and a candidate carrying its own question.
    let status = c
        .rank(pb::RankRequest {
            question: "q".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().starts_with("candidates"),
        "{}",
        status.message()
    );
    let status = c
        .rank(pb::RankRequest {
            question: "q".into(),
            candidates: vec![steps_trace("other", &["s"])],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        status.message().starts_with("candidates[0]"),
        "{}",
        status.message()
    );
    s.stop().await.unwrap();
}

/// An error message echoes little of the input: a 100 KB evaluator name once came back whole,
/// past the transport's header limit, and the caller saw RESOURCE_EXHAUSTED ("metadata size
/// exceeds limit") instead of INVALID_ARGUMENT naming the field.
#[tokio::test]
async fn a_huge_unknown_name_gets_invalid_argument_with_a_short_message() {
    let (s, _) = quick_server(&[("a", "")], "").await;
    let mut c = s.client().await;
    let name = "n".repeat(100_000);
    let status = c
        .evaluate(request("r", &name, steps_trace("q", &["s"])))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .starts_with("evaluator: unknown evaluator \"nnn"),
        "{}",
        status.message()
    );
    assert!(
        status.message().contains("(100000 bytes)"),
        "{}",
        status.message()
    );
    assert!(status.message().len() < 400, "{}", status.message().len());
    s.stop().await.unwrap();
}

/// A Rank's candidates each carry its id, so a long id would multiply the response: ids are
/// capped at the edge (a 1 MB id with 100 candidates once answered with 101 MB).
#[tokio::test]
async fn a_long_id_is_refused_before_it_is_copied_into_every_candidate() {
    let (s, _) = quick_server(&[("a", "")], "").await;
    let mut c = s.client().await;
    let rank = |id: String| pb::RankRequest {
        id,
        question: "q".into(),
        candidates: vec![steps_trace("", &["fine"]); 8],
        ..Default::default()
    };
    let status = c.rank(rank("i".repeat(257))).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status.message().starts_with("id: is 257 bytes"),
        "{}",
        status.message()
    );
    let status = c
        .evaluate(request(&"i".repeat(300), "", steps_trace("q", &["s"])))
        .await
        .unwrap_err();
    assert!(status.message().starts_with("id: "), "{}", status.message());
    let ok = c.rank(rank("i".repeat(256))).await.unwrap().into_inner();
    let ids: Vec<String> = ok
        .ranked
        .iter()
        .map(|r| r.verdict.clone().unwrap().id)
        .collect();
    assert!(ids.iter().all(|id| id.len() <= 256 + 3), "{ids:?}");
    s.stop().await.unwrap();
}

#[tokio::test]
async fn rank_orders_by_trace_score_and_list_describes() {
    let (s, _) = quick_server(
        &[("a", ""), ("b", "threshold = 0.3\nmax_steps = 9")],
        "default_evaluator = \"b\"",
    )
    .await;
    let mut c = s.client().await;
    let r = c
        .rank(pb::RankRequest {
            id: "rank1".into(),
            question: "q".into(),
            candidates: vec![
                steps_trace("", &["wrong start", "fine"]),
                steps_trace("", &["fine", "fine"]),
                pb::Trace {
                    text: "fine\n\nwrong end".into(),
                    ..Default::default()
                },
                steps_trace("", &["fine"]),
            ],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.id, "rank1");
    assert_eq!(r.evaluator, "b");
    let order: Vec<u32> = r.ranked.iter().map(|c| c.index).collect();
    assert_eq!(
        order,
        vec![1, 3, 0, 2],
        "best first; ties keep request order"
    );
    let v = r.ranked[2].verdict.as_ref().unwrap();
    assert_eq!(v.first_error_index, 0);

    let list = c
        .list_evaluators(pb::ListEvaluatorsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.evaluators.len(), 2);
    let b = &list.evaluators[1];
    assert_eq!(
        (b.name.as_str(), b.kind.as_str(), b.family.as_str()),
        ("b", "prm", "fake")
    );
    assert_eq!(
        (b.threshold, b.max_steps, b.ready, b.is_default),
        (0.3, 9, true, true)
    );
    assert_eq!(b.aggregate, "min");
    assert!(!list.evaluators[0].is_default);
    // An evaluator's complaint about a trace names the candidate.
    let status = c
        .rank(pb::RankRequest {
            question: "q".into(),
            candidates: vec![
                steps_trace("", &["fine"]),
                steps_trace("", &["fine", "refuse"]),
            ],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(
        status.message().starts_with("candidates[1].steps[1]"),
        "{}",
        status.message()
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn stream_answers_many_in_flight_by_id() {
    let counters = Arc::new(Counters::default());
    let loader = fake_loader(Duration::from_millis(30), counters.clone(), None);
    let s = TestServer::start(config("", &[("a", "")]), loader).await;
    s.ready().await;
    let mut c = s.client().await;
    let n = 20;
    let mut reqs: Vec<pb::EvaluateRequest> = (0..n)
        .map(|i| {
            request(
                &format!("id-{i}"),
                "",
                steps_trace("q", &["fine", if i % 2 == 0 { "wrong" } else { "fine" }]),
            )
        })
        .collect();
    reqs.push(request("bad", "", steps_trace("q", &[" "])));
    let mut out = c
        .evaluate_stream(futures::stream::iter(reqs))
        .await
        .unwrap()
        .into_inner();
    let mut seen = std::collections::HashMap::new();
    while let Some(r) = out.next().await {
        let r = r.unwrap();
        seen.insert(r.id.clone(), r);
    }
    // The jobs ran side by side, not one after another.
    assert!(counters.peak() > 1, "at most one job ran at a time");
    assert_eq!(seen.len(), n as usize + 1);
    for i in 0..n {
        let r = &seen[&format!("id-{i}")];
        assert_eq!(r.first_error_index, if i % 2 == 0 { 1 } else { -1 });
        assert!(r.error.is_none());
    }
    let bad = seen["bad"]
        .error
        .as_ref()
        .expect("error carried in the stream");
    assert_eq!(bad.code, Code::InvalidArgument as i32);
    assert!(bad.message.starts_with("trace.steps[0]"));
    s.stop().await.unwrap();
}

/// A request stream that breaks (one item over the message size limit) still gets an answer for
/// every item it sent before, those in flight included, and then an error status, not OK.
#[tokio::test]
async fn a_broken_request_stream_answers_what_it_accepted_then_fails() {
    let counters = Arc::new(Counters::default());
    let loader = fake_loader(Duration::from_millis(300), counters.clone(), None);
    let s = TestServer::start(config("", &[("a", "")]), loader).await;
    s.ready().await;
    let mut c = s.client().await;
    let mut reqs: Vec<pb::EvaluateRequest> = (0..3)
        .map(|i| request(&format!("id-{i}"), "", steps_trace("q", &["fine"])))
        .collect();
    // Past the server's 4 MiB decoding limit: the stream breaks here.
    reqs.push(request(
        "huge",
        "",
        steps_trace(&"q".repeat(5 << 20), &["s"]),
    ));
    reqs.push(request("after", "", steps_trace("q", &["fine"])));
    let mut out = c
        .evaluate_stream(futures::stream::iter(reqs))
        .await
        .unwrap()
        .into_inner();
    let mut answered = Vec::new();
    let end = loop {
        match out.next().await {
            Some(Ok(r)) => answered.push(r.id),
            Some(Err(status)) => break Some(status),
            None => break None,
        }
    };
    answered.sort();
    assert_eq!(answered, ["id-0", "id-1", "id-2"]);
    let status = end.expect("the stream ends with an error, not OK");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(
        status
            .message()
            .starts_with("request stream: item 3 could not be read (message of "),
        "{}",
        status.message()
    );
    assert!(
        status
            .message()
            .contains(" bytes exceeds the 4 MiB limit); the 3 before it were answered"),
        "{}",
        status.message()
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn closing_a_stream_cancels_queued_work() {
    let counters = Arc::new(Counters::default());
    let loader = fake_loader(Duration::from_millis(300), counters.clone(), None);
    let s = TestServer::start(config("", &[("cancel", "max_concurrency = 1")]), loader).await;
    s.ready().await;
    let mut c = s.client().await;
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    for i in 0..10 {
        tx.send(request(&format!("{i}"), "", steps_trace("q", &["s"])))
            .await
            .unwrap();
    }
    let out = c
        .evaluate_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap();
    // Wait until the first job reached the model and the rest queue behind it.
    counters.until_started(1).await;
    // The other nine queue behind it (they may still be arriving).
    let depth = [("evaluator", "cancel")];
    let within = Duration::from_secs(2);
    s.until_sample("retrace_queue_depth", &depth, 9.0, within)
        .await;
    drop(out);
    drop(tx);
    // Once all ten are settled as cancelled, none is left to reach the model.
    let cancelled = [("evaluator", "cancel"), ("outcome", "cancelled")];
    let metrics = s
        .until_sample("retrace_requests_total", &cancelled, 10.0, within)
        .await;
    assert_eq!(
        counters.started(),
        1,
        "queued jobs must not reach the model after the stream closed"
    );
    let depth = sample(&metrics, "retrace_queue_depth", &depth);
    assert_eq!(depth, Some(0.0));
    s.stop().await.unwrap();
}

#[tokio::test]
async fn deadline_drops_queued_work_before_the_model() {
    let counters = Arc::new(Counters::default());
    let loader = fake_loader(Duration::from_millis(400), counters.clone(), None);
    let s = TestServer::start(config("", &[("dl", "max_concurrency = 1")]), loader).await;
    s.ready().await;
    let c = s.client().await;
    let first = {
        let mut c = c.clone();
        tokio::spawn(async move { c.evaluate(request("1", "", steps_trace("q", &["s"]))).await })
    };
    counters.until_started(1).await;
    // The header alone, so that the server (not the client's own timer) enforces it.
    let mut req = tonic::Request::new(request("2", "", steps_trace("q", &["s"])));
    req.metadata_mut()
        .insert("grpc-timeout", "100m".parse().unwrap());
    let status = c.clone().evaluate(req).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded);
    first.await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        counters.started(),
        1,
        "the expired request never reached the model"
    );
    // A deadline that passes while the model runs also ends the request.
    let mut req = tonic::Request::new(request("3", "", steps_trace("q", &["s"])));
    req.metadata_mut()
        .insert("grpc-timeout", "100m".parse().unwrap());
    assert_eq!(
        c.clone().evaluate(req).await.unwrap_err().code(),
        Code::DeadlineExceeded
    );
    let metrics = s.scrape().await;
    let deadline = [("evaluator", "dl"), ("outcome", "deadline_exceeded")];
    assert_eq!(
        sample(&metrics, "retrace_requests_total", &deadline),
        Some(2.0),
        "both count as deadlines, whichever timer fired: {metrics}"
    );
    s.stop().await.unwrap();
}

/// tonic keeps a `grpc-timeout` timer of its own, started when the headers arrive, before our
/// handler has the request; when it fires first (here it must: the body never comes, so the
/// handler never runs) the caller still gets DEADLINE_EXCEEDED, never tonic's CANCELLED (which
/// clients retry), and the request is counted as a deadline, not a cancellation.
#[tokio::test]
async fn a_deadline_that_passes_before_the_handler_runs_is_deadline_exceeded() {
    let (s, _) = quick_server(&[("early", "")], "").await;
    let counted = |metrics: &str, outcome| {
        let labels = [
            ("rpc", "Evaluate"),
            ("evaluator", "unknown"),
            ("outcome", outcome),
        ];
        sample(metrics, "retrace_requests_total", &labels).unwrap_or(0.0)
    };
    let before = counted(&s.scrape().await, "deadline_exceeded");
    // A bare HTTP/2 client: tonic's own client would keep a timer of its own.
    let mut connection = http2::connect(s.addr).await;
    let headers = http2::grpc_headers(s.addr, "/retrace.v1.Evaluator/Evaluate", Some("50m"));
    // The body stays open and empty: the request is never whole, so no handler can run.
    let (response, _body) = connection.send.send_request(headers, false).unwrap();
    let (status, _) = http2::finish(response).await.unwrap();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert_eq!(
        counted(&s.scrape().await, "deadline_exceeded"),
        before + 1.0,
        "counted as a deadline"
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn health_follows_loading_and_shutdown_and_reflection_lists_services() {
    let gate = Arc::new(Semaphore::new(0));
    let counters = Arc::new(Counters::default());
    let mut s = TestServer::start(
        config("", &[("h", "")]),
        fake_loader(MS, counters, Some(gate.clone())),
    )
    .await;
    let channel = s.channel().await;
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let check = |service: &str| tonic_health::pb::HealthCheckRequest {
        service: service.into(),
    };
    for svc in ["", "retrace.v1.Evaluator"] {
        assert_eq!(
            health.check(check(svc)).await.unwrap().into_inner().status,
            2,
            "NOT_SERVING while loading"
        );
    }
    let mut c = pb::evaluator_client::EvaluatorClient::new(channel.clone());
    let status = c
        .evaluate(request("x", "", steps_trace("q", &["s"])))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    let list = c
        .list_evaluators(pb::ListEvaluatorsRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!list.evaluators[0].ready);

    let mut watch = health
        .watch(check("retrace.v1.Evaluator"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(watch.next().await.unwrap().unwrap().status, 2);
    gate.add_permits(1);
    assert_eq!(
        watch.next().await.unwrap().unwrap().status,
        1,
        "SERVING once loaded"
    );
    assert_eq!(
        health.check(check("")).await.unwrap().into_inner().status,
        1
    );

    // Reflection v1 and v1alpha list the services.
    use tonic_reflection::pb::{v1, v1alpha};
    let mut r1 = v1::server_reflection_client::ServerReflectionClient::new(channel.clone());
    let req = v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(v1::server_reflection_request::MessageRequest::ListServices(
            String::new(),
        )),
    };
    let mut resp = r1
        .server_reflection_info(futures::stream::iter([req]))
        .await
        .unwrap()
        .into_inner();
    let Some(v1::server_reflection_response::MessageResponse::ListServicesResponse(l)) =
        resp.next().await.unwrap().unwrap().message_response
    else {
        panic!("expected a service list")
    };
    let names: Vec<_> = l.service.iter().map(|s| s.name.as_str()).collect();
    assert!(
        names.contains(&"retrace.v1.Evaluator") && names.contains(&"grpc.health.v1.Health"),
        "{names:?}"
    );
    let mut ra = v1alpha::server_reflection_client::ServerReflectionClient::new(channel.clone());
    let req = v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            v1alpha::server_reflection_request::MessageRequest::FileContainingSymbol(
                "retrace.v1.Evaluator".into(),
            ),
        ),
    };
    let mut resp = ra
        .server_reflection_info(futures::stream::iter([req]))
        .await
        .unwrap()
        .into_inner();
    let msg = resp
        .next()
        .await
        .unwrap()
        .unwrap()
        .message_response
        .unwrap();
    assert!(matches!(
        msg,
        v1alpha::server_reflection_response::MessageResponse::FileDescriptorResponse(_)
    ));

    s.begin_stop();
    assert_eq!(
        watch.next().await.unwrap().unwrap().status,
        2,
        "NOT_SERVING once shutdown begins"
    );
    // The Watch ends after NOT_SERVING instead of holding the drain for the whole grace period
    // (30 s here), as it did while it stayed open.
    let end = tokio::time::timeout(Duration::from_secs(5), watch.next()).await;
    assert!(matches!(end, Ok(None)), "the Watch ends after NOT_SERVING");
    drop((health, c, r1, ra, channel));
    tokio::time::timeout(Duration::from_secs(5), s.handle)
        .await
        .expect("drained with a health Watch open")
        .unwrap()
        .unwrap();
    drop(watch);
}

#[tokio::test]
async fn bearer_auth_guards_the_evaluator_but_not_health() {
    let mut config = config(
        "auth_tokens = [\"tok-file\"]\nauth_tokens_env = \"RETRACE_TEST_TOKENS\"",
        &[("a", "")],
    );
    config.env = retrace::Env::fixed([("RETRACE_TEST_TOKENS", "tok-env")]);
    let s = TestServer::start(config, fake_loader(MS, Arc::new(Counters::default()), None)).await;
    s.ready().await;
    let mut c = s.client().await;
    let status = c
        .evaluate(request("x", "", steps_trace("q", &["s"])))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated);
    for token in ["tok-file", "tok-env"] {
        let mut req = tonic::Request::new(request("x", "", steps_trace("q", &["s"])));
        req.metadata_mut()
            .insert("authorization", format!("Bearer {token}").parse().unwrap());
        c.evaluate(req).await.unwrap();
    }
    let mut req = tonic::Request::new(pb::ListEvaluatorsRequest {});
    req.metadata_mut()
        .insert("authorization", "Bearer nope".parse().unwrap());
    assert_eq!(
        c.list_evaluators(req).await.unwrap_err().code(),
        Code::Unauthenticated
    );
    s.ready().await; // health is open without a token
    s.stop().await.unwrap();
}

#[tokio::test]
async fn tls_serves_with_the_configured_certificate() {
    // A test CA and a leaf for localhost (scripts/fixtures/make_tls.sh, valid until 2126).
    let dir = std::path::Path::new(crate::common::REPO).join("tests/fixtures/tls");
    let (cert, key, ca) = (
        dir.join("cert.pem"),
        dir.join("key.pem"),
        dir.join("ca.pem"),
    );
    let extra = format!(
        "tls_cert = {:?}\ntls_key = {:?}",
        cert.display().to_string(),
        key.display().to_string()
    );
    let counters = Arc::new(Counters::default());
    let s = TestServer::start(
        config(&extra, &[("a", "")]),
        fake_loader(MS, counters, None),
    )
    .await;
    let tls = tonic::transport::ClientTlsConfig::new()
        .ca_certificate(tonic::transport::Certificate::from_pem(
            std::fs::read(&ca).unwrap(),
        ))
        .domain_name("localhost");
    let endpoint =
        tonic::transport::Channel::from_shared(format!("https://localhost:{}", s.addr.port()))
            .unwrap()
            .tls_config(tls)
            .unwrap();
    let channel = tokio::time::timeout(Duration::from_secs(10), endpoint.connect())
        .await
        .expect("TLS handshake")
        .unwrap();
    let mut c = pb::evaluator_client::EvaluatorClient::new(channel);
    let mut served = false;
    for _ in 0..100 {
        match c.evaluate(request("t", "", steps_trace("q", &["s"]))).await {
            Ok(r) => {
                assert_eq!(r.into_inner().first_error_index, -1);
                served = true;
                break;
            }
            Err(s) if s.code() == Code::Unavailable => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(s) => panic!("{s:?}"),
        }
    }
    assert!(served);
    // Plain text gets no answer on a TLS port.
    let plain =
        tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{}", s.addr.port()))
            .unwrap()
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(2));
    let attempt = async {
        let mut c = pb::evaluator_client::EvaluatorClient::new(plain.connect().await?);
        c.evaluate(request("t", "", steps_trace("q", &["s"])))
            .await
            .map_err(|e| e.into())
    };
    let r: Result<_, Box<dyn std::error::Error>> = attempt.await;
    assert!(r.is_err());
    s.stop().await.unwrap();
}
