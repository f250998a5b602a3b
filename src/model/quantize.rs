//! A model whose weight matrices are kept in block formats: how it holds them (the `impl Model`
//! below), and an f32 model's matrices stored in a block format (`attnres quantize`).
//!
//! What is quantised: the matrices that products read whole ([`Layout::matrices`]): each
//! layer's q/k/v, o_proj, gate/up and down projections, the embedding and the LM head. What stays
//! f32: every RMSNorm gain and all depth-attention parameters (pseudo-queries, key-norm gains),
//! which are a few values per sublayer, cost nothing to read, and set which layers a sublayer
//! listens to; a small error there moves every later layer. The matrix the LM head reads (the
//! embedding when tied) is stored in Q8_0 when the target is a 4- or 5-bit format, as llama.cpp keeps
//! its output matrix at more bits than the rest: its error goes straight into every logit. F16
//! is not a block format but takes the same path: a matrix's values rounded to halves.

use super::params::ParamSpec;
use super::Model;
use crate::kernels::quant::matrix::{Bytes, QuantMatrix, QuantPart};
use crate::kernels::quant::{self, Format};
use anyhow::{ensure, Context, Result};
use rayon::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

/// What [`quantize`] made.
pub struct Quantized {
    pub model: Model,
    /// Tensors per format, f32 ones included.
    pub tensors: BTreeMap<&'static str, usize>,
    /// The weight matrices' bytes before and after.
    pub bytes: (usize, usize),
}

/// The formats `quantize` writes: those the code makes.
pub fn targets() -> Vec<Format> {
    Format::ALL.into_iter().filter(|f| f.quantizable()).collect()
}

impl Model {
    /// This model with the matrices of `quant` (keyed by their range's start) computed from
    /// their blocks; each must be one of [`Layout::matrices`] and of its shape.
    pub fn with_quant(mut self, quant: BTreeMap<usize, QuantMatrix>) -> Result<Model> {
        let matrices = self.layout.matrices();
        for (&start, q) in &quant {
            let range = matrices.iter().find(|r| r.start == start && !r.is_empty());
            let range = range.with_context(|| {
                format!("{}: only weight matrices may be quantised", q.parts[0].name)
            })?;
            let specs = self.layout.specs_in(range);
            let names: Vec<&str> =
                specs.iter().map(|&i| self.layout.specs[i].name.as_str()).collect();
            let have: Vec<&str> = q.parts.iter().map(|p| p.name.as_str()).collect();
            ensure!(
                names == have,
                "the quantised tensors {} must be {} (one product reads them together)",
                have.join(", "),
                names.join(", ")
            );
            for (&i, p) in specs.iter().zip(&q.parts) {
                let shape = &self.layout.specs[i].shape;
                ensure!(
                    shape[..] == [p.rows, q.cols],
                    "tensor {} holds {} x {} values, the config implies {shape:?}",
                    p.name,
                    p.rows,
                    q.cols
                );
            }
        }
        self.quant = quant;
        Ok(self)
    }

    /// Whether some matrices are kept in block formats (such a model runs, but does not train).
    pub fn is_quantized(&self) -> bool {
        !self.quant.is_empty()
    }

    /// The quantised part that holds tensor `spec` of the layout, if it is quantised.
    pub fn quant_part(&self, spec: &ParamSpec) -> Option<&QuantPart> {
        part_of(&self.quant, spec)
    }

    /// How the weight matrices are stored: `f32`, or their block formats (`Q4_0 + Q8_0`, in the
    /// order of the bytes they hold, most first).
    pub fn storage_label(&self) -> String {
        let mut bytes: BTreeMap<&str, usize> = BTreeMap::new();
        for p in self.quant.values().flat_map(|q| &q.parts) {
            *bytes.entry(p.format.name()).or_default() += p.data.len();
        }
        let f32_bytes: usize = self
            .layout
            .matrices()
            .iter()
            .filter(|r| !self.quant.contains_key(&r.start))
            .map(|r| 4 * r.len())
            .sum();
        if f32_bytes > 0 {
            bytes.insert("f32", f32_bytes);
        }
        let mut v: Vec<(&str, usize)> = bytes.into_iter().collect();
        v.sort_by_key(|&(_, b)| std::cmp::Reverse(b));
        v.iter().map(|(f, _)| *f).collect::<Vec<_>>().join(" + ")
    }

