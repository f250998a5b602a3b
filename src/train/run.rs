//! The training loop: set a run up (fresh, resumed or overwritten), then step, log, evaluate
//! and checkpoint until the token budget is spent, then write the run's summary.
//!
//! Settings live in [`super::config`], the run directory's files in [`super::checkpoint`],
//! progress output in [`super::progress`] and the loss measurements in [`super::validation`].
//! Training over several ranks is in [`parallel`].

pub mod parallel;
pub mod pipeline;

use super::checkpoint::{self as run_dir, TrainState, METRICS};
use super::config::RunConfig;
use super::data::{Corpus, Split};
use super::optim::{global_norm, lr_at, tensor_squares, Optimizer};
use super::progress::{Progress, SharedBar};
use super::tokenizer::Bpe;
use super::tokens::{cache_dir, content_key, Tokens, WindowOrder};
use super::validation::{unigram_bits_per_byte, validate};
use crate::fs::write_atomic;
use crate::kernels;
use crate::model::params::Layout as ParamLayout;
use crate::model::{checkpoint, Model};
use crate::version::CodeVersion;
use anyhow::{bail, ensure, Context, Result};
use parallel::Group;
use serde_json::{json, Value};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
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
    let mut trainer = match group {
        None => Trainer::start(run, opts, 1, true)?,
        Some(g) => Trainer::start_group(run, opts, g)?,
    };
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

/// What one optimiser step produced.
pub struct StepOutcome {
    /// The learning rate of the step.
    pub lr: f64,
    /// The mean loss over the step's micro-batches.
    pub train_loss: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// The gradient norm of each sublayer's own weights, before clipping.
    pub sublayer_grad_norms: Vec<f64>,
    /// Under pipeline parallelism: bytes all ranks sent in pipeline transfers.
    pub pipeline_bytes: Option<u64>,
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
}

/// A checkpoint to resume from: its directory and state.
struct Resume {
    dir: PathBuf,
    state: TrainState,
}

impl Resume {
    /// The checkpoint to resume with `--resume`; without it, none, and an earlier run in the
    /// directory is refused unless `--overwrite` was given. Settings given with `--resume` must
    /// equal the run's own; a run without a checkpoint then starts again from step 0 (none: a
    /// note for the log says so).
    fn find(
        settings: Option<&RunConfig>,
        opts: &TrainOptions,
        has_run: bool,
    ) -> Result<(Option<Resume>, Option<String>)> {
        let out = &opts.out;
        if !opts.resume {
            ensure!(!has_run || opts.overwrite, "{} already holds a training run; pass --resume to continue it or --overwrite to start over", out.display());
            return Ok((None, None));
        }
        let dir = match (run_dir::checkpoint_dir(out), settings) {
            (Ok(dir), _) => dir,
            (Err(_), Some(_)) => {
                let note = format!(
                    "{} holds no checkpoint (the run stopped before it saved one): starting it again from step 0",
                    out.display()
                );
                return Ok((None, Some(note)));
            }
            // Nothing of the run was saved, its settings included: only its command can say them.
            (Err(_), None) if !has_run => bail!(
                "{} holds no checkpoint: the run stopped before saving one, so its settings are unknown; repeat the command that started it (with or without --resume)",
                out.display()
            ),
            (Err(e), None) => return Err(e),
        };
        let mut state = run_dir::read_state(&dir)?;
        if let Some(init) = &opts.init {
            ensure!(
                state.init.as_deref() == Some(init.as_path()),
                "{} was not started from {} (--init): it started from {}; resume it with its own command",
                out.display(),
                init.display(),
                state.init.as_ref().map_or("a fresh model".to_string(), |p| p.display().to_string())
            );
        }
        if let Some(want) = settings {
            if let Some((key, have, asked)) = state.run.first_difference(want)? {
                bail!(
                    "{} was trained with other settings ({key}: {have} there, {asked} asked); resume it with its own settings (drop --preset/--config/--set), or start over with --overwrite",
                    out.display()
                );
            }
            // A run may go on with or without recomputation: the same bits either way.
            state.run.train.recompute = want.train.recompute;
        }
        Ok((Some(Resume { dir, state }), None))
    }
}

