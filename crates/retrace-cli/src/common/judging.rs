//! The two ways of judging records: a server over one EvaluateStream (our own ids on the wire),
//! or an engine in this process (the server's own parsing at the edge); each answer becomes an
//! `Outcome` carrying what `eval` and `label` keep.

use super::EvalError;
use super::backend::connection_lost;
use super::dataset::Record;
use super::spec::{Outcome, RunSpec};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use retrace::FieldPath;
use retrace::TraceParts;
use retrace::Verdict;
use retrace::pb;
use retrace::{Engine, EngineError, Origin, Request};
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;

/// A way of judging records: sent one at a time, answered in any order.
pub(super) trait Judge {
    /// Requests sent and not yet answered.
    fn in_flight(&self) -> usize;
    /// Sends `record` off to be judged.
    async fn send(&mut self, record: Record, spec: &RunSpec) -> Result<(), EvalError>;
    /// The next answer; never resolves while none can come.
    async fn answer(&mut self, spec: &RunSpec) -> Result<(Record, Outcome), EvalError>;
}

/// A server, over one EvaluateStream at a time. A server retires a connection after
/// `max_connection_age_s` (GOAWAY) and cuts it after its grace, stream and all: a stream that
/// fails with the connection (not with a status the server sent) is opened again, on a new
/// connection, and what was pending is sent again.
pub(super) struct Remote {
    client: pb::evaluator_client::EvaluatorClient<Channel>,
    token: Option<MetadataValue<Ascii>>,
    requests: mpsc::Sender<pb::EvaluateRequest>,
    inbound: tonic::Streaming<pb::EvaluateResponse>,
    /// By our own ids on the wire: the data's ids need not be unique across files.
    pending: HashMap<String, Record>,
    next_id: u64,
    /// Streams opened again since the last answer.
    reopened: usize,
}

/// Streams opened again in a row, with no answer between, before the failure is the run's.
const MAX_REOPEN: usize = 3;

/// The two ends of a new EvaluateStream on `client`.
async fn open_stream(
    client: &mut pb::evaluator_client::EvaluatorClient<Channel>,
    token: &Option<MetadataValue<Ascii>>,
    spec: &RunSpec,
) -> Result<Stream, tonic::Status> {
    let (requests, req_rx) = mpsc::channel(spec.concurrency.max(1));
    let mut request = tonic::Request::new(ReceiverStream::new(req_rx));
    if let Some(t) = token {
        request.metadata_mut().insert("authorization", t.clone());
    }
    let inbound = client.evaluate_stream(request).await?.into_inner();
    Ok((requests, inbound))
}

type Stream = (
    mpsc::Sender<pb::EvaluateRequest>,
    tonic::Streaming<pb::EvaluateResponse>,
);

impl Remote {
    pub(super) async fn open(
        mut client: pb::evaluator_client::EvaluatorClient<Channel>,
        token: Option<MetadataValue<Ascii>>,
        spec: &RunSpec,
    ) -> Result<Remote, EvalError> {
        let (requests, inbound) = open_stream(&mut client, &token, spec)
            .await
            .map_err(|s| EvalError::Stream(s.to_string()))?;
        Ok(Remote {
            client,
            token,
            requests,
            inbound,
            pending: HashMap::new(),
            next_id: 0,
            reopened: 0,
        })
    }

    /// A new stream in place of one whose connection failed (`why`), with every pending
    /// request sent again; `why` is the run's error after MAX_REOPEN tries without an answer.
    async fn reopen(&mut self, why: tonic::Status, spec: &RunSpec) -> Result<(), EvalError> {
        let mut last = why;
        while connection_lost(&last) && self.reopened < MAX_REOPEN {
            self.reopened += 1;
            match open_stream(&mut self.client, &self.token, spec).await {
                Ok((requests, inbound)) => {
                    (self.requests, self.inbound) = (requests, inbound);
                    for (id, record) in &self.pending {
                        let req = request_of(record, id.clone(), spec);
                        // The channel holds `concurrency` requests, as many as can be pending.
                        if self.requests.send(req).await.is_err() {
                            break;
                        }
                    }
                    return Ok(());
                }
                Err(status) => last = status,
            }
        }
        Err(EvalError::Stream(last.to_string()))
    }
}

impl Judge for Remote {
    fn in_flight(&self) -> usize {
        self.pending.len()
    }

    /// A request the stream no longer takes stays pending: the failure shows in `answer`,
    /// which opens a new stream and sends it there.
    async fn send(&mut self, record: Record, spec: &RunSpec) -> Result<(), EvalError> {
        let id = self.next_id.to_string();
        self.next_id += 1;
        let req = request_of(&record, id.clone(), spec);
        self.pending.insert(id, record);
        let _ = self.requests.send(req).await;
        Ok(())
    }

