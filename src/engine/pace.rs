//! An evaluator's pace: the work admitted to it and not yet done, and how fast it clears work,
//! so that a request which cannot finish before its deadline is refused at admission instead of
//! admitted to fail.
//!
//! Work is counted in trace bytes, plus a fixed share per request. Bytes stand in for tokens, to
//! which they are proportional for one tokenizer and language, and they are known at admission
//! without tokenizing on the async runtime; the pace is measured in the same unit, so the ratio
//! cancels. A count of requests is not enough when traces differ in length tenfold, and bytes
//! alone undercount short ones: each also costs its prompt template and its read-out.
//!
//! How the pace is measured depends on how the evaluator shares its time (`Sharing`): a model on
//! this machine's cores clears a byte rate however many requests it batches, so its pace is bytes
//! per busy second; an upstream serves each request beside the others, so a rate measured with
//! one request in flight says nothing of sixteen, and its pace is a request's own bytes per
//! second of its own service time.

use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// Busy time over which one sample of the pace is taken.
const WINDOW: Duration = Duration::from_secs(1);
/// An idle evaluator that has started nothing for this long takes the next request whatever
/// its estimate says: a pace measured while the machine was busier (another process, a burst)
/// is low, refuses what would fit, and only answered work measures it again. At most one such
/// probe can be late in each interval.
const PROBE_AFTER: Duration = Duration::from_secs(1);
/// Each probe in a row that ends unanswered (late, failed, dropped) doubles that interval, up to
/// this many times (64 s): a machine slowed past the deadlines is not handed every request that
/// arrives a second after the last to fail, and an answer resets it.
const MAX_PROBE_DOUBLINGS: u32 = 6;
/// The newest sample's weight in the pace: half, so a few probes bring a pace that was
/// measured low back to the machine's.
const ALPHA: f64 = 0.5;
/// An answered request's weight in the mean work of a request.
const MEAN_ALPHA: f64 = 0.1;
/// The estimate is stretched by this much before it is held against the time left: the pace is
/// a mean, and a request's batch-mates and the cores' other work make some finish later.
const MARGIN: f64 = 1.3;

/// What one request costs beyond its trace's bytes, in bytes: a chat template's system prompt
/// and markup (about 60 tokens for a ChatML model) and the per-request work of a batch.
const PER_REQUEST: u64 = 256;

/// The work a trace of `bytes` bytes counts as.
pub(super) fn work(bytes: usize) -> u64 {
    bytes as u64 + PER_REQUEST
}

/// How an evaluator's requests share its time, which decides what its pace measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Sharing {
    /// A model on this machine's cores: requests share its batches and its cores, so what it
    /// clears is a byte rate over its busy time, and a request ends when its batch does.
    #[default]
    Batched,
    /// An upstream (a judge, a remote PRM) or an evaluator that wraps one: up to
    /// `max_concurrency` requests run at once, each in about its own time, so the pace is a
    /// request's bytes over its own service time and the work ahead is shared among the slots.
    Parallel,
}

/// One evaluator's pending work and measured pace.
#[derive(Debug)]
pub(super) struct Pace {
    state: Mutex<State>,
    shape: PaceShape,
}

#[derive(Debug, Default)]
struct State {
    /// Bytes admitted and not yet finished.
    pending: u64,
    /// Requests admitted and not yet finished.
    requests: usize,
    /// The mean work of an answered request; unknown until one is answered.
    mean: Option<f64>,
    /// Of those, bytes handed to the evaluator (past its `max_concurrency` gate).
    serving: u64,
    /// When work was last counted as pending.
    last_start: Option<Instant>,
    /// Probes that ended unanswered since the last answer.
    failed_probes: u32,
    /// Since when `pending` has been above zero.
    busy_since: Option<Instant>,
    /// The last answer, or the start of this busy spell: the evaluator has worked on what it
    /// serves since then.
    last_finish: Option<Instant>,
    /// Busy time and bytes finished since the last sample; for `Sharing::Parallel`, the
    /// answered requests' own service time and bytes.
    busy: Duration,
    done: u64,
    /// Bytes cleared per busy second (per second of a request's service, for
    /// `Sharing::Parallel`); unknown until the first window of work closes.
    rate: Option<f64>,
}

