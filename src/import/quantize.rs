//! `attnres quantize`: a checkpoint's weight matrices stored in a block format (what is
//! quantised and why: [`crate::model::quantize`]), with the tokenizer files carried over.

use super::output::{check_out, write_dir, Files};
use crate::base::memory::format_bytes;
use crate::kernels::quant::Format;
use crate::model::checkpoint;
use crate::model::quantize::quantize as quantize_model;
use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::path::Path;

/// What a quantisation wrote, for the log line.
pub struct Done {
    pub tensors: BTreeMap<&'static str, usize>,
    pub bytes: (usize, usize),
    pub carried: Vec<&'static str>,
}

impl Done {
    pub fn line(&self, model: &Path, out: &Path) -> String {
        let tensors: Vec<String> = self.tensors.iter().map(|(f, n)| format!("{n} {f}")).collect();
        format!(
            "quantised {} into {}: tensors {}; weight matrices {} -> {}; carried over: {}",
            model.display(),
            out.display(),
            tensors.join(", "),
            format_bytes(self.bytes.0 as u128),
            format_bytes(self.bytes.1 as u128),
            if self.carried.is_empty() {
                "no tokenizer".to_string()
            } else {
                self.carried.join(", ")
            }
        )
    }
}

/// Quantises the checkpoint in `model` to `to` into `out`, written whole or not at all; an
/// `out` that exists and is not empty is replaced only with `force`.
pub fn quantize(model: &Path, to: Format, out: &Path, force: bool) -> Result<Done> {
    crate::base::fs::refuse_output_over_input(out, model, "--model")?;
    check_out(out, force)?;
    let src = checkpoint::load(model)
        .with_context(|| format!("cannot read the model {}", model.display()))?;
    let q = quantize_model(&src, to)?;
    let (files, carried) = Files::carried(model, q.model)?;
    write_dir(out, &files)?;
    Ok(Done { tensors: q.tensors, bytes: q.bytes, carried })
}
