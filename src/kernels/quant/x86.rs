//! The block products on x86-64, in two instruction sets made from one body: AVX2 (with FMA
//! and F16C) and, where the processor has it, AVX-512 VNNI on 256-bit registers. Per slice of
//! 32 values the integer products are summed exactly (AVX2: `vpmaddubsw` on unsigned weights,
//! or the weights' magnitudes and the activations with the weights' signs, then `vpmaddwd`;
//! VNNI: `vpdpbusd` on the same operands); the layouts ([`super::packed::Layout`]) turn the
//! sums into f32 with their scales, in the portable code's order of operations. Also the
//! activations' quantiser and the F16 products. [`isa`] chooses the form at run time, once;
//! [`crate::by_isa`] is where the code branches on it.

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
    // The VNNI kernel also runs two groups at once in 512-bit registers (`lanes::Sixteen`).
    let vnni = avx2
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni");
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
pub unsafe fn quantize_block(x: &[f32; 32], out: &mut [u8]) -> Option<(f32, [i32; 2])> {
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
    let sum = |a: __m256i, b: __m256i| {
        let s = _mm256_add_epi32(a, b);
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)))
    };
    let sums = [sum(q[0], q[1]), sum(q[2], q[3])];
    // The packs work within 128-bit halves; the permutation puts the 32 bytes back in order.
    let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    let h = super::f32_to_f16(d);
    out[..2].copy_from_slice(&h.to_le_bytes());
    // SAFETY: `out` holds 34 bytes (checked above); an unaligned store of 32 from byte 2.
    unsafe { _mm256_storeu_si256(out[2..].as_mut_ptr() as *mut __m256i, bytes) };
    Some((super::f16_to_f32(h), sums))
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
        for row in rows {
            // A prefetch hint ahead of each row's stream (hints never fault, past the
            // row's end too).
            _mm_prefetch::<_MM_HINT_T0>(row.as_ptr().wrapping_add(2 * j + PREFETCH) as *const i8);
        }
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

/// [`super::dot::f16_to_f32_slice`].
///
/// # Safety
/// The processor has F16C; `bytes` holds two bytes per value of `out`.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn f16_to_f32_slice(bytes: &[u8], out: &mut [f32]) {
    assert!(bytes.len() == 2 * out.len());
    let whole = out.len() / 8 * 8;
    for (o, b) in out[..whole].chunks_exact_mut(8).zip(bytes.chunks_exact(16)) {
        // SAFETY: sixteen bytes in, eight floats out (the chunks); unaligned.
        unsafe {
            let h = _mm_loadu_si128(b.as_ptr() as *const __m128i);
            _mm256_storeu_ps(o.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
    }
    for (o, b) in out[whole..].iter_mut().zip(bytes[2 * whole..].chunks_exact(2)) {
        *o = super::half(b);
    }
}

/// `acc` plus the exact sums of four products each, `u[j] · s[j]`, of unsigned bytes `u` and
/// signed bytes `s` (each sum in the 32-bit lane of its four bytes). vpmaddubsw's 16-bit pair
/// sums cannot saturate: every caller's `u` is at most 128 and `|s|` at most 127 (Q8_0
/// activations hold -127..127), 2·128·127 < 2^15.
pub trait Products {
    /// # Safety
    /// The processor has the instruction set.
    unsafe fn add(acc: __m256i, u: __m256i, s: __m256i) -> __m256i;
}

/// [`Products`] with AVX2: `vpmaddubsw`, then `vpmaddwd` by ones.
pub struct Avx2;
/// [`Products`] in one instruction, `vpdpbusd`, without intermediate 16-bit sums.
pub struct Vnni;

impl Products for Avx2 {
    #[inline(always)]
    unsafe fn add(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: the caller's (AVX2).
        unsafe {
            _mm256_add_epi32(
                acc,
                _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)),
            )
        }
    }
}

impl Products for Vnni {
    #[inline(always)]
    unsafe fn add(acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        // SAFETY: the caller's (AVX-512 VNNI and VL).
        unsafe { _mm256_dpbusd_epi32(acc, u, s) }
    }
}

/// How far ahead of the bytes they multiply the kernels ask for the next ones: the hardware's
/// own prefetching left decoding short of the memory's bandwidth.
const PREFETCH: usize = 4096;

