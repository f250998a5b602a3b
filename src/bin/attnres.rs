//! The `attnres` command line: arguments and what is printed. The work itself is done by the
//! library (`train`, `compare`, `report`, `eval`, `forward`, `generate`, `bench`).

use anyhow::{bail, ensure, Context, Result};
use attnres::base::progress::log;
use attnres::infer::generate::{self, GenerateOptions, Overflow, Sampling, TextStream};
use attnres::model::{checkpoint, Config, Model};
use attnres::model::checkpoint::load_with_tokenizer;
use attnres::train::config::RunConfig;
use attnres::train::parallel::pipeline::Layout;
use attnres::train::parallel::{Reduce, Reported};
use attnres::train::run::{self, TrainOptions};
use attnres::{
    experiments::bench, experiments::compare, experiments::suite, infer::eval, infer::forward,
    train::presets,
};
use clap::{Args, Parser, Subcommand};
use std::io::Write;
use std::path::PathBuf;

#[global_allocator]
static ALLOC: attnres::base::alloc::Recycling = attnres::base::alloc::Recycling;

#[derive(Parser)]
#[command(
    name = "attnres",
    version = env!("ATTNRES_VERSION"),
    about = "Train, evaluate, inspect and serve transformer language models with Attention Residuals"
)]
struct Cli {
    /// Worker threads (default: all cores; under mpirun, the cores shared among the ranks on
    /// each machine).
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
    /// Serve a model over HTTP with the OpenAI API (completions, chat, streaming), batching
    /// concurrent requests.
    Serve(ServeArgs),
    /// Plan pipeline-parallel training without training: chunks, what crosses each stage
    /// transition (with and without the cross-stage cache), the schedule and its bubble.
    Plan(PlanArgs),
    /// Import a Llama checkpoint (a GGUF file or a Hugging Face directory) as a checkpoint with
    /// its tokenizer, ready for generate and eval.
    Import(ImportArgs),
    /// Upcycle a standard checkpoint to Full or Block AttnRes: the same weights plus depth
    /// parameters that start as the standard residual (pseudo-queries zero, key-norm gains one).
    Convert(ConvertArgs),
}

#[derive(Args)]
struct ConvertArgs {
    /// A standard checkpoint directory (an import, a training run).
    #[arg(long)]
    model: PathBuf,
    /// residual=block with num_blocks=N, or residual=full; rms_norm_eps=X also allowed.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Checkpoint directory to write (the tokenizer and chat template are carried over).
    #[arg(long)]
    out: PathBuf,
    /// Replace a non-empty --out.
    #[arg(long)]
    force: bool,
}

#[derive(Args)]
struct ImportArgs {
    /// A GGUF file (llama architecture) or a Hugging Face Llama directory (config.json,
    /// *.safetensors, tokenizer.json).
    #[arg(long)]
    from: PathBuf,
    /// Checkpoint directory to write.
    #[arg(long)]
    out: PathBuf,
    /// Replace a non-empty --out.
    #[arg(long)]
    force: bool,
}

#[derive(Args)]
struct ServeArgs {
    /// A training run's directory (the model and its tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0: any free port; the log line names it).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Sequences decoded together (key/value cache slots).
    #[arg(long, default_value_t = 16)]
    max_batch: usize,
    /// Requests that may wait for a slot; beyond them a request gets 429.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Prompt tokens prefilled per step, beside the running sequences' next tokens.
    #[arg(long, default_value_t = 2048)]
    prefill_tokens: usize,
    /// The model's name in the API (default: the model directory's name).
    #[arg(long)]
    name: Option<String>,
}

#[derive(Args)]
struct PlanArgs {
    /// Pipeline stages (ranks in one pipeline).
    #[arg(long)]
    pp: usize,
    /// Virtual stages per rank (interleaved chunks).
    #[arg(long, default_value_t = 1)]
    vpp: usize,
    /// Micro-batches per optimiser step (default: the settings' gradient accumulation).
    #[arg(long)]
    micro_batches: Option<usize>,
    /// on: ranks keep the blocks they received or produced; received: only those received (the
    /// report's accounting, Eq. 8); off: every transition resends every block (Eq. 7).
    #[arg(long, default_value = "on")]
    pp_cache: String,
    /// Named preset for the model and batch shape.
    #[arg(long, default_value = presets::DEFAULT_PRESET)]
    preset: String,
    /// Override any model or training setting.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Layers, overriding the settings (with --hidden and --block-layers, for shapes no config
    /// of this machine holds, such as the report's 93 layers in blocks of 12).
    #[arg(long)]
    layers: Option<usize>,
    /// Hidden size, overriding the settings.
    #[arg(long)]
    hidden: Option<usize>,
    /// Layers per block (Block AttnRes; the last block may be shorter), overriding the settings.
    #[arg(long)]
    block_layers: Option<usize>,
    /// Also print each rank's order of forward and backward passes.
    #[arg(long)]
    schedule: bool,
}

