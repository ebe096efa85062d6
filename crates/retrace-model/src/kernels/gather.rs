//! One block of a kv head's keys and values gathered for attention's score tile: the keys
//! transposed (hd x BK), the values copied (BK x hd), from the runs they live in (the packed
//! stream, the prefix cache's tensors). Attention gathers each block once per task of 32
//! queries, so on a long row the transposition is a few percent of the forward; on AVX-512 it
//! runs as 16 x 16 in-register transposes rather than one scattered store per element.

use super::simd::{Level, level};

/// Keys per block: the bookkeeping (gathering, masking, the softmax's max) is per block, so
/// larger blocks amortize it; 64 measured faster than 32 at 512 and 2,048 keys.
pub(super) const BK: usize = 64;

/// Keys and values at positions `pos..pos + len`: kv head `g`'s key at position `p` is row
/// `g * stride + offset + p - pos` of `k` (rows of head_dim), and likewise its value in `v`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct KvRun<'a> {
    pub(crate) pos: usize,
    pub(crate) len: usize,
    pub(crate) k: &'a [f32],
    pub(crate) v: &'a [f32],
    pub(crate) stride: usize,
    pub(crate) offset: usize,
}

/// Keys `j0..j1` of kv head `kv` from `runs`: transposed into `kt` (hd x BK), values into
/// `vb` (BK x hd); a short block's remaining columns are zeroed (they are masked).
pub(super) fn gather(
    runs: &[KvRun],
    kv: usize,
    hd: usize,
    (j0, j1): (usize, usize),
    kt: &mut [f32],
    vb: &mut [f32],
) {
    if j1 - j0 < BK {
        kt.fill(0.0);
    }
    let wide = level() == Level::Avx512 && hd.is_multiple_of(16);
    for run in runs {
        let (lo, hi) = (run.pos.max(j0), (run.pos + run.len).min(j1));
        let mut p = lo;
        while p < hi {
            let row = (kv * run.stride + run.offset + p - run.pos) * hd;
            let j = p - j0;
            if wide && p + 16 <= hi {
                // Sixteen keys are sixteen consecutive rows of the run.
                #[cfg(target_arch = "x86_64")]
                // SAFETY: `level` says this CPU has AVX-512F.
                unsafe {
                    transpose_keys(&run.k[row..row + 16 * hd], hd, &mut kt[j..])
                };
                vb[j * hd..(j + 16) * hd].copy_from_slice(&run.v[row..row + 16 * hd]);
                p += 16;
                continue;
            }
            for (d, &k) in run.k[row..row + hd].iter().enumerate() {
                kt[d * BK + j] = k;
            }
            vb[j * hd..(j + 1) * hd].copy_from_slice(&run.v[row..row + hd]);
            p += 1;
        }
    }
}

/// Sixteen keys (rows of `hd`, a multiple of 16, in `k`) into columns `0..16` of `kt` (rows of
/// BK): each 16 x 16 square of them transposed in registers.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn transpose_keys(k: &[f32], hd: usize, kt: &mut [f32]) {
    use std::arch::x86_64::{_mm512_loadu_ps, _mm512_setzero_ps, _mm512_storeu_ps};
    assert!(k.len() >= 16 * hd && kt.len() >= (hd - 1) * BK + 16);
    for c in (0..hd).step_by(16) {
        let mut rows = [_mm512_setzero_ps(); 16];
        for (i, row) in rows.iter_mut().enumerate() {
            // SAFETY: row i's lanes c..c + 16 lie in `k` (asserted above).
            *row = unsafe { _mm512_loadu_ps(k[i * hd + c..].as_ptr()) };
        }
        for (i, col) in transpose16(rows).into_iter().enumerate() {
            // SAFETY: row c + i of `kt` has 16 lanes from its start (asserted above).
            unsafe { _mm512_storeu_ps(kt[(c + i) * BK..].as_mut_ptr(), col) };
        }
    }
}

/// A 16 x 16 f32 matrix (one register per row) transposed: pairs of lanes, then pairs of
/// pairs, then 128-bit quarters twice. Loops rather than closures, which would not inherit
/// the target feature.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn transpose16(r: [std::arch::x86_64::__m512; 16]) -> [std::arch::x86_64::__m512; 16] {
    use std::arch::x86_64::*;
    let mut t = [_mm512_setzero_ps(); 16];
    for i in (0..16).step_by(2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    // u[4g + m] from t[4g + m / 2] and t[4g + 2 + m / 2]: low halves for even m.
    let mut u = [_mm512_setzero_ps(); 16];
    for g in (0..16).step_by(4) {
        for m in 0..2 {
            let a = _mm512_castps_pd(t[g + m]);
            let b = _mm512_castps_pd(t[g + 2 + m]);
            u[g + 2 * m] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            u[g + 2 * m + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    }
    // v[8h + m] from u[8h + m % 4] and u[8h + 4 + m % 4]: even quarters for m < 4.
    let mut v = [_mm512_setzero_ps(); 16];
    for h in (0..16).step_by(8) {
        for m in 0..4 {
            v[h + m] = _mm512_shuffle_f32x4::<0x88>(u[h + m], u[h + 4 + m]);
            v[h + 4 + m] = _mm512_shuffle_f32x4::<0xdd>(u[h + m], u[h + 4 + m]);
        }
    }
    let mut out = [_mm512_setzero_ps(); 16];
    for m in 0..8 {
        out[m] = _mm512_shuffle_f32x4::<0x88>(v[m], v[8 + m]);
        out[8 + m] = _mm512_shuffle_f32x4::<0xdd>(v[m], v[8 + m]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wide path (on a CPU with AVX-512) against the element-by-element one, over runs
    /// that start mid-block and blocks that end short.
    #[test]
    fn gathered_blocks_hold_each_key_transposed_and_each_value() {
        let hd = 32;
        let k: Vec<f32> = (0..200 * hd).map(|i| i as f32).collect();
        let v: Vec<f32> = (0..200 * hd).map(|i| -(i as f32)).collect();
        let run = |pos, len, offset| KvRun {
            pos,
            len,
            k: &k,
            v: &v,
            stride: 100,
            offset,
        };
        let runs = [run(0, 37, 3), run(37, 60, 40)];
        for (j0, j1) in [(0, 64), (5, 69), (40, 97), (64, 97)] {
            let (mut kt, mut vb) = (vec![f32::NAN; hd * BK], vec![f32::NAN; BK * hd]);
            gather(&runs, 1, hd, (j0, j1), &mut kt, &mut vb);
            for j in 0..BK {
                let p = j0 + j;
                let at = runs.iter().find(|r| (r.pos..r.pos + r.len).contains(&p));
                for d in 0..hd {
                    match at {
                        Some(r) if p < j1 => {
                            let row = (r.stride + r.offset + p - r.pos) * hd;
                            assert_eq!(kt[d * BK + j], k[row + d], "key {p} dim {d}");
                            assert_eq!(vb[j * hd + d], v[row + d], "value {p} dim {d}");
                        }
                        _ => assert_eq!(kt[d * BK + j], 0.0, "key {p} past the block"),
                    }
                }
            }
        }
    }
}
