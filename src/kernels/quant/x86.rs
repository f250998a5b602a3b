//! [`super::dot::dot_q8`] with AVX2, FMA and F16C: per block the 32 integer products summed in
//! one register (`vpmaddubsw` on the weights' magnitudes and the activations with the weights'
//! signs, then `vpmaddwd`: exact), converted to f32 and added into an f32 accumulator scaled by
//! both blocks' scales; the eight lanes are summed once per row. The sums run in another order
//! than the portable code's, so the two agree within f32 rounding, not bit for bit.

use super::Format;
use std::arch::x86_64::*;

/// Whether this processor has AVX2, FMA and F16C (the standard library caches the answer).
pub fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
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

/// `Σ w[j] · x[j]` over 32 pairs of signed bytes, as eight exact partial sums.
#[inline]
#[target_feature(enable = "avx2")]
fn dot32(w: __m256i, x: __m256i) -> __m256i {
    // vpmaddubsw multiplies unsigned by signed bytes: |w| by x with w's sign. Its 16-bit pair
    // sums cannot saturate: |w| ≤ 128 and |x| ≤ 127 (Q8_0 stores -127..127), 2·128·127 < 2^15.
    let products = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    _mm256_madd_epi16(products, _mm256_set1_epi16(1))
}

/// The product of two blocks' f16 scales (the first two bytes of each).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn scales(w: &[u8], x: &[u8]) -> f32 {
    let h = _mm_set_epi16(
        0,
        0,
        0,
        0,
        0,
        0,
        i16::from_le_bytes([x[0], x[1]]),
        i16::from_le_bytes([w[0], w[1]]),
    );
    let f = _mm_cvtph_ps(h);
    _mm_cvtss_f32(_mm_mul_ss(f, _mm_movehdup_ps(f)))
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

/// The AVX2 form of [`super::dot::dot_q8`].
///
/// # Safety
/// The processor must have AVX2, FMA and F16C ([`has_avx2`]); `row` and `xq` whole blocks of
/// `format` (Q8_0 or Q4_0) and of Q8_0.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8(format: Format, row: &[u8], xq: &[u8]) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 2];
    for (i, (w, x)) in row.chunks_exact(format.block_bytes()).zip(xq.chunks_exact(34)).enumerate() {
        // SAFETY: a Q8_0 block holds 32 bytes after its scale.
        let xs = unsafe { _mm256_loadu_si256(x[2..].as_ptr() as *const __m256i) };
        let ws = unsafe { values(format, w) };
        let sum = _mm256_cvtepi32_ps(dot32(ws, xs));
        // Two accumulators, so that consecutive blocks' additions need not wait on each other.
        acc[i & 1] = _mm256_fmadd_ps(sum, _mm256_set1_ps(scales(w, x)), acc[i & 1]);
    }
    sum_f32(_mm256_add_ps(acc[0], acc[1]))
}

/// [`dot_q8`] of one row with four activation rows at once (prefill): the row's block is loaded,
/// unpacked and its scale converted once for all four. `xd` holds each activation block's scale
/// as f32.
///
/// # Safety
/// As [`dot_q8`], for each of the four activation rows.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_x4(format: Format, row: &[u8], xq: [&[u8]; 4], xd: [&[f32]; 4]) -> [f32; 4] {
    let mut acc = [_mm256_setzero_ps(); 4];
    for (b, w) in row.chunks_exact(format.block_bytes()).enumerate() {
        let ws = unsafe { values(format, w) };
        let (wabs, dw) = (_mm256_sign_epi8(ws, ws), scale(w));
        for j in 0..4 {
            // SAFETY: activation block `b` lies inside `xq[j]` (whole blocks, as many as the row).
            let xs = unsafe { _mm256_loadu_si256(xq[j][b * 34 + 2..].as_ptr() as *const __m256i) };
            let products = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xs, ws));
            let sum = _mm256_cvtepi32_ps(_mm256_madd_epi16(products, _mm256_set1_epi16(1)));
            acc[j] = _mm256_fmadd_ps(sum, _mm256_set1_ps(dw * xd[j][b]), acc[j]);
        }
    }
    acc.map(|a| sum_f32(a))
}

/// A block's f16 scale (its first two bytes).
#[inline]
#[target_feature(enable = "avx2,f16c")]
fn scale(w: &[u8]) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(u16::from_le_bytes([w[0], w[1]]) as i32)))
}
