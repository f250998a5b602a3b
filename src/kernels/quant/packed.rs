//! Rows of the block formats regrouped eight at a time for the products: a copy made when a
//! model loads, so that one vector instruction works on eight rows at once.
//!
//! In a file each row's blocks follow one another; a product then spends most of its
//! instructions on one row's block at a time (unpacking, converting its scale, summing the
//! lanes). Regrouped, a 32-byte load holds four values of each of eight rows, which one
//! `vpmaddubsw` (or `vpdpbusd`) multiplies by the same four activations broadcast to every
//! lane: the eight lanes are the eight rows' sums, and no lane ever needs summing across.
//! Where the processor has AVX-512 with VNNI, two neighbouring groups share a 512-bit register
//! ([`super::lanes`]), sixteen rows per instruction.
//!
//! The activations are quantised to Q8_0 (blocks of 32, [`Activations`]) whatever the weights'
//! format, so a matrix whose parts have different formats quantises them once. The weights are
//! read in slices of 32 values, one activation block each. A slice of eight rows holds:
//!
//! - Q8_0: 8 chunks of 32 bytes; chunk `c` holds values `4c..4c+4` of row 0, then of row 1, …;
//! - the others: 4 chunks of 32 bytes of nibbles, the low 4 bits of each value: in chunk `c`
//!   the low nibbles hold values `4c..4c+4` of each row, the high nibbles values
//!   `16+4c..16+4c+4`; then, for 5-bit values, 32 bytes whose bit `p` of byte `4r + j` is
//!   bit 4 of the value in nibble plane `p` (planes 0..4 the chunks' low nibbles, 4..8 their
//!   high nibbles) at row `r`, place `j`; for 6-bit values, 64 bytes: bits `2c, 2c+1` of byte
//!   `32h + 4r + j` are bits 4 and 5 of the value in chunk `c`, half `h` (low, high nibbles).
//!
//! Before the slices, each block of a group holds its eight rows' scales as the file has them
//! (f16 scales, 6-bit K-quant scales, …), [`Layout`] says where; [`super::layouts`] holds one
//! per family of formats. Every product of a row and
//! a token sums each slice's integer products exactly (values 0..16 and 16..32 apart), then
//! adds them into an f32 accumulator with the format's scales in a fixed order of f32
//! operations (the K-quants sum a block's slices times their sub-block scales first, and
//! multiply by the block's `d` and `dmin` once at its end): the same in the portable code and
//! the vector kernels, for one token, four or eight, so a token's result has the same bits
//! whatever form or batch computes it.

#[cfg(target_arch = "x86_64")]
use super::{lanes::Lanes, x86};

/// Rows per group.
pub const ROWS: usize = 8;

/// Activations quantised to Q8_0, with what the kernels read beside the blocks: each block's
/// scale as f32, and its values' sums (for the formats whose values are offset or have a min).
/// The blocks of `tokens` tokens are interleaved, block `k` of token `t` at `k·tokens + t`: so
/// that a kernel reads every token's block `k` from one place.
pub struct Activations<'a> {
    /// Q8_0 blocks, 34 bytes each.
    pub blocks: &'a [u8],
    pub scales: &'a [f32],
    /// The sums of each block's values 0..16 and 16..32.
    pub sums: &'a [[i32; 2]],
    /// Each block's scale times the sum of its values, in f32 (Q8_1's `s`).
    pub dsums: &'a [f32],
    /// The sums times −32: Q6_K's offset, which its vector kernels start their sums from (a
    /// broadcast from memory costs no arithmetic).
    pub neg32: &'a [[i32; 2]],
    /// Tokens interleaved.
    pub tokens: usize,
}

/// One activation block as a slice's product reads it beside its integer sums.
#[derive(Clone, Copy, Default)]
pub struct XBlock {
    /// The block's scale.
    pub d: f32,
    /// The sums of its values 0..16 and 16..32.
    pub sums: [i32; 2],
    /// `d` times the sum of its values.
    pub dsum: f32,
}

impl Activations<'_> {
    /// Checks the arrays' lengths agree; the blocks per token.
    fn check(&self) -> usize {
        let n = self.scales.len();
        assert!(
            self.blocks.len() == n * 34
                && self.sums.len() == n
                && self.dsums.len() == n
                && self.neg32.len() == n
                && self.tokens > 0
                && n.is_multiple_of(self.tokens),
            "activation rows"
        );
        n / self.tokens
    }

    /// Block `k` of token `t`.
    fn block(&self, t: usize, k: usize) -> XBlock {
        let i = k * self.tokens + t;
        XBlock { d: self.scales[i], sums: self.sums[i], dsum: self.dsums[i] }
    }

    /// The 32 values of block `k` of token `t`.
    fn values(&self, t: usize, k: usize) -> &[u8] {
        let i = k * self.tokens + t;
        &self.blocks[34 * i + 2..34 * i + 34]
    }

    /// The start of each array, for the vector kernels' unchecked reads.
    #[cfg(target_arch = "x86_64")]
    fn raw(&self) -> RawActivations {
        RawActivations {
            values: self.blocks.as_ptr().wrapping_add(2),
            scales: self.scales.as_ptr(),
            sums: self.sums.as_ptr(),
            dsums: self.dsums.as_ptr(),
            neg32: self.neg32.as_ptr(),
            stride: self.tokens,
        }
    }
}

