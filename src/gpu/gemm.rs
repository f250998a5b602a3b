//! The Linear layers' matrix products on the GPU (cuBLASLt, [`super::blas`]): forward and
//! both backward products, as `crate::kernels::matmul` computes them on the CPU.

use super::act::Act;
use super::blas::DType;
use super::blas::Gemm;
use super::buffer::{Arg, Buf, Slice, SliceMut};
use super::device::Device;
use anyhow::Result;

/// The product `g` of the matrices at `a`, `b` into `c`.
///
/// # Safety
/// `a`, `b` and `c` hold what `g` spans from them, and `c` overlaps neither.
pub unsafe fn gemm(dev: &Device, g: &Gemm, a: Arg, b: Arg, c: Arg) -> Result<()> {
    g.check();
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    // SAFETY: the caller's promise.
    unsafe { dev.matmul(g, a, b, c) }
}

/// Checks that a buffer of `len` values holds the `span` a product reads or writes.
fn holds(len: usize, span: usize, what: &str) {
    assert!(span <= len, "{what}: {span} values past a buffer of {len}");
}

/// `y[rows, d_out] = x[rows, d_in] · wᵀ`, the weight `w[d_out, d_in]` (a tensor of the
/// model's parameters, or of their bf16 copy).
pub fn linear<A: Act>(
    dev: &Device,
    x: &Buf<A>,
    w: Slice<A>,
    rows: usize,
    d_in: usize,
    d_out: usize,
) -> Result<Buf<A>> {
    let mut y = dev.output(rows * d_out)?;
    let g = Gemm::packed(rows, d_out, d_in, false, true).typed(A::TYPE, A::TYPE);
    let (sa, sb, sc) = g.spans();
    holds(x.len(), sa, "linear input");
    holds(w.len(), sb, "linear weight");
    holds(y.len(), sc, "linear output");
    // SAFETY: spans checked; `y` is new.
    unsafe { gemm(dev, &g, x.arg(), w.arg(), y.arg_mut()) }?;
    Ok(y)
}

/// Both backward products of [`linear`]: `dx = dy · w` (added into `dx` with `accumulate_dx`,
/// else written) and `dw += dyᵀ · x`, into the f32 gradients whatever the activations' type.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward<A: Act>(
    dev: &Device,
    dx: &mut Buf<A>,
    dw: &mut SliceMut<f32>,
    dy: &Buf<A>,
    x: &Buf<A>,
    w: Slice<A>,
    rows: usize,
    d_in: usize,
    d_out: usize,
    accumulate_dx: bool,
) -> Result<()> {
    let beta = if accumulate_dx { 1.0 } else { 0.0 };
    let input = Gemm { beta, ..Gemm::packed(rows, d_in, d_out, false, false) };
    let weight = Gemm { beta: 1.0, ..Gemm::packed(d_out, d_in, rows, true, false) };
    let (input, weight) = (input.typed(A::TYPE, A::TYPE), weight.typed(A::TYPE, DType::F32));
    let (sa, sb, sc) = input.spans();
    holds(dy.len(), sa, "linear output gradient");
    holds(w.len(), sb, "linear weight");
    holds(dx.len(), sc, "linear input gradient");
    let (sa, sb, sc) = weight.spans();
    holds(dy.len(), sa, "linear output gradient");
    holds(x.len(), sb, "linear input");
    holds(dw.len(), sc, "linear weight gradient");
    // SAFETY: spans checked; `dx` and `dw` are `&mut` of their own, so overlap no input.
    unsafe {
        gemm(dev, &input, dy.arg(), w.arg(), dx.arg_mut())?;
        gemm(dev, &weight, dy.arg(), x.arg(), dw.arg_mut())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::matmul as cpu;
    use crate::testutil::{assert_close_to_largest, rand_vec};

    /// The Linear products against the CPU's, over shapes that are not multiples of anything.
    fn linear_matches_the_cpu(dev: &Device) {
        for (rows, d_in, d_out) in [(1, 3, 5), (37, 96, 200), (130, 257, 64)] {
            let x = rand_vec(rows * d_in, 1, 1.0);
            // The weight sits inside a larger buffer, as a model's parameters do.
            let w_at = 11;
            let params = rand_vec(w_at + d_in * d_out + 5, 2, 0.5);
            let w = &params[w_at..w_at + d_in * d_out];
            let dy = rand_vec(rows * d_out, 3, 1.0);
            let want_y = cpu::linear(&x, w, rows, d_in, d_out);
            let mut want_dx = rand_vec(rows * d_in, 4, 1.0);
            let mut want_dw = rand_vec(d_in * d_out, 5, 1.0);
            let (dx0, dw0) = (want_dx.clone(), want_dw.clone());
            cpu::linear_backward(&mut want_dx, &mut want_dw, &dy, &x, w, rows, d_in, d_out, true);

            let (xd, pd, dyd) =
                (dev.upload(&x).unwrap(), dev.upload(&params).unwrap(), dev.upload(&dy).unwrap());
            let wr = w_at..w_at + d_in * d_out;
            let y = linear(dev, &xd, pd.slice(wr.clone()), rows, d_in, d_out).unwrap();
            let mut dx = dev.upload(&dx0).unwrap();
            let mut dw_all = vec![7.0f32; params.len()];
            dw_all[w_at..w_at + d_in * d_out].copy_from_slice(&dw0);
            let mut dw = dev.upload(&dw_all).unwrap();
            let (dwr, wv) = (&mut dw.slice_mut(wr.clone()), pd.slice(wr.clone()));
            linear_backward(dev, &mut dx, dwr, &dyd, &xd, wv, rows, d_in, d_out, true).unwrap();
            let at = format!("{rows}x{d_in}->{d_out}");
            let dw = dev.download(&dw).unwrap();
            assert!(
                dw[..w_at].iter().chain(&dw[w_at + d_in * d_out..]).all(|&v| v == 7.0),
                "{at}: the weight gradient wrote outside its range"
            );
            for (name, got, want) in [
                ("y", dev.download(&y).unwrap(), want_y),
                ("dx", dev.download(&dx).unwrap(), want_dx),
                ("dw", dw[w_at..w_at + d_in * d_out].to_vec(), want_dw),
            ] {
                assert_close_to_largest(&got, &want, 1e-5, &format!("{at}: {name}"));
            }
            // Written, not added, without `accumulate_dx`.
            let mut dx = dev.upload(&dx0).unwrap();
            let mut scratch = dev.zeros(d_in * d_out).unwrap();
            let (dwr, wv) = (&mut scratch.all_mut(), pd.slice(wr.clone()));
            linear_backward(dev, &mut dx, dwr, &dyd, &xd, wv, rows, d_in, d_out, false).unwrap();
            let want = cpu::linear(&dy, &transpose(w, d_out, d_in), rows, d_out, d_in);
            assert_close_to_largest(
                &dev.download(&dx).unwrap(),
                &want,
                1e-5,
                &format!("{at}: dx written"),
            );
        }
    }
    crate::gpu::on_cpu_and_gpu!(linear_matches_the_cpu);

    /// `w[r, c]` as `[c, r]`.
    fn transpose(w: &[f32], r: usize, c: usize) -> Vec<f32> {
        (0..c).flat_map(|j| (0..r).map(move |i| w[i * c + j])).collect()
    }
}
