//! The reliable call to one upstream: the concurrency and rate limits, the circuit breaker and
//! retries with backoff, all inside the caller's deadline, with the upstream's metrics.

use super::http::{AttemptError, Endpoint, Raw};
use super::policy::{self, Breaker};
use crate::metrics::UpstreamMetrics;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use serde_json::Value;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::{Instant, timeout_at};

/// A retry is pointless with less than this left before the caller's deadline.
const MIN_USEFUL: Duration = Duration::from_millis(50);

/// How one evaluator reaches its upstream.
#[derive(Debug, Clone)]
pub(crate) struct CallPolicy {
    pub max_concurrency: usize,
    pub requests_per_minute: Option<u32>,
    pub retries: u32,
    /// Bound on one exchange, whatever the caller's deadline.
    pub timeout: Duration,
    pub breaker_failures: u32,
    pub breaker_cooldown: Duration,
}

/// Why a call gave no reply.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum CallError {
    /// The last attempt's failure, after `attempts` exchanges.
    #[error("{error} (after {attempts} attempt(s))")]
    Upstream { error: AttemptError, attempts: u32 },
    #[error("circuit breaker open after repeated upstream failures; next probe in {0:.1?}")]
    CircuitOpen(Duration),
    /// The caller's deadline passed while waiting for a slot, the rate limit or a backoff.
    #[error("the deadline passed while {0}")]
    Deadline(&'static str),
    /// The upstream's slots were closed: the server is shutting down.
    #[error("the upstream is shutting down")]
    Closed,
}

impl CallError {
    /// Whether the caller's time ran out (DEADLINE_EXCEEDED) rather than the upstream failing.
    pub(crate) fn is_timeout(&self) -> bool {
        match self {
            CallError::Deadline(_) => true,
            CallError::Upstream { error, .. } => error.is_timeout(),
            CallError::CircuitOpen(_) | CallError::Closed => false,
        }
    }
}

/// One upstream endpoint behind its limits, breaker and retries.
pub(crate) struct Caller {
    name: String,
    metrics: &'static UpstreamMetrics,
    endpoint: Endpoint,
    policy: CallPolicy,
    breaker: Arc<Breaker>,
    slots: Semaphore,
    limiter: Option<DefaultDirectRateLimiter>,
}

/// Keeps the in-flight gauge true on every exit path, cancellation included.
struct InFlight<'a>(&'a UpstreamMetrics, &'a str);

impl<'a> InFlight<'a> {
    fn new(metrics: &'a UpstreamMetrics, name: &'a str) -> Self {
        metrics.in_flight(name, 1.0);
        InFlight(metrics, name)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight(self.1, -1.0);
    }
}

impl Caller {
    /// `name` is the evaluator's, the label of every metric `metrics` names.
    pub(crate) fn new(
        name: &str,
        metrics: &'static UpstreamMetrics,
        endpoint: Endpoint,
        policy: CallPolicy,
    ) -> Caller {
        let limiter = policy
            .requests_per_minute
            .and_then(NonZeroU32::new)
            .map(|rpm| RateLimiter::direct(Quota::per_minute(rpm)));
        let owned = name.to_string();
        let breaker = Breaker::new(policy.breaker_failures, policy.breaker_cooldown, move |p| {
            metrics.breaker_state(&owned, p.gauge())
        });
        Caller {
            name: name.to_string(),
            metrics,
            breaker,
            slots: Semaphore::new(policy.max_concurrency),
            limiter,
            endpoint,
            policy,
        }
    }

    pub(crate) fn url(&self) -> &str {
        self.endpoint.url()
    }

    /// Posts `body` and reads the reply with `read`, retrying what a later attempt may not meet.
    /// `read` runs inside the attempt, so a garbled 2xx body is a failed (unretried) attempt with
    /// its own outcome. Dropping the future cancels the exchange in progress.
    pub(crate) async fn call<R>(
        &self,
        body: &Value,
        deadline: Option<Instant>,
        read: impl Fn(Raw) -> Result<R, AttemptError>,
    ) -> Result<R, CallError> {
        let _slot = until(
            deadline,
            self.slots.acquire(),
            "waiting for an upstream slot",
        )
        .await?
        .map_err(|_| CallError::Closed)?;
        let mut attempt = 0u32;
        loop {
            if let Some(limiter) = &self.limiter {
                until(
                    deadline,
                    limiter.until_ready(),
                    "waiting for the rate limit",
                )
                .await?;
            }
            let permit = self.breaker.acquire(Instant::now()).map_err(|open| {
                self.metrics.request(&self.name, "circuit_open");
                CallError::CircuitOpen(open.retry_in)
            })?;
            let started = Instant::now();
            let stop = match deadline {
                Some(d) => d.min(started + self.policy.timeout),
                None => started + self.policy.timeout,
            };
            let result = {
                let _in_flight = InFlight::new(self.metrics, &self.name);
                self.endpoint.post(body, stop).await.and_then(&read)
            };
            self.metrics.latency(&self.name, started.elapsed());
            let error = match result {
                Ok(reply) => {
                    permit.record(false, Instant::now());
                    return Ok(reply);
                }
                Err(e) => e,
            };
            self.metrics.request(&self.name, error.outcome());
            if permit.record(error.upstream_unwell(), Instant::now()) {
                self.metrics.breaker_opened(&self.name);
                tracing::warn!(evaluator = %self.name, error = %error, "circuit breaker opened");
            }
            attempt += 1;
            let wait = policy::backoff(attempt - 1, error.retry_after(), fastrand::f64());
            let retry = error.retryable()
                && attempt <= self.policy.retries
                && policy::fits(Instant::now(), wait, deadline, MIN_USEFUL);
            if !retry {
                return Err(CallError::Upstream {
                    error,
                    attempts: attempt,
                });
            }
            self.metrics.retry(&self.name, error.outcome());
            tracing::debug!(evaluator = %self.name, %error, ?wait, attempt, "retrying the upstream");
            tokio::time::sleep(wait).await;
        }
    }
}

/// Awaits `f` until `deadline`, if any.
async fn until<F: Future>(
    deadline: Option<Instant>,
    f: F,
    what: &'static str,
) -> Result<F::Output, CallError> {
    match deadline {
        Some(d) => timeout_at(d, f)
            .await
            .map_err(|_| CallError::Deadline(what)),
        None => Ok(f.await),
    }
}
