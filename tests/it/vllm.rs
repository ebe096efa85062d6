//! PRMs served by vLLM (`backend = "vllm"`), against a fake vLLM server that answers in vLLM's
//! documented shapes with the committed tiny checkpoints' real scores (tests/common/vllm.rs):
//! every family vLLM can serve scores as the same checkpoint does in-process, the token ids sent
//! are the formatter's, and upstream faults (HTTP and socket level) end inside the deadline with
//! a status that says what happened, through the same upstream module as the judges.

use crate::common;

use common::vllm::{FakeVllm, Fault, Pooling};
use common::wire::{Wire, WireUpstream};
use common::{TestServer, evaluate_within, processbench, sample, steps_trace};
use retrace::Config;
use retrace::Trace;
use retrace::pb;
use retrace::{Family, Formatter};
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;
use tonic::Code;

const DEADLINE: Duration = Duration::from_secs(2);
/// Past the deadline, the most a loaded 2-core machine may take to deliver the status.
const SLACK: Duration = Duration::from_secs(3);

#[derive(Deserialize)]
struct Bench {
    id: String,
    problem: String,
    steps: Vec<String>,
}

/// ProcessBench traces cut to four steps each, so the tiny models stay quick.
fn traces(n: usize) -> Vec<Bench> {
    let all: Vec<Bench> =
        serde_json::from_str(&std::fs::read_to_string(processbench("gsm8k")).unwrap()).unwrap();
    all.into_iter()
        .take(n)
        .map(|mut b| {
            b.steps.truncate(4);
            b
        })
        .collect()
}

fn tiny(family: &str) -> PathBuf {
    PathBuf::from(crate::common::REPO).join(format!("tests/fixtures/tiny/{family}"))
}

fn prm_table(name: &str, family: &str, extra: &str) -> String {
    format!(
        "[[evaluator]]\nname = \"{name}\"\nkind = \"prm\"\nfamily = \"{family}\"\nmodel = {:?}\n{extra}\n",
        tiny(family).display().to_string()
    )
}

async fn server(tables: &[String]) -> TestServer {
    let config = Config::parse(&tables.concat(), "test config", &[]).expect("valid config");
    let s = TestServer::start(config, retrace::default_loader()).await;
    s.ready().await;
    s
}

async fn evaluate(
    s: &TestServer,
    evaluator: &str,
    trace: pb::Trace,
) -> Result<pb::EvaluateResponse, tonic::Status> {
    evaluate_within(s, evaluator, trace, DEADLINE, SLACK).await
}

fn short_trace() -> pb::Trace {
    steps_trace("What is 2 + 3?", &["2 + 3 = 5.", "5 is even.", "So 5."])
}

async fn fails(s: &TestServer, evaluator: &str, code: Code, needles: &[&str]) {
    let status = evaluate(s, evaluator, short_trace()).await.unwrap_err();
    println!("{evaluator}: {:?}: {}", status.code(), status.message());
    assert_eq!(status.code(), code, "{status:?}");
    for needle in needles {
        assert!(
            status.message().contains(needle),
            "{needle:?} not in {:?}",
            status.message()
        );
    }
}

/// Scores every trace through the in-process evaluator and each remote one; the remote scores
/// must be the in-process ones (same checkpoint, same tokens), and the ids vLLM got the
/// formatter's.
async fn same_as_in_process(family: Family, remotes: &[(&str, &FakeVllm, &str)]) {
    let name = family.as_str();
    let mut tables = vec![prm_table("local", name, "")];
    for (evaluator, fake, extra) in remotes {
        tables.push(prm_table(
            evaluator,
            name,
            &format!(
                "backend = \"vllm\"\n[evaluator.vllm]\nbase_url = \"{}\"\n{extra}",
                fake.base_url()
            ),
        ));
    }
    let s = server(&tables).await;
    let formatter = Formatter::load(family, &tiny(name)).unwrap();
    let bench = traces(6);
    let mut compared = 0;
    for (i, b) in bench.iter().enumerate() {
        let steps: Vec<&str> = b.steps.iter().map(String::as_str).collect();
        let local = evaluate(&s, "local", steps_trace(&b.problem, &steps))
            .await
            .unwrap();
        let want_ids = formatter
            .encode(&Trace::of_steps(&b.problem, &b.steps))
            .unwrap()
            .ids;
        for (evaluator, fake, _) in remotes {
            let remote = evaluate(&s, evaluator, steps_trace(&b.problem, &steps))
                .await
                .unwrap_or_else(|e| panic!("{name} {evaluator} {}: {e:?}", b.id));
            assert_eq!(remote.steps.len(), b.steps.len(), "one score per step");
            for (a, r) in local.steps.iter().zip(&remote.steps) {
                let (a, r) = (a.score, r.score);
                assert!(
                    (a - r).abs() < 1e-5,
                    "{name} {evaluator} {}: {a} vs {r}",
                    b.id
                );
            }
            assert_eq!(local.first_error_index, remote.first_error_index);
            let body = &fake.bodies()[i];
            let sent: Vec<u32> = body
                .get("input")
                .or_else(|| body.get("prompt"))
                .and_then(|v| serde_json::from_value(v.clone()).ok())
                .unwrap();
            // The completions route sends one token more (see request_body): only ids before it.
            assert_eq!(
                &sent[..want_ids.len()],
                want_ids.as_slice(),
                "{name} {evaluator}"
            );
            compared += 1;
        }
    }
    assert_eq!(compared, bench.len() * remotes.len());
    let metrics = s.scrape().await;
    for (evaluator, _, _) in remotes {
        let ok = sample(
            &metrics,
            "retrace_prm_upstream_requests_total",
            &[("evaluator", *evaluator), ("outcome", "ok")],
        );
        assert_eq!(ok, Some(6.0), "{evaluator}");
    }
    s.stop().await.unwrap();
}

