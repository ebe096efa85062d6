//! Configuration: a TOML file, `--set` overrides and typed flags become one validated `Config`.
//!
//! It owns no kind's keys: each kind's struct lives with the kind (`prm/config.rs`,
//! `judge/config.rs`, `cascade.rs`, `upstream/config.rs` for the keys every upstream shares),
//! and this module dispatches on `kind`. Adding a key: a field (with its default) in the kind's
//! struct, a line in its `check` if a type can't express the rule, and a line in
//! docs/configuration.md.

mod embedded;
mod evaluator;
mod flags;
mod keys;
mod overrides;
mod reward;
mod rules;

pub use embedded::install_head;
pub use evaluator::EvaluatorConfig;
pub use evaluator::KindConfig;
pub use flags::ServerFlags;
pub(crate) use reward::{
    Gives, LabelsAs, QuestionFrom, RewardConfig, RewardRule, SLIME_EXTRAS, check_reward_key,
};

use crate::engine::{Admission, SlotSpec};
pub(crate) use crate::env::{Env, Secret};
use overrides::apply_override;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Largest `max_in_flight` / `max_concurrency`: queues are allocated up front.
pub(crate) const MAX_CAPACITY: usize = 1 << 20;
/// Longest shutdown grace period, one hour.
pub(crate) const MAX_GRACE_S: f64 = crate::rule::MAX_SECONDS;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub server: ServerConfig,
    #[serde(default, rename = "evaluator")]
    pub evaluators: Vec<EvaluatorConfig>,
    /// How the reward routes (`/get_reward`, `/slime/reward`) read samples and make rewards.
    #[serde(default)]
    pub(crate) reward: RewardConfig,
    /// Where the configuration came from, for error messages.
    #[serde(skip)]
    pub source: String,
    /// The environment its `*_env` keys are read from: the process's, unless a test hands in
    /// its own.
    #[serde(skip)]
    pub env: Env,
    /// The line of each `[[evaluator]]` header in the source text, so a rule's error names its
    /// table's line as a parse error does; empty when the text spells them otherwise.
    #[serde(skip)]
    pub evaluator_lines: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub grpc_addr: SocketAddr,
    /// HTTP/JSON: OpenRLHF's `/get_reward`, `/v1/evaluate`, `/v1/rank`.
    pub http_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    /// Evaluator used when a request names none; the first one when unset.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub default_evaluator: Option<String>,
    /// Requests admitted at once, across evaluators; more are refused with RESOURCE_EXHAUSTED.
    pub max_in_flight: usize,
    pub shutdown_grace_s: f64,
    /// A gRPC connection's life: past it the server sends GOAWAY, so the client makes its next
    /// calls on a new connection (behind a headless Service, maybe to a pod that joined since).
    pub max_connection_age_s: f64,
    /// How long calls in flight on a connection past its age may still finish; then it closes.
    pub max_connection_age_grace_s: f64,
    /// HTTP/2 PINGs every so often on each gRPC connection, and how long the answer may take
    /// before the connection is dropped: finds peers that vanished without closing.
    pub http2_keepalive_interval_s: f64,
    pub http2_keepalive_timeout_s: f64,
    /// Default per-evaluator limits on a trace's size.
    pub max_steps: usize,
    pub max_trace_bytes: usize,
    /// Bearer tokens accepted on the Evaluator service; none means no auth.
    pub auth_tokens: Vec<Secret>,
    /// Environment variable holding more bearer tokens, comma-separated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auth_tokens_env: Option<String>,
    /// Environment variable holding the admin calls' bearer tokens (Reload), comma-separated.
    /// Unset, admin calls are refused but on a loopback listener.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_tokens_env: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// Where fetched models (the embedded default) live.
    pub cache_dir: PathBuf,
}

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("config {source_name}: {message}")]
pub struct ConfigError {
    pub source_name: String,
    pub message: String,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            grpc_addr: "0.0.0.0:50051".parse().expect("literal address"),
            http_addr: "0.0.0.0:8080".parse().expect("literal address"),
            metrics_addr: "0.0.0.0:9091".parse().expect("literal address"),
            default_evaluator: None,
            max_in_flight: 512,
            shutdown_grace_s: 30.0,
            max_connection_age_s: 300.0,
            max_connection_age_grace_s: 60.0,
            http2_keepalive_interval_s: 60.0,
            http2_keepalive_timeout_s: 20.0,
            max_steps: 256,
            max_trace_bytes: 256 * 1024,
            auth_tokens: Vec::new(),
            auth_tokens_env: None,
            admin_tokens_env: None,
            tls_cert: None,
            tls_key: None,
            cache_dir: Env::process().cache_dir(),
        }
    }
}

