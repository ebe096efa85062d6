//! The engine on tokio's paused clock, with a fake evaluator whose work takes a known time:
//! admission by count, the per-evaluator gate, deadlines while queued and while judged, and a
//! request that names no evaluator or one that is not there. Time moves only when every task
//! waits, so each assertion about "when" is exact, not a race against the machine.

use super::*;
use crate::engine::EvaluatorLoadError;
use crate::engine::Sharing;
use crate::engine::{Job, Origin};
use crate::trace::{Judgement, Trace};
use futures::future::BoxFuture;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::time::Instant;

/// Judges any trace after `work`, counting the jobs it started.
struct Slow {
    work: Duration,
    started: Arc<AtomicUsize>,
}

impl Evaluator for Slow {
    fn describe(&self) -> Description {
        Description {
            kind: "prm".into(),
            family: "fake".into(),
            model: "slow".into(),
        }
    }

    fn evaluate(&self, job: Job) -> BoxFuture<'_, Result<crate::trace::Judgement, EngineError>> {
        self.started.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            tokio::time::sleep(self.work).await;
            Ok(Judgement::from_scores(
                vec![0.9; job.trace.steps.len()],
                job.threshold,
            ))
        })
    }
}

fn spec(name: &str, max_concurrency: usize) -> SlotSpec {
    SlotSpec {
        name: name.into(),
        threshold: None,
        aggregate: Aggregate::default(),
        max_steps: 100,
        max_trace_bytes: 1 << 20,
        max_concurrency,
        sharing: Sharing::Batched,
        tier: 0,
        loading: Description {
            kind: "prm".into(),
            family: "fake".into(),
            model: "slow".into(),
        },
    }
}

/// An engine of one evaluator `slow` whose every job takes `work`; the count of jobs started.
async fn engine(
    max_in_flight: usize,
    max_concurrency: usize,
    work: Duration,
) -> (Arc<Engine>, Arc<AtomicUsize>) {
    engine_of(spec("slow", max_concurrency), max_in_flight, work).await
}

/// `engine`, of an evaluator `slow` that `spec` describes.
async fn engine_of(
    spec: SlotSpec,
    max_in_flight: usize,
    work: Duration,
) -> (Arc<Engine>, Arc<AtomicUsize>) {
    let engine = Engine::new(
        vec![spec],
        Admission {
            max_in_flight,
            default: "slow".into(),
        },
    );
    let started = Arc::new(AtomicUsize::new(0));
    let counter = started.clone();
    let loader: LoadByName = Arc::new(move |_, _| {
        Ok(Arc::new(Slow {
            work,
            started: counter.clone(),
        }) as Arc<dyn Evaluator>)
    });
    engine.load(loader).await.unwrap();
    (engine, started)
}

fn request(evaluator: &str, deadline: Option<Duration>) -> Request {
    let now = Instant::now();
    Request {
        evaluator: evaluator.into(),
        trace: Arc::new(Trace::of_steps("q", &["a".into(), "b".into()])),
        threshold: None,
        deadline: deadline.map(|d| now + d),
        arrived: now,
        origin: Origin::fields(FieldPath::key("trace")),
    }
}