/// Why a request would miss its deadline, for the refusal's message.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct TooSlow {
    /// How long the work ahead and the request's own would take at the measured pace.
    pub estimate: Duration,
    /// The time left before the deadline.
    pub left: Duration,
    /// Bytes of work ahead of it.
    pub ahead: u64,
    /// Bytes of work likely to share its batch after it: its batch-mates, at the mean request.
    pub beside: u64,
    /// The measured pace, bytes a second.
    pub rate: f64,
    /// How long the work ahead takes to drain far enough for this request to fit.
    pub retry_after: Duration,
}

impl Default for Pace {
    fn default() -> Self {
        Pace::new(1, Sharing::Batched)
    }
}

impl Pace {
    /// An evaluator's pace, unmeasured, serving `concurrency` requests at once.
    pub(super) fn new(concurrency: usize, sharing: Sharing) -> Pace {
        Pace {
            state: Mutex::default(),
            shape: PaceShape {
                concurrency: concurrency.max(1),
                sharing,
            },
        }
    }

    /// Admits work of `sizes` bytes at `now`, all or none, if it can finish by `deadline` at the
    /// measured pace behind what is pending; each ticket counts its part as pending from here.
    /// The check and the count are one step, so two admissions at once cannot both take the
    /// same room.
    pub(super) fn admit(
        &self,
        sizes: &[u64],
        deadline: Option<Instant>,
        now: Instant,
    ) -> Result<Vec<Ticket<'_>>, TooSlow> {
        let mut s = self.lock();
        let probe = s.check(sizes.iter().sum(), self.shape, deadline, now)?;
        Ok(sizes
            .iter()
            .map(|&b| s.start(self, b, now, probe))
            .collect())
    }

    /// `admit` for one trace.
    #[cfg(test)]
    fn admit_one(
        &self,
        bytes: u64,
        deadline: Option<Instant>,
        now: Instant,
    ) -> Result<Ticket<'_>, TooSlow> {
        let mut s = self.lock();
        let probe = s.check(bytes, self.shape, deadline, now)?;
        Ok(s.start(self, bytes, now, probe))
    }

    /// Whether `bytes` of work admitted at `now` could finish by `deadline`; counts nothing.
    #[cfg(test)]
    fn admits(&self, bytes: u64, deadline: Option<Instant>, now: Instant) -> Result<(), TooSlow> {
        self.lock()
            .check(bytes, self.shape, deadline, now)
            .map(|_| ())
    }

    /// How long the work pending now takes to drain at the measured pace; None before the
    /// pace is known. What an overloaded caller is told to wait.
    pub(super) fn drain(&self, now: Instant) -> Option<Duration> {
        let s = self.lock();
        let rate = s.rate?;
        let ahead = s.queued(rate, self.shape, now);
        Some(Duration::from_secs_f64(ahead as f64 / rate))
    }

    /// Counts `bytes` as pending until the ticket is dropped, with no check: work an evaluator
    /// already admitted hands on (a cascade's call to the evaluator it wraps).
    pub(super) fn start(&self, bytes: u64, now: Instant) -> Ticket<'_> {
        self.lock().start(self, bytes, now, false)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn serve(&self, bytes: u64) {
        self.lock().serving += bytes;
    }

    fn finish(&self, t: &Ticket<'_>, end: End, now: Instant) -> Option<f64> {
        let (bytes, serving) = (t.bytes, t.served_at.is_some());
        let cleared = end == End::Answered;
        let mut s = self.lock();
        match end {
            End::Answered => s.failed_probes = 0,
            End::Failed if t.probe => s.failed_probes = s.failed_probes.saturating_add(1),
            // The caller's mistake says nothing of the evaluator's pace or health.
            End::Failed | End::BadInput => {}
        }
        s.pending = s.pending.saturating_sub(bytes);
        s.requests = s.requests.saturating_sub(1);
        if serving {
            s.serving = s.serving.saturating_sub(bytes);
        }
        s.last_finish = Some(now);
        if cleared {
            let w = bytes as f64;
            s.mean = Some(s.mean.map_or(w, |m| m + MEAN_ALPHA * (w - m)));
        }
        match self.shape.sharing {
            Sharing::Batched => s.busy_sample(bytes, cleared, now),
            Sharing::Parallel => s.service_sample(bytes, cleared, t.served_at, now),
        }
    }
}

