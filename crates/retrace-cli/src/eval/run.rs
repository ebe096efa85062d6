//! Drives records through an evaluator, over gRPC (one EvaluateStream, a bounded window of
//! requests in flight) or in-process (an `Engine` built from a config), and appends one
//! predictions row per answer. Rows already in the output are skipped, so a rerun resumes.

use super::backend::EvalBackend;
use super::dataset::{self, DataError, Record};
use super::predictions::{self, Outcome, Row, Writer};
use super::{EvalError, shown};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use retrace::api::TraceParts;
use retrace::api::pb;
use retrace::engine::{Engine, EngineError, Origin, Request};
use retrace::field::FieldPath;
use retrace::trace::Verdict;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;

/// What to judge and how.
#[derive(Debug, Clone)]
pub(crate) struct RunSpec {
    pub(crate) files: Vec<PathBuf>,
    /// Empty: the server's default.
    pub(crate) evaluator: String,
    /// Overrides the evaluator's threshold.
    pub(crate) threshold: Option<f32>,
    /// Requests in flight at once.
    pub(crate) concurrency: usize,
    /// At most this many rows from each file.
    pub(crate) limit: Option<usize>,
    /// Skip (and count) bad rows instead of stopping at the first.
    pub(crate) skip_bad: bool,
    pub(crate) progress: bool,
}

/// What a run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunStats {
    /// Rows judged (written) in this run.
    pub judged: usize,
    /// ... of which the request failed.
    pub failed: usize,
    /// Rows skipped because the output already had them.
    pub already_done: usize,
    /// Bad input rows skipped (with --skip-bad).
    pub bad_rows: usize,
    /// The first few of those, as `file:line: message`.
    pub bad: Vec<String>,
}

/// Bad rows whose messages a run keeps.
const BAD_KEPT: usize = 20;

/// What the reading thread hands over.
enum Item {
    Record(Record),
    Done,
    Bad(DataError),
}

/// Judges every record of `spec.files` not yet in `out`, appending a row per answer.
pub(crate) async fn score(
    backend: &EvalBackend,
    spec: &RunSpec,
    out: &Path,
) -> Result<RunStats, EvalError> {
    dataset::check_files(&spec.files)?;
    let evaluator = backend.resolve(&spec.evaluator).await?;
    // Name the evaluator on every request, so a default that changes mid-run can't mix rows.
    let spec = &RunSpec {
        evaluator: evaluator.clone(),
        ..spec.clone()
    };
    let existing = predictions::prepare(out)?;
    check_existing(&existing, spec, out)?;
    let mut total = 0;
    for f in &spec.files {
        let n = dataset::count_records(f)?;
        total += spec.limit.map_or(n, |l| n.min(l));
    }
    let mut sink = Sink {
        writer: Writer::append(out)?,
        bar: progress_bar(total as u64, spec.progress),
        stats: RunStats::default(),
    };
    let (tx, rx) = mpsc::channel(spec.concurrency.max(1) * 2);
    let reader = {
        let (files, limit, skip_bad) = (spec.files.clone(), spec.limit, spec.skip_bad);
        tokio::task::spawn_blocking(move || read_all(&files, limit, skip_bad, &existing.keys, tx))
    };
    let result = match backend {
        EvalBackend::Remote { client, token, .. } => {
            match Remote::open((**client).clone(), token.clone(), spec).await {
                Ok(judge) => judge_all(judge, spec, rx, &mut sink).await,
                Err(e) => Err(e),
            }
        }
        EvalBackend::Local { engine } => {
            let judge = Local {
                engine: engine.clone(),
                in_flight: FuturesUnordered::new(),
            };
            judge_all(judge, spec, rx, &mut sink).await
        }
    };
    sink.bar.finish_and_clear();
    result?;
    reader
        .await
        .map_err(|e| EvalError::Usage(format!("the reading thread failed: {e}")))?;
    Ok(sink.stats)
}

