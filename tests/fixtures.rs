//! Compares logits, loss and every gradient with fixtures computed by an independent PyTorch
//! implementation (scripts/reference/reference.py, float64) for standard, full and two block layouts,
//! all with non-zero pseudo-queries. Regenerate with `python scripts/reference/make_fixtures.py`.

mod common;

use attnres::model::checkpoint::{self, f32_values};
use common::id_rows as ids;
use safetensors::SafeTensors;
use std::path::Path;

fn check(name: &str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    let model = checkpoint::load(&dir).unwrap();
    let batch: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("batch.json")).unwrap()).unwrap();
    let (input, targets) = (ids(&batch["input_ids"]), ids(&batch["targets"]));
    let b = batch["input_ids"].as_array().unwrap().len();
    let t = input.len() / b;
    let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
    let exp = SafeTensors::deserialize(&bytes).unwrap();
    let get = |k: &str| f32_values(k, &exp.tensor(k).unwrap()).unwrap();

    let fwd = model.forward(&input, b, t).unwrap();
    let want = get("logits");
    let scale = want.iter().fold(0f32, |a, x| a.max(x.abs()));
    for (i, (a, w)) in fwd.logits.iter().zip(&want).enumerate() {
        assert!((a - w).abs() <= 2e-5 * scale, "{name}: logits[{i}] {a} vs {w}");
    }
    let (loss, grads) = model.backward(&fwd, &targets).unwrap();
    let wl = get("loss")[0];
    assert!((loss - wl).abs() < 1e-5 * wl.abs(), "{name}: loss {loss} vs {wl}");
    for s in &model.layout.specs {
        let w = get(&format!("grad.{}", s.name));
        let g = &grads[s.range.clone()];
        let scale = w.iter().fold(0f32, |a, x| a.max(x.abs())).max(1e-6);
        for (i, (a, b)) in g.iter().zip(&w).enumerate() {
            assert!(
                (a - b).abs() <= 1e-4 * scale,
                "{name}: grad {}[{i}] {a} vs {b} (scale {scale})",
                s.name
            );
        }
        if s.name.contains("res_proj") && !s.name.contains("layers.0.attn") {
            assert!(scale > 1e-4, "{name}: {} should receive gradient", s.name);
        }
    }
}

#[test]
fn standard_matches_pytorch() {
    check("standard");
}

#[test]
fn full_matches_pytorch() {
    check("full");
}

#[test]
fn block_aligned_with_layers_matches_pytorch() {
    check("block3");
}

#[test]
fn block_spanning_layers_matches_pytorch() {
    check("block2");
}
