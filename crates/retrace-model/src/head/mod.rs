//! The scoring heads that turn a PRM's hidden states into P(step correct), in f32: the ones
//! each family's checkpoint carries, a head trained on a frozen base (`trained`), and the one
//! head that gives a raw reward instead (a sequence classifier's `score`).
//!
//! - `classifier.rs`: a sequence classifier's own config keys.
//! - `folder.rs`: a trained head's folder (file and tensor names, its spec and kind, the
//!   weights read and checked); `trained.rs`: its forward; `trace_probe.rs`: the trained head
//!   that reads a trace's steps in order.

use crate::config::ModelConfig;
use crate::decoder::Output;
use crate::error::ModelError;
use crate::layers::{Emb, rows_apart};
use crate::spans::SpanRows;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Linear, VarBuilder};

mod classifier;
mod folder;
mod trace_probe;
mod trained;

pub use classifier::ClassifierConfig;
pub use folder::{HEAD_CONFIG, HEAD_WEIGHTS, HeadKind, Pool, TrainedSpec, head_tensors};
pub use trace_probe::TraceProbe;
pub(crate) use trained::Trained;
pub use trained::average_states;

/// Which head a checkpoint carries; the family in the server config decides it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeadSpec {
    /// Qwen2.5-Math-PRM: `score.0` Linear(H,H) -> ReLU -> `score.2` Linear(H,2); softmax[1].
    QwenScore,
    /// Skywork-o1-Open-PRM: `v_head.summary` Linear(H,1); sigmoid.
    ValueHead,
    /// A causal LM read at two vocabulary ids: softmax over (logit[plus], logit[minus]), index 0.
    LmPair { plus: u32, minus: u32 },
    /// A head trained on the frozen base (a head folder's `head.safetensors`).
    Trained(TrainedSpec),
    /// No head: the model is loaded to read hidden states (`PrmModel::states`) only, as a
    /// trainer does; it cannot score.
    States,
    /// A sequence-classification reward model (`*ForSequenceClassification`, one label):
    /// `score` Linear(H,1) without bias. Its score is the raw logit, unbounded, not a probability.
    Outcome,
}

pub(crate) enum Head {
    QwenScore {
        l0: Linear,
        l2: Linear,
    },
    Value {
        summary: Linear,
    },
    /// The two LM-head rows as a Linear(H,2) without bias: the full-vocab projection is never built.
    LmPair {
        pair: Linear,
    },
    Trained(Trained),
    States,
    Outcome {
        score: Linear,
    },
}

/// What a head read at a batch's reads, in row-major read order.
pub(crate) struct Reading {
    pub(crate) scores: Vec<f32>,
    /// Per read, the category probabilities; empty without a category head.
    pub(crate) categories: Vec<Vec<f32>>,
}

impl Head {
    /// Loads the head's weights from the checkpoint root `vb`. `rows` (the same checkpoint) lets
    /// the LM pair read two rows of the output matrix without materialising the whole of it;
    /// `embed` is the decoder's input embedding, the matrix of a tied LM head.
    pub(crate) fn load(
        spec: HeadSpec,
        cfg: &ModelConfig,
        vb: VarBuilder,
        rows: &dyn Fn(&str, &[usize]) -> Result<Tensor>,
        embed: &Emb,
    ) -> std::result::Result<Self, ModelError> {
        let h = cfg.hidden_size;
        let dev = vb.device().clone();
        let dtype = vb.dtype();
        // Weights are rounded to the model dtype first (what the checkpoint runs at), then held in
        // f32 so the head's arithmetic is f32.
        let f32_linear = |l: Linear| -> Result<Linear> {
            let w = l.weight().to_dtype(DType::F32)?;
            let b = l.bias().map(|b| b.to_dtype(DType::F32)).transpose()?;
            Ok(Linear::new(w, b))
        };
        match spec {
            HeadSpec::QwenScore => Ok(Self::QwenScore {
                l0: f32_linear(candle_nn::linear(h, h, vb.pp("score").pp("0"))?)?,
                l2: f32_linear(candle_nn::linear(h, 2, vb.pp("score").pp("2"))?)?,
            }),
            HeadSpec::ValueHead => Ok(Self::Value {
                summary: f32_linear(candle_nn::linear(h, 1, vb.pp("v_head").pp("summary"))?)?,
            }),
            HeadSpec::Trained(spec) => Ok(Self::Trained(Trained::load(&spec, cfg, &dev)?)),
            HeadSpec::States => Ok(Self::States),
            HeadSpec::Outcome => Ok(Self::Outcome {
                score: f32_linear(candle_nn::linear_no_bias(h, 1, vb.pp("score"))?)?,
            }),
            HeadSpec::LmPair { plus, minus } => {
                for id in [plus, minus] {
                    if id as usize >= cfg.vocab_size {
                        return Err(candle_core::Error::Msg(format!(
                            "LM-pair token id {id} is outside the vocabulary ({})",
                            cfg.vocab_size
                        ))
                        .into());
                    }
                }
                let ids = [plus as usize, minus as usize];
                let rows = if cfg.tie_word_embeddings || !vb.contains_tensor("lm_head.weight") {
                    embed.rows(&[plus, minus])?
                } else {
                    rows("lm_head.weight", &ids)?
                        .to_dtype(dtype)?
                        .to_device(&dev)?
                };
                if rows.dims2()? != (2, h) {
                    return Err(candle_core::Error::Msg(format!(
                        "the LM head's rows are {:?}, expected (2, {h})",
                        rows.shape()
                    ))
                    .into());
                }
                Ok(Self::LmPair {
                    pair: Linear::new(rows.to_dtype(DType::F32)?, None),
                })
            }
        }
    }

