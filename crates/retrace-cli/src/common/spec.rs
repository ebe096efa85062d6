//! What a run asks and what it hands back, the leaf the driver (`run.rs`), the backends'
//! exchanges (`judging.rs`) and the outputs (`predictions.rs`, `label`'s rows) share.

use super::EvalError;
use super::dataset::{Purpose, Record};
use retrace::ErrorCategory;
use std::path::PathBuf;

/// What to judge and how.
#[derive(Debug, Clone)]
pub(crate) struct RunSpec {
    pub(crate) files: Vec<PathBuf>,
    /// Empty: the server's default.
    pub(crate) evaluator: String,
    /// Overrides the evaluator's threshold.
    pub(crate) threshold: Option<f32>,
    /// Requests in flight at once.
    pub(crate) concurrency: usize,
    /// At most this many rows from each file.
    pub(crate) limit: Option<usize>,
    /// Skip (and count) bad rows instead of stopping at the first.
    pub(crate) skip_bad: bool,
    pub(crate) progress: bool,
    /// What the rows are read for: `label` reads unlabelled rows and keeps their fields.
    pub(crate) purpose: Purpose,
}

/// A record's resume key: its split and id (ids are unique within a split).
pub(crate) type Key = (String, String);

/// Where a run's answers go.
pub(crate) trait Output {
    /// Keeps what the evaluator said about `record`.
    fn write(&mut self, record: Record, outcome: Outcome) -> Result<(), EvalError>;
}

/// What the evaluator said about a record.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Judged {
        evaluator: String,
        first_error: i32,
        category: ErrorCategory,
        step_scores: Vec<f32>,
        threshold: f32,
        trace_score: f32,
        outcome_score: Option<f32>,
        /// The steps judged: the record's, or the server's segmentation of its `text`.
        steps: Vec<String>,
        rationale: Option<String>,
        /// A voting judge's agreement with its first error (see the API's `agreement`).
        agreement: Option<f32>,
    },
    Failed {
        evaluator: String,
        message: String,
    },
}

impl Outcome {
    pub fn failed(&self) -> bool {
        matches!(self, Outcome::Failed { .. })
    }
}
