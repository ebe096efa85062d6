//! Overload on a real model: SmolLM2-135M in f32 (`chat-lm`, fetched by `scripts/fetch-smollm2.sh
//! --f32`) offered twice what it sustains, with 2 s deadlines. Admission refuses at once what
//! could not finish in time, by the work queued ahead (trace bytes) and the evaluator's measured
//! pace, so goodput stays near capacity, admitted requests finish in time, and refusals and
//! health answers stay fast while the model saturates the cores. Once with traces of one kind,
//! once with traces mixed 10:1 in length, which a count of requests in flight cannot tell apart;
//! first one request at a time (`max_concurrency = 1`), then batching (`BATCHING`), where a
//! request shares its batch with those that follow it and admission must count them too.
//!
//! In its own test binary so that nothing else runs beside it: its figures are the machine's.
//! `RETRACE_SOAK_S` sets the seconds of overload (default 60, as the targets are set for);
//! docs/operating.md shows a run.
// A test crate's helpers are `pub` for its modules, not an API: nothing outside reaches them.
#![allow(unreachable_pub)]

#[path = "common/mod.rs"]
mod common;

use common::load::{self, Tally, Workload, ms_quantile, quantiles};
use common::*;
use retrace::pb;
use serde::Deserialize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// Each request's deadline under overload.
const DEADLINE: Duration = Duration::from_secs(2);
/// The deadline while capacity is measured: long enough that nothing is refused for it.
const PATIENT: Duration = Duration::from_secs(60);
/// More than fits in 2 s, so that the deadline, not this count, is what refuses.
const MAX_IN_FLIGHT: usize = 32;

#[derive(Deserialize, Clone)]
struct Sample {
    problem: String,
    steps: Vec<String>,
}

/// The committed ProcessBench gsm8k traces of 4 to 10 steps (up to 1.8 KB).
fn traces() -> Vec<Sample> {
    let text = std::fs::read_to_string(processbench("gsm8k")).unwrap();
    let all: Vec<Sample> = serde_json::from_str(&text).unwrap();
    all.into_iter()
        .filter(|s| (4..=10).contains(&s.steps.len()))
        .collect()
}

/// Request `i` of `sample`, its question opened by `i` so that no two requests share more than
/// the chat template's opening: the prefix cache saves a request nothing another computed. It
/// names the chat-lm evaluator: the embedded default's default is its trained head.
fn request_of(i: usize, question: &str, steps: &[&str]) -> pb::EvaluateRequest {
    request(
        &format!("r{i}"),
        "smollm2",
        steps_trace(&format!("({i}) {question}"), steps),
    )
}

/// `text`'s first `bytes` bytes, cut at a character boundary.
fn cut(text: &str, bytes: usize) -> &str {
    let end = (0..=bytes.min(text.len()))
        .rev()
        .find(|&e| text.is_char_boundary(e))
        .unwrap_or(0);
    &text[..end]
}

/// The gsm8k traces, in turn.
fn uniform(samples: Arc<Vec<Sample>>) -> Workload {
    Arc::new(move |i| {
        let s = &samples[i % samples.len()];
        let steps: Vec<&str> = s.steps.iter().map(String::as_str).collect();
        request_of(i, &s.problem, &steps)
    })
}

/// Every other request a tenth as long: the question and one step, each cut to a twentieth of
/// the whole trace's bytes.
fn mixed(samples: Arc<Vec<Sample>>) -> Workload {
    let long = uniform(samples.clone());
    Arc::new(move |i| {
        if i % 2 == 0 {
            return long(i);
        }
        let s = &samples[i % samples.len()];
        let bytes = s.problem.len() + s.steps.iter().map(String::len).sum::<usize>();
        let step = cut(&s.steps[0], bytes / 20);
        request_of(i, cut(&s.problem, bytes / 20), &[step])
    })
}

/// Calls the gRPC health Check on its own connection every 50 ms until told to stop; returns
/// when each was sent and its latency.
fn watch_health(
    channel: Channel,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<(Instant, Duration)>> {
    tokio::spawn(async move {
        let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
        let mut latencies = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let started = Instant::now();
            let check = tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            };
            let status = health.check(check).await.unwrap().into_inner().status;
            latencies.push((started, started.elapsed()));
            assert_eq!(status, 1, "SERVING under load");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        latencies
    })
}

