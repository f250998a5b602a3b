//! `attnres import`: Llama-family checkpoints from elsewhere turned into our checkpoint format
//! (`config.json`, f32 `model.safetensors`, `tokenizer.json`, `tokenizer_config.json`).
//!
//! Two sources (docs/import.md):
//! - a **GGUF** file of the `llama` architecture (llama.cpp's format), dequantised, with the
//!   rows of the query and key projections put back in Hugging Face order, and its tokenizer
//!   rebuilt from the metadata ([`tokenizer`]);
//! - a **Hugging Face** Llama directory: `config.json`, one or several `*.safetensors` (f32,
//!   f16 or bf16), `tokenizer.json` and `tokenizer_config.json`.
//!
//! The output directory is written under a temporary name beside it and renamed into place, so
//! a failed import leaves nothing behind.
//!
//! The way back, a standard checkpoint as a GGUF file for llama.cpp, is [`export`], written with
//! [`gguf_writer`].

pub mod convert;
pub mod export;
pub mod gguf;
pub mod gguf_writer;
pub mod quantize;
pub mod tokenizer;

use crate::base::fs::write_atomic;
use crate::kernels::quant::matrix::{Bytes, QuantMatrix, QuantPart};
use crate::model::checkpoint::{self, CONFIG_FILE};
use crate::model::params::{Layout, ParamSpec};
use crate::model::quantize::part_of;
use crate::model::{Config, Model};
use crate::text::tokenizer::{eos_token, Bpe};
use anyhow::{bail, ensure, Context, Result};
use gguf::{Gguf, Value};
use serde_json::{json, Map, Value as Json};
use std::collections::{BTreeMap, BTreeSet};
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
struct Files {
    model: Model,
    /// `tokenizer.json` (a converted checkpoint without one has none).
    tokenizer: Option<String>,
    tokenizer_config: Option<String>,
    chat_template: Option<String>,
}

