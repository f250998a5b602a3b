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
    /// Length of the softmax statistics the forward pass saves: two values (the row's largest
    /// score and the reciprocal of its sum of exponentials) per row of each head, `[B, H, T, 2]`.
    pub fn stats_len(&self) -> usize {
        self.batch * self.heads * self.seq * 2
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
    /// Every query head maps to a kv head inside the packed row: the kernels' raw-pointer views
    /// rely on it.
    fn check(&self) {
        assert!(
            self.kv_heads > 0 && self.heads.is_multiple_of(self.kv_heads),
            "{} query heads do not split into groups over {} kv heads",
            self.heads,
            self.kv_heads
        );
    }
}

/// Rows per tile: the causal mask lets tile `i` skip every key after its last row, so about
/// half of the score matrix is never computed.
const TILE: usize = 64;

/// Writes into `tile` (rows of stride `s.seq`) the scaled scores of query rows `r0..r1` of head
/// `h` in sequence `b` against keys `0..r1`. Forward and backward both call it, with the same
/// arguments, so backward recomputes the very bits forward had.
fn score_tile(
    tile: &mut [f32],
    qkv: &[f32],
    s: AttnShape,
    b: usize,
    h: usize,
    r0: usize,
    r1: usize,
) {
    let (t, hd, w) = (s.seq, s.head_dim, s.qkv_width());
    let row0 = b * t * w;
    assert!(r1 <= t && r0 < r1 && tile.len() >= (r1 - r0) * t && qkv.len() >= (b + 1) * t * w);
    let kt = Strided { ptr: qkv[row0 + s.k_col(h / s.group())..].as_ptr(), rs: 1, cs: w as isize };
    let q = Strided { ptr: qkv[row0 + r0 * w + h * hd..].as_ptr(), rs: w as isize, cs: 1 };
    // SAFETY: writes rows 0..r1-r0, columns 0..r1 of `tile` (length checked); `q` and `kt` read
    // rows of sequence b inside `qkv` (checked), at columns of head h and its kv head.
    unsafe {
        gemm_strided(
            r1 - r0,
            r1,
            hd,
            tile.as_mut_ptr(),
            t as isize,
            1,
            false,
            q,
            kt,
            1.0 / (hd as f32).sqrt(),
            Parallelism::None,
        );
    }
}

/// Turns `row`'s scores into probabilities in place; returns the statistics that recompute
/// them (see [`backward`]): the largest score and the reciprocal of the sum of exponentials.
fn softmax_row(row: &mut [f32]) -> (f32, f32) {
    let m = simd::max(row);
    let inv_z = 1.0 / simd::exp_shift_sum(row, m);
    simd::scale(row, inv_z);
    (m, inv_z)
}

/// Forward: returns `out[B·T, H·hd]` and the softmax statistics `stats[B, H, T, 2]` (each row's
/// largest score and the reciprocal of its sum of exponentials). The probabilities themselves
/// live only one tile of rows at a time, so memory grows with T, not T²: backward recomputes
/// them from the statistics.
pub fn forward(qkv: &[f32], s: AttnShape) -> (Vec<f32>, Vec<f32>) {
    let (t, hd, w, ow) = (s.seq, s.head_dim, s.qkv_width(), s.out_width());
    s.check();
    assert_eq!(qkv.len(), s.batch * t * w);
    // `out` is written in full by the products below, through raw pointers (no zeroing pass);
    // its length is set after.
    let mut out: Vec<f32> = Vec::with_capacity(s.batch * t * ow);
    let mut stats = super::zeros(s.stats_len());
    let out_ptr = SendPtr(out.as_mut_ptr());
    stats.par_chunks_mut(2 * t).enumerate().for_each(|(bh, st)| {
        let (b, h) = (bh / s.heads, bh % s.heads);
        let v = Strided {
            ptr: qkv[b * t * w + s.v_col(h / s.group())..].as_ptr(),
            rs: w as isize,
            cs: 1,
        };
        let mut tile = vec![0.0f32; TILE.min(t) * t];
        for r0 in (0..t).step_by(TILE) {
            let r1 = (r0 + TILE).min(t);
            score_tile(&mut tile, qkv, s, b, h, r0, r1);
            for (i, row) in (r0..r1).zip(tile.chunks_mut(t)) {
                let (m, inv_z) = softmax_row(&mut row[..=i]);
                row[i + 1..r1].fill(0.0);
                st[2 * i..2 * i + 2].copy_from_slice(&[m, inv_z]);
            }
            // SAFETY: writes rows r0..r1 of sequence b, columns h·hd..(h + 1)·hd of `out`
            // (inside its capacity, B·T·H·hd), which no other task touches: tasks are one per
            // (b, h), and nothing reads `out` while they run. `v` reads inside `qkv`.
            unsafe {
                let dst = out_ptr.get().add(b * t * ow + r0 * ow + h * hd);
                gemm_strided(
                    r1 - r0,
                    hd,
                    r1,
                    dst,
                    ow as isize,
                    1,
                    false,
                    Strided::rows(&tile, t),
                    v,
                    1.0,
                    Parallelism::None,
                );
            }
        }
    });
    // SAFETY: the capacity is B·T·H·hd, and the tasks above wrote every row of every head (a
    // panic in one would have ended this function first).
    unsafe { out.set_len(s.batch * t * ow) };
    (out, stats)
}

