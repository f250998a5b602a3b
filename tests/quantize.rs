//! `attnres quantize` on a model trained here: the quantised checkpoints evaluate close to the
//! original, generate and serve like any model, and are refused where f32 weights are needed.

mod common;

use common::RunEnv;
use std::path::{Path, PathBuf};

/// A short Block AttnRes run (`tiny`: hidden 64, whole blocks of 32; its intermediate size of
/// 176 is not, so down_proj stays f32).
fn trained(env: &RunEnv) -> PathBuf {
    let sets =
        ["vocab_size=400", "seq_len=64", "micro_batch=4", "batch_tokens=512", "max_tokens=20480"];
    common::train_tiny(env, "run", &sets)
}

fn eval_loss(env: &RunEnv, model: &Path) -> f64 {
    let o = env.run(&[
        "eval",
        "--model",
        model.to_str().unwrap(),
        "--text",
        env.path("corpus.txt").to_str().unwrap(),
        "--json",
    ]);
    common::ok(&o);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    v["loss"].as_f64().unwrap()
}

fn fails(o: &std::process::Output, needle: &str) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains(needle), "expected {needle:?} in: {err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn quantised_models_stay_close_run_and_refuse_training() {
    let env = &RunEnv::new(20_000, 2);
    let run = trained(env);
    let f32_loss = eval_loss(env, &run);
    let runs = run.to_str().unwrap();
    // F16 moves the loss by a hundredth of a percent, Q8_0 by well under a percent, the 4-bit
    // formats by a few.
    for (to, tolerance) in [("f16", 1e-4), ("q8_0", 0.005), ("q4_0", 0.05), ("q4_1", 0.05)] {
        let out = env.path(to);
        let o =
            env.run(&["quantize", "--model", runs, "--dtype", to, "--out", out.to_str().unwrap()]);
        let err = common::ok(&o);
        assert!(err.contains("quantised") && err.contains("carried over: tokenizer.json"), "{err}");
        let loss = eval_loss(env, &out);
        let change = (loss / f32_loss - 1.0).abs();
        assert!(change <= tolerance, "{to}: loss {loss} against {f32_loss}");
        assert!(change > 0.0, "{to}: the quantised products ran");
        let o = env.run(&[
            "generate",
            "--model",
            out.to_str().unwrap(),
            "--prompt",
            "The",
            "--max-tokens",
            "8",
        ]);
        common::ok(&o);
        assert!(String::from_utf8_lossy(&o.stdout).starts_with("The"));
    }
    let q8 = env.path("q8_0");
    let q8s = q8.to_str().unwrap();
    // Where f32 weights are needed, or the output is the input: refused, nothing written.
    let again = env.path("again");
    // `--to`: the older name of `--dtype`, still taken.
    let o =
        env.run(&["quantize", "--model", q8s, "--to", "q4_0", "--out", again.to_str().unwrap()]);
    fails(&o, "already quantised");
    assert!(!again.exists());
    let o = env.run(&["quantize", "--model", runs, "--dtype", "q8_0", "--out", runs, "--force"]);
    fails(&o, "--model");
    let o = env.run(&[
        "quantize",
        "--model",
        runs,
        "--dtype",
        "q3_k",
        "--out",
        again.to_str().unwrap(),
    ]);
    fails(&o, "q3_k");
    assert!(!again.exists());
    let o = env.run(&[
        "convert",
        "--model",
        q8s,
        "--set",
        "residual=full",
        "--out",
        again.to_str().unwrap(),
    ]);
    fails(&o, "is quantised");
    let args = common::run_args(
        &["train", "--init", q8s, "--no-progress"],
        &env.path("tuned"),
        &env.path("corpus.txt"),
        &["max_tokens=2048", "seq_len=64", "micro_batch=4", "batch_tokens=512"],
    );
    fails(&env.run(&args), "the model is quantised, and training needs f32 weights");
    assert!(!again.exists());
}
