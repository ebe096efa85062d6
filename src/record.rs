//! Recording a judge's verdicts as dataset rows (`record = "PATH"` on a judge or a cascade):
//! each judged trace becomes one JSONL line in the shape `eval`, `label` and `train-head` read,
//! so the judge's decisions can train the head that will spare it. A queue bounded in rows and
//! in bytes feeds one writer thread: a request never waits on the disk, and a full queue drops
//! the row (counted), never the request. The files hold users' traces: they are the owner's
//! alone (0600).

use crate::dataset::{VerdictFields, verdict_index as index};
use crate::metrics;
use crate::rule::{Refused, refuse};
use crate::trace::{Judgement, Trace};
use serde::{Deserialize, Deserializer, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How often written rows are synced to the disk: a crash of the machine loses at most this
/// much; a crash of the process loses only the rows still queued.
const SYNC_EVERY: Duration = Duration::from_secs(1);

/// Where and how much a judge or cascade records.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RecordConfig {
    /// A `.jsonl` file, rotated to `NAME.000001.jsonl`, `NAME.000002.jsonl`... beside it; or a
    /// folder, which then holds `verdicts.jsonl` and its rotated files.
    pub path: PathBuf,
    /// The current file is rotated before it passes this size.
    #[serde(default = "defaults::max_file_mb")]
    pub max_file_mb: u64,
    /// Rotated files kept beside the current one; the oldest goes first.
    #[serde(default = "defaults::max_files")]
    pub max_files: usize,
    /// Rows waiting for the writer; past it, rows are dropped and counted.
    #[serde(default = "defaults::queue")]
    pub queue: usize,
    /// Bytes of rows waiting for the writer, in MiB; past it, rows are dropped and counted. A
    /// row is up to a trace's size (256 KiB by default), so a count of rows alone could hold
    /// a gigabyte.
    #[serde(default = "defaults::queue_mb")]
    pub queue_mb: u64,
}

/// The mode of a record file: the owner's alone.
const FILE_MODE: u32 = 0o600;

mod defaults {
    pub(super) fn max_file_mb() -> u64 {
        64
    }
    pub(super) fn max_files() -> usize {
        8
    }
    pub(super) fn queue() -> usize {
        4096
    }
    pub(super) fn queue_mb() -> u64 {
        16
    }
}

impl RecordConfig {
    pub fn check(&self) -> Result<(), Refused> {
        if self.path.as_os_str().is_empty() {
            return refuse("record.path must name a .jsonl file or a folder");
        }
        if self.max_file_mb == 0 || self.max_files == 0 || self.queue == 0 || self.queue_mb == 0 {
            return refuse(
                "record.max_file_mb, record.max_files, record.queue and record.queue_mb must be \
                 at least 1",
            );
        }
        Ok(())
    }

    /// The folder the files live in and their stem: `PATH.jsonl`'s folder and `PATH`'s stem,
    /// or a folder's `verdicts`.
    fn place(&self) -> (PathBuf, String) {
        let path = &self.path;
        let folder = path.is_dir() || path.as_os_str().to_string_lossy().ends_with('/');
        let (dir, stem) = match folder {
            true => (path.clone(), "verdicts".to_string()),
            false => {
                let dir = path.parent().unwrap_or(Path::new(".")).to_path_buf();
                let stem = path.file_stem().unwrap_or_default();
                (dir, stem.to_string_lossy().into_owned())
            }
        };
        match dir.as_os_str().is_empty() {
            true => (PathBuf::from("."), stem),
            false => (dir, stem),
        }
    }

    /// The file rows are appended to, made absolute, so that two configs that name one file
    /// in two ways are seen to (two writers on one file interleave and rotate each other's).
    pub(crate) fn current_file(&self) -> PathBuf {
        let (dir, stem) = self.place();
        let file = dir.join(format!("{stem}.jsonl"));
        std::path::absolute(&file).unwrap_or(file)
    }
}

/// `record = "PATH"`, or a table with `path` and the limits.
pub(crate) fn deserialize_record<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<RecordConfig>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Form {
        Path(PathBuf),
        Table(toml::Table),
    }
    match Form::deserialize(d)? {
        Form::Path(path) => Ok(Some(RecordConfig {
            path,
            max_file_mb: defaults::max_file_mb(),
            max_files: defaults::max_files(),
            queue: defaults::queue(),
            queue_mb: defaults::queue_mb(),
        })),
        // Read again as the struct, so an unknown or mistyped key is named.
        Form::Table(t) => toml::Value::Table(t)
            .try_into()
            .map(Some)
            .map_err(|e| serde::de::Error::custom(format!("record: {e}"))),
    }
}

/// One recorded row: the trace, and the judge's verdict as a dataset's `label` and `category`.
#[derive(Debug, Serialize)]
struct Row<'a> {
    id: String,
    question: &'a str,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    options: &'a [String],
    steps: Vec<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reference_answer: Option<&'a str>,
    /// The judge's verdict, as `retrace label` writes it too.
    #[serde(flatten)]
    verdict: VerdictFields,
    /// The evaluator that recorded it (a cascade over the judge).
    recorded_by: &'a str,
    /// A cascade's PRM's first wrong step on the same trace, -1 when none.
    #[serde(skip_serializing_if = "Option::is_none")]
    prm_label: Option<i32>,
    recorded_unix_ms: u128,
}

