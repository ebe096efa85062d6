//! The `cascade` evaluator: a PRM scores every step, and its judge is asked only when the PRM is
//! unsure (escalation) or, with `categorize`, to name the category of the error the PRM found.

use crate::engine::{Description, EngineError, Evaluator, Job, Loaded, NotLoaded, wrapped};
use crate::metrics;
use crate::record::{RecordConfig, RecordError, Recorder};
use crate::rule::{Refused, refuse};
use crate::trace::{DecisionPath, ErrorCategory, Judgement};
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// A PRM first, its judge where the PRM is unsure (or to name the category).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CascadeConfig {
    /// The `prm` evaluator it runs first.
    pub prm: String,
    /// The `judge` evaluator it escalates to.
    pub judge: String,
    /// A deciding step within this distance of the threshold (inclusive) escalates.
    #[serde(default = "default_margin")]
    pub escalate_margin: f32,
    /// Ask the judge for the category of an error the PRM is sure of.
    #[serde(default)]
    pub categorize: bool,
    /// Records each trace its judge decided as a dataset row (`record = "PATH"`, or a table
    /// with `path` and limits), for `train-head` and `retrace distill`; off when unset. Rows
    /// hold the traces, which may hold users' data.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::record::deserialize_record"
    )]
    pub record: Option<RecordConfig>,
}

/// The default `escalate_margin`.
pub(crate) const ESCALATE_MARGIN: f32 = 0.1;

fn default_margin() -> f32 {
    ESCALATE_MARGIN
}

impl CascadeConfig {
    /// Its own rules; that `prm` and `judge` name evaluators of those kinds is the config's
    /// check, which sees every table.
    pub fn check(&self) -> Result<(), Refused> {
        if !(0.0..=1.0).contains(&self.escalate_margin) {
            return refuse(format!(
                "escalate_margin must lie in [0, 1], got {}",
                self.escalate_margin
            ));
        }
        if let Some(r) = &self.record {
            r.check()?;
        }
        Ok(())
    }
}

pub(crate) struct Cascade {
    name: String,
    prm: Arc<dyn Evaluator>,
    judge: Arc<dyn Evaluator>,
    prm_name: String,
    judge_name: String,
    margin: f32,
    categorize: bool,
    recorder: Option<Recorder>,
}

/// What the cascade does with one PRM judgement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// The PRM is sure: its verdict stands.
    Keep,
    /// A step that decides the verdict scored within the margin of the threshold.
    Escalate,
    /// The PRM is sure of an error; the judge names its category.
    Categorize,
}

/// Only steps up to and including the PRM's first error decide the verdict; an unsure score
/// after it can't move the index, so it never costs a judge call.
pub(crate) fn decide(
    scores: &[f32],
    first_error: Option<usize>,
    threshold: f32,
    margin: f32,
    categorize: bool,
) -> Decision {
    let deciding = first_error
        .map_or(scores.len(), |k| k + 1)
        .min(scores.len());
    if scores[..deciding]
        .iter()
        .any(|s| (s - threshold).abs() <= margin)
    {
        Decision::Escalate
    } else if categorize && first_error.is_some() {
        Decision::Categorize
    } else {
        Decision::Keep
    }
}