impl State {
    /// Closes the busy spell's sample when a window of busy time has passed: bytes answered
    /// over the time anything was pending.
    fn busy_sample(&mut self, bytes: u64, cleared: bool, now: Instant) -> Option<f64> {
        if cleared {
            self.done += bytes;
        }
        let since = self.busy_since.unwrap_or(now);
        let busy = self.busy + now.saturating_duration_since(since);
        if self.pending == 0 {
            self.busy = busy;
            self.busy_since = None;
        }
        if busy < WINDOW || self.done == 0 {
            return None;
        }
        let rate = self.close_sample(busy);
        if self.pending > 0 {
            self.busy_since = Some(now);
        }
        Some(rate)
    }

    /// Adds an answered request's own service time (from its handing over to its answer) and
    /// bytes, and closes the sample once a window of service time has gathered. Requests
    /// answered side by side each add their own time, so the rate is one request's, however
    /// many ran at once.
    fn service_sample(
        &mut self,
        bytes: u64,
        cleared: bool,
        served_at: Option<Instant>,
        now: Instant,
    ) -> Option<f64> {
        if self.pending == 0 {
            self.busy_since = None;
        }
        let (true, Some(at)) = (cleared, served_at) else {
            return None;
        };
        self.done += bytes;
        self.busy += now.saturating_duration_since(at);
        if self.busy < WINDOW {
            return None;
        }
        Some(self.close_sample(self.busy))
    }

    /// The sample of `done` bytes over `time`, folded into the pace.
    fn close_sample(&mut self, time: Duration) -> f64 {
        let sample = self.done as f64 / time.as_secs_f64();
        let rate = self.rate.map_or(sample, |r| r + ALPHA * (sample - r));
        self.rate = Some(rate);
        self.busy = Duration::ZERO;
        self.done = 0;
        rate
    }

    /// Whether `bytes` of work admitted at `now` can finish by `deadline`, at the measured pace,
    /// behind what is pending and beside its likely batch-mates (as many as are pending, up to
    /// `concurrency` less one, at the mean request: it ends when its batch does); a request
    /// that alone would take longer than its deadline is refused too. Always yes with no
    /// deadline, before the pace is known, or as a probe (an evaluator idle and given nothing
    /// for `PROBE_AFTER`, doubled for each probe in a row that ended unanswered): Ok(true) says
    /// it was admitted only as a probe.
    fn check(
        &self,
        bytes: u64,
        shape: PaceShape,
        deadline: Option<Instant>,
        now: Instant,
    ) -> Result<bool, TooSlow> {
        let (Some(deadline), Some(rate)) = (deadline, self.rate) else {
            return Ok(false);
        };
        let ahead = self.queued(rate, shape, now);
        let beside = match shape.sharing {
            Sharing::Batched => {
                let mates = self.requests.min(shape.concurrency - 1) as f64;
                (mates * self.mean.unwrap_or(0.0)) as u64
            }
            Sharing::Parallel => 0,
        };
        let estimate = Duration::from_secs_f64((ahead + beside + bytes) as f64 / rate);
        let left = deadline.saturating_duration_since(now);
        let wait = PROBE_AFTER * 2u32.pow(self.failed_probes.min(MAX_PROBE_DOUBLINGS));
        let quiet = self
            .last_start
            .is_none_or(|t| now.saturating_duration_since(t) >= wait);
        match estimate.mul_f64(MARGIN) <= left {
            true => Ok(false),
            false if self.pending == 0 && quiet => Ok(true),
            false => {
                // The work ahead drains at the pace; once enough of it has, this would fit.
                let over = estimate.mul_f64(MARGIN).saturating_sub(left);
                let drains = Duration::from_secs_f64(ahead as f64 / rate);
                Err(TooSlow {
                    estimate,
                    left,
                    ahead,
                    beside,
                    rate,
                    retry_after: over.min(drains),
                })
            }
        }
    }

