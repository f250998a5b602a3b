//! Q8_0: blocks of 32 values, an f16 scale `d` and 32 signed bytes `q`; a value is `q · d`.

use super::super::layouts::Q8Layout;
use super::super::packed::ROWS;
use super::{half, inverse, FormatOps, Packed};
use crate::kernels::quant::f32_to_f16;

pub static OPS: FormatOps = FormatOps {
    name: "Q8_0",
    ggml_id: 8,
    file_type: 7,
    block_values: 32,
    block_bytes: 34,
    dequantize,
    quantize: Some(quantize),
    packed: Some(Packed::of::<Q8Layout>(pack)),
};

fn dequantize(b: &[u8], out: &mut [f32]) {
    let d = half(b);
    for (o, &q) in out.iter_mut().zip(&b[2..]) {
        *o = (q as i8) as f32 * d;
    }
}

/// ggml's `quantize_row_q8_0_ref`: the largest magnitude maps to 127, rounding half away from
/// zero.
pub fn quantize(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    for (o, &v) in out[2..].iter_mut().zip(x) {
        *o = (v * id).round() as i8 as u8;
    }
}

/// The eight rows' scales, then chunk `c` holding values `4c..4c+4` of each row in turn.
fn pack(blocks: [&[u8]; ROWS], out: &mut [u8]) {
    for (r, b) in blocks.iter().enumerate() {
        out[2 * r..2 * r + 2].copy_from_slice(&b[..2]);
        for (j, &q) in b[2..34].iter().enumerate() {
            out[16 + 32 * (j / 4) + 4 * r + j % 4] = q;
        }
    }
}
