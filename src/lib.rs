//! # retrace
//!
//! A gRPC service that judges reasoning traces step by step: the first wrong step, the error's
//! category and a score per step, from process reward models run in-process on candle and from
//! LLM judges behind an OpenAI-compatible endpoint.
//!
//! # Layout
//! The server library; beside it, `crates/retrace-model` (the pure candle model) and
//! `crates/retrace-cli` (the `retrace` binary and its tools). From the top of the import graph
//! down, with no cycle and no arrow upward:
//! - `api/`: the tonic service and the HTTP/JSON edge (`api/http/`: the trainers' reward routes,
//!   OpenRLHF's `/get_reward` and slime's `/slime/reward`, proto3 JSON at `/v1/...`); proto <-> domain at the edge (`convert.rs`); the one error ->
//!   status table (`status.rs`); the codec and the layer that answer a request tonic can't read
//!   as bad input.
//! - `config/`: the file, `--set` and typed flags -> one validated `Config`. It owns no kind's
//!   keys: it composes the kinds' own structs and dispatches on `kind`, and checks the rules that
//!   span tables (a cascade naming others).
//! - `cascade/`: a PRM, then its judge when unsure; its `CascadeConfig`. Unsure is a margin, or
//!   a confidence under a threshold chosen on calibration rows to guarantee an agreement with
//!   the judge (`guarantee.rs`, pure; `guard.rs`, the rows scored and the choice kept).
//! - `record.rs`: a judge's or cascade's verdicts written as dataset rows, off the request path.
//! - `composite.rs`: a step evaluator and an outcome reward model on one trace at once; its
//!   `CompositeConfig`.
//! - `prm/`: PRMs as evaluators: `config.rs` (its keys; a vLLM server's in `[evaluator.vllm]`),
//!   formats per family (`format.rs`, the conversation families' turns in `format/turns.rs`
//!   and each step's own tokens in `spans.rs`; `template.rs`), the batcher thread driving a `Scorer`
//!   (`batcher.rs`), the candle model as one scorer (`candle.rs`); `remote.rs`, the same formats
//!   scored by a vLLM server: an evaluator of its own rather than a scorer under the batcher,
//!   because vLLM batches continuously and wants many requests in flight, which the batcher's
//!   one-batch-at-a-time thread would forbid (deadlines, cancellation and the breaker are the
//!   upstream caller's).
//! - `judge/`: its keys (`config.rs`), prompt templates, the reply parser and vote, the
//!   chat-completions body and reply, and the response cache.
//! - `engine/`: the `Evaluator` trait, the registry, admission (by count, and by each evaluator's
//!   measured pace against the request's deadline: `pace.rs`), per-evaluator slots (`slot.rs`:
//!   the gate on every caller's path to an evaluator, a cascade's included), deadlines, readiness
//!   watches. It knows evaluators by `SlotSpec`, not by config, and names fields by where each
//!   trace sits (`Origin`).
//! - `upstream/`: the one reliable HTTP upstream judges and vLLM PRMs call through, and the keys
//!   both spell the same way (`config.rs`): capped bodies, retries with backoff, the breaker, rate
//!   and concurrency limits, metrics.
//! - `health.rs`: grpc.health.v1 for the server, the Evaluator service and each evaluator.
//! - Leaves: `dataset/` (labelled traces read from ProcessBench JSON and JSONL rows, one bad
//!   row named by file and line: the tools' input and a cascade's calibration rows; and a
//!   verdict written as a row's fields, by `record` and `retrace label` alike),
//!   `trace.rs` (domain types), `segment.rs` (raw text -> steps), `field.rs` (typed field
//!   paths), `env.rs` (the one reader of the process environment, as a value), `rule.rs` (what a
//!   config rule says when it refuses), `metrics.rs` (every metric name once), `priority.rs` (the
//!   model's threads below the runtime's).
//! - `fuzzing` (hidden): the private parsers opened to `fuzz/` and `tests/it/fuzz_props/`.
//!
//! Every module is private: the crate root re-exports the face the tools, the tests and the fuzz
//! targets use (the trace types, configs, the engine and its `Evaluator` seam, the PRM scorer and
//! formats, the feature extractor, the gRPC messages as `pb`), and nothing else.
//!
//! A request takes three hops: api -> engine -> evaluator. `run` is the whole server; `serve`
//! (`server.rs`) wires its pieces: the metrics listener, the gRPC router, the HTTP router,
//! health, and the drain on shutdown; `signal.rs` turns the process's signals into a stop and
//! SIGHUP's reload of every PRM.