    /// Tensor `spec`'s values as f32: its blocks dequantised when it is quantised.
    pub fn values(&self, spec: &ParamSpec) -> Vec<f32> {
        match self.quant_part(spec) {
            Some(p) => crate::kernels::quant::dequantize(p.format, &p.data),
            None => self.params[spec.range.clone()].to_vec(),
        }
    }

    /// The bytes of the weights that one decoding step reads: every matrix (f32 or its blocks)
    /// once; the embedding row lookups are left out unless the head shares the table.
    pub fn weight_bytes(&self) -> usize {
        let lay = &self.layout;
        lay.matrices()
            .iter()
            .filter(|r| **r != lay.embed || lay.head == lay.embed)
            .map(|r| self.quant.get(&r.start).map_or(4 * r.len(), |q| q.bytes()))
            .sum()
    }

    /// The bytes the weights take in memory: the f32 tensors, and the blocks of the quantised
    /// matrices (whose f32 ranges are never touched, so their pages cost nothing).
    pub fn resident_bytes(&self) -> usize {
        let quantised: usize = self.quant.keys().map(|&start| self.quant_range_len(start)).sum();
        let blocks: usize = self.quant.values().map(QuantMatrix::bytes).sum();
        4 * (self.params.len() - quantised) + blocks
    }

    /// The length of the f32 range of the matrix that starts at `start`.
    fn quant_range_len(&self, start: usize) -> usize {
        self.layout.matrices().iter().find(|r| r.start == start).map_or(0, |r| r.len())
    }
}

/// The part of `quant` (matrices by the start of their range in the layout) that holds tensor
/// `spec`, if any.
pub fn part_of<'a>(
    quant: &'a BTreeMap<usize, QuantMatrix>,
    spec: &ParamSpec,
) -> Option<&'a QuantPart> {
    let (_, q) = quant.range(..=spec.range.start).next_back()?;
    q.parts.iter().find(|p| p.name == spec.name)
}

/// `model`'s matrices in `to` (see the module's notes); every other tensor as it is.
pub fn quantize(model: &Model, to: Format) -> Result<Quantized> {
    let targets = targets();
    ensure!(targets.contains(&to), "quantize writes {}, not {}", names(&targets), to.name());
    ensure!(
        !model.is_quantized(),
        "the model is already quantised: quantise its f32 original (for an imported GGUF: attnres import --dtype f32)"
    );
    let lay = &model.layout;
    let head = lay.head.start;
    let mut quant = BTreeMap::new();
    let mut tensors = BTreeMap::new();
    let mut quantised = BTreeSet::new();
    for m in lay.matrices() {
        let few_bits = matches!(
            to,
            Format::Q4_0 | Format::Q4_1 | Format::Q5_0 | Format::Q5_1 | Format::Q4K | Format::Q5K
        );
        let format = if m.start == head && few_bits { Format::Q8_0 } else { to };
        let specs = lay.specs_in(&m);
        let cols = *lay.specs[specs[0]].shape.last().unwrap_or(&1);
        if format.row_bytes(cols).is_err() {
            // A row that is not a whole number of blocks stays f32.
            continue;
        }
        let mut parts = Vec::new();
        for &i in &specs {
            let s = &lay.specs[i];
            let values = &model.params[s.range.clone()];
            let row = format.row_bytes(cols)?;
            let mut data = vec![0u8; s.shape[0] * row];
            data.par_chunks_mut(row).zip(values.par_chunks(cols)).try_for_each(|(out, v)| {
                out.copy_from_slice(&quant::quantize(format, v)?);
                anyhow::Ok(())
            })?;
            parts.push(QuantPart::new(s.name.clone(), format, s.shape[0], Bytes::from_vec(data)));
            quantised.insert(i);
            *tensors.entry(format.name()).or_insert(0) += 1;
        }
        quant.insert(m.start, QuantMatrix::new(cols, parts)?);
    }
    let f32_count = lay.specs.len() - quantised.len();
    if f32_count > 0 {
        tensors.insert("F32", f32_count);
    }
    // The quantised tensors' f32 values are not carried: their ranges stay zero pages.
    let mut params = crate::base::alloc::untouched_zeros(lay.total);
    for (i, s) in lay.specs.iter().enumerate() {
        if !quantised.contains(&i) {
            params[s.range.clone()].copy_from_slice(&model.params[s.range.clone()]);
        }
    }
    let before = model.weight_bytes();
    let model = Model::new(model.config.clone(), params)?.with_quant(quant)?;
    let after = model.weight_bytes();
    Ok(Quantized { model, tensors, bytes: (before, after) })
}

