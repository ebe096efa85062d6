//! Configuration: a TOML file, `--set` overrides and flags/env become one validated `Config`.

mod judge_rules;
mod overrides;

use crate::trace::Aggregate;
use overrides::apply_override;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Evaluator kinds this build can serve; the others parse but stop startup.
pub const SERVED_KINDS: &[Kind] = &[Kind::Prm, Kind::Judge, Kind::Cascade];

/// Largest `max_in_flight` / `max_concurrency`: queues are allocated up front.
pub const MAX_CAPACITY: usize = 1 << 20;
/// Longest shutdown grace period, one hour.
pub const MAX_GRACE_S: f64 = 3600.0;

/// PRM families (see docs/prm-formats.md).
pub const PRM_FAMILIES: &[&str] = &[
    "qwen2-math-prm",
    "skywork-prm",
    "math-shepherd",
    "rlhflow",
    "chat-lm",
];

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub server: ServerConfig,
    #[serde(default, rename = "evaluator")]
    pub evaluators: Vec<EvaluatorConfig>,
    /// Where the configuration came from, for error messages.
    #[serde(skip)]
    pub source: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub grpc_addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    /// Evaluator used when a request names none; the first one when unset.
    pub default_evaluator: Option<String>,
    /// Requests admitted at once, across evaluators; more are refused with RESOURCE_EXHAUSTED.
    pub max_in_flight: usize,
    pub shutdown_grace_s: f64,
    /// Default per-evaluator limits on a trace's size.
    pub max_steps: usize,
    pub max_trace_bytes: usize,
    /// Bearer tokens accepted on the Evaluator service; none means no auth.
    pub auth_tokens: Vec<Secret>,
    /// Environment variable holding more bearer tokens, comma-separated.
    pub auth_tokens_env: Option<String>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// Where fetched models (the embedded default) live.
    pub cache_dir: PathBuf,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    Prm,
    Judge,
    Cascade,
}

/// One `[[evaluator]]` table. Keys that don't apply to its kind are refused by `validate`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EvaluatorConfig {
    pub name: String,
    pub kind: Kind,
    #[serde(default = "default_threshold")]
    pub threshold: f32,
    #[serde(default)]
    pub aggregate: Aggregate,
    pub max_steps: Option<usize>,
    pub max_trace_bytes: Option<usize>,
    /// Requests handed to the evaluator at once; the rest wait in its queue.
    #[serde(default = "default_max_concurrency")]
    pub max_concurrency: usize,
    /// prm: local Hugging Face folder; judge: the upstream's model name.
    pub model: Option<String>,
    // prm
    pub family: Option<String>,
    pub device: Option<String>,
    pub dtype: Option<String>,
    pub max_batch_tokens: Option<usize>,
    pub max_batch_size: Option<usize>,
    pub max_wait_ms: Option<u64>,
    // judge
    pub base_url: Option<String>,
    pub api_key_env: Option<String>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub max_tokens: Option<u32>,
    pub samples: Option<u32>,
    pub timeout_s: Option<f64>,
    pub requests_per_minute: Option<u32>,
    pub retries: Option<u32>,
    pub reasoning: Option<bool>,
    /// Extra JSON fields for the request body (`reasoning_effort`, `seed`...).
    pub extra_body: Option<toml::Table>,
    /// Folder whose `{domain}-{mode}.txt` files replace the built-in prompt templates.
    pub prompts_dir: Option<PathBuf>,
    /// Always send samples as parallel requests instead of one request with `n`.
    pub parallel_samples: Option<bool>,
    /// Consecutive failed upstream attempts that open the circuit breaker.
    pub breaker_failures: Option<u32>,
    /// Seconds the open breaker refuses calls before one probe.
    pub breaker_cooldown_s: Option<f64>,
    /// Entries in the temperature-0 response cache; 0 turns it off.
    pub cache_entries: Option<usize>,
    /// Ask once more, for the final two lines only, when a reply has no readable answer.
    pub repair: Option<bool>,
    /// The repair turn's text.
    pub repair_prompt: Option<String>,
    /// How the reply is constrained and read: `json_schema`, `grammar` or `text`.
    pub output: Option<crate::judge::OutputMode>,
    /// The server behind `base_url` (`openai`, `llama.cpp`, `vllm`, `sglang`): the grammar's
    /// dialect and the default `output`.
    pub upstream: Option<crate::judge::UpstreamKind>,
    // cascade
    pub prm: Option<String>,
    pub judge: Option<String>,
    pub escalate_margin: Option<f32>,
    pub categorize: Option<bool>,
}

