//! The reuse bench's report: a row per workload and contender (medians over rounds), each
//! workload's speed-ups and token bound, and a verdict for each target the flags give.

use super::{BenchOptions, Kind, Who};
use crate::bench::report::{Targets, median};
use std::fmt::Write as _;
use std::time::Duration;

/// One contender's run of one workload in one measured round.
#[derive(Debug, Clone)]
pub(super) struct ReuseSample {
    pub(super) workload: Kind,
    pub(super) who: Who,
    pub(super) wall: Duration,
    /// Tokens computed and reused, from the server's counters (retrace only).
    pub(super) tokens: Option<(f64, f64)>,
}

/// The runs of one workload, and the medians read off them.
struct WorkloadRuns<'a> {
    kind: Kind,
    runs: &'a [ReuseSample],
}

impl WorkloadRuns<'_> {
    fn of(&self, who: Who) -> Vec<&ReuseSample> {
        self.runs
            .iter()
            .filter(|m| m.workload == self.kind && m.who == who)
            .collect()
    }

    /// Median seconds of a contender.
    fn secs(&self, who: Who) -> f64 {
        median(self.of(who).iter().map(|m| m.wall.as_secs_f64()).collect())
    }

    /// Median tokens computed (`reused` false) or reused of a contender.
    fn tokens(&self, who: Who, reused: bool) -> f64 {
        let pick = |t: (f64, f64)| if reused { t.1 } else { t.0 };
        median(
            self.of(who)
                .iter()
                .filter_map(|m| m.tokens.map(pick))
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
    for &kind in kinds {
        let w = WorkloadRuns { kind, runs };
        out.push_str(&rows(&w));
        notes.extend(speed_notes(&w, &opts.targets));
    }
    notes.extend(rss_notes(opts, rss, weights));
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
            w.kind.name(),
            who.name(),
            cell(w.tokens(who, false)),
            cell(w.tokens(who, true)),
        );
    }
    out
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
        Kind::Tree | Kind::BestOfN => {
            let bound = w.bound();
            let share = (base / cache) / bound;
            let head = format!(
                "{}: {:.0}% of the token bound ({:.2}x of {bound:.2}x",
                w.kind.name(),
                100.0 * share,
                base / cache,
            );
            notes.push(match targets.target_bound_percent {
                Some(t) => format!("{head}; target {t}%): {}", mark(100.0 * share >= t)),
                None => format!("{head})"),
            });
            if w.kind == Kind::Tree && !w.of(Who::Llama).is_empty() {
                let vs = w.secs(Who::Llama) / cache;
                notes.push(format!(
                    "tree search: {vs:.2}x llama-server's per-step procedure{}",
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
