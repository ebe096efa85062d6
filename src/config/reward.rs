//! `[reward]`: how `POST /get_reward` turns an RL trainer's prompt and response into a trace and
//! a verdict into one number.

use crate::trace::Verdict;
use serde::{Deserialize, Serialize};

/// The `[reward]` table; every key has a default, so OpenRLHF needs none of them.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct RewardConfig {
    /// The evaluator that scores samples; the server's default when unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub evaluator: Option<String>,
    /// Which number a verdict becomes.
    pub rule: RewardRule,
    /// Where the question comes from.
    pub question: QuestionFrom,
    /// What the trainer's `labels` are for.
    pub labels: LabelsAs,
    /// The reward of a response with no step at all (an empty completion): a sample, not an
    /// error, so one empty rollout does not fail the trainer's whole batch.
    pub empty_reward: f32,
}

impl Default for RewardConfig {
    fn default() -> Self {
        RewardConfig {
            evaluator: None,
            rule: RewardRule::TraceScore,
            question: QuestionFrom::Chat,
            labels: LabelsAs::Ignore,
            empty_reward: 0.0,
        }
    }
}

/// A verdict as one reward.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum RewardRule {
    /// The evaluator's trace score (its `aggregate` of step scores: min by default; an outcome
    /// model's raw score when it has no step scores).
    TraceScore,
    /// 1 when the trace holds, else 0.
    Correct,
    /// The share of steps before the first wrong one: 1 when every step holds.
    Prefix,
    /// The outcome model's raw score (a composite's, or an outcome-rm PRM's).
    Outcome,
    /// The smaller of the trace score and sigmoid(outcome score): both in [0, 1], so a trace
    /// rewarded high needs both its steps and its whole to hold (a composite only).
    MinWithOutcome,
}

/// What a verdict must carry for a rule to apply, and what an evaluator gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gives {
    /// Step scores (every kind but an outcome-rm PRM alone).
    pub steps: bool,
    /// An outcome score (an outcome-rm PRM, a composite).
    pub outcome: bool,
}

impl RewardRule {
    pub const ALL: [RewardRule; 5] = [
        RewardRule::TraceScore,
        RewardRule::Correct,
        RewardRule::Prefix,
        RewardRule::Outcome,
        RewardRule::MinWithOutcome,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RewardRule::TraceScore => "trace_score",
            RewardRule::Correct => "correct",
            RewardRule::Prefix => "prefix",
            RewardRule::Outcome => "outcome",
            RewardRule::MinWithOutcome => "min_with_outcome",
        }
    }

    pub fn parse(s: &str) -> Option<RewardRule> {
        RewardRule::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// What a verdict needs for this rule.
    pub fn needs(self) -> Gives {
        Gives {
            steps: matches!(self, RewardRule::Prefix | RewardRule::MinWithOutcome),
            outcome: matches!(self, RewardRule::Outcome | RewardRule::MinWithOutcome),
        }
    }

    /// Why an evaluator that gives `gives` can't serve this rule; `None` when it can.
    pub fn unmet(self, gives: Gives) -> Option<&'static str> {
        let needs = self.needs();
        if needs.outcome && !gives.outcome {
            Some("needs an outcome score: use a composite, or an outcome-rm PRM")
        } else if needs.steps && !gives.steps {
            Some("needs step scores, which an outcome-rm PRM alone does not give: use a composite")
        } else {
            None
        }
    }

    /// The reward of `v`, a verdict over `steps` steps; the reason when `v` lacks what the rule
    /// needs.
    pub fn apply(self, v: &Verdict, steps: usize) -> Result<f32, &'static str> {
        let j = &v.judgement;
        let gives = Gives {
            steps: !j.step_scores.is_empty(),
            outcome: j.outcome.is_some(),
        };
        if let Some(why) = self.unmet(gives) {
            return Err(why);
        }
        let first = j.error_index();
        Ok(match (self, j.outcome) {
            (RewardRule::TraceScore, _) => v.trace_score,
            (RewardRule::Correct, _) => f32::from(u8::from(first == -1)),
            (RewardRule::Prefix, _) if first == -1 || steps == 0 => 1.0,
            (RewardRule::Prefix, _) => first as f32 / steps as f32,
            (RewardRule::Outcome, Some(o)) => o.score,
            (RewardRule::MinWithOutcome, Some(o)) => v.trace_score.min(o.sigmoid()),
            (RewardRule::Outcome | RewardRule::MinWithOutcome, None) => {
                return Err("needs an outcome score");
            }
        })
    }
}

