//! A trained head's folder format (docs/training.md), as the model reads it: the file names,
//! the tensor names of `head.safetensors`, the spec its `config.json` gives (layers, pools,
//! the step head's kind), each tensor checked for its shape as it is read, and the spec checked
//! against the base. The forward over those weights is `trained.rs`.

use super::trace_probe::TraceProbe;
use crate::config::ModelConfig;
use crate::error::ModelError;
use candle_core::{DType, Device, Tensor};
use candle_nn::Linear;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The weights file of a head folder.
pub const HEAD_WEIGHTS: &str = "head.safetensors";
/// The config file of a head folder, which errors about the spec name.
pub const HEAD_CONFIG: &str = "config.json";

/// The tensor names of a head folder's `head.safetensors`: what `retrace train-head` writes
/// and the served head reads. A linear layer `L` is the tensors `L.weight` and `L.bias`.
pub mod head_tensors {
    /// The feature standardiser: x = (f - mean) / scale.
    pub const NORM_MEAN: &str = "norm.mean";
    pub const NORM_SCALE: &str = "norm.scale";
    /// A logistic step head's one layer.
    pub const STEP: &str = "step";
    /// An MLP step head's hidden layer and its output layer (after the ReLU at index 1).
    pub const STEP_HIDDEN: &str = "step.0";
    pub const STEP_OUT: &str = "step.2";
    /// The category head's layer.
    pub const CATEGORY: &str = "category";
    /// A trace probe's layers (`TraceProbe`): the input projection, the GRU's input and
    /// state weights, and the output layer.
    pub const TRACE_INPUT: &str = "trace.input";
    pub const TRACE_GRU_IH: &str = "trace.gru_ih";
    pub const TRACE_GRU_HH: &str = "trace.gru_hh";
    pub const TRACE_OUT: &str = "trace.out";

    pub fn weight(layer: &str) -> String {
        format!("{layer}.weight")
    }

    pub fn bias(layer: &str) -> String {
        format!("{layer}.bias")
    }
}

/// What a head folder's config says of its head, as the model needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainedSpec {
    /// The head folder: the weights are its `head.safetensors`.
    pub dir: PathBuf,
    /// The feature's groups of layers: each group's states averaged, the groups' means
    /// concatenated in order (one group: the feature is its mean, `hidden_size` wide). Layer
    /// `l` < the base's layer count is the residual stream after decoder layer `l`; the layer
    /// count is after the final norm.
    pub groups: Vec<Vec<usize>>,
    /// The base's hidden size the head was trained on.
    pub hidden_size: usize,
    /// How each group is read, in group order: at the step's read position, or averaged over
    /// the step's own tokens. Empty: every group at the read.
    pub pools: Vec<Pool>,
    pub kind: HeadKind,
    /// Rows of the category head; 0 when it has none.
    pub categories: usize,
}

/// Where a group of layers is read for a step; a head folder's `pools` names it in lowercase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pool {
    /// At the step's read position.
    #[default]
    Read,
    /// The mean over the step's own tokens (`crate::spans`), which only conversation formats
    /// (`chat-lm`, `rlhflow`) mark.
    Span,
}

impl TrainedSpec {
    /// Whether some group is read over the steps' spans, so the head needs them.
    pub fn reads_spans(&self) -> bool {
        self.pools.contains(&Pool::Span)
    }
}

/// The step head's shape. In a head folder's `config.json`, `head` names it (`logistic`, `mlp`,
/// `trace`) and `mlp_hidden` or `trace_width` gives its size, each only for its own kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "KindFields", into = "KindFields")]
pub enum HeadKind {
    /// p = sigmoid(x · w + b).
    Logistic,
    /// p = sigmoid(W2 relu(W1 x + b1) + b2), W1 with `hidden` rows.
    Mlp { hidden: usize },
    /// A trace probe `width` wide over the trace's steps in order (`TraceProbe`).
    Trace { width: usize },
}

impl HeadKind {
    /// Its `head` value in `config.json`.
    pub fn name(self) -> &'static str {
        match self {
            HeadKind::Logistic => "logistic",
            HeadKind::Mlp { .. } => "mlp",
            HeadKind::Trace { .. } => "trace",
        }
    }
}

/// "logistic", "mlp 64", "trace probe 32": as a trainer's report names it.
impl std::fmt::Display for HeadKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeadKind::Logistic => f.write_str("logistic"),
            HeadKind::Mlp { hidden } => write!(f, "mlp {hidden}"),
            HeadKind::Trace { width } => write!(f, "trace probe {width}"),
        }
    }
}

/// `HeadKind` as `config.json`'s keys lay it out.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct KindFields {
    head: KindName,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mlp_hidden: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    trace_width: Option<usize>,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum KindName {
    Logistic,
    Mlp,
    Trace,
}

impl TryFrom<KindFields> for HeadKind {
    type Error = String;

