//! The depth attention of Attention Residuals (docs/method.md §3): per token, a softmax over
//! sources with a static pseudo-query `q` and RMS-normalised keys with gain `γ`; values stay raw.
//!
//! ```text
//! logit_i = r_i · ⟨q ⊙ γ, v_i⟩        r_i = 1/sqrt(mean(v_i²) + eps)   (no 1/sqrt(d))
//! α_i     = softmax_i(logit_i)
//! h       = Σ_i α_i · v_i
//! ```
//!
//! Each source's `r_i` (its `rstd`) is computed once per token by the caller (`rmsnorm::rstd`)
//! and shared by every consumer that reads the source. All statistics are f32.
//!
//! This module is what the model runs: the two-phase forward of docs/method.md §7 ([`phase1`],
//! [`phase2`]) and the backward taken per source ([`backward_partial`], [`backward_source`]).
//! [`ablation`] is the one-pass form with the options of §5, which the ablations run in
//! production. `reference` (test builds only) is the plain one-pass form of the method that the
//! tests hold these fast paths equal to.

pub mod ablation;
#[cfg(test)]
pub mod reference;

use super::{dot, par_reduce_rows, par_rows_mut, simd, SendPtr};
use std::mem::MaybeUninit;

/// What phase 1 produced for the `S` consumers of one block (docs/method.md §7), per consumer
/// and token: the logits over the `C` completed sources, their maximum `m1`, the sum
/// `l1 = Σ e^(logit − m1)` and the mix `o1 = Σ e^(logit − m1) · v / l1`. (§7 keeps `o1`
/// unnormalised; dividing the weights by `l1` before mixing is the same sum and spares the
/// block's first consumer, which reads no partial sum, a pass over its input.)
///
/// One value is reused from block to block: decoding runs this for a token or two at a time,
/// where fresh buffers (and the cold allocator state behind them) would cost more than the
/// arithmetic. Only each `o1` is new every block, since phase 2 hands it on as the consumer's
/// input.
#[derive(Default)]
pub struct Phase1 {
    rows: usize,
    completed: usize,
    /// `[S, rows, C]`.
    logits: Vec<f32>,
    /// `[S, rows]`.
    m1: Vec<f32>,
    l1: Vec<f32>,
    /// Per consumer `[rows, d]`.
    o1: Vec<Vec<f32>>,
}

impl Phase1 {
    /// Empty buffers with room for `consumers` consumers of `rows` tokens scoring up to
    /// `completed` sources each, so that later blocks do not reallocate.
    pub fn with_capacity(consumers: usize, rows: usize, completed: usize) -> Phase1 {
        let n = consumers * rows;
        let v = Vec::with_capacity;
        Phase1 {
            rows,
            completed: 0,
            logits: v(n * completed),
            m1: v(n),
            l1: v(n),
            o1: Vec::with_capacity(consumers),
        }
    }

    /// Tokens scored.
    pub fn rows(&self) -> usize {
        self.rows
    }
}

