//! Blocked causal attention with an online softmax, on f32 slices: for each block of a query
//! group's queries and each of its kv heads, key blocks in order with a running max, sum and
//! accumulator per query row, so no (queries x keys) score matrix is ever built and masked
//! blocks are never computed. Grouped-query heads read their kv head's keys by index: each
//! group's key blocks are gathered once (`gather::Blocks`) from their runs (the packed stream,
//! or the prefix cache's tensors), and every task of the group reads them.

use super::exp::exp;
use super::gather::{BK, Blocks, Keys, KvRun};
use super::simd::{Mac, simd_fn};
use rayon::prelude::*;

/// Query rows per score tile.
const R: usize = 4;
/// Queries per task: a task's key blocks are gathered once for all its rows.
const QB: usize = 32;

/// Queries at rows `first_row..` of q, one per position of `positions` (ascending), over
/// the keys of `runs` (ascending, covering every position the queries see).
pub(crate) struct QueryGroup<'a> {
    pub(crate) first_row: usize,
    pub(crate) positions: &'a [u32],
    pub(crate) runs: &'a [KvRun<'a>],
}

/// Head counts, head size and sliding window of one attention layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Heads {
    pub(crate) heads: usize,
    pub(crate) kv: usize,
    pub(crate) hd: usize,
    pub(crate) window: Option<usize>,
}

impl Heads {
    /// The first key position a query at `p` sees.
    fn first_key(&self, p: usize) -> usize {
        self.window.map_or(0, |w| (p + 1).saturating_sub(w))
    }
}

/// Attention of scaled, rotated queries `q` (heads, nq, hd) in `groups` over their keys,
/// into `out` (nq, heads * hd), which starts zeroed.
pub(crate) fn attend(q: &[f32], nq: usize, groups: &[QueryGroup], dims: Heads, out: &mut [f32]) {
    let width = dims.heads * dims.hd;
    let keys: Vec<Keys> = groups
        .iter()
        .map(|g| match (g.positions.first(), g.positions.last()) {
            (Some(&a), Some(&z)) => (g.runs, (dims.first_key(a as usize), z as usize + 1)),
            _ => (g.runs, (0, 0)),
        })
        .collect();
    let blocks = Blocks::gather(&keys, dims.kv, dims.hd);
    // Tasks in row order, each with its group's index and its rows of `out`.
    let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
    let mut cost = 0;
    let (mut rest, mut at) = (out, 0);
    let mut order: Vec<usize> = (0..groups.len()).collect();
    order.sort_by_key(|&i| groups[i].first_row);
    for gi in order {
        let g = &groups[gi];
        for a in (0..g.positions.len()).step_by(QB) {
            let n = QB.min(g.positions.len() - a);
            let row = g.first_row + a;
            let (_, tail) = rest.split_at_mut((row - at) * width);
            let (mine, tail) = tail.split_at_mut(n * width);
            (rest, at) = (tail, row + n);
            let last = g.positions[a + n - 1] as usize;
            cost += n * (last + 1 - dims.first_key(g.positions[a] as usize)) * width;
            tasks.push((gi, a, mine));
        }
    }
    let run = |scratch: &mut Scratch, (gi, a, o): (usize, usize, &mut [f32])| {
        let block = Block {
            q,
            nq,
            dims,
            group: &groups[gi],
            blocks: (&blocks, gi),
            start: a,
            len: o.len() / width,
        };
        for kv in 0..dims.kv {
            block.head(kv, scratch, o);
        }
    };
    // One element of `cost` is two flops: a few hundred thousand per piece are worth a thread.
    if super::pieces(cost / 16) == 1 {
        let mut scratch = Scratch::new(dims);
        tasks.into_iter().for_each(|t| run(&mut scratch, t));
    } else {
        tasks
            .into_par_iter()
            .for_each_init(|| Scratch::new(dims), |s, t| run(s, t));
    }
}

/// A thread's working memory: a score tile, and each row's running max, sum and accumulator
/// (rows x hd, rows padded to a whole tile).
struct Scratch {
    s: [[f32; BK]; R],
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
}

impl Scratch {
    fn new(dims: Heads) -> Self {
        let rows = QB * (dims.heads / dims.kv.max(1));
        Self {
            s: [[0.0; BK]; R],
            m: vec![0.0; rows],
            l: vec![0.0; rows],
            acc: vec![0.0; rows.next_multiple_of(R) * dims.hd],
        }
    }
}

/// One task: queries `start..start + len` of `group`, for every head.
struct Block<'a> {
    q: &'a [f32],
    nq: usize,
    dims: Heads,
    group: &'a QueryGroup<'a>,
    /// The gathered key blocks, and this group's index in them.
    blocks: (&'a Blocks, usize),
    start: usize,
    len: usize,
}

