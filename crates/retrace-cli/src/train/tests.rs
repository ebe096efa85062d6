//! Known answers: synthetic features where one hidden direction marks the wrong steps (and,
//! for the category head, one more direction per category).

use super::choose::{Candidate, Settings, decide};
use super::fit::Params;
use super::progress::Progress;
use super::select::{CATEGORIES, Problem, TraceRows, fit_step};
use super::taps::Tap;
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng, rngs::StdRng};
use retrace::ErrorCategory;
use retrace_model::HeadKind;

const H: usize = 24;

fn gauss(rng: &mut StdRng) -> f32 {
    // Box-Muller: two uniforms in (0, 1] give one standard normal.
    let u1: f32 = 1.0 - rng.random::<f32>();
    let u2: f32 = rng.random::<f32>();
    (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
}

fn unit(v: Vec<f32>) -> Vec<f32> {
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    v.into_iter().map(|x| x / n).collect()
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (norm(a) * norm(b))
}

/// How wrong steps stand out.
#[derive(Clone, Copy, PartialEq)]
enum Marker {
    /// Shifted by 6 along u: a linear head can find them.
    Linear,
    /// Shifted by +6 or -6 along u at random: the mean does not move, so only a nonlinear head
    /// can find them.
    TwoSided,
    /// Not the wrong step but the one before it is shifted by 6 along u (every error comes
    /// after the first step): only a head that reads the steps before can find them.
    Before,
}

/// Synthetic data: each step's feature is D (z + 6 u [wrong]) + c, z standard normal, D and c
/// per-dimension scales and offsets, so that only standardising recovers the direction; with
/// categories, a first wrong step also moves 4 along its category's own direction.
struct Synthetic {
    traces: Vec<TraceRows>,
    features: Tensor,
    /// The direction that separates wrong from correct steps in feature space: D^-1 u.
    direction: Vec<f32>,
}

fn synthetic(n_traces: usize, seed: u64, marker: Marker, with_categories: bool) -> Synthetic {
    let mut rng = StdRng::seed_from_u64(seed);
    let u = unit((0..H).map(|_| gauss(&mut rng)).collect());
    let u_cat: Vec<Vec<f32>> = (0..3)
        .map(|_| unit((0..H).map(|_| gauss(&mut rng)).collect()))
        .collect();
    let d: Vec<f32> = (0..H).map(|_| rng.random_range(0.5..4.0)).collect();
    let c: Vec<f32> = (0..H).map(|_| rng.random_range(-10.0..10.0)).collect();
    let (mut traces, mut rows) = (Vec::new(), Vec::<f32>::new());
    for i in 0..n_traces {
        let len = rng.random_range(2..8usize);
        let first = usize::from(marker == Marker::Before);
        let label = if rng.random_bool(0.4) {
            -1
        } else {
            rng.random_range(first..len) as i32
        };
        let cat = rng.random_range(0..3usize);
        let category = with_categories.then(|| match label {
            -1 => ErrorCategory::None,
            _ => CATEGORIES[cat + 1],
        });
        for k in 0..len as i32 {
            let wrong = match marker {
                Marker::Before => label >= 0 && k + 1 == label,
                _ => label >= 0 && k >= label,
            };
            let sign = match marker {
                Marker::TwoSided if rng.random_bool(0.5) => -6.0,
                _ => 6.0,
            };
            for j in 0..H {
                let mut z = gauss(&mut rng);
                if wrong {
                    z += sign * u[j];
                }
                if with_categories && k == label {
                    z += 4.0 * u_cat[cat][j];
                }
                rows.push(d[j] * z + c[j]);
            }
        }
        let start = traces.last().map_or(0, |t: &TraceRows| t.start + t.len);
        traces.push(TraceRows {
            split: ["a", "b"][i % 2].into(),
            label,
            category,
            start,
            len,
        });
    }
    let n = rows.len() / H;
    Synthetic {
        traces,
        features: Tensor::from_vec(rows, (n, H), &Device::Cpu).unwrap(),
        direction: unit(u.iter().zip(&d).map(|(u, d)| u / d).collect()),
    }
}

fn params() -> Params {
    Params {
        epochs: 40,
        patience: 6,
        lr: 1e-2,
        weight_decay: 1e-2,
        batch_size: 256,
        seed: 3,
    }
}

fn split(n: usize) -> (Vec<usize>, Vec<usize>) {
    let cut = n * 3 / 4;
    ((0..cut).collect(), (cut..n).collect())
}

#[test]
fn finds_the_direction_that_marks_wrong_steps() {
    let s = synthetic(1200, 11, Marker::Linear, false);
    let (train, dev) = split(s.traces.len());
    let p = Problem {
        traces: &s.traces,
        train: &train,
        dev: &dev,
    };
    let fit = fit_step(&p, &s.features, HeadKind::Logistic, &params(), |_| {}).unwrap();
    assert!(fit.dev_f1 >= 95.0, "dev F1 {}", fit.dev_f1);
    // The weight in feature space: w / scale. Wrong steps lie along +u, so P(correct) falls
    // along it: the learned direction is -w.
    let w: Vec<f32> = fit.fitted.head.params[0]
        .1
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let scale: Vec<f32> = fit.norm.scale.to_vec1().unwrap();
    let learned: Vec<f32> = w.iter().zip(&scale).map(|(w, s)| -w / s).collect();
    let cos = cosine(&learned, &s.direction);
    assert!(cos > 0.9, "cosine {cos}");
}

#[test]
fn the_same_seed_trains_the_same_head() {
    let s = synthetic(300, 5, Marker::Linear, false);
    let (train, dev) = split(s.traces.len());
    let p = Problem {
        traces: &s.traces,
        train: &train,
        dev: &dev,
    };
    let kind = HeadKind::Mlp { hidden: 8 };
    let weights = |seed: u64| {
        let params = Params { seed, ..params() };
        let fit = fit_step(&p, &s.features, kind, &params, |_| {}).unwrap();
        let w: Vec<Vec<f32>> = (fit.fitted.head.params.iter())
            .map(|(_, v)| v.flatten_all().unwrap().to_vec1().unwrap())
            .collect();
        (w, fit.fitted.history.len())
    };
    assert_eq!(weights(1), weights(1));
    assert_ne!(weights(1).0, weights(2).0);
}

fn candidates(s: &Synthetic) -> Vec<Candidate> {
    // A tap of pure noise beside the real one: dev must pick the real one.
    let noise = Tensor::randn(0f32, 1.0, s.features.dims(), &Device::Cpu).unwrap();
    vec![
        Candidate {
            tap: Tap {
                name: "noise".into(),
                parts: vec![vec![1]],
                pools: vec![retrace::Pool::Read],
            },
            rows: noise,
        },
        Candidate {
            tap: Tap {
                name: "real".into(),
                parts: vec![vec![2]],
                pools: vec![retrace::Pool::Read],
            },
            rows: s.features.clone(),
        },
    ]
}

fn settings() -> Settings {
    Settings {
        params: params(),
        mlp_hidden: 16,
        trace_width: 0,
        margin: 1.0,
        force: None,
    }
}

#[test]
fn dev_picks_the_tap_and_keeps_the_logistic_head_on_linear_data() {
    let s = synthetic(800, 21, Marker::Linear, true);
    let (train, dev) = split(s.traces.len());
    let p = Problem {
        traces: &s.traces,
        train: &train,
        dev: &dev,
    };
    let shown = Progress { shown: false };
    let out = decide(&p, &candidates(&s), &settings(), &shown).unwrap();
    assert_eq!(out.tap().name, "real");
    assert!(
        out.taps[0].1.dev_f1 < 60.0,
        "noise {}",
        out.taps[0].1.dev_f1
    );
    assert!(
        out.kept.is_none(),
        "mlp {} logistic {}",
        out.larger[0].dev_f1,
        out.taps[1].1.dev_f1
    );
    assert!(out.threshold.f1 >= 95.0, "{}", out.threshold.f1);
    // The category head names the category of each dev trace's first wrong step.
    let cats = out.categories.as_ref().expect("a category head");
    let (mut hit, mut all) = (0, 0);
    for &i in &dev {
        let t = &s.traces[i];
        if t.label >= 0 {
            all += 1;
            hit += usize::from(Some(cats[t.start + t.label as usize]) == t.category);
        }
    }
    assert!(hit as f64 / all as f64 > 0.9, "{hit}/{all}");
}

#[test]
fn an_mlp_is_kept_where_only_it_can_separate() {
    let s = synthetic(1200, 31, Marker::TwoSided, false);
    let (train, dev) = split(s.traces.len());
    let p = Problem {
        traces: &s.traces,
        train: &train,
        dev: &dev,
    };
    let shown = Progress { shown: false };
    let out = decide(&p, &candidates(&s)[1..], &settings(), &shown).unwrap();
    let mlp = out.larger[0].dev_f1;
    assert_eq!(
        out.kept,
        Some(0),
        "mlp {mlp} logistic {}",
        out.taps[0].1.dev_f1
    );
    assert!(mlp >= 90.0, "{mlp}");
    assert!(out.category.is_none());
}

#[test]
fn a_trace_probe_is_kept_where_only_the_steps_before_tell() {
    let s = synthetic(1200, 41, Marker::Before, false);
    let (train, dev) = split(s.traces.len());
    let p = Problem {
        traces: &s.traces,
        train: &train,
        dev: &dev,
    };
    let shown = Progress { shown: false };
    let settings = Settings {
        trace_width: 8,
        ..settings()
    };
    let out = decide(&p, &candidates(&s)[1..], &settings, &shown).unwrap();
    let f1: Vec<f64> = out.larger.iter().map(|l| l.dev_f1).collect();
    let logistic = out.taps[0].1.dev_f1;
    assert_eq!(
        out.kept,
        Some(1),
        "logistic {logistic}, mlp and trace {f1:?}"
    );
    assert_eq!(out.kind(), HeadKind::Trace { width: 8 });
    assert!(
        f1[1] >= 90.0 && logistic < 60.0 && f1[0] < 60.0,
        "logistic {logistic}, {f1:?}"
    );
    // Forced, the logistic head is kept whatever dev says.
    let forced = Settings {
        force: Some(super::choose::Force::Logistic),
        ..settings
    };
    let out = decide(&p, &candidates(&s)[1..], &forced, &shown).unwrap();
    assert_eq!((out.kept, out.kind()), (None, HeadKind::Logistic));
}

#[test]
fn a_split_calibrated_on_its_own_first_traces_is_scored_on_the_rest() {
    // Split "a": 30 traces whose wrong steps score 0.6 and correct ones 0.9, so only a
    // threshold between the two finds the errors; split "b" has too few traces to calibrate on.
    let (mut traces, mut probs) = (Vec::new(), Vec::new());
    for i in 0..35 {
        let label = if i % 2 == 0 { -1 } else { 1 };
        let start = probs.len();
        probs.extend([0.9f32, if label == 1 { 0.6 } else { 0.9 }, 0.9]);
        let split = if i < 30 { "a" } else { "b" };
        traces.push(TraceRows {
            split: split.into(),
            label,
            category: None,
            start,
            len: 3,
        });
    }
    let p = Problem {
        traces: &traces,
        train: &[],
        dev: &[],
    };
    let all: Vec<usize> = (0..35).collect();
    let own = p.own_thresholds(&all, &probs);
    assert_eq!(own.len(), 1, "{own:?}");
    let a = &own[0];
    assert_eq!((a.split.as_str(), a.traces, a.f1), ("a", 10, 100.0));
    assert!(a.threshold > 0.6 && a.threshold <= 0.9, "{}", a.threshold);
}
