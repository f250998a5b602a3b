//! Incremental decoding and generation against recomputation from scratch: cached logits equal
//! the full forward pass (and the PyTorch fixtures, whose depth attention is the one-pass
//! softmax) for every residual mode; greedy and sliding-window generation equal their
//! definitions; bad requests get named errors.

mod common;

use attnres::infer::generate::{argmax, generate, GenerateOptions, Overflow, Sampling, StopReason};
use attnres::model::checkpoint::{self, f32_values};
use attnres::model::decode::KvCache;
use attnres::model::{Config, Model, ResidualKind};
use common::{noise, perturbed};
use safetensors::SafeTensors;
use std::path::Path;

/// Tolerance of cached against full-pass logits, relative to the largest logit: both run in
/// f32 and differ only in summation order.
const TOL: f32 = 1e-5;

fn config(residual: ResidualKind, num_blocks: usize, context: usize) -> Config {
    Config {
        vocab_size: 37,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 3,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 4,
        max_position_embeddings: context,
        tie_word_embeddings: false,
        residual,
        num_blocks,
        ..Config::default()
    }
}

/// Every residual layout: block 3 puts boundaries between layers, block 2 inside them.
const MODES: [(ResidualKind, usize); 5] = [
    (ResidualKind::Standard, 0),
    (ResidualKind::Full, 0),
    (ResidualKind::Block, 3),
    (ResidualKind::Block, 2),
    (ResidualKind::Block, 1),
];

fn tokens(n: usize, salt: u64, vocab: u32) -> Vec<u32> {
    (0..n).map(|i| ((noise(i, salt) + 1.0) * 0.5 * vocab as f32) as u32 % vocab).collect()
}

fn assert_rows_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(0f32, |a, x| a.max(x.abs()));
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!((a - b).abs() <= TOL * scale, "{what}: [{i}] {a} vs {b} (scale {scale})");
    }
}

#[test]
fn cached_decoding_matches_the_full_forward_pass() {
    for (kind, nb) in MODES {
        let m = perturbed(config(kind, nb, 40));
        let v = m.config.vocab_size;
        let seqs = [tokens(30, 1, v as u32), tokens(23, 2, v as u32)];
        let want: Vec<Vec<f32>> =
            seqs.iter().map(|s| m.forward(s, 1, s.len()).unwrap().logits).collect();
        let mut got: Vec<Vec<f32>> = vec![Vec::new(), Vec::new()];
        let mut cache = KvCache::new(&m.config, 2, 40).unwrap();
        // Prefill of unequal lengths in one call, then mixed steps: single tokens for slot 0,
        // chunks of three for slot 1.
        let mut pos = [0usize, 0];
        let mut first = true;
        while pos[0] < 30 || pos[1] < 23 {
            let mut chunks = Vec::new();
            for (b, s) in seqs.iter().enumerate() {
                let len = if first { [17, 5][b] } else { [1, 3][b] }.min(s.len() - pos[b]);
                if len > 0 {
                    chunks.push((b, &s[pos[b]..pos[b] + len]));
                }
            }
            let logits = m.decode(&mut cache, &chunks, true).unwrap();
            let mut row = 0;
            for (b, ids) in &chunks {
                got[*b].extend_from_slice(&logits[row * v..(row + ids.len()) * v]);
                row += ids.len();
                pos[*b] += ids.len();
            }
            first = false;
        }
        for b in 0..2 {
            assert_rows_close(&got[b], &want[b], &format!("{kind:?}/{nb} sequence {b}"));
            assert_eq!(cache.len(b), seqs[b].len());
        }
        // Last-token logits only.
        let mut cache = KvCache::new(&m.config, 2, 40).unwrap();
        let last = m.decode(&mut cache, &[(1, &seqs[1][..]), (0, &seqs[0][..])], false).unwrap();
        assert_rows_close(&last[..v], &want[1][22 * v..], "last-token logits, slot 1");
        assert_rows_close(&last[v..], &want[0][29 * v..], "last-token logits, slot 0");
    }
}

#[test]
fn token_by_token_decoding_matches_the_pytorch_fixtures() {
    for name in ["standard", "full", "block3", "block2"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
        let m = checkpoint::load(&dir).unwrap();
        let batch: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("batch.json")).unwrap())
                .unwrap();
        let rows: Vec<Vec<u32>> = batch["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect())
            .collect();
        let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
        let exp = SafeTensors::deserialize(&bytes).unwrap();
        let want = f32_values("logits", &exp.tensor("logits").unwrap()).unwrap();
        let (b, t) = (rows.len(), rows[0].len());
        let mut cache = KvCache::new(&m.config, b, t).unwrap();
        let mut got = vec![0.0; want.len()];
        let v = m.config.vocab_size;
        for i in 0..t {
            let chunks: Vec<(usize, &[u32])> =
                rows.iter().enumerate().map(|(s, r)| (s, &r[i..i + 1])).collect();
            let logits = m.decode(&mut cache, &chunks, false).unwrap();
            for s in 0..b {
                got[(s * t + i) * v..(s * t + i + 1) * v]
                    .copy_from_slice(&logits[s * v..(s + 1) * v]);
            }
        }
        let scale = want.iter().fold(0f32, |a, x| a.max(x.abs()));
        for (i, (a, w)) in got.iter().zip(&want).enumerate() {
            assert!((a - w).abs() <= 2e-5 * scale, "{name}: logits[{i}] {a} vs {w}");
        }
    }
}

fn opts(max_tokens: usize, overflow: Overflow) -> GenerateOptions {
    GenerateOptions {
        max_tokens,
        sampling: Sampling { temperature: 0.0, top_k: None, top_p: None },
        seed: 0,
        overflow,
        stop: None,
        sample_below: None,
    }
}

