//! The HTTP/JSON edge beside gRPC, into the same engine: the trainers' reward routes (OpenRLHF's
//! `POST /get_reward`, slime's `POST /slime/reward`), the gRPC messages in proto3's JSON mapping at `POST /v1/evaluate` and `POST /v1/rank`,
//! `GET /v1/evaluators` and `GET /health`. Same admission, deadlines, bearer tokens, metrics
//! (the route is the rpc label) and status table (its HTTP column).

mod chat;
mod reward;

use super::status::{self, capped};
use super::{AdminAuth, BearerAuth, Recorder, label, pb};
use crate::config::RewardConfig;
use crate::engine::{Engine, EngineError};
use crate::field::FieldPath;
use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::time::Instant;
use tonic::Code;

/// Largest request body: room for a Rank of hundreds of candidates in JSON, which spells out what
/// protobuf packs (the gRPC limit is 4 MiB of protobuf).
pub(crate) const MAX_BODY_BYTES: usize = 16 << 20;
/// The request header that sets a deadline, in seconds (HTTP has no `grpc-timeout`).
pub(crate) const TIMEOUT_HEADER: &str = "x-request-timeout";

/// What every handler shares.
pub(crate) struct Http {
    engine: Arc<Engine>,
    auth: BearerAuth,
    admin: AdminAuth,
    reward: RewardConfig,
    /// `[reward] policy_tokenizer`, loaded: what token ids in a reward body are decoded with.
    policy: Option<Arc<reward::PolicyTokenizer>>,
}

/// The routes, ready to serve; fails when `[reward] policy_tokenizer` can't be loaded (the
/// message names the key).
pub(crate) fn router(
    engine: Arc<Engine>,
    (auth, admin): (BearerAuth, AdminAuth),
    reward: RewardConfig,
) -> Result<Router, String> {
    let policy = match &reward.policy_tokenizer {
        Some(path) => Some(Arc::new(
            reward::PolicyTokenizer::load(path)
                .map_err(|e| format!("reward.policy_tokenizer: {e}"))?,
        )),
        None => None,
    };
    for e in engine.list() {
        crate::metrics::reward_samples_at_zero(&e.name);
    }
    let state = Arc::new(Http {
        engine,
        auth,
        admin,
        reward,
        policy,
    });
    Ok(Router::new()
        .route("/get_reward", post(reward::handle::<reward::Openrlhf>))
        .route("/slime/reward", post(reward::handle::<reward::Slime>))
        .route("/v1/evaluate", post(evaluate))
        .route("/v1/rank", post(rank))
        .route("/v1/evaluators", get(evaluators))
        .route("/v1/reload", post(reload))
        .route("/health", get(health))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state))
}

/// Serves `router` on `listener` until `stop`, then lets requests in flight finish.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    stop: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router)
        .with_graceful_shutdown(stop)
        .await
}

/// A request's failure as the status table has it: the gRPC code, its HTTP status, the message,
/// and the field at fault when the input was.
#[derive(Debug)]
pub(crate) struct Failure {
    code: Code,
    message: String,
    field: Option<String>,
    /// When to come back (overload and restarts), for `Retry-After`.
    retry_after: Duration,
}

impl From<EngineError> for Failure {
    fn from(e: EngineError) -> Self {
        let status = status::to_status(&e);
        let retry_after = status::retry_after(&e);
        let field = match e {
            EngineError::Invalid { field, .. } | EngineError::TooLarge { field, .. } => {
                Some(field.to_string())
            }
            _ => None,
        };
        Failure {
            code: status.code(),
            message: status.message().to_string(),
            field,
            retry_after,
        }
    }
}

impl Failure {
    fn invalid(field: impl Into<FieldPath>, message: impl Into<String>) -> Self {
        EngineError::invalid(field, message).into()
    }

