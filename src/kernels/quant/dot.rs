//! Products of quantised rows with activations, without expanding the rows to f32.
//!
//! Two ways, as llama.cpp has them: [`dot_f32`] takes f32 activations (each block's values are
//! made and multiplied in registers); [`dot_q8`] takes activations quantised to Q8_0
//! ([`quantize_activations`]), so that each block is a sum of integer products scaled once by
//! both blocks' scales: the weights' format sets how far that is from the f32 product (the
//! tests state the bound). F16 rows have their own product ([`dot_f16_many`]), in f32.

use super::packed::Activations;
use super::{dequantize_into, Format};
use anyhow::Result;
use rayon::prelude::*;

/// `Σ row[j] · x[j]` for one quantised row of `x.len()` values.
pub fn dot_f32(format: Format, row: &[u8], x: &[f32]) -> f32 {
    let per = format.block_values();
    let mut values = Vec::with_capacity(per);
    let mut sum = 0.0f32;
    for (b, xb) in row.chunks_exact(format.block_bytes()).zip(x.chunks_exact(per)) {
        values.clear();
        dequantize_into(format, b, &mut values);
        sum += values.iter().zip(xb).map(|(w, v)| w * v).sum::<f32>();
    }
    sum
}

/// `Σ row[j] · x[j]` for `R` rows of F16 values and `T` tokens (`[[f32; T]; R]`), each pair
/// computed as [`dot_f16`] does it alone: 32 lanes, lane `l` a chain of fused multiply-adds
/// over values `l, l + 32, l + 64, …`; the four groups of eight lanes added as `(g0 + g1) +
/// (g2 + g3)`, those eight summed as `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`;
/// then the values past the last whole 32 added one by one. The vector kernel does the same
/// operations, so every token's result has the same bits whatever runs with it. Four chains
/// per pair keep the multiply-adds' latency hidden when one row and one token run alone, as
/// in decoding (a row at a time reads memory fastest).
pub fn dot_f16_many<const R: usize, const T: usize>(
    rows: [&[u8]; R],
    xs: [&[f32]; T],
) -> [[f32; T]; R] {
    let k = xs.first().map_or(0, |x| x.len());
    assert!(rows.iter().all(|r| r.len() == 2 * k) && xs.iter().all(|x| x.len() == k));
    #[cfg(target_arch = "x86_64")]
    if super::x86::isa().is_some() {
        // SAFETY: the processor has AVX2, FMA and F16C (`isa` found them); every row holds
        // two bytes per value of every token (checked above).
        return unsafe { super::x86::dot_f16_many(rows, xs) };
    }
    rows.map(|row| xs.map(|x| dot_f16_portable(row, x)))
}

/// [`dot_f16_many`] of one row and one token.
pub fn dot_f16(row: &[u8], x: &[f32]) -> f32 {
    dot_f16_many([row], [x])[0][0]
}

fn dot_f16_portable(row: &[u8], x: &[f32]) -> f32 {
    let whole = x.len() / 32 * 32;
    let mut lanes = [0.0f32; 32];
    for (w, x) in row[..2 * whole].chunks_exact(64).zip(x[..whole].chunks_exact(32)) {
        for (l, lane) in lanes.iter_mut().enumerate() {
            *lane = super::half(&w[2 * l..]).mul_add(x[l], *lane);
        }
    }
    let g: [f32; 8] =
        std::array::from_fn(|l| (lanes[l] + lanes[8 + l]) + (lanes[16 + l] + lanes[24 + l]));
    let mut sum = ((g[0] + g[4]) + (g[2] + g[6])) + ((g[1] + g[5]) + (g[3] + g[7]));
    for j in whole..x.len() {
        sum = super::half(&row[2 * j..]).mul_add(x[j], sum);
    }
    sum
}

/// Activations quantised to Q8_0, blocks of 32, for [`dot_q8`].
pub fn quantize_activations(x: &[f32]) -> Result<Vec<u8>> {
    super::quantize(Format::Q8_0, x)
}

/// Rows of activations quantised to Q8_0 (the same bytes as [`quantize_activations`] gives
/// each), with what the kernels read beside the blocks: each block's scale as f32 and the sum
/// of its 32 values.
pub struct QuantRows {
    blocks: Vec<u8>,
    scales: Vec<f32>,
    sums: Vec<i32>,
    /// Blocks per row.
    per_row: usize,
}