/// Greedy continuation by recomputing the whole window every step; the window starts where
/// the sliding rule of `attnres::generate` puts it.
fn greedy_from_scratch(m: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let ctx = m.config.max_position_embeddings;
    let v = m.config.vocab_size;
    let mut seq = prompt.to_vec();
    let mut start = prompt.len().saturating_sub(ctx);
    let mut cached = seq.len() - start;
    let mut out = Vec::new();
    for _ in 0..n {
        let w = &seq[start..];
        let logits = m.forward(w, 1, w.len()).unwrap().logits;
        let tok = argmax(&logits[(w.len() - 1) * v..]);
        out.push(tok);
        seq.push(tok);
        // The cache holds `cached` tokens; a full one restarts from the recent half.
        if cached == ctx {
            start = seq.len() - ctx / 2;
            cached = ctx / 2;
        } else {
            cached += 1;
        }
    }
    out
}

#[test]
fn greedy_generation_equals_recomputation_for_every_mode() {
    for (kind, nb) in MODES {
        let m = perturbed(config(kind, nb, 40));
        let prompts = vec![tokens(9, 3, 37), tokens(2, 4, 37), tokens(20, 5, 37)];
        let mut streamed = vec![Vec::new(); 3];
        let (gens, timing) = generate(&m, &prompts, &opts(12, Overflow::Error), |i, t| {
            streamed[i].push(t);
            Ok(())
        })
        .unwrap();
        for (i, p) in prompts.iter().enumerate() {
            assert_eq!(gens[i].tokens, greedy_from_scratch(&m, p, 12), "{kind:?}/{nb} prompt {i}");
            assert_eq!(gens[i].tokens, streamed[i]);
            assert_eq!(gens[i].stop, StopReason::MaxTokens);
        }
        assert_eq!(timing.prefill_tokens, 31);
        assert_eq!(timing.decode_tokens, 3 * 11);
    }
}

#[test]
fn sliding_window_generation_equals_its_definition() {
    for (kind, nb) in [(ResidualKind::Standard, 0), (ResidualKind::Block, 3)] {
        let m = perturbed(config(kind, nb, 10));
        // One prompt fits, one is longer than the whole context.
        let prompts = vec![tokens(4, 6, 37), tokens(13, 7, 37)];
        let (gens, _) = generate(&m, &prompts, &opts(25, Overflow::Slide), |_, _| Ok(())).unwrap();
        for (i, p) in prompts.iter().enumerate() {
            assert_eq!(gens[i].tokens, greedy_from_scratch(&m, p, 25), "{kind:?}/{nb} prompt {i}");
        }
        let err = generate(&m, &prompts[..1], &opts(25, Overflow::Error), |_, _| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("beyond the model's context of 10"), "{err}");
    }
}

#[test]
fn sampling_is_deterministic_for_a_seed_and_stops_at_end_of_text() {
    let m = perturbed(config(ResidualKind::Block, 3, 40));
    let prompts = vec![tokens(5, 8, 37), tokens(7, 9, 37)];
    let mut o = opts(20, Overflow::Error);
    o.sampling = Sampling { temperature: 1.0, top_k: Some(10), top_p: Some(0.95) };
    let run = |o: &GenerateOptions| {
        generate(&m, &prompts, o, |_, _| Ok(()))
            .unwrap()
            .0
            .into_iter()
            .map(|g| g.tokens)
            .collect::<Vec<_>>()
    };
    let a = run(&o);
    assert_eq!(a, run(&o));
    o.seed = 1;
    assert_ne!(a, run(&o));
    // Stopping: make the first sampled token of prompt 0 the end-of-text token.
    o.seed = 0;
    o.stop = Some(a[0][0]);
    let (gens, _) = generate(&m, &prompts, &o, |_, _| Ok(())).unwrap();
    assert_eq!(gens[0].tokens, vec![a[0][0]]);
    assert_eq!(gens[0].stop, StopReason::EndOfText);
}

#[test]
fn bad_requests_get_named_errors() {
    let m = perturbed(config(ResidualKind::Full, 0, 16));
    let err = |prompts: Vec<Vec<u32>>, o: GenerateOptions| {
        generate(&m, &prompts, &o, |_, _| Ok(())).unwrap_err().to_string()
    };
    assert!(err(vec![vec![1], vec![]], opts(3, Overflow::Error)).contains("prompt 2 is empty"));
    assert!(err(vec![vec![1]], opts(0, Overflow::Error)).contains("max-tokens"));
    assert!(err(vec![vec![1, 99]], opts(3, Overflow::Error)).contains("token id 99"));
    assert!(err(vec![vec![1; 10]], opts(8, Overflow::Error)).contains("need 17 positions"));
    let mut bad = opts(3, Overflow::Error);
    bad.sampling.top_p = Some(0.0);
    assert!(err(vec![vec![1]], bad).contains("top-p"));

    let mut cache = KvCache::new(&m.config, 2, 16).unwrap();
    let e = |r: anyhow::Result<Vec<f32>>| r.unwrap_err().to_string();
    assert!(e(m.decode(&mut cache, &[(0, &[1]), (0, &[2])], false)).contains("twice"));
    assert!(e(m.decode(&mut cache, &[(2, &[1])], false)).contains("slot 2 does not exist"));
    assert!(e(m.decode(&mut cache, &[(0, &[1; 17])], false)).contains("exceed the context of 16"));
    // A refused call leaves the cache as it was.
    assert_eq!((cache.len(0), cache.len(1)), (0, 0));
    assert!(KvCache::new(&m.config, 1, 17).is_err());
}
