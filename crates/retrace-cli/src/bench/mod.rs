//! `retrace bench`: scoring speed on this machine. It owns the workload (ProcessBench traces), the
//! child servers, the contenders (retrace over gRPC, llama-server following RLHFlow's per-step
//! procedure), the measured matmul peak, the scaling sweep, and the side-by-side report.
//!
//! - `procs`: child processes (guards, free ports, peak RSS).
//! - `grpc`: the retrace contender. `llama`: the llama-server contender.
//! - `gemm`: candle's f32 matmul peak at the model's shapes; the model's FLOPs per trace.
//! - `scaling`: the model over trace length and batch size, and its SVG.
//! - `speed`: the speed table's flow; `report`: its medians, ratios and Markdown.
//! - `reuse`: the token-reuse workloads (`--workload tree,...`), their table and targets.

mod gemm;
mod grpc;
mod llama;
mod procs;
mod report;
mod reuse;
mod scaling;
mod speed;

use crate::common::{EvalBackend, read_records};
use anyhow::{Context, bail};
use gemm::Shapes;
use procs::{Guard, free_port};
use retrace::Formatter;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `retrace bench`: how fast retrace scores traces here, next to llama-server on the same model.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchOptions {
    /// What to measure, comma-separated: `plain` is the speed table (retrace against
    /// llama-server on ProcessBench); `tree`, `beam`, `best-of-n`, `rl-burst` and `processbench`
    /// measure token reuse (the prefix cache on, off, and no reuse at all) in one run.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "plain")]
    pub(crate) workload: Vec<reuse::Kind>,
    /// Callers for the reuse workloads (requests in flight; searches in flight for `beam`),
    /// comma-separated: each workload runs at each. Default: each workload's own (tree search
    /// and beam search 4, Best-of-N 1, RL burst 64, ProcessBench 16).
    #[arg(long, value_delimiter = ',')]
    pub callers: Vec<usize>,
    /// ProcessBench splits beside --data that tree search walks, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "math,olympiadbench")]
    pub tree_splits: Vec<String>,
    /// The Best-of-N candidates (JSONL: instruction, question, candidates), for `best-of-n`
    /// and `rl-burst`; scripts/bench/make-best-of-n.sh regenerates it.
    #[arg(long, default_value = "bench/best-of-n.jsonl")]
    pub bon_data: PathBuf,
    /// ProcessBench-shaped traces to score (JSON array or JSONL): gsm8k.json of the full
    /// ProcessBench set (Qwen/ProcessBench on Hugging Face, four JSON splits; scripts/bench/bench.sh
    /// passes $RETRACE_PROCESSBENCH_DIR/gsm8k.json); tests/fixtures/processbench is a subset.
    #[arg(long)]
    pub data: PathBuf,
    /// Score the first N traces of --data (of each tree split for `tree`; the first N questions
    /// of --bon-data for `beam`, repeated as other questions up to --callers searches).
    #[arg(long, default_value_t = 64)]
    pub limit: usize,
    /// Measured rounds; each round runs every contender at every concurrency, alternating which
    /// goes first, and the report shows medians over rounds.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Concurrency levels (traces in flight), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,16")]
    pub concurrency: Vec<usize>,
    /// A running retrace server (host:port) instead of starting one; its peak RSS is then not
    /// measured.
    #[arg(long)]
    pub server: Option<String>,
    /// The model the bench's server loads, as an [[evaluator]]'s `model`: a Hugging Face
    /// folder or a .gguf file; also read for token counts and the matmul shapes
    /// [default: CACHE/smollm2].
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Its family, as in an [[evaluator]] table.
    #[arg(long, default_value = "chat-lm")]
    pub family: String,
    /// Config overrides for the server the bench starts (`evaluator.bench.KEY=VALUE`), repeatable:
    /// e.g. `--set evaluator.bench.max_batch_tokens=16384`.
    #[arg(long = "set")]
    pub set: Vec<String>,
    /// Cache folder [default: $RETRACE_CACHE_DIR or ~/.cache/retrace].
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// The llama-server binary [default: CACHE/llama-server/bin/llama-server].
    #[arg(long)]
    pub llama_server: Option<PathBuf>,
    /// The GGUF llama-server loads: the same weights as --model [default:
    /// CACHE/bench/SmolLM2-135M-Instruct.f32.gguf, written by scripts/bench/bench.sh]. The last one
    /// given counts (scripts/bench/bench.sh passes its default first).
    #[arg(long, overrides_with = "llama_gguf")]
    pub llama_gguf: Option<PathBuf>,
    /// Threads for llama-server [default: the machine's cores].
    #[arg(long)]
    pub llama_threads: Option<usize>,
    /// Alternatives llama-server lists per reply; a step whose '+' or '-' is not among them is
    /// counted as a miss in the report.
    #[arg(long, default_value_t = 200)]
    pub llama_top_logprobs: usize,
    /// Extra llama-server arguments, repeatable: e.g. `--llama-arg=-ctk --llama-arg=f32` for an
    /// f32 KV cache (its default is f16).
    #[arg(long = "llama-arg", allow_hyphen_values = true)]
    pub llama_args: Vec<String>,
    /// Skip the llama-server contender (retrace and the matmul peak only).
    #[arg(long)]
    pub no_llama: bool,
    /// Rows M of the matmul-peak GEMMs, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "512,1024,2048")]
    pub gemm_rows: Vec<usize>,
    /// Also sweep the model over trace length x batch size and write the plot to --svg.
    #[arg(long)]
    pub scaling: bool,
    /// Trace lengths (tokens) of the sweep, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "256,512,1024,2048,4096")]
    pub scaling_lens: Vec<usize>,
    /// Batch sizes of the sweep, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    pub scaling_batches: Vec<usize>,
    /// Skip sweep points with more than this many tokens per forward pass.
    #[arg(long, default_value_t = 8192)]
    pub scaling_max_tokens: usize,
    /// Where the sweep's SVG goes.
    #[arg(long, default_value = "docs/bench-scaling.svg")]
    pub svg: PathBuf,
    /// Also write the report (Markdown) to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) targets: report::Targets,
}

