//! The bench's report: per-run rates, medians over rounds, per-round ratios between the
//! contenders (medians of those, since the machine is noisy), the targets, as Markdown.

use super::gemm::Peak;
use super::scaling::Point;
use super::{ContenderRun, Workload};
use std::fmt::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Contender {
    Retrace,
    Llama,
}

impl Contender {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Contender::Retrace => "retrace",
            Contender::Llama => "llama-server",
        }
    }
}

/// One contender's run at one concurrency in one round.
#[derive(Debug, Clone)]
pub(crate) struct SpeedSample {
    pub(crate) who: Contender,
    pub(crate) concurrency: usize,
    pub(crate) round: usize,
    pub(crate) run: ContenderRun,
    /// What it scored: the traces with the run's marker (its own token count).
    pub(crate) work: Arc<Workload>,
}

/// Everything the speed table is made of.
#[derive(Debug)]
pub(crate) struct SpeedReport {
    pub(crate) model: String,
    pub(crate) family: String,
    pub(crate) data: PathBuf,
    pub(crate) work: Arc<Workload>,
    pub(crate) rounds: usize,
    pub(crate) runs: Vec<SpeedSample>,
    pub(crate) peak: Peak,
    pub(crate) retrace_rss: Option<u64>,
    pub(crate) llama_rss: Option<u64>,
    /// Bytes of the weight files.
    pub(crate) weights: u64,
    pub(crate) scaling: Option<Vec<Point>>,
    pub(crate) svg: Option<PathBuf>,
    pub(crate) top_logprobs: usize,
    pub(crate) targets: Targets,
}

/// Goals the report checks, each only when its flag is given.
#[derive(Debug, Clone, Default, clap::Args)]
pub(crate) struct Targets {
    /// Report whether retrace reaches this many times llama-server's traces/s at each concurrency
    /// (with --workload tree: the prefix cache server against llama-server's per-step procedure).
    #[arg(long)]
    pub(crate) target_speedup: Option<f64>,
    /// Report whether the scaling sweep reaches this % of the matmul peak at batch ≥ 8.
    #[arg(long)]
    pub(crate) target_peak_percent: Option<f64>,
    /// Report whether retrace's peak RSS stays within this many times the weights, plus 256 MiB
    /// (with --workload: the prefix cache server's, plus its cache budget).
    #[arg(long)]
    pub(crate) target_rss_factor: Option<f64>,
    /// With --workload tree or best-of-n: report whether the prefix cache server reaches this %
    /// of the token bound (tokens scored over tokens computed) in speed-up against no reuse.
    #[arg(long)]
    pub(crate) target_bound_percent: Option<f64>,
    /// With --workload processbench: report whether the prefix cache costs at most this % of
    /// time against `prefix_cache_mb = 0` when nothing repeats.
    #[arg(long)]
    pub(crate) target_cache_cost_percent: Option<f64>,
}

/// The rates of one run.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Rates {
    pub(crate) traces_per_s: f64,
    pub(crate) tokens_per_s: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) gflops: f64,
}

