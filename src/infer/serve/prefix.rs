//! The prefix cache: keys and values of the sequences the server has run (prompts once
//! prefilled, whole conversations once answered), in a radix tree of token runs, so that
//! sequences with a common start (a system prompt, the earlier turns of a chat) share one copy of
//! it. A new request reads the longest cached start of its prompt in place (its slot holds only
//! what follows, [`KvCache::share`]) and prefills only the rest: nothing is copied, and every
//! sequence reads the one copy. A run leaves the cache when evicted, and memory when the last
//! sequence reading it ends (within what the key/value pool, counted at full size, would have held
//! had those sequences copied it). When the bytes held pass the bound, the least recently used
//! leaves go first (kept in order, so each eviction costs O(log n)); a run larger than the whole
//! bound is not kept at all, so that one long prompt cannot flush what everyone else shares.
//!
//! A key or value depends only on the tokens up to its position, so a reused one is the number a
//! fresh prefill would compute, up to rounding: the engine picks its matrix and attention kernels
//! by the shape of a pass (one row or many), and a token decoded alone rounds differently in the
//! last bits from one prefilled among others, as a request alone or in a batch already does.

use crate::model::decode::{KvCache, KvRun};
use anyhow::Result;
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

pub struct PrefixCache {
    /// The tree's nodes; index 0 is the root (no tokens). Removed nodes leave `None`.
    nodes: Vec<Option<Node>>,
    free: Vec<usize>,
    /// Bytes of keys and values held, and the most that may be.
    bytes: usize,
    limit: usize,
    /// Ticks at every lookup and insertion: a node's `used` is the last tick that read it.
    clock: u64,
    /// The nodes without children (but the root), by when they were last used: the next to
    /// evict first.
    leaves: BTreeSet<(u64, usize)>,
}

/// A run of tokens that continues its parent's, with the run's keys and values.
struct Node {
    tokens: Vec<u32>,
    kv: Arc<KvRun>,
    parent: usize,
    /// By the first token of their run (runs of siblings start with different tokens).
    children: HashMap<u32, usize>,
    used: u64,
}

impl PrefixCache {
    /// An empty cache holding at most `limit` bytes (0: nothing is ever kept).
    pub fn new(limit: usize) -> PrefixCache {
        let root = Node {
            tokens: Vec::new(),
            kv: Arc::default(),
            parent: 0,
            children: HashMap::new(),
            used: 0,
        };
        let nodes = vec![Some(root)];
        PrefixCache { nodes, free: Vec::new(), bytes: 0, limit, clock: 0, leaves: BTreeSet::new() }
    }

    /// Bytes of keys and values held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// How many tokens of `prompt` [`Self::load`] would reuse.
    pub fn reusable(&self, prompt: &[u32]) -> usize {
        self.walk(usable(prompt)).iter().map(|&(_, n)| n).sum()
    }

    /// Starts the (empty) sequence in `slot` with the keys and values of the longest cached
    /// start of `prompt` but its last token (whose logits are needed), read in place; returns
    /// its length.
    pub fn load(&mut self, prompt: &[u32], cache: &mut KvCache, slot: usize) -> Result<usize> {
        debug_assert_eq!(cache.len(slot), 0);
        self.clock += 1;
        let (clock, mut loaded) = (self.clock, 0);
        for (id, n) in self.walk(usable(prompt)) {
            self.touch(id, clock);
            cache.share(slot, &self.node(id).kv, n)?;
            loaded += n;
        }
        Ok(loaded)
    }

    /// Keeps the keys and values of `tokens`, the start of the sequence `slot` holds, then
    /// evicts down to the bound. The part not cached yet is not kept if it alone is larger than
    /// the bound.
    pub fn insert(&mut self, tokens: &[u32], cache: &KvCache, slot: usize) {
        if self.limit == 0 {
            return;
        }
        let path = self.walk(tokens);
        let held: usize = path.iter().map(|&(_, n)| n).sum();
        let new = tokens.len() - held;
        if new > 0 && cache.run_bytes(new) > self.limit {
            return;
        }
        self.clock += 1;
        let mut parent = 0;
        for (id, n) in path {
            // A run that the new tokens leave part-way is cut there, unless nothing follows.
            if n < self.node(id).tokens.len() && new > 0 {
                self.split(id, n);
            }
            self.touch(id, self.clock);
            parent = id;
        }
        if new == 0 {
            return;
        }
        let kv = Arc::new(cache.copy_out(slot, held..tokens.len()));
        self.bytes += kv.bytes();
        let node = Node {
            tokens: tokens[held..].to_vec(),
            kv,
            parent,
            children: HashMap::new(),
            used: self.clock,
        };
        let first = node.tokens[0];
        let id = self.add(node);
        self.adopt(parent, first, id);
        self.evict();
    }