/// The formats' names, lower case as the command line takes them: `q8_0, q4_0, q4_1`.
pub fn names(formats: &[Format]) -> String {
    formats.iter().map(|f| f.name().to_lowercase()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::checkpoint;
    use crate::model::config::{Config, ResidualKind};

    fn config(residual: ResidualKind, tied: bool) -> Config {
        // Rows of 64 and 96 values: whole blocks of 32.
        Config {
            vocab_size: 50,
            hidden_size: 64,
            intermediate_size: 96,
            num_hidden_layers: 2,
            num_attention_heads: 2,
            num_key_value_heads: 1,
            head_dim: 32,
            max_position_embeddings: 16,
            residual,
            num_blocks: 2,
            tie_word_embeddings: tied,
            ..Config::default()
        }
    }

    /// Every matrix is quantised in the asked format (the head's in Q8_0), every other tensor
    /// keeps its bits, and the quantised model computes what its dequantised copy computes,
    /// within the activations' rounding.
    #[test]
    fn matrices_are_quantised_and_the_rest_kept() {
        for (residual, tied) in [
            (ResidualKind::Standard, true),
            (ResidualKind::Block, false),
            (ResidualKind::Full, true),
        ] {
            let c = config(residual, tied);
            let mut m = Model::init(c.clone(), 3).unwrap();
            // Non-zero depth parameters, so that keeping them matters.
            for s in &m.layout.specs.clone() {
                if s.name.contains("_res") {
                    m.params[s.range.clone()]
                        .iter_mut()
                        .enumerate()
                        .for_each(|(i, v)| *v = 0.01 * i as f32);
                }
            }
            // Under F16 the LM head is F16 like the rest; under a 4-bit format, Q8_0.
            let f16 = quantize(&m, Format::F16).unwrap();
            let head_part = |q: &Quantized| q.model.quant[&m.layout.head.start].parts[0].format;
            assert_eq!(head_part(&f16), Format::F16);
            assert!(f16.bytes.1 * 2 == f16.bytes.0, "{:?}", f16.bytes);
            let q = quantize(&m, Format::Q4_0).unwrap();
            assert_eq!(head_part(&q), Format::Q8_0);
            let lay = &m.layout;
            for s in &lay.specs {
                match q.model.quant_part(s) {
                    Some(p) => {
                        let head =
                            lay.specs_in(&lay.head).iter().any(|&i| lay.specs[i].name == s.name);
                        assert_eq!(
                            p.format,
                            if head { Format::Q8_0 } else { Format::Q4_0 },
                            "{}",
                            s.name
                        );
                        assert!(s.shape.len() == 2 && !s.name.contains("_res"), "{}", s.name);
                    }
                    None => {
                        assert!(
                            s.shape.len() == 1 || s.name.contains("_res"),
                            "{} kept f32",
                            s.name
                        );
                        assert_eq!(q.model.params[s.range.clone()], m.params[s.range.clone()]);
                    }
                }
            }
            assert!(q.bytes.1 * 3 < q.bytes.0, "{:?}", q.bytes);
            // The same model with the dequantised values in f32.
            let mut params = m.params.clone();
            for (start, mat) in &q.model.quant {
                let w = mat.dequantize();
                params[*start..*start + w.len()].copy_from_slice(&w);
            }
            let f = Model::new(c.clone(), params).unwrap();
            let ids: Vec<u32> = (0..16).map(|i| (i * 7 % c.vocab_size) as u32).collect();
            let a = q.model.forward(&ids, 2, 8).unwrap().logits;
            let b = f.forward(&ids, 2, 8).unwrap().logits;
            let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            // Q8_0 activations carry a relative rounding of 1/254 per value; through a few
            // layers that stays within a few percent of the logits' scale.
            assert!(worst <= 0.05 * scale, "{residual:?}: {worst} of {scale}");
            assert!(worst > 0.0, "the products did run on the blocks");
        }
    }

    /// A quantised checkpoint saves and loads back to the same blocks and the same logits; a
    /// file whose marks and tensors disagree is refused with the tensor's name.
    #[test]
    fn quantised_checkpoints_round_trip() {
        let m = Model::init(config(ResidualKind::Block, false), 5).unwrap();
        let q = quantize(&m, Format::Q4_1).unwrap().model;
        let dir = tempfile::tempdir().unwrap();
        checkpoint::save(&m, dir.path()).unwrap();
        checkpoint::save(&q, dir.path()).unwrap();
        // The PyTorch module reads f32 tensors: a quantised AttnRes checkpoint names none and
        // the f32 one's files are gone.
        let config = std::fs::read_to_string(dir.path().join(checkpoint::CONFIG_FILE)).unwrap();
        assert!(!config.contains("auto_map"), "{config}");
        assert!(checkpoint::REMOTE_CODE.iter().all(|(f, _)| !dir.path().join(f).exists()));
        let back = checkpoint::load(dir.path()).unwrap();
        assert_eq!(back.quant.len(), q.quant.len());
        for (k, a) in &q.quant {
            let b = &back.quant[k];
            for (x, y) in a.parts.iter().zip(&b.parts) {
                assert_eq!((&x.name, x.format, &x.data[..]), (&y.name, y.format, &y.data[..]));
            }
        }
        let ids: Vec<u32> = (0..8).collect();
        let (a, b) =
            (q.forward(&ids, 1, 8).unwrap().logits, back.forward(&ids, 1, 8).unwrap().logits);
        assert_eq!(a, b);

        // Blocks without their mark, a mark of the wrong format, an unknown format: refused.
        let path = dir.path().join(checkpoint::WEIGHTS_FILE);
        let bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
        let edit = |from: &str, to: &str| {
            let h = header.replacen(from, to, 1);
            assert_ne!(h, header, "{from} is in the header");
            let mut b = (h.len() as u64).to_le_bytes().to_vec();
            b.extend(h.as_bytes());
            b.extend(&bytes[8 + n..]);
            std::fs::write(&path, b).unwrap();
            format!("{:#}", checkpoint::load(dir.path()).err().unwrap())
        };
        let e = edit(
            "\"quant.model.layers.0.self_attn.k_proj.weight\"",
            "\"other.model.layers.0.self_attn.k_proj.weight\"",
        );
        assert!(
            e.contains("\"model.layers.0.self_attn.k_proj.weight\" has dtype U8, expected F32"),
            "{e}"
        );
        let e = edit(
            "\"quant.model.layers.0.self_attn.k_proj.weight\":\"Q4_1\"",
            "\"quant.model.layers.0.self_attn.k_proj.weight\":\"Q4_0\"",
        );
        assert!(e.contains("k_proj") && e.contains("expected [32, 36]"), "{e}");
        let e = edit(
            "\"quant.model.layers.0.self_attn.k_proj.weight\":\"Q4_1\"",
            "\"quant.model.layers.0.self_attn.k_proj.weight\":\"Q7_2\"",
        );
        assert!(e.contains("unknown block format \"Q7_2\""), "{e}");
    }

    #[test]
    fn quantising_twice_is_refused() {
        let m = Model::init(config(ResidualKind::Standard, true), 1).unwrap();
        let q = quantize(&m, Format::Q8_0).unwrap();
        let e = quantize(&q.model, Format::Q8_0).err().unwrap().to_string();
        assert!(e.contains("already quantised"), "{e}");
    }
}
