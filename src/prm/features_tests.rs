//! The extractor against a path that shares none of its batching: the reference's token ids,
//! and the model run on each trace alone, without batching, sharing or cache.

use super::super::format::Family;
use super::*;
use crate::trace::Step;
use candle_core::{DType, Device};
use retrace_model::{Batch, Reuse};
use std::path::{Path, PathBuf};

fn tiny() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny/chat-lm")
}

/// The fixture's traces and the reference's ids for them.
fn cases() -> Vec<(Trace, Vec<u32>)> {
    let text = std::fs::read_to_string(tiny().join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let strings = |x: &serde_json::Value| -> Vec<String> {
        x.as_array()
            .map(|a| a.iter().map(|s| s.as_str().unwrap().to_string()).collect())
            .unwrap_or_default()
    };
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let trace = Trace {
                question: c["question"].as_str().unwrap().to_string(),
                options: strings(&c["options"]),
                steps: strings(&c["steps"])
                    .into_iter()
                    .map(|text| Step { text, span: None })
                    .collect(),
                reference_answer: c["reference_answer"]
                    .as_str()
                    .filter(|r| !r.is_empty())
                    .map(str::to_string),
            };
            let ids = c["input_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|n| n.as_u64().unwrap() as u32)
                .collect();
            (trace, ids)
        })
        .collect()
}

fn extractor(cache_mb: usize, batch_tokens: usize) -> Extractor {
    let mut cfg = PrmConfig::new(Family::ChatLm, tiny().display().to_string());
    cfg.candle.prefix_cache_mb = Some(cache_mb);
    cfg.candle.max_batch_tokens = Some(batch_tokens);
    Extractor::load(&cfg).unwrap()
}

/// The largest |got - want|, element by element; infinite where either side holds a NaN or
/// their lengths differ. `f64::max` drops a NaN operand, so a fold over it would pass NaN
/// features under any tolerance.
fn max_gap(got: &[f32], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    let mut worst = 0.0f64;
    for (&x, &y) in got.iter().zip(want) {
        let d = (x as f64 - y).abs();
        if d.is_nan() {
            return f64::INFINITY;
        }
        worst = worst.max(d);
    }
    worst
}

#[test]
fn max_gap_counts_a_nan_or_a_missing_value_as_infinite() {
    assert_eq!(max_gap(&[1.0, 2.0], &[1.0, 2.5]), 0.5);
    assert_eq!(max_gap(&[f32::NAN], &[1.0]), f64::INFINITY);
    assert_eq!(max_gap(&[1.0], &[f64::NAN]), f64::INFINITY);
    assert_eq!(max_gap(&[1.0], &[1.0, 2.0]), f64::INFINITY);
}

#[test]
fn features_equal_the_model_run_on_each_trace_alone() {
    let cases = cases();
    let traces: Vec<Trace> = cases.iter().map(|(t, _)| t.clone()).collect();
    // Batches of about two traces, through a prefix cache: the second pass reuses the first's.
    let ex = extractor(16, 700);
    let taps = vec![vec![0], vec![1, 2], vec![2, 0, 1]];
    let alone = PrmModel::load(&tiny(), HeadSpec::States, &Device::Cpu, DType::F32)
        .unwrap()
        .with_reuse(Reuse {
            cache_bytes: 0,
            share: false,
        });
    for pass in 0..2 {
        let mut heard = Vec::new();
        let got = ex.extract(&traces, &taps, |p| heard.push(p)).unwrap();
        let mut worst = 0.0f64;
        for ((trace, ids), features) in cases.iter().zip(&got) {
            let e = ex.encode(trace).unwrap();
            assert_eq!(&e.ids, ids, "the reference's ids");
            assert_eq!(features.steps.len(), trace.steps.len());
            let st = &alone
                .states(Batch::new(&[ids], &[&e.positions]), &[0, 1, 2])
                .unwrap()[0];
            for (r, step) in features.steps.iter().enumerate() {
                assert_eq!(step.len(), taps.len());
                for (tap, f) in taps.iter().zip(step) {
                    let mean: Vec<f64> = (0..alone.hidden_size())
                        .map(|i| {
                            tap.iter().map(|&l| st.at(l, r)[i] as f64).sum::<f64>()
                                / tap.len() as f64
                        })
                        .collect();
                    worst = worst.max(max_gap(f, &mean));
                }
            }
        }
        assert!(worst < 1e-5, "pass {pass}: {worst}");
        let last = *heard.last().unwrap();
        assert!(heard.len() > 1, "several batches: {heard:?}");
        assert!(
            heard
                .windows(2)
                .all(|w| w[0].traces_done < w[1].traces_done)
        );
        assert_eq!(
            (last.traces_done, last.traces),
            (traces.len(), traces.len())
        );
        assert_eq!(last.tokens_done, last.tokens);
        if pass == 1 {
            // Tap 0 is the last layer's input, which the cache keeps: a full hit.
            assert_eq!(last.tokens_computed, 0, "{last:?}");
        } else {
            assert!(
                last.tokens_computed < last.tokens,
                "shared openings: {last:?}"
            );
        }
    }
}

#[test]
fn bad_taps_and_traces_are_named() {
    let ex = extractor(0, 8192);
    let (trace, _) = cases().remove(0);
    let err = ex.extract(std::slice::from_ref(&trace), &[vec![1], vec![]], |_| {});
    assert!(
        matches!(err, Err(ExtractError::Tap { tap: 1, .. })),
        "{err:?}"
    );
    let err = ex
        .extract(std::slice::from_ref(&trace), &[vec![3]], |_| {})
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "taps[0]: layer 3 is out of range: the base has 2 decoder layers, so 0..=2 (2 is after \
         the final norm)"
    );
    let mut bad = trace.clone();
    bad.steps[1].text = "a \u{E000} b".into();
    let err = ex.extract(&[trace, bad], &[vec![2]], |_| {}).unwrap_err();
    assert!(
        err.to_string().starts_with("trace 1: trace.steps[1]:"),
        "{err}"
    );
    let mut cfg = PrmConfig::new(PrmKind::Head, tiny().display().to_string());
    cfg.candle.prefix_cache_mb = Some(0);
    assert!(matches!(Extractor::load(&cfg), Err(ExtractError::Load(_))));
}
