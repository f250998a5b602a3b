//! [`super::dot::dot_q8`] on x86-64, in two instruction sets made from one body: AVX2 (with FMA
//! and F16C) and, where the processor has it, AVX-512 VNNI on 256-bit registers. Per block the
//! 32 integer products are summed in one register, exactly (AVX2: `vpmaddubsw` on the weights'
//! magnitudes and the activations with the weights' signs, then `vpmaddwd`; VNNI: `vpdpbusd`
//! on the same operands), converted to f32 and added into an f32 accumulator scaled by both
//! blocks' scales; the eight lanes are summed once per row. The sums run in another order than
//! the portable code's, so they agree with it within f32 rounding, not bit for bit.

use super::Format;
use std::arch::x86_64::*;
use std::sync::OnceLock;

/// The instruction sets, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Vnni,
    Avx2,
}

/// The best instruction set this processor has for the block products, if any (`NO_VNNI` in
/// the environment passes over VNNI). In tests, [`with_isa`] may choose another on a thread.
pub fn isa() -> Option<Isa> {
    #[cfg(test)]
    if let Some(forced) = FORCED.with(|f| f.get()) {
        return forced;
    }
    static ISA: OnceLock<Option<Isa>> = OnceLock::new();
    *ISA.get_or_init(|| match forms()[..] {
        [Some(Isa::Vnni), ..] if std::env::var_os("NO_VNNI").is_some() => Some(Isa::Avx2),
        [best, ..] => best,
        [] => None,
    })
}

/// Every form of the block products this processor runs, best first: its instruction sets,
/// then the portable code (`None`).
pub fn forms() -> Vec<Option<Isa>> {
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c");
    let vnni =
        avx2 && is_x86_feature_detected!("avx512vnni") && is_x86_feature_detected!("avx512vl");
    let mut forms = Vec::new();
    if vnni {
        forms.push(Some(Isa::Vnni));
    }
    if avx2 {
        forms.push(Some(Isa::Avx2));
    }
    forms.push(None);
    forms
}

#[cfg(test)]
thread_local! {
    static FORCED: std::cell::Cell<Option<Option<Isa>>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with [`isa`] giving `form` on this thread (one of [`forms`]): so that the tests of
/// a VNNI machine check the AVX2 and portable kernels too. Only what runs on this thread sees
/// it, not the thread pool's workers.
#[cfg(test)]
pub fn with_isa<T>(form: Option<Isa>, f: impl FnOnce() -> T) -> T {
    assert!(forms().contains(&form), "this processor cannot run {form:?}");
    let before = FORCED.with(|c| c.replace(Some(form)));
    let out = f();
    FORCED.with(|c| c.set(before));
    out
}

/// The sum of the eight lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn sum_f32(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// A block's f16 scale (its first two bytes).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn scale(w: &[u8]) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes([w[0], w[1]]) as i32)))
}

/// A Q8_0 or Q4_0 block's 32 values as signed bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn values(format: Format, w: &[u8]) -> __m256i {
    // SAFETY (both arms): a Q8_0 block holds 32 bytes after its scale, a Q4_0 block 16;
    // unaligned loads.
    match format {
        Format::Q8_0 => unsafe { _mm256_loadu_si256(w[2..].as_ptr() as *const __m256i) },
        _ => {
            let bytes = unsafe { _mm_loadu_si128(w[2..].as_ptr() as *const __m128i) };
            let low = _mm_and_si128(bytes, _mm_set1_epi8(0x0f));
            let high = _mm_and_si128(_mm_srli_epi16::<4>(bytes), _mm_set1_epi8(0x0f));
            _mm256_sub_epi8(_mm256_set_m128i(high, low), _mm256_set1_epi8(8))
        }
    }
}

/// Eight exact partial sums of `|w[j]| · (x[j] with w[j]'s sign)` over 32 pairs of bytes.
/// vpmaddubsw's 16-bit pair sums cannot saturate: |w| ≤ 128 and |x| ≤ 127 (Q8_0 stores
/// -127..127), 2·128·127 < 2^15.
#[inline]
#[target_feature(enable = "avx2")]
fn products_avx2(wabs: __m256i, xs: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xs), _mm256_set1_epi16(1))
}

