//! Small models shared by the integration tests.

use attnres::model::{Config, Model, ResidualKind};

/// A two-layer model small enough for finite differences.
#[allow(dead_code)]
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
