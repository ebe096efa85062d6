//! One evaluator's slot: its limits, its gate (`max_concurrency`), its pace, and the path of
//! every call through them, a cascade's calls to the evaluators it wraps included.

use super::current::Current;
use super::pace::{self, Pace, Sharing, Ticket, TooSlow};
use super::{
    DEFAULT_THRESHOLD, Description, EngineError, Evaluator, HeadChecksums, Job, Limit, Request,
};
use crate::field::FieldPath;
use crate::metrics;
use crate::trace::{Aggregate, Judgement, Trace, Verdict};
use futures::future::BoxFuture;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::{Instant, timeout_at};

/// What the engine knows of an evaluator before it is loaded: its name, its request-side
/// settings, and what to say of it while it loads.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct SlotSpec {
    pub name: String,
    /// The config's threshold; unset, the evaluator's own (a trained head's), else the default.
    pub threshold: Option<f32>,
    pub aggregate: Aggregate,
    pub max_steps: usize,
    pub max_trace_bytes: usize,
    /// Requests handed to the evaluator at once; the rest wait in its queue.
    pub max_concurrency: usize,
    /// How those requests share the evaluator's time, for its pace.
    pub sharing: Sharing,
    /// Evaluators load in tiers, lowest first, so one loads after those it wraps: 0 wraps none,
    /// 1 a cascade, 2 a composite (which may wrap a cascade).
    pub tier: u8,
    /// What ListEvaluators says while it loads.
    pub loading: Description,
}

/// One evaluator, loaded or not, with what every call to it passes through.
pub(super) struct Slot {
    pub(super) name: String,
    pub(super) spec: SlotSpec,
    /// Requests handed to the evaluator at once; waiters are the evaluator's queue.
    gate: Arc<Semaphore>,
    pub(super) evaluator: Current,
    /// Its pending work and measured pace, for refusing what would miss its deadline.
    pace: Pace,
}

/// Decrements a gauge when dropped, so every exit path (error, cancel) restores it.
pub(super) struct GaugeGuard<F: Fn(f64)>(F);

impl<F: Fn(f64)> GaugeGuard<F> {
    pub(super) fn new(f: F) -> Self {
        f(1.0);
        GaugeGuard(f)
    }
}

impl<F: Fn(f64)> Drop for GaugeGuard<F> {
    fn drop(&mut self) {
        (self.0)(-1.0);
    }
}

impl Slot {
    /// The slot of an evaluator not loaded yet.
    pub(super) fn new(spec: SlotSpec) -> Slot {
        Slot {
            name: spec.name.clone(),
            gate: Arc::new(Semaphore::new(spec.max_concurrency)),
            evaluator: Current::default(),
            pace: Pace::new(spec.max_concurrency, spec.sharing),
            spec,
        }
    }

    /// The loaded evaluator's description, or what its table says while it loads.
    /// Serves `evaluator` from now on, with the head-info gauge following it; the one it
    /// replaces, if any.
    pub(super) fn serve(&self, evaluator: Arc<dyn Evaluator>) -> Option<Arc<dyn Evaluator>> {
        let now = evaluator.head();
        let before = self.evaluator.set(evaluator);
        let was = before.as_ref().and_then(|b| b.head());
        let pair = |h: &HeadChecksums| [h.head_sha256.clone(), h.base_sha256.clone()];
        metrics::set_head(&self.name, was.as_ref().map(pair), now.as_ref().map(pair));
        before
    }

    pub(super) fn describe(&self) -> Description {
        match self.evaluator.get() {
            Some(e) => e.describe(),
            None => self.spec.loading.clone(),
        }
    }

    pub(super) fn ready(&self) -> bool {
        self.evaluator.get().is_some_and(|e| e.ready())
    }

    /// The threshold in force: the config's, else the loaded evaluator's own, else the default.
    pub(super) fn threshold(&self) -> f32 {
        let own = self.evaluator.get().and_then(|e| e.threshold());
        self.spec.threshold.or(own).unwrap_or(DEFAULT_THRESHOLD)
    }

