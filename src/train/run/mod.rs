//! The training loop: a run is set up ([`setup`]: fresh, resumed, from a checkpoint, on one
//! rank or several), then steps, logs, evaluates and checkpoints until its token budget is
//! spent, then writes its summary. The [`Trainer`] here owns a run's whole state; the work of
//! one optimiser step is in [`crate::train::step`], what the ranks of a job do together in
//! [`ranks`] and [`crate::train::parallel`].

mod progress;
mod ranks;
pub mod setup;

use super::checkpoint::{self as run_dir, TrainState, METRICS};
use super::config::RunConfig;
use super::optim::{lr_at, Optimizer};
use super::step::{micro_batch, optimizer_step, Pass, StepOutcome};
use super::tokens::{Tokens, WindowOrder};
use super::validation::{unigram_bits_per_byte, validate, validate_by};
use crate::base::fs::write_atomic;
use crate::base::progress::SharedBar;
use crate::base::version::CodeVersion;
use crate::gpu::Precision;
use crate::model::Model;
use crate::text::tokenizer::Bpe;
use crate::train::gpu::trainer::{self as gpu_trainer, DeviceSteps};
use crate::train::parallel::{self, Group};
use anyhow::{Context, Result};
use progress::Progress;
use serde_json::{json, Value};
use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

/// Where a run goes and how it starts: fresh, resumed or over an earlier one.
pub struct TrainOptions {
    pub out: PathBuf,
    /// Training text (none: the embedded corpus, or on resume the run's own `--data`).
    pub data: Option<PathBuf>,
    /// A `tokenizer.json` to use instead of training one.
    pub tokenizer: Option<PathBuf>,
    /// A checkpoint directory to start from (its weights and tokenizer) instead of a fresh
    /// model; the settings' model must be its config ([`init_settings`]).
    pub init: Option<PathBuf>,
    pub resume: bool,
    pub overwrite: bool,
    /// Show a progress bar (else plain log lines).
    pub progress: bool,
    /// Report progress on this bar (shared by the runs of a comparison) instead of a bar of the
    /// run's own.
    pub shared_bar: Option<SharedBar>,
    /// Where the steps run. Not a setting of the run: a run resumes on either.
    pub device: Hardware,
}

/// Where a run's steps run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Hardware {
    #[default]
    Cpu,
    /// The first NVIDIA GPU (docs/gpu.md), with activations of this precision: the model, its
    /// gradients and the optimiser's state live there; validation runs there; checkpoints are
    /// the CPU's.
    Cuda(Precision),
    /// The GPU's code with its kernels run on the CPU (tests only: `crate::gpu::device::Device::emulated`).
    #[cfg(test)]
    Emulated(Precision),
}

/// The longest a run trains without writing a checkpoint, in seconds (besides the step under
/// way): a kill never costs more than this, whatever `checkpoint_every` is.
pub const CHECKPOINT_SECONDS: f64 = 60.0;

/// Whether a checkpoint is due after `step` of `total` steps: every `every` steps, at the end,
/// and whenever [`CHECKPOINT_SECONDS`] have passed since the last one.
pub fn checkpoint_due(step: usize, total: usize, every: usize, since_last: f64) -> bool {
    step.is_multiple_of(every) || step == total || since_last >= CHECKPOINT_SECONDS
}

/// Trains (or resumes) a run; returns the final validation loss.
pub fn train(run: Option<RunConfig>, opts: &TrainOptions) -> Result<f64> {
    train_on(run, opts, None)
}

