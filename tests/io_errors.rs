//! Closed pipes and full disks through the binary, with real child processes: log lines never
//! stop the work (stderr closed, or a reader that stops reading); a result that cannot be
//! written to stdout is an error (a full device), or a quiet exit 141 when the reader has gone;
//! a checkpoint that does not fit on the disk (a small tmpfs, mounted as root or as root of a
//! user namespace, and a file-size limit) leaves no temporary directory behind, and the run
//! resumes from the previous checkpoint or restarts (docs/development.md, "Errors and exit codes").

mod common;

use common::RunEnv;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

/// The exit status of a command whose stdout reader has gone.
const CLOSED_PIPE_EXIT: i32 = 141;

/// A short training run into `out`: `steps` steps of 512 tokens, a checkpoint every 2.
fn train_args(env: &RunEnv, out: &Path, steps: usize) -> Vec<String> {
    let max_tokens = format!("max_tokens={}", 512 * steps);
    let sets = [
        "vocab_size=300",
        "seq_len=64",
        "micro_batch=4",
        "batch_tokens=512",
        max_tokens.as_str(),
        "eval_every=2",
        "eval_tokens=256",
        "checkpoint_every=2",
        "warmup_steps=1",
    ];
    let head = ["train", "--preset", "tiny", "--no-progress"];
    common::run_args(&head, out, &env.path("corpus.txt"), &sets)
}

fn args(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| s.to_string()).collect()
}

/// Runs with stdout on a full device (every write fails with "no space left"): a private one,
/// made with `mknod` beside the run's files (the character device 1:7, as `/dev/full`), so
/// that the test never writes to the machine's own device nodes.
fn stdout_full(env: &RunEnv, mut c: Command) -> Output {
    let full = env.path("full");
    if !full.exists() {
        common::make_device(&full, 1, 7);
    }
    c.stdout(std::fs::OpenOptions::new().write(true).open(&full).unwrap()).stderr(Stdio::piped());
    c.output().unwrap()
}

/// The writing end of a pipe whose reader is already closed: every write fails with EPIPE.
fn broken_pipe() -> std::io::PipeWriter {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    writer
}

/// Runs with stdout a pipe whose reader is closed before the command starts.
fn stdout_closed(mut c: Command) -> Output {
    c.stdout(broken_pipe()).stderr(Stdio::piped()).output().unwrap()
}

/// Runs with stdout closed from the start (a shell's `>&-`): Rust's runtime would put
/// `/dev/null` in its place, so the command must notice before it starts.
fn stdout_shut(c: Command) -> Output {
    let mut sh = Command::new("sh");
    sh.arg("-c").arg("exec \"$0\" \"$@\" >&-").arg(c.get_program()).args(c.get_args());
    for (k, v) in c.get_envs() {
        if let Some(v) = v {
            sh.env(k, v);
        }
    }
    sh.stdin(Stdio::null()).stderr(Stdio::piped()).output().unwrap()
}

/// A result with stdout closed from the start: exit 1, one error line that says so.
fn fails_on_shut_stdout(o: &Output, what: &str) {
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{what}: {err}");
    assert_eq!(
        err.lines().last(),
        Some("error: cannot write to standard output: it was closed when attnres started"),
        "{what}: {err}"
    );
}

/// Runs with stderr a pipe whose reader is closed before the command starts.
fn stderr_closed(mut c: Command) -> Output {
    c.stdout(Stdio::piped()).stderr(broken_pipe()).output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A result written to `/dev/full`: exit 1, and after the log lines one `error:` line that
/// names stdout.
fn fails_on_full_stdout(o: &Output, what: &str) {
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{what}: {err}");
    let last = err.lines().last().unwrap_or("");
    assert!(
        last.starts_with("error: cannot write to standard output") && last.contains("space"),
        "{what}: {err}"
    );
    assert_eq!(err.lines().filter(|l| l.starts_with("error")).count(), 1, "{what}: {err}");
    assert!(!err.contains("panicked"), "{what}: {err}");
}

/// A result written into a closed pipe: a quiet exit 141.
fn quiet_on_closed_stdout(o: &Output, what: &str) {
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(CLOSED_PIPE_EXIT), "{what}: {err}");
    assert!(!err.contains("error") && !err.contains("panicked"), "{what}: {err}");
}

