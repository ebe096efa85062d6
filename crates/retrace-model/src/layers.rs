//! The decoder's linear and embedding layers in either precision: full (candle's own, from
//! safetensors or a GGUF's f32/f16 tensors) or quantized (a GGUF's blocks kept as they are,
//! multiplied by candle's quantized matmul, which quantizes the activations as llama.cpp does).

use crate::gguf::Gguf;
use crate::kernels::{Dequantized, Rounded, covers, dequantize_once, rounded_matmul};
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Embedding, VarBuilder};
use std::sync::Arc;

pub(crate) enum Lin {
    Full(Dense),
    Quant {
        w: QMatMul,
        table: Arc<QTensor>,
        b: Option<Tensor>,
        /// The table dequantized once (`dequantize_once`), when a budget allowed it.
        once: Option<Dequantized>,
    },
}

impl Lin {
    pub(crate) fn quant(table: QTensor, b: Option<Tensor>) -> Result<Lin> {
        let table = Arc::new(table);
        Ok(Self::Quant {
            w: QMatMul::from_arc(table.clone())?,
            table,
            b,
            once: None,
        })
    }

    /// Keeps a quantized table of a block type the own matmul runs also dequantized, when it
    /// fits what is left of `budget` bytes (which it then spends): each call reads it instead
    /// of dequantizing the weights again. Full layers and the K-quants are left as they are.
    pub(crate) fn dequantize_once(&mut self, budget: &mut usize) -> Result<()> {
        let Self::Quant { table, once, .. } = self else {
            return Ok(());
        };
        let (n, k) = table.shape().dims2()?;
        // The weights, and at most one minimum per block of 32.
        let need = 4 * (n * k + n * k / 32);
        if once.is_some() || !table.device().is_cpu() || need > *budget {
            return Ok(());
        }
        if let Some(d) = dequantize_once(table)? {
            *budget -= d.bytes();
            *once = Some(d);
        }
        Ok(())
    }
}

/// A full-precision linear layer, y = x W^T + b. On the CPU its weight is kept transposed,
/// (in, out) row-major: gemm then reads it as it is instead of packing the whole matrix again
/// for every call, which on a forward of a few dozen to a few hundred rows (a search's next
/// step over a cached prefix) took a third of gemm's time; the sums are the same, to the bit.
pub(crate) struct Dense {
    /// (in, out) on the CPU, (out, in) elsewhere (`transposed` says which).
    w: Tensor,
    transposed: bool,
    b: Option<Tensor>,
}

impl Dense {
    /// From a weight (out, in), as checkpoints store it.
    pub(crate) fn new(w: Tensor, b: Option<Tensor>) -> Result<Self> {
        let transposed = w.device().is_cpu();
        let w = match transposed {
            true => w.t()?.contiguous()?,
            false => w,
        };
        Ok(Self { w, transposed, b })
    }

    /// The weight as checkpoints store it, (out, in) (a view on the CPU).
    pub(crate) fn weight(&self) -> Result<Tensor> {
        match self.transposed {
            true => self.w.t(),
            false => Ok(self.w.clone()),
        }
    }

    pub(crate) fn bias(&self) -> Option<&Tensor> {
        self.b.as_ref()
    }

    /// Its output columns.
    fn out_dim(&self) -> Result<usize> {
        self.w.dim(if self.transposed { 1 } else { 0 })
    }

    /// The layer of outputs `at..at + len` alone, a view of this one's weight (no copy).
    pub(crate) fn outputs(&self, at: usize, len: usize) -> Result<Self> {
        let out_dim = if self.transposed { 1 } else { 0 };
        Ok(Self {
            w: self.w.narrow(out_dim, at, len)?,
            transposed: self.transposed,
            b: self.b.as_ref().map(|b| b.narrow(0, at, len)).transpose()?,
        })
    }
}

/// `x` is (rows, in): the decoder's stream is packed rows, never batched (a higher rank is
/// refused by the matmul, not guessed at).
impl Module for Dense {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match self.transposed {
            true => x.matmul(&self.w)?,
            false => x.matmul(&self.w.t()?)?,
        };
        match &self.b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

impl Module for Lin {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let [y] = Lin::forward_each([self], x)?;
        Ok(y)
    }
}

