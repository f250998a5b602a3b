//! Pure functions on contiguous f32 slices: one forward and one backward per operation.
//!
//! Conventions: activations are row-major `[rows, cols]` with one row per token; weights follow
//! the Hugging Face layout `[out_features, in_features]`. Backward functions *accumulate* into
//! parameter gradients (so several uses of one weight add up) and say in their docs whether they
//! overwrite or accumulate input gradients.

pub mod adamw;
pub mod attention;
pub mod cross_entropy;
pub mod depth;
pub mod embedding;
pub mod matmul;
pub mod quant;
pub mod rmsnorm;
pub mod rope;
pub mod simd;
pub mod swiglu;

use rayon::prelude::*;
use std::mem::MaybeUninit;

/// The processor cores this process may use.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The worker threads to run for a request of `n`: at least 1, and no more than the cores,
/// since threads beyond them only wait on each other (a parallel region is as slow as its last
/// thread, and the cores take turns among them). The second value says when `n` was more than
/// the cores.
pub fn threads_for(n: usize) -> anyhow::Result<(usize, bool)> {
    anyhow::ensure!(n >= 1, "--threads must be at least 1, got {n}");
    let cores = cores();
    Ok((n.min(cores), n > cores))
}

/// Rows handled per parallel task for row-wise kernels: big enough to amortise task overhead.
pub(crate) fn rows_per_task(rows: usize, cols: usize) -> usize {
    let target_elems = 16 * 1024;
    (target_elems / cols.max(1)).clamp(1, rows.max(1))
}

/// Runs `f(first_row, rows_chunk)` over disjoint chunks of the rows of `out` (`cols` wide), in parallel.
pub(crate) fn par_rows_mut<T: Send, F>(out: &mut [T], cols: usize, f: F)
where
    F: Fn(usize, &mut [T]) + Sync + Send,
{
    let rows = out.len() / cols.max(1);
    let chunk = rows_per_task(rows, cols);
    if chunk >= rows {
        // One task: skip the thread pool (decoding runs many such tiny calls).
        return f(0, out);
    }
    out.par_chunks_mut(chunk * cols).enumerate().for_each(|(i, c)| f(i * chunk, c));
}

/// Sums per-task partial vectors of length `n` produced by `f(row_range, acc)` over `rows` rows.
/// Tasks cover fixed row ranges and are summed in order, so the result does not depend on
/// thread scheduling.
pub(crate) fn par_reduce_rows<F>(rows: usize, cols: usize, n: usize, f: F) -> Vec<f32>
where
    F: Fn(std::ops::Range<usize>, &mut [f32]) + Sync + Send,
{
    let chunk = rows_per_task(rows, cols).max(64.min(rows.max(1)));
    let n_tasks = rows.div_ceil(chunk);
    if n_tasks <= 1 {
        let mut acc = vec![0.0f32; n];
        f(0..rows, &mut acc);
        return acc;
    }
    let parts: Vec<Vec<f32>> = (0..n_tasks)
        .into_par_iter()
        .map(|i| {
            let mut acc = vec![0.0f32; n];
            f(i * chunk..((i + 1) * chunk).min(rows), &mut acc);
            acc
        })
        .collect();
    let mut total = vec![0.0f32; n];
    for p in &parts {
        total.iter_mut().zip(p).for_each(|(a, b)| *a += b);
    }
    total
}

/// A new `[rows, cols]` buffer made by `fill(first_row, rows_chunk)`, which runs over chunks as
/// in [`par_rows_mut`]: the same as [`zeros`] followed by [`par_rows_mut`], but each chunk is
/// zeroed right before `fill` runs on it, while it is in cache. For a kernel that overwrites its
/// output, zeroing the whole buffer first would be one more trip through memory for nothing.
pub(crate) fn par_rows_new<F>(rows: usize, cols: usize, fill: F) -> Vec<f32>
where
    F: Fn(usize, &mut [f32]) + Sync + Send,
{
    let n = rows * cols;
    let mut v: Vec<f32> = Vec::with_capacity(n);
    par_rows_mut(&mut v.spare_capacity_mut()[..n], cols, |r0, c| {
        c.fill(MaybeUninit::new(0.0));
        // SAFETY: every element of `c` was written just above.
        fill(r0, unsafe { &mut *(c as *mut [MaybeUninit<f32>] as *mut [f32]) });
    });
    // SAFETY: `par_rows_mut`'s chunks cover all n values, and each was zeroed above.
    unsafe { v.set_len(n) };
    v
}

/// Buffers at least this long are filled by several threads.
const PAR_MIN: usize = 1 << 16;

/// A new buffer of `n` values, each chunk written by `fill(first_index, chunk)` on several
/// threads when large. `fill` must write every element of its chunk.
fn par_build(n: usize, fill: impl Fn(usize, &mut [MaybeUninit<f32>]) + Sync + Send) -> Vec<f32> {
    let mut v: Vec<f32> = Vec::with_capacity(n);
    let spare = &mut v.spare_capacity_mut()[..n];
    if n < PAR_MIN {
        fill(0, spare);
    } else {
        spare.par_chunks_mut(PAR_MIN).enumerate().for_each(|(i, c)| fill(i * PAR_MIN, c));
    }
    // SAFETY: the capacity is n and `fill` wrote all n elements: its callers below write every
    // element of their chunk (`zeros` fills it; `copy` and `sum` zip it with inputs of length n).
    unsafe { v.set_len(n) };
    v
}

