//! One decoder layer (attention, then the MLP, each after its RMS norm, each added to the
//! residual stream), run over the whole stream or, for the last layer, at the reads only; and
//! the linear layers it loads, full or quantized.

use super::QuantSource;
use super::attention::{Angles, Attention, Plan, Queries};
use super::capture::Capture;
use super::packing::Seq;
use super::reads::ReadOut;
use crate::config::ModelConfig;
use crate::layers::Lin;
use candle_core::{Module, Result, Tensor};
use candle_nn::{RmsNorm, VarBuilder};

pub(super) struct Layer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

struct Mlp {
    gate_proj: Lin,
    up_proj: Lin,
    down_proj: Lin,
}

/// A linear layer whose bias is loaded when the checkpoint has one (or the config says so, in which
/// case a missing tensor is an error). A GGUF's quantized matrix stays quantized; its bias is f32.
pub(super) fn linear(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    vb: VarBuilder,
    quant: QuantSource,
) -> Result<Lin> {
    let bias = bias || vb.contains_tensor("bias");
    if let Some(w) = quant
        .map(|g| g.quantized(&format!("{}.weight", vb.prefix()), vb.device()))
        .transpose()?
        .flatten()
    {
        let b = bias.then(|| vb.get(out_dim, "bias")).transpose()?;
        return Lin::quant(w, b);
    }
    Ok(Lin::Full(candle_nn::linear_b(in_dim, out_dim, bias, vb)?))
}

impl Mlp {
    fn new(cfg: &ModelConfig, vb: VarBuilder, quant: QuantSource) -> Result<Self> {
        let (h, i, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        Ok(Self {
            gate_proj: linear(h, i, bias, vb.pp("gate_proj"), quant)?,
            up_proj: linear(h, i, bias, vb.pp("up_proj"), quant)?,
            down_proj: linear(i, h, bias, vb.pp("down_proj"), quant)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = candle_nn::ops::silu(&self.gate_proj.forward(x)?)?;
        self.down_proj.forward(&(gate * self.up_proj.forward(x)?)?)
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
        })
    }

    /// The layer's sliding window, if it has one.
    pub(super) fn window(&self) -> Option<usize> {
        self.self_attn.window
    }

    /// Every stream token through the layer.
    pub(super) fn forward(
        &self,
        layer: usize,
        x: &Tensor,
        seqs: &[Seq],
        rope: &Angles,
        plans: &[Plan],
        capture: &mut Capture,
    ) -> Result<Tensor> {
        let xn = self.input_layernorm.forward(x)?;
        let queries = Queries::Full(plans);
        let h = self
            .self_attn
            .forward(layer, Some(&xn), seqs, rope, &queries, capture)?;
        self.residual_mlp((x + h)?)
    }

    /// Only the rows `xq` (their residual stream before this layer) through the layer, over
    /// keys from the stream `x` (whose RoPE rows are `rope`) and the cache.
    pub(super) fn forward_gathered(
        &self,
        layer: usize,
        x: Option<&Tensor>,
        xq: &Tensor,
        reads: &ReadOut,
        rope: &Angles,
        capture: &mut Capture,
    ) -> Result<Tensor> {
        let xn = x.map(|x| self.input_layernorm.forward(x)).transpose()?;
        let xqn = self.input_layernorm.forward(xq)?;
        let queries = Queries::Gathered {
            xq: &xqn,
            rope: &reads.rope,
            chunks: &reads.chunks,
        };
        let h = self
            .self_attn
            .forward(layer, xn.as_ref(), &reads.seqs, rope, &queries, capture)?;
        self.residual_mlp((xq + h)?)
    }

    /// `x` (after attention) plus the MLP of its post-attention norm.
    fn residual_mlp(&self, x: Tensor) -> Result<Tensor> {
        let h = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&x)?)?;
        x + h
    }
}
