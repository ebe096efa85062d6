//! The cascade's metrics and those of the loop that learns from its judge: decisions by path,
//! verdicts recorded, and evaluators reloaded.

use metrics::{counter, describe_counter, describe_gauge, gauge};

pub(crate) const CASCADE_PATHS: &str = "retrace_cascade_total";
pub(crate) const RECORDED: &str = "retrace_recorded_total";
pub(crate) const RELOADS: &str = "retrace_reloads_total";
pub(crate) const HEAD_INFO: &str = "retrace_head_info";
pub(crate) const GUARANTEED: &str = "retrace_cascade_guaranteed";
pub(crate) const CONFIDENCE_THRESHOLD: &str = "retrace_cascade_confidence_threshold";
pub(crate) const CALIBRATION_ROWS: &str = "retrace_cascade_calibration_rows";
pub(crate) const DISAGREEMENT_BOUND: &str = "retrace_cascade_disagreement_bound";
pub(crate) const EXPECTED_COVERAGE: &str = "retrace_cascade_expected_coverage";
pub(crate) const AUDITS: &str = "retrace_cascade_audits_total";
pub(crate) const AUDITED_AGREEMENT: &str = "retrace_cascade_audited_agreement";
pub(crate) const AUDITED_AGREEMENT_LOWER: &str = "retrace_cascade_audited_agreement_lower";
pub(crate) const AUDIT_SHARE: &str = "retrace_cascade_audit_share";
pub(crate) const AUDITED: &str = "retrace_cascade_audited";
pub(crate) const TARGET_AGREEMENT: &str = "retrace_cascade_target_agreement";
pub(crate) const RECALIBRATIONS: &str = "retrace_cascade_recalibrations_total";

/// `retrace_cascade_audits_total`'s outcomes.
const AUDIT_OUTCOMES: [&str; 4] = ["agreed", "disagreed", "failed", "over_budget"];

/// `retrace_recorded_total`'s outcomes.
pub(crate) const RECORDED_OUTCOMES: [&str; 3] = ["written", "dropped", "failed"];

pub(super) fn describe() {
    describe_counter!(
        CASCADE_PATHS,
        "Cascade decisions, by cascade and path (prm, escalated, categorized)."
    );
    describe_counter!(
        RECORDED,
        "Judged traces recorded as dataset rows, by evaluator and outcome (written; dropped: the \
         writer's queue was full; failed: the file could not be written)."
    );
    describe_counter!(
        RELOADS,
        "Evaluator reloads, by evaluator and outcome (swapped; refused: the new model failed to \
         load and the old one serves on)."
    );
    describe_gauge!(
        GUARANTEED,
        "1 while a cascade with target_agreement keeps the PRM verdicts whose confidence clears \
         its calibrated threshold; 0 while it escalates every trace (calibrating, too few \
         calibration rows, or no threshold passed)."
    );
    describe_gauge!(
        CONFIDENCE_THRESHOLD,
        "The confidence a cascade's PRM verdict needs to be kept, chosen on its calibration rows."
    );
    describe_gauge!(
        CALIBRATION_ROWS,
        "The calibration rows a cascade's threshold was chosen on."
    );
    describe_gauge!(
        DISAGREEMENT_BOUND,
        "The upper bound, at the cascade's target_confidence, on how often a kept PRM verdict \
         disagrees with the judge (at most 1 - target_agreement when guaranteed)."
    );
    describe_gauge!(
        EXPECTED_COVERAGE,
        "The share of traces a cascade's PRM is expected to decide alone: its calibration rows' \
         share kept at the threshold."
    );
    describe_counter!(
        AUDITS,
        "Kept traces a cascade also sent its judge, after the answer, by evaluator and outcome \
         (agreed, disagreed, failed: the judge did not answer; over_budget: drawn, but the \
         audit budget was spent)."
    );
    describe_gauge!(
        AUDITED_AGREEMENT,
        "The share of a cascade's audits since its threshold was chosen whose judge verdict was \
         the PRM's."
    );
    describe_gauge!(
        AUDITED_AGREEMENT_LOWER,
        "The lower bound on that agreement, at the cascade's target_confidence (0 before an audit)."
    );
    describe_gauge!(
        AUDITED,
        "Audits a cascade's judge answered since its threshold was chosen: what its audited \
         agreement and the bound rest on."
    );
    describe_gauge!(
        AUDIT_SHARE,
        "The share of kept traces a cascade audits now (it decays to audit_floor)."
    );
    describe_gauge!(
        TARGET_AGREEMENT,
        "The agreement with its judge a cascade is set to guarantee (target_agreement)."
    );
    describe_counter!(
        RECALIBRATIONS,
        "A cascade's thresholds chosen again, by evaluator and reason (swap: its PRM was \
         reloaded; drift: audits showed the kept traces below the target)."
    );
    describe_gauge!(
        HEAD_INFO,
        "1 for the trained head an evaluator serves, by evaluator, head_sha256 (its folder's \
         head.safetensors and config.json) and base_sha256; 0 for a head a reload replaced."
    );
}

