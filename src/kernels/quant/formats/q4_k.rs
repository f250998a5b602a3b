//! Q4_K: super-blocks of 256 values in 8 sub-blocks of 32: an f16 scale `d`, an f16 `dmin`,
//! 12 bytes of 6-bit sub-block scales `sc` and minimums `m`, 128 bytes of nibbles (32 bytes
//! per 64 values: the low nibbles the first 32, the high nibbles the next); a value is
//! `d·sc · q − dmin·m`.

use super::super::layouts::{slice, KLayout};
use super::super::packed::ROWS;
use super::search::{nearest_int, scale_and_min};
use super::{half, FormatOps, Packed};
use crate::kernels::quant::f32_to_f16;

pub static OPS: FormatOps = FormatOps {
    name: "Q4_K",
    ggml_id: 12,
    file_type: 14,
    block_values: 256,
    block_bytes: 144,
    dequantize,
    quantize: Some(quantize),
    packed: Some(Packed::of::<KLayout<4>>(pack)),
};

/// Sub-block `j`'s (0..8) scale and minimum from the 12 packed bytes: 6 bits each, the low
/// four sub-blocks' in the low 6 bits of bytes 0..4 and 4..8, the high four's low bits in the
/// nibbles of bytes 8..12 and their top two bits in bits 6 and 7 of bytes 0..8 (Q4_K and Q5_K).
pub(super) fn scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Sub-block `j`'s 32 values, 0..16.
fn values(b: &[u8], j: usize) -> [u8; 32] {
    let qs = &b[16 + 32 * (j / 2)..][..32];
    std::array::from_fn(|l| if j.is_multiple_of(2) { qs[l] & 0x0f } else { qs[l] >> 4 })
}

fn dequantize(b: &[u8], out: &mut [f32]) {
    dequantize_k(b, values, out);
}

/// A Q4_K or Q5_K block's values, `d·sc · q − dmin·m`, its sub-block `j`'s levels `q` from
/// `values(b, j)`.
pub(super) fn dequantize_k(b: &[u8], values: fn(&[u8], usize) -> [u8; 32], out: &mut [f32]) {
    let (d, dmin) = (half(b), half(&b[2..]));
    for (j, out) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min(j, &b[4..16]);
        let (d1, m1) = (d * sc as f32, dmin * m as f32);
        for (o, q) in out.iter_mut().zip(values(b, j)) {
            *o = d1 * q as f32 - m1;
        }
    }
}

/// ggml's `quantize_row_q4_K_ref`: [`quantize_k`] with 4-bit values.
fn quantize(x: &[f32], out: &mut [u8]) {
    let l = quantize_k(x, 15, (-1.0, 0.1, 20), out);
    for (g, q) in out[16..144].chunks_exact_mut(32).enumerate() {
        for (i, q) in q.iter_mut().enumerate() {
            *q = l[64 * g + i] | (l[64 * g + 32 + i] << 4);
        }
    }
}

/// The part of ggml's Q4_K and Q5_K quantisers they share: each sub-block's scale and minimum
/// by [`scale_and_min`] (levels up to `nmax`, its search `steps`), both sets quantised to 6
/// bits against their largest, written with `d` and `dmin` into `out`'s first 16 bytes; then
/// each value's level under the stored scales, returned for the caller to pack.
pub(super) fn quantize_k(
    x: &[f32],
    nmax: i32,
    steps: (f32, f32, i32),
    out: &mut [u8],
) -> [u8; 256] {
    let mut l = [0u8; 256];
    let (mut scales, mut mins) = ([0.0f32; 8], [0.0f32; 8]);
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..8 {
        let x = &x[32 * j..32 * j + 32];
        let sum_x2 = x.iter().fold(0.0f32, |s, &v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        let weights: [f32; 32] = std::array::from_fn(|i| av_x + x[i].abs());
        (scales[j], mins[j]) = scale_and_min(nmax, x, &weights, &mut l[32 * j..32 * j + 32], steps);
        max_scale = if scales[j] > max_scale { scales[j] } else { max_scale };
        max_min = if mins[j] > max_min { mins[j] } else { max_min };
    }
    let inverse = |max: f32| if max > 0.0 { 63.0 / max } else { 0.0 };
    let (inv_scale, inv_min) = (inverse(max_scale), inverse(max_min));
    let packed = &mut out[4..16];
    packed.fill(0);
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            (packed[j], packed[j + 4]) = (ls, lm);
        } else {
            packed[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    out[..2].copy_from_slice(&f32_to_f16(max_scale / 63.0).to_le_bytes());
    out[2..4].copy_from_slice(&f32_to_f16(max_min / 63.0).to_le_bytes());
    let (d, dmin) = (half(out), half(&out[2..]));
    for j in 0..8 {
        let (sc, m) = scale_min(j, &out[4..16]);
        let d1 = d * sc as f32;
        if d1 == 0.0 {
            continue;
        }
        let dm = dmin * m as f32;
        for i in 32 * j..32 * j + 32 {
            l[i] = nearest_int((x[i] + dm) / d1).clamp(0, nmax) as u8;
        }
    }
    l
}

/// Writes the head of a K-quant group block (Q4_K and Q5_K): the rows' `d` and `dmin`, then
/// each sub-block's scales and minimums row by row.
pub(super) fn pack_head(blocks: &[&[u8]; ROWS], out: &mut [u8]) {
    for (r, b) in blocks.iter().enumerate() {
        out[2 * r..2 * r + 2].copy_from_slice(&b[..2]);
        out[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&b[2..4]);
        for j in 0..8 {
            let (sc, m) = scale_min(j, &b[4..16]);
            (out[32 + 8 * j + r], out[96 + 8 * j + r]) = (sc, m);
        }
    }
}

fn pack(blocks: [&[u8]; ROWS], out: &mut [u8]) {
    pack_head(&blocks, out);
    let bytes = slice::bytes(4);
    for j in 0..8 {
        slice::pack(&blocks.map(|b| values(b, j)), 4, &mut out[160 + j * bytes..][..bytes]);
    }
}
