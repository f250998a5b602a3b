//! The `attnres` command line.

use anyhow::{bail, ensure, Context, Result};
use attnres::bench;
use attnres::compare;
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
#[command(
    name = "attnres",
    version,
    about = "Train, evaluate, inspect and serve transformer language models with Attention Residuals"
)]
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
    /// Continue a prompt (or a file of prompts) with a trained model, streaming the text.
    Generate(GenerateArgs),
    /// Time training steps (or, with --generate, prefill and decoding) for each residual mode,
    /// side by side.
    Bench(BenchArgs),
    /// Train standard, block and full (or another suite) with identical data and settings, for
    /// one or more seeds, and write a report with figures (resumable).
    Compare(CompareArgs),
    /// Rebuild the report of a comparison directory from its runs.
    Report(ReportArgs),
}

#[derive(Args)]
struct CompareArgs {
    /// Report directory: compare.json, runs/, index.html, summary.json and the figures.
    #[arg(long)]
    out: PathBuf,
    /// residuals (standard, block, full), ablations (SPEC §5) or block-sizes (S from 1 to L).
    #[arg(long, default_value = "residuals")]
    suite: String,
    /// Seeds per variant (each changes initialisation and data order).
    #[arg(long, default_value_t = 1)]
    seeds: usize,
    /// The tiny model on 400K tokens: a first look in a couple of minutes.
    #[arg(long)]
    quick: bool,
    /// Change a setting of every run, e.g. --set max_tokens=1000000 --set num_hidden_layers=12.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Training text (default: the embedded Shakespeare corpus).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Print log lines instead of a progress bar.
    #[arg(long)]
    no_progress: bool,
}

#[derive(Args)]
struct ReportArgs {
    /// A directory written by `attnres compare`.
    dir: PathBuf,
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
    /// Timed steps per mode (with --generate: timed rounds); the median is reported.
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
    /// Also report the time per step of each phase (linear layers, attention, norms, the
    /// residual connection, ...).
    #[arg(long)]
    profile: bool,
    /// Benchmark generation instead: prefill and decode throughput, decode latency per mode.
    #[arg(long)]
    generate: bool,
    /// With --generate: tokens per prompt.
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// With --generate: tokens decoded per sequence and round.
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// With --generate: batch sizes (sequences decoded together).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    batches: Vec<usize>,
}

#[derive(Args)]
struct GenerateArgs {
    /// Model directory with tokenizer.json: a training run's --out.
    #[arg(long)]
    model: PathBuf,
    /// Text to continue.
    #[arg(long, conflicts_with = "prompt_file", required_unless_present = "prompt_file")]
    prompt: Option<String>,
    /// A UTF-8 file with one prompt per line, generated as one batch; prints one JSON object
    /// per prompt ({"prompt", "completion", "new_tokens", "stop"}).
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// New tokens per prompt (fewer if the model ends the text).
    #[arg(long, default_value_t = 200, allow_negative_numbers = true)]
    max_tokens: i64,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temperature: f32,
    /// Sample only from the K most likely tokens.
    #[arg(long, allow_negative_numbers = true)]
    top_k: Option<i64>,
    /// Sample only from the most likely tokens whose probabilities add up to P (0 < P <= 1).
    #[arg(long, allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Seed of the sampler (same seed, same prompts: same text).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// When prompt plus new tokens outgrow the model's context, keep going over a sliding
    /// window (the cache is rebuilt from the latest half of the context) instead of refusing.
    #[arg(long)]
    slide: bool,
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
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("cannot start the thread pool")?;
    }
    match cli.command {
        Command::Init(a) => init(a),
        Command::Forward(a) => forward(a),
        Command::Train(a) => train_cmd(a),
        Command::Eval(a) => eval_cmd(a),
        Command::Generate(a) => generate_cmd(a),
        Command::Bench(a) => bench_cmd(a),
        Command::Compare(a) => compare_cmd(a),
        Command::Report(a) => {
            let page = attnres::report::write(&a.dir)?;
            eprintln!("report: {}", page.display());
            Ok(())
        }
    }
}

fn compare_cmd(a: CompareArgs) -> Result<()> {
    let base = compare::base(a.quick)?.with_overrides(&a.sets)?;
    let variants = compare::suite(&a.suite, &base)?;
    let plan =
        compare::Plan { suite: a.suite.clone(), base, variants, seeds: a.seeds, data: a.data };
    compare::run(&plan, &compare::CompareOptions { out: a.out, progress: !a.no_progress })
}

