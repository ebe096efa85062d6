//! The crate's one error type: what loading a checkpoint or scoring a batch can fail with.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("missing file {}", .0.display())]
    MissingFile(PathBuf),
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: bad `{key}`: {reason}", path.display())]
    BadConfig {
        path: PathBuf,
        key: String,
        reason: String,
    },
    /// A GGUF file's tokenizer can't be rebuilt from its metadata.
    #[error("{}: {reason}", path.display())]
    Tokenizer { path: PathBuf, reason: String },
    /// A trained head's weights file is unusable: a tensor missing, misshapen or not finite.
    #[error("{}: {reason}", path.display())]
    Head { path: PathBuf, reason: String },
    #[error("bad input: {0}")]
    BadInput(String),
    /// A lock a panicking thread held: what it guards may be half-written, so it is not used.
    #[error("{0} was poisoned by a panic")]
    Poisoned(&'static str),
    #[error("device {name:?}: {reason}")]
    Device { name: String, reason: String },
    #[error("candle: {0}")]
    Candle(#[from] candle_core::Error),
}
