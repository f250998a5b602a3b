//! RMSNorm with a learnable gain: `y = x / sqrt(mean(x²) + eps) ⊙ g` (statistics in f32,
//! as Hugging Face's `LlamaRMSNorm` computes them).

use super::{dot, par_reduce_rows, par_rows_mut, par_rows_new, zeros};
use std::mem::MaybeUninit;

/// The reciprocal RMS of one row, `1 / sqrt(mean(x²) + eps)`: every pass that takes it computes
/// it here, so that they all give the same bits.
fn row_rstd(row: &[f32], eps: f32) -> f32 {
    let rstd = 1.0 / (dot(row, row) / row.len() as f32 + eps).sqrt();
    if rstd != 0.0 || row.iter().any(|x| !x.is_finite()) {
        return rstd;
    }
    // The squares overflowed f32 (values beyond about 1.8e19, finite all of them): the same
    // statistic in f64, whose range holds them, so that such a row normalises as any other.
    let ms = row.iter().map(|&x| x as f64 * x as f64).sum::<f64>() / row.len() as f64;
    (1.0 / (ms + eps as f64).sqrt()) as f32
}

/// Per-row reciprocal RMS, `1 / sqrt(mean(x²) + eps)`, into `rstd[rows]`.
pub fn rstd(rstd: &mut [f32], x: &[f32], d: usize, eps: f32) {
    par_rows_mut(rstd, 1, |r0, out| {
        for (i, o) in out.iter_mut().enumerate() {
            *o = row_rstd(&x[(r0 + i) * d..(r0 + i + 1) * d], eps);
        }
    });
}

/// `x += y` (when given) and the per-row reciprocal RMS of the result into `rstd[rows]`, in one
/// pass over memory.
pub fn add_assign_rstd(x: &mut [f32], y: Option<&[f32]>, rstd: &mut [f32], d: usize, eps: f32) {
    assert!(y.is_none_or(|y| y.len() == x.len()) && rstd.len() * d == x.len());
    let rp = super::SendPtr(rstd.as_mut_ptr());
    par_rows_mut(x, d, |r0, chunk| {
        for (i, row) in chunk.chunks_mut(d).enumerate() {
            let t = r0 + i;
            if let Some(y) = y {
                super::simd::axpy(row, 1.0, &y[t * d..(t + 1) * d]);
            }
            // SAFETY: entry t of `rstd` (inside it: length checked above) goes with row t of
            // `x`, which is this task's alone.
            unsafe { rp.slice(t, 1)[0] = row_rstd(row, eps) };
        }
    });
}

/// `dst = x + y` (or `x`) and the per-row reciprocal RMS of the result into `rstd[rows]`, in
/// one pass over memory: [`add_assign_rstd`] into a new place (`dst` may start uninitialised;
/// it is written in full).
pub fn sum_rstd(
    dst: &mut [MaybeUninit<f32>],
    x: &[f32],
    y: Option<&[f32]>,
    rstd: &mut [f32],
    d: usize,
    eps: f32,
) {
    assert!(
        dst.len() == x.len() && y.is_none_or(|y| y.len() == x.len()) && rstd.len() * d == x.len()
    );
    let rp = super::SendPtr(rstd.as_mut_ptr());
    par_rows_mut(dst, d, |r0, chunk| {
        for (i, row) in chunk.chunks_mut(d).enumerate() {
            let t = r0 + i;
            let xr = &x[t * d..(t + 1) * d];
            match y {
                Some(y) => row.iter_mut().zip(xr).zip(&y[t * d..]).for_each(|((o, a), b)| {
                    o.write(a + b);
                }),
                None => row.iter_mut().zip(xr).for_each(|(o, a)| {
                    o.write(*a);
                }),
            }
            // SAFETY: every element of `row` was written just above.
            let row: &[f32] = unsafe { &*(row as *const [MaybeUninit<f32>] as *const [f32]) };
            // SAFETY: entry t of `rstd` (inside it: length checked above) goes with row t of
            // `dst`, which is this task's alone.
            unsafe { rp.slice(t, 1)[0] = row_rstd(row, eps) };
        }
    });
}

