//! The domain types: a validated trace, its steps, and the verdict an evaluator reaches.

use std::ops::Range;
use std::time::Duration;

/// A question and its chain of thought, validated at the API edge.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub question: String,
    /// Multiple-choice options, in order; empty for open questions.
    pub options: Vec<String>,
    pub steps: Vec<Step>,
    /// Non-empty selects reference-based mode.
    pub reference_answer: Option<String>,
}

/// One step of a chain of thought.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub text: String,
    /// Byte range in the caller's raw text, when the server segmented it.
    pub span: Option<Range<usize>>,
}

/// Category of the first wrong step, in ReTraceQA's priority order; the one mapping between
/// the names in data, predictions and judge replies and the variants.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum ErrorCategory {
    /// Every step holds.
    None,
    Misinterpretation,
    Hallucination,
    Reasoning,
    /// The evaluator names no category (a PRM can't tell).
    Unspecified,
}

impl ErrorCategory {
    /// The labelled categories, in ReTraceQA's priority order after `None`.
    pub const LABELLED: [ErrorCategory; 4] = [
        ErrorCategory::None,
        ErrorCategory::Misinterpretation,
        ErrorCategory::Hallucination,
        ErrorCategory::Reasoning,
    ];

    /// A name as data and replies write it, any case; "correct" is `None`.
    pub fn parse(s: &str) -> Option<ErrorCategory> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "none" | "correct" => ErrorCategory::None,
            "misinterpretation" => ErrorCategory::Misinterpretation,
            "hallucination" => ErrorCategory::Hallucination,
            "reasoning" => ErrorCategory::Reasoning,
            "unspecified" => ErrorCategory::Unspecified,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCategory::None => "none",
            ErrorCategory::Misinterpretation => "misinterpretation",
            ErrorCategory::Hallucination => "hallucination",
            ErrorCategory::Reasoning => "reasoning",
            ErrorCategory::Unspecified => "unspecified",
        }
    }
}

/// Who decided the verdict: a PRM alone, a judge alone, or a cascade that asked its judge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DecisionPath {
    Prm,
    Judge,
    /// The PRM was unsure; the judge's index decided.
    Escalated,
    /// The PRM's index stands; the judge named its category.
    Categorized,
}

impl DecisionPath {
    pub fn as_str(self) -> &'static str {
        match self {
            DecisionPath::Prm => "prm",
            DecisionPath::Judge => "judge",
            DecisionPath::Escalated => "escalated",
            DecisionPath::Categorized => "categorized",
        }
    }
}

/// How a trace's reward is computed from its step scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum Aggregate {
    #[default]
    Min,
    Product,
    Last,
    Mean,
}

/// What an evaluator concluded about one trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Judgement {
    /// One score per step: the probability that the step is correct.
    pub step_scores: Vec<f32>,
    /// Index of the first wrong step; `None` when every step holds.
    pub first_error: Option<usize>,
    pub category: ErrorCategory,
    pub rationale: Option<String>,
    /// A voting judge's agreement: the share of its readable samples that put the first error
    /// where the verdict does, in (0, 1]. `None` when nothing voted (a PRM, a one-sample judge).
    pub agreement: Option<f32>,
    /// Time spent waiting inside the evaluator (a batch queue), beyond the engine's own queue.
    pub queued: Duration,
    /// Time the model or the upstream judge took.
    pub inference: Duration,
    pub path: DecisionPath,
    /// A PRM's tokens computed for this trace and reused (cached, or shared in its batch).
    pub tokens: Option<(usize, usize)>,
    /// An outcome reward model's verdict on the whole trace, when one was asked (an `outcome-rm`
    /// PRM, or a composite's outcome side).
    pub outcome: Option<Outcome>,
}

/// An outcome reward model's verdict on a whole trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    /// The model's raw reward (its one logit; unbounded, higher is better).
    pub score: f32,
    /// sigmoid(score) reached the threshold.
    pub holds: bool,
}

/// A PRM's rule: the first step scoring below `threshold` is the first error.
pub(crate) fn first_below(scores: &[f32], threshold: f32) -> Option<usize> {
    scores.iter().position(|&s| s < threshold)
}

/// The first-error index of a trace judged wrong as a whole with no step located: an outcome
/// reward model alone scores the trace, not its steps, and names no index.
pub const UNLOCATED: i32 = -2;

/// The engine's answer: a judgement plus what the engine adds to it.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub evaluator: String,
    pub judgement: Judgement,
    pub threshold: f32,
    pub trace_score: f32,
    pub queue: Duration,
    pub total: Duration,
}

impl Trace {
    /// A trace of `question` and these steps' texts, with no options or reference answer.
    pub fn of_steps(question: &str, steps: &[String]) -> Trace {
        Trace {
            question: question.to_string(),
            options: Vec::new(),
            steps: steps
                .iter()
                .map(|text| Step {
                    text: text.clone(),
                    span: None,
                })
                .collect(),
            reference_answer: None,
        }
    }

    /// Bytes of question, options, reference and steps together: what the size limit counts.
    pub(crate) fn byte_len(&self) -> usize {
        self.question.len()
            + self.options.iter().map(String::len).sum::<usize>()
            + self.reference_answer.as_deref().map_or(0, str::len)
            + self.steps.iter().map(|s| s.text.len()).sum::<usize>()
    }