/// New tokens of one sequence, as [`forward_cached`] reads them: rows `row0..row0 + len` of the
/// `qkv` buffer sit at positions `start..start + len` of the sequence in cache slot `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub slot: usize,
    pub start: usize,
    pub len: usize,
    pub row0: usize,
}

/// Keys and values of a run of positions that a sequence holds outside its cache slot and
/// reads in place (a start it shares with other sequences): each `[len, KV·hd]`.
#[derive(Clone, Copy, Debug)]
pub struct Segment<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub len: usize,
}

/// Incremental attention against a key/value cache (inference).
///
/// `cache_k` and `cache_v` are `[slots, capacity, KV·hd]`, with `s.batch` = slots and
/// `s.seq` = capacity. Span `i`'s sequence holds its first positions in `shared[i]`'s segments,
/// in order, and the rest in its slot from the slot's start. The new rows' keys and values
/// (already rotated) are first written into their slots; then each new row attends to its own
/// sequence's positions `0..=its position`. Writes `out[rows, H·hd]` for the rows the spans
/// name.
pub fn forward_cached(
    out: &mut [f32],
    qkv: &[f32],
    cache_k: &mut [f32],
    cache_v: &mut [f32],
    spans: &[Span],
    shared: &[Vec<Segment>],
    s: AttnShape,
) {
    let (cap, hd, w, ow) = (s.seq, s.head_dim, s.qkv_width(), s.out_width());
    let kvw = s.kv_heads * hd;
    s.check();
    assert!(cache_k.len() == s.batch * cap * kvw && cache_v.len() == cache_k.len());
    assert_eq!(shared.len(), spans.len(), "one list of shared segments per span");
    let held: Vec<usize> = shared.iter().map(|segs| segs.iter().map(|g| g.len).sum()).collect();
    for (i, sp) in spans.iter().enumerate() {
        assert!(
            sp.slot < s.batch && held[i] <= sp.start && sp.start - held[i] + sp.len <= cap,
            "span {sp:?} outside the cache"
        );
        assert!(
            shared[i]
                .iter()
                .all(|g| g.len > 0 && g.k.len() >= g.len * kvw && g.v.len() >= g.len * kvw),
            "a shared segment shorter than its positions"
        );
        assert!((sp.row0 + sp.len) * w <= qkv.len() && (sp.row0 + sp.len) * ow <= out.len());
        // The tasks below write each span's rows of `out` without a lock.
        assert!(
            spans[..i].iter().all(|o| o.row0 + o.len <= sp.row0 || sp.row0 + sp.len <= o.row0),
            "span {sp:?} overlaps the rows of another"
        );
        for r in 0..sp.len {
            let row = &qkv[(sp.row0 + r) * w..(sp.row0 + r + 1) * w];
            let at = (sp.slot * cap + sp.start - held[i] + r) * kvw;
            cache_k[at..at + kvw].copy_from_slice(&row[s.k_col(0)..s.k_col(0) + kvw]);
            cache_v[at..at + kvw].copy_from_slice(&row[s.v_col(0)..s.v_col(0) + kvw]);
        }
    }
    let (cache_k, cache_v) = (&*cache_k, &*cache_v);
    let scale = 1.0 / (hd as f32).sqrt();
    let out_ptr = SendPtr(out.as_mut_ptr());
    // One task per (span, query head, tile of rows), but a decoding step (one row) takes the
    // query heads that share a key/value head together (up to four), so that each cached key
    // and value is read once for all of them. Where that leaves too few tasks to keep every
    // thread busy (one sequence decoding alone), a group is split over more tasks, which read
    // its keys and values again on threads that would otherwise wait. The numbers do not depend
    // on the grouping.
    let (group, kv) = (s.group(), s.kv_heads);
    let decoding = spans.iter().filter(|sp| sp.len == 1).count() * kv;
    let splits = (2 * rayon::current_num_threads()).div_ceil(decoding.max(1)).clamp(1, group);
    let chunk = group.div_ceil(splits).min(4);
    let tasks: Vec<(usize, usize, usize, usize)> = (0..spans.len())
        .flat_map(|i| {
            let sp = spans[i];
            let decode = (sp.len == 1).then(|| {
                (0..kv).flat_map(move |g| {
                    (0..group)
                        .step_by(chunk)
                        .map(move |c| (i, g * group + c, (group - c).min(chunk), 0))
                })
            });
            let tiles = (sp.len > 1).then(|| {
                (0..s.heads)
                    .flat_map(move |h| (0..sp.len).step_by(TILE).map(move |r0| (i, h, 1, r0)))
            });
            decode.into_iter().flatten().chain(tiles.into_iter().flatten())
        })
        .collect();
    tasks.par_iter().for_each(|&(i, h, nh, r0)| {
        let sp = spans[i];
        let r1 = (r0 + TILE).min(sp.len);
        let keys = sp.start + r1;
        let head = (h / s.group()) * hd;
        // The positions the tile sees, as runs of keys and values (`[n, KV·hd]` from this
        // head's columns): the shared segments, then the slot.
        let own = sp.slot * cap * kvw + head;
        let pieces: Vec<(&[f32], &[f32], usize)> = shared[i]
            .iter()
            .map(|g| (&g.k[head..], &g.v[head..], g.len))
            .chain(std::iter::once((&cache_k[own..], &cache_v[own..], keys - held[i])))
            .collect();
        if r1 - r0 == 1 {
            // One query row (a decoding step) of `nh` heads: their scores and their mixes read
            // each cached key and value row once, straight from the cache, where `gemm` would
            // first pack them. Each head's numbers are those it gets alone.
            let at = (sp.row0 + r0) * w + h * hd;
            let qs: Vec<&[f32]> = (0..nh).map(|r| &qkv[at + r * hd..at + (r + 1) * hd]).collect();
            // `[nh, keys]`; a piece's part of it goes through `part` (`[nh, n]`, as the
            // kernels take it).
            let mut scores = vec![0.0f32; nh * keys];
            let mut part = Vec::new();
            let mut from = 0;
            for &(k, _, n) in &pieces {
                part.resize(nh * n, 0.0);
                simd::scores(&mut part, &qs, k, kvw);
                for (r, p) in part.chunks_exact(n).enumerate() {
                    scores[r * keys + from..r * keys + from + n].copy_from_slice(p);
                }
                from += n;
            }
            for row in scores.chunks_exact_mut(keys) {
                simd::scale(row, scale);
                softmax_row(row);
            }
            // SAFETY: row sp.row0 + r0, columns h·hd..(h + nh)·hd of `out`: inside it (checked
            // above) and this task's alone, as below. Viewing initialised f32s as maybe-
            // uninitialised ones is sound: `mixes` only writes them.
            let mut dsts: Vec<&mut [std::mem::MaybeUninit<f32>]> = (0..nh)
                .map(|r| unsafe {
                    let p = out_ptr.get().add((sp.row0 + r0) * ow + (h + r) * hd);
                    std::slice::from_raw_parts_mut(p.cast::<std::mem::MaybeUninit<f32>>(), hd)
                })
                .collect();
            let mut from = 0;
            for (j, &(_, v, n)) in pieces.iter().enumerate() {
                part.clear();
                for row in scores.chunks_exact(keys) {
                    part.extend_from_slice(&row[from..from + n]);
                }
                from += n;
                if j == 0 {
                    simd::mixes(&mut dsts, &part, v, kvw);
                } else {
                    // SAFETY: written in full by `mixes` above.
                    let mut sums: Vec<&mut [f32]> = dsts
                        .iter_mut()
                        .map(|d| unsafe {
                            &mut *(&mut **d as *mut [std::mem::MaybeUninit<f32>] as *mut [f32])
                        })
                        .collect();
                    // Continuing the sums: a shared start changes no bit of a decoded token.
                    simd::mixes_more(&mut sums, &part, v, kvw);
                }
            }
            return;
        }
        let q = Strided { ptr: qkv[(sp.row0 + r0) * w + h * hd..].as_ptr(), rs: w as isize, cs: 1 };
        let mut scores = vec![0.0f32; (r1 - r0) * keys];
        let mut from = 0;
        for &(k, _, n) in &pieces {
            let kt = Strided { ptr: k.as_ptr(), rs: 1, cs: kvw as isize };
            // SAFETY: writes columns from..from + n of this task's own `scores`; `q` reads
            // inside `qkv`, `kt` n rows of a piece (its length checked above).
            unsafe {
                gemm_strided(
                    r1 - r0,
                    n,
                    hd,
                    scores[from..].as_mut_ptr(),
                    keys as isize,
                    1,
                    false,
                    q,
                    kt,
                    scale,
                    Parallelism::None,
                );
            }
            from += n;
        }
        for (r, row) in scores.chunks_mut(keys).enumerate() {
            let visible = sp.start + r0 + r + 1;
            softmax_row(&mut row[..visible]);
            row[visible..].fill(0.0);
        }
        let mut from = 0;
        for (j, &(_, v, n)) in pieces.iter().enumerate() {
            let v = Strided { ptr: v.as_ptr(), rs: kvw as isize, cs: 1 };
            // SAFETY: writes (j = 0) or adds to (later pieces) rows sp.row0 + r0..r1, columns
            // h·hd..(h + 1)·hd of `out` (inside it, checked above), which no other task
            // touches: spans' rows are disjoint (checked) and tasks are one per (span, head,
            // tile). `v` reads n rows of a piece.
            unsafe {
                let dst = out_ptr.get().add((sp.row0 + r0) * ow + h * hd);
                gemm_strided(
                    r1 - r0,
                    hd,
                    n,
                    dst,
                    ow as isize,
                    1,
                    j > 0,
                    Strided { ptr: scores[from..].as_ptr(), rs: keys as isize, cs: 1 },
                    v,
                    1.0,
                    Parallelism::None,
                );
            }
            from += n;
        }
    });
}

