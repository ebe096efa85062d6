//! How the decoder reads keys and values: each query row's context is a list of runs, from the
//! packed token stream (this batch's segments, never padded) or from the prefix cache.

use crate::prefix_cache::Kv;
use candle_core::{Result, Tensor};

/// Where a run of positions has its keys and values.
#[derive(Debug, Clone, Copy)]
pub(super) enum Src<'a> {
    /// Stream rows from this index on.
    Stream(usize),
    /// A cached run, from this offset on.
    Cached(&'a Kv, usize),
}

/// Positions `pos..pos + len`, kept in `src`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Run<'a> {
    pub(super) pos: usize,
    pub(super) len: usize,
    pub(super) src: Src<'a>,
}

/// Keys or values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Which {
    K,
    V,
}

/// Query rows whose own tokens sit at stream rows `start..start + len`, positions
/// `pos0..pos0 + len`; `context` covers positions `0..pos0`, in order.
#[derive(Debug, Clone)]
pub(super) struct Seq<'a> {
    pub(super) start: usize,
    pub(super) len: usize,
    pub(super) pos0: usize,
    pub(super) context: Vec<Run<'a>>,
}

impl Seq<'_> {
    /// Keys (or values) of layer `layer` at positions `k_start..k_start + k_len`, from the
    /// context and the row's own tokens: `stream` is that layer's (1, nkv, stream, hd).
    pub(super) fn keys(
        &self,
        layer: usize,
        which: Which,
        stream: Option<&Tensor>,
        k_start: usize,
        k_len: usize,
    ) -> Result<Tensor> {
        let end = k_start + k_len;
        let own = Run {
            pos: self.pos0,
            len: self.len,
            src: Src::Stream(self.start),
        };
        let mut parts = Vec::with_capacity(self.context.len() + 1);
        for run in self.context.iter().chain(std::iter::once(&own)) {
            let (lo, hi) = (run.pos.max(k_start), (run.pos + run.len).min(end));
            if lo >= hi {
                continue;
            }
            let skip = lo - run.pos;
            parts.push(match run.src {
                Src::Stream(at) => {
                    let t = stream.ok_or_else(|| candle_core::Error::Msg("no stream".into()))?;
                    t.narrow(2, at + skip, hi - lo)?
                }
                Src::Cached(kv, offset) => {
                    let t = match which {
                        Which::K => &kv.k[layer],
                        Which::V => &kv.v[layer],
                    };
                    t.narrow(2, offset + skip, hi - lo)?
                }
            });
        }
        match parts.len() {
            1 => parts[0].contiguous(),
            _ => Tensor::cat(&parts, 2),
        }
    }
}
