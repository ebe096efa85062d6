//! `retrace bench`: scoring speed on this machine. It owns the workload (ProcessBench traces), the
//! child servers, the contenders (retrace over gRPC, llama-server following RLHFlow's per-step
//! procedure), the measured matmul peak, the scaling sweep, and the side-by-side report.
//!
//! - `procs`: child processes (guards, free ports, peak RSS).
//! - `grpc`: the retrace contender. `llama`: the llama-server contender.
//! - `gemm`: candle's f32 matmul peak at the model's shapes; the model's FLOPs per trace.
//! - `scaling`: the model over trace length and batch size, and its SVG.
//! - `report`: medians, ratios and the Markdown table.

mod gemm;
mod grpc;
mod llama;
mod procs;
mod report;
mod reuse;
mod scaling;

use crate::eval::{Backend, read_records};
use anyhow::{Context, bail};
use gemm::Shapes;
use procs::{Guard, free_port};
use retrace::prm::format::{Family, Formatter};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `retrace bench`: how fast retrace scores traces here, next to llama-server on the same model.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchOptions {
    /// What to measure, comma-separated: `plain` is the speed table (retrace against
    /// llama-server on ProcessBench); `tree`, `best-of-n`, `rl-burst` and `processbench` measure
    /// token reuse (the prefix cache on, off, and no reuse at all) in one run.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "plain")]
    pub workload: Vec<reuse::Kind>,
    /// ProcessBench splits beside --data that tree search walks, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "math,olympiadbench")]
    pub tree_splits: Vec<String>,
    /// The Best-of-N candidates (JSONL: instruction, question, candidates), for `best-of-n`
    /// and `rl-burst`; scripts/make-best-of-n.sh regenerates it.
    #[arg(long, default_value = "bench/best-of-n.jsonl")]
    pub bon_data: PathBuf,
    /// ProcessBench-shaped traces to score (JSON array or JSONL): gsm8k.json of the full
    /// ProcessBench set (Qwen/ProcessBench on Hugging Face, four JSON splits; scripts/bench.sh
    /// passes $RETRACE_PROCESSBENCH_DIR/gsm8k.json); tests/fixtures/processbench is a subset.
    #[arg(long)]
    pub data: PathBuf,
    /// Score the first N traces of --data (of each tree split for `tree`).
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
    /// Model folder (Hugging Face layout) for the server the bench starts, for token counts and
    /// the matmul shapes [default: CACHE/smollm2].
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
    /// CACHE/bench/SmolLM2-135M-Instruct.f32.gguf, written by scripts/bench.sh].
    #[arg(long)]
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
    pub targets: report::Targets,
}

/// One trace as both contenders see it, with the token count chat-lm scores.
#[derive(Debug, Clone)]
pub struct BenchTrace {
    /// As chat-lm words it (options rendered in).
    pub question: String,
    pub steps: Vec<String>,
    pub tokens: usize,
}

/// The traces of a run, and their totals.
#[derive(Debug)]
pub struct Workload {
    pub traces: Vec<BenchTrace>,
    pub tokens: usize,
    pub steps: usize,
    pub flops: f64,
}

/// What one contender did with the whole workload at one concurrency.
#[derive(Debug, Clone)]
pub struct Run {
    pub wall: Duration,
    /// Per trace, sorted.
    pub latencies: Vec<Duration>,
    /// Per trace, in workload order.
    pub scores: Vec<Vec<f32>>,
    /// Steps whose score could not be read in full (llama-server: '+' or '-' outside the
    /// listed logprobs).
    pub misses: usize,
}

/// Scores every trace of `work` with `concurrency` workers, each taking the next unscored trace;
/// `score(i)` gives trace i's step scores and its logprob misses. Both contenders run this loop,
/// so they are driven the same way.
async fn drive<F, Fut>(work: &Arc<Workload>, concurrency: usize, score: F) -> anyhow::Result<Run>
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = anyhow::Result<(Vec<f32>, usize)>> + Send,
{
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let n = work.traces.len();
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
    Ok(Run::collect(started.elapsed(), n, results))
}

impl Run {
    /// From each trace's (index, latency, scores, misses).
    fn collect(wall: Duration, n: usize, done: Vec<(usize, Duration, Vec<f32>, usize)>) -> Run {
        let mut scores = vec![Vec::new(); n];
        let mut latencies = Vec::with_capacity(done.len());
        let mut misses = 0;
        for (i, l, s, m) in done {
            scores[i] = s;
            latencies.push(l);
            misses += m;
        }
        latencies.sort();
        Run {
            wall,
            latencies,
            scores,
            misses,
        }
    }
}

