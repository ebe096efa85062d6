//! The registry: evaluators by name, admission control, per-evaluator queues, deadlines.

use super::origin::Origin;
use super::pace::{Pace, Ticket, TooSlow};
use super::{DEFAULT_THRESHOLD, Description, EngineError, Evaluator, Job, Limit};
use crate::field::FieldPath;
use crate::metrics;
use crate::trace::{Aggregate, Judgement, Trace, Verdict};
use futures::future::BoxFuture;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::{Instant, timeout_at};

/// Builds the evaluator of one name; runs on a blocking thread (it may load a model).
/// `Loaded` holds the evaluators built before it, which a cascade wraps.
pub type LoadByName =
    Arc<dyn Fn(&str, &Loaded) -> Result<Arc<dyn Evaluator>, EngineError> + Send + Sync>;

/// What the engine knows of an evaluator before it is loaded: its name, its request-side
/// settings, and what to say of it while it loads.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotSpec {
    pub name: String,
    /// The config's threshold; unset, the evaluator's own (a trained head's), else the default.
    pub threshold: Option<f32>,
    pub aggregate: Aggregate,
    pub max_steps: usize,
    pub max_trace_bytes: usize,
    /// Requests handed to the evaluator at once; the rest wait in its queue.
    pub max_concurrency: usize,
    /// Evaluators load in tiers, lowest first, so one loads after those it wraps: 0 wraps none,
    /// 1 a cascade, 2 a composite (which may wrap a cascade).
    pub tier: u8,
    /// What ListEvaluators says while it loads.
    pub loading: Description,
}

/// The limits shared by every evaluator.
#[derive(Debug, Clone, PartialEq)]
pub struct Admission {
    /// Requests admitted at once, across evaluators; more are refused.
    pub max_in_flight: usize,
    /// The evaluator a request gets when it names none.
    pub default: String,
}

/// Evaluators loaded so far, by name. Each is reached through its own gate, so a cascade's calls
/// queue behind the evaluator's `max_concurrency` like everyone else's.
pub type Loaded = HashMap<String, Arc<dyn Evaluator>>;

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

/// What ListEvaluators reports for one evaluator.
#[derive(Debug, Clone, PartialEq)]
pub struct EvaluatorStatus {
    pub name: String,
    pub description: Description,
    pub threshold: f32,
    pub aggregate: Aggregate,
    pub max_steps: usize,
    pub max_trace_bytes: usize,
    pub ready: bool,
    pub is_default: bool,
}

/// Evaluators by name, with the admission semaphore shared by all of them.
pub struct Engine {
    slots: HashMap<String, Arc<Slot>>,
    order: Vec<String>,
    default: String,
    admission: Arc<Semaphore>,
    max_in_flight: usize,
}

struct Slot {
    name: String,
    spec: SlotSpec,
    max_steps: usize,
    max_trace_bytes: usize,
    /// Requests handed to the evaluator at once; waiters are the evaluator's queue.
    gate: Arc<Semaphore>,
    evaluator: OnceLock<Arc<dyn Evaluator>>,
    /// Its pending work and measured pace, for refusing what would miss its deadline.
    pace: Pace,
}

/// Decrements a gauge when dropped, so every exit path (error, cancel) restores it.
struct GaugeGuard<F: Fn(f64)>(F);

impl<F: Fn(f64)> GaugeGuard<F> {
    fn new(f: F) -> Self {
        f(1.0);
        GaugeGuard(f)
    }
}

impl<F: Fn(f64)> Drop for GaugeGuard<F> {
    fn drop(&mut self) {
        (self.0)(-1.0);
    }
}

