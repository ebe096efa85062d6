//! The predictions JSONL: one `Row` per judged trace. It is `eval`'s output, what makes a run
//! resumable (rows already there are skipped), and the score cache `calibrate` re-thresholds.

use super::dataset::{DataError, Record};
use super::jsonl::{self, Writer};
use super::spec::{Outcome, Output};
use super::{EvalError, shown};
use retrace::ErrorCategory;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;

/// One judged trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    pub id: String,
    pub split: String,
    /// Gold first wrong step; -1 when every step holds.
    pub label: i32,
    /// The evaluator's first wrong step; -1 for none; null when the request failed.
    pub prediction: Option<i32>,
    /// The evaluator's category; null when the request failed.
    pub category: Option<ErrorCategory>,
    /// Gold category, when the data carries one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gold_category: Option<ErrorCategory>,
    /// One score per step: P(step correct).
    #[serde(default)]
    pub step_scores: Vec<f32>,
    /// prediction == label (ProcessBench's `match`).
    #[serde(rename = "match")]
    pub matched: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generator: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_answer_correct: Option<bool>,
    /// The evaluator that answered (empty when the request failed before one was chosen).
    #[serde(default)]
    pub evaluator: String,
    /// The threshold that decided `prediction`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold: Option<f32>,
    /// Why the request failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The verdict's trace score (the evaluator's aggregate; an outcome model's raw score alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace_score: Option<f32>,
    /// An outcome reward model's raw score, when the evaluator gives one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome_score: Option<f32>,
    /// A hash of the question: rows that share it are candidates for one question (Best-of-N).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub question_key: Option<String>,
}

impl Row {
    /// `record`'s row, against its gold `label`.
    pub fn new(record: &Record, label: i32, outcome: Outcome) -> Row {
        let mut row = Row {
            id: record.id.clone(),
            split: record.split.clone(),
            label,
            prediction: None,
            category: None,
            gold_category: record.category,
            step_scores: Vec::new(),
            matched: false,
            generator: record.generator.clone(),
            final_answer_correct: record.final_answer_correct,
            evaluator: String::new(),
            threshold: None,
            error: None,
            trace_score: None,
            outcome_score: None,
            question_key: Some(question_key(&record.question)),
        };
        match outcome {
            Outcome::Judged {
                evaluator,
                first_error,
                category,
                step_scores,
                threshold,
                trace_score,
                outcome_score,
                ..
            } => {
                row.trace_score = Some(trace_score);
                row.outcome_score = outcome_score;
                row.prediction = Some(first_error);
                row.category = Some(category);
                row.step_scores = step_scores;
                row.matched = first_error == label;
                row.evaluator = evaluator;
                row.threshold = Some(threshold);
            }
            Outcome::Failed { evaluator, message } => {
                row.evaluator = evaluator;
                row.error = Some(message);
            }
        }
        row
    }

    /// The resume key: ids are unique within a split.
    pub fn key(&self) -> (String, String) {
        (self.split.clone(), self.id.clone())
    }
}

/// FNV-1a (64 bits) of the question, in hex: stable across runs and builds, unlike std's hasher.
fn question_key(question: &str) -> String {
    let hash = question
        .trim()
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
    format!("{hash:016x}")
}

/// Streams the rows of a predictions file to `f`; a bad line is an error naming file and line.
///
/// A trace judged again (a failed row retried on resume) appears more than once: only its last
/// row is passed on. That takes a first pass over the keys, so memory stays one key per trace.
pub fn read_rows(path: &Path, mut f: impl FnMut(Row)) -> Result<(), EvalError> {
    let mut last: HashMap<(String, String), usize> = HashMap::new();
    read_all_rows(path, |i, row| {
        last.insert(row.key(), i);
    })?;
    read_all_rows(path, |i, row| {
        if last.get(&row.key()) == Some(&i) {
            f(row);
        }
    })
}

/// Every row with its line index, superseded ones included.
fn read_all_rows(path: &Path, mut f: impl FnMut(usize, Row)) -> Result<(), EvalError> {
    let file =
        File::open(path).map_err(|e| EvalError::io(format!("opening {}", shown(path)), e))?;
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(|e| EvalError::io(format!("reading {}", shown(path)), e))?;
        if line.trim().is_empty() {
            continue;
        }
        let row: Row = serde_json::from_str(&line).map_err(|e| DataError {
            file: shown(path),
            line: i + 1,
            message: format!("not a predictions row: {e}"),
            fatal: true,
        })?;
        f(i, row);
    }
    Ok(())
}

/// What a predictions file already holds, for resuming.
#[derive(Debug, Default)]
pub(crate) struct Existing {
    pub(crate) keys: HashSet<(String, String)>,
    pub(crate) evaluators: HashSet<String>,
    /// Thresholds that decided the rows already there (a rerun must not mix in another).
    pub(crate) thresholds: Vec<f32>,
}

