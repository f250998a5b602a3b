//! Data-parallel training (docs/distributed.md). Every rank holds the whole model and
//! optimiser state and takes a consecutive share of the micro-batches of each step; the ranks
//! then add their gradients, so every rank takes the same update. Under a pipeline a rank holds
//! its stage's part instead, and the replicas of each stage add theirs. Rank 0 alone reads and
//! writes the run directory: it sets the run up and hands its state (or each rank's part) to
//! the others, and puts the whole model together from the stages when it validates or writes
//! a checkpoint.
//!
//! A failure on any rank is agreed on at fixed points ([`Group::agree`]): every rank stops
//! there, and only the first failing rank prints its error (and exits with status 1).

use super::pipeline::{Layout, Stage, StepTraffic};
use super::{
    apply_gradients, backward_each, check_loss, whole_norms, Pass, Position, StepOutcome,
    Throughput, Trainer,
};
use super::{Model, Optimizer, Progress, TrainOptions, Whole};
use crate::comm::{self, Comm};
use crate::model::params::Layout as ParamLayout;
use crate::train::checkpoint::{self as run_dir, StateSource};
use crate::train::config::{RunConfig, TrainConfig};
use crate::train::data::Corpus;
use crate::train::tokenizer::Bpe;
use crate::train::tokens::{Tokens, WindowOrder};
use anyhow::{bail, ensure, Context, Result};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::cell::{Cell, RefCell};
use std::path::PathBuf;
use std::time::Instant;

/// How the ranks add their gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    /// In the order one process adds them ([`comm::sum_in_order`]): bit-identical to training
    /// alone, and to any other number of ranks.
    Exact,
    /// By MPI's all-reduce ([`comm::sum_all_reduce`]): the low bits depend on the number of
    /// ranks.
    Mpi,
}

impl Reduce {
    pub fn parse(s: &str) -> Result<Reduce> {
        match s {
            "exact" => Ok(Reduce::Exact),
            "mpi" => Ok(Reduce::Mpi),
            _ => bail!("--reduce must be exact or mpi, got {s:?}"),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Reduce::Exact => "exact",
            Reduce::Mpi => "mpi",
        }
    }
}

/// The error of a rank when another rank reported the failure: nothing more to print, and the
/// process exits with status 0, leaving the failure's status to the rank that prints it (mpirun
/// ends the job at the first non-zero exit, which must not cut that rank short).
#[derive(Debug)]
pub struct Reported;

impl std::fmt::Display for Reported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("another rank failed and reported the error")
    }
}

impl std::error::Error for Reported {}

/// The ranks that train one run together, as seen from one of them.
pub struct Group<'c> {
    comm: &'c dyn Comm,
    pub reduce: Reduce,
    /// How the ranks cut the model into pipeline stages (none: pure data parallelism).
    pub layout: Layout,
    /// This rank's stage, once the run's model is known.
    stage: RefCell<Option<Stage>>,
    /// On rank 0 of a pipeline: the stages of the first replica, whose parts it puts together.
    first_replica: RefCell<Vec<Stage>>,
    /// Seconds this session's steps spent computing chunks and waiting for messages.
    pipe_seconds: Cell<(f64, f64)>,
    /// Set once the ranks have agreed on a failure (so all of them stop together).
    failure_agreed: Cell<bool>,
    /// Seconds spent in this session's steps, and in adding gradients over the ranks in them
    /// (waiting for the slowest rank included).
    step_seconds: Cell<f64>,
    reduce_seconds: Cell<f64>,
}

