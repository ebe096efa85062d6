//! The rules a type can't express, one function per kind; each message names the key at fault.

use super::evaluator::{
    Backend, CascadeConfig, DeviceSpec, EvaluatorConfig, JudgeConfig, KindConfig, PrmConfig,
};
use super::{MAX_CAPACITY, MAX_GRACE_S};
use crate::judge::OutputMode;
use crate::prm::format::Family;

/// Most samples one judge may vote over: each is a full judge reply.
pub const MAX_SAMPLES: u32 = 64;
/// Retries per upstream exchange; more would hide an outage behind minutes of backoff.
pub const MAX_RETRIES: u32 = 10;
/// Body fields the judge sets itself; `extra_body` must not replace them.
const RESERVED_BODY_KEYS: &[&str] = &["model", "messages", "n", "stream"];

/// Checks one evaluator table against the rest (a cascade names others).
pub fn check(e: &EvaluatorConfig, all: &[EvaluatorConfig]) -> Result<(), String> {
    if !(0.0..=1.0).contains(&e.threshold) {
        return Err(format!("threshold must lie in [0, 1], got {}", e.threshold));
    }
    if e.max_concurrency == 0 || e.max_concurrency > MAX_CAPACITY {
        return Err(format!("max_concurrency must lie in [1, {MAX_CAPACITY}]"));
    }
    if e.max_steps == Some(0) || e.max_trace_bytes == Some(0) {
        return Err("max_steps and max_trace_bytes must be at least 1".into());
    }
    match &e.kind {
        KindConfig::Prm(p) => check_prm(p),
        KindConfig::Judge(j) => check_judge(j),
        KindConfig::Cascade(c) => check_cascade(c, all),
    }
}

fn check_prm(p: &PrmConfig) -> Result<(), String> {
    if p.model.trim().is_empty() {
        return Err("model must name a checkpoint folder or .gguf file".into());
    }
    check_backend(p)?;
    let gguf = std::path::Path::new(&p.model)
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if gguf && p.dtype.is_some_and(|d| d != super::evaluator::Dtype::F32) {
        return Err(
            "dtype: a .gguf model runs its quantized weights with f32 activations, as \
             llama.cpp does; leave dtype out or set it to \"f32\""
                .into(),
        );
    }
    if p.max_batch_size == 0 {
        return Err("max_batch_size must be at least 1".into());
    }
    if p.max_batch_tokens == Some(0) {
        return Err("max_batch_tokens must be at least 1".into());
    }
    if p.max_wait_ms > 60_000 {
        return Err(format!(
            "max_wait_ms must be at most 60000, got {}",
            p.max_wait_ms
        ));
    }
    // 1 TiB: beyond any machine's memory, so a typo in units is caught here, not by the OOM killer.
    if p.prefix_cache_mb > 1 << 20 {
        return Err(format!(
            "prefix_cache_mb must be at most 1048576 (1 TiB), got {}",
            p.prefix_cache_mb
        ));
    }
    Ok(())
}

/// The vLLM keys go with `backend = "vllm"` and nothing else; what vLLM can't serve exactly is
/// refused here rather than scored wrong.
fn check_backend(p: &PrmConfig) -> Result<(), String> {
    let remote_keys = [
        ("base_url", p.base_url.is_some()),
        ("served_model", p.served_model.is_some()),
        ("api_key_env", p.api_key_env.is_some()),
        ("timeout_s", p.timeout_s.is_some()),
        ("retries", p.retries.is_some()),
        ("requests_per_minute", p.requests_per_minute.is_some()),
        ("breaker_failures", p.breaker_failures.is_some()),
        ("breaker_cooldown_s", p.breaker_cooldown_s.is_some()),
        ("top_logprobs", p.top_logprobs.is_some()),
    ];
    if p.backend == Backend::Candle {
        if let Some((key, _)) = remote_keys.iter().find(|(_, set)| *set) {
            return Err(format!(
                "{key} applies only to backend = \"vllm\"; this PRM runs in-process"
            ));
        }
        return Ok(());
    }
    let url = p.base_url.as_deref().unwrap_or("");
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(format!(
            "base_url must be the vLLM server's http:// or https:// root (backend = \"vllm\"), got {url:?}"
        ));
    }
    if p.family == Family::Skywork {
        return Err(
            "backend: vLLM has no pooler that returns skywork-prm's value head per step; \
             serve it with backend = \"candle\""
                .into(),
        );
    }
    if p.device != DeviceSpec::Cpu || p.dtype.is_some() {
        return Err(
            "device and dtype: with backend = \"vllm\" the server's own flags (--dtype, \
             --tensor-parallel-size) decide them; leave them out"
                .into(),
        );
    }
    if let Some(t) = p.timeout_s.filter(|t| !(*t > 0.0 && *t <= MAX_GRACE_S)) {
        return Err(format!("timeout_s must lie in (0, {MAX_GRACE_S}], got {t}"));
    }
    if p.retries.is_some_and(|r| r > MAX_RETRIES) {
        return Err(format!("retries must be at most {MAX_RETRIES}"));
    }
    if p.breaker_failures == Some(0) {
        return Err("breaker_failures must be at least 1".into());
    }
    if let Some(c) = p
        .breaker_cooldown_s
        .filter(|c| !(*c > 0.0 && *c <= MAX_GRACE_S))
    {
        return Err(format!(
            "breaker_cooldown_s must lie in (0, {MAX_GRACE_S}], got {c}"
        ));
    }
    if p.requests_per_minute == Some(0) {
        return Err("requests_per_minute must be at least 1 (leave it out for no limit)".into());
    }
    if p.top_logprobs.is_some_and(|k| !(2..=100).contains(&k)) {
        return Err("top_logprobs must lie in [2, 100]".into());
    }
    Ok(())
}

