//! The fused kernels against candle's ops through the whole decoder, on random-weight models
//! of several shapes: packed rows of different lengths, grouped-query heads, head sizes of 16
//! to 128, sliding windows shorter than the rows, and keys from the prefix cache.

use super::*;
use crate::batch::RowStates;
use crate::kernels::testing::{Gap, max_gap, values};
use candle_core::Tensor;
use std::collections::HashMap;

/// A model's shape: hidden size, heads, kv heads, layers, sliding window.
#[derive(Clone, Copy)]
struct Shape {
    hidden: usize,
    heads: usize,
    kv: usize,
    layers: usize,
    window: Option<usize>,
}

const VOCAB: usize = 97;

/// Writes a random-weight Mistral (or Llama, without a window) checkpoint of `shape` to a
/// fresh folder named after `name`.
fn checkpoint(name: &str, s: Shape) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("retrace-kernels-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (h, hd, inter) = (s.hidden, s.hidden / s.heads, 2 * s.hidden + 6);
    let config = serde_json::json!({
        "model_type": if s.window.is_some() { "mistral" } else { "llama" },
        "hidden_size": h, "intermediate_size": inter, "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv, "num_hidden_layers": s.layers, "vocab_size": VOCAB,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "sliding_window": s.window, "tie_word_embeddings": true,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut seed = 0;
    let mut t = |dims: &[usize], scale: f32| {
        seed += 1;
        let n = dims.iter().product();
        Tensor::from_vec(values(n, seed, scale), dims, &Device::Cpu).unwrap()
    };
    let mut w: HashMap<String, Tensor> = HashMap::new();
    w.insert("model.embed_tokens.weight".into(), t(&[VOCAB, h], 1.0));
    w.insert("model.norm.weight".into(), t(&[h], 1.5));
    for l in 0..s.layers {
        let p = format!("model.layers.{l}");
        // Matrices as torch initialises a Linear (uniform, 1 / sqrt(fan in)), so activations
        // stay the size a trained model's do.
        let mut put = |name: &str, dims: &[usize]| {
            let scale = match dims {
                [_, fan_in] => 2.0 / (*fan_in as f32).sqrt(),
                _ => 1.5,
            };
            w.insert(format!("{p}.{name}.weight"), t(dims, scale));
        };
        put("input_layernorm", &[h]);
        put("post_attention_layernorm", &[h]);
        put("self_attn.q_proj", &[s.heads * hd, h]);
        put("self_attn.k_proj", &[s.kv * hd, h]);
        put("self_attn.v_proj", &[s.kv * hd, h]);
        put("self_attn.o_proj", &[h, s.heads * hd]);
        put("mlp.gate_proj", &[inter, h]);
        put("mlp.up_proj", &[inter, h]);
        put("mlp.down_proj", &[h, inter]);
    }
    candle_core::safetensors::save(&w, dir.join("model.safetensors")).unwrap();
    dir
}

fn load(dir: &Path, kernels: Kernels, cache_bytes: usize) -> PrmModel {
    PrmModel::load(dir, HeadSpec::States, &Device::Cpu, DType::F32)
        .unwrap()
        .with_kernels(kernels)
        .unwrap()
        .with_reuse(Reuse {
            cache_bytes,
            share: true,
        })
}

/// The largest difference between two runs' states, relative where a value exceeds 1.
fn diff(a: &[RowStates], b: &[RowStates]) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut worst = 0f64;
    for (ra, rb) in a.iter().zip(b) {
        assert_eq!(ra.layers.len(), rb.layers.len());
        for (ta, tb) in ra.layers.iter().zip(&rb.layers) {
            worst = worst.max(max_gap(ta, tb, Gap::Rel));
        }
    }
    worst
}

#[test]
fn fused_kernels_match_candles_ops_through_the_decoder() {
    let shapes = [
        (
            "mha-16",
            Shape {
                hidden: 64,
                heads: 4,
                kv: 4,
                layers: 2,
                window: None,
            },
        ),
        (
            "gqa-64",
            Shape {
                hidden: 192,
                heads: 3,
                kv: 1,
                layers: 2,
                window: None,
            },
        ),
        (
            "gqa-win",
            Shape {
                hidden: 96,
                heads: 6,
                kv: 2,
                layers: 3,
                window: Some(37),
            },
        ),
        (
            "hd128-win",
            Shape {
                hidden: 256,
                heads: 2,
                kv: 1,
                layers: 1,
                window: Some(5),
            },
        ),
    ];
    // Rows sharing a 70-token prefix, of ragged lengths; reads all along them.
    let prefix: Vec<u32> = (0..70).map(|i| (i * 7 + 3) % VOCAB as u32).collect();
    let rows: Vec<Vec<u32>> = [1usize, 33, 130, 200]
        .iter()
        .enumerate()
        .map(|(r, &n)| {
            let mut row = prefix.clone();
            row.extend((0..n as u32).map(|i| (i * 13 + 5 + r as u32 * 31) % VOCAB as u32));
            row
        })
        .collect();
    let reads: Vec<Vec<usize>> = rows
        .iter()
        .map(|r| (0..r.len()).step_by(9).chain([r.len() - 1]).collect())
        .collect();
    let refs: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
    let pos: Vec<&[usize]> = reads.iter().map(Vec::as_slice).collect();
    let short: Vec<&[u32]> = rows.iter().map(|r| &r[..60]).collect();
    let short_pos: Vec<Vec<usize>> = (0..rows.len()).map(|_| vec![10, 59]).collect();
    let short_pos: Vec<&[usize]> = short_pos.iter().map(Vec::as_slice).collect();
    for (name, shape) in shapes {
        let dir = checkpoint(name, shape);
        let taps = [0, shape.layers - 1, shape.layers];
        let candle = load(&dir, Kernels::Candle, 0)
            .states(Batch::new(&refs, &pos), &taps)
            .unwrap();
        let fused = load(&dir, Kernels::Fused, 0)
            .states(Batch::new(&refs, &pos), &taps)
            .unwrap();
        let d = diff(&fused, &candle);
        assert!(d < 1e-5, "{name}: fused vs candle {d}");
        // The same rows over cached keys: the first 60 tokens of each scored first.
        let cached = load(&dir, Kernels::Fused, 64 << 20);
        cached
            .states(Batch::new(&short, &short_pos), &taps[2..])
            .unwrap();
        let again = cached.states(Batch::new(&refs, &pos), &taps[2..]).unwrap();
        let last: Vec<RowStates> = candle
            .into_iter()
            .map(|r| RowStates {
                layers: r.layers[2..].to_vec(),
                ..r
            })
            .collect();
        let d = diff(&again, &last);
        assert!(d < 1e-5, "{name}: fused over the cache vs candle {d}");
        assert!(cached.cache_stats().unwrap().bytes > 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
