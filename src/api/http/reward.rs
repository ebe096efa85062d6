//! `POST /get_reward`, OpenRLHF's remote reward contract: `{"query", "prompts", "labels"}` in
//! (each a string for one sample or a list), `{"rewards", "scores", "extra_logs"}` out, the same
//! shape back. Each query is its prompt plus the response; the response, stripped of end
//! markers, is segmented into steps, and the question is read from the prompt.

use super::{Failure, Http, QueryParams, answer, chat, params, refuse};
use crate::api::convert::TraceParts;
use crate::api::{convert, label};
use crate::config::{LabelsAs, RewardConfig, RewardRule};
use crate::engine::{Engine, EngineError, Origin, Request};
use crate::field::FieldPath;
use crate::trace::{Trace, Verdict};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde::Serialize;
use serde_json::Value;
use std::sync::Arc;
use tokio::time::Instant;

const RPC: &str = "/get_reward";

/// One sample as the trainer sent it.
#[derive(Debug, PartialEq)]
pub(super) struct RawSample {
    query: String,
    prompt: Option<String>,
    label: Option<String>,
}

/// The samples of one request, and whether they came as one string (answered with scalars).
#[derive(Debug, PartialEq)]
pub(super) struct Samples {
    samples: Vec<RawSample>,
    single: bool,
}

/// What one sample got.
#[derive(Debug, Clone, PartialEq)]
struct SampleReward {
    reward: f32,
    trace_score: f32,
    first_error_index: i32,
    step_count: usize,
    category: i32,
}

pub(super) async fn get_reward(
    State(http): State<Arc<Http>>,
    query: QueryParams,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let arrived = Instant::now();
    let prepared = http.admit(&headers, arrived).and_then(|deadline| {
        let get = params(&query, &["evaluator", "rule"])?;
        let mut reward = http.reward.clone();
        if let Some(e) = get("evaluator") {
            reward.evaluator = Some(e.to_string());
        }
        if let Some(r) = get("rule") {
            reward.rule = RewardRule::parse(r).ok_or_else(|| {
                let names: Vec<_> = RewardRule::ALL.iter().map(|r| r.as_str()).collect();
                Failure::invalid("?rule", format!("must be one of {}", names.join(", ")))
            })?;
        }
        Ok((deadline, reward, parse_samples(&body)?))
    });
    let (deadline, reward, samples) = match prepared {
        Ok(p) => p,
        Err(f) => return refuse(RPC, arrived, f),
    };
    let evaluator = reward.evaluator.clone().unwrap_or_default();
    let single = samples.single;
    answer(RPC, label(&http.engine, &evaluator), arrived, async move {
        let scored = score(&http.engine, &reward, samples, deadline, arrived).await?;
        Ok(render(&scored, single))
    })
    .await
}

/// Reads the body: `query` required, `prompts` and `labels` optional, each a string or a list
/// as long as `query`; other keys (a newer trainer's `datasources`...) are ignored.
pub(super) fn parse_samples(body: &[u8]) -> Result<Samples, Failure> {
    let value: Value = super::parse(body)?;
    let Value::Object(mut object) = value else {
        return Err(Failure::invalid(
            "body",
            "must be a JSON object with `query`",
        ));
    };
    let (queries, single) = match object.remove("query") {
        Some(Value::String(q)) => (vec![q], true),
        Some(Value::Array(items)) => (strings(items, "query", false)?, false),
        Some(_) => {
            return Err(Failure::invalid(
                "query",
                "must be a string or a list of strings",
            ));
        }
        None => return Err(Failure::invalid("query", "is required (prompt + response)")),
    };
    if queries.is_empty() {
        return Err(Failure::invalid("query", "holds no sample"));
    }
    let n = queries.len();
    let prompts = optional_list(object.remove("prompts"), "prompts", n, false)?;
    let labels = optional_list(object.remove("labels"), "labels", n, true)?;
    let samples = queries
        .into_iter()
        .zip(prompts)
        .zip(labels)
        .map(|((query, prompt), label)| RawSample {
            query,
            prompt,
            label,
        })
        .collect();
    Ok(Samples { samples, single })
}

/// A list of strings; with `lenient`, null stays empty and numbers or booleans become text
/// (labels are whatever the dataset held).
fn strings(items: Vec<Value>, field: &'static str, lenient: bool) -> Result<Vec<String>, Failure> {
    items
        .into_iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::String(s) => Ok(s),
            Value::Null if lenient => Ok(String::new()),
            Value::Number(n) if lenient => Ok(n.to_string()),
            Value::Bool(b) if lenient => Ok(b.to_string()),
            _ => Err(Failure::invalid(
                FieldPath::key(field).at(i),
                "must be a string",
            )),
        })
        .collect()
}

