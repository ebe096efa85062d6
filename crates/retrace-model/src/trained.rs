//! A PRM head trained on a frozen base (a head folder's `head.safetensors`, docs/training.md):
//! at each read, the mean of some layers' hidden states (or several such means, concatenated),
//! standardised, through a logistic or
//! one-hidden-layer MLP step head or a trace probe over the trace's steps in order, and an
//! optional category head on the same features.

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::spans::SpanRows;
use crate::trace_probe::TraceProbe;
use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Linear;
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
    pub kind: TrainedKind,
    /// Rows of the category head; 0 when it has none.
    pub categories: usize,
}

/// Where a group of layers is read for a step; a head folder's `pools` names it in lowercase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
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

/// The step head's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrainedKind {
    /// p = sigmoid(x · w + b).
    Logistic,
    /// p = sigmoid(W2 relu(W1 x + b1) + b2), W1 with `hidden` rows.
    Mlp { hidden: usize },
    /// A trace probe `width` wide over the trace's steps in order (`TraceProbe`).
    Trace { width: usize },
}

pub(crate) struct Trained {
    /// Every layer the groups name, once, in the order first named: what the decoder taps.
    layers: Vec<usize>,
    /// Each group as indices into `layers`.
    groups: Vec<Vec<usize>>,
    /// Each group's pool, in group order.
    pools: Vec<Pool>,
    /// (1, D) each, D = H x groups: x = (f - mean) / scale.
    mean: Tensor,
    scale: Tensor,
    step: Step,
    category: Option<Linear>,
}

enum Step {
    Logistic(Linear),
    Mlp { l0: Linear, l2: Linear },
    Trace(TraceProbe),
}

/// A head file's tensors, each checked for its shape as it is taken.
struct Weights<'a> {
    path: &'a Path,
    tensors: HashMap<String, Tensor>,
    dev: &'a Device,
}