impl Config {
    /// Reads a TOML file, applies `--set` overrides (dotted `path=value` pairs), validates.
    pub fn load(path: &Path, sets: &[String]) -> Result<Config, ConfigError> {
        Config::load_with(path, sets, &ServerFlags::default())
    }

    /// `load`, then the flags laid over `[server]` before validation.
    pub fn load_with(
        path: &Path,
        sets: &[String],
        flags: &ServerFlags,
    ) -> Result<Config, ConfigError> {
        let source_name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            source_name: source_name.clone(),
            message: format!("cannot read: {e}"),
        })?;
        Config::parse_with(&text, &source_name, sets, flags)
    }

    /// Parses TOML text (named `source_name` in errors), applies overrides, validates.
    pub fn parse(text: &str, source_name: &str, sets: &[String]) -> Result<Config, ConfigError> {
        Config::parse_with(text, source_name, sets, &ServerFlags::default())
    }

    /// `parse`, then the flags laid over `[server]` before validation.
    pub(crate) fn parse_with(
        text: &str,
        source_name: &str,
        sets: &[String],
        flags: &ServerFlags,
    ) -> Result<Config, ConfigError> {
        let err = |message: String| ConfigError {
            source_name: source_name.to_string(),
            message,
        };
        // Parse the text alone first: its errors carry line and column.
        let mut config: Config = toml::from_str(text).map_err(|e| {
            let line = e.span().map(|s| text[..s.start].matches('\n').count() + 1);
            let table = toml::from_str::<toml::Table>(text).ok();
            err(
                match table.as_ref().and_then(|t| at_fault(t, e.message(), line)) {
                    Some(message) => message,
                    None => e.to_string(),
                },
            )
        })?;
        if !sets.is_empty() {
            let mut table: toml::Table = toml::from_str(text).map_err(|e| err(e.to_string()))?;
            for o in sets {
                let bare = apply_override(&mut table, o).map_err(|e| err(e.to_string()))?;
                // Bare text is a string: refused at once, naming the --set, for a key that
                // takes none.
                if let Some(raw) = bare
                    && let Err(e) = Config::deserialize(toml::Value::Table(table.clone()))
                    && let Some(refused) = overrides::check_bare(o, raw, e.message())
                {
                    return Err(err(refused.to_string()));
                }
            }
            config = Config::deserialize(toml::Value::Table(table.clone())).map_err(|e| {
                let message = at_fault(&table, e.message(), None).unwrap_or(e.to_string());
                err(format!("after --set overrides: {message}"))
            })?;
        }
        flags.apply(&mut config.server);
        config.source = source_name.to_string();
        config.evaluator_lines = header_lines(text, "[[evaluator]]");
        config.validate()?;
        config.resolve();
        Ok(config)
    }

    /// The embedded default: SmolLM2-135M-Instruct's GGUF as a head trained on it,
    /// `smollm2-head` (the default), and as the zero-shot `chat-lm` PRM `smollm2`, from the
    /// cache folder wherever flags or `--set` put it. `install_head` writes the head there.
    pub fn embedded(sets: &[String], flags: &ServerFlags) -> Result<Config, ConfigError> {
        let mut config = Config::parse_with(&embedded::text(), "embedded default", sets, flags)?;
        embedded::place(&mut config);
        Ok(config)
    }

    /// Fills in a PRM's in-process keys where its table leaves them out. An unset threshold
    /// stays unset: the engine decides it (a trained head's own, else the default), as only a
    /// loaded head knows its own.
    fn resolve(&mut self) {
        for e in &mut self.evaluators {
            if let KindConfig::Prm(p) = &mut e.kind {
                *p = p.clone().resolved();
            }
        }
    }

    fn fail(&self, message: String) -> ConfigError {
        ConfigError {
            source_name: self.source.clone(),
            message,
        }
    }

    /// Checks every rule a type can't express; the message names the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_server()?;
        if self.evaluators.is_empty() {
            return Err(self.fail("no [[evaluator]] is configured".into()));
        }
        let mut names = HashSet::new();
        for (i, e) in self.evaluators.iter().enumerate() {
            if e.name.trim().is_empty() {
                return Err(self.fail(format!("evaluator[{i}].name must not be empty")));
            }
            let line = match self.evaluator_lines.get(i) {
                Some(l) if self.evaluator_lines.len() == self.evaluators.len() => {
                    format!(" (line {l})")
                }
                _ => String::new(),
            };
            let at = format!("evaluator[{i}] ({:?}){line}", e.name);
            if !names.insert(e.name.as_str()) {
                return Err(self.fail(format!("{at}: name is used twice")));
            }
            rules::check(e, &self.evaluators).map_err(|m| self.fail(format!("{at}: {m}")))?;
        }
        if let Some(d) = &self.server.default_evaluator
            && !names.contains(d.as_str())
        {
            return Err(self.fail(format!(
                "server.default_evaluator {d:?} names no [[evaluator]]"
            )));
        }
        if let Some(r) = &self.reward.evaluator
            && !names.contains(r.as_str())
        {
            return Err(self.fail(format!("reward.evaluator {r:?} names no [[evaluator]]")));
        }
        self.validate_records()?;
        self.validate_reward_rule()?;
        self.reward
            .check()
            .map_err(|m| self.fail(format!("reward.{m}")))?;
        Ok(())
    }

    /// That the evaluator `/get_reward` uses gives what `reward.rule` reads.
    /// No two evaluators record to one file: their writers would interleave rows and rotate
    /// each other's files.
    fn validate_records(&self) -> Result<(), ConfigError> {
        let mut by_file = std::collections::HashMap::new();
        for e in &self.evaluators {
            let Some(record) = e.kind.record() else {
                continue;
            };
            if let Some(first) = by_file.insert(record.current_file(), e.name.as_str()) {
                return Err(self.fail(format!(
                    "evaluators {first:?} and {:?} both record to {}: give each its own \
                     record path",
                    e.name,
                    record.current_file().display()
                )));
            }
        }
        Ok(())
    }

    fn validate_reward_rule(&self) -> Result<(), ConfigError> {
        let name = self
            .reward
            .evaluator
            .as_deref()
            .unwrap_or_else(|| self.default_evaluator());
        let Some(e) = self.evaluators.iter().find(|e| e.name == name) else {
            return Ok(());
        };
        match self.reward.rule.unmet(e.kind.gives()) {
            Some(why) => Err(self.fail(format!(
                "reward.rule = {:?} {why}; evaluator {name:?} (the reward's) is a {}",
                self.reward.rule.as_str(),
                e.kind.describe_kind()
            ))),
            None => Ok(()),
        }
    }

    fn validate_server(&self) -> Result<(), ConfigError> {
        let s = &self.server;
        if s.max_in_flight == 0 {
            return Err(self.fail("server.max_in_flight must be at least 1".into()));
        }
        if !(0.0..=MAX_GRACE_S).contains(&s.shutdown_grace_s) {
            return Err(self.fail(format!(
                "server.shutdown_grace_s must lie in [0, {MAX_GRACE_S}]"
            )));
        }
        for (key, seconds) in [
            ("max_connection_age_s", s.max_connection_age_s),
            ("max_connection_age_grace_s", s.max_connection_age_grace_s),
            ("http2_keepalive_interval_s", s.http2_keepalive_interval_s),
            ("http2_keepalive_timeout_s", s.http2_keepalive_timeout_s),
        ] {
            if !(seconds > 0.0 && seconds <= crate::rule::MAX_SECONDS) {
                return Err(self.fail(format!(
                    "server.{key} must lie in (0, {}] seconds, got {seconds}",
                    crate::rule::MAX_SECONDS
                )));
            }
        }
        if s.max_in_flight > MAX_CAPACITY {
            return Err(self.fail(format!(
                "server.max_in_flight must be at most {MAX_CAPACITY}"
            )));
        }
        if s.auth_tokens.iter().any(|t| t.0.trim().is_empty()) {
            return Err(self.fail("server.auth_tokens must not hold an empty token".into()));
        }
        if s.max_steps == 0 || s.max_trace_bytes == 0 {
            return Err(
                self.fail("server.max_steps and server.max_trace_bytes must be at least 1".into())
            );
        }
        if s.tls_cert.is_some() != s.tls_key.is_some() {
            return Err(self.fail("server.tls_cert and server.tls_key must be set together".into()));
        }
        Ok(())
    }

    /// What the engine needs of each evaluator before it is loaded.
    pub(crate) fn slot_specs(&self) -> Vec<SlotSpec> {
        self.evaluators
            .iter()
            .map(|e| SlotSpec {
                name: e.name.clone(),
                threshold: e.threshold,
                aggregate: e.aggregate,
                max_steps: e.max_steps.unwrap_or(self.server.max_steps),
                max_trace_bytes: e.max_trace_bytes.unwrap_or(self.server.max_trace_bytes),
                max_concurrency: e.max_concurrency,
                sharing: e.kind.sharing(),
                tier: match e.kind {
                    KindConfig::Prm(_) | KindConfig::Judge(_) => 0,
                    KindConfig::Cascade(_) => 1,
                    KindConfig::Composite(_) => 2,
                },
                loading: e.kind.loading(),
            })
            .collect()
    }

    /// The limits every evaluator shares.
    pub(crate) fn admission(&self) -> Admission {
        Admission {
            max_in_flight: self.server.max_in_flight,
            default: self.default_evaluator().to_string(),
        }
    }

    /// The evaluator requests get when they name none.
    pub fn default_evaluator(&self) -> &str {
        self.server
            .default_evaluator
            .as_deref()
            .unwrap_or(&self.evaluators[0].name)
    }

    /// Every accepted bearer token: the file's plus those in `auth_tokens_env`.
    pub fn auth_tokens(&self) -> Result<Vec<Secret>, ConfigError> {
        let mut tokens = self.server.auth_tokens.clone();
        if let Some(var) = &self.server.auth_tokens_env {
            tokens.extend(self.tokens_in("auth_tokens_env", var)?);
        }
        Ok(tokens)
    }

    /// The admin calls' bearer tokens, from `admin_tokens_env`; none when it is unset. Set
    /// but empty is an error: an operator who set it meant admin calls to need a token.
    pub fn admin_tokens(&self) -> Result<Vec<Secret>, ConfigError> {
        let Some(var) = &self.server.admin_tokens_env else {
            return Ok(Vec::new());
        };
        let tokens = self.tokens_in("admin_tokens_env", var)?;
        if tokens.is_empty() {
            return Err(self.fail(format!(
                "server.admin_tokens_env names {var}, which holds no token"
            )));
        }
        Ok(tokens)
    }

    /// The comma-separated tokens in the variable `var` that the server key `key` names.
    fn tokens_in(&self, key: &str, var: &str) -> Result<Vec<Secret>, ConfigError> {
        let value = self
            .env
            .secret(var)
            .ok_or_else(|| self.fail(format!("server.{key} names {var}, which is not set")))?;
        Ok(value
            .split(',')
            .map(str::trim)
            .filter(|t| !t.is_empty())
            .map(|t| Secret(t.to_string()))
            .collect())
    }

    /// The resolved configuration as TOML, secrets redacted: safe to log.
    pub fn redacted_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot render config: {e}"))
    }
}

