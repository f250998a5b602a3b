//! The command line's arguments: every command, its options and their help text. Closed sets
//! of values are enums, so that `--help` lists them and a wrong value is named at once.
//!
//! Longer than most files on purpose: declarations and help text, no logic; the commands sit
//! side by side so that an option several of them take reads the same in each.

use anyhow::Result;
use attnres::kernels::quant::Format;
use attnres::model::{Config, ResidualKind};
use attnres::train::parallel::plan::Cache;
use attnres::train::parallel::Reduce;
use attnres::train::presets;
use clap::builder::PossibleValuesParser;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "attnres",
    version = env!("ATTNRES_VERSION"),
    about = "Train, evaluate, inspect and serve transformer language models with Attention Residuals"
)]
pub(crate) struct Cli {
    /// Worker threads (default: all cores; under mpirun, the cores shared among the ranks on
    /// each machine).
    #[arg(long, global = true)]
    pub threads: Option<usize>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
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
    /// Store a checkpoint's weight matrices in a smaller format (F16, Q8_0, Q4_0, Q4_1, Q5_0,
    /// Q5_1, Q4_K, Q5_K, Q6_K) for faster, smaller inference; norms and depth-attention
    /// parameters stay f32.
    Quantize(QuantizeArgs),
    /// Write a standard checkpoint as a GGUF file that llama.cpp loads (llama architecture, with
    /// its tokenizer); AttnRes models are refused.
    Export(ExportArgs),
    /// What this machine offers the engine: threads, vector instructions, NVIDIA GPUs (or why
    /// there are none), and with --compile-for every CUDA kernel compiled by NVRTC.
    Device(DeviceArgs),
}

/// A file format `export` writes.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum ExportFormat {
    Gguf,
}

/// A storage type as `quantize` and `export` take it: ggml's name in lower case (`q8_0`,
/// `q4_k`, …), or for `export` `f32` (no block format, `None`).
#[derive(Clone, Copy)]
pub(crate) struct Dtype(pub Option<Format>);

/// Parses a [`Dtype`]: `f32` or one of [`block_format`]'s.
fn dtype(s: &str) -> Result<Dtype, String> {
    match s {
        "f32" => Ok(Dtype(None)),
        _ => block_format(s).map(|f| Dtype(Some(f))).map_err(|e| format!("f32 or {e}")),
    }
}

/// Parses a block format as `quantize` takes it: one of [`attnres::model::quantize::targets`].
fn block_format(s: &str) -> Result<Format, String> {
    let made = attnres::model::quantize::targets();
    let found = made.iter().find(|f| f.name().eq_ignore_ascii_case(s)).copied();
    found.ok_or_else(|| format!("one of {}", attnres::model::quantize::names(&made)))
}

#[derive(Args)]
pub(crate) struct ExportArgs {
    /// A standard f32 checkpoint directory with its tokenizer.json (a training run, an import).
    #[arg(long)]
    pub model: PathBuf,
    /// The file format: gguf (llama.cpp).
    #[arg(long, value_enum)]
    pub to: ExportFormat,
    /// The weight matrices' type: f32, f16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k or q6_k
    /// (the same bytes as `quantize`: the LM head's matrix in q8_0 under the 4- and 5-bit
    /// types, matrices whose rows are not whole blocks in f32); norms stay f32. `--type` is the
    /// older name, still taken.
    #[arg(long = "dtype", alias = "type", value_name = "DTYPE", value_parser = dtype, default_value = "f32")]
    pub ty: Dtype,
    /// The file to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace an existing --out.
    #[arg(long)]
    pub force: bool,
}

#[derive(Args)]
pub(crate) struct QuantizeArgs {
    /// An f32 checkpoint directory (a training run, an import, a conversion).
    #[arg(long)]
    pub model: PathBuf,
    /// The format of the weight matrices: f16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k or q6_k
    /// (the LM head's matrix takes Q8_0 under the 4- and 5-bit formats). `--to` is the older
    /// name, still taken.
    #[arg(long = "dtype", alias = "to", value_name = "DTYPE", value_parser = block_format)]
    pub to: Format,
    /// Checkpoint directory to write (the tokenizer and chat template are carried over).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace a non-empty --out.
    #[arg(long)]
    pub force: bool,
}

#[derive(Args)]
pub(crate) struct ConvertArgs {
    /// A standard checkpoint directory (an import, a training run).
    #[arg(long)]
    pub model: PathBuf,
    /// residual=block with num_blocks=N, or residual=full; rms_norm_eps=X also allowed.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Checkpoint directory to write (the tokenizer and chat template are carried over).
    #[arg(long)]
    pub out: PathBuf,
    /// Replace a non-empty --out.
    #[arg(long)]
    pub force: bool,
}