#[derive(Args)]
struct CompareArgs {
    /// Report directory: compare.json, runs/, index.html, summary.json and the figures.
    #[arg(long)]
    out: PathBuf,
    /// residuals (standard, block, full), ablations (docs/method.md §5), block-sizes
    /// (S = L, L/2, ..., 1) or scaling (standard and block at four sizes).
    #[arg(long, default_value = "residuals")]
    suite: String,
    /// Seeds per variant (each changes initialisation and data order).
    #[arg(long, default_value_t = 1)]
    seeds: usize,
    /// The tiny model on 400K tokens (scaling: its own sizes and budgets): the default suite in
    /// about a minute on two cores.
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
    /// Named preset (configs/): tiny (about a minute), small (the default, about 13 minutes on
    /// two cores), compare, compare-quick (the models `compare` trains).
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
    /// Start from this checkpoint (an import, a conversion, a run) and its tokenizer instead of
    /// a fresh model: the model's settings are its config.json; --preset, --config's [train]
    /// and --set give the training settings.
    #[arg(long, conflicts_with = "tokenizer")]
    init: Option<PathBuf>,
    /// Continue the run in --out from its last checkpoint.
    #[arg(long, conflicts_with = "overwrite")]
    resume: bool,
    /// Replace a run already in --out.
    #[arg(long)]
    overwrite: bool,
    /// Plain log lines instead of a progress bar.
    #[arg(long)]
    no_progress: bool,
    /// Under mpirun: how the ranks add their gradients. exact: in the order one process adds
    /// them (bit-identical to training alone); mpi: MPI's all-reduce (docs/distributed.md).
    #[arg(long, default_value = "exact", value_parser = ["exact", "mpi"])]
    reduce: String,
    /// Under mpirun: pipeline stages, ranks per pipeline; the job's ranks form
    /// ranks / --pp data-parallel replicas of the pipeline (docs/pipeline.md).
    #[arg(long, default_value_t = 1)]
    pp: usize,
    /// Virtual stages per pipeline rank: the model is cut into --pp x --vpp chunks.
    #[arg(long, default_value_t = 1)]
    vpp: usize,
    /// on: pipeline ranks keep the blocks they received or produced and are sent only new
    /// ones; off: every transition resends every completed block.
    #[arg(long, default_value = "on", value_parser = ["on", "off", "received"])]
    pp_cache: String,
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
    /// Named preset for the model shape (configs/): tiny, small, compare, compare-quick.
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
    /// Activation recomputation (train's `recompute` setting): backward recomputes each
    /// sublayer's work from its input instead of keeping it from forward.
    #[arg(long, conflicts_with = "generate")]
    recompute: bool,
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
    #[arg(long, conflicts_with = "prompt_file", required_unless_present_any = ["prompt_file", "chat"])]
    prompt: Option<String>,
    /// A message to an instruction model: put into the model's chat template (an imported
    /// model's tokenizer_config.json); the answer ends at its end-of-turn token.
    #[arg(long, conflicts_with_all = ["prompt", "prompt_file"])]
    chat: Option<String>,
    /// With --chat: a system message before it.
    #[arg(long)]
    system: Option<String>,
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
    /// Keep generating past the end-of-text token, to --max-tokens (for benchmarks)
    #[arg(long)]
    ignore_eos: bool,
}

/// The exit status when stdout is a pipe whose reader has gone (EPIPE): what a shell reports
/// for a Unix tool that SIGPIPE ended (128 + 13). Nothing is printed (docs/development.md,
/// "Errors and exit codes").
const CLOSED_PIPE_EXIT: i32 = 141;

