//! The decoder's attention through the fused blocked kernel (CPU f32): every query chunk is one
//! of the kernel's query groups, and keys and values are read in place, run by run, from the
//! stream's tensors and the prefix cache's: nothing is concatenated, masked or repeated.

use super::chunk::Chunk;
use super::packing::{Run, Seq, Src};
use crate::kernels::{self, Heads, KvRun, QueryGroup};
use crate::prefix_cache::Kv;
use candle_core::{Layout, Result, Storage, Tensor};

/// One query group's chunks: `chunks` of `seq`, whose queries start at row `q_start`.
pub(super) struct Group<'s, 'a> {
    pub(super) seq: &'s Seq<'a>,
    pub(super) q_start: usize,
    pub(super) chunks: &'s [Chunk],
}

/// Attention of `q` (1, heads, rows, hd; scaled and rotated) in `groups` over layer `layer`'s
/// keys and values: the stream's `kv` (1, kv heads, stream, hd each; `None` when the batch
/// computes no token) and the cache's. Returns (rows, heads * hd).
pub(super) fn attend(
    q: &Tensor,
    kv: (Option<&Tensor>, Option<&Tensor>),
    layer: usize,
    groups: &[Group],
    dims: Heads,
) -> Result<Tensor> {
    let rows = q.dim(2)?;
    // Every tensor the kernel reads: q, the stream's k and v, then each cached run's k and v.
    let mut tensors: Vec<&Tensor> = vec![q];
    if let (Some(k), Some(v)) = kv {
        tensors.extend([k, v]);
    }
    let mut cached: Vec<&Kv> = Vec::new();
    for run in groups.iter().flat_map(|g| &g.seq.context) {
        if let Src::Cached(c, _) = run.src
            && !cached.iter().any(|seen| std::ptr::eq(*seen, c))
        {
            cached.push(c);
            tensors.extend([&c.k[layer], &c.v[layer]]);
        }
    }
    let guards: Vec<_> = tensors.iter().map(|t| t.storage_and_layout()).collect();
    let data = guards
        .iter()
        .map(|(s, l)| f32_data(s, l))
        .collect::<Result<Vec<_>>>()?;
    let sources = Sources {
        data: &data,
        stream: kv.0.map(|k| k.dim(2)).transpose()?,
        cached: &cached,
        layer,
    };
    let runs = groups
        .iter()
        .map(|g| sources.runs(g.seq))
        .collect::<Result<Vec<_>>>()?;
    let mut query_groups = Vec::new();
    for (g, runs) in groups.iter().zip(&runs) {
        for c in g.chunks.iter().filter(|c| !c.q_pos.is_empty()) {
            query_groups.push(QueryGroup {
                first_row: g.q_start + c.start,
                positions: &c.q_pos,
                runs,
            });
        }
    }
    let mut out = vec![0f32; rows * dims.heads * dims.hd];
    kernels::attend(data[0], rows, &query_groups, dims, &mut out);
    drop(guards);
    Tensor::from_vec(out, (rows, dims.heads * dims.hd), q.device())
}

/// Where runs find their keys and values: `data` holds q, then the stream's k and v (when
/// `stream`, its length, is some), then each of `cached`'s k and v at `layer`.
struct Sources<'d, 'a> {
    data: &'d [&'d [f32]],
    stream: Option<usize>,
    cached: &'d [&'a Kv],
    layer: usize,
}

impl<'d> Sources<'d, '_> {
    /// `seq`'s context, then its own tokens, as the kernel's runs.
    fn runs(&self, seq: &Seq) -> Result<Vec<KvRun<'d>>> {
        let own = Run {
            pos: seq.pos0,
            len: seq.len,
            src: Src::Stream(seq.start),
        };
        seq.context
            .iter()
            .chain(std::iter::once(&own))
            .filter(|r| r.len > 0)
            .map(|r| self.run(r))
            .collect()
    }

    fn run(&self, run: &Run) -> Result<KvRun<'d>> {
        let (at, stride, offset) = match run.src {
            Src::Stream(start) => match self.stream {
                Some(n) => (1, n, start),
                None => candle_core::bail!("a stream run in a batch that computes no token"),
            },
            Src::Cached(kv, offset) => {
                let i = self.cached.iter().position(|c| std::ptr::eq(*c, kv));
                let i = i.ok_or_else(|| candle_core::Error::Msg("an unlisted cache run".into()))?;
                let base = if self.stream.is_some() { 3 } else { 1 };
                (base + 2 * i, kv.k[self.layer].dim(2)?, offset)
            }
        };
        Ok(KvRun {
            pos: run.pos,
            len: run.len,
            k: self.data[at],
            v: self.data[at + 1],
            stride,
            offset,
        })
    }
}

/// The f32 elements of a contiguous CPU tensor.
fn f32_data<'s>(s: &'s Storage, l: &Layout) -> Result<&'s [f32]> {
    match s {
        Storage::Cpu(cpu) => kernels::f32s(cpu, l, "attention"),
        _ => candle_core::bail!("the fused attention runs on the CPU only"),
    }
}
