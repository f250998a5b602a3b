//! Whole-model checks: gradients against finite differences for every residual mode, the
//! zero-init equivalence of docs/method.md §4, and Full as Block with one sublayer per block.

mod common;

use attnres::model::{Config, Model, ResidualKind};
use common::reference::{self, Ref};
use common::{copy_shared, max_abs, noise, perturbed, tiny};

const IDS: [u32; 6] = [1, 5, 9, 2, 2, 10];
const TARGETS: [u32; 6] = [5, 9, 0, 2, 10, 3];

fn loss_of(m: &Model) -> f64 {
    let f = m.forward(&IDS, 2, 3).unwrap();
    m.loss(&f, &TARGETS).unwrap() as f64
}

/// `(f(h) − f(−h)) / 2h`, where `f(δ)` is the loss with one coordinate moved by `δ`.
fn central(h: f64, mut f: impl FnMut(f64) -> f64) -> f64 {
    (f(h) - f(-h)) / (2.0 * h)
}

/// Central differences of the float64 reference loss in every parameter. With step 1e-5 the
/// truncation error is O(h²) ~ 1e-10 and the rounding error ~ 1e-16·loss/h ~ 1e-11, so even a
/// coordinate whose gradient is 1e-6 is known to ~1e-4 of itself.
/// `norm_eps` as in `reference::forward`.
fn reference_gradient(m: &Model, norm_eps: &dyn Fn(usize) -> f64) -> Vec<f64> {
    let mut r = Ref::new(m);
    (0..r.params.len())
        .map(|i| {
            let orig = r.params[i];
            let g = central(1e-5, |d| {
                r.params[i] = orig + d;
                reference::loss(&reference::forward(&r, &IDS, 2, 3, norm_eps).logits, &TARGETS)
            });
            r.params[i] = orig;
            g
        })
        .collect()
}

/// Every coordinate of every tensor of the library's backward against finite differences of
/// the independent float64 forward pass (tests/common/reference.rs). Tolerance per tensor,
/// relative to that tensor's own largest gradient (`GRAD_TOL`): the library computes in f32,
/// whose rounding (~6e-8 relative) summed over a few hundred terms stays below it (the worst
/// seen is ~1e-6). The
/// absolute floor, 1e-7 of the largest gradient anywhere, covers tensors whose gradient is
/// zero by construction (the pseudo-query of sublayer 0, which reads one source).
fn check_gradients(cfg: Config) {
    const GRAD_TOL: f64 = 1e-5;
    let m = perturbed(cfg);
    let f = m.forward(&IDS, 2, 3).unwrap();
    // The reference must first be the same function.
    let r = reference::forward(&Ref::new(&m), &IDS, 2, 3, &|_| m.config.rms_norm_eps);
    let want: Vec<f32> = r.logits.concat().iter().map(|v| *v as f32).collect();
    assert_close(&f.logits, &want, 1e-5, "logits against the reference");
    let (_, grads) = m.backward(&f, &TARGETS).unwrap();
    let fd = reference_gradient(&m, &|_| m.config.rms_norm_eps);
    let floor = 1e-7 * fd.iter().fold(0f64, |a, g| a.max(g.abs()));
    for spec in &m.layout.specs {
        let (g, w) = (&grads[spec.range.clone()], &fd[spec.range.clone()]);
        let scale = w.iter().fold(0f64, |a, x| a.max(x.abs()));
        for (j, (a, b)) in g.iter().zip(w).enumerate() {
            let err = (*a as f64 - b).abs();
            assert!(
                err <= GRAD_TOL * scale + floor,
                "{}[{j}]: backward {a} vs finite difference {b} (tensor scale {scale:.3e})",
                spec.name
            );
        }
        // Pseudo-queries of consumers that read more than one source must get gradient.
        if spec.name.contains("res_proj") && !spec.name.contains("layers.0.attn") {
            assert!(scale > 1e-6, "{} has no gradient", spec.name);
        }
    }
}

/// `got` against `want` within `tol` of the largest `|want|`.
fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = max_abs(want);
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!((a - b).abs() <= tol * scale, "{what}: [{i}] {a} vs {b} (scale {scale})");
    }
}