impl Block<'_> {
    /// The block's position at its row `r` (query-major: `r / group`, head `r % group`).
    fn pos(&self, r: usize, group: usize) -> usize {
        self.group.positions[self.start + r / group] as usize
    }

    /// The heads of kv head `kv` for this block's queries, into `out` (the block's rows).
    fn head(&self, kv: usize, sc: &mut Scratch, out: &mut [f32]) {
        let d = self.dims;
        let (hd, group) = (d.hd, d.heads / d.kv);
        let rows = self.len * group;
        let width = d.heads * hd;
        // Row r: query r / group, head kv * group + r % group.
        let head = |r: usize| kv * group + r % group;
        let q_row = |r: usize| {
            let at = (head(r) * self.nq + self.group.first_row + self.start + r / group) * hd;
            &self.q[at..at + hd]
        };
        let o_at = |r: usize| (r / group) * width + head(r) * hd;
        sc.m[..rows].fill(f32::NEG_INFINITY);
        sc.l[..rows].fill(0.0);
        sc.acc[..rows.next_multiple_of(R) * hd].fill(0.0);
        // Blocks on the grid of positions the blocks were gathered on; keys before a row's
        // window are masked as any others.
        let k_lo = d.first_key(self.pos(0, group)) / BK * BK;
        let k_hi = self.pos(rows - 1, group) + 1;
        let (blocks, g) = self.blocks;
        for j0 in (k_lo..k_hi).step_by(BK) {
            let j1 = (j0 + BK).min(k_hi);
            let (kt, vb) = blocks.block(g, kv, j0 / BK);
            for t0 in (0..rows).step_by(R) {
                let tile: [usize; R] = std::array::from_fn(|i| (t0 + i).min(rows - 1));
                // Positions ascend with rows: past the tile's last query's key range, or
                // before the first one's window, the whole tile is masked.
                if j0 > self.pos(tile[R - 1], group) || j1 <= d.first_key(self.pos(t0, group)) {
                    continue;
                }
                let qs: [&[f32]; R] = std::array::from_fn(|i| q_row(tile[i]));
                scores(&qs, kt, &mut sc.s);
                // Each row's keys in this block; a padding row, or one that sees none of
                // them, gets an empty range and stays as it was.
                let keys: [(usize, usize); R] = std::array::from_fn(|i| {
                    let p = self.pos(tile[i], group);
                    let lo = d.first_key(p).max(j0) - j0;
                    let hi = (p + 1).min(j1).saturating_sub(j0);
                    if i < rows - t0 && lo < hi {
                        (lo, hi)
                    } else {
                        (0, 0)
                    }
                });
                let mut m: [f32; R] = std::array::from_fn(|i| sc.m[tile[i]]);
                let mut l: [f32; R] = std::array::from_fn(|i| sc.l[tile[i]]);
                let mut alpha = [1f32; R];
                softmax_tile(&mut sc.s, &keys, (&mut m, &mut l), &mut alpha);
                let (mut lo_all, mut hi_all) = (BK, 0);
                for (i, &(lo, hi)) in keys.iter().enumerate() {
                    if lo < hi {
                        (sc.m[t0 + i], sc.l[t0 + i]) = (m[i], l[i]);
                        (lo_all, hi_all) = (lo_all.min(lo), hi_all.max(hi));
                    }
                }
                let acc = &mut sc.acc[t0 * hd..(t0 + R) * hd];
                weigh_values(&sc.s, &alpha, (lo_all, hi_all), vb, acc);
            }
        }
        for r in 0..rows {
            let inv = 1.0 / sc.l[r];
            let acc = &sc.acc[r * hd..(r + 1) * hd];
            for (o, a) in out[o_at(r)..o_at(r) + hd].iter_mut().zip(acc) {
                *o = a * inv;
            }
        }
    }
}

simd_fn! {
    /// The score tile `s` = `q` (R rows of hd) times `kt` (hd x BK), `M::TILE` keys at a
    /// time: each query element broadcast against a row of keys, the R rows' sums held in
    /// registers.
    fn scores<M>(q: &[&[f32]; R], kt: &[f32], s: &mut [[f32; BK]; R]) {
        for t in (0..BK).step_by(M::TILE) {
            match M::TILE {
                64 => score_cols::<M, 64>(q, kt, t, s),
                16 => score_cols::<M, 16>(q, kt, t, s),
                _ => score_cols::<M, 8>(q, kt, t, s),
            }
        }
    }
}

