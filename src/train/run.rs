//! The training run: settings, the loop, validation, metrics and resumable checkpoints.
//!
//! A run directory holds the latest model as a checkpoint (`config.json`, `model.safetensors`,
//! `tokenizer.json`), `metrics.jsonl` (one JSON object per logged step) and `ckpt/`, the full
//! state a resume needs: model, tokenizer, optimiser moments, step, data position and the run's
//! settings. `ckpt/` is replaced as a whole: the new state is written to `.ckpt.tmp/`, the old one
//! renamed away, the new one renamed in, so a run killed at any moment resumes from the last
//! complete checkpoint.

use super::data::{Corpus, Split};
use super::optim::{lr_at, OptimConfig, Optimizer};
use super::tokenizer::Bpe;
use super::tokens::{cache_dir, content_key, Tokens, WindowOrder};
use crate::kernels;
use crate::model::checkpoint::{self, f32_values, safetensors_bytes, write_atomic};
use crate::model::{Config, Model};
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Training settings (the `[train]` table of a config file or preset).
// Unknown keys are caught by `overlay_train` (serde cannot deny them next to `flatten`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct TrainConfig {
    /// Tokens per training sequence (at most `max_position_embeddings`).
    pub seq_len: usize,
    /// Sequences per forward/backward pass.
    pub micro_batch: usize,
    /// Tokens per optimiser step; a multiple of `micro_batch · seq_len` (the rest is gradient
    /// accumulation).
    pub batch_tokens: usize,
    /// Training budget in tokens; the run takes `max_tokens / batch_tokens` steps.
    pub max_tokens: u64,
    /// Validate every this many steps (and at the end).
    pub eval_every: usize,
    /// Validation tokens per evaluation (0: the whole validation split).
    pub eval_tokens: usize,
    /// Write a resumable checkpoint every this many steps (and at the end).
    pub checkpoint_every: usize,
    /// Seed of the initialisation and of the data order.
    pub seed: u64,
    #[serde(flatten)]
    pub optim: OptimConfig,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            seq_len: 256,
            micro_batch: 8,
            batch_tokens: 16384,
            max_tokens: 1_000_000,
            eval_every: 20,
            eval_tokens: 65536,
            checkpoint_every: 50,
            seed: 0,
            optim: OptimConfig::default(),
        }
    }
}

impl TrainConfig {
    pub fn steps(&self) -> usize {
        (self.max_tokens / self.batch_tokens as u64) as usize
    }

    pub fn accumulation(&self) -> usize {
        self.batch_tokens / (self.micro_batch * self.seq_len)
    }

    pub fn validate(&self, model: &Config) -> Result<()> {
        for (k, v) in [
            ("seq_len", self.seq_len),
            ("micro_batch", self.micro_batch),
            ("batch_tokens", self.batch_tokens),
            ("eval_every", self.eval_every),
            ("checkpoint_every", self.checkpoint_every),
        ] {
            ensure!(v > 0, "train: {k} must be positive, got {v}");
        }
        ensure!(
            self.seq_len <= model.max_position_embeddings,
            "train: seq_len = {} exceeds the model's max_position_embeddings = {}",
            self.seq_len,
            model.max_position_embeddings
        );
        let per = self.micro_batch * self.seq_len;
        ensure!(
            self.batch_tokens.is_multiple_of(per),
            "train: batch_tokens = {} must be a multiple of micro_batch x seq_len = {per}",
            self.batch_tokens
        );
        ensure!(
            self.steps() > 0,
            "train: max_tokens = {} is less than one batch of {} tokens",
            self.max_tokens,
            self.batch_tokens
        );
        let o = &self.optim;
        for (k, v) in [
            ("lr", o.lr),
            ("weight_decay", o.weight_decay),
            ("grad_clip", o.grad_clip),
            ("adam_eps", o.adam_eps),
        ] {
            ensure!(
                v.is_finite() && v >= 0.0,
                "train: {k} must be a finite non-negative number, got {v}"
            );
        }
        ensure!(o.lr > 0.0, "train: lr must be positive, got {}", o.lr);
        for (k, v) in [
            ("beta1", o.beta1),
            ("beta2", o.beta2),
            ("muon_momentum", o.muon_momentum),
            ("min_lr_ratio", o.min_lr_ratio),
            ("decay_fraction", o.decay_fraction),
        ] {
            ensure!((0.0..=1.0).contains(&v), "train: {k} must lie in [0, 1], got {v}");
        }
        Ok(())
    }
}

