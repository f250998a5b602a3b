//! `attnres compare` end to end on a few-step budget: every run trains, the report and its
//! summary agree with the runs, a comparison stopped in the middle of a run (by the binary's
//! test hook, at a chosen step) reuses the finished runs and resumes the interrupted one to the
//! same weights as an uninterrupted comparison, a directory holding other settings is
//! refused, and a comparison that failed on its data runs again with the data corrected.

mod common;

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

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

    // A second comparison (seed 0 only), stopped twice in the middle of a run and then run
    // again: the finished runs are reused, the interrupted ones resume from their checkpoints
    // and train their remaining steps, and every run ends with the weights of the
    // uninterrupted comparison above. The binary's test hook ATTNRES_TEST_ABORT_AT=0:STEP
    // makes the process abort as it starts step STEP of a run (rank 0 is the only process), as
    // a killed comparison would stop: in one process it fires in the first run to reach STEP.
    let out_b = tmp.path().join("interrupted");
    let args_b = args(&out_b, "1");
    let argv_b: Vec<&str> = args_b.iter().map(|s| s.as_str()).collect();
    let names = ["standard", "block", "full"];
    let runs: Vec<PathBuf> = names.iter().map(|v| out_b.join(format!("runs/{v}-seed0"))).collect();
    let steps_of = |run: &Path| -> Vec<u64> {
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap()["step"].as_u64().unwrap())
            .collect()
    };
    let stopped_at = |step: &str| {
        let o = command(&cache, &argv_b).env("ATTNRES_TEST_ABORT_AT", step).output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        assert!(!o.status.success(), "the comparison did not stop at step {step}: {err}");
        err
    };
    let finished = |r: &PathBuf| r.join("summary.json").exists();
    // Stopped as the first run (standard) starts step 5, after its checkpoint of step 4.
    stopped_at("0:5");
    assert_eq!(checkpoint_step(&runs[0]), Some(4));
    assert!(!runs.iter().any(finished), "no run finished");
    // Run again and stopped at step 3: the first run resumes after step 4 and finishes; the second
    // (block) stops as it starts step 3, after its checkpoint of step 2.
    let log = stopped_at("0:3");
    assert!(log.contains("resuming at step 4/8"), "{log}");
    assert_eq!(steps_of(&runs[0]), (1..=8).collect::<Vec<u64>>());
    assert!(finished(&runs[0]) && !finished(&runs[1]) && !finished(&runs[2]));
    assert_eq!(checkpoint_step(&runs[1]), Some(2));
    assert!(steps_of(&runs[1]).len() < 8, "the interrupted run had not finished");
    // Run to the end.
    let log = ok(attnres(&cache, &argv_b));
    assert_eq!(log.matches("finished earlier, reused").count(), 1, "{log}");
    assert!(log.contains("resuming at step 2/8"), "{log}");
    // The resumed run trained steps 3 ..= 8 itself.
    assert_eq!(steps_of(&runs[1]), (1..=8).collect::<Vec<u64>>());
    assert_eq!(read(&runs[1].join("summary.json"))["steps"], 8);
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

/// A comparison whose first run fails on its data (too short to hold out a validation split)
/// is run again with the data corrected: nothing it left counts as a started comparison.
#[test]
fn a_comparison_that_failed_on_its_data_runs_again_with_other_data() {
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let short = tmp.path().join("short.txt");
    std::fs::write(&short, "To be, or not to be.").unwrap();
    let data = tmp.path().join("corpus.txt");
    common::write_small_corpus(&data, 8_000);
    let out = tmp.path().join("report");
    let args = |data: &Path| -> Vec<String> {
        let head = ["compare", "--quick", "--no-progress"];
        let sets =
            ["vocab_size=300", "seq_len=32", "micro_batch=4", "batch_tokens=256", "max_tokens=512"];
        common::run_args(&head, &out, data, &sets)
    };
    fn argv(a: &[String]) -> Vec<&str> {
        a.iter().map(String::as_str).collect()
    }
    let bad = args(&short);
    let o = attnres(&cache, &argv(&bad));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("validation split is empty"), "{err}");
    let good = args(&data);
    let log = ok(attnres(&cache, &argv(&good)));
    assert!(log.contains("report:"), "{log}");
    assert!(out.join("runs/full-seed0/summary.json").exists());
}
