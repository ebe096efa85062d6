//! `retrace_reward_samples_total`: every sample the reward routes answer, by its status.

use super::REWARD_SAMPLES;
use metrics::counter;

/// `retrace_reward_samples_total`'s `route` and `status` label values.
pub(crate) const REWARD_ROUTES: [&str; 2] = ["/get_reward", "/slime/reward"];
pub(crate) const REWARD_STATUSES: [&str; 5] =
    ["ok", "empty", "too_large", "timed_out", "unavailable"];

/// Every reward-sample series of `evaluator` at zero, so the share of stand-ins reads 0, not
/// nothing, before the first sample.
pub(crate) fn reward_samples_at_zero(evaluator: &str) {
    for route in REWARD_ROUTES {
        for status in REWARD_STATUSES {
            let e = evaluator.to_string();
            counter!(REWARD_SAMPLES, "route" => route, "evaluator" => e, "status" => status)
                .absolute(0);
        }
    }
}

pub(crate) fn record_reward_sample(route: &'static str, evaluator: &str, status: &'static str) {
    let e = evaluator.to_string();
    counter!(REWARD_SAMPLES, "route" => route, "evaluator" => e, "status" => status).increment(1);
}
