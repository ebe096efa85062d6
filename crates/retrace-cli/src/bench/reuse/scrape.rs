//! What a bench server's /metrics says of its work so far: tokens computed and reused, and where
//! its requests' time went (the request, its queue, its tokenizing, the model's batches), so a
//! round's share is the difference of two scrapes.

use std::ops::Sub;

/// The bench evaluator's counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(super) struct Counters {
    pub(super) computed: f64,
    pub(super) reused: f64,
    /// Requests answered, and the seconds they took from arrival to answer.
    pub(super) requests: f64,
    pub(super) request_s: f64,
    /// Seconds requests waited for admission and for the model's thread.
    pub(super) queue_s: f64,
    pub(super) tokenize_s: f64,
    /// Batches the model ran, the seconds they took and the traces they held.
    pub(super) batches: f64,
    pub(super) inference_s: f64,
    pub(super) batch_traces: f64,
}

impl Sub for Counters {
    type Output = Counters;

    fn sub(self, o: Counters) -> Counters {
        Counters {
            computed: self.computed - o.computed,
            reused: self.reused - o.reused,
            requests: self.requests - o.requests,
            request_s: self.request_s - o.request_s,
            queue_s: self.queue_s - o.queue_s,
            tokenize_s: self.tokenize_s - o.tokenize_s,
            batches: self.batches - o.batches,
            inference_s: self.inference_s - o.inference_s,
            batch_traces: self.batch_traces - o.batch_traces,
        }
    }
}

/// The sum of the series `name` whose labels include every one of `labels` (a request's
/// duration has a series per RPC); 0 when there is none.
fn value(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{'))
        .filter_map(|rest| rest.split_once("} "))
        .filter(|(have, _)| {
            labels
                .iter()
                .all(|(k, v)| have.split(',').any(|kv| kv == format!("{k}=\"{v}\"")))
        })
        .filter_map(|(_, v)| v.trim().parse::<f64>().ok())
        .sum()
}

/// The evaluator `bench`'s counters in a /metrics page.
pub(super) fn counters(text: &str) -> Counters {
    let e = ("evaluator", "bench");
    let tokens = |kind| value(text, retrace::PREFIX_TOKENS, &[e, ("kind", kind)]);
    let stage = |stage| {
        let name = format!("{}_sum", retrace::STAGE_DURATION);
        value(text, &name, &[e, ("stage", stage)])
    };
    let of = |metric: &str, part: &str| value(text, &format!("{metric}_{part}"), &[e]);
    Counters {
        computed: tokens("computed"),
        reused: tokens("reused"),
        requests: of(retrace::REQUEST_DURATION, "count"),
        request_s: of(retrace::REQUEST_DURATION, "sum"),
        queue_s: stage("queue"),
        tokenize_s: stage("tokenize"),
        batches: of(retrace::BATCH_SIZE, "count"),
        inference_s: stage("inference"),
        batch_traces: of(retrace::BATCH_SIZE, "sum"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_bench_evaluators_series_and_nothing_else() {
        let page = "\
retrace_prefix_tokens_total{evaluator=\"bench\",kind=\"computed\"} 120
retrace_prefix_tokens_total{evaluator=\"other\",kind=\"reused\"} 7
retrace_prefix_tokens_total{evaluator=\"bench\",kind=\"reused\"} 880
retrace_stage_duration_seconds_sum{evaluator=\"bench\",stage=\"queue\"} 0.5
retrace_stage_duration_seconds_sum{evaluator=\"bench\",stage=\"inference\"} 2.25
retrace_request_duration_seconds_sum{rpc=\"Evaluate\",evaluator=\"bench\"} 4
retrace_request_duration_seconds_count{rpc=\"Evaluate\",evaluator=\"bench\"} 8
retrace_request_duration_seconds_count{rpc=\"Rank\",evaluator=\"bench\"} 2
retrace_batch_size_sum{evaluator=\"bench\"} 10
retrace_batch_size_count{evaluator=\"bench\"} 4
";
        let c = counters(page);
        assert_eq!((c.computed, c.reused), (120.0, 880.0));
        assert_eq!((c.queue_s, c.inference_s, c.tokenize_s), (0.5, 2.25, 0.0));
        assert_eq!((c.requests, c.request_s), (10.0, 4.0));
        assert_eq!((c.batches, c.batch_traces), (4.0, 10.0));
        assert_eq!((c - c).requests, 0.0);
    }
}