/// Forward: returns `y` and the per-row `rstd` that backward needs.
pub fn forward(x: &[f32], g: &[f32], d: usize, eps: f32) -> (Vec<f32>, Vec<f32>) {
    let rows = x.len() / d.max(1);
    let mut rs = zeros(rows);
    rstd(&mut rs, x, d, eps);
    let y = par_rows_new(rows, d, |r0, out| {
        for (i, yrow) in out.chunks_mut(d).enumerate() {
            let r = rs[r0 + i];
            let xrow = &x[(r0 + i) * d..(r0 + i + 1) * d];
            for j in 0..d {
                yrow[j] = xrow[j] * r * g[j];
            }
        }
    });
    (y, rs)
}

/// Backward: returns `dx`; `dg` accumulates.
/// With `u = g ⊙ dy`: `dx = r·u − (r³/d)·⟨u, x⟩·x`.
/// `dx_dot_x`, when given, receives each row's `⟨dx, x⟩`, taken while the rows are in cache:
/// when the norm's input is a sublayer's input `h`, that is the depth attention's `dh_dot_h`.
pub fn backward(
    dg: &mut [f32],
    dy: &[f32],
    x: &[f32],
    g: &[f32],
    rstd: &[f32],
    d: usize,
    dx_dot_x: Option<&mut [f32]>,
) -> Vec<f32> {
    let rows = rstd.len();
    assert!(x.len() == rows * d && dy.len() == rows * d);
    let dot_ptr = dx_dot_x.map(|v| {
        assert_eq!(v.len(), rows);
        super::SendPtr(v.as_mut_ptr())
    });
    let dx = par_rows_new(rows, d, |r0, out| {
        for (i, dxrow) in out.chunks_mut(d).enumerate() {
            let row = r0 + i;
            let (xr, dyr) = (&x[row * d..(row + 1) * d], &dy[row * d..(row + 1) * d]);
            let r = rstd[row];
            let mut ux = 0.0f32;
            for j in 0..d {
                ux += g[j] * dyr[j] * xr[j];
            }
            let c = r * r * r * ux / d as f32;
            for j in 0..d {
                dxrow[j] = r * g[j] * dyr[j] - c * xr[j];
            }
            if let Some(p) = dot_ptr {
                // SAFETY: entry `row` (inside the buffer: its length is `rows`, checked above)
                // goes with row `row` of `dx`, which is this task's alone.
                unsafe { p.slice(row, 1)[0] = dot(dxrow, xr) };
            }
        }
    });
    let part = par_reduce_rows(rows, d, d, |range, acc| {
        for row in range {
            let r = rstd[row];
            let (xr, dyr) = (&x[row * d..(row + 1) * d], &dy[row * d..(row + 1) * d]);
            for j in 0..d {
                acc[j] += dyr[j] * xr[j] * r;
            }
        }
    });
    dg.iter_mut().zip(&part).for_each(|(a, b)| *a += b);
    dx
}

