//! One decoder-only transformer for Llama, Mistral and Qwen2 checkpoints that returns the final
//! (normed) hidden states only at the positions a scoring head reads.
//!
//! Written for scoring, not generation: no KV cache, causal masks built per call, batches packed
//! end to end without padding (each row attends over its own keys; see `packing`), RoPE tables
//! computed in f32 (then cast, as transformers does), attention softmax in f32, queries in blocks
//! that skip the masked upper triangle and keep score memory bounded. The last layer runs attention queries and the MLP only for the gathered
//! rows, since nothing else of it is read.

use crate::config::ModelConfig;
use crate::gguf::Gguf;
use crate::layers::{Emb, Lin};
use crate::packing::{Run, Seq, Src, Which};
use crate::plan::{self, Layout};
use crate::prefix_cache::{Hit, Kv, owned};
use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::{RmsNorm, VarBuilder, rotary_emb::rope};

/// Bytes of f32 attention scores one query chunk may take; longer inputs are split into chunks
/// of query rows so memory grows as L * chunk instead of L * L.
pub(super) const SCORES_BUDGET_BYTES: usize = 256 << 20;

/// Most queries per attention chunk. A chunk attends only to keys up to its last query, so
/// smaller chunks skip more of the causally masked upper triangle (whole-row chunks computed,
/// exponentiated and masked all of it: at 1,024 tokens attention took ~45% of the forward for
/// ~14% of its useful FLOPs); 128 queries still make matmuls large enough to run near peak.
const QUERY_BLOCK: usize = 128;

/// `QUERY_BLOCK` on a GPU. There every chunk costs a dozen kernel launches whatever its size,
/// and a (1,024 x keys) score block is still small for the card, so fewer, larger chunks win
/// over skipping more of the masked triangle.
pub(super) const QUERY_BLOCK_GPU: usize = 1024;

struct Attention {
    q_proj: Lin,
    k_proj: Lin,
    v_proj: Lin,
    o_proj: Lin,
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
    window: Option<usize>,
}

