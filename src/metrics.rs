//! Every metric name once, their descriptions and buckets, the recorder, and record_* helpers.

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

mod learning;
mod reward;
mod upstream;
pub(crate) use learning::{
    Audited, audits_at_zero, record_audit, record_cascade, record_recalibration, record_recorded,
    record_reload, recorded_at_zero, set_audited, set_guarantee, set_head,
};
#[cfg(test)]
pub(crate) use reward::{REWARD_ROUTES, REWARD_STATUSES};
pub(crate) use reward::{record_reward_sample, reward_samples_at_zero};
pub(crate) use upstream::{JUDGE_UPSTREAM, PRM_UPSTREAM, UpstreamMetrics};

pub(crate) const REQUESTS: &str = "retrace_requests_total";
pub const REQUEST_DURATION: &str = "retrace_request_duration_seconds";
pub const STAGE_DURATION: &str = "retrace_stage_duration_seconds";
pub(crate) const IN_FLIGHT: &str = "retrace_in_flight_requests";
pub(crate) const MAX_IN_FLIGHT: &str = "retrace_max_in_flight";
pub(crate) const QUEUE_DEPTH: &str = "retrace_queue_depth";
pub(crate) const PACE: &str = "retrace_evaluator_pace_bytes_per_second";
pub(crate) const EVALUATOR_READY: &str = "retrace_evaluator_ready";
pub(crate) const STEPS_SCORED: &str = "retrace_steps_scored_total";
pub const BATCH_SIZE: &str = "retrace_batch_size";
pub(crate) const BATCH_TOKENS: &str = "retrace_batch_tokens";
pub(crate) const TOKENS_SCORED: &str = "retrace_tokens_scored_total";
pub(crate) const MODEL_LOAD: &str = "retrace_model_load_seconds";
pub const PREFIX_TOKENS: &str = "retrace_prefix_tokens_total";
pub(crate) const PREFIX_CACHE_BYTES: &str = "retrace_prefix_cache_bytes";
pub(crate) const PREFIX_CACHE_EVICTIONS: &str = "retrace_prefix_cache_evictions_total";
pub(crate) const DROPPED: &str = "retrace_dropped_total";
pub(crate) const REWARD_SAMPLES: &str = "retrace_reward_samples_total";
pub(crate) const UNAUTHENTICATED: &str = "retrace_unauthenticated_total";
pub(crate) const JUDGE_REQUESTS: &str = "retrace_judge_requests_total";
pub(crate) const JUDGE_REQUEST_DURATION: &str = "retrace_judge_request_duration_seconds";
pub(crate) const JUDGE_IN_FLIGHT: &str = "retrace_judge_in_flight_requests";
pub(crate) const JUDGE_RETRIES: &str = "retrace_judge_retries_total";
pub(crate) const JUDGE_TOKENS: &str = "retrace_judge_tokens_total";
pub(crate) const JUDGE_CACHE: &str = "retrace_judge_cache_total";
pub(crate) const JUDGE_REPAIRS: &str = "retrace_judge_repairs_total";
pub(crate) const JUDGE_SCHEMA_IGNORED: &str = "retrace_judge_schema_ignored_total";
pub(crate) const JUDGE_DISAGREEMENT: &str = "retrace_judge_vote_disagreements_total";
pub(crate) const JUDGE_BREAKER_OPENED: &str = "retrace_judge_breaker_opened_total";
pub(crate) const JUDGE_BREAKER_STATE: &str = "retrace_judge_breaker_state";
pub(crate) const JUDGE_CACHE_BYTES: &str = "retrace_judge_cache_bytes";
pub(crate) const JUDGE_CACHE_ENTRIES: &str = "retrace_judge_cache_entries";
pub(crate) const PRM_UPSTREAM_REQUESTS: &str = "retrace_prm_upstream_requests_total";
pub(crate) const PRM_UPSTREAM_DURATION: &str = "retrace_prm_upstream_request_duration_seconds";
pub(crate) const PRM_UPSTREAM_IN_FLIGHT: &str = "retrace_prm_upstream_in_flight_requests";
pub(crate) const PRM_UPSTREAM_RETRIES: &str = "retrace_prm_upstream_retries_total";
pub(crate) const PRM_UPSTREAM_BREAKER_OPENED: &str = "retrace_prm_upstream_breaker_opened_total";
pub(crate) const PRM_UPSTREAM_BREAKER_STATE: &str = "retrace_prm_upstream_breaker_state";
pub(crate) const PRM_UPSTREAM_INEXACT: &str = "retrace_prm_upstream_inexact_scores_total";

