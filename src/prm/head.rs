//! A trained head's folder (docs/training.md): its `config.json` as the one type that `retrace
//! train-head` writes and `family = "head"` reads (the tensor names of its `head.safetensors`
//! are `retrace_model::head_tensors`, which both sides use too), the checks a type can't
//! express (each error names the file and key), and the base it is tied to, verified by
//! checksum before it loads.

use super::config::Dtype;
use super::format::Family;
use crate::trace::ErrorCategory;
pub use retrace_model::HeadKind;
pub use retrace_model::Pool;
use retrace_model::{HEAD_CONFIG, TrainedSpec, checkpoint_sha256};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// The format version this server reads and `train-head` writes.
pub const HEAD_VERSION: u32 = 1;

/// A head folder's `config.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HeadConfig {
    /// The format version, `HEAD_VERSION`.
    pub retrace_head: u32,
    /// The base checkpoint as given (a folder or a `.gguf` file); relative to the head folder
    /// when relative.
    pub base: String,
    /// `retrace_model::checkpoint_sha256` of the base: its weights, tokenizer, chat template
    /// and config, all of which the features depend on.
    pub base_sha256: String,
    /// The dtype the base ran in when the features were computed; serving in another is
    /// refused (its features differ). Unset in folders written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<Dtype>,
    /// The family whose formatting and read positions the head uses.
    #[serde(default = "chat_lm")]
    pub format: Family,
    /// The decoder layers the feature reads; `num_hidden_layers` is after the final norm.
    pub layers: Layers,
    /// Where each group of `layers` is read, in order: `read` (at the step's read position)
    /// or `span` (the mean over the step's own tokens). Omitted: every group at the read.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pools: Vec<Pool>,
    pub hidden_size: usize,
    /// The step head: `head`, and `mlp_hidden` or `trace_width` for its size.
    #[serde(flatten)]
    pub head: HeadKind,
    /// A step whose probability is below it is wrong; the first such step is the first error.
    pub threshold: f32,
    /// The category head's labels in its row order; `None` without one.
    #[serde(default)]
    pub categories: Option<Vec<ErrorCategory>>,
    /// What it was trained on: the trainer's record, which serving does not read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label_counts: Option<LabelCounts>,
    #[serde(default)]
    pub data: Vec<DataFile>,
    #[serde(default)]
    pub dev: Vec<DataFile>,
    #[serde(default)]
    pub seed: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dev_f1: Option<f64>,
}

/// The layers a feature reads: one group averaged (`[26, 27, 28, 29]` in `config.json`), or
/// several groups, each averaged and the means concatenated in order (`[[15], [26, 27]]`),
/// which makes the feature `hidden_size` times the groups wide.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layers(pub Vec<Vec<usize>>);

impl std::fmt::Display for Layers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.as_slice() {
            [one] => write!(f, "{one:?}"),
            groups => write!(f, "{groups:?} concatenated"),
        }
    }
}

/// A flat list for one group, so a one-group head's file reads as it always has.
impl Serialize for Layers {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [one] => one.serialize(s),
            groups => groups.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for Layers {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Either {
            Mean(Vec<usize>),
            Groups(Vec<Vec<usize>>),
        }
        Either::deserialize(d)
            .map(|e| match e {
                Either::Mean(one) => Layers(vec![one]),
                Either::Groups(groups) => Layers(groups),
            })
            .map_err(|_| {
                serde::de::Error::custom(
                    "`layers` is a list of layers ([26, 27]) or of groups of layers ([[15], [26, 27]])",
                )
            })
    }
}

/// Step and trace counts of a training set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct LabelCounts {
    pub correct_steps: usize,
    pub wrong_steps: usize,
    pub traces: usize,
    pub all_correct_traces: usize,
    /// Traces that carried a reference answer, which the format puts in the prompt: a head
    /// trained with them reads their features, one trained without does not. Unset in folders
    /// written before it was recorded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub with_reference: Option<usize>,
}

