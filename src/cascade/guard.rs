//! A cascade's guaranteed escalation: its calibration rows scored by its PRM, the confidence
//! threshold chosen on them (`guarantee.rs`) for the threshold in force, and the rows scored
//! again when the PRM is swapped. Until the rows are scored, and where no threshold passes,
//! every trace escalates: a trace is never kept without the guarantee. With audits
//! (`audit.rs`), a kept trace may be judged too, after its answer; when the audits show the
//! kept traces no longer agree at the target (drift), every trace escalates again until enough
//! of them, each judged, choose a new threshold.

use super::audit::{AuditConfig, AuditTally, Audits, Draw};
use super::guarantee::{self, AgreementTarget, CalibrationItem, GuaranteedThreshold};
use crate::dataset::{DataError, Record, read_records};
use crate::engine::{Evaluator, Job};
use crate::metrics;
use crate::segment::segment;
use crate::trace::{Trace, first_below};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::time::Instant;

/// Calibration rows scored at once: enough for the PRM's batcher to fill a batch.
const SCORING_AT_ONCE: usize = 16;
/// After a drift, traces judged before a threshold is chosen again: at least this many, and
/// at least as many as the calibration rows.
const FEWEST_AFTER_DRIFT: usize = 100;

/// How sure the PRM is of its verdict on a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Confidence {
    /// The probability of its own verdict, the steps taken as independent: for a first error
    /// at k, the product of the steps before k holding and step k failing; for none, of every
    /// step holding.
    #[default]
    Verdict,
    /// The deciding steps' least distance from the threshold (what `escalate_margin` reads).
    Margin,
}

impl Confidence {
    /// The confidence of the verdict that `scores` give at `threshold`.
    pub fn of(self, scores: &[f32], first_error: Option<usize>, threshold: f32) -> f64 {
        let deciding = first_error
            .map_or(scores.len(), |k| k + 1)
            .min(scores.len());
        match self {
            Confidence::Margin => scores[..deciding]
                .iter()
                .map(|s| f64::from((s - threshold).abs()))
                .fold(f64::INFINITY, f64::min),
            Confidence::Verdict => scores[..deciding]
                .iter()
                .enumerate()
                .map(|(i, &s)| match Some(i) == first_error {
                    true => 1.0 - f64::from(s),
                    false => f64::from(s),
                })
                .product(),
        }
    }
}

/// What the cascade asks of its guarantee, from its config.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct GuardConfig {
    pub target: AgreementTarget,
    pub confidence: Confidence,
    pub rows: PathBuf,
    /// The cascade's configured threshold, if any: what the gauges and the log report at.
    pub threshold: Option<f32>,
    /// Audits of the kept traces, if asked for.
    pub audit: Option<AuditConfig>,
}

/// The guarantee of one cascade.
pub(crate) struct CascadeGuard {
    cascade: String,
    config: GuardConfig,
    prm: Arc<dyn Evaluator>,
    state: Mutex<State>,
    audits: Option<Audits>,
}

#[derive(Default)]
struct State {
    /// The rows as the PRM scored them, and which PRM (its generation) did.
    scored: Option<(u64, Arc<Vec<ScoredRow>>)>,
    /// A scoring runs (for this generation).
    scoring: Option<u64>,
    /// The last threshold's choice: requests nearly always carry the cascade's own.
    chosen: Option<(u32, Arc<GuaranteedThreshold>)>,
    /// The audits showed drift: every trace escalates, and each judged one gathers here until
    /// there are enough to choose again.
    drifted: Option<Vec<ScoredRow>>,
}

/// One calibration row: the PRM's step scores and the judge's first error.
pub(crate) struct ScoredRow {
    scores: Vec<f32>,
    label: Option<usize>,
}

