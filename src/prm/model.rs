//! A loaded PRM checkpoint (config, decoder and head) and its one entry point: token ids and the
//! positions to read in, step scores out.

use super::batcher::Scorer;
use super::decoder::Decoder;
use super::format::Encoded;
use super::head::Head;
pub use super::head::HeadSpec;
use super::model_config::ModelConfig;
use super::weights::FileTensors;
use crate::config::DeviceSpec;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};
use candle_nn::VarBuilder;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("missing file {}", .0.display())]
    MissingFile(PathBuf),
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: bad `{key}`: {reason}", path.display())]
    BadConfig {
        path: PathBuf,
        key: String,
        reason: String,
    },
    #[error("bad input: {0}")]
    BadInput(String),
    #[error("device {name:?}: {reason}")]
    Device { name: String, reason: String },
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}

/// A PRM ready to score: immutable after loading, so one instance can serve every request.
pub struct PrmModel {
    config: ModelConfig,
    decoder: Decoder,
    head: Head,
}

impl PrmModel {
    /// Loads `folder/config.json` and the weights (`model.safetensors`, or the shards named by
    /// `model.safetensors.index.json`), read and converted to `dtype` on `device`.
    pub fn load(
        folder: &Path,
        head: HeadSpec,
        device: &Device,
        dtype: DType,
    ) -> Result<Self, ModelError> {
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
        let decoder = Decoder::new(&config, vb.clone())?;
        let head = Head::load(head, &config, vb, &weights, decoder.embeddings())?;
        Ok(Self {
            config,
            decoder,
            head,
        })
    }

    /// The longest input (in tokens) the model accepts.
    pub fn max_positions(&self) -> usize {
        self.config.max_position_embeddings
    }

    pub fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }

    /// Scores a batch in one forward pass: row `b` is read at `positions[b]` (in that order), and
    /// its scores in [0, 1] come back in the same order. Rows are packed, not padded (see
    /// `Decoder::forward`).
    pub fn score(
        &self,
        batch: &[&[u32]],
        positions: &[&[usize]],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
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
        if positions.iter().all(|p| p.is_empty()) {
            return Ok(vec![Vec::new(); batch.len()]);
        }
        let hidden = self.decoder.forward(batch, positions)?;
        let mut flat = self.head.scores(&hidden)?.into_iter();
        Ok(positions
            .iter()
            .map(|p| flat.by_ref().take(p.len()).collect())
            .collect())
    }
}

impl Scorer for PrmModel {
    fn score(&self, batch: &[&Encoded]) -> Result<Vec<Vec<f32>>, String> {
        let rows: Vec<&[u32]> = batch.iter().map(|e| e.ids.as_slice()).collect();
        let positions: Vec<&[usize]> = batch.iter().map(|e| e.positions.as_slice()).collect();
        PrmModel::score(self, &rows, &positions).map_err(|e| e.to_string())
    }
}

/// The candle device a config names; CUDA needs a build with `--features cuda`.
pub fn device(spec: DeviceSpec) -> Result<Device, ModelError> {
    let err = |reason: String| ModelError::Device {
        name: spec.to_string(),
        reason,
    };
    match spec {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Cuda(ordinal) if cfg!(feature = "cuda") => {
            Device::new_cuda(ordinal).map_err(|e| err(e.to_string()))
        }
        DeviceSpec::Cuda(_) => Err(err(
            "this build has no CUDA support; rebuild with `--features cuda`".to_string(),
        )),
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
