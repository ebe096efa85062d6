//! The speed table: retrace against llama-server on the same traces, next to the machine's
//! measured matmul peak, in named steps: load the workload, measure the peak, start the
//! contenders, warm up, run the rounds, sweep the scaling curve, report.

use super::gemm::{self, Peak, Shapes};
use super::llama::LlamaServer;
use super::procs::Guard;
use super::report::{Contender, SpeedReport, SpeedSample};
use super::scaling::{self, Point};
use super::{BenchOptions, Workload, cache_dir, grpc, write_out};
use crate::common::EvalBackend;
use anyhow::{Context, bail};
use retrace::pb::evaluator_client::EvaluatorClient;
use retrace::{Family, Formatter};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

/// The retrace contender: the server the bench started (None with --server), a client on it,
/// and the evaluator to name (empty: the server's default).
struct Retrace {
    server: Option<Guard>,
    client: EvaluatorClient<Channel>,
    evaluator: String,
}

/// Measures the speed table and prints it (and writes it to --out).
pub(super) async fn speed(opts: BenchOptions) -> anyhow::Result<()> {
    let cache = cache_dir(&opts);
    let model = opts.model.clone().unwrap_or_else(|| cache.join("smollm2"));
    let formatter = formatter(&opts, &model)?;
    let shapes = Shapes::load(&model)?;
    let work = Arc::new(Workload::load(&opts, &formatter, &shapes, None)?);
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

    let retrace = start_retrace(&opts, &model, &logs).await?;
    let llama = match opts.no_llama {
        true => None,
        false => Some(start_llama(&opts, &cache, &work, &logs).await?),
    };
    warm_up(&retrace, llama.as_ref(), &work).await?;
    let marked = |marker: &str| Workload::load(&opts, &formatter, &shapes, Some(marker));
    let runs = rounds(&opts, &retrace, llama.as_ref(), marked).await?;

    let retrace_rss = match &retrace.server {
        Some(guard) => Some(guard.peak_rss()?),
        None => None,
    };
    let llama_rss = match &llama {
        Some(l) => Some(l.guard.peak_rss()?),
        None => None,
    };
    let weights = super::weight_bytes(&model)?;
    let scaling = match opts.scaling {
        true => {
            // Nothing else of ours may compete for the cores during the sweep.
            drop(llama);
            drop(retrace);
            Some(sweep(&opts, &model, &peak)?)
        }
        false => None,
    };

    let report = SpeedReport {
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
    write_out(&opts, &report.markdown())
}

/// --family's formatter on --model: how the traces are encoded.
pub(super) fn formatter(opts: &BenchOptions, model: &Path) -> anyhow::Result<Formatter> {
    let family = Family::parse(&opts.family)
        .with_context(|| format!("unknown --family {:?}", opts.family))?;
    Formatter::load(family, model).map_err(anyhow::Error::msg)
}

/// Starts our own server (prefix cache off) unless --server names one, and connects.
async fn start_retrace(opts: &BenchOptions, model: &Path, logs: &Path) -> anyhow::Result<Retrace> {
    if let Some(addr) = &opts.server {
        let backend = EvalBackend::connect(addr, None, None, Duration::from_secs(60))
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        let EvalBackend::Remote { client, .. } = backend else {
            bail!("expected a remote backend");
        };
        return Ok(Retrace {
            server: None,
            client: *client,
            evaluator: String::new(),
        });
    }
    // The traces repeat across rounds and concurrencies: a prefix cache would answer all but the
    // first from memory. Speed is measured computing every token (a --set wins).
    let cold = BenchOptions {
        set: [
            vec!["evaluator.bench.prefix_cache_mb=0".into()],
            opts.set.clone(),
        ]
        .concat(),
        ..opts.clone()
    };
    let (mut guard, addr, _) = super::start_server(&cold, model, logs, "bench")?;
    let client = super::connect_child(&mut guard, &addr).await?;
    Ok(Retrace {
        server: Some(guard),
        client,
        evaluator: "bench".to_string(),
    })
}

/// llama-server with a slot per concurrent trace, each with room for the longest trace.
async fn start_llama(
    opts: &BenchOptions,
    cache: &Path,
    work: &Workload,
    logs: &Path,
) -> anyhow::Result<LlamaServer> {
    let (bin, gguf) = super::llama_paths(opts, cache);
    let longest = work.traces.iter().map(|t| t.tokens).max().unwrap_or(0);
    // Room for the longest conversation plus template drift, rounded up.
    let ctx = (longest + 256).next_multiple_of(256);
    let parallel = opts.concurrency.iter().copied().max().unwrap_or(1);
    eprintln!("bench: starting llama-server ({})", bin.display());
    LlamaServer::start(
        &bin,
        &gguf,
        parallel,
        ctx,
        opts,
        &logs.join("llama-server.log"),
    )
    .await
}

/// Warm-up (not measured): first-touch pages, thread pools, caches' steady state.
async fn warm_up(
    retrace: &Retrace,
    llama: Option<&LlamaServer>,
    work: &Workload,
) -> anyhow::Result<()> {
    let warm = Arc::new(Workload {
        traces: work.traces.iter().take(4).cloned().collect(),
        tokens: 0,
        steps: 0,
        flops: 0.0,
    });
    grpc::run(&retrace.client, &retrace.evaluator, &warm, 4).await?;
    if let Some(l) = llama {
        l.run(&warm, 4).await?;
    }
    Ok(())
}

/// Every contender at every concurrency, --rounds times, alternating who goes first so drift
/// on a shared machine hits both alike. Each run's questions open with a marker naming it (as
/// the reuse workloads' do), built by `marked`: llama-server's slots and its prompt cache keep
/// the prompts of the run before, which would answer a quarter to a third of a repeated run's
/// tokens from memory, while retrace's contender runs with no prefix cache.
async fn rounds(
    opts: &BenchOptions,
    retrace: &Retrace,
    llama: Option<&LlamaServer>,
    marked: impl Fn(&str) -> anyhow::Result<Workload>,
) -> anyhow::Result<Vec<SpeedSample>> {
    let mut runs = Vec::new();
    for round in 0..opts.rounds {
        for &c in &opts.concurrency {
            let work = Arc::new(marked(&format!("Round {}, {c} in flight.", round + 1))?);
            let llama_first = round % 2 == 1;
            let mut order = vec![Contender::Retrace];
            if llama.is_some() {
                match llama_first {
                    true => order.insert(0, Contender::Llama),
                    false => order.push(Contender::Llama),
                }
            }
            for who in order {
                let started = Instant::now();
                let run = match (who, llama) {
                    (Contender::Retrace, _) => {
                        grpc::run(&retrace.client, &retrace.evaluator, &work, c).await?
                    }
                    (Contender::Llama, Some(l)) => l.run(&work, c).await?,
                    (Contender::Llama, None) => unreachable!("only run when started"),
                };
                eprintln!(
                    "bench: round {} {:>13} c={c:<3} {:6.2} s",
                    round + 1,
                    who.name(),
                    started.elapsed().as_secs_f64()
                );
                runs.push(SpeedSample {
                    who,
                    concurrency: c,
                    round,
                    run,
                    work: work.clone(),
                });
            }
        }
    }
    Ok(runs)
}

/// The model in-process over trace length x batch size; writes the plot to --svg.
fn sweep(opts: &BenchOptions, model: &Path, peak: &Peak) -> anyhow::Result<Vec<Point>> {
    eprintln!("bench: scaling sweep");
    let points = scaling::sweep(
        model,
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
    let svg = scaling::svg(&points, peak, &title)?;
    let path = &opts.svg;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
    Ok(points)
}