/// Whether a head's training traces carried reference answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum References {
    None,
    Some,
    All,
}

/// Says, once, when a head serves traces unlike those it was trained on in their reference
/// answers: the format puts a reference in the prompt, so the features differ with and
/// without one, and so does what the head learned to read.
#[derive(Debug, Default)]
pub(crate) struct ReferenceWatch {
    trained: Option<References>,
    warned: std::sync::atomic::AtomicBool,
}

impl ReferenceWatch {
    pub(crate) fn new(counts: Option<&LabelCounts>) -> Self {
        ReferenceWatch {
            trained: counts.and_then(LabelCounts::references),
            warned: Default::default(),
        }
    }

    /// Whether a trace with (`with`) or without a reference is unlike the training traces.
    pub(crate) fn differs(&self, with: bool) -> bool {
        matches!(
            (self.trained, with),
            (Some(References::None), true) | (Some(References::All), false)
        )
    }

    /// Warns the first time a trace differs.
    pub(crate) fn check(&self, evaluator: &str, with: bool) {
        use std::sync::atomic::Ordering;
        if self.differs(with) && !self.warned.swap(true, Ordering::Relaxed) {
            let (trained, served) = match with {
                true => ("without reference answers", "with one"),
                false => ("with reference answers", "without one"),
            };
            tracing::warn!(
                evaluator,
                "this head was trained {trained}, and serves a trace {served}: its scores may \
                 not be what its training measured (the reward routes send none unless \
                 [reward] labels = \"reference\"); said once"
            );
        }
    }
}

impl LabelCounts {
    /// What the training traces carried; None where it was not recorded.
    pub fn references(&self) -> Option<References> {
        Some(match self.with_reference? {
            0 => References::None,
            n if n >= self.traces => References::All,
            _ => References::Some,
        })
    }
}

/// A data file a head was trained or tuned on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataFile {
    pub path: String,
    pub sha256: String,
    pub rows: usize,
}

fn chat_lm() -> Family {
    Family::ChatLm
}

/// A head folder checked against its config's rules and its base's checksum: what serving it
/// needs.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct HeadFolder {
    pub dir: PathBuf,
    pub config: HeadConfig,
    /// The base, resolved against `dir`.
    pub base: PathBuf,
}

impl HeadConfig {
    /// The folder's `config.json` text, as `read` reads it back.
    pub fn to_json(&self) -> String {
        // Plain fields and string-keyed maps only: serialising cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_default() + "\n"
    }

    /// Reads and checks `dir/config.json`; errors name the file and the key.
    pub fn read(dir: &Path) -> Result<HeadConfig, String> {
        let path = dir.join(HEAD_CONFIG);
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let config: HeadConfig =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        config
            .check()
            .map_err(|(key, reason)| format!("{}: bad `{key}`: {reason}", path.display()))?;
        Ok(config)
    }