/// What one workload's run measured.
struct Run {
    capacity: f64,
    offered: f64,
    load: Tally,
    elapsed: Duration,
    /// When the overload began.
    began: Instant,
    /// When each health Check was sent, and its latency.
    checks: Vec<(Instant, Duration)>,
    health: Vec<Duration>,
}

impl Run {
    fn goodput(&self) -> f64 {
        self.load.ok as f64 / self.elapsed.as_secs_f64()
    }

    /// Admitted requests that missed their deadline, of all admitted.
    fn late_share(&self) -> f64 {
        self.load.deadline as f64 / self.load.admitted.len().max(1) as f64
    }

    /// Each slow refusal: when it was sent, its latency and message, and the health Checks sent
    /// within a second of it, so a failure tells a stall of the whole machine or process (the
    /// Checks late too) from a slow refusal path.
    fn slow_refusals(&self) -> String {
        let at = |t: Instant| t.duration_since(self.began).as_secs_f64();
        let mut out = String::new();
        for (sent, latency, message) in &self.load.slow_refusals {
            let near: Vec<String> = self
                .checks
                .iter()
                .filter(|(c, _)| (at(*c) - at(*sent)).abs() <= 1.0)
                .map(|(c, l)| format!("+{:.2} s: {:.0} ms", at(*c), l.as_secs_f64() * 1e3))
                .collect();
            out.push_str(&format!(
                "\n  sent at +{:.2} s, {:.0} ms: {message}; health Checks near it: {}",
                at(*sent),
                latency.as_secs_f64() * 1e3,
                near.join(", ")
            ));
        }
        out
    }

    fn table(&self, name: &str, load_s: f64) -> String {
        let l = &self.load;
        format!(
            "\n| SmolLM2-135M f32, {name}: {load_s:.0} s at 2x, {} s deadlines | |\n|---|---:|\n\
             | capacity (closed loop, 4 callers) | {:.2} req/s |\n\
             | offered (open loop) | {:.2} req/s, {} requests |\n\
             | OK / refused / late / other / unanswered | {} / {} / {} / {} / {} |\n\
             | goodput | {:.2} req/s, {:.0}% of capacity |\n\
             | admitted requests late | {:.1}% |\n\
             | admitted latency p50 / p99 / max | {} ms |\n\
             | refusal latency p50 / p99 / max | {} ms |\n\
             | health Check latency p50 / p99 / max | {} ms |",
            DEADLINE.as_secs(),
            self.capacity,
            self.offered,
            l.total(),
            l.ok,
            l.exhausted,
            l.deadline,
            l.other.len(),
            l.unanswered,
            self.goodput(),
            100.0 * self.goodput() / self.capacity,
            100.0 * self.late_share(),
            quantiles(&l.admitted),
            quantiles(&l.refused),
            quantiles(&self.health),
        )
    }
}

/// Measures what `make` sustains, then offers twice that for `load_s` with 2 s deadlines.
async fn overload(channel: &Channel, health: Channel, make: &Workload, load_s: f64) -> Run {
    let mut warm = Tally::default();
    load::closed_loop(channel, 2, 2.0, PATIENT, make, &mut warm).await;
    let capacity = load::closed_loop(channel, 4, 10.0, PATIENT, make, &mut warm).await;
    assert_eq!(warm.ok, warm.total(), "all answered while measuring");
    let offered = 2.0 * capacity;
    let stop = Arc::new(AtomicBool::new(false));
    let began = Instant::now();
    let watcher = watch_health(health, stop.clone());
    let (load, elapsed) =
        load::open_loop(channel, offered, load_s, DEADLINE, make, 10_000_000).await;
    stop.store(true, Ordering::Relaxed);
    let checks = watcher.await.unwrap();
    Run {
        capacity,
        offered,
        load,
        elapsed,
        began,
        health: checks.iter().map(|c| c.1).collect(),
        checks,
    }
}

