//! Causal attention over one sequence, fused (the blocked kernel) or eager (candle's ops on the
//! whole masked score matrix): the kernel alone, for its own tests and the microbenchmark.

use super::attention::{Heads, QueryGroup, attend};
use super::gather::KvRun;
use super::{Kernels, f32s};
use candle_core::{DType, Result, Storage, Tensor};

/// Attention of `q` (1, heads, L, hd; scaled and rotated) over `k`, `v` (1, kv heads, L, hd)
/// at positions 0..L, causal and within `window` when given: (L, heads * hd). Grouped-query
/// heads share their kv head (heads a multiple of kv heads).
pub fn causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    window: Option<usize>,
    kernels: Kernels,
) -> Result<Tensor> {
    let (_, heads, len, hd) = q.dims4()?;
    let kv = k.dim(1)?;
    if kv == 0 || heads % kv != 0 || k.dims4()? != (1, kv, len, hd) {
        candle_core::bail!("attention: q {:?} over k {:?}", q.shape(), k.shape())
    }
    if !kernels.fused_for(q) {
        return eager(q, k, v, window);
    }
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let guards = [&q, &k, &v].map(|t| t.storage_and_layout());
    let data = guards
        .iter()
        .map(|(s, l)| match &**s {
            Storage::Cpu(cpu) => f32s(cpu, l, "attention"),
            _ => candle_core::bail!("the fused attention runs on the CPU only"),
        })
        .collect::<Result<Vec<_>>>()?;
    let positions: Vec<u32> = (0..len as u32).collect();
    let runs = [KvRun {
        pos: 0,
        len,
        k: data[1],
        v: data[2],
        stride: len,
        offset: 0,
    }];
    let group = QueryGroup {
        first_row: 0,
        positions: &positions,
        runs: &runs,
    };
    let dims = Heads {
        heads,
        kv,
        hd,
        window,
    };
    let mut out = vec![0f32; len * heads * hd];
    attend(data[0], len, std::slice::from_ref(&group), dims, &mut out);
    drop(guards);
    Tensor::from_vec(out, (len, heads * hd), q.device())
}

/// The unfused reference: scores for every (query, key) pair, an additive mask, softmax in
/// f32, then the values; grouped heads folded into the query rows.
fn eager(q: &Tensor, k: &Tensor, v: &Tensor, window: Option<usize>) -> Result<Tensor> {
    let (_, heads, len, hd) = q.dims4()?;
    let kv = k.dim(1)?;
    let group = heads / kv;
    let dev = q.device();
    let i = Tensor::arange(0f32, len as f32, dev)?.unsqueeze(1)?;
    let j = Tensor::arange(0f32, len as f32, dev)?.unsqueeze(0)?;
    let mut open = j.broadcast_le(&i)?;
    if let Some(w) = window {
        open = (open * j.broadcast_gt(&(&i - w as f64)?)?)?;
    }
    let shut = Tensor::full(f32::NEG_INFINITY, (len, len), dev)?;
    let mask = open.where_cond(&Tensor::zeros((len, len), DType::F32, dev)?, &shut)?;
    let scores = q
        .contiguous()?
        .reshape((1, kv, group * len, hd))?
        .matmul(&k.t()?)?
        .to_dtype(DType::F32)?
        .reshape((1, kv, group, len, len))?;
    let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&mask)?)?;
    let probs = probs
        .to_dtype(v.dtype())?
        .reshape((1, kv, group * len, len))?;
    let o = probs
        .matmul(&v.contiguous()?)?
        .reshape((1, heads, len, hd))?;
    o.transpose(1, 2)?.reshape((len, heads * hd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{max_diff, tensor};

    #[test]
    fn the_blocked_kernel_matches_eager_attention() {
        // Odd lengths around the block sizes, GQA and plain heads, head sizes 8 to 128,
        // windows shorter and longer than the sequence.
        let cases = [
            (1, 1, 1, 8, None),
            (5, 2, 1, 16, Some(2)),
            (33, 4, 2, 24, None),
            (97, 9, 3, 64, Some(40)),
            (130, 2, 2, 128, Some(500)),
            (257, 6, 2, 64, None),
        ];
        for (c, &(len, heads, kv, hd, window)) in cases.iter().enumerate() {
            let s = c as u64 * 7;
            let scale = 1.0 / (hd as f32).sqrt();
            let q = tensor(&[1, heads, len, hd], s + 1, 3.0 * scale);
            let k = tensor(&[1, kv, len, hd], s + 2, 3.0);
            let v = tensor(&[1, kv, len, hd], s + 3, 2.0);
            let got = causal_attention(&q, &k, &v, window, Kernels::Fused).unwrap();
            let want = causal_attention(&q, &k, &v, window, Kernels::Candle).unwrap();
            let d = max_diff(&got, &want);
            assert!(
                d < 1e-5,
                "L {len}, {heads}/{kv} heads of {hd}, {window:?}: {d}"
            );
        }
    }

    #[test]
    fn a_nan_query_gives_nan_out_and_leaves_the_other_rows_alone() {
        let (len, heads, hd) = (70, 2, 16);
        let mut qv = crate::kernels::testing::values(heads * len * hd, 5, 0.5);
        // Head 1's query at position 40: its scores are NaN, over two key blocks.
        qv[(len + 40) * hd + 3] = f32::NAN;
        let q = Tensor::from_vec(qv, (1, heads, len, hd), &candle_core::Device::Cpu).unwrap();
        let k = tensor(&[1, 1, len, hd], 2, 2.0);
        let v = tensor(&[1, 1, len, hd], 3, 2.0);
        let got = causal_attention(&q, &k, &v, None, Kernels::Fused).unwrap();
        let got = got.to_vec2::<f32>().unwrap();
        for (p, row) in got.iter().enumerate() {
            let (h0, h1) = row.split_at(hd);
            assert!(h0.iter().all(|x| x.is_finite()), "row {p}, head 0: {h0:?}");
            let want_nan = p == 40;
            assert!(
                h1.iter().all(|x| x.is_nan() == want_nan),
                "row {p}, head 1: {h1:?}"
            );
        }
    }
}
