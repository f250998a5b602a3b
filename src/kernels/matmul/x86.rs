//! The f32 matrix product on processors with AVX2 and FMA, with wider kernels where there is
//! AVX-512 (docs/performance-log/matmul.md): `dst = (accumulate ? dst : 0) + alpha ·
//! lhs · rhs` with any strides.
//!
//! The usual blocked scheme: `rhs` is packed `KC` rows at a time into panels of `NR` columns,
//! `lhs` `MC` rows at a time into panels of `MR` rows, and a register kernel multiplies one panel
//! of each into an `MR × NR` tile held in registers: 6 × 16 in twelve 8-wide registers with
//! AVX2, 6 × 64 in twenty-four 16-wide ones with AVX-512. The destination tile is prefetched
//! before its kernel runs: without that, each tile's read-modify-write after the first `KC`
//! block waits on memory (the rows of a tile are far apart, so the hardware does not prefetch
//! them), which held back every product deeper than `KC`. Two or more threads take disjoint
//! parts of the destination.
//!
//! Every element sums its products in the same order (`k` in blocks of `KC`, in order; within a
//! block one fused multiply-add per step from zero; each block's sum added into the
//! destination), whatever the shape, the split, the threads and the kernel: the result depends
//! only on the operands and `k`, so both kernels give the same bits.

use super::strided::Strided;
use std::arch::x86_64::*;
use std::cell::RefCell;

/// Depth of a packed block: an `rhs` panel (`KC × NR`: 16 KiB with AVX2, 64 KiB with AVX-512)
/// stays in L1 or L2 across the `lhs` panels of a block. The same for both kernels, so that they
/// give the same bits.
const KC: usize = 256;
/// Columns of `rhs` packed at a time (rounded down to whole panels).
const NC: usize = 4096;
/// The AVX2 tile: rows and columns (two 8-wide registers per row).
const AVX2_MR: usize = 6;
const AVX2_NR: usize = 16;
/// The AVX-512 tile: rows, and 16-wide registers per row. 6 × 64 because the model's widths
/// (256, 1024, a head's 64) are multiples of 64, not of 48 (docs/performance-log/matmul.md,
/// "With AVX-512").
const AVX512_MR: usize = 6;
const AVX512_NV: usize = 4;
/// Panels of `lhs` packed at a time: `MC = MC_PANELS · MR` rows (`MC × KC` floats, 96 KiB, in
/// L2).
const MC_PANELS: usize = 16;
/// Products smaller than this (m·n·k) are not split across threads.
const SPLIT_MIN: usize = 1 << 18;

/// The register kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// 6 × 16 tiles in 8-wide registers (AVX2 and FMA).
    Avx2,
    /// 6 × 64 tiles in 16-wide registers (AVX-512F).
    Avx512,
}

impl Kernel {
    /// Rows of the register tile.
    const fn mr(self) -> usize {
        match self {
            Kernel::Avx2 => AVX2_MR,
            Kernel::Avx512 => AVX512_MR,
        }
    }

    /// Columns of the register tile.
    const fn nr(self) -> usize {
        match self {
            Kernel::Avx2 => AVX2_NR,
            Kernel::Avx512 => 16 * AVX512_NV,
        }
    }

    /// Whether this processor can run it.
    pub fn supported(self) -> bool {
        let avx2 = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma");
        match self {
            Kernel::Avx2 => avx2,
            Kernel::Avx512 => avx2 && is_x86_feature_detected!("avx512f"),
        }
    }
}

/// The kernel matrix products run on: the widest this processor supports, or none (then the
/// `gemm` crate runs them). `ATTNRES_GEMM=crate`, `=avx2` or `=avx512` overrides the choice
/// (a kernel only where supported), for side-by-side measurements.
pub fn chosen() -> Option<Kernel> {
    use std::sync::OnceLock;
    static CHOSEN: OnceLock<Option<Kernel>> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let widest = [Kernel::Avx512, Kernel::Avx2].into_iter().find(|k| k.supported());
        match std::env::var("ATTNRES_GEMM").as_deref() {
            Ok("crate") => None,
            Ok("avx2") => Some(Kernel::Avx2).filter(|k| k.supported()),
            Ok("avx512") => Some(Kernel::Avx512).filter(|k| k.supported()),
            _ => widest,
        }
    })
}

/// The destination: element (r, c) at `ptr + r·rs + c·cs`.
#[derive(Clone, Copy)]
struct Dst {
    ptr: *mut f32,
    rs: isize,
    cs: isize,
}

