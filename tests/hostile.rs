//! The hostile-input suite: the binary attacked the way a careless user or a flaky machine
//! would — corrupted and truncated checkpoints, impossible sizes, bad batches, corpora and
//! settings, a second writer on a live run, and `kill -9` at random moments, many of them in the
//! middle of a checkpoint write. Every failure must exit 1 with one `error:` line, the last, that
//! names the problem: never a panic or an abort, and no temporary file left behind. Every killed
//! run must resume and end bit-identical to an uninterrupted one. Closed pipes and full disks are
//! in `tests/io_errors.rs`; the figures of this suite are in docs/verification.md.

mod common;

use common::RunEnv;

use std::path::{Path, PathBuf};
use std::process::{Child, Output, Stdio};
use std::time::{Duration, Instant};

/// The command of a short run into `out`, checkpointing after every step.
fn train_args(env: &RunEnv, out: &Path) -> Vec<String> {
    let head = ["train", "--preset", "tiny", "--no-progress"];
    common::run_args(&head, out, &env.path("corpus.txt"), &SETS)
}

/// The settings of the short runs, laid over the `tiny` preset: 150 steps (long enough for 45
/// kills on a fast machine).
const SETS: [&str; 9] = [
    "vocab_size=400",
    "seq_len=64",
    "micro_batch=4",
    "batch_tokens=512",
    "max_tokens=76800",
    "eval_every=10",
    "eval_tokens=512",
    "checkpoint_every=1",
    "warmup_steps=3",
];

/// A failure as the README promises it: exit 1, no panic or abort, and one `error:` line, the
/// last, containing `needle`.
fn clean_failure(o: &Output, what: &str, needle: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{what}: expected exit 1, got {:?}: {err}", o.status);
    assert!(!err.contains("panicked") && !err.contains("memory allocation"), "{what}: {err}");
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error")).collect();
    assert_eq!(errors.len(), 1, "{what}: one error line expected: {err}");
    assert_eq!(err.lines().last(), Some(errors[0]), "{what}: the error comes last: {err}");
    assert!(errors[0].contains(needle), "{what}: expected {needle:?} in {:?}", errors[0]);
}

fn copy_dir(from: &Path, to: &Path) {
    let _ = std::fs::remove_dir_all(to);
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        let dest = to.join(p.file_name().unwrap());
        if p.is_dir() {
            copy_dir(&p, &dest);
        } else {
            std::fs::copy(&p, &dest).unwrap();
        }
    }
}

/// Deterministic pseudo-random numbers (xorshift64*), so every run of the suite attacks the
/// same way and a failure can be replayed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D) % n
    }
}

/// The ways a file is damaged: emptied, cut in half, its last byte lost, bytes of its head
/// overwritten (a header or the start of a JSON document), garbage appended.
fn damaged(bytes: &[u8], how: usize, rng: &mut Rng) -> Vec<u8> {
    let mut b = bytes.to_vec();
    match how {
        0 => b.clear(),
        1 => b.truncate(b.len() / 2),
        2 => {
            b.pop();
        }
        3 => {
            let head = b.len().min(96) as u64;
            for _ in 0..8 {
                let i = rng.below(head) as usize;
                b[i] = b"\xff{\"0:,]z"[rng.below(8) as usize];
            }
        }
        _ => b.extend(std::iter::repeat_n(0xA5, 1000)),
    }
    b
}

const DAMAGES: [&str; 5] =
    ["emptied", "cut in half", "last byte lost", "head overwritten", "grown"];

#[test]
fn damaged_checkpoints_are_refused_naming_the_file() {
    let env = &RunEnv::new(12_000, 1);
    let run = env.path("run");
    let mut args = train_args(env, &run);
    args.extend(["--set".into(), "max_tokens=3072".into()]);
    common::ok(&env.run(&args));
    let copy = env.path("copy");
    let mut rng = Rng(7);
    let mut cases = 0;
    // The resumable state: every file of ckpt/ is read before training goes on.
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "train_state.json",
        "optimizer.safetensors",
    ] {
        for (how, damage) in DAMAGES.iter().enumerate() {
            copy_dir(&run, &copy);
            let path = copy.join("ckpt").join(file);
            std::fs::write(&path, damaged(&std::fs::read(&path).unwrap(), how, &mut rng)).unwrap();
            let o =
                env.run(&["train", "--resume", "--no-progress", "--out", copy.to_str().unwrap()]);
            let what = format!("train --resume with ckpt/{file} {damage}");
            clean_failure(&o, &what, file);
            assert_eq!(common::leftovers(&copy), Vec::<PathBuf>::new(), "{what}");
            cases += 1;
        }
    }
    // The latest model, read by generate and eval.
    let text = env.path("corpus.txt");
    for file in ["config.json", "model.safetensors", "tokenizer.json"] {
        for (how, damage) in DAMAGES.iter().enumerate() {
            copy_dir(&run, &copy);
            let path = copy.join(file);
            std::fs::write(&path, damaged(&std::fs::read(&path).unwrap(), how, &mut rng)).unwrap();
            let m = copy.to_str().unwrap();
            for command in [
                vec!["generate", "--model", m, "--prompt", "To be", "--max-tokens", "5"],
                vec!["eval", "--model", m, "--text", text.to_str().unwrap()],
            ] {
                let what = format!("{} with {file} {damage}", command[0]);
                clean_failure(&env.run(&command), &what, file);
                cases += 1;
            }
        }
    }
    println!("damaged checkpoints: {cases} cases, each a clean error naming the file");
}

