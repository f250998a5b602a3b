//! Training end to end through the binary: a run killed at an arbitrary moment and resumed
//! gives the same per-step losses as an uninterrupted one; evaluation; and clear errors on bad
//! input without damaging an existing run.

mod common;

use common::RunEnv;

use common::{losses, ok};
use std::path::Path;
use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

/// Arguments that resume the run in `out` (which remembers its own --data).
fn resume_args(env: &RunEnv, out: &str) -> Vec<String> {
    let o = env.path(out);
    ["train", "--resume", "--no-progress", "--out", o.to_str().unwrap()]
        .iter()
        .map(|s| s.to_string())
        .collect()
}

/// Training arguments for a short run into `out`.
fn train_args(env: &RunEnv, out: &str) -> Vec<String> {
    let head = ["train", "--preset", "tiny", "--no-progress"];
    common::run_args(&head, &env.path(out), &env.path("corpus.txt"), &SETS)
}

/// The settings of the short runs, laid over the `tiny` preset.
const SETS: [&str; 9] = [
    "vocab_size=400",
    "seq_len=64",
    "micro_batch=4",
    "batch_tokens=512",
    "max_tokens=30720",
    "eval_every=5",
    "eval_tokens=512",
    "checkpoint_every=3",
    "warmup_steps=3",
];

