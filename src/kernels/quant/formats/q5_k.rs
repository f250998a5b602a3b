//! Q5_K: Q4_K with a fifth bit per value. Super-blocks of 256 values: f16 `d`, f16 `dmin`,
//! 12 bytes of 6-bit scales and minimums (as Q4_K's), 32 bytes of fifth bits (bit `j` of
//! byte `l` belongs to value `l` of sub-block `j`), 128 bytes of nibbles (as Q4_K's); a value
//! is `d·sc · q − dmin·m`.

use super::super::layouts::{slice, KLayout};
use super::super::packed::ROWS;
use super::q4_k::{dequantize_k, pack_head, quantize_k};
use super::{FormatOps, Packed};

pub static OPS: FormatOps = FormatOps {
    name: "Q5_K",
    ggml_id: 13,
    file_type: 16,
    block_values: 256,
    block_bytes: 176,
    dequantize,
    quantize: Some(quantize),
    packed: Some(Packed::of::<KLayout<5>>(pack)),
};

/// Sub-block `j`'s 32 values, 0..32.
fn values(b: &[u8], j: usize) -> [u8; 32] {
    let (qh, qs) = (&b[16..48], &b[48 + 32 * (j / 2)..][..32]);
    std::array::from_fn(|l| {
        let low = if j.is_multiple_of(2) { qs[l] & 0x0f } else { qs[l] >> 4 };
        low | (((qh[l] >> j) & 1) << 4)
    })
}

fn dequantize(b: &[u8], out: &mut [f32]) {
    dequantize_k(b, values, out);
}

/// ggml's `quantize_row_q5_K_ref`: the Q4_K quantiser's search with 5-bit values.
fn quantize(x: &[f32], out: &mut [u8]) {
    let l = quantize_k(x, 31, (-0.5, 0.1, 15), out);
    out[16..48].fill(0);
    for g in 0..4 {
        for i in 0..32 {
            let (a, b) = (l[64 * g + i], l[64 * g + 32 + i]);
            out[16 + i] |= ((a >> 4) << (2 * g)) | ((b >> 4) << (2 * g + 1));
            out[48 + 32 * g + i] = (a & 0x0f) | ((b & 0x0f) << 4);
        }
    }
}

fn pack(blocks: [&[u8]; ROWS], out: &mut [u8]) {
    pack_head(&blocks, out);
    let bytes = slice::bytes(5);
    for j in 0..8 {
        slice::pack(&blocks.map(|b| values(b, j)), 5, &mut out[160 + j * bytes..][..bytes]);
    }
}
