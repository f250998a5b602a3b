//! Test reference: the method's depth attention in the plain one-pass form, one consumer at a
//! time (docs/method.md §3). The model never runs it; the two-phase forward and the per-source
//! backward of [`super`] are tested against it, and it is tested against the definition.

use crate::kernels::{dot, par_reduce_rows, par_rows_mut, simd, SendPtr};

/// Forward over `K = sources.len()` sources of shape `[rows, d]`: writes `h[rows, d]` and, per
/// token, the weights `alpha[rows, K]` and `logits[rows, K]` that backward needs.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    h: &mut [f32],
    alpha: &mut [f32],
    logits: &mut [f32],
    sources: &[&[f32]],
    rstds: &[&[f32]],
    q: &[f32],
    gamma: &[f32],
    d: usize,
) {
    let k = sources.len();
    let rows = h.len() / d;
    assert!(k > 0 && rstds.len() == k && alpha.len() == rows * k && logits.len() == rows * k);
    let w: Vec<f32> = q.iter().zip(gamma).map(|(a, b)| a * b).collect();
    let (aptr, lptr) = (SendPtr(alpha.as_mut_ptr()), SendPtr(logits.as_mut_ptr()));
    par_rows_mut(h, d, |r0, chunk| {
        let n = chunk.len() / d;
        // SAFETY: rows r0..r0 + n of alpha and logits (inside them: lengths checked above) go
        // with this task's rows of `h`, so no other task touches them.
        let (al, lg) = unsafe { (aptr.slice(r0 * k, n * k), lptr.slice(r0 * k, n * k)) };
        for i in 0..n {
            let t = r0 + i;
            let (a, l) = (&mut al[i * k..(i + 1) * k], &mut lg[i * k..(i + 1) * k]);
            let mut m = f32::NEG_INFINITY;
            for s in 0..k {
                l[s] = rstds[s][t] * dot(&w, &sources[s][t * d..(t + 1) * d]);
                m = m.max(l[s]);
            }
            let mut z = 0.0f32;
            for s in 0..k {
                a[s] = (l[s] - m).exp();
                z += a[s];
            }
            a.iter_mut().for_each(|x| *x /= z);
            let hrow = &mut chunk[i * d..(i + 1) * d];
            hrow.iter_mut().for_each(|x| *x = 0.0);
            for s in 0..k {
                simd::axpy(hrow, a[s], &sources[s][t * d..(t + 1) * d]);
            }
        }
    });
}

/// Backward: accumulates into each source's gradient (`dsources[i]`, `[rows, d]`) and into
/// `dq`, `dgamma`, given `dh` and what forward saved.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    dsources: &mut [&mut [f32]],
    dq: &mut [f32],
    dgamma: &mut [f32],
    dh: &[f32],
    sources: &[&[f32]],
    rstds: &[&[f32]],
    alpha: &[f32],
    logits: &[f32],
    q: &[f32],
    gamma: &[f32],
    d: usize,
) {
    let k = sources.len();
    let rows = dh.len() / d;
    assert!(dsources.len() == k && dsources.iter().all(|s| s.len() == rows * d));
    let w: Vec<f32> = q.iter().zip(gamma).map(|(a, b)| a * b).collect();
    let dptrs: Vec<SendPtr> = dsources.iter_mut().map(|s| SendPtr(s.as_mut_ptr())).collect();
    // Source gradients are written in place (disjoint rows per task); the gradient of the
    // effective query w = q ⊙ γ is reduced across tasks.
    let dw = par_reduce_rows(rows, k * d, d, |range, dw| {
        let mut da = vec![0.0f32; k];
        for t in range {
            let a = &alpha[t * k..(t + 1) * k];
            let l = &logits[t * k..(t + 1) * k];
            let g = &dh[t * d..(t + 1) * d];
            let mut dh_dot_h = 0.0f32;
            for s in 0..k {
                da[s] = dot(g, &sources[s][t * d..(t + 1) * d]);
                dh_dot_h += a[s] * da[s];
            }
            for s in 0..k {
                let v = &sources[s][t * d..(t + 1) * d];
                let r = rstds[s][t];
                let dl = a[s] * (da[s] - dh_dot_h);
                // SAFETY: row t of source s's gradient (inside it: lengths checked above; the
                // gradients are distinct `&mut` buffers) belongs to this task's rows only.
                let dv = unsafe { dptrs[s].slice(t * d, d) };
                // value path + key path: d(r⟨w,v⟩)/dv = r·w − (r²·logit/d)·v
                let c = dl * r * r * l[s] / d as f32;
                simd::depth_source_grad(dv, dw, g, &w, v, a[s], dl * r, c);
            }
        }
    });
    for j in 0..d {
        dq[j] += dw[j] * gamma[j];
        dgamma[j] += dw[j] * q[j];
    }
}

/// Per token `dh_dot_h = ⟨dh, h⟩` of a consumer's input `h` and its gradient `dh` (the model
/// takes it from the norm's backward instead, while the rows are in cache).
pub fn dh_dot_h(dh: &[f32], h: &[f32], d: usize) -> Vec<f32> {
    let mut out = crate::kernels::zeros(dh.len() / d);
    par_rows_mut(&mut out, 1, |r0, chunk| {
        for (i, o) in chunk.iter_mut().enumerate() {
            let t = r0 + i;
            *o = dot(&dh[t * d..(t + 1) * d], &h[t * d..(t + 1) * d]);
        }
    });
    out
}