/// [`products_avx2`] in one instruction, without intermediate 16-bit sums.
#[inline]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
fn products_vnni(wabs: __m256i, xs: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), wabs, xs)
}

/// `acc` plus the eight partial sums of [`products_avx2`].
#[inline]
#[target_feature(enable = "avx2")]
fn add_products_avx2(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi32(acc, products_avx2(a, b))
}

/// [`add_products_avx2`] in one instruction.
#[inline]
#[target_feature(enable = "avx2,avx512vnni,avx512vl")]
fn add_products_vnni(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, a, b)
}

/// Four activation bytes (values `at..at + 4` of a block's 32) in every 32-bit lane.
#[inline]
#[target_feature(enable = "avx2")]
fn broadcast4(xs: &[u8], at: usize) -> __m256i {
    let four = &xs[at..at + 4];
    _mm256_set1_epi32(i32::from_le_bytes([four[0], four[1], four[2], four[3]]))
}

/// [`super::dot`]'s `quantize_block` in AVX2: the largest magnitude, the scale and its
/// inverse as the reference computes them, each value times the inverse rounded half away
/// from zero (as `f32::round`: truncate, then step away from zero where the dropped part is at
/// least one half, which is exact), packed to bytes. `None`, writing nothing, for a block with a
/// value that is not finite or one whose inverse scale is: the portable code's conversions of
/// NaN and infinities to bytes are not the vector instructions'.
///
/// # Safety
/// The processor must have AVX2, FMA and F16C ([`isa`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_block(x: &[f32; 32], out: &mut [u8]) -> Option<(f32, i32)> {
    assert!(out.len() == 34);
    let sign = _mm256_set1_ps(-0.0);
    // SAFETY: `x` holds 32 values; unaligned loads.
    let v: [__m256; 4] = std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) });
    let abs = v.map(|v| _mm256_andnot_ps(sign, v));
    let inf = _mm256_set1_ps(f32::INFINITY);
    let finite =
        abs.iter().fold(0xff, |m, &a| m & _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_LT_OQ>(a, inf)));
    if finite != 0xff {
        return None;
    }
    let m = _mm256_max_ps(_mm256_max_ps(abs[0], abs[1]), _mm256_max_ps(abs[2], abs[3]));
    let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    if id.is_infinite() {
        // Largest magnitude below 127 times the smallest normal: the products are infinite or
        // NaN.
        return None;
    }
    let id = _mm256_set1_ps(id);
    let (one, half) = (_mm256_set1_ps(1.0), _mm256_set1_ps(0.5));
    let q = v.map(|v| {
        let t = _mm256_mul_ps(v, id);
        let whole = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(t);
        let dropped = _mm256_andnot_ps(sign, _mm256_sub_ps(t, whole));
        let away = _mm256_or_ps(_mm256_and_ps(t, sign), one);
        let step = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(dropped, half), away);
        _mm256_cvttps_epi32(_mm256_add_ps(whole, step))
    });
    let sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    let sum = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256::<1>(sum));
    let sum = _mm_add_epi32(sum, _mm_shuffle_epi32::<0b01_00_11_10>(sum));
    let sum = _mm_cvtsi128_si32(_mm_add_epi32(sum, _mm_shuffle_epi32::<0b10_11_00_01>(sum)));
    // The packs work within 128-bit halves; the permutation puts the 32 bytes back in order.
    let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    let h = super::f32_to_f16(d);
    out[..2].copy_from_slice(&h.to_le_bytes());
    // SAFETY: `out` holds 34 bytes (checked above); an unaligned store of 32 from byte 2.
    unsafe { _mm256_storeu_si256(out[2..].as_mut_ptr() as *mut __m256i, bytes) };
    Some((super::f16_to_f32(h), sum))
}

