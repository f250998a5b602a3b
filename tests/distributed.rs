//! Data- and pipeline-parallel training under `mpirun` against the same run in one process:
//! per-step metrics and final weights bit for bit (`--reduce exact`) for every residual mode,
//! 2 and 4 ranks, pipelines with and without virtual stages and blocks that do or do not line
//! up with the stages, and both together; the bytes a pipeline sends are the plan's and the
//! report's formulas; a rank that dies (or is killed mid-step) ends the job, which resumes in
//! one process or on another layout; bad requests are one error line. The tests that run
//! `mpirun` need a binary built with `--features mpi` and Open MPI's `mpirun`
//! (docs/distributed.md): without the feature they are ignored, with the reason; with it and no
//! `mpirun` they fail. Without the feature, the binary refuses to run as one of several ranks
//! (a test ignored in builds with the feature).

mod common;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_attnres");

/// The longest any command here may take; past it the test fails as a hang.
const LIMIT: Duration = Duration::from_secs(120);

/// Fails the test, saying why, unless Open MPI's `mpirun` runs here: a build with the `mpi`
/// feature is meant to run these tests, not to pass them without running.
fn require_mpirun() {
    let mut c = Command::new("mpirun");
    c.arg("--version").envs(MPIRUN_AS_ROOT);
    match c.output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => panic!(
            "`mpirun --version` failed ({}): {}; the tests of a build with --features mpi need \
             Open MPI's mpirun (docs/distributed.md)",
            o.status,
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => panic!(
            "cannot run mpirun ({e}): the tests of a build with --features mpi need Open MPI's \
             mpirun (apt-get install openmpi-bin; docs/distributed.md), or build without the \
             feature to leave them out"
        ),
    }
}

/// What mpirun needs in a container, as root (docs/distributed.md).
const MPIRUN_AS_ROOT: [(&str, &str); 3] = [
    ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
    ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
    ("OMPI_MCA_btl_vader_single_copy_mechanism", "none"),
];

/// The settings of the short runs over the `tiny` preset: 4 micro-batches of 2 sequences per
/// step (so 1, 2 and 4 ranks share a step evenly), 8 steps, checkpoints every 3.
const SETS: [&str; 9] = [
    "vocab_size=400",
    "seq_len=32",
    "micro_batch=2",
    "batch_tokens=256",
    "max_tokens=2048",
    "eval_every=4",
    "eval_tokens=256",
    "checkpoint_every=3",
    "warmup_steps=2",
];

struct Env {
    tmp: tempfile::TempDir,
}

impl Env {
    /// A directory for a test that runs `mpirun`, which it checks first ([`require_mpirun`]).
    fn for_mpirun() -> Env {
        require_mpirun();
        Env::new()
    }

