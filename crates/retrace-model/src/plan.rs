//! How one batch is laid out for the decoder: each row's cached prefix, then the rest as a tree
//! of segments in one packed stream, so tokens several rows share (at the same positions, after
//! the same context) are computed once: a Rank's candidates, the samples of one prompt, the
//! beams of one search. Pure: token ids and cached lengths in, the layout out.

/// Positions `pos0..pos0 + len` of every row through it, computed once at stream rows
/// `start..start + len`.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Segment {
    pub(crate) start: usize,
    pub(crate) len: usize,
    pub(crate) pos0: usize,
    /// The segment computed just before this one on its rows' paths: their context between the
    /// cached prefix and `pos0`. `None` when the cached prefix reaches `pos0`.
    pub(crate) parent: Option<usize>,
    /// A row through this segment; its cached prefix is the segment's cached context.
    pub(crate) row: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Layout {
    /// Parents before children, in stream order.
    pub(crate) segments: Vec<Segment>,
    /// Per row, the segments covering its positions from its cached length to its end.
    pub(crate) paths: Vec<Vec<usize>>,
    /// Each row's cached length as the layout uses it.
    pub(crate) cached: Vec<usize>,
    /// Tokens in the stream: what the batch computes.
    pub(crate) tokens: usize,
}

impl Layout {
    /// The segment of row `row` holding position `pos` (at or past its cached length).
    pub(crate) fn segment_at(&self, row: usize, pos: usize) -> Option<usize> {
        self.paths[row].iter().copied().find(|&s| {
            let seg = &self.segments[s];
            (seg.pos0..seg.pos0 + seg.len).contains(&pos)
        })
    }
}

/// Lays out `rows` (each already cut to the tokens it needs) whose first `cached[i]` tokens
/// the cache holds. With `share`, rows computing the same tokens after the same context share
/// one segment; without it, each row is computed on its own (to measure what sharing saves).
pub(crate) fn layout(rows: &[&[u32]], cached: &[usize], share: bool) -> Layout {
    let mut out = Layout {
        segments: Vec::new(),
        paths: vec![Vec::new(); rows.len()],
        cached: cached
            .iter()
            .zip(rows)
            .map(|(&c, r)| c.min(r.len()))
            .collect(),
        tokens: 0,
    };
    let live: Vec<usize> = (0..rows.len()).filter(|&i| !rows[i].is_empty()).collect();
    if share {
        group(rows, live, 0, None, &mut out);
    } else {
        for i in live {
            group(rows, vec![i], 0, None, &mut out);
        }
    }
    out
}

/// Rows of `members` share tokens `..at` and are longer than `at`.
fn group(rows: &[&[u32]], members: Vec<usize>, at: usize, parent: Option<usize>, out: &mut Layout) {
    let end = match members.as_slice() {
        [one] => rows[*one].len(),
        _ => {
            let first = rows[members[0]];
            let shared = members[1..]
                .iter()
                .map(|&i| common(&first[at..], &rows[i][at..]))
                .min()
                .unwrap_or(0);
            at + shared
        }
    };
    let mut parent = parent;
    if end > at {
        // Rows that share tokens ..end share what the cache holds of them (the cache is keyed
        // by tokens); the minimum keeps that true even if they didn't.
        let cached = members.iter().map(|&i| out.cached[i]).min().unwrap_or(0);
        if cached < end {
            for &i in &members {
                out.cached[i] = out.cached[i].min(cached.max(at));
            }
        }
        let pos0 = at.max(cached);
        if pos0 < end {
            let id = out.segments.len();
            out.segments.push(Segment {
                start: out.tokens,
                len: end - pos0,
                pos0,
                parent,
                row: members[0],
            });
            out.tokens += end - pos0;
            for &i in &members {
                out.paths[i].push(id);
            }
            parent = Some(id);
        }
    }
    // Rows that go on split by their next token, in order of first appearance.
    let mut next: Vec<(u32, Vec<usize>)> = Vec::new();
    for &i in &members {
        let Some(&token) = rows[i].get(end) else {
            continue;
        };
        match next.iter_mut().find(|(t, _)| *t == token) {
            Some((_, list)) => list.push(i),
            None => next.push((token, vec![i])),
        }
    }
    for (_, list) in next {
        group(rows, list, end, parent, out);
    }
}

fn common(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(start: usize, len: usize, pos0: usize, parent: Option<usize>, row: usize) -> Segment {
        Segment {
            start,
            len,
            pos0,
            parent,
            row,
        }
    }

    #[test]
    fn shared_tokens_are_computed_once_per_group() {
        // Two rows share 4 tokens, a third shares 2 with them; one row is unrelated.
        let rows: [&[u32]; 4] = [&[1, 2, 3, 4, 5, 6], &[1, 2, 3, 4, 7], &[1, 2, 9], &[8, 8]];
        let l = layout(&rows, &[0; 4], true);
        assert_eq!(
            l.segments,
            vec![
                seg(0, 2, 0, None, 0),    // [1, 2]
                seg(2, 2, 2, Some(0), 0), // [3, 4]
                seg(4, 2, 4, Some(1), 0), // [5, 6]
                seg(6, 1, 4, Some(1), 1), // [7]
                seg(7, 1, 2, Some(0), 2), // [9]
                seg(8, 2, 0, None, 3),    // [8, 8]
            ]
        );
        assert_eq!(
            l.paths,
            vec![vec![0, 1, 2], vec![0, 1, 3], vec![0, 4], vec![5]]
        );
        assert_eq!(l.tokens, 10);
        assert_eq!(l.segment_at(1, 4), Some(3));
        assert_eq!(l.segment_at(1, 3), Some(1));
    }

    #[test]
    fn cached_prefixes_are_skipped_and_identical_rows_collapse() {
        let rows: [&[u32]; 3] = [&[1, 2, 3, 4], &[1, 2, 3, 5], &[1, 2, 3, 4]];
        let l = layout(&rows, &[3, 3, 3], true);
        assert_eq!(
            l.segments,
            vec![seg(0, 1, 3, None, 0), seg(1, 1, 3, None, 1)]
        );
        assert_eq!(l.paths, vec![vec![0], vec![1], vec![0]]);
        // Fully cached: nothing to compute.
        let l = layout(&rows[..1], &[4], true);
        assert!(l.segments.is_empty() && l.paths[0].is_empty());
        // Without sharing, every row computes its own uncached tokens.
        let l = layout(&rows, &[2, 0, 3], false);
        assert_eq!(l.tokens, 2 + 4 + 1);
        assert_eq!(l.paths, vec![vec![0], vec![1], vec![2]]);
    }

    #[test]
    fn empty_rows_have_no_path() {
        let rows: [&[u32]; 2] = [&[], &[4, 5]];
        let l = layout(&rows, &[0, 0], true);
        assert_eq!(l.paths, vec![vec![], vec![0]]);
        assert_eq!(l.tokens, 2);
    }
}
