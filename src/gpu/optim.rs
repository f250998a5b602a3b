//! The optimisers' updates on the GPU (`kernels/adamw.cu`): AdamW as
//! `crate::kernels::adamw::update` computes it, bit for bit.

use super::device::{Arg, Buf, Device};
use super::per_value;
use crate::kernels::adamw::AdamStep;
use anyhow::Result;

/// One AdamW step of the parameters `p` with gradients `g`, moments `m` and `v` in place.
pub fn adamw(
    dev: &Device,
    p: &mut Buf<f32>,
    m: &mut Buf<f32>,
    v: &mut Buf<f32>,
    g: &Buf<f32>,
    k: &AdamStep,
) -> Result<()> {
    let n = p.len();
    assert!(m.len() == n && v.len() == n && g.len() == n);
    let args = [
        p.arg_mut(),
        m.arg_mut(),
        v.arg_mut(),
        g.arg(),
        Arg::i64(n),
        Arg::f64(k.beta1),
        Arg::f64(k.beta2),
        Arg::f64(k.bc1),
        Arg::f64(k.bc2),
        Arg::f64(k.eps),
        Arg::f64(k.lr),
        Arg::f64(k.weight_decay),
    ];
    // SAFETY: the kernel's arguments in its order; the four buffers hold `n` values each.
    unsafe { dev.launch("adamw", per_value(n), &args) }?;
    Ok(())
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
            adamw(dev, &mut pd, &mut md, &mut vd, &dev.upload(&g).unwrap(), &k).unwrap();
            for (name, got, want) in [("p", &pd, &p), ("m", &md, &m), ("v", &vd, &v)] {
                let got = dev.download(got).unwrap();
                let same = got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "step {step}: {name} differs from the CPU's bits");
            }
        }
    }
    crate::gpu::on_cpu_and_gpu!(adamw_is_the_cpu_update_bit_for_bit);
}
