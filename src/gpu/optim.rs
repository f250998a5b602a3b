//! The optimisers on the GPU (`kernels/optim.cu`): AdamW as `crate::kernels::adamw::update`
//! computes it, bit for bit, Muon with its Newton–Schulz steps on cuBLASLt, the per-tensor sums
//! of squares that the gradient norm and its clipping take, and the optimiser state of a run,
//! laid out as `crate::train::optim` lays it.

use super::device::{Arg, Buf, Device};
use super::per_value;
use crate::kernels::adamw::AdamStep;
use crate::model::params::Layout;
use crate::train::optim::{OptimConfig, Optimizer, Rule};
use anyhow::Result;
use cudarc::driver::LaunchConfig;
use std::ops::Range;

/// One AdamW step of the parameters `p[range]` with gradients `g[range]` and moments
/// `m[range]`, `v[range]`, in place.
pub fn adamw(
    dev: &Device,
    range: Range<usize>,
    p: &mut Buf<f32>,
    m: &mut Buf<f32>,
    v: &mut Buf<f32>,
    g: &Buf<f32>,
    k: &AdamStep,
) -> Result<()> {
    let n = range.len();
    assert!(range.end <= p.len() && m.len() == p.len() && v.len() == p.len() && g.len() == p.len());
    let at = range.start;
    let args = [
        p.arg_mut_at(at),
        m.arg_mut_at(at),
        v.arg_mut_at(at),
        g.arg_at(at),
        Arg::i64(n),
        Arg::f64(k.beta1),
        Arg::f64(k.beta2),
        Arg::f64(k.bc1),
        Arg::f64(k.bc2),
        Arg::f64(k.eps),
        Arg::f64(k.lr),
        Arg::f64(k.weight_decay),
    ];
    // SAFETY: the kernel's arguments in its order; the four buffers hold `range` (checked).
    unsafe { dev.launch("adamw", per_value(n), &args) }?;
    Ok(())
}

/// Blocks per tensor of `tensor_squares` for tensors of up to `len` values: enough that each
/// thread sums about 64 values, at most 64.
fn square_blocks(len: usize) -> usize {
    len.div_ceil(256 * 64).clamp(1, 64)
}

/// Each tensor's sum of squared values of `g` (laid out by `layout`), in f64, as
/// `crate::train::optim::tensor_squares` takes them (summed in another order).
pub fn tensor_squares(dev: &Device, layout: &Layout, g: &Buf<f32>) -> Result<Vec<f64>> {
    let mut starts: Vec<i64> = Vec::with_capacity(layout.specs.len() + 1);
    for s in &layout.specs {
        starts.push(s.range.start as i64);
    }
    let tensors = layout.specs.len();
    // A tensor's stretch ends where the next begins: specs are laid out in order, each after
    // the one before.
    assert!(layout.specs.windows(2).all(|w| w[0].range.end == w[1].range.start));
    starts.push(layout.specs.last().map_or(0, |s| s.range.end) as i64);
    assert!(*starts.last().unwrap() as usize <= g.len());
    if tensors == 0 {
        return Ok(Vec::new());
    }
    let blocks = square_blocks(layout.specs.iter().map(|s| s.range.len()).max().unwrap_or(0));
    let starts = dev.upload(&starts)?;
    let mut partial = dev.zeros::<f64>(tensors * blocks)?;
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, tensors as u32, 1),
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

/// The sum of squares of `x[range]`, in f64.
fn range_squares(dev: &Device, x: &Buf<f32>, range: Range<usize>) -> Result<f64> {
    let blocks = square_blocks(range.len());
    let starts = dev.upload(&[range.start as i64, range.end as i64])?;
    let mut partial = dev.zeros::<f64>(blocks)?;
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    assert!(range.end <= x.len());
    // SAFETY: as in `tensor_squares`.
    unsafe { dev.launch("tensor_squares", cfg, &[partial.arg_mut(), x.arg(), starts.arg()]) }?;
    Ok(dev.download(&partial)?.iter().sum())
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
    use super::gemm::{gemm, Gemm};
    let (a, b, c) = (3.4445f32, -4.7750f32, 2.0315f32);
    let tall = rows > cols;
    let (r, k) = if tall { (cols, rows) } else { (rows, cols) };
    let mut x = if tall { transposed(dev, g, rows, cols)? } else { dev.copy(g)? };
    let norm = range_squares(dev, &x, 0..r * k)?.sqrt() as f32 + 1e-7;
    // SAFETY: the kernel's arguments in its order; `x` holds r·k values.
    unsafe {
        dev.launch("divide", per_value(r * k), &[x.arg_mut(), Arg::f32(norm), Arg::i64(r * k)])
    }?;
    let (mut s, mut s2, mut y) =
        (dev.zeros::<f32>(r * r)?, dev.zeros::<f32>(r * r)?, dev.zeros::<f32>(r * k)?);
    let product = |m, n, kk, bt, lda, ldb, ldc| Gemm {
        m,
        n,
        k: kk,
        a_trans: false,
        b_trans: bt,
        lda,
        ldb,
        ldc,
        alpha: 1.0,
        beta: 0.0,
    };
    for _ in 0..5 {
        // S = X Xᵀ; P = b S + c S²; X ← a X + P X
        // SAFETY: every operand holds what its product spans (r·k, r·r), and no product
        // writes a buffer it reads; `combine` reads and writes r·r or r·k values.
        unsafe {
            gemm(dev, &product(r, r, k, true, k, k, r), x.arg(), x.arg(), s.arg_mut())?;
            gemm(dev, &product(r, r, r, false, r, r, r), s.arg(), s.arg(), s2.arg_mut())?;
            combine(dev, s2.arg_mut(), s.arg(), b, s2.arg(), c, r * r)?;
            gemm(dev, &product(r, k, r, false, r, k, k), s2.arg(), x.arg(), y.arg_mut())?;
            combine(dev, x.arg_mut(), x.arg(), a, y.arg(), 1.0, r * k)?;
        }
    }
    if tall {
        transposed(dev, &x, cols, rows)
    } else {
        Ok(x)
    }
}