#[derive(Args)]
pub(crate) struct ImportArgs {
    /// A GGUF file (llama architecture) or a Hugging Face Llama directory (config.json,
    /// *.safetensors, tokenizer.json).
    #[arg(long)]
    pub from: PathBuf,
    /// Checkpoint directory to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Replace a non-empty --out.
    #[arg(long)]
    pub force: bool,
    /// How to store the GGUF file's weights: `keep` stores the block formats (Q8_0, Q4_0, Q4_1,
    /// Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) as they are and computes on them; `f32` expands every
    /// tensor to f32.
    #[arg(long, value_enum, default_value = "keep")]
    pub dtype: ImportDtype,
}

/// How `import` stores weights.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum ImportDtype {
    Keep,
    F32,
}

#[derive(Args)]
pub(crate) struct ServeArgs {
    /// A training run's directory (the model and its tokenizer.json).
    #[arg(long)]
    pub model: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0: any free port; the log line names it).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Sequences decoded together (key/value cache slots).
    #[arg(long, default_value_t = 16)]
    pub max_batch: usize,
    /// Requests that may wait for a slot; beyond them a request gets 429.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Prompt tokens prefilled per step, beside the running sequences' next tokens.
    #[arg(long, default_value_t = 2048)]
    pub prefill_tokens: usize,
    /// MiB of prompts' keys and values kept for reuse by later prompts that start the same way
    /// (a system prompt, a chat's earlier turns); 0 turns the prefix cache off.
    #[arg(long, default_value_t = 1024)]
    pub prefix_cache: usize,
    /// Tokens one sequence may hold, prompt and completion together [default: the model's
    /// context]: the key/value cache holds --max-batch sequences of this many.
    #[arg(long)]
    pub context: Option<usize>,
    /// The model's name in the API (default: the model directory's name).
    #[arg(long)]
    pub name: Option<String>,
    /// Connections served at once; more wait until one closes.
    #[arg(long, default_value_t = 256)]
    pub max_connections: usize,
    /// Seconds a client may take to send a request's head; also how long an idle keep-alive
    /// connection stays open.
    #[arg(long, default_value_t = 30)]
    pub header_timeout: u64,
    /// Seconds a client may take to send a request's body (then 408).
    #[arg(long, default_value_t = 60)]
    pub body_timeout: u64,
    /// Seconds a request may take from its arrival to its last token; then it is cancelled
    /// and answered with 504 (a stream ends with an error event).
    #[arg(long, default_value_t = 600)]
    pub request_timeout: u64,
    /// Seconds an answer may wait for its client to read: a connection whose writes make no
    /// progress for this long is closed and its requests cancelled.
    #[arg(long, default_value_t = 30)]
    pub write_timeout: u64,
    /// MiB of request bodies buffered over all connections together; past it a request gets
    /// 503 (one body may be up to 16 MiB).
    #[arg(long, default_value_t = 256)]
    pub max_body_total: usize,
    /// Connections one client address may hold; more are answered 429 and closed (0: no limit).
    #[arg(long, default_value_t = attnres::infer::serve::limits::CLIENT_CONNECTIONS)]
    pub max_client_connections: usize,
    /// Requests one client address may have queued or running, each choice counting as one
    /// (0: no limit) [default: half of --max-batch].
    #[arg(long)]
    pub max_client_requests: Option<usize>,
    /// Tokens (prompt and max_tokens, per choice) one client address's requests in flight may
    /// ask for (0: no limit) [default: half of --max-batch times the model's context].
    #[arg(long)]
    pub max_client_tokens: Option<usize>,
    /// Require this key (`Authorization: Bearer KEY`) on every route but /health and the page;
    /// default: the environment variable ATTNRES_API_KEY, if set (which keeps the key out of
    /// the process list).
    #[arg(long)]
    pub api_key: Option<String>,
}