/// A secret string: never printed, serialised as "[redacted]".
#[derive(Clone, Deserialize, PartialEq)]
#[serde(transparent)]
pub struct Secret(pub String);

#[derive(Debug, thiserror::Error, PartialEq)]
#[error("config {source_name}: {message}")]
pub struct ConfigError {
    pub source_name: String,
    pub message: String,
}

fn default_threshold() -> f32 {
    0.5
}

fn default_max_concurrency() -> usize {
    256
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            grpc_addr: "0.0.0.0:50051".parse().expect("literal address"),
            metrics_addr: "0.0.0.0:9091".parse().expect("literal address"),
            default_evaluator: None,
            max_in_flight: 512,
            shutdown_grace_s: 30.0,
            max_steps: 256,
            max_trace_bytes: 256 * 1024,
            auth_tokens: Vec::new(),
            auth_tokens_env: None,
            tls_cert: None,
            tls_key: None,
            cache_dir: default_cache_dir(),
        }
    }
}

/// `$RETRACE_CACHE_DIR`, else `$HOME/.cache/retrace`, else `.cache/retrace`.
pub fn default_cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("RETRACE_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    match std::env::var_os("HOME") {
        Some(home) => Path::new(&home).join(".cache/retrace"),
        None => PathBuf::from(".cache/retrace"),
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str("[redacted]")
    }
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Prm => "prm",
            Kind::Judge => "judge",
            Kind::Cascade => "cascade",
        }
    }
}

