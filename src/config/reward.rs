//! `[reward]`: how the reward routes (`POST /get_reward`, `POST /slime/reward`) turn an RL
//! trainer's prompt and response into a trace and a verdict into one number, and how long they
//! wait for it.

use crate::rule::{MAX_SECONDS, Refused, refuse};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

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
    /// Seconds a reward request may take when its caller sends no `x-request-timeout` (the
    /// trainers post fixed bodies and headers); unset: no deadline of the server's own.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
    /// What a sample whose deadline passed gets.
    pub on_timeout: OnTimeout,
    /// The policy's tokenizer (a folder holding `tokenizer.json`): with it, `/get_reward` takes
    /// token ids (`prompt_ids`, `completion_ids`) and decodes them itself.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy_tokenizer: Option<PathBuf>,
    /// `/slime/reward` answers `{KEY: reward, ...}` instead of a bare number (slime's
    /// `--reward-key`); `?reward_key=` overrides it per trainer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reward_key: Option<String>,
}

impl Default for RewardConfig {
    fn default() -> Self {
        RewardConfig {
            evaluator: None,
            rule: RewardRule::TraceScore,
            question: QuestionFrom::Chat,
            labels: LabelsAs::Ignore,
            empty_reward: 0.0,
            timeout_s: None,
            on_timeout: OnTimeout::Error,
            policy_tokenizer: None,
            reward_key: None,
        }
    }
}

impl RewardConfig {
    /// The rules a type can't express; the message names the key (`reward.` is the caller's).
    pub fn check(&self) -> Result<(), Refused> {
        if !self.empty_reward.is_finite() {
            return refuse("empty_reward must be a finite number");
        }
        if let Some(t) = self.timeout_s
            && !(t > 0.0 && t <= MAX_SECONDS)
        {
            return refuse(format!("timeout_s must lie in (0, {MAX_SECONDS}], got {t}"));
        }
        if let Some(key) = &self.reward_key {
            check_reward_key(key).map_err(|m| Refused(format!("reward_key {m}")))?;
        }
        Ok(())
    }
}

/// The numbers `/slime/reward` puts beside the reward in its dict; a reward key may not be one.
pub const SLIME_EXTRAS: [&str; 5] = [
    "trace_score",
    "first_error_index",
    "step_count",
    "category",
    "timed_out",
];

/// Why `key` can't name the reward in `/slime/reward`'s dict, if it can't.
pub fn check_reward_key(key: &str) -> Result<(), String> {
    if key.trim().is_empty() {
        return Err("must not be empty".into());
    }
    if SLIME_EXTRAS.contains(&key) {
        return Err(format!(
            "{key:?} names one of the numbers the dict carries beside the reward ({})",
            SLIME_EXTRAS.join(", ")
        ));
    }
    Ok(())
}

/// What a reward sample gets when its deadline passes before its verdict.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    /// The request fails with DEADLINE_EXCEEDED (HTTP 504) naming the deadline.
    Error,
    /// The sample gets `empty_reward` and `timed_out` 1 in its logs; the rest keep theirs.
    EmptyReward,
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

    #[test]
    fn checks_name_the_key() {
        let ok = RewardConfig {
            timeout_s: Some(30.0),
            reward_key: Some("score".into()),
            ..RewardConfig::default()
        };
        assert_eq!(ok.check(), Ok(()));
        let cases = [
            (
                RewardConfig {
                    timeout_s: Some(0.0),
                    ..ok.clone()
                },
                "timeout_s",
            ),
            (
                RewardConfig {
                    timeout_s: Some(f64::NAN),
                    ..ok.clone()
                },
                "timeout_s",
            ),
            (
                RewardConfig {
                    timeout_s: Some(MAX_SECONDS + 1.0),
                    ..ok.clone()
                },
                "timeout_s",
            ),
            (
                RewardConfig {
                    reward_key: Some("step_count".into()),
                    ..ok.clone()
                },
                "reward_key",
            ),
            (
                RewardConfig {
                    reward_key: Some(" ".into()),
                    ..ok.clone()
                },
                "reward_key",
            ),
            (
                RewardConfig {
                    empty_reward: f32::INFINITY,
                    ..ok.clone()
                },
                "empty_reward",
            ),
        ];
        for (config, key) in cases {
            let e = config.check().unwrap_err().0;
            assert!(e.starts_with(key), "{e}");
        }
    }
}
