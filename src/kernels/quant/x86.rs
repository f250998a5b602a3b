//! [`super::dot::dot_q8`] with AVX2: a block's 32 integer products summed in one register
//! (`vpmaddubsw` on the weights' magnitudes and the activations with the weights' signs, then
//! `vpmaddwd`), the block's sum made exact in an integer, and the scales applied as the
//! portable code applies them, so that both give the same bits on every processor.

use super::Format;
use std::arch::x86_64::*;

/// Whether this processor has AVX2 (the standard library caches the answer).
pub fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
}

/// The sum of the eight 32-bit lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn sum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// `Σ w[j] · x[j]` over 32 pairs of signed bytes, exactly.
#[inline]
#[target_feature(enable = "avx2")]
fn dot32(w: __m256i, x: __m256i) -> i32 {
    // vpmaddubsw multiplies unsigned by signed bytes: |w| by x with w's sign. Its 16-bit pair
    // sums cannot saturate: |w| ≤ 128 and |x| ≤ 127 (Q8_0 stores -127..127), 2·128·127 < 2^15.
    let products = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    sum_i32(_mm256_madd_epi16(products, _mm256_set1_epi16(1)))
}

/// The AVX2 form of [`super::dot::dot_q8`].
///
/// # Safety
/// The processor must have AVX2 ([`has_avx2`]); `row` and `xq` whole blocks of `format`
/// (Q8_0 or Q4_0) and of Q8_0.
#[target_feature(enable = "avx2")]
pub unsafe fn dot_q8(format: Format, row: &[u8], xq: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (w, x) in row.chunks_exact(format.block_bytes()).zip(xq.chunks_exact(34)) {
        let (dw, dx) = (super::half(w), super::half(x));
        // SAFETY: each block holds 32 bytes after its scale (Q8_0), or 16 (Q4_0); unaligned
        // loads.
        let xs = unsafe { _mm256_loadu_si256(x[2..].as_ptr() as *const __m256i) };
        let ws = match format {
            Format::Q8_0 => unsafe { _mm256_loadu_si256(w[2..].as_ptr() as *const __m256i) },
            _ => {
                let bytes = unsafe { _mm_loadu_si128(w[2..].as_ptr() as *const __m128i) };
                let low = _mm_and_si128(bytes, _mm_set1_epi8(0x0f));
                let high = _mm_and_si128(_mm_srli_epi16::<4>(bytes), _mm_set1_epi8(0x0f));
                let q = _mm256_set_m128i(high, low);
                _mm256_sub_epi8(q, _mm256_set1_epi8(8))
            }
        };
        sum += dot32(ws, xs) as f32 * dw * dx;
    }
    sum
}
