//! Reliability policy for one upstream (a judge's chat endpoint, a remote PRM): which failures are
//! retried, how long to back off (jittered, Retry-After first), and the circuit breaker. Clock
//! values are passed in, so every rule here is tested without sleeping.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};
use tokio::time::Instant;

/// First backoff ceiling; doubled per retry up to `MAX_BACKOFF`.
const BASE_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(8);

/// The longest wait between retries, however early the attempt (`attempt` counts from 0):
/// min(8 s, 250 ms * 2^attempt).
pub(crate) fn backoff_ceiling(attempt: u32) -> Duration {
    BASE_BACKOFF
        .saturating_mul(1u32 << attempt.min(16))
        .min(MAX_BACKOFF)
}

/// The wait before retry `attempt`. A server's Retry-After is obeyed as given (plus up to 10% so
/// that callers told the same second don't return together); otherwise "full jitter", uniform in
/// [0, ceiling], which spreads a burst of failed callers best. `unit` is a uniform draw in [0, 1).
pub(crate) fn backoff(attempt: u32, retry_after: Option<Duration>, unit: f64) -> Duration {
    let unit = unit.clamp(0.0, 1.0);
    match retry_after {
        Some(after) => after + after.mul_f64(0.1 * unit),
        None => backoff_ceiling(attempt).mul_f64(unit),
    }
}

/// Reads a Retry-After header value: delta-seconds or an HTTP date. Negative, unreadable or past
/// values give `None` (then the jittered backoff applies).
pub(crate) fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<f64>() {
        return (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    at.duration_since(now).ok()
}

/// Whether a retry that starts after `wait` still fits before `deadline`. The retry needs time
/// to be useful, so at least `min_useful` must remain once the wait is over.
pub(crate) fn fits(
    now: Instant,
    wait: Duration,
    deadline: Option<Instant>,
    min_useful: Duration,
) -> bool {
    deadline.is_none_or(|d| now + wait + min_useful <= d)
}

/// A per-upstream circuit breaker: after `threshold` consecutive failed attempts it opens and
/// refuses calls for `cooldown`; then one probe goes through (half-open). The probe's success
/// closes it; its failure opens it for another cooldown.
#[derive(Debug)]
pub(crate) struct Breaker {
    threshold: u32,
    cooldown: Duration,
    state: Mutex<State>,
    observer: Observer,
}

/// The breaker's phase as its gauge reports it. An open breaker whose cooldown has passed stays
/// `Open` until the next call probes: nothing has shown the upstream well again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    Closed,
    HalfOpen,
    Open,
}

impl Phase {
    /// The gauge's value: 0 closed, 1 half-open, 2 open.
    pub(crate) fn gauge(self) -> f64 {
        match self {
            Phase::Closed => 0.0,
            Phase::HalfOpen => 1.0,
            Phase::Open => 2.0,
        }
    }
}

/// Told every change of phase, under the breaker's lock, so reports arrive in order.
struct Observer(Box<dyn Fn(Phase) + Send + Sync>);

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Observer")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed {
        failures: u32,
    },
    Open {
        until: Instant,
    },
    /// One probe is out; everyone else is refused until it reports.
    HalfOpen,
}

/// Refused by an open breaker; `retry_in` is the time left in the cooldown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Open {
    pub retry_in: Duration,
}

/// Leave to make one attempt. Report its outcome with `record`; a permit dropped without a
/// report (the caller left) releases a half-open probe slot, so the breaker can't stick.
#[derive(Debug)]
pub(crate) struct Permit {
    breaker: Arc<Breaker>,
    probe: bool,
    reported: bool,
}

impl State {
    fn phase(self) -> Phase {
        match self {
            State::Closed { .. } => Phase::Closed,
            State::Open { .. } => Phase::Open,
            State::HalfOpen => Phase::HalfOpen,
        }
    }
}

