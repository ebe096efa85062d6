//! One decoder-only transformer for Llama, Mistral and Qwen2 checkpoints that returns the final
//! (normed) hidden states only at the positions a scoring head reads.
//!
//! Written for scoring, not generation: no KV cache, causal masks built per call, batches packed
//! end to end without padding (each row attends over its own keys; see `packing`), RoPE tables
//! computed in f32 (then cast, as transformers does), attention softmax in f32, queries in blocks
//! that skip the masked upper triangle and keep score memory bounded. The last layer runs attention queries and the MLP only for the gathered
//! rows, since nothing else of it is read.

use super::model_config::ModelConfig;
use super::packing::{Seq, shared_prefix};
use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, Linear, RmsNorm, VarBuilder, rotary_emb::rope};

/// Bytes of f32 attention scores one query chunk may take; longer inputs are split into chunks
/// of query rows so memory grows as L * chunk instead of L * L.
const SCORES_BUDGET_BYTES: usize = 256 << 20;

/// Most queries per attention chunk. A chunk attends only to keys up to its last query, so
/// smaller chunks skip more of the causally masked upper triangle (whole-row chunks computed,
/// exponentiated and masked all of it: at 1,024 tokens attention took ~45% of the forward for
/// ~14% of its useful FLOPs); 128 queries still make matmuls large enough to run near peak.
const QUERY_BLOCK: usize = 128;

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

/// One batch row inside the packed token stream: its tokens are rows `start..start + len`.
/// Query rows of one attention call. `Full`: every token of every row, each row's queries in
/// the chunks of its plan for the layer's window (`plans[w][row]`). `Gathered`: only the rows a
/// head reads, `idx` into the packed stream, with each row's queries `chunks[row]` (one chunk).
enum Queries<'a> {
    Full(&'a [Plan]),
    Gathered {
        idx: &'a Tensor,
        cos: &'a Tensor,
        sin: &'a Tensor,
        chunks: &'a [Chunk],
    },
}

/// How every row splits its queries into chunks for the layers with one sliding window (or
/// none), with each chunk's mask built once per forward and shared by all those layers.
struct Plan {
    window: Option<usize>,
    rows: Vec<Vec<Chunk>>,
}

