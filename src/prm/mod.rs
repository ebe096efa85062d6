//! Process reward models on candle: checkpoint loading, the decoder, heads, per-family input
//! formatting, and the batching model thread, behind the engine's `Evaluator` trait.

mod bases;
pub(crate) use bases::Bases;
mod batcher;
mod candle;
mod config;
mod family;
pub(crate) mod features;
pub(crate) mod format;
pub(crate) mod head;
pub(crate) mod remote;
mod spans;
mod template;

pub use batcher::BatchError;
pub(crate) use batcher::Budget;
pub use batcher::{ScoreError, Scorer};
pub use config::{Backend, CandleConfig, DeviceSpec, Dtype, PrmConfig, VllmConfig};
pub(crate) use config::{MOVED_TO_VLLM, defaults};

use crate::engine::{Description, EngineError, Evaluator, HeadChecksums, Job, Limit};
use crate::env::Env;
use crate::field::FieldPath;
use crate::metrics;
use crate::trace::Judgement;
use batcher::Batcher;
use format::{FormatError, Formatter, PrmKind};
use futures::future::BoxFuture;
use head::HeadFolder;
use retrace_model::SharedBase;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Why a PRM evaluator could not be built; the engine's load error names which one.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct PrmLoadError(pub String);

/// The PRM layer's errors on a request; `From<PrmError> for EngineError` is their one exit.
#[derive(Debug, thiserror::Error)]
pub enum PrmError {
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error(
        "{tokens} tokens exceed the model's context of {limit} tokens (max_position_embeddings)"
    )]
    TooLong { tokens: usize, limit: usize },
    #[error(transparent)]
    Batch(#[from] BatchError),
    /// A bug: the task that tokenizes a trace panicked.
    #[error("tokenizing panicked: {0}")]
    Panicked(String),
    /// A bug in an outcome family's format: its head read other than one position.
    #[error("an outcome model read {0} positions, not one")]
    OutcomeReads(usize),
}

impl From<PrmError> for EngineError {
    fn from(e: PrmError) -> Self {
        match e {
            // Fields relative to the trace; the engine knows where the trace sits.
            PrmError::Format(FormatError::Step { step, message }) => {
                EngineError::invalid(FieldPath::root().then("steps").at(step), message)
            }
            PrmError::Format(FormatError::Trace(message)) => {
                EngineError::invalid(FieldPath::root(), message)
            }
            e @ PrmError::TooLong { .. } => {
                EngineError::too_large(FieldPath::root(), Limit::Tokens, e.to_string())
            }
            PrmError::Batch(BatchError::QueueFull(n)) => {
                EngineError::overloaded(format!("the model's queue is full ({n} requests)"))
            }
            PrmError::Batch(BatchError::Stopped) => {
                EngineError::Unavailable("the model thread has stopped".into())
            }
            PrmError::Batch(BatchError::Deadline) => {
                EngineError::DeadlineExceeded("queued for the model past the deadline".into())
            }
            PrmError::Batch(e @ BatchError::Model(_)) => EngineError::Internal(e.to_string()),
            PrmError::Batch(e @ BatchError::Died { .. }) => EngineError::Unavailable(e.to_string()),
            e @ (PrmError::Panicked(_) | PrmError::OutcomeReads(_)) => {
                EngineError::Internal(e.to_string())
            }
        }
    }
}

/// What a scorer accepts: rows up to `max_tokens` long, token ids below `vocab_size`, and
/// where `reads_spans`, each step's own tokens marked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Limits {
    pub max_tokens: usize,
    pub vocab_size: usize,
    pub reads_spans: bool,
}

/// A PRM evaluator: formatter on the caller's task, model on its own thread.
pub struct PrmEvaluator {
    name: String,
    family: PrmKind,
    folder: PathBuf,
    formatter: Arc<Formatter>,
    limits: Limits,
    batcher: Batcher,
    /// A trained head's folder (family `head`): its threshold and category labels.
    head: Option<HeadFolder>,
    /// A trained head's base, held so that the next head on it (a reload's) shares it.
    base: Option<Arc<SharedBase>>,
    /// A trained head's record of reference answers, against what it serves.
    references: head::ReferenceWatch,
    /// A trained head's checksum and its base's.
    checksums: Option<HeadChecksums>,
}

