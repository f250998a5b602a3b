//! A run's optimiser state on the GPU, laid out as [`crate::train::optim`] lays it, and its
//! update through the GPU's kernels (`crate::gpu::optim`).

use crate::gpu::buffer::Buf;

use crate::gpu::device::Device;
use crate::gpu::optim::{adamw, muon_apply, muon_momentum, newton_schulz, Weights};
use crate::kernels::adamw::AdamStep;
use crate::train::optim::{OptimConfig, Optimizer, Rule};
use anyhow::Result;
use std::ops::Range;

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

    /// One update of the weights `w` with gradients `grads` scaled by `clip` as each is read
    /// ([`OptimConfig::clip_factor`], 1 where it does not clip) and learning rate `lr`, as
    /// [`Optimizer::clip`] then [`Optimizer::update`].
    pub fn update(
        &mut self,
        dev: &Device,
        mut w: Weights,
        grads: &Buf<f32>,
        clip: f32,
        lr: f64,
    ) -> Result<()> {
        self.step += 1;
        let c = self.config.clone();
        for (range, rule) in self.rules.clone() {
            match rule {
                Rule::Adam { decay } => {
                    let wd = if decay { c.weight_decay } else { 0.0 };
                    let k = AdamStep::at(self.step as i32, c.beta1, c.beta2, c.adam_eps, lr, wd);
                    adamw(dev, range, &mut w, &mut self.m, &mut self.v, grads, clip, &k)?;
                }
                Rule::Muon { rows, cols } => {
                    let mu = c.muon_momentum as f32;
                    let dir =
                        muon_momentum(dev, range.clone(), &mut self.momentum, grads, clip, mu)?;
                    let o = newton_schulz(dev, &dir, rows, cols)?;
                    let scale = 0.2 * (rows.max(cols) as f64).sqrt();
                    let decay = 1.0 - lr * c.weight_decay;
                    muon_apply(dev, range, &mut w, &o, decay, lr * scale)?;
                }
            }
        }
        Ok(())
    }
}
