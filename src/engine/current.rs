//! The evaluator a slot serves now: set once loaded, replaced whole by a reload. A request takes
//! its own handle (an `Arc`) when it starts, so it finishes on the evaluator it began with; the
//! one replaced is dropped when its last request ends.

use super::Evaluator;
use std::sync::{Arc, RwLock};

#[derive(Default)]
pub(super) struct Current(RwLock<Option<Arc<dyn Evaluator>>>);

impl Current {
    pub(super) fn get(&self) -> Option<Arc<dyn Evaluator>> {
        // A panic while the lock is held cannot leave the Option half-written: read it anyway.
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Serves `evaluator` from now on; the one it replaces, if any.
    pub(super) fn set(&self, evaluator: Arc<dyn Evaluator>) -> Option<Arc<dyn Evaluator>> {
        let mut slot = self.0.write().unwrap_or_else(|e| e.into_inner());
        slot.replace(evaluator)
    }
}
