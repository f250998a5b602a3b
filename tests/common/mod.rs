//! Helpers shared by the integration tests: small models, deterministic noise, a small corpus
//! and the float64 reference forward pass. Each test binary uses only some of them.
#![allow(dead_code)]

pub mod reference;

use attnres::model::{Config, Model, ResidualKind};
use std::path::Path;

/// A two-layer model small enough for finite differences.
pub fn tiny(residual: ResidualKind, num_blocks: usize) -> Config {
    Config {
        vocab_size: 11,
        hidden_size: 8,
        intermediate_size: 12,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 4,
        max_position_embeddings: 8,
        tie_word_embeddings: false,
        residual,
        num_blocks,
        ..Config::default()
    }
}

/// Deterministic pseudo-random values in [-1, 1).
pub fn noise(i: usize, salt: u64) -> f32 {
    let mut x = (i as u64).wrapping_mul(0x9E3779B97F4A7C15) ^ salt.wrapping_mul(0xD1B54A32D192ED03);
    x ^= x >> 29;
    x = x.wrapping_mul(0xBF58476D1CE4E5B9);
    x ^= x >> 32;
    (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// A model with every parameter non-trivial, pseudo-queries included.
pub fn perturbed(cfg: Config) -> Model {
    let mut m = Model::init(cfg, 3).unwrap();
    for (i, p) in m.params.iter_mut().enumerate() {
        *p += 0.3 * noise(i, 1);
    }
    m
}

/// Copies every parameter the two models share by name.
pub fn copy_shared(from: &Model, to: &mut Model) {
    for s in &to.layout.specs.clone() {
        if let Some(f) = from.layout.spec(&s.name) {
            to.params[s.range.clone()].copy_from_slice(&from.params[f.range.clone()]);
        }
    }
}

/// Writes a small training corpus to `path`: the first `chars` characters of each of the first
/// twelve plays of the embedded corpus (many documents, fast to tokenize).
pub fn write_small_corpus(path: &Path, chars: usize) {
    let corpus = attnres::train::data::Corpus::embedded();
    let text = corpus.documents[..12]
        .iter()
        .map(|d| d.chars().take(chars).collect::<String>())
        .collect::<Vec<_>>()
        .join("\n\n\n");
    std::fs::write(path, text).unwrap();
}

/// The stderr of a command that must have succeeded.
pub fn ok(o: &std::process::Output) -> String {
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(o.status.success(), "command failed: {err}");
    err
}

/// Largest absolute value (0 for an empty slice).
pub fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |a, x| a.max(x.abs()))
}

/// A JSON array of rows of token ids (a fixture's `input_ids` or `targets`), flattened.
pub fn id_rows(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .flat_map(|r| r.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32))
        .collect()
}

/// Command-line arguments: `head`, then `--out out --data data`, then `--set s` for each setting.
pub fn run_args(head: &[&str], out: &Path, data: &Path, sets: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = head.iter().map(|s| s.to_string()).collect();
    for (flag, p) in [("--out", out), ("--data", data)] {
        v.push(flag.into());
        v.push(p.to_string_lossy().into_owned());
    }
    for s in sets {
        v.push("--set".into());
        v.push(s.to_string());
    }
    v
}