fn main() {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                e.exit(); // --help and --version: printed on stdout, exit 0
            }
            // Under mpirun every rank has the same arguments: rank 0 alone says what is wrong
            // (the others stop quietly, as for any error another rank reports).
            if attnres::train::parallel::comm::launched().is_some_and(|(_, rank)| rank != 0) {
                std::process::exit(0);
            }
            log(&format!("error: {}", usage_error(&e)));
            std::process::exit(1);
        }
    };
    if let Err(e) = run(cli) {
        if closed_pipe(&e) {
            std::process::exit(CLOSED_PIPE_EXIT);
        }
        // Under mpirun, the rank that failed first prints the error and exits with 1; the
        // others stop quietly with 0: mpirun ends the whole job at the first non-zero exit, which
        // must not come before the error is printed. mpirun's own exit status is then 1.
        if e.downcast_ref::<Reported>().is_some() {
            std::process::exit(0);
        }
        log(&format!("error: {e:#}"));
        std::process::exit(1);
    }
}

/// An argument error as one line (docs/development.md, "Errors and exit codes"): clap's first
/// line without its `error: ` prefix, and where to read more.
fn usage_error(e: &clap::Error) -> String {
    if e.kind() == clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
        return "no command given: one of init, forward, train, eval, generate, serve, bench, \
                compare, report, plan, import, convert (see attnres --help)"
            .into();
    }
    // The message runs to the first blank line or the usage block; a list of missing
    // arguments continues on indented lines.
    let text = e.to_string();
    let message: Vec<&str> = text
        .lines()
        .map(str::trim)
        .skip_while(|l| l.is_empty())
        .take_while(|l| !l.is_empty() && !l.starts_with("Usage:"))
        .collect();
    let message = message.join(" ");
    let message = message.strip_prefix("error: ").unwrap_or(&message);
    format!("{message} (see attnres --help)")
}

/// Whether the error is a write to stdout, a pipe whose reader has closed it.
fn closed_pipe(e: &anyhow::Error) -> bool {
    let broken = |c: &(dyn std::error::Error + 'static)| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    };
    e.chain().any(|c| c.to_string() == STDOUT) && e.chain().any(broken)
}

/// Writes a result (text, numbers, JSON, a table) to stdout and flushes it. A stdout that is
/// closed or full is an error: the result did not arrive.
fn output(text: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes()).and_then(|()| out.flush()).context(STDOUT)
}

const STDOUT: &str = "cannot write to standard output";

fn run(cli: Cli) -> Result<()> {
    let ranks = ranks(&cli.command)?;
    let threads = match (cli.threads, &ranks) {
        (Some(n), _) => Some(attnres::kernels::check_threads(n)?),
        (None, Some(r)) => Some(default_threads(r)),
        (None, None) => None,
    };
    // The workers' stacks as large as the main thread's, since commands run on one of them.
    let mut pool = rayon::ThreadPoolBuilder::new().stack_size(8 << 20);
    if let Some(n) = threads {
        pool = pool.num_threads(n);
    }
    pool.build_global().context("cannot start the thread pool")?;
    match ranks {
        // MPI was initialised on this thread, the only one that may call it ("funneled").
        Some(r) => command(cli.command, Some(&r)),
        // The server runs its model on threads of its own.
        None if matches!(cli.command, Command::Serve(_)) => command(cli.command, None),
        // Everything else on a thread of rayon's pool (`scope` runs its body on one and returns
        // its result). A parallel kernel called from outside the pool hands its work to the pool
        // and sleeps until the work is done, and the pool finds its threads asleep after every
        // stretch of serial code; from a pool thread, the caller does half the work itself and
        // only the other thread has to be woken, so a step makes far fewer context switches
        // (docs/performance.md, "What makes it fast").
        None => rayon::scope(|_| command(cli.command, None)),
    }
}

fn command(command: Command, ranks: Option<&Ranks>) -> Result<()> {
    match command {
        Command::Init(a) => init(a),
        Command::Forward(a) => forward_cmd(a),
        Command::Train(a) => train_cmd(a, ranks),
        Command::Eval(a) => eval_cmd(a),
        Command::Generate(a) => generate_cmd(a),
        Command::Bench(a) => bench_cmd(a),
        Command::Compare(a) => compare_cmd(a),
        Command::Report(a) => {
            let page = attnres::experiments::report::write(&a.dir)?;
            log(&format!("report: {}", page.display()));
            Ok(())
        }
        Command::Plan(a) => plan_cmd(a),
        Command::Import(a) => {
            let summary = attnres::import::import(&a.from, &a.out, a.force)?;
            log(&summary.line(&a.out));
            Ok(())
        }
        Command::Convert(a) => {
            let done = attnres::import::convert::convert(&a.model, &a.sets, &a.out, a.force)?;
            log(&done.line(&a.model, &a.out));
            Ok(())
        }
        Command::Serve(a) => attnres::infer::serve::run(attnres::infer::serve::ServeOptions {
            model: a.model,
            host: a.host,
            port: a.port,
            engine: attnres::infer::serve::engine::EngineOptions {
                max_batch: a.max_batch,
                max_queue: a.max_queue,
                prefill_tokens: a.prefill_tokens,
            },
            name: a.name,
        }),
    }
}

