//! One GPU: its context and stream, the engine's kernels compiled for its architecture when it
//! opens, the buffers it makes (`buffer.rs`), and kernel launches. In the tests the same device can
//! instead run the kernels on the CPU (`emulator.rs`), so that every host side and kernel is
//! checked without a GPU.

use super::blas::{Blas, Gemm};
use super::buffer::{Arg, Buf, Elem, Mem, Meter};
use super::driver::gpus;
use super::nvrtc::{kernel_images, kernel_names, KERNELS};
use super::profile::{Op, Profiler};
use crate::base::memory::format_bytes;
use anyhow::{anyhow, bail, ensure, Context, Result};
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaStream, DriverError, LaunchConfig};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

/// Cloning shares the device: the same context, stream, kernels and buffers' home.
#[derive(Clone)]
pub struct Device {
    backend: Backend,
    meter: Arc<Meter>,
    profiler: Arc<Profiler>,
    /// `sm_XY`, what the kernels were compiled for.
    pub arch: String,
    /// The GPU's memory in bytes, for the error that says it is full; in the emulator a limit
    /// that the tests may set, none by default.
    capacity: usize,
}

#[derive(Clone)]
enum Backend {
    Cuda {
        /// The context's default stream, which also keeps the context alive.
        stream: Arc<CudaStream>,
        functions: HashMap<&'static str, Kernel>,
        blas: Arc<Blas>,
        /// Streaming multiprocessors.
        sms: usize,
    },
    #[cfg(test)]
    Emulated(Arc<super::emulator::Kernels>),
}

/// Indices on the device, each checked on the host to lie below `below`, so that the kernels
/// that index rows with them stay inside their tables: token ids (below the vocabulary), and
/// positions (below the rotary tables' length, `RopeTables::positions`). The host keeps them
/// too (`host`), from which the embedding's backward groups the tokens by id.
pub struct Ids {
    pub buf: Buf<u32>,
    pub host: Vec<u32>,
    pub below: usize,
}

impl Ids {
    pub fn upload(dev: &Device, ids: &[u32], below: usize) -> Result<Ids> {
        if let Some((i, &t)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= below) {
            bail!("token id {t} at position {i} is out of range for a vocabulary of {below}");
        }
        Ok(Ids { buf: dev.upload(ids)?, host: ids.to_vec(), below })
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// A loaded kernel, with the limits its compiled code puts on a launch.
#[derive(Clone)]
struct Kernel {
    f: CudaFunction,
    /// Bytes of its `__shared__` variables.
    static_shared: u32,
    /// The most threads a block can have, which its registers bound.
    max_threads: u32,
}

impl Kernel {
    fn load(f: CudaFunction) -> Result<Kernel, cudarc::driver::DriverError> {
        let static_shared = f.shared_size_bytes()? as u32;
        let max_threads = f.max_threads_per_block()? as u32;
        Ok(Kernel { f, static_shared, max_threads })
    }

    /// Checks that a block of `threads` threads fits, and lets the kernel have `dynamic`
    /// bytes of dynamic shared memory: beyond 48 KB with its static shared memory, that must
    /// be allowed first.
    fn allow(&self, name: &str, threads: u32, dynamic: u32) -> Result<()> {
        ensure!(
            threads <= self.max_threads,
            "{name}: a block of {threads} threads, more than the {} its registers allow",
            self.max_threads
        );
        if self.static_shared + dynamic > 48 * 1024 {
            let most = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            self.f.set_attribute(most, dynamic as i32).with_context(|| {
                format!("{name}: {} B of shared memory", self.static_shared + dynamic)
            })?;
        }
        Ok(())
    }
}

/// Whether `e` is the driver's report that the GPU's memory is full.
fn out_of_memory(e: &anyhow::Error) -> bool {
    let driver = e.downcast_ref::<DriverError>();
    driver.is_some_and(|d| d.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)
}

/// Kernel `name`, or an error that names it.
fn function<'a>(functions: &'a HashMap<&str, Kernel>, name: &str) -> Result<&'a Kernel> {
    functions.get(name).with_context(|| format!("no kernel {name} in src/gpu/kernels"))
}

