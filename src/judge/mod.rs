//! LLM judges behind an OpenAI-compatible endpoint: prompt templates, reply parsing and voting,
//! the reliable HTTP call, and the `judge` evaluator built from its config table.

mod call;
pub mod client;
mod evaluator;
pub mod output;
pub mod parse;
pub mod policy;
pub mod prompt;

pub use call::{CallError, CallPolicy};
pub use evaluator::JudgeEvaluator;
pub use output::{OutputMode, UpstreamKind};

use crate::config::{EvaluatorConfig, Secret};
use crate::engine::EngineError;
use client::{AttemptError, ChatParams, Upstream};
use prompt::{PromptError, Template, TemplateKind, Templates};
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// Defaults for keys a judge table leaves out (README: "Judge evaluators").
pub const DEFAULT_MAX_TOKENS: u32 = 1024;
pub const DEFAULT_VOTING_TEMPERATURE: f32 = 0.7;
pub const DEFAULT_TIMEOUT_S: f64 = 60.0;
pub const DEFAULT_RETRIES: u32 = 2;
pub const DEFAULT_BREAKER_FAILURES: u32 = 5;
pub const DEFAULT_BREAKER_COOLDOWN_S: f64 = 10.0;
pub const DEFAULT_CACHE_ENTRIES: usize = 1024;

/// Every way judging can fail; `into_engine` gives each its engine error.
#[derive(Debug, thiserror::Error)]
pub enum JudgeError {
    #[error(transparent)]
    Prompt(#[from] PromptError),
    #[error(transparent)]
    Call(#[from] CallError),
    /// Not one sample gave a readable verdict; never replaced by a guess.
    #[error("no readable verdict in {samples} sample(s): {reason}")]
    Unreadable { samples: usize, reason: String },
}

impl JudgeError {
    /// Timeouts become DEADLINE_EXCEEDED; every other upstream failure UNAVAILABLE, with the
    /// upstream's status and reason in the message.
    pub fn into_engine(self, judge: &str) -> EngineError {
        let message = format!("judge {judge:?}: {self}");
        match self {
            JudgeError::Call(CallError::Deadline(_))
            | JudgeError::Call(CallError::Upstream {
                error: AttemptError::Timeout,
                ..
            }) => EngineError::DeadlineExceeded(message),
            JudgeError::Call(_) | JudgeError::Unreadable { .. } => {
                EngineError::Unavailable(message)
            }
            JudgeError::Prompt(_) => EngineError::Internal(message),
        }
    }
}

/// Builds a judge from its table: reads the API key from `api_key_env` and template overrides
/// from `prompts_dir`. Nothing is sent upstream until the first request.
pub fn load(config: &EvaluatorConfig) -> Result<JudgeEvaluator, EngineError> {
    let at =
        |message: String| EngineError::Internal(format!("evaluator {:?}: {message}", config.name));
    let api_key = match &config.api_key_env {
        Some(var) => match std::env::var(var) {
            Ok(key) if !key.trim().is_empty() => Some(Secret(key.trim().to_string())),
            _ => return Err(at(format!("api_key_env names {var}, which is not set"))),
        },
        None => None,
    };
    let base_url = config.base_url.as_deref().unwrap_or_default();
    let upstream = Upstream::new(base_url, api_key).map_err(at)?;
    let samples = config.samples.unwrap_or(1);
    let reasoning = config.reasoning.unwrap_or(false);
    let temperature = match (reasoning, config.temperature) {
        (true, _) => None,
        (false, Some(t)) => Some(t),
        (false, None) if samples > 1 => Some(DEFAULT_VOTING_TEMPERATURE),
        (false, None) => Some(0.0),
    };
    let extra = match &config.extra_body {
        Some(table) => serde_json::to_value(table)
            .ok()
            .and_then(|v| v.as_object().cloned())
            .ok_or_else(|| at("extra_body is not a table of JSON values".into()))?,
        None => Default::default(),
    };
    let params = ChatParams {
        model: config.model.clone().unwrap_or_default(),
        temperature,
        top_p: if reasoning { None } else { config.top_p },
        max_tokens: config.max_tokens.unwrap_or(DEFAULT_MAX_TOKENS),
        reasoning,
        extra,
    };
    let mut templates = Templates::builtin();
    if let Some(dir) = &config.prompts_dir {
        load_overrides(&mut templates, dir).map_err(|e| at(e.to_string()))?;
    }
    let policy = CallPolicy {
        max_concurrency: config.max_concurrency,
        requests_per_minute: config.requests_per_minute,
        retries: config.retries.unwrap_or(DEFAULT_RETRIES),
        timeout: Duration::from_secs_f64(config.timeout_s.unwrap_or(DEFAULT_TIMEOUT_S)),
        breaker_failures: config.breaker_failures.unwrap_or(DEFAULT_BREAKER_FAILURES),
        breaker_cooldown: Duration::from_secs_f64(
            config
                .breaker_cooldown_s
                .unwrap_or(DEFAULT_BREAKER_COOLDOWN_S),
        ),
        cache_entries: config.cache_entries.unwrap_or(DEFAULT_CACHE_ENTRIES),
    };
    let kind = config.upstream.unwrap_or_default();
    let extra_constrains = config
        .extra_body
        .as_ref()
        .is_some_and(|t| output::CONSTRAINT_KEYS.iter().any(|k| t.contains_key(*k)));
    let output = config
        .output
        .unwrap_or_else(|| OutputMode::default_for(kind, extra_constrains));
    Ok(JudgeEvaluator {
        name: config.name.clone(),
        params,
        samples,
        parallel: AtomicBool::new(config.parallel_samples.unwrap_or(false)),
        templates,
        repair: config.repair.unwrap_or(true),
        repair_prompt: config.repair_prompt.clone(),
        output,
        upstream: kind,
        text_fallback: AtomicBool::new(false),
        caller: call::Caller::new(&config.name, upstream, policy),
    })
}

/// Replaces each built-in template whose file (`math-reference-free.txt`...) is in `dir`.
fn load_overrides(templates: &mut Templates, dir: &Path) -> Result<(), PromptError> {
    if !dir.is_dir() {
        return Err(PromptError::Read {
            path: dir.to_path_buf(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "not a folder"),
        });
    }
    for kind in TemplateKind::ALL {
        let path = dir.join(format!("{}.txt", kind.name()));
        if path.exists() {
            templates.set(Template::load(kind, &path)?);
        }
    }
    Ok(())
}
