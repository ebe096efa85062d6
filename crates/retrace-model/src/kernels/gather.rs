//! Blocks of a kv head's keys and values for attention's score tile: the keys transposed
//! (hd x BK), the values copied (BK x hd), from the runs they live in (the packed stream, the
//! prefix cache's tensors). `Blocks` gathers each query group's blocks once per attention call,
//! for every task of the group to read; on AVX-512 the transposition runs as 16 x 16
//! in-register transposes rather than one scattered store per element.

use super::simd::{Level, level};
use rayon::prelude::*;
use std::cell::Cell;

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

/// Every query group's keys and values, per kv head, in blocks of BK positions on the grid of
/// absolute positions (block b holds positions `b * BK..`), gathered once and read by every
/// task of the group. Gathered per task instead, a row of 4,096 tokens transposed and copied
/// its keys once per 32 queries: about 6% of that forward.
pub(super) struct Blocks {
    buf: Vec<f32>,
    /// Per group: where its blocks start in `buf`, its first block, its blocks per kv head.
    spans: Vec<(usize, usize, usize)>,
    hd: usize,
}

thread_local! {
    /// The last `Blocks`' buffer, for the next: a fresh one of a long row's size came from the
    /// OS on every call, and faulting its pages in cost about 4% of a forward at 4,096. The
    /// forward's thread keeps its largest, which a forward of that size holds anyway.
    static SPARE: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

impl Drop for Blocks {
    fn drop(&mut self) {
        SPARE.set(std::mem::take(&mut self.buf));
    }
}

/// A group's key runs and the positions `lo..hi` its queries see.
pub(super) type Keys<'a> = (&'a [KvRun<'a>], (usize, usize));

/// One block to gather: the runs, the kv head, its positions, and where it goes.
type Job<'a, 'b> = (&'a [KvRun<'a>], usize, (usize, usize), &'b mut [f32]);

impl Blocks {
    /// The blocks of `kv` kv heads of size `hd` covering each group's positions.
    pub(super) fn gather(groups: &[Keys], kv: usize, hd: usize) -> Self {
        let size = 2 * hd * BK;
        let mut spans = Vec::with_capacity(groups.len());
        let mut at = 0;
        for &(_, (lo, hi)) in groups {
            let first = lo / BK;
            let count = hi.div_ceil(BK).saturating_sub(first);
            spans.push((at, first, count));
            at += kv * count * size;
        }
        let mut buf = SPARE.take();
        buf.clear();
        buf.resize(at, 0.0);
        let mut jobs: Vec<Job> = Vec::new();
        let mut rest = buf.as_mut_slice();
        for (&(runs, (_, hi)), &(_, first, count)) in groups.iter().zip(&spans) {
            for h in 0..kv {
                for b in first..first + count {
                    let (mine, tail) = std::mem::take(&mut rest).split_at_mut(size);
                    rest = tail;
                    jobs.push((runs, h, (b * BK, ((b + 1) * BK).min(hi)), mine));
                }
            }
        }
        let fill = |(runs, h, keys, mine): Job| {
            let (kt, vb) = mine.split_at_mut(hd * BK);
            gather(runs, h, hd, keys, kt, vb);
        };
        if super::pieces(at) == 1 {
            jobs.into_iter().for_each(fill);
        } else {
            jobs.into_par_iter().for_each(fill);
        }
        Self { buf, spans, hd }
    }

    /// Group `g`'s block `b` (positions `b * BK..`) of kv head `h`: its keys transposed
    /// (hd x BK) and its values (BK x hd).
    pub(super) fn block(&self, g: usize, h: usize, b: usize) -> (&[f32], &[f32]) {
        let (at, first, count) = self.spans[g];
        let size = 2 * self.hd * BK;
        let i = at + (h * count + b - first) * size;
        self.buf[i..i + size].split_at(self.hd * BK)
    }
}

/// Keys `j0..j1` of kv head `kv` from `runs`: transposed into `kt` (hd x BK), values into
/// `vb` (BK x hd); a short block's remaining columns are zeroed (they are masked).
fn gather(
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

    /// `n` keys and values, each element its index (values negated), so every one is told
    /// apart.
    fn keys_and_values(n: usize) -> (Vec<f32>, Vec<f32>) {
        let k: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let v = k.iter().map(|x| -x).collect();
        (k, v)
    }

    /// Each group's blocks, read back, are what gathering that block alone gives, for a group
    /// whose positions start mid-block (a window) and one that starts at 0.
    #[test]
    fn blocks_hold_what_each_block_gathers() {
        let hd = 16;
        let (k, v) = keys_and_values(300 * hd);
        let run = |pos, len, offset| KvRun {
            pos,
            len,
            k: &k,
            v: &v,
            stride: 150,
            offset,
        };
        let (a, b) = ([run(0, 37, 3), run(37, 60, 40)], [run(70, 80, 0)]);
        let groups: [Keys; 2] = [(&a, (0, 97)), (&b, (100, 150))];
        let blocks = Blocks::gather(&groups, 2, hd);
        for (g, &(runs, (lo, hi))) in groups.iter().enumerate() {
            for h in 0..2 {
                for n in lo / BK..hi.div_ceil(BK) {
                    let (mut kt, mut vb) = (vec![0.0; hd * BK], vec![0.0; BK * hd]);
                    let keys = (n * BK, ((n + 1) * BK).min(hi));
                    gather(runs, h, hd, keys, &mut kt, &mut vb);
                    let (got_k, got_v) = blocks.block(g, h, n);
                    assert_eq!(got_k, &kt[..], "group {g} head {h} block {n}: keys");
                    assert_eq!(got_v, &vb[..], "group {g} head {h} block {n}: values");
                }
            }
        }
    }

    /// The wide path (on a CPU with AVX-512) against the element-by-element one, over runs
    /// that start mid-block and blocks that end short.
    #[test]
    fn gathered_blocks_hold_each_key_transposed_and_each_value() {
        let hd = 32;
        let (k, v) = keys_and_values(200 * hd);
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