/// An operand (only read).
#[derive(Clone, Copy)]
struct Src(Strided);

impl Src {
    /// Element (r, c) as a pointer.
    unsafe fn at(self, r: usize, c: usize) -> *const f32 {
        self.0.ptr.offset(r as isize * self.0.rs + c as isize * self.0.cs)
    }
}

/// One product, or the part of one that a thread takes: `d[m, n] = (accumulate ? d : 0) +
/// alpha · a[m, k] · b[k, n]`.
#[derive(Clone, Copy)]
struct Product {
    m: usize,
    n: usize,
    k: usize,
    d: Dst,
    accumulate: bool,
    a: Src,
    b: Src,
    alpha: f32,
}

// SAFETY: addresses only. The threads of one product read the operands and write disjoint
// parts of the destination ([`Product::rows`], [`Product::cols`]), as `gemm`'s contract lets
// them.
unsafe impl Send for Product {}
unsafe impl Sync for Product {}

impl Product {
    /// Its rows `r0..r0 + m` (inside it).
    unsafe fn rows(self, r0: usize, m: usize) -> Product {
        let d = Dst { ptr: self.d.ptr.offset(r0 as isize * self.d.rs), ..self.d };
        Product { m, d, a: Src(Strided { ptr: self.a.at(r0, 0), ..self.a.0 }), ..self }
    }

    /// Its columns `c0..c0 + n` (inside it).
    unsafe fn cols(self, c0: usize, n: usize) -> Product {
        let d = Dst { ptr: self.d.ptr.offset(c0 as isize * self.d.cs), ..self.d };
        Product { n, d, b: Src(Strided { ptr: self.b.at(0, c0), ..self.b.0 }), ..self }
    }
}

/// `dst[m, n] = (accumulate ? dst : 0) + alpha · lhs[m, k] · rhs[k, n]` with `kernel` on up to
/// `threads` threads.
///
/// # Safety
/// `kernel` must be [`Kernel::supported`], and the contract of [`super::matmul::gemm_strided`]
/// holds: every view lies inside a live buffer, `dst` overlaps no input, and nothing else touches
/// `dst` meanwhile.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm(
    kernel: Kernel,
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
    threads: usize,
) {
    debug_assert!(kernel.supported());
    let d = Dst { ptr: dst, rs: dst_rs, cs: dst_cs };
    let (a, b) = (Src(lhs), Src(rhs));
    split(kernel, Product { m, n, k, d, accumulate, a, b, alpha }, threads.max(1));
}

/// Halves the destination along its longer side (rows in multiples of `MR`, columns of `NR`)
/// until each part has one thread.
unsafe fn split(kernel: Kernel, p: Product, threads: usize) {
    let (m, n, mr, nr) = (p.m, p.n, kernel.mr(), kernel.nr());
    if threads == 1 || m * n * p.k < SPLIT_MIN || (m < 2 * mr && n < 2 * nr) {
        return match kernel {
            Kernel::Avx2 => serial_avx2(p),
            Kernel::Avx512 => serial_avx512(p),
        };
    }
    let t1 = threads / 2;
    if (m >= n && m >= 2 * mr) || n < 2 * nr {
        let m1 = (m * t1 / threads).next_multiple_of(mr).min(m);
        rayon::join(
            || split(kernel, p.rows(0, m1), t1),
            || split(kernel, p.rows(m1, m - m1), threads - t1),
        );
    } else {
        let n1 = (n * t1 / threads).next_multiple_of(nr).min(n);
        rayon::join(
            || split(kernel, p.cols(0, n1), t1),
            || split(kernel, p.cols(n1, n - n1), threads - t1),
        );
    }
}

