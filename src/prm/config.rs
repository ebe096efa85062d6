//! A PRM's `[[evaluator]]` keys (kind = "prm"): the family and checkpoint, the in-process
//! (candle) keys at the top level, and a vLLM server's keys in their own `[evaluator.vllm]`
//! table; defaults beside the keys, and the rules a type can't express.

use super::format::{Family, PrmKind};
use crate::rule::{Refused, refuse};
use crate::upstream::UpstreamConfig;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// A PRM checkpoint, served in-process or by a vLLM server this process formats for.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PrmConfig {
    /// Decides the input format and the head (a causal-LM PRM can't be told from its config),
    /// or `head`: a head folder that names its own format and base.
    pub family: PrmKind,
    /// A local Hugging Face folder, or an `org/name` id already in the Hugging Face cache. With
    /// `backend = "vllm"` only its tokenizer files are read.
    pub model: String,
    /// Where the model runs: `candle`, in this process (the default), or `vllm`, the server
    /// the `[evaluator.vllm]` table names, which gets the token ids this process formats.
    #[serde(default)]
    pub backend: Backend,
    /// The vLLM server's keys (backend = "vllm" only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vllm: Option<VllmConfig>,
    /// The in-process keys (backend = "candle" only), each `None` when unset.
    #[serde(flatten)]
    pub candle: CandleConfig,
}

/// How the in-process model runs and batches; unset keys take the defaults in `defaults`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct CandleConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceSpec>,
    /// f32 on the CPU, bf16 on a GPU when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<Dtype>,
    /// Most tokens per packed batch (their sum; rows are not padded); the device's default
    /// when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch_tokens: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_batch_size: Option<usize>,
    /// How long a batch with room waits for company after its latest request arrived (its
    /// first at most ten times this).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_wait_ms: Option<u64>,
    /// MiB of computed prefixes (keys and values) the model thread keeps for later requests
    /// that start with the same tokens; 0 turns the cache off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_cache_mb: Option<usize>,
    /// Rows of one batch that share leading tokens compute them once. On by default; off only
    /// to measure what it saves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix_sharing: Option<bool>,
    /// MiB of a GGUF's quantized matrices (the 32-element block types) also kept dequantized
    /// to f32, from the first layer on, so that each matmul skips dequantizing them: faster,
    /// the same scores to the bit, four bytes a weight of memory. 0 (the default) keeps none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dequantized_mb: Option<usize>,
}

/// A vLLM server's keys: the upstream's, plus what vLLM itself needs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct VllmConfig {
    /// `base_url` (the server's root, e.g. `http://gpu-0:8000`), `api_key_env`, `timeout_s`,
    /// `retries`, `requests_per_minute` and the breaker.
    #[serde(flatten)]
    pub endpoint: UpstreamConfig,
    /// The name the vLLM server serves the model under; its only model when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_model: Option<String>,
    /// Causal-LM families: log-probabilities asked per position (`prompt_logprobs`; at most
    /// the server's `--max-logprobs`).
    #[serde(default = "defaults::top_logprobs")]
    pub top_logprobs: u32,
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    /// Its name in configs.
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }
}

/// A PRM's defaults.
pub(crate) mod defaults {
    pub(crate) const MAX_BATCH_TOKENS: usize = 8192;
    /// On a GPU: a 7B model's activations for 32k packed tokens take a few GiB next to its
    /// 15 GiB of bf16 weights, and the matmuls need thousands of rows to fill a large card.
    pub(crate) const MAX_BATCH_TOKENS_CUDA: usize = 32768;
    pub(crate) const MAX_BATCH_SIZE: usize = 32;
    pub(crate) const MAX_WAIT_MS: u64 = 2;
    /// Room for ~11k tokens of SmolLM2-135M, ~9k of a 7B Qwen2 in bf16 (see docs/models.md).
    pub const PREFIX_CACHE_MB: usize = 512;
    /// A trained PRM's top two at a step's end are its plus and minus tokens; a few more leave
    /// room for a chat model that spreads its mass, at about 60 bytes per position and
    /// log-probability.
    pub(crate) const TOP_LOGPROBS: u32 = 5;

