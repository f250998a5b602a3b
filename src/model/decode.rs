//! Incremental decoding: a key/value cache per layer, and a forward pass over new tokens only.
//!
//! Each cache slot holds one sequence. One call runs new tokens of any set of slots together
//! (whole prompts for prefill, one token per slot while decoding); every token attends to its
//! own slot's cached keys and values, which the call extends.
//!
//! The residual connection runs exactly as in training, on the new tokens: depth attention never
//! mixes positions, so a token's **depth cache** (the embedding and the completed block sums,
//! or every sublayer output for `full`, plus the running partial sum) is built while that token
//! passes through the layers and read by all later sublayers, with the two-phase computation of
//! docs/method.md §7 (phase 1 once per block for all of its sublayers, phase 2 per sublayer).
//! Unlike the key/value cache it is not kept once the token's logits exist.

use super::config::Config;
use super::residual::{DepthMap, ResidualForward};
use super::transformer::Model;
use crate::base::alloc::ZeroPages;
use crate::base::memory::{format_bytes, memory_limit};
use crate::base::profile::phase;
use crate::kernels::attention::{self, AttnShape, Segment, Span};
use crate::kernels::rope::Positions;
use crate::kernels::zeros;
use anyhow::{anyhow, bail, ensure, Result};
use std::ops::Range;
use std::sync::Arc;

/// Keys and values of every layer for `slots` sequences of up to `capacity` tokens (a cache
/// serves one model). The buffers hold room for as many positions per slot as the tokens need
/// (or as [`KvCache::reserve`] asked for), growing when a call needs more, never beyond
/// `capacity`.
pub struct KvCache {
    slots: usize,
    capacity: usize,
    /// Positions per slot the buffers have room for (`<= capacity`).
    room: usize,
    /// Values per token per layer: `KV·hd`.
    width: usize,
    /// Per layer: `[slots, room, KV·hd]`, keys after the rotary embedding. Pages the slots
    /// have not reached yet are the system's zero pages.
    k: Vec<ZeroPages>,
    v: Vec<ZeroPages>,
    /// Tokens held per slot, shared and own.
    len: Vec<usize>,
    /// Per slot: runs of positions its sequence starts with, read in place from where they are
    /// kept (the prefix cache's runs) rather than copied into the slot, with how many of each
    /// run's positions it uses. The slot's own buffers hold the positions after them.
    shared: Vec<Vec<(Arc<KvRun>, usize)>>,
    /// The depth attention's effective queries, made on the first call (a cache serves one model).
    queries: Option<Arc<[f32]>>,
}

impl KvCache {
    /// An empty cache (nothing allocated yet); `capacity` may not exceed the model's
    /// `max_position_embeddings`.
    pub fn new(config: &Config, slots: usize, capacity: usize) -> Result<KvCache> {
        ensure!(slots > 0, "a cache needs at least one slot");
        ensure!(
            capacity > 0 && capacity <= config.max_position_embeddings,
            "cache capacity {capacity} must lie in 1..={} (max_position_embeddings)",
            config.max_position_embeddings
        );
        let layers = config.num_hidden_layers;
        Ok(KvCache {
            slots,
            capacity,
            room: 0,
            width: config.num_key_value_heads * config.head_dim,
            k: (0..layers).map(|_| ZeroPages::default()).collect(),
            v: (0..layers).map(|_| ZeroPages::default()).collect(),
            len: vec![0; slots],
            shared: vec![Vec::new(); slots],
            queries: None,
        })
    }

    /// An error, allocating nothing, when `room` tokens per slot would need more than the memory
    /// limit ([`memory_limit`]).
    pub fn check_room(&self, room: usize) -> Result<()> {
        check_cache_size(self.slots, room, self.width, self.k.len())
    }