impl Position {
    /// Where a resumed run stopped (its optimiser state restored into `opt`, metrics after its
    /// checkpoint dropped), or the start of a new run in a new directory. Without `load`, only
    /// the state's step is restored (and its file checked): a pipeline's rank 0 reads the rest
    /// as it hands it out ([`Trainer::state_file`]).
    fn restore(
        resume: Option<&Resume>,
        opt: &mut Optimizer,
        out: &Path,
        load: bool,
    ) -> Result<Position> {
        let Some(r) = resume else {
            return Ok(Position {
                step: 0,
                tokens_seen: 0,
                windows_seen: 0,
                train_seconds: 0.0,
                earlier_seconds: 0.0,
            });
        };
        let path = r.dir.join("optimizer.safetensors");
        if load {
            run_dir::load_optimizer(opt, &path)?;
        } else {
            opt.step = run_dir::StateFile::open(&path, opt.m.len())?.step();
        }
        let s = &r.state;
        ensure!(
            opt.step as usize == s.step,
            "the checkpoint's optimizer state is from step {}, its train_state from step {}",
            opt.step,
            s.step
        );
        run_dir::truncate_metrics(&out.join(METRICS), s.step)?;
        Ok(Position {
            step: s.step,
            tokens_seen: s.tokens_seen,
            windows_seen: s.windows_seen,
            train_seconds: s.train_seconds,
            earlier_seconds: s.elapsed_seconds,
        })
    }
}

impl<'g> Trainer<'g> {
    /// Checks the request against the run directory, loads or builds settings, tokenizer, data,
    /// model and optimiser, and announces the run, which `ranks` ranks will train.
    /// Without `load_state` a resumed run's optimiser state stays in its file (`state_file`).
    fn start(
        run: Option<RunConfig>,
        opts: &TrainOptions,
        ranks: usize,
        load_state: bool,
    ) -> Result<Trainer<'g>> {
        let out = &opts.out;
        ensure!(
            !opts.resume || out.is_dir(),
            "{} holds no checkpoint to resume (there is no such directory)",
            out.display()
        );
        std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
        // One writer per run directory, from before anything is read until the process ends.
        let lock = run_dir::lock(out)?;
        run_dir::remove_stale_temporaries(out)?;
        let has_run = run_dir::holds_run(out);
        let (resume, restart_note) = Resume::find(run.as_ref(), opts, has_run)?;

        // Data: as given, else the resumed run's own, else the embedded corpus.
        let data = opts.data.clone().or_else(|| resume.as_ref().and_then(|r| r.state.data.clone()));
        let corpus = match &data {
            Some(p) => Corpus::from_path(p)?,
            None => Corpus::embedded(),
        };
        let split = corpus.split();
        let (run, bpe, model) = match (&resume, &opts.init) {
            (Some(r), _) => resumed_model(r)?,
            (None, Some(dir)) => init_model(run, dir)?,
            (None, None) => fresh_model(run, opts, &split)?,
        };
        let (init, tokenizer_files) = match (&resume, &opts.init) {
            (Some(r), _) => (r.state.init.clone(), run_dir::read_tokenizer_extras(&r.dir)?),
            (None, Some(dir)) => (Some(dir.clone()), run_dir::read_tokenizer_extras(dir)?),
            (None, None) => (None, Vec::new()),
        };
        let tc = &run.train;
        parallel::check_share(tc, ranks)?;
        let (tokens, reused) = Tokens::load_or_build(&split, &bpe)?;
        let data_key = tokens.key();
        if let Some(r) = &resume {
            check_data_key(&r.state.data_key, &tokens)?;
        }
        ensure!(
            tokens.val_len() >= 2,
            "the validation split is empty: use a corpus with more text"
        );
        let order = WindowOrder::new(tokens.train_len(), tc.seq_len, tc.seed)?;
        if resume.is_none() && has_run {
            // --overwrite, or a run without a checkpoint started again: everything is checked;
            // clear the old run before the new one writes anything.
            run_dir::clear(out)?;
        }

