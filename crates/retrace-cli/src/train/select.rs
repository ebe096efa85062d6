//! How each head is fitted and scored on dev: a step head of any kind on a tap's features, the
//! threshold (the exact F1-maximising one, `calibrate`'s sweep), and the category head.

use super::data::{self, Target};
use super::fit::{self, Data, Epoch, Examples, Fitted, Loss, Params};
use super::head::{Head, Standardiser};
use crate::common::{ScoredTrace, ThresholdChoice, sweep};
use candle_core::{Result, Tensor};
use retrace::ErrorCategory;
use retrace_model::HeadKind;

/// The category head's classes, in its output order.
pub(crate) const CATEGORIES: [ErrorCategory; 4] = ErrorCategory::LABELLED;

/// Where one trace's steps sit in the feature matrix, and its gold labels.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TraceRows {
    pub(crate) split: String,
    pub(crate) label: i32,
    pub(crate) category: Option<ErrorCategory>,
    pub(crate) start: usize,
    pub(crate) len: usize,
}

/// The training traces and the dev traces, as indices into `traces`.
pub(crate) struct Problem<'a> {
    pub(crate) traces: &'a [TraceRows],
    pub(crate) train: &'a [usize],
    pub(crate) dev: &'a [usize],
}

/// A step head trained on one tap's features.
pub(crate) struct StepFit {
    pub(crate) norm: Standardiser,
    pub(crate) fitted: Fitted,
    /// The dev F1 (mean over splits, at dev's best threshold) of the kept epoch.
    pub(crate) dev_f1: f64,
}

impl TraceRows {
    fn targets(&self) -> impl Iterator<Item = Target> {
        data::targets(self.label, self.len)
    }
}

impl Problem<'_> {
    /// The feature rows of the given traces' steps.
    fn rows_of(&self, set: &[usize]) -> Vec<u32> {
        set.iter()
            .flat_map(|&i| {
                let t = &self.traces[i];
                (t.start..t.start + t.len).map(|r| r as u32)
            })
            .collect()
    }

    /// The step head's examples: trained steps of `set`'s traces, 1 correct, 0 wrong.
    fn step_examples(&self, set: &[usize]) -> Examples {
        let (mut rows, mut targets) = (Vec::new(), Vec::new());
        for &i in set {
            let t = &self.traces[i];
            for (k, target) in t.targets().enumerate() {
                let y = match target {
                    Target::Correct => 1,
                    Target::Wrong => 0,
                    Target::Untrained => continue,
                };
                rows.push((t.start + k) as u32);
                targets.push(y);
            }
        }
        Examples::balanced(rows, targets)
    }

    /// Each trace of `set` with its step scores cut from `probs` (one per feature row).
    pub(crate) fn scored(&self, set: &[usize], probs: &[f32]) -> Vec<ScoredTrace> {
        set.iter()
            .map(|&i| {
                let t = &self.traces[i];
                ScoredTrace {
                    split: t.split.clone(),
                    label: t.label,
                    scores: Some(probs[t.start..t.start + t.len].to_vec()),
                }
            })
            .collect()
    }

    /// Dev's best threshold for `probs`, and the train F1 at that threshold.
    pub(crate) fn calibrate(&self, probs: &[f32]) -> (ThresholdChoice, f64) {
        let dev = sweep(&self.scored(self.dev, probs)).best();
        let train = sweep(&self.scored(self.train, probs));
        let f1 = train.mean_f1(train.point(dev.threshold));
        (dev, f1)
    }
}

/// A held-out split scored at a threshold chosen on a few of its own traces: the "label a few
/// in your domain" path, beside dev's threshold, so calibration and ranking are told apart.
#[derive(Debug, Clone, PartialEq)]
pub struct OwnThreshold {
    pub split: String,
    /// Chosen on the split's first `OWN_TRACES` traces in file order.
    pub threshold: f32,
    /// The split's F1 at it, on its other traces (percent), and how many they are.
    pub f1: f64,
    pub traces: usize,
}

/// How many of its own traces a held-out split's threshold is chosen on.
pub(crate) const OWN_TRACES: usize = 20;

impl Problem<'_> {
    /// Each split of `set` with more than `OWN_TRACES` traces, scored by `probs` at the
    /// threshold its first `OWN_TRACES` traces choose, on the rest; splits in order of first
    /// appearance.
    pub(crate) fn own_thresholds(&self, set: &[usize], probs: &[f32]) -> Vec<OwnThreshold> {
        let mut splits: Vec<(&str, Vec<usize>)> = Vec::new();
        for &i in set {
            let name = self.traces[i].split.as_str();
            match splits.iter_mut().find(|(s, _)| *s == name) {
                Some((_, v)) => v.push(i),
                None => splits.push((name, vec![i])),
            }
        }
        splits
            .into_iter()
            .filter(|(_, v)| v.len() > OWN_TRACES)
            .map(|(split, v)| {
                let (own, rest) = v.split_at(OWN_TRACES);
                let threshold = sweep(&self.scored(own, probs)).best().threshold;
                let curve = sweep(&self.scored(rest, probs));
                OwnThreshold {
                    split: split.to_string(),
                    threshold,
                    f1: curve.mean_f1(curve.point(threshold)),
                    traces: rest.len(),
                }
            })
            .collect()
    }
}

