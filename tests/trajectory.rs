//! Training trajectories against the PyTorch reference (scripts/reference/make_trajectory.py, float64):
//! eight optimiser steps of a tiny model, AdamW (Block AttnRes) and Muon (Full AttnRes), each
//! with warmup, cosine decay and gradient clipping active on some steps, run here through the
//! training loop's own step (`train::step::optimizer_step`, at the learning rate of `lr_at`) and
//! compared step by step (learning rate, loss, gradient norm before clipping) and in the final
//! weights.
//! Regenerate with `python scripts/reference/make_trajectory.py`.

mod common;

use attnres::model::checkpoint::{self, f32_values};
use attnres::train::optim::{lr_at, OptimConfig, Optimizer};
use attnres::train::step::{optimizer_step, Pass};
use common::id_rows as rows;
use safetensors::SafeTensors;
use std::path::Path;

fn check(name: &str) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trajectory").join(name);
    let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
    let mut model = checkpoint::load(&dir).unwrap();
    let optim: serde_json::Value = serde_json::from_str(&read("optim.json")).unwrap();
    let total = optim["steps"].as_u64().unwrap() as usize;
    let config: OptimConfig = serde_json::from_value(optim).unwrap();
    let batches: Vec<serde_json::Value> = serde_json::from_str(&read("batches.json")).unwrap();
    assert_eq!(batches.len(), total);
    let bytes = std::fs::read(dir.join("expected.safetensors")).unwrap();
    let exp = SafeTensors::deserialize(&bytes).unwrap();
    let get = |k: &str| f32_values(k, &exp.tensor(k).unwrap()).unwrap();
    let (want_loss, want_norm, want_lr) = (get("loss"), get("grad_norm"), get("lr"));

    let mut opt = Optimizer::new(config.clone(), &model.layout);
    let mut clipped = 0;
    for (step, batch) in batches.iter().enumerate() {
        let (ids, targets) = (rows(&batch["input_ids"]), rows(&batch["targets"]));
        let b = batch["input_ids"].as_array().unwrap().len();
        let lr = lr_at(&config, step, total);
        assert!((lr - want_lr[step] as f64).abs() < 1e-6 * lr, "{name} step {step}: lr {lr}");
        let done = optimizer_step(&mut model, &mut opt, &[(ids, targets)], Pass::rows(b), lr, step)
            .unwrap();
        // Losses: f32 forward against float64, after `step` updates that each carry their f32
        // rounding forward; seen: at most 1.3e-7 relative.
        let (loss, wl) = (done.train_loss, want_loss[step] as f64);
        assert!((loss - wl).abs() < 2e-6 * wl, "{name} step {step}: loss {loss} vs {wl}");
        let (norm, wn) = (done.grad_norm, want_norm[step] as f64);
        assert!((norm - wn).abs() < 1e-4 * wn, "{name} step {step}: grad norm {norm} vs {wn}");
        clipped += usize::from(norm > config.grad_clip);
    }
    assert!(clipped > 0 && clipped < total, "{name}: clipping should act on some steps only");
    // Final weights: the reference's trajectory in float64 and ours in f32 differ by rounding
    // that each step carries into the next, a small fraction of how far the weights moved.
    // Tolerance per tensor: 1e-3 of its largest movement over the eight steps (seen: up to 4e-5),
    // plus 1e-7 absolute for tensors that do not move (rows of tokens never seen).
    let start = checkpoint::load(&dir).unwrap();
    for s in &model.layout.specs {
        let want = get(&format!("final.{}", s.name));
        let (got, p0) = (&model.params[s.range.clone()], &start.params[s.range.clone()]);
        let moved = want.iter().zip(p0).fold(0f32, |a, (w, p)| a.max((w - p).abs()));
        assert!(
            moved > 0.0 || s.name.contains("layers.0.attn_res"),
            "{name}: {} never moved",
            s.name
        );
        for (i, (a, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - w).abs() <= 1e-3 * moved + 1e-7,
                "{name}: final {}[{i}] {a} vs {w} (moved up to {moved:.3e})",
                s.name
            );
        }
    }
}

#[test]
fn adamw_trajectory_matches_pytorch() {
    check("adamw");
}

#[test]
fn muon_trajectory_matches_pytorch() {
    check("muon");
}
