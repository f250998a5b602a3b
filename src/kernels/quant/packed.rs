//! Q8_0 and Q4_0 rows regrouped eight at a time for the products: a copy made when a model
//! loads, so that one vector instruction works on eight rows at once.
//!
//! In a file each row's blocks follow one another; a product then spends most of its
//! instructions on one row's block at a time (unpacking, converting its scale, summing the
//! lanes). Regrouped, a 32-byte load holds four values of each of eight rows, which one
//! `vpmaddubsw` (or `vpdpbusd`) multiplies by the same four activations broadcast to every
//! lane: the eight lanes are the eight rows' sums, and no lane ever needs summing across. Per
//! block of 32 values and group of 8 rows the layout holds:
//!
//! - the 8 rows' f16 scales, 16 bytes (one conversion gives all eight as f32);
//! - Q8_0: 8 chunks of 32 bytes; chunk `g` holds values `4g..4g+4` of row 0, then of row 1, …;
//! - Q4_0: 4 chunks of 32 bytes; in chunk `c` the low nibbles hold values `4c..4c+4` of each
//!   row, the high nibbles values `16+4c..16+4c+4`, as stored (0..16, the offset of 8 not taken).
//!
//! Every product of a row and a token computes, block after block, the block's exact integer sum
//! `s`, then `acc = fma(s as f32, d_w · d_x, acc)` in f32: the same operations in the same order
//! in the portable code, in the vector kernels, for one token or four, so a token's result has
//! the same bits whatever else runs with it.

use super::Format;

/// Rows per group.
pub const ROWS: usize = 8;

/// Bytes per block of a group of eight rows: scales, then values.
pub fn group_block_bytes(format: Format) -> usize {
    16 + match format {
        Format::Q8_0 => 256,
        _ => 128,
    }
}

/// Whether [`pack`] takes rows of `format`.
pub fn packs(format: Format) -> bool {
    matches!(format, Format::Q8_0 | Format::Q4_0)
}

/// `rows` rows of `format` blocks (`bytes`, as a file holds them), a multiple of [`ROWS`],
/// regrouped.
pub fn pack(format: Format, bytes: &[u8], rows: usize) -> Vec<u8> {
    assert!(packs(format) && rows.is_multiple_of(ROWS) && bytes.len().is_multiple_of(rows));
    let rb = bytes.len() / rows;
    let (bb, blocks) = (format.block_bytes(), rb / format.block_bytes());
    let gb = group_block_bytes(format);
    let mut out = vec![0u8; rows / ROWS * blocks * gb];
    for (g, group) in out.chunks_exact_mut(blocks * gb).enumerate() {
        for (b, o) in group.chunks_exact_mut(gb).enumerate() {
            let block = |r: usize| &bytes[(g * ROWS + r) * rb + b * bb..][..bb];
            for r in 0..ROWS {
                o[2 * r..2 * r + 2].copy_from_slice(&block(r)[..2]);
            }
            let values = &mut o[16..];
            for r in 0..ROWS {
                let q = &block(r)[2..];
                match format {
                    Format::Q8_0 => {
                        for (j, &v) in q.iter().enumerate() {
                            values[(j / 4) * 32 + 4 * r + j % 4] = v;
                        }
                    }
                    _ => {
                        // q[j] holds value j (low nibble) and value j + 16 (high nibble).
                        for j in 0..16 {
                            values[(j / 4) * 32 + 4 * r + j % 4] = q[j];
                        }
                    }
                }
            }
        }
    }
    out
}

/// Activations quantised to Q8_0, with what the regrouped kernels read beside the blocks: each
/// block's scale as f32, and its values' sum (for Q4_0's offset of 8).
pub struct Activations<'a> {
    /// Q8_0 blocks, 34 bytes each.
    pub blocks: &'a [u8],
    pub scales: &'a [f32],
    pub sums: &'a [i32],
}