/// Columns `t..t + W` of the score tile (W divides BK): R x W sums in registers across hd.
#[inline(always)]
fn score_cols<M: Mac, const W: usize>(
    q: &[&[f32]; R],
    kt: &[f32],
    t: usize,
    s: &mut [[f32; BK]; R],
) {
    let hd = kt.len() / BK;
    // Sliced to hd, so the loop below indexes them without checks.
    let q: [&[f32]; R] = std::array::from_fn(|r| &q[r][..hd]);
    let mut acc = [[0f32; W]; R];
    for d in 0..hd {
        let k = &kt[d * BK + t..d * BK + t + W];
        for r in 0..R {
            let qd = q[r][d];
            for j in 0..W {
                acc[r][j] = M::mac(qd, k[j], acc[r][j]);
            }
        }
    }
    for r in 0..R {
        s[r][t..t + W].copy_from_slice(&acc[r]);
    }
}

simd_fn! {
    /// The online-softmax step of a tile's rows over the block's keys: row i sees keys
    /// `keys[i]` (an empty range: none, and the row is left as it was). A row's scores become
    /// the weights e^(s - new max) (0 where masked), `alpha` the factor its accumulator is
    /// rescaled by, and its running max and sum (`state`) move.
    fn softmax_tile<M>(
        s: &mut [[f32; BK]; R],
        keys: &[(usize, usize); R],
        state: (&mut [f32; R], &mut [f32; R]),
        alpha: &mut [f32; R],
    ) {
        let (m, l) = state;
        let live = |i: usize| keys[i].0 < keys[i].1;
        // Every row's new max first, then the rows' rescaling factors as one short vector of
        // exponentials rather than R scalar ones, each a long dependent chain.
        let mut m_new = *m;
        for i in 0..R {
            let (lo, hi) = keys[i];
            if lo >= hi {
                s[i] = [0.0; BK];
                continue;
            }
            if lo > 0 || hi < BK {
                // Only the blocks at a row's diagonal or window edge are cut.
                s[i][..lo].fill(f32::NEG_INFINITY);
                s[i][hi..].fill(f32::NEG_INFINITY);
            }
            m_new[i] = row_max::<M>(&s[i], m[i]);
        }
        for i in 0..R {
            // exp(-inf) is 0: a row's first block scales its zero accumulator by 0. A row
            // left as it was keeps its accumulator (its max may still be -inf, and
            // -inf - -inf is NaN).
            let a = exp::<M>(m[i] - m_new[i]);
            alpha[i] = if live(i) { a } else { 1.0 };
        }
        for i in 0..R {
            if live(i) {
                l[i] = l[i] * alpha[i] + weights::<M>(&mut s[i], m_new[i]);
                m[i] = m_new[i];
            }
        }
    }
}

/// A row's scores `s` (masked ones -inf) become its weights e^(s - m); returns their sum.
/// Fixed-width loops, so the exponentials run a vector at a time.
#[inline(always)]
fn weights<M: Mac>(s: &mut [f32; BK], m: f32) -> f32 {
    for c in s.chunks_exact_mut(16) {
        // Loops, not `array::from_fn`: a closure does not inherit the copy's target
        // features, and where it is not inlined (unoptimised callers, many codegen units)
        // its multiply-adds become libm calls.
        let mut e = [0f32; 16];
        for i in 0..16 {
            e[i] = exp::<M>(c[i] - m);
        }
        c.copy_from_slice(&e);
    }
    weight_sum::<M>(s)
}

/// The sum of a row's weights: 16 lanes, each summing its column of the row's 16-wide chunks
/// in order, then halved, so it is four vector additions, not sixteen dependent scalar ones.
/// On AVX-512 it is written out in intrinsics (the same additions in the same order): LLVM
/// otherwise spreads the lanes across the tile's unrolled rows and adds them one at a time.
#[inline(always)]
fn weight_sum<M: Mac>(s: &[f32; BK]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if M::TILE == 64 {
        // SAFETY: a tile of 64 lanes is the AVX-512 copy's (`simd_fn!`), which runs only on a
        // CPU with AVX-512F.
        return unsafe { weight_sum_avx512(s) };
    }
    let mut sum = [0f32; 16];
    for c in s.chunks_exact(16) {
        for i in 0..16 {
            sum[i] += c[i];
        }
    }
    let mut half = [0f32; 8];
    for i in 0..8 {
        half[i] = sum[i] + sum[i + 8];
    }
    let mut quarter = [0f32; 4];
    for i in 0..4 {
        quarter[i] = half[i] + half[i + 4];
    }
    (quarter[0] + quarter[2]) + (quarter[1] + quarter[3])
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn weight_sum_avx512(s: &[f32; BK]) -> f32 {
    use std::arch::x86_64::*;
    let at = |k: usize| {
        // SAFETY: 16 lanes from `k`, and `k` + 16 <= BK.
        unsafe { _mm512_loadu_ps(s[k..k + 16].as_ptr()) }
    };
    // 0 + the first chunk, as the generic loop adds it (0 + x is x for the weights' x >= 0).
    let mut sum = at(0);
    for k in (16..BK).step_by(16) {
        sum = _mm512_add_ps(sum, at(k));
    }
    // Lanes i and i + 8, then i and i + 4: the generic loop's halving.
    let lo = _mm512_castps512_ps256(sum);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(sum)));
    let half = _mm256_add_ps(lo, hi);
    let quarter = _mm_add_ps(
        _mm256_castps256_ps128(half),
        _mm256_extractf128_ps::<1>(half),
    );
    // (q0 + q2) and (q1 + q3), then their sum.
    let pairs = _mm_add_ps(quarter, _mm_movehl_ps(quarter, quarter));
    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)))
}

