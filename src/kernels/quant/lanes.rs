//! The vectors the regrouped products are written in ([`super::packed::Layout`]): one group of
//! eight rows in the lanes of a 256-bit register ([`Eight`]), or two neighbouring groups in a
//! 512-bit one ([`Sixteen`], where the processor has AVX-512 with VNNI). Both make the same
//! operations lane for lane, so a row gets the same bits from either; sixteen lanes do twice
//! the work per instruction at about the same rate on the processors that have them.
//!
//! Each method is `inline(always)`: inlined into the kernels ([`super::x86`]), which enable the
//! instruction sets.

use super::x86::Products;
use std::arch::x86_64::*;

/// The operations of the layouts' vector code, on one group's lanes or two groups'.
///
/// # Safety
/// Every method: the processor has what the kernel inlining it enables (AVX2, FMA and F16C for
/// [`Eight`]; AVX-512 F, BW, VL and VNNI besides for [`Sixteen`]), and the bytes read at a
/// pointer are there, for each group ([`Sixteen`]: again `stride` bytes on).
pub trait Lanes: Copy {
    /// 32-bit integer lanes.
    type I: Copy;
    /// f32 lanes.
    type F: Copy;
    /// Rows: 8 or 16.
    const ROWS: usize;

    unsafe fn zero(self) -> Self::I;
    unsafe fn zero_f(self) -> Self::F;
    /// 32 bytes of each group at `p`, unaligned.
    unsafe fn load(self, p: *const u8) -> Self::I;
    /// The four bytes at `p` in every 32-bit lane.
    unsafe fn bcast4(self, p: *const u8) -> Self::I;
    /// `acc` plus, in each 32-bit lane, the products of the four unsigned bytes of `u` with the
    /// four signed bytes of `s`.
    unsafe fn dot<P: Products>(self, acc: Self::I, u: Self::I, s: Self::I) -> Self::I;
    /// [`Lanes::dot`] of signed bytes `w`: their magnitudes with `x` signed by `w`.
    unsafe fn dot_signed<P: Products>(self, acc: Self::I, w: Self::I, x: Self::I) -> Self::I;
    unsafe fn set1_i8(self, v: i8) -> Self::I;
    unsafe fn and(self, a: Self::I, b: Self::I) -> Self::I;
    unsafe fn or(self, a: Self::I, b: Self::I) -> Self::I;
    /// Each 16-bit lane shifted right by 4.
    unsafe fn shr4(self, a: Self::I) -> Self::I;
    /// Each 16-bit lane shifted left by `n` bits, or right by `-n`.
    unsafe fn shift(self, a: Self::I, n: i32) -> Self::I;
    unsafe fn add_i32(self, a: Self::I, b: Self::I) -> Self::I;
    unsafe fn sub_i32(self, a: Self::I, b: Self::I) -> Self::I;
    unsafe fn splat_i32(self, v: i32) -> Self::I;
    unsafe fn to_f32(self, a: Self::I) -> Self::F;
    /// Eight f16 of each group at `p`, as f32.
    unsafe fn halves(self, p: *const u8) -> Self::F;
    /// Eight unsigned bytes of each group at `p`, as f32.
    unsafe fn bytes_u8(self, p: *const u8) -> Self::F;
    /// Eight signed bytes of each group at `p`, as f32.
    unsafe fn bytes_i8(self, p: *const u8) -> Self::F;
    unsafe fn splat(self, v: f32) -> Self::F;
    unsafe fn mul(self, a: Self::F, b: Self::F) -> Self::F;
    /// `a·b + c`, rounded once.
    unsafe fn fma(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// `c − a·b`, rounded once.
    unsafe fn fnma(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    /// The lanes to `p` (`ROWS` floats).
    unsafe fn store(self, p: *mut f32, v: Self::F);
    /// A hint to fetch the cache line at `p` of each group (never faults).
    unsafe fn prefetch(self, p: *const u8);
}

/// One group of eight rows in a 256-bit register.
#[derive(Clone, Copy)]
pub struct Eight;

/// Two neighbouring groups in a 512-bit register, the second's bytes `stride` after the
/// first's. Only the VNNI kernel uses it, so its products are `vpdpbusd` whatever `P` is.
#[derive(Clone, Copy)]
pub struct Sixteen {
    pub stride: usize,
}

// SAFETY (every method below): the trait's.
impl Lanes for Eight {
    type I = __m256i;
    type F = __m256;
    const ROWS: usize = 8;

    #[inline(always)]
    unsafe fn zero(self) -> __m256i {
        unsafe { _mm256_setzero_si256() }
    }
    #[inline(always)]
    unsafe fn zero_f(self) -> __m256 {
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn load(self, p: *const u8) -> __m256i {
        unsafe { _mm256_loadu_si256(p as *const __m256i) }
    }
    #[inline(always)]
    unsafe fn bcast4(self, p: *const u8) -> __m256i {
        unsafe { _mm256_set1_epi32((p as *const i32).read_unaligned()) }
    }
    #[inline(always)]
    unsafe fn dot<P: Products>(self, acc: __m256i, u: __m256i, s: __m256i) -> __m256i {
        unsafe { P::add(acc, u, s) }
    }
    #[inline(always)]
    unsafe fn dot_signed<P: Products>(self, acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
        unsafe { P::add(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)) }
    }
    #[inline(always)]
    unsafe fn set1_i8(self, v: i8) -> __m256i {
        unsafe { _mm256_set1_epi8(v) }
    }
    #[inline(always)]
    unsafe fn and(self, a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_and_si256(a, b) }
    }
    #[inline(always)]
    unsafe fn or(self, a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_or_si256(a, b) }
    }
    #[inline(always)]
    unsafe fn shr4(self, a: __m256i) -> __m256i {
        unsafe { _mm256_srli_epi16::<4>(a) }
    }
    #[inline(always)]
    unsafe fn shift(self, a: __m256i, n: i32) -> __m256i {
        unsafe {
            if n >= 0 {
                _mm256_sll_epi16(a, _mm_cvtsi32_si128(n))
            } else {
                _mm256_srl_epi16(a, _mm_cvtsi32_si128(-n))
            }
        }
    }
    #[inline(always)]
    unsafe fn add_i32(self, a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_add_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn sub_i32(self, a: __m256i, b: __m256i) -> __m256i {
        unsafe { _mm256_sub_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn splat_i32(self, v: i32) -> __m256i {
        unsafe { _mm256_set1_epi32(v) }
    }
    #[inline(always)]
    unsafe fn to_f32(self, a: __m256i) -> __m256 {
        unsafe { _mm256_cvtepi32_ps(a) }
    }
    #[inline(always)]
    unsafe fn halves(self, p: *const u8) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
    #[inline(always)]
    unsafe fn bytes_u8(self, p: *const u8) -> __m256 {
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))) }
    }
    #[inline(always)]
    unsafe fn bytes_i8(self, p: *const u8) -> __m256 {
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))) }
    }
    #[inline(always)]
    unsafe fn splat(self, v: f32) -> __m256 {
        unsafe { _mm256_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn mul(self, a: __m256, b: __m256) -> __m256 {
        unsafe { _mm256_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(self, a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn fnma(self, a: __m256, b: __m256, c: __m256) -> __m256 {
        unsafe { _mm256_fnmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: __m256) {
        unsafe { _mm256_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn prefetch(self, p: *const u8) {
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) }
    }
}

impl Sixteen {
    /// Two 256-bit halves as one register: `a` the low lanes.
    #[inline(always)]
    unsafe fn join(a: __m256i, b: __m256i) -> __m512i {
        unsafe { _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b) }
    }

    /// Eight bytes of each group at `p`.
    #[inline(always)]
    unsafe fn eight_bytes(self, p: *const u8) -> __m128i {
        unsafe {
            let a = _mm_loadl_epi64(p as *const __m128i);
            _mm_unpacklo_epi64(a, _mm_loadl_epi64(p.add(self.stride) as *const __m128i))
        }
    }
}

// SAFETY (every method below): the trait's.
impl Lanes for Sixteen {
    type I = __m512i;
    type F = __m512;
    const ROWS: usize = 16;

    #[inline(always)]
    unsafe fn zero(self) -> __m512i {
        unsafe { _mm512_setzero_si512() }
    }
    #[inline(always)]
    unsafe fn zero_f(self) -> __m512 {
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn load(self, p: *const u8) -> __m512i {
        unsafe {
            let a = _mm256_loadu_si256(p as *const __m256i);
            Self::join(a, _mm256_loadu_si256(p.add(self.stride) as *const __m256i))
        }
    }
    #[inline(always)]
    unsafe fn bcast4(self, p: *const u8) -> __m512i {
        unsafe { _mm512_set1_epi32((p as *const i32).read_unaligned()) }
    }
    #[inline(always)]
    unsafe fn dot<P: Products>(self, acc: __m512i, u: __m512i, s: __m512i) -> __m512i {
        unsafe { _mm512_dpbusd_epi32(acc, u, s) }
    }
    #[inline(always)]
    unsafe fn dot_signed<P: Products>(self, acc: __m512i, w: __m512i, x: __m512i) -> __m512i {
        // AVX-512 has no `vpsignb`: `x` negated where `w` is negative (and the product is zero
        // where `w` is), as `vpsignb` gives.
        unsafe {
            let negative = _mm512_movepi8_mask(w);
            let x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);
            _mm512_dpbusd_epi32(acc, _mm512_abs_epi8(w), x)
        }
    }
    #[inline(always)]
    unsafe fn set1_i8(self, v: i8) -> __m512i {
        unsafe { _mm512_set1_epi8(v) }
    }
    #[inline(always)]
    unsafe fn and(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_and_si512(a, b) }
    }
    #[inline(always)]
    unsafe fn or(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_or_si512(a, b) }
    }
    #[inline(always)]
    unsafe fn shr4(self, a: __m512i) -> __m512i {
        unsafe { _mm512_srli_epi16::<4>(a) }
    }
    #[inline(always)]
    unsafe fn shift(self, a: __m512i, n: i32) -> __m512i {
        unsafe {
            if n >= 0 {
                _mm512_sll_epi16(a, _mm_cvtsi32_si128(n))
            } else {
                _mm512_srl_epi16(a, _mm_cvtsi32_si128(-n))
            }
        }
    }
    #[inline(always)]
    unsafe fn add_i32(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_add_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn sub_i32(self, a: __m512i, b: __m512i) -> __m512i {
        unsafe { _mm512_sub_epi32(a, b) }
    }
    #[inline(always)]
    unsafe fn splat_i32(self, v: i32) -> __m512i {
        unsafe { _mm512_set1_epi32(v) }
    }
    #[inline(always)]
    unsafe fn to_f32(self, a: __m512i) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(a) }
    }
    #[inline(always)]
    unsafe fn halves(self, p: *const u8) -> __m512 {
        unsafe {
            let a = _mm_loadu_si128(p as *const __m128i);
            let b = _mm_loadu_si128(p.add(self.stride) as *const __m128i);
            _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(a), b))
        }
    }
    #[inline(always)]
    unsafe fn bytes_u8(self, p: *const u8) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(self.eight_bytes(p))) }
    }
    #[inline(always)]
    unsafe fn bytes_i8(self, p: *const u8) -> __m512 {
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(self.eight_bytes(p))) }
    }
    #[inline(always)]
    unsafe fn splat(self, v: f32) -> __m512 {
        unsafe { _mm512_set1_ps(v) }
    }
    #[inline(always)]
    unsafe fn mul(self, a: __m512, b: __m512) -> __m512 {
        unsafe { _mm512_mul_ps(a, b) }
    }
    #[inline(always)]
    unsafe fn fma(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn fnma(self, a: __m512, b: __m512, c: __m512) -> __m512 {
        unsafe { _mm512_fnmadd_ps(a, b, c) }
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32, v: __m512) {
        unsafe { _mm512_storeu_ps(p, v) }
    }
    #[inline(always)]
    unsafe fn prefetch(self, p: *const u8) {
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(self.stride) as *const i8);
        }
    }
}

