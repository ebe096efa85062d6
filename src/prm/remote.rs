//! A PRM scored by a vLLM server: formatted and tokenized here exactly as in-process, its token
//! ids sent through the shared upstream caller, and vLLM's reply mapped to one score per step.
//!
//! Two routes, by the family's head:
//! - token classification (qwen2-math-prm): `POST /pooling` with `task = "token_classify"`; vLLM's
//!   STEP pooler returns `[p_wrong, p_right]` at each step tag (its ALL pooler, one row per
//!   token, is read at the same positions);
//! - a causal LM read at `+`/`-` (math-shepherd, rlhflow, chat-lm): `POST /v1/completions` with
//!   `prompt_logprobs`, the log-softmax at every position, read at each step's position. vLLM's
//!   pooler for these models indexes hidden states, not logits, so it can't give these scores.

use super::config::{PrmConfig, VllmConfig};
use super::format::{Encoded, Family, Formatter, PrmKind};
use super::{PrmLoadError, encode, find_model};
use crate::engine::{Description, EngineError, Evaluator, Job};
use crate::metrics;
use crate::trace::Judgement;
use crate::upstream::{self, AttemptError, CallError, Caller, Endpoint, Raw, snippet};
use futures::future::BoxFuture;
use retrace_model::{HeadSpec, ModelConfig};
use serde::Deserialize;
use serde_json::{Map, Value, json};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Which endpoint, and how its reply becomes scores.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Route {
    Pooling,
    Logprobs { plus: u32, minus: u32, top: u32 },
}

pub(crate) struct RemotePrm {
    name: String,
    family: Family,
    folder: PathBuf,
    formatter: Arc<Formatter>,
    /// `max_position_embeddings` from the folder's config.json, when it has one: a trace longer
    /// than that is refused here with the field named, not by vLLM with a 400.
    max_tokens: Option<usize>,
    served_model: Option<String>,
    route: Route,
    caller: Caller,
}

impl RemotePrm {
    /// Builds the evaluator; nothing is sent to vLLM until the first request.
    pub(crate) fn load(
        name: &str,
        max_concurrency: usize,
        cfg: &PrmConfig,
        vllm: &VllmConfig,
    ) -> Result<RemotePrm, PrmLoadError> {
        let fail = PrmLoadError;
        let folder = find_model(
            &cfg.model,
            "with backend = \"vllm\" it holds the tokenizer retrace formats with",
        )?;
        let PrmKind::Checkpoint(family) = cfg.family else {
            return Err(fail(
                "a trained head runs in-process only; use backend = \"candle\"".into(),
            ));
        };
        let formatter = Formatter::load(family, &folder).map_err(|e| fail(e.to_string()))?;
        let route = match family {
            Family::QwenMathPrm => Route::Pooling,
            Family::Skywork => {
                return Err(fail(
                    "vLLM has no pooler for skywork-prm's value head; use backend = \"candle\""
                        .into(),
                ));
            }
            Family::OutcomeRm => {
                return Err(fail(
                    "outcome-rm runs in-process only; use backend = \"candle\"".into(),
                ));
            }
            Family::MathShepherd | Family::Rlhflow | Family::ChatLm => {
                match formatter.head_spec() {
                    HeadSpec::LmPair { plus, minus } => Route::Logprobs {
                        plus,
                        minus,
                        top: vllm.top_logprobs,
                    },
                    other => return Err(fail(format!("family head {other:?} is not an LM pair"))),
                }
            }
        };
        let keys = &vllm.endpoint;
        let api_key =
            upstream::api_key(keys.api_key_env.as_deref()).map_err(|e| fail(e.to_string()))?;
        let base = keys.base_url.as_str();
        let base = base.trim_end_matches('/').trim_end_matches("/v1");
        let url = match route {
            Route::Pooling => format!("{base}/pooling"),
            Route::Logprobs { .. } => format!("{base}/v1/completions"),
        };
        let endpoint = Endpoint::new(url, api_key).map_err(|e| fail(e.to_string()))?;
        let policy = keys.policy(max_concurrency);
        Ok(RemotePrm {
            name: name.to_string(),
            family,
            max_tokens: max_positions(&folder),
            folder,
            formatter: Arc::new(formatter),
            served_model: vllm.served_model.clone(),
            route,
            caller: Caller::new(name, &metrics::PRM_UPSTREAM, endpoint, policy),
        })
    }

