//! Matrix products: our own kernels ([`x86`]) on processors with AVX2 and FMA (and
//! AVX-512 where present), the `gemm` crate elsewhere. A Linear layer stores its weight as
//! `[out, in]` (Hugging Face layout), so forward is `Y = X · Wᵀ`.

mod strided;
#[cfg(target_arch = "x86_64")]
pub mod x86;

use gemm::Parallelism;
pub use strided::Strided;

/// How many threads `gemm` may use: all of rayon's for top-level products; one inside a
/// parallel loop.
pub fn threads() -> Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

/// `dst[m,n] = accumulate·dst + alpha · lhs[m,k] · rhs[k,n]` with arbitrary strides.
///
/// # Safety
/// `dst` (m × n with strides `dst_rs`, `dst_cs`), `lhs` (m × k) and `rhs` (k × n) must lie
/// inside live buffers; `dst` must not overlap the inputs; and while this runs nothing else may
/// read or write the elements of `dst` it addresses, nor hold a reference covering them.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_strided(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: isize,
    dst_cs: isize,
    accumulate: bool,
    lhs: Strided,
    rhs: Strided,
    alpha: f32,
    par: Parallelism,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                for c in 0..n {
                    // SAFETY: element (r, c) of `dst`, inside it and ours (the contract above).
                    *dst.offset(r as isize * dst_rs + c as isize * dst_cs) = 0.0;
                }
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(kernel) = x86::chosen() {
        let threads = match par {
            Parallelism::None => 1,
            Parallelism::Rayon(0) => rayon::current_num_threads(),
            Parallelism::Rayon(n) => n,
        };
        // SAFETY: the processor qualifies (just checked), and the contract above is its own.
        return x86::gemm(
            kernel, m, n, k, dst, dst_rs, dst_cs, accumulate, lhs, rhs, alpha, threads,
        );
    }
    // SAFETY: `gemm` reads and writes exactly these views (the contract above).
    gemm::gemm(
        m, n, k, dst, dst_cs, dst_rs, accumulate, lhs.ptr, lhs.cs, lhs.rs, rhs.ptr, rhs.cs, rhs.rs,
        1.0, alpha, false, false, false, par,
    );
}

/// `dst[m,n] (+)= lhs · rhs` for row-major operands, each optionally transposed.
/// `lhs` is `[m,k]` (or `[k,m]` when `lhs_t`), `rhs` is `[k,n]` (or `[n,k]` when `rhs_t`).
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    dst: &mut [f32],
    lhs: &[f32],
    lhs_t: bool,
    rhs: &[f32],
    rhs_t: bool,
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
    par: Parallelism,
) {
    assert!(
        dst.len() >= m * n && lhs.len() >= m * k && rhs.len() >= k * n,
        "matmul: operand too small"
    );
    let l = if lhs_t { Strided::transposed(lhs, m) } else { Strided::rows(lhs, k) };
    let r = if rhs_t { Strided::transposed(rhs, k) } else { Strided::rows(rhs, n) };
    // SAFETY: the views lie inside the operands (sizes checked above, and the transposed views
    // address the same m·k and k·n elements); `dst` is a `&mut` of its own, so it overlaps no
    // input and nothing else touches it.
    unsafe { gemm_strided(m, n, k, dst.as_mut_ptr(), n as isize, 1, accumulate, l, r, 1.0, par) }
}

/// Linear forward into a new buffer: `x[rows, in] · w[out, in]ᵀ`. The product writes every
/// element before it reads any, so the buffer skips the zero-filling pass a `zeros` buffer would
/// take (a training step's products write a few hundred megabytes).
pub fn linear(x: &[f32], w: &[f32], rows: usize, d_in: usize, d_out: usize) -> Vec<f32> {
    if rows <= FEW_ROWS {
        let mut y = super::zeros(rows * d_out);
        linear_forward_few_rows(&mut y, x, w, rows, d_in, d_out);
        return y;
    }
    assert!(x.len() >= rows * d_in && w.len() >= d_in * d_out, "linear: operand too small");
    let mut y: Vec<f32> = Vec::with_capacity(rows * d_out);
    let (l, r) = (Strided::rows(x, d_in), Strided::transposed(w, d_in));
    // SAFETY: the views lie inside `x` and `w` (sizes checked above); `y`'s capacity holds the
    // `rows × d_out` destination, which overlaps neither and which nothing else sees. Without
    // `accumulate` every element of it is written before it is read (`gemm_strided`: the first
    // block of `k`, or zeros when `k` is 0; the `gemm` crate does not read it), so all of it is
    // initialised when the length is set.
    unsafe {
        let dst = y.as_mut_ptr();
        gemm_strided(rows, d_out, d_in, dst, d_out as isize, 1, false, l, r, 1.0, threads());
        y.set_len(rows * d_out);
    }
    y
}