/// The features standardised by the training traces' statistics.
pub(crate) fn standardise(p: &Problem, f: &Tensor) -> Result<(Standardiser, Tensor)> {
    let rows = Tensor::new(p.rows_of(p.train), f.device())?;
    let norm = Standardiser::fit(&f.index_select(&rows, 0)?)?;
    let x = norm.apply(f)?;
    Ok((norm, x))
}

/// Trains a step head of `kind` on features `f` (N, H).
pub(crate) fn fit_step(
    p: &Problem,
    f: &Tensor,
    kind: HeadKind,
    params: &Params,
    progress: impl FnMut(&Epoch),
) -> Result<StepFit> {
    let (norm, x) = standardise(p, f)?;
    let traces: Vec<(usize, usize)> = p.traces.iter().map(|t| (t.start, t.len)).collect();
    let head = Head::step(kind, f.dim(1)?, params.seed, f.device(), &traces)?;
    let evaluate = |logits: &Tensor| -> Result<(f64, f64)> {
        let probs = candle_nn::ops::sigmoid(logits)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let (dev, train_f1) = p.calibrate(&probs);
        Ok((train_f1, dev.f1))
    };
    let data = Data {
        x: &x,
        train: &p.step_examples(p.train),
        dev: &p.step_examples(p.dev),
        loss: Loss::Binary,
    };
    let fitted = fit::fit(head, &data, params, evaluate, progress)?;
    let dev_f1 = fitted.history[fitted.best].dev;
    Ok(StepFit {
        norm,
        fitted,
        dev_f1,
    })
}

/// The category examples of `set`: the first wrong step of each trace with a category, as that
/// category, and the correct steps of traces with a category, as `none`.
fn category_examples(p: &Problem, set: &[usize]) -> Examples {
    let (mut rows, mut targets) = (Vec::new(), Vec::new());
    for &i in set {
        let t = &p.traces[i];
        let Some(gold) = t.category else { continue };
        for (k, target) in t.targets().enumerate() {
            let class = match target {
                Target::Correct => ErrorCategory::None,
                Target::Wrong => gold,
                Target::Untrained => continue,
            };
            rows.push((t.start + k) as u32);
            targets.push(class_index(class));
        }
    }
    Examples::balanced(rows, targets)
}

fn class_index(c: ErrorCategory) -> u32 {
    CATEGORIES.iter().position(|&x| x == c).unwrap_or(0) as u32
}

/// Mean recall over the classes present (balanced accuracy), percent.
fn balanced_accuracy(pred: &[u32], ex: &Examples) -> f64 {
    let mut hit = [0usize; 4];
    let mut all = [0usize; 4];
    for (k, &row) in ex.rows.iter().enumerate() {
        let t = ex.targets[k] as usize;
        all[t] += 1;
        hit[t] += usize::from(pred[row as usize] as usize == t);
    }
    let recalls: Vec<f64> = (0..4)
        .filter(|&c| all[c] > 0)
        .map(|c| hit[c] as f64 / all[c] as f64)
        .collect();
    100.0 * recalls.iter().sum::<f64>() / recalls.len().max(1) as f64
}

/// How many categories the training traces teach (the category head needs two).
pub(crate) fn category_classes(p: &Problem) -> usize {
    let train = category_examples(p, p.train);
    let classes: std::collections::BTreeSet<_> = train.targets.iter().collect();
    classes.len()
}

/// Trains the category head on standardised features `x`, when the training traces carry
/// at least two categories; early stopping on dev's balanced accuracy.
pub(crate) fn fit_category(
    p: &Problem,
    x: &Tensor,
    params: &Params,
    progress: impl FnMut(&Epoch),
) -> Result<Option<Fitted>> {
    if category_classes(p) < 2 {
        return Ok(None);
    }
    let train = category_examples(p, p.train);
    let dev = category_examples(p, p.dev);
    let head = Head::category(CATEGORIES.len(), x.dim(1)?, x.device())?;
    let evaluate = |logits: &Tensor| -> Result<(f64, f64)> {
        let pred = logits.argmax(1)?.to_vec1::<u32>()?;
        let on_dev = if dev.len() == 0 {
            0.0
        } else {
            balanced_accuracy(&pred, &dev)
        };
        Ok((balanced_accuracy(&pred, &train), on_dev))
    };
    let data = Data {
        x,
        train: &train,
        dev: &dev,
        loss: Loss::Softmax,
    };
    let fitted = fit::fit(head, &data, params, evaluate, progress)?;
    Ok(Some(fitted))
}

/// The category a server names at each row, were it a first error: the most probable one
/// other than `none` (the step head, not this one, decides that a step is wrong).
pub(crate) fn categories_at(head: &Head, x: &Tensor) -> Result<Vec<ErrorCategory>> {
    Ok(head
        .logits(x)?
        .narrow(1, 1, CATEGORIES.len() - 1)?
        .argmax(1)?
        .to_vec1::<u32>()?
        .into_iter()
        .map(|i| CATEGORIES[i as usize + 1])
        .collect())
}