/// Refuses an output file holding another evaluator's rows, or rows decided at another threshold.
fn check_existing(
    existing: &predictions::Existing,
    spec: &RunSpec,
    out: &Path,
) -> Result<(), EvalError> {
    let evaluator = &spec.evaluator;
    if let Some(other) = existing.evaluators.iter().find(|e| *e != evaluator) {
        return Err(EvalError::Usage(format!(
            "{} holds predictions of evaluator {other:?}, not {evaluator:?}: choose another output",
            shown(out)
        )));
    }
    if let Some(t) = spec.threshold
        && let Some(other) = existing.thresholds.iter().find(|x| **x != t)
    {
        return Err(EvalError::Usage(format!(
            "{} holds predictions decided at threshold {other}, not {t}: choose another output \
             (or re-threshold them with `retrace calibrate`)",
            shown(out)
        )));
    }
    Ok(())
}

/// Where answers and skipped rows go: the predictions file, the progress bar, the counts.
struct Sink {
    writer: Writer,
    bar: indicatif::ProgressBar,
    stats: RunStats,
}

impl Sink {
    fn answer(&mut self, row: Row) -> Result<(), EvalError> {
        self.stats.judged += 1;
        self.stats.failed += usize::from(row.prediction.is_none());
        self.writer.write(&row)?;
        self.bar.inc(1);
        Ok(())
    }

    /// The record to judge, or None when the row is already done or bad (counted).
    fn item(&mut self, item: Item) -> Option<Record> {
        match item {
            Item::Record(r) => return Some(r),
            Item::Done => self.stats.already_done += 1,
            Item::Bad(e) => {
                self.stats.bad_rows += 1;
                if self.stats.bad.len() < BAD_KEPT {
                    self.stats.bad.push(e.to_string());
                }
            }
        }
        self.bar.inc(1);
        None
    }
}

fn progress_bar(total: u64, shown: bool) -> indicatif::ProgressBar {
    if !shown {
        return indicatif::ProgressBar::hidden();
    }
    let style = indicatif::ProgressStyle::with_template(
        "{bar:40} {pos}/{len} traces  {per_sec}  ETA {eta}  {elapsed}",
    )
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    indicatif::ProgressBar::new(total).with_style(style)
}

/// Reads every file in order on a blocking thread; stops at the first bad row unless `skip_bad`.
fn read_all(
    files: &[PathBuf],
    limit: Option<usize>,
    skip_bad: bool,
    done: &HashSet<(String, String)>,
    tx: mpsc::Sender<Result<Item, DataError>>,
) {
    for f in files {
        let records = match dataset::read_records(f) {
            Ok(r) => r,
            Err(e) => {
                let _ = tx.blocking_send(Err(e));
                return;
            }
        };
        for (n, item) in records.enumerate() {
            if limit.is_some_and(|l| n >= l) {
                break;
            }
            let item = match item {
                Ok(r) if done.contains(&(r.split.clone(), r.id.clone())) => Ok(Item::Done),
                Ok(r) => Ok(Item::Record(r)),
                Err(e) if skip_bad && !e.fatal => Ok(Item::Bad(e)),
                Err(e) => Err(e),
            };
            let stop = item.is_err();
            if tx.blocking_send(item).is_err() || stop {
                return;
            }
        }
    }
}

type Input = mpsc::Receiver<Result<Item, DataError>>;

/// A way of judging records: sent one at a time, answered in any order.
trait Judge {
    /// Requests sent and not yet answered.
    fn in_flight(&self) -> usize;
    /// Sends `record` off to be judged.
    async fn send(&mut self, record: Record, spec: &RunSpec) -> Result<(), EvalError>;
    /// The next answer; never resolves while none can come.
    async fn answer(&mut self, spec: &RunSpec) -> Result<(Record, Outcome), EvalError>;
}

/// Keeps up to --concurrency records in flight until the input runs out and every one is
/// answered, writing each answer as it comes.
async fn judge_all(
    mut judge: impl Judge,
    spec: &RunSpec,
    mut input: Input,
    sink: &mut Sink,
) -> Result<(), EvalError> {
    let window = spec.concurrency.max(1);
    let mut reading = true;
    while reading || judge.in_flight() > 0 {
        let can_send = reading && judge.in_flight() < window;
        tokio::select! {
            item = input.recv(), if can_send => match item {
                Some(Ok(item)) => {
                    if let Some(record) = sink.item(item) {
                        judge.send(record, spec).await?;
                    }
                }
                Some(Err(e)) => return Err(e.into()),
                None => reading = false,
            },
            answer = judge.answer(spec) => {
                let (record, outcome) = answer?;
                sink.answer(Row::new(&record, outcome))?;
            }
        }
    }
    Ok(())
}

