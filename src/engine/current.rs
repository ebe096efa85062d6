//! The evaluator a slot serves now: set once loaded, replaced whole by a reload. A request takes
//! its own handle (an `Arc`) when it starts, so it finishes on the evaluator it began with; the
//! one replaced is dropped when its last request ends.

use super::Evaluator;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// The evaluator, and how many times one was set: what a wrapper calibrated on it keys on.
#[derive(Default)]
pub(super) struct Current(RwLock<Option<Arc<dyn Evaluator>>>, AtomicU64);

impl Current {
    /// Counts the evaluators set so far: a swap moves it.
    pub(super) fn generation(&self) -> u64 {
        self.1.load(Ordering::Acquire)
    }

    pub(super) fn get(&self) -> Option<Arc<dyn Evaluator>> {
        // A panic while the lock is held cannot leave the Option half-written: read it anyway.
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Serves `evaluator` from now on; the one it replaces, if any.
    pub(super) fn set(&self, evaluator: Arc<dyn Evaluator>) -> Option<Arc<dyn Evaluator>> {
        let mut slot = self.0.write().unwrap_or_else(|e| e.into_inner());
        let before = slot.replace(evaluator);
        self.1.fetch_add(1, Ordering::AcqRel);
        before
    }
}