macro_rules! kernels {
    (@wide $gi:ident, $groups:ident, $group:ident, $packed:ident, $x:ident, $blocks:ident, $y:ident) => {
        // Two groups at a time in 512-bit registers, then a last one alone.
        while $gi + 2 <= $groups {
            let w = Sixteen { stride: $group };
            // SAFETY: the caller's; groups `gi` and `gi + 1` lie inside `packed`.
            unsafe { run_groups::<Sixteen, L, T>(w, &$packed[$gi * $group..], $x, $blocks, $y, $gi) };
            $gi += 2;
        }
    };
    ($name:ident, $features:literal, $products:ty $(, $wide:ident)?) => {
        /// The products of the regrouped layouts for one instruction set.
        pub mod $name {
            #[allow(unused_imports)]
            use super::super::lanes::{Eight, Lanes, Sixteen};
            use super::super::packed::{Layout, RawActivations, XBlock, ROWS};
            use super::*;

            /// [`super::super::packed::Kernels`]: the products of `T` tokens (`blocks` blocks
            /// each, at `x`) with every group of `packed`, outputs one after another in `y`.
            ///
            /// # Safety
            /// The processor has this module's instruction set ([`isa`]); `x` holds `T` tokens'
            /// blocks, and the sizes agree as the portable kernel's caller checks them.
            #[target_feature(enable = $features)]
            pub unsafe fn products<L: Layout, const T: usize>(
                packed: &[u8],
                x: RawActivations,
                blocks: usize,
                y: &mut [f32],
            ) {
                let group = blocks * 32 / L::VALUES * L::GROUP_BLOCK;
                let groups = packed.len() / group;
                let mut gi = 0;
                $(kernels!(@$wide gi, groups, group, packed, x, blocks, y);)?
                while gi < groups {
                    // SAFETY: the caller's; group `gi` lies inside `packed`.
                    unsafe {
                        run_groups::<Eight, L, T>(Eight, &packed[gi * group..], x, blocks, y, gi)
                    };
                    gi += 1;
                }
            }

            /// The products of the group (or two) that `w` covers, starting at group `gi`
            /// at the start of `packed`.
            ///
            /// # Safety
            /// As [`products`]; `packed` holds the groups `w` reads.
            #[inline(always)]
            unsafe fn run_groups<W: Lanes, L: Layout, const T: usize>(
                w: W,
                packed: &[u8],
                x: RawActivations,
                blocks: usize,
                y: &mut [f32],
                gi: usize,
            ) {
                let slices = L::VALUES / 32;
                let width = y.len() / T;
                // SAFETY: block `k` lies inside every token's activations, and each group
                // block read (at `g`, and `stride` on for two groups) is whole (the sizes agree).
                unsafe {
                    let mut acc = [w.zero_f(); T];
                    for b in 0..blocks / slices {
                        let g = packed.as_ptr().add(b * L::GROUP_BLOCK);
                        for line in (0..L::GROUP_BLOCK).step_by(64) {
                            w.prefetch(g.wrapping_add(PREFETCH + line));
                        }
                        let mut part = [[w.zero_f(); 2]; T];
                        for s in 0..slices {
                            let k = b * slices + s;
                            // Loops, not `array::map`, whose closures are not always
                            // inlined here.
                            let mut xp = [std::ptr::null(); T];
                            let mut xn = [std::ptr::null(); T];
                            let mut xb = [XBlock::default(); T];
                            for t in 0..T {
                                let i = x.at(t, k);
                                xp[t] = x.values(i);
                                xn[t] = x.neg32(i);
                                xb[t] = x.block(i);
                            }
                            let sums = L::sums::<W, $products, T>(w, g, s, xp, xn);
                            L::add_lanes::<W, T>(w, g, s, sums, xb, &mut acc, &mut part);
                        }
                        L::finish_lanes::<W, T>(w, g, part, &mut acc);
                    }
                    for (t, acc) in acc.iter().enumerate() {
                        let at = t * width + ROWS * gi;
                        assert!(at + W::ROWS <= (t + 1) * width);
                        w.store(y.as_mut_ptr().add(at), *acc);
                    }
                }
            }
        }
    };
}

kernels!(avx2, "avx2,fma,f16c", Avx2);
kernels!(vnni, "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl", Vnni, wide);
