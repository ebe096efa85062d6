//! The gRPC edge: the Evaluator service, proto types, auth; prost types never leave this module
//! except through `pb` for clients.

mod auth;
mod codec;
mod connection;
pub(crate) mod convert;
mod deadline;
pub(crate) mod http;
mod status;
mod unreadable;

pub(crate) use auth::{AdminAuth, BearerAuth, evaluation_auth};
pub(crate) use connection::incoming;
pub use convert::{TraceParts, category_from_pb};
pub(crate) use deadline::Deadlines;
pub(crate) use status::outcome;
pub use status::to_status;
pub(crate) use unreadable::Readable;

use crate::engine::{Engine, EngineError, Origin, Request as EngineRequest};
use crate::field::FieldPath;
use crate::metrics;
use deadline::Arrival;
use futures::StreamExt;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

/// Generated protobuf types and the service's client and server.
pub mod pb {
    tonic::include_proto!("retrace.v1");
    // proto3's JSON mapping (serde) for the HTTP edge.
    include!(concat!(env!("OUT_DIR"), "/retrace.v1.serde.rs"));
    /// Encoded descriptors of retrace.v1, for reflection.
    pub(crate) const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/retrace_descriptor.bin"));
}

/// Responses buffered per stream before finished tasks wait for the caller to read.
const STREAM_BUFFER: usize = 64;
/// Requests one stream may have open at once; past it the server stops reading the stream, so a
/// caller that sends without reading is held back by HTTP/2 flow control, not by our memory.
const STREAM_MAX_OPEN: usize = 1024;

/// The retrace.v1.Evaluator service over an engine.
pub(crate) struct EvaluatorService {
    engine: Arc<Engine>,
    admin: AdminAuth,
}

impl EvaluatorService {
    pub(crate) fn new(engine: Arc<Engine>, admin: AdminAuth) -> Self {
        EvaluatorService { engine, admin }
    }

    pub(crate) fn into_server(self) -> pb::evaluator_server::EvaluatorServer<Self> {
        pb::evaluator_server::EvaluatorServer::new(self)
    }
}

/// The evaluator label for metrics: a configured name, or "unknown" (keeps the label set bounded).
fn label(engine: &Engine, requested: &str) -> String {
    engine
        .resolve_name(requested)
        .unwrap_or("unknown")
        .to_string()
}

/// Parses, runs and renders one EvaluateRequest.
async fn evaluate_one(
    engine: &Engine,
    req: pb::EvaluateRequest,
    deadline: Option<Instant>,
    arrived: Instant,
) -> Result<pb::EvaluateResponse, EngineError> {
    let input = convert::parse_evaluate(req)?;
    let trace = Arc::new(input.trace);
    let verdict = engine
        .evaluate(EngineRequest {
            evaluator: input.evaluator,
            trace: trace.clone(),
            threshold: input.threshold,
            deadline,
            arrived,
            origin: Origin::fields(FieldPath::key("trace")),
        })
        .await?;
    Ok(convert::response(input.id, &trace, verdict))
}

/// The engine's deadline: the caller's, brought forward a little so that the engine's
/// DEADLINE_EXCEEDED, which says where the time went, normally answers before the deadline
/// layer's plainer one.
fn engine_deadline(arrival: &Arrival) -> Option<Instant> {
    let d = arrival.timeout?;
    arrival
        .at
        .checked_add(d - (d / 10).min(Duration::from_millis(20)))
}

/// Counts a request once: with its outcome when it finishes; when its future is dropped first,
/// as `deadline_exceeded` if the caller's deadline had passed (the deadline layer answered, or
/// the caller's own timer gave up), else as `cancelled` (the caller went away).
struct Recorder {
    rpc: &'static str,
    evaluator: String,
    arrived: Instant,
    deadline: Option<Instant>,
    done: bool,
}

impl Recorder {
    fn new(
        rpc: &'static str,
        evaluator: String,
        arrived: Instant,
        deadline: Option<Instant>,
    ) -> Self {
        Recorder {
            rpc,
            evaluator,
            arrived,
            deadline,
            done: false,
        }
    }

    fn finish<T>(self, result: &Result<T, EngineError>) {
        let code = match result {
            Ok(_) => tonic::Code::Ok,
            Err(e) => to_status(e).code(),
        };
        self.finish_as(code);
    }

