//! The fused CPU kernels against candle's ops, side by side in one run: a whole forward pass
//! (tokens/s for 64 rows of 8 tokens and one row of 512, 2,048 and 4,096, in alternating
//! rounds), the per-token cost of the long rows against 512 beside their FLOP floor, each kernel
//! alone, and the forward's useful GFLOP/s as a share of this machine's f32 matmul peak,
//! measured in the same run.
//!
//! `cargo run --release -p retrace-model --example kernels -- [--model DIR] [--rounds N]
//! [--only fused|candle] [--len N]` (`--only`: one kernel set's forwards of one row of `--len`
//! tokens, 2,048 unless given, and nothing else, to profile).
//!
//! DIR is a Hugging Face folder (f32 safetensors). Without one, a SmolLM2-135M folder under
//! `~/.cache/retrace/` is used when there is one, else a random-weight model of SmolLM2-135M's
//! shape is written to the temp folder (once) and used: the same arithmetic, other numbers.

use candle_core::{DType, Device, Tensor};
use retrace_model::kernels::{
    add_rms_norm, causal_attention, rope_heads, silu_mul, silu_mul_joined,
};
use retrace_model::{Batch, HeadSpec, Kernels, PrmModel};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// What a forward's FLOPs depend on, from config.json.
#[derive(Clone, Copy)]
struct Shape {
    hidden: usize,
    heads: usize,
    kv: usize,
    layers: usize,
    inter: usize,
    vocab: usize,
    window: Option<usize>,
}

const SMOLLM2: Shape = Shape {
    hidden: 576,
    heads: 9,
    kv: 3,
    layers: 30,
    inter: 1536,
    vocab: 49152,
    window: None,
};

// An example binary: it passes RETRACE_SIMD to the kernels as the retrace binary does.
#[allow(clippy::disallowed_methods)]
fn main() -> Res<()> {
    if let Ok(cap) = std::env::var("RETRACE_SIMD") {
        retrace_model::kernels::cap_simd(&cap)?;
    }
    let args: Vec<String> = std::env::args().collect();
    let flag = |name: &str| {
        let i = args.iter().position(|a| a == name)?;
        args.get(i + 1).cloned()
    };
    let rounds: usize = flag("--rounds").map_or(Ok(3), |r| r.parse())?;
    if let Some(only) = flag("--only") {
        let k = if only == "candle" {
            Kernels::Candle
        } else {
            Kernels::Fused
        };
        let (dir, _) = find_or_make()?;
        let model = PrmModel::load(&dir, HeadSpec::States, &Device::Cpu, DType::F32)?;
        let len: usize = flag("--len").map_or(Ok(2048), |r| r.parse())?;
        return profile(model.with_kernels(k)?, read_shape(&dir)?, rounds, len);
    }
    let (dir, what) = match flag("--model") {
        Some(d) => (PathBuf::from(d), "the model given".to_string()),
        None => find_or_make()?,
    };
    let shape = read_shape(&dir)?;
    println!("model: {} ({what})", dir.display());
    println!(
        "threads: {} (candle), SIMD: {}",
        candle_core::utils::get_num_threads(),
        simd()
    );
    // Measured before and after the forwards, the best kept: the cores may be shared.
    let peak = matmul_peak()?;
    let model = PrmModel::load(&dir, HeadSpec::States, &Device::Cpu, DType::F32)?;
    let per_token = forwards(model, shape, rounds, peak)?;
    // The floor: a long row's FLOPs per token against 512's (attention sees more keys).
    let flops_per_token = |len: usize| forward_flops(shape, 1, len) / len as f64;
    println!("\nper-token cost against a row of 512 (FLOP floor: the FLOPs per token's ratio):");
    println!(
        "  {:<7} {:>8} {:>8} {:>8}",
        "tokens", "floor", "Candle", "Fused"
    );
    for (i, len) in [2048, 4096].into_iter().enumerate() {
        let floor = flops_per_token(len) / flops_per_token(512);
        let [c, f] = per_token.map(|t| t[i + 1] / t[0]);
        println!("  {len:<7} {floor:>7.3}x {c:>7.3}x {f:>7.3}x");
    }
    println!();
    kernels_alone(shape)?;
    Ok(())
}

