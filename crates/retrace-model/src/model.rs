//! A loaded PRM checkpoint (config, decoder and head): loading it, from a Hugging Face folder or a
//! GGUF file, and its entry points (token ids and the positions to read in, step scores out; a
//! batch's own run is `batch`'s).

use crate::batch::{Batch, Row, RowStates, Runner};
use crate::config::ModelConfig;
use crate::decoder::Decoder;
use crate::error::ModelError;
use crate::gguf::{Gguf, GgufTensors, is_gguf};
use crate::head::{ClassifierConfig, Head, HeadSpec, Trained, TrainedSpec, matrix_rows};
use crate::kernels::Kernels;
use crate::prefix_cache::PrefixCache;
use crate::weights::FileTensors;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// A PRM ready to score: its weights immutable after loading; its prefix cache (when on) is
/// the model thread's own.
pub struct PrmModel {
    config: ModelConfig,
    /// Shared with the other heads on the same base (`SharedBase`); the weights are read-only.
    decoder: Arc<Decoder>,
    head: Head,
    cache: Option<Mutex<PrefixCache>>,
    /// Rows of one batch that share tokens compute them once (off only to measure it).
    share: bool,
    dtype: DType,
}

/// A decoder loaded once, for trained heads to share (`PrmModel::on_base`): a head on it holds
/// its own weights only, so swapping one head for another on the same base reads no base weights
/// and holds no second copy of them.
#[derive(Clone)]
pub struct SharedBase {
    config: ModelConfig,
    decoder: Arc<Decoder>,
    dtype: DType,
    device: Device,
}

impl SharedBase {
    /// Loads the checkpoint at `path` (a folder or a `.gguf` file) without a head.
    pub fn load(path: &Path, device: &Device, dtype: DType) -> Result<Self, ModelError> {
        let model = PrmModel::load(path, HeadSpec::States, device, dtype)?;
        Ok(SharedBase {
            config: model.config,
            decoder: model.decoder,
            dtype: model.dtype,
            device: device.clone(),
        })
    }

    /// `PrmModel::with_dequantized`, for the base before any head shares it.
    pub fn with_dequantized(mut self, bytes: usize) -> Result<Self, ModelError> {
        if let Some(decoder) = Arc::get_mut(&mut self.decoder) {
            decoder.dequantize_once(bytes)?;
        }
        Ok(self)
    }

    /// Whether `model` runs on this very base (the same weights in memory, not a copy).
    pub fn runs(&self, model: &PrmModel) -> bool {
        Arc::ptr_eq(&self.decoder, &model.decoder)
    }
}

/// A prefix cache's state, for its metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CacheStats {
    pub bytes: usize,
    pub evictions: u64,
}

/// How a model reuses computed tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reuse {
    /// Bytes the prefix cache may hold; 0 turns it off.
    pub cache_bytes: usize,
    /// In-batch sharing of tokens rows have in common.
    pub share: bool,
}

impl Default for Reuse {
    fn default() -> Self {
        Reuse {
            cache_bytes: 0,
            share: true,
        }
    }
}

