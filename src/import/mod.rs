//! `attnres import`: Llama-family checkpoints from elsewhere turned into our checkpoint format
//! (`config.json`, f32 `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`).
//!
//! Two sources (docs/import.md), each in a module of its own:
//! - a **GGUF** file of the `llama` architecture (llama.cpp's format), dequantised, with the
//!   rows of the query and key projections put back in Hugging Face order, and its tokenizer
//!   rebuilt from the metadata ([`tokenizer`]): `from_gguf`;
//! - a **Hugging Face** Llama directory: `config.json`, one or several `*.safetensors` (f32,
//!   f16 or bf16), `tokenizer.json` and `tokenizer_config.json`: `from_hf`.
//!
//! What both write, and how, is `output`.
//!
//! The output directory is written under a temporary name beside it and renamed into place, so
//! a failed import leaves nothing behind.
//!
//! GGUF files are read with [`crate::gguf::read`]. The way back, a standard checkpoint as a
//! GGUF file for llama.cpp, is `crate::export`, which uses the names and the tokenizer
//! metadata of this module.

pub mod convert;
mod from_gguf;
mod from_hf;
mod output;
pub mod quantize;
pub mod tokenizer;

use from_gguf::from_gguf;
pub(crate) use from_gguf::gguf_name;
pub use from_gguf::{permute_rows, unpermute_rows};
use from_hf::from_hf_dir;

use anyhow::{Context, Result};
use output::{check_out, write_dir};
pub use output::{Summary, CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE};
use std::path::Path;

/// Imports `from` (a GGUF file or a Hugging Face directory) into the checkpoint directory
/// `out`. An `out` that exists and is not empty is replaced only with `force`.
pub fn import(from: &Path, out: &Path, force: bool, keep_blocks: bool) -> Result<Summary> {
    let meta =
        std::fs::metadata(from).with_context(|| format!("cannot read {}", from.display()))?;
    crate::base::fs::refuse_output_over_input(out, from, "--from")?;
    check_out(out, force)?;
    let (files, summary) = if meta.is_dir() {
        from_hf_dir(from).with_context(|| format!("cannot import {}", from.display()))?
    } else {
        from_gguf(from, keep_blocks).with_context(|| format!("cannot import {}", from.display()))?
    };
    write_dir(out, &files)?;
    Ok(summary)
}