/// Up to this many rows (token-by-token decoding), [`linear`] streams the weight once
/// instead of calling `gemm`, whose packing of the whole weight costs more than so small a
/// product.
pub const FEW_ROWS: usize = 16;

/// `y = x · wᵀ` for a few rows: four weight rows at a time are read from memory once and applied
/// to every input row while they sit in cache. Output features are split across threads when
/// there is enough work to pay for it.
fn linear_forward_few_rows(
    y: &mut [f32],
    x: &[f32],
    w: &[f32],
    rows: usize,
    d_in: usize,
    d_out: usize,
) {
    assert!(
        y.len() >= rows * d_out && x.len() >= rows * d_in && w.len() >= d_in * d_out,
        "linear: operand too small"
    );
    let y_ptr = super::SendPtr(y.as_mut_ptr());
    // Output features j0..j1 for every row; tasks own disjoint feature ranges.
    let run = |j0: usize, j1: usize| {
        let mut out = [[0.0f32; 4]; 2];
        let mut j = j0;
        while j < j1 {
            let width = (j1 - j).min(4);
            let wr = &w[j * d_in..(j + width) * d_in];
            for b in (0..rows).step_by(2) {
                let pair = (rows - b).min(2);
                // SAFETY: features j..j + width of row b + r lie inside `y` (sizes checked
                // above) and in this task's feature range j0..j1, which no other task writes; the
                // slice is dropped before the next one is made.
                let ys = |r: usize| unsafe { y_ptr.slice((b + r) * d_out + j, width) };
                if width == 4 {
                    let xs = [
                        &x[b * d_in..(b + 1) * d_in],
                        &x[(b + pair - 1) * d_in..(b + pair) * d_in],
                    ];
                    super::simd::dot4(&xs[..pair], wr, &mut out);
                    for r in 0..pair {
                        ys(r).copy_from_slice(&out[r]);
                    }
                } else {
                    for r in 0..pair {
                        let xb = &x[(b + r) * d_in..(b + r + 1) * d_in];
                        for (k, yk) in ys(r).iter_mut().enumerate() {
                            *yk = super::simd::dot(xb, &wr[k * d_in..(k + 1) * d_in]);
                        }
                    }
                }
            }
            j += width;
        }
    };
    let threads = rayon::current_num_threads();
    if threads == 1 || rows * d_in * d_out < 1 << 16 {
        return run(0, d_out);
    }
    // A multiple of four features per task, about two tasks per thread.
    let per = d_out.div_ceil(2 * threads).next_multiple_of(4).max(4);
    use rayon::prelude::*;
    (0..d_out.div_ceil(per)).into_par_iter().for_each(|t| run(t * per, ((t + 1) * per).min(d_out)));
}

/// Linear backward into the input: `dx (+)= dy · w`.
pub fn linear_backward_input(
    dx: &mut [f32],
    dy: &[f32],
    w: &[f32],
    rows: usize,
    d_in: usize,
    d_out: usize,
    accumulate: bool,
) {
    matmul(dx, dy, false, w, false, rows, d_out, d_in, accumulate, threads());
}

/// Linear backward into the weight: `dw += dyᵀ · x` (always accumulates).
pub fn linear_backward_weight(
    dw: &mut [f32],
    dy: &[f32],
    x: &[f32],
    rows: usize,
    d_in: usize,
    d_out: usize,
) {
    matmul(dw, dy, true, x, false, d_out, rows, d_in, true, threads());
}

