//! Q4_K: super-blocks of 256 values in 8 sub-blocks of 32: an f16 scale `d`, an f16 `dmin`,
//! 12 bytes of 6-bit sub-block scales `sc` and minimums `m`, 128 bytes of nibbles (32 bytes
//! per 64 values: the low nibbles the first 32, the high nibbles the next); a value is
//! `d·sc · q − dmin·m`. Read from files, not made here.

use super::super::packed::{slice, KLayout, ROWS};
use super::{half, FormatOps, Packed};

pub static OPS: FormatOps = FormatOps {
    name: "Q4_K",
    ggml_id: 12,
    file_type: 14,
    block_values: 256,
    block_bytes: 144,
    dequantize,
    quantize: None,
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
    let (d, dmin) = (half(b), half(&b[2..]));
    for (j, out) in out.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min(j, &b[4..16]);
        let (d1, m1) = (d * sc as f32, dmin * m as f32);
        for (o, q) in out.iter_mut().zip(values(b, j)) {
            *o = d1 * q as f32 - m1;
        }
    }
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
