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
//! - Leaves: `dataset.rs` (labelled traces read from ProcessBench JSON and JSONL rows, one bad
//!   row named by file and line: the tools' input and a cascade's calibration rows),
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
//! wires its pieces: the metrics listener, the gRPC router, the HTTP router, health, and the drain
//! on shutdown.

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
    DataError, Purpose, Record, Records, check_files, count_records, read_records,
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
    pub use crate::cascade::{Calibrated, Confidence, Item, Target, choose};
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

use crate::api::{AdminAuth, BearerAuth, EvaluatorService, Readable};
use crate::engine::{LoadByName, Loaded};
use crate::health::Health;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::{Identity, Server, ServerTlsConfig};

/// The sockets the server answers on; bind them first (tests use 127.0.0.1:0).
pub struct Listeners {
    pub grpc: TcpListener,
    /// Serves the HTTP/JSON API (`/get_reward`, `/v1/...`); `None` serves none.
    pub http: Option<TcpListener>,
    /// Serves Prometheus text at /metrics; `None` serves no metrics endpoint.
    pub metrics: Option<TcpListener>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("loading {0}")]
    Load(EvaluatorLoadError),
    /// The task that loads the evaluators died (a bug, not a model's fault).
    #[error("the loading task failed: {0}")]
    LoadTask(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("gRPC transport: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves `config` on `listeners` until `shutdown` resolves, then drains within the grace period.
pub async fn run(
    config: Config,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    serve(config, default_loader(), listeners, shutdown).await
}

/// Builds one evaluator from its table; runs on a blocking thread (it may load a model).
/// `Loaded` holds the evaluators built before it, which a cascade wraps.
/// Its error is the kind's own load error, boxed: the engine keeps its message.
pub type EvaluatorLoader =
    Arc<dyn Fn(&EvaluatorConfig, &Loaded) -> Result<Arc<dyn Evaluator>, LoadFailure> + Send + Sync>;

/// The engine for `config`'s evaluators, none loaded yet; `load_engine` loads them.
pub fn new_engine(config: &Config) -> Arc<Engine> {
    Engine::new(config.slot_specs(), config.admission())
}

/// Loads every evaluator of `config` into `engine` with `loader`.
pub async fn load_engine(
    engine: &Engine,
    config: &Config,
    loader: EvaluatorLoader,
) -> Result<(), EvaluatorLoadError> {
    engine.load(by_name(config, loader)).await
}

/// `loader`, looking each evaluator's table up by name.
fn by_name(config: &Config, loader: EvaluatorLoader) -> LoadByName {
    let tables: std::collections::HashMap<String, EvaluatorConfig> = config
        .evaluators
        .iter()
        .map(|e| (e.name.clone(), e.clone()))
        .collect();
    Arc::new(move |name, loaded| match tables.get(name) {
        Some(table) => loader(table, loaded),
        // The engine is built from the same config, so every name it loads has a table.
        None => Err(format!("no [[evaluator]] table named {name:?}").into()),
    })
}

/// Builds the product's evaluators: each kind's real implementation. Adding a kind is a variant
/// in `config::KindConfig` and an arm here.
pub fn default_loader() -> EvaluatorLoader {
    Arc::new(|cfg, loaded| match &cfg.kind {
        KindConfig::Prm(p) => Ok(prm::load(&cfg.name, cfg.max_concurrency, p)?),
        KindConfig::Judge(j) => Ok(engine::shared(judge::load(
            &cfg.name,
            cfg.max_concurrency,
            j,
        )?)),
        KindConfig::Cascade(c) => Ok(engine::shared(cascade::load(
            &cfg.name,
            c,
            cfg.threshold,
            loaded,
        )?)),
        KindConfig::Composite(c) => Ok(engine::shared(composite::load(c, loaded)?)),
    })
}

/// `run` with the evaluators built by `loader` (tests pass fakes here).
pub async fn serve(
    config: Config,
    loader: EvaluatorLoader,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    priority::lower_compute_pool();
    let handle = metrics::install();
    let engine = new_engine(&config);
    let stop = Stop::new();
    if let Some(listener) = listeners.metrics {
        serve_metrics(listener, handle, stop.signal());
    }
    let names: Vec<&str> = config.evaluators.iter().map(|e| e.name.as_str()).collect();
    let (mut health, health_service) = Health::new(&names).await;
    let server = grpc_server(&config, &engine, health_service, listeners.grpc, &stop)?;
    tokio::pin!(server);
    let http = match listeners.http {
        Some(listener) => Some(spawn_http(listener, &config, engine.clone(), &stop)?),
        None => None,
    };

    let (loading, loader) = (engine.clone(), by_name(&config, loader));
    let load = tokio::spawn(async move { loading.load(loader).await });
    tokio::pin!(load);
    tokio::pin!(shutdown);
    let mut watches = None;
    let mut failure = None;
    let mut hangup = hangup_signal();
    loop {
        tokio::select! {
            result = &mut server => return result.map_err(ServeError::from),
            result = &mut load, if watches.is_none() => match result {
                Ok(Ok(())) => {
                    tracing::info!("every evaluator is loaded; serving");
                    watches = Some(engine.health_watches());
                    health.follow(&engine).await;
                }
                Ok(Err(e)) => { failure = Some(ServeError::Load(e)); break; }
                Err(e) => { failure = Some(ServeError::LoadTask(e.to_string())); break; }
            },
            // A model thread that dies takes the server out of rotation (NOT_SERVING) at once,
            // instead of failing every request behind a green probe.
            _ = async { engine::any_changed(watches.as_mut().expect("guarded")).await }, if watches.is_some() => {
                // Taken again: a reload replaces an evaluator, and its watch with it.
                watches = Some(engine.health_watches());
                health.follow(&engine).await;
            }
            // SIGHUP reloads every PRM, as the Reload call does one.
            _ = async { hangup.as_mut().expect("guarded").recv().await }, if hangup.is_some() && watches.is_some() => {
                tokio::spawn(reload_all(engine.clone()));
            }
            _ = &mut shutdown => break,
        }
    }

    // Shutting down: tell load balancers first, then stop accepting and drain.
    health.shutting_down().await;
    health.end_watches().await;
    stop.fire();
    let grace = Duration::from_secs_f64(config.server.shutdown_grace_s);
    tracing::info!(
        grace_s = grace.as_secs_f64(),
        "shutting down; draining requests in flight"
    );
    let drained = async {
        let grpc = (&mut server).await;
        if let Some(http) = http {
            join_http(http).await;
        }
        grpc
    };
    match tokio::time::timeout(grace, drained).await {
        Ok(result) => result?,
        Err(_) => tracing::warn!("grace period over; abandoning requests still in flight"),
    }
    failure.map_or(Ok(()), Err)
}

/// The HTTP/JSON listener, serving until `stop` fires.
fn spawn_http(
    listener: TcpListener,
    config: &Config,
    engine: Arc<Engine>,
    stop: &Stop,
) -> Result<tokio::task::JoinHandle<std::io::Result<()>>, ServeError> {
    let auths = auths(config, &listener)?;
    let router =
        api::http::router(engine, auths, config.reward.clone()).map_err(|message| ConfigError {
            source_name: config.source.clone(),
            message,
        })?;
    Ok(tokio::spawn(api::http::serve(
        listener,
        router,
        stop.signal(),
    )))
}

/// A listener's evaluation and admin auth: admin calls are open without an admin token only
/// where the listener is loopback.
fn auths(config: &Config, listener: &TcpListener) -> Result<(BearerAuth, AdminAuth), ServeError> {
    let admin = config.admin_tokens()?;
    let at = listener.local_addr().map_err(|source| ServeError::Io {
        what: "reading the listener's address".into(),
        source,
    })?;
    Ok((
        api::evaluation_auth(config.auth_tokens()?, &admin),
        AdminAuth::new(admin, at),
    ))
}

/// Waits for the HTTP listener to finish draining, logging how it ended.
async fn join_http(http: tokio::task::JoinHandle<std::io::Result<()>>) {
    match http.await {
        Ok(Err(e)) => tracing::error!(error = %e, "HTTP listener failed"),
        Err(e) => tracing::error!(error = %e, "HTTP listener panicked"),
        Ok(Ok(())) => {}
    }
}

/// The one stop signal every listener waits on.
struct Stop(watch::Sender<bool>);

impl Stop {
    fn new() -> Self {
        Stop(watch::channel(false).0)
    }

    fn signal(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.0.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }

    fn fire(&self) {
        self.0.send_replace(true);
    }
}

/// Prometheus text at /metrics until `stop`.
fn serve_metrics(
    listener: TcpListener,
    handle: metrics_exporter_prometheus::PrometheusHandle,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    let router = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || std::future::ready(handle.render())),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router)
            .with_graceful_shutdown(stop)
            .await
        {
            tracing::error!(error = %e, "metrics endpoint failed");
        }
    });
}

