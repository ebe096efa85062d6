//! LLM judges behind an OpenAI-compatible endpoint: prompt templates, reply parsing and voting,
//! the reliable HTTP call, and the `judge` evaluator built from its config table.

mod cache;
mod call;
pub(crate) mod client;
mod config;
mod domain;
mod evaluator;
mod keys;
pub(crate) mod output;
pub(crate) mod parse;
pub(crate) mod prompt;

pub(crate) use crate::upstream::CallError;
pub use config::JudgeConfig;
pub(crate) use domain::DomainChoice;
pub(crate) use evaluator::JudgeEvaluator;
pub(crate) use output::OutputMode;
pub(crate) use output::UpstreamKind;

use crate::engine::EngineError;
use crate::upstream::{Endpoint, SetupError};
use client::ChatParams;
use prompt::{PromptError, Template, TemplateKind, Templates};
use std::path::Path;
use std::sync::atomic::AtomicBool;

/// Every way judging can fail; `JudgeFailure` (with the judge's name) gives each its engine
/// error.
#[derive(Debug, thiserror::Error)]
pub(crate) enum JudgeError {
    #[error(transparent)]
    Prompt(#[from] PromptError),
    #[error(transparent)]
    Call(#[from] CallError),
    /// Not one sample gave a readable verdict; never replaced by a guess.
    #[error("no readable verdict in {samples} sample(s): {reason}")]
    Unreadable { samples: usize, reason: String },
}

/// A judge's failure with the judge's name: what the engine's error is made from, so that every
/// layer reaches `EngineError` through one `From`.
#[derive(Debug)]
pub(crate) struct JudgeFailure {
    pub(crate) judge: String,
    pub(crate) error: JudgeError,
}

impl From<JudgeFailure> for EngineError {
    /// Timeouts become DEADLINE_EXCEEDED; every other upstream failure UNAVAILABLE, with the
    /// upstream's status and reason in the message; a trace the prompt can't show is bad input
    /// naming its field.
    fn from(JudgeFailure { judge, error }: JudgeFailure) -> Self {
        let message = format!("judge {judge:?}: {error}");
        match error {
            JudgeError::Call(e) if e.is_timeout() => EngineError::DeadlineExceeded(message),
            JudgeError::Call(_) | JudgeError::Unreadable { .. } => {
                EngineError::Unavailable(message)
            }
            JudgeError::Prompt(e) => match e.field() {
                Some(field) => EngineError::invalid(crate::field::FieldPath::key(field), message),
                None => EngineError::Internal(message),
            },
        }
    }
}

/// Why a judge could not be built; the engine's load error names which one.
#[derive(Debug, thiserror::Error)]
pub(crate) enum JudgeLoadError {
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error("extra_body is not a table of JSON values")]
    ExtraBody,
    #[error(transparent)]
    Prompts(#[from] PromptError),
    #[error(transparent)]
    Record(#[from] crate::record::RecordError),
}

/// Builds a judge from its table: reads the API key from `api_key_env` and template overrides
/// from `prompts_dir`. Nothing is sent upstream until the first request.
pub(crate) fn load(
    name: &str,
    max_concurrency: usize,
    config: &JudgeConfig,
) -> Result<JudgeEvaluator, JudgeLoadError> {
    let keys = &config.endpoint;
    let api_key = crate::upstream::api_key(keys.api_key_env.as_deref())?;
    let url = format!("{}/chat/completions", keys.base_url.trim_end_matches('/'));
    let endpoint = Endpoint::new(url, api_key)?;
    let extra = serde_json::to_value(&config.extra_body)
        .ok()
        .and_then(|v| v.as_object().cloned())
        .ok_or(JudgeLoadError::ExtraBody)?;
    let params = ChatParams {
        model: config.model.clone(),
        temperature: config.temperature(),
        top_p: if config.reasoning { None } else { config.top_p },
        max_tokens: config.max_tokens,
        reasoning: config.reasoning,
        extra,
    };
    let mut templates = Templates::builtin();
    if let Some(dir) = &config.prompts_dir {
        load_overrides(&mut templates, dir)?;
    }
    let policy = keys.policy(max_concurrency);
    let recorder = match &config.record {
        Some(r) => Some(crate::record::Recorder::start(name, name, r)?),
        None => None,
    };
    Ok(JudgeEvaluator {
        name: name.to_string(),
        params,
        samples: config.samples,
        parallel: AtomicBool::new(config.parallel_samples),
        templates,
        domain: config.domain,
        repair: config.repair,
        repair_prompt: config.repair_prompt.clone(),
        output: config.output_mode(),
        upstream: config.upstream,
        text_fallback: AtomicBool::new(false),
        caller: call::CachedCaller::new(name, endpoint, policy, config.cache_entries),
        recorder,
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
