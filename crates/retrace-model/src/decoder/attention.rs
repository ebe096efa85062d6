//! Attention over the packed stream: the projections and RoPE, the chunk plan that splits each
//! row's queries into blocks, and the causal (and sliding-window) masks those blocks use; on
//! CPU f32 the fused kernels (`flash`) take RoPE and the attention itself, the eager path
//! elsewhere.

use super::QuantSource;
use super::capture::Capture;
use super::flash::{self, Group};
use super::layer::linear;
use super::packing::{Seq, Which};
use crate::config::ModelConfig;
use crate::kernels::{Heads, Kernels, rope_heads};
use crate::layers::Lin;
use candle_core::{D, DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;

pub(super) struct Attention {
    q_proj: Lin,
    k_proj: Lin,
    v_proj: Lin,
    o_proj: Lin,
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
    /// The layer's sliding window; `None` attends to every earlier key.
    pub(super) window: Option<usize>,
    pub(super) kernels: Kernels,
}

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

/// Query rows of one attention call. `Full`: every stream token of every segment, each
/// segment's queries in the chunks of its plan for the layer's window (`plans[w][segment]`).
/// `Gathered`: only the positions a head reads, `xq` (normed) in group order with their own
/// RoPE rows, each group's queries one chunk.
pub(super) enum Queries<'a> {
    Full(&'a [Plan]),
    Gathered {
        xq: &'a Tensor,
        rope: &'a Angles,
        chunks: &'a [Chunk],
    },
}

/// How every row splits its queries into chunks for the layers with one sliding window (or
/// none), with each chunk's mask built once per forward and shared by all those layers.
pub(super) struct Plan {
    window: Option<usize>,
    rows: Vec<Vec<Chunk>>,
}

/// Queries `start..start + len` (in the row's query stream) over the row's keys at positions
/// `k_start..k_start + mask's last dim`, with the mask shaped to broadcast over
/// (1, nkv, group, len, keys). Keys after the chunk are masked for all its queries, and so are
/// keys before its first query's window: both are left out. `q_pos` holds the queries'
/// positions (what the fused kernel masks by).
pub(super) struct Chunk {
    pub(super) start: usize,
    len: usize,
    k_start: usize,
    mask: Tensor,
    pub(super) q_pos: Vec<u32>,
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
    fn apply(&self, x: &Tensor, n: usize, scale: Option<f64>, k: Kernels) -> Result<Tensor> {
        rope_heads(x, &self.cos, &self.sin, n, scale, k)
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

impl Chunk {
    /// One group of reads, `positions` (sorted, not empty), as queries `start..` of the
    /// gathered rows: over the keys up to the last of them, from the first one's window on.
    pub(super) fn at_reads(
        positions: &[usize],
        start: usize,
        window: Option<usize>,
        dev: &Device,
    ) -> Result<Self> {
        let (Some(&lo), Some(&hi)) = (positions.first(), positions.last()) else {
            candle_core::bail!("a read group with no position")
        };
        let k_start = window.map_or(0, |w| (lo + 1).saturating_sub(w));
        let qp: Vec<u32> = positions.iter().map(|p| *p as u32).collect();
        let qt = Tensor::from_vec(qp.clone(), qp.len(), dev)?;
        let m = mask(&qt, k_start, hi + 1 - k_start, window)?.reshape((1, 1, 1, qp.len(), ()))?;
        Ok(Self {
            start,
            len: qp.len(),
            k_start,
            mask: m,
            q_pos: qp,
        })
    }
}

impl Plan {
    pub(super) fn new(
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
                        let q_pos: Vec<u32> = (first as u32..(first + len) as u32).collect();
                        let qt = Tensor::from_slice(&q_pos, len, dev)?;
                        let mask = mask(&qt, k_start, first + len - k_start, window)?;
                        let mask = mask.reshape((1, 1, 1, len, ()))?;
                        Ok(Chunk {
                            start,
                            len,
                            k_start,
                            mask,
                            q_pos,
                        })
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { window, rows })
    }

    /// The window of the layers this plan is for.
    pub(super) fn window(&self) -> Option<usize> {
        self.window
    }
}

impl Attention {
    pub(super) fn new(
        cfg: &ModelConfig,
        layer: usize,
        vb: VarBuilder,
        quant: QuantSource,
    ) -> Result<Self> {
        let (h, hd, nh, nkv) = (
            cfg.hidden_size,
            cfg.head_dim(),
            cfg.num_attention_heads,
            cfg.kv_heads(),
        );
        let qkv_bias = cfg.attention_bias;
        Ok(Self {
            q_proj: linear(h, nh * hd, qkv_bias, vb.pp("q_proj"), quant)?,
            k_proj: linear(h, nkv * hd, qkv_bias, vb.pp("k_proj"), quant)?,
            v_proj: linear(h, nkv * hd, qkv_bias, vb.pp("v_proj"), quant)?,
            o_proj: linear(nh * hd, h, false, vb.pp("o_proj"), quant)?,
            n_heads: nh,
            n_kv: nkv,
            head_dim: hd,
            window: cfg.window_for_layer(layer),
            kernels: Kernels::default(),
        })
    }

    /// `x`: the normed packed stream (N, H), `None` when the batch computes no token; `rope`:
    /// each stream token's RoPE rows; `seqs`: the query groups (the stream's segments for
    /// `Full`, the read groups for `Gathered`). Returns (N, H) for `Full`, (rows of `xq`, H)
    /// for `Gathered`.
    pub(super) fn forward(
        &self,
        layer: usize,
        x: Option<&Tensor>,
        seqs: &[Seq],
        rope: &Angles,
        queries: &Queries,
        capture: &mut Capture,
    ) -> Result<Tensor> {
        let (k, v) = match x {
            Some(x) => {
                let n = x.dim(0)?;
                let k = rope.apply(&self.k_proj.forward(x)?, self.n_kv, None, self.kernels)?;
                let v = self.heads(self.v_proj.forward(x)?, self.n_kv, n)?;
                capture.take(&k, &v)?;
                (Some(k), Some(v))
            }
            None => (None, None),
        };
        let (q, rows) = self.queries(x, rope, queries)?;
        if self.kernels.fused_for(&q) {
            let groups = (0..seqs.len())
                .map(|row| {
                    let (q_start, chunks) = self.chunks(queries, row, &seqs[row])?;
                    let seq = &seqs[row];
                    Ok(Group {
                        seq,
                        q_start,
                        chunks,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let dims = Heads {
                heads: self.n_heads,
                kv: self.n_kv,
                hd: self.head_dim,
                window: self.window,
            };
            let o = flash::attend(&q, (k.as_ref(), v.as_ref()), layer, &groups, dims)?;
            return self.o_proj.forward(&o);
        }
        let mut outs = Vec::new();
        for (row, seq) in seqs.iter().enumerate() {
            let (q_start, chunks) = self.chunks(queries, row, seq)?;
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
        self.o_proj
            .forward(&o.reshape((rows, self.n_heads * self.head_dim))?)
    }

    /// (rows, n * hd) -> (1, n, rows, hd): heads first, so a row's tokens are one narrow.
    fn heads(&self, t: Tensor, n: usize, rows: usize) -> Result<Tensor> {
        t.reshape((1, rows, n, self.head_dim))?
            .transpose(1, 2)?
            .contiguous()
    }

    /// The scaled, rotated queries (1, n_heads, rows, hd) and their row count.
    fn queries(
        &self,
        x: Option<&Tensor>,
        rope: &Angles,
        queries: &Queries,
    ) -> Result<(Tensor, usize)> {
        // The softmax scale goes on the queries (rows x hd) rather than the scores (rows x keys).
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let (xq, rope) = match (queries, x) {
            (Queries::Full(_), Some(x)) => (x, rope),
            (Queries::Full(_), None) => candle_core::bail!("full attention over no tokens"),
            (Queries::Gathered { xq, rope, .. }, _) => (*xq, *rope),
        };
        let rows = xq.dim(0)?;
        let q = self.q_proj.forward(xq)?;
        Ok((
            rope.apply(&q, self.n_heads, Some(scale), self.kernels)?,
            rows,
        ))
    }

    /// Where query group `row` begins among the queries (its stream tokens for `Full`; for
    /// `Gathered`, chunk starts are already offsets into the gathered rows) and its chunks.
    fn chunks<'q>(
        &self,
        queries: &'q Queries,
        row: usize,
        seq: &Seq,
    ) -> Result<(usize, &'q [Chunk])> {
        let missing = |what: &str| candle_core::Error::Msg(format!("no {what} for group {row}"));
        match queries {
            Queries::Full(plans) => {
                let plan = plans.iter().find(|p| p.window == self.window);
                let plan = plan.ok_or_else(|| missing("plan"))?;
                let chunks = plan.rows.get(row).ok_or_else(|| missing("chunks"))?;
                Ok((seq.start, chunks))
            }
            Queries::Gathered { chunks, .. } => {
                let chunk = chunks.get(row).ok_or_else(|| missing("chunk"))?;
                Ok((0, std::slice::from_ref(chunk)))
            }
        }
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