/// Times every batch with both kernel sets, alternating, and prints tokens/s; returns each
/// set's seconds per token at 512, 2,048 and 4,096 tokens.
fn forwards(mut model: PrmModel, s: Shape, rounds: usize, peak: f64) -> Res<[[f64; 3]; 2]> {
    let batches = [
        ("64 x 8", 64, 8),
        ("1 x 512", 1, 512),
        ("1 x 2048", 1, 2048),
        ("1 x 4096", 1, 4096),
    ];
    let sets = [Kernels::Candle, Kernels::Fused];
    let mut times = vec![[Vec::new(), Vec::new()]; batches.len()];
    for round in 0..=rounds {
        for (b, &(_, rows, len)) in batches.iter().enumerate() {
            let ids: Vec<Vec<u32>> = (0..rows).map(|r| random_ids(len, r, s.vocab)).collect();
            let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
            let reads: Vec<Vec<usize>> = vec![vec![len - 1]; rows];
            let pos: Vec<&[usize]> = reads.iter().map(Vec::as_slice).collect();
            for (i, &k) in sets.iter().enumerate() {
                model = model.with_kernels(k)?;
                let t = Instant::now();
                model.states(Batch::new(&refs, &pos), &[s.layers])?;
                // Round 0 warms up (page faults, rayon's threads).
                if round > 0 {
                    times[b][i].push(t.elapsed().as_secs_f64());
                }
            }
        }
    }
    let peak = peak.max(matmul_peak()?);
    println!("f32 matmul peak (2048^3, best of 10 around the forwards): {peak:.1} GFLOP/s\n");
    println!("forward (median of {rounds} rounds, each read at its last token):");
    println!(
        "  {:<9} {:>13} {:>13} {:>7} {:>14} {:>14}",
        "batch", "Candle tok/s", "Fused tok/s", "ratio", "Candle GFLOP/s", "Fused GFLOP/s"
    );
    let mut per_token = [[0.0; 3]; 2];
    for (b, &(name, rows, len)) in batches.iter().enumerate() {
        let [c, f] = [median(&times[b][0]), median(&times[b][1])];
        let tokens = (rows * len) as f64;
        let flops = forward_flops(s, rows, len);
        let rate = |t: f64| flops / t / 1e9;
        println!(
            "  {name:<9} {:>13.0} {:>13.0} {:>6.2}x {:>7.1} ({:>3.0}%) {:>7.1} ({:>3.0}%)",
            tokens / c,
            tokens / f,
            c / f,
            rate(c),
            100.0 * rate(c) / peak,
            rate(f),
            100.0 * rate(f) / peak
        );
        for (i, t) in [c, f].into_iter().enumerate() {
            if rows == 1 {
                per_token[i][b - 1] = t / tokens;
            }
        }
    }
    Ok(per_token)
}

/// `rounds` forwards of one row of `len` tokens with the model's kernel set, for a profiler.
fn profile(model: PrmModel, s: Shape, rounds: usize, len: usize) -> Res<()> {
    let ids = random_ids(len, 0, s.vocab);
    for _ in 0..rounds {
        let t = Instant::now();
        model.states(Batch::new(&[&ids], &[&[len - 1]]), &[s.layers])?;
        let rate = len as f64 / t.elapsed().as_secs_f64();
        println!("1 x {len}: {rate:.0} tok/s");
    }
    Ok(())
}

/// The useful FLOPs of a forward over `rows` rows of `len` tokens, each read at its last
/// token: every layer's matrices at every token but the last layer's (keys and values only,
/// then the rest at the reads), and attention over the keys each query sees.
fn forward_flops(s: Shape, rows: usize, len: usize) -> f64 {
    let hd = s.hidden / s.heads;
    // Multiply-adds per token: keys and values; queries, output and MLP.
    let kv = 2 * s.hidden * s.kv * hd;
    let rest = 2 * s.hidden * s.heads * hd + 3 * s.hidden * s.inter;
    let keys = |p: usize| s.window.map_or(p + 1, |w| (p + 1).min(w));
    let row_keys: usize = (0..len).map(keys).sum();
    let attn = |k: usize| 4 * hd * s.heads * k;
    let tokens = rows * len;
    let full = (s.layers - 1) * (2 * tokens * (kv + rest) + rows * attn(row_keys));
    let last = 2 * tokens * kv + rows * (2 * rest + attn(keys(len - 1)));
    (full + last) as f64
}

