//! A step's own tokens, as a head that pools over them reads them: the positions a pass reads
//! for such a head (each row's read positions, then every step's span of tokens, in order), and
//! where each span's rows lie among them. Training and serving both lay reads out this way, so
//! a span's mean is taken over the same rows on both sides.

use std::ops::Range;

/// A step's tokens: positions `start..end` of its row.
pub type Span = Range<usize>;

/// The positions a row is read at when a head pools over spans: `positions` (one per step),
/// then each span's positions in order.
pub fn span_reads(positions: &[usize], spans: &[Span]) -> Vec<usize> {
    let mut out = positions.to_vec();
    for s in spans {
        out.extend(s.clone());
    }
    out
}

/// Where each of a row's spans lies among its reads laid out by `span_reads` (`reads`: its
/// read positions' count), counted from the row's first read.
pub fn span_rows(reads: usize, spans: &[Span]) -> Vec<Range<usize>> {
    let mut at = reads;
    spans
        .iter()
        .map(|s| {
            let rows = at..at + s.len();
            at = rows.end;
            rows
        })
        .collect()
}

/// Where a batch's spans lie among its reads laid out by `span_reads` row after row: each
/// read's own row (row-major), and each span's rows, in the same order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SpanRows {
    pub(crate) reads: Vec<u32>,
    pub(crate) spans: Vec<Range<usize>>,
}

impl SpanRows {
    /// The layout of rows with `positions` and `spans` (one span per read), or why not.
    pub(crate) fn new(positions: &[&[usize]], spans: &[&[Span]]) -> Result<Self, String> {
        if spans.len() != positions.len() {
            return Err(format!(
                "{} span lists for a batch of {}",
                spans.len(),
                positions.len()
            ));
        }
        let mut out = SpanRows {
            reads: Vec::new(),
            spans: Vec::new(),
        };
        let mut at = 0;
        for (row, (p, s)) in positions.iter().zip(spans).enumerate() {
            if s.is_empty() && !p.is_empty() {
                return Err(format!(
                    "row {row}: this head reads each step's own tokens, and none were marked"
                ));
            }
            if p.len() != s.len() {
                return Err(format!(
                    "row {row}: {} reads but {} spans",
                    p.len(),
                    s.len()
                ));
            }
            if let Some(k) = s.iter().position(|s| s.is_empty()) {
                return Err(format!("row {row}: step {k}'s span holds no token"));
            }
            // A step's tokens come before its read (the pass computes no further than a row's
            // last read, and counts its tokens so).
            if let Some(k) = s.iter().zip(*p).position(|(s, &at)| s.end > at + 1) {
                return Err(format!(
                    "row {row}: step {k}'s span {:?} runs past its read at {}",
                    s[k], p[k]
                ));
            }
            out.reads.extend((at..at + p.len()).map(|r| r as u32));
            let rows = span_rows(p.len(), s);
            out.spans
                .extend(rows.iter().map(|r| at + r.start..at + r.end));
            at += rows.last().map_or(p.len(), |r| r.end);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_follow_their_rows_reads() {
        let p0: &[usize] = &[5, 9];
        let s0: &[Span] = &[1..4, 6..8];
        let p1: &[usize] = &[3];
        let s1: &[Span] = &[Span { start: 0, end: 2 }];
        assert_eq!(span_reads(p0, s0), vec![5, 9, 1, 2, 3, 6, 7]);
        let rows = SpanRows::new(&[p0, p1], &[s0, s1]).unwrap();
        assert_eq!(rows.reads, vec![0, 1, 7]);
        assert_eq!(rows.spans, vec![2..5, 5..7, 8..10]);
        let empty: &[Span] = &[1..4, 6..6];
        assert!(
            SpanRows::new(&[p0], &[empty])
                .unwrap_err()
                .contains("step 1")
        );
        assert!(
            SpanRows::new(&[p0], &[s1])
                .unwrap_err()
                .contains("2 reads but 1")
        );
        let late: &[Span] = &[1..4, 6..11];
        assert!(
            SpanRows::new(&[p0], &[late])
                .unwrap_err()
                .contains("step 1's span 6..11 runs past its read at 9")
        );
    }
}
