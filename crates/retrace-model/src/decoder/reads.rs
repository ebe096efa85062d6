//! The read-out: which positions a batch reads, grouped for the last layer (by the stream
//! segment that holds them, or by the row whose cached prefix does; a position several rows
//! read is computed once), the last layer's queries at them, and the way back to the order the
//! rows asked for.

use super::chunk::Chunk;
use super::packing::Seq;
use super::rope::{Angles, Rope};
use super::stream::cached_runs;
use crate::plan::Layout;
use crate::prefix_cache::Hit;
use candle_core::{Device, Result, Tensor};
use std::collections::HashMap;

/// What holds a read's last-layer input: a stream segment, or a row's cached prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Source {
    Stream(usize),
    Cached(usize),
}

/// The positions one source's reads take, sorted and without repeats.
struct Group {
    source: Source,
    positions: Vec<usize>,
}

/// A batch's reads, grouped.
pub(super) struct Reads {
    /// Stream groups first, then cached ones, each kind in order of first appearance.
    groups: Vec<Group>,
    /// Each read, in row-major order, as its row among the groups' positions end to end.
    order: Vec<u32>,
}

/// The last layer's queries: the reads' rows of its input, and everything they upload, built
/// before the first layer is queued.
pub(super) struct ReadOut<'a> {
    /// Each group's query context: its segment's, or its row's cached prefix.
    pub(super) seqs: Vec<Seq<'a>>,
    /// One chunk per group, its queries at the group's positions.
    pub(super) chunks: Vec<Chunk>,
    /// The reads' RoPE rows, in group order.
    pub(super) rope: Angles,
    /// Stream rows of the stream groups' reads; `None` when every read is cached.
    stream_rows: Option<Tensor>,
    /// The cached groups' reads' last-layer inputs, (1, H) each.
    cached_x: Vec<Tensor>,
    /// Back from group order to row-major read order.
    pub(super) order: Tensor,
}

impl Reads {
    /// Groups the reads `positions` (per row) of a batch laid out as `layout`.
    pub(super) fn group(positions: &[&[usize]], layout: &Layout) -> Result<Self> {
        // Groups by kind; a read's group is its index among its kind's.
        let (mut stream, mut cached) = (Vec::new(), Vec::new());
        let mut index: HashMap<Source, usize> = HashMap::new();
        let mut asked: Vec<(Source, usize, usize)> = Vec::new();
        for (row, pos) in positions.iter().enumerate() {
            for &p in pos.iter() {
                let source = source_of(layout, row, p)?;
                let groups: &mut Vec<Group> = match source {
                    Source::Stream(_) => &mut stream,
                    Source::Cached(_) => &mut cached,
                };
                let g = *index.entry(source).or_insert_with(|| {
                    groups.push(Group {
                        source,
                        positions: Vec::new(),
                    });
                    groups.len() - 1
                });
                groups[g].positions.push(p);
                asked.push((source, g, p));
            }
        }
        for group in stream.iter_mut().chain(cached.iter_mut()) {
            group.positions.sort_unstable();
            group.positions.dedup();
        }
        let n_stream = stream.len();
        let mut groups = stream;
        groups.extend(cached);
        let order = gathered_order(&groups, n_stream, &asked)?;
        Ok(Self { groups, order })
    }