/// Each fused kernel against its unfused version, at SmolLM2's sizes for 2,048 tokens.
fn kernels_alone(s: Shape) -> Res<()> {
    let (n, h, hd) = (2048, s.hidden, s.hidden / s.heads);
    let x = randn(&[n, h])?;
    let hh = randn(&[n, h])?;
    let norm = candle_nn::RmsNorm::new(randn(&[h])?, 1e-5);
    let gate_up = randn(&[n, 2 * s.inter])?;
    let (gate, up) = (randn(&[n, s.inter])?, randn(&[n, s.inter])?);
    let q = randn(&[n, s.heads * hd])?;
    let (cos, sin) = (randn(&[n, hd / 2])?, randn(&[n, hd / 2])?);
    let scale = 1.0 / (hd as f64).sqrt();
    println!("kernels alone (median of 7 runs of 5 calls; ms per call):");
    println!(
        "  {:<38} {:>9} {:>9} {:>7}",
        "kernel", "Candle", "Fused", "ratio"
    );
    let each = |name: &str, f: &dyn Fn(Kernels) -> candle_core::Result<Tensor>| -> Res<()> {
        let [c, u] = [Kernels::Candle, Kernels::Fused].map(|k| time_ms(|| f(k)));
        let (c, u) = (c?, u?);
        println!("  {name:<38} {c:>9.3} {u:>9.3} {:>6.2}x", c / u);
        Ok(())
    };
    each(&format!("add + rms norm ({n} x {h})"), &|k| {
        add_rms_norm(&x, &hh, &norm, k).map(|r| r.1)
    })?;
    each(&format!("silu * up, joined ({n} x 2*{})", s.inter), &|k| {
        silu_mul_joined(&gate_up, k)
    })?;
    each(&format!("silu * up, two ({n} x {})", s.inter), &|k| {
        silu_mul(&gate, &up, k)
    })?;
    each(
        &format!("rope + heads + scale ({n} x {}x{hd})", s.heads),
        &|k| rope_heads(&q, &cos, &sin, s.heads, Some(scale), k),
    )?;
    for len in [512, 2048] {
        let q = (randn(&[1, s.heads, len, hd])? * scale)?;
        let (k, v) = (randn(&[1, s.kv, len, hd])?, randn(&[1, s.kv, len, hd])?);
        let name = format!("attention, whole mask ({len}, {}/{} heads)", s.heads, s.kv);
        each(&name, &|kern| causal_attention(&q, &k, &v, s.window, kern))?;
    }
    Ok(())
}

/// Best GFLOP/s of a 2048 x 2048 x 2048 f32 matmul.
fn matmul_peak() -> Res<f64> {
    let n = 2048;
    let (a, b) = (randn(&[n, n])?, randn(&[n, n])?);
    a.matmul(&b)?;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = Instant::now();
        a.matmul(&b)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(2.0 * (n * n * n) as f64 / best / 1e9)
}

/// Median milliseconds per call of `f`, over 7 runs of 5 calls after one warm-up call.
fn time_ms(f: impl Fn() -> candle_core::Result<Tensor>) -> candle_core::Result<f64> {
    f()?;
    let mut runs = Vec::new();
    for _ in 0..7 {
        let t = Instant::now();
        for _ in 0..5 {
            f()?;
        }
        runs.push(t.elapsed().as_secs_f64() * 1e3 / 5.0);
    }
    Ok(median(&runs))
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn randn(dims: &[usize]) -> candle_core::Result<Tensor> {
    Tensor::randn(0f32, 1.0, dims, &Device::Cpu)
}

/// Token ids from a fixed xorshift stream, one per row (rows share no prefix).
fn random_ids(len: usize, row: usize, vocab: usize) -> Vec<u32> {
    let mut state = 0x2545_f491_u64 + row as u64 * 0x9e37_79b9;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % vocab as u64) as u32
        })
        .collect()
}

