//! The keys of an HTTP upstream, written once for judges and for PRMs on a vLLM server: where it
//! is, its key, and the call policy (timeout, retries, rate, breaker) with defaults and rules.

use super::CallPolicy;
use crate::rule::{MAX_SECONDS, Refused, refuse};
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// An upstream's keys, flattened into the table of whatever calls it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct UpstreamConfig {
    /// The server's root URL (http or https).
    pub base_url: String,
    /// Environment variable holding the API key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// Seconds one exchange may take.
    #[serde(default = "defaults::timeout_s")]
    pub timeout_s: f64,
    /// Retries of a failed exchange within the deadline.
    #[serde(default = "defaults::retries")]
    pub retries: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u32>,
    /// Consecutive failed attempts that open the circuit breaker.
    #[serde(default = "defaults::breaker_failures")]
    pub breaker_failures: u32,
    /// Seconds the open breaker refuses calls before one probe.
    #[serde(default = "defaults::breaker_cooldown_s")]
    pub breaker_cooldown_s: f64,
}

/// The defaults of the upstream keys, and their bounds.
pub(crate) mod defaults {
    pub(crate) const TIMEOUT_S: f64 = 60.0;
    pub(crate) const RETRIES: u32 = 2;
    pub(crate) const BREAKER_FAILURES: u32 = 5;
    pub(crate) const BREAKER_COOLDOWN_S: f64 = 10.0;
    /// Retries per exchange; more would hide an outage behind minutes of backoff.
    pub(crate) const MAX_RETRIES: u32 = 10;

    pub(super) fn timeout_s() -> f64 {
        TIMEOUT_S
    }
    pub(super) fn retries() -> u32 {
        RETRIES
    }
    pub(super) fn breaker_failures() -> u32 {
        BREAKER_FAILURES
    }
    pub(super) fn breaker_cooldown_s() -> f64 {
        BREAKER_COOLDOWN_S
    }
}

impl UpstreamConfig {
    /// The rules every upstream's keys follow; `what` names the server in messages.
    pub fn check(&self, what: &str) -> Result<(), Refused> {
        let url = reqwest::Url::parse(&self.base_url)
            .map_err(|e| Refused(format!("base_url {:?} is not a URL: {e}", self.base_url)))?;
        if !matches!(url.scheme(), "http" | "https") {
            return refuse(format!(
                "base_url {:?} must be {what}'s http:// or https:// root",
                self.base_url
            ));
        }
        if self
            .api_key_env
            .as_deref()
            .is_some_and(|v| v.trim().is_empty())
        {
            return refuse("api_key_env must name an environment variable");
        }
        if !(self.timeout_s > 0.0 && self.timeout_s <= MAX_SECONDS) {
            return refuse(format!(
                "timeout_s must lie in (0, {MAX_SECONDS}], got {}",
                self.timeout_s
            ));
        }
        if self.retries > defaults::MAX_RETRIES {
            return refuse(format!(
                "retries must be at most {}, got {}",
                defaults::MAX_RETRIES,
                self.retries
            ));
        }
        if self.requests_per_minute == Some(0) {
            return refuse("requests_per_minute must be at least 1 (leave it out for no limit)");
        }
        if self.breaker_failures == 0 {
            return refuse("breaker_failures must be at least 1");
        }
        if !(self.breaker_cooldown_s > 0.0 && self.breaker_cooldown_s <= MAX_SECONDS) {
            return refuse(format!(
                "breaker_cooldown_s must lie in (0, {MAX_SECONDS}], got {}",
                self.breaker_cooldown_s
            ));
        }
        Ok(())
    }

    /// The call policy these keys make, for a caller admitting `max_concurrency` at once.
    pub(crate) fn policy(&self, max_concurrency: usize) -> CallPolicy {
        CallPolicy {
            max_concurrency,
            requests_per_minute: self.requests_per_minute,
            retries: self.retries,
            timeout: Duration::from_secs_f64(self.timeout_s),
            breaker_failures: self.breaker_failures,
            breaker_cooldown: Duration::from_secs_f64(self.breaker_cooldown_s),
        }
    }
}
