//! The batcher's cutting, waiting, dropping and failure paths, driven by a scripted inbox on
//! simulated time and a fake scorer: nothing here sleeps.

use super::*;
use std::sync::Mutex;

/// Each row's reads at `value`, every token computed: what a fake scorer answers.
fn rows_at(batch: &[&Encoded], value: f32) -> Vec<Row> {
    batch
        .iter()
        .map(|e| Row {
            scores: vec![value; e.positions.len()],
            categories: Vec::new(),
            tokens: Tokens {
                computed: e.ids.len(),
                reused: 0,
            },
        })
        .collect()
}

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

/// Requests arriving at set times on a simulated clock that only the script moves.
struct Script {
    now: Instant,
    arrivals: VecDeque<(Instant, Pending)>,
}

impl Inbox for Script {
    fn now(&self) -> Instant {
        self.now
    }

    fn recv(&mut self, until: Option<Instant>) -> Result<Option<Pending>, Closed> {
        match (self.arrivals.front(), until) {
            (None, None) => Err(Closed),
            (Some((at, _)), until) if until.is_none_or(|u| *at <= u) => {
                self.now = self.now.max(*at);
                Ok(self.arrivals.pop_front().map(|(_, p)| p))
            }
            (_, Some(until)) => {
                self.now = self.now.max(until);
                Ok(None)
            }
            (Some(_), None) => unreachable!("the guard above takes every arrival when unbounded"),
        }
    }
}

/// Records each batch's row lengths (its ids are `[len; len]`) and scores each position 0.5,
/// or fails as told.
#[derive(Default)]
struct Fake {
    batches: Mutex<Vec<Vec<usize>>>,
    fail: Option<&'static str>,
    nan: bool,
    /// Tokens of every row its prefix cache holds, which a batch does not compute.
    cached: usize,
    /// How many times a request's cost was asked for.
    costed: std::sync::atomic::AtomicUsize,
}

impl Scorer for Fake {
    fn cost(&self, encoded: &Encoded) -> usize {
        self.costed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        encoded.ids.len().saturating_sub(self.cached)
    }

    fn score(&self, batch: &[&Encoded]) -> Result<Vec<Row>, ScoreError> {
        self.batches
            .lock()
            .unwrap()
            .push(batch.iter().map(|e| e.ids.len()).collect());
        if let Some(message) = self.fail {
            return Err(ScoreError::Other(message.into()));
        }
        let value = if self.nan { f32::NAN } else { 0.5 };
        Ok(rows_at(batch, value))
    }
}

type Rx = oneshot::Receiver<Result<Scored, BatchError>>;

struct Sim {
    t0: Instant,
    arrivals: VecDeque<(Instant, Pending)>,
}

impl Sim {
    fn new() -> Self {
        Sim {
            t0: Instant::now(),
            arrivals: VecDeque::new(),
        }
    }

    fn ms(&self, ms: u64) -> Instant {
        self.t0 + Duration::from_millis(ms)
    }

    /// A request of `len` tokens (one read position) arriving at `at_ms`.
    fn arrive(&mut self, at_ms: u64, len: usize, deadline_ms: Option<u64>) -> Rx {
        let (reply, rx) = oneshot::channel();
        let at = self.ms(at_ms);
        let pending = Pending {
            encoded: Encoded {
                ids: vec![len as u32; len],
                positions: vec![len - 1],
                spans: Ok(Vec::new()),
            },
            reply,
            deadline: deadline_ms.map(|d| self.ms(d)),
            enqueued: at,
        };
        self.arrivals.push_back((at, pending));
        rx
    }

    /// Runs the model thread's loop over the script until every request is handled.
    fn run(self, budget: Budget, scorer: &Fake) {
        let inbox = Script {
            now: self.t0,
            arrivals: self.arrivals,
        };
        run("test", scorer, budget, inbox, &|why| panic!("died: {why}"));
    }
}

fn waiting(tokens: usize, size: usize, wait_ms: u64) -> Budget {
    Budget {
        max_wait: Duration::from_millis(wait_ms),
        ..budget(tokens, size)
    }
}

fn answer(mut rx: Rx) -> Result<Scored, BatchError> {
    rx.try_recv().expect("the thread answered")
}

