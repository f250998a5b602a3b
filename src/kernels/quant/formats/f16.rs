//! F16: one IEEE half per value. Its rows are multiplied as they are, in f32
//! ([`super::super::dot::dot_f16_many`]), not regrouped.

use super::{half, FormatOps};

pub static OPS: FormatOps = FormatOps {
    name: "F16",
    ggml_id: 1,
    file_type: 1,
    block_values: 1,
    block_bytes: 2,
    dequantize,
    quantize: Some(quantize),
    packed: None,
};

fn dequantize(b: &[u8], out: &mut [f32]) {
    out[0] = half(b);
}

fn quantize(x: &[f32], out: &mut [u8]) {
    out.copy_from_slice(&super::super::f32_to_f16(x[0]).to_le_bytes());
}