fn simd() -> &'static str {
    if std::arch::is_x86_feature_detected!("avx512f") {
        "AVX-512"
    } else if std::arch::is_x86_feature_detected!("avx2") {
        "AVX2"
    } else {
        "baseline"
    }
}

/// The shape a folder's config.json gives.
fn read_shape(dir: &Path) -> Res<Shape> {
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let n = |k: &str| c[k].as_u64().map(|v| v as usize).ok_or(format!("no {k}"));
    let window = match c["model_type"].as_str() {
        Some("mistral") => c["sliding_window"].as_u64().map(|w| w as usize),
        _ => None,
    };
    Ok(Shape {
        hidden: n("hidden_size")?,
        heads: n("num_attention_heads")?,
        kv: n("num_key_value_heads").or_else(|_| n("num_attention_heads"))?,
        layers: n("num_hidden_layers")?,
        inter: n("intermediate_size")?,
        vocab: n("vocab_size")?,
        window,
    })
}

/// A SmolLM2-135M folder under `~/.cache/retrace/`, else a random-weight one of its shape.
// An example binary, beside the product's one reader of the environment.
#[allow(clippy::disallowed_methods)]
fn find_or_make() -> Res<(PathBuf, String)> {
    let cache = std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/retrace"));
    if let Some(Ok(entries)) = cache.map(std::fs::read_dir) {
        for e in entries.flatten() {
            let p = e.path();
            let name = p.file_name().map(|n| n.to_string_lossy().to_lowercase());
            let smol = name.is_some_and(|n| n.contains("smollm2-135m"));
            if smol && p.join("config.json").is_file() && p.join("model.safetensors").is_file() {
                return Ok((p, "SmolLM2-135M, real weights".into()));
            }
        }
    }
    let dir = std::env::temp_dir().join("retrace-kernels-smollm2-135m-random");
    if !dir.join("model.safetensors").is_file() {
        write_random(&dir, SMOLLM2)?;
    }
    Ok((dir, "random weights, SmolLM2-135M's shape".into()))
}

/// A Llama folder of shape `s` with random weights (uniform, 1 / sqrt(fan in), as torch
/// initialises a Linear; norms near 1).
fn write_random(dir: &Path, s: Shape) -> Res<()> {
    std::fs::create_dir_all(dir)?;
    let config = serde_json::json!({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "hidden_size": s.hidden, "intermediate_size": s.inter,
        "num_attention_heads": s.heads, "num_key_value_heads": s.kv,
        "num_hidden_layers": s.layers, "vocab_size": s.vocab,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "tie_word_embeddings": true, "torch_dtype": "float32",
    });
    std::fs::write(dir.join("config.json"), config.to_string())?;
    let dev = Device::Cpu;
    let lin = |o: usize, i: usize| {
        let b = 1.0 / (i as f32).sqrt();
        Tensor::rand(-b, b, (o, i), &dev)
    };
    let hd = s.hidden / s.heads;
    let mut w: HashMap<String, Tensor> = HashMap::new();
    let embed = Tensor::rand(-1f32, 1.0, (s.vocab, s.hidden), &dev)?;
    w.insert("model.embed_tokens.weight".into(), embed);
    w.insert(
        "model.norm.weight".into(),
        Tensor::rand(0.5f32, 1.5, s.hidden, &dev)?,
    );
    for l in 0..s.layers {
        let p = format!("model.layers.{l}");
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            let t = Tensor::rand(0.5f32, 1.5, s.hidden, &dev)?;
            w.insert(format!("{p}.{norm}.weight"), t);
        }
        for (name, o, i) in [
            ("self_attn.q_proj", s.heads * hd, s.hidden),
            ("self_attn.k_proj", s.kv * hd, s.hidden),
            ("self_attn.v_proj", s.kv * hd, s.hidden),
            ("self_attn.o_proj", s.hidden, s.heads * hd),
            ("mlp.gate_proj", s.inter, s.hidden),
            ("mlp.up_proj", s.inter, s.hidden),
            ("mlp.down_proj", s.hidden, s.inter),
        ] {
            w.insert(format!("{p}.{name}.weight"), lin(o, i)?);
        }
    }
    candle_core::safetensors::save(&w, dir.join("model.safetensors"))?;
    Ok(())
}
