//! Exactness of the PRM model against the tiny fixtures' float64 numpy reference, batching,
//! chunked attention, sharded checkpoints and the load errors.

use super::*;
use crate::kernels::testing::{Gap, max_gap};
use candle_core::Tensor;
use std::time::Instant;

/// Each row's scores alone, for tests that compare only those.
pub(crate) fn scores(rows: Vec<Row>) -> Vec<Vec<f32>> {
    rows.into_iter().map(|r| r.scores).collect()
}

const FAMILIES: [&str; 5] = [
    "qwen2-math-prm",
    "skywork-prm",
    "math-shepherd",
    "rlhflow",
    "chat-lm",
];

pub(super) struct Case {
    pub(super) ids: Vec<u32>,
    pub(super) positions: Vec<usize>,
    pub(super) scores: Vec<f64>,
}

pub(super) fn fixture(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tiny")
        .join(family)
}

/// The last id of `text` encoded without special tokens, as the formats doc defines `+` / `-`.
fn last_id(tok: &tokenizers::Tokenizer, text: &str) -> u32 {
    *tok.encode(text, false).unwrap().get_ids().last().unwrap()
}

pub(super) fn head_for(family: &str) -> HeadSpec {
    match family {
        "qwen2-math-prm" => HeadSpec::QwenScore,
        "skywork-prm" => HeadSpec::ValueHead,
        _ => {
            let tok =
                tokenizers::Tokenizer::from_file(fixture(family).join("tokenizer.json")).unwrap();
            HeadSpec::LmPair {
                plus: last_id(&tok, "+"),
                minus: last_id(&tok, "-"),
            }
        }
    }
}

pub(super) fn cases(family: &str) -> Vec<Case> {
    let text = std::fs::read_to_string(fixture(family).join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let nums = |x: &serde_json::Value| {
        x.as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_f64().unwrap())
            .collect::<Vec<_>>()
    };
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            ids: nums(&c["input_ids"])
                .into_iter()
                .map(|n| n as u32)
                .collect(),
            positions: nums(&c["score_positions"])
                .into_iter()
                .map(|n| n as usize)
                .collect(),
            scores: nums(&c["scores"]),
        })
        .collect()
}

fn load(family: &str, dtype: DType) -> PrmModel {
    PrmModel::load(&fixture(family), head_for(family), &Device::Cpu, dtype).unwrap()
}

fn score_all(model: &PrmModel, cases: &[Case]) -> Vec<Vec<f32>> {
    let rows: Vec<&[u32]> = cases.iter().map(|c| c.ids.as_slice()).collect();
    let pos: Vec<&[usize]> = cases.iter().map(|c| c.positions.as_slice()).collect();
    model.score(Batch::new(&rows, &pos)).map(scores).unwrap()
}

fn max_diff(got: &[Vec<f32>], want: impl Fn(usize) -> Vec<f64>) -> f64 {
    got.iter()
        .enumerate()
        .map(|(i, g)| {
            let w = want(i);
            assert_eq!(g.len(), w.len(), "case {i}: score count");
            max_gap(g, &w, Gap::Abs)
        })
        .fold(0.0, f64::max)
}

#[test]
fn every_family_matches_the_reference_one_at_a_time_and_batched() {
    for family in FAMILIES {
        let model = load(family, DType::F32);
        let cases = cases(family);
        let t = Instant::now();
        let single: Vec<Vec<f32>> = cases
            .iter()
            .flat_map(|c| score_all(&model, std::slice::from_ref(c)))
            .collect();
        let t_single = t.elapsed();
        let t = Instant::now();
        let batched = score_all(&model, &cases);
        let t_batch = t.elapsed();
        let ref_diff = max_diff(&single, |i| cases[i].scores.clone());
        let batch_diff = max_diff(&batched, |i| single[i].iter().map(|s| *s as f64).collect());
        eprintln!(
            "{family}: max |score - reference| {ref_diff:.2e}, max |batched - single| {batch_diff:.2e}; \
             {} cases, {} tokens: one at a time {t_single:.2?}, one batch {t_batch:.2?}",
            cases.len(),
            cases.iter().map(|c| c.ids.len()).sum::<usize>()
        );
        assert!(ref_diff < 1e-4, "{family}: reference diff {ref_diff}");
        assert!(batch_diff < 1e-5, "{family}: batch diff {batch_diff}");
    }
}

