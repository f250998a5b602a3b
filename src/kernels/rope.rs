//! Rotary position embedding in the "rotate half" layout of Hugging Face Llama: dimension `i`
//! of a head pairs with `i + head_dim/2`, frequency `theta^(-2i/head_dim)`, positions from 0.

use super::{par_rows_mut, simd};

/// Positions below this many have their cos/sin precomputed; later ones are computed when
/// used (with the same arithmetic, so the values are identical). This keeps the table small
/// however long the context is.
pub const TABLE_POSITIONS: usize = 8192;

/// Cos/sin tables `[min(max_pos, TABLE_POSITIONS), head_dim/2]` and the inverse frequencies.
pub struct RopeTable {
    pub half: usize,
    /// Positions the tables hold.
    pub len: usize,
    pub inv: Vec<f32>,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(head_dim: usize, max_pos: usize, theta: f64) -> Self {
        let half = head_dim / 2;
        let len = max_pos.min(TABLE_POSITIONS);
        // Computed as Hugging Face does: inverse frequency in f32, angle in f32.
        let inv: Vec<f32> = (0..half)
            .map(|i| (1.0 / theta.powf((2 * i) as f64 / head_dim as f64)) as f32)
            .collect();
        let mut cos = vec![0.0; len * half];
        let mut sin = vec![0.0; len * half];
        for (i, &f) in inv.iter().enumerate() {
            for p in 0..len {
                let ang = p as f32 * f;
                cos[p * half + i] = ang.cos();
                sin[p * half + i] = ang.sin();
            }
        }
        RopeTable { half, len, inv, cos, sin }
    }

    /// Cos and sin at `pos`: from the tables, or computed into `buf` (`2 * half` long) past them.
    fn at<'a>(&'a self, pos: usize, buf: &'a mut [f32]) -> (&'a [f32], &'a [f32]) {
        let half = self.half;
        if pos < self.len {
            return (
                &self.cos[pos * half..(pos + 1) * half],
                &self.sin[pos * half..(pos + 1) * half],
            );
        }
        let (c, s) = buf.split_at_mut(half);
        for ((c, s), &f) in c.iter_mut().zip(s.iter_mut()).zip(&self.inv) {
            let ang = pos as f32 * f;
            *c = ang.cos();
            *s = ang.sin();
        }
        (c, s)
    }
}

/// Where each row of a buffer sits in its sequence.
#[derive(Clone, Copy)]
pub enum Positions<'a> {
    /// Rows are whole sequences of this length laid end to end: row `r` is at `r % len`.
    Packed(usize),
    /// Row `r` is at `pos[r]` (incremental decoding, where rows come from different places).
    Explicit(&'a [usize]),
}

impl Positions<'_> {
    fn of(&self, row: usize) -> usize {
        match self {
            Positions::Packed(len) => row % len,
            Positions::Explicit(pos) => pos[row],
        }
    }
}

/// Rotates, in place, `n_heads` consecutive heads starting at column `col0` of each row of
/// `x` (`[rows, width]`). `inverse` applies the transpose rotation (the backward pass).
pub fn apply(
    x: &mut [f32],
    width: usize,
    col0: usize,
    n_heads: usize,
    positions: Positions,
    table: &RopeTable,
    inverse: bool,
) {
    let half = table.half;
    let hd = 2 * half;
    let sign = if inverse { -1.0 } else { 1.0 };
    par_rows_mut(x, width, |r0, chunk| {
        let mut buf = vec![0.0; 2 * half];
        for (i, row) in chunk.chunks_mut(width).enumerate() {
            let (c, s) = table.at(positions.of(r0 + i), &mut buf);
            simd::rotate_halves(&mut row[col0..col0 + n_heads * hd], c, s, sign);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{assert_close, rand_vec};

    #[test]
    fn matches_rotate_half_definition() {
        let (hd, heads, seq, rows) = (8, 2, 3, 6);
        let t = RopeTable::new(hd, 16, 10000.0);
        let x = rand_vec(rows * heads * hd, 9, 1.0);
        let mut y = x.clone();
        apply(&mut y, heads * hd, 0, heads, Positions::Packed(seq), &t, false);
        let mut want = vec![0.0; x.len()];
        for r in 0..rows {
            let pos = (r % seq) as f64;
            for h in 0..heads {
                let base = r * heads * hd + h * hd;
                for i in 0..hd {
                    let f = pos / 10000f64.powf((2 * (i % (hd / 2))) as f64 / hd as f64);
                    let rot = if i < hd / 2 { -x[base + i + hd / 2] } else { x[base + i - hd / 2] };
                    want[base + i] = (x[base + i] as f64 * f.cos() + rot as f64 * f.sin()) as f32;
                }
            }
        }
        assert_close(&y, &want, 1e-5, "rope");
    }

    #[test]
    fn positions_past_the_table_match_a_full_table() {
        // A context far longer than the table costs no memory and rotates as a full table would.
        let long = RopeTable::new(8, 1 << 40, 10000.0);
        assert_eq!(long.cos.len(), TABLE_POSITIONS * 4);
        let (hd, rows) = (8, 3);
        let pos = [TABLE_POSITIONS - 1, TABLE_POSITIONS, TABLE_POSITIONS + 5000];
        let x = rand_vec(rows * hd, 4, 1.0);
        let mut y = x.clone();
        apply(&mut y, hd, 0, 1, Positions::Explicit(&pos), &long, false);
        let full = RopeTable::new(hd, TABLE_POSITIONS + 5001, 10000.0);
        let mut z = x.clone();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for p in 0..TABLE_POSITIONS + 5001 {
            for &f in &full.inv {
                cos.push((p as f32 * f).cos());
                sin.push((p as f32 * f).sin());
            }
        }
        let full = RopeTable { len: TABLE_POSITIONS + 5001, cos, sin, ..full };
        apply(&mut z, hd, 0, 1, Positions::Explicit(&pos), &full, false);
        assert_eq!(y, z);
    }

    #[test]
    fn inverse_is_the_transpose() {
        // A rotation's backward is its transpose: <R x, y> == <x, Rᵀ y>.
        let (hd, heads, seq, rows) = (6, 3, 4, 8);
        let t = RopeTable::new(hd, seq, 500.0);
        let x = rand_vec(rows * heads * hd, 1, 1.0);
        let y = rand_vec(rows * heads * hd, 2, 1.0);
        let (mut rx, mut rty) = (x.clone(), y.clone());
        apply(&mut rx, heads * hd, 0, heads, Positions::Packed(seq), &t, false);
        apply(&mut rty, heads * hd, 0, heads, Positions::Packed(seq), &t, true);
        let a: f64 = rx.iter().zip(&y).map(|(a, b)| (a * b) as f64).sum();
        let b: f64 = x.iter().zip(&rty).map(|(a, b)| (a * b) as f64).sum();
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
}