/// Finite differences of the library's own f32 loss, for the ablations the reference does not
/// implement: five coordinates per tensor (ends, thirds, middle). Tolerance per tensor: 2% of
/// its largest backward gradient, plus the noise floor of an f32 central difference (the
/// loss's rounding `2^-23·loss / h` and the `h²` truncation, doubled: about 3e-4 at h = 1e-2).
fn check_gradients_f32(cfg: Config) {
    let mut m = perturbed(cfg);
    let f = m.forward(&IDS, 2, 3).unwrap();
    let (loss, grads) = m.backward(&f, &TARGETS).unwrap();
    let h = 1e-2f32;
    let floor = 2.0 * (loss as f64 * 2f64.powi(-23) / h as f64 + (h as f64).powi(2));
    for spec in m.layout.specs.clone() {
        let n = spec.range.len();
        let scale = max_abs(&grads[spec.range.clone()]) as f64;
        for j in [0, n / 3, n / 2, 2 * n / 3, n - 1] {
            let i = spec.range.start + j;
            let orig = m.params[i];
            let fd = central(h as f64, |d| {
                m.params[i] = orig + d as f32;
                loss_of(&m)
            });
            m.params[i] = orig;
            assert!(
                (fd - grads[i] as f64).abs() <= 2e-2 * scale + floor,
                "{}[{j}]: backward {} vs finite difference {fd} (tensor scale {scale:.3e})",
                spec.name,
                grads[i]
            );
        }
    }
}

#[test]
fn gradients_standard() {
    check_gradients(tiny(ResidualKind::Standard, 0));
}

#[test]
fn gradients_full() {
    check_gradients(tiny(ResidualKind::Full, 0));
}

#[test]
fn gradients_block() {
    check_gradients(tiny(ResidualKind::Block, 2));
}

#[test]
fn gradients_block_single() {
    check_gradients(tiny(ResidualKind::Block, 1));
}

/// Three layers in blocks of two (`attn_res_block_size = 2`): blocks of 4 and 2 sublayers.
fn uneven() -> Config {
    Config { num_hidden_layers: 3, ..tiny(ResidualKind::Block, 2) }
        .with_overrides(&["attn_res_block_size=2".into()])
        .unwrap()
}

/// A shorter last block: closed after the last sublayer, read by the output aggregation only.
#[test]
fn gradients_block_with_a_shorter_last_block() {
    let c = uneven();
    assert_eq!((c.block_size(), c.num_blocks, c.attn_res_block_size), (Some(4), 2, Some(2)));
    check_gradients(c);
}