/// The sums of a slice's values times `T` tokens' activations, values 0..16 and 16..32 apart
/// with `HALVES`, else all in the first (the second zero): the slice at `s` in the layout
/// [`super::packed`] describes, with `BITS` (4, 5 or 6) bits per value, as unsigned integers (a
/// format's offset comes off through the activations' sums), from `init` (two i32 at each)
/// where given, else zero.
///
/// # Safety
/// The slice's bytes are readable at `s` (for each group of `w`), 32 activation bytes at each
/// of `x`; what `w` and `P` need.
#[inline(always)]
pub unsafe fn slice_sums<
    W: Lanes,
    P: Products,
    const BITS: u32,
    const HALVES: bool,
    const T: usize,
>(
    w: W,
    s: *const u8,
    x: [*const u8; T],
    init: Option<[*const u8; T]>,
) -> [[W::I; 2]; T] {
    unsafe {
        let low4 = w.set1_i8(0x0f);
        let (bit4, bits45) = (w.set1_i8(0x10), w.set1_i8(0x30));
        let (ha, hb) = match BITS {
            5 => (w.load(s.add(128)), w.zero()),
            6 => (w.load(s.add(128)), w.load(s.add(160))),
            _ => (w.zero(), w.zero()),
        };
        let mut out = [[w.zero(); 2]; T];
        if let Some(init) = init {
            for t in 0..T {
                out[t] = [w.bcast4(init[t]), w.bcast4(init[t].add(4))];
            }
        }
        for c in 0..4 {
            let v = w.load(s.add(32 * c));
            let mut lo = w.and(v, low4);
            let mut hi = w.and(w.shr4(v), low4);
            let c = c as i32;
            if BITS == 5 {
                lo = w.or(lo, w.and(w.shift(ha, 4 - c), bit4));
                hi = w.or(hi, w.and(w.shift(ha, -c), bit4));
            } else if BITS == 6 {
                lo = w.or(lo, w.and(w.shift(ha, 4 - 2 * c), bits45));
                hi = w.or(hi, w.and(w.shift(hb, 4 - 2 * c), bits45));
            }
            let c = c as usize;
            for t in 0..T {
                out[t][0] = w.dot::<P>(out[t][0], lo, w.bcast4(x[t].add(4 * c)));
                let h = HALVES as usize;
                out[t][h] = w.dot::<P>(out[t][h], hi, w.bcast4(x[t].add(16 + 4 * c)));
            }
        }
        out
    }
}
