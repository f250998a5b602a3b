//! The runs of a report directory as the report reads them, and the row of the summary each
//! variant gets.

use super::stat::Stat;
use crate::base::version::CodeVersion;
use crate::experiments::suite::Variant;
use crate::model::diagnostics::Diagnostics;
use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::Value;
use std::path::Path;

/// One finished run, as read back from its directory.
pub(super) struct Run {
    pub(super) val_loss: f64,
    pub(super) bpb: f64,
    pub(super) tokens_per_second: f64,
    pub(super) parameters: u64,
    /// Validation loss over training: (tokens, loss).
    pub(super) curve: Vec<(f64, f64)>,
    /// Mean gradient norm of each sublayer's weights over all steps.
    pub(super) grad_norms: Vec<f64>,
    pub(super) diag: Diagnostics,
    /// The version of the code that finished the run (none: not recorded).
    pub(super) code_version: Option<CodeVersion>,
}

pub(super) fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is corrupt", path.display()))
}

pub(super) fn read_run(dir: &Path) -> Result<Option<Run>> {
    if !dir.join("summary.json").exists() || !dir.join("diagnostics.json").exists() {
        return Ok(None);
    }
    let s = read_json(&dir.join("summary.json"))?;
    let num = |k: &str| {
        s[k].as_f64().with_context(|| format!("{}: summary.json has no {k}", dir.display()))
    };
    let diag: Diagnostics = serde_json::from_value(read_json(&dir.join("diagnostics.json"))?)
        .with_context(|| format!("{}: diagnostics.json", dir.display()))?;
    let metrics = std::fs::read_to_string(dir.join("metrics.jsonl"))
        .with_context(|| format!("cannot read {}/metrics.jsonl", dir.display()))?;
    let (mut curve, mut sums, mut steps) =
        (Vec::new(), vec![0.0f64; diag.output_rms.len()], 0usize);
    for line in metrics.lines().filter(|l| !l.trim().is_empty()) {
        let m: Value = serde_json::from_str(line)
            .with_context(|| format!("{}/metrics.jsonl: bad line", dir.display()))?;
        if let (Some(t), Some(v)) = (m["tokens"].as_f64(), m["val_loss"].as_f64()) {
            curve.push((t, v));
        }
        if let Some(g) = m["sublayer_grad_norms"].as_array() {
            for (acc, x) in sums.iter_mut().zip(g) {
                *acc += x.as_f64().unwrap_or(0.0);
            }
            steps += 1;
        }
    }
    let grad_norms = sums.iter().map(|x| x / steps.max(1) as f64).collect();
    Ok(Some(Run {
        val_loss: num("val_loss")?,
        bpb: num("val_bits_per_byte")?,
        tokens_per_second: num("train_tokens_per_second")?,
        parameters: num("parameters")? as u64,
        curve,
        grad_norms,
        diag,
        code_version: serde_json::from_value(s["code_version"].clone()).ok(),
    }))
}

/// The variants with at least one finished run: colour index, variant, runs.
pub(super) type Finished<'a> = [(usize, &'a Variant, Vec<&'a Run>)];

/// One variant's line of the summary.
#[derive(Serialize)]
pub(super) struct Row {
    pub(super) name: String,
    pub(super) settings: Vec<String>,
    pub(super) seeds_finished: usize,
    pub(super) parameters: u64,
    pub(super) val_loss: Stat,
    pub(super) val_bits_per_byte: Stat,
    /// Per-seed difference from the baseline's run with the same seed.
    pub(super) val_loss_minus_baseline: Option<Stat>,
    pub(super) train_tokens_per_second: Stat,
    /// Training time per token relative to the baseline, minus one.
    pub(super) training_overhead: Option<f64>,
    pub(super) val_losses: Vec<f64>,
}