/// Both Linear backward products at once: `dx (+)= dy · w` and `dw += dyᵀ · x`. They are
/// independent and equal in cost, so they run side by side, each on half of the threads: two
/// products with no synchronisation inside either beat two products split across all threads.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward(
    dx: &mut [f32],
    dw: &mut [f32],
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    rows: usize,
    d_in: usize,
    d_out: usize,
    accumulate_dx: bool,
) {
    let half = match rayon::current_num_threads() / 2 {
        0 | 1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    };
    rayon::join(
        || matmul(dx, dy, false, w, false, rows, d_out, d_in, accumulate_dx, half),
        || matmul(dw, dy, true, x, false, d_out, rows, d_in, true, half),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut c = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    c[i * n + j] += a[i * k + p] as f64 * b[p * n + j] as f64;
                }
            }
        }
        c.into_iter().map(|x| x as f32).collect()
    }

    fn transpose(a: &[f32], r: usize, c: usize) -> Vec<f32> {
        let mut t = vec![0.0; r * c];
        for i in 0..r {
            for j in 0..c {
                t[j * r + i] = a[i * c + j];
            }
        }
        t
    }

    #[test]
    fn all_transpose_combinations_match_naive() {
        let (m, k, n) = (37, 53, 29);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 97) as f32 / 97.0 - 0.5).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 104729) % 89) as f32 / 89.0 - 0.5).collect();
        let want = naive(&a, &b, m, k, n);
        for (lt, rt) in [(false, false), (true, false), (false, true), (true, true)] {
            let la = if lt { transpose(&a, m, k) } else { a.clone() };
            let rb = if rt { transpose(&b, k, n) } else { b.clone() };
            let mut c = vec![1.0; m * n];
            matmul(&mut c, &la, lt, &rb, rt, m, k, n, true, threads());
            for (x, y) in c.iter().zip(&want) {
                assert!((x - (y + 1.0)).abs() < 1e-4, "lt={lt} rt={rt}: {x} vs {}", y + 1.0);
            }
        }
    }

    #[test]
    fn linear_matches_naive_for_few_and_many_rows() {
        // Small (serial) and large (split across threads) products; feature counts that are not
        // multiples of four; and a row count on each side of FEW_ROWS.
        for (rows, din, dout) in [
            (2, 7, 5),
            (3, 37, 30),
            (2, 256, 1027),
            (8, 300, 401),
            (FEW_ROWS + 1, 33, 18),
            (1, 9, 6),
            // No inputs: zeros, written without reading the buffer.
            (FEW_ROWS + 3, 0, 5),
        ] {
            let x: Vec<f32> = (0..rows * din).map(|i| (i as f32 * 0.37).sin()).collect();
            let w: Vec<f32> = (0..dout * din).map(|i| (i as f32 * 0.71).cos()).collect();
            let want = naive(&x, &transpose(&w, dout, din), rows, din, dout);
            let y = linear(&x, &w, rows, din, dout);
            for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() < 1e-4 * (1.0 + b.abs()),
                    "{rows}x{din}x{dout} [{i}]: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn linear_gradients_match_definition() {
        let (rows, din, dout) = (5, 4, 3);
        let x: Vec<f32> = (0..rows * din).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..dout * din).map(|i| (i as f32 * 0.71).cos()).collect();
        let dy: Vec<f32> = (0..rows * dout).map(|i| (i as f32 * 1.3).sin()).collect();
        let mut dx = vec![0.0; rows * din];
        let mut dw = vec![0.0; dout * din];
        linear_backward_input(&mut dx, &dy, &w, rows, din, dout, false);
        linear_backward_weight(&mut dw, &dy, &x, rows, din, dout);
        let (mut dx2, mut dw2) = (vec![0.0; rows * din], vec![0.0; dout * din]);
        linear_backward(&mut dx2, &mut dw2, &dy, &x, &w, rows, din, dout, false);
        assert_eq!((&dx, &dw), (&dx2, &dw2));
        for r in 0..rows {
            for i in 0..din {
                let want: f32 = (0..dout).map(|o| dy[r * dout + o] * w[o * din + i]).sum();
                assert!((dx[r * din + i] - want).abs() < 1e-5);
            }
        }
        for o in 0..dout {
            for i in 0..din {
                let want: f32 = (0..rows).map(|r| dy[r * dout + o] * x[r * din + i]).sum();
                assert!((dw[o * din + i] - want).abs() < 1e-5);
            }
        }
    }
}