fn train_cmd(a: TrainArgs) -> Result<()> {
    let run = if a.resume {
        ensure!(
            a.sets.is_empty() && a.config.is_none() && a.preset.is_none(),
            "--resume continues with the run's own settings; drop --config/--preset/--set"
        );
        None
    } else {
        let base = match &a.config {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .with_context(|| format!("cannot read {}", p.display()))?;
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
        shared_bar: None,
    };
    run::train(run, &opts)?;
    Ok(())
}

/// A checkpoint and the tokenizer stored beside it.
fn load_with_tokenizer(dir: &Path) -> Result<(Model, Bpe)> {
    let model = checkpoint::load(dir)?;
    let path = dir.join("tokenizer.json");
    ensure!(
        path.exists(),
        "{} has no tokenizer.json: pass the directory of a training run (attnres train --out DIR)",
        dir.display()
    );
    let bpe = Bpe::load(&path)?;
    ensure!(
        bpe.vocab_size() <= model.config.vocab_size,
        "tokenizer.json has {} tokens, the model only {}",
        bpe.vocab_size(),
        model.config.vocab_size
    );
    Ok((model, bpe))
}

fn read_utf8(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{} is not valid UTF-8 (first invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}

fn generate_cmd(a: GenerateArgs) -> Result<()> {
    use attnres::generate::{generate, GenerateOptions, Overflow, Sampling};
    use std::io::Write;
    ensure!(a.max_tokens > 0, "--max-tokens must be at least 1, got {}", a.max_tokens);
    let top_k = match a.top_k {
        Some(k) if k < 1 => bail!("--top-k must be at least 1, got {k}"),
        k => k.map(|k| k as usize),
    };
    let sampling = Sampling { temperature: a.temperature, top_k, top_p: a.top_p };
    sampling.validate().map_err(|e| anyhow::anyhow!("--{e}"))?;
    let texts: Vec<String> = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => {
            ensure!(!p.is_empty(), "--prompt is empty: give some text to continue");
            vec![p.clone()]
        }
        (None, Some(f)) => {
            let text = read_utf8(f)?;
            let lines: Vec<String> = text.lines().map(str::to_string).collect();
            ensure!(!lines.is_empty(), "{} holds no prompts", f.display());
            if let Some(i) = lines.iter().position(|l| l.is_empty()) {
                bail!("{} line {} is empty: every line must be a prompt", f.display(), i + 1);
            }
            lines
        }
        (None, None) => bail!("give --prompt TEXT or --prompt-file FILE"),
    };
    let (model, bpe) = load_with_tokenizer(&a.model)?;
    let prompts = texts.iter().map(|t| bpe.encode(t)).collect::<Result<Vec<_>>>()?;
    let opts = GenerateOptions {
        max_tokens: a.max_tokens as usize,
        sampling,
        seed: a.seed,
        overflow: if a.slide { Overflow::Slide } else { Overflow::Error },
        stop: Some(bpe.eot),
    };
    // --prompt streams text; --prompt-file (even with one line) prints JSON lines.
    let single = a.prompt.is_some();
    let mut out = std::io::stdout().lock();
    let mut streamed: Vec<u32> = Vec::new();
    let mut shown = 0;
    if single {
        write!(out, "{}", texts[0])?;
        out.flush()?;
    }
    let (gens, timing) = generate(&model, &prompts, &opts, |_, tok| {
        if !single || tok == bpe.eot {
            return;
        }
        // Print what the tokens so far decode to, holding back a trailing partial character.
        streamed.push(tok);
        if let Ok(text) = bpe.decode(&streamed) {
            if !text.ends_with('\u{FFFD}') && text.len() > shown {
                let _ = write!(out, "{}", &text[shown..]);
                let _ = out.flush();
                shown = text.len();
            }
        }
    })?;
    if single {
        let text = bpe.decode(&streamed)?;
        writeln!(out, "{}", text.get(shown..).unwrap_or(""))?;
    } else {
        for (t, g) in texts.iter().zip(&gens) {
            let body: Vec<u32> = g.tokens.iter().copied().filter(|&x| x != bpe.eot).collect();
            let line = serde_json::json!({"prompt": t, "completion": bpe.decode(&body)?, "new_tokens": g.tokens.len(), "stop": g.stop});
            writeln!(out, "{line}")?;
        }
    }
    eprintln!(
        "prefill {} tokens in {:.1} ms ({:.0} tokens/s); decode {} tokens in {:.2} s ({:.1} tokens/s)",
        timing.prefill_tokens,
        timing.prefill_seconds * 1e3,
        timing.prefill_tokens as f64 / timing.prefill_seconds,
        timing.decode_tokens,
        timing.decode_seconds,
        timing.decode_tokens as f64 / timing.decode_seconds.max(1e-9)
    );
    Ok(())
}

fn eval_cmd(a: EvalArgs) -> Result<()> {
    let (model, bpe) = load_with_tokenizer(&a.model)?;
    let text = read_utf8(&a.text)?;
    let ids = bpe.encode(&text)?;
    ensure!(
        ids.len() >= 2,
        "{} is too short to measure: it encodes to {} token(s)",
        a.text.display(),
        ids.len()
    );
    let seq = a.seq.unwrap_or(model.config.max_position_embeddings);
    ensure!(
        seq > 0 && seq <= model.config.max_position_embeddings,
        "--seq must lie in 1..={}",
        model.config.max_position_embeddings
    );
    let (nats, count) = run::windowed_loss(&model, &ids, seq.min(ids.len() - 1), 8, 0)?;
    let loss = nats / count as f64;
    // Every token but the first is predicted: count the bytes those tokens decode to.
    let first = bpe.decode(&ids[..1])?.len();
    let predicted_bytes = (text.len() - first).max(1);
    let bpb = nats / std::f64::consts::LN_2 / predicted_bytes as f64;
    if a.json {
        println!(
            "{}",
            serde_json::json!({"loss": loss, "perplexity": loss.exp(), "bits_per_byte": bpb, "tokens": count, "bytes": predicted_bytes})
        );
    } else {
        println!(
            "{}: {count} tokens, loss {loss:.4} nats/token, perplexity {:.2}, {bpb:.4} bits/byte",
            a.text.display(),
            loss.exp()
        );
    }
    Ok(())
}

fn init(a: InitArgs) -> Result<()> {
    let config = a.model.config()?;
    let existing =
        [checkpoint::CONFIG_FILE, checkpoint::WEIGHTS_FILE].iter().any(|f| a.out.join(f).exists());
    ensure!(
        !existing || a.force,
        "{} already holds a checkpoint; pass --force to replace it",
        a.out.display()
    );
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
        ensure!(
            row.len() == t,
            "{what}[{b}] has {} ids, {what}[0] has {t}: rows must have equal length",
            row.len()
        );
        for (i, &id) in row.iter().enumerate() {
            ensure!(
                (0..=u32::MAX as i64).contains(&id),
                "{what}[{b}][{i}] = {id} is not a valid token id"
            );
            out.push(id as u32);
        }
    }
    Ok((out, rows.len(), t))
}