/// Mean over the rows of `v` (`[rows, d]`) of each row's root mean square.
pub fn mean_rms(v: &[f32], d: usize) -> f64 {
    let rows = v.len() / d;
    let total: f64 = v
        .chunks(d)
        .map(|r| (r.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / d as f64).sqrt())
        .sum();
    total / rows.max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{assert_close, fd_check, rand_vec};

    /// Values whose squares overflow f32 (up to f32's largest) normalise as in f64; a row with
    /// an infinity still gives no finite statistic.
    #[test]
    fn rows_whose_squares_overflow_normalise() {
        let d = 7;
        for scale in [1e20f32, 3e38, f32::MAX] {
            let x: Vec<f32> = (0..d).map(|i| scale * (1.0 - 0.13 * i as f32).min(1.0)).collect();
            let g = vec![2.0f32; d];
            let (y, _) = forward(&x, &g, d, 1e-6);
            let ms = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
            for (yi, xi) in y.iter().zip(&x) {
                let want = 2.0 * *xi as f64 / ms.sqrt();
                assert!(
                    (*yi as f64 - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{scale}: {yi} vs {want}"
                );
            }
        }
        let mut r = [1.0f32];
        rstd(&mut r, &[1.0, f32::INFINITY, 2.0], 3, 1e-6);
        assert_eq!(r[0], 0.0);
    }

    #[test]
    fn add_assign_rstd_and_sum_rstd_match_sum_then_rstd() {
        // One task and several.
        for rows in [5, 2000] {
            sum_then_rstd_case(rows);
        }
    }

    fn sum_then_rstd_case(rows: usize) {
        let (d, eps) = (19, 1e-5);
        let (x, y) = (rand_vec(rows * d, 3, 1.0), rand_vec(rows * d, 4, 2.0));
        let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        for (add, want) in [(Some(y.as_slice()), &sum), (None, &x)] {
            let (mut got, mut r) = (x.clone(), vec![0.0; rows]);
            add_assign_rstd(&mut got, add, &mut r, d, eps);
            assert_eq!(&got, want);
            // Into a new place: the same values and the same bits of rstd.
            let (mut dst, mut r2) = (vec![MaybeUninit::new(f32::NAN); rows * d], vec![0.0; rows]);
            sum_rstd(&mut dst, &x, add, &mut r2, d, eps);
            // SAFETY: initialised above (and overwritten by `sum_rstd`).
            assert!(dst.iter().zip(want).all(|(a, b)| unsafe { a.assume_init() } == *b));
            assert_eq!(r, r2, "sum_rstd's rstd");
            for (i, ri) in r.iter().enumerate() {
                let row = &want[i * d..(i + 1) * d];
                let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d as f64;
                assert!(
                    (*ri as f64 - 1.0 / (ms + eps as f64).sqrt()).abs() < 1e-5 * *ri as f64,
                    "rstd of row {i}"
                );
            }
        }
    }

    #[test]
    fn forward_matches_naive() {
        let (rows, d, eps) = (7, 13, 1e-5);
        let x = rand_vec(rows * d, 1, 1.0);
        let g = rand_vec(d, 2, 1.0);
        let (y, _) = forward(&x, &g, d, eps);
        let mut want = vec![0.0; rows * d];
        for i in 0..rows {
            let ms: f64 =
                x[i * d..(i + 1) * d].iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d as f64;
            for j in 0..d {
                want[i * d + j] =
                    (x[i * d + j] as f64 / (ms + eps as f64).sqrt() * g[j] as f64) as f32;
            }
        }
        assert_close(&y, &want, 1e-5, "rmsnorm forward");
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (rows, d, eps) = (5, 8, 1e-5);
        let x = rand_vec(rows * d, 3, 1.0);
        let g = rand_vec(d, 4, 1.0);
        let dy = rand_vec(rows * d, 5, 1.0);
        let loss = |x: &[f32], g: &[f32]| {
            let (y, _) = forward(x, g, d, eps);
            y.iter().zip(&dy).map(|(a, b)| (a * b) as f64).sum::<f64>()
        };
        let (_, r) = forward(&x, &g, d, eps);
        let (mut dg, mut dx_dot_x) = (vec![0.0; d], vec![0.0; rows]);
        let dx = backward(&mut dg, &dy, &x, &g, &r, d, Some(&mut dx_dot_x));
        fd_check(&x, &dx, |xp| loss(xp, &g), "rmsnorm dx");
        fd_check(&g, &dg, |gp| loss(&x, gp), "rmsnorm dg");
        let want: Vec<f32> = dx
            .chunks(d)
            .zip(x.chunks(d))
            .map(|(a, b)| a.iter().zip(b).map(|(p, q)| p * q).sum())
            .collect();
        assert_close(&dx_dot_x, &want, 1e-5, "rmsnorm dx_dot_x");
    }
}
