//! `[reward]`: how the reward routes (`POST /get_reward`, `POST /slime/reward`) turn an RL
//! trainer's prompt and response into a trace and a verdict into one number, and how long they
//! wait for it.

use crate::rule::{MAX_SECONDS, Refused, refuse};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// The `[reward]` table; every key has a default, so OpenRLHF needs none of them.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct RewardConfig {
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
    /// What a sample whose deadline passed gets (status `timed_out`).
    pub on_timeout: Unscored,
    /// What a sample over the evaluator's size limits gets (status `too_large`: bytes, steps or
    /// tokens): a policy that writes a long answer is data, not a client bug.
    pub on_too_large: Unscored,
    /// What a sample gets when its evaluator (or the judge behind it) could not answer
    /// (status `unavailable`).
    pub on_unavailable: Unscored,
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
            on_timeout: Unscored::Error,
            on_too_large: Unscored::EmptyReward,
            on_unavailable: Unscored::Error,
            policy_tokenizer: None,
            reward_key: None,
        }
    }
}

impl RewardConfig {
    /// The rules a type can't express; the message names the key (`reward.` is the caller's).
    pub(crate) fn check(&self) -> Result<(), Refused> {
        if !self.empty_reward.is_finite() {
            return refuse("empty_reward must be a finite number");
        }
        if let Some(t) = self.timeout_s
            && !(t > 0.0 && t <= MAX_SECONDS)
        {
            return refuse(format!("timeout_s must lie in (0, {MAX_SECONDS}], got {t}"));
        }
        for (key, on) in [
            ("on_timeout", self.on_timeout),
            ("on_too_large", self.on_too_large),
            ("on_unavailable", self.on_unavailable),
        ] {
            if let Unscored::Reward(r) = on
                && !r.is_finite()
            {
                return refuse(format!(
                    "{key} must be \"error\", \"empty_reward\" or a finite number"
                ));
            }
        }
        if let Some(key) = &self.reward_key {
            check_reward_key(key).map_err(|m| Refused(format!("reward_key {m}")))?;
        }
        Ok(())
    }
}

/// What `/slime/reward` puts beside the reward in its dict (numbers, and the sample's status by
/// name); a reward key may not be one.
pub(crate) const SLIME_EXTRAS: [&str; 6] = [
    "trace_score",
    "first_error_index",
    "step_count",
    "category",
    "timed_out",
    "status",
];