        let mut opt = Optimizer::new(tc.optim.clone(), &model.layout);
        let at = Position::restore(resume.as_ref(), &mut opt, out, load_state)?;
        let state_file =
            resume.as_ref().filter(|_| !load_state).map(|r| r.dir.join("optimizer.safetensors"));

        let total = tc.steps();
        let progress =
            Progress::new(opts.shared_bar.as_ref(), opts.progress, total as u64, at.step as u64);
        if let Some(note) = restart_note {
            progress.say(note);
        }
        let (code_versions, other_version) = code_versions(resume.as_ref());
        if let Some(v) = other_version {
            progress.say(format!(
                "resuming a checkpoint written by {v}; this is attnres {}",
                CodeVersion::current()
            ));
        }
        progress.say(format!(
            "{}: {} ({} documents, {:.1} MB), {} train / {} val tokens{}, vocab {}, {} parameters, residual {}{}",
            if resume.is_some() { format!("resuming at step {}/{total}", at.step) } else { format!("training {total} steps") },
            corpus.name,
            corpus.documents.len(),
            corpus.bytes() as f64 / 1e6,
            tokens.train_len(),
            tokens.val_len(),
            if reused { " (cached)" } else { "" },
            bpe.vocab_size(),
            model.params.len(),
            model.config.residual_label(),
            init.as_ref().map_or(String::new(), |p| format!(", from {}", p.display())),
        ));
        Ok(Trainer {
            run,
            out: out.clone(),
            data,
            data_key,
            code_versions,
            init,
            tokenizer_files,
            bpe,
            tokens,
            order,
            model,
            opt,
            total,
            at,
            metrics: None,
            _lock: Some(lock),
            state_file,
            group: None,
            streamed: None,
            last_checkpoint: Instant::now(),
            progress,
            started: Instant::now(),
            throughput: Throughput { tokens: 0, since: Instant::now() },
            last_val: f64::NAN,
        })
    }

    /// One optimiser step: forward and backward over `accumulation` micro-batches (on several
    /// ranks: this rank's share of them), gradient clipping, the update.
    fn step(&mut self) -> Result<StepOutcome> {
        let tc = &self.run.train;
        let t_step = Instant::now();
        let lr = lr_at(&tc.optim, self.at.step, self.total);
        parallel::fault_point(self.group.map_or(0, |g| g.rank()), self.at.step + 1);
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
        let done = match self.group {
            None => optimizer_step(model, opt, &micro_batches, pass, lr, step)?,
            Some(g) => g.optimizer_step(model, opt, &micro_batches, pass, lr, step)?,
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
        validate(&self.model, &self.tokens, tc.seq_len, tc.micro_batch, tc.eval_tokens)
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
        let diag = crate::diagnostics::diagnose(
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

/// The versions of the code that trained the run so far, this one last, and the version that
/// wrote the checkpoint being resumed, when it is another one.
fn code_versions(resume: Option<&Resume>) -> (Vec<CodeVersion>, Option<String>) {
    let current = CodeVersion::current();
    let mut versions = resume.map(|r| r.state.code_versions.clone()).unwrap_or_default();
    let other = match (resume, versions.last()) {
        (None, _) => None,
        (Some(_), None) => Some("a version of attnres that did not record itself".to_string()),
        (Some(_), Some(v)) => (*v != current).then(|| format!("attnres {v}")),
    };
    if versions.last() != Some(&current) {
        versions.push(current);
    }
    (versions, other)
}

/// Refuses to resume on other data than the run's. Keys written before they were taken from
/// the content named the token cache's path: those match only at that same path.
fn check_data_key(saved: &str, tokens: &Tokens) -> Result<()> {
    if saved == tokens.key() {
        return Ok(());
    }
    let by_path = content_key(&[tokens.path.to_string_lossy().as_bytes()]);
    if saved == by_path {
        return Ok(());
    }
    if !saved.starts_with("tokens-") {
        bail!(
            "the run being resumed identified its data by the path of its token cache file (an older attnres) and the cache is now {}; resume with the token cache it was trained with (ATTNRES_CACHE), or check that the training data (or tokenizer) is the same",
            tokens.path.display()
        );
    }
    bail!("the training data (or tokenizer) differs from the run being resumed")
}

/// Settings, tokenizer and model of the checkpoint being resumed.
fn resumed_model(r: &Resume) -> Result<(RunConfig, Bpe, Model)> {
    let bpe = Bpe::load(&r.dir.join("tokenizer.json"))?;
    let model = checkpoint::load(&r.dir).context("cannot load the checkpoint's model")?;
    ensure!(
        model.config == r.state.run.model,
        "the checkpoint's config.json does not match its train_state.json"
    );
    Ok((r.state.run.clone(), bpe, model))
}

/// The settings of a run that starts from the checkpoint in `dir` (`train --init`): the model's
/// are its `config.json`; the training settings are `base`'s with `sets` laid over. A model
/// setting in `sets` is an error: the weights fix the model.
pub fn init_settings(dir: &Path, base: &RunConfig, sets: &[String]) -> Result<RunConfig> {
    ensure!(dir.is_dir(), "--init {} is not a checkpoint directory", dir.display());
    let path = dir.join(checkpoint::CONFIG_FILE);
    // Checked before the run directory is touched.
    for f in [checkpoint::CONFIG_FILE, checkpoint::WEIGHTS_FILE] {
        ensure!(dir.join(f).exists(), "--init {} holds no {f}", dir.display());
    }
    ensure!(
        dir.join("tokenizer.json").exists(),
        "--init {} has no tokenizer.json: a run continues with its model's own tokenizer (an import or a training run has one)",
        dir.display()
    );
    let model = crate::model::Config::from_json(&crate::fs::read_utf8(&path)?)
        .with_context(|| format!("in {}", path.display()))?;
    let Value::Object(model_keys) = serde_json::to_value(&model)? else { unreachable!() };
    for s in sets {
        let k = s.split_once('=').map_or(s.as_str(), |(k, _)| k).trim();
        ensure!(
            !model_keys.contains_key(k),
            "--set {k}: with --init the model's settings are those of {} (to change the residual connection, convert it: attnres convert)",
            path.display()
        );
    }
    RunConfig { model, train: base.train.clone() }.with_overrides(sets)
}

/// A run from the checkpoint in `dir`: its tokenizer (with the end-of-text token its
/// `tokenizer_config.json` names) and its weights, which must be those `run` describes.
fn init_model(run: Option<RunConfig>, dir: &Path) -> Result<(RunConfig, Bpe, Model)> {
    let run = run.context("no settings given")?;
    let bpe = Bpe::load(&dir.join("tokenizer.json"))?;
    let model = checkpoint::load(dir)
        .with_context(|| format!("--init {}: cannot load the model", dir.display()))?;
    ensure!(
        model.config == run.model,
        "--init {}: config.json changed while the run was set up",
        dir.display()
    );
    ensure!(
        bpe.vocab_size() <= model.config.vocab_size,
        "--init {}: tokenizer.json has {} tokens, the model only {}",
        dir.display(),
        bpe.vocab_size(),
        model.config.vocab_size
    );
    Ok((run, bpe, model))
}

/// A new run: the tokenizer given or trained on the data (its size sets the vocabulary), then a
/// freshly initialised model.
fn fresh_model(
    run: Option<RunConfig>,
    opts: &TrainOptions,
    split: &Split,
) -> Result<(RunConfig, Bpe, Model)> {
    let mut run = run.context("no settings given")?;
    let bpe = match &opts.tokenizer {
        Some(p) => Bpe::load(p)?,
        None => cached_tokenizer(split, run.model.vocab_size)?,
    };
    run.model.vocab_size = bpe.vocab_size();
    run.model.validate()?;
    run.train.validate(&run.model)?;
    let model = Model::init(run.model.clone(), run.train.seed)?;
    Ok((run, bpe, model))
}

/// How each micro-batch of a step goes through the model: `rows` sequences of token ids, and
/// with `recompute`, backward recomputes each sublayer's work from its input instead of keeping
/// it from forward ([`Model::forward_with`]; `TrainConfig::recompute`).
#[derive(Clone, Copy, Debug)]
pub struct Pass {
    pub rows: usize,
    pub recompute: bool,
}

impl Pass {
    /// `rows` sequences per micro-batch, everything kept from forward.
    pub fn rows(rows: usize) -> Pass {
        Pass { rows, recompute: false }
    }
}

/// One optimiser step as training takes it: forward and backward over each micro-batch (as
/// `pass` says, with their targets), the mean gradient, clipping, then the update at learning
/// rate `lr`. `step` (from 0) names the step in the error for a non-finite loss.
pub fn optimizer_step(
    model: &mut Model,
    opt: &mut Optimizer,
    micro_batches: &[(Vec<u32>, Vec<u32>)],
    pass: Pass,
    lr: f64,
    step: usize,
) -> Result<StepOutcome> {
    ensure!(!micro_batches.is_empty(), "a step needs at least one micro-batch");
    let mut grads = kernels::zeros(model.params.len());
    let losses = backward_each(model, &opt.config, micro_batches, pass, step, |g| {
        kernels::add_assign(&mut grads, &g)
    })?;
    apply_gradients(model, opt, grads, &losses, lr, step, &whole_norms)
}

/// Each tensor's sum of squared gradients and each sublayer's gradient norm, of the whole
/// model, from the gradients `grads` of the tensors of `layout`: in one process these are all
/// of them; a pipeline stage gathers the other stages' ([`Group`]).
type Norms<'a> = &'a dyn Fn(&ParamLayout, &[f32]) -> (Vec<f64>, Vec<f64>);

/// [`Norms`] of one process, which holds every tensor.
fn whole_norms(layout: &ParamLayout, grads: &[f32]) -> (Vec<f64>, Vec<f64>) {
    (tensor_squares(layout, grads), crate::diagnostics::sublayer_grad_norms(layout, grads))
}

/// Forward and backward over each micro-batch in order: hands each gradient to `take` and
/// returns the losses; a non-finite loss is an error naming step `step` (from 0).
fn backward_each(
    model: &Model,
    o: &super::optim::OptimConfig,
    micro_batches: &[(Vec<u32>, Vec<u32>)],
    pass: Pass,
    step: usize,
    mut take: impl FnMut(Vec<f32>),
) -> Result<Vec<f32>> {
    let mut losses = Vec::with_capacity(micro_batches.len());
    for (ids, targets) in micro_batches {
        let rows = pass.rows;
        let fwd = model.forward_with(ids, rows, ids.len() / rows, pass.recompute)?;
        let (loss, g) = model.backward(&fwd, targets)?;
        check_loss(loss, o, step)?;
        losses.push(loss);
        take(g);
    }
    Ok(losses)
}

/// Refuses a non-finite loss of step `step` (from 0).
fn check_loss(loss: f32, o: &super::optim::OptimConfig, step: usize) -> Result<()> {
    // Steps are numbered from 1 in errors, as in metrics.jsonl.
    ensure!(
        loss.is_finite(),
        "the training loss became {loss} at step {}; {}",
        step + 1,
        non_finite_advice(o, step, false)
    );
    Ok(())
}

/// The rest of a step once `grads` holds the sum of the gradients of the step's micro-batches
/// (`losses`: theirs, in order): the mean, clipping (by the whole model's norm, from
/// `norms`), the update.
fn apply_gradients(
    model: &mut Model,
    opt: &mut Optimizer,
    mut grads: Vec<f32>,
    losses: &[f32],
    lr: f64,
    step: usize,
    norms: Norms,
) -> Result<StepOutcome> {
    let loss_sum: f64 = losses.iter().fold(0.0, |s, &l| s + l as f64);
    let n = step + 1;
    let accum = losses.len();
    if accum > 1 {
        let s = 1.0 / accum as f32;
        grads.iter_mut().for_each(|g| *g *= s);
    }
    let (squares, sublayer_grad_norms) = norms(&model.layout, &grads);
    let grad_norm = global_norm(&squares);
    opt.clip(&mut grads, grad_norm);
    if !grad_norm.is_finite() {
        bail!(
            "the gradient norm became {grad_norm} at step {n} (first in {}); {}",
            first_non_finite(&model.layout, &grads).unwrap_or("another pipeline stage's tensors"),
            non_finite_advice(&opt.config, step, false)
        );
    }
    opt.update(&mut model.params, &grads, lr);
    if let Some(name) = first_non_finite(&model.layout, &model.params) {
        bail!(
            "the weights became non-finite in the update of step {n} (first in {name}); {}",
            non_finite_advice(&opt.config, step, true)
        );
    }
    Ok(StepOutcome {
        lr,
        train_loss: loss_sum / accum as f64,
        grad_norm,
        sublayer_grad_norms,
        pipeline_bytes: None,
    })
}

/// The name of the first tensor of `layout` holding a non-finite value of `values`.
fn first_non_finite<'a>(
    layout: &'a crate::model::params::Layout,
    values: &[f32],
) -> Option<&'a str> {
    layout
        .specs
        .iter()
        .find(|s| values[s.range.clone()].iter().any(|x| !x.is_finite()))
        .map(|s| s.name.as_str())
}

/// What to change when a value of step `step` (from 0) became non-finite; `updated`: it
/// appeared in the update itself rather than in the forward or backward pass.
fn non_finite_advice(o: &super::optim::OptimConfig, step: usize, updated: bool) -> String {
    if step == 0 && !updated {
        // No update has happened yet: the settings of the model itself overflow.
        "the untrained model already overflows: check the model settings (rope_theta, initializer_range, rms_norm_eps, hidden_size)".to_string()
    } else if o.adam_eps == 0.0 {
        "adam_eps = 0 divides by zero wherever a gradient is zero: set adam_eps > 0 (e.g. 1e-8)"
            .to_string()
    } else {
        format!(
            "training diverged: lower lr (now {}){}",
            o.lr,
            if o.grad_clip == 0.0 { " or enable grad_clip" } else { "" }
        )
    }
}

/// The `micro_batch` training windows from position `first` of the data order: inputs and
/// their next-token targets.
fn micro_batch(
    tokens: &Tokens,
    order: &mut WindowOrder,
    first: u64,
    micro_batch: usize,
) -> (Vec<u32>, Vec<u32>) {
    let seq = order.seq;
    let (mut ids, mut targets) =
        (Vec::with_capacity(micro_batch * seq), Vec::with_capacity(micro_batch * seq));
    for w in 0..micro_batch as u64 {
        let s = order.start(first + w);
        let w = tokens.train(s..s + seq + 1);
        ids.extend_from_slice(&w[..seq]);
        targets.extend_from_slice(&w[1..]);
    }
    (ids, targets)
}

/// A tokenizer trained on the training split, cached by (text, vocabulary size).
fn cached_tokenizer(split: &Split, vocab_size: usize) -> Result<Bpe> {
    let mut parts: Vec<&[u8]> = split.train.iter().map(|d| d.as_bytes()).collect();
    let v = vocab_size.to_le_bytes();
    parts.push(&v);
    let path = cache_dir().join(format!("tokenizer-{}.json", content_key(&parts)));
    if let Ok(b) = Bpe::load(&path) {
        return Ok(b);
    }
    let b = Bpe::train(&split.train, vocab_size)?;
    std::fs::create_dir_all(cache_dir())?;
    write_atomic(&path, b.to_json()?.as_bytes())?;
    Ok(b)
}
