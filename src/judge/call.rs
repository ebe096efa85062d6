//! A judge's call: the temperature-0 response cache in front of the shared upstream caller
//! (limits, breaker, retries), and the chat reply read inside each attempt.

use super::cache::{self, ReplyCache};
use super::client::{Reply, read_reply};
use crate::metrics;
use crate::upstream::{CallError, CallPolicy, Caller as UpstreamCaller, Endpoint};
use serde_json::Value;
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex};
use tokio::time::Instant;

/// A reply, and whether it came from the cache (then no upstream request was made).
pub(super) struct Fetched {
    pub reply: Arc<Reply>,
    pub cached: bool,
}

pub(super) struct CachedCaller {
    judge: String,
    upstream: UpstreamCaller,
    cache: Option<Mutex<ReplyCache>>,
}

impl CachedCaller {
    /// `cache_entries` bounds the temperature-0 response cache; 0 turns it off.
    pub(super) fn new(
        judge: &str,
        endpoint: Endpoint,
        policy: CallPolicy,
        cache_entries: usize,
    ) -> CachedCaller {
        let cache = NonZeroUsize::new(cache_entries).map(|n| {
            // Exported from the start, so a dashboard shows an empty cache, not no data.
            metrics::set_judge_cache(judge, 0, 0);
            Mutex::new(ReplyCache::new(n, cache::MAX_BYTES))
        });
        CachedCaller {
            judge: judge.to_string(),
            upstream: UpstreamCaller::new(judge, &metrics::JUDGE_UPSTREAM, endpoint, policy),
            cache,
        }
    }

    /// Sends `body`, answering from the cache when `cacheable` (deterministic sampling) and the
    /// same body was answered before. Dropping the future cancels the exchange in progress.
    pub(super) async fn call(
        &self,
        body: &Value,
        cacheable: bool,
        deadline: Option<Instant>,
    ) -> Result<Fetched, CallError> {
        // The serialised body holds model, messages and every parameter: the whole cache key.
        let key = (cacheable && self.cache.is_some()).then(|| body.to_string());
        if let (Some(cache), Some(key)) = (&self.cache, &key) {
            let hit = lock(cache).get(key);
            metrics::record_judge_cache(&self.judge, hit.is_some());
            if let Some(reply) = hit {
                return Ok(Fetched {
                    reply,
                    cached: true,
                });
            }
        }
        let reply = self
            .upstream
            .call(body, deadline, |raw| {
                read_reply(raw.content_type.as_deref(), &raw.body)
            })
            .await?;
        let reply = Arc::new(reply);
        if let (Some(cache), Some(key)) = (&self.cache, key) {
            let mut cache = lock(cache);
            cache.put(key, reply.clone());
            metrics::set_judge_cache(&self.judge, cache.bytes(), cache.len());
        }
        Ok(Fetched {
            reply,
            cached: false,
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A cache is valid after any panic; at worst it misses.
    m.lock().unwrap_or_else(|e| e.into_inner())
}