/// Backward: overwrites `dqkv[B·T, (H+2KV)·hd]` from `dout[B·T, H·hd]`, using the saved `qkv`
/// (after rotary embedding) and `stats`. Each tile of probabilities is recomputed from the
/// statistics exactly as forward computed it (the same products, the same exponentials), so
/// the gradient is the one the saved probabilities would give, bit for bit.
pub fn backward(dqkv: &mut [f32], dout: &[f32], qkv: &[f32], stats: &[f32], s: AttnShape) {
    let (t, hd, w, ow) = (s.seq, s.head_dim, s.qkv_width(), s.out_width());
    s.check();
    assert!(
        qkv.len() == s.batch * t * w
            && dqkv.len() == qkv.len()
            && dout.len() == s.batch * t * ow
            && stats.len() == s.stats_len()
    );
    let scale = 1.0 / (hd as f32).sqrt();
    // The tasks of one sequence share its rows, each writing its own columns: no task may hold
    // a `&mut` to a whole row, so every write goes through this pointer, to the task's columns.
    let dptr = SendPtr(dqkv.as_mut_ptr());
    // One task per (batch, kv head): the query heads of a group all add into the same dK, dV.
    (0..s.batch * s.kv_heads).into_par_iter().for_each(|task| {
        let (b, kvh) = (task / s.kv_heads, task % s.kv_heads);
        let row0 = b * t * w;
        // Columns this task alone writes, in the t rows of sequence b: the q columns of its
        // group's heads (overwritten by the dQ products below), the k and v columns of its kv
        // head (zeroed here, then accumulated into).
        for r in 0..t {
            for col in [s.k_col(kvh), s.v_col(kvh)] {
                // SAFETY: `hd` values at column `col` of row r of sequence b: inside `dqkv`
                // (length checked above) and written by this task only (see above).
                unsafe { dptr.slice(row0 + r * w + col, hd) }.fill(0.0);
            }
        }
        let (mut pt, mut ds) = (vec![0.0f32; TILE.min(t) * t], vec![0.0f32; TILE.min(t) * t]);
        let k = Strided { ptr: qkv[row0 + s.k_col(kvh)..].as_ptr(), rs: w as isize, cs: 1 };
        let vt = Strided { ptr: qkv[row0 + s.v_col(kvh)..].as_ptr(), rs: 1, cs: w as isize };
        for h in kvh * s.group()..(kvh + 1) * s.group() {
            let st = &stats[(b * s.heads + h) * 2 * t..(b * s.heads + h + 1) * 2 * t];
            for r0 in (0..t).step_by(TILE) {
                let (r1, rows) = ((r0 + TILE).min(t), (r0 + TILE).min(t) - r0);
                score_tile(&mut pt, qkv, s, b, h, r0, r1);
                for (i, row) in (r0..r1).zip(pt.chunks_mut(t)) {
                    let (m, inv_z) = (st[2 * i], st[2 * i + 1]);
                    simd::exp_shift_scale(&mut row[..=i], m, inv_z);
                    row[i + 1..r1].fill(0.0);
                }
                let dout_h = Strided {
                    ptr: dout[b * t * ow + r0 * ow + h * hd..].as_ptr(),
                    rs: ow as isize,
                    cs: 1,
                };
                let q =
                    Strided { ptr: qkv[row0 + r0 * w + h * hd..].as_ptr(), rs: w as isize, cs: 1 };
                // SAFETY: writes this task's own `ds` (`rows` ≤ TILE rows of t); `dout_h` and `vt`
                // read inside `dout` and `qkv` (lengths checked above).
                unsafe {
                    // dP = dO · Vᵀ for rows r0..r1, keys 0..r1.
                    gemm_strided(
                        rows,
                        r1,
                        hd,
                        ds.as_mut_ptr(),
                        t as isize,
                        1,
                        false,
                        dout_h,
                        vt,
                        1.0,
                        Parallelism::None,
                    );
                }
                for (i, (prow, drow)) in (r0..r1).zip(pt.chunks(t).zip(ds.chunks_mut(t))) {
                    simd::softmax_grad(&mut drow[..=i], prow, scale);
                    drow[i + 1..r1].fill(0.0);
                }
                // SAFETY: the three products write, in rows of sequence b only, the columns of
                // query head h (one of this task's group) and of kv head kvh: this task's
                // columns, through `dptr` (no `&mut` to `dqkv` is live while the tasks run).
                // Every view lies inside its buffer (lengths checked above).
                unsafe {
                    // dQ = dS · K
                    gemm_strided(
                        rows,
                        hd,
                        r1,
                        dptr.get().add(row0 + r0 * w + h * hd),
                        w as isize,
                        1,
                        false,
                        Strided::rows(&ds, t),
                        k,
                        1.0,
                        Parallelism::None,
                    );
                    // dK += dSᵀ · Q
                    gemm_strided(
                        r1,
                        hd,
                        rows,
                        dptr.get().add(row0 + s.k_col(kvh)),
                        w as isize,
                        1,
                        true,
                        Strided::transposed(&ds, t),
                        q,
                        1.0,
                        Parallelism::None,
                    );
                    // dV += Pᵀ · dO
                    gemm_strided(
                        r1,
                        hd,
                        rows,
                        dptr.get().add(row0 + s.v_col(kvh)),
                        w as isize,
                        1,
                        true,
                        Strided::transposed(&pt, t),
                        dout_h,
                        1.0,
                        Parallelism::None,
                    );
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
                            qi.iter().zip(kj).map(|(a, b)| (a * b) as f64).sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|x| (x - m).exp()).sum();
                    for (j, sc) in scores.iter().enumerate() {
                        let vj = &qkv[(b * t + j) * w + (s.heads + s.kv_heads + kvh) * hd..][..hd];
                        for d in 0..hd {
                            out[(b * t + i) * s.out_width() + h * hd + d] +=
                                (((sc - m).exp() / z) * vj[d] as f64) as f32;
                        }
                    }
                }
            }
        }
        out
    }

    const SHAPE: AttnShape = AttnShape { batch: 2, seq: 5, heads: 4, kv_heads: 2, head_dim: 4 };
    /// Longer than one tile, and not a multiple of it.
    const LONG: AttnShape =
        AttnShape { batch: 1, seq: 2 * TILE + 7, heads: 2, kv_heads: 1, head_dim: 4 };

    #[test]
    fn forward_matches_naive_with_gqa() {
        let s = SHAPE;
        let qkv = rand_vec(s.batch * s.seq * s.qkv_width(), 11, 1.5);
        let (out, _) = forward(&qkv, s);
        assert_close(&out, &naive(&qkv, s), 1e-5, "attention forward");
    }

    #[test]
    fn tiled_forward_matches_naive_beyond_one_tile() {
        let s = LONG;
        let qkv = rand_vec(s.batch * s.seq * s.qkv_width(), 14, 1.5);
        let (out, _) = forward(&qkv, s);
        assert_close(&out, &naive(&qkv, s), 1e-5, "attention forward (long)");
    }

    #[test]
    fn tiled_backward_matches_finite_differences_beyond_one_tile() {
        let s = LONG;
        let qkv = rand_vec(s.batch * s.seq * s.qkv_width(), 15, 1.0);
        let dout = rand_vec(s.batch * s.seq * s.out_width(), 16, 1.0);
        let (_, p) = forward(&qkv, s);
        let mut d = vec![f32::NAN; qkv.len()];
        backward(&mut d, &dout, &qkv, &p, s);
        let loss = |x: &[f32]| {
            let (out, _) = forward(x, s);
            out.iter().zip(&dout).map(|(a, b)| (a * b) as f64).sum::<f64>()
        };
        let idx: Vec<usize> = (0..qkv.len()).step_by(37).collect();
        crate::testutil::fd_check_at(&qkv, &d, loss, "attention dqkv (long)", &idx, 1e-2);
    }

    /// Feeds two sequences of `qkv` (`[2, T, width]`) through a cache in the same calls, as a
    /// batch does: slot `b` from position `from[b]` (slot 0's earlier positions read from
    /// `segs`), `first[b]` tokens in the first call and then one at a time. Returns the output
    /// rows by position, the ones never computed taken from `fill`.
    fn feed_in_steps(
        qkv: &[f32],
        s: AttnShape,
        from: [usize; 2],
        first: [usize; 2],
        segs: &[Segment],
        fill: &[f32],
    ) -> Vec<f32> {
        let (t, w, ow, kvw) = (s.seq, s.qkv_width(), s.out_width(), s.kv_heads * s.head_dim);
        let (mut ck, mut cv) = (vec![0.0; s.batch * t * kvw], vec![0.0; s.batch * t * kvw]);
        let mut got = fill.to_vec();
        let mut pos = from;
        let mut step = 0;
        while pos != [t, t] {
            let (mut spans, mut rows, mut shared) = (Vec::new(), Vec::new(), Vec::new());
            for slot in 0..2 {
                let len = if step == 0 { first[slot] } else { 1.min(t - pos[slot]) };
                if len > 0 {
                    spans.push(Span { slot, start: pos[slot], len, row0: rows.len() / w });
                    let at = slot * t + pos[slot];
                    rows.extend_from_slice(&qkv[at * w..(at + len) * w]);
                    shared.push(if slot == 0 { segs.to_vec() } else { Vec::new() });
                }
            }
            let mut out = vec![0.0; rows.len() / w * ow];
            forward_cached(&mut out, &rows, &mut ck, &mut cv, &spans, &shared, s);
            for sp in &spans {
                let dst = (sp.slot * t + sp.start) * ow;
                got[dst..dst + sp.len * ow]
                    .copy_from_slice(&out[sp.row0 * ow..(sp.row0 + sp.len) * ow]);
                pos[sp.slot] += sp.len;
            }
            step += 1;
        }
        got
    }

    /// Feeding a sequence in pieces through the cache gives what full causal attention gives:
    /// slot 0 a long prefill and then single tokens, slot 1 other cuts.
    #[test]
    fn cached_matches_full_attention_in_pieces() {
        let s = AttnShape { batch: 2, seq: TILE + 9, heads: 4, kv_heads: 2, head_dim: 4 };
        let qkv = rand_vec(s.batch * s.seq * s.qkv_width(), 21, 1.5);
        let want = naive(&qkv, s);
        let got = feed_in_steps(&qkv, s, [0, 0], [TILE + 2, 3], &[], &vec![f32::NAN; want.len()]);
        assert_close(&got, &want, 1e-5, "cached attention");
    }

    /// A sequence whose first positions are read in place from shared segments (two, of
    /// different lengths) attends as if they were in its slot: a prefill tile over them, then
    /// single tokens, against full causal attention; and each single token bit for bit as with
    /// the whole sequence in the slot. The other slot holds a sequence of its own.
    #[test]
    fn shared_segments_read_as_the_slot_would() {
        let s = AttnShape { batch: 2, seq: 2 * TILE + 12, heads: 4, kv_heads: 2, head_dim: 16 };
        let (t, w, ow, kvw) = (s.seq, s.qkv_width(), s.out_width(), s.kv_heads * s.head_dim);
        let qkv = rand_vec(s.batch * t * w, 23, 1.5);
        let want = naive(&qkv, s);
        // Keys and values of positions `range` of slot 0, as a segment keeps them.
        let keep = |range: std::ops::Range<usize>| -> (Vec<f32>, Vec<f32>) {
            let rows = || range.clone().map(|p| &qkv[p * w..(p + 1) * w]);
            let k = rows().flat_map(|r| r[s.k_col(0)..s.k_col(0) + kvw].to_vec()).collect();
            let v = rows().flat_map(|r| r[s.v_col(0)..s.v_col(0) + kvw].to_vec()).collect();
            (k, v)
        };
        let (a, b) = (5, TILE + 3);
        let (k1, v1) = keep(0..a);
        let (k2, v2) = keep(a..a + b);
        let segs = [Segment { k: &k1, v: &v1, len: a }, Segment { k: &k2, v: &v2, len: b }];
        // Slot 0 prefills up to the same position either way, then decodes one at a time.
        let tile_end = a + b + TILE + 2;
        let shared = feed_in_steps(&qkv, s, [a + b, 0], [TILE + 2, 7], &segs, &want);
        let whole = feed_in_steps(&qkv, s, [0, 0], [tile_end, 7], &[], &want);
        assert_close(&shared, &want, 1e-5, "attention over shared segments");
        let single = tile_end * ow..t * ow;
        assert!(shared[single.clone()] == whole[single], "single tokens differ from the slot's");
    }

    #[test]
    fn backward_matches_finite_differences() {
        let s = SHAPE;
        let qkv = rand_vec(s.batch * s.seq * s.qkv_width(), 12, 1.0);
        let dout = rand_vec(s.batch * s.seq * s.out_width(), 13, 1.0);
        let loss = |x: &[f32]| {
            let (out, _) = forward(x, s);
            out.iter().zip(&dout).map(|(a, b)| (a * b) as f64).sum::<f64>()
        };
        let (_, p) = forward(&qkv, s);
        let mut d = vec![f32::NAN; qkv.len()];
        backward(&mut d, &dout, &qkv, &p, s);
        fd_check(&qkv, &d, loss, "attention dqkv");
    }
}