#[test]
fn impossible_sizes_and_bad_batches_corpora_and_settings_are_refused() {
    let env = &RunEnv::new(12_000, 1);
    let run = env.path("run");
    let mut args = train_args(env, &run);
    args.extend(["--set".into(), "max_tokens=1024".into()]);
    common::ok(&env.run(&args));
    let m = run.to_str().unwrap().to_string();
    let file = |name: &str, bytes: &[u8]| -> String {
        let p = env.path(name);
        std::fs::write(&p, bytes).unwrap();
        p.to_str().unwrap().to_string()
    };

    // Checkpoints whose config asks for impossible sizes.
    let huge = env.path("huge");
    copy_dir(&run, &huge);
    let config = std::fs::read_to_string(run.join("config.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&config).unwrap();
    v["hidden_size"] = 4_000_000_000u64.into();
    std::fs::write(huge.join("config.json"), v.to_string()).unwrap();
    let huge = huge.to_str().unwrap().to_string();

    // Batches for `forward`.
    let batch = |name: &str, json: &str| file(name, json.as_bytes());
    let batches = [
        (batch("b-not-json", "{\"input_ids\": [[1, 2"), "not a valid batch file"),
        (batch("b-empty", r#"{"input_ids": []}"#), "input_ids is empty"),
        (batch("b-ragged", r#"{"input_ids": [[1, 2], [3]]}"#), "rows must have equal length"),
        (batch("b-negative", r#"{"input_ids": [[1, -2]]}"#), "-2"),
        (batch("b-vocab", r#"{"input_ids": [[1, 4000000000]]}"#), "4000000000"),
        (batch("b-targets", r#"{"input_ids": [[1, 2]], "targets": [[1]]}"#), "targets"),
        (batch("b-field", r#"{"input_ids": [[1, 2]], "labels": [[1, 2]]}"#), "labels"),
        (batch("b-long", &format!(r#"{{"input_ids": [{:?}]}}"#, vec![1; 5000])), "5000"),
    ];

    // Corpora for `train --data`.
    let dir_empty = env.path("empty-dir");
    std::fs::create_dir_all(&dir_empty).unwrap();
    let dir_loop = env.path("loop-dir");
    std::fs::create_dir_all(&dir_loop).unwrap();
    let _ = std::os::unix::fs::symlink(&dir_loop, dir_loop.join("again"));
    let corpora = [
        (env.path("missing.txt").to_str().unwrap().to_string(), "no such file"),
        (file("c-empty.txt", b""), "the corpus is empty"),
        (file("c-blank.txt", b"\n\n \n\t\n"), "the corpus is empty"),
        (
            file("c-binary.txt", b"To be\xff\xfe or not"),
            "not valid UTF-8 (first invalid byte at offset 5",
        ),
        (file("c-bad.jsonl", b"{\"text\": \"a\"}\n{\"text\": 3}\n"), "line 2"),
        (file("c-short.txt", b"To be, or not to be."), "validation split is empty"),
        ("/dev/zero".to_string(), "not a regular file"),
        (dir_empty.to_str().unwrap().to_string(), "holds no files"),
        (dir_loop.to_str().unwrap().to_string(), "holds no files"),
    ];

    let out = env.path("out");
    let o = out.to_str().unwrap().to_string();
    let mut cases: Vec<(Vec<String>, String)> = Vec::new();
    let mut case = |args: &[&str], needle: &str| {
        cases.push((args.iter().map(|s| s.to_string()).collect(), needle.to_string()));
    };
    case(&["init", "--out", &o, "--set", "hidden_size=4000000000"], "the model needs");
    case(&["init", "--out", &o, "--set", "num_hidden_layers=100000000000000"], "the model needs");
    case(&["init", "--out", &o, "--set", "hidden_size=-3"], "hidden_size");
    case(
        &[
            "train",
            "--out",
            &o,
            "--set",
            "micro_batch=100000",
            "--set",
            "batch_tokens=25600000",
            "--set",
            "max_tokens=1000000000",
        ],
        "a training step needs",
    );
    case(&["train", "--out", &o, "--set", "micro_batch=72057594037927936"], "overflows");
    case(&["generate", "--model", &huge, "--prompt", "To be"], "the model needs");
    case(&["eval", "--model", &huge, "--text", &m], "the model needs");
    for (b, needle) in &batches {
        case(&["forward", "--model", &m, "--batch", b, "--out", &o], needle);
    }
    for (c, needle) in &corpora {
        case(&["train", "--preset", "tiny", "--no-progress", "--out", &o, "--data", c], needle);
    }
    for (set, needle) in [
        ("lr=-1", "lr"),
        ("seq_len=0", "seq_len must be positive"),
        ("eval_every=0", "eval_every must be positive"),
        ("adam_eps=abc", "adam_eps"),
        ("no_such_key=1", "unknown setting"),
        ("residual=sideways", "residual"),
        ("num_blocks=0", "num_blocks"),
        ("rms_norm_eps=1e308", "rms_norm_eps must be a positive number, at most 1, got 1e308"),
        ("rope_theta=1e308", "rope_theta must be positive, at most 1e12, got 1e308"),
    ] {
        case(&["train", "--preset", "tiny", "--out", &o, "--set", set], needle);
    }
    // Malformed --config files: one line naming the place.
    for (name, text, needle) in [
        (
            "t-eq.toml",
            "[model]\nhidden_size = = 3\n",
            "invalid TOML at line 2, column 15: extra `=`",
        ),
        ("t-table.toml", "[model\n", "invalid TOML at line 1, column 7"),
        ("t-key.toml", "[train]\nlr = 1\nlr = 2\n", "invalid TOML at line 3"),
    ] {
        case(&["train", "--out", &o, "--config", &file(name, text.as_bytes())], needle);
    }
    let prompts_empty = file("p-empty.txt", b"");
    let prompts_blank = file("p-blank.txt", b"To be\n\nor not\n");
    for (flags, needle) in [
        (vec!["--prompt", "To be", "--max-tokens", "0"], "--max-tokens"),
        (vec!["--prompt", "To be", "--top-p", "2"], "top-p"),
        (vec!["--prompt", "To be", "--temperature", "NaN"], "temperature"),
        (vec!["--prompt", ""], "--prompt is empty"),
        (vec!["--prompt", "To be", "--max-tokens", "100000000"], "context"),
        (vec!["--prompt-file", &prompts_empty], "holds no prompts"),
        (vec!["--prompt-file", &prompts_blank], "line 2 is empty"),
        (vec!["--prompt-file", "/dev/zero"], "not a regular file"),
    ] {
        let mut args = vec!["generate", "--model", &m];
        args.extend(flags);
        case(&args, needle);
    }
    case(&["eval", "--model", &m, "--text", env.path("missing").to_str().unwrap()], "cannot read");
    for (flags, needle) in [
        (["--max-batch", "0"], "--max-batch must be at least 1"),
        (["--max-queue", "0"], "--max-queue must be at least 1"),
        (["--max-batch", "1000000000"], "(--max-batch 1000000000 sequences of"),
        // Checked before anything is allocated: a slot list of this many would not fit.
        (["--max-batch", "10000000000"], "(--max-batch 10000000000 sequences of"),
        (["--max-queue", "1000000000"], "--max-queue must be at most 65536"),
        (["--max-connections", "0"], "--max-connections must lie in 1..=65536, got 0"),
        (["--max-connections", "1000000"], "--max-connections must lie in 1..=65536"),
        (["--header-timeout", "0"], "--header-timeout must lie in 1..=86400 seconds, got 0"),
        (["--body-timeout", "999999999"], "--body-timeout must lie in 1..=86400 seconds"),
        (["--request-timeout", "0"], "--request-timeout must lie in 1..=86400 seconds, got 0"),
        (["--write-timeout", "0"], "--write-timeout must lie in 1..=86400 seconds, got 0"),
        (["--max-body-total", "15"], "--max-body-total must be at least one request body's"),
    ] {
        let mut args = vec!["serve", "--model", &m, "--port", "0"];
        args.extend(flags);
        case(&args, needle);
    }
    // The weights, the key/value cache at full size and the prefix cache must fit together: a
    // prefix cache of all the machine's memory leaves no room for the rest.
    let all = (attnres::base::memory::memory_limit() >> 20).to_string();
    case(
        &["serve", "--model", &m, "--port", "0", "--max-batch", "1", "--prefix-cache", &all],
        "more than the machine's memory",
    );
    case(&["eval", "--model", env.path("no-model").to_str().unwrap(), "--text", &m], "no-model");

    for (args, needle) in &cases {
        clean_failure(&env.run(args), &args.join(" "), needle);
        assert_eq!(common::leftovers(&out), Vec::<PathBuf>::new(), "{args:?}");
        assert!(
            !out.join("model.safetensors").exists(),
            "{args:?} failed, yet left a model in {o}"
        );
    }
    // An output that is a device (a private null device, 1:3) is refused and left a device:
    // the atomic write's rename would put a file in its place.
    let null = env.path("null-device");
    common::make_device(&null, 1, 3);
    let good = batch("b-good", r#"{"input_ids": [[1, 2, 3]]}"#);
    let n = null.to_str().unwrap();
    let o = env.run(&["forward", "--model", &m, "--batch", &good, "--out", n]);
    clean_failure(&o, "forward --out onto a device", "is a device, not a file");
    use std::os::unix::fs::FileTypeExt;
    assert!(
        std::fs::metadata(&null).unwrap().file_type().is_char_device(),
        "the device was replaced"
    );
    // A run that would write over the model it starts from, or over the tokenizer it is given:
    // refused before anything is written, the run left as it was.
    let weights = std::fs::read(run.join("model.safetensors")).unwrap();
    let tokenizer = run.join("tokenizer.json");
    let (t, data) = (tokenizer.to_str().unwrap(), env.path("corpus.txt"));
    let head = [
        "train",
        "--no-progress",
        "--overwrite",
        "--set",
        "max_tokens=4096",
        "--set",
        "seq_len=64",
        "--out",
        &m,
    ];
    // And a corpus inside the run's directory.
    let inside = run.join("corpus.txt");
    std::fs::copy(&data, &inside).unwrap();
    for (extra, needle) in [
        (["--init", m.as_str(), "--data", data.to_str().unwrap()], "is --init's"),
        (["--tokenizer", t, "--data", data.to_str().unwrap()], "is --tokenizer"),
        (["--data", inside.to_str().unwrap(), "--set", "seed=1"], "is --data"),
    ] {
        let mut args: Vec<&str> = head.to_vec();
        args.extend(extra);
        clean_failure(&env.run(&args), &args.join(" "), needle);
        assert_eq!(std::fs::read(run.join("model.safetensors")).unwrap(), weights);
    }
    let cmp = env.path("cmp");
    std::fs::create_dir(&cmp).unwrap();
    std::fs::copy(&data, cmp.join("c.txt")).unwrap();
    let (c, cd) = (cmp.to_str().unwrap(), cmp.join("c.txt"));
    let o = env.run(&["compare", "--quick", "--out", c, "--data", cd.to_str().unwrap()]);
    clean_failure(&o, "compare --data inside --out", "is --data");
    assert!(!cmp.join("compare.json").exists());
    println!("impossible sizes, bad batches, corpora and settings: {} cases", cases.len() + 5);
}

/// Spawns the run's command, quiet.
fn spawn(env: &RunEnv, args: &[String]) -> Child {
    env.cmd(args).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap()
}

/// Whether the child has ended by itself (the run finished), after waiting for it.
fn ended(child: &mut Child) -> bool {
    child.try_wait().unwrap().is_some()
}

/// Steps logged in `run` so far.
fn steps_logged(run: &Path) -> usize {
    std::fs::read_to_string(run.join("metrics.jsonl")).map(|s| s.lines().count()).unwrap_or(0)
}

#[test]
fn kills_at_random_moments_and_second_writers_never_lose_or_change_a_run() {
    let env = &RunEnv::new(12_000, 1);
    let reference = env.path("reference");
    common::ok(&env.run(&train_args(env, &reference)));

    let run = env.path("run");
    let start = train_args(env, &run);
    // After the first kill: the same command with --resume, as people do.
    let mut resume = start.clone();
    resume.push("--resume".into());
    let mut rng = Rng(2026);
    let (mut kills, mut in_checkpoint, mut refused) = (0, 0, 0);
    const KILLS: usize = 45;
    for round in 0..KILLS {
        let mut child = spawn(env, if round == 0 { &start } else { &resume });
        let pid = child.id();
        let t = Instant::now();
        match round % 3 {
            // At a random moment from the start: while loading, tokenizing, training or saving.
            0 => std::thread::sleep(Duration::from_millis(rng.below(400))),
            // The moment a checkpoint is being written.
            1 => {
                let tmp = run.join(".ckpt.tmp");
                while !tmp.exists() && !ended(&mut child) && t.elapsed() < Duration::from_secs(20) {
                    std::thread::sleep(Duration::from_micros(100));
                }
                // Within about a millisecond: a write takes a few, and on a loaded machine a
                // longer wait let as few as 3 of 15 kills land inside one (5 are required).
                std::thread::sleep(Duration::from_micros(rng.below(1200)));
            }
            // A few steps in, and meanwhile a second writer on the same run is refused.
            _ => {
                let before = steps_logged(&run);
                while steps_logged(&run) < before + 1
                    && !ended(&mut child)
                    && t.elapsed() < Duration::from_secs(20)
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
                if !ended(&mut child) {
                    let second = env.run(&resume);
                    clean_failure(&second, "a second writer", &format!("in use by process {pid}"));
                    refused += 1;
                }
                std::thread::sleep(Duration::from_millis(rng.below(50)));
            }
        }
        if ended(&mut child) {
            break; // finished before this kill: the rest of the test still checks the result
        }
        child.kill().unwrap();
        child.wait().unwrap();
        kills += 1;
        if run.join(".ckpt.tmp").exists() {
            in_checkpoint += 1;
        }
    }
    assert!(kills >= 30, "the run finished after {kills} kills: make it longer");
    assert!(in_checkpoint >= 5, "only {in_checkpoint} kills landed in a checkpoint write");
    let log = common::ok(&env.run(&resume));
    assert!(log.contains("done: step 150"), "{log}");
    assert_eq!(
        common::losses(&run),
        common::losses(&reference),
        "the killed run's losses differ from the uninterrupted run's"
    );
    for f in ["model.safetensors", "ckpt/optimizer.safetensors"] {
        assert!(
            std::fs::read(run.join(f)).unwrap() == std::fs::read(reference.join(f)).unwrap(),
            "{f} differs from the uninterrupted run's"
        );
    }
    assert_eq!(common::leftovers(&run), Vec::<PathBuf>::new());
    println!(
        "kill -9: {kills} kills ({in_checkpoint} during a checkpoint write), {refused} second writers refused; the run resumed bit-identical"
    );
}

/// Weights so large that their squares overflow f32: RMSNorm computes its statistic without
/// overflowing (once it gave 0, a uniform output and a plausible loss of ln(vocab)), and what
/// overflows after it is an error naming the non-finite values, never a loss.
#[test]
fn overflowing_weights_are_an_error_not_a_loss() {
    let env = &RunEnv::new(20_000, 2);
    let run = common::train_tiny(env, "run", &["max_tokens=4096", "vocab_size=300"]);
    let text = env.path("corpus.txt");
    let eval = |name: &str, scale: f32, all: bool| {
        let dir = env.path(name);
        copy_dir(&run, &dir);
        let mut model = attnres::model::checkpoint::load(&dir).unwrap();
        let last =
            format!("model.layers.{}.mlp.down_proj.weight", model.config.num_hidden_layers - 1);
        for s in model.layout.specs.clone() {
            if all || s.name == last {
                model.params[s.range.clone()].iter_mut().for_each(|v| *v *= scale);
            }
        }
        attnres::model::checkpoint::save(&model, &dir).unwrap();
        env.run(&[
            "eval",
            "--model",
            dir.to_str().unwrap(),
            "--text",
            text.to_str().unwrap(),
            "--json",
        ])
    };
    // The last MLP's output scaled up until it dominates the residual stream: at 1e12 its
    // squares fit f32, at 1e37 they do not. The final RMSNorm sees the same direction in both.
    let loss = |o: &Output| -> f64 {
        common::ok(o);
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["loss"].as_f64().unwrap()
    };
    let (fits, overflows) = (loss(&eval("e12", 1e12, false)), loss(&eval("e37", 1e37, false)));
    assert!((fits / overflows - 1.0).abs() < 1e-5, "{fits} vs {overflows}");
    assert!((overflows - (300f64).ln()).abs() > 1e-3, "a uniform output: {overflows}");
    // Every weight near f32's largest: the products overflow, and that is an error.
    let o = eval("all", 1e37, true);
    clean_failure(&o, "eval of huge weights", "the forward pass overflowed");
    let huge = env.path("all");
    let o = env.run(&[
        "generate",
        "--model",
        huge.to_str().unwrap(),
        "--prompt",
        "the",
        "--max-tokens",
        "4",
    ]);
    clean_failure(&o, "generate with huge weights", "non-finite value");
}
