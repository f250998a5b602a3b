//! One GPU: its context and stream, the engine's kernels compiled for its architecture when it
//! opens, buffers on it, and kernel launches. In the tests the same device can instead run the
//! kernels on the CPU (`emulator.rs`), so that every host side and kernel is checked
//! without a GPU.

use super::blas::{Blas, Gemm};
use super::driver::gpus;
use super::nvrtc::{kernel_images, kernel_names, KERNELS};
use super::profile::Profiler;
use anyhow::{bail, Context, Result};
use cudarc::driver::{
    sys, CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig,
    ValidAsZeroBits,
};
use std::collections::HashMap;
use std::ffi::c_void;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Cloning shares the device: the same context, stream, kernels and buffers' home.
#[derive(Clone)]
pub struct Device {
    backend: Backend,
    meter: Arc<Meter>,
    profiler: Arc<Profiler>,
    /// `sm_XY`, what the kernels were compiled for.
    pub arch: String,
}

#[derive(Clone)]
enum Backend {
    Cuda {
        /// The context's default stream, which also keeps the context alive.
        stream: Arc<CudaStream>,
        functions: HashMap<&'static str, CudaFunction>,
        blas: Arc<Blas>,
        /// Streaming multiprocessors.
        sms: usize,
    },
    #[cfg(test)]
    Emulated(Arc<super::emulator::Kernels>),
}

/// What a buffer may hold.
pub trait Elem: DeviceRepr + ValidAsZeroBits + Copy + Default + Unpin + 'static {
    /// What the emulator fills an [`Device::output`] buffer with, so that a kernel that reads
    /// a value before it is written shows it: NaN, or the most negative integer.
    const POISON: Self;
}
impl Elem for f32 {
    const POISON: f32 = f32::NAN;
}
impl Elem for u32 {
    const POISON: u32 = u32::MAX;
}
impl Elem for i32 {
    const POISON: i32 = i32::MIN;
}
impl Elem for i64 {
    const POISON: i64 = i64::MIN;
}
impl Elem for f64 {
    const POISON: f64 = f64::NAN;
}
impl Elem for Bf16 {
    const POISON: Bf16 = Bf16(0x7fc1);
}

/// A bfloat16 value as the kernels store it (`bf16` in `reduce.cuh`): the upper half of an
/// f32's bits.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

// SAFETY: a plain 16-bit value, passed and stored as the kernels' `bf16` is.
unsafe impl DeviceRepr for Bf16 {}
// SAFETY: all zero bits are bfloat16's +0.
unsafe impl ValidAsZeroBits for Bf16 {}

/// The type of the activations: f32 (the exact mode) or bfloat16 (mixed precision). Kernels
/// that take either are named `NAME` for f32 and `NAME_bf16` for bfloat16.
pub trait Act: Elem {
    /// The kernels' name suffix.
    const SUFFIX: &'static str;
    /// The type cuBLASLt is told.
    const TYPE: super::blas::DType;
    /// The nearest value of this type (for bfloat16: ties to even, as the kernels round).
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    /// `x` as values of this type: `x` itself for f32, a copy rounded to bfloat16.
    fn narrow(dev: &Device, x: Buf<f32>) -> Result<Buf<Self>>;
    /// Keeps `copy` the values of `master` in this type, where they differ: for bfloat16 the
    /// weights the matrix products take (made on first use, then overwritten); nothing for f32,
    /// whose products take the master weights themselves ([`Act::weights`]).
    fn refresh(dev: &Device, copy: &mut Option<Buf<Self>>, master: &Buf<f32>) -> Result<()>;
    /// The values of `master` in this type: `master` for f32, `copy` (kept by
    /// [`Act::refresh`]) for bfloat16.
    fn weights<'a>(master: &'a Buf<f32>, copy: &'a Option<Buf<Self>>) -> &'a Buf<Self>;
    /// `copy` as the bfloat16 buffer it is (for bfloat16), for the kernels that write it.
    fn bf16_copy(copy: &mut Option<Buf<Self>>) -> Option<&mut Buf<Bf16>>;
}