thread_local! {
    /// Each thread's packing buffers for `lhs` and `rhs`, kept between products (attention
    /// runs thousands of small ones per step).
    static PACKED: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `len` floats of `buf` from its first 64-byte boundary on, growing it as needed. A packed
/// row of `rhs` (`NR` floats) then starts a cache line, and the kernel's loads of it never
/// straddle two (the system allocator places large blocks 16 bytes past a boundary).
fn line_aligned(buf: &mut Vec<f32>, len: usize) -> &mut [f32] {
    // Floats to skip: at most 15, since a float's address is a multiple of 4. (Computed here
    // rather than by `align_offset`, whose contract lets it give up.)
    const MAX_SKIP: usize = 64 / 4 - 1;
    if buf.len() < len + MAX_SKIP {
        buf.resize(len + MAX_SKIP, 0.0);
    }
    let skip = (64 - buf.as_ptr() as usize % 64) % 64 / 4;
    &mut buf[skip..skip + len]
}

/// One register tile: `d[tile] = (overwrite ? 0 : d) + alpha · a · b` over `kc` steps, for
/// the first `rows × cols` of it. `a` is a packed `MR`-row panel (`kc` groups of `MR`), `b` a
/// packed `NR`-column panel (`kc` groups of `NR`).
type TileFn = unsafe fn(usize, *const f32, *const f32, Dst, usize, usize, bool, f32);

/// One thread's product with the AVX2 kernel.
#[target_feature(enable = "avx2,fma")]
unsafe fn serial_avx2(p: Product) {
    serial::<AVX2_MR, AVX2_NR>(p, tile_avx2)
}

/// One thread's product with the AVX-512 kernel.
#[target_feature(enable = "avx2,fma,avx512f")]
unsafe fn serial_avx512(p: Product) {
    serial::<AVX512_MR, { 16 * AVX512_NV }>(p, tile_avx512::<AVX512_MR, AVX512_NV>)
}

/// One thread's product: the blocked loops around `tile`, an `MR × NR` kernel.
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn serial<const MR: usize, const NR: usize>(p: Product, tile: TileFn) {
    let Product { m, n, k, d, accumulate, a, b, alpha } = p;
    let mc_max = MC_PANELS * MR;
    PACKED.with_borrow_mut(|(ap, bp)| {
        // Every value a kernel reads is written by the packing first (padding included), so
        // the buffers only grow, never need clearing.
        let ap = line_aligned(ap, KC * mc_max.min(m.next_multiple_of(MR)));
        // Whole panels of `rhs` at a time.
        let nc_max = NC / NR * NR;
        let bp = line_aligned(bp, KC * nc_max.min(n.next_multiple_of(NR)));
        for jc in (0..n).step_by(nc_max) {
            let nc = nc_max.min(n - jc);
            for pc in (0..k).step_by(KC) {
                let kc = KC.min(k - pc);
                for jr in (0..nc).step_by(NR) {
                    let cols = NR.min(nc - jr);
                    pack_rhs::<NR>(&mut bp[jr * kc..(jr + NR) * kc], b, pc, kc, jc + jr, cols);
                }
                let overwrite = pc == 0 && !accumulate;
                for ic in (0..m).step_by(mc_max) {
                    let mc = mc_max.min(m - ic);
                    for ir in (0..mc).step_by(MR) {
                        let rows = MR.min(mc - ir);
                        pack_lhs::<MR>(&mut ap[ir * kc..(ir + MR) * kc], a, ic + ir, rows, pc, kc);
                    }
                    for jr in (0..nc).step_by(NR) {
                        for ir in (0..mc).step_by(MR) {
                            let (rows, cols) = (MR.min(mc - ir), NR.min(nc - jr));
                            let at = (ic + ir) as isize * d.rs + (jc + jr) as isize * d.cs;
                            let t = Dst { ptr: d.ptr.offset(at), ..d };
                            for i in 0..rows {
                                // Every cache line of the tile's row i: every 16th element
                                // and the last (a row of `NR` spans up to `NR / 16 + 1`).
                                let row = t.ptr.offset(i as isize * t.rs);
                                for j in (0..cols).step_by(16).chain([cols - 1]) {
                                    _mm_prefetch::<_MM_HINT_T0>(
                                        row.offset(j as isize * t.cs).cast(),
                                    );
                                }
                            }
                            let (ap, bp) = (ap.as_ptr().add(ir * kc), bp.as_ptr().add(jr * kc));
                            tile(kc, ap, bp, t, rows, cols, overwrite, alpha);
                        }
                    }
                }
            }
        }
    });
}

/// The AVX2 kernel ([`TileFn`]): 6 × 16, row i of the tile in registers `2i` and `2i + 1`.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2(
    kc: usize,
    a: *const f32,
    b: *const f32,
    d: Dst,
    rows: usize,
    cols: usize,
    overwrite: bool,
    alpha: f32,
) {
    const MR: usize = AVX2_MR;
    // One step of `k`: the rank-1 update of the tile by column p of `a` and row p of `b`.
    let step = |c: &mut [__m256; 2 * MR], p: usize| {
        let (ap, bp) = (a.add(p * MR), b.add(p * AVX2_NR));
        let (b0, b1) = (_mm256_loadu_ps(bp), _mm256_loadu_ps(bp.add(8)));
        for i in 0..MR {
            let x = _mm256_broadcast_ss(&*ap.add(i));
            c[2 * i] = _mm256_fmadd_ps(x, b0, c[2 * i]);
            c[2 * i + 1] = _mm256_fmadd_ps(x, b1, c[2 * i + 1]);
        }
    };
    let mut c = [_mm256_setzero_ps(); 2 * MR];
    // Four steps per iteration, so the loop's own instructions cost a quarter as much.
    let mut p = 0;
    while p + 4 <= kc {
        for q in p..p + 4 {
            step(&mut c, q);
        }
        p += 4;
    }
    for q in p..kc {
        step(&mut c, q);
    }
    let al = _mm256_set1_ps(alpha);
    if d.cs == 1 && cols == AVX2_NR {
        for i in 0..rows {
            let p = d.ptr.offset(i as isize * d.rs);
            for (h, v) in [(0, c[2 * i]), (8, c[2 * i + 1])] {
                let out = match overwrite {
                    true => _mm256_mul_ps(al, v),
                    false => _mm256_fmadd_ps(al, v, _mm256_loadu_ps(p.add(h))),
                };
                _mm256_storeu_ps(p.add(h), out);
            }
        }
        return;
    }
    let mut t = [0.0f32; MR * AVX2_NR];
    for (i, v) in c.iter().enumerate() {
        _mm256_storeu_ps(t.as_mut_ptr().add(8 * i), *v);
    }
    store_by_element(&t, AVX2_NR, d, rows, cols, overwrite, alpha);
}

