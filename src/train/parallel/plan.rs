//! Pipeline-parallel planning (docs/method.md §8): how the sublayers are cut into chunks over
//! `P` ranks with `V` virtual stages each, the interleaved 1F1B order in which every rank runs
//! its chunks, and what crosses each stage transition — for Block and Full AttnRes every
//! completed depth source a later chunk reads, which the cross-stage cache keeps from being
//! sent twice. `attnres plan` prints this for any shape without training.
//!
//! Depth sources are numbered as the model numbers them: 0 is the token embedding, `n ≥ 1` the
//! `n`-th completed block (for Full, every sublayer's output is a block of one). A transition
//! into a chunk that starts inside a block also carries the block's running partial sum, which
//! changes with every sublayer and so is never cached.

use anyhow::{bail, ensure, Result};
use std::collections::BTreeSet;
use std::ops::Range;

/// The depth structure that decides what crosses a transition.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Depth {
    /// Sublayers of the model (two per layer).
    pub sublayers: usize,
    /// Sublayers per block (1 for Full); `None` for the standard residual, which sends one
    /// hidden state. The last block may be shorter.
    pub block: Option<usize>,
}

impl Depth {
    pub fn of(config: &crate::model::Config) -> Depth {
        Depth { sublayers: config.sublayers(), block: config.block_size() }
    }

    /// Completed blocks, not counting the embedding.
    pub fn blocks(&self) -> usize {
        self.block.map_or(0, |b| self.sublayers.div_ceil(b))
    }

    /// The sources complete before sublayer `k`: the embedding and every block that ended.
    fn complete_before(&self, k: usize, b: usize) -> Range<usize> {
        0..k / b + 1
    }
}

/// What a rank keeps of the depth sources it has seen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cache {
    /// Nothing: every transition resends all completed sources (report Eq. 7).
    Off,
    /// The sources it received before (the report's accounting, Eq. 8).
    Received,
    /// The sources it received or produced itself: a rank's own blocks never come back to it.
    Kept,
}

impl Cache {
    pub fn parse(s: &str) -> Result<Cache> {
        Ok(match s {
            "off" => Cache::Off,
            "received" => Cache::Received,
            "on" | "kept" => Cache::Kept,
            _ => bail!("--pp-cache must be on, received or off, got {s:?}"),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Cache::Off => "off",
            Cache::Received => "received",
            Cache::Kept => "on",
        }
    }
}

/// `P` ranks, `V` virtual stages per rank and `M` micro-batches per optimiser step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shape {
    pub stages: usize,
    pub virtual_stages: usize,
    pub micro_batches: usize,
}

impl Shape {
    /// Chunks of the model: `P · V`.
    pub fn chunks(&self) -> usize {
        self.stages * self.virtual_stages
    }

    /// The rank that runs chunk `c` (chunks go round the ranks `V` times).
    pub fn rank_of(&self, c: usize) -> usize {
        c % self.stages
    }

    pub fn validate(&self, depth: &Depth) -> Result<()> {
        ensure!(self.stages >= 1, "--pp must be at least 1");
        ensure!(self.virtual_stages >= 1, "--vpp must be at least 1");
        ensure!(self.micro_batches >= 1, "a step needs at least one micro-batch");
        ensure!(
            self.chunks() <= depth.sublayers,
            "--pp {} x --vpp {} = {} chunks, but the model has only {} sublayers",
            self.stages,
            self.virtual_stages,
            self.chunks(),
            depth.sublayers
        );
        // The interleaved order sends micro-batches round the ranks in groups of P.
        ensure!(
            self.virtual_stages == 1 || self.micro_batches.is_multiple_of(self.stages),
            "with --vpp > 1 the micro-batches per step ({}) must be a multiple of --pp ({})",
            self.micro_batches,
            self.stages
        );
        Ok(())
    }
}

/// The sublayers of each chunk: contiguous, sizes differing by at most one.
pub fn chunk_bounds(sublayers: usize, chunks: usize) -> Vec<Range<usize>> {
    (0..chunks).map(|c| c * sublayers / chunks..(c + 1) * sublayers / chunks).collect()
}

/// One forward stage transition: the input of chunk `into` sent from the rank that ran chunk
/// `into - 1`. Backward mirrors it: the gradient of every vector sent goes back once.
#[derive(Clone, Debug, PartialEq)]
pub struct Transfer {
    pub into: usize,
    pub from_rank: usize,
    pub to_rank: usize,
    /// Depth sources sent (0: the embedding, `n`: block `n`).
    pub sources: Vec<usize>,
    /// Whether the running partial sum of an unfinished block goes along.
    pub partial: bool,
    /// Standard residual: the one hidden state.
    pub hidden: bool,
    /// Sources complete before the chunk (AttnRes): the embedding and the blocks it reads.
    pub before: usize,
}

