//! Measuring a model during training: validation loss with bits per byte, and the unigram
//! floor a useful model must beat.

use super::tokens::Tokens;
use crate::model::evaluate::{window_loss, windowed_loss_by};
use crate::model::Model;
use anyhow::Result;

/// Mean validation loss over consecutive windows (up to `max_tokens` predicted tokens, 0 = all)
/// and the matching bits per byte (using the split's bytes per token).
pub fn validate(
    model: &Model,
    tokens: &Tokens,
    seq: usize,
    micro_batch: usize,
    max_tokens: usize,
) -> Result<(f64, f64)> {
    validate_by(tokens, seq, micro_batch, max_tokens, window_loss(model))
}

/// [`validate`] with the model's mean loss given by `loss` ([`windowed_loss_by`]).
pub fn validate_by(
    tokens: &Tokens,
    seq: usize,
    micro_batch: usize,
    max_tokens: usize,
    loss: impl FnMut(&[u32], &[u32], usize, usize) -> Result<f32>,
) -> Result<(f64, f64)> {
    let n = tokens.val_len();
    let val: Vec<u32> = tokens.val(0..n);
    let (nats, count) = windowed_loss_by(&val, seq.min(n - 1), micro_batch, max_tokens, loss)?;
    let loss = nats / count as f64;
    let bytes_per_token = tokens.val_bytes as f64 / n as f64;
    Ok((loss, loss / std::f64::consts::LN_2 / bytes_per_token))
}

/// Bits per byte of the validation split under a unigram model of the training tokens (add-one
/// smoothing): the floor any useful language model must beat.
pub fn unigram_bits_per_byte(tokens: &Tokens, vocab: usize) -> f64 {
    let mut counts = vec![1.0f64; vocab];
    for t in tokens.train(0..tokens.train_len()) {
        counts[t as usize] += 1.0;
    }
    let total: f64 = counts.iter().sum();
    let nats: f64 =
        tokens.val(0..tokens.val_len()).iter().map(|&t| -(counts[t as usize] / total).ln()).sum();
    nats / std::f64::consts::LN_2 / tokens.val_bytes as f64
}
