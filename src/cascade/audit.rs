//! Audits of a guaranteed cascade: a share of the traces its PRM decided alone, judged as
//! well after the answer has gone, so the agreement it keeps is measured live. The share decays
//! as SSV's does (arXiv 2602.17633), max(floor, rate / sqrt(t + 1)) for the t-th trace kept
//! since the threshold was chosen, under a budget of judge calls a second (a token bucket) and
//! a cap on audits in flight; the tally's lower bound on agreement is what says the guarantee
//! broke. Clock values and draws are passed in, so no test sleeps or rolls dice.

use super::guarantee;
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// Audits in flight at once: past it a drawn audit is skipped, so a slow judge never piles
/// up tasks holding traces.
const MAX_IN_FLIGHT: usize = 8;

/// `audit_rate` and its companions, from the cascade's table.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct AuditConfig {
    /// The share audited at first (p0).
    pub rate: f64,
    /// The share it decays to and never below (p_min).
    pub floor: f64,
    /// Judge calls a second the audits may spend, at most; bursts up to one second's worth.
    pub per_second: f64,
}

pub(crate) mod defaults {
    pub(crate) fn floor() -> f64 {
        0.05
    }
    pub(crate) fn per_second() -> f64 {
        1.0
    }
}

impl AuditConfig {
    /// `audit_rate = 0.3`, the defaults for the rest.
    pub(crate) fn of_rate(rate: f64) -> AuditConfig {
        AuditConfig {
            rate,
            floor: defaults::floor().min(rate),
            per_second: defaults::per_second(),
        }
    }

    /// Each key's range, named.
    pub(crate) fn check(&self) -> Result<(), String> {
        let share = |p: f64| p > 0.0 && p <= 1.0;
        if !share(self.rate) || !share(self.floor) || self.floor > self.rate {
            return Err(format!(
                "audit rate and floor must lie in (0, 1], floor <= rate; got {} and {}",
                self.rate, self.floor
            ));
        }
        if !(self.per_second > 0.0 && self.per_second.is_finite()) {
            return Err(format!(
                "audit per_second must be a positive number, got {}",
                self.per_second
            ));
        }
        Ok(())
    }
}

/// Why a kept trace was not audited, or that it was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Draw {
    Audit,
    /// Not drawn at this trace's share.
    NotDrawn,
    /// Drawn, but the budget of calls a second is spent or too many audits are in flight.
    OverBudget,
}

/// The audits of one cascade.
#[derive(Debug)]
pub(crate) struct Audits {
    config: AuditConfig,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Traces kept since the threshold was chosen (SSV's t).
    kept: u64,
    tokens: f64,
    refilled: Option<Instant>,
    in_flight: usize,
    tally: AuditTally,
}

/// Audited traces and how many the judge disagreed with, since the threshold was chosen.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct AuditTally {
    pub audited: u64,
    pub disagreed: u64,
}

impl AuditTally {
    /// The lower bound on agreement among kept traces, at `confidence` (Clopper-Pearson);
    /// 0 before any audit.
    pub(crate) fn lower_bound(&self, confidence: f64) -> f64 {
        let (k, n) = (self.disagreed as usize, self.audited as usize);
        1.0 - guarantee::upper_bound(k, n, 1.0 - confidence)
    }

    /// The upper bound on that agreement: below the target, the audits show (at `confidence`)
    /// that the kept traces no longer agree as the calibration rows did. 1 before any audit.
    pub(crate) fn upper_bound(&self, confidence: f64) -> f64 {
        let (agreed, n) = (
            (self.audited - self.disagreed) as usize,
            self.audited as usize,
        );
        match n {
            0 => 1.0,
            _ => guarantee::upper_bound(agreed, n, 1.0 - confidence),
        }
    }

    /// The share of audits that agreed; None before any.
    pub(crate) fn agreement(&self) -> Option<f64> {
        (self.audited > 0).then(|| 1.0 - self.disagreed as f64 / self.audited as f64)
    }
}