impl<'c> Group<'c> {
    pub fn new(comm: &'c dyn Comm, reduce: Reduce) -> Group<'c> {
        Group {
            comm,
            reduce,
            layout: Layout::none(),
            stage: RefCell::new(None),
            first_replica: RefCell::new(Vec::new()),
            pipe_seconds: Cell::new((0.0, 0.0)),
            failure_agreed: Cell::new(false),
            step_seconds: Cell::new(0.0),
            reduce_seconds: Cell::new(0.0),
        }
    }

    /// The same ranks cut into pipelines of `layout` (checked against the ranks).
    pub fn with_layout(mut self, layout: Layout) -> Result<Group<'c>> {
        layout.check_ranks(self.size())?;
        self.layout = layout;
        Ok(self)
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// How many replicas of the model share each step's micro-batches (data parallelism).
    pub fn replicas(&self) -> usize {
        self.size() / self.layout.stages
    }

    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// `buf` of rank 0 on every rank.
    pub(super) fn broadcast_from_leader(&self, buf: &mut [u8]) {
        self.comm.broadcast_u8(0, buf);
    }

    /// Whether this is rank 0, which writes the run directory and prints the run's progress.
    pub fn leads(&self) -> bool {
        self.rank() == 0
    }

    /// How long this session's steps took on every rank, and how much of it went into adding
    /// gradients over the ranks (waiting for the others included) and, in a pipeline, into
    /// computing chunks and into waiting for (or posting) messages: the log's lines and the
    /// figures for `summary.json`. Every rank calls this; rank 0 uses the result.
    /// Also what each rank holds (`model`, `opt`: its own) and its peak resident memory.
    fn timings(&self, model: &Model, opt: &Optimizer) -> (Vec<String>, Value) {
        let (compute, wait) = self.pipe_seconds.get();
        let mine = [
            self.step_seconds.get() as f32,
            self.reduce_seconds.get() as f32,
            compute as f32,
            wait as f32,
        ];
        let all = self.comm.all_gather_f32(&mine);
        let held = [
            model.params.len() as u64,
            model.layout.updated() as u64,
            (opt.m.len() + opt.v.len() + opt.momentum.len()) as u64,
            peak_resident_bytes().unwrap_or(0),
        ];
        let held = self.comm.all_gather_u64(&held);
        let pct = |x: f32, of: f32| 100.0 * x / of.max(1e-9);
        let mut lines = Vec::new();
        let mut json = Vec::new();
        for (r, t) in all.chunks(4).enumerate() {
            let [step, reduce, compute, wait] = [t[0], t[1], t[2], t[3]];
            let mut line = format!(
                "rank {r}: this session's steps took {step:.2} s, {reduce:.2} s ({:.1}%) of them adding gradients over the ranks (--reduce {})",
                pct(reduce, step),
                self.reduce.name()
            );
            let h = &held[4 * r..4 * r + 4];
            let mut j = json!({
                "rank": r, "step_seconds": step, "reduce_seconds": reduce,
                "parameter_values": h[0], "updated_values": h[1], "optimizer_values": h[2],
            });
            if h[3] > 0 {
                j["peak_resident_bytes"] = json!(h[3]);
            }
            if self.layout.is_pipeline() {
                line += &format!(
                    ", {compute:.2} s ({:.1}%) computing chunks, {wait:.2} s ({:.1}%) waiting for or posting pipeline messages",
                    pct(compute, step),
                    pct(wait, step)
                );
                j["compute_seconds"] = json!(compute);
                j["wait_seconds"] = json!(wait);
            }
            line += &format!(
                "; it held {} parameter values ({} of them updated here) and {} optimiser values{}",
                h[0],
                h[1],
                h[2],
                if h[3] > 0 {
                    format!(", {:.1} MB at its peak", h[3] as f64 / 1e6)
                } else {
                    String::new()
                }
            );
            lines.push(line);
            json.push(j);
        }
        (lines, Value::Array(json))
    }

    /// Whether every rank knows of the failure that ended training here. When it does not (a
    /// failure outside the agreed points: a bug), the other ranks may be waiting for this one,
    /// and the caller must end the job by other means (`MPI_Abort`).
    pub fn failure_agreed(&self) -> bool {
        self.failure_agreed.get()
    }

    /// The micro-batches of a step of `accumulation` that this rank computes: a consecutive
    /// share, so that the running sum of [`comm::sum_in_order`] passes each rank once.
    /// Under pipeline parallelism the share is the replica's: every stage of it runs the same
    /// micro-batches.
    pub(super) fn share(&self, accumulation: usize) -> std::ops::Range<usize> {
        let per = accumulation / self.replicas();
        let replica = self.rank() / self.layout.stages;
        replica * per..(replica + 1) * per
    }

    /// Sets this rank's pipeline stage up for the run's model and step.
    pub(super) fn set_stage(&self, c: &crate::model::Config, accumulation: usize) -> Result<()> {
        *self.stage.borrow_mut() = super::pipeline::stage_of(self, c, accumulation)?;
        if self.leads() && self.layout.is_pipeline() {
            let m = accumulation / self.replicas();
            *self.first_replica.borrow_mut() = (0..self.layout.stages)
                .map(|r| Stage::new(self.layout, c, m, r))
                .collect::<Result<_>>()?;
        }
        Ok(())
    }

    /// Every rank's outcome of the same piece of work: `local` when every rank succeeded;
    /// otherwise an error on every rank, the first failing rank's own error on that rank (which
    /// prints it), [`Reported`] on the others. `weights`: `(step, fingerprint)` of this rank's
    /// weights after `step`, to check that every rank holds the same weights.
    pub fn agree<T>(&self, local: Result<T>, weights: Option<(usize, u64)>) -> Result<T> {
        let mine = [local.is_err() as u64, weights.map_or(0, |w| w.1)];
        let all = self.comm.all_gather_u64(&mine);
        let rank = self.rank();
        if let Some(first) = (0..self.size()).find(|r| all[2 * r] != 0) {
            self.failure_agreed.set(true);
            return match local {
                Err(e) if first == rank && rank > 0 => Err(e.context(format!("rank {rank}"))),
                Err(e) if first == rank => Err(e),
                _ => Err(Reported.into()),
            };
        }
        if let Some((step, _)) = weights {
            // Each rank against the rank of its pipeline stage in the first replica, which
            // holds the same part of the model (rank 0, without a pipeline).
            let twin = |r: usize| r % self.layout.stages;
            if let Some(r) = (1..self.size()).find(|&r| all[2 * r + 1] != all[2 * twin(r) + 1]) {
                self.failure_agreed.set(true);
                if rank > 0 {
                    return Err(Reported.into());
                }
                bail!(
                    "rank {r}'s weights differ from rank {}'s after step {step}: every rank must run the same attnres build with the same --threads on the same kind of processor",
                    twin(r)
                );
            }
        }
        local
    }

    /// One optimiser step over the ranks: this rank's micro-batches forward and backward (on
    /// its pipeline stage, if any), the gradients of all of them added over the ranks, then the
    /// same update on every rank.
    pub(super) fn optimizer_step(
        &self,
        model: &mut Model,
        opt: &mut Optimizer,
        micro_batches: &[(Vec<u32>, Vec<u32>)],
        pass: Pass,
        lr: f64,
        step: usize,
    ) -> Result<StepOutcome> {
        let t_step = Instant::now();
        let (losses, grads, bytes) = match self.stage.borrow().as_ref() {
            None => {
                let (losses, grads) =
                    self.data_parallel_grads(model, opt, micro_batches, pass, step)?;
                (losses, grads, None)
            }
            Some(stage) => {
                let (losses, grads, bytes) =
                    self.pipeline_grads(stage, model, opt, micro_batches, pass, step)?;
                (losses, grads, Some(bytes))
            }
        };
        let stage = self.stage.borrow();
        let norms = |lay: &ParamLayout, g: &[f32]| match stage.as_ref() {
            None => whole_norms(lay, g),
            Some(stage) => self.gathered_norms(stage, lay, g),
        };
        let done = apply_gradients(model, opt, grads, &losses, lr, step, &norms).map(|mut o| {
            o.pipeline_bytes = bytes;
            o
        });
        let done = self.agree(done, None)?;
        if let Some(reader) = stage.as_ref().and_then(Stage::tied_reader) {
            // The first stage reads the tied embedding that the last stage updated.
            let embed = model.layout.embed.clone();
            if stage.as_ref().is_some_and(Stage::is_last) {
                self.comm.send_f32(reader, &model.params[embed]);
            } else if self.rank() == reader {
                let last = stage.as_ref().map_or(0, Stage::last_rank);
                self.comm.receive_f32(last, &mut model.params[embed]);
            }
        }
        self.step_seconds.set(self.step_seconds.get() + t_step.elapsed().as_secs_f64());
        Ok(done)
    }

    /// [`super::Norms`] on a pipeline stage: each tensor's sum of squares made by the stage that
    /// updates it, and each sublayer's norm by the stage that runs it, gathered from the stages
    /// of the first replica (their replicas hold the same values).
    fn gathered_norms(
        &self,
        stage: &Stage,
        layout: &ParamLayout,
        grads: &[f32],
    ) -> (Vec<f64>, Vec<f64>) {
        let (squares, sublayers) = whole_norms(layout, grads);
        let tensors = stage.whole_tensors();
        // Every value in its place among the whole model's, zero where another stage makes it.
        let mut mine = vec![0u64; tensors + sublayers.len()];
        for (&i, sq) in stage.updated().iter().zip(&squares) {
            mine[i] = sq.to_bits();
        }
        for (j, n) in sublayers.iter().enumerate() {
            mine[tensors + j] = n.to_bits();
        }
        let all = self.comm.all_gather_u64(&mine);
        // Adding the zeros of the other stages changes no value.
        let mut whole = vec![0f64; mine.len()];
        for part in all.chunks(mine.len()).take(self.layout.stages) {
            whole.iter_mut().zip(part).for_each(|(w, p)| *w += f64::from_bits(*p));
        }
        let sublayers = whole.split_off(tensors);
        (whole, sublayers)
    }

    /// Every micro-batch's loss, in the order of one process, and the sum of their gradients:
    /// this rank's share computed here, the rest by the other ranks.
    fn data_parallel_grads(
        &self,
        model: &Model,
        opt: &Optimizer,
        micro_batches: &[(Vec<u32>, Vec<u32>)],
        pass: Pass,
        step: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let n = model.params.len();
        let mut mine = Vec::with_capacity(micro_batches.len());
        let local = backward_each(model, &opt.config, micro_batches, pass, step, |g| mine.push(g));
        let losses = self.agree(local, None)?;
        let losses = self.comm.all_gather_f32(&losses);
        let t = Instant::now();
        let grads = match self.reduce {
            Reduce::Exact => comm::sum_in_order(self.comm, &mine, n),
            Reduce::Mpi => comm::sum_all_reduce(self.comm, &mine, n),
        };
        self.reduce_seconds.set(self.reduce_seconds.get() + t.elapsed().as_secs_f64());
        Ok((losses, grads))
    }

    /// [`Self::data_parallel_grads`] over pipelines: this rank's passes over its replica's
    /// micro-batches, then the losses gathered from the last stages and the gradients of this
    /// stage's tensors added over its replicas, in one process's order. Also the bytes every
    /// rank sent between stages.
    fn pipeline_grads(
        &self,
        stage: &Stage,
        model: &Model,
        opt: &Optimizer,
        micro_batches: &[(Vec<u32>, Vec<u32>)],
        pass: Pass,
        step: usize,
    ) -> Result<(Vec<f32>, Vec<f32>, u64)> {
        let n = model.layout.updated();
        let mut traffic = StepTraffic::default();
        fault_point_kill(self.rank(), step + 1);
        // Nothing in the passes fails but a bug, and the other ranks may be waiting for this
        // one's messages: such an error is not agreed on, so the job ends through MPI_Abort.
        // The first replica's sum starts from zero: it adds its micro-batches as they complete.
        let first = stage.replica() == 0;
        let (losses, mine) =
            stage.run(self.comm, model, micro_batches, pass, &mut traffic, first)?;
        // The last stages' losses, in replica order.
        let all = self.comm.all_gather_f32(&losses);
        let (p, m) = (self.layout.stages, losses.len());
        let losses: Vec<f32> = (0..self.replicas())
            .flat_map(|r| all[((r + 1) * p - 1) * m..((r + 1) * p) * m].to_vec())
            .collect();
        for &loss in &losses {
            check_loss(loss, &opt.config, step)?;
        }
        let t = Instant::now();
        // The stage's replicas add theirs in one process's order (in either mode: MPI's
        // all-reduce spans every rank, and the stages hold different tensors).
        let among = stage.stage_ranks(self.size());
        let grads = comm::sum_in_order_among(self.comm, &among, &mine, n);
        self.reduce_seconds.set(self.reduce_seconds.get() + t.elapsed().as_secs_f64());
        let bytes = self.comm.all_gather_u64(&[traffic.bytes]).iter().sum();
        let (c, w) = self.pipe_seconds.get();
        self.pipe_seconds.set((c + traffic.compute_seconds, w + traffic.wait_seconds));
        Ok((losses, grads, bytes))
    }
}

/// Refuses a step that `ranks` ranks cannot share evenly.
pub(super) fn check_share(tc: &TrainConfig, ranks: usize) -> Result<()> {
    let a = tc.accumulation();
    ensure!(
        a.is_multiple_of(ranks),
        "train: a step is {a} micro-batches (batch_tokens {} / (micro_batch {} x seq_len {})), which {ranks} ranks cannot share evenly: make it a multiple of {ranks}",
        tc.batch_tokens,
        tc.micro_batch,
        tc.seq_len
    );
    Ok(())
}

/// A test hook: `ATTNRES_TEST_ABORT_AT=RANK:STEP` makes rank RANK die (`abort`) as it starts
/// step STEP (from 1), as a crashed or killed process would.
pub(super) fn fault_point(rank: usize, step: usize) {
    static AT: std::sync::OnceLock<Option<(usize, usize)>> = std::sync::OnceLock::new();
    if *AT.get_or_init(|| hook_at("ATTNRES_TEST_ABORT_AT")) == Some((rank, step)) {
        std::process::abort();
    }
}

/// `RANK:STEP` of the test hook in the environment variable `var`.
fn hook_at(var: &str) -> Option<(usize, usize)> {
    let v = std::env::var(var).ok()?;
    let (r, s) = v.split_once(':')?;
    Some((r.trim().parse().ok()?, s.trim().parse().ok()?))
}

/// A test hook: `ATTNRES_TEST_KILL_AT=RANK:STEP` makes rank RANK kill itself with SIGKILL in
/// the middle of step STEP (from 1) of a pipeline, while the other ranks wait for its messages.
fn fault_point_kill(rank: usize, step: usize) {
    static AT: std::sync::OnceLock<Option<(usize, usize)>> = std::sync::OnceLock::new();
    if *AT.get_or_init(|| hook_at("ATTNRES_TEST_KILL_AT")) == Some((rank, step)) {
        let pid = std::process::id().to_string();
        let _ = std::process::Command::new("kill").args(["-KILL", &pid]).status();
        std::process::abort();
    }
}

/// The optimiser state of a pipeline's first replica for a checkpoint on rank 0, put together
/// one tensor at a time as the checkpoint writes it: rank 0's own part and the other stages'
/// parts, which they send after their weights ([`Trainer::assemble`]).
pub(super) struct StagesState<'g> {
    g: &'g Group<'g>,
    /// Rank 0's own part of each tensor.
    own: [Vec<f32>; 3],
    step: u64,
    /// The tensor being written, whole.
    whole: Vec<f32>,
    /// Tensors taken so far.
    taken: usize,
}