/// How the gradients of the depth sources go back (docs/pipeline.md, "Exactness").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grads {
    /// Every transition hands back the running sums of every source complete before it, so
    /// each source's gradient is added in one process's order: bit-identical.
    InOrder,
    /// Each source's gradient goes back once along each transition that carried it forward,
    /// and a rank adds the gradients of the sources it holds itself: the cache's saving
    /// backward too, but the sums run in another order.
    Once,
}

impl Transfer {
    /// Vectors of `hidden_size` sent per token.
    pub fn vectors(&self) -> usize {
        self.sources.len() + self.partial as usize + self.hidden as usize
    }

    /// Values sent forward per token with hidden size `d`.
    pub fn forward_values(&self, d: usize) -> usize {
        self.vectors() * d
    }

    /// The sources whose gradient goes back, as running sums over the consumers of the later
    /// chunks (see `kernels::depth::SourceSums`).
    pub fn returned(&self, grads: Grads) -> Vec<usize> {
        match grads {
            Grads::InOrder => (0..self.before).collect(),
            Grads::Once => self.sources.clone(),
        }
    }

    /// Values sent back per token with hidden size `d`: the gradient of the hidden state or of
    /// the partial sum, and `d + 1` per returned source (its running sums).
    pub fn backward_values(&self, d: usize, grads: Grads) -> usize {
        (self.partial as usize + self.hidden as usize) * d + self.returned(grads).len() * (d + 1)
    }

    /// Completed blocks sent (neither the embedding nor a partial sum): the quantity of the
    /// report's formulas.
    pub fn blocks(&self) -> usize {
        self.sources.iter().filter(|&&s| s > 0).count()
    }
}

/// Every forward transition of one micro-batch, in chunk order, under a cache policy.
pub fn transfers(depth: &Depth, shape: &Shape, cache: Cache) -> Vec<Transfer> {
    let bounds = chunk_bounds(depth.sublayers, shape.chunks());
    // What each rank holds: sources received (and, for `Kept`, produced).
    let mut held: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); shape.stages];
    let mut out = Vec::new();
    for c in 0..bounds.len() {
        let rank = shape.rank_of(c);
        if c > 0 {
            let k = bounds[c].start;
            let mut t = Transfer {
                into: c,
                from_rank: shape.rank_of(c - 1),
                to_rank: rank,
                sources: Vec::new(),
                partial: false,
                hidden: depth.block.is_none(),
                before: 0,
            };
            if let Some(b) = depth.block {
                t.before = depth.complete_before(k, b).len();
                let have = &mut held[rank];
                t.sources = depth
                    .complete_before(k, b)
                    .filter(|s| cache == Cache::Off || !have.contains(s))
                    .collect();
                if cache != Cache::Off {
                    have.extend(&t.sources);
                }
                t.partial = !k.is_multiple_of(b);
            }
            out.push(t);
        }
        if let (Some(b), Cache::Kept) = (depth.block, cache) {
            // The chunk's own products: the embedding (chunk 0) and the blocks it completes.
            let r = &bounds[c];
            let produced = if c == 0 { 0 } else { r.start / b + 1 }..r.end / b + 1;
            held[rank].extend(produced);
        }
    }
    out
}

/// Per token of a micro-batch: completed blocks and all vectors sent forward (backward sends
/// [`Transfer::backward_values`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Traffic {
    pub blocks: usize,
    pub vectors: usize,
    /// The most vectors of one transition.
    pub peak: usize,
}

pub fn traffic(transfers: &[Transfer]) -> Traffic {
    Traffic {
        blocks: transfers.iter().map(Transfer::blocks).sum(),
        vectors: transfers.iter().map(Transfer::vectors).sum(),
        peak: transfers.iter().map(Transfer::vectors).max().unwrap_or(0),
    }
}

/// Bytes all ranks of one pipeline send per token of a micro-batch, forward and backward, with
/// hidden size `d` (f32 values).
pub fn bytes_per_token(transfers: &[Transfer], d: usize, grads: Grads) -> (usize, usize) {
    let f = transfers.iter().map(|t| t.forward_values(d)).sum::<usize>();
    let b = transfers.iter().map(|t| t.backward_values(d, grads)).sum::<usize>();
    (4 * f, 4 * b)
}