#[test]
fn a_batch_waits_max_wait_after_its_latest_arrival() {
    let mut sim = Sim::new();
    let a = sim.arrive(0, 3, None);
    let b = sim.arrive(4, 5, None);
    // Within 5 ms of B: it joins. D comes 6 ms after C, when the batch has gone.
    let c = sim.arrive(8, 7, None);
    let d = sim.arrive(14, 9, None);
    let fake = Fake::default();
    sim.run(waiting(1000, 8, 5), &fake);
    assert_eq!(*fake.batches.lock().unwrap(), vec![vec![3, 5, 7], vec![9]]);
    let a = answer(a).unwrap();
    assert_eq!(a.scores, vec![0.5]);
    // The batch was cut 5 ms after C: A waited 13 ms, B 9, C 5.
    assert_eq!(a.queued, Duration::from_millis(13));
    assert_eq!(answer(b).unwrap().queued, Duration::from_millis(9));
    assert_eq!(answer(c).unwrap().queued, Duration::from_millis(5));
    assert!(answer(d).is_ok());
}

#[test]
fn a_burst_holds_its_first_request_ten_max_waits_at_most() {
    let mut sim = Sim::new();
    // One every 4 ms, each within max_wait (5 ms) of the one before, for ever: the batch is
    // cut at 50 ms, ten times max_wait after the first, with the 13 that came by then.
    let rxs: Vec<Rx> = (0..16).map(|i| sim.arrive(4 * i, 2, None)).collect();
    let fake = Fake::default();
    sim.run(waiting(1000, 100, 5), &fake);
    assert_eq!(fake.batches.lock().unwrap()[0], vec![2; 13]);
    let first = rxs.into_iter().next().map(|rx| answer(rx).unwrap().queued);
    assert_eq!(first, Some(Duration::from_millis(50)));
}

#[test]
fn each_request_is_costed_once_a_gathering_and_a_long_queues_tail_never() {
    // A burst of 16, one every 4 ms: two gatherings (13, then 3), each arrival costed once.
    let mut sim = Sim::new();
    let rxs: Vec<Rx> = (0..16).map(|i| sim.arrive(4 * i, 2, None)).collect();
    let fake = Fake::default();
    sim.run(waiting(1000, 100, 5), &fake);
    assert_eq!(fake.costed.into_inner(), 16);
    assert!(rxs.into_iter().all(|rx| answer(rx).is_ok()));
    // Ten at once, batches of two: each gathering costs the two it takes and the one that
    // does not fit (the last, two), never the queue behind them.
    let mut sim = Sim::new();
    let rxs: Vec<Rx> = (0..10).map(|_| sim.arrive(0, 2, None)).collect();
    let fake = Fake::default();
    sim.run(waiting(1000, 2, 5), &fake);
    assert_eq!(fake.batches.lock().unwrap().len(), 5);
    assert_eq!(fake.costed.into_inner(), 4 * 3 + 2);
    assert!(rxs.into_iter().all(|rx| answer(rx).is_ok()));
}

#[test]
fn no_batch_waits_into_a_queued_deadline() {
    let mut sim = Sim::new();
    let a = sim.arrive(0, 3, Some(8));
    // B's arrival would hold the batch to 7 ms and take C in; A's deadline at 8 ms leaves
    // room to wait only until 3 ms (a 5 ms max_wait short of it).
    let b = sim.arrive(2, 4, None);
    let c = sim.arrive(6, 5, None);
    let fake = Fake::default();
    sim.run(waiting(1000, 8, 5), &fake);
    assert_eq!(*fake.batches.lock().unwrap(), vec![vec![3, 4], vec![5]]);
    assert_eq!(answer(a).unwrap().queued, Duration::from_millis(3));
    assert!(answer(b).is_ok() && answer(c).is_ok());
}

#[test]
fn a_full_batch_is_cut_without_waiting() {
    let mut sim = Sim::new();
    let rxs: Vec<Rx> = (0..5).map(|_| sim.arrive(0, 10, None)).collect();
    let fake = Fake::default();
    // Room for two rows of 10 tokens: three batches, none of which waited.
    sim.run(waiting(25, 8, 1_000), &fake);
    assert_eq!(
        *fake.batches.lock().unwrap(),
        vec![vec![10, 10], vec![10, 10], vec![10]]
    );
    for rx in rxs.into_iter().take(4) {
        assert_eq!(answer(rx).unwrap().queued, Duration::ZERO);
    }
}

