//! The CPU GEMM path of a quantized matmul whose block type candle has no SIMD dot product for
//! (Q4_1, Q5_0, Q5_1): the activations rounded through the block type llama.cpp's dot product
//! takes them in (Q8_1 or Q8_0) and the weights dequantized, both threaded over rows and
//! exactly candle's values (the weights through candle's own block code, the activations
//! through a vectorized copy of it), then one f32 GEMM. Candle's `QTensor::quantize` and
//! `dequantize` run the same code on one thread, with a copy each.

use super::simd::simd_fn;
use super::{f32s, for_rows};
use candle_core::quantized::k_quants::{BlockQ4_1, BlockQ5_0, BlockQ5_1, GgmlType};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{CpuStorage, CustomOp1, Device, Layout, Result, Shape, Tensor};
use half::f16;

/// `x` (.., K) times the transposed quantized `table` (N, K), as a GEMM on the values the
/// quantized dot products multiply; `None` for block types this path does not cover.
pub(crate) fn quantized_gemm(x: &Tensor, table: &QTensor) -> Result<Option<Tensor>> {
    Ok(Some(match table.dtype() {
        GgmlDType::Q4_1 => gemm::<BlockQ4_1>(x, table)?,
        GgmlDType::Q5_0 => gemm::<BlockQ5_0>(x, table)?,
        GgmlDType::Q5_1 => gemm::<BlockQ5_1>(x, table)?,
        _ => return Ok(None),
    }))
}

fn gemm<W: GgmlType>(x: &Tensor, table: &QTensor) -> Result<Tensor> {
    let (n, k) = table.shape().dims2()?;
    // Every type this path covers takes its activations in 8-bit blocks of 32.
    debug_assert_eq!(<W::VecDotType as GgmlType>::BLCK_SIZE, QK8);
    let xq = x.contiguous()?.apply_op1_no_bwd(&RoundTrip)?;
    let w = Tensor::from_vec(dequantize::<W>(table, n, k)?, (n, k), &Device::Cpu)?;
    let mut dims = x.dims().to_vec();
    let rows = x.elem_count() / k.max(1);
    *dims.last_mut().expect("rank >= 1") = n;
    xq.reshape((rows, k))?.matmul(&w.t()?)?.reshape(dims)
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

/// `table` (n rows of k) as f32, rows split over candle's threads.
fn dequantize<W: GgmlType>(table: &QTensor, n: usize, k: usize) -> Result<Vec<f32>> {
    let data = table.data()?;
    let all = blocks::<W>(&data)?;
    let per_row = k / W::BLCK_SIZE;
    if !k.is_multiple_of(W::BLCK_SIZE) || all.len() != n * per_row {
        candle_core::bail!("quantized table: {} blocks for ({n}, {k})", all.len())
    }
    let mut out = vec![0f32; n * k];
    for_rows(&mut out, n, k, 2, |r0, dst| {
        let src = &all[r0 * per_row..][..dst.len() / W::BLCK_SIZE];
        W::to_float(src, dst);
    });
    Ok(out)
}

/// Activations rounded to 8-bit blocks and back: the values a Q8_0 or Q8_1 block holds
/// (both round alike; Q8_1's extra block sum is not a value).
struct RoundTrip;

/// Elements per 8-bit activation block (Q8_0 and Q8_1 alike).
const QK8: usize = 32;

impl CustomOp1 for RoundTrip {
    fn name(&self) -> &'static str {
        "q8-round-trip"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let src = f32s(s, l, "activations")?;
        let k = l.dims().last().copied().unwrap_or(0);
        if k == 0 || !k.is_multiple_of(QK8) {
            candle_core::bail!("activations: width {k} is not whole blocks of {QK8}")
        }
        let rows = src.len() / k;
        let mut out = vec![0f32; src.len()];
        for_rows(&mut out, rows, k, 2, |r0, dst| {
            round_trip(&src[r0 * k..][..dst.len()], dst);
        });
        Ok((CpuStorage::F32(out), l.shape().clone()))
    }
}

simd_fn! {
    /// Each block of 32 in `src` as candle's (and llama.cpp's) 8-bit quantization stores it,
    /// read back into `dst`: scale d = max |x| / 127 (kept in f16), q = round(x / d), then
    /// q * d. The same operations in the same order, so the values are candle's to the bit;
    /// `f32::round` (half away from zero) vectorizes here, where candle calls libm per element.
    fn round_trip<M>(src: &[f32], dst: &mut [f32]) {
        for (x, y) in src.chunks_exact(QK8).zip(dst.chunks_exact_mut(QK8)) {
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
            for i in 0..QK8 {
                // An i8 holds what `as i8` saturates to.
                y[i] = (x[i] * id).round().clamp(-128.0, 127.0) * scale;
            }
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

    #[test]
    fn rounding_and_dequantizing_equal_candles_own_to_the_bit() {
        let dev = Device::Cpu;
        // Enough rows that both are split over threads where there are several.
        let (n, k, rows) = (96, 256, 80);
        let w = Tensor::from_vec(data(n * k, 7), (n, k), &dev).unwrap();
        let x = Tensor::from_vec(data(rows * k, 11), (rows, k), &dev).unwrap();
        for (dtype, act) in [
            (GgmlDType::Q4_1, GgmlDType::Q8_1),
            (GgmlDType::Q5_0, GgmlDType::Q8_0),
            (GgmlDType::Q5_1, GgmlDType::Q8_1),
        ] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let xq = QTensor::quantize(&x, act)
                .unwrap()
                .dequantize(&dev)
                .unwrap();
            let wd = q.dequantize(&dev).unwrap();
            let want = xq.matmul(&wd.t().unwrap()).unwrap();
            let got = quantized_gemm(&x, &q).unwrap().expect("a covered type");
            let bits = |t: &Tensor| -> Vec<u32> {
                let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                v.iter().map(|f| f.to_bits()).collect()
            };
            assert_eq!(bits(&got), bits(&want), "{dtype:?}");
        }
    }

    #[test]
    fn other_block_types_are_left_to_candle() {
        let w = Tensor::from_vec(data(32 * 64, 3), (32, 64), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let x = Tensor::from_vec(values(64, 5, 1.0), (1, 64), &Device::Cpu).unwrap();
        assert!(quantized_gemm(&x, &q).unwrap().is_none());
    }

    #[test]
    fn a_width_that_is_not_whole_blocks_is_refused_by_name() {
        let w = Tensor::from_vec(data(32 * 64, 3), (32, 64), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        let x = Tensor::from_vec(data(2 * 48, 5), (2, 48), &Device::Cpu).unwrap();
        let err = quantized_gemm(&x, &q).unwrap_err().to_string();
        assert!(err.contains("activations: width 48"), "{err}");
    }
}
