//! # retrace
//!
//! A gRPC service that judges reasoning traces step by step: the first wrong step, the error's
//! category and a score per step, from process reward models run in-process on candle.
//!
//! # Layout
//! - `api/`: the tonic service; proto <-> domain at the edge; the one error -> Status table.
//! - `engine/`: the `Evaluator` trait, the registry, admission, per-evaluator queues, deadlines.
//! - `prm/`: PRM checkpoints on candle: loading, the decoder, heads, formats, the batcher thread.
//! - `eval/`: the offline benchmark (`retrace eval`, `retrace calibrate`) and its report.
//! - `config/` (file, overrides, validation), `trace.rs` (domain types), `segment.rs` (raw text
//!   -> steps), `metrics.rs` (every metric name once).
//!
//! A request takes three hops: api -> engine -> evaluator. `run` is the whole server.

pub mod api;
pub mod bench;
pub mod cascade;
pub mod config;
pub mod engine;
pub mod eval;
pub mod judge;
pub mod metrics;
pub mod prm;
pub mod segment;
pub mod trace;

use crate::api::{BearerAuth, EvaluatorService, pb};
use crate::config::{Config, ConfigError, Kind};
use crate::engine::{Engine, EngineError, EvaluatorLoader};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic_health::ServingStatus;

/// The sockets the server answers on; bind them first (tests use 127.0.0.1:0).
pub struct Listeners {
    pub grpc: TcpListener,
    /// Serves Prometheus text at /metrics; `None` serves no metrics endpoint.
    pub metrics: Option<TcpListener>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("loading evaluators: {0}")]
    Load(EngineError),
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

/// Builds the product's evaluators: each kind's real implementation.
pub fn default_loader() -> EvaluatorLoader {
    Arc::new(|cfg, server, loaded| match cfg.kind {
        Kind::Prm => prm::load(cfg, server),
        Kind::Judge => judge::load(cfg).map(engine::shared),
        Kind::Cascade => cascade::load(cfg, loaded).map(engine::shared),
    })
}

/// `run` with the evaluators built by `loader` (tests pass fakes here).
pub async fn serve(
    config: Config,
    loader: EvaluatorLoader,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let handle = metrics::install();
    let engine = Engine::new(&config);
    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = move || {
        let mut rx = stop_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };

    if let Some(listener) = listeners.metrics {
        let router = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || std::future::ready(handle.render())),
        );
        let stop = stopped();
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, router)
                .with_graceful_shutdown(stop)
                .await
            {
                tracing::error!(error = %e, "metrics endpoint failed");
            }
        });
    }

    let (health, health_service) = tonic_health::server::health_reporter();
    set_health(&health, ServingStatus::NotServing).await;
    let evaluator = EvaluatorService::new(engine.clone()).into_server();
    let auth = BearerAuth::new(config.auth_tokens()?);
    let reflection = |b: tonic_reflection::server::Builder<'static>| {
        b.register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection(tonic_reflection::server::Builder::configure())
        .build_v1()
        .map_err(|e| ServeError::Io {
            what: "reflection".into(),
            source: std::io::Error::other(e),
        })?;
    let reflection_v1alpha = reflection(tonic_reflection::server::Builder::configure())
        .build_v1alpha()
        .map_err(|e| ServeError::Io {
            what: "reflection".into(),
            source: std::io::Error::other(e),
        })?;

    let mut builder = Server::builder();
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
    let server = builder
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(tonic::service::interceptor::InterceptedService::new(
            evaluator, auth,
        ))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listeners.grpc), stopped());
    tokio::pin!(server);

    let load = {
        let (engine, server_cfg) = (engine.clone(), config.server.clone());
        tokio::spawn(async move { engine.load(loader, &server_cfg).await })
    };
    tokio::pin!(load);
    tokio::pin!(shutdown);
    let mut loading = true;
    let mut failure = None;
    // Once loaded, readiness is re-read every second, so a model thread that died takes the
    // server out of rotation (NOT_SERVING) instead of failing every request behind a green probe.
    let mut watch = tokio::time::interval(Duration::from_secs(1));
    let mut serving = false;
    loop {
        tokio::select! {
            result = &mut server => return result.map_err(ServeError::from),
            result = &mut load, if loading => {
                loading = false;
                match result {
                    Ok(Ok(())) => {
                        tracing::info!("every evaluator is loaded; serving");
                        set_health(&health, ServingStatus::Serving).await;
                        serving = true;
                    }
                    Ok(Err(e)) => { failure = Some(ServeError::Load(e)); break; }
                    Err(e) => { failure = Some(ServeError::Load(EngineError::Internal(e.to_string()))); break; }
                }
            }
            _ = watch.tick(), if !loading => {
                let statuses = engine.list();
                for s in &statuses {
                    metrics::set_ready(&s.name, s.ready);
                }
                let ready = statuses.iter().all(|s| s.ready);
                if ready != serving {
                    tracing::warn!(ready, "evaluator readiness changed");
                    let status = if ready { ServingStatus::Serving } else { ServingStatus::NotServing };
                    set_health(&health, status).await;
                    serving = ready;
                }
            }
            _ = &mut shutdown => break,
        }
    }

    // Shutting down: tell load balancers first, then stop accepting and drain.
    set_health(&health, ServingStatus::NotServing).await;
    let _ = stop_tx.send(true);
    let grace = Duration::from_secs_f64(config.server.shutdown_grace_s);
    tracing::info!(
        grace_s = grace.as_secs_f64(),
        "shutting down; draining requests in flight"
    );
    match tokio::time::timeout(grace, &mut server).await {
        Ok(result) => result?,
        Err(_) => tracing::warn!("grace period over; abandoning requests still in flight"),
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

async fn set_health(health: &tonic_health::server::HealthReporter, status: ServingStatus) {
    health.set_service_status("", status).await;
    health
        .set_service_status(
            <pb::evaluator_server::EvaluatorServer<EvaluatorService> as tonic::server::NamedService>::NAME,
            status,
        )
        .await;
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