impl Workload {
    fn load(opts: &BenchOptions, formatter: &Formatter, shapes: &Shapes) -> anyhow::Result<Self> {
        let mut traces = Vec::new();
        let (mut tokens, mut steps, mut flops) = (0, 0, 0.0);
        for record in read_records(&opts.data)?.take(opts.limit) {
            let r = record?;
            // The server's own edge parsing, so the text scored here is the text it scores.
            let parts = retrace::api::TraceParts {
                question: r.question,
                options: r.options,
                steps: r.steps,
                text: r.text.unwrap_or_default(),
                ..Default::default()
            };
            let trace = parts
                .parse(&retrace::field::FieldPath::key("trace"))
                .map_err(|e| anyhow::anyhow!("{}: trace {}: {e}", opts.data.display(), r.id))?;
            let encoded = formatter.encode(&trace)?;
            tokens += encoded.ids.len();
            steps += encoded.positions.len();
            flops += shapes.trace_flops(encoded.ids.len(), encoded.positions.len());
            traces.push(BenchTrace {
                question: retrace::prm::format::question_text(&trace),
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
        .unwrap_or_else(|| retrace::env::Env::process().cache_dir())
}

/// Runs the benchmark the flags name and prints its report.
pub async fn bench(opts: BenchOptions) -> anyhow::Result<()> {
    if opts.rounds == 0 || opts.limit == 0 || opts.concurrency.contains(&0) {
        bail!("--rounds, --limit and every --concurrency must be at least 1");
    }
    if opts.workload == [reuse::Kind::Plain] {
        return speed(opts).await.map(drop);
    }
    if opts.workload.contains(&reuse::Kind::Plain) {
        bail!("--workload plain is the speed table; run it on its own");
    }
    let cache = cache_dir(&opts);
    let model = opts.model.clone().unwrap_or_else(|| cache.join("smollm2"));
    let text = reuse::bench(&opts, &opts.workload, &model, &cache).await?;
    println!("{text}");
    if let Some(out) = &opts.out {
        std::fs::write(out, &text).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// The speed table: retrace against llama-server on the same traces.
async fn speed(opts: BenchOptions) -> anyhow::Result<report::Report> {
    let cache = cache_dir(&opts);
    let model = opts.model.clone().unwrap_or_else(|| cache.join("smollm2"));
    let family = Family::parse(&opts.family)
        .with_context(|| format!("unknown --family {:?}", opts.family))?;
    let formatter = Formatter::load(family, &model).map_err(anyhow::Error::msg)?;
    let shapes = Shapes::load(&model)?;
    let work = Arc::new(Workload::load(&opts, &formatter, &shapes)?);
    let logs = std::env::temp_dir().join(format!("retrace-bench-{}", std::process::id()));
    std::fs::create_dir_all(&logs)?;
    eprintln!(
        "bench: {} traces, {} tokens, {} steps; logs in {}",
        work.traces.len(),
        work.tokens,
        work.steps,
        logs.display()
    );

    // The matmul peak first, while nothing else of ours runs.
    eprintln!("bench: measuring the f32 matmul peak");
    let peak = gemm::peak(&shapes, &opts.gemm_rows, 5)?;

    let mut server = match &opts.server {
        Some(_) => None,
        None => {
            // The traces repeat across rounds and concurrencies: a prefix cache would answer all
            // but the first from memory. Speed is measured computing every token (a --set wins).
            let cold = BenchOptions {
                set: [
                    vec!["evaluator.bench.prefix_cache_mb=0".into()],
                    opts.set.clone(),
                ]
                .concat(),
                ..opts.clone()
            };
            Some(start_server(&cold, &model, &logs, "bench").map(|(g, a, _)| (g, a))?)
        }
    };
    let (addr, evaluator) = match (&opts.server, &server) {
        (Some(addr), _) => (addr.clone(), String::new()),
        (None, Some((_, addr))) => (addr.clone(), "bench".to_string()),
        (None, None) => unreachable!("started above"),
    };
    let client = match &mut server {
        Some((guard, _)) => connect_child(guard, &addr).await?,
        None => match Backend::connect(&addr, None, None, Duration::from_secs(60))
            .await
            .with_context(|| format!("connecting to {addr}"))?
        {
            Backend::Remote { client, .. } => *client,
            Backend::Local { .. } => bail!("expected a remote backend"),
        },
    };

    let llama = if opts.no_llama {
        None
    } else {
        let (bin, gguf) = llama_paths(&opts, &cache);
        let longest = work.traces.iter().map(|t| t.tokens).max().unwrap_or(0);
        // Room for the longest conversation plus template drift, rounded up.
        let ctx = (longest + 256).next_multiple_of(256);
        let parallel = opts.concurrency.iter().copied().max().unwrap_or(1);
        eprintln!("bench: starting llama-server ({})", bin.display());
        Some(
            llama::LlamaServer::start(
                &bin,
                &gguf,
                parallel,
                ctx,
                &opts,
                &logs.join("llama-server.log"),
            )
            .await?,
        )
    };

    // Warm-up (not measured): first-touch pages, thread pools, caches' steady state.
    let warm = Arc::new(Workload {
        traces: work.traces.iter().take(4).cloned().collect(),
        tokens: 0,
        steps: 0,
        flops: 0.0,
    });
    grpc::run(&client, &evaluator, &warm, 4).await?;
    if let Some(l) = &llama {
        l.run(&warm, 4).await?;
    }

    let mut runs = Vec::new();
    for round in 0..opts.rounds {
        for &c in &opts.concurrency {
            // Alternate who goes first, so drift on a shared machine hits both alike.
            let llama_first = round % 2 == 1;
            let mut order = vec![report::Contender::Retrace];
            if llama.is_some() {
                match llama_first {
                    true => order.insert(0, report::Contender::Llama),
                    false => order.push(report::Contender::Llama),
                }
            }
            for who in order {
                let started = Instant::now();
                let run = match (who, &llama) {
                    (report::Contender::Retrace, _) => {
                        grpc::run(&client, &evaluator, &work, c).await?
                    }
                    (report::Contender::Llama, Some(l)) => l.run(&work, c).await?,
                    (report::Contender::Llama, None) => unreachable!("only run when started"),
                };
                eprintln!(
                    "bench: round {} {:>13} c={c:<3} {:6.2} s",
                    round + 1,
                    who.name(),
                    started.elapsed().as_secs_f64()
                );
                runs.push(report::Measured {
                    who,
                    concurrency: c,
                    round,
                    run,
                });
            }
        }
    }

    let retrace_rss = match &server {
        Some((guard, _)) => Some(guard.peak_rss()?),
        None => None,
    };
    let llama_rss = match &llama {
        Some(l) => Some(l.guard.peak_rss()?),
        None => None,
    };
    let weights = weight_bytes(&model)?;
    let scaling = if opts.scaling {
        // Nothing else of ours may compete for the cores during the sweep.
        drop(llama);
        drop(server);
        eprintln!("bench: scaling sweep");
        let points = scaling::sweep(
            &model,
            &opts.scaling_lens,
            &opts.scaling_batches,
            opts.scaling_max_tokens,
            2,
            |p| {
                eprintln!(
                    "bench: len {:5} batch {:3}: {:8.3} s, {:7.0} tokens/s, {:6.1} GFLOP/s",
                    p.len, p.batch, p.seconds, p.tokens_per_s, p.gflops
                )
            },
        )?;
        let title = format!(
            "retrace scaling: {} (f32, CPU)",
            model.file_name().unwrap_or_default().to_string_lossy()
        );
        let svg = scaling::svg(&points, &peak, &title)?;
        if let Some(dir) = opts.svg.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(&opts.svg, svg)
            .with_context(|| format!("writing {}", opts.svg.display()))?;
        Some(points)
    } else {
        None
    };

    let report = report::Report {
        model: model
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into(),
        family: opts.family.clone(),
        data: opts.data.clone(),
        work: work.clone(),
        rounds: opts.rounds,
        runs,
        peak,
        retrace_rss,
        llama_rss,
        weights,
        scaling,
        svg: opts.scaling.then(|| opts.svg.clone()),
        top_logprobs: opts.llama_top_logprobs,
        targets: opts.targets.clone(),
    };
    let text = report.markdown();
    println!("{text}");
    if let Some(out) = &opts.out {
        std::fs::write(out, &text).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(report)
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
) -> anyhow::Result<retrace::api::pb::evaluator_client::EvaluatorClient<tonic::transport::Channel>>
{
    let started = Instant::now();
    loop {
        guard.check_alive()?;
        match Backend::connect(addr, None, None, Duration::ZERO).await {
            Ok(Backend::Remote { client, .. }) => return Ok(*client),
            Ok(Backend::Local { .. }) => bail!("expected a remote backend"),
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
