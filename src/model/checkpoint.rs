//! Checkpoint directories: `config.json` (Hugging Face Llama format plus `residual` and
//! `num_blocks`) and `model.safetensors` (Hugging Face tensor names, f32). Files are written to
//! a temporary name and renamed, so a crash never leaves a half-written file under the real name.

use super::config::Config;
use super::params::Layout;
use super::quantize::part_of;
use super::transformer::Model;
use crate::base::fs::{write_atomic, write_atomic_parts};
use crate::base::memory::format_bytes;
use crate::kernels::quant::matrix::{Bytes, QuantMatrix, QuantPart};
use crate::kernels::quant::Format;
use crate::text::tokenizer::Bpe;
use anyhow::{bail, ensure, Context, Result};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::Path;
use std::sync::Arc;

pub const CONFIG_FILE: &str = "config.json";
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The largest safetensors header accepted (the `safetensors` crate's own limit: 100 MB).
const MAX_HEADER: u64 = 100_000_000 + 8;

/// Serialises named f32 tensors in safetensors format.
pub fn safetensors_bytes(
    tensors: &[(String, Vec<usize>, &[f32])],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    Ok(safetensors_parts(tensors, metadata)?.concat())
}

/// The safetensors encoding of named f32 tensors as parts to write one after another: the
/// header's length, the header, then each tensor's bytes. On a little-endian machine a tensor's
/// part is its values' own memory, so a checkpoint is written without a copy of the weights
/// (for a 135M-parameter model the optimiser's moments alone are 1.6 GB).
pub fn safetensors_parts<'a>(
    tensors: &'a [(String, Vec<usize>, &'a [f32])],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<Cow<'a, [u8]>>> {
    for (name, shape, data) in tensors {
        ensure!(
            shape.iter().product::<usize>() == data.len(),
            "tensor {name:?}: shape {shape:?} does not hold {} values",
            data.len()
        );
    }
    let shapes: Vec<(String, Vec<usize>)> =
        tensors.iter().map(|(n, s, _)| (n.clone(), s.clone())).collect();
    let mut parts = vec![Cow::Owned(safetensors_header(&shapes, metadata)?)];
    parts.extend(tensors.iter().map(|(_, _, d)| le_bytes(d)));
    Ok(parts)
}

/// The start of a safetensors file of f32 tensors of these names and shapes, whose values
/// follow it one tensor after another: the header's length, then the header.
pub fn safetensors_header(
    tensors: &[(String, Vec<usize>)],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let entries: Vec<Entry> = tensors
        .iter()
        .map(|(n, s)| Entry {
            name: n.clone(),
            dtype: "F32",
            shape: s.clone(),
            bytes: 4 * s.iter().product::<usize>(),
        })
        .collect();
    header_of(&entries, metadata)
}

/// A tensor as the safetensors header describes it.
struct Entry {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    bytes: usize,
}

fn header_of(entries: &[Entry], metadata: Option<HashMap<String, String>>) -> Result<Vec<u8>> {
    let mut header = serde_json::Map::new();
    if let Some(m) = metadata {
        header.insert("__metadata__".into(), serde_json::to_value(m)?);
    }
    let mut offset = 0usize;
    for e in entries {
        let end = offset + e.bytes;
        let info =
            serde_json::json!({"dtype": e.dtype, "shape": e.shape, "data_offsets": [offset, end]});
        ensure!(header.insert(e.name.clone(), info).is_none(), "tensor {:?} appears twice", e.name);
        offset = end;
    }
    // The format pads the header with spaces to a multiple of 8 bytes.
    let mut head = serde_json::to_vec(&header)?;
    head.resize(head.len().next_multiple_of(8), b' ');
    let mut out = (head.len() as u64).to_le_bytes().to_vec();
    out.extend(head);
    Ok(out)
}

