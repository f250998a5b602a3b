//! `attnres eval`: a checkpoint measured on a text: mean loss per token, perplexity and bits per
//! byte, over windows of the model's context.

use crate::model::Model;
use crate::train::tokenizer::Bpe;
use crate::train::validation::windowed_loss;
use anyhow::{ensure, Result};

/// How well a model predicts a text.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measurement {
    /// Mean next-token loss in nats.
    pub loss: f64,
    pub perplexity: f64,
    pub bits_per_byte: f64,
    /// Tokens predicted (every token but the first).
    pub tokens: usize,
    /// Bytes those tokens decode to.
    pub bytes: usize,
}

/// Measures `model` on `text` (named `origin` in errors) over windows of `seq` tokens (default:
/// the model's context).
pub fn measure(
    model: &Model,
    bpe: &Bpe,
    text: &str,
    origin: &str,
    seq: Option<usize>,
) -> Result<Measurement> {
    let ids = bpe.encode(text)?;
    ensure!(
        ids.len() >= 2,
        "{origin} is too short to measure: it encodes to {} token(s)",
        ids.len()
    );
    let context = model.config.max_position_embeddings;
    let seq = seq.unwrap_or(context);
    ensure!(seq > 0 && seq <= context, "--seq must lie in 1..={context}");
    let (nats, tokens) = windowed_loss(model, &ids, seq.min(ids.len() - 1), 8, 0)?;
    let loss = nats / tokens as f64;
    // Every token but the first is predicted: count the bytes those tokens decode to.
    let first = bpe.decode(&ids[..1])?.len();
    let bytes = (text.len() - first).max(1);
    let bits_per_byte = nats / std::f64::consts::LN_2 / bytes as f64;
    Ok(Measurement { loss, perplexity: loss.exp(), bits_per_byte, tokens, bytes })
}
