//! Where each answer of a `label` run goes: a labelled row to OUT when it meets the agreement
//! bar, else to the held-back file; a failed request to the failures file; and the tally the
//! summary reports.

use super::files::{Paths, meets};
use super::row::{self, Verdict};
use crate::common::Output;
use crate::common::jsonl::Writer;
use crate::common::{EvalError, Outcome, Record};
use std::collections::BTreeMap;

/// A request that failed: the row's key and why.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Failure {
    pub id: String,
    pub dataset: String,
    pub evaluator: String,
    pub error: String,
}

/// What a run wrote.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tally {
    /// Rows written to OUT, by label category (`none` for the rows whose steps all hold;
    /// `unspecified` where the evaluator names none).
    pub written: BTreeMap<String, usize>,
    /// Rows held back below the bar ...
    pub held: usize,
    /// ... of which the evaluator gave no agreement (it did not vote).
    pub held_without_vote: usize,
    pub failed: Vec<Failure>,
}

impl Tally {
    pub(crate) fn written_total(&self) -> usize {
        self.written.values().sum()
    }
}

/// The run's `Output`: OUT, the held-back file, the failures file.
pub(super) struct LabelOutput {
    out: Writer,
    held: Writer,
    failed: Writer,
    bar: Option<f32>,
    pub(super) tally: Tally,
}

impl LabelOutput {
    /// Opens OUT and the held-back file for appending; the failures file starts empty, since
    /// this run retries every row in it.
    pub(super) fn open(paths: &Paths, bar: Option<f32>) -> Result<LabelOutput, EvalError> {
        Ok(LabelOutput {
            out: Writer::append(&paths.out)?,
            held: Writer::append(&paths.held)?,
            failed: Writer::create(&paths.failed)?,
            bar,
            tally: Tally::default(),
        })
    }
}

impl Output for LabelOutput {
    fn write(&mut self, record: Record, outcome: Outcome) -> Result<(), EvalError> {
        let verdict = match outcome {
            Outcome::Failed { evaluator, message } => {
                let failure = Failure {
                    id: record.id,
                    dataset: record.split,
                    evaluator,
                    error: message,
                };
                self.failed.write(&failure)?;
                self.tally.failed.push(failure);
                return Ok(());
            }
            Outcome::Judged {
                evaluator,
                first_error,
                category,
                steps,
                rationale,
                agreement,
                ..
            } => Verdict {
                evaluator,
                first_error,
                category,
                steps,
                rationale,
                agreement,
            },
        };
        let agreement = verdict.agreement;
        let row = row::build(record, verdict);
        if meets(agreement, self.bar) {
            let category = row
                .get("category")
                .and_then(|c| c.as_str())
                .unwrap_or("unspecified");
            *self.tally.written.entry(category.to_string()).or_default() += 1;
            self.out.write(&row)
        } else {
            self.tally.held += 1;
            self.tally.held_without_vote += usize::from(agreement.is_none());
            self.held.write(&row)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::common::{Purpose, records_from_bytes};
    use retrace::ErrorCategory;
    use std::path::Path;

    fn records() -> Vec<Record> {
        let rows = "{\"id\": \"a\", \"question\": \"q\", \"steps\": [\"x\", \"y\"]}\n\
                    {\"id\": \"b\", \"question\": \"q\", \"steps\": [\"x\", \"y\"]}\n\
                    {\"id\": \"c\", \"question\": \"q\", \"steps\": [\"x\", \"y\"]}\n";
        records_from_bytes(Path::new("d.jsonl"), rows.as_bytes().to_vec())
            .unwrap()
            .for_purpose(Purpose::Label)
            .map(Result::unwrap)
            .collect()
    }

    fn judged(first_error: i32, agreement: f32) -> Outcome {
        Outcome::Judged {
            evaluator: "j".into(),
            first_error,
            category: ErrorCategory::Reasoning,
            step_scores: vec![1.0, 0.0],
            threshold: 0.5,
            trace_score: 0.0,
            outcome_score: None,
            steps: vec!["x".into(), "y".into()],
            rationale: None,
            agreement: Some(agreement),
        }
    }

    /// Each answer lands in its file: met the bar, held back, or failed with its error.
    #[test]
    fn answers_are_routed_and_tallied() {
        let dir = std::env::temp_dir().join(format!("retrace-label-out-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let paths = Paths::new(&dir.join("out.jsonl"));
        std::fs::write(&paths.failed, "{\"id\": \"stale\"}\n").unwrap();
        let mut output = LabelOutput::open(&paths, Some(0.8)).unwrap();
        let mut rs = records().into_iter();
        output.write(rs.next().unwrap(), judged(1, 1.0)).unwrap();
        output.write(rs.next().unwrap(), judged(-1, 0.5)).unwrap();
        let failed = Outcome::Failed {
            evaluator: "j".into(),
            message: "UNAVAILABLE: HTTP 500".into(),
        };
        output.write(rs.next().unwrap(), failed).unwrap();
        let tally = output.tally.clone();
        drop(output);
        assert_eq!(tally.written_total(), 1);
        assert_eq!(tally.written.get("reasoning"), Some(&1));
        assert_eq!((tally.held, tally.held_without_vote), (1, 0));
        assert_eq!(tally.failed[0].id, "c");
        let read = |p: &Path| std::fs::read_to_string(p).unwrap();
        assert!(
            read(&paths.out).contains("\"id\":\"a\""),
            "{}",
            read(&paths.out)
        );
        assert!(read(&paths.held).contains("\"id\":\"b\""));
        let failed = read(&paths.failed);
        assert!(
            !failed.contains("stale"),
            "a run starts its failures afresh"
        );
        assert!(
            failed.contains("\"error\":\"UNAVAILABLE: HTTP 500\""),
            "{failed}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}