    fn new() -> Env {
        let tmp = tempfile::tempdir().unwrap();
        common::write_small_corpus(&tmp.path().join("corpus.txt"), 12_000);
        Env { tmp }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    /// `attnres ARGS --threads 1` alone (`ranks` = 0) or under `mpirun -np RANKS`.
    fn cmd(&self, ranks: usize, args: &[String]) -> Command {
        let mut c = if ranks == 0 {
            Command::new(BIN)
        } else {
            let mut c = Command::new("mpirun");
            c.args(["-np", &ranks.to_string(), "--oversubscribe", "--bind-to", "none", BIN]);
            c
        };
        c.args(args).args(["--threads", "1"]).env("ATTNRES_CACHE", self.path("cache"));
        c.envs(MPIRUN_AS_ROOT);
        c.stdin(Stdio::null());
        c
    }

    /// Training arguments of a short run into `out` with `residual`, and `extra`.
    fn train_args(&self, out: &str, residual: &str, extra: &[&str]) -> Vec<String> {
        let residual = format!("residual={residual}");
        let sets: Vec<&str> = SETS.iter().copied().chain([residual.as_str()]).collect();
        let head = ["train", "--preset", "tiny", "--no-progress"];
        let mut v = common::run_args(&head, &self.path(out), &self.path("corpus.txt"), &sets);
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    }

    fn resume_args(&self, out: &str) -> Vec<String> {
        let out = self.path(out).to_string_lossy().into_owned();
        ["train", "--resume", "--no-progress", "--out", &out].map(String::from).to_vec()
    }

    fn run(&self, ranks: usize, args: &[String]) -> Output {
        bounded(
            self.cmd(ranks, args).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap(),
        )
    }

    fn train(&self, ranks: usize, args: &[String]) {
        ok(&self.run(ranks, args));
    }
}

/// Waits for `child` at most [`LIMIT`], collecting its output; a child still running then is
/// killed and the test fails.
fn bounded(mut child: Child) -> Output {
    let mut pipes = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let out = std::thread::spawn(move || {
        let (mut o, mut e) = (Vec::new(), Vec::new());
        pipes.0.read_to_end(&mut o).unwrap();
        pipes.1.read_to_end(&mut e).unwrap();
        (o, e)
    });
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > LIMIT {
            child.kill().unwrap();
            panic!("the command hung: still running after {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (stdout, stderr) = out.join().unwrap();
    Output { status, stdout, stderr }
}

fn ok(o: &Output) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "command failed: {err}");
}

/// A failed command whose stderr holds exactly one error line, naming `needle`.
fn fails_with_one_error(o: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "expected a failure: {err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "expected one error line: {err}");
    assert!(errors[0].contains(needle), "expected {needle:?} in {err}");
}

/// The metrics of a run without the wall-clock fields, one JSON value per step.
fn metrics(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            let m = v.as_object_mut().unwrap();
            m.remove("tokens_per_second");
            m.remove("elapsed_seconds");
            // Pipeline traffic: checked on its own (one process sends nothing).
            m.remove("pp_bytes_sent");
            m.remove("pp_bytes_per_token");
            v
        })
        .collect()
}

fn weights(run: &Path) -> Vec<u8> {
    std::fs::read(run.join("model.safetensors")).unwrap()
}

/// Asserts that the run `got` trained exactly what `want` did: every step's loss, learning
/// rate and gradient norms, validation, and the final weights, bit for bit.
fn same_run(env: &Env, want: &str, got: &str) {
    let (w, g) = (env.path(want), env.path(got));
    let (mw, mg) = (metrics(&w), metrics(&g));
    assert_eq!(mw.len(), 8, "{want}: 8 steps");
    for (a, b) in mw.iter().zip(&mg) {
        assert_eq!(a, b, "{got} differs from {want} at step {}", a["step"]);
    }
    assert_eq!(mw.len(), mg.len(), "{got} has other steps than {want}");
    assert!(weights(&w) == weights(&g), "{got}'s final weights differ from {want}'s");
}

fn file_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn summary(run: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(run.join("summary.json")).unwrap()).unwrap()
}

#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a build with --features mpi and Open MPI's mpirun (docs/distributed.md)"
)]
#[test]
fn ranks_train_bit_for_bit_what_one_process_trains() {
    let env = Env::for_mpirun();
    for residual in ["standard", "block", "full"] {
        let alone = format!("{residual}-1");
        env.train(0, &env.train_args(&alone, residual, &[]));
        let first = metrics(&env.path(&alone));
        let last = first.last().unwrap()["train_loss"].as_f64().unwrap();
        assert!(last < first[0]["train_loss"].as_f64().unwrap() - 0.3, "training lowers the loss");
        for ranks in [2, 4] {
            let run = format!("{residual}-{ranks}");
            env.train(ranks, &env.train_args(&run, residual, &[]));
            same_run(&env, &alone, &run);
            // Rank 0 alone wrote the run directory: the same files as training alone.
            assert_eq!(file_names(&env.path(&run)), file_names(&env.path(&alone)));
            let s = summary(&env.path(&run));
            assert_eq!(
                (s["ranks"].as_u64(), s["reduce"].as_str()),
                (Some(ranks as u64), Some("exact"))
            );
        }
    }
    // MPI's all-reduce adds the ranks' sums in its own order: the first step's losses are the
    // same (the same weights, the losses gathered in order), later steps agree closely.
    env.train(2, &env.train_args("block-mpi", "block", &["--reduce", "mpi"]));
    let (want, got) = (metrics(&env.path("block-1")), metrics(&env.path("block-mpi")));
    assert_eq!(want[0]["train_loss"], got[0]["train_loss"]);
    let (a, b) = (want[7]["val_loss"].as_f64().unwrap(), got[7]["val_loss"].as_f64().unwrap());
    assert!((a - b).abs() < 1e-3, "validation loss {b} with --reduce mpi, {a} alone");
    assert_eq!(summary(&env.path("block-mpi"))["reduce"], "mpi");
}

