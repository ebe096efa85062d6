//! The CPU matmul of a GGUF's 32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) in
//! llama.cpp's arithmetic, the same for a row whatever else is in its batch: the activations
//! rounded through the 8-bit block type llama.cpp's dot product takes them in (Q8_0, or Q8_1
//! with its block sum in f16), the weights dequantized (exactly the values the blocks hold),
//! then one f32 GEMM over the whole dequantized matrix, plus the Q8_1 sum's rounding as a
//! small second product.
//!
//! One GEMM at every row count, because the 8-bit rounding of the next layer's activations
//! turns any difference in a sum's last bit into a whole quantum now and then: a few-row path
//! summing in another order (candle's dot products, or a GEMV of our own) moved a trace's
//! scores by up to 2e-2 with its batch and the prefix cache. Candle's own dot products are
//! also not llama.cpp's: its Q8_1 sum is rounded twice, and its Q8_0 path rounds activations
//! in blocks of 256.

use super::simd::simd_fn;
use super::{f32s, for_rows};
use candle_core::quantized::k_quants::{
    BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0, GgmlType,
};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Result, Storage, Tensor};
use half::f16;
use rayon::prelude::*;
use std::borrow::Cow;

/// Elements per 8-bit activation block (Q8_0 and Q8_1 alike), and per weight block of every
/// type this path covers.
const QK8: usize = 32;

/// The block types `quantized_matmul` covers.
#[cfg(test)]
pub(crate) const COVERED: [GgmlDType; 5] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
];

/// `x` (.., K) times the transposed quantized `table` (N, K) in llama.cpp's arithmetic; `None`
/// for block types this path does not cover (the K-quants, whose dot products candle runs the
/// same way for every row).
/// `once`: the table as `dequantize_once` gave it, which this then reads instead of
/// dequantizing the weights again (the same values, so the same bits).
#[cfg(test)]
fn quantized_matmul(
    x: &Tensor,
    table: &QTensor,
    once: Option<&Dequantized>,
) -> Result<Option<Tensor>> {
    if !covers(table.dtype()) {
        return Ok(None);
    }
    let r = Rounded::new(x, table.shape().dims2()?.1)?;
    rounded_matmul(&r, table, once, 0).map(Some)
}

/// Whether `quantized_matmul` runs tables of `dtype` itself.
pub(crate) fn covers(dtype: GgmlDType) -> bool {
    use GgmlDType::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
    matches!(dtype, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0)
}

/// Activations (.., K) as their 8-bit blocks hold them, and the Q8_1 sums' remainder per
/// block (`round_trip_rows`): the same for every table they are multiplied by (Q8_0 and Q8_1
/// round alike), so q, k and v, or gate and up, round their shared input once.
pub(crate) struct Rounded {
    xq: Vec<f32>,
    sums: Vec<f32>,
    dims: Vec<usize>,
}

impl Rounded {
    /// `x`'s rows rounded, after checking they are `k` wide.
    pub(crate) fn new(x: &Tensor, k: usize) -> Result<Self> {
        let width = x.dim(candle_core::D::Minus1)?;
        if width != k {
            candle_core::bail!("activations: width {width} is not the matrix's {k}")
        }
        let x = x.contiguous()?;
        let (storage, layout) = x.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else {
            candle_core::bail!("quantized matmul: activations not on the CPU")
        };
        let (xq, sums) = round_trip_rows(f32s(cpu, layout, "activations")?, k)?;
        Ok(Self {
            xq,
            sums,
            dims: x.dims().to_vec(),
        })
    }

    fn width(&self) -> usize {
        *self.dims.last().expect("rank >= 1")
    }
}

/// The rounded activations `r` times the transposed `table`, a type `covers` names, computed
/// on at least `least` rows (zero rows pad a short input and are dropped after: what a row's
/// sums are then does not depend on how many rows share the call; see `layers::min_rows`).
pub(crate) fn rounded_matmul(
    r: &Rounded,
    table: &QTensor,
    once: Option<&Dequantized>,
    least: usize,
) -> Result<Tensor> {
    match table.dtype() {
        GgmlDType::Q4_0 => matmul::<BlockQ4_0>(r, table, false, once, least),
        GgmlDType::Q4_1 => matmul::<BlockQ4_1>(r, table, true, once, least),
        GgmlDType::Q5_0 => matmul::<BlockQ5_0>(r, table, false, once, least),
        GgmlDType::Q5_1 => matmul::<BlockQ5_1>(r, table, true, once, least),
        GgmlDType::Q8_0 => matmul::<BlockQ8_0>(r, table, false, once, least),
        other => candle_core::bail!("quantized matmul: {other:?} is not a type it covers"),
    }
}

