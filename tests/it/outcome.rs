//! Outcome reward models (family `outcome-rm`) and the composite kind, on the tiny fixtures: each
//! architecture's ids, read position and score against the independent numpy reference; a served
//! composite over a tiny PRM and a tiny outcome RM answering both over gRPC; and `/get_reward`
//! combining them.

use crate::common::{self, TestServer, request};
use retrace::PrmConfig;
use retrace::PrmEvaluator;
use retrace::pb;
use retrace::{Evaluator, Job};
use retrace::{Family, Formatter};
use retrace::{Step, Trace, UNLOCATED};
use serde::Deserialize;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::sync::Arc;

const ARCHS: [&str; 3] = ["qwen2", "llama", "mistral"];

#[derive(Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    id: String,
    question: String,
    #[serde(default)]
    options: Vec<String>,
    #[serde(default)]
    reference_answer: String,
    steps: Vec<String>,
    #[serde(default)]
    input_ids: Vec<u32>,
    #[serde(default)]
    read_position: usize,
    #[serde(default)]
    score: f64,
    /// The step scores, in a PRM's fixture.
    #[serde(default)]
    scores: Vec<f64>,
}

fn tiny(name: &str) -> PathBuf {
    PathBuf::from(common::REPO)
        .join("tests/fixtures/tiny")
        .join(name)
}

