//! The `attnres` command line.

use anyhow::{bail, ensure, Context, Result};
use attnres::bench;
use attnres::model::checkpoint::{self, safetensors_bytes, write_atomic};
use attnres::model::{Config, Model, ResidualKind};
use attnres::presets;
use attnres::train::run::{self, RunConfig, TrainOptions};
use attnres::train::tokenizer::Bpe;
use clap::{Args, Parser, Subcommand};
use serde::Deserialize;
use std::path::{Path, PathBuf};

#[global_allocator]
static ALLOC: attnres::alloc::Recycling = attnres::alloc::Recycling;

#[derive(Parser)]
#[command(name = "attnres", version, about = "Train, evaluate, inspect and serve transformer language models with Attention Residuals")]
struct Cli {
    /// Worker threads (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write a freshly initialised checkpoint (config.json + model.safetensors).
    Init(InitArgs),
    /// Run one batch through a checkpoint: logits, and with targets the loss and every gradient.
    Forward(ForwardArgs),
    /// Train a model on the embedded corpus or your own text (resumable).
    Train(TrainArgs),
    /// Measure a checkpoint on a text file: loss, perplexity and bits per byte.
    Eval(EvalArgs),
    /// Time one training step (forward + backward) for each residual mode, side by side.
    Bench(BenchArgs),
}

#[derive(Args)]
struct TrainArgs {
    /// Run directory: the latest model, metrics.jsonl and the resumable checkpoint.
    #[arg(long)]
    out: PathBuf,
    /// A TOML file with [model] and [train] tables (instead of --preset).
    #[arg(long, conflicts_with = "preset")]
    config: Option<PathBuf>,
    /// Named preset: tiny (about a minute), small (the default, about 13 minutes on two cores).
    #[arg(long)]
    preset: Option<String>,
    /// Override any model or training setting, e.g. --set residual=full --set lr=1e-3.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Training text: a file, a directory of files, or JSONL with a "text" field
    /// (default: the embedded Shakespeare corpus; on --resume, the run's own).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Use this tokenizer.json instead of training a byte-level BPE on the data.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Continue the run in --out from its last checkpoint.
    #[arg(long, conflicts_with = "overwrite")]
    resume: bool,
    /// Replace a run already in --out.
    #[arg(long)]
    overwrite: bool,
    /// Plain log lines instead of a progress bar.
    #[arg(long)]
    no_progress: bool,
}

#[derive(Args)]
struct EvalArgs {
    /// Checkpoint directory (with tokenizer.json), e.g. a training run's --out.
    #[arg(long)]
    model: PathBuf,
    /// UTF-8 text file to measure.
    #[arg(long)]
    text: PathBuf,
    /// Window length in tokens (default: the model's max_position_embeddings).
    #[arg(long)]
    seq: Option<usize>,
    /// Print one JSON object with loss, perplexity and bits_per_byte.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ModelChoice {
    /// Named preset for the model shape (see configs/): tiny, small.
    #[arg(long, default_value = presets::DEFAULT_PRESET)]
    preset: String,
    /// Override any config.json key, e.g. --set hidden_size=64 --set residual=full.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
}

impl ModelChoice {
    fn config(&self) -> Result<Config> {
        presets::model_config(&self.preset)?.with_overrides(&self.sets)
    }
}

#[derive(Args)]
struct InitArgs {
    /// Checkpoint directory to write.
    #[arg(long)]
    out: PathBuf,
    /// Seed of the initialisation.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[command(flatten)]
    model: ModelChoice,
    /// Replace a checkpoint already in --out.
    #[arg(long)]
    force: bool,
}

#[derive(Args)]
struct ForwardArgs {
    /// Checkpoint directory.
    #[arg(long)]
    model: PathBuf,
    /// JSON file: {"input_ids": [[...], ...], "targets": [[...], ...]} (targets optional).
    #[arg(long)]
    batch: PathBuf,
    /// Output safetensors file: logits, and with targets also loss and grad.<parameter>.
    #[arg(long)]
    out: PathBuf,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelChoice,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256)]
    seq: usize,
    /// Timed steps per mode (the median is reported).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Untimed warm-up steps per mode.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Residual modes to compare: standard, full, block (block uses the preset's num_blocks).
    #[arg(long, value_delimiter = ',', default_value = "standard,block,full")]
    modes: Vec<String>,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    json: bool,
    /// Also report the time per step of each phase (linear layers, attention, norms, ...).
    #[arg(long)]
    profile: bool,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    if let Some(n) = cli.threads {
        ensure!(n > 0, "--threads must be positive");
        rayon::ThreadPoolBuilder::new().num_threads(n).build_global().context("cannot start the thread pool")?;
    }
    match cli.command {
        Command::Init(a) => init(a),
        Command::Forward(a) => forward(a),
        Command::Train(a) => train_cmd(a),
        Command::Eval(a) => eval_cmd(a),
        Command::Bench(a) => bench_cmd(a),
    }
}

