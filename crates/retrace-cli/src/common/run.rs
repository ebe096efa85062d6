//! Drives records through an evaluator (`judging`: a server over one EvaluateStream, or an
//! engine in this process) with a bounded window in flight and a progress bar, handing each
//! answer to an `Output`: `eval`'s predictions, or `label`'s rows. Records whose key the output
//! already holds are skipped, so a rerun resumes.

use super::backend::EvalBackend;
use super::dataset::{self, DataError, Record};
use super::jsonl::Writer;
use super::judging::{Judge, Local, Remote};
use super::predictions::{self, Predictions};
use super::spec::{Key, Outcome, Output, RunSpec};
use super::{EvalError, shown};
use std::collections::HashSet;
use std::path::Path;
use tokio::sync::mpsc;

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

/// Judges every record of `spec.files` not yet in the predictions file `out`, appending a row per
/// answer.
pub(crate) async fn score(
    backend: &EvalBackend,
    spec: &RunSpec,
    out: &Path,
) -> Result<RunStats, EvalError> {
    let spec = &resolve(backend, spec).await?;
    let existing = predictions::prepare(out)?;
    check_existing(&existing, spec, out)?;
    let mut output = Predictions(Writer::append(out)?);
    drive(backend, spec, existing.keys, &mut output).await
}

/// `spec` with its files checked and its evaluator named: every request names it, so a default
/// that changes mid-run can't mix rows.
pub(crate) async fn resolve(backend: &EvalBackend, spec: &RunSpec) -> Result<RunSpec, EvalError> {
    dataset::check_files(&spec.files)?;
    Ok(RunSpec {
        evaluator: backend.resolve(&spec.evaluator).await?,
        ..spec.clone()
    })
}

/// Judges every record of `spec.files` (a `resolve`d spec) whose key is not in `done`, handing
/// each answer to `output` as it comes.
pub(crate) async fn drive(
    backend: &EvalBackend,
    spec: &RunSpec,
    done: HashSet<Key>,
    output: &mut impl Output,
) -> Result<RunStats, EvalError> {
    let mut total = 0;
    for f in &spec.files {
        let n = dataset::count_records(f)?;
        total += spec.limit.map_or(n, |l| n.min(l));
    }
    let mut sink = Sink {
        output,
        bar: progress_bar(total as u64, spec.progress),
        stats: RunStats::default(),
    };
    let (tx, rx) = mpsc::channel(spec.concurrency.max(1) * 2);
    let reader = {
        let spec = spec.clone();
        tokio::task::spawn_blocking(move || read_all(&spec, &done, tx))
    };
    let result = match backend {
        EvalBackend::Remote { client, token, .. } => {
            match Remote::open((**client).clone(), token.clone(), spec).await {
                Ok(judge) => judge_all(judge, spec, rx, &mut sink).await,
                Err(e) => Err(e),
            }
        }
        EvalBackend::Local { engine } => judge_all(Local::new(engine), spec, rx, &mut sink).await,
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

/// Where answers and skipped rows go: the output, the progress bar, the counts.
struct Sink<'a, O> {
    output: &'a mut O,
    bar: indicatif::ProgressBar,
    stats: RunStats,
}

impl<O: Output> Sink<'_, O> {
    fn answer(&mut self, record: Record, outcome: Outcome) -> Result<(), EvalError> {
        self.stats.judged += 1;
        self.stats.failed += usize::from(outcome.failed());
        self.output.write(record, outcome)?;
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

/// Reads every file in order on a blocking thread; stops at the first bad row unless
/// `spec.skip_bad`.
fn read_all(spec: &RunSpec, done: &HashSet<Key>, tx: mpsc::Sender<Result<Item, DataError>>) {
    let (limit, skip_bad) = (spec.limit, spec.skip_bad);
    for f in &spec.files {
        let records = match dataset::read_records(f) {
            Ok(r) => r.for_purpose(spec.purpose),
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

/// Keeps up to --concurrency records in flight until the input runs out and every one is
/// answered, writing each answer as it comes.
async fn judge_all(
    mut judge: impl Judge,
    spec: &RunSpec,
    mut input: Input,
    sink: &mut Sink<'_, impl Output>,
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
                sink.answer(record, outcome)?;
            }
        }
    }
    Ok(())
}