#[test]
fn results_on_a_closed_or_full_stdout_and_logs_on_a_closed_stderr() {
    let env = &RunEnv::new(6_000, 2);
    let run = env.path("run");
    // A command whose result is not on stdout does not mind a closed stdout.
    let o = stdout_shut(env.cmd(&[
        "init",
        "--preset",
        "tiny",
        "--out",
        env.path("i").to_str().unwrap(),
    ]));
    assert!(o.status.success(), "init with stdout closed: {}", text(&o.stderr));
    // Training logs every step to stderr; with stderr closed from the start it still finishes.
    let o = stderr_closed(env.cmd(&train_args(env, &run, 4)));
    assert!(o.status.success(), "training with a closed stderr: {:?}", o.status);
    assert!(run.join("ckpt/train_state.json").exists() && run.join("summary.json").exists());

    let m = run.to_str().unwrap();
    let corpus = env.path("corpus.txt");
    let c = corpus.to_str().unwrap();
    let prompts = env.path("prompts.txt");
    std::fs::write(&prompts, "To be\nThe king\n").unwrap();
    let p = prompts.to_str().unwrap();
    let commands = [
        ("eval", args(&["eval", "--model", m, "--text", c])),
        ("eval --json", args(&["eval", "--model", m, "--text", c, "--json"])),
        (
            "generate --prompt",
            args(&["generate", "--model", m, "--prompt", "The", "--max-tokens", "40"]),
        ),
        (
            "generate --prompt-file",
            args(&["generate", "--model", m, "--prompt-file", p, "--max-tokens", "40"]),
        ),
    ];
    for (what, a) in &commands {
        // Results on a closed stderr: the result arrives, the log lines are dropped.
        let o = stderr_closed(env.cmd(a));
        assert!(o.status.success(), "{what} with a closed stderr: {:?}", o.status);
        assert!(!o.stdout.is_empty(), "{what}: no result");
        fails_on_full_stdout(&stdout_full(env, env.cmd(a)), what);
        quiet_on_closed_stdout(&stdout_closed(env.cmd(a)), what);
        fails_on_shut_stdout(&stdout_shut(env.cmd(a)), what);
    }
    // --help and --version are results too.
    for what in ["--help", "--version"] {
        fails_on_full_stdout(&stdout_full(env, env.cmd(&[what])), what);
        quiet_on_closed_stdout(&stdout_closed(env.cmd(&[what])), what);
        fails_on_shut_stdout(&stdout_shut(env.cmd(&[what])), what);
    }
    // A stream cut off part way: the reader takes the first bytes of the text and goes while
    // a hundred million tokens (hours of work) are still to come; generation stops with it.
    let a = args(&[
        "generate",
        "--model",
        m,
        "--prompt",
        "The",
        "--max-tokens",
        "100000000",
        "--slide",
        "--ignore-eos",
    ]);
    let mut child = env.cmd(&a).stdout(Stdio::piped()).stderr(Stdio::null()).spawn().unwrap();
    let mut first = [0u8; 3];
    std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut first).unwrap();
    assert_eq!(&first, b"The");
    drop(child.stdout.take());
    let t = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed().as_secs() > 30 {
            child.kill().unwrap();
            panic!("generate went on for 30 s after its reader had gone");
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    };
    assert_eq!(status.code(), Some(CLOSED_PIPE_EXIT), "generate cut off");
}

#[test]
fn training_outlives_a_reader_that_stops_after_two_lines() {
    // `attnres train ... 2>&1 | head -2`
    let env = &RunEnv::new(6_000, 2);
    let run = env.path("run");
    let (reader, writer) = std::io::pipe().unwrap();
    let mut c = env.cmd(&train_args(env, &run, 6));
    c.stdout(writer.try_clone().unwrap()).stderr(writer);
    let mut child = c.spawn().unwrap();
    drop(c);
    let mut lines = BufReader::new(reader);
    for _ in 0..2 {
        let mut line = String::new();
        lines.read_line(&mut line).unwrap();
        assert!(!line.is_empty());
    }
    drop(lines);
    let status = child.wait().unwrap();
    assert!(status.success(), "training after its reader left: {status:?}");
    assert!(run.join("summary.json").exists());
}

