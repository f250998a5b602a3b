//! Row kernels that dominate the non-matmul time (exponentials, dot products), compiled three
//! times: for the baseline target, with AVX2+FMA, and with AVX-512F as well, chosen at run time.
//! The binary stays portable and still uses 8- or 16-wide vectors where the processor has them.
//!
//! Longer than most files on purpose: each primitive's vector forms and its portable form sit
//! side by side under one dispatch macro, so that they are read, and changed, together.

use std::mem::MaybeUninit;

/// Defines `pub fn $name` that runs `$imp` (an `#[inline(always)]` function with the same
/// signature) under AVX-512F or AVX2+FMA when available.
macro_rules! multiversion {
    ($(#[$m:meta])* $name:ident => $imp:ident ( $($arg:ident : $ty:ty),* ) $(-> $ret:ty)?) => {
        $(#[$m])*
        #[inline]
        pub fn $name($($arg: $ty),*) $(-> $ret)? {
            #[cfg(target_arch = "x86_64")]
            {
                // Unsafe only because of `target_feature`: `$imp` itself is safe code.
                #[target_feature(enable = "avx2,fma,avx512f")]
                unsafe fn wide($($arg: $ty),*) $(-> $ret)? { $imp($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn fast($($arg: $ty),*) $(-> $ret)? { $imp($($arg),*) }
                if wide_vectors() {
                    // SAFETY: the processor has AVX-512F, AVX2 and FMA (just detected).
                    return unsafe { wide($($arg),*) };
                }
                if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                    // SAFETY: the processor has AVX2 and FMA (just detected), `fast`'s only
                    // requirement.
                    return unsafe { fast($($arg),*) };
                }
            }
            $imp($($arg),*)
        }
    };
}

/// Whether the row kernels run with 16-wide vectors: the processor has AVX-512F (and AVX2 and
/// FMA). The kernels' sums keep one accumulator per lane of a fixed count, so the width changes
/// the speed, not the bits.
#[cfg(target_arch = "x86_64")]
fn wide_vectors() -> bool {
    use std::arch::is_x86_feature_detected as has;
    has!("avx512f") && has!("avx2") && has!("fma")
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
    assert!(
        matches!(xs.len(), 1 | 2)
            && out.len() >= xs.len()
            && xs.iter().all(|x| x.len() == n)
            && w.len() >= 4 * n,
        "dot4: bad operand sizes"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: AVX2 and FMA were just detected; the assert above gives `dot4_avx2`'s
            // sizes (every row of `xs` n long, `w` at least 4n).
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

/// `out[r·c + i] = ⟨ws[r], src[i·stride..][..n]⟩` for one to four queries `ws` (each `n`
/// long) and `c = out.len() / ws.len()` rows of `src` lying `stride` apart: each load of a
/// source serves every query, and each query's sums are what it gets alone. (Phase 1 of the
/// depth attention: a block's consumers score a token's completed sources; decoding attention:
/// the query heads that share a key head.)
pub fn scores(out: &mut [f32], ws: &[&[f32]], src: &[f32], stride: usize) {
    let (r, n) = (ws.len(), ws.first().map_or(0, |w| w.len()));
    let c = out.len() / r.max(1);
    assert!(
        (1..=4).contains(&r)
            && c * r == out.len()
            && ws.iter().all(|w| w.len() == n)
            && (c == 0 || src.len() >= (c - 1) * stride + n),
        "scores: bad operand sizes"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            /// # Safety
            /// As `scores_avx2`, with `ws` holding `R` queries.
            #[target_feature(enable = "avx2,fma")]
            unsafe fn of<const R: usize>(
                ws: &[&[f32]],
                out: &mut [f32],
                src: &[f32],
                stride: usize,
                c: usize,
            ) {
                scores_avx2::<R>(std::array::from_fn(|i| ws[i]), out, src, stride, c)
            }
            // SAFETY: AVX2 and FMA were just detected; the assert above gives `scores_avx2`'s
            // sizes (`out` R·c long, `src` reaching (c − 1)·stride + n).
            unsafe {
                match r {
                    1 => of::<1>(ws, out, src, stride, c),
                    2 => of::<2>(ws, out, src, stride, c),
                    3 => of::<3>(ws, out, src, stride, c),
                    _ => of::<4>(ws, out, src, stride, c),
                }
            }
            return;
        }
    }
    scores_portable(out, ws, src, stride)
}

fn scores_portable(out: &mut [f32], ws: &[&[f32]], src: &[f32], stride: usize) {
    let c = out.len() / ws.len();
    for (k, w) in ws.iter().enumerate() {
        for i in 0..c {
            out[k * c + i] = dot_imp(w, &src[i * stride..i * stride + w.len()]);
        }
    }
}

/// [`scores`] with explicit AVX2/FMA: sources in groups of four, `4·R` accumulators.
///
/// # Safety
/// The processor must support AVX2 and FMA; `out` must hold `R·c` values and `src` reach
/// `(c − 1)·stride + n`, `n = ws[r].len()`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_avx2<const R: usize>(
    ws: [&[f32]; R],
    out: &mut [f32],
    src: &[f32],
    stride: usize,
    c: usize,
) {
    let mut i = 0;
    while i + 4 <= c {
        let got = scores_group_avx2::<R, 4>(ws, src.as_ptr().add(i * stride), stride);
        for r in 0..R {
            out[r * c + i..r * c + i + 4].copy_from_slice(&got[r]);
        }
        i += 4;
    }
    while i < c {
        let got = scores_group_avx2::<R, 1>(ws, src.as_ptr().add(i * stride), stride);
        for r in 0..R {
            out[r * c + i] = got[r][0];
        }
        i += 1;
    }
}

/// `⟨ws[r], row_k⟩` for `K` rows starting at `src`, `stride` apart.
///
/// # Safety
/// As [`scores_avx2`]; `src` must reach `(K − 1)·stride + n`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scores_group_avx2<const R: usize, const K: usize>(
    ws: [&[f32]; R],
    src: *const f32,
    stride: usize,
) -> [[f32; K]; R] {
    use std::arch::x86_64::*;
    let n = ws[0].len();
    let full = n / 8 * 8;
    let mut acc = [[_mm256_setzero_ps(); K]; R];
    let mut j = 0;
    while j < full {
        let q: [__m256; R] = std::array::from_fn(|r| _mm256_loadu_ps(ws[r].as_ptr().add(j)));
        for k in 0..K {
            let v = _mm256_loadu_ps(src.add(k * stride + j));
            for r in 0..R {
                acc[r][k] = _mm256_fmadd_ps(q[r], v, acc[r][k]);
            }
        }
        j += 8;
    }
    std::array::from_fn(|r| {
        std::array::from_fn(|k| {
            let tail: f32 = (full..n).map(|j| ws[r][j] * *src.add(k * stride + j)).sum();
            hsum_avx(acc[r][k]) + tail
        })
    })
}

/// Sum of the eight lanes.
///
/// # Safety
/// The processor must support AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum_avx(v: std::arch::x86_64::__m256) -> f32 {
    let mut lanes = [0.0f32; 8];
    std::arch::x86_64::_mm256_storeu_ps(lanes.as_mut_ptr(), v);
    lanes.iter().sum()
}

/// `outs[r] = Σ_i e[r·c + i] · src[i·stride..][..n]` for one to four outputs (each `n` long,
/// written in full, so they may start uninitialised) and `c = e.len() / outs.len()` rows of
/// `src` lying `stride` apart: each load of a source serves every output, each output is
/// written once, and each is what it gets alone. (Phase 1 of the depth attention: a block's
/// consumers mix a token's sources; decoding attention: the query heads that share a value
/// head.)
pub fn mixes(outs: &mut [&mut [MaybeUninit<f32>]], e: &[f32], src: &[f32], stride: usize) {
    let (c, n) = mix_sizes(outs.iter().map(|o| o.len()), e, src, stride);
    #[cfg(target_arch = "x86_64")]
    if mixes_dispatch::<false>(outs.iter_mut().map(|o| o.as_mut_ptr().cast()), e, src, stride, c, n)
    {
        return;
    }
    mixes_portable(outs, e, src, stride)
}

/// [`mixes`] for outputs that already hold a mix of earlier rows: adds the mix of these `c =
/// e.len() / outs.len()` rows, continuing each sum where it stopped, so that a mix over rows
/// held in several places, taken piece by piece in order, equals the one over all of them at
/// once, bit for bit (attention over a sequence whose start is shared, [`super::attention`]).
pub fn mixes_more(outs: &mut [&mut [f32]], e: &[f32], src: &[f32], stride: usize) {
    let (c, n) = mix_sizes(outs.iter().map(|o| o.len()), e, src, stride);
    #[cfg(target_arch = "x86_64")]
    if mixes_dispatch::<true>(outs.iter_mut().map(|o| o.as_mut_ptr()), e, src, stride, c, n) {
        return;
    }
    for (k, out) in outs.iter_mut().enumerate() {
        for (j, o) in out.iter_mut().enumerate() {
            *o = (0..c).map(|i| e[k * c + i] * src[i * stride + j]).fold(*o, |a, x| a + x);
        }
    }
}

/// The rows `c` and the output length `n` of a mix of outputs of lengths `outs` with weights
/// `e` over `src`; panics unless there are one to four outputs of one length, `c` weights for
/// each and `src` reaches `(c − 1)·stride + n`.
fn mix_sizes(
    outs: impl ExactSizeIterator<Item = usize> + Clone,
    e: &[f32],
    src: &[f32],
    stride: usize,
) -> (usize, usize) {
    let (r, n) = (outs.len(), outs.clone().next().unwrap_or(0));
    let c = e.len() / r.max(1);
    assert!(
        (1..=4).contains(&r)
            && c > 0
            && c * r == e.len()
            && outs.into_iter().all(|len| len == n)
            && src.len() >= (c - 1) * stride + n,
        "mixes: bad operand sizes"
    );
    (c, n)
}

/// Runs `mixes_avx2` on the outputs `outs` (1 to 4, each `n` long and distinct; read first when
/// `ADD`) where the processor has AVX2 and FMA; false, doing nothing, where it has not.
#[cfg(target_arch = "x86_64")]
fn mixes_dispatch<const ADD: bool>(
    outs: impl Iterator<Item = *mut f32>,
    e: &[f32],
    src: &[f32],
    stride: usize,
    c: usize,
    n: usize,
) -> bool {
    if !(std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma"))
    {
        return false;
    }
    let (mut ptrs, mut r) = ([std::ptr::null_mut(); 4], 0);
    for p in outs.take(4) {
        ptrs[r] = p;
        r += 1;
    }
    let outs = &ptrs[..r];
    /// # Safety
    /// As `mixes_avx2`, with `outs` holding `R` pointers.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn of<const R: usize, const ADD: bool>(
        outs: &[*mut f32],
        e: &[f32],
        src: &[f32],
        stride: usize,
        c: usize,
        n: usize,
    ) {
        mixes_avx2::<R, ADD>(std::array::from_fn(|i| outs[i]), e, src, stride, c, n)
    }
    // SAFETY: AVX2 and FMA were just detected; the callers' asserts give `mixes_avx2`'s sizes
    // (each output n long and a distinct `&mut`, `e` R·c long, `src` reaching (c − 1)·stride
    // + n).
    unsafe {
        match outs.len() {
            1 => of::<1, ADD>(outs, e, src, stride, c, n),
            2 => of::<2, ADD>(outs, e, src, stride, c, n),
            3 => of::<3, ADD>(outs, e, src, stride, c, n),
            _ => of::<4, ADD>(outs, e, src, stride, c, n),
        }
    }
    true
}

fn mixes_portable(outs: &mut [&mut [MaybeUninit<f32>]], e: &[f32], src: &[f32], stride: usize) {
    let c = e.len() / outs.len();
    for (k, o) in outs.iter_mut().enumerate() {
        for (j, o) in o.iter_mut().enumerate() {
            o.write((0..c).map(|i| e[k * c + i] * src[i * stride + j]).sum());
        }
    }
}

/// [`mixes`] with explicit AVX2/FMA, 16 values (one cache line's worth) of every output at a
/// time. A token's sources may lie a multiple of 4 KiB apart, in one cache set; each step reads
/// its stretch of every source at once rather than coming back to a line after the others.
///
/// # Safety
/// The processor must support AVX2 and FMA; each `outs[r]` must be valid for `n` writes, `e`
/// hold `R·c` weights and `src` reach `(c − 1)·stride + n`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn mixes_avx2<const R: usize, const ADD: bool>(
    outs: [*mut f32; R],
    e: &[f32],
    src: &[f32],
    stride: usize,
    c: usize,
    n: usize,
) {
    use std::arch::x86_64::*;
    let (s, ep) = (src.as_ptr(), e.as_ptr());
    let full = n / 16 * 16;
    let mut j = 0;
    while j < full {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        if ADD {
            for r in 0..R {
                acc[r] = [_mm256_loadu_ps(outs[r].add(j)), _mm256_loadu_ps(outs[r].add(j + 8))];
            }
        }
        for i in 0..c {
            let row = s.add(i * stride + j);
            let (v0, v1) = (_mm256_loadu_ps(row), _mm256_loadu_ps(row.add(8)));
            for r in 0..R {
                let w = _mm256_set1_ps(*ep.add(r * c + i));
                acc[r][0] = _mm256_fmadd_ps(w, v0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(w, v1, acc[r][1]);
            }
        }
        for r in 0..R {
            _mm256_storeu_ps(outs[r].add(j), acc[r][0]);
            _mm256_storeu_ps(outs[r].add(j + 8), acc[r][1]);
        }
        j += 16;
    }
    for j in full..n {
        for r in 0..R {
            let terms = (0..c).map(|i| e[r * c + i] * src[i * stride + j]);
            *outs[r].add(j) =
                if ADD { terms.fold(*outs[r].add(j), |a, x| a + x) } else { terms.sum() };
        }
    }
}

#[inline(always)]
fn axpy_imp(y: &mut [f32], a: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

#[inline(always)]
fn exp_shift_sum_imp(row: &mut [f32], m: f32) -> f32 {
    // The exponentials in a loop of their own, as wide as the vectors go (in the summing loop
    // they would run only as wide as its 8 lanes), then their sum over the row, now in L1.
    row.iter_mut().for_each(|x| *x = exp(*x - m));
    let mut acc = [0.0f32; 8];
    let chunks = row.chunks_exact(8);
    let s: f32 = chunks.remainder().iter().fold(0.0, |s, x| s + x);
    for c in chunks {
        for j in 0..8 {
            acc[j] += c[j];
        }
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
fn depth_source_grad_imp(
    dv: &mut [f32],
    dw: &mut [f32],
    g: &[f32],
    w: &[f32],
    v: &[f32],
    a: f32,
    b: f32,
    c: f32,
) {
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
/// What one consumer's tile of the per-source depth backward reads ([`source_tile`]): rows `i`
/// of `dh` and `v` (each `w.len()` long), and per token `a_i`, `dhh_i` and `r_i`.
pub struct SourceRows<'a> {
    pub dh: &'a [f32],
    pub v: &'a [f32],
    pub w: &'a [f32],
    pub a: &'a [f32],
    pub dhh: &'a [f32],
    pub r: &'a [f32],
    /// The rows of `dh` the caller reads after these (prefetched; any length, empty for none).
    pub next: &'a [f32],
}

/// One consumer's share of the per-source depth backward over a tile of tokens:
/// `dl_i = a_i·(⟨dh_i, v_i⟩ − dhh_i)`, then `acc_i += a_i·dh_i + (dl_i·r_i)·w` and
/// `dw += (dl_i·r_i)·v_i`, the tokens in order. Returns the `dl_i` in `dl`.
pub fn source_tile(acc: &mut [f32], dw: &mut [f32], dl: &mut [f32], x: &SourceRows) {
    let (n, rows) = (x.w.len(), x.a.len());
    assert!(
        dw.len() == n
            && [dl.len(), x.dhh.len(), x.r.len()] == [rows; 3]
            && acc.len() == rows * n
            && x.dh.len() == acc.len()
            && x.v.len() == acc.len(),
        "source_tile: bad operand sizes"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: AVX2 and FMA were just detected; the assert gives the sizes.
            unsafe { source_tile_avx2(acc, dw, dl, x) };
            return;
        }
    }
    source_tile_portable(acc, dw, dl, x)
}

fn source_tile_portable(acc: &mut [f32], dw: &mut [f32], dl: &mut [f32], x: &SourceRows) {
    let n = x.w.len();
    for i in 0..x.a.len() {
        let row = i * n..(i + 1) * n;
        dl[i] = x.a[i] * (dot_imp(&x.dh[row.clone()], &x.v[row.clone()]) - x.dhh[i]);
        let c = dl[i] * x.r[i];
        axpy2_imp(&mut acc[row.clone()], x.a[i], &x.dh[row.clone()], c, x.w);
        axpy_imp(dw, c, &x.v[row]);
    }
}

/// Rows of `dh` that [`source_tile_avx2`] prefetches ahead of the one it works on. The rows
/// stream in from memory (they were written many layers ago), and the hardware prefetcher
/// alone keeps too few of them in flight, so the kernel asks for them itself.
const SOURCE_PREFETCH: usize = 4;

/// [`source_tile`] with explicit AVX2/FMA, one token at a time, prefetching `dh` (and then
/// `next`, the rows that come after the tile) [`SOURCE_PREFETCH`] rows ahead. `dl` has the same
/// bits as [`source_tile_portable`]'s; the updates use fused multiply-adds.
///
/// # Safety
/// The processor must support AVX2 and FMA; the sizes as [`source_tile`] asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn source_tile_avx2(acc: &mut [f32], dw: &mut [f32], dl: &mut [f32], x: &SourceRows) {
    use std::arch::x86_64::*;
    let SourceRows { dh, v, w, a, dhh, r, next } = *x;
    let (n, rows) = (w.len(), a.len());
    let (ap, gp, vp, wp, dwp) =
        (acc.as_mut_ptr(), dh.as_ptr(), v.as_ptr(), w.as_ptr(), dw.as_mut_ptr());
    for i in 0..rows {
        let ahead = i + SOURCE_PREFETCH;
        let row = match ahead < rows {
            true => Some(&dh[ahead * n..(ahead + 1) * n]),
            false => next.get((ahead - rows) * n..(ahead - rows + 1) * n),
        };
        for line in row.into_iter().flat_map(|r| r.chunks(16)) {
            _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast());
        }
        let at = i * n;
        // ⟨dh, v⟩ through `dot`'s own loop (inlined here, so compiled for AVX2), which gives its
        // bits: a consumer that reads one source has `h = v`, and then `⟨dh, v⟩ − ⟨dh, h⟩` must
        // come out 0, as the method's gradient is.
        dl[i] = a[i] * (dot_imp(&dh[at..at + n], &v[at..at + n]) - dhh[i]);
        let c = dl[i] * r[i];
        let (ai, ci) = (_mm256_set1_ps(a[i]), _mm256_set1_ps(c));
        let mut j = 0;
        while j + 8 <= n {
            let o = at + j;
            let x = _mm256_fmadd_ps(ai, _mm256_loadu_ps(gp.add(o)), _mm256_loadu_ps(ap.add(o)));
            _mm256_storeu_ps(ap.add(o), _mm256_fmadd_ps(ci, _mm256_loadu_ps(wp.add(j)), x));
            let y = _mm256_fmadd_ps(ci, _mm256_loadu_ps(vp.add(o)), _mm256_loadu_ps(dwp.add(j)));
            _mm256_storeu_ps(dwp.add(j), y);
            j += 8;
        }
        for j in j..n {
            let o = at + j;
            acc[o] += a[i] * dh[o] + c * w[j];
            dw[j] += c * v[o];
        }
    }
}

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
fn axpby_imp(y: &mut [f32], a: f32, b: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y = a * *y + b * x);
}

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

