//! The reuse bench's report: a row per workload and contender (medians over rounds), each
//! workload's speed-ups and token bound, and a verdict for each target the flags give.

use super::scrape::Counters;
use super::{BenchOptions, Kind, Who};
use crate::bench::report::{Targets, median};
use std::fmt::Write as _;
use std::time::Duration;

/// One contender's run of one workload in one measured round.
#[derive(Debug, Clone)]
pub(super) struct ReuseSample {
    pub(super) workload: Kind,
    /// Requests (or searches) in flight.
    pub(super) callers: usize,
    pub(super) who: Who,
    pub(super) wall: Duration,
    /// The server's counters' movement over the run (retrace only).
    pub(super) counters: Option<Counters>,
}

/// The runs of one workload, and the medians read off them.
struct WorkloadRuns<'a> {
    kind: Kind,
    callers: usize,
    runs: &'a [ReuseSample],
}

impl WorkloadRuns<'_> {
    fn of(&self, who: Who) -> Vec<&ReuseSample> {
        self.runs
            .iter()
            .filter(|m| m.workload == self.kind && m.callers == self.callers && m.who == who)
            .collect()
    }

    /// The workload and its callers, as the table and the notes name them.
    fn name(&self) -> String {
        let s = if self.callers == 1 { "" } else { "s" };
        format!("{}, {} caller{s}", self.kind.name(), self.callers)
    }

    /// Median seconds of a contender.
    fn secs(&self, who: Who) -> f64 {
        median(self.of(who).iter().map(|m| m.wall.as_secs_f64()).collect())
    }

    /// Median tokens computed (`reused` false) or reused of a contender.
    fn tokens(&self, who: Who, reused: bool) -> f64 {
        let pick = |c: Counters| if reused { c.reused } else { c.computed };
        self.median(who, pick)
    }

    /// The median over rounds of `f` of a contender's counters.
    fn median(&self, who: Who, f: impl Fn(Counters) -> f64) -> f64 {
        median(
            self.of(who)
                .iter()
                .filter_map(|m| m.counters.map(&f))
                .collect(),
        )
    }

    /// Tokens scored over tokens the prefix cache server computed.
    fn bound(&self) -> f64 {
        let (computed, reused) = (
            self.tokens(Who::Cache, false),
            self.tokens(Who::Cache, true),
        );
        (computed + reused) / computed
    }
}

/// The Markdown table, with each workload's speed-ups and bounds, and the verdicts.
pub(super) fn report(
    opts: &BenchOptions,
    kinds: &[Kind],
    runs: &[ReuseSample],
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
    let mut notes = Vec::new();
    let mut profile = String::new();
    for &kind in kinds {
        let mut callers: Vec<usize> = runs
            .iter()
            .filter(|r| r.workload == kind)
            .map(|r| r.callers)
            .collect();
        callers.dedup();
        for callers in callers {
            let w = WorkloadRuns {
                kind,
                callers,
                runs,
            };
            out.push_str(&rows(&w));
            profile.push_str(&profile_row(&w));
            notes.extend(speed_notes(&w, &opts.targets));
        }
    }
    notes.extend(rss_notes(opts, rss, weights));
    out.push_str(&format!("\n{PROFILE_HEAD}{profile}"));
    out.push('\n');
    for v in notes {
        let _ = writeln!(out, "- {v}");
    }
    out
}

/// A workload's rows, one per contender that ran it.
fn rows(w: &WorkloadRuns) -> String {
    let mut out = String::new();
    let base = w.secs(Who::NoReuse);
    let bound = w.bound();
    let cell = |v: f64| match v.is_nan() {
        true => "–".to_string(),
        false => format!("{v:.0}"),
    };
    for who in [Who::Cache, Who::NoCache, Who::NoReuse, Who::Llama] {
        if w.of(who).is_empty() {
            continue;
        }
        let s = w.secs(who);
        let speedup = base / s;
        let (bound_cell, share) = match who {
            Who::Cache => (
                format!("{bound:.2}x"),
                format!("{:.0}%", 100.0 * speedup / bound),
            ),
            _ => ("–".into(), "–".into()),
        };
        let _ = writeln!(
            out,
            "| {} | {} | {s:.2} | {} | {} | {speedup:.2}x | {bound_cell} | {share} |",
            w.name(),
            who.name(),
            cell(w.tokens(who, false)),
            cell(w.tokens(who, true)),
        );
    }
    out
}

const PROFILE_HEAD: &str = "Where a request's time goes on the prefix cache server (medians over \
rounds; per request: its whole time in the server, its wait before the model, its tokenizing; \
per forward: its mean time, over the forwards, which weighs a small batch as much as a large one \
that holds more of the requests; the model's busy share of the run; traces and tokens computed \
per forward):\n\n\
| workload | requests | ms in server | ms queued | ms tokenizing | ms a forward | model busy | traces / forward | tokens computed / forward |\n\
|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";

