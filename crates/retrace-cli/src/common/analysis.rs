//! Beyond the headline metric: per-category accuracy and the category confusion matrix, gold
//! against predicted first-error index, and ReTraceQA's answer-level view by generator.

use super::best_of_n::{BestOfN, Groups};
use super::metric::{Accumulator, Summary};
use super::predictions::Row;
use retrace::ErrorCategory;
use serde::Serialize;
use std::collections::BTreeMap;

/// The predicted side of the category confusion matrix: a category, or a failed request.
pub(crate) type Predicted = Option<ErrorCategory>;

/// Everything the report shows, built from rows in one pass (memory: counts only).
#[derive(Debug, Clone, Serialize)]
pub struct Analysis {
    pub summary: Summary,
    pub rows: usize,
    pub failed: usize,
    /// (gold label, prediction) -> traces; prediction None: failed.
    #[serde(serialize_with = "as_entries")]
    pub index_pairs: BTreeMap<(i32, Option<i32>), usize>,
    /// Present when some rows carry a gold category.
    pub categories: Option<CategoryStats>,
    /// Present when some rows carry `final_answer_correct`.
    pub answers: Option<AnswerLevel>,
    /// Present when some question has several judged candidates with `final_answer_correct`.
    pub best_of_n: Option<BestOfN>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct CategoryStats {
    /// (gold, predicted) -> traces.
    #[serde(serialize_with = "as_entries")]
    pub confusion: BTreeMap<(ErrorCategory, Predicted), usize>,
    /// gold -> (traces, first-error index right, category right).
    pub by_gold: BTreeMap<ErrorCategory, (usize, usize, usize)>,
}

/// A map with composite keys as a JSON list of [key, value] pairs.
fn as_entries<S, K, V>(m: &BTreeMap<K, V>, s: S) -> Result<S::Ok, S::Error>
where
    S: serde::Serializer,
    K: Serialize,
    V: Serialize,
{
    s.collect_seq(m.iter())
}

/// ReTraceQA's answer-level analysis: answer-only against reasoning-aware accuracy.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AnswerLevel {
    /// By generator, sorted by name; the `all` row is separate.
    pub generators: Vec<GeneratorStats>,
    pub all: GeneratorStats,
}

/// Counts for one generator model.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GeneratorStats {
    pub generator: String,
    /// Traces with `final_answer_correct`.
    pub traces: usize,
    /// ... whose final answer is correct.
    pub answer_correct: usize,
    /// ... correct answer and gold label -1 (no wrong step).
    pub sound_gold: usize,
    /// ... correct answer and the evaluator found no wrong step (a failed request is not sound).
    pub sound_predicted: usize,
}

impl GeneratorStats {
    fn add(&mut self, row: &Row) {
        let Some(correct) = row.final_answer_correct else {
            return;
        };
        self.traces += 1;
        if correct {
            self.answer_correct += 1;
            self.sound_gold += usize::from(row.label == -1);
            self.sound_predicted += usize::from(row.prediction == Some(-1));
        }
    }

    fn pct(&self, n: usize) -> Option<f64> {
        (self.traces > 0).then(|| n as f64 / self.traces as f64 * 100.0)
    }

    /// Share of traces whose final answer is correct, in percent.
    pub(crate) fn answer_acc(&self) -> Option<f64> {
        self.pct(self.answer_correct)
    }

    /// Share with a correct answer and no wrong step: by the gold labels, or by the evaluator.
    pub(crate) fn reasoning_acc(&self, predicted: bool) -> Option<f64> {
        self.pct(if predicted {
            self.sound_predicted
        } else {
            self.sound_gold
        })
    }

    /// Points lost going from answer-only to reasoning-aware accuracy.
    pub(crate) fn inflation(&self, predicted: bool) -> Option<f64> {
        Some(self.answer_acc()? - self.reasoning_acc(predicted)?)
    }

    /// Share of correct answers whose trace has a wrong step, in percent.
    pub(crate) fn process_error_rate(&self, predicted: bool) -> Option<f64> {
        let sound = if predicted {
            self.sound_predicted
        } else {
            self.sound_gold
        };
        (self.answer_correct > 0)
            .then(|| (self.answer_correct - sound) as f64 / self.answer_correct as f64 * 100.0)
    }
}

/// Folds rows into an `Analysis`.
#[derive(Debug, Default)]
pub(crate) struct Analyzer {
    metric: Accumulator,
    rows: usize,
    failed: usize,
    index_pairs: BTreeMap<(i32, Option<i32>), usize>,
    categories: CategoryStats,
    has_categories: bool,
    generators: BTreeMap<String, GeneratorStats>,
    all: GeneratorStats,
    groups: Groups,
}

