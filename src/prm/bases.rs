//! The bases trained heads share: a head over a base that another head already holds (the same
//! checksum, dtype and device) reads only its own weights, so a reload that swaps one head for
//! the next, or a second head in the same config, does not load the base again. The loader
//! that builds a server's evaluators owns the `Bases` they share.

use super::candle;
use super::config::{Dtype, PrmConfig};
use super::head::HeadFolder;
use retrace_model::{ModelError, SharedBase};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

/// What makes two bases one: the checksum the head folder verified (weights, tokenizer,
/// template, config), and where and how it runs.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    sha256: String,
    dtype: Dtype,
    device: String,
    /// Bytes of its quantized matrices kept dequantized: a base loaded with another budget
    /// is another base.
    dequantized: usize,
}

/// Bases some head still holds, by what makes them one. Weak: a base goes when its last head
/// does.
#[derive(Debug, Default)]
pub(crate) struct Bases(Mutex<HashMap<Key, Weak<SharedBase>>>);

impl Bases {
    /// `head`'s base, run in `served` on `cfg`'s device: the one a head already holds, else
    /// loaded now. The second value says whether it was already loaded.
    pub(super) fn base_for(
        &self,
        head: &HeadFolder,
        cfg: &PrmConfig,
        served: Dtype,
    ) -> Result<(Arc<SharedBase>, bool), ModelError> {
        let key = Key {
            sha256: head.config.base_sha256.to_ascii_lowercase(),
            dtype: served,
            device: cfg.device().to_string(),
            dequantized: candle::dequantized(cfg),
        };
        // Held across the load: two heads on one base that load at once load it once, and loads
        // of bases follow one another, which also bounds the memory a burst of loads peaks at. A
        // panic mid-load leaves the map as it was, so a poisoned lock is still sound to use.
        let mut loaded = self.0.lock().unwrap_or_else(|p| p.into_inner());
        loaded.retain(|_, base| base.strong_count() > 0);
        if let Some(base) = loaded.get(&key).and_then(Weak::upgrade) {
            return Ok((base, true));
        }
        let base = Arc::new(candle::load_base(&head.base, cfg, served)?);
        loaded.insert(key, Arc::downgrade(&base));
        Ok((base, false))
    }
}

#[cfg(test)]
#[path = "bases_tests.rs"]
mod tests;
