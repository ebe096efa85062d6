//! Drives records through an evaluator, over gRPC (one EvaluateStream, a bounded window of
//! requests in flight) or in-process (an `Engine` built from a config), and appends one
//! predictions row per answer. Rows already in the output are skipped, so a rerun resumes.

use super::backend::Backend;
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
pub struct RunSpec {
    pub files: Vec<PathBuf>,
    /// Empty: the server's default.
    pub evaluator: String,
    /// Overrides the evaluator's threshold.
    pub threshold: Option<f32>,
    /// Requests in flight at once.
    pub concurrency: usize,
    /// At most this many rows from each file.
    pub limit: Option<usize>,
    /// Skip (and count) bad rows instead of stopping at the first.
    pub skip_bad: bool,
    pub progress: bool,
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
pub async fn score(backend: &Backend, spec: &RunSpec, out: &Path) -> Result<RunStats, EvalError> {
    dataset::check_files(&spec.files)?;
    let evaluator = backend.resolve(&spec.evaluator).await?;
    // Name the evaluator on every request, so a default that changes mid-run can't mix rows.
    let spec = &RunSpec {
        evaluator: evaluator.clone(),
        ..spec.clone()
    };
    let existing = predictions::prepare(out)?;
    if let Some(other) = existing.evaluators.iter().find(|e| **e != evaluator) {
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
    let mut total = 0;
    for f in &spec.files {
        let n = dataset::count_records(f)?;
        total += spec.limit.map_or(n, |l| n.min(l));
    }
    let bar = progress_bar(total as u64, spec.progress);
    let mut writer = Writer::append(out)?;
    let (tx, rx) = mpsc::channel(spec.concurrency.max(1) * 2);
    let reader = {
        let (files, limit, skip_bad) = (spec.files.clone(), spec.limit, spec.skip_bad);
        tokio::task::spawn_blocking(move || read_all(&files, limit, skip_bad, &existing.keys, tx))
    };
    let mut stats = RunStats::default();
    let mut sink = |row: Row, stats: &mut RunStats| -> Result<(), EvalError> {
        stats.judged += 1;
        stats.failed += usize::from(row.prediction.is_none());
        writer.write(&row)?;
        bar.inc(1);
        Ok(())
    };
    let mut on_item = |item: Item, stats: &mut RunStats| -> Option<Record> {
        match item {
            Item::Record(r) => return Some(r),
            Item::Done => stats.already_done += 1,
            Item::Bad(e) => {
                stats.bad_rows += 1;
                if stats.bad.len() < BAD_KEPT {
                    stats.bad.push(e.to_string());
                }
            }
        }
        bar.inc(1);
        None
    };
    let result = match backend {
        Backend::Remote { client, token, .. } => {
            let client = (**client).clone();
            remote(
                client,
                token.clone(),
                spec,
                rx,
                &mut stats,
                &mut on_item,
                &mut sink,
            )
            .await
        }
        Backend::Local { engine } => {
            local(
                engine.clone(),
                spec,
                rx,
                &mut stats,
                &mut on_item,
                &mut sink,
            )
            .await
        }
    };
    bar.finish_and_clear();
    result?;
    reader
        .await
        .map_err(|e| EvalError::Usage(format!("the reading thread failed: {e}")))?;
    Ok(stats)
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

async fn remote(
    mut client: pb::evaluator_client::EvaluatorClient<Channel>,
    token: Option<MetadataValue<Ascii>>,
    spec: &RunSpec,
    mut input: Input,
    stats: &mut RunStats,
    on_item: &mut impl FnMut(Item, &mut RunStats) -> Option<Record>,
    sink: &mut impl FnMut(Row, &mut RunStats) -> Result<(), EvalError>,
) -> Result<(), EvalError> {
    let window = spec.concurrency.max(1);
    let (req_tx, req_rx) = mpsc::channel(window);
    let mut request = tonic::Request::new(ReceiverStream::new(req_rx));
    if let Some(t) = token {
        request.metadata_mut().insert("authorization", t);
    }
    let mut inbound = client
        .evaluate_stream(request)
        .await
        .map_err(|s| EvalError::Stream(s.to_string()))?
        .into_inner();
    // Our own ids on the wire: the data's ids need not be unique across files.
    let mut pending: HashMap<String, Record> = HashMap::new();
    let (mut next_id, mut reading) = (0u64, true);
    while reading || !pending.is_empty() {
        tokio::select! {
            item = input.recv(), if reading && pending.len() < window => match item {
                Some(Ok(item)) => {
                    if let Some(record) = on_item(item, stats) {
                        let id = next_id.to_string();
                        next_id += 1;
                        let req = request_of(&record, id.clone(), spec);
                        pending.insert(id, record);
                        req_tx.send(req).await.map_err(|_| {
                            EvalError::Stream("the request stream closed".into())
                        })?;
                    }
                }
                Some(Err(e)) => return Err(e.into()),
                None => reading = false,
            },
            answer = inbound.next() => match answer {
                Some(Ok(resp)) => {
                    let record = pending.remove(&resp.id).ok_or_else(|| {
                        EvalError::Stream(format!("the server answered an unknown id {:?}", resp.id))
                    })?;
                    sink(Row::new(&record, outcome_of(resp)), stats)?;
                }
                Some(Err(status)) => return Err(EvalError::Stream(status.to_string())),
                None => {
                    return Err(EvalError::Stream(format!(
                        "the server ended the stream with {} requests unanswered",
                        pending.len()
                    )));
                }
            },
        }
    }
    Ok(())
}

async fn local(
    engine: Arc<Engine>,
    spec: &RunSpec,
    mut input: Input,
    stats: &mut RunStats,
    on_item: &mut impl FnMut(Item, &mut RunStats) -> Option<Record>,
    sink: &mut impl FnMut(Row, &mut RunStats) -> Result<(), EvalError>,
) -> Result<(), EvalError> {
    let window = spec.concurrency.max(1);
    let mut in_flight = FuturesUnordered::new();
    let mut reading = true;
    while reading || !in_flight.is_empty() {
        tokio::select! {
            item = input.recv(), if reading && in_flight.len() < window => match item {
                Some(Ok(item)) => {
                    if let Some(record) = on_item(item, stats) {
                        let (engine, spec) = (engine.clone(), spec.clone());
                        in_flight.push(async move {
                            let result = judge_locally(&engine, &record, &spec).await;
                            (record, result)
                        });
                    }
                }
                Some(Err(e)) => return Err(e.into()),
                None => reading = false,
            },
            Some((record, result)) = in_flight.next(), if !in_flight.is_empty() => {
                let outcome = match result {
                    Ok(v) => judged(v),
                    Err(e) => Outcome::Failed {
                        evaluator: spec.evaluator.clone(),
                        message: e.to_string(),
                    },
                };
                sink(Row::new(&record, outcome), stats)?;
            }
        }
    }
    Ok(())
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
        first_error: v.judgement.first_error.map_or(-1, |i| i as i32),
        category: v.judgement.category,
        step_scores: v.judgement.step_scores,
        threshold: v.threshold,
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
    }
}
