//! The process's signals: SIGTERM and SIGINT stop the server (it drains), SIGHUP reloads every
//! PRM as the Reload call reloads one.

use crate::engine::Engine;
use std::sync::Arc;

/// SIGHUP's stream, or none (with a warning) where it cannot be installed.
pub(crate) fn hangup_signal() -> Option<tokio::signal::unix::Signal> {
    use tokio::signal::unix::{SignalKind, signal};
    signal(SignalKind::hangup())
        .inspect_err(|e| tracing::warn!(error = %e, "cannot install SIGHUP's handler"))
        .ok()
}

/// Reloads every PRM in turn; each one that fails is logged and keeps serving.
pub(crate) async fn reload_all(engine: Arc<Engine>) {
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