/// Why `key` can't name the reward in `/slime/reward`'s dict, if it can't.
pub(crate) fn check_reward_key(key: &str) -> Result<(), String> {
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

/// What a reward sample that got no verdict gets (in TOML: `"error"`, `"empty_reward"` or a
/// number). Whatever it gets, its status says why, so a stand-in reward is never mistaken for
/// a verdict.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "UnscoredToml", into = "UnscoredToml")]
pub(crate) enum Unscored {
    /// The request fails with the sample's error (its status code: 504 for a deadline, 400 for
    /// a size limit, 503 for an evaluator down).
    Error,
    /// The sample gets `empty_reward`; the rest keep theirs.
    EmptyReward,
    /// The sample gets this reward; the rest keep theirs.
    Reward(f32),
}

/// `Unscored` as TOML spells it.
#[derive(Serialize, Deserialize)]
#[serde(untagged)]
enum UnscoredToml {
    Name(String),
    Reward(f32),
}

impl TryFrom<UnscoredToml> for Unscored {
    type Error = String;

    fn try_from(t: UnscoredToml) -> Result<Self, String> {
        match t {
            UnscoredToml::Reward(r) => Ok(Unscored::Reward(r)),
            UnscoredToml::Name(n) if n == "error" => Ok(Unscored::Error),
            UnscoredToml::Name(n) if n == "empty_reward" => Ok(Unscored::EmptyReward),
            UnscoredToml::Name(n) => Err(format!(
                "expected \"error\", \"empty_reward\" or a number, got {n:?}"
            )),
        }
    }
}

impl From<Unscored> for UnscoredToml {
    fn from(u: Unscored) -> Self {
        match u {
            Unscored::Error => UnscoredToml::Name("error".into()),
            Unscored::EmptyReward => UnscoredToml::Name("empty_reward".into()),
            Unscored::Reward(r) => UnscoredToml::Reward(r),
        }
    }
}

impl Unscored {
    /// The reward it gives, or `None` when the request fails instead.
    pub(crate) fn reward(self, empty_reward: f32) -> Option<f32> {
        match self {
            Unscored::Error => None,
            Unscored::EmptyReward => Some(empty_reward),
            Unscored::Reward(r) => Some(r),
        }
    }
}

/// A verdict as one reward.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(crate) enum RewardRule {
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
pub(crate) struct Gives {
    /// Step scores (every kind but an outcome-rm PRM alone).
    pub steps: bool,
    /// An outcome score (an outcome-rm PRM, a composite).
    pub outcome: bool,
}

impl RewardRule {
    pub(crate) const ALL: [RewardRule; 5] = [
        RewardRule::TraceScore,
        RewardRule::Correct,
        RewardRule::Prefix,
        RewardRule::Outcome,
        RewardRule::MinWithOutcome,
    ];

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            RewardRule::TraceScore => "trace_score",
            RewardRule::Correct => "correct",
            RewardRule::Prefix => "prefix",
            RewardRule::Outcome => "outcome",
            RewardRule::MinWithOutcome => "min_with_outcome",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<RewardRule> {
        RewardRule::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// What a verdict needs for this rule.
    pub(crate) fn needs(self) -> Gives {
        Gives {
            steps: matches!(self, RewardRule::Prefix | RewardRule::MinWithOutcome),
            outcome: matches!(self, RewardRule::Outcome | RewardRule::MinWithOutcome),
        }
    }

    /// Why an evaluator that gives `gives` can't serve this rule; `None` when it can.
    pub(crate) fn unmet(self, gives: Gives) -> Option<&'static str> {
        let needs = self.needs();
        if needs.outcome && !gives.outcome {
            Some("needs an outcome score: use a composite, or an outcome-rm PRM")
        } else if needs.steps && !gives.steps {
            Some("needs step scores, which an outcome-rm PRM alone does not give: use a composite")
        } else {
            None
        }
    }
}

/// Where `/get_reward` reads the question.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(crate) enum QuestionFrom {
    /// The last user turn of ChatML, Llama 3 or Mistral chat markup; the whole prompt when it
    /// holds none of them.
    Chat,
    /// The prompt as it is.
    Raw,
}

/// What `/get_reward` does with the trainer's `labels`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub(crate) enum LabelsAs {
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
    fn rules_parse_by_name() {
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

#[cfg(test)]
mod unscored_tests {
    use super::*;

    fn parse(toml_text: &str) -> Result<RewardConfig, String> {
        toml::from_str(toml_text).map_err(|e| e.to_string())
    }

    #[test]
    fn a_stand_in_is_error_empty_reward_or_a_number() {
        let c = parse("on_timeout = \"empty_reward\"\non_too_large = -1\non_unavailable = 0.5")
            .unwrap();
        assert_eq!(c.on_timeout, Unscored::EmptyReward);
        assert_eq!(c.on_too_large, Unscored::Reward(-1.0));
        assert_eq!(c.on_unavailable, Unscored::Reward(0.5));
        let defaults = RewardConfig::default();
        assert_eq!(defaults.on_timeout, Unscored::Error);
        assert_eq!(defaults.on_too_large, Unscored::EmptyReward);
        assert_eq!(defaults.on_unavailable, Unscored::Error);
        let e = parse("on_too_large = \"skip\"").unwrap_err();
        assert!(e.contains("\"skip\"") && e.contains("empty_reward"), "{e}");
        let nan = RewardConfig {
            on_unavailable: Unscored::Reward(f32::NAN),
            ..RewardConfig::default()
        };
        let why = nan.check().unwrap_err().0;
        assert!(why.starts_with("on_unavailable"), "{why}");
        // Written back as read.
        let text = toml::to_string(&c).unwrap();
        assert_eq!(parse(&text).unwrap(), c);
        assert_eq!(Unscored::EmptyReward.reward(-3.0), Some(-3.0));
        assert_eq!(Unscored::Error.reward(-3.0), None);
    }
}
