//! Pure functions on contiguous f32 slices: one forward and one backward per operation.
//!
//! Conventions: activations are row-major `[rows, cols]` with one row per token; weights follow
//! the Hugging Face layout `[out_features, in_features]`. Backward functions *accumulate* into
//! parameter gradients (so several uses of one weight add up) and say in their docs whether they
//! overwrite or accumulate input gradients.

pub mod attention;
pub mod cross_entropy;
pub mod depth;
pub mod embedding;
pub mod matmul;
pub mod rmsnorm;
pub mod rope;
pub mod swiglu;

use rayon::prelude::*;

/// Rows handled per parallel task for row-wise kernels: big enough to amortise task overhead.
pub(crate) fn rows_per_task(rows: usize, cols: usize) -> usize {
    let target_elems = 16 * 1024;
    (target_elems / cols.max(1)).clamp(1, rows.max(1))
}

/// Runs `f(first_row, rows_chunk)` over disjoint chunks of the rows of `out` (`cols` wide), in parallel.
pub(crate) fn par_rows_mut<F>(out: &mut [f32], cols: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync + Send,
{
    let rows = out.len() / cols.max(1);
    let chunk = rows_per_task(rows, cols);
    out.par_chunks_mut(chunk * cols)
        .enumerate()
        .for_each(|(i, c)| f(i * chunk, c));
}

/// Sums per-task partial vectors of length `n` produced by `f(row_range)` over `rows` rows.
pub(crate) fn par_reduce_rows<F>(rows: usize, cols: usize, n: usize, f: F) -> Vec<f32>
where
    F: Fn(std::ops::Range<usize>, &mut [f32]) + Sync + Send,
{
    let chunk = rows_per_task(rows, cols).max(64.min(rows.max(1)));
    let n_tasks = rows.div_ceil(chunk);
    (0..n_tasks)
        .into_par_iter()
        .map(|i| {
            let mut acc = vec![0.0f32; n];
            f(i * chunk..((i + 1) * chunk).min(rows), &mut acc);
            acc
        })
        .reduce(
            || vec![0.0f32; n],
            |mut a, b| {
                a.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
                a
            },
        )
}

/// A raw pointer that may cross threads: used where parallel tasks write provably disjoint
/// rows of several buffers at once (the borrow checker cannot split a list of buffers by rows).
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub *mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The raw pointer (a method, so closures capture the whole `Send` wrapper).
    pub fn get(self) -> *mut f32 {
        self.0
    }
    /// # Safety
    /// `start..start+len` must lie in the buffer and no other task may touch it concurrently.
    pub unsafe fn slice<'a>(self, start: usize, len: usize) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(start), len)
    }
}

#[inline]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent accumulators let the compiler vectorise without reassociation flags.
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for j in 0..8 {
            acc[j] += a[c * 8 + j] * b[c * 8 + j];
        }
    }
    let mut s = 0.0f32;
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s + acc.iter().sum::<f32>()
}

#[inline]
pub(crate) fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}
