//! The reward routes' shared path: a trainer's contract (`openrlhf`: `POST /get_reward`,
//! `slime`: `POST /slime/reward`) reads its body into samples; here each sample becomes a trace,
//! the samples go to the engine together under one deadline, and each verdict becomes a reward
//! that the contract writes back in its trainer's shape.

mod openrlhf;
mod policy;
mod slime;

pub(super) use openrlhf::Openrlhf;
pub(crate) use policy::PolicyTokenizer;
pub(super) use slime::Slime;

use super::{Failure, Http, QueryParams, answer_as, chat, params, refuse};
use crate::api::convert::TraceParts;
use crate::api::{convert, label};
use crate::config::{LabelsAs, OnTimeout, RewardConfig, RewardRule};
use crate::engine::{Engine, EngineError, Origin, Request};
use crate::field::FieldPath;
use crate::trace::{Trace, Verdict};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tonic::Code;

/// A trainer's reward contract: how its body reads into samples, and how rewards go back.
pub(super) trait Contract: Sized + Send + 'static {
    /// The route, as the `rpc` label of metrics has it.
    const RPC: &'static str;
    /// The query parameters it takes.
    const PARAMS: &'static [&'static str];

    /// Reads the body (and the parameters beside `evaluator` and `rule`) into samples, keeping
    /// what `render` needs.
    fn read(
        body: &[u8],
        http: &Http,
        param: &dyn Fn(&str) -> Option<String>,
    ) -> Result<(Self, Vec<Sample>), Failure>;

    /// The field an admission error names for the whole batch.
    fn list(&self) -> FieldPath;

    /// The reply, one reward per sample in the body's order.
    fn render(&self, rewards: &[SampleReward]) -> Value;
}

/// One sample as its contract sent it.
#[derive(Debug, PartialEq)]
pub(super) struct Sample {
    pub text: Text,
    pub label: Option<String>,
    /// Where its response sits in the body (`query[2]`, `completion_ids[2]`, `response`), and
    /// where its prompt does (`prompts[2]`, `prompt_ids[2]`, `prompt`).
    pub at: FieldPath,
    pub prompt_at: FieldPath,
}

/// A sample's text.
#[derive(Debug, PartialEq)]
pub(super) enum Text {
    /// OpenRLHF's query: prompt and response decoded together, and the prompt when sent.
    Query {
        query: String,
        prompt: Option<String>,
    },
    /// Prompt and response apart: the prompt as text (chat markup and all) or the question
    /// itself (the last user message of a message list).
    Apart {
        prompt: String,
        is_question: bool,
        response: String,
    },
    /// Token ids, decoded by the policy's tokenizer before anything else.
    Ids {
        prompt: Vec<u32>,
        completion: Vec<u32>,
    },
}

/// What one sample got.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct SampleReward {
    pub reward: f32,
    pub trace_score: f32,
    pub first_error_index: i32,
    pub step_count: usize,
    pub category: i32,
    /// Its deadline passed and `on_timeout = "empty_reward"` gave it `empty_reward`.
    pub timed_out: bool,
}

/// When a reward request stops waiting, and what set it, for the error that names it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Deadline {
    at: Instant,
    seconds: f64,
    from: &'static str,
}

impl Deadline {
    /// The caller's `x-request-timeout` when sent (HTTP has no `grpc-timeout`), else
    /// `[reward] timeout_s` from when the request arrived.
    fn of(header: Option<Instant>, reward: &RewardConfig, arrived: Instant) -> Option<Deadline> {
        match (header, reward.timeout_s) {
            (Some(at), _) => Some(Deadline {
                at,
                seconds: at.saturating_duration_since(arrived).as_secs_f64(),
                from: "its x-request-timeout header",
            }),
            (None, Some(seconds)) => Some(Deadline {
                at: arrived + Duration::from_secs_f64(seconds),
                seconds,
                from: "[reward] timeout_s",
            }),
            (None, None) => None,
        }
    }

    /// The engine's deadline error, saying which deadline passed.
    fn exceeded(self, message: &str) -> EngineError {
        EngineError::DeadlineExceeded(format!(
            "{message}; the request's deadline was {} s, set by {}",
            self.seconds, self.from
        ))
    }
}