/// Loads the PRM an `[[evaluator]]` table describes (runs on a blocking thread): the checkpoint
/// on candle, or the formatter in front of a vLLM server. A trained head shares its base
/// through `bases` with the other heads the same loader built.
pub(crate) fn load(
    name: &str,
    max_concurrency: usize,
    cfg: &PrmConfig,
    bases: &Bases,
) -> Result<Arc<dyn Evaluator>, PrmLoadError> {
    if let (Backend::Vllm, Some(vllm)) = (cfg.backend, &cfg.vllm) {
        return Ok(Arc::new(remote::RemotePrm::load(
            name,
            max_concurrency,
            cfg,
            vllm,
        )?));
    }
    Ok(Arc::new(PrmEvaluator::load_sharing(
        name,
        max_concurrency,
        cfg,
        bases,
    )?))
}

impl PrmEvaluator {
    /// The PRM `cfg` describes, on candle; a trained head's base is loaded for it alone.
    pub fn load(
        name: &str,
        max_concurrency: usize,
        cfg: &PrmConfig,
    ) -> Result<PrmEvaluator, PrmLoadError> {
        Self::load_sharing(name, max_concurrency, cfg, &Bases::default())
    }

    /// `load`, a trained head sharing its base with the heads `bases` holds.
    pub(crate) fn load_sharing(
        name: &str,
        max_concurrency: usize,
        cfg: &PrmConfig,
        bases: &Bases,
    ) -> Result<PrmEvaluator, PrmLoadError> {
        let PrmKind::Checkpoint(family) = cfg.family else {
            return Self::load_head(name, max_concurrency, cfg, bases);
        };
        let fail = PrmLoadError;
        let folder = find_model(
            &cfg.model,
            "for the embedded default, run scripts/fetch-smollm2.sh",
        )?;
        let formatter = Formatter::load(family, &folder).map_err(|e| fail(e.to_string()))?;
        let model = candle::load_model(&folder, formatter.head_spec(), cfg)
            .map_err(|e| fail(e.to_string()))?;
        let limits = Limits {
            max_tokens: model.max_positions(),
            vocab_size: model.vocab_size(),
            reads_spans: model.reads_spans(),
        };
        Self::assemble(name, max_concurrency, cfg, folder, formatter, model, limits)
    }

    /// A head trained on a frozen base (`cfg.model` is its folder): the base verified by its
    /// checksum, formatted with the head's format, and shared with any head that holds it.
    fn load_head(
        name: &str,
        max_concurrency: usize,
        cfg: &PrmConfig,
        bases: &Bases,
    ) -> Result<PrmEvaluator, PrmLoadError> {
        let fail = PrmLoadError;
        let dir = find_model(&cfg.model, "a head folder that retrace train-head wrote")?;
        let head = HeadFolder::open(&dir).map_err(fail)?;
        // A .gguf base runs its quantized weights with f32 activations, whatever the table says.
        let served = match retrace_model::is_gguf(&head.base) {
            true => Dtype::F32,
            false => cfg.dtype(),
        };
        head.check_dtype(served).map_err(fail)?;
        let formatter =
            Formatter::load(head.config.format, &head.base).map_err(|e| fail(e.to_string()))?;
        let (base, shared) = bases
            .base_for(&head, cfg, served)
            .map_err(|e| fail(e.to_string()))?;
        let model = candle::load_on_base(&base, &head.config.spec(&dir), cfg)
            .map_err(|e| fail(e.to_string()))?;
        let head_sha256 =
            retrace_model::checkpoint_sha256(&dir).map_err(|e| fail(e.to_string()))?;
        tracing::info!(evaluator = name, head = %dir.display(), %head_sha256, base_shared = shared, "head loaded");
        let limits = Limits {
            max_tokens: model.max_positions(),
            vocab_size: model.vocab_size(),
            reads_spans: model.reads_spans(),
        };
        let mut evaluator =
            Self::assemble(name, max_concurrency, cfg, dir, formatter, model, limits)?;
        evaluator.references = head::ReferenceWatch::new(head.config.label_counts.as_ref());
        evaluator.checksums = Some(HeadChecksums {
            head_sha256,
            base_sha256: head.config.base_sha256.clone(),
        });
        evaluator.head = Some(head);
        evaluator.base = Some(base);
        Ok(evaluator)
    }

