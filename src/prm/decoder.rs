//! One decoder-only transformer for Llama, Mistral and Qwen2 checkpoints that returns the final
//! (normed) hidden states only at the positions a scoring head reads.
//!
//! Written for scoring, not generation: no KV cache, causal masks built per call, right-padded
//! batches (a real token never sees the pads after it, so padding is exact), RoPE tables computed
//! in f32 (then cast, as transformers does), attention softmax in f32, queries chunked so score
//! memory stays bounded. The last layer runs attention queries and the MLP only for the gathered
//! rows, since nothing else of it is read.

use super::model_config::ModelConfig;
use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, Linear, RmsNorm, VarBuilder, rotary_emb::rope};

/// Bytes of f32 attention scores one query chunk may take; longer inputs are split into chunks
/// of query rows so memory grows as L * chunk instead of L * L.
const SCORES_BUDGET_BYTES: usize = 256 << 20;

struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
    window: Option<usize>,
}

struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

struct Layer {
    input_layernorm: RmsNorm,
    self_attn: Attention,
    post_attention_layernorm: RmsNorm,
    mlp: Mlp,
}

/// cos / sin tables, shape (max_positions, head_dim / 2), in the model dtype.
struct Rope {
    cos: Tensor,
    sin: Tensor,
}

pub struct Decoder {
    embed_tokens: Embedding,
    layers: Vec<Layer>,
    norm: RmsNorm,
    rope: Rope,
    n_heads: usize,
    /// `SCORES_BUDGET_BYTES`; tests lower it to force chunking.
    pub(super) scores_budget: usize,
}

/// Query rows of one attention call: `Full` is every position 0..L of every row, in the chunks of
/// the plan for the layer's window; `Gathered` is, per batch row, the same number `m` of positions
/// (shorter lists padded by repeating one).
enum Queries<'a> {
    Full(&'a [Plan]),
    Gathered {
        positions: &'a [Vec<usize>],
        m: usize,
    },
}

/// How the full layers with one sliding window (or none) split their queries into chunks, with
/// each chunk's mask built once per forward and shared by all those layers.
struct Plan {
    window: Option<usize>,
    chunks: Vec<Chunk>,
}

/// Queries `start..start + len` over keys `k_start..k_start + mask's last dim`, with the mask
/// shaped to broadcast over (B, nkv, group, len, keys). Keys after the chunk are masked for all
/// its queries, and so are keys before its first query's window: both are left out.
struct Chunk {
    start: usize,
    len: usize,
    k_start: usize,
    mask: Tensor,
}

/// A linear layer whose bias is loaded when the checkpoint has one (or the config says so, in which
/// case a missing tensor is an error).
fn linear(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    let bias = bias || vb.contains_tensor("bias");
    candle_nn::linear_b(in_dim, out_dim, bias, vb)
}

