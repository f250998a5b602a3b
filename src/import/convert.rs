//! `attnres convert`: a standard checkpoint upcycled to Full or Block AttnRes (docs/import.md,
//! "Upcycling").
//!
//! The new model keeps every weight of the old one and gains the depth parameters as a fresh
//! model starts them: pseudo-queries zero, key-norm gains one (docs/method.md §3). With zero
//! queries every depth attention is the uniform mean of its sources, whose sum is the standard
//! residual stream, and every consumer normalises first: the converted model computes what the
//! source computed, except that each norm's eps weighs `n²` times more, `n` being the number of
//! sources its consumer reads.

use super::output::{check_out, write_dir, Files};
use crate::model::checkpoint;
use crate::model::config::ResidualKind;
use crate::model::params::{Init, Layout};
use crate::model::{Config, Model};
use anyhow::{bail, ensure, Context, Result};
use std::collections::BTreeSet;
use std::path::Path;

/// The settings `convert` may change: those that keep the model's function. The residual
/// connection and its blocks (with zero pseudo-queries the mean of the standard stream's parts),
/// and the norms' eps (whose weight the uniform mean changes anyway).
pub const KEYS: &[&str] = &["residual", "num_blocks", "rms_norm_eps"];

/// What a conversion read and wrote, for the log line.
pub struct Converted {
    pub from: Config,
    pub to: Config,
    /// Parameters added (the depth parameters).
    pub added: usize,
    /// The tokenizer files carried over.
    pub carried: Vec<&'static str>,
}

impl Converted {
    pub fn line(&self, model: &Path, out: &Path) -> String {
        let to = &self.to;
        let shape = match to.block_size() {
            None => String::new(),
            // The output aggregation reads the most: the embedding and every block.
            Some(s) => format!(
                " (blocks of {s} sublayer{}, at most {} sources per depth attention)",
                if s == 1 { "" } else { "s" },
                to.sublayers() / s + 1
            ),
        };
        format!(
            "converted {} ({}) into {}: residual {}{shape}, {} parameters added (pseudo-queries 0, key-norm gains 1), rms_norm_eps {:e}; carried over: {}",
            model.display(),
            self.from.residual_label(),
            out.display(),
            to.residual_label(),
            self.added,
            to.rms_norm_eps,
            if self.carried.is_empty() { "no tokenizer".to_string() } else { self.carried.join(", ") }
        )
    }
}

/// Converts the checkpoint in `model` with the `key=value` settings `sets` into `out`, which is
/// written whole or not at all; an `out` that exists and is not empty is replaced only with
/// `force`.
pub fn convert(model: &Path, sets: &[String], out: &Path, force: bool) -> Result<Converted> {
    crate::base::fs::refuse_output_over_input(out, model, "--model")?;
    check_out(out, force)?;
    let src = checkpoint::load(model)
        .with_context(|| format!("cannot read the model {}", model.display()))?;
    ensure!(
        !src.is_quantized(),
        "{} is quantised: convert its f32 original, then quantise the result",
        model.display()
    );
    let to = converted_config(&src.config, sets)?;
    let params = upcycle(&src, &to)?;
    let added = params.len() - src.params.len();
    let (files, carried) = Files::carried(model, Model::new(to.clone(), params)?)?;
    write_dir(out, &files)?;
    Ok(Converted { from: src.config, to, added, carried })
}

/// The converted model's config: `from` (which must be standard) with `sets` applied, each key
/// one of [`KEYS`].
pub fn converted_config(from: &Config, sets: &[String]) -> Result<Config> {
    ensure!(
        from.residual == ResidualKind::Standard,
        "the model is already residual = {}: convert upcycles a standard model (residual = \"standard\")",
        from.residual_label()
    );
    ensure!(
        !sets.is_empty(),
        "nothing to convert: give --set residual=block --set num_blocks=N, or --set residual=full"
    );
    let mut keys = BTreeSet::new();
    for s in sets {
        let (k, v) =
            s.split_once('=').with_context(|| format!("--set {s:?}: expected key=value"))?;
        let k = k.trim();
        ensure!(
            KEYS.contains(&k),
            "--set {k}: convert changes only {} (the settings that keep what the model computes)",
            KEYS.join(", ")
        );
        keys.insert(k);
        // The source's num_blocks is a default it never used: a block count must be chosen.
        let block = v.trim().trim_matches('"') == "block";
        ensure!(
            k != "residual" || !block || sets.iter().any(|s| s.trim_start().starts_with("num_blocks")),
            "residual = block needs --set num_blocks=N, a divisor of the sublayer count 2 * num_hidden_layers = {}",
            from.sublayers()
        );
    }
    let to = from.with_overrides(sets)?;
    ensure!(
        to.residual == ResidualKind::Block || !keys.contains("num_blocks"),
        "--set num_blocks applies to residual = block only"
    );
    // Ablations would not start from the standard model's function (a window skips part of the
    // stream): convert makes the method itself.
    ensure!(
        to.residual == ResidualKind::Standard || to.depth_is_default(),
        "the model's config sets attn_res_* ablation options; convert makes the method itself (reset them to their defaults first)"
    );
    ensure!(to != *from, "nothing to convert: the settings given are the model's own");
    Ok(to)
}

/// The parameters of `to`: every tensor of `src` as it is, and the new depth parameters as a
/// fresh model starts them (pseudo-queries zero, key-norm gains one).
pub fn upcycle(src: &Model, to: &Config) -> Result<Vec<f32>> {
    let layout = Layout::new(to);
    let mut params = vec![0.0f32; layout.total];
    for s in &layout.specs {
        let out = &mut params[s.range.clone()];
        match src.layout.spec(&s.name) {
            Some(f) => {
                ensure!(f.shape == s.shape, "tensor {:?} changes shape", s.name);
                out.copy_from_slice(&src.params[f.range.clone()]);
            }
            None => match s.init {
                Init::Zero => out.fill(0.0),
                Init::One => out.fill(1.0),
                Init::Normal => bail!("tensor {:?} is new and would be random", s.name),
            },
        }
    }
    Ok(params)
}