fn compare_cmd(a: CompareArgs) -> Result<()> {
    let base = suite::base(a.quick)?.with_overrides(&a.sets)?;
    let variants = suite::suite(&a.suite, &base)?;
    let plan = suite::Plan { suite: a.suite.clone(), base, variants, seeds: a.seeds, data: a.data };
    compare::run(&plan, &compare::CompareOptions { out: a.out, progress: !a.no_progress })
}

fn plan_cmd(a: PlanArgs) -> Result<()> {
    use attnres::train::parallel::plan::{Cache, Depth, PlanText, Shape};
    let run = presets::run_config(&a.preset)?.with_overrides(&a.sets)?;
    let mut depth = Depth::of(&run.model);
    if let Some(l) = a.layers {
        ensure!(l > 0, "--layers must be at least 1");
        depth.sublayers = 2 * l;
    }
    if let Some(k) = a.block_layers {
        ensure!(k > 0, "--block-layers must be at least 1");
        depth.block = Some(2 * k);
    }
    let shape = Shape {
        stages: a.pp,
        virtual_stages: a.vpp,
        micro_batches: a.micro_batches.unwrap_or(run.train.accumulation()),
    };
    let text = PlanText {
        depth: &depth,
        shape: &shape,
        cache: Cache::parse(&a.pp_cache)?,
        hidden_size: a.hidden.unwrap_or(run.model.hidden_size),
        tokens: run.train.micro_batch * run.train.seq_len,
        tied_head: run.model.tie_word_embeddings,
        show_schedule: a.schedule,
    };
    output(&text.render()?)
}

/// The ranks of an MPI job this process is one of (none when it runs alone). Only `train` runs
/// on several ranks; without the `mpi` feature no command does.
#[cfg(feature = "mpi")]
type Ranks = attnres::train::parallel::comm::mpi::Mpi;
#[cfg(not(feature = "mpi"))]
type Ranks = std::convert::Infallible;

#[cfg(feature = "mpi")]
fn ranks(command: &Command) -> Result<Option<Ranks>> {
    let Some((size, rank)) = attnres::train::parallel::comm::launched() else { return Ok(None) };
    if !matches!(command, Command::Train(_)) {
        // Every rank would do the same work: say so once.
        ensure!(rank != 0, "only train runs on several ranks; start this command without mpirun ({size} ranks here)");
        return Err(Reported.into());
    }
    Ok(Some(Ranks::init()?))
}

#[cfg(not(feature = "mpi"))]
fn ranks(_: &Command) -> Result<Option<Ranks>> {
    let Some((size, rank)) = attnres::train::parallel::comm::launched() else { return Ok(None) };
    ensure!(
        rank != 0,
        "this attnres was built without MPI, so the {size} ranks of mpirun would each train alone: build it with `cargo build --release --features mpi` (docs/distributed.md)"
    );
    Err(Reported.into())
}

/// Worker threads per rank when --threads is not given: the machine's cores shared among the
/// ranks running on it.
#[cfg(feature = "mpi")]
fn default_threads(r: &Ranks) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / r.local_size().max(1)).max(1)
}

#[cfg(not(feature = "mpi"))]
fn default_threads(r: &Ranks) -> usize {
    match *r {}
}

