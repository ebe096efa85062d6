//! The bound against published values, and the guarantee itself over many draws of
//! calibration sets from a known agreement curve.

use super::*;

const TENTH: AgreementTarget = AgreementTarget {
    agreement: 0.9,
    confidence: 0.9,
};

#[test]
fn the_bound_is_clopper_pearsons() {
    // The one-sided 95% upper limit after 1 in 10, as Clopper-Pearson tables give it.
    assert!((upper_bound(1, 10, 0.05) - 0.3942).abs() < 1e-4);
    // No disagreement in n: the bound is 1 - delta^(1/n), so 22 kept items are the fewest that
    // reach 0.1 at delta 0.1, 29 at delta 0.05 and 45 for alpha 0.05 (the guaranteed-cascade
    // notes' table).
    for n in [1, 10, 22, 100] {
        let closed = 1.0 - 0.1f64.powf(1.0 / n as f64);
        assert!((upper_bound(0, n, 0.1) - closed).abs() < 1e-9, "{n}");
    }
    assert!(upper_bound(0, 22, 0.1) <= 0.1 && upper_bound(0, 21, 0.1) > 0.1);
    assert_eq!(GuaranteedThreshold::fewest(TENTH), 22);
    let strict = |agreement, confidence| {
        GuaranteedThreshold::fewest(AgreementTarget {
            agreement,
            confidence,
        })
    };
    assert_eq!((strict(0.9, 0.95), strict(0.95, 0.9)), (29, 45));
    assert_eq!(upper_bound(5, 5, 0.1), 1.0);
    assert_eq!(upper_bound(0, 0, 0.1), 1.0);
    // Large counts stay finite.
    let big = upper_bound(500, 100_000, 0.1);
    assert!(big > 0.005 && big < 0.0055, "{big}");
}

/// A seeded xorshift: the draws are the same on every run.
struct Draws(u64);

impl Draws {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Confidence uniform on [0, 1], agreement with probability 0.6 + 0.4c: among the items kept
/// at threshold t, agreement is 0.8 + 0.2t, at least 0.9 exactly when t >= 0.5.
fn calibration_set(draws: &mut Draws, n: usize) -> Vec<CalibrationItem> {
    (0..n)
        .map(|_| {
            let confidence = draws.uniform();
            let agrees = draws.uniform() < 0.6 + 0.4 * confidence;
            CalibrationItem { confidence, agrees }
        })
        .collect()
}

#[test]
fn kept_items_agree_at_the_target_in_at_least_the_targets_share_of_draws() {
    let mut draws = Draws(0x2545_f491_4f6c_dd1d);
    let (mut held, mut coverage, runs) = (0, 0.0, 1000);
    for _ in 0..runs {
        let c = choose(&calibration_set(&mut draws, 500), TENTH);
        // The population's agreement among the traces this threshold keeps: the curve's own.
        let realized = c.threshold.map_or(1.0, |t| 0.8 + 0.2 * t);
        held += usize::from(realized >= 0.9);
        coverage += c.coverage();
        if let Some(t) = c.threshold {
            assert!(c.bound <= 0.1 && c.kept >= 22 && t > 0.0, "{c:?}");
        }
    }
    assert!(held >= 900, "held in {held} of {runs} draws");
    // Not by keeping nothing: the best threshold (0.5) keeps half; testing from the top
    // stops at the first run of disagreements, which keeps it well above that.
    let mean = coverage / runs as f64;
    assert!(mean > 0.1 && mean < 0.5, "mean coverage {mean}");
}

#[test]
fn too_few_items_or_none_passing_keeps_nothing() {
    let mut draws = Draws(0x9e37_79b9_7f4a_7c15);
    let few = calibration_set(&mut draws, 21);
    let all_agree: Vec<CalibrationItem> = few
        .iter()
        .map(|i| CalibrationItem { agrees: true, ..*i })
        .collect();
    let c = choose(&all_agree, TENTH);
    assert_eq!((c.threshold, c.kept, c.coverage()), (None, 0, 0.0));
    // 22 that all agree pass, keeping all of them.
    let mut enough = all_agree.clone();
    enough.push(CalibrationItem {
        confidence: -1.0,
        agrees: true,
    });
    let c = choose(&enough, TENTH);
    assert_eq!((c.threshold, c.kept), (Some(-1.0), 22));
    // A tier that disagrees a third of the time at every confidence never passes.
    let poor: Vec<CalibrationItem> = (0..3000)
        .map(|i| CalibrationItem {
            confidence: draws.uniform(),
            agrees: i % 3 != 0,
        })
        .collect();
    assert_eq!(choose(&poor, TENTH).threshold, None);
    assert_eq!(choose(&[], TENTH).threshold, None);
}

#[test]
fn testing_stops_at_the_first_threshold_that_fails() {
    // The most confident 30 agree, the next 10 all disagree, the 360 below all agree: the
    // lowest threshold would pass on its own (10 of 400), but testing stopped above it.
    let mut items: Vec<CalibrationItem> = (0..30)
        .map(|i| CalibrationItem {
            confidence: 0.9 + i as f64 * 1e-3,
            agrees: true,
        })
        .collect();
    items.extend((0..10).map(|i| CalibrationItem {
        confidence: 0.8 + i as f64 * 1e-3,
        agrees: false,
    }));
    items.extend((0..360).map(|i| CalibrationItem {
        confidence: 0.1 + i as f64 * 1e-3,
        agrees: true,
    }));
    let alone: Vec<CalibrationItem> = items
        .iter()
        .map(|i| CalibrationItem {
            confidence: 0.5,
            ..*i
        })
        .collect();
    assert_eq!(choose(&alone, TENTH).kept, 400, "10 of 400 pass alone");
    let c = choose(&items, TENTH);
    assert!(c.threshold.unwrap() >= 0.8, "{c:?}");
    assert!(c.kept <= 40 && c.disagreements <= 10, "{c:?}");
}