    /// The evaluator's limits on a trace; fields are named relative to it.
    pub(super) fn check_limits(&self, trace: &Trace) -> Result<(), EngineError> {
        if trace.steps.len() > self.spec.max_steps {
            return Err(EngineError::too_large(
                FieldPath::root().then("steps"),
                Limit::Steps,
                format!(
                    "{} steps exceed this evaluator's limit of {}",
                    trace.steps.len(),
                    self.spec.max_steps
                ),
            ));
        }
        let bytes = trace.byte_len();
        if bytes > self.spec.max_trace_bytes {
            return Err(EngineError::too_large(
                FieldPath::root(),
                Limit::Bytes,
                format!(
                    "{bytes} bytes exceed this evaluator's limit of {} (max_trace_bytes)",
                    self.spec.max_trace_bytes
                ),
            ));
        }
        Ok(())
    }

    /// Admits traces of `sizes` bytes, all or none, unless they would not finish before
    /// `deadline` behind what is pending at the evaluator's measured pace: refused at once, not
    /// admitted to fail. Each ticket counts its trace as pending until it is answered.
    pub(super) fn paced(
        &self,
        sizes: &[usize],
        deadline: Option<Instant>,
    ) -> Result<Vec<Ticket<'_>>, EngineError> {
        let sizes: Vec<u64> = sizes.iter().map(|&b| pace::work(b)).collect();
        self.pace
            .admit(&sizes, deadline, Instant::now())
            .map_err(|t| self.too_slow(t, sizes.iter().sum()))
    }

    /// The refusal of `bytes` of work that would miss its deadline, counted as a drop.
    fn too_slow(&self, t: TooSlow, bytes: u64) -> EngineError {
        metrics::record_dropped(&self.name, "would_miss_deadline");
        EngineError::Overloaded {
            message: format!(
                "evaluator {:?} would not finish this before its deadline: {:.2} s of work at \
                 its measured pace ({} bytes of work ahead of this request's {bytes} and {} \
                 likely beside it, at {:.0} bytes/s), {:.2} s left",
                self.name,
                t.estimate.as_secs_f64(),
                t.ahead,
                t.beside,
                t.rate,
                t.left.as_secs_f64()
            ),
            retry_after: Some(t.retry_after),
        }
    }

    /// How long the work pending at this evaluator takes to drain; None before its pace is
    /// measured.
    pub(super) fn drain(&self) -> Option<Duration> {
        self.pace.drain(Instant::now())
    }

    /// Through the gate, then the evaluator, within the job's deadline: the path of every
    /// caller, a cascade's included; `ticket` counts the job as pending work until it ends.
    /// Returns the judgement and the time spent at the gate.
    async fn judge(
        &self,
        job: Job,
        mut ticket: Ticket<'_>,
    ) -> Result<(Judgement, Duration), EngineError> {
        let evaluator = self.evaluator.get().ok_or_else(|| {
            EngineError::Unavailable(format!("evaluator {:?} is still loading", self.name))
        })?;
        if !evaluator.ready() {
            let why = evaluator
                .why_not_ready()
                .map_or_else(String::new, |why| format!(": {why}"));
            return Err(EngineError::Unavailable(format!(
                "evaluator {:?} is not ready{why}",
                self.name
            )));
        }
        let queue_started = Instant::now();
        let _permit = {
            let _queued = GaugeGuard::new(|d| metrics::queue_depth(&self.name, d));
            let acquire = self.gate.clone().acquire_owned();
            let permit = match job.deadline {
                Some(deadline) => timeout_at(deadline, acquire).await.map_err(|_| {
                    metrics::record_dropped(&self.name, "deadline");
                    EngineError::DeadlineExceeded(format!(
                        "still queued for evaluator {:?}",
                        self.name
                    ))
                })?,
                None => acquire.await,
            };
            permit.map_err(|_| EngineError::Unavailable("the evaluator is shutting down".into()))?
        };
        ticket.serving();
        let queue = queue_started.elapsed();
        let steps = job.trace.steps.len();
        let judgement = match job.deadline {
            Some(deadline) => timeout_at(deadline, evaluator.evaluate(job))
                .await
                .map_err(|_| {
                    EngineError::DeadlineExceeded(format!(
                        "evaluator {:?} did not answer in time",
                        self.name
                    ))
                })?,
            None => evaluator.evaluate(job).await,
        };
        let judgement = match judgement {
            Ok(j) => j,
            Err(e @ (EngineError::Invalid { .. } | EngineError::TooLarge { .. })) => {
                ticket.bad_input();
                return Err(e);
            }
            Err(e) => return Err(self.when_to_return(e)),
        };
        if let Some(rate) = ticket.done() {
            metrics::set_pace(&self.name, rate);
        }
        // An outcome model alone scores the trace, not its steps: none is a whole answer.
        let outcome_only = judgement.step_scores.is_empty() && judgement.outcome.is_some();
        if judgement.step_scores.len() != steps && !outcome_only {
            return Err(EngineError::Internal(format!(
                "evaluator {:?} returned {} scores for {steps} steps",
                self.name,
                judgement.step_scores.len()
            )));
        }
        Ok((judgement, queue))
    }

    /// An evaluator's overload (a full model queue) told when to come back, by this slot's
    /// pace, where the evaluator could not say.
    fn when_to_return(&self, e: EngineError) -> EngineError {
        match e {
            EngineError::Overloaded {
                message,
                retry_after: None,
            } => EngineError::Overloaded {
                message,
                retry_after: self.drain(),
            },
            e => e,
        }
    }

    pub(super) async fn run(
        &self,
        request: Request,
        ticket: Ticket<'_>,
    ) -> Result<Verdict, EngineError> {
        let threshold = request.threshold.unwrap_or_else(|| self.threshold());
        let job = Job {
            trace: request.trace.clone(),
            threshold,
            deadline: request.deadline,
        };
        let (judgement, queue) = self.judge(job, ticket).await?;
        metrics::record_steps(&self.name, request.trace.steps.len());
        metrics::record_stage(&self.name, metrics::Stage::Queue, queue + judgement.queued);
        Ok(Verdict {
            evaluator: self.name.clone(),
            trace_score: trace_score(self.spec.aggregate, &judgement),
            threshold,
            queue: queue + judgement.queued,
            total: request.arrived.elapsed(),
            judgement,
        })
    }
}

