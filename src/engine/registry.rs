//! The registry: evaluators by name, admission control, per-evaluator queues, deadlines.

use super::{Description, EngineError, Evaluator, Job};
use crate::config::{Config, EvaluatorConfig, Kind, ServerConfig};
use crate::metrics;
use crate::trace::{Aggregate, Trace, Verdict};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::{Instant, timeout_at};

/// Builds one evaluator from its table; runs on a blocking thread (it may load a model).
/// `Loaded` holds the evaluators built before it, which a cascade wraps.
pub type EvaluatorLoader = Arc<
    dyn Fn(&EvaluatorConfig, &ServerConfig, &Loaded) -> Result<Arc<dyn Evaluator>, EngineError>
        + Send
        + Sync,
>;

/// Evaluators loaded so far, by name.
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
    slots: HashMap<String, Slot>,
    order: Vec<String>,
    default: String,
    admission: Arc<Semaphore>,
    max_in_flight: usize,
    loaded: watch::Sender<bool>,
}

struct Slot {
    name: String,
    config: EvaluatorConfig,
    max_steps: usize,
    max_trace_bytes: usize,
    /// Requests handed to the evaluator at once; waiters are the evaluator's queue.
    gate: Arc<Semaphore>,
    evaluator: OnceLock<Arc<dyn Evaluator>>,
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
    pub fn new(config: &Config) -> Arc<Engine> {
        let server = &config.server;
        let slots = config
            .evaluators
            .iter()
            .map(|e| {
                let slot = Slot {
                    name: e.name.clone(),
                    config: e.clone(),
                    max_steps: e.max_steps.unwrap_or(server.max_steps),
                    max_trace_bytes: e.max_trace_bytes.unwrap_or(server.max_trace_bytes),
                    gate: Arc::new(Semaphore::new(e.max_concurrency)),
                    evaluator: OnceLock::new(),
                };
                metrics::set_ready(&e.name, false);
                (e.name.clone(), slot)
            })
            .collect();
        Arc::new(Engine {
            slots,
            order: config.evaluators.iter().map(|e| e.name.clone()).collect(),
            default: config.default_evaluator().to_string(),
            admission: Arc::new(Semaphore::new(server.max_in_flight)),
            max_in_flight: server.max_in_flight,
            loaded: watch::channel(false).0,
        })
    }

    /// Loads every evaluator on blocking threads, in config order except that cascades come
    /// last (they wrap others); fails on the first error.
    pub async fn load(
        &self,
        loader: EvaluatorLoader,
        server: &ServerConfig,
    ) -> Result<(), EngineError> {
        let mut order: Vec<&String> = self.order.iter().collect();
        order.sort_by_key(|name| self.slots[*name].config.kind == Kind::Cascade);
        let mut loaded = Loaded::new();
        for name in order {
            let slot = &self.slots[name];
            let (loader, cfg, server) = (loader.clone(), slot.config.clone(), server.clone());
            let before = loaded.clone();
            let started = std::time::Instant::now();
            let evaluator = tokio::task::spawn_blocking(move || loader(&cfg, &server, &before))
                .await
                .map_err(|e| {
                    EngineError::Internal(format!("loading evaluator {name:?} panicked: {e}"))
                })??;
            metrics::record_model_load(name, started.elapsed());
            tracing::info!(evaluator = %name, seconds = started.elapsed().as_secs_f64(), "evaluator loaded");
            metrics::set_ready(name, true);
            loaded.insert(name.clone(), evaluator.clone());
            let _ = slot.evaluator.set(evaluator);
        }
        self.loaded.send_replace(true);
        Ok(())
    }

    /// Becomes true once every evaluator is loaded.
    pub fn loaded(&self) -> watch::Receiver<bool> {
        self.loaded.subscribe()
    }