/// A full run description: the model and the training settings.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct RunConfig {
    pub model: Config,
    pub train: TrainConfig,
}

impl RunConfig {
    /// Parses a TOML document with `[model]` and `[train]` tables laid over the defaults.
    pub fn from_toml(text: &str, origin: &str) -> Result<RunConfig> {
        let doc: toml::Table =
            toml::from_str(text).with_context(|| format!("{origin}: invalid TOML"))?;
        for k in doc.keys() {
            ensure!(
                k == "model" || k == "train",
                "{origin}: unknown table [{k}] (expected [model] and [train])"
            );
        }
        let table = |name: &str| -> Result<Map<String, Value>> {
            match doc.get(name).map(serde_json::to_value).transpose()? {
                None => Ok(Map::new()),
                Some(Value::Object(m)) => Ok(m),
                Some(_) => bail!("{origin}: [{name}] must be a table"),
            }
        };
        let model = Config::default()
            .with_values(table("model")?)
            .with_context(|| format!("in {origin}"))?;
        let train = overlay_train(&TrainConfig::default(), table("train")?)
            .with_context(|| format!("in {origin} [train]"))?;
        Ok(RunConfig { model, train })
    }

    /// Applies `key=value` overrides; each key must name a model or a training setting.
    pub fn with_overrides(&self, sets: &[String]) -> Result<RunConfig> {
        let train_keys = match serde_json::to_value(&self.train)? {
            Value::Object(m) => m,
            _ => unreachable!(),
        };
        let model_keys = match serde_json::to_value(&self.model)? {
            Value::Object(m) => m,
            _ => unreachable!(),
        };
        let (mut model_sets, mut train_sets) = (Vec::new(), Map::new());
        for s in sets {
            let (k, v) =
                s.split_once('=').with_context(|| format!("--set {s:?}: expected key=value"))?;
            let k = k.trim();
            if model_keys.contains_key(k) {
                model_sets.push(s.clone());
            } else if train_keys.contains_key(k) {
                let v = serde_json::from_str(v.trim())
                    .unwrap_or_else(|_| Value::String(v.trim().to_string()));
                train_sets.insert(k.to_string(), v);
            } else {
                bail!(
                    "--set {k}: unknown setting (model keys: {}; training keys: {})",
                    model_keys.keys().cloned().collect::<Vec<_>>().join(", "),
                    train_keys.keys().cloned().collect::<Vec<_>>().join(", ")
                );
            }
        }
        let model = self.model.with_overrides(&model_sets)?;
        let train = overlay_train(&self.train, train_sets).context("--set")?;
        Ok(RunConfig { model, train })
    }
}

fn overlay_train(base: &TrainConfig, values: Map<String, Value>) -> Result<TrainConfig> {
    let Value::Object(mut map) = serde_json::to_value(base)? else { unreachable!() };
    for (k, v) in values {
        let Some(old) = map.get(&k) else { bail!("unknown training key {k:?}") };
        crate::model::config::same_kind(old, &v)
            .map_err(|want| anyhow::anyhow!("training key {k} must be {want}, got {v}"))?;
        map.insert(k, v);
    }
    serde_json::from_value(Value::Object(map)).map_err(|e| anyhow::anyhow!("{e}"))
}

