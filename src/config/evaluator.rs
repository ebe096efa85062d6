//! One `[[evaluator]]` table: the keys every kind shares, then the kind's own struct, which
//! lives with the kind (`prm::PrmConfig`, `judge::JudgeConfig`, `cascade::CascadeConfig`,
//! `composite::CompositeConfig`). The
//! deserialiser refuses an unknown key or a key of another kind; each kind checks the rest.

use super::reward::Gives;
use crate::cascade::CascadeConfig;
use crate::composite::CompositeConfig;
use crate::engine::{Description, Sharing};
use crate::judge::JudgeConfig;
use crate::prm::{Backend, PrmConfig};
use crate::record::RecordConfig;
use crate::trace::Aggregate;
use serde::{Deserialize, Serialize};

/// One `[[evaluator]]` table.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct EvaluatorConfig {
    pub name: String,
    /// Unset: the engine applies a trained head's own threshold (for the head and a cascade or
    /// composite over it), else 0.5; ListEvaluators reports the one in force.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub threshold: Option<f32>,
    #[serde(default)]
    pub(crate) aggregate: Aggregate,
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
    Composite(CompositeConfig),
}

/// The defaults of the keys every kind shares.
pub(crate) mod defaults {
    pub(crate) const MAX_CONCURRENCY: usize = 256;

    pub(super) fn max_concurrency() -> usize {
        MAX_CONCURRENCY
    }
}

impl EvaluatorConfig {
    pub(crate) fn kind_name(&self) -> &'static str {
        self.kind.name()
    }
}

impl KindConfig {
    pub fn name(&self) -> &'static str {
        match self {
            KindConfig::Prm(_) => "prm",
            KindConfig::Judge(_) => "judge",
            KindConfig::Cascade(_) => "cascade",
            KindConfig::Composite(_) => "composite",
        }
    }

    /// What its verdicts carry: step scores, an outcome score, or both.
    pub(crate) fn gives(&self) -> Gives {
        let outcome_only = matches!(self, KindConfig::Prm(p) if p.family.is_outcome());
        Gives {
            steps: !outcome_only,
            outcome: outcome_only || matches!(self, KindConfig::Composite(_)),
        }
    }

    /// Its kind for messages, with a PRM's family: `prm (outcome-rm)`, `judge`.
    pub(crate) fn describe_kind(&self) -> String {
        match self {
            KindConfig::Prm(p) => format!("prm ({})", p.family.as_str()),
            other => other.name().to_string(),
        }
    }

    /// Where it records verdicts, if it does (a judge or a cascade).
    pub(crate) fn record(&self) -> Option<&RecordConfig> {
        match self {
            KindConfig::Judge(j) => j.record.as_ref(),
            KindConfig::Cascade(c) => c.record.as_ref(),
            KindConfig::Prm(_) | KindConfig::Composite(_) => None,
        }
    }

    /// How its requests share its time: an in-process model batches them on this machine's
    /// cores; an upstream (a judge, a vLLM PRM) serves them side by side, and so, for the
    /// deadline's sake, does a cascade or composite, whose requests wait mostly on the
    /// evaluators they wrap (whose own slots count the work too).
    pub(crate) fn sharing(&self) -> Sharing {
        match self {
            KindConfig::Prm(p) if p.backend == Backend::Candle => Sharing::Batched,
            _ => Sharing::Parallel,
        }
    }

    /// What ListEvaluators says of it while it loads: its kind, a PRM's family, and the model
    /// (a PRM's folder, a judge's upstream model).
    pub fn loading(&self) -> Description {
        let (family, model) = match self {
            KindConfig::Prm(p) => (p.family.as_str(), p.model.as_str()),
            KindConfig::Judge(j) => ("", j.model.as_str()),
            KindConfig::Cascade(_) | KindConfig::Composite(_) => ("", ""),
        };
        Description {
            kind: self.name().to_string(),
            family: family.to_string(),
            model: model.to_string(),
        }
    }
}