#[test]
fn the_budget_counts_the_tokens_a_batch_computes_not_what_is_cached() {
    for (cached, want) in [
        (0, vec![vec![60], vec![60], vec![60]]),
        (50, vec![vec![60; 3]]),
    ] {
        let mut sim = Sim::new();
        let rxs: Vec<Rx> = (0..3).map(|_| sim.arrive(0, 60, None)).collect();
        let fake = Fake {
            cached,
            ..Fake::default()
        };
        // 100 tokens: one row of 60 at a time, or all three increments of 10 over the cache.
        sim.run(waiting(100, 8, 0), &fake);
        assert_eq!(*fake.batches.lock().unwrap(), want, "cached {cached}");
        assert!(rxs.into_iter().all(|rx| answer(rx).is_ok()));
    }
}

#[test]
fn a_long_row_never_starves_behind_short_ones() {
    let mut sim = Sim::new();
    let long = sim.arrive(0, 90, None);
    let shorts: Vec<Rx> = (1..6).map(|t| sim.arrive(t, 10, None)).collect();
    let fake = Fake::default();
    sim.run(waiting(100, 8, 10), &fake);
    // Queue order holds: the long row goes first, with the one short row that fits beside it.
    assert_eq!(fake.batches.lock().unwrap()[0], vec![90, 10]);
    assert!(answer(long).is_ok());
    for rx in shorts {
        assert!(answer(rx).is_ok());
    }
}

#[test]
fn work_past_its_deadline_is_answered_and_never_scored() {
    let mut sim = Sim::new();
    // Its deadline passes as it reaches the model thread (the batcher never waits into one).
    let late = sim.arrive(2, 3, Some(2));
    let fine = sim.arrive(2, 4, Some(100));
    let fake = Fake::default();
    sim.run(waiting(1000, 8, 5), &fake);
    assert_eq!(answer(late), Err(BatchError::Deadline));
    assert!(answer(fine).is_ok());
    assert_eq!(*fake.batches.lock().unwrap(), vec![vec![4]]);
}

#[test]
fn work_whose_caller_left_is_dropped_before_the_scorer() {
    let mut sim = Sim::new();
    let gone = sim.arrive(0, 3, None);
    let stays = sim.arrive(0, 4, None);
    drop(gone);
    let fake = Fake::default();
    sim.run(waiting(1000, 8, 5), &fake);
    assert_eq!(*fake.batches.lock().unwrap(), vec![vec![4]]);
    assert!(answer(stays).is_ok());
}

#[test]
fn a_failed_or_non_finite_batch_fails_each_of_its_requests() {
    for (fake, want) in [
        (
            Fake {
                fail: Some("out of memory"),
                ..Fake::default()
            },
            "out of memory",
        ),
        (
            Fake {
                nan: true,
                ..Fake::default()
            },
            "non-finite",
        ),
    ] {
        let mut sim = Sim::new();
        let rxs = [sim.arrive(0, 3, None), sim.arrive(0, 4, None)];
        sim.run(waiting(1000, 8, 0), &fake);
        for rx in rxs {
            match answer(rx) {
                Err(BatchError::Model(m)) => assert!(m.contains(want), "{m}"),
                other => panic!("{other:?}"),
            }
        }
    }
}

/// Panics on its first batch, as a model thread that hits a bug would.
struct Panics;

impl Scorer for Panics {
    fn score(&self, _: &[&Encoded]) -> Result<Vec<Row>, ScoreError> {
        panic!("a bug in the model")
    }
}

#[tokio::test]
async fn a_dead_model_thread_fails_its_work_and_reports_itself() {
    // Batches of one: the first request dies with the thread, the others wait behind it.
    let batcher = Batcher::spawn("dies", Panics, budget(100, 1), 4).unwrap();
    let mut health = batcher.health();
    assert!(batcher.alive());
    let encoded = Encoded {
        ids: vec![1, 2, 3],
        positions: vec![2],
        spans: Ok(Vec::new()),
    };
    let first = batcher.submit(encoded.clone(), None).unwrap();
    // These queue behind the first, unless the thread died already, which refuses them.
    let rest: Vec<_> = (0..2)
        .map(|_| batcher.submit(encoded.clone(), None))
        .collect();
    let died = |e: &BatchError| {
        matches!(e, BatchError::Died { evaluator, panic }
            if evaluator == "dies" && panic == "a bug in the model")
    };
    // Every one is told why, the one in the batch and those queued behind it alike.
    let mut errors = vec![first.await.expect("answered").unwrap_err()];
    assert!(!batcher.alive(), "dead before its first caller is told");
    for r in rest {
        errors.push(match r {
            Ok(rx) => rx.await.expect("answered, not dropped").unwrap_err(),
            Err(e) => e,
        });
    }
    for err in errors {
        assert!(died(&err), "{err:?}");
        assert!(
            err.to_string().contains("until the server restarts"),
            "{err}"
        );
    }
    health.wait_for(|alive| !alive).await.unwrap();
    assert!(!batcher.alive());
    assert!(died(&batcher.stopped()));
    // Refused; or, in the moment before the thread is gone, queued and answered the same way.
    let err = match batcher.submit(encoded, None) {
        Err(e) => e,
        Ok(rx) => rx
            .await
            .map_or_else(|_| batcher.stopped(), |r| r.unwrap_err()),
    };
    assert!(died(&err), "{err:?}");
}

