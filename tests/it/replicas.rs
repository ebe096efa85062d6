//! Scaling out: three `retrace serve` children on the committed tiny PRM behind client-side
//! round-robin over their addresses, as a client does over a headless Service's. One replica is
//! SIGKILLed mid-run; every request still ends OK, through retries on the survivors, and load had
//! reached all three before the kill. Prints the figures docs/operating.md shows.

use crate::common;

use common::*;
use retrace::pb;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Mutex;
use tonic::Code;
use tonic::transport::Channel;

const REPLICAS: usize = 3;
/// Requests in the run, and how many of them are sent before the kill.
const REQUESTS: usize = 240;
const KILL_AFTER: usize = 90;
/// Callers in closed loops.
const CALLERS: usize = 6;
/// One deadline over all of a request's attempts, as the Python client keeps it.
const DEADLINE: Duration = Duration::from_secs(10);
/// Every replica tried at most once per request.
const ATTEMPTS: usize = REPLICAS;

/// Round-robin over replicas: a call starts at the next address, and a retry moves one address
/// on, so a dead replica costs a call one fast UNAVAILABLE (the Python client's policy).
struct RoundRobin {
    channels: Vec<Channel>,
    next: AtomicUsize,
    served: Vec<AtomicUsize>,
    /// Retries after UNAVAILABLE (a refused connection) or RESOURCE_EXHAUSTED.
    retries: AtomicUsize,
    /// Retries of requests in flight on a connection that broke.
    broken: AtomicUsize,
}

/// How one request ended: OK, or the last attempt's status.
type Ended = Result<(), String>;

impl RoundRobin {
    fn new(channels: Vec<Channel>) -> Self {
        RoundRobin {
            served: channels.iter().map(|_| AtomicUsize::new(0)).collect(),
            channels,
            next: AtomicUsize::new(0),
            retries: AtomicUsize::new(0),
            broken: AtomicUsize::new(0),
        }
    }

    async fn evaluate(&self, i: usize) -> Ended {
        let started = Instant::now();
        let first = self.next.fetch_add(1, Ordering::Relaxed);
        let mut last = String::new();
        for attempt in 0..ATTEMPTS {
            let replica = (first + attempt) % self.channels.len();
            let left = DEADLINE.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(format!("out of time after {attempt} attempt(s): {last}"));
            }
            let mut client =
                pb::evaluator_client::EvaluatorClient::new(self.channels[replica].clone());
            let mut req = tonic::Request::new(trace_request(i));
            req.set_timeout(left);
            match client.evaluate(req).await {
                Ok(_) => {
                    self.served[replica].fetch_add(1, Ordering::Relaxed);
                    return Ok(());
                }
                Err(s) if retryable(&s) => {
                    let counter = match s.code() {
                        Code::Unknown | Code::Cancelled => &self.broken,
                        _ => &self.retries,
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                    last = format!("{:?}: {}", s.code(), s.message());
                }
                Err(s) => return Err(format!("{:?}: {}", s.code(), s.message())),
            }
        }
        Err(last)
    }

    fn served(&self) -> Vec<usize> {
        self.served
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .collect()
    }
}

/// Worth another replica: UNAVAILABLE (refused, not ready, draining), RESOURCE_EXHAUSTED, and a
/// request in flight on a connection that broke, which tonic's client reports as UNKNOWN with
/// the local error as its source: "transport error", or "h2 protocol error: error reading a
/// body from connection" when the kill lands mid-body; or CANCELLED "operation was canceled"
/// when hyper drops the request with the connection (grpc-core, under the Python client, says
/// UNAVAILABLE). An UNKNOWN the server sent carries no source and is not retried.
fn retryable(s: &tonic::Status) -> bool {
    match s.code() {
        Code::Unavailable | Code::ResourceExhausted => true,
        Code::Unknown => std::error::Error::source(s).is_some(),
        // Nothing here cancels a call, so a CANCELLED is the dead connection's; scoring is
        // idempotent, so another replica may take it.
        Code::Cancelled => true,
        _ => false,
    }
}