impl<'g> StagesState<'g> {
    fn new(g: &'g Group<'g>, own: [Vec<f32>; 3], step: u64) -> StagesState<'g> {
        StagesState { g, own, step, whole: Vec::new(), taken: 0 }
    }

    /// Takes what the checkpoint did not (when writing it failed), so that no stage is left
    /// waiting to send; returns rank 0's own part.
    fn finish(mut self) -> [Vec<f32>; 3] {
        while self.taken < self.own.len() {
            self.tensor(self.taken);
        }
        self.own
    }
}

impl StateSource for StagesState<'_> {
    fn step(&self) -> u64 {
        self.step
    }

    fn len(&self) -> usize {
        self.g.first_replica.borrow().first().map_or(0, |s| s.whole().total)
    }

    fn tensor(&mut self, i: usize) -> &[f32] {
        assert_eq!(i, self.taken, "the optimiser state is taken in order, each tensor once");
        if self.whole.is_empty() {
            self.whole = vec![0.0; self.len()];
        }
        for (r, theirs) in self.g.first_replica.borrow().iter().enumerate() {
            if r == 0 {
                theirs.put_updated(&self.own[i], &mut self.whole);
            } else {
                let mut buf = vec![0.0f32; theirs.part().updated()];
                self.g.comm.receive_f32(r, &mut buf);
                theirs.put_updated(&buf, &mut self.whole);
            }
        }
        self.taken += 1;
        &self.whole
    }
}

