//! A fake vLLM server for remote-PRM tests: `POST /pooling` (token_classify, STEP or ALL pooling)
//! and `POST /v1/completions` with `prompt_logprobs`, in vLLM's documented request and response
//! shapes and its error body. It answers with a real model's scores (the committed tiny
//! checkpoint, run in-process), so the test compares retrace's remote path with its own
//! in-process one; scripted faults replace the next replies.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use retrace::{Family, Formatter};
use retrace_model::{Batch, HeadSpec, PrmModel};
use serde_json::{Map, Value, json};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The in-process model scoring given ids at given positions: what the fake answers with.
struct ReferenceScorer {
    model: PrmModel,
    head: HeadSpec,
}

impl ReferenceScorer {
    fn load(family: Family, folder: &Path) -> Result<ReferenceScorer, String> {
        let head = Formatter::load(family, folder)
            .map_err(|e| e.to_string())?
            .head_spec();
        let model = PrmModel::load(
            folder,
            head.clone(),
            &candle_core::Device::Cpu,
            candle_core::DType::F32,
        )
        .map_err(|e| e.to_string())?;
        Ok(ReferenceScorer { model, head })
    }

    /// The (plus, minus) token ids a causal-LM family reads.
    fn pair(&self) -> Option<(u32, u32)> {
        match self.head {
            HeadSpec::LmPair { plus, minus } => Some((plus, minus)),
            _ => None,
        }
    }

    fn score(&self, ids: &[u32], positions: &[usize]) -> Result<Vec<f32>, String> {
        let mut rows = self
            .model
            .score(Batch::new(&[ids], &[positions]))
            .map_err(|e| e.to_string())?;
        Ok(rows.pop().map(|r| r.scores).unwrap_or_default())
    }
}

/// How the fake's `/pooling` pools a token-classification model.
#[derive(Debug, Clone, Copy)]
pub enum Pooling {
    /// A row at each token equal to `tag` (vLLM's default for Qwen2.5-Math-PRM).
    Step { tag: u32 },
    /// A row per token.
    All,
}

/// What the fake does with one request instead of scoring it.
#[derive(Debug, Clone)]
pub enum Fault {
    /// vLLM's error body with this status, and a Retry-After header when given.
    Status(u16, Option<&'static str>, &'static str),
    /// A pooling reply with one row too few.
    MissingRow,
    /// A pooling reply of raw logits (as with `use_activation = false`).
    Logits,
}

struct Shared {
    scorer: Mutex<ReferenceScorer>,
    pooling: Pooling,
    /// The causal LM's two read tokens, listed in every prompt_logprobs entry.
    pair: Option<(u32, u32)>,
    script: Mutex<VecDeque<Fault>>,
    bodies: Mutex<Vec<Value>>,
    hits: AtomicUsize,
}

pub struct FakeVllm {
    pub addr: SocketAddr,
    state: Arc<Shared>,
}

impl FakeVllm {
    /// Serves `folder`'s checkpoint on 127.0.0.1.
    pub async fn start(family: Family, folder: &Path, pooling: Pooling) -> FakeVllm {
        let scorer = ReferenceScorer::load(family, folder).expect("the tiny checkpoint loads");
        let pair = scorer.pair();
        let state = Arc::new(Shared {
            scorer: Mutex::new(scorer),
            pooling,
            pair,
            script: Mutex::new(VecDeque::new()),
            bodies: Mutex::new(Vec::new()),
            hits: AtomicUsize::new(0),
        });
        let app = axum::Router::new()
            .route("/pooling", axum::routing::post(pooling_route))
            .route("/v1/completions", axum::routing::post(completions_route))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        FakeVllm { addr, state }
    }

    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn script(&self, faults: impl IntoIterator<Item = Fault>) {
        self.state.script.lock().unwrap().extend(faults);
    }

    pub fn bodies(&self) -> Vec<Value> {
        self.state.bodies.lock().unwrap().clone()
    }

    pub fn hits(&self) -> usize {
        self.state.hits.load(Ordering::SeqCst)
    }
}

/// vLLM's error response (`ErrorResponse`), as its OpenAI-compatible server sends it.
fn error(code: u16, retry_after: Option<&str>, message: &str) -> Response {
    let kind = if code < 500 {
        "BadRequestError"
    } else {
        "InternalServerError"
    };
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": code}});
    let mut response = (StatusCode::from_u16(code).unwrap(), json_body(body)).into_response();
    if let Some(after) = retry_after {
        response
            .headers_mut()
            .insert("retry-after", after.parse().unwrap());
    }
    response
}