/// Trains (or resumes) a run in one process, or as one rank of `group` (every rank calls this
/// with the same arguments; rank 0 alone reads and writes the run directory). Returns the
/// final validation loss (NaN on the other ranks).
pub fn train_on(run: Option<RunConfig>, opts: &TrainOptions, group: Option<&Group>) -> Result<f64> {
    // A GPU run fails before it writes anything where it cannot run at all.
    let dev = match opts.device {
        Hardware::Cpu => None,
        #[cfg(test)]
        Hardware::Emulated(p) => Some((
            crate::gpu::device::Device::emulated("train").context("no emulated GPU here")?,
            p,
        )),
        Hardware::Cuda(p) => {
            anyhow::ensure!(
                group.is_none(),
                "--device cuda trains on one GPU in one process, not under mpirun"
            );
            Some((crate::gpu::device::Device::open(0)?, p))
        }
    };
    let mut trainer = match group {
        None => Trainer::start(run, opts, 1, true)?,
        Some(g) => Trainer::start_group(run, opts, g)?,
    };
    if let Some((dev, precision)) = dev {
        trainer.progress.say(format!("steps on GPU 0 ({}), {precision}", dev.arch));
        let (model, opt, recompute) = (&trainer.model, &trainer.opt, trainer.run.train.recompute);
        trainer.gpu = Some(gpu_trainer::start(dev, model, opt, precision, recompute)?);
    }
    if trainer.at.step == 0 {
        // A run is resumable from its first moment: a kill before the first regular checkpoint
        // resumes at step 0 instead of leaving a directory that can only be overwritten.
        trainer.lead(Whole::State, |t| t.checkpoint())?;
        if trainer.init.is_some() {
            // A run from a checkpoint starts where that model is: its loss before any step.
            trainer.lead(Whole::Weights, |t| t.evaluate_start())?;
        }
    }
    while trainer.at.step < trainer.total {
        let outcome = trainer.step()?;
        let (evaluated, checkpointed) = (trainer.evaluation_due(), trainer.agreed_checkpoint_due());
        let whole = match (evaluated, checkpointed) {
            (_, true) => Whole::State,
            (true, false) => Whole::Weights,
            (false, false) => Whole::Nothing,
        };
        if whole == Whole::State {
            trainer.sync_from_gpu(true)?;
        }
        trainer.lead(whole, |t| {
            let mut record = outcome.record(&t.at, t.run.train.batch_tokens);
            if evaluated {
                t.evaluate(&outcome, &mut record)?;
            }
            t.log(&outcome, record, evaluated)?;
            if checkpointed {
                t.checkpoint()?;
            }
            Ok(())
        })?;
    }
    trainer.sync_from_gpu(false)?;
    trainer.lead_finish()
}

/// What of the whole model rank 0's work after a step needs, where the ranks of a pipeline
/// hold parts of it ([`Trainer::lead`]): nothing, the weights (to validate) or the weights and
/// optimiser state (to write a checkpoint).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Whole {
    Nothing,
    Weights,
    State,
}

/// How far a run has got; saved in every checkpoint.
struct Position {
    /// Optimiser steps completed.
    step: usize,
    tokens_seen: u64,
    /// Training windows consumed (the data order's position).
    windows_seen: u64,
    /// Seconds in training steps alone (no validation or checkpoints), over every session.
    train_seconds: f64,
    /// Wall-clock seconds of the sessions before this one.
    earlier_seconds: f64,
}

impl StepOutcome {
    /// The step's line of `metrics.jsonl`, before validation and timing are added.
    /// `tokens`: the step's tokens.
    fn record(&self, at: &Position, tokens: usize) -> Value {
        let mut r = json!({
            "step": at.step, "tokens": at.tokens_seen, "train_loss": self.train_loss, "lr": self.lr,
            "grad_norm": self.grad_norm, "sublayer_grad_norms": self.sublayer_grad_norms,
        });
        if let Some(b) = self.pipeline_bytes {
            r["pp_bytes_sent"] = json!(b);
            r["pp_bytes_per_token"] = json!(b as f64 / tokens as f64);
        }
        r
    }
}

/// Training tokens per second since the last evaluation.
struct Throughput {
    tokens: u64,
    since: Instant,
}

