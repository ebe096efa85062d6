//! Hidden states at the reads (`PrmModel::states`) and trained heads over them: each tapped
//! layer checked against a path that does not tap (the LM pair's reference scores, a model cut
//! at that layer, one trace alone without batching or cache), and a trained head's scores
//! recomputed here from the states and its weights.

use super::tests::{Case, cases, fixture, head_for};
use super::*;
use crate::head::{HeadKind, Pool, TrainedSpec, average_states};
use crate::kernels::testing::{Gap, max_gap};
use crate::spans::{Span, span_reads};
use candle_core::Tensor;
use std::collections::HashMap;

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("retrace-taps-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The chat-lm fixture with `n` layers: its own first ones, then copies of its last.
fn with_layers(n: usize, name: &str) -> PathBuf {
    let src = fixture("chat-lm");
    let dir = temp(name);
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let have = config["num_hidden_layers"].as_u64().unwrap() as usize;
    config["num_hidden_layers"] = n.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let tensors =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut out = HashMap::new();
    for (name, t) in &tensors {
        match name.strip_prefix("model.layers.") {
            None => {
                out.insert(name.clone(), t.clone());
            }
            Some(rest) => {
                let (layer, tail) = rest.split_once('.').unwrap();
                let layer: usize = layer.parse().unwrap();
                for to in 0..n {
                    if to.min(have - 1) == layer {
                        out.insert(format!("model.layers.{to}.{tail}"), t.clone());
                    }
                }
            }
        }
    }
    candle_core::safetensors::save(&out, dir.join("model.safetensors")).unwrap();
    dir
}

fn states_model(folder: &Path) -> PrmModel {
    PrmModel::load(folder, HeadSpec::States, &Device::Cpu, DType::F32).unwrap()
}

fn rows_of(cases: &[Case]) -> (Vec<&[u32]>, Vec<&[usize]>) {
    cases
        .iter()
        .map(|c| (c.ids.as_slice(), c.positions.as_slice()))
        .unzip()
}

fn tensor(path: &Path, name: &str) -> Vec<f32> {
    let t = candle_core::safetensors::load(path, &Device::Cpu).unwrap();
    t[name].flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn the_top_taps_are_what_the_lm_head_reads() {
    let folder = fixture("chat-lm");
    let model = states_model(&folder);
    let n = model.num_layers();
    let cases = cases("chat-lm");
    let (rows, pos) = rows_of(&cases);
    let got = model.states(Batch::new(&rows, &pos), &[n - 1, n]).unwrap();
    let weights = folder.join("model.safetensors");
    let embed = tensor(&weights, "model.embed_tokens.weight");
    let norm = tensor(&weights, "model.norm.weight");
    let h = model.hidden_size();
    let HeadSpec::LmPair { plus, minus } = head_for("chat-lm") else {
        unreachable!()
    };
    let row = |id: u32| &embed[id as usize * h..(id as usize + 1) * h];
    let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let (mut ref_diff, mut norm_diff) = (0.0f64, 0.0f64);
    for (c, states) in cases.iter().zip(&got) {
        for (r, want) in c.scores.iter().enumerate() {
            // The tied LM head's '+' against '-' on the final tap: the numpy reference's score.
            let last: &[f32] = states.at(1, r);
            let (lp, lm): (f64, f64) = (dot(last, row(plus)), dot(last, row(minus)));
            let p = 1.0 / (1.0 + (lm - lp).exp());
            ref_diff = ref_diff.max(max_gap(&[p], &[*want], Gap::Abs));
            // The final tap is the last layer's output through the RMS norm.
            let below = states.at(0, r);
            let ms = below.iter().map(|v| *v as f64 * *v as f64).sum::<f64>() / h as f64;
            let inv = 1.0 / (ms + 1e-5).sqrt();
            let normed: Vec<f32> = below
                .iter()
                .zip(&norm)
                .map(|(v, w)| (*v as f64 * inv * *w as f64) as f32)
                .collect();
            norm_diff = norm_diff.max(max_gap(&normed, last, Gap::Abs));
        }
    }
    assert!(
        ref_diff < 1e-4,
        "final tap vs the reference scores: {ref_diff}"
    );
    assert!(
        norm_diff < 1e-5,
        "final tap vs the norm of the one below: {norm_diff}"
    );
}

#[test]
fn a_tap_below_the_last_layer_is_the_output_of_a_model_cut_there() {
    let deep = states_model(&with_layers(3, "deep"));
    let cut1 = states_model(&with_layers(1, "cut1"));
    let cut2 = states_model(&fixture("chat-lm"));
    let cases = cases("chat-lm");
    let (rows, pos) = rows_of(&cases);
    // Layer 0 of three is taken from the stream as it passes; a one-layer model's layer 0
    // is its last layer's output, run at the reads only. Layer 1 of three is the last
    // layer's input; of two, the last layer's output.
    let batched = deep.states(Batch::new(&rows, &pos), &[0, 1]).unwrap();
    let mut d = 0.0f64;
    for (i, b) in batched.iter().enumerate() {
        let one = |m: &PrmModel, layer| {
            m.states(Batch::new(&rows[i..=i], &pos[i..=i]), &[layer])
                .unwrap()
        };
        d = d.max(max_gap(&b.layers[0], &one(&cut1, 0)[0].layers[0], Gap::Abs));
        d = d.max(max_gap(&b.layers[1], &one(&cut2, 1)[0].layers[0], Gap::Abs));
        assert_eq!(b.layers[0].len(), pos[i].len() * deep.hidden_size());
    }
    assert!(d < 1e-5, "deep taps vs cut models: {d}");
    let err = deep.states(Batch::new(&rows, &pos), &[4]).unwrap_err();
    assert!(err.to_string().contains("layer 4 is out of range"), "{err}");
}

#[test]
fn taps_through_the_cache_and_sharing_equal_one_trace_alone() {
    let folder = with_layers(3, "cached");
    let alone = states_model(&folder).with_reuse(Reuse {
        cache_bytes: 0,
        share: false,
    });
    let cached = states_model(&folder).with_reuse(Reuse {
        cache_bytes: 64 << 20,
        share: true,
    });
    let cases = cases("chat-lm");
    let (rows, pos) = rows_of(&cases);
    for (layers, deep) in [(vec![0, 2, 3], true), (vec![1, 2, 3], false)] {
        for round in 0..2 {
            let got = cached.states(Batch::new(&rows, &pos), &layers).unwrap();
            for (i, g) in got.iter().enumerate() {
                let want = &alone
                    .states(Batch::new(&rows[i..=i], &pos[i..=i]), &layers)
                    .unwrap()[0];
                for (l, layer) in layers.iter().enumerate() {
                    let d = max_gap(&g.layers[l], &want.layers[l], Gap::Abs);
                    assert!(
                        d < 1e-5,
                        "layers {layers:?} round {round} row {i} layer {layer}: {d}"
                    );
                }
                let first = *pos[i].iter().min().unwrap();
                if round == 1 && deep {
                    // Reused only up to the first read, which the cache holds no layer 0 of.
                    assert!(
                        g.tokens.reused > 0 && g.tokens.reused <= first,
                        "{:?}",
                        g.tokens
                    );
                }
                if round == 1 && !deep {
                    assert_eq!(g.tokens.computed, 0, "a full hit: {:?}", g.tokens);
                }
            }
        }
    }
}

/// Deterministic values in [-1, 1).
fn noise(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A head's tensors: logistic, or an MLP with `m` hidden units; with `k` categories.
fn head_tensors(h: usize, m: Option<usize>, k: usize) -> HashMap<String, Vec<f32>> {
    let mut t = HashMap::new();
    t.insert("norm.mean".to_string(), noise(1, h));
    let scale = noise(2, h).iter().map(|v| 0.5 + v.abs()).collect();
    t.insert("norm.scale".to_string(), scale);
    match m {
        None => {
            t.insert("step.weight".into(), noise(3, h));
            t.insert("step.bias".into(), vec![0.25]);
        }
        Some(m) => {
            t.insert("step.0.weight".into(), noise(4, m * h));
            t.insert("step.0.bias".into(), noise(5, m));
            t.insert("step.2.weight".into(), noise(6, m));
            t.insert("step.2.bias".into(), vec![-0.1]);
        }
    }
    if k > 0 {
        t.insert("category.weight".into(), noise(7, k * h));
        t.insert("category.bias".into(), noise(8, k));
    }
    t
}

fn write_head(dir: &Path, t: &HashMap<String, Vec<f32>>, shapes: &[(&str, Vec<usize>)]) {
    let tensors: HashMap<String, Tensor> = shapes
        .iter()
        .filter(|(name, _)| t.contains_key(*name))
        .map(|(name, shape)| {
            let v = Tensor::from_vec(t[*name].clone(), shape.as_slice(), &Device::Cpu).unwrap();
            (name.to_string(), v)
        })
        .collect();
    candle_core::safetensors::save(&tensors, dir.join("head.safetensors")).unwrap();
}

fn shapes(h: usize, m: usize, k: usize) -> Vec<(&'static str, Vec<usize>)> {
    vec![
        ("norm.mean", vec![h]),
        ("norm.scale", vec![h]),
        ("step.weight", vec![1, h]),
        ("step.bias", vec![1]),
        ("step.0.weight", vec![m, h]),
        ("step.0.bias", vec![m]),
        ("step.2.weight", vec![1, m]),
        ("step.2.bias", vec![1]),
        ("category.weight", vec![k, h]),
        ("category.bias", vec![k]),
    ]
}

/// The head's arithmetic, in f64, from the contract: p = sigmoid(step(x)), x standardised.
fn expected(
    t: &HashMap<String, Vec<f32>>,
    f: &[f32],
    m: Option<usize>,
    k: usize,
) -> (f64, Vec<f64>) {
    let h = f.len();
    let x: Vec<f64> = (0..h)
        .map(|i| (f[i] as f64 - t["norm.mean"][i] as f64) / t["norm.scale"][i] as f64)
        .collect();
    let affine =
        |w: &[f32], b: f32| x.iter().zip(w).map(|(a, w)| a * *w as f64).sum::<f64>() + b as f64;
    let z = match m {
        None => affine(&t["step.weight"], t["step.bias"][0]),
        Some(m) => {
            let hidden: Vec<f64> = (0..m)
                .map(|j| {
                    affine(&t["step.0.weight"][j * h..(j + 1) * h], t["step.0.bias"][j]).max(0.0)
                })
                .collect();
            let w2 = &t["step.2.weight"];
            hidden
                .iter()
                .zip(w2)
                .map(|(a, w)| a * *w as f64)
                .sum::<f64>()
                + t["step.2.bias"][0] as f64
        }
    };
    let logits: Vec<f64> = (0..k)
        .map(|c| {
            affine(
                &t["category.weight"][c * h..(c + 1) * h],
                t["category.bias"][c],
            )
        })
        .collect();
    let top = logits.iter().copied().fold(f64::MIN, f64::max);
    let sum: f64 = logits.iter().map(|l| (l - top).exp()).sum();
    (
        1.0 / (1.0 + (-z).exp()),
        logits.iter().map(|l| (l - top).exp() / sum).collect(),
    )
}

#[test]
fn a_trained_head_scores_sigmoid_of_its_weights_on_the_averaged_taps() {
    let folder = fixture("chat-lm");
    let plain = states_model(&folder);
    let h = plain.hidden_size();
    let cases = cases("chat-lm");
    let (rows, pos) = rows_of(&cases);
    let layers = vec![0, 2];
    let states = plain.states(Batch::new(&rows, &pos), &layers).unwrap();
    // Groups as indices into `layers`: one mean, and two means concatenated (2H wide).
    let mean: &[&[usize]] = &[&[0, 1]];
    let concat: &[&[usize]] = &[&[1], &[0, 1]];
    for (groups, m, k) in [
        (mean, None, 0),
        (mean, Some(8), 4),
        (concat, None, 0),
        (concat, Some(8), 4),
    ] {
        let d = h * groups.len();
        let dir = temp(&format!("head-{k}-{}", groups.len()));
        let t = head_tensors(d, m, k);
        write_head(&dir, &t, &shapes(d, m.unwrap_or(0), k));
        let spec = TrainedSpec {
            dir: dir.clone(),
            groups: groups
                .iter()
                .map(|g| g.iter().map(|&i| layers[i]).collect())
                .collect(),
            hidden_size: h,
            pools: Vec::new(),
            kind: m.map_or(HeadKind::Logistic, |hidden| HeadKind::Mlp { hidden }),
            categories: k,
        };
        let model = PrmModel::load(&folder, HeadSpec::Trained(spec), &Device::Cpu, DType::F32)
            .unwrap()
            .with_reuse(Reuse {
                cache_bytes: 16 << 20,
                share: true,
            });
        let (mut d, mut dc) = (0.0f64, 0.0f64);
        for _round in 0..2 {
            let got = model.score(Batch::new(&rows, &pos)).unwrap();
            for (row, st) in got.iter().zip(&states) {
                assert_eq!(
                    row.categories.len(),
                    if k > 0 { row.scores.len() } else { 0 }
                );
                for (r, p) in row.scores.iter().enumerate() {
                    let f: Vec<f32> = groups
                        .iter()
                        .flat_map(|g| {
                            average_states(&g.iter().map(|&l| st.at(l, r)).collect::<Vec<_>>())
                        })
                        .collect();
                    let (want, cats) = expected(&t, &f, m, k);
                    d = d.max(max_gap(&[*p], &[want], Gap::Abs));
                    let got = row.categories.get(r).map_or(&[][..], Vec::as_slice);
                    dc = dc.max(max_gap(got, &cats, Gap::Abs));
                }
            }
        }
        assert!(
            d < 1e-5,
            "head {m:?} groups {groups:?}: scores differ by {d}"
        );
        assert!(
            dc < 1e-5,
            "head {m:?} groups {groups:?}: categories differ by {dc}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_span_head_scores_the_mean_over_each_steps_tokens_beside_the_read() {
    let folder = fixture("chat-lm");
    let plain = states_model(&folder);
    let h = plain.hidden_size();
    let cases = cases("chat-lm");
    let (rows, pos) = rows_of(&cases);
    // Each step's span: the tokens after the previous read up to its own (the first step's
    // from halfway to its read), as a format would mark its text.
    let spans: Vec<Vec<Span>> = pos
        .iter()
        .map(|p| {
            p.iter()
                .enumerate()
                .map(|(k, &at)| match k {
                    0 => at / 2..at,
                    _ => p[k - 1] + 1..at,
                })
                .collect()
        })
        .collect();
    let span_refs: Vec<&[Span]> = spans.iter().map(Vec::as_slice).collect();
    let layers = [0, 2];
    let dir = temp("span-head");
    let (m, k) = (Some(8), 4);
    let t = head_tensors(2 * h, m, k);
    write_head(&dir, &t, &shapes(2 * h, 8, k));
    let spec = TrainedSpec {
        dir: dir.clone(),
        groups: vec![layers.to_vec(), vec![2]],
        hidden_size: h,
        pools: vec![Pool::Read, Pool::Span],
        kind: HeadKind::Mlp { hidden: 8 },
        categories: k,
    };
    let model = PrmModel::load(&folder, HeadSpec::Trained(spec), &Device::Cpu, DType::F32)
        .unwrap()
        .with_reuse(Reuse {
            cache_bytes: 16 << 20,
            share: true,
        });
    assert!(model.reads_spans());
    let mut d = 0.0f64;
    for _round in 0..2 {
        let got = model
            .score(Batch::new(&rows, &pos).with_spans(&span_refs))
            .unwrap();
        for (b, row) in got.iter().enumerate() {
            let wide = span_reads(pos[b], &spans[b]);
            let st = &plain
                .states(Batch::new(&rows[b..=b], &[&wide]), &layers)
                .unwrap()[0];
            let mut first = pos[b].len();
            for (r, p) in row.scores.iter().enumerate() {
                let mut f = average_states(&[st.at(0, r), st.at(1, r)]);
                let tokens: Vec<&[f32]> = (first..first + spans[b][r].len())
                    .map(|i| st.at(1, i))
                    .collect();
                first += spans[b][r].len();
                f.extend(average_states(&tokens));
                let (want, _) = expected(&t, &f, m, k);
                d = d.max(max_gap(&[*p], &[want], Gap::Abs));
            }
        }
    }
    assert!(d < 1e-5, "span head: scores differ by {d}");
    // Without spans, or with a span that holds no token, the head refuses the batch.
    let err = model
        .score(Batch::new(&rows, &pos))
        .unwrap_err()
        .to_string();
    assert!(err.contains("own tokens"), "{err}");
    let mut empty = spans[0].clone();
    empty[0] = 3..3;
    let err = model
        .score(Batch::new(&rows[..1], &pos[..1]).with_spans(&[&empty]))
        .unwrap_err();
    assert!(
        err.to_string().contains("step 0's span holds no token"),
        "{err}"
    );
    // A span past its step's read is refused, not computed beyond the row's last read.
    let mut late = spans[0].clone();
    let last = late.len() - 1;
    late[last] = pos[0][last]..pos[0][last] + 2;
    let err = model
        .score(Batch::new(&rows[..1], &pos[..1]).with_spans(&[&late]))
        .unwrap_err();
    assert!(err.to_string().contains("runs past its read"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn heads_on_a_shared_base_hold_one_copy_and_score_as_if_each_had_its_own() {
    let folder = fixture("chat-lm");
    let base = SharedBase::load(&folder, &Device::Cpu, DType::F32).unwrap();
    let h = 64;
    let cases = cases("chat-lm");
    let (rows, pos) = rows_of(&cases);
    let mut on_base = Vec::new();
    for (m, k) in [(None, 0), (Some(8), 4)] {
        let dir = temp(&format!("shared-{k}"));
        write_head(&dir, &head_tensors(h, m, k), &shapes(h, m.unwrap_or(0), k));
        let spec = TrainedSpec {
            dir: dir.clone(),
            groups: vec![vec![1]],
            hidden_size: h,
            pools: Vec::new(),
            kind: m.map_or(HeadKind::Logistic, |hidden| HeadKind::Mlp { hidden }),
            categories: k,
        };
        let shared = PrmModel::on_base(&base, &spec).unwrap();
        let alone =
            PrmModel::load(&folder, HeadSpec::Trained(spec), &Device::Cpu, DType::F32).unwrap();
        assert!(base.runs(&shared) && !base.runs(&alone));
        assert_eq!(
            shared.score(Batch::new(&rows, &pos)).unwrap(),
            alone.score(Batch::new(&rows, &pos)).unwrap(),
            "head {m:?}"
        );
        on_base.push(shared);
        std::fs::remove_dir_all(&dir).unwrap();
    }
    // The base's kernels were chosen before it was shared.
    let err = on_base
        .pop()
        .unwrap()
        .with_kernels(Kernels::Candle)
        .err()
        .unwrap();
    assert!(err.to_string().contains("share"), "{err}");
}

#[test]
fn a_bad_trained_head_is_refused_naming_its_file() {
    let folder = fixture("chat-lm");
    let h = 64;
    let dir = temp("bad");
    let spec = |layers: Vec<usize>, hidden_size| TrainedSpec {
        dir: dir.clone(),
        groups: vec![layers],
        hidden_size,
        pools: Vec::new(),
        kind: HeadKind::Logistic,
        categories: 0,
    };
    let load = |s: TrainedSpec| {
        PrmModel::load(&folder, HeadSpec::Trained(s), &Device::Cpu, DType::F32)
            .err()
            .unwrap()
            .to_string()
    };
    let err = load(spec(vec![0], h));
    assert!(
        err.contains("missing file") && err.contains("head.safetensors"),
        "{err}"
    );
    let mut t = head_tensors(h, None, 0);
    write_head(&dir, &t, &shapes(h, 0, 0));
    let err = load(spec(vec![3], h));
    assert!(
        err.contains("config.json") && err.contains("layer 3 is out of range"),
        "{err}"
    );
    let err = load(spec(vec![1], 32));
    assert!(
        err.contains("config.json") && err.contains("`hidden_size`"),
        "{err}"
    );
    t.remove("step.bias");
    write_head(&dir, &t, &shapes(h, 0, 0));
    let err = load(spec(vec![1], h));
    assert!(
        err.contains("head.safetensors: missing tensor step.bias"),
        "{err}"
    );
    t.insert("step.bias".into(), vec![0.0]);
    write_head(
        &dir,
        &t,
        &[
            ("norm.mean", vec![h]),
            ("norm.scale", vec![h]),
            ("step.weight", vec![2, 32]),
            ("step.bias", vec![1]),
        ],
    );
    let err = load(spec(vec![1], h));
    assert!(
        err.contains("step.weight has shape [2, 32], expected [1, 64]"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
