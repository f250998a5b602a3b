//! A weight matrix kept in block formats, and its product with f32 activations.
//!
//! A matrix is one or more parts stacked by rows (a fused projection such as q/k/v is three
//! tensors, which a GGUF file may store in different formats); every row holds `cols` values.
//! The bytes are borrowed from whatever owns them (a memory-mapped checkpoint, or a buffer).

use super::dot::{
    dot_f16, dot_f16_many, dot_f32, dot_q8, dot_q8_rows4, dot_q8_x4, takes_q8, QuantRows,
};
use super::packed::{self, group_dot, group_dot4};
use super::{dequantize_into, Format};
use anyhow::{ensure, Result};
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
    /// The rows regrouped for the products ([`packed`]), made by [`QuantMatrix::new`] for
    /// Q8_0 and Q4_0 parts of whole groups of eight rows.
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

impl QuantMatrix {
    /// Checks that every part holds whole rows of `cols` values in its format, and regroups
    /// the Q8_0 and Q4_0 parts for the products.
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
            if packed::packs(p.format) && p.rows.is_multiple_of(packed::ROWS) && p.packed.is_none()
            {
                p.packed = Some(Arc::new(packed::pack(p.format, &p.data, p.rows)));
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

    /// `y = x · Wᵀ` for `n` rows of `x` (`[n, cols]`): `[n, rows]`. Rows of Q8_0 and Q4_0 take
    /// the activations quantised to Q8_0 per row (llama.cpp's way): regrouped parts through
    /// [`packed`], eight rows at a time, the rest through [`super::dot`]; the other formats
    /// take the f32 activations. Every token's result has the same bits whatever `n` is.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        let k = self.cols;
        assert!(x.len() == n * k, "quantised product: {} activations, not {n} x {k}", x.len());
        let xq = self.parts.iter().any(|p| takes_q8(p.format)).then(|| QuantRows::new(x, k));
        let m = self.rows();
        let mut y = vec![0.0f32; n * m];
        // Each task owns whole weight rows, `r0..r0 + rows`: the same columns of every
        // token's output.
        let mut tasks = Vec::new();
        let mut r0 = 0;
        for p in &self.parts {
            let rb = p.data.len() / p.rows;
            // A regrouped part's tasks take whole groups of its regrouped bytes.
            let (bytes, per_row) = match &p.packed {
                Some(g) => (&g[..], g.len() / p.rows),
                None => (&p.data[..], rb),
            };
            for w in bytes.chunks(per_row * ROWS_PER_TASK) {
                let rows = w.len() / per_row;
                tasks.push(Task { format: p.format, regrouped: p.packed.is_some(), w, rows, r0 });
                r0 += rows;
            }
        }
        let out = Columns { y: y.as_mut_ptr(), n, m };
        tasks.into_par_iter().for_each(|t| {
            // SAFETY: the tasks' row ranges are disjoint, so no two write the same columns.
            let put = |i: usize, r: usize, v: &[f32]| unsafe { out.put(i, t.r0 + r, v) };
            match &xq {
                Some(xq) if t.regrouped => {
                    // Four tokens at a time (prefill), then one at a time: the same bits.
                    let mut v = vec![0.0f32; 4 * t.rows];
                    let mut i = 0;
                    while i + 4 <= n {
                        let a = [xq.row(i), xq.row(i + 1), xq.row(i + 2), xq.row(i + 3)];
                        group_dot4(t.format, t.w, [&a[0], &a[1], &a[2], &a[3]], &mut v);
                        for (j, v) in v.chunks_exact(t.rows).enumerate() {
                            put(i + j, 0, v);
                        }
                        i += 4;
                    }
                    for i in i..n {
                        group_dot(t.format, t.w, &xq.row(i), &mut v[..t.rows]);
                        put(i, 0, &v[..t.rows]);
                    }
                }
                Some(xq) if takes_q8(t.format) => by_rows(
                    &t,
                    n,
                    put,
                    |row, i| dot_q8(t.format, row, xq.row(i).blocks),
                    |rows, i| {
                        let a = xq.row(i);
                        dot_q8_rows4(t.format, rows, a.blocks, a.scales)
                    },
                    |row, i| {
                        let a = [xq.row(i), xq.row(i + 1), xq.row(i + 2), xq.row(i + 3)];
                        let q = a.each_ref().map(|a| a.blocks);
                        dot_q8_x4(t.format, row, q, a.each_ref().map(|a| a.scales))
                    },
                ),
                _ if t.format == Format::F16 => {
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
                _ => {
                    let rb = t.w.len() / t.rows;
                    for (r, row) in t.w.chunks_exact(rb).enumerate() {
                        for i in 0..n {
                            put(i, r, &[dot_f32(t.format, row, &x[i * k..(i + 1) * k])]);
                        }
                    }
                }
            }
        });
        y
    }
}

/// A task's rows (as the file holds them) by `n` tokens, through a kernel's three forms, each
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
    regrouped: bool,
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
    use super::super::dot::quantize_activations;
    use super::super::packed::Activations;
    use super::super::quantize;
    use super::super::testing::{raw_blocks, values};
    use super::*;

