//! The model thread and its queue: requests are packed into batches by a token budget and
//! handed to a `Scorer` (the candle model packs their rows end to end, no padding); work whose
//! caller left or whose deadline passed is dropped before it reaches the scorer. A scorer that
//! panics ends the thread: its batch and everything queued behind it are told why, at once.

use super::format::Encoded;
use crate::metrics;
pub(super) use retrace_model::{CacheStats, Row, Tokens};
use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, watch};

/// What the model thread drives: a batch of encoded rows in, one score in [0, 1] per read
/// position of each row out, in order (`Row`). The candle model is one; a quantized or a remote model
/// fits the same seam.
pub trait Scorer: Send + 'static {
    /// Each row's scores at its read positions, in order, with how many of its tokens were
    /// computed for it and how many reused (cached, or computed once for rows sharing them).
    fn score(&self, batch: &[&Encoded]) -> Result<Vec<Row>, ScoreError>;

    /// What its prefix cache holds, when it has one.
    fn cache(&self) -> Option<CacheStats> {
        None
    }

    /// The tokens a batch would compute for `encoded` now, which is what the batch budget
    /// counts: by default all of them; a scorer with a prefix cache, those past the cached part.
    fn cost(&self, encoded: &Encoded) -> usize {
        encoded.ids.len()
    }
}

/// Why a scorer could not score a batch.
#[derive(Debug, thiserror::Error)]
pub enum ScoreError {
    #[error(transparent)]
    Model(#[from] retrace_model::ModelError),
    /// Another scorer's failure, in its own words.
    #[error("{0}")]
    Other(String),
}

/// How batches are cut.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Budget {
    /// Most tokens a batch computes (rows are packed end to end, not padded, so this is their
    /// sum, less what the scorer's prefix cache holds); a longer single trace runs alone.
    pub max_batch_tokens: usize,
    pub max_batch_size: usize,
    /// How long a batch with room waits for company after its latest request arrived (its
    /// first at most `GATHER` times this).
    pub max_wait: Duration,
}

/// A scored request: its step scores and where its time went.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Scored {
    pub scores: Vec<f32>,
    /// Per step, a trained head's category probabilities; empty without a category head.
    pub categories: Vec<Vec<f32>>,
    pub tokens: Tokens,
    pub queued: Duration,
    pub inference: Duration,
}

/// Why the model thread could not score a request.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum BatchError {
    #[error("the scoring queue is full ({0} requests)")]
    QueueFull(usize),
    #[error("the model thread has stopped")]
    Stopped,
    #[error("the deadline passed while queued for the model")]
    Deadline,
    #[error("the model failed: {0}")]
    Model(String),
    /// The scorer panicked: the thread is gone and never comes back (a panic may leave the
    /// model's state half-written, so no later batch is trusted to it).
    #[error(
        "the model thread of evaluator {evaluator:?} died ({panic}); it serves nothing more until the server restarts"
    )]
    Died { evaluator: String, panic: String },
}

type ReplyTo = oneshot::Sender<Result<Scored, BatchError>>;

/// Requests left in the queue by callers gone past their deadline that the queue holds beside
/// live ones (see `Batcher::spawn`): each is a trace's token ids, dropped unscored.
const LEFT_BEHIND: usize = 64;

struct Pending {
    encoded: Encoded,
    reply: ReplyTo,
    deadline: Option<Instant>,
    enqueued: Instant,
}

/// The sending side, held by the evaluator; dropping it stops the thread.
pub(super) struct Batcher {
    tx: SyncSender<Pending>,
    capacity: usize,
    /// True while the model thread runs; it turns false when the thread exits, even by a panic.
    alive: watch::Receiver<bool>,
    /// Why the thread died, once it has.
    death: Arc<OnceLock<BatchError>>,
    /// For the queue-depth gauge, which counts requests waiting for the model too.
    name: String,
}

/// How many requests from the front of the queue go into the next batch: as many as fit the
/// budget, and always at least one. The model packs rows without padding, so a batch costs the
/// sum of its lengths and a long trace doesn't inflate its neighbours.
pub(crate) fn next_batch(lengths: impl IntoIterator<Item = usize>, budget: &Budget) -> usize {
    let mut count = 0;
    let mut total = 0;
    for len in lengths {
        if count > 0 && (count == budget.max_batch_size || total + len > budget.max_batch_tokens) {
            break;
        }
        total += len;
        count += 1;
    }
    count
}