/// The resumable state besides model and optimiser moments.
#[derive(Serialize, Deserialize, Debug)]
struct TrainState {
    run: RunConfig,
    /// Optimiser steps completed.
    step: usize,
    tokens_seen: u64,
    /// Training windows consumed (the data position).
    windows_seen: u64,
    elapsed_seconds: f64,
    /// Time spent in training steps alone (no validation or checkpoints).
    #[serde(default)]
    train_seconds: f64,
    /// Hash of the corpus split and tokenizer, to refuse resuming on other data.
    data_key: String,
    /// `--data` of the run (none: the embedded corpus).
    data: Option<PathBuf>,
}

pub struct TrainOptions {
    pub out: PathBuf,
    /// Training text (none: the embedded corpus, or on resume the run's own `--data`).
    pub data: Option<PathBuf>,
    /// A `tokenizer.json` to use instead of training one.
    pub tokenizer: Option<PathBuf>,
    pub resume: bool,
    pub overwrite: bool,
    /// Show a progress bar (else plain log lines).
    pub progress: bool,
    /// Report progress on this bar (shared by the runs of a comparison) instead of a bar of the
    /// run's own.
    pub shared_bar: Option<SharedBar>,
}

/// A progress bar over several runs: this run's steps start at `offset`, and its messages are
/// prefixed with `label`.
#[derive(Clone)]
pub struct SharedBar {
    pub bar: indicatif::ProgressBar,
    pub offset: u64,
    pub label: String,
}

const CKPT: &str = "ckpt";
const METRICS: &str = "metrics.jsonl";