/// Bytes of pipeline transfers every step of a run sent (all ranks together).
fn pipeline_bytes(run: &Path) -> Vec<u64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["pp_bytes_sent"].as_u64().unwrap()
        })
        .collect()
}

/// What the plan says a step of the short runs sends: 256 tokens of hidden size 64 through
/// pipelines of `p` stages and `v` virtual stages over the `tiny` preset's 8 sublayers, and the
/// embedding output's gradient from the first stage to the last (the head is tied).
/// `once`: each source's gradient goes back once (`--reduce mpi`).
fn planned_bytes(
    block: Option<usize>,
    p: usize,
    v: usize,
    replicas: usize,
    cache: &str,
    once: bool,
) -> u64 {
    use attnres::train::parallel::plan::{bytes_per_token, transfers, Cache, Depth, Grads, Shape};
    let depth = Depth { sublayers: 8, block };
    let shape = Shape { stages: p, virtual_stages: v, micro_batches: 4 / replicas };
    let ts = transfers(&depth, &shape, Cache::parse(cache).unwrap());
    let grads = if once { Grads::Once } else { Grads::InOrder };
    let (f, b) = bytes_per_token(&ts, 64, grads);
    ((f + b + 4 * 64) * 256) as u64
}

#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a build with --features mpi and Open MPI's mpirun (docs/distributed.md)"
)]
#[test]
fn pipelines_train_bit_for_bit_what_one_process_trains() {
    let env = Env::for_mpirun();
    // (residual, num_blocks, ranks, P, V, cache). The tiny preset has 8 sublayers: with
    // num_blocks 4 a block is 2 sublayers, with 2 it is 4, with 1 it is all 8.
    let cases = [
        ("standard", 4, 2, 2, 1, "on"),
        ("full", 4, 2, 2, 2, "on"),
        ("full", 4, 4, 4, 1, "off"),
        // Blocks of 2, chunks of 4 or 2: block and stage boundaries line up.
        ("block", 4, 2, 2, 1, "on"),
        ("block", 4, 2, 2, 2, "on"),
        ("block", 4, 2, 2, 2, "off"),
        // Blocks of 8 over chunks of 4, blocks of 4 over chunks of 2: a block's partial sum
        // crosses the stages.
        ("block", 1, 2, 2, 1, "on"),
        ("block", 2, 2, 2, 2, "on"),
        // Two replicas of a pipeline of two stages.
        ("block", 2, 4, 2, 2, "on"),
        ("standard", 4, 4, 2, 1, "off"),
    ];
    for (residual, blocks, ranks, p, v, cache) in cases {
        let sets = ["--set".to_string(), format!("num_blocks={blocks}")];
        let alone = format!("{residual}-{blocks}");
        if !env.path(&alone).exists() {
            let args: Vec<&str> = sets.iter().map(String::as_str).collect();
            env.train(0, &env.train_args(&alone, residual, &args));
        }
        let run = format!("{alone}-np{ranks}-pp{p}-vpp{v}-{cache}");
        let (ps, vs) = (p.to_string(), v.to_string());
        let mut extra: Vec<&str> = sets.iter().map(String::as_str).collect();
        extra.extend(["--pp", &ps, "--vpp", &vs, "--pp-cache", cache]);
        env.train(ranks, &env.train_args(&run, residual, &extra));
        same_run(&env, &alone, &run);
        assert_eq!(file_names(&env.path(&run)), file_names(&env.path(&alone)));
        let s = summary(&env.path(&run));
        assert_eq!((s["pp"].as_u64(), s["vpp"].as_u64()), (Some(p as u64), Some(v as u64)));
        let block = match residual {
            "standard" => None,
            "full" => Some(1),
            _ => Some(8 / blocks),
        };
        let want = planned_bytes(block, p, v, ranks / p, cache, false);
        assert_eq!(pipeline_bytes(&env.path(&run)), vec![want; 8], "{run}: bytes per step");
        each_rank_holds_its_stages_share(&env.path(&run), p, v);
    }
}

