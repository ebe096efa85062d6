//! One chat-completions exchange with an OpenAI-compatible server (vLLM, SGLang, llama.cpp,
//! OpenAI, Gemini's and DeepSeek's endpoints): the request body, the HTTP call, and the reply
//! read into choices and token counts, or an `AttemptError` classified for retries and metrics.

use crate::config::Secret;
use serde::Deserialize;
use serde_json::{Map, Value, json};
use std::time::{Duration, SystemTime};
use tokio::time::{Instant, timeout_at};

/// A reason quoted from an upstream body is cut to this many characters: enough to read
/// "Invalid API Key", short enough for a status message and a log line.
const REASON_CHARS: usize = 200;

/// The sampling parameters of one judge, fixed at load.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatParams {
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
pub struct Turn {
    pub role: &'static str,
    pub content: String,
}

/// A reply read from the upstream: choices in `index` order, and what it says it spent.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Reply {
    pub choices: Vec<Choice>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl Reply {
    /// The bytes of text it holds, for the cache's budget.
    pub fn text_bytes(&self) -> usize {
        self.choices
            .iter()
            .map(|c| c.content.len() + c.reasoning.as_ref().map_or(0, String::len))
            .sum()
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct Choice {
    pub content: String,
    /// `reasoning_content` (DeepSeek, vLLM, llama.cpp) or `reasoning` (OpenRouter, newer vLLM).
    pub reasoning: Option<String>,
    pub finish_reason: Option<String>,
}

/// Why one HTTP exchange gave no reply.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AttemptError {
    #[error("cannot reach the upstream: {0}")]
    Connect(String),
    #[error("the upstream did not answer in time")]
    Timeout,
    /// Headers and the start of a body, then silence until the deadline: a hung upstream, not a
    /// slow one, which the operator looks for in different places.
    #[error("the upstream stalled mid-reply: its headers and {0} bytes of body came, then nothing")]
    Stalled(usize),
    /// The connection broke (reset, or closed short of the body's length) after the headers.
    #[error("the upstream's reply was cut off: {0}")]
    CutOff(String),
    #[error("the upstream answered HTTP {code}: {reason}")]
    Status {
        code: u16,
        retry_after: Option<Duration>,
        reason: String,
    },
    #[error("the upstream's reply is not a chat completion: {0}")]
    BadResponse(String),
}

impl AttemptError {
    /// Only failures that a later attempt may not meet: the connection, rate limits, 5xx.
    pub fn retryable(&self) -> bool {
        match self {
            AttemptError::Connect(_) | AttemptError::CutOff(_) => true,
            AttemptError::Status { code, .. } => *code == 429 || *code >= 500,
            AttemptError::Timeout | AttemptError::Stalled(_) | AttemptError::BadResponse(_) => {
                false
            }
        }
    }

    /// Failures that say the upstream is unwell, which the circuit breaker counts. A 4xx other
    /// than 429 means our request or key is wrong, and a garbled body came from a live server.
    pub fn upstream_unwell(&self) -> bool {
        match self {
            AttemptError::Connect(_)
            | AttemptError::Timeout
            | AttemptError::Stalled(_)
            | AttemptError::CutOff(_) => true,
            AttemptError::Status { code, .. } => *code == 429 || *code >= 500,
            AttemptError::BadResponse(_) => false,
        }
    }

    /// The `outcome` label of `retrace_judge_requests_total`.
    pub fn outcome(&self) -> &'static str {
        match self {
            AttemptError::Connect(_) | AttemptError::CutOff(_) => "connect_error",
            AttemptError::Timeout | AttemptError::Stalled(_) => "timeout",
            AttemptError::Status { code, .. } if *code >= 500 => "http_5xx",
            AttemptError::Status { .. } => "http_4xx",
            AttemptError::BadResponse(_) => "bad_response",
        }
    }

    /// The Retry-After the upstream asked for, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            AttemptError::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }
}