/// Per-token 1/rms of `[rows, d]` sources.
pub fn rstd_of(v: &[f32], d: usize, eps: f32) -> Vec<f32> {
    let mut r = vec![0.0; v.len() / d];
    crate::kernels::rmsnorm::rstd(&mut r, v, d, eps);
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{assert_close, fd_check, rand_vec};

    const EPS: f32 = 1e-6;

    /// Forward with each source's 1/rms recomputed from its (possibly perturbed) values.
    fn run(
        srcs: &[Vec<f32>],
        q: &[f32],
        g: &[f32],
        d: usize,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<Vec<f32>>) {
        let rows = srcs[0].len() / d;
        let rs: Vec<Vec<f32>> = srcs.iter().map(|s| rstd_of(s, d, EPS)).collect();
        let k = srcs.len();
        let (mut h, mut a, mut l) = (vec![0.0; rows * d], vec![0.0; rows * k], vec![0.0; rows * k]);
        let sv: Vec<&[f32]> = srcs.iter().map(|s| s.as_slice()).collect();
        let rv: Vec<&[f32]> = rs.iter().map(|s| s.as_slice()).collect();
        forward(&mut h, &mut a, &mut l, &sv, &rv, q, g, d);
        (h, a, l, rs)
    }

    #[test]
    fn forward_matches_definition() {
        let (rows, d, k) = (6, 10, 4);
        let srcs: Vec<Vec<f32>> =
            (0..k).map(|s| rand_vec(rows * d, 40 + s as u64, 1.0 + s as f32)).collect();
        let (q, g) = (rand_vec(d, 50, 1.0), rand_vec(d, 51, 2.0));
        let (h, a, _, _) = run(&srcs, &q, &g, d);
        for t in 0..rows {
            let logit: Vec<f64> = srcs
                .iter()
                .map(|v| {
                    let v = &v[t * d..(t + 1) * d];
                    let ms = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / d as f64;
                    let r = 1.0 / (ms + EPS as f64).sqrt();
                    (0..d).map(|j| q[j] as f64 * g[j] as f64 * v[j] as f64 * r).sum()
                })
                .collect();
            let z: f64 = logit.iter().map(|x| x.exp()).sum();
            let want_a: Vec<f32> = logit.iter().map(|x| (x.exp() / z) as f32).collect();
            assert_close(&a[t * k..(t + 1) * k], &want_a, 1e-5, "alpha");
            let want_h: Vec<f32> =
                (0..d).map(|j| (0..k).map(|s| want_a[s] * srcs[s][t * d + j]).sum()).collect();
            assert_close(&h[t * d..(t + 1) * d], &want_h, 1e-5, "h");
        }
    }

    #[test]
    fn zero_query_gives_uniform_average() {
        let (rows, d, k) = (3, 8, 5);
        let srcs: Vec<Vec<f32>> = (0..k).map(|s| rand_vec(rows * d, 60 + s as u64, 1.0)).collect();
        let (h, a, _, _) = run(&srcs, &vec![0.0; d], &vec![1.0; d], d);
        assert!(a.iter().all(|x| (x - 0.2).abs() < 1e-7));
        let avg: Vec<f32> =
            (0..rows * d).map(|i| srcs.iter().map(|s| s[i]).sum::<f32>() / k as f32).collect();
        assert_close(&h, &avg, 1e-6, "uniform average");
    }

    #[test]
    fn backward_matches_finite_differences() {
        let (rows, d, k) = (4, 6, 3);
        let srcs: Vec<Vec<f32>> = (0..k).map(|s| rand_vec(rows * d, 70 + s as u64, 1.0)).collect();
        let (q, g) = (rand_vec(d, 80, 1.0), rand_vec(d, 81, 1.0));
        let dh = rand_vec(rows * d, 82, 1.0);
        let loss = |srcs: &[Vec<f32>], q: &[f32], g: &[f32]| -> f64 {
            let (h, ..) = run(srcs, q, g, d);
            h.iter().zip(&dh).map(|(a, b)| (a * b) as f64).sum()
        };
        let (_, a, l, rs) = run(&srcs, &q, &g, d);
        let mut ds: Vec<Vec<f32>> = vec![vec![0.0; rows * d]; k];
        let (mut dq, mut dg) = (vec![0.0; d], vec![0.0; d]);
        {
            let mut dsv: Vec<&mut [f32]> = ds.iter_mut().map(|s| s.as_mut_slice()).collect();
            let sv: Vec<&[f32]> = srcs.iter().map(|s| s.as_slice()).collect();
            let rv: Vec<&[f32]> = rs.iter().map(|s| s.as_slice()).collect();
            backward(&mut dsv, &mut dq, &mut dg, &dh, &sv, &rv, &a, &l, &q, &g, d);
        }
        for s in 0..k {
            fd_check(
                &srcs[s],
                &ds[s],
                |x| {
                    let mut p = srcs.clone();
                    p[s] = x.to_vec();
                    loss(&p, &q, &g)
                },
                &format!("depth dsource{s}"),
            );
        }
        fd_check(&q, &dq, |x| loss(&srcs, x, &g), "depth dq");
        fd_check(&g, &dg, |x| loss(&srcs, &q, x), "depth dgamma");
    }
}
