//! The `retrace` command line: parses flags and hands off to the library; nothing else.

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use retrace::config::Config;
use std::path::PathBuf;

/// A large batch allocates activations of tens of MiB per op; glibc malloc serves those with
/// fresh mmaps (a page fault and a zeroed page per 4 KiB, every time), mimalloc from reused memory.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "retrace",
    version,
    about = "Judges reasoning traces step by step over gRPC."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serves the gRPC API. With no --config, serves the embedded default: SmolLM2-135M-Instruct
    /// as a zero-shot `chat-lm` PRM named `smollm2`, from the cache folder (fetch it with
    /// scripts/fetch-smollm2.sh).
    Serve(ServeArgs),
    /// Loads and validates a config, then prints it resolved, secrets redacted.
    CheckConfig(ServeArgs),
    /// Runs labelled traces (ProcessBench, ReTraceQA-shaped JSONL) through an evaluator, on a
    /// server or in-process; writes predictions JSONL, the ProcessBench metric and a report.
    Eval(retrace::eval::EvalOptions),
    /// Scores traces once, sweeps the PRM threshold, and prints the F1-maximising config line.
    Calibrate(retrace::eval::CalibrateOptions),
    /// Measures scoring speed here: retrace over gRPC (a `retrace serve` it starts, or --server)
    /// next to llama-server following RLHFlow's one-request-per-step procedure on the same model
    /// and traces, against the machine's measured f32 matmul peak; prints the side-by-side table
    /// (medians over alternating rounds, ratios) and, with --scaling, writes the scaling plot.
    Bench(retrace::bench::BenchOptions),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// TOML config file.
    #[arg(long, env = "RETRACE_CONFIG")]
    config: Option<PathBuf>,
    /// gRPC listen address [config: server.grpc_addr; default 0.0.0.0:50051].
    #[arg(long, env = "RETRACE_GRPC_ADDR")]
    grpc_addr: Option<String>,
    /// Prometheus /metrics listen address [server.metrics_addr; default 0.0.0.0:9091].
    #[arg(long, env = "RETRACE_METRICS_ADDR")]
    metrics_addr: Option<String>,
    /// Evaluator used when a request names none [server.default_evaluator].
    #[arg(long, env = "RETRACE_DEFAULT_EVALUATOR")]
    default_evaluator: Option<String>,
    /// Requests admitted at once; more get RESOURCE_EXHAUSTED [server.max_in_flight; 512].
    #[arg(long, env = "RETRACE_MAX_IN_FLIGHT")]
    max_in_flight: Option<usize>,
    /// Seconds to let requests in flight finish after SIGTERM [server.shutdown_grace_s; 30].
    #[arg(long, env = "RETRACE_SHUTDOWN_GRACE_S")]
    shutdown_grace_s: Option<f64>,
    /// Most steps per trace [server.max_steps; 256].
    #[arg(long, env = "RETRACE_MAX_STEPS")]
    max_steps: Option<usize>,
    /// Most bytes per trace [server.max_trace_bytes; 262144].
    #[arg(long, env = "RETRACE_MAX_TRACE_BYTES")]
    max_trace_bytes: Option<usize>,
    /// Environment variable holding accepted bearer tokens, comma-separated [server.auth_tokens_env].
    #[arg(long, env = "RETRACE_AUTH_TOKENS_ENV")]
    auth_tokens_env: Option<String>,
    /// PEM certificate; enables TLS with --tls-key [server.tls_cert].
    #[arg(long, env = "RETRACE_TLS_CERT")]
    tls_cert: Option<PathBuf>,
    /// PEM private key [server.tls_key].
    #[arg(long, env = "RETRACE_TLS_KEY")]
    tls_key: Option<PathBuf>,
    /// Folder for fetched models [server.cache_dir; $RETRACE_CACHE_DIR or ~/.cache/retrace].
    #[arg(long)]
    cache_dir: Option<PathBuf>,
    /// Sets any key: `server.KEY=VALUE` or `evaluator.NAME.KEY=VALUE` (VALUE in TOML syntax, or a
    /// bare string). Repeatable; RETRACE_SET takes several separated by ';'.
    #[arg(long = "set", env = "RETRACE_SET", value_delimiter = ';')]
    set: Vec<String>,
    /// Log format.
    #[arg(long, env = "RETRACE_LOG_FORMAT", default_value = "text")]
    log_format: LogFormat,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// The embedded default: SmolLM2-135M-Instruct as a zero-shot chat-lm PRM.
