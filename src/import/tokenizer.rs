//! A GGUF file's tokenizer metadata (`tokenizer.ggml.*`, llama.cpp's keys) rebuilt as a Hugging
//! Face `tokenizer.json` plus a `tokenizer_config.json` (special tokens, chat template), the
//! pair `transformers` and our `Bpe` load.
//!
//! Two tokenizer models are rebuilt:
//! - `gpt2`: byte-level BPE. The vocabulary and merges are taken as they are; the pre-tokenizer
//!   (how text is cut before the merges apply) comes from `tokenizer.ggml.pre`, with the split
//!   rules llama.cpp applies for that name (`llama-vocab.cpp`), written as the Hugging Face
//!   pre-tokenizers that do the same.
//! - `llama`: SentencePiece BPE with byte fallback, the shape of Hugging Face's `LlamaTokenizer`:
//!   `▁` for spaces, a `▁` prepended to the text when `tokenizer.ggml.add_space_prefix` (default
//!   true), unknown characters as `<0xNN>` byte tokens. The file holds scores, not merges: the
//!   merges are rebuilt from the vocabulary and the scores, as `transformers` does.
//!
//! Tokens marked control (type 3) become special added tokens, user-defined ones (type 4) plain
//! added tokens, so that they are matched whole in text.

use crate::gguf::read::Gguf;
use crate::gguf::Value;
use crate::text::tokenizer::{special_token, END_OF_TEXT};
use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Map, Value as Json};
use std::collections::HashMap;

// llama.cpp's token types.
const NORMAL: i64 = 1;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;
const UNUSED: i64 = 5;

/// Llama 3's split (also used by several later models).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's split: Llama 3's with single digits.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// How text is cut before byte-level merges, by the `tokenizer.ggml.pre` names llama.cpp gives.
#[derive(Clone, Copy)]
enum PreSplit {
    /// GPT-2's split (`'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`),
    /// which Hugging Face's `ByteLevel` pre-tokenizer applies itself.
    Gpt2,
    /// Every digit on its own, then GPT-2's split (llama.cpp's `starcoder` group, `smollm`
    /// among them).
    DigitsThenGpt2,
    /// One regular expression, its matches isolated.
    Regex(&'static str),
}

const PRE_NAMES: &[(&str, PreSplit)] = &[
    ("default", PreSplit::Gpt2),
    ("gpt2", PreSplit::Gpt2),
    ("gpt-2", PreSplit::Gpt2),
    ("mpt", PreSplit::Gpt2),
    ("olmo", PreSplit::Gpt2),
    ("jais", PreSplit::Gpt2),
    ("smollm", PreSplit::DigitsThenGpt2),
    ("starcoder", PreSplit::DigitsThenGpt2),
    ("refact", PreSplit::DigitsThenGpt2),
    ("command-r", PreSplit::DigitsThenGpt2),
    ("codeshell", PreSplit::DigitsThenGpt2),
    ("exaone", PreSplit::DigitsThenGpt2),
    ("minerva-7b", PreSplit::DigitsThenGpt2),
    ("llama3", PreSplit::Regex(LLAMA3_SPLIT)),
    ("llama-v3", PreSplit::Regex(LLAMA3_SPLIT)),
    ("llama-bpe", PreSplit::Regex(LLAMA3_SPLIT)),
    ("falcon3", PreSplit::Regex(LLAMA3_SPLIT)),
    ("pixtral", PreSplit::Regex(LLAMA3_SPLIT)),
    ("dbrx", PreSplit::Regex(LLAMA3_SPLIT)),
    ("smaug-bpe", PreSplit::Regex(LLAMA3_SPLIT)),
    ("qwen2", PreSplit::Regex(QWEN2_SPLIT)),
    ("deepseek-r1-qwen", PreSplit::Regex(QWEN2_SPLIT)),
];

/// The rebuilt tokenizer: `tokenizer.json` and `tokenizer_config.json` as JSON values.
pub struct Rebuilt {
    pub tokenizer: Json,
    pub config: Json,
    /// `gpt2` or `llama`.
    pub kind: String,
    pub vocab_size: usize,
}

fn strings(g: &Gguf, key: &str) -> Result<Option<Vec<String>>> {
    let Some(v) = g.get(key) else { return Ok(None) };
    let items =
        v.as_array().with_context(|| format!("{key} is a {}, not an array", v.type_name()))?;
    let out = items
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.as_str()
                .map(str::to_string)
                .with_context(|| format!("{key}[{i}] is a {}, not a string", s.type_name()))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Some(out))
}