/// Phase 1 of the two-phase computation: the consumers of a block (effective queries
/// `ws = [S, d]`, row c = `q_c ⊙ γ_c`) score the `C` completed sources (`sources = [C, rows, d]`
/// with their 1/rms `rstds = [C, rows]`) in one pass, so each source row is read from memory
/// once per block instead of once per consumer. Overwrites `out`.
pub fn phase1(out: &mut Phase1, sources: &[f32], rstds: &[f32], ws: &[f32], rows: usize, d: usize) {
    let (c, s) = (rstds.len() / rows, ws.len() / d);
    assert!(c * rows == rstds.len() && sources.len() == c * rows * d && s * d == ws.len());
    out.rows = rows;
    out.completed = c;
    // Every value is overwritten below, so only growth needs filling.
    for (v, n) in
        [(&mut out.logits, s * rows * c), (&mut out.m1, s * rows), (&mut out.l1, s * rows)]
    {
        v.resize(n, 0.0);
    }
    out.o1.resize_with(s, Vec::new);
    for o in out.o1.iter_mut() {
        // Written below through raw pointers (no zeroing pass); the length is set after.
        o.clear();
        o.reserve_exact(rows * d);
    }
    let ptrs = [&mut out.logits, &mut out.m1, &mut out.l1].map(|v| SendPtr(v.as_mut_ptr()));
    // The consumers' o1 pointers: on the stack for the usual handful of consumers.
    let mut stack = [SendPtr(std::ptr::null_mut()); 16];
    let heap: Vec<SendPtr>;
    let o1s: &[SendPtr] = if s <= stack.len() {
        for (p, o) in stack.iter_mut().zip(out.o1.iter_mut()) {
            *p = SendPtr(o.as_mut_ptr());
        }
        &stack[..s]
    } else {
        heap = out.o1.iter_mut().map(|o| SendPtr(o.as_mut_ptr())).collect();
        &heap
    };
    let chunk = super::rows_per_task(rows, c * d);
    let tasks = rows.div_ceil(chunk);
    let run = |task: usize| {
        // Scores, then exponentials, of two consumers: on the stack for the usual handful of
        // sources.
        let mut stack = [0.0f32; 64];
        let mut heap = Vec::new();
        let e: &mut [f32] = if 2 * c <= stack.len() {
            &mut stack[..2 * c]
        } else {
            heap.resize(2 * c, 0.0);
            &mut heap
        };
        for t in task * chunk..((task + 1) * chunk).min(rows) {
            // Source i of token t lies at (i·rows + t)·d: a stride of rows·d.
            let first = &sources[t * d..];
            // Consumers two at a time, so that each source load serves both.
            for j0 in (0..s).step_by(2) {
                let pair = (s - j0).min(2);
                let e = &mut e[..pair * c];
                let w = |j: usize| &ws[j * d..(j + 1) * d];
                simd::scores(e, &[w(j0), w(j0 + pair - 1)][..pair], first, rows * d);
                for (r, e) in e.chunks_mut(c).enumerate() {
                    let row = (j0 + r) * rows + t;
                    // SAFETY: entry `row` of m1, l1 and its `c` logits lie inside the buffers
                    // (resized to S·rows·C and S·rows above) and belong to token t, which is this
                    // task's alone.
                    let (lg, m1, l1) = unsafe {
                        (ptrs[0].slice(row * c, c), ptrs[1].slice(row, 1), ptrs[2].slice(row, 1))
                    };
                    let mut m = f32::NEG_INFINITY;
                    for i in 0..c {
                        lg[i] = e[i] * rstds[i * rows + t];
                        m = m.max(lg[i]);
                    }
                    let mut z = 0.0f32;
                    for i in 0..c {
                        e[i] = simd::exp(lg[i] - m);
                        z += e[i];
                    }
                    // Weights divided by their sum: the mix comes out normalised.
                    let inv = 1.0 / z;
                    e.iter_mut().for_each(|x| *x *= inv);
                    m1[0] = m;
                    l1[0] = z;
                }
                // SAFETY: row t of each consumer's o1 lies in its reserved capacity (rows·d) and
                // belongs to this task only; `mixes` writes it in full. Nothing reads the spare
                // capacity meanwhile (the lengths are set after every task ended).
                let mut outs: [&mut [MaybeUninit<f32>]; 2] = [0, 1].map(|r| match r < pair {
                    true => unsafe {
                        std::slice::from_raw_parts_mut(o1s[j0 + r].get().add(t * d).cast(), d)
                    },
                    false => &mut [],
                });
                simd::mixes(&mut outs[..pair], e, first, rows * d);
            }
        }
    };
    if tasks <= 1 {
        // One task: skip the thread pool (decoding scores a handful of tokens).
        (0..tasks).for_each(run);
    } else {
        use rayon::prelude::*;
        (0..tasks).into_par_iter().for_each(run);
    }
    for o in out.o1.iter_mut() {
        // SAFETY: the capacity is rows·d (reserved above) and every row of every consumer's o1
        // was written by `mixes` (a panic in a task would have ended this function first).
        unsafe { o.set_len(rows * d) };
    }
}

