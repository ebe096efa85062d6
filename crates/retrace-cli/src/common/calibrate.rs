//! Threshold calibration: the exact F1 curve over every threshold, from cached step scores.
//!
//! A PRM's prediction at threshold t is the first step scoring below t. It changes only where t
//! crosses a score, so the distinct scores (and 1.0 above them) cut [0, 1] into intervals on
//! which every prediction is constant: the curve has one point per interval, and its maximum is
//! the exact optimum. Each trace is right on one run of consecutive intervals, so the whole curve
//! costs a sort and a prefix sum, not a re-scoring per threshold.

use super::metric::{Counts, SplitScore, Summary};
use super::predictions::Row;
use serde::Serialize;

/// What calibration needs of a judged trace.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredTrace {
    pub split: String,
    pub label: i32,
    /// None: the request failed (wrong at every threshold).
    pub scores: Option<Vec<f32>>,
}

/// The metric at every threshold interval.
#[derive(Debug, Clone)]
pub struct Curve {
    pub splits: Vec<String>,
    /// Ascending distinct cut points; point k stands for thresholds in (cuts[k-1], cuts[k]]
    /// (point 0: thresholds <= cuts[0]).
    pub cuts: Vec<f32>,
    /// totals[split] = (error traces, correct traces).
    totals: Vec<(usize, usize)>,
    /// hits[split][k] = (error hits, correct hits) at point k.
    hits: Vec<Vec<(u32, u32)>>,
    failed: Vec<usize>,
}

/// The chosen threshold and what it scores on the calibration data.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ThresholdChoice {
    /// The threshold to configure: inside its interval, away from the scores that bound it.
    pub threshold: f32,
    /// Every threshold in (low, high] scores the same on the calibration data.
    pub low: Option<f32>,
    pub high: f32,
    /// The objective: mean F1 over splits (or the split's F1, for a per-split choice).
    pub f1: f64,
    pub summary: Summary,
}

/// The first step scoring below `threshold`, or -1: the PRM rule (`Judgement::from_scores`).
pub fn first_below(scores: &[f32], threshold: f32) -> i32 {
    scores
        .iter()
        .position(|&s| s < threshold)
        .map_or(-1, |i| i as i32)
}

impl ScoredTrace {
    pub fn of(row: &Row) -> ScoredTrace {
        ScoredTrace {
            split: row.split.clone(),
            label: row.label,
            scores: row.prediction.map(|_| row.step_scores.clone()),
        }
    }
}

/// Rows re-decided at `threshold` from their cached scores (failed rows stay failed).
pub fn rethreshold(row: &Row, threshold: f32) -> Row {
    let mut r = row.clone();
    if r.prediction.is_some() {
        let p = first_below(&r.step_scores, threshold);
        r.prediction = Some(p);
        r.matched = p == r.label;
        r.threshold = Some(threshold);
    }
    r
}

fn index_of(cuts: &[f32], v: f32) -> usize {
    cuts.partition_point(|c| c.total_cmp(&v).is_lt())
}

/// The full curve over `traces`.
pub fn sweep(traces: &[ScoredTrace]) -> Curve {
    let cuts = cuts_of(traces);
    let k = cuts.len();
    let mut splits: Vec<String> = Vec::new();
    let mut totals = Vec::new();
    let mut failed = Vec::new();
    // Difference arrays, one extra slot for run ends.
    let mut diff: Vec<Vec<(i64, i64)>> = Vec::new();
    for t in traces {
        let s = match splits.iter().position(|x| *x == t.split) {
            Some(s) => s,
            None => {
                splits.push(t.split.clone());
                totals.push((0, 0));
                failed.push(0);
                diff.push(vec![(0, 0); k + 1]);
                splits.len() - 1
            }
        };
        if t.label == -1 {
            totals[s].1 += 1;
        } else {
            totals[s].0 += 1;
        }
        let Some(scores) = &t.scores else {
            failed[s] += 1;
            continue;
        };
        if let Some((start, end)) = right_run(scores, t.label, &cuts) {
            let d = &mut diff[s];
            if t.label == -1 {
                d[start].1 += 1;
                d[end].1 -= 1;
            } else {
                d[start].0 += 1;
                d[end].0 -= 1;
            }
        }
    }
    Curve {
        splits,
        cuts,
        totals,
        hits: diff.into_iter().map(|d| prefix_sums(&d[..k])).collect(),
        failed,
    }
}