/// A table's weights as f32 and its block minimums (n, k / 32) where the type stores them:
/// what `quantized_matmul` builds on every call, built once. The weights are kept transposed,
/// (k, n) row-major, as a full-precision layer keeps its own: gemm then reads them as they are
/// instead of packing them again on every call, for the same sums.
#[derive(Debug)]
pub(crate) struct Dequantized {
    w_t: Vec<f32>,
    mins: Option<Vec<f32>>,
}

impl Dequantized {
    /// Bytes it holds.
    pub(crate) fn bytes(&self) -> usize {
        4 * (self.w_t.len() + self.mins.as_ref().map_or(0, Vec::len))
    }
}

/// `table` dequantized, for the block types `quantized_matmul` runs itself (None for others).
pub(crate) fn dequantize_once(table: &QTensor) -> Result<Option<Dequantized>> {
    let (w, mins) = match table.dtype() {
        GgmlDType::Q4_0 => weights::<BlockQ4_0>(table, false)?,
        GgmlDType::Q4_1 => weights::<BlockQ4_1>(table, true)?,
        GgmlDType::Q5_0 => weights::<BlockQ5_0>(table, false)?,
        GgmlDType::Q5_1 => weights::<BlockQ5_1>(table, true)?,
        GgmlDType::Q8_0 => weights::<BlockQ8_0>(table, false)?,
        _ => return Ok(None),
    };
    let (n, k) = table.shape().dims2()?;
    let mut w_t = vec![0f32; n * k];
    for (j, row) in w.chunks_exact(k.max(1)).enumerate() {
        for (i, &v) in row.iter().enumerate() {
            w_t[i * n + j] = v;
        }
    }
    Ok(Some(Dequantized { w_t, mins }))
}

/// The weights of a CPU `table` of `W` blocks as f32 (n, k) row-major, and its minimums
/// (n, k / 32) with `with_min`.
fn weights<W: GgmlType>(table: &QTensor, with_min: bool) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
    let (n, k) = table.shape().dims2()?;
    let data = table.data()?;
    let all = blocks::<W>(&data)?;
    if !k.is_multiple_of(QK8) || all.len() != n * (k / QK8) {
        candle_core::bail!("quantized table: {} blocks for ({n}, {k})", all.len())
    }
    let mins = with_min.then(|| block_mins::<W>(&data));
    Ok((dequantize(all, n, k), mins))
}

/// `with_min`: the block type stores a minimum `m` beside its scale, so its dot product takes
/// the activations as Q8_1 and adds `m` times the activation block's sum, kept in f16.
fn matmul<W: GgmlType>(
    r: &Rounded,
    table: &QTensor,
    with_min: bool,
    once: Option<&Dequantized>,
    least: usize,
) -> Result<Tensor> {
    let (n, k) = table.shape().dims2()?;
    debug_assert_eq!(W::BLCK_SIZE, QK8);
    if r.width() != k {
        candle_core::bail!("activations: width {} is not the matrix's {k}", r.width())
    }
    let nb = k / QK8;
    let rows = r.xq.len() / k.max(1);
    let m = rows.max(least);
    let (xq, sums) = (padded(&r.xq, m * k), padded(&r.sums, m * nb));
    let fresh;
    let (w, mins) = match once {
        Some(d) => (Rhs::rows_of(&d.w_t, n), d.mins.as_deref()),
        None => {
            fresh = weights::<W>(table, with_min)?;
            (Rhs::columns_of(&fresh.0, k), fresh.1.as_deref())
        }
    };
    let mut y = vec![0f32; m * n];
    gemm_into(&mut y, &xq, (m, k, n), w, false)?;
    if let Some(mins) = mins {
        // The minimums' small product is summed into `y` where it lies: a product of its own
        // and then a sum wrote and read three more matrices of y's size, for the same bits.
        gemm_into(&mut y, &sums, (m, nb, n), Rhs::columns_of(mins, nb), true)?;
    }
    y.truncate(rows * n);
    let mut dims = r.dims.clone();
    *dims.last_mut().expect("rank >= 1") = n;
    Tensor::from_vec(y, dims, &Device::Cpu)
}

/// `v` followed by zeros up to `len` (borrowed when it is that long already).
fn padded(v: &[f32], len: usize) -> Cow<'_, [f32]> {
    if v.len() >= len {
        return Cow::Borrowed(v);
    }
    let mut p = Vec::with_capacity(len);
    p.extend_from_slice(v);
    p.resize(len, 0.0);
    Cow::Owned(p)
}