/// A 6-step trace (about 300 tokens on the tiny model).
fn trace_request(i: usize) -> pb::EvaluateRequest {
    let steps: Vec<String> = (0..6)
        .map(|s| format!("Step {s}: 3*4 = 12, and 12 + 2 = 14 ({i})."))
        .collect();
    let steps: Vec<&str> = steps.iter().map(String::as_str).collect();
    request(&format!("r{i}"), "", steps_trace("What is 2+3*4?", &steps))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_replicas_lose_nothing_when_one_is_killed() {
    let started = Instant::now();
    let cfg = tiny_prm_config("replicas", "max_in_flight = 16");
    let args = ["--config".as_ref(), cfg.as_os_str()];
    let env = [("RETRACE_LOG", "warn")];
    let (a, b, c) = tokio::join!(
        spawn_retrace(&args, &env),
        spawn_retrace(&args, &env),
        spawn_retrace(&args, &env)
    );
    let mut children = vec![a.0, b.0, c.0];
    let rr = Arc::new(RoundRobin::new(vec![a.1, b.1, c.1]));
    let ready = started.elapsed();

    // Callers take request numbers from one counter; the one that takes KILL_AFTER kills
    // replica 1 while the others' requests are in flight on it.
    let ticket = Arc::new(AtomicUsize::new(0));
    let victim = Arc::new(Mutex::new(Some(children.remove(1))));
    let before_kill = Arc::new(Mutex::new(Vec::new()));
    let run_started = Instant::now();
    let callers: Vec<_> = (0..CALLERS)
        .map(|_| {
            let (rr, ticket, victim) = (rr.clone(), ticket.clone(), victim.clone());
            let before_kill = before_kill.clone();
            tokio::spawn(async move {
                let mut ended = Vec::new();
                loop {
                    let i = ticket.fetch_add(1, Ordering::Relaxed);
                    if i >= REQUESTS {
                        return ended;
                    }
                    if i == KILL_AFTER {
                        let mut child = victim.lock().await.take().expect("killed once");
                        child.0.kill().expect("SIGKILL"); // std's kill is SIGKILL
                        child.0.wait().unwrap();
                        *before_kill.lock().await = rr.served();
                    }
                    ended.push(rr.evaluate(i).await);
                }
            })
        })
        .collect();
    let mut failed = Vec::new();
    let mut ok = 0;
    for caller in callers {
        for e in caller.await.unwrap() {
            match e {
                Ok(()) => ok += 1,
                Err(status) => failed.push(status),
            }
        }
    }
    let wall = run_started.elapsed();
    let served = rr.served();
    let before = before_kill.lock().await.clone();
    let retries = rr.retries.load(Ordering::Relaxed);
    let broken = rr.broken.load(Ordering::Relaxed);

    println!(
        "\n| three replicas, replica 1 SIGKILLed after {KILL_AFTER} of {REQUESTS} requests ({CALLERS} callers) | |"
    );
    println!("|---|---:|");
    println!(
        "| requests / OK / failed | {REQUESTS} / {ok} / {} |",
        failed.len()
    );
    println!(
        "| served by replica 0 / 1 / 2 before the kill | {} / {} / {} |",
        before[0], before[1], before[2]
    );
    println!(
        "| served by replica 0 / 1 / 2 in all | {} / {} / {} |",
        served[0], served[1], served[2]
    );
    println!(
        "| retries on to the next replica: UNAVAILABLE / in flight on the killed connection | {retries} / {broken} |"
    );
    println!(
        "| wall time (3 replicas SERVING after) | {:.1} s ({:.1} s) |",
        wall.as_secs_f64(),
        ready.as_secs_f64()
    );
    println!(
        "| throughput | {:.1} req/s |\n",
        REQUESTS as f64 / wall.as_secs_f64()
    );

    assert!(failed.is_empty(), "lost requests: {failed:?}");
    assert_eq!(ok, REQUESTS);
    assert!(before.iter().all(|&n| n > 0), "before the kill: {before:?}");
    assert!(retries > 0, "the kill was never noticed");
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "{:?}",
        started.elapsed()
    );
    drop(children);
}