    pub fn list(&self) -> Vec<EvaluatorStatus> {
        self.order
            .iter()
            .map(|name| {
                let slot = &self.slots[name];
                let description = match slot.evaluator.get() {
                    Some(e) => e.describe(),
                    None => Description {
                        kind: slot.config.kind.as_str().to_string(),
                        family: slot.config.family.clone().unwrap_or_default(),
                        model: slot.config.model.clone().unwrap_or_default(),
                    },
                };
                EvaluatorStatus {
                    name: name.clone(),
                    description,
                    threshold: slot.config.threshold,
                    aggregate: slot.config.aggregate,
                    max_steps: slot.max_steps,
                    max_trace_bytes: slot.max_trace_bytes,
                    ready: slot.evaluator.get().is_some_and(|e| e.ready()),
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
                    "unknown evaluator {name:?}; this server hosts {}",
                    self.order.join(", ")
                ),
            )),
        }
    }

    /// Admits and judges one request.
    pub async fn evaluate(&self, request: Request) -> Result<Verdict, EngineError> {
        let slot = self.slot(&request.evaluator)?;
        slot.check_limits(&request.trace, "trace")?;
        let _permit = self.admit(1)?;
        slot.run(request).await
    }

    /// Admits and judges every candidate together (all or none are admitted); results keep order.
    pub async fn evaluate_all(&self, requests: Vec<Request>) -> Result<Vec<Verdict>, EngineError> {
        let Some(first) = requests.first() else {
            return Ok(Vec::new());
        };
        let slot = self.slot(&first.evaluator)?;
        for (i, r) in requests.iter().enumerate() {
            slot.check_limits(&r.trace, &format!("candidates[{i}]"))?;
        }
        let _permit = self.admit(requests.len())?;
        let runs = requests.into_iter().enumerate().map(|(i, r)| async move {
            // An evaluator names fields under `trace`; in a ranking the trace is a candidate.
            slot.run(r).await.map_err(|e| match e {
                EngineError::Invalid { field, message } if field.starts_with("trace") => {
                    EngineError::Invalid {
                        field: format!("candidates[{i}]{}", &field["trace".len()..]),
                        message,
                    }
                }
                other => other,
            })
        });
        futures::future::try_join_all(runs).await
    }

    fn slot(&self, requested: &str) -> Result<&Slot, EngineError> {
        let name = self.resolve_name(requested)?;
        Ok(&self.slots[name])
    }

    /// Takes `n` in-flight permits at once or refuses: never waits, never queues unboundedly.
    fn admit(
        &self,
        n: usize,
    ) -> Result<(OwnedSemaphorePermit, GaugeGuard<impl Fn(f64)>), EngineError> {
        let n32 = u32::try_from(n).unwrap_or(u32::MAX);
        if n > self.max_in_flight {
            return Err(EngineError::invalid(
                "candidates",
                format!(
                    "{n} candidates exceed the server's max_in_flight = {}",
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
    fn check_limits(&self, trace: &Trace, field: &str) -> Result<(), EngineError> {
        if trace.steps.len() > self.max_steps {
            return Err(EngineError::invalid(
                format!("{field}.steps"),
                format!(
                    "{} steps exceed this evaluator's limit of {}",
                    trace.steps.len(),
                    self.max_steps
                ),
            ));
        }
        let bytes = trace.byte_len();
        if bytes > self.max_trace_bytes {
            return Err(EngineError::invalid(
                field,
                format!(
                    "{bytes} bytes exceed this evaluator's limit of {} (max_trace_bytes)",
                    self.max_trace_bytes
                ),
            ));
        }
        Ok(())
    }

    async fn run(&self, request: Request) -> Result<Verdict, EngineError> {
        let evaluator = self.evaluator.get().ok_or_else(|| {
            EngineError::Unavailable(format!("evaluator {:?} is still loading", self.name))
        })?;
        if !evaluator.ready() {
            return Err(EngineError::Unavailable(format!(
                "evaluator {:?} is not ready",
                self.name
            )));
        }
        let threshold = request.threshold.unwrap_or(self.config.threshold);
        let name = self.name.clone();
        let queue_started = Instant::now();
        let _permit = {
            let _queued = GaugeGuard::new(|d| metrics::queue_depth(&name, d));
            let acquire = self.gate.clone().acquire_owned();
            let permit = match request.deadline {
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
        let queue = queue_started.elapsed();
        let job = Job {
            trace: request.trace.clone(),
            threshold,
            deadline: request.deadline,
        };
        let judgement = match request.deadline {
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
        let steps = request.trace.steps.len();
        if judgement.step_scores.len() != steps {
            return Err(EngineError::Internal(format!(
                "evaluator {:?} returned {} scores for {steps} steps",
                self.name,
                judgement.step_scores.len()
            )));
        }
        metrics::record_steps(&self.name, steps);
        metrics::record_stage(&self.name, metrics::Stage::Queue, queue + judgement.queued);
        Ok(Verdict {
            evaluator: self.name.clone(),
            trace_score: self.config.aggregate.apply(&judgement.step_scores),
            threshold,
            queue: queue + judgement.queued,
            total: request.arrived.elapsed(),
            judgement,
        })
    }
}
