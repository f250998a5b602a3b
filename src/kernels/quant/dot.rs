//! The activations' side of the products: f32 activations quantised to Q8_0 per row for the
//! regrouped block products ([`super::packed`]), and the F16 rows' own product in f32
//! ([`dot_f16_many`]).

use super::packed::Activations;
use super::Format;
use anyhow::Result;
use rayon::prelude::*;

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
    super::by_isa!(
        // SAFETY: the processor has AVX2, FMA and F16C (`by_isa` found them); every row holds
        // two bytes per value of every token (checked above).
        vnni => unsafe { super::x86::dot_f16_many(rows, xs) },
        avx2 => unsafe { super::x86::dot_f16_many(rows, xs) },
        portable => rows.map(|row| xs.map(|x| dot_f16_portable(row, x))),
    )
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

/// `bytes` (F16 values, two bytes each) as f32 into `out`: eight at a time with F16C.
pub fn f16_to_f32_slice(bytes: &[u8], out: &mut [f32]) {
    assert!(bytes.len() == 2 * out.len());
    super::by_isa!(
        // SAFETY: the processor has F16C (`by_isa` found AVX2, FMA and F16C); the sizes agree
        // (checked above).
        vnni => unsafe { super::x86::f16_to_f32_slice(bytes, out) },
        avx2 => unsafe { super::x86::f16_to_f32_slice(bytes, out) },
        portable => {
            for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = super::half(b);
            }
        },
    )
}

/// Activations quantised to Q8_0, blocks of 32, for [`dot_q8`].
pub fn quantize_activations(x: &[f32]) -> Result<Vec<u8>> {
    super::quantize(Format::Q8_0, x)
}

/// Rows of activations quantised to Q8_0 (the same bytes as [`quantize_activations`] gives
/// each), with what the kernels read beside the blocks: each block's scale as f32 and the sums
/// of its values 0..16 and 16..32, and the scale times the sum of all 32 (an f32 product).
pub struct QuantRows {
    all: Blocks,
    /// Blocks per row.
    per_row: usize,
}

/// Quantised blocks and what the kernels read beside each ([`Activations`]' arrays).
#[derive(Default)]
struct Blocks {
    blocks: Vec<u8>,
    scales: Vec<f32>,
    sums: Vec<[i32; 2]>,
    dsums: Vec<f32>,
    neg32: Vec<[i32; 2]>,
}

impl Blocks {
    /// Blocks `b` as the activations of `tokens` tokens interleaved.
    fn view(&self, b: std::ops::Range<usize>, tokens: usize) -> Activations<'_> {
        Activations {
            blocks: &self.blocks[34 * b.start..34 * b.end],
            scales: &self.scales[b.clone()],
            sums: &self.sums[b.clone()],
            dsums: &self.dsums[b.clone()],
            neg32: &self.neg32[b],
            tokens,
        }
    }
}

impl QuantRows {
    /// `x` as rows of `cols` values, a whole number of blocks of 32; the rows in parallel.
    pub fn new(x: &[f32], cols: usize) -> QuantRows {
        assert!(cols.is_multiple_of(32) && cols > 0 && x.len().is_multiple_of(cols));
        let (per_row, n) = (cols / 32, x.len() / cols);
        let mut blocks = vec![0u8; n * per_row * 34];
        let mut scales = vec![0.0f32; n * per_row];
        let mut sums = vec![[0i32; 2]; n * per_row];
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
        let dsums = scales.iter().zip(&sums).map(|(&d, s)| d * (s[0] + s[1]) as f32).collect();
        let neg32 = sums.iter().map(|s| s.map(|s| -32 * s)).collect();
        QuantRows { all: Blocks { blocks, scales, sums, dsums, neg32 }, per_row }
    }

    /// Row `i`.
    pub fn row(&self, i: usize) -> Activations<'_> {
        self.all.view(i * self.per_row..(i + 1) * self.per_row, 1)
    }

    /// Rows `first..first + count` interleaved for the kernels that take several tokens
    /// ([`Activations`]).
    pub fn interleave(&self, first: usize, count: usize) -> Interleaved {
        let (from, mut to) = (&self.all, Blocks::default());
        for k in 0..self.per_row {
            for i in (first..first + count).map(|t| t * self.per_row + k) {
                to.blocks.extend_from_slice(&from.blocks[34 * i..34 * i + 34]);
                to.scales.push(from.scales[i]);
                to.sums.push(from.sums[i]);
                to.dsums.push(from.dsums[i]);
                to.neg32.push(from.neg32[i]);
            }
        }
        Interleaved { all: to, tokens: count }
    }
}

/// Quantised rows interleaved ([`QuantRows::interleave`]).
pub struct Interleaved {
    all: Blocks,
    tokens: usize,
}

impl Interleaved {
    pub fn view(&self) -> Activations<'_> {
        self.all.view(0..self.all.scales.len(), self.tokens)
    }
}

/// One block of 32 activations into its 34 bytes of Q8_0 (`out`), as [`super::quantize`]
/// makes them; returns the block's scale as f32 (after its f16 rounding) and the sums of its
/// values 0..16 and 16..32. With AVX2 where the processor has it: the same bits.
fn quantize_block(x: &[f32; 32], out: &mut [u8]) -> (f32, [i32; 2]) {
    // SAFETY: the processor has AVX2 (`by_isa` found it); `out` holds 34 bytes (checked
    // inside).
    let done = super::by_isa!(
        vnni => unsafe { super::x86::quantize_block(x, out) },
        avx2 => unsafe { super::x86::quantize_block(x, out) },
        portable => None,
    );
    done.unwrap_or_else(|| quantize_block_portable(x, out))
}

fn quantize_block_portable(x: &[f32; 32], out: &mut [u8]) -> (f32, [i32; 2]) {
    out.copy_from_slice(&super::quantize(Format::Q8_0, x).expect("one whole block"));
    let sum = |h: &[u8]| h.iter().map(|&v| v as i8 as i32).sum();
    (super::half(out), [sum(&out[2..18]), sum(&out[18..])])
}

#[cfg(test)]
mod tests {
    use super::super::dequantize;
    use super::super::testing::{in_every_form, raw_blocks, values};
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
        let check = |got: &[u8], scale: f32, sums: [i32; 2], want: &[u8], at: &str| {
            assert_eq!(got, want, "{at}");
            assert_eq!(scale.to_bits(), super::super::half(want).to_bits(), "{at}");
            let sum = |h: &[u8]| h.iter().map(|&v| v as i8 as i32).sum::<i32>();
            assert_eq!(sums, [sum(&want[2..18]), sum(&want[18..])], "{at}");
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
                    let sum = (got.sums[b][0] + got.sums[b][1]) as f32;
                    assert_eq!(got.dsums[b].to_bits(), (got.scales[b] * sum).to_bits());
                    assert_eq!(got.neg32[b], got.sums[b].map(|s| -32 * s));
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
}
