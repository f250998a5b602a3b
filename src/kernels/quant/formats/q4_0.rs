//! Q4_0: blocks of 32 values, an f16 scale `d` and 16 bytes of nibbles `q` (the low nibbles
//! values 0..16, the high nibbles values 16..32); a value is `(q − 8) · d`.

use super::super::layouts::{slice, BlockLayout};
use super::super::packed::ROWS;
use super::{half, inverse, signed_max, FormatOps, Packed};
use crate::kernels::quant::f32_to_f16;

type Layout = BlockLayout<4, false>;

pub static OPS: FormatOps = FormatOps {
    name: "Q4_0",
    ggml_id: 2,
    file_type: 2,
    block_values: 32,
    block_bytes: 18,
    dequantize,
    quantize: Some(quantize),
    packed: Some(Packed::of::<Layout>(pack)),
};

/// The stored values, 0..16.
fn values(b: &[u8]) -> [u8; 32] {
    std::array::from_fn(|j| if j < 16 { b[2 + j] & 0x0f } else { b[2 + j - 16] >> 4 })
}

fn dequantize(b: &[u8], out: &mut [f32]) {
    let d = half(b);
    for (o, q) in out.iter_mut().zip(values(b)) {
        *o = (q as i32 - 8) as f32 * d;
    }
}

/// ggml's `quantize_row_q4_0_ref`: the value of largest magnitude, with its sign, maps to -8.
fn quantize(x: &[f32], out: &mut [u8]) {
    let d = signed_max(x) / -8.0;
    let id = inverse(d);
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
    for j in 0..16 {
        out[2 + j] = q(x[j]) | (q(x[j + 16]) << 4);
    }
}

fn pack(blocks: [&[u8]; ROWS], out: &mut [u8]) {
    for (r, b) in blocks.iter().enumerate() {
        out[2 * r..2 * r + 2].copy_from_slice(&b[..2]);
    }
    slice::pack(&blocks.map(values), 4, &mut out[16..]);
}
