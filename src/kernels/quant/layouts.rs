//! The layouts of the regrouped rows ([`super::packed`]), one per family of formats: where a
//! group block keeps its scales and slices, and how a slice's integer sums become its share
//! of the product, in plain Rust and in vectors. The formats' files choose among them.

use super::half;
use super::packed::{Layout, XBlock, ROWS};
#[cfg(target_arch = "x86_64")]
use super::{lanes, lanes::Lanes, x86};

/// Eight rows' f16 values stored one after another at `at` of `g`, row `r`'s.
fn row_half(g: &[u8], at: usize, r: usize) -> f32 {
    half(&g[at + 2 * r..])
}

/// Nibble plane helpers shared by the layouts (the module's notes give the layout).
pub mod slice {
    use super::ROWS;

    /// Writes eight rows' 32 values of one slice (`q[r]`, each below `1 << bits`) as nibbles
    /// and, for 5 and 6 bits, their high bits, into `out` ([`bytes`] of them).
    pub fn pack(q: &[[u8; 32]; ROWS], bits: u32, out: &mut [u8]) {
        assert!(out.len() == bytes(bits));
        out.fill(0);
        for (r, q) in q.iter().enumerate() {
            for (v, &q) in q.iter().enumerate() {
                let (h, c, j) = (v / 16, v % 16 / 4, v % 4);
                out[32 * c + 4 * r + j] |= (q & 0x0f) << (4 * h);
                match bits {
                    4 => {}
                    5 => out[128 + 4 * r + j] |= ((q >> 4) & 1) << (4 * h + c),
                    6 => out[128 + 32 * h + 4 * r + j] |= ((q >> 4) & 3) << (2 * c),
                    _ => unreachable!("slices hold 4, 5 or 6 bits"),
                }
            }
        }
    }

    /// Row `r`'s 32 values of a slice that [`pack`] wrote.
    pub fn unpack(s: &[u8], bits: u32, r: usize) -> [u8; 32] {
        std::array::from_fn(|v| {
            let (h, c, j) = (v / 16, v % 16 / 4, v % 4);
            let low = (s[32 * c + 4 * r + j] >> (4 * h)) & 0x0f;
            let high = match bits {
                5 => (s[128 + 4 * r + j] >> (4 * h + c)) & 1,
                6 => (s[128 + 32 * h + 4 * r + j] >> (2 * c)) & 3,
                _ => 0,
            };
            low | (high << 4)
        })
    }

    /// Bytes of a slice of eight rows at `bits` per value.
    pub const fn bytes(bits: u32) -> usize {
        128 + 32 * (bits as usize - 4)
    }
}

/// Q8_0: per block the eight rows' f16 scales (16 bytes), then the slice's eight chunks.
pub struct Q8Layout;

impl Layout for Q8Layout {
    const VALUES: usize = 32;
    const GROUP_BLOCK: usize = 16 + 256;

    fn values(g: &[u8], _: usize, r: usize) -> [i32; 32] {
        std::array::from_fn(|v| g[16 + 32 * (v / 4) + 4 * r + v % 4] as i8 as i32)
    }

