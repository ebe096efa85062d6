//! The reward routes' shared path: a trainer's contract (`openrlhf`: `POST /get_reward`,
//! `slime`: `POST /slime/reward`) reads its body into samples; here each sample becomes a trace,
//! the samples go to the engine together under one deadline, and each verdict becomes a reward
//! that the contract writes back in its trainer's shape.

mod openrlhf;
mod policy;
mod rule;
mod slime;

pub(super) use openrlhf::Openrlhf;
pub(crate) use policy::PolicyTokenizer;
pub(super) use slime::Slime;

use super::{Failure, Http, QueryParams, answer_as, chat, params, refuse};
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
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;
use tonic::Code;

/// The reward routes' own failures: slips in their bookkeeping, never the caller's input.
#[derive(Debug, thiserror::Error)]
enum RewardBug {
    #[error("{0}: token ids reached scoring undecoded")]
    Undecoded(FieldPath),
    #[error("a reward sample went unanswered")]
    Unanswered,
    #[error("decoding token ids panicked: {0}")]
    DecodePanicked(String),
}

impl From<RewardBug> for EngineError {
    fn from(e: RewardBug) -> Self {
        EngineError::Internal(e.to_string())
    }
}

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

/// A sample without a verdict has no first error: not -1 (every step holds), 0 (the first step
/// is wrong) nor -2 (`UNLOCATED`: wrong, no step named), which a trainer's logs would read as
/// verdicts. Numbers, since OpenRLHF makes tensors of `extra_logs`.
pub(super) const NO_VERDICT_INDEX: i32 = -3;
/// Nor a trace score: a step score is a probability, so -1 cannot be one.
pub(super) const NO_VERDICT_SCORE: f32 = -1.0;

/// What one sample got.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct SampleReward {
    pub reward: f32,
    pub trace_score: f32,
    pub first_error_index: i32,
    pub step_count: usize,
    pub category: i32,
    /// Whether the reward is a verdict's, and if not, why not.
    pub status: SampleStatus,
    /// The error behind a status other than `ok` and `empty`.
    pub detail: Option<String>,
}

/// Why a sample's reward is what it is: a verdict's (`ok`), or the stand-in `[reward]` sets
/// for a sample that got none, so a trainer never mistakes one for the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SampleStatus {
    Ok,
    /// The response holds no step.
    Empty,
    /// Over a size limit of the evaluator's (bytes, steps or tokens; the detail says which).
    TooLarge,
    /// Its deadline passed first.
    TimedOut,
    /// The evaluator (or its upstream) could not answer.
    Unavailable,
}

impl SampleStatus {
    /// The status's name, as the replies and `retrace_reward_samples_total` spell it.
    pub(super) fn as_str(self) -> &'static str {
        match self {
            SampleStatus::Ok => "ok",
            SampleStatus::Empty => "empty",
            SampleStatus::TooLarge => "too_large",
            SampleStatus::TimedOut => "timed_out",
            SampleStatus::Unavailable => "unavailable",
        }
    }
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
    let named = label(&http.engine, &evaluator);
    answer_as(C::RPC, named.clone(), arrived, async move {
        let samples = policy::decode_ids(http.policy.clone(), samples).await?;
        let list = contract.list();
        let scored = score(&http.engine, &reward, samples, &list, deadline, arrived).await?;
        for s in &scored {
            crate::metrics::record_reward_sample(C::RPC, &named, s.status.as_str());
        }
        let code = match scored.iter().any(|s| s.status == SampleStatus::TimedOut) {
            true => Code::DeadlineExceeded,
            false => Code::Ok,
        };
        Ok((contract.render(&scored), code))
    })
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
        Text::Ids { .. } => return Err(RewardBug::Undecoded(sample.at.clone()).into()),
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
    let settle = |result| settle(result, reward, deadline);
    let mut settled = engine
        .evaluate_each(requests, list, settle)
        .await?
        .into_iter();
    let stand_in = |status, reward, detail| SampleReward {
        reward,
        trace_score: NO_VERDICT_SCORE,
        first_error_index: NO_VERDICT_INDEX,
        step_count: 0,
        category: crate::api::pb::ErrorCategory::Unspecified as i32,
        status,
        detail,
    };
    let scored: Vec<SampleReward> = traces
        .iter()
        .map(|t| match t {
            None => Ok(stand_in(SampleStatus::Empty, reward.empty_reward, None)),
            Some((t, _)) => match settled.next() {
                Some(Settled::Verdict(v)) => scored(reward.rule, t, v),
                Some(Settled::Unscored(status, r, detail)) => Ok(stand_in(status, r, Some(detail))),
                None => Err(RewardBug::Unanswered.into()),
            },
        })
        .collect::<Result<_, _>>()?;
    let unscored = scored.iter().filter(|s| s.detail.is_some()).count();
    if unscored > 0 {
        tracing::warn!(
            samples = unscored,
            of = scored.len(),
            first = ?scored.iter().find_map(|s| s.detail.as_deref()),
            deadline_s = ?deadline.map(|d| d.seconds),
            "reward samples got no verdict; answered with [reward]'s stand-in and their status"
        );
    }
    Ok(scored)
}

/// A scored sample's outcome: its verdict, or the status and stand-in reward `[reward]`
/// gives a sample that got none.
enum Settled {
    Verdict(Verdict),
    Unscored(SampleStatus, f32, String),
}

/// One sample's result as `[reward]`'s `on_*` keys settle it: a verdict, a stand-in reward
/// with its status, or the error that fails the request (a deadline naming what set it).
fn settle(
    result: Result<Verdict, EngineError>,
    reward: &RewardConfig,
    deadline: Option<Deadline>,
) -> Result<Settled, EngineError> {
    let e = match result {
        Ok(v) => return Ok(Settled::Verdict(v)),
        Err(e) => e,
    };
    let (status, on) = match &e {
        EngineError::DeadlineExceeded(_) => (SampleStatus::TimedOut, reward.on_timeout),
        EngineError::TooLarge { .. } => (SampleStatus::TooLarge, reward.on_too_large),
        EngineError::Unavailable(_) => (SampleStatus::Unavailable, reward.on_unavailable),
        _ => return Err(e),
    };
    match (on.reward(reward.empty_reward), e) {
        (Some(r), e) => Ok(Settled::Unscored(status, r, e.to_string())),
        (None, EngineError::DeadlineExceeded(m)) => Err(match deadline {
            Some(d) => d.exceeded(&m),
            None => EngineError::DeadlineExceeded(m),
        }),
        (None, e) => Err(e),
    }
}

/// One sample's reward; a rule the verdict can't serve (a `?rule=` or `?evaluator=` override the
/// config check could not see) is the caller's error, naming `?rule`.
fn scored(rule: RewardRule, trace: &Trace, v: Verdict) -> Result<SampleReward, EngineError> {
    let reward = rule::reward(rule, &v, trace.steps.len()).map_err(|why| {
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
        status: SampleStatus::Ok,
        detail: None,
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
    fn every_status_is_a_series_the_metrics_start_at_zero() {
        let all = [
            SampleStatus::Ok,
            SampleStatus::Empty,
            SampleStatus::TooLarge,
            SampleStatus::TimedOut,
            SampleStatus::Unavailable,
        ];
        let names: Vec<_> = all.iter().map(|s| s.as_str()).collect();
        assert_eq!(names, crate::metrics::REWARD_STATUSES);
        let routes = [Openrlhf::RPC, Slime::RPC];
        assert_eq!(routes, crate::metrics::REWARD_ROUTES);
    }

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