impl Act for f32 {
    const SUFFIX: &'static str = "";
    const TYPE: super::blas::DType = super::blas::DType::F32;
    fn from_f32(x: f32) -> f32 {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn narrow(_: &Device, x: Buf<f32>) -> Result<Buf<f32>> {
        Ok(x)
    }
    fn refresh(_: &Device, _: &mut Option<Buf<f32>>, _: &Buf<f32>) -> Result<()> {
        Ok(())
    }
    fn weights<'a>(master: &'a Buf<f32>, _: &'a Option<Buf<f32>>) -> &'a Buf<f32> {
        master
    }
    fn bf16_copy(_: &mut Option<Buf<f32>>) -> Option<&mut Buf<Bf16>> {
        None
    }
}

impl Act for Bf16 {
    const SUFFIX: &'static str = "_bf16";
    const TYPE: super::blas::DType = super::blas::DType::Bf16;
    fn from_f32(x: f32) -> Bf16 {
        Bf16(half::bf16::from_f32(x).to_bits())
    }
    fn to_f32(self) -> f32 {
        half::bf16::from_bits(self.0).to_f32()
    }
    fn narrow(dev: &Device, x: Buf<f32>) -> Result<Buf<Bf16>> {
        let mut y = dev.output(x.len())?;
        to_bf16(dev, &mut y, &x)?;
        Ok(y)
    }
    fn refresh(dev: &Device, copy: &mut Option<Buf<Bf16>>, master: &Buf<f32>) -> Result<()> {
        if copy.is_none() {
            *copy = Some(dev.output(master.len())?);
        }
        to_bf16(dev, copy.as_mut().expect("made above"), master)
    }
    fn weights<'a>(_: &'a Buf<f32>, copy: &'a Option<Buf<Bf16>>) -> &'a Buf<Bf16> {
        copy.as_ref().expect("the bf16 weights are kept by Act::refresh before use")
    }
    fn bf16_copy(copy: &mut Option<Buf<Bf16>>) -> Option<&mut Buf<Bf16>> {
        copy.as_mut()
    }
}

/// `y = x` rounded to bfloat16 (`to_bf16` in `kernels/convert.cu`).
fn to_bf16(dev: &Device, y: &mut Buf<Bf16>, x: &Buf<f32>) -> Result<()> {
    let n = x.len();
    assert_eq!(y.len(), n);
    let args = [y.arg_mut(), x.arg(), Arg::i64(n)];
    // SAFETY: the kernel's arguments in its order; two buffers of `n` values.
    unsafe { dev.launch("to_bf16", super::per_value(n), &args) }
}

/// The name of kernel `name` for activations of type `A`.
pub fn kernel<A: Act>(name: &str) -> String {
    format!("{name}{}", A::SUFFIX)
}

/// Values in the device's memory (in host memory where the kernels are emulated).
pub struct Buf<T: Elem> {
    mem: Mem<T>,
    /// The device's count of bytes held, which this buffer leaves when dropped.
    meter: Arc<Meter>,
}

impl<T: Elem> Drop for Buf<T> {
    fn drop(&mut self) {
        self.meter.live.fetch_sub(self.len() * size_of::<T>(), Ordering::Relaxed);
    }
}

/// Bytes the buffers of a device hold: now, and the most since the last [`Device::reset_peak`].
#[derive(Default)]
pub struct Meter {
    live: AtomicUsize,
    peak: AtomicUsize,
}

enum Mem<T: Elem> {
    Cuda(CudaSlice<T>),
    #[cfg(test)]
    Host(Vec<T>),
}

/// One kernel argument: a scalar's bits, or the address of a buffer's value. Kernels read as
/// many bytes as their parameter's type holds (little-endian).
#[derive(Clone, Copy, Debug)]
pub struct Arg(u64);

impl Arg {
    pub fn i32(v: i32) -> Arg {
        Arg(v as u32 as u64)
    }
    /// A count or index as the kernels' `long long`.
    pub fn i64(v: usize) -> Arg {
        Arg(v as u64)
    }
    pub fn f32(v: f32) -> Arg {
        Arg(v.to_bits() as u64)
    }
    pub fn f64(v: f64) -> Arg {
        Arg(v.to_bits())
    }
    /// A null pointer, for an optional buffer the kernel checks.
    pub fn null() -> Arg {
        Arg(0)
    }
    /// The value as the kernel reads it: an address, or a scalar's bits.
    pub fn bits(self) -> u64 {
        self.0
    }
}

impl<T: Elem> Buf<T> {
    pub fn len(&self) -> usize {
        match &self.mem {
            Mem::Cuda(s) => s.len(),
            #[cfg(test)]
            Mem::Host(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The buffer as a kernel argument that the kernel reads.
    pub fn arg(&self) -> Arg {
        self.arg_at(0)
    }

    /// The buffer as a kernel argument that the kernel writes.
    pub fn arg_mut(&mut self) -> Arg {
        self.arg_mut_at(0)
    }

    /// Value `at` onward as a kernel argument that the kernel reads.
    pub fn arg_at(&self, at: usize) -> Arg {
        assert!(at <= self.len(), "offset {at} past a buffer of {}", self.len());
        let base = match &self.mem {
            Mem::Cuda(s) => s.device_ptr(s.stream()).0,
            #[cfg(test)]
            Mem::Host(v) => v.as_ptr() as u64,
        };
        Arg(base + (at * size_of::<T>()) as u64)
    }

    /// Value `at` onward as a kernel argument that the kernel writes.
    pub fn arg_mut_at(&mut self, at: usize) -> Arg {
        assert!(at <= self.len(), "offset {at} past a buffer of {}", self.len());
        let base = match &mut self.mem {
            Mem::Cuda(s) => s.device_ptr(s.stream()).0,
            #[cfg(test)]
            Mem::Host(v) => v.as_mut_ptr() as u64,
        };
        Arg(base + (at * size_of::<T>()) as u64)
    }
}

/// Values `at..at + len` of a buffer, which a kernel reads: a tensor of the model's parameters.
#[derive(Clone, Copy)]
pub struct Slice<'a, T: Elem> {
    buf: &'a Buf<T>,
    at: usize,
    len: usize,
}

/// Values of a buffer that a kernel writes: a tensor's gradient.
pub struct SliceMut<'a, T: Elem> {
    buf: &'a mut Buf<T>,
    at: usize,
    len: usize,
}

impl<T: Elem> Buf<T> {
    pub fn slice(&self, r: Range<usize>) -> Slice<'_, T> {
        assert!(
            r.start <= r.end && r.end <= self.len(),
            "{r:?} outside a buffer of {}",
            self.len()
        );
        Slice { buf: self, at: r.start, len: r.len() }
    }