/// [`Activations`] as pointers, from a first token on: the vector kernels read them in their
/// innermost loops, where a bounds check per read costs more than the product's arithmetic,
/// and where one pointer per array (not per token) keeps the general registers free.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
pub struct RawActivations {
    /// The first token's block 0's values (past its f16 scale).
    values: *const u8,
    scales: *const f32,
    sums: *const [i32; 2],
    dsums: *const f32,
    neg32: *const [i32; 2],
    /// Tokens interleaved.
    stride: usize,
}

#[cfg(target_arch = "x86_64")]
impl RawActivations {
    /// From token `t` on.
    fn skip(self, t: usize) -> RawActivations {
        RawActivations {
            values: self.values.wrapping_add(34 * t),
            scales: self.scales.wrapping_add(t),
            sums: self.sums.wrapping_add(t),
            dsums: self.dsums.wrapping_add(t),
            neg32: self.neg32.wrapping_add(t),
            stride: self.stride,
        }
    }

    /// Where token `t`'s block `k` is, among the blocks.
    #[inline(always)]
    pub fn at(self, t: usize, k: usize) -> usize {
        k * self.stride + t
    }

    /// The 32 values of the block at `i` ([`RawActivations::at`]).
    ///
    /// # Safety
    /// The block is inside the activations.
    #[inline(always)]
    pub unsafe fn values(self, i: usize) -> *const u8 {
        // SAFETY: the caller's.
        unsafe { self.values.add(34 * i) }
    }

    /// The block at `i`'s sums times −32, two i32.
    ///
    /// # Safety
    /// As [`RawActivations::values`].
    #[inline(always)]
    pub unsafe fn neg32(self, i: usize) -> *const u8 {
        // SAFETY: the caller's.
        unsafe { self.neg32.add(i).cast() }
    }

    /// The scale and sums of the block at `i`.
    ///
    /// # Safety
    /// As [`RawActivations::values`].
    #[inline(always)]
    pub unsafe fn block(self, i: usize) -> XBlock {
        // SAFETY: the caller's.
        unsafe {
            XBlock { d: *self.scales.add(i), sums: *self.sums.add(i), dsum: *self.dsums.add(i) }
        }
    }
}

/// How a format's blocks look regrouped, and how a slice's integer sums become its share of
/// the product. The vector methods must compute what the portable ones do, in the same order.
pub trait Layout: 'static {
    /// Values per block of the file (32 or 256): slices per group block, times 32.
    const VALUES: usize;
    /// Bytes per block of a group of eight rows.
    const GROUP_BLOCK: usize;

    /// Row `r`'s 32 values of slice `s` of group block `g`, as integers to multiply the
    /// activations by.
    fn values(g: &[u8], s: usize, r: usize) -> [i32; 32];

    /// Row `r`'s share of slice `s` added into `acc`, or into `part` (sums a layout keeps over
    /// a block before its scales multiply them, zero at each block's start): `sums` the
    /// integer products of its values 0..16 and 16..32 with the activation block `x`.
    fn add(
        g: &[u8],
        s: usize,
        r: usize,
        sums: [i32; 2],
        x: XBlock,
        acc: &mut f32,
        part: &mut [f32; 2],
    );

    /// The end of a block: what `part` holds for row `r`, added into `acc`.
    fn finish(_g: &[u8], _r: usize, _part: [f32; 2], acc: f32) -> f32 {
        acc
    }

    /// [`Layout::values`] times `T` tokens' activation blocks (32 bytes at each of `x`), the
    /// eight rows in the lanes: the sums of values 0..16 and 16..32, or (where the layout adds
    /// them anyway: one chain of additions fewer) their sum and zero. A layout whose values are
    /// offset by 32 (Q6_K) may start the sums from `neg32` (each token's half sums times −32,
    /// [`Activations::neg32`]), and its [`Layout::add_lanes`] then takes them as they are.
    ///
    /// # Safety
    /// The processor has AVX2 and what `P` needs; `g` points at a whole group block, each `x`
    /// at 32 bytes, each `neg32` at two i32.
    #[cfg(target_arch = "x86_64")]
    unsafe fn sums<W: Lanes, P: x86::Products, const T: usize>(
        w: W,
        g: *const u8,
        s: usize,
        x: [*const u8; T],
        neg32: [*const u8; T],
    ) -> [[W::I; 2]; T];

    /// [`Layout::add`] for the eight rows and `T` tokens.
    ///
    /// # Safety
    /// The processor has AVX2, FMA and F16C; `g` points at a whole group block.
    #[cfg(target_arch = "x86_64")]
    unsafe fn add_lanes<W: Lanes, const T: usize>(
        w: W,
        g: *const u8,
        s: usize,
        sums: [[W::I; 2]; T],
        x: [XBlock; T],
        acc: &mut [W::F; T],
        part: &mut [[W::F; 2]; T],
    );

    /// [`Layout::finish`] for the eight rows and `T` tokens.
    ///
    /// # Safety
    /// As [`Layout::add_lanes`].
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn finish_lanes<W: Lanes, const T: usize>(
        _w: W,
        _g: *const u8,
        _part: [[W::F; 2]; T],
        _acc: &mut [W::F; T],
    ) {
    }
}