impl Audits {
    pub(crate) fn new(config: AuditConfig) -> Audits {
        Audits {
            config,
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The share the next kept trace is audited at.
    pub(crate) fn share(&self) -> f64 {
        self.share_after(self.lock().kept)
    }

    /// The share after `kept` traces: max(floor, rate / sqrt(kept + 1)).
    fn share_after(&self, kept: u64) -> f64 {
        (self.config.rate / (kept as f64 + 1.0).sqrt()).max(self.config.floor)
    }

    /// A trace was kept at `now`; `u` is a uniform draw in [0, 1). An `Audit` holds a place in
    /// flight until `finish`.
    pub(crate) fn draw(&self, now: Instant, u: f64) -> Draw {
        let mut s = self.lock();
        let share = self.share_after(s.kept);
        s.kept += 1;
        if u >= share {
            return Draw::NotDrawn;
        }
        let since = s
            .refilled
            .map_or(Duration::from_secs(1), |t| now.saturating_duration_since(t));
        let burst = self.config.per_second.max(1.0);
        s.tokens = (s.tokens + since.as_secs_f64() * self.config.per_second).min(burst);
        s.refilled = Some(now);
        if s.tokens < 1.0 || s.in_flight >= MAX_IN_FLIGHT {
            return Draw::OverBudget;
        }
        s.tokens -= 1.0;
        s.in_flight += 1;
        Draw::Audit
    }

    /// An audit ended: `agreed` when the judge answered (whether it agreed), None when it
    /// could not. Returns the tally.
    pub(crate) fn finish(&self, agreed: Option<bool>) -> AuditTally {
        let mut s = self.lock();
        s.in_flight = s.in_flight.saturating_sub(1);
        if let Some(agreed) = agreed {
            s.tally.audited += 1;
            s.tally.disagreed += u64::from(!agreed);
        }
        s.tally
    }

    /// A new threshold: the decay and the tally start again (audits in flight still count
    /// against the cap when they end).
    pub(crate) fn restart(&self) {
        let mut s = self.lock();
        s.kept = 0;
        s.tally = AuditTally::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: f64) -> Duration {
        Duration::from_secs_f64(s)
    }

    #[test]
    fn the_share_decays_to_its_floor() {
        let audits = Audits::new(AuditConfig {
            rate: 0.3,
            floor: 0.05,
            per_second: 1e9,
        });
        let now = Instant::now();
        assert!((audits.share() - 0.3).abs() < 1e-12);
        // A draw just under the share audits; just over does not.
        assert_eq!(audits.draw(now, 0.299), Draw::Audit);
        audits.finish(Some(true));
        let second = 0.3 / 2f64.sqrt();
        assert!((audits.share() - second).abs() < 1e-12);
        assert_eq!(audits.draw(now, second + 1e-9), Draw::NotDrawn);
        for _ in 0..100 {
            audits.draw(now, 0.99);
        }
        assert_eq!(audits.share(), 0.05, "0.3 / sqrt(103) is under the floor");
        audits.restart();
        assert!((audits.share() - 0.3).abs() < 1e-12);
    }

    #[tokio::test(start_paused = true)]
    async fn the_budget_caps_calls_a_second_and_audits_in_flight() {
        let audits = Audits::new(AuditConfig {
            rate: 1.0,
            floor: 1.0,
            per_second: 2.0,
        });
        let t0 = Instant::now();
        // A burst of two, then nothing until the bucket refills at two a second.
        assert_eq!(audits.draw(t0, 0.0), Draw::Audit);
        assert_eq!(audits.draw(t0, 0.0), Draw::Audit);
        assert_eq!(audits.draw(t0, 0.0), Draw::OverBudget);
        assert_eq!(audits.draw(t0 + secs(0.25), 0.0), Draw::OverBudget);
        assert_eq!(audits.draw(t0 + secs(0.5), 0.0), Draw::Audit);
        // In flight: three; the cap holds however full the bucket.
        let rich = Audits::new(AuditConfig {
            rate: 1.0,
            floor: 1.0,
            per_second: 1e6,
        });
        let drawn = (0..20)
            .filter(|i| rich.draw(t0 + secs(*i as f64), 0.0) == Draw::Audit)
            .count();
        assert_eq!(drawn, MAX_IN_FLIGHT);
        rich.finish(None);
        assert_eq!(rich.draw(t0 + secs(30.0), 0.0), Draw::Audit);
    }

    #[test]
    fn the_tally_bounds_agreement_from_below() {
        let audits = Audits::new(AuditConfig::of_rate(1.0));
        let mut tally = AuditTally::default();
        for i in 0..100 {
            tally = audits.finish(Some(i % 10 != 0));
        }
        assert_eq!((tally.audited, tally.disagreed), (100, 10));
        let low = tally.lower_bound(0.9);
        // 90 of 100 agreed: the bound sits under 0.9, and over 0.85.
        assert!(low > 0.85 && low < 0.9, "{low}");
        assert_eq!(AuditTally::default().lower_bound(0.9), 0.0);
        // And above: 0.9 is within what 90 of 100 allow; 70 of 100 rule it out.
        assert!(tally.upper_bound(0.9) > 0.9);
        let poor = AuditTally {
            audited: 100,
            disagreed: 30,
        };
        assert!(poor.upper_bound(0.9) < 0.9, "{}", poor.upper_bound(0.9));
        assert_eq!(AuditTally::default().upper_bound(0.9), 1.0);
        assert_eq!(audits.finish(None), tally, "a failed audit is no verdict");
    }

    #[test]
    fn bad_settings_are_named() {
        assert!(AuditConfig::of_rate(0.3).check().is_ok());
        assert!(AuditConfig::of_rate(0.0).check().is_err());
        let inverted = AuditConfig {
            floor: 0.5,
            ..AuditConfig::of_rate(0.3)
        };
        assert!(inverted.check().unwrap_err().contains("floor"));
        let free = AuditConfig {
            per_second: 0.0,
            ..AuditConfig::of_rate(0.3)
        };
        assert!(free.check().unwrap_err().contains("per_second"));
    }
}
