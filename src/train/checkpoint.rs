//! A run directory on disk. It holds the latest model as a checkpoint (`config.json`,
//! `model.safetensors`, `tokenizer.json`), `metrics.jsonl` (one JSON object per step) and
//! `ckpt/`, the full state a resume needs: model, tokenizer, optimiser moments, step, data
//! position and the run's settings. `ckpt/` is replaced as a whole: the new state is written to
//! `.ckpt.tmp/`, the old one renamed away, the new one renamed in, so a run killed at any moment
//! resumes from the last complete checkpoint.

use super::config::RunConfig;
use super::optim::Optimizer;
use super::tokenizer::Bpe;
use crate::fs::write_atomic;
use crate::model::checkpoint::{self, f32_values, safetensors_bytes};
use crate::model::Model;
use crate::version::CodeVersion;
use anyhow::{bail, ensure, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::{Path, PathBuf};

const CKPT: &str = "ckpt";
pub(super) const METRICS: &str = "metrics.jsonl";

/// The resumable state besides model and optimiser moments.
#[derive(Serialize, Deserialize, Debug)]
pub(super) struct TrainState {
    pub(super) run: RunConfig,
    /// Optimiser steps completed.
    pub(super) step: usize,
    pub(super) tokens_seen: u64,
    /// Training windows consumed (the data position).
    pub(super) windows_seen: u64,
    pub(super) elapsed_seconds: f64,
    /// Time spent in training steps alone (no validation or checkpoints).
    #[serde(default)]
    pub(super) train_seconds: f64,
    /// Hash of the corpus split and tokenizer, to refuse resuming on other data.
    pub(super) data_key: String,
    /// `--data` of the run (none: the embedded corpus).
    pub(super) data: Option<PathBuf>,
    /// Every version of the code that trained part of the run, oldest first (empty in
    /// checkpoints written before versions were recorded).
    #[serde(default)]
    pub(super) code_versions: Vec<CodeVersion>,
}

/// Whether `out` holds (part of) a training run.
pub(super) fn holds_run(out: &Path) -> bool {
    out.join(CKPT).exists() || out.join(".ckpt.old").exists() || out.join(METRICS).exists()
}

/// The state saved beside a checkpoint's model.
pub(super) fn read_state(dir: &Path) -> Result<TrainState> {
    serde_json::from_str(
        &std::fs::read_to_string(dir.join("train_state.json"))
            .context("cannot read the checkpoint's train_state.json")?,
    )
    .context("the checkpoint's train_state.json is corrupt")
}

/// Removes every file of an earlier run (for `--overwrite`).
pub(super) fn clear(out: &Path) -> Result<()> {
    for p in [CKPT, ".ckpt.old", ".ckpt.tmp", METRICS, "summary.json", "diagnostics.json"] {
        let p = out.join(p);
        if p.is_dir() {
            std::fs::remove_dir_all(&p)?;
        } else if p.exists() {
            std::fs::remove_file(&p)?;
        }
    }
    Ok(())
}

/// A run's latest model and the tokenizer stored beside it (any checkpoint directory with a
/// `tokenizer.json`).
pub fn load_with_tokenizer(dir: &Path) -> Result<(Model, Bpe)> {
    let model = checkpoint::load(dir)?;
    let path = dir.join("tokenizer.json");
    ensure!(
        path.exists(),
        "{} has no tokenizer.json: pass the directory of a training run (attnres train --out DIR)",
        dir.display()
    );
    let bpe = Bpe::load(&path)?;
    ensure!(
        bpe.vocab_size() <= model.config.vocab_size,
        "tokenizer.json has {} tokens, the model only {}",
        bpe.vocab_size(),
        model.config.vocab_size
    );
    Ok((model, bpe))
}

/// The checkpoint directory to resume from (the previous one if a swap was interrupted).
pub(super) fn checkpoint_dir(out: &Path) -> Result<PathBuf> {
    for name in [CKPT, ".ckpt.old"] {
        let d = out.join(name);
        if d.join("train_state.json").exists() {
            return Ok(d);
        }
    }
    bail!("{} holds no checkpoint to resume (no {}/train_state.json)", out.display(), CKPT)
}

/// Writes a checkpoint of the run into `ckpt/` (swapped in whole) and the latest model beside it.
/// If writing or swapping fails (a full or read-only disk), `.ckpt.tmp/` is removed, so the disk
/// is not left full and `--resume` continues from the previous checkpoint (`ckpt/`, or
/// `.ckpt.old/` if the swap stopped half way); the error names the path that failed.
pub(super) fn save(
    out: &Path,
    model: &Model,
    bpe: &Bpe,
    opt: &Optimizer,
    st: &TrainState,
) -> Result<()> {
    let tmp = out.join(".ckpt.tmp");
    let (cur, old) = (out.join(CKPT), out.join(".ckpt.old"));
    let remove_dir = |d: &Path| {
        std::fs::remove_dir_all(d).with_context(|| format!("cannot remove {}", d.display()))
    };
    let rename = |from: &Path, to: &Path| {
        std::fs::rename(from, to)
            .with_context(|| format!("cannot rename {} to {}", from.display(), to.display()))
    };
    let tok = bpe.to_json()?;
    let write_and_swap = || -> Result<()> {
        if tmp.exists() {
            remove_dir(&tmp)?;
        }
        checkpoint::save(model, &tmp)?;
        write_atomic(&tmp.join("tokenizer.json"), tok.as_bytes())?;
        let meta = std::collections::HashMap::from([("step".to_string(), opt.step.to_string())]);
        let n = opt.m.len();
        let tensors: Vec<(String, Vec<usize>, &[f32])> = vec![
            ("adam.m".into(), vec![n], &opt.m),
            ("adam.v".into(), vec![n], &opt.v),
            ("muon.momentum".into(), vec![n], &opt.momentum),
        ];
        let optimizer = safetensors_bytes(&tensors, Some(meta))?;
        write_atomic(&tmp.join("optimizer.safetensors"), &optimizer)?;
        write_atomic(&tmp.join("train_state.json"), serde_json::to_string_pretty(st)?.as_bytes())?;
        // Without `ckpt/`, `.ckpt.old/` is the last complete checkpoint: kept until the new
        // one is in place.
        if cur.exists() {
            if old.exists() {
                remove_dir(&old)?;
            }
            rename(&cur, &old)?;
        }
        rename(&tmp, &cur)
    };
    if let Err(e) = write_and_swap() {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e.context(format!("cannot save the checkpoint {}", cur.display())));
    }
    if old.exists() {
        remove_dir(&old)?;
    }
    // The latest model, loadable as a plain checkpoint directory.
    checkpoint::save(model, out)?;
    write_atomic(&out.join("tokenizer.json"), tok.as_bytes())
}

/// Restores the optimiser's step and moments.
pub(super) fn load_optimizer(opt: &mut Optimizer, path: &Path) -> Result<()> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| anyhow::anyhow!("{} is corrupt: {e}", path.display()))?;
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| anyhow::anyhow!("{e}"))?;
    opt.step = meta
        .metadata()
        .as_ref()
        .and_then(|m| m.get("step"))
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("{} has no step", path.display()))?;
    for (name, buf) in
        [("adam.m", &mut opt.m), ("adam.v", &mut opt.v), ("muon.momentum", &mut opt.momentum)]
    {
        let t = st.tensor(name).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let vals = f32_values(name, &t)?;
        ensure!(
            vals.len() == buf.len(),
            "{}: {name} has {} values, the model needs {}",
            path.display(),
            vals.len(),
            buf.len()
        );
        buf.copy_from_slice(&vals);
    }
    Ok(())
}

/// Drops metric lines after `step` (written after the checkpoint the run resumes from).
pub(super) fn truncate_metrics(path: &Path, step: usize) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else { return Ok(()) };
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<Value>(l)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s as usize <= step)
        })
        .map(|l| format!("{l}\n"))
        .collect();
    write_atomic(path, kept.as_bytes())
}
