//! The forward of a PRM head trained on a frozen base (its folder is `folder.rs`): at each
//! read, the mean of some layers' hidden states (or several such means, concatenated),
//! standardised, through a logistic or one-hidden-layer MLP step head or a trace probe over
//! the trace's steps in order, and an optional category head on the same features.

use super::apart;
use super::folder::{HEAD_WEIGHTS, HeadKind, Pool, TrainedSpec, Weights, check_spec, head_tensors};
use super::trace_probe::TraceProbe;
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::spans::SpanRows;
use candle_core::{DType, Device, Tensor};
use candle_nn::Linear;

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
            HeadKind::Logistic => Step::Logistic(w.linear(head_tensors::STEP, 1, h, base)?),
            HeadKind::Mlp { hidden } => Step::Mlp {
                l0: w.linear(
                    head_tensors::STEP_HIDDEN,
                    hidden,
                    h,
                    "mlp_hidden by the feature's width",
                )?,
                l2: w.linear(head_tensors::STEP_OUT, 1, hidden, "mlp_hidden")?,
            },
            HeadKind::Trace { width } => Step::Trace(w.trace_probe(width, h)?),
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
            Step::Logistic(l) => apart(l, &x)?,
            Step::Mlp { l0, l2 } => apart(l2, &apart(l0, &x)?.relu()?)?,
            Step::Trace(probe) => per_row(probe, &x, rows)?,
        };
        let scores = candle_nn::ops::sigmoid(&z)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let categories = match &self.category {
            Some(c) => candle_nn::ops::softmax_last_dim(&apart(c, &x)?)?.to_vec2::<f32>()?,
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
