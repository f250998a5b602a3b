//! `attnres export --to gguf`: a standard checkpoint as a GGUF file of llama.cpp's `llama`
//! architecture with its tokenizer, the inverse of the GGUF import: the tensor names and
//! metadata keys import reads ([`crate::import::gguf_name`]), the query and key rows in
//! llama.cpp's order ([`crate::import::permute_rows`]), the tokenizer as `tokenizer.ggml.*`
//! metadata ([`crate::import::tokenizer::describe`]), written with [`crate::gguf::write`].
//!
//! Types: `f32` writes every tensor F32. `f16` and `q8_0` store the weight matrices as
//! `attnres quantize` does (the same bytes, the embedding included, as in llama.cpp's own Q8_0
//! files; a Q8_0 matrix whose rows are not whole 32-value blocks stays F32); norms stay F32.
//!
//! Refused: AttnRes models (llama.cpp has no architecture for a Llama with depth attention; they
//! load in transformers instead), and quantised checkpoints (export their f32 original).

use crate::base::fs::{read_utf8, refuse_non_file, refuse_output_over_input, write_atomic_with};
use crate::base::memory::format_bytes;
use crate::gguf::write::{File, Tensor, ALIGNMENT};
use crate::gguf::{GgmlType, Value};
use crate::import::{gguf_name, permute_rows, tokenizer, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE};
use crate::kernels::quant::Format;
use crate::model::checkpoint::{self, CONFIG_FILE};
use crate::model::config::ResidualKind;
use crate::model::quantize::quantize;
use crate::model::{Config, Model};
use crate::text::chat::ChatTemplate;
use anyhow::{ensure, Context, Result};
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::Path;

/// What an export wrote, for the log line.
pub struct Exported {
    /// Tensors per GGUF type.
    pub tensors: BTreeMap<&'static str, usize>,
    pub bytes: usize,
    pub tokens: usize,
    pub merges: usize,
    pub pre: &'static str,
    pub chat_template: bool,
}

impl Exported {
    pub fn line(&self, model: &Path, out: &Path) -> String {
        let tensors: Vec<String> = self.tensors.iter().map(|(t, n)| format!("{n} {t}")).collect();
        format!(
            "exported {} into {} (GGUF, llama): tensors {}, {}; tokenizer gpt2 ({} tokens, {} merges, pre-tokenizer {}{})",
            model.display(),
            out.display(),
            tensors.join(", "),
            format_bytes(self.bytes as u128),
            self.tokens,
            self.merges,
            self.pre,
            if self.chat_template { ", chat template" } else { "" }
        )
    }
}

/// Writes the checkpoint in `model` as the GGUF file `out`, whole or not at all, with the weight
/// matrices in `to` (`None`: F32); an existing `out` is replaced only with `force`.
pub fn export(model: &Path, to: Option<Format>, out: &Path, force: bool) -> Result<Exported> {
    if let Some(f) = to {
        let made = crate::model::quantize::targets();
        ensure!(made.contains(&f), "export writes f32, {}", crate::model::quantize::names(&made));
    }
    refuse_output_over_input(out, model, "--model")?;
    refuse_non_file(out)?;
    ensure!(!out.exists() || force, "{} already exists; pass --force to replace it", out.display());
    ensure!(model.is_dir(), "{} is not a checkpoint directory", model.display());
    let cpath = model.join(CONFIG_FILE);
    let config = Config::from_json(&read_utf8(&cpath)?)
        .with_context(|| format!("in {}", cpath.display()))?;
    ensure!(
        config.residual == ResidualKind::Standard,
        "{} is an Attention Residuals model (residual = {}): llama.cpp has no architecture for a Llama with depth attention, so only standard models export to GGUF; load this checkpoint in transformers instead (trust_remote_code)",
        model.display(),
        config.residual_label()
    );

    let tpath = model.join(TOKENIZER_FILE);
    ensure!(
        tpath.exists(),
        "{} has no {TOKENIZER_FILE}: a GGUF file carries its tokenizer, and llama.cpp needs one",
        model.display()
    );
    let json = |path: &Path| -> Result<Json> {
        serde_json::from_str(&read_utf8(path)?)
            .with_context(|| format!("{} is not valid JSON", path.display()))
    };
    let tcpath = model.join(TOKENIZER_CONFIG_FILE);
    let tc = if tcpath.exists() { Some(json(&tcpath)?) } else { None };
    let template = ChatTemplate::find(model)?.map(|t| t.source);
    let described =
        tokenizer::describe(&json(&tpath)?, tc.as_ref(), template.as_deref(), config.vocab_size)
            .with_context(|| format!("cannot export the tokenizer {}", tpath.display()))?;

    let src = checkpoint::load(model)
        .with_context(|| format!("cannot read the model {}", model.display()))?;
    ensure!(
        !src.is_quantized(),
        "{} is quantised ({}): export its f32 original (--dtype f16 or q8_0 makes a smaller file)",
        model.display(),
        src.storage_label()
    );
    let stored = match to {
        None => src,
        Some(f) => quantize(&src, f)?.model,
    };
    let name = model
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| "attnres".into());
    let mut meta = metadata(&stored.config, &name, to);
    meta.extend(described.metadata);
    let file = File { metadata: meta, tensors: tensors(&stored)? };
    let header = file.header()?;
    write_atomic_with(out, |w| file.write(&header, w))?;

    let mut counts = BTreeMap::new();
    for t in &file.tensors {
        *counts.entry(type_name(t.ty)).or_insert(0) += 1;
    }
    Ok(Exported {
        tensors: counts,
        bytes: header.len()
            + file.tensors.iter().map(|t| t.data.len().next_multiple_of(ALIGNMENT)).sum::<usize>(),
        tokens: config.vocab_size,
        merges: described.merges,
        pre: described.pre,
        chat_template: template.is_some(),
    })
}