impl Breaker {
    /// A closed breaker; `observe` hears `Closed` now and every change of phase after.
    pub(crate) fn new(
        threshold: u32,
        cooldown: Duration,
        observe: impl Fn(Phase) + Send + Sync + 'static,
    ) -> Arc<Breaker> {
        observe(Phase::Closed);
        Arc::new(Breaker {
            threshold: threshold.max(1),
            cooldown,
            state: Mutex::new(State::Closed { failures: 0 }),
            observer: Observer(Box::new(observe)),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // The state is plain data, valid after any panic; keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Moves `state` (this breaker's, locked) to `to`, telling the observer when the phase changes.
    fn set(&self, state: &mut State, to: State) {
        let before = state.phase();
        *state = to;
        if to.phase() != before {
            (self.observer.0)(to.phase());
        }
    }

    /// Asks to make an attempt at `now`.
    pub(crate) fn acquire(self: &Arc<Self>, now: Instant) -> Result<Permit, Open> {
        let mut state = self.lock();
        let probe = match *state {
            State::Closed { .. } => false,
            State::Open { until } if now < until => {
                return Err(Open {
                    retry_in: until - now,
                });
            }
            State::Open { .. } => {
                self.set(&mut state, State::HalfOpen);
                true
            }
            State::HalfOpen => {
                return Err(Open {
                    retry_in: Duration::ZERO,
                });
            }
        };
        Ok(Permit {
            breaker: self.clone(),
            probe,
            reported: false,
        })
    }

    /// Whether calls would be refused at `now` (the tests' view of the state).
    #[cfg(test)]
    pub(crate) fn is_open(&self, now: Instant) -> bool {
        match *self.lock() {
            State::Closed { .. } => false,
            State::Open { until } => now < until,
            State::HalfOpen => true,
        }
    }
}

impl Permit {
    /// Reports the attempt: `failed` for connection errors, timeouts, 429 and 5xx, the failures
    /// that say the upstream is unwell. Returns true when this report opened the breaker.
    pub(crate) fn record(mut self, failed: bool, now: Instant) -> bool {
        self.reported = true;
        let b = &self.breaker;
        let mut state = b.lock();
        match (*state, failed) {
            (_, false) => {
                b.set(&mut state, State::Closed { failures: 0 });
                false
            }
            (State::Closed { failures }, true) if failures + 1 < b.threshold => {
                *state = State::Closed {
                    failures: failures + 1,
                };
                false
            }
            // The threshold reached, or the half-open probe failed: open (again).
            (State::Closed { .. } | State::HalfOpen, true) => {
                let until = now + b.cooldown;
                b.set(&mut state, State::Open { until });
                true
            }
            // Opened meanwhile by another caller's failure: it already counts.
            (State::Open { .. }, true) => false,
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.probe && !self.reported {
            let mut state = self.breaker.lock();
            if *state == State::HalfOpen {
                // Nothing was learnt: let the next caller probe at once.
                let until = Instant::now();
                self.breaker.set(&mut state, State::Open { until });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceiling_doubles_then_caps() {
        let ms = |a| backoff_ceiling(a).as_millis();
        assert_eq!(
            [ms(0), ms(1), ms(2), ms(5), ms(6), ms(40)],
            [250, 500, 1000, 8000, 8000, 8000]
        );
    }

    #[test]
    fn full_jitter_stays_under_the_ceiling_and_retry_after_wins() {
        assert_eq!(backoff(2, None, 0.0), Duration::ZERO);
        assert_eq!(backoff(2, None, 0.5), Duration::from_millis(500));
        assert!(backoff(2, None, 0.999) < Duration::from_millis(1000));
        let after = Some(Duration::from_secs(3));
        assert_eq!(backoff(0, after, 0.0), Duration::from_secs(3));
        assert_eq!(backoff(0, after, 0.5), Duration::from_millis(3150));
    }

    #[test]
    fn retry_after_reads_seconds_and_dates() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(parse_retry_after("2", now), Some(Duration::from_secs(2)));
        assert_eq!(
            parse_retry_after(" 0.5 ", now),
            Some(Duration::from_millis(500))
        );
        assert_eq!(parse_retry_after("-1", now), None);
        assert_eq!(parse_retry_after("soon", now), None);
        let later = httpdate::fmt_http_date(now + Duration::from_secs(30));
        assert_eq!(
            parse_retry_after(&later, now),
            Some(Duration::from_secs(30))
        );
        let earlier = httpdate::fmt_http_date(now - Duration::from_secs(30));
        assert_eq!(parse_retry_after(&earlier, now), None);
    }

    #[test]
    fn a_retry_must_fit_before_the_deadline() {
        let now = Instant::now();
        let s = Duration::from_secs;
        assert!(fits(now, s(1), None, s(1)));
        assert!(fits(now, s(1), Some(now + s(3)), s(1)));
        assert!(!fits(now, s(3), Some(now + s(3)), s(1)));
    }

    #[test]
    fn opens_after_consecutive_failures_and_a_success_resets() {
        let b = Breaker::new(3, Duration::from_secs(10), |_| {});
        let t = Instant::now();
        for _ in 0..2 {
            assert!(!b.acquire(t).unwrap().record(true, t));
        }
        assert!(!b.acquire(t).unwrap().record(false, t));
        for _ in 0..2 {
            assert!(!b.acquire(t).unwrap().record(true, t));
        }
        assert!(
            b.acquire(t).unwrap().record(true, t),
            "third failure in a row opens"
        );
        assert_eq!(
            b.acquire(t + Duration::from_secs(4)).unwrap_err(),
            Open {
                retry_in: Duration::from_secs(6)
            }
        );
        assert!(b.is_open(t));
    }

    #[test]
    fn half_open_lets_one_probe_through() {
        let b = Breaker::new(1, Duration::from_secs(10), |_| {});
        let t = Instant::now();
        b.acquire(t).unwrap().record(true, t);
        let later = t + Duration::from_secs(10);
        let probe = b.acquire(later).expect("cooldown over: a probe");
        assert!(b.acquire(later).is_err(), "only one probe at a time");
        // A failed probe opens it for a full cooldown again.
        assert!(probe.record(true, later));
        assert!(b.acquire(later + Duration::from_secs(9)).is_err());
        let probe = b.acquire(later + Duration::from_secs(10)).unwrap();
        probe.record(false, later);
        assert!(!b.is_open(later));
        assert!(b.acquire(later).is_ok());
    }

    #[test]
    fn an_abandoned_probe_frees_the_slot() {
        let b = Breaker::new(1, Duration::from_millis(1), |_| {});
        let t = Instant::now();
        b.acquire(t).unwrap().record(true, t);
        let probe = b.acquire(t + Duration::from_secs(1)).unwrap();
        drop(probe);
        assert!(b.acquire(Instant::now() + Duration::from_millis(1)).is_ok());
    }

    /// A breaker whose observer writes down every phase it hears.
    fn observed(threshold: u32, cooldown: Duration) -> (Arc<Breaker>, Arc<Mutex<Vec<Phase>>>) {
        let heard = Arc::new(Mutex::new(Vec::new()));
        let sink = heard.clone();
        let b = Breaker::new(threshold, cooldown, move |p| sink.lock().unwrap().push(p));
        (b, heard)
    }

    #[test]
    fn every_change_of_phase_is_reported_once() {
        use Phase::*;
        let (b, heard) = observed(2, Duration::from_secs(10));
        let t = Instant::now();
        let heard_now = || std::mem::take(&mut *heard.lock().unwrap());
        assert_eq!(heard_now(), [Closed], "a new breaker reports closed");
        b.acquire(t).unwrap().record(true, t);
        assert_eq!(heard_now(), [], "one failure of two: still closed");
        b.acquire(t).unwrap().record(true, t);
        assert_eq!(heard_now(), [Open]);
        assert!(b.acquire(t).is_err());
        let later = t + Duration::from_secs(10);
        let probe = b.acquire(later).unwrap();
        assert_eq!(heard_now(), [HalfOpen]);
        probe.record(true, later);
        assert_eq!(heard_now(), [Open], "a failed probe opens it again");
        let again = later + Duration::from_secs(10);
        drop(b.acquire(again).unwrap());
        assert_eq!(
            heard_now(),
            [HalfOpen, Open],
            "an abandoned probe leaves it open"
        );
        b.acquire(again).unwrap().record(false, again);
        assert_eq!(heard_now(), [HalfOpen, Closed]);
        b.acquire(again).unwrap().record(false, again);
        assert_eq!(heard_now(), [], "closed stays closed, unreported");
        assert_eq!([Closed, HalfOpen, Open].map(Phase::gauge), [0.0, 1.0, 2.0]);
    }
}