/// Where `/get_reward` reads the question.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum QuestionFrom {
    /// The last user turn of ChatML, Llama 3 or Mistral chat markup; the whole prompt when it
    /// holds none of them.
    Chat,
    /// The prompt as it is.
    Raw,
}

/// What `/get_reward` does with the trainer's `labels`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum LabelsAs {
    /// Reference-free judging: labels are not read.
    Ignore,
    /// Each sample's label is its gold answer (reference-based mode); an empty label leaves
    /// that sample reference-free.
    Reference,
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::trace::{Judgement, Outcome};
    use std::time::Duration;

    fn verdict(j: Judgement, trace_score: f32) -> Verdict {
        Verdict {
            evaluator: "e".into(),
            judgement: j,
            threshold: 0.5,
            trace_score,
            queue: Duration::ZERO,
            total: Duration::ZERO,
        }
    }

    #[test]
    fn rules() {
        let steps = verdict(Judgement::from_scores(vec![0.9, 0.25, 0.9, 0.9], 0.5), 0.25);
        let apply = |r: RewardRule, v: &Verdict| r.apply(v, 4);
        assert_eq!(apply(RewardRule::TraceScore, &steps), Ok(0.25));
        assert_eq!(apply(RewardRule::Correct, &steps), Ok(0.0));
        assert_eq!(apply(RewardRule::Prefix, &steps), Ok(0.25));
        let holds = verdict(Judgement::from_scores(vec![0.9; 4], 0.5), 0.9);
        assert_eq!(apply(RewardRule::Correct, &holds), Ok(1.0));
        assert_eq!(apply(RewardRule::Prefix, &holds), Ok(1.0));
        for r in RewardRule::ALL {
            assert_eq!(RewardRule::parse(r.as_str()), Some(r));
        }
        assert_eq!(RewardRule::parse("min"), None);
    }

    #[test]
    fn outcome_rules_need_an_outcome_score() {
        let steps = verdict(Judgement::from_scores(vec![0.9, 0.8], 0.5), 0.8);
        for r in [RewardRule::Outcome, RewardRule::MinWithOutcome] {
            assert!(r.apply(&steps, 2).unwrap_err().contains("outcome score"));
        }
        let mut j = Judgement::from_scores(vec![0.9, 0.8], 0.5);
        j.outcome = Some(Outcome::new(-1.0, 0.5));
        let both = verdict(j, 0.8);
        assert_eq!(RewardRule::Outcome.apply(&both, 2), Ok(-1.0));
        let low = 1.0 / (1.0 + 1f32.exp());
        let got = RewardRule::MinWithOutcome.apply(&both, 2).unwrap();
        assert!((got - low).abs() < 1e-6, "{got}");
        // The steps hold, so `correct` is the PRM's even though the outcome model disagrees.
        assert_eq!(RewardRule::Correct.apply(&both, 2), Ok(1.0));
        let alone = verdict(Judgement::from_outcome(-1.0, 0.5), -1.0);
        assert_eq!(RewardRule::TraceScore.apply(&alone, 2), Ok(-1.0));
        assert_eq!(RewardRule::Correct.apply(&alone, 2), Ok(0.0));
        assert!(RewardRule::Prefix.apply(&alone, 2).is_err());
        assert!(RewardRule::MinWithOutcome.apply(&alone, 2).is_err());
    }
}