    /// A PRM whose rows `scorer` scores instead of the candle model (another backend, or a test's
    /// scorer that fails on purpose); formatting, batching and health are the same as `load`'s.
    pub fn with_scorer(
        name: &str,
        max_concurrency: usize,
        cfg: &PrmConfig,
        scorer: impl Scorer,
        limits: Limits,
    ) -> Result<PrmEvaluator, PrmLoadError> {
        let fail = PrmLoadError;
        let family = cfg.family.family().ok_or_else(|| {
            fail("a trained head reads its base's states; it takes no other scorer".into())
        })?;
        let folder = resolve_model(&cfg.model, Env::process().hf_hub_cache().as_deref())
            .ok_or_else(|| fail(format!("model folder {} does not exist", cfg.model)))?;
        let formatter = Formatter::load(family, &folder).map_err(|e| fail(e.to_string()))?;
        Self::assemble(
            name,
            max_concurrency,
            cfg,
            folder,
            formatter,
            scorer,
            limits,
        )
    }

    fn assemble(
        name: &str,
        max_concurrency: usize,
        cfg: &PrmConfig,
        folder: PathBuf,
        formatter: Formatter,
        scorer: impl Scorer,
        limits: Limits,
    ) -> Result<PrmEvaluator, PrmLoadError> {
        let budget = Budget {
            max_batch_tokens: cfg.max_batch_tokens(),
            max_batch_size: cfg.max_batch_size(),
            max_wait: Duration::from_millis(cfg.max_wait_ms()),
        };
        // The engine's gate admits at most max_concurrency jobs; the batcher's queue holds those
        // and as many left behind by callers whose deadline passed while they waited.
        let batcher = Batcher::spawn(name, scorer, budget, max_concurrency)
            .map_err(|e| PrmLoadError(format!("cannot start the model thread: {e}")))?;
        Ok(PrmEvaluator {
            name: name.to_string(),
            family: cfg.family,
            folder,
            formatter: Arc::new(formatter),
            limits,
            batcher,
            head: None,
            references: head::ReferenceWatch::default(),
            base: None,
            checksums: None,
        })
    }
}

/// Formats and tokenizes `trace` off the runtime (a long trace takes milliseconds), timed as
/// the tokenize stage, and refuses it past `limit` tokens: both backends' first step.
async fn encode(
    name: &str,
    formatter: &Arc<Formatter>,
    trace: Arc<crate::trace::Trace>,
    limit: Option<usize>,
) -> Result<format::Encoded, EngineError> {
    let started = std::time::Instant::now();
    let formatter = formatter.clone();
    let encoded = tokio::task::spawn_blocking(move || formatter.encode(&trace))
        .await
        .map_err(|e| PrmError::Panicked(e.to_string()))?
        .map_err(PrmError::from)?;
    metrics::record_stage(name, metrics::Stage::Tokenize, started.elapsed());
    if let Some(limit) = limit.filter(|&l| encoded.ids.len() > l) {
        return Err(PrmError::TooLong {
            tokens: encoded.ids.len(),
            limit,
        }
        .into());
    }
    Ok(encoded)
}

/// `resolve_model`, or the load error that says where `model` was looked for, ending in `hint`.
fn find_model(model: &str, hint: &str) -> Result<PathBuf, PrmLoadError> {
    resolve_model(model, Env::process().hf_hub_cache().as_deref()).ok_or_else(|| {
        PrmLoadError(format!(
            "model {model} does not exist as a folder or .gguf file and is not a model id in the \
             Hugging Face cache ({hint})"
        ))
    })
}