/// One trace as both contenders see it, with the token count chat-lm scores.
#[derive(Debug, Clone)]
pub(crate) struct BenchTrace {
    /// As chat-lm words it (options rendered in).
    pub(crate) question: String,
    pub(crate) steps: Vec<String>,
    pub(crate) tokens: usize,
}

/// The traces of a run, and their totals.
#[derive(Debug)]
pub(crate) struct Workload {
    pub(crate) traces: Vec<BenchTrace>,
    pub(crate) tokens: usize,
    pub(crate) steps: usize,
    pub(crate) flops: f64,
}

/// What one contender did with the whole workload at one concurrency.
#[derive(Debug, Clone)]
pub(crate) struct ContenderRun {
    pub(crate) wall: Duration,
    /// Per trace, sorted.
    pub(crate) latencies: Vec<Duration>,
    /// Per trace, in workload order.
    pub(crate) scores: Vec<Vec<f32>>,
    /// Steps whose score could not be read in full (llama-server: '+' or '-' outside the
    /// listed logprobs).
    pub(crate) misses: usize,
}

/// Scores `n` units of work with `concurrency` workers, each taking the next unscored one;
/// `score(i)` gives unit i's step scores and its logprob misses. Every contender, and every
/// reuse workload, runs this loop, so they are all driven the same way.
async fn drive<F, Fut>(n: usize, concurrency: usize, score: F) -> anyhow::Result<ContenderRun>
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = anyhow::Result<(Vec<f32>, usize)>> + Send,
{
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = std::time::Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (next, score) = (next.clone(), score.clone());
        tasks.push(tokio::spawn(async move {
            let mut done = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= n {
                    return anyhow::Ok(done);
                }
                let sent = std::time::Instant::now();
                let (scores, misses) = score(i).await?;
                done.push((i, sent.elapsed(), scores, misses));
            }
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.extend(t.await.context("a bench client task panicked")??);
    }
    Ok(ContenderRun::collect(started.elapsed(), n, results))
}

impl ContenderRun {
    /// From each unit's (index, latency, scores, misses).
    fn collect(
        wall: Duration,
        n: usize,
        done: Vec<(usize, Duration, Vec<f32>, usize)>,
    ) -> ContenderRun {
        let mut scores = vec![Vec::new(); n];
        let mut latencies = Vec::with_capacity(done.len());
        let mut misses = 0;
        for (i, l, s, m) in done {
            scores[i] = s;
            latencies.push(l);
            misses += m;
        }
        latencies.sort();
        ContenderRun {
            wall,
            latencies,
            scores,
            misses,
        }
    }
}

impl Workload {
    /// --limit traces of --data, each question opening with `marker` when one is given.
    fn load(
        opts: &BenchOptions,
        formatter: &Formatter,
        shapes: &Shapes,
        marker: Option<&str>,
    ) -> anyhow::Result<Self> {
        let mut traces = Vec::new();
        let (mut tokens, mut steps, mut flops) = (0, 0, 0.0);
        for record in read_records(&opts.data)?.take(opts.limit) {
            let r = record?;
            // The server's own edge parsing, so the text scored here is the text it scores.
            let parts = retrace::TraceParts {
                question: match marker {
                    Some(m) => format!("{m} {}", r.question),
                    None => r.question,
                },
                options: r.options,
                steps: r.steps,
                text: r.text.unwrap_or_default(),
                ..Default::default()
            };
            let trace = parts
                .parse(&retrace::FieldPath::key("trace"))
                .map_err(|e| anyhow::anyhow!("{}: trace {}: {e}", opts.data.display(), r.id))?;
            let encoded = formatter.encode(&trace)?;
            tokens += encoded.ids.len();
            steps += encoded.positions.len();
            flops += shapes.trace_flops(encoded.ids.len(), encoded.positions.len());
            traces.push(BenchTrace {
                question: retrace::question_text(&trace),
                steps: trace.step_texts().map(str::to_string).collect(),
                tokens: encoded.ids.len(),
            });
        }
        if traces.is_empty() {
            bail!("{} has no traces", opts.data.display());
        }
        Ok(Workload {
            traces,
            tokens,
            steps,
            flops,
        })
    }
}

fn cache_dir(opts: &BenchOptions) -> PathBuf {
    opts.cache_dir
        .clone()
        .unwrap_or_else(|| retrace::Env::process().cache_dir())
}

/// Runs the benchmark the flags name and prints its report.
pub async fn bench(opts: BenchOptions) -> anyhow::Result<()> {
    if opts.rounds == 0 || opts.limit == 0 || opts.concurrency.contains(&0) {
        bail!("--rounds, --limit and every --concurrency must be at least 1");
    }
    if opts.workload == [reuse::Kind::Plain] {
        return speed::speed(opts).await;
    }
    if opts.workload.contains(&reuse::Kind::Plain) {
        bail!("--workload plain is the speed table; run it on its own");
    }
    let cache = cache_dir(&opts);
    let model = opts.model.clone().unwrap_or_else(|| cache.join("smollm2"));
    let text = reuse::bench(&opts, &opts.workload, &model, &cache).await?;
    write_out(&opts, &text)
}

/// Prints the report, and writes it to --out when given.
fn write_out(opts: &BenchOptions, text: &str) -> anyhow::Result<()> {
    println!("{text}");
    if let Some(out) = &opts.out {
        std::fs::write(out, text).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// Starts `retrace serve` (this executable) on 127.0.0.1 with one evaluator, `bench`; its
/// config and log are named after `label`. Returns its gRPC and metrics addresses.
fn start_server(
    opts: &BenchOptions,
    model: &Path,
    logs: &Path,
    label: &str,
) -> anyhow::Result<(Guard, String, String)> {
    let (grpc, metrics, http) = (free_port()?, free_port()?, free_port()?);
    let config = logs.join(format!("retrace-{label}.toml"));
    std::fs::write(
        &config,
        format!(
            "[server]\ngrpc_addr = \"127.0.0.1:{grpc}\"\nmetrics_addr = \"127.0.0.1:{metrics}\"\n\
             http_addr = \"127.0.0.1:{http}\"\n\n\
             [[evaluator]]\nname = \"bench\"\nkind = \"prm\"\nfamily = {:?}\nmodel = {:?}\n",
            opts.family,
            model.display().to_string()
        ),
    )?;
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("serve").arg("--config").arg(&config);
    for s in &opts.set {
        cmd.arg("--set").arg(s);
    }
    let guard = Guard::spawn(
        "retrace serve",
        cmd,
        &logs.join(format!("retrace-{label}.log")),
    )?;
    Ok((
        guard,
        format!("127.0.0.1:{grpc}"),
        format!("127.0.0.1:{metrics}"),
    ))
}

/// Connects to our own child server once it is SERVING, failing at once (with its log) if it
/// dies while loading.
async fn connect_child(
    guard: &mut Guard,
    addr: &str,
) -> anyhow::Result<retrace::pb::evaluator_client::EvaluatorClient<tonic::transport::Channel>> {
    let started = Instant::now();
    loop {
        guard.check_alive()?;
        match EvalBackend::connect(addr, None, None, Duration::ZERO).await {
            Ok(EvalBackend::Remote { client, .. }) => return Ok(*client),
            Ok(EvalBackend::Local { .. }) => bail!("expected a remote backend"),
            Err(e) if started.elapsed() > Duration::from_secs(300) => {
                bail!("the retrace server never became SERVING: {e}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Bytes of the checkpoint's weight files: the weights in memory at f32 when they are f32.
/// The llama-server binary and the GGUF it loads: the flags', else the cache's defaults.
fn llama_paths(opts: &BenchOptions, cache: &Path) -> (PathBuf, PathBuf) {
    let bin = opts
        .llama_server
        .clone()
        .unwrap_or_else(|| cache.join("llama-server/bin/llama-server"));
    let gguf = opts
        .llama_gguf
        .clone()
        .unwrap_or_else(|| cache.join("bench/SmolLM2-135M-Instruct.f32.gguf"));
    (bin, gguf)
}

fn weight_bytes(folder: &Path) -> anyhow::Result<u64> {
    if folder.is_file() {
        return Ok(folder.metadata()?.len());
    }
    let mut total = 0;
    for entry in std::fs::read_dir(folder)? {
        let entry = entry?;
        if entry.path().extension().is_some_and(|e| e == "safetensors") {
            total += entry.metadata()?.len();
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        bench: BenchOptions,
    }

    #[test]
    fn the_last_llama_gguf_counts() {
        let args = [
            "bench",
            "--data",
            "d.json",
            "--llama-gguf",
            "a.gguf",
            "--llama-gguf",
            "b.gguf",
        ];
        let cmd = Cmd::try_parse_from(args).expect("a second --llama-gguf overrides the first");
        assert_eq!(cmd.bench.llama_gguf, Some(PathBuf::from("b.gguf")));
    }
}
