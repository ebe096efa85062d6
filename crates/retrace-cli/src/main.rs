//! The `retrace` command line: parses flags and hands off to the library; nothing else.
// One unsafe call, the allocator's collect (`alloc.rs`), allowed where it stands.
#![deny(unsafe_code)]

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use retrace::{Config, ServerFlags};
use std::path::PathBuf;

mod alloc;

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
    /// Serves the gRPC API, and HTTP/JSON beside it (OpenRLHF's /get_reward, /v1/evaluate,
    /// /v1/rank). With no --config, serves the embedded default from the cache folder (fetch
    /// it with scripts/fetch-smollm2.sh): SmolLM2-135M-Instruct's Q4_1 GGUF as a head trained
    /// on it, `smollm2-head` (the default evaluator), and as a zero-shot `chat-lm` PRM named
    /// `smollm2`.
    Serve(ServeArgs),
    /// Loads and validates a config, then prints it resolved, secrets redacted.
    CheckConfig(ServeArgs),
    /// Runs labelled traces (ProcessBench, ReTraceQA-shaped JSONL) through an evaluator, on a
    /// server or in-process; writes predictions JSONL, the ProcessBench metric and a report.
    Eval(retrace_cli::EvalOptions),
    /// Scores traces once, sweeps the PRM threshold, and prints the F1-maximising config line.
    Calibrate(retrace_cli::CalibrateOptions),
    /// Labels traces with an evaluator's verdicts (usually a voting judge's) as dataset rows
    /// that `eval` and `train-head` read.
    ///
    /// Input is what `eval` reads (ProcessBench JSON arrays, JSONL), with or without `label`.
    /// Each output row keeps every field of its input row and adds `label` (the first wrong
    /// step, -1 when every step holds), `category` (none, misinterpretation, hallucination or
    /// reasoning; left out where the evaluator names none, as a PRM), the judge's `rationale`,
    /// `labelled_by` (the evaluator) and, from a voting judge (`samples` > 1), `agreement` (the
    /// share of its samples that put the first error where the verdict does). An input row's
    /// own `label` and `category` (a human's) are kept as `source_label` and `source_category`.
    /// A row without `id` gets its default id (SPLIT-N), one without `dataset` its file's split,
    /// one given as `text` the segmented `steps`.
    ///
    /// A judge words its prompt by its `domain` key: `math`, `multiple_choice`, `open` (open
    /// and yes/no questions of world knowledge, commonsense or science, as StrategyQA's), or
    /// `auto` (the default), which reads each trace: options make it multiple choice; math
    /// notation or math words (integer, probability, how many ...) make it math; a yes/no
    /// question (opening with is, did, could ...) or a yes/no reference answer makes it open; a
    /// number in the question makes it math; anything else is open.
    ///
    /// Rerunning with the same --out resumes: rows already labelled are skipped, and rows whose
    /// request failed (listed in OUT-STEM.failed.jsonl and in the summary, and the command then
    /// exits with status 1) are tried again.
    Label(retrace_cli::LabelOptions),
    /// Measures scoring speed here: retrace over gRPC (a `retrace serve` it starts, or --server)
    /// next to llama-server following RLHFlow's one-request-per-step procedure on the same model
    /// and traces, against the machine's measured f32 matmul peak; prints the side-by-side table
    /// (medians over alternating rounds, ratios) and, with --scaling, writes the scaling plot.
    Bench(Box<retrace_cli::BenchOptions>),
    /// Sends traces to a running server and prints each verdict: the score of every step as a
    /// bar, the first error marked with its category (or --json).
    Score(retrace_cli::ScoreOptions),
    /// Trains a PRM head on a frozen base: features at each step's read position (the server's
    /// formatting, cached on disk), a logistic or MLP step head and a category head, taps,
    /// head kind and threshold chosen on dev; writes the head folder `family = "head"` serves.
    TrainHead(Box<retrace_cli::TrainOptions>),
}