/// The `tiny` preset with [`SETS`] and then `sets` laid over it, for runs in this process.
fn in_process_config(sets: &[&str]) -> attnres::train::config::RunConfig {
    attnres::train::presets::run_config("tiny")
        .unwrap()
        .with_overrides(&SETS.map(String::from))
        .unwrap()
        .with_overrides(&sets.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .unwrap()
}

/// Options of a run in this process into `out` on the test corpus.
fn in_process_options(env: &RunEnv, out: &str, resume: bool) -> attnres::train::run::TrainOptions {
    attnres::train::run::TrainOptions {
        out: env.path(out),
        data: Some(env.path("corpus.txt")),
        tokenizer: None,
        init: None,
        resume,
        overwrite: false,
        progress: false,
        shared_bar: None,
        device: attnres::train::run::Hardware::Cpu,
    }
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(|s| s.as_str()).collect()
}

/// Waits until `run` has at least `n` metric lines (or two minutes have passed).
fn wait_for_steps(run: &Path, n: usize) {
    let t = Instant::now();
    while std::fs::read_to_string(run.join("metrics.jsonl")).map(|s| s.lines().count()).unwrap_or(0)
        < n
        && t.elapsed() < Duration::from_secs(120)
    {
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A failure after the run was announced: the last line of stderr is the error.
fn fails_in_training(o: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    let last = err.lines().last().unwrap_or("");
    assert_eq!(o.status.code(), Some(1), "expected a clean failure, got: {err}");
    assert!(last.starts_with("error: ") && last.contains(needle), "expected {needle:?} in {err:?}");
}

fn fails(o: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "expected a clean failure, got: {err}");
    assert!(err.starts_with("error: ") && err.contains(needle), "expected {needle:?} in {err:?}");
}

#[test]
fn killed_and_resumed_run_matches_an_uninterrupted_one() {
    let env = &RunEnv::new(12_000, 2);
    let args = train_args(env, "a");
    let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    ok(&env.run(&a));
    let want = losses(&env.path("a"));
    assert_eq!(want.len(), 60);
    assert!(want.last().unwrap().1 < want[0].1 - 0.5, "training lowers the loss: {want:?}");

    // Kill a second run at two different moments, resuming each time.
    let args = train_args(env, "b");
    let b: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let resume_args = resume_args(env, "b");
    let resume: Vec<&str> = resume_args.iter().map(|s| s.as_str()).collect();
    for min_lines in [4, 23] {
        let mut child = if min_lines == 4 { env.cmd(&b) } else { env.cmd(&resume) };
        let mut child = child.stderr(Stdio::null()).spawn().unwrap();
        let t = Instant::now();
        loop {
            let n = std::fs::read_to_string(env.path("b").join("metrics.jsonl"))
                .map(|s| s.lines().count())
                .unwrap_or(0);
            if n >= min_lines || t.elapsed() > Duration::from_secs(120) {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        let n = losses(&env.path("b")).len();
        assert!(
            n < 60,
            "the run finished before it could be killed ({n} steps); the test needs a longer run"
        );
    }
    let log = ok(&env.run(&resume));
    assert!(log.contains("resuming at step"), "{log}");
    assert_eq!(losses(&env.path("b")), want, "resumed losses differ from the uninterrupted run");
    assert_eq!(
        std::fs::read(env.path("a/model.safetensors")).unwrap(),
        std::fs::read(env.path("b/model.safetensors")).unwrap()
    );

    // Evaluation of the trained model on held-out text.
    let text = env.path("heldout.txt");
    std::fs::write(
        &text,
        attnres::train::data::Corpus::embedded().documents[20]
            .chars()
            .take(3000)
            .collect::<String>(),
    )
    .unwrap();
    let out = env.run(&[
        "eval",
        "--model",
        env.path("a").to_str().unwrap(),
        "--text",
        text.to_str().unwrap(),
        "--json",
    ]);
    ok(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let (loss, ppl, bpb) = (
        v["loss"].as_f64().unwrap(),
        v["perplexity"].as_f64().unwrap(),
        v["bits_per_byte"].as_f64().unwrap(),
    );
    assert!((ppl - loss.exp()).abs() < 1e-9 * ppl);
    let (tokens, bytes) = (v["tokens"].as_f64().unwrap(), v["bytes"].as_f64().unwrap());
    assert!((bpb - loss * tokens / bytes / std::f64::consts::LN_2).abs() < 1e-9);
    assert!(
        loss > 1.0 && loss < (400f64).ln(),
        "loss {loss} should beat a uniform guess over the vocabulary"
    );
}

#[test]
fn bad_input_gets_a_named_error_and_leaves_runs_intact() {
    let env = &RunEnv::new(12_000, 2);
    let args = train_args(env, "r");
    let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let with = |extra: &[&str]| -> Vec<String> {
        a.iter().map(|s| s.to_string()).chain(extra.iter().map(|s| s.to_string())).collect()
    };
    let run = |v: Vec<String>| env.run(&v.iter().map(|s| s.as_str()).collect::<Vec<_>>());

    fails(&run(with(&["--set", "lr=nan"])), "lr must be a number");
    fails(&run(with(&["--set", "lr=1e999"])), "lr must be a number");
    fails(&run(with(&["--set", "lr=-1"])), "lr must be a finite non-negative number");
    fails(&run(with(&["--set", "num_blocks=3"])), "num_blocks = 3");
    fails(&run(with(&["--set", "seq_len=0"])), "seq_len must be positive");
    fails(&run(with(&["--set", "hidden_size=0"])), "hidden_size must be positive");
    fails(&run(with(&["--set", "warmup=3"])), "--set warmup: unknown setting");
    fails(&run(with(&["--set", "micro_batch=two"])), "micro_batch must be a non-negative integer");
    fails(
        &run(with(&["--set", "batch_tokens=100"])),
        "must be a multiple of micro_batch x seq_len",
    );
    fails(
        &env.run(&["train", "--preset", "huge", "--out", env.path("x").to_str().unwrap()]),
        "invalid value 'huge' for '--preset",
    );
    fails(
        &env.run(&["train", "--resume", "--out", env.path("nothing").to_str().unwrap()]),
        "holds no checkpoint",
    );

    // Training on a corpus that cannot be used fails before anything is written.
    let train_on = |data: &Path| {
        let (out, data) = (env.path("x"), data.to_str().unwrap().to_string());
        env.run(&["train", "--preset", "tiny", "--out", out.to_str().unwrap(), "--data", &data])
    };
    let bad = env.path("bad.txt");
    std::fs::write(&bad, b"Shakespeare \xc3\x28 broken").unwrap();
    fails(&train_on(&bad), "not valid UTF-8");
    let empty = env.path("empty.txt");
    std::fs::write(&empty, "\n\n").unwrap();
    fails(&train_on(&empty), "empty");
    let tiny = env.path("tiny.txt");
    std::fs::write(&tiny, "To be, or not to be.\n\n\nThat is the question.").unwrap();
    fails(
        &env.run(&[
            "train",
            "--preset",
            "tiny",
            "--out",
            env.path("x").to_str().unwrap(),
            "--data",
            tiny.to_str().unwrap(),
            "--set",
            "vocab_size=300",
        ]),
        "too small",
    );

    // A finished run is neither overwritten nor resumed with other settings by accident.
    ok(&run(with(&[])));
    let before = std::fs::read(env.path("r/model.safetensors")).unwrap();
    fails(&run(with(&[])), "already holds a training run");
    fails(&run(with(&["--resume", "--set", "lr=1"])), "other settings (train.lr");
    // The command that started the run, plus --resume, continues it (here: nothing left to do).
    ok(&run(with(&["--resume"])));
    assert_eq!(std::fs::read(env.path("r/model.safetensors")).unwrap(), before);
    saved_state_is_checked_like_user_input(env, "r");
    // The token cache is found by content: another cache location holds the same data.
    let o =
        env.cmd(&strs(&resume_args(env, "r"))).env("ATTNRES_CACHE", env.path("cache2")).output();
    ok(&o.unwrap());
    assert!(env.path("cache2").read_dir().unwrap().count() > 0);
    // A corrupt checkpoint is reported, and nothing is changed.
    let opt = env.path("r/ckpt/optimizer.safetensors");
    let bytes = std::fs::read(&opt).unwrap();
    std::fs::write(&opt, &bytes[..bytes.len() / 3]).unwrap();
    fails(&run(resume_args(env, "r")), "optimizer.safetensors is corrupt");
    assert_eq!(std::fs::read(env.path("r/model.safetensors")).unwrap(), before);
    // Resuming on other data is refused.
    std::fs::write(&opt, &bytes).unwrap();
    let other: Vec<String> = [
        "train",
        "--resume",
        "--out",
        env.path("r").to_str().unwrap(),
        "--data",
        tiny.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    fails(&run(other), "differs from the run being resumed");
    fails(
        &env.run(&[
            "eval",
            "--model",
            env.path("r").to_str().unwrap(),
            "--text",
            bad.to_str().unwrap(),
        ]),
        "not valid UTF-8",
    );
    fails(
        &env.run(&[
            "eval",
            "--model",
            env.path("r").to_str().unwrap(),
            "--text",
            env.path("missing.txt").to_str().unwrap(),
        ]),
        "cannot read",
    );
    generation_from_a_trained_run(env, "r");
}

/// `attnres generate` on a trained run: streaming output equals the batch output, a seed fixes
/// sampled text, and bad requests get named errors.
fn generation_from_a_trained_run(env: &RunEnv, run: &str) {
    let model = env.path(run);
    let m = model.to_str().unwrap();
    let gen = |extra: &[&str]| {
        let mut a = vec!["generate", "--model", m];
        a.extend_from_slice(extra);
        env.run(&a)
    };
    let greedy = gen(&["--prompt", "ROMEO:", "--max-tokens", "24", "--temperature", "0"]);
    let log = ok(&greedy);
    assert!(log.contains("tokens/s"), "{log}");
    let text = String::from_utf8(greedy.stdout).unwrap();
    assert!(text.starts_with("ROMEO:") && text.len() > "ROMEO:".len() + 5, "{text:?}");

    // The same prompt inside a batch gives the same greedy continuation.
    let prompts = env.path("prompts.txt");
    std::fs::write(&prompts, "ROMEO:\nWhat light through yonder window\n").unwrap();
    let batch = gen(&[
        "--prompt-file",
        prompts.to_str().unwrap(),
        "--max-tokens",
        "24",
        "--temperature",
        "0",
    ]);
    ok(&batch);
    let lines: Vec<serde_json::Value> = String::from_utf8(batch.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[1]["prompt"], "What light through yonder window");
    assert_eq!(format!("ROMEO:{}\n", lines[0]["completion"].as_str().unwrap()), text);

    let sampled = |seed: &str| {
        let o = gen(&[
            "--prompt",
            "KING:",
            "--max-tokens",
            "30",
            "--temperature",
            "1.0",
            "--top-k",
            "50",
            "--top-p",
            "0.9",
            "--seed",
            seed,
        ]);
        ok(&o);
        o.stdout
    };
    assert_eq!(sampled("4"), sampled("4"));
    assert_ne!(sampled("4"), sampled("5"));

    fails(&gen(&["--prompt", "x", "--max-tokens", "0"]), "--max-tokens must be at least 1");
    fails(&gen(&["--prompt", "x", "--max-tokens", "-3"]), "--max-tokens must be at least 1");
    fails(&gen(&["--prompt", "x", "--temperature", "-1"]), "temperature must be");
    fails(&gen(&["--prompt", "x", "--top-k", "0"]), "--top-k must be at least 1");
    fails(&gen(&["--prompt", "x", "--top-p", "0"]), "top-p must lie in (0, 1]");
    fails(&gen(&["--prompt", "x", "--top-p", "1.5"]), "top-p must lie in (0, 1]");
    fails(&gen(&["--prompt", ""]), "--prompt is empty");
    std::fs::write(&prompts, "one\n\nthree\n").unwrap();
    fails(&gen(&["--prompt-file", prompts.to_str().unwrap()]), "line 2 is empty");
    // The tiny preset's context is 128 tokens.
    fails(&gen(&["--prompt", "x", "--max-tokens", "500"]), "beyond the model's context of 128");
    let slid = gen(&["--prompt", "x", "--max-tokens", "300", "--temperature", "0", "--slide"]);
    ok(&slid);
    assert!(String::from_utf8(slid.stdout).unwrap().len() > 300);
    fails(
        &env.run(&["generate", "--model", env.path("nothing").to_str().unwrap(), "--prompt", "x"]),
        "is not a directory",
    );
}

/// A checkpoint's `train_state.json` is read like user input: invalid, ill-typed and unknown
/// settings are errors naming the file and the key, and nothing is changed.
fn saved_state_is_checked_like_user_input(env: &RunEnv, run: &str) {
    let path = env.path(run).join("ckpt/train_state.json");
    let good = std::fs::read_to_string(&path).unwrap();
    let before = std::fs::read(env.path(run).join("model.safetensors")).unwrap();
    let cases: [(&str, serde_json::Value, &str); 8] = [
        ("/run/train/seq_len", 0.into(), "seq_len must be positive"),
        ("/run/train/micro_batch", 0.into(), "micro_batch must be positive"),
        ("/run/train/eval_every", 0.into(), "eval_every must be positive"),
        ("/run/train/lr", (-1.0).into(), "lr must be a finite non-negative number"),
        ("/run/train/warmup", 3.into(), "unknown training key \"warmup\""),
        ("/run/model/hidden_sise", 3.into(), "unknown config key \"hidden_sise\""),
        ("/run/model/num_blocks", 3.into(), "num_blocks = 3"),
        ("/stepp", 3.into(), "unknown field `stepp`"),
    ];
    for (pointer, value, needle) in cases {
        let mut v: serde_json::Value = serde_json::from_str(&good).unwrap();
        let (parent, key) = pointer.rsplit_once('/').unwrap();
        v.pointer_mut(if parent.is_empty() { "" } else { parent })
            .unwrap()
            .as_object_mut()
            .unwrap()
            .insert(key.to_string(), value);
        std::fs::write(&path, v.to_string()).unwrap();
        let o = env.run(&strs(&resume_args(env, run)));
        fails(&o, needle);
        fails(&o, "train_state.json");
    }
    std::fs::write(&path, good).unwrap();
    assert_eq!(std::fs::read(env.path(run).join("model.safetensors")).unwrap(), before);
}

/// A run killed before its first regular checkpoint (`checkpoint_every` beyond the run's
/// steps) resumes; a directory without any checkpoint can be started again with --overwrite;
/// and an --overwrite killed early never leaves the old model beside the new metrics.
#[test]
fn no_run_is_lost_before_its_first_checkpoint() {
    let env = &RunEnv::new(12_000, 2);
    let mut args = train_args(env, "k");
    args.extend(["--set".to_string(), "checkpoint_every=1000".to_string()]);
    let mut child = env.cmd(&strs(&args)).stderr(Stdio::null()).spawn().unwrap();
    wait_for_steps(&env.path("k"), 2);
    child.kill().unwrap();
    child.wait().unwrap();
    let n = losses(&env.path("k")).len();
    assert!((2..60).contains(&n), "killed after {n} steps");
    let log = ok(&env.run(&strs(&resume_args(env, "k"))));
    assert!(log.contains("resuming at step 0/60"), "{log}");
    assert_eq!(losses(&env.path("k")).len(), 60);
    let old_model = std::fs::read(env.path("k/model.safetensors")).unwrap();

    // --overwrite, killed as soon as the new run logs a step: the model beside the new metrics
    // is the new run's.
    let mut again = args.clone();
    again.extend(["--overwrite", "--set", "seed=5"].map(String::from));
    let old_metrics = std::fs::read_to_string(env.path("k/metrics.jsonl")).unwrap();
    let mut child = env.cmd(&strs(&again)).stderr(Stdio::null()).spawn().unwrap();
    let t = Instant::now();
    let new_metrics = || {
        std::fs::read_to_string(env.path("k/metrics.jsonl"))
            .is_ok_and(|m| !m.is_empty() && m != old_metrics)
    };
    while !new_metrics() && t.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(1));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(new_metrics());
    let model = std::fs::read(env.path("k/model.safetensors")).unwrap();
    assert!(model != old_model, "the old model is left beside the new run's metrics");

    // A directory holding no checkpoint at all (a run stopped before it saved anything).
    for d in ["ckpt", ".ckpt.old"] {
        let _ = std::fs::remove_dir_all(env.path("k").join(d));
    }
    fails(&env.run(&strs(&resume_args(env, "k"))), "start it again with --overwrite");
    ok(&env.run(&strs(&[args.clone(), vec!["--overwrite".into()]].concat())));
    assert_eq!(losses(&env.path("k")).len(), 60);
}

/// A second training process on a run directory in use is refused, naming the directory and
/// the process holding it; the lock goes with the process.
#[test]
fn one_run_has_one_writer() {
    let env = &RunEnv::new(12_000, 2);
    let mut args = train_args(env, "w");
    args.extend(["--set".to_string(), "max_tokens=3072000".to_string()]);
    let mut first = env.cmd(&strs(&args)).stderr(Stdio::null()).spawn().unwrap();
    wait_for_steps(&env.path("w"), 1);
    let pid = first.id().to_string();
    let mut overwrite = train_args(env, "w");
    overwrite.push("--overwrite".into());
    // Each second writer gets 60 seconds (a refused one ends at once).
    let outputs: Vec<Output> = [overwrite, resume_args(env, "w")]
        .iter()
        .map(|second| {
            let mut c = env.cmd(&strs(second)).stderr(Stdio::piped()).spawn().unwrap();
            let t = Instant::now();
            while c.try_wait().unwrap().is_none() && t.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = c.kill();
            c.wait_with_output().unwrap()
        })
        .collect();
    let still_training = first.try_wait().unwrap().is_none();
    first.kill().unwrap();
    first.wait().unwrap();
    for o in &outputs {
        fails(o, &format!("{} is in use by process {pid}", env.path("w").display()));
    }
    assert!(still_training, "the first run was still training");
    let lock = attnres::train::checkpoint::lock(&env.path("w")).unwrap();
    drop(lock);
}

/// `--resume` with the settings the run was started with continues it; other settings are
/// refused, naming the first difference; a run without a checkpoint starts again from step 0.
#[test]
fn resume_accepts_the_command_that_started_the_run() {
    use attnres::train::run::train;
    let env = &RunEnv::new(12_000, 2);
    // In-process runs use this cache (the other tests pass theirs to each process).
    std::env::set_var("ATTNRES_CACHE", env.path("cache"));
    let cfg = in_process_config(&["max_tokens=5120"]);
    let opts = |resume: bool| in_process_options(env, "s", resume);
    train(Some(cfg.clone()), &opts(false)).unwrap();
    let want = losses(&env.path("s"));
    train(Some(cfg.clone()), &opts(true)).unwrap();
    let other = cfg.with_overrides(&["lr=0.5".to_string()]).unwrap();
    let e = format!("{:#}", train(Some(other), &opts(true)).unwrap_err());
    assert!(e.contains("other settings (train.lr: 0.01 there, 0.5 asked)"), "{e}");
    // No checkpoint: the same command with --resume starts the run again from step 0.
    for d in ["ckpt", ".ckpt.old"] {
        let _ = std::fs::remove_dir_all(env.path("s").join(d));
    }
    train(Some(cfg.clone()), &opts(true)).unwrap();
    assert_eq!(losses(&env.path("s")), want);
}

/// `recompute=true` trains the same run bit for bit (losses and weights), and a run may be
/// resumed with or without it.
#[test]
fn recomputation_trains_the_same_run() {
    use attnres::train::run::train;
    let env = &RunEnv::new(12_000, 2);
    std::env::set_var("ATTNRES_CACHE", env.path("cache"));
    let opts = |out: &str, resume: bool| in_process_options(env, out, resume);
    let kept = in_process_config(&["max_tokens=5120"]);
    let recomputed = in_process_config(&["max_tokens=5120", "recompute=true"]);
    train(Some(kept.clone()), &opts("kept", false)).unwrap();
    train(Some(recomputed), &opts("recomputed", false)).unwrap();
    let want = losses(&env.path("kept"));
    assert_eq!(want.len(), 10);
    assert_eq!(losses(&env.path("recomputed")), want);
    let weights = |run: &str| std::fs::read(env.path(run).join("model.safetensors")).unwrap();
    assert!(weights("recomputed") == weights("kept"), "the trained weights differ");
    // Resumed with the other setting: accepted, not "other settings".
    train(Some(kept), &opts("recomputed", true)).unwrap();
}

/// A non-finite loss, gradient norm or weight is an error naming the step, what became
/// non-finite and the suspect setting; the run keeps its last good (step 0) checkpoint.
#[test]
fn non_finite_values_are_errors_naming_the_step_and_the_setting() {
    let env = &RunEnv::new(12_000, 2);
    let cases = [
        ("adam_eps=0", "the weights became non-finite in the update of step 1", "adam_eps = 0"),
        ("rope_theta=1e-300", "the training loss became NaN at step 1", "model settings"),
        ("initializer_range=1e30", "the training loss became NaN at step 1", "model settings"),
        // Weights of about 1e11: the forward pass stays finite, its gradients do not.
        ("initializer_range=1e11", "the gradient norm became NaN at step 1", "model settings"),
    ];
    for (i, (set, what, advice)) in cases.into_iter().enumerate() {
        let out = format!("n{i}");
        let mut args = train_args(env, &out);
        args.extend(["--set".to_string(), set.to_string()]);
        let o = env.run(&strs(&args));
        fails_in_training(&o, what);
        fails_in_training(&o, advice);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!err.contains("learning rate") && !err.contains("lower lr"), "{err}");
        assert!(!env.path(&out).join("summary.json").exists());
        let state = std::fs::read_to_string(env.path(&out).join("ckpt/train_state.json")).unwrap();
        let state: serde_json::Value = serde_json::from_str(&state).unwrap();
        assert_eq!(state["step"], 0, "{set}");
    }
}

/// Checkpoints come every `checkpoint_every` steps, at the end, and after at most
/// `CHECKPOINT_SECONDS` whatever `checkpoint_every` is.
#[test]
fn checkpoints_are_due_after_bounded_work() {
    use attnres::train::run::{checkpoint_due, CHECKPOINT_SECONDS};
    assert!(checkpoint_due(50, 60, 50, 0.0));
    assert!(checkpoint_due(60, 60, 1000, 0.0));
    assert!(!checkpoint_due(7, 60, 1000, CHECKPOINT_SECONDS - 1.0));
    assert!(checkpoint_due(7, 60, 1000, CHECKPOINT_SECONDS));
}
