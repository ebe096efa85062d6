//! `retrace bench --workload tree,beam,best-of-n,rl-burst,processbench`: what reusing computed tokens
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

mod beam;
mod jobs;
mod report;
mod scrape;
mod source;

use super::grpc::again_if_cut;
use super::llama::LlamaServer;
use super::procs::Guard;
use super::{BenchOptions, BenchTrace, Workload};
use anyhow::Context;
use beam::{BeamJob, Scorer};
use jobs::{Fits, jobs};
use report::ReuseSample;
use retrace::pb;
use scrape::Counters;
use std::path::Path;
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
    /// PRM-guided beam search: 4 beams kept, each extended by 4 candidate steps a depth.
    Beam,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Plain => "plain",
            Kind::Tree => "tree search",
            Kind::BestOfN => "Best-of-N",
            Kind::RlBurst => "RL burst",
            Kind::Processbench => "ProcessBench, no repeats",
            Kind::Beam => "beam search",
        }
    }

    /// The searches, which llama-server runs too (by its per-step procedure) unless --no-llama.
    fn llama_runs(self) -> bool {
        matches!(self, Kind::Tree | Kind::Beam)
    }

    /// Callers (requests, or searches, in flight) unless --callers says otherwise.
    fn concurrency(self) -> usize {
        match self {
            Kind::Tree | Kind::Beam => 4,
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
    /// A search whose requests depend on the scores of those before.
    Beam(BeamJob),
}

struct Server {
    guard: Guard,
    client: pb::evaluator_client::EvaluatorClient<Channel>,
    metrics: String,
}

/// The three retrace servers, and llama-server for the searches.
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
    let searched = kinds.iter().any(|k| k.llama_runs());
    let llama = match searched && !opts.no_llama {
        true => Some(start_llama(opts, kinds, cache, &logs).await?),
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

/// The callers a workload runs at: --callers, else its own.
fn callers(opts: &BenchOptions, kind: Kind) -> Vec<usize> {
    match opts.callers.is_empty() {
        true => vec![kind.concurrency()],
        false => opts.callers.clone(),
    }
}

/// One workload at each of its callers: a warm-up round, then --rounds measured ones, each
/// contender once per round, who goes first rotating.
async fn measure(
    opts: &BenchOptions,
    kind: Kind,
    contenders: &Contenders,
    fits: &Fits,
) -> anyhow::Result<Vec<ReuseSample>> {
    let mut order: Vec<Who> = vec![Who::Cache, Who::NoCache, Who::NoReuse];
    if kind.llama_runs() && contenders.llama.is_some() {
        order.push(Who::Llama);
    }
    let mut runs = Vec::new();
    for callers in callers(opts, kind) {
        for round in 0..=opts.rounds {
            // Round 0 warms up (pages, pools) and is not measured.
            let marker = match round {
                0 => format!("Warm-up {callers}."),
                r => format!("Round {r}, {callers}."),
            };
            let (mut jobs, mut traces) = jobs(opts, kind, &marker, fits, callers)?;
            if round == 0 {
                jobs.truncate(2);
                traces.traces.truncate(2);
            }
            let (jobs, traces) = (Arc::new(jobs), Arc::new(traces));
            let n = order.len();
            for i in 0..n {
                let who = order[(i + round) % n];
                let started = Instant::now();
                let counters = run_one(who, callers, contenders, &jobs, &traces).await?;
                let wall = started.elapsed();
                eprintln!(
                    "bench: {} ({callers} in flight) round {round} {:>30} {:7.2} s",
                    kind.name(),
                    who.name(),
                    wall.as_secs_f64()
                );
                if round > 0 {
                    runs.push(ReuseSample {
                        workload: kind,
                        callers,
                        who,
                        wall,
                        counters,
                    });
                }
            }
        }
    }
    Ok(runs)
}

/// One contender through one round's work; for a retrace server, its counters' movement
/// meanwhile (tokens computed and reused, where the requests' time went).
async fn run_one(
    who: Who,
    callers: usize,
    contenders: &Contenders,
    jobs: &Arc<Vec<ReuseJob>>,
    traces: &Arc<Workload>,
) -> anyhow::Result<Option<Counters>> {
    if who == Who::Llama {
        let l = contenders.llama.as_ref().expect("started for the searches");
        match traces.traces.is_empty() {
            // Beam searches: their requests depend on llama-server's own scores.
            true => send(Scorer::Llama(l.client()?), jobs, callers).await?,
            false => drop(l.run(traces, callers).await?),
        }
        return Ok(None);
    }
    let server = &contenders
        .servers
        .iter()
        .find(|(w, _)| *w == who)
        .expect("started")
        .1;
    let before = counters(&server.metrics).await?;
    send(Scorer::Retrace(server.client.clone()), jobs, callers).await?;
    let after = counters(&server.metrics).await?;
    Ok(Some(after - before))
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
    kinds: &[Kind],
    cache: &Path,
    logs: &Path,
) -> anyhow::Result<LlamaServer> {
    let (bin, gguf) = super::llama_paths(opts, cache);
    eprintln!("bench: starting llama-server ({})", bin.display());
    // A slot for each caller a search runs at.
    let slots = kinds
        .iter()
        .filter(|k| k.llama_runs())
        .flat_map(|&k| callers(opts, k))
        .max()
        .unwrap_or(1);
    LlamaServer::start(
        &bin,
        &gguf,
        slots,
        4096,
        opts,
        &logs.join("llama-server.log"),
    )
    .await
}

/// The bench evaluator's counters so far, from the server's /metrics.
async fn counters(url: &str) -> anyhow::Result<Counters> {
    let http = retrace::http_client()?;
    let text = http.get(url).send().await?.text().await?;
    Ok(scrape::counters(&text))
}

/// Sends every job, `concurrency` at a time, each job's requests in order; llama-server takes
/// the beam searches only (tree search has its own procedure, `LlamaServer::run`).
async fn send(client: Scorer, jobs: &Arc<Vec<ReuseJob>>, concurrency: usize) -> anyhow::Result<()> {
    let jobs = jobs.clone();
    super::drive(jobs.len(), concurrency, move |i| {
        let (client, jobs) = (client.clone(), jobs.clone());
        async move {
            match (&jobs[i], &client) {
                (ReuseJob::Beam(search), client) => search.run(client).await?,
                (ReuseJob::Evaluate(requests), Scorer::Retrace(client)) => {
                    for r in requests {
                        again_if_cut(|| {
                            let (mut client, r) = (client.clone(), r.clone());
                            async move { client.evaluate(r).await }
                        })
                        .await
                        .context("Evaluate")?;
                    }
                }
                (ReuseJob::Rank(r), Scorer::Retrace(client)) => {
                    again_if_cut(|| {
                        let (mut client, r) = (client.clone(), r.clone());
                        async move { client.rank(r).await }
                    })
                    .await
                    .context("Rank")?;
                }
                (_, Scorer::Llama(_)) => anyhow::bail!("llama-server runs the beam searches only"),
            }
            Ok((Vec::new(), 0))
        }
    })
    .await
    .map(drop)
}