#[test]
fn chunked_attention_is_exact() {
    // math-shepherd has a 16-token sliding window; rlhflow has llama3 RoPE scaling.
    for family in ["math-shepherd", "rlhflow"] {
        let mut model = load(family, DType::F32);
        // One query row per chunk at the largest L in the batch: the smallest possible chunks.
        decoder_mut(&mut model).scores_budget = 1;
        let cases = cases(family);
        let got = score_all(&model, &cases);
        let d = max_diff(&got, |i| cases[i].scores.clone());
        assert!(d < 1e-4, "{family}: chunked diff {d}");
        decoder_mut(&mut model).scores_budget = 4 * 4 * 300 * 37;
        let got = score_all(&model, &cases);
        let d = max_diff(&got, |i| cases[i].scores.clone());
        assert!(d < 1e-4, "{family}: uneven chunk diff {d}");
        // The GPU's query blocks, here on the CPU: whole rows in one chunk.
        decoder_mut(&mut model).scores_budget = crate::decoder::SCORES_BUDGET_BYTES;
        decoder_mut(&mut model).query_block = crate::decoder::QUERY_BLOCK_GPU;
        let got = score_all(&model, &cases);
        let d = max_diff(&got, |i| cases[i].scores.clone());
        assert!(d < 1e-4, "{family}: GPU-sized chunk diff {d}");
    }
}

#[test]
fn positions_come_back_in_the_order_asked() {
    let model = load("qwen2-math-prm", DType::F32);
    let c = &cases("qwen2-math-prm")[1];
    let mut rev = c.positions.clone();
    rev.reverse();
    rev.push(c.positions[0]);
    let got = model
        .score(Batch::new(&[&c.ids, &c.ids[..3]], &[&rev, &[]]))
        .map(scores)
        .unwrap();
    let mut want: Vec<f64> = c.scores.iter().rev().copied().collect();
    want.push(c.scores[0]);
    assert!(max_diff(&got[..1], |_| want.clone()) < 1e-4);
    assert!(got[1].is_empty());
    assert_eq!(
        model
            .score(Batch::new(&[&c.ids], &[&[]]))
            .map(scores)
            .unwrap(),
        vec![Vec::<f32>::new()]
    );
}

#[test]
fn half_precision_runs_close_to_f32() {
    for (family, dtype) in [("qwen2-math-prm", DType::BF16), ("rlhflow", DType::F16)] {
        let model = load(family, dtype);
        let cases = cases(family);
        let d = max_diff(&score_all(&model, &cases), |i| cases[i].scores.clone());
        eprintln!("{family} in {dtype:?}: max |score - reference| {d:.2e}");
        assert!(d < 0.1, "{family} {dtype:?}: {d}");
    }
}