/// A server, over one EvaluateStream.
struct Remote {
    requests: mpsc::Sender<pb::EvaluateRequest>,
    inbound: tonic::Streaming<pb::EvaluateResponse>,
    /// By our own ids on the wire: the data's ids need not be unique across files.
    pending: HashMap<String, Record>,
    next_id: u64,
}

impl Remote {
    async fn open(
        mut client: pb::evaluator_client::EvaluatorClient<Channel>,
        token: Option<MetadataValue<Ascii>>,
        spec: &RunSpec,
    ) -> Result<Remote, EvalError> {
        let (requests, req_rx) = mpsc::channel(spec.concurrency.max(1));
        let mut request = tonic::Request::new(ReceiverStream::new(req_rx));
        if let Some(t) = token {
            request.metadata_mut().insert("authorization", t);
        }
        let inbound = client
            .evaluate_stream(request)
            .await
            .map_err(|s| EvalError::Stream(s.to_string()))?
            .into_inner();
        Ok(Remote {
            requests,
            inbound,
            pending: HashMap::new(),
            next_id: 0,
        })
    }
}

impl Judge for Remote {
    fn in_flight(&self) -> usize {
        self.pending.len()
    }

    async fn send(&mut self, record: Record, spec: &RunSpec) -> Result<(), EvalError> {
        let id = self.next_id.to_string();
        self.next_id += 1;
        let req = request_of(&record, id.clone(), spec);
        self.pending.insert(id, record);
        self.requests
            .send(req)
            .await
            .map_err(|_| EvalError::Stream("the request stream closed".into()))
    }

    /// Listens to the stream even with nothing pending, so a stream that ends early is seen.
    async fn answer(&mut self, _: &RunSpec) -> Result<(Record, Outcome), EvalError> {
        match self.inbound.next().await {
            Some(Ok(resp)) => {
                let record = self.pending.remove(&resp.id).ok_or_else(|| {
                    EvalError::Stream(format!("the server answered an unknown id {:?}", resp.id))
                })?;
                Ok((record, outcome_of(resp)))
            }
            Some(Err(status)) => Err(EvalError::Stream(status.to_string())),
            None => Err(EvalError::Stream(format!(
                "the server ended the stream with {} requests unanswered",
                self.pending.len()
            ))),
        }
    }
}

type Judging =
    std::pin::Pin<Box<dyn Future<Output = (Record, Result<Verdict, EngineError>)> + Send>>;

/// An engine in this process.
struct Local {
    engine: Arc<Engine>,
    in_flight: FuturesUnordered<Judging>,
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
            Ok(v) => judged(v),
            Err(e) => Outcome::Failed {
                evaluator: spec.evaluator.clone(),
                message: e.to_string(),
            },
        };
        Ok((record, outcome))
    }
}

async fn judge_locally(
    engine: &Engine,
    record: &Record,
    spec: &RunSpec,
) -> Result<Verdict, EngineError> {
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
    engine
        .evaluate(Request {
            evaluator: spec.evaluator.clone(),
            trace: Arc::new(trace),
            threshold: spec.threshold,
            deadline: None,
            arrived: tokio::time::Instant::now(),
            origin: Origin::fields(at),
        })
        .await
}

fn judged(v: Verdict) -> Outcome {
    Outcome::Judged {
        evaluator: v.evaluator,
        first_error: v.judgement.error_index(),
        category: v.judgement.category,
        outcome_score: v.judgement.outcome.map(|o| o.score),
        step_scores: v.judgement.step_scores,
        threshold: v.threshold,
        trace_score: v.trace_score,
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
    let category = retrace::api::category_from_pb(resp.category);
    Outcome::Judged {
        evaluator: resp.evaluator,
        first_error: resp.first_error_index,
        category,
        step_scores: resp.steps.iter().map(|s| s.score).collect(),
        threshold: resp.threshold,
        trace_score: resp.trace_score,
        outcome_score: resp.outcome_score,
    }
}
