//! ggml's block formats against ggml's own Python package (`gguf`): fixtures written by
//! `scripts/reference/make_quant_fixtures.py`. Dequantisation of every format (edge cases
//! included: zero, subnormal and extreme scales, the K-quants' extreme 6-bit scales and
//! minimums) and quantisation to every format the package makes must give the same bits.

use attnres::kernels::quant::{dequantize, quantize, Format};
use std::path::PathBuf;

fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant").join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn floats(bytes: &[u8]) -> Vec<f32> {
    bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "{what}: value {i}: {g} vs gguf's {w}");
    }
}

#[test]
fn dequantisation_of_every_format_is_ggmls_bit_for_bit() {
    for format in Format::ALL {
        let name = format.name().to_lowercase();
        let blocks = fixture(&format!("{name}.blocks"));
        let want = floats(&fixture(&format!("{name}.values")));
        assert_eq!(blocks.len() / format.block_bytes() * format.block_values(), want.len());
        assert_same_bits(&dequantize(format, &blocks), &want, format.name());
    }
}

#[test]
fn quantisation_to_the_formats_gguf_makes_is_ggmls_bit_for_bit() {
    let source = floats(&fixture("source"));
    let made = [Format::F16, Format::Q8_0, Format::Q4_0, Format::Q4_1, Format::Q5_0, Format::Q5_1];
    for format in made {
        let blocks = fixture(&format!("{}.blocks", format.name().to_lowercase()));
        let got = quantize(format, &source).unwrap();
        // The fixture's first blocks are gguf's quantisation of `source`; edge cases follow.
        assert!(blocks.len() > got.len(), "{}", format.name());
        let want = &blocks[..got.len()];
        for (b, (g, w)) in
            got.chunks(format.block_bytes()).zip(want.chunks(format.block_bytes())).enumerate()
        {
            assert_eq!(g, w, "{}: block {b}", format.name());
        }
    }
}

/// Q4_K, Q5_K and Q6_K, which gguf reads but does not make: 32 super-blocks of varied values
/// quantised as ggml's own C quantiser does it (`quantize_row_q*_K_ref`, fixtures by
/// make_kquant_fixtures.py).
#[test]
fn quantisation_to_the_k_quants_is_ggmls_bit_for_bit() {
    let source = floats(&fixture("kquant.source"));
    for format in [Format::Q4K, Format::Q5K, Format::Q6K] {
        let want = fixture(&format!("{}.made", format.name().to_lowercase()));
        let got = quantize(format, &source).unwrap();
        assert_eq!(got.len(), want.len(), "{}", format.name());
        for (b, (g, w)) in
            got.chunks(format.block_bytes()).zip(want.chunks(format.block_bytes())).enumerate()
        {
            assert_eq!(g, w, "{}: block {b}", format.name());
        }
    }
}