    /// Counts the call under `code`'s outcome: a reward answered with `empty_reward` after its
    /// deadline passed still counts as deadline_exceeded.
    fn finish_as(mut self, code: tonic::Code) {
        metrics::record_request(
            self.rpc,
            &self.evaluator,
            outcome(code),
            self.arrived.elapsed(),
        );
        self.done = true;
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        if !self.done {
            let outcome = match self.deadline {
                Some(d) if Instant::now() >= d => "deadline_exceeded",
                _ => "cancelled",
            };
            metrics::record_request(self.rpc, &self.evaluator, outcome, self.arrived.elapsed());
        }
    }
}

/// Turns a failed stream item into a response that carries the error and the request's id.
fn error_response(id: String, evaluator: String, e: &EngineError) -> pb::EvaluateResponse {
    let status = to_status(e);
    pb::EvaluateResponse {
        id,
        evaluator,
        first_error_index: -1,
        error: Some(pb::Error {
            code: status.code() as i32,
            message: status.message().to_string(),
        }),
        ..Default::default()
    }
}

/// The status a response stream ends with when its request stream breaks (an undecodable or
/// oversized item): INVALID_ARGUMENT, as the table has it for bad input, saying where it broke
/// and, in the words a unary call gets, why.
fn stream_broke(accepted: usize, status: &Status) -> Status {
    let why = unreadable::reason(status)
        .unwrap_or_else(|| format!("{:?}: {}", status.code(), status.message()));
    to_status(&EngineError::invalid(
        "request stream",
        format!(
            "item {accepted} could not be read ({why}); the {accepted} before it were answered"
        ),
    ))
}