#[derive(Args)]
pub(crate) struct PlanArgs {
    /// Pipeline stages (ranks in one pipeline).
    #[arg(long)]
    pub pp: usize,
    /// Virtual stages per rank (interleaved chunks).
    #[arg(long, default_value_t = 1)]
    pub vpp: usize,
    /// Micro-batches per optimiser step (default: the settings' gradient accumulation).
    #[arg(long)]
    pub micro_batches: Option<usize>,
    /// on: ranks keep the blocks they received or produced; received: only those received (the
    /// report's accounting, Eq. 8); off: every transition resends every block (Eq. 7).
    #[arg(long, value_enum, default_value_t = PpCache::On)]
    pub pp_cache: PpCache,
    /// Named preset for the model and batch shape.
    #[arg(long, default_value = presets::DEFAULT_PRESET, value_parser = preset_names())]
    pub preset: String,
    /// Override any model or training setting.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Layers, overriding the settings (with --hidden and --block-layers, for shapes no config
    /// of this machine holds, such as the report's 93 layers in blocks of 12).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Hidden size, overriding the settings.
    #[arg(long)]
    pub hidden: Option<usize>,
    /// Layers per block (Block AttnRes; the last block may be shorter), overriding the settings.
    #[arg(long)]
    pub block_layers: Option<usize>,
    /// Also print each rank's order of forward and backward passes.
    #[arg(long)]
    pub schedule: bool,
}

#[derive(Args)]
pub(crate) struct CompareArgs {
    /// Report directory: compare.json, runs/, index.html, summary.json and the figures.
    #[arg(long)]
    pub out: PathBuf,
    /// residuals (standard, block, full), ablations (docs/method.md §5), block-sizes
    /// (S = L, L/2, ..., 1) or scaling (standard and block at four sizes).
    #[arg(long, value_enum, default_value_t = Suite::Residuals)]
    pub suite: Suite,
    /// Seeds per variant (each changes initialisation and data order).
    #[arg(long, default_value_t = 1)]
    pub seeds: usize,
    /// The tiny model on 400K tokens (scaling: its own sizes and budgets): the default suite in
    /// about a minute on two cores.
    #[arg(long)]
    pub quick: bool,
    /// Change a setting of every run, e.g. --set max_tokens=1000000 --set num_hidden_layers=12.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Training text (default: the embedded Shakespeare corpus).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Print log lines instead of a progress bar.
    #[arg(long)]
    pub no_progress: bool,
    #[command(flatten)]
    pub hardware: HardwareArgs,
}

#[derive(Args)]
pub(crate) struct ReportArgs {
    /// A directory written by `attnres compare`.
    pub dir: PathBuf,
}

#[derive(Args)]
pub(crate) struct TrainArgs {
    /// Run directory: the latest model, metrics.jsonl and the resumable checkpoint.
    #[arg(long)]
    pub out: PathBuf,
    /// A TOML file with [model] and [train] tables (instead of --preset).
    #[arg(long, conflicts_with = "preset")]
    pub config: Option<PathBuf>,
    /// Named preset (configs/): tiny (about a minute), small (the default, about 13 minutes on
    /// two cores), compare, compare-quick (the models `compare` trains).
    #[arg(long, value_parser = preset_names())]
    pub preset: Option<String>,
    /// Override any model or training setting, e.g. --set residual=full --set lr=1e-3.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Training text: a file, a directory of files, or JSONL with a "text" field
    /// (default: the embedded Shakespeare corpus; on --resume, the run's own).
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Use this tokenizer.json instead of training a byte-level BPE on the data.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Start from this checkpoint (an import, a conversion, a run) and its tokenizer instead of
    /// a fresh model: the model's settings are its config.json; --preset, --config's [train]
    /// and --set give the training settings.
    #[arg(long, conflicts_with = "tokenizer")]
    pub init: Option<PathBuf>,
    /// Continue the run in --out from its last checkpoint.
    #[arg(long, conflicts_with = "overwrite")]
    pub resume: bool,
    /// Replace a run already in --out.
    #[arg(long)]
    pub overwrite: bool,
    /// Plain log lines instead of a progress bar.
    #[arg(long)]
    pub no_progress: bool,
    #[command(flatten)]
    pub hardware: HardwareArgs,
    /// Under mpirun: how the ranks add their gradients. exact: in the order one process adds
    /// them (bit-identical to training alone); mpi: MPI's all-reduce (docs/distributed.md).
    #[arg(long, value_enum, default_value_t = ReduceArg::Exact)]
    pub reduce: ReduceArg,
    /// Under mpirun: pipeline stages, ranks per pipeline; the job's ranks form
    /// ranks / --pp data-parallel replicas of the pipeline (docs/pipeline.md).
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Virtual stages per pipeline rank: the model is cut into --pp x --vpp chunks.
    #[arg(long, default_value_t = 1)]
    pub vpp: usize,
    /// on: pipeline ranks keep the blocks they received or produced and are sent only new
    /// ones; off: every transition resends every completed block.
    #[arg(long, value_enum, default_value_t = PpCache::On)]
    pub pp_cache: PpCache,
    /// Under mpirun: seconds a rank waits for another (a message, a sum over the ranks) before
    /// it ends the job, naming the rank: one that was stopped or hangs (docs/distributed.md).
    #[arg(long, default_value_t = 600)]
    pub comm_timeout: u64,
}

