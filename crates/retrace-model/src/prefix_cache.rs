//! The prefix cache a PRM's model thread owns: keys and values (every layer) and the last
//! layer's input, for token prefixes already computed, in a radix tree keyed by token ids, held
//! to a byte budget with least-recently-used eviction of leaves.
//!
//! Keyed by token ids, not text, so every family's format works unchanged: a trace re-sent with
//! one more step reuses everything up to the first token where the two differ. The last layer's
//! input is kept for every cached position because a head may read a position inside the cached
//! part (an earlier step's score): the last layer is then run for that position alone, over the
//! cached keys, and its score is computed, never remembered.

use candle_core::{Result, Tensor};
use std::collections::HashMap;
use std::sync::Arc;

/// What the cache holds for one run of tokens.
#[derive(Debug)]
pub(crate) struct Kv {
    /// Per layer, post-RoPE keys and values, (1, kv heads, tokens, head dim).
    pub(crate) k: Vec<Tensor>,
    pub(crate) v: Vec<Tensor>,
    /// The last layer's input (the residual stream after the layer before it), (tokens, hidden).
    pub(crate) x: Tensor,
}

impl Kv {
    fn bytes(&self) -> usize {
        let size = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        self.k.iter().chain(&self.v).map(size).sum::<usize>() + size(&self.x)
    }

    /// Tokens `start..start + len` of this run, copied (a view would keep the whole run alive).
    pub(crate) fn slice(&self, start: usize, len: usize) -> Result<Kv> {
        let cut = |t: &Tensor| owned(&t.narrow(2, start, len)?);
        Ok(Kv {
            k: self.k.iter().map(cut).collect::<Result<_>>()?,
            v: self.v.iter().map(cut).collect::<Result<_>>()?,
            x: owned(&self.x.narrow(0, start, len)?)?,
        })
    }

    /// The bytes its tensors' storage really holds, which `bytes` must equal: a tensor that is
    /// a view into a larger one keeps all of that alive, uncounted.
    #[cfg(test)]
    pub(crate) fn held_bytes(&self) -> usize {
        self.k
            .iter()
            .chain(&self.v)
            .chain([&self.x])
            .map(storage_bytes)
            .sum()
    }
}

/// A copy of `view` holding its elements only. Neither `contiguous` nor `copy` will do for
/// the cache: a narrow along the outermost non-unit dimension is already contiguous, so
/// `contiguous` returns the view itself, and candle's `copy` clones the whole storage.
pub(crate) fn owned(view: &Tensor) -> Result<Tensor> {
    view.force_contiguous()
}

/// Bytes of the storage behind `t` (CPU tensors; the tests' check of `owned`).
#[cfg(test)]
pub(crate) fn storage_bytes(t: &Tensor) -> usize {
    use candle_core::{CpuStorage, Storage};
    let (storage, _) = t.storage_and_layout();
    let elems = match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => v.len(),
        Storage::Cpu(CpuStorage::F16(v)) => v.len(),
        Storage::Cpu(CpuStorage::BF16(v)) => v.len(),
        other => panic!("storage_bytes: {:?} storage", other.dtype()),
    };
    elems * t.dtype().size_in_bytes()
}

/// A cached run a batch reads: positions `pos..pos + len`, at `offset` in `kv`.
#[derive(Debug, Clone)]
pub(crate) struct Piece {
    pub(crate) kv: Arc<Kv>,
    pub(crate) offset: usize,
    pub(crate) pos: usize,
    pub(crate) len: usize,
}

/// The longest cached prefix of a row.
#[derive(Debug, Default, Clone)]
pub(crate) struct Hit {
    pub(crate) pieces: Vec<Piece>,
    /// Tokens of the row covered, from position 0.
    pub(crate) len: usize,
}

const ROOT: usize = 0;

struct Node {
    tokens: Vec<u32>,
    kv: Option<Arc<Kv>>,
    parent: usize,
    children: HashMap<u32, usize>,
    last_used: u64,
    /// Batches reading this node now: it is not evicted while pinned.
    pins: u32,
    bytes: usize,
}