/// A run in progress: settings, data, model, optimiser and where it writes.
struct Trainer<'g> {
    run: RunConfig,
    out: PathBuf,
    /// `--data` of the run (none: the embedded corpus).
    data: Option<PathBuf>,
    /// Hash of the tokenized data, to refuse resuming on other data.
    data_key: String,
    /// Every version of the code that trained part of the run, oldest first, this one last.
    code_versions: Vec<CodeVersion>,
    /// The checkpoint the run started from (`--init`).
    init: Option<PathBuf>,
    /// Files kept beside `tokenizer.json` (an imported model's `tokenizer_config.json` and
    /// chat template): name and text.
    tokenizer_files: Vec<(String, String)>,
    bpe: Bpe,
    tokens: Tokens,
    order: WindowOrder,
    model: Model,
    opt: Optimizer,
    total: usize,
    at: Position,
    /// `metrics.jsonl`, opened after the run's first checkpoint: a directory with metrics always
    /// holds a checkpoint to resume them from.
    metrics: Option<File>,
    /// The run directory's lock, held until the trainer is dropped (none on ranks other than
    /// 0, which do not write the run directory).
    _lock: Option<File>,
    /// A resumed checkpoint's optimiser state not loaded yet: a pipeline's rank 0 reads it
    /// tensor by tensor as it hands every stage its part.
    state_file: Option<PathBuf>,
    /// The ranks this one trains with (none: training alone).
    group: Option<&'g Group<'g>>,
    /// On rank 0 of a pipeline, while it writes a checkpoint: the optimiser state, put
    /// together from the stages as it is written.
    streamed: Option<parallel::StagesState<'g>>,
    /// When the last checkpoint was written.
    last_checkpoint: Instant,
    progress: Progress,
    started: Instant,
    throughput: Throughput,
    last_val: f64,
    /// Where the steps run when they run on a GPU.
    gpu: Option<Box<dyn DeviceSteps>>,
}

/// What every rank sets up for itself: the rest of a [`Trainer`] starts the same on every
/// rank, and what rank 0 alone has (the run directory's lock, files and history) it fills in
/// after ([`Trainer::start`]).
struct Setup<'g> {
    run: RunConfig,
    data: Option<PathBuf>,
    data_key: String,
    init: Option<PathBuf>,
    bpe: Bpe,
    tokens: Tokens,
    order: WindowOrder,
    model: Model,
    opt: Optimizer,
    at: Position,
    progress: Progress,
    group: Option<&'g Group<'g>>,
}

impl<'g> Trainer<'g> {
    fn new(s: Setup<'g>) -> Trainer<'g> {
        let now = Instant::now();
        Trainer {
            total: s.run.train.steps(),
            run: s.run,
            out: PathBuf::new(),
            data: s.data,
            data_key: s.data_key,
            code_versions: Vec::new(),
            init: s.init,
            tokenizer_files: Vec::new(),
            bpe: s.bpe,
            tokens: s.tokens,
            order: s.order,
            model: s.model,
            opt: s.opt,
            at: s.at,
            metrics: None,
            _lock: None,
            state_file: None,
            group: s.group,
            streamed: None,
            last_checkpoint: now,
            progress: s.progress,
            started: now,
            throughput: Throughput { tokens: 0, since: now },
            last_val: f64::NAN,
            gpu: None,
        }
    }
}

impl<'g> Trainer<'g> {
    /// One optimiser step: forward and backward over `accumulation` micro-batches (on several
    /// ranks: this rank's share of them), gradient clipping, the update.
    fn step(&mut self) -> Result<StepOutcome> {
        let tc = &self.run.train;
        let t_step = Instant::now();
        let lr = lr_at(&tc.optim, self.at.step, self.total);
        parallel::fault::fault_point(self.group.map_or(0, |g| g.rank()), self.at.step + 1);
        let accumulation = tc.accumulation();
        let share = match self.group {
            None => 0..accumulation,
            Some(g) => g.share(accumulation),
        };
        let first = self.at.windows_seen;
        let micro_batches: Vec<_> = share
            .map(|i| {
                let at = first + (i * tc.micro_batch) as u64;
                micro_batch(&self.tokens, &mut self.order, at, tc.micro_batch)
            })
            .collect();
        self.at.windows_seen += (accumulation * tc.micro_batch) as u64;
        let (model, opt, step) = (&mut self.model, &mut self.opt, self.at.step);
        let pass = Pass { rows: tc.micro_batch, recompute: tc.recompute };
        let done = match (self.group, self.gpu.as_mut()) {
            (_, Some(gpu)) => gpu.step(&micro_batches, tc.micro_batch, lr, step)?,
            (None, None) => optimizer_step(model, opt, &micro_batches, pass, lr, step)?,
            (Some(g), None) => g.optimizer_step(model, opt, &micro_batches, pass, lr, step)?,
        };
        self.at.train_seconds += t_step.elapsed().as_secs_f64();
        self.at.step += 1;
        self.at.tokens_seen += tc.batch_tokens as u64;
        self.throughput.tokens += tc.batch_tokens as u64;
        Ok(done)
    }

