//! The decoder's linear and embedding layers in either precision: full (candle's own, from
//! safetensors or a GGUF's f32/f16 tensors) or quantized (a GGUF's blocks kept as they are,
//! multiplied by candle's quantized matmul, which quantizes the activations as llama.cpp does).

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Embedding, Linear};
use std::sync::Arc;

/// Rows from which a CPU matmul over a block type candle has no SIMD dot product for goes
/// through f32 GEMM instead (see `Lin::forward`).
const GEMM_ROWS: usize = 16;

pub enum Lin {
    Full(Linear),
    Quant {
        w: QMatMul,
        table: Arc<QTensor>,
        b: Option<Tensor>,
    },
}

impl Lin {
    pub fn quant(table: QTensor, b: Option<Tensor>) -> Result<Lin> {
        let table = Arc::new(table);
        Ok(Self::Quant {
            w: QMatMul::from_arc(table.clone())?,
            table,
            b,
        })
    }
}

/// The block type llama.cpp (and candle) quantize activations to before a dot product with
/// weights of type `w`; `None` for the types candle's CPU kernels handle at SIMD speed.
fn slow_on_cpu(w: GgmlDType) -> Option<GgmlDType> {
    match w {
        GgmlDType::Q4_1 | GgmlDType::Q5_1 => Some(GgmlDType::Q8_1),
        GgmlDType::Q5_0 => Some(GgmlDType::Q8_0),
        _ => None,
    }
}

impl Module for Lin {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Full(l) => l.forward(x),
            Self::Quant { w, table, b } => {
                let k = x.dim(candle_core::D::Minus1)?;
                let rows = x.elem_count() / k.max(1);
                let y = match slow_on_cpu(table.dtype()) {
                    // candle's dot products for these blocks are scalar: many times slower than
                    // llama.cpp's. The same arithmetic as a GEMM: the activations rounded to the
                    // block type llama.cpp's dot product takes them in, times the weights
                    // dequantized (exactly the values the blocks hold) for this call only.
                    Some(act) if x.device().is_cpu() && rows >= GEMM_ROWS => {
                        let shape = x.shape().clone();
                        let x2 = x.reshape((rows, k))?.contiguous()?;
                        let xq = QTensor::quantize(&x2, act)?.dequantize(x.device())?;
                        let wd = table.dequantize(x.device())?;
                        let mut dims = shape.dims().to_vec();
                        *dims.last_mut().expect("rank >= 1") = wd.dim(0)?;
                        xq.matmul(&wd.t()?)?.reshape(dims)?
                    }
                    _ => w.forward(x)?,
                };
                match b {
                    Some(b) => y.broadcast_add(b),
                    None => Ok(y),
                }
            }
        }
    }
}

pub enum Emb {
    Full(Embedding),
    /// Rows are dequantized as they are looked up: the table stays at its quantized size.
    Quant {
        table: Arc<QTensor>,
        dtype: DType,
    },
}

impl Emb {
    /// `ids` (n) -> (n, H) in the model dtype.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        match self {
            Self::Full(e) => e.forward(ids),
            Self::Quant { table, dtype } => table.embedding(ids)?.to_dtype(*dtype),
        }
    }

    pub fn device(&self) -> candle_core::Device {
        match self {
            Self::Full(e) => e.embeddings().device().clone(),
            Self::Quant { table, .. } => table.device(),
        }
    }

    /// The dtype `forward` returns.
    pub fn dtype(&self) -> DType {
        match self {
            Self::Full(e) => e.embeddings().dtype(),
            Self::Quant { dtype, .. } => *dtype,
        }
    }

    pub fn hidden_size(&self) -> usize {
        match self {
            Self::Full(e) => e.hidden_size(),
            Self::Quant { table, .. } => table.shape().dims().last().copied().unwrap_or(0),
        }
    }

    /// Rows `ids` of the table, (ids.len(), H) in f32: a tied LM head's rows.
    pub fn rows(&self, ids: &[u32]) -> Result<Tensor> {
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

    #[test]
    fn the_gemm_path_computes_what_the_quantized_dot_products_do() {
        // Rows past GEMM_ROWS take the dequantized GEMM; below, candle's own Q4_1 x Q8_1 dot
        // products (a port of llama.cpp's). Both must give the same numbers.
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (96, 64), &dev).unwrap();
        let x = Tensor::randn(0f32, 1.0, (GEMM_ROWS + 8, 64), &dev).unwrap();
        for dtype in [GgmlDType::Q4_1, GgmlDType::Q5_0, GgmlDType::Q5_1] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let reference = QMatMul::from_qtensor(QTensor::quantize(&w, dtype).unwrap())
                .unwrap()
                .forward(&x)
                .unwrap();
            let gemm = Lin::quant(q, None).unwrap().forward(&x).unwrap();
            let scale = reference.abs().unwrap().max_all().unwrap();
            let scale = scale.to_scalar::<f32>().unwrap();
            let diff = (gemm - &reference)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(diff <= 1e-3 * scale, "{dtype:?}: {diff} of {scale}");
            // And far from the unquantized product: the activations were rounded.
            let exact = x.matmul(&w.t().unwrap()).unwrap();
            let off = (exact - &reference)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap();
            assert!(off.to_scalar::<f32>().unwrap() > diff, "{dtype:?}");
        }
    }
}
