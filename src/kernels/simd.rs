//! Row kernels that dominate the non-matmul time (exponentials, dot products), compiled twice:
//! once for the baseline target and once with AVX2+FMA, chosen at run time. The binary stays
//! portable and still uses 8-wide vectors where the processor has them.

/// Defines `pub fn $name` that runs `$imp` (an `#[inline(always)]` function with the same
/// signature) under AVX2+FMA when available.
macro_rules! multiversion {
    ($(#[$m:meta])* $name:ident => $imp:ident ( $($arg:ident : $ty:ty),* ) $(-> $ret:ty)?) => {
        $(#[$m])*
        #[inline]
        pub fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2,fma")]
                unsafe fn fast($($arg: $ty),*) $(-> $ret)? { $imp($($arg),*) }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    // SAFETY: the features were just detected.
                    return unsafe { fast($($arg),*) };
                }
            }
            $imp($($arg),*)
        }
    };
}

/// `e^x` for f32 to within ~2 ulp, branch-free so that loops over it vectorise: `x = n·ln2 + r`
/// with |r| ≤ ln2/2, a degree-6 polynomial for `e^r`, and `2^n` built in the exponent bits.
/// Inputs below −87.3 flush to 0.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Adding 1.5·2²³ rounds to the nearest integer and leaves it in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.7);
    let t = x * LOG2E + MAGIC;
    let n = t - MAGIC;
    let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    let y = p * f32::from_bits((ni.wrapping_add(127) as u32) << 23);
    if x <= -87.3 {
        0.0
    } else {
        y
    }
}

// The loops below walk fixed-width chunks (`chunks_exact`) with one accumulator per lane, which
// is the shape the compiler turns into vector instructions.

#[inline(always)]
fn dot_imp(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for j in 0..16 {
            acc[j] += x[j] * y[j];
        }
    }
    tail + acc.iter().sum::<f32>()
}

/// Dot products of up to two rows `xs` (each `n` long) with four consecutive rows of `w`
/// (`[4, n]`): `out[r][k] = ⟨xs[r], w_k⟩`. Portable form.
fn dot4_portable(xs: &[&[f32]], w: &[f32], out: &mut [[f32; 4]]) {
    for (x, o) in xs.iter().zip(out.iter_mut()) {
        let n = x.len();
        *o = std::array::from_fn(|k| dot_imp(x, &w[k * n..(k + 1) * n]));
    }
}

/// [`dot4`] with explicit AVX2/FMA for `R` rows: `4·R` accumulators share each load.
///
/// # Safety
/// The processor must support AVX2 and FMA; every `xs[r]` must be `n` long and `w` hold `4n`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot4_avx2<const R: usize>(xs: [&[f32]; R], w: &[f32], n: usize) -> [[f32; 4]; R] {
    use std::arch::x86_64::*;
    let full = n / 8 * 8;
    let wp = w.as_ptr();
    let mut a = [[_mm256_setzero_ps(); 4]; R];
    let mut i = 0;
    while i < full {
        let v: [__m256; R] = std::array::from_fn(|r| _mm256_loadu_ps(xs[r].as_ptr().add(i)));
        for k in 0..4 {
            let wv = _mm256_loadu_ps(wp.add(k * n + i));
            for r in 0..R {
                a[r][k] = _mm256_fmadd_ps(v[r], wv, a[r][k]);
            }
        }
        i += 8;
    }
    let mut out = [[0.0f32; 4]; R];
    for r in 0..R {
        for k in 0..4 {
            let mut lanes = [0.0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), a[r][k]);
            let tail: f32 = (full..n).map(|j| xs[r][j] * w[k * n + j]).sum();
            out[r][k] = lanes.iter().sum::<f32>() + tail;
        }
    }
    out
}