    /// A size for its own kind, at least 1, and none for another: each error names its key.
    fn try_from(k: KindFields) -> Result<Self, String> {
        let only =
            |key: &str, kind: &str| Err(format!("bad `{key}`: applies only to head = \"{kind}\""));
        match (k.head, k.mlp_hidden, k.trace_width) {
            (KindName::Logistic | KindName::Trace, Some(_), _) => only("mlp_hidden", "mlp"),
            (KindName::Logistic | KindName::Mlp, _, Some(_)) => only("trace_width", "trace"),
            (KindName::Logistic, None, None) => Ok(HeadKind::Logistic),
            (KindName::Mlp, Some(hidden @ 1..), None) => Ok(HeadKind::Mlp { hidden }),
            (KindName::Mlp, _, _) => {
                Err("bad `mlp_hidden`: an mlp head needs at least 1 hidden unit".into())
            }
            (KindName::Trace, None, Some(width @ 1..)) => Ok(HeadKind::Trace { width }),
            (KindName::Trace, _, _) => {
                Err("bad `trace_width`: a trace head needs a width of at least 1".into())
            }
        }
    }
}

impl From<HeadKind> for KindFields {
    fn from(kind: HeadKind) -> Self {
        let (head, mlp_hidden, trace_width) = match kind {
            HeadKind::Logistic => (KindName::Logistic, None, None),
            HeadKind::Mlp { hidden } => (KindName::Mlp, Some(hidden), None),
            HeadKind::Trace { width } => (KindName::Trace, None, Some(width)),
        };
        KindFields {
            head,
            mlp_hidden,
            trace_width,
        }
    }
}

/// A head file's tensors, each checked for its shape as it is taken.
pub(super) struct Weights<'a> {
    pub(super) path: &'a Path,
    pub(super) tensors: HashMap<String, Tensor>,
    pub(super) dev: &'a Device,
}

impl Weights<'_> {
    pub(super) fn get(
        &self,
        name: &str,
        shape: &[usize],
        what: &str,
    ) -> Result<Tensor, ModelError> {
        let bad = |reason: String| ModelError::Head {
            path: self.path.to_path_buf(),
            reason,
        };
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| bad(format!("missing tensor {name}")))?;
        if t.dims() != shape {
            return Err(bad(format!(
                "{name} has shape {:?}, expected {shape:?} ({what})",
                t.dims()
            )));
        }
        let t = t.to_dtype(DType::F32)?;
        let values = t.flatten_all()?.to_vec1::<f32>()?;
        if values.iter().any(|v| !v.is_finite()) {
            return Err(bad(format!("{name} holds a value that is not finite")));
        }
        Ok(t.to_device(self.dev)?)
    }

    pub(super) fn linear(
        &self,
        name: &str,
        rows: usize,
        cols: usize,
        what: &str,
    ) -> Result<Linear, ModelError> {
        let w = self.get(&head_tensors::weight(name), &[rows, cols], what)?;
        let b = self.get(&head_tensors::bias(name), &[rows], what)?;
        Ok(Linear::new(w, Some(b)))
    }

    pub(super) fn trace_probe(&self, d: usize, h: usize) -> Result<TraceProbe, ModelError> {
        let what = "trace_width and the base's hidden size";
        let pair = |name: &str, rows: usize, cols: usize| -> Result<_, ModelError> {
            let w = self.get(&head_tensors::weight(name), &[rows, cols], what)?;
            Ok((w, self.get(&head_tensors::bias(name), &[rows], what)?))
        };
        let (input_w, input_b) = pair(head_tensors::TRACE_INPUT, d, h)?;
        let (gru_ih_w, gru_ih_b) = pair(head_tensors::TRACE_GRU_IH, 3 * d, d)?;
        let (gru_hh_w, gru_hh_b) = pair(head_tensors::TRACE_GRU_HH, 3 * d, d)?;
        let (out_w, out_b) = pair(head_tensors::TRACE_OUT, 1, 2 * d)?;
        Ok(TraceProbe {
            input_w,
            input_b,
            gru_ih_w,
            gru_ih_b,
            gru_hh_w,
            gru_hh_b,
            out_w,
            out_b,
        })
    }
}

/// The spec against the base: layers in range, the hidden size the head was trained on.
pub(super) fn check_spec(spec: &TrainedSpec, cfg: &ModelConfig) -> Result<(), ModelError> {
    let bad = |key: &str, reason: String| ModelError::BadConfig {
        path: spec.dir.join(HEAD_CONFIG),
        key: key.into(),
        reason,
    };
    let n = cfg.num_hidden_layers;
    if spec.groups.is_empty() || spec.groups.iter().any(Vec::is_empty) {
        return Err(bad("layers", "lists no layer".into()));
    }
    if !spec.pools.is_empty() && spec.pools.len() != spec.groups.len() {
        return Err(bad(
            "pools",
            format!(
                "names {} pools for {} groups of layers",
                spec.pools.len(),
                spec.groups.len()
            ),
        ));
    }
    if let Some(l) = spec.groups.iter().flatten().find(|&&l| l > n) {
        return Err(bad(
            "layers",
            format!(
                "layer {l} is out of range: the base has {n} decoder layers, so 0..={n} \
                 ({n} is after the final norm)"
            ),
        ));
    }
    if spec.hidden_size != cfg.hidden_size {
        return Err(bad(
            "hidden_size",
            format!(
                "is {}, but the base's hidden size is {}",
                spec.hidden_size, cfg.hidden_size
            ),
        ));
    }
    match spec.kind {
        HeadKind::Mlp { hidden: 0 } => {
            return Err(bad("mlp_hidden", "must be at least 1".into()));
        }
        HeadKind::Trace { width: 0 } => {
            return Err(bad("trace_width", "must be at least 1".into()));
        }
        _ => {}
    }
    Ok(())
}
