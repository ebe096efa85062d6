//! The keys each kind of `[[evaluator]]` table takes, for the error that names an unknown one.
//! serde lists the expected keys only for a table that flattens nothing in, so a judge (its
//! upstream's keys flattened in) and a PRM (its candle keys) got a bare "unknown field": the
//! lists are written here, and a test holds each to what its type reads and writes.

/// Every kind's keys.
const COMMON: &[&str] = &[
    "name",
    "kind",
    "threshold",
    "aggregate",
    "max_steps",
    "max_trace_bytes",
    "max_concurrency",
];

/// An HTTP upstream's keys (`UpstreamConfig`), flattened into a judge and a vLLM table.
const UPSTREAM: &[&str] = &[
    "base_url",
    "api_key_env",
    "timeout_s",
    "retries",
    "requests_per_minute",
    "breaker_failures",
    "breaker_cooldown_s",
];

const PRM: &[&str] = &[
    "family",
    "model",
    "backend",
    "vllm",
    "device",
    "dtype",
    "max_batch_tokens",
    "max_batch_size",
    "max_wait_ms",
    "prefix_cache_mb",
    "prefix_sharing",
    "dequantized_mb",
];

const JUDGE: &[&str] = &[
    "model",
    "temperature",
    "top_p",
    "max_tokens",
    "samples",
    "reasoning",
    "extra_body",
    "domain",
    "prompts_dir",
    "parallel_samples",
    "cache_entries",
    "repair",
    "repair_prompt",
    "output",
    "upstream",
    "record",
];

const CASCADE: &[&str] = &[
    "prm",
    "judge",
    "escalate_margin",
    "target_agreement",
    "target_confidence",
    "calibration",
    "confidence",
    "audit_rate",
    "audit_floor",
    "audit_per_second",
    "categorize",
    "record",
];

const COMPOSITE: &[&str] = &["steps", "outcome"];

/// The keys a table of `kind` takes beside `COMMON`; None for a kind there is not.
fn own(kind: &str) -> Option<Vec<&'static str>> {
    Some(match kind {
        "prm" => PRM.to_vec(),
        "judge" => [JUDGE, UPSTREAM].concat(),
        "cascade" => CASCADE.to_vec(),
        "composite" => COMPOSITE.to_vec(),
        _ => return None,
    })
}

/// `message` with the keys a `kind` table takes, where it names an unknown field: serde's own
/// list, where it gave one, is partial (the kind's keys without the common ones) or absent.
pub(super) fn with_known_keys(message: &str, kind: Option<&str>) -> String {
    let (Some(at), Some(own)) = (message.find("unknown field `"), kind.and_then(own)) else {
        return message.to_string();
    };
    let rest = &message[at + "unknown field `".len()..];
    let Some(end) = rest.find('`') else {
        return message.to_string();
    };
    let quote = |keys: &[&str]| {
        keys.iter()
            .map(|k| format!("`{k}`"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "{}unknown field `{}`; a {} evaluator takes {} and its own {}",
        &message[..at],
        &rest[..end],
        kind.unwrap_or_default(),
        quote(COMMON),
        quote(&own),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EvaluatorConfig;

    /// Every key of a kind, set: each list is exactly what the kind's type reads (parsing
    /// refuses an unknown key) and writes back.
    const FULL: [(&str, &str); 4] = [
        (
            "prm",
            r#"family = "chat-lm"
model = "m"
backend = "candle"
vllm = { base_url = "http://127.0.0.1:1" }
device = "cpu"
dtype = "f32"
max_batch_tokens = 1
max_batch_size = 1
max_wait_ms = 1
prefix_cache_mb = 1
prefix_sharing = true
dequantized_mb = 1"#,
        ),
        (
            "judge",
            r#"base_url = "http://127.0.0.1:1"
api_key_env = "K"
timeout_s = 1.0
retries = 1
requests_per_minute = 1
breaker_failures = 1
breaker_cooldown_s = 1.0
model = "m"
temperature = 0.5
top_p = 0.5
max_tokens = 1
samples = 1
reasoning = true
extra_body = { seed = 1 }
domain = "math"
prompts_dir = "p"
parallel_samples = true
cache_entries = 1
repair = true
repair_prompt = "r"
output = "text"
upstream = "vllm"
record = "r.jsonl""#,
        ),
        (
            "cascade",
            r#"prm = "a"
judge = "b"
escalate_margin = 0.1
target_agreement = 0.9
target_confidence = 0.9
calibration = "c.jsonl"
confidence = "margin"
audit_rate = 0.1
audit_floor = 0.01
audit_per_second = 1.0
categorize = true
record = "r.jsonl""#,
        ),
        (
            "composite",
            r#"steps = "a"
outcome = "b""#,
        ),
    ];

    #[test]
    fn each_kinds_list_is_what_its_type_reads_and_writes() {
        let common = r#"name = "x"
threshold = 0.5
aggregate = "min"
max_steps = 1
max_trace_bytes = 1
max_concurrency = 1"#;
        for (kind, keys) in FULL {
            let text = format!("{common}\nkind = \"{kind}\"\n{keys}");
            let parsed: EvaluatorConfig =
                toml::from_str(&text).unwrap_or_else(|e| panic!("{kind}: {e}"));
            let written: toml::Table = toml::Table::try_from(&parsed).unwrap();
            let mut got: Vec<&str> = written.keys().map(String::as_str).collect();
            let mut want = [COMMON.to_vec(), own(kind).unwrap()].concat();
            got.sort_unstable();
            want.sort_unstable();
            want.dedup();
            assert_eq!(got, want, "{kind}");
        }
    }

    #[test]
    fn an_unknown_key_is_named_with_every_key_its_kind_takes() {
        let m = with_known_keys(
            "evaluator[0] (\"x\"): unknown field `family`",
            Some("judge"),
        );
        assert!(
            m.starts_with(
                "evaluator[0] (\"x\"): unknown field `family`; a judge evaluator takes `name`"
            ),
            "{m}"
        );
        for key in ["`base_url`", "`model`", "`max_concurrency`", "`record`"] {
            assert!(m.contains(key), "{key}: {m}");
        }
        let serde = "unknown field `bogus`, expected one of `prm`, `judge`";
        assert!(with_known_keys(serde, Some("cascade")).contains("`name`, `kind`"));
        assert_eq!(
            with_known_keys("threshold must lie in [0, 1]", Some("prm")),
            "threshold must lie in [0, 1]"
        );
        assert_eq!(with_known_keys(serde, Some("nope")), serde);
    }
}
