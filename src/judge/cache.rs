//! The temperature-0 reply cache: least recently used out first, bounded both by entries and by
//! bytes, so a few huge replies (or huge prompts, which are the keys) cannot hold the memory that
//! `cache_entries` small ones would.

use super::client::Reply;
use lru::LruCache;
use std::num::NonZeroUsize;
use std::sync::Arc;

/// Most bytes (keys plus replies' text) one judge's cache holds.
pub(super) const MAX_BYTES: usize = 64 << 20;

pub(super) struct ReplyCache {
    entries: LruCache<String, (Arc<Reply>, usize)>,
    bytes: usize,
    max_bytes: usize,
}

impl ReplyCache {
    pub(super) fn new(max_entries: NonZeroUsize, max_bytes: usize) -> Self {
        ReplyCache {
            entries: LruCache::new(max_entries),
            bytes: 0,
            max_bytes,
        }
    }

    pub(super) fn get(&mut self, key: &str) -> Option<Arc<Reply>> {
        self.entries.get(key).map(|(r, _)| r.clone())
    }

    /// Keeps `reply` under `key`, evicting the least recently used until both bounds hold; an
    /// entry larger than the whole byte budget is not kept at all.
    pub(super) fn put(&mut self, key: String, reply: Arc<Reply>) {
        let size = key.len() + reply.text_bytes();
        if size > self.max_bytes {
            return;
        }
        if let Some((_, old)) = self.entries.pop(&key) {
            self.bytes -= old;
        }
        while self.bytes + size > self.max_bytes {
            match self.entries.pop_lru() {
                Some((_, (_, old))) => self.bytes -= old,
                None => break,
            }
        }
        if let Some((_, (_, evicted))) = self.entries.push(key, (reply, size)) {
            self.bytes -= evicted;
        }
        self.bytes += size;
    }

    /// Bytes held: keys plus replies' text.
    pub(super) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::judge::client::Choice;

    fn reply(len: usize) -> Arc<Reply> {
        Arc::new(Reply {
            choices: vec![Choice {
                content: "x".repeat(len),
                ..Choice::default()
            }],
            prompt_tokens: 0,
            completion_tokens: 0,
        })
    }

    #[test]
    fn bytes_and_entries_both_bound_it() {
        let mut c = ReplyCache::new(NonZeroUsize::new(3).unwrap(), 100);
        c.put("a".into(), reply(29));
        c.put("b".into(), reply(29));
        c.put("c".into(), reply(29));
        assert_eq!((c.len(), c.bytes()), (3, 90));
        assert!(c.get("a").is_some(), "a is now the most recently used");
        // 90 + 30 > 100: the least recently used (b) goes.
        c.put("d".into(), reply(29));
        assert!(c.get("b").is_none());
        assert_eq!((c.len(), c.bytes()), (3, 90));
        // The entry bound evicts too, and its bytes are given back.
        c.put("e".into(), reply(4));
        assert_eq!(c.len(), 3);
        assert_eq!(c.bytes(), 65);
        // Replacing a key counts it once.
        c.put("e".into(), reply(9));
        assert_eq!(c.bytes(), 70);
    }

    #[test]
    fn an_entry_larger_than_the_budget_is_not_kept() {
        let mut c = ReplyCache::new(NonZeroUsize::new(8).unwrap(), 100);
        c.put("a".into(), reply(10));
        c.put("huge".into(), reply(500));
        assert!(c.get("huge").is_none());
        assert!(c.get("a").is_some(), "what was cached stays");
        assert_eq!(c.bytes(), 11);
    }
}