/// Phase 2 for consumer `j` of the block that `p1` scored: merges the optional partial-sum
/// source (its values and per-token 1/rms) into the phase-1 statistics by online softmax. Returns the input
/// `h[rows, d]` (made in place of the consumer's `o1`, which it takes). With `weights =
/// (alpha, logits)`, also writes per token the weights `alpha[rows, K]` and logits
/// `logits[rows, K]` over all `K = C (+1)` sources (completed first, partial last), which
/// backward needs; inference passes `None` and skips them.
pub fn phase2(
    weights: Option<(&mut [f32], &mut [f32])>,
    p1: &mut Phase1,
    j: usize,
    partial: Option<(&[f32], &[f32])>,
    w: &[f32],
    d: usize,
) -> Vec<f32> {
    let (rows, c) = (p1.rows, p1.completed);
    let k = c + partial.is_some() as usize;
    let mut h = std::mem::take(&mut p1.o1[j]);
    assert_eq!(h.len(), rows * d, "phase 2 of a consumer runs once per phase 1");
    if partial.is_none() && weights.is_none() {
        // Phase 1 already normalised the mix: it is the input.
        return h;
    }
    let ptrs = weights.map(|(alpha, logits)| {
        assert!(alpha.len() == rows * k && logits.len() == rows * k);
        (SendPtr(alpha.as_mut_ptr()), SendPtr(logits.as_mut_ptr()))
    });
    let (l1_logits, m1, l1) = (
        &p1.logits[j * rows * c..(j + 1) * rows * c],
        &p1.m1[j * rows..(j + 1) * rows],
        &p1.l1[j * rows..(j + 1) * rows],
    );
    par_rows_mut(&mut h, d, |r0, chunk| {
        for (i, hrow) in chunk.chunks_mut(d).enumerate() {
            let t = r0 + i;
            // SAFETY: row t of alpha and logits (inside them: lengths checked above) goes with
            // row t of `h`, which is this task's alone.
            let mut out = ptrs.map(|(a, l)| unsafe { (a.slice(t * k, k), l.slice(t * k, k)) });
            let (mut m, mut z) = (m1[t], l1[t]);
            if let Some((pv, pr)) = partial {
                // h = o1 (normalised by z) and p, weighted by their shares of the merged sum.
                let prow = &pv[t * d..(t + 1) * d];
                let lp = pr[t] * dot(w, prow);
                let mm = m.max(lp);
                let s1 = simd::exp(m - mm) * z;
                let sp = simd::exp(lp - mm);
                z = s1 + sp;
                m = mm;
                simd::axpby(hrow, s1 / z, sp / z, prow);
                if let Some((a, l)) = &mut out {
                    (a[c], l[c]) = (sp / z, lp);
                }
            }
            if let Some((a, l)) = out {
                l[..c].copy_from_slice(&l1_logits[t * c..(t + 1) * c]);
                for (a, l) in a[..c].iter_mut().zip(&l[..c]) {
                    *a = simd::exp(l - m) / z;
                }
            }
        }
    });
    h
}

/// One consumer's share of the backward pass, as the per-source backward reads it.
pub struct ConsumerGrad<'a> {
    /// Gradient of the consumer's input `h`, `[rows, d]`.
    pub dh: &'a [f32],
    /// Per token `⟨dh, h⟩ = Σ_i α_i ⟨dh, v_i⟩`, the softmax-normalisation term.
    pub dh_dot_h: &'a [f32],
    pub alpha: &'a [f32],
    pub logits: &'a [f32],
    /// Sources this consumer read (`K`; the completed ones come first): the row length of
    /// `alpha` and `logits`.
    pub n_sources: usize,
    /// Effective query `q ⊙ γ`.
    pub w: &'a [f32],
}

