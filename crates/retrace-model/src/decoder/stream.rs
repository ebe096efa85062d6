//! The packed stream a batch computes, from its layout: the token ids and positions of every
//! segment end to end, and each segment's context (its row's cached prefix, then its ancestors
//! in the stream), which is where its queries find their earlier keys.

use super::packing::{Run, Seq, Src};
use crate::plan::Layout;
use crate::prefix_cache::Hit;

pub(super) struct Stream<'a> {
    /// Token ids, segment after segment.
    pub(super) ids: Vec<u32>,
    /// Each token's position in its row.
    pub(super) positions: Vec<u32>,
    /// Each segment's query group, by segment index.
    pub(super) seqs: Vec<Seq<'a>>,
}

impl<'a> Stream<'a> {
    /// `rows`' segments of `layout`, over the cached prefixes `hits`.
    pub(super) fn new(rows: &[&[u32]], layout: &Layout, hits: &'a [Hit]) -> Self {
        let segs = &layout.segments;
        let seqs = (0..segs.len())
            .map(|s| Seq {
                start: segs[s].start,
                len: segs[s].len,
                pos0: segs[s].pos0,
                context: context(layout, hits, s),
            })
            .collect();
        let mut ids: Vec<u32> = Vec::with_capacity(layout.tokens);
        let mut positions: Vec<u32> = Vec::with_capacity(layout.tokens);
        for seg in segs {
            ids.extend_from_slice(&rows[seg.row][seg.pos0..seg.pos0 + seg.len]);
            positions.extend(seg.pos0 as u32..(seg.pos0 + seg.len) as u32);
        }
        Self {
            ids,
            positions,
            seqs,
        }
    }
}

/// Segment `s`'s context: its row's cached prefix, then its ancestors in the stream.
fn context<'a>(layout: &Layout, hits: &'a [Hit], s: usize) -> Vec<Run<'a>> {
    let segs = &layout.segments;
    let seg = &segs[s];
    let mut runs = cached_runs(&hits[seg.row], layout.cached[seg.row].min(seg.pos0));
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
}

/// A row's cached runs (its `hit`) below position `upto`.
pub(super) fn cached_runs(hit: &Hit, upto: usize) -> Vec<Run<'_>> {
    hit.pieces
        .iter()
        .filter(|p| p.pos < upto)
        .map(|p| Run {
            pos: p.pos,
            len: p.len.min(upto - p.pos),
            src: Src::Cached(&p.kv, p.offset),
        })
        .collect()
}