/// A run's optimiser state on the GPU: the moments and Muon's momentum laid out as the
/// parameters, and each tensor's rule ([`Optimizer::rules`]).
pub struct GpuOptimizer {
    pub config: OptimConfig,
    pub step: u64,
    m: Buf<f32>,
    v: Buf<f32>,
    momentum: Buf<f32>,
    rules: Vec<(Range<usize>, Rule)>,
}

impl GpuOptimizer {
    /// `opt`'s state on `dev`.
    pub fn upload(dev: &Device, opt: &Optimizer) -> Result<GpuOptimizer> {
        Ok(GpuOptimizer {
            config: opt.config.clone(),
            step: opt.step,
            m: dev.upload(&opt.m)?,
            v: dev.upload(&opt.v)?,
            momentum: dev.upload(&opt.momentum)?,
            rules: opt.rules().to_vec(),
        })
    }

    /// The state back into `opt`.
    pub fn download_into(&self, dev: &Device, opt: &mut Optimizer) -> Result<()> {
        opt.m = dev.download(&self.m)?;
        opt.v = dev.download(&self.v)?;
        opt.momentum = dev.download(&self.momentum)?;
        opt.step = self.step;
        Ok(())
    }

    /// Scales `grads` down to the configured global norm when `norm` exceeds it, as
    /// [`Optimizer::clip`].
    pub fn clip(&self, dev: &Device, grads: &mut Buf<f32>, norm: f64) -> Result<()> {
        let max = self.config.grad_clip;
        if max > 0.0 && norm > max {
            scale(dev, grads, (max / (norm + 1e-12)) as f32)?;
        }
        Ok(())
    }

    /// One update of `params` with learning rate `lr`, as [`Optimizer::update`].
    pub fn update(
        &mut self,
        dev: &Device,
        params: &mut Buf<f32>,
        grads: &Buf<f32>,
        lr: f64,
    ) -> Result<()> {
        self.step += 1;
        let c = self.config.clone();
        for (range, rule) in self.rules.clone() {
            match rule {
                Rule::Adam { decay } => {
                    let wd = if decay { c.weight_decay } else { 0.0 };
                    let k = AdamStep::at(self.step as i32, c.beta1, c.beta2, c.adam_eps, lr, wd);
                    adamw(dev, range, params, &mut self.m, &mut self.v, grads, &k)?;
                }
                Rule::Muon { rows, cols } => {
                    let n = range.len();
                    let mut dir = dev.zeros::<f32>(n)?;
                    let at = range.start;
                    let args = [
                        self.momentum.arg_mut_at(at),
                        dir.arg_mut(),
                        grads.arg_at(at),
                        Arg::f32(c.muon_momentum as f32),
                        Arg::i64(n),
                    ];
                    assert!(range.end <= params.len() && grads.len() == params.len());
                    // SAFETY: the kernel's arguments in its order; each holds the tensor's
                    // n values from `at` (checked).
                    unsafe { dev.launch("muon_momentum", per_value(n), &args) }?;
                    let o = newton_schulz(dev, &dir, rows, cols)?;
                    let scale = 0.2 * (rows.max(cols) as f64).sqrt();
                    let args = [
                        params.arg_mut_at(at),
                        o.arg(),
                        Arg::f64(1.0 - lr * c.weight_decay),
                        Arg::f64(lr * scale),
                        Arg::i64(n),
                    ];
                    // SAFETY: as above.
                    unsafe { dev.launch("muon_apply", per_value(n), &args) }?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::adamw::update;
    use crate::testutil::rand_vec;

    /// Five steps with changing gradients, decay on and off: the CPU's bits every step.
    fn adamw_is_the_cpu_update_bit_for_bit(dev: &Device) {
        let n = 10_000;
        let (mut p, mut m, mut v) = (rand_vec(n, 1, 1.0), vec![0.0f32; n], vec![0.0f32; n]);
        let (mut pd, mut md, mut vd) =
            (dev.upload(&p).unwrap(), dev.upload(&m).unwrap(), dev.upload(&v).unwrap());
        for step in 1..=5 {
            let g = rand_vec(n, 10 + step as u64, 0.1 * step as f32);
            let wd = if step % 2 == 0 { 0.1 } else { 0.0 };
            let k = AdamStep::at(step, 0.9, 0.95, 1e-8, 3e-3 / step as f64, wd);
            for i in 0..n {
                update(&mut p[i], &mut m[i], &mut v[i], g[i], &k);
            }
            adamw(dev, 0..n, &mut pd, &mut md, &mut vd, &dev.upload(&g).unwrap(), &k).unwrap();
            for (name, got, want) in [("p", &pd, &p), ("m", &md, &m), ("v", &vd, &v)] {
                let got = dev.download(got).unwrap();
                let same = got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "step {step}: {name} differs from the CPU's bits");
            }
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
}
