//! `attnres export --to gguf` on a model trained here: the f32 file imports back to the same
//! weights bit for bit, the same config and a tokenizer that gives the same ids; the f16 and
//! q8_0 files import back to exactly what `attnres quantize` makes; the file is laid out as
//! llama.cpp reads it (query/key rows in its order, aligned data, tokenizer metadata); AttnRes
//! and quantised models, an existing file without --force and bad paths are refused with one
//! named error and nothing left behind. Against llama.cpp itself:
//! scripts/reference/check_export.py.

mod common;

use attnres::gguf::read::Gguf;
use attnres::gguf::Value;
use attnres::import::permute_rows;
use attnres::model::{checkpoint, Config};
use attnres::text::tokenizer::Bpe;
use common::{ok, RunEnv};
use std::path::Path;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn fails(o: &std::process::Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    for n in needles {
        assert!(err.contains(n), "expected {n:?} in: {err}");
    }
    assert!(!err.contains("panicked"), "{err}");
}

fn config(dir: &Path) -> Config {
    Config::from_json(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
}

#[test]
fn exports_round_trip_and_bad_input_is_refused() {
    let env = &RunEnv::new(4_000, 2);
    let sets = [
        "residual=standard",
        "vocab_size=400",
        "seq_len=64",
        "micro_batch=4",
        "batch_tokens=512",
        "max_tokens=4096",
    ];
    let run = common::train_tiny(env, "run", &sets);
    let export = |ty: &str, out: &Path| {
        // `--type`, the older name of `--dtype`, is still taken.
        let flag = if ty == "q8_0" { "--type" } else { "--dtype" };
        env.run(&["export", "--model", s(&run), "--to", "gguf", flag, ty, "--out", s(out)])
    };

    // f32: the same weights, bit for bit, the same config, the same token ids.
    let file = env.path("run.gguf");
    let log = ok(&export("f32", &file));
    assert!(log.contains("38 F32") && log.contains("pre-tokenizer gpt-2"), "{log}");
    let back = env.path("back");
    ok(&env.run(&["import", "--from", s(&file), "--out", s(&back)]));
    let weights = |d: &Path| std::fs::read(d.join(checkpoint::WEIGHTS_FILE)).unwrap();
    assert!(weights(&run) == weights(&back), "the weights changed on the way");
    let (want, got) = (config(&run), config(&back));
    // num_blocks means nothing to a standard model, and GGUF has no key for it.
    assert_eq!(got, Config { num_blocks: got.num_blocks, ..want });
    let (a, b) = (
        Bpe::load(&run.join("tokenizer.json")).unwrap(),
        Bpe::load(&back.join("tokenizer.json")).unwrap(),
    );
    for text in
        ["ROMEO: What say you?", "  spaces\n\n\ttabs 12345 ünïcödé 🙂", "a<|endoftext|>b", ""]
    {
        assert_eq!(a.encode(text).unwrap(), b.encode(text).unwrap(), "{text:?}");
    }
    assert_eq!(a.eot, b.eot);

    // The file as llama.cpp reads it.
    let bytes = std::fs::read(&file).unwrap();
    let g = Gguf::parse(&bytes).unwrap();
    let meta = |k: &str| g.get(k).unwrap_or_else(|| panic!("no {k}")).clone();
    assert_eq!(meta("general.architecture"), Value::Str("llama".into()));
    assert_eq!(meta("general.alignment"), Value::U32(32));
    assert_eq!(meta("llama.rope.dimension_count"), Value::U32(16));
    assert_eq!(meta("tokenizer.ggml.model"), Value::Str("gpt2".into()));
    assert_eq!(meta("tokenizer.ggml.eos_token_id"), Value::U32(a.eot));
    let types = meta("tokenizer.ggml.token_type");
    assert_eq!(types.as_array().unwrap()[a.eot as usize], Value::I32(3), "end of text is control");
    assert!(g.tensor("output.weight").is_none(), "tied embeddings have no output tensor");
    let model = checkpoint::load(&run).unwrap();
    let spec = model.layout.spec("model.layers.1.self_attn.k_proj.weight").unwrap();
    let k = g.tensor("blk.1.attn_k.weight").unwrap();
    assert_eq!((k.dims.clone(), k.type_id), (vec![64, 64], 0));
    let original = &model.params[spec.range.clone()];
    let stored = g.dequantize(k).unwrap();
    assert!(stored != original, "the rows are reordered");
    assert_eq!(stored, permute_rows(original, 4, 64), "in llama.cpp's order");

    // f16 and q8_0: what `quantize` makes, byte for byte.
    for ty in ["f16", "q8_0"] {
        let file = env.path(&format!("run.{ty}.gguf"));
        ok(&export(ty, &file));
        let back = env.path(&format!("back-{ty}"));
        ok(&env.run(&["import", "--from", s(&file), "--out", s(&back)]));
        let quantised = env.path(&format!("quantised-{ty}"));
        ok(&env.run(&["quantize", "--model", s(&run), "--dtype", ty, "--out", s(&quantised)]));
        assert!(weights(&quantised) == weights(&back), "{ty}: not quantize's bytes");
    }

    // Refused, each with its reason; nothing written.
    let out = env.path("refused.gguf");
    let full = env.path("full");
    ok(&env.run(&["convert", "--model", s(&run), "--set", "residual=full", "--out", s(&full)]));
    let o = env.run(&["export", "--model", s(&full), "--to", "gguf", "--out", s(&out)]);
    fails(&o, &["residual = full", "llama.cpp has no architecture", "transformers"]);
    let quantised = env.path("quantised-q8_0");
    let o = env.run(&["export", "--model", s(&quantised), "--to", "gguf", "--out", s(&out)]);
    fails(&o, &["is quantised", "f32 original"]);
    let o =
        env.run(&["export", "--model", s(&env.path("nothing")), "--to", "gguf", "--out", s(&out)]);
    fails(&o, &["is not a checkpoint directory"]);
    let broken = env.path("broken");
    std::fs::create_dir(&broken).unwrap();
    std::fs::write(broken.join("config.json"), "{").unwrap();
    let o = env.run(&["export", "--model", s(&broken), "--to", "gguf", "--out", s(&out)]);
    fails(&o, &["config.json"]);
    let bare = env.path("bare");
    std::fs::create_dir(&bare).unwrap();
    for f in ["config.json", checkpoint::WEIGHTS_FILE] {
        std::fs::copy(run.join(f), bare.join(f)).unwrap();
    }
    let o = env.run(&["export", "--model", s(&bare), "--to", "gguf", "--out", s(&out)]);
    fails(&o, &["has no tokenizer.json"]);
    assert!(!out.exists());
    let o =
        env.run(&["export", "--model", s(&run), "--to", "gguf", "--out", "/nonexistent/x.gguf"]);
    fails(&o, &["cannot write /nonexistent/x.gguf"]);
    let o = env.run(&["export", "--model", s(&run), "--to", "gguf", "--out", s(&back), "--force"]);
    fails(&o, &["is a directory"]);

    // An existing file: kept without --force, replaced with it.
    std::fs::write(&out, "keep me").unwrap();
    fails(&export("f32", &out), &["already exists", "--force"]);
    assert_eq!(std::fs::read(&out).unwrap(), b"keep me");
    let o = env.run(&["export", "--model", s(&run), "--to", "gguf", "--out", s(&out), "--force"]);
    ok(&o);
    assert!(std::fs::read(&out).unwrap() == bytes, "the same model, the same file");
    assert!(
        common::leftovers(env.tmp.path()).is_empty(),
        "{:?}",
        common::leftovers(env.tmp.path())
    );
}
