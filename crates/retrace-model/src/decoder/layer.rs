//! One decoder layer (attention, then the MLP, each after its RMS norm, each added to the
//! residual stream), run over the whole stream or, for the last layer, at the reads only; and
//! the linear layers it loads, full or quantized. A layer hands the next its MLP's output not
//! yet added (`Residual`): the next layer's norm adds it in the same pass (`add_rms_norm`).

use super::QuantSource;
use super::attention::{Attention, Queries};
use super::capture::Capture;
use super::chunk::Plan;
use super::packing::Seq;
use super::reads::ReadOut;
use super::rope::Angles;
use crate::config::ModelConfig;
use crate::kernels::{Kernels, add_rms_norm, silu_mul, silu_mul_joined};
use crate::layers::{Dense, Lin, linear};
use candle_core::{D, Module, Result, Tensor};
use candle_nn::{RmsNorm, VarBuilder};

pub(super) struct Layer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
    kernels: Kernels,
}

/// The residual stream between layers: `x`, plus the last layer's MLP output `h` when it is
/// not yet added.
pub(super) struct Residual {
    x: Tensor,
    h: Option<Tensor>,
}

impl Residual {
    pub(super) fn new(x: Tensor) -> Self {
        Self { x, h: None }
    }

    /// The stream with `h` added.
    pub(super) fn sum(&self) -> Result<Tensor> {
        match &self.h {
            Some(h) => &self.x + h,
            None => Ok(self.x.clone()),
        }
    }
}

/// Rows per MLP pass. Its (rows, 2I) intermediate is the decoder's largest activation (a
/// full 8,192-token batch of SmolLM2 holds 150 MiB of it); in pieces of this many rows it
/// stays under 40 MiB, while each GEMM is still large enough to run at the matmul's peak.
const MLP_ROWS: usize = 2048;

/// The MLP. Full gate and up projections are joined into one (2I, H) matrix at load, which the
/// fused kernels multiply once and read half by half; `gate_proj` and `up_proj` are then views
/// of its two halves (no second copy), what candle's ops run.
struct Mlp {
    gate_up: Option<Dense>,
    gate_proj: Lin,
    up_proj: Lin,
    down_proj: Lin,
}

impl Mlp {
    fn new(cfg: &ModelConfig, vb: VarBuilder, quant: QuantSource) -> Result<Self> {
        let (h, i, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        let gate_proj = linear(h, i, bias, vb.pp("gate_proj"), quant)?;
        let up_proj = linear(h, i, bias, vb.pp("up_proj"), quant)?;
        let down_proj = linear(i, h, bias, vb.pp("down_proj"), quant)?;
        Ok(match (&gate_proj, &up_proj) {
            (Lin::Full(g), Lin::Full(u)) if g.bias().is_some() == u.bias().is_some() => {
                let join = |a: &Tensor, b: &Tensor| Tensor::cat(&[a, b], 0);
                let w = join(&g.weight()?, &u.weight()?)?;
                let b = g
                    .bias()
                    .zip(u.bias())
                    .map(|(a, b)| join(a, b))
                    .transpose()?;
                let gate_up = Dense::new(w, b)?;
                Self {
                    gate_proj: Lin::Full(gate_up.outputs(0, i)?),
                    up_proj: Lin::Full(gate_up.outputs(i, i)?),
                    gate_up: Some(gate_up),
                    down_proj,
                }
            }
            _ => Self {
                gate_up: None,
                gate_proj,
                up_proj,
                down_proj,
            },
        })
    }

    /// The MLP of `x` (.., H), in pieces of at most `MLP_ROWS` rows (as even as they come).
    fn forward(&self, x: &Tensor, kernels: Kernels) -> Result<Tensor> {
        let h = x.dim(D::Minus1)?;
        let rows = x.elem_count() / h.max(1);
        if rows <= MLP_ROWS {
            return self.forward_rows(x, kernels);
        }
        let per = rows.div_ceil(rows.div_ceil(MLP_ROWS));
        let flat = x.reshape((rows, h))?;
        let parts = (0..rows)
            .step_by(per)
            .map(|a| self.forward_rows(&flat.narrow(0, a, per.min(rows - a))?, kernels))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts, 0)?.reshape(x.shape())
    }

    fn forward_rows(&self, x: &Tensor, kernels: Kernels) -> Result<Tensor> {
        let h = match &self.gate_up {
            Some(gate_up) if kernels.fused_for(x) => {
                silu_mul_joined(&gate_up.forward(x)?, kernels)?
            }
            _ => {
                // One call, so a quantized pair rounds the stream once.
                let [gate, up] = Lin::forward_each([&self.gate_proj, &self.up_proj], x)?;
                silu_mul(&gate, &up, kernels)?
            }
        };
        self.down_proj.forward(&h)
    }
}

