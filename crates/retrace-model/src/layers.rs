//! The decoder's linear and embedding layers in either precision: full (candle's own, from
//! safetensors or a GGUF's f32/f16 tensors) or quantized (a GGUF's blocks kept as they are,
//! multiplied by candle's quantized matmul, which quantizes the activations as llama.cpp does).

use crate::kernels::quantized_gemm;
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Embedding, Linear};
use std::sync::Arc;

/// Rows from which a CPU matmul over a block type candle has no SIMD dot product for goes
/// through f32 GEMM instead (see `Lin::forward`).
const GEMM_ROWS: usize = 16;

pub(crate) enum Lin {
    Full(Linear),
    Quant {
        w: QMatMul,
        table: Arc<QTensor>,
        b: Option<Tensor>,
    },
}

impl Lin {
    pub(crate) fn quant(table: QTensor, b: Option<Tensor>) -> Result<Lin> {
        let table = Arc::new(table);
        Ok(Self::Quant {
            w: QMatMul::from_arc(table.clone())?,
            table,
            b,
        })
    }
}

impl Module for Lin {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Full(l) => l.forward(x),
            Self::Quant { w, table, b } => {
                let k = x.dim(candle_core::D::Minus1)?;
                let rows = x.elem_count() / k.max(1);
                // candle's dot products for Q4_1, Q5_0 and Q5_1 blocks are scalar: many times
                // slower than llama.cpp's. The same arithmetic as a GEMM: the activations
                // rounded to the block type llama.cpp's dot product takes them in, times the
                // weights dequantized (exactly the values the blocks hold) for this call only.
                let gemm = if x.device().is_cpu() && x.dtype() == DType::F32 && rows >= GEMM_ROWS {
                    quantized_gemm(x, table)?
                } else {
                    None
                };
                let y = match gemm {
                    Some(y) => y,
                    None => w.forward(x)?,
                };
                match b {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                }
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;
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
    fn the_gemm_path_reads_a_view_as_its_own_rows() {
        // The second half of a larger tensor: contiguous, at an offset into a storage twice its
        // size, as the fused kernels hand views to the next matmul.
        let dev = Device::Cpu;
        let (n, k, rows) = (64, 64, GEMM_ROWS + 8);
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

    #[test]
    fn the_gemm_path_computes_what_the_quantized_dot_products_do() {
        // Rows past GEMM_ROWS take the dequantized GEMM; below, candle's own dot products (a port
        // of llama.cpp's). They share every value but one: a Q8_1 block keeps its sum `s` in f16
        // (the integer sum rounded, times the f16 scale, rounded again: at most 2^-10 relative),
        // which the Q4_1/Q5_1 dot product multiplies by the weight block's minimum `m`, where the
        // GEMM sums the activations exactly. So each output may differ by at most
        // sum over blocks of |m| * |block sum| * 2^-10, plus f32 rounding of the sums.
        let dev = Device::Cpu;
        let (n, k, rows) = (96, 64, GEMM_ROWS + 8);
        let w = Tensor::from_vec(values(n * k, 0x9e37_79b9), (n, k), &dev).unwrap();
        let x = Tensor::from_vec(values(rows * k, 0x2545_f491), (rows, k), &dev).unwrap();
        for (dtype, act) in [
            (GgmlDType::Q4_1, GgmlDType::Q8_1),
            (GgmlDType::Q5_0, GgmlDType::Q8_0),
            (GgmlDType::Q5_1, GgmlDType::Q8_1),
        ] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let wd = q.dequantize(&dev).unwrap().to_vec2::<f32>().unwrap();
            let xq = QTensor::quantize(&x, act)
                .unwrap()
                .dequantize(&dev)
                .unwrap();
            let xq = xq.to_vec2::<f32>().unwrap();
            let reference = QMatMul::from_qtensor(QTensor::quantize(&w, dtype).unwrap())
                .unwrap()
                .forward(&x)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let gemm = Lin::quant(q, None).unwrap().forward(&x).unwrap();
            let gemm = gemm.to_vec2::<f32>().unwrap();
            let exact = x.matmul(&w.t().unwrap()).unwrap().to_vec2::<f32>().unwrap();
            let mut far = 0f32;
            for i in 0..rows {
                for j in 0..n {
                    let mut bound = 0f32;
                    let mut magnitude = 0f32;
                    for b in (0..k).step_by(32) {
                        let block = b..b + 32;
                        // The element equal to a Q4_1/Q5_1 block's minimum quantizes to 0, so the
                        // smallest dequantized value is `m` itself.
                        let m = wd[j][block.clone()]
                            .iter()
                            .copied()
                            .fold(f32::MAX, f32::min);
                        let sum: f32 = xq[i][block.clone()].iter().sum();
                        if act == GgmlDType::Q8_1 {
                            bound += m.abs() * sum.abs() * 2f32.powi(-10);
                        }
                        magnitude += block.map(|c| (xq[i][c] * wd[j][c]).abs()).sum::<f32>();
                    }
                    bound += 1e-5 * magnitude;
                    let diff = (gemm[i][j] - reference[i][j]).abs();
                    assert!(diff <= bound, "{dtype:?} [{i}][{j}]: {diff} > {bound}");
                    far = far.max((exact[i][j] - reference[i][j]).abs() - bound);
                }
            }
            // And the activations were rounded: the unquantized product is further off than
            // the bound somewhere.
            assert!(far > 0.0, "{dtype:?}");
        }
    }
}
