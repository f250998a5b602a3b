//! Measuring a model during and after training: the windowed next-token loss, validation loss
//! with bits per byte, and the unigram floor a useful model must beat.

use super::tokens::Tokens;
use crate::model::Model;
use anyhow::{ensure, Result};

/// Mean validation loss over consecutive windows (up to `max_tokens` predicted tokens, 0 = all)
/// and the matching bits per byte (using the split's bytes per token).
pub fn validate(
    model: &Model,
    tokens: &Tokens,
    seq: usize,
    micro_batch: usize,
    max_tokens: usize,
) -> Result<(f64, f64)> {
    let n = tokens.val_len();
    let val: Vec<u32> = tokens.val(0..n);
    let (nats, count) = windowed_loss(model, &val, seq.min(n - 1), micro_batch, max_tokens)?;
    let loss = nats / count as f64;
    let bytes_per_token = tokens.val_bytes as f64 / n as f64;
    Ok((loss, loss / std::f64::consts::LN_2 / bytes_per_token))
}

/// Summed next-token loss (nats) and the number of predicted tokens, over windows of `seq + 1`
/// tokens taken with stride `seq` (so every token but the first is predicted once), stopping
/// after `max_tokens` predictions when non-zero.
pub fn windowed_loss(
    model: &Model,
    ids: &[u32],
    seq: usize,
    micro_batch: usize,
    max_tokens: usize,
) -> Result<(f64, usize)> {
    ensure!(ids.len() >= 2, "need at least two tokens to measure a loss");
    let mut starts: Vec<usize> = (0..ids.len() - 1).step_by(seq).collect();
    if max_tokens > 0 {
        starts.truncate(max_tokens.div_ceil(seq).max(1));
    }
    let (mut nats, mut count) = (0.0f64, 0usize);
    // Full windows go in batches; the ragged last window alone.
    let (full, last): (Vec<usize>, Vec<usize>) = starts.iter().partition(|&&s| s + seq < ids.len());
    for chunk in full.chunks(micro_batch) {
        let (mut x, mut y) = (Vec::new(), Vec::new());
        for &s in chunk {
            x.extend_from_slice(&ids[s..s + seq]);
            y.extend_from_slice(&ids[s + 1..s + seq + 1]);
        }
        // No backward follows: keep of each sublayer only its input (as recomputation does),
        // not its work, so that validation takes less memory than a training step.
        let f = model.forward_with(&x, chunk.len(), seq, true)?;
        nats += model.loss(&f, &y)? as f64 * y.len() as f64;
        count += y.len();
    }
    for s in last {
        let t = ids.len() - 1 - s;
        let f = model.forward_with(&ids[s..s + t], 1, t, true)?;
        nats += model.loss(&f, &ids[s + 1..])? as f64 * t as f64;
        count += t;
    }
    Ok((nats, count))
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