impl QuantRows {
    /// `x` as rows of `cols` values, a whole number of blocks of 32; the rows in parallel.
    pub fn new(x: &[f32], cols: usize) -> QuantRows {
        assert!(cols.is_multiple_of(32) && cols > 0 && x.len().is_multiple_of(cols));
        let (per_row, n) = (cols / 32, x.len() / cols);
        let mut blocks = vec![0u8; n * per_row * 34];
        let mut scales = vec![0.0f32; n * per_row];
        let mut sums = vec![0i32; n * per_row];
        (
            blocks.par_chunks_mut(34 * per_row),
            scales.par_chunks_mut(per_row),
            sums.par_chunks_mut(per_row),
            x.par_chunks(cols),
        )
            .into_par_iter()
            .for_each(|(q, d, s, x)| {
                for (((q, d), s), x) in q.chunks_exact_mut(34).zip(d).zip(s).zip(x.chunks_exact(32))
                {
                    (*d, *s) = quantize_block(x.try_into().expect("32 values"), q);
                }
            });
        QuantRows { blocks, scales, sums, per_row }
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> Activations<'_> {
        let b = i * self.per_row..(i + 1) * self.per_row;
        Activations {
            blocks: &self.blocks[34 * b.start..34 * b.end],
            scales: &self.scales[b.clone()],
            sums: &self.sums[b],
        }
    }
}

/// One block of 32 activations into its 34 bytes of Q8_0 (`out`), as [`super::quantize`]
/// makes them; returns the block's scale as f32 (after its f16 rounding) and the sum of its
/// values. With AVX2 where the processor has it: the same bits.
fn quantize_block(x: &[f32; 32], out: &mut [u8]) -> (f32, i32) {
    #[cfg(target_arch = "x86_64")]
    if super::x86::isa().is_some() {
        // SAFETY: the processor has AVX2 (`isa` found it); `out` holds 34 bytes (checked
        // inside).
        if let Some(done) = unsafe { super::x86::quantize_block(x, out) } {
            return done;
        }
    }
    quantize_block_portable(x, out)
}

fn quantize_block_portable(x: &[f32; 32], out: &mut [u8]) -> (f32, i32) {
    out.copy_from_slice(&super::quantize(Format::Q8_0, x).expect("one whole block"));
    (super::half(out), out[2..].iter().map(|&v| v as i8 as i32).sum())
}

/// Whether [`dot_q8`] takes rows of `format`.
pub fn takes_q8(format: Format) -> bool {
    matches!(format, Format::Q8_0 | Format::Q4_0)
}

/// `Σ row[j] · x[j]` for a row of Q8_0 or Q4_0 and activations `xq` in Q8_0 (as ggml's
/// `vec_dot_q8_0_q8_0` and `vec_dot_q4_0_q8_0`): per block the integer sum of products, times
/// the row's scale, times the activations'. With AVX2 where the processor has it (the same
/// products summed in another order: equal to the portable result within f32 rounding).
pub fn dot_q8(format: Format, row: &[u8], xq: &[u8]) -> f32 {
    assert!(takes_q8(format), "dot_q8 takes Q8_0 and Q4_0 rows, not {}", format.name());
    #[cfg(target_arch = "x86_64")]
    {
        use super::x86::{avx2, isa, vnni, Isa};
        // SAFETY: the processor has the instruction set (just checked); the format is Q8_0 or
        // Q4_0 and the blocks whole (the caller's rows).
        match isa() {
            Some(Isa::Vnni) => return unsafe { vnni::dot_q8(format, row, xq) },
            Some(Isa::Avx2) => return unsafe { avx2::dot_q8(format, row, xq) },
            None => {}
        }
    }
    dot_q8_portable(format, row, xq)
}

