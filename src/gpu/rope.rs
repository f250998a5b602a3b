//! Rotary position embedding on the GPU (`kernels/rope.cu`): `crate::kernels::rope::apply`,
//! bit for bit, with the CPU's cos/sin tables uploaded once.

use super::act::{kernel, Act};

use super::buffer::{Arg, Buf};

use super::device::{Device, Ids};
use super::{per_value, ROW_CHUNK};
use crate::kernels::rope::RopeTable;
use anyhow::{bail, Result};

/// A [`RopeTable`]'s cos and sin on the GPU: positions `0..len`.
pub struct RopeTables {
    cos: Buf<f32>,
    sin: Buf<f32>,
    half: usize,
    len: usize,
}

impl RopeTables {
    /// `positions` on the device, each checked to lie inside the tables.
    pub fn positions(&self, dev: &Device, positions: &[u32]) -> Result<Ids> {
        if let Some(&p) = positions.iter().find(|&&p| p as usize >= self.len) {
            bail!("position {p} is past the GPU's rotary tables ({} positions)", self.len);
        }
        Ok(Ids { buf: dev.upload(positions)?, host: positions.to_vec(), below: self.len })
    }

    pub fn upload(dev: &Device, t: &RopeTable) -> Result<RopeTables> {
        Ok(RopeTables {
            cos: dev.upload(&t.cos)?,
            sin: dev.upload(&t.sin)?,
            half: t.half,
            len: t.len,
        })
    }
}

/// Rotates, in place, `n_heads` consecutive heads from column `col0` of each row of `x`
/// (`[rows, width]`), row `r` at `positions[r]` (uploaded once per pass, each checked against
/// the tables' length); `inverse` applies the transpose.
#[allow(clippy::too_many_arguments)]
pub fn apply<A: Act>(
    dev: &Device,
    x: &mut Buf<A>,
    width: usize,
    col0: usize,
    n_heads: usize,
    positions: &Ids,
    t: &RopeTables,
    inverse: bool,
) -> Result<()> {
    let rows = positions.len();
    assert!(x.len() == rows * width && col0 + n_heads * 2 * t.half <= width);
    assert!(width <= i32::MAX as usize);
    assert!(positions.below <= t.len, "positions checked against longer tables than these");
    let sign: f32 = if inverse { -1.0 } else { 1.0 };
    let args = [
        x.arg_mut(),
        t.cos.arg(),
        t.sin.arg(),
        positions.buf.arg(),
        Arg::i64(rows),
        Arg::i32(width as i32),
        Arg::i32(col0 as i32),
        Arg::i32(n_heads as i32),
        Arg::i32(t.half as i32),
        Arg::f32(sign),
    ];
    // SAFETY: the kernel's arguments in its order; every row's position is inside the tables
    // (checked) and every head inside the row.
    unsafe {
        dev.launch(
            &kernel::<A>("rope_apply"),
            per_value(rows * n_heads * t.half.div_ceil(ROW_CHUNK)),
            &args,
        )
    }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::rope::{self as cpu, Positions};
    use crate::testutil::rand_vec;

    /// Query and key heads of a packed `qkv` buffer, forward and inverse, at the CPU's bits;
    /// heads of 20 values rotate halves of 10, a whole chunk and a short one.
    fn rope_is_the_cpu_kernel_bit_for_bit(dev: &Device) {
        for hd in [64, 20] {
            check(dev, hd);
        }
    }

    fn check(dev: &Device, hd: usize) {
        let (heads, kv, seq, rows) = (8, 2, 100, 300);
        let width = (heads + 2 * kv) * hd;
        let table = RopeTable::new(hd, 2048, 10000.0);
        let gpu_table = RopeTables::upload(dev, &table).unwrap();
        let x = rand_vec(rows * width, 5, 2.0);
        let positions: Vec<u32> = (0..rows as u32).map(|r| r % seq as u32).collect();
        let positions = gpu_table.positions(dev, &positions).unwrap();
        for inverse in [false, true] {
            let mut want = x.clone();
            cpu::apply(&mut want, width, 0, heads + kv, Positions::Packed(seq), &table, inverse);
            let mut got = dev.upload(&x).unwrap();
            apply(dev, &mut got, width, 0, heads + kv, &positions, &gpu_table, inverse).unwrap();
            let got = dev.download(&got).unwrap();
            let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "hd {hd}, inverse {inverse}: the GPU's rotation differs from the CPU's");
        }
    }
    crate::gpu::on_cpu_and_gpu!(rope_is_the_cpu_kernel_bit_for_bit);
}
