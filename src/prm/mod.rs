//! Process reward models on candle: checkpoint loading, the decoder, heads, per-family input
//! formatting, and the batching model thread.

mod decoder;
mod head;
pub mod model;
mod model_config;

use crate::config::{EvaluatorConfig, ServerConfig};
use crate::engine::{EngineError, Evaluator};
use std::sync::Arc;

/// Loads the PRM an `[[evaluator]]` table describes.
pub fn load(
    cfg: &EvaluatorConfig,
    _server: &ServerConfig,
) -> Result<Arc<dyn Evaluator>, EngineError> {
    Err(EngineError::Unavailable(format!(
        "evaluator {:?}: PRM loading is not built yet",
        cfg.name
    )))
}