    /// Makes room for `positions` tokens per slot (at most the capacity), keeping what the
    /// slots hold; an error, before anything is allocated, past the memory limit.
    pub fn reserve(&mut self, positions: usize) -> Result<()> {
        let room = positions.min(self.capacity);
        if room <= self.room {
            return Ok(());
        }
        self.check_room(room)?;
        let (old, w, slots) = (self.room, self.width, self.slots);
        let own: Vec<usize> = (0..slots).map(|s| self.len[s] - self.shared_len(s)).collect();
        for buf in self.k.iter_mut().chain(self.v.iter_mut()) {
            let mut new = ZeroPages::new(slots * room * w).ok_or_else(|| {
                anyhow!(
                    "the system refused {} for the key/value cache",
                    format_bytes((slots * room * w * 4) as u128)
                )
            })?;
            for (slot, &n) in own.iter().enumerate() {
                new[slot * room * w..][..n * w].copy_from_slice(&buf[slot * old * w..][..n * w]);
            }
            *buf = new;
        }
        self.room = room;
        Ok(())
    }

    /// Makes room for `positions` tokens per slot, growing by at least double when it grows
    /// (amortised: each growth moves every slot's keys and values).
    pub fn grow(&mut self, positions: usize) -> Result<()> {
        if positions <= self.room {
            return Ok(());
        }
        self.reserve(positions.max(self.room.saturating_mul(2)))
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Positions per slot the buffers have room for now (grows with the tokens held).
    pub fn room(&self) -> usize {
        self.room
    }

    /// Tokens cached in `slot`: those it shares ([`KvCache::share`]) and its own.
    pub fn len(&self, slot: usize) -> usize {
        self.len[slot]
    }

    /// Positions at the start of `slot`'s sequence that it reads from shared runs.
    fn shared_len(&self, slot: usize) -> usize {
        self.shared[slot].iter().map(|&(_, n)| n).sum()
    }

    /// Forgets the sequence in `slot` (its next token goes to position 0).
    pub fn clear(&mut self, slot: usize) {
        self.len[slot] = 0;
        self.shared[slot].clear();
    }

    /// The bytes [`KvCache::copy_out`] takes for `positions` tokens.
    pub fn run_bytes(&self, positions: usize) -> usize {
        positions.saturating_mul(2 * self.k.len() * self.width * 4)
    }

    /// A copy of the keys and values `slot` holds for `positions` (from its shared runs or its
    /// own).
    pub fn copy_out(&self, slot: usize, positions: Range<usize>) -> KvRun {
        assert!(positions.end <= self.len[slot], "positions {positions:?} not held by slot {slot}");
        let (w, layers) = (self.width, self.k.len());
        let mut values = Vec::with_capacity(4 * layers);
        for part in 0..2 * layers {
            // The pieces of the sequence in order: (first position, keys or values [n, w]).
            let mut at = 0;
            for (run, n) in &self.shared[slot] {
                let (lo, hi) = (positions.start.max(at), positions.end.min(at + n));
                if lo < hi {
                    values.push(&run.part(part)[(lo - at) * w..(hi - at) * w]);
                }
                at += n;
            }
            let own = if part < layers { &self.k[part] } else { &self.v[part - layers] };
            let lo = positions.start.max(at);
            if lo < positions.end {
                let base = slot * self.room;
                values.push(&own[(base + lo - at) * w..(base + positions.end - at) * w]);
            }
        }
        KvRun::gather(positions.len(), 2 * layers, &values)
    }

    /// Continues the shared start of the sequence in `slot` (which holds no positions of its own
    /// yet) with the first `n` positions of `run`, which the slot then reads in place, as if they
    /// had been decoded there: keys and values are those of the positions the slot holds next,
    /// so a run may only continue the sequence it was copied from.
    pub fn share(&mut self, slot: usize, run: &Arc<KvRun>, n: usize) -> Result<()> {
        ensure!(0 < n && n <= run.len, "{n} positions asked of a run of {}", run.len);
        let start = self.len[slot];
        ensure!(
            start == self.shared_len(slot),
            "slot {slot} holds positions of its own; a shared run can only come before them"
        );
        ensure!(
            start + n <= self.capacity,
            "slot {slot} holds {start} tokens; {n} more would exceed the context of {} tokens",
            self.capacity
        );
        ensure!(run.parts == 2 * self.k.len(), "a run of another model's layers");
        self.shared[slot].push((run.clone(), n));
        self.len[slot] += n;
        Ok(())
    }
}

/// The shared runs of each span's sequence, as layer `layer`'s attention reads them.
fn segments<'a>(
    shared: &'a [Vec<(Arc<KvRun>, usize)>],
    spans: &[Span],
    layer: usize,
) -> Vec<Vec<Segment<'a>>> {
    spans
        .iter()
        .map(|sp| {
            shared[sp.slot]
                .iter()
                .map(|(run, n)| {
                    let layers = run.parts / 2;
                    Segment { k: run.part(layer), v: run.part(layers + layer), len: *n }
                })
                .collect()
        })
        .collect()
}

