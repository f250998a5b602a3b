//! Helpers shared by the integration tests: small models, deterministic noise, a small corpus
//! and the float64 reference forward pass. Each test binary uses only some of them.
#![allow(dead_code)]

pub mod reference;
pub mod serve;

use attnres::model::{Config, Model, ResidualKind};
use std::path::Path;

/// A two-layer model small enough for finite differences.
pub fn tiny(residual: ResidualKind, num_blocks: usize) -> Config {
    Config {
        vocab_size: 11,
        hidden_size: 8,
        intermediate_size: 12,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 4,
        max_position_embeddings: 8,
        tie_word_embeddings: false,
        residual,
        num_blocks,
        ..Config::default()
    }
}

/// Deterministic pseudo-random values in [-1, 1).
pub fn noise(i: usize, salt: u64) -> f32 {
    let mut x = (i as u64).wrapping_mul(0x9E3779B97F4A7C15) ^ salt.wrapping_mul(0xD1B54A32D192ED03);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58476D1CE4E5B9);
    x ^= x >> 32;
    (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// A model with every parameter non-trivial, pseudo-queries included.
pub fn perturbed(cfg: Config) -> Model {
    let mut m = Model::init(cfg, 3).unwrap();
    for (i, p) in m.params.iter_mut().enumerate() {
        *p += 0.3 * noise(i, 1);
    }
    m
}

/// Copies every parameter the two models share by name.
pub fn copy_shared(from: &Model, to: &mut Model) {
    for s in &to.layout.specs.clone() {
        if let Some(f) = from.layout.spec(&s.name) {
            to.params[s.range.clone()].copy_from_slice(&from.params[f.range.clone()]);
        }
    }
}

/// Writes a small training corpus to `path`: the first `chars` characters of each of the first
/// twelve plays of the embedded corpus (many documents, fast to tokenize).
pub fn write_small_corpus(path: &Path, chars: usize) {
    let corpus = attnres::train::data::Corpus::embedded();
    let text = corpus.documents[..12]
        .iter()
        .map(|d| d.chars().take(chars).collect::<String>())
        .collect::<Vec<_>>()
        .join("\n\n\n");
    std::fs::write(path, text).unwrap();
}

/// A temporary directory with a small corpus (`corpus.txt`) and a token cache of its own, in
/// which the binary runs with a fixed thread count.
pub struct RunEnv {
    pub tmp: tempfile::TempDir,
    threads: usize,
}

impl RunEnv {
    /// `corpus_chars` characters of each of twelve plays (see [`write_small_corpus`]).
    pub fn new(corpus_chars: usize, threads: usize) -> RunEnv {
        let tmp = tempfile::tempdir().unwrap();
        write_small_corpus(&tmp.path().join("corpus.txt"), corpus_chars);
        RunEnv { tmp, threads }
    }

    pub fn path(&self, name: &str) -> std::path::PathBuf {
        self.tmp.path().join(name)
    }

    /// The binary with `args`, no stdin, this directory's token cache and thread count.
    pub fn cmd<S: AsRef<std::ffi::OsStr>>(&self, args: &[S]) -> std::process::Command {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_attnres"));
        c.args(args)
            .env("ATTNRES_CACHE", self.path("cache"))
            .args(["--threads", &self.threads.to_string()])
            .stdin(std::process::Stdio::null());
        c
    }

    pub fn run<S: AsRef<std::ffi::OsStr>>(&self, args: &[S]) -> std::process::Output {
        self.cmd(args).output().unwrap()
    }
}

/// `(step, train_loss, val_loss)` of every line of a run's `metrics.jsonl`.
pub fn losses(run: &Path) -> Vec<(u64, f64, Option<f64>)> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["step"].as_u64().unwrap(), v["train_loss"].as_f64().unwrap(), v["val_loss"].as_f64())
        })
        .collect()
}

/// Temporary files and directories a failed or killed write left anywhere below `dir`.
pub fn leftovers(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return found };
    for e in entries {
        let p = e.unwrap().path();
        if p.file_name().unwrap().to_string_lossy().contains(".tmp") {
            found.push(p.clone());
        }
        if p.is_dir() {
            found.extend(leftovers(&p));
        }
    }
    found
}

/// The stderr of a command that must have succeeded.
pub fn ok(o: &std::process::Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "command failed: {err}");
    err
}

/// Largest absolute value (0 for an empty slice).
pub fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |a, x| a.max(x.abs()))
}

/// A JSON array of rows of token ids (a fixture's `input_ids` or `targets`), flattened.
pub fn id_rows(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32))
        .collect()
}

/// Command-line arguments: `head`, then `--out out --data data`, then `--set s` for each setting.
pub fn run_args(head: &[&str], out: &Path, data: &Path, sets: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = head.iter().map(|s| s.to_string()).collect();
    for (flag, p) in [("--out", out), ("--data", data)] {
        v.push(flag.into());
        v.push(p.to_string_lossy().into_owned());
    }
    for s in sets {
        v.push("--set".into());
        v.push(s.to_string());
    }
    v
}

/// Trains the `tiny` preset on the environment's corpus into the run directory `name`, with
/// `sets` on top; panics if training fails.
pub fn train_tiny(env: &RunEnv, name: &str, sets: &[&str]) -> std::path::PathBuf {
    let run = env.path(name);
    let args = run_args(
        &["train", "--preset", "tiny", "--no-progress"],
        &run,
        &env.path("corpus.txt"),
        sets,
    );
    ok(&env.run(&args));
    run
}

/// Makes a character device `major:minor` at `path` with `mknod` (1:3 a null device, 1:7 a full
/// one), so that a test writes to a device of its own, never to the machine's. Needs root, as
/// CI has.
pub fn make_device(path: &Path, major: u32, minor: u32) {
    let made = std::process::Command::new("mknod")
        .arg(path)
        .arg("c")
        .arg(major.to_string())
        .arg(minor.to_string())
        .status();
    assert!(made.is_ok_and(|s| s.success()), "mknod failed (the test needs root, as CI has)");
}

/// The body of an HTTP/1.1 response sent in chunked transfer encoding.
pub fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap();
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}
