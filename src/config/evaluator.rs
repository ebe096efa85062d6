//! One `[[evaluator]]` table: the keys every kind shares, then one typed struct per kind, each
//! with its defaults beside its keys. The deserialiser itself refuses an unknown key or a key of
//! another kind; what a type can't say is checked in `rules.rs`.

use crate::judge::output::CONSTRAINT_KEYS;
use crate::judge::{OutputMode, UpstreamKind};
use crate::prm::format::Family;
use crate::trace::Aggregate;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::path::PathBuf;

/// One `[[evaluator]]` table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EvaluatorConfig {
    pub name: String,
    #[serde(default = "defaults::threshold")]
    pub threshold: f32,
    #[serde(default)]
    pub aggregate: Aggregate,
    /// Limits on a trace's size; the server's when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_steps: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_trace_bytes: Option<usize>,
    /// Requests handed to the evaluator at once; the rest wait in its queue.
    #[serde(default = "defaults::max_concurrency")]
    pub max_concurrency: usize,
    /// `kind = "..."` and that kind's own keys.
    #[serde(flatten)]
    pub kind: KindConfig,
}

/// The kind of an evaluator and its keys. Each struct refuses keys it doesn't know, so a key of
/// another kind stops startup naming the key.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum KindConfig {
    Prm(PrmConfig),
    Judge(JudgeConfig),
    Cascade(CascadeConfig),
}

/// A PRM checkpoint, served in-process or by a vLLM server this process formats for.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PrmConfig {
    /// Decides the input format and the head (a causal-LM PRM can't be told from its config).
    pub family: Family,
    /// A local Hugging Face folder, or an `org/name` id already in the Hugging Face cache. With
    /// `backend = "vllm"` only its tokenizer files are read.
    pub model: String,
    /// Where the model runs: `candle`, in this process (the default), or `vllm`, a vLLM server
    /// at `base_url` that gets the token ids this process formats.
    #[serde(default)]
    pub backend: Backend,
    /// The vLLM server's root, e.g. `http://gpu-0:8000` (backend = "vllm" only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// The name the vLLM server serves the model under; its only model when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_model: Option<String>,
    /// Environment variable holding the vLLM server's API key (`vllm serve --api-key`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// Seconds one exchange with the vLLM server may take (`defaults::TIMEOUT_S`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<f64>,
    /// Retries of a failed exchange within the deadline (`defaults::RETRIES`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retries: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub breaker_failures: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub breaker_cooldown_s: Option<f64>,
    /// Causal-LM families on vLLM: log-probabilities asked per position (`prompt_logprobs`; at
    /// most the server's `--max-logprobs`); `defaults::TOP_LOGPROBS`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<u32>,
    #[serde(default)]
    pub device: DeviceSpec,
    /// f32 on the CPU, bf16 on a GPU when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<Dtype>,
    /// Most tokens per packed batch (their sum; rows are not padded). When unset, the default
    /// for the device (see `max_batch_tokens()`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch_tokens: Option<usize>,
    #[serde(default = "defaults::max_batch_size")]
    pub max_batch_size: usize,
    /// How long the first request of a batch may wait for company.
    #[serde(default = "defaults::max_wait_ms")]
    pub max_wait_ms: u64,
    /// MiB of computed prefixes (keys and values) the model thread keeps for later requests
    /// that start with the same tokens; 0 turns the cache off.
    #[serde(default = "defaults::prefix_cache_mb")]
    pub prefix_cache_mb: usize,
    /// Rows of one batch that share leading tokens compute them once. On by default; off only to
    /// measure what it saves.
    #[serde(default = "defaults::prefix_sharing")]
    pub prefix_sharing: bool,
}

