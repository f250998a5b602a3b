//! ggml's block formats: weights stored as blocks of small integers with one or two scales per
//! block, the formats of the GGUF files people download. Conversion both ways, bit for bit as
//! ggml's reference code does it (`dequantize_row_*`, `quantize_row_*_ref`), and products of
//! a quantised row with activations ([`dot`]).
//!
//! | format | values per block | bytes per block | a value |
//! |---|---|---|---|
//! | F16 | 1 | 2: an IEEE half | the half as f32 |
//! | Q8_0 | 32 | 34: f16 `d`, 32 × i8 `q` | `q · d` |
//! | Q4_0 | 32 | 18: f16 `d`, 16 bytes of nibbles | `(q − 8) · d` |
//! | Q4_1 | 32 | 20: f16 `d`, f16 `m`, 16 bytes of nibbles | `q · d + m` |
//! | Q4_K | 256 | 144: f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and mins, 128 of nibbles | `d·sc · q − dmin·m` per 32 |
//! | Q6_K | 256 | 210: 128 bytes of low nibbles, 64 of high 2 bits, 16 × i8 scales, f16 `d` | `d·sc · (q − 32)` per 16 |
//!
//! In a 32-value block of Q4_0 and Q4_1 the low nibbles hold values 0..16 and the high nibbles
//! values 16..32.

pub mod dot;
pub mod matrix;
pub mod packed;
#[cfg(test)]
mod testing;
#[cfg(target_arch = "x86_64")]
mod x86;

use anyhow::{bail, ensure, Result};

/// A block format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    F16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q4K,
    Q6K,
}

/// Values per K-quant super-block.
pub const QK_K: usize = 256;

impl Format {
    /// Every format, in ggml's order of type ids.
    pub const ALL: [Format; 6] =
        [Format::F16, Format::Q4_0, Format::Q4_1, Format::Q8_0, Format::Q4K, Format::Q6K];

    /// ggml's type id.
    pub fn ggml_id(self) -> u32 {
        match self {
            Format::F16 => 1,
            Format::Q4_0 => 2,
            Format::Q4_1 => 3,
            Format::Q8_0 => 8,
            Format::Q4K => 12,
            Format::Q6K => 14,
        }
    }

    pub fn from_ggml_id(id: u32) -> Option<Format> {
        Format::ALL.into_iter().find(|f| f.ggml_id() == id)
    }

    /// ggml's name: `Q8_0`, `Q4_K`, ...
    pub fn name(self) -> &'static str {
        match self {
            Format::F16 => "F16",
            Format::Q8_0 => "Q8_0",
            Format::Q4_0 => "Q4_0",
            Format::Q4_1 => "Q4_1",
            Format::Q4K => "Q4_K",
            Format::Q6K => "Q6_K",
        }
    }

    /// Values per block.
    pub fn block_values(self) -> usize {
        match self {
            Format::F16 => 1,
            Format::Q8_0 | Format::Q4_0 | Format::Q4_1 => 32,
            Format::Q4K | Format::Q6K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            Format::F16 => 2,
            Format::Q8_0 => 34,
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
            Format::Q4K => 144,
            Format::Q6K => 210,
        }
    }

    /// The bytes of a row of `n` values; `n` must be a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Result<usize> {
        let per = self.block_values();
        ensure!(
            n.is_multiple_of(per),
            "{} stores values in blocks of {per}: a row of {n} values is not a whole number of blocks",
            self.name()
        );
        Ok(n / per * self.block_bytes())
    }
}

/// An IEEE half-precision value (binary16) as f32; exact (the `half` crate: F16C's
/// `vcvtph2ps` where the processor has it).
pub fn f16_to_f32(h: u16) -> f32 {
    half::f16::from_bits(h).to_f32()
}

/// An f32 as the nearest half-precision value, ties to even (F16C's `vcvtps2ph` where the
/// processor has it, as numpy's `astype(float16)` rounds); too large overflows to infinity,
/// NaN stays NaN.
pub fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

/// A bfloat16 value as f32; exact.
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