fn numbers(g: &Gguf, key: &str, n: usize) -> Result<Option<Vec<f64>>> {
    let Some(v) = g.get(key) else { return Ok(None) };
    let items =
        v.as_array().with_context(|| format!("{key} is a {}, not an array", v.type_name()))?;
    ensure!(items.len() == n, "{key} has {} entries, tokenizer.ggml.tokens {n}", items.len());
    let out = items
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.as_f64().with_context(|| format!("{key}[{i}] is a {}, not a number", s.type_name()))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Some(out))
}

/// The id of a special token named in the metadata, if any; an error if it is out of range.
fn special_id(g: &Gguf, key: &str, n: usize) -> Result<Option<usize>> {
    let Some(v) = g.get(key) else { return Ok(None) };
    let id = v.as_u64().with_context(|| format!("{key} is a {}, not an id", v.type_name()))?;
    ensure!((id as usize) < n, "{key} = {id} is not a token id (the vocabulary has {n} tokens)");
    Ok(Some(id as usize))
}

/// GPT-2's byte-to-character table: printable bytes stand for themselves, the others for
/// characters from U+0100 on.
pub fn byte_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u32 {
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).expect("a byte is a char")
        } else {
            next += 1;
            char::from_u32(next - 1).expect("below U+0200")
        };
    }
    table
}

fn added_token(id: usize, content: &str, special: bool) -> Json {
    json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
           "normalized": false, "special": special})
}