// No unsafe code of the server's own: the model crate holds the documented blocks.
#![forbid(unsafe_code)]

mod api;
mod cascade;
mod composite;
mod config;
mod dataset;
mod engine;
mod env;
mod field;
mod health;
mod judge;
mod metrics;
mod priority;
mod prm;
mod record;
mod rule;
mod segment;
mod server;
mod signal;
mod trace;
mod upstream;

// The library's face: exactly what the tools, the tests and the fuzz targets name. Everything
// else is the server's own, so `unreachable_pub` and dead-code lints see all of it.
pub use api::{TraceParts, category_from_pb, pb, to_status};
pub use cascade::CascadeConfig;
pub use composite::CompositeConfig;
pub use config::{
    Config, ConfigError, EvaluatorConfig, KindConfig, ServerConfig, ServerFlags, install_head,
};
pub use dataset::{
    DataError, Purpose, Record, Records, VerdictFields, check_files, count_records, read_records,
    records_from_bytes,
};
pub use engine::{
    Description, Engine, EngineError, Evaluator, EvaluatorLoadError, Job, Limit, LoadFailure,
    NotLoaded, Origin, Reloaded, Request,
};
pub use env::{Env, Secret};
pub use field::FieldPath;
pub use health::evaluator_service;
pub use judge::JudgeConfig;
pub use metrics::{
    Activity, BATCH_SIZE, PREFIX_TOKENS, REQUEST_DURATION, STAGE_DURATION, activity,
    install as install_metrics,
};
pub use prm::features::{ExtractError, Extractor, TraceFeatures};
pub use prm::format::{
    CHAT_LM_INSTRUCTION, Encoded, Family, FormatError, Formatter, LoadError, PrmKind,
    TemplateError, TokenizeError, question_text,
};
pub use prm::head::{
    DataFile as HeadDataFile, HEAD_VERSION, HeadConfig, HeadKind, LabelCounts,
    Layers as HeadLayers, Pool, References,
};
pub use prm::{
    Backend, BatchError, CandleConfig, DeviceSpec, Dtype, Limits, PrmConfig, PrmError,
    PrmEvaluator, PrmLoadError, ScoreError, Scorer, VllmConfig, resolve_model,
};
pub use record::RecordConfig;
pub use segment::segment;
pub use trace::{ErrorCategory, Judgement, Step, Trace, UNLOCATED, Verdict};
pub use upstream::{SetupError, UpstreamConfig, http_client};

/// How a guaranteed cascade chooses its confidence threshold, for `retrace calibrate` to measure
/// the same choice offline.
pub mod guarantee {
    pub use crate::cascade::{
        AgreementTarget, CalibrationItem, Confidence, GuaranteedThreshold, choose,
    };
}

/// The PRM defaults a tool shows as its own (`retrace bench`'s cache size).
pub mod defaults {
    pub use crate::prm::defaults::PREFIX_CACHE_MB;
}

#[doc(hidden)]
pub mod fuzzing {
    //! Pure parsers the product keeps private, opened for the fuzz targets in `fuzz/` and the
    //! property tests in `tests/it/fuzz_props/`; not an API.
    pub use crate::api::convert::{EvaluateInput, RankInput, parse_evaluate, parse_rank};
    pub use crate::judge::output::{OutputMode, refuses_constraint, repair_prompt};
    pub use crate::judge::parse::{ParseError, Parsed, Vote, parse_json_reply, parse_reply, vote};
    pub use crate::segment::segment;
}

use std::future::Future;

pub use server::{
    EvaluatorLoader, Listeners, ServeError, default_loader, load_engine, new_engine, serve,
};
pub use signal::shutdown_signal;

/// Serves `config` on `listeners` until `shutdown` resolves, then drains within the grace period.
pub async fn run(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    serve(config, default_loader(), listeners, shutdown).await
}
