//! A weight matrix kept in block formats, and its product with f32 activations.
//!
//! A matrix is one or more parts stacked by rows (a fused projection such as q/k/v is three
//! tensors, which a GGUF file may store in different formats); every row holds `cols` values.
//! The bytes are borrowed from whatever owns them (a memory-mapped checkpoint, or a buffer).

use super::dot::{dot_f16, dot_f16_many, QuantRows};
use super::formats::Packed;
use super::packed::ROWS;
use super::{dequantize_into, Format};
use crate::kernels::matmul::{gemm_strided, Strided, FEW_ROWS};
use anyhow::{ensure, Result};
use gemm::Parallelism;
use rayon::prelude::*;
use std::ops::{Deref, Range};
use std::sync::Arc;

/// Bytes inside a shared owner (a memory map or a vector), read without a copy.
#[derive(Clone)]
pub struct Bytes {
    owner: Arc<dyn AsRef<[u8]> + Send + Sync>,
    range: Range<usize>,
}

impl Bytes {
    /// `range` of `owner`; an error when it lies outside.
    pub fn new(owner: Arc<dyn AsRef<[u8]> + Send + Sync>, range: Range<usize>) -> Result<Bytes> {
        let len = (*owner).as_ref().len();
        ensure!(
            range.start <= range.end && range.end <= len,
            "bytes {range:?} lie outside a buffer of {len}"
        );
        Ok(Bytes { owner, range })
    }

    pub fn from_vec(v: Vec<u8>) -> Bytes {
        let n = v.len();
        Bytes { owner: Arc::new(v), range: 0..n }
    }
}

impl Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &(*self.owner).as_ref()[self.range.clone()]
    }
}

/// Rows of one tensor in one format.
#[derive(Clone)]
pub struct QuantPart {
    /// The tensor's name (for saving and for errors).
    pub name: String,
    pub format: Format,
    pub rows: usize,
    pub data: Bytes,
    /// The rows regrouped for the products ([`super::packed`]), eight at a time (the last
    /// group padded with zero rows), made by [`QuantMatrix::new`] for every format but F16.
    pub packed: Option<Arc<Vec<u8>>>,
}

impl QuantPart {
    /// A part as a file holds it (not regrouped yet).
    pub fn new(name: String, format: Format, rows: usize, data: Bytes) -> QuantPart {
        QuantPart { name, format, rows, data, packed: None }
    }
}

/// A `[rows, cols]` matrix of quantised parts stacked by rows.
#[derive(Clone)]
pub struct QuantMatrix {
    pub cols: usize,
    pub parts: Vec<QuantPart>,
}

/// Weight rows per task of a product: enough work per task that the pool's overhead stays
/// small, few enough tasks per matrix that two threads share it evenly.
const ROWS_PER_TASK: usize = 32;

/// Weight rows per task where F16 rows go through the f32 product (prefill).
const F16_PRODUCT_ROWS: usize = 128;

impl QuantMatrix {
    /// Checks that every part holds whole rows of `cols` values in its format, and regroups
    /// the rows of every format but F16 for the products.
    pub fn new(cols: usize, mut parts: Vec<QuantPart>) -> Result<QuantMatrix> {
        ensure!(!parts.is_empty(), "a quantised matrix needs at least one part");
        for p in &mut parts {
            let row = p.format.row_bytes(cols).map_err(|e| anyhow::anyhow!("{}: {e}", p.name))?;
            ensure!(
                p.data.len() == p.rows * row,
                "{}: {} rows of {cols} values in {} take {} bytes, not {}",
                p.name,
                p.rows,
                p.format.name(),
                p.rows * row,
                p.data.len()
            );
            if let (Some(how), None) = (&p.format.ops().packed, &p.packed) {
                p.packed = Some(Arc::new(pack(how, p.format, &p.data, p.rows)));
            }
        }
        Ok(QuantMatrix { cols, parts })
    }

    pub fn rows(&self) -> usize {
        self.parts.iter().map(|p| p.rows).sum()
    }

