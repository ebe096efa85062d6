//! The machine's matrix-multiply peak, measured with candle's own CPU matmul (the backend the
//! model runs on) at the model's shapes, and the model's FLOP count per scored trace.

use candle_core::{DType, Device, Module, Tensor};
use serde::Deserialize;
use std::path::Path;
use std::time::Instant;

/// The shapes a forward pass multiplies, from config.json.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct Shapes {
    pub(crate) hidden_size: usize,
    pub(crate) intermediate_size: usize,
    pub(crate) num_hidden_layers: usize,
    pub(crate) num_attention_heads: usize,
    pub(crate) num_key_value_heads: Option<usize>,
    pub(crate) head_dim: Option<usize>,
}

/// The best rate seen, and at which (M, K, N).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Peak {
    pub(crate) gflops: f64,
    pub(crate) shape: (usize, usize, usize),
}

impl Shapes {
    pub(crate) fn load(folder: &Path) -> anyhow::Result<Shapes> {
        if retrace_model::is_gguf(folder) {
            let c = retrace_model::Gguf::open(folder).and_then(|g| g.config())?;
            return Ok(Shapes {
                hidden_size: c.hidden_size,
                intermediate_size: c.intermediate_size,
                num_hidden_layers: c.num_hidden_layers,
                num_attention_heads: c.num_attention_heads,
                num_key_value_heads: c.num_key_value_heads,
                head_dim: c.head_dim,
            });
        }
        let text = std::fs::read_to_string(folder.join("config.json"))?;
        Ok(serde_json::from_str(&text)?)
    }

    fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    fn kv_dim(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads) * self.head_dim()
    }

    /// Weights multiplied per token per layer: q, k, v, o and the gated MLP.
    fn layer_params(&self) -> (usize, usize) {
        let (h, i, q) = (
            self.hidden_size,
            self.intermediate_size,
            self.num_attention_heads * self.head_dim(),
        );
        let kv = 2 * h * self.kv_dim();
        (kv, h * q + q * h + 3 * h * i)
    }

    /// Useful FLOPs to score one trace of `len` tokens read at `reads` positions: every layer's
    /// matmuls for every token, except that the last layer runs only k, v for all tokens and
    /// the rest for the read rows (as the decoder does); plus causal attention (QK^T and PV over
    /// the keys each query may see). Padding, masked-out scores and the head are not counted.
    pub(crate) fn trace_flops(&self, len: usize, reads: usize) -> f64 {
        let (kv, rest) = self.layer_params();
        let layers = self.num_hidden_layers as f64;
        let (l, m) = (len as f64, reads as f64);
        let matmul = 2.0 * l * (kv + rest) as f64 * (layers - 1.0)
            + 2.0 * l * kv as f64
            + 2.0 * m * rest as f64;
        let q = (self.num_attention_heads * self.head_dim()) as f64;
        let attention = 4.0 * q * (l * (l + 1.0) / 2.0) * (layers - 1.0) + 4.0 * q * m * l;
        matmul + attention
    }

    /// (K, N) of each weight matrix, distinct.
    fn weight_shapes(&self) -> Vec<(usize, usize)> {
        let (h, i, q) = (
            self.hidden_size,
            self.intermediate_size,
            self.num_attention_heads * self.head_dim(),
        );
        let mut s = vec![(h, q), (h, self.kv_dim()), (q, h), (h, i), (i, h)];
        s.dedup();
        s
    }
}

/// f32 `x (M, K) @ w (N, K)^T` through `candle_nn::Linear`, for each weight shape of the model
/// and each M in `rows`: the best of `reps` runs each, and the best of those.
pub(crate) fn peak(shapes: &Shapes, rows: &[usize], reps: usize) -> anyhow::Result<Peak> {
    let dev = Device::Cpu;
    let mut best = Peak {
        gflops: 0.0,
        shape: (0, 0, 0),
    };
    for &(k, n) in &shapes.weight_shapes() {
        let w = Tensor::randn(0f32, 0.02, (n, k), &dev)?;
        let linear = candle_nn::Linear::new(w, None);
        for &m in rows {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?.to_dtype(DType::F32)?;
            linear.forward(&x)?; // warm-up: page in, spin up the thread pool
            for _ in 0..reps {
                let t = Instant::now();
                let y = linear.forward(&x)?;
                // Make sure the work is done (CPU ops are eager; this is cheap insurance).
                let _ = y.dims();
                let gflops = 2.0 * (m * k * n) as f64 / t.elapsed().as_secs_f64() / 1e9;
                if gflops > best.gflops {
                    best = Peak {
                        gflops,
                        shape: (m, k, n),
                    };
                }
            }
        }
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smol() -> Shapes {
        Shapes {
            hidden_size: 576,
            intermediate_size: 1536,
            num_hidden_layers: 30,
            num_attention_heads: 9,
            num_key_value_heads: Some(3),
            head_dim: None,
        }
    }

    #[test]
    fn counts_smollm2_matmul_params() {
        let s = smol();
        let (kv, rest) = s.layer_params();
        // 30 layers of q, k, v, o, gate, up, down: SmolLM2-135M's 106M non-embedding weights.
        assert_eq!((kv + rest) * 30, 106_168_320);
        // One token read at itself: all layers' matmuls plus attention over one key.
        let f = s.trace_flops(1, 1);
        assert!((f - (2.0 * 106_168_320.0 + 4.0 * 576.0 * 30.0)).abs() < 1.0);
    }

    #[test]
    fn measures_a_positive_peak() {
        let mut s = smol();
        s.hidden_size = 64;
        s.intermediate_size = 128;
        s.num_attention_heads = 4;
        s.num_key_value_heads = Some(2);
        let p = peak(&s, &[32], 2).unwrap();
        assert!(p.gflops > 0.0 && p.shape.0 == 32);
    }
}
