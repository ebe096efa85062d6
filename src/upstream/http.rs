//! One JSON exchange with an HTTP upstream: the POST, the body read under a size cap and the
//! caller's stop time, and every failure classified (`AttemptError`) for retries and metrics.

use crate::env::Secret;
use serde_json::Value;
use std::time::{Duration, SystemTime};
use tokio::time::{Instant, timeout_at};

/// A reason quoted from an upstream body is cut to this many characters: enough to read
/// "Invalid API Key", short enough for a status message and a log line.
const REASON_CHARS: usize = 200;

/// Most bytes of one upstream reply: a chat completion or a PRM's step scores is kilobytes; a
/// larger body is a broken or hostile upstream, and reading it whole would hold it in memory.
pub(crate) const MAX_REPLY_BYTES: usize = 4 << 20;

/// Why one HTTP exchange gave no reply.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub(crate) enum AttemptError {
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
    /// A 2xx body that is not what was asked for; the text says what was expected ("a chat
    /// completion: it holds no choices").
    #[error("the upstream's reply is not {0}")]
    BadResponse(String),
}

impl AttemptError {
    /// Only failures that a later attempt may not meet: the connection, rate limits, 5xx.
    pub(crate) fn retryable(&self) -> bool {
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
    pub(crate) fn upstream_unwell(&self) -> bool {
        match self {
            AttemptError::Connect(_)
            | AttemptError::Timeout
            | AttemptError::Stalled(_)
            | AttemptError::CutOff(_) => true,
            AttemptError::Status { code, .. } => *code == 429 || *code >= 500,
            AttemptError::BadResponse(_) => false,
        }
    }

    /// The `outcome` label of the upstream request counters.
    pub(crate) fn outcome(&self) -> &'static str {
        match self {
            AttemptError::Connect(_) | AttemptError::CutOff(_) => "connect_error",
            AttemptError::Timeout | AttemptError::Stalled(_) => "timeout",
            AttemptError::Status { code, .. } if *code >= 500 => "http_5xx",
            AttemptError::Status { .. } => "http_4xx",
            AttemptError::BadResponse(_) => "bad_response",
        }
    }

    /// The Retry-After the upstream asked for, if any.
    pub(crate) fn retry_after(&self) -> Option<Duration> {
        match self {
            AttemptError::Status { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// Timeouts of every kind: the caller maps them to DEADLINE_EXCEEDED, the rest to UNAVAILABLE.
    pub(crate) fn is_timeout(&self) -> bool {
        matches!(self, AttemptError::Timeout | AttemptError::Stalled(_))
    }
}

/// A 2xx reply: its content type and body, for the caller to read.
pub(crate) struct Raw {
    pub content_type: Option<String>,
    pub body: Vec<u8>,
}

/// The short reason in an error body: OpenAI's `{"error": {"message"}}`, vLLM's older
/// `{"object": "error", "message"}`, a bare `{"message"}`, `{"error": "..."}` or FastAPI's
/// `{"detail"}`, else the start of the text.
pub(crate) fn error_reason(body: &[u8]) -> String {
    let from_json = serde_json::from_slice::<Value>(body).ok().and_then(|v| {
        let message = v
            .pointer("/error/message")
            .or_else(|| v.get("message"))
            .or_else(|| v.get("error"))
            .or_else(|| v.get("detail"))?;
        match message {
            Value::String(s) => Some(s.clone()),
            // FastAPI's validation errors: a list of {loc, msg}.
            Value::Array(items) => Some(
                items
                    .iter()
                    .filter_map(|i| i.get("msg").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join("; "),
            ),
            _ => None,
        }
    });
    let reason = from_json.unwrap_or_else(|| snippet(body));
    if reason.trim().is_empty() {
        "(empty body)".into()
    } else {
        cut(reason.trim(), REASON_CHARS)
    }
}

/// The start of a body, for messages.
pub(crate) fn snippet(body: &[u8]) -> String {
    cut(&String::from_utf8_lossy(body), REASON_CHARS)
}

fn cut(s: &str, chars: usize) -> String {
    match s.char_indices().nth(chars) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s.to_string(),
    }
}

/// One URL of an upstream, with its connection pool and key.
pub(crate) struct Endpoint {
    http: reqwest::Client,
    url: String,
    api_key: Option<Secret>,
}

/// Why an upstream could not be set up (before any call).
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error("api_key_env names {0}, which is not set")]
    MissingKey(String),
    #[error("cannot build the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
}

impl Endpoint {
    pub(crate) fn new(url: String, api_key: Option<Secret>) -> Result<Endpoint, SetupError> {
        Ok(Endpoint {
            http: http_client()?,
            url,
            api_key,
        })
    }

    pub(crate) fn url(&self) -> &str {
        &self.url
    }

    /// One exchange, given up at `stop`. Dropping the future drops the connection, which is how
    /// a caller that left cancels the upstream's work.
    pub(crate) async fn post(&self, body: &Value, stop: Instant) -> Result<Raw, AttemptError> {
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
        Ok(Raw { content_type, body })
    }
}

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
    AttemptError::BadResponse(format!(
        "readable: the body is over {} MiB",
        MAX_REPLY_BYTES >> 20
    ))
}

/// The process's HTTP client settings (judges, remote PRMs, and the bench's llama-server client).
pub fn http_client() -> Result<reqwest::Client, SetupError> {
    // reqwest is built without a bundled crypto provider; use ring, as tonic's TLS does, so one
    // provider serves the whole process. Installing twice is harmless.
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .pool_idle_timeout(Duration::from_secs(60))
        .user_agent(concat!("retrace/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(SetupError::Client)
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
#[path = "http_tests.rs"]
mod tests;