/// A weight matrix (k, n) as gemm reads it: `data` with the stride between its rows and
/// between its columns.
#[derive(Clone, Copy)]
struct Rhs<'a> {
    data: &'a [f32],
    rs: usize,
    cs: usize,
}

impl<'a> Rhs<'a> {
    /// `data` holds (k, n) row-major.
    fn rows_of(data: &'a [f32], n: usize) -> Self {
        Self { data, rs: n, cs: 1 }
    }

    /// `data` holds (n, k) row-major: the matrix read transposed.
    fn columns_of(data: &'a [f32], k: usize) -> Self {
        Self { data, rs: 1, cs: k }
    }
}

/// `dst` (m, n) = `lhs` (m, k) times `rhs`, or `dst +=` that with `add`, all row-major but
/// `rhs`. gemm is called as candle's matmul calls it (the same strides, thread count and
/// kernels), so the product has candle's bits, and an added one the bits of candle's sum of
/// the two products: gemm adds a result to what `dst` holds in one rounding, as that sum does.
fn gemm_into(
    dst: &mut [f32],
    lhs: &[f32],
    (m, k, n): (usize, usize, usize),
    rhs: Rhs<'_>,
    add: bool,
) -> Result<()> {
    let last = k.saturating_sub(1) * rhs.rs + n.saturating_sub(1) * rhs.cs;
    if dst.len() != m * n || lhs.len() != m * k || (k * n > 0 && rhs.data.len() <= last) {
        candle_core::bail!("quantized matmul: operands do not match ({m}, {k}, {n})")
    }
    if m * n == 0 {
        return Ok(());
    }
    let threads = super::threads();
    let parallelism = match threads {
        1 => gemm::Parallelism::None,
        t => gemm::Parallelism::Rayon(t),
    };
    // SAFETY: the lengths were checked above against every index gemm reads or writes: `dst`
    // and `lhs` row-major (m, n) and (m, k), `rhs` up to (k - 1) * rs + (n - 1) * cs; `dst`
    // is borrowed mutably, so nothing else reads it while gemm writes.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            add,
            lhs.as_ptr(),
            1,
            k as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            if add { 1.0 } else { 0.0 },
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
    Ok(())
}

/// The blocks of a CPU `table` of `W` blocks, read in place.
fn blocks<W: GgmlType>(bytes: &[u8]) -> Result<&[W]> {
    let size = std::mem::size_of::<W>();
    if !bytes.len().is_multiple_of(size) || !bytes.as_ptr().cast::<W>().is_aligned() {
        candle_core::bail!(
            "quantized table: {} bytes not whole aligned blocks",
            bytes.len()
        )
    }
    // SAFETY: the bytes are a CPU QTensor's storage of `W` blocks (its dtype was matched to
    // `W`), checked above to be whole blocks at `W`'s alignment; every block type is
    // `repr(C)` plain data (f16 and byte arrays), valid for any bit pattern; the slice
    // borrows `bytes`, so it cannot outlive them.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<W>(), bytes.len() / size) })
}

/// Each block's minimum `m`, for the block types that store one (Q4_1, Q5_1: `repr(C)`
/// `{ d: f16, m: f16, .. }`, as llama.cpp lays them out; candle keeps the field private).
fn block_mins<W: GgmlType>(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(std::mem::size_of::<W>())
        .map(|b| f16::from_le_bytes([b[2], b[3]]).to_f32())
        .collect()
}

/// `all` (n rows of k) as f32, rows split over candle's threads.
fn dequantize<W: GgmlType>(all: &[W], n: usize, k: usize) -> Vec<f32> {
    let per_row = k / QK8;
    let mut out = vec![0f32; n * k];
    for_rows(&mut out, n, k, 2, |r0, dst| {
        W::to_float(&all[r0 * per_row..][..dst.len() / QK8], dst);
    });
    out
}

/// The activations `src` (rows of `k`) as their 8-bit blocks hold them, and per block what
/// Q8_1's f16 sum adds beyond the sum of those values (see `round_trip`), rows split over
/// candle's threads.
fn round_trip_rows(src: &[f32], k: usize) -> Result<(Vec<f32>, Vec<f32>)> {
    if k == 0 || !k.is_multiple_of(QK8) {
        candle_core::bail!("activations: width {k} is not whole blocks of {QK8}")
    }
    let (rows, nb) = (src.len() / k, k / QK8);
    let mut xq = vec![0f32; src.len()];
    let mut sums = vec![0f32; rows * nb];
    let per = rows.div_ceil(super::pieces(rows * k * 2));
    xq.par_chunks_mut(per * k)
        .zip(sums.par_chunks_mut(per * nb))
        .enumerate()
        .for_each(|(i, (dst, s))| round_trip(&src[i * per * k..][..dst.len()], dst, s));
    Ok((xq, sums))
}