const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const BATCH_SIZE_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0];
const BATCH_TOKENS_BUCKETS: &[f64] = &[
    64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0, 65536.0,
];

/// Pipeline stages timed by `STAGE_DURATION`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Stage {
    Queue,
    Tokenize,
    Inference,
    Judge,
}

impl Stage {
    fn as_str(self) -> &'static str {
        match self {
            Stage::Queue => "queue",
            Stage::Tokenize => "tokenize",
            Stage::Inference => "inference",
            Stage::Judge => "judge",
        }
    }
}

/// Installs the process-wide recorder once and returns its handle; later calls share it.
pub fn install() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
                .and_then(|b| {
                    b.set_buckets_for_metric(Matcher::Full(BATCH_SIZE.into()), BATCH_SIZE_BUCKETS)
                })
                .and_then(|b| {
                    b.set_buckets_for_metric(
                        Matcher::Full(BATCH_TOKENS.into()),
                        BATCH_TOKENS_BUCKETS,
                    )
                })
                .expect("bucket lists are non-empty literals");
            let recorder = builder.build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics will be empty");
            }
            describe();
            // Histogram upkeep: the HTTP listener feature would do this itself; we serve /metrics
            // on our own listener so tests can bind port 0.
            let upkeep = handle.clone();
            std::thread::Builder::new()
                .name("metrics-upkeep".into())
                .spawn(move || {
                    loop {
                        std::thread::sleep(Duration::from_secs(5));
                        upkeep.run_upkeep();
                    }
                })
                .expect("spawning a thread");
            handle
        })
        .clone()
}

/// What kind of metric a name is, for its description.
#[derive(Clone, Copy)]
enum Kind {
    Counter,
    Gauge,
    GaugeSeconds,
    Histogram,
    HistogramSeconds,
}