/// The AVX-512 kernel ([`TileFn`]): `MR × 16·NV`, row i of the tile in registers `c[i]`.
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<const MR: usize, const NV: usize>(
    kc: usize,
    a: *const f32,
    b: *const f32,
    d: Dst,
    rows: usize,
    cols: usize,
    overwrite: bool,
    alpha: f32,
) {
    let step = |c: &mut [[__m512; NV]; MR], p: usize| {
        let (ap, bp) = (a.add(p * MR), b.add(p * 16 * NV));
        let bv: [__m512; NV] = std::array::from_fn(|v| _mm512_loadu_ps(bp.add(16 * v)));
        for i in 0..MR {
            let x = _mm512_set1_ps(*ap.add(i));
            for v in 0..NV {
                c[i][v] = _mm512_fmadd_ps(x, bv[v], c[i][v]);
            }
        }
    };
    let mut c = [[_mm512_setzero_ps(); NV]; MR];
    let mut p = 0;
    while p + 4 <= kc {
        step(&mut c, p);
        step(&mut c, p + 1);
        step(&mut c, p + 2);
        step(&mut c, p + 3);
        p += 4;
    }
    for q in p..kc {
        step(&mut c, q);
    }
    let al = _mm512_set1_ps(alpha);
    if d.cs == 1 {
        // Full rows, or the first `cols` of each through a mask.
        let masks: [__mmask16; NV] = std::array::from_fn(|v| {
            let n = cols.saturating_sub(16 * v).min(16);
            ((1u32 << n) - 1) as __mmask16
        });
        for i in 0..rows {
            let p = d.ptr.offset(i as isize * d.rs);
            for v in 0..NV {
                let (q, m) = (p.add(16 * v), masks[v]);
                let out = match overwrite {
                    true => _mm512_mul_ps(al, c[i][v]),
                    false => _mm512_fmadd_ps(al, c[i][v], _mm512_maskz_loadu_ps(m, q)),
                };
                _mm512_mask_storeu_ps(q, m, out);
            }
        }
        return;
    }
    let mut t = [[[0.0f32; 16]; NV]; MR];
    for i in 0..MR {
        for v in 0..NV {
            _mm512_storeu_ps(t[i][v].as_mut_ptr(), c[i][v]);
        }
    }
    store_by_element(t.as_flattened().as_flattened(), 16 * NV, d, rows, cols, overwrite, alpha);
}

/// Edge tiles and column strides: the first `rows × cols` of `t` (rows of `nr`) into `d`, with
/// the operations of the vector stores, element by element.
unsafe fn store_by_element(
    t: &[f32],
    nr: usize,
    d: Dst,
    rows: usize,
    cols: usize,
    overwrite: bool,
    alpha: f32,
) {
    for i in 0..rows {
        for j in 0..cols {
            let p = d.ptr.offset(i as isize * d.rs + j as isize * d.cs);
            let v = t[i * nr + j];
            *p = if overwrite { alpha * v } else { alpha.mul_add(v, *p) };
        }
    }
}