    fn evaluation_due(&self) -> bool {
        self.at.step.is_multiple_of(self.run.train.eval_every) || self.at.step == self.total
    }

    /// [`Self::checkpoint_due`] as rank 0, which writes checkpoints, sees it, on every rank
    /// (the time since the last checkpoint is rank 0's).
    fn agreed_checkpoint_due(&self) -> bool {
        let mut due = [self.checkpoint_due() as u8];
        if let Some(g) = self.group {
            g.broadcast_from_leader(&mut due);
        }
        due[0] != 0
    }

    fn checkpoint_due(&self) -> bool {
        checkpoint_due(
            self.at.step,
            self.total,
            self.run.train.checkpoint_every,
            self.last_checkpoint.elapsed().as_secs_f64(),
        )
    }

    /// Validation loss and bits per byte, into the step's record and the log.
    fn evaluate(&mut self, done: &StepOutcome, record: &mut Value) -> Result<()> {
        let (val_loss, bpb) = self.validate()?;
        self.last_val = val_loss;
        record["val_loss"] = json!(val_loss);
        record["val_bits_per_byte"] = json!(bpb);
        let (step, total, train_loss) = (self.at.step, self.total, done.train_loss);
        self.progress.say(format!("step {step}/{total}: train loss {train_loss:.4}, val loss {val_loss:.4}, val bits/byte {bpb:.4}"));
        Ok(())
    }

    /// The loss before the first step, as metrics.jsonl's line of step 0 (unless a run resumed
    /// at step 0 wrote it already).
    fn evaluate_start(&mut self) -> Result<()> {
        let path = self.out.join(METRICS);
        if std::fs::read_to_string(&path).is_ok_and(|t| !t.trim().is_empty()) {
            return Ok(());
        }
        let (val_loss, bpb) = self.validate()?;
        let record =
            json!({"step": 0, "tokens": 0, "val_loss": val_loss, "val_bits_per_byte": bpb});
        write_atomic(&path, format!("{record}\n").as_bytes())?;
        self.progress.say(format!(
            "step 0/{}: val loss {val_loss:.4}, val bits/byte {bpb:.4} (the model of --init)",
            self.total
        ));
        Ok(())
    }

    fn validate(&self) -> Result<(f64, f64)> {
        let tc = &self.run.train;
        let (tokens, seq, rows, max) = (&self.tokens, tc.seq_len, tc.micro_batch, tc.eval_tokens);
        match &self.gpu {
            Some(gpu) => validate_by(tokens, seq, rows, max, |x, y, r, t| gpu.loss(x, y, r, t)),
            None => validate(&self.model, tokens, seq, rows, max),
        }
    }

    /// The GPU's weights (and, with `state`, optimiser state) into the host's model and
    /// optimiser, which checkpoints, diagnostics and the summary read.
    fn sync_from_gpu(&mut self, state: bool) -> Result<()> {
        if let Some(gpu) = &self.gpu {
            gpu.sync(&mut self.model, state.then_some(&mut self.opt))?;
            if let Some(name) =
                crate::train::step::first_non_finite(&self.model.layout, &self.model.params)
            {
                anyhow::bail!(
                    "the weights became non-finite on the GPU by step {} (first in {name}); {}",
                    self.at.step,
                    crate::train::step::non_finite_advice(
                        &self.run.train.optim,
                        self.at.step,
                        true
                    )
                );
            }
        }
        Ok(())
    }

    /// Appends the step's record to `metrics.jsonl` and shows progress; the throughput window
    /// restarts at every regular evaluation.
    fn log(&mut self, done: &StepOutcome, mut record: Value, evaluated: bool) -> Result<()> {
        let tps = self.throughput.tokens as f64 / self.throughput.since.elapsed().as_secs_f64();
        record["tokens_per_second"] = json!(tps);
        record["elapsed_seconds"] = json!(self.elapsed_seconds());
        let path = self.out.join(METRICS);
        let metrics = match &mut self.metrics {
            Some(f) => f,
            None => self.metrics.insert(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&path)
                    .with_context(|| format!("cannot open {}", path.display()))?,
            ),
        };
        // One write per line: a run killed mid-record must not leave half a line behind.
        metrics
            .write_all(format!("{record}\n").as_bytes())
            .and_then(|()| metrics.flush())
            .with_context(|| format!("cannot write {}", path.display()))?;
        self.progress.step(self.at.step, self.total, done.train_loss, tps, evaluated);
        if self.at.step.is_multiple_of(self.run.train.eval_every) {
            self.throughput = Throughput { tokens: 0, since: Instant::now() };
        }
        Ok(())
    }