/// Every reward route: admits, applies `?evaluator=` and `?rule=`, reads the body as `C`
/// does, scores under the deadline and answers in `C`'s shape. A request with a sample whose
/// deadline passed counts as deadline_exceeded, whether it failed or got `empty_reward`.
pub(super) async fn handle<C: Contract>(
    State(http): State<Arc<Http>>,
    query: QueryParams,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let arrived = Instant::now();
    let prepared = http.admit(&headers, arrived).and_then(|header| {
        let get = params(&query, C::PARAMS)?;
        let param = |k: &str| get(k).map(str::to_string);
        let reward = overridden(&http.reward, &param)?;
        let (contract, samples) = C::read(&body, &http, &param)?;
        Ok((
            Deadline::of(header, &reward, arrived),
            reward,
            contract,
            samples,
        ))
    });
    let (deadline, reward, contract, samples) = match prepared {
        Ok(p) => p,
        Err(f) => return refuse(C::RPC, arrived, f),
    };
    let evaluator = reward.evaluator.clone().unwrap_or_default();
    answer_as(
        C::RPC,
        label(&http.engine, &evaluator),
        arrived,
        async move {
            let samples = policy::decode_ids(http.policy.clone(), samples).await?;
            let list = contract.list();
            let scored = score(&http.engine, &reward, samples, &list, deadline, arrived).await?;
            let code = match scored.iter().any(|s| s.timed_out) {
                true => Code::DeadlineExceeded,
                false => Code::Ok,
            };
            Ok((contract.render(&scored), code))
        },
    )
    .await
}

/// `[reward]` with the request's `?evaluator=` and `?rule=`.
fn overridden(
    reward: &RewardConfig,
    param: &dyn Fn(&str) -> Option<String>,
) -> Result<RewardConfig, Failure> {
    let mut reward = reward.clone();
    if let Some(e) = param("evaluator") {
        reward.evaluator = Some(e);
    }
    if let Some(r) = param("rule") {
        reward.rule = RewardRule::parse(&r).ok_or_else(|| {
            let names: Vec<_> = RewardRule::ALL.iter().map(|r| r.as_str()).collect();
            Failure::invalid("?rule", format!("must be one of {}", names.join(", ")))
        })?;
    }
    Ok(reward)
}

/// One sample as a trace, or `None` when its response holds no step (scored `empty_reward`).
fn trace_of(sample: Sample, reward: &RewardConfig) -> Result<Option<Trace>, EngineError> {
    let (question, response) = match &sample.text {
        Text::Query { query, prompt } => {
            let parts = chat::split(query, prompt.as_deref(), reward.question)
                .map_err(|e| EngineError::invalid(sample.at.clone(), e.to_string()))?;
            (parts.question, parts.response)
        }
        Text::Apart {
            prompt,
            is_question,
            response,
        } => {
            let question = match is_question {
                true => prompt.trim(),
                false => chat::question(prompt, reward.question),
            };
            (question, chat::strip_end_markers(response))
        }
        Text::Ids { .. } => {
            return Err(EngineError::Internal(format!(
                "{}: token ids reached scoring undecoded",
                sample.at
            )));
        }
    };
    if response.trim().is_empty() {
        return Ok(None);
    }
    if question.is_empty() {
        return Err(EngineError::invalid(
            sample.prompt_at,
            "holds no question (its last user turn, or the prompt itself, is empty)",
        ));
    }
    let reference = match reward.labels {
        LabelsAs::Reference => sample.label.clone().unwrap_or_default(),
        LabelsAs::Ignore => String::new(),
    };
    let parts = TraceParts {
        question: question.to_string(),
        reference_answer: reference,
        text: response.to_string(),
        ..TraceParts::default()
    };
    parts.parse(&sample.at).map(Some)
}

