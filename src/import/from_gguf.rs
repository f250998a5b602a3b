//! Import from a GGUF file of the `llama` architecture (llama.cpp's format): the metadata read
//! as our config, each tensor checked against ours, dequantised or kept in its block format,
//! and the query and key rows put back in Hugging Face order.

use super::output::{check_tokenizer, Files, Summary};
use super::tokenizer;
use crate::gguf::read::{Gguf, TensorInfo};
use crate::gguf::{type_name, Value};
use crate::kernels::quant::matrix::{Bytes, QuantMatrix, QuantPart};
use crate::model::params::{Layout, ParamSpec};
use crate::model::quantize::part_of;
use crate::model::{Config, Model};
use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value as Json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// The GGUF counterpart of our tensor `spec`, checked against its shape, and the number of
/// heads whose rows llama.cpp reordered (query and key projections).
fn gguf_tensor<'g>(
    g: &'g Gguf,
    spec: &ParamSpec,
    config: &Config,
) -> Result<(&'g TensorInfo, Option<usize>)> {
    let (gname, heads) = gguf_name(&spec.name, config)
        .with_context(|| format!("tensor {} has no GGUF counterpart", spec.name))?;
    let t = g.tensor(&gname).with_context(|| {
        format!("the file lacks tensor {gname:?} (our {}), which the metadata implies", spec.name)
    })?;
    ensure!(
        t.shape() == spec.shape,
        "tensor {gname:?} has shape {:?}, but the metadata implies {:?}",
        t.shape(),
        spec.shape
    );
    Ok((t, heads))
}

/// The matrices of `layout` whose GGUF tensors are all in block formats, kept as they are
/// (query and key rows put back in Hugging Face order), by their range's start.
fn gguf_blocks(g: &Gguf, layout: &Layout, config: &Config) -> Result<BTreeMap<usize, QuantMatrix>> {
    let mut quant = BTreeMap::new();
    'matrices: for m in layout.matrices() {
        let specs = layout.specs_in(&m);
        let mut parts = Vec::new();
        for &i in &specs {
            let spec = &layout.specs[i];
            let (t, heads) = gguf_tensor(g, spec, config)?;
            // A product whose tensors are not all in blocks runs in f32.
            let Some((format, bytes)) = g.blocks(t)? else { continue 'matrices };
            let rows = spec.shape[0];
            let data = match heads {
                Some(h) => unpermute_rows(bytes, h, bytes.len() / rows),
                None => bytes.to_vec(),
            };
            parts.push(QuantPart::new(spec.name.clone(), format, rows, Bytes::from_vec(data)));
        }
        let cols = *layout.specs[specs[0]].shape.last().unwrap_or(&1);
        let matrix = QuantMatrix::new(cols, parts)?;
        for p in &matrix.parts {
            if let Some(i) = first_non_finite(p) {
                bail!("tensor {:?} holds a non-finite value at index {i}", p.name);
            }
        }
        quant.insert(m.start, matrix);
    }
    Ok(quant)
}

/// The index of the first value of `p` that is not finite.
fn first_non_finite(p: &QuantPart) -> Option<usize> {
    let rb = p.data.len() / p.rows;
    let mut row = Vec::new();
    (0..p.rows).find_map(|r| {
        row.clear();
        crate::kernels::quant::dequantize_into(p.format, &p.data[r * rb..(r + 1) * rb], &mut row);
        row.iter().position(|x| !x.is_finite()).map(|i| r * row.len() + i)
    })
}

pub(super) fn from_gguf(path: &Path, keep_blocks: bool) -> Result<(Files, Summary)> {
    let map = crate::base::fs::map_file(path)?;
    let g = Gguf::parse(&map)?;
    let config = gguf_config(&g)?;
    let layout = Layout::new(&config);
    let quant = if keep_blocks { gguf_blocks(&g, &layout, &config)? } else { BTreeMap::new() };
    let mut params = crate::base::alloc::untouched_zeros(layout.total);
    let mut used = BTreeSet::new();
    let mut types = BTreeMap::new();
    for spec in &layout.specs {
        let (t, heads) = gguf_tensor(&g, spec, &config)?;
        used.insert(t.name.clone());
        *types.entry(type_name(t.type_id)).or_insert(0) += 1;
        if part_of(&quant, spec).is_some() {
            continue;
        }
        let mut values = g.dequantize(t)?;
        if let Some(h) = heads {
            values = unpermute_rows(&values, h, spec.shape[1]);
        }
        if let Some(i) = values.iter().position(|x| !x.is_finite()) {
            bail!("tensor {:?} holds a non-finite value at index {i}", t.name);
        }
        params[spec.range.clone()].copy_from_slice(&values);
    }
    for t in &g.tensors {
        if used.contains(&t.name) {
            continue;
        }
        if t.name == "rope_freqs.weight" {
            bail!("tensor \"rope_freqs.weight\": RoPE frequency scaling (Llama 3.1 style) is not supported");
        }
        bail!("tensor {:?} is not part of a Llama model as this engine runs it", t.name);
    }
    let rebuilt = tokenizer::rebuild(&g).context("tokenizer")?;
    ensure!(
        rebuilt.vocab_size == config.vocab_size,
        "the tokenizer has {} tokens, the embedding {} rows",
        rebuilt.vocab_size,
        config.vocab_size
    );
    let tokenizer_json = serde_json::to_string(&rebuilt.tokenizer)?;
    check_tokenizer(&tokenizer_json, Some(&rebuilt.config), config.vocab_size)
        .context("the rebuilt tokenizer does not load")?;
    let pre = g.get("tokenizer.ggml.pre").and_then(Value::as_str).unwrap_or("default");
    let name = g.get("general.name").and_then(Value::as_str).map(str::to_string);
    let kept = quant.values().map(|q| q.parts.len()).sum();
    let summary = Summary {
        source: name
            .map_or_else(|| path.display().to_string(), |n| format!("{n:?} ({})", path.display())),
        parameters: layout.total,
        types,
        kept,
        tokenizer: if rebuilt.kind == "gpt2" {
            format!("byte-level BPE (pre-tokenizer {pre})")
        } else {
            "SentencePiece BPE".into()
        },
        config: config.clone(),
    };
    let files = Files {
        model: Model::new(config, params)?.with_quant(quant)?,
        tokenizer: Some(tokenizer_json),
        tokenizer_config: Some(serde_json::to_string_pretty(&rebuilt.config)?),
        chat_template: None,
    };
    Ok((files, summary))
}