impl Lin {
    /// Each of `lins` applied to the same `x` (q, k and v; gate and up), as `forward` applies
    /// one: the quantized tables the own matmul runs share one rounding of `x`'s activations
    /// (the same values for every table, so the same bits as rounding it for each).
    pub(crate) fn forward_each<const N: usize>(lins: [&Lin; N], x: &Tensor) -> Result<[Tensor; N]> {
        let mut rounded = None;
        let mut out = Vec::with_capacity(N);
        for lin in lins {
            out.push(match lin {
                Self::Full(l) => rows_apart(x, l.out_dim()?, |x| l.forward(x))?,
                Self::Quant { w, table, b, once } => {
                    let (n, k) = table.shape().dims2()?;
                    // The 32-element block types in llama.cpp's arithmetic, the same for any
                    // number of rows (see `rounded_matmul`); the K-quants (and every type off
                    // the CPU or outside f32) through candle's own matmul.
                    let own = x.device().is_cpu() && x.dtype() == DType::F32;
                    let y = match own && covers(table.dtype()) {
                        true => {
                            let r = match &rounded {
                                Some(r) => r,
                                None => rounded.insert(Rounded::new(x, k)?),
                            };
                            rounded_matmul(r, table, once.as_ref(), min_rows(n))?
                        }
                        false => rows_apart(x, n, |x| w.forward(x))?,
                    };
                    match b {
                        Some(b) => y.broadcast_add(b)?,
                        None => y,
                    }
                }
            });
        }
        out.try_into()
            .map_err(|_| candle_core::Error::Msg("one output per layer".into()))
    }
}

/// The fewest rows a product with `n` output columns is run on, on the CPU. gemm chooses its
/// kernel by the product's shape: a matrix-vector one for a lone row, a horizontal one when
/// rows x columns <= 256, another block depth when both are <= 64 (and candle runs a lone row
/// of a K-quant with a kernel of its own); their sums differ in the last bits, which the next
/// layer's 8-bit activations can turn into a whole quantum. Past this many rows every call of
/// a product takes one kernel, whatever rows share it (a single output column, gemm's
/// matrix-vector product for every row count, aside).
fn min_rows(n: usize) -> usize {
    (256 / n.max(1) + 1).max(65)
}

/// `f(x)`, a product of `x`'s rows with `n` output columns, run on at least `min_rows(n)` rows
/// on the CPU (zero rows pad a short input, and are dropped after), so that a row gets the same
/// bits alone, in a batch, or after a cached prefix: what `f` costs on the padding is the
/// price of a score that does not depend on its batch-mates.
pub(crate) fn rows_apart(
    x: &Tensor,
    n: usize,
    f: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let k = x.dim(candle_core::D::Minus1)?;
    let rows = x.elem_count() / k.max(1);
    let least = min_rows(n);
    if !x.device().is_cpu() || rows >= least || k == 0 {
        return f(x);
    }
    let flat = x.reshape((rows, k))?;
    let pad = Tensor::zeros((least - rows, k), x.dtype(), x.device())?;
    let y = f(&Tensor::cat(&[&flat, &pad], 0)?)?.narrow(0, 0, rows)?;
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("rank >= 1") = y.dim(1)?;
    y.contiguous()?.reshape(dims)
}

pub(crate) enum Emb {
    Full(Embedding),
    /// Rows are dequantized as they are looked up: the table stays at its quantized size.
    Quant {
        table: Arc<QTensor>,
        dtype: DType,
    },
}