fn half(b: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// Q4_K's scale and min of sub-block `j` (0..8) from its 12 packed bytes: 6 bits each.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Appends the values of whole blocks of `format` to `out`.
pub fn dequantize_into(format: Format, bytes: &[u8], out: &mut Vec<f32>) {
    if format == Format::F16 {
        return out.extend(bytes.chunks_exact(2).map(half));
    }
    for b in bytes.chunks_exact(format.block_bytes()) {
        match format {
            Format::F16 => unreachable!("handled above"),
            Format::Q8_0 => {
                let d = half(b);
                out.extend(b[2..].iter().map(|&q| (q as i8) as f32 * d));
            }
            Format::Q4_0 => {
                let d = half(b);
                let qs = &b[2..];
                out.extend(qs.iter().map(|&q| ((q & 0x0f) as i32 - 8) as f32 * d));
                out.extend(qs.iter().map(|&q| ((q >> 4) as i32 - 8) as f32 * d));
            }
            Format::Q4_1 => {
                let (d, m) = (half(b), half(&b[2..]));
                let qs = &b[4..];
                out.extend(qs.iter().map(|&q| (q & 0x0f) as f32 * d + m));
                out.extend(qs.iter().map(|&q| (q >> 4) as f32 * d + m));
            }
            Format::Q4K => {
                let (d, dmin) = (half(b), half(&b[2..]));
                let (scales, qs) = (&b[4..16], &b[16..]);
                // Four groups of 64 values: 32 low nibbles, then 32 high nibbles, of 32 bytes.
                for (g, q) in qs.chunks_exact(32).enumerate() {
                    let (s1, m1) = scale_min_k4(2 * g, scales);
                    let (s2, m2) = scale_min_k4(2 * g + 1, scales);
                    let (d1, m1) = (d * s1 as f32, dmin * m1 as f32);
                    let (d2, m2) = (d * s2 as f32, dmin * m2 as f32);
                    out.extend(q.iter().map(|&v| d1 * (v & 0x0f) as f32 - m1));
                    out.extend(q.iter().map(|&v| d2 * (v >> 4) as f32 - m2));
                }
            }
            Format::Q6K => {
                let (ql, qh, sc) = (&b[..128], &b[128..192], &b[192..208]);
                let d = half(&b[208..]);
                // Two halves of 128 values, each from 64 bytes of `ql` and 32 of `qh`.
                for h in 0..2 {
                    let (ql, qh, sc) = (&ql[64 * h..], &qh[32 * h..], &sc[8 * h..]);
                    let start = out.len();
                    out.resize(start + 128, 0.0);
                    let y = &mut out[start..];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                        let s = |k: usize| d * (sc[is + k] as i8) as f32;
                        y[l] = s(0) * q1 as f32;
                        y[l + 32] = s(2) * q2 as f32;
                        y[l + 64] = s(4) * q3 as f32;
                        y[l + 96] = s(6) * q4 as f32;
                    }
                }
            }
        }
    }
}

/// The values of whole blocks of `format`.
pub fn dequantize(format: Format, bytes: &[u8]) -> Vec<f32> {
    let mut out = Vec::with_capacity(bytes.len() / format.block_bytes() * format.block_values());
    dequantize_into(format, bytes, &mut out);
    out
}

/// Rounds half away from zero (C's `roundf`).
fn round_away(x: f32) -> f32 {
    x.round()
}