impl PrmModel {
    /// Loads `folder/config.json` and the weights (`model.safetensors`, or the shards named by
    /// `model.safetensors.index.json`), read and converted to `dtype` on `device`; or, when
    /// `folder` is a `.gguf` file, that checkpoint (see `load_gguf`).
    pub fn load(
        folder: &Path,
        head: HeadSpec,
        device: &Device,
        dtype: DType,
    ) -> Result<Self, ModelError> {
        if is_gguf(folder) {
            return Self::load_gguf(folder, head, device);
        }
        if head == HeadSpec::Outcome {
            ClassifierConfig::read(folder)?;
        }
        let config_path = folder.join("config.json");
        let text = read(&config_path)?;
        let config = ModelConfig::from_json(&text).map_err(|e| ModelError::BadConfig {
            path: config_path.clone(),
            key: e.key,
            reason: e.reason,
        })?;
        let files = weight_files(folder)?;
        // Read, not mapped: a map's touched pages stayed resident until it was dropped, so
        // loading peaked at twice the weights (1.06 GiB VmHWM for SmolLM2's 0.51 GiB).
        let vb =
            VarBuilder::from_backend(Box::new(FileTensors::open(&files)?), dtype, device.clone());
        // SAFETY: the files are mapped read-only; like every mmap-based loader, this relies on
        // nobody rewriting a checkpoint while a server has it loaded. Only the head reads from
        // this map (a few rows of an untied lm_head), so few of its pages are ever resident.
        let weights = unsafe { MmapedSafetensors::multi(&files)? };
        let decoder = Decoder::new(&config, vb.clone(), None)?;
        let rows = |name: &str, ids: &[usize]| matrix_rows(&weights, name, ids, config.hidden_size);
        let head = Head::load(head, &config, vb, &rows, decoder.embeddings())?;
        Ok(Self::new(config, decoder, head, dtype))
    }

    /// Loads a GGUF checkpoint: its quantized matrices stay quantized (activations in f32, as
    /// llama.cpp runs them), every other tensor and the head in f32.
    pub fn load_gguf(path: &Path, head: HeadSpec, device: &Device) -> Result<Self, ModelError> {
        if !path.is_file() {
            return Err(ModelError::MissingFile(path.to_path_buf()));
        }
        if head == HeadSpec::Outcome {
            return Err(ModelError::BadConfig {
                path: path.to_path_buf(),
                key: "score".into(),
                reason: "a GGUF file carries no sequence-classification `score` head (llama.cpp \
                         converts the decoder only); load the Hugging Face folder instead"
                    .into(),
            });
        }
        let gguf = Gguf::open(path)?;
        let config = gguf.config()?;
        let dtype = DType::F32;
        let vb =
            VarBuilder::from_backend(Box::new(GgufTensors(gguf.clone())), dtype, device.clone());
        let decoder = Decoder::new(&config, vb.clone(), Some(&gguf))?;
        let rows = |name: &str, ids: &[usize]| gguf.rows(name, ids);
        let head = Head::load(head, &config, vb, &rows, decoder.embeddings())?;
        Ok(Self::new(config, decoder, head, dtype))
    }

    /// The trained head `spec` over `base`: only the head's weights are read.
    pub fn on_base(base: &SharedBase, spec: &TrainedSpec) -> Result<Self, ModelError> {
        let head = Head::Trained(Trained::load(spec, &base.config, &base.device)?);
        Ok(Self {
            config: base.config.clone(),
            decoder: base.decoder.clone(),
            head,
            cache: None,
            share: true,
            dtype: base.dtype,
        })
    }

    fn new(config: ModelConfig, decoder: Decoder, head: Head, dtype: DType) -> Self {
        Self {
            config,
            decoder: Arc::new(decoder),
            head,
            cache: None,
            share: true,
            dtype,
        }
    }

    /// Sets how this model reuses computed tokens.
    pub fn with_reuse(mut self, reuse: Reuse) -> Self {
        self.cache =
            (reuse.cache_bytes > 0).then(|| Mutex::new(PrefixCache::new(reuse.cache_bytes)));
        self.share = reuse.share;
        self
    }

    /// Which ops the decoder runs: the fused kernels (the default; on CPU f32 only, candle's
    /// ops elsewhere) or candle's ops everywhere. Refused on a base that other heads share: the
    /// choice is the base's, made before it is shared.
    pub fn with_kernels(mut self, kernels: Kernels) -> Result<Self, ModelError> {
        let decoder = Arc::get_mut(&mut self.decoder).ok_or_else(|| {
            ModelError::BadInput("the kernels of a base other heads share are fixed".into())
        })?;
        decoder.set_kernels(kernels);
        Ok(self)
    }

