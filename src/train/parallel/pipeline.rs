//! Pipeline-parallel training (docs/pipeline.md): the ranks of a job form `N / P` replicas of
//! a pipeline of `P` stages; rank `replica · P + stage` runs the chunks of its stage
//! ([`super::plan`]: the same chunks, transfers and interleaved 1F1B order that `attnres
//! plan` prints) on the micro-batches of its replica. A rank holds, updates and keeps optimiser
//! state for its stage's part of the model only ([`Stage::part`]); after the step's passes each
//! stage adds its gradients over its replicas and takes the update a single process takes of
//! its tensors.
//!
//! Exactness: a chunk runs exactly the operations one process runs on its sublayers, and what
//! crosses a transition is bit for bit what one process holds there, with two kinds of values
//! recomputed rather than sent: the 1/rms of received sources (the same formula on the same
//! values) and, for a chunk starting inside a block, the block's phase-1 scores (the same pass
//! over the same sources). Backward, the gradient of each completed source travels as running
//! sums over its consumers, continued stage by stage in the order one process adds them.
//! Each parameter belongs to one chunk, so each micro-batch's gradient of it is made on one
//! rank; the tied embedding/head matrix is the exception: the first stage sends the embedding
//! output's gradient to the last stage, which adds it after the head's, as one process does.
//!
//! Longer than most files on purpose: a stage's forward and backward passes and the messages
//! each sends and receives must match pair by pair, which is checked by reading them together.

use super::comm::{Comm, Receiving};
use super::plan::{self, chunk_bounds, Cache, Depth, Grads, Op, Shape, Transfer};
use crate::model::chunk::{ChunkForward, ChunkGradIn};
use crate::model::params::Layout as ParamLayout;
use crate::model::residual::{ResidualForward, SourceSums};
use crate::model::{Config, Model};
use crate::train::step::Pass;
use anyhow::{bail, ensure, Context, Result};
use std::collections::HashMap;
use std::ops::Range;
use std::time::Instant;

/// The pipeline layout asked for on the command line.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Layout {
    /// Stages `P` (ranks per pipeline).
    pub stages: usize,
    /// Virtual stages `V` (chunks per rank).
    pub virtual_stages: usize,
    pub cache: Cache,
    /// How source gradients go back: in one process's order (`--reduce exact`) or once per
    /// transition that carried the source (`--reduce mpi`).
    pub grads: Grads,
}

impl Layout {
    /// Pure data parallelism.
    pub fn none() -> Layout {
        Layout { stages: 1, virtual_stages: 1, cache: Cache::Kept, grads: Grads::InOrder }
    }

    /// Whether the model is cut into chunks at all.
    pub fn is_pipeline(&self) -> bool {
        self.stages > 1 || self.virtual_stages > 1
    }

    /// Checks the layout against the job's ranks.
    pub fn check_ranks(&self, ranks: usize) -> Result<()> {
        ensure!(self.stages >= 1, "--pp must be at least 1");
        ensure!(self.virtual_stages >= 1, "--vpp must be at least 1");
        ensure!(
            ranks.is_multiple_of(self.stages),
            "--pp {} must divide the number of ranks ({ranks}): each pipeline takes --pp ranks{}",
            self.stages,
            if ranks == 1 {
                "; start it under mpirun -np <a multiple of --pp> (docs/pipeline.md)"
            } else {
                ""
            }
        );
        ensure!(
            self.stages > 1 || self.virtual_stages == 1,
            "--vpp {} needs --pp of at least 2 (virtual stages interleave the chunks of several ranks)",
            self.virtual_stages
        );
        Ok(())
    }

    /// Checks the layout against the model and the micro-batches of a step each pipeline runs.
    pub fn check_model(&self, c: &Config, micro_batches: usize) -> Result<()> {
        ensure!(
            c.block_size().is_none() || c.depth_is_default(),
            "--pp runs standard, full and block without the ablation options (attn_res_*); this model sets one"
        );
        self.shape(micro_batches).validate(&Depth::of(c))
    }

    fn shape(&self, micro_batches: usize) -> Shape {
        Shape { stages: self.stages, virtual_stages: self.virtual_stages, micro_batches }
    }
}

/// Message tags: the forward input of chunk `c`, the gradient coming back out of chunk `c`,
/// and the embedding output's gradient for a tied head (3, which neither of the others is).
fn forward_tag(c: usize) -> u16 {
    (3 * c + 1) as u16
}
fn backward_tag(c: usize) -> u16 {
    (3 * c + 2) as u16
}
const TIED_TAG: u16 = 3;

/// What the ranks of one pipeline measured in a step.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepTraffic {
    /// Bytes this rank sent in pipeline transfers.
    pub bytes: u64,
    /// On this rank: seconds computing chunks, and waiting for (and copying) messages.
    pub compute_seconds: f64,
    pub wait_seconds: f64,
}