fn json_body(v: Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

fn ids(body: &Value, key: &str) -> Option<Vec<u32>> {
    body.get(key)?
        .as_array()?
        .iter()
        .map(|v| v.as_u64().map(|n| n as u32))
        .collect()
}

/// Reads the request, records it, and returns the next scripted fault if any.
fn take(s: &Shared, body: &Bytes) -> Result<(Value, Option<Fault>), String> {
    s.hits.fetch_add(1, Ordering::SeqCst);
    let body: Value =
        serde_json::from_slice(body).map_err(|e| format!("JSON decode error: {e}"))?;
    s.bodies.lock().unwrap().push(body.clone());
    let fault = s.script.lock().unwrap().pop_front();
    Ok((body, fault))
}

async fn pooling_route(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    let (body, fault) = match take(&s, &body) {
        Ok(t) => t,
        Err(message) => return error(400, None, &message),
    };
    if let Some(Fault::Status(code, after, message)) = &fault {
        return error(*code, *after, message);
    }
    if body.get("task").and_then(Value::as_str) != Some("token_classify") {
        return error(
            400,
            None,
            "Unsupported task: 'None' Supported tasks: ['token_classify']",
        );
    }
    let Some(input) = ids(&body, "input") else {
        return error(400, None, "input must be a list of token ids here");
    };
    let positions: Vec<usize> = match s.pooling {
        Pooling::Step { tag } => (0..input.len()).filter(|&i| input[i] == tag).collect(),
        Pooling::All => (0..input.len()).collect(),
    };
    let scores = match s.scorer.lock().unwrap().score(&input, &positions) {
        Ok(scores) => scores,
        Err(e) => return error(500, None, &e),
    };
    let mut rows: Vec<Value> = scores
        .iter()
        .map(|&p| match fault {
            Some(Fault::Logits) => json!([-(p as f64) * 3.0, p as f64 * 3.0]),
            _ => json!([1.0 - p as f64, p as f64]),
        })
        .collect();
    if matches!(fault, Some(Fault::MissingRow)) {
        rows.pop();
    }
    json_body(json!({
        "id": "pool-fake", "object": "list", "created": 0, "model": "prm",
        "data": [{"index": 0, "object": "pooling", "data": rows}],
        "usage": {"prompt_tokens": input.len(), "total_tokens": input.len(), "completion_tokens": 0}
    }))
}

async fn completions_route(State(s): State<Arc<Shared>>, body: Bytes) -> Response {
    let (body, fault) = match take(&s, &body) {
        Ok(t) => t,
        Err(message) => return error(400, None, &message),
    };
    if let Some(Fault::Status(code, after, message)) = &fault {
        return error(*code, *after, message);
    }
    let Some(prompt) = ids(&body, "prompt") else {
        return error(400, None, "prompt must be a list of token ids here");
    };
    let Some(k) = body.get("prompt_logprobs").and_then(Value::as_u64) else {
        return error(
            400,
            None,
            "this test server answers only prompt_logprobs requests",
        );
    };
    let (plus, minus) = s.pair.expect("a causal-LM fake knows its pair");
    // Entry i + 1 is the distribution after tokens 0..=i: the LM pair read at position i, with
    // the rest of the mass left out (as vLLM's top-k would) and the actual next token listed.
    let positions: Vec<usize> = (0..prompt.len() - 1).collect();
    let scores = match s.scorer.lock().unwrap().score(&prompt, &positions) {
        Ok(scores) => scores,
        Err(e) => return error(500, None, &e),
    };
    let mut entries = vec![Value::Null];
    for (i, &p) in scores.iter().enumerate() {
        let mut top = Map::new();
        // vLLM clamps -inf to -9999 before it writes JSON.
        let (lp_plus, lp_minus) = (
            (p as f64).ln().max(-9999.0),
            (1.0 - p as f64).ln().max(-9999.0),
        );
        top.insert(
            plus.to_string(),
            json!({"logprob": lp_plus, "rank": 1, "decoded_token": "+"}),
        );
        top.insert(
            minus.to_string(),
            json!({"logprob": lp_minus, "rank": 2, "decoded_token": "-"}),
        );
        let next = prompt[i + 1];
        if k >= 3 && next != plus && next != minus {
            top.insert(
                next.to_string(),
                json!({"logprob": -30.0, "rank": 3, "decoded_token": "?"}),
            );
        }
        entries.push(Value::Object(top));
    }
    json_body(json!({
        "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": "prm",
        "choices": [{"index": 0, "text": "+", "logprobs": null, "finish_reason": "length",
                     "stop_reason": null, "prompt_logprobs": entries}],
        "usage": {"prompt_tokens": prompt.len(), "total_tokens": prompt.len() + 1, "completion_tokens": 1}
    }))
}
