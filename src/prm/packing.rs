//! How the decoder lays a batch out: rows packed end to end in one token stream, never padded,
//! with the leading tokens every row shares computed once.

use candle_core::{Result, Tensor};

/// A row's own tokens sit at positions `pos0..pos0 + len`; positions `0..pos0` are the batch's
/// shared prefix, whose tokens sit once at `prefix_start..prefix_start + pos0` of the stream.
pub(super) struct Seq {
    pub start: usize,
    pub len: usize,
    pub pos0: usize,
    pub prefix_start: usize,
}

impl Seq {
    /// This row's keys (or values) at positions `k_start..k_start + k_len`, from the shared
    /// prefix and its own tokens: `t` is (1, nkv, stream, hd).
    pub fn keys(&self, t: &Tensor, k_start: usize, k_len: usize) -> Result<Tensor> {
        let end = k_start + k_len;
        let mut parts = Vec::with_capacity(2);
        if k_start < self.pos0 {
            let n = self.pos0.min(end) - k_start;
            parts.push(t.narrow(2, self.prefix_start + k_start, n)?);
        }
        let own = k_start.max(self.pos0);
        if end > own {
            parts.push(t.narrow(2, self.start + own - self.pos0, end - own)?);
        }
        match parts.len() {
            1 => parts[0].contiguous(),
            _ => Tensor::cat(&parts, 2),
        }
    }
}

/// Shortest prefix worth sharing: below it, the per-row copies of its keys cost about what
/// recomputing it would.
const MIN_SHARED_PREFIX: usize = 16;

/// How many leading tokens every row that is read shares (at least two such rows), when that is
/// worth computing once: capped below every read position, so each read lies in its row's own
/// tokens. Causality makes the prefix's hidden states the same in every row, so sharing is exact.
/// (chat-lm and the chat-template families open every trace with the same system prompt.)
pub(super) fn shared_prefix(rows: &[&[u32]], positions: &[&[usize]], lens: &[usize]) -> usize {
    let live: Vec<usize> = (0..rows.len()).filter(|&i| lens[i] > 0).collect();
    if live.len() < 2 {
        return 0;
    }
    let first = &rows[live[0]][..lens[live[0]]];
    let mut shared = live
        .iter()
        .flat_map(|&i| positions[i].iter().copied())
        .min()
        .unwrap_or(0);
    for &i in &live[1..] {
        let row = &rows[i][..lens[i]];
        shared = shared.min(first.iter().zip(row).take_while(|(a, b)| a == b).count());
    }
    if shared >= MIN_SHARED_PREFIX {
        shared
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_prefix_is_the_common_start_below_every_read() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[30] = 999;
        let (ra, rb): (&[u32], &[u32]) = (&a, &b);
        let lens = [40, 40];
        assert_eq!(shared_prefix(&[ra, rb], &[&[39], &[35]], &lens), 30);
        // Capped by the earliest read.
        assert_eq!(shared_prefix(&[ra, rb], &[&[39], &[20]], &lens), 20);
        // Too short to be worth it, a single row, or a row with nothing to read.
        assert_eq!(shared_prefix(&[ra, rb], &[&[39], &[10]], &lens), 0);
        assert_eq!(shared_prefix(&[ra], &[&[39]], &[40]), 0);
        assert_eq!(shared_prefix(&[ra, rb], &[&[39], &[]], &[40, 0]), 0);
    }
}