    #[test]
    fn the_product_is_each_rows_dot_and_parts_stack() {
        // Six tokens: four through the prefill kernel, two alone.
        let (k, n) = (64, 6);
        let a = values(40 * k, 1);
        let b = values(70 * k, 2);
        let c = values(12 * k, 4);
        let d = values(9 * k, 6);
        // Q8_0 in whole groups of eight rows (regrouped), Q4_1 (f32 activations), Q4_0 in
        // twelve rows (not whole groups: the per-row kernels), and F16 in nine (four rows at a
        // time, then one).
        let parts = vec![
            QuantPart::new(
                "a".into(),
                Format::Q8_0,
                40,
                Bytes::from_vec(quantize(Format::Q8_0, &a).unwrap()),
            ),
            QuantPart::new(
                "b".into(),
                Format::Q4_1,
                70,
                Bytes::from_vec(quantize(Format::Q4_1, &b).unwrap()),
            ),
            QuantPart::new(
                "c".into(),
                Format::Q4_0,
                12,
                Bytes::from_vec(quantize(Format::Q4_0, &c).unwrap()),
            ),
            QuantPart::new(
                "d".into(),
                Format::F16,
                9,
                Bytes::from_vec(quantize(Format::F16, &d).unwrap()),
            ),
        ];
        let m = QuantMatrix::new(k, parts).unwrap();
        assert!(
            m.parts[0].packed.is_some()
                && m.parts[1].packed.is_none()
                && m.parts[2].packed.is_none()
                && m.parts[3].packed.is_none()
        );
        let rows = m.rows();
        assert_eq!(rows, 131);
        let x = values(n * k, 3);
        let y = m.matmul(&x, n);
        let w = m.dequantize();
        for i in 0..n {
            let xi = &x[i * k..(i + 1) * k];
            let xq = quantize_activations(xi).unwrap();
            let xd: Vec<f32> = xq
                .chunks(34)
                .map(|b| super::super::f16_to_f32(u16::from_le_bytes([b[0], b[1]])))
                .collect();
            let sums: Vec<i32> =
                xq.chunks(34).map(|b| b[2..].iter().map(|&v| v as i8 as i32).sum()).collect();
            let mut grouped = vec![0.0; 40];
            let act = Activations { blocks: &xq, scales: &xd, sums: &sums };
            packed::group_dot_portable(
                Format::Q8_0,
                m.parts[0].packed.as_ref().unwrap(),
                &act,
                &mut grouped,
            );
            for r in 0..rows {
                let (p, rr) = match r {
                    0..40 => (0, r),
                    40..110 => (1, r - 40),
                    110..122 => (2, r - 110),
                    _ => (3, r - 122),
                };
                let part = &m.parts[p];
                let rb = part.data.len() / part.rows;
                let bytes = &part.data[rr * rb..(rr + 1) * rb];
                let want = match p {
                    0 => grouped[rr],
                    1 => dot_f32(part.format, bytes, xi),
                    2 => dot_q8(part.format, bytes, &xq),
                    _ => dot_f16(bytes, xi),
                };
                assert_eq!(y[i * rows + r].to_bits(), want.to_bits(), "row {i}, column {r}");
                let mut got = Vec::new();
                m.row_into(r, &mut got);
                assert_eq!(got, w[r * k..(r + 1) * k]);
            }
        }
        // Decoding kernels (fewer than four tokens) give each token the same bits: a token's
        // result does not depend on what else is in the batch.
        for few in [1, 3] {
            let y_few = m.matmul(&x[..few * k], few);
            assert!(y_few.iter().zip(&y).all(|(a, b)| a.to_bits() == b.to_bits()), "{few} tokens");
        }
    }

    /// Every format, through a one-part matrix of three rows (not a whole group of eight):
    /// each output is its row's product with the token.
    #[test]
    fn every_format_multiplies_as_its_rows_dot() {
        for format in Format::ALL {
            let n = format.block_values();
            let w = raw_blocks(format, 3, 21);
            let x = values(n, 9);
            let part = QuantPart::new("w".into(), format, 3, Bytes::from_vec(w.clone()));
            let y = QuantMatrix::new(n, vec![part]).unwrap().matmul(&x, 1);
            let rb = format.block_bytes();
            for (r, &yr) in y.iter().enumerate() {
                let row = &w[r * rb..(r + 1) * rb];
                let want = if takes_q8(format) {
                    dot_q8(format, row, &quantize_activations(&x).unwrap())
                } else if format == Format::F16 {
                    dot_f16(row, &x)
                } else {
                    dot_f32(format, row, &x)
                };
                assert_eq!(yr.to_bits(), want.to_bits(), "{format:?} row {r}");
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
