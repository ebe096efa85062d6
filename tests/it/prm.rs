//! PRM exactness: every family's formatting against the independent Python reference (tiny
//! random checkpoints and the real tokenizers), scores to 1e-4, batched against unbatched, one
//! score per step, and the error paths.

use retrace::Env;
use retrace::FieldPath;
use retrace::PrmEvaluator;
use retrace::{DeviceSpec, PrmConfig};
use retrace::{Encoded, Limits, ScoreError, Scorer};
use retrace::{EngineError, Evaluator, Job};
use retrace::{Family, Formatter};
use retrace::{Step, Trace};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

const FAMILIES: &[&str] = &[
    "qwen2-math-prm",
    "skywork-prm",
    "math-shepherd",
    "rlhflow",
    "chat-lm",
];

#[derive(Deserialize)]
struct Fixture {
    cases: Vec<Case>,
    tokenizer_dir: Option<String>,
}

#[derive(Deserialize)]
struct Case {
    id: String,
    question: String,
    #[serde(default)]
    options: Vec<String>,
    #[serde(default)]
    reference_answer: Option<String>,
    steps: Vec<String>,
    input_ids: Vec<u32>,
    score_positions: Vec<usize>,
    #[serde(default)]
    scores: Vec<f64>,
}

fn root() -> PathBuf {
    PathBuf::from(crate::common::REPO)
}

fn read_fixture(path: &Path) -> Fixture {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
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
        reference_answer: c.reference_answer.clone().filter(|r| !r.is_empty()),
    }
}

fn tiny(family: &str) -> PathBuf {
    root().join("tests/fixtures/tiny").join(family)
}

fn prm_table(family: &str, folder: &Path) -> PrmConfig {
    let family = Family::parse(family).unwrap_or_else(|| panic!("{family} is a family"));
    PrmConfig::new(family, folder.display().to_string())
}

fn evaluator(family: &str, folder: &Path, batch: usize) -> PrmEvaluator {
    let mut prm = prm_table(family, folder);
    prm.candle.max_batch_size = Some(batch);
    prm.candle.max_wait_ms = Some(50);
    PrmEvaluator::load(&format!("{family}-{batch}"), 256, &prm)
        .unwrap_or_else(|e| panic!("{family}: {e}"))
}

fn job(t: &Trace) -> Job {
    Job {
        trace: Arc::new(t.clone()),
        threshold: 0.5,
        deadline: None,
    }
}

/// Formats every case of `fixture` with the tokenizer in `dir`: ids and positions exactly, one
/// position per step.
fn assert_formats(family: &str, dir: &Path, fixture: &Fixture) {
    let f = Formatter::load(Family::parse(family).unwrap(), dir).unwrap();
    for c in &fixture.cases {
        let e = f
            .encode(&trace(c))
            .unwrap_or_else(|e| panic!("{family} {}: {e}", c.id));
        assert_eq!(e.ids, c.input_ids, "{family} {}: ids", c.id);
        assert_eq!(
            e.positions, c.score_positions,
            "{family} {}: positions",
            c.id
        );
        assert_eq!(e.positions.len(), c.steps.len());
        assert_spans(family, dir, &e, c);
    }
}

/// Conversation formats mark each step's own tokens: they decode to text holding the step's,
/// and lie after the previous step's read and before the step's own. Others mark none.
fn assert_spans(family: &str, dir: &Path, e: &retrace::Encoded, c: &Case) {
    if !matches!(family, "chat-lm" | "rlhflow") {
        assert_eq!(e.spans, Ok(vec![]), "{family} {}", c.id);
        return;
    }
    assert_eq!(e.marked_spans().len(), c.steps.len(), "{family} {}", c.id);
    let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    for (k, (span, step)) in e.marked_spans().iter().zip(&c.steps).enumerate() {
        let text = tokenizer.decode(&e.ids[span.clone()], false).unwrap();
        assert!(
            text.contains(step.trim()),
            "{family} {} step {k}: {text:?} lacks {step:?}",
            c.id
        );
        let after = if k == 0 { 0 } else { e.positions[k - 1] + 1 };
        assert!(
            span.start >= after && span.end <= e.positions[k],
            "{family} {} step {k}: span {span:?}, reads {:?}",
            c.id,
            e.positions
        );
    }
}

#[test]
fn tiny_fixtures_format_exactly() {
    for family in FAMILIES {
        let fixture = read_fixture(&tiny(family).join("expected.json"));
        assert_formats(family, &tiny(family), &fixture);
    }
}

#[test]
fn real_tokenizers_format_exactly() {
    let cache = Env::process().cache_dir();
    for family in FAMILIES {
        let fixture =
            read_fixture(&root().join(format!("tests/fixtures/real-tokenizers/{family}.json")));
        let dir = cache.join(fixture.tokenizer_dir.as_deref().expect("tokenizer_dir"));
        assert!(
            dir.is_dir(),
            "{} is missing: run scripts/fetch/fetch-tokenizers.sh and scripts/fetch-smollm2.sh --f32",
            dir.display()
        );
        assert_formats(family, &dir, &fixture);
    }
}