/// [`dot_q8`] of one row with four activation rows: `xd` holds each activation block's scale
/// as f32. The vector kernel shares the row's unpacking among the four.
pub fn dot_q8_x4(format: Format, row: &[u8], xq: [&[u8]; 4], xd: [&[f32]; 4]) -> [f32; 4] {
    assert!(takes_q8(format), "dot_q8 takes Q8_0 and Q4_0 rows, not {}", format.name());
    let blocks = row.len() / format.block_bytes();
    assert!(xq.iter().zip(xd).all(|(q, d)| q.len() == blocks * 34 && d.len() == blocks));
    #[cfg(target_arch = "x86_64")]
    {
        use super::x86::{avx2, isa, vnni, Isa};
        // SAFETY: the processor has the instruction set (just checked); the format is Q8_0 or
        // Q4_0, and every activation row holds as many blocks as the row (checked above).
        match isa() {
            Some(Isa::Vnni) => return unsafe { vnni::dot_q8_x4(format, row, xq, xd) },
            Some(Isa::Avx2) => return unsafe { avx2::dot_q8_x4(format, row, xq, xd) },
            None => {}
        }
    }
    xq.map(|x| dot_q8_portable(format, row, x))
}

/// [`dot_q8`] of four rows with one activation row: `xd` holds each activation block's scale
/// as f32. The vector kernel shares the activations' loads among the four.
pub fn dot_q8_rows4(format: Format, rows: [&[u8]; 4], xq: &[u8], xd: &[f32]) -> [f32; 4] {
    assert!(takes_q8(format), "dot_q8 takes Q8_0 and Q4_0 rows, not {}", format.name());
    let blocks = xd.len();
    assert!(
        xq.len() == blocks * 34 && rows.iter().all(|r| r.len() == blocks * format.block_bytes())
    );
    #[cfg(target_arch = "x86_64")]
    {
        use super::x86::{avx2, isa, vnni, Isa};
        // SAFETY: the processor has the instruction set (just checked); the format is Q8_0 or
        // Q4_0, and every row holds as many blocks as the activations (checked above).
        match isa() {
            Some(Isa::Vnni) => return unsafe { vnni::dot_q8_rows4(format, rows, xq, xd) },
            Some(Isa::Avx2) => return unsafe { avx2::dot_q8_rows4(format, rows, xq, xd) },
            None => {}
        }
    }
    rows.map(|r| dot_q8_portable(format, r, xq))
}