/// One rank's part of a pipeline.
pub struct Stage {
    layout: Layout,
    shape: Shape,
    depth: Depth,
    bounds: Vec<Range<usize>>,
    /// Forward transitions of one micro-batch: `transfers[c - 1]` goes into chunk c.
    transfers: Vec<Transfer>,
    /// This rank's order of passes.
    ops: Vec<Op>,
    stage: usize,
    replica: usize,
    /// Whether the first and last stage share the embedding matrix as the LM head.
    tied: bool,
    /// The whole model's tensors, and this stage's part of them ([`ParamLayout::part`]).
    whole: ParamLayout,
    part: ParamLayout,
    /// Where the part's tensors lie in the whole model's buffer and in the part's: those the
    /// stage updates first (one per tensor of `part.specs`), then its read-only copies.
    held: Vec<(Range<usize>, usize)>,
    /// The index in `whole.specs` of each tensor this stage updates.
    updated: Vec<usize>,
}

impl Stage {
    /// The stage of rank `rank` for `micro_batches` per pipeline and step.
    pub fn new(layout: Layout, c: &Config, micro_batches: usize, rank: usize) -> Result<Stage> {
        layout.check_model(c, micro_batches)?;
        let shape = layout.shape(micro_batches);
        let depth = Depth::of(c);
        let stage = rank % layout.stages;
        // MPI guarantees tags up to 32767.
        ensure!(
            3 * shape.chunks() + 3 < 32767,
            "--pp x --vpp = {} chunks is more than MPI's tags can name",
            shape.chunks()
        );
        let bounds = chunk_bounds(depth.sublayers, shape.chunks());
        let whole = ParamLayout::new(c);
        let (owned, copied) = ownership(&whole, &shape, &bounds, stage, c.tie_word_embeddings);
        let part = whole.part(&owned, &copied);
        // Packed as the part packs them: the tensors it updates, then its copies.
        let mut held = Vec::new();
        for marks in [&owned, &copied] {
            for s in whole.specs.iter().zip(marks.iter()).filter(|(_, m)| **m).map(|(s, _)| s) {
                let at = held.last().map_or(0, |(r, at): &(Range<usize>, usize)| at + r.len());
                held.push((s.range.clone(), at));
            }
        }
        let updated = (0..whole.specs.len()).filter(|&i| owned[i]).collect();
        Ok(Stage {
            layout,
            shape,
            depth,
            bounds,
            transfers: plan::transfers(&depth, &shape, layout.cache),
            ops: plan::schedule(&shape)[stage].clone(),
            stage,
            replica: rank / layout.stages,
            tied: c.tie_word_embeddings,
            whole,
            part,
            held,
            updated,
        })
    }

    /// How many tensors the whole model has.
    pub fn whole_tensors(&self) -> usize {
        self.whole.specs.len()
    }

    /// The whole model's tensors.
    pub fn whole(&self) -> &ParamLayout {
        &self.whole
    }

    /// This stage's part of the model's tensors.
    pub fn part(&self) -> &ParamLayout {
        &self.part
    }

    /// The index in the whole model's tensors of each tensor this stage updates, in order.
    pub fn updated(&self) -> &[usize] {
        &self.updated
    }

    /// The values of this stage's part (its own tensors, then its read-only copies) out of the
    /// whole model's buffer `whole`.
    pub fn take(&self, whole: &[f32]) -> Vec<f32> {
        let mut part = vec![0.0f32; self.part.total];
        for (r, at) in &self.held {
            part[*at..*at + r.len()].copy_from_slice(&whole[r.clone()]);
        }
        part
    }

    /// The values of the tensors this stage updates, laid out as its optimiser state is, out
    /// of the whole model's state `whole`.
    pub fn take_updated(&self, whole: &[f32]) -> Vec<f32> {
        let mut part = vec![0.0f32; self.part.updated()];
        for (r, at) in &self.held[..self.updated.len()] {
            part[*at..*at + r.len()].copy_from_slice(&whole[r.clone()]);
        }
        part
    }

    /// Puts the values of the tensors this stage updates (`part`, laid out as
    /// [`Self::take_updated`] makes them) into the whole model's buffer `whole`.
    pub fn put_updated(&self, part: &[f32], whole: &mut [f32]) {
        for (r, at) in &self.held[..self.updated.len()] {
            whole[r.clone()].copy_from_slice(&part[*at..*at + r.len()]);
        }
    }

    /// The rank of this replica's first stage, which reads the tied embedding that the last
    /// stage updates (as the LM head): none for an untied head.
    pub fn tied_reader(&self) -> Option<usize> {
        (self.tied && self.layout.stages > 1).then(|| self.rank_of(0))
    }

    /// The rank of this replica's last stage.
    pub fn last_rank(&self) -> usize {
        self.rank_of(self.last_chunk())
    }

    /// The rank of the job that runs chunk `c` of this rank's pipeline.
    fn rank_of(&self, c: usize) -> usize {
        self.replica * self.layout.stages + self.shape.rank_of(c)
    }