/// `y[r] = Σ_j W[r, j] · x[j]` for the eight rows of each group in `packed` (`groups` groups)
/// and one token; `y` holds `8 · groups` values.
pub fn group_dot(format: Format, packed: &[u8], x: &Activations, y: &mut [f32]) {
    let blocks = x.scales.len();
    assert!(x.blocks.len() == blocks * 34 && x.sums.len() == blocks);
    assert!(packed.len() == y.len() / ROWS * blocks * group_block_bytes(format));
    #[cfg(target_arch = "x86_64")]
    {
        use super::x86::{avx2, isa, vnni, Isa};
        // SAFETY: the processor has the instruction set (just checked); the sizes agree
        // (checked above).
        match isa() {
            Some(Isa::Vnni) => return unsafe { vnni::group_dot(format, packed, x, y) },
            Some(Isa::Avx2) => return unsafe { avx2::group_dot(format, packed, x, y) },
            None => {}
        }
    }
    group_dot_portable(format, packed, x, y)
}

/// [`group_dot`] for four tokens: `y` holds the four tokens' outputs one after another
/// (`8 · groups` values each), the same bits as four calls of [`group_dot`].
pub fn group_dot4(format: Format, packed: &[u8], x: [&Activations; 4], y: &mut [f32]) {
    let blocks = x[0].scales.len();
    assert!(x.iter().all(|x| {
        x.blocks.len() == blocks * 34 && x.sums.len() == blocks && x.scales.len() == blocks
    }));
    assert!(y.len().is_multiple_of(4 * ROWS));
    assert!(packed.len() == y.len() / 4 / ROWS * blocks * group_block_bytes(format));
    #[cfg(target_arch = "x86_64")]
    {
        use super::x86::{avx2, isa, vnni, Isa};
        // SAFETY: the processor has the instruction set (just checked); the sizes agree
        // (checked above).
        match isa() {
            Some(Isa::Vnni) => return unsafe { vnni::group_dot4(format, packed, x, y) },
            Some(Isa::Avx2) => return unsafe { avx2::group_dot4(format, packed, x, y) },
            None => {}
        }
    }
    let width = y.len() / 4;
    for (x, y) in x.iter().zip(y.chunks_exact_mut(width)) {
        group_dot_portable(format, packed, x, y);
    }
}

/// [`group_dot`] in plain Rust: the form the vector kernels are checked against, bit for bit.
pub fn group_dot_portable(format: Format, packed: &[u8], x: &Activations, y: &mut [f32]) {
    let blocks = x.scales.len();
    let gb = group_block_bytes(format);
    for (group, out) in packed.chunks_exact(blocks * gb).zip(y.chunks_exact_mut(ROWS)) {
        let mut acc = [0.0f32; ROWS];
        for (b, g) in group.chunks_exact(gb).enumerate() {
            let xs = &x.blocks[b * 34 + 2..][..32];
            for (r, acc) in acc.iter_mut().enumerate() {
                let mut s = 0i32;
                for j in 0..32 {
                    let w = match format {
                        Format::Q8_0 => g[16 + (j / 4) * 32 + 4 * r + j % 4] as i8 as i32,
                        _ => {
                            let byte = g[16 + ((j % 16) / 4) * 32 + 4 * r + j % 4];
                            (if j < 16 { byte & 0x0f } else { byte >> 4 }) as i32 - 8
                        }
                    };
                    s += w * xs[j] as i8 as i32;
                }
                let dw = super::f16_to_f32(u16::from_le_bytes([g[2 * r], g[2 * r + 1]]));
                *acc = (s as f32).mul_add(dw * x.scales[b], *acc);
            }
        }
        out.copy_from_slice(&acc);
    }
}

#[cfg(test)]
mod tests {
    use super::super::dot::quantize_activations;
    use super::super::f16_to_f32;
    use super::super::testing::{in_every_form, raw_blocks};
    use super::*;