#[tokio::test(start_paused = true)]
async fn requests_past_max_in_flight_are_refused_at_once_and_the_rest_served() {
    let (engine, started) = engine(2, 2, Duration::from_secs(1)).await;
    let t0 = Instant::now();
    let (a, b) = (engine.clone(), engine.clone());
    let first = tokio::spawn(async move { a.evaluate(request("", None)).await });
    let second = tokio::spawn(async move { b.evaluate(request("", None)).await });
    tokio::task::yield_now().await;
    let third = engine.evaluate(request("", None)).await;
    assert!(
        matches!(third, Err(EngineError::Overloaded { .. })),
        "{third:?}"
    );
    assert_eq!(Instant::now(), t0, "the refusal waited");
    assert!(first.await.unwrap().is_ok() && second.await.unwrap().is_ok());
    assert_eq!(started.load(Ordering::SeqCst), 2);
    // Both ran at once: max_concurrency 2.
    assert_eq!(Instant::now() - t0, Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn the_gate_queues_past_max_concurrency_and_a_deadline_ends_the_wait_unstarted() {
    let (engine, started) = engine(8, 1, Duration::from_secs(1)).await;
    let t0 = Instant::now();
    let a = engine.clone();
    let first = tokio::spawn(async move { a.evaluate(request("slow", None)).await });
    tokio::task::yield_now().await;
    // Queued behind the first for its whole 1 s of work, with 0.5 s to live.
    let late = engine
        .evaluate(request("slow", Some(Duration::from_millis(500))))
        .await;
    assert!(
        matches!(&late, Err(EngineError::DeadlineExceeded(m)) if m.contains("still queued")),
        "{late:?}"
    );
    assert_eq!(Instant::now() - t0, Duration::from_millis(500));
    assert!(first.await.unwrap().is_ok());
    assert_eq!(
        started.load(Ordering::SeqCst),
        1,
        "the expired request reached the model"
    );
    // A queued request with time to spare waits its turn and is served.
    let b = engine.clone();
    let t1 = Instant::now();
    let one = tokio::spawn(async move { b.evaluate(request("slow", None)).await });
    tokio::task::yield_now().await;
    let two = engine
        .evaluate(request("slow", Some(Duration::from_secs(5))))
        .await;
    assert!(two.is_ok(), "{two:?}");
    assert_eq!(Instant::now() - t1, Duration::from_secs(2));
    assert!(one.await.unwrap().is_ok());
}

#[tokio::test(start_paused = true)]
async fn a_deadline_that_passes_while_judged_is_deadline_exceeded() {
    let (engine, started) = engine(8, 1, Duration::from_secs(3)).await;
    let t0 = Instant::now();
    let r = engine
        .evaluate(request("slow", Some(Duration::from_secs(1))))
        .await;
    assert!(matches!(r, Err(EngineError::DeadlineExceeded(_))), "{r:?}");
    assert_eq!(Instant::now() - t0, Duration::from_secs(1));
    assert_eq!(started.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn an_unknown_evaluator_is_bad_input_naming_the_field_and_the_choices() {
    let (engine, started) = engine(8, 1, Duration::from_secs(1)).await;
    let r = engine.evaluate(request("nope", None)).await;
    match r {
        Err(EngineError::Invalid { field, message }) => {
            assert_eq!(field.to_string(), "evaluator", "{message}");
            assert!(message.contains("slow"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(started.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_failed_load_is_a_load_error_naming_the_evaluator_once() {
    let engine = Engine::new(
        vec![spec("slow", 1)],
        Admission {
            max_in_flight: 8,
            default: "slow".into(),
        },
    );
    // A loader's error says what failed; the load error adds which evaluator, once.
    let loader: LoadByName = Arc::new(|_, _| Err("model /nowhere does not exist".into()));
    let err = engine.load(loader).await.unwrap_err();
    assert_eq!(
        err,
        EvaluatorLoadError {
            evaluator: "slow".into(),
            reason: "model /nowhere does not exist".into(),
        }
    );
    assert_eq!(
        err.to_string(),
        "evaluator \"slow\": model /nowhere does not exist"
    );

    let panics: LoadByName = Arc::new(|_, _| panic!("a loader's bug"));
    let err = engine.load(panics).await.unwrap_err();
    assert_eq!(err.evaluator, "slow");
    assert!(err.reason.starts_with("loading panicked"), "{err}");
}

/// A fake with a calibrated threshold of its own, as a trained head has.
struct Calibrated;

impl Evaluator for Calibrated {
    fn describe(&self) -> Description {
        spec("", 1).loading
    }

    fn threshold(&self) -> Option<f32> {
        Some(0.8)
    }

    fn evaluate(&self, job: Job) -> BoxFuture<'_, Result<Judgement, EngineError>> {
        let scores = vec![0.9; job.trace.steps.len()];
        Box::pin(async move { Ok(Judgement::from_scores(scores, job.threshold)) })
    }
}

#[tokio::test(start_paused = true)]
async fn the_threshold_in_force_is_the_configs_else_the_evaluators_own_else_the_default() {
    let set = SlotSpec {
        threshold: Some(0.3),
        ..spec("set", 1)
    };
    let engine = Engine::new(
        vec![spec("plain", 1), spec("head", 1), set],
        Admission {
            max_in_flight: 8,
            default: "plain".into(),
        },
    );
    let loader: LoadByName = Arc::new(|name, _| match name {
        "plain" => Ok(Arc::new(Slow {
            work: Duration::ZERO,
            started: Arc::default(),
        }) as Arc<dyn Evaluator>),
        _ => Ok(Arc::new(Calibrated) as Arc<dyn Evaluator>),
    });
    engine.load(loader).await.unwrap();
    let thresholds: Vec<(String, f32)> = engine
        .list()
        .into_iter()
        .map(|s| (s.name, s.threshold))
        .collect();
    let expected = [("plain", 0.5), ("head", 0.8), ("set", 0.3)];
    assert_eq!(
        thresholds,
        expected.map(|(n, t)| (n.to_string(), t)).to_vec()
    );
    let verdict = engine.evaluate(request("head", None)).await.unwrap();
    assert_eq!(verdict.threshold, 0.8);
}

#[test]
fn a_wrapped_evaluator_not_loaded_is_named_with_the_key_that_wants_it() {
    let err = wrapped(&Loaded::new(), "judge", "gpt").err().unwrap();
    assert_eq!(err.to_string(), "its judge \"gpt\" is not loaded");
}

#[tokio::test(start_paused = true)]
async fn an_upstream_that_serves_many_at_once_is_not_refused_work_that_would_finish_in_time() {
    // A judge that answers each call in 1 s, 64 at once, and 16 callers with 15 s deadlines:
    // each call takes about 1 s, so none would miss its deadline. A pace that read the
    // upstream as serial (bytes per busy second, measured while one caller warmed it) saw 16
    // calls ahead of each, 16 s of work, and refused about half.
    let judge = SlotSpec {
        sharing: Sharing::Parallel,
        ..spec("slow", 64)
    };
    let (engine, started) = engine_of(judge, 256, Duration::from_secs(1)).await;
    let deadline = Some(Duration::from_secs(15));
    for _ in 0..3 {
        engine.evaluate(request("", deadline)).await.unwrap();
    }
    let callers: Vec<_> = (0..16)
        .map(|_| {
            let engine = engine.clone();
            tokio::spawn(async move {
                let mut refused = Vec::new();
                for _ in 0..6 {
                    if let Err(e) = engine.evaluate(request("", deadline)).await {
                        refused.push(e);
                    }
                }
                refused
            })
        })
        .collect();
    let t0 = Instant::now();
    let refused: Vec<EngineError> = futures::future::join_all(callers)
        .await
        .into_iter()
        .flat_map(|r| r.unwrap())
        .collect();
    assert!(
        refused.is_empty(),
        "{} of 96 refused: {:?}",
        refused.len(),
        refused.first()
    );
    assert_eq!(started.load(Ordering::SeqCst), 3 + 96);
    assert_eq!(
        Instant::now() - t0,
        Duration::from_secs(6),
        "16 at once, 1 s each"
    );
}

#[tokio::test(start_paused = true)]
async fn an_upstream_full_past_its_slots_refuses_what_would_wait_too_long_and_says_when() {
    // Two slots, 1 s a call: with 8 calls admitted, a ninth waits about 4 s for a slot.
    let judge = SlotSpec {
        sharing: Sharing::Parallel,
        ..spec("slow", 2)
    };
    let (engine, _) = engine_of(judge, 256, Duration::from_secs(1)).await;
    engine.evaluate(request("", None)).await.unwrap();
    let queued: Vec<_> = (0..8)
        .map(|_| {
            let engine = engine.clone();
            tokio::spawn(async move { engine.evaluate(request("", None)).await })
        })
        .collect();
    tokio::task::yield_now().await;
    let refused = engine
        .evaluate(request("", Some(Duration::from_secs(2))))
        .await;
    let Err(EngineError::Overloaded { retry_after, .. }) = refused else {
        panic!("{refused:?}");
    };
    let retry_after = retry_after.expect("a measured pace says when to come back");
    assert!(
        retry_after > Duration::ZERO && retry_after <= Duration::from_secs_f64(4.01),
        "{retry_after:?}"
    );
    let later = engine
        .evaluate(request("", Some(Duration::from_secs(10))))
        .await;
    assert!(later.is_ok(), "{later:?}");
    for q in queued {
        q.await.unwrap().unwrap();
    }
}