/// The distinct finite scores, ascending, and 1.0 above them.
fn cuts_of(traces: &[ScoredTrace]) -> Vec<f32> {
    let mut cuts: Vec<f32> = traces
        .iter()
        .filter_map(|t| t.scores.as_deref())
        .flatten()
        .copied()
        .filter(|s| s.is_finite())
        .collect();
    cuts.sort_by(f32::total_cmp);
    cuts.dedup();
    if cuts.last().is_none_or(|&m| m < 1.0) {
        cuts.push(1.0); // above every score: every step is an error
    }
    cuts
}

/// The points [start, end) at which a trace with these scores and this label is predicted
/// right; None when no point is.
fn right_run(scores: &[f32], label: i32, cuts: &[f32]) -> Option<(usize, usize)> {
    let k = cuts.len();
    // Prefix minima: the prediction at point k >= 1 is the first i with min(s[..=i]) <=
    // cuts[k-1]; at point 0 it is -1.
    let mut m = Vec::with_capacity(scores.len());
    let mut low = f32::INFINITY;
    for &x in scores {
        low = low.min(x);
        m.push(low);
    }
    if label == -1 {
        let end = m.last().map_or(k, |&v| index_of(cuts, v) + 1);
        return Some((0, end));
    }
    let l = label as usize;
    (l < m.len()).then(|| {
        let start = index_of(cuts, m[l]) + 1;
        let end = if l == 0 {
            k
        } else {
            index_of(cuts, m[l - 1]) + 1
        };
        (start, end.max(start))
    })
}

/// Running totals of a difference array: (error hits, correct hits) at each point.
fn prefix_sums(d: &[(i64, i64)]) -> Vec<(u32, u32)> {
    let (mut e, mut c) = (0i64, 0i64);
    d.iter()
        .map(|&(de, dc)| {
            e += de;
            c += dc;
            (e as u32, c as u32)
        })
        .collect()
}

impl Curve {
    pub fn len(&self) -> usize {
        self.cuts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cuts.is_empty()
    }

    /// A threshold inside point k's interval, halfway between the scores that bound it.
    pub fn threshold(&self, k: usize) -> f32 {
        let high = self.cuts[k];
        let low = if k == 0 {
            0.0f32.min(high)
        } else {
            self.cuts[k - 1]
        };
        let mid = low + (high - low) / 2.0;
        if k == 0 && high <= 0.0 {
            high
        } else if mid > low && mid <= high {
            mid
        } else {
            high
        }
    }

    /// The point whose interval holds `threshold`.
    pub fn point(&self, threshold: f32) -> usize {
        index_of(&self.cuts, threshold).min(self.len() - 1)
    }

    pub fn counts(&self, split: usize, k: usize) -> Counts {
        let (error_total, correct_total) = self.totals[split];
        let (e, c) = self.hits[split][k];
        Counts {
            error_total,
            error_hit: e as usize,
            correct_total,
            correct_hit: c as usize,
        }
    }

    pub fn summary(&self, k: usize) -> Summary {
        Summary::from_splits(
            (0..self.splits.len())
                .map(|s| SplitScore::new(&self.splits[s], self.counts(s, k), self.failed[s]))
                .collect(),
        )
    }

    /// Mean F1 over splits at point k (0 where undefined).
    pub fn mean_f1(&self, k: usize) -> f64 {
        let f1s: Vec<f64> = (0..self.splits.len())
            .filter_map(|s| self.counts(s, k).f1())
            .collect();
        if f1s.is_empty() {
            0.0
        } else {
            f1s.iter().sum::<f64>() / f1s.len() as f64
        }
    }

    pub(crate) fn split_f1(&self, split: usize, k: usize) -> f64 {
        self.counts(split, k).f1().unwrap_or(0.0)
    }

    fn choose(&self, objective: impl Fn(usize) -> f64) -> ThresholdChoice {
        let mut best = 0;
        for k in 1..self.len() {
            if objective(k) > objective(best) {
                best = k;
            }
        }
        ThresholdChoice {
            threshold: self.threshold(best),
            low: (best > 0).then(|| self.cuts[best - 1]),
            high: self.cuts[best],
            f1: objective(best),
            summary: self.summary(best),
        }
    }