/// Rebuilds the tokenizer a GGUF file describes.
pub fn rebuild(g: &Gguf) -> Result<Rebuilt> {
    let model = match g.get("tokenizer.ggml.model") {
        None => bail!("the file has no tokenizer (no tokenizer.ggml.model)"),
        Some(v) => v
            .as_str()
            .with_context(|| format!("tokenizer.ggml.model is a {}", v.type_name()))?
            .to_string(),
    };
    let mut tokens =
        strings(g, "tokenizer.ggml.tokens")?.context("the file has no tokenizer.ggml.tokens")?;
    let n = tokens.len();
    ensure!(n > 0, "tokenizer.ggml.tokens is empty");
    ensure!(n <= u32::MAX as usize, "tokenizer.ggml.tokens has too many entries");
    let types: Vec<i64> = match numbers(g, "tokenizer.ggml.token_type", n)? {
        Some(t) => t.into_iter().map(|x| x as i64).collect(),
        None => vec![1; n],
    };
    let id_of = |key: &str| special_id(g, &format!("tokenizer.ggml.{key}"), n);
    let (bos, eos, unk, pad) = (
        id_of("bos_token_id")?,
        id_of("eos_token_id")?,
        id_of("unknown_token_id")?,
        id_of("padding_token_id")?,
    );

    let byte_level = match model.as_str() {
        "gpt2" => true,
        "llama" => false,
        other => bail!(
            "tokenizer model {other:?} cannot be rebuilt (supported: \"gpt2\" byte-level BPE, \"llama\" SentencePiece)"
        ),
    };
    let alphabet = byte_alphabet();
    let in_alphabet = |t: &str| t.chars().all(|c| alphabet.contains(&c));
    if byte_level {
        // A byte-level vocabulary is spelled in the byte alphabet; a token spelled otherwise
        // (an added token with other characters) is respelled from its UTF-8 bytes.
        for t in tokens.iter_mut() {
            if !in_alphabet(t) {
                *t = t.bytes().map(|b| alphabet[b as usize]).collect();
            }
        }
    }
    let mut vocab = Map::new();
    let mut first = HashMap::new();
    for (i, t) in tokens.iter().enumerate() {
        if let Some(j) = first.insert(t.as_str(), i) {
            bail!("tokenizer.ggml.tokens holds {t:?} twice (ids {j} and {i}): the vocabulary cannot be rebuilt");
        }
        vocab.insert(t.clone(), json!(i));
    }

    // Special tokens: control tokens, and those the metadata names as bos/eos/unk/pad.
    let named: Vec<usize> = [bos, eos, unk, pad].into_iter().flatten().collect();
    let mut added = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        let control = types[i] == CONTROL || named.contains(&i);
        if control && (!byte_level || in_alphabet(t)) {
            added.push(added_token(i, t, true));
        } else if types[i] == USER_DEFINED {
            added.push(added_token(i, t, false));
        }
    }

    let merges: Vec<(String, String)> = match strings(g, "tokenizer.ggml.merges")? {
        Some(m) => m
            .iter()
            .enumerate()
            .map(|(i, s)| match s.split(' ').collect::<Vec<_>>()[..] {
                [a, b] => Ok((a.to_string(), b.to_string())),
                _ => bail!(
                    "tokenizer.ggml.merges[{i}] = {s:?} is not two tokens separated by a space"
                ),
            })
            .collect::<Result<_>>()?,
        None if byte_level => {
            bail!("a gpt2 tokenizer needs tokenizer.ggml.merges, which the file lacks")
        }
        None => {
            let scores = numbers(g, "tokenizer.ggml.scores", n)?
                .context("a llama tokenizer without merges needs tokenizer.ggml.scores")?;
            merges_from_scores(&tokens, &scores)
        }
    };
    for (i, (a, b)) in merges.iter().enumerate() {
        ensure!(
            vocab.contains_key(a) && vocab.contains_key(b),
            "tokenizer.ggml.merges[{i}] = \"{a} {b}\" names a token the vocabulary lacks"
        );
    }
    let merges: Vec<Json> = merges.into_iter().map(|(a, b)| json!([a, b])).collect();

    let (pre_tokenizer, decoder, bpe_extra) = if byte_level {
        let pre = match g.get("tokenizer.ggml.pre") {
            None => "default".to_string(),
            Some(v) => v.as_str().context("tokenizer.ggml.pre is not a string")?.to_string(),
        };
        let split = PRE_NAMES.iter().find(|(name, _)| *name == pre).map(|(_, s)| *s);
        let Some(split) = split else {
            let known: Vec<&str> = PRE_NAMES.iter().map(|(n, _)| *n).collect();
            bail!(
                "byte-level pre-tokenizer {pre:?} (tokenizer.ggml.pre) cannot be rebuilt: its split rules are not known here (known: {})",
                known.join(", ")
            )
        };
        let pre = pre_tokenizer(split);
        let decoder = json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true});
        (pre, decoder, json!({"unk_token": null, "fuse_unk": false, "byte_fallback": false}))
    } else {
        let prefix = match g.get("tokenizer.ggml.add_space_prefix") {
            None => true,
            Some(v) => v.as_bool().context("tokenizer.ggml.add_space_prefix is not a bool")?,
        };
        let pre = json!({"type": "Metaspace", "replacement": "\u{2581}",
                         "prepend_scheme": if prefix { "first" } else { "never" }, "split": false});
        let mut steps = vec![
            json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}),
            json!({"type": "ByteFallback"}),
            json!({"type": "Fuse"}),
        ];
        if prefix {
            steps.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
        }
        let unk_token = unk
            .map(|u| tokens[u].clone())
            .or_else(|| tokens.iter().any(|t| t == "<unk>").then(|| "<unk>".to_string()));
        let byte_tokens = (0..=255u8).all(|b| vocab.contains_key(&format!("<0x{b:02X}>")));
        ensure!(
            byte_tokens,
            "this SentencePiece vocabulary lacks some of the 256 byte tokens <0x00>..<0xFF>, which byte fallback needs"
        );
        (
            pre,
            json!({"type": "Sequence", "decoders": steps}),
            json!({"unk_token": unk_token, "fuse_unk": true, "byte_fallback": true}),
        )
    };
    let mut bpe = json!({"type": "BPE", "dropout": null, "continuing_subword_prefix": null,
                         "end_of_word_suffix": null, "ignore_merges": false,
                         "vocab": Json::Object(vocab), "merges": merges});
    for (k, v) in bpe_extra.as_object().expect("an object") {
        bpe[k] = v.clone();
    }
    let tokenizer = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": pre_tokenizer, "post_processor": null,
        "decoder": decoder, "model": bpe,
    });

    let name = |id: Option<usize>| id.map_or(Json::Null, |i| json!(tokens[i]));
    let mut config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name(bos), "eos_token": name(eos), "unk_token": name(unk), "pad_token": name(pad),
        "add_bos_token": flag(g, "tokenizer.ggml.add_bos_token")?.unwrap_or(!byte_level),
        "add_eos_token": flag(g, "tokenizer.ggml.add_eos_token")?.unwrap_or(false),
        "clean_up_tokenization_spaces": false,
    });
    if let Some(ctx) = g.get("llama.context_length").and_then(Value::as_u64) {
        config["model_max_length"] = json!(ctx);
    }
    if let Some(t) = g.get("tokenizer.chat_template") {
        config["chat_template"] =
            json!(t.as_str().context("tokenizer.chat_template is not a string")?);
    }
    Ok(Rebuilt { tokenizer, config, kind: model, vocab_size: n })
}