/// [`super::dot::dot_f16_many`]: eight values of a row converted from F16 at once and
/// multiplied into each token's accumulators; the same operations as the portable code.
///
/// # Safety
/// The processor must have AVX2, FMA and F16C ([`isa`]); every row must hold two bytes per
/// value of every token.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16_many<const R: usize, const T: usize>(
    rows: [&[u8]; R],
    xs: [&[f32]; T],
) -> [[f32; T]; R] {
    let k = xs.first().map_or(0, |x| x.len());
    let whole = k / 32 * 32;
    let mut acc = [[[_mm256_setzero_ps(); 4]; T]; R];
    for j in (0..whole).step_by(32) {
        for a in 0..4 {
            let at = j + 8 * a;
            // SAFETY: values at..at + 8 lie inside every row and token (`whole` ≤ k);
            // unaligned loads.
            let x: [__m256; T] = xs.map(|x| unsafe { _mm256_loadu_ps(x.as_ptr().add(at)) });
            for (acc, row) in acc.iter_mut().zip(rows) {
                let w = unsafe { _mm_loadu_si128(row.as_ptr().add(2 * at) as *const __m128i) };
                let w = _mm256_cvtph_ps(w);
                for (acc, &x) in acc.iter_mut().zip(&x) {
                    acc[a] = _mm256_fmadd_ps(w, x, acc[a]);
                }
            }
        }
    }
    let mut out = [[0.0f32; T]; R];
    for ((out, acc), row) in out.iter_mut().zip(&acc).zip(rows) {
        for ((o, a), x) in out.iter_mut().zip(acc).zip(xs) {
            let lanes = _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
            let mut sum = sum_f32(lanes);
            for j in whole..k {
                let h = super::f16_to_f32(u16::from_le_bytes([row[2 * j], row[2 * j + 1]]));
                sum = h.mul_add(x[j], sum);
            }
            *o = sum;
        }
    }
    out
}

