//! A judge's `[[evaluator]]` keys (kind = "judge"), their defaults and the rules a type can't
//! express; the upstream's own keys are `UpstreamConfig`'s, flattened in.

use super::output::CONSTRAINT_KEYS;
use super::{DomainChoice, OutputMode, UpstreamKind};
use crate::rule::{Refused, refuse};
use crate::upstream::UpstreamConfig;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// An LLM judge behind an OpenAI-compatible chat-completions endpoint.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JudgeConfig {
    /// `base_url`, `api_key_env`, `timeout_s`, `retries`, `requests_per_minute` and the breaker.
    #[serde(flatten)]
    pub endpoint: UpstreamConfig,
    /// The upstream's model name.
    pub model: String,
    /// 0 for one sample, `defaults::VOTING_TEMPERATURE` when voting; never sent with reasoning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default = "defaults::max_tokens")]
    pub max_tokens: u32,
    #[serde(default = "defaults::samples")]
    pub samples: u32,
    /// A reasoning model: sends `max_completion_tokens` and no sampling parameters.
    #[serde(default)]
    pub reasoning: bool,
    /// Extra JSON fields for the request body (`reasoning_effort`, `seed`...).
    #[serde(default, skip_serializing_if = "toml::Table::is_empty")]
    pub extra_body: toml::Table,
    /// The prompt's wording: `math`, `multiple_choice` or `open` for every trace, or `auto`
    /// (the default), chosen per trace by its shape (`domain::auto`).
    #[serde(default)]
    pub(crate) domain: DomainChoice,
    /// Folder whose `{domain}-{mode}.txt` files replace the built-in prompt templates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompts_dir: Option<PathBuf>,
    /// Always send samples as parallel requests instead of one request with `n`.
    #[serde(default)]
    pub parallel_samples: bool,
    /// Entries in the temperature-0 response cache; 0 turns it off.
    #[serde(default = "defaults::cache_entries")]
    pub cache_entries: usize,
    /// Ask once more, for the final two lines only, when a reply has no readable answer.
    #[serde(default = "defaults::yes")]
    pub repair: bool,
    /// The repair turn's text; the built-in one when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repair_prompt: Option<String>,
    /// How the reply is constrained and read: `json_schema`, `grammar` or `text`; the default
    /// follows `upstream` (see `output_mode`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<OutputMode>,
    /// The server behind `base_url` (`openai`, `llama.cpp`, `vllm`, `sglang`): the grammar's
    /// dialect and the default `output`.
    #[serde(default)]
    pub(crate) upstream: UpstreamKind,
    /// Records each verdict as a dataset row (`record = "PATH"`, or a table with `path` and
    /// limits); off when unset. Rows hold the traces, which may hold users' data.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::record::deserialize_record"
    )]
    pub record: Option<crate::record::RecordConfig>,
}

/// A judge's defaults and bounds.
pub(crate) mod defaults {
    pub(crate) const MAX_TOKENS: u32 = 1024;
    /// The temperature of a voting judge that sets none: samples must differ to vote.
    pub(crate) const VOTING_TEMPERATURE: f32 = 0.7;
    pub(crate) const CACHE_ENTRIES: usize = 1024;
    /// Most samples one judge may vote over: each is a full judge reply.
    pub(crate) const MAX_SAMPLES: u32 = 64;

    pub(super) fn max_tokens() -> u32 {
        MAX_TOKENS
    }
    pub(super) fn samples() -> u32 {
        1
    }
    pub(super) fn cache_entries() -> usize {
        CACHE_ENTRIES
    }
    pub(super) fn yes() -> bool {
        true
    }
}

/// Body fields the judge sets itself; `extra_body` must not replace them.
const RESERVED_BODY_KEYS: &[&str] = &["model", "messages", "n", "stream"];

impl JudgeConfig {
    /// The `extra_body` key through which the user already constrains the reply, if any.
    pub(crate) fn own_constraint(&self) -> Option<&'static str> {
        CONSTRAINT_KEYS
            .iter()
            .copied()
            .find(|k| self.extra_body.contains_key(*k))
    }

    /// The output mode in force: the table's, else the default (see `OutputMode::default_for`).
    pub(crate) fn output_mode(&self) -> OutputMode {
        self.output
            .unwrap_or_else(|| OutputMode::default_for(self.own_constraint().is_some()))
    }

    /// The temperature sent upstream: none for a reasoning model.
    pub fn temperature(&self) -> Option<f32> {
        match (self.reasoning, self.temperature) {
            (true, _) => None,
            (false, Some(t)) => Some(t),
            (false, None) if self.samples > 1 => Some(defaults::VOTING_TEMPERATURE),
            (false, None) => Some(0.0),
        }
    }

    /// The rules a type can't express; each message names the key.
    pub fn check(&self) -> Result<(), Refused> {
        self.endpoint.check("the upstream")?;
        if let Some(r) = &self.record {
            r.check()?;
        }
        if self.model.trim().is_empty() {
            return refuse("model must name the upstream's model");
        }
        self.check_sampling()?;
        if self
            .repair_prompt
            .as_deref()
            .is_some_and(|p| p.trim().is_empty())
        {
            return refuse("repair_prompt must not be empty (set repair = false instead)");
        }
        if let Some(key) = RESERVED_BODY_KEYS
            .iter()
            .find(|k| self.extra_body.contains_key(**k))
        {
            return refuse(format!(
                "extra_body must not set `{key}`: the judge sets it (use `samples` for `n`)"
            ));
        }
        self.check_output()
    }

    fn check_sampling(&self) -> Result<(), Refused> {
        if self.reasoning && (self.temperature.is_some() || self.top_p.is_some()) {
            return refuse(
                "temperature and top_p don't apply with reasoning = true (reasoning models \
                 refuse them); remove them",
            );
        }
        if let Some(t) = self.temperature
            && !(0.0..=2.0).contains(&t)
        {
            return refuse(format!("temperature must lie in [0, 2], got {t}"));
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return refuse(format!("top_p must lie in (0, 1], got {p}"));
        }
        if self.max_tokens == 0 {
            return refuse("max_tokens must be at least 1");
        }
        if !(1..=defaults::MAX_SAMPLES).contains(&self.samples) {
            return refuse(format!(
                "samples must lie in [1, {}], got {}",
                defaults::MAX_SAMPLES,
                self.samples
            ));
        }
        if self.samples > 1 && self.temperature == Some(0.0) {
            return refuse(
                "samples > 1 at temperature = 0 would vote over identical replies; raise \
                 temperature",
            );
        }
        Ok(())
    }

    /// A grammar needs an upstream that reads one, and a structured mode can't share the
    /// request with a constraint of the user's own in `extra_body`.
    fn check_output(&self) -> Result<(), Refused> {
        if self.output == Some(OutputMode::Grammar) && !self.upstream.takes_grammar() {
            return refuse(format!(
                "output = \"grammar\" needs upstream = \"llama.cpp\", \"vllm\" or \"sglang\" \
                 (upstream {:?} takes no grammar; use output = \"json_schema\")",
                self.upstream.name()
            ));
        }
        if let Some(mode) = self.output.filter(|m| *m != OutputMode::Text)
            && let Some(key) = self.own_constraint()
        {
            return refuse(format!(
                "extra_body sets `{key}`, which conflicts with output = \"{}\"; remove one \
                 (leave output out, or set it to \"text\", to keep your own constraint)",
                mode.name()
            ));
        }
        Ok(())
    }
}