/// Every metric's help text, written once.
const HELP: &[(Kind, &str, &str)] = &[
    (
        Kind::Counter,
        REQUESTS,
        "Requests answered, by rpc, evaluator and outcome (a gRPC code name).",
    ),
    (
        Kind::HistogramSeconds,
        REQUEST_DURATION,
        "Request latency by rpc and evaluator.",
    ),
    (
        Kind::HistogramSeconds,
        STAGE_DURATION,
        "Time per pipeline stage (queue, tokenize, inference, judge), by evaluator.",
    ),
    (
        Kind::Gauge,
        IN_FLIGHT,
        "Requests admitted and not yet answered.",
    ),
    (
        Kind::Gauge,
        MAX_IN_FLIGHT,
        "The server's max_in_flight: requests admitted at once before RESOURCE_EXHAUSTED.",
    ),
    (
        Kind::Gauge,
        QUEUE_DEPTH,
        "Requests admitted and waiting for their evaluator, by evaluator.",
    ),
    (
        Kind::Gauge,
        PACE,
        "Trace bytes the evaluator answers per busy second, as admission measures it to refuse work that would miss its deadline.",
    ),
    (
        Kind::Gauge,
        EVALUATOR_READY,
        "1 when the evaluator is loaded and answering.",
    ),
    (Kind::Counter, STEPS_SCORED, "Steps scored, by evaluator."),
    (
        Kind::Counter,
        PREFIX_TOKENS,
        "Tokens of scored traces, by evaluator and whether they were computed or reused (from the prefix cache, or computed once for rows of a batch that share them).",
    ),
    (
        Kind::Gauge,
        PREFIX_CACHE_BYTES,
        "Bytes the prefix cache holds, by evaluator.",
    ),
    (
        Kind::Counter,
        PREFIX_CACHE_EVICTIONS,
        "Prefix-cache entries evicted since start, by evaluator.",
    ),
    (
        Kind::Histogram,
        BATCH_SIZE,
        "Traces per model batch, by evaluator.",
    ),
    (
        Kind::Histogram,
        BATCH_TOKENS,
        "Tokens per model batch (packed, so all real), by evaluator.",
    ),
    (
        Kind::Counter,
        TOKENS_SCORED,
        "Real (unpadded) tokens run through the model, by evaluator.",
    ),
    (
        Kind::GaugeSeconds,
        MODEL_LOAD,
        "How long loading the evaluator's model took.",
    ),
    (
        Kind::Counter,
        UNAUTHENTICATED,
        "Requests refused for a missing or invalid bearer token.",
    ),
    (
        Kind::Counter,
        JUDGE_REQUESTS,
        "Judge outcomes, by judge and outcome: replies read (ok, parse_error), failed upstream \
         exchanges (http_4xx, http_5xx, timeout, connect_error, bad_response), refusals by the \
         breaker (circuit_open).",
    ),
    (
        Kind::HistogramSeconds,
        JUDGE_REQUEST_DURATION,
        "Latency of one upstream judge exchange, by judge.",
    ),
    (
        Kind::Gauge,
        JUDGE_IN_FLIGHT,
        "Upstream judge exchanges open now, by judge.",
    ),
    (
        Kind::Counter,
        JUDGE_RETRIES,
        "Upstream judge exchanges retried, by judge and the outcome that caused the retry.",
    ),
    (
        Kind::Counter,
        JUDGE_TOKENS,
        "Tokens the upstream judge reported, by judge and kind (prompt, completion).",
    ),
    (
        Kind::Counter,
        JUDGE_CACHE,
        "Temperature-0 response cache lookups, by judge and result (hit, miss).",
    ),
    (
        Kind::Counter,
        JUDGE_REPAIRS,
        "Repair turns sent after an unreadable reply, by judge and result (repaired, failed).",
    ),
    (
        Kind::Counter,
        JUDGE_SCHEMA_IGNORED,
        "Replies asked for under a JSON schema that came back as text (the upstream ignored \
         response_format) and were read as text, by judge.",
    ),
    (
        Kind::Counter,
        JUDGE_DISAGREEMENT,
        "Votes whose samples did not all name the same step, by judge.",
    ),
    (
        Kind::Counter,
        JUDGE_BREAKER_OPENED,
        "Times the judge's circuit breaker opened, by judge.",
    ),
    (
        Kind::Gauge,
        JUDGE_BREAKER_STATE,
        "The judge's circuit breaker now, by judge: 0 closed, 1 half-open (a probe is out), 2 open.",
    ),
    (
        Kind::Gauge,
        JUDGE_CACHE_BYTES,
        "Bytes (keys plus replies' text) the judge's temperature-0 response cache holds, by judge.",
    ),
    (
        Kind::Gauge,
        JUDGE_CACHE_ENTRIES,
        "Replies the judge's temperature-0 response cache holds, by judge.",
    ),
    (
        Kind::Counter,
        PRM_UPSTREAM_REQUESTS,
        "Remote PRM outcomes, by evaluator and outcome: replies read (ok), failed upstream \
         exchanges (http_4xx, http_5xx, timeout, connect_error, bad_response), refusals by the \
         breaker (circuit_open).",
    ),
    (
        Kind::HistogramSeconds,
        PRM_UPSTREAM_DURATION,
        "Latency of one exchange with a remote PRM's server, by evaluator.",
    ),
    (
        Kind::Gauge,
        PRM_UPSTREAM_IN_FLIGHT,
        "Exchanges with a remote PRM's server open now, by evaluator.",
    ),
    (
        Kind::Counter,
        PRM_UPSTREAM_RETRIES,
        "Exchanges with a remote PRM's server retried, by evaluator and the outcome that caused it.",
    ),
    (
        Kind::Counter,
        PRM_UPSTREAM_BREAKER_OPENED,
        "Times a remote PRM's circuit breaker opened, by evaluator.",
    ),
    (
        Kind::Gauge,
        PRM_UPSTREAM_BREAKER_STATE,
        "A remote PRM's circuit breaker now, by evaluator: 0 closed, 1 half-open, 2 open.",
    ),
    (
        Kind::Counter,
        PRM_UPSTREAM_INEXACT,
        "Steps of a causal-LM PRM on vLLM whose + or - token fell outside the top log-probabilities \
         returned (scored with the smallest listed one as its bound), by evaluator.",
    ),
    (
        Kind::Counter,
        DROPPED,
        "Requests dropped before reaching the model, by evaluator and reason (cancelled, deadline, would_miss_deadline: refused at admission).",
    ),
    (
        Kind::Counter,
        REWARD_SAMPLES,
        "Reward-route samples answered, by route, evaluator and status (ok, or a stand-in's).",
    ),
];

