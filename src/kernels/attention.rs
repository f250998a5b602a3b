//! Causal multi-head self-attention with grouped-query heads, over a packed `qkv` buffer.
//!
//! `qkv` is `[B·T, (H + 2·KV)·hd]`: query heads, then key heads, then value heads (the order of
//! the fused q/k/v projection). Query head `h` reads key/value head `h / (H / KV)`. Scores are
//! scaled by `1/sqrt(hd)`; row `i` of a sequence attends to positions `0..=i`.

use super::matmul::{gemm_strided, Strided};
use super::{simd, SendPtr};
use gemm::Parallelism;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub batch: usize,
    pub seq: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttnShape {
    pub fn qkv_width(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }
    pub fn out_width(&self) -> usize {
        self.heads * self.head_dim
    }
    /// Length of the saved probabilities buffer `[B, H, T, T]`.
    pub fn probs_len(&self) -> usize {
        self.batch * self.heads * self.seq * self.seq
    }
    fn k_col(&self, kvh: usize) -> usize {
        (self.heads + kvh) * self.head_dim
    }
    fn v_col(&self, kvh: usize) -> usize {
        (self.heads + self.kv_heads + kvh) * self.head_dim
    }
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

/// Rows per tile: the causal mask lets tile `i` skip every key after its last row, so about
/// half of the score matrix is never computed.
const TILE: usize = 64;

/// Forward: writes `out[B·T, H·hd]` and the softmax probabilities `probs[B,H,T,T]`
/// (zero above the diagonal).
pub fn forward(out: &mut [f32], probs: &mut [f32], qkv: &[f32], s: AttnShape) {
    let (t, hd, w, ow) = (s.seq, s.head_dim, s.qkv_width(), s.out_width());
    assert!(qkv.len() == s.batch * t * w && out.len() == s.batch * t * ow && probs.len() == s.probs_len());
    let scale = 1.0 / (hd as f32).sqrt();
    let out_ptr = SendPtr(out.as_mut_ptr());
    probs.par_chunks_mut(t * t).enumerate().for_each(|(bh, p)| {
        let (b, h) = (bh / s.heads, bh % s.heads);
        let kvh = h / s.group();
        let row0 = b * t * w;
        let kt = Strided { ptr: qkv[row0 + s.k_col(kvh)..].as_ptr(), rs: 1, cs: w as isize };
        let v = Strided { ptr: qkv[row0 + s.v_col(kvh)..].as_ptr(), rs: w as isize, cs: 1 };
        for r0 in (0..t).step_by(TILE) {
            let r1 = (r0 + TILE).min(t);
            let q = Strided { ptr: qkv[row0 + r0 * w + h * hd..].as_ptr(), rs: w as isize, cs: 1 };
            let pt = &mut p[r0 * t..r1 * t];
            // SAFETY: each task writes its own probs chunk and its own (b, h) block of `out`.
            unsafe {
                // Scores of rows r0..r1 against keys 0..r1.
                gemm_strided(r1 - r0, r1, hd, pt.as_mut_ptr(), t as isize, 1, false, q, kt, scale, Parallelism::None);
            }
            for (i, row) in (r0..r1).zip(pt.chunks_mut(t)) {
                let m = simd::max(&row[..=i]);
                let z = simd::exp_shift_sum(&mut row[..=i], m);
                simd::scale(&mut row[..=i], 1.0 / z);
                row[i + 1..].fill(0.0);
            }
            unsafe {
                let dst = out_ptr.get().add(b * t * ow + r0 * ow + h * hd);
                gemm_strided(r1 - r0, hd, r1, dst, ow as isize, 1, false, Strided::rows(pt, t), v, 1.0, Parallelism::None);
            }
        }
    });
}

/// Backward: overwrites `dqkv[B·T, (H+2KV)·hd]` from `dout[B·T, H·hd]`, using the saved `qkv`
/// (after rotary embedding) and `probs`.
pub fn backward(dqkv: &mut [f32], dout: &[f32], qkv: &[f32], probs: &[f32], s: AttnShape) {
    let (t, hd, w, ow) = (s.seq, s.head_dim, s.qkv_width(), s.out_width());
    assert!(dqkv.len() == qkv.len() && dout.len() == s.batch * t * ow && probs.len() == s.probs_len());
    let scale = 1.0 / (hd as f32).sqrt();
    let dptr = SendPtr(dqkv.as_mut_ptr());
    // One task per (batch, kv head): the query heads of a group all add into the same dK, dV.
    (0..s.batch * s.kv_heads).into_par_iter().for_each(|task| {
        let (b, kvh) = (task / s.kv_heads, task % s.kv_heads);
        let row0 = b * t * w;
        // SAFETY: this task alone writes rows of batch b in the q columns of its heads and in
        // the k/v columns of its kv head.
        for r in 0..t {
            let row = unsafe { dptr.slice(row0 + r * w, w) };
            row[s.k_col(kvh)..s.k_col(kvh) + hd].fill(0.0);
            row[s.v_col(kvh)..s.v_col(kvh) + hd].fill(0.0);
        }
        let mut ds = vec![0.0f32; TILE * t];
        let k = Strided { ptr: qkv[row0 + s.k_col(kvh)..].as_ptr(), rs: w as isize, cs: 1 };
        let vt = Strided { ptr: qkv[row0 + s.v_col(kvh)..].as_ptr(), rs: 1, cs: w as isize };
        for h in kvh * s.group()..(kvh + 1) * s.group() {
            let p = &probs[(b * s.heads + h) * t * t..(b * s.heads + h + 1) * t * t];
            for r0 in (0..t).step_by(TILE) {
                let (r1, rows) = ((r0 + TILE).min(t), (r0 + TILE).min(t) - r0);
                let pt = &p[r0 * t..r1 * t];
                let dout_h = Strided { ptr: dout[b * t * ow + r0 * ow + h * hd..].as_ptr(), rs: ow as isize, cs: 1 };
                let q = Strided { ptr: qkv[row0 + r0 * w + h * hd..].as_ptr(), rs: w as isize, cs: 1 };
                unsafe {
                    // dP = dO · Vᵀ for rows r0..r1, keys 0..r1.
                    gemm_strided(rows, r1, hd, ds.as_mut_ptr(), t as isize, 1, false, dout_h, vt, 1.0, Parallelism::None);
                }
                for (i, (prow, drow)) in (r0..r1).zip(pt.chunks(t).zip(ds.chunks_mut(t))) {
                    let dot = simd::dot(&prow[..=i], &drow[..=i]);
                    for j in 0..=i {
                        drow[j] = prow[j] * (drow[j] - dot) * scale;
                    }
                    drow[i + 1..r1].fill(0.0);
                }
                unsafe {
                    // dQ = dS · K
                    gemm_strided(rows, hd, r1, dptr.get().add(row0 + r0 * w + h * hd), w as isize, 1, false, Strided::rows(&ds, t), k, 1.0, Parallelism::None);
                    // dK += dSᵀ · Q
                    gemm_strided(r1, hd, rows, dptr.get().add(row0 + s.k_col(kvh)), w as isize, 1, true, Strided::transposed(&ds, t), q, 1.0, Parallelism::None);
                    // dV += Pᵀ · dO
                    gemm_strided(r1, hd, rows, dptr.get().add(row0 + s.v_col(kvh)), w as isize, 1, true, Strided::transposed(pt, t), dout_h, 1.0, Parallelism::None);
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{assert_close, fd_check, rand_vec};

    fn naive(qkv: &[f32], s: AttnShape) -> Vec<f32> {
        let (t, hd, w) = (s.seq, s.head_dim, s.qkv_width());
        let mut out = vec![0.0f32; s.batch * t * s.out_width()];
        for b in 0..s.batch {
            for h in 0..s.heads {
                let kvh = h / (s.heads / s.kv_heads);
                for i in 0..t {
                    let qi = &qkv[(b * t + i) * w + h * hd..][..hd];
                    let scores: Vec<f64> = (0..=i)
                        .map(|j| {
                            let kj = &qkv[(b * t + j) * w + (s.heads + kvh) * hd..][..hd];
                            qi.iter().zip(kj).map(|(a, b)| (a * b) as f64).sum::<f64>() / (hd as f64).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|x| (x - m).exp()).sum();
                    for (j, sc) in scores.iter().enumerate() {
                        let vj = &qkv[(b * t + j) * w + (s.heads + s.kv_heads + kvh) * hd..][..hd];
                        for d in 0..hd {
                            out[(b * t + i) * s.out_width() + h * hd + d] += (((sc - m).exp() / z) * vj[d] as f64) as f32;
                        }
                    }
                }
            }
        }
        out
    }

    const SHAPE: AttnShape = AttnShape { batch: 2, seq: 5, heads: 4, kv_heads: 2, head_dim: 4 };
    /// Longer than one tile, and not a multiple of it.
    const LONG: AttnShape = AttnShape { batch: 1, seq: 2 * TILE + 7, heads: 2, kv_heads: 1, head_dim: 4 };

    #[test]
    fn forward_matches_naive_with_gqa() {
        let s = SHAPE;
        let qkv = rand_vec(s.batch * s.seq * s.qkv_width(), 11, 1.5);
        let mut out = vec![0.0; s.batch * s.seq * s.out_width()];
        let mut p = vec![0.0; s.probs_len()];
        forward(&mut out, &mut p, &qkv, s);
        assert_close(&out, &naive(&qkv, s), 1e-5, "attention forward");
    }

    #[test]
    fn tiled_forward_matches_naive_beyond_one_tile() {
        let s = LONG;
        let qkv = rand_vec(s.batch * s.seq * s.qkv_width(), 14, 1.5);
        let mut out = vec![0.0; s.batch * s.seq * s.out_width()];
        let mut p = vec![f32::NAN; s.probs_len()];
        forward(&mut out, &mut p, &qkv, s);
        assert_close(&out, &naive(&qkv, s), 1e-5, "attention forward (long)");
    }

    #[test]
    fn tiled_backward_matches_finite_differences_beyond_one_tile() {
        let s = LONG;
        let qkv = rand_vec(s.batch * s.seq * s.qkv_width(), 15, 1.0);
        let dout = rand_vec(s.batch * s.seq * s.out_width(), 16, 1.0);
        let mut out = vec![0.0; s.batch * s.seq * s.out_width()];
        let mut p = vec![0.0; s.probs_len()];
        forward(&mut out, &mut p, &qkv, s);
        let mut d = vec![f32::NAN; qkv.len()];
        backward(&mut d, &dout, &qkv, &p, s);
        let loss = |x: &[f32]| {
            let mut out = vec![0.0; s.batch * s.seq * s.out_width()];
            let mut p = vec![0.0; s.probs_len()];
            forward(&mut out, &mut p, x, s);
            out.iter().zip(&dout).map(|(a, b)| (a * b) as f64).sum::<f64>()
        };
        let idx: Vec<usize> = (0..qkv.len()).step_by(37).collect();
        crate::testutil::fd_check_at(&qkv, &d, loss, "attention dqkv (long)", &idx, 1e-2);
    }

    #[test]
    fn backward_matches_finite_differences() {
        let s = SHAPE;
        let qkv = rand_vec(s.batch * s.seq * s.qkv_width(), 12, 1.0);
        let dout = rand_vec(s.batch * s.seq * s.out_width(), 13, 1.0);
        let loss = |x: &[f32]| {
            let mut out = vec![0.0; s.batch * s.seq * s.out_width()];
            let mut p = vec![0.0; s.probs_len()];
            forward(&mut out, &mut p, x, s);
            out.iter().zip(&dout).map(|(a, b)| (a * b) as f64).sum::<f64>()
        };
        let mut out = vec![0.0; s.batch * s.seq * s.out_width()];
        let mut p = vec![0.0; s.probs_len()];
        forward(&mut out, &mut p, &qkv, s);
        let mut d = vec![f32::NAN; qkv.len()];
        backward(&mut d, &dout, &qkv, &p, s);
        fd_check(&qkv, &d, loss, "attention dqkv");
    }
}