fn type_name(ty: GgmlType) -> &'static str {
    match ty {
        GgmlType::F32 => "F32",
        GgmlType::BF16 => "BF16",
        GgmlType::Blocks(f) => f.name(),
    }
}

/// The `general.*` and `llama.*` metadata: what import's `gguf_config` reads.
fn metadata(c: &Config, name: &str, to: Option<Format>) -> Vec<(String, Value)> {
    // llama.cpp's `llama_ftype`: all F32, mostly F16, mostly Q8_0.
    let file_type = to.map_or(0, |f| f.ops().file_type);
    let count = |n: usize| Value::U32(n as u32);
    let m = vec![
        ("general.architecture", Value::Str("llama".into())),
        ("general.name", Value::Str(name.into())),
        ("general.alignment", count(ALIGNMENT)),
        ("general.file_type", Value::U32(file_type)),
        ("llama.vocab_size", count(c.vocab_size)),
        ("llama.context_length", count(c.max_position_embeddings)),
        ("llama.embedding_length", count(c.hidden_size)),
        ("llama.block_count", count(c.num_hidden_layers)),
        ("llama.feed_forward_length", count(c.intermediate_size)),
        ("llama.attention.head_count", count(c.num_attention_heads)),
        ("llama.attention.head_count_kv", count(c.num_key_value_heads)),
        ("llama.attention.key_length", count(c.head_dim)),
        ("llama.attention.value_length", count(c.head_dim)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(c.rms_norm_eps as f32)),
        ("llama.rope.freq_base", Value::F32(c.rope_theta as f32)),
        ("llama.rope.dimension_count", count(c.head_dim)),
    ];
    m.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// Every tensor of `model` under its GGUF name, dims innermost first: the quantised ones as
/// their blocks, the others as F32, query and key rows in llama.cpp's order.
fn tensors(model: &Model) -> Result<Vec<Tensor>> {
    model
        .layout
        .specs
        .iter()
        .map(|spec| {
            let (name, heads) = gguf_name(&spec.name, &model.config)
                .with_context(|| format!("tensor {} has no GGUF counterpart", spec.name))?;
            let (ty, data) = match model.quant_part(spec) {
                Some(p) => {
                    let data = match heads {
                        Some(h) => permute_rows(&p.data, h, p.data.len() / p.rows),
                        None => p.data.to_vec(),
                    };
                    (GgmlType::Blocks(p.format), data)
                }
                None => {
                    let values = &model.params[spec.range.clone()];
                    let values = match heads {
                        Some(h) => permute_rows(values, h, spec.shape[1]),
                        None => values.to_vec(),
                    };
                    (GgmlType::F32, values.iter().flat_map(|v| v.to_le_bytes()).collect())
                }
            };
            let dims = spec.shape.iter().rev().map(|&d| d as u64).collect();
            Ok(Tensor { name, dims, ty, data })
        })
        .collect()
}
