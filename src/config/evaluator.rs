//! One `[[evaluator]]` table: the keys every kind shares, then the kind's own struct, which
//! lives with the kind (`prm::PrmConfig`, `judge::JudgeConfig`, `cascade::CascadeConfig`). The
//! deserialiser refuses an unknown key or a key of another kind; each kind checks the rest.

use crate::cascade::CascadeConfig;
use crate::engine::Description;
use crate::judge::JudgeConfig;
use crate::prm::PrmConfig;
use crate::trace::Aggregate;
use serde::{Deserialize, Serialize};

/// One `[[evaluator]]` table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EvaluatorConfig {
    pub name: String,
    /// Unset: a trained head's own threshold, else `defaults::THRESHOLD` (filled in when the
    /// config is resolved, so the printed config says what applies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold: Option<f32>,
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

/// The defaults of the keys every kind shares.
pub mod defaults {
    pub const THRESHOLD: f32 = crate::engine::DEFAULT_THRESHOLD;
    pub const MAX_CONCURRENCY: usize = 256;

    pub(super) fn max_concurrency() -> usize {
        MAX_CONCURRENCY
    }
}

impl EvaluatorConfig {
    /// A table with the shared keys at their defaults.
    pub fn new(name: &str, kind: KindConfig) -> Self {
        EvaluatorConfig {
            name: name.to_string(),
            threshold: Some(defaults::THRESHOLD),
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

    /// What ListEvaluators says of it while it loads: its kind, a PRM's family, and the model
    /// (a PRM's folder, a judge's upstream model).
    pub fn loading(&self) -> Description {
        let (family, model) = match self {
            KindConfig::Prm(p) => (p.family.as_str(), p.model.as_str()),
            KindConfig::Judge(j) => ("", j.model.as_str()),
            KindConfig::Cascade(_) => ("", ""),
        };
        Description {
            kind: self.name().to_string(),
            family: family.to_string(),
            model: model.to_string(),
        }
    }
}
