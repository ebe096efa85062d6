//! The `cascade` evaluator: a PRM scores every step, and its judge is asked only when the PRM is
//! unsure (escalation) or, with `categorize`, to name the category of the error the PRM found.

mod audit;
mod guarantee;
mod guard;

pub use guarantee::{AgreementTarget, CalibrationItem, GuaranteedThreshold, choose};
pub use guard::Confidence;

use crate::engine::{Description, EngineError, Evaluator, Job, Loaded, NotLoaded, wrapped};
use crate::metrics;
use crate::record::{RecordConfig, RecordError, Recorder};
use crate::rule::{Refused, refuse};
use crate::trace::{DecisionPath, ErrorCategory, Judgement};
use audit::AuditConfig;
use futures::future::BoxFuture;
use guard::{CascadeGuard, GuardConfig};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// A PRM first, its judge where the PRM is unsure (or to name the category).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CascadeConfig {
    /// The `prm` evaluator it runs first.
    pub prm: String,
    /// The `judge` evaluator it escalates to.
    pub judge: String,
    /// A deciding step within this distance of the threshold (inclusive) escalates; 0.1 when
    /// unset. Not with `target_agreement`, which decides instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub escalate_margin: Option<f32>,
    /// The least agreement with the judge among the traces the PRM decides alone (1 - alpha):
    /// the PRM keeps a verdict only where its confidence clears a threshold chosen on the
    /// `calibration` rows to hold this with probability `target_confidence`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_agreement: Option<f64>,
    /// The probability that the agreement target holds (1 - delta); 0.9 when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_confidence: Option<f64>,
    /// Dataset rows with the judge's verdicts as labels (the rows `record` writes, or any file
    /// `eval` reads), scored by the PRM at load and at each swap of it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<PathBuf>,
    /// How the PRM's confidence in a verdict is read (`verdict` or `margin`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub confidence: Option<Confidence>,
    /// The share of kept traces also sent to the judge after their answer, at first; it
    /// decays as max(audit_floor, audit_rate / sqrt(t + 1)). Off when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit_rate: Option<f64>,
    /// The share the audits decay to; 0.05 (or `audit_rate`, if lower) when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit_floor: Option<f64>,
    /// Judge calls a second the audits may spend at most; 1 when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audit_per_second: Option<f64>,
    /// Ask the judge for the category of an error the PRM is sure of.
    #[serde(default)]
    pub categorize: bool,
    /// Records each trace its judge decided as a dataset row (`record = "PATH"`, or a table
    /// with `path` and limits), for `train-head` and the learning loop
    /// (scripts/learn/distill.py); off when unset. Rows hold the traces, which may hold users'
    /// data.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::record::deserialize_record"
    )]
    pub record: Option<RecordConfig>,
}

/// The default `escalate_margin`.
pub(crate) const ESCALATE_MARGIN: f32 = 0.1;
/// The default `target_confidence`.
const TARGET_CONFIDENCE: f64 = 0.9;

impl CascadeConfig {
    /// Its own rules; that `prm` and `judge` name evaluators of those kinds is the config's
    /// check, which sees every table.
    pub fn check(&self) -> Result<(), Refused> {
        if let Some(m) = self.escalate_margin
            && !(0.0..=1.0).contains(&m)
        {
            return refuse(format!("escalate_margin must lie in [0, 1], got {m}"));
        }
        self.check_guarantee()?;
        if let Some(r) = &self.record {
            r.check()?;
        }
        Ok(())
    }

    /// The guarantee's keys: all or none, each a probability strictly inside (0, 1).
    fn check_guarantee(&self) -> Result<(), Refused> {
        let Some(agreement) = self.target_agreement else {
            let set = [
                ("target_confidence", self.target_confidence.is_some()),
                ("calibration", self.calibration.is_some()),
                ("confidence", self.confidence.is_some()),
                ("audit_rate", self.audit_rate.is_some()),
                ("audit_floor", self.audit_floor.is_some()),
                ("audit_per_second", self.audit_per_second.is_some()),
            ];
            return match set.iter().find(|(_, on)| *on) {
                Some((key, _)) => refuse(format!("{key} needs target_agreement")),
                None => Ok(()),
            };
        };
        if self.escalate_margin.is_some() {
            return refuse(
                "escalate_margin and target_agreement are two ways to escalate: set one",
            );
        }
        for (key, p) in [
            ("target_agreement", Some(agreement)),
            ("target_confidence", self.target_confidence),
        ] {
            if let Some(p) = p
                && !(p > 0.0 && p < 1.0)
            {
                return refuse(format!("{key} must lie strictly between 0 and 1, got {p}"));
            }
        }
        if self.calibration.is_none() {
            return refuse(
                "target_agreement needs calibration = \"PATH\": rows labelled by the judge",
            );
        }
        match (self.audit(), self.audit_floor.or(self.audit_per_second)) {
            (Some(a), _) => a.check().or_else(refuse),
            (None, Some(_)) => refuse("audit_floor and audit_per_second need audit_rate"),
            (None, None) => Ok(()),
        }
    }

    /// The audits' settings, when `audit_rate` asks for them.
    fn audit(&self) -> Option<AuditConfig> {
        let rate = self.audit_rate?;
        let mut a = AuditConfig::of_rate(rate);
        a.floor = self.audit_floor.unwrap_or(a.floor);
        a.per_second = self.audit_per_second.unwrap_or(a.per_second);
        Some(a)
    }