/// The report's formulas for completed blocks per token, in units of one block (`N_p` the
/// blocks a chunk completes on average): Eq. 7 without a cache, `C(C−1)/2 · N_p`, and Eq. 8
/// with the cache of received blocks, `P(P−1)/2 · N_p + (V−1) · P² · N_p`.
pub fn report_formulas(depth: &Depth, shape: &Shape) -> (f64, f64) {
    let (p, v, c) = (shape.stages as f64, shape.virtual_stages as f64, shape.chunks() as f64);
    let np = depth.blocks() as f64 / c;
    (c * (c - 1.0) / 2.0 * np, p * (p - 1.0) / 2.0 * np + (v - 1.0) * p * p * np)
}

/// One unit of a rank's work: the forward or backward pass of a chunk on a micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Forward { chunk: usize, micro: usize },
    Backward { chunk: usize, micro: usize },
}

/// The interleaved 1F1B order of each rank's work: micro-batches enter in groups of `P`, each
/// group through the rank's chunks in turn (the last chunk first on the way back); a warm-up of
/// forwards fills the pipeline, then each forward is followed by a backward, then the remaining
/// backwards drain it. With `V = 1` this is the plain 1F1B order.
pub fn schedule(shape: &Shape) -> Vec<Vec<Op>> {
    let (p, v, m) = (shape.stages, shape.virtual_stages, shape.micro_batches);
    let total = m * v;
    // The k-th forward (backward) of rank r: its chunk and micro-batch.
    let nth = |r: usize, k: usize, backward: bool| {
        let (group, within) = (k / (p * v), k % (p * v));
        let local = if backward { v - 1 - within / p } else { within / p };
        let (chunk, micro) = if v == 1 { (r, k) } else { (local * p + r, group * p + within % p) };
        if backward {
            Op::Backward { chunk, micro }
        } else {
            Op::Forward { chunk, micro }
        }
    };
    (0..p)
        .map(|r| {
            let warmup = if v == 1 {
                (p - r - 1).min(m)
            } else {
                ((p - r - 1) * 2 + (v - 1) * p).min(total)
            };
            let mut ops: Vec<Op> = (0..warmup).map(|k| nth(r, k, false)).collect();
            for k in 0..total - warmup {
                ops.push(nth(r, warmup + k, false));
                ops.push(nth(r, k, true));
            }
            ops.extend((total - warmup..total).map(|k| nth(r, k, true)));
            ops
        })
        .collect()
}

/// The timeline of a schedule with every chunk's forward taking `forward[c]` and its backward
/// `backward[c]` (communication free): the time the last rank finishes, and the idle fraction
/// of all ranks until then (the pipeline bubble). An order that could never finish (a rank
/// waiting for work that waits for it) is an error.
pub fn simulate(
    shape: &Shape,
    ops: &[Vec<Op>],
    forward: &[f64],
    backward: &[f64],
) -> Result<(f64, f64)> {
    use std::collections::HashMap;
    let mut done: HashMap<Op, f64> = HashMap::new();
    let mut next = vec![0usize; ops.len()];
    let mut free = vec![0f64; ops.len()];
    let last = shape.chunks() - 1;
    let mut busy = 0.0;
    loop {
        let mut progressed = false;
        for r in 0..ops.len() {
            while let Some(&op) = ops[r].get(next[r]) {
                let (dep, cost) = match op {
                    Op::Forward { chunk, micro } => (
                        (chunk > 0).then(|| Op::Forward { chunk: chunk - 1, micro }),
                        forward[chunk],
                    ),
                    Op::Backward { chunk, micro } => (
                        Some(if chunk < last {
                            Op::Backward { chunk: chunk + 1, micro }
                        } else {
                            Op::Forward { chunk, micro }
                        }),
                        backward[chunk],
                    ),
                };
                let ready = match dep {
                    None => 0.0,
                    Some(d) => match done.get(&d) {
                        Some(&t) => t,
                        None => break,
                    },
                };
                let end = free[r].max(ready) + cost;
                done.insert(op, end);
                free[r] = end;
                busy += cost;
                next[r] += 1;
                progressed = true;
            }
        }
        if next.iter().zip(ops).all(|(n, o)| *n == o.len()) {
            break;
        }
        ensure!(progressed, "the schedule cannot finish: every rank waits for another");
    }
    let span = free.iter().cloned().fold(0.0, f64::max);
    Ok((span, 1.0 - busy / (span * ops.len() as f64)))
}