    pub fn slice_mut(&mut self, r: Range<usize>) -> SliceMut<'_, T> {
        assert!(
            r.start <= r.end && r.end <= self.len(),
            "{r:?} outside a buffer of {}",
            self.len()
        );
        SliceMut { buf: self, at: r.start, len: r.len() }
    }

    /// The whole buffer as a slice.
    pub fn all(&self) -> Slice<'_, T> {
        self.slice(0..self.len())
    }

    pub fn all_mut(&mut self) -> SliceMut<'_, T> {
        let n = self.len();
        self.slice_mut(0..n)
    }
}

impl<T: Elem> Slice<'_, T> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn arg(&self) -> Arg {
        self.buf.arg_at(self.at)
    }
}

impl<T: Elem> SliceMut<'_, T> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn arg_mut(&mut self) -> Arg {
        self.buf.arg_mut_at(self.at)
    }
}

/// Indices on the device, each checked on the host to lie below `below`, so that the kernels
/// that index rows with them stay inside their tables: token ids (below the vocabulary), and
/// positions (below the rotary tables' length, `RopeTables::positions`).
pub struct Ids {
    pub buf: Buf<u32>,
    pub below: usize,
}

impl Ids {
    pub fn upload(dev: &Device, ids: &[u32], below: usize) -> Result<Ids> {
        if let Some((i, &t)) = ids.iter().enumerate().find(|(_, &t)| t as usize >= below) {
            bail!("token id {t} at position {i} is out of range for a vocabulary of {below}");
        }
        Ok(Ids { buf: dev.upload(ids)?, below })
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// Kernel `name`, or an error that names it.
fn function<'a>(
    functions: &'a HashMap<&str, CudaFunction>,
    name: &str,
) -> Result<&'a CudaFunction> {
    functions.get(name).with_context(|| format!("no kernel {name} in src/gpu/kernels"))
}