/// `prompts` or `labels`: absent or null gives `None` for every sample.
fn optional_list(
    value: Option<Value>,
    field: &'static str,
    n: usize,
    lenient: bool,
) -> Result<Vec<Option<String>>, Failure> {
    let items = match value {
        None | Some(Value::Null) => return Ok(vec![None; n]),
        Some(Value::Array(items)) => strings(items, field, lenient)?,
        Some(one) => strings(vec![one], field, lenient)
            .map_err(|_| Failure::invalid(field, "must be a string or a list of strings"))?,
    };
    if items.len() != n {
        return Err(Failure::invalid(
            field,
            format!("holds {} items for {n} queries", items.len()),
        ));
    }
    Ok(items.into_iter().map(Some).collect())
}

/// One sample as a trace, or `None` when its response holds no step (scored `empty_reward`).
/// `query`, or item `i` of it when the body held a list: where sample `i` sits.
fn sample_at(list: &str, i: usize, single: bool) -> FieldPath {
    let field = FieldPath::key(list.to_string());
    if single { field } else { field.at(i) }
}

fn trace_of(
    sample: RawSample,
    i: usize,
    single: bool,
    reward: &RewardConfig,
) -> Result<Option<Trace>, EngineError> {
    let query = sample_at("query", i, single);
    let parts = chat::split(&sample.query, sample.prompt.as_deref(), reward.question)
        .map_err(|e| EngineError::invalid(query.clone(), e.to_string()))?;
    if parts.response.trim().is_empty() {
        return Ok(None);
    }
    if parts.question.is_empty() {
        return Err(EngineError::invalid(
            sample_at("prompts", i, single),
            "holds no question (its last user turn, or the prompt itself, is empty)",
        ));
    }
    let reference = match reward.labels {
        LabelsAs::Reference => sample.label.unwrap_or_default(),
        LabelsAs::Ignore => String::new(),
    };
    let parts = TraceParts {
        question: parts.question.to_string(),
        reference_answer: reference,
        text: parts.response.to_string(),
        ..TraceParts::default()
    };
    parts.parse(&query).map(Some)
}

/// Scores every sample: those with steps go to the engine together (one admission, batched by
/// the evaluator with whatever else is in flight), the empty ones get `empty_reward`.
async fn score(
    engine: &Engine,
    reward: &RewardConfig,
    samples: Samples,
    deadline: Option<Instant>,
    arrived: Instant,
) -> Result<Vec<SampleReward>, EngineError> {
    let single = samples.single;
    let mut traces = Vec::with_capacity(samples.samples.len());
    for (i, s) in samples.samples.into_iter().enumerate() {
        traces.push(trace_of(s, i, single, reward)?.map(Arc::new));
    }
    let evaluator = reward.evaluator.clone().unwrap_or_default();
    // Each sample keeps its own index: the empty ones are skipped, not renumbered around.
    let requests: Vec<Request> = traces
        .iter()
        .enumerate()
        .filter_map(|(i, t)| Some((i, t.as_ref()?)))
        .map(|(i, t)| Request {
            evaluator: evaluator.clone(),
            trace: t.clone(),
            threshold: None,
            deadline,
            arrived,
            origin: Origin::text(sample_at("query", i, single)),
        })
        .collect();
    let mut verdicts = match requests.len() {
        0 => Vec::new(),
        1 if single => vec![
            engine
                .evaluate(requests.into_iter().next().expect("one"))
                .await?,
        ],
        _ => {
            engine
                .evaluate_all(requests, &FieldPath::key("query"))
                .await?
        }
    }
    .into_iter();
    let empty = SampleReward {
        reward: reward.empty_reward,
        trace_score: reward.empty_reward,
        first_error_index: 0,
        step_count: 0,
        category: crate::api::pb::ErrorCategory::Unspecified as i32,
    };
    traces
        .iter()
        .map(|t| match t {
            None => Ok(empty.clone()),
            Some(t) => scored(
                reward.rule,
                t,
                verdicts.next().expect("one verdict a trace"),
            ),
        })
        .collect()
}

