//! `attnres forward`: one batch of token ids from a JSON file through a checkpoint; the logits,
//! and with targets the loss and the gradient of every parameter, as safetensors.

use crate::base::fs::write_atomic;
use crate::model::checkpoint::safetensors_bytes;
use crate::model::Model;
use anyhow::{ensure, Context, Result};
use serde::Deserialize;
use std::path::Path;

/// The batch file: `{"input_ids": [[...], ...], "targets": [[...], ...]}`, targets optional.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchFile {
    pub input_ids: Vec<Vec<i64>>,
    pub targets: Option<Vec<Vec<i64>>>,
}

impl BatchFile {
    pub fn read(path: &Path) -> Result<BatchFile> {
        let text = crate::base::fs::read_utf8(path)?;
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not a valid batch file", path.display()))
    }
}

/// Flattens a rectangular list of token ids into (ids, rows, columns), naming what is wrong.
pub fn flatten_ids(rows: &[Vec<i64>], what: &str) -> Result<(Vec<u32>, usize, usize)> {
    ensure!(!rows.is_empty(), "{what} is empty");
    let t = rows[0].len();
    ensure!(t > 0, "{what}[0] is empty");
    let mut out = Vec::with_capacity(rows.len() * t);
    for (b, row) in rows.iter().enumerate() {
        ensure!(
            row.len() == t,
            "{what}[{b}] has {} ids, {what}[0] has {t}: rows must have equal length",
            row.len()
        );
        for (i, &id) in row.iter().enumerate() {
            ensure!(
                (0..=u32::MAX as i64).contains(&id),
                "{what}[{b}][{i}] = {id} is not a valid token id"
            );
            out.push(id as u32);
        }
    }
    Ok((out, rows.len(), t))
}

/// What a batch produced: the safetensors file's bytes, and the loss when targets were given.
pub struct ForwardOutput {
    pub safetensors: Vec<u8>,
    pub loss: Option<f32>,
}

/// Runs the batch: `logits` [batch, seq, vocab]; with targets also `loss` and
/// `grad.<parameter>` for every parameter.
pub fn run(model: &Model, batch: &BatchFile) -> Result<ForwardOutput> {
    let (ids, b, t) = flatten_ids(&batch.input_ids, "input_ids")?;
    let fwd = model.forward(&ids, b, t)?;
    model.check_finite(&fwd.logits)?;
    let v = model.config.vocab_size;
    let mut tensors: Vec<(String, Vec<usize>, &[f32])> =
        vec![("logits".into(), vec![b, t, v], &fwd.logits)];
    let (loss, grads);
    let mut reported = None;
    if let Some(tg) = &batch.targets {
        let (targets, tb, tt) = flatten_ids(tg, "targets")?;
        ensure!((tb, tt) == (b, t), "targets are {tb} x {tt}, input_ids are {b} x {t}");
        (loss, grads) = model.backward(&fwd, &targets)?;
        reported = Some(loss);
        tensors.push(("loss".into(), vec![], std::slice::from_ref(&loss)));
        for s in &model.layout.specs {
            tensors.push((format!("grad.{}", s.name), s.shape.clone(), &grads[s.range.clone()]));
        }
    }
    Ok(ForwardOutput { safetensors: safetensors_bytes(&tensors, None)?, loss: reported })
}

/// Writes the output file; its directory must exist.
pub fn write_output(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        ensure!(dir.is_dir(), "output directory {} does not exist", dir.display());
    }
    write_atomic(path, bytes)
}