    /// Marks node `id` used at `tick`, keeping the order of the leaves.
    fn touch(&mut self, id: usize, tick: u64) {
        let node = self.node_mut(id);
        let (old, leaf) = (node.used, node.children.is_empty());
        node.used = tick;
        if leaf && self.leaves.remove(&(old, id)) {
            self.leaves.insert((tick, id));
        }
    }

    /// Makes `child` (whose run starts with `first`) a child of `parent`, which stops being a
    /// leaf.
    fn adopt(&mut self, parent: usize, first: u32, child: usize) {
        let p = self.node_mut(parent);
        let was_leaf = p.children.is_empty();
        let used = p.used;
        p.children.insert(first, child);
        if was_leaf {
            self.leaves.remove(&(used, parent));
        }
    }

    /// The nodes along the cached start of `tokens`, each with how many of its tokens match
    /// (all but possibly the last node's).
    fn walk(&self, tokens: &[u32]) -> Vec<(usize, usize)> {
        let (mut path, mut at, mut id) = (Vec::new(), 0, 0);
        while let Some(&first) = tokens.get(at) {
            let Some(&child) = self.node(id).children.get(&first) else { break };
            let run = &self.node(child).tokens;
            let n = run.iter().zip(&tokens[at..]).take_while(|(a, b)| a == b).count();
            path.push((child, n));
            at += n;
            if n < run.len() {
                break;
            }
            id = child;
        }
        path
    }

    /// Cuts node `id` after its first `at` tokens: the rest, with the node's children, becomes
    /// its only child.
    fn split(&mut self, id: usize, at: usize) {
        let node = self.node_mut(id);
        // New runs for both halves: sequences reading the node's run keep it as it is.
        let (head, tail) = node.kv.split(at);
        node.kv = Arc::new(head);
        let tail = Node {
            tokens: node.tokens.split_off(at),
            kv: Arc::new(tail),
            parent: id,
            children: std::mem::take(&mut node.children),
            used: node.used,
        };
        let (first, grandchildren) = (tail.tokens[0], tail.children.clone());
        let tail_id = self.add(tail);
        for c in grandchildren.into_values() {
            self.node_mut(c).parent = tail_id;
        }
        // The tail took the node's place among the leaves, if it was one (`add`).
        let used = self.node(id).used;
        self.leaves.remove(&(used, id));
        self.node_mut(id).children.insert(first, tail_id);
    }

    /// Removes least recently used leaves until the bytes held are within the bound; a parent
    /// left without children becomes a leaf in its turn.
    fn evict(&mut self) {
        while self.bytes > self.limit {
            let Some((_, id)) = self.leaves.pop_first() else { break };
            let node = self.nodes[id].take().expect("a live node");
            self.bytes -= node.kv.bytes();
            self.free.push(id);
            let parent = self.node_mut(node.parent);
            parent.children.remove(&node.tokens[0]);
            if parent.children.is_empty() && node.parent != 0 {
                let used = parent.used;
                self.leaves.insert((used, node.parent));
            }
        }
    }

