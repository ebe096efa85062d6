//! The decoder's linear and embedding layers in either precision: full (candle's own, from
//! safetensors or a GGUF's f32/f16 tensors) or quantized (a GGUF's blocks kept as they are,
//! multiplied by candle's quantized matmul, which quantizes the activations as llama.cpp does).

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Embedding, Linear};
use std::sync::Arc;

pub enum Lin {
    Full(Linear),
    Quant { w: QMatMul, b: Option<Tensor> },
}

impl Module for Lin {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Full(l) => l.forward(x),
            Self::Quant { w, b } => {
                let y = w.forward(x)?;
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