#[test]
fn bench_results_on_a_closed_or_full_stdout() {
    let env = &RunEnv::new(6_000, 2);
    let base = ["bench", "--preset", "tiny", "--batch", "1", "--seq", "16", "--steps", "1"];
    for (what, extra) in [("bench table", &[][..]), ("bench --json", &["--json"][..])] {
        let a = args(&[&base[..], extra].concat());
        let o = stderr_closed(env.cmd(&a));
        assert!(o.status.success() && !o.stdout.is_empty(), "{what} with a closed stderr");
        fails_on_full_stdout(&stdout_full(env, env.cmd(&a)), what);
        quiet_on_closed_stdout(&stdout_closed(env.cmd(&a)), what);
    }
}

/// A tmpfs mounted for one test and unmounted when dropped.
struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    /// Mounts a tmpfs of `bytes` at `dir`, or says why not (not root, no right to mount in a
    /// container).
    fn mount(dir: &Path, bytes: u64) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(dir).unwrap();
        let o = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir)
            .output()
            .map_err(|e| format!("cannot run mount: {e}"))?;
        if !o.status.success() {
            return Err(format!("mount -t tmpfs failed: {}", text(&o.stderr).trim()));
        }
        Ok(Tmpfs { dir: dir.to_path_buf() })
    }

    /// Mounts it again with `opts` (`remount,...`). The type and source are named: in a user
    /// namespace, mount(8) given the directory alone fails to remount.
    fn remount(&self, opts: &str) {
        let o = Command::new("mount")
            .args(["-t", "tmpfs", "-o", opts, "tmpfs"])
            .arg(&self.dir)
            .output()
            .unwrap();
        assert!(o.status.success(), "mount -o {opts}: {}", text(&o.stderr));
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
    }
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let m = e.metadata().unwrap();
            if m.is_dir() {
                dir_bytes(&e.path())
            } else {
                m.len()
            }
        })
        .sum()
}

/// This test's name, to run it again on its own in a user namespace.
const TMPFS_TEST: &str =
    "a_checkpoint_that_does_not_fit_leaves_no_temporary_files_and_the_run_resumes";

/// Whether this process runs as root (of its user namespace): `Uid:` in /proc/self/status.
fn is_root() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:")).unwrap();
    uid.split_whitespace().next() == Some("0")
}

/// A run on a small tmpfs that fills up in its second checkpoint, then resumes when the disk has
/// room again, then meets a read-only disk. Mounting needs root. CI runs as root, where the test
/// mounts the tmpfs itself and fails if it cannot (say, a container without the right to
/// mount). Run by another user, the test runs itself again as root of its own user and mount
/// namespaces (`unshare --user --map-root-user --mount`, which most Linux systems allow
/// anyone), and fails, saying why, where that is refused too. It cannot be ignored at compile
/// time, since whether a mount is permitted is known only when the test runs, and it does not
/// pass without mounting: a pass would claim a full and a read-only disk it never saw.
#[test]
fn a_checkpoint_that_does_not_fit_leaves_no_temporary_files_and_the_run_resumes() {
    if !is_root() {
        let exe = std::env::current_exe().unwrap();
        let o = Command::new("unshare")
            .args(["--user", "--map-root-user", "--mount", "--"])
            .arg(&exe)
            .args(["--exact", TMPFS_TEST, "--test-threads", "1"])
            .output()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot run unshare ({e}): this test mounts a tmpfs, which needs root or a \
                     user namespace"
                )
            });
        let out = text(&o.stdout);
        assert!(
            o.status.success() && out.contains(" 1 passed"),
            "the test, run again as root of a user namespace (unshare --user --map-root-user \
             --mount), failed; it mounts a tmpfs, which needs root or such a namespace:\n{out}\n{}",
            text(&o.stderr)
        );
        return;
    }
    let env = &RunEnv::new(6_000, 2);
    // The size of a checkpoint (ckpt/) and of the latest model beside it, from a run on the
    // ordinary disk.
    let reference = env.path("reference");
    common::ok(&env.cmd(&train_args(env, &reference, 2)).output().unwrap());
    let ckpt = dir_bytes(&reference.join("ckpt"));
    let run_bytes = dir_bytes(&reference);

    // A disk with room for the run after its first checkpoint and half of a second checkpoint.
    let mnt = env.path("mnt");
    let size = (run_bytes + ckpt / 2).div_ceil(4096) * 4096 + 64 * 4096;
    let disk = Tmpfs::mount(&mnt, size).unwrap_or_else(|why| {
        panic!(
            "{why}: this test mounts a small tmpfs, which root may do unless a container denies \
             it the right to mount (CAP_SYS_ADMIN)"
        )
    });
    let run = mnt.join("run");
    let o = env.cmd(&train_args(env, &run, 6)).output().unwrap();
    let err = text(&o.stderr);
    let last = err.lines().last().unwrap_or("");
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        last.starts_with("error: ") && last.contains(&run.join("ckpt").display().to_string()),
        "the error names the checkpoint: {last}"
    );
    assert!(last.contains("space"), "{last}");
    assert_eq!(
        common::leftovers(&run),
        Vec::<PathBuf>::new(),
        "temporary files left on the full disk"
    );
    assert!(run.join("ckpt/train_state.json").exists(), "the previous checkpoint is kept");
    // A model into a new directory on the full disk: refused, and no directory is left.
    let fresh = mnt.join("fresh");
    let o = env
        .cmd(&args(&["init", "--preset", "small", "--out", fresh.to_str().unwrap()]))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o.stderr));
    assert!(!fresh.exists(), "init left {} behind", fresh.display());

    // With room again, the run resumes from its last checkpoint and finishes.
    disk.remount(&format!("remount,size={}", size * 4));
    let o = env
        .cmd(&args(&["train", "--resume", "--no-progress", "--out", run.to_str().unwrap()]))
        .output()
        .unwrap();
    let log = common::ok(&o);
    assert!(log.contains("resum"), "{log}");
    assert!(run.join("summary.json").exists());

    // A read-only disk: the write fails naming the file, and leaves nothing.
    disk.remount("remount,ro");
    let o = env
        .cmd(&args(&["init", "--preset", "tiny", "--force", "--out", run.to_str().unwrap()]))
        .output()
        .unwrap();
    let err = text(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(&run.join("model.safetensors").display().to_string()), "{err}");
    assert!(err.contains("Read-only"), "{err}");
    assert_eq!(common::leftovers(&run), Vec::<PathBuf>::new());
}