/// Trains (or resumes) a run; returns the final validation loss.
pub fn train(run: Option<RunConfig>, opts: &TrainOptions) -> Result<f64> {
    let out = &opts.out;
    let has_run =
        out.join(CKPT).exists() || out.join(".ckpt.old").exists() || out.join(METRICS).exists();
    let resume_dir = if opts.resume {
        ensure!(
            run.is_none(),
            "--resume continues the run in {} with its own settings; drop --config/--preset/--set",
            out.display()
        );
        Some(checkpoint_dir(out)?)
    } else {
        ensure!(!has_run || opts.overwrite, "{} already holds a training run; pass --resume to continue it or --overwrite to start over", out.display());
        None
    };
    let state: Option<TrainState> = match &resume_dir {
        Some(dir) => Some(
            serde_json::from_str(
                &std::fs::read_to_string(dir.join("train_state.json"))
                    .context("cannot read the checkpoint's train_state.json")?,
            )
            .context("the checkpoint's train_state.json is corrupt")?,
        ),
        None => None,
    };

    // Data: as given, else the resumed run's own, else the embedded corpus.
    let data = opts.data.clone().or_else(|| state.as_ref().and_then(|s| s.data.clone()));
    let corpus = match &data {
        Some(p) => Corpus::from_path(p)?,
        None => Corpus::embedded(),
    };
    let split = corpus.split();
    // Settings, tokenizer and model: from the checkpoint, or fresh.
    let (run, bpe, mut model) = match (&resume_dir, &state) {
        (Some(dir), Some(state)) => {
            let bpe = Bpe::load(&dir.join("tokenizer.json"))?;
            let model = checkpoint::load(dir).context("cannot load the checkpoint's model")?;
            ensure!(
                model.config == state.run.model,
                "the checkpoint's config.json does not match its train_state.json"
            );
            (state.run.clone(), bpe, model)
        }
        _ => {
            let mut run = run.context("no settings given")?;
            let bpe = match &opts.tokenizer {
                Some(p) => Bpe::load(p)?,
                None => cached_tokenizer(&split, run.model.vocab_size)?,
            };
            run.model.vocab_size = bpe.vocab_size();
            run.model.validate()?;
            run.train.validate(&run.model)?;
            let model = Model::init(run.model.clone(), run.train.seed)?;
            (run, bpe, model)
        }
    };
    let tc = run.train.clone();
    let (tokens, reused) = Tokens::load_or_build(&split, &bpe)?;
    let data_key = content_key(&[tokens.path.to_string_lossy().as_bytes()]);
    if let Some(s) = &state {
        ensure!(
            s.data_key == data_key,
            "the training data (or tokenizer) differs from the run being resumed"
        );
    }
    ensure!(tokens.val_len() >= 2, "the validation split is empty: use a corpus with more text");
    let mut order = WindowOrder::new(tokens.train_len(), tc.seq_len, tc.seed)?;
    if resume_dir.is_none() && has_run {
        // --overwrite: everything checked, now clear the old run.
        for p in [CKPT, ".ckpt.old", ".ckpt.tmp", METRICS, "summary.json", "diagnostics.json"] {
            let p = out.join(p);
            if p.is_dir() {
                std::fs::remove_dir_all(&p)?;
            } else if p.exists() {
                std::fs::remove_file(&p)?;
            }
        }
    }

    let mut opt = Optimizer::new(tc.optim.clone(), &model.layout);
    let (mut step, mut tokens_seen, mut windows_seen, elapsed0) = (0usize, 0u64, 0u64, 0.0f64);
    if let (Some(dir), Some(s)) = (&resume_dir, &state) {
        load_optimizer(&mut opt, &dir.join("optimizer.safetensors"))?;
        ensure!(
            opt.step as usize == s.step,
            "the checkpoint's optimizer state is from step {}, its train_state from step {}",
            opt.step,
            s.step
        );
        (step, tokens_seen, windows_seen) = (s.step, s.tokens_seen, s.windows_seen);
        truncate_metrics(&out.join(METRICS), step)?;
    } else {
        std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    }
    let elapsed0 = state.as_ref().map_or(elapsed0, |s| s.elapsed_seconds);
    let mut train_seconds = state.as_ref().map_or(0.0, |s| s.train_seconds);

    let total = tc.steps();
    let accum = tc.accumulation();
    let n_params = model.params.len();
    let bar = progress_bar(opts, total as u64, step as u64);
    let say = |line: String| match &bar {
        Some(b) => b.bar.println(format!("{}{line}", b.prefix())),
        None => log(&line),
    };
    say(format!(
        "{}: {} ({} documents, {:.1} MB), {} train / {} val tokens{}, vocab {}, {} parameters, residual {}",
        if resume_dir.is_some() { format!("resuming at step {step}/{total}") } else { format!("training {total} steps") },
        corpus.name,
        corpus.documents.len(),
        corpus.bytes() as f64 / 1e6,
        tokens.train_len(),
        tokens.val_len(),
        if reused { " (cached)" } else { "" },
        bpe.vocab_size(),
        n_params,
        crate::bench::label(&model.config),
    ));

    let mut metrics = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(out.join(METRICS))
        .context("cannot open metrics.jsonl")?;
    let t0 = Instant::now();
    let mut last_val = f64::NAN;
    let mut seen_since = 0u64;
    let mut t_since = Instant::now();
    while step < total {
        let t_step = Instant::now();
        let lr = lr_at(&tc.optim, step, total);
        let mut grads = kernels::zeros(n_params);
        let mut loss_sum = 0.0f64;
        for _ in 0..accum {
            let (ids, targets) = next_batch(&tokens, &mut order, &mut windows_seen, tc.micro_batch);
            let fwd = model.forward(&ids, tc.micro_batch, tc.seq_len)?;
            let (loss, g) = model.backward(&fwd, &targets)?;
            ensure!(
                loss.is_finite(),
                "the training loss became {loss} at step {step}; lower the learning rate"
            );
            loss_sum += loss as f64;
            kernels::add_assign(&mut grads, &g);
        }
        if accum > 1 {
            let s = 1.0 / accum as f32;
            grads.iter_mut().for_each(|g| *g *= s);
        }
        let sublayer_norms = crate::diagnostics::sublayer_grad_norms(&model.layout, &grads);
        let grad_norm = opt.clip(&mut grads);
        opt.update(&mut model.params, &grads, lr);
        train_seconds += t_step.elapsed().as_secs_f64();
        step += 1;
        tokens_seen += tc.batch_tokens as u64;
        seen_since += tc.batch_tokens as u64;
        let train_loss = loss_sum / accum as f64;

        let mut rec = json!({
            "step": step, "tokens": tokens_seen, "train_loss": train_loss, "lr": lr, "grad_norm": grad_norm,
            "sublayer_grad_norms": sublayer_norms,
        });
        if step % tc.eval_every == 0 || step == total {
            let (val_loss, bpb) =
                validate(&model, &tokens, tc.seq_len, tc.micro_batch, tc.eval_tokens)?;
            last_val = val_loss;
            rec["val_loss"] = json!(val_loss);
            rec["val_bits_per_byte"] = json!(bpb);
            say(format!("step {step}/{total}: train loss {train_loss:.4}, val loss {val_loss:.4}, val bits/byte {bpb:.4}"));
        }
        let tps = seen_since as f64 / t_since.elapsed().as_secs_f64();
        rec["tokens_per_second"] = json!(tps);
        rec["elapsed_seconds"] = json!(elapsed0 + t0.elapsed().as_secs_f64());
        // One write per line: a run killed mid-record must not leave half a line behind.
        metrics.write_all(format!("{rec}\n").as_bytes()).context("cannot write metrics.jsonl")?;
        metrics.flush()?;
        if let Some(b) = &bar {
            b.bar.set_position(b.offset + step as u64);
            b.bar.set_message(format!("{}loss {train_loss:.3} | {tps:.0} tok/s", b.prefix()));
        } else if step % tc.eval_every != 0 && step != total {
            log(&format!("step {step}/{total}: train loss {train_loss:.4}, {tps:.0} tokens/s"));
        }
        if step % tc.eval_every == 0 {
            seen_since = 0;
            t_since = Instant::now();
        }
        if step % tc.checkpoint_every == 0 || step == total {
            let st = TrainState {
                run: run.clone(),
                step,
                tokens_seen,
                windows_seen,
                elapsed_seconds: elapsed0 + t0.elapsed().as_secs_f64(),
                train_seconds,
                data_key: data_key.clone(),
                data: data.clone(),
            };
            save_checkpoint(out, &model, &bpe, &opt, &st)?;
        }
    }
    if last_val.is_nan() {
        last_val = validate(&model, &tokens, tc.seq_len, tc.micro_batch, tc.eval_tokens)?.0;
    }
    let (unigram, val_bpb) = (
        unigram_bits_per_byte(&tokens, bpe.vocab_size()),
        last_val / std::f64::consts::LN_2 / (tokens.val_bytes as f64 / tokens.val_len() as f64),
    );
    let val: Vec<u32> = tokens.val(0..tokens.val_len());
    let diag =
        crate::diagnostics::diagnose(&model, &val, tc.seq_len, tc.micro_batch, tc.eval_tokens)?;
    write_atomic(&out.join("diagnostics.json"), serde_json::to_string_pretty(&diag)?.as_bytes())?;
    let summary = json!({
        "residual": crate::bench::label(&model.config), "parameters": n_params, "steps": step, "tokens": tokens_seen,
        "val_loss": last_val, "val_bits_per_byte": val_bpb, "unigram_val_bits_per_byte": unigram,
        "elapsed_seconds": elapsed0 + t0.elapsed().as_secs_f64(),
        "train_seconds": train_seconds, "train_tokens_per_second": tokens_seen as f64 / train_seconds.max(1e-9),
    });
    write_atomic(&out.join("summary.json"), serde_json::to_string_pretty(&summary)?.as_bytes())?;
    say(format!(
        "done: step {step}, validation loss {last_val:.4} ({val_bpb:.4} bits/byte; a unigram model of the training tokens: {unigram:.4} bits/byte); model in {}",
        out.display()
    ));
    if let Some(b) = bar.filter(|_| opts.shared_bar.is_none()) {
        b.bar.finish_and_clear();
    }
    Ok(last_val)
}

