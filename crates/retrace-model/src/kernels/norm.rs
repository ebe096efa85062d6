//! Residual add + RMS norm in one pass over the rows: `x + h` (the new residual stream) and
//! its RMS norm, where candle's ops read and write the stream twice (an add, then a norm).

use super::simd::simd_fn;
use super::{Kernels, f32s};
use candle_core::{CpuStorage, CustomOp3, Layout, Module, Result, Shape, Tensor};
use candle_nn::RmsNorm;

/// `(x + h, norm(x + h))`: the residual stream after adding `h`, and its RMS norm, for `x`
/// and `h` of one shape (rows, H). Fused on CPU f32 (one pass); candle's add and norm
/// otherwise.
pub fn add_rms_norm(
    x: &Tensor,
    h: &Tensor,
    norm: &RmsNorm,
    kernels: Kernels,
) -> Result<(Tensor, Tensor)> {
    if !kernels.fused_for(x) || x.shape() != h.shape() {
        let sum = (x + h)?;
        let normed = norm.forward(&sum)?;
        return Ok((sum, normed));
    }
    let op = AddRmsNorm {
        eps: norm.eps() as f32,
    };
    let both =
        x.contiguous()?
            .apply_op3_no_bwd(&h.contiguous()?, &norm.weight().contiguous()?, &op)?;
    // Two halves of one storage: the unfused ops allocated the same two tensors.
    Ok((both.get(0)?, both.get(1)?))
}

struct AddRmsNorm {
    eps: f32,
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }

    /// (2, ..x's shape): the sum, then its norm.
    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        hs: &CpuStorage,
        hl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, h) = (f32s(xs, xl, "x")?, f32s(hs, hl, "h")?);
        let w = f32s(ws, wl, "norm weight")?;
        let dim = w.len();
        if dim == 0 || x.len() != h.len() || x.len() % dim != 0 {
            candle_core::bail!(
                "add-rms-norm: {:?} + {:?} over {dim}",
                xl.shape(),
                hl.shape()
            )
        }
        let rows = x.len() / dim;
        let mut out = vec![0f32; 2 * x.len()];
        let (sum, normed) = out.split_at_mut(x.len());
        // Pieces of the sum and the norm at the same rows go together.
        let mut pairs: Vec<(&mut [f32], &mut [f32])> = Vec::new();
        let per = rows.div_ceil(super::pieces(x.len() * 3)) * dim;
        for (s, n) in sum.chunks_mut(per).zip(normed.chunks_mut(per)) {
            pairs.push((s, n));
        }
        let eps = self.eps;
        let run = |i: usize, s: &mut [f32], n: &mut [f32]| {
            let at = i * per;
            add_norm_rows(&x[at..at + s.len()], &h[at..at + s.len()], w, eps, s, n)
        };
        if pairs.len() == 1 {
            let (s, n) = pairs.pop().expect("one piece");
            run(0, s, n);
        } else {
            use rayon::prelude::*;
            pairs
                .into_par_iter()
                .enumerate()
                .for_each(|(i, (s, n))| run(i, s, n));
        }
        let mut dims = vec![2];
        dims.extend_from_slice(xl.dims());
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }
}

simd_fn! {
    /// Rows of `x + h` into `sum`, and their RMS norm (times `w`) into `normed`, as candle's
    /// norm computes it: x / sqrt(mean(x^2) + eps) * w.
    fn add_norm_rows<M>(
        x: &[f32],
        h: &[f32],
        w: &[f32],
        eps: f32,
        sum: &mut [f32],
        normed: &mut [f32],
    ) {
        let dim = w.len();
        for r in 0..sum.len() / dim {
            let at = r * dim..(r + 1) * dim;
            let (s, n) = (&mut sum[at.clone()], &mut normed[at.clone()]);
            let (xr, hr) = (&x[at.clone()], &h[at]);
            // Sixteen partial sums: one vector's lanes, summed in order at the end.
            let mut lanes = [0f32; 16];
            let whole = xr.chunks_exact(16).zip(hr.chunks_exact(16));
            for ((xa, ha), sa) in whole.zip(s.chunks_exact_mut(16)) {
                for l in 0..16 {
                    let v = xa[l] + ha[l];
                    sa[l] = v;
                    lanes[l] = M::mac(v, v, lanes[l]);
                }
            }
            for c in dim - dim % 16..dim {
                let v = xr[c] + hr[c];
                s[c] = v;
                lanes[c % 16] = M::mac(v, v, lanes[c % 16]);
            }
            let sum2: f32 = lanes.iter().sum();
            let m = (sum2 / dim as f32 + eps).sqrt();
            for c in 0..dim {
                n[c] = s[c] / m * w[c];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{max_diff, tensor};

    #[test]
    fn add_rms_norm_matches_candles_add_then_norm() {
        // Ragged widths and row counts, a single row, and enough rows to run threaded.
        for (i, &(rows, dim)) in [(1, 8), (3, 17), (7, 576), (129, 64), (300, 333), (2048, 96)]
            .iter()
            .enumerate()
        {
            let s = i as u64 * 3;
            let x = tensor(&[rows, dim], s + 1, 4.0);
            let h = tensor(&[rows, dim], s + 2, 4.0);
            let w = tensor(&[dim], s + 3, 2.0);
            let norm = RmsNorm::new(w, 1e-5);
            let (sum, normed) = add_rms_norm(&x, &h, &norm, Kernels::Fused).unwrap();
            let (want_sum, want) = add_rms_norm(&x, &h, &norm, Kernels::Candle).unwrap();
            assert_eq!(max_diff(&sum, &want_sum), 0.0, "{rows}x{dim}");
            assert!(max_diff(&normed, &want) < 1e-6, "{rows}x{dim}");
            assert!(sum.is_contiguous() && normed.is_contiguous());
        }
    }
}
