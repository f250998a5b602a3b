//! `attnres compare`: trains the variants of a suite (by default `standard`, `block` and `full`)
//! with identical data order, token budget and hyperparameters, for one or several seeds, then
//! writes the report ([`crate::report`]).
//!
//! The report directory holds `compare.json` (what was asked), `runs/<variant>-seed<k>/` (one
//! training run each) and the report itself. Finished runs are reused and interrupted ones
//! resumed, so running the same command again continues where it stopped; a run trained with
//! other settings is an error, never silently reused.

use crate::train::run::{self, RunConfig, SharedBar, TrainOptions};
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::{Path, PathBuf};

/// One arm of a comparison: a name and the settings it changes.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Variant {
    pub name: String,
    pub sets: Vec<String>,
    /// The variant this one is compared with (none: the suite's first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline: Option<String>,
}

impl Variant {
    pub fn new(name: &str, sets: &[&str]) -> Variant {
        Variant {
            name: name.into(),
            sets: sets.iter().map(|s| s.to_string()).collect(),
            baseline: None,
        }
    }
}

/// What a report directory was asked to hold (`compare.json`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Plan {
    /// Suite name, shown in the report's title.
    pub suite: String,
    /// Settings shared by every run, before each variant's own.
    pub base: RunConfig,
    /// The first variant is the baseline the others are compared with.
    pub variants: Vec<Variant>,
    pub seeds: usize,
    /// `--data` (none: the embedded corpus).
    pub data: Option<PathBuf>,
}

pub const PLAN: &str = "compare.json";

impl Plan {
    /// The run directory of a variant and seed.
    pub fn run_dir(out: &Path, variant: &str, seed: usize) -> PathBuf {
        out.join("runs").join(format!("{variant}-seed{seed}"))
    }

    /// The settings of one run: the base, the variant's changes, then the seed.
    pub fn run_config(&self, v: &Variant, seed: usize) -> Result<RunConfig> {
        let mut sets = v.sets.clone();
        sets.push(format!("seed={}", self.base.train.seed + seed as u64));
        self.base.with_overrides(&sets).with_context(|| format!("variant {}", v.name))
    }

    pub fn load(out: &Path) -> Result<Plan> {
        let path = out.join(PLAN);
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!("cannot read {} (is {} a report directory?)", path.display(), out.display())
        })?;
        serde_json::from_str(&text).with_context(|| format!("{} is corrupt", path.display()))
    }
}

/// The settings every run of a comparison starts from: the `compare` preset, or
/// `compare-quick` for `--quick`.
pub fn base(quick: bool) -> Result<RunConfig> {
    crate::presets::run_config(if quick { "compare-quick" } else { "compare" })
}

/// The variants of a named suite over `base`: `residuals` (the main comparison), `ablations`
/// (SPEC §5) or `block-sizes` (the block-size sweep, S from L down to 1).
pub fn suite(name: &str, base: &RunConfig) -> Result<Vec<Variant>> {
    let l = base.model.sublayers();
    let variants = match name {
        "residuals" => vec![
            Variant::new("standard", &["residual=standard"]),
            Variant::new("block", &["residual=block"]),
            Variant::new("full", &["residual=full"]),
        ],
        "block-sizes" => {
            let mut v = vec![Variant::new("standard", &["residual=standard"])];
            let mut n = 1;
            while n <= l {
                let s = l / n;
                let name =
                    if n == l { "full (S=1)".to_string() } else { format!("block S={s} (N={n})") };
                v.push(Variant {
                    name: slug(&name),
                    sets: vec!["residual=block".into(), format!("num_blocks={n}")],
                    baseline: None,
                });
                n *= 2;
            }
            v
        }
        "ablations" => crate::presets::ablations(&base.model),
        "scaling" => scaling_variants(base, SCALING_TOKENS_PER_PARAMETER)?,
        other => {
            bail!("unknown suite {other:?} (available: residuals, ablations, block-sizes, scaling)")
        }
    };
    Ok(variants)
}

/// The scaling suite's model shapes (layers, hidden): four sizes, from 0.1M to 0.9M
/// non-embedding parameters, deeper as they widen.
pub const SCALING_SHAPES: [(usize, usize); 4] = [(4, 48), (4, 64), (6, 80), (8, 96)];

/// Training tokens per non-embedding parameter in the scaling suite. Far below the report's
/// (compute-optimal) budgets, so that four sizes times two modes train in about ten minutes on
/// two cores; every size gets the same ratio, which is what the fit needs.
pub const SCALING_TOKENS_PER_PARAMETER: f64 = 2.0;

/// Non-embedding parameters of a model (the `N` of `C = 6·N·D`): everything but the token
/// embedding and the LM head.
pub fn non_embedding_parameters(c: &crate::model::Config) -> usize {
    let lay = crate::model::params::Layout::new(c);
    let head = if c.tie_word_embeddings { 0 } else { lay.head.len() };
    lay.total - lay.embed.len() - head
}