simd_fn! {
    /// Each block of 32 in `src` as candle's (and llama.cpp's reference) 8-bit quantization
    /// stores it, read back into `dst`: scale d = max |x| / 127 (kept in f16), q = round(x /
    /// d), then q * d; the same operations in the same order, so the values are candle's to the
    /// bit (`f32::round`, half away from zero, vectorizes here, where candle calls libm per
    /// element). `sums` gets, per block, llama.cpp's Q8_1 sum `f16(d * sum q)` less the sum of
    /// the values written (`f16(d) * sum q`, exact in f32): the GEMM adds it back times `m`.
    fn round_trip<M>(src: &[f32], dst: &mut [f32], sums: &mut [f32]) {
        let blocks = src.chunks_exact(QK8).zip(dst.chunks_exact_mut(QK8));
        for ((x, y), s) in blocks.zip(sums.iter_mut()) {
            let mut top = [0f32; 16];
            for c in x.chunks_exact(16) {
                for i in 0..16 {
                    top[i] = top[i].max(c[i].abs());
                }
            }
            let amax = top.iter().fold(0f32, |a, &b| a.max(b));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let scale = f16::from_f32(d).to_f32();
            let mut q = [0f32; QK8];
            for i in 0..QK8 {
                // An i8 holds what `as i8` saturates to.
                // `+ 0.0`: an i8 has no -0, so what rounds to -0 is stored as 0.
                q[i] = (x[i] * id).round().clamp(-128.0, 127.0) + 0.0;
                y[i] = q[i] * scale;
            }
            let sum = q.iter().sum::<f32>();
            *s = f16::from_f32(sum * d).to_f32() - sum * scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testing::values;

    /// Values in [-1, 1) with every third block of 32 shifted, so block minimums differ, one
    /// all-zero block (a zero scale), and one whose scale is 1, so its halves round exactly
    /// half-way (away from zero, as C's `roundf`).
    fn data(n: usize, seed: u64) -> Vec<f32> {
        let mut v = values(n, seed, 1.0);
        for (i, x) in v.iter_mut().enumerate() {
            *x += ((i / 32) % 3) as f32 * 0.5;
        }
        v[32..64].fill(0.0);
        let halves = [
            127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 126.5, -126.5, -127.0,
        ];
        v[64..96].fill(0.25);
        v[64..64 + halves.len()].copy_from_slice(&halves);
        v
    }

    /// A table's block minimums, for the types that store them.
    fn mins_of(q: &QTensor) -> Option<Vec<f32>> {
        match q.dtype() {
            GgmlDType::Q4_1 => Some(block_mins::<BlockQ4_1>(&q.data().unwrap())),
            GgmlDType::Q5_1 => Some(block_mins::<BlockQ5_1>(&q.data().unwrap())),
            _ => None,
        }
    }

    /// Where two vectors first differ in their bits, if they do (and are of equal lengths).
    fn first_difference(got: &[f32], want: &[f32]) -> Option<(usize, f32, f32)> {
        assert_eq!(got.len(), want.len());
        let at = got
            .iter()
            .zip(want)
            .position(|(a, b)| a.to_bits() != b.to_bits())?;
        Some((at, got[at], want[at]))
    }

    #[test]
    fn rounding_and_dequantizing_equal_candles_own_to_the_bit() {
        let dev = Device::Cpu;
        // Enough rows that both are split over threads where there are several.
        let (n, k, rows) = (96, 256, 80);
        let w = Tensor::from_vec(data(n * k, 7), (n, k), &dev).unwrap();
        let x = data(rows * k, 11);
        let (xq, _) = round_trip_rows(&x, k).unwrap();
        let xt = Tensor::from_vec(x, (rows, k), &dev).unwrap();
        for act in [GgmlDType::Q8_0, GgmlDType::Q8_1] {
            let want = QTensor::quantize(&xt, act)
                .unwrap()
                .dequantize(&dev)
                .unwrap();
            let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            assert_eq!(first_difference(&xq, &want), None, "{act:?}");
        }
        for dtype in COVERED {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let want = q.dequantize(&dev).unwrap().flatten_all().unwrap();
            let data = q.data().unwrap();
            let got = match dtype {
                GgmlDType::Q4_0 => dequantize(blocks::<BlockQ4_0>(&data).unwrap(), n, k),
                GgmlDType::Q4_1 => dequantize(blocks::<BlockQ4_1>(&data).unwrap(), n, k),
                GgmlDType::Q5_0 => dequantize(blocks::<BlockQ5_0>(&data).unwrap(), n, k),
                GgmlDType::Q5_1 => dequantize(blocks::<BlockQ5_1>(&data).unwrap(), n, k),
                _ => dequantize(blocks::<BlockQ8_0>(&data).unwrap(), n, k),
            };
            assert_eq!(
                first_difference(&got, &want.to_vec1().unwrap()),
                None,
                "{dtype:?}"
            );
        }
    }

    #[test]
    fn the_block_minimums_are_read_where_the_blocks_hold_them() {
        // The element at a block's minimum quantizes to 0, so each block's smallest dequantized
        // value is its `m`.
        let dev = Device::Cpu;
        let w = Tensor::from_vec(data(16 * 64, 7), (16, 64), &dev).unwrap();
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q5_1] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let wd = q.dequantize(&dev).unwrap().flatten_all().unwrap();
            let wd = wd.to_vec1::<f32>().unwrap();
            let want: Vec<f32> = wd
                .chunks_exact(QK8)
                .map(|b| b.iter().copied().fold(f32::MAX, f32::min))
                .collect();
            let got = mins_of(&q).expect("a type with minimums");
            assert_eq!(first_difference(&got, &want), None, "{dtype:?}");
        }
    }

    #[test]
    fn the_product_has_the_bits_of_candles_two_products_and_their_sum() {
        // What this path computed with candle's ops before it called gemm itself: the rounded
        // activations times the dequantized weights, plus the Q8_1 sums times the minimums.
        let dev = Device::Cpu;
        let (n, k) = (40, 256);
        let w = Tensor::from_vec(data(n * k, 7), (n, k), &dev).unwrap();
        for dtype in COVERED {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let once = dequantize_once(&q).unwrap().unwrap();
            let wd = q.dequantize(&dev).unwrap();
            let mins = mins_of(&q);
            // The weights as the path reads them each call (a transposed view) and once (a
            // transposed copy): gemm reads the two in other orders for a single row.
            let views = [wd.t().unwrap(), wd.t().unwrap().contiguous().unwrap()];
            for rows in [1, 65, 300] {
                let x = data(rows * k, 11 + rows as u64);
                let (xq, sums) = round_trip_rows(&x, k).unwrap();
                let xq = Tensor::from_vec(xq, (rows, k), &dev).unwrap();
                let xt = Tensor::from_vec(x, (rows, k), &dev).unwrap();
                for (o, w) in [None, Some(&once)].into_iter().zip(&views) {
                    let mut want = xq.matmul(w).unwrap();
                    if let Some(m) = &mins {
                        let m = Tensor::from_vec(m.clone(), (n, k / QK8), &dev).unwrap();
                        let s = Tensor::from_vec(sums.clone(), (rows, k / QK8), &dev).unwrap();
                        want = (want + s.matmul(&m.t().unwrap()).unwrap()).unwrap();
                    }
                    let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    let got = quantized_matmul(&xt, &q, o).unwrap().unwrap();
                    let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    let what = (dtype, rows, o.is_some());
                    assert_eq!(first_difference(&got, &want), None, "{what:?}");
                }
            }
        }
    }

    #[test]
    fn the_k_quants_are_left_to_candle() {
        let w = Tensor::from_vec(data(32 * 256, 3), (32, 256), &Device::Cpu).unwrap();
        let x = Tensor::from_vec(values(256, 5, 1.0), (1, 256), &Device::Cpu).unwrap();
        for dtype in [GgmlDType::Q4K, GgmlDType::Q6K] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            assert!(
                quantized_matmul(&x, &q, None).unwrap().is_none(),
                "{dtype:?}"
            );
        }
    }

    #[test]
    fn a_width_that_is_not_whole_blocks_is_refused_by_name() {
        let w = Tensor::from_vec(data(32 * 64, 3), (32, 64), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        let x = Tensor::from_vec(data(2 * 48, 5), (2, 48), &Device::Cpu).unwrap();
        let err = quantized_matmul(&x, &q, None).unwrap_err().to_string();
        assert!(err.contains("activations: width 48"), "{err}");
    }
}
