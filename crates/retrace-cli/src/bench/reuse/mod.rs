//! `retrace bench --workload tree,best-of-n,rl-burst,processbench`: what reusing computed tokens
//! buys, on the loops retrace serves, through the real gRPC path. Three retrace servers on the
//! same model: the prefix cache on; `prefix_cache_mb = 0` (in-batch sharing still on); and no
//! reuse at all (`prefix_sharing = false` too), plus llama-server's per-step procedure (its slot
//! cache makes it incremental) for tree search. Rounds alternate who goes first; every round's
//! traces open with the round's number, so no round reuses another's work.
//!
//! The bound on a workload's speed-up is its token counts: tokens it scores without reuse over
//! tokens computed with it (the cache server's counters).
//!
//! - `report`: the table, and the verdicts on the targets the flags give.

mod report;

use super::grpc::again_if_cut;
use super::llama::LlamaServer;
use super::procs::Guard;
use super::{BenchOptions, BenchTrace, Workload};
use crate::common::read_records;
use anyhow::{Context, bail};
use report::ReuseSample;
use retrace::pb;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;
use tonic::transport::Channel;

/// A workload of the reuse bench.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Kind {
    /// The speed table: retrace against llama-server on plain ProcessBench (the default).
    Plain,
    /// PRM-guided search: every prefix of 1, 2, ... n steps of each trace, in order.
    Tree,
    /// Rank: 16 sampled candidates per question behind one long few-shot prompt.
    BestOfN,
    /// An RL reward step: groups of 8 samples per prompt, all sent at once.
    RlBurst,
    /// Plain ProcessBench, each trace once: what the cache costs when nothing repeats.
    Processbench,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Plain => "plain",
            Kind::Tree => "tree search",
            Kind::BestOfN => "Best-of-N",
            Kind::RlBurst => "RL burst",
            Kind::Processbench => "ProcessBench, no repeats",
        }
    }

    /// Requests in flight: part of each workload's definition.
    fn concurrency(self) -> usize {
        match self {
            Kind::Tree => 4,
            Kind::BestOfN => 1,
            Kind::RlBurst => 64,
            Kind::Plain | Kind::Processbench => 16,
        }
    }
}

/// A contender of the reuse bench.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Who {
    Cache,
    NoCache,
    NoReuse,
    Llama,
}

impl Who {
    fn name(self) -> &'static str {
        match self {
            Who::Cache => "retrace, prefix cache",
            Who::NoCache => "retrace, prefix_cache_mb = 0",
            Who::NoReuse => "retrace, no reuse",
            Who::Llama => "llama-server, per step",
        }
    }

    fn sets(self) -> &'static [&'static str] {
        match self {
            Who::Cache | Who::Llama => &[],
            Who::NoCache => &["evaluator.bench.prefix_cache_mb=0"],
            Who::NoReuse => &[
                "evaluator.bench.prefix_cache_mb=0",
                "evaluator.bench.prefix_sharing=false",
            ],
        }
    }
}

/// One unit a client sends: a sequence of requests that must go in order (a search's
/// prefixes), or a single Evaluate or Rank.
#[derive(Debug, Clone)]
enum ReuseJob {
    Evaluate(Vec<pb::EvaluateRequest>),
    Rank(pb::RankRequest),
}

struct Server {
    guard: Guard,
    client: pb::evaluator_client::EvaluatorClient<Channel>,
    metrics: String,
}

/// The three retrace servers, and llama-server for tree search.
struct Contenders {
    servers: Vec<(Who, Server)>,
    llama: Option<LlamaServer>,
}

