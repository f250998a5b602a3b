//! The GPUs the CUDA driver reports, or why there are none.

use anyhow::{bail, Result};

/// One GPU as the driver reports it.
#[derive(Debug)]
pub struct Gpu {
    pub ordinal: usize,
    pub name: String,
    pub memory_bytes: usize,
    /// Compute capability (major, minor): (9, 0) for Hopper, the `sm_90` of NVRTC.
    pub capability: (i32, i32),
}

impl Gpu {
    /// The architecture NVRTC compiles for, `sm_XY`.
    pub fn arch(&self) -> String {
        format!("sm_{}{}", self.capability.0, self.capability.1)
    }
}

/// The GPUs the CUDA driver sees; an error that says why where there are none to use.
pub fn gpus() -> Result<Vec<Gpu>> {
    use cudarc::driver::{result, sys};
    // SAFETY: only tries to open the library.
    if !unsafe { sys::is_culib_present() } {
        bail!("no NVIDIA driver: the CUDA driver library (libcuda.so.1) is not on this machine");
    }
    let attr = |dev, a| -> Result<i32> {
        // SAFETY: `dev` is a device the driver returned.
        Ok(unsafe { result::device::get_attribute(dev, a) }?)
    };
    let failed = |e: result::DriverError| anyhow::anyhow!("the CUDA driver failed: {e}");
    result::init().map_err(failed)?;
    // The bindings are CUDA 13's: an older driver lacks some of their functions, whose first
    // call would panic, and cuBLASLt and NVRTC 13 need it too.
    let mut version = 0;
    // SAFETY: writes one int.
    unsafe { sys::cuDriverGetVersion(&mut version) }.result().map_err(failed)?;
    if version < 13000 {
        let (major, minor) = (version / 1000, version % 1000 / 10);
        bail!(
            "the NVIDIA driver supports CUDA {major}.{minor}; the engine needs CUDA 13 (a driver \
             of version 580 or later)"
        );
    }
    let count = result::device::get_count().map_err(failed)?;
    let mut out = Vec::new();
    for ordinal in 0..count {
        let dev = result::device::get(ordinal).map_err(failed)?;
        out.push(Gpu {
            ordinal: ordinal as usize,
            name: result::device::get_name(dev).map_err(failed)?,
            // SAFETY: as above.
            memory_bytes: unsafe { result::device::total_mem(dev) }.map_err(failed)?,
            capability: (
                attr(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(dev, sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            ),
        });
    }
    if out.is_empty() {
        bail!("the CUDA driver is here but reports no GPU");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without the driver, the reason names its library (and nothing panics in cudarc).
    #[test]
    fn no_driver_is_an_error_that_names_its_library() {
        // SAFETY: only tries to open the library.
        if unsafe { cudarc::driver::sys::is_culib_present() } {
            eprintln!(
                "no_driver_is_an_error_that_names_its_library: skipped, a CUDA driver is here"
            );
            return;
        }
        let err = gpus().unwrap_err().to_string();
        assert!(err.contains("libcuda.so.1"), "{err}");
    }
}