/// Scores every sample: those with steps go to the engine together (one admission, batched by
/// the evaluator with whatever else is in flight), the empty ones get `empty_reward`, and so,
/// under `on_timeout = "empty_reward"`, do those whose deadline passed.
async fn score(
    engine: &Engine,
    reward: &RewardConfig,
    samples: Vec<Sample>,
    list: &FieldPath,
    deadline: Option<Deadline>,
    arrived: Instant,
) -> Result<Vec<SampleReward>, EngineError> {
    let mut traces = Vec::with_capacity(samples.len());
    for s in samples {
        let at = s.at.clone();
        traces.push(trace_of(s, reward)?.map(|t| (Arc::new(t), at)));
    }
    let evaluator = reward.evaluator.clone().unwrap_or_default();
    let requests: Vec<Request> = traces
        .iter()
        .flatten()
        .map(|(t, at)| Request {
            evaluator: evaluator.clone(),
            trace: t.clone(),
            threshold: None,
            deadline: deadline.map(|d| d.at),
            arrived,
            origin: Origin::text(at.clone()),
        })
        .collect();
    let keep_going = reward.on_timeout == OnTimeout::EmptyReward;
    let settle = |result: Result<Verdict, EngineError>| match result {
        Err(EngineError::DeadlineExceeded(_)) if keep_going => Ok(None),
        Err(EngineError::DeadlineExceeded(m)) => Err(match deadline {
            Some(d) => d.exceeded(&m),
            None => EngineError::DeadlineExceeded(m),
        }),
        other => other.map(Some),
    };
    let mut verdicts = engine
        .evaluate_each(requests, list, settle)
        .await?
        .into_iter();
    let empty = |timed_out| SampleReward {
        reward: reward.empty_reward,
        trace_score: reward.empty_reward,
        first_error_index: 0,
        step_count: 0,
        category: crate::api::pb::ErrorCategory::Unspecified as i32,
        timed_out,
    };
    let scored: Vec<SampleReward> = traces
        .iter()
        .map(|t| match t {
            None => Ok(empty(false)),
            Some((t, _)) => match verdicts.next().flatten() {
                Some(v) => scored(reward.rule, t, v),
                None => Ok(empty(true)),
            },
        })
        .collect::<Result<_, _>>()?;
    let late = scored.iter().filter(|s| s.timed_out).count();
    if late > 0 {
        tracing::warn!(
            samples = late,
            deadline_s = ?deadline.map(|d| d.seconds),
            from = ?deadline.map(|d| d.from),
            "reward samples passed their deadline; answered with empty_reward"
        );
    }
    Ok(scored)
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
        timed_out: false,
    })
}

/// `field`, or item `i` of it when the body held a list: where sample `i` sits.
fn sample_at(field: &'static str, i: usize, single: bool) -> FieldPath {
    let field = FieldPath::key(field);
    if single { field } else { field.at(i) }
}

/// A label as text: datasets hold strings, numbers or booleans; null is no label.
fn label_text(value: Value, field: FieldPath) -> Result<Option<String>, Failure> {
    match value {
        Value::String(s) => Ok(Some(s)),
        Value::Null => Ok(None),
        Value::Number(n) => Ok(Some(n.to_string())),
        Value::Bool(b) => Ok(Some(b.to_string())),
        _ => Err(Failure::invalid(
            field,
            "must be a string, a number, a boolean or null",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_wins_over_the_config_and_names_itself() {
        let arrived = Instant::now();
        let reward = RewardConfig {
            timeout_s: Some(30.0),
            ..RewardConfig::default()
        };
        let from_config = Deadline::of(None, &reward, arrived).unwrap();
        assert_eq!(from_config.at, arrived + Duration::from_secs(30));
        assert_eq!(from_config.from, "[reward] timeout_s");
        let header = arrived + Duration::from_millis(1500);
        let from_header = Deadline::of(Some(header), &reward, arrived).unwrap();
        assert_eq!((from_header.at, from_header.seconds), (header, 1.5));
        assert_eq!(Deadline::of(None, &RewardConfig::default(), arrived), None);
        let e = from_config.exceeded("evaluator \"j\" did not answer in time");
        assert!(
            e.to_string()
                .ends_with("the request's deadline was 30 s, set by [reward] timeout_s"),
            "{e}"
        );
    }
}