#[tokio::test]
async fn qwen_prm_through_step_and_all_pooling_scores_as_in_process() {
    let folder = tiny("qwen2-math-prm");
    let formatter = Formatter::load(Family::QwenMathPrm, &folder).unwrap();
    let tag = formatter
        .encode(&Trace::of_steps("q", &["a".to_string()]))
        .map(|e| e.ids[e.positions[0]])
        .unwrap();
    let step = FakeVllm::start(Family::QwenMathPrm, &folder, Pooling::Step { tag }).await;
    let all = FakeVllm::start(Family::QwenMathPrm, &folder, Pooling::All).await;
    same_as_in_process(
        Family::QwenMathPrm,
        &[("step", &step, "served_model = \"prm\""), ("all", &all, "")],
    )
    .await;
    let body = &step.bodies()[0];
    assert_eq!(body["task"], "token_classify");
    assert_eq!(body["model"], "prm");
    assert!(
        all.bodies()[0].get("model").is_none(),
        "no served_model: no model field"
    );
}

#[tokio::test]
async fn causal_lm_families_through_prompt_logprobs_score_as_in_process() {
    for family in [Family::MathShepherd, Family::Rlhflow, Family::ChatLm] {
        let fake = FakeVllm::start(family, &tiny(family.as_str()), Pooling::All).await;
        // Metrics are the process's: one name per family keeps each server's counts apart.
        let name = format!("remote-{}", family.as_str());
        same_as_in_process(family, &[(&name, &fake, "top_logprobs = 3")]).await;
        assert_eq!(fake.bodies()[0]["prompt_logprobs"], 3);
    }
}

/// A qwen2-math-prm evaluator named `name` (metrics are the process's: one name per test) on a
/// fake vLLM whose faults the test scripts.
async fn faulty(name: &str, extra: &str) -> (FakeVllm, TestServer) {
    let folder = tiny("qwen2-math-prm");
    let fake = FakeVllm::start(Family::QwenMathPrm, &folder, Pooling::All).await;
    let s = server(&[prm_table(
        name,
        "qwen2-math-prm",
        &format!(
            "backend = \"vllm\"\n[evaluator.vllm]\nbase_url = \"{}/v1\"\n{extra}",
            fake.base_url()
        ),
    )])
    .await;
    (fake, s)
}

#[tokio::test]
async fn overload_and_server_errors_are_retried_within_the_deadline() {
    let (fake, s) = faulty("v-retry", "retries = 3\nbreaker_failures = 100").await;
    fake.script([
        Fault::Status(503, None, "The engine is starting"),
        Fault::Status(429, Some("0.1"), "Too many requests"),
    ]);
    let r = evaluate(&s, "v-retry", short_trace()).await.unwrap();
    assert_eq!(r.steps.len(), 3);
    assert_eq!(fake.hits(), 3, "two failures, then the reply");
    let m = s.scrape().await;
    let retried = |cause| {
        sample(
            &m,
            "retrace_prm_upstream_retries_total",
            &[("evaluator", "v-retry"), ("cause", cause)],
        )
    };
    assert_eq!(
        (retried("http_5xx"), retried("http_4xx")),
        (Some(1.0), Some(1.0))
    );
    s.stop().await.unwrap();
}