impl Files {
    /// `model` with the tokenizer files of the checkpoint directory `dir` (those it has), and
    /// their names.
    fn carried(dir: &Path, model: Model) -> Result<(Files, Vec<&'static str>)> {
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

/// Refuses an `out` that exists and is not empty, unless `force`.
fn check_out(out: &Path, force: bool) -> Result<()> {
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
fn write_dir(out: &Path, files: &Files) -> Result<()> {
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
fn check_tokenizer(json: &str, config: Option<&Json>, model_vocab: usize) -> Result<Bpe> {
    let bpe = Bpe::from_json_with_eos(json, config.and_then(eos_token))?;
    ensure!(
        bpe.vocab_size() <= model_vocab,
        "the tokenizer has {} tokens, the model's vocabulary only {model_vocab}",
        bpe.vocab_size()
    );
    Ok(bpe)
}

// ---------------------------------------------------------------------------------------------
// GGUF

/// The GGUF counterpart of our tensor `spec`, checked against its shape, and the number of
/// heads whose rows llama.cpp reordered (query and key projections).
fn gguf_tensor<'g>(
    g: &'g Gguf,
    spec: &ParamSpec,
    config: &Config,
) -> Result<(&'g gguf::TensorInfo, Option<usize>)> {
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

fn from_gguf(path: &Path, keep_blocks: bool) -> Result<(Files, Summary)> {
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
        *types.entry(gguf::type_name(t.type_id)).or_insert(0) += 1;
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
fn gguf_name(name: &str, c: &Config) -> Option<(String, Option<usize>)> {
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

// ---------------------------------------------------------------------------------------------
// Hugging Face directories

/// `config.json` keys that Llama checkpoints on the Hub carry and that do not change the
/// computation; dropped on import.
const HF_DROPPED_KEYS: &[&str] = &[
    "is_llama_config",
    "transformers.js_config",
    "torch_dtype",
    "dtype",
    "_model_name_or_path",
    "unk_token_id",
];

const INDEX_FILE: &str = "model.safetensors.index.json";

fn from_hf_dir(dir: &Path) -> Result<(Files, Summary)> {
    let cpath = dir.join(CONFIG_FILE);
    ensure!(cpath.exists(), "{} has no {CONFIG_FILE}", dir.display());
    let config = hf_config(&crate::base::fs::read_utf8(&cpath)?)
        .with_context(|| format!("in {}", cpath.display()))?;
    let shards = weight_files(dir)?;
    let layout = Layout::new(&config);
    let mut params = vec![0.0f32; layout.total];
    let mut found = BTreeSet::new();
    let mut types = BTreeMap::new();
    for (file, names) in &shards {
        let map = crate::base::fs::map_file(file)?;
        let st = safetensors::SafeTensors::deserialize(&map).map_err(|e| {
            anyhow::anyhow!("{} is not a valid safetensors file: {e}", file.display())
        })?;
        for (name, t) in st.tensors() {
            if let Some(names) = names {
                if !names.contains(&name) {
                    continue; // the index places it in another file
                }
            }
            if name.ends_with("rotary_emb.inv_freq")
                || (name == "lm_head.weight" && config.tie_word_embeddings)
            {
                continue; // recomputed / tied to the embedding
            }
            let spec = layout.spec(&name).with_context(|| {
                format!(
                    "tensor {name:?} in {} is not part of a Llama model as this engine runs it",
                    file.display()
                )
            })?;
            ensure!(
                t.shape() == spec.shape.as_slice(),
                "tensor {name:?} has shape {:?}, config.json implies {:?}",
                t.shape(),
                spec.shape
            );
            let values = to_f32(&name, &t)?;
            if let Some(i) = values.iter().position(|x| !x.is_finite()) {
                bail!("tensor {name:?} holds a non-finite value at index {i}");
            }
            ensure!(found.insert(name.clone()), "tensor {name:?} appears twice");
            params[spec.range.clone()].copy_from_slice(&values);
            *types.entry(format!("{:?}", t.dtype())).or_insert(0) += 1;
        }
    }
    let missing: Vec<&str> =
        layout.specs.iter().map(|s| s.name.as_str()).filter(|n| !found.contains(*n)).collect();
    ensure!(missing.is_empty(), "the weights lack tensor(s): {}", missing.join(", "));
    let tpath = dir.join(TOKENIZER_FILE);
    ensure!(tpath.exists(), "{} has no {TOKENIZER_FILE}", dir.display());
    let tokenizer = crate::base::fs::read_utf8(&tpath)?;
    let tcpath = dir.join(TOKENIZER_CONFIG_FILE);
    let tokenizer_config =
        if tcpath.exists() { Some(crate::base::fs::read_utf8(&tcpath)?) } else { None };
    let tc_json = match &tokenizer_config {
        Some(t) => Some(
            serde_json::from_str::<Json>(t)
                .with_context(|| format!("{} is not valid JSON", tcpath.display()))?,
        ),
        None => None,
    };
    check_tokenizer(&tokenizer, tc_json.as_ref(), config.vocab_size)
        .with_context(|| format!("{} does not load", tpath.display()))?;
    let jpath = dir.join(CHAT_TEMPLATE_FILE);
    let chat_template =
        if jpath.exists() { Some(crate::base::fs::read_utf8(&jpath)?) } else { None };
    let summary = Summary {
        source: dir.display().to_string(),
        config: config.clone(),
        parameters: layout.total,
        kept: 0,
        types,
        tokenizer: "tokenizer.json as given".into(),
    };
    let files = Files {
        model: Model::new(config, params)?,
        tokenizer: Some(tokenizer),
        tokenizer_config,
        chat_template,
    };
    Ok((files, summary))
}

/// A Hugging Face Llama `config.json`, converted to f32.
fn hf_config(text: &str) -> Result<Config> {
    let value: Json = serde_json::from_str(text).context("config.json is not valid JSON")?;
    let Json::Object(mut map) = value else { bail!("config.json must hold a JSON object") };
    if let Some(a) = map.get("architectures") {
        let known = ["LlamaForCausalLM", crate::model::config::ATTNRES_ARCHITECTURE];
        let ok = a.as_array().is_some_and(|a| a.iter().any(|x| known.iter().any(|k| x == k)));
        ensure!(ok, "architectures = {a}: only LlamaForCausalLM and AttnResForCausalLM (an attnres checkpoint saved by transformers) import");
    }
    if let Some(q) = map.get("quantization_config") {
        bail!("quantization_config = {q}: quantised Hugging Face checkpoints are not supported (f32, f16 and bf16 are)");
    }
    if let Some(v) = map.get("rope_interleaved") {
        ensure!(v == &Json::Bool(false), "rope_interleaved = {v} is not supported");
        map.remove("rope_interleaved");
    }
    for k in HF_DROPPED_KEYS {
        map.remove(*k);
    }
    map.insert("torch_dtype".into(), json!("float32"));
    Config::from_map(map)
}

/// The safetensors files of a directory: `model.safetensors`, or the files an index names, each
/// with the tensor names the index assigns to it.
type Shards = Vec<(PathBuf, Option<BTreeSet<String>>)>;

fn weight_files(dir: &Path) -> Result<Shards> {
    let single = dir.join(checkpoint::WEIGHTS_FILE);
    let index = dir.join(INDEX_FILE);
    if index.exists() {
        let text = crate::base::fs::read_utf8(&index)?;
        let v: Json = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", index.display()))?;
        let map: &Map<String, Json> = v["weight_map"]
            .as_object()
            .with_context(|| format!("{} has no weight_map object", index.display()))?;
        let mut files: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (name, file) in map {
            let file = file.as_str().with_context(|| {
                format!("{}: weight_map[{name:?}] is not a file name", index.display())
            })?;
            ensure!(
                !file.contains('/') && !file.contains('\\') && file != ".." && !file.is_empty(),
                "{}: weight_map[{name:?}] = {file:?} is not a file name in the directory",
                index.display()
            );
            files.entry(file.to_string()).or_default().insert(name.clone());
        }
        ensure!(!files.is_empty(), "{} lists no tensors", index.display());
        return files
            .into_iter()
            .map(|(f, names)| {
                let p = dir.join(&f);
                ensure!(p.exists(), "{} names {f}, which does not exist", index.display());
                Ok((p, Some(names)))
            })
            .collect();
    }
    if single.exists() {
        return Ok(vec![(single, None)]);
    }
    let other = ["pytorch_model.bin", "model.pt", "consolidated.00.pth"]
        .iter()
        .find(|f| dir.join(f).exists());
    match other {
        Some(f) => bail!(
            "{} holds {f}: only safetensors weights import (model.safetensors or {INDEX_FILE})",
            dir.display()
        ),
        None => bail!("{} has no weights (model.safetensors or {INDEX_FILE})", dir.display()),
    }
}

/// A safetensors tensor as f32 values: F32 as it is, F16 and BF16 converted exactly (as the
/// same types of a GGUF file are).
fn to_f32(name: &str, t: &safetensors::tensor::TensorView) -> Result<Vec<f32>> {
    use safetensors::tensor::Dtype;
    let ty = match t.dtype() {
        Dtype::F32 => gguf::GgmlType::F32,
        Dtype::F16 => gguf::GgmlType::Blocks(crate::kernels::quant::Format::F16),
        Dtype::BF16 => gguf::GgmlType::BF16,
        other => bail!("tensor {name:?} has dtype {other:?}; import reads F32, F16 and BF16"),
    };
    Ok(gguf::dequantize(ty, t.data()))
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

    #[test]
    fn hf_configs_lose_their_dtype_and_keep_their_shape() {
        let text = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama","vocab_size":100,
            "hidden_size":32,"intermediate_size":64,"num_hidden_layers":2,"num_attention_heads":4,
            "num_key_value_heads":2,"max_position_embeddings":64,"rms_norm_eps":1e-5,"rope_theta":1e5,
            "torch_dtype":"bfloat16","is_llama_config":true,"rope_interleaved":false,"tie_word_embeddings":true}"#;
        let c = hf_config(text).unwrap();
        assert_eq!((c.torch_dtype.as_str(), c.head_dim, c.num_key_value_heads), ("float32", 8, 2));
        let e = hf_config(&text.replace("LlamaForCausalLM", "MistralForCausalLM")).unwrap_err();
        assert!(e.to_string().contains("only LlamaForCausalLM"), "{e}");
        let e = hf_config(&text.replace("\"rope_interleaved\":false", "\"rope_interleaved\":true"))
            .unwrap_err();
        assert!(e.to_string().contains("rope_interleaved"), "{e}");
    }
}
