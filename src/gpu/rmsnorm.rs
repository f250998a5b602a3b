//! RMSNorm on the GPU (`kernels/rmsnorm.cu`): what `crate::kernels::rmsnorm` computes on the
//! CPU, with the same buffers (`[rows, d]` rows, the per-row `rstd` that backward takes).

use super::device::{Arg, Buf, Device, Slice, SliceMut};
use super::{per_row, per_value};
use anyhow::Result;

/// Threads per row.
const THREADS: u32 = 256;

/// Forward: `y` and the per-row `rstd`.
pub fn forward(
    dev: &Device,
    x: &Buf<f32>,
    g: Slice<f32>,
    d: usize,
    eps: f32,
) -> Result<(Buf<f32>, Buf<f32>)> {
    let rows = x.len() / d;
    assert!(rows * d == x.len() && g.len() == d && d <= i32::MAX as usize);
    let (mut y, mut rstd) = (dev.zeros(x.len())?, dev.zeros(rows)?);
    let args = [y.arg_mut(), rstd.arg_mut(), x.arg(), g.arg(), Arg::i32(d as i32), Arg::f32(eps)];
    // SAFETY: the arguments are the kernel's, in its order, and every buffer holds what the
    // kernel reads or writes for `rows` rows of `d` (checked above).
    unsafe { dev.launch("rmsnorm_forward", per_row(rows, THREADS), &args) }?;
    Ok((y, rstd))
}

/// Backward: returns `dx`; `dg` accumulates.
pub fn backward(
    dev: &Device,
    dg: &mut SliceMut<f32>,
    dy: &Buf<f32>,
    x: &Buf<f32>,
    g: Slice<f32>,
    rstd: &Buf<f32>,
    d: usize,
) -> Result<Buf<f32>> {
    let rows = rstd.len();
    assert!(x.len() == rows * d && dy.len() == x.len() && g.len() == d && dg.len() == d);
    let mut dx = dev.zeros(x.len())?;
    let args = [dx.arg_mut(), dy.arg(), x.arg(), g.arg(), rstd.arg(), Arg::i32(d as i32)];
    // SAFETY: as in `forward`.
    unsafe { dev.launch("rmsnorm_backward", per_row(rows, THREADS), &args) }?;
    let args =
        [dg.arg_mut(), dy.arg(), x.arg(), rstd.arg(), Arg::i32(rows as i32), Arg::i32(d as i32)];
    // SAFETY: as in `forward`; one thread per column of `dg`.
    unsafe { dev.launch("rmsnorm_backward_gain", per_value(d), &args) }?;
    Ok(dx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::rmsnorm as cpu;
    use crate::testutil::{assert_close_to_largest, rand_vec};

    fn rmsnorm_matches_the_cpu_kernel(dev: &Device) {
        for (rows, d) in [(3, 64), (37, 1000), (5, 4096)] {
            let x = rand_vec(rows * d, 1, 3.0);
            let g: Vec<f32> = rand_vec(d, 2, 0.5).iter().map(|v| 1.0 + v).collect();
            let dy = rand_vec(rows * d, 3, 1.0);
            let (want_y, want_rstd) = cpu::forward(&x, &g, d, 1e-5);
            let mut want_dg = vec![0.25f32; d];
            let want_dx = cpu::backward(&mut want_dg, &dy, &x, &g, &want_rstd, d, None);

            let (xg, gg, dyg) =
                (dev.upload(&x).unwrap(), dev.upload(&g).unwrap(), dev.upload(&dy).unwrap());
            let (y, rstd) = forward(dev, &xg, gg.all(), d, 1e-5).unwrap();
            let mut dg = dev.upload(&vec![0.25f32; d]).unwrap();
            let dx = backward(dev, &mut dg.all_mut(), &dyg, &xg, gg.all(), &rstd, d).unwrap();
            let at = format!("{rows}x{d}");
            for (name, got, want) in [
                ("y", dev.download(&y).unwrap(), want_y),
                ("rstd", dev.download(&rstd).unwrap(), want_rstd),
                ("dx", dev.download(&dx).unwrap(), want_dx),
                ("dg", dev.download(&dg).unwrap(), want_dg),
            ] {
                assert_close_to_largest(&got, &want, 1e-5, &format!("{at}: {name}"));
            }
        }
    }
    crate::gpu::on_cpu_and_gpu!(rmsnorm_matches_the_cpu_kernel);
}