/// The transpose of 8 rows of 8 values (`r[i]` is row i).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let lo = |x, y| _mm256_unpacklo_ps(x, y);
    let hi = |x, y| _mm256_unpackhi_ps(x, y);
    let t = [lo(r[0], r[1]), hi(r[0], r[1]), lo(r[2], r[3]), hi(r[2], r[3])];
    let u = [lo(r[4], r[5]), hi(r[4], r[5]), lo(r[6], r[7]), hi(r[6], r[7])];
    let s = |x: [__m256; 4]| {
        [
            _mm256_shuffle_ps::<0x44>(x[0], x[2]),
            _mm256_shuffle_ps::<0xEE>(x[0], x[2]),
            _mm256_shuffle_ps::<0x44>(x[1], x[3]),
            _mm256_shuffle_ps::<0xEE>(x[1], x[3]),
        ]
    };
    let (t, u) = (s(t), s(u));
    let join = |i: usize| _mm256_permute2f128_ps::<0x20>(t[i], u[i]);
    let join_hi = |i: usize| _mm256_permute2f128_ps::<0x31>(t[i], u[i]);
    [join(0), join(1), join(2), join(3), join_hi(0), join_hi(1), join_hi(2), join_hi(3)]
}

/// Packs rows `i0..i0 + rows` (zeros past them up to `MR`) and columns `p0..p0 + kc` of `a`
/// into `ap` (`kc` groups of `MR`).
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_lhs<const MR: usize>(
    ap: &mut [f32],
    a: Src,
    i0: usize,
    rows: usize,
    p0: usize,
    kc: usize,
) {
    assert!(ap.len() >= kc * MR);
    let out = ap.as_mut_ptr();
    if rows == MR && a.0.rs == 1 {
        // Each column of the panel is contiguous (a transposed operand).
        for p in 0..kc {
            std::ptr::copy_nonoverlapping(a.at(i0, p0 + p), out.add(p * MR), MR);
        }
        return;
    }
    let mut p = 0;
    if rows == MR && a.0.cs == 1 {
        // Rows contiguous along k: 8 columns at a time through a transpose (the rows past `MR`
        // unused; the kernels have at most 8).
        const { assert!(MR <= 8) };
        let mut r = [_mm256_setzero_ps(); 8];
        while p + 8 <= kc {
            for (i, ri) in r.iter_mut().enumerate().take(MR) {
                *ri = _mm256_loadu_ps(a.at(i0 + i, p0 + p));
            }
            let cols = transpose8(r);
            // Each column's MR values; the lanes past them are overwritten by the next one (the
            // last column is copied, so nothing is written past the panel).
            for (q, c) in cols.iter().enumerate().take(7) {
                _mm256_storeu_ps(out.add((p + q) * MR), *c);
            }
            let mut last = [0.0f32; 8];
            _mm256_storeu_ps(last.as_mut_ptr(), cols[7]);
            std::ptr::copy_nonoverlapping(last.as_ptr(), out.add((p + 7) * MR), MR);
            p += 8;
        }
    }
    for p in p..kc {
        for i in 0..MR {
            *out.add(p * MR + i) = if i < rows { *a.at(i0 + i, p0 + p) } else { 0.0 };
        }
    }
}