/// What `attnres plan` prints: the chunks, the transitions under the chosen cache, the traffic
/// of every cache policy next to the report's formulas, and the schedule's bubble.
pub struct PlanText<'a> {
    pub depth: &'a Depth,
    pub shape: &'a Shape,
    pub cache: Cache,
    pub hidden_size: usize,
    /// Tokens per micro-batch.
    pub tokens: usize,
    /// The LM head is the embedding matrix: the first stage also sends the embedding output's
    /// gradient (one vector per token) to the last.
    pub tied_head: bool,
    /// Also print every rank's order of passes.
    pub show_schedule: bool,
}

impl PlanText<'_> {
    pub fn render(&self) -> Result<String> {
        use std::fmt::Write;
        let (depth, shape) = (self.depth, self.shape);
        shape.validate(depth)?;
        let mut o = String::new();
        let bounds = chunk_bounds(depth.sublayers, shape.chunks());
        let sizes: BTreeSet<usize> = bounds.iter().map(|r| r.len()).collect();
        let residual = match depth.block {
            None => "standard residual".to_string(),
            Some(1) => format!("Full AttnRes ({} sources)", depth.sublayers + 1),
            Some(b) => {
                format!("Block AttnRes, {b} sublayers per block ({} blocks)", depth.blocks())
            }
        };
        writeln!(
            o,
            "{} ranks x {} virtual stages = {} chunks of {} sublayers ({} each); {residual}; hidden {}; {} micro-batches of {} tokens per step",
            shape.stages,
            shape.virtual_stages,
            shape.chunks(),
            depth.sublayers,
            sizes.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(" or "),
            self.hidden_size,
            shape.micro_batches,
            self.tokens
        )?;

        let vector_bytes = self.hidden_size as f64 * 4.0;
        let step_tokens = (self.tokens * shape.micro_batches) as f64;
        let tied = if self.tied_head && shape.stages > 1 { 4 * self.hidden_size } else { 0 };
        writeln!(o, "\ntransitions of one micro-batch, --pp-cache {} (sources: 0 = embedding, n = block n; + partial = the unfinished block's running sum):", self.cache.name())?;
        for t in transfers(depth, shape, self.cache) {
            let what = if t.hidden {
                "the hidden state".to_string()
            } else {
                let mut parts = vec![ranges(&t.sources)];
                if t.partial {
                    parts.push("partial".into());
                }
                parts.retain(|p| !p.is_empty());
                if parts.is_empty() {
                    "nothing".into()
                } else {
                    parts.join(" + ")
                }
            };
            writeln!(
                o,
                "  into chunk {:>3} (sublayer {:>3}), rank {} -> {}: {what} ({} vectors)",
                t.into,
                bounds[t.into].start,
                t.from_rank,
                t.to_rank,
                t.vectors()
            )?;
        }

        let (eq7, eq8) = report_formulas(depth, shape);
        writeln!(o, "\ntraffic per token (a vector is {vector_bytes} bytes); backward sends the gradient of the hidden state or partial sum and d + 1 values per source returned: with --reduce exact every source complete before the chunk, with --reduce mpi those the transition carried forward:")?;
        writeln!(
            o,
            "  {:<9} {:>8} {:>16} {:>8} {:>6} {:>14} {:>14} {:>14} {:>18}",
            "cache",
            "blocks",
            "report formula",
            "vectors",
            "peak",
            "forward",
            "back, exact",
            "back, mpi",
            "bytes/step exact"
        )?;
        for cache in [Cache::Off, Cache::Received, Cache::Kept] {
            let ts = transfers(depth, shape, cache);
            let (fwd, back) = bytes_per_token(&ts, self.hidden_size, Grads::InOrder);
            let (_, once) = bytes_per_token(&ts, self.hidden_size, Grads::Once);
            let t = traffic(&ts);
            let formula = match cache {
                Cache::Off => format!("Eq. 7: {eq7:.1}"),
                Cache::Received => format!("Eq. 8: {eq8:.1}"),
                Cache::Kept => "-".into(),
            };
            let bytes = crate::base::memory::format_bytes;
            writeln!(
                o,
                "  {:<9} {:>8} {:>16} {:>8} {:>6} {:>14} {:>14} {:>14} {:>18}",
                cache.name(),
                t.blocks,
                formula,
                t.vectors,
                t.peak,
                bytes(fwd as u128),
                bytes(back as u128),
                bytes(once as u128),
                bytes(((fwd + back + tied) as f64 * step_tokens) as u128)
            )?;
        }
        writeln!(o, "  (blocks: completed blocks sent, the formulas' unit N_p·d with N_p = {:.3} blocks per chunk; vectors add the embedding and partial sums)", depth.blocks() as f64 / shape.chunks() as f64)?;
        if tied > 0 {
            writeln!(o, "  (bytes/step: one pipeline's step, with the tied LM head's gradient of the embedding output, {} per token, from the first stage to the last)", crate::base::memory::format_bytes(tied as u128))?;
        }

        let ops = schedule(shape);
        let cost = |r: &Range<usize>| r.len() as f64;
        let forward: Vec<f64> = bounds.iter().map(cost).collect();
        let backward: Vec<f64> = forward.iter().map(|f| 2.0 * f).collect();
        let (span, bubble) = simulate(shape, &ops, &forward, &backward)?;
        let (p, v, m) =
            (shape.stages as f64, shape.virtual_stages as f64, shape.micro_batches as f64);
        writeln!(
            o,
            "\nschedule: interleaved 1F1B; with a backward twice a forward and no communication time, {:.1}% of rank time is idle (the bubble; (P-1)/(V*M + P-1) = {:.1}% for equal chunks), {span} sublayer-forwards long",
            100.0 * bubble,
            100.0 * (p - 1.0) / (v * m + p - 1.0)
        )?;
        if self.show_schedule {
            writeln!(o, "  (Fc.m / Bc.m: forward / backward of chunk c on micro-batch m)")?;
            for (r, list) in ops.iter().enumerate() {
                let names: Vec<String> = list
                    .iter()
                    .map(|op| match op {
                        Op::Forward { chunk, micro } => format!("F{chunk}.{micro}"),
                        Op::Backward { chunk, micro } => format!("B{chunk}.{micro}"),
                    })
                    .collect();
                writeln!(o, "  rank {r}: {}", names.join(" "))?;
            }
        }
        Ok(o)
    }
}

