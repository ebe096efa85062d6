//! One chat-completions exchange with an OpenAI-compatible server (vLLM, SGLang, llama.cpp,
//! OpenAI, Gemini's and DeepSeek's endpoints): the request body, and the reply read into choices
//! and token counts. The HTTP call itself is the shared upstream module's.

pub(crate) use crate::upstream::AttemptError;
use crate::upstream::snippet;
use serde::Deserialize;
use serde_json::{Map, Value, json};

/// The sampling parameters of one judge, fixed at load.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ChatParams {
    pub model: String,
    /// `None` is omitted from the body (reasoning models refuse it).
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub max_tokens: u32,
    /// Reasoning models (OpenAI o-series and later) take `max_completion_tokens` and refuse
    /// `max_tokens`, `temperature` and `top_p`.
    pub reasoning: bool,
    /// Copied into the body as given (`reasoning_effort`, `chat_template_kwargs`, `seed`...).
    pub extra: Map<String, Value>,
}

/// One turn of the conversation sent.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ChatMessage {
    pub role: &'static str,
    pub content: String,
}

/// A reply read from the upstream: choices in `index` order, and what it says it spent.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Reply {
    pub choices: Vec<Choice>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl Reply {
    /// The bytes of text it holds, for the cache's budget.
    pub(crate) fn text_bytes(&self) -> usize {
        self.choices
            .iter()
            .map(|c| c.content.len() + c.reasoning.as_ref().map_or(0, String::len))
            .sum()
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Choice {
    pub content: String,
    /// `reasoning_content` (DeepSeek, vLLM, llama.cpp) or `reasoning` (OpenRouter, newer vLLM).
    pub reasoning: Option<String>,
    pub finish_reason: Option<String>,
}

/// The JSON body of a chat-completions request. `n` is sent only above 1, since some
/// OpenAI-compatible servers refuse the field outright.
pub(crate) fn request_body(params: &ChatParams, turns: &[ChatMessage], n: u32) -> Value {
    let messages: Vec<Value> = turns
        .iter()
        .map(|t| json!({"role": t.role, "content": t.content}))
        .collect();
    let mut body = Map::new();
    body.insert("model".into(), json!(params.model));
    body.insert("messages".into(), Value::Array(messages));
    body.insert("stream".into(), json!(false));
    if params.reasoning {
        body.insert("max_completion_tokens".into(), json!(params.max_tokens));
    } else {
        body.insert("max_tokens".into(), json!(params.max_tokens));
        if let Some(t) = params.temperature {
            body.insert("temperature".into(), json!(t));
        }
        if let Some(p) = params.top_p {
            body.insert("top_p".into(), json!(p));
        }
    }
    if n > 1 {
        body.insert("n".into(), json!(n));
    }
    for (k, v) in &params.extra {
        body.insert(k.clone(), v.clone());
    }
    Value::Object(body)
}

#[derive(Deserialize)]
struct WireCompletion {
    choices: Vec<WireChoice>,
    #[serde(default)]
    usage: Option<WireUsage>,
}

#[derive(Deserialize)]
struct WireChoice {
    #[serde(default)]
    index: Option<u32>,
    message: WireMessage,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct WireMessage {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    reasoning: Option<String>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
}

/// Reads a 2xx body. Pure, so every malformed shape an upstream can send is a table test.
pub(crate) fn read_reply(content_type: Option<&str>, body: &[u8]) -> Result<Reply, AttemptError> {
    if content_type.is_some_and(|c| c.starts_with("text/event-stream")) {
        return Err(AttemptError::BadResponse(
            "a chat completion: an event stream (text/event-stream) came where JSON was \
             expected; remove `stream` from extra_body"
                .into(),
        ));
    }
    let wire: WireCompletion = serde_json::from_slice(body).map_err(|e| {
        AttemptError::BadResponse(format!(
            "a chat completion: {e}; body starts {:?}",
            snippet(body)
        ))
    })?;
    if wire.choices.is_empty() {
        return Err(AttemptError::BadResponse(
            "a chat completion: it holds no choices".into(),
        ));
    }
    let mut choices: Vec<(u32, Choice)> = wire
        .choices
        .into_iter()
        .enumerate()
        .map(|(i, c)| {
            let choice = Choice {
                content: c.message.content.unwrap_or_default(),
                reasoning: c.message.reasoning_content.or(c.message.reasoning),
                finish_reason: c.finish_reason,
            };
            (c.index.unwrap_or(i as u32), choice)
        })
        .collect();
    // Votes are counted in request order, so ties break the same way on every run.
    choices.sort_by_key(|(i, _)| *i);
    let usage = wire.usage.unwrap_or(WireUsage {
        prompt_tokens: 0,
        completion_tokens: 0,
    });
    Ok(Reply {
        choices: choices.into_iter().map(|(_, c)| c).collect(),
        prompt_tokens: usage.prompt_tokens,
        completion_tokens: usage.completion_tokens,
    })
}

#[cfg(test)]
#[path = "client_tests.rs"]
mod tests;