/// Bits per byte of the validation split under a unigram model of the training tokens (add-one
/// smoothing): the floor any useful language model must beat.
pub fn unigram_bits_per_byte(tokens: &Tokens, vocab: usize) -> f64 {
    let mut counts = vec![1.0f64; vocab];
    for t in tokens.train(0..tokens.train_len()) {
        counts[t as usize] += 1.0;
    }
    let total: f64 = counts.iter().sum();
    let nats: f64 =
        tokens.val(0..tokens.val_len()).iter().map(|&t| -(counts[t as usize] / total).ln()).sum();
    nats / std::f64::consts::LN_2 / tokens.val_bytes as f64
}

fn log(line: &str) {
    eprintln!("{line}");
}

impl SharedBar {
    fn prefix(&self) -> String {
        if self.label.is_empty() {
            String::new()
        } else {
            format!("{}: ", self.label)
        }
    }
}

/// A terminal progress bar of `total` steps (none when stderr is not a terminal).
pub fn new_progress_bar(total: u64) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let b = indicatif::ProgressBar::new(total);
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} steps | {msg} | {elapsed_precise} elapsed, ETA {eta_precise}",
        )
        .expect("valid template"),
    );
    Some(b)
}

fn progress_bar(opts: &TrainOptions, total: u64, pos: u64) -> Option<SharedBar> {
    if let Some(b) = &opts.shared_bar {
        b.bar.set_position(b.offset + pos);
        return Some(b.clone());
    }
    if !opts.progress {
        return None;
    }
    let bar = new_progress_bar(total)?;
    bar.set_position(pos);
    Some(SharedBar { bar, offset: 0, label: String::new() })
}