/// Signals when the thread enters its first batch, then holds it there until let go.
struct Started {
    started: Mutex<std::sync::mpsc::Sender<()>>,
    release: Mutex<std::sync::mpsc::Receiver<()>>,
}

impl Scorer for Started {
    fn score(&self, batch: &[&Encoded]) -> Result<Vec<Row>, ScoreError> {
        let _ = self.started.lock().unwrap().send(());
        let _ = self.release.lock().unwrap().recv();
        Ok(rows_at(batch, 1.0))
    }
}

/// A caller whose deadline passes while its request waits for the model gives its place at
/// the gate to the next; the request itself stays queued until the thread reaches it. That
/// next request must be queued, not refused as if the queue were full of live work (seen as
/// refusals under overload that waited at the gate for a second and then failed).
#[tokio::test]
async fn work_left_in_the_queue_does_not_refuse_the_gates_next_request() {
    let (started_tx, started) = std::sync::mpsc::channel();
    let (release, held) = std::sync::mpsc::channel();
    let scorer = Started {
        started: Mutex::new(started_tx),
        release: Mutex::new(held),
    };
    // A gate of one request at a time.
    let batcher = Batcher::spawn("left", scorer, budget(100, 1), 1).unwrap();
    let row = || Encoded {
        ids: vec![1],
        positions: vec![0],
        spans: Ok(Vec::new()),
    };
    let first = batcher.submit(row(), None).unwrap();
    started.recv().unwrap();
    // Queued behind the first; its caller leaves (its permit goes back to the gate).
    drop(batcher.submit(row(), None).unwrap());
    let next = batcher.submit(row(), None);
    assert!(next.is_ok(), "{:?}", next.err());
    for _ in 0..3 {
        let _ = release.send(());
    }
    assert!(first.await.unwrap().is_ok());
    assert!(next.unwrap().await.unwrap().is_ok());
}

#[tokio::test]
async fn a_full_queue_is_refused_at_once() {
    /// Holds the thread in its first batch until the test lets it go.
    struct Held(Mutex<std::sync::mpsc::Receiver<()>>);
    impl Scorer for Held {
        fn score(&self, batch: &[&Encoded]) -> Result<Vec<Row>, ScoreError> {
            let _ = self.0.lock().unwrap().recv();
            Ok(rows_at(batch, 1.0))
        }
    }
    let (release, held) = std::sync::mpsc::channel();
    let batcher = Batcher::spawn("full", Held(Mutex::new(held)), budget(100, 1), 1).unwrap();
    let row = || Encoded {
        ids: vec![1],
        positions: vec![0],
        spans: Ok(Vec::new()),
    };
    let first = batcher.submit(row(), None).unwrap();
    // Fill the channel's one slot once the thread has taken the first request into its batch.
    let second = loop {
        match batcher.submit(row(), None) {
            Ok(rx) => break rx,
            Err(BatchError::QueueFull(_)) => tokio::task::yield_now().await,
            Err(e) => panic!("{e}"),
        }
    };
    let refused = loop {
        match batcher.submit(row(), None) {
            Err(e) => break e,
            // The thread took the second one too before its first batch began: try again.
            Ok(rx) => drop(rx),
        }
    };
    assert_eq!(refused, BatchError::QueueFull(1));
    for _ in 0..3 {
        let _ = release.send(());
    }
    assert!(first.await.unwrap().is_ok());
    assert!(second.await.unwrap().is_ok());
}
