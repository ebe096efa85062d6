//! How a tool reaches its evaluators: the `--server` / `--config` flags every client tool
//! shares (`eval`, `calibrate`, `label`), the backend they open, and the run they ask for.

use super::EvalError;
use super::backend::EvalBackend;
use super::dataset::Purpose;
use super::spec::RunSpec;
use retrace::Config;
use std::path::PathBuf;
use std::time::Duration;

/// Where traces are judged, and how the input is read.
#[derive(Debug, Clone, clap::Args)]
pub struct ConnectOptions {
    /// A running retrace server's gRPC address (host:port or http(s)://host:port).
    #[arg(long, conflicts_with = "config", required_unless_present = "config")]
    pub server: Option<String>,
    /// Load the evaluators of this config in-process instead of using a server.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Config overrides for --config (`evaluator.NAME.KEY=VALUE`), repeatable.
    #[arg(long = "set", requires = "config")]
    pub set: Vec<String>,
    /// Traces in flight at once.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// At most this many rows from each input file (a sample).
    #[arg(long)]
    pub limit: Option<usize>,
    /// Skip and count bad input rows instead of stopping at the first.
    #[arg(long)]
    pub skip_bad: bool,
    /// Environment variable holding a bearer token for the server.
    #[arg(long)]
    pub token_env: Option<String>,
    /// PEM CA certificate to trust for an https:// server.
    #[arg(long)]
    pub ca_cert: Option<PathBuf>,
    /// Seconds to wait for the server to report SERVING.
    #[arg(long, default_value_t = 120.0)]
    pub wait_s: f64,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
}

/// Where `c` says traces are judged: a server, or a config loaded here.
pub(crate) async fn backend(c: &ConnectOptions) -> Result<EvalBackend, EvalError> {
    if c.concurrency == 0 {
        return Err(EvalError::Usage("--concurrency must be at least 1".into()));
    }
    match (&c.server, &c.config) {
        (Some(addr), None) => {
            let token = match &c.token_env {
                Some(var) => Some(retrace::Env::process().secret(var).ok_or_else(|| {
                    EvalError::Usage(format!("--token-env names {var}, which is not set"))
                })?),
                None => None,
            };
            let wait = Duration::try_from_secs_f64(c.wait_s)
                .map_err(|_| EvalError::Usage("--wait-s must be a non-negative number".into()))?;
            EvalBackend::connect(addr, token, c.ca_cert.as_deref(), wait).await
        }
        (None, Some(path)) => EvalBackend::local(&Config::load(path, &c.set)?).await,
        _ => Err(EvalError::Usage(
            "give exactly one of --server and --config".into(),
        )),
    }
}

/// What `c` asks of a run over `files` (read for `eval`).
pub(crate) fn run_spec(
    c: &ConnectOptions,
    files: &[PathBuf],
    evaluator: &str,
    threshold: Option<f32>,
) -> RunSpec {
    RunSpec {
        files: files.to_vec(),
        evaluator: evaluator.to_string(),
        threshold,
        concurrency: c.concurrency,
        limit: c.limit,
        skip_bad: c.skip_bad,
        progress: !c.no_progress,
        purpose: Purpose::Eval,
    }
}
