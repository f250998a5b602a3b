//! What an import writes, for both of its sources and for `convert`: the checkpoint's files,
//! checked, written under a temporary name beside the output directory and renamed into place.

use crate::base::fs::write_atomic;
use crate::model::checkpoint;
use crate::model::{Config, Model};
use crate::text::tokenizer::{eos_token, Bpe};
use anyhow::{ensure, Context, Result};
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// What an import read and wrote, for the log line.
#[derive(Debug)]
pub struct Summary {
    pub source: String,
    pub config: Config,
    pub parameters: usize,
    /// Tensor types or dtypes of the source and how many tensors had each.
    pub types: BTreeMap<String, usize>,
    /// Tensors kept in their own formats, F16 or blocks (the others are f32).
    pub kept: usize,
    pub tokenizer: String,
}

impl Summary {
    pub fn line(&self, out: &Path) -> String {
        let c = &self.config;
        let types: Vec<String> = self.types.iter().map(|(t, n)| format!("{n} {t}")).collect();
        format!(
            "imported {} into {}: {} layers, hidden {}, {} heads ({} key/value), vocabulary {}, {} parameters (from {}; {}), tokenizer: {}",
            self.source,
            out.display(),
            c.num_hidden_layers,
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.vocab_size,
            self.parameters,
            types.join(", "),
            match self.kept {
                0 => "all f32".to_string(),
                n => format!("{n} tensors kept in their own formats, the rest f32"),
            },
            self.tokenizer
        )
    }
}

/// The files of an imported (or converted) checkpoint, before they are written.
pub(super) struct Files {
    pub(super) model: Model,
    /// `tokenizer.json` (a converted checkpoint without one has none).
    pub(super) tokenizer: Option<String>,
    pub(super) tokenizer_config: Option<String>,
    pub(super) chat_template: Option<String>,
}

impl Files {
    /// `model` with the tokenizer files of the checkpoint directory `dir` (those it has), and
    /// their names.
    pub(super) fn carried(dir: &Path, model: Model) -> Result<(Files, Vec<&'static str>)> {
        let mut carried = Vec::new();
        let mut carry = |name: &'static str| -> Result<Option<String>> {
            let p = dir.join(name);
            if !p.exists() {
                return Ok(None);
            }
            carried.push(name);
            crate::base::fs::read_utf8(&p).map(Some)
        };
        let files = Files {
            tokenizer: carry(TOKENIZER_FILE)?,
            tokenizer_config: carry(TOKENIZER_CONFIG_FILE)?,
            chat_template: carry(CHAT_TEMPLATE_FILE)?,
            model,
        };
        Ok((files, carried))
    }
}

/// Refuses an `out` that exists and is not empty, unless `force`.
pub(super) fn check_out(out: &Path, force: bool) -> Result<()> {
    let occupied = out.exists() && std::fs::read_dir(out).map_or(true, |mut d| d.next().is_some());
    ensure!(
        !occupied || force,
        "{} already exists and is not empty; pass --force to replace it",
        out.display()
    );
    Ok(())
}

/// Writes the files into a temporary directory beside `out`, then puts it in place of `out`.
/// The temporary directory's name is `.NAME.import-tmp-PID`.
pub(super) fn write_dir(out: &Path, files: &Files) -> Result<()> {
    let name = out.file_name().context("--out has no directory name")?.to_string_lossy();
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent)
        .with_context(|| format!("cannot create {}", parent.display()))?;
    let tmp = parent.join(format!(".{name}.import-tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let written = (|| -> Result<()> {
        std::fs::create_dir(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        checkpoint::save(&files.model, &tmp)?;
        if let Some(t) = &files.tokenizer {
            write_atomic(&tmp.join(TOKENIZER_FILE), t.as_bytes())?;
        }
        if let Some(c) = &files.tokenizer_config {
            write_atomic(&tmp.join(TOKENIZER_CONFIG_FILE), c.as_bytes())?;
        }
        if let Some(t) = &files.chat_template {
            write_atomic(&tmp.join(CHAT_TEMPLATE_FILE), t.as_bytes())?;
        }
        let old = parent.join(format!(".{name}.import-old-{}", std::process::id()));
        if out.exists() {
            std::fs::rename(out, &old)
                .with_context(|| format!("cannot move the old {} aside", out.display()))?;
        }
        if let Err(e) = std::fs::rename(&tmp, out) {
            let _ = std::fs::rename(&old, out);
            return Err(e)
                .with_context(|| format!("cannot rename {} to {}", tmp.display(), out.display()));
        }
        let _ = std::fs::remove_dir_all(&old);
        Ok(())
    })();
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    written
}

/// Loads the tokenizer as `generate` and `eval` will, so that one that cannot be used fails the
/// import instead.
pub(super) fn check_tokenizer(
    json: &str,
    config: Option<&Json>,
    model_vocab: usize,
) -> Result<Bpe> {
    let bpe = Bpe::from_json_with_eos(json, config.and_then(eos_token))?;
    ensure!(
        bpe.vocab_size() <= model_vocab,
        "the tokenizer has {} tokens, the model's vocabulary only {model_vocab}",
        bpe.vocab_size()
    );
    Ok(bpe)
}
