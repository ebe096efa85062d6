//! # retrace-model
//!
//! Process reward models on candle, and nothing else: no runtime, metrics, server config or
//! RPC. A checkpoint (a Hugging Face folder or a GGUF file) is loaded with the head its family
//! reads, or a head trained on it; token ids and the positions to read go in, one score in
//! [0, 1] per position comes out (for a sequence-classification reward model, its raw reward at
//! the one position read; or the hidden states of chosen layers there, a trainer's features:
//! `PrmModel::states`). Both calls take one `Batch` (ids, positions, and spans where a head reads
//! them). Rows of a batch are packed end to end, not padded; tokens rows share are computed
//! once, and an optional prefix cache keeps what earlier batches computed.
//!
//! ```
//! use candle_core::{DType, Device};
//! use retrace_model::{Batch, HeadSpec, PrmModel};
//!
//! # fn main() -> Result<(), retrace_model::ModelError> {
//! // A Math-Shepherd-style PRM (the repository's tiny random-weight fixture): the softmax
//! // over the logits of '+' and '-' at each step's closing tag, index '+'.
//! let folder = std::path::Path::new("../../tests/fixtures/tiny/math-shepherd");
//! let head = HeadSpec::LmPair { plus: 270, minus: 272 };
//! let model = PrmModel::load(folder, head, &Device::Cpu, DType::F32)?;
//! // A trace of two steps as its family formats it: token ids, each step ending in the tag
//! // (818 here), read at the tags.
//! let ids: &[u32] = &[1, 446, 718, 348, 818, 391, 441, 415, 818];
//! let rows = model.score(Batch::new(&[ids], &[&[4, 8]]))?;
//! assert_eq!(rows[0].scores.len(), 2);
//! assert!(rows[0].scores.iter().all(|p| (0.0..=1.0).contains(p)));
//! # Ok(())
//! # }
//! ```
//!
//! # Layout
//! - `model.rs`: `PrmModel`, loading a checkpoint and its two calls (`score`, `states`) and reuse;
//!   `error.rs`: `ModelError`.
//! - `batch.rs`: `Batch`, and one batch through the prefix cache (look up, lay out, run, insert, evict).
//! - `config.rs`: `ModelConfig`, mirroring `config.json` (Llama, Mistral, Qwen2).
//! - `decoder/`: the packed decoder, run in stages (`stream`, `reads`, `layer`, `attention`,
//!   `capture`; `packing`: keys and values per packed row; `flash`: attention through the
//!   fused kernel); `layers.rs`: linear and embedding layers, f32 or quantized.
//! - `kernels/`: fused CPU f32 kernels (add + RMS norm, SiLU * up, RoPE, blocked attention)
//!   and `Kernels`, the switch between them and candle's ops.
//! - `head/`: the heads each PRM family reads (a value head, a two-class head, an LM pair, a
//!   sequence classifier's `score`, with its own config keys in `classifier.rs`), and a head
//!   trained on a frozen base over the hidden states of chosen layers: its folder format
//!   (`folder.rs`) apart from its forward (`trained.rs`, `trace_probe.rs`).
//! - `checksum.rs`: a checkpoint's weights checksum, which ties a trained head to its base.
//! - `gguf.rs`, `weights.rs`: checkpoints from GGUF files and safetensors.
//! - `plan.rs` (a batch's layout of shared segments), `prefix_cache.rs` (what earlier batches
//!   computed), `spans.rs` (where a step's own tokens lie among the reads, for heads that pool
//!   over them, laid out one way for training and serving).

mod batch;
mod checksum;
mod config;
mod decoder;
mod error;
mod gguf;
mod head;
pub mod kernels;
mod layers;
mod model;
mod plan;
mod prefix_cache;
mod spans;
mod weights;

pub use batch::{Batch, Row, RowStates, Tokens};
pub use checksum::checkpoint_sha256;
pub use config::{ModelConfig, ModelConfigError};
pub use error::ModelError;
pub use gguf::{Gguf, is_gguf};
pub use head::{
    ClassifierConfig, HEAD_CONFIG, HEAD_WEIGHTS, HeadKind, HeadSpec, Pool, TraceProbe, TrainedSpec,
    average_states, head_tensors,
};
pub use kernels::Kernels;
pub use model::{CacheStats, PrmModel, Reuse, SharedBase};
pub use spans::{Span, span_reads, span_rows};