#[derive(Args)]
pub(crate) struct EvalArgs {
    /// Checkpoint directory (with tokenizer.json), e.g. a training run's --out.
    #[arg(long)]
    pub model: PathBuf,
    /// UTF-8 text file to measure.
    #[arg(long)]
    pub text: PathBuf,
    /// Window length in tokens (default: the model's max_position_embeddings).
    #[arg(long)]
    pub seq: Option<usize>,
    /// Print one JSON object with loss, perplexity and bits_per_byte.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub hardware: HardwareArgs,
}

#[derive(Args)]
pub(crate) struct ModelChoice {
    /// Named preset for the model shape (configs/): tiny, small, compare, compare-quick.
    #[arg(long, default_value = presets::DEFAULT_PRESET, value_parser = preset_names())]
    pub preset: String,
    /// Override any config.json key, e.g. --set hidden_size=64 --set residual=full.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
}

impl ModelChoice {
    pub fn config(&self) -> Result<Config> {
        presets::model_config(&self.preset)?.with_overrides(&self.sets)
    }
}

#[derive(Args)]
pub(crate) struct InitArgs {
    /// Checkpoint directory to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of the initialisation.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub model: ModelChoice,
    /// Replace a checkpoint already in --out.
    #[arg(long)]
    pub force: bool,
}

#[derive(Args)]
pub(crate) struct ForwardArgs {
    /// Checkpoint directory.
    #[arg(long)]
    pub model: PathBuf,
    /// JSON file: {"input_ids": [[...], ...], "targets": [[...], ...]} (targets optional).
    #[arg(long)]
    pub batch: PathBuf,
    /// Output safetensors file: logits, and with targets also loss and grad.<parameter>.
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Args)]
pub(crate) struct BenchArgs {
    #[command(flatten)]
    pub model: ModelChoice,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 256)]
    pub seq: usize,
    /// Timed steps per mode (with --generate: timed rounds); the median is reported.
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// Untimed warm-up steps per mode.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    #[command(flatten)]
    pub hardware: HardwareArgs,
    /// Residual modes to compare: standard, full, block (block uses the preset's num_blocks).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "standard,block,full")]
    pub modes: Vec<Mode>,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Also report the time per step of each phase (linear layers, attention, norms, the
    /// residual connection, ...); with --device cuda, of each kernel over one more step.
    #[arg(long)]
    pub profile: bool,
    /// Activation recomputation (train's `recompute` setting): backward recomputes each
    /// sublayer's work from its input instead of keeping it from forward.
    #[arg(long, conflicts_with = "generate")]
    pub recompute: bool,
    /// Benchmark generation instead: prefill and decode throughput, decode latency per mode.
    #[arg(long)]
    pub generate: bool,
    /// With --generate: tokens per prompt.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// With --generate: tokens decoded per sequence and round.
    #[arg(long, default_value_t = 64)]
    pub new_tokens: usize,
    /// With --generate: batch sizes (sequences decoded together).
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    pub batches: Vec<usize>,
    /// With --generate: benchmark these checkpoint directories (any format, e.g. an f32 model
    /// and its quantised copies) instead of fresh models of each mode; repeat for several.
    #[arg(long = "checkpoint", value_name = "DIR")]
    pub checkpoints: Vec<PathBuf>,
}

#[derive(Args)]
pub(crate) struct GenerateArgs {
    /// Model directory with tokenizer.json: a training run's --out.
    #[arg(long)]
    pub model: PathBuf,
    /// Text to continue.
    #[arg(long, conflicts_with = "prompt_file", required_unless_present_any = ["prompt_file", "chat"])]
    pub prompt: Option<String>,
    /// A message to an instruction model: put into the model's chat template (an imported
    /// model's tokenizer_config.json); the answer ends at its end-of-turn token.
    #[arg(long, conflicts_with_all = ["prompt", "prompt_file"])]
    pub chat: Option<String>,
    /// With --chat: a system message before it.
    #[arg(long)]
    pub system: Option<String>,
    /// A UTF-8 file with one prompt per line, generated as one batch; prints one JSON object
    /// per prompt ({"prompt", "completion", "new_tokens", "stop"}).
    #[arg(long)]
    pub prompt_file: Option<PathBuf>,
    /// New tokens per prompt (fewer if the model ends the text).
    #[arg(long, default_value_t = 200, allow_negative_numbers = true)]
    pub max_tokens: i64,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Sample only from the K most likely tokens.
    #[arg(long, allow_negative_numbers = true)]
    pub top_k: Option<i64>,
    /// Sample only from the most likely tokens whose probabilities add up to P (0 < P <= 1).
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// Seed of the sampler (same seed, same prompts: same text).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// When prompt plus new tokens outgrow the model's context, keep going over a sliding
    /// window (the cache is rebuilt from the latest half of the context) instead of refusing.
    #[arg(long)]
    pub slide: bool,
    /// Keep generating past the end-of-text token, to --max-tokens (for benchmarks)
    #[arg(long)]
    pub ignore_eos: bool,
}

