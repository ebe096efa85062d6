//! `retrace bench --workload tree,best-of-n,rl-burst,processbench`: what reusing computed tokens
//! buys, on the loops retrace serves, through the real gRPC path. Three retrace servers on the
//! same model: the prefix cache on; `prefix_cache_mb = 0` (in-batch sharing still on); and no
//! reuse at all (`prefix_sharing = false` too), plus llama-server's per-step procedure (its slot
//! cache makes it incremental) for tree search. Rounds alternate who goes first; every round's
//! traces open with the round's number, so no round reuses another's work.
//!
//! The bound on a workload's speed-up is its token counts: tokens it scores without reuse over
//! tokens computed with it (the cache server's counters).

use super::llama::LlamaServer;
use super::procs::Guard;
use super::{BenchOptions, BenchTrace, Workload};
use crate::eval::read_records;
use anyhow::{Context, bail};
use retrace::api::pb;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// A workload of the reuse bench.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
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
enum Job {
    Evaluate(Vec<pb::EvaluateRequest>),
    Rank(pb::RankRequest),
}

struct Server {
    guard: Guard,
    client: pb::evaluator_client::EvaluatorClient<Channel>,
    metrics: String,
}

/// One measured run.
#[derive(Debug, Clone)]
struct Measured {
    workload: Kind,
    who: Who,
    wall: Duration,
    /// Tokens computed and reused, from the server's counters (retrace only).
    tokens: Option<(f64, f64)>,
}

