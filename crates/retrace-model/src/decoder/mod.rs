//! One decoder-only transformer for Llama, Mistral and Qwen2 checkpoints that returns the final
//! (normed) hidden states only at the positions a scoring head reads.
//!
//! Written for scoring, not generation: no KV cache, causal masks built per call, batches packed
//! end to end without padding (each row attends over its own keys; see `packing`), RoPE tables
//! computed in f32 (then cast, as transformers does), attention softmax in f32, queries in blocks
//! that skip the masked upper triangle and keep score memory bounded. The last layer runs
//! attention queries and the MLP only for the gathered rows, since nothing else of it is read.
//!
//! `Decoder::run` goes in stages, each in its own file: the packed stream's ids, positions and
//! contexts (`stream`), the reads grouped for the last layer (`reads`), every other layer over
//! the whole stream (`layer`, `attention`), the last layer at the reads, and what is copied out
//! (`capture`): keys and values for the prefix cache, and the hidden states of tapped layers
//! at the reads' rows (a trained head's features), gathered as the stream passes each layer.
//! On CPU f32 the layers run the fused kernels (`crate::kernels`; `flash`: attention) unless
//! `set_kernels` asks for candle's ops.

mod attention;
mod capture;
mod chunk;
mod flash;
mod layer;
mod packing;
mod reads;
mod rope;
mod stream;

use crate::config::ModelConfig;
use crate::gguf::Gguf;
use crate::kernels::Kernels;
use crate::layers::Emb;
use crate::plan::{self, Layout};
use crate::prefix_cache::{Hit, Kv};
use candle_core::{Device, Module, Result, Tensor};
use candle_nn::{RmsNorm, VarBuilder};
use capture::{Capture, Taps};
use chunk::Plan;
use layer::{Layer, Residual};
use reads::{ReadOut, Reads};
use rope::{Angles, Rope};
use stream::Stream;

/// Bytes of f32 attention scores one query chunk may take; longer inputs are split into chunks
/// of query rows so memory grows as L * chunk instead of L * L.
pub(crate) const SCORES_BUDGET_BYTES: usize = 256 << 20;

/// Most queries per attention chunk. A chunk attends only to keys up to its last query, so
/// smaller chunks skip more of the causally masked upper triangle (whole-row chunks computed,
/// exponentiated and masked all of it: at 1,024 tokens attention took ~45% of the forward for
/// ~14% of its useful FLOPs); 128 queries still make matmuls large enough to run near peak.
const QUERY_BLOCK: usize = 128;

/// `QUERY_BLOCK` on a GPU. There every chunk costs a dozen kernel launches whatever its size,
/// and a (1,024 x keys) score block is still small for the card, so fewer, larger chunks win
/// over skipping more of the masked triangle.
pub(crate) const QUERY_BLOCK_GPU: usize = 1024;

/// Where the decoder's matrices come from quantized: a GGUF, or nowhere (safetensors load in
/// full).
pub(crate) type QuantSource<'a> = Option<&'a Gguf>;

/// A forward pass's result: the final normed hidden states at the reads, (reads, H) in row-major
/// order; the tapped layers' states there, likewise, in the order asked; and the keys and
/// values of each captured segment (by segment index).
pub(crate) struct Output {
    pub(crate) hidden: Tensor,
    pub(crate) taps: Vec<Tensor>,
    pub(crate) captured: Vec<(usize, Kv)>,
}

pub(crate) struct Decoder {
    embed_tokens: Emb,
    layers: Vec<Layer>,
    norm: RmsNorm,
    rope: Rope,
    n_heads: usize,
    /// `SCORES_BUDGET_BYTES`; tests lower it to force chunking.
    pub(crate) scores_budget: usize,
    /// Most queries per attention chunk: `QUERY_BLOCK`, or `QUERY_BLOCK_GPU` off the CPU.
    pub(crate) query_block: usize,
}

impl Decoder {
    /// `vb` is the checkpoint root; weights are read from `model.*`, the matrices from `quant`
    /// when it holds them quantized.
    pub(crate) fn new(cfg: &ModelConfig, vb: VarBuilder, quant: QuantSource) -> Result<Self> {
        let vb_m = vb.pp("model");
        let embed_tokens = embedding(cfg, &vb, quant)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| Layer::new(cfg, i, vb_m.pp("layers").pp(i), quant))
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

    /// Which ops every layer runs.
    /// Keeps its quantized matrices dequantized as well, layer by layer from the first, while
    /// `budget` bytes last (`Lin::dequantize_once`); returns the bytes spent.
    pub(crate) fn dequantize_once(&mut self, budget: usize) -> Result<usize> {
        let mut left = budget;
        for lin in self.layers.iter_mut().flat_map(Layer::linears) {
            lin.dequantize_once(&mut left)?;
        }
        Ok(budget - left)
    }

    pub(crate) fn set_kernels(&mut self, kernels: Kernels) {
        self.layers.iter_mut().for_each(|l| l.set_kernels(kernels));
    }

    pub(crate) fn n_layers(&self) -> usize {
        self.layers.len()
    }