#[derive(clap::Args)]
struct ServeArgs {
    /// TOML config file.
    #[arg(long, env = "RETRACE_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    server: ServerFlags,
    /// Sets any key: `server.KEY=VALUE` or `evaluator.NAME.KEY=VALUE` (VALUE in TOML syntax, or a
    /// bare string). Repeatable; RETRACE_SET takes several separated by ';'. Flags win over it.
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

impl ServeArgs {
    fn load(&self) -> anyhow::Result<Config> {
        Ok(match &self.config {
            Some(path) => Config::load_with(path, &self.set, &self.server)?,
            None => {
                let config = Config::embedded(&self.set, &self.server)?;
                let cache = &config.server.cache_dir;
                retrace::install_head(cache).with_context(|| {
                    format!(
                        "writing the embedded default's head into {}",
                        cache.display()
                    )
                })?;
                config
            }
        })
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

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    if let Some(cap) = retrace::Env::process().simd()
        && let Err(e) = retrace_model::kernels::cap_simd(&cap)
    {
        // A serving process must not die of a typo: the CPU's widest kernels run.
        eprintln!("retrace: {e}; running the widest kernels this CPU has");
    }
    alloc::runtime()
        .context("starting the tokio runtime")?
        .block_on(run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Eval(opts) => retrace_cli::eval(opts).await.map(drop).map_err(Into::into),
        Command::Calibrate(opts) => retrace_cli::calibrate(opts)
            .await
            .map(drop)
            .map_err(Into::into),
        Command::Label(opts) => retrace_cli::label(opts).await.map(drop).map_err(Into::into),
        Command::Bench(opts) => retrace_cli::bench(*opts).await,
        Command::Score(opts) => retrace_cli::score(opts).await,
        Command::TrainHead(opts) => {
            let t = tokio::task::spawn_blocking(move || retrace_cli::train_head(*opts))
                .await
                .context("the training thread")??;
            println!(
                "wrote {}: {} head on layers {} (tap {}), threshold {}, dev F1 {:.2}",
                t.out.display(),
                t.head,
                t.layers,
                t.tap,
                t.threshold,
                t.dev_f1
            );
            let x = &t.extraction;
            println!(
                "features: {:.1} s, {} traces ({} tokens, {:.0} tokens/s) through the base, {} \
                 file(s) from the cache; training on {} traces: {:.1} s",
                x.seconds,
                x.traces,
                x.tokens,
                x.tokens as f64 / x.seconds.max(1e-9),
                x.cached_files,
                t.train_traces,
                t.train_s
            );
            if let Some(test) = &t.test {
                for s in &test.summary.splits {
                    println!("test {}: {}", s.split, split_line(s));
                }
                let f1 = test.summary.average.f1;
                println!("test mean F1 over splits: {}", percent(f1));
                for o in &t.own {
                    println!(
                        "test {}: F1 {:.1} on its other {} traces at threshold {} chosen on its \
                         first 20",
                        o.split, o.f1, o.traces, o.threshold
                    );
                }
            }
            Ok(())
        }
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
                http: Some(bind(config.server.http_addr).await?),
                metrics: Some(bind(config.server.metrics_addr).await?),
            };
            let s = &config.server;
            tracing::info!(grpc = %s.grpc_addr, http = %s.http_addr, metrics = %s.metrics_addr, "listening");
            alloc::spawn_idle_trim().context("starting the idle-trim thread")?;
            retrace::run(config, listeners, retrace::shutdown_signal()).await?;
            tracing::info!("stopped");
            Ok(())
        }
    }
}

/// One split's ProcessBench scores on a line.
fn split_line(s: &retrace_cli::SplitScore) -> String {
    format!(
        "F1 {} (error accuracy {}, correct accuracy {}; {} traces)",
        percent(s.f1),
        percent(s.error_acc),
        percent(s.correct_acc),
        s.counts.error_total + s.counts.correct_total
    )
}

fn percent(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.1}"))
}
