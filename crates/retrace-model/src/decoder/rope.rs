//! Rotary position embeddings: the cos / sin tables built once per model on the host, and the
//! rows of the tokens one forward attends, applied head by head.

use crate::config::ModelConfig;
use crate::kernels::{Kernels, rope_heads};
use candle_core::{DType, Device, Result, Tensor};

/// cos / sin tables, shape (max_positions, head_dim / 2), in the model dtype.
pub(super) struct Rope {
    cos: Tensor,
    sin: Tensor,
}

/// The RoPE rows of some tokens, (tokens, head_dim / 2) each, in the tokens' order.
pub(super) struct Angles {
    cos: Tensor,
    sin: Tensor,
}

impl Rope {
    pub(super) fn new(cfg: &ModelConfig, dtype: DType, dev: &Device) -> Result<Self> {
        // Built on the host in f64/f32 whatever the model dtype: bf16 angles are wrong far out.
        let inv = cfg.rope_inv_freq().map_err(candle_core::Error::wrap)?;
        let n = cfg.max_position_embeddings;
        let mut cos = Vec::with_capacity(n * inv.len());
        let mut sin = Vec::with_capacity(n * inv.len());
        for p in 0..n {
            for f in &inv {
                // transformers computes the angle in f32; keep that rounding, then take cos / sin.
                let angle = (p as f32 * *f as f32) as f64;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let shape = (n, inv.len());
        Ok(Self {
            cos: Tensor::from_vec(cos, shape, dev)?.to_dtype(dtype)?,
            sin: Tensor::from_vec(sin, shape, dev)?.to_dtype(dtype)?,
        })
    }

    /// Positions the tables cover.
    pub(super) fn positions(&self) -> Result<usize> {
        self.cos.dim(0)
    }

    /// The rows of tokens at positions `pos`, in that order.
    pub(super) fn at(&self, pos: &[u32], dev: &Device) -> Result<Angles> {
        let pos = Tensor::from_slice(pos, pos.len(), dev)?;
        Ok(Angles {
            cos: self.cos.index_select(&pos, 0)?,
            sin: self.sin.index_select(&pos, 0)?,
        })
    }
}

impl Angles {
    /// HF rotate-half RoPE on a projection `x` (tokens, n * hd), scaled by `scale`, split
    /// into `n` heads: (1, n, tokens, hd).
    pub(super) fn apply(
        &self,
        x: &Tensor,
        n: usize,
        scale: Option<f64>,
        k: Kernels,
    ) -> Result<Tensor> {
        rope_heads(x, &self.cos, &self.sin, n, scale, k)
    }
}
