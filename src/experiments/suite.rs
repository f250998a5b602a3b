//! What a comparison trains: its variants (a name and the settings each changes), the named
//! suites of variants, and the plan of a report directory (`compare.json`: base settings,
//! variants, seeds, data). `compare` trains a plan and `report` reads it back; this module
//! depends on neither.

use crate::model::params::Layout;
use crate::model::Config;
use crate::train::config::RunConfig;
use crate::train::presets;
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
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

/// The plan's file in a report directory.
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
        ensure!(!text.trim().is_empty(), "{} is empty", path.display());
        let plan: Plan = serde_json::from_str(&text)
            .with_context(|| format!("{} is corrupt", path.display()))?;
        plan.check().with_context(|| format!("{} is corrupt", path.display()))?;
        Ok(plan)
    }

    /// What the report relies on: at least one variant and one seed, unique variant names, and
    /// baselines that are variants of the plan.
    fn check(&self) -> Result<()> {
        ensure!(!self.variants.is_empty(), "it lists no variants");
        ensure!(self.seeds > 0, "it asks for no seeds");
        for (i, v) in self.variants.iter().enumerate() {
            ensure!(
                !self.variants[..i].iter().any(|w| w.name == v.name),
                "variant {:?} is listed twice",
                v.name
            );
            if let Some(b) = &v.baseline {
                ensure!(
                    self.variants.iter().any(|w| &w.name == b),
                    "variant {:?} is compared with {b:?}, which is not a variant of the plan",
                    v.name
                );
            }
        }
        Ok(())
    }
}

/// The settings every run of a comparison starts from: the `compare` preset, or
/// `compare-quick` for `--quick`.
pub fn base(quick: bool) -> Result<RunConfig> {
    presets::run_config(if quick { "compare-quick" } else { "compare" })
}

/// The variants of a named suite over `base`: `residuals` (the main comparison), `ablations`
/// (docs/method.md §5), `block-sizes` (the block-size sweep, S = L, L/2, ..., 1) or `scaling`
/// (standard and block at four sizes).
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
        "ablations" => ablations(&base.model),
        "scaling" => scaling_variants(base, SCALING_TOKENS_PER_PARAMETER)?,
        other => {
            bail!("unknown suite {other:?} (available: residuals, ablations, block-sizes, scaling)")
        }
    };
    Ok(variants)
}

/// The ablation suite (docs/method.md §5): the report's table at laptop scale, each arm a set of model
/// settings over the comparison's model `base`. The report's sliding window (the latest 8 of 32
/// sublayers) and multi-head depth attention (16 groups) keep their proportions here.
fn ablations(base: &Config) -> Vec<Variant> {
    let window = format!("attn_res_window={}", (base.sublayers() / 4).max(1));
    let heads = format!(
        "attn_res_heads={}",
        (1..=16).rev().find(|h| base.hidden_size.is_multiple_of(*h)).unwrap_or(1)
    );
    let v = |name: &str, sets: &[&str]| Variant::new(name, sets);
    vec![
        v("standard", &["residual=standard"]),
        v("denseformer", &["residual=full", "attn_res_query=dense"]),
        v("full", &["residual=full"]),
        v("full-input-query", &["residual=full", "attn_res_query=input"]),
        v("full-scalar-mixing", &["residual=full", "attn_res_query=scalar"]),
        v("full-sigmoid", &["residual=full", "attn_res_gate=sigmoid"]),
        v("full-no-key-norm", &["residual=full", "attn_res_key_norm=false"]),
        v("sliding-window", &["residual=full", &window]),
        v("block", &["residual=block"]),
        v("block-multihead", &["residual=block", &heads]),
        v("block-no-key-norm", &["residual=block", "attn_res_key_norm=false"]),
    ]
}

/// The scaling suite's model shapes (layers, hidden): four sizes, from 0.1M to 0.9M
/// non-embedding parameters, deeper as they widen.
pub const SCALING_SHAPES: [(usize, usize); 4] = [(4, 48), (4, 64), (6, 80), (8, 96)];

/// Training tokens per non-embedding parameter in the scaling suite. Far below the report's
/// (compute-optimal) budgets, to keep four sizes times two modes to minutes on two cores; every
/// size gets the same ratio, which is what the fit needs.
pub const SCALING_TOKENS_PER_PARAMETER: f64 = 2.0;

/// Non-embedding parameters of a model (the `N` of `C = 6·N·D`): everything but the token
/// embedding and the LM head.
pub fn non_embedding_parameters(c: &Config) -> usize {
    let lay = Layout::new(c);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suites_resolve() {
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
    }

    /// An empty, truncated or inconsistent plan is an error naming the file, never a panic.
    #[test]
    fn malformed_plans_are_errors_naming_the_file() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(PLAN);
        let base = base(true).unwrap();
        let good = Plan {
            suite: "residuals".into(),
            variants: suite("residuals", &base).unwrap(),
            base,
            seeds: 1,
            data: None,
        };
        let good_text = serde_json::to_string(&good).unwrap();
        let mut no_variants = serde_json::to_value(&good).unwrap();
        no_variants["variants"] = serde_json::json!([]);
        let mut no_seeds = serde_json::to_value(&good).unwrap();
        no_seeds["seeds"] = serde_json::json!(0);
        let mut bad_baseline = serde_json::to_value(&good).unwrap();
        bad_baseline["variants"][1]["baseline"] = serde_json::json!("nope");
        for (text, says) in [
            (String::new(), "is empty"),
            ("{}".to_string(), "is corrupt"),
            (good_text[..good_text.len() / 2].to_string(), "is corrupt"),
            (no_variants.to_string(), "no variants"),
            (no_seeds.to_string(), "no seeds"),
            (bad_baseline.to_string(), "not a variant"),
        ] {
            std::fs::write(&path, &text).unwrap();
            let e = format!("{:#}", Plan::load(tmp.path()).unwrap_err());
            assert!(e.contains(&path.display().to_string()) && e.contains(says), "{e}");
        }
        std::fs::write(&path, good_text).unwrap();
        assert_eq!(Plan::load(tmp.path()).unwrap(), good);
    }
}
