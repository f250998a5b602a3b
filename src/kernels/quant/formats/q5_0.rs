//! Q5_0: blocks of 32 values, an f16 scale `d`, 4 bytes of fifth bits (bit `j` of the
//! little-endian u32 is value `j`'s) and 16 bytes of nibbles (the low nibbles values 0..16,
//! the high nibbles values 16..32); a value is `(q − 16) · d`. llama.cpp's quantizer writes it
//! for rows whose width is not a multiple of 256 in the K-quant mixes.

use super::super::layouts::{slice, BlockLayout};
use super::super::packed::ROWS;
use super::{half, inverse, signed_max, FormatOps, Packed};
use crate::kernels::quant::f32_to_f16;

type Layout = BlockLayout<5, false>;

pub static OPS: FormatOps = FormatOps {
    name: "Q5_0",
    ggml_id: 6,
    file_type: 8,
    block_values: 32,
    block_bytes: 22,
    dequantize,
    quantize: Some(quantize),
    packed: Some(Packed::of::<Layout>(pack)),
};

/// The stored values, 0..32, of a block whose fifth bits start at `at` (Q5_0 and Q5_1).
pub(super) fn values_at(b: &[u8], at: usize) -> [u8; 32] {
    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let qs = &b[at + 4..at + 20];
    std::array::from_fn(|j| {
        let low = if j < 16 { qs[j] & 0x0f } else { qs[j - 16] >> 4 };
        low | ((((qh >> j) & 1) as u8) << 4)
    })
}

/// Values `q` (0..32) of one block into fifth bits and nibbles at `out` (Q5_0 and Q5_1).
pub(super) fn store(q: impl Fn(usize) -> u8, out: &mut [u8]) {
    let mut qh = 0u32;
    for j in 0..16 {
        let (a, b) = (q(j), q(j + 16));
        out[4 + j] = (a & 0x0f) | ((b & 0x0f) << 4);
        qh |= (((a & 0x10) >> 4) as u32) << j | (((b & 0x10) >> 4) as u32) << (j + 16);
    }
    out[..4].copy_from_slice(&qh.to_le_bytes());
}

fn dequantize(b: &[u8], out: &mut [f32]) {
    let d = half(b);
    for (o, q) in out.iter_mut().zip(values_at(b, 2)) {
        *o = (q as i32 - 16) as f32 * d;
    }
}

/// ggml's `quantize_row_q5_0_ref`: the value of largest magnitude, with its sign, maps to -16.
fn quantize(x: &[f32], out: &mut [u8]) {
    let d = signed_max(x) / -16.0;
    let id = inverse(d);
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    store(|j| ((x[j] * id + 16.5) as i8).min(31) as u8, &mut out[2..]);
}

fn pack(blocks: [&[u8]; ROWS], out: &mut [u8]) {
    for (r, b) in blocks.iter().enumerate() {
        out[2 * r..2 * r + 2].copy_from_slice(&b[..2]);
    }
    slice::pack(&blocks.map(|b| values_at(b, 2)), 5, &mut out[16..]);
}