    /// Bytes of all parts.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|p| p.data.len()).sum()
    }

    /// Row `r` as f32 values, appended to `out`.
    pub fn row_into(&self, mut r: usize, out: &mut Vec<f32>) {
        for p in &self.parts {
            if r < p.rows {
                let rb = p.data.len() / p.rows;
                dequantize_into(p.format, &p.data[r * rb..(r + 1) * rb], out);
                return;
            }
            r -= p.rows;
        }
        panic!("row {r} past the matrix's end");
    }

    /// The whole matrix as f32, row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.rows() * self.cols);
        for p in &self.parts {
            dequantize_into(p.format, &p.data, &mut out);
        }
        out
    }

    /// `y = x · Wᵀ` for `n` rows of `x` (`[n, cols]`): `[n, rows]`. The activations are
    /// quantised to Q8_0 per row (llama.cpp's way) for the regrouped parts ([`super::packed`],
    /// eight rows at a time); F16 rows take them in f32. Every token's result has the same
    /// bits whatever `n` is, except in F16 rows past [`FEW_ROWS`] tokens: those take the f32
    /// product, as an f32 model's rows do.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        let k = self.cols;
        assert!(x.len() == n * k, "quantised product: {} activations, not {n} x {k}", x.len());
        let xq = self.parts.iter().any(|p| p.packed.is_some()).then(|| QuantRows::new(x, k));
        // Prefill: eight tokens at a time, then four, interleaved once for every task; the rest
        // one at a time. Each token gets the same bits whichever way.
        let mut batches = Vec::new();
        if let Some(xq) = &xq {
            let mut i = 0;
            for size in [8, 4] {
                while i + size <= n {
                    batches.push((i, xq.interleave(i, size)));
                    i += size;
                }
            }
        }
        let singles = batches.last().map_or(0, |(i, b)| i + b.view().tokens);
        let m = self.rows();
        let mut y = vec![0.0f32; n * m];
        // Each task owns whole weight rows, `r0..r0 + rows`: the same columns of every
        // token's output.
        let mut tasks = Vec::new();
        let mut r0 = 0;
        for p in &self.parts {
            // A regrouped part's tasks take whole groups; F16 rows as the file holds them.
            let (bytes, unit, unit_rows) = match &p.packed {
                Some(g) => (&g[..], g.len() / p.rows.div_ceil(ROWS), ROWS),
                None => (&p.data[..], p.data.len() / p.rows, 1),
            };
            let mut left = p.rows;
            // F16 rows through the f32 product: more rows per task, as each task's product
            // packs the activations again.
            let per_task = match p.packed {
                None if n > FEW_ROWS => F16_PRODUCT_ROWS,
                _ => ROWS_PER_TASK,
            };
            for w in bytes.chunks(unit * (per_task / unit_rows)) {
                let rows = (w.len() / unit * unit_rows).min(left);
                tasks.push(Task { format: p.format, w, rows, r0 });
                (r0, left) = (r0 + rows, left - rows);
            }
        }
        let out = Columns { y: y.as_mut_ptr(), n, m };
        tasks.into_par_iter().for_each(|t| {
            // SAFETY: the tasks' row ranges are disjoint, so no two write the same columns.
            let put = |i: usize, r: usize, v: &[f32]| unsafe { out.put(i, t.r0 + r, v) };
            match (&t.format.ops().packed, &xq) {
                (Some(how), Some(xq)) => {
                    let kernels = &how.kernels;
                    // The last group's padding rows are computed and dropped.
                    let width = t.rows.div_ceil(ROWS) * ROWS;
                    let mut v = vec![0.0f32; 8 * width];
                    for (i, batch) in &batches {
                        let x = batch.view();
                        let v = &mut v[..x.tokens * width];
                        let dot = if x.tokens == 8 { kernels.dot8 } else { kernels.dot4 };
                        dot(t.w, &x, v);
                        for (j, v) in v.chunks_exact(width).enumerate() {
                            put(i + j, 0, &v[..t.rows]);
                        }
                    }
                    for i in singles..n {
                        (kernels.dot)(t.w, &xq.row(i), &mut v[..width]);
                        put(i, 0, &v[..t.rows]);
                    }
                }
                _ if n > FEW_ROWS => {
                    // Prefill: this task's F16 rows converted to f32, then the f32 product
                    // (whose sums run in another order than `dot_f16`'s, as f32 models' do
                    // past the same count).
                    let mut w = vec![0.0f32; t.rows * k];
                    super::dot::f16_to_f32_slice(t.w, &mut w);
                    // SAFETY: the task owns columns `r0..r0 + rows` of every token's output.
                    unsafe { out.product(t.r0, t.rows, x, &w, k) };
                }
                _ => {
                    let x = |i: usize| &x[i * k..(i + 1) * k];
                    by_rows(
                        &t,
                        n,
                        put,
                        |row, i| dot_f16(row, x(i)),
                        // One row at a time, each a single stream through memory.
                        |rows, i| rows.map(|row| dot_f16(row, x(i))),
                        // Two tokens at a time: four would need more registers than AVX2 has.
                        |row, i| {
                            let [[a, b]] = dot_f16_many([row], [x(i), x(i + 1)]);
                            let [[c, d]] = dot_f16_many([row], [x(i + 2), x(i + 3)]);
                            [a, b, c, d]
                        },
                    )
                }
            }
        });
        y
    }
}