/// A zero-filled buffer, filled in parallel when large (the step allocates hundreds of
/// megabytes of activations; filling them on one thread would leave the other cores idle).
pub fn zeros(n: usize) -> Vec<f32> {
    par_build(n, |_, c| c.fill(MaybeUninit::new(0.0)))
}

/// A copy of `src`, made in parallel when large.
pub fn copy(src: &[f32]) -> Vec<f32> {
    par_build(src.len(), |i, c| {
        for (o, x) in c.iter_mut().zip(&src[i..]) {
            o.write(*x);
        }
    })
}

/// `dst += src`, in parallel when large.
pub fn add_assign(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len());
    if dst.len() < PAR_MIN {
        return simd::axpy(dst, 1.0, src);
    }
    dst.par_chunks_mut(PAR_MIN)
        .zip(src.par_chunks(PAR_MIN))
        .for_each(|(d, s)| simd::axpy(d, 1.0, s));
}

/// `a + b` as a new buffer, in one parallel pass when large.
pub fn sum(a: &[f32], b: &[f32]) -> Vec<f32> {
    assert_eq!(a.len(), b.len());
    par_build(a.len(), |i, c| {
        for ((o, x), y) in c.iter_mut().zip(&a[i..]).zip(&b[i..]) {
            o.write(x + y);
        }
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn parallel_builders_match_serial_code() {
        for n in [0, 5, super::PAR_MIN - 1, 3 * super::PAR_MIN + 17] {
            let a: Vec<f32> = (0..n).map(|i| i as f32).collect();
            let b: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
            assert_eq!(super::zeros(n), vec![0.0; n]);
            assert_eq!(super::copy(&a), a);
            let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
            assert_eq!(super::sum(&a, &b), want);
            let mut c = a.clone();
            super::add_assign(&mut c, &b);
            assert_eq!(c, want);
            // Rows of 3 (a chunk is whole rows); a `fill` that skips every other row leaves
            // zeros there, as `zeros` followed by `par_rows_mut` would.
            let rows = n / 3;
            let built = super::par_rows_new(rows, 3, |r0, chunk| {
                for (i, row) in chunk.chunks_mut(3).enumerate() {
                    if (r0 + i) % 2 == 0 {
                        row.copy_from_slice(&a[(r0 + i) * 3..(r0 + i + 1) * 3]);
                    }
                }
            });
            let want: Vec<f32> =
                (0..rows * 3).map(|j| if (j / 3) % 2 == 0 { a[j] } else { 0.0 }).collect();
            assert_eq!(built, want);
        }
    }

    #[test]
    fn thread_counts_are_at_least_one_and_at_most_the_cores() {
        let cores = super::cores();
        assert_eq!(super::threads_for(1).unwrap(), (1, false));
        assert_eq!(super::threads_for(cores).unwrap(), (cores, false));
        for n in [cores + 1, 100_000_000, usize::MAX] {
            assert_eq!(super::threads_for(n).unwrap(), (cores, true));
        }
        let e = super::threads_for(0).unwrap_err().to_string();
        assert_eq!(e, "--threads must be at least 1, got 0");
    }
}

/// A raw pointer that may cross threads, where parallel tasks write provably disjoint parts of
/// a buffer that the borrow checker cannot split: rows of several buffers at once, or columns
/// of rows that several tasks share (attention's backward). The rule every user keeps: a task
/// makes a `&mut` (or writes) only to elements it alone touches while the tasks run, and no
/// `&` or `&mut` to the whole buffer is used meanwhile.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub *mut f32);
// SAFETY: the wrapper is only an address; every access through it is `unsafe` (`slice`, or a
// raw write through `get`) and its caller promises the disjointness above.
unsafe impl Send for SendPtr {}
// SAFETY: as for `Send`: sharing the address between tasks grants no access by itself.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The raw pointer (a method, so closures capture the whole `Send` wrapper).
    pub fn get(self) -> *mut f32 {
        self.0
    }
    /// `len` values from `start`, as a `&mut` slice.
    ///
    /// # Safety
    /// `start..start + len` must lie in the buffer, and no other task may read or write any of
    /// it (nor hold a reference covering it) while the slice lives.
    pub unsafe fn slice<'a>(self, start: usize, len: usize) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.0.add(start), len)
    }
}

pub(crate) use simd::{axpy, dot};

/// The memory's read bandwidth in bytes per second, as a STREAM-like sum over a buffer of
/// 256 MiB (eight times the largest last-level caches of the machines this runs on) by all
/// threads of the pool; the best of three reads, so that one slowed by other work counts less.
pub fn read_bandwidth() -> f64 {
    use rayon::prelude::*;
    const BYTES: usize = 256 << 20;
    let buf: Vec<f32> = (0..BYTES / 4).into_par_iter().map(|i| (i % 251) as f32).collect();
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = std::time::Instant::now();
        // Sixteen independent sums per chunk: the compiler keeps them in vector registers, so
        // the read, not the additions, sets the pace.
        let total: f32 = buf
            .par_chunks(1 << 16)
            .map(|c| {
                let mut acc = [0.0f32; 16];
                for v in c.chunks_exact(16) {
                    for (a, x) in acc.iter_mut().zip(v) {
                        *a += x;
                    }
                }
                acc.iter().sum::<f32>()
            })
            .sum();
        std::hint::black_box(total);
        best = best.min(t.elapsed().as_secs_f64());
    }
    BYTES as f64 / best
}