    pub fn step_texts(&self) -> impl Iterator<Item = &str> {
        self.steps.iter().map(|s| s.text.as_str())
    }
}

impl Judgement {
    /// A PRM's judgement: the first error is the first step scoring below `threshold`.
    pub fn from_scores(step_scores: Vec<f32>, threshold: f32) -> Self {
        let first_error = first_below(&step_scores, threshold);
        let category = if first_error.is_some() {
            ErrorCategory::Unspecified
        } else {
            ErrorCategory::None
        };
        Judgement {
            step_scores,
            first_error,
            category,
            rationale: None,
            agreement: None,
            queued: Duration::ZERO,
            inference: Duration::ZERO,
            path: DecisionPath::Prm,
            tokens: None,
            outcome: None,
        }
    }

    /// An outcome reward model's judgement: no step scores, the trace holds when
    /// sigmoid(`score`) reaches `threshold` (a raw reward of 0 is the midpoint, 0.5).
    pub(crate) fn from_outcome(score: f32, threshold: f32) -> Self {
        let outcome = Outcome::new(score, threshold);
        let mut j = Judgement::from_scores(Vec::new(), threshold);
        j.category = if outcome.holds {
            ErrorCategory::None
        } else {
            ErrorCategory::Unspecified
        };
        j.outcome = Some(outcome);
        j
    }

    /// The first-error index as the API states it: the step's index, -1 when the trace holds, or
    /// `UNLOCATED` when an outcome model alone found it wrong.
    pub fn error_index(&self) -> i32 {
        match (self.first_error, self.outcome) {
            (Some(k), _) => i32::try_from(k).unwrap_or(i32::MAX),
            (None, Some(o)) if self.step_scores.is_empty() && !o.holds => UNLOCATED,
            (None, _) => -1,
        }
    }
}

impl Outcome {
    /// `score` judged against `threshold`, a probability: sigmoid(score) >= threshold.
    pub fn new(score: f32, threshold: f32) -> Self {
        let p = 1.0 / (1.0 + (-f64::from(score)).exp());
        Outcome {
            score,
            holds: p >= f64::from(threshold),
        }
    }

    /// The score as a probability-like number in [0, 1], to set beside step scores.
    pub fn sigmoid(self) -> f32 {
        (1.0 / (1.0 + (-f64::from(self.score)).exp())) as f32
    }
}

impl Aggregate {
    /// The trace's reward. An empty list scores 1.0 (nothing is wrong), though traces always
    /// have at least one step.
    pub(crate) fn apply(self, scores: &[f32]) -> f32 {
        if scores.is_empty() {
            return 1.0;
        }
        match self {
            Aggregate::Min => scores.iter().copied().fold(f32::INFINITY, f32::min),
            Aggregate::Product => scores.iter().product(),
            Aggregate::Last => scores[scores.len() - 1],
            Aggregate::Mean => scores.iter().sum::<f32>() / scores.len() as f32,
        }
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Aggregate::Min => "min",
            Aggregate::Product => "product",
            Aggregate::Last => "last",
            Aggregate::Mean => "mean",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_error_is_first_score_below_threshold() {
        let j = Judgement::from_scores(vec![0.9, 0.4, 0.2], 0.5);
        assert_eq!(j.first_error, Some(1));
        assert_eq!(j.category, ErrorCategory::Unspecified);
        let j = Judgement::from_scores(vec![0.9, 0.5], 0.5);
        assert_eq!(j.first_error, None);
        assert_eq!(j.category, ErrorCategory::None);
    }

    #[test]
    fn an_outcome_alone_holds_or_is_unlocated() {
        let pass = Judgement::from_outcome(0.0, 0.5);
        assert_eq!(
            (pass.error_index(), pass.category),
            (-1, ErrorCategory::None)
        );
        let fail = Judgement::from_outcome(-0.01, 0.5);
        assert_eq!(
            (fail.error_index(), fail.category),
            (UNLOCATED, ErrorCategory::Unspecified)
        );
        assert!(fail.step_scores.is_empty());
        // Beside step scores (a composite), the index is the steps'.
        let mut both = Judgement::from_scores(vec![0.9, 0.2], 0.5);
        both.outcome = Some(Outcome::new(3.0, 0.5));
        assert_eq!(both.error_index(), 1);
        both.outcome = Some(Outcome::new(-3.0, 0.5));
        both.first_error = None;
        assert_eq!(both.error_index(), -1);
        assert!((Outcome::new(0.0, 0.5).sigmoid() - 0.5).abs() < 1e-7);
        assert!(Outcome::new(40.0, 1.0).holds && !Outcome::new(-40.0, 1e-9).holds);
    }

    #[test]
    fn aggregates() {
        let s = [0.5, 0.25, 1.0];
        assert_eq!(Aggregate::Min.apply(&s), 0.25);
        assert_eq!(Aggregate::Product.apply(&s), 0.125);
        assert_eq!(Aggregate::Last.apply(&s), 1.0);
        assert!((Aggregate::Mean.apply(&s) - 0.583_333_3).abs() < 1e-6);
    }
}