/// `0-3,5,7-8`: sorted ids as ranges.
fn ranges(ids: &[usize]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ids.len() {
        let mut j = i;
        while j + 1 < ids.len() && ids[j + 1] == ids[j] + 1 {
            j += 1;
        }
        parts.push(if i == j { ids[i].to_string() } else { format!("{}-{}", ids[i], ids[j]) });
        i = j + 1;
    }
    parts.join(",")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(p: usize, v: usize, m: usize) -> Shape {
        Shape { stages: p, virtual_stages: v, micro_batches: m }
    }

    /// Blocks aligned with chunks (every chunk completes the same whole number of blocks): the
    /// counted transfers are exactly the report's formulas, and keeping one's own blocks saves
    /// `(V−1)·P·N_p` more.
    #[test]
    fn aligned_transfers_match_the_reports_formulas() {
        for (p, v, per_chunk, block) in
            [(4, 2, 4, 2), (4, 2, 2, 1), (2, 3, 6, 3), (8, 4, 2, 2), (3, 1, 4, 4), (1, 4, 2, 1)]
        {
            let s = shape(p, v, p);
            let depth = Depth { sublayers: s.chunks() * per_chunk, block: Some(block) };
            let np = (per_chunk / block) as f64;
            let (eq7, eq8) = report_formulas(&depth, &s);
            let count = |cache| traffic(&transfers(&depth, &s, cache)).blocks as f64;
            assert_eq!(count(Cache::Off), eq7, "P={p} V={v}");
            assert_eq!(count(Cache::Received), eq8, "P={p} V={v}");
            let saved = ((v - 1) * p) as f64 * np;
            assert_eq!(count(Cache::Kept), eq8 - saved, "P={p} V={v}");
        }
        // The report's example, P = 4, V = 2, one block per chunk: 28 → 22 block transfers.
        let s = shape(4, 2, 4);
        let (eq7, eq8) = report_formulas(&Depth { sublayers: 16, block: Some(2) }, &s);
        assert_eq!((eq7, eq8), (28.0, 22.0));
    }

    /// Each transition sends exactly the sources the receiver needs and lacks: replaying the
    /// transfers, every rank holds all sources its chunk reads, and (with a cache) nothing twice.
    #[test]
    fn every_chunk_receives_what_it_reads_and_a_cache_never_resends() {
        for (sublayers, block, p, v) in
            [(16, 3, 2, 2), (24, 5, 3, 2), (18, 1, 3, 3), (12, 4, 4, 1), (20, 7, 2, 5)]
        {
            let (depth, s) = (Depth { sublayers, block: Some(block) }, shape(p, v, p));
            let bounds = chunk_bounds(sublayers, s.chunks());
            for cache in [Cache::Off, Cache::Received, Cache::Kept] {
                let ts = transfers(&depth, &s, cache);
                let mut held: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); p];
                let mut received: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); p];
                held[0].insert(0);
                for (c, r) in bounds.iter().enumerate() {
                    let rank = s.rank_of(c);
                    if c > 0 {
                        let t = &ts[c - 1];
                        assert_eq!((t.into, t.from_rank, t.to_rank), (c, s.rank_of(c - 1), rank));
                        assert!(t.sources.iter().all(|x| held[t.from_rank].contains(x)));
                        for x in &t.sources {
                            let first = received[rank].insert(*x);
                            assert!(cache == Cache::Off || first, "{x} sent twice to {rank}");
                            if cache == Cache::Kept {
                                assert!(!held[rank].contains(x), "{x} sent back to its holder");
                            }
                        }
                        held[rank].extend(&t.sources);
                        let needed: BTreeSet<usize> = (0..=r.start / block).collect();
                        assert!(needed.is_subset(&held[rank]), "chunk {c} lacks a source");
                        assert_eq!(t.partial, r.start % block != 0);
                    }
                    held[rank].extend(r.start / block + 1..=r.end / block);
                }
            }
        }
    }

    #[test]
    fn standard_sends_one_hidden_state_per_transition() {
        let ts = transfers(&Depth { sublayers: 8, block: None }, &shape(2, 2, 2), Cache::Kept);
        assert_eq!(ts.len(), 3);
        assert!(ts.iter().all(|t| t.vectors() == 1 && t.hidden));
    }

    /// Every rank runs each of its chunks forward and backward once per micro-batch, and with
    /// uniform chunks the timeline is the ideal work plus the known bubble of (interleaved)
    /// 1F1B, `(P − 1) · (f + b)` for chunk times f and b.
    #[test]
    fn the_schedule_is_complete_and_its_bubble_is_the_known_one() {
        for (p, v, m) in [
            (1, 1, 3),
            (2, 1, 4),
            (4, 1, 32),
            (4, 1, 3),
            (2, 2, 4),
            (4, 2, 32),
            (4, 3, 4),
            (3, 2, 6),
        ] {
            let s = shape(p, v, m);
            let ops = schedule(&s);
            for (r, list) in ops.iter().enumerate() {
                let (mut live, mut most) = (0i64, 0i64);
                for op in list {
                    live += if matches!(op, Op::Forward { .. }) { 1 } else { -1 };
                    most = most.max(live);
                }
                let bound = if v == 1 { (p - r).min(m) } else { (v + 1) * p - 1 };
                assert!(most as usize <= bound, "rank {r} of P={p} V={v} M={m} holds {most}");
                let mut want: Vec<Op> = Vec::new();
                for c in (r..s.chunks()).step_by(p) {
                    for micro in 0..m {
                        want.push(Op::Forward { chunk: c, micro });
                        want.push(Op::Backward { chunk: c, micro });
                    }
                }
                let (mut a, mut b) = (list.clone(), want);
                let key = |o: &Op| format!("{o:?}");
                a.sort_by_key(key);
                b.sort_by_key(key);
                assert_eq!(a, b, "rank {r} of P={p} V={v} M={m}");
            }
            let (f, b) = (1.0, 2.0);
            let (span, bubble) =
                simulate(&s, &ops, &vec![f; s.chunks()], &vec![b; s.chunks()]).unwrap();
            let ideal = (m * v) as f64 * (f + b);
            assert_eq!(span, ideal + (p - 1) as f64 * (f + b), "P={p} V={v} M={m}");
            assert!((bubble - (1.0 - ideal / span)).abs() < 1e-12);
        }
    }

    #[test]
    fn an_order_that_waits_on_itself_is_refused() {
        let s = shape(2, 1, 1);
        let bad = vec![
            vec![Op::Backward { chunk: 0, micro: 0 }, Op::Forward { chunk: 0, micro: 0 }],
            vec![Op::Forward { chunk: 1, micro: 0 }, Op::Backward { chunk: 1, micro: 0 }],
        ];
        let e = simulate(&s, &bad, &[1.0; 2], &[1.0; 2]).unwrap_err().to_string();
        assert!(e.contains("cannot finish"), "{e}");
    }
}
