//! Attention over the packed stream: the projections, RoPE (`rope.rs`) and the blocks of the
//! chunk plan (`chunk.rs`); on CPU f32 the fused kernels (`flash`) take RoPE and the attention
//! itself, the eager path elsewhere.

use super::QuantSource;
use super::capture::Capture;
use super::chunk::{Chunk, Plan};
use super::flash::{self, Group};
use super::packing::{Seq, Which};
use super::rope::Angles;
use crate::config::ModelConfig;
use crate::kernels::{Heads, Kernels};
use crate::layers::{Lin, linear};
use candle_core::{D, DType, Module, Result, Tensor};
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

impl Attention {
    /// Its projections, for what is done to every linear layer (`Lin::dequantize_once`).
    pub(super) fn linears(&mut self) -> [&mut Lin; 4] {
        [
            &mut self.q_proj,
            &mut self.k_proj,
            &mut self.v_proj,
            &mut self.o_proj,
        ]
    }

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
        // q, k and v of the same stream in one call, so a quantized layer rounds it once.
        let (q, kv) = match (x, queries) {
            (Some(x), Queries::Full(_)) => {
                let [q, k, v] = Lin::forward_each([&self.q_proj, &self.k_proj, &self.v_proj], x)?;
                (Some(q), Some((x, k, v)))
            }
            (Some(x), Queries::Gathered { .. }) => {
                let [k, v] = Lin::forward_each([&self.k_proj, &self.v_proj], x)?;
                (None, Some((x, k, v)))
            }
            (None, _) => (None, None),
        };
        let (k, v) = match kv {
            Some((x, k, v)) => {
                let k = rope.apply(&k, self.n_kv, None, self.kernels)?;
                let v = self.heads(v, self.n_kv, x.dim(0)?)?;
                capture.take(&k, &v)?;
                (Some(k), Some(v))
            }
            None => (None, None),
        };
        let (q, rows) = self.queries(q, x, rope, queries)?;
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

    /// The scaled, rotated queries (1, n_heads, rows, hd) and their row count. `projected`: the
    /// stream's q projection, when the caller computed it beside k and v (`Full` queries).
    fn queries(
        &self,
        projected: Option<Tensor>,
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
        let q = match projected {
            Some(q) => q,
            None => self.q_proj.forward(xq)?,
        };
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