fn fixture(name: &str) -> Fixture {
    let path = tiny(name).join("expected.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

fn trace(c: &Case) -> Trace {
    Trace {
        question: c.question.clone(),
        options: c.options.clone(),
        steps: c
            .steps
            .iter()
            .map(|s| Step {
                text: s.clone(),
                span: None,
            })
            .collect(),
        reference_answer: Some(c.reference_answer.clone()).filter(|r| !r.is_empty()),
    }
}

fn close(got: f32, want: f64, what: &str) {
    assert!(
        (f64::from(got) - want).abs() < 1e-4,
        "{what}: {got} vs {want}"
    );
}

#[tokio::test]
async fn every_architecture_formats_reads_and_scores_as_the_reference() {
    retrace::install_metrics();
    for arch in ARCHS {
        let folder = tiny(&format!("outcome-rm-{arch}"));
        let formatter = Formatter::load(Family::OutcomeRm, &folder).unwrap();
        let cfg = PrmConfig::new(Family::OutcomeRm, folder.display().to_string());
        let evaluator = PrmEvaluator::load(&format!("outcome-{arch}"), 16, &cfg)
            .unwrap_or_else(|e| panic!("{arch}: {e}"));
        for c in fixture(&format!("outcome-rm-{arch}")).cases {
            let what = format!("{arch} {}", c.id);
            let encoded = formatter.encode(&trace(&c)).unwrap();
            assert_eq!(encoded.ids, c.input_ids, "{what}: ids");
            assert_eq!(
                encoded.positions,
                [c.read_position],
                "{what}: read position"
            );
            let job = Job {
                trace: Arc::new(trace(&c)),
                threshold: 0.5,
                deadline: None,
            };
            let j = evaluator.evaluate(job).await.unwrap();
            assert!(j.step_scores.is_empty(), "{what}: no step scores");
            close(j.outcome.expect("an outcome").score, c.score, &what);
            let want = if c.score >= 0.0 { -1 } else { UNLOCATED };
            assert_eq!(j.error_index(), want, "{what}");
        }
    }
}

/// A composite over the tiny qwen2-math-prm (steps) and the tiny Qwen2 outcome RM, with each
/// of them also served alone.
async fn composite_server() -> TestServer {
    let text = format!(
        "[[evaluator]]\nname = \"both\"\nkind = \"composite\"\nsteps = \"steps\"\noutcome = \"rm\"\n\n\
         [[evaluator]]\nname = \"steps\"\nkind = \"prm\"\nfamily = \"qwen2-math-prm\"\nmodel = {:?}\n\n\
         [[evaluator]]\nname = \"rm\"\nkind = \"prm\"\nfamily = \"outcome-rm\"\nmodel = {:?}\n",
        tiny("qwen2-math-prm").display().to_string(),
        tiny("outcome-rm-qwen2").display().to_string(),
    );
    let config = retrace::Config::parse(&text, "test", &[]).unwrap();
    let s = TestServer::start(config, retrace::default_loader()).await;
    s.ready().await;
    s
}

fn pb_trace(c: &Case) -> pb::Trace {
    pb::Trace {
        question: c.question.clone(),
        options: c.options.clone(),
        steps: c.steps.clone(),
        reference_answer: c.reference_answer.clone(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_composite_answers_step_scores_and_the_outcome_score_over_grpc() {
    let s = composite_server().await;
    let mut client = s.client().await;
    let prm = fixture("qwen2-math-prm");
    let rm = fixture("outcome-rm-qwen2");
    for (p, o) in prm.cases.iter().zip(&rm.cases) {
        assert_eq!(p.id, o.id, "the two fixtures hold the same cases");
        let v = client
            .evaluate(request(&p.id, "both", pb_trace(p)))
            .await
            .unwrap()
            .into_inner();
        let scores: Vec<f32> = v.steps.iter().map(|s| s.score).collect();
        assert_eq!(scores.len(), p.scores.len(), "{}", p.id);
        for (got, want) in scores.iter().zip(&p.scores) {
            close(*got, *want, &p.id);
        }
        close(v.outcome_score.expect("outcome_score"), o.score, &p.id);
        let first = p
            .scores
            .iter()
            .position(|s| *s < 0.5)
            .map_or(-1, |k| k as i32);
        assert_eq!(v.first_error_index, first, "{}: the PRM's index", p.id);
        let min = scores.iter().copied().fold(f32::INFINITY, f32::min);
        assert_eq!(v.trace_score, min, "{}: the PRM's min", p.id);
        // The outcome model alone: no steps, its score as the trace score, no step named.
        let alone = client
            .evaluate(request(&p.id, "rm", pb_trace(p)))
            .await
            .unwrap()
            .into_inner();
        assert!(alone.steps.is_empty());
        assert_eq!(alone.outcome_score, v.outcome_score);
        assert_eq!(Some(alone.trace_score), alone.outcome_score);
        assert_eq!(
            alone.first_error_index,
            if o.score >= 0.0 { -1 } else { UNLOCATED }
        );
        // A step PRM alone carries no outcome score.
        let steps = client
            .evaluate(request(&p.id, "steps", pb_trace(p)))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(steps.outcome_score, None);
    }
    let listed = client
        .list_evaluators(pb::ListEvaluatorsRequest {})
        .await
        .unwrap()
        .into_inner();
    let both = listed.evaluators.iter().find(|e| e.name == "both").unwrap();
    assert_eq!(both.kind, "composite");
    assert!(both.ready);
}

async fn post(s: &TestServer, path: &str, body: &Value) -> (u16, Value) {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let r = reqwest::Client::new()
        .post(format!("http://{}{path}", s.http_addr))
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_reward_combines_the_prm_and_the_outcome_model() {
    let s = composite_server().await;
    let (question, response) = (
        "What is 2+3*4?",
        "3*4 = 12.\n\n2+12 = 14.\n\nThe answer is $\\boxed{14}$.",
    );
    let trace = pb::Trace {
        question: question.into(),
        text: response.into(),
        ..Default::default()
    };
    let want = s
        .client()
        .await
        .evaluate(request("ref", "both", trace))
        .await
        .unwrap()
        .into_inner();
    let outcome = want.outcome_score.expect("outcome_score");
    let sigmoid = 1.0 / (1.0 + (-outcome).exp());
    let body = json!({"query": format!("{question}{response}"), "prompts": question});
    for (rule, expected) in [
        ("outcome", outcome),
        ("min_with_outcome", want.trace_score.min(sigmoid)),
        ("trace_score", want.trace_score),
    ] {
        let (status, got) = post(&s, &format!("/get_reward?rule={rule}"), &body).await;
        assert_eq!(status, 200, "{rule}: {got}");
        let reward = got["rewards"].as_f64().unwrap() as f32;
        assert!(
            (reward - expected).abs() < 1e-5,
            "{rule}: {reward} vs {expected}"
        );
    }
    // A rule that reads an outcome score, on an evaluator that gives none: the caller's error.
    let (status, got) = post(&s, "/get_reward?rule=outcome&evaluator=steps", &body).await;
    assert_eq!(status, 400, "{got}");
    let text = got.to_string();
    assert!(
        text.contains("?rule") && text.contains("needs an outcome score"),
        "{text}"
    );
}

/// A Best-of-N data file: two questions, two candidates each, one right and one wrong.
fn best_of_n_data(dir: &std::path::Path) -> PathBuf {
    let prm = fixture("qwen2-math-prm");
    let rows: Vec<Value> = prm.cases[..4]
        .iter()
        .enumerate()
        .map(|(i, c)| {
            json!({"id": format!("c{i}"), "problem": format!("question {}", i / 2),
                   "steps": c.steps, "label": -1, "final_answer_correct": i % 2 == 0})
        })
        .collect();
    let path = dir.join("gsm8k.json");
    std::fs::write(&path, serde_json::to_string(&rows).unwrap()).unwrap();
    path
}

fn connect(config: PathBuf) -> retrace_cli::ConnectOptions {
    retrace_cli::ConnectOptions {
        server: None,
        config: Some(config),
        set: vec![],
        concurrency: 4,
        limit: None,
        skip_bad: false,
        token_env: None,
        ca_cert: None,
        wait_s: 0.0,
        no_progress: true,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eval_tables_best_of_n_by_both_scores_and_calibrate_refuses_an_outcome_model() {
    let dir = std::env::temp_dir().join(format!("retrace-bon-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = dir.join("retrace.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[evaluator]]\nname = \"both\"\nkind = \"composite\"\nsteps = \"steps\"\noutcome = \"rm\"\n\n\
             [[evaluator]]\nname = \"steps\"\nkind = \"prm\"\nfamily = \"qwen2-math-prm\"\nmodel = {:?}\n\n\
             [[evaluator]]\nname = \"rm\"\nkind = \"prm\"\nfamily = \"outcome-rm\"\nmodel = {:?}\n",
            tiny("qwen2-math-prm").display().to_string(),
            tiny("outcome-rm-llama").display().to_string(),
        ),
    )
    .unwrap();
    let data = best_of_n_data(&dir);
    let opts = retrace_cli::EvalOptions {
        data: vec![data.clone()],
        evaluator: Some("both".into()),
        threshold: None,
        out: dir.join("out"),
        connect: connect(cfg.clone()),
    };
    let outcome = retrace_cli::eval(opts).await.unwrap();
    let mut rows = Vec::new();
    retrace_cli::read_rows(&outcome.predictions, |r| rows.push(r)).unwrap();
    assert_eq!(rows.len(), 4);
    rows.sort_by(|a, b| a.id.cmp(&b.id));
    // The share of questions whose highest-scored candidate (by `key`) is the right one.
    let share = |key: &dyn Fn(&retrace_cli::Row) -> f32| {
        let right = rows
            .chunks(2)
            .filter(|pair| {
                let best = if key(&pair[0]) >= key(&pair[1]) {
                    &pair[0]
                } else {
                    &pair[1]
                };
                best.final_answer_correct == Some(true)
            })
            .count();
        100.0 * right as f64 / 2.0
    };
    let table = outcome.analysis.best_of_n.expect("a Best-of-N table");
    assert_eq!((table.questions, table.mixed, table.candidates), (2, 2, 4));
    let by = |prefix: &str| {
        table
            .selectors
            .iter()
            .find(|s| s.selector.starts_with(prefix))
            .unwrap()
            .all
    };
    assert_eq!(by("trace"), share(&|r| r.trace_score.unwrap()));
    assert_eq!(by("outcome"), share(&|r| r.outcome_score.unwrap()));
    assert_eq!((by("random"), by("oracle")), (50.0, 100.0));
    let calibrate = retrace_cli::CalibrateOptions {
        calibrate_on: vec![data],
        test_on: vec![],
        evaluator: vec!["rm".into()],
        per_split: false,
        target_agreement: None,
        target_confidence: None,
        out: dir.join("cal"),
        connect: connect(cfg),
    };
    let err = retrace_cli::calibrate(calibrate).await.unwrap_err();
    assert!(err.to_string().contains("gives no step scores"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
