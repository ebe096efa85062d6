//! RoPE (Hugging Face's rotate-half form) applied as a projection's output is split into
//! heads: (tokens, heads * hd) in, (1, heads, tokens, hd) out, scaled on the way (the queries'
//! softmax scale), in one pass where candle's ops take three (scale, heads-first copy, rope).

use super::simd::simd_fn;
use super::{Kernels, f32s, for_rows};
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

/// `x` (tokens, heads * hd) times `scale`, split into heads and rotated by `cos`, `sin`
/// (tokens, hd / 2) each: (1, heads, tokens, hd), contiguous. The same arithmetic as scaling,
/// transposing and candle's `rope`, element for element.
pub fn rope_heads(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    heads: usize,
    scale: Option<f64>,
    kernels: Kernels,
) -> Result<Tensor> {
    let (tokens, width) = x.dims2()?;
    let hd = width / heads.max(1);
    if !kernels.fused_for(x) || cos.dtype() != x.dtype() {
        let x = match scale {
            Some(s) => (x * s)?,
            None => x.clone(),
        };
        let x = x.reshape((1, tokens, heads, hd))?.transpose(1, 2)?;
        let (cos, sin) = (cos.contiguous()?, sin.contiguous()?);
        return candle_nn::rotary_emb::rope(&x.contiguous()?, &cos, &sin);
    }
    if heads * hd != width || !hd.is_multiple_of(2) || cos.dims2()? != (tokens, hd / 2) {
        candle_core::bail!(
            "rope: {:?} in {heads} heads, cos {:?}",
            x.shape(),
            cos.shape()
        )
    }
    let op = RopeHeads {
        heads,
        scale: scale.map_or(1.0, |s| s as f32),
    };
    x.contiguous()?
        .apply_op3_no_bwd(&cos.contiguous()?, &sin.contiguous()?, &op)
}

struct RopeHeads {
    heads: usize,
    scale: f32,
}

impl CustomOp3 for RopeHeads {
    fn name(&self) -> &'static str {
        "rope-heads"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        cs: &CpuStorage,
        cl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let x = f32s(xs, xl, "x")?;
        let (cos, sin) = (f32s(cs, cl, "cos")?, f32s(ss, sl, "sin")?);
        let (tokens, width) = xl.shape().dims2()?;
        let hd = width / self.heads;
        let mut out = vec![0f32; x.len()];
        // Output rows are (head, token) pairs, head-major.
        for_rows(&mut out, self.heads * tokens, hd, hd, |r0, dst| {
            for (r, d) in dst.chunks_exact_mut(hd).enumerate() {
                let (h, t) = ((r0 + r) / tokens, (r0 + r) % tokens);
                let half = t * hd / 2..(t + 1) * hd / 2;
                let src = &x[t * width + h * hd..][..hd];
                rope_row(src, &cos[half.clone()], &sin[half], self.scale, d);
            }
        });
        let shape = Shape::from((1, self.heads, tokens, hd));
        Ok((CpuStorage::F32(out), shape))
    }
}

simd_fn! {
    /// One head of one token: scaled, then rotated half against half. Products and sums
    /// as candle's kernel writes them (no fused multiply-add), so the results are its own.
    fn rope_row<M>(x: &[f32], cos: &[f32], sin: &[f32], scale: f32, out: &mut [f32]) {
        let half = cos.len();
        let (lo, hi) = out.split_at_mut(half);
        for i in 0..half {
            let (a, b) = (x[i] * scale, x[i + half] * scale);
            lo[i] = a * cos[i] - b * sin[i];
            hi[i] = a * sin[i] + b * cos[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::{max_diff, tensor};

    #[test]
    fn rope_heads_matches_scale_transpose_and_candles_rope() {
        for (i, &(tokens, heads, hd)) in [(1, 1, 2), (5, 3, 8), (33, 9, 64), (300, 4, 128)]
            .iter()
            .enumerate()
        {
            let s = i as u64 * 5;
            let x = tensor(&[tokens, heads * hd], s + 1, 3.0);
            let cos = tensor(&[tokens, hd / 2], s + 2, 1.0);
            let sin = tensor(&[tokens, hd / 2], s + 3, 1.0);
            for scale in [None, Some(0.125)] {
                let got = rope_heads(&x, &cos, &sin, heads, scale, Kernels::Fused).unwrap();
                let want = rope_heads(&x, &cos, &sin, heads, scale, Kernels::Candle).unwrap();
                assert_eq!(got.dims(), &[1, heads, tokens, hd]);
                assert_eq!(max_diff(&got, &want), 0.0, "{tokens} x {heads} x {hd}");
            }
        }
    }
}