    /// The layers whose states the head reads (see `Decoder::run`); none for a head that
    /// reads the final normed state, which every pass returns.
    pub(crate) fn taps(&self) -> &[usize] {
        match self {
            Self::Trained(t) => t.layers(),
            _ => &[],
        }
    }

    /// Whether the head reads each step's own tokens (a trained head pooling over spans).
    pub(crate) fn reads_spans(&self) -> bool {
        matches!(self, Self::Trained(t) if t.reads_spans())
    }

    /// The head at a pass's reads (`rows`: how many each row of the batch has): one score in
    /// [0, 1] per read, and a trained head's category probabilities. `spans`: where the
    /// steps' spans lie among the pass's reads, for a head that reads them.
    pub(crate) fn read(
        &self,
        out: &Output,
        rows: &[usize],
        spans: Option<&SpanRows>,
    ) -> Result<Reading> {
        match self {
            Self::Trained(t) => {
                let (scores, categories) = t.read(&out.taps, rows, spans)?;
                Ok(Reading { scores, categories })
            }
            Self::States => {
                candle_core::bail!("this model was loaded without a head: it cannot score")
            }
            _ => Ok(Reading {
                scores: self.scores(&out.hidden)?,
                categories: Vec::new(),
            }),
        }
    }

    /// `hidden` (N, H) in any dtype -> N scores, for the heads a checkpoint carries: in [0, 1],
    /// or raw rewards for `Outcome`.
    pub(crate) fn scores(&self, hidden: &Tensor) -> Result<Vec<f32>> {
        let x = hidden.to_dtype(DType::F32)?;
        let p = match self {
            Self::QwenScore { l0, l2 } => {
                let logits = apart(l2, &apart(l0, &x)?.relu()?)?;
                candle_nn::ops::softmax_last_dim(&logits)?.narrow(1, 1, 1)?
            }
            Self::Value { summary } => candle_nn::ops::sigmoid(&apart(summary, &x)?)?,
            Self::LmPair { pair } => {
                candle_nn::ops::softmax_last_dim(&apart(pair, &x)?)?.narrow(1, 0, 1)?
            }
            Self::Trained(_) | Self::States => candle_core::bail!("not a checkpoint's own head"),
            Self::Outcome { score } => apart(score, &x)?,
        };
        p.flatten_all()?.to_vec1::<f32>()
    }
}

/// `l` over `x`'s reads, each read's bits whatever reads share the call (`rows_apart`).
pub(crate) fn apart(l: &Linear, x: &Tensor) -> Result<Tensor> {
    rows_apart(x, l.weight().dim(0)?, |x| l.forward(x))
}

/// Rows `ids` of the 2-D tensor `name`, shape (ids.len(), cols), in the stored dtype on the CPU,
/// read straight from the mapped bytes (an LM head is 0.5-2 GB; two rows are a few KB).
pub(crate) fn matrix_rows(
    weights: &MmapedSafetensors,
    name: &str,
    ids: &[usize],
    cols: usize,
) -> Result<Tensor> {
    let view = weights.get(name)?;
    let dtype = DType::try_from(view.dtype())?;
    let shape = view.shape();
    if shape.len() != 2 || shape[1] != cols {
        candle_core::bail!("{name} has shape {shape:?}, expected (vocab, {cols})")
    }
    let row_bytes = cols * dtype.size_in_bytes();
    let mut bytes = Vec::with_capacity(ids.len() * row_bytes);
    for &id in ids {
        if id >= shape[0] {
            candle_core::bail!("row {id} is outside {name} ({} rows)", shape[0])
        }
        bytes.extend_from_slice(&view.data()[id * row_bytes..(id + 1) * row_bytes]);
    }
    Tensor::from_raw_buffer(&bytes, dtype, &[ids.len(), cols], &Device::Cpu)
}