impl Emb {
    /// `ids` (n) -> (n, H) in the model dtype.
    pub(crate) fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Self::Full(e) => e.forward(ids),
            Self::Quant { table, dtype } => table.embedding(ids)?.to_dtype(*dtype),
        }
    }

    pub(crate) fn device(&self) -> candle_core::Device {
        match self {
            Self::Full(e) => e.embeddings().device().clone(),
            Self::Quant { table, .. } => table.device(),
        }
    }

    /// The dtype `forward` returns.
    pub(crate) fn dtype(&self) -> DType {
        match self {
            Self::Full(e) => e.embeddings().dtype(),
            Self::Quant { dtype, .. } => *dtype,
        }
    }

    pub(crate) fn hidden_size(&self) -> usize {
        match self {
            Self::Full(e) => e.hidden_size(),
            Self::Quant { table, .. } => table.shape().dims().last().copied().unwrap_or(0),
        }
    }

    /// Rows `ids` of the table, (ids.len(), H) in f32: a tied LM head's rows.
    pub(crate) fn rows(&self, ids: &[u32]) -> Result<Tensor> {
        let idx = Tensor::new(ids, &self.device())?;
        match self {
            Self::Full(e) => e.embeddings().index_select(&idx, 0)?.to_dtype(DType::F32),
            Self::Quant { table, .. } => table.embedding(&idx)?.to_dtype(DType::F32),
        }
    }
}

