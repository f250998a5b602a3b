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

pub mod comm;
pub mod fault;
pub mod pipeline;
pub mod plan;

use crate::model::params::Layout as ParamLayout;
use crate::model::Model;
use crate::train::checkpoint::StateSource;
use crate::train::config::TrainConfig;
use crate::train::optim::Optimizer;
use crate::train::step::{
    apply_gradients, backward_each, check_loss, whole_norms, Pass, StepOutcome,
};
use anyhow::{bail, ensure, Result};
use comm::Comm;
use pipeline::{Layout, Stage, StepTraffic};
use rayon::prelude::*;
use serde_json::{json, Value};
use std::cell::{Cell, RefCell};
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
    pub(crate) comm: &'c dyn Comm,
    pub reduce: Reduce,
    /// How the ranks cut the model into pipeline stages (none: pure data parallelism).
    pub layout: Layout,
    /// This rank's stage, once the run's model is known.
    pub(crate) stage: RefCell<Option<Stage>>,
    /// On rank 0 of a pipeline: the stages of the first replica, whose parts it puts together.
    pub(crate) first_replica: RefCell<Vec<Stage>>,
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
    pub(crate) fn broadcast_from_leader(&self, buf: &mut [u8]) {
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
    pub(crate) fn timings(&self, model: &Model, opt: &Optimizer) -> (Vec<String>, Value) {
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
    pub(crate) fn share(&self, accumulation: usize) -> std::ops::Range<usize> {
        let per = accumulation / self.replicas();
        let replica = self.rank() / self.layout.stages;
        replica * per..(replica + 1) * per
    }

    /// Sets this rank's pipeline stage up for the run's model and step.
    pub(crate) fn set_stage(&self, c: &crate::model::Config, accumulation: usize) -> Result<()> {
        if !self.layout.is_pipeline() {
            return Ok(());
        }
        let m = accumulation / self.replicas();
        *self.stage.borrow_mut() = Some(Stage::new(self.layout, c, m, self.rank())?);
        if self.leads() {
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
    pub(crate) fn optimizer_step(
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
        fault::fault_point_kill(self.rank(), step + 1);
        fault::fault_point_stop(self.rank(), step + 1);
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
pub(crate) fn check_share(tc: &TrainConfig, ranks: usize) -> Result<()> {
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

/// The optimiser state of a pipeline's first replica for a checkpoint on rank 0, put together
/// one tensor at a time as the checkpoint writes it: rank 0's own part and the other stages'
/// parts, which they send after their weights ([`Trainer::assemble`]).
pub(crate) struct StagesState<'g> {
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
    pub(crate) fn new(g: &'g Group<'g>, own: [Vec<f32>; 3], step: u64) -> StagesState<'g> {
        StagesState { g, own, step, whole: Vec::new(), taken: 0 }
    }

    /// Takes what the checkpoint did not (when writing it failed), so that no stage is left
    /// waiting to send; returns rank 0's own part.
    pub(crate) fn finish(mut self) -> [Vec<f32>; 3] {
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
pub(crate) fn fingerprint(values: &[f32]) -> u64 {
    let fnv = |h: u64, x: u64| (h ^ x).wrapping_mul(0x100000001b3);
    let parts: Vec<u64> = values
        .par_chunks(1 << 16)
        .map(|c| c.iter().fold(0xcbf29ce484222325, |h, x| fnv(h, x.to_bits() as u64)))
        .collect();
    parts.into_iter().fold(0xcbf29ce484222325, fnv)
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