    /// The threshold maximising mean F1 over splits; ties go to the lowest threshold.
    pub fn best(&self) -> ThresholdChoice {
        self.choose(|k| self.mean_f1(k))
    }

    /// Each split's own best threshold.
    pub(crate) fn best_per_split(&self) -> Vec<(String, ThresholdChoice)> {
        (0..self.splits.len())
            .map(|s| (self.splits[s].clone(), self.choose(|k| self.split_f1(s, k))))
            .collect()
    }

    /// (threshold, mean F1, F1 per split) at `n + 1` evenly spaced thresholds in [0, 1]: for plots.
    pub(crate) fn sampled(&self, n: usize) -> Vec<(f32, f64, Vec<f64>)> {
        (0..=n)
            .map(|i| {
                let t = i as f32 / n as f32;
                let k = self.point(t);
                let per = (0..self.splits.len())
                    .map(|s| self.split_f1(s, k))
                    .collect();
                (t, self.mean_f1(k), per)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(split: &str, label: i32, scores: &[f32]) -> ScoredTrace {
        ScoredTrace {
            split: split.into(),
            label,
            scores: Some(scores.to_vec()),
        }
    }

    /// The metric computed by re-thresholding every trace directly.
    fn direct(traces: &[ScoredTrace], t: f32) -> Summary {
        Summary::of(traces.iter().map(|x| {
            let p = x.scores.as_deref().map(|s| first_below(s, t));
            (x.split.as_str(), x.label, p)
        }))
    }

    #[test]
    fn known_best_threshold() {
        // Correct steps score >= 0.7, wrong ones <= 0.3: any t in (0.3, 0.7] is perfect.
        let traces = vec![
            trace("a", -1, &[0.9, 0.8, 0.7]),
            trace("a", 1, &[0.95, 0.3, 0.9]),
            trace("a", 0, &[0.2, 0.9]),
            trace("b", -1, &[0.75]),
            trace("b", 2, &[0.8, 0.85, 0.1]),
        ];
        let curve = sweep(&traces);
        let best = curve.best();
        assert_eq!(best.f1, 100.0);
        assert_eq!((best.low, best.high), (Some(0.3), 0.7));
        assert!((best.threshold - 0.5).abs() < 1e-6, "{}", best.threshold);
        assert_eq!(direct(&traces, best.threshold).average.f1, Some(100.0));
    }

    #[test]
    fn curve_matches_direct_rethresholding_everywhere() {
        // A deterministic pseudo-random set, with ties and a failed trace.
        let mut state = 7u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) % 20) as f32 / 20.0
        };
        let mut traces = Vec::new();
        for i in 0..60usize {
            let n = 1 + i % 5;
            let scores: Vec<f32> = (0..n).map(|_| next()).collect();
            let label = (i as i32 % (n as i32 + 1)) - 1;
            traces.push(trace(if i % 3 == 0 { "x" } else { "y" }, label, &scores));
        }
        traces.push(ScoredTrace {
            split: "x".into(),
            label: -1,
            scores: None,
        });
        let curve = sweep(&traces);
        for k in 0..curve.len() {
            let t = curve.threshold(k);
            assert_eq!(curve.point(t), k);
            assert_eq!(curve.summary(k), direct(&traces, t), "point {k}, t {t}");
        }
        for t in [0.0, 0.05, 0.5, 0.99, 1.0] {
            assert_eq!(curve.summary(curve.point(t)), direct(&traces, t), "t {t}");
        }
        let best = curve.best();
        let brute = (0..=1000)
            .map(|i| direct(&traces, i as f32 / 1000.0).average.f1.unwrap())
            .fold(0.0, f64::max);
        assert!((best.f1 - brute).abs() < 1e-9, "{} vs {brute}", best.f1);
    }

    #[test]
    fn per_split_choices() {
        let traces = vec![
            trace("a", -1, &[0.6]),
            trace("a", 0, &[0.4]),
            trace("b", -1, &[0.3]),
            trace("b", 0, &[0.1]),
        ];
        let per = sweep(&traces).best_per_split();
        assert_eq!(per[0].0, "a");
        assert!(per[0].1.threshold > 0.4 && per[0].1.threshold <= 0.6);
        assert!(per[1].1.threshold > 0.1 && per[1].1.threshold <= 0.3);
        assert_eq!(per[1].1.f1, 100.0);
    }
}