#[test]
fn sharded_checkpoint_loads_like_a_single_file() {
    let src = fixture("rlhflow");
    let dir = std::env::temp_dir().join(format!("retrace-shards-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(src.join("config.json"), dir.join("config.json")).unwrap();
    let tensors =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort();
    let mut map = serde_json::Map::new();
    for (k, part) in names.chunks(names.len().div_ceil(2)).enumerate() {
        let file = format!("model-{:05}-of-00002.safetensors", k + 1);
        let shard: std::collections::HashMap<String, Tensor> = part
            .iter()
            .map(|n| ((*n).clone(), tensors[*n].clone()))
            .collect();
        candle_core::safetensors::save(&shard, dir.join(&file)).unwrap();
        for n in part {
            map.insert((*n).clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();

    let sharded = PrmModel::load(&dir, head_for("rlhflow"), &Device::Cpu, DType::F32).unwrap();
    let cases = cases("rlhflow");
    let d = max_diff(&score_all(&sharded, &cases), |i| cases[i].scores.clone());
    assert!(d < 1e-4, "sharded diff {d}");

    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let err = PrmModel::load(&dir, head_for("rlhflow"), &Device::Cpu, DType::F32)
        .err()
        .unwrap();
    assert!(
        matches!(&err, ModelError::MissingFile(p) if p.ends_with("model-00002-of-00002.safetensors")),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn load_and_input_errors_are_clear() {
    let err = PrmModel::load(
        Path::new("/nonexistent/prm"),
        HeadSpec::ValueHead,
        &Device::Cpu,
        DType::F32,
    )
    .err()
    .unwrap();
    assert!(
        matches!(&err, ModelError::MissingFile(p) if p.ends_with("config.json")),
        "{err}"
    );
    // Qwen score head asked of a checkpoint that has a value head.
    let err = PrmModel::load(
        &fixture("skywork-prm"),
        HeadSpec::QwenScore,
        &Device::Cpu,
        DType::F32,
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("score"), "{err}");
    let err = PrmModel::load(
        &fixture("skywork-prm"),
        HeadSpec::LmPair {
            plus: 1,
            minus: 9999,
        },
        &Device::Cpu,
        DType::F32,
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("9999"), "{err}");

    let model = load("skywork-prm", DType::F32);
    assert_eq!(model.max_positions(), 1024);
    // Both public entry points check their input: `states` (a trainer's) as `score` does.
    let bad = |rows: &[&[u32]], pos: &[&[usize]]| {
        matches!(
            model.score(Batch::new(rows, pos)),
            Err(ModelError::BadInput(_))
        ) && matches!(
            model.states(Batch::new(rows, pos), &[0]),
            Err(ModelError::BadInput(_))
        )
    };
    assert!(bad(&[&[1, 2, 3]], &[&[3]]));
    assert!(bad(&[&[1, 2, 99_999]], &[&[0]]));
    assert!(bad(&[&[1, 2, 3]], &[]));
    assert!(bad(&[&vec![1; 1025]], &[&[0]]));
}

#[test]
fn the_model_can_move_to_and_be_shared_by_a_backend_thread() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<PrmModel>();
}

#[test]
fn a_shared_prefix_is_computed_once_and_exactly() {
    // math-shepherd has a 16-token sliding window (shorter than the shared prefix); rlhflow and
    // chat-lm are what sharing is for (every trace opens with the same chat template text).
    for family in ["math-shepherd", "rlhflow", "chat-lm"] {
        let model = load(family, DType::F32);
        let vocab = model.vocab_size() as u32;
        let prefix: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % vocab).collect();
        let rows: Vec<Vec<u32>> = [25usize, 60, 9]
            .iter()
            .enumerate()
            .map(|(r, &n)| {
                let mut row = prefix.clone();
                row.extend((0..n as u32).map(|i| (i * 13 + 5 + r as u32 * 101) % vocab));
                row
            })
            .collect();
        // Reads after the prefix, one right at its end, and one row whose first read lies
        // inside it (which caps what can be shared).
        let positions: Vec<Vec<usize>> = vec![vec![40, 52, 64], vec![45, 99], vec![30, 48]];
        let refs: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
        let pos: Vec<&[usize]> = positions.iter().map(Vec::as_slice).collect();
        for (take, what) in [(2, "whole prefix shared"), (3, "prefix capped at a read")] {
            let batched = model
                .score(Batch::new(&refs[..take], &pos[..take]))
                .map(scores)
                .unwrap();
            for i in 0..take {
                let alone = model
                    .score(Batch::new(&refs[i..i + 1], &pos[i..i + 1]))
                    .map(scores)
                    .unwrap();
                let d = max_gap(&batched[i], &alone[0], Gap::Abs);
                assert!(d < 1e-5, "{family}, {what}, row {i}: diff {d}");
                assert_eq!(batched[i].len(), positions[i].len());
            }
        }
    }
}

fn with_cache(family: &str, cache_bytes: usize, share: bool) -> PrmModel {
    load(family, DType::F32).with_reuse(Reuse { cache_bytes, share })
}

/// Scores rows with both models; returns the largest difference and the second's rows.
fn compare(
    plain: &PrmModel,
    cached: &PrmModel,
    rows: &[&[u32]],
    pos: &[&[usize]],
) -> (f64, Vec<Row>) {
    let want = plain.score(Batch::new(rows, pos)).unwrap();
    let got = cached.score(Batch::new(rows, pos)).unwrap();
    let mut worst = 0.0f64;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.scores.len(), pos[i].len(), "row {i}: one score per read");
        let len = pos[i].iter().max().map_or(0, |m| m + 1);
        assert_eq!(
            g.tokens.computed + g.tokens.reused,
            len,
            "row {i}: tokens add up"
        );
        worst = worst.max(max_gap(&g.scores, &w.scores, Gap::Abs));
    }
    (worst, got)
}

#[test]
fn the_prefix_cache_is_exact_for_every_family() {
    for family in FAMILIES {
        let plain = with_cache(family, 0, true);
        let cached = with_cache(family, 64 << 20, true);
        let cases = cases(family);
        let mut worst = 0.0f64;
        for c in &cases {
            // Tree search: the trace cut after each step, rescored in order. From the second
            // on, everything up to the previous cut is reused, its reads included.
            for k in 1..=c.positions.len() {
                let ids = &c.ids[..c.positions[k - 1] + 1];
                let (d, rows) = compare(&plain, &cached, &[ids], &[&c.positions[..k]]);
                worst = worst.max(d);
                if k > 1 {
                    assert!(
                        rows[0].tokens.reused > c.positions[k - 2],
                        "{family}: {rows:?}"
                    );
                }
            }
            // A full hit computes nothing and still scores every step.
            let (d, rows) = compare(&plain, &cached, &[&c.ids], &[&c.positions]);
            worst = worst.max(d);
            let last = c.positions.iter().max().unwrap() + 1;
            assert_eq!(rows[0].tokens.computed, 0, "{family}: full hit");
            assert_eq!(rows[0].tokens.reused, last);
            // A divergence in the middle of a step: reused up to it, recomputed after.
            if c.positions.len() >= 2 {
                let mut other = c.ids.clone();
                let at = (c.positions[0] + c.positions[1]) / 2 + 1;
                other[at] = (other[at] + 1) % plain.vocab_size() as u32;
                let (d, rows) = compare(&plain, &cached, &[&other], &[&c.positions]);
                worst = worst.max(d);
                assert_eq!(
                    rows[0].tokens.reused, at,
                    "{family}: reused up to the divergence"
                );
            }
        }
        assert!(worst < 1e-5, "{family}: cache on vs off differs by {worst}");
    }
}

#[test]
fn one_batch_mixes_hits_shared_rows_and_new_rows_exactly() {
    for family in ["qwen2-math-prm", "math-shepherd", "chat-lm"] {
        let cases = cases(family);
        let (a, b) = (&cases[0], &cases[1]);
        for share in [true, false] {
            let plain = with_cache(family, 0, true);
            let cached = with_cache(family, 64 << 20, share);
            // Half of case a is cached first.
            let half = a.positions[a.positions.len() / 2] + 1;
            let n = a.positions.iter().filter(|p| **p < half).count();
            compare(&plain, &cached, &[&a.ids[..half]], &[&a.positions[..n]]);
            // What the next forward would compute of a: the rest past the cached half.
            assert_eq!(cached.uncached_len(&a.ids), a.ids.len() - half, "{family}");
            assert_eq!(plain.uncached_len(&a.ids), a.ids.len());
            // Then, in one batch: a twice (racing for the same prefix), a's cached half alone
            // (a full hit), and b (new).
            let rows: [&[u32]; 4] = [&a.ids, &a.ids, &a.ids[..half], &b.ids];
            let pos: [&[usize]; 4] = [&a.positions, &a.positions, &a.positions[..n], &b.positions];
            let (d, got) = compare(&plain, &cached, &rows, &pos);
            assert!(d < 1e-5, "{family} share={share}: {d}");
            assert_eq!(
                got[2].tokens.computed, 0,
                "{family}: the cached half is a full hit"
            );
            // What the batch captured owns its tokens only: no cached tensor is a view that
            // keeps the batch's keys, values or residual stream alive past the budget.
            let cache = cached.cache.as_ref().unwrap().lock().unwrap();
            assert!(cache.bytes() > 0);
            assert_eq!(cache.held_bytes(), cache.bytes(), "{family} share={share}");
            drop(cache);
            if share {
                // The second copy of a computes nothing: the first computed it for both.
                assert_eq!(got[1].tokens.computed, 0, "{family}: {got:?}");
            } else {
                assert_eq!(got[1].tokens.computed, got[0].tokens.computed);
            }
        }
    }
}

#[test]
fn eviction_keeps_the_budget_and_scores_exact() {
    let family = "rlhflow";
    let cases = cases(family);
    let plain = with_cache(family, 0, true);
    let per_token = plain.cache_bytes_per_token();
    let longest = cases.iter().map(|c| c.ids.len()).max().unwrap();
    // Room for about two traces, and for less than one.
    for budget in [2 * longest * per_token, longest * per_token / 3] {
        let cached = with_cache(family, budget, true);
        let mut worst = 0.0f64;
        for round in 0..2 {
            for c in &cases {
                let (d, _) = compare(&plain, &cached, &[&c.ids], &[&c.positions]);
                worst = worst.max(d);
                let cache = cached.cache_stats().unwrap();
                assert!(
                    cache.bytes <= budget,
                    "round {round}: {} > {budget}",
                    cache.bytes
                );
            }
        }
        assert!(worst < 1e-5, "budget {budget}: {worst}");
        assert!(cached.cache_stats().unwrap().evictions > 0 || budget < longest * per_token);
    }
}

#[test]
fn no_cache_and_no_sharing_compute_every_token() {
    let family = "chat-lm";
    let cases = cases(family);
    let rows: Vec<&[u32]> = cases.iter().map(|c| c.ids.as_slice()).collect();
    let pos: Vec<&[usize]> = cases.iter().map(|c| c.positions.as_slice()).collect();
    let plain = with_cache(family, 0, true);
    let none = with_cache(family, 0, false);
    assert!(plain.cache_stats().is_none());
    let (d, got) = compare(&plain, &none, &rows, &pos);
    assert!(d < 1e-5, "{d}");
    assert!(got.iter().all(|r| r.tokens.reused == 0), "{got:?}");
    // With sharing, chat-lm's rows share the chat template's opening: reused in the batch.
    let shared = plain.score(Batch::new(&rows, &pos)).unwrap();
    assert!(
        shared[1..].iter().all(|r| r.tokens.reused > 0),
        "{shared:?}"
    );
    assert_eq!(shared[0].tokens.reused, 0);
}

fn load_gguf(family: &str, file: &str) -> PrmModel {
    PrmModel::load(
        &fixture(family).join(file),
        head_for(family),
        &Device::Cpu,
        DType::F32,
    )
    .unwrap()
}

#[test]
fn f32_gguf_checkpoints_match_the_reference() {
    // The same numbers in llama.cpp's layout (names, permuted Q/K, rope_freqs, classifier head
    // names): every family scores as the float64 reference does.
    for family in FAMILIES {
        let cases = cases(family);
        let got = score_all(&load_gguf(family, "model.f32.gguf"), &cases);
        let diff = max_diff(&got, |i| cases[i].scores.clone());
        eprintln!("{family}: f32 GGUF, max |score - reference| {diff:.2e}");
        assert!(diff < 1e-4, "{family}: reference diff {diff}");
    }
}

#[test]
fn quantized_gguf_checkpoints_score_close_to_the_reference() {
    // Q8_0 matrices and embedding (activations quantized too), f32 head: close, not equal. The
    // tiny random checkpoints amplify rounding: Q8_0 weights alone, dequantized and run in f32
    // (CANDLE_DEQUANTIZE_ALL=1), moved their scores by 1.3e-2 to 8.1e-2, the quantized path by
    // 2.0e-2 to 7.0e-2.
    for family in FAMILIES {
        let cases = cases(family);
        let got = score_all(&load_gguf(family, "model.q8_0.gguf"), &cases);
        let diff = max_diff(&got, |i| cases[i].scores.clone());
        eprintln!("{family}: Q8_0 GGUF, max |score - reference| {diff:.2e}");
        assert!(
            diff > 0.0,
            "{family}: the quantized path computed nothing different"
        );
        assert!(diff < 0.1, "{family}: reference diff {diff}");
    }
}

#[test]
fn gguf_load_errors_name_the_file_and_what_is_missing() {
    let dir = std::env::temp_dir().join(format!("retrace-gguf-errors-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("not.gguf");
    std::fs::write(&bad, b"GGUF but not really").unwrap();
    let head = || HeadSpec::QwenScore;
    let e = PrmModel::load(&bad, head(), &Device::Cpu, DType::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("not.gguf"), "{e}");
    let missing = dir.join("missing.gguf");
    let e = PrmModel::load(&missing, head(), &Device::Cpu, DType::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("missing file") && e.contains("missing.gguf"),
        "{e}"
    );
    // A Qwen PRM head asked of a checkpoint without one names the tensor.
    let e = PrmModel::load(
        &fixture("chat-lm").join("model.f32.gguf"),
        head(),
        &Device::Cpu,
        DType::F32,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("score.0"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_prefix_cache_poisoned_by_a_panic_is_reported_as_such_not_as_bad_input() {
    let model = with_cache("qwen2-math-prm", 1 << 20, true);
    let cache = model.cache.as_ref().expect("a cache");
    let _ = std::thread::scope(|s| {
        s.spawn(|| {
            let _held = cache.lock().unwrap();
            panic!("a scorer dies holding the cache");
        })
        .join()
    });
    let rows: &[&[u32]] = &[&[1, 2, 3]];
    let err = model.score(Batch::new(rows, &[&[2]])).unwrap_err();
    assert!(matches!(err, ModelError::Poisoned(_)), "{err}");
    assert_eq!(err.to_string(), "the prefix cache was poisoned by a panic");
}

/// A model's own decoder, to set its chunking (a model loaded alone shares it with nobody).
fn decoder_mut(model: &mut PrmModel) -> &mut crate::decoder::Decoder {
    Arc::get_mut(&mut model.decoder).expect("an unshared decoder")
}

/// Scores as bits, row by row.
fn bits(rows: Vec<Row>) -> Vec<Vec<u32>> {
    rows.into_iter()
        .map(|r| r.scores.iter().map(|f| f.to_bits()).collect())
        .collect()
}

#[test]
fn weights_dequantized_once_score_the_same_bits_as_dequantized_per_call() {
    for family in FAMILIES {
        let c = cases(family);
        let rows: Vec<&[u32]> = c.iter().map(|c| c.ids.as_slice()).collect();
        let pos: Vec<&[usize]> = c.iter().map(|c| c.positions.as_slice()).collect();
        let per_call = load_gguf(family, "model.q8_0.gguf");
        let once = load_gguf(family, "model.q8_0.gguf")
            .with_dequantized(usize::MAX)
            .unwrap();
        let want = bits(per_call.score(Batch::new(&rows, &pos)).unwrap());
        assert_eq!(
            bits(once.score(Batch::new(&rows, &pos)).unwrap()),
            want,
            "{family}"
        );
    }
}

#[test]
fn a_gguf_rows_scores_are_the_same_bits_alone_in_a_batch_and_after_a_cached_prefix() {
    // Not merely close: each quantized matmul rounds its activations to 8 bits, which turns a
    // difference in the last bit upstream into a whole quantum now and then.
    for family in FAMILIES {
        for file in ["model.f32.gguf", "model.q8_0.gguf"] {
            let c = cases(family);
            let rows: Vec<&[u32]> = c.iter().map(|c| c.ids.as_slice()).collect();
            let pos: Vec<&[usize]> = c.iter().map(|c| c.positions.as_slice()).collect();
            // Sixteen rows: the cases, and then again, as a batch of repeats and mixed lengths.
            let (rows16, pos16): (Vec<&[u32]>, Vec<&[usize]>) = (0..16)
                .map(|i| (rows[i % rows.len()], pos[i % pos.len()]))
                .unzip();
            let plain = load_gguf(family, file).with_reuse(Reuse {
                cache_bytes: 0,
                share: false,
            });
            let cached = load_gguf(family, file);
            let alone: Vec<Vec<u32>> = (0..rows.len())
                .flat_map(|i| bits(plain.score(Batch::new(&rows[i..=i], &pos[i..=i])).unwrap()))
                .collect();
            let batched = bits(plain.score(Batch::new(&rows16, &pos16)).unwrap());
            let shared = bits(cached.score(Batch::new(&rows16, &pos16)).unwrap());
            // Each case's first half as a prefix the cache keeps, then the whole case after it.
            let halves: Vec<&[u32]> = rows.iter().map(|r| &r[..r.len() / 2]).collect();
            let none: Vec<&[usize]> = vec![&[]; rows.len()];
            cached.score(Batch::new(&halves, &none)).unwrap();
            let after = cached.score(Batch::new(&rows, &pos)).unwrap();
            let reused: usize = after.iter().map(|r| r.tokens.reused).sum();
            let after = bits(after);
            for i in 0..16 {
                let want = &alone[i % rows.len()];
                assert_eq!(
                    &batched[i], want,
                    "{family} {file}: row {i} in a batch of 16"
                );
                assert_eq!(&shared[i], want, "{family} {file}: row {i} shared, cached");
            }
            assert_eq!(after, alone, "{family} {file}: after a cached prefix");
            assert!(reused > 0, "{family} {file}: nothing came from the cache");
        }
    }
}
