//! A judge's reliable call: the response cache, the concurrency and rate limits, the circuit
//! breaker and retries with backoff, all inside the caller's deadline, around one `Upstream`.

use super::cache::{self, ReplyCache};
use super::client::{AttemptError, Reply, Upstream};
use super::policy::{self, Breaker};
use crate::metrics;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use serde_json::Value;
use std::num::NonZeroU32;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::time::{Instant, timeout_at};

/// A retry is pointless with less than this left before the caller's deadline.
const MIN_USEFUL: Duration = Duration::from_millis(50);

/// How one judge reaches its upstream.
pub struct CallPolicy {
    pub max_concurrency: usize,
    pub requests_per_minute: Option<u32>,
    pub retries: u32,
    /// Bound on one exchange, whatever the caller's deadline.
    pub timeout: Duration,
    pub breaker_failures: u32,
    pub breaker_cooldown: Duration,
    /// Entries in the temperature-0 response cache; 0 turns it off.
    pub cache_entries: usize,
}

/// Why a call gave no reply.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CallError {
    /// The last attempt's failure, after `attempts` exchanges.
    #[error("{error} (after {attempts} attempt(s))")]
    Upstream { error: AttemptError, attempts: u32 },
    #[error("circuit breaker open after repeated upstream failures; next probe in {0:.1?}")]
    CircuitOpen(Duration),
    /// The caller's deadline passed while waiting for a slot, the rate limit or a backoff.
    #[error("the deadline passed while {0}")]
    Deadline(&'static str),
}

/// A reply, and whether it came from the cache (then no upstream request was made).
pub struct Fetched {
    pub reply: Arc<Reply>,
    pub cached: bool,
}

pub struct Caller {
    judge: String,
    upstream: Upstream,
    policy: CallPolicy,
    breaker: Arc<Breaker>,
    slots: Semaphore,
    limiter: Option<DefaultDirectRateLimiter>,
    cache: Option<Mutex<ReplyCache>>,
}

/// Keeps `retrace_judge_in_flight_requests` true on every exit path, cancellation included.
struct InFlight<'a>(&'a str);

impl<'a> InFlight<'a> {
    fn new(judge: &'a str) -> Self {
        metrics::judge_in_flight(judge, 1.0);
        InFlight(judge)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        metrics::judge_in_flight(self.0, -1.0);
    }
}

impl Caller {
    pub fn new(judge: &str, upstream: Upstream, policy: CallPolicy) -> Caller {
        let limiter = policy
            .requests_per_minute
            .and_then(NonZeroU32::new)
            .map(|rpm| RateLimiter::direct(Quota::per_minute(rpm)));
        let cache = NonZeroUsize::new(policy.cache_entries)
            .map(|n| Mutex::new(ReplyCache::new(n, cache::MAX_BYTES)));
        Caller {
            judge: judge.to_string(),
            upstream,
            breaker: Breaker::new(policy.breaker_failures, policy.breaker_cooldown),
            slots: Semaphore::new(policy.max_concurrency),
            limiter,
            cache,
            policy,
        }
    }

    /// Sends `body`, answering from the cache when `cacheable` (deterministic sampling) and the
    /// same body was answered before. Dropping the future cancels the exchange in progress.
    pub async fn call(
        &self,
        body: &Value,
        cacheable: bool,
        deadline: Option<Instant>,
    ) -> Result<Fetched, CallError> {
        // The serialised body holds model, messages and every parameter: the whole cache key.
        let key = (cacheable && self.cache.is_some()).then(|| body.to_string());
        if let (Some(cache), Some(key)) = (&self.cache, &key) {
            let hit = lock(cache).get(key);
            metrics::record_judge_cache(&self.judge, hit.is_some());
            if let Some(reply) = hit {
                return Ok(Fetched {
                    reply,
                    cached: true,
                });
            }
        }
        let _slot = until(deadline, self.slots.acquire(), "waiting for a judge slot")
            .await?
            .map_err(|_| CallError::Deadline("the judge was shutting down"))?;
        let reply = Arc::new(self.with_retries(body, deadline).await?);
        if let (Some(cache), Some(key)) = (&self.cache, key) {
            lock(cache).put(key, reply.clone());
        }
        Ok(Fetched {
            reply,
            cached: false,
        })
    }

    async fn with_retries(
        &self,
        body: &Value,
        deadline: Option<Instant>,
    ) -> Result<Reply, CallError> {
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
                metrics::record_judge_request(&self.judge, "circuit_open");
                CallError::CircuitOpen(open.retry_in)
            })?;
            let started = Instant::now();
            let stop = match deadline {
                Some(d) => d.min(started + self.policy.timeout),
                None => started + self.policy.timeout,
            };
            let result = {
                let _in_flight = InFlight::new(&self.judge);
                self.upstream.send(body, stop).await
            };
            metrics::record_judge_latency(&self.judge, started.elapsed());
            let error = match result {
                Ok(reply) => {
                    permit.record(false, Instant::now());
                    return Ok(reply);
                }
                Err(e) => e,
            };
            metrics::record_judge_request(&self.judge, error.outcome());
            if permit.record(error.upstream_unwell(), Instant::now()) {
                metrics::record_breaker_opened(&self.judge);
                tracing::warn!(judge = %self.judge, error = %error, "circuit breaker opened");
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
            metrics::record_judge_retry(&self.judge, error.outcome());
            tracing::debug!(judge = %self.judge, %error, ?wait, attempt, "retrying the judge");
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A cache is valid after any panic; at worst it misses.
    m.lock().unwrap_or_else(|e| e.into_inner())
}