/// The next `micro_batch` training windows: inputs and their next-token targets.
fn next_batch(
    tokens: &Tokens,
    order: &mut WindowOrder,
    windows_seen: &mut u64,
    micro_batch: usize,
) -> (Vec<u32>, Vec<u32>) {
    let seq = order.seq;
    let (mut ids, mut targets) =
        (Vec::with_capacity(micro_batch * seq), Vec::with_capacity(micro_batch * seq));
    for _ in 0..micro_batch {
        let s = order.start(*windows_seen);
        *windows_seen += 1;
        let w = tokens.train(s..s + seq + 1);
        ids.extend_from_slice(&w[..seq]);
        targets.extend_from_slice(&w[1..]);
    }
    (ids, targets)
}

/// Mean validation loss over consecutive windows (up to `max_tokens` predicted tokens, 0 = all)
/// and the matching bits per byte (using the split's bytes per token).
pub fn validate(
    model: &Model,
    tokens: &Tokens,
    seq: usize,
    micro_batch: usize,
    max_tokens: usize,
) -> Result<(f64, f64)> {
    let n = tokens.val_len();
    let val: Vec<u32> = tokens.val(0..n);
    let (nats, count) = windowed_loss(model, &val, seq.min(n - 1), micro_batch, max_tokens)?;
    let loss = nats / count as f64;
    let bytes_per_token = tokens.val_bytes as f64 / n as f64;
    Ok((loss, loss / std::f64::consts::LN_2 / bytes_per_token))
}

