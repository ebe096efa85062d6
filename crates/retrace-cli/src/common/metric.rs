//! ProcessBench's metric (run_eval.py), per split and averaged over splits: error accuracy,
//! correct accuracy and their harmonic mean, with a failed prediction wrong in either subset.
//!
//! Two edge cases run_eval.py leaves to numpy: an empty subset's accuracy (numpy: nan) is `None`
//! here, and F1 with both accuracies 0 (Python: ZeroDivisionError / nan) is 0.

use serde::Serialize;

/// Hits and totals of one split.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Traces with label != -1.
    pub error_total: usize,
    /// ... whose prediction equals the label.
    pub error_hit: usize,
    /// Traces with label == -1.
    pub correct_total: usize,
    /// ... predicted -1.
    pub correct_hit: usize,
}

/// One split's scores, in percent.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SplitScore {
    pub split: String,
    pub counts: Counts,
    /// Failed predictions (requests that errored), counted wrong.
    pub failed: usize,
    pub error_acc: Option<f64>,
    pub correct_acc: Option<f64>,
    pub f1: Option<f64>,
}

/// Per-split scores in first-seen order, and their mean.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub splits: Vec<SplitScore>,
    /// Mean over splits of each score (over the splits where it is defined).
    pub average: Averages,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Averages {
    pub error_acc: Option<f64>,
    pub correct_acc: Option<f64>,
    pub f1: Option<f64>,
}

/// The harmonic mean of two percentages; 0 when both are 0.
pub(crate) fn f1(error_acc: f64, correct_acc: f64) -> f64 {
    if error_acc + correct_acc == 0.0 {
        0.0
    } else {
        2.0 * error_acc * correct_acc / (error_acc + correct_acc)
    }
}

fn percent(hit: usize, total: usize) -> Option<f64> {
    (total > 0).then(|| hit as f64 / total as f64 * 100.0)
}

impl Counts {
    /// Counts one trace; `prediction` None (failed) never matches.
    pub fn add(&mut self, label: i32, prediction: Option<i32>) {
        let hit = prediction == Some(label);
        if label == -1 {
            self.correct_total += 1;
            self.correct_hit += usize::from(hit);
        } else {
            self.error_total += 1;
            self.error_hit += usize::from(hit);
        }
    }

    pub fn error_acc(&self) -> Option<f64> {
        percent(self.error_hit, self.error_total)
    }

    pub fn correct_acc(&self) -> Option<f64> {
        percent(self.correct_hit, self.correct_total)
    }

    pub fn f1(&self) -> Option<f64> {
        Some(f1(self.error_acc()?, self.correct_acc()?))
    }

    pub fn total(&self) -> usize {
        self.error_total + self.correct_total
    }
}

impl SplitScore {
    pub fn new(split: &str, counts: Counts, failed: usize) -> Self {
        SplitScore {
            split: split.to_string(),
            counts,
            failed,
            error_acc: counts.error_acc(),
            correct_acc: counts.correct_acc(),
            f1: counts.f1(),
        }
    }
}

fn mean(values: impl Iterator<Item = Option<f64>>) -> Option<f64> {
    let defined: Vec<f64> = values.flatten().collect();
    (!defined.is_empty()).then(|| defined.iter().sum::<f64>() / defined.len() as f64)
}

impl Summary {
    pub(crate) fn from_splits(splits: Vec<SplitScore>) -> Summary {
        let average = Averages {
            error_acc: mean(splits.iter().map(|s| s.error_acc)),
            correct_acc: mean(splits.iter().map(|s| s.correct_acc)),
            f1: mean(splits.iter().map(|s| s.f1)),
        };
        Summary { splits, average }
    }

    /// Scores (split, label, prediction) triples; splits keep their first-seen order.
    pub fn of<'a>(items: impl IntoIterator<Item = (&'a str, i32, Option<i32>)>) -> Summary {
        let mut acc = Accumulator::default();
        for (split, label, prediction) in items {
            acc.add(split, label, prediction);
        }
        acc.finish()
    }
}

/// Builds a `Summary` one trace at a time (memory: one entry per split).
#[derive(Debug, Default)]
pub(crate) struct Accumulator {
    splits: Vec<(String, Counts, usize)>,
}

impl Accumulator {
    pub(crate) fn add(&mut self, split: &str, label: i32, prediction: Option<i32>) {
        let i = match self.splits.iter().position(|(s, ..)| s == split) {
            Some(i) => i,
            None => {
                self.splits.push((split.to_string(), Counts::default(), 0));
                self.splits.len() - 1
            }
        };
        let entry = &mut self.splits[i];
        entry.1.add(label, prediction);
        entry.2 += usize::from(prediction.is_none());
    }

    pub(crate) fn finish(self) -> Summary {
        Summary::from_splits(
            self.splits
                .into_iter()
                .map(|(s, c, failed)| SplitScore::new(&s, c, failed))
                .collect(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: Option<f64>, b: f64) {
        let a = a.expect("defined");
        assert!((a - b).abs() < 1e-9, "{a} != {b}");
    }

    #[test]
    fn hand_computed_split() {
        // label -1 x3: predicted -1, -1, 2 -> correct acc 2/3.
        // label 1 x2, label 0 x2: predicted 1, 0 (wrong), 0, failed -> error acc 2/4.
        let s = Summary::of([
            ("a", -1, Some(-1)),
            ("a", -1, Some(-1)),
            ("a", -1, Some(2)),
            ("a", 1, Some(1)),
            ("a", 1, Some(0)),
            ("a", 0, Some(0)),
            ("a", 0, None),
        ]);
        let a = &s.splits[0];
        assert_eq!(
            a.counts,
            Counts {
                error_total: 4,
                error_hit: 2,
                correct_total: 3,
                correct_hit: 2
            }
        );
        assert_eq!(a.failed, 1);
        close(a.error_acc, 50.0);
        close(a.correct_acc, 200.0 / 3.0);
        // 2 * 50 * 66.67 / 116.67 = 57.142857...
        close(a.f1, 400.0 / 7.0);
    }

    #[test]
    fn average_is_the_mean_over_splits_and_a_failure_is_wrong_in_both_subsets() {
        let s = Summary::of([
            ("x", -1, None),
            ("x", 0, Some(0)),
            ("y", -1, Some(-1)),
            ("y", 3, None),
        ]);
        let (x, y) = (&s.splits[0], &s.splits[1]);
        assert_eq!((x.split.as_str(), y.split.as_str()), ("x", "y"));
        close(x.error_acc, 100.0);
        close(x.correct_acc, 0.0);
        close(x.f1, 0.0);
        close(y.error_acc, 0.0);
        close(y.correct_acc, 100.0);
        close(s.average.error_acc, 50.0);
        close(s.average.correct_acc, 50.0);
        close(s.average.f1, 0.0);
    }

    #[test]
    fn edge_cases() {
        assert_eq!(f1(0.0, 0.0), 0.0);
        assert_eq!(f1(100.0, 100.0), 100.0);
        let s = Summary::of([("only-correct", -1, Some(-1))]);
        assert_eq!(s.splits[0].error_acc, None);
        assert_eq!(s.splits[0].f1, None);
        close(s.splits[0].correct_acc, 100.0);
        assert_eq!(s.average.f1, None);
    }
}