    /// Keeps up to `bytes` of a GGUF's quantized matrices (the 32-element block types: Q4_0,
    /// Q4_1, Q5_0, Q5_1, Q8_0) dequantized to f32 beside their blocks, from the first layer on:
    /// each matmul then reads them instead of dequantizing its weights on every call, for the
    /// same bits. It costs what it keeps (four bytes a weight); the K-quants and full-precision
    /// weights are left as they are. Refused on a base other heads share, as `with_kernels` is.
    pub fn with_dequantized(mut self, bytes: usize) -> Result<Self, ModelError> {
        if bytes == 0 {
            return Ok(self);
        }
        let decoder = Arc::get_mut(&mut self.decoder).ok_or_else(|| {
            ModelError::BadInput("the weights of a base other heads share are fixed".into())
        })?;
        decoder.dequantize_once(bytes)?;
        Ok(self)
    }

    /// How many of a row's tokens a forward would compute now: those past its longest cached
    /// prefix (every one without a cache). What a batch costs, where its rows' lengths
    /// overstate it: a search's increments over cached prefixes are a few dozen tokens each.
    pub fn uncached_len(&self, ids: &[u32]) -> usize {
        let cached = match &self.cache {
            Some(cache) => cache.lock().map_or(0, |c| c.cached_len(ids)),
            None => 0,
        };
        ids.len() - cached
    }

    /// What the prefix cache holds, when it is on.
    pub fn cache_stats(&self) -> Option<CacheStats> {
        let cache = self.cache.as_ref()?.lock().ok()?;
        Some(CacheStats {
            bytes: cache.bytes(),
            evictions: cache.stats().evictions,
        })
    }

    /// Bytes the prefix cache spends per token: every layer's keys and values, and the last
    /// layer's input.
    pub fn cache_bytes_per_token(&self) -> usize {
        let c = &self.config;
        (2 * c.num_hidden_layers * c.kv_heads() * c.head_dim() + c.hidden_size)
            * self.dtype.size_in_bytes()
    }

    /// The longest input (in tokens) the model accepts.
    pub fn max_positions(&self) -> usize {
        self.config.max_position_embeddings
    }

    pub fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    /// Decoder layers; a tap of `num_layers()` is the state after the final norm.
    pub fn num_layers(&self) -> usize {
        self.config.num_hidden_layers
    }

    pub fn hidden_size(&self) -> usize {
        self.config.hidden_size
    }

    /// Scores `batch` in one forward pass: each row's scores in [0, 1] at its positions, in
    /// order (for a sequence classifier, its raw reward), its trained head's category
    /// probabilities, and how many of its tokens were computed and reused. Rows are packed, not
    /// padded (see `Decoder::run`); with the prefix cache on, each row starts from its longest
    /// cached prefix, and what the batch computes is cached after (as much as the budget holds,
    /// least recently used evicted first). A row too long, a token outside the vocabulary or a
    /// position past its row is refused, never indexed.
    pub fn score(&self, batch: Batch<'_>) -> Result<Vec<Row>, ModelError> {
        self.check_input(batch.ids, batch.positions)?;
        self.on_pool(|| self.runner().score(batch))
    }

    /// The hidden states of `layers` at each row's positions, through the same batching and
    /// prefix cache as `score`: layer `l` < `num_layers()` is the residual stream after decoder
    /// layer `l`, `num_layers()` the state after the final norm (what an LM head reads). A
    /// layer below the last layer's input reuses cached prefixes only up to each row's first
    /// read (the cache keeps no state of earlier layers). Spans are not read.
    pub fn states(&self, batch: Batch<'_>, layers: &[usize]) -> Result<Vec<RowStates>, ModelError> {
        self.check_input(batch.ids, batch.positions)?;
        let n = self.num_layers();
        if let Some(l) = layers.iter().find(|&&l| l > n) {
            return Err(ModelError::BadInput(format!(
                "layer {l} is out of range: the model has {n} decoder layers, so 0..={n} \
                 ({n} is after the final norm)"
            )));
        }
        self.on_pool(|| self.runner().states(batch, layers))
    }