#[tokio::test]
async fn a_refused_request_and_unreadable_replies_say_why_and_are_not_retried() {
    let (fake, s) = faulty("v", "retries = 3\nbreaker_failures = 100").await;
    fake.script([Fault::Status(
        400,
        None,
        "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens",
    )]);
    fails(
        &s,
        "v",
        Code::Unavailable,
        &[
            "\"v\" on vLLM",
            "HTTP 400",
            "maximum context length",
            "after 1 attempt",
        ],
    )
    .await;
    fake.script([Fault::MissingRow]);
    fails(
        &s,
        "v",
        Code::Unavailable,
        &["not a vLLM pooling response", "rows for 3 steps"],
    )
    .await;
    fake.script([Fault::Logits]);
    fails(
        &s,
        "v",
        Code::Unavailable,
        &["not two probabilities", "use_activation"],
    )
    .await;
    assert_eq!(fake.hits(), 3, "none of them is retried");
    s.stop().await.unwrap();
}

#[tokio::test]
async fn the_breaker_opens_after_consecutive_failures_and_refuses_at_once() {
    let (fake, s) = faulty(
        "v-breaker",
        "retries = 0\nbreaker_failures = 2\nbreaker_cooldown_s = 30",
    )
    .await;
    let state = &[("evaluator", "v-breaker")];
    let breaker = |m: &str| sample(m, "retrace_prm_upstream_breaker_state", state);
    assert_eq!(
        breaker(&s.scrape().await),
        Some(0.0),
        "closed from the start"
    );
    fake.script([
        Fault::Status(500, None, "boom"),
        Fault::Status(500, None, "boom"),
    ]);
    fails(&s, "v-breaker", Code::Unavailable, &["HTTP 500", "boom"]).await;
    fails(&s, "v-breaker", Code::Unavailable, &["HTTP 500"]).await;
    fails(
        &s,
        "v-breaker",
        Code::Unavailable,
        &["circuit breaker open"],
    )
    .await;
    assert_eq!(fake.hits(), 2, "the open breaker sends nothing");
    let m = s.scrape().await;
    assert_eq!(breaker(&m), Some(2.0), "open");
    assert_eq!(
        sample(
            &m,
            "retrace_prm_upstream_breaker_opened_total",
            &[("evaluator", "v-breaker")]
        ),
        Some(1.0)
    );
    s.stop().await.unwrap();
}

async fn wire_server(name: &str, up: &WireUpstream, extra: &str) -> TestServer {
    // The wire upstream answers any path; base_url is its root.
    let base = up.base_url();
    let base = base.trim_end_matches("/v1");
    server(&[prm_table(
        name,
        "qwen2-math-prm",
        &format!("backend = \"vllm\"\n[evaluator.vllm]\nbase_url = \"{base}\"\n{extra}"),
    )])
    .await
}

#[tokio::test]
async fn socket_faults_end_inside_the_deadline_and_leave_no_connection_open() {
    // The last reply is well-formed HTTP, so its connection stays pooled until the server stops.
    let embedding = r#"{"object":"list","data":[{"index":0,"object":"pooling","data":[0.5,0.5]}]}"#;
    let cases: [(Wire, Code, &[&str], bool); 4] = [
        (
            Wire::Silent,
            Code::DeadlineExceeded,
            &["did not answer in time"],
            true,
        ),
        (
            Wire::Stall,
            Code::DeadlineExceeded,
            &["stalled mid-reply"],
            true,
        ),
        (
            Wire::Flood(50 << 20),
            Code::Unavailable,
            &["over 4 MiB"],
            true,
        ),
        (
            Wire::Json(embedding.into()),
            Code::Unavailable,
            &["not a list of rows"],
            false,
        ),
    ];
    for (i, (wire, code, needles, closes)) in cases.into_iter().enumerate() {
        let up = WireUpstream::start(wire).await;
        let name = format!("w{i}");
        let s = wire_server(&name, &up, "retries = 3").await;
        fails(&s, &name, code, needles).await;
        assert_eq!(up.requests(), 1, "{name}: not retried");
        if closes {
            assert!(
                up.wait_closed(Duration::from_secs(3)).await,
                "{name}: {} connection(s) left open",
                up.open()
            );
        }
        s.stop().await.unwrap();
        assert!(
            up.wait_closed(Duration::from_secs(3)).await,
            "{name}: open after stop"
        );
    }
    let up = WireUpstream::start(Wire::Reset).await;
    let s = wire_server("reset", &up, "retries = 2\nbreaker_failures = 100").await;
    fails(&s, "reset", Code::Unavailable, &["after 3 attempt(s)"]).await;
    assert_eq!(up.requests(), 3, "a reset is retried");
    s.stop().await.unwrap();
}
