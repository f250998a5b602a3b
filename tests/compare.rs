//! `attnres compare` end to end on a few-step budget: every run trains, the report and its
//! summary agree with the runs, a comparison killed in the middle of a run reuses the finished
//! runs and resumes the interrupted one to the same weights as an uninterrupted comparison,
//! and a directory holding other settings is refused.

mod common;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn command(cache: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_attnres"));
    c.args(args).env("ATTNRES_CACHE", cache).arg("--threads").arg("2");
    c
}

fn attnres(cache: &Path, args: &[&str]) -> Output {
    command(cache, args).output().unwrap()
}

fn ok(o: Output) -> String {
    common::ok(&o)
}

/// The step of a run's latest resumable checkpoint, if it has one.
fn checkpoint_step(run: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(run.join("ckpt/train_state.json")).ok()?;
    serde_json::from_str::<Value>(&text).ok()?["step"].as_u64()
}

fn read(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn compare_trains_reports_and_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("corpus.txt");
    common::write_small_corpus(&data, 8_000);
    let cache = tmp.path().join("cache");
    // Eight steps per run, a checkpoint every two: room to kill a run in its middle.
    let args = |out: &Path, seeds: &str| -> Vec<String> {
        let head = ["compare", "--quick", "--seeds", seeds, "--no-progress"];
        let sets = [
            "vocab_size=300",
            "seq_len=32",
            "micro_batch=4",
            "batch_tokens=256",
            "max_tokens=2048",
            "eval_every=4",
            "eval_tokens=256",
            "checkpoint_every=2",
            "warmup_steps=1",
        ];
        common::run_args(&head, out, &data, &sets)
    };
    let out = tmp.path().join("report");
    let args_a = args(&out, "2");
    let argv: Vec<&str> = args_a.iter().map(|s| s.as_str()).collect();
    ok(attnres(&cache, &argv));

    for f in [
        "index.html",
        "summary.json",
        "compare.json",
        "loss.svg",
        "rms.svg",
        "grads.svg",
        "alpha-block.svg",
        "alpha-full.svg",
    ] {
        assert!(out.join(f).exists(), "{f} missing");
    }
    assert!(!out.join("alpha-standard.svg").exists(), "the standard residual has no depth weights");
    let summary = read(&out.join("summary.json"));
    let rows = summary["variants"].as_array().unwrap();
    assert_eq!(
        rows.iter().map(|r| r["name"].as_str().unwrap()).collect::<Vec<_>>(),
        ["standard", "block", "full"]
    );
    // Every run records the code that made it, and the report lists it once.
    let head = std::process::Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    for v in ["standard", "block", "full"] {
        let run = read(&out.join(format!("runs/{v}-seed0/summary.json")));
        let version = &run["code_version"];
        assert_eq!(version["package"], env!("CARGO_PKG_VERSION"), "{v}");
        if let Some(head) = &head {
            assert_eq!(version["commit"].as_str(), Some(head.as_str()), "{v}");
        }
        assert_eq!(run["trained_by"], serde_json::json!([version]), "{v}");
    }
    assert_eq!(summary["code_versions"].as_array().map(|a| a.len()), Some(1));
    // The table is the runs' own numbers: mean and paired difference over the two seeds.
    let loss = |v: &str, s: usize| {
        read(&out.join(format!("runs/{v}-seed{s}/summary.json")))["val_loss"].as_f64().unwrap()
    };
    for r in rows {
        let v = r["name"].as_str().unwrap();
        assert_eq!(r["seeds_finished"], 2);
        let mean = (loss(v, 0) + loss(v, 1)) / 2.0;
        assert!((r["val_loss"]["mean"].as_f64().unwrap() - mean).abs() < 1e-12, "{v}");
        if v != "standard" {
            let d = (loss(v, 0) - loss("standard", 0) + loss(v, 1) - loss("standard", 1)) / 2.0;
            assert!(
                (r["val_loss_minus_baseline"]["mean"].as_f64().unwrap() - d).abs() < 1e-12,
                "{v}"
            );
        }
    }
    // Seeds differ in initialisation and data order, so their losses differ.
    assert_ne!(loss("block", 0), loss("block", 1));
    let diag = read(&out.join("runs/block-seed0/diagnostics.json"));
    assert_eq!(diag["output_rms"].as_array().unwrap().len(), 8, "tiny model: 8 sublayers");
    assert_eq!(diag["alpha"].as_array().unwrap().len(), 9, "8 sublayers and the output");
    let metrics = std::fs::read_to_string(out.join("runs/full-seed1/metrics.jsonl")).unwrap();
    let first: Value = serde_json::from_str(metrics.lines().next().unwrap()).unwrap();
    assert_eq!(first["sublayer_grad_norms"].as_array().unwrap().len(), 8);

    // A second comparison (seed 0 only) killed while one of its runs is between two
    // checkpoints after its first (every run also checkpoints step 0), then run again: the finished runs are reused, the interrupted one resumes
    // from its checkpoint and trains its remaining steps, and every run ends with the weights
    // of the uninterrupted comparison above.
    let out_b = tmp.path().join("interrupted");
    let args_b = args(&out_b, "1");
    let argv_b: Vec<&str> = args_b.iter().map(|s| s.as_str()).collect();
    let names = ["standard", "block", "full"];
    let runs: Vec<PathBuf> = names.iter().map(|v| out_b.join(format!("runs/{v}-seed0"))).collect();
    let mut child = command(&cache, &argv_b).stderr(Stdio::null()).spawn().unwrap();
    let t = Instant::now();
    let in_flight = |r: &PathBuf| {
        checkpoint_step(r).is_some_and(|s| s > 0 && s < 8) && !r.join("summary.json").exists()
    };
    while !runs.iter().any(in_flight) && t.elapsed() < Duration::from_secs(120) {
        std::thread::sleep(Duration::from_millis(2));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let cut = runs.iter().position(in_flight).expect(
        "no run was caught between checkpoints: the comparison finished first; the test needs \
         longer runs",
    );
    let at = checkpoint_step(&runs[cut]).unwrap();
    assert!(at > 0 && at < 8);
    let before = std::fs::read_to_string(runs[cut].join("metrics.jsonl")).unwrap();
    assert!(before.lines().count() < 8, "the interrupted run had not finished");
    let log = ok(attnres(&cache, &argv_b));
    assert_eq!(log.matches("finished earlier, reused").count(), cut, "{log}");
    assert!(log.contains(&format!("resuming at step {at}/8")), "{log}");
    // The resumed run trained steps `at + 1 ..= 8` itself.
    let steps: Vec<u64> = std::fs::read_to_string(runs[cut].join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["step"].as_u64().unwrap())
        .collect();
    assert_eq!(steps, (1..=8).collect::<Vec<u64>>());
    assert_eq!(read(&runs[cut].join("summary.json"))["steps"], 8);
    for (v, run) in names.iter().zip(&runs) {
        assert_eq!(
            std::fs::read(run.join("model.safetensors")).unwrap(),
            std::fs::read(out.join(format!("runs/{v}-seed0/model.safetensors"))).unwrap(),
            "{v}: the interrupted comparison ends with other weights"
        );
    }

    // Other settings in the same directory are refused before anything is touched.
    let mut other = argv.clone();
    other.push("--set");
    other.push("lr=0.5");
    let o = attnres(&cache, &other);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("other settings"), "{err}");
    let o = attnres(&cache, &["report", tmp.path().to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("a report directory?"), "{err}");
}