#[inline(always)]
fn exp_shift_scale_imp(row: &mut [f32], m: f32, s: f32) {
    row.iter_mut().for_each(|x| *x = exp(*x - m) * s);
}

multiversion!(
    /// `row_i = e^(row_i − m) · s`: a softmax row again from its statistics, with the bits of
    /// [`exp_shift_sum`] followed by [`scale`].
    exp_shift_scale => exp_shift_scale_imp(row: &mut [f32], m: f32, s: f32)
);

#[inline(always)]
fn softmax_grad_imp(ds: &mut [f32], p: &[f32], scale: f32) {
    let p = &p[..ds.len()];
    let dot = dot_imp(p, ds);
    for (d, p) in ds.iter_mut().zip(p) {
        *d = p * (*d - dot) * scale;
    }
}

multiversion!(
    /// The gradient of a softmax row's scores from that of its probabilities `p`, in place:
    /// `ds_j = p_j · (ds_j − ⟨p, ds⟩) · scale`, with `⟨p, ds⟩` summed as [`dot`] sums it.
    softmax_grad => softmax_grad_imp(ds: &mut [f32], p: &[f32], scale: f32)
);

#[inline(always)]
fn rotate_halves_imp(heads: &mut [f32], cos: &[f32], sin: &[f32], sign: f32) {
    let half = cos.len();
    if half == 0 {
        // Heads of no dimensions: nothing turns (and `chunks_exact_mut` takes no zero width).
        return;
    }
    let sin = &sin[..half];
    for head in heads.chunks_exact_mut(2 * half) {
        let (a, b) = head.split_at_mut(half);
        for j in 0..half {
            // Two products and a sum, as `x·cos + rotate_half(x)·sin` rounds them: no fused
            // multiply-add, so every path gives the same bits.
            let (x1, x2, s) = (a[j], b[j], sign * sin[j]);
            a[j] = x1 * cos[j] - x2 * s;
            b[j] = x2 * cos[j] + x1 * s;
        }
    }
}

