//! RMSNorm on the GPU (`kernels/rmsnorm.cu`): what `crate::kernels::rmsnorm` computes on the
//! CPU, with the same buffers (`[rows, d]` rows, the per-row `rstd` that backward takes).

use super::act::{kernel, Act};

use super::buffer::{Arg, Buf, Slice, SliceMut};

use super::device::Device;
use super::{per_row, rows_per_block};
use anyhow::Result;
use cudarc::driver::LaunchConfig;

/// Forward: `y` and the per-row `rstd`.
pub fn forward<A: Act>(
    dev: &Device,
    x: &Buf<A>,
    g: Slice<f32>,
    d: usize,
    eps: f32,
) -> Result<(Buf<A>, Buf<f32>)> {
    let rows = x.len() / d;
    assert!(rows * d == x.len() && g.len() == d && d <= i32::MAX as usize);
    let (mut y, mut rstd) = (dev.output(x.len())?, dev.output(rows)?);
    let args = [y.arg_mut(), rstd.arg_mut(), x.arg(), g.arg(), Arg::i32(d as i32), Arg::f32(eps)];
    // SAFETY: the arguments are the kernel's, in its order, and every buffer holds what the
    // kernel reads or writes for `rows` rows of `d` (checked above).
    unsafe { dev.launch(&kernel::<A>("rmsnorm_forward"), per_row(rows, d), &args) }?;
    Ok((y, rstd))
}

/// The sum `h = a + b` and its forward in one pass: `(h, y, rstd)`, the standard residual's
/// next sublayer input (the stream plus a sublayer's output) and what the sublayer takes.
pub fn add_forward<A: Act>(
    dev: &Device,
    a: &Buf<A>,
    b: &Buf<A>,
    g: Slice<f32>,
    d: usize,
    eps: f32,
) -> Result<(Buf<A>, Buf<A>, Buf<f32>)> {
    let rows = a.len() / d;
    assert!(rows * d == a.len() && b.len() == a.len() && g.len() == d && d <= i32::MAX as usize);
    let (mut h, mut y, mut rstd) = (dev.output(a.len())?, dev.output(a.len())?, dev.output(rows)?);
    let args = [
        h.arg_mut(),
        y.arg_mut(),
        rstd.arg_mut(),
        a.arg(),
        b.arg(),
        g.arg(),
        Arg::i32(d as i32),
        Arg::f32(eps),
    ];
    // SAFETY: as in `forward`.
    unsafe { dev.launch(&kernel::<A>("rmsnorm_add_forward"), per_row(rows, d), &args) }?;
    Ok((h, y, rstd))
}

/// Backward: returns `dx`; `dg` accumulates. With `dx_dot_x` (`[rows]`), also each row's
/// `⟨dx, x⟩`, which the depth attention's backward takes (as the CPU kernel's option).
#[allow(clippy::too_many_arguments)]
pub fn backward<A: Act>(
    dev: &Device,
    dg: &mut SliceMut<f32>,
    dy: &Buf<A>,
    x: &Buf<A>,
    g: Slice<f32>,
    rstd: &Buf<f32>,
    d: usize,
    dx_dot_x: Option<&mut Buf<f32>>,
) -> Result<Buf<A>> {
    let mut dx = dev.output(x.len())?;
    backward_into(dev, &mut dx, false, dg, dy, x, g, rstd, d, dx_dot_x)?;
    Ok(dx)
}

/// [`backward`] into `dx`, added to what it holds with `accumulate` (the standard residual's
/// stream gradient takes each sublayer's input gradient so).
#[allow(clippy::too_many_arguments)]
pub fn backward_into<A: Act>(
    dev: &Device,
    dx: &mut Buf<A>,
    accumulate: bool,
    dg: &mut SliceMut<f32>,
    dy: &Buf<A>,
    x: &Buf<A>,
    g: Slice<f32>,
    rstd: &Buf<f32>,
    d: usize,
    dx_dot_x: Option<&mut Buf<f32>>,
) -> Result<()> {
    let rows = rstd.len();
    assert!(x.len() == rows * d && dy.len() == x.len() && g.len() == d && dg.len() == d);
    assert!(dx.len() == x.len() && !(accumulate && dx_dot_x.is_some()), "<dx, x> of a new dx");
    assert!(dx_dot_x.as_ref().is_none_or(|b| b.len() == rows), "one <dx, x> per row");
    let dxx = dx_dot_x.map_or(Arg::null(), |b| b.arg_mut());
    let name = kernel::<A>("rmsnorm_backward");
    let (cfg, blocks, per_block) = rows_per_block(dev, &name, rows, d, 1)?;
    let mut parts = dev.output::<f32>(blocks * d)?;
    let args = [
        dx.arg_mut(),
        dxx,
        parts.arg_mut(),
        dy.arg(),
        x.arg(),
        g.arg(),
        rstd.arg(),
        Arg::i32(rows as i32),
        Arg::i32(d as i32),
        Arg::i32(per_block as i32),
        Arg::i32(accumulate as i32),
    ];
    // SAFETY: as in `forward`; `parts` holds a row of `d` for each block, and shared memory a
    // row of sums.
    unsafe { dev.launch(&name, cfg, &args) }?;
    add_column_sums(dev, dg, parts.all(), d)
}