/// The gRPC server on `listener` until `stop`: health, reflection, and the Evaluator service
/// behind bearer auth and TLS; every call under the caller's deadline (`api::Deadlines`), every
/// connection retired after `max_connection_age_s`.
fn grpc_server(
    config: &Config,
    engine: &Arc<Engine>,
    health_service: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    listener: TcpListener,
    stop: &Stop,
) -> Result<impl Future<Output = Result<(), tonic::transport::Error>> + Send, ServeError> {
    let (auth, admin) = auths(config, &listener)?;
    // A request tonic cannot read is answered as bad input, not as our bug (src/api/unreadable.rs).
    let evaluator = Readable(EvaluatorService::new(engine.clone(), admin).into_server());
    let reflection = |b: tonic_reflection::server::Builder<'static>| {
        b.register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_err = |e| ServeError::Io {
        what: "reflection".into(),
        source: std::io::Error::other(e),
    };
    let reflection_v1 = reflection(tonic_reflection::server::Builder::configure())
        .build_v1()
        .map_err(reflection_err)?;
    let reflection_v1alpha = reflection(tonic_reflection::server::Builder::configure())
        .build_v1alpha()
        .map_err(reflection_err)?;
    let s = &config.server;
    let seconds = Duration::from_secs_f64;
    // tonic is given the age alone: its grace would skip the GOAWAY, so the close after the
    // grace is api::connection's.
    let mut builder = Server::builder()
        .max_connection_age(seconds(s.max_connection_age_s))
        .http2_keepalive_interval(Some(seconds(s.http2_keepalive_interval_s)))
        .http2_keepalive_timeout(Some(seconds(s.http2_keepalive_timeout_s)));
    let life = seconds(s.max_connection_age_s + s.max_connection_age_grace_s);
    if let (Some(cert), Some(key)) = (&config.server.tls_cert, &config.server.tls_key) {
        let read = |p: &std::path::Path| {
            std::fs::read(p).map_err(|source| ServeError::Io {
                what: format!("reading {}", p.display()),
                source,
            })
        };
        let identity = Identity::from_pem(read(cert)?, read(key)?);
        builder = builder.tls_config(ServerTlsConfig::new().identity(identity))?;
    }
    Ok(builder
        .layer(api::Deadlines)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(tonic::service::interceptor::InterceptedService::new(
            evaluator, auth,
        ))
        .serve_with_incoming_shutdown(api::incoming(listener, life), stop.signal()))
}

/// SIGHUP's stream, or none (with a warning) where it cannot be installed.
fn hangup_signal() -> Option<tokio::signal::unix::Signal> {
    use tokio::signal::unix::{SignalKind, signal};
    signal(SignalKind::hangup())
        .inspect_err(|e| tracing::warn!(error = %e, "cannot install SIGHUP's handler"))
        .ok()
}

/// Reloads every PRM in turn; each one that fails is logged and keeps serving.
async fn reload_all(engine: Arc<Engine>) {
    tracing::info!("SIGHUP: reloading every prm evaluator");
    for name in engine.reloadable() {
        if let Err(e) = engine.reload(&name).await {
            tracing::warn!(evaluator = %name, error = %e, "SIGHUP reload refused");
        }
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::error!("cannot install signal handlers; only the process's death will stop it");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM received"),
        _ = int.recv() => tracing::info!("SIGINT received"),
    }
}