multiversion!(
    /// Rotary embedding of consecutive heads (`heads`, each `2·cos.len()` wide) in the "rotate
    /// half" layout: the pair `(x_j, x_{j+half})` turns by the angle with `cos[j]` and
    /// `sign·sin[j]` (`sign` −1: the inverse rotation).
    rotate_halves => rotate_halves_imp(heads: &mut [f32], cos: &[f32], sin: &[f32], sign: f32)
);

#[cfg(test)]
mod tests {
    /// Up to four queries or outputs at once give each the bits it gets alone (the grouped
    /// query heads of a decoding step rely on it), and a mix continued piece by piece gives the
    /// bits of the whole; odd lengths cover the tails.
    #[test]
    fn grouped_scores_and_mixes_are_each_alone_bit_for_bit() {
        use std::mem::MaybeUninit;
        let (n, c, stride) = (37, 11, 41);
        let v = |k: usize| ((k as f32 * 0.618).fract() - 0.5) * 3.0;
        let src: Vec<f32> = (0..c * stride).map(v).collect();
        let ws: Vec<Vec<f32>> =
            (0..4).map(|r| (0..n).map(|j| v(1000 + 97 * r + j)).collect()).collect();
        let e: Vec<f32> = (0..4 * c).map(|k| v(5000 + k).abs()).collect();
        let alone = |r: usize| {
            let mut sc = vec![0.0; c];
            super::scores(&mut sc, &[&ws[r]], &src, stride);
            let mut out = vec![MaybeUninit::new(0.0); n];
            super::mixes(&mut [&mut out[..]], &e[r * c..(r + 1) * c], &src, stride);
            (sc, out.iter().map(|x| unsafe { x.assume_init() }).collect::<Vec<f32>>())
        };
        for r in 1..=4 {
            let qs: Vec<&[f32]> = ws[..r].iter().map(|w| &w[..]).collect();
            let mut sc = vec![0.0; r * c];
            super::scores(&mut sc, &qs, &src, stride);
            let mut outs = vec![vec![MaybeUninit::new(0.0); n]; r];
            let mut refs: Vec<&mut [MaybeUninit<f32>]> =
                outs.iter_mut().map(|o| &mut o[..]).collect();
            // The weights of the outputs' first 4 rows, then (continued) of the other 7.
            let cut = 4;
            let first: Vec<f32> = (0..r).flat_map(|k| e[k * c..k * c + cut].to_vec()).collect();
            let rest: Vec<f32> =
                (0..r).flat_map(|k| e[k * c + cut..(k + 1) * c].to_vec()).collect();
            super::mixes(&mut refs, &first, &src, stride);
            // SAFETY: written in full just above.
            let mut sums: Vec<&mut [f32]> = refs
                .iter_mut()
                .map(|o| unsafe { &mut *(&mut **o as *mut [MaybeUninit<f32>] as *mut [f32]) })
                .collect();
            super::mixes_more(&mut sums, &rest, &src[cut * stride..], stride);
            for k in 0..r {
                let (want_sc, want_mix) = alone(k);
                let got: Vec<u32> = sc[k * c..(k + 1) * c].iter().map(|x| x.to_bits()).collect();
                let want: Vec<u32> = want_sc.iter().map(|x| x.to_bits()).collect();
                assert_eq!(got, want, "scores of query {k} of {r}");
                let got: Vec<u32> = sums[k].iter().map(|x| x.to_bits()).collect();
                let want: Vec<u32> = want_mix.iter().map(|x| x.to_bits()).collect();
                assert_eq!(got, want, "mix of output {k} of {r}");
            }
        }
    }

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
    fn rotate_halves_has_the_bits_of_the_scalar_rotation() {
        // Two heads of 2·20 (a vector part and a remainder), forward and inverse: the vector
        // path must round as the plain products and sums do (no fused multiply-add).
        let half = 20;
        let x: Vec<f32> = (0..4 * half).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let cos: Vec<f32> = (0..half).map(|j| (j as f32 * 0.9).cos()).collect();
        let sin: Vec<f32> = (0..half).map(|j| (j as f32 * 0.9).sin()).collect();
        for sign in [1.0f32, -1.0] {
            let mut got = x.clone();
            super::rotate_halves(&mut got, &cos, &sin, sign);
            for (head, want) in x.chunks(2 * half).zip(got.chunks(2 * half)) {
                for j in 0..half {
                    let (x1, x2, s) = (head[j], head[j + half], sign * sin[j]);
                    let a = (x1 * cos[j]) - (x2 * s);
                    let b = (x2 * cos[j]) + (x1 * s);
                    assert_eq!((want[j], want[j + half]), (a, b), "sign {sign}, pair {j}");
                }
            }
        }
        // Heads of no dimensions leave the row as it is.
        let mut row = x.clone();
        super::rotate_halves(&mut row, &[], &[], 1.0);
        assert_eq!(row, x);
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
                assert!(
                    (d4[r][k] - want).abs() < 1e-5 && (p4[r][k] - want).abs() < 1e-5,
                    "dot4[{r}][{k}]"
                );
            }
        }
        // Five rows of 37 at a stride of 40 (a token's sources), scored by and mixed into one
        // or two consumers, against sums in f64 (37: both kernels' vector loops and tails).
        let (c, n, stride) = (5, 37, 40);
        let src: Vec<f32> = (0..c * stride).map(|i| (i as f32 * 0.37).sin()).collect();
        let row = |i: usize| &src[i * stride..i * stride + n];
        type Scores = fn(&mut [f32], &[&[f32]], &[f32], usize);
        type Mixes = fn(&mut [&mut [std::mem::MaybeUninit<f32>]], &[f32], &[f32], usize);
        let vector = (super::scores as Scores, super::mixes as Mixes);
        let portable = (super::scores_portable as Scores, super::mixes_portable as Mixes);
        for ((scores, mixes), ws) in [vector, portable]
            .into_iter()
            .flat_map(|k| [(k, vec![&a[..]]), (k, vec![&a[..], &b[..]])])
        {
            let mut got = vec![0.0f32; ws.len() * c];
            scores(&mut got, &ws, &src, stride);
            for (r, w) in ws.iter().enumerate() {
                for i in 0..c {
                    let want: f64 = (0..n).map(|j| w[j] as f64 * row(i)[j] as f64).sum();
                    assert!((got[r * c + i] as f64 - want).abs() < 1e-5, "scores[{r}][{i}]");
                }
            }
            let e: Vec<f32> = (0..ws.len() * c).map(|i| 0.1 + 0.2 * i as f32).collect();
            let mut outs = vec![vec![std::mem::MaybeUninit::new(f32::NAN); n]; ws.len()];
            mixes(&mut outs.iter_mut().map(|o| &mut o[..]).collect::<Vec<_>>(), &e, &src, stride);
            for (r, o) in outs.iter().enumerate() {
                for j in 0..n {
                    let want: f64 = (0..c).map(|i| e[r * c + i] as f64 * row(i)[j] as f64).sum();
                    // SAFETY: initialised above (and overwritten by `mixes`).
                    assert!(
                        (unsafe { o[j].assume_init() } as f64 - want).abs() < 1e-5,
                        "mixes[{r}][{j}]"
                    );
                }
            }
        }
        // The per-source depth backward over 7 tokens of 37 values, both kernels, against f64.
        type Tile = fn(&mut [f32], &mut [f32], &mut [f32], &super::SourceRows);
        let rows = 7;
        let val = |k: usize, s: f32| (k as f32 * s).sin();
        let dh: Vec<f32> = (0..rows * n).map(|k| val(k, 0.13)).collect();
        let v: Vec<f32> = (0..rows * n).map(|k| val(k, 0.29)).collect();
        let (al, dhh, rs): (Vec<f32>, Vec<f32>, Vec<f32>) =
            (0..rows).map(|i| (0.1 * i as f32, val(i, 0.5), 1.0 + val(i, 0.9))).collect();
        for tile in [super::source_tile as Tile, super::source_tile_portable as Tile] {
            let (mut acc, mut dw, mut dl) =
                (vec![0.5f32; rows * n], vec![0.25f32; n], vec![f32::NAN; rows]);
            let x =
                super::SourceRows { dh: &dh, v: &v, w: &a, a: &al, dhh: &dhh, r: &rs, next: &b };
            tile(&mut acc, &mut dw, &mut dl, &x);
            let mut want_dw: Vec<f64> = vec![0.25; n];
            for i in 0..rows {
                let row = |x: &[f32], j: usize| x[i * n + j] as f64;
                let dot: f64 = (0..n).map(|j| row(&dh, j) * row(&v, j)).sum();
                let want_dl = al[i] as f64 * (dot - dhh[i] as f64);
                assert!((dl[i] as f64 - want_dl).abs() < 1e-5, "source_tile dl[{i}]");
                let c = want_dl * rs[i] as f64;
                for j in 0..n {
                    let want = 0.5 + al[i] as f64 * row(&dh, j) + c * a[j] as f64;
                    assert!((acc[i * n + j] as f64 - want).abs() < 1e-5, "source_tile acc[{i}]");
                    want_dw[j] += c * row(&v, j);
                }
            }
            for j in 0..n {
                assert!((dw[j] as f64 - want_dw[j]).abs() < 1e-5, "source_tile dw[{j}]");
            }
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
        // Attention's backward recomputes its probabilities in one pass: the bits of the two
        // passes forward made.
        super::scale(&mut r, 0.3);
        let mut one = a.clone();
        super::exp_shift_scale(&mut one, 1.0, 0.3);
        assert_eq!(one, r, "exp_shift_scale");
        // The softmax gradient: the bits of dot then the elementwise products in plain order.
        let mut ds = b.clone();
        super::softmax_grad(&mut ds, &a, 0.3);
        let dot = super::dot(&a, &b);
        let want: Vec<f32> = a.iter().zip(&b).map(|(p, d)| p * (d - dot) * 0.3).collect();
        assert_eq!(ds, want, "softmax_grad");
    }
}
