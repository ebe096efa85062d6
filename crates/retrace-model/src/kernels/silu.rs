//! The MLP's SiLU(gate) * up in one pass: from one joined (rows, 2I) projection (gate in the
//! first half of each row, up in the second), or from two (rows, I) ones. Candle's ops make
//! three passes (silu, then a product) and call libm's `expf` per element.

use super::exp::exp;
use super::simd::simd_fn;
use super::{Kernels, f32s, for_rows};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, D, Layout, Result, Shape, Tensor};

/// SiLU(gate) * up for `gate_up` (.., 2I) holding gate, then up, in each row: (.., I).
pub fn silu_mul_joined(gate_up: &Tensor, kernels: Kernels) -> Result<Tensor> {
    let i = gate_up.dim(D::Minus1)? / 2;
    if !kernels.fused_for(gate_up) {
        let gate = gate_up.narrow(D::Minus1, 0, i)?;
        let up = gate_up.narrow(D::Minus1, i, i)?;
        return gate.silu()? * up;
    }
    gate_up.contiguous()?.apply_op1_no_bwd(&SiluMul)
}

/// SiLU(gate) * up for `gate` and `up` of one shape.
pub fn silu_mul(gate: &Tensor, up: &Tensor, kernels: Kernels) -> Result<Tensor> {
    if !kernels.fused_for(gate) || gate.shape() != up.shape() {
        return gate.silu()? * up;
    }
    gate.contiguous()?
        .apply_op2_no_bwd(&up.contiguous()?, &SiluMul)
}

struct SiluMul;

/// Elements' cost relative to a copy, for the threading threshold (an exp and a division).
const COST: usize = 8;

impl CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul-joined"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let src = f32s(s, l, "gate_up")?;
        let width = l.dims().last().copied().unwrap_or(0);
        if !width.is_multiple_of(2) {
            candle_core::bail!("silu-mul: odd joined width {width}")
        }
        let i = width / 2;
        let rows = src.len() / width.max(1);
        let mut out = vec![0f32; rows * i];
        for_rows(&mut out, rows, i, i * COST, |r0, dst| {
            for (r, d) in dst.chunks_exact_mut(i).enumerate() {
                let row = &src[(r0 + r) * width..][..width];
                silu_mul_row(&row[..i], &row[i..], d);
            }
        });
        let mut dims = l.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last = i;
        }
        Ok((CpuStorage::F32(out), Shape::from(dims)))
    }
}

impl CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (gate, up) = (f32s(gs, gl, "gate")?, f32s(us, ul, "up")?);
        let width = gl.dims().last().copied().unwrap_or(1).max(1);
        let rows = gate.len() / width;
        let mut out = vec![0f32; gate.len()];
        for_rows(&mut out, rows, width, width * COST, |r0, dst| {
            let at = r0 * width..r0 * width + dst.len();
            silu_mul_row(&gate[at.clone()], &up[at], dst);
        });
        Ok((CpuStorage::F32(out), gl.shape().clone()))
    }
}

simd_fn! {
    /// `out = gate / (1 + e^-gate) * up`, element by element, as candle's silu then product.
    fn silu_mul_row<M>(gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = g / (exp::<M>(-g) + 1.0) * u;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{max_diff, tensor};

    #[test]
    fn silu_mul_matches_candles_silu_then_product() {
        for (i, &(rows, width)) in [(1, 2), (3, 34), (5, 3072), (64, 130), (700, 1536)]
            .iter()
            .enumerate()
        {
            let joined = tensor(&[rows, width], i as u64 + 11, 12.0);
            let got = silu_mul_joined(&joined, Kernels::Fused).unwrap();
            let want = silu_mul_joined(&joined, Kernels::Candle).unwrap();
            assert_eq!(got.dims(), &[rows, width / 2]);
            assert!(max_diff(&got, &want) < 1e-6, "{rows}x{width}");
            let gate = tensor(&[rows, width], i as u64 + 21, 30.0);
            let up = tensor(&[rows, width], i as u64 + 31, 3.0);
            let got = silu_mul(&gate, &up, Kernels::Fused).unwrap();
            let want = silu_mul(&gate, &up, Kernels::Candle).unwrap();
            assert!(max_diff(&got, &want) < 1e-6, "{rows}x{width}");
        }
    }
}