/// The little-endian bytes of `values`.
pub fn le_bytes(values: &[f32]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        // SAFETY: the same memory read as bytes: f32 has no padding, every byte is a valid u8,
        // and u8 needs no alignment.
        Cow::Borrowed(unsafe {
            std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
        })
    } else {
        Cow::Owned(values.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

/// Reads an f32 tensor's values (little-endian) after checking its dtype.
pub fn f32_values(name: &str, t: &TensorView) -> Result<Vec<f32>> {
    ensure!(t.dtype() == Dtype::F32, "tensor {name:?} has dtype {:?}, expected F32", t.dtype());
    Ok(t.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
}

/// The metadata key that marks tensor `name` as stored in a block format; its value is the
/// format's ggml name (`Q8_0`, ...). The tensor itself is `U8` of shape `[rows, bytes per row]`.
fn quant_key(name: &str) -> String {
    format!("quant.{name}")
}

/// Saves a model as a checkpoint directory (created if needed): f32 tensors as `F32`, the
/// quantised ones as their blocks.
pub fn save(model: &Model, dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    let mut entries = Vec::new();
    let mut parts = Vec::new();
    for s in &model.layout.specs {
        let bytes = match model.quant_part(s) {
            Some(q) => {
                meta.insert(quant_key(&s.name), q.format.name().to_string());
                let row = q.data.len() / q.rows;
                entries.push(Entry {
                    name: s.name.clone(),
                    dtype: "U8",
                    shape: vec![q.rows, row],
                    bytes: q.data.len(),
                });
                Cow::Borrowed(&q.data[..])
            }
            None => {
                let values = &model.params[s.range.clone()];
                entries.push(Entry {
                    name: s.name.clone(),
                    dtype: "F32",
                    shape: s.shape.clone(),
                    bytes: 4 * values.len(),
                });
                le_bytes(values)
            }
        };
        parts.push(bytes);
    }
    parts.insert(0, Cow::Owned(header_of(&entries, Some(meta))?));
    write_atomic_parts(&dir.join(WEIGHTS_FILE), &parts)?;
    // The PyTorch module reads f32 tensors only.
    let quantised = model.layout.specs.iter().any(|s| model.quant_part(s).is_some());
    let remote_code = model.config.block_size().is_some() && !quantised;
    write_remote_code(remote_code, dir)?;
    write_atomic(&dir.join(CONFIG_FILE), model.config.to_json_with_module(remote_code).as_bytes())
}

/// The PyTorch module an AttnRes checkpoint carries for `transformers` (its `auto_map`),
/// written from docs/method.md; needs only torch and transformers (docs/interop.md).
pub const REMOTE_CODE: [(&str, &str); 2] = [
    ("configuration_attnres.py", include_str!("hf/configuration_attnres.py")),
    ("modeling_attnres.py", include_str!("hf/modeling_attnres.py")),
];

/// Writes the remote-code files beside an f32 AttnRes checkpoint (`write`), or removes stale
/// ones (a standard checkpoint is plain Llama, which `transformers` loads without them).
fn write_remote_code(write: bool, dir: &Path) -> Result<()> {
    for (name, text) in REMOTE_CODE {
        let path = dir.join(name);
        if write {
            write_atomic(&path, text.as_bytes())?;
        } else if path.exists() {
            fs::remove_file(&path).with_context(|| format!("cannot remove {}", path.display()))?;
        }
    }
    Ok(())
}

/// Loads and validates a checkpoint directory. Every mismatch is an error naming the tensor.
/// The weights file is memory-mapped: f32 tensors are copied out of it, quantised ones are
/// read from the map where they lie.
pub fn load(dir: &Path) -> Result<Model> {
    ensure!(dir.is_dir(), "checkpoint {} is not a directory", dir.display());
    let cpath = dir.join(CONFIG_FILE);
    let text = crate::base::fs::read_utf8(&cpath)?;
    let config = Config::from_json(&text).with_context(|| format!("in {}", cpath.display()))?;
    let wpath = dir.join(WEIGHTS_FILE);
    // The file holds the parameters (f32 at most) and a header; one far larger than the config
    // implies is refused before it is read.
    let size =
        fs::metadata(&wpath).with_context(|| format!("cannot read {}", wpath.display()))?.len();
    let expected = 4 * Layout::new(&config).total as u64;
    ensure!(
        size <= expected + MAX_HEADER,
        "{} holds {}, but the config implies {} of parameters (plus a header of at most {})",
        wpath.display(),
        format_bytes(size as u128),
        format_bytes(expected as u128),
        format_bytes(MAX_HEADER as u128)
    );
    let map = Arc::new(crate::base::fs::map_file(&wpath)?);
    let (params, quant) = tensors_from_safetensors(&config, map)
        .with_context(|| format!("in {}", wpath.display()))?;
    Model::new(config, params)?.with_quant(quant).with_context(|| format!("in {}", wpath.display()))
}

/// Checks a safetensors file against the layout the config implies and returns the flat
/// parameter buffer (f32 tensors) and the quantised matrices, whose bytes stay in `file`.
pub fn tensors_from_safetensors(
    config: &Config,
    file: Arc<memmap2::Mmap>,
) -> Result<(Vec<f32>, BTreeMap<usize, QuantMatrix>)> {
    let bytes: &[u8] = &file;
    let st = SafeTensors::deserialize(bytes)
        .map_err(|e| anyhow::anyhow!("not a valid safetensors file: {e}"))?;
    let (_, header) = SafeTensors::read_metadata(bytes)
        .map_err(|e| anyhow::anyhow!("not a valid safetensors file: {e}"))?;
    let meta = header.metadata().clone().unwrap_or_default();
    let layout = Layout::new(config);
    let have: BTreeSet<String> = st.names().into_iter().map(String::from).collect();
    let want: BTreeSet<String> = layout.specs.iter().map(|s| s.name.clone()).collect();
    let missing: Vec<_> = want.difference(&have).cloned().collect();
    let extra: Vec<_> = have.difference(&want).cloned().collect();
    if !missing.is_empty() {
        bail!("missing tensor(s) for residual = {:?}: {}", config.residual, missing.join(", "));
    }
    if !extra.is_empty() {
        bail!("unexpected tensor(s) for residual = {:?}: {}", config.residual, extra.join(", "));
    }
    // Every shape is checked against the config before the parameter buffer exists.
    let mut parts: HashMap<&str, QuantPart> = HashMap::new();
    for s in &layout.specs {
        let t = st.tensor(&s.name)?;
        match meta.get(&quant_key(&s.name)) {
            None => {
                ensure!(
                    t.dtype() == Dtype::F32,
                    "tensor {:?} has dtype {:?}, expected F32 (a quantised tensor's format goes in the metadata as {:?})",
                    s.name,
                    t.dtype(),
                    quant_key(&s.name)
                );
                ensure!(
                    t.shape() == s.shape.as_slice(),
                    "tensor {:?} has shape {:?}, expected {:?}",
                    s.name,
                    t.shape(),
                    s.shape
                )
            }
            Some(f) => {
                let format = Format::ALL
                    .into_iter()
                    .find(|x| x.name() == f)
                    .with_context(|| format!("tensor {:?}: unknown block format {f:?}", s.name))?;
                ensure!(
                    t.dtype() == Dtype::U8,
                    "tensor {:?} is quantised ({f}) but has dtype {:?}, expected U8",
                    s.name,
                    t.dtype()
                );
                let (rows, cols) = (s.shape[0], *s.shape.last().unwrap_or(&1));
                let row = format.row_bytes(cols).with_context(|| format!("tensor {:?}", s.name))?;
                ensure!(
                    t.shape() == [rows, row],
                    "tensor {:?} ({rows} x {cols} in {f}) has shape {:?}, expected [{rows}, {row}]",
                    s.name,
                    t.shape()
                );
                let start = t.data().as_ptr() as usize - bytes.as_ptr() as usize;
                let data = Bytes::new(file.clone(), start..start + t.data().len())?;
                parts.insert(&s.name, QuantPart::new(s.name.clone(), format, rows, data));
            }
        }
    }
    let mut quant = BTreeMap::new();
    for m in layout.matrices() {
        let specs = layout.specs_in(&m);
        let held: Vec<QuantPart> =
            specs.iter().filter_map(|&i| parts.remove(layout.specs[i].name.as_str())).collect();
        if held.is_empty() {
            continue;
        }
        ensure!(
            held.len() == specs.len(),
            "tensors {} are read by one product: all or none of them must be quantised",
            specs.iter().map(|&i| layout.specs[i].name.as_str()).collect::<Vec<_>>().join(", ")
        );
        let cols = *layout.specs[specs[0]].shape.last().unwrap_or(&1);
        quant.insert(m.start, QuantMatrix::new(cols, held)?);
    }
    if let Some(name) = parts.keys().next() {
        bail!("tensor {name:?} is marked quantised, but only weight matrices may be");
    }
    let mut params = if quant.is_empty() {
        vec![0.0f32; layout.total]
    } else {
        crate::base::alloc::untouched_zeros(layout.total)
    };
    for s in &layout.specs {
        if part_of(&quant, s).is_some() {
            continue;
        }
        let t = st.tensor(&s.name)?;
        let vals = f32_values(&s.name, &t)?;
        if let Some(i) = vals.iter().position(|x| !x.is_finite()) {
            bail!("tensor {:?} holds a non-finite value at index {i}", s.name);
        }
        params[s.range.clone()].copy_from_slice(&vals);
    }
    Ok((params, quant))
}

/// A run's latest model and the tokenizer stored beside it (any checkpoint directory with a
/// `tokenizer.json`).
pub fn load_with_tokenizer(dir: &Path) -> Result<(Model, Bpe)> {
    let model = load(dir)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Our writer's bytes read back by the `safetensors` crate: names, shapes, values, metadata,
    /// and the header padded to 8 bytes as the format asks.
    #[test]
    fn safetensors_parts_read_back_with_the_crate() {
        let (a, b) = (vec![1.5f32, -2.0, 3.25, f32::MIN_POSITIVE], vec![7.0f32; 6]);
        let tensors = vec![("b".to_string(), vec![2, 2], &a[..]), ("a".into(), vec![6], &b[..])];
        let meta = HashMap::from([("step".to_string(), "3".to_string())]);
        let bytes = safetensors_bytes(&tensors, Some(meta.clone())).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        assert_eq!(n % 8, 0);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        assert_eq!(f32_values("b", &st.tensor("b").unwrap()).unwrap(), a);
        assert_eq!(st.tensor("b").unwrap().shape(), [2, 2]);
        assert_eq!(f32_values("a", &st.tensor("a").unwrap()).unwrap(), b);
        let (_, m) = SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(m.metadata().as_ref(), Some(&meta));
        let bad = vec![("x".to_string(), vec![3], &a[..])];
        assert!(safetensors_bytes(&bad, None).unwrap_err().to_string().contains("shape [3]"));
    }

    /// An AttnRes checkpoint carries the PyTorch module its `auto_map` names, byte for byte;
    /// saving a standard model over it removes the files (plain Llama needs none).
    #[test]
    fn attnres_checkpoints_carry_their_transformers_module() {
        use crate::model::config::{ResidualKind, AUTO_MAP};
        let dir = tempfile::tempdir().unwrap();
        let small = |residual| Config {
            vocab_size: 32,
            hidden_size: 16,
            intermediate_size: 32,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            num_key_value_heads: 2,
            head_dim: 8,
            residual,
            num_blocks: 2,
            ..Config::default()
        };
        for residual in [ResidualKind::Full, ResidualKind::Block] {
            save(&Model::init(small(residual), 0).unwrap(), dir.path()).unwrap();
            let config: serde_json::Value =
                serde_json::from_str(&fs::read_to_string(dir.path().join(CONFIG_FILE)).unwrap())
                    .unwrap();
            for (class, module) in AUTO_MAP {
                assert_eq!(config["auto_map"][class], module);
                let file = format!("{}.py", module.split('.').next().unwrap());
                let (_, text) = REMOTE_CODE.iter().find(|(f, _)| *f == file).unwrap();
                assert_eq!(fs::read_to_string(dir.path().join(&file)).unwrap(), *text);
                assert!(text.contains(&format!("class {}", module.split('.').nth(1).unwrap())));
            }
            assert_eq!(config["model_type"], "attnres");
            assert_eq!(load(dir.path()).unwrap().config, small(residual));
        }
        save(&Model::init(small(ResidualKind::Standard), 0).unwrap(), dir.path()).unwrap();
        let config = fs::read_to_string(dir.path().join(CONFIG_FILE)).unwrap();
        assert!(config.contains("\"LlamaForCausalLM\"") && !config.contains("auto_map"));
        assert!(REMOTE_CODE.iter().all(|(f, _)| !dir.path().join(f).exists()));
    }
}
