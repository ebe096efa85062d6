//! The cascade's metrics and those of the loop that learns from its judge: decisions by path,
//! verdicts recorded, and evaluators reloaded.

use metrics::{counter, describe_counter};

pub(crate) const CASCADE_PATHS: &str = "retrace_cascade_total";
pub(crate) const RECORDED: &str = "retrace_recorded_total";
pub(crate) const RELOADS: &str = "retrace_reloads_total";

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
