//! `attnres compare`: trains the runs of a plan ([`crate::suite`]: by default `standard`,
//! `block` and `full`) with identical data order, token budget and hyperparameters, for one or
//! several seeds, then writes the report ([`crate::report`]).
//!
//! The report directory holds `compare.json` (what was asked), `runs/<variant>-seed<k>/` (one
//! training run each) and the report itself. Finished runs are reused and interrupted ones
//! resumed, so running the same command again continues where it stopped; a run trained with
//! other settings is an error, never silently reused.

use crate::base::fs::write_atomic;
use crate::base::progress::{log, new_progress_bar, SharedBar};
use crate::base::version::CodeVersion;
use crate::experiments::suite::{Plan, PLAN};
use crate::train::config::{first_difference, lookup, RunConfig};
use crate::train::data::Corpus;
use crate::train::run::{self, TrainOptions};
use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// Where the report directory is, and whether to draw a progress bar.
pub struct CompareOptions {
    pub out: PathBuf,
    pub progress: bool,
    /// Where every run trains (not a setting of the comparison: runs resume on either).
    pub device: run::Hardware,
}

/// What to do with one run directory.
#[derive(Debug, PartialEq)]
enum Status {
    Done,
    Resume,
    Fresh,
}

fn status(dir: &Path, want: &RunConfig) -> Result<Status> {
    let state = [dir.join("ckpt"), dir.join(".ckpt.old")]
        .into_iter()
        .map(|d| d.join("train_state.json"))
        .find(|p| p.exists());
    let Some(state) = state else { return Ok(Status::Fresh) };
    let text = std::fs::read_to_string(&state)
        .with_context(|| format!("cannot read {}", state.display()))?;
    let v: Value =
        serde_json::from_str(&text).with_context(|| format!("{} is corrupt", state.display()))?;
    let have = v
        .get("run")
        .cloned()
        .with_context(|| format!("{} has no run settings", state.display()))?;
    // Through the settings type, so that keys added since the run was trained take their defaults.
    let have: RunConfig = serde_json::from_value(have)
        .with_context(|| format!("{}: unreadable run settings", state.display()))?;
    let (mut have, mut want) = (serde_json::to_value(have)?, serde_json::to_value(want)?);
    // The vocabulary size comes from the tokenizer, not from the request.
    for v in [&mut have, &mut want] {
        v["model"]["vocab_size"] = Value::Null;
    }
    if let Some(key) = first_difference(&have, &want, "") {
        bail!(
            "{} was trained with other settings ({key}: {} there, {} asked); use another --out, or delete that run",
            dir.display(),
            lookup(&have, &key),
            lookup(&want, &key)
        );
    }
    Ok(if dir.join("summary.json").exists() && dir.join("diagnostics.json").exists() {
        Status::Done
    } else {
        Status::Resume
    })
}

/// The version of the code that finished a run, when it is not this one.
fn other_version(dir: &Path) -> Option<String> {
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).ok()?).ok()?;
    let current = CodeVersion::current();
    match serde_json::from_value::<CodeVersion>(summary["code_version"].clone()) {
        Ok(v) if v == current => None,
        Ok(v) => Some(format!("attnres {v} (this is {current})")),
        Err(_) => {
            Some(format!("a version of attnres that did not record itself (this is {current})"))
        }
    }
}