    /// The input embedding, whose rows a tied LM head reuses.
    pub(crate) fn embeddings(&self) -> &Emb {
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
            if len > self.rope.positions()? {
                candle_core::bail!(
                    "input of {len} tokens exceeds max_position_embeddings {}",
                    self.rope.positions()?
                )
            }
            lens.push(len);
        }
        Ok(lens)
    }

    /// The batch's layout: each row's cached prefix (`hits`), then the segments the stream
    /// computes, shared between rows when `share`.
    pub(crate) fn layout(
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
    /// segments named in `capture` for the cache, and the states of the layers `taps` at the
    /// reads (layer `l` < the layer count: the residual stream after layer `l`; the layer
    /// count: after the final norm).
    pub(crate) fn run(
        &self,
        rows: &[&[u32]],
        positions: &[&[usize]],
        hits: &[Hit],
        layout: &Layout,
        capture: &[usize],
        taps: &[usize],
    ) -> Result<Output> {
        let n = self.layers.len();
        if let Some(l) = taps.iter().find(|&&l| l > n) {
            candle_core::bail!("layer {l} is out of range: the model has layers 0..={n}")
        }
        let dev = self.embed_tokens.device();
        let stream = Stream::new(rows, layout, hits);
        let reads = Reads::group(positions, layout)?;
        if reads.is_empty() {
            let (h, dtype) = (self.embed_tokens.hidden_size(), self.embed_tokens.dtype());
            let none = Tensor::zeros((0, h), dtype, &dev)?;
            return Ok(Output {
                taps: vec![none.clone(); taps.len()],
                hidden: none,
                captured: Vec::new(),
            });
        }
        let rope = self.rope.at(&stream.positions, &dev)?;
        let mut cap = Capture::new(capture, &layout.segments);
        let mut tapped = Taps::new(taps);
        let (last, full) = self
            .layers
            .split_last()
            .ok_or_else(|| candle_core::Error::Msg("a decoder with no layers".into()))?;
        // Every index the pass uploads is built before the first layer is queued: on a GPU a
        // copy from pageable host memory can wait for the kernels queued before it.
        let window = last.window();
        let read_out = ReadOut::new(reads, &stream.seqs, layout, hits, window, &self.rope, &dev)?;
        let pass = Pass {
            stream: &stream,
            rope: &rope,
            read_out: &read_out,
        };
        let res = self.through(full, &pass, &mut cap, &mut tapped, &dev)?;
        // The last layer's input, summed, and normed for its keys and values.
        let (x, xn) = match res.map(|r| last.input(&r)).transpose()? {
            Some((x, xn)) => (Some(x), Some(xn)),
            None => (None, None),
        };
        let xq = read_out.inputs(x.as_ref())?;
        if let Some(below) = n.checked_sub(2) {
            tapped.put(below, &xq);
        }
        let last_in = cap.last_inputs(x.as_ref())?;
        let read =
            last.forward_gathered(full.len(), xn.as_ref(), &xq, &read_out, &rope, &mut cap)?;
        tapped.put(n - 1, &read);
        let normed = self.norm.forward(&read)?;
        tapped.put(n, &normed);
        Ok(Output {
            hidden: normed.index_select(&read_out.order, 0)?,
            taps: tapped.into_read_order(&read_out.order)?,
            captured: cap.into_kv(last_in),
        })
    }

    /// Every stream token through the layers `full` (all but the last); `None` when the batch
    /// computes no token. Each window's chunk plan is uploaded first, then the ids. A tapped
    /// layer below the last layer's input keeps its reads' rows as the stream passes it.
    fn through(
        &self,
        full: &[Layer],
        pass: &Pass,
        cap: &mut Capture,
        taps: &mut Taps,
        dev: &Device,
    ) -> Result<Option<Residual>> {
        let stream = pass.stream;
        let n = stream.ids.len();
        if n == 0 {
            return Ok(None);
        }
        let mut plans: Vec<Plan> = Vec::new();
        for w in full.iter().map(Layer::window) {
            if !plans.iter().any(|p| p.window() == w) {
                let budget = (self.scores_budget, self.query_block);
                plans.push(Plan::new(&stream.seqs, budget, self.n_heads, w, dev)?);
            }
        }
        let ids = Tensor::from_slice(&stream.ids, n, dev)?;
        let mut res = Residual::new(self.embed_tokens.forward(&ids)?);
        for (li, layer) in full.iter().enumerate() {
            res = layer.forward(li, &res, &stream.seqs, pass.rope, &plans, cap)?;
            // The last of these is the last layer's input, which `run` takes from its reads.
            if li + 1 < full.len() && taps.wants(li) {
                taps.put(li, &pass.read_out.stream_inputs(&res.sum()?)?);
            }
        }
        Ok(Some(res))
    }
}

/// What every stage of one pass reads: the stream, its RoPE rows, and the reads.
struct Pass<'a, 'b> {
    stream: &'a Stream<'b>,
    rope: &'a Angles,
    read_out: &'a ReadOut<'b>,
}

/// The input embedding: a GGUF's quantized table when it has one, else the full one.
fn embedding(cfg: &ModelConfig, vb: &VarBuilder, quant: QuantSource) -> Result<Emb> {
    let table = quant
        .map(|g| g.quantized("model.embed_tokens.weight", vb.device()))
        .transpose()?
        .flatten();
    Ok(match table {
        Some(table) => Emb::Quant {
            table: std::sync::Arc::new(table),
            dtype: vb.dtype(),
        },
        None => Emb::Full(candle_nn::embedding(
            cfg.vocab_size,
            cfg.hidden_size,
            vb.pp("model").pp("embed_tokens"),
        )?),
    })
}