impl Engine {
    /// An engine whose evaluators are not loaded yet: requests get UNAVAILABLE until `load`.
    pub fn new(specs: Vec<SlotSpec>, admission: Admission) -> Arc<Engine> {
        let order = specs.iter().map(|s| s.name.clone()).collect();
        metrics::set_max_in_flight(admission.max_in_flight);
        let slots = specs
            .into_iter()
            .map(|spec| {
                metrics::set_ready(&spec.name, false);
                let slot = Arc::new(Slot {
                    name: spec.name.clone(),
                    max_steps: spec.max_steps,
                    max_trace_bytes: spec.max_trace_bytes,
                    gate: Arc::new(Semaphore::new(spec.max_concurrency)),
                    evaluator: OnceLock::new(),
                    pace: Pace::default(),
                    spec,
                });
                (slot.name.clone(), slot)
            })
            .collect();
        Arc::new(Engine {
            slots,
            order,
            default: admission.default,
            admission: Arc::new(Semaphore::new(admission.max_in_flight)),
            max_in_flight: admission.max_in_flight,
        })
    }

    /// Loads every evaluator on blocking threads, in config order within each tier (cascades and
    /// composites after what they wrap); fails on the first error.
    pub async fn load(&self, loader: LoadByName) -> Result<(), EngineError> {
        let mut order: Vec<&String> = self.order.iter().collect();
        order.sort_by_key(|name| self.slots[*name].spec.tier);
        let mut loaded = Loaded::new();
        for name in order {
            let slot = &self.slots[name];
            let (loader, owned) = (loader.clone(), name.clone());
            let before = loaded.clone();
            let started = std::time::Instant::now();
            let evaluator = tokio::task::spawn_blocking(move || loader(&owned, &before))
                .await
                .map_err(|e| {
                    EngineError::Internal(format!("loading evaluator {name:?} panicked: {e}"))
                })??;
            metrics::record_model_load(name, started.elapsed());
            tracing::info!(evaluator = %name, seconds = started.elapsed().as_secs_f64(), "evaluator loaded");
            metrics::set_ready(name, true);
            let _ = slot.evaluator.set(evaluator);
            loaded.insert(name.clone(), Arc::new(Gated(slot.clone())));
        }
        Ok(())
    }

    /// Watches on every loaded evaluator whose readiness can change; see `any_changed`.
    pub fn health_watches(&self) -> Vec<watch::Receiver<bool>> {
        self.slots
            .values()
            .filter_map(|s| s.evaluator.get()?.health())
            .collect()
    }

    pub fn list(&self) -> Vec<EvaluatorStatus> {
        self.order
            .iter()
            .map(|name| {
                let slot = &self.slots[name];
                let description = slot.describe();
                EvaluatorStatus {
                    name: name.clone(),
                    description,
                    threshold: slot.threshold(),
                    aggregate: slot.spec.aggregate,
                    max_steps: slot.max_steps,
                    max_trace_bytes: slot.max_trace_bytes,
                    ready: slot.ready(),
                    is_default: *name == self.default,
                }
            })
            .collect()
    }

    /// The evaluator a request names (the default when empty); errors name the `evaluator` field.
    pub fn resolve_name<'a>(&'a self, requested: &'a str) -> Result<&'a str, EngineError> {
        let name = if requested.is_empty() {
            self.default.as_str()
        } else {
            requested
        };
        match self.slots.get(name) {
            Some(slot) => Ok(&slot.name),
            None => Err(EngineError::invalid(
                "evaluator",
                format!(
                    "unknown evaluator {}; this server hosts {}",
                    echo(name),
                    self.order.join(", ")
                ),
            )),
        }
    }

    /// Admits and judges one request.
    pub async fn evaluate(&self, request: Request) -> Result<Verdict, EngineError> {
        let slot = self.slot(&request.evaluator)?;
        let origin = request.origin.clone();
        slot.check_limits(&request.trace)
            .map_err(|e| origin.locate(e))?;
        let _permit = self.admit(1, &origin.at)?;
        let ticket = slot.paced_one(request.trace.byte_len(), request.deadline)?;
        slot.run(request, ticket)
            .await
            .map_err(|e| origin.locate(e))
    }

    /// Admits and judges every request together (all or none are admitted); results keep order.
    /// `list` names the list in errors: `candidates` (a Rank), `query` (a reward batch); each
    /// request's origin names its item.
    pub async fn evaluate_all(
        &self,
        requests: Vec<Request>,
        list: &FieldPath,
    ) -> Result<Vec<Verdict>, EngineError> {
        self.evaluate_each(requests, list, |r| r).await
    }