impl CascadeGuard {
    pub(crate) fn new(
        cascade: &str,
        config: GuardConfig,
        prm: Arc<dyn Evaluator>,
    ) -> Arc<CascadeGuard> {
        if let Some(a) = &config.audit {
            metrics::audits_at_zero(cascade);
            audited_gauges(cascade, config.target, AuditTally::default(), a.rate);
        }
        Arc::new(CascadeGuard {
            cascade: cascade.to_string(),
            config: config.clone(),
            prm,
            state: Mutex::default(),
            audits: config.audit.map(Audits::new),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the PRM's verdict (`scores`, `first_error` at `threshold`) is kept: its
    /// confidence clears the threshold chosen on the calibration rows for that threshold.
    /// Scores the rows (in the background) when the PRM has changed since they were scored.
    pub(crate) fn keeps(
        self: &Arc<Self>,
        scores: &[f32],
        first_error: Option<usize>,
        threshold: f32,
    ) -> bool {
        if self.lock().drifted.is_some() {
            return false;
        }
        let Some(chosen) = self.calibrated(threshold) else {
            return false;
        };
        let confidence = self.config.confidence.of(scores, first_error, threshold);
        chosen.threshold.is_some_and(|t| confidence >= t)
    }

    /// The choice at `threshold` on rows the serving PRM scored; None while they are scored.
    fn calibrated(self: &Arc<Self>, threshold: f32) -> Option<Arc<GuaranteedThreshold>> {
        let generation = self.prm.generation();
        let rows = {
            let mut state = self.lock();
            match &state.scored {
                Some((g, rows)) if *g == generation => {
                    if let Some((bits, c)) = &state.chosen
                        && *bits == threshold.to_bits()
                    {
                        return Some(c.clone());
                    }
                    rows.clone()
                }
                _ => {
                    let start = state.scoring != Some(generation);
                    state.scoring = Some(generation);
                    drop(state);
                    if start {
                        self.clone().spawn_scoring(generation);
                    }
                    return None;
                }
            }
        };
        let chosen = Arc::new(self.choose(&rows, threshold));
        self.lock().chosen = Some((threshold.to_bits(), chosen.clone()));
        Some(chosen)
    }

    /// Chooses the confidence threshold on `rows` at `threshold`, and says so.
    fn choose(&self, rows: &[ScoredRow], threshold: f32) -> GuaranteedThreshold {
        let items: Vec<CalibrationItem> = rows
            .iter()
            .map(|r| {
                let verdict = first_below(&r.scores, threshold);
                CalibrationItem {
                    confidence: self.config.confidence.of(&r.scores, verdict, threshold),
                    agrees: verdict == r.label,
                }
            })
            .collect();
        let c = guarantee::choose(&items, self.config.target);
        metrics::set_guarantee(&self.cascade, c.threshold, c.items, c.bound, c.coverage());
        match c.threshold {
            Some(t) => tracing::info!(
                cascade = %self.cascade, prm_threshold = threshold, confidence_threshold = t,
                rows = c.items, kept = c.kept, disagreements = c.disagreements, bound = c.bound,
                coverage = c.coverage(), "cascade calibrated: its PRM keeps what clears the threshold"
            ),
            None => tracing::warn!(
                cascade = %self.cascade, prm_threshold = threshold, rows = c.items,
                fewest = GuaranteedThreshold::fewest(self.config.target),
                "cascade calibration: no threshold holds the target on these rows; every trace escalates"
            ),
        }
        c
    }

    /// Starts scoring the rows on the PRM of `generation` (it may be any thread's call, a load's
    /// included, so it takes the runtime it finds; without one, the first request starts it).
    pub(crate) fn start(self: &Arc<Self>) {
        let threshold = self.threshold_in_force();
        self.calibrated(threshold);
    }

    fn spawn_scoring(self: Arc<Self>, generation: u64) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.lock().scoring = None;
            return;
        };
        metrics::set_guarantee(&self.cascade, None, 0, 1.0, 0.0);
        runtime.spawn(async move {
            let scored = self.score().await;
            let mut state = self.lock();
            if state.scoring == Some(generation) {
                state.scoring = None;
            }
            // The PRM was swapped again while these rows were scored: its own scoring runs (a
            // swap starts one), and these scores are of a PRM that no longer serves.
            if generation != self.prm.generation() {
                return;
            }
            state.chosen = None;
            state.drifted = None;
            let before = state.scored.replace((generation, Arc::new(scored)));
            drop(state);
            if before.is_some() {
                metrics::record_recalibration(&self.cascade, "swap");
            }
            if let Some(a) = &self.audits {
                a.restart();
            }
            // Report the choice at the threshold in force at once, not at the first request.
            self.calibrated(self.threshold_in_force());
        });
    }

    /// The cascade's threshold when a request sets none: its config's, else its PRM's own.
    fn threshold_in_force(&self) -> f32 {
        self.config
            .threshold
            .or_else(|| self.prm.threshold())
            .unwrap_or(crate::engine::DEFAULT_THRESHOLD)
    }

    /// The calibration rows as the PRM scores them; a row that cannot be read or scored is
    /// logged and left out (the rest still calibrate; too few of them escalate everything).
    async fn score(&self) -> Vec<ScoredRow> {
        let path = self.config.rows.clone();
        let read = tokio::task::spawn_blocking(move || read_rows(&path)).await;
        let rows = match read {
            Ok(Ok(rows)) => rows,
            Ok(Err(e)) => {
                tracing::warn!(cascade = %self.cascade, error = %e, "cannot read the calibration rows; every trace escalates");
                return Vec::new();
            }
            Err(e) => {
                tracing::warn!(cascade = %self.cascade, error = %e, "reading the calibration rows panicked");
                return Vec::new();
            }
        };
        let jobs = rows.into_iter().map(|(trace, label)| async move {
            let job = Job {
                trace: Arc::new(trace),
                threshold: crate::engine::DEFAULT_THRESHOLD,
                deadline: None,
            };
            (self.prm.evaluate(job).await, label)
        });
        let mut scored = Vec::new();
        let mut failed = 0;
        let mut results = futures::stream::iter(jobs).buffered(SCORING_AT_ONCE);
        while let Some((result, label)) = results.next().await {
            match result {
                Ok(j) if !j.step_scores.is_empty() => scored.push(ScoredRow {
                    scores: j.step_scores,
                    label,
                }),
                _ => failed += 1,
            }
        }
        if failed > 0 {
            tracing::warn!(cascade = %self.cascade, failed, "calibration rows the PRM could not score are left out");
        }
        scored
    }

    /// Whether to audit a trace just kept (drawn at the decaying share, within the budget).
    pub(crate) fn draw_audit(&self) -> bool {
        let Some(audits) = &self.audits else {
            return false;
        };
        match audits.draw(Instant::now(), fastrand::f64()) {
            Draw::Audit => true,
            Draw::NotDrawn => false,
            Draw::OverBudget => {
                metrics::record_audit(&self.cascade, "over_budget");
                false
            }
        }
    }

    /// An audit ended: `agreed` is whether the judge's first error was the PRM's, None when
    /// the judge could not answer. Audits that show the kept traces below the target (their
    /// agreement's upper bound under it) start a drift.
    pub(crate) fn audited(&self, agreed: Option<bool>) {
        let Some(audits) = &self.audits else {
            return;
        };
        let tally = audits.finish(agreed);
        let outcome = match agreed {
            Some(true) => "agreed",
            Some(false) => "disagreed",
            None => "failed",
        };
        metrics::record_audit(&self.cascade, outcome);
        let target = self.config.target;
        audited_gauges(&self.cascade, target, tally, audits.share());
        if tally.upper_bound(target.confidence) < target.agreement {
            let mut state = self.lock();
            if state.drifted.is_none() {
                state.drifted = Some(Vec::new());
                metrics::set_guarantee(&self.cascade, None, 0, 1.0, 0.0);
                tracing::warn!(
                    cascade = %self.cascade, audited = tally.audited, disagreed = tally.disagreed,
                    "audits show the kept traces below the target agreement; every trace escalates until it is calibrated again"
                );
            }
        }
    }

    /// A trace the judge decided while drifted: gathered, and once there are enough, the
    /// threshold is chosen again on them (every trace was judged, so they are the stream's).
    pub(crate) fn observe(self: &Arc<Self>, scores: Vec<f32>, label: Option<usize>) {
        let mut state = self.lock();
        let needed = state
            .scored
            .as_ref()
            .map_or(0, |(_, rows)| rows.len())
            .max(FEWEST_AFTER_DRIFT);
        let Some(gathered) = state.drifted.as_mut() else {
            return;
        };
        gathered.push(ScoredRow { scores, label });
        if gathered.len() < needed {
            return;
        }
        let rows = state.drifted.take().unwrap_or_default();
        let generation = self.prm.generation();
        state.scored = Some((generation, Arc::new(rows)));
        state.chosen = None;
        drop(state);
        if let Some(a) = &self.audits {
            a.restart();
        }
        metrics::record_recalibration(&self.cascade, "drift");
        // Chosen now (a gauge and a log line), not at the next request.
        self.calibrated(self.threshold_in_force());
    }

    /// Whether the traces it escalates are gathered to choose again.
    pub(crate) fn drifted(&self) -> bool {
        self.lock().drifted.is_some()
    }

    /// One line for ListEvaluators: the target, and what the calibration chose at the
    /// threshold in force.
    pub(crate) fn summary(&self) -> String {
        let target = self.config.target;
        let head = format!(
            "agreement >= {} with confidence {}",
            target.agreement, target.confidence
        );
        let state = self.lock();
        match &state.chosen {
            // Scoring runs (at load, or for a swapped PRM): what was chosen before is not in force.
            _ if state.scored.is_none() || state.scoring.is_some() => {
                format!("{head}: calibrating, every trace escalates")
            }
            _ if state.drifted.is_some() => {
                format!("{head}: audits showed drift, every trace escalates until recalibrated")
            }
            Some((_, c)) => match c.threshold {
                Some(t) => format!(
                    "{head}: keeps confidence >= {t:.4} ({} of {} calibration rows, bound {:.3})",
                    c.kept, c.items, c.bound
                ),
                None => format!(
                    "{head}: no threshold holds on {} calibration rows, every trace escalates",
                    c.items
                ),
            },
            None => format!("{head}: calibrated, not chosen yet"),
        }
    }
}

fn audited_gauges(cascade: &str, target: AgreementTarget, tally: AuditTally, share: f64) {
    let audited = metrics::Audited {
        target: target.agreement,
        audited: tally.audited,
        agreement: tally.agreement(),
        lower: tally.lower_bound(target.confidence),
        share,
    };
    metrics::set_audited(cascade, audited);
}

/// The calibration file's rows with their judge's labels (-1: every step holds), as traces.
fn read_rows(path: &std::path::Path) -> Result<Vec<(Trace, Option<usize>)>, DataError> {
    read_records(path)?
        .map(|r| r.map(|r| (trace_of(&r), r.label.and_then(|l| usize::try_from(l).ok()))))
        .collect()
}

/// A row as the trace a request would carry (raw text segmented as the server segments it).
fn trace_of(r: &Record) -> Trace {
    let steps: Vec<String> = match (&r.text, r.steps.is_empty()) {
        (Some(text), true) => segment(text)
            .into_iter()
            .map(|range| text[range].to_string())
            .collect(),
        _ => r.steps.clone(),
    };
    let mut trace = Trace::of_steps(&r.question, &steps);
    trace.options = r.options.clone();
    trace.reference_answer = r.reference_answer.clone();
    trace
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verdicts_confidence_is_its_probability_or_its_margin() {
        let scores = [0.9, 0.8, 0.2, 0.6];
        // First error at step 2: 0.9 * 0.8 * (1 - 0.2); step 3 does not decide.
        let p = Confidence::Verdict.of(&scores, Some(2), 0.5);
        assert!((p - 0.9 * 0.8 * 0.8).abs() < 1e-6, "{p}");
        let all = Confidence::Verdict.of(&[0.9, 0.8], None, 0.5);
        assert!((all - 0.72).abs() < 1e-6, "{all}");
        let m = Confidence::Margin.of(&scores, Some(2), 0.5);
        assert!((m - 0.3).abs() < 1e-6, "{m}");
        assert_eq!(Confidence::Margin.of(&[], None, 0.5), f64::INFINITY);
        assert_eq!(Confidence::Verdict.of(&[], None, 0.5), 1.0);
    }
}