    /// The work a new request waits behind. Batched, all that is ahead of it; in parallel,
    /// nothing while a slot is free, else what is ahead shared among the slots.
    fn queued(&self, rate: f64, shape: PaceShape, now: Instant) -> u64 {
        let ahead = self.ahead(rate, now);
        match shape.sharing {
            Sharing::Batched => ahead,
            Sharing::Parallel if self.requests < shape.concurrency => 0,
            Sharing::Parallel => ahead / shape.concurrency as u64,
        }
    }

    /// Counts `bytes` as pending; `Ticket::done` counts them as cleared (a failure or a drop
    /// does not: the pace is what the evaluator answers).
    fn start<'a>(&mut self, pace: &'a Pace, bytes: u64, now: Instant, probe: bool) -> Ticket<'a> {
        if self.pending == 0 {
            self.busy_since = Some(now);
            self.last_finish = Some(now);
        }
        self.pending += bytes;
        self.requests += 1;
        self.last_start = Some(now);
        Ticket {
            pace,
            bytes,
            served_at: None,
            ended: false,
            probe,
        }
    }

    /// The work ahead of a new request: what is pending, less what the evaluator has done since
    /// its last answer on the work it serves (at the measured pace, and never more than that
    /// work).
    fn ahead(&self, rate: f64, now: Instant) -> u64 {
        let since = self
            .last_finish
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        let progress = (rate * since.as_secs_f64()) as u64;
        self.pending.saturating_sub(progress.min(self.serving))
    }
}

/// What the estimate needs of the evaluator beside its state.
#[derive(Debug, Clone, Copy)]
struct PaceShape {
    /// Requests the evaluator serves at once (its `max_concurrency`): a request shares its
    /// batch, or the upstream, with up to this many less one, and ends when they all do.
    concurrency: usize,
    sharing: Sharing,
}

/// Work counted as pending; dropping it ends the count.
#[derive(Debug)]
pub(super) struct Ticket<'a> {
    pace: &'a Pace,
    bytes: u64,
    /// When the evaluator was handed the work (past its gate).
    served_at: Option<Instant>,
    ended: bool,
    /// Admitted only because the evaluator was quiet, against its estimate.
    probe: bool,
}

impl Ticket<'_> {
    /// The evaluator has the work now (past its gate).
    pub(super) fn serving(&mut self) {
        self.served_at = Some(Instant::now());
        self.pace.serve(self.bytes);
    }

    /// The work was answered; returns the pace when this closed a window.
    pub(super) fn done(mut self) -> Option<f64> {
        self.ended = true;
        self.pace.finish(&self, End::Answered, Instant::now())
    }

    /// The evaluator refused the input (the caller's mistake): not counted against it, as a
    /// failure or a probe that went unanswered would be.
    pub(super) fn bad_input(mut self) {
        self.ended = true;
        self.pace.finish(&self, End::BadInput, Instant::now());
    }
}

/// How a ticket's work ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Answered,
    /// Failed, timed out or dropped: the evaluator did not answer.
    Failed,
    /// Refused as bad input.
    BadInput,
}

impl Drop for Ticket<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.pace.finish(self, End::Failed, Instant::now());
        }
    }
}

#[cfg(test)]
#[path = "pace_tests.rs"]
mod tests;