type ResponseStream =
    Pin<Box<dyn futures::Stream<Item = Result<pb::EvaluateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::evaluator_server::Evaluator for EvaluatorService {
    async fn evaluate(
        &self,
        request: Request<pb::EvaluateRequest>,
    ) -> Result<Response<pb::EvaluateResponse>, Status> {
        let arrival = Arrival::take(&request);
        let req = request.into_inner();
        let evaluator = label(&self.engine, &req.evaluator);
        let recorder = Recorder::new("Evaluate", evaluator, arrival.at, arrival.deadline());
        let deadline = engine_deadline(&arrival);
        let result = evaluate_one(&self.engine, req, deadline, arrival.at).await;
        recorder.finish(&result);
        result.map(Response::new).map_err(|e| to_status(&e))
    }

    type EvaluateStreamStream = ResponseStream;

    async fn evaluate_stream(
        &self,
        request: Request<Streaming<pb::EvaluateRequest>>,
    ) -> Result<Response<Self::EvaluateStreamStream>, Status> {
        let arrival = Arrival::take(&request);
        let (stream_deadline, caller_deadline) = (engine_deadline(&arrival), arrival.deadline());
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        let engine = self.engine.clone();
        tokio::spawn(async move {
            // Owning the tasks here means that when the caller goes away, dropping the set
            // aborts them, and with them any work still queued.
            let mut tasks = JoinSet::new();
            let mut reading = true;
            let (mut accepted, mut broke) = (0usize, None);
            loop {
                if !reading && tasks.is_empty() {
                    // Every accepted request is answered; a broken request stream ends the
                    // response stream with its error instead of a silent OK.
                    if let Some(status) = broke.take() {
                        let _ = tx.send(Err(status)).await;
                    }
                    return;
                }
                tokio::select! {
                    next = inbound.next(), if reading && tasks.len() < STREAM_MAX_OPEN => match next {
                        Some(Ok(req)) => {
                            accepted += 1;
                            let (engine, tx) = (engine.clone(), tx.clone());
                            tasks.spawn(async move {
                                let arrived = Instant::now();
                                let (id, evaluator) = (req.id.clone(), label(&engine, &req.evaluator));
                                let recorder = Recorder::new("EvaluateStream", evaluator.clone(), arrived, caller_deadline);
                                let result = evaluate_one(&engine, req, stream_deadline, arrived).await;
                                recorder.finish(&result);
                                let item = result.unwrap_or_else(|e| error_response(id, evaluator, &e));
                                let _ = tx.send(Ok(item)).await;
                            });
                        }
                        Some(Err(status)) => {
                            tracing::info!(%status, accepted, "request stream broke off; answering what it accepted");
                            reading = false;
                            broke = Some(stream_broke(accepted, &status));
                        }
                        None => reading = false,
                    },
                    Some(_) = tasks.join_next(), if !tasks.is_empty() => {}
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn rank(
        &self,
        request: Request<pb::RankRequest>,
    ) -> Result<Response<pb::RankResponse>, Status> {
        let arrival = Arrival::take(&request);
        let req = request.into_inner();
        let evaluator = label(&self.engine, &req.evaluator);
        let recorder = Recorder::new("Rank", evaluator, arrival.at, arrival.deadline());
        let result = rank(&self.engine, req, engine_deadline(&arrival), arrival.at).await;
        recorder.finish(&result);
        result.map(Response::new).map_err(|e| to_status(&e))
    }

    async fn list_evaluators(
        &self,
        _request: Request<pb::ListEvaluatorsRequest>,
    ) -> Result<Response<pb::ListEvaluatorsResponse>, Status> {
        Ok(Response::new(evaluator_infos(&self.engine)))
    }

    async fn reload(
        &self,
        request: Request<pb::ReloadRequest>,
    ) -> Result<Response<pb::ReloadResponse>, Status> {
        self.admin.check_grpc(&request)?;
        let r = self.engine.reload(&request.get_ref().evaluator).await;
        let r = r.map_err(|e| to_status(&e))?;
        Ok(Response::new(reloaded(r)))
    }
}

/// A swap, as Reload and `POST /v1/reload` answer it.
pub(super) fn reloaded(r: crate::engine::Reloaded) -> pb::ReloadResponse {
    pb::ReloadResponse {
        evaluator: r.evaluator,
        model: r.model,
        seconds: r.seconds,
    }
}

/// Every hosted evaluator, as ListEvaluators and `GET /v1/evaluators` answer.
fn evaluator_infos(engine: &Engine) -> pb::ListEvaluatorsResponse {
    let evaluators = engine
        .list()
        .into_iter()
        .map(|s| pb::EvaluatorInfo {
            name: s.name,
            kind: s.description.kind,
            family: s.description.family,
            model: s.description.model,
            threshold: s.threshold,
            max_steps: u32::try_from(s.max_steps).unwrap_or(u32::MAX),
            max_trace_bytes: u32::try_from(s.max_trace_bytes).unwrap_or(u32::MAX),
            ready: s.ready,
            is_default: s.is_default,
            aggregate: s.aggregate.as_str().to_string(),
        })
        .collect();
    pb::ListEvaluatorsResponse { evaluators }
}

async fn rank(
    engine: &Engine,
    req: pb::RankRequest,
    deadline: Option<Instant>,
    arrived: Instant,
) -> Result<pb::RankResponse, EngineError> {
    let input = convert::parse_rank(req)?;
    let (id, threshold) = (input.id, input.threshold);
    let traces: Vec<Arc<_>> = input.traces.into_iter().map(Arc::new).collect();
    let requests = traces
        .iter()
        .enumerate()
        .map(|(i, t)| EngineRequest {
            evaluator: input.evaluator.clone(),
            trace: t.clone(),
            threshold,
            deadline,
            arrived,
            origin: Origin::fields(FieldPath::key("candidates").at(i)),
        })
        .collect();
    let verdicts = engine
        .evaluate_all(requests, &FieldPath::key("candidates"))
        .await?;
    let evaluator = verdicts
        .first()
        .map(|v| v.evaluator.clone())
        .unwrap_or_default();
    let mut ranked: Vec<pb::RankedCandidate> = verdicts
        .into_iter()
        .zip(&traces)
        .enumerate()
        .map(|(i, (v, t))| pb::RankedCandidate {
            index: i as u32,
            verdict: Some(convert::response(format!("{id}#{i}"), t, v)),
        })
        .collect();
    // Stable sort: equal scores keep request order.
    let score = |c: &pb::RankedCandidate| {
        c.verdict
            .as_ref()
            .map_or(f32::NEG_INFINITY, |v| v.trace_score)
    };
    ranked.sort_by(|a, b| score(b).total_cmp(&score(a)));
    Ok(pb::RankResponse {
        id,
        evaluator,
        ranked,
    })
}
