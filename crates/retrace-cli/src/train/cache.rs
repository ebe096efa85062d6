//! The feature cache: each data file's features, once extracted, kept on disk under a key of
//! everything they depend on (the base's checksum, the format, the taps, the precision, the
//! file's checksum and this program's version), so trying other training settings reuses them.
//! `train-head` keeps one entry per file and tap part, so other taps reuse the parts they share.
//!
//! An entry is `KEY.safetensors` (one (steps, H) f32 matrix per tap, `tap.0`, `tap.1`, ...)
//! and `KEY.json` (the key and each row's step count), each written to a temporary name and
//! renamed; the index goes last, so an entry without one is incomplete and is not read. An
//! entry that does not match what is asked of it is recomputed, never trusted.

use super::TrainError;
use super::checksum::sha256;
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// What a file's features depend on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Key {
    /// This program's version: extraction may change between versions.
    pub(crate) retrace: String,
    pub(crate) base_sha256: String,
    pub(crate) format: String,
    /// Each tap's layers, in order.
    pub(crate) taps: Vec<Vec<usize>>,
    /// Where each tap is read, when some tap is read over the steps' tokens; empty when
    /// every one is read at the read position (so such keys name what they always named).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) pools: Vec<retrace::Pool>,
    /// The device kind and dtype the base ran in ("cpu f32").
    pub(crate) precision: String,
    pub(crate) file_sha256: String,
}

#[derive(Debug, Serialize, Deserialize)]
struct Index {
    key: Key,
    /// The file the entry was made from (for people reading the cache).
    file: String,
    hidden_size: usize,
    /// Each row's step count, in file order.
    steps: Vec<usize>,
}

/// One file's features: one (total steps, H) matrix per tap, rows in file and step order.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) steps: Vec<usize>,
    pub(crate) taps: Vec<Tensor>,
}

/// A folder of entries.
#[derive(Debug, Clone)]
pub(crate) struct FeatureCache {
    pub(crate) dir: PathBuf,
}

impl Key {
    fn name(&self) -> String {
        let json = serde_json::to_vec(self).unwrap_or_default();
        sha256(&json)[..32].to_string()
    }
}

fn io(what: String) -> impl FnOnce(std::io::Error) -> TrainError {
    move |source| TrainError::Io { what, source }
}

/// Writes `bytes` to `path` by way of a temporary file beside it.
fn write_atomic(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<(), TrainError>,
) -> Result<(), TrainError> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let result = write(&tmp).and_then(|()| {
        std::fs::rename(&tmp, path).map_err(io(format!("renaming {}", tmp.display())))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

impl FeatureCache {
    fn paths(&self, key: &Key) -> (PathBuf, PathBuf) {
        let name = key.name();
        (
            self.dir.join(format!("{name}.safetensors")),
            self.dir.join(format!("{name}.json")),
        )
    }

    /// The entry for `key` whose rows have exactly `steps` steps; None when there is none or
    /// it does not match (then it is recomputed and replaced).
    pub(crate) fn get(&self, key: &Key, steps: &[usize]) -> Option<Entry> {
        let (data, index) = self.paths(key);
        let index: Index = serde_json::from_slice(&std::fs::read(index).ok()?).ok()?;
        if index.key != *key || index.steps != steps {
            return None;
        }
        let mut tensors: HashMap<String, Tensor> =
            candle_core::safetensors::load(&data, &Device::Cpu).ok()?;
        let rows: usize = steps.iter().sum();
        let taps = (0..key.taps.len())
            .map(|i| {
                let t = tensors.remove(&format!("tap.{i}"))?;
                (t.dims() == [rows, index.hidden_size]).then_some(t)
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Entry {
            steps: index.steps,
            taps,
        })
    }

    /// Stores `entry` under `key`: the data, then the index that makes it visible.
    pub(crate) fn put(&self, key: &Key, file: &Path, entry: &Entry) -> Result<(), TrainError> {
        std::fs::create_dir_all(&self.dir).map_err(io(format!(
            "creating the feature cache {}",
            self.dir.display()
        )))?;
        let (data, index) = self.paths(key);
        let tensors: HashMap<String, Tensor> = entry
            .taps
            .iter()
            .enumerate()
            .map(|(i, t)| (format!("tap.{i}"), t.clone()))
            .collect();
        write_atomic(&data, |tmp| {
            Ok(candle_core::safetensors::save(&tensors, tmp)?)
        })?;
        let hidden_size = entry
            .taps
            .first()
            .map_or(0, |t| t.dims().get(1).copied().unwrap_or(0));
        let json = serde_json::to_vec_pretty(&Index {
            key: key.clone(),
            file: file.display().to_string(),
            hidden_size,
            steps: entry.steps.clone(),
        })
        .map_err(|e| TrainError::Usage(format!("the cache index: {e}")))?;
        write_atomic(&index, |tmp| {
            std::fs::write(tmp, &json).map_err(io(format!("writing {}", tmp.display())))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(file: &str) -> Key {
        Key {
            retrace: "0".into(),
            base_sha256: "b".into(),
            format: "chat-lm".into(),
            taps: vec![vec![2], vec![0, 1]],
            pools: Vec::new(),
            precision: "cpu f32".into(),
            file_sha256: file.into(),
        }
    }

    fn entry() -> Entry {
        let t = |v: f32| Tensor::full(v, (5, 3), &Device::Cpu).unwrap();
        Entry {
            steps: vec![2, 3],
            taps: vec![t(1.0), t(2.0)],
        }
    }

    #[test]
    fn round_trips_and_refuses_what_does_not_match() {
        let dir = std::env::temp_dir().join(format!("retrace-fcache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cache = FeatureCache { dir: dir.clone() };
        assert!(cache.get(&key("f"), &[2, 3]).is_none());
        cache
            .put(&key("f"), Path::new("d.jsonl"), &entry())
            .unwrap();
        let got = cache.get(&key("f"), &[2, 3]).unwrap();
        assert_eq!(got.taps[1].to_vec2::<f32>().unwrap()[4], [2.0; 3]);
        assert!(cache.get(&key("f"), &[3, 2]).is_none(), "other step counts");
        assert!(cache.get(&key("g"), &[2, 3]).is_none(), "another file");
        // A damaged data file (an interrupted writer cannot leave one, but a disk can): missed,
        // then replaced.
        let (data, _) = cache.paths(&key("f"));
        std::fs::write(&data, b"not safetensors").unwrap();
        assert!(cache.get(&key("f"), &[2, 3]).is_none());
        cache
            .put(&key("f"), Path::new("d.jsonl"), &entry())
            .unwrap();
        assert!(cache.get(&key("f"), &[2, 3]).is_some());
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names.len(), 2, "no temporary file left: {names:?}");
        std::fs::remove_dir_all(dir).unwrap();
    }
}
