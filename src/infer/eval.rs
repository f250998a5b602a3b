//! `attnres eval`: a checkpoint measured on a text: mean loss per token, perplexity and bits per
//! byte, over windows of the model's context.

use crate::model::evaluate::{window_loss, windowed_loss_by};
use crate::model::Model;
use crate::text::tokenizer::Bpe;
use anyhow::{ensure, Context, Result};

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
    measure_by(model, bpe, text, origin, seq, window_loss(model))
}

/// [`measure`] with the model's mean loss over windows given by `loss(ids, targets, rows,
/// seq)` (the GPU's, for one; `crate::model::evaluate::windowed_loss_by`).
pub fn measure_by(
    model: &Model,
    bpe: &Bpe,
    text: &str,
    origin: &str,
    seq: Option<usize>,
    loss: impl FnMut(&[u32], &[u32], usize, usize) -> Result<f32>,
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
    let (nats, tokens) = windowed_loss_by(&ids, seq.min(ids.len() - 1), 8, 0, loss)?;
    let loss = nats / tokens as f64;
    // Every token but the first is predicted: count the bytes those tokens stand for. The
    // first token can end inside a UTF-8 character, so its bytes are counted from its entry in
    // the vocabulary, not from its decoded text (a partial character decodes to U+FFFD).
    let first = token_bytes(bpe, ids[0])?;
    let bytes = text.len().saturating_sub(first).max(1);
    let bits_per_byte = nats / std::f64::consts::LN_2 / bytes as f64;
    Ok(Measurement { loss, perplexity: loss.exp(), bits_per_byte, tokens, bytes })
}

/// The number of bytes of text that token `id` stands for. In a byte-level vocabulary every
/// character of a token's entry is one byte; an added token (end-of-text) is its own text.
fn token_bytes(bpe: &Bpe, id: u32) -> Result<usize> {
    let json: serde_json::Value =
        serde_json::from_str(&bpe.to_json()?).context("cannot read the tokenizer's vocabulary")?;
    let added = json["added_tokens"].as_array().into_iter().flatten();
    if let Some(t) = added.into_iter().find(|t| t["id"].as_u64() == Some(id as u64)) {
        return Ok(t["content"].as_str().map_or(0, str::len));
    }
    let vocab = json["model"]["vocab"]
        .as_object()
        .context("the tokenizer has no vocabulary (model.vocab)")?;
    let token = vocab
        .iter()
        .find(|(_, v)| v.as_u64() == Some(id as u64))
        .map(|(k, _)| k)
        .with_context(|| format!("token id {id} is not in the tokenizer's vocabulary"))?;
    Ok(token.chars().count())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Config, Model};

    /// Texts that start inside a character the tokenizer has no merge for: the first token is
    /// one byte of it, so the predicted text is every byte but one.
    #[test]
    fn bytes_of_short_non_ascii_texts() {
        let docs: Vec<String> = (0..20).map(|i| format!("the cat sat on mat {i}\n")).collect();
        let bpe = Bpe::train(&docs, 300).unwrap();
        let c = Config {
            vocab_size: bpe.vocab_size(),
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 1,
            num_blocks: 2,
            num_attention_heads: 2,
            num_key_value_heads: 2,
            head_dim: 8,
            max_position_embeddings: 16,
            ..Config::default()
        };
        let model = Model::init(c, 1).unwrap();
        for text in ["é", "éa", "日本", "€", "ü ü", "\u{1F600}"] {
            let ids = bpe.encode(text).unwrap();
            // Every byte of a character the tokenizer has not seen is its own token.
            assert_eq!(ids.len(), text.len(), "{text:?}");
            let m = measure(&model, &bpe, text, "t", None).unwrap();
            assert_eq!(m.bytes, text.len() - 1, "{text:?}");
            assert_eq!(m.tokens, text.len() - 1, "{text:?}");
        }
        let m = measure(&model, &bpe, "the cat", "t", None).unwrap();
        assert_eq!(
            m.bytes,
            "the cat".len() - bpe.decode(&bpe.encode("the").unwrap()[..1]).unwrap().len()
        );
    }
}