/// The product kernels of one layout.
#[derive(Clone, Copy)]
pub struct Kernels {
    /// One token: `y[r]` for each row of the groups in `packed` (eight per group).
    pub dot: fn(packed: &[u8], x: &Activations, y: &mut [f32]),
    /// Four tokens interleaved, outputs one after another in `y`: each the bits
    /// [`Kernels::dot`] gives.
    pub dot4: fn(packed: &[u8], x: &Activations, y: &mut [f32]),
    /// Eight tokens, as [`Kernels::dot4`].
    pub dot8: fn(packed: &[u8], x: &Activations, y: &mut [f32]),
    /// [`Kernels::dot`] in plain Rust, whatever the processor: the tests' reference.
    pub portable: fn(packed: &[u8], x: &Activations, y: &mut [f32]),
}

impl Kernels {
    pub const fn of<L: Layout>() -> Kernels {
        Kernels {
            dot: products::<L, 1>,
            dot4: products::<L, 4>,
            dot8: products::<L, 8>,
            portable: portable::<L, 1>,
        }
    }
}

/// `y[t·width + r] = Σ_j W[r, j] · x_t[j]` for the rows of every group in `packed` and `T`
/// tokens, in the best form the processor has.
fn products<L: Layout, const T: usize>(packed: &[u8], x: &Activations, y: &mut [f32]) {
    let blocks = x.check();
    assert!(x.tokens == T && (blocks * 32).is_multiple_of(L::VALUES));
    let group = blocks * 32 / L::VALUES * L::GROUP_BLOCK;
    assert!(packed.len().is_multiple_of(group) && y.len() == T * packed.len() / group * ROWS);
    super::by_isa!(
        // SAFETY: the processor has the instruction set (`by_isa` chose it); the sizes agree
        // (checked above).
        vnni => unsafe { x86::vnni::products::<L, T>(packed, x.raw(), blocks, y) },
        avx2 => avx2::<L, T>(packed, x, blocks, y),
        portable => portable::<L, T>(packed, x, y),
    )
}

/// The AVX2 kernel, at most four tokens at a time: its sixteen registers hold no more.
#[cfg(target_arch = "x86_64")]
fn avx2<L: Layout, const T: usize>(packed: &[u8], x: &Activations, blocks: usize, y: &mut [f32]) {
    const { assert!(T == 1 || T.is_multiple_of(4), "one token or fours") };
    let width = y.len() / T;
    for (t, y) in (0..T).step_by(4).zip(y.chunks_mut(4 * width)) {
        let x = x.raw().skip(t);
        // SAFETY: `products` chose AVX2 on this processor and checked the sizes.
        unsafe {
            if T == 1 {
                x86::avx2::products::<L, 1>(packed, x, blocks, y)
            } else {
                x86::avx2::products::<L, 4>(packed, x, blocks, y)
            }
        }
    }
}