pub(crate) fn record_cascade(cascade: &str, path: &'static str) {
    counter!(CASCADE_PATHS, "cascade" => cascade.to_string(), "path" => path).increment(1);
}

/// Every outcome of `evaluator` as a series (0 until it moves; a reload keeps the counts), so a
/// dropped share reads 0 before the first drop.
pub(crate) fn recorded_at_zero(evaluator: &str) {
    for outcome in RECORDED_OUTCOMES {
        counter!(RECORDED, "evaluator" => evaluator.to_string(), "outcome" => outcome).increment(0);
    }
}

pub(crate) fn record_recorded(evaluator: &str, outcome: &'static str, rows: u64) {
    counter!(RECORDED, "evaluator" => evaluator.to_string(), "outcome" => outcome).increment(rows);
}

pub(crate) fn record_reload(evaluator: &str, outcome: &'static str) {
    counter!(RELOADS, "evaluator" => evaluator.to_string(), "outcome" => outcome).increment(1);
}

/// `evaluator` now serves the head and base `now` (head then base checksum; none for anything
/// but a trained head) where it served `before`, whose series goes to 0.
pub(crate) fn set_head(evaluator: &str, before: Option<[String; 2]>, now: Option<[String; 2]>) {
    let series = |[head, base]: [String; 2]| {
        let base = base.to_ascii_lowercase();
        gauge!(HEAD_INFO, "evaluator" => evaluator.to_string(), "head_sha256" => head, "base_sha256" => base)
    };
    if let Some(before) = before.filter(|b| now.as_ref() != Some(b)) {
        series(before).set(0.0);
    }
    if let Some(now) = now {
        series(now).set(1.0);
    }
}

/// What a cascade's calibration chose, as gauges: `threshold` None while every trace escalates.
pub(crate) fn set_guarantee(
    cascade: &str,
    threshold: Option<f64>,
    rows: usize,
    bound: f64,
    coverage: f64,
) {
    let name = || cascade.to_string();
    gauge!(GUARANTEED, "evaluator" => name()).set(if threshold.is_some() { 1.0 } else { 0.0 });
    // NaN while no threshold holds: the last one chosen is no longer in force.
    gauge!(CONFIDENCE_THRESHOLD, "evaluator" => name()).set(threshold.unwrap_or(f64::NAN));
    gauge!(CALIBRATION_ROWS, "evaluator" => name()).set(rows as f64);
    gauge!(DISAGREEMENT_BOUND, "evaluator" => name()).set(bound);
    gauge!(EXPECTED_COVERAGE, "evaluator" => name()).set(coverage);
}

pub(crate) fn record_audit(cascade: &str, outcome: &'static str) {
    counter!(AUDITS, "evaluator" => cascade.to_string(), "outcome" => outcome).increment(1);
}

/// What a cascade's audits say, as gauges: its target, the audited agreement (None before an
/// audit) and its lower bound, and the share audited now.
pub(crate) struct Audited {
    pub target: f64,
    pub audited: u64,
    pub agreement: Option<f64>,
    pub lower: f64,
    pub share: f64,
}

/// Every audit outcome of `cascade` as a series from the start, so a ratio reads 0 before the
/// first audit.
pub(crate) fn audits_at_zero(cascade: &str) {
    for outcome in AUDIT_OUTCOMES {
        counter!(AUDITS, "evaluator" => cascade.to_string(), "outcome" => outcome).increment(0);
    }
}

pub(crate) fn set_audited(cascade: &str, a: Audited) {
    let name = || cascade.to_string();
    gauge!(TARGET_AGREEMENT, "evaluator" => name()).set(a.target);
    gauge!(AUDITED, "evaluator" => name()).set(a.audited as f64);
    // No audit yet is no agreement: NaN, which a panel leaves blank, rather than a 0 or a 1.
    gauge!(AUDITED_AGREEMENT, "evaluator" => name()).set(a.agreement.unwrap_or(f64::NAN));
    gauge!(AUDITED_AGREEMENT_LOWER, "evaluator" => name()).set(a.lower);
    gauge!(AUDIT_SHARE, "evaluator" => name()).set(a.share);
}

pub(crate) fn record_recalibration(cascade: &str, reason: &'static str) {
    counter!(RECALIBRATIONS, "evaluator" => cascade.to_string(), "reason" => reason).increment(1);
}