/// The most memory this process has held resident (Linux's `VmHWM`), in bytes; none where the
/// system does not say.
fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 =
        line.trim_start_matches("VmHWM:").trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024)
}

/// A fingerprint of the weights, to check that the ranks hold the same ones.
fn fingerprint(values: &[f32]) -> u64 {
    let fnv = |h: u64, x: u64| (h ^ x).wrapping_mul(0x100000001b3);
    let parts: Vec<u64> = values
        .par_chunks(1 << 16)
        .map(|c| c.iter().fold(0xcbf29ce484222325, |h, x| fnv(h, x.to_bits() as u64)))
        .collect();
    parts.into_iter().fold(0xcbf29ce484222325, fnv)
}

/// What rank 0 hands the other ranks at the start: the run's settings, tokenizer, data and
/// position (the weights and optimiser moments follow as raw values).
#[derive(Serialize, Deserialize)]
struct Handover {
    run: RunConfig,
    tokenizer: String,
    /// The tokenizer's end-of-text token (an imported one's is its own `eos_token`).
    eot: u32,
    /// The checkpoint the run started from (every rank measures the start of such a run).
    init: Option<PathBuf>,
    data: Option<PathBuf>,
    data_key: String,
    step: usize,
    tokens_seen: u64,
    windows_seen: u64,
    optimizer_step: u64,
}