fn train_cmd(a: TrainArgs, ranks: Option<&Ranks>) -> Result<()> {
    // With --resume and no settings, the run continues with its own; settings given with
    // --resume must equal the run's (the training loop names the first difference).
    let settings_given =
        !a.sets.is_empty() || a.config.is_some() || a.preset.is_some() || a.init.is_some();
    let run = if a.resume && !settings_given {
        None
    } else {
        let base = match &a.config {
            Some(p) => {
                let text = attnres::base::fs::read_utf8(p)?;
                if a.init.is_some() {
                    let doc: toml::Table = toml::from_str(&text)
                        .with_context(|| format!("{}: invalid TOML", p.display()))?;
                    ensure!(!doc.contains_key("model"), "{}: a [model] table does not go with --init (the model's settings are its checkpoint's config.json)", p.display());
                }
                RunConfig::from_toml(&text, &p.display().to_string())?
            }
            None => presets::run_config(a.preset.as_deref().unwrap_or(presets::DEFAULT_PRESET))?,
        };
        Some(match &a.init {
            Some(dir) => run::setup::init_settings(dir, &base, &a.sets)?,
            None => base.with_overrides(&a.sets)?,
        })
    };
    let opts = TrainOptions {
        out: a.out,
        data: a.data,
        tokenizer: a.tokenizer,
        init: a.init,
        resume: a.resume,
        overwrite: a.overwrite,
        progress: !a.no_progress,
        shared_bar: None,
    };
    let reduce = Reduce::parse(&a.reduce)?;
    let layout = Layout {
        stages: a.pp,
        virtual_stages: a.vpp,
        cache: attnres::train::parallel::plan::Cache::parse(&a.pp_cache)?,
        grads: match reduce {
            Reduce::Exact => attnres::train::parallel::plan::Grads::InOrder,
            Reduce::Mpi => attnres::train::parallel::plan::Grads::Once,
        },
    };
    match ranks {
        None => {
            layout.check_ranks(1)?;
            run::train(run, &opts).map(drop)
        }
        Some(r) => train_ranks(run, &opts, r, reduce, layout),
    }
}

/// Trains as one rank of an MPI job.
#[cfg(feature = "mpi")]
fn train_ranks(
    run: Option<RunConfig>,
    opts: &TrainOptions,
    r: &Ranks,
    reduce: Reduce,
    layout: Layout,
) -> Result<()> {
    use attnres::train::parallel::comm::Comm;
    let group = attnres::train::parallel::Group::new(r, reduce).with_layout(layout);
    // Every rank has the same arguments: rank 0 alone says what is wrong.
    let group = match group {
        Err(e) if r.rank() == 0 => return Err(e),
        Err(_) => return Err(Reported.into()),
        Ok(g) => g,
    };
    let done = run::train_on(run, opts, Some(&group));
    if let Err(e) = &done {
        if !group.failure_agreed() {
            // The other ranks do not know of this failure and may be waiting for this rank:
            // end the whole job.
            log(&format!("error: {e:#}"));
            r.abort(1);
        }
    }
    done.map(drop)
}

#[cfg(not(feature = "mpi"))]
fn train_ranks(
    _: Option<RunConfig>,
    _: &TrainOptions,
    r: &Ranks,
    _: Reduce,
    _: Layout,
) -> Result<()> {
    match *r {}
}

fn generate_cmd(a: GenerateArgs) -> Result<()> {
    ensure!(a.max_tokens > 0, "--max-tokens must be at least 1, got {}", a.max_tokens);
    ensure!(a.system.is_none() || a.chat.is_some(), "--system goes with --chat");
    let top_k = match a.top_k {
        Some(k) if k < 1 => bail!("--top-k must be at least 1, got {k}"),
        k => k.map(|k| k as usize),
    };
    let sampling = Sampling { temperature: a.temperature, top_k, top_p: a.top_p };
    sampling.validate().map_err(|e| anyhow::anyhow!("--{e}"))?;
    let texts: Vec<String> = match (&a.prompt, &a.prompt_file, &a.chat) {
        (Some(p), ..) => {
            ensure!(!p.is_empty(), "--prompt is empty: give some text to continue");
            vec![p.clone()]
        }
        (None, Some(f), _) => generate::read_prompts(f)?,
        (None, None, Some(message)) => {
            let template = attnres::text::chat::ChatTemplate::load(&a.model)?;
            let mut messages = Vec::new();
            if let Some(s) = &a.system {
                messages.push(("system", s.as_str()));
            }
            messages.push(("user", message.as_str()));
            vec![template.render(&messages)?]
        }
        (None, None, None) => bail!("give --prompt TEXT, --prompt-file FILE or --chat MESSAGE"),
    };
    let (model, bpe) = load_with_tokenizer(&a.model)?;
    generate::check_tokenizer(model.config.vocab_size, &bpe)?;
    let prompts = texts.iter().map(|t| bpe.encode(t)).collect::<Result<Vec<_>>>()?;
    let opts = GenerateOptions {
        max_tokens: a.max_tokens as usize,
        sampling,
        seed: a.seed,
        overflow: if a.slide { Overflow::Slide } else { Overflow::Error },
        stop: (!a.ignore_eos).then_some(bpe.eot),
    };
    // --prompt streams text; --prompt-file (even with one line) prints JSON lines. --chat
    // streams the answer alone.
    let single = a.prompt.is_some() || a.chat.is_some();
    let mut stream = TextStream::new(&bpe).after(prompts[0].last().copied());
    if a.prompt.is_some() {
        output(&texts[0])?;
    }
    let (gens, timing) = generate::generate(&model, &prompts, &opts, |_, tok| {
        if !single {
            return Ok(());
        }
        if let Some(text) = stream.push(tok) {
            // A reader that has gone ends generation: nobody would read the rest.
            let mut out = std::io::stdout().lock();
            out.write_all(text.as_bytes()).and_then(|()| out.flush()).context(STDOUT)?;
        }
        Ok(())
    })?;
    if single {
        output(&format!("{}\n", stream.finish()?))?;
    } else {
        let mut lines = String::new();
        for (t, g) in texts.iter().zip(&gens) {
            let line = serde_json::json!({"prompt": t, "completion": g.text(&bpe)?, "new_tokens": g.tokens.len(), "stop": g.stop});
            lines.push_str(&format!("{line}\n"));
        }
        output(&lines)?;
    }
    log(&timing.summary());
    Ok(())
}