    fn last_chunk(&self) -> usize {
        self.shape.chunks() - 1
    }

    /// Bytes this rank sends in one step with `tokens` per micro-batch and hidden size `d`, and
    /// its messages: what MPI must buffer at most.
    pub fn bytes_per_step(&self, tokens: usize, d: usize) -> (usize, usize) {
        let (mut bytes, mut messages) = (0, 0);
        for t in &self.transfers {
            if self.shape.rank_of(t.into - 1) == self.stage {
                bytes += 4 * tokens * t.forward_values(d);
                messages += 1;
            }
            if self.shape.rank_of(t.into) == self.stage {
                bytes += 4 * tokens * t.backward_values(d, self.layout.grads);
                messages += 1;
            }
        }
        if self.tied && self.stage == 0 {
            bytes += 4 * tokens * d;
            messages += 1;
        }
        (bytes * self.shape.micro_batches, messages * self.shape.micro_batches)
    }

    /// The ranks that hold this stage in every replica, in replica order.
    pub fn stage_ranks(&self, ranks: usize) -> Vec<usize> {
        (self.stage..ranks).step_by(self.layout.stages).collect()
    }

    pub fn replica(&self) -> usize {
        self.replica
    }

    pub fn is_last(&self) -> bool {
        self.stage == self.layout.stages - 1
    }

    /// This rank's passes of one step over its replica's `micro_batches` (as `pass` says) on
    /// `model`, this stage's part of the model ([`Self::take`]): the loss of each micro-batch
    /// (last stage; NaN elsewhere) and the gradients of the tensors this stage updates (laid
    /// out as its optimiser state is): each micro-batch's, or with `sum` their sum in
    /// micro-batch order, added as each is complete ([`StepGrads`]).
    pub fn run(
        &self,
        comm: &dyn Comm,
        model: &Model,
        micro_batches: &[(Vec<u32>, Vec<u32>)],
        pass: Pass,
        traffic: &mut StepTraffic,
        sum: bool,
    ) -> Result<(Vec<f32>, Vec<Vec<f32>>)> {
        let rows = pass.rows;
        let m_count = micro_batches.len();
        ensure!(
            m_count == self.shape.micro_batches,
            "a pipeline step of {m_count} micro-batches, planned for {}",
            self.shape.micro_batches
        );
        let d = model.config.hidden_size;
        let mut losses = vec![f32::NAN; m_count];
        let passes = self.ops.iter().filter(|op| matches!(op, Op::Backward { micro: 0, .. }));
        // The tied embedding's gradient on the last stage is complete only once the first
        // stage's part of it arrived, at the end of the step.
        let late = (self.tied && self.layout.stages > 1 && self.is_last())
            .then(|| model.layout.embed.clone());
        let mut grads = StepGrads::new(model.layout.updated(), passes.count(), sum, late);
        let mut fwd: HashMap<(usize, usize), ChunkForward> = HashMap::new();
        // With `Grads::Once`: the gradient sums of the sources each micro-batch's chunk here
        // kept from this rank's chunk before, for that chunk's backward.
        let mut held: HashMap<(usize, usize), SourceSums> = HashMap::new();
        let mut io = Io::new(comm, traffic, self.receives(micro_batches, d), self.receives_ahead());
        for &op in &self.ops {
            match op {
                Op::Forward { chunk, micro } => {
                    let (ids, targets) = &micro_batches[micro];
                    let seq = ids.len() / rows;
                    io.tokens = ids.len();
                    let res = if chunk == 0 {
                        model.embed(ids, rows, seq)?
                    } else {
                        // The sources this rank kept: those of its chunk before.
                        let kept = chunk
                            .checked_sub(self.layout.stages)
                            .and_then(|k| fwd.get(&(k, micro)));
                        self.receive_forward(&mut io, model, chunk, kept, d)?
                    };
                    let t = Instant::now();
                    let bounds = self.bounds[chunk].clone();
                    let f = model.forward_chunk(bounds, res, rows, seq, pass.recompute);
                    if chunk == self.last_chunk() {
                        losses[micro] =
                            model.chunk_loss(&f, targets).context("the last chunk has the head")?;
                    }
                    io.traffic.compute_seconds += t.elapsed().as_secs_f64();
                    if chunk < self.last_chunk() {
                        self.send_forward(&mut io, &f, chunk + 1);
                    }
                    fwd.insert((chunk, micro), f);
                }
                Op::Backward { chunk, micro } => {
                    let (ids, targets) = &micro_batches[micro];
                    io.tokens = ids.len();
                    let f = fwd
                        .remove(&(chunk, micro))
                        .context("a backward pass before its forward")?;
                    let start = if chunk == self.last_chunk() {
                        ChunkGradIn::Loss(targets)
                    } else {
                        let (acc, mut sums) = self.receive_backward(&mut io, chunk + 1, d)?;
                        for (n, s) in sums.iter_mut().enumerate() {
                            // A rank adds the gradient of what it kept to what came back.
                            if let Some(h) = held.remove(&(micro, n)) {
                                match s {
                                    Some(s) => s.add(&h),
                                    None => *s = Some(h),
                                }
                            }
                        }
                        ChunkGradIn::Sent { acc, sums }
                    };
                    let t = Instant::now();
                    let out = model.backward_chunk(f, start, grads.of(micro))?;
                    io.traffic.compute_seconds += t.elapsed().as_secs_f64();
                    if let Some((acc, sums)) = out.handed {
                        let t = &self.transfers[chunk - 1];
                        let back = t.returned(self.layout.grads);
                        let mut sent = Vec::with_capacity(back.len());
                        for (n, s) in sums.into_iter().enumerate() {
                            if back.contains(&n) {
                                sent.push(s);
                            } else {
                                held.insert((micro, n), s);
                            }
                        }
                        self.send_backward(&mut io, chunk, acc, sent);
                    }
                    if let Some(de) = out.embedding {
                        if self.tied && self.layout.stages > 1 {
                            io.post(self.rank_of(self.last_chunk()), TIED_TAG, &de);
                        } else {
                            model.embedding_backward(grads.of(micro), &de, ids);
                        }
                    }
                    grads.pass_done(micro);
                }
            }
        }
        if grads.late.is_some() {
            // The embedding output's gradient after the head's, as one process adds them.
            for (m, (ids, _)) in micro_batches.iter().enumerate() {
                let de = io.receive(self.rank_of(0), TIED_TAG, ids.len() * d)?;
                grads.finish_late(m, &de, ids, d);
            }
        }
        Ok((losses, grads.into_result()?))
    }