macro_rules! kernels {
    ($name:ident, $features:literal, $products:ident, $add_products:ident) => {
        /// The kernels for one instruction set.
        pub mod $name {
            use super::*;

            /// [`super::super::dot::dot_q8`].
            ///
            /// # Safety
            /// The processor must have this module's instruction set ([`isa`]); `row` and `xq`
            /// whole blocks of `format` (Q8_0 or Q4_0) and of Q8_0, as many.
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q8(format: Format, row: &[u8], xq: &[u8]) -> f32 {
                // One accumulator, as in the kernels below: every kernel gives a row and a
                // token the same bits, whatever else runs with them (batch invariance).
                let mut acc = _mm256_setzero_ps();
                for (w, x) in row.chunks_exact(format.block_bytes()).zip(xq.chunks_exact(34)) {
                    // SAFETY: a Q8_0 block holds 32 bytes after its scale.
                    let xs = unsafe { _mm256_loadu_si256(x[2..].as_ptr() as *const __m256i) };
                    let ws = unsafe { values(format, w) };
                    let sum = $products(_mm256_sign_epi8(ws, ws), _mm256_sign_epi8(xs, ws));
                    let d = _mm256_set1_ps(scale(w) * scale(x));
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), d, acc);
                }
                sum_f32(acc)
            }

            /// [`dot_q8`] of one row with four activation rows at once (prefill): the row's
            /// block is loaded, unpacked and its scale converted once for all four. `xd` holds
            /// each activation block's scale as f32.
            ///
            /// # Safety
            /// As [`dot_q8`], for each of the four activation rows.
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q8_x4(
                format: Format,
                row: &[u8],
                xq: [&[u8]; 4],
                xd: [&[f32]; 4],
            ) -> [f32; 4] {
                let mut acc = [_mm256_setzero_ps(); 4];
                for (b, w) in row.chunks_exact(format.block_bytes()).enumerate() {
                    let ws = unsafe { values(format, w) };
                    let (wabs, dw) = (_mm256_sign_epi8(ws, ws), scale(w));
                    for j in 0..4 {
                        // SAFETY: block `b` lies inside `xq[j]` (as many blocks as the row).
                        let xs = unsafe {
                            _mm256_loadu_si256(xq[j][b * 34 + 2..].as_ptr() as *const __m256i)
                        };
                        let sum = $products(wabs, _mm256_sign_epi8(xs, ws));
                        let d = _mm256_set1_ps(dw * xd[j][b]);
                        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), d, acc[j]);
                    }
                }
                acc.map(|a| sum_f32(a))
            }

            /// [`dot_q8`] of four rows with one activation row (decoding): the activations'
            /// block is loaded once for all four rows. `xd` holds each activation block's
            /// scale as f32.
            ///
            /// # Safety
            /// As [`dot_q8`], for each of the four rows.
            #[target_feature(enable = $features)]
            pub unsafe fn dot_q8_rows4(
                format: Format,
                rows: [&[u8]; 4],
                xq: &[u8],
                xd: &[f32],
            ) -> [f32; 4] {
                let mut acc = [_mm256_setzero_ps(); 4];
                let bb = format.block_bytes();
                for (b, x) in xq.chunks_exact(34).enumerate() {
                    // SAFETY: an activation block holds 32 bytes after its scale; block `b`
                    // lies inside every row (as many blocks as the activations).
                    let xs = unsafe { _mm256_loadu_si256(x[2..].as_ptr() as *const __m256i) };
                    for j in 0..4 {
                        let w = &rows[j][b * bb..(b + 1) * bb];
                        let ws = unsafe { values(format, w) };
                        let sum = $products(_mm256_sign_epi8(ws, ws), _mm256_sign_epi8(xs, ws));
                        let d = _mm256_set1_ps(scale(w) * xd[b]);
                        acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), d, acc[j]);
                    }
                }
                acc.map(|a| sum_f32(a))
            }

            /// [`super::super::packed::group_dot`]: each lane one of a group's eight rows.
            ///
            /// # Safety
            /// The processor must have this module's instruction set ([`isa`]); the sizes as
            /// `group_dot` checks them.
            #[target_feature(enable = $features)]
            pub unsafe fn group_dot(
                format: Format,
                packed: &[u8],
                x: &super::super::packed::Activations,
                y: &mut [f32],
            ) {
                let blocks = x.scales.len();
                let gb = super::super::packed::group_block_bytes(format);
                for (group, out) in packed.chunks_exact(blocks * gb).zip(y.chunks_exact_mut(8)) {
                    let mut acc = _mm256_setzero_ps();
                    for (b, g) in group.chunks_exact(gb).enumerate() {
                        let xs = &x.blocks[b * 34 + 2..b * 34 + 34];
                        // SAFETY: a group's block starts with 16 bytes of scales, then 256
                        // (Q8_0) or 128 (Q4_0) of values; unaligned loads.
                        let scales = unsafe { _mm_loadu_si128(g.as_ptr() as *const __m128i) };
                        let d = _mm256_mul_ps(_mm256_cvtph_ps(scales), _mm256_set1_ps(x.scales[b]));
                        let load = |c: usize| unsafe {
                            _mm256_loadu_si256(g[16 + 32 * c..].as_ptr() as *const __m256i)
                        };
                        let mut sum = _mm256_setzero_si256();
                        if format == Format::Q8_0 {
                            for c in 0..8 {
                                let (w, xb) = (load(c), broadcast4(xs, 4 * c));
                                sum = $add_products(
                                    sum,
                                    _mm256_sign_epi8(w, w),
                                    _mm256_sign_epi8(xb, w),
                                );
                            }
                        } else {
                            let low = _mm256_set1_epi8(0x0f);
                            for c in 0..4 {
                                let v = load(c);
                                let lo = _mm256_and_si256(v, low);
                                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                                sum = $add_products(sum, lo, broadcast4(xs, 4 * c));
                                sum = $add_products(sum, hi, broadcast4(xs, 16 + 4 * c));
                            }
                            // The stored values are q + 8.
                            sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(8 * x.sums[b]));
                        }
                        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), d, acc);
                    }
                    // SAFETY: `out` holds eight values.
                    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
                }
            }

            /// [`group_dot`] for four tokens at once (prefill): each group's block is loaded,
            /// unpacked and its scales converted once for the four; every lane computes what
            /// `group_dot` computes for its row and token, in the same order. `y` holds the
            /// four tokens' outputs one after another.
            ///
            /// # Safety
            /// As [`group_dot`], for each token.
            #[target_feature(enable = $features)]
            pub unsafe fn group_dot4(
                format: Format,
                packed: &[u8],
                x: [&super::super::packed::Activations; 4],
                y: &mut [f32],
            ) {
                let blocks = x[0].scales.len();
                let gb = super::super::packed::group_block_bytes(format);
                let width = y.len() / 4;
                let [x0, x1, x2, x3] = x;
                // SAFETY (the loads below): every activation row holds `blocks` blocks of 34
                // bytes, a group's block 16 bytes of scales and then its values.
                let bcast = |x: &super::super::packed::Activations, b: usize, at: usize| unsafe {
                    _mm256_set1_epi32(
                        (x.blocks.as_ptr().add(b * 34 + 2 + at) as *const i32).read_unaligned(),
                    )
                };
                let low = _mm256_set1_epi8(0x0f);
                for (gi, group) in packed.chunks_exact(blocks * gb).enumerate() {
                    let (mut a0, mut a1, mut a2, mut a3) = (
                        _mm256_setzero_ps(),
                        _mm256_setzero_ps(),
                        _mm256_setzero_ps(),
                        _mm256_setzero_ps(),
                    );
                    for (b, g) in group.chunks_exact(gb).enumerate() {
                        let gp = g.as_ptr();
                        let dw = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(gp as *const __m128i) });
                        let load = |c: usize| unsafe {
                            _mm256_loadu_si256(gp.add(16 + 32 * c) as *const __m256i)
                        };
                        let z = _mm256_setzero_si256();
                        let (mut s0, mut s1, mut s2, mut s3) = (z, z, z, z);
                        if format == Format::Q8_0 {
                            for c in 0..8 {
                                let w = load(c);
                                let wabs = _mm256_sign_epi8(w, w);
                                s0 = $add_products(
                                    s0,
                                    wabs,
                                    _mm256_sign_epi8(bcast(x0, b, 4 * c), w),
                                );
                                s1 = $add_products(
                                    s1,
                                    wabs,
                                    _mm256_sign_epi8(bcast(x1, b, 4 * c), w),
                                );
                                s2 = $add_products(
                                    s2,
                                    wabs,
                                    _mm256_sign_epi8(bcast(x2, b, 4 * c), w),
                                );
                                s3 = $add_products(
                                    s3,
                                    wabs,
                                    _mm256_sign_epi8(bcast(x3, b, 4 * c), w),
                                );
                            }
                        } else {
                            for c in 0..4 {
                                let v = load(c);
                                let lo = _mm256_and_si256(v, low);
                                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                                let (l, h) = (4 * c, 16 + 4 * c);
                                s0 = $add_products(s0, lo, bcast(x0, b, l));
                                s0 = $add_products(s0, hi, bcast(x0, b, h));
                                s1 = $add_products(s1, lo, bcast(x1, b, l));
                                s1 = $add_products(s1, hi, bcast(x1, b, h));
                                s2 = $add_products(s2, lo, bcast(x2, b, l));
                                s2 = $add_products(s2, hi, bcast(x2, b, h));
                                s3 = $add_products(s3, lo, bcast(x3, b, l));
                                s3 = $add_products(s3, hi, bcast(x3, b, h));
                            }
                            // The stored values are q + 8.
                            let off = |x: &super::super::packed::Activations| {
                                _mm256_set1_epi32(8 * x.sums[b])
                            };
                            s0 = _mm256_sub_epi32(s0, off(x0));
                            s1 = _mm256_sub_epi32(s1, off(x1));
                            s2 = _mm256_sub_epi32(s2, off(x2));
                            s3 = _mm256_sub_epi32(s3, off(x3));
                        }
                        let d = |x: &super::super::packed::Activations| {
                            _mm256_mul_ps(dw, _mm256_set1_ps(x.scales[b]))
                        };
                        a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), d(x0), a0);
                        a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), d(x1), a1);
                        a2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s2), d(x2), a2);
                        a3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s3), d(x3), a3);
                    }
                    // SAFETY: `y` holds four rows of `width` values, each eight per group.
                    unsafe {
                        let o = y.as_mut_ptr().add(8 * gi);
                        _mm256_storeu_ps(o, a0);
                        _mm256_storeu_ps(o.add(width), a1);
                        _mm256_storeu_ps(o.add(2 * width), a2);
                        _mm256_storeu_ps(o.add(3 * width), a3);
                    }
                }
            }
        }
    };
}

kernels!(avx2, "avx2,fma,f16c", products_avx2, add_products_avx2);
kernels!(vnni, "avx2,fma,f16c,avx512vnni,avx512vl", products_vnni, add_products_vnni);
