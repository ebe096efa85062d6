//! The tools' floor: what `eval`, `calibrate`, `label`, `train-head`, `bench` and `score` stand
//! on, so that they import this and never each other. Data (datasets, JSONL, the predictions
//! file), the client and run driver (backends, connection reuse and reopen, a resumable run),
//! scoring (the ProcessBench metric, the threshold sweep, the analyses) and reports (Markdown,
//! HTML, plots, one style).
//!
//! - `dataset`: the server library's reader of ProcessBench JSON arrays and JSONL -> `Record`s.
//! - `predictions`: the predictions JSONL (one `Row` per trace): the resumable output and the
//!   score cache calibration re-thresholds.
//! - `jsonl`: appending JSONL rows, and mending a last line a crash cut.
//! - `metric`: ProcessBench's run_eval.py per split, plus the average over splits.
//! - `analysis`: categories, the first-error index confusion, the answer-level (ReTraceQA) view.
//! - `best_of_n`: candidates of one question picked by trace score and by outcome score.
//! - `connect`: the flags that say where traces are judged, and the backend and run they give.
//! - `backend`: a server over gRPC, or an engine in this process.
//! - `spec`: what a run asks (`RunSpec`) and hands back (`Outcome`, into an `Output`).
//! - `run`: drives records through a backend, resumably, a bounded window in flight, into an
//!   `Output` (`eval`'s predictions; `label` has its own).
//! - `judging`: the two backends' ways of sending records and reading answers.
//! - `calibrate`: the exact F1-maximising threshold sweep.
//! - `report` / `plots`: Markdown, and HTML with inline SVG plots; `style`, what other tools'
//!   reports reuse.

mod analysis;
mod backend;
mod best_of_n;
mod calibrate;
mod connect;
/// The dataset reader is the server library's (a cascade reads its calibration rows with it).
pub(crate) mod dataset {
    pub(crate) use retrace::{
        DataError, Purpose, Record, check_files, count_records, read_records,
    };
}
pub(crate) mod jsonl;
mod judging;
mod metric;
mod plots;
mod predictions;
mod report;
pub(crate) mod run;
mod spec;

pub(crate) use analysis::Analyzer;
pub use analysis::{Analysis, AnswerLevel, CategoryStats, GeneratorStats};
pub(crate) use backend::{EvalBackend, connection_lost};
pub use best_of_n::{BestOfN, SelectorShare};
pub use calibrate::{Curve, ScoredTrace, ThresholdChoice, first_below, rethreshold, sweep};
pub use connect::ConnectOptions;
pub(crate) use connect::{backend, run_spec};
pub(crate) use dataset::Purpose;
pub use metric::{Averages, SplitScore, Summary};
pub use predictions::{Row, read_rows};
pub use report::{Calibration, Report, render_html, render_markdown};
pub use retrace::{DataError, Record, Records, read_records, records_from_bytes};
pub(crate) use spec::{Key, Outcome, Output};
/// What other tools' reports reuse: sections, tables and plots in the same style.
pub(crate) mod style {
    pub(crate) use super::plots::{PlotResult, SPLIT_COLORS, svg, threshold_curve};
    pub(crate) use super::report::{
        Section, Table, categories_section, html, markdown, metric_section, section, table,
    };
}
pub use run::RunStats;

use std::path::PathBuf;

/// Every way `eval` and `calibrate` fail.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// A row of an input or predictions file is bad: names the file and line.
    #[error(transparent)]
    Data(#[from] DataError),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Config(#[from] retrace::ConfigError),
    #[error("connecting to {addr}: {message}")]
    Connect { addr: String, message: String },
    /// The stream to the server broke off; what was written so far is kept (rerun to resume).
    #[error("the evaluation stream failed: {0}; predictions so far are kept, rerun to resume")]
    Stream(String),
    #[error("loading {0}")]
    Load(retrace::EvaluatorLoadError),
    /// A flag combination or a file's contents make the request impossible.
    #[error("{0}")]
    Usage(String),
    /// The run finished but left rows undone (failed requests); what they are was reported and
    /// a rerun retries them.
    #[error("{0}")]
    Incomplete(String),
}

impl EvalError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        EvalError::Io {
            what: what.into(),
            source,
        }
    }
}

/// `path` as shown in messages.
pub(crate) fn shown(path: &std::path::Path) -> String {
    path.display().to_string()
}

/// Creates `dir` (and parents) for output files.
pub(crate) fn ensure_dir(dir: &std::path::Path) -> Result<PathBuf, EvalError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| EvalError::io(format!("creating {}", shown(dir)), e))?;
    Ok(dir.to_path_buf())
}
