//! A model thread that dies mid-batch, in a whole server next to a healthy PRM: its requests (the
//! one in the batch and those queued behind it) end at once with UNAVAILABLE saying why, health
//! says NOT_SERVING for that evaluator (grpc.health.v1, ListEvaluators, the readiness gauge), the
//! queue gauge comes back to 0, and the other evaluator goes on answering.

use crate::common;

use common::{TestServer, request, sample, steps_trace, until_health};
use retrace::Encoded;
use retrace::Evaluator;
use retrace::pb;
use retrace::{Config, KindConfig};
use retrace::{Limits, PrmEvaluator, ScoreError, Scorer};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};
use tonic::Code;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};

/// Holds its first batch until the test lets it go, then panics, as a model with a bug would.
struct Dies(Mutex<mpsc::Receiver<()>>);

impl Scorer for Dies {
    fn score(&self, _: &[&Encoded]) -> Result<Vec<retrace_model::Row>, ScoreError> {
        let _ = self.0.lock().unwrap().recv();
        panic!("a bug in the model")
    }
}

const DEADLINE: Duration = Duration::from_secs(20);
/// Requests sent to the dying evaluator: one in its batch (of one), the rest queued behind it.
const CALLS: usize = 4;

/// "dies" (the panicking scorer) and "lives" (the committed tiny PRM), both formatting with the
/// tiny PRM's tokenizer; "dies" cuts batches of one so the others queue behind the first.
async fn server(release: mpsc::Receiver<()>) -> TestServer {
    let model =
        std::path::Path::new(crate::common::REPO).join("tests/fixtures/tiny/qwen2-math-prm");
    let table = |name: &str, extra: &str| {
        format!(
            "[[evaluator]]\nname = \"{name}\"\nkind = \"prm\"\nfamily = \"qwen2-math-prm\"\n\
             model = {:?}\nmax_concurrency = {CALLS}\n{extra}\n",
            model.display().to_string()
        )
    };
    let text = table("dies", "max_batch_size = 1\nmax_wait_ms = 0") + &table("lives", "");
    let config = Config::parse(&text, "test config", &[]).expect("valid config");
    let release = Mutex::new(Some(release));
    let products = retrace::default_loader();
    let loader: retrace::EvaluatorLoader = Arc::new(move |cfg, loaded| {
        let (KindConfig::Prm(prm), "dies") = (&cfg.kind, cfg.name.as_str()) else {
            return products(cfg, loaded);
        };
        let scorer = Dies(Mutex::new(release.lock().unwrap().take().unwrap()));
        let limits = Limits {
            max_tokens: 4096,
            vocab_size: 1 << 20,
            reads_spans: false,
        };
        let prm = PrmEvaluator::with_scorer(&cfg.name, cfg.max_concurrency, prm, scorer, limits)?;
        Ok(Arc::new(prm) as Arc<dyn Evaluator>)
    });
    let s = TestServer::start(config, loader).await;
    s.ready().await;
    s
}

fn call(evaluator: &str) -> tonic::Request<pb::EvaluateRequest> {
    let trace = steps_trace("What is 2 + 3?", &["2 + 3 = 5.", "So the answer is 5."]);
    let mut req = tonic::Request::new(request("r", evaluator, trace));
    req.set_timeout(DEADLINE);
    req
}

async fn health(s: &TestServer, service: &str) -> Option<ServingStatus> {
    let mut client = HealthClient::new(s.channel().await);
    let check = HealthCheckRequest {
        service: service.into(),
    };
    let status = client.check(check).await.ok()?.into_inner().status;
    ServingStatus::try_from(status).ok()
}

async fn gauge(s: &TestServer, name: &str, evaluator: &str) -> f64 {
    sample(&s.scrape().await, name, &[("evaluator", evaluator)]).unwrap_or(f64::NAN)
}

#[tokio::test]
async fn a_dead_model_thread_fails_its_requests_and_only_its_health() {
    let (release, held) = mpsc::channel();
    let s = server(held).await;
    let per_evaluator = retrace::evaluator_service;
    assert_eq!(
        health(&s, &per_evaluator("dies")).await,
        Some(ServingStatus::Serving)
    );

    let client = s.client().await;
    let started = Instant::now();
    let calls: Vec<_> = (0..CALLS)
        .map(|_| {
            let mut c = client.clone();
            tokio::spawn(async move { c.evaluate(call("dies")).await })
        })
        .collect();
    // One in the model's hands, the rest waiting in its queue: then the model dies.
    let (dies, within) = ([("evaluator", "dies")], Duration::from_secs(10));
    s.until_sample("retrace_queue_depth", &dies, (CALLS - 1) as f64, within)
        .await;
    release.send(()).unwrap();
    for c in calls {
        let status = c.await.unwrap().unwrap_err();
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        let message = status.message();
        assert!(
            message.contains("model thread of evaluator \"dies\" died (a bug in the model)"),
            "{message}"
        );
    }
    assert!(started.elapsed() < DEADLINE, "took {:?}", started.elapsed());
    assert_eq!(gauge(&s, "retrace_queue_depth", "dies").await, 0.0);

    // Health names the dead one; the server as a whole leaves rotation, as documented.
    let not_serving = ServingStatus::NotServing;
    let dies_service = per_evaluator("dies");
    let dead = until_health(s.channel().await, &dies_service, not_serving, within);
    assert!(dead.await, "NOT_SERVING for dies");
    assert_eq!(
        health(&s, &per_evaluator("lives")).await,
        Some(ServingStatus::Serving)
    );
    assert_eq!(health(&s, "").await, Some(ServingStatus::NotServing));
    assert_eq!(gauge(&s, "retrace_evaluator_ready", "dies").await, 0.0);
    assert_eq!(gauge(&s, "retrace_evaluator_ready", "lives").await, 1.0);
    let list = client
        .clone()
        .list_evaluators(pb::ListEvaluatorsRequest {})
        .await
        .unwrap()
        .into_inner();
    let ready: Vec<(&str, bool)> = list
        .evaluators
        .iter()
        .map(|e| (e.name.as_str(), e.ready))
        .collect();
    assert_eq!(ready, [("dies", false), ("lives", true)]);

    // The process stays up: the other evaluator answers, the dead one refuses fast, saying why.
    let mut c = client.clone();
    let verdict = c.evaluate(call("lives")).await.unwrap().into_inner();
    assert_eq!(verdict.steps.len(), 2);
    let status = c.evaluate(call("dies")).await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert!(
        status
            .message()
            .contains("evaluator \"dies\" is not ready: the model thread"),
        "{}",
        status.message()
    );
    assert!(!s.handle.is_finished());
    s.stop().await.unwrap();
}
