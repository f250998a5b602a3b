//! Softmax cross-entropy over the vocabulary, averaged over tokens, fused with its gradient:
//! one pass of exponentials per row serves both.

use super::{par_reduce_rows, simd, SendPtr};

/// Mean cross-entropy of `logits[rows, V]` against `targets[rows]`.
pub fn loss(logits: &[f32], targets: &[u32], v: usize) -> f32 {
    mean_loss(logits, targets, v, None)
}

/// [`loss`] and its gradient `(softmax − onehot) / rows`, `[rows, V]`.
pub fn loss_and_grad(logits: &[f32], targets: &[u32], v: usize) -> (f32, Vec<f32>) {
    let mut dlogits = Vec::new();
    let loss = mean_loss(logits, targets, v, Some(&mut dlogits));
    (loss, dlogits)
}

/// The mean loss; with `dlogits`, also the gradient, written over it.
fn mean_loss(logits: &[f32], targets: &[u32], v: usize, mut dlogits: Option<&mut Vec<f32>>) -> f32 {
    let rows = targets.len();
    assert_eq!(logits.len(), rows * v);
    let inv = 1.0 / rows as f32;
    // The gradient's rows are first written by copying the logits in (no zeroing pass); its
    // length is set after.
    if let Some(d) = dlogits.as_mut() {
        d.clear();
        d.reserve_exact(rows * v);
    }
    let dptr = dlogits.as_mut().map(|d| SendPtr(d.as_mut_ptr()));
    let total = par_reduce_rows(rows, v, 1, |range, acc| {
        let mut scratch = Vec::new();
        for r in range {
            let row = &logits[r * v..(r + 1) * v];
            let e: &mut [f32] = match dptr {
                // SAFETY: row r of dlogits lies in its capacity (rows·V) and in this task's row
                // range only; it is written in full by the copy before the slice is made.
                Some(p) => unsafe {
                    std::ptr::copy_nonoverlapping(row.as_ptr(), p.get().add(r * v), v);
                    p.slice(r * v, v)
                },
                None => {
                    scratch.clear();
                    scratch.extend_from_slice(row);
                    &mut scratch
                }
            };
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
    if let Some(d) = dlogits {
        // SAFETY: the capacity is rows·V and every row was written above (a panic in a task
        // would have ended this function first).
        unsafe { d.set_len(rows * v) };
    }
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
        let (l, d) = loss_and_grad(&logits, &targets, v);
        assert!((l as f64 - want / rows as f64).abs() < 1e-5);
        assert_eq!(l, loss(&logits, &targets, v));
        fd_check(&logits, &d, |x| loss(x, &targets, v) as f64, "cross-entropy");
    }
}