fn forward(a: ForwardArgs) -> Result<()> {
    let model = checkpoint::load(&a.model)?;
    let text = std::fs::read_to_string(&a.batch)
        .with_context(|| format!("cannot read {}", a.batch.display()))?;
    let batch: BatchFile = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a valid batch file", a.batch.display()))?;
    let (ids, b, t) = flatten_ids(&batch.input_ids, "input_ids")?;
    let fwd = model.forward(&ids, b, t)?;
    let v = model.config.vocab_size;
    let mut tensors: Vec<(String, Vec<usize>, &[f32])> =
        vec![("logits".into(), vec![b, t, v], &fwd.logits)];
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
    attnres::profile::enable(a.profile);
    if a.generate {
        return bench_generate(&a, &configs);
    }
    ensure!(
        a.seq <= base.max_position_embeddings,
        "--seq {} exceeds max_position_embeddings = {}",
        a.seq,
        base.max_position_embeddings
    );
    eprintln!(
        "bench: {} layers, hidden {}, {} heads, batch {} x seq {}, {} threads",
        base.num_hidden_layers,
        base.hidden_size,
        base.num_attention_heads,
        a.batch,
        a.seq,
        rayon::current_num_threads()
    );
    let report =
        bench::run(&configs, a.batch, a.seq, a.warmup, a.steps, |line| eprintln!("  {line}"))?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!("matrix-product peak (1024^3, f32): {:.1} GFLOP/s", report.matmul_peak_gflops);
    println!("| mode | step (ms) | tokens/s | GFLOP/s | % of peak | vs standard | fastest step (ms) | fastest vs standard |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let rel = |r: Option<f64>| r.map_or("-".into(), |r| format!("{r:.3}x"));
    for m in &report.modes {
        println!(
            "| {} | {:.1} | {:.0} | {:.1} | {:.0}% | {} | {:.1} | {} |",
            if m.residual == "block" {
                format!("block ({} blocks)", m.num_blocks)
            } else {
                m.residual.clone()
            },
            m.step_seconds * 1e3,
            m.tokens_per_second,
            m.gflops,
            100.0 * m.gflops / report.matmul_peak_gflops,
            rel(m.relative_to_standard),
            m.fastest_step_seconds * 1e3,
            rel(m.fastest_relative_to_standard)
        );
    }
    for m in report.modes.iter().filter(|m| !m.profile.is_empty()) {
        println!("\nphases of one {} step:", m.residual);
        for (name, secs) in &m.profile {
            println!(
                "  {name:<16} {:>8.1} ms  {:>5.1}%",
                secs * 1e3,
                100.0 * secs / m.step_seconds
            );
        }
    }
    Ok(())
}

fn bench_generate(a: &BenchArgs, configs: &[Config]) -> Result<()> {
    let base = &configs[0];
    ensure!(
        a.prompt_tokens > 0 && a.new_tokens > 0,
        "--prompt-tokens and --new-tokens must be positive"
    );
    ensure!(
        !a.batches.is_empty() && a.batches.iter().all(|&b| b > 0),
        "--batches must list positive batch sizes"
    );
    let total = a.prompt_tokens + a.new_tokens;
    ensure!(
        total <= base.max_position_embeddings,
        "--prompt-tokens + --new-tokens = {total} exceeds max_position_embeddings = {}",
        base.max_position_embeddings
    );
    eprintln!(
        "bench --generate: {} layers, hidden {}, {} heads, prompt {} + {} new tokens, batches {:?}, {} threads",
        base.num_hidden_layers,
        base.hidden_size,
        base.num_attention_heads,
        a.prompt_tokens,
        a.new_tokens,
        a.batches,
        rayon::current_num_threads()
    );
    let report = bench::run_generate(
        configs,
        a.prompt_tokens,
        a.new_tokens,
        &a.batches,
        a.warmup,
        a.steps,
        |line| eprintln!("  {line}"),
    )?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!("| mode | batch | prefill tokens/s | decode ms/step | decode tokens/s | decode latency vs standard | prefill time vs standard |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let name = |m: &bench::GenerateModeResult| {
        if m.residual == "block" {
            format!("block ({} blocks)", m.num_blocks)
        } else {
            m.residual.clone()
        }
    };
    let rel = |r: Option<f64>| r.map_or("-".into(), |r| format!("{r:.3}x"));
    for b in 0..a.batches.len() {
        for m in &report.modes {
            let r = &m.batches[b];
            println!(
                "| {} | {} | {:.0} | {:.2} | {:.0} | {} | {} |",
                name(m),
                r.batch,
                r.prefill_tokens_per_second,
                r.step_seconds * 1e3,
                r.decode_tokens_per_second,
                rel(r.latency_relative_to_standard),
                rel(r.prefill_relative_to_standard)
            );
        }
    }
    println!("\n| mode | KV cache bytes/token (whole context) | depth cache bytes/token (while in flight) |");
    println!("|---|---:|---:|");
    for m in &report.modes {
        println!(
            "| {} | {} | {} |",
            name(m),
            m.kv_cache_bytes_per_token,
            m.depth_cache_bytes_per_token
        );
    }
    for m in &report.modes {
        for r in m.batches.iter().filter(|r| !r.decode_profile.is_empty()) {
            println!("\nphases of one {} decode step, batch {}:", name(m), r.batch);
            for (phase, secs) in &r.decode_profile {
                println!(
                    "  {phase:<16} {:>8.1} us  {:>5.1}%",
                    secs * 1e6,
                    100.0 * secs / r.step_seconds
                );
            }
        }
    }
    Ok(())
}
