//! The metric families of one kind of upstream (judges, remote PRMs) behind one recorder, so
//! the shared caller meters either without knowing which it serves.

use super::{
    JUDGE_BREAKER_OPENED, JUDGE_BREAKER_STATE, JUDGE_IN_FLIGHT, JUDGE_REQUEST_DURATION,
    JUDGE_REQUESTS, JUDGE_RETRIES, PRM_UPSTREAM_BREAKER_OPENED, PRM_UPSTREAM_BREAKER_STATE,
    PRM_UPSTREAM_DURATION, PRM_UPSTREAM_IN_FLIGHT, PRM_UPSTREAM_REQUESTS, PRM_UPSTREAM_RETRIES,
};
use metrics::{counter, gauge, histogram};
use std::time::Duration;

/// The metric families of one kind of upstream, and the label that names the evaluator: judges
/// keep their `retrace_judge_*` names, remote PRMs have `retrace_prm_upstream_*`.
pub(crate) struct UpstreamMetrics {
    label: &'static str,
    requests: &'static str,
    duration: &'static str,
    in_flight: &'static str,
    retries: &'static str,
    breaker_opened: &'static str,
    breaker_state: &'static str,
}

pub(crate) static JUDGE_UPSTREAM: UpstreamMetrics = UpstreamMetrics {
    label: "judge",
    requests: JUDGE_REQUESTS,
    duration: JUDGE_REQUEST_DURATION,
    in_flight: JUDGE_IN_FLIGHT,
    retries: JUDGE_RETRIES,
    breaker_opened: JUDGE_BREAKER_OPENED,
    breaker_state: JUDGE_BREAKER_STATE,
};

pub(crate) static PRM_UPSTREAM: UpstreamMetrics = UpstreamMetrics {
    label: "evaluator",
    requests: PRM_UPSTREAM_REQUESTS,
    duration: PRM_UPSTREAM_DURATION,
    in_flight: PRM_UPSTREAM_IN_FLIGHT,
    retries: PRM_UPSTREAM_RETRIES,
    breaker_opened: PRM_UPSTREAM_BREAKER_OPENED,
    breaker_state: PRM_UPSTREAM_BREAKER_STATE,
};

impl UpstreamMetrics {
    pub(crate) fn request(&self, name: &str, outcome: &'static str) {
        counter!(self.requests, self.label => name.to_string(), "outcome" => outcome).increment(1);
    }

    /// How long one upstream exchange took, whatever its outcome.
    pub(crate) fn latency(&self, name: &str, elapsed: Duration) {
        histogram!(self.duration, self.label => name.to_string()).record(elapsed.as_secs_f64());
    }

    pub(crate) fn in_flight(&self, name: &str, delta: f64) {
        gauge!(self.in_flight, self.label => name.to_string()).increment(delta);
    }

    pub(crate) fn retry(&self, name: &str, cause: &'static str) {
        counter!(self.retries, self.label => name.to_string(), "cause" => cause).increment(1);
    }

    pub(crate) fn breaker_opened(&self, name: &str) {
        counter!(self.breaker_opened, self.label => name.to_string()).increment(1);
    }

    /// The breaker's state now: 0 closed, 1 half-open, 2 open.
    pub(crate) fn breaker_state(&self, name: &str, state: f64) {
        gauge!(self.breaker_state, self.label => name.to_string()).set(state);
    }
}