fn describe() {
    learning::describe();
    for &(kind, name, help) in HELP {
        match kind {
            Kind::Counter => describe_counter!(name, help),
            Kind::Gauge => describe_gauge!(name, help),
            Kind::GaugeSeconds => describe_gauge!(name, metrics::Unit::Seconds, help),
            Kind::Histogram => describe_histogram!(name, help),
            Kind::HistogramSeconds => describe_histogram!(name, metrics::Unit::Seconds, help),
        }
    }
}

pub(crate) fn record_request(
    rpc: &'static str,
    evaluator: &str,
    outcome: &'static str,
    elapsed: Duration,
) {
    let evaluator = evaluator.to_string();
    counter!(REQUESTS, "rpc" => rpc, "evaluator" => evaluator.clone(), "outcome" => outcome)
        .increment(1);
    histogram!(REQUEST_DURATION, "rpc" => rpc, "evaluator" => evaluator)
        .record(elapsed.as_secs_f64());
    ACTIVITY_FINISHED.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn record_stage(evaluator: &str, stage: Stage, elapsed: Duration) {
    histogram!(STAGE_DURATION, "evaluator" => evaluator.to_string(), "stage" => stage.as_str())
        .record(elapsed.as_secs_f64());
}

pub(crate) fn in_flight(delta: f64) {
    gauge!(IN_FLIGHT).increment(delta);
    // Request counts are whole numbers; the f64 is the gauge's type.
    ACTIVITY_IN_FLIGHT.fetch_add(delta as i64, Ordering::Relaxed);
}

static ACTIVITY_IN_FLIGHT: AtomicI64 = AtomicI64::new(0);
static ACTIVITY_FINISHED: AtomicU64 = AtomicU64::new(0);

/// What the server is doing, read back without the exporter: for the binary's idle work (its
/// allocator hands free memory back once requests stop; see src/alloc.rs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Activity {
    /// Requests admitted and not yet answered (`retrace_in_flight_requests`).
    pub in_flight: i64,
    /// Requests finished since start, any RPC or route and any outcome.
    pub finished: u64,
}

pub fn activity() -> Activity {
    Activity {
        in_flight: ACTIVITY_IN_FLIGHT.load(Ordering::Relaxed),
        finished: ACTIVITY_FINISHED.load(Ordering::Relaxed),
    }
}

pub(crate) fn set_max_in_flight(max: usize) {
    gauge!(MAX_IN_FLIGHT).set(max as f64);
}

pub(crate) fn queue_depth(evaluator: &str, delta: f64) {
    gauge!(QUEUE_DEPTH, "evaluator" => evaluator.to_string()).increment(delta);
}

pub(crate) fn set_pace(evaluator: &str, bytes_per_second: f64) {
    gauge!(PACE, "evaluator" => evaluator.to_string()).set(bytes_per_second);
}

pub(crate) fn set_ready(evaluator: &str, ready: bool) {
    gauge!(EVALUATOR_READY, "evaluator" => evaluator.to_string()).set(if ready {
        1.0
    } else {
        0.0
    });
}

pub(crate) fn record_steps(evaluator: &str, steps: usize) {
    counter!(STEPS_SCORED, "evaluator" => evaluator.to_string()).increment(steps as u64);
}

