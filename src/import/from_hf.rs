//! Import from a Hugging Face Llama directory: `config.json`, one or several `*.safetensors`
//! (f32, f16 or bf16, sharded or not), `tokenizer.json` and `tokenizer_config.json`.

use super::output::{
    check_tokenizer, Files, Summary, CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE,
};
use crate::gguf::{read::dequantize, GgmlType};
use crate::model::checkpoint::{self, CONFIG_FILE};
use crate::model::params::Layout;
use crate::model::{Config, Model};
use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Map, Value as Json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

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

pub(super) fn from_hf_dir(dir: &Path) -> Result<(Files, Summary)> {
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
        Dtype::F32 => GgmlType::F32,
        Dtype::F16 => GgmlType::Blocks(crate::kernels::quant::Format::F16),
        Dtype::BF16 => GgmlType::BF16,
        other => bail!("tensor {name:?} has dtype {other:?}; import reads F32, F16 and BF16"),
    };
    Ok(dequantize(ty, t.data()))
}

#[cfg(test)]
mod tests {
    use super::*;

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