    /// Refused before any work: auth, which names no field and has nothing to wait for.
    fn refused(code: Code, message: &str) -> Self {
        Failure {
            code,
            message: message.to_string(),
            field: None,
            retry_after: Duration::ZERO,
        }
    }
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    /// The HTTP status, repeated for clients that only keep the body.
    code: u16,
    /// The gRPC code's name, as the status table has it.
    status: &'static str,
    message: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    field: Option<&'a str>,
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let http = status::http_status(self.code);
        let body = ErrorBody {
            error: ErrorDetail {
                code: http,
                status: status::code_name(self.code),
                message: &self.message,
                field: self.field.as_deref(),
            },
        };
        let mut response = json(
            StatusCode::from_u16(http).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            &body,
        );
        // Overload and restarts pass: say when to try again instead of letting clients spin.
        // Retry-After counts whole seconds; rounding up never asks for a retry too soon.
        if matches!(self.code, Code::ResourceExhausted | Code::Unavailable) {
            let seconds = self.retry_after.as_secs_f64().ceil().max(1.0) as u64;
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        if self.code == Code::Unauthenticated {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}

/// `value` as a JSON response.
fn json(status: StatusCode, value: &impl Serialize) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => (status, [(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("rendering the response: {e}"),
        )
            .into_response(),
    }
}

impl Http {
    /// Checks the bearer token, then reads the deadline; the clock starts at `arrived`.
    fn admit(&self, headers: &HeaderMap, arrived: Instant) -> Result<Option<Instant>, Failure> {
        self.auth
            .check(authorization(headers))
            .map_err(|message| Failure::refused(Code::Unauthenticated, message))?;
        deadline(headers, arrived)
    }
}

/// A request's `authorization` header, if it is text.
fn authorization(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
}

/// The deadline a request's `x-request-timeout` header sets (seconds, fractions allowed).
fn deadline(headers: &HeaderMap, arrived: Instant) -> Result<Option<Instant>, Failure> {
    let Some(value) = headers.get(TIMEOUT_HEADER) else {
        return Ok(None);
    };
    let seconds = value
        .to_str()
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s > 0.0 && *s <= 86_400.0);
    match seconds {
        Some(s) => Ok(Some(arrived + Duration::from_secs_f64(s))),
        None => Err(Failure::invalid(
            TIMEOUT_HEADER,
            "must be a number of seconds in (0, 86400]",
        )),
    }
}

/// Parses a JSON body into `T`; a malformed body names where it broke.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Failure> {
    serde_json::from_slice(body).map_err(|e| Failure::invalid("body", capped(e.to_string())))
}

/// Runs one call to its response, counted under `rpc`.
async fn answer<T: Serialize>(
    rpc: &'static str,
    recorder_evaluator: String,
    arrived: Instant,
    work: impl Future<Output = Result<T, EngineError>>,
) -> Response {
    let work = async { work.await.map(|value| (value, Code::Ok)) };
    answer_as(rpc, recorder_evaluator, arrived, work).await
}

/// `answer`, for a call that says which outcome its success counts as.
async fn answer_as<T: Serialize>(
    rpc: &'static str,
    recorder_evaluator: String,
    arrived: Instant,
    work: impl Future<Output = Result<(T, Code), EngineError>>,
) -> Response {
    // No timer but the engine's keeps an HTTP deadline, so a drop is the caller leaving.
    let recorder = Recorder::new(rpc, recorder_evaluator, arrived, None);
    match work.await {
        Ok((value, code)) => {
            recorder.finish_as(code);
            json(StatusCode::OK, &value)
        }
        Err(e) => {
            recorder.finish_as(status::to_status(&e).code());
            Failure::from(e).into_response()
        }
    }
}

/// A failure before the call reached the engine, counted like one.
fn refuse(rpc: &'static str, arrived: Instant, failure: Failure) -> Response {
    if failure.code == Code::Unauthenticated {
        crate::metrics::record_unauthenticated();
    }
    crate::metrics::record_request(
        rpc,
        "unknown",
        status::outcome(failure.code),
        arrived.elapsed(),
    );
    failure.into_response()
}