/// Backward into the source at index `src` of one consumer: the partial sum, which only its
/// own consumer reads. Accumulates into `dv` and the effective-query gradient `dw`.
#[allow(clippy::too_many_arguments)]
pub fn backward_partial(
    dv: &mut [f32],
    dw: &mut [f32],
    g: &ConsumerGrad,
    src: usize,
    v: &[f32],
    rstd: &[f32],
    d: usize,
) {
    let rows = rstd.len();
    let k = g.n_sources;
    assert_eq!(dv.len(), rows * d, "one gradient row per token");
    let dptr = SendPtr(dv.as_mut_ptr());
    let part = par_reduce_rows(rows, d, d, |range, acc| {
        for t in range {
            let (a, l, r) = (g.alpha[t * k + src], g.logits[t * k + src], rstd[t]);
            let (vrow, dh) = (&v[t * d..(t + 1) * d], &g.dh[t * d..(t + 1) * d]);
            let dl = a * (dot(dh, vrow) - g.dh_dot_h[t]);
            // SAFETY: row t of dv (inside it: length checked above) is in this task's row range
            // only.
            let dvrow = unsafe { dptr.slice(t * d, d) };
            simd::depth_source_grad(
                dvrow,
                acc,
                dh,
                g.w,
                vrow,
                a,
                dl * r,
                dl * r * r * l / d as f32,
            );
        }
    });
    dw.iter_mut().zip(&part).for_each(|(a, b)| *a += b);
}

/// The running sums of one completed source's gradient over the consumers taken so far, per
/// token: `acc = Σ_c (α·dh + dl·r·w)` (`[rows, d]`) and `coef = Σ_c dl·logit` (`[rows]`). The
/// gradient is `acc − (r²/d)·coef·v` once every consumer is in. A pipeline stage hands these on
/// to the stage before it, which adds its own consumers: the sum runs in one process's order.
pub struct SourceSums {
    pub acc: Vec<f32>,
    pub coef: Vec<f32>,
}

impl SourceSums {
    /// Adds sums over other consumers (taken apart, so in another order than one pass).
    pub fn add(&mut self, other: &SourceSums) {
        super::add_assign(&mut self.acc, &other.acc);
        super::add_assign(&mut self.coef, &other.coef);
    }
}

/// Tokens per tile in [`backward_source`].
const SOURCE_TILE: usize = 64;

