//! Softmax cross-entropy over the vocabulary, averaged over tokens, fused with its gradient:
//! one pass of exponentials per row serves both.

use super::{par_reduce_rows, simd, SendPtr};

/// Mean cross-entropy of `logits[rows, V]` against `targets[rows]`. When `dlogits` is given it
/// receives `(softmax − onehot) / rows`, the gradient of the mean loss.
pub fn forward_backward(
    logits: &[f32],
    targets: &[u32],
    v: usize,
    dlogits: Option<&mut [f32]>,
) -> f32 {
    let rows = targets.len();
    assert_eq!(logits.len(), rows * v);
    let inv = 1.0 / rows as f32;
    let dptr = dlogits.map(|d| {
        assert_eq!(d.len(), rows * v);
        SendPtr(d.as_mut_ptr())
    });
    let total = par_reduce_rows(rows, v, 1, |range, acc| {
        let mut scratch = Vec::new();
        for r in range {
            let row = &logits[r * v..(r + 1) * v];
            let e: &mut [f32] = match dptr {
                // SAFETY: row r of dlogits (inside it: length checked above) is in this task's
                // row range only.
                Some(p) => unsafe { p.slice(r * v, v) },
                None => {
                    scratch.resize(v, 0.0);
                    &mut scratch
                }
            };
            e.copy_from_slice(row);
            let m = simd::max(e);
            let z = simd::exp_shift_sum(e, m);
            let t = targets[r] as usize;
            acc[0] += (z as f64).ln() as f32 + m - row[t];
            if dptr.is_some() {
                simd::scale(e, inv / z);
                e[t] -= inv;
            }
        }
    });
    total[0] * inv
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
            want += -(row[targets[r] as usize] as f64) + z.ln();
        }
        let mut d = vec![0.0; rows * v];
        let loss = forward_backward(&logits, &targets, v, Some(&mut d));
        assert!((loss as f64 - want / rows as f64).abs() < 1e-5);
        assert_eq!(loss, forward_backward(&logits, &targets, v, None));
        fd_check(&logits, &d, |x| forward_backward(x, &targets, v, None) as f64, "cross-entropy");
    }
}
