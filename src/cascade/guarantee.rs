//! A cascade tier's confidence threshold chosen so that, among the traces it keeps, its
//! agreement with the judge is at least `1 - alpha` with probability at least `1 - delta`
//! (Trust or Escalate, arXiv 2407.18370): thresholds are tested from the highest down, each by
//! the exact binomial (Clopper-Pearson) upper bound on the disagreement rate of the calibration
//! items it keeps, and testing stops before the first that fails (fixed-sequence testing, which
//! holds the family-wise error at `delta` for an order fixed in advance: Learn then Test, arXiv
//! 2110.01052). The guarantee needs only that calibration and served items are exchangeable.

/// What the cascade is asked to hold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AgreementTarget {
    /// The least agreement with the judge among kept traces (`1 - alpha`).
    pub agreement: f64,
    /// The probability the guarantee holds over the draw of calibration items (`1 - delta`).
    pub confidence: f64,
}

/// One calibration item: the tier's confidence in its verdict, and whether that verdict was
/// the judge's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CalibrationItem {
    pub confidence: f64,
    pub agrees: bool,
}

/// The chosen threshold and what the calibration items say of it.
#[derive(Debug, Clone, PartialEq)]
pub struct GuaranteedThreshold {
    /// Keep a trace whose confidence is at least this; `None`: no threshold passed (too few
    /// items, or too many disagreements at every one), so every trace escalates.
    pub threshold: Option<f64>,
    /// Calibration items in all.
    pub items: usize,
    /// Of those, kept at the threshold, and how many of the kept disagreed.
    pub kept: usize,
    pub disagreements: usize,
    /// The upper bound on the kept traces' disagreement rate, at the target's confidence
    /// (1.0 when nothing is kept).
    pub bound: f64,
}

impl GuaranteedThreshold {
    /// The share of traces the tier is expected to decide alone: its share of the items.
    pub fn coverage(&self) -> f64 {
        match self.items {
            0 => 0.0,
            n => self.kept as f64 / n as f64,
        }
    }

    /// The fewest items that could ever pass at this target: with none disagreeing, the bound
    /// reaches `alpha` only past this many kept.
    pub fn fewest(target: AgreementTarget) -> usize {
        let (alpha, delta) = (1.0 - target.agreement, 1.0 - target.confidence);
        // With no disagreement the bound is 1 - delta^(1/n).
        (delta.ln() / (1.0 - alpha).ln()).ceil() as usize
    }
}

/// Chooses the lowest threshold whose kept items pass, testing from the highest down and
/// stopping at the first that fails. Candidates are the items' distinct confidences where at
/// least `GuaranteedThreshold::fewest` items are kept (a threshold keeping fewer cannot pass, and would
/// stop the testing before any could).
pub fn choose(items: &[CalibrationItem], target: AgreementTarget) -> GuaranteedThreshold {
    let alpha = 1.0 - target.agreement;
    let delta = 1.0 - target.confidence;
    let mut sorted: Vec<CalibrationItem> = items
        .iter()
        .copied()
        .filter(|i| i.confidence.is_finite())
        .collect();
    sorted.sort_by(|a, b| b.confidence.total_cmp(&a.confidence));
    let fewest = GuaranteedThreshold::fewest(target).max(1);
    let (mut kept, mut disagreements) = (0, 0);
    let mut chosen = None;
    let mut i = 0;
    while i < sorted.len() {
        // Every item at this confidence is kept together.
        let at = sorted[i].confidence;
        while i < sorted.len() && sorted[i].confidence == at {
            kept += 1;
            disagreements += usize::from(!sorted[i].agrees);
            i += 1;
        }
        if kept < fewest {
            continue;
        }
        // The bound is at most alpha exactly when seeing this few disagreements at rate alpha
        // is no likelier than delta: one tail instead of a bisection per candidate.
        if binomial_cdf(disagreements, kept, alpha) > delta {
            break;
        }
        chosen = Some((at, kept, disagreements));
    }
    match chosen {
        Some((at, kept, disagreements)) => GuaranteedThreshold {
            threshold: Some(at),
            items: items.len(),
            kept,
            disagreements,
            bound: upper_bound(disagreements, kept, delta),
        },
        None => GuaranteedThreshold {
            threshold: None,
            items: items.len(),
            kept: 0,
            disagreements: 0,
            bound: 1.0,
        },
    }
}

/// The exact one-sided upper bound on a binomial rate at level `1 - delta` after `k` successes
/// in `n` trials (Clopper-Pearson): the rate `r` at which seeing `k` or fewer has probability
/// `delta`. Bisection on the tail, which falls as `r` grows.
pub(crate) fn upper_bound(k: usize, n: usize, delta: f64) -> f64 {
    if n == 0 || k >= n {
        return 1.0;
    }
    let (mut low, mut high) = (0.0f64, 1.0f64);
    for _ in 0..100 {
        let mid = 0.5 * (low + high);
        if binomial_cdf(k, n, mid) > delta {
            low = mid;
        } else {
            high = mid;
        }
    }
    high
}

/// P(X <= k) for X ~ Binomial(n, r), summed in log space so that large `n` neither
/// underflows nor overflows.
fn binomial_cdf(k: usize, n: usize, r: f64) -> f64 {
    if r <= 0.0 {
        return 1.0;
    }
    if r >= 1.0 {
        return if k >= n { 1.0 } else { 0.0 };
    }
    let (ln_r, ln_q) = (r.ln(), (1.0 - r).ln());
    // ln C(n, i) built term by term: ln C(n, i+1) = ln C(n, i) + ln((n - i) / (i + 1)).
    let mut ln_choose = 0.0f64;
    let mut terms = Vec::with_capacity(k + 1);
    for i in 0..=k {
        if i > 0 {
            ln_choose += ((n - i + 1) as f64).ln() - (i as f64).ln();
        }
        terms.push(ln_choose + i as f64 * ln_r + (n - i) as f64 * ln_q);
    }
    let top = terms.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = terms.iter().map(|t| (t - top).exp()).sum();
    (top + sum.ln()).exp().min(1.0)
}

#[cfg(test)]
#[path = "guarantee_tests.rs"]
mod tests;