    /// The residual state before chunk `c`: the sources and partial sum (or hidden state) the
    /// stage before sent, with the sources this rank kept from its chunk before (`kept`).
    fn receive_forward(
        &self,
        io: &mut Io,
        model: &Model,
        c: usize,
        kept: Option<&ChunkForward>,
        d: usize,
    ) -> Result<ResidualForward> {
        let t = &self.transfers[c - 1];
        let n = io.tokens * d;
        let buf = io.receive(self.rank_of(c - 1), forward_tag(c), t.vectors() * n)?;
        let mut parts = buf.chunks(n.max(1));
        let k = self.bounds[c].start;
        let cfg = &model.config;
        let Some(b) = self.depth.block else {
            let stream = parts.next().context("the hidden state")?;
            return Ok(ResidualForward::resume(cfg, k, &[stream], None));
        };
        let sent: HashMap<usize, &[f32]> =
            t.sources.iter().map(|&s| (s, parts.next().unwrap())).collect();
        let partial = t.partial.then(|| parts.next().unwrap());
        let completed = (0..k / b + 1)
            .map(|s| match sent.get(&s) {
                Some(v) => Ok(*v),
                None => match kept {
                    Some(f) if s < f.residual.completed() => Ok(f.residual.source(s)),
                    _ => bail!("chunk {c} lacks source {s}: neither sent nor kept"),
                },
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ResidualForward::resume(cfg, k, &completed, partial))
    }

    /// Sends the input of chunk `c` from the state `f` after chunk `c - 1`.
    fn send_forward(&self, io: &mut Io, f: &ChunkForward, c: usize) {
        let t = &self.transfers[c - 1];
        let r = &f.residual;
        let mut buf: Vec<f32> = Vec::with_capacity(t.vectors() * r.source(0).len());
        if t.hidden {
            buf.extend_from_slice(r.source(0));
        }
        for &s in &t.sources {
            buf.extend_from_slice(r.source(s));
        }
        if t.partial {
            buf.extend_from_slice(r.partial().expect("a partial sum where the plan sends one"));
        }
        io.post(self.rank_of(c), forward_tag(c), &buf);
    }

    /// What the stage after sent back out of chunk `c`: the gradient of the hidden state or
    /// partial sum, and the running sums of the sources returned (by source; none for a
    /// source this transition does not return).
    fn receive_backward(
        &self,
        io: &mut Io,
        c: usize,
        d: usize,
    ) -> Result<(Vec<f32>, Vec<Option<SourceSums>>)> {
        let t = &self.transfers[c - 1];
        let (n, rows) = (io.tokens * d, io.tokens);
        let len = t.backward_values(d, self.layout.grads) * rows;
        let buf = io.receive(self.rank_of(c), backward_tag(c), len)?;
        let (acc, mut rest) = if t.hidden || t.partial {
            (buf[..n].to_vec(), &buf[n..])
        } else {
            (vec![0.0f32; n], &buf[..])
        };
        let mut sums: Vec<Option<SourceSums>> = (0..t.before).map(|_| None).collect();
        for s in t.returned(self.layout.grads) {
            let (a, r) = rest.split_at(n);
            let (coef, r) = r.split_at(rows);
            sums[s] = Some(SourceSums { acc: a.to_vec(), coef: coef.to_vec() });
            rest = r;
        }
        Ok((acc, sums))
    }

    /// Every message this rank receives in a step over `micro_batches` (hidden size `d`), in
    /// the order its passes take them: rank, tag and values.
    fn receives(
        &self,
        micro_batches: &[(Vec<u32>, Vec<u32>)],
        d: usize,
    ) -> Vec<(usize, u16, usize)> {
        let mut out = Vec::new();
        for op in &self.ops {
            match *op {
                Op::Forward { chunk, micro } if chunk > 0 => {
                    let n = micro_batches[micro].0.len() * d;
                    out.push((
                        self.rank_of(chunk - 1),
                        forward_tag(chunk),
                        self.transfers[chunk - 1].vectors() * n,
                    ));
                }
                Op::Backward { chunk, micro } if chunk < self.last_chunk() => {
                    let rows = micro_batches[micro].0.len();
                    let t = &self.transfers[chunk];
                    out.push((
                        self.rank_of(chunk + 1),
                        backward_tag(chunk + 1),
                        t.backward_values(d, self.layout.grads) * rows,
                    ));
                }
                _ => {}
            }
        }
        if self.tied && self.layout.stages > 1 && self.is_last() {
            for (ids, _) in micro_batches {
                out.push((self.rank_of(0), TIED_TAG, ids.len() * d));
            }
        }
        out
    }

    /// How many receives a rank keeps started ahead of the pass that needs the first of them:
    /// two per chunk it runs, the next forward input and the next returned gradient of each
    /// (one message's buffer each).
    fn receives_ahead(&self) -> usize {
        2 * self.layout.virtual_stages
    }

    /// Sends back out of chunk `c` what its backward pass handed on.
    fn send_backward(&self, io: &mut Io, c: usize, acc: Vec<f32>, sums: Vec<SourceSums>) {
        let t = &self.transfers[c - 1];
        let mut buf: Vec<f32> =
            Vec::with_capacity(t.backward_values(1, self.layout.grads) * acc.len());
        if t.hidden || t.partial {
            buf.extend_from_slice(&acc);
        }
        for s in &sums {
            buf.extend_from_slice(&s.acc);
            buf.extend_from_slice(&s.coef);
        }
        io.post(self.rank_of(c - 1), backward_tag(c), &buf);
    }
}

/// A stage's gradients of one step, made micro-batch by micro-batch, each from zero as one
/// process makes it: either kept apart (for the running sum over the replicas of the stage,
/// which continues another rank's sum) or added up in micro-batch order as each is complete,
/// so that a rank holds the gradients of the micro-batches under way only, not of all.
struct StepGrads {
    /// Values of a gradient.
    n: usize,
    /// Backward passes a micro-batch takes here (one per chunk of this rank).
    passes: usize,
    /// Micro-batches under way: passes done and gradient so far.
    open: HashMap<usize, (usize, Vec<f32>)>,
    /// Micro-batches complete but not yet added (one completing before an earlier one).
    complete: std::collections::BTreeMap<usize, Vec<f32>>,
    /// The next micro-batch to add or keep.
    next: usize,
    /// The running sum; none: each micro-batch's gradient kept in `kept`.
    sum: Option<Vec<f32>>,
    kept: Vec<Vec<f32>>,
    /// A range completed only at the end of the step (the tied embedding on the last stage),
    /// and each micro-batch's values there until then (when summing).
    late: Option<Range<usize>>,
    late_parts: Vec<Vec<f32>>,
}

impl StepGrads {
    fn new(n: usize, passes: usize, sum: bool, late: Option<Range<usize>>) -> StepGrads {
        StepGrads {
            n,
            passes,
            open: HashMap::new(),
            complete: Default::default(),
            next: 0,
            sum: sum.then(|| crate::kernels::zeros(n)),
            kept: Vec::new(),
            late,
            late_parts: Vec::new(),
        }
    }