/// The Hugging Face pre-tokenizer that cuts text as `split` does.
fn pre_tokenizer(split: PreSplit) -> Json {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    match split {
        PreSplit::Gpt2 => byte_level(true),
        PreSplit::DigitsThenGpt2 => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        PreSplit::Regex(r) => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false},
            byte_level(false)]}),
    }
}

fn flag(g: &Gguf, key: &str) -> Result<Option<bool>> {
    g.get(key)
        .map(|v| v.as_bool().with_context(|| format!("{key} is a {}, not a bool", v.type_name())))
        .transpose()
}

/// The `tokenizer.ggml.pre` name export writes for each split rule: one llama.cpp applies that
/// rule for (and import reads back).
const EXPORT_PRE_NAMES: [(&str, PreSplit); 4] = [
    ("gpt-2", PreSplit::Gpt2),
    ("smollm", PreSplit::DigitsThenGpt2),
    ("llama-bpe", PreSplit::Regex(LLAMA3_SPLIT)),
    ("qwen2", PreSplit::Regex(QWEN2_SPLIT)),
];

/// A tokenizer as `tokenizer.ggml.*` metadata, and what the log line says of it.
pub struct Described {
    pub metadata: Vec<(String, Value)>,
    pub pre: &'static str,
    pub merges: usize,
}