/// Runs every reuse workload in `kinds` and returns the report.
pub(super) async fn bench(
    opts: &BenchOptions,
    kinds: &[Kind],
    model: &Path,
    cache: &Path,
) -> anyhow::Result<String> {
    let logs = std::env::temp_dir().join(format!("retrace-bench-reuse-{}", std::process::id()));
    std::fs::create_dir_all(&logs)?;
    let mut servers = Vec::new();
    for who in [Who::Cache, Who::NoCache, Who::NoReuse] {
        eprintln!("bench: starting {}", who.name());
        servers.push((who, start(opts, model, &logs, who).await?));
    }
    let llama = match kinds.contains(&Kind::Tree) && !opts.no_llama {
        true => Some(start_llama(opts, cache, &logs).await?),
        false => None,
    };
    let contenders = Contenders { servers, llama };
    let fits = Fits::load(opts, model)?;
    let mut runs = Vec::new();
    for &kind in kinds {
        runs.extend(measure(opts, kind, &contenders, &fits).await?);
    }
    // Every server's peak, so the cache's share of the cache server's shows against the others.
    let mut rss = Vec::new();
    for (who, s) in &contenders.servers {
        rss.push((*who, s.guard.peak_rss()?));
    }
    let weights = super::weight_bytes(model)?;
    Ok(report::report(opts, kinds, &runs, &rss, weights))
}

/// One workload: a warm-up round, then --rounds measured ones, each contender once per round,
/// who goes first rotating.
async fn measure(
    opts: &BenchOptions,
    kind: Kind,
    contenders: &Contenders,
    fits: &Fits,
) -> anyhow::Result<Vec<ReuseSample>> {
    let mut order: Vec<Who> = vec![Who::Cache, Who::NoCache, Who::NoReuse];
    if kind == Kind::Tree && contenders.llama.is_some() {
        order.push(Who::Llama);
    }
    let mut runs = Vec::new();
    for round in 0..=opts.rounds {
        // Round 0 warms up (pages, pools) and is not measured.
        let marker = match round {
            0 => "Warm-up.".to_string(),
            r => format!("Round {r}."),
        };
        let (mut jobs, mut traces) = jobs(opts, kind, &marker, fits)?;
        if round == 0 {
            jobs.truncate(2);
            traces.traces.truncate(2);
        }
        let (jobs, traces) = (Arc::new(jobs), Arc::new(traces));
        let n = order.len();
        for i in 0..n {
            let who = order[(i + round) % n];
            let started = Instant::now();
            let tokens = run_one(who, kind, contenders, &jobs, &traces).await?;
            let wall = started.elapsed();
            eprintln!(
                "bench: {} round {round} {:>30} {:7.2} s",
                kind.name(),
                who.name(),
                wall.as_secs_f64()
            );
            if round > 0 {
                runs.push(ReuseSample {
                    workload: kind,
                    who,
                    wall,
                    tokens,
                });
            }
        }
    }
    Ok(runs)
}

/// One contender through one round's work; for a retrace server, the tokens it computed and
/// reused meanwhile.
async fn run_one(
    who: Who,
    kind: Kind,
    contenders: &Contenders,
    jobs: &Arc<Vec<ReuseJob>>,
    traces: &Arc<Workload>,
) -> anyhow::Result<Option<(f64, f64)>> {
    if who == Who::Llama {
        let l = contenders.llama.as_ref().expect("started for tree");
        l.run(traces, kind.concurrency()).await?;
        return Ok(None);
    }
    let server = &contenders
        .servers
        .iter()
        .find(|(w, _)| *w == who)
        .expect("started")
        .1;
    let before = counters(&server.metrics).await?;
    send(&server.client, jobs, kind.concurrency()).await?;
    let after = counters(&server.metrics).await?;
    Ok(Some((after.0 - before.0, after.1 - before.1)))
}

/// Starts `retrace serve` for one contender and connects.
async fn start(opts: &BenchOptions, model: &Path, logs: &Path, who: Who) -> anyhow::Result<Server> {
    let label = match who {
        Who::Cache => "cache",
        Who::NoCache => "nocache",
        Who::NoReuse => "noreuse",
        Who::Llama => "llama",
    };
    let mut opts = opts.clone();
    opts.set.extend(who.sets().iter().map(|s| s.to_string()));
    let (mut guard, addr, metrics) = super::start_server(&opts, model, logs, label)?;
    let client = super::connect_child(&mut guard, &addr).await?;
    Ok(Server {
        guard,
        client,
        metrics: format!("http://{metrics}/metrics"),
    })
}