    /// Runs a forward `f` on the compute pool (rayon's) when the model is on the CPU. Called
    /// from a thread outside the pool, every parallel kernel of the forward (a few hundred a
    /// forward) handed its work to the pool and put the caller to sleep until it was done, and
    /// its pieces' threads slept between kernels; on one of the pool's threads the forward forks
    /// each kernel itself and runs a share of it. Which thread runs a piece does not change its
    /// sums. On a GPU the forward stays on its caller's thread, which holds the device.
    fn on_pool<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        if self.decoder.embeddings().device().is_cpu() && rayon::current_thread_index().is_none() {
            rayon::scope(|_| f())
        } else {
            f()
        }
    }

    /// That the rows fit the model and the positions their rows.
    fn check_input(&self, batch: &[&[u32]], positions: &[&[usize]]) -> Result<(), ModelError> {
        if batch.len() != positions.len() {
            return Err(ModelError::BadInput(format!(
                "{} rows but {} position lists",
                batch.len(),
                positions.len()
            )));
        }
        for (b, (row, pos)) in batch.iter().zip(positions).enumerate() {
            if row.len() > self.max_positions() {
                return Err(ModelError::BadInput(format!(
                    "row {b} has {} tokens, more than the model's {}",
                    row.len(),
                    self.max_positions()
                )));
            }
            if let Some(id) = row
                .iter()
                .find(|id| **id as usize >= self.config.vocab_size)
            {
                return Err(ModelError::BadInput(format!(
                    "row {b}: token id {id} is outside the vocabulary"
                )));
            }
            if let Some(p) = pos.iter().find(|p| **p >= row.len()) {
                return Err(ModelError::BadInput(format!(
                    "row {b}: position {p} is past its {} tokens",
                    row.len()
                )));
            }
        }
        Ok(())
    }

    /// Whether the head reads each step's own tokens (`Batch::with_spans`).
    pub fn reads_spans(&self) -> bool {
        self.head.reads_spans()
    }

    fn runner(&self) -> Runner<'_> {
        Runner {
            decoder: &self.decoder,
            head: &self.head,
            cache: self.cache.as_ref(),
            bytes_per_token: self.cache_bytes_per_token(),
            share: self.share,
        }
    }
}

fn read(path: &Path) -> Result<String, ModelError> {
    std::fs::read_to_string(path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => ModelError::MissingFile(path.to_path_buf()),
        _ => ModelError::Io {
            path: path.to_path_buf(),
            source,
        },
    })
}

/// `model.safetensors`, else the distinct shards of `model.safetensors.index.json` (sorted).
fn weight_files(folder: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let single = folder.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index_path = folder.join("model.safetensors.index.json");
    if !index_path.is_file() {
        return Err(ModelError::MissingFile(single));
    }
    let bad = |reason: String| ModelError::BadConfig {
        path: index_path.clone(),
        key: "weight_map".into(),
        reason,
    };
    let index: serde_json::Value =
        serde_json::from_str(&read(&index_path)?).map_err(|e| bad(e.to_string()))?;
    let map = index
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("missing or not an object".into()))?;
    let mut shards = map
        .values()
        .map(|v| {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| bad(format!("shard name {v} is not a string")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    shards.sort();
    shards.dedup();
    if shards.is_empty() {
        return Err(bad("names no shard files".into()));
    }
    shards
        .into_iter()
        .map(|s| {
            let p = folder.join(&s);
            if s.contains('/') || s.contains('\\') || s.starts_with('.') {
                Err(bad(format!("shard name {s:?} is not a plain file name")))
            } else if p.is_file() {
                Ok(p)
            } else {
                Err(ModelError::MissingFile(p))
            }
        })
        .collect()
}

#[cfg(test)]
#[path = "model_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "taps_tests.rs"]
mod taps_tests;

#[cfg(test)]
#[path = "outcome_tests.rs"]
mod outcome_tests;

#[cfg(test)]
#[path = "kernels_tests.rs"]
mod kernels_tests;