#[tokio::test]
async fn tiny_scores_match_the_reference_batched_and_not() {
    let metrics = retrace::install_metrics();
    for family in FAMILIES {
        let fixture = read_fixture(&tiny(family).join("expected.json"));
        let single = evaluator(family, &tiny(family), 1);
        let batched = evaluator(family, &tiny(family), 16);
        let traces: Vec<Trace> = fixture.cases.iter().map(trace).collect();
        let mut alone = Vec::new();
        for (c, t) in fixture.cases.iter().zip(&traces) {
            let j = single.evaluate(job(t)).await.unwrap();
            assert_eq!(
                j.step_scores.len(),
                c.steps.len(),
                "{family} {}: one score per step",
                c.id
            );
            assert_eq!(
                c.scores.len(),
                c.steps.len(),
                "{family} {}: fixture scores",
                c.id
            );
            for (got, want) in j.step_scores.iter().zip(&c.scores) {
                assert!(
                    (*got as f64 - want).abs() < 1e-4,
                    "{family} {}: {got} vs {want}",
                    c.id
                );
            }
            alone.push(j.step_scores);
        }
        // All at once: the batcher packs them into one right-padded batch.
        let together =
            futures::future::join_all(traces.iter().map(|t| batched.evaluate(job(t)))).await;
        for (j, a) in together.into_iter().zip(&alone) {
            let j = j.unwrap();
            assert_eq!(j.step_scores.len(), a.len());
            for (x, y) in j.step_scores.iter().zip(a) {
                assert!((x - y).abs() < 1e-5, "{family}: batched {x} vs alone {y}");
            }
        }
        // Fewer forward passes than traces: they really were batched.
        let text = metrics.render();
        let key = format!("retrace_batch_size_count{{evaluator=\"{family}-16\"}} ");
        let batches: f64 = text
            .lines()
            .find_map(|l| l.strip_prefix(&key))
            .and_then(|v| v.trim().parse().ok())
            .expect("batch size histogram");
        assert!(
            batches < traces.len() as f64,
            "{family}: {batches} batches for {} traces",
            traces.len()
        );
    }
}

#[tokio::test]
async fn over_long_traces_and_tagged_steps_are_refused_by_field() {
    let e = evaluator("chat-lm", &tiny("chat-lm"), 4);
    let long = Trace {
        question: "q".into(),
        options: vec![],
        steps: vec![Step {
            text: "step ".repeat(5000),
            span: None,
        }],
        reference_answer: None,
    };
    match e.evaluate(job(&long)).await {
        Err(EngineError::TooLarge {
            field,
            limit,
            message,
        }) => {
            // The trace itself: the engine names where the caller put it, and which limit.
            assert_eq!(field, FieldPath::root());
            assert_eq!(limit, retrace::Limit::Tokens);
            assert!(message.contains("exceed the model's context"), "{message}");
        }
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    }
    let q = evaluator("qwen2-math-prm", &tiny("qwen2-math-prm"), 4);
    let tagged = Trace {
        question: "q".into(),
        options: vec![],
        steps: vec![
            Step {
                text: "a".into(),
                span: None,
            },
            Step {
                text: "b <extra_0>".into(),
                span: None,
            },
        ],
        reference_answer: None,
    };
    match q.evaluate(job(&tagged)).await {
        Err(EngineError::Invalid { field, .. }) => {
            assert_eq!(field, FieldPath::root().then("steps").at(1))
        }
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    }
}

fn steps(question: &str, texts: &[&str]) -> Trace {
    Trace {
        question: question.into(),
        options: vec![],
        steps: texts
            .iter()
            .map(|t| Step {
                text: t.to_string(),
                span: None,
            })
            .collect(),
        reference_answer: None,
    }
}

/// A step that spells the template's own words ("assistant", "user", "end") is marked in its
/// own user turn, before the turn's end and the assistant's header, not inside them.
#[test]
fn a_step_that_spells_the_templates_words_is_marked_in_its_own_turn() {
    let cache = Env::process().cache_dir();
    for family in ["chat-lm", "rlhflow"] {
        let fixture =
            read_fixture(&root().join(format!("tests/fixtures/real-tokenizers/{family}.json")));
        let dir = cache.join(fixture.tokenizer_dir.as_deref().expect("tokenizer_dir"));
        let f = Formatter::load(Family::parse(family).unwrap(), &dir).unwrap();
        let tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let texts = ["assistant", "user", "end", "a"];
        let e = f.encode(&steps("Which word?", &texts)).unwrap();
        let spans = e.spans.clone().unwrap();
        for (k, (span, text)) in spans.iter().zip(texts).enumerate() {
            let decode = |ids: &[u32]| tokenizer.decode(ids, false).unwrap();
            assert_eq!(
                decode(&e.ids[span.clone()]).trim(),
                text,
                "{family} step {k}"
            );
            // What follows the span up to its read is the turn's end and the assistant's header.
            let tail = decode(&e.ids[span.end..=e.positions[k]]);
            assert!(tail.contains("assistant"), "{family} step {k}: {tail:?}");
        }
    }
}

