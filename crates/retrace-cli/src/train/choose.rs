//! The decisions dev makes, in order: the tap (a logistic head on each candidate, the best dev
//! F1 wins), the head kind (an MLP, then a trace probe, on the winning tap, each kept only when
//! its dev F1 beats the head kept so far by the margin), the threshold, and the category head.

use super::fit::{Fitted, Params};
use super::head::{Head, Standardiser};
use super::progress::Progress;
use super::select::{Problem, StepFit, categories_at, category_classes, fit_category, fit_step};
use super::taps::Tap;
use crate::common::{Curve, ThresholdChoice, sweep};
use candle_core::{Result, Tensor};
use retrace::ErrorCategory;
use retrace_model::HeadKind;

/// One candidate tap's features: a row per step of every trace, in trace order.
pub(crate) struct Candidate {
    pub(crate) tap: Tap,
    pub(crate) rows: Tensor,
}

/// What to try.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Settings {
    pub(crate) params: Params,
    /// The MLP's hidden width; 0: no MLP is tried.
    pub(crate) mlp_hidden: usize,
    /// The trace probe's width; 0: none is tried.
    pub(crate) trace_width: usize,
    /// F1 points by which a larger head must beat the head kept so far on dev to be kept.
    pub(crate) margin: f64,
    /// The step head to keep whatever dev says; `None`: dev decides.
    pub(crate) force: Option<Force>,
}

/// A step head kind named on the command line (`--head`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Force {
    Logistic,
    Mlp,
    Trace,
}

/// Everything decided, with what it was decided on.
pub(crate) struct Outcome {
    /// A logistic head per candidate tap, in the order given.
    pub(crate) taps: Vec<(Tap, StepFit)>,
    pub(crate) winner: usize,
    /// The larger heads tried on the winning tap, in order: the MLP, the trace probe.
    pub(crate) larger: Vec<StepFit>,
    /// The head kept: `None` the winning tap's logistic head, `Some(i)` `larger[i]`.
    pub(crate) kept: Option<usize>,
    /// Dev's threshold curve for the kept head, and its best point.
    pub(crate) curve: Curve,
    pub(crate) threshold: ThresholdChoice,
    /// The kept head's P(correct) at every feature row, as a server computes it.
    pub(crate) probs: Vec<f32>,
    pub(crate) category: Option<Fitted>,
    /// The category head's choice at every feature row.
    pub(crate) categories: Option<Vec<ErrorCategory>>,
}

impl Outcome {
    /// The step head kept.
    pub(crate) fn step(&self) -> &StepFit {
        match self.kept {
            Some(i) => &self.larger[i],
            None => &self.taps[self.winner].1,
        }
    }

    pub(crate) fn kind(&self) -> HeadKind {
        self.step().fitted.head.kind
    }

    pub(crate) fn tap(&self) -> &Tap {
        &self.taps[self.winner].0
    }

    pub(crate) fn norm(&self) -> &Standardiser {
        &self.step().norm
    }

    pub(crate) fn head(&self) -> &Head {
        &self.step().fitted.head
    }
}

/// The index of the highest `f1`, the first among equals.
fn best_of(f1: impl Iterator<Item = f64>) -> usize {
    let mut best: Option<(usize, f64)> = None;
    for (i, v) in f1.enumerate() {
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map_or(0, |(i, _)| i)
}

/// Trains and decides; `progress` shows a bar per head.
pub(crate) fn decide(
    p: &Problem,
    candidates: &[Candidate],
    s: &Settings,
    progress: &Progress,
) -> Result<Outcome> {
    let epochs = s.params.epochs;
    let mut taps = Vec::new();
    for c in candidates {
        let bar = progress.training(&format!("logistic, tap {}", c.tap.name), epochs);
        let fit = fit_step(p, &c.rows, HeadKind::Logistic, &s.params, |e| bar.epoch(e))?;
        taps.push((c.tap.clone(), fit));
    }
    let winner = best_of(taps.iter().map(|(_, f)| f.dev_f1));
    let f = &candidates[winner].rows;
    let mut larger = Vec::new();
    let tries = |force: Force| s.force.is_none() || s.force == Some(force);
    let mut kinds = Vec::new();
    if s.mlp_hidden > 0 && tries(Force::Mlp) {
        kinds.push(HeadKind::Mlp {
            hidden: s.mlp_hidden,
        });
    }
    if s.trace_width > 0 && tries(Force::Trace) {
        kinds.push(HeadKind::Trace {
            width: s.trace_width,
        });
    }
    for kind in kinds {
        let what = format!("{}, tap {}", kind, taps[winner].0.name);
        let bar = progress.training(&what, epochs);
        larger.push(fit_step(p, f, kind, &s.params, |e| bar.epoch(e))?);
    }
    let kept = match s.force {
        Some(Force::Logistic) => None,
        Some(_) => (!larger.is_empty()).then_some(0),
        None => {
            let mut kept: Option<usize> = None;
            let mut best = taps[winner].1.dev_f1;
            for (i, l) in larger.iter().enumerate() {
                if l.dev_f1 > best + s.margin {
                    (kept, best) = (Some(i), l.dev_f1);
                }
            }
            kept
        }
    };
    let mut out = Outcome {
        taps,
        winner,
        larger,
        kept,
        curve: sweep(&[]),
        threshold: sweep(&[]).best(),
        probs: Vec::new(),
        category: None,
        categories: None,
    };
    out.probs = out.head().step_probs(out.norm(), f)?;
    out.curve = sweep(&p.scored(p.dev, &out.probs));
    out.threshold = out.curve.best();
    if category_classes(p) >= 2 {
        let x = out.norm().apply(f)?;
        let bar = progress.training("category head", epochs);
        out.category = fit_category(p, &x, &s.params, |e| bar.epoch(e))?;
        if let Some(c) = &out.category {
            out.categories = Some(categories_at(&c.head, &x)?);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_of_equals_wins() {
        assert_eq!(best_of([70.0, 72.0, 72.0, 10.0].into_iter()), 1);
        assert_eq!(best_of(std::iter::empty()), 0);
    }
}
