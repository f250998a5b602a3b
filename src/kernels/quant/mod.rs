//! ggml's block formats: weights stored as blocks of small integers with one or two scales per
//! block, the formats of the GGUF files people download. Conversion both ways, bit for bit as
//! ggml's reference code does it (`dequantize_row_*`, `quantize_row_*_ref`), and products of
//! quantised rows with activations ([`matrix`]). Each format lives in one file of [`formats`].
//!
//! | format | values per block | bytes per block | a value |
//! |---|---|---|---|
//! | F16 | 1 | 2: an IEEE half | the half as f32 |
//! | Q8_0 | 32 | 34: f16 `d`, 32 × i8 `q` | `q · d` |
//! | Q4_0 | 32 | 18: f16 `d`, 16 bytes of nibbles | `(q − 8) · d` |
//! | Q4_1 | 32 | 20: f16 `d`, f16 `m`, 16 bytes of nibbles | `q · d + m` |
//! | Q5_0 | 32 | 22: f16 `d`, 4 bytes of fifth bits, 16 of nibbles | `(q − 16) · d` |
//! | Q5_1 | 32 | 24: f16 `d`, f16 `m`, 4 bytes of fifth bits, 16 of nibbles | `q · d + m` |
//! | Q4_K | 256 | 144: f16 `d`, f16 `dmin`, 12 bytes of 6-bit scales and mins, 128 of nibbles | `d·sc · q − dmin·m` per 32 |
//! | Q5_K | 256 | 176: as Q4_K, with 32 bytes of fifth bits | `d·sc · q − dmin·m` per 32 |
//! | Q6_K | 256 | 210: 128 bytes of low nibbles, 64 of high 2 bits, 16 × i8 scales, f16 `d` | `d·sc · (q − 32)` per 16 |
//!
//! In a 32-value block of Q4_0, Q4_1, Q5_0 and Q5_1 the low nibbles hold values 0..16 and the
//! high nibbles values 16..32.

pub mod dot;
pub mod formats;
#[cfg(target_arch = "x86_64")]
mod lanes;
mod layouts;
pub mod matrix;
pub mod packed;
#[cfg(test)]
mod testing;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

use anyhow::{bail, ensure, Result};
use formats::FormatOps;

/// Runs the first expression where the processor has AVX-512 VNNI, the second where it has
/// AVX2 (with FMA and F16C), the third elsewhere: the one place the code chooses among the
/// forms of its kernels ([`x86::isa`]).
macro_rules! by_isa {
    (vnni => $vnni:expr, avx2 => $avx2:expr, portable => $portable:expr $(,)?) => {{
        #[cfg(target_arch = "x86_64")]
        let chosen = match $crate::kernels::quant::x86::isa() {
            Some($crate::kernels::quant::x86::Isa::Vnni) => $vnni,
            Some($crate::kernels::quant::x86::Isa::Avx2) => $avx2,
            None => $portable,
        };
        #[cfg(not(target_arch = "x86_64"))]
        let chosen = $portable;
        chosen
    }};
}
pub(crate) use by_isa;

/// A block format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    F16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4K,
    Q5K,
    Q6K,
}

impl Format {
    /// Every format, in ggml's order of type ids.
    pub const ALL: [Format; 9] = [
        Format::F16,
        Format::Q4_0,
        Format::Q4_1,
        Format::Q5_0,
        Format::Q5_1,
        Format::Q8_0,
        Format::Q4K,
        Format::Q5K,
        Format::Q6K,
    ];

    /// What the code knows of the format: the one place that chooses among them.
    pub fn ops(self) -> &'static FormatOps {
        match self {
            Format::F16 => &formats::f16::OPS,
            Format::Q8_0 => &formats::q8_0::OPS,
            Format::Q4_0 => &formats::q4_0::OPS,
            Format::Q4_1 => &formats::q4_1::OPS,
            Format::Q5_0 => &formats::q5_0::OPS,
            Format::Q5_1 => &formats::q5_1::OPS,
            Format::Q4K => &formats::q4_k::OPS,
            Format::Q5K => &formats::q5_k::OPS,
            Format::Q6K => &formats::q6_k::OPS,
        }
    }

    /// ggml's type id.
    pub fn ggml_id(self) -> u32 {
        self.ops().ggml_id
    }

    pub fn from_ggml_id(id: u32) -> Option<Format> {
        Format::ALL.into_iter().find(|f| f.ggml_id() == id)
    }

    /// ggml's name: `Q8_0`, `Q4_K`, ...
    pub fn name(self) -> &'static str {
        self.ops().name
    }

    /// Values per block.
    pub fn block_values(self) -> usize {
        self.ops().block_values
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        self.ops().block_bytes
    }

    /// Whether [`quantize`] makes the format (every format does today).
    pub fn quantizable(self) -> bool {
        self.ops().quantize.is_some()
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

/// An f16 stored little-endian at the start of `b`, as f32.
pub(crate) fn half(b: &[u8]) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[0], b[1]]))
}

/// A bfloat16 value as f32; exact.
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// Appends the values of whole blocks of `format` to `out`.
pub fn dequantize_into(format: Format, bytes: &[u8], out: &mut Vec<f32>) {
    let ops = format.ops();
    let start = out.len();
    out.resize(start + bytes.len() / ops.block_bytes * ops.block_values, 0.0);
    for (b, o) in
        bytes.chunks_exact(ops.block_bytes).zip(out[start..].chunks_exact_mut(ops.block_values))
    {
        (ops.dequantize)(b, o);
    }
}

/// The values of whole blocks of `format`.
pub fn dequantize(format: Format, bytes: &[u8]) -> Vec<f32> {
    let mut out = Vec::new();
    dequantize_into(format, bytes, &mut out);
    out
}

/// Quantises `values` (a whole number of blocks) into `format`, as ggml's reference
/// quantisation does (for the K-quants, `quantize_row_q*_K_ref`, which llama.cpp's quantizer
/// runs without an importance matrix).
pub fn quantize(format: Format, values: &[f32]) -> Result<Vec<u8>> {
    let ops = format.ops();
    let Some(quantize_block) = ops.quantize else {
        let made: Vec<&str> =
            Format::ALL.iter().filter(|f| f.quantizable()).map(|f| f.name()).collect();
        bail!("quantising to {} is not supported ({} are)", ops.name, made.join(", "))
    };
    let mut out = vec![0u8; format.row_bytes(values.len())?];
    for (x, o) in values.chunks_exact(ops.block_values).zip(out.chunks_exact_mut(ops.block_bytes)) {
        quantize_block(x, o);
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
        let e = quantize(Format::Q6K, &[0.0; 200]).unwrap_err().to_string();
        assert!(e.contains("blocks of 256"), "{e}");
    }
}
