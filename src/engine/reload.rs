//! Reloading a PRM while the server runs (the admin call and SIGHUP): its table is loaded again
//! beside the one serving, and swapped in only once it is whole. Requests that started on the
//! old one finish on it; a model that fails to load is refused with the reason, and the old one
//! serves on.

use super::registry::{Engine, Reloader};
use super::{EngineError, Evaluator};
use crate::field::FieldPath;
use crate::metrics;
use std::sync::Arc;
use std::time::Instant;

/// A swap that happened.
#[derive(Debug, Clone, PartialEq)]
pub struct Reloaded {
    pub evaluator: String,
    /// The new evaluator's model, as ListEvaluators describes it.
    pub model: String,
    pub seconds: f64,
}

impl Engine {
    /// Loads `requested` again and swaps it in; see the module's doc. Reloads run one at a
    /// time.
    pub async fn reload(&self, requested: &str) -> Result<Reloaded, EngineError> {
        let name = self.resolve_name(requested)?.to_string();
        let slot = self.slot_of(&name);
        let still_loading = || EngineError::Unavailable("the evaluators are still loading".into());
        let current = slot.evaluator.get().ok_or_else(still_loading)?;
        let kind = current.describe().kind;
        if kind != "prm" {
            return Err(EngineError::invalid(
                FieldPath::key("evaluator"),
                format!(
                    "{name:?} is a {kind}: only a prm is reloaded (a trained head, or a \
                     checkpoint whose folder changed); a cascade over it follows its swap"
                ),
            ));
        }
        let reloader = self.reloader.lock().await;
        let Some(Reloader { loader, loaded }) = reloader.as_ref() else {
            return Err(still_loading());
        };
        let (loader, loaded, owned) = (loader.clone(), loaded.clone(), name.clone());
        let started = Instant::now();
        let built = tokio::task::spawn_blocking(move || loader(&owned, &loaded))
            .await
            .map_err(|e| format!("loading panicked: {e}"))
            .and_then(|r| r.map_err(|e| e.to_string()));
        let new: Arc<dyn Evaluator> = match built {
            Ok(e) => e,
            Err(reason) => {
                metrics::record_reload(&name, "refused");
                tracing::warn!(evaluator = %name, %reason, "reload refused; the loaded one serves on");
                return Err(EngineError::Refused(format!(
                    "reloading evaluator {name:?}: {reason}; the one loaded serves on"
                )));
            }
        };
        let model = new.describe().model;
        metrics::set_ready(&name, new.ready());
        // The old one goes when the last request that holds it ends.
        drop(slot.serve(new));
        self.swapped();
        let seconds = started.elapsed().as_secs_f64();
        metrics::record_reload(&name, "swapped");
        tracing::info!(evaluator = %name, %model, seconds, "evaluator reloaded");
        Ok(Reloaded {
            evaluator: name,
            model,
            seconds,
        })
    }

    /// Every evaluator a reload takes: the PRMs.
    pub(crate) fn reloadable(&self) -> Vec<String> {
        self.list()
            .into_iter()
            .filter(|s| s.description.kind == "prm")
            .map(|s| s.name)
            .collect()
    }
}
