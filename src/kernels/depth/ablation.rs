//! The depth attention with the ablation options of docs/method.md §5, in the plain one-pass
//! form: one consumer, `K` sources, per token. This is the ablations' production path (their
//! per-token queries, gates, heads and windows fall outside the two-phase form).
//!
//! ```text
//! logit_{i,g} = r_i · ⟨w_g, v_{i,g}⟩     (r_i = 1/rms(v_i) with key norm, else 1; g = head)
//!             | c_i                      (content-independent: a learned scalar per source)
//! α_{i,g}     = softmax_i(logit_{·,g}) | sigmoid(logit_{i,g}) | logit_{i,g} (dense: the scalar itself)
//! h_g         = Σ_i α_{i,g} · v_{i,g}
//! ```
//!
//! `w` is the effective query (`q ⊙ γ`), the same for every token or one per token (the
//! input-dependent query); heads split the channels into `H` equal groups, each with its own
//! softmax. With one head, key norm, softmax and a static query this is exactly the method
//! (tested against the reference form), which the model runs in its faster two-phase form.

use crate::kernels::{dot, par_reduce_rows, SendPtr};

/// How logits become weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gate {
    Softmax,
    Sigmoid,
    /// The weight is the logit itself (DenseFormer-style static mixing).
    Identity,
}

/// Where the logits come from.
#[derive(Clone, Copy, Debug)]
pub enum Query<'a> {
    /// One effective query `[d]` for every token.
    Static(&'a [f32]),
    /// One effective query per token, `[rows, d]`.
    PerToken(&'a [f32]),
    /// One logit per source, `[K]`, whatever the content (one head only).
    Scalar(&'a [f32]),
}

#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub key_norm: bool,
    pub gate: Gate,
    pub heads: usize,
}

/// Forward: writes `h[rows, d]` and per token the weights and logits `[rows, K, H]`.
/// `rstds[i]` is source i's per-token 1/rms (read only with key norm).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    h: &mut [f32],
    alpha: &mut [f32],
    logits: &mut [f32],
    sources: &[&[f32]],
    rstds: &[&[f32]],
    query: Query,
    o: Options,
    d: usize,
) {
    let (k, nh) = (sources.len(), o.heads);
    let rows = h.len() / d;
    let hd = d / nh;
    assert!(
        k > 0
            && d.is_multiple_of(nh)
            && alpha.len() == rows * k * nh
            && logits.len() == rows * k * nh
    );
    let (hp, ap, lp) =
        (SendPtr(h.as_mut_ptr()), SendPtr(alpha.as_mut_ptr()), SendPtr(logits.as_mut_ptr()));
    // Tasks over disjoint row ranges (nothing to reduce).
    par_reduce_rows(rows, k * d, 0, |range, _| {
        for t in range {
            // SAFETY: row t of h, alpha and logits (inside them: `rows` is h's, the others'
            // lengths are checked above) is in this task's row range only.
            let (hrow, a, l) = unsafe {
                (hp.slice(t * d, d), ap.slice(t * k * nh, k * nh), lp.slice(t * k * nh, k * nh))
            };
            for i in 0..k {
                let v = &sources[i][t * d..(t + 1) * d];
                let r = if o.key_norm { rstds[i][t] } else { 1.0 };
                for g in 0..nh {
                    let cols = g * hd..(g + 1) * hd;
                    l[i * nh + g] = match query {
                        Query::Static(w) => r * dot(&w[cols.clone()], &v[cols]),
                        Query::PerToken(w) => {
                            r * dot(&w[t * d..(t + 1) * d][cols.clone()], &v[cols])
                        }
                        Query::Scalar(c) => c[i],
                    };
                }
            }
            gate_forward(a, l, k, nh, o.gate);
            hrow.fill(0.0);
            for i in 0..k {
                let v = &sources[i][t * d..(t + 1) * d];
                // Slices (not indices) so the loops vectorise.
                for (g, (hg, vg)) in hrow.chunks_mut(hd).zip(v.chunks(hd)).enumerate() {
                    let w = a[i * nh + g];
                    hg.iter_mut().zip(vg).for_each(|(h, x)| *h += w * x);
                }
            }
        }
    });
}

