//! The optimisers on the GPU (`kernels/optim.cu`): AdamW as `crate::kernels::adamw::update`
//! computes it, bit for bit, the per-tensor sums of squares that the gradient norm and its
//! clipping take, and the optimiser state of a run, laid out as `crate::train::optim` lays it.

use super::device::{Arg, Buf, Device};
use super::per_value;
use crate::kernels::adamw::AdamStep;
use crate::model::params::Layout;
use crate::train::optim::{OptimConfig, Optimizer};
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

/// Blocks per tensor of `tensor_squares`.
const SQUARE_BLOCKS: usize = 64;

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
    let starts = dev.upload(&starts)?;
    let mut partial = dev.zeros::<f64>(tensors * SQUARE_BLOCKS)?;
    let cfg = LaunchConfig {
        grid_dim: (SQUARE_BLOCKS as u32, tensors as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the kernel's arguments in its order; every tensor's stretch lies inside `g`
    // (checked), `partial` holds a value per block.
    unsafe { dev.launch("tensor_squares", cfg, &[partial.arg_mut(), g.arg(), starts.arg()]) }?;
    let partial = dev.download(&partial)?;
    Ok(partial.chunks(SQUARE_BLOCKS).map(|c| c.iter().sum()).collect())
}

/// `x *= s`, in f32.
pub fn scale(dev: &Device, x: &mut Buf<f32>, s: f32) -> Result<()> {
    let n = x.len();
    // SAFETY: the kernel's arguments in its order; one thread per value of `x`.
    unsafe { dev.launch("scale", per_value(n), &[x.arg_mut(), Arg::f32(s), Arg::i64(n)]) }
}

/// A run's AdamW state on the GPU: the moments laid out as the parameters, and each tensor's
/// range with whether it decays ([`Optimizer::adam_tensors`]).
pub struct GpuOptimizer {
    pub config: OptimConfig,
    pub step: u64,
    m: Buf<f32>,
    v: Buf<f32>,
    tensors: Vec<(Range<usize>, bool)>,
}

impl GpuOptimizer {
    /// `opt`'s state on `dev`; an error for an optimiser the GPU does not run yet.
    pub fn upload(dev: &Device, opt: &Optimizer) -> Result<GpuOptimizer> {
        Ok(GpuOptimizer {
            config: opt.config.clone(),
            step: opt.step,
            m: dev.upload(&opt.m)?,
            v: dev.upload(&opt.v)?,
            tensors: opt.adam_tensors()?,
        })
    }

    /// The state back into `opt`.
    pub fn download_into(&self, dev: &Device, opt: &mut Optimizer) -> Result<()> {
        opt.m = dev.download(&self.m)?;
        opt.v = dev.download(&self.v)?;
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
        let c = &self.config;
        for (range, decay) in &self.tensors {
            let wd = if *decay { c.weight_decay } else { 0.0 };
            let k = AdamStep::at(self.step as i32, c.beta1, c.beta2, c.adam_eps, lr, wd);
            adamw(dev, range.clone(), params, &mut self.m, &mut self.v, grads, &k)?;
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
}
