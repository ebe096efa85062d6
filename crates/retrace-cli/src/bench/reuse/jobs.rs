//! The reuse workloads' jobs for one round: tree search's prefixes, plain ProcessBench, Best-of-N
//! Ranks, the RL burst and beam searches, every question opening with the round's marker.

use super::beam;
use super::source::{evaluate, read_candidates};
use super::{BenchOptions, BenchTrace, Kind, ReuseJob, Workload};
use crate::common::read_records;
use anyhow::bail;
use retrace::pb;
use std::path::{Path, PathBuf};

/// The workload's jobs for one round (questions opening with `marker`), and for tree search
/// the same traces for llama-server.
pub(super) fn jobs(
    opts: &BenchOptions,
    kind: Kind,
    marker: &str,
    fits: &Fits,
    callers: usize,
) -> anyhow::Result<(Vec<ReuseJob>, Workload)> {
    let (jobs, traces) = match kind {
        Kind::Plain => bail!("the plain workload is the speed table"),
        Kind::Tree | Kind::Processbench => trace_jobs(opts, kind, marker, fits)?,
        Kind::BestOfN => (rank_jobs(opts, marker)?, Vec::new()),
        Kind::RlBurst => (burst_jobs(opts, marker)?, Vec::new()),
        Kind::Beam => {
            let mut questions = read_candidates(&opts.bon_data)?;
            questions.truncate(opts.limit);
            let searches = beam::jobs(&questions, marker, callers);
            (
                searches.into_iter().map(ReuseJob::Beam).collect(),
                Vec::new(),
            )
        }
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
pub(super) struct Fits {
    formatter: retrace::Formatter,
    limit: usize,
}

impl Fits {
    pub(super) fn load(opts: &BenchOptions, model: &Path) -> anyhow::Result<Fits> {
        let formatter = super::super::speed::formatter(opts, model)?;
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