/// Quantises `values` (a whole number of blocks) into `format`, as ggml's reference
/// quantisation does. The K-quants are not made here: they are read from files only.
pub fn quantize(format: Format, values: &[f32]) -> Result<Vec<u8>> {
    let bytes = format.row_bytes(values.len())?;
    let mut out = Vec::with_capacity(bytes);
    for x in values.chunks_exact(format.block_values()) {
        match format {
            Format::F16 => out.extend(f32_to_f16(x[0]).to_le_bytes()),
            Format::Q8_0 => {
                let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f32_to_f16(d).to_le_bytes());
                out.extend(x.iter().map(|&v| round_away(v * id) as i8 as u8));
            }
            Format::Q4_0 => {
                // The value of largest magnitude, with its sign, maps to -8.
                let max = x.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f32_to_f16(d).to_le_bytes());
                let q = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
                out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
            }
            Format::Q4_1 => {
                let min = x.iter().fold(f32::INFINITY, |m, &v| m.min(v));
                let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let d = (max - min) / 15.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend(f32_to_f16(d).to_le_bytes());
                out.extend(f32_to_f16(min).to_le_bytes());
                let q = |v: f32| (((v - min) * id + 0.5) as i8).min(15) as u8;
                out.extend((0..16).map(|j| q(x[j]) | (q(x[j + 16]) << 4)));
            }
            Format::Q4K | Format::Q6K => {
                bail!("quantising to {} is not supported (Q8_0, Q4_0, Q4_1 are)", format.name())
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// binary16 from its definition: (-1)^s · 2^(e-15) · (1 + f/1024), subnormals 2^-14 · f/1024.
    fn f16_reference(h: u16) -> f64 {
        let s = if h & 0x8000 != 0 { -1.0 } else { 1.0 };
        let e = ((h >> 10) & 0x1f) as i32;
        let f = (h & 0x3ff) as f64;
        match e {
            0 => s * 2f64.powi(-14) * f / 1024.0,
            31 if f == 0.0 => s * f64::INFINITY,
            31 => f64::NAN,
            _ => s * 2f64.powi(e - 15) * (1.0 + f / 1024.0),
        }
    }

    #[test]
    fn every_half_value_converts_exactly_and_back() {
        for h in 0..=u16::MAX {
            let (got, want) = (f16_to_f32(h) as f64, f16_reference(h));
            if want.is_nan() {
                assert!(got.is_nan(), "{h:#x}");
                assert!(f16_to_f32(f32_to_f16(got as f32)).is_nan(), "{h:#x}");
            } else {
                assert_eq!(got, want, "{h:#x}");
                assert_eq!(got.is_sign_negative(), want.is_sign_negative(), "{h:#x}");
                assert_eq!(f32_to_f16(got as f32), h, "{h:#x} back");
            }
        }
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        assert_eq!(bf16_to_f32(0xc040), -3.0);
    }

    /// The nearest half by search over every finite half (ties to the even one), against which
    /// the rounding of [`f32_to_f16`] is checked.
    fn nearest_half(x: f32) -> u16 {
        let mut best = if x.is_sign_negative() { 0x8000 } else { 0 };
        let mut best_err = f64::INFINITY;
        for h in 0..=u16::MAX {
            let v = f16_reference(h);
            if !v.is_finite() || (v == 0.0 && v.is_sign_negative() != x.is_sign_negative()) {
                continue;
            }
            let err = (v - x as f64).abs();
            if err < best_err || (err == best_err && h & 1 == 0) {
                (best, best_err) = (h, err);
            }
        }
        // Beyond the largest half by half an ulp or more: infinity.
        if (x as f64).abs() >= 65520.0 {
            return if x < 0.0 { 0xfc00 } else { 0x7c00 };
        }
        best
    }

    #[test]
    fn f32_to_f16_rounds_to_the_nearest_half_ties_to_even() {
        let mut cases = vec![0.0f32, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 1e-8, -3e-5, 6.1e-5];
        let mut s = 12345u64;
        for _ in 0..300 {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let mag = ((s >> 40) % 30) as i32 - 25;
            let frac = (s >> 11) as f64 / (1u64 << 53) as f64;
            let v = (1.0 + frac) * 2f64.powi(mag) * if s & 1 == 0 { 1.0 } else { -1.0 };
            cases.push(v as f32);
        }
        // Exact ties between two halves.
        for h in [0x3c00u16, 0x3c01, 0x0001, 0x0002, 0x7bfe] {
            let (a, b) = (f16_reference(h), f16_reference(h + 1));
            cases.push(((a + b) / 2.0) as f32);
        }
        for x in cases {
            assert_eq!(f32_to_f16(x), nearest_half(x), "{x:e}");
        }
    }

    #[test]
    fn formats_name_their_geometry() {
        for f in Format::ALL {
            assert_eq!(Format::from_ggml_id(f.ggml_id()), Some(f));
        }
        assert_eq!(Format::Q4K.row_bytes(512).unwrap(), 288);
        let e = Format::Q8_0.row_bytes(40).unwrap_err().to_string();
        assert!(e.contains("blocks of 32") && e.contains("40 values"), "{e}");
        assert!(quantize(Format::Q6K, &[0.0; 256]).is_err());
    }
}
