//! The server's wiring: the engine built and loaded from the config, and every listener (gRPC
//! with health and reflection behind auth and TLS, the HTTP/JSON edge, the metrics endpoint)
//! served until the one stop signal, then drained within the grace period.

use crate::api::{self, AdminAuth, BearerAuth, EvaluatorService, Readable, pb};
use crate::config::{Config, ConfigError, EvaluatorConfig, KindConfig};
use crate::engine::{self, Engine, Evaluator, EvaluatorLoadError, LoadByName, LoadFailure, Loaded};
use crate::health::Health;
use crate::signal::{hangup_signal, reload_all};
use crate::{cascade, composite, judge, metrics, priority, prm};
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
    // The bases its trained heads share, a reload's new head with the old one included.
    let bases = prm::Bases::default();
    Arc::new(move |cfg, loaded| match &cfg.kind {
        KindConfig::Prm(p) => Ok(prm::load(&cfg.name, cfg.max_concurrency, p, &bases)?),
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