/// A table row: its label, how to read it off `Rates`, and whether higher is better.
type Metric = (&'static str, fn(&Rates) -> f64, bool);

const METRICS: [Metric; 5] = [
    ("traces/s", |r| r.traces_per_s, true),
    ("tokens/s", |r| r.tokens_per_s, true),
    ("p50 latency (ms)", |r| r.p50_ms, false),
    ("p99 latency (ms)", |r| r.p99_ms, false),
    ("achieved GFLOP/s", |r| r.gflops, true),
];

/// Nearest-rank percentile of sorted durations, in ms.
pub(crate) fn percentile_ms(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1e3
}

/// Median (the mean of the middle two for an even count); NaN for none.
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| !x.is_nan());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n % 2 {
        1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

impl Rates {
    pub(crate) fn of(run: &ContenderRun, work: &Workload) -> Rates {
        let s = run.wall.as_secs_f64();
        Rates {
            traces_per_s: work.traces.len() as f64 / s,
            tokens_per_s: work.tokens as f64 / s,
            p50_ms: percentile_ms(&run.latencies, 0.50),
            p99_ms: percentile_ms(&run.latencies, 0.99),
            gflops: work.flops / s / 1e9,
        }
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// Three significant figures, no exponent.
fn num(x: f64) -> String {
    if x.is_nan() {
        return "–".into();
    }
    let digits = if x.abs() >= 100.0 {
        0
    } else if x.abs() >= 10.0 {
        1
    } else {
        2
    };
    format!("{x:.digits$}")
}

impl SpeedReport {
    fn concurrencies(&self) -> Vec<usize> {
        let mut c: Vec<usize> = self.runs.iter().map(|m| m.concurrency).collect();
        c.sort_unstable();
        c.dedup();
        c
    }

    fn runs_of(&self, who: Contender, c: usize) -> impl Iterator<Item = &SpeedSample> {
        self.runs
            .iter()
            .filter(move |m| m.who == who && m.concurrency == c)
    }

    /// Median over rounds of one metric.
    pub(crate) fn median_of(&self, who: Contender, c: usize, metric: fn(&Rates) -> f64) -> f64 {
        median(
            self.runs_of(who, c)
                .map(|m| metric(&Rates::of(&m.run, &m.work)))
                .collect(),
        )
    }

    /// Median over rounds of retrace's advantage in that round (>1: retrace is better).
    pub(crate) fn speedup(&self, c: usize, metric: fn(&Rates) -> f64, higher_better: bool) -> f64 {
        let per_round = (0..self.rounds).filter_map(|round| {
            let get = |who| {
                self.runs_of(who, c)
                    .find(|m| m.round == round)
                    .map(|m| metric(&Rates::of(&m.run, &m.work)))
            };
            let (r, l) = (get(Contender::Retrace)?, get(Contender::Llama)?);
            Some(if higher_better { r / l } else { l / r })
        });
        median(per_round.collect())
    }

    fn has_llama(&self) -> bool {
        self.runs.iter().any(|m| m.who == Contender::Llama)
    }

    /// The side-by-side table and everything said under it.
    pub(crate) fn markdown(&self) -> String {
        let mut s = self.header();
        s.push_str(&self.table());
        let (m, k, n) = self.peak.shape;
        let _ = writeln!(
            s,
            "- f32 matmul peak (candle, this machine, best at M×K×N = {m}×{k}×{n}): {} GFLOP/s. \
             Achieved GFLOP/s counts useful work only (causal attention, no padding).",
            num(self.peak.gflops)
        );
        if self.has_llama() {
            s.push_str(&self.agreement());
        }
        s.push_str(&self.targets());
        if let Some(svg) = &self.svg {
            let _ = writeln!(
                s,
                "- Scaling sweep (in-process model, best of 2): `{}`.",
                svg.display()
            );
        }
        s
    }

    /// The line above the table: model, data, rounds, machine.
    fn header(&self) -> String {
        let w = &self.work;
        format!(
            "{} as `{}` ({}), {} traces of {} ({} tokens, {} steps), {} round(s), medians; {}.\n\n",
            self.model,
            self.family,
            match self.model.ends_with(".gguf") {
                true => "GGUF: quantized weights, f32 activations",
                false => "f32",
            },
            w.traces.len(),
            self.data.display(),
            w.tokens,
            w.steps,
            self.rounds,
            machine()
        )
    }

    /// The table: a column per contender and concurrency (and the speed-up), a row per metric,
    /// then the share of the matmul peak and the peak RSS.
    fn table(&self) -> String {
        let mut s = String::new();
        let cs = self.concurrencies();
        let llama = self.has_llama();
        let mut head = String::from("| |");
        let mut rule = String::from("|---|");
        for c in &cs {
            let _ = write!(head, " retrace c={c} |");
            rule.push_str("---:|");
            if llama {
                let _ = write!(head, " llama-server c={c} | retrace speed-up |");
                rule.push_str("---:|---:|");
            }
        }
        let _ = writeln!(s, "{head}\n{rule}");
        for (label, metric, higher) in METRICS {
            let mut row = format!("| {label} |");
            for &c in &cs {
                let _ = write!(
                    row,
                    " {} |",
                    num(self.median_of(Contender::Retrace, c, metric))
                );
                if llama {
                    let _ = write!(
                        row,
                        " {} | {}x |",
                        num(self.median_of(Contender::Llama, c, metric)),
                        num(self.speedup(c, metric, higher))
                    );
                }
            }
            let _ = writeln!(s, "{row}");
        }
        s.push_str(&self.resource_rows(&cs, llama));
        s
    }

    /// The rows under the metrics: % of the matmul peak, and peak RSS.
    fn resource_rows(&self, cs: &[usize], llama: bool) -> String {
        let mut s = String::new();
        let mut row = String::from("| % of matmul peak |");
        for &c in cs {
            let pct = |who| 100.0 * self.median_of(who, c, |r| r.gflops) / self.peak.gflops;
            let _ = write!(row, " {}% |", num(pct(Contender::Retrace)));
            if llama {
                let _ = write!(row, " {}% | |", num(pct(Contender::Llama)));
            }
        }
        let _ = writeln!(s, "{row}");
        let rss = |b: Option<u64>| b.map_or("–".to_string(), |b| format!("{:.0}", mib(b)));
        let mut row = format!("| peak RSS (MiB, whole run) | {} |", rss(self.retrace_rss));
        if llama {
            let _ = write!(row, " {} | |", rss(self.llama_rss));
        }
        for _ in 1..cs.len() {
            row.push_str(if llama { " | | |" } else { " |" });
        }
        let _ = writeln!(s, "{row}\n");
        s
    }

    /// How closely the two contenders' step scores agree (first round, lowest concurrency).
    fn agreement(&self) -> String {
        let c = self.concurrencies()[0];
        let pick = |who| self.runs_of(who, c).next().map(|m| &m.run.scores);
        let (Some(r), Some(l)) = (pick(Contender::Retrace), pick(Contender::Llama)) else {
            return String::new();
        };
        let mut diffs = Vec::new();
        let (mut same_first, mut traces) = (0, 0);
        for (a, b) in r.iter().zip(l) {
            if a.len() != b.len() {
                continue;
            }
            traces += 1;
            diffs.extend(a.iter().zip(b).map(|(x, y)| f64::from((x - y).abs())));
            let first = |v: &[f32]| v.iter().position(|s| *s < 0.5);
            same_first += usize::from(first(a) == first(b));
        }
        let max = diffs.iter().copied().fold(0.0, f64::max);
        let close = diffs.iter().filter(|d| **d <= 5e-3).count();
        let mut sorted = diffs.clone();
        sorted.sort_by(f64::total_cmp);
        let p90 = sorted
            .get((sorted.len() * 9 / 10).min(sorted.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0);
        format!(
            "- Sanity check, same traces: step scores differ by median {:.2e}, p90 {p90:.2e}, max \
             {:.2e} over {} steps ({close} within 5e-3); the first step under 0.5 agrees on \
             {same_first}/{traces} traces. \
             llama-server's '+' or '-' fell outside its top {} logprobs on {} step(s) (scored as \
             probability 0).\n",
            median(diffs.clone()),
            max,
            diffs.len(),
            self.top_logprobs,
            self.misses()
        )
    }

    /// llama-server steps scored without both logprobs, over its first run.
    fn misses(&self) -> usize {
        let c = self.concurrencies()[0];
        self.runs_of(Contender::Llama, c)
            .next()
            .map_or(0, |m| m.run.misses)
    }

    /// The targets given by flags, each met or not; nothing when none was given.
    fn targets(&self) -> String {
        let t = &self.targets;
        let mut parts = Vec::new();
        let mark = |ok: bool| if ok { "met" } else { "NOT met" };
        if let Some(want) = t.target_speedup
            && self.has_llama()
        {
            for c in self.concurrencies() {
                let x = self.speedup(c, |r| r.traces_per_s, true);
                parts.push(format!(
                    "traces/s ≥ {want}x llama-server at c={c}: {}x, {}",
                    num(x),
                    mark(x >= want)
                ));
            }
        }
        if let (Some(want), Some(points)) = (t.target_peak_percent, &self.scaling) {
            let big: Vec<&Point> = points.iter().filter(|p| p.batch >= 8).collect();
            if let Some(best) = big.iter().max_by(|a, b| a.gflops.total_cmp(&b.gflops)) {
                let pct = 100.0 * best.gflops / self.peak.gflops;
                let worst = big.iter().map(|p| p.gflops).fold(f64::INFINITY, f64::min);
                parts.push(format!(
                    "≥ {want}% of the matmul peak at batch ≥ 8: best {}% ({} tokens × {}), worst {}%, {}",
                    num(pct),
                    best.len,
                    best.batch,
                    num(100.0 * worst / self.peak.gflops),
                    mark(pct >= want)
                ));
            }
        }
        if let (Some(factor), Some(rss)) = (t.target_rss_factor, self.retrace_rss) {
            let limit = factor * self.weights as f64 + (256u64 << 20) as f64;
            parts.push(format!(
                "peak RSS ≤ {factor} × weights ({:.0} MiB) + 256 MiB = {:.0} MiB: {:.0} MiB, {}",
                mib(self.weights),
                limit / (1 << 20) as f64,
                mib(rss),
                mark(rss as f64 <= limit)
            ));
        }
        match parts.is_empty() {
            true => String::new(),
            false => format!("- Targets: {}.\n", parts.join("; ")),
        }
    }
}

/// "CPU model, N cores, YYYY-MM-DD" for the report's header.
fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let days = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    let (y, m, d) = civil_from_days(days);
    format!("{cpu}, {cores} cores, no GPU used, {y:04}-{m:02}-{d:02}")
}

/// Days since 1970-01-01 -> (year, month, day), proleptic Gregorian (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_medians() {
        let d: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile_ms(&d, 0.5), 50.0);
        assert_eq!(percentile_ms(&d, 0.99), 99.0);
        assert_eq!(percentile_ms(&d[..1], 0.99), 1.0);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(vec![]).is_nan());
    }

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
    }
}