/// The inverse of [`rebuild`] for byte-level BPE: a Hugging Face `tokenizer.json` (with its
/// `tokenizer_config.json` and chat template, where there are) as llama.cpp's `gpt2` tokenizer
/// metadata of `vocab_size` tokens. Added tokens are control tokens when special, user-defined
/// otherwise; ids the tokenizer leaves out become unused tokens `[PADn]`, as llama.cpp's
/// converter writes them. Without a `bos_token` the end-of-text token stands in, as in GPT-2
/// (llama.cpp would otherwise take id 11).
pub fn describe(
    tokenizer: &Json,
    config: Option<&Json>,
    chat_template: Option<&str>,
    vocab_size: usize,
) -> Result<Described> {
    let model = &tokenizer["model"];
    ensure!(
        model["type"] == "BPE",
        "the tokenizer's model is {}: only byte-level BPE tokenizers export",
        model["type"]
    );
    ensure!(
        model["byte_fallback"] != true && tokenizer["normalizer"].is_null(),
        "the tokenizer is SentencePiece-style (byte fallback, a normalizer): only byte-level BPE tokenizers export (llama.cpp's \"gpt2\" tokenizer)"
    );
    let pre = pre_name(&tokenizer["pre_tokenizer"])?;

    let mut tokens: Vec<Option<String>> = vec![None; vocab_size];
    let mut types = vec![NORMAL; vocab_size];
    let mut place = |id: &Json, token: &str, ty: i64| -> Result<()> {
        let i = id.as_u64().with_context(|| format!("token {token:?} has id {id}"))? as usize;
        ensure!(
            i < vocab_size,
            "token {token:?} has id {i}, but the model's vocabulary has {vocab_size} entries"
        );
        tokens[i] = Some(token.to_string());
        types[i] = ty;
        Ok(())
    };
    let vocab = model["vocab"].as_object().context("the tokenizer has no model.vocab object")?;
    for (token, id) in vocab {
        place(id, token, NORMAL)?;
    }
    let added = tokenizer["added_tokens"].as_array().map_or(&[][..], Vec::as_slice);
    for t in added {
        let content = t["content"].as_str().context("an added token has no content")?;
        place(&t["id"], content, if t["special"] == true { CONTROL } else { USER_DEFINED })?;
    }
    let tokens: Vec<String> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            t.unwrap_or_else(|| {
                types[i] = UNUSED;
                format!("[PAD{i}]")
            })
        })
        .collect();
    let mut ids = HashMap::new();
    for (i, t) in tokens.iter().enumerate() {
        if let Some(j) = ids.insert(t.as_str(), i) {
            bail!("the tokenizer spells ids {j} and {i} alike ({t:?}): llama.cpp's token list cannot hold both");
        }
    }

    let merges = model["merges"].as_array().context("the tokenizer has no model.merges list")?;
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let pair = match m {
                Json::String(s) => s.split_once(' '),
                Json::Array(p) => {
                    p.first().and_then(Json::as_str).zip(p.get(1).and_then(Json::as_str))
                }
                _ => None,
            };
            let (a, b) =
                pair.with_context(|| format!("merge {i} ({m}) is not a pair of tokens"))?;
            ensure!(
                !a.contains(' ') && !b.contains(' '),
                "merge {i} ({m}) holds a space, which llama.cpp's \"a b\" form cannot"
            );
            Ok(Value::Str(format!("{a} {b}")))
        })
        .collect::<Result<Vec<_>>>()?;

    let none = Json::Null;
    let config = config.unwrap_or(&none);
    let id_of = |key: &str| -> Result<Option<u32>> {
        let Some(name) = special_token(config, key) else { return Ok(None) };
        let id = ids.get(name).with_context(|| {
            format!("tokenizer_config.json names {key} {name:?}, which the vocabulary lacks")
        })?;
        Ok(Some(*id as u32))
    };
    let eos = match id_of("eos_token")? {
        Some(id) => id,
        None => *ids.get(END_OF_TEXT).with_context(|| {
            format!("the tokenizer has no end-of-text token ({END_OF_TEXT}, or an eos_token in tokenizer_config.json)")
        })? as u32,
    };
    let bos = id_of("bos_token")?.unwrap_or(eos);
    let (unk, pad) = (id_of("unk_token")?, id_of("pad_token")?);
    let flag = |key: &str| config[key].as_bool();

    let merge_count = merges.len();
    let strings = |v: Vec<String>| Value::Array(v.into_iter().map(Value::Str).collect());
    let mut metadata = vec![
        ("tokenizer.ggml.model".to_string(), Value::Str("gpt2".into())),
        ("tokenizer.ggml.pre".to_string(), Value::Str(pre.into())),
        ("tokenizer.ggml.tokens".to_string(), strings(tokens)),
        (
            "tokenizer.ggml.token_type".to_string(),
            Value::Array(types.into_iter().map(|t| Value::I32(t as i32)).collect()),
        ),
        ("tokenizer.ggml.merges".to_string(), Value::Array(merges)),
        ("tokenizer.ggml.bos_token_id".to_string(), Value::U32(bos)),
        ("tokenizer.ggml.eos_token_id".to_string(), Value::U32(eos)),
    ];
    for (key, id) in [("unknown_token_id", unk), ("padding_token_id", pad)] {
        if let Some(id) = id {
            metadata.push((format!("tokenizer.ggml.{key}"), Value::U32(id)));
        }
    }
    metadata.push((
        "tokenizer.ggml.add_bos_token".to_string(),
        Value::Bool(flag("add_bos_token").unwrap_or(false)),
    ));
    if let Some(b) = flag("add_eos_token") {
        metadata.push(("tokenizer.ggml.add_eos_token".to_string(), Value::Bool(b)));
    }
    if let Some(t) = chat_template {
        metadata.push(("tokenizer.chat_template".to_string(), Value::Str(t.to_string())));
    }
    Ok(Described { metadata, pre, merges: merge_count })
}

