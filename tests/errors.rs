//! Errors of the command line: argument errors, a mistyped `--data` for `compare` and a broken
//! `compare.json` are one `error:` line naming the problem, exit code 1, never a panic.

use std::path::Path;
use std::process::{Command, Output};

fn attnres(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_attnres")).args(args).output().expect("binary runs")
}

/// A failure with exit code 1 and exactly one line, `error: ...`, holding every one of `needles`.
fn fails(args: &[&str], needles: &[&str]) {
    let o = attnres(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "attnres {args:?}: {err}");
    assert!(err.starts_with("error: ") && err.lines().count() == 1, "attnres {args:?}: {err:?}");
    for n in needles {
        assert!(err.contains(n), "attnres {args:?}: expected {n:?} in {err:?}");
    }
}

#[test]
fn argument_errors_are_one_line_and_exit_1() {
    fails(&["--bogus"], &["--bogus", "attnres --help"]);
    fails(&["frobnicate"], &["frobnicate", "attnres --help"]);
    fails(&["compare", "--out", "x", "--seeds", "many"], &["--seeds", "many", "--help"]);
    fails(&["eval", "--text", "t.txt"], &["--model", "--help"]);
    fails(&[], &["no command given", "--help"]);
    for flag in ["--help", "--version"] {
        let o = attnres(&[flag]);
        assert!(o.status.success() && !o.stdout.is_empty() && o.stderr.is_empty(), "{flag}");
    }
    let o = attnres(&["train", "--help"]);
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("--data"));
}

/// A mistyped `--data` is refused before the report directory is written, so the corrected
/// command runs there.
#[test]
fn compare_with_a_missing_data_path_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("report");
    let data = tmp.path().join("corpsu.txt");
    let (out_s, data_s) = (out.to_str().unwrap(), data.to_str().unwrap());
    fails(&["compare", "--quick", "--out", out_s, "--data", data_s, "--no-progress"], &[data_s]);
    assert!(!out.join("compare.json").exists(), "compare.json was written");
}

/// `report` on a directory whose plan is empty, truncated or inconsistent.
#[test]
fn report_with_a_broken_plan_names_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let plan = dir.join("compare.json");
    let plan_s = plan.display().to_string();
    let write = |text: &str| std::fs::write(&plan, text).unwrap();
    let report = |dir: &Path| fails(&["report", dir.to_str().unwrap()], &[&plan_s]);
    write("");
    report(dir);
    write("{\"suite\": \"residuals\", \"base\"");
    report(dir);
    write("[]");
    report(dir);
    // Well-formed, but nothing to report on.
    let base = attnres::experiments::suite::base(true).unwrap();
    let empty = attnres::experiments::suite::Plan {
        suite: "residuals".into(),
        base,
        variants: vec![],
        seeds: 1,
        data: None,
    };
    write(&serde_json::to_string(&empty).unwrap());
    report(dir);
    std::fs::remove_file(&plan).unwrap();
    report(dir);
}

/// `--device cuda` where the machine has no NVIDIA driver: one line naming the missing library,
/// before anything is written (the GPU is opened before a run directory is made). Work that
/// runs only on the CPU is refused with `--device cuda` wherever it runs.
#[test]
fn asking_for_a_gpu_without_one_is_one_line() {
    fails(
        &["bench", "--generate", "--device", "cuda", "--preset", "tiny"],
        &["--generate", "--device cuda"],
    );
    let device = attnres(&["device"]);
    let report = String::from_utf8_lossy(&device.stdout);
    if !report.contains("no NVIDIA driver") {
        eprintln!("skipped the no-driver errors: this machine has an NVIDIA driver");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let out_s = out.to_str().unwrap();
    fails(&["train", "--device", "cuda", "--preset", "tiny", "--out", out_s], &["libcuda.so.1"]);
    assert!(!out.exists(), "train wrote {out_s} without a GPU");
    fails(&["bench", "--device", "cuda", "--preset", "tiny", "--steps", "1"], &["libcuda.so.1"]);
    let report = tmp.path().join("report");
    let report_s = report.to_str().unwrap();
    fails(&["compare", "--device", "cuda", "--quick", "--out", report_s], &["libcuda.so.1"]);
    assert!(!report.exists(), "compare wrote {report_s} without a GPU");
}
