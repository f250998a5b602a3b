//! Sizes are checked before anything is allocated: configs whose parameters overflow or exceed
//! the machine's memory, edited checkpoints, caches past the memory limit and out-of-range
//! `--threads` get one-line errors; a long context costs nothing until tokens fill it.

use attnres::base::memory::memory_limit;
use attnres::infer::generate::{generate, GenerateOptions, Overflow, Sampling};
use attnres::model::checkpoint;
use attnres::model::decode::KvCache;
use attnres::model::{Config, Model, ResidualKind};
use std::process::Command;

fn small(context: usize) -> Config {
    Config {
        vocab_size: 41,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 4,
        max_position_embeddings: context,
        residual: ResidualKind::Block,
        num_blocks: 2,
        ..Config::default()
    }
}

fn set_err(sets: &[&str]) -> String {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    match Config::default().with_overrides(&sets) {
        Ok(c) => panic!("{sets:?} was accepted: {c:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn oversized_configs_are_refused_by_their_memory_estimate() {
    for sets in [
        &["hidden_size=4000000000"][..],
        &["vocab_size=4000000000"],
        &["intermediate_size=1000000000000"],
        &["num_hidden_layers=1000000000000000", "num_blocks=2"],
        &["num_hidden_layers=1000000000000000", "num_blocks=3"],
        &["head_dim=4611686018427387904", "num_attention_heads=64", "num_key_value_heads=64"],
    ] {
        let e = set_err(sets);
        assert!(
            e.contains("the model needs")
                && e.contains("the machine's memory")
                && !e.contains('\n'),
            "{sets:?}: {e}"
        );
    }
    let e = set_err(&["hidden_size=9223372036854775808", "intermediate_size=9223372036854775808"]);
    assert!(e.contains("parameter count overflows"), "{e}");
}

#[test]
fn the_estimate_names_both_sizes() {
    // 2^29 embedding values of 4 bytes, plus the layers: just over 2.1 GB.
    let c = Config { vocab_size: 1 << 21, ..Config::default() };
    let e = c.check_size(1 << 30).unwrap_err().to_string();
    assert!(e.contains("needs 2.2 GB of parameters") && e.contains("at most 1.1 GB"), "{e}");
    assert!(Config::default().check_size(1 << 30).is_ok());
}

#[test]
fn training_steps_are_refused_by_their_memory_estimate() {
    use attnres::train::config::TrainConfig;
    let model = Config::default();
    let t = TrainConfig::default();
    let bytes = |micro_batch| TrainConfig { micro_batch, ..t.clone() }.step_bytes(&model).unwrap();
    // Six f32 copies of the parameters, plus a part that grows with the tokens of a micro-batch.
    let params = model.param_count().unwrap() * 24;
    assert!(bytes(1) > params);
    assert_eq!(bytes(3) - bytes(2), bytes(2) - bytes(1));
    assert!(bytes(8) - params > 8 * (bytes(1) - params) - 8, "linear in the tokens");
    let need = bytes(8) as u64;
    assert!(t.check_memory(&model, need).is_ok());
    let e = t.check_memory(&model, need - 1).unwrap_err().to_string();
    assert!(
        e.contains("micro_batch = 8 x seq_len = 256") && e.contains("lower micro_batch"),
        "{e}"
    );
    let huge = TrainConfig { micro_batch: 1 << 63, seq_len: 1 << 63, ..t.clone() };
    assert!(huge.check_memory(&model, u64::MAX).unwrap_err().to_string().contains("overflows"));
}

#[test]
fn parameter_count_matches_the_layout() {
    use attnres::model::config::{DepthGate, DepthQuery};
    use attnres::model::params::Layout;
    for residual in [ResidualKind::Standard, ResidualKind::Full, ResidualKind::Block] {
        for query in [DepthQuery::Static, DepthQuery::Input, DepthQuery::Scalar, DepthQuery::Dense]
        {
            for (tied, key_norm, nb) in [(true, true, 2), (false, false, 4), (false, true, 1)] {
                let c = Config {
                    residual,
                    attn_res_query: query,
                    attn_res_gate: DepthGate::Softmax,
                    tie_word_embeddings: tied,
                    attn_res_key_norm: key_norm,
                    num_blocks: nb,
                    ..small(64)
                };
                c.validate().unwrap();
                assert_eq!(c.param_count(), Some(Layout::new(&c).total as u128), "{c:?}");
            }
        }
    }
}

#[test]
fn a_long_context_costs_nothing_until_used() {
    // max_position_embeddings = 1e11: the model, its rotary table and a cache for that context
    // are small, and generation equals that of the same weights with a short context.
    let long = Model::init(small(100_000_000_000), 3).unwrap();
    let short = Model::new(small(256), long.params.clone()).unwrap();
    let opts = GenerateOptions {
        max_tokens: 20,
        sampling: Sampling { temperature: 0.0, top_k: None, top_p: None },
        seed: 1,
        overflow: Overflow::Error,
        stop: None,
        sample_below: None,
    };
    let prompts = vec![vec![1, 2, 3, 4, 5, 6], vec![7, 8]];
    let (a, _) = generate(&long, &prompts, &opts, |_, _| Ok(())).unwrap();
    let (b, _) = generate(&short, &prompts, &opts, |_, _| Ok(())).unwrap();
    assert_eq!(
        a.iter().map(|g| &g.tokens).collect::<Vec<_>>(),
        b.iter().map(|g| &g.tokens).collect::<Vec<_>>()
    );

    let mut cache = KvCache::new(&long.config, 2, 100_000_000_000).unwrap();
    assert_eq!(cache.room(), 0);
    long.decode(&mut cache, &[(0, &[1, 2, 3, 4, 5, 6]), (1, &[7])], false).unwrap();
    assert_eq!(cache.room(), 6, "room for the tokens held");
    long.decode(&mut cache, &[(1, &[8])], false).unwrap();
    assert_eq!(cache.room(), 6);
    long.decode(&mut cache, &[(0, &[9])], false).unwrap();
    assert_eq!(cache.room(), 12, "doubled when full");
}

#[test]
fn grown_caches_give_the_same_logits() {
    let m = Model::init(small(64), 5).unwrap();
    let ids: Vec<u32> = (0..30).map(|i| (i * 7 % 41) as u32).collect();
    let mut whole = KvCache::new(&m.config, 1, 64).unwrap();
    whole.reserve(64).unwrap();
    let mut grown = KvCache::new(&m.config, 1, 64).unwrap();
    for (i, t) in ids.iter().enumerate() {
        let a = m.decode(&mut whole, &[(0, std::slice::from_ref(t))], false).unwrap();
        let b = m.decode(&mut grown, &[(0, std::slice::from_ref(t))], false).unwrap();
        assert_eq!(a, b, "token {i}");
    }
    assert!(grown.room() < 64);
}

#[test]
fn a_cache_past_the_memory_limit_is_an_error() {
    let c = small(usize::MAX / 2);
    let mut cache = KvCache::new(&c, 1000, usize::MAX / 2).unwrap();
    let e = cache.reserve(usize::MAX / 2).unwrap_err().to_string();
    assert!(e.contains("key/value cache") && e.contains("the machine's memory"), "{e}");
    let need = memory_limit() as usize / (2 * 2 * 8 * 4 * 1000) + 1;
    let e = cache.reserve(need).unwrap_err().to_string();
    assert!(e.contains("key/value cache for 1000 sequence(s)"), "{e}");
    assert_eq!(cache.room(), 0);
}

#[test]
fn edited_checkpoints_are_refused_before_reading() {
    let dir = tempdir("edited");
    let m = Model::init(small(64), 1).unwrap();
    checkpoint::save(&m, &dir).unwrap();
    let cfg = dir.join(checkpoint::CONFIG_FILE);
    let text = std::fs::read_to_string(&cfg).unwrap();

    let huge = text.replace("\"hidden_size\": 16", "\"hidden_size\": 4000000000");
    assert_ne!(huge, text);
    std::fs::write(&cfg, &huge).unwrap();
    let e = format!("{:#}", checkpoint::load(&dir).err().expect("huge config loads"));
    assert!(e.contains("the model needs") && e.contains("config.json"), "{e}");

    let other = text.replace("\"intermediate_size\": 24", "\"intermediate_size\": 32");
    std::fs::write(&cfg, &other).unwrap();
    let e = format!("{:#}", checkpoint::load(&dir).err().expect("reshaped config loads"));
    assert!(e.contains("has shape"), "{e}");

    // A weights file far larger than the config implies is not read (a sparse file here).
    std::fs::write(&cfg, &text).unwrap();
    let w =
        std::fs::OpenOptions::new().write(true).open(dir.join(checkpoint::WEIGHTS_FILE)).unwrap();
    w.set_len(1 << 40).unwrap();
    let e = format!("{:#}", checkpoint::load(&dir).err().expect("oversized weights load"));
    assert!(e.contains("1.1 TB") && e.contains("the config implies"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("attnres-sizes-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn attnres(args: &[&str]) -> (i32, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_attnres")).args(args).output().unwrap();
    (o.status.code().unwrap_or(-1), String::from_utf8_lossy(&o.stderr).into_owned())
}

#[test]
fn the_cli_refuses_bad_sizes_and_thread_counts() {
    let dir = tempdir("cli");
    let out = dir.join("m");
    let out = out.to_str().unwrap();
    for (args, want) in [
        (vec!["init", "--out", out, "--set", "hidden_size=4000000000"], "the model needs"),
        (vec!["init", "--out", out, "--set", "num_hidden_layers=1000000000000"], "the model needs"),
        (
            vec![
                "train",
                "--out",
                out,
                "--set",
                "micro_batch=1000",
                "--set",
                "batch_tokens=256000",
            ],
            "a training step needs about",
        ),
        (vec!["train", "--out", out, "--set", "micro_batch=72057594037927936"], "overflows"),
        (vec!["--threads", "0", "init", "--out", out], "--threads must be at least 1, got 0"),
    ] {
        let (code, err) = attnres(&args);
        assert_eq!(code, 1, "{args:?}: {err}");
        assert!(err.starts_with("error: ") && err.contains(want), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    }
    // More threads than cores only wait on each other: capped at the cores, with a warning.
    let capped = dir.join("capped");
    let (code, err) =
        attnres(&["--threads", "100000000", "init", "--out", capped.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let cores = std::thread::available_parallelism().unwrap().get();
    let warning =
        format!("warning: --threads 100000000 is more than the {cores} cores here: using {cores}");
    assert_eq!(err.lines().next(), Some(warning.as_str()), "{err}");
    let (code, err) = attnres(&[
        "--threads",
        "2",
        "init",
        "--out",
        out,
        "--set",
        "max_position_embeddings=100000000000",
    ]);
    assert_eq!(code, 0, "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