    async fn score(
        &self,
        encoded: &Encoded,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Scores, CallError> {
        let body = request_body(self.route, self.served_model.as_deref(), &encoded.ids);
        let route = self.route;
        self.caller
            .call(&body, deadline, |raw| read_scores(route, encoded, &raw))
            .await
    }
}

/// The decoder's context length, read as the in-process backend reads it (config.json, or a
/// GGUF's metadata); `None` when the files don't say.
fn max_positions(model_path: &Path) -> Option<usize> {
    let config = if retrace_model::is_gguf(model_path) {
        retrace_model::Gguf::open(model_path).ok()?.config().ok()?
    } else {
        let text = std::fs::read_to_string(model_path.join("config.json")).ok()?;
        ModelConfig::from_json(&text).ok()?
    };
    Some(config.max_position_embeddings)
}

/// The request for one trace's ids.
fn request_body(route: Route, model: Option<&str>, ids: &[u32]) -> Value {
    let mut body = Map::new();
    if let Some(m) = model {
        body.insert("model".into(), json!(m));
    }
    match route {
        Route::Pooling => {
            body.insert("input".into(), json!(ids));
            body.insert("task".into(), json!("token_classify"));
            // Probabilities, not logits: the head's softmax is vLLM's activation.
            body.insert("use_activation".into(), json!(true));
        }
        Route::Logprobs { plus, top, .. } => {
            // prompt_logprobs[i] is the distribution after tokens 0..i, so the one after the last
            // token needs a token behind it; a causal model's earlier positions can't see it.
            let mut prompt = ids.to_vec();
            prompt.push(plus);
            body.insert("prompt".into(), json!(prompt));
            body.insert("prompt_logprobs".into(), json!(top));
            body.insert("max_tokens".into(), json!(1));
            body.insert("temperature".into(), json!(0));
        }
    }
    Value::Object(body)
}

/// One trace's scores, and how many of them had to bound a log-probability vLLM left out.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Scores {
    pub scores: Vec<f32>,
    pub inexact: usize,
}

#[derive(Deserialize)]
struct PoolingReply {
    data: Vec<PoolingItem>,
}

#[derive(Deserialize)]
struct PoolingItem {
    data: Value,
}

#[derive(Deserialize)]
struct CompletionReply {
    choices: Vec<CompletionChoice>,
}

#[derive(Deserialize)]
struct CompletionChoice {
    #[serde(default)]
    prompt_logprobs: Option<Vec<Option<HashMap<String, Logprob>>>>,
}

#[derive(Deserialize)]
struct Logprob {
    /// JSON has no -inf: a server may send null for a token the model rules out.
    logprob: Option<f64>,
}

impl Logprob {
    fn value(&self) -> f64 {
        self.logprob.unwrap_or(f64::NEG_INFINITY)
    }
}

/// Reads a 2xx reply into one score per step. Pure, so every shape vLLM may send is a test.
fn read_scores(route: Route, encoded: &Encoded, raw: &Raw) -> Result<Scores, AttemptError> {
    match route {
        Route::Pooling => read_pooling(encoded, &raw.body),
        Route::Logprobs { plus, minus, .. } => read_logprobs(encoded, &raw.body, plus, minus),
    }
}

fn bad(what: &str, detail: String) -> AttemptError {
    AttemptError::BadResponse(format!("{what}: {detail}"))
}

const POOLING: &str = "a vLLM pooling response";
const COMPLETION: &str = "a vLLM completion with prompt_logprobs";

fn read_pooling(encoded: &Encoded, body: &[u8]) -> Result<Scores, AttemptError> {
    let reply: PoolingReply = serde_json::from_slice(body)
        .map_err(|e| bad(POOLING, format!("{e}; body starts {:?}", snippet(body))))?;
    let [item] = reply.data.as_slice() else {
        return Err(bad(
            POOLING,
            format!("it holds {} items for one input", reply.data.len()),
        ));
    };
    let rows: Vec<Vec<f64>> = serde_json::from_value(item.data.clone()).map_err(|_| {
        bad(
            POOLING,
            "its data is not a list of rows of numbers (an embedding? serve the model with \
             --runner pooling and its token_classify head)"
                .into(),
        )
    })?;
    let steps = encoded.positions.len();
    // STEP pooling: a row per step tag, in order. ALL pooling: a row per token.
    let picked: Vec<&Vec<f64>> = if rows.len() == steps {
        rows.iter().collect()
    } else if rows.len() == encoded.ids.len() {
        encoded.positions.iter().map(|&p| &rows[p]).collect()
    } else {
        return Err(bad(
            POOLING,
            format!(
                "it holds {} rows for {steps} steps and {} tokens; the STEP pooler must tag \
                 the family's step token (vLLM's default step_tag_id for Qwen2.5-Math-PRM)",
                rows.len(),
                encoded.ids.len()
            ),
        ));
    };
    let mut scores = Vec::with_capacity(steps);
    for (step, row) in picked.into_iter().enumerate() {
        let [wrong, right] = row.as_slice() else {
            return Err(bad(
                POOLING,
                format!("step {step}'s row has {} values, not 2", row.len()),
            ));
        };
        let probability = |v: f64| v.is_finite() && (0.0..=1.0).contains(&v);
        if !probability(*wrong) || !probability(*right) || (wrong + right - 1.0).abs() > 1e-3 {
            return Err(bad(
                POOLING,
                format!(
                    "step {step}'s row [{wrong}, {right}] is not two probabilities summing to \
                     1; leave vLLM's activation on (no use_activation = false)"
                ),
            ));
        }
        scores.push(*right as f32);
    }
    Ok(Scores { scores, inexact: 0 })
}