impl Weights<'_> {
    fn get(&self, name: &str, shape: &[usize], what: &str) -> Result<Tensor, ModelError> {
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

    fn linear(
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

    fn trace_probe(&self, d: usize, h: usize) -> Result<TraceProbe, ModelError> {
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

impl Trained {
    /// Loads `spec`'s weights for a base configured as `cfg`, onto `dev`.
    pub(crate) fn load(
        spec: &TrainedSpec,
        cfg: &ModelConfig,
        dev: &Device,
    ) -> Result<Self, ModelError> {
        check_spec(spec, cfg)?;
        let path = spec.dir.join(HEAD_WEIGHTS);
        if !path.is_file() {
            return Err(ModelError::MissingFile(path));
        }
        let tensors =
            candle_core::safetensors::load(&path, &Device::Cpu).map_err(|e| ModelError::Head {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        let w = Weights {
            path: &path,
            tensors,
            dev,
        };
        // The feature's width: one hidden state per group.
        let h = spec.hidden_size * spec.groups.len();
        let base = "the base's hidden size by the layer groups";
        let mean = w
            .get(head_tensors::NORM_MEAN, &[h], base)?
            .reshape((1, h))?;
        let scale = w.get(head_tensors::NORM_SCALE, &[h], base)?;
        if scale.flatten_all()?.to_vec1::<f32>()?.contains(&0.0) {
            return Err(ModelError::Head {
                path: path.clone(),
                reason: "norm.scale holds a zero: the features cannot be standardised".into(),
            });
        }
        let step = match spec.kind {
            TrainedKind::Logistic => Step::Logistic(w.linear(head_tensors::STEP, 1, h, base)?),
            TrainedKind::Mlp { hidden } => Step::Mlp {
                l0: w.linear(
                    head_tensors::STEP_HIDDEN,
                    hidden,
                    h,
                    "mlp_hidden by the feature's width",
                )?,
                l2: w.linear(head_tensors::STEP_OUT, 1, hidden, "mlp_hidden")?,
            },
            TrainedKind::Trace { width } => Step::Trace(w.trace_probe(width, h)?),
        };
        let category = match spec.categories {
            0 => None,
            k => Some(w.linear(
                head_tensors::CATEGORY,
                k,
                h,
                "the categories by the feature's width",
            )?),
        };
        let (layers, groups) = tapped(&spec.groups);
        let pools = match spec.pools.as_slice() {
            [] => vec![Pool::Read; groups.len()],
            p => p.to_vec(),
        };
        Ok(Self {
            layers,
            groups,
            pools,
            mean,
            scale: scale.reshape((1, h))?,
            step,
            category,
        })
    }

    pub(crate) fn layers(&self) -> &[usize] {
        &self.layers
    }

    pub(crate) fn reads_spans(&self) -> bool {
        self.pools.contains(&Pool::Span)
    }

    /// The head over the tapped layers' states (`taps`, (reads, H) each, in `layers` order;
    /// `rows`: how many reads each row of the batch has, row after row): each read's score, and
    /// its category probabilities (none without a category head). With `spans`, the taps'
    /// rows are laid out by `crate::spans::span_reads` and `spans` says where.
    pub(crate) fn read(
        &self,
        taps: &[Tensor],
        rows: &[usize],
        spans: Option<&SpanRows>,
    ) -> candle_core::Result<(Vec<f32>, Vec<Vec<f32>>)> {
        let x = self
            .feature(taps, spans)?
            .broadcast_sub(&self.mean)?
            .broadcast_div(&self.scale)?;
        let z = match &self.step {
            Step::Logistic(l) => l.forward(&x)?,
            Step::Mlp { l0, l2 } => l2.forward(&l0.forward(&x)?.relu()?)?,
            Step::Trace(probe) => per_row(probe, &x, rows)?,
        };
        let scores = candle_nn::ops::sigmoid(&z)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let categories = match &self.category {
            Some(c) => candle_nn::ops::softmax_last_dim(&c.forward(&x)?)?.to_vec2::<f32>()?,
            None => Vec::new(),
        };
        Ok((scores, categories))
    }
}

impl Trained {
    /// The feature at each read: each group's mean (at the read, or over the step's span),
    /// concatenated in group order.
    fn feature(&self, taps: &[Tensor], spans: Option<&SpanRows>) -> candle_core::Result<Tensor> {
        if spans.is_none() && self.reads_spans() {
            candle_core::bail!("this head reads each step's own tokens; its format marks none")
        }
        // With spans, the reads' own rows among the taps', once for every group read there.
        let reads = spans
            .map(|s| Tensor::new(s.reads.as_slice(), &taps_device(taps)?))
            .transpose()?;
        let means = self
            .groups
            .iter()
            .zip(&self.pools)
            .map(|(g, pool)| {
                let states = g
                    .iter()
                    .map(|&i| taps.get(i).cloned())
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| candle_core::Error::Msg("a tapped layer is missing".into()))?;
                let mean = average(&states)?;
                match (spans, &reads, pool) {
                    (Some(s), _, Pool::Span) => span_means(&mean, s),
                    (_, Some(idx), Pool::Read) => mean.index_select(idx, 0),
                    _ => Ok(mean),
                }
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        match means.as_slice() {
            [one] => Ok(one.clone()),
            _ => Tensor::cat(&means, 1),
        }
    }
}

/// The layers `groups` name, each once in the order first named, and each group as indices
/// into them.
fn tapped(groups: &[Vec<usize>]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let mut layers: Vec<usize> = Vec::new();
    let index = groups
        .iter()
        .map(|g| {
            g.iter()
                .map(|&l| match layers.iter().position(|&x| x == l) {
                    Some(i) => i,
                    None => {
                        layers.push(l);
                        layers.len() - 1
                    }
                })
                .collect()
        })
        .collect();
    (layers, index)
}

/// A trace probe over each row's reads on their own, so a row's scores do not depend on the
/// rows batched with it.
fn per_row(probe: &TraceProbe, x: &Tensor, rows: &[usize]) -> candle_core::Result<Tensor> {
    let mut start = 0;
    let mut out = Vec::with_capacity(rows.len());
    for &len in rows.iter().filter(|&&l| l > 0) {
        out.push(probe.logits(&x.narrow(0, start, len)?, &[(0, len)])?);
        start += len;
    }
    if start != x.dim(0)? {
        candle_core::bail!("{} reads, but the rows name {start}", x.dim(0)?)
    }
    Tensor::cat(&out, 0)
}

/// The device the tapped states are on.
fn taps_device(taps: &[Tensor]) -> candle_core::Result<Device> {
    taps.first()
        .map(|t| t.device().clone())
        .ok_or_else(|| candle_core::Error::Msg("a trained head taps no layer".into()))
}

/// Each span's rows of `x` averaged (summed in order, then divided by their count, as
/// `average_states` does), (spans, H).
fn span_means(x: &Tensor, rows: &SpanRows) -> candle_core::Result<Tensor> {
    let means = rows
        .spans
        .iter()
        .map(|s| x.narrow(0, s.start, s.len())?.sum_keepdim(0)? / s.len() as f64)
        .collect::<candle_core::Result<Vec<_>>>()?;
    Tensor::cat(&means, 0)
}

/// The feature: the layers' states summed in f32 in order, then divided by their count.
fn average(taps: &[Tensor]) -> candle_core::Result<Tensor> {
    let (first, rest) = taps
        .split_first()
        .ok_or_else(|| candle_core::Error::Msg("a trained head taps no layer".into()))?;
    let mut sum = first.to_dtype(DType::F32)?;
    for t in rest {
        sum = (sum + t.to_dtype(DType::F32)?)?;
    }
    sum / taps.len() as f64
}

/// The feature of one read from its layers' states (the same arithmetic as the served head's):
/// what a trainer computes from `PrmModel::states`.
pub fn average_states(states: &[&[f32]]) -> Vec<f32> {
    let Some((first, rest)) = states.split_first() else {
        return Vec::new();
    };
    let mut sum = first.to_vec();
    for s in rest {
        for (a, b) in sum.iter_mut().zip(s.iter()) {
            *a += b;
        }
    }
    // candle divides a tensor by a scalar as a multiply by its inverse.
    let inv = (1.0 / states.len() as f64) as f32;
    sum.iter().map(|v| v * inv).collect()
}

/// The spec against the base: layers in range, the hidden size the head was trained on.
fn check_spec(spec: &TrainedSpec, cfg: &ModelConfig) -> Result<(), ModelError> {
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
        TrainedKind::Mlp { hidden: 0 } => {
            return Err(bad("mlp_hidden", "must be at least 1".into()));
        }
        TrainedKind::Trace { width: 0 } => {
            return Err(bad("trace_width", "must be at least 1".into()));
        }
        _ => {}
    }
    Ok(())
}
