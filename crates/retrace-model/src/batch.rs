//! One batch's trip through the prefix cache, start to end: each row's cached prefix looked up
//! (and pinned), the batch laid out, room made and the segments to keep picked, the decoder run,
//! what it computed inserted, then the pins released and the cache evicted back to its budget
//! whatever happened in between; and each row's scores (or hidden states) and token counts.

use crate::decoder::{Decoder, Output};
use crate::error::ModelError;
use crate::head::{Head, Reading};
use crate::plan::Layout;
use crate::prefix_cache::{Hit, PrefixCache};
use crate::spans::{Span, SpanRows, span_reads};
use candle_core::DType;
use std::sync::Mutex;

/// One row's scores, and where its tokens came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub scores: Vec<f32>,
    /// Per read, the probabilities of a trained head's error categories (in the order its
    /// config lists them); empty when the head has no category head.
    pub categories: Vec<Vec<f32>>,
    pub tokens: Tokens,
}

/// Tokens of one row computed for it, and reused (from the cache, or shared in its batch).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Tokens {
    pub computed: usize,
    pub reused: usize,
}

/// One row's hidden states at its reads (`PrmModel::states`), in f32.
#[derive(Debug, Clone, PartialEq)]
pub struct RowStates {
    /// Per layer asked for, in that order: reads x hidden values, row-major.
    pub layers: Vec<Vec<f32>>,
    pub hidden_size: usize,
    pub tokens: Tokens,
}

impl RowStates {
    /// Layer `layer`'s (its index among those asked for) state at read `read`.
    pub fn at(&self, layer: usize, read: usize) -> &[f32] {
        let h = self.hidden_size;
        &self.layers[layer][read * h..(read + 1) * h]
    }
}

/// A batch to score, as TEI names one: each row's token ids, the positions it is read at (in
/// that order), and, for a trained head that pools over a step's own tokens, each read's span
/// (`spans[b][k]` for `positions[b][k]`; other heads ignore them, and a span head given none
/// is refused).
#[derive(Debug, Clone, Copy)]
pub struct Batch<'a> {
    pub ids: &'a [&'a [u32]],
    pub positions: &'a [&'a [usize]],
    pub spans: Option<&'a [&'a [Span]]>,
}

impl<'a> Batch<'a> {
    /// Rows `ids`, row `b` read at `positions[b]`.
    pub fn new(ids: &'a [&'a [u32]], positions: &'a [&'a [usize]]) -> Self {
        Batch {
            ids,
            positions,
            spans: None,
        }
    }

    /// With each read's span.
    pub fn with_spans(self, spans: &'a [&'a [Span]]) -> Self {
        Batch {
            spans: Some(spans),
            ..self
        }
    }
}

/// What a batch runs on: a model's decoder and head, and how it reuses tokens.
pub(crate) struct Runner<'a> {
    pub(crate) decoder: &'a Decoder,
    pub(crate) head: &'a Head,
    /// The prefix cache, when it is on.
    pub(crate) cache: Option<&'a Mutex<PrefixCache>>,
    /// Bytes the cache spends per token.
    pub(crate) bytes_per_token: usize,
    /// Rows that share tokens compute them once.
    pub(crate) share: bool,
}

/// The cached prefixes a batch reads, pinned (not evicted) until it is done.
struct Lookup {
    hits: Vec<Hit>,
    pins: Vec<usize>,
}

/// A forward pass's reads, in row-major read order, and the batch's layout.
struct Pass {
    layout: Layout,
    out: Output,
}

