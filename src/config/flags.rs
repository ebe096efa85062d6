//! `[server]` keys as command-line flags (and their environment variables): typed values laid
//! over the file's, with no round trip through TOML text.

use super::ServerConfig;
use std::net::SocketAddr;
use std::path::PathBuf;

/// The flags of `serve` and `check-config`; each one is a `[server]` key of the same name.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServerFlags {
    /// gRPC listen address [server.grpc_addr; default 0.0.0.0:50051].
    #[arg(long, env = "RETRACE_GRPC_ADDR")]
    pub grpc_addr: Option<SocketAddr>,
    /// HTTP/JSON listen address: /get_reward, /v1/evaluate, /v1/rank [server.http_addr; default
    /// 0.0.0.0:8080].
    #[arg(long, env = "RETRACE_HTTP_ADDR")]
    pub http_addr: Option<SocketAddr>,
    /// Prometheus /metrics listen address [server.metrics_addr; default 0.0.0.0:9091].
    #[arg(long, env = "RETRACE_METRICS_ADDR")]
    pub metrics_addr: Option<SocketAddr>,
    /// Evaluator used when a request names none [server.default_evaluator].
    #[arg(long, env = "RETRACE_DEFAULT_EVALUATOR")]
    pub default_evaluator: Option<String>,
    /// Requests admitted at once; more get RESOURCE_EXHAUSTED [server.max_in_flight; 512].
    #[arg(long, env = "RETRACE_MAX_IN_FLIGHT")]
    pub max_in_flight: Option<usize>,
    /// Seconds to let requests in flight finish after SIGTERM [server.shutdown_grace_s; 30].
    #[arg(long, env = "RETRACE_SHUTDOWN_GRACE_S")]
    pub shutdown_grace_s: Option<f64>,
    /// Most steps per trace [server.max_steps; 256].
    #[arg(long, env = "RETRACE_MAX_STEPS")]
    pub max_steps: Option<usize>,
    /// Most bytes per trace [server.max_trace_bytes; 262144].
    #[arg(long, env = "RETRACE_MAX_TRACE_BYTES")]
    pub max_trace_bytes: Option<usize>,
    /// Environment variable holding accepted bearer tokens, comma-separated [server.auth_tokens_env].
    #[arg(long, env = "RETRACE_AUTH_TOKENS_ENV")]
    pub auth_tokens_env: Option<String>,
    /// Environment variable holding the admin calls' (Reload) bearer tokens, comma-separated;
    /// unset, admin calls are taken only on a loopback listener [server.admin_tokens_env].
    #[arg(long, env = "RETRACE_ADMIN_TOKENS_ENV")]
    pub admin_tokens_env: Option<String>,
    /// PEM certificate; enables TLS with --tls-key [server.tls_cert].
    #[arg(long, env = "RETRACE_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key [server.tls_key].
    #[arg(long, env = "RETRACE_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Folder for fetched models [server.cache_dir; $RETRACE_CACHE_DIR or ~/.cache/retrace].
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
}

impl ServerFlags {
    /// Lays every flag that was given over `server`.
    pub(super) fn apply(&self, server: &mut ServerConfig) {
        fn set<T: Clone>(slot: &mut T, flag: &Option<T>) {
            if let Some(v) = flag {
                *slot = v.clone();
            }
        }
        fn set_opt<T: Clone>(slot: &mut Option<T>, flag: &Option<T>) {
            if flag.is_some() {
                slot.clone_from(flag);
            }
        }
        set(&mut server.grpc_addr, &self.grpc_addr);
        set(&mut server.http_addr, &self.http_addr);
        set(&mut server.metrics_addr, &self.metrics_addr);
        set_opt(&mut server.default_evaluator, &self.default_evaluator);
        set(&mut server.max_in_flight, &self.max_in_flight);
        set(&mut server.shutdown_grace_s, &self.shutdown_grace_s);
        set(&mut server.max_steps, &self.max_steps);
        set(&mut server.max_trace_bytes, &self.max_trace_bytes);
        set_opt(&mut server.auth_tokens_env, &self.auth_tokens_env);
        set_opt(&mut server.admin_tokens_env, &self.admin_tokens_env);
        set_opt(&mut server.tls_cert, &self.tls_cert);
        set_opt(&mut server.tls_key, &self.tls_key);
        set(&mut server.cache_dir, &self.cache_dir);
    }
}
