//! Fused CPU kernels for the decoder's f32 hot path, and the switch between them and candle's
//! own ops: residual add + RMS norm in one pass (`norm`), SiLU(gate) * up (`silu`), RoPE with
//! the heads-first transpose (`rope`), and blocked attention with an online softmax
//! (`attention`, over key blocks `gather` transposes; `causal`: that kernel over one
//! sequence, alone), and the quantized matmul's
//! GEMM path (`quant`), each threaded over rows on candle's thread count (rayon's pool).
//!
//! Every kernel runs only on the CPU in f32 and falls back to candle's unfused ops for any
//! other dtype or device, so the CUDA and bf16 paths are what they were. The inner loops are
//! compiled three times (AVX-512, AVX2 + FMA, baseline) and chosen at run time (`simd`):
//! the crate is built for baseline x86-64, where they would otherwise use 4-wide SSE2.

mod attention;
mod causal;
mod exp;
mod gather;
mod norm;
mod quant;
mod rope;
mod silu;
mod simd;

pub use simd::cap_simd;

pub(crate) use attention::{Heads, QueryGroup, attend};
pub use causal::causal_attention;
pub(crate) use gather::KvRun;
pub use norm::add_rms_norm;
#[cfg(test)]
pub(crate) use quant::COVERED;
pub(crate) use quant::{Dequantized, Rounded, covers, dequantize_once, rounded_matmul};
pub use rope::rope_heads;
pub use silu::{silu_mul, silu_mul_joined};

use candle_core::{CpuStorage, DType, Layout, Result, Tensor};
use rayon::prelude::*;

/// Which ops the decoder runs: its fused kernels (on CPU f32; elsewhere they fall back to
/// candle's), or candle's own ops everywhere (the reference the fused kernels are measured
/// and tested against).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernels {
    #[default]
    Fused,
    Candle,
}

impl Kernels {
    /// Whether the fused kernels run on `t`: asked for, and on the CPU in f32.
    pub(crate) fn fused_for(self, t: &Tensor) -> bool {
        self == Kernels::Fused && t.device().is_cpu() && t.dtype() == DType::F32
    }
}

/// Elements below which a parallel piece costs more in wake-ups than it saves: a rayon
/// hand-off is a few microseconds, which a few thousand f32 element-wise ops take alone.
const MIN_PER_THREAD: usize = 16 * 1024;

/// How many parallel pieces `work` elements split into: candle's thread count, fewer when
/// each piece would get under `MIN_PER_THREAD`, and 1 (run on the caller) for small inputs.
pub(crate) fn pieces(work: usize) -> usize {
    threads().min(work / MIN_PER_THREAD).max(1)
}

/// candle's thread count, read once. candle works it out again on every call, from procfs
/// (`/proc/cpuinfo` among others), and the kernels ask for it several times a layer: on a
/// forward of a few dozen rows that reading showed as about 3% of the model thread's time.
fn threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(candle_core::utils::get_num_threads)
}

/// Runs `f(first_row, dst_rows)` over `dst`, `rows` rows of `width` elements each, split into
/// `pieces(rows * cost)` contiguous pieces of rows, in parallel when there is more than one.
pub(crate) fn for_rows(
    dst: &mut [f32],
    rows: usize,
    width: usize,
    cost: usize,
    f: impl Fn(usize, &mut [f32]) + Sync,
) {
    let n = pieces(rows * cost);
    if n == 1 || width == 0 {
        return f(0, dst);
    }
    let per = rows.div_ceil(n);
    dst.par_chunks_mut(per * width)
        .enumerate()
        .for_each(|(i, d)| f(i * per, d));
}

/// The f32 elements of a contiguous CPU tensor's storage, from its start offset.
pub(crate) fn f32s<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    let CpuStorage::F32(v) = s else {
        use candle_core::backend::BackendStorage;
        candle_core::bail!("{what}: f32 storage expected, got {:?}", s.dtype())
    };
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&v[a..b]),
        None => candle_core::bail!("{what}: contiguous input expected"),
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! Seeded random tensors and comparisons for the kernels' tests.

    use candle_core::{Device, Tensor};

    /// Fixed pseudo-random values in [-scale, scale), the same on every machine.
    pub(crate) fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let u = (state >> 40) as f32 / (1u64 << 24) as f32;
                scale * (2.0 * u - 1.0)
            })
            .collect()
    }

    pub(crate) fn tensor(dims: &[usize], seed: u64, scale: f32) -> Tensor {
        let n = dims.iter().product();
        Tensor::from_vec(values(n, seed, scale), dims, &Device::Cpu).unwrap()
    }

    /// How `max_gap` measures one difference.
    #[derive(Clone, Copy)]
    pub(crate) enum Gap {
        /// |got - want|.
        Abs,
        /// |got - want|, divided by |want| where that is above 1.
        Rel,
    }

    /// The largest difference between `got` and `want`, element by element; infinite where
    /// either side holds a NaN or their lengths differ. `f32::max` and `f64::max` drop a NaN
    /// operand, so a fold over them passes a kernel that returns NaN under any tolerance.
    pub(crate) fn max_gap<A, B>(got: &[A], want: &[B], gap: Gap) -> f64
    where
        A: Copy + Into<f64>,
        B: Copy + Into<f64>,
    {
        if got.len() != want.len() {
            return f64::INFINITY;
        }
        let mut worst = 0.0f64;
        for (&x, &y) in got.iter().zip(want) {
            let (x, y): (f64, f64) = (x.into(), y.into());
            if x == y {
                // Equal infinities too, whose difference is NaN.
                continue;
            }
            let d = match gap {
                Gap::Abs => (x - y).abs(),
                Gap::Rel => (x - y).abs() / y.abs().max(1.0),
            };
            if d.is_nan() {
                return f64::INFINITY;
            }
            worst = worst.max(d);
        }
        worst
    }

    #[test]
    fn a_nan_or_a_missing_value_is_an_infinite_gap() {
        let inf = f64::INFINITY;
        assert_eq!(max_gap(&[1.0f32, 2.0], &[1.0f32, 2.5], Gap::Abs), 0.5);
        assert_eq!(max_gap(&[1.0f32, 12.0], &[1.0f64, 10.0], Gap::Rel), 0.2);
        assert_eq!(max_gap(&[f32::NAN, 2.0], &[1.0f32, 2.0], Gap::Abs), inf);
        assert_eq!(max_gap(&[1.0f32, 2.0], &[1.0f32, f32::NAN], Gap::Rel), inf);
        assert_eq!(max_gap(&[f32::NAN], &[f32::NAN], Gap::Abs), inf);
        assert_eq!(max_gap(&[1.0f32], &[1.0f32, 2.0], Gap::Abs), inf);
        assert_eq!(max_gap(&[f32::INFINITY], &[f32::INFINITY], Gap::Abs), 0.0);
        assert_eq!(max_gap(&[f32::INFINITY], &[1.0f32], Gap::Abs), inf);
    }

    /// `max_gap` of two tensors of one shape, relative where `b` is above 1 in size.
    pub(crate) fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        assert_eq!(a.dims(), b.dims());
        let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        max_gap(&a, &b, Gap::Rel)
    }
}
