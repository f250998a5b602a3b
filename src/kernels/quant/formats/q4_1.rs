//! Q4_1: blocks of 32 values, an f16 scale `d`, an f16 minimum `m` and 16 bytes of nibbles `q`
//! (the low nibbles values 0..16, the high nibbles values 16..32); a value is `q · d + m`.

use super::super::layouts::{slice, BlockLayout};
use super::super::packed::ROWS;
use super::{half, inverse, min_max, FormatOps, Packed};
use crate::kernels::quant::f32_to_f16;

type Layout = BlockLayout<4, true>;

pub static OPS: FormatOps = FormatOps {
    name: "Q4_1",
    ggml_id: 3,
    file_type: 3,
    block_values: 32,
    block_bytes: 20,
    dequantize,
    quantize: Some(quantize),
    packed: Some(Packed::of::<Layout>(pack)),
};

fn values(b: &[u8]) -> [u8; 32] {
    std::array::from_fn(|j| if j < 16 { b[4 + j] & 0x0f } else { b[4 + j - 16] >> 4 })
}

fn dequantize(b: &[u8], out: &mut [f32]) {
    let (d, m) = (half(b), half(&b[2..]));
    for (o, q) in out.iter_mut().zip(values(b)) {
        *o = q as f32 * d + m;
    }
}

/// ggml's `quantize_row_q4_1_ref`: the minimum maps to 0, the maximum to 15.
fn quantize(x: &[f32], out: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = inverse(d);
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    out[2..4].copy_from_slice(&f32_to_f16(min).to_le_bytes());
    let q = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
    for j in 0..16 {
        out[4 + j] = q(x[j]) | (q(x[j + 16]) << 4);
    }
}

fn pack(blocks: [&[u8]; ROWS], out: &mut [u8]) {
    for (r, b) in blocks.iter().enumerate() {
        out[2 * r..2 * r + 2].copy_from_slice(&b[..2]);
        out[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&b[2..4]);
    }
    slice::pack(&blocks.map(values), 4, &mut out[32..]);
}
