//! Helpers shared by the unit tests: deterministic random data and finite-difference checks.

use rand_chacha::ChaCha8Rng;
use rand_core::{Rng, SeedableRng};

/// Uniform values in `[-scale, scale)`, deterministic in `seed`.
pub fn rand_vec(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| ((rng.next_u32() >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0) * scale)
        .collect()
}

pub fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w} (tol {tol})"
        );
    }
}

/// `got` against `want` within `tol` of `want`'s largest magnitude: for kernels that sum in
/// another order (the GPU's), where a value near zero carries the rounding of larger ones.
pub fn assert_close_to_largest(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let largest = want.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    let (i, diff) = got
        .iter()
        .zip(want)
        // A NaN where a number is wanted (or the reverse) is as far off as can be; NaN in both
        // agrees.
        .map(|(g, w)| match (g.is_nan(), w.is_nan()) {
            (false, false) => (g - w).abs(),
            (true, true) => 0.0,
            _ => f32::INFINITY,
        })
        .enumerate()
        .fold((0, 0.0f32), |(bi, b), (i, d)| if d > b { (i, d) } else { (bi, b) });
    assert!(
        diff <= tol * largest,
        "{what}[{i}]: got {}, want {}: off by {:e} of the largest value {largest}",
        got[i],
        want[i],
        diff / largest
    );
}

/// Each row's dot product `got[t] = ⟨a_t, b_t⟩` (rows of `d`) within `tol` of the sum of its
/// terms' magnitudes, taken in f64: for dot products that nearly cancel, such as a norm's
/// input gradient with its input, where only the sizes of the terms bound the rounding.
pub fn assert_row_dots(got: &[f32], a: &[f32], b: &[f32], d: usize, tol: f64, what: &str) {
    assert!(a.len() == got.len() * d && b.len() == a.len(), "{what}: lengths");
    for (t, got) in got.iter().enumerate() {
        let terms = a[t * d..(t + 1) * d].iter().zip(&b[t * d..(t + 1) * d]);
        let (sum, size) = terms.fold((0f64, 0f64), |(s, m), (x, y)| {
            let p = *x as f64 * *y as f64;
            (s + p, m + p.abs())
        });
        assert!((*got as f64 - sum).abs() <= tol * size, "{what}[{t}]: {got} vs {sum}");
    }
}

/// Compares an analytic gradient with central differences of `f` (evaluated in f32, summed
/// in f64) at every coordinate of `x`.
pub fn fd_check(x: &[f32], grad: &[f32], f: impl Fn(&[f32]) -> f64, what: &str) {
    fd_check_at(x, grad, f, what, &(0..x.len()).collect::<Vec<_>>(), 1e-2)
}

/// Like [`fd_check`] on chosen coordinates, with step `h`. The tolerance is relative to the
/// largest gradient so that tiny entries do not fail on f32 rounding.
pub fn fd_check_at(
    x: &[f32],
    grad: &[f32],
    f: impl Fn(&[f32]) -> f64,
    what: &str,
    idx: &[usize],
    h: f32,
) {
    let scale = grad.iter().fold(0.0f32, |m, g| m.max(g.abs())).max(1e-3);
    let mut xp = x.to_vec();
    for &i in idx {
        let orig = xp[i];
        xp[i] = orig + h;
        let up = f(&xp);
        xp[i] = orig - h;
        let down = f(&xp);
        xp[i] = orig;
        let fd = ((up - down) / (2.0 * h as f64)) as f32;
        assert!(
            (fd - grad[i]).abs() <= 1e-2 * scale + 1e-2 * fd.abs(),
            "{what}[{i}]: analytic {} vs finite difference {fd} (scale {scale})",
            grad[i]
        );
    }
}

/// Settings of a run small enough for the emulated GPU (on the tiny preset): its model and
/// batches, to which a test adds its token budget and evaluations.
pub const EMULATED_RUN: &[&str] = &[
    "hidden_size=32",
    "intermediate_size=48",
    "num_hidden_layers=2",
    "num_attention_heads=2",
    "num_key_value_heads=2",
    "seq_len=32",
    "micro_batch=4",
    "batch_tokens=256",
];