/// A full disk without mounting one (no root, a container): under a file-size limit
/// (`ulimit -f`, with SIGXFSZ ignored so that the write fails with EFBIG instead of ending the
/// process) the first checkpoint's model does not fit. The error names the checkpoint, nothing
/// temporary is left, and the run — which saved nothing — starts again from step 0 when its
/// command is repeated with `--resume`, ending bit-identical to an undisturbed run.
#[test]
fn a_first_checkpoint_over_the_file_size_limit_fails_cleanly_and_the_run_restarts() {
    let env = &RunEnv::new(6_000, 2);
    let reference = env.path("reference");
    common::ok(&env.cmd(&train_args(env, &reference, 2)).output().unwrap());
    let model = std::fs::metadata(reference.join("ckpt/model.safetensors")).unwrap().len();
    let largest_other = ["tokenizer.json", "config.json", "ckpt/train_state.json"]
        .iter()
        .map(|f| std::fs::metadata(reference.join(f)).unwrap().len())
        .max()
        .unwrap();
    // The limit in blocks of 512 bytes (dash) or 1024 (bash): below the model either way, above
    // every file written before it (the token cache is reused from the reference run).
    let blocks = model / 2048;
    assert!(blocks * 512 > largest_other, "the model is too small for this test");

    let run = env.path("run");
    let o = Command::new("sh")
        .arg("-c")
        .arg(format!("ulimit -f {blocks} && trap '' XFSZ && exec \"$@\""))
        .arg("sh")
        .arg(env!("CARGO_BIN_EXE_attnres"))
        .args(train_args(env, &run, 2))
        .env("ATTNRES_CACHE", env.path("cache"))
        .output()
        .unwrap();
    let err = text(&o.stderr);
    let last = err.lines().last().unwrap_or("");
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        last.starts_with("error: ")
            && last.contains(&run.join("ckpt").display().to_string())
            && last.contains("File too large"),
        "the error names the checkpoint and the cause: {err}"
    );
    assert_eq!(common::leftovers(&run), Vec::<PathBuf>::new(), "temporary files left");
    assert!(!run.join("metrics.jsonl").exists(), "metrics without a checkpoint");

    let mut again = train_args(env, &run, 2);
    again.push("--resume".into());
    let log = common::ok(&env.cmd(&again).output().unwrap());
    assert!(log.contains("starting it again from step 0"), "{log}");
    assert_eq!(
        std::fs::read(run.join("model.safetensors")).unwrap(),
        std::fs::read(reference.join("model.safetensors")).unwrap()
    );
}