/// A verdict's trace score: the aggregate of its step scores, or an outcome model's raw score
/// when it has no step scores.
fn trace_score(aggregate: Aggregate, j: &Judgement) -> f32 {
    match j.outcome {
        Some(o) if j.step_scores.is_empty() => o.score,
        _ => aggregate.apply(&j.step_scores),
    }
}

/// An evaluator as other evaluators reach it: through its slot's gate and deadline.
pub(super) struct Gated(pub(super) Arc<Slot>);

impl Evaluator for Gated {
    fn describe(&self) -> Description {
        self.0.describe()
    }

    fn ready(&self) -> bool {
        self.0.ready()
    }

    fn why_not_ready(&self) -> Option<String> {
        self.0.evaluator.get()?.why_not_ready()
    }

    fn head(&self) -> Option<HeadChecksums> {
        self.0.evaluator.get().and_then(|e| e.head())
    }

    fn generation(&self) -> u64 {
        self.0.evaluator.generation()
    }

    /// The evaluator's own, not its config's: a cascade's threshold key is the cascade's.
    fn threshold(&self) -> Option<f32> {
        self.0.evaluator.get()?.threshold()
    }

    fn evaluate(&self, job: Job) -> BoxFuture<'_, Result<Judgement, EngineError>> {
        Box::pin(async move {
            let work = pace::work(job.trace.byte_len());
            let ticket = self.0.pace.start(work, Instant::now());
            let (mut judgement, queue) = self.0.judge(job, ticket).await?;
            judgement.queued += queue;
            Ok(judgement)
        })
    }
}
