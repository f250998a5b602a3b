//! Each command: its arguments checked and turned into the library's options, the work done by
//! the library, and the result printed.

use crate::args::*;
use crate::output::{output, write_stdout};
use crate::ranks::Ranks;
use anyhow::{bail, ensure, Context, Result};
use attnres::base::fs::write_atomic;
use attnres::base::progress::log;
use attnres::experiments::{bench, compare, suite};
use attnres::gpu::act::Act;
use attnres::gpu::buffer::Bf16;
use attnres::gpu::device::Device;
use attnres::gpu::Precision;
use attnres::infer::generate::{self, GenerateOptions, Overflow, Sampling, TextStream};
use attnres::infer::{eval, forward};
use attnres::model::checkpoint::load_with_tokenizer;
use attnres::model::{checkpoint, Config, Model};
use attnres::train::config::RunConfig;
use attnres::train::parallel::pipeline::Layout;
use attnres::train::parallel::Reduce;
use attnres::train::presets;
use attnres::train::run::setup::Settings;
use attnres::train::run::{self, Hardware, TrainOptions};

pub(crate) fn command(command: Command, ranks: Option<&Ranks>) -> Result<()> {
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
        Command::Device(a) => device_cmd(a),
        Command::Import(a) => {
            let summary = attnres::import::import(
                &a.from,
                &a.out,
                a.force,
                matches!(a.dtype, ImportDtype::Keep),
            )?;
            log(&summary.line(&a.out));
            Ok(())
        }
        Command::Convert(a) => {
            let done = attnres::import::convert::convert(&a.model, &a.sets, &a.out, a.force)?;
            log(&done.line(&a.model, &a.out));
            Ok(())
        }
        Command::Quantize(a) => {
            let done = attnres::import::quantize::quantize(&a.model, a.to, &a.out, a.force)?;
            log(&done.line(&a.model, &a.out));
            Ok(())
        }
        Command::Export(a) => {
            let ExportFormat::Gguf = a.to;
            let done = attnres::export::export(&a.model, a.ty.0, &a.out, a.force)?;
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
                prefix_cache_bytes: a.prefix_cache.saturating_mul(1 << 20),
                context: a.context,
            },
            name: a.name,
            net: attnres::infer::serve::NetLimits {
                max_connections: a.max_connections,
                header_timeout: std::time::Duration::from_secs(a.header_timeout),
                body_timeout: std::time::Duration::from_secs(a.body_timeout),
                request_timeout: std::time::Duration::from_secs(a.request_timeout),
                write_timeout: std::time::Duration::from_secs(a.write_timeout),
                body_bytes: a.max_body_total.saturating_mul(1 << 20),
                client: attnres::infer::serve::ClientLimits {
                    connections: Some(a.max_client_connections),
                    requests: a.max_client_requests,
                    tokens: a.max_client_tokens,
                },
            },
            api_key: api_key(a.api_key)?,
        }),
    }
}

fn compare_cmd(a: CompareArgs) -> Result<()> {
    if let Some(data) = &a.data {
        // The report directory is the comparison's own: its runs and pages are rewritten.
        attnres::base::fs::refuse_output_over_input(&a.out, data, "--data")?;
    }
    let base = suite::base(a.quick)?.with_overrides(&a.sets)?;
    let name = a.suite.name();
    let variants = suite::suite(&name, &base)?;
    let plan = suite::Plan { suite: name, base, variants, seeds: a.seeds, data: a.data };
    let opts =
        compare::CompareOptions { out: a.out, progress: !a.no_progress, device: a.hardware.get() };
    compare::run(&plan, &opts)
}