/// Records what reaches the model; every step scores 0.9.
struct Records(Arc<Mutex<Vec<Encoded>>>);

impl Scorer for Records {
    fn score(&self, batch: &[&Encoded]) -> Result<Vec<retrace_model::Row>, ScoreError> {
        let mut seen = self.0.lock().unwrap();
        seen.extend(batch.iter().map(|&e| e.clone()));
        Ok(crate::common::rows_at(batch, 0.9))
    }
}

/// A head that reads each step's own tokens refuses, by the step's field, the trace whose step
/// the chat template rewrote, before it reaches the batch it would fail for its neighbours.
#[tokio::test]
async fn a_span_head_refuses_alone_a_trace_whose_step_the_template_rewrote() {
    let dir = crate::common::TempDir::new("rewrites");
    for file in ["config.json", "tokenizer.json"] {
        std::fs::copy(tiny("chat-lm").join(file), dir.0.join(file)).unwrap();
    }
    let config = std::fs::read_to_string(tiny("chat-lm").join("tokenizer_config.json")).unwrap();
    let rewrites = config.replace(
        "message['content']",
        "message['content'] | replace('cat', 'dog')",
    );
    assert_ne!(config, rewrites);
    std::fs::write(dir.0.join("tokenizer_config.json"), rewrites).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let mut cfg = prm_table("chat-lm", &dir.0);
    cfg.candle.max_wait_ms = Some(0);
    let limits = Limits {
        max_tokens: 4096,
        vocab_size: 1 << 20,
        reads_spans: true,
    };
    let e = PrmEvaluator::with_scorer("spans", 4, &cfg, Records(seen.clone()), limits).unwrap();
    let rewritten = steps("Pets?", &["a bird", "a cat"]);
    match e.evaluate(job(&rewritten)).await {
        Err(EngineError::Invalid { field, message }) => {
            assert_eq!(field, FieldPath::root().then("steps").at(1));
            assert!(message.contains("rewrote its text"), "{message}");
        }
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    }
    let kept = steps("Pets?", &["a bird", "a fish"]);
    let judged = e.evaluate(job(&kept)).await.unwrap();
    assert_eq!(judged.step_scores, vec![0.9, 0.9]);
    let seen = seen.lock().unwrap();
    assert_eq!(
        seen.len(),
        1,
        "only the trace the template kept reaches the model"
    );
    assert_eq!(seen[0].spans.as_ref().map(Vec::len), Ok(2));
}

#[tokio::test]
async fn an_expired_deadline_is_dropped_before_the_model() {
    let e = evaluator("chat-lm", &tiny("chat-lm"), 4);
    let fixture = read_fixture(&tiny("chat-lm").join("expected.json"));
    let mut j = job(&trace(&fixture.cases[0]));
    j.deadline = Some(tokio::time::Instant::now());
    match e.evaluate(j).await {
        Err(EngineError::DeadlineExceeded(m)) => assert!(m.contains("deadline"), "{m}"),
        other => panic!("expected DEADLINE_EXCEEDED, got {other:?}"),
    }
}

#[test]
fn hub_ids_resolve_through_the_local_cache_only() {
    let hub = std::env::temp_dir().join(format!("retrace-hub-{}", std::process::id()));
    let snapshot = hub.join("models--Org--Tiny/snapshots/abc123");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(hub.join("models--Org--Tiny/refs")).unwrap();
    std::fs::write(hub.join("models--Org--Tiny/refs/main"), "abc123\n").unwrap();
    let env = retrace::Env::fixed([("HF_HUB_CACHE", hub.to_str().unwrap())]);
    let resolve = |model: &str| retrace::resolve_model(model, env.hf_hub_cache().as_deref());
    assert_eq!(resolve("Org/Tiny"), Some(snapshot));
    assert_eq!(resolve("Org/Missing"), None);
    let local = tiny("chat-lm");
    assert_eq!(resolve(local.to_str().unwrap()), Some(local));
    std::fs::remove_dir_all(&hub).unwrap();
}

#[test]
fn load_errors_name_the_problem() {
    let load = |prm: PrmConfig| {
        PrmEvaluator::load("x", 256, &prm)
            .err()
            .unwrap()
            .to_string()
    };
    let err = load(prm_table("chat-lm", Path::new("/nonexistent/model")));
    assert!(
        err.contains("/nonexistent/model") && err.contains("does not exist"),
        "{err}"
    );
    // A family whose format needs what the checkpoint lacks.
    let err = load(prm_table("qwen2-math-prm", &tiny("chat-lm")));
    assert!(err.contains("<extra_0>"), "{err}");
    if !cfg!(feature = "cuda") {
        let mut prm = prm_table("chat-lm", &tiny("chat-lm"));
        prm.candle.device = Some(DeviceSpec::Cuda(0));
        let err = load(prm);
        assert!(err.contains("--features cuda"), "{err}");
    }
}
