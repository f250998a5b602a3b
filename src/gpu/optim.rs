//! The optimisers' operations on the GPU (`kernels/optim.cu`): AdamW as
//! `crate::kernels::adamw::update` computes it, bit for bit, Muon's momentum, Newton–Schulz
//! steps (on cuBLASLt) and update, and the per-tensor sums of squares that the gradient norm
//! and its clipping take. `crate::train::gpu` holds a run's state and applies them.

use super::buffer::{Arg, Bf16, Buf};

use super::device::Device;
use super::per_value;
use crate::kernels::adamw::AdamStep;
use anyhow::Result;
use cudarc::driver::LaunchConfig;
use std::ops::Range;

/// What an update writes: the f32 master weights and, when training in bf16, the bf16 copy
/// the matrix products take, written in the same pass as the master weights.
pub struct Weights<'a> {
    pub master: &'a mut Buf<f32>,
    pub copy: Option<&'a mut Buf<Bf16>>,
}

impl Weights<'_> {
    /// Kernel arguments for the tensor at `range`: its master weights and its copy (a null
    /// pointer where there is none).
    fn args_at(&mut self, range: &Range<usize>) -> [Arg; 2] {
        let len = self.master.len();
        assert!(range.end <= len, "tensor {range:?} of {len} weights");
        let copy = self.copy.as_mut().map_or(Arg::null(), |c| {
            assert_eq!(c.len(), len, "the bf16 copy has the master weights' length");
            c.arg_mut_at(range.start)
        });
        [self.master.arg_mut_at(range.start), copy]
    }
}

/// One AdamW step of the weights at `range` with gradients `g[range]` scaled by `clip` (as
/// `crate::train::optim::Optimizer::clip` scales them; 1 where it does not) and moments
/// `m[range]`, `v[range]`, in place.
#[allow(clippy::too_many_arguments)]
pub fn adamw(
    dev: &Device,
    range: Range<usize>,
    w: &mut Weights,
    m: &mut Buf<f32>,
    v: &mut Buf<f32>,
    g: &Buf<f32>,
    clip: f32,
    k: &AdamStep,
) -> Result<()> {
    let (n, at, len) = (range.len(), range.start, w.master.len());
    assert!(m.len() == len && v.len() == len && g.len() == len);
    let [p, copy] = w.args_at(&range);
    let args = [
        p,
        copy,
        m.arg_mut_at(at),
        v.arg_mut_at(at),
        g.arg_at(at),
        Arg::f32(clip),
        Arg::i64(n),
        Arg::f64(k.beta1),
        Arg::f64(k.beta2),
        Arg::f64(k.bc1),
        Arg::f64(k.bc2),
        Arg::f64(k.eps),
        Arg::f64(k.lr),
        Arg::f64(k.weight_decay),
    ];
    // SAFETY: the kernel's arguments in its order; the buffers hold `range` (checked), the
    // copy where there is one.
    unsafe { dev.launch("adamw", per_value(n), &args) }?;
    Ok(())
}

/// Blocks per tensor of `tensor_squares` for tensors of up to `len` values: enough that each
/// thread sums about 64 values, at most 64.
fn square_blocks(len: usize) -> usize {
    len.div_ceil(256 * 64).clamp(1, 64)
}

/// The sum of squared values of `g` over each of `tensors` (ranges laid end to end, in
/// order), in f64, as `crate::train::optim::tensor_squares` takes them (summed in another
/// order).
pub fn tensor_squares(dev: &Device, tensors: &[Range<usize>], g: &Buf<f32>) -> Result<Vec<f64>> {
    // A tensor's stretch ends where the next begins.
    assert!(tensors.windows(2).all(|w| w[0].end == w[1].start));
    let mut starts: Vec<i64> = tensors.iter().map(|r| r.start as i64).collect();
    starts.push(tensors.last().map_or(0, |r| r.end) as i64);
    assert!(*starts.last().unwrap() as usize <= g.len());
    if tensors.is_empty() {
        return Ok(Vec::new());
    }
    let blocks = square_blocks(tensors.iter().map(|r| r.len()).max().unwrap_or(0));
    let starts = dev.upload(&starts)?;
    let mut partial = dev.zeros::<f64>(tensors.len() * blocks)?;
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, tensors.len() as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the kernel's arguments in its order; every tensor's stretch lies inside `g`
    // (checked), `partial` holds a value per block.
    unsafe { dev.launch("tensor_squares", cfg, &[partial.arg_mut(), g.arg(), starts.arg()]) }?;
    let partial = dev.download(&partial)?;
    Ok(partial.chunks(blocks).map(|c| c.iter().sum()).collect())
}

/// `x *= s`, in f32.
pub fn scale(dev: &Device, x: &mut Buf<f32>, s: f32) -> Result<()> {
    let n = x.len();
    // SAFETY: the kernel's arguments in its order; one thread per value of `x`.
    unsafe { dev.launch("scale", per_value(n), &[x.arg_mut(), Arg::f32(s), Arg::i64(n)]) }
}

