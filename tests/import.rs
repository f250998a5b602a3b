//! `attnres import` on small GGUF files and Hugging Face directories that the tests write
//! themselves: every supported tensor type against a naive dequantisation written here from the
//! format's definition (ggml's `ggml-common.h` block layouts), llama.cpp's query/key row order
//! undone, both tokenizer kinds rebuilt, and every kind of bad input refused with one named
//! error line and nothing left behind. The real-model check against `transformers` is
//! scripts/reference/check_import.py (docs/import.md).

mod common;

use attnres::model::checkpoint;
use attnres::text::tokenizer::Bpe;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Output};

fn attnres(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_attnres")).args(args).output().expect("binary runs")
}

// ---------------------------------------------------------------------------------------------
// A GGUF writer (version 3, little-endian, alignment 32), from the specification.

enum Meta {
    U32(u32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
    F32s(Vec<f32>),
}

struct RawTensor {
    name: String,
    /// ggml order: innermost first.
    dims: Vec<u64>,
    type_id: u32,
    data: Vec<u8>,
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn write_gguf(meta: &[(String, Meta)], tensors: &[RawTensor]) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    out.extend(3u32.to_le_bytes());
    out.extend((tensors.len() as u64).to_le_bytes());
    out.extend((meta.len() as u64).to_le_bytes());
    for (k, v) in meta {
        put_str(&mut out, k);
        match v {
            Meta::U32(x) => {
                out.extend(4u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Meta::F32(x) => {
                out.extend(6u32.to_le_bytes());
                out.extend(x.to_le_bytes());
            }
            Meta::Bool(b) => {
                out.extend(7u32.to_le_bytes());
                out.push(*b as u8);
            }
            Meta::Str(s) => {
                out.extend(8u32.to_le_bytes());
                put_str(&mut out, s);
            }
            Meta::Strs(a) => {
                out.extend(9u32.to_le_bytes());
                out.extend(8u32.to_le_bytes());
                out.extend((a.len() as u64).to_le_bytes());
                a.iter().for_each(|s| put_str(&mut out, s));
            }
            Meta::I32s(a) => {
                out.extend(9u32.to_le_bytes());
                out.extend(5u32.to_le_bytes());
                out.extend((a.len() as u64).to_le_bytes());
                a.iter().for_each(|x| out.extend(x.to_le_bytes()));
            }
            Meta::F32s(a) => {
                out.extend(9u32.to_le_bytes());
                out.extend(6u32.to_le_bytes());
                out.extend((a.len() as u64).to_le_bytes());
                a.iter().for_each(|x| out.extend(x.to_le_bytes()));
            }
        }
    }
    let mut offset = 0u64;
    for t in tensors {
        put_str(&mut out, &t.name);
        out.extend((t.dims.len() as u32).to_le_bytes());
        t.dims.iter().for_each(|d| out.extend(d.to_le_bytes()));
        out.extend(t.type_id.to_le_bytes());
        out.extend(offset.to_le_bytes());
        offset += (t.data.len() as u64).div_ceil(32) * 32;
    }
    for t in tensors {
        while !out.len().is_multiple_of(32) {
            out.push(0);
        }
        out.extend(&t.data);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Random encoded tensors and their values by the format's definition.

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn byte(&mut self) -> u8 {
        (self.next() >> 24) as u8
    }
    /// A binary16 of magnitude 2^(lo-15) .. 2^(hi-14), either sign.
    fn half(&mut self, lo: u64, hi: u64, signed: bool) -> u16 {
        let sign = if signed { (self.next() & 1) << 15 } else { 0 };
        let exp = lo + self.next() % (hi - lo + 1);
        (sign | exp << 10 | (self.next() & 0x3ff)) as u16
    }
}

/// binary16 by its definition: (-1)^s · 2^(e-15) · (1 + f/1024) (normal numbers only here).
fn half_value(h: u16) -> f32 {
    let s = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
    let e = ((h >> 10) & 0x1f) as i32;
    let f = (h & 0x3ff) as f64;
    assert!(e > 0 && e < 31, "test halves are normal numbers");
    (s * 2f64.powi(e - 15) * (1.0 + f / 1024.0)) as f32
}

const F32: u32 = 0;
const F16: u32 = 1;
const Q4_0: u32 = 2;
const Q4_1: u32 = 3;
const Q8_0: u32 = 8;
const BF16: u32 = 30;

/// `n` random values encoded as ggml type `ty`: the bytes, and the values the specification
/// gives them. Q8_0: a half scale d, then 32 int8 q, value q·d. Q4_0: d, then 16 bytes whose
/// low nibbles are values 0..16 and high nibbles values 16..32, value (nibble − 8)·d. Q4_1: d, a
/// half minimum m, the same nibbles, value nibble·d + m.
fn encoded(ty: u32, n: usize, rng: &mut Rng) -> (Vec<u8>, Vec<f32>) {
    let (mut bytes, mut values) = (Vec::new(), Vec::new());
    match ty {
        F32 => {
            for _ in 0..n {
                let x = (rng.next() % 2001) as f32 / 1000.0 - 1.0;
                bytes.extend(x.to_le_bytes());
                values.push(x);
            }
        }
        F16 => {
            for _ in 0..n {
                let h = rng.half(8, 16, true);
                bytes.extend(h.to_le_bytes());
                values.push(half_value(h));
            }
        }
        BF16 => {
            for _ in 0..n {
                let x = (rng.next() % 2001) as f32 / 1000.0 - 1.0;
                let b = (x.to_bits() >> 16) as u16;
                bytes.extend(b.to_le_bytes());
                values.push(f32::from_bits(x.to_bits() & 0xffff_0000));
            }
        }
        Q8_0 | Q4_0 | Q4_1 => {
            assert_eq!(n % 32, 0);
            for _ in 0..n / 32 {
                let d = rng.half(5, 9, false);
                bytes.extend(d.to_le_bytes());
                let d = half_value(d);
                if ty == Q8_0 {
                    let qs: Vec<u8> = (0..32).map(|_| rng.byte()).collect();
                    bytes.extend(&qs);
                    values.extend(qs.iter().map(|&q| (q as i8) as f32 * d));
                    continue;
                }
                let m = if ty == Q4_1 {
                    let m = rng.half(8, 13, true);
                    bytes.extend(m.to_le_bytes());
                    half_value(m)
                } else {
                    0.0
                };
                let qs: Vec<u8> = (0..16).map(|_| rng.byte()).collect();
                bytes.extend(&qs);
                for k in 0..32 {
                    let nibble = if k < 16 { qs[k] & 0x0f } else { qs[k - 16] >> 4 };
                    values.push(if ty == Q4_0 {
                        (nibble as i32 - 8) as f32 * d
                    } else {
                        nibble as f32 * d + m
                    });
                }
            }
        }
        _ => panic!("no encoder for type {ty}"),
    }
    (bytes, values)
}

// ---------------------------------------------------------------------------------------------
// A tiny Llama model as a GGUF file.

const HIDDEN: usize = 64;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 16;
const FF: usize = 96;
const LAYERS: usize = 2;

/// GPT-2's byte alphabet (`bytes_to_unicode`): printable bytes stand for themselves, the rest
/// for U+0100 on, in byte order.
fn gpt2_alphabet() -> Vec<char> {
    let mut next = 256;
    (0u32..256)
        .map(|b| {
            if (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b) {
                char::from_u32(b).unwrap()
            } else {
                next += 1;
                char::from_u32(next - 1).unwrap()
            }
        })
        .collect()
}

struct Tok {
    meta: Vec<(String, Meta)>,
    tokens: Vec<String>,
}

/// A byte-level vocabulary: the 256 bytes, three merges, two control tokens.
fn gpt2_tokenizer() -> Tok {
    let mut tokens: Vec<String> = gpt2_alphabet().iter().map(|c| c.to_string()).collect();
    tokens.extend(["Ġt", "he", "Ġthe", "<|endoftext|>", "<|im_end|>"].map(String::from));
    let mut types = vec![1; tokens.len()];
    let n = tokens.len();
    types[n - 2] = 3;
    types[n - 1] = 3;
    let meta = vec![
        ("tokenizer.ggml.model".into(), Meta::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Meta::Str("smollm".into())),
        ("tokenizer.ggml.tokens".into(), Meta::Strs(tokens.clone())),
        ("tokenizer.ggml.token_type".into(), Meta::I32s(types)),
        (
            "tokenizer.ggml.merges".into(),
            Meta::Strs(vec!["Ġ t".into(), "h e".into(), "Ġt he".into()]),
        ),
        ("tokenizer.ggml.bos_token_id".into(), Meta::U32(n as u32 - 2)),
        ("tokenizer.ggml.eos_token_id".into(), Meta::U32(n as u32 - 1)),
        ("tokenizer.ggml.add_bos_token".into(), Meta::Bool(false)),
        ("tokenizer.chat_template".into(), Meta::Str("{{ messages[0]['content'] }}".into())),
    ];
    Tok { meta, tokens }
}

/// A SentencePiece vocabulary: unknown, BOS, EOS, the 256 byte tokens and a few pieces with
/// scores, no merges.
fn spm_tokenizer() -> Tok {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    let mut types = vec![2, 3, 3];
    let mut scores = vec![0.0, 0.0, 0.0];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
        scores.push(0.0);
    }
    for (piece, score) in [
        ("▁", -1.0),
        ("t", -2.0),
        ("h", -3.0),
        ("e", -4.0),
        ("▁t", -5.0),
        ("he", -6.0),
        ("▁the", -7.0),
    ] {
        tokens.push(piece.into());
        types.push(1);
        scores.push(score);
    }
    let meta = vec![
        ("tokenizer.ggml.model".into(), Meta::Str("llama".into())),
        ("tokenizer.ggml.tokens".into(), Meta::Strs(tokens.clone())),
        ("tokenizer.ggml.token_type".into(), Meta::I32s(types)),
        ("tokenizer.ggml.scores".into(), Meta::F32s(scores)),
        ("tokenizer.ggml.bos_token_id".into(), Meta::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Meta::U32(2)),
        ("tokenizer.ggml.unknown_token_id".into(), Meta::U32(0)),
    ];
    Tok { meta, tokens }
}

/// The tensors of a two-layer Llama with vocabulary `vocab` (one of each supported type, and
/// an untied output), and the values our checkpoint must hold for each (Hugging Face names and
/// order).
fn llama_tensors(vocab: usize, rng: &mut Rng) -> (Vec<RawTensor>, BTreeMap<String, Vec<f32>>) {
    let (q, kv) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    // (gguf name, our name, [out, in] or [d], type, heads whose rows llama.cpp reordered)
    let mut plan: Vec<(String, String, Vec<usize>, u32, usize)> = vec![
        (
            "token_embd.weight".into(),
            "model.embed_tokens.weight".into(),
            vec![vocab, HIDDEN],
            Q8_0,
            0,
        ),
        ("output_norm.weight".into(), "model.norm.weight".into(), vec![HIDDEN], F32, 0),
        ("output.weight".into(), "lm_head.weight".into(), vec![vocab, HIDDEN], Q4_0, 0),
    ];
    let types =
        [[Q4_0, Q4_1, F16, BF16, Q8_0, Q4_1, Q4_0], [Q4_1, Q4_0, Q8_0, F16, Q8_0, BF16, F32]];
    for (i, ty) in types.iter().enumerate() {
        let l = |g: &str, h: &str, shape: Vec<usize>, t: u32, heads: usize| {
            (format!("blk.{i}.{g}.weight"), format!("model.layers.{i}.{h}.weight"), shape, t, heads)
        };
        plan.extend([
            l("attn_norm", "input_layernorm", vec![HIDDEN], F32, 0),
            l("attn_q", "self_attn.q_proj", vec![q, HIDDEN], ty[0], HEADS),
            l("attn_k", "self_attn.k_proj", vec![kv, HIDDEN], ty[1], KV_HEADS),
            l("attn_v", "self_attn.v_proj", vec![kv, HIDDEN], ty[2], 0),
            l("attn_output", "self_attn.o_proj", vec![HIDDEN, q], ty[3], 0),
            l("ffn_norm", "post_attention_layernorm", vec![HIDDEN], F32, 0),
            l("ffn_gate", "mlp.gate_proj", vec![FF, HIDDEN], ty[4], 0),
            l("ffn_up", "mlp.up_proj", vec![FF, HIDDEN], ty[5], 0),
            l("ffn_down", "mlp.down_proj", vec![HIDDEN, FF], ty[6], 0),
        ]);
    }
    let mut tensors = Vec::new();
    let mut expected = BTreeMap::new();
    for (gname, name, shape, ty, heads) in plan {
        let n: usize = shape.iter().product();
        let (data, values) = encoded(ty, n, rng);
        let ours = if heads > 0 {
            // The file holds llama.cpp's order: our [heads, 2, hd/2, in] with its two middle
            // axes swapped. File row (h, i, j) is our row (h, j, i).
            let (cols, half) = (shape[1], HEAD_DIM / 2);
            let mut ours = vec![0.0; n];
            for h in 0..heads {
                for i in 0..half {
                    for j in 0..2 {
                        let file_row = h * HEAD_DIM + i * 2 + j;
                        let our_row = h * HEAD_DIM + j * half + i;
                        ours[our_row * cols..(our_row + 1) * cols]
                            .copy_from_slice(&values[file_row * cols..(file_row + 1) * cols]);
                    }
                }
            }
            ours
        } else {
            values
        };
        let dims = shape.iter().rev().map(|&d| d as u64).collect();
        tensors.push(RawTensor { name: gname, dims, type_id: ty, data });
        expected.insert(name, ours);
    }
    (tensors, expected)
}

fn llama_meta(arch: &str) -> Vec<(String, Meta)> {
    let u = |k: &str, v: usize| (k.to_string(), Meta::U32(v as u32));
    vec![
        ("general.architecture".into(), Meta::Str(arch.into())),
        ("general.name".into(), Meta::Str("tiny test llama".into())),
        u("llama.block_count", LAYERS),
        u("llama.context_length", 32),
        u("llama.embedding_length", HIDDEN),
        u("llama.feed_forward_length", FF),
        u("llama.attention.head_count", HEADS),
        u("llama.attention.head_count_kv", KV_HEADS),
        u("llama.rope.dimension_count", HEAD_DIM),
        ("llama.rope.freq_base".into(), Meta::F32(10000.0)),
        ("llama.attention.layer_norm_rms_epsilon".into(), Meta::F32(1e-5)),
    ]
}

/// A tiny GGUF with the given tokenizer; returns the file and the expected tensors.
fn tiny_gguf(tok: Tok, seed: u64) -> (Vec<u8>, BTreeMap<String, Vec<f32>>) {
    let mut rng = Rng(seed);
    let (tensors, expected) = llama_tensors(tok.tokens.len(), &mut rng);
    let mut meta = llama_meta("llama");
    meta.extend(tok.meta);
    (write_gguf(&meta, &tensors), expected)
}

fn import_ok(from: &Path, out: &Path) {
    let o = attnres(&["import", "--from", from.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "import failed: {}", String::from_utf8_lossy(&o.stderr));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("imported"), "{err}");
}

/// The imported weights (block formats dequantised) are `expected` bit for bit.
fn assert_weights(out: &Path, expected: &BTreeMap<String, Vec<f32>>) {
    let model = checkpoint::load(out).unwrap();
    assert_eq!(model.layout.specs.len(), expected.len());
    for s in &model.layout.specs {
        let want = &expected[&s.name];
        let got = &model.values(s);
        let bad = got.iter().zip(want).position(|(a, b)| a.to_bits() != b.to_bits());
        assert!(
            bad.is_none(),
            "{}: value {} is {}, expected {}",
            s.name,
            bad.unwrap(),
            got[bad.unwrap()],
            want[bad.unwrap()]
        );
    }
}

#[test]
fn a_gguf_of_every_supported_type_imports_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let (bytes, expected) = tiny_gguf(gpt2_tokenizer(), 7);
    let file = tmp.path().join("tiny.gguf");
    std::fs::write(&file, &bytes).unwrap();
    let out = tmp.path().join("ck");
    import_ok(&file, &out);
    assert_weights(&out, &expected);
    // The products whose tensors are all in F16 or block formats keep them; with --dtype f32
    // none.
    let kept = checkpoint::load(&out).unwrap();
    let formats: BTreeSet<&str> =
        kept.quant.values().flat_map(|q| q.parts.iter().map(|p| p.format.name())).collect();
    assert_eq!(formats, BTreeSet::from(["F16", "Q4_0", "Q4_1", "Q8_0"]));
    // Layer 0's q/k/v (Q4_0, Q4_1, F16) are kept as three parts of one product, its o_proj
    // (BF16) is expanded; layer 1's gate and up mix Q8_0 with BF16, read by one product: both
    // expanded.
    let (l0, l1) = (&kept.layout.layers[0], &kept.layout.layers[1]);
    let qkv = &kept.quant[&l0.qkv.start].parts;
    assert_eq!(qkv.iter().map(|p| p.format.name()).collect::<Vec<_>>(), ["Q4_0", "Q4_1", "F16"]);
    assert!(!kept.quant.contains_key(&l0.o_proj.start));
    assert!(!kept.quant.contains_key(&l1.gate_up.start));
    assert_eq!(kept.quant[&l1.qkv.start].parts.len(), 3);
    let f32_out = tmp.path().join("ck-f32");
    let o = attnres(&[
        "import",
        "--from",
        file.to_str().unwrap(),
        "--out",
        f32_out.to_str().unwrap(),
        "--dtype",
        "f32",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!checkpoint::load(&f32_out).unwrap().is_quantized());
    assert_weights(&f32_out, &expected);

    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["num_key_value_heads"], 2);
    assert_eq!(config["tie_word_embeddings"], false);
    assert_eq!(config["residual"], "standard");
    assert_eq!(config["rope_theta"], 10000.0);

    // The tokenizer: merges, special tokens matched whole, single digits, the model's EOS.
    let tc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(tc["eos_token"], "<|im_end|>");
    assert_eq!(tc["chat_template"], "{{ messages[0]['content'] }}");
    let bpe = Bpe::load(&out.join("tokenizer.json")).unwrap();
    let id = |t: &str| gpt2_tokenizer().tokens.iter().position(|x| x == t).unwrap() as u32;
    assert_eq!(bpe.eot, id("<|im_end|>"));
    assert_eq!(bpe.encode(" the").unwrap(), [id("Ġthe")]);
    assert_eq!(bpe.encode("the").unwrap(), [id("t"), id("he")]);
    assert_eq!(bpe.encode("a<|im_end|>b").unwrap(), [id("a"), id("<|im_end|>"), id("b")]);
    assert_eq!(bpe.encode("12").unwrap(), [id("1"), id("2")]);
    for s in ["héllo wörld 日本 🙂", "  two  spaces\n\ttab", ""] {
        assert_eq!(bpe.decode(&bpe.encode(s).unwrap()).unwrap(), s);
    }

    // The imported model generates.
    let o = attnres(&[
        "generate",
        "--model",
        out.to_str().unwrap(),
        "--prompt",
        " the",
        "--max-tokens",
        "4",
        "--temperature",
        "0",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).starts_with(" the"));

    // --chat puts the message into the model's template (here the message alone) and prints
    // the answer alone; --system goes with --chat only.
    let model = out.to_str().unwrap();
    let chat = |extra: &[&str]| {
        let mut args =
            vec!["generate", "--model", model, "--max-tokens", "3", "--temperature", "0"];
        args.extend(extra);
        attnres(&args)
    };
    let o = chat(&["--chat", " the", "--system", "be brief"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!String::from_utf8_lossy(&o.stdout).starts_with(" the"), "the prompt is not echoed");
    let o = chat(&["--prompt", "x", "--system", "be brief"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--system goes with --chat"));
    std::fs::remove_file(out.join("tokenizer_config.json")).unwrap();
    let o = chat(&["--chat", "hi"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("has no chat template"));
}

#[test]
fn a_sentencepiece_gguf_gets_a_byte_fallback_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let (bytes, expected) = tiny_gguf(spm_tokenizer(), 11);
    let file = tmp.path().join("spm.gguf");
    std::fs::write(&file, &bytes).unwrap();
    let out = tmp.path().join("ck");
    import_ok(&file, &out);
    assert_weights(&out, &expected);
    let bpe = Bpe::load(&out.join("tokenizer.json")).unwrap();
    let id = |t: &str| spm_tokenizer().tokens.iter().position(|x| x == t).unwrap() as u32;
    assert_eq!(bpe.eot, id("</s>"));
    // A space is prepended; "▁the" is one piece; "€" is not in the vocabulary: its three bytes.
    assert_eq!(bpe.encode("the").unwrap(), [id("▁the")]);
    assert_eq!(
        bpe.encode("the €").unwrap(),
        [id("▁the"), id("▁"), id("<0xE2>"), id("<0x82>"), id("<0xAC>")]
    );
    assert_eq!(bpe.decode(&bpe.encode("the €").unwrap()).unwrap(), "the €");
    // Streamed pieces keep their spaces: the decoder strips one leading space from the text,
    // not from every piece.
    let mut stream = attnres::infer::generate::TextStream::new(&bpe).after(Some(id("▁the")));
    let pieces: String =
        [id("▁the"), id("▁t"), id("he")].iter().filter_map(|&t| stream.push(t)).collect();
    assert_eq!(pieces + &stream.finish().unwrap(), " the the");
    let tc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        (tc["bos_token"].as_str(), tc["add_bos_token"].as_bool()),
        (Some("<s>"), Some(true))
    );
}

/// One POST to a server on a loopback port; the body of the answer (de-chunked, for streams).
fn post(port: u16, path: &str, body: &serde_json::Value) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    let body = body.to_string();
    write!(s, "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{raw}");
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return rest.to_string();
    }
    common::dechunk(rest)
}

/// The server's text for a SentencePiece model is `generate`'s: words keep their spaces, whole
/// and streamed, and characters whose bytes come as separate tokens are whole (a sampled run
/// of a random model, compared with `attnres generate`, which streams through the same
/// decoder); log-probabilities' token texts add up to the text.
#[test]
fn a_sentencepiece_model_is_served_with_its_spaces() {
    use serde_json::{json, Value};
    use std::io::BufRead;
    let tmp = tempfile::tempdir().unwrap();
    let (bytes, _) = tiny_gguf(spm_tokenizer(), 11);
    let file = tmp.path().join("spm.gguf");
    std::fs::write(&file, &bytes).unwrap();
    let out = tmp.path().join("ck");
    import_ok(&file, &out);
    let id = |t: &str| spm_tokenizer().tokens.iter().position(|x| x == t).unwrap() as u32;
    /// The server, stopped however the test ends.
    struct Server(std::process::Child);
    impl Drop for Server {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Server(
        Command::new(env!("CARGO_BIN_EXE_attnres"))
            .args(["serve", "--model", out.to_str().unwrap(), "--port", "0"])
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut lines = std::io::BufReader::new(child.0.stderr.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    std::thread::spawn(move || lines.for_each(drop));
    let port: u16 = first
        .rsplit_once("127.0.0.1:")
        .unwrap()
        .1
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();

    // "▁the" forced three times after "the": " the the the", whole and streamed.
    let forced = json!({"prompt": "the", "max_tokens": 3, "temperature": 0, "logprobs": 0,
        "logit_bias": {id("▁the").to_string(): 100}});
    let whole: Value = serde_json::from_str(&post(port, "/v1/completions", &forced)).unwrap();
    assert_eq!(whole["choices"][0]["text"], " the the the");
    let tokens: Vec<&str> = whole["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens, [" the"; 3]);
    let mut streamed_body = forced.clone();
    streamed_body["stream"] = json!(true);
    let stream = post(port, "/v1/completions", &streamed_body);
    let streamed: String = stream
        .split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(streamed, " the the the");

    // Sampled from a random model: byte tokens split characters; the text is generate's.
    for seed in [1, 2, 3] {
        let body = json!({"prompt": "the", "max_tokens": 24, "temperature": 1.0, "seed": seed});
        let v: Value = serde_json::from_str(&post(port, "/v1/completions", &body)).unwrap();
        let o = attnres(&[
            "generate",
            "--model",
            out.to_str().unwrap(),
            "--prompt",
            "the",
            "--max-tokens",
            "24",
            "--temperature",
            "1",
            "--seed",
            &seed.to_string(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let cli = String::from_utf8(o.stdout).unwrap();
        let cli = cli.strip_prefix("the").unwrap().strip_suffix('\n').unwrap();
        assert_eq!(v["choices"][0]["text"].as_str().unwrap(), cli, "seed {seed}");
    }
}

// ---------------------------------------------------------------------------------------------
// Hugging Face directories.

/// A tiny model saved as Transformers would: bf16 and f16 shards with an index, a bf16
/// `config.json` with keys we do not keep, a tokenizer with its config and chat template.
/// Returns the values the import must produce.
fn write_hf_dir(dir: &Path) -> BTreeMap<String, Vec<f32>> {
    use safetensors::tensor::{Dtype, TensorView};
    std::fs::create_dir_all(dir).unwrap();
    let config = attnres::model::Config {
        vocab_size: 300,
        hidden_size: 32,
        intermediate_size: 48,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        max_position_embeddings: 32,
        tie_word_embeddings: true,
        residual: attnres::model::ResidualKind::Standard,
        ..Default::default()
    };
    let model = attnres::model::Model::init(config.clone(), 5).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(&config.to_json()).unwrap();
    for k in [
        "residual",
        "num_blocks",
        "attn_res_key_norm",
        "attn_res_query",
        "attn_res_gate",
        "attn_res_heads",
        "attn_res_window",
    ] {
        cfg.as_object_mut().unwrap().remove(k);
    }
    cfg["torch_dtype"] = "bfloat16".into();
    cfg["_name_or_path"] = "tiny".into();
    cfg["is_llama_config"] = true.into();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();

    let mut rng = Rng(3);
    let mut expected = BTreeMap::new();
    type Shard = Vec<(String, Vec<usize>, Dtype, Vec<u8>)>;
    let mut shards: Vec<Shard> = vec![vec![], vec![]];
    for (k, s) in model.layout.specs.iter().enumerate() {
        let vals = &model.params[s.range.clone()];
        let (dtype, bytes, want): (Dtype, Vec<u8>, Vec<f32>) = if k % 2 == 0 {
            let bits: Vec<u16> = vals.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
            let want = vals.iter().map(|x| f32::from_bits(x.to_bits() & 0xffff_0000)).collect();
            (Dtype::BF16, bits.iter().flat_map(|b| b.to_le_bytes()).collect(), want)
        } else {
            let bits: Vec<u16> = vals.iter().map(|_| rng.half(8, 16, true)).collect();
            let want = bits.iter().map(|&h| half_value(h)).collect();
            (Dtype::F16, bits.iter().flat_map(|b| b.to_le_bytes()).collect(), want)
        };
        expected.insert(s.name.clone(), want);
        shards[k % 2].push((s.name.clone(), s.shape.clone(), dtype, bytes));
    }
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let views: Vec<(String, TensorView)> = shard
            .iter()
            .map(|(n, shape, dt, b)| (n.clone(), TensorView::new(*dt, shape.clone(), b).unwrap()))
            .collect();
        std::fs::write(dir.join(&file), safetensors::serialize(views, None).unwrap()).unwrap();
        for (n, ..) in shard {
            weight_map.insert(n.clone(), file.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    let docs: Vec<String> = (0..40).map(|i| format!("the quick brown fox {i} jumps\n")).collect();
    let bpe = Bpe::train(&docs, 300).unwrap();
    std::fs::write(dir.join("tokenizer.json"), bpe.to_json().unwrap()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"eos_token": {"content": "<|endoftext|>"}, "tokenizer_class": "PreTrainedTokenizerFast"}"#,
    )
    .unwrap();
    std::fs::write(dir.join("chat_template.jinja"), "{{ messages }}").unwrap();
    expected
}

#[test]
fn a_sharded_half_precision_hf_directory_imports_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    let expected = write_hf_dir(&hf);
    let out = tmp.path().join("ck");
    import_ok(&hf, &out);
    assert_weights(&out, &expected);
    for f in ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] {
        assert_eq!(std::fs::read(hf.join(f)).unwrap(), std::fs::read(out.join(f)).unwrap(), "{f}");
    }
    let config = std::fs::read_to_string(out.join("config.json")).unwrap();
    assert!(config.contains("\"torch_dtype\": \"float32\""), "{config}");
    // Importing again over it needs --force.
    let o = attnres(&["import", "--from", hf.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--force"));
    let o = attnres(&[
        "import",
        "--from",
        hf.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--force",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_weights(&out, &expected);
}

/// A model whose embedding is padded beyond its tokenizer (300 rows, fewer tokens) imports and
/// generates, sampled text included: only the tokenizer's ids are drawn.
#[test]
fn a_model_padded_beyond_its_tokenizer_imports_and_generates() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    write_hf_dir(&hf);
    let docs: Vec<String> = (0..30).map(|i| format!("a few words, number {i}\n")).collect();
    let small = Bpe::train(&docs, 270).unwrap();
    assert!(small.vocab_size() < 300);
    std::fs::write(hf.join("tokenizer.json"), small.to_json().unwrap()).unwrap();
    let out = tmp.path().join("ck");
    import_ok(&hf, &out);
    for seed in ["1", "2", "3"] {
        let o = attnres(&[
            "generate",
            "--model",
            out.to_str().unwrap(),
            "--prompt",
            "a few",
            "--max-tokens",
            "20",
            "--temperature",
            "1.5",
            "--seed",
            seed,
            "--ignore-eos",
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
}

// ---------------------------------------------------------------------------------------------
// Bad input.

/// `attnres import` fails with exit code 1 and one `error:` line holding each needle, writes no
/// --out and leaves no temporary directory beside it.
fn import_fails(from: &Path, needles: &[&str]) {
    let parent = tempfile::tempdir().unwrap();
    let out = parent.path().join("ck");
    let o = attnres(&["import", "--from", from.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.starts_with("error: ") && err.lines().count() == 1, "{err:?}");
    for n in needles {
        assert!(err.contains(n), "expected {n:?} in {err:?}");
    }
    assert!(!out.exists(), "--out was written");
    let left: Vec<_> = std::fs::read_dir(parent.path()).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

#[test]
fn bad_gguf_files_are_named_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("bad.gguf");
    let write = |bytes: &[u8]| std::fs::write(&file, bytes).unwrap();
    let (good, _) = tiny_gguf(gpt2_tokenizer(), 1);

    // An output onto the input itself, or a directory holding it: refused, the input kept.
    write(&good);
    let f = file.to_str().unwrap();
    for out in [f, tmp.path().to_str().unwrap()] {
        let o = attnres(&["import", "--from", f, "--out", out, "--force"]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{err}");
        assert!(err.contains("or holds it") && err.contains("--from"), "{err}");
        assert_eq!(std::fs::read(&file).unwrap(), good, "the input was changed");
    }

    // Another architecture.
    let mut rng = Rng(1);
    let (tensors, _) = llama_tensors(gpt2_tokenizer().tokens.len(), &mut rng);
    let mut meta = llama_meta("qwen2");
    meta.extend(gpt2_tokenizer().meta);
    write(&write_gguf(&meta, &tensors));
    import_fails(&file, &["architecture \"qwen2\"", "only \"llama\""]);

    // An unsupported tensor type (IQ4_NL: 18 bytes per 32 values).
    let (mut tensors, _) = llama_tensors(gpt2_tokenizer().tokens.len(), &mut rng);
    let t = tensors.iter_mut().find(|t| t.name == "blk.1.ffn_up.weight").unwrap();
    t.type_id = 20;
    t.data = vec![0; FF * HIDDEN / 32 * 18];
    let mut meta = llama_meta("llama");
    meta.extend(gpt2_tokenizer().meta);
    write(&write_gguf(&meta, &tensors));
    import_fails(&file, &["blk.1.ffn_up.weight", "IQ4_NL", "Q5_1", "Q6_K"]);

    // A K-quant tensor whose rows are not whole 256-value blocks.
    let (mut tensors, _) = llama_tensors(gpt2_tokenizer().tokens.len(), &mut rng);
    let t = tensors.iter_mut().find(|t| t.name == "blk.1.ffn_up.weight").unwrap();
    t.type_id = 12;
    t.data = vec![0; FF * HIDDEN / 256 * 144];
    let mut meta = llama_meta("llama");
    meta.extend(gpt2_tokenizer().meta);
    write(&write_gguf(&meta, &tensors));
    import_fails(&file, &["blk.1.ffn_up.weight", "not a whole number of 256-value blocks", "Q4_K"]);

    // A wrong magic, and an empty file.
    let mut bad = good.clone();
    bad[3] = b'G';
    write(&bad);
    import_fails(&file, &["not a GGUF file"]);
    write(b"");
    import_fails(&file, &["not a GGUF file"]);

    // Truncated in the header, the metadata, the tensor table and the tensor data.
    for cut in [10, 30, 200, 3000, good.len() / 2, good.len() - 1] {
        write(&good[..cut]);
        import_fails(&file, &["truncated"]);
    }

    // Tokenizers that cannot be rebuilt.
    for (key, value, needle) in [
        ("tokenizer.ggml.model", "rwkv", "\"rwkv\" cannot be rebuilt"),
        ("tokenizer.ggml.pre", "mystery-pre", "\"mystery-pre\""),
    ] {
        let mut rng = Rng(1);
        let (tensors, _) = llama_tensors(gpt2_tokenizer().tokens.len(), &mut rng);
        let mut meta = llama_meta("llama");
        for (k, v) in gpt2_tokenizer().meta {
            meta.push((k.clone(), if k == key { Meta::Str(value.into()) } else { v }));
        }
        write(&write_gguf(&meta, &tensors));
        import_fails(&file, &["tokenizer", needle]);
    }

    // Every other cut: an error, never a panic, nothing written.
    let out = tmp.path().join("ck");
    for cut in (0..good.len()).step_by(97) {
        write(&good[..cut]);
        assert!(attnres::import::import(&file, &out, false, true).is_err(), "cut at {cut}");
        assert!(!out.exists());
    }
}

#[test]
fn bad_hf_directories_are_named_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    write_hf_dir(&hf);
    // Without weights.
    let bare = tmp.path().join("bare");
    std::fs::create_dir(&bare).unwrap();
    std::fs::copy(hf.join("config.json"), bare.join("config.json")).unwrap();
    import_fails(&bare, &["has no weights"]);
    std::fs::write(bare.join("pytorch_model.bin"), b"pickle").unwrap();
    import_fails(&bare, &["pytorch_model.bin", "only safetensors"]);
    // A tokenizer that does not load.
    std::fs::write(hf.join("tokenizer.json"), "{}").unwrap();
    import_fails(&hf, &["tokenizer.json", "does not load"]);
    // A shard the index names is missing.
    std::fs::remove_file(hf.join("model-00002-of-00002.safetensors")).unwrap();
    import_fails(&hf, &["model-00002-of-00002.safetensors", "does not exist"]);
    // No config.json.
    std::fs::remove_file(hf.join("config.json")).unwrap();
    import_fails(&hf, &["has no config.json"]);
    // A path that is not there.
    import_fails(&tmp.path().join("nowhere"), &["nowhere"]);
}
