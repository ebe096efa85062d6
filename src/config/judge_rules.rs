//! Validation rules for `judge` and `cascade` tables; each message names the key at fault.

use super::{EvaluatorConfig, Kind, MAX_GRACE_S};
use crate::judge::OutputMode;
use crate::judge::output::CONSTRAINT_KEYS;

/// Most samples one judge may vote over: each is a full judge reply.
pub const MAX_SAMPLES: u32 = 64;
/// Retries per upstream exchange; more would hide an outage behind minutes of backoff.
pub const MAX_RETRIES: u32 = 10;
/// Body fields the judge sets itself; `extra_body` must not replace them.
const RESERVED_BODY_KEYS: &[&str] = &["model", "messages", "n", "stream"];

pub fn check_judge(e: &EvaluatorConfig) -> Result<(), String> {
    let base_url = e.base_url.as_deref().unwrap_or_default();
    let url = reqwest::Url::parse(base_url)
        .map_err(|err| format!("base_url {base_url:?} is not a URL: {err}"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!(
            "base_url {base_url:?} must start with http:// or https://"
        ));
    }
    if e.model.as_deref().is_some_and(|m| m.trim().is_empty()) {
        return Err("model must name the upstream's model".into());
    }
    if e.api_key_env
        .as_deref()
        .is_some_and(|v| v.trim().is_empty())
    {
        return Err("api_key_env must name an environment variable".into());
    }
    let reasoning = e.reasoning.unwrap_or(false);
    if reasoning && (e.temperature.is_some() || e.top_p.is_some()) {
        return Err(
            "temperature and top_p don't apply with reasoning = true (reasoning models refuse \
             them); remove them"
                .into(),
        );
    }
    if let Some(t) = e.temperature
        && !(0.0..=2.0).contains(&t)
    {
        return Err(format!("temperature must lie in [0, 2], got {t}"));
    }
    if let Some(p) = e.top_p
        && !(p > 0.0 && p <= 1.0)
    {
        return Err(format!("top_p must lie in (0, 1], got {p}"));
    }
    if e.max_tokens == Some(0) {
        return Err("max_tokens must be at least 1".into());
    }
    let samples = e.samples.unwrap_or(1);
    if !(1..=MAX_SAMPLES).contains(&samples) {
        return Err(format!(
            "samples must lie in [1, {MAX_SAMPLES}], got {samples}"
        ));
    }
    if samples > 1 && e.temperature == Some(0.0) {
        return Err(
            "samples > 1 at temperature = 0 would vote over identical replies; raise temperature"
                .into(),
        );
    }
    if let Some(t) = e.timeout_s
        && !(t > 0.0 && t <= MAX_GRACE_S)
    {
        return Err(format!("timeout_s must lie in (0, {MAX_GRACE_S}], got {t}"));
    }
    if let Some(r) = e.retries
        && r > MAX_RETRIES
    {
        return Err(format!("retries must be at most {MAX_RETRIES}, got {r}"));
    }
    if e.requests_per_minute == Some(0) {
        return Err("requests_per_minute must be at least 1 (leave it out for no limit)".into());
    }
    if e.breaker_failures == Some(0) {
        return Err("breaker_failures must be at least 1".into());
    }
    if let Some(c) = e.breaker_cooldown_s
        && !(c > 0.0 && c <= MAX_GRACE_S)
    {
        return Err(format!(
            "breaker_cooldown_s must lie in (0, {MAX_GRACE_S}], got {c}"
        ));
    }
    if e.repair_prompt
        .as_deref()
        .is_some_and(|p| p.trim().is_empty())
    {
        return Err("repair_prompt must not be empty (set repair = false instead)".into());
    }
    if let Some(extra) = &e.extra_body
        && let Some(key) = RESERVED_BODY_KEYS.iter().find(|k| extra.contains_key(**k))
    {
        return Err(format!(
            "extra_body must not set `{key}`: the judge sets it (use `samples` for `n`)"
        ));
    }
    check_output(e)
}

/// A grammar needs an upstream that reads one, and a structured mode can't share the request
/// with a constraint of the user's own in `extra_body`.
fn check_output(e: &EvaluatorConfig) -> Result<(), String> {
    let upstream = e.upstream.unwrap_or_default();
    if e.output == Some(OutputMode::Grammar) && !upstream.takes_grammar() {
        return Err(format!(
            "output = \"grammar\" needs upstream = \"llama.cpp\", \"vllm\" or \"sglang\" \
             (upstream {:?} takes no grammar; use output = \"json_schema\")",
            upstream.name()
        ));
    }
    if let Some(mode) = e.output.filter(|m| *m != OutputMode::Text)
        && let Some(extra) = &e.extra_body
        && let Some(key) = CONSTRAINT_KEYS.iter().find(|k| extra.contains_key(**k))
    {
        return Err(format!(
            "extra_body sets `{key}`, which conflicts with output = \"{}\"; remove one \
             (leave output out, or set it to \"text\", to keep your own constraint)",
            mode.name()
        ));
    }
    Ok(())
}

pub fn check_cascade(e: &EvaluatorConfig, all: &[EvaluatorConfig]) -> Result<(), String> {
    let names = |key: &str, name: &str, kind: Kind| match all.iter().find(|o| o.name == name) {
        Some(o) if o.kind == kind => Ok(()),
        Some(o) => Err(format!(
            "{key} {name:?} is a {} evaluator, not a {}",
            o.kind.as_str(),
            kind.as_str()
        )),
        None => Err(format!("{key} {name:?} names no [[evaluator]]")),
    };
    names("prm", e.prm.as_deref().unwrap_or_default(), Kind::Prm)?;
    names("judge", e.judge.as_deref().unwrap_or_default(), Kind::Judge)?;
    if let Some(m) = e.escalate_margin
        && !(0.0..=1.0).contains(&m)
    {
        return Err(format!("escalate_margin must lie in [0, 1], got {m}"));
    }
    Ok(())
}