/// Why a cascade could not be built.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CascadeLoadError {
    #[error(transparent)]
    NotLoaded(#[from] NotLoaded),
    #[error(transparent)]
    Record(#[from] RecordError),
}

/// Builds a cascade over evaluators loaded before it (`Engine::load` loads cascades last).
pub(crate) fn load(
    name: &str,
    config: &CascadeConfig,
    loaded: &Loaded,
) -> Result<Cascade, CascadeLoadError> {
    let find = |key, wanted: &str| wrapped(loaded, key, wanted);
    let (prm, judge) = (find("prm", &config.prm)?, find("judge", &config.judge)?);
    let recorder = match &config.record {
        Some(r) => Some(Recorder::start(name, &config.judge, r)?),
        None => None,
    };
    Ok(Cascade {
        name: name.to_string(),
        prm,
        judge,
        prm_name: config.prm.clone(),
        judge_name: config.judge.clone(),
        margin: config.escalate_margin,
        categorize: config.categorize,
        recorder,
    })
}

impl Evaluator for Cascade {
    fn describe(&self) -> Description {
        Description {
            kind: "cascade".into(),
            family: format!("prm {:?} + judge {:?}", self.prm_name, self.judge_name),
            model: format!(
                "{} -> {}",
                self.prm.describe().model,
                self.judge.describe().model
            ),
        }
    }

    fn ready(&self) -> bool {
        self.prm.ready() && self.judge.ready()
    }

    fn why_not_ready(&self) -> Option<String> {
        self.prm
            .why_not_ready()
            .or_else(|| self.judge.why_not_ready())
    }

    /// Its PRM's own (a trained head's), since the threshold applies to the PRM's scores.
    fn threshold(&self) -> Option<f32> {
        self.prm.threshold()
    }

    fn evaluate(&self, job: Job) -> BoxFuture<'_, Result<Judgement, EngineError>> {
        Box::pin(async move {
            let mut verdict = self.prm.evaluate(job.clone()).await?;
            let decision = decide(
                &verdict.step_scores,
                verdict.first_error,
                job.threshold,
                self.margin,
                self.categorize,
            );
            if decision == Decision::Keep {
                metrics::record_cascade(&self.name, "prm");
                return Ok(verdict);
            }
            let judged = match self.judge.evaluate(job.clone()).await {
                Ok(j) => j,
                // The PRM's verdict is still an answer: a judge outage degrades the cascade to
                // its PRM instead of failing every request. The rationale and path say so.
                Err(e) => {
                    tracing::warn!(cascade = %self.name, error = %e, "judge failed; answering with the PRM's verdict");
                    metrics::record_cascade(&self.name, "judge_failed");
                    verdict.rationale = Some(format!("judge unavailable, PRM verdict kept: {e}"));
                    return Ok(verdict);
                }
            };
            verdict.inference += judged.inference;
            if let Some(r) = &self.recorder {
                r.record(&job.trace, &judged, Some(verdict.first_error));
            }
            match decision {
                Decision::Escalate => {
                    verdict.first_error = judged.first_error;
                    verdict.category = judged.category;
                    verdict.path = DecisionPath::Escalated;
                    verdict.rationale = judged.rationale;
                    verdict.agreement = judged.agreement;
                    metrics::record_cascade(&self.name, "escalated");
                }
                _ => {
                    // The judge's category describes the step it found first; it names the PRM's
                    // error only when the two agree on which step that is.
                    if judged.first_error == verdict.first_error {
                        verdict.category = judged.category;
                        verdict.rationale = judged.rationale;
                        // The judge's votes for its index are votes for the PRM's.
                        verdict.agreement = judged.agreement;
                    } else {
                        verdict.category = ErrorCategory::Unspecified;
                        verdict.rationale = Some(format!(
                            "the judge put the earliest error at step {}, not the PRM's; no category",
                            judged.first_error.map_or(-1, |k| k as i64)
                        ));
                    }
                    verdict.path = DecisionPath::Categorized;
                    metrics::record_cascade(&self.name, "categorized");
                }
            }
            Ok(verdict)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escalates_only_on_deciding_steps_near_the_threshold() {
        let d = |scores: &[f32], first: Option<usize>, cat| decide(scores, first, 0.5, 0.1, cat);
        assert_eq!(d(&[0.9, 0.8, 0.95], None, false), Decision::Keep);
        assert_eq!(d(&[0.9, 0.55, 0.95], None, false), Decision::Escalate);
        assert_eq!(d(&[0.9, 0.45, 0.95], Some(1), false), Decision::Escalate);
        // After the first error nothing is deciding, however unsure.
        assert_eq!(d(&[0.9, 0.1, 0.5], Some(1), false), Decision::Keep);
        assert_eq!(d(&[0.9, 0.1, 0.5], Some(1), true), Decision::Categorize);
        assert_eq!(d(&[0.9, 0.8], None, true), Decision::Keep);
        // The margin is inclusive; a zero margin escalates only an exact tie.
        assert_eq!(
            decide(&[0.625], None, 0.5, 0.125, false),
            Decision::Escalate
        );
        assert_eq!(decide(&[0.625], None, 0.5, 0.0, false), Decision::Keep);
    }
}
