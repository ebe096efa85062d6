//! # retrace-cli
//!
//! The tools of the `retrace` binary, apart from the server library so that the server links
//! none of their dependencies (anyhow, plotters, indicatif).
//!
//! # Layout
//! - `common/`: the floor every tool stands on: datasets and JSONL, the client and the resumable
//!   run driver, the ProcessBench metric and the threshold sweep, reports in one style. The
//!   tools above it import it and never each other.
//! - `eval/` (`retrace eval`, `retrace calibrate`): the two commands' options and flow.
//! - `label/` (`retrace label`): an evaluator's verdicts written as dataset rows.
//! - `bench/` (`retrace bench`): scoring speed against llama-server and the machine's peak.
//! - `score.rs` (`retrace score`): a client that prints verdicts as tables.
//! - `train/` (`retrace train-head`): a PRM head on a frozen decoder's features.
//! - `main.rs`: the command line; `alloc.rs`: the binary's allocator and its idle trim.

#![forbid(unsafe_code)]

mod bench;
mod common;
mod eval;
mod label;
mod score;
mod train;

// The tools' face: what the binary (`main.rs`) and the tests name. The rest is the tools' own,
// so `unreachable_pub` and the dead-code lints see all of it.
pub use bench::{BenchOptions, bench};
pub use common::{
    Analysis, AnswerLevel, Averages, BestOfN, Calibration, CategoryStats, ConnectOptions, Curve,
    DataError, EvalError, GeneratorStats, Record, Records, Report, Row, RunStats, ScoredTrace,
    SelectorShare, SplitScore, Summary, ThresholdChoice, first_below, read_records, read_rows,
    records_from_bytes, render_html, render_markdown, rethreshold, sweep,
};
pub use eval::{CalibrateOptions, Calibrated, EvalOptions, EvalOutcome, calibrate, eval};
pub use label::{LabelOptions, LabelOutcome, label};
pub use score::{ScoreOptions, score};
pub use train::{Extraction, OwnThreshold, TrainError, TrainOptions, Trained, train_head};