/// Muon's Nesterov momentum over the tensor at `range`, from its gradient scaled by `clip`
/// (as [`adamw`]): `momentum = mu·momentum + g`, and the direction `g + mu·momentum` returned.
pub fn muon_momentum(
    dev: &Device,
    range: Range<usize>,
    momentum: &mut Buf<f32>,
    grads: &Buf<f32>,
    clip: f32,
    mu: f32,
) -> Result<Buf<f32>> {
    let (n, at) = (range.len(), range.start);
    assert!(range.end <= momentum.len() && grads.len() == momentum.len());
    let mut dir = dev.zeros::<f32>(n)?;
    let args = [
        momentum.arg_mut_at(at),
        dir.arg_mut(),
        grads.arg_at(at),
        Arg::f32(clip),
        Arg::f32(mu),
        Arg::i64(n),
    ];
    // SAFETY: the kernel's arguments in its order; each holds the tensor's n values (checked).
    unsafe { dev.launch("muon_momentum", per_value(n), &args) }?;
    Ok(dir)
}

/// Muon's update of the weights at `range` by the orthogonalised `o`:
/// `p = p·decay − lr_scale·o`, in f64 as the CPU takes it.
pub fn muon_apply(
    dev: &Device,
    range: Range<usize>,
    w: &mut Weights,
    o: &Buf<f32>,
    decay: f64,
    lr_scale: f64,
) -> Result<()> {
    let n = range.len();
    assert_eq!(o.len(), n);
    let [p, copy] = w.args_at(&range);
    let args = [p, copy, o.arg(), Arg::f64(decay), Arg::f64(lr_scale), Arg::i64(n)];
    // SAFETY: as in `adamw`.
    unsafe { dev.launch("muon_apply", per_value(n), &args) }
}

/// `out = alpha·p + beta·q` over `n` values from the given arguments.
///
/// # Safety
/// Each argument addresses `n` values.
unsafe fn combine(
    dev: &Device,
    out: Arg,
    p: Arg,
    alpha: f32,
    q: Arg,
    beta: f32,
    n: usize,
) -> Result<()> {
    let args = [out, p, Arg::f32(alpha), q, Arg::f32(beta), Arg::i64(n)];
    // SAFETY: the caller's promise.
    unsafe { dev.launch("combine", per_value(n), &args) }
}

/// `x[rows, cols]` transposed.
fn transposed(dev: &Device, x: &Buf<f32>, rows: usize, cols: usize) -> Result<Buf<f32>> {
    assert_eq!(x.len(), rows * cols);
    let mut out = dev.zeros(rows * cols)?;
    let args = [out.arg_mut(), x.arg(), Arg::i32(rows as i32), Arg::i32(cols as i32)];
    // SAFETY: the kernel's arguments in its order; both buffers hold rows·cols values.
    unsafe { dev.launch("transpose", per_value(rows * cols), &args) }?;
    Ok(out)
}