/// Reads the keys already in `path` (absent: none). A last line cut short by a crash is removed,
/// so that trace is judged again.
pub(crate) fn prepare(path: &Path) -> Result<Existing, EvalError> {
    let mut existing = Existing::default();
    jsonl::mend_last_line(path, |tail| serde_json::from_str::<Row>(tail).is_ok())?;
    if !path.exists() {
        return Ok(existing);
    }
    read_rows(path, |row| {
        // A failed trace is judged again on resume; its new row supersedes this one.
        if row.error.is_some() {
            return;
        }
        existing.keys.insert(row.key());
        if let Some(t) = row.threshold
            && !existing.thresholds.contains(&t)
        {
            existing.thresholds.push(t);
        }
        if !row.evaluator.is_empty() {
            existing.evaluators.insert(row.evaluator);
        }
    })?;
    Ok(existing)
}

/// `eval`'s output: a predictions row per answer, against the record's gold label.
pub(crate) struct Predictions(pub(crate) Writer);

impl Output for Predictions {
    fn write(&mut self, record: Record, outcome: Outcome) -> Result<(), EvalError> {
        // Read for `eval`, every record has its label; the check keeps a mistake from panicking.
        let label = record.label.ok_or_else(|| {
            EvalError::Usage(format!(
                "row {:?} of split {:?} has no `label` to score against",
                record.id, record.split
            ))
        })?;
        self.0.write(&Row::new(&record, label, outcome))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(label: i32) -> Record {
        Record {
            id: "a".into(),
            split: "s".into(),
            question: "q".into(),
            options: vec![],
            steps: vec!["x".into(), "y".into()],
            text: None,
            label: Some(label),
            category: None,
            reference_answer: None,
            final_answer_correct: Some(true),
            generator: Some("g".into()),
            source: None,
        }
    }

    #[test]
    fn rows_round_trip_and_match() {
        let row = Row::new(
            &record(1),
            1,
            Outcome::Judged {
                evaluator: "e".into(),
                first_error: 1,
                category: ErrorCategory::Unspecified,
                step_scores: vec![0.9, 0.123_456_79],
                threshold: 0.5,
                trace_score: 0.123_456_79,
                outcome_score: Some(-1.5),
                steps: vec!["x".into(), "y".into()],
                rationale: None,
                agreement: None,
            },
        );
        assert!(row.matched);
        assert_eq!(row.question_key.as_deref(), Some("af63ec4c860207bc"));
        let line = serde_json::to_string(&row).unwrap();
        assert!(line.contains("\"match\":true"), "{line}");
        assert_eq!(serde_json::from_str::<Row>(&line).unwrap(), row);
        let failed = Row::new(
            &record(-1),
            -1,
            Outcome::Failed {
                evaluator: "e".into(),
                message: "boom".into(),
            },
        );
        assert!(!failed.matched);
        assert_eq!(failed.prediction, None);
        assert!(
            serde_json::to_string(&failed)
                .unwrap()
                .contains("\"prediction\":null")
        );
    }

    #[test]
    fn prepare_drops_a_cut_line_and_keeps_the_rest() {
        let path = std::env::temp_dir().join(format!("retrace-pred-{}.jsonl", std::process::id()));
        let row = Row::new(&record(-1), -1, judged(-1));
        let line = serde_json::to_string(&row).unwrap();
        std::fs::write(&path, format!("{line}\n{}", &line[..10])).unwrap();
        let existing = prepare(&path).unwrap();
        assert_eq!(existing.keys.len(), 1);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{line}\n"));
        std::fs::write(&path, &line).unwrap();
        prepare(&path).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), format!("{line}\n"));
        std::fs::remove_file(&path).unwrap();
    }

    fn judged(first_error: i32) -> Outcome {
        Outcome::Judged {
            evaluator: "e".into(),
            first_error,
            category: ErrorCategory::Unspecified,
            step_scores: vec![0.9, 0.9],
            threshold: 0.5,
            trace_score: 0.9,
            outcome_score: None,
            steps: vec!["x".into(), "y".into()],
            rationale: None,
            agreement: None,
        }
    }

    #[test]
    fn a_failed_row_is_retried_and_its_retry_supersedes_it() {
        let path = std::env::temp_dir().join(format!("retrace-retry-{}.jsonl", std::process::id()));
        let failed = Row::new(
            &record(1),
            1,
            Outcome::Failed {
                evaluator: "e".into(),
                message: "unavailable".into(),
            },
        );
        let line = |r: &Row| serde_json::to_string(r).unwrap();
        std::fs::write(&path, format!("{}\n", line(&failed))).unwrap();
        assert!(
            prepare(&path).unwrap().keys.is_empty(),
            "a failed trace is judged again"
        );
        let retried = Row::new(&record(1), 1, judged(1));
        std::fs::write(&path, format!("{}\n{}\n", line(&failed), line(&retried))).unwrap();
        let mut rows = Vec::new();
        read_rows(&path, |r| rows.push(r)).unwrap();
        assert_eq!(rows, vec![retried]);
        assert_eq!(prepare(&path).unwrap().keys.len(), 1);
        std::fs::remove_file(&path).unwrap();
    }
}