/// `rows` rows of `format` blocks (`bytes`, as a file holds them) regrouped eight at a time
/// as `how` lays them out, the last group padded with rows of zeros.
pub(crate) fn pack(how: &Packed, format: Format, bytes: &[u8], rows: usize) -> Vec<u8> {
    let rb = bytes.len() / rows;
    let (bb, blocks) = (format.block_bytes(), rb / format.block_bytes());
    let zero = vec![0u8; bb];
    let mut out = vec![0u8; rows.div_ceil(ROWS) * blocks * how.group_block];
    // In parallel: regrouping a model's matrices takes longer than reading its file.
    out.par_chunks_exact_mut(blocks * how.group_block).enumerate().for_each(|(g, group)| {
        for (b, o) in group.chunks_exact_mut(how.group_block).enumerate() {
            let block = |r: usize| match g * ROWS + r {
                row if row < rows => &bytes[row * rb + b * bb..][..bb],
                _ => &zero[..],
            };
            (how.pack)(std::array::from_fn(block), o);
        }
    });
    out
}

/// A task's F16 rows by `n` tokens, through a kernel's three forms, each
/// giving a row and a token the same bits: `one` (a row, token `i`), `rows4` (four rows, token
/// `i`: decoding, fewer than four tokens) and `tokens4` (a row, tokens `i..i + 4`: prefill).
fn by_rows(
    t: &Task,
    n: usize,
    put: impl Fn(usize, usize, &[f32]),
    one: impl Fn(&[u8], usize) -> f32,
    rows4: impl Fn([&[u8]; 4], usize) -> [f32; 4],
    tokens4: impl Fn(&[u8], usize) -> [f32; 4],
) {
    let rows: Vec<&[u8]> = t.w.chunks_exact(t.w.len() / t.rows).collect();
    if n < 4 {
        let mut v = vec![0.0f32; t.rows];
        for i in 0..n {
            for (r, four) in rows.chunks(4).enumerate() {
                if let &[a, b, c, d] = four {
                    v[4 * r..4 * r + 4].copy_from_slice(&rows4([a, b, c, d], i));
                } else {
                    for (j, w) in four.iter().enumerate() {
                        v[4 * r + j] = one(w, i);
                    }
                }
            }
            put(i, 0, &v);
        }
        return;
    }
    for (r, row) in rows.iter().enumerate() {
        let mut i = 0;
        while i + 4 <= n {
            for (j, y) in tokens4(row, i).into_iter().enumerate() {
                put(i + j, r, &[y]);
            }
            i += 4;
        }
        for i in i..n {
            put(i, r, &[one(row, i)]);
        }
    }
}

/// A product's share of work: `rows` weight rows (`w`, regrouped or as the file holds them)
/// whose outputs are columns `r0..r0 + rows` of every token's.
struct Task<'a> {
    format: Format,
    w: &'a [u8],
    rows: usize,
    r0: usize,
}

/// A product's output `[n, m]`, written by tasks that each own some of its columns.
struct Columns {
    y: *mut f32,
    n: usize,
    m: usize,
}

// SAFETY: tasks on other threads write through the pointer only into columns they own (see
// `put`); the buffer outlives them (the product waits for its tasks).
unsafe impl Sync for Columns {}

impl Columns {
    /// Writes `x · wᵀ` (`x` is `[n, k]`, `w` is `[rows, k]`) to columns `r0..r0 + rows` of
    /// every token's output, with the f32 product on this thread.
    ///
    /// # Safety
    /// No other thread writes or reads those columns meanwhile.
    unsafe fn product(&self, r0: usize, rows: usize, x: &[f32], w: &[f32], k: usize) {
        assert!(r0 + rows <= self.m && x.len() == self.n * k && w.len() == rows * k);
        let (lhs, rhs) = (Strided::rows(x, k), Strided::transposed(w, k));
        // SAFETY: the views lie inside `x` and `w` (checked); the destination, columns
        // `r0..r0 + rows` of `n` rows of `m`, lies inside the buffer (checked) and is ours.
        unsafe {
            let dst = self.y.add(r0);
            gemm_strided(
                self.n,
                rows,
                k,
                dst,
                self.m as isize,
                1,
                false,
                lhs,
                rhs,
                1.0,
                Parallelism::None,
            );
        }
    }