impl Config {
    /// Reads a TOML file, applies `overrides` (dotted `path=value` pairs), and validates.
    pub fn load(path: &Path, overrides: &[String]) -> Result<Config, ConfigError> {
        let source_name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            source_name: source_name.clone(),
            message: format!("cannot read: {e}"),
        })?;
        Config::parse(&text, &source_name, overrides)
    }

    /// Parses TOML text (named `source_name` in errors), applies overrides, validates.
    pub fn parse(
        text: &str,
        source_name: &str,
        overrides: &[String],
    ) -> Result<Config, ConfigError> {
        let err = |message: String| ConfigError {
            source_name: source_name.to_string(),
            message,
        };
        // Parse the text alone first: its errors carry line and column.
        let mut config: Config = toml::from_str(text).map_err(|e| err(e.to_string()))?;
        if !overrides.is_empty() {
            let mut table: toml::Table = toml::from_str(text).map_err(|e| err(e.to_string()))?;
            for o in overrides {
                apply_override(&mut table, o).map_err(&err)?;
            }
            config = Config::deserialize(toml::Value::Table(table))
                .map_err(|e| err(format!("after --set overrides: {e}")))?;
        }
        config.source = source_name.to_string();
        config.validate()?;
        Ok(config)
    }

    /// Builds a validated config from evaluator tables (used for the embedded default).
    pub fn from_parts(
        server: ServerConfig,
        evaluators: Vec<EvaluatorConfig>,
        source_name: &str,
    ) -> Result<Config, ConfigError> {
        let config = Config {
            server,
            evaluators,
            source: source_name.to_string(),
        };
        config.validate()?;
        Ok(config)
    }

    fn fail(&self, message: String) -> ConfigError {
        ConfigError {
            source_name: self.source.clone(),
            message,
        }
    }

    /// Checks every rule a type can't express; the message names the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let s = &self.server;
        if s.max_in_flight == 0 {
            return Err(self.fail("server.max_in_flight must be at least 1".into()));
        }
        if !(0.0..=MAX_GRACE_S).contains(&s.shutdown_grace_s) {
            return Err(self.fail(format!(
                "server.shutdown_grace_s must lie in [0, {MAX_GRACE_S}]"
            )));
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
        if self.evaluators.is_empty() {
            return Err(self.fail("no [[evaluator]] is configured".into()));
        }
        let mut names = HashSet::new();
        for (i, e) in self.evaluators.iter().enumerate() {
            let at = format!("evaluator[{i}] ({:?})", e.name);
            if e.name.trim().is_empty() {
                return Err(self.fail(format!("evaluator[{i}].name must not be empty")));
            }
            if !names.insert(e.name.as_str()) {
                return Err(self.fail(format!("{at}: name is used twice")));
            }
            self.validate_evaluator(e, &at)?;
        }
        if let Some(d) = &s.default_evaluator
            && !names.contains(d.as_str())
        {
            return Err(self.fail(format!(
                "server.default_evaluator {d:?} names no [[evaluator]]"
            )));
        }
        Ok(())
    }

    fn validate_evaluator(&self, e: &EvaluatorConfig, at: &str) -> Result<(), ConfigError> {
        if !(0.0..=1.0).contains(&e.threshold) {
            return Err(self.fail(format!(
                "{at}: threshold must lie in [0, 1], got {}",
                e.threshold
            )));
        }
        if e.max_concurrency == 0 || e.max_concurrency > MAX_CAPACITY {
            return Err(self.fail(format!(
                "{at}: max_concurrency must lie in [1, {MAX_CAPACITY}]"
            )));
        }
        if e.max_steps == Some(0) || e.max_trace_bytes == Some(0) {
            return Err(self.fail(format!(
                "{at}: max_steps and max_trace_bytes must be at least 1"
            )));
        }
        for key in e.present_keys() {
            if !key_applies(e.kind, key) {
                return Err(self.fail(format!(
                    "{at}: key `{key}` does not apply to kind `{}`",
                    e.kind.as_str()
                )));
            }
        }
        let need = |key: &str, v: bool| {
            if v {
                Ok(())
            } else {
                Err(self.fail(format!(
                    "{at}: key `{key}` is required for kind `{}`",
                    e.kind.as_str()
                )))
            }
        };
        match e.kind {
            Kind::Prm => {
                need("family", e.family.is_some())?;
                need("model", e.model.is_some())?;
                let family = e.family.as_deref().unwrap_or_default();
                if !PRM_FAMILIES.contains(&family) {
                    return Err(self.fail(format!(
                        "{at}: family {family:?} is not one of {}",
                        PRM_FAMILIES.join(", ")
                    )));
                }
            }
            Kind::Judge => {
                need("base_url", e.base_url.is_some())?;
                need("model", e.model.is_some())?;
                judge_rules::check_judge(e).map_err(|m| self.fail(format!("{at}: {m}")))?;
            }
            Kind::Cascade => {
                need("prm", e.prm.is_some())?;
                need("judge", e.judge.is_some())?;
                judge_rules::check_cascade(e, &self.evaluators)
                    .map_err(|m| self.fail(format!("{at}: {m}")))?;
            }
        }
        if !SERVED_KINDS.contains(&e.kind) {
            return Err(self.fail(format!(
                "{at}: kind `{}` is not served by this build yet (served: {})",
                e.kind.as_str(),
                SERVED_KINDS
                    .iter()
                    .map(|k| k.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        Ok(())
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
            let value = std::env::var(var).map_err(|_| {
                self.fail(format!(
                    "server.auth_tokens_env names {var}, which is not set"
                ))
            })?;
            tokens.extend(
                value
                    .split(',')
                    .map(str::trim)
                    .filter(|t| !t.is_empty())
                    .map(|t| Secret(t.to_string())),
            );
        }
        Ok(tokens)
    }

    /// The resolved configuration as TOML, secrets redacted: safe to log.
    pub fn redacted_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot render config: {e}"))
    }
}

impl EvaluatorConfig {
    /// A bare evaluator table, for tests and the embedded default.
    pub fn new(name: &str, kind: Kind) -> Self {
        EvaluatorConfig {
            name: name.to_string(),
            kind,
            threshold: default_threshold(),
            aggregate: Aggregate::default(),
            max_steps: None,
            max_trace_bytes: None,
            max_concurrency: default_max_concurrency(),
            model: None,
            family: None,
            device: None,
            dtype: None,
            max_batch_tokens: None,
            max_batch_size: None,
            max_wait_ms: None,
            base_url: None,
            api_key_env: None,
            temperature: None,
            top_p: None,
            max_tokens: None,
            samples: None,
            timeout_s: None,
            requests_per_minute: None,
            retries: None,
            reasoning: None,
            extra_body: None,
            prompts_dir: None,
            parallel_samples: None,
            breaker_failures: None,
            breaker_cooldown_s: None,
            cache_entries: None,
            repair: None,
            repair_prompt: None,
            output: None,
            upstream: None,
            prm: None,
            judge: None,
            escalate_margin: None,
            categorize: None,
        }
    }

    /// Kind-specific keys that are set.
    fn present_keys(&self) -> Vec<&'static str> {
        let flags: [(&'static str, bool); 30] = [
            ("family", self.family.is_some()),
            ("device", self.device.is_some()),
            ("dtype", self.dtype.is_some()),
            ("max_batch_tokens", self.max_batch_tokens.is_some()),
            ("max_batch_size", self.max_batch_size.is_some()),
            ("max_wait_ms", self.max_wait_ms.is_some()),
            ("base_url", self.base_url.is_some()),
            ("api_key_env", self.api_key_env.is_some()),
            ("temperature", self.temperature.is_some()),
            ("top_p", self.top_p.is_some()),
            ("max_tokens", self.max_tokens.is_some()),
            ("samples", self.samples.is_some()),
            ("timeout_s", self.timeout_s.is_some()),
            ("requests_per_minute", self.requests_per_minute.is_some()),
            ("retries", self.retries.is_some()),
            ("reasoning", self.reasoning.is_some()),
            ("extra_body", self.extra_body.is_some()),
            ("prompts_dir", self.prompts_dir.is_some()),
            ("parallel_samples", self.parallel_samples.is_some()),
            ("breaker_failures", self.breaker_failures.is_some()),
            ("breaker_cooldown_s", self.breaker_cooldown_s.is_some()),
            ("cache_entries", self.cache_entries.is_some()),
            ("repair", self.repair.is_some()),
            ("repair_prompt", self.repair_prompt.is_some()),
            ("output", self.output.is_some()),
            ("upstream", self.upstream.is_some()),
            ("prm", self.prm.is_some()),
            ("judge", self.judge.is_some()),
            ("escalate_margin", self.escalate_margin.is_some()),
            ("categorize", self.categorize.is_some()),
        ];
        let mut keys: Vec<_> = flags
            .iter()
            .filter(|(_, set)| *set)
            .map(|(k, _)| *k)
            .collect();
        if self.model.is_some() {
            keys.push("model");
        }
        keys
    }
}

/// Whether a kind-specific key belongs to `kind`.
fn key_applies(kind: Kind, key: &str) -> bool {
    const PRM: &[&str] = &[
        "model",
        "family",
        "device",
        "dtype",
        "max_batch_tokens",
        "max_batch_size",
        "max_wait_ms",
    ];
    const JUDGE: &[&str] = &[
        "model",
        "base_url",
        "api_key_env",
        "temperature",
        "top_p",
        "max_tokens",
        "samples",
        "timeout_s",
        "requests_per_minute",
        "retries",
        "reasoning",
        "extra_body",
        "prompts_dir",
        "parallel_samples",
        "breaker_failures",
        "breaker_cooldown_s",
        "cache_entries",
        "repair",
        "repair_prompt",
        "output",
        "upstream",
    ];
    const CASCADE: &[&str] = &["prm", "judge", "escalate_margin", "categorize"];
    match kind {
        Kind::Prm => PRM.contains(&key),
        Kind::Judge => JUDGE.contains(&key),
        Kind::Cascade => CASCADE.contains(&key),
    }
}

#[cfg(test)]
mod tests;