/// Makes the device's memory pool keep what is freed for the next allocations. By default it
/// hands freed memory back to the system at every synchronisation, so that each step would
/// map its buffers again. Only speed depends on it: a driver that refuses is left as it is.
fn keep_freed_memory(ctx: &CudaContext) {
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold = u64::MAX;
    // SAFETY: the pool handle is written by the driver before it is used; the attribute takes
    // a u64.
    unsafe {
        if sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result().is_ok() {
            let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
            let value = (&mut threshold as *mut u64).cast();
            let _ = sys::cuMemPoolSetAttribute(pool, attr, value);
        }
    }
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
        // One stream does all the work, in order: cudarc's events that order buffers between
        // streams would only cost time.
        // SAFETY: before any buffer exists, and nothing here uses a second stream.
        unsafe { ctx.disable_event_tracking() };
        keep_freed_memory(&ctx);
        let arch = found[ordinal].arch();
        let images = kernel_images(&arch).with_context(|| format!("GPU {ordinal}"))?;
        let mut functions = HashMap::new();
        for ((file, cubin), &(_, src)) in images.into_iter().zip(KERNELS) {
            let image = cudarc::nvrtc::Ptx::from_binary(cubin);
            let module = ctx.load_module(image).with_context(|| format!("loading {file}"))?;
            for name in kernel_names(src) {
                let f = module.load_function(name).and_then(Kernel::load);
                functions.insert(name, f.with_context(|| format!("{file}: {name}"))?);
            }
        }
        let sms = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        let sms = ctx.attribute(sms).context("asking for the GPU's multiprocessors")?.max(1);
        let stream = ctx.default_stream();
        let blas = Arc::new(Blas::new(&stream)?);
        Ok(Device {
            backend: Backend::Cuda { stream, functions, blas, sms: sms as usize },
            arch,
            meter: Arc::default(),
            profiler: Arc::default(),
            capacity: found[ordinal].memory_bytes,
        })
    }

    /// A device that runs the kernels on the CPU (tests only), or why there is none: where
    /// `g++` is missing the tests pass with a note naming `test`, unless
    /// `ATTNRES_REQUIRE_GPU_EMULATOR` is set (CI sets it).
    #[cfg(test)]
    pub(crate) fn emulated(test: &str) -> Option<Device> {
        match super::emulator::kernels() {
            Ok(kernels) => Some(Device {
                backend: Backend::Emulated(kernels),
                arch: "emulated".to_string(),
                meter: Arc::default(),
                profiler: Arc::default(),
                capacity: usize::MAX,
            }),
            Err(why) if std::env::var_os("ATTNRES_REQUIRE_GPU_EMULATOR").is_none() => {
                eprintln!("{test}: skipped, the kernels cannot run on the CPU here: {why}");
                None
            }
            Err(why) => panic!("{test}: {why}"),
        }
    }

    /// The emulated device, holding at most `bytes` in its buffers, as a GPU of that memory.
    #[cfg(test)]
    pub(crate) fn with_capacity(self, bytes: usize) -> Device {
        Device { capacity: bytes, ..self }
    }

    /// A buffer of `n` values of T that `alloc` makes, counted by the meter; where the GPU
    /// cannot hold them, an error that says so, with what the run held and what to lower.
    fn allocate<T: Elem>(
        &self,
        n: usize,
        alloc: impl FnOnce() -> Result<Mem<T>>,
    ) -> Result<Buf<T>> {
        let bytes = n * size_of::<T>();
        let held = self.meter.now_and_peak().0;
        let full = |held: usize| {
            let size = |b: usize| format_bytes(b as u128);
            anyhow!(
                "the GPU is out of memory: {} more asked for while this run's buffers held {} of \
                 its {}; run fewer tokens at once (train: a smaller micro_batch, which leaves \
                 batch_tokens as it is, or seq_len; bench: --batch or --seq), or recompute \
                 activations (train: recompute=true; bench: --recompute)",
                size(bytes),
                size(held),
                size(self.capacity)
            )
        };
        #[cfg(test)]
        if matches!(self.backend, Backend::Emulated(_)) && held + bytes > self.capacity {
            return Err(full(held));
        }
        match alloc() {
            Ok(mem) => Ok(self.meter.hold(mem)),
            Err(e) if out_of_memory(&e) => Err(full(held)),
            Err(e) => Err(e),
        }
    }

    /// Bytes the device's buffers hold now, and the most they held since the last
    /// [`Self::reset_peak`] (cuBLASLt's workspace and the kernels' code left out).
    pub fn memory(&self) -> (usize, usize) {
        self.meter.now_and_peak()
    }

    /// Starts the peak of [`Self::memory`] again from what is held now.
    pub fn reset_peak(&self) {
        self.meter.reset_peak();
    }

    pub fn upload<T: Elem>(&self, x: &[T]) -> Result<Buf<T>> {
        self.stamp("copy to the device")?;
        self.allocate(x.len(), || match &self.backend {
            Backend::Cuda { stream, .. } => Ok(Mem::Cuda(stream.clone_htod(x)?)),
            #[cfg(test)]
            Backend::Emulated(_) => Ok(Mem::Host(x.to_vec())),
        })
    }

    pub fn zeros<T: Elem>(&self, n: usize) -> Result<Buf<T>> {
        self.stamp("zeros")?;
        self.allocate(n, || match &self.backend {
            Backend::Cuda { stream, .. } => Ok(Mem::Cuda(stream.alloc_zeros(n)?)),
            #[cfg(test)]
            Backend::Emulated(_) => Ok(Mem::Host(vec![T::default(); n])),
        })
    }

    /// `n` values for a kernel or product to write every one of before anything reads them:
    /// not zeroed on a GPU (a pass over memory saved), filled with [`Elem::POISON`] in the
    /// emulator, where a value read before it is written then spreads into the results.
    pub fn output<T: Elem>(&self, n: usize) -> Result<Buf<T>> {
        self.allocate(n, || match &self.backend {
            // SAFETY: the caller writes every value before reading it (the emulator's poison
            // checks that in the tests); until then the memory is never read.
            Backend::Cuda { stream, .. } => Ok(Mem::Cuda(unsafe { stream.alloc(n) }?)),
            #[cfg(test)]
            Backend::Emulated(_) => Ok(Mem::Host(vec![T::POISON; n])),
        })
    }

    /// A copy of `x`.
    pub fn copy<T: Elem>(&self, x: &Buf<T>) -> Result<Buf<T>> {
        self.stamp("copy")?;
        self.allocate(x.len(), || match (&self.backend, &x.mem) {
            (Backend::Cuda { stream, .. }, Mem::Cuda(s)) => Ok(Mem::Cuda(stream.clone_dtod(s)?)),
            #[cfg(test)]
            (Backend::Emulated(_), Mem::Host(v)) => Ok(Mem::Host(v.clone())),
            #[cfg(test)]
            _ => bail!("a buffer used on another device"),
        })
    }

    /// Sets every value of `x` to zero.
    pub fn fill_zeros<T: Elem>(&self, x: &mut Buf<T>) -> Result<()> {
        self.stamp("zeros")?;
        match (&self.backend, &mut x.mem) {
            (Backend::Cuda { stream, .. }, Mem::Cuda(s)) => stream.memset_zeros(s)?,
            #[cfg(test)]
            (Backend::Emulated(_), Mem::Host(v)) => v.fill(T::default()),
            #[cfg(test)]
            _ => bail!("a buffer used on another device"),
        }
        Ok(())
    }

    /// `x` back on the host, once the work queued before it is done.
    pub fn download<T: Elem>(&self, x: &Buf<T>) -> Result<Vec<T>> {
        self.stamp("copy to the host")?;
        match (&self.backend, &x.mem) {
            (Backend::Cuda { stream, .. }, Mem::Cuda(s)) => Ok(stream.clone_dtoh(s)?),
            #[cfg(test)]
            (Backend::Emulated(_), Mem::Host(v)) => Ok(v.clone()),
            #[cfg(test)]
            _ => bail!("a buffer used on another device"),
        }
    }

    /// The stream, on a GPU.
    fn stream(&self) -> Option<&Arc<CudaStream>> {
        match &self.backend {
            Backend::Cuda { stream, .. } => Some(stream),
            #[cfg(test)]
            Backend::Emulated(_) => None,
        }
    }

    /// Stamps the start of operation `what` where a profile is open.
    fn stamp(&self, what: &str) -> Result<()> {
        self.profiler.stamp(|| what.to_string(), 0.0, self.stream())
    }

    /// Starts timing each operation queued from now on ([`Self::profile_close`] says how long
    /// each took), dropping any profile already open.
    pub fn profile_open(&self) {
        self.profiler.open();
    }

    /// The operations since [`Self::profile_open`], the costliest first (waiting for the
    /// work queued): kernels by name, cuBLASLt's products by shape, copies and zeroing.
    pub fn profile_close(&self) -> Result<Vec<Op>> {
        self.profiler.close(self.stream())
    }

    /// Waits for the work queued so far.
    pub fn synchronize(&self) -> Result<()> {
        match &self.backend {
            Backend::Cuda { stream, .. } => Ok(stream.synchronize()?),
            #[cfg(test)]
            Backend::Emulated(_) => Ok(()),
        }
    }

    /// How many blocks of kernel `name` (of `threads` threads and `shared` bytes of dynamic
    /// shared memory) the device runs at once, at least one: the grid of a kernel whose blocks
    /// share out the rows, in one wave. The emulator claims 4, so that its blocks take
    /// several rows each.
    pub fn resident_blocks(&self, name: &str, threads: u32, shared: u32) -> Result<usize> {
        match &self.backend {
            Backend::Cuda { functions, sms, .. } => {
                let k = function(functions, name)?;
                k.allow(name, threads, shared)?;
                let per_sm = k
                    .f
                    .occupancy_max_active_blocks_per_multiprocessor(threads, shared as usize, None)
                    .with_context(|| format!("{name}: occupancy"))?;
                Ok(sms * per_sm.max(1) as usize)
            }
            #[cfg(test)]
            Backend::Emulated(_) => Ok(4),
        }
    }

    /// Queues kernel `name`, one of those the kernel files declare, over `cfg`.
    ///
    /// # Safety
    /// `args` are the kernel's parameters in its order, each of its type, and every buffer
    /// holds what the kernel reads or writes over `cfg`.
    pub unsafe fn launch(&self, name: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<()> {
        let (x, y, z) = cfg.grid_dim;
        if x == 0 || y == 0 || z == 0 {
            // Nothing to compute, which a GPU would refuse to launch.
            return Ok(());
        }
        ensure!(
            y <= 65_535 && z <= 65_535,
            "{name}: a grid of {x} x {y} x {z} blocks (at most 65,535 along y and z)"
        );
        self.stamp(name)?;
        let mut values: Vec<u64> = args.iter().map(|a| a.bits()).collect();
        let mut params: Vec<*mut c_void> =
            values.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
        match &self.backend {
            Backend::Cuda { stream, functions, .. } => {
                let k = function(functions, name)?;
                stream.context().bind_to_thread()?;
                let (bx, by, bz) = cfg.block_dim;
                k.allow(name, bx * by * bz, cfg.shared_mem_bytes)?;
                // SAFETY: the caller's promise; `params` point at the arguments' values,
                // which outlive the call (the driver copies them when it queues the launch).
                unsafe {
                    cudarc::driver::result::launch_kernel(
                        k.f.cu_function(),
                        cfg.grid_dim,
                        cfg.block_dim,
                        cfg.shared_mem_bytes,
                        stream.cu_stream(),
                        &mut params,
                    )
                }
                .with_context(|| format!("launching {name}"))?;
            }
            #[cfg(test)]
            Backend::Emulated(kernels) => {
                // SAFETY: the caller's promise, as above.
                unsafe { kernels.run(name, cfg, &mut params) }?;
            }
        }
        Ok(())
    }

    /// The product `g` of the matrices at `a`, `b` into `c`.
    ///
    /// # Safety
    /// `a`, `b` and `c` hold what `g` spans from them, and `c` overlaps neither.
    pub(super) unsafe fn matmul(&self, g: &Gemm, a: Arg, b: Arg, c: Arg) -> Result<()> {
        let flops = 2.0 * (g.m * g.n * g.k) as f64;
        self.profiler.stamp(|| g.label(), flops, self.stream())?;
        match &self.backend {
            // SAFETY: the caller's promise.
            Backend::Cuda { blas, stream, .. } => {
                // cuBLASLt works in the thread's current context, as kernels launch.
                stream.context().bind_to_thread()?;
                unsafe { blas.matmul(stream, g, a.bits(), b.bits(), c.bits()) }
                    .with_context(|| format!("cuBLASLt failed on {g:?}"))
            }
            // SAFETY: the caller's promise; the emulated device's addresses are host ones.
            #[cfg(test)]
            Backend::Emulated(_) => unsafe {
                super::emulator::host_matmul(g, a.bits(), b.bits(), c.bits())
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes held follow the buffers, and the peak stays until reset.
    #[test]
    fn the_meter_counts_what_buffers_hold() {
        let Some(dev) = Device::emulated("the_meter_counts_what_buffers_hold") else { return };
        let a = dev.zeros::<f32>(1000).unwrap();
        let b = dev.upload(&[1u32, 2, 3]).unwrap();
        assert_eq!(dev.memory(), (4012, 4012));
        let c = dev.copy(&a).unwrap();
        drop((a, b));
        assert_eq!(dev.memory(), (4000, 8012));
        dev.reset_peak();
        drop(c);
        assert_eq!(dev.memory(), (0, 4000));
    }

    /// A buffer the GPU cannot hold is an error that says how much was asked for and held,
    /// and what to lower; nothing is counted for it, and what fits after still does.
    #[test]
    fn a_full_gpu_is_an_error_that_says_what_to_lower() {
        let Some(dev) = Device::emulated("a_full_gpu_is_an_error_that_says_what_to_lower") else {
            return;
        };
        let dev = dev.with_capacity(10_000_000);
        let a = dev.zeros::<f32>(2_000_000).unwrap();
        for e in [
            dev.output::<f32>(1_000_000).err(),
            dev.copy(&a).err(),
            dev.upload(&vec![0u32; 1_000_000]).err(),
        ] {
            let e = format!("{:#}", e.expect("past the GPU's memory"));
            assert!(e.starts_with("the GPU is out of memory: "), "{e}");
            for part in
                ["held 8.0 MB of its 10.0 MB", "smaller micro_batch", "--batch", "recompute"]
            {
                assert!(e.contains(part), "{part} in {e}");
            }
        }
        let e = dev.output::<f32>(1_000_000).err().unwrap().to_string();
        assert!(e.contains(": 4.0 MB more asked for"), "{e}");
        // On a GPU the driver reports it.
        let driver = |code| anyhow::Error::from(DriverError(code));
        assert!(out_of_memory(&driver(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)));
        assert!(!out_of_memory(&driver(sys::CUresult::CUDA_ERROR_INVALID_VALUE)));
        assert_eq!(dev.memory().0, 8_000_000);
        let b = dev.zeros::<f32>(500_000).unwrap();
        assert_eq!(dev.memory().0, 10_000_000);
        drop((a, b));
    }

    /// A grid without blocks launches nothing (a GPU would refuse it); one taller than a GPU
    /// allows is an error that says so, on the emulator as on a GPU.
    #[test]
    fn grids_are_held_to_the_gpu_s_limits() {
        let Some(dev) = Device::emulated("grids_are_held_to_the_gpu_s_limits") else { return };
        let mut x = dev.upload(&[1.0f32, 2.0]).unwrap();
        let args = [x.arg_mut(), Arg::f32(3.0), Arg::i64(2)];
        let grid = |grid_dim| LaunchConfig { grid_dim, block_dim: (32, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: `scale` takes (x, s, n), and `x` holds n values.
        let scale = |g| unsafe { dev.launch("scale", grid(g), &args) };
        scale((0, 1, 1)).unwrap();
        assert_eq!(dev.download(&x).unwrap(), [1.0, 2.0]);
        for tall in [(1, 65_536, 1), (1, 1, 65_536)] {
            let err = scale(tall).unwrap_err().to_string();
            assert!(err.contains("scale") && err.contains("65,535"), "{err}");
        }
        scale((1, 1, 1)).unwrap();
        assert_eq!(dev.download(&x).unwrap(), [3.0, 6.0]);
    }
}