    /// Writes `v` to token `i`'s columns `r..r + v.len()`.
    ///
    /// # Safety
    /// No other thread writes or reads those columns meanwhile.
    unsafe fn put(&self, i: usize, r: usize, v: &[f32]) {
        assert!(
            i < self.n && r + v.len() <= self.m,
            "output ({i}, {r}) past [{}, {}]",
            self.n,
            self.m
        );
        // SAFETY: inside the buffer (checked above); the caller owns these columns.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), self.y.add(i * self.m + r), v.len()) };
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{raw_blocks, values};
    use super::*;

    /// A matrix with a part in every format, row counts in and out of whole groups: each
    /// token's outputs are each part's own kernel (the portable one, as the tasks run on the
    /// pool's threads in the best form, whose bits are the portable ones), and tokens give the
    /// same bits however many run together (six: four through the prefill kernel, two alone).
    #[test]
    fn the_product_is_each_parts_kernel_and_parts_stack() {
        let (k, n) = (256, 6);
        let counts = [8, 13, 3, 40, 9, 16, 5, 24, 11];
        let parts: Vec<QuantPart> = Format::ALL
            .iter()
            .zip(counts)
            .enumerate()
            .map(|(i, (&f, rows))| {
                let bytes = raw_blocks(f, rows * k / f.block_values(), 30 + i as u64);
                QuantPart::new(format!("p{i}"), f, rows, Bytes::from_vec(bytes))
            })
            .collect();
        let m = QuantMatrix::new(k, parts).unwrap();
        let rows = m.rows();
        assert_eq!(rows, counts.iter().sum::<usize>());
        let x = values(n * k, 3);
        let y = m.matmul(&x, n);
        let w = m.dequantize();
        let xq = QuantRows::new(&x, k);
        for i in 0..n {
            let mut r0 = 0;
            for p in &m.parts {
                let want: Vec<f32> = match (&p.format.ops().packed, &p.packed) {
                    (Some(how), Some(packed)) => {
                        let mut v = vec![0.0; p.rows.div_ceil(ROWS) * ROWS];
                        (how.kernels.portable)(packed, &xq.row(i), &mut v);
                        v.truncate(p.rows);
                        v
                    }
                    _ => {
                        let rb = p.data.len() / p.rows;
                        p.data.chunks(rb).map(|row| dot_f16(row, &x[i * k..(i + 1) * k])).collect()
                    }
                };
                for (r, want) in want.iter().enumerate() {
                    let got = y[i * rows + r0 + r];
                    assert_eq!(got.to_bits(), want.to_bits(), "token {i}, {} row {r}", p.name);
                }
                r0 += p.rows;
            }
        }
        for r in 0..rows {
            let mut got = Vec::new();
            m.row_into(r, &mut got);
            assert_eq!(got, w[r * k..(r + 1) * k]);
        }
        // Decoding (fewer than four tokens): each token the same bits.
        for few in [1, 3] {
            let y_few = m.matmul(&x[..few * k], few);
            assert!(y_few.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()), "{few} tokens");
        }
    }

    /// F16 rows past FEW_ROWS tokens (prefill) go through the f32 product: each output is the
    /// exact product of the halves with the activations within f32 rounding, over row counts
    /// that split into tasks with a remainder.
    #[test]
    fn f16_prefill_is_the_f32_product() {
        let (k, rows, n) = (96, 2 * F16_PRODUCT_ROWS + 5, FEW_ROWS + 3);
        let bytes = raw_blocks(Format::F16, rows * k, 8);
        let part = QuantPart::new("w".into(), Format::F16, rows, Bytes::from_vec(bytes));
        let m = QuantMatrix::new(k, vec![part]).unwrap();
        let x = values(n * k, 9);
        let y = m.matmul(&x, n);
        let w = m.dequantize();
        for i in 0..n {
            for r in 0..rows {
                let (xi, wr) = (&x[i * k..(i + 1) * k], &w[r * k..(r + 1) * k]);
                let exact: f64 = xi.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum();
                let size: f64 = xi.iter().zip(wr).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                let bound = k as f64 * f32::EPSILON as f64 * size;
                let got = y[i * rows + r] as f64;
                assert!((got - exact).abs() <= bound, "token {i} row {r}: {got} vs {exact}");
            }
        }
    }

    #[test]
    fn parts_of_the_wrong_size_are_refused() {
        let part = QuantPart::new("w".into(), Format::Q4_0, 2, Bytes::from_vec(vec![0; 35]));
        let e = QuantMatrix::new(32, vec![part.clone()]).err().unwrap().to_string();
        assert!(e.contains("w: 2 rows of 32 values in Q4_0 take 36 bytes, not 35"), "{e}");
        let e = QuantMatrix::new(48, vec![part]).err().unwrap().to_string();
        assert!(e.contains("not a whole number of blocks"), "{e}");
    }
}