/// The model's shape from the `llama.*` metadata.
fn gguf_config(g: &Gguf) -> Result<Config> {
    let arch = match g.get("general.architecture") {
        Some(Value::Str(a)) => a.clone(),
        Some(v) => bail!("general.architecture is a {}, not a string", v.type_name()),
        None => bail!("the file has no general.architecture"),
    };
    ensure!(
        arch == "llama",
        "GGUF architecture {arch:?} is not supported: only \"llama\" models import"
    );
    let get = |k: &str| g.get(&format!("llama.{k}"));
    let int = |k: &str| -> Result<Option<u64>> {
        get(k)
            .map(|v| {
                v.as_u64().with_context(|| format!("llama.{k} is a {}, not a count", v.type_name()))
            })
            .transpose()
    };
    let need =
        |k: &str| -> Result<u64> { int(k)?.with_context(|| format!("the file lacks llama.{k}")) };
    let float = |k: &str| -> Result<Option<f64>> {
        get(k)
            .map(|v| match v {
                Value::F32(x) => Ok(as_written(*x)),
                _ => v
                    .as_f64()
                    .with_context(|| format!("llama.{k} is a {}, not a number", v.type_name())),
            })
            .transpose()
    };
    if let Some(e) = int("expert_count")? {
        ensure!(e == 0, "llama.expert_count = {e}: mixture-of-experts models are not supported");
    }
    if let Some(v) = get("rope.scaling.type") {
        let t = v.as_str().unwrap_or("?");
        ensure!(t == "none", "llama.rope.scaling.type = {t:?}: RoPE scaling is not supported");
    }
    for k in ["rope.scale_linear", "rope.scaling.factor"] {
        if let Some(f) = float(k)? {
            ensure!(f == 1.0 || f == 0.0, "llama.{k} = {f}: RoPE scaling is not supported");
        }
    }
    let hidden = need("embedding_length")?;
    let heads = need("attention.head_count")?;
    let kv = int("attention.head_count_kv")?.unwrap_or(heads);
    ensure!(heads > 0, "llama.attention.head_count is 0");
    let head_dim = match int("attention.key_length")? {
        Some(k) => k,
        None => {
            ensure!(hidden.is_multiple_of(heads), "llama.attention.head_count ({heads}) does not divide llama.embedding_length ({hidden})");
            hidden / heads
        }
    };
    if let Some(v) = int("attention.value_length")? {
        ensure!(v == head_dim, "llama.attention.value_length ({v}) differs from the key length ({head_dim}): not supported");
    }
    if let Some(r) = int("rope.dimension_count")? {
        ensure!(
            r == head_dim,
            "llama.rope.dimension_count = {r}, but heads have {head_dim} dimensions: partial rotary embedding is not supported"
        );
    }
    let vocab = match (g.get("tokenizer.ggml.tokens").and_then(Value::as_array), int("vocab_size")?)
    {
        (Some(t), _) => t.len() as u64,
        (None, Some(v)) => v,
        (None, None) => {
            let e = g.tensor("token_embd.weight").context("the file lacks token_embd.weight")?;
            *e.dims.last().expect("a tensor has dimensions")
        }
    };
    let eps = float("attention.layer_norm_rms_epsilon")?
        .context("the file lacks llama.attention.layer_norm_rms_epsilon")?;
    let map = json!({
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length")?,
        "num_hidden_layers": need("block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "max_position_embeddings": need("context_length")?,
        "rms_norm_eps": eps,
        "rope_theta": float("rope.freq_base")?.unwrap_or(10000.0),
        "tie_word_embeddings": g.tensor("output.weight").is_none(),
        "residual": "standard",
    });
    let Json::Object(map) = map else { unreachable!() };
    Config::from_map(map).context("the metadata describes a model this engine cannot run")
}

/// A float32 value as the decimal it was written from: `1e-5` is stored as 9.99999975e-6, whose
/// shortest decimal form, read as f64, is `1e-5` again (so an exported model imports with its
/// own config values, and an imported one with those of the model's Hugging Face config).
fn as_written(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(x as f64)
}

/// The GGUF name of one of our tensors, and for `q_proj` and `k_proj` the number of heads whose
/// rows llama.cpp reordered.
pub(crate) fn gguf_name(name: &str, c: &Config) -> Option<(String, Option<usize>)> {
    let fixed = match name {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some((f.to_string(), None));
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (i, part) = rest.split_once('.')?;
    let (g, heads) = match part {
        "input_layernorm.weight" => ("attn_norm", None),
        "self_attn.q_proj.weight" => ("attn_q", Some(c.num_attention_heads)),
        "self_attn.k_proj.weight" => ("attn_k", Some(c.num_key_value_heads)),
        "self_attn.v_proj.weight" => ("attn_v", None),
        "self_attn.o_proj.weight" => ("attn_output", None),
        "post_attention_layernorm.weight" => ("ffn_norm", None),
        "mlp.gate_proj.weight" => ("ffn_gate", None),
        "mlp.up_proj.weight" => ("ffn_up", None),
        "mlp.down_proj.weight" => ("ffn_down", None),
        _ => return None,
    };
    Some((format!("blk.{i}.{g}.weight"), heads))
}

/// Undoes llama.cpp's reordering of the query and key rows. Its converter
/// (`convert_hf_to_gguf.py`, `LlamaModel.permute`) moves, within each head of `head_dim` rows,
/// row `j·head_dim/2 + i` (rotate-half order: first halves, then second halves) to row `2i + j`
/// (interleaved pairs), for its RoPE that rotates adjacent pairs. Our RoPE rotates the two
/// halves, as Hugging Face's does, so the rows go back.
pub fn unpermute_rows<T: Copy + Default>(w: &[T], heads: usize, cols: usize) -> Vec<T> {
    move_rows(w, heads, cols, |half, i, j| (2 * i + j, j * half + i))
}

/// llama.cpp's reordering of the query and key rows, which [`unpermute_rows`] undoes: within
/// each head, row `j·head_dim/2 + i` moves to row `2i + j` (export writes rows in its order).
pub fn permute_rows<T: Copy + Default>(w: &[T], heads: usize, cols: usize) -> Vec<T> {
    move_rows(w, heads, cols, |half, i, j| (j * half + i, 2 * i + j))
}

/// Moves rows within each head: `(source, destination)` rows in the head for pair `i`, half `j`.
fn move_rows<T: Copy + Default>(
    w: &[T],
    heads: usize,
    cols: usize,
    rows_of: impl Fn(usize, usize, usize) -> (usize, usize),
) -> Vec<T> {
    let hd = w.len() / cols / heads;
    let half = hd / 2;
    let mut out = vec![T::default(); w.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let (src, dst) = rows_of(half, i, j);
                let (src, dst) = ((h * hd + src) * cols, (h * hd + dst) * cols);
                out[dst..dst + cols].copy_from_slice(&w[src..src + cols]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llama.cpp's permutation as its converter writes it (reshape to [heads, 2, hd/2, cols],
    /// swap the middle axes), applied to row indices; `unpermute_rows` must invert it.
    #[test]
    fn unpermute_inverts_llama_cpps_permutation() {
        let (heads, hd, cols) = (3, 8, 2);
        let rows = heads * hd;
        let original: Vec<f32> = (0..rows * cols).map(|x| x as f32).collect();
        let mut permuted = vec![0.0; rows * cols];
        for h in 0..heads {
            for two in 0..2 {
                for k in 0..hd / 2 {
                    // source [h, two, k] lands at [h, k, two]
                    let src = h * hd + two * (hd / 2) + k;
                    let dst = h * hd + k * 2 + two;
                    permuted[dst * cols..dst * cols + cols]
                        .copy_from_slice(&original[src * cols..src * cols + cols]);
                }
            }
        }
        assert_ne!(permuted, original);
        assert_eq!(unpermute_rows(&permuted, heads, cols), original);
        assert_eq!(permute_rows(&original, heads, cols), permuted);
    }

    /// Export's row order is undone by import's, for queries and keys alike, on values and on
    /// rows of quantised bytes.
    #[test]
    fn unpermute_inverts_permute() {
        for (heads, hd, cols) in [(4, 16, 64), (1, 4, 3), (2, 64, 34)] {
            let w: Vec<u16> = (0..heads * hd * cols).map(|x| (x * 7919 % 65521) as u16).collect();
            let p = permute_rows(&w, heads, cols);
            assert_ne!(p, w);
            assert_eq!(unpermute_rows(&p, heads, cols), w);
        }
    }
}