impl Rope {
    fn new(cfg: &ModelConfig, dtype: DType, dev: &Device) -> Result<Self> {
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
}

/// Additive f32 mask (R, k_len) for queries at positions `q_pos` (u32, (R,)) over keys at
/// `k_start..k_start + k_len`: 0 where j <= i and i - j < window, else -inf. Built on the device.
fn mask(q_pos: &Tensor, k_start: usize, k_len: usize, window: Option<usize>) -> Result<Tensor> {
    let dev = q_pos.device();
    // f32 holds positions exactly (< 2^24) and, unlike u32, i - window may go negative.
    let q = q_pos.to_dtype(DType::F32)?.unsqueeze(1)?;
    let k = Tensor::arange(k_start as f32, (k_start + k_len) as f32, dev)?.unsqueeze(0)?;
    let shape = (q.dim(0)?, k_len);
    let open = Tensor::zeros(shape, DType::F32, dev)?;
    let shut = Tensor::full(f32::NEG_INFINITY, shape, dev)?;
    let open = match window {
        Some(w) => k
            .broadcast_gt(&(&q - w as f64)?)?
            .where_cond(&open, &shut)?,
        None => open,
    };
    k.broadcast_le(&q)?.where_cond(&open, &shut)
}

impl Plan {
    fn new(l: usize, chunk: usize, window: Option<usize>, dev: &Device) -> Result<Self> {
        let chunks = (0..l)
            .step_by(chunk)
            .map(|start| {
                let len = chunk.min(l - start);
                let k_start = window.map_or(0, |w| (start + 1).saturating_sub(w));
                let q_pos = Tensor::arange(start as u32, (start + len) as u32, dev)?;
                let mask = mask(&q_pos, k_start, start + len - k_start, window)?;
                let mask = mask.reshape((1, 1, 1, len, ()))?;
                Ok(Chunk {
                    start,
                    len,
                    k_start,
                    mask,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { window, chunks })
    }
}

impl Attention {
    fn new(cfg: &ModelConfig, layer: usize, vb: VarBuilder) -> Result<Self> {
        let (h, hd, nh, nkv) = (
            cfg.hidden_size,
            cfg.head_dim(),
            cfg.num_attention_heads,
            cfg.kv_heads(),
        );
        let qkv_bias = cfg.attention_bias;
        Ok(Self {
            q_proj: linear(h, nh * hd, qkv_bias, vb.pp("q_proj"))?,
            k_proj: linear(h, nkv * hd, qkv_bias, vb.pp("k_proj"))?,
            v_proj: linear(h, nkv * hd, qkv_bias, vb.pp("v_proj"))?,
            o_proj: linear(nh * hd, h, false, vb.pp("o_proj"))?,
            n_heads: nh,
            n_kv: nkv,
            head_dim: hd,
            window: cfg.window_for_layer(layer),
        })
    }

    /// `x`: normed input (B, L, H). Returns (B, L, H) for `Full`, (B, m, H) for `Gathered`.
    fn forward(&self, x: &Tensor, rope: &Rope, queries: &Queries) -> Result<Tensor> {
        let (b, l, _) = x.dims3()?;
        let hd = self.head_dim;
        let heads = |t: Tensor, n: usize, rows: usize| {
            t.reshape((b, rows, n, hd))?.transpose(1, 2)?.contiguous()
        };
        let k = heads(self.k_proj.forward(x)?, self.n_kv, l)?;
        let v = heads(self.v_proj.forward(x)?, self.n_kv, l)?;
        let k = rope_apply(&k, &rope.cos.narrow(0, 0, l)?, &rope.sin.narrow(0, 0, l)?)?;
        let one_chunk: [Chunk; 1];
        let (q, rows, chunks) = match queries {
            Queries::Full(plans) => {
                let q = heads(self.q_proj.forward(x)?, self.n_heads, l)?;
                let q = rope_apply(&q, &rope.cos.narrow(0, 0, l)?, &rope.sin.narrow(0, 0, l)?)?;
                let plan = plans.iter().find(|p| p.window == self.window);
                let plan = plan.ok_or_else(|| candle_core::Error::Msg("no plan".into()))?;
                (q, l, plan.chunks.as_slice())
            }
            Queries::Gathered { positions, m } => {
                let (m, dev) = (*m, x.device());
                let xq = gather_rows(x, positions, m)?;
                let q = heads(self.q_proj.forward(&xq)?, self.n_heads, m)?;
                let flat: Vec<u32> = positions.iter().flatten().map(|p| *p as u32).collect();
                let pos = Tensor::from_vec(flat, b * m, dev)?;
                let cos = rope.cos.index_select(&pos, 0)?.reshape((b, m, hd / 2))?;
                let sin = rope.sin.index_select(&pos, 0)?.reshape((b, m, hd / 2))?;
                // One chunk, leaving out the keys no query reads (after the last position,
                // before the first one's window).
                let lo = positions.iter().flatten().min().copied().unwrap_or(0);
                let hi = positions.iter().flatten().max().copied().unwrap_or(0);
                let k_start = self.window.map_or(0, |w| (lo + 1).saturating_sub(w));
                let mask = mask(&pos, k_start, hi + 1 - k_start, self.window)?;
                let mask = mask.reshape((b, 1, 1, m, ()))?;
                one_chunk = [Chunk {
                    start: 0,
                    len: m,
                    k_start,
                    mask,
                }];
                (rope_apply(&q, &cos, &sin)?, m, one_chunk.as_slice())
            }
        };
        let mut outs = Vec::with_capacity(chunks.len());
        for c in chunks {
            let k_len = c.mask.dim(D::Minus1)?;
            outs.push(self.attend(
                &q.narrow(2, c.start, c.len)?.contiguous()?,
                &k.narrow(2, c.k_start, k_len)?.contiguous()?,
                &v.narrow(2, c.k_start, k_len)?.contiguous()?,
                &c.mask,
            )?);
        }
        let o = Tensor::cat(&outs, 2)?.transpose(1, 2)?;
        self.o_proj
            .forward(&o.reshape((b, rows, self.n_heads * hd))?)
    }

    /// Eager attention for q (B, nh, C, hd) over k, v (B, nkv, K, hd) with an additive f32 mask
    /// broadcastable to (B, 1, 1, C, K). Grouped-query heads are folded into the query rows so
    /// k and v are never repeated.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (b, nh, c, hd) = q.dims4()?;
        let group = nh / self.n_kv;
        let kl = k.dim(2)?;
        let q = q.reshape((b, self.n_kv, group * c, hd))?;
        let scores = q.matmul(&k.t()?)?.to_dtype(DType::F32)?;
        let scores = (scores.reshape((b, self.n_kv, group, c, kl))? * (1.0 / (hd as f64).sqrt()))?;
        let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(mask)?)?;
        let probs = probs
            .to_dtype(v.dtype())?
            .reshape((b, self.n_kv, group * c, kl))?;
        probs.matmul(v)?.reshape((b, nh, c, hd))
    }
}

/// HF rotate-half RoPE; candle's fused kernel wants contiguous input of one dtype.
fn rope_apply(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    rope(&x.contiguous()?, &cos.contiguous()?, &sin.contiguous()?)
}

impl Mlp {
    fn new(cfg: &ModelConfig, vb: VarBuilder) -> Result<Self> {
        let (h, i, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        Ok(Self {
            gate_proj: linear(h, i, bias, vb.pp("gate_proj"))?,
            up_proj: linear(h, i, bias, vb.pp("up_proj"))?,
            down_proj: linear(i, h, bias, vb.pp("down_proj"))?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = candle_nn::ops::silu(&self.gate_proj.forward(x)?)?;
        self.down_proj.forward(&(gate * self.up_proj.forward(x)?)?)
    }
}

impl Layer {
    fn new(cfg: &ModelConfig, layer: usize, vb: VarBuilder) -> Result<Self> {
        let eps = cfg.rms_norm_eps;
        Ok(Self {
            input_layernorm: candle_nn::rms_norm(cfg.hidden_size, eps, vb.pp("input_layernorm"))?,
            self_attn: Attention::new(cfg, layer, vb.pp("self_attn"))?,
            post_attention_layernorm: candle_nn::rms_norm(
                cfg.hidden_size,
                eps,
                vb.pp("post_attention_layernorm"),
            )?,
            mlp: Mlp::new(cfg, vb.pp("mlp"))?,
        })
    }

    /// `residual` is the stream the attention output is added to: `x` itself for `Full`, the
    /// gathered rows of `x` for `Gathered`.
    fn forward(
        &self,
        x: &Tensor,
        residual: &Tensor,
        rope: &Rope,
        queries: &Queries,
    ) -> Result<Tensor> {
        let h = self
            .self_attn
            .forward(&self.input_layernorm.forward(x)?, rope, queries)?;
        let x = (residual + h)?;
        let h = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&x)?)?;
        x + h
    }
}

impl Decoder {
    /// `vb` is the checkpoint root; weights are read from `model.*`.
    pub fn new(cfg: &ModelConfig, vb: VarBuilder) -> Result<Self> {
        let vb_m = vb.pp("model");
        let embed_tokens =
            candle_nn::embedding(cfg.vocab_size, cfg.hidden_size, vb_m.pp("embed_tokens"))?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::new(cfg, i, vb_m.pp("layers").pp(i)))
            .collect::<Result<Vec<_>>>()?;
        let norm = candle_nn::rms_norm(cfg.hidden_size, cfg.rms_norm_eps, vb_m.pp("norm"))?;
        let rope = Rope::new(cfg, vb.dtype(), vb.device())?;
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            rope,
            n_heads: cfg.num_attention_heads,
            scores_budget: SCORES_BUDGET_BYTES,
        })
    }