/// Weights from logits for one token (`[K, H]`).
fn gate_forward(a: &mut [f32], l: &[f32], k: usize, nh: usize, gate: Gate) {
    match gate {
        Gate::Softmax => {
            for g in 0..nh {
                let m = (0..k).map(|i| l[i * nh + g]).fold(f32::NEG_INFINITY, f32::max);
                let mut z = 0.0f32;
                for i in 0..k {
                    a[i * nh + g] = (l[i * nh + g] - m).exp();
                    z += a[i * nh + g];
                }
                (0..k).for_each(|i| a[i * nh + g] /= z);
            }
        }
        Gate::Sigmoid => a.iter_mut().zip(l).for_each(|(a, l)| *a = 1.0 / (1.0 + (-l).exp())),
        Gate::Identity => a.copy_from_slice(l),
    }
}

/// Backward: accumulates into each source's gradient `dsources[i]` (`[rows, d]`) and into the
/// query's gradient `dquery` (`[d]` for a static query, `[rows, d]` per token, `[K]` scalar).
#[allow(clippy::too_many_arguments)]
pub fn backward(
    dsources: &mut [&mut [f32]],
    dquery: &mut [f32],
    dh: &[f32],
    sources: &[&[f32]],
    rstds: &[&[f32]],
    alpha: &[f32],
    logits: &[f32],
    query: Query,
    o: Options,
    d: usize,
) {
    let (k, nh) = (sources.len(), o.heads);
    let rows = dh.len() / d;
    let hd = d / nh;
    assert!(dsources.len() == k && dsources.iter().all(|s| s.len() == rows * d));
    let query_len = match query {
        Query::Static(_) => d,
        Query::PerToken(_) => rows * d,
        Query::Scalar(_) => k,
    };
    assert_eq!(dquery.len(), query_len, "query gradient of the query's shape");
    let dptrs: Vec<SendPtr> = dsources.iter_mut().map(|s| SendPtr(s.as_mut_ptr())).collect();
    let qptr = SendPtr(dquery.as_mut_ptr());
    // Static and scalar query gradients are summed over tokens; per-token ones written by row.
    let shared = match query {
        Query::Static(_) => d,
        Query::Scalar(_) => k,
        Query::PerToken(_) => 0,
    };
    let total = par_reduce_rows(rows, k * d, shared, |range, acc| {
        let (mut da, mut ds) = (vec![0.0f32; k * nh], vec![0.0f32; k * nh]);
        for t in range {
            let (a, l) =
                (&alpha[t * k * nh..(t + 1) * k * nh], &logits[t * k * nh..(t + 1) * k * nh]);
            let g_row = &dh[t * d..(t + 1) * d];
            for i in 0..k {
                let v = &sources[i][t * d..(t + 1) * d];
                for g in 0..nh {
                    let cols = g * hd..(g + 1) * hd;
                    da[i * nh + g] = dot(&g_row[cols.clone()], &v[cols]);
                }
            }
            // Gradient of the logits.
            for g in 0..nh {
                match o.gate {
                    Gate::Softmax => {
                        // ⟨dh, h⟩ of this head's channels.
                        let dh_dot_h: f32 = (0..k).map(|i| a[i * nh + g] * da[i * nh + g]).sum();
                        (0..k).for_each(|i| {
                            ds[i * nh + g] = a[i * nh + g] * (da[i * nh + g] - dh_dot_h)
                        });
                    }
                    Gate::Sigmoid => (0..k).for_each(|i| {
                        let s = a[i * nh + g];
                        ds[i * nh + g] = da[i * nh + g] * s * (1.0 - s);
                    }),
                    Gate::Identity => (0..k).for_each(|i| ds[i * nh + g] = da[i * nh + g]),
                }
            }
            // SAFETY: row t of a per-token query gradient (inside it: length checked above) is in
            // this task's row range only.
            let mut dq_row = match query {
                Query::PerToken(_) => Some(unsafe { qptr.slice(t * d, d) }),
                _ => None,
            };
            for i in 0..k {
                let v = &sources[i][t * d..(t + 1) * d];
                // SAFETY: row t of source i's gradient (inside it: lengths checked above; the
                // gradients are distinct `&mut` buffers) is in this task's row range only.
                let dv = unsafe { dptrs[i].slice(t * d, d) };
                let r = if o.key_norm { rstds[i][t] } else { 1.0 };
                // Value path.
                for (g, (dg, gg)) in dv.chunks_mut(hd).zip(g_row.chunks(hd)).enumerate() {
                    let w = a[i * nh + g];
                    dg.iter_mut().zip(gg).for_each(|(x, y)| *x += w * y);
                }
                // Key path.
                let w = match query {
                    Query::Scalar(_) => {
                        acc[i] += ds[i * nh];
                        continue;
                    }
                    Query::Static(w) => w,
                    Query::PerToken(w) => &w[t * d..(t + 1) * d],
                };
                let mut coef = 0.0f32;
                for g in 0..nh {
                    let s = ds[i * nh + g];
                    coef += s * l[i * nh + g];
                    let dq: &mut [f32] = match dq_row.as_deref_mut() {
                        Some(row) => row,
                        None => &mut *acc,
                    };
                    let cols = g * hd..(g + 1) * hd;
                    dv[cols.clone()]
                        .iter_mut()
                        .zip(&w[cols.clone()])
                        .for_each(|(x, y)| *x += s * r * y);
                    dq[cols.clone()].iter_mut().zip(&v[cols]).for_each(|(x, y)| *x += s * r * y);
                }
                if o.key_norm {
                    // Through r = 1/rms(v): dr/dv = −r³·v/d, and Σ_g ds·⟨w_g, v_g⟩ = coef / r.
                    let c = coef * r * r / d as f32;
                    dv.iter_mut().zip(v).for_each(|(x, y)| *x -= c * y);
                }
            }
        }
    });
    dquery.iter_mut().zip(&total).for_each(|(a, b)| *a += b);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::depth::reference::{self, rstd_of};
    use crate::testutil::{assert_close, fd_check, rand_vec};

    const EPS: f32 = 1e-6;

    struct Case {
        srcs: Vec<Vec<f32>>,
        rs: Vec<Vec<f32>>,
        q: Vec<f32>,
        rows: usize,
        d: usize,
    }

    fn case(rows: usize, d: usize, k: usize, qlen: usize) -> Case {
        let srcs: Vec<Vec<f32>> =
            (0..k).map(|i| rand_vec(rows * d, 700 + i as u64, 1.0 + i as f32)).collect();
        let rs = srcs.iter().map(|s| rstd_of(s, d, EPS)).collect();
        Case { srcs, rs, q: rand_vec(qlen, 777, 0.8), rows, d }
    }

    fn query<'a>(kind: &str, q: &'a [f32]) -> Query<'a> {
        match kind {
            "static" => Query::Static(q),
            "token" => Query::PerToken(q),
            _ => Query::Scalar(q),
        }
    }

    /// Runs forward with the sources' 1/rms recomputed from the (possibly perturbed) values.
    fn run(
        srcs: &[Vec<f32>],
        q: &[f32],
        kind: &str,
        o: Options,
        d: usize,
    ) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let rows = srcs[0].len() / d;
        let k = srcs.len();
        let rs: Vec<Vec<f32>> = srcs.iter().map(|s| rstd_of(s, d, EPS)).collect();
        let (mut h, mut a, mut l) =
            (vec![0.0; rows * d], vec![0.0; rows * k * o.heads], vec![0.0; rows * k * o.heads]);
        let sv: Vec<&[f32]> = srcs.iter().map(|s| s.as_slice()).collect();
        let rv: Vec<&[f32]> = rs.iter().map(|s| s.as_slice()).collect();
        forward(&mut h, &mut a, &mut l, &sv, &rv, query(kind, q), o, d);
        (h, a, l)
    }

    #[test]
    fn default_options_equal_the_method() {
        let c = case(9, 12, 4, 12);
        let o = Options { key_norm: true, gate: Gate::Softmax, heads: 1 };
        let (h, a, _) = run(&c.srcs, &c.q, "static", o, c.d);
        let (mut h1, mut a1, mut l1) =
            (vec![0.0; c.rows * c.d], vec![0.0; c.rows * 4], vec![0.0; c.rows * 4]);
        let sv: Vec<&[f32]> = c.srcs.iter().map(|s| s.as_slice()).collect();
        let rv: Vec<&[f32]> = c.rs.iter().map(|s| s.as_slice()).collect();
        reference::forward(&mut h1, &mut a1, &mut l1, &sv, &rv, &c.q, &vec![1.0; c.d], c.d);
        assert_close(&h, &h1, 1e-6, "h");
        assert_close(&a, &a1, 1e-6, "alpha");
    }

    /// Heads: each group of channels is its own single-head depth attention.
    #[test]
    fn heads_are_independent_groups() {
        let (rows, d, k, nh) = (5, 12, 3, 3);
        let c = case(rows, d, k, d);
        let o = Options { key_norm: false, gate: Gate::Softmax, heads: nh };
        let (h, ..) = run(&c.srcs, &c.q, "static", o, d);
        let hd = d / nh;
        for g in 0..nh {
            let part = |v: &[f32]| -> Vec<f32> {
                v.chunks(d).flat_map(|r| r[g * hd..(g + 1) * hd].to_vec()).collect()
            };
            let srcs: Vec<Vec<f32>> = c.srcs.iter().map(|s| part(s)).collect();
            let (hg, ..) =
                run(&srcs, &c.q[g * hd..(g + 1) * hd], "static", Options { heads: 1, ..o }, hd);
            assert_close(&part(&h), &hg, 1e-6, "head");
        }
    }

    #[test]
    fn backward_matches_finite_differences_for_every_option() {
        let (rows, d, k) = (3, 8, 3);
        for (kind, gate, key_norm, heads) in [
            ("static", Gate::Softmax, false, 1),
            ("static", Gate::Sigmoid, true, 1),
            ("static", Gate::Softmax, true, 2),
            ("token", Gate::Softmax, true, 1),
            ("token", Gate::Sigmoid, false, 2),
            ("scalar", Gate::Softmax, true, 1),
            ("scalar", Gate::Identity, true, 1),
        ] {
            let o = Options { key_norm, gate, heads };
            let qlen = match kind {
                "static" => d,
                "token" => rows * d,
                _ => k,
            };
            let c = case(rows, d, k, qlen);
            let dh = rand_vec(rows * d, 999, 1.0);
            let loss = |srcs: &[Vec<f32>], q: &[f32]| -> f64 {
                let (h, ..) = run(srcs, q, kind, o, d);
                h.iter().zip(&dh).map(|(a, b)| (a * b) as f64).sum()
            };
            let (_, a, l) = run(&c.srcs, &c.q, kind, o, d);
            let mut ds = vec![vec![0.0f32; rows * d]; k];
            let mut dq = vec![0.0f32; qlen];
            {
                let mut dsv: Vec<&mut [f32]> = ds.iter_mut().map(|s| s.as_mut_slice()).collect();
                let sv: Vec<&[f32]> = c.srcs.iter().map(|s| s.as_slice()).collect();
                let rv: Vec<&[f32]> = c.rs.iter().map(|s| s.as_slice()).collect();
                backward(&mut dsv, &mut dq, &dh, &sv, &rv, &a, &l, query(kind, &c.q), o, d);
            }
            let tag = format!("{kind} {gate:?} norm={key_norm} heads={heads}");
            for s in 0..k {
                fd_check(
                    &c.srcs[s],
                    &ds[s],
                    |x| {
                        let mut p = c.srcs.clone();
                        p[s] = x.to_vec();
                        loss(&p, &c.q)
                    },
                    &format!("{tag}: dsource{s}"),
                );
            }
            fd_check(&c.q, &dq, |x| loss(&c.srcs, x), &format!("{tag}: dquery"));
        }
    }
}