/// Summed next-token loss (nats) and the number of predicted tokens, over windows of `seq + 1`
/// tokens taken with stride `seq` (so every token but the first is predicted once), stopping
/// after `max_tokens` predictions when non-zero.
pub fn windowed_loss(
    model: &Model,
    ids: &[u32],
    seq: usize,
    micro_batch: usize,
    max_tokens: usize,
) -> Result<(f64, usize)> {
    ensure!(ids.len() >= 2, "need at least two tokens to measure a loss");
    let mut starts: Vec<usize> = (0..ids.len() - 1).step_by(seq).collect();
    if max_tokens > 0 {
        starts.truncate(max_tokens.div_ceil(seq).max(1));
    }
    let (mut nats, mut count) = (0.0f64, 0usize);
    // Full windows go in batches; the ragged last window alone.
    let (full, last): (Vec<usize>, Vec<usize>) = starts.iter().partition(|&&s| s + seq < ids.len());
    for chunk in full.chunks(micro_batch) {
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for &s in chunk {
            x.extend_from_slice(&ids[s..s + seq]);
            y.extend_from_slice(&ids[s + 1..s + seq + 1]);
        }
        let f = model.forward(&x, chunk.len(), seq)?;
        nats += model.loss(&f, &y)? as f64 * y.len() as f64;
        count += y.len();
    }
    for s in last {
        let t = ids.len() - 1 - s;
        let f = model.forward(&ids[s..s + t], 1, t)?;
        nats += model.loss(&f, &ids[s + 1..])? as f64 * t as f64;
        count += t;
    }
    Ok((nats, count))
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

/// The checkpoint directory to resume from (the previous one if a swap was interrupted).
fn checkpoint_dir(out: &Path) -> Result<PathBuf> {
    for name in [CKPT, ".ckpt.old"] {
        let d = out.join(name);
        if d.join("train_state.json").exists() {
            return Ok(d);
        }
    }
    bail!("{} holds no checkpoint to resume (no {}/train_state.json)", out.display(), CKPT)
}

fn save_checkpoint(
    out: &Path,
    model: &Model,
    bpe: &Bpe,
    opt: &Optimizer,
    st: &TrainState,
) -> Result<()> {
    let tmp = out.join(".ckpt.tmp");
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    checkpoint::save(model, &tmp)?;
    let tok = bpe.to_json()?;
    write_atomic(&tmp.join("tokenizer.json"), tok.as_bytes())?;
    let meta = std::collections::HashMap::from([("step".to_string(), opt.step.to_string())]);
    let n = opt.m.len();
    let tensors: Vec<(String, Vec<usize>, &[f32])> = vec![
        ("adam.m".into(), vec![n], &opt.m),
        ("adam.v".into(), vec![n], &opt.v),
        ("muon.momentum".into(), vec![n], &opt.momentum),
    ];
    write_atomic(&tmp.join("optimizer.safetensors"), &safetensors_bytes(&tensors, Some(meta))?)?;
    write_atomic(&tmp.join("train_state.json"), serde_json::to_string_pretty(st)?.as_bytes())?;
    let (cur, old) = (out.join(CKPT), out.join(".ckpt.old"));
    if old.exists() {
        std::fs::remove_dir_all(&old)?;
    }
    if cur.exists() {
        std::fs::rename(&cur, &old)?;
    }
    std::fs::rename(&tmp, &cur)?;
    if old.exists() {
        std::fs::remove_dir_all(&old)?;
    }
    // The latest model, loadable as a plain checkpoint directory.
    checkpoint::save(model, out)?;
    write_atomic(&out.join("tokenizer.json"), tok.as_bytes())
}

fn load_optimizer(opt: &mut Optimizer, path: &Path) -> Result<()> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| anyhow::anyhow!("{} is corrupt: {e}", path.display()))?;
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| anyhow::anyhow!("{e}"))?;
    opt.step = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("step"))
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("{} has no step", path.display()))?;
    for (name, buf) in
        [("adam.m", &mut opt.m), ("adam.v", &mut opt.v), ("muon.momentum", &mut opt.momentum)]
    {
        let t = st.tensor(name).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let vals = f32_values(name, &t)?;
        ensure!(
            vals.len() == buf.len(),
            "{}: {name} has {} values, the model needs {}",
            path.display(),
            vals.len(),
            buf.len()
        );
        buf.copy_from_slice(&vals);
    }
    Ok(())
}

/// Drops metric lines after `step` (written after the checkpoint the run resumes from).
fn truncate_metrics(path: &Path, step: usize) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(()) };
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<Value>(l)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s as usize <= step)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    write_atomic(path, kept.as_bytes())
}