/// The parameter and optimiser values every rank of a pipeline run reported holding
/// (`summary.json`) against its stage's share, worked out here from the tensors' names and
/// shapes in the run's `model.safetensors`: the tensors of the sublayers of the stage's chunks
/// (chunk `c` on stage `c mod P`), the embedding on the first stage, the final norm, output
/// aggregation and LM head on the last; a tied embedding is the last stage's (as the LM head),
/// with a copy on the first. Three optimiser values (AdamW's two moments, Muon's momentum) per
/// parameter a stage updates.
fn each_rank_holds_its_stages_share(run: &Path, p: usize, v: usize) {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(run.join("config.json")).unwrap()).unwrap();
    let tied = config["tie_word_embeddings"].as_bool().unwrap();
    let sublayers = 2 * config["num_hidden_layers"].as_u64().unwrap() as usize;
    let bytes = weights(run);
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let chunks = attnres::train::parallel::plan::chunk_bounds(sublayers, p * v);
    let (mut updated, mut embedding, mut total) = (vec![0u64; p], 0, 0);
    for (name, t) in tensors.tensors() {
        let size = t.shape().iter().product::<usize>() as u64;
        total += size;
        let stage = if let Some(rest) = name.strip_prefix("model.layers.") {
            let layer: usize = rest.split('.').next().unwrap().parse().unwrap();
            let mlp = rest.contains(".mlp") || rest.contains("post_attention_layernorm");
            let l = 2 * layer + mlp as usize;
            chunks.iter().position(|c| c.contains(&l)).unwrap() % p
        } else if name == "model.embed_tokens.weight" {
            embedding = size;
            if tied {
                p - 1
            } else {
                0
            }
        } else {
            p - 1
        };
        updated[stage] += size;
    }
    assert_eq!(updated.iter().sum::<u64>(), total);
    let ranks = summary(run)["rank_seconds"].as_array().unwrap().clone();
    for r in &ranks {
        let stage = r["rank"].as_u64().unwrap() as usize % p;
        let copy = if tied && stage == 0 { embedding } else { 0 };
        let got = [&r["updated_values"], &r["parameter_values"], &r["optimizer_values"]]
            .map(|x| x.as_u64().unwrap());
        let want = [updated[stage], updated[stage] + copy, 3 * updated[stage]];
        assert_eq!(
            got,
            want,
            "{}: rank {} (updated, held, optimiser values)",
            run.display(),
            r["rank"]
        );
        assert!(got[2] < 3 * total, "a stage holds less optimiser state than one process");
    }
}

/// The bytes a pipeline measures against the report's formulas: blocks aligned with chunks
/// (one block of 2 sublayers per chunk of 2, P = 2, V = 2, so C = 4 and N_p = 1), the forward
/// transfers of completed blocks are Eq. 7 without a cache, C(C-1)/2 = 6, and Eq. 8 with the
/// cache of received blocks, P(P-1)/2 + (V-1)P^2 = 5; keeping one's own blocks saves (V-1)P = 2
/// more. The formulas leave out the embedding (source 0), which goes into every chunk without
/// a cache (3 times), to every rank that did not receive it before with the cache of received
/// blocks (ranks 1 and 0: 2 times) and to every rank but its maker's with ours (once).
/// Everything else sent (backward) is the same under every cache, so the measured differences
/// are these differences, 256 tokens of 64 values of 4 bytes per vector.
#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a build with --features mpi and Open MPI's mpirun (docs/distributed.md)"
)]
#[test]
fn pipeline_bytes_follow_the_reports_formulas() {
    let env = Env::for_mpirun();
    let mut per_step = Vec::new();
    for cache in ["off", "received", "on"] {
        let run = format!("block-{cache}");
        let extra = ["--pp", "2", "--vpp", "2", "--pp-cache", cache];
        env.train(2, &env.train_args(&run, "block", &extra));
        per_step.push(pipeline_bytes(&env.path(&run))[0]);
    }
    let vector = 256 * 64 * 4;
    let (eq7, eq8, kept) = (6, 5, 3);
    let (e_off, e_received, e_kept) = (3, 2, 1);
    assert_eq!(
        per_step[0] - per_step[1],
        (eq7 - eq8 + e_off - e_received) * vector,
        "Eq. 7 - Eq. 8"
    );
    assert_eq!(
        per_step[1] - per_step[2],
        (eq8 - kept + e_received - e_kept) * vector,
        "own blocks"
    );

    // With --reduce mpi each cached source's gradient goes back once: fewer bytes, as planned,
    // and a run that agrees closely (the same first loss; sums in another order after).
    let extra = ["--pp", "2", "--vpp", "2", "--reduce", "mpi"];
    env.train(2, &env.train_args("block-once", "block", &extra));
    let once = pipeline_bytes(&env.path("block-once"));
    assert_eq!(once[0], planned_bytes(Some(2), 2, 2, 1, "on", true));
    assert!(
        once[0] < per_step[2],
        "{} bytes returning gradients once, {} in order",
        once[0],
        per_step[2]
    );
    let (want, got) = (metrics(&env.path("block-on")), metrics(&env.path("block-once")));
    assert_eq!(want[0]["train_loss"], got[0]["train_loss"]);
    let (a, b) = (want[7]["val_loss"].as_f64().unwrap(), got[7]["val_loss"].as_f64().unwrap());
    assert!((a - b).abs() < 1e-3, "validation loss {b} returning gradients once, {a} in order");
}