    /// The gradient of micro-batch `m` so far, for its next backward pass.
    fn of(&mut self, m: usize) -> &mut [f32] {
        let n = self.n;
        &mut self.open.entry(m).or_insert_with(|| (0, crate::kernels::zeros(n))).1
    }

    /// One backward pass of micro-batch `m` is done; after its last, its gradient (but for a
    /// late range) is complete, and the complete ones are added in order.
    fn pass_done(&mut self, m: usize) {
        let Some(entry) = self.open.get_mut(&m) else { return };
        entry.0 += 1;
        if entry.0 < self.passes {
            return;
        }
        let Some((_, g)) = self.open.remove(&m) else { return };
        self.complete.insert(m, g);
        while let Some(g) = self.complete.remove(&self.next) {
            match &mut self.sum {
                Some(sum) => {
                    // All but the late range now, element by element as one process adds.
                    let late = self.late.clone().unwrap_or(0..0);
                    crate::kernels::add_assign(&mut sum[..late.start], &g[..late.start]);
                    crate::kernels::add_assign(&mut sum[late.end..], &g[late.end..]);
                    if !late.is_empty() {
                        self.late_parts.push(g[late].to_vec());
                    }
                }
                None => self.kept.push(g),
            }
            self.next += 1;
        }
    }

    /// Adds micro-batch `m`'s embedding-output gradient `de` (of token ids `ids`, width `d`)
    /// into the late range, completing it (micro-batches in order).
    fn finish_late(&mut self, m: usize, de: &[f32], ids: &[u32], d: usize) {
        let Some(late) = self.late.clone() else { return };
        match &mut self.sum {
            Some(sum) => {
                let part = &mut self.late_parts[m];
                crate::kernels::embedding::backward(part, de, ids, d);
                crate::kernels::add_assign(&mut sum[late], part);
            }
            None => crate::kernels::embedding::backward(&mut self.kept[m][late], de, ids, d),
        }
    }