/// `crate::train::optim::newton_schulz` on the GPU: the approximate orthogonalisation of
/// `g[rows, cols]` by five quintic Newton–Schulz steps, on the wide orientation, its products
/// on cuBLASLt.
pub fn newton_schulz(dev: &Device, g: &Buf<f32>, rows: usize, cols: usize) -> Result<Buf<f32>> {
    use super::blas::Gemm;
    use super::gemm::gemm;
    let (a, b, c) = (3.4445f32, -4.7750f32, 2.0315f32);
    let tall = rows > cols;
    let (r, k) = if tall { (cols, rows) } else { (rows, cols) };
    let mut x = if tall { transposed(dev, g, rows, cols)? } else { dev.copy(g)? };
    let whole = 0..r * k;
    let norm = tensor_squares(dev, std::slice::from_ref(&whole), &x)?[0].sqrt() as f32 + 1e-7;
    // SAFETY: the kernel's arguments in its order; `x` holds r·k values.
    unsafe {
        dev.launch("divide", per_value(r * k), &[x.arg_mut(), Arg::f32(norm), Arg::i64(r * k)])
    }?;
    let (mut s, mut s2, mut y) =
        (dev.zeros::<f32>(r * r)?, dev.zeros::<f32>(r * r)?, dev.zeros::<f32>(r * k)?);
    for _ in 0..5 {
        // S = X Xᵀ; P = b S + c S²; X ← a X + P X
        // SAFETY: every operand holds what its product spans (r·k, r·r), and no product
        // writes a buffer it reads; `combine` reads and writes r·r or r·k values.
        unsafe {
            gemm(dev, &Gemm::packed(r, r, k, false, true), x.arg(), x.arg(), s.arg_mut())?;
            gemm(dev, &Gemm::packed(r, r, r, false, false), s.arg(), s.arg(), s2.arg_mut())?;
            combine(dev, s2.arg_mut(), s.arg(), b, s2.arg(), c, r * r)?;
            gemm(dev, &Gemm::packed(r, k, r, false, false), s2.arg(), x.arg(), y.arg_mut())?;
            combine(dev, x.arg_mut(), x.arg(), a, y.arg(), 1.0, r * k)?;
        }
    }
    if tall {
        transposed(dev, &x, cols, rows)
    } else {
        Ok(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::act::Act;
    use crate::kernels::adamw::update;
    use crate::testutil::rand_vec;

    /// Five steps with changing gradients, decay on and off, clipping on and off: the CPU's
    /// bits every step, and the bf16 copy the bf16 rounding of the updated weights.
    fn adamw_is_the_cpu_update_bit_for_bit(dev: &Device) {
        let n = 10_000;
        let (mut p, mut m, mut v) = (rand_vec(n, 1, 1.0), vec![0.0f32; n], vec![0.0f32; n]);
        let (mut pd, mut md, mut vd) =
            (dev.upload(&p).unwrap(), dev.upload(&m).unwrap(), dev.upload(&v).unwrap());
        let mut copy = dev.zeros::<Bf16>(n).unwrap();
        for step in 1..=5 {
            let mut g = rand_vec(n, 10 + step as u64, 0.1 * step as f32);
            let gd = dev.upload(&g).unwrap();
            let wd = if step % 2 == 0 { 0.1 } else { 0.0 };
            let clip = if step % 3 == 0 { 0.37 } else { 1.0 };
            g.iter_mut().for_each(|x| *x *= clip);
            let k = AdamStep::at(step, 0.9, 0.95, 1e-8, 3e-3 / step as f64, wd);
            for i in 0..n {
                update(&mut p[i], &mut m[i], &mut v[i], g[i], &k);
            }
            let mut w = Weights { master: &mut pd, copy: Some(&mut copy) };
            adamw(dev, 0..n, &mut w, &mut md, &mut vd, &gd, clip, &k).unwrap();
            for (name, got, want) in [("p", &pd, &p), ("m", &md, &m), ("v", &vd, &v)] {
                let got = dev.download(got).unwrap();
                let same = got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "step {step}: {name} differs from the CPU's bits");
            }
            let want: Vec<Bf16> = p.iter().map(|&x| Bf16::from_f32(x)).collect();
            assert!(dev.download(&copy).unwrap() == want, "step {step}: the bf16 copy");
        }
    }
    crate::gpu::on_cpu_and_gpu!(adamw_is_the_cpu_update_bit_for_bit);

    /// Newton–Schulz on a wide and a tall matrix against the CPU's (whose products sum in
    /// another order).
    fn newton_schulz_matches_the_cpu(dev: &Device) {
        for (rows, cols) in [(24, 40), (40, 24)] {
            let g = rand_vec(rows * cols, 3, 1.0);
            let want = crate::train::optim::newton_schulz(&g, rows, cols);
            let got = newton_schulz(dev, &dev.upload(&g).unwrap(), rows, cols).unwrap();
            let got = dev.download(&got).unwrap();
            crate::testutil::assert_close_to_largest(&got, &want, 1e-4, &format!("{rows}x{cols}"));
        }
    }
    crate::gpu::on_cpu_and_gpu!(newton_schulz_matches_the_cpu);

    /// Muon's momentum from clipped gradients and its update with the bf16 copy, against the
    /// CPU's arithmetic written out.
    fn muon_steps_are_the_cpu_s(dev: &Device) {
        let n = 3000;
        let (p, buf, g) = (rand_vec(n, 4, 1.0), rand_vec(n, 5, 0.1), rand_vec(n, 6, 0.1));
        let (o, clip, mu, decay, lr_scale) = (rand_vec(n, 7, 1.0), 0.37f32, 0.95f32, 0.999, 0.02);
        let (mut pd, mut bufd) = (dev.upload(&p).unwrap(), dev.upload(&buf).unwrap());
        let dir = muon_momentum(dev, 0..n, &mut bufd, &dev.upload(&g).unwrap(), clip, mu);
        let (dir, bufd) = (dev.download(&dir.unwrap()).unwrap(), dev.download(&bufd).unwrap());
        for i in 0..n {
            let gi = g[i] * clip;
            let b = mu * buf[i] + gi;
            assert_eq!((bufd[i], dir[i]), (b, gi + mu * b), "momentum and direction at {i}");
        }
        let mut copy = dev.zeros::<Bf16>(n).unwrap();
        let mut w = Weights { master: &mut pd, copy: Some(&mut copy) };
        muon_apply(dev, 0..n, &mut w, &dev.upload(&o).unwrap(), decay, lr_scale).unwrap();
        let (got, copy) = (dev.download(&pd).unwrap(), dev.download(&copy).unwrap());
        for i in 0..n {
            let want = (p[i] as f64 * decay - lr_scale * o[i] as f64) as f32;
            assert_eq!((got[i], copy[i]), (want, Bf16::from_f32(want)), "weight {i}");
        }
    }
    crate::gpu::on_cpu_and_gpu!(muon_steps_are_the_cpu_s);
}