    pub(super) fn top_logprobs() -> u32 {
        TOP_LOGPROBS
    }
}

/// The keys that were spelled at the PRM's top level before they moved into `[evaluator.vllm]`.
pub(crate) const MOVED_TO_VLLM: &[&str] = &[
    "base_url",
    "served_model",
    "api_key_env",
    "timeout_s",
    "retries",
    "requests_per_minute",
    "breaker_failures",
    "breaker_cooldown_s",
    "top_logprobs",
];

impl PrmConfig {
    /// A table for `family` at `model`, in-process, with every other key at its default.
    pub fn new(family: impl Into<PrmKind>, model: impl Into<String>) -> Self {
        PrmConfig {
            family: family.into(),
            model: model.into(),
            backend: Backend::Candle,
            vllm: None,
            candle: CandleConfig::default(),
        }
    }

    pub fn device(&self) -> DeviceSpec {
        self.candle.device.unwrap_or_default()
    }

    /// The batch budget in force: the table's, else the device's default.
    pub fn max_batch_tokens(&self) -> usize {
        self.candle.max_batch_tokens.unwrap_or(match self.device() {
            DeviceSpec::Cpu => defaults::MAX_BATCH_TOKENS,
            DeviceSpec::Cuda(_) => defaults::MAX_BATCH_TOKENS_CUDA,
        })
    }

    pub fn max_batch_size(&self) -> usize {
        self.candle
            .max_batch_size
            .unwrap_or(defaults::MAX_BATCH_SIZE)
    }

    pub fn max_wait_ms(&self) -> u64 {
        self.candle.max_wait_ms.unwrap_or(defaults::MAX_WAIT_MS)
    }

    pub fn prefix_cache_mb(&self) -> usize {
        self.candle
            .prefix_cache_mb
            .unwrap_or(defaults::PREFIX_CACHE_MB)
    }

    pub fn prefix_sharing(&self) -> bool {
        self.candle.prefix_sharing.unwrap_or(true)
    }

    /// The dtype in force: the table's, else f32 on the CPU and bf16 on a GPU.
    pub fn dtype(&self) -> Dtype {
        self.candle.dtype.unwrap_or(match self.device() {
            DeviceSpec::Cpu => Dtype::F32,
            DeviceSpec::Cuda(_) => Dtype::Bf16,
        })
    }

    /// This table with every in-process key it leaves out at the value in force, so the
    /// resolved config says what runs (a vLLM-backed table has none to fill).
    pub fn resolved(mut self) -> PrmConfig {
        if self.backend == Backend::Candle {
            let gguf = retrace_model::is_gguf(std::path::Path::new(&self.model));
            self.candle = CandleConfig {
                device: Some(self.device()),
                // A GGUF file's activations are f32 whatever the device.
                dtype: Some(if gguf { Dtype::F32 } else { self.dtype() }),
                max_batch_tokens: Some(self.max_batch_tokens()),
                max_batch_size: Some(self.max_batch_size()),
                max_wait_ms: Some(self.max_wait_ms()),
                prefix_cache_mb: Some(self.prefix_cache_mb()),
                prefix_sharing: Some(self.prefix_sharing()),
                dequantized_mb: Some(self.candle.dequantized_mb.unwrap_or(0)),
            };
        }
        self
    }

    /// The rules a type can't express; each message names the key.
    pub fn check(&self) -> Result<(), Refused> {
        if self.model.trim().is_empty() {
            return refuse("model must name a checkpoint folder or .gguf file");
        }
        match (self.backend, &self.vllm) {
            (Backend::Candle, None) => self.candle.check(&self.model, self.family),
            (Backend::Candle, Some(_)) => refuse(
                "vllm: an [evaluator.vllm] table applies only to backend = \"vllm\"; this PRM \
                 runs in-process",
            ),
            (Backend::Vllm, None) => refuse(
                "backend = \"vllm\" needs an [evaluator.vllm] table with the server's base_url",
            ),
            (Backend::Vllm, Some(vllm)) => self.check_vllm(vllm),
        }
    }

