//! One GPU: its context and stream, the engine's kernels compiled for its architecture when it
//! opens, and buffers moved to and from it.

use super::{compile, gpus, kernel_names, KERNELS};
use anyhow::{bail, Context, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream};
use std::collections::HashMap;
use std::sync::Arc;

pub struct Device {
    /// The context's default stream, which also keeps the context alive.
    stream: Arc<CudaStream>,
    /// `sm_XY`, what the kernels were compiled for.
    pub arch: String,
    functions: HashMap<&'static str, CudaFunction>,
}

impl Device {
    /// GPU `ordinal` (0 for the first), with every kernel compiled and loaded; an error that
    /// says why where there is no such GPU or a kernel does not compile.
    pub fn open(ordinal: usize) -> Result<Device> {
        let found = gpus()?;
        if ordinal >= found.len() {
            bail!("GPU {ordinal} asked for, but the driver reports {} GPU(s)", found.len());
        }
        let ctx = CudaContext::new(ordinal).context("opening the GPU")?;
        let arch = found[ordinal].arch();
        let mut functions = HashMap::new();
        for &(file, src) in KERNELS {
            let compiled = compile(file, src, &arch)?;
            let ptx = cudarc::nvrtc::Ptx::from_src(compiled.ptx);
            let module = ctx.load_module(ptx).with_context(|| format!("loading {file}"))?;
            for name in kernel_names(src) {
                let f = module.load_function(name).with_context(|| format!("{file}: {name}"))?;
                functions.insert(name, f);
            }
        }
        let stream = ctx.default_stream();
        Ok(Device { stream, arch, functions })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The kernel `name`, which one of the kernel files declares.
    pub fn function(&self, name: &str) -> &CudaFunction {
        self.functions.get(name).unwrap_or_else(|| panic!("no kernel {name} in src/gpu/kernels"))
    }

    pub fn upload(&self, x: &[f32]) -> Result<CudaSlice<f32>> {
        Ok(self.stream.clone_htod(x)?)
    }

    pub fn zeros(&self, n: usize) -> Result<CudaSlice<f32>> {
        Ok(self.stream.alloc_zeros(n)?)
    }

    /// `x` back on the host, once the work queued before it is done.
    pub fn download(&self, x: &CudaSlice<f32>) -> Result<Vec<f32>> {
        Ok(self.stream.clone_dtoh(x)?)
    }
}
