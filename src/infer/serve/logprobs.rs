//! Log-probabilities as the OpenAI API reports them: of the model's distribution before
//! temperature, top-k and top-p (what the API documents), for the token that was chosen (or
//! that the prompt holds) and its most likely alternatives.

use crate::infer::generate::decode_after;
use crate::text::tokenizer::Bpe;
use serde_json::{json, Map, Value};

/// The most alternatives a token may report: completions take 0 to 5, chat 0 to 20.
pub const MAX_COMPLETION_ALTERNATIVES: usize = 5;
pub const MAX_CHAT_ALTERNATIVES: usize = 20;

/// One token's entry.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: Token,
    /// `None` for the prompt's first token, which nothing predicts.
    pub logprob: Option<f32>,
    /// The most likely tokens at this position, most likely first (ties: lower id first).
    pub top: Vec<(Token, f32)>,
    /// Where the token's text starts in the prompt and completion together, in characters.
    pub offset: usize,
}

/// A token as the entries name it.
#[derive(Debug, Clone, PartialEq)]
pub struct Token {
    /// Its text on its own, after the token before it (a piece of a character decodes to
    /// U+FFFD).
    pub text: String,
    /// Its own bytes: a piece of a character has that piece (the chat API's `bytes`).
    pub bytes: Vec<u8>,
}

impl Token {
    /// Token `id` after the token `after`.
    pub fn new(bpe: &Bpe, after: Option<u32>, id: u32) -> Token {
        let text = token_text(bpe, after, id);
        let bytes = bpe.token_bytes(id).unwrap_or_else(|| text.clone().into_bytes());
        Token { text, bytes }
    }
}

/// `ln softmax(logits)[token]` and the `k` most likely tokens, computed in f64.
pub fn score(logits: &[f32], token: u32, k: usize) -> (f32, Vec<(u32, f32)>) {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x)) as f64;
    let sum: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    let lp = |i: usize| (logits[i] as f64 - lse) as f32;
    // The k largest by one pass over a short sorted list.
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &x) in logits.iter().enumerate() {
        if top.len() == k && top.last().is_none_or(|&(_, y)| x <= y) {
            continue;
        }
        let at = top.partition_point(|&(_, y)| y >= x);
        top.insert(at, (i as u32, x));
        top.truncate(k);
    }
    (lp(token as usize), top.into_iter().map(|(i, _)| (i, lp(i as usize))).collect())
}

/// A token's text after the token before it (`after`), as the streamed text has it.
fn token_text(bpe: &Bpe, after: Option<u32>, token: u32) -> String {
    decode_after(bpe, after, &[token]).or_else(|_| bpe.decode(&[token])).unwrap_or_default()
}

/// The completions API's `logprobs` object of a choice.
pub fn completion_object(entries: &[TokenLogprob]) -> Value {
    let top = |e: &TokenLogprob| -> Value {
        if e.logprob.is_none() {
            return Value::Null;
        }
        let map: Map<String, Value> =
            e.top.iter().map(|(t, lp)| (t.text.clone(), json!(lp))).collect();
        Value::Object(map)
    };
    json!({
        "tokens": entries.iter().map(|e| e.token.text.clone()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
        "top_logprobs": entries.iter().map(top).collect::<Vec<_>>(),
        "text_offset": entries.iter().map(|e| e.offset).collect::<Vec<_>>(),
    })
}

/// The chat API's `logprobs` object of a choice.
pub fn chat_object(entries: &[TokenLogprob]) -> Value {
    let one = |t: &Token, lp: f32| json!({"token": t.text, "logprob": lp, "bytes": t.bytes});
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = one(&e.token, e.logprob.unwrap_or(0.0));
            v["top_logprobs"] = e.top.iter().map(|(t, lp)| one(t, *lp)).collect();
            v
        })
        .collect();
    json!({ "content": content })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against a log-softmax written out in f64 and a full sort: the chosen token's value, the
    /// alternatives in order (ties to the lower id), and k = 0.
    #[test]
    fn score_is_the_log_softmax_and_its_largest_entries() {
        let logits = [1.0f32, 3.0, -2.0, 3.0, 0.5, 2.5];
        let lse = logits.iter().map(|&x| (x as f64).exp()).sum::<f64>().ln();
        for token in 0..logits.len() as u32 {
            let (lp, top) = score(&logits, token, 3);
            assert!((lp as f64 - (logits[token as usize] as f64 - lse)).abs() < 1e-6);
            let ids: Vec<u32> = top.iter().map(|t| t.0).collect();
            assert_eq!(ids, [1, 3, 5]);
            for (i, l) in top {
                assert!((l as f64 - (logits[i as usize] as f64 - lse)).abs() < 1e-6);
            }
        }
        assert!(score(&logits, 0, 0).1.is_empty());
        assert_eq!(score(&logits, 0, 10).1.len(), logits.len());
        // Large logits do not overflow.
        let (lp, _) = score(&[1000.0, 1000.0], 0, 1);
        assert!((lp - (0.5f32).ln()).abs() < 1e-6);
    }
}
