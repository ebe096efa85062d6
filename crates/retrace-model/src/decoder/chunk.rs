//! The chunk plan: how each row's queries split into blocks that fit the attention budget, and
//! the causal (and sliding-window) mask each block attends with, built once per forward and
//! shared by every layer with the same window.

use super::packing::Seq;
use candle_core::{DType, Device, Result, Tensor};

/// How every row splits its queries into chunks for the layers with one sliding window (or
/// none), with each chunk's mask built once per forward and shared by all those layers.
pub(super) struct Plan {
    pub(super) window: Option<usize>,
    pub(super) rows: Vec<Vec<Chunk>>,
}

/// Queries `start..start + len` (in the row's query stream) over the row's keys at positions
/// `k_start..k_start + mask's last dim`, with the mask shaped to broadcast over
/// (1, nkv, group, len, keys). Keys after the chunk are masked for all its queries, and so are
/// keys before its first query's window: both are left out. `q_pos` holds the queries'
/// positions (what the fused kernel masks by).
pub(super) struct Chunk {
    pub(super) start: usize,
    pub(super) len: usize,
    pub(super) k_start: usize,
    pub(super) mask: Tensor,
    pub(super) q_pos: Vec<u32>,
}

/// Additive f32 mask (R, k_len) for queries at positions `q_pos` (u32, (R,)) over keys at
/// `k_start..k_start + k_len`: 0 where j <= i and i - j < window, else -inf. Built on the device.
fn mask(q_pos: &Tensor, k_start: usize, k_len: usize, window: Option<usize>) -> Result<Tensor> {
    let dev = q_pos.device();
    // f32 holds positions exactly (< 2^24) and, unlike u32, i - window may go negative.
    let q = q_pos.to_dtype(DType::F32)?.unsqueeze(1)?;
    let k = Tensor::arange(k_start as f32, (k_start + k_len) as f32, dev)?.unsqueeze(0)?;
    let shape = (q.dim(0)?, k_len);
    let open = Tensor::zeros(shape, DType::F32, dev)?;
    let shut = Tensor::full(f32::NEG_INFINITY, shape, dev)?;
    let open = match window {
        Some(w) => k
            .broadcast_gt(&(&q - w as f64)?)?
            .where_cond(&open, &shut)?,
        None => open,
    };
    k.broadcast_le(&q)?.where_cond(&open, &shut)
}

impl Chunk {
    /// One group of reads, `positions` (sorted, not empty), as queries `start..` of the
    /// gathered rows: over the keys up to the last of them, from the first one's window on.
    pub(super) fn at_reads(
        positions: &[usize],
        start: usize,
        window: Option<usize>,
        dev: &Device,
    ) -> Result<Self> {
        let (Some(&lo), Some(&hi)) = (positions.first(), positions.last()) else {
            candle_core::bail!("a read group with no position")
        };
        let k_start = window.map_or(0, |w| (lo + 1).saturating_sub(w));
        let qp: Vec<u32> = positions.iter().map(|p| *p as u32).collect();
        let qt = Tensor::from_vec(qp.clone(), qp.len(), dev)?;
        let m = mask(&qt, k_start, hi + 1 - k_start, window)?.reshape((1, 1, 1, qp.len(), ()))?;
        Ok(Self {
            start,
            len: qp.len(),
            k_start,
            mask: m,
            q_pos: qp,
        })
    }
}

impl Plan {
    pub(super) fn new(
        seqs: &[Seq],
        (budget, block): (usize, usize),
        n_heads: usize,
        window: Option<usize>,
        dev: &Device,
    ) -> Result<Self> {
        let rows = seqs
            .iter()
            .map(|seq| {
                let (l, p0) = (seq.len, seq.pos0);
                // Rows are attended one at a time, so the budget is per row.
                let chunk = (budget / (4 * n_heads * (p0 + l).max(1))).clamp(1, block);
                (0..l)
                    .step_by(chunk)
                    .map(|start| {
                        let len = chunk.min(l - start);
                        let first = p0 + start;
                        let k_start = window.map_or(0, |w| (first + 1).saturating_sub(w));
                        let q_pos: Vec<u32> = (first as u32..(first + len) as u32).collect();
                        let qt = Tensor::from_slice(&q_pos, len, dev)?;
                        let mask = mask(&qt, k_start, first + len - k_start, window)?;
                        let mask = mask.reshape((1, 1, 1, len, ()))?;
                        Ok(Chunk {
                            start,
                            len,
                            k_start,
                            mask,
                            q_pos,
                        })
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { window, rows })
    }

    /// The window of the layers this plan is for.
    pub(super) fn window(&self) -> Option<usize> {
        self.window
    }
}
