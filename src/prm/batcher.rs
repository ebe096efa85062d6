//! The model thread and its queue: requests are packed into batches by a token budget (the model
//! packs their rows end to end, no padding) and scored in one forward pass; work whose caller
//! left or whose deadline passed is dropped before it reaches the model.

use super::format::Encoded;
use super::model::PrmModel;
use crate::metrics;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// How batches are cut.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    /// Most tokens per batch (rows are packed end to end, not padded, so this is their sum);
    /// a longer single trace runs alone.
    pub max_batch_tokens: usize,
    pub max_batch_size: usize,
    /// How long the first request of a batch may wait for company.
    pub max_wait: Duration,
}

/// A scored request: its step scores and where its time went.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    pub scores: Vec<f32>,
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
}

struct Pending {
    encoded: Encoded,
    reply: oneshot::Sender<Result<Scored, BatchError>>,
    deadline: Option<Instant>,
    enqueued: Instant,
}

/// The sending side, held by the evaluator; dropping it stops the thread.
pub struct Batcher {
    tx: SyncSender<Pending>,
    capacity: usize,
    alive: Arc<AtomicBool>,
    /// For the queue-depth gauge, which counts requests waiting for the model too.
    name: String,
}

/// How many requests from the front of the queue go into the next batch: as many as fit the
/// budget, and always at least one. The model packs rows without padding, so a batch costs the
/// sum of its lengths and a long trace doesn't inflate its neighbours.
pub fn next_batch(lengths: impl IntoIterator<Item = usize>, budget: &Budget) -> usize {
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

/// Marks the batcher dead when the thread exits, even by a panic.
struct AliveGuard(Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

impl Batcher {
    /// Starts the model thread for `model`, with room for `capacity` queued requests.
    pub fn spawn(
        name: &str,
        model: PrmModel,
        budget: Budget,
        capacity: usize,
    ) -> std::io::Result<Batcher> {
        let (tx, rx) = sync_channel(capacity);
        let alive = Arc::new(AtomicBool::new(true));
        let guard = AliveGuard(alive.clone());
        let name = name.to_string();
        let name_for_gauge = name.clone();
        std::thread::Builder::new()
            .name(format!("prm-{name}"))
            .spawn(move || {
                let _guard = guard;
                run(&name, &model, budget, rx);
            })?;
        Ok(Batcher {
            tx,
            capacity,
            alive,
            name: name_for_gauge,
        })
    }

    pub fn alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    /// Queues a request without waiting: a full queue is refused at once.
    pub fn submit(
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
            Err(TrySendError::Disconnected(_)) => Err(BatchError::Stopped),
        }
    }
}

/// The model thread: gather, cut, drop the abandoned, score, reply; until every sender is gone.
fn run(name: &str, model: &PrmModel, budget: Budget, rx: Receiver<Pending>) {
    let mut queue: VecDeque<Pending> = VecDeque::new();
    loop {
        if queue.is_empty() {
            match rx.recv() {
                Ok(p) => queue.push_back(p),
                Err(_) => return,
            }
        }
        // Wait a little for company while the batch still has room.
        let first = queue[0].enqueued;
        while next_batch(queue.iter().map(|p| p.encoded.ids.len()), &budget) == queue.len() {
            let waited = first.elapsed();
            let item = if waited >= budget.max_wait {
                match rx.try_recv() {
                    Ok(p) => p,
                    Err(_) => break,
                }
            } else {
                match rx.recv_timeout(budget.max_wait - waited) {
                    Ok(p) => p,
                    Err(RecvTimeoutError::Timeout) => break,
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            };
            queue.push_back(item);
        }
        let n = next_batch(queue.iter().map(|p| p.encoded.ids.len()), &budget);
        metrics::queue_depth(name, -(n as f64));
        let batch: Vec<Pending> = queue.drain(..n).filter_map(|p| keep(name, p)).collect();
        if !batch.is_empty() {
            score(name, model, batch);
        }
    }
}

/// The job, unless nobody will read its result: a caller that left, or a deadline that passed
/// (that caller is told so).
fn keep(name: &str, p: Pending) -> Option<Pending> {
    if p.deadline.is_some_and(|d| Instant::now() >= d) {
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

fn score(name: &str, model: &PrmModel, batch: Vec<Pending>) {
    let started = Instant::now();
    let rows: Vec<&[u32]> = batch.iter().map(|p| p.encoded.ids.as_slice()).collect();
    let positions: Vec<&[usize]> = batch
        .iter()
        .map(|p| p.encoded.positions.as_slice())
        .collect();
    let real: usize = rows.iter().map(|r| r.len()).sum();
    let result = model
        .score(&rows, &positions)
        .map_err(|e| e.to_string())
        .and_then(|scores| {
            // A NaN would pass every threshold and sort first in a ranking: never let one out.
            match scores.iter().flatten().all(|s| s.is_finite()) {
                true => Ok(scores),
                false => Err("the model produced a non-finite score".to_string()),
            }
        });
    let inference = started.elapsed();
    // Packed, not padded: the tokens computed are the real ones.
    metrics::record_batch(name, batch.len(), real);
    metrics::record_stage(name, metrics::Stage::Inference, inference);
    match result {
        Ok(scores) => {
            for (p, scores) in batch.into_iter().zip(scores) {
                let queued = started.saturating_duration_since(p.enqueued);
                let _ = p.reply.send(Ok(Scored {
                    scores,
                    queued,
                    inference,
                }));
            }
        }
        Err(e) => {
            tracing::error!(evaluator = name, error = %e, "batch failed");
            for p in batch {
                let _ = p.reply.send(Err(BatchError::Model(e.clone())));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(tokens: usize, size: usize) -> Budget {
        Budget {
            max_batch_tokens: tokens,
            max_batch_size: size,
            max_wait: Duration::ZERO,
        }
    }

    #[test]
    fn cuts_by_packed_tokens() {
        let b = budget(100, 8);
        assert_eq!(next_batch([], &b), 0);
        assert_eq!(next_batch([10, 10, 10], &b), 3);
        // The sum counts, not rows x the longest: 10 + 20 + 30 + 10 = 70 fits.
        assert_eq!(next_batch([10, 20, 30, 10], &b), 4);
        // 10 + 10 + 90 = 110 > 100: the long row waits for the next batch.
        assert_eq!(next_batch([10, 10, 90], &b), 2);
        assert_eq!(next_batch([60, 40, 1], &b), 2);
        assert_eq!(next_batch([50, 50, 1], &b), 2);
    }

    #[test]
    fn cuts_by_size_and_always_takes_one() {
        assert_eq!(next_batch([1; 10], &budget(1000, 4)), 4);
        // A single trace over the budget still runs, alone.
        assert_eq!(next_batch([500, 1], &budget(100, 8)), 1);
        assert_eq!(next_batch([5], &budget(0, 0)), 1);
    }
}