impl Layer {
    pub(super) fn new(
        cfg: &ModelConfig,
        layer: usize,
        vb: VarBuilder,
        quant: QuantSource,
    ) -> Result<Self> {
        let eps = cfg.rms_norm_eps;
        Ok(Self {
            input_layernorm: candle_nn::rms_norm(cfg.hidden_size, eps, vb.pp("input_layernorm"))?,
            self_attn: Attention::new(cfg, layer, vb.pp("self_attn"), quant)?,
            post_attention_layernorm: candle_nn::rms_norm(
                cfg.hidden_size,
                eps,
                vb.pp("post_attention_layernorm"),
            )?,
            mlp: Mlp::new(cfg, vb.pp("mlp"), quant)?,
            kernels: Kernels::default(),
        })
    }

    /// Its linear layers, in the order a forward runs them.
    pub(super) fn linears(&mut self) -> impl Iterator<Item = &mut Lin> {
        let mlp = &mut self.mlp;
        self.self_attn.linears().into_iter().chain([
            &mut mlp.gate_proj,
            &mut mlp.up_proj,
            &mut mlp.down_proj,
        ])
    }

    pub(super) fn set_kernels(&mut self, kernels: Kernels) {
        self.kernels = kernels;
        self.self_attn.kernels = kernels;
    }

    /// The layer's sliding window, if it has one.
    pub(super) fn window(&self) -> Option<usize> {
        self.self_attn.window
    }

    /// The stream `res` summed (the layer's input) and normed for its attention.
    pub(super) fn input(&self, res: &Residual) -> Result<(Tensor, Tensor)> {
        match &res.h {
            Some(h) => add_rms_norm(&res.x, h, &self.input_layernorm, self.kernels),
            None => Ok((res.x.clone(), self.input_layernorm.forward(&res.x)?)),
        }
    }

    /// Every stream token through the layer.
    pub(super) fn forward(
        &self,
        layer: usize,
        res: &Residual,
        seqs: &[Seq],
        rope: &Angles,
        plans: &[Plan],
        capture: &mut Capture,
    ) -> Result<Residual> {
        let (x, xn) = self.input(res)?;
        let queries = Queries::Full(plans);
        let h = self
            .self_attn
            .forward(layer, Some(&xn), seqs, rope, &queries, capture)?;
        self.residual_mlp(&x, &h)
    }

    /// Only the rows `xq` (their residual stream before this layer) through the layer, over
    /// keys from the normed stream `xn` (whose RoPE rows are `rope`) and the cache.
    pub(super) fn forward_gathered(
        &self,
        layer: usize,
        xn: Option<&Tensor>,
        xq: &Tensor,
        reads: &ReadOut,
        rope: &Angles,
        capture: &mut Capture,
    ) -> Result<Tensor> {
        let xqn = self.input_layernorm.forward(xq)?;
        let queries = Queries::Gathered {
            xq: &xqn,
            rope: &reads.rope,
            chunks: &reads.chunks,
        };
        let h = self
            .self_attn
            .forward(layer, xn, &reads.seqs, rope, &queries, capture)?;
        self.residual_mlp(xq, &h)?.sum()
    }

    /// `x` plus the attention's `h`, and the MLP of that sum's post-attention norm, not yet
    /// added.
    fn residual_mlp(&self, x: &Tensor, h: &Tensor) -> Result<Residual> {
        let (x, xn) = add_rms_norm(x, h, &self.post_attention_layernorm, self.kernels)?;
        let h = self.mlp.forward(&xn, self.kernels)?;
        Ok(Residual { x, h: Some(h) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{max_diff, tensor};
    use candle_core::quantized::{GgmlDType, QTensor};

    #[test]
    fn the_mlp_in_pieces_equals_it_whole() {
        // Three uneven pieces, each a view at an offset into the stream: full and quantized
        // weights (whose GEMM path reads its rows from the view's offset), each kernel set.
        let (h, i, rows) = (32, 64, 2 * MLP_ROWS + 37);
        let w = |o: usize, k: usize, seed| tensor(&[o, k], seed, 0.5);
        let lin = |o, k, seed, quantized: bool| {
            if !quantized {
                return Lin::Full(Dense::new(w(o, k, seed), None).unwrap());
            }
            let q = QTensor::quantize(&w(o, k, seed), GgmlDType::Q4_1).unwrap();
            Lin::quant(q, None).unwrap()
        };
        let x = tensor(&[rows, h], 4, 1.0);
        for q in [false, true] {
            let mlp = Mlp {
                gate_up: None,
                gate_proj: lin(i, h, 1, q),
                up_proj: lin(i, h, 2, q),
                down_proj: lin(h, i, 3, q),
            };
            for kernels in [Kernels::Fused, Kernels::Candle] {
                let whole = mlp.forward_rows(&x, kernels).unwrap();
                let pieces = mlp.forward(&x, kernels).unwrap();
                assert!(max_diff(&pieces, &whole) <= 1e-6, "{kernels:?} {q}");
            }
        }
    }
}