impl Runner<'_> {
    /// Scores `rows` at `positions` (checked by the caller). With the cache on, each row starts
    /// from its longest cached prefix, and what the batch computes is cached after (as much as
    /// the budget holds, least recently used evicted first).
    /// A head that reads each step's own tokens reads `spans` too (one per position, checked
    /// here), its pass laid out by `span_reads`; other heads ignore them.
    pub(crate) fn score(&self, batch: Batch<'_>) -> Result<Vec<Row>, ModelError> {
        let Batch {
            ids: rows,
            positions,
            spans,
        } = batch;
        if positions.iter().all(|p| p.is_empty()) {
            return Ok(rows.iter().map(|_| no_reads()).collect());
        }
        let reads: Vec<usize> = positions.iter().map(|p| p.len()).collect();
        let (pass, read) = match spans.filter(|_| self.head.reads_spans()) {
            Some(spans) => {
                let at = SpanRows::new(positions, spans).map_err(ModelError::BadInput)?;
                let wide: Vec<Vec<usize>> = positions
                    .iter()
                    .zip(spans)
                    .map(|(p, s)| span_reads(p, s))
                    .collect();
                let wide: Vec<&[usize]> = wide.iter().map(Vec::as_slice).collect();
                check_spans(rows, &wide)?;
                let pass = self.pass(rows, &wide, self.head.taps())?;
                let read = self.head.read(&pass.out, &reads, Some(&at))?;
                (pass, read)
            }
            None => {
                let pass = self.pass(rows, positions, self.head.taps())?;
                let read = self.head.read(&pass.out, &reads, None)?;
                (pass, read)
            }
        };
        let tokens = row_tokens(&pass.layout, &read_lengths(positions));
        Ok(split_rows(read, positions, tokens))
    }

    /// The hidden states of the layers `layers` at `positions` (checked by the caller), through
    /// the cache like `score`.
    pub(crate) fn states(
        &self,
        batch: Batch<'_>,
        layers: &[usize],
    ) -> Result<Vec<RowStates>, ModelError> {
        let (rows, positions) = (batch.ids, batch.positions);
        let pass = self.pass(rows, positions, layers)?;
        let tokens = row_tokens(&pass.layout, &read_lengths(positions));
        let hidden_size = pass.out.hidden.dim(1)?;
        let mut per_layer = Vec::with_capacity(layers.len());
        for t in &pass.out.taps {
            per_layer.push(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?);
        }
        let mut start = 0;
        Ok(positions
            .iter()
            .zip(tokens)
            .map(|(p, tokens)| {
                let span = start * hidden_size..(start + p.len()) * hidden_size;
                start += p.len();
                RowStates {
                    layers: per_layer.iter().map(|l| l[span.clone()].to_vec()).collect(),
                    hidden_size,
                    tokens,
                }
            })
            .collect())
    }

    /// One pass over the cache: each row's cached prefix looked up and pinned (only up to its
    /// first read when `taps` reach below the last layer's input, which is all a cached
    /// prefix keeps of the stream), the batch run, the pins released whatever happened.
    fn pass(
        &self,
        rows: &[&[u32]],
        positions: &[&[usize]],
        taps: &[usize],
    ) -> Result<Pass, ModelError> {
        let mut cache = match self.cache {
            Some(c) => Some(
                c.lock()
                    .map_err(|_| ModelError::Poisoned("the prefix cache"))?,
            ),
            None => None,
        };
        let deep = taps.iter().any(|&l| l + 2 < self.decoder.n_layers());
        let lens = match deep {
            true => first_reads(positions),
            false => read_lengths(positions),
        };
        let lookup = lookup(cache.as_deref_mut(), rows, &lens);
        let result = self.run(cache.as_deref_mut(), rows, positions, &lookup.hits, taps);
        if let Some(c) = cache.as_deref_mut() {
            release(c, &lookup.pins);
        }
        result
    }

    /// Lays the batch out over its cached prefixes `hits`, runs it and inserts what the cache
    /// keeps of it.
    fn run(
        &self,
        mut cache: Option<&mut PrefixCache>,
        rows: &[&[u32]],
        positions: &[&[usize]],
        hits: &[Hit],
        taps: &[usize],
    ) -> Result<Pass, ModelError> {
        let layout = self.decoder.layout(rows, positions, hits, self.share)?;
        let capture = match cache.as_deref_mut() {
            Some(c) => make_room(c, &layout, self.bytes_per_token),
            None => Vec::new(),
        };
        let mut out = self
            .decoder
            .run(rows, positions, hits, &layout, &capture, taps)?;
        if let Some(c) = cache {
            for (s, kv) in std::mem::take(&mut out.captured) {
                let seg = &layout.segments[s];
                c.insert(&rows[seg.row][..seg.pos0 + seg.len], seg.pos0, kv)?;
            }
        }
        Ok(Pass { layout, out })
    }
}

