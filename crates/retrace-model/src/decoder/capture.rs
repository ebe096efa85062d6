//! What a forward pass copies out: for the prefix cache, the keys and values of the segments it
//! was asked to keep, every layer's, and the last layer's input at their tokens; for a trained
//! head (or a trainer), the hidden states of the tapped layers at the reads' rows only.

use crate::plan::Segment;
use crate::prefix_cache::{Kv, owned};
use candle_core::{Result, Tensor};

/// Keys and values per captured segment, in layer order as the layers run.
pub(super) struct Capture {
    /// Each captured segment's index and its stream rows `start..start + len`.
    segments: Vec<(usize, usize, usize)>,
    k: Vec<Vec<Tensor>>,
    v: Vec<Vec<Tensor>>,
}

impl Capture {
    /// A capture of segments `keep` (indices into `segments`).
    pub(super) fn new(keep: &[usize], segments: &[Segment]) -> Self {
        Self {
            segments: keep
                .iter()
                .map(|&s| (s, segments[s].start, segments[s].len))
                .collect(),
            k: vec![Vec::new(); keep.len()],
            v: vec![Vec::new(); keep.len()],
        }
    }

    /// Takes one layer's keys and values, (1, nkv, stream, hd) each.
    pub(super) fn take(&mut self, k: &Tensor, v: &Tensor) -> Result<()> {
        for (i, &(_, start, len)) in self.segments.iter().enumerate() {
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

    /// The last layer's input at each captured segment, from the stream `x` (N, H): what a
    /// later read inside this prefix starts from. Empty when the batch computed no token.
    pub(super) fn last_inputs(&self, x: Option<&Tensor>) -> Result<Vec<Tensor>> {
        match x {
            Some(stream) => self
                .segments
                .iter()
                .map(|&(_, start, len)| owned(&stream.narrow(0, start, len)?))
                .collect(),
            None => Ok(Vec::new()),
        }
    }

    /// Each captured segment's index and what the cache keeps of it, given `last_in` from
    /// `last_inputs`.
    pub(super) fn into_kv(self, last_in: Vec<Tensor>) -> Vec<(usize, Kv)> {
        self.segments
            .iter()
            .zip(self.k.into_iter().zip(self.v))
            .zip(last_in)
            .map(|((&(s, _, _), (k, v)), x)| (s, Kv { k, v, x }))
            .collect()
    }
}

/// The hidden states a pass keeps of the layers `layers` at the reads, each (reads, H) in
/// group order as the pass produces them (see `ReadOut`), in the order `layers` lists them.
pub(super) struct Taps {
    layers: Vec<usize>,
    got: Vec<Option<Tensor>>,
}

impl Taps {
    pub(super) fn new(layers: &[usize]) -> Self {
        Self {
            layers: layers.to_vec(),
            got: vec![None; layers.len()],
        }
    }

    pub(super) fn wants(&self, layer: usize) -> bool {
        self.layers.contains(&layer)
    }

    /// Keeps `rows` (the reads' rows, in group order) as layer `layer`'s states, wherever
    /// that layer is asked for.
    pub(super) fn put(&mut self, layer: usize, rows: &Tensor) {
        for (l, got) in self.layers.iter().zip(&mut self.got) {
            if *l == layer {
                *got = Some(rows.clone());
            }
        }
    }

    /// Every tapped layer's states in row-major read order (`order`, from group order).
    pub(super) fn into_read_order(self, order: &Tensor) -> Result<Vec<Tensor>> {
        self.layers
            .iter()
            .zip(self.got)
            .map(|(l, got)| match got {
                Some(t) => t.index_select(order, 0),
                None => candle_core::bail!("layer {l} was tapped nowhere in the pass"),
            })
            .collect()
    }
}
