//! Softmax cross-entropy over the vocabulary, averaged over tokens, fused with its gradient.

use super::par_rows_mut;
use rayon::prelude::*;

/// Mean cross-entropy of `logits[rows, V]` against `targets[rows]`. When `dlogits` is given it
/// receives `(softmax − onehot) / rows`, the gradient of the mean loss.
pub fn forward_backward(logits: &[f32], targets: &[u32], v: usize, dlogits: Option<&mut [f32]>) -> f32 {
    let rows = targets.len();
    assert_eq!(logits.len(), rows * v);
    let losses: Vec<f64> = (0..rows)
        .into_par_iter()
        .map(|r| {
            let row = &logits[r * v..(r + 1) * v];
            let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let z: f64 = row.iter().map(|x| ((x - m) as f64).exp()).sum();
            z.ln() + m as f64 - row[targets[r] as usize] as f64
        })
        .collect();
    if let Some(d) = dlogits {
        let inv = 1.0 / rows as f32;
        par_rows_mut(d, v, |r0, chunk| {
            for (i, drow) in chunk.chunks_mut(v).enumerate() {
                let r = r0 + i;
                let row = &logits[r * v..(r + 1) * v];
                let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let mut z = 0.0f32;
                for (d, x) in drow.iter_mut().zip(row) {
                    *d = (x - m).exp();
                    z += *d;
                }
                let s = inv / z;
                drow.iter_mut().for_each(|d| *d *= s);
                drow[targets[r] as usize] -= inv;
            }
        });
    }
    (losses.iter().sum::<f64>() / rows as f64) as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{fd_check, rand_vec};

    #[test]
    fn loss_and_gradient() {
        let (rows, v) = (4, 7);
        let logits = rand_vec(rows * v, 31, 4.0);
        let targets = [0u32, 6, 3, 3];
        let mut want = 0.0f64;
        for r in 0..rows {
            let row = &logits[r * v..(r + 1) * v];
            let z: f64 = row.iter().map(|x| (*x as f64).exp()).sum();
            want += -(row[targets[r] as usize] as f64).exp().ln() + z.ln();
        }
        let mut d = vec![0.0; rows * v];
        let loss = forward_backward(&logits, &targets, v, Some(&mut d));
        assert!((loss as f64 - want / rows as f64).abs() < 1e-5);
        fd_check(&logits, &d, |x| forward_backward(x, &targets, v, None) as f64, "cross-entropy");
    }
}