/// One forward pass: its traces and tokens (packed, so every token is real).
pub(crate) fn record_batch(evaluator: &str, traces: usize, tokens: usize) {
    let e = evaluator.to_string();
    histogram!(BATCH_SIZE, "evaluator" => e.clone()).record(traces as f64);
    histogram!(BATCH_TOKENS, "evaluator" => e.clone()).record(tokens as f64);
    counter!(TOKENS_SCORED, "evaluator" => e).increment(tokens as u64);
}

/// Tokens a batch computed and reused.
pub(crate) fn record_prefix_tokens(evaluator: &str, computed: usize, reused: usize) {
    let e = evaluator.to_string();
    counter!(PREFIX_TOKENS, "evaluator" => e.clone(), "kind" => "computed")
        .increment(computed as u64);
    counter!(PREFIX_TOKENS, "evaluator" => e, "kind" => "reused").increment(reused as u64);
}

/// The prefix cache's size and its evictions so far.
pub(crate) fn set_prefix_cache(evaluator: &str, bytes: usize, evictions: u64) {
    let e = evaluator.to_string();
    gauge!(PREFIX_CACHE_BYTES, "evaluator" => e.clone()).set(bytes as f64);
    counter!(PREFIX_CACHE_EVICTIONS, "evaluator" => e).absolute(evictions);
}

pub(crate) fn record_model_load(evaluator: &str, elapsed: Duration) {
    gauge!(MODEL_LOAD, "evaluator" => evaluator.to_string()).set(elapsed.as_secs_f64());
}

pub(crate) fn record_dropped(evaluator: &str, reason: &'static str) {
    counter!(DROPPED, "evaluator" => evaluator.to_string(), "reason" => reason).increment(1);
}

pub(crate) fn record_unauthenticated() {
    counter!(UNAUTHENTICATED).increment(1);
}

/// One judge outcome: a reply read, a failed exchange, or a refusal by the breaker.
pub(crate) fn record_judge_request(judge: &str, outcome: &'static str) {
    counter!(JUDGE_REQUESTS, "judge" => judge.to_string(), "outcome" => outcome).increment(1);
}

pub(crate) fn record_prm_inexact(evaluator: &str, steps: u64) {
    counter!(PRM_UPSTREAM_INEXACT, "evaluator" => evaluator.to_string()).increment(steps);
}

pub(crate) fn record_judge_tokens(judge: &str, prompt: u64, completion: u64) {
    let judge = judge.to_string();
    counter!(JUDGE_TOKENS, "judge" => judge.clone(), "kind" => "prompt").increment(prompt);
    counter!(JUDGE_TOKENS, "judge" => judge, "kind" => "completion").increment(completion);
}

pub(crate) fn record_judge_cache(judge: &str, hit: bool) {
    let result = if hit { "hit" } else { "miss" };
    counter!(JUDGE_CACHE, "judge" => judge.to_string(), "result" => result).increment(1);
}

/// What a judge's response cache holds now.
pub(crate) fn set_judge_cache(judge: &str, bytes: usize, entries: usize) {
    let judge = judge.to_string();
    gauge!(JUDGE_CACHE_BYTES, "judge" => judge.clone()).set(bytes as f64);
    gauge!(JUDGE_CACHE_ENTRIES, "judge" => judge).set(entries as f64);
}

/// `n` replies asked for under a JSON schema came back as text and were read as text.
pub(crate) fn record_judge_schema_ignored(judge: &str, n: u64) {
    counter!(JUDGE_SCHEMA_IGNORED, "judge" => judge.to_string()).increment(n);
}

pub(crate) fn record_judge_repair(judge: &str, repaired: bool) {
    let result = if repaired { "repaired" } else { "failed" };
    counter!(JUDGE_REPAIRS, "judge" => judge.to_string(), "result" => result).increment(1);
}

pub(crate) fn record_judge_disagreement(judge: &str) {
    counter!(JUDGE_DISAGREEMENT, "judge" => judge.to_string()).increment(1);
}
