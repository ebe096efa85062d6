//! # retrace-cli
//!
//! The tools of the `retrace` binary, apart from the server library so that the server links
//! none of their dependencies (anyhow, plotters, indicatif).
//!
//! # Layout
//! - `eval/` (`retrace eval`, `retrace calibrate`): datasets, the ProcessBench metric, the
//!   threshold sweep, reports.
//! - `label/` (`retrace label`): an evaluator's verdicts written as dataset rows, on eval's
//!   reader and runner.
//! - `bench/` (`retrace bench`): scoring speed against llama-server and the machine's peak.
//! - `score.rs` (`retrace score`): a client that prints verdicts as tables.
//! - `train/` (`retrace train-head`): a PRM head on a frozen decoder's features.
//! - `main.rs`: the command line; `alloc.rs`: the binary's allocator and its idle trim.

pub mod bench;
pub mod eval;
pub mod label;
pub mod score;
pub mod train;