/// A linear layer whose bias is loaded when the checkpoint has one (or the config says so, in which
/// case a missing tensor is an error). A GGUF's quantized matrix stays quantized; its bias is f32.
pub(crate) fn linear(
    in_dim: usize,
    out_dim: usize,
    bias: bool,
    vb: VarBuilder,
    quant: Option<&Gguf>,
) -> Result<Lin> {
    let bias = bias || vb.contains_tensor("bias");
    if let Some(w) = quant
        .map(|g| g.quantized(&format!("{}.weight", vb.prefix()), vb.device()))
        .transpose()?
        .flatten()
    {
        let b = bias.then(|| vb.get(out_dim, "bias")).transpose()?;
        return Lin::quant(w, b);
    }
    let l = candle_nn::linear_b(in_dim, out_dim, bias, vb)?;
    Ok(Lin::Full(Dense::new(
        l.weight().clone(),
        l.bias().cloned(),
    )?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::COVERED;
    use candle_core::Device;
    use candle_core::quantized::GgmlDType;

    /// Fixed pseudo-random values in [-1, 1), each block of 32 shifted by its own offset so that
    /// block minimums differ: a seeded test, the same on every machine.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed;
        (0..n)
            .map(|i| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let u = (state >> 40) as f32 / (1u64 << 24) as f32;
                2.0 * u - 1.0 + ((i / 32) % 3) as f32 * 0.5
            })
            .collect()
    }

    #[test]
    fn the_quantized_matmul_reads_a_view_as_its_own_rows() {
        // The second half of a larger tensor: contiguous, at an offset into a storage twice its
        // size, as the fused kernels hand views to the next matmul.
        let dev = Device::Cpu;
        let (n, k, rows) = (64, 64, 24);
        let w = Tensor::from_vec(values(n * k, 0x9e37_79b9), (n, k), &dev).unwrap();
        let both = Tensor::from_vec(values(2 * rows * k, 0x2545_f491), (2 * rows, k), &dev);
        let view = both.unwrap().narrow(0, rows, rows).unwrap();
        assert!(view.is_contiguous());
        let copy = Tensor::from_vec(
            view.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            (rows, k),
            &dev,
        )
        .unwrap();
        let lin = Lin::quant(QTensor::quantize(&w, GgmlDType::Q4_1).unwrap(), None).unwrap();
        let got = lin.forward(&view).unwrap().to_vec2::<f32>().unwrap();
        let want = lin.forward(&copy).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(got, want);
    }

    /// llama.cpp's dot product of weight row `w` (dequantized: `d * q + m`, `m` 0 for the types
    /// without one) and activation row `x`, in f64: per block of 32, the activations rounded to
    /// Q8 (scale `f16(amax / 127)`), and for a type with a minimum, `m` times the block's Q8_1
    /// sum `f16(amax / 127 * sum q)` in place of the exact sum of the rounded values. Also the
    /// magnitude (sum of |products|) the f32 result's rounding scales with.
    fn llama_dot(w: &[f32], x: &[f32], with_min: bool) -> (f64, f64) {
        let (mut dot, mut magnitude) = (0f64, 0f64);
        for (wb, xb) in w.chunks_exact(32).zip(x.chunks_exact(32)) {
            // The element at a block's minimum quantizes to 0 in the test data, so the smallest
            // dequantized value is `m` itself.
            let m = match with_min {
                true => wb.iter().copied().fold(f32::MAX, f32::min) as f64,
                false => 0.0,
            };
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let scale = half::f16::from_f32(d).to_f32() as f64;
            let q: Vec<f32> = xb.iter().map(|v| (v * id).round()).collect();
            let sum_q: f32 = q.iter().sum();
            for (wv, qv) in wb.iter().zip(&q) {
                dot += (*wv as f64 - m) * (*qv as f64 * scale);
                magnitude += (*wv as f64 * *qv as f64 * scale).abs();
            }
            dot += m * half::f16::from_f32(sum_q * d).to_f32() as f64;
        }
        (dot, magnitude)
    }

    #[test]
    fn the_32_element_block_types_compute_llama_cpps_dot_products_at_any_row_count() {
        let dev = Device::Cpu;
        let (n, k) = (96, 128);
        let w = Tensor::from_vec(values(n * k, 0x9e37_79b9), (n, k), &dev).unwrap();
        for dtype in COVERED {
            let with_min = matches!(dtype, GgmlDType::Q4_1 | GgmlDType::Q5_1);
            let q = QTensor::quantize(&w, dtype).unwrap();
            let wd = q.dequantize(&dev).unwrap().to_vec2::<f32>().unwrap();
            let lin = Lin::quant(q, None).unwrap();
            // One row, a few, many.
            for rows in [1, 3, 24] {
                let x = values(rows * k, 0x2545_f491 + rows as u64);
                let xt = Tensor::from_vec(x.clone(), (rows, k), &dev).unwrap();
                let got = lin.forward(&xt).unwrap().to_vec2::<f32>().unwrap();
                for i in 0..rows {
                    for j in 0..n {
                        let (want, magnitude) = llama_dot(&wd[j], &x[i * k..][..k], with_min);
                        let gap = (got[i][j] as f64 - want).abs();
                        assert!(
                            gap <= 1e-5 * magnitude,
                            "{dtype:?}, {rows} rows, [{i}][{j}]: {} against {want}",
                            got[i][j]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn a_table_dequantized_once_multiplies_to_the_same_bits() {
        let dev = Device::Cpu;
        let (n, k, rows) = (96, 256, 70);
        let w = Tensor::from_vec(values(n * k, 0x9e37_79b9), (n, k), &dev).unwrap();
        let x = Tensor::from_vec(values(rows * k, 0x2545_f491), (rows, k), &dev).unwrap();
        for dtype in COVERED {
            let per_call = Lin::quant(QTensor::quantize(&w, dtype).unwrap(), None).unwrap();
            let mut once = Lin::quant(QTensor::quantize(&w, dtype).unwrap(), None).unwrap();
            let mut budget = 4 * n * k - 1;
            once.dequantize_once(&mut budget).unwrap();
            assert!(
                matches!(once, Lin::Quant { once: None, .. }),
                "{dtype:?}: over budget"
            );
            let mut budget = usize::MAX;
            once.dequantize_once(&mut budget).unwrap();
            assert!(
                matches!(once, Lin::Quant { once: Some(_), .. }),
                "{dtype:?}"
            );
            let want = per_call.forward(&x).unwrap().to_vec2::<f32>().unwrap();
            let got = once.forward(&x).unwrap().to_vec2::<f32>().unwrap();
            let bits = |v: &[Vec<f32>]| v.concat().iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "{dtype:?}");
        }
    }

    #[test]
    fn layers_applied_together_give_each_ones_bits() {
        // q, k and v (or gate and up) share one rounding of their input: each output must be
        // what the layer gives alone, for every kind of layer beside it, padded or not.
        let dev = Device::Cpu;
        let k = 256;
        let table = |n: usize, dtype, seed| {
            let w = Tensor::from_vec(values(n * k, seed), (n, k), &dev).unwrap();
            Lin::quant(QTensor::quantize(&w, dtype).unwrap(), None).unwrap()
        };
        let w = Tensor::from_vec(values(48 * k, 3), (48, k), &dev).unwrap();
        let b = Tensor::from_vec(values(64, 5), 64, &dev).unwrap();
        let with_bias = {
            let w = Tensor::from_vec(values(64 * k, 9), (64, k), &dev).unwrap();
            Lin::quant(QTensor::quantize(&w, GgmlDType::Q8_0).unwrap(), Some(b)).unwrap()
        };
        let lins = [
            table(96, GgmlDType::Q4_1, 1),
            table(32, GgmlDType::Q4_0, 2),
            Lin::Full(Dense::new(w, None).unwrap()),
            table(64, GgmlDType::Q4K, 4),
            table(40, GgmlDType::Q5_1, 7),
            with_bias,
        ];
        let bits = |t: &Tensor| {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.iter().map(|f| f.to_bits()).collect::<Vec<_>>()
        };
        for rows in [1, 30, 70] {
            let x = Tensor::from_vec(values(rows * k, 11 + rows as u64), (rows, k), &dev).unwrap();
            let together = Lin::forward_each(lins.each_ref(), &x).unwrap();
            for (lin, got) in lins.iter().zip(&together) {
                let alone = lin.forward(&x).unwrap();
                assert_eq!(got.dims(), alone.dims(), "{rows} rows");
                assert!(bits(got) == bits(&alone), "{rows} rows: a layer moved");
            }
        }
    }

    #[test]
    fn a_narrow_product_does_not_depend_on_its_batch_mates_either() {
        // 64 outputs of 64 inputs, as the tiny fixtures' layers and a PRM's heads are narrow:
        // gemm runs a few such rows with a horizontal kernel and many with another.
        let dev = Device::Cpu;
        let (n, k, rows) = (64, 64, 300);
        let w = Tensor::from_vec(values(n * k, 0x9e37_79b9), (n, k), &dev).unwrap();
        let x = Tensor::from_vec(values(rows * k, 0x2545_f491), (rows, k), &dev).unwrap();
        let full = Lin::Full(Dense::new(w.clone(), None).unwrap());
        let quant = COVERED.map(|d| Lin::quant(QTensor::quantize(&w, d).unwrap(), None).unwrap());
        for lin in std::iter::once(&full).chain(&quant) {
            let all = lin.forward(&x).unwrap().to_vec2::<f32>().unwrap();
            for (start, take) in [(0, 1), (5, 2), (9, 3), (0, 64), (3, 100)] {
                let part = lin.forward(&x.narrow(0, start, take).unwrap()).unwrap();
                for (i, row) in part.to_vec2::<f32>().unwrap().iter().enumerate() {
                    let same = row
                        .iter()
                        .zip(&all[start + i])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "row {} among {take} differs from itself among {rows}",
                        start + i
                    );
                }
            }
        }
    }

    #[test]
    fn a_rows_product_does_not_depend_on_its_batch_mates() {
        // Every block type of the GGUFs retrace serves (SmolLM2's Q4_1, Qwen2.5's Q4_K_M: Q5_0,
        // Q4_K, Q6_K, Q8_0) and their siblings: a row alone, among a few, and among many gets
        // the same bits. Not merely close: the next layer rounds its activations to 8 bits, which
        // turns a difference in the last bit into a whole quantum now and then.
        let dev = Device::Cpu;
        let (n, k, rows) = (256, 512, 40);
        let w = Tensor::from_vec(values(n * k, 0x9e37_79b9), (n, k), &dev).unwrap();
        let x = Tensor::from_vec(values(rows * k, 0x2545_f491), (rows, k), &dev).unwrap();
        let k_quants = [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K];
        for dtype in COVERED.into_iter().chain(k_quants) {
            let lin = Lin::quant(QTensor::quantize(&w, dtype).unwrap(), None).unwrap();
            let all = lin.forward(&x).unwrap().to_vec2::<f32>().unwrap();
            for (start, take) in [(0, 1), (7, 1), (3, 2), (0, 8), (12, 20)] {
                let part = lin.forward(&x.narrow(0, start, take).unwrap()).unwrap();
                let part = part.to_vec2::<f32>().unwrap();
                for i in 0..take {
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    let (a, b) = (&part[i], &all[start + i]);
                    assert!(
                        bits(a) == bits(b),
                        "{dtype:?}: row {} among {take} differs from itself among {rows} by {}",
                        start + i,
                        a.iter()
                            .zip(b)
                            .map(|(x, y)| (x - y).abs())
                            .fold(0f32, f32::max)
                    );
                }
            }
        }
    }
}