/// Backward into one completed source `v` (with per-token 1/rms `rstd`), taken at once for
/// every consumer that read it, where it sat at column `col` of their weights: returns the
/// source's whole gradient (in `acc`) and accumulates into each consumer's effective-query gradient
/// `dws[c]`. Taking a source's gradient once, when the backward pass reaches it, reads the
/// source once and writes its gradient once, instead of updating it after every block.
///
/// `from`: the sums over consumers taken earlier (by later pipeline stages), to continue.
/// `pass`: how many consumers the whole model's pass takes here, which sets the split of the
/// rows into tasks, so that each `dws[c]` is the same whichever consumers come along.
/// `finish`: the gradient in `acc` (and no `coef`); else the running sums, for the stage
/// before.
#[allow(clippy::too_many_arguments)]
pub fn backward_source(
    dws: &mut [&mut [f32]],
    consumers: &[ConsumerGrad],
    col: usize,
    v: &[f32],
    rstd: &[f32],
    d: usize,
    pass: usize,
    from: Option<&SourceSums>,
    finish: bool,
) -> SourceSums {
    let (rows, s) = (rstd.len(), consumers.len());
    let mut dv: Vec<f32> = Vec::with_capacity(rows * d);
    let mut coefs = if finish { Vec::new() } else { vec![0.0f32; rows] };
    let dptr = SendPtr(dv.as_mut_ptr());
    let cptr = SendPtr(coefs.as_mut_ptr());
    let part = par_reduce_rows(rows, (pass.max(s) + 1) * d, s * d, |range, dw| {
        // Tokens go in tiles, consumer by consumer within a tile: each consumer's `dh` is then
        // read as one run of `SOURCE_TILE` rows rather than one row among many streams, which
        // the hardware prefetches. Every sum still adds its terms in the same order (per token
        // over consumers, per consumer over tokens), so the result is the same bits.
        let mut acc = vec![0.0f32; SOURCE_TILE * d];
        let mut coef = [0.0f32; SOURCE_TILE];
        // Per token of the tile, for the consumer at hand: α, ⟨dh, h⟩ and dl.
        let mut per_token = [[0.0f32; SOURCE_TILE]; 3];
        for t0 in range.clone().step_by(SOURCE_TILE) {
            let t1 = (t0 + SOURCE_TILE).min(range.end);
            let n = t1 - t0;
            let (acc, coef) = (&mut acc[..n * d], &mut coef[..n]);
            match from {
                Some(f) => {
                    acc.copy_from_slice(&f.acc[t0 * d..t1 * d]);
                    coef.copy_from_slice(&f.coef[t0..t1]);
                }
                None => {
                    acc.fill(0.0);
                    coef.fill(0.0);
                }
            }
            let (vt, rt) = (&v[t0 * d..t1 * d], &rstd[t0..t1]);
            for (j, g) in consumers.iter().enumerate() {
                let [alphas, dhh, dls] = &mut per_token;
                for (i, t) in (t0..t1).enumerate() {
                    (alphas[i], dhh[i]) = (g.alpha[t * g.n_sources + col], g.dh_dot_h[t]);
                }
                let (dh, dw) = (&g.dh[t0 * d..t1 * d], &mut dw[j * d..(j + 1) * d]);
                // What this task reads after these rows, for the kernel to prefetch: the next
                // consumer's rows of the tile, or the first consumer's of the next tile.
                let next = match consumers.get(j + 1) {
                    Some(g) => &g.dh[t0 * d..t1 * d],
                    None => &consumers[0].dh[t1 * d..(t1 + n).min(range.end) * d],
                };
                let x = simd::SourceRows {
                    dh,
                    v: vt,
                    w: g.w,
                    a: &alphas[..n],
                    dhh: &dhh[..n],
                    r: rt,
                    next,
                };
                simd::source_tile(acc, dw, &mut dls[..n], &x);
                for (i, t) in (t0..t1).enumerate() {
                    coef[i] += dls[i] * g.logits[t * g.n_sources + col];
                }
            }
            for t in t0..t1 {
                let (vrow, i) = (&v[t * d..(t + 1) * d], t - t0);
                let acc = &acc[i * d..(i + 1) * d];
                // SAFETY: row t of `dv` (capacity rows·d), written by this task only (tasks
                // cover disjoint row ranges); `coefs` likewise at t, when kept.
                unsafe {
                    let out = dptr.get().add(t * d);
                    if finish {
                        // value path + key path: dv = Σ_c (α·dh + dl·r·w) − (r²/d)·Σ_c dl·logit · v
                        let c = coef[i] * rstd[t] * rstd[t] / d as f32;
                        for (k, (x, y)) in acc.iter().zip(vrow).enumerate() {
                            out.add(k).write(x - c * y);
                        }
                    } else {
                        std::ptr::copy_nonoverlapping(acc.as_ptr(), out, d);
                        cptr.get().add(t).write(coef[i]);
                    }
                }
            }
        }
    });
    // SAFETY: the capacity is rows·d and every row was written above (a panic in a task would
    // have ended this function first).
    unsafe { dv.set_len(rows * d) };
    for (j, dw) in dws.iter_mut().enumerate() {
        dw.iter_mut().zip(&part[j * d..(j + 1) * d]).for_each(|(a, b)| *a += b);
    }
    SourceSums { acc: dv, coef: coefs }
}

#[cfg(test)]
mod tests {
    use super::reference::{self, rstd_of};
    use super::*;
    use crate::testutil::{assert_close, rand_vec};

    const EPS: f32 = 1e-6;