/// The JSON body of a chat-completions request. `n` is sent only above 1, since some
/// OpenAI-compatible servers refuse the field outright.
pub fn request_body(params: &ChatParams, turns: &[Turn], n: u32) -> Value {
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
pub fn read_reply(content_type: Option<&str>, body: &[u8]) -> Result<Reply, AttemptError> {
    if content_type.is_some_and(|c| c.starts_with("text/event-stream")) {
        return Err(AttemptError::BadResponse(
            "an event stream (text/event-stream) came where JSON was expected; \
             remove `stream` from extra_body"
                .into(),
        ));
    }
    let wire: WireCompletion = serde_json::from_slice(body)
        .map_err(|e| AttemptError::BadResponse(format!("{e}; body starts {:?}", snippet(body))))?;
    if wire.choices.is_empty() {
        return Err(AttemptError::BadResponse("it holds no choices".into()));
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

/// The short reason in an error body: OpenAI's `{"error": {"message"}}`, a bare `{"message"}`
/// or `{"error": "..."}`, else the start of the text.
pub fn error_reason(body: &[u8]) -> String {
    let from_json = serde_json::from_slice::<Value>(body).ok().and_then(|v| {
        let message = v
            .pointer("/error/message")
            .or_else(|| v.get("message"))
            .or_else(|| v.get("error"))
            .or_else(|| v.get("detail"))?;
        message.as_str().map(str::to_string)
    });
    let reason = from_json.unwrap_or_else(|| snippet(body));
    if reason.trim().is_empty() {
        "(empty body)".into()
    } else {
        cut(reason.trim(), REASON_CHARS)
    }
}

fn snippet(body: &[u8]) -> String {
    cut(&String::from_utf8_lossy(body), REASON_CHARS)
}

fn cut(s: &str, chars: usize) -> String {
    match s.char_indices().nth(chars) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s.to_string(),
    }
}

/// The HTTP side: one client (connection pool) per judge, the endpoint, and the key.
pub struct Upstream {
    http: reqwest::Client,
    url: String,
    api_key: Option<Secret>,
}

impl Upstream {
    /// `base_url` is the API root, e.g. `http://127.0.0.1:8080/v1`.
    pub fn new(base_url: &str, api_key: Option<Secret>) -> Result<Upstream, String> {
        let http = http_client()?;
        Ok(Upstream {
            http,
            url: format!("{}/chat/completions", base_url.trim_end_matches('/')),
            api_key,
        })
    }

    /// One exchange, given up at `stop`. Dropping the future drops the connection, which is how
    /// a caller that left cancels the upstream's work.
    pub async fn send(&self, body: &Value, stop: Instant) -> Result<Reply, AttemptError> {
        let mut request = self.http.post(&self.url).json(body);
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(&key.0);
        }
        let response = timeout_at(stop, request.send())
            .await
            .map_err(|_| AttemptError::Timeout)?
            .map_err(|e| {
                if e.is_timeout() {
                    AttemptError::Timeout
                } else {
                    AttemptError::Connect(error_chain(&e))
                }
            })?;
        let status = response.status();
        let header = |name| {
            response
                .headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let content_type = header(reqwest::header::CONTENT_TYPE);
        let retry_after = header(reqwest::header::RETRY_AFTER)
            .and_then(|v| super::policy::parse_retry_after(&v, SystemTime::now()));
        let body = read_capped(response, stop).await?;
        if !status.is_success() {
            return Err(AttemptError::Status {
                code: status.as_u16(),
                retry_after,
                reason: error_reason(&body),
            });
        }
        read_reply(content_type.as_deref(), &body)
    }
}

/// Most bytes of one upstream reply: a chat completion is kilobytes; a larger body is a broken
/// or hostile upstream, and reading it whole would hold it in memory (and in the cache).
pub const MAX_REPLY_BYTES: usize = 4 << 20;

/// The body, read chunk by chunk and refused as soon as it passes `MAX_REPLY_BYTES`, so a huge
/// reply costs at most the cap in memory, whatever it says (or doesn't say) about its length.
async fn read_capped(
    mut response: reqwest::Response,
    stop: Instant,
) -> Result<Vec<u8>, AttemptError> {
    if response
        .content_length()
        .is_some_and(|n| n > MAX_REPLY_BYTES as u64)
    {
        return Err(too_large());
    }
    let mut body = Vec::new();
    while let Some(chunk) = timeout_at(stop, response.chunk())
        .await
        .map_err(|_| AttemptError::Stalled(body.len()))?
        .map_err(|e| AttemptError::CutOff(error_chain(&e)))?
    {
        if body.len() + chunk.len() > MAX_REPLY_BYTES {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

fn too_large() -> AttemptError {
    AttemptError::BadResponse(format!("the body is over {} MiB", MAX_REPLY_BYTES >> 20))
}

/// The process's HTTP client settings (judges, and the bench's llama-server client).
pub fn http_client() -> Result<reqwest::Client, String> {
    // reqwest is built without a bundled crypto provider; use ring, as tonic's TLS does, so one
    // provider serves the whole process. Installing twice is harmless.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .pool_idle_timeout(Duration::from_secs(60))
        .user_agent(concat!("retrace/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| format!("cannot build the HTTP client: {e}"))
}

/// reqwest's Display stops at "error sending request"; the cause (refused, reset) is below.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[cfg(test)]
#[path = "client_tests.rs"]
mod tests;