/// A tiny AttnRes config with ablation settings (docs/method.md §5) applied.
fn ablation(kind: ResidualKind, nb: usize, sets: &[&str]) -> Config {
    tiny(kind, nb).with_overrides(&sets.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
}

const ABLATIONS: &[&[&str]] = &[
    &["attn_res_key_norm=false"],
    &["attn_res_gate=sigmoid"],
    &["attn_res_query=input"],
    &["attn_res_query=input", "attn_res_key_norm=false"],
    &["attn_res_query=scalar"],
    &["attn_res_query=dense"],
    &["attn_res_heads=2"],
    &["attn_res_window=1"],
];

#[test]
fn gradients_of_every_ablation() {
    let sets = |s: &[&str]| s.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    for s in ABLATIONS {
        for (kind, nb) in [(ResidualKind::Full, 0), (ResidualKind::Block, 2)] {
            let cfg = ablation(kind, nb, s);
            let r = std::panic::catch_unwind(|| check_gradients_f32(cfg.clone()));
            assert!(r.is_ok(), "{kind:?}/{nb} with {s:?}");
        }
        let cfg = uneven().with_overrides(&sets(s)).unwrap();
        let r = std::panic::catch_unwind(|| check_gradients_f32(cfg.clone()));
        assert!(r.is_ok(), "a shorter last block with {s:?}");
    }
}

/// With a window covering every source, the ablation path (one pass per consumer) must give
/// what the two-phase path gives: logits and every gradient.
#[test]
fn ablation_path_equals_the_two_phase_path() {
    for (kind, nb) in [(ResidualKind::Full, 0), (ResidualKind::Block, 2)] {
        let fast = perturbed(tiny(kind, nb));
        let slow =
            Model::new(ablation(kind, nb, &["attn_res_window=100"]), fast.params.clone()).unwrap();
        let (ff, fs) = (fast.forward(&IDS, 2, 3).unwrap(), slow.forward(&IDS, 2, 3).unwrap());
        for (a, b) in ff.logits.iter().zip(&fs.logits) {
            assert!((a - b).abs() < 1e-5 * (1.0 + a.abs()), "{kind:?}: logits {a} vs {b}");
        }
        let (g1, g2) =
            (fast.backward(&ff, &TARGETS).unwrap().1, slow.backward(&fs, &TARGETS).unwrap().1);
        let scale = g1.iter().fold(0f32, |a, g| a.max(g.abs()));
        for (i, (a, b)) in g1.iter().zip(&g2).enumerate() {
            assert!((a - b).abs() < 1e-5 * scale, "{kind:?}: gradient {i}: {a} vs {b}");
        }
    }
}

/// DenseFormer-style mixing starts with every weight 1: the plain sum, i.e. the standard
/// residual, exactly (up to rounding), whatever the other weights.
#[test]
fn dense_mixing_starts_as_the_standard_residual() {
    let std = perturbed(tiny(ResidualKind::Standard, 0));
    let f0 = std.forward(&IDS, 2, 3).unwrap();
    for (kind, nb) in [(ResidualKind::Full, 0), (ResidualKind::Block, 2), (ResidualKind::Block, 1)]
    {
        let mut m = Model::init(ablation(kind, nb, &["attn_res_query=dense"]), 1).unwrap();
        copy_shared(&std, &mut m);
        let f = m.forward(&IDS, 2, 3).unwrap();
        for (a, b) in f.logits.iter().zip(&f0.logits) {
            assert!((a - b).abs() < 1e-5 * (1.0 + b.abs()), "{kind:?}/{nb}: logits {a} vs {b}");
        }
    }
}

/// A window of W reads the embedding and the latest W outputs: with W = 1 in Full AttnRes,
/// every consumer mixes exactly two sources (one for the first), which the weights show.
#[test]
fn sliding_window_reads_the_embedding_and_the_latest_outputs() {
    let m = perturbed(ablation(ResidualKind::Full, 0, &["attn_res_window=1"]));
    let f = m.forward(&IDS, 2, 3).unwrap();
    let w = f.residual.depth_weights().unwrap();
    let want: Vec<Vec<usize>> = vec![vec![0], vec![0, 1], vec![0, 2], vec![0, 3], vec![0, 4]];
    assert_eq!(w.columns, want);
    // The scalar and dense parameters hold one value per distinct source.
    let s = Model::init(ablation(ResidualKind::Block, 2, &["attn_res_query=scalar"]), 1).unwrap();
    let spec = s.layout.spec("model.layers.1.mlp_res_proj.weight").unwrap();
    assert_eq!(spec.shape, vec![1, 4], "emb, b1, b2, partial");
    assert!(s.layout.spec("model.layers.1.mlp_res_norm.weight").is_none());
    let i = Model::init(ablation(ResidualKind::Full, 0, &["attn_res_query=input"]), 1).unwrap();
    assert_eq!(i.layout.spec("model.output_attn_res_proj.weight").unwrap().shape, vec![8, 8]);
}

/// docs/method.md §4 at the model's real eps, with non-trivial hidden states (perturbed
/// weights, pseudo-queries zeroed). With every pseudo-query zero each depth attention returns
/// the mean of its `n_l` sources; their sum is the standard stream `s_l`, so consumer `l` reads
/// `s_l / n_l`, and the key norm plays no part (every depth logit is 0 whatever the keys). Every
/// consumer normalises first: `RMSNorm(s/n; eps) = s / sqrt(ms(s) + n²·eps) · g = RMSNorm(s;
/// n²·eps)`. So the AttnRes model is *exactly* the standard model whose PreNorm at consumer `l`
/// has eps `n_l²·eps` (the final norm `n_L²·eps`). Checked against the float64 reference
/// forward pass with those per-norm eps: logits, loss and every shared gradient, to f32
/// rounding. The same reference at one eps is visibly different, and the library's standard
/// model differs from the AttnRes one by no more than the first-order effect of that eps.
#[test]
fn zero_init_equivalence_at_the_real_eps() {
    let mut std = perturbed(tiny(ResidualKind::Standard, 0));
    // A stream of the size training starts from (embeddings of mean square ~8e-4, docs/method.md
    // §4, and small sublayer outputs), so that `n²·eps` is a visible fraction of the mean
    // square it is added to; the gains and the LM head keep the logits far from uniform.
    let emb = std.layout.embed.clone();
    for (i, p) in std.params[emb].iter_mut().enumerate() {
        *p = 0.05 * noise(i, 7);
    }
    for lp in std.layout.layers.clone() {
        for r in [lp.o_proj, lp.down] {
            std.params[r].iter_mut().for_each(|p| *p *= 0.1);
        }
    }
    let eps = std.config.rms_norm_eps;
    let fs = std.forward(&IDS, 2, 3).unwrap();
    let (_, grad_s) = std.backward(&fs, &TARGETS).unwrap();
    let rs = Ref::new(&std);
    let uniform = reference::forward(&rs, &IDS, 2, 3, &|_| eps);
    for (kind, nb) in [(ResidualKind::Full, 0), (ResidualKind::Block, 2), (ResidualKind::Block, 1)]
    {
        let what = format!("{kind:?}/{nb}");
        let mut m = perturbed(tiny(kind, nb));
        copy_shared(&std, &mut m);
        for s in m.layout.specs.iter().filter(|s| s.name.contains("res_proj")) {
            m.params[s.range.clone()].fill(0.0);
        }
        let block = m.config.block_size().unwrap();
        let n2 = |l: usize| (reference::sources_read(l, block) as f64).powi(2);
        let scaled = move |l: usize| n2(l) * eps;
        let f = m.forward(&IDS, 2, 3).unwrap();
        let (loss, grad) = m.backward(&f, &TARGETS).unwrap();
        let exact = reference::forward(&rs, &IDS, 2, 3, &scaled);
        let want: Vec<f32> = exact.logits.concat().iter().map(|v| *v as f32).collect();
        // f32 rounding: ~1e-7 of the largest logit is seen.
        assert_close(&f.logits, &want, 1e-6, &format!("{what}: logits"));
        let want_loss = reference::loss(&exact.logits, &TARGETS);
        assert!((loss as f64 - want_loss).abs() < 1e-5 * want_loss, "{what}: loss {loss}");

        // Every gradient the two models share, against central differences of the reference.
        let fd = reference_gradient(&std, &scaled);
        let floor = 1e-7 * fd.iter().fold(0f64, |a, g| a.max(g.abs()));
        for s in &std.layout.specs {
            let t = m.layout.spec(&s.name).unwrap();
            let w = &fd[s.range.clone()];
            let scale = w.iter().fold(0f64, |a, x| a.max(x.abs()));
            for (j, (a, b)) in grad[t.range.clone()].iter().zip(w).enumerate() {
                assert!(
                    (*a as f64 - b).abs() <= 1e-4 * scale + floor,
                    "{what}: grad {}[{j}] {a} vs {b} (tensor scale {scale:.3e})",
                    s.name
                );
            }
        }

        // The eps effect is real: the reference at one eps misses by far more than rounding...
        let scale = max_abs(&want) as f64;
        let gap = uniform
            .logits
            .concat()
            .iter()
            .zip(exact.logits.concat())
            .fold(0f64, |a, (u, e)| a.max((u - e).abs()));
        assert!(gap > 100.0 * 1e-6 * scale, "{what}: eps changes the logits by only {gap:.2e}");
        // ...and within first order of it. Norm l rescales its output by
        // sqrt((ms + eps) / (ms + n²·eps)), i.e. by a relative δ_l ≤ (n² − 1)·eps / (2·ms)
        // with ms the smallest per-token mean square of the stream it normalises; a logit
        // moves by at most Σ δ_l of the largest logit (each rescaling feeds forward through
        // one more sublayer); a gradient, the product of a forward and a backward factor that
        // each move by at most that, by at most 2·Σ δ_l. The library's standard model must lie
        // that close to the AttnRes one (seen: a third of the bound for logits, 0.8 of it for
        // the worst gradient tensor).
        let ms = |rows: &[Vec<f64>]| {
            rows.iter().map(|r| reference::rms(r).powi(2)).fold(f64::MAX, f64::min)
        };
        let streams: Vec<&Vec<Vec<f64>>> =
            uniform.inputs.iter().chain(std::iter::once(&uniform.final_input)).collect();
        let delta: f64 =
            streams.iter().enumerate().map(|(l, s)| (n2(l) - 1.0) * eps / (2.0 * ms(s))).sum();
        assert!(
            gap <= delta * scale,
            "{what}: eps moves the logits by {gap:.2e}, Σδ = {delta:.2e}"
        );
        assert_close(
            &fs.logits,
            &f.logits,
            (delta + 1e-5) as f32,
            &format!("{what}: standard logits"),
        );
        for s in &std.layout.specs {
            let t = m.layout.spec(&s.name).unwrap();
            let (a, b) = (&grad_s[s.range.clone()], &grad[t.range.clone()]);
            let scale = max_abs(b);
            for (j, (a, b)) in a.iter().zip(b).enumerate() {
                assert!(
                    (a - b).abs() <= (2.0 * delta as f32 + 1e-5) * scale,
                    "{what}: standard grad {}[{j}] {a} vs {b}",
                    s.name
                );
            }
        }
    }
}

#[test]
fn block_with_one_sublayer_per_block_is_full() {
    let full = perturbed(tiny(ResidualKind::Full, 0));
    let block = Model::new(tiny(ResidualKind::Block, 4), full.params.clone()).unwrap();
    let (ff, fb) = (full.forward(&IDS, 2, 3).unwrap(), block.forward(&IDS, 2, 3).unwrap());
    assert_eq!(ff.logits, fb.logits);
    let (g1, g2) =
        (full.backward(&ff, &TARGETS).unwrap().1, block.backward(&fb, &TARGETS).unwrap().1);
    assert_eq!(g1, g2);
    // ...and a coarser block count really is different.
    let coarse = Model::new(tiny(ResidualKind::Block, 2), full.params.clone()).unwrap();
    assert_ne!(coarse.forward(&IDS, 2, 3).unwrap().logits, ff.logits);
}

#[test]
fn bad_batches_are_rejected_with_names() {
    let m = Model::init(tiny(ResidualKind::Block, 2), 1).unwrap();
    assert!(m.forward(&[1, 2, 11], 1, 3).err().unwrap().to_string().contains("token id 11"));
    assert!(m
        .forward(&[1; 9], 1, 9)
        .err()
        .unwrap()
        .to_string()
        .contains("max_position_embeddings"));
    let f = m.forward(&[1, 2, 3], 1, 3).unwrap();
    assert!(m.loss(&f, &[1, 2]).unwrap_err().to_string().contains("targets"));
}

/// Large enough that every kernel splits its work across threads.
fn parallel_sized(residual: ResidualKind) -> Config {
    Config {
        vocab_size: 300,
        hidden_size: 128,
        intermediate_size: 256,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 32,
        max_position_embeddings: 128,
        residual,
        num_blocks: 2,
        ..Config::default()
    }
}

/// Four sequences of 100 token ids for [`parallel_sized`], and their targets.
fn parallel_batch() -> (Vec<u32>, Vec<u32>) {
    let ids: Vec<u32> = (0..4 * 100).map(|i| (noise(i, 9).abs() * 299.0) as u32).collect();
    let targets: Vec<u32> = ids.iter().map(|t| (t + 1) % 300).collect();
    (ids, targets)
}

#[test]
fn results_are_bitwise_deterministic_on_a_parallel_sized_model() {
    let m = perturbed(parallel_sized(ResidualKind::Block));
    let (ids, targets) = parallel_batch();
    let run = || {
        let f = m.forward(&ids, 4, 100).unwrap();
        let (loss, g) = m.backward(&f, &targets).unwrap();
        (f.logits, loss, g)
    };
    let (a, b) = (run(), run());
    assert!(a.0 == b.0 && a.1 == b.1 && a.2 == b.2, "two identical runs differ");
}

/// Activation recomputation changes what a step keeps, not what it computes: the same loss
/// and gradient, bit for bit, for every residual and an ablation.
#[test]
fn recomputation_gives_the_same_bits() {
    let (ids, targets) = parallel_batch();
    let input_query = parallel_sized(ResidualKind::Block)
        .with_overrides(&["attn_res_query=input".to_string()])
        .unwrap();
    for cfg in [
        parallel_sized(ResidualKind::Standard),
        parallel_sized(ResidualKind::Full),
        parallel_sized(ResidualKind::Block),
        input_query,
    ] {
        let what = format!("{} {:?}", cfg.residual_label(), cfg.attn_res_query);
        let m = perturbed(cfg);
        let kept = m.forward(&ids, 4, 100).unwrap();
        let recomputed = m.forward_with(&ids, 4, 100, true).unwrap();
        assert!(kept.logits == recomputed.logits, "{what}: logits");
        let (a, b) =
            (m.backward(&kept, &targets).unwrap(), m.backward(&recomputed, &targets).unwrap());
        let same = a.1.iter().zip(&b.1).all(|(x, y)| x.to_bits() == y.to_bits());
        assert!(a.0.to_bits() == b.0.to_bits() && same, "{what}: loss or gradient differs");
    }
}