/// Keys and values of `len` consecutive positions of one sequence: what a prefix cache keeps
/// of a prompt. One buffer (few allocations for many kept runs): the keys of each layer, then
/// the values of each layer, each `[len, KV·hd]`.
#[derive(Default)]
pub struct KvRun {
    len: usize,
    /// Keys and values of every layer: twice the layers.
    parts: usize,
    /// On small pages of its own: a run of a long prompt is tens of megabytes, copied while a
    /// request waits for its first token, where a huge-page block would first have the kernel
    /// compact memory.
    values: ZeroPages,
}

impl KvRun {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.values.len() * 4
    }

    /// Keys (`p` below the layers) or values (from the layers on) of one layer: `[len, KV·hd]`.
    fn part(&self, p: usize) -> &[f32] {
        let size = self.values.len() / self.parts.max(1);
        &self.values[p * size..(p + 1) * size]
    }

    /// The positions before `at` and those from `at` on, as two runs.
    pub fn split(&self, at: usize) -> (KvRun, KvRun) {
        assert!(0 < at && at < self.len, "a run of {} positions split at {at}", self.len);
        let cut = at * (self.part(0).len() / self.len);
        let (head, tail): (Vec<&[f32]>, Vec<&[f32]>) =
            (0..self.parts).map(|p| self.part(p).split_at(cut)).unzip();
        (KvRun::gather(at, self.parts, &head), KvRun::gather(self.len - at, self.parts, &tail))
    }

    /// A run of `len` positions whose values are `pieces`, one after another.
    fn gather(len: usize, parts: usize, pieces: &[&[f32]]) -> KvRun {
        let n = pieces.iter().map(|p| p.len()).sum();
        let mut values = ZeroPages::new(n).unwrap_or_else(|| {
            std::alloc::handle_alloc_error(std::alloc::Layout::array::<f32>(n).expect("a size"))
        });
        let mut at = 0;
        for p in pieces {
            values[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        KvRun { len, parts, values }
    }
}
/// Memory per token, in f32 values: the key/value cache holds `kv` for every token of the
/// context; the depth cache holds `depth` for each token while it passes through the layers.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct CacheFootprint {
    pub kv: usize,
    pub depth: usize,
}

impl CacheFootprint {
    pub fn of(c: &Config) -> CacheFootprint {
        let kv = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim;
        // Sources a sublayer may read: the embedding and the completed blocks (N of them by the
        // last block, each sublayer's output for full), the running partial sum inside a block,
        // and one 1/rms per source. The standard residual keeps just the stream.
        let d = c.hidden_size;
        let depth = match c.block_size() {
            None => d,
            Some(s) => {
                let blocks = c.sublayers().div_ceil(s);
                let partial = (s > 1) as usize;
                (1 + blocks + partial) * (d + 1)
            }
        };
        CacheFootprint { kv, depth }
    }

    /// Bytes one decoding call over `rows` new tokens holds at its peak, roughly: per token the
    /// depth cache, the embedding and the widest activations (q/k/v, gate/up, attention output),
    /// and the `logit_rows` rows of logits it returns. `None` on overflow.
    pub fn working(&self, c: &Config, rows: usize, logit_rows: usize) -> Option<u128> {
        let n = |x: usize| x as u128;
        let per_token = n(self.depth)
            + n(c.qkv_width())
            + 2 * n(c.intermediate_size)
            + n(c.num_attention_heads * c.head_dim)
            + 2 * n(c.hidden_size);
        let logits = n(logit_rows).checked_mul(n(c.vocab_size))?;
        n(rows).checked_mul(per_token)?.checked_add(logits)?.checked_mul(4)
    }
}

