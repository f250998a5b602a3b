//! Q5_1: blocks of 32 values, an f16 scale `d`, an f16 minimum `m`, 4 bytes of fifth bits and
//! 16 bytes of nibbles as Q5_0's; a value is `q · d + m`.

use super::super::layouts::{slice, BlockLayout};
use super::super::packed::ROWS;
use super::q5_0::{store, values_at};
use super::{half, inverse, min_max, FormatOps, Packed};
use crate::kernels::quant::f32_to_f16;

type Layout = BlockLayout<5, true>;

pub static OPS: FormatOps = FormatOps {
    name: "Q5_1",
    ggml_id: 7,
    file_type: 9,
    block_values: 32,
    block_bytes: 24,
    dequantize,
    quantize: Some(quantize),
    packed: Some(Packed::of::<Layout>(pack)),
};

fn dequantize(b: &[u8], out: &mut [f32]) {
    let (d, m) = (half(b), half(&b[2..]));
    for (o, q) in out.iter_mut().zip(values_at(b, 4)) {
        *o = q as f32 * d + m;
    }
}

/// ggml's `quantize_row_q5_1_ref`: the minimum maps to 0, the maximum to 31.
fn quantize(x: &[f32], out: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = inverse(d);
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    out[2..4].copy_from_slice(&f32_to_f16(min).to_le_bytes());
    store(|j| ((x[j] - min) * id + 0.5) as u8, &mut out[4..]);
}

fn pack(blocks: [&[u8]; ROWS], out: &mut [u8]) {
    for (r, b) in blocks.iter().enumerate() {
        out[2 * r..2 * r + 2].copy_from_slice(&b[..2]);
        out[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&b[2..4]);
    }
    slice::pack(&blocks.map(|b| values_at(b, 4)), 5, &mut out[32..]);
}