    /// Stores `node`, among the leaves if it has no children, and returns its id.
    fn add(&mut self, node: Node) -> usize {
        let used = node.used;
        let leaf = node.children.is_empty();
        let id = match self.free.pop() {
            Some(id) => {
                self.nodes[id] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        };
        if leaf {
            self.leaves.insert((used, id));
        }
        id
    }

    /// Asserts that `leaves` lists exactly the live nodes without children (but the root), each
    /// with its last use.
    #[cfg(test)]
    fn check_leaves(&self) {
        let want: BTreeSet<(u64, usize)> = (1..self.nodes.len())
            .filter_map(|i| self.nodes[i].as_ref().map(|n| (i, n)))
            .filter(|(_, n)| n.children.is_empty())
            .map(|(i, n)| (n.used, i))
            .collect();
        assert_eq!(self.leaves, want);
        let bytes: usize = self.nodes.iter().flatten().map(|n| n.kv.bytes()).sum();
        assert_eq!(self.bytes, bytes);
    }

    fn node(&self, id: usize) -> &Node {
        self.nodes[id].as_ref().expect("a live node")
    }

    fn node_mut(&mut self, id: usize) -> &mut Node {
        self.nodes[id].as_mut().expect("a live node")
    }
}

/// The part of a prompt that may come from the cache: all but the last token, which is run to
/// give the logits of the next.
fn usable(prompt: &[u32]) -> &[u32] {
    &prompt[..prompt.len().saturating_sub(1)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Config, Model, ResidualKind};

    const CONTEXT: usize = 160;

    /// A small Block AttnRes model with every weight perturbed (nonzero pseudo-queries, so the
    /// depth attention is no plain average).
    fn model() -> Model {
        let c = Config {
            vocab_size: 50,
            hidden_size: 32,
            intermediate_size: 48,
            num_hidden_layers: 3,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 8,
            max_position_embeddings: CONTEXT,
            residual: ResidualKind::Block,
            num_blocks: 2,
            ..Config::default()
        };
        let mut m = Model::init(c, 3).unwrap();
        for (i, p) in m.params.iter_mut().enumerate() {
            *p += 0.2 * ((i as f32 * 0.618).fract() - 0.5);
        }
        m
    }

    /// `n` tokens starting with `first`, none of them equal to `first` after it.
    fn run(first: u32, n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| if i == 0 { first } else { (first + 1 + i * 7) % 50 }).collect()
    }

    /// Bytes of keys and values per cached token of [`model`].
    const PER_TOKEN: usize = 2 * 3 * 2 * 8 * 4;

    #[test]
    fn a_reused_start_gives_the_logits_of_a_whole_prefill() {
        let m = model();
        let whole = |p: &[u32]| {
            let mut c = KvCache::new(&m.config, 1, CONTEXT).unwrap();
            m.decode(&mut c, &[(0, p)], false).unwrap()
        };
        let mut cache = KvCache::new(&m.config, 2, CONTEXT).unwrap();
        let mut prefix = PrefixCache::new(usize::MAX);
        let system = run(3, 40);
        let a = [&system[..], &[1, 2, 3, 4, 5]].concat();
        m.decode(&mut cache, &[(0, &a)], false).unwrap();
        prefix.insert(&a, &cache, 0);
        // Parting inside a cached run (which splits it), continuing a cached prompt, the same
        // prompt again (its last token is always run), and nothing in common.
        let b = [&system[..30], &[9, 8, 7, 6]].concat();
        let c = [&a[..], &[11, 12, 13]].concat();
        let d = run(4, 6);
        for (p, reused) in [(&b, 30), (&c, 45), (&a, 44), (&d, 0)] {
            cache.clear(1);
            let n = prefix.load(p, &mut cache, 1).unwrap();
            assert_eq!((n, prefix.reusable(p)), (reused, reused));
            let got = m.decode(&mut cache, &[(1, &p[n..])], false).unwrap();
            // Kernels chosen by the pass's shape round differently (the module's note).
            let want = whole(p);
            let scale = want.iter().fold(0f32, |a, x| a.max(x.abs()));
            for (x, y) in got.iter().zip(&want) {
                assert!((x - y).abs() <= 1e-5 * scale, "{n} of {} reused: {x} vs {y}", p.len());
            }
            prefix.insert(p, &cache, 1);
        }
        // Each distinct token is held once: a's 45, b's last 4, c's last 3, d's 6.
        assert_eq!(prefix.bytes(), (45 + 4 + 3 + 6) * PER_TOKEN);

        // A slot reads its reused start in place; keeping its sequence copies that start too
        // (the runs it reads may have left the cache by then): another cache, given c from
        // slot 1, serves c to slot 0 as a whole prefill would.
        cache.clear(1);
        let n = prefix.load(&c, &mut cache, 1).unwrap();
        m.decode(&mut cache, &[(1, &c[n..])], false).unwrap();
        let mut other = PrefixCache::new(usize::MAX);
        other.insert(&c, &cache, 1);
        assert_eq!(other.bytes(), c.len() * PER_TOKEN);
        cache.clear(0);
        let n = other.load(&c, &mut cache, 0).unwrap();
        assert_eq!(n, c.len() - 1);
        let got = m.decode(&mut cache, &[(0, &c[n..])], false).unwrap();
        let want = whole(&c);
        let scale = want.iter().fold(0f32, |a, x| a.max(x.abs()));
        for (x, y) in got.iter().zip(&want) {
            assert!((x - y).abs() <= 1e-5 * scale, "from a copied shared start: {x} vs {y}");
        }
    }

