//! Byte-level BPE tokenizers (Hugging Face `tokenizers`): trained on the training split, or
//! loaded from a `tokenizer.json`. The byte-level alphabet covers all 256 bytes, so every UTF-8
//! text encodes without unknown tokens and decodes back to itself.

use anyhow::{anyhow, ensure, Context, Result};
use std::path::Path;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, Tokenizer, TokenizerImpl};

/// Separates documents in the token stream.
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// The end-of-text token a `tokenizer_config.json` names (`eos_token`, a string or
/// `{"content": ...}`).
pub fn eos_token(tokenizer_config: &serde_json::Value) -> Option<&str> {
    special_token(tokenizer_config, "eos_token")
}

/// The token a `tokenizer_config.json` names under `key` (`bos_token`, ...: a string or
/// `{"content": ...}`).
pub fn special_token<'a>(tokenizer_config: &'a serde_json::Value, key: &str) -> Option<&'a str> {
    match &tokenizer_config[key] {
        serde_json::Value::String(s) => Some(s),
        serde_json::Value::Object(o) => o.get("content").and_then(serde_json::Value::as_str),
        _ => None,
    }
}

pub struct Bpe {
    inner: Tokenizer,
    /// Id of [`END_OF_TEXT`].
    pub eot: u32,
    /// Ids the tokenizer has, added tokens included: counted once, as the tokenizers crate
    /// counts them by building its whole vocabulary map (a copy of every entry).
    vocab_size: usize,
    /// Whether tokens are byte-level pieces (GPT-2's alphabet: one character per byte), which
    /// [`Bpe::token_bytes`] maps back; otherwise SentencePiece's (`▁` for a space, `<0xHH>`
    /// for a byte).
    byte_level: bool,
}

impl Bpe {
    /// Trains a byte-level BPE with `vocab_size` entries (including the 256 bytes and the
    /// end-of-text token) on `docs`.
    pub fn train(docs: &[String], vocab_size: usize) -> Result<Bpe> {
        ensure!(vocab_size > 257, "tokenizer vocabulary size must be at least 258 (256 bytes, end-of-text, one merge), got {vocab_size}");
        let mut trainer = BpeTrainerBuilder::new()
            .vocab_size(vocab_size)
            .min_frequency(2)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
            .build();
        let mut tk: TokenizerImpl<
            BPE,
            NormalizerWrapper,
            ByteLevel,
            PostProcessorWrapper,
            ByteLevel,
        > = TokenizerImpl::new(BPE::default());
        tk.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        tk.with_decoder(Some(ByteLevel::default()));
        tk.train(&mut trainer, docs.iter())
            .map_err(|e| anyhow!("tokenizer training failed: {e}"))?;
        let json =
            tk.to_string(false).map_err(|e| anyhow!("cannot serialise the tokenizer: {e}"))?;
        Self::from_json(&json)
    }

    pub fn from_json(json: &str) -> Result<Bpe> {
        Self::from_json_with_eos(json, None)
    }

    /// A tokenizer whose end-of-text token is `eos` (an imported model's own, such as `</s>` or
    /// `<|im_end|>`), or [`END_OF_TEXT`] when `None`.
    pub fn from_json_with_eos(json: &str, eos: Option<&str>) -> Result<Bpe> {
        let inner: Tokenizer =
            json.parse().map_err(|e| anyhow!("not a valid tokenizer.json: {e}"))?;
        let name = eos.unwrap_or(END_OF_TEXT);
        let eot =
            inner.token_to_id(name).with_context(|| format!("tokenizer has no {name} token"))?;
        let vocab_size = inner.get_vocab_size(true);
        let byte_level =
            matches!(inner.get_decoder(), Some(tokenizers::decoders::DecoderWrapper::ByteLevel(_)));
        Ok(Bpe { inner, eot, vocab_size, byte_level })
    }

    /// Loads `tokenizer.json`. When a `tokenizer_config.json` lies beside it (an imported
    /// model's, docs/import.md) and names an `eos_token`, that token ends the text.
    pub fn load(path: &Path) -> Result<Bpe> {
        let json = crate::base::fs::read_utf8(path)?;
        let config_path = path.with_file_name("tokenizer_config.json");
        let config: Option<serde_json::Value> = if config_path.exists() {
            let text = crate::base::fs::read_utf8(&config_path)?;
            Some(
                serde_json::from_str(&text)
                    .with_context(|| format!("{} is not valid JSON", config_path.display()))?,
            )
        } else {
            None
        };
        let eos = config.as_ref().and_then(eos_token);
        Self::from_json_with_eos(&json, eos).with_context(|| format!("in {}", path.display()))
    }