/// A record file that could not be opened, or a writer thread that could not start.
#[derive(Debug, thiserror::Error)]
#[error("record: cannot write to {path}: {source}")]
pub(crate) struct RecordError {
    path: String,
    source: std::io::Error,
}

/// The sending side: cheap to call from a request; the writer thread does the rest.
pub(crate) struct Recorder {
    evaluator: String,
    judge: String,
    tx: SyncSender<String>,
    /// Bytes queued and not yet taken by the writer, and the most allowed.
    queued: Arc<AtomicU64>,
    max_queued: u64,
}

/// The writing side: one thread owns the file.
pub(crate) struct Writer {
    evaluator: String,
    files: Files,
    rx: Receiver<String>,
    queued: Arc<AtomicU64>,
}

impl Recorder {
    /// The recorder of `evaluator`'s verdicts by `judge`, its writer thread started.
    pub(crate) fn start(
        evaluator: &str,
        judge: &str,
        config: &RecordConfig,
    ) -> Result<Recorder, RecordError> {
        let failed = |source| RecordError {
            path: config.path.display().to_string(),
            source,
        };
        let (recorder, writer) = Recorder::open(evaluator, judge, config).map_err(failed)?;
        writer.spawn().map_err(failed)?;
        Ok(recorder)
    }

    /// Opens (and repairs) the current file and makes the queue; `Writer::spawn` starts the
    /// thread that drains it. `evaluator` records, `judge` decides.
    pub(crate) fn open(
        evaluator: &str,
        judge: &str,
        cfg: &RecordConfig,
    ) -> std::io::Result<(Recorder, Writer)> {
        let files = Files::open(cfg)?;
        let (tx, rx) = sync_channel(cfg.queue);
        let queued = Arc::new(AtomicU64::new(0));
        metrics::recorded_at_zero(evaluator);
        let recorder = Recorder {
            evaluator: evaluator.into(),
            judge: judge.into(),
            tx,
            queued: queued.clone(),
            max_queued: cfg.queue_mb.saturating_mul(1 << 20),
        };
        let writer = Writer {
            evaluator: evaluator.into(),
            files,
            rx,
            queued,
        };
        Ok((recorder, writer))
    }

    /// Queues the judge's verdict on `trace`; `prm` is a cascade's PRM's own first error.
    pub(crate) fn record(&self, trace: &Trace, judged: &Judgement, prm: Option<Option<usize>>) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let row = Row {
            id: format!("{}-{}", self.evaluator, now.as_nanos()),
            question: &trace.question,
            options: &trace.options,
            steps: trace.step_texts().collect(),
            reference_answer: trace.reference_answer.as_deref().filter(|r| !r.is_empty()),
            verdict: VerdictFields::of(judged, &self.judge),
            recorded_by: &self.evaluator,
            prm_label: prm.map(index),
            recorded_unix_ms: now.as_millis(),
        };
        // Plain strings, numbers and lists: serialising cannot fail.
        let line = serde_json::to_string(&row).unwrap_or_default();
        if let Err(outcome) = self.send(line) {
            metrics::record_recorded(&self.evaluator, outcome, 1);
        }
    }

    /// Queues a row unless the queue is full in rows or in bytes; the outcome it is counted
    /// under when not.
    fn send(&self, line: String) -> Result<(), &'static str> {
        let len = line.len() as u64;
        let before = self.queued.fetch_add(len, Ordering::AcqRel);
        // One row larger than the whole bound still goes when nothing is queued: a bound in
        // bytes must not refuse every row of a long trace.
        if before > 0 && before + len > self.max_queued {
            self.queued.fetch_sub(len, Ordering::AcqRel);
            return Err("dropped");
        }
        let refused = match self.tx.try_send(line) {
            Ok(()) => return Ok(()),
            Err(TrySendError::Full(_)) => "dropped",
            Err(TrySendError::Disconnected(_)) => "failed",
        };
        self.queued.fetch_sub(len, Ordering::AcqRel);
        Err(refused)
    }
}

impl Writer {
    /// Starts the writer thread; it ends when its `Recorder` is dropped, after a last sync.
    pub(crate) fn spawn(self) -> std::io::Result<()> {
        let name = format!("record-{}", self.evaluator);
        std::thread::Builder::new()
            .name(name)
            .spawn(move || self.run())
            .map(|_| ())
    }