impl Model {
    /// Runs new tokens through the model and appends them to `cache`: `chunks` pairs a slot
    /// with the tokens that continue its sequence (each slot at most once). Returns logits
    /// `[rows, vocab]`: for every new token, in chunk order, when `all_logits`; otherwise for
    /// the last token of each chunk.
    pub fn decode(
        &self,
        cache: &mut KvCache,
        chunks: &[(usize, &[u32])],
        all_logits: bool,
    ) -> Result<Vec<f32>> {
        self.decode_rows(cache, chunks, &vec![all_logits; chunks.len()])
    }

    /// [`Self::decode`] with the choice per chunk: logits for every new token of chunk `k` when
    /// `all_rows[k]` (a prompt whose every token is scored), else for its last token.
    pub fn decode_rows(
        &self,
        cache: &mut KvCache,
        chunks: &[(usize, &[u32])],
        all_rows: &[bool],
    ) -> Result<Vec<f32>> {
        let none = vec![false; chunks.len()];
        Ok(self.decode_traced(cache, chunks, all_rows, &none)?.0)
    }

    /// [`Self::decode_rows`], also returning for each chunk `k` with `depth[k]` the depth-
    /// attention weights of its last token (those that made the next token's logits). Asking
    /// for them changes no number of the pass; not asking costs nothing.
    pub fn decode_traced(
        &self,
        cache: &mut KvCache,
        chunks: &[(usize, &[u32])],
        all_rows: &[bool],
        depth: &[bool],
    ) -> Result<(Vec<f32>, Vec<Option<DepthMap>>)> {
        ensure!(all_rows.len() == chunks.len(), "one choice of logits per chunk");
        ensure!(depth.len() == chunks.len(), "one choice of depth weights per chunk");
        // Run on a worker of the thread pool: a decoding step makes hundreds of small parallel
        // calls, which are cheap from inside the pool and costly from outside it.
        rayon::scope(|_| self.decode_in_pool(cache, chunks, all_rows, depth))
    }

