//! Training end to end through the binary: a run killed at an arbitrary moment and resumed
//! gives the same per-step losses as an uninterrupted one; evaluation; and clear errors on bad
//! input without damaging an existing run.

mod common;

use common::ok;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

struct Env {
    tmp: tempfile::TempDir,
}

impl Env {
    fn new() -> Env {
        let tmp = tempfile::tempdir().unwrap();
        common::write_small_corpus(&tmp.path().join("corpus.txt"), 12_000);
        Env { tmp }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.tmp.path().join(name)
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_attnres"));
        c.args(args).env("ATTNRES_CACHE", self.path("cache")).arg("--threads").arg("2");
        c
    }

    fn run(&self, args: &[&str]) -> Output {
        self.cmd(args).output().unwrap()
    }

    /// Arguments that resume the run in `out` (which remembers its own --data).
    fn resume_args(&self, out: &str) -> Vec<String> {
        let o = self.path(out);
        ["train", "--resume", "--no-progress", "--out", o.to_str().unwrap()]
            .iter()
            .map(|s| s.to_string())
            .collect()
    }

    /// Training arguments for a short run into `out`.
    fn train_args(&self, out: &str) -> Vec<String> {
        let sets = [
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
        let head = ["train", "--preset", "tiny", "--no-progress"];
        common::run_args(&head, &self.path(out), &self.path("corpus.txt"), &sets)
    }
}

fn fails(o: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "expected a clean failure, got: {err}");
    assert!(err.starts_with("error: ") && err.contains(needle), "expected {needle:?} in {err:?}");
}

/// `(step, train_loss, val_loss)` of every metrics line.
fn losses(run: &Path) -> Vec<(u64, f64, Option<f64>)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["train_loss"].as_f64().unwrap(), v["val_loss"].as_f64())
        })
        .collect()
}

#[test]
fn killed_and_resumed_run_matches_an_uninterrupted_one() {
    let env = Env::new();
    let args = env.train_args("a");
    let a: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    ok(&env.run(&a));
    let want = losses(&env.path("a"));
    assert_eq!(want.len(), 60);
    assert!(want.last().unwrap().1 < want[0].1 - 0.5, "training lowers the loss: {want:?}");

    // Kill a second run at two different moments, resuming each time.
    let args = env.train_args("b");
    let b: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let resume_args = env.resume_args("b");
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
    let env = Env::new();
    let args = env.train_args("r");
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
        "unknown preset",
    );
    fails(
        &env.run(&["train", "--resume", "--out", env.path("nothing").to_str().unwrap()]),
        "holds no checkpoint",
    );

    let bad = env.path("bad.txt");
    std::fs::write(&bad, b"Shakespeare \xc3\x28 broken").unwrap();
    fails(
        &env.run(&[
            "train",
            "--preset",
            "tiny",
            "--out",
            env.path("x").to_str().unwrap(),
            "--data",
            bad.to_str().unwrap(),
        ]),
        "not valid UTF-8",
    );
    let empty = env.path("empty.txt");
    std::fs::write(&empty, "\n\n").unwrap();
    fails(
        &env.run(&[
            "train",
            "--preset",
            "tiny",
            "--out",
            env.path("x").to_str().unwrap(),
            "--data",
            empty.to_str().unwrap(),
        ]),
        "empty",
    );
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
    fails(&run(with(&["--resume", "--set", "lr=1"])), "drop --config/--preset/--set");
    // A corrupt checkpoint is reported, and nothing is changed.
    let opt = env.path("r/ckpt/optimizer.safetensors");
    let bytes = std::fs::read(&opt).unwrap();
    std::fs::write(&opt, &bytes[..bytes.len() / 3]).unwrap();
    fails(&run(env.resume_args("r")), "optimizer.safetensors is corrupt");
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
    generation_from_a_trained_run(&env, "r");
}

/// `attnres generate` on a trained run: streaming output equals the batch output, a seed fixes
/// sampled text, and bad requests get named errors.
fn generation_from_a_trained_run(env: &Env, run: &str) {
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
