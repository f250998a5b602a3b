//! The diagnostics (docs/method.md §6: output RMS per sublayer, input RMS, depth weights α)
//! against an independent computation: the float64 reference forward pass of
//! tests/common/reference.rs, which records every sublayer's raw output and input and every
//! consumer's α from the method's equations with plain loops, averaged here over tokens.

mod common;

use attnres::model::diagnostics::diagnose;
use attnres::model::ResidualKind;
use common::reference::{self, rms, Ref};
use common::{noise, perturbed, tiny};

/// Mean over tokens of each row's RMS.
fn mean_rms(rows: &[Vec<f64>]) -> f64 {
    rows.iter().map(|r| rms(r)).sum::<f64>() / rows.len() as f64
}

fn close(got: f64, want: f64, what: &str) {
    // The library's f32 forward against float64: rounding, far below 1e-5 relative.
    assert!((got - want).abs() <= 1e-5 * want.abs().max(1e-3), "{what}: {got} vs {want}");
}

#[test]
fn diagnostics_match_an_independent_computation() {
    // Three windows of six tokens, measured two windows at a time.
    let (seq, windows) = (6, 3);
    let val: Vec<u32> =
        (0..seq * windows).map(|i| ((noise(i, 5) + 1.0) * 5.5) as u32 % 11).collect();
    for (kind, nb, labels) in [
        (ResidualKind::Standard, 0, vec![]),
        (ResidualKind::Full, 0, vec!["emb", "b1", "b2", "b3", "b4"]),
        (ResidualKind::Block, 2, vec!["emb", "b1", "b2", "partial"]),
        (ResidualKind::Block, 1, vec!["emb", "b1", "partial"]),
    ] {
        let what = format!("{kind:?}/{nb}");
        let mut m = perturbed(tiny(kind, nb));
        // Larger pseudo-queries: clearly non-uniform depth weights.
        for s in m.layout.specs.clone().iter().filter(|s| s.name.contains("res_proj")) {
            m.params[s.range.clone()].iter_mut().for_each(|q| *q *= 5.0);
        }
        let d = diagnose(&m, &val, seq, 2, 0).unwrap();
        let r = reference::forward(&Ref::new(&m), &val, windows, seq, &|_| m.config.rms_norm_eps);
        assert_eq!(d.tokens, seq * windows);
        assert_eq!(d.sources, labels, "{what}");
        assert_eq!(d.output_rms.len(), 4);
        for l in 0..4 {
            close(d.output_rms[l], mean_rms(&r.outputs[l]), &format!("{what}: output RMS {l}"));
            close(d.input_rms[l], mean_rms(&r.inputs[l]), &format!("{what}: input RMS {l}"));
        }
        close(d.final_input_rms, mean_rms(&r.final_input), &format!("{what}: final input RMS"));
        let Some(alpha) = &d.alpha else {
            assert!(kind == ResidualKind::Standard, "{what}: no α");
            continue;
        };
        // Consumer c (sublayers, then the output) reads the embedding and the completed blocks
        // (their own columns), then its partial sum (the last column) when it has one.
        let block = m.config.block_size().unwrap();
        assert_eq!(alpha.len(), r.alpha.len());
        let mut spread = 0f64;
        for (c, (row, per_token)) in alpha.iter().zip(&r.alpha).enumerate() {
            let k = reference::sources_read(c, block);
            let mut want = vec![0f64; labels.len()];
            for a in per_token {
                assert_eq!(a.len(), k);
                let completed = if c % block != 0 && c < 4 { k - 1 } else { k };
                for (i, x) in a.iter().enumerate() {
                    let col = if i < completed { i } else { labels.len() - 1 };
                    want[col] += x / per_token.len() as f64;
                }
            }
            for (col, (g, w)) in row.iter().zip(&want).enumerate() {
                assert!((g - w).abs() < 1e-5, "{what}: α[{c}][{}] {g} vs {w}", labels[col]);
            }
            let read: Vec<f64> = want.iter().copied().filter(|x| *x > 0.0).collect();
            spread = spread.max(
                read.iter().cloned().fold(0.0, f64::max) - read.iter().cloned().fold(1.0, f64::min),
            );
        }
        // Non-zero pseudo-queries: the weights are far from uniform, so they test something.
        assert!(spread > 0.2, "{what}: α nearly uniform ({spread})");
    }
}