/// Where the model thread's requests come from, and its clock: the channel and the real clock
/// in the product, a script on simulated time in tests.
trait Inbox {
    fn now(&self) -> Instant;
    /// The next request, waiting until `until` at most (forever when `None`); `Ok(None)` when
    /// that time came first, `Err(Closed)` once every sender is gone.
    fn recv(&mut self, until: Option<Instant>) -> Result<Option<Pending>, Closed>;
}

struct Closed;

/// The product's inbox: the bounded channel `Batcher::submit` fills.
struct Channel(Receiver<Pending>);

impl Inbox for Channel {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn recv(&mut self, until: Option<Instant>) -> Result<Option<Pending>, Closed> {
        let Some(until) = until else {
            return self.0.recv().map(Some).map_err(|_| Closed);
        };
        match until.checked_duration_since(Instant::now()) {
            Some(wait) if !wait.is_zero() => match self.0.recv_timeout(wait) {
                Ok(p) => Ok(Some(p)),
                Err(RecvTimeoutError::Timeout) => Ok(None),
                Err(RecvTimeoutError::Disconnected) => Err(Closed),
            },
            _ => match self.0.try_recv() {
                Ok(p) => Ok(Some(p)),
                Err(TryRecvError::Empty) => Ok(None),
                Err(TryRecvError::Disconnected) => Err(Closed),
            },
        }
    }
}

/// Marks the batcher dead when the thread exits, even by a panic the scorer guard missed.
struct AliveGuard(watch::Sender<bool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.send_replace(false);
    }
}

/// The thread's life as the batcher sees it: `died` records why, then turns health false, before
/// any caller is answered, so none of them can find it still alive.
struct Life<'a> {
    guard: &'a AliveGuard,
    death: &'a OnceLock<BatchError>,
}

impl Life<'_> {
    fn died(&self, why: &BatchError) {
        let _ = self.death.set(why.clone());
        self.guard.0.send_replace(false);
    }
}

impl Batcher {
    /// Starts the model thread for `scorer`, for callers whose gate admits `capacity` requests
    /// at a time. A request whose caller left (its deadline passed while it waited for the
    /// model) keeps its slot until the thread reaches it and drops it, while its caller's place
    /// at the gate is already another's; during one long forward a chain of such callers, each
    /// let through the gate with little time left, leaves several behind. So the queue holds
    /// `LEFT_BEHIND` of them beside twice the gate's count.
    pub(super) fn spawn(
        name: &str,
        scorer: impl Scorer,
        budget: Budget,
        capacity: usize,
    ) -> std::io::Result<Batcher> {
        let (tx, rx) = std::sync::mpsc::sync_channel(2 * capacity + LEFT_BEHIND);
        let (alive_tx, alive) = watch::channel(true);
        let guard = AliveGuard(alive_tx);
        let death = Arc::new(OnceLock::new());
        let thread_name = name.to_string();
        let thread_death = death.clone();
        std::thread::Builder::new()
            .name(format!("prm-{name}"))
            .spawn(move || {
                crate::priority::lower_this_thread();
                let life = Life {
                    guard: &guard,
                    death: &thread_death,
                };
                run(&thread_name, &scorer, budget, Channel(rx), &|why| {
                    life.died(why)
                });
            })?;
        Ok(Batcher {
            tx,
            capacity,
            alive,
            death,
            name: name.to_string(),
        })
    }

    pub(super) fn alive(&self) -> bool {
        *self.alive.borrow()
    }

    /// Turns false when the model thread exits.
    pub(super) fn health(&self) -> watch::Receiver<bool> {
        self.alive.clone()
    }

    /// What a request gets once the thread is gone: why it died, if it did.
    pub(super) fn stopped(&self) -> BatchError {
        self.death.get().cloned().unwrap_or(BatchError::Stopped)
    }