fn device_cmd(a: DeviceArgs) -> Result<()> {
    use attnres::gpu;
    let mut lines =
        vec![format!("threads: {} (--threads sets them)", rayon::current_num_threads())];
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let sets = [
            ("AVX2", has!("avx2")),
            ("FMA", has!("fma")),
            ("F16C", has!("f16c")),
            ("AVX-512F", has!("avx512f")),
            ("AVX-512 VNNI", has!("avx512vnni")),
        ];
        let found: Vec<&str> = sets.iter().filter(|s| s.1).map(|s| s.0).collect();
        let found =
            if found.is_empty() { "none beyond SSE2".to_string() } else { found.join(", ") };
        lines.push(format!("vector instructions: {found}"));
    }
    match gpu::gpus() {
        Ok(gpus) => lines.extend(gpus.iter().map(|g| {
            let gib = g.memory_bytes as f64 / (1u64 << 30) as f64;
            format!("GPU {}: {}, {gib:.1} GiB, {}", g.ordinal, g.name, g.arch())
        })),
        Err(why) => lines.push(format!("GPUs: none ({why})")),
    }
    let nvrtc = if gpu::nvrtc_present() { "found" } else { "not found (libnvrtc.so.13)" };
    lines.push(format!("NVRTC: {nvrtc}"));
    write_stdout((lines.join("\n") + "\n").as_bytes())?;
    if let Some(arch) = a.compile_for {
        if let Some(dir) = &a.save {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        for k in gpu::compile_all(&arch)? {
            if let Some(dir) = &a.save {
                let stem = k.file.trim_end_matches(".cu");
                write_atomic(&dir.join(format!("{stem}.ptx")), k.ptx.as_bytes())?;
                write_atomic(&dir.join(format!("{stem}.cubin")), &k.cubin)?;
            }
            let kb = k.ptx.len() as f64 / 1024.0;
            let line = format!(
                "compiled {} for {arch}: {kb:.0} KiB of PTX in {:.2} s\n",
                k.file, k.seconds
            );
            write_stdout(line.as_bytes())?;
            for r in &k.resources {
                let local = if r.in_registers() {
                    String::new()
                } else {
                    format!(", LOCAL MEMORY {} B stack, {} B spilled", r.stack_bytes, r.spill_bytes)
                };
                let line = format!(
                    "  {}: {} registers, {} B shared{local}\n",
                    r.kernel, r.registers, r.shared_bytes
                );
                write_stdout(line.as_bytes())?;
            }
        }
    }
    Ok(())
}

fn plan_cmd(a: PlanArgs) -> Result<()> {
    use attnres::train::parallel::plan::{Depth, PlanText, Shape};
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
        cache: a.pp_cache.get(),
        hidden_size: a.hidden.unwrap_or(run.model.hidden_size),
        tokens: run.train.micro_batch * run.train.seq_len,
        tied_head: run.model.tie_word_embeddings,
        show_schedule: a.schedule,
    };
    output(&text.render()?)
}

fn train_cmd(a: TrainArgs, ranks: Option<&Ranks>) -> Result<()> {
    // The run writes its own files into --out: refused when one of them is the model it starts
    // from or the tokenizer it is given, and when --out holds the corpus (a run's directory is
    // its own, which --overwrite clears of runs' files).
    let refuse = attnres::base::fs::refuse_output_over_input;
    if let Some(data) = &a.data {
        refuse(&a.out, data, "--data")?;
    }
    if let Some(init) = &a.init {
        for name in [checkpoint::CONFIG_FILE, checkpoint::WEIGHTS_FILE] {
            refuse(&a.out.join(name), &init.join(name), "--init's")?;
        }
    }
    if let Some(tokenizer) = &a.tokenizer {
        refuse(&a.out.join("tokenizer.json"), tokenizer, "--tokenizer")?;
    }
    let run = run::setup::settings(&Settings {
        config: a.config.as_deref(),
        preset: a.preset.as_deref(),
        sets: &a.sets,
        init: a.init.as_deref(),
        resume: a.resume,
    })?;
    let opts = TrainOptions {
        out: a.out,
        data: a.data,
        tokenizer: a.tokenizer,
        init: a.init,
        resume: a.resume,
        overwrite: a.overwrite,
        progress: !a.no_progress,
        shared_bar: None,
        device: a.hardware.get(),
    };
    let reduce = a.reduce.get();
    let layout = Layout {
        stages: a.pp,
        virtual_stages: a.vpp,
        cache: a.pp_cache.get(),
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
        Err(_) => return Err(attnres::train::parallel::Reported.into()),
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
            vec![generate::chat_prompt(&a.model, a.system.as_deref(), message)?]
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
        sample_below: Some(bpe.vocab_size()),
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
            write_stdout(text.as_bytes())?;
        }
        Ok(())
    })?;
    if single {
        output(&format!("{}\n", stream.finish()?))?;
    } else {
        let mut lines = String::new();
        for ((t, g), p) in texts.iter().zip(&gens).zip(&prompts) {
            let completion = g.text(&bpe, p.last().copied())?;
            let line = serde_json::json!({"prompt": t, "completion": completion, "new_tokens": g.tokens.len(), "stop": g.stop});
            lines.push_str(&format!("{line}\n"));
        }
        output(&lines)?;
    }
    log(&timing.summary());
    Ok(())
}

/// `eval --device cuda`: the model's loss on `text`, its windows on the GPU with activations
/// of type `A`.
fn eval_on_gpu<A: Act>(
    dev: &Device,
    model: &Model,
    bpe: &attnres::text::tokenizer::Bpe,
    text: &str,
    origin: &str,
    seq: Option<usize>,
) -> Result<eval::Measurement> {
    let gpu = attnres::train::gpu::model::GpuModel::<A>::upload(dev, model)?;
    eval::measure_by(model, bpe, text, origin, seq, |x, y, rows, t| {
        gpu.window_loss(dev, x, y, rows, t)
    })
}