/// One sample's reward; a rule the verdict can't serve (a `?rule=` or `?evaluator=` override the
/// config check could not see) is the caller's error, naming `?rule`.
fn scored(rule: RewardRule, trace: &Trace, v: Verdict) -> Result<SampleReward, EngineError> {
    let reward = rule.apply(&v, trace.steps.len()).map_err(|why| {
        EngineError::invalid(
            FieldPath::key("?rule"),
            format!(
                "rule {:?} {why}; evaluator {:?} does not give it",
                rule.as_str(),
                v.evaluator
            ),
        )
    })?;
    Ok(SampleReward {
        reward,
        trace_score: v.trace_score,
        first_error_index: v.judgement.error_index(),
        step_count: trace.steps.len(),
        category: convert::category(v.judgement.category) as i32,
    })
}

/// OpenRLHF reads `rewards`, then `scores` (the same numbers here), then `extra_logs`, whose
/// values it turns into tensors: numbers only, so the category is its proto enum number.
#[derive(Serialize)]
struct Rewards<T> {
    rewards: T,
    scores: T,
    extra_logs: ExtraLogs<T, Vec<i32>, Vec<usize>>,
}

#[derive(Serialize)]
struct ExtraLogs<F, I, U> {
    first_error_index: I,
    step_count: U,
    category: I,
    trace_score: F,
}

/// The reply: lists for a list, scalars for one string.
fn render(scored: &[SampleReward], single: bool) -> Value {
    let rewards: Vec<f32> = scored.iter().map(|s| s.reward).collect();
    let body = Rewards {
        scores: rewards.clone(),
        rewards,
        extra_logs: ExtraLogs {
            first_error_index: scored.iter().map(|s| s.first_error_index).collect(),
            step_count: scored.iter().map(|s| s.step_count).collect(),
            category: scored.iter().map(|s| s.category).collect(),
            trace_score: scored.iter().map(|s| s.trace_score).collect(),
        },
    };
    let mut value = serde_json::to_value(body).unwrap_or(Value::Null);
    if single {
        unwrap_singletons(&mut value);
    }
    value
}

/// Replaces every one-element list in `value` (an object tree) by its element.
fn unwrap_singletons(value: &mut Value) {
    match value {
        Value::Object(map) => map.values_mut().for_each(unwrap_singletons),
        Value::Array(items) if items.len() == 1 => *value = items.remove(0),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(r: Result<Samples, Failure>) -> String {
        r.unwrap_err().field.unwrap_or_default()
    }

    #[test]
    fn one_sample_or_a_list() {
        let one = parse_samples(br#"{"query": "p r", "prompts": "p", "labels": "5"}"#).unwrap();
        assert!(one.single);
        assert_eq!(one.samples[0].prompt.as_deref(), Some("p"));
        assert_eq!(one.samples[0].label.as_deref(), Some("5"));
        let many = parse_samples(
            br#"{"query": ["a", "b"], "prompts": ["x", "y"], "labels": [3, null], "datasources": ["m"]}"#,
        )
        .unwrap();
        assert!(!many.single);
        assert_eq!(many.samples[1].prompt.as_deref(), Some("y"));
        assert_eq!(many.samples[0].label.as_deref(), Some("3"));
        assert_eq!(many.samples[1].label.as_deref(), Some(""));
        let bare = parse_samples(br#"{"query": ["a"]}"#).unwrap();
        assert_eq!(bare.samples[0].prompt, None);
    }

    #[test]
    fn bad_bodies_name_the_field() {
        assert_eq!(field(parse_samples(b"{")), "body");
        assert_eq!(field(parse_samples(b"[]")), "body");
        assert_eq!(field(parse_samples(br#"{"prompts": []}"#)), "query");
        assert_eq!(field(parse_samples(br#"{"query": []}"#)), "query");
        assert_eq!(field(parse_samples(br#"{"query": ["a", 3]}"#)), "query[1]");
        assert_eq!(
            field(parse_samples(br#"{"query": ["a", "b"], "prompts": ["x"]}"#)),
            "prompts"
        );
        assert_eq!(
            field(parse_samples(br#"{"query": ["a"], "prompts": [1]}"#)),
            "prompts[0]"
        );
    }

    #[test]
    fn scalars_for_one_sample() {
        let s = SampleReward {
            reward: 0.5,
            trace_score: 0.5,
            first_error_index: -1,
            step_count: 2,
            category: 1,
        };
        let one = render(std::slice::from_ref(&s), true);
        assert_eq!(one["rewards"], serde_json::json!(0.5));
        assert_eq!(one["extra_logs"]["step_count"], serde_json::json!(2));
        let many = render(&[s.clone(), s], false);
        assert_eq!(many["scores"], serde_json::json!([0.5, 0.5]));
        assert_eq!(
            many["extra_logs"]["first_error_index"],
            serde_json::json!([-1, -1])
        );
    }
}