    fn run(mut self) {
        let mut synced = Instant::now();
        loop {
            match self.rx.recv_timeout(SYNC_EVERY) {
                Ok(line) => {
                    let mut written = u64::from(self.write(&line));
                    while let Ok(line) = self.rx.try_recv() {
                        written += u64::from(self.write(&line));
                    }
                    self.files.flush();
                    // Counted once in the file, so a reader that sees the count sees the rows.
                    metrics::record_recorded(&self.evaluator, "written", written);
                    if synced.elapsed() >= SYNC_EVERY {
                        self.files.sync();
                        synced = Instant::now();
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    self.files.sync();
                    synced = Instant::now();
                }
                Err(RecvTimeoutError::Disconnected) => {
                    self.files.sync();
                    return;
                }
            }
        }
    }

    /// Appends one row, taken off the queue; whether it was written.
    fn write(&mut self, line: &str) -> bool {
        self.queued.fetch_sub(line.len() as u64, Ordering::AcqRel);
        match self.files.append(line) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(evaluator = %self.evaluator, error = %e, "recording a verdict failed");
                metrics::record_recorded(&self.evaluator, "failed", 1);
                false
            }
        }
    }
}

/// The current file and its rotated siblings.
struct Files {
    dir: PathBuf,
    stem: String,
    out: BufWriter<File>,
    size: u64,
    max_bytes: u64,
    max_files: usize,
}

impl Files {
    fn open(cfg: &RecordConfig) -> std::io::Result<Files> {
        let (dir, stem) = cfg.place();
        std::fs::create_dir_all(&dir)?;
        let current = dir.join(format!("{stem}.jsonl"));
        let (out, size) = open_current(&current)?;
        Ok(Files {
            dir,
            stem,
            out,
            size,
            max_bytes: cfg.max_file_mb.saturating_mul(1 << 20),
            max_files: cfg.max_files,
        })
    }

    fn current(&self) -> PathBuf {
        self.dir.join(format!("{}.jsonl", self.stem))
    }

    fn append(&mut self, line: &str) -> std::io::Result<()> {
        let len = line.len() as u64 + 1;
        if self.size > 0 && self.size + len > self.max_bytes {
            self.rotate()?;
        }
        self.out.write_all(line.as_bytes())?;
        self.out.write_all(b"\n")?;
        self.size += len;
        Ok(())
    }

    /// The current file becomes the next numbered one; the oldest past `max_files` go.
    fn rotate(&mut self) -> std::io::Result<()> {
        self.out.flush()?;
        self.out.get_ref().sync_data()?;
        let mut numbered = self.numbered()?;
        let next = numbered.last().map_or(1, |(n, _)| n + 1);
        let to = self.dir.join(format!("{}.{next:06}.jsonl", self.stem));
        std::fs::rename(self.current(), &to)?;
        numbered.push((next, to));
        let excess = numbered.len().saturating_sub(self.max_files);
        for (_, old) in &numbered[..excess] {
            std::fs::remove_file(old)?;
        }
        (self.out, self.size) = open_current(&self.current())?;
        Ok(())
    }

    /// The rotated files, oldest first.
    fn numbered(&self) -> std::io::Result<Vec<(u64, PathBuf)>> {
        let prefix = format!("{}.", self.stem);
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let name = entry?.file_name().to_string_lossy().into_owned();
            let n = name
                .strip_prefix(&prefix)
                .and_then(|rest| rest.strip_suffix(".jsonl"))
                .and_then(|n| n.parse::<u64>().ok());
            if let Some(n) = n {
                found.push((n, self.dir.join(name)));
            }
        }
        found.sort();
        Ok(found)
    }

    fn flush(&mut self) {
        if let Err(e) = self.out.flush() {
            tracing::warn!(error = %e, "flushing recorded verdicts failed");
        }
    }

    fn sync(&mut self) {
        self.flush();
        if let Err(e) = self.out.get_ref().sync_data() {
            tracing::warn!(error = %e, "syncing recorded verdicts failed");
        }
    }
}

/// Opens the current file for appending, first cutting a line a crash left half-written: the
/// rows before it stay whole. Returns it and its length.
fn open_current(path: &Path) -> std::io::Result<(BufWriter<File>, u64)> {
    let mut file = OpenOptions::new()
        .create(true)
        .read(true)
        .append(true)
        .mode(FILE_MODE)
        .open(path)?;
    // A file made before (by another tool, or under another umask) is narrowed too.
    let permissions = file.metadata()?.permissions();
    if permissions.mode() & 0o777 != FILE_MODE {
        file.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))?;
    }
    let whole = whole_length(&mut file)?;
    if whole < file.metadata()?.len() {
        file.set_len(whole)?;
    }
    Ok((BufWriter::new(file), whole))
}

/// The length of `file` up to and including its last newline: what whole lines it holds.
fn whole_length(file: &mut File) -> std::io::Result<u64> {
    let len = file.metadata()?.len();
    let mut at = len;
    let mut buf = [0u8; 4096];
    while at > 0 {
        let n = (at as usize).min(buf.len());
        at -= n as u64;
        file.seek(SeekFrom::Start(at))?;
        file.read_exact(&mut buf[..n])?;
        if let Some(i) = buf[..n].iter().rposition(|&b| b == b'\n') {
            return Ok(at + i as u64 + 1);
        }
    }
    Ok(0)
}

#[cfg(test)]
#[path = "record_tests.rs"]
mod tests;
