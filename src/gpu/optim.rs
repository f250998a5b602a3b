//! The optimisers' updates on the GPU (`kernels/adamw.cu`): AdamW as
//! `crate::kernels::adamw::update` computes it, bit for bit.

use super::device::Device;
use super::per_value;
use crate::kernels::adamw::AdamStep;
use anyhow::Result;
use cudarc::driver::{CudaSlice, PushKernelArg};

/// One AdamW step of the parameters `p` with gradients `g`, moments `m` and `v` in place.
pub fn adamw(
    dev: &Device,
    p: &mut CudaSlice<f32>,
    m: &mut CudaSlice<f32>,
    v: &mut CudaSlice<f32>,
    g: &CudaSlice<f32>,
    k: &AdamStep,
) -> Result<()> {
    let n = p.len();
    assert!(m.len() == n && v.len() == n && g.len() == n);
    let n64 = n as i64;
    let mut launch = dev.stream().launch_builder(dev.function("adamw"));
    launch.arg(p).arg(m).arg(v).arg(g).arg(&n64);
    launch.arg(&k.beta1).arg(&k.beta2).arg(&k.bc1).arg(&k.bc2).arg(&k.eps).arg(&k.lr);
    launch.arg(&k.weight_decay);
    let cfg = per_value(n);
    // SAFETY: the kernel's arguments in its order; the four buffers hold `n` values each.
    unsafe { launch.launch(cfg) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::adamw::update;
    use crate::testutil::rand_vec;

    /// Five steps with changing gradients, decay on and off: the CPU's bits every step.
    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored on one (docs/gpu.md)"]
    fn adamw_on_the_gpu_is_the_cpu_update_bit_for_bit() {
        let dev = Device::open(0).unwrap();
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
            adamw(&dev, &mut pd, &mut md, &mut vd, &dev.upload(&g).unwrap(), &k).unwrap();
            for (name, got, want) in [("p", &pd, &p), ("m", &md, &m), ("v", &vd, &v)] {
                let got = dev.download(got).unwrap();
                let same = got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "step {step}: {name} differs from the CPU's bits");
            }
        }
    }
}
