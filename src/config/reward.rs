//! `[reward]`: how `POST /get_reward` turns an RL trainer's prompt and response into a trace and
//! a verdict into one number.

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
    /// The evaluator's trace score (its `aggregate` of step scores: min by default).
    TraceScore,
    /// 1 when every step holds, else 0.
    Correct,
    /// The share of steps before the first wrong one: 1 when every step holds.
    Prefix,
}

impl RewardRule {
    pub const ALL: [RewardRule; 3] = [
        RewardRule::TraceScore,
        RewardRule::Correct,
        RewardRule::Prefix,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RewardRule::TraceScore => "trace_score",
            RewardRule::Correct => "correct",
            RewardRule::Prefix => "prefix",
        }
    }

    pub fn parse(s: &str) -> Option<RewardRule> {
        RewardRule::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// The reward of a verdict with `first_error` (-1 when none) over `steps` steps.
    pub fn apply(self, trace_score: f32, first_error: i32, steps: usize) -> f32 {
        match self {
            RewardRule::TraceScore => trace_score,
            RewardRule::Correct => f32::from(u8::from(first_error < 0)),
            RewardRule::Prefix if first_error < 0 || steps == 0 => 1.0,
            RewardRule::Prefix => first_error as f32 / steps as f32,
        }
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

    #[test]
    fn rules() {
        assert_eq!(RewardRule::TraceScore.apply(0.25, 1, 4), 0.25);
        assert_eq!(RewardRule::Correct.apply(0.25, 1, 4), 0.0);
        assert_eq!(RewardRule::Correct.apply(0.25, -1, 4), 1.0);
        assert_eq!(RewardRule::Prefix.apply(0.25, 1, 4), 0.25);
        assert_eq!(RewardRule::Prefix.apply(0.25, 0, 4), 0.0);
        assert_eq!(RewardRule::Prefix.apply(0.25, -1, 4), 1.0);
        for r in RewardRule::ALL {
            assert_eq!(RewardRule::parse(r.as_str()), Some(r));
        }
        assert_eq!(RewardRule::parse("min"), None);
    }
}
