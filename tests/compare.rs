//! `attnres compare` end to end on a few-step budget: every run trains, the report and its
//! summary agree with the runs, a second invocation reuses finished runs and resumes an
//! interrupted one, and a directory holding other settings is refused.

use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

fn attnres(cache: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_attnres"))
        .args(args)
        .env("ATTNRES_CACHE", cache)
        .arg("--threads")
        .arg("2")
        .output()
        .unwrap()
}

fn ok(o: Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "command failed: {err}");
    err
}

fn read(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn compare_trains_reports_and_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let corpus = attnres::train::data::Corpus::embedded();
    let text = corpus.documents[..12]
        .iter()
        .map(|d| d.chars().take(8_000).collect::<String>())
        .collect::<Vec<_>>()
        .join("\n\n\n");
    let data = tmp.path().join("corpus.txt");
    std::fs::write(&data, text).unwrap();
    let out = tmp.path().join("report");
    let cache = tmp.path().join("cache");
    let mut args: Vec<String> = ["compare", "--quick", "--seeds", "2", "--no-progress", "--out"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.push(out.to_string_lossy().into());
    args.push("--data".into());
    args.push(data.to_string_lossy().into());
    for s in [
        "vocab_size=300",
        "seq_len=32",
        "micro_batch=4",
        "batch_tokens=256",
        "max_tokens=1024",
        "eval_every=2",
        "eval_tokens=256",
        "checkpoint_every=2",
        "warmup_steps=1",
    ] {
        args.push("--set".into());
        args.push(s.into());
    }
    let argv: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
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

    // Interrupt one run (as if killed before it finished), then run the same command again.
    let run = out.join("runs/full-seed1");
    let weights = std::fs::read(run.join("model.safetensors")).unwrap();
    std::fs::remove_file(run.join("summary.json")).unwrap();
    let log = ok(attnres(&cache, &argv));
    assert_eq!(log.matches("finished earlier, reused").count(), 5, "{log}");
    assert!(log.contains("resuming at step 4/4"), "{log}");
    assert_eq!(
        std::fs::read(run.join("model.safetensors")).unwrap(),
        weights,
        "the resumed run is the same run"
    );
    assert!(run.join("summary.json").exists());

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
