//! ggml's block formats against ggml's own Python package (`gguf`): fixtures written by
//! `scripts/reference/make_quant_fixtures.py`. Dequantisation of every format (edge cases
//! included: zero, subnormal and extreme scales, the K-quants' extreme 6-bit scales and
//! minimums) and quantisation to every format made here must give the same bits.

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
fn quantisation_of_every_format_made_here_is_ggmls_bit_for_bit() {
    let source = floats(&fixture("source"));
    let made: Vec<Format> = Format::ALL.into_iter().filter(|f| f.quantizable()).collect();
    assert_eq!(made.len(), 6, "F16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: {made:?}");
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