fn eval_cmd(a: EvalArgs) -> Result<()> {
    let (model, bpe) = load_with_tokenizer(&a.model)?;
    let text = attnres::base::fs::read_utf8(&a.text)?;
    let origin = a.text.display().to_string();
    let m = match a.hardware.get() {
        Hardware::Cpu => eval::measure(&model, &bpe, &text, &origin, a.seq)?,
        Hardware::Cuda(precision) => {
            let dev = attnres::gpu::device::Device::open(0)?;
            match precision {
                Precision::Bf16 => eval_on_gpu::<Bf16>(&dev, &model, &bpe, &text, &origin, a.seq)?,
                Precision::Fp32 => eval_on_gpu::<f32>(&dev, &model, &bpe, &text, &origin, a.seq)?,
            }
        }
    };
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
    let created = !a.out.exists();
    let saved = checkpoint::save(&model, &a.out);
    if saved.is_err() && created {
        // A failed write (a full disk) leaves no new directory; `remove_dir` takes only an
        // empty one, and the write removes its own temporary files.
        let _ = std::fs::remove_dir(&a.out);
    }
    saved?;
    log(&format!(
        "wrote {} ({} parameters, residual = {})",
        a.out.display(),
        model.params.len(),
        model.config.residual_label()
    ));
    Ok(())
}

fn forward_cmd(a: ForwardArgs) -> Result<()> {
    let refuse = attnres::base::fs::refuse_output_over_input;
    refuse(&a.out, &a.batch, "--batch")?;
    for name in [checkpoint::CONFIG_FILE, checkpoint::WEIGHTS_FILE] {
        refuse(&a.out, &a.model.join(name), "the model's")?;
    }
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
    let modes: Vec<_> = a.modes.iter().map(|m| m.get()).collect();
    let configs = bench::mode_configs(&base, &modes)?;
    attnres::base::profile::enable(a.profile);
    let on_gpu = matches!(a.hardware.device, DeviceArg::Cuda);
    if a.generate {
        ensure!(!on_gpu, "--generate runs on the CPU (not with --device cuda)");
        return bench_generate(&a, &configs);
    }
    ensure!(
        a.checkpoints.is_empty(),
        "--checkpoint goes with --generate (training steps run fresh models)"
    );
    if on_gpu {
        return bench_gpu(&a, &configs);
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

/// Training steps timed on the first GPU.
fn bench_gpu(a: &BenchArgs, configs: &[Config]) -> Result<()> {
    let dev = attnres::gpu::device::Device::open(0)?;
    let name = attnres::gpu::gpus()?.swap_remove(0).name;
    let base = &configs[0];
    log(&format!(
        "bench on {name}: {} layers, hidden {}, {} heads, batch {} x seq {}",
        base.num_hidden_layers, base.hidden_size, base.num_attention_heads, a.batch, a.seq
    ));
    let plan = bench::gpu::Plan {
        precision: a.hardware.precision.into(),
        batch: a.batch,
        seq: a.seq,
        warmup: a.warmup,
        steps: a.steps,
        peak_size: 4096,
        recompute: a.recompute,
        profile: a.profile,
    };
    let report = bench::gpu::run(&dev, &name, configs, plan, |line| log(&format!("  {line}")))?;
    if a.json {
        return output(&format!("{}\n", serde_json::to_string_pretty(&report)?));
    }
    output(&report.table())
}

fn bench_generate(a: &BenchArgs, configs: &[Config]) -> Result<()> {
    let named = if a.checkpoints.is_empty() {
        bench::generate::Named::modes(configs)?
    } else {
        a.checkpoints
            .iter()
            .map(|dir| {
                let model = checkpoint::load(dir)?;
                let name = format!("{} ({})", dir.display(), model.storage_label());
                Ok(bench::generate::Named { name, model })
            })
            .collect::<Result<Vec<_>>>()?
    };
    let base = &named[0].model.config;
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
    let report = bench::generate::run_generate(
        named,
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

/// `serve`'s key: `--api-key`, else the environment's ATTNRES_API_KEY; an empty key is refused
/// (it would open the server while looking closed).
fn api_key(given: Option<String>) -> Result<Option<String>> {
    let key = given.or_else(|| std::env::var("ATTNRES_API_KEY").ok());
    anyhow::ensure!(
        key.as_ref().is_none_or(|k| !k.trim().is_empty()),
        "--api-key (or ATTNRES_API_KEY) is empty"
    );
    Ok(key)
}
