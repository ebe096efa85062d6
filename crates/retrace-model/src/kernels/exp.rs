//! An f32 `exp` without branches or library calls, so loops over it vectorize: libm's `expf`
//! is a scalar call per element, which made SiLU and the attention softmax cost more than
//! their arithmetic. Cephes' `expf` polynomial: within 2 ulp of `f32::exp`.

use super::simd::Mac;

/// Below this, `exp` is 0 (the true value is under f32's normal range); -inf included.
const LOW: f32 = -87.336_55;
/// Above this, `exp` saturates at its value here (just under f32::MAX); +inf included.
const HIGH: f32 = 88.376_26;

/// e^x, within 2 ulp, 0 below `LOW`, NaN for NaN (so a broken score reaches the output
/// rather than vanishing into a weight of 0).
#[inline(always)]
pub(crate) fn exp<M: Mac>(x: f32) -> f32 {
    // 1.5 * 2^23: adding it rounds to the nearest integer, which the low mantissa bits hold.
    const ROUND: f32 = 12_582_912.0;
    // max / min, not clamp: clamp's NaN and order checks keep loops from vectorizing.
    #[allow(clippy::manual_clamp)]
    let xc = x.max(LOW).min(HIGH);
    let t = M::mac(xc, std::f32::consts::LOG2_E, ROUND);
    let n = t - ROUND;
    // x - n ln 2, with ln 2 split in two so the first product is exact.
    let r = M::mac(n, -0.693_359_4, xc);
    let r = M::mac(n, 2.121_944_4e-4, r);
    let mut p = 1.987_569_1e-4;
    p = M::mac(p, r, 1.398_199_9e-3);
    p = M::mac(p, r, 8.333_452e-3);
    p = M::mac(p, r, 4.166_579_6e-2);
    p = M::mac(p, r, 1.666_666_5e-1);
    p = M::mac(p, r, 0.5);
    let p = M::mac(p, r * r, r) + 1.0;
    // 2^n from the rounded integer's bits (n in -126..=127 after the clamp).
    let n = (t.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let scale = f32::from_bits(((n + 127) as u32) << 23);
    // `max` and `min` return the other operand for NaN, so NaN is put back here.
    if x < LOW {
        0.0
    } else if x.is_nan() {
        x
    } else {
        p * scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::simd::{Fused, Plain};
    use crate::kernels::testing::{Gap, max_gap};

    #[test]
    fn exp_is_within_two_ulp_of_libm_zero_far_below_and_saturates_above() {
        let mut worst = 0f64;
        for i in -870_000..=880_000 {
            let x = i as f32 * 1e-4;
            let want = x.exp();
            // In units of the last place: a power of two, so the division is exact.
            let ulp = f32::from_bits(want.to_bits() + 1) - want;
            let got = [exp::<Plain>(x) / ulp, exp::<Fused>(x) / ulp];
            worst = worst.max(max_gap(&got, &[want / ulp; 2], Gap::Abs));
        }
        assert!(worst <= 2.0, "{worst} ulp");
        assert_eq!(exp::<Plain>(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp::<Fused>(-100.0), 0.0);
        assert_eq!(exp::<Plain>(0.0), 1.0);
        let top = exp::<Plain>(HIGH);
        assert!(top.is_finite() && top > 2e38, "{top}");
        for x in [100.0, f32::INFINITY] {
            assert_eq!(exp::<Plain>(x), top);
            assert_eq!(exp::<Fused>(x), top);
        }
    }

    #[test]
    fn exp_of_nan_is_nan() {
        for x in [f32::NAN, -f32::NAN] {
            assert!(exp::<Plain>(x).is_nan());
            assert!(exp::<Fused>(x).is_nan());
        }
    }
}
