//! A scripted OpenAI-compatible upstream for judge tests: each request takes the next fault from
//! a script (or the default), and the server counts requests and those still open.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::{Value, json};
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the upstream does with one request.
#[derive(Debug, Clone)]
pub enum Fault {
    /// 200 with `n` copies of one content, as a server that honours `n` would answer.
    PerN(String),
    /// 200 with exactly these choices, whatever `n` asked for.
    Reply(Vec<String>),
    /// 200 after a delay.
    Slow(Duration, String),
    /// An error status, optionally with Retry-After, and an OpenAI-style error body.
    Status(u16, Option<String>, String),
    /// 200 whose JSON stops half-way.
    TruncatedJson,
    /// 200 as a server-sent event stream.
    EventStream,
    /// 200 with an HTML page.
    Garbage,
    /// 200 whose content depends on the request: a judge that reads the trace (an oracle).
    By(fn(&Value) -> String),
}

pub struct Upstream {
    pub addr: SocketAddr,
    state: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    script: Mutex<VecDeque<Fault>>,
    default: Mutex<Option<Fault>>,
    hits: AtomicUsize,
    open: super::Count,
    bodies: Mutex<Vec<Value>>,
    auth: Mutex<Vec<Option<String>>>,
}

/// Counts a request as open until its handler finishes or is dropped (the client left).
struct Open(Arc<Shared>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.open.add(-1);
    }
}

pub fn reply(content: &str) -> Fault {
    Fault::PerN(content.to_string())
}

impl Upstream {
    /// Serves on 127.0.0.1; `default` answers once the script is used up.
    pub async fn start(default: Fault) -> Upstream {
        let state = Arc::new(Shared::default());
        *state.default.lock().unwrap() = Some(default);
        let app = axum::Router::new()
            .route("/v1/chat/completions", axum::routing::post(handle))
            .with_state(state.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Upstream { addr, state }
    }

    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    pub fn script(&self, faults: impl IntoIterator<Item = Fault>) {
        self.state.script.lock().unwrap().extend(faults);
    }

    pub fn set_default(&self, fault: Fault) {
        *self.state.default.lock().unwrap() = Some(fault);
    }

    pub fn hits(&self) -> usize {
        self.state.hits.load(Ordering::SeqCst)
    }

    pub fn open(&self) -> isize {
        self.state.open.get() as isize
    }

    /// Waits (up to 10 s) until a request is open upstream.
    pub async fn until_open(&self) {
        let within = Duration::from_secs(10);
        self.state
            .open
            .reach(1, within, "requests open upstream")
            .await;
    }

    pub fn bodies(&self) -> Vec<Value> {
        self.state.bodies.lock().unwrap().clone()
    }

    pub fn auth_headers(&self) -> Vec<Option<String>> {
        self.state.auth.lock().unwrap().clone()
    }

    /// Waits up to `within` for every request to have finished or been dropped.
    pub async fn wait_idle(&self, within: Duration) -> bool {
        self.state.open.until(within, |n| *n == 0).await
    }
}

async fn handle(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    s.hits.fetch_add(1, Ordering::SeqCst);
    s.open.add(1);
    let _open = Open(s.clone());
    let body: Value = serde_json::from_slice(&body).expect("the judge sends JSON");
    let n = body.get("n").and_then(Value::as_u64).unwrap_or(1) as usize;
    s.bodies.lock().unwrap().push(body.clone());
    s.auth.lock().unwrap().push(
        headers
            .get("authorization")
            .map(|v| v.to_str().unwrap().to_string()),
    );
    let fault = {
        let next = s.script.lock().unwrap().pop_front();
        next.unwrap_or_else(|| s.default.lock().unwrap().clone().expect("a default fault"))
    };
    match fault {
        Fault::PerN(content) => completion(&vec![content; n]),
        Fault::By(answer) => completion(&vec![answer(&body); n]),
        Fault::Reply(contents) => completion(&contents),
        Fault::Slow(delay, content) => {
            tokio::time::sleep(delay).await;
            completion(&[content])
        }
        Fault::Status(code, retry_after, message) => {
            let mut r = Response::builder()
                .status(StatusCode::from_u16(code).unwrap())
                .header("content-type", "application/json");
            if let Some(after) = retry_after {
                r = r.header("retry-after", after);
            }
            let body = json!({"error": {"message": message, "code": code}}).to_string();
            r.body(body.into()).unwrap()
        }
        Fault::TruncatedJson => raw(
            "application/json",
            r#"{"choices":[{"index":0,"message":{"role":"assistant","content":"\\boxed{"#,
        ),
        Fault::EventStream => raw(
            "text/event-stream",
            "data: {\"choices\":[{\"delta\":{\"content\":\"\\\\boxed{1}\"}}]}\n\ndata: [DONE]\n\n",
        ),
        Fault::Garbage => raw("text/html", "<html><body>502 Bad Gateway</body></html>"),
    }
}

fn completion(contents: &[String]) -> Response {
    let choices: Vec<Value> = contents
        .iter()
        .enumerate()
        .map(|(i, c)| json!({"index": i, "finish_reason": "stop", "message": {"role": "assistant", "content": c}}))
        .collect();
    let body = json!({
        "id": "chatcmpl-test", "object": "chat.completion", "model": "fake",
        "choices": choices,
        "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110},
    });
    raw("application/json", &body.to_string())
}

fn raw(content_type: &str, body: &str) -> Response {
    Response::builder()
        .status(200)
        .header("content-type", content_type)
        .body(body.to_string().into())
        .unwrap()
}