async fn start_llama(
    opts: &BenchOptions,
    cache: &Path,
    logs: &Path,
) -> anyhow::Result<LlamaServer> {
    let (bin, gguf) = super::llama_paths(opts, cache);
    eprintln!("bench: starting llama-server ({})", bin.display());
    LlamaServer::start(
        &bin,
        &gguf,
        Kind::Tree.concurrency(),
        4096,
        opts,
        &logs.join("llama-server.log"),
    )
    .await
}

/// The server's tokens computed and reused so far.
async fn counters(url: &str) -> anyhow::Result<(f64, f64)> {
    let http = retrace::http_client()?;
    let text = http.get(url).send().await?.text().await?;
    let read = |kind: &str| {
        let key = format!(
            "{}{{evaluator=\"bench\",kind=\"{kind}\"}} ",
            retrace::PREFIX_TOKENS
        );
        text.lines()
            .find_map(|l| l.strip_prefix(&key))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    Ok((read("computed"), read("reused")))
}

/// Sends every job, `concurrency` at a time, each job's requests in order.
async fn send(
    client: &pb::evaluator_client::EvaluatorClient<Channel>,
    jobs: &Arc<Vec<ReuseJob>>,
    concurrency: usize,
) -> anyhow::Result<()> {
    let (client, jobs) = (client.clone(), jobs.clone());
    super::drive(jobs.len(), concurrency, move |i| {
        let (client, jobs) = (client.clone(), jobs.clone());
        async move {
            match &jobs[i] {
                ReuseJob::Evaluate(requests) => {
                    for r in requests {
                        again_if_cut(|| {
                            let (mut client, r) = (client.clone(), r.clone());
                            async move { client.evaluate(r).await }
                        })
                        .await
                        .context("Evaluate")?;
                    }
                }
                ReuseJob::Rank(r) => {
                    again_if_cut(|| {
                        let (mut client, r) = (client.clone(), r.clone());
                        async move { client.rank(r).await }
                    })
                    .await
                    .context("Rank")?;
                }
            }
            Ok((Vec::new(), 0))
        }
    })
    .await
    .map(drop)
}

/// A Best-of-N line: the instruction every candidate follows, the question, the candidates.
#[derive(serde::Deserialize)]
struct Candidates {
    instruction: String,
    question: String,
    candidates: Vec<String>,
}

fn read_candidates(path: &Path) -> anyhow::Result<Vec<Candidates>> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!(
            "reading {} (scripts/bench/make-best-of-n.sh writes it)",
            path.display()
        )
    })?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).with_context(|| format!("{}: line {}", path.display(), i + 1))
        })
        .collect()
}