/// The `tokenizer.ggml.pre` name of a Hugging Face pre-tokenizer: the split rule it applies, as
/// [`pre_tokenizer`] writes it (`trim_offsets` aside, which moves offsets, not ids).
fn pre_name(pre: &Json) -> Result<&'static str> {
    fn without_offsets(j: &Json) -> Json {
        match j {
            Json::Object(m) => Json::Object(
                m.iter()
                    .filter(|(k, _)| *k != "trim_offsets")
                    .map(|(k, v)| (k.clone(), without_offsets(v)))
                    .collect(),
            ),
            Json::Array(a) => Json::Array(a.iter().map(without_offsets).collect()),
            other => other.clone(),
        }
    }
    let pre = without_offsets(pre);
    EXPORT_PRE_NAMES
        .iter()
        .find(|(_, split)| without_offsets(&pre_tokenizer(*split)) == pre)
        .map(|(name, _)| *name)
        .with_context(|| {
            format!(
                "the tokenizer's pre-tokenizer {pre} is not one llama.cpp knows by name (export writes GPT-2's split, single digits then GPT-2's, Llama 3's and Qwen 2's)"
            )
        })
}

/// The merges a SentencePiece vocabulary implies: every way to cut a token into two tokens of
/// the vocabulary is a merge, ranked by the score of the token it makes (best first; ties by
/// the lengths of the two parts, longer first, then vocabulary order). This is what
/// `transformers` does for a GGUF file without merges (`generate_merges`).
pub fn merges_from_scores(tokens: &[String], scores: &[f64]) -> Vec<(String, String)> {
    let ids: HashMap<&str, usize> =
        tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    let mut merges: Vec<(String, String, f64, usize, usize)> = Vec::new();
    for (t, &score) in tokens.iter().zip(scores) {
        let cuts: Vec<usize> = t.char_indices().map(|(i, _)| i).skip(1).collect();
        let mut local: Vec<(usize, usize, &str, &str)> = cuts
            .into_iter()
            .filter_map(|i| {
                let (l, r) = t.split_at(i);
                Some((*ids.get(l)?, *ids.get(r)?, l, r))
            })
            .collect();
        local.sort_by_key(|&(a, b, _, _)| (a, b));
        for (_, _, l, r) in local {
            merges.push((
                l.to_string(),
                r.to_string(),
                score,
                l.chars().count(),
                r.chars().count(),
            ));
        }
    }
    // Descending by (score, left length, right length); stable, so ties keep their order.
    merges.sort_by(|x, y| {
        y.2.partial_cmp(&x.2)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(y.3.cmp(&x.3))
            .then(y.4.cmp(&x.4))
    });
    merges.into_iter().map(|(l, r, ..)| (l, r)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_byte_alphabet_is_gpt2s() {
        let a = byte_alphabet();
        assert_eq!(a[b'A' as usize], 'A');
        assert_eq!(a[b' ' as usize], '\u{120}'); // Ġ
        assert_eq!(a[b'\n' as usize], '\u{10a}'); // Ċ
        let distinct: std::collections::HashSet<char> = a.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn merges_follow_the_scores() {
        let tokens: Vec<String> =
            ["a", "b", "c", "ab", "bc", "abc"].iter().map(|s| s.to_string()).collect();
        let scores = [0.0, 0.0, 0.0, -1.0, -2.0, -0.5];
        let m = merges_from_scores(&tokens, &scores);
        let m: Vec<String> = m.iter().map(|(a, b)| format!("{a} {b}")).collect();
        // abc (-0.5) first: "ab c" (left part longer) before "a bc"; then ab (-1), then bc (-2).
        assert_eq!(m, ["ab c", "a bc", "a b", "b c"]);
    }
}