    /// Queues a request without waiting: a full queue is refused at once.
    pub(super) fn submit(
        &self,
        encoded: Encoded,
        deadline: Option<Instant>,
    ) -> Result<oneshot::Receiver<Result<Scored, BatchError>>, BatchError> {
        let (reply, rx) = oneshot::channel();
        let pending = Pending {
            encoded,
            reply,
            deadline,
            enqueued: Instant::now(),
        };
        match self.tx.try_send(pending) {
            Ok(()) => {
                metrics::queue_depth(&self.name, 1.0);
                Ok(rx)
            }
            Err(TrySendError::Full(_)) => Err(BatchError::QueueFull(self.capacity)),
            Err(TrySendError::Disconnected(_)) => Err(self.stopped()),
        }
    }
}

/// The model thread: gather, cut, drop the abandoned, score, reply; until every sender is gone,
/// or the scorer panics (then `died` is told, and every request still queued is answered).
fn run(
    name: &str,
    scorer: &dyn Scorer,
    budget: Budget,
    mut inbox: impl Inbox,
    died: &dyn Fn(&BatchError),
) {
    let mut queue: VecDeque<Pending> = VecDeque::new();
    let mut closed = false;
    loop {
        if queue.is_empty() {
            if closed {
                return;
            }
            match inbox.recv(None) {
                Ok(Some(p)) => queue.push_back(p),
                Ok(None) => continue,
                Err(Closed) => return,
            }
        }
        // Wait for company while the batch still has room.
        let mut costs = Vec::new();
        cost_front(&mut costs, &queue, scorer, &budget);
        while !closed && next_batch(costs.iter().copied(), &budget) == queue.len() {
            match inbox.recv(Some(gather_until(&queue, budget.max_wait))) {
                Ok(Some(p)) => queue.push_back(p),
                Ok(None) => break,
                Err(Closed) => closed = true,
            }
            cost_front(&mut costs, &queue, scorer, &budget);
        }
        let n = next_batch(costs, &budget);
        metrics::queue_depth(name, -(n as f64));
        let now = inbox.now();
        let batch: Vec<Pending> = queue
            .drain(..n)
            .filter_map(|p| keep(name, p, now))
            .collect();
        if !batch.is_empty()
            && let Err((why, batch)) = score(name, scorer, batch, now)
        {
            died(&why);
            // The batch is already off the queue-depth gauge; the queued are not.
            for p in batch {
                let _ = p.reply.send(Err(why.clone()));
            }
            fail_queued(name, queue, &mut inbox, &why);
            return;
        }
    }
}

/// Extends `costs` (the queue's first requests' costs, in order) while the batch they make has
/// room, up to one past it. Each cost is taken once a gathering (a walk of the prefix cache,
/// which only a forward changes, and none runs until the batch is cut), and a long queue's
/// tail is never costed.
fn cost_front(
    costs: &mut Vec<usize>,
    queue: &VecDeque<Pending>,
    scorer: &dyn Scorer,
    budget: &Budget,
) {
    while let Some(p) = queue.get(costs.len()) {
        if next_batch(costs.iter().copied(), budget) < costs.len() {
            return;
        }
        costs.push(scorer.cost(&p.encoded));
    }
}

/// How many times `max_wait` a burst may hold its first request for company.
const GATHER: u32 = 10;

/// Until when a batch with room waits for more: `max_wait` after its latest arrival, so a
/// burst that comes a request at a time (a search's candidates, each tokenized on its own)
/// shares one forward; never past `GATHER` times `max_wait` after its first, nor closer than
/// `max_wait` to a queued deadline (work cut at its deadline is dropped unscored). Requests
/// that queued while the model was busy arrived long ago: they wait no more.
fn gather_until(queue: &VecDeque<Pending>, max_wait: Duration) -> Instant {
    let first = queue[0].enqueued;
    let latest = queue.iter().map(|p| p.enqueued).max().unwrap_or(first);
    let until = (latest + max_wait).min(first + max_wait * GATHER);
    match queue.iter().filter_map(|p| p.deadline).min() {
        // Before `first` (past already): cut now.
        Some(d) => until.min(d.checked_sub(max_wait).unwrap_or(first).max(first)),
        None => until,
    }
}