fn train_cmd(a: TrainArgs) -> Result<()> {
    let run = if a.resume {
        ensure!(a.sets.is_empty() && a.config.is_none() && a.preset.is_none(), "--resume continues with the run's own settings; drop --config/--preset/--set");
        None
    } else {
        let base = match &a.config {
            Some(p) => {
                let text = std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?;
                RunConfig::from_toml(&text, &p.display().to_string())?
            }
            None => presets::run_config(a.preset.as_deref().unwrap_or(presets::DEFAULT_PRESET))?,
        };
        Some(base.with_overrides(&a.sets)?)
    };
    let opts = TrainOptions {
        out: a.out,
        data: a.data,
        tokenizer: a.tokenizer,
        resume: a.resume,
        overwrite: a.overwrite,
        progress: !a.no_progress,
    };
    run::train(run, &opts)?;
    Ok(())
}

fn eval_cmd(a: EvalArgs) -> Result<()> {
    let model = checkpoint::load(&a.model)?;
    let bpe = Bpe::load(&a.model.join("tokenizer.json"))?;
    ensure!(bpe.vocab_size() <= model.config.vocab_size, "tokenizer.json has {} tokens, the model only {}", bpe.vocab_size(), model.config.vocab_size);
    let bytes = std::fs::read(&a.text).with_context(|| format!("cannot read {}", a.text.display()))?;
    let text = String::from_utf8(bytes)
        .map_err(|e| anyhow::anyhow!("{} is not valid UTF-8 (first invalid byte at offset {})", a.text.display(), e.utf8_error().valid_up_to()))?;
    let ids = bpe.encode(&text)?;
    ensure!(ids.len() >= 2, "{} is too short to measure: it encodes to {} token(s)", a.text.display(), ids.len());
    let seq = a.seq.unwrap_or(model.config.max_position_embeddings);
    ensure!(seq > 0 && seq <= model.config.max_position_embeddings, "--seq must lie in 1..={}", model.config.max_position_embeddings);
    let (nats, count) = run::windowed_loss(&model, &ids, seq.min(ids.len() - 1), 8, 0)?;
    let loss = nats / count as f64;
    // Every token but the first is predicted: count the bytes those tokens decode to.
    let first = bpe.decode(&ids[..1])?.len();
    let predicted_bytes = (text.len() - first).max(1);
    let bpb = nats / std::f64::consts::LN_2 / predicted_bytes as f64;
    if a.json {
        println!("{}", serde_json::json!({"loss": loss, "perplexity": loss.exp(), "bits_per_byte": bpb, "tokens": count, "bytes": predicted_bytes}));
    } else {
        println!("{}: {count} tokens, loss {loss:.4} nats/token, perplexity {:.2}, {bpb:.4} bits/byte", a.text.display(), loss.exp());
    }
    Ok(())
}