/// Lets kernel `f` have `bytes` of dynamic shared memory: beyond 48 KB it must be allowed
/// first.
fn allow_shared(f: &CudaFunction, name: &str, bytes: u32) -> Result<()> {
    if bytes > 48 * 1024 {
        let most = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        f.set_attribute(most, bytes as i32)
            .with_context(|| format!("{name}: {bytes} B of shared memory"))?;
    }
    Ok(())
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
        let mut functions = HashMap::new();
        for ((file, cubin), &(_, src)) in kernel_images(&arch)?.into_iter().zip(KERNELS) {
            let image = cudarc::nvrtc::Ptx::from_binary(cubin);
            let module = ctx.load_module(image).with_context(|| format!("loading {file}"))?;
            for name in kernel_names(src) {
                let f = module.load_function(name).with_context(|| format!("{file}: {name}"))?;
                functions.insert(name, f);
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
            }),
            Err(why) if std::env::var_os("ATTNRES_REQUIRE_GPU_EMULATOR").is_none() => {
                eprintln!("{test}: skipped, the kernels cannot run on the CPU here: {why}");
                None
            }
            Err(why) => panic!("{test}: {why}"),
        }
    }

    /// A buffer of `mem`, counted in the device's bytes held.
    fn held<T: Elem>(&self, mem: Mem<T>) -> Buf<T> {
        let buf = Buf { mem, meter: self.meter.clone() };
        let live = self.meter.live.fetch_add(buf.len() * size_of::<T>(), Ordering::Relaxed);
        self.meter.peak.fetch_max(live + buf.len() * size_of::<T>(), Ordering::Relaxed);
        buf
    }

    /// Bytes the device's buffers hold now, and the most they held since the last
    /// [`Self::reset_peak`] (cuBLASLt's workspace and the kernels' code left out).
    pub fn memory(&self) -> (usize, usize) {
        (self.meter.live.load(Ordering::Relaxed), self.meter.peak.load(Ordering::Relaxed))
    }

    /// Starts the peak of [`Self::memory`] again from what is held now.
    pub fn reset_peak(&self) {
        self.meter.peak.store(self.meter.live.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    pub fn upload<T: Elem>(&self, x: &[T]) -> Result<Buf<T>> {
        self.stamp("copy to the device")?;
        let mem = match &self.backend {
            Backend::Cuda { stream, .. } => Mem::Cuda(stream.clone_htod(x)?),
            #[cfg(test)]
            Backend::Emulated(_) => Mem::Host(x.to_vec()),
        };
        Ok(self.held(mem))
    }

    pub fn zeros<T: Elem>(&self, n: usize) -> Result<Buf<T>> {
        self.stamp("zeros")?;
        let mem = match &self.backend {
            Backend::Cuda { stream, .. } => Mem::Cuda(stream.alloc_zeros(n)?),
            #[cfg(test)]
            Backend::Emulated(_) => Mem::Host(vec![T::default(); n]),
        };
        Ok(self.held(mem))
    }

    /// `n` values for a kernel or product to write every one of before anything reads them:
    /// not zeroed on a GPU (a pass over memory saved), filled with [`Elem::POISON`] in the
    /// emulator, where a value read before it is written then spreads into the results.
    pub fn output<T: Elem>(&self, n: usize) -> Result<Buf<T>> {
        let mem = match &self.backend {
            // SAFETY: the caller writes every value before reading it (the emulator's poison
            // checks that in the tests); until then the memory is never read.
            Backend::Cuda { stream, .. } => Mem::Cuda(unsafe { stream.alloc(n) }?),
            #[cfg(test)]
            Backend::Emulated(_) => Mem::Host(vec![T::POISON; n]),
        };
        Ok(self.held(mem))
    }

    /// A copy of `x`.
    pub fn copy<T: Elem>(&self, x: &Buf<T>) -> Result<Buf<T>> {
        self.stamp("copy")?;
        let mem = match (&self.backend, &x.mem) {
            (Backend::Cuda { stream, .. }, Mem::Cuda(s)) => Mem::Cuda(stream.clone_dtod(s)?),
            #[cfg(test)]
            (Backend::Emulated(_), Mem::Host(v)) => Mem::Host(v.clone()),
            #[cfg(test)]
            _ => bail!("a buffer used on another device"),
        };
        Ok(self.held(mem))
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
        self.profiler.stamp(what, self.stream())
    }

    /// Starts timing each operation queued from now on ([`Self::profile_close`] says how long
    /// each took), dropping any profile already open.
    pub fn profile_open(&self) {
        self.profiler.open();
    }

    /// Seconds per operation since [`Self::profile_open`], the most first (waiting for the
    /// work queued): kernels by name, cuBLASLt's products together, copies and zeroing.
    pub fn profile_close(&self) -> Result<Vec<(String, f64)>> {
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
                let f = function(functions, name)?;
                allow_shared(f, name, shared)?;
                let per_sm = f
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
        self.stamp(name)?;
        let mut values: Vec<u64> = args.iter().map(|a| a.0).collect();
        let mut params: Vec<*mut c_void> =
            values.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
        match &self.backend {
            Backend::Cuda { stream, functions, .. } => {
                let f = function(functions, name)?;
                stream.context().bind_to_thread()?;
                allow_shared(f, name, cfg.shared_mem_bytes)?;
                // SAFETY: the caller's promise; `params` point at the arguments' values,
                // which outlive the call (the driver copies them when it queues the launch).
                unsafe {
                    cudarc::driver::result::launch_kernel(
                        f.cu_function(),
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
        self.stamp("matrix products (cuBLASLt)")?;
        match &self.backend {
            // SAFETY: the caller's promise.
            Backend::Cuda { blas, stream, .. } => {
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
}