#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a build with --features mpi and Open MPI's mpirun (docs/distributed.md)"
)]
#[test]
fn a_pipeline_rank_killed_mid_step_ends_the_job_and_the_run_resumes() {
    let env = Env::for_mpirun();
    env.train(0, &env.train_args("alone", "block", &[]));

    // Rank 1 of a pipeline of 2 stages kills itself (SIGKILL) in step 6, while rank 0 waits
    // for its messages: the job ends, promptly and with a failure that names the signal, after
    // the checkpoint of step 3 and the metrics of step 5.
    let args_of = |env: &Env, out: &str| env.train_args(out, "block", &["--pp", "2", "--vpp", "2"]);
    let args = args_of(&env, "pp");
    let died = dies(&env, 2, &args, "ATTNRES_TEST_KILL_AT", "1:6");
    let err = String::from_utf8_lossy(&died.stderr);
    assert!(err.contains("signal 9"), "{err}");
    assert_eq!(metrics(&env.path("pp")).len(), 5);
    // One process continues it from step 3 exactly.
    env.train(0, &env.resume_args("pp"));
    same_run(&env, "alone", "pp");

    // Killed again, it continues as a pipeline of another shape: each stage takes its part of
    // the checkpoint the stages of the other shape put together.
    dies(&env, 2, &args_of(&env, "pp-again"), "ATTNRES_TEST_KILL_AT", "1:6");
    let mut resume = env.resume_args("pp-again");
    resume.extend(["--pp", "4"].map(String::from));
    env.train(4, &resume);
    same_run(&env, "alone", "pp-again");
    // Its optimiser state, read tensor by tensor on rank 0 of a pipeline, is checked as one
    // process checks it: a damaged file is one error line.
    let state = env.path("pp-again/ckpt/optimizer.safetensors");
    let bytes = std::fs::read(&state).unwrap();
    std::fs::write(&state, &bytes[..bytes.len() / 2]).unwrap();
    let mut resume = env.resume_args("pp-again");
    resume.extend(["--pp", "2"].map(String::from));
    fails_with_one_error(&env.run(2, &resume), "optimizer.safetensors is corrupt");

    // A run in one process dies; two pipelines of two stages continue it.
    one_process_dies_and_ranks_resume(&env, 4, &["--pp", "2"]);
}