/// That every span lies inside its row.
fn check_spans(rows: &[&[u32]], wide: &[&[usize]]) -> Result<(), ModelError> {
    for (b, (row, pos)) in rows.iter().zip(wide).enumerate() {
        if let Some(p) = pos.iter().find(|p| **p >= row.len()) {
            return Err(ModelError::BadInput(format!(
                "row {b}: a step's span reaches position {p}, past its {} tokens",
                row.len()
            )));
        }
    }
    Ok(())
}

/// The result for a row with nothing to read.
fn no_reads() -> Row {
    Row {
        scores: Vec::new(),
        categories: Vec::new(),
        tokens: Tokens::default(),
    }
}

/// Tokens each row needs: up to its last read.
fn read_lengths(positions: &[&[usize]]) -> Vec<usize> {
    positions
        .iter()
        .map(|p| p.iter().max().map_or(0, |m| m + 1))
        .collect()
}

/// Each row's first read: a cached prefix that ends there holds none of its reads.
fn first_reads(positions: &[&[usize]]) -> Vec<usize> {
    positions
        .iter()
        .map(|p| p.iter().min().copied().unwrap_or(0))
        .collect()
}

/// Each row's longest cached prefix (of the tokens it needs, `lens`), pinned; nothing without
/// a cache.
fn lookup(cache: Option<&mut PrefixCache>, rows: &[&[u32]], lens: &[usize]) -> Lookup {
    let Some(c) = cache else {
        return Lookup {
            hits: vec![Hit::default(); rows.len()],
            pins: Vec::new(),
        };
    };
    let mut pins = Vec::new();
    let hits = rows
        .iter()
        .zip(lens)
        .map(|(row, &len)| {
            let (hit, pinned) = c.lookup(&row[..len.min(row.len())]);
            pins.extend(pinned);
            hit
        })
        .collect();
    Lookup { hits, pins }
}

/// Evicts for what the batch computes, and picks the segments the cache keeps: in stream
/// order (parents first) while they fit the budget.
fn make_room(cache: &mut PrefixCache, layout: &Layout, per_token: usize) -> Vec<usize> {
    let budget = cache.budget();
    cache.evict_to(budget.saturating_sub(layout.tokens * per_token));
    let mut room = budget.saturating_sub(cache.bytes());
    let mut keep = Vec::new();
    for (i, seg) in layout.segments.iter().enumerate() {
        let bytes = seg.len * per_token;
        if bytes > room {
            break;
        }
        room -= bytes;
        keep.push(i);
    }
    keep
}

/// Unpins what the batch read and evicts back to the budget.
fn release(cache: &mut PrefixCache, pins: &[usize]) {
    cache.unpin(pins);
    let budget = cache.budget();
    cache.evict_to(budget);
}

/// The batch's scores and categories (row-major) cut into rows, each with its token counts.
fn split_rows(read: Reading, positions: &[&[usize]], tokens: Vec<Tokens>) -> Vec<Row> {
    let mut scores = read.scores.into_iter();
    let mut categories = read.categories.into_iter();
    positions
        .iter()
        .zip(tokens)
        .map(|(p, tokens)| Row {
            scores: scores.by_ref().take(p.len()).collect(),
            categories: categories.by_ref().take(p.len()).collect(),
            tokens,
        })
        .collect()
}

/// Each row's tokens computed for it and reused: a segment several rows share counts as
/// computed for the first of them.
fn row_tokens(layout: &Layout, lens: &[usize]) -> Vec<Tokens> {
    let mut claimed = vec![false; layout.segments.len()];
    layout
        .paths
        .iter()
        .zip(lens)
        .map(|(path, &len)| {
            let mut computed = 0;
            for &s in path {
                if !std::mem::replace(&mut claimed[s], true) {
                    computed += layout.segments[s].len;
                }
            }
            Tokens {
                computed,
                reused: len - computed,
            }
        })
        .collect()
}