/// Counters since the cache was made.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(crate) struct Stats {
    pub(crate) evictions: u64,
}

pub(crate) struct PrefixCache {
    nodes: Vec<Option<Node>>,
    free: Vec<usize>,
    budget: usize,
    bytes: usize,
    clock: u64,
    stats: Stats,
}

impl PrefixCache {
    /// An empty cache that holds at most `budget` bytes.
    pub(crate) fn new(budget: usize) -> Self {
        let root = Node {
            tokens: Vec::new(),
            kv: None,
            parent: ROOT,
            children: HashMap::new(),
            last_used: 0,
            pins: 0,
            bytes: 0,
        };
        PrefixCache {
            nodes: vec![Some(root)],
            free: Vec::new(),
            budget,
            bytes: 0,
            clock: 0,
            stats: Stats::default(),
        }
    }

    pub(crate) fn budget(&self) -> usize {
        self.budget
    }

    /// Bytes held now.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    pub(crate) fn stats(&self) -> Stats {
        self.stats
    }

    fn node(&self, id: usize) -> &Node {
        self.nodes[id].as_ref().expect("live node")
    }

    fn node_mut(&mut self, id: usize) -> &mut Node {
        self.nodes[id].as_mut().expect("live node")
    }

    /// The bytes the cached tensors' storage holds (see `Kv::held_bytes`).
    #[cfg(test)]
    pub(crate) fn held_bytes(&self) -> usize {
        let kvs = self.nodes.iter().flatten().filter_map(|n| n.kv.as_ref());
        kvs.map(|kv| kv.held_bytes()).sum()
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The longest cached prefix of `tokens`; its nodes are pinned (see `unpin`) and touched.
    pub(crate) fn lookup(&mut self, tokens: &[u32]) -> (Hit, Vec<usize>) {
        let now = self.tick();
        let (mut hit, mut pinned) = (Hit::default(), Vec::new());
        for (child, pos, len) in self.walk(tokens) {
            let node = self.node_mut(child);
            node.last_used = now;
            node.pins += 1;
            pinned.push(child);
            hit.pieces.push(Piece {
                kv: node.kv.clone().expect("only the root has no kv"),
                offset: 0,
                pos,
                len,
            });
            hit.len = pos + len;
        }
        (hit, pinned)
    }

    /// How many of `tokens`' first tokens are cached: what `lookup` would find, without pinning
    /// or touching anything.
    pub(crate) fn cached_len(&self, tokens: &[u32]) -> usize {
        self.walk(tokens)
            .last()
            .map_or(0, |&(_, pos, len)| pos + len)
    }

    /// The nodes `tokens`' longest cached prefix runs through from the root: each node, where
    /// it starts in `tokens` and how many of its tokens match (all but maybe the last's).
    fn walk(&self, tokens: &[u32]) -> Vec<(usize, usize, usize)> {
        let (mut path, mut pos, mut at) = (Vec::new(), 0, ROOT);
        while let Some(&child) = tokens.get(pos).and_then(|t| self.node(at).children.get(t)) {
            let node = self.node(child);
            let common = common_prefix(&node.tokens, &tokens[pos..]);
            path.push((child, pos, common));
            pos += common;
            if common < node.tokens.len() {
                break;
            }
            at = child;
        }
        path
    }

    /// Releases the pins a `lookup` took.
    pub(crate) fn unpin(&mut self, pinned: &[usize]) {
        for &id in pinned {
            if let Some(Some(node)) = self.nodes.get_mut(id) {
                node.pins = node.pins.saturating_sub(1);
            }
        }
    }

    /// Adds `kv` for `tokens[from..]`, whose prefix `tokens[..from]` must be cached (earlier in
    /// the same batch, or pinned since its lookup). Tokens already present are skipped (their
    /// slice of `kv` is dropped); a node the new run diverges from inside is split there.
    /// Returns false, adding nothing, when the prefix is not cached.
    pub(crate) fn insert(&mut self, tokens: &[u32], from: usize, kv: Kv) -> Result<bool> {
        let now = self.tick();
        let (mut at, mut pos) = (ROOT, 0);
        // Walk as far as the tree matches, at most to the end of `tokens`.
        while pos < tokens.len() {
            let Some(&child) = self.node(at).children.get(&tokens[pos]) else {
                break;
            };
            let common = common_prefix(&self.node(child).tokens, &tokens[pos..]);
            self.node_mut(child).last_used = now;
            if common < self.node(child).tokens.len() {
                if pos + common < from {
                    return Ok(false);
                }
                at = self.split(child, common)?;
                pos += common;
                break;
            }
            pos += common;
            at = child;
        }
        if pos < from {
            return Ok(false);
        }
        if pos == tokens.len() {
            return Ok(true);
        }
        let kv = match pos - from {
            0 => kv,
            skip => kv.slice(skip, tokens.len() - pos)?,
        };
        let bytes = kv.bytes();
        let node = Node {
            tokens: tokens[pos..].to_vec(),
            kv: Some(Arc::new(kv)),
            parent: at,
            children: HashMap::new(),
            last_used: now,
            pins: 0,
            bytes,
        };
        let id = self.alloc(node);
        self.node_mut(at).children.insert(tokens[pos], id);
        self.bytes += bytes;
        Ok(true)
    }

    /// Stores `node` in a free slot, or a new one.
    fn alloc(&mut self, node: Node) -> usize {
        match self.free.pop() {
            Some(id) => {
                self.nodes[id] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        }
    }

    /// Splits node `id` after `at` tokens: a new parent holds the first `at`, `id` keeps the
    /// rest (so pins on `id` stay on its part). Returns the new parent.
    fn split(&mut self, id: usize, at: usize) -> Result<usize> {
        let (head_kv, tail_kv, tokens, parent, last_used) = {
            let node = self.node(id);
            let kv = node.kv.as_ref().expect("only the root has no kv");
            let n = node.tokens.len();
            (
                kv.slice(0, at)?,
                kv.slice(at, n - at)?,
                node.tokens.clone(),
                node.parent,
                node.last_used,
            )
        };
        let old_bytes = self.node(id).bytes;
        let (head_bytes, tail_bytes) = (head_kv.bytes(), tail_kv.bytes());
        let head = Node {
            tokens: tokens[..at].to_vec(),
            kv: Some(Arc::new(head_kv)),
            parent,
            children: HashMap::from([(tokens[at], id)]),
            last_used,
            pins: 0,
            bytes: head_bytes,
        };
        let head_id = self.alloc(head);
        let node = self.node_mut(id);
        node.tokens.drain(..at);
        node.kv = Some(Arc::new(tail_kv));
        node.parent = head_id;
        node.bytes = tail_bytes;
        self.node_mut(parent).children.insert(tokens[0], head_id);
        self.bytes = self.bytes - old_bytes + head_bytes + tail_bytes;
        Ok(head_id)
    }

    /// Evicts least recently used leaves (never a pinned one) until at most `target` bytes are
    /// held or nothing more can go. Returns the bytes freed.
    pub(crate) fn evict_to(&mut self, target: usize) -> usize {
        let before = self.bytes;
        while self.bytes > target {
            let victim = self
                .nodes
                .iter()
                .enumerate()
                .skip(1)
                .filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
                .filter(|(_, n)| n.children.is_empty() && n.pins == 0)
                .min_by_key(|(_, n)| n.last_used)
                .map(|(i, _)| i);
            let Some(id) = victim else { break };
            let node = self.nodes[id].take().expect("live node");
            let first = node.tokens[0];
            self.node_mut(node.parent).children.remove(&first);
            self.bytes -= node.bytes;
            self.free.push(id);
            self.stats.evictions += 1;
        }
        before - self.bytes
    }

    /// Cached runs, for tests: each node's tokens, depth first.
    #[cfg(test)]
    fn runs(&self) -> Vec<Vec<u32>> {
        let mut out = Vec::new();
        let mut stack = vec![ROOT];
        while let Some(id) = stack.pop() {
            let node = self.node(id);
            if id != ROOT {
                out.push(node.tokens.clone());
            }
            let mut kids: Vec<_> = node.children.values().copied().collect();
            kids.sort();
            stack.extend(kids);
        }
        out.sort();
        out
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A run whose every value is its position, so slices can be checked.
    fn kv(from: usize, len: usize) -> Kv {
        let dev = Device::Cpu;
        let pos: Vec<f32> = (from..from + len).map(|p| p as f32).collect();
        let t = Tensor::from_vec(pos.clone(), (1, 1, len, 1), &dev).unwrap();
        Kv {
            k: vec![t.clone()],
            v: vec![t],
            x: Tensor::from_vec(pos, (len, 1), &dev).unwrap(),
        }
    }

    fn values(p: &Piece) -> Vec<f32> {
        p.kv.x
            .narrow(0, p.offset, p.len)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    #[test]
    fn inserts_splits_and_finds_the_longest_prefix() {
        let mut c = PrefixCache::new(1 << 20);
        let a: Vec<u32> = (0..10).collect();
        assert!(c.insert(&a, 0, kv(0, 10)).unwrap());
        let mut b = a.clone();
        b[6] = 99;
        b.push(7);
        // b's first six tokens are cached: insert the rest; the node splits at 6.
        let (hit, pins) = c.lookup(&b);
        assert_eq!(hit.len, 6);
        assert!(c.insert(&b, 6, kv(6, 5)).unwrap());
        c.unpin(&pins);
        assert_eq!(
            c.runs(),
            vec![
                vec![0, 1, 2, 3, 4, 5],
                vec![6, 7, 8, 9],
                vec![99, 7, 8, 9, 7]
            ]
        );
        let (hit, pins) = c.lookup(&b);
        assert_eq!(hit.len, 11);
        let got: Vec<f32> = hit.pieces.iter().flat_map(values).collect();
        assert_eq!(got, (0..11).map(|p| p as f32).collect::<Vec<_>>());
        c.unpin(&pins);
        // Both halves of the split own their tokens only: the budget counts what is held.
        assert_eq!(c.held_bytes(), c.bytes());
        // Re-inserting what is there adds nothing; an uncached prefix is refused.
        let before = c.bytes();
        assert!(c.insert(&a, 0, kv(0, 10)).unwrap());
        assert_eq!(c.bytes(), before);
        assert!(!c.insert(&[5, 5, 5], 2, kv(2, 1)).unwrap());
        // A partial overlap inserts only the new tail.
        let mut d = a.clone();
        d.push(42);
        assert!(c.insert(&d, 3, kv(3, 8)).unwrap());
        assert_eq!(c.lookup(&d).0.len, 11);
    }

    #[test]
    fn evicts_least_recently_used_unpinned_leaves() {
        let mut c = PrefixCache::new(1 << 20);
        let per_token = kv(0, 1).bytes();
        let rows: Vec<Vec<u32>> = (0..3).map(|r| vec![r, r, r, r]).collect();
        for r in &rows {
            c.insert(r, 0, kv(0, 4)).unwrap();
        }
        assert_eq!(c.bytes(), 12 * per_token);
        let (_, pinned) = c.lookup(&rows[0]);
        let (_, touched) = c.lookup(&rows[1]);
        c.unpin(&touched);
        let freed = c.evict_to(4 * per_token);
        // Row 2 is the least recently used; row 0 is pinned; row 1 goes next.
        assert_eq!(freed, 8 * per_token);
        assert_eq!(c.runs(), vec![vec![0, 0, 0, 0]]);
        assert_eq!(c.stats().evictions, 2);
        // Pinned: nothing more can go.
        assert_eq!(c.evict_to(0), 0);
        c.unpin(&pinned);
        assert_eq!(c.evict_to(0), 4 * per_token);
        assert_eq!(c.bytes(), 0);
        assert!(c.runs().is_empty());
    }
}