fn read_logprobs(
    encoded: &Encoded,
    body: &[u8],
    plus: u32,
    minus: u32,
) -> Result<Scores, AttemptError> {
    let reply: CompletionReply = serde_json::from_slice(body)
        .map_err(|e| bad(COMPLETION, format!("{e}; body starts {:?}", snippet(body))))?;
    let Some(choice) = reply.choices.first() else {
        return Err(bad(COMPLETION, "it holds no choices".into()));
    };
    let Some(positions) = &choice.prompt_logprobs else {
        return Err(bad(
            COMPLETION,
            "it has no prompt_logprobs (a server other than vLLM?)".into(),
        ));
    };
    // One entry per prompt token, the extra one included; the first is null.
    if positions.len() != encoded.ids.len() + 1 {
        return Err(bad(
            COMPLETION,
            format!(
                "it has {} prompt_logprobs entries for {} prompt tokens",
                positions.len(),
                encoded.ids.len() + 1
            ),
        ));
    }
    let (plus_key, minus_key) = (plus.to_string(), minus.to_string());
    let mut scores = Vec::with_capacity(encoded.positions.len());
    let mut inexact = 0;
    for (step, &p) in encoded.positions.iter().enumerate() {
        let Some(Some(top)) = positions.get(p + 1) else {
            return Err(bad(
                COMPLETION,
                format!("step {step}'s position {} has no log-probabilities", p + 1),
            ));
        };
        let read = |key: &str| top.get(key).map(Logprob::value).filter(|l| !l.is_nan());
        let (lp_plus, lp_minus) = (read(&plus_key), read(&minus_key));
        if lp_plus.is_none() || lp_minus.is_none() {
            // Left out of the top-k: its log-probability is at most the smallest listed one.
            inexact += 1;
        }
        let floor = || {
            let least = top
                .values()
                .map(Logprob::value)
                .filter(|l| l.is_finite())
                .fold(f64::INFINITY, f64::min);
            if least.is_finite() {
                Ok(least)
            } else {
                Err(bad(
                    COMPLETION,
                    format!("step {step}'s log-probabilities hold no finite value to bound by"),
                ))
            }
        };
        let a = match lp_plus {
            Some(a) => a,
            None => floor()?,
        };
        let b = match lp_minus {
            Some(b) => b,
            None => floor()?,
        };
        // softmax over (logit[+], logit[-]), index 0: the log-softmax offsets cancel.
        let score = 1.0 / (1.0 + (b - a).exp());
        if !score.is_finite() {
            return Err(bad(
                COMPLETION,
                format!("step {step}: + and - both have log-probability -inf"),
            ));
        }
        scores.push(score as f32);
    }
    Ok(Scores { scores, inexact })
}

impl Evaluator for RemotePrm {
    fn describe(&self) -> Description {
        Description {
            kind: "prm".into(),
            family: self.family.as_str().into(),
            model: format!("{} (vLLM at {})", self.folder.display(), self.caller.url()),
        }
    }

    fn evaluate(&self, job: Job) -> BoxFuture<'_, Result<Judgement, EngineError>> {
        Box::pin(async move {
            let encoded = encode(
                &self.name,
                &self.formatter,
                job.trace.clone(),
                self.max_tokens,
            )
            .await?;
            let sent = Instant::now();
            let scored = self.score(&encoded, job.deadline).await.map_err(|e| {
                let message = format!("PRM {:?} on vLLM: {e}", self.name);
                if e.is_timeout() {
                    EngineError::DeadlineExceeded(message)
                } else {
                    EngineError::Unavailable(message)
                }
            })?;
            metrics::record_stage(&self.name, metrics::Stage::Inference, sent.elapsed());
            metrics::PRM_UPSTREAM.request(&self.name, "ok");
            if scored.inexact > 0 {
                metrics::record_prm_inexact(&self.name, scored.inexact as u64);
            }
            let mut judgement = Judgement::from_scores(scored.scores, job.threshold);
            judgement.inference = sent.elapsed();
            judgement.tokens = Some((encoded.ids.len(), 0));
            Ok(judgement)
        })
    }
}

#[cfg(test)]
#[path = "remote_tests.rs"]
mod tests;