fn portable<L: Layout, const T: usize>(packed: &[u8], x: &Activations, y: &mut [f32]) {
    let blocks = x.check();
    let slices = L::VALUES / 32;
    let group = blocks / slices * L::GROUP_BLOCK;
    let width = y.len() / T;
    for t in 0..T {
        for (gi, gr) in packed.chunks_exact(group).enumerate() {
            let mut acc = [0.0f32; ROWS];
            for (b, g) in gr.chunks_exact(L::GROUP_BLOCK).enumerate() {
                let mut part = [[0.0f32; 2]; ROWS];
                for s in 0..slices {
                    let k = b * slices + s;
                    let xs = x.values(t, k);
                    for (r, (acc, part)) in acc.iter_mut().zip(&mut part).enumerate() {
                        let w = L::values(g, s, r);
                        let sum = |h: usize| {
                            (16 * h..16 * h + 16).map(|j| w[j] * xs[j] as i8 as i32).sum::<i32>()
                        };
                        L::add(g, s, r, [sum(0), sum(1)], x.block(t, k), acc, part);
                    }
                }
                for (r, (acc, part)) in acc.iter_mut().zip(part).enumerate() {
                    *acc = L::finish(g, r, part, *acc);
                }
            }
            y[t * width + ROWS * gi..][..ROWS].copy_from_slice(&acc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::dot::QuantRows;
    use super::super::matrix::pack;
    use super::super::testing::{in_every_form, raw_blocks, scale_and_min_parts, values};
    use super::super::{dequantize, Format};
    use super::*;

    /// Every regrouped format, in every form the processor has: one token, four and eight at
    /// once give the portable kernel's bits for each token, and the portable kernel gives the
    /// exact product of the file's values with the quantised activations within the f32
    /// rounding of its sums. Row counts that are not whole groups take padding rows.
    #[test]
    fn every_format_multiplies_as_its_values_in_every_form() {
        for format in Format::ALL.into_iter().filter(|f| f.ops().packed.is_some()) {
            for (rows, blocks) in [(8, 1), (13, 2), (24, 3)] {
                let seed = 5 + rows as u64 + format.ggml_id() as u64;
                case(format, rows, blocks, seed);
            }
        }
    }

    /// Tokens per case: one batch of eight, two of four.
    const TOKENS: usize = 8;

    fn case(format: Format, rows: usize, blocks: usize, seed: u64) {
        let how = format.ops().packed.as_ref().unwrap();
        let cols = blocks * format.block_values();
        let bytes = raw_blocks(format, rows * blocks, seed);
        let packed = pack(how, format, &bytes, rows);
        let width = rows.div_ceil(ROWS) * ROWS;
        let mut x = values(TOKENS * cols, seed + 1);
        x[3] = 40.0;
        let xq = QuantRows::new(&x, cols);
        let act: Vec<Activations> = (0..TOKENS).map(|i| xq.row(i)).collect();
        let at = |t: usize| format!("{format:?} {rows}x{cols} token {t}");
        let mut want = vec![vec![0.0f32; width]; TOKENS];
        for (t, w) in want.iter_mut().enumerate() {
            (how.kernels.portable)(&packed, &act[t], w);
        }
        // The exact product with the activations as quantised, in f64; the bound: each slice
        // adds its scaled sums with a few roundings, each within one ulp of the sums'
        // magnitudes, and the accumulator carries them over the row's slices.
        let (scaled, mins) = scale_and_min_parts(format, &bytes);
        let w = dequantize(format, &bytes);
        for (t, a) in act.iter().enumerate() {
            let xd: Vec<f64> = (0..cols)
                .map(|j| {
                    a.blocks[34 * (j / 32) + 2 + j % 32] as i8 as f64 * a.scales[j / 32] as f64
                })
                .collect();
            for r in 0..rows {
                let row = r * cols..(r + 1) * cols;
                let exact: f64 = w[row.clone()].iter().zip(&xd).map(|(&w, x)| w as f64 * x).sum();
                let size: f64 = scaled[row.clone()]
                    .iter()
                    .zip(&mins[row])
                    .zip(&xd)
                    .map(|((&s, &m), x)| (s.abs() + m.abs()) as f64 * x.abs())
                    .sum();
                let bound = (cols / 32 + 4) as f64 * f32::EPSILON as f64 * size;
                let got = want[t][r] as f64;
                assert!((got - exact).abs() <= bound, "{}: row {r}: {got} vs {exact}", at(t));
            }
            assert!(want[t][rows..].iter().all(|&v| v == 0.0), "{}: padding rows", at(t));
        }
        in_every_form(|form| {
            let mut eight = vec![0.0f32; 8 * width];
            (how.kernels.dot8)(&packed, &xq.interleave(0, 8).view(), &mut eight);
            let mut four = vec![0.0f32; 8 * width];
            for (first, y) in [0, 4].into_iter().zip(four.chunks_mut(4 * width)) {
                (how.kernels.dot4)(&packed, &xq.interleave(first, 4).view(), y);
            }
            for t in 0..TOKENS {
                let mut one = vec![0.0f32; width];
                (how.kernels.dot)(&packed, &act[t], &mut one);
                for r in 0..width {
                    let w = want[t][r].to_bits();
                    assert_eq!(one[r].to_bits(), w, "{form}: {}: row {r}", at(t));
                    let at = |many: &[f32], of: &str| {
                        assert_eq!(
                            many[t * width + r].to_bits(),
                            w,
                            "{form}: {} of {of}: row {r}",
                            at(t)
                        );
                    };
                    at(&four, "four");
                    at(&eight, "eight");
                }
            }
        });
    }
}