fn eval_cmd(a: EvalArgs) -> Result<()> {
    let (model, bpe) = load_with_tokenizer(&a.model)?;
    let text = attnres::base::fs::read_utf8(&a.text)?;
    let m = eval::measure(&model, &bpe, &text, &a.text.display().to_string(), a.seq)?;
    if a.json {
        output(&format!(
            "{}\n",
            serde_json::json!({"loss": m.loss, "perplexity": m.perplexity, "bits_per_byte": m.bits_per_byte, "tokens": m.tokens, "bytes": m.bytes})
        ))
    } else {
        output(&format!(
            "{}: {} tokens, loss {:.4} nats/token, perplexity {:.2}, {:.4} bits/byte\n",
            a.text.display(),
            m.tokens,
            m.loss,
            m.perplexity,
            m.bits_per_byte
        ))
    }
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
    log(&format!(
        "wrote {} ({} parameters, residual = {})",
        a.out.display(),
        model.params.len(),
        model.config.residual_label()
    ));
    Ok(())
}

fn forward_cmd(a: ForwardArgs) -> Result<()> {
    let model = checkpoint::load(&a.model)?;
    let batch = forward::BatchFile::read(&a.batch)?;
    let output = forward::run(&model, &batch)?;
    if let Some(loss) = output.loss {
        log(&format!("loss {loss:.6}"));
    }
    forward::write_output(&a.out, &output.safetensors)
}

fn bench_cmd(a: BenchArgs) -> Result<()> {
    ensure!(a.batch > 0 && a.seq > 0 && a.steps > 0, "--batch, --seq and --steps must be positive");
    let base = a.model.config()?;
    let configs = bench::mode_configs(&base, &a.modes)?;
    attnres::base::profile::enable(a.profile);
    if a.generate {
        return bench_generate(&a, &configs);
    }
    ensure!(
        a.seq <= base.max_position_embeddings,
        "--seq {} exceeds max_position_embeddings = {}",
        a.seq,
        base.max_position_embeddings
    );
    log(&format!(
        "bench: {} layers, hidden {}, {} heads, batch {} x seq {}, {} threads{}",
        base.num_hidden_layers,
        base.hidden_size,
        base.num_attention_heads,
        a.batch,
        a.seq,
        rayon::current_num_threads(),
        if a.recompute { ", recomputing activations" } else { "" }
    ));
    let (batch, seq, recompute) = (a.batch, a.seq, a.recompute);
    let report = bench::run(&configs, batch, seq, recompute, a.warmup, a.steps, |line| {
        log(&format!("  {line}"))
    })?;
    if a.json {
        return output(&format!("{}\n", serde_json::to_string_pretty(&report)?));
    }
    output(&report.table())
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
    log(&format!(
        "bench --generate: {} layers, hidden {}, {} heads, prompt {} + {} new tokens, batches {:?}, {} threads",
        base.num_hidden_layers,
        base.hidden_size,
        base.num_attention_heads,
        a.prompt_tokens,
        a.new_tokens,
        a.batches,
        rayon::current_num_threads()
    ));
    let report = bench::run_generate(
        configs,
        a.prompt_tokens,
        a.new_tokens,
        &a.batches,
        a.warmup,
        a.steps,
        |line| log(&format!("  {line}")),
    )?;
    if a.json {
        return output(&format!("{}\n", serde_json::to_string_pretty(&report)?));
    }
    output(&report.table())
}