const EMBEDDED: &str = r#"
[[evaluator]]
name = "smollm2"
kind = "prm"
family = "chat-lm"
model = "smollm2"
threshold = 0.5
"#;

impl ServeArgs {
    /// Flags become `--set` overrides, applied after the file's own values.
    fn overrides(&self) -> Vec<String> {
        let q = |v: &str| format!("{v:?}");
        let mut o = Vec::new();
        let mut push = |k: &str, v: Option<String>| {
            if let Some(v) = v {
                o.push(format!("server.{k}={v}"));
            }
        };
        push("grpc_addr", self.grpc_addr.as_deref().map(q));
        push("metrics_addr", self.metrics_addr.as_deref().map(q));
        push(
            "default_evaluator",
            self.default_evaluator.as_deref().map(q),
        );
        push("max_in_flight", self.max_in_flight.map(|v| v.to_string()));
        push(
            "shutdown_grace_s",
            self.shutdown_grace_s.map(|v| format!("{v:?}")),
        );
        push("max_steps", self.max_steps.map(|v| v.to_string()));
        push(
            "max_trace_bytes",
            self.max_trace_bytes.map(|v| v.to_string()),
        );
        push("auth_tokens_env", self.auth_tokens_env.as_deref().map(q));
        push(
            "tls_cert",
            self.tls_cert.as_ref().map(|p| q(&p.display().to_string())),
        );
        push(
            "tls_key",
            self.tls_key.as_ref().map(|p| q(&p.display().to_string())),
        );
        push(
            "cache_dir",
            self.cache_dir.as_ref().map(|p| q(&p.display().to_string())),
        );
        o.extend(self.set.iter().cloned());
        o
    }

    fn load(&self) -> anyhow::Result<Config> {
        let overrides = self.overrides();
        let config = match &self.config {
            Some(path) => Config::load(path, &overrides)?,
            None => {
                let mut config = Config::parse(EMBEDDED, "embedded default", &overrides)?;
                // The model lives in the cache folder, wherever flags or --set put it.
                let cache = config.server.cache_dir.clone();
                for e in &mut config.evaluators {
                    if e.name == "smollm2" && e.model.as_deref() == Some("smollm2") {
                        e.model = Some(cache.join("smollm2").display().to_string());
                    }
                }
                config
            }
        };
        Ok(config)
    }
}

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("RETRACE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Eval(opts) => retrace::eval::eval(opts)
            .await
            .map(drop)
            .map_err(Into::into),
        Command::Calibrate(opts) => retrace::eval::calibrate(opts)
            .await
            .map(drop)
            .map_err(Into::into),
        Command::Bench(opts) => retrace::bench::bench(opts).await.map(drop),
        Command::CheckConfig(args) => {
            let config = args.load()?;
            print!("{}", config.redacted_toml());
            Ok(())
        }
        Command::Serve(args) => {
            init_logs(args.log_format);
            let config = args.load()?;
            tracing::info!(source = %config.source, config = %config.redacted_toml(), "configuration");
            let bind = |addr| async move {
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding {addr}"))
            };
            let listeners = retrace::Listeners {
                grpc: bind(config.server.grpc_addr).await?,
                metrics: Some(bind(config.server.metrics_addr).await?),
            };
            tracing::info!(grpc = %config.server.grpc_addr, metrics = %config.server.metrics_addr, "listening");
            retrace::run(config, listeners, retrace::shutdown_signal()).await?;
            tracing::info!("stopped");
            Ok(())
        }
    }
}