    /// The input embedding matrix (vocab, H), which a tied LM head reuses.
    pub fn embeddings(&self) -> &Tensor {
        self.embed_tokens.embeddings()
    }

    /// `ids`: a right-padded (B, L) u32 batch; `positions[b]`: the positions of row `b` to return
    /// (each < L and within the row's real tokens). Returns the final normed hidden states at those
    /// positions, (N, H) in row-major gather order, in the model dtype.
    pub fn forward(&self, ids: &Tensor, positions: &[&[usize]]) -> Result<Tensor> {
        let (b, l) = ids.dims2()?;
        if positions.len() != b {
            candle_core::bail!("{} position lists for a batch of {b}", positions.len())
        }
        if let Some(p) = positions.iter().flat_map(|p| p.iter()).find(|p| **p >= l) {
            candle_core::bail!("position {p} outside a batch of length {l}")
        }
        if l > self.rope.cos.dim(0)? {
            candle_core::bail!(
                "input of {l} tokens exceeds max_position_embeddings {}",
                self.rope.cos.dim(0)?
            )
        }
        // Each row's positions padded to the longest list by repeating one of them; the copies
        // are computed and dropped.
        let m = positions.iter().map(|p| p.len()).max().unwrap_or(0);
        if m == 0 {
            return Tensor::zeros(
                (0, self.embed_tokens.hidden_size()),
                self.embeddings().dtype(),
                ids.device(),
            );
        }
        let padded: Vec<Vec<usize>> = positions
            .iter()
            .map(|p| {
                let fill = p.last().copied().unwrap_or(0);
                p.iter()
                    .copied()
                    .chain(std::iter::repeat_n(fill, m - p.len()))
                    .collect()
            })
            .collect();
        let keep: Vec<u32> = positions
            .iter()
            .enumerate()
            .flat_map(|(row, p)| (0..p.len()).map(move |i| (row * m + i) as u32))
            .collect();
        let gathered = Queries::Gathered {
            positions: &padded,
            m,
        };

        let mut x = self.embed_tokens.forward(ids)?;
        let Some((last, full)) = self.layers.split_last() else {
            let rows = gather_rows(&x, &padded, m)?;
            return self.finish(&rows, &keep);
        };
        let chunk = (self.scores_budget / (4 * b * self.n_heads * l)).clamp(1, l);
        let mut plans: Vec<Plan> = Vec::new();
        for w in full.iter().map(|layer| layer.self_attn.window) {
            if !plans.iter().any(|p| p.window == w) {
                plans.push(Plan::new(l, chunk, w, ids.device())?);
            }
        }
        for layer in full {
            x = layer.forward(&x, &x, &self.rope, &Queries::Full(&plans))?;
        }
        let residual = gather_rows(&x, &padded, m)?;
        let rows = last.forward(&x, &residual, &self.rope, &gathered)?;
        self.finish(&rows, &keep)
    }

    /// Final norm on the (B, m, H) gathered rows, then drop the padding copies -> (N, H).
    fn finish(&self, rows: &Tensor, keep: &[u32]) -> Result<Tensor> {
        let (b, m, h) = rows.dims3()?;
        let keep = Tensor::from_slice(keep, keep.len(), rows.device())?;
        self.norm
            .forward(&rows.reshape((b * m, h))?.index_select(&keep, 0)?)
    }
}

/// Rows `positions[b][i]` of `x` (B, L, H) -> (B, m, H).
fn gather_rows(x: &Tensor, positions: &[Vec<usize>], m: usize) -> Result<Tensor> {
    let (b, l, h) = x.dims3()?;
    let idx: Vec<u32> = positions
        .iter()
        .enumerate()
        .flat_map(|(row, p)| p.iter().map(move |i| (row * l + i) as u32))
        .collect();
    let idx = Tensor::from_vec(idx, b * m, x.device())?;
    x.reshape((b * l, h))?
        .index_select(&idx, 0)?
        .reshape((b, m, h))
}