#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a build with --features mpi and Open MPI's mpirun (docs/distributed.md)"
)]
#[test]
fn a_stalled_or_killed_rank_ends_the_job_and_the_run_resumes() {
    let env = Env::for_mpirun();
    env.train(0, &env.train_args("alone", "block", &[]));

    // Rank 1 stops itself (SIGSTOP) in step 6, mid-step, as a hung or swapped-out process
    // would: the ranks waiting for it end the job after --comm-timeout, naming it; the same
    // command with --resume finishes the run as if nothing had happened.
    for (ranks, shape, out) in
        [(2, &["--pp", "2"][..], "stop2"), (4, &["--pp", "2", "--vpp", "2"][..], "stop4")]
    {
        let mut args = env.train_args(out, "block", shape);
        args.extend(["--comm-timeout", "3"].map(String::from));
        let died = dies(&env, ranks, &args, "ATTNRES_TEST_STOP_AT", "1:6");
        let err = String::from_utf8_lossy(&died.stderr);
        // The first rank whose wait passes the timeout ends the job. One waiting on rank 1's
        // messages names it; with 4 ranks, one of the other replica may first have waited as
        // long in a collective operation, where no single rank can be named.
        let named = err.contains("waited more than 3 s for rank 1 (");
        let collective = ranks > 2
            && err.contains(&format!("waited more than 3 s for the other ranks ({ranks} in all)"));
        assert!(named || collective, "{err}");
        assert_eq!(metrics(&env.path(out)).len(), 5, "{out}");
        let mut resume = env.resume_args(out);
        resume.extend(shape.iter().map(|s| s.to_string()));
        env.train(ranks, &resume);
        same_run(&env, "alone", out);
    }

    // A rank killed from outside (SIGKILL, not a hook of ours) at moments of the test's
    // choosing (once the run has logged 2, 4 and 6 steps; the one killed alternates), each time
    // continued by the same command with --resume: the run ends as an undisturbed one.
    let args = env.train_args("killed", "block", &["--pp", "2"]);
    let mut resume = env.resume_args("killed");
    resume.extend(["--pp", "2"].map(String::from));
    let mut killed = 0;
    for (i, steps) in [2usize, 4, 6].into_iter().enumerate() {
        let mut c = env.cmd(2, if i == 0 { &args } else { &resume });
        let mut child = c.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
        let logged = || {
            std::fs::read_to_string(env.path("killed/metrics.jsonl"))
                .map_or(0, |m| m.lines().count())
        };
        let t = Instant::now();
        while logged() < steps && child.try_wait().unwrap().is_none() && t.elapsed() < LIMIT {
            std::thread::sleep(Duration::from_millis(1));
        }
        let ranks = Command::new("pgrep").args(["-P", &child.id().to_string()]).output().unwrap();
        let pids: Vec<String> =
            String::from_utf8_lossy(&ranks.stdout).split_whitespace().map(String::from).collect();
        if let Some(pid) = pids.get(i % 2) {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
        // Ended by the kill, or finished just before it: either way it ends.
        let status = child.wait().unwrap();
        if !status.success() {
            killed += 1;
        }
    }
    assert_eq!(killed, 3, "a kill did not land while the job ran");
    env.train(2, &resume);
    same_run(&env, "alone", "killed");
}

/// Runs `args` on `ranks` ranks with the test hook `var=value`, which ends the job: asserts
/// that the job fails within a minute, and returns its output.
fn dies(env: &Env, ranks: usize, args: &[String], var: &str, value: &str) -> Output {
    let mut c = env.cmd(ranks, args);
    c.env(var, value).stdout(Stdio::piped()).stderr(Stdio::piped());
    let t = Instant::now();
    let died = bounded(c.spawn().unwrap());
    assert!(!died.status.success(), "the job went on without the dead rank");
    assert!(t.elapsed() < Duration::from_secs(60), "the job took {:?} to end", t.elapsed());
    died
}

/// A run in one process dies at step 5, after the checkpoint of step 3; `ranks` ranks with
/// `extra` options continue it exactly to the result of the run "alone".
fn one_process_dies_and_ranks_resume(env: &Env, ranks: usize, extra: &[&str]) {
    dies(env, 0, &env.train_args("one", "block", &[]), "ATTNRES_TEST_ABORT_AT", "0:5");
    assert_eq!(metrics(&env.path("one")).len(), 4);
    let mut resume = env.resume_args("one");
    resume.extend(extra.iter().map(|s| s.to_string()));
    env.train(ranks, &resume);
    same_run(env, "alone", "one");
}

#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a build with --features mpi and Open MPI's mpirun (docs/distributed.md)"
)]
#[test]
fn a_rank_that_dies_ends_the_job_and_the_run_resumes_on_any_number_of_ranks() {
    let env = Env::for_mpirun();
    env.train(0, &env.train_args("alone", "block", &[]));

    // Rank 1 of 2 dies as it starts step 6: the whole job ends, promptly and with a failure,
    // after the checkpoint of step 3 and the metrics of step 5.
    dies(&env, 2, &env.train_args("two", "block", &[]), "ATTNRES_TEST_ABORT_AT", "1:6");
    assert_eq!(metrics(&env.path("two")).len(), 5);
    // One process continues it from step 3 exactly.
    env.train(0, &env.resume_args("two"));
    same_run(&env, "alone", "two");

    // The other way round: a run in one process dies and 4 ranks continue it.
    one_process_dies_and_ranks_resume(&env, 4, &[]);
}