    fn elapsed_seconds(&self) -> f64 {
        self.at.earlier_seconds + self.started.elapsed().as_secs_f64()
    }

    fn checkpoint(&mut self) -> Result<()> {
        let state = TrainState {
            run: self.run.clone(),
            step: self.at.step,
            tokens_seen: self.at.tokens_seen,
            windows_seen: self.at.windows_seen,
            elapsed_seconds: self.elapsed_seconds(),
            train_seconds: self.at.train_seconds,
            data_key: self.data_key.clone(),
            data: self.data.clone(),
            code_versions: self.code_versions.clone(),
            init: self.init.clone(),
        };
        let mut held = &self.opt;
        let source: &mut dyn run_dir::StateSource = match self.streamed.as_mut() {
            Some(s) => s,
            None => &mut held,
        };
        run_dir::save(&self.out, &self.model, &self.bpe, &self.tokenizer_files, source, &state)?;
        self.last_checkpoint = Instant::now();
        Ok(())
    }

    /// Final validation, diagnostics and `summary.json`; returns the final validation loss.
    /// `timings`: of the ranks, when there are several ([`Group::timings`]).
    fn finish(mut self, timings: Option<(Vec<String>, Value)>) -> Result<f64> {
        if self.last_val.is_nan() {
            self.last_val = self.validate()?.0;
        }
        let (tokens, tc, last_val) = (&self.tokens, &self.run.train, self.last_val);
        let (unigram, val_bpb) = (
            unigram_bits_per_byte(tokens, self.bpe.vocab_size()),
            last_val / std::f64::consts::LN_2 / (tokens.val_bytes as f64 / tokens.val_len() as f64),
        );
        let val: Vec<u32> = tokens.val(0..tokens.val_len());
        let diag = crate::model::diagnostics::diagnose(
            &self.model,
            &val,
            tc.seq_len,
            tc.micro_batch,
            tc.eval_tokens,
        )?;
        let out = &self.out;
        write_atomic(
            &out.join("diagnostics.json"),
            serde_json::to_string_pretty(&diag)?.as_bytes(),
        )?;
        let at = &self.at;
        let mut summary = json!({
            "residual": self.model.config.residual_label(), "parameters": self.model.params.len(), "steps": at.step, "tokens": at.tokens_seen,
            "val_loss": last_val, "val_bits_per_byte": val_bpb, "unigram_val_bits_per_byte": unigram,
            "elapsed_seconds": self.elapsed_seconds(),
            "train_seconds": at.train_seconds, "train_tokens_per_second": at.tokens_seen as f64 / at.train_seconds.max(1e-9),
            "code_version": CodeVersion::current(), "trained_by": self.code_versions,
            "ranks": self.group.map_or(1, |g| g.size()),
        });
        if let Some((_, t)) = &timings {
            summary["rank_seconds"] = t.clone();
        }
        if let Some(g) = self.group {
            summary["reduce"] = json!(g.reduce.name());
            if g.layout.is_pipeline() {
                let l = g.layout;
                summary["pp"] = json!(l.stages);
                summary["vpp"] = json!(l.virtual_stages);
                summary["pp_cache"] = json!(l.cache.name());
            }
        }
        write_atomic(
            &out.join("summary.json"),
            serde_json::to_string_pretty(&summary)?.as_bytes(),
        )?;
        for line in timings.iter().flat_map(|t| &t.0) {
            self.progress.say(line.clone());
        }
        self.progress.say(format!(
            "done: step {}, validation loss {last_val:.4} ({val_bpb:.4} bits/byte; a unigram model of the training tokens: {unigram:.4} bits/byte); model in {}",
            at.step,
            out.display()
        ));
        self.progress.finish();
        Ok(last_val)
    }
}