/// Queries `start..start + len` (in the row's query stream) over the row's keys at positions
/// `k_start..k_start + mask's last dim`, with the mask shaped to broadcast over
/// (1, nkv, group, len, keys). Keys after the chunk are masked for all its queries, and so are
/// keys before its first query's window: both are left out.
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
    fn new(
        seqs: &[Seq],
        budget: usize,
        n_heads: usize,
        window: Option<usize>,
        dev: &Device,
    ) -> Result<Self> {
        let rows = seqs
            .iter()
            .map(|seq| {
                let (l, p0) = (seq.len, seq.pos0);
                // Rows are attended one at a time, so the budget is per row.
                let chunk = (budget / (4 * n_heads * (p0 + l).max(1))).clamp(1, QUERY_BLOCK);
                (0..l)
                    .step_by(chunk)
                    .map(|start| {
                        let len = chunk.min(l - start);
                        let first = p0 + start;
                        let k_start = window.map_or(0, |w| (first + 1).saturating_sub(w));
                        let q_pos = Tensor::arange(first as u32, (first + len) as u32, dev)?;
                        let mask = mask(&q_pos, k_start, first + len - k_start, window)?;
                        let mask = mask.reshape((1, 1, 1, len, ()))?;
                        Ok(Chunk {
                            start,
                            len,
                            k_start,
                            mask,
                        })
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { window, rows })
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

    /// `x`: the normed packed stream (N, H); `cos`, `sin`: each token's RoPE rows (N, hd / 2).
    /// Returns (N, H) for `Full`, (rows of `idx`, H) for `Gathered`.
    fn forward(
        &self,
        x: &Tensor,
        seqs: &[Seq],
        cos: &Tensor,
        sin: &Tensor,
        queries: &Queries,
    ) -> Result<Tensor> {
        let n = x.dim(0)?;
        let hd = self.head_dim;
        // (rows, n * hd) -> (1, n, rows, hd): heads first, so a row's tokens are one narrow.
        let heads = |t: Tensor, nh: usize, rows: usize| {
            t.reshape((1, rows, nh, hd))?.transpose(1, 2)?.contiguous()
        };
        let k = heads(self.k_proj.forward(x)?, self.n_kv, n)?;
        let k = rope_apply(&k, cos, sin)?;
        let v = heads(self.v_proj.forward(x)?, self.n_kv, n)?;
        // The softmax scale goes on the queries (rows x hd) rather than the scores (rows x keys).
        let scale = 1.0 / (hd as f64).sqrt();
        let (q, rows) = match queries {
            Queries::Full(_) => {
                let q = heads((self.q_proj.forward(x)? * scale)?, self.n_heads, n)?;
                (rope_apply(&q, cos, sin)?, n)
            }
            Queries::Gathered {
                idx,
                cos: qcos,
                sin: qsin,
                ..
            } => {
                let m = idx.dim(0)?;
                let xq = x.index_select(idx, 0)?;
                let q = heads((self.q_proj.forward(&xq)? * scale)?, self.n_heads, m)?;
                (rope_apply(&q, qcos, qsin)?, m)
            }
        };
        let mut outs = Vec::new();
        for (row, seq) in seqs.iter().enumerate() {
            // Where the row's queries begin: its tokens for `Full`; for `Gathered`, chunk starts
            // are already offsets into the gathered rows.
            let mut q_start = 0;
            let chunks: &[Chunk] = match queries {
                Queries::Full(plans) => {
                    let plan = plans.iter().find(|p| p.window == self.window);
                    let plan = plan.ok_or_else(|| candle_core::Error::Msg("no plan".into()))?;
                    q_start = seq.start;
                    &plan.rows[row]
                }
                Queries::Gathered { chunks, .. } => std::slice::from_ref(&chunks[row]),
            };
            // A row with nothing to read has no queries in the last layer.
            for c in chunks.iter().filter(|c| c.len > 0) {
                let k_len = c.mask.dim(D::Minus1)?;
                outs.push(self.attend(
                    &q.narrow(2, q_start + c.start, c.len)?.contiguous()?,
                    &seq.keys(&k, c.k_start, k_len)?,
                    &seq.keys(&v, c.k_start, k_len)?,
                    &c.mask,
                )?);
            }
        }
        let o = Tensor::cat(&outs, 2)?.transpose(1, 2)?;
        self.o_proj.forward(&o.reshape((rows, self.n_heads * hd))?)
    }

    /// Eager attention for scaled q (B, nh, C, hd) over k, v (B, nkv, K, hd) with an additive
    /// f32 mask broadcastable to (B, 1, 1, C, K). Grouped-query heads are folded into the query
    /// rows so k and v are never repeated.
    fn attend(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (b, nh, c, hd) = q.dims4()?;
        let group = nh / self.n_kv;
        let kl = k.dim(2)?;
        let q = q.reshape((b, self.n_kv, group * c, hd))?;
        let scores = q.matmul(&k.t()?)?.to_dtype(DType::F32)?;
        let scores = scores.reshape((b, self.n_kv, group, c, kl))?;
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
        seqs: &[Seq],
        cos: &Tensor,
        sin: &Tensor,
        queries: &Queries,
    ) -> Result<Tensor> {
        let h =
            self.self_attn
                .forward(&self.input_layernorm.forward(x)?, seqs, cos, sin, queries)?;
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

    /// `rows`: the batch's token ids, any lengths; `positions[b]`: the positions of row `b` to
    /// return (each within the row). Returns the final normed hidden states at those positions,
    /// (N, H) in row-major order, in the model dtype.
    ///
    /// The rows are packed end to end, never padded: every matmul runs on real tokens only and
    /// each row attends over its own keys, so cost follows the sum of lengths (and of squared
    /// lengths for attention) rather than rows x the longest. Tokens after a row's last read
    /// position are dropped: under the causal mask nothing read depends on them.
    pub fn forward(&self, rows: &[&[u32]], positions: &[&[usize]]) -> Result<Tensor> {
        if positions.len() != rows.len() {
            candle_core::bail!(
                "{} position lists for a batch of {}",
                positions.len(),
                rows.len()
            )
        }
        let dev = self.embeddings().device().clone();
        let mut lens = Vec::with_capacity(rows.len());
        for (row, pos) in rows.iter().zip(positions) {
            if let Some(p) = pos.iter().find(|p| **p >= row.len()) {
                candle_core::bail!("position {p} outside a row of length {}", row.len())
            }
            let len = pos.iter().max().map_or(0, |p| p + 1);
            if len > self.rope.cos.dim(0)? {
                candle_core::bail!(
                    "input of {len} tokens exceeds max_position_embeddings {}",
                    self.rope.cos.dim(0)?
                )
            }
            lens.push(len);
        }
        let shared = shared_prefix(rows, positions, &lens);
        tracing::debug!(
            rows = rows.len(),
            tokens = lens.iter().sum::<usize>(),
            shared,
            "packed batch"
        );
        // The stream: the shared prefix once (a row of its own that nothing reads), then each
        // row's own tokens.
        let mut ids: Vec<u32> = Vec::new();
        let mut token_pos: Vec<u32> = Vec::new();
        let mut seqs = Vec::with_capacity(rows.len() + 1);
        if shared > 0 {
            let first = rows[lens.iter().position(|l| *l > 0).unwrap_or(0)];
            ids.extend_from_slice(&first[..shared]);
            token_pos.extend(0..shared as u32);
            seqs.push(Seq {
                start: 0,
                len: shared,
                pos0: 0,
                prefix_start: 0,
            });
        }
        for (row, &len) in rows.iter().zip(&lens) {
            let pos0 = if len > 0 { shared } else { 0 };
            seqs.push(Seq {
                start: ids.len(),
                len: len - pos0,
                pos0,
                prefix_start: 0,
            });
            ids.extend_from_slice(&row[pos0..len]);
            token_pos.extend(pos0 as u32..len as u32);
        }
        // Packed stream index of every read, in order, and each row's query chunk for the last
        // layer (which only computes those rows).
        let row_seqs = &seqs[seqs.len() - rows.len()..];
        let mut read_idx: Vec<u32> = Vec::new();
        let mut read_pos: Vec<u32> = Vec::new();
        for (seq, pos) in row_seqs.iter().zip(positions) {
            read_idx.extend(pos.iter().map(|p| (seq.start + p - seq.pos0) as u32));
            read_pos.extend(pos.iter().map(|p| *p as u32));
        }
        let h = self.embed_tokens.hidden_size();
        if read_idx.is_empty() {
            return Tensor::zeros((0, h), self.embeddings().dtype(), &dev);
        }
        let n = ids.len();
        let ids = Tensor::from_vec(ids, n, &dev)?;
        let token_pos = Tensor::from_vec(token_pos, n, &dev)?;
        let cos = self.rope.cos.index_select(&token_pos, 0)?;
        let sin = self.rope.sin.index_select(&token_pos, 0)?;
        let read_count = read_idx.len();
        let read_idx = Tensor::from_vec(read_idx, read_count, &dev)?;

        let mut x = self.embed_tokens.forward(&ids)?;
        let Some((last, full)) = self.layers.split_last() else {
            return self.norm.forward(&x.index_select(&read_idx, 0)?);
        };
        let mut plans: Vec<Plan> = Vec::new();
        for w in full.iter().map(|layer| layer.self_attn.window) {
            if !plans.iter().any(|p| p.window == w) {
                plans.push(Plan::new(&seqs, self.scores_budget, self.n_heads, w, &dev)?);
            }
        }
        for layer in full {
            x = layer.forward(&x, &x, &seqs, &cos, &sin, &Queries::Full(&plans))?;
        }
        drop(plans);
        // The last layer: queries, attention output and MLP for the read rows only.
        let window = last.self_attn.window;
        let mut chunks = Vec::with_capacity(seqs.len());
        if shared > 0 {
            // The prefix row: nothing to read.
            chunks.push(Chunk {
                start: 0,
                len: 0,
                k_start: 0,
                mask: Tensor::zeros((1, 1, 1, 0, 1), DType::F32, &dev)?,
            });
        }
        let mut start = 0;
        for pos in positions {
            let lo = pos.iter().min().copied().unwrap_or(0);
            let hi = pos.iter().max().copied().unwrap_or(0);
            let k_start = window.map_or(0, |w| (lo + 1).saturating_sub(w));
            let mask = match pos.is_empty() {
                true => Tensor::zeros((1, 1, 1, 0, 1), DType::F32, &dev)?,
                false => {
                    let q_pos: Vec<u32> = pos.iter().map(|p| *p as u32).collect();
                    let q_pos = Tensor::from_vec(q_pos, pos.len(), &dev)?;
                    mask(&q_pos, k_start, hi + 1 - k_start, window)?.reshape((
                        1,
                        1,
                        1,
                        pos.len(),
                        (),
                    ))?
                }
            };
            chunks.push(Chunk {
                start,
                len: pos.len(),
                k_start,
                mask,
            });
            start += pos.len();
        }
        let read_pos = Tensor::from_vec(read_pos, read_count, &dev)?;
        let gathered = Queries::Gathered {
            idx: &read_idx,
            cos: &self.rope.cos.index_select(&read_pos, 0)?,
            sin: &self.rope.sin.index_select(&read_pos, 0)?,
            chunks: &chunks,
        };
        let residual = x.index_select(&read_idx, 0)?;
        let rows = last.forward(&x, &residual, &seqs, &cos, &sin, &gathered)?;
        self.norm.forward(&rows)
    }
}