    #[test]
    fn the_least_recently_used_leaves_go_first_within_the_bound() {
        let m = model();
        let mut cache = KvCache::new(&m.config, 1, CONTEXT).unwrap();
        let mut prefix = PrefixCache::new(100 * PER_TOKEN);
        let mut fill = |prefix: &mut PrefixCache, p: &[u32]| {
            cache.clear(0);
            m.decode(&mut cache, &[(0, p)], false).unwrap();
            prefix.insert(p, &cache, 0);
        };
        let (p1, p2, p3) = (run(1, 40), run(2, 40), run(3, 40));
        fill(&mut prefix, &p1);
        fill(&mut prefix, &p2);
        assert_eq!(prefix.bytes(), 80 * PER_TOKEN);
        // Reading p1 makes p2 the least recently used: p3 pushes it out.
        let mut other = KvCache::new(&m.config, 1, CONTEXT).unwrap();
        prefix.load(&p1, &mut other, 0).unwrap();
        fill(&mut prefix, &p3);
        assert_eq!(prefix.bytes(), 80 * PER_TOKEN);
        assert_eq!([&p1, &p2, &p3].map(|p| prefix.reusable(p)), [39, 0, 39]);
        // A prompt sharing p3's start splits it; the leaves are p1, p3's rest and the new one,
        // of which p1 is the oldest.
        let p4 = [&p3[..20], &run(5, 30)[..]].concat();
        fill(&mut prefix, &p4);
        assert_eq!(prefix.bytes(), 70 * PER_TOKEN);
        assert_eq!([&p1, &p3, &p4].map(|p| prefix.reusable(p)), [0, 39, 49]);
        // A prompt whose new part is beyond the bound is not kept, and pushes out nothing.
        fill(&mut prefix, &run(6, 120));
        assert_eq!(prefix.bytes(), 70 * PER_TOKEN);
        assert_eq!([&p3, &p4, &run(6, 120)].map(|p| prefix.reusable(p)), [39, 49, 0]);
        // Its start within the bound is kept when it comes again alone.
        fill(&mut prefix, &run(6, 100));
        assert_eq!(prefix.reusable(&run(6, 120)), 100);
        prefix.check_leaves();
        // Off: nothing is kept.
        let mut off = PrefixCache::new(0);
        fill(&mut off, &p1);
        assert_eq!((off.bytes(), off.reusable(&p1)), (0, 0));
    }

    /// Random prompts sharing starts, loaded and inserted under a tight bound: after every
    /// step the ordered leaves are exactly the childless nodes (what a scan of every node would
    /// pick from), the bytes add up, and the bound holds.
    #[test]
    fn the_ordered_leaves_follow_every_change() {
        let m = model();
        let mut cache = KvCache::new(&m.config, 1, CONTEXT).unwrap();
        let mut prefix = PrefixCache::new(150 * PER_TOKEN);
        let mut x = 7u64;
        let mut next = |n: u64| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (x >> 33) % n
        };
        let stems: Vec<Vec<u32>> = (0..4).map(|i| run(i as u32 * 11 + 1, 30)).collect();
        for _ in 0..60 {
            let stem = &stems[next(4) as usize][..next(30) as usize + 1];
            let tail: Vec<u32> = (0..next(40)).map(|_| next(50) as u32).collect();
            let p = [stem, &tail[..]].concat();
            cache.clear(0);
            let n = prefix.load(&p, &mut cache, 0).unwrap();
            prefix.check_leaves();
            m.decode(&mut cache, &[(0, &p[n..])], false).unwrap();
            prefix.insert(&p, &cache, 0);
            prefix.check_leaves();
            assert!(prefix.bytes() <= 150 * PER_TOKEN);
        }
    }
}