/// An LLM judge behind an OpenAI-compatible chat-completions endpoint.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JudgeConfig {
    pub base_url: String,
    /// The upstream's model name.
    pub model: String,
    /// Environment variable holding the API key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// 0 for one sample, `defaults::VOTING_TEMPERATURE` when voting; never sent with reasoning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[serde(default = "defaults::judge_max_tokens")]
    pub max_tokens: u32,
    #[serde(default = "defaults::samples")]
    pub samples: u32,
    #[serde(default = "defaults::timeout_s")]
    pub timeout_s: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u32>,
    #[serde(default = "defaults::retries")]
    pub retries: u32,
    /// A reasoning model: sends `max_completion_tokens` and no sampling parameters.
    #[serde(default)]
    pub reasoning: bool,
    /// Extra JSON fields for the request body (`reasoning_effort`, `seed`...).
    #[serde(default, skip_serializing_if = "toml::Table::is_empty")]
    pub extra_body: toml::Table,
    /// Folder whose `{domain}-{mode}.txt` files replace the built-in prompt templates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompts_dir: Option<PathBuf>,
    /// Always send samples as parallel requests instead of one request with `n`.
    #[serde(default)]
    pub parallel_samples: bool,
    /// Consecutive failed upstream attempts that open the circuit breaker.
    #[serde(default = "defaults::breaker_failures")]
    pub breaker_failures: u32,
    /// Seconds the open breaker refuses calls before one probe.
    #[serde(default = "defaults::breaker_cooldown_s")]
    pub breaker_cooldown_s: f64,
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
    pub upstream: UpstreamKind,
}

/// A PRM first, its judge where the PRM is unsure (or to name the category).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct CascadeConfig {
    /// The `prm` evaluator it runs first.
    pub prm: String,
    /// The `judge` evaluator it escalates to.
    pub judge: String,
    /// A deciding step within this distance of the threshold (inclusive) escalates.
    #[serde(default = "defaults::escalate_margin")]
    pub escalate_margin: f32,
    /// Ask the judge for the category of an error the PRM is sure of.
    #[serde(default)]
    pub categorize: bool,
}

/// What computes a PRM's scores.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// The checkpoint on candle, in this process.
    #[default]
    Candle,
    /// A vLLM server (`/pooling` for token-classification PRMs, `/v1/completions` with
    /// `prompt_logprobs` for causal-LM ones).
    Vllm,
}

/// Where a PRM runs: `"cpu"`, `"cuda"` (device 0) or `"cuda:N"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    Cuda(usize),
}

/// The dtype a PRM's weights and activations use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

/// Every default of an evaluator table, in one place.
pub mod defaults {
    pub const THRESHOLD: f32 = 0.5;
    pub const MAX_CONCURRENCY: usize = 256;
    pub const MAX_BATCH_TOKENS: usize = 8192;
    /// On a GPU: a 7B model's activations for 32k packed tokens take a few GiB next to its
    /// 15 GiB of bf16 weights, and the matmuls need thousands of rows to fill a large card.
    pub const MAX_BATCH_TOKENS_CUDA: usize = 32768;
    pub const MAX_BATCH_SIZE: usize = 32;
    pub const MAX_WAIT_MS: u64 = 2;
    pub const JUDGE_MAX_TOKENS: u32 = 1024;
    /// The temperature of a voting judge that sets none: samples must differ to vote.
    pub const VOTING_TEMPERATURE: f32 = 0.7;
    pub const TIMEOUT_S: f64 = 60.0;
    pub const RETRIES: u32 = 2;
    pub const BREAKER_FAILURES: u32 = 5;
    pub const BREAKER_COOLDOWN_S: f64 = 10.0;
    pub const CACHE_ENTRIES: usize = 1024;
    pub const ESCALATE_MARGIN: f32 = 0.1;
    /// A trained PRM's top two at a step's end are its plus and minus tokens; a few more leave
    /// room for a chat model that spreads its mass, at about 60 bytes per position and
    /// log-probability.
    pub const TOP_LOGPROBS: u32 = 5;

    pub(super) fn threshold() -> f32 {
        THRESHOLD
    }
    pub(super) fn max_concurrency() -> usize {
        MAX_CONCURRENCY
    }
    pub(super) fn max_batch_size() -> usize {
        MAX_BATCH_SIZE
    }
    pub(super) fn max_wait_ms() -> u64 {
        MAX_WAIT_MS
    }

    /// Room for ~11k tokens of SmolLM2-135M, ~9k of a 7B Qwen2 in bf16 (see the README's sizing).
    pub const PREFIX_CACHE_MB: usize = 512;

    pub(super) fn prefix_cache_mb() -> usize {
        PREFIX_CACHE_MB
    }