/// [`dot_q8`] in plain Rust: the form the vector kernels are checked against.
pub fn dot_q8_portable(format: Format, row: &[u8], xq: &[u8]) -> f32 {
    let mut sum = 0.0f32;
    for (w, x) in row.chunks_exact(format.block_bytes()).zip(xq.chunks_exact(34)) {
        let (dw, dx) = (super::half(w), super::half(x));
        let xs = &x[2..];
        let sumi: i32 = match format {
            Format::Q8_0 => {
                w[2..].iter().zip(xs).map(|(&a, &b)| a as i8 as i32 * b as i8 as i32).sum()
            }
            _ => w[2..]
                .iter()
                .enumerate()
                .map(|(j, &q)| {
                    ((q & 0x0f) as i32 - 8) * xs[j] as i8 as i32
                        + ((q >> 4) as i32 - 8) * xs[j + 16] as i8 as i32
                })
                .sum(),
        };
        sum += sumi as f32 * dw * dx;
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::super::testing::{in_every_form, raw_blocks, values};
    use super::super::{dequantize, quantize};
    use super::*;

    /// The f32 product of the dequantised row, in f64.
    fn exact(format: Format, row: &[u8], x: &[f32]) -> (f64, f64) {
        let w = dequantize(format, row);
        let dot = w.iter().zip(x).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>();
        let abs = w.iter().zip(x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum::<f64>();
        (dot, abs)
    }

    /// The vector quantiser of activations gives the reference's bytes in every form: ties of
    /// the rounding (values that land exactly on k + 1/2), zeros, tiny and huge values, blocks
    /// so tiny that the inverse scale overflows, a block with a NaN or an infinity; and each
    /// block's scale and sum. The rows quantised in parallel give the same.
    #[test]
    fn quantised_rows_are_the_reference_quantisation() {
        let mut x = values(32 * 40, 17);
        // Block 1: the largest magnitude 127, so the inverse scale is 1 and every value is its
        // own rounding: halves round away from zero, and 0.49999997 down.
        for (j, v) in x[32..64].iter_mut().enumerate() {
            *v = [0.5, -0.5, 1.5, -2.5, 126.5, -3.49999, 0.49999997, 2.0][j % 8];
        }
        x[63] = 127.0;
        x[64..96].fill(0.0);
        x[96..128].iter_mut().enumerate().for_each(|(j, v)| *v = 1e-30 * j as f32);
        x[128..160].iter_mut().enumerate().for_each(|(j, v)| *v = -3e38 + 1e37 * j as f32);
        // Blocks 5 and 6: largest magnitudes below 3.7e-37 (127 times the smallest normal),
        // whose scale's inverse is infinite; one with zeros among them, one subnormal.
        x[160..192].iter_mut().enumerate().for_each(|(j, v)| *v = [1e-37, -2e-37, 0.0][j % 3]);
        x[192..224].iter_mut().enumerate().for_each(|(j, v)| *v = -1e-42 * (j % 5) as f32);
        x[250] = f32::NAN;
        x[290] = f32::INFINITY;
        x[330] = f32::NEG_INFINITY;
        let check = |got: &[u8], scale: f32, sum: i32, want: &[u8], at: &str| {
            assert_eq!(got, want, "{at}");
            assert_eq!(scale.to_bits(), super::super::half(want).to_bits(), "{at}");
            let want_sum: i32 = want[2..].iter().map(|&v| v as i8 as i32).sum();
            assert_eq!(sum, want_sum, "{at}");
        };
        in_every_form(|form| {
            for (b, block) in x.chunks_exact(32).enumerate() {
                let want = quantize_activations(block).unwrap();
                let mut got = [0u8; 34];
                let (scale, sum) = quantize_block(block.try_into().unwrap(), &mut got);
                check(&got, scale, sum, &want, &format!("{form}: block {b}"));
            }
        });
        for cols in [32, 64, 160] {
            let q = QuantRows::new(&x, cols);
            for (i, row) in x.chunks(cols).enumerate() {
                let want = quantize_activations(row).unwrap();
                let got = q.row(i);
                for (b, block) in want.chunks(34).enumerate() {
                    let bytes = &got.blocks[34 * b..34 * (b + 1)];
                    check(bytes, got.scales[b], got.sums[b], block, &format!("row {i} block {b}"));
                }
            }
        }
    }

    /// F16 rows: the vector kernel gives the portable code's bits, for one row and token and
    /// in the batched forms (four rows, four tokens), with lengths that end in a partial eight;
    /// and the result is the exact product within f32 rounding.
    #[test]
    fn f16_products_are_the_portable_bits_in_every_form() {
        in_every_form(f16_products_in);
    }

    fn f16_products_in(form: &str) {
        for k in [8, 37, 100, 576] {
            let rows: Vec<Vec<u8>> = (0..4).map(|r| raw_blocks(Format::F16, k, 40 + r)).collect();
            let xs: Vec<Vec<f32>> = (0..4).map(|t| values(k, 50 + t)).collect();
            let rows4 = [&rows[0][..], &rows[1], &rows[2], &rows[3]];
            let xs4 = [&xs[0][..], &xs[1], &xs[2], &xs[3]];
            let by_rows = dot_f16_many(rows4, [xs4[1]]);
            let by_tokens = dot_f16_many([rows4[2]], xs4);
            for r in 0..4 {
                for t in 0..4 {
                    let want = dot_f16_portable(rows4[r], xs4[t]);
                    let got = dot_f16(rows4[r], xs4[t]);
                    assert_eq!(got.to_bits(), want.to_bits(), "{form}: {k} {r} {t}");
                    let (exact, abs) = exact(Format::F16, rows4[r], xs4[t]);
                    let bound = abs * k as f64 * f32::EPSILON as f64;
                    assert!((want as f64 - exact).abs() <= bound, "{k}: {want} vs {exact}");
                }
                assert_eq!(by_rows[r][0].to_bits(), dot_f16_portable(rows4[r], xs4[1]).to_bits());
                assert_eq!(by_tokens[0][r].to_bits(), dot_f16_portable(rows4[2], xs4[r]).to_bits());
            }
        }
    }

    #[test]
    fn the_f32_product_is_the_dequantised_rows_product() {
        for format in Format::ALL {
            let n = 2 * format.block_values();
            let row = raw_blocks(format, 2, 7 + format.ggml_id() as u64);
            let x = values(n, 3);
            let (want, abs) = exact(format, &row, &x);
            // f32 sums of n products: each rounding at most one ulp of the running magnitude.
            let bound = abs * n as f64 * f32::EPSILON as f64;
            let got = dot_f32(format, &row, &x) as f64;
            assert!((got - want).abs() <= bound, "{format:?}: {got} vs {want} (bound {bound})");
        }
    }

    #[test]
    fn the_q8_product_is_within_the_activations_rounding() {
        for format in [Format::Q8_0, Format::Q4_0] {
            let n = 8 * 32;
            let row = quantize(format, &values(n, 11)).unwrap();
            let x = values(n, 5);
            let xq = quantize_activations(&x).unwrap();
            let got = dot_q8(format, &row, &xq) as f64;
            let (want, abs) = exact(format, &row, &x);
            // Quantising x moves each value by at most half its block's step d = max|x| / 127
            // (stored as f16: relative error 2^-11), so the product moves by at most
            // Σ_blocks d/2 · Σ|w| of the block; then f32 rounding of the sums.
            let w = dequantize(format, &row);
            let moved: f64 = x
                .chunks(32)
                .zip(w.chunks(32))
                .map(|(xb, wb)| {
                    let d = xb.iter().fold(0f64, |m, v| m.max(v.abs() as f64)) / 127.0;
                    d * (0.5 + 127.0 * 2f64.powi(-11))
                        * wb.iter().map(|v| v.abs() as f64).sum::<f64>()
                })
                .sum();
            let bound = moved + abs * n as f64 * f32::EPSILON as f64;
            assert!((got - want).abs() <= bound, "{format:?}: {got} vs {want} (bound {bound})");
            // The bound is tight enough to mean something: a tenth of the product's scale.
            assert!(bound < 0.1 * abs, "{format:?}: bound {bound} of {abs}");
        }
    }

    /// In every form, the products of Q8_0 and Q4_0 rows with quantised activations give the
    /// portable sum within f32 rounding, and the regrouped forms (one row with four token rows,
    /// four rows with one token row) give each pair's one-row product, bit for bit.
    #[test]
    fn the_vector_kernel_gives_the_portable_sum() {
        in_every_form(|form| {
            for format in [Format::Q8_0, Format::Q4_0] {
                for blocks in [1, 3, 64] {
                    vector_kernel_case(form, format, blocks);
                }
            }
        });
    }

    fn vector_kernel_case(form: &str, format: Format, blocks: usize) {
        // Every byte pattern in the rows, extreme activations included.
        let rows: Vec<Vec<u8>> =
            (0..4).map(|r| raw_blocks(format, blocks, 40 + blocks as u64 + r)).collect();
        let xs: Vec<Vec<f32>> = (0..4)
            .map(|t| {
                let mut x = values(blocks * 32, 8 + t);
                x[0] = 1e3;
                x
            })
            .collect();
        let xq: Vec<Vec<u8>> = xs.iter().map(|x| quantize_activations(x).unwrap()).collect();
        let xd: Vec<Vec<f32>> =
            xq.iter().map(|q| q.chunks(34).map(super::super::half).collect()).collect();
        let (row, x) = (&rows[0], &xq[0]);
        let portable = dot_q8_portable(format, row, x);
        // Both sum the same exact block products, each scaled once: they differ only by the
        // order of the f32 additions, at most one rounding per block of the sum of the blocks'
        // magnitudes.
        let w = dequantize(format, row);
        let wx = dequantize(Format::Q8_0, x);
        let abs: f32 = w.iter().zip(&wx).map(|(a, b)| (a * b).abs()).sum();
        let bound = 2.0 * blocks as f32 * f32::EPSILON * abs;
        let got = dot_q8(format, row, x);
        let at = format!("{form}: {format:?} {blocks}");
        assert!((got - portable).abs() <= bound, "{at}: {got} vs {portable} (bound {bound})");
        let q4 = [&xq[0][..], &xq[1], &xq[2], &xq[3]];
        let d4 = [&xd[0][..], &xd[1], &xd[2], &xd[3]];
        let by_tokens = dot_q8_x4(format, row, q4, d4);
        let r4 = [&rows[0][..], &rows[1], &rows[2], &rows[3]];
        let by_rows = dot_q8_rows4(format, r4, x, &xd[0]);
        for i in 0..4 {
            let one = dot_q8(format, row, q4[i]);
            assert_eq!(by_tokens[i].to_bits(), one.to_bits(), "{at}: token {i} of four");
            let one = dot_q8(format, r4[i], x);
            assert_eq!(by_rows[i].to_bits(), one.to_bits(), "{at}: row {i} of four");
        }
    }
}