    /// What vLLM can't serve exactly is refused here rather than scored wrong, and no candle
    /// key is silently ignored.
    fn check_vllm(&self, vllm: &VllmConfig) -> Result<(), Refused> {
        if let Some(key) = self.candle.keys_set().first() {
            return refuse(format!(
                "{key} applies only to backend = \"candle\"; with backend = \"vllm\" the vLLM \
                 server batches and places the model (its own flags: --dtype, \
                 --tensor-parallel-size, --max-num-seqs)"
            ));
        }
        if self.family == PrmKind::Head {
            return refuse(
                "backend: a trained head (family = \"head\") runs in-process; serve it with \
                 backend = \"candle\"",
            );
        }
        if self.family == Family::OutcomeRm.into() {
            return refuse(
                "backend: outcome-rm runs in-process; serve it with backend = \"candle\"",
            );
        }
        if self.family == Family::Skywork.into() {
            return refuse(
                "backend: vLLM has no pooler that returns skywork-prm's value head per step; \
                 serve it with backend = \"candle\"",
            );
        }
        vllm.endpoint
            .check("the vLLM server")
            .map_err(|e| Refused(format!("vllm.{e}")))?;
        if !(2..=100).contains(&vllm.top_logprobs) {
            return refuse("vllm.top_logprobs must lie in [2, 100]");
        }
        Ok(())
    }
}

impl CandleConfig {
    /// The names of the keys this table sets.
    fn keys_set(&self) -> Vec<&'static str> {
        [
            ("device", self.device.is_some()),
            ("dtype", self.dtype.is_some()),
            ("max_batch_tokens", self.max_batch_tokens.is_some()),
            ("max_batch_size", self.max_batch_size.is_some()),
            ("max_wait_ms", self.max_wait_ms.is_some()),
            ("prefix_cache_mb", self.prefix_cache_mb.is_some()),
            ("prefix_sharing", self.prefix_sharing.is_some()),
        ]
        .into_iter()
        .filter_map(|(key, set)| set.then_some(key))
        .collect()
    }

    fn check(&self, model: &str, family: PrmKind) -> Result<(), Refused> {
        let gguf = retrace_model::is_gguf(std::path::Path::new(model));
        if gguf && family.is_outcome() {
            return refuse(
                "model: a .gguf file carries no sequence-classification `score` head (llama.cpp \
                 converts the decoder only); family outcome-rm needs the Hugging Face folder",
            );
        }
        if gguf && self.dtype.is_some_and(|d| d != Dtype::F32) {
            return refuse(
                "dtype: a .gguf model runs its quantized weights with f32 activations, as \
                 llama.cpp does; leave dtype out or set it to \"f32\"",
            );
        }
        if self.max_batch_size == Some(0) {
            return refuse("max_batch_size must be at least 1");
        }
        if self.max_batch_tokens == Some(0) {
            return refuse("max_batch_tokens must be at least 1");
        }
        if let Some(ms) = self.max_wait_ms.filter(|ms| *ms > 60_000) {
            return refuse(format!("max_wait_ms must be at most 60000, got {ms}"));
        }
        // 1 TiB: beyond any machine's memory, so a typo in units is caught here, not by the
        // OOM killer.
        if let Some(mb) = self.prefix_cache_mb.filter(|mb| *mb > 1 << 20) {
            return refuse(format!(
                "prefix_cache_mb must be at most 1048576 (1 TiB), got {mb}"
            ));
        }
        Ok(())
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
    type Err = Refused;

    fn from_str(s: &str) -> Result<Self, Refused> {
        match s.trim() {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda(0)),
            other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(DeviceSpec::Cuda(n)),
                _ => refuse(format!(
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
