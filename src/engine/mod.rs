//! The engine: the `Evaluator` trait, the engine's error enum, and the registry that admits,
//! queues and dispatches requests to evaluators.

mod current;
mod origin;
mod pace;
mod registry;
mod reload;
mod slot;

pub use origin::Origin;
pub(crate) use pace::Sharing;
pub use registry::Engine;
pub(crate) use registry::{Admission, LoadByName, Loaded, any_changed, wrapped};
pub use reload::Reloaded;
pub(crate) use slot::SlotSpec;

use crate::field::FieldPath;
use crate::trace::{Judgement, Trace};
use futures::future::BoxFuture;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// The threshold of an evaluator whose config sets none and that has none of its own.
pub(crate) const DEFAULT_THRESHOLD: f32 = 0.5;

/// What an evaluator says about itself, for ListEvaluators.
#[derive(Debug, Clone, PartialEq)]
pub struct Description {
    /// prm, judge, cascade or composite.
    pub kind: String,
    /// The PRM family, or the judge's upstream model.
    pub family: String,
    /// The model folder or model name.
    pub model: String,
}

/// A trained head and its base, each by its checksum (`retrace_model::checkpoint_sha256`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadChecksums {
    pub head_sha256: String,
    pub base_sha256: String,
}

/// One unit of work handed to an evaluator.
#[derive(Debug, Clone)]
pub struct Job {
    pub trace: Arc<Trace>,
    pub threshold: f32,
    /// When the caller stops waiting; work not started by then is dropped.
    pub deadline: Option<Instant>,
}

/// One request, parsed and structurally validated at the API edge.
#[derive(Debug, Clone)]
pub struct Request {
    /// Empty selects the default.
    pub evaluator: String,
    pub trace: Arc<Trace>,
    pub threshold: Option<f32>,
    pub deadline: Option<Instant>,
    pub arrived: Instant,
    /// Where the trace sits in the caller's body, for naming fields in errors.
    pub origin: Origin,
}

/// Anything that judges a validated trace: a PRM backend, a judge client, a cascade.
///
/// Dropping the returned future means the caller has gone: an implementation must then drop any
/// work it queued for this job before it reaches a model or an upstream.
pub trait Evaluator: Send + Sync + 'static {
    fn describe(&self) -> Description;

    /// Whether it can answer now: false when a model thread died. An upstream judge's health is
    /// not ours, so a judge stays ready while its breaker is open (it answers UNAVAILABLE fast).
    fn ready(&self) -> bool {
        true
    }

    /// Why `ready()` is false, for the message a refused request gets.
    fn why_not_ready(&self) -> Option<String> {
        None
    }

    /// Pushes changes of `ready()`, for evaluators whose readiness can change (a model thread
    /// that dies); `None` when it never changes by itself.
    fn health(&self) -> Option<watch::Receiver<bool>> {
        None
    }

    /// Its own threshold (a trained head's calibrated one), which applies when the config
    /// sets none.
    fn threshold(&self) -> Option<f32> {
        None
    }

    /// The trained head it serves and that head's base, by checksum; `None` for anything but
    /// a trained head. `retrace_head_info` follows it as the slot's evaluator is set.
    fn head(&self) -> Option<HeadChecksums> {
        None
    }

    /// Which model answers now, as a count that a swap moves (a reload through the engine):
    /// a wrapper that calibrated on the last one knows to calibrate again.
    fn generation(&self) -> u64 {
        0
    }

    /// A PRM was swapped (any one: the engine tells every evaluator): a wrapper that
    /// calibrated on one it wraps calibrates again now, not at its next request, so what it
    /// reports (gauges, its description) follows the swap at once.
    fn after_swap(&self) {}

    /// Judges one trace; the judgement carries one score per step.
    fn evaluate(&self, job: Job) -> BoxFuture<'_, Result<Judgement, EngineError>>;
}

/// Every way a request can fail below the API; `api::status` maps each to one gRPC code.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// The input is at fault; `field` names where (e.g. `trace.steps[2]`). An evaluator names
    /// fields relative to the trace it was given; the engine makes them the caller's.
    #[error("{field}: {message}")]
    Invalid { field: FieldPath, message: String },
    /// The input passes one of the server's size limits: bad input too, but a trainer's sample
    /// that runs long is data, so the reward routes can score it apart instead of failing.
    #[error("{field}: {message}")]
    TooLarge {
        field: FieldPath,
        limit: Limit,
        message: String,
    },
    /// At capacity; `retry_after` is when the work ahead should have drained, where the
    /// evaluator's pace knows it (the caller is told to come back then).
    #[error("server at capacity: {message}")]
    Overloaded {
        message: String,
        retry_after: Option<Duration>,
    },
    #[error("unavailable: {0}")]
    Unavailable(String),
    #[error("deadline exceeded: {0}")]
    DeadlineExceeded(String),
    #[error("cancelled by the caller")]
    Cancelled,
    /// An operator's request the server's state refuses (a reload whose new model failed to
    /// load: the old one serves on).
    #[error("refused: {0}")]
    Refused(String),
    #[error("internal error: {0}")]
    Internal(String),
}

/// Why a loader could not build its evaluator: the kind's own load error (a PRM's, a judge's,
/// an evaluator a cascade wraps that is missing). The engine keeps its message, naming the
/// evaluator beside it in an `EvaluatorLoadError`.
pub type LoadFailure = Box<dyn std::error::Error + Send + Sync>;

/// An evaluator that a cascade or composite wraps was not loaded before it (`Engine::load`
/// loads them last, so a loader skipped it or the config named one that does not exist).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("its {key} {wanted:?} is not loaded")]
pub struct NotLoaded {
    /// The wrapper's key that names it (`prm`, `judge`, `steps`, `outcome`).
    pub key: &'static str,
    pub wanted: String,
}

/// Why an evaluator could not be loaded: which one, and the reason. Not a request's error: it
/// stops the server (or a tool's in-process engine) before anything is served.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("evaluator {evaluator:?}: {reason}")]
pub struct EvaluatorLoadError {
    pub evaluator: String,
    pub reason: String,
}

/// Which size limit a too-large input passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// `max_trace_bytes`.
    Bytes,
    /// `max_steps`.
    Steps,
    /// The model's context (`max_position_embeddings`).
    Tokens,
}

impl EngineError {
    pub fn too_large(field: FieldPath, limit: Limit, message: impl Into<String>) -> Self {
        EngineError::TooLarge {
            field,
            limit,
            message: message.into(),
        }
    }

    /// Overload with no estimate of when it passes (the slot fills one in from its pace).
    pub fn overloaded(message: impl Into<String>) -> Self {
        EngineError::Overloaded {
            message: message.into(),
            retry_after: None,
        }
    }

    pub fn invalid(field: impl Into<FieldPath>, message: impl Into<String>) -> Self {
        EngineError::Invalid {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// Boxes an evaluator for the registry.
pub(crate) fn shared<E: Evaluator>(e: E) -> Arc<dyn Evaluator> {
    Arc::new(e)
}