/// A trace with its steps; traces of fewer than two steps are left out of tree search.
fn evaluate(question: String, steps: Vec<String>) -> pb::EvaluateRequest {
    pb::EvaluateRequest {
        evaluator: "bench".into(),
        trace: Some(pb::Trace {
            question,
            steps,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The workload's jobs for one round (questions opening with `marker`), and for tree search
/// the same traces for llama-server.
fn jobs(
    opts: &BenchOptions,
    kind: Kind,
    marker: &str,
    fits: &Fits,
) -> anyhow::Result<(Vec<ReuseJob>, Workload)> {
    let (jobs, traces) = match kind {
        Kind::Plain => bail!("the plain workload is the speed table"),
        Kind::Tree | Kind::Processbench => trace_jobs(opts, kind, marker, fits)?,
        Kind::BestOfN => (rank_jobs(opts, marker)?, Vec::new()),
        Kind::RlBurst => (burst_jobs(opts, marker)?, Vec::new()),
    };
    if jobs.is_empty() {
        bail!("the {} workload has no traces", kind.name());
    }
    let work = Workload {
        traces,
        tokens: 0,
        steps: 0,
        flops: 0.0,
    };
    Ok((jobs, work))
}

/// Tree search (every prefix of a trace, in order) or plain ProcessBench (each trace once):
/// the first --limit traces of each file that fit the model.
fn trace_jobs(
    opts: &BenchOptions,
    kind: Kind,
    marker: &str,
    fits: &Fits,
) -> anyhow::Result<(Vec<ReuseJob>, Vec<BenchTrace>)> {
    let files: Vec<PathBuf> = match kind {
        Kind::Tree => opts.tree_splits.iter().map(|s| split(opts, s)).collect(),
        _ => vec![opts.data.clone()],
    };
    let (mut jobs, mut traces) = (Vec::new(), Vec::new());
    for file in files {
        for record in read_records(&file)?.take(opts.limit) {
            let r = record?;
            let question = format!("{marker} {}", r.question.trim());
            let steps: Vec<String> = r.steps.iter().map(|s| s.trim().to_string()).collect();
            if steps.iter().any(|s| s.is_empty())
                || steps.is_empty()
                || !fits.check(&question, &steps)
            {
                continue;
            }
            match kind {
                Kind::Tree if steps.len() < 2 => continue,
                Kind::Tree => jobs.push(ReuseJob::Evaluate(
                    (1..=steps.len())
                        .map(|k| evaluate(question.clone(), steps[..k].to_vec()))
                        .collect(),
                )),
                _ => jobs.push(ReuseJob::Evaluate(vec![evaluate(
                    question.clone(),
                    steps.clone(),
                )])),
            }
            traces.push(BenchTrace {
                question,
                steps,
                tokens: 0,
            });
        }
    }
    Ok((jobs, traces))
}

/// Best-of-N: one Rank of every candidate per question.
fn rank_jobs(opts: &BenchOptions, marker: &str) -> anyhow::Result<Vec<ReuseJob>> {
    let jobs = read_candidates(&opts.bon_data)?
        .into_iter()
        .map(|c| {
            ReuseJob::Rank(pb::RankRequest {
                evaluator: "bench".into(),
                question: format!("{marker} {}\n\nQuestion: {}", c.instruction, c.question),
                candidates: c
                    .candidates
                    .iter()
                    .map(|t| pb::Trace {
                        text: t.clone(),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            })
        })
        .collect();
    Ok(jobs)
}

/// The RL burst: an Evaluate for each of the first 8 candidates of every question.
fn burst_jobs(opts: &BenchOptions, marker: &str) -> anyhow::Result<Vec<ReuseJob>> {
    let mut jobs = Vec::new();
    for c in read_candidates(&opts.bon_data)? {
        for t in c.candidates.iter().take(8) {
            let request = pb::EvaluateRequest {
                evaluator: "bench".into(),
                trace: Some(pb::Trace {
                    question: format!("{marker} {}", c.question),
                    text: t.clone(),
                    ..Default::default()
                }),
                ..Default::default()
            };
            jobs.push(ReuseJob::Evaluate(vec![request]));
        }
    }
    Ok(jobs)
}

/// Which traces fit the model's context (the longest olympiadbench ones may not).
struct Fits {
    formatter: retrace::Formatter,
    limit: usize,
}

impl Fits {
    fn load(opts: &BenchOptions, model: &Path) -> anyhow::Result<Fits> {
        let formatter = super::speed::formatter(opts, model)?;
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(model.join("config.json"))?)?;
        let limit = config["max_position_embeddings"].as_u64().unwrap_or(2048) as usize;
        Ok(Fits { formatter, limit })
    }

    fn check(&self, question: &str, steps: &[String]) -> bool {
        let trace = retrace::Trace::of_steps(question, steps);
        self.formatter
            .encode(&trace)
            .is_ok_and(|e| e.ids.len() <= self.limit)
    }
}

/// A ProcessBench split's file beside --data.
fn split(opts: &BenchOptions, name: &str) -> PathBuf {
    opts.data
        .parent()
        .unwrap_or(Path::new("."))
        .join(format!("{name}.json"))
}
