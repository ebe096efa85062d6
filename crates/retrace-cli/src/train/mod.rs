//! `retrace train-head`: a PRM head on a frozen decoder: features at each step's read position
//! (through the server's own formatting), cached on disk; a logistic (or MLP) step head and a
//! category head trained on them; the threshold calibrated on dev; the head folder written.
//!
//! - `data`: labelled traces, step targets, the train/dev split by question.
//! - `head` (the heads as candle variables), `fit` (the training loop), `select` (taps, head
//!   kind, threshold and category head, each decided on dev).
//! - `checksum`: SHA-256 of files and keys.

mod cache;
mod checksum;
mod choose;
mod cli;
mod data;
mod extract;
mod fit;
mod head;
mod output;
mod progress;
mod report;
mod select;
mod taps;
#[cfg(test)]
mod tests;

pub use cli::{TrainOptions, Trained, train_head};
pub use extract::Extraction;
pub use select::OwnThreshold;

use crate::common::DataError;

/// Every way `train-head` fails.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A row of a data file is bad: names the file and line.
    #[error(transparent)]
    Data(#[from] DataError),
    /// An option or the data make the request impossible: names the option.
    #[error("{0}")]
    Usage(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    /// Training itself failed (a tensor operation).
    #[error("training: {0}")]
    Model(#[from] candle_core::Error),
}