    /// A `tokenizer_config.json` for a tokenizer trained here, so that Hugging Face's
    /// `AutoTokenizer` (and lm-eval, PEFT, ...) knows its end-of-text token: no beginning-of-text
    /// token is added, as `generate` and `eval` encode.
    pub fn hf_tokenizer_config(max_length: usize) -> String {
        let v = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": END_OF_TEXT,
            "add_bos_token": false,
            "add_eos_token": false,
            "clean_up_tokenization_spaces": false,
            "model_max_length": max_length,
        });
        serde_json::to_string_pretty(&v).expect("a JSON object serialises")
    }

    pub fn to_json(&self) -> Result<String> {
        self.inner.to_string(true).map_err(|e| anyhow!("cannot serialise the tokenizer: {e}"))
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc =
            self.inner.encode_fast(text, false).map_err(|e| anyhow!("tokenizer failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| anyhow!("tokenizer failed: {e}"))
    }

    /// The bytes token `id` stands for, before they are joined into text: a token that ends
    /// inside a UTF-8 character has only part of it. `None` for an id the tokenizer lacks.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let piece = self.inner.id_to_token(id)?;
        if self.byte_level {
            // Added tokens (`<|endoftext|>`) are kept as written, outside the alphabet at times.
            let bytes: Option<Vec<u8>> = piece.chars().map(byte_of_level_char).collect();
            return Some(bytes.unwrap_or_else(|| piece.into_bytes()));
        }
        let hex = piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>'));
        if let Some(b) = hex.filter(|h| h.len() == 2).and_then(|h| u8::from_str_radix(h, 16).ok()) {
            return Some(vec![b]);
        }
        Some(piece.replace('\u{2581}', " ").into_bytes())
    }

    /// The documents as one token stream, each followed by the end-of-text token.
    pub fn encode_documents(&self, docs: &[String]) -> Result<Vec<u32>> {
        let encs = self
            .inner
            .encode_batch_fast(docs.iter().map(|d| d.as_str()).collect::<Vec<_>>(), false)
            .map_err(|e| anyhow!("tokenizer failed: {e}"))?;
        let mut out = Vec::new();
        for e in encs {
            out.extend_from_slice(e.get_ids());
            out.push(self.eot);
        }
        Ok(out)
    }
}

/// The byte a character of the byte-level alphabet stands for: the printable bytes (`!`..`~`,
/// `¡`..`¬`, `®`..`ÿ`) are their own characters, and the n-th of the other 68 is U+0100 + n.
fn byte_of_level_char(c: char) -> Option<u8> {
    let printable = |b: u32| matches!(b, 33..=126 | 161..=172 | 174..=255);
    let c = c as u32;
    if c < 256 {
        return printable(c).then_some(c as u8);
    }
    let n = (c - 256) as usize;
    (0u32..256).filter(|&b| !printable(b)).nth(n).map(|b| b as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> Bpe {
        let docs: Vec<String> = (0..50)
            .map(|i| {
                format!("To be, or not to be: that is the question {i}. Whether 'tis nobler\n")
            })
            .collect();
        Bpe::train(&docs, 300).unwrap()
    }

    #[test]
    fn every_text_round_trips() {
        let t = small();
        assert!(t.vocab_size() <= 300 && t.vocab_size() > 257);
        let samples = [
            "To be, or not to be",
            "",
            "  leading and trailing spaces  \n\n\t tabs",
            "ünïcödé — “quotes” 日本語 🙂 \u{0} \u{7f} \u{10ffff}",
            "<|endoftext|> in the middle of text",
        ];
        for s in samples {
            let ids = t.encode(s).unwrap();
            assert_eq!(t.decode(&ids).unwrap(), s, "round trip of {s:?}");
        }
        // Pseudo-random code points, including ones the training text never showed.
        let mut x = 12345u32;
        for _ in 0..200 {
            let s: String = (0..20)
                .filter_map(|_| {
                    x = x.wrapping_mul(1103515245).wrapping_add(12345);
                    char::from_u32((x >> 8) % 0x2_0000)
                })
                .collect();
            assert_eq!(t.decode(&t.encode(&s).unwrap()).unwrap(), s);
        }
    }

    /// A token's bytes are its own, also where it splits a character: the bytes of a text's
    /// tokens, joined, are the text's bytes.
    #[test]
    fn token_bytes_join_to_the_text() {
        let t = small();
        for s in ["To be, or not", "ünïcödé — 日本語 🙂 \u{0} \u{7f}", "a<|endoftext|>b"]
        {
            let ids = t.encode(s).unwrap();
            let bytes: Vec<u8> = ids.iter().flat_map(|&i| t.token_bytes(i).unwrap()).collect();
            assert_eq!(bytes, s.as_bytes(), "{s:?}");
        }
        // The alphabet's 256 single-byte tokens each stand for a byte of their own.
        let mut seen: Vec<u8> = (0..t.vocab_size() as u32)
            .filter_map(|i| t.token_bytes(i).filter(|b| b.len() == 1))
            .flatten()
            .collect();
        seen.sort();
        assert_eq!(seen, (0..=255).collect::<Vec<u8>>());
        assert_eq!(t.token_bytes(1_000_000), None);
    }

    /// SentencePiece's pieces: `▁` is a space, `<0xHH>` one byte.
    #[test]
    fn sentencepiece_token_bytes() {
        let json = r#"{"version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [], "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                "vocab": {"<unk>": 0, "<0xE3>": 1, "<0x81>": 2, "\u2581a": 3, "<|endoftext|>": 4},
                "merges": []}}"#;
        let t = Bpe::from_json(json).unwrap();
        assert_eq!(t.token_bytes(1).unwrap(), [0xE3]);
        assert_eq!(t.token_bytes(2).unwrap(), [0x81]);
        assert_eq!(t.token_bytes(3).unwrap(), b" a");
        assert_eq!(t.token_bytes(4).unwrap(), b"<|endoftext|>");
    }

    #[test]
    fn saves_loads_and_separates_documents() {
        let t = small();
        let u = Bpe::from_json(&t.to_json().unwrap()).unwrap();
        let docs = vec!["To be".to_string(), "or not".to_string()];
        let ids = u.encode_documents(&docs).unwrap();
        assert_eq!(ids, t.encode_documents(&docs).unwrap());
        assert_eq!(ids.iter().filter(|&&i| i == t.eot).count(), 2);
        assert_eq!(*ids.last().unwrap(), t.eot);
        assert!(Bpe::from_json("{}").is_err());
        assert!(Bpe::train(&docs, 100).is_err());
    }
}