/// The 1-based lines of `text` that open a `header` table (`[[evaluator]]`), in order.
fn header_lines(text: &str, header: &str) -> Vec<usize> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| {
            let l = l.trim_start();
            l.strip_prefix(header)
                .is_some_and(|rest| rest.trim().is_empty() || rest.trim_start().starts_with('#'))
        })
        .map(|(i, _)| i + 1)
        .collect()
}

/// The `[[evaluator]]` table a deserialisation error comes from, named as validation names it:
/// a typed table's error alone says which key, not whose.
fn at_fault(table: &toml::Table, message: &str, line: Option<usize>) -> Option<String> {
    let list = table.get("evaluator")?.as_array()?;
    let (i, t) = list
        .iter()
        .enumerate()
        .find(|(_, t)| EvaluatorConfig::deserialize((*t).clone()).is_err())?;
    let name = t.get("name").and_then(toml::Value::as_str).unwrap_or("?");
    let line = line.map(|l| format!(" (line {l})")).unwrap_or_default();
    let kind = t.get("kind").and_then(toml::Value::as_str);
    let moved = crate::prm::MOVED_TO_VLLM
        .iter()
        .find(|k| kind == Some("prm") && t.get(**k).is_some());
    let message = match moved {
        Some(key) => format!(
            "{key}: a PRM's vLLM keys now live in their own table; move `{key}` under \
             [evaluator.vllm], after this evaluator's other keys"
        ),
        None => keys::with_known_keys(message.trim(), kind),
    };
    Some(format!("evaluator[{i}] ({name:?}){line}: {message}"))
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod outcome_tests;