impl Analyzer {
    pub(crate) fn add(&mut self, row: &Row) {
        self.metric.add(&row.split, row.label, row.prediction);
        self.rows += 1;
        self.failed += usize::from(row.prediction.is_none());
        *self
            .index_pairs
            .entry((row.label, row.prediction))
            .or_default() += 1;
        if let Some(gold) = row.gold_category {
            self.has_categories = true;
            *self
                .categories
                .confusion
                .entry((gold, row.category))
                .or_default() += 1;
            let e = self.categories.by_gold.entry(gold).or_default();
            e.0 += 1;
            e.1 += usize::from(row.matched);
            e.2 += usize::from(row.category == Some(gold));
        }
        self.groups.add(row);
        if row.final_answer_correct.is_some() {
            let name = row.generator.clone().unwrap_or_else(|| "(unknown)".into());
            let g = self.generators.entry(name.clone()).or_default();
            g.generator = name;
            g.add(row);
            self.all.add(row);
        }
    }

    pub(crate) fn finish(self) -> Analysis {
        let answers = (self.all.traces > 0).then(|| AnswerLevel {
            generators: self.generators.into_values().collect(),
            all: GeneratorStats {
                generator: "all".into(),
                ..self.all
            },
        });
        Analysis {
            summary: self.metric.finish(),
            rows: self.rows,
            failed: self.failed,
            index_pairs: self.index_pairs,
            categories: self.has_categories.then_some(self.categories),
            answers,
            best_of_n: self.groups.finish(),
        }
    }
}

impl Analysis {
    pub fn of<'a>(rows: impl IntoIterator<Item = &'a Row>) -> Analysis {
        let mut a = Analyzer::default();
        for r in rows {
            a.add(r);
        }
        a.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(label: i32, prediction: Option<i32>, gen_: &str, correct: bool) -> Row {
        Row {
            id: String::new(),
            split: "s".into(),
            label,
            prediction,
            category: prediction.map(|p| {
                if p == -1 {
                    ErrorCategory::None
                } else {
                    ErrorCategory::Reasoning
                }
            }),
            gold_category: Some(if label == -1 {
                ErrorCategory::None
            } else {
                ErrorCategory::Hallucination
            }),
            step_scores: vec![],
            matched: prediction == Some(label),
            generator: Some(gen_.into()),
            final_answer_correct: Some(correct),
            evaluator: "e".into(),
            threshold: None,
            error: None,
            trace_score: None,
            outcome_score: None,
            question_key: None,
        }
    }

    #[test]
    fn answer_level_by_generator() {
        // g1: 4 traces, 3 correct answers of which 1 has a wrong step (gold); the evaluator
        // flags 2 of the 3 (one wrongly) -> answer acc 75, reasoning-aware 50 (gold) / 25 (pred).
        let rows = [
            row(-1, Some(-1), "g1", true),
            row(-1, Some(1), "g1", true),
            row(2, Some(2), "g1", true),
            row(0, Some(0), "g1", false),
            row(-1, None, "g2", true),
        ];
        let a = Analysis::of(&rows);
        let ans = a.answers.unwrap();
        let g1 = &ans.generators[0];
        assert_eq!(
            (
                g1.traces,
                g1.answer_correct,
                g1.sound_gold,
                g1.sound_predicted
            ),
            (4, 3, 2, 1)
        );
        assert_eq!(g1.answer_acc(), Some(75.0));
        assert_eq!(g1.reasoning_acc(false), Some(50.0));
        assert_eq!(g1.reasoning_acc(true), Some(25.0));
        assert_eq!(g1.inflation(false), Some(25.0));
        assert!((g1.process_error_rate(false).unwrap() - 100.0 / 3.0).abs() < 1e-9);
        assert!((g1.process_error_rate(true).unwrap() - 200.0 / 3.0).abs() < 1e-9);
        let g2 = &ans.generators[1];
        assert_eq!(g2.sound_predicted, 0, "a failed request is not sound");
        assert_eq!(ans.all.traces, 5);
        assert_eq!(a.failed, 1);
    }

    #[test]
    fn category_confusion() {
        let rows = [
            row(-1, Some(-1), "g", true),
            row(1, Some(1), "g", true),
            row(1, None, "g", true),
        ];
        let c = Analysis::of(&rows).categories.unwrap();
        assert_eq!(
            c.confusion[&(ErrorCategory::None, Some(ErrorCategory::None))],
            1
        );
        assert_eq!(
            c.confusion[&(ErrorCategory::Hallucination, Some(ErrorCategory::Reasoning))],
            1
        );
        assert_eq!(c.confusion[&(ErrorCategory::Hallucination, None)], 1);
        assert_eq!(c.by_gold[&ErrorCategory::Hallucination], (2, 1, 0));
        assert_eq!(c.by_gold[&ErrorCategory::None], (1, 1, 1));
    }
}