    /// The guarantee's settings, when `target_agreement` asks for one.
    fn guard(&self, threshold: Option<f32>) -> Option<GuardConfig> {
        Some(GuardConfig {
            target: AgreementTarget {
                agreement: self.target_agreement?,
                confidence: self.target_confidence.unwrap_or(TARGET_CONFIDENCE),
            },
            confidence: self.confidence.unwrap_or_default(),
            rows: self.calibration.clone()?,
            threshold,
            audit: self.audit(),
        })
    }
}

/// How a cascade decides to ask its judge.
enum Escalation {
    /// A deciding step within this distance of the threshold.
    Margin(f32),
    /// A verdict whose confidence misses the calibrated threshold.
    Guaranteed(Arc<CascadeGuard>),
}

pub(crate) struct Cascade {
    name: String,
    prm: Arc<dyn Evaluator>,
    judge: Arc<dyn Evaluator>,
    prm_name: String,
    judge_name: String,
    escalation: Escalation,
    categorize: bool,
    recorder: Option<Arc<Recorder>>,
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
    // The deciding steps' least distance from the threshold: the margin reading of confidence.
    if Confidence::Margin.of(scores, first_error, threshold) <= f64::from(margin) {
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

/// Builds a cascade over evaluators loaded before it (`Engine::load` loads cascades last);
/// `threshold` is its table's. A guaranteed cascade starts scoring its calibration rows.
pub(crate) fn load(
    name: &str,
    config: &CascadeConfig,
    threshold: Option<f32>,
    loaded: &Loaded,
) -> Result<Cascade, CascadeLoadError> {
    let find = |key, wanted: &str| wrapped(loaded, key, wanted);
    let (prm, judge) = (find("prm", &config.prm)?, find("judge", &config.judge)?);
    let escalation = match config.guard(threshold) {
        Some(g) => {
            let guard = CascadeGuard::new(name, g, prm.clone());
            guard.start();
            Escalation::Guaranteed(guard)
        }
        None => Escalation::Margin(config.escalate_margin.unwrap_or(ESCALATE_MARGIN)),
    };
    let recorder = match &config.record {
        Some(r) => Some(Arc::new(Recorder::start(name, &config.judge, r)?)),
        None => None,
    };
    Ok(Cascade {
        name: name.to_string(),
        prm,
        judge,
        prm_name: config.prm.clone(),
        judge_name: config.judge.clone(),
        escalation,
        categorize: config.categorize,
        recorder,
    })
}

impl Cascade {
    fn decide(&self, verdict: &Judgement, threshold: f32) -> Decision {
        let (scores, first) = (&verdict.step_scores, verdict.first_error);
        match &self.escalation {
            Escalation::Margin(m) => decide(scores, first, threshold, *m, self.categorize),
            Escalation::Guaranteed(g) => match g.keeps(scores, first, threshold) {
                false => Decision::Escalate,
                true if self.categorize && first.is_some() => Decision::Categorize,
                true => Decision::Keep,
            },
        }
    }
}

impl Evaluator for Cascade {
    fn describe(&self) -> Description {
        let pair = format!("prm {:?} + judge {:?}", self.prm_name, self.judge_name);
        Description {
            kind: "cascade".into(),
            family: match &self.escalation {
                Escalation::Margin(_) => pair,
                Escalation::Guaranteed(g) => format!("{pair}; {}", g.summary()),
            },
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

    /// Scores its calibration rows on its PRM when that is what was swapped.
    fn after_swap(&self) {
        if let Escalation::Guaranteed(g) = &self.escalation {
            g.start();
        }
    }

    fn evaluate(&self, job: Job) -> BoxFuture<'_, Result<Judgement, EngineError>> {
        Box::pin(async move {
            let mut verdict = self.prm.evaluate(job.clone()).await?;
            let decision = self.decide(&verdict, job.threshold);
            if decision == Decision::Keep {
                metrics::record_cascade(&self.name, "prm");
                self.audit(&job, &verdict);
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
            if let Escalation::Guaranteed(g) = &self.escalation
                && g.drifted()
            {
                g.observe(verdict.step_scores.clone(), judged.first_error);
            }
            self.merge(decision, &mut verdict, judged);
            Ok(verdict)
        })
    }
}

/// How long an audit's judge call may take: it holds no caller, only a place among the
/// audits in flight.
const AUDIT_DEADLINE: Duration = Duration::from_secs(120);

impl Cascade {
    /// Sends a kept trace to the judge too, off the request's path, when the audits draw it;
    /// the judge's verdict is recorded like an escalation's and tallied against the PRM's.
    fn audit(&self, job: &Job, verdict: &Judgement) {
        let Escalation::Guaranteed(guard) = &self.escalation else {
            return;
        };
        if !guard.draw_audit() {
            return;
        }
        let (guard, judge, recorder) = (guard.clone(), self.judge.clone(), self.recorder.clone());
        let prm_first = verdict.first_error;
        let job = Job {
            deadline: Some(Instant::now() + AUDIT_DEADLINE),
            ..job.clone()
        };
        tokio::spawn(async move {
            let judged = judge.evaluate(job.clone()).await.ok();
            if let (Some(j), Some(r)) = (&judged, &recorder) {
                r.record(&job.trace, j, Some(prm_first));
            }
            guard.audited(judged.map(|j| j.first_error == prm_first));
        });
    }

    /// The judge's answer laid over the PRM's verdict: the judge's verdict where it escalated;
    /// the judge's category where it was asked for one, if the two agree on the step.
    fn merge(&self, decision: Decision, verdict: &mut Judgement, judged: Judgement) {
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