/// The cache server's time per request for one workload.
fn profile_row(w: &WorkloadRuns) -> String {
    let who = Who::Cache;
    let per = |num: fn(&Counters) -> f64, den: fn(&Counters) -> f64| {
        w.median(who, |c| num(&c) / den(&c).max(1.0))
    };
    let ms = |v: f64| v * 1e3;
    let request = ms(per(|c| c.request_s, |c| c.requests));
    let queued = ms(per(|c| c.queue_s, |c| c.requests));
    let tokenize = ms(per(|c| c.tokenize_s, |c| c.requests));
    let batch = ms(per(|c| c.inference_s, |c| c.batches));
    let busy = median(
        w.of(who)
            .iter()
            .filter_map(|m| Some(m.counters?.inference_s / m.wall.as_secs_f64()))
            .collect(),
    );
    format!(
        "| {} | {:.0} | {request:.1} | {queued:.1} | {tokenize:.1} | {batch:.1} | {:.0}% | {:.2} | \
         {:.0} |\n",
        w.name(),
        w.median(who, |c| c.requests),
        100.0 * busy,
        per(|c| c.batch_traces, |c| c.batches),
        per(|c| c.computed, |c| c.batches),
    )
}

/// Whether a target the flags gave is met.
fn mark(met: bool) -> &'static str {
    if met { "met" } else { "MISSED" }
}

/// " (target T): met" when the flag gave a target, else nothing.
fn verdict(target: Option<f64>, shown: fn(f64) -> String, met: impl Fn(f64) -> bool) -> String {
    target.map_or_else(String::new, |t| {
        format!(" (target {}): {}", shown(t), mark(met(t)))
    })
}

/// What a workload's speed-ups come to, each judged against its target when one was given.
fn speed_notes(w: &WorkloadRuns, targets: &Targets) -> Vec<String> {
    let mut notes = Vec::new();
    let (base, cache) = (w.secs(Who::NoReuse), w.secs(Who::Cache));
    match w.kind {
        Kind::Tree | Kind::BestOfN | Kind::Beam => {
            let bound = w.bound();
            let share = (base / cache) / bound;
            let head = format!(
                "{}: {:.0}% of the token bound ({:.2}x of {bound:.2}x",
                w.name(),
                100.0 * share,
                base / cache,
            );
            notes.push(match targets.target_bound_percent {
                Some(t) => format!("{head}; target {t}%): {}", mark(100.0 * share >= t)),
                None => format!("{head})"),
            });
            if !w.of(Who::Llama).is_empty() {
                let vs = w.secs(Who::Llama) / cache;
                notes.push(format!(
                    "{}: {vs:.2}x llama-server's per-step procedure{}",
                    w.name(),
                    verdict(targets.target_speedup, |t| format!("{t}x"), |t| vs >= t)
                ));
            }
        }
        Kind::Processbench => {
            let slower = cache / w.secs(Who::NoCache) - 1.0;
            notes.push(format!(
                "ProcessBench with nothing repeated: the cache costs {:+.1}% against \
                 prefix_cache_mb = 0{}",
                100.0 * slower,
                verdict(
                    targets.target_cache_cost_percent,
                    |t| format!("within {t}%"),
                    |t| 100.0 * slower <= t
                )
            ));
        }
        Kind::Plain | Kind::RlBurst => {}
    }
    notes
}

/// Every server's peak RSS, and the cache server's against --target-rss-factor when given.
fn rss_notes(opts: &BenchOptions, rss: &[(Who, u64)], weights: u64) -> Vec<String> {
    let mib = |b: f64| b / 1048576.0;
    let mut notes = Vec::new();
    if !rss.is_empty() {
        let peaks: Vec<String> = rss
            .iter()
            .map(|(who, b)| format!("{} {:.0} MiB", who.name(), mib(*b as f64)))
            .collect();
        notes.push(format!("peak RSS by server: {}", peaks.join("; ")));
    }
    let cache = rss.iter().find(|(w, _)| *w == Who::Cache);
    if let (Some(&(_, rss)), Some(factor)) = (cache, opts.targets.target_rss_factor) {
        let budget = cache_budget(opts) as f64;
        let limit = factor * weights as f64 + budget + (256u64 << 20) as f64;
        notes.push(format!(
            "peak RSS of the cache server {:.0} MiB; {factor}x the weights ({:.0} MiB) + the cache \
             budget ({:.0} MiB) + 256 MiB = {:.0} MiB: {}",
            mib(rss as f64),
            mib(weights as f64),
            mib(budget),
            mib(limit),
            mark(rss as f64 <= limit)
        ));
    }
    notes
}

/// The cache server's budget in bytes: its --set, else the default.
fn cache_budget(opts: &BenchOptions) -> usize {
    let mb = opts
        .set
        .iter()
        .rev()
        .find_map(|s| s.strip_prefix("evaluator.bench.prefix_cache_mb="))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(retrace::defaults::PREFIX_CACHE_MB);
    mb << 20
}