    fn decode_in_pool(
        &self,
        cache: &mut KvCache,
        chunks: &[(usize, &[u32])],
        all_rows: &[bool],
        depth: &[bool],
    ) -> Result<(Vec<f32>, Vec<Option<DepthMap>>)> {
        let c = &self.config;
        let (d, v) = (c.hidden_size, c.vocab_size);
        let mut spans = Vec::with_capacity(chunks.len());
        let mut seen = vec![false; cache.slots];
        let mut rows = 0;
        for &(slot, ids) in chunks {
            ensure!(
                slot < cache.slots,
                "slot {slot} does not exist (the cache has {})",
                cache.slots
            );
            ensure!(
                !std::mem::replace(&mut seen[slot], true),
                "slot {slot} appears twice in one call"
            );
            ensure!(!ids.is_empty(), "no new tokens for slot {slot}");
            let start = cache.len[slot];
            if start + ids.len() > cache.capacity {
                bail!(
                    "slot {slot} holds {start} tokens; {} more would exceed the context of {} tokens",
                    ids.len(),
                    cache.capacity
                );
            }
            if let Some(&t) = ids.iter().find(|&&t| t as usize >= v) {
                bail!("token id {t} is out of range for vocab_size = {v}");
            }
            spans.push(Span { slot, start, len: ids.len(), row0: rows });
            rows += ids.len();
        }
        ensure!(rows > 0, "nothing to decode");
        let logit_rows: usize =
            spans.iter().zip(all_rows).map(|(s, &all)| if all { s.len } else { 1 }).sum();
        let working = CacheFootprint::of(c).working(c, rows, logit_rows);
        ensure!(
            working.is_some_and(|b| b <= memory_limit() as u128),
            "running {rows} new token(s) at once needs {}; at most {} (the machine's memory) is \
             allowed: feed the prompt in parts",
            working.map_or("more than 2^128 bytes".into(), format_bytes),
            format_bytes(memory_limit() as u128)
        );
        let needed =
            spans.iter().map(|s| s.start - cache.shared_len(s.slot) + s.len).max().unwrap_or(0);
        cache.grow(needed)?;
        let ids: Vec<u32> = chunks.iter().flat_map(|(_, ids)| ids.iter().copied()).collect();
        let positions: Vec<usize> = spans.iter().flat_map(|s| s.start..s.start + s.len).collect();

        let p = &self.params;
        let lay = &self.layout;
        let sh = AttnShape {
            batch: cache.slots,
            seq: cache.room,
            heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
        };
        let ow = sh.out_width();
        let mut e = zeros(rows * d);
        self.embed_rows(&mut e, &ids);
        if cache.queries.is_none() {
            cache.queries = ResidualForward::queries_of(c, p, lay);
        }
        // Keeping what backward would need keeps the weights too (the same numbers either way).
        let traced = depth.contains(&true);
        let mut res = ResidualForward::new(c, e, traced);
        if let Some(q) = &cache.queries {
            res = res.with_queries(q.clone());
        }
        for (i, lp) in lay.layers.iter().enumerate() {
            let h = phase("fwd residual", || res.input(2 * i, p, lay));
            let (_, _, qkv) = self.attn_project(lp, &h, Positions::Explicit(&positions));
            let mut o = zeros(rows * ow);
            let shared = segments(&cache.shared, &spans, i);
            phase("fwd attention", || {
                attention::forward_cached(
                    &mut o,
                    &qkv,
                    &mut cache.k[i],
                    &mut cache.v[i],
                    &spans,
                    &shared,
                    sh,
                )
            });
            let out = phase("fwd linear", || self.linear(&o, &lp.o_proj, rows, ow, d));
            phase("fwd residual", || res.push_output(2 * i, out));

            let h = phase("fwd residual", || res.input(2 * i + 1, p, lay));
            let (_, out) = self.mlp_sublayer(lp, h);
            phase("fwd residual", || res.push_output(2 * i + 1, out));
        }
        for s in &spans {
            cache.len[s.slot] += s.len;
        }
        let mut h = phase("fwd residual", || res.output(p, lay));
        let maps = match res.depth_weights().filter(|_| traced) {
            Some(w) => spans
                .iter()
                .zip(depth)
                .map(|(s, &asked)| asked.then(|| w.of_row(s.row0 + s.len - 1, c.depth_sources())))
                .collect(),
            None => vec![None; spans.len()],
        };
        drop(res);
        if logit_rows < rows {
            // Only the last token of a chunk predicts what comes next (unless all are scored).
            h = spans
                .iter()
                .zip(all_rows)
                .flat_map(|(s, &all)| {
                    let first = if all { s.row0 } else { s.row0 + s.len - 1 };
                    h[first * d..(s.row0 + s.len) * d].iter().copied()
                })
                .collect();
        }
        let logits = self.head(&h).2;
        self.check_finite(&logits)?;
        Ok((logits, maps))
    }
}

/// An error, allocating nothing, when a key/value cache of `slots` sequences of `room` tokens
/// (`width` values per token and layer, `layers` layers) would need more than the memory limit.
pub fn check_cache_size(slots: usize, room: usize, width: usize, layers: usize) -> Result<()> {
    let bytes = cache_bytes(slots, room, width, layers);
    let limit = memory_limit();
    match bytes {
        Some(b) if b <= limit as u128 => Ok(()),
        _ => bail!(
            "the key/value cache for {} sequence(s) of {room} tokens needs {}; at most {} \
             (the machine's memory) is allowed",
            slots,
            bytes.map_or("more than 2^128 bytes".into(), format_bytes),
            format_bytes(limit as u128)
        ),
    }
}

/// The bytes of keys and values for `slots` sequences of `room` tokens, `width` values per
/// token and layer; `None` past 2^128.
pub fn cache_bytes(slots: usize, room: usize, width: usize, layers: usize) -> Option<u128> {
    [slots, room, width, layers, 2, 4].iter().try_fold(1u128, |a, &b| a.checked_mul(b as u128))
}