    fn activations(x: &[f32]) -> (Vec<u8>, Vec<f32>, Vec<i32>) {
        let q = quantize_activations(x).unwrap();
        let scales = q.chunks(34).map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect();
        let sums = q.chunks(34).map(|b| b[2..].iter().map(|&v| v as i8 as i32).sum()).collect();
        (q, scales, sums)
    }

    /// Row by row from the file's layout: each block's exact integer sum, then one fused
    /// multiply-add per block, as the module's notes say.
    fn by_rows(format: Format, bytes: &[u8], rows: usize, xq: &[u8], xd: &[f32]) -> Vec<f32> {
        let rb = bytes.len() / rows;
        (0..rows)
            .map(|r| {
                let mut acc = 0.0f32;
                for (b, w) in
                    bytes[r * rb..(r + 1) * rb].chunks_exact(format.block_bytes()).enumerate()
                {
                    let xs = &xq[b * 34 + 2..b * 34 + 34];
                    let s: i32 = (0..32)
                        .map(|j| {
                            let q = &w[2..];
                            let v = match format {
                                Format::Q8_0 => q[j] as i8 as i32,
                                _ => (if j < 16 { q[j] & 0x0f } else { q[j - 16] >> 4 }) as i32 - 8,
                            };
                            v * xs[j] as i8 as i32
                        })
                        .sum();
                    let dw = f16_to_f32(u16::from_le_bytes([w[0], w[1]]));
                    acc = (s as f32).mul_add(dw * xd[b], acc);
                }
                acc
            })
            .collect()
    }

    #[test]
    fn regrouped_products_are_each_rows_product_bit_for_bit() {
        in_every_form(|form| {
            for format in [Format::Q8_0, Format::Q4_0] {
                for (rows, blocks) in [(8, 1), (16, 3), (24, 18)] {
                    regrouped_case(form, format, rows, blocks);
                }
            }
        });
    }

    fn regrouped_case(form: &str, format: Format, rows: usize, blocks: usize) {
        let bytes = raw_blocks(format, rows * blocks, 5 + rows as u64);
        let mut x: Vec<f32> =
            (0..blocks * 32).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        x[0] = 1e3;
        let (xq, xd, sums) = activations(&x);
        let act = Activations { blocks: &xq, scales: &xd, sums: &sums };
        let packed = pack(format, &bytes, rows);
        let want = by_rows(format, &bytes, rows, &xq, &xd);
        let mut portable = vec![0.0; rows];
        group_dot_portable(format, &packed, &act, &mut portable);
        let mut fast = vec![0.0; rows];
        group_dot(format, &packed, &act, &mut fast);
        // Four tokens at once: four different tokens, each the bits it gets alone.
        let xs4: Vec<Vec<f32>> = (0..4)
            .map(|t| {
                x.iter().enumerate().map(|(i, v)| v * (1.0 + 0.1 * ((i + t) % 5) as f32)).collect()
            })
            .collect();
        let acts4: Vec<_> = xs4.iter().map(|x| activations(x)).collect();
        let a4: Vec<Activations> =
            acts4.iter().map(|(q, d, s)| Activations { blocks: q, scales: d, sums: s }).collect();
        let mut four = vec![0.0; 4 * rows];
        group_dot4(format, &packed, [&a4[0], &a4[1], &a4[2], &a4[3]], &mut four);
        for (t, a) in a4.iter().enumerate() {
            let mut alone = vec![0.0; rows];
            group_dot_portable(format, &packed, a, &mut alone);
            for r in 0..rows {
                assert_eq!(
                    four[t * rows + r].to_bits(),
                    alone[r].to_bits(),
                    "{form}: {format:?} token {t} row {r}"
                );
            }
        }
        for r in 0..rows {
            assert_eq!(
                portable[r].to_bits(),
                want[r].to_bits(),
                "{form}: {format:?} portable row {r}"
            );
            assert_eq!(fast[r].to_bits(), want[r].to_bits(), "{form}: {format:?} row {r}");
        }
    }
}
