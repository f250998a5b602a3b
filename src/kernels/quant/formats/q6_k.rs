//! Q6_K: super-blocks of 256 values in 16 sub-blocks of 16: 128 bytes of low nibbles, 64 bytes
//! of top two bits, 16 signed 8-bit scales `sc`, an f16 scale `d`; a value is
//! `d·sc · (q − 32)`. Value `128h + 32k + l` (h = 0..2, k = 0..4, l = 0..32) takes nibble
//! `k / 2` of byte `64h + 32(k % 2) + l`, bits `2k, 2k + 1` of top-bit byte `32h + l`, and the
//! scale of sub-block `v / 16`.

use super::super::layouts::{slice, Q6KLayout};
use super::super::packed::ROWS;
use super::search::{nearest_int, scale_signed, GROUP_MAX_EPS};
use super::{half, FormatOps, Packed};
use crate::kernels::quant::f32_to_f16;

pub static OPS: FormatOps = FormatOps {
    name: "Q6_K",
    ggml_id: 14,
    file_type: 18,
    block_values: 256,
    block_bytes: 210,
    dequantize,
    quantize: Some(quantize),
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

/// ggml's `quantize_row_q6_K_ref`: each sub-block of 16 values' scale by [`scale_signed`],
/// the scales quantised to 8 bits against the one of largest magnitude, then each value's level
/// under the stored scales.
fn quantize(x: &[f32], out: &mut [u8]) {
    let mut l = [0u8; 256];
    let mut scales = [0.0f32; 16];
    let (mut max_scale, mut max_abs) = (0.0f32, 0.0f32);
    for (ib, scale) in scales.iter_mut().enumerate() {
        *scale = scale_signed(32, &x[16 * ib..16 * ib + 16], &mut l[16 * ib..16 * ib + 16]);
        if scale.abs() > max_abs {
            (max_abs, max_scale) = (scale.abs(), *scale);
        }
    }
    out.fill(0);
    if max_abs < GROUP_MAX_EPS {
        return;
    }
    let iscale = -128.0 / max_scale;
    out[208..210].copy_from_slice(&f32_to_f16(1.0 / iscale).to_le_bytes());
    for (ib, &scale) in scales.iter().enumerate() {
        out[192 + ib] = nearest_int(iscale * scale).min(127) as i8 as u8;
    }
    let d = half(&out[208..]);
    for j in 0..16 {
        let dj = d * (out[192 + j] as i8) as f32;
        if dj == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            l[i] = (nearest_int(x[i] / dj).clamp(-32, 31) + 32) as u8;
        }
    }
    for h in 0..2 {
        let (l, base) = (&l[128 * h..], 64 * h);
        for i in 0..32 {
            out[base + i] = (l[i] & 0x0f) | ((l[i + 64] & 0x0f) << 4);
            out[base + 32 + i] = (l[i + 32] & 0x0f) | ((l[i + 96] & 0x0f) << 4);
            out[128 + 32 * h + i] = (l[i] >> 4)
                | ((l[i + 32] >> 4) << 2)
                | ((l[i + 64] >> 4) << 4)
                | ((l[i + 96] >> 4) << 6);
        }
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