    /// A block of `s` consumers over `c` completed sources; consumer j > 0 also reads its own
    /// partial sum, as in Block AttnRes.
    struct Case {
        srcs: Vec<Vec<f32>>,
        rs: Vec<Vec<f32>>,
        partials: Vec<Vec<f32>>,
        prs: Vec<Vec<f32>>,
        qs: Vec<Vec<f32>>,
        gs: Vec<Vec<f32>>,
    }

    fn case(rows: usize, d: usize, c: usize, s: usize) -> Case {
        let srcs: Vec<Vec<f32>> =
            (0..c).map(|i| rand_vec(rows * d, 100 + i as u64, 1.0 + i as f32)).collect();
        let partials: Vec<Vec<f32>> =
            (0..s).map(|j| rand_vec(rows * d, 200 + j as u64, 2.0)).collect();
        Case {
            rs: srcs.iter().map(|v| rstd_of(v, d, EPS)).collect(),
            prs: partials.iter().map(|v| rstd_of(v, d, EPS)).collect(),
            srcs,
            partials,
            qs: (0..s).map(|j| rand_vec(d, 300 + j as u64, 1.0)).collect(),
            gs: (0..s).map(|j| rand_vec(d, 400 + j as u64, 1.5)).collect(),
        }
    }

    /// Sources of consumer j: the completed ones, then its partial when j > 0.
    fn sources_of(cs: &Case, j: usize) -> (Vec<&[f32]>, Vec<&[f32]>) {
        let mut v: Vec<&[f32]> = cs.srcs.iter().map(|x| x.as_slice()).collect();
        let mut r: Vec<&[f32]> = cs.rs.iter().map(|x| x.as_slice()).collect();
        if j > 0 {
            v.push(&cs.partials[j]);
            r.push(&cs.prs[j]);
        }
        (v, r)
    }

    #[test]
    fn two_phase_equals_one_pass() {
        // One token (decoding) and many (training, several row tasks).
        for rows in [1, 37] {
            two_phase_case(rows);
        }
    }

    fn two_phase_case(rows: usize) {
        let (d, c, s) = (24, 4, 3);
        let cs = case(rows, d, c, s);
        let ws: Vec<Vec<f32>> =
            (0..s).map(|j| cs.qs[j].iter().zip(&cs.gs[j]).map(|(a, b)| a * b).collect()).collect();
        let (sv, rv) = (cs.srcs.concat(), cs.rs.concat());
        let mut p1 = Phase1::default();
        // Reused buffers must not leak a previous block's results.
        phase1(&mut p1, &sv[..rows * d], &rv[..rows], &ws[0], rows, d);
        phase1(&mut p1, &sv, &rv, &ws.concat(), rows, d);
        let mut hs = Vec::new();
        for j in 0..s {
            let partial = (j > 0).then(|| (cs.partials[j].as_slice(), cs.prs[j].as_slice()));
            let (v, r) = sources_of(&cs, j);
            let k = v.len();
            let (mut a, mut l) = (vec![0.0; rows * k], vec![0.0; rows * k]);
            let h = phase2(Some((&mut a, &mut l)), &mut p1, j, partial, &ws[j], d);
            let (mut h1, mut a1, mut l1) =
                (vec![0.0; rows * d], vec![0.0; rows * k], vec![0.0; rows * k]);
            reference::forward(&mut h1, &mut a1, &mut l1, &v, &r, &cs.qs[j], &cs.gs[j], d);
            assert_close(&h, &h1, 1e-5, "two-phase h");
            assert_close(&a, &a1, 1e-6, "two-phase alpha");
            assert_close(&l, &l1, 1e-6, "two-phase logits");
            hs.push(h);
        }
        // Inference skips the weights: the same inputs.
        phase1(&mut p1, &sv, &rv, &ws.concat(), rows, d);
        for j in 0..s {
            let partial = (j > 0).then(|| (cs.partials[j].as_slice(), cs.prs[j].as_slice()));
            assert_eq!(
                phase2(None, &mut p1, j, partial, &ws[j], d),
                hs[j],
                "inference phase 2 of consumer {j}"
            );
        }
    }