    pub(super) fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

/// Where row `row`'s read at `p` finds its last-layer input.
fn source_of(layout: &Layout, row: usize, p: usize) -> Result<Source> {
    if p < layout.cached[row] {
        return Ok(Source::Cached(row));
    }
    match layout.segment_at(row, p) {
        Some(s) => Ok(Source::Stream(s)),
        None => candle_core::bail!("row {row}: position {p} laid out nowhere"),
    }
}

/// Each read of `asked` (its source, its group among its kind's, its position) as its row in
/// the groups' positions end to end, stream groups (the first `n_stream`) first.
fn gathered_order(
    groups: &[Group],
    n_stream: usize,
    asked: &[(Source, usize, usize)],
) -> Result<Vec<u32>> {
    let mut base = Vec::with_capacity(groups.len());
    let mut rows = 0;
    for group in groups {
        base.push(rows);
        rows += group.positions.len();
    }
    asked
        .iter()
        .map(|&(source, g, p)| {
            let g = match source {
                Source::Stream(_) => g,
                Source::Cached(_) => n_stream + g,
            };
            match groups[g].positions.binary_search(&p) {
                Ok(i) => Ok((base[g] + i) as u32),
                Err(_) => candle_core::bail!("position {p} was not gathered"),
            }
        })
        .collect()
}

impl<'a> ReadOut<'a> {
    /// The queries of `reads` for a last layer with sliding window `window`: stream groups
    /// query like their segment (`stream`, by segment index), cached ones like a row whose
    /// tokens all sit in its cached prefix (`hits`, `layout.cached`).
    pub(super) fn new(
        reads: Reads,
        stream: &[Seq<'a>],
        layout: &Layout,
        hits: &'a [Hit],
        window: Option<usize>,
        rope: &Rope,
        dev: &Device,
    ) -> Result<Self> {
        let mut seqs = Vec::with_capacity(reads.groups.len());
        let mut chunks = Vec::with_capacity(reads.groups.len());
        let mut q_pos: Vec<u32> = Vec::new();
        let mut stream_rows: Vec<u32> = Vec::new();
        let mut cached_x: Vec<Tensor> = Vec::new();
        for Group { source, positions } in &reads.groups {
            match *source {
                Source::Stream(s) => {
                    let seq = &stream[s];
                    stream_rows
                        .extend(positions.iter().map(|&p| (seq.start + p - seq.pos0) as u32));
                    seqs.push(seq.clone());
                }
                Source::Cached(row) => {
                    for &p in positions {
                        cached_x.push(cached_input(&hits[row], p)?);
                    }
                    let upto = layout.cached[row];
                    seqs.push(Seq {
                        start: 0,
                        len: 0,
                        pos0: upto,
                        context: cached_runs(&hits[row], upto),
                    });
                }
            }
            chunks.push(Chunk::at_reads(positions, q_pos.len(), window, dev)?);
            q_pos.extend(positions.iter().map(|&p| p as u32));
        }
        let rope = rope.at(&q_pos, dev)?;
        let stream_rows = match stream_rows.len() {
            0 => None,
            count => Some(Tensor::from_vec(stream_rows, count, dev)?),
        };
        let count = reads.order.len();
        let order = Tensor::from_vec(reads.order, count, dev)?;
        Ok(Self {
            seqs,
            chunks,
            rope,
            stream_rows,
            cached_x,
            order,
        })
    }

    /// The reads' rows of the last layer's input in group order: from the stream `x` (after
    /// every layer but the last), then from the cache.
    pub(super) fn inputs(&self, x: Option<&Tensor>) -> Result<Tensor> {
        let mut parts = Vec::with_capacity(1 + self.cached_x.len());
        if let (Some(stream), Some(idx)) = (x, self.stream_rows.as_ref()) {
            parts.push(stream.index_select(idx, 0)?);
        }
        parts.extend(self.cached_x.iter().cloned());
        Tensor::cat(&parts, 0)
    }

    /// The reads' rows of the stream state `x` after a layer below the last layer's input, in
    /// group order. Only reads in the stream have one: a cached prefix keeps no layer's state
    /// but the last layer's input (`Batch` looks up no prefix past a row's first read when a
    /// head taps deeper).
    pub(super) fn stream_inputs(&self, x: &Tensor) -> Result<Tensor> {
        match (&self.stream_rows, self.cached_x.is_empty()) {
            (Some(idx), true) => x.index_select(idx, 0),
            _ => candle_core::bail!(
                "a read inside a cached prefix has no hidden state below the last layer's input"
            ),
        }
    }
}

/// The cached last-layer input of position `p` of a row whose cached prefix is `hit`, (1, H).
fn cached_input(hit: &Hit, p: usize) -> Result<Tensor> {
    let piece = hit
        .pieces
        .iter()
        .find(|c| (c.pos..c.pos + c.len).contains(&p))
        .ok_or_else(|| candle_core::Error::Msg(format!("position {p} not cached")))?;
    piece.kv.x.narrow(0, piece.offset + p - piece.pos, 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::layout;

    #[test]
    fn reads_group_by_source_once_each_and_come_back_in_the_order_asked() {
        // Rows 0 and 1 share tokens 0..3 (segment 0), then part (segments 1 and 2); row 2 has
        // its first two tokens cached and computes the third (segment 3).
        let rows: [&[u32]; 3] = [&[1, 2, 3, 4], &[1, 2, 3, 5], &[7, 8, 9]];
        let l = layout(&rows, &[0, 0, 2], true);
        let positions: [&[usize]; 3] = [&[3, 0, 2], &[2, 3], &[1, 2, 0]];
        let reads = Reads::group(&positions, &l).unwrap();
        let groups: Vec<(Source, Vec<usize>)> = reads
            .groups
            .iter()
            .map(|g| (g.source, g.positions.clone()))
            .collect();
        assert_eq!(
            groups,
            vec![
                (Source::Stream(1), vec![3]),
                (Source::Stream(0), vec![0, 2]),
                (Source::Stream(2), vec![3]),
                (Source::Stream(3), vec![2]),
                (Source::Cached(2), vec![0, 1]),
            ]
        );
        // Position 2 of segment 0, read by rows 0 and 1, is one gathered row.
        assert_eq!(reads.order, vec![0, 1, 2, 2, 3, 6, 4, 5]);
        let nowhere: [&[usize]; 3] = [&[9], &[], &[]];
        assert!(Reads::group(&nowhere, &l).is_err());
    }
}