/// Packs rows `p0..p0 + kc` and columns `j0..j0 + cols` (zeros past them up to `NR`) of `b`
/// into `bp` (`kc` groups of `NR`).
#[target_feature(enable = "avx2,fma")]
unsafe fn pack_rhs<const NR: usize>(
    bp: &mut [f32],
    b: Src,
    p0: usize,
    kc: usize,
    j0: usize,
    cols: usize,
) {
    assert!(bp.len() >= kc * NR);
    let out = bp.as_mut_ptr();
    if cols == NR && b.0.cs == 1 {
        for p in 0..kc {
            std::ptr::copy_nonoverlapping(b.at(p0 + p, j0), out.add(p * NR), NR);
        }
        return;
    }
    let mut p = 0;
    if cols == NR && b.0.rs == 1 {
        // Columns contiguous along k (`rhs` = a weight, transposed): 8 × 8 transposes.
        while p + 8 <= kc {
            for h in (0..NR).step_by(8) {
                let r: [__m256; 8] =
                    std::array::from_fn(|j| _mm256_loadu_ps(b.at(p0 + p, j0 + h + j)));
                for (q, c) in transpose8(r).iter().enumerate() {
                    _mm256_storeu_ps(out.add((p + q) * NR + h), *c);
                }
            }
            p += 8;
        }
    }
    for p in p..kc {
        for j in 0..NR {
            *out.add(p * NR + j) = if j < cols { *b.at(p0 + p, j0 + j) } else { 0.0 };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `alpha · lhs · rhs` (+ `init`) in f64, element by element.
    fn naive(
        m: usize,
        n: usize,
        k: usize,
        a: Strided,
        b: Strided,
        alpha: f32,
        init: &[f32],
    ) -> Vec<f64> {
        let mut out = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for p in 0..k {
                    // SAFETY: inside the test's operands (m × k and k × n views).
                    let (x, y) = unsafe { (*Src(a).at(i, p), *Src(b).at(p, j)) };
                    s += x as f64 * y as f64;
                }
                out[i * n + j] = init[i * n + j] as f64 + alpha as f64 * s;
            }
        }
        out
    }

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n).map(|i| (((i + seed) * 7919) % 97) as f32 / 97.0 - 0.5).collect()
    }

    /// Every layout of both operands, shapes with ragged edges in each dimension, depths over
    /// several `KC` blocks, overwrite and accumulate, a column-strided destination, 1 to 3
    /// threads, each kernel the processor supports: against the f64 product, and the same bits
    /// on any number of threads and with either kernel.
    #[test]
    fn matches_the_naive_product_in_every_layout() {
        let kernels: Vec<Kernel> =
            [Kernel::Avx2, Kernel::Avx512].into_iter().filter(|k| k.supported()).collect();
        if kernels.is_empty() {
            eprintln!("skipped: this processor lacks AVX2 or FMA");
            return;
        }
        let mc = MC_PANELS * Kernel::Avx512.mr();
        let shapes = [(1, 1, 1), (5, 17, 3), (37, 53, 29), (6, 16, 2 * KC + 9), (12, 32, 9)];
        let more = [(2 * mc + 7, 40, KC + 1), (13, NC + 21, 8), (130, 129, 70), (25, 70, 17)];
        for (m, n, k) in shapes.into_iter().chain(more) {
            let (a, b) = (values(m * k, 1), values(k * n, 2));
            for (a_t, b_t, accumulate, dst_t) in [
                (false, false, false, false),
                (true, false, true, false),
                (false, true, false, true),
                (true, true, true, false),
            ] {
                let av = match a_t {
                    true => Strided::transposed(&a, m),
                    false => Strided::rows(&a, k),
                };
                let bv = match b_t {
                    true => Strided::transposed(&b, k),
                    false => Strided::rows(&b, n),
                };
                let init = if accumulate { values(m * n, 3) } else { vec![0.0; m * n] };
                let want = naive(m, n, k, av, bv, 0.5, &init);
                let mut outs = Vec::new();
                for (kernel, threads) in kernels.iter().flat_map(|&g| [(g, 1), (g, 2), (g, 3)]) {
                    // Row-major, or column-major (`dst_t`) with the result read back transposed.
                    let mut c = if dst_t { vec![f32::NAN; m * n] } else { init.clone() };
                    let (rs, cs) = if dst_t { (1, m as isize) } else { (n as isize, 1) };
                    // SAFETY: the kernel is supported (filtered above); `c` holds m × n, `a`
                    // m × k, `b` k × n, in the layouts the views describe.
                    unsafe {
                        gemm(
                            kernel,
                            m,
                            n,
                            k,
                            c.as_mut_ptr(),
                            rs,
                            cs,
                            accumulate,
                            av,
                            bv,
                            0.5,
                            threads,
                        )
                    };
                    if dst_t {
                        c = (0..m * n).map(|e| c[(e % n) * m + e / n]).collect();
                    }
                    let label =
                        format!("{kernel:?} {m}x{n}x{k} a_t={a_t} b_t={b_t} acc={accumulate}");
                    for (e, (x, y)) in c.iter().zip(&want).enumerate() {
                        let tol = 1e-6 * (1.0 + k as f64).sqrt();
                        assert!((*x as f64 - y).abs() <= tol, "{label} [{e}]: {x} vs {y}");
                    }
                    outs.push(c);
                }
                let same = outs.iter().all(|c| *c == outs[0]);
                assert!(same, "{m}x{n}x{k}: threads or kernels change the bits");
            }
        }
    }
}
