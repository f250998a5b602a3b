//! The GPU's elementwise operations (`kernels/swiglu.cu`, `kernels/embedding.cu`): what
//! `crate::kernels::swiglu` and `crate::kernels::embedding` compute on the CPU, with the same
//! buffers.

use super::device::Device;
use super::per_value;
use anyhow::Result;
use cudarc::driver::{CudaSlice, PushKernelArg};

/// SwiGLU forward: `act[rows, F]` from the fused `gu[rows, 2F]`.
pub fn swiglu_forward(dev: &Device, gu: &CudaSlice<f32>, f: usize) -> Result<CudaSlice<f32>> {
    let rows = gu.len() / (2 * f);
    assert!(rows * 2 * f == gu.len() && f <= i32::MAX as usize);
    let (mut act, rows64, f32_) = (dev.zeros(rows * f)?, rows as i64, f as i32);
    let mut launch = dev.stream().launch_builder(dev.function("swiglu_forward"));
    launch.arg(&mut act).arg(gu).arg(&rows64).arg(&f32_);
    // SAFETY: the kernel's arguments in its order; `act` holds rows·F values, `gu` rows·2F.
    unsafe { launch.launch(per_value(rows * f)) }?;
    Ok(act)
}

/// SwiGLU backward: `dgu[rows, 2F]` from `dact[rows, F]`.
pub fn swiglu_backward(
    dev: &Device,
    dact: &CudaSlice<f32>,
    gu: &CudaSlice<f32>,
    f: usize,
) -> Result<CudaSlice<f32>> {
    let rows = gu.len() / (2 * f);
    assert!(rows * 2 * f == gu.len() && dact.len() == rows * f && f <= i32::MAX as usize);
    let (mut dgu, rows64, f32_) = (dev.zeros(gu.len())?, rows as i64, f as i32);
    let mut launch = dev.stream().launch_builder(dev.function("swiglu_backward"));
    launch.arg(&mut dgu).arg(dact).arg(gu).arg(&rows64).arg(&f32_);
    // SAFETY: as in `swiglu_forward`.
    unsafe { launch.launch(per_value(rows * f)) }?;
    Ok(dgu)
}

/// Embedding forward: `out[tokens, d]`, row `t` the table's row `ids[t]`; every id must be
/// below the table's rows (checked on the host, where the ids come from).
pub fn embedding_forward(
    dev: &Device,
    table: &CudaSlice<f32>,
    ids: &[u32],
    d: usize,
) -> Result<CudaSlice<f32>> {
    let vocab = table.len() / d;
    assert!(ids.iter().all(|&i| (i as usize) < vocab) && d <= i32::MAX as usize);
    let ids_dev = dev.stream().clone_htod(ids)?;
    let (mut out, n64, d32) = (dev.zeros(ids.len() * d)?, ids.len() as i64, d as i32);
    let mut launch = dev.stream().launch_builder(dev.function("embedding_forward"));
    launch.arg(&mut out).arg(table).arg(&ids_dev).arg(&n64).arg(&d32);
    // SAFETY: the kernel's arguments in its order; every id indexes a row of `table` (checked).
    unsafe { launch.launch(per_value(ids.len() * d)) }?;
    Ok(out)
}

/// Embedding backward: `dtable[ids[t]] += dout[t]`.
pub fn embedding_backward(
    dev: &Device,
    dtable: &mut CudaSlice<f32>,
    dout: &CudaSlice<f32>,
    ids: &[u32],
    d: usize,
) -> Result<()> {
    let vocab = dtable.len() / d;
    assert!(ids.iter().all(|&i| (i as usize) < vocab) && dout.len() == ids.len() * d);
    let ids_dev = dev.stream().clone_htod(ids)?;
    let (n64, d32) = (ids.len() as i64, d as i32);
    let mut launch = dev.stream().launch_builder(dev.function("embedding_backward"));
    launch.arg(dtable).arg(dout).arg(&ids_dev).arg(&n64).arg(&d32);
    // SAFETY: as in `embedding_forward`.
    unsafe { launch.launch(per_value(ids.len() * d)) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{embedding, swiglu};
    use crate::testutil::{assert_close_to_largest, rand_vec};

    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored on one (docs/gpu.md)"]
    fn swiglu_on_the_gpu_is_the_cpu_kernel() {
        let dev = Device::open(0).unwrap();
        let (rows, f) = (37, 1000);
        let gu = rand_vec(rows * 2 * f, 1, 4.0);
        let dact = rand_vec(rows * f, 2, 1.0);
        let want_act = swiglu::forward(&gu, f);
        let mut want_dgu = vec![0.0f32; gu.len()];
        swiglu::backward(&mut want_dgu, &dact, &gu, f);
        let (gu_d, dact_d) = (dev.upload(&gu).unwrap(), dev.upload(&dact).unwrap());
        let act = dev.download(&swiglu_forward(&dev, &gu_d, f).unwrap()).unwrap();
        let dgu = dev.download(&swiglu_backward(&dev, &dact_d, &gu_d, f).unwrap()).unwrap();
        for (name, got, want) in [("act", act, want_act), ("dgu", dgu, want_dgu)] {
            assert_close_to_largest(&got, &want, 1e-5, name);
        }
    }

    /// Repeated ids included, so that the gradient's atomic sums meet.
    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored on one (docs/gpu.md)"]
    fn embedding_on_the_gpu_is_the_cpu_kernel() {
        let dev = Device::open(0).unwrap();
        let (vocab, d) = (50, 96);
        let ids: Vec<u32> = (0..300u32).map(|t| (t * 7 + t / 3) % vocab as u32).collect();
        let table = rand_vec(vocab * d, 3, 1.0);
        let dout = rand_vec(ids.len() * d, 4, 1.0);
        let mut want_out = vec![0.0f32; ids.len() * d];
        embedding::forward(&mut want_out, &table, &ids, d);
        let mut want_dtable = vec![0.5f32; vocab * d];
        embedding::backward(&mut want_dtable, &dout, &ids, d);
        let (table_d, dout_d) = (dev.upload(&table).unwrap(), dev.upload(&dout).unwrap());
        let out = dev.download(&embedding_forward(&dev, &table_d, &ids, d).unwrap()).unwrap();
        assert_eq!(out, want_out, "a gather is exact");
        let mut dtable = dev.upload(&vec![0.5f32; vocab * d]).unwrap();
        embedding_backward(&dev, &mut dtable, &dout_d, &ids, d).unwrap();
        let dtable = dev.download(&dtable).unwrap();
        assert_close_to_largest(&dtable, &want_dtable, 1e-5, "dtable");
    }
}