    /// `evaluate_all`, where `settle` makes each request's outcome its item, or the error that
    /// fails them all (and drops the rest): a reward batch keeps the verdicts it got in time.
    pub async fn evaluate_each<T>(
        &self,
        requests: Vec<Request>,
        list: &FieldPath,
        settle: impl Fn(Result<Verdict, EngineError>) -> Result<T, EngineError>,
    ) -> Result<Vec<T>, EngineError> {
        let Some(first) = requests.first() else {
            return Ok(Vec::new());
        };
        let slot = self.slot(&first.evaluator)?;
        // A trace over a limit is settled before admission: a caller that fails on it fails
        // before any work is done, and one that settles it (a reward route scoring the sample
        // apart) has it judged without taking a permit.
        let mut settled = Vec::with_capacity(requests.len());
        let mut admitted = Vec::with_capacity(requests.len());
        for r in requests {
            match slot.check_limits(&r.trace) {
                Ok(()) => {
                    settled.push(None);
                    admitted.push(r);
                }
                Err(e) => settled.push(Some(settle(Err(r.origin.locate(e)))?)),
            }
        }
        let _permit = match admitted.is_empty() {
            true => None,
            false => Some(self.admit(admitted.len(), list)?),
        };
        let sizes: Vec<usize> = admitted.iter().map(|r| r.trace.byte_len()).collect();
        let tickets = slot.paced(&sizes, admitted.iter().filter_map(|r| r.deadline).min())?;
        let settle = &settle;
        let runs = admitted
            .into_iter()
            .zip(tickets)
            .map(|(r, ticket)| async move {
                let origin = r.origin.clone();
                settle(slot.run(r, ticket).await.map_err(|e| origin.locate(e)))
            });
        let mut ran = futures::future::try_join_all(runs).await?.into_iter();
        settled
            .into_iter()
            .map(|s| s.or_else(|| ran.next()))
            .collect::<Option<Vec<T>>>()
            .ok_or_else(|| EngineError::Internal("a request of the batch went unanswered".into()))
    }

    fn slot(&self, requested: &str) -> Result<&Slot, EngineError> {
        let name = self.resolve_name(requested)?;
        Ok(&self.slots[name])
    }

    /// Takes `n` in-flight permits at once or refuses: never waits, never queues unboundedly.
    fn admit(
        &self,
        n: usize,
        field: &FieldPath,
    ) -> Result<(OwnedSemaphorePermit, GaugeGuard<impl Fn(f64)>), EngineError> {
        let n32 = u32::try_from(n).unwrap_or(u32::MAX);
        if n > self.max_in_flight {
            return Err(EngineError::invalid(
                field.clone(),
                format!(
                    "{n} items exceed the server's max_in_flight = {}",
                    self.max_in_flight
                ),
            ));
        }
        let permit = self
            .admission
            .clone()
            .try_acquire_many_owned(n32)
            .map_err(|_| {
                EngineError::Overloaded(format!(
                    "{} requests already in flight",
                    self.max_in_flight
                ))
            })?;
        let count = n as f64;
        Ok((
            permit,
            GaugeGuard::new(move |d| metrics::in_flight(d * count)),
        ))
    }
}

impl Slot {
    /// The loaded evaluator's description, or what its table says while it loads.
    fn describe(&self) -> Description {
        match self.evaluator.get() {
            Some(e) => e.describe(),
            None => self.spec.loading.clone(),
        }
    }

    fn ready(&self) -> bool {
        self.evaluator.get().is_some_and(|e| e.ready())
    }

    /// The threshold in force: the config's, else the loaded evaluator's own, else the default.
    fn threshold(&self) -> f32 {
        let own = self.evaluator.get().and_then(|e| e.threshold());
        self.spec.threshold.or(own).unwrap_or(DEFAULT_THRESHOLD)
    }