/// `out[r][k] = ⟨xs[r], w_k⟩` for one or two rows `xs` (each `n` long) and the four rows of
/// `w` (`[4, n]`): each load of `w` serves both rows.
pub fn dot4(xs: &[&[f32]], w: &[f32], out: &mut [[f32; 4]]) {
    let n = xs[0].len();
    assert!(matches!(xs.len(), 1 | 2) && out.len() >= xs.len() && xs.iter().all(|x| x.len() == n) && w.len() >= 4 * n, "dot4: bad operand sizes");
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: features detected; sizes checked.
            unsafe {
                if xs.len() == 2 {
                    out[..2].copy_from_slice(&dot4_avx2([xs[0], xs[1]], w, n));
                } else {
                    out[0] = dot4_avx2([xs[0]], w, n)[0];
                }
            }
            return;
        }
    }
    dot4_portable(xs, w, out)
}

#[inline(always)]
fn axpy_imp(y: &mut [f32], a: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

#[inline(always)]
fn exp_shift_sum_imp(row: &mut [f32], m: f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut chunks = row.chunks_exact_mut(8);
    for c in &mut chunks {
        for j in 0..8 {
            let e = exp(c[j] - m);
            c[j] = e;
            acc[j] += e;
        }
    }
    let mut s = 0.0f32;
    for x in chunks.into_remainder() {
        *x = exp(*x - m);
        s += *x;
    }
    s + acc.iter().sum::<f32>()
}

#[inline(always)]
fn max_imp(row: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for c in chunks {
        for j in 0..8 {
            acc[j] = acc[j].max(c[j]);
        }
    }
    acc.iter().fold(tail, |a, &b| a.max(b))
}

#[inline(always)]
fn scale_imp(row: &mut [f32], s: f32) {
    row.iter_mut().for_each(|x| *x *= s);
}

#[inline(always)]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

#[inline(always)]
fn swiglu_fwd_imp(act: &mut [f32], g: &[f32], u: &[f32]) {
    for ((a, &g), &u) in act.iter_mut().zip(g).zip(u) {
        *a = g * sigmoid(g) * u;
    }
}

#[inline(always)]
fn swiglu_bwd_imp(dg: &mut [f32], du: &mut [f32], da: &[f32], g: &[f32], u: &[f32]) {
    for i in 0..da.len().min(dg.len()).min(du.len()).min(g.len()).min(u.len()) {
        let s = sigmoid(g[i]);
        du[i] = da[i] * g[i] * s;
        dg[i] = da[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn depth_source_grad_imp(dv: &mut [f32], dw: &mut [f32], g: &[f32], w: &[f32], v: &[f32], a: f32, b: f32, c: f32) {
    for ((((dv, dw), g), w), v) in dv.iter_mut().zip(dw.iter_mut()).zip(g).zip(w).zip(v) {
        *dv += a * g + b * w - c * v;
        *dw += b * v;
    }
}

multiversion!(
    /// The per-source step of the depth-attention backward: `dv += a·g + b·w − c·v`,
    /// `dw += b·v`.
    #[allow(clippy::too_many_arguments)]
    depth_source_grad => depth_source_grad_imp(dv: &mut [f32], dw: &mut [f32], g: &[f32], w: &[f32], v: &[f32], a: f32, b: f32, c: f32)
);
#[inline(always)]
fn axpy2_imp(y: &mut [f32], a: f32, x: &[f32], b: f32, z: &[f32]) {
    for ((y, x), z) in y.iter_mut().zip(x).zip(z) {
        *y += a * x + b * z;
    }
}

multiversion!(
    /// `y += a·x + b·z`.
    axpy2 => axpy2_imp(y: &mut [f32], a: f32, x: &[f32], b: f32, z: &[f32])
);
#[inline(always)]
fn dots_imp(out: &mut [f32], w: &[f32], src: &[f32], stride: usize) {
    let n = w.len();
    for (i, o) in out.iter_mut().enumerate() {
        *o = dot_imp(w, &src[i * stride..i * stride + n]);
    }
}

#[inline(always)]
fn axpby_imp(y: &mut [f32], a: f32, b: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y = a * *y + b * x);
}

multiversion!(
    /// `out_i = ⟨w, src[i·stride ..][..n]⟩` for each of the `out.len()` rows of `src`
    /// (`n = w.len()`).
    dots => dots_imp(out: &mut [f32], w: &[f32], src: &[f32], stride: usize)
);
multiversion!(
    /// `y = a·y + b·x`.
    axpby => axpby_imp(y: &mut [f32], a: f32, b: f32, x: &[f32])
);
multiversion!(
    /// `Σ a_i b_i`.
    dot => dot_imp(a: &[f32], b: &[f32]) -> f32
);
multiversion!(
    /// `y += a·x`.
    axpy => axpy_imp(y: &mut [f32], a: f32, x: &[f32])
);
multiversion!(
    /// `row_i = e^(row_i − m)`, returning the sum (the inner step of a stable softmax).
    exp_shift_sum => exp_shift_sum_imp(row: &mut [f32], m: f32) -> f32
);
multiversion!(
    /// Largest element (−∞ for an empty row).
    max => max_imp(row: &[f32]) -> f32
);
multiversion!(
    /// `row *= s`.
    scale => scale_imp(row: &mut [f32], s: f32)
);
multiversion!(
    /// `act = silu(g) ⊙ u`.
    swiglu_forward_row => swiglu_fwd_imp(act: &mut [f32], g: &[f32], u: &[f32])
);
multiversion!(
    /// Gradients of `silu(g) ⊙ u` given `da`.
    swiglu_backward_row => swiglu_bwd_imp(dg: &mut [f32], du: &mut [f32], da: &[f32], g: &[f32], u: &[f32])
);

#[cfg(test)]
mod tests {
    #[test]
    fn exp_is_accurate_over_the_softmax_range() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            let got = super::exp(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.001;
        }
        assert!(worst < 4e-7, "max relative error {worst}");
        assert_eq!(super::exp(-1000.0), 0.0);
        assert_eq!(super::exp(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn row_helpers_match_scalar_code() {
        let a: Vec<f32> = (0..37).map(|i| (i as f32 * 0.3).sin()).collect();
        let b: Vec<f32> = (0..37).map(|i| (i as f32 * 0.7).cos()).collect();
        let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        assert!((super::dot(&a, &b) - want).abs() < 1e-5);
        let w: Vec<f32> = (0..4 * 37).map(|i| (i as f32 * 0.11).cos()).collect();
        let (mut d4, mut p4) = ([[0.0; 4]; 2], [[0.0; 4]; 2]);
        super::dot4(&[&a, &b], &w, &mut d4);
        super::dot4_portable(&[&a, &b], &w, &mut p4);
        for (r, x) in [&a, &b].iter().enumerate() {
            for k in 0..4 {
                let want: f32 = x.iter().zip(&w[k * 37..]).map(|(x, y)| x * y).sum();
                assert!((d4[r][k] - want).abs() < 1e-5 && (p4[r][k] - want).abs() < 1e-5, "dot4[{r}][{k}]");
            }
        }
        // Three rows of 37 at a stride of 40 (a strided source list), against sums in f64.
        let (c, n, stride) = (3, 37, 40);
        let src: Vec<f32> = (0..c * stride).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut dots = [0.0f32; 3];
        super::dots(&mut dots, &a, &src, stride);
        for i in 0..c {
            let want: f64 = (0..n).map(|j| a[j] as f64 * src[i * stride + j] as f64).sum();
            assert!((dots[i] as f64 - want).abs() < 1e-5, "dots[{i}]");
        }
        let mut y = a.clone();
        super::axpby(&mut y, 0.5, -2.0, &b);
        for j in 0..n {
            assert!((y[j] - (0.5 * a[j] - 2.0 * b[j])).abs() < 1e-6, "axpby[{j}]");
        }
        assert_eq!(super::max(&a), a.iter().cloned().fold(f32::MIN, f32::max));
        let mut r = a.clone();
        let s = super::exp_shift_sum(&mut r, 1.0);
        let want: f32 = a.iter().map(|x| (x - 1.0).exp()).sum();
        assert!((s - want).abs() < 1e-5 * want);
    }
}