    pub(super) fn prefix_sharing() -> bool {
        true
    }
    pub(super) fn judge_max_tokens() -> u32 {
        JUDGE_MAX_TOKENS
    }
    pub(super) fn samples() -> u32 {
        1
    }
    pub(super) fn timeout_s() -> f64 {
        TIMEOUT_S
    }
    pub(super) fn retries() -> u32 {
        RETRIES
    }
    pub(super) fn breaker_failures() -> u32 {
        BREAKER_FAILURES
    }
    pub(super) fn breaker_cooldown_s() -> f64 {
        BREAKER_COOLDOWN_S
    }
    pub(super) fn cache_entries() -> usize {
        CACHE_ENTRIES
    }
    pub(super) fn escalate_margin() -> f32 {
        ESCALATE_MARGIN
    }
    pub(super) fn yes() -> bool {
        true
    }
}

impl EvaluatorConfig {
    /// A table with the shared keys at their defaults.
    pub fn new(name: &str, kind: KindConfig) -> Self {
        EvaluatorConfig {
            name: name.to_string(),
            threshold: defaults::THRESHOLD,
            aggregate: Aggregate::default(),
            max_steps: None,
            max_trace_bytes: None,
            max_concurrency: defaults::MAX_CONCURRENCY,
            kind,
        }
    }

    pub fn kind_name(&self) -> &'static str {
        self.kind.name()
    }
}

impl KindConfig {
    pub fn name(&self) -> &'static str {
        match self {
            KindConfig::Prm(_) => "prm",
            KindConfig::Judge(_) => "judge",
            KindConfig::Cascade(_) => "cascade",
        }
    }

    /// The model a status line shows: a PRM's folder, a judge's upstream model.
    pub fn model(&self) -> Option<&str> {
        match self {
            KindConfig::Prm(p) => Some(&p.model),
            KindConfig::Judge(j) => Some(&j.model),
            KindConfig::Cascade(_) => None,
        }
    }
}

impl PrmConfig {
    /// A table for `family` at `model` with every other key at its default.
    pub fn new(family: Family, model: impl Into<String>) -> Self {
        PrmConfig {
            family,
            model: model.into(),
            backend: Backend::Candle,
            base_url: None,
            served_model: None,
            api_key_env: None,
            timeout_s: None,
            retries: None,
            requests_per_minute: None,
            breaker_failures: None,
            breaker_cooldown_s: None,
            top_logprobs: None,
            device: DeviceSpec::Cpu,
            dtype: None,
            max_batch_tokens: None,
            max_batch_size: defaults::MAX_BATCH_SIZE,
            max_wait_ms: defaults::MAX_WAIT_MS,
            prefix_cache_mb: defaults::PREFIX_CACHE_MB,
            prefix_sharing: true,
        }
    }

    /// The batch budget in force: the table's, else the device's default.
    pub fn max_batch_tokens(&self) -> usize {
        self.max_batch_tokens.unwrap_or(match self.device {
            DeviceSpec::Cpu => defaults::MAX_BATCH_TOKENS,
            DeviceSpec::Cuda(_) => defaults::MAX_BATCH_TOKENS_CUDA,
        })
    }

    /// The dtype in force: the table's, else f32 on the CPU and bf16 on a GPU.
    pub fn dtype(&self) -> Dtype {
        self.dtype.unwrap_or(match self.device {
            DeviceSpec::Cpu => Dtype::F32,
            DeviceSpec::Cuda(_) => Dtype::Bf16,
        })
    }
}

impl JudgeConfig {
    /// The `extra_body` key through which the user already constrains the reply, if any.
    pub fn own_constraint(&self) -> Option<&'static str> {
        CONSTRAINT_KEYS
            .iter()
            .copied()
            .find(|k| self.extra_body.contains_key(*k))
    }

    /// The output mode in force: the table's, else the default (see `OutputMode::default_for`).
    pub fn output_mode(&self) -> OutputMode {
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
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceSpec::Cuda(n)),
                _ => Err(format!(
                    "device {s:?} is not \"cpu\", \"cuda\" or \"cuda:N\""
                )),
            },
        }
    }
}

impl Serialize for DeviceSpec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}