    /// The evaluator's limits on a trace; fields are named relative to it.
    fn check_limits(&self, trace: &Trace) -> Result<(), EngineError> {
        if trace.steps.len() > self.max_steps {
            return Err(EngineError::too_large(
                FieldPath::root().then("steps"),
                Limit::Steps,
                format!(
                    "{} steps exceed this evaluator's limit of {}",
                    trace.steps.len(),
                    self.max_steps
                ),
            ));
        }
        let bytes = trace.byte_len();
        if bytes > self.max_trace_bytes {
            return Err(EngineError::too_large(
                FieldPath::root(),
                Limit::Bytes,
                format!(
                    "{bytes} bytes exceed this evaluator's limit of {} (max_trace_bytes)",
                    self.max_trace_bytes
                ),
            ));
        }
        Ok(())
    }

    /// Admits traces of `sizes` bytes, all or none, unless they would not finish before
    /// `deadline` behind what is pending at the evaluator's measured pace: refused at once, not
    /// admitted to fail. Each ticket counts its trace as pending until it is answered.
    fn paced(
        &self,
        sizes: &[usize],
        deadline: Option<Instant>,
    ) -> Result<Vec<Ticket<'_>>, EngineError> {
        let sizes: Vec<u64> = sizes.iter().map(|&b| b as u64).collect();
        self.pace
            .admit(&sizes, deadline, Instant::now())
            .map_err(|t| self.too_slow(t, sizes.iter().sum()))
    }

    /// `paced` for one trace.
    fn paced_one(
        &self,
        bytes: usize,
        deadline: Option<Instant>,
    ) -> Result<Ticket<'_>, EngineError> {
        self.pace
            .admit_one(bytes as u64, deadline, Instant::now())
            .map_err(|t| self.too_slow(t, bytes as u64))
    }

    /// The refusal of `bytes` of work that would miss its deadline, counted as a drop.
    fn too_slow(&self, t: TooSlow, bytes: u64) -> EngineError {
        metrics::record_dropped(&self.name, "would_miss_deadline");
        EngineError::Overloaded(format!(
            "evaluator {:?} would not finish this before its deadline: {:.2} s of work at its \
             measured pace ({} bytes ahead of this request's {bytes}, {:.0} bytes/s), {:.2} s left",
            self.name,
            t.estimate.as_secs_f64(),
            t.ahead,
            t.rate,
            t.left.as_secs_f64()
        ))
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
                })??,
            None => evaluator.evaluate(job).await?,
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

    async fn run(&self, request: Request, ticket: Ticket<'_>) -> Result<Verdict, EngineError> {
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
struct Gated(Arc<Slot>);

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

    /// The evaluator's own, not its config's: a cascade's threshold key is the cascade's.
    fn threshold(&self) -> Option<f32> {
        self.0.evaluator.get()?.threshold()
    }

    fn evaluate(&self, job: Job) -> BoxFuture<'_, Result<Judgement, EngineError>> {
        Box::pin(async move {
            let ticket = self
                .0
                .pace
                .start(job.trace.byte_len() as u64, Instant::now());
            let (mut judgement, queue) = self.0.judge(job, ticket).await?;
            judgement.queued += queue;
            Ok(judgement)
        })
    }
}

/// A caller's name, quoted and cut short: a message echoes no more of the input than it needs.
fn echo(name: &str) -> String {
    const MAX_CHARS: usize = 64;
    match name.char_indices().nth(MAX_CHARS) {
        Some((end, _)) => format!("{:?}… ({} bytes)", &name[..end], name.len()),
        None => format!("{name:?}"),
    }
}

/// Resolves when one of `watches` changes, or its sender goes (that watch is dropped: its last
/// value stands); never resolves once none is left.
pub async fn any_changed(watches: &mut Vec<watch::Receiver<bool>>) {
    if watches.is_empty() {
        return std::future::pending().await;
    }
    let changes = watches.iter_mut().map(|w| Box::pin(w.changed()));
    let (result, i, _) = futures::future::select_all(changes).await;
    if result.is_err() {
        watches.swap_remove(i);
    }
}