fn init(a: InitArgs) -> Result<()> {
    let config = a.model.config()?;
    let existing = [checkpoint::CONFIG_FILE, checkpoint::WEIGHTS_FILE].iter().any(|f| a.out.join(f).exists());
    ensure!(!existing || a.force, "{} already holds a checkpoint; pass --force to replace it", a.out.display());
    let model = Model::init(config, a.seed)?;
    checkpoint::save(&model, &a.out)?;
    eprintln!(
        "wrote {} ({} parameters, residual = {})",
        a.out.display(),
        model.params.len(),
        bench::label(&model.config)
    );
    Ok(())
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BatchFile {
    input_ids: Vec<Vec<i64>>,
    targets: Option<Vec<Vec<i64>>>,
}

/// Flattens a rectangular list of token ids, naming what is wrong.
fn flatten_ids(rows: &[Vec<i64>], what: &str) -> Result<(Vec<u32>, usize, usize)> {
    ensure!(!rows.is_empty(), "{what} is empty");
    let t = rows[0].len();
    ensure!(t > 0, "{what}[0] is empty");
    let mut out = Vec::with_capacity(rows.len() * t);
    for (b, row) in rows.iter().enumerate() {
        ensure!(row.len() == t, "{what}[{b}] has {} ids, {what}[0] has {t}: rows must have equal length", row.len());
        for (i, &id) in row.iter().enumerate() {
            ensure!((0..=u32::MAX as i64).contains(&id), "{what}[{b}][{i}] = {id} is not a valid token id");
            out.push(id as u32);
        }
    }
    Ok((out, rows.len(), t))
}

fn forward(a: ForwardArgs) -> Result<()> {
    let model = checkpoint::load(&a.model)?;
    let text = std::fs::read_to_string(&a.batch).with_context(|| format!("cannot read {}", a.batch.display()))?;
    let batch: BatchFile = serde_json::from_str(&text).with_context(|| format!("{} is not a valid batch file", a.batch.display()))?;
    let (ids, b, t) = flatten_ids(&batch.input_ids, "input_ids")?;
    let fwd = model.forward(&ids, b, t)?;
    let v = model.config.vocab_size;
    let mut tensors: Vec<(String, Vec<usize>, &[f32])> = vec![("logits".into(), vec![b, t, v], &fwd.logits)];
    let (loss, grads);
    if let Some(tg) = &batch.targets {
        let (targets, tb, tt) = flatten_ids(tg, "targets")?;
        ensure!((tb, tt) == (b, t), "targets are {tb} x {tt}, input_ids are {b} x {t}");
        (loss, grads) = model.backward(&fwd, &targets)?;
        tensors.push(("loss".into(), vec![], std::slice::from_ref(&loss)));
        for s in &model.layout.specs {
            tensors.push((format!("grad.{}", s.name), s.shape.clone(), &grads[s.range.clone()]));
        }
        eprintln!("loss {loss:.6}");
    }
    write_output(&a.out, &safetensors_bytes(&tensors, None)?)
}

fn write_output(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        ensure!(dir.is_dir(), "output directory {} does not exist", dir.display());
    }
    write_atomic(path, bytes)
}

fn bench_cmd(a: BenchArgs) -> Result<()> {
    ensure!(a.batch > 0 && a.seq > 0 && a.steps > 0, "--batch, --seq and --steps must be positive");
    let base = a.model.config()?;
    ensure!(a.seq <= base.max_position_embeddings, "--seq {} exceeds max_position_embeddings = {}", a.seq, base.max_position_embeddings);
    let mut configs = Vec::new();
    for m in &a.modes {
        let residual = match m.as_str() {
            "standard" => ResidualKind::Standard,
            "full" => ResidualKind::Full,
            "block" => ResidualKind::Block,
            other => bail!("--modes: unknown residual mode {other:?} (use standard, block, full)"),
        };
        let c = Config { residual, ..base.clone() };
        c.validate()?;
        configs.push(c);
    }
    ensure!(!configs.is_empty(), "--modes is empty");
    eprintln!(
        "bench: {} layers, hidden {}, {} heads, batch {} x seq {}, {} threads",
        base.num_hidden_layers,
        base.hidden_size,
        base.num_attention_heads,
        a.batch,
        a.seq,
        rayon::current_num_threads()
    );
    attnres::profile::enable(a.profile);
    let report = bench::run(&configs, a.batch, a.seq, a.warmup, a.steps, |line| eprintln!("  {line}"))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!("matrix-product peak (1024^3, f32): {:.1} GFLOP/s", report.matmul_peak_gflops);
    println!("| mode | step (ms) | tokens/s | GFLOP/s | % of peak | vs standard |");
    println!("|---|---:|---:|---:|---:|---:|");
    for m in &report.modes {
        println!(
            "| {} | {:.1} | {:.0} | {:.1} | {:.0}% | {} |",
            if m.residual == "block" { format!("block ({} blocks)", m.num_blocks) } else { m.residual.clone() },
            m.step_seconds * 1e3,
            m.tokens_per_second,
            m.gflops,
            100.0 * m.gflops / report.matmul_peak_gflops,
            m.relative_to_standard.map_or("-".into(), |r| format!("{r:.3}x"))
        );
    }
    for m in report.modes.iter().filter(|m| !m.profile.is_empty()) {
        println!("\nphases of one {} step:", m.residual);
        for (name, secs) in &m.profile {
            println!("  {name:<16} {:>8.1} ms  {:>5.1}%", secs * 1e3, 100.0 * secs / m.step_seconds);
        }
    }
    Ok(())
}
