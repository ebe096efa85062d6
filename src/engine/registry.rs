//! The registry: evaluators by name, admission control, per-evaluator queues, deadlines.

use super::slot::{Gated, GaugeGuard, Slot, SlotSpec};
use super::{
    Description, EngineError, Evaluator, EvaluatorLoadError, LoadFailure, NotLoaded, Request,
};
use crate::field::FieldPath;
use crate::metrics;
use crate::trace::{Aggregate, Verdict};
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

/// Builds the evaluator of one name; runs on a blocking thread (it may load a model).
/// `Loaded` holds the evaluators built before it, which a cascade wraps.
pub(crate) type LoadByName =
    Arc<dyn Fn(&str, &Loaded) -> Result<Arc<dyn Evaluator>, LoadFailure> + Send + Sync>;

/// What the loader needs again for a reload (`reload.rs`): set once every evaluator has loaded.
pub(super) struct Reloader {
    pub(super) loader: LoadByName,
    /// Every evaluator, each through its gate: what a reloaded evaluator may wrap.
    pub(super) loaded: Loaded,
}

/// The limits shared by every evaluator.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Admission {
    /// Requests admitted at once, across evaluators; more are refused.
    pub max_in_flight: usize,
    /// The evaluator a request gets when it names none.
    pub default: String,
}

/// Evaluators loaded so far, by name. Each is reached through its own gate, so a cascade's calls
/// queue behind the evaluator's `max_concurrency` like everyone else's.
pub(crate) type Loaded = HashMap<String, Arc<dyn Evaluator>>;

/// The loaded evaluator `wanted`, which a wrapper names under `key`.
pub(crate) fn wrapped(
    loaded: &Loaded,
    key: &'static str,
    wanted: &str,
) -> Result<Arc<dyn Evaluator>, NotLoaded> {
    loaded.get(wanted).cloned().ok_or_else(|| NotLoaded {
        key,
        wanted: wanted.to_string(),
    })
}

/// What ListEvaluators reports for one evaluator.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct EvaluatorStatus {
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
    pub(super) reloader: tokio::sync::Mutex<Option<Reloader>>,
    /// Flips at each swap, so whoever follows health watches the new evaluator's.
    swaps: watch::Sender<bool>,
}

impl Engine {
    /// An engine whose evaluators are not loaded yet: requests get UNAVAILABLE until `load`.
    pub(crate) fn new(specs: Vec<SlotSpec>, admission: Admission) -> Arc<Engine> {
        let order = specs.iter().map(|s| s.name.clone()).collect();
        metrics::set_max_in_flight(admission.max_in_flight);
        let slots = specs
            .into_iter()
            .map(|spec| {
                metrics::set_ready(&spec.name, false);
                let slot = Arc::new(Slot::new(spec));
                (slot.name.clone(), slot)
            })
            .collect();
        Arc::new(Engine {
            slots,
            order,
            default: admission.default,
            admission: Arc::new(Semaphore::new(admission.max_in_flight)),
            max_in_flight: admission.max_in_flight,
            reloader: tokio::sync::Mutex::new(None),
            swaps: watch::Sender::new(false),
        })
    }

    /// Loads every evaluator on blocking threads, in config order within each tier (cascades and
    /// composites after what they wrap); fails on the first error.
    pub async fn load(&self, loader: LoadByName) -> Result<(), EvaluatorLoadError> {
        let mut order: Vec<&String> = self.order.iter().collect();
        order.sort_by_key(|name| self.slots[*name].spec.tier);
        let mut loaded = Loaded::new();
        for name in order {
            let slot = &self.slots[name];
            let (loader, owned) = (loader.clone(), name.clone());
            let before = loaded.clone();
            let started = std::time::Instant::now();
            let failed = |reason: String| EvaluatorLoadError {
                evaluator: name.clone(),
                reason,
            };
            let evaluator = tokio::task::spawn_blocking(move || loader(&owned, &before))
                .await
                .map_err(|e| failed(format!("loading panicked: {e}")))?
                .map_err(|e| failed(e.to_string()))?;
            metrics::record_model_load(name, started.elapsed());
            tracing::info!(evaluator = %name, seconds = started.elapsed().as_secs_f64(), "evaluator loaded");
            metrics::set_ready(name, true);
            slot.serve(evaluator);
            loaded.insert(name.clone(), Arc::new(Gated(slot.clone())));
        }
        *self.reloader.lock().await = Some(Reloader { loader, loaded });
        Ok(())
    }