/// `standard` and `block` (2 sublayers per block) at each of [`SCALING_SHAPES`], every run on
/// `ratio` tokens per non-embedding parameter of its standard model.
fn scaling_variants(base: &RunConfig, ratio: f64) -> Result<Vec<Variant>> {
    let mut out = Vec::new();
    for (layers, d) in SCALING_SHAPES {
        let heads = d / 16;
        let ff = (11 * d / 4).div_ceil(8) * 8;
        let shape = [
            format!("num_hidden_layers={layers}"),
            format!("hidden_size={d}"),
            format!("num_attention_heads={heads}"),
            format!("num_key_value_heads={heads}"),
            format!("intermediate_size={ff}"),
        ];
        let model = base
            .with_overrides(&[shape.to_vec(), vec!["residual=standard".into()]].concat())?
            .model;
        let batch = base.train.batch_tokens as f64;
        let steps =
            ((ratio * non_embedding_parameters(&model) as f64 / batch).round() as usize).max(10);
        let budget = [
            format!("max_tokens={}", steps * base.train.batch_tokens),
            format!("eval_every={}", (steps / 5).max(1)),
        ];
        for (mode, extra) in [
            ("standard", vec!["residual=standard".to_string()]),
            ("block", vec!["residual=block".into(), format!("num_blocks={layers}")]),
        ] {
            let sets = [shape.to_vec(), budget.to_vec(), extra].concat();
            // Each size is compared with the standard model of the same size.
            let baseline = Some(format!("L{layers}-d{d}-standard"));
            out.push(Variant { name: format!("L{layers}-d{d}-{mode}"), sets, baseline });
        }
    }
    Ok(out)
}

/// A file-name-safe form of a variant name.
fn slug(name: &str) -> String {
    name.chars()
        .map(
            |c| if c.is_ascii_alphanumeric() || c == '-' || c == '=' || c == '.' { c } else { '_' },
        )
        .collect::<String>()
        .replace("__", "_")
        .trim_matches('_')
        .to_string()
}

pub struct CompareOptions {
    pub out: PathBuf,
    pub progress: bool,
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

fn first_difference(a: &Value, b: &Value, path: &str) -> Option<String> {
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            keys.into_iter().find_map(|k| {
                let p = if path.is_empty() { k.clone() } else { format!("{path}.{k}") };
                first_difference(
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                    &p,
                )
            })
        }
        _ if a == b => None,
        _ => Some(path.to_string()),
    }
}

fn lookup(v: &Value, path: &str) -> Value {
    path.split('.').fold(v.clone(), |v, k| v.get(k).cloned().unwrap_or(Value::Null))
}

/// Trains every run of the plan that is not finished yet, then writes the report.
pub fn run(plan: &Plan, opts: &CompareOptions) -> Result<()> {
    ensure!(plan.seeds > 0, "--seeds must be at least 1");
    ensure!(!plan.variants.is_empty(), "nothing to compare");
    let out = &opts.out;
    let plan_path = out.join(PLAN);
    if plan_path.exists() {
        let old = Plan::load(out)?;
        let same = Plan { seeds: plan.seeds, ..old.clone() } == *plan;
        ensure!(
            same,
            "{} holds a comparison with other settings (suite {:?}, variants {:?}); use another --out, or delete it",
            out.display(),
            old.suite,
            old.variants.iter().map(|v| &v.name).collect::<Vec<_>>()
        );
    }
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
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    crate::model::checkpoint::write_atomic(
        &plan_path,
        serde_json::to_string_pretty(plan)?.as_bytes(),
    )?;

    let total: u64 = jobs.iter().map(|j| j.2.train.steps() as u64).sum();
    let bar = if opts.progress { run::new_progress_bar(total) } else { None };
    let mut offset = 0u64;
    let n = jobs.len();
    for (i, (name, seed, cfg, dir, st)) in jobs.into_iter().enumerate() {
        let steps = cfg.train.steps() as u64;
        let label = format!("[{}/{n}] {name} seed {seed}", i + 1);
        if st == Status::Done {
            let line = format!("{label}: finished earlier, reused ({})", dir.display());
            match &bar {
                Some(b) => b.println(line),
                None => eprintln!("{line}"),
            }
        } else {
            let train_opts = TrainOptions {
                out: dir.clone(),
                data: plan.data.clone(),
                tokenizer: None,
                resume: st == Status::Resume,
                overwrite: st == Status::Fresh,
                progress: opts.progress,
                shared_bar: bar.as_ref().map(|b| SharedBar {
                    bar: b.clone(),
                    offset,
                    label: label.clone(),
                }),
            };
            if bar.is_none() {
                eprintln!("{label}");
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
    let page = crate::report::write(out)?;
    eprintln!("report: {}", page.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suites_resolve_and_differences_are_named() {
        for s in ["residuals", "block-sizes", "ablations", "scaling"] {
            let base = base(true).unwrap();
            let vs = suite(s, &base).unwrap();
            let plan = Plan { suite: s.into(), base, variants: vs, seeds: 2, data: None };
            for v in &plan.variants {
                for seed in 0..2 {
                    let c = plan.run_config(v, seed).unwrap();
                    c.model.validate().unwrap();
                    assert_eq!(c.train.seed, plan.base.train.seed + seed as u64);
                }
            }
        }
        let base = base(false).unwrap();
        assert!(suite("nope", &base).unwrap_err().to_string().contains("available"));
        let vs = suite("block-sizes", &base).unwrap();
        let names: Vec<&str> = vs.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names.first(), Some(&"standard"));
        assert!(names.last().unwrap().starts_with("full"), "{names:?}");
        assert_eq!(vs.len(), 2 + (base.model.sublayers() as f64).log2() as usize);
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
        let want = base(true).unwrap();
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
}