/// Refuses a report directory whose `compare.json` asks for other settings (more seeds are
/// allowed), unless none of its runs has saved anything to keep: such a plan is simply
/// replaced (a comparison whose first run failed, on bad data say, is run again as corrected).
fn check_existing_plan(out: &Path, plan: &Plan) -> Result<()> {
    if !out.join(PLAN).exists() {
        return Ok(());
    }
    let runs = out.join("runs");
    let started = match std::fs::read_dir(&runs) {
        // A run has something to keep once it wrote a checkpoint or finished.
        Ok(entries) => entries.filter_map(|e| e.ok()).any(|e| {
            ["ckpt", ".ckpt.old", "summary.json"].iter().any(|f| e.path().join(f).exists())
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", runs.display())),
    };
    if !started {
        return Ok(());
    }
    let old = Plan::load(out)?;
    let differs = if old.suite != plan.suite || old.variants != plan.variants {
        format!(
            "suite {:?} with variants {:?}",
            old.suite,
            old.variants.iter().map(|v| &v.name).collect::<Vec<_>>()
        )
    } else if old.data != plan.data {
        let data = |d: &Option<std::path::PathBuf>| {
            d.as_ref().map_or("the embedded corpus".to_string(), |p| p.display().to_string())
        };
        format!("data {}, not {}", data(&old.data), data(&plan.data))
    } else if old.base != plan.base {
        let (have, want) = (serde_json::to_value(&old.base)?, serde_json::to_value(&plan.base)?);
        let key = first_difference(&have, &want, "").unwrap_or_default();
        format!("{key}: {} there, {} asked", lookup(&have, &key), lookup(&want, &key))
    } else {
        return Ok(());
    };
    bail!(
        "{} holds a comparison with other settings ({differs}); use another --out, or delete it",
        out.display()
    )
}

/// Trains every run of the plan that is not finished yet, then writes the report.
pub fn run(plan: &Plan, opts: &CompareOptions) -> Result<()> {
    ensure!(plan.seeds > 0, "--seeds must be at least 1");
    ensure!(!plan.variants.is_empty(), "nothing to compare");
    let out = &opts.out;
    let plan_path = out.join(PLAN);
    check_existing_plan(out, plan)?;
    // Everything is validated before anything is trained.
    let mut jobs = Vec::new();
    for seed in 0..plan.seeds {
        for v in &plan.variants {
            let cfg = plan.run_config(v, seed)?;
            cfg.model.validate().with_context(|| format!("variant {}", v.name))?;
            cfg.train.validate(&cfg.model).with_context(|| format!("variant {}", v.name))?;
            let dir = Plan::run_dir(out, &v.name, seed);
            let st = status(&dir, &cfg)?;
            jobs.push((v.name.clone(), seed, cfg, dir, st));
        }
    }
    // The data too, so that a mistyped --data leaves nothing behind, and the GPU.
    if let Some(data) = &plan.data {
        Corpus::from_path(data)?;
    }
    if let run::Hardware::Cuda(_) = opts.device {
        crate::gpu::device::Device::open(0)?;
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    write_atomic(&plan_path, serde_json::to_string_pretty(plan)?.as_bytes())?;

    let total: u64 = jobs.iter().map(|j| j.2.train.steps() as u64).sum();
    let bar = if opts.progress { new_progress_bar(total) } else { None };
    let mut offset = 0u64;
    let n = jobs.len();
    for (i, (name, seed, cfg, dir, st)) in jobs.into_iter().enumerate() {
        let steps = cfg.train.steps() as u64;
        let label = format!("[{}/{n}] {name} seed {seed}", i + 1);
        if st == Status::Done {
            let line = format!(
                "{label}: finished earlier{}, reused ({})",
                other_version(&dir).map(|v| format!(" by {v}")).unwrap_or_default(),
                dir.display()
            );
            match &bar {
                Some(b) => b.println(line),
                None => log(&line),
            }
        } else {
            let train_opts = TrainOptions {
                out: dir.clone(),
                data: plan.data.clone(),
                tokenizer: None,
                init: None,
                resume: st == Status::Resume,
                overwrite: st == Status::Fresh,
                progress: opts.progress,
                shared_bar: bar.as_ref().map(|b| SharedBar {
                    bar: b.clone(),
                    offset,
                    label: label.clone(),
                }),
                device: opts.device,
            };
            if bar.is_none() {
                log(&label);
            }
            run::train((st == Status::Fresh).then_some(cfg), &train_opts)
                .with_context(|| format!("run {}", dir.display()))?;
        }
        offset += steps;
        if let Some(b) = &bar {
            b.set_position(offset);
        }
    }
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let page = crate::experiments::report::write(out)?;
    log(&format!("report: {}", page.display()));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A comparison trains on the device it is given: a small run on the emulated GPU beside
    /// the same on the CPU, their validation losses within 0.02 nats but not the same bits
    /// (the GPU's kernels sum in other orders); and one asked of a GPU this machine lacks
    /// fails before it writes anything.
    #[test]
    fn a_comparison_runs_on_the_device_it_is_given() {
        use crate::experiments::suite::Variant;
        use crate::gpu::{device::Device, Precision};
        if Device::emulated("a_comparison_runs_on_the_device_it_is_given").is_none() {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let budget = ["max_tokens=2560", "eval_every=5", "eval_tokens=512"];
        let sets = crate::testutil::EMULATED_RUN.iter().copied().chain(budget);
        let sets: Vec<String> = sets.map(String::from).collect();
        let base = crate::experiments::suite::base(true).unwrap().with_overrides(&sets).unwrap();
        let block = ["residual=block", "num_blocks=2"].map(String::from).to_vec();
        let variants = vec![Variant { name: "block".into(), sets: block, baseline: None }];
        let plan = Plan { suite: "residuals".into(), base, variants, seeds: 1, data: None };
        let compare = |dir: &str, device| {
            let out = tmp.path().join(dir);
            run(&plan, &CompareOptions { out: out.clone(), progress: false, device })?;
            let metrics = Plan::run_dir(&out, "block", 0).join("metrics.jsonl");
            let text = std::fs::read_to_string(metrics)?;
            let mut losses = text
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok()?.get("val_loss")?.as_f64());
            Ok::<_, anyhow::Error>(losses.next_back().expect("a validation"))
        };
        let cpu = compare("cpu", run::Hardware::Cpu).unwrap();
        let gpu = compare("gpu", run::Hardware::Emulated(Precision::Fp32)).unwrap();
        assert!((cpu - gpu).abs() <= 0.02 && cpu != gpu, "{cpu} on the CPU, {gpu} on the GPU");
        if crate::gpu::driver::gpus().is_err() {
            let e = compare("cuda", run::Hardware::Cuda(Precision::Fp32)).unwrap_err();
            assert!(e.to_string().contains("driver"), "{e:#}");
            assert!(!tmp.path().join("cuda").exists(), "a comparison that cannot run wrote");
        }
    }

    #[test]
    fn differences_are_named() {
        let a = serde_json::json!({"model": {"x": 1, "y": 2}, "train": {"lr": 0.1}});
        let b = serde_json::json!({"model": {"x": 1, "y": 3}, "train": {"lr": 0.1}});
        assert_eq!(first_difference(&a, &b, "").as_deref(), Some("model.y"));
        assert_eq!(first_difference(&a, &a, ""), None);
    }

    /// A run trained before a setting existed is the same run when the setting has its default;
    /// a run with another value is refused, naming the key.
    #[test]
    fn status_fills_new_settings_with_defaults() {
        let tmp = std::env::temp_dir().join(format!("attnres-status-{}", std::process::id()));
        std::fs::create_dir_all(tmp.join("ckpt")).unwrap();
        let want = crate::experiments::suite::base(true).unwrap();
        let mut run = serde_json::to_value(&want).unwrap();
        run["model"].as_object_mut().unwrap().retain(|k, _| !k.starts_with("attn_res_"));
        let write = |run: &Value| {
            std::fs::write(
                tmp.join("ckpt/train_state.json"),
                serde_json::json!({ "run": run }).to_string(),
            )
            .unwrap()
        };
        write(&run);
        assert_eq!(status(&tmp, &want).unwrap(), Status::Resume);
        run["train"]["lr"] = serde_json::json!(0.5);
        write(&run);
        let e = status(&tmp, &want).unwrap_err().to_string();
        assert!(e.contains("train.lr"), "{e}");
        std::fs::remove_dir_all(&tmp).unwrap();
    }

    /// A plan none of whose runs has saved anything is replaced by another (a run directory
    /// that a failed first run left, without a checkpoint, does not count); once a run has a
    /// checkpoint, other settings are refused, naming what differs.
    #[test]
    fn a_plan_without_runs_is_replaced() {
        let tmp = tempfile::tempdir().unwrap();
        let base = crate::experiments::suite::base(true).unwrap();
        let variants = crate::experiments::suite::suite("residuals", &base).unwrap();
        let old = Plan {
            suite: "residuals".into(),
            base,
            variants,
            seeds: 1,
            data: Some("mistyped.txt".into()),
        };
        std::fs::write(tmp.path().join(PLAN), serde_json::to_string(&old).unwrap()).unwrap();
        let new = Plan { data: Some("corpus.txt".into()), ..old.clone() };
        check_existing_plan(tmp.path(), &new).unwrap();
        std::fs::create_dir_all(tmp.path().join("runs/standard-seed0")).unwrap();
        check_existing_plan(tmp.path(), &new).unwrap();
        std::fs::create_dir_all(tmp.path().join("runs/standard-seed0/ckpt")).unwrap();
        let e = check_existing_plan(tmp.path(), &new).unwrap_err().to_string();
        assert!(e.contains("other settings (data mistyped.txt, not corpus.txt)"), "{e}");
        let mut lr = old.clone();
        lr.base.train.optim.lr = 0.5;
        let e = check_existing_plan(tmp.path(), &lr).unwrap_err().to_string();
        assert!(e.contains("train.lr"), "{e}");
        check_existing_plan(tmp.path(), &Plan { seeds: 3, ..old }).unwrap();
    }

    /// A reused run names the version that made it when it is not this one.
    #[test]
    fn reused_runs_of_another_version_are_named() {
        let tmp = std::env::temp_dir().join(format!("attnres-version-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        let write = |v: Value| std::fs::write(tmp.join("summary.json"), v.to_string()).unwrap();
        write(serde_json::json!({ "code_version": CodeVersion::current() }));
        assert_eq!(other_version(&tmp), None);
        let old = CodeVersion { package: "0.0.9".into(), commit: Some("0123456789abcdef".into()) };
        write(serde_json::json!({ "code_version": old }));
        let said = other_version(&tmp).unwrap();
        assert!(said.starts_with("attnres 0.0.9 (commit 0123456789ab) (this is "), "{said}");
        write(serde_json::json!({ "val_loss": 4.0 }));
        assert!(other_version(&tmp).unwrap().contains("did not record"));
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
