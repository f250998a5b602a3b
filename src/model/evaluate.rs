//! A model's next-token loss over a token sequence of any length, in windows it fits: what
//! validation during training and `attnres eval` measure.

use super::Model;
use anyhow::{ensure, Result};

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
    windowed_loss_by(ids, seq, micro_batch, max_tokens, window_loss(model))
}

/// `model`'s mean loss of `rows` windows of `seq` tokens against their targets, as
/// [`windowed_loss_by`] takes it: `(ids, targets, rows, seq)`.
pub fn window_loss(model: &Model) -> impl FnMut(&[u32], &[u32], usize, usize) -> Result<f32> + '_ {
    |x, y, rows, t| {
        // No backward follows: keep of each sublayer only its input (as recomputation does),
        // not its work, so that validation takes less memory than a training step.
        let f = model.forward_with(x, rows, t, true)?;
        model.loss(&f, y)
    }
}

/// [`windowed_loss`] with the model's mean loss given by `loss(ids, targets, rows, seq)`, for
/// `rows` windows of `seq` tokens (the GPU's, for one).
pub fn windowed_loss_by(
    ids: &[u32],
    seq: usize,
    micro_batch: usize,
    max_tokens: usize,
    mut loss: impl FnMut(&[u32], &[u32], usize, usize) -> Result<f32>,
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
        nats += loss(&x, &y, chunk.len(), seq)? as f64 * y.len() as f64;
        count += y.len();
    }
    for s in last {
        let t = ids.len() - 1 - s;
        nats += loss(&ids[s..s + t], &ids[s + 1..], 1, t)? as f64 * t as f64;
        count += t;
    }
    Ok((nats, count))
}
