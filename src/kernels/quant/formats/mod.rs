//! One file per block format: its layout in a file, its dequantiser and quantiser (bit for bit
//! ggml's reference code, `dequantize_row_*` and `quantize_row_*_ref`), and how its rows are
//! regrouped for the products ([`super::packed`]). Each file ends in one [`FormatOps`] table,
//! and [`super::Format::ops`] is the only place that chooses among them: a new format is a new
//! file here and a line there.

pub mod f16;
pub mod q4_0;
pub mod q4_1;
pub mod q4_k;
pub mod q5_0;
pub mod q5_1;
pub mod q5_k;
pub mod q6_k;
pub mod q8_0;
mod search;

pub(super) use super::half;
use super::packed::{Kernels, Layout, ROWS};

/// What the code knows of one format.
pub struct FormatOps {
    /// ggml's name: `Q8_0`, `Q4_K`, …
    pub name: &'static str,
    /// ggml's type id.
    pub ggml_id: u32,
    /// llama.cpp's file type (`general.file_type`, `LLAMA_FTYPE_MOSTLY_*`) of a file whose
    /// matrices are mostly in this format (for a K-quant, its plain `_S` mix).
    pub file_type: u32,
    pub block_values: usize,
    pub block_bytes: usize,
    /// One block's values (`block_values` of them into `out`).
    pub dequantize: fn(block: &[u8], out: &mut [f32]),
    /// One block of values into its bytes, as ggml's reference quantiser makes them; `None`
    /// where this code does not make the format (it reads it only).
    pub quantize: Option<QuantizeBlock>,
    /// The products of rows regrouped eight at a time with quantised activations; `None` for
    /// F16, whose rows are multiplied as they are, in f32.
    pub packed: Option<Packed>,
}

/// One block of values (`block_values`) into its bytes (`block_bytes`).
pub type QuantizeBlock = fn(values: &[f32], out: &mut [u8]);

/// How a format's rows are regrouped and multiplied ([`super::packed`]).
pub struct Packed {
    /// Bytes of one block of a group of eight rows.
    pub group_block: usize,
    /// Eight rows' blocks (the same block of each) regrouped into `out`.
    pub pack: fn(blocks: [&[u8]; 8], out: &mut [u8]),
    pub kernels: Kernels,
}

impl Packed {
    pub const fn of<L: Layout>(pack: fn(blocks: [&[u8]; ROWS], out: &mut [u8])) -> Packed {
        Packed { group_block: L::GROUP_BLOCK, pack, kernels: Kernels::of::<L>() }
    }
}

/// The largest magnitude of `x`, with its sign (the first such value where two tie), as ggml's
/// Q4_0 and Q5_0 quantisers choose it.
pub(super) fn signed_max(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m })
}

/// The smallest and largest of `x`.
pub(super) fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

/// `1 / d`, or 0 where `d` is 0 (ggml's quantisers).
pub(super) fn inverse(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}