    /// The sum, or every micro-batch's gradient.
    fn into_result(self) -> Result<Vec<Vec<f32>>> {
        ensure!(
            self.open.is_empty() && self.complete.is_empty(),
            "a micro-batch's backward passes are missing"
        );
        Ok(match self.sum {
            Some(sum) => vec![sum],
            None => self.kept,
        })
    }
}

/// A rank's messages in a step, counted and timed. Receives start ahead of the passes that
/// need them ([`Comm::start_receive`]), so that messages arrive while the rank computes.
struct Io<'a> {
    comm: &'a dyn Comm,
    traffic: &'a mut StepTraffic,
    /// Tokens of the micro-batch under way.
    tokens: usize,
    /// Receives started, in the order the passes take them, and those still to start.
    started: std::collections::VecDeque<Receiving>,
    upcoming: std::vec::IntoIter<(usize, u16, usize)>,
    ahead: usize,
}

impl<'a> Io<'a> {
    /// The messages of a step: `receives`, in order ([`Stage::receives`]), `ahead` of them
    /// started at a time.
    fn new(
        comm: &'a dyn Comm,
        traffic: &'a mut StepTraffic,
        receives: Vec<(usize, u16, usize)>,
        ahead: usize,
    ) -> Io<'a> {
        let mut io = Io {
            comm,
            traffic,
            tokens: 0,
            started: Default::default(),
            upcoming: receives.into_iter(),
            ahead: ahead.max(1),
        };
        let t = Instant::now();
        io.start_ahead();
        io.traffic.wait_seconds += t.elapsed().as_secs_f64();
        io
    }

    fn start_ahead(&mut self) {
        while self.started.len() < self.ahead {
            let Some((from, tag, len)) = self.upcoming.next() else { break };
            self.started.push_back(self.comm.start_receive(from, tag, len));
        }
    }

    fn post(&mut self, to: usize, tag: u16, buf: &[f32]) {
        let t = Instant::now();
        self.comm.post_f32(to, tag, buf);
        self.traffic.bytes += 4 * buf.len() as u64;
        self.traffic.wait_seconds += t.elapsed().as_secs_f64();
    }

    /// The `len` values rank `from` posted under `tag`: the next receive started.
    fn receive(&mut self, from: usize, tag: u16, len: usize) -> Result<Vec<f32>> {
        let t = Instant::now();
        let r = self.started.pop_front().context("a receive the step's plan does not hold")?;
        ensure!(
            (r.from, r.tag, r.len) == (from, tag, len),
            "a pass takes {len} values under tag {tag} from rank {from}, but the plan's next receive is {} values under tag {} from rank {}",
            r.len,
            r.tag,
            r.from
        );
        let values = self.comm.finish_receive(r);
        self.start_ahead();
        self.traffic.wait_seconds += t.elapsed().as_secs_f64();
        Ok(values)
    }
}

