//! Inputs for the tests of the block formats' products.

use super::{f32_to_f16, Format};

/// `n` values in [-1, 1) from a fixed pseudo-random sequence.
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
        })
        .collect()
}

/// Raw blocks of `format` with every bit pattern likely, and small finite scales that differ
/// from block to block (0.010 to 0.016), so that a scale read from the wrong block shows.
pub fn raw_blocks(format: Format, blocks: usize, seed: u64) -> Vec<u8> {
    if format == Format::F16 {
        // Halves of values in [-1, 1) instead: random bits would hold infinities and NaNs.
        return values(blocks, seed).iter().flat_map(|&v| f32_to_f16(v).to_le_bytes()).collect();
    }
    let mut s = seed;
    let mut bytes: Vec<u8> = (0..blocks * format.block_bytes())
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 56) as u8
        })
        .collect();
    for (i, b) in bytes.chunks_exact_mut(format.block_bytes()).enumerate() {
        let scale = f32_to_f16(0.01 + 0.001 * (i % 7) as f32).to_le_bytes();
        let at: &[usize] = match format {
            Format::F16 => unreachable!("handled above"),
            Format::Q6K => &[208],
            Format::Q4K | Format::Q5K | Format::Q4_1 | Format::Q5_1 => &[0, 2],
            Format::Q8_0 | Format::Q4_0 | Format::Q5_0 => &[0],
        };
        for &i in at {
            b[i..i + 2].copy_from_slice(&scale);
        }
    }
    bytes
}

/// Runs `f` once in every form of the block products this processor has (its instruction sets
/// and the portable code), each named for messages; elsewhere than x86-64, once, portably.
pub fn in_every_form(mut f: impl FnMut(&str)) {
    #[cfg(target_arch = "x86_64")]
    for form in super::x86::forms() {
        super::x86::with_isa(form, || f(&format!("{form:?}")));
    }
    #[cfg(not(target_arch = "x86_64"))]
    f("portable");
}

/// The values of `blocks` of `format` split in two: with the minimums (`m`, `dmin`) zeroed,
/// and with the scales zeroed (all zeros for a format without minimums), whose magnitudes
/// bound the f32 rounding of a product that adds the two apart.
pub fn scale_and_min_parts(format: Format, blocks: &[u8]) -> (Vec<f32>, Vec<f32>) {
    let (scale, min) = match format {
        Format::Q4_1 | Format::Q5_1 | Format::Q4K | Format::Q5K => (0..2, 2..4),
        Format::F16 | Format::Q8_0 | Format::Q4_0 | Format::Q5_0 | Format::Q6K => {
            let w = super::dequantize(format, blocks);
            return (w.clone(), vec![0.0; w.len()]);
        }
    };
    let zeroed = |at: std::ops::Range<usize>| {
        let mut b = blocks.to_vec();
        for block in b.chunks_exact_mut(format.block_bytes()) {
            block[at.clone()].fill(0);
        }
        super::dequantize(format, &b)
    };
    (zeroed(min), zeroed(scale))
}