/// Floors under the targets, for one workload: well inside what admission by count gave (22% of
/// capacity served, 68% of admitted requests late, refusals at 1.4 s p99), with room for a busy
/// machine. The targets themselves (80%, 1%, 50 ms) are figures this test prints and
/// docs/operating.md shows, not assertions: a timed assertion at the target fails whenever the
/// machine is slower than the one it was set on (79% goodput seen once in a full run, and 6.1%
/// of admitted requests late on the mixed workload under CI, where 4.0% was seen alone).
fn check(run: &Run) {
    let l = &run.load;
    assert_eq!(l.unanswered, 0, "requests with no answer");
    assert!(l.other.is_empty(), "unexpected codes: {:?}", l.other);
    assert!(l.exhausted > 0, "twice the capacity was all admitted");
    assert!(
        run.goodput() >= 0.6 * run.capacity,
        "goodput {:.2}/s against a capacity of {:.2}/s",
        run.goodput(),
        run.capacity
    );
    assert!(
        l.deadline <= (l.admitted.len() / 10).max(2),
        "{} of {} admitted requests late",
        l.deadline,
        l.admitted.len()
    );
    let refused_p99 = ms_quantile(&l.refused, 0.99);
    assert!(
        refused_p99 <= 100.0,
        "refusals p99 {refused_p99:.1} ms; the slow ones:{}",
        run.slow_refusals()
    );
    let health_p99 = ms_quantile(&run.health, 0.99);
    assert!(health_p99 <= 100.0, "health Check p99 {health_p99:.1} ms");
}

/// A batching concurrency: enough that the model thread gathers several requests a batch.
const BATCHING: usize = 16;

/// One test, run in turn at each concurrency: two at once would share the cores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_model_refuses_at_once_what_would_miss_its_deadline() {
    let load_s: f64 = retrace::Env::process()
        .secret("RETRACE_SOAK_S")
        .and_then(|v| v.parse().ok())
        .unwrap_or(60.0);
    let samples = Arc::new(traces());
    saturate(
        1,
        &[
            ("gsm8k traces", uniform(samples.clone())),
            ("mixed 10:1 in length", mixed(samples.clone())),
        ],
        load_s,
    )
    .await;
    saturate(
        BATCHING,
        &[("mixed 10:1 in length", mixed(samples.clone()))],
        load_s,
    )
    .await;
}

/// A server of SmolLM2 at `max_concurrency`, overloaded with each workload in turn; checks each
/// run, and that every refusal was the deadline's.
async fn saturate(max_concurrency: usize, workloads: &[(&str, Workload)], load_s: f64) {
    let model = retrace::Env::process().cache_dir().join("smollm2");
    assert!(
        model.join("model.safetensors").is_file(),
        "{} is missing: run scripts/fetch-smollm2.sh --f32",
        model.display()
    );
    let sets = [
        format!("evaluator.smollm2.model={}", model.display()),
        format!("evaluator.smollm2.max_concurrency={max_concurrency}"),
    ];
    let max_in_flight = MAX_IN_FLIGHT.to_string();
    let mut args: Vec<&std::ffi::OsStr> = vec!["--max-in-flight".as_ref(), max_in_flight.as_ref()];
    for s in &sets {
        args.extend::<[&std::ffi::OsStr; 2]>(["--set".as_ref(), s.as_ref()]);
    }
    let port = free_port();
    let (_server, channel, metrics) =
        spawn_retrace_on(port, &args, &[("RETRACE_LOG", "warn")]).await;
    // Health is asked on a connection of its own, as a load balancer's probe would.
    let health = Channel::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut runs = Vec::new();
    for (name, make) in workloads {
        let run = overload(&channel, health.clone(), make, load_s).await;
        let name = format!("{name}, max_concurrency {max_concurrency}");
        eprintln!("{}", run.table(&name, load_s));
        runs.push(run);
    }
    for run in &runs {
        check(run);
    }
    // Every refusal was the deadline's (max_in_flight was never reached), as the server counts.
    let by_deadline = sample(
        &scrape(metrics).await,
        "retrace_dropped_total",
        &[("reason", "would_miss_deadline")],
    );
    let refused: usize = runs.iter().map(|r| r.load.exhausted).sum();
    assert_eq!(by_deadline, Some(refused as f64));
}