#[cfg_attr(
    not(feature = "mpi"),
    ignore = "needs a build with --features mpi and Open MPI's mpirun (docs/distributed.md)"
)]
#[test]
fn bad_requests_under_mpirun_get_one_error_line() {
    let env = Env::for_mpirun();
    // 4 micro-batches per step cannot be shared by 3 ranks.
    let o = env.run(3, &env.train_args("r", "block", &[]));
    fails_with_one_error(&o, "which 3 ranks cannot share evenly");
    // A failure every rank meets at once (here the loss) is printed once, by rank 0.
    let o =
        env.run(2, &env.train_args("nan", "block", &["--set", "lr=1e30", "--set", "grad_clip=0"]));
    fails_with_one_error(&o, "the training loss became NaN at step 2");
    // Only train runs on several ranks.
    let text = env.path("corpus.txt").to_string_lossy().into_owned();
    let o = env.run(2, &["eval", "--model", "x", "--text", &text].map(String::from));
    fails_with_one_error(&o, "only train runs on several ranks");
    // Every rank has the same bad argument; rank 0 alone names it.
    let o = env.run(2, &env.train_args("r", "block", &["--reduce", "fast"]));
    fails_with_one_error(&o, "invalid value 'fast' for '--reduce");
    // Pipelines that the ranks or the model cannot hold.
    let o = env.run(2, &env.train_args("r", "block", &["--pp", "3"]));
    fails_with_one_error(&o, "--pp 3 must divide the number of ranks (2)");
    let o = env.run(2, &env.train_args("r", "block", &["--pp", "2", "--vpp", "8"]));
    fails_with_one_error(&o, "16 chunks, but the model has only 8 sublayers");
    let o = env.run(2, &env.train_args("r", "block", &["--vpp", "2"]));
    fails_with_one_error(&o, "--vpp 2 needs --pp of at least 2");
    let o = env.run(2, &env.train_args("r", "block", &["--pp", "2", "--set", "attn_res_heads=2"]));
    fails_with_one_error(&o, "without the ablation options");
}

#[test]
fn a_pipeline_needs_ranks() {
    // In one process (any build): one error line, nothing written.
    let env = Env::new();
    let o = env.run(0, &env.train_args("r", "block", &["--pp", "2"]));
    fails_with_one_error(&o, "--pp 2 must divide the number of ranks (1)");
    assert!(!env.path("r").exists(), "nothing is written");
}

#[cfg_attr(
    feature = "mpi",
    ignore = "checks a build without the mpi feature: run cargo test without --features mpi"
)]
#[test]
fn a_build_without_mpi_refuses_to_run_as_one_of_several_ranks() {
    let env = Env::new();
    let run = |rank: &str| {
        let mut c = env.cmd(0, &env.train_args("r", "block", &[]));
        c.env("OMPI_COMM_WORLD_SIZE", "2").env("OMPI_COMM_WORLD_RANK", rank);
        c.output().unwrap()
    };
    // Rank 0 says why and fails; the other ranks stop without repeating it, with status 0 so
    // that mpirun does not end the job before rank 0 has said it.
    fails_with_one_error(&run("0"), "built without MPI");
    let o = run("1");
    assert_eq!(o.status.code(), Some(0));
    assert!(o.stderr.is_empty(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!env.path("r").exists(), "nothing is written");
}