fn check_judge(e: &JudgeConfig) -> Result<(), String> {
    let url = reqwest::Url::parse(&e.base_url)
        .map_err(|err| format!("base_url {:?} is not a URL: {err}", e.base_url))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!(
            "base_url {:?} must start with http:// or https://",
            e.base_url
        ));
    }
    if e.model.trim().is_empty() {
        return Err("model must name the upstream's model".into());
    }
    if e.api_key_env
        .as_deref()
        .is_some_and(|v| v.trim().is_empty())
    {
        return Err("api_key_env must name an environment variable".into());
    }
    if e.reasoning && (e.temperature.is_some() || e.top_p.is_some()) {
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
    if e.max_tokens == 0 {
        return Err("max_tokens must be at least 1".into());
    }
    if !(1..=MAX_SAMPLES).contains(&e.samples) {
        return Err(format!(
            "samples must lie in [1, {MAX_SAMPLES}], got {}",
            e.samples
        ));
    }
    if e.samples > 1 && e.temperature == Some(0.0) {
        return Err(
            "samples > 1 at temperature = 0 would vote over identical replies; raise temperature"
                .into(),
        );
    }
    if !(e.timeout_s > 0.0 && e.timeout_s <= MAX_GRACE_S) {
        return Err(format!(
            "timeout_s must lie in (0, {MAX_GRACE_S}], got {}",
            e.timeout_s
        ));
    }
    if e.retries > MAX_RETRIES {
        return Err(format!(
            "retries must be at most {MAX_RETRIES}, got {}",
            e.retries
        ));
    }
    if e.requests_per_minute == Some(0) {
        return Err("requests_per_minute must be at least 1 (leave it out for no limit)".into());
    }
    if e.breaker_failures == 0 {
        return Err("breaker_failures must be at least 1".into());
    }
    if !(e.breaker_cooldown_s > 0.0 && e.breaker_cooldown_s <= MAX_GRACE_S) {
        return Err(format!(
            "breaker_cooldown_s must lie in (0, {MAX_GRACE_S}], got {}",
            e.breaker_cooldown_s
        ));
    }
    if e.repair_prompt
        .as_deref()
        .is_some_and(|p| p.trim().is_empty())
    {
        return Err("repair_prompt must not be empty (set repair = false instead)".into());
    }
    if let Some(key) = RESERVED_BODY_KEYS
        .iter()
        .find(|k| e.extra_body.contains_key(**k))
    {
        return Err(format!(
            "extra_body must not set `{key}`: the judge sets it (use `samples` for `n`)"
        ));
    }
    check_output(e)
}

/// A grammar needs an upstream that reads one, and a structured mode can't share the request
/// with a constraint of the user's own in `extra_body`.
fn check_output(e: &JudgeConfig) -> Result<(), String> {
    if e.output == Some(OutputMode::Grammar) && !e.upstream.takes_grammar() {
        return Err(format!(
            "output = \"grammar\" needs upstream = \"llama.cpp\", \"vllm\" or \"sglang\" \
             (upstream {:?} takes no grammar; use output = \"json_schema\")",
            e.upstream.name()
        ));
    }
    if let Some(mode) = e.output.filter(|m| *m != OutputMode::Text)
        && let Some(key) = e.own_constraint()
    {
        return Err(format!(
            "extra_body sets `{key}`, which conflicts with output = \"{}\"; remove one \
             (leave output out, or set it to \"text\", to keep your own constraint)",
            mode.name()
        ));
    }
    Ok(())
}

fn check_cascade(e: &CascadeConfig, all: &[EvaluatorConfig]) -> Result<(), String> {
    let names = |key: &str, name: &str, kind: &str| match all.iter().find(|o| o.name == name) {
        Some(o) if o.kind_name() == kind => Ok(()),
        Some(o) => Err(format!(
            "{key} {name:?} is a {} evaluator, not a {kind}",
            o.kind_name()
        )),
        None => Err(format!("{key} {name:?} names no [[evaluator]]")),
    };
    names("prm", &e.prm, "prm")?;
    names("judge", &e.judge, "judge")?;
    if !(0.0..=1.0).contains(&e.escalate_margin) {
        return Err(format!(
            "escalate_margin must lie in [0, 1], got {}",
            e.escalate_margin
        ));
    }
    Ok(())
}