/// A gRPC method over JSON: admits, parses `Req`, runs it, answers `Resp`, counted under `rpc`.
async fn json_call<Req, Resp, Fut>(
    rpc: &'static str,
    http: &Http,
    headers: &HeaderMap,
    body: &[u8],
    evaluator: impl Fn(&Req) -> &str,
    run: impl FnOnce(Req, Option<Instant>, Instant) -> Fut,
) -> Response
where
    Req: serde::de::DeserializeOwned,
    Resp: Serialize,
    Fut: Future<Output = Result<Resp, EngineError>>,
{
    let arrived = Instant::now();
    let prepared = http
        .admit(headers, arrived)
        .and_then(|deadline| parse::<Req>(body).map(|request| (deadline, request)));
    let (deadline, request) = match prepared {
        Ok(p) => p,
        Err(f) => return refuse(rpc, arrived, f),
    };
    let label = label(&http.engine, evaluator(&request));
    answer(rpc, label, arrived, run(request, deadline, arrived)).await
}

async fn evaluate(State(http): State<Arc<Http>>, headers: HeaderMap, body: Bytes) -> Response {
    let engine = &http.engine;
    json_call(
        "/v1/evaluate",
        &http,
        &headers,
        &body,
        |r: &pb::EvaluateRequest| &r.evaluator,
        |r, deadline, arrived| super::evaluate_one(engine, r, deadline, arrived),
    )
    .await
}

async fn rank(State(http): State<Arc<Http>>, headers: HeaderMap, body: Bytes) -> Response {
    let engine = &http.engine;
    json_call(
        "/v1/rank",
        &http,
        &headers,
        &body,
        |r: &pb::RankRequest| &r.evaluator,
        |r, deadline, arrived| super::rank(engine, r, deadline, arrived),
    )
    .await
}

/// The Reload call over JSON: `{"evaluator": "..."}`.
async fn reload(State(http): State<Arc<Http>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err((code, why)) = http.admin.check(authorization(&headers)) {
        return Failure::refused(code, why).into_response();
    }
    let engine = &http.engine;
    json_call(
        "/v1/reload",
        &http,
        &headers,
        &body,
        |r: &pb::ReloadRequest| &r.evaluator,
        |r, _, _| async move { engine.reload(&r.evaluator).await.map(super::reloaded) },
    )
    .await
}

async fn evaluators(State(http): State<Arc<Http>>, headers: HeaderMap) -> Response {
    if let Err(f) = http.admit(&headers, Instant::now()) {
        return f.into_response();
    }
    json(StatusCode::OK, &super::evaluator_infos(&http.engine))
}

/// 200 while every evaluator is ready, else 503: a load balancer's probe (no token needed).
async fn health(State(http): State<Arc<Http>>) -> Response {
    let ready = http.engine.list().iter().all(|s| s.ready);
    let (code, status) = match ready {
        true => (StatusCode::OK, "SERVING"),
        false => (StatusCode::SERVICE_UNAVAILABLE, "NOT_SERVING"),
    };
    json(code, &serde_json::json!({ "status": status }))
}

async fn not_found(uri: axum::http::Uri) -> Response {
    let body = serde_json::json!({ "error": {
        "code": 404,
        "status": "NOT_FOUND",
        "message": format!(
            "no route {}; this server answers POST /get_reward, POST /slime/reward, \
             POST /v1/evaluate, POST /v1/rank, GET /v1/evaluators and GET /health",
            capped(uri.path().chars().take(128).collect())
        ),
    }});
    json(StatusCode::NOT_FOUND, &body)
}

/// The query parameters a route accepts; any other is refused by name.
fn params<'a>(
    query: &'a HashMap<String, String>,
    known: &[&str],
) -> Result<impl Fn(&str) -> Option<&'a str>, Failure> {
    if let Some(unknown) = query.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(Failure::invalid(
            FieldPath::key(format!("?{}", unknown.chars().take(64).collect::<String>())),
            format!(
                "is not a parameter of this route; it takes {}",
                known.join(", ")
            ),
        ));
    }
    Ok(move |k: &str| query.get(k).map(String::as_str))
}

pub(crate) type QueryParams = Query<HashMap<String, String>>;