    #[test]
    fn per_source_backward_equals_per_consumer_backward() {
        // Within one tile of tokens, and over several with a ragged last one.
        for rows in [29, 2 * SOURCE_TILE + 5] {
            per_source_case(rows);
        }
    }

    fn per_source_case(rows: usize) {
        let (d, c, s) = (16, 3, 3);
        let cs = case(rows, d, c, s);
        let dhs: Vec<Vec<f32>> = (0..s).map(|j| rand_vec(rows * d, 500 + j as u64, 1.0)).collect();
        // Reference: one-pass forward and backward per consumer.
        let mut want_src = vec![vec![0.0f32; rows * d]; c];
        let mut want_part = vec![vec![0.0f32; rows * d]; s];
        let (mut want_dq, mut want_dg) = (vec![vec![0.0f32; d]; s], vec![vec![0.0f32; d]; s]);
        let mut saved = Vec::new();
        for j in 0..s {
            let (v, r) = sources_of(&cs, j);
            let k = v.len();
            let (mut h, mut a, mut l) =
                (vec![0.0; rows * d], vec![0.0; rows * k], vec![0.0; rows * k]);
            reference::forward(&mut h, &mut a, &mut l, &v, &r, &cs.qs[j], &cs.gs[j], d);
            let mut ds: Vec<&mut [f32]> = want_src.iter_mut().map(|x| x.as_mut_slice()).collect();
            if j > 0 {
                ds.push(want_part[j].as_mut_slice());
            }
            reference::backward(
                &mut ds,
                &mut want_dq[j],
                &mut want_dg[j],
                &dhs[j],
                &v,
                &r,
                &a,
                &l,
                &cs.qs[j],
                &cs.gs[j],
                d,
            );
            saved.push((h, a, l, k));
        }
        // Per source: partials one by one, each completed source once for all its consumers.
        let ws: Vec<Vec<f32>> =
            (0..s).map(|j| cs.qs[j].iter().zip(&cs.gs[j]).map(|(a, b)| a * b).collect()).collect();
        let dh_dot_h: Vec<Vec<f32>> =
            (0..s).map(|j| reference::dh_dot_h(&dhs[j], &saved[j].0, d)).collect();
        let grads: Vec<ConsumerGrad> = (0..s)
            .map(|j| ConsumerGrad {
                dh: &dhs[j],
                dh_dot_h: &dh_dot_h[j],
                alpha: &saved[j].1,
                logits: &saved[j].2,
                n_sources: saved[j].3,
                w: &ws[j],
            })
            .collect();
        let mut got_part = vec![vec![0.0f32; rows * d]; s];
        let mut dws = vec![vec![0.0f32; d]; s];
        for j in 1..s {
            backward_partial(
                &mut got_part[j],
                &mut dws[j],
                &grads[j],
                c,
                &cs.partials[j],
                &cs.prs[j],
                d,
            );
        }
        let got_src: Vec<Vec<f32>> = (0..c)
            .map(|i| {
                let mut dw: Vec<&mut [f32]> = dws.iter_mut().map(|x| x.as_mut_slice()).collect();
                backward_source(&mut dw, &grads, i, &cs.srcs[i], &cs.rs[i], d, s, None, true).acc
            })
            .collect();
        for i in 0..c {
            assert_close(&got_src[i], &want_src[i], 1e-4, "completed source grad");
        }
        for j in 1..s {
            assert_close(&got_part[j], &want_part[j], 1e-4, "partial grad");
        }
        for j in 0..s {
            let dq: Vec<f32> = dws[j].iter().zip(&cs.gs[j]).map(|(a, b)| a * b).collect();
            let dg: Vec<f32> = dws[j].iter().zip(&cs.qs[j]).map(|(a, b)| a * b).collect();
            assert_close(&dq, &want_dq[j], 1e-4, "dq");
            assert_close(&dg, &want_dg[j], 1e-4, "dgamma");
        }
    }
}