    /// Watches on every loaded evaluator whose readiness can change, and on swaps (after
    /// which the watches are to be taken again); see `any_changed`.
    pub(crate) fn health_watches(&self) -> Vec<watch::Receiver<bool>> {
        self.slots
            .values()
            .filter_map(|s| s.evaluator.get()?.health())
            .chain(std::iter::once(self.swaps.subscribe()))
            .collect()
    }

    /// A reload swapped an evaluator: the health watches are taken again, and every evaluator
    /// hears of it (a cascade over the swapped PRM calibrates on it).
    pub(super) fn swapped(&self) {
        self.swaps.send_modify(|v| *v = !*v);
        for slot in self.slots.values() {
            if let Some(e) = slot.evaluator.get() {
                e.after_swap();
            }
        }
    }

    pub(super) fn slot_of(&self, name: &str) -> Arc<Slot> {
        self.slots[name].clone()
    }

    pub(crate) fn list(&self) -> Vec<EvaluatorStatus> {
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
                    max_steps: slot.spec.max_steps,
                    max_trace_bytes: slot.spec.max_trace_bytes,
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
        let (_permit, mut tickets) =
            self.admission(slot, std::slice::from_ref(&request), &origin.at)?;
        let ticket = tickets
            .pop()
            .ok_or_else(|| EngineError::Internal("admission gave no ticket".into()))?;
        slot.run(request, ticket)
            .await
            .map_err(|e| origin.locate(e))
    }

    /// Admits and judges every request together (all or none are admitted); results keep order.
    /// `list` names the list in errors: `candidates` (a Rank), `query` (a reward batch); each
    /// request's origin names its item.
    pub(crate) async fn evaluate_all(
        &self,
        requests: Vec<Request>,
        list: &FieldPath,
    ) -> Result<Vec<Verdict>, EngineError> {
        self.evaluate_each(requests, list, |r| r).await
    }

    /// `evaluate_all`, where `settle` makes each request's outcome its item, or the error that
    /// fails them all (and drops the rest): a reward batch keeps the verdicts it got in time.
    pub(crate) async fn evaluate_each<T>(
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
        let (_permit, tickets) = self.admission(slot, &admitted, list)?;
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

    /// The one admission step, for one request or a batch (all or none): room among the
    /// server's `max_in_flight` (refused at once, never queued), then the evaluator's pace (all
    /// can finish before the earliest deadline). Limits are checked before, per request, since
    /// a reward batch settles a trace over them apart. Returns the permit, held while they run,
    /// and each request's pace ticket, in order; nothing for an empty batch.
    fn admission<'s>(
        &self,
        slot: &'s Slot,
        requests: &[Request],
        field: &FieldPath,
    ) -> Result<(Option<impl Sized + use<>>, Vec<super::pace::Ticket<'s>>), EngineError> {
        if requests.is_empty() {
            return Ok((None, Vec::new()));
        }
        let permit = self.admit(slot, requests.len(), field)?;
        let sizes: Vec<usize> = requests.iter().map(|r| r.trace.byte_len()).collect();
        let deadline = requests.iter().filter_map(|r| r.deadline).min();
        Ok((Some(permit), slot.paced(&sizes, deadline)?))
    }

    fn slot(&self, requested: &str) -> Result<&Slot, EngineError> {
        let name = self.resolve_name(requested)?;
        Ok(&self.slots[name])
    }

    /// Takes `n` in-flight permits at once or refuses: never waits, never queues unboundedly.
    /// `slot`'s pace says when to come back.
    fn admit(
        &self,
        slot: &Slot,
        n: usize,
        field: &FieldPath,
    ) -> Result<(OwnedSemaphorePermit, GaugeGuard<impl Fn(f64) + use<>>), EngineError> {
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
            .map_err(|_| EngineError::Overloaded {
                message: format!("{} requests already in flight", self.max_in_flight),
                retry_after: slot.drain(),
            })?;
        let count = n as f64;
        Ok((
            permit,
            GaugeGuard::new(move |d| metrics::in_flight(d * count)),
        ))
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
pub(crate) async fn any_changed(watches: &mut Vec<watch::Receiver<bool>>) {
    if watches.is_empty() {
        return std::future::pending().await;
    }
    let changes = watches.iter_mut().map(|w| Box::pin(w.changed()));
    let (result, i, _) = futures::future::select_all(changes).await;
    if result.is_err() {
        watches.swap_remove(i);
    }
}

#[cfg(test)]
#[path = "registry_tests.rs"]
mod tests;