    fn add(
        g: &[u8],
        _: usize,
        r: usize,
        sums: [i32; 2],
        x: XBlock,
        acc: &mut f32,
        _: &mut [f32; 2],
    ) {
        *acc = ((sums[0] + sums[1]) as f32).mul_add(row_half(g, 0, r) * x.d, *acc);
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn sums<W: Lanes, P: x86::Products, const T: usize>(
        w: W,
        g: *const u8,
        _: usize,
        x: [*const u8; T],
        _neg32: [*const u8; T],
    ) -> [[W::I; 2]; T] {
        // SAFETY: the caller's (a whole group block at `g`, 32 bytes at each of `x`).
        unsafe {
            let mut out = [[w.zero(); 2]; T];
            for c in 0..8 {
                let v = w.load(g.add(16 + 32 * c));
                for t in 0..T {
                    out[t][0] = w.dot_signed::<P>(out[t][0], v, w.bcast4(x[t].add(4 * c)));
                }
            }
            out
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn add_lanes<W: Lanes, const T: usize>(
        w: W,
        g: *const u8,
        _: usize,
        sums: [[W::I; 2]; T],
        x: [XBlock; T],
        acc: &mut [W::F; T],
        _: &mut [[W::F; 2]; T],
    ) {
        // SAFETY: the caller's.
        unsafe {
            let d = w.halves(g);
            for t in 0..T {
                acc[t] = w.fma(w.to_f32(sums[t][0]), w.mul(d, w.splat(x[t].d)), acc[t]);
            }
        }
    }
}

/// The 32-value formats of `BITS` (4 or 5) bits: per block the eight rows' f16 scales `d`,
/// then with `MIN` their f16 minimums `m` (value `q·d + m`), else values offset by
/// `2^(BITS-1)` (value `(q − 2^(BITS-1))·d`); then the slice.
pub struct BlockLayout<const BITS: u32, const MIN: bool>;

impl<const BITS: u32, const MIN: bool> BlockLayout<BITS, MIN> {
    const SLICE_AT: usize = if MIN { 32 } else { 16 };
    const OFFSET: i32 = 1 << (BITS - 1);
}

impl<const BITS: u32, const MIN: bool> Layout for BlockLayout<BITS, MIN> {
    const VALUES: usize = 32;
    const GROUP_BLOCK: usize = Self::SLICE_AT + slice::bytes(BITS);

    fn values(g: &[u8], _: usize, r: usize) -> [i32; 32] {
        slice::unpack(&g[Self::SLICE_AT..], BITS, r).map(|q| q as i32)
    }

    fn add(
        g: &[u8],
        _: usize,
        r: usize,
        sums: [i32; 2],
        x: XBlock,
        acc: &mut f32,
        _: &mut [f32; 2],
    ) {
        let d = row_half(g, 0, r);
        *acc = if MIN {
            let acc = ((sums[0] + sums[1]) as f32).mul_add(d * x.d, *acc);
            x.dsum.mul_add(row_half(g, 16, r), acc)
        } else {
            let xsum = x.sums[0] + x.sums[1];
            ((sums[0] + sums[1] - Self::OFFSET * xsum) as f32).mul_add(d * x.d, *acc)
        };
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn sums<W: Lanes, P: x86::Products, const T: usize>(
        w: W,
        g: *const u8,
        _: usize,
        x: [*const u8; T],
        _neg32: [*const u8; T],
    ) -> [[W::I; 2]; T] {
        // SAFETY: the caller's.
        unsafe { lanes::slice_sums::<W, P, BITS, false, T>(w, g.add(Self::SLICE_AT), x, None) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn add_lanes<W: Lanes, const T: usize>(
        w: W,
        g: *const u8,
        _: usize,
        sums: [[W::I; 2]; T],
        x: [XBlock; T],
        acc: &mut [W::F; T],
        _: &mut [[W::F; 2]; T],
    ) {
        // SAFETY: the caller's.
        unsafe {
            let d = w.halves(g);
            for t in 0..T {
                let s = sums[t][0];
                let dd = w.mul(d, w.splat(x[t].d));
                if MIN {
                    acc[t] = w.fma(w.to_f32(s), dd, acc[t]);
                    acc[t] = w.fma(w.splat(x[t].dsum), w.halves(g.add(16)), acc[t]);
                } else {
                    let xsum = x[t].sums[0] + x[t].sums[1];
                    let s = w.sub_i32(s, w.splat_i32(Self::OFFSET * xsum));
                    acc[t] = w.fma(w.to_f32(s), dd, acc[t]);
                }
            }
        }
    }
}

/// Q4_K and Q5_K (`BITS` 4 or 5): per block of 256 values the eight rows' f16 `d` and `dmin`
/// (32 bytes), the 6-bit scales of the 8 slices (byte `8s + r`, 64 bytes) and their 6-bit
/// minimums (64 bytes); then 8 slices. Value `d·sc · q − dmin·m`.
pub struct KLayout<const BITS: u32>;

impl<const BITS: u32> KLayout<BITS> {
    const HEAD: usize = 32 + 128;
    const SLICE: usize = slice::bytes(BITS);
}

impl<const BITS: u32> Layout for KLayout<BITS> {
    const VALUES: usize = 256;
    const GROUP_BLOCK: usize = Self::HEAD + 8 * Self::SLICE;

    fn values(g: &[u8], s: usize, r: usize) -> [i32; 32] {
        slice::unpack(&g[Self::HEAD + s * Self::SLICE..], BITS, r).map(|q| q as i32)
    }

    // Over a block, `part` holds Σ sc·(sums·dx) and Σ m·dsum; the block's `d` and `dmin`
    // multiply them once at its end rather than once per slice and token.
    fn add(
        g: &[u8],
        s: usize,
        r: usize,
        sums: [i32; 2],
        x: XBlock,
        _: &mut f32,
        part: &mut [f32; 2],
    ) {
        let (sc, m) = (g[32 + 8 * s + r] as f32, g[96 + 8 * s + r] as f32);
        part[0] = (((sums[0] + sums[1]) as f32) * x.d).mul_add(sc, part[0]);
        part[1] = x.dsum.mul_add(m, part[1]);
    }

    fn finish(g: &[u8], r: usize, part: [f32; 2], acc: f32) -> f32 {
        let acc = row_half(g, 0, r).mul_add(part[0], acc);
        (-row_half(g, 16, r)).mul_add(part[1], acc)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn sums<W: Lanes, P: x86::Products, const T: usize>(
        w: W,
        g: *const u8,
        s: usize,
        x: [*const u8; T],
        _neg32: [*const u8; T],
    ) -> [[W::I; 2]; T] {
        // SAFETY: the caller's.
        unsafe {
            lanes::slice_sums::<W, P, BITS, false, T>(
                w,
                g.add(Self::HEAD + s * Self::SLICE),
                x,
                None,
            )
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn add_lanes<W: Lanes, const T: usize>(
        w: W,
        g: *const u8,
        s: usize,
        sums: [[W::I; 2]; T],
        x: [XBlock; T],
        _: &mut [W::F; T],
        part: &mut [[W::F; 2]; T],
    ) {
        // SAFETY: the caller's.
        unsafe {
            let (sc, m) = (w.bytes_u8(g.add(32 + 8 * s)), w.bytes_u8(g.add(96 + 8 * s)));
            for t in 0..T {
                let s = w.to_f32(sums[t][0]);
                part[t][0] = w.fma(w.mul(s, w.splat(x[t].d)), sc, part[t][0]);
                part[t][1] = w.fma(w.splat(x[t].dsum), m, part[t][1]);
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn finish_lanes<W: Lanes, const T: usize>(
        w: W,
        g: *const u8,
        part: [[W::F; 2]; T],
        acc: &mut [W::F; T],
    ) {
        // SAFETY: the caller's.
        unsafe {
            let (d, dmin) = (w.halves(g), w.halves(g.add(16)));
            for t in 0..T {
                acc[t] = w.fma(d, part[t][0], acc[t]);
                acc[t] = w.fnma(dmin, part[t][1], acc[t]);
            }
        }
    }
}

/// Q6_K: per block of 256 values the eight rows' f16 `d` (16 bytes) and the signed 8-bit
/// scales of the 16 half slices (byte `8h + r`, 128 bytes); then 8 slices of 6-bit values.
/// Value `d·sc · (q − 32)`, a scale per 16 values. The products take `q` as it is (unsigned, the
/// cheap form of the integer product) and the 32 comes off through the activations' half sums.
pub struct Q6KLayout;

impl Q6KLayout {
    const HEAD: usize = 16 + 128;
    const SLICE: usize = slice::bytes(6);
}

impl Layout for Q6KLayout {
    const VALUES: usize = 256;
    const GROUP_BLOCK: usize = Self::HEAD + 8 * Self::SLICE;

    fn values(g: &[u8], s: usize, r: usize) -> [i32; 32] {
        slice::unpack(&g[Self::HEAD + s * Self::SLICE..], 6, r).map(|q| q as i32)
    }

    // Over a block, `part[0]` holds Σ dx·(sc₀·sums₀ + sc₁·sums₁) (the 32 off each sum); the
    // block's `d` multiplies it once at its end.
    fn add(
        g: &[u8],
        s: usize,
        r: usize,
        sums: [i32; 2],
        x: XBlock,
        _: &mut f32,
        part: &mut [f32; 2],
    ) {
        let scale = |h: usize| g[16 + 8 * (2 * s + h) + r] as i8 as f32;
        let off = |h: usize| (sums[h] - 32 * x.sums[h]) as f32;
        let both = off(1).mul_add(scale(1), off(0) * scale(0));
        part[0] = both.mul_add(x.d, part[0]);
    }

    fn finish(g: &[u8], r: usize, part: [f32; 2], acc: f32) -> f32 {
        row_half(g, 0, r).mul_add(part[0], acc)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn sums<W: Lanes, P: x86::Products, const T: usize>(
        w: W,
        g: *const u8,
        s: usize,
        x: [*const u8; T],
        neg32: [*const u8; T],
    ) -> [[W::I; 2]; T] {
        let (at, init) = (g.wrapping_add(Self::HEAD + s * Self::SLICE), Some(neg32));
        // SAFETY: the caller's.
        unsafe { lanes::slice_sums::<W, P, 6, true, T>(w, at, x, init) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn add_lanes<W: Lanes, const T: usize>(
        w: W,
        g: *const u8,
        s: usize,
        sums: [[W::I; 2]; T],
        x: [XBlock; T],
        _: &mut [W::F; T],
        part: &mut [[W::F; 2]; T],
    ) {
        // SAFETY: the caller's.
        unsafe {
            let scale = |h: usize| w.bytes_i8(g.add(16 + 8 * (2 * s + h)));
            let (a, b) = (scale(0), scale(1));
            for t in 0..T {
                // The sums started from −32 times the activations' ([`Layout::sums`]).
                let off = |h: usize| w.to_f32(sums[t][h]);
                let both = w.fma(off(1), b, w.mul(off(0), a));
                part[t][0] = w.fma(both, w.splat(x[t].d), part[t][0]);
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn finish_lanes<W: Lanes, const T: usize>(
        w: W,
        g: *const u8,
        part: [[W::F; 2]; T],
        acc: &mut [W::F; T],
    ) {
        // SAFETY: the caller's.
        unsafe {
            let d = w.halves(g);
            for t in 0..T {
                acc[t] = w.fma(d, part[t][0], acc[t]);
            }
        }
    }
}
