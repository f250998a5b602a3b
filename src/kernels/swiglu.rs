//! SwiGLU activation over a fused gate/up buffer: `gu[rows, 2F]` holds the gate projection in
//! columns `0..F` and the up projection in `F..2F`; `act = silu(gate) ⊙ up`.

use super::{par_rows_mut, par_rows_new, simd};

/// Forward: returns `act[rows, F]`.
pub fn forward(gu: &[f32], f: usize) -> Vec<f32> {
    par_rows_new(gu.len() / (2 * f).max(1), f, |r0, chunk| {
        for (i, a) in chunk.chunks_mut(f).enumerate() {
            let row = &gu[(r0 + i) * 2 * f..(r0 + i + 1) * 2 * f];
            let (g, u) = row.split_at(f);
            simd::swiglu_forward_row(a, g, u);
        }
    })
}

/// Backward: overwrites `dgu[rows, 2F]` from `dact[rows, F]`.
pub fn backward(dgu: &mut [f32], dact: &[f32], gu: &[f32], f: usize) {
    par_rows_mut(dgu, 2 * f, |r0, chunk| {
        for (i, d) in chunk.chunks_mut(2 * f).enumerate() {
            let row = r0 + i;
            let (g, u) = gu[row * 2 * f..(row + 1) * 2 * f].split_at(f);
            let da = &dact[row * f..(row + 1) * f];
            let (dg, du) = d.split_at_mut(f);
            simd::swiglu_backward_row(dg, du, da, g, u);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{fd_check, rand_vec};

    #[test]
    fn forward_and_backward() {
        let (rows, f) = (3, 5);
        let gu = rand_vec(rows * 2 * f, 21, 3.0);
        let act = forward(&gu, f);
        let (g, u) = (gu[2 * f + 1] as f64, gu[2 * f + f + 1] as f64);
        assert!((act[f + 1] as f64 - g / (1.0 + (-g).exp()) * u).abs() < 1e-6);
        let dact = rand_vec(rows * f, 22, 1.0);
        let mut dgu = vec![0.0; gu.len()];
        backward(&mut dgu, &dact, &gu, f);
        fd_check(
            &gu,
            &dgu,
            |x| {
                let a = forward(x, f);
                a.iter().zip(&dact).map(|(a, b)| (a * b) as f64).sum()
            },
            "swiglu",
        );
    }
}
