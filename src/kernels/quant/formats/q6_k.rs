//! Q6_K: super-blocks of 256 values in 16 sub-blocks of 16: 128 bytes of low nibbles, 64 bytes
//! of top two bits, 16 signed 8-bit scales `sc`, an f16 scale `d`; a value is
//! `d·sc · (q − 32)`. Value `128h + 32k + l` (h = 0..2, k = 0..4, l = 0..32) takes nibble
//! `k / 2` of byte `64h + 32(k % 2) + l`, bits `2k, 2k + 1` of top-bit byte `32h + l`, and the
//! scale of sub-block `v / 16`. Read from files, not made here.

use super::super::packed::{slice, Q6KLayout, ROWS};
use super::{half, FormatOps, Packed};

pub static OPS: FormatOps = FormatOps {
    name: "Q6_K",
    ggml_id: 14,
    file_type: 18,
    block_values: 256,
    block_bytes: 210,
    dequantize,
    quantize: None,
    packed: Some(Packed::of::<Q6KLayout>(pack)),
};

/// The 256 stored values, 0..64.
fn values(b: &[u8]) -> [u8; 256] {
    let (ql, qh) = (&b[..128], &b[128..192]);
    std::array::from_fn(|v| {
        let (h, k, l) = (v / 128, v % 128 / 32, v % 32);
        let low = ql[64 * h + l + 32 * (k % 2)] >> (4 * (k / 2)) & 0x0f;
        low | ((qh[32 * h + l] >> (2 * k)) & 3) << 4
    })
}

fn dequantize(b: &[u8], out: &mut [f32]) {
    let d = half(&b[208..]);
    for (v, (o, q)) in out.iter_mut().zip(values(b)).enumerate() {
        *o = d * (b[192 + v / 16] as i8) as f32 * (q as i32 - 32) as f32;
    }
}

/// The rows' `d`, then the 16 sub-block scales row by row, then the 8 slices.
fn pack(blocks: [&[u8]; ROWS], out: &mut [u8]) {
    for (r, b) in blocks.iter().enumerate() {
        out[2 * r..2 * r + 2].copy_from_slice(&b[208..210]);
        for t in 0..16 {
            out[16 + 8 * t + r] = b[192 + t];
        }
    }
    let q = blocks.map(values);
    let bytes = slice::bytes(6);
    for s in 0..8 {
        let rows = std::array::from_fn(|r| q[r][32 * s..32 * s + 32].try_into().expect("32"));
        slice::pack(&rows, 6, &mut out[144 + s * bytes..][..bytes]);
    }
}