struct Mlp {
    gate_proj: Lin,
    up_proj: Lin,
    down_proj: Lin,
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

/// A forward pass's result: the final normed hidden states at the reads, (reads, H) in row-major
/// order, and the keys and values of each captured segment (by segment index).
pub struct Output {
    pub hidden: Tensor,
    pub captured: Vec<(usize, Kv)>,
}

pub struct Decoder {
    embed_tokens: Emb,
    layers: Vec<Layer>,
    norm: RmsNorm,
    rope: Rope,
    n_heads: usize,
    /// `SCORES_BUDGET_BYTES`; tests lower it to force chunking.
    pub(super) scores_budget: usize,
    /// Most queries per attention chunk: `QUERY_BLOCK`, or `QUERY_BLOCK_GPU` off the CPU.
    pub(super) query_block: usize,
}

/// Query rows of one attention call. `Full`: every stream token of every segment, each
/// segment's queries in the chunks of its plan for the layer's window (`plans[w][segment]`).
/// `Gathered`: only the positions a head reads, `xq` (normed) in group order, each group's
/// queries one chunk.
enum Queries<'a> {
    Full(&'a [Plan]),
    Gathered {
        xq: &'a Tensor,
        cos: &'a Tensor,
        sin: &'a Tensor,
        chunks: &'a [Chunk],
    },
}

/// Keys and values a forward pass copies out for the prefix cache: per captured segment (its
/// stream rows `start..start + len`), every layer's, in layer order.
struct Capture {
    segments: Vec<(usize, usize)>,
    k: Vec<Vec<Tensor>>,
    v: Vec<Vec<Tensor>>,
}

impl Capture {
    fn take(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        for (i, &(start, len)) in self.segments.iter().enumerate() {
            // A segment that is the whole batch is the layer's own fresh tensor.
            let cut = |t: &Tensor| match (start, len) {
                (0, n) if n == t.dim(2)? => Ok(t.clone()),
                _ => owned(&t.narrow(2, start, len)?),
            };
            self.k[i].push(cut(k)?);
            self.v[i].push(cut(v)?);
        }
        Ok(())
    }
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
/// case a missing tensor is an error). A GGUF's quantized matrix stays quantized; its bias is f32.
fn linear(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder, q: Q) -> Result<Lin> {
    let bias = bias || vb.contains_tensor("bias");
    if let Some(w) = q
        .map(|g| g.quantized(&format!("{}.weight", vb.prefix()), vb.device()))
        .transpose()?
        .flatten()
    {
        let b = bias.then(|| vb.get(out_dim, "bias")).transpose()?;
        return Lin::quant(w, b);
    }
    Ok(Lin::Full(candle_nn::linear_b(in_dim, out_dim, bias, vb)?))
}

/// Where quantized matrices come from: a GGUF, or nowhere (safetensors load in full).
type Q<'a> = Option<&'a Gguf>;

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
        (budget, block): (usize, usize),
        n_heads: usize,
        window: Option<usize>,
        dev: &Device,
    ) -> Result<Self> {
        let rows = seqs
            .iter()
            .map(|seq| {
                let (l, p0) = (seq.len, seq.pos0);
                // Rows are attended one at a time, so the budget is per row.
                let chunk = (budget / (4 * n_heads * (p0 + l).max(1))).clamp(1, block);
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
    fn new(cfg: &ModelConfig, layer: usize, vb: VarBuilder, q: Q) -> Result<Self> {
        let (h, hd, nh, nkv) = (
            cfg.hidden_size,
            cfg.head_dim(),
            cfg.num_attention_heads,
            cfg.kv_heads(),
        );
        let qkv_bias = cfg.attention_bias;
        Ok(Self {
            q_proj: linear(h, nh * hd, qkv_bias, vb.pp("q_proj"), q)?,
            k_proj: linear(h, nkv * hd, qkv_bias, vb.pp("k_proj"), q)?,
            v_proj: linear(h, nkv * hd, qkv_bias, vb.pp("v_proj"), q)?,
            o_proj: linear(nh * hd, h, false, vb.pp("o_proj"), q)?,
            n_heads: nh,
            n_kv: nkv,
            head_dim: hd,
            window: cfg.window_for_layer(layer),
        })
    }

    /// `x`: the normed packed stream (N, H), `None` when the batch computes no token; `cos`,
    /// `sin`: each stream token's RoPE rows (N, hd / 2); `seqs`: the query groups (the stream's
    /// segments for `Full`, the read groups for `Gathered`). Returns (N, H) for `Full`, (rows
    /// of `xq`, H) for `Gathered`.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        layer: usize,
        x: Option<&Tensor>,
        seqs: &[Seq],
        cos: &Tensor,
        sin: &Tensor,
        queries: &Queries,
        capture: &mut Capture,
    ) -> Result<Tensor> {
        let hd = self.head_dim;
        // (rows, n * hd) -> (1, n, rows, hd): heads first, so a row's tokens are one narrow.
        let heads = |t: Tensor, nh: usize, rows: usize| {
            t.reshape((1, rows, nh, hd))?.transpose(1, 2)?.contiguous()
        };
        let (k, v) = match x {
            Some(x) => {
                let n = x.dim(0)?;
                let k = heads(self.k_proj.forward(x)?, self.n_kv, n)?;
                let k = rope_apply(&k, cos, sin)?;
                let v = heads(self.v_proj.forward(x)?, self.n_kv, n)?;
                capture.take(&k, &v)?;
                (Some(k), Some(v))
            }
            None => (None, None),
        };
        // The softmax scale goes on the queries (rows x hd) rather than the scores (rows x keys).
        let scale = 1.0 / (hd as f64).sqrt();
        let (q, rows) = match (queries, x) {
            (Queries::Full(_), Some(x)) => {
                let n = x.dim(0)?;
                let q = heads((self.q_proj.forward(x)? * scale)?, self.n_heads, n)?;
                (rope_apply(&q, cos, sin)?, n)
            }
            (Queries::Full(_), None) => candle_core::bail!("full attention over no tokens"),
            (
                Queries::Gathered {
                    xq,
                    cos: qcos,
                    sin: qsin,
                    ..
                },
                _,
            ) => {
                let m = xq.dim(0)?;
                let q = heads((self.q_proj.forward(xq)? * scale)?, self.n_heads, m)?;
                (rope_apply(&q, qcos, qsin)?, m)
            }
        };
        let mut outs = Vec::new();
        for (row, seq) in seqs.iter().enumerate() {
            // Where the group's queries begin: its stream tokens for `Full`; for `Gathered`,
            // chunk starts are already offsets into the gathered rows.
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
            for c in chunks.iter().filter(|c| c.len > 0) {
                let k_len = c.mask.dim(D::Minus1)?;
                outs.push(self.attend(
                    &q.narrow(2, q_start + c.start, c.len)?.contiguous()?,
                    &seq.keys(layer, Which::K, k.as_ref(), c.k_start, k_len)?,
                    &seq.keys(layer, Which::V, v.as_ref(), c.k_start, k_len)?,
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
    fn new(cfg: &ModelConfig, vb: VarBuilder, q: Q) -> Result<Self> {
        let (h, i, bias) = (cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias);
        Ok(Self {
            gate_proj: linear(h, i, bias, vb.pp("gate_proj"), q)?,
            up_proj: linear(h, i, bias, vb.pp("up_proj"), q)?,
            down_proj: linear(i, h, bias, vb.pp("down_proj"), q)?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = candle_nn::ops::silu(&self.gate_proj.forward(x)?)?;
        self.down_proj.forward(&(gate * self.up_proj.forward(x)?)?)
    }
}

impl Layer {
    fn new(cfg: &ModelConfig, layer: usize, vb: VarBuilder, q: Q) -> Result<Self> {
        let eps = cfg.rms_norm_eps;
        Ok(Self {
            input_layernorm: candle_nn::rms_norm(cfg.hidden_size, eps, vb.pp("input_layernorm"))?,
            self_attn: Attention::new(cfg, layer, vb.pp("self_attn"), q)?,
            post_attention_layernorm: candle_nn::rms_norm(
                cfg.hidden_size,
                eps,
                vb.pp("post_attention_layernorm"),
            )?,
            mlp: Mlp::new(cfg, vb.pp("mlp"), q)?,
        })
    }

    /// Every stream token through the layer.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        layer: usize,
        x: &Tensor,
        seqs: &[Seq],
        cos: &Tensor,
        sin: &Tensor,
        plans: &[Plan],
        capture: &mut Capture,
    ) -> Result<Tensor> {
        let xn = self.input_layernorm.forward(x)?;
        let h = self.self_attn.forward(
            layer,
            Some(&xn),
            seqs,
            cos,
            sin,
            &Queries::Full(plans),
            capture,
        )?;
        let x = (x + h)?;
        let h = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&x)?)?;
        x + h
    }

    /// Only the rows `xq` (their residual stream before this layer) through the layer, over
    /// keys from the stream `x` and the cache.
    #[allow(clippy::too_many_arguments)]
    fn forward_gathered(
        &self,
        layer: usize,
        x: Option<&Tensor>,
        xq: &Tensor,
        groups: &[Seq],
        chunks: &[Chunk],
        cos: &Tensor,
        sin: &Tensor,
        qcos: &Tensor,
        qsin: &Tensor,
        capture: &mut Capture,
    ) -> Result<Tensor> {
        let xn = x.map(|x| self.input_layernorm.forward(x)).transpose()?;
        let xqn = self.input_layernorm.forward(xq)?;
        let queries = Queries::Gathered {
            xq: &xqn,
            cos: qcos,
            sin: qsin,
            chunks,
        };
        let h = self
            .self_attn
            .forward(layer, xn.as_ref(), groups, cos, sin, &queries, capture)?;
        let x = (xq + h)?;
        let h = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&x)?)?;
        x + h
    }
}

impl Decoder {
    /// `vb` is the checkpoint root; weights are read from `model.*`, the matrices from `q` when
    /// it holds them quantized.
    pub fn new(cfg: &ModelConfig, vb: VarBuilder, q: Q) -> Result<Self> {
        let vb_m = vb.pp("model");
        let embed_tokens = match q
            .map(|g| g.quantized("model.embed_tokens.weight", vb.device()))
            .transpose()?
            .flatten()
        {
            Some(table) => Emb::Quant {
                table: std::sync::Arc::new(table),
                dtype: vb.dtype(),
            },
            None => Emb::Full(candle_nn::embedding(
                cfg.vocab_size,
                cfg.hidden_size,
                vb_m.pp("embed_tokens"),
            )?),
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::new(cfg, i, vb_m.pp("layers").pp(i), q))
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
            query_block: match vb.device() {
                Device::Cpu => QUERY_BLOCK,
                _ => QUERY_BLOCK_GPU,
            },
        })
    }

    /// The input embedding, whose rows a tied LM head reuses.
    pub fn embeddings(&self) -> &Emb {
        &self.embed_tokens
    }

    /// Each row cut to the tokens it needs (up to its last read: under the causal mask nothing
    /// read depends on later tokens), checked against the positions the model has.
    fn lengths(&self, rows: &[&[u32]], positions: &[&[usize]]) -> Result<Vec<usize>> {
        if positions.len() != rows.len() {
            candle_core::bail!(
                "{} position lists for a batch of {}",
                positions.len(),
                rows.len()
            )
        }
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
        Ok(lens)
    }

    /// The batch's layout: each row's cached prefix (`hits`), then the segments the stream
    /// computes, shared between rows when `share`.
    pub fn layout(
        &self,
        rows: &[&[u32]],
        positions: &[&[usize]],
        hits: &[Hit],
        share: bool,
    ) -> Result<Layout> {
        let lens = self.lengths(rows, positions)?;
        let cut: Vec<&[u32]> = rows.iter().zip(&lens).map(|(r, &l)| &r[..l]).collect();
        let cached: Vec<usize> = hits.iter().map(|h| h.len).collect();
        Ok(plan::layout(&cut, &cached, share))
    }

    /// Runs a laid-out batch: the stream through every layer (the last one only at the reads),
    /// attending over cached keys where the layout says; copies out the keys and values of the
    /// segments named in `capture` for the cache.
    pub fn run(
        &self,
        rows: &[&[u32]],
        positions: &[&[usize]],
        hits: &[Hit],
        layout: &Layout,
        capture: &[usize],
    ) -> Result<Output> {
        let dev = self.embeddings().device();
        let h = self.embed_tokens.hidden_size();
        let dtype = self.embeddings().dtype();
        // A row's cached runs below `upto`.
        let cached_runs = |row: usize, upto: usize| -> Vec<Run<'_>> {
            hits[row]
                .pieces
                .iter()
                .filter(|p| p.pos < upto)
                .map(|p| Run {
                    pos: p.pos,
                    len: p.len.min(upto - p.pos),
                    src: Src::Cached(&p.kv, p.offset),
                })
                .collect()
        };
        let segs = &layout.segments;
        // A segment's context: its row's cached prefix, then its ancestors in the stream.
        let context = |s: usize| -> Vec<Run<'_>> {
            let seg = &segs[s];
            let mut runs = cached_runs(seg.row, layout.cached[seg.row].min(seg.pos0));
            let mut chain = Vec::new();
            let mut at = seg.parent;
            while let Some(p) = at {
                chain.push(p);
                at = segs[p].parent;
            }
            runs.extend(chain.into_iter().rev().map(|p| Run {
                pos: segs[p].pos0,
                len: segs[p].len,
                src: Src::Stream(segs[p].start),
            }));
            runs
        };
        let seqs: Vec<Seq> = (0..segs.len())
            .map(|s| Seq {
                start: segs[s].start,
                len: segs[s].len,
                pos0: segs[s].pos0,
                context: context(s),
            })
            .collect();
        let mut ids: Vec<u32> = Vec::with_capacity(layout.tokens);
        let mut token_pos: Vec<u32> = Vec::with_capacity(layout.tokens);
        for seg in segs {
            ids.extend_from_slice(&rows[seg.row][seg.pos0..seg.pos0 + seg.len]);
            token_pos.extend(seg.pos0 as u32..(seg.pos0 + seg.len) as u32);
        }

        // The reads: grouped by the segment that holds them (a position several rows read is
        // computed once), or, inside a row's cached prefix, by row.
        let mut stream_groups: Vec<(usize, Vec<usize>)> = Vec::new();
        let mut cached_groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for (row, pos) in positions.iter().enumerate() {
            for &p in pos.iter() {
                let (groups, key) = match p < layout.cached[row] {
                    true => (&mut cached_groups, row),
                    false => {
                        let s = layout.segment_at(row, p).ok_or_else(|| {
                            candle_core::Error::Msg(format!(
                                "row {row}: position {p} laid out nowhere"
                            ))
                        })?;
                        (&mut stream_groups, s)
                    }
                };
                match groups.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, list)) => list.push(p),
                    None => groups.push((key, vec![p])),
                }
            }
        }
        for (_, list) in stream_groups.iter_mut().chain(cached_groups.iter_mut()) {
            list.sort_unstable();
            list.dedup();
        }
        let read_count: usize = positions.iter().map(|p| p.len()).sum();
        if read_count == 0 {
            return Ok(Output {
                hidden: Tensor::zeros((0, h), dtype, &dev)?,
                captured: Vec::new(),
            });
        }

        let n = ids.len();
        let stream_cos_sin = |pos: Vec<u32>| -> Result<(Tensor, Tensor)> {
            let count = pos.len();
            let pos = Tensor::from_vec(pos, count, &dev)?;
            Ok((
                self.rope.cos.index_select(&pos, 0)?,
                self.rope.sin.index_select(&pos, 0)?,
            ))
        };
        let (cos, sin) = stream_cos_sin(token_pos)?;
        let mut cap = Capture {
            segments: capture
                .iter()
                .map(|&s| (segs[s].start, segs[s].len))
                .collect(),
            k: vec![Vec::new(); capture.len()],
            v: vec![Vec::new(); capture.len()],
        };
        let (last, full) = self
            .layers
            .split_last()
            .ok_or_else(|| candle_core::Error::Msg("a decoder with no layers".into()))?;
        // Every index the pass uploads is built here, before the first layer is queued: on a GPU
        // a copy from pageable host memory can wait for the kernels queued before it.
        // The last layer runs for the reads only: their rows of its input, from the stream or the
        // cache, in group order (stream groups first).
        let window = last.self_attn.window;
        let mut groups: Vec<Seq> = Vec::new();
        let mut chunks: Vec<Chunk> = Vec::new();
        let mut q_pos: Vec<u32> = Vec::new();
        let mut stream_idx: Vec<u32> = Vec::new();
        let mut cached_x: Vec<Tensor> = Vec::new();
        let mut out_at: Vec<((bool, usize), usize)> = Vec::new();
        let mut add_chunk = |list: &[usize], q_pos: &mut Vec<u32>| -> Result<()> {
            let (lo, hi) = (list[0], list[list.len() - 1]);
            let k_start = window.map_or(0, |w| (lo + 1).saturating_sub(w));
            let qp: Vec<u32> = list.iter().map(|p| *p as u32).collect();
            let qt = Tensor::from_vec(qp.clone(), qp.len(), &dev)?;
            let m =
                mask(&qt, k_start, hi + 1 - k_start, window)?.reshape((1, 1, 1, qp.len(), ()))?;
            chunks.push(Chunk {
                start: q_pos.len(),
                len: qp.len(),
                k_start,
                mask: m,
            });
            q_pos.extend(qp);
            Ok(())
        };
        for (s, list) in &stream_groups {
            let seg = &segs[*s];
            for &p in list {
                out_at.push(((false, *s), p));
                stream_idx.push((seg.start + p - seg.pos0) as u32);
            }
            add_chunk(list, &mut q_pos)?;
            groups.push(seqs[*s].clone());
        }
        for (row, list) in &cached_groups {
            for &p in list {
                out_at.push(((true, *row), p));
                let piece = hits[*row]
                    .pieces
                    .iter()
                    .find(|c| (c.pos..c.pos + c.len).contains(&p))
                    .ok_or_else(|| candle_core::Error::Msg(format!("position {p} not cached")))?;
                cached_x.push(piece.kv.x.narrow(0, piece.offset + p - piece.pos, 1)?);
            }
            let seq = Seq {
                start: 0,
                len: 0,
                pos0: layout.cached[*row],
                context: cached_runs(*row, layout.cached[*row]),
            };
            add_chunk(list, &mut q_pos)?;
            groups.push(seq);
        }
        let (qcos, qsin) = stream_cos_sin(q_pos)?;
        let stream_idx = match stream_idx.len() {
            0 => None,
            count => Some(Tensor::from_vec(stream_idx, count, &dev)?),
        };
        // Back to row-major read order, uploaded with the other indices.
        let mut order = Vec::with_capacity(read_count);
        for (row, pos) in positions.iter().enumerate() {
            for &p in pos.iter() {
                let key = match p < layout.cached[row] {
                    true => (true, row),
                    false => (false, layout.segment_at(row, p).expect("laid out above")),
                };
                let at = out_at
                    .iter()
                    .position(|&(k, q)| k == key && q == p)
                    .expect("every read is gathered");
                order.push(at as u32);
            }
        }
        let order = Tensor::from_vec(order, read_count, &dev)?;
        let mut plans: Vec<Plan> = Vec::new();
        if n > 0 {
            for w in full.iter().map(|layer| layer.self_attn.window) {
                if !plans.iter().any(|p| p.window == w) {
                    let budget = (self.scores_budget, self.query_block);
                    plans.push(Plan::new(&seqs, budget, self.n_heads, w, &dev)?);
                }
            }
        }
        let mut x = match n {
            0 => None,
            _ => Some(
                self.embed_tokens
                    .forward(&Tensor::from_vec(ids, n, &dev)?)?,
            ),
        };
        if let Some(stream) = x.as_mut() {
            for (li, layer) in full.iter().enumerate() {
                *stream = layer.forward(li, stream, &seqs, &cos, &sin, &plans, &mut cap)?;
            }
        }

        let mut parts = Vec::new();
        if let (Some(stream), Some(idx)) = (x.as_ref(), stream_idx.as_ref()) {
            parts.push(stream.index_select(idx, 0)?);
        }
        parts.extend(cached_x);
        let xq = Tensor::cat(&parts, 0)?;
        // The last layer's input is what a later read inside this prefix starts from.
        let last_in: Vec<Tensor> = match x.as_ref() {
            Some(stream) => cap
                .segments
                .iter()
                .map(|&(start, len)| owned(&stream.narrow(0, start, len)?))
                .collect::<Result<_>>()?,
            None => Vec::new(),
        };
        let read = last.forward_gathered(
            full.len(),
            x.as_ref(),
            &xq,
            &groups,
            &chunks,
            &cos,
            &sin,
            &qcos,
            &qsin,
            &mut cap,
        )?;
        let read = self.norm.forward(&read)?;
        let hidden = read.index_select(&order, 0)?;
        let captured = capture
            .iter()
            .zip(cap.k.into_iter().zip(cap.v))
            .zip(last_in)
            .map(|((&s, (k, v)), x)| (s, Kv { k, v, x }))
            .collect();
        Ok(Output { hidden, captured })
    }
}