    /// Listens to the stream even with nothing pending, so a stream that ends early is seen.
    async fn answer(&mut self, spec: &RunSpec) -> Result<(Record, Outcome), EvalError> {
        loop {
            match self.inbound.next().await {
                Some(Ok(resp)) => {
                    let record = self.pending.remove(&resp.id).ok_or_else(|| {
                        EvalError::Stream(format!(
                            "the server answered an unknown id {:?}",
                            resp.id
                        ))
                    })?;
                    self.reopened = 0;
                    return Ok((record, outcome_of(resp)));
                }
                Some(Err(status)) => self.reopen(status, spec).await?,
                None => {
                    return Err(EvalError::Stream(format!(
                        "the server ended the stream with {} requests unanswered",
                        self.pending.len()
                    )));
                }
            }
        }
    }
}

/// A verdict and the steps it judged.
type Judged = Result<(Verdict, Vec<String>), EngineError>;

type Judging = std::pin::Pin<Box<dyn Future<Output = (Record, Judged)> + Send>>;

/// An engine in this process.
pub(super) struct Local {
    engine: Arc<Engine>,
    in_flight: FuturesUnordered<Judging>,
}

impl Local {
    pub(super) fn new(engine: &Arc<Engine>) -> Local {
        Local {
            engine: engine.clone(),
            in_flight: FuturesUnordered::new(),
        }
    }
}

impl Judge for Local {
    fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    async fn send(&mut self, record: Record, spec: &RunSpec) -> Result<(), EvalError> {
        let (engine, spec) = (self.engine.clone(), spec.clone());
        self.in_flight.push(Box::pin(async move {
            let result = judge_locally(&engine, &record, &spec).await;
            (record, result)
        }));
        Ok(())
    }

    async fn answer(&mut self, spec: &RunSpec) -> Result<(Record, Outcome), EvalError> {
        let Some((record, result)) = self.in_flight.next().await else {
            return std::future::pending().await;
        };
        let outcome = match result {
            Ok((v, steps)) => judged(v, steps),
            Err(e) => Outcome::Failed {
                evaluator: spec.evaluator.clone(),
                message: e.to_string(),
            },
        };
        Ok((record, outcome))
    }
}

async fn judge_locally(engine: &Engine, record: &Record, spec: &RunSpec) -> Judged {
    // The same parsing and validation the server applies at its edge.
    let at = FieldPath::key("trace");
    let parts = TraceParts {
        question: record.question.clone(),
        options: record.options.clone(),
        reference_answer: record.reference_answer.clone().unwrap_or_default(),
        steps: record.steps.clone(),
        text: record.text.clone().unwrap_or_default(),
    };
    let trace = parts.parse(&at)?;
    let steps = trace.step_texts().map(str::to_string).collect();
    let verdict = engine
        .evaluate(Request {
            evaluator: spec.evaluator.clone(),
            trace: Arc::new(trace),
            threshold: spec.threshold,
            deadline: None,
            arrived: tokio::time::Instant::now(),
            origin: Origin::fields(at),
        })
        .await?;
    Ok((verdict, steps))
}

fn judged(v: Verdict, steps: Vec<String>) -> Outcome {
    let j = v.judgement;
    Outcome::Judged {
        evaluator: v.evaluator,
        first_error: j.error_index(),
        category: j.category,
        outcome_score: j.outcome.map(|o| o.score),
        step_scores: j.step_scores,
        threshold: v.threshold,
        trace_score: v.trace_score,
        steps,
        rationale: j.rationale,
        agreement: j.agreement,
    }
}

fn request_of(record: &Record, id: String, spec: &RunSpec) -> pb::EvaluateRequest {
    pb::EvaluateRequest {
        id,
        evaluator: spec.evaluator.clone(),
        trace: Some(pb::Trace {
            question: record.question.clone(),
            options: record.options.clone(),
            steps: record.steps.clone(),
            text: record.text.clone().unwrap_or_default(),
            reference_answer: record.reference_answer.clone().unwrap_or_default(),
        }),
        threshold: spec.threshold,
    }
}

fn outcome_of(resp: pb::EvaluateResponse) -> Outcome {
    if let Some(e) = resp.error {
        let code = tonic::Code::from_i32(e.code);
        return Outcome::Failed {
            evaluator: resp.evaluator,
            message: format!("{code:?}: {}", e.message),
        };
    }
    let category = retrace::category_from_pb(resp.category);
    Outcome::Judged {
        evaluator: resp.evaluator,
        first_error: resp.first_error_index,
        category,
        step_scores: resp.steps.iter().map(|s| s.score).collect(),
        threshold: resp.threshold,
        trace_score: resp.trace_score,
        outcome_score: resp.outcome_score,
        steps: resp.steps.into_iter().map(|s| s.text).collect(),
        rationale: Some(resp.rationale).filter(|r| !r.is_empty()),
        agreement: resp.agreement,
    }
}