impl<'g> Trainer<'g> {
    /// Sets a run up on every rank of `g`: rank 0 as [`Trainer::start`] does (it alone touches
    /// the run directory, and fills the token cache before the others look there), then the
    /// others from its state.
    pub(super) fn start_group(
        run: Option<RunConfig>,
        opts: &TrainOptions,
        g: &'g Group<'g>,
    ) -> Result<Trainer<'g>> {
        let leader = g.leads().then(|| {
            // A pipeline's rank 0 reads a resumed optimiser state as it hands it out.
            let t = Trainer::start(run, opts, g.replicas(), !g.layout.is_pipeline())?;
            let tc = &t.run.train;
            g.layout.check_model(&t.run.model, tc.accumulation() / g.replicas())?;
            g.set_stage(&t.run.model, tc.accumulation())?;
            let handover = serde_json::to_vec(&t.handover()?)?;
            Ok((t, handover))
        });
        let (leader, handover) = match g.agree(leader.transpose(), None)? {
            Some((t, h)) => (Some(t), h),
            None => (None, Vec::new()),
        };
        let handover = comm::broadcast_bytes(g.comm, 0, handover);
        let t = match leader {
            Some(t) => Ok(t),
            None => Trainer::follow(&handover, g),
        };
        let mut t = g.agree(t, None)?;
        match g.stage.borrow().as_ref() {
            None => {
                for buf in [&mut t.model.params, &mut t.opt.m, &mut t.opt.v, &mut t.opt.momentum] {
                    g.comm.broadcast_f32(0, buf);
                }
            }
            Some(stage) => t.take_parts(g, stage)?,
        }
        t.group = Some(g);
        let tc = &t.run.train;
        if let Some(stage) = g.stage.borrow().as_ref() {
            let (bytes, messages) =
                stage.bytes_per_step(tc.micro_batch * tc.seq_len, t.model.config.hidden_size);
            // MPI's buffer for posted messages is sized by a C int.
            let fits = bytes + messages * 1024 < (i32::MAX as usize) / 2;
            let why = format!("a pipeline rank posts {bytes} bytes of messages per step, more than MPI can buffer (1 GB): use fewer or shorter micro-batches per step");
            g.agree(if fits { Ok(()) } else { Err(anyhow::anyhow!(why)) }, None)?;
            g.comm.reserve_posts(bytes, messages);
        }
        if g.leads() && g.layout.is_pipeline() {
            let (l, a) = (g.layout, t.run.train.accumulation());
            t.progress.say(format!(
                "pipeline parallel: {} replicas of {} stages x {} virtual stages ({} chunks of the {} sublayers), cross-stage cache {}, ranks of {} thread{}; each pipeline runs {} of the {a} micro-batches of a step in interleaved 1F1B order",
                g.replicas(),
                l.stages,
                l.virtual_stages,
                l.stages * l.virtual_stages,
                t.model.config.sublayers(),
                l.cache.name(),
                rayon::current_num_threads(),
                if rayon::current_num_threads() == 1 { "" } else { "s" },
                a / g.replicas(),
            ));
        } else if g.leads() {
            let a = t.run.train.accumulation();
            t.progress.say(format!(
                "data parallel: {} ranks of {} thread{}, each computing {} of the {a} micro-batches of a step; gradients added {}",
                g.size(),
                rayon::current_num_threads(),
                if rayon::current_num_threads() == 1 { "" } else { "s" },
                a / g.size(),
                match g.reduce {
                    Reduce::Exact => "in one process's order (--reduce exact)",
                    Reduce::Mpi => "by MPI's all-reduce (--reduce mpi)",
                }
            ));
        }
        Ok(t)
    }

    fn handover(&self) -> Result<Handover> {
        Ok(Handover {
            run: self.run.clone(),
            tokenizer: self.bpe.to_json()?,
            eot: self.bpe.eot,
            init: self.init.clone(),
            data: self.data.clone(),
            data_key: self.data_key.clone(),
            step: self.at.step,
            tokens_seen: self.at.tokens_seen,
            windows_seen: self.at.windows_seen,
            optimizer_step: self.opt.step,
        })
    }

    /// A rank other than 0: the run rank 0 set up, with its own copy of the data (from the
    /// token cache rank 0 filled, where the ranks share it). Weights and moments are filled in
    /// by the caller.
    fn follow(handover: &[u8], g: &'g Group<'g>) -> Result<Trainer<'g>> {
        let h: Handover = serde_json::from_slice(handover)
            .context("the run's state from rank 0 is unreadable")?;
        let mut bpe = Bpe::from_json(&h.tokenizer)?;
        bpe.eot = h.eot;
        let corpus = match &h.data {
            Some(p) => Corpus::from_path(p)?,
            None => Corpus::embedded(),
        };
        let (tokens, _) = Tokens::load_or_build(&corpus.split(), &bpe)?;
        ensure!(
            tokens.key() == h.data_key,
            "the training data ({}) differs from rank 0's: every rank must read the same text",
            h.data.as_ref().map_or("the embedded corpus".to_string(), |p| p.display().to_string())
        );
        let tc = &h.run.train;
        let order = WindowOrder::new(tokens.train_len(), tc.seq_len, tc.seed)?;
        g.set_stage(&h.run.model, tc.accumulation())?;
        // The values come from rank 0; a pipeline stage holds only its part of them.
        let model = match g.stage.borrow().as_ref() {
            None => Model::init(h.run.model.clone(), tc.seed)?,
            Some(stage) => {
                let part = stage.part().clone();
                Model::part(h.run.model.clone(), part.clone(), vec![0.0; part.total])?
            }
        };
        let mut opt = Optimizer::new(tc.optim.clone(), &model.layout);
        opt.step = h.optimizer_step;
        let total = tc.steps();
        let at = Position {
            step: h.step,
            tokens_seen: h.tokens_seen,
            windows_seen: h.windows_seen,
            train_seconds: 0.0,
            earlier_seconds: 0.0,
        };
        Ok(Trainer {
            run: h.run,
            out: PathBuf::new(),
            data: h.data,
            data_key: h.data_key,
            code_versions: Vec::new(),
            init: h.init,
            tokenizer_files: Vec::new(),
            bpe,
            tokens,
            order,
            model,
            opt,
            total,
            at,
            metrics: None,
            _lock: None,
            state_file: None,
            group: Some(g),
            streamed: None,
            last_checkpoint: Instant::now(),
            progress: Progress::new(None, false, total as u64, h.step as u64),
            started: Instant::now(),
            throughput: Throughput { tokens: 0, since: Instant::now() },
            last_val: f64::NAN,
        })
    }

    /// Hands every rank of a pipeline its stage's part of the model and optimiser state, which
    /// rank 0 loaded or made whole; rank 0 then keeps its own part only.
    fn take_parts(&mut self, g: &Group, stage: &Stage) -> Result<()> {
        let c = &self.run.model;
        // Before the first update the state is all zeros: nothing to send, and a stage's own
        // zeros, never written, take no memory until it updates them.
        let moved = self.opt.step > 0;
        if g.leads() {
            let stages = g.first_replica.borrow();
            // The same stage in every replica holds the same part.
            let theirs = |r: usize| &stages[r % g.layout.stages];
            for r in 1..g.size() {
                g.comm.send_f32(r, &theirs(r).take(&self.model.params));
            }
            let params = stage.take(&self.model.params);
            self.model = Model::part(c.clone(), stage.part().clone(), params)?;
            let mut opt = Optimizer::new(self.run.train.optim.clone(), &self.model.layout);
            opt.step = self.opt.step;
            // A resumed state is read one tensor at a time, each handed out before the next.
            let whole = self.opt.m.len();
            let mut file = match self.state_file.take() {
                Some(path) if moved => Some(run_dir::StateFile::open(&path, whole)?),
                _ => None,
            };
            for i in (0..3).filter(|_| moved) {
                let read;
                let values: &[f32] = match file.as_mut() {
                    Some(f) => {
                        read = f.read(i)?;
                        &read
                    }
                    None => [&self.opt.m, &self.opt.v, &self.opt.momentum][i],
                };
                for r in 1..g.size() {
                    g.comm.send_f32(r, &theirs(r).take_updated(values));
                }
                *[&mut opt.m, &mut opt.v, &mut opt.momentum][i] = stage.take_updated(values);
            }
            self.opt = opt;
            // The whole model rank 0 loaded or made is not needed again.
            crate::alloc::release_kept();
        } else {
            g.comm.receive_f32(0, &mut self.model.params);
            let state = [&mut self.opt.m, &mut self.opt.v, &mut self.opt.momentum];
            for buf in state.into_iter().filter(|_| moved) {
                g.comm.receive_f32(0, buf);
            }
        }
        Ok(())
    }

    /// Under a pipeline, the whole model's weights on rank 0, put together from the parts the
    /// stages of the first replica update; none elsewhere, or without a pipeline (every rank
    /// holds the whole model). With [`Whole::State`] those stages then send their optimiser
    /// state too, which rank 0 takes one tensor at a time as it writes the checkpoint
    /// ([`StagesState`]).
    fn assemble(&self, g: &Group, whole: Whole) -> Result<Option<Model>> {
        let stage = g.stage.borrow();
        let Some(stage) = stage.as_ref().filter(|_| whole != Whole::Nothing) else {
            return Ok(None);
        };
        let mine = &self.model.params[..self.model.layout.updated()];
        if !g.leads() {
            if stage.replica() == 0 {
                g.comm.send_f32(0, mine);
                if whole == Whole::State {
                    for buf in [&self.opt.m, &self.opt.v, &self.opt.momentum] {
                        g.comm.send_f32(0, buf);
                    }
                }
            }
            return Ok(None);
        }
        let mut params = vec![0.0f32; stage.whole().total];
        for (r, theirs) in g.first_replica.borrow().iter().enumerate() {
            if r == 0 {
                theirs.put_updated(mine, &mut params);
            } else {
                let mut buf = vec![0.0f32; theirs.part().updated()];
                g.comm.receive_f32(r, &mut buf);
                theirs.put_updated(&buf, &mut params);
            }
        }
        Model::new(self.run.model.clone(), params).map(Some)
    }

    /// Work that only rank 0 does (logging, validation, checkpoints), agreed on by every rank,
    /// with as much of the whole model as it needs (`whole`) in `self.model` and, for a
    /// checkpoint, the optimiser state in `self.streamed`; after the first step and every
    /// validation the ranks also check that their weights agree.
    pub(super) fn lead(
        &mut self,
        whole: Whole,
        work: impl FnOnce(&mut Self) -> Result<()>,
    ) -> Result<()> {
        let Some(g) = self.group else { return work(self) };
        let check = (self.at.step <= 1 || self.evaluation_due())
            .then(|| (self.at.step, fingerprint(&self.model.params)));
        if g.leads() && whole != Whole::Nothing && g.layout.is_pipeline() {
            // The step's freed buffers make room for the whole model, and it for the steps.
            crate::alloc::release_kept();
        }
        let done = match self.assemble(g, whole) {
            Ok(Some(model)) => {
                if whole == Whole::State {
                    let own = [&mut self.opt.m, &mut self.opt.v, &mut self.opt.momentum]
                        .map(std::mem::take);
                    self.streamed = Some(StagesState::new(g, own, self.opt.step));
                }
                let part = std::mem::replace(&mut self.model, model);
                let done = work(self);
                self.model = part;
                if let Some(s) = self.streamed.take() {
                    // Whatever the checkpoint did not take is still on its way: take it.
                    [self.opt.m, self.opt.v, self.opt.momentum] = s.finish();
                }
                crate::alloc::release_kept();
                done
            }
            Ok(None) if g.leads() => work(self),
            Ok(None) => Ok(()),
            Err(e) => Err(e),
        };
        g.agree(done, check)
    }

    /// [`Trainer::finish`] on rank 0, agreed on by every rank.
    pub(super) fn lead_finish(mut self) -> Result<f64> {
        let Some(g) = self.group else { return self.finish(None) };
        let timings = g.timings(&self.model, &self.opt);
        if g.layout.is_pipeline() {
            // Training is over: rank 0 needs the whole weights alone, its stage's state no more.
            let opt = &mut self.opt;
            [opt.m, opt.v, opt.momentum] = [Vec::new(), Vec::new(), Vec::new()];
        }
        let done = match self.assemble(g, Whole::Weights) {
            Ok(Some(model)) => {
                self.model = model;
                self.finish(Some(timings))
            }
            Ok(None) if g.leads() => self.finish(Some(timings)),
            Ok(None) => Ok(f64::NAN),
            Err(e) => Err(e),
        };
        g.agree(done, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `f` on every rank of a job of `size` threads; the results in rank order.
    fn on_ranks<T: Send>(size: usize, f: impl Fn(&Group) -> T + Sync) -> Vec<T> {
        let f = &f;
        std::thread::scope(|s| {
            let handles: Vec<_> = comm::threads(size)
                .into_iter()
                .map(|c| s.spawn(move || f(&Group::new(&c, Reduce::Exact))))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    fn outcome(r: &Result<usize>) -> String {
        match r {
            Ok(v) => format!("ok {v}"),
            Err(e) if e.downcast_ref::<Reported>().is_some() => "reported".into(),
            Err(e) => format!("{e:#}"),
        }
    }

    #[test]
    fn the_first_failing_rank_reports_and_every_rank_stops() {
        let got = on_ranks(4, |g| {
            let local = match g.rank() {
                1 | 3 => Err(anyhow::anyhow!("disk full on {}", g.rank())),
                r => Ok(r),
            };
            let r = g.agree(local, None);
            (outcome(&r), g.failure_agreed())
        });
        let want = ["reported", "rank 1: disk full on 1", "reported", "reported"];
        assert_eq!(got.iter().map(|g| g.0.as_str()).collect::<Vec<_>>(), want);
        assert!(got.iter().all(|g| g.1));
        // Rank 0's own error is printed as it is.
        let got = on_ranks(2, |g| {
            outcome(&g.agree(if g.leads() { Err(anyhow::anyhow!("bad")) } else { Ok(1) }, None))
        });
        assert_eq!(got, ["bad", "reported"]);
        // Success everywhere: every rank keeps its own value.
        let got = on_ranks(3, |g| outcome(&g.agree(Ok(g.rank()), Some((5, 7)))));
        assert_eq!(got, ["ok 0", "ok 1", "ok 2"]);
    }

    #[test]
    fn ranks_whose_weights_differ_stop_with_an_error_naming_the_rank() {
        let got = on_ranks(3, |g| {
            let weights = fingerprint(&[1.0, g.rank().min(1) as f32]);
            (outcome(&g.agree(Ok(0), Some((12, weights)))), g.failure_agreed())
        });
        assert!(got[0].0.starts_with("rank 1's weights differ from rank 0's after step 12"));
        assert_eq!((got[1].0.as_str(), got[2].0.as_str()), ("reported", "reported"));
        assert!(got.iter().all(|g| g.1));
    }

    #[test]
    fn ranks_share_a_step_in_consecutive_runs_and_refuse_an_uneven_split() {
        let shares = on_ranks(4, |g| g.share(8));
        assert_eq!(shares, [0..2, 2..4, 4..6, 6..8]);
        let tc = TrainConfig { batch_tokens: 3 * 8 * 256, ..TrainConfig::default() };
        assert!(check_share(&tc, 3).is_ok());
        let e = check_share(&tc, 2).unwrap_err().to_string();
        assert!(e.contains("a step is 3 micro-batches") && e.contains("2 ranks"), "{e}");
    }
}