simd_fn! {
    /// `acc` (R rows of hd) = `acc` * `alpha` + `p` (R x BK weights) times the block's values
    /// `vb` (BK x hd) at keys `lo..hi`, `M::TILE` output lanes of all R rows at a time (then 8,
    /// then one), held in registers across the keys; each value vector loaded serves R rows.
    fn weigh_values<M>(
        p: &[[f32; BK]; R],
        alpha: &[f32; R],
        keys: (usize, usize),
        vb: &[f32],
        acc: &mut [f32],
    ) {
        let hd = acc.len() / R;
        let mut c = 0;
        while c + M::TILE <= hd {
            match M::TILE {
                64 => weigh_cols::<M, 64>(p, alpha, keys, vb, acc, c),
                16 => weigh_cols::<M, 16>(p, alpha, keys, vb, acc, c),
                _ => weigh_cols::<M, 8>(p, alpha, keys, vb, acc, c),
            }
            c += M::TILE;
        }
        while c + 8 <= hd {
            weigh_cols::<M, 8>(p, alpha, keys, vb, acc, c);
            c += 8;
        }
        let (lo, hi) = keys;
        for r in 0..R {
            for d in c..hd {
                let mut x = acc[r * hd + d] * alpha[r];
                for j in lo..hi {
                    x = M::mac(p[r][j], vb[j * hd + d], x);
                }
                acc[r * hd + d] = x;
            }
        }
    }
}

/// The largest of `s` and `m`. A comparison, not `f32::max`, whose NaN rule keeps loops
/// scalar: a NaN score is passed over here, as `max` did, and reaches the output through its
/// weight. On AVX-512 it is written out in intrinsics: LLVM vectorizes the loop below across
/// the tile's unrolled rows instead of along a row, in quarter-width pieces.
#[inline(always)]
fn row_max<M: Mac>(s: &[f32; BK], m: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if M::TILE == 64 {
        // SAFETY: a tile of 64 lanes is the AVX-512 copy's (`simd_fn!`), which runs only on a
        // CPU with AVX-512F.
        return unsafe { row_max_avx512(s, m) };
    }
    let mut top = f32::NEG_INFINITY;
    for &x in s {
        top = if x > top { x } else { top };
    }
    if top > m { top } else { m }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
fn row_max_avx512(s: &[f32; BK], m: f32) -> f32 {
    use std::arch::x86_64::{_mm512_loadu_ps, _mm512_max_ps, _mm512_reduce_max_ps};
    let at = |k: usize| {
        // SAFETY: 16 lanes from `k`, and `k` + 16 <= BK.
        unsafe { _mm512_loadu_ps(s[k..k + 16].as_ptr()) }
    };
    let mut t = at(0);
    for k in (16..BK).step_by(16) {
        // A lane's NaN is the first operand's, so it is passed over (as above).
        t = _mm512_max_ps(at(k), t);
    }
    let top = _mm512_reduce_max_ps(t);
    if top > m { top } else { m }
}

/// Output lanes `c..c + W` of `weigh_values`: R x W sums in registers across the keys.
#[inline(always)]
fn weigh_cols<M: Mac, const W: usize>(
    p: &[[f32; BK]; R],
    alpha: &[f32; R],
    (lo, hi): (usize, usize),
    vb: &[f32],
    acc: &mut [f32],
    c: usize,
) {
    let hd = acc.len() / R;
    let hi = hi.min(BK);
    let mut a = [[0f32; W]; R];
    for r in 0..R {
        // Sliced to W first, so the loop is whole vectors with no bounds checks.
        let row = &acc[r * hd + c..r * hd + c + W];
        for i in 0..W {
            a[r][i] = row[i] * alpha[r];
        }
    }
    for j in lo..hi {
        let v = &vb[j * hd + c..j * hd + c + W];
        for r in 0..R {
            let w = p[r][j];
            for i in 0..W {
                a[r][i] = M::mac(w, v[i], a[r][i]);
            }
        }
    }
    for r in 0..R {
        acc[r * hd + c..r * hd + c + W].copy_from_slice(&a[r]);
    }
}