/// Runs every reuse workload in `kinds` and prints the table.
pub async fn bench(
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
    let fits = Fits::load(opts, model)?;
    let mut runs = Vec::new();
    for &kind in kinds {
        let mut contenders: Vec<Who> = vec![Who::Cache, Who::NoCache, Who::NoReuse];
        if kind == Kind::Tree && llama.is_some() {
            contenders.push(Who::Llama);
        }
        for round in 0..=opts.rounds {
            // Round 0 warms up (pages, pools) and is not measured.
            let marker = match round {
                0 => "Warm-up.".to_string(),
                r => format!("Round {r}."),
            };
            let (mut jobs, mut traces) = jobs(opts, kind, &marker, &fits)?;
            if round == 0 {
                jobs.truncate(2);
                traces.traces.truncate(2);
            }
            let traces = Arc::new(traces);
            let n = contenders.len();
            for i in 0..n {
                let who = contenders[(i + round) % n];
                let started = Instant::now();
                let tokens = match who {
                    Who::Llama => {
                        let l = llama.as_ref().expect("started for tree");
                        l.run(&traces, kind.concurrency()).await?;
                        None
                    }
                    _ => {
                        let server = &servers.iter().find(|(w, _)| *w == who).expect("started").1;
                        let before = counters(&server.metrics).await?;
                        drive(&server.client, &jobs, kind.concurrency()).await?;
                        let after = counters(&server.metrics).await?;
                        Some((after.0 - before.0, after.1 - before.1))
                    }
                };
                let wall = started.elapsed();
                eprintln!(
                    "bench: {} round {round} {:>30} {:7.2} s",
                    kind.name(),
                    who.name(),
                    wall.as_secs_f64()
                );
                if round > 0 {
                    runs.push(Measured {
                        workload: kind,
                        who,
                        wall,
                        tokens,
                    });
                }
            }
        }
    }
    // Every server's peak, so the cache's share of the cache server's shows against the others.
    let mut rss = Vec::new();
    for (who, s) in &servers {
        rss.push((*who, s.guard.peak_rss()?));
    }
    let weights = super::weight_bytes(model)?;
    Ok(report(opts, kinds, &runs, &rss, weights))
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
    let http = retrace::upstream::http_client()?;
    let text = http.get(url).send().await?.text().await?;
    let read = |kind: &str| {
        let key = format!(
            "{}{{evaluator=\"bench\",kind=\"{kind}\"}} ",
            retrace::metrics::PREFIX_TOKENS
        );
        text.lines()
            .find_map(|l| l.strip_prefix(&key))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    Ok((read("computed"), read("reused")))
}

/// Sends every job, `concurrency` at a time, each job's requests in order.
async fn drive(
    client: &pb::evaluator_client::EvaluatorClient<Channel>,
    jobs: &[Job],
    concurrency: usize,
) -> anyhow::Result<()> {
    use futures::StreamExt;
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(jobs.iter().cloned())
        .map(|job| {
            let mut client = client.clone();
            async move {
                match job {
                    Job::Evaluate(requests) => {
                        for r in requests {
                            client.evaluate(r).await.context("Evaluate")?;
                        }
                    }
                    Job::Rank(r) => {
                        client.rank(r).await.context("Rank")?;
                    }
                }
                anyhow::Ok(())
            }
        })
        .buffer_unordered(concurrency.max(1))
        .collect()
        .await;
    results.into_iter().collect()
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
            "reading {} (scripts/make-best-of-n.sh writes it)",
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
) -> anyhow::Result<(Vec<Job>, Workload)> {
    let mut jobs = Vec::new();
    let mut traces = Vec::new();
    match kind {
        Kind::Plain => bail!("the plain workload is the speed table"),
        Kind::Tree | Kind::Processbench => {
            let files: Vec<PathBuf> = match kind {
                Kind::Tree => opts.tree_splits.iter().map(|s| split(opts, s)).collect(),
                _ => vec![opts.data.clone()],
            };
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
                        Kind::Tree => jobs.push(Job::Evaluate(
                            (1..=steps.len())
                                .map(|k| evaluate(question.clone(), steps[..k].to_vec()))
                                .collect(),
                        )),
                        _ => jobs.push(Job::Evaluate(vec![evaluate(
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
        }
        Kind::BestOfN => {
            for c in read_candidates(&opts.bon_data)? {
                jobs.push(Job::Rank(pb::RankRequest {
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
                }));
            }
        }
        Kind::RlBurst => {
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
                    jobs.push(Job::Evaluate(vec![request]));
                }
            }
        }
    }
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

/// Which traces fit the model's context (the longest olympiadbench ones may not).
struct Fits {
    formatter: retrace::prm::format::Formatter,
    limit: usize,
}

impl Fits {
    fn load(opts: &BenchOptions, model: &Path) -> anyhow::Result<Fits> {
        let family = retrace::prm::format::Family::parse(&opts.family)
            .with_context(|| format!("unknown --family {:?}", opts.family))?;
        let formatter =
            retrace::prm::format::Formatter::load(family, model).map_err(anyhow::Error::msg)?;
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(model.join("config.json"))?)?;
        let limit = config["max_position_embeddings"].as_u64().unwrap_or(2048) as usize;
        Ok(Fits { formatter, limit })
    }

    fn check(&self, question: &str, steps: &[String]) -> bool {
        let trace = retrace::trace::Trace::of_steps(question, steps);
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The Markdown table, with each workload's speed-ups, bounds and targets.
fn report(
    opts: &BenchOptions,
    kinds: &[Kind],
    runs: &[Measured],
    rss: &[(Who, u64)],
    weights: u64,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Medians of {} alternating rounds; speed-up against no reuse; the bound is tokens scored \
         over tokens the prefix cache server computed.\n",
        opts.rounds
    );
    let _ = writeln!(
        out,
        "| workload | contender | seconds | tokens computed | tokens reused | speed-up | bound | share of bound |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|---|---|");
    let mut verdicts = Vec::new();
    for &kind in kinds {
        let of = |who: Who| -> Vec<&Measured> {
            runs.iter()
                .filter(|m| m.workload == kind && m.who == who)
                .collect()
        };
        let secs = |who: Who| median(of(who).iter().map(|m| m.wall.as_secs_f64()).collect());
        let base = secs(Who::NoReuse);
        let (computed, reused) = {
            let ms = of(Who::Cache);
            (
                median(ms.iter().filter_map(|m| m.tokens.map(|t| t.0)).collect()),
                median(ms.iter().filter_map(|m| m.tokens.map(|t| t.1)).collect()),
            )
        };
        let bound = (computed + reused) / computed;
        for who in [Who::Cache, Who::NoCache, Who::NoReuse, Who::Llama] {
            let ms = of(who);
            if ms.is_empty() {
                continue;
            }
            let s = secs(who);
            let tokens = |i: usize| {
                median(
                    ms.iter()
                        .filter_map(|m| m.tokens.map(|t| if i == 0 { t.0 } else { t.1 }))
                        .collect(),
                )
            };
            let (c, r) = (tokens(0), tokens(1));
            let cell = |v: f64| {
                if v.is_nan() {
                    "–".to_string()
                } else {
                    format!("{v:.0}")
                }
            };
            let speedup = base / s;
            let share = match who {
                Who::Cache => format!("{:.0}%", 100.0 * speedup / bound),
                _ => "–".into(),
            };
            let bound_cell = match who {
                Who::Cache => format!("{bound:.2}x"),
                _ => "–".into(),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {s:.2} | {} | {} | {speedup:.2}x | {bound_cell} | {share} |",
                kind.name(),
                who.name(),
                cell(c),
                cell(r),
            );
        }
        let cache = secs(Who::Cache);
        match kind {
            Kind::Tree | Kind::BestOfN => {
                let share = (base / cache) / bound;
                verdicts.push(format!(
                    "{}: {:.0}% of the token bound ({:.2}x of {bound:.2}x; target 80%): {}",
                    kind.name(),
                    100.0 * share,
                    base / cache,
                    if share >= 0.8 { "met" } else { "MISSED" }
                ));
                if kind == Kind::Tree && !of(Who::Llama).is_empty() {
                    let vs = secs(Who::Llama) / cache;
                    verdicts.push(format!(
                        "tree search: {vs:.2}x llama-server's per-step procedure (target 1.5x): {}",
                        if vs >= 1.5 { "met" } else { "MISSED" }
                    ));
                }
            }
            Kind::Processbench => {
                let slower = cache / secs(Who::NoCache) - 1.0;
                verdicts.push(format!(
                    "ProcessBench with nothing repeated: the cache costs {:+.1}% against prefix_cache_mb = 0 (target within 3%): {}",
                    100.0 * slower,
                    if slower <= 0.03 { "met" } else { "MISSED" }
                ));
            }
            _ => {}
        }
    }
    if !rss.is_empty() {
        let peaks: Vec<String> = rss
            .iter()
            .map(|(who, b)| format!("{} {:.0} MiB", who.name(), *b as f64 / 1048576.0))
            .collect();
        verdicts.push(format!("peak RSS by server: {}", peaks.join("; ")));
    }
    if let Some(&(_, rss)) = rss.iter().find(|(w, _)| *w == Who::Cache) {
        let budget = defaults_budget(opts);
        let limit = 1.5 * weights as f64 + budget as f64 + (256u64 << 20) as f64;
        verdicts.push(format!(
            "peak RSS of the cache server {:.0} MiB; 1.5x the weights ({:.0} MiB) + the cache budget ({:.0} MiB) + 256 MiB = {:.0} MiB: {}",
            rss as f64 / 1048576.0,
            weights as f64 / 1048576.0,
            budget as f64 / 1048576.0,
            limit / 1048576.0,
            if (rss as f64) <= limit { "met" } else { "MISSED" }
        ));
    }
    out.push('\n');
    for v in verdicts {
        let _ = writeln!(out, "- {v}");
    }
    out
}

/// The cache server's budget in bytes: its --set, else the default.
fn defaults_budget(opts: &BenchOptions) -> usize {
    let mb = opts
        .set
        .iter()
        .rev()
        .find_map(|s| s.strip_prefix("evaluator.bench.prefix_cache_mb="))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(retrace::prm::defaults::PREFIX_CACHE_MB);
    mb << 20
}