/// Answers every request still queued, or already sent, with `why`, and takes each off the
/// queue-depth gauge, which would otherwise count them forever.
fn fail_queued(name: &str, queue: VecDeque<Pending>, inbox: &mut impl Inbox, why: &BatchError) {
    let mut fail = |p: Pending| {
        metrics::queue_depth(name, -1.0);
        let _ = p.reply.send(Err(why.clone()));
    };
    queue.into_iter().for_each(&mut fail);
    let now = inbox.now();
    while let Ok(Some(p)) = inbox.recv(Some(now)) {
        fail(p);
    }
}

/// The panic's message, when it carries one (`panic!` with a literal or a format).
fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// The job, unless nobody will read its result: a caller that left, or a deadline that passed
/// (that caller is told so).
fn keep(name: &str, p: Pending, now: Instant) -> Option<Pending> {
    if p.deadline.is_some_and(|d| now >= d) {
        metrics::record_dropped(name, "deadline");
        let _ = p.reply.send(Err(BatchError::Deadline));
        return None;
    }
    if p.reply.is_closed() {
        metrics::record_dropped(name, "cancelled");
        return None;
    }
    Some(p)
}

/// Scores one batch and answers its callers; `Err` with the batch, unanswered, when the scorer
/// panicked, after which the thread must stop.
fn score(
    name: &str,
    scorer: &dyn Scorer,
    batch: Vec<Pending>,
    cut_at: Instant,
) -> Result<(), (BatchError, Vec<Pending>)> {
    let started = Instant::now();
    let rows: Vec<&Encoded> = batch.iter().map(|p| &p.encoded).collect();
    // Caught only to answer the callers with the reason; the thread ends right after.
    let scored = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| scorer.score(&rows)))
        .map_err(|payload| BatchError::Died {
            evaluator: name.to_string(),
            panic: panic_message(payload.as_ref()),
        });
    let scored = match scored {
        Ok(scored) => scored,
        Err(why) => {
            tracing::error!(evaluator = name, error = %why, "the model thread died");
            return Err((why, batch));
        }
    };
    let result = scored.map_err(|e| e.to_string()).and_then(|scored| {
        if scored.len() != rows.len()
            || scored.iter().zip(&rows).any(|(s, r)| {
                s.scores.len() != r.positions.len()
                    || !(s.categories.is_empty() || s.categories.len() == r.positions.len())
            })
        {
            return Err("the scorer returned a score list of the wrong shape".to_string());
        }
        // A NaN would pass every threshold and sort first in a ranking: never let one out.
        match scored.iter().flat_map(|r| &r.scores).all(|s| s.is_finite()) {
            true => Ok(scored),
            false => Err("the model produced a non-finite score".to_string()),
        }
    });
    let inference = started.elapsed();
    metrics::record_stage(name, metrics::Stage::Inference, inference);
    if let Some(cache) = scorer.cache() {
        metrics::set_prefix_cache(name, cache.bytes, cache.evictions);
    }
    match result {
        Ok(scored) => {
            let computed: usize = scored.iter().map(|r| r.tokens.computed).sum();
            let reused: usize = scored.iter().map(|r| r.tokens.reused).sum();
            // Packed, not padded, and reused tokens skipped: the tokens computed are real.
            metrics::record_batch(name, batch.len(), computed);
            metrics::record_prefix_tokens(name, computed, reused);
            for (p, row) in batch.into_iter().zip(scored) {
                let queued = cut_at.saturating_duration_since(p.enqueued);
                let _ = p.reply.send(Ok(Scored {
                    scores: row.scores,
                    categories: row.categories,
                    tokens: row.tokens,
                    queued,
                    inference,
                }));
            }
        }
        Err(e) => {
            let real: usize = rows_len(&batch);
            metrics::record_batch(name, batch.len(), real);
            tracing::error!(evaluator = name, error = %e, "batch failed");
            for p in batch {
                let _ = p.reply.send(Err(BatchError::Model(e.clone())));
            }
        }
    }
    Ok(())
}

fn rows_len(batch: &[Pending]) -> usize {
    batch.iter().map(|p| p.encoded.ids.len()).sum()
}

#[cfg(test)]
#[path = "batcher_tests.rs"]
mod tests;
