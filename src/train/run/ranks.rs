//! The trainer on the ranks of a parallel job: rank 0 sets the run up and hands its state (or
//! each stage's part) to the others; before validating or writing a checkpoint it puts the
//! whole model together from the stages; failures are agreed on so that every rank stops.

use super::progress::Progress;
/// What rank 0 hands the other ranks at the start: the run's settings, tokenizer, data and
/// position (the weights and optimiser moments follow as raw values).
use super::{Position, Setup, TrainOptions, Trainer, Whole};
use crate::model::Model;
use crate::text::tokenizer::Bpe;
use crate::train::checkpoint as run_dir;
use crate::train::config::RunConfig;
use crate::train::data::Corpus;
use crate::train::optim::Optimizer;
use crate::train::parallel::comm;
use crate::train::parallel::pipeline::Stage;
use crate::train::parallel::{fingerprint, Group, Reduce, StagesState};
use crate::train::tokens::{Tokens, WindowOrder};
use anyhow::{ensure, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

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
        Ok(Trainer::new(Setup {
            run: h.run,
            data: h.data,
            data_key: h.data_key,
            init: h.init,
            bpe,
            tokens,
            order,
            model,
            opt,
            at,
            progress: Progress::new(None, false, total as u64, h.step as u64),
            group: Some(g),
        }))
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
            crate::base::alloc::release_kept();
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
            crate::base::alloc::release_kept();
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
                crate::base::alloc::release_kept();
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