/// A local folder or `.gguf` file, or else a hub id (`org/name`) already in the standard Hugging Face cache
/// (`hub`: see `Env::hf_hub_cache`): never a download.
pub fn resolve_model(model: &str, hub: Option<&Path>) -> Option<PathBuf> {
    let path = PathBuf::from(model);
    if path.is_dir() || (path.is_file() && retrace_model::is_gguf(&path)) {
        return Some(path);
    }
    let (org, name) = model.split_once('/')?;
    if org.is_empty() || name.is_empty() || name.contains('/') {
        return None;
    }
    let hub = hub?;
    let repo = hub.join(format!("models--{org}--{name}"));
    let revision = std::fs::read_to_string(repo.join("refs/main")).ok()?;
    let snapshot = repo.join("snapshots").join(revision.trim());
    snapshot.is_dir().then_some(snapshot)
}

impl Evaluator for PrmEvaluator {
    fn describe(&self) -> Description {
        Description {
            kind: "prm".into(),
            family: self.family.as_str().into(),
            model: self.folder.display().to_string(),
        }
    }

    fn ready(&self) -> bool {
        self.batcher.alive()
    }

    fn threshold(&self) -> Option<f32> {
        self.head.as_ref().map(|h| h.config.threshold)
    }

    fn head(&self) -> Option<HeadChecksums> {
        self.checksums.clone()
    }

    fn why_not_ready(&self) -> Option<String> {
        (!self.batcher.alive()).then(|| self.batcher.stopped().to_string())
    }

    fn health(&self) -> Option<tokio::sync::watch::Receiver<bool>> {
        Some(self.batcher.health())
    }

    fn evaluate(&self, job: Job) -> BoxFuture<'_, Result<Judgement, EngineError>> {
        Box::pin(async move {
            let reference = job.trace.reference_answer.as_deref();
            self.references
                .check(&self.name, reference.is_some_and(|r| !r.trim().is_empty()));
            let encoded = encode(
                &self.name,
                &self.formatter,
                job.trace.clone(),
                Some(self.limits.max_tokens),
            )
            .await?;
            // Checked per request: in a batch, one bad row would fail its neighbours too.
            if let Some(id) = encoded
                .ids
                .iter()
                .find(|&&id| id as usize >= self.limits.vocab_size)
            {
                return Err(EngineError::invalid(
                    FieldPath::root(),
                    format!(
                        "token id {id} is outside the model's vocabulary of {}: its tokenizer and checkpoint disagree",
                        self.limits.vocab_size
                    ),
                ));
            }
            // A head that reads each step's own tokens refuses the trace whose steps the format
            // could not find, naming the step, before it fails the batch it would join.
            if let (true, Err(e)) = (self.limits.reads_spans, &encoded.spans) {
                return Err(PrmError::Format(e.clone()).into());
            }
            let deadline = job.deadline.map(|d| d.into_std());
            let reply = self
                .batcher
                .submit(encoded, deadline)
                .map_err(PrmError::from)?;
            // Dropping this future drops `reply`, which the model thread sees before running it.
            let scored = reply
                .await
                .map_err(|_| PrmError::Batch(self.batcher.stopped()))?
                .map_err(PrmError::from)?;
            let mut judgement = match (self.family.is_outcome(), scored.scores.as_slice()) {
                (true, [score]) => Judgement::from_outcome(*score, job.threshold),
                (true, other) => return Err(PrmError::OutcomeReads(other.len()).into()),
                (false, _) => Judgement::from_scores(scored.scores, job.threshold),
            };
            if let (Some(head), Some(k)) = (&self.head, judgement.first_error)
                && let Some(probs) = scored.categories.get(k)
            {
                judgement.category = head.category(probs);
            }
            judgement.queued = scored.queued;
            judgement.inference = scored.inference;
            judgement.tokens = Some((scored.tokens.computed, scored.tokens.reused));
            Ok(judgement)
        })
    }
}