    /// The rules a type can't express, as (key, reason).
    fn check(&self) -> Result<(), (&'static str, String)> {
        if self.retrace_head != HEAD_VERSION {
            let v = self.retrace_head;
            return Err((
                "retrace_head",
                format!("version {v}; this server reads {HEAD_VERSION}"),
            ));
        }
        if self.layers.0.is_empty() || self.layers.0.iter().any(Vec::is_empty) {
            return Err(("layers", "lists no layer".into()));
        }
        self.check_pools()?;
        if self.hidden_size == 0 {
            return Err(("hidden_size", "must be at least 1".into()));
        }
        if !(0.0..=1.0).contains(&self.threshold) {
            return Err((
                "threshold",
                format!("must lie in [0, 1], got {}", self.threshold),
            ));
        }
        if let Some(c) = &self.categories {
            check_categories(c).map_err(|reason| ("categories", reason))?;
        }
        let sum = &self.base_sha256;
        if sum.len() != 64 || !sum.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(("base_sha256", "must be 64 hexadecimal digits".into()));
        }
        Ok(())
    }

    /// One pool per group, and spans only where the format marks them.
    fn check_pools(&self) -> Result<(), (&'static str, String)> {
        let (pools, groups) = (self.pools.len(), self.layers.0.len());
        if pools != 0 && pools != groups {
            return Err((
                "pools",
                format!("names {pools} pools for {groups} groups of layers"),
            ));
        }
        let conversation = matches!(self.format, Family::ChatLm | Family::Rlhflow);
        if self.pools.contains(&Pool::Span) && !conversation {
            return Err((
                "pools",
                format!(
                    "\"span\" reads each step's own tokens, which format {} does not mark \
                     (chat-lm and rlhflow do)",
                    self.format.as_str()
                ),
            ));
        }
        Ok(())
    }

    /// The model's view of the head in `dir`.
    pub(crate) fn spec(&self, dir: &Path) -> TrainedSpec {
        TrainedSpec {
            dir: dir.to_path_buf(),
            groups: self.layers.0.clone(),
            hidden_size: self.hidden_size,
            pools: self.pools.clone(),
            kind: self.head,
            categories: self.categories.as_ref().map_or(0, Vec::len),
        }
    }
}

/// Labels of a category head: known, none twice, at least one error category.
fn check_categories(labels: &[ErrorCategory]) -> Result<(), String> {
    if labels.contains(&ErrorCategory::Unspecified) {
        return Err("\"unspecified\" is not a category a head can name".into());
    }
    for (i, c) in labels.iter().enumerate() {
        if labels[..i].contains(c) {
            return Err(format!("{:?} is listed twice", c.as_str()));
        }
    }
    if labels.iter().all(|c| *c == ErrorCategory::None) {
        return Err("names no error category".into());
    }
    Ok(())
}

impl HeadFolder {
    /// Reads `dir`'s config and verifies its base: a base whose checksum differs from the one
    /// the head was trained on is refused, naming both and the base.
    pub(crate) fn open(dir: &Path) -> Result<HeadFolder, String> {
        let config = HeadConfig::read(dir)?;
        let base = dir.join(&config.base);
        let path = dir.join(HEAD_CONFIG);
        if !base.exists() {
            return Err(format!(
                "{}: base {} does not exist",
                path.display(),
                base.display()
            ));
        }
        let sum = checkpoint_sha256(&base).map_err(|e| format!("base {}: {e}", base.display()))?;
        if !sum.eq_ignore_ascii_case(&config.base_sha256) {
            return Err(format!(
                "{}: the base {} has checksum {sum}, but the head was trained on a base with \
                 checksum {}: the weights differ, so the head does not apply",
                path.display(),
                base.display(),
                config.base_sha256
            ));
        }
        Ok(HeadFolder {
            dir: dir.to_path_buf(),
            config,
            base,
        })
    }

    /// Refuses to serve the head over a base run in another dtype than the one its features
    /// were computed in (`served`): the states differ, so its threshold no longer applies.
    pub(crate) fn check_dtype(&self, served: Dtype) -> Result<(), String> {
        match self.config.dtype {
            Some(trained) if trained != served => Err(format!(
                "{}: the head was trained on the base's states in {}, but this evaluator runs \
                 the base in {}: set dtype = \"{}\" on it, or train the head in {}",
                self.dir.join(HEAD_CONFIG).display(),
                trained.as_str(),
                served.as_str(),
                trained.as_str(),
                served.as_str()
            )),
            _ => Ok(()),
        }
    }

    /// The category at a first error from its category probabilities (`probs`, in the
    /// config's label order): the most probable label other than `none`.
    pub(crate) fn category(&self, probs: &[f32]) -> ErrorCategory {
        let labels = self.config.categories.as_deref().unwrap_or_default();
        labels
            .iter()
            .zip(probs)
            .filter(|(c, _)| **c != ErrorCategory::None)
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(ErrorCategory::Unspecified, |(c, _)| *c)
    }
}

#[cfg(test)]
#[path = "head_tests.rs"]
mod tests;