/// The named presets (configs/), as `--preset` accepts them.
fn preset_names() -> PossibleValuesParser {
    PossibleValuesParser::new(presets::names())
}

/// Where a command computes (`--device`).
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum DeviceArg {
    /// The CPU's threads.
    Cpu,
    /// The first NVIDIA GPU.
    Cuda,
}

/// The activations' type on a GPU (`--precision`).
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum PrecisionArg {
    /// bf16 activations and matrix products over f32 weights (mixed precision).
    Bf16,
    /// f32 throughout, TF32 off (the exact mode).
    Fp32,
}

impl From<PrecisionArg> for attnres::gpu::Precision {
    fn from(p: PrecisionArg) -> Self {
        match p {
            PrecisionArg::Bf16 => attnres::gpu::Precision::Bf16,
            PrecisionArg::Fp32 => attnres::gpu::Precision::Fp32,
        }
    }
}

/// Where `train`, `eval`, `bench` and `compare` compute, and in which precision on a GPU.
#[derive(Args)]
pub(crate) struct HardwareArgs {
    /// Where the work runs: cpu, or cuda for the first NVIDIA GPU (docs/gpu.md); checkpoints
    /// are the same either way.
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// With --device cuda: bf16 (mixed precision: bf16 activations and matrix products over
    /// f32 weights) or fp32 (f32 throughout, TF32 off: the exact mode).
    #[arg(long, value_enum, default_value_t = PrecisionArg::Bf16)]
    pub precision: PrecisionArg,
}

impl HardwareArgs {
    /// `--device` at `--precision`.
    pub fn get(&self) -> attnres::train::run::Hardware {
        match self.device {
            DeviceArg::Cpu => attnres::train::run::Hardware::Cpu,
            DeviceArg::Cuda => attnres::train::run::Hardware::Cuda(self.precision.into()),
        }
    }
}

/// How the ranks of a job add their gradients (`--reduce`).
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum ReduceArg {
    /// In the order one process adds them: bit-identical to training alone.
    Exact,
    /// MPI's all-reduce.
    Mpi,
}

impl ReduceArg {
    pub fn get(self) -> Reduce {
        match self {
            ReduceArg::Exact => Reduce::Exact,
            ReduceArg::Mpi => Reduce::Mpi,
        }
    }
}

/// What a pipeline rank keeps of the depth sources it has seen (`--pp-cache`).
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum PpCache {
    /// The sources it received or produced.
    #[value(alias = "kept")]
    On,
    /// Only those it received (the report's accounting).
    Received,
    /// Nothing: every transition resends every completed source.
    Off,
}

impl PpCache {
    pub fn get(self) -> Cache {
        match self {
            PpCache::On => Cache::Kept,
            PpCache::Received => Cache::Received,
            PpCache::Off => Cache::Off,
        }
    }
}

/// What `compare` trains (`--suite`).
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Suite {
    Residuals,
    Ablations,
    BlockSizes,
    Scaling,
}

impl Suite {
    /// The suite's name, as the library and the report directory know it.
    pub fn name(self) -> String {
        self.to_possible_value().expect("no variant is skipped").get_name().to_string()
    }
}

/// A residual mode to benchmark (`--modes`).
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Mode {
    Standard,
    Block,
    Full,
}

impl Mode {
    pub fn get(self) -> ResidualKind {
        match self {
            Mode::Standard => ResidualKind::Standard,
            Mode::Block => ResidualKind::Block,
            Mode::Full => ResidualKind::Full,
        }
    }
}

#[derive(Args)]
pub(crate) struct DeviceArgs {
    /// Compile every CUDA kernel with NVRTC for this architecture (sm_90 for Hopper) and show
    /// each kernel's registers, shared memory and any local memory; needs the NVRTC library,
    /// not a GPU.
    #[arg(long, value_name = "ARCH")]
    pub compile_for: Option<String>,
    /// With --compile-for, write each kernel file's PTX and CUBIN into this folder (NAME.ptx,
    /// NAME.cubin), for cuobjdump or nvdisasm to show the machine code.
    #[arg(long, value_name = "DIR", requires = "compile_for")]
    pub save: Option<PathBuf>,
}