/// `sums += ` the sum of the rows of `parts` (`[n, d]`), in a fixed order.
pub fn add_column_sums(
    dev: &Device,
    sums: &mut SliceMut<f32>,
    parts: Slice<f32>,
    d: usize,
) -> Result<()> {
    let count = parts.len() / d;
    assert!(sums.len() == d && count * d == parts.len() && count <= i32::MAX as usize);
    let args = [sums.arg_mut(), parts.arg(), Arg::i32(count as i32), Arg::i32(d as i32)];
    let cfg = LaunchConfig {
        grid_dim: (d.div_ceil(32) as u32, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the kernel's arguments in its order; a thread per column and row of 32 of
    // `parts`, inside it, and one per column of `sums`.
    unsafe { dev.launch("column_sums", cfg, &args) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::rmsnorm as cpu;
    use crate::testutil::{assert_close_to_largest, assert_row_dots, rand_vec};

    fn rmsnorm_matches_the_cpu_kernel(dev: &Device) {
        // Several blocks of rows, a last block short of rows, and rows of 16384 values, whose
        // sums take more than 48 KB of shared memory.
        for (rows, d) in [(3, 64), (37, 1000), (5, 4096), (600, 96), (7, 203), (3, 16384)] {
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
            let mut dxx = dev.zeros(rows).unwrap();
            let dx =
                backward(dev, &mut dg.all_mut(), &dyg, &xg, gg.all(), &rstd, d, Some(&mut dxx))
                    .unwrap();
            let at = format!("{rows}x{d}");
            // <dx, x> nearly cancels (dx is almost orthogonal to x), so it is held to the sum
            // of its terms' sizes, taken from the kernel's own dx.
            let (dx_host, dxx) = (dev.download(&dx).unwrap(), dev.download(&dxx).unwrap());
            assert_row_dots(&dxx, &dx_host, &x, d, 1e-6, &format!("{at}: <dx, x>"));
            for (name, got, want) in [
                ("y", dev.download(&y).unwrap(), want_y),
                ("rstd", dev.download(&rstd).unwrap(), want_rstd),
                ("dx", dev.download(&dx).unwrap(), want_dx),
                ("dg", dev.download(&dg).unwrap(), want_dg),
            ] {
                assert_close_to_largest(&got, &want, 1e-5, &format!("{at}: {name}"));
            }
            // Backward added into what a buffer holds.
            let before = rand_vec(rows * d, 5, 1.0);
            let mut into = dev.upload(&before).unwrap();
            let mut dg2 = dev.zeros(d).unwrap();
            let (dgs, gs) = (&mut dg2.all_mut(), gg.all());
            backward_into(dev, &mut into, true, dgs, &dyg, &xg, gs, &rstd, d, None).unwrap();
            let want: Vec<f32> = before.iter().zip(&dx_host).map(|(a, b)| a + b).collect();
            let into = dev.download(&into).unwrap();
            assert_close_to_largest(&into, &want, 1e-6, &format!("{at}: dx added"));
            // The sum of two rows and its norm in one pass: x = a + b.
            let a = rand_vec(rows * d, 4, 2.0);
            let b: Vec<f32> = x.iter().zip(&a).map(|(x, a)| x - a).collect();
            let want_h: Vec<f32> = a.iter().zip(&b).map(|(a, b)| a + b).collect();
            let (want_y, want_rstd) = cpu::forward(&want_h, &g, d, 1e-5);
            let (ag, bg) = (dev.upload(&a).unwrap(), dev.upload(&b).unwrap());
            let (h, y, rstd) = add_forward(dev, &ag, &bg, gg.all(), d, 1e-5).unwrap();
            assert_eq!(dev.download(&h).unwrap(), want_h, "{at}: a + b");
            for (name, got, want) in [
                ("y of a + b", dev.download(&y).unwrap(), want_y),
                ("rstd of a + b", dev.download(&rstd).unwrap(), want_rstd),
            ] {
                assert_close_to_largest(&got, &want, 1e-5, &format!("{at}: {name}"));
            }
        }
    }
    crate::gpu::on_cpu_and_gpu!(rmsnorm_matches_the_cpu_kernel);
}