/// Which tensors of the whole model (`layout`) stage `stage` updates and which it holds as
/// read-only copies: the tensors of the sublayers of its chunks, the embedding on the first
/// stage and the final norm, output aggregation and LM head on the last. A tied embedding is the
/// last stage's (the LM head's gradient and the embedding's meet there, see [`Stage::run`]);
/// the first stage reads a copy of it, which the last stage sends after every update.
fn ownership(
    layout: &ParamLayout,
    shape: &Shape,
    bounds: &[Range<usize>],
    stage: usize,
    tied: bool,
) -> (Vec<bool>, Vec<bool>) {
    let last = stage == shape.stages - 1;
    let mut mine: Vec<Range<usize>> = Vec::new();
    for (_, b) in bounds.iter().enumerate().filter(|(c, _)| shape.rank_of(*c) == stage) {
        for l in b.clone() {
            mine.extend(layout.sublayer_ranges(l));
        }
    }
    if stage == 0 && !tied {
        mine.push(layout.embed.clone());
    }
    if last {
        mine.push(layout.final_norm.clone());
        mine.push(layout.head.clone());
        if let Some(p) = &layout.output_depth {
            mine.push(p.query.clone());
            mine.extend(p.gain.clone());
        }
    }
    let within = |r: &Range<usize>, of: &[Range<usize>]| {
        of.iter().any(|m| m.start <= r.start && r.end <= m.end)
    };
    let owned = layout.specs.iter().map(|s| within(&s.range, &mine)).collect();
    let copies = if stage == 0 && tied && !last { vec![layout.embed.clone()] } else { Vec::new() };
    let copied = layout.specs.iter().map(|s| within(&s.range, &copies)).collect();
    (owned, copied)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels;
    use crate::model::config::ResidualKind;
    use crate::train::parallel::comm;

    /// `num_blocks` for [`model`]: blocks of two layers over three (`attn_res_block_size = 2`),
    /// 4 sublayers and a shorter last one of 2.
    const UNEVEN: usize = 0;

    /// A small model: 3 layers (6 sublayers), so that chunks of 1 and 2 sublayers and blocks of
    /// 2 and 3 cross each other.
    fn model(residual: ResidualKind, num_blocks: usize, tied: bool) -> Model {
        let uneven = num_blocks == UNEVEN && residual == ResidualKind::Block;
        let c = Config {
            vocab_size: 50,
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 3,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 8,
            max_position_embeddings: 16,
            residual,
            num_blocks: if uneven { 2 } else { num_blocks },
            attn_res_block_size: uneven.then_some(2),
            tie_word_embeddings: tied,
            ..Config::default()
        };
        let mut m = Model::init(c, 7).unwrap();
        // Non-zero pseudo-queries, so that the depth attention's weights are not uniform.
        let q = crate::testutil::rand_vec(m.params.len(), 3, 0.05);
        m.params.iter_mut().zip(q).for_each(|(p, r)| *p += r);
        m
    }

    fn micro_batches(count: usize, rows: usize, seq: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
        (0..count)
            .map(|m| {
                let ids: Vec<u32> =
                    (0..rows * seq + 1).map(|i| ((i * 7 + m * 13) % 50) as u32).collect();
                (ids[..rows * seq].to_vec(), ids[1..].to_vec())
            })
            .collect()
    }

    /// Every micro-batch's loss and gradient as one process computes them.
    fn alone(
        model: &Model,
        mbs: &[(Vec<u32>, Vec<u32>)],
        rows: usize,
    ) -> (Vec<f32>, Vec<Vec<f32>>) {
        mbs.iter()
            .map(|(ids, t)| {
                let f = model.forward(ids, rows, ids.len() / rows).unwrap();
                model.backward(&f, t).unwrap()
            })
            .unzip()
    }

    /// One pipeline over threads: every micro-batch's loss (from the last stage), gradient (the
    /// stages' disjoint parts added; with `sum`, one: their sum) and the bytes sent.
    fn pipelined(
        model: &Model,
        layout: Layout,
        mbs: &[(Vec<u32>, Vec<u32>)],
        pass: Pass,
        sum: bool,
    ) -> (Vec<f32>, Vec<Vec<f32>>, u64) {
        let p = layout.stages;
        let out: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = comm::threads(p)
                .into_iter()
                .map(|c| {
                    s.spawn(move || {
                        let stage = Stage::new(layout, &model.config, mbs.len(), c.rank()).unwrap();
                        let (config, part) = (model.config.clone(), stage.part().clone());
                        let mine = Model::part(config, part, stage.take(&model.params)).unwrap();
                        let mut traffic = StepTraffic::default();
                        let (losses, grads) =
                            stage.run(&c, &mine, mbs, pass, &mut traffic, sum).unwrap();
                        // Each stage's gradients in the whole model's places, zero elsewhere.
                        let grads = grads
                            .iter()
                            .map(|g| {
                                let mut whole = kernels::zeros(model.params.len());
                                stage.put_updated(g, &mut whole);
                                whole
                            })
                            .collect::<Vec<_>>();
                        ((losses, grads), traffic.bytes)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let losses = out[p - 1].0 .0.clone();
        let mut grads = vec![kernels::zeros(model.params.len()); out[0].0 .1.len()];
        for ((_, g), _) in &out {
            for (total, part) in grads.iter_mut().zip(g) {
                kernels::add_assign(total, part);
            }
        }
        (losses, grads, out.iter().map(|o| o.1).sum())
    }

    /// Every tensor is updated by exactly one stage, each stage's part holds the tensors of
    /// its sublayers by name, and the first stage reads a tied embedding it does not update.
    #[test]
    fn the_stages_update_disjoint_parts_that_cover_the_model() {
        use ResidualKind::*;
        for (residual, tied, p, v) in
            [(Block, true, 2, 2), (Full, false, 3, 1), (Standard, true, 3, 2), (Block, false, 2, 3)]
        {
            let m = model(residual, 3, tied);
            let layout = Layout { stages: p, virtual_stages: v, ..Layout::none() };
            let stages: Vec<Stage> =
                (0..p).map(|r| Stage::new(layout, &m.config, 2 * p, r).unwrap()).collect();
            let mut owner = vec![None; m.layout.specs.len()];
            for st in &stages {
                for &i in st.updated() {
                    assert_eq!(owner[i], None, "{} updated twice", m.layout.specs[i].name);
                    owner[i] = Some(st.stage);
                }
                assert_eq!(
                    st.part().updated(),
                    st.updated().iter().map(|&i| m.layout.specs[i].range.len()).sum::<usize>()
                );
            }
            let bounds = chunk_bounds(6, p * v);
            for (i, s) in m.layout.specs.iter().enumerate() {
                let want = if s.name.starts_with("model.layers.") {
                    let layer: usize = s.name.split('.').nth(2).unwrap().parse().unwrap();
                    let mlp = s.name.contains(".mlp") || s.name.contains("post_attention");
                    let l = 2 * layer + mlp as usize;
                    bounds.iter().position(|b| b.contains(&l)).unwrap() % p
                } else if s.name == "model.embed_tokens.weight" && !tied {
                    0
                } else {
                    p - 1
                };
                assert_eq!(owner[i], Some(want), "{residual:?} P {p} V {v}: {}", s.name);
            }
            // Only the tied embedding is held without being updated, and only by stage 0.
            let embed = m.layout.embed.len();
            assert_eq!(
                stages[0].part().total - stages[0].part().updated(),
                if tied { embed } else { 0 }
            );
            assert!(stages[1..].iter().all(|s| s.part().total == s.part().updated()));
        }
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// Each micro-batch's loss and gradient from a pipeline equal one process's bit for bit,
    /// for every residual, blocks that cross chunk boundaries or not, virtual stages, either
    /// cache, a tied head or not; the bytes sent are the plan's. Returning each source's
    /// gradient once (`--reduce mpi`) adds the same terms in another order: close, not equal.
    #[test]
    fn a_pipeline_computes_each_micro_batchs_gradient_bit_for_bit() {
        use ResidualKind::*;
        let (rows, seq) = (2, 8);
        let mut reordered = false;
        for (residual, blocks, tied, p, v) in [
            (Standard, 1, true, 2, 1),
            (Standard, 1, false, 3, 2),
            (Full, 1, true, 2, 2),
            (Full, 1, false, 3, 1),
            (Block, 3, true, 2, 2), // blocks of 2, chunks of 1 or 2: some cross
            (Block, 2, false, 2, 1), // blocks of 3, chunks of 3: aligned
            (Block, 2, true, 2, 3), // blocks of 3, chunks of 1
            (Block, 1, true, 3, 1), // one block over every chunk
            (Block, UNEVEN, true, 2, 1), // blocks of 4 and 2, chunks of 3
            (Block, UNEVEN, false, 3, 2), // blocks of 4 and 2, chunks of 1
        ] {
            let m = model(residual, blocks, tied);
            let mbs = micro_batches(2 * p, rows, seq);
            let (want_loss, want) = alone(&m, &mbs, rows);
            for (cache, grads) in [
                (Cache::Kept, Grads::InOrder),
                (Cache::Off, Grads::InOrder),
                (Cache::Kept, Grads::Once),
            ] {
                let layout = Layout { stages: p, virtual_stages: v, cache, grads };
                let what = format!(
                    "{residual:?} blocks {blocks} tied {tied} P {p} V {v} {cache:?} {grads:?}"
                );
                let (loss, got, bytes) = pipelined(&m, layout, &mbs, Pass::rows(rows), false);
                // Added as each micro-batch completes: one process's sum, in its order.
                let (_, sum, _) = pipelined(&m, layout, &mbs, Pass::rows(rows), true);
                // Recomputing each sublayer's work in backward: the same bits again.
                let (_, again, _) =
                    pipelined(&m, layout, &mbs, Pass { rows, recompute: true }, true);
                assert!(same_bits(&again[0], &sum[0]), "{what}: recomputed activations");
                let mut want_sum = kernels::zeros(m.params.len());
                want.iter().for_each(|g| kernels::add_assign(&mut want_sum, g));
                if grads == Grads::InOrder {
                    assert!(same_bits(&sum[0], &want_sum), "{what}: the step's summed gradient");
                }
                assert!(same_bits(&loss, &want_loss), "{what}: losses {loss:?} vs {want_loss:?}");
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    if grads == Grads::InOrder {
                        assert!(same_bits(g, w), "{what}: micro-batch {i}'s gradient differs");
                    } else {
                        crate::testutil::assert_close(g, w, 1e-5, &what);
                        reordered |= !same_bits(g, w);
                    }
                }
                let planned: usize = (0..p)
                    .map(|r| Stage::new(layout, &m.config, mbs.len(), r).unwrap())
                    .map(|s| s.bytes_per_step(rows * seq, 16).0)
                    .sum();
                assert_eq!(bytes as usize, planned, "{what}: bytes sent");
            }
        }
        assert!(reordered, "returning gradients once changes some low bits (the test can tell)");
    }
}
