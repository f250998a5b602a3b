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
            Format::Q6K => &[208],
            Format::Q4K | Format::Q4_1 => &[0, 2],
            _ => &[0],
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
