//! NVIDIA GPUs, through the CUDA driver, NVRTC and cuBLASLt opened at run time (`cudarc` with
//! dynamic loading): the binary builds without the CUDA toolkit and runs where there is no GPU
//! (docs/gpu.md).
//!
//! What is here: finding the GPUs, or saying why there are none ([`driver`]); compiling the
//! engine's CUDA kernels (`kernels/*.cu`, built into the binary) with NVRTC for an architecture,
//! which needs the NVRTC library but no GPU ([`nvrtc`]); a device ([`device`]) that loads them,
//! makes buffers ([`buffer`]) and launches; the activations' two types ([`act`]); matrix products
//! ([`blas`], [`gemm`]); and the host side of each kernel, taking the buffers its CPU kernel takes.
//! The model and its training on the device are `crate::train::gpu`. cudarc panics when it cannot
//! open a library, so every entry point here asks first whether the library is there and turns its
//! absence into an error that names it.

pub mod act;
pub mod attention;
#[cfg(test)]
mod bf16_tests;
pub mod blas;
pub mod buffer;
pub mod cross_entropy;
pub mod depth;
pub mod depth_ablation;
pub mod device;
pub mod driver;
pub mod elementwise;
#[cfg(test)]
pub(crate) mod emulator;
pub mod gemm;
pub mod nvrtc;
pub mod optim;
pub mod profile;
pub mod rmsnorm;
pub mod rope;

pub use driver::{gpus, Gpu};
pub use nvrtc::{compile, compile_all, kernel_names, nvrtc_present, Compiled, KERNELS};

/// The activations' type on the GPU. The weights, their gradients, the optimiser's state and
/// every statistic and sum are f32 either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    /// bf16 activations and matrix products (f32 sums), over f32 master weights: mixed
    /// precision as llm.c runs it.
    #[default]
    Bf16,
    /// f32 throughout, TF32 off: the exact mode, which the tests hold to the CPU engine.
    Fp32,
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(match self {
            Precision::Bf16 => "bf16",
            Precision::Fp32 => "fp32",
        })
    }
}

/// Values a thread of the row kernels reads and writes at a time (`CHUNK` in reduce.cuh).
pub const ROW_CHUNK: usize = 8;

/// A launch of one block per row of `d` values, for the kernels that reduce over a row: a power
/// of two of threads, as `reduce.cuh` needs, with a chunk of [`ROW_CHUNK`] values for each
/// (several above 4096 values). At most 512 threads, so that a kernel of up to 128 registers a
/// thread fits the 65,536 of a block. The threads depend on `d` alone: `row_dot` (reduce.cuh)
/// gives the same bits in every kernel only with the same threads.
pub fn per_row(rows: usize, d: usize) -> cudarc::driver::LaunchConfig {
    assert!(rows <= i32::MAX as usize && d <= i32::MAX as usize);
    let threads = d.div_ceil(ROW_CHUNK).next_power_of_two().clamp(32, 512) as u32;
    cudarc::driver::LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A launch of kernel `name` over `rows` rows of `d` values, for the backward kernels that
/// also sum gradients over the rows, `sums` rows of them in shared memory: as many blocks as
/// the device runs at once, each taking an equal share of consecutive rows, and keeping its
/// sums, so that only a row of sums per block goes out. Returns the launch, its blocks and
/// the rows each takes.
pub fn rows_per_block(
    dev: &device::Device,
    name: &str,
    rows: usize,
    d: usize,
    sums: u32,
) -> anyhow::Result<(cudarc::driver::LaunchConfig, usize, usize)> {
    let row = cudarc::driver::LaunchConfig {
        shared_mem_bytes: sums * row_sums_bytes(d),
        ..per_row(1, d)
    };
    let resident = dev.resident_blocks(name, row.block_dim.0, row.shared_mem_bytes)?;
    let per_block = rows.div_ceil(resident.clamp(1, rows.max(1)));
    let blocks = rows.div_ceil(per_block.max(1));
    Ok((cudarc::driver::LaunchConfig { grid_dim: (blocks as u32, 1, 1), ..row }, blocks, per_block))
}

/// Bytes of one row of sums in shared memory (`row_sums_clear` in reduce.cuh).
pub fn row_sums_bytes(d: usize) -> u32 {
    (d.next_multiple_of(ROW_CHUNK) * size_of::<f32>()) as u32
}

/// A launch of one thread per value, in blocks of 256.
pub fn per_value(n: usize) -> cudarc::driver::LaunchConfig {
    const THREADS: u32 = 256;
    let blocks = n.div_ceil(THREADS as usize);
    assert!(blocks <= i32::MAX as usize, "{n} values: too many for one launch");
    cudarc::driver::LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A GPU test, `check(&Device)`, twice, in a module of its name: on the CPU through the
/// emulator (every test run) and on GPU 0 (`--ignored`, on a machine with one).
#[cfg(test)]
macro_rules! on_cpu_and_gpu {
    ($check:ident) => {
        mod $check {
            #[test]
            fn emulated_on_the_cpu() {
                if let Some(dev) = crate::gpu::device::Device::emulated(stringify!($check)) {
                    super::$check(&dev);
                }
            }

            #[test]
            #[ignore = "needs an NVIDIA GPU: run with --ignored on one (docs/gpu.md)"]
            fn on_the_gpu() {
                super::$check(&crate::gpu::device::Device::open(0).unwrap());
            }
        }
    };
}
#[cfg(test)]
pub(crate) use on_cpu_and_gpu;
