//! The CUDA kernels (`kernels/*.cu`, built into the binary) compiled with NVRTC for an
//! architecture, which needs the NVRTC library but no GPU.

use crate::base::fs::{cache_dir, content_key, write_atomic};
use anyhow::{anyhow, bail, Context, Result};
use cudarc::nvrtc::{result as nvrtc, sys};
use rayon::prelude::*;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// What every kernel file starts with when compiled: the bf16 type and the block-wide
/// reductions.
pub(crate) const COMMON: &str = include_str!("kernels/reduce.cuh");

/// The engine's CUDA kernels: (file name, source).
pub const KERNELS: &[(&str, &str)] = &[
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("convert.cu", include_str!("kernels/convert.cu")),
    ("cross_entropy.cu", include_str!("kernels/cross_entropy.cu")),
    ("depth.cu", include_str!("kernels/depth.cu")),
    ("depth_ablation.cu", include_str!("kernels/depth_ablation.cu")),
    ("embedding.cu", include_str!("kernels/embedding.cu")),
    ("flash.cu", include_str!("kernels/flash.cu")),
    ("optim.cu", include_str!("kernels/optim.cu")),
    ("rmsnorm.cu", include_str!("kernels/rmsnorm.cu")),
    ("rope.cu", include_str!("kernels/rope.cu")),
    ("swiglu.cu", include_str!("kernels/swiglu.cu")),
];

/// The kernels a source file declares (`extern "C" __global__ void NAME(`, or
/// `... void __launch_bounds__(...) NAME(`).
pub fn kernel_names(src: &str) -> Vec<&str> {
    let heads = src.split("extern \"C\" __global__ void ").skip(1);
    heads.map(|s| declared_name(s).split('(').next().unwrap_or("").trim()).collect()
}

/// What follows `void` in a kernel's declaration, its launch bounds left out.
fn declared_name(head: &str) -> &str {
    match head.strip_prefix("__launch_bounds__") {
        Some(bounded) => bounded.split_once(')').map_or("", |(_, rest)| rest),
        None => head,
    }
}

/// Whether the NVRTC library can be opened.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// One kernel file compiled for an architecture: PTX, and the machine code ptxas made of it.
#[derive(Debug)]
pub struct Compiled {
    pub file: &'static str,
    pub ptx: String,
    /// The CUBIN that a GPU of the architecture loads as it is (no compiling in the driver).
    pub cubin: Vec<u8>,
    pub seconds: f64,
    /// What ptxas reports of each kernel, in its order.
    pub resources: Vec<Resources>,
}

/// What ptxas reports of one kernel for the architecture it was compiled for. A stack frame
/// is local memory: arrays indexed by values known only at run time, or spilled registers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Resources {
    pub kernel: String,
    /// Per thread.
    pub registers: u32,
    pub stack_bytes: u32,
    /// Spill stores and loads, per thread.
    pub spill_bytes: u32,
    /// Static shared memory per block.
    pub shared_bytes: u32,
}

impl Resources {
    /// Whether all of the kernel's per-thread values live in registers.
    pub fn in_registers(&self) -> bool {
        self.stack_bytes == 0 && self.spill_bytes == 0
    }
}

/// The number before `unit` in `line` ("768 bytes stack frame" for " bytes stack frame").
fn number_before(line: &str, unit: &str) -> Option<u32> {
    let head = &line[..line.find(unit)?];
    head.rsplit(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// Each entry function's resources from ptxas's verbose log (`--ptxas-options=-v`): a
/// "Compiling entry function 'NAME'" line, then its stack and spills, then "Used N registers".
pub fn parse_ptxas_log(log: &str) -> Vec<Resources> {
    let mut found = Vec::new();
    let mut current: Option<Resources> = None;
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let kernel = rest.split('\'').next().unwrap_or("").to_string();
            current = Some(Resources { kernel, ..Resources::default() });
        } else if let Some(r) = current.as_mut() {
            if let Some(stack) = number_before(line, " bytes stack frame") {
                r.stack_bytes = stack;
                let stores = number_before(line, " bytes spill stores").unwrap_or(0);
                r.spill_bytes = stores + number_before(line, " bytes spill loads").unwrap_or(0);
            } else if let Some(registers) = number_before(line, " registers") {
                r.registers = registers;
                r.shared_bytes = number_before(line, " bytes smem").unwrap_or(0);
                found.extend(current.take());
            }
        }
    }
    found
}

/// Every kernel file compiled with NVRTC for `arch` (`sm_90`, …), side by side (NVRTC takes
/// separate programs on separate threads), each CUBIN also put in [`kernel_images`]' cache so
/// that a device opened next finds them; one that fails ends it with NVRTC's log.
pub fn compile_all(arch: &str) -> Result<Vec<Compiled>> {
    compile_all_in(&cache_dir().join("kernels"), arch)
}

/// [`compile_all`] with the cache in `dir`.
fn compile_all_in(dir: &Path, arch: &str) -> Result<Vec<Compiled>> {
    ready(arch)?;
    let cache = Cache::new(dir, arch)?;
    KERNELS
        .par_iter()
        .map(|&(file, src)| {
            let compiled = compile(file, src, arch)?;
            cache.put(file, src, &compiled.cubin);
            Ok(compiled)
        })
        .collect()
}

/// An error unless `arch` is written as NVRTC takes it and the NVRTC library is present.
fn ready(arch: &str) -> Result<()> {
    let digits = arch.strip_prefix("sm_").unwrap_or("");
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_alphanumeric()) {
        bail!("architecture {arch:?}: write it sm_XY, as sm_90 for Hopper");
    }
    let number: String = digits.chars().take_while(char::is_ascii_digit).collect();
    if number.parse::<u32>().is_ok_and(|n| n < 80) {
        bail!(
            "{arch}: the kernels need sm_80 (Ampere) or later, for the bf16 tensor cores and \
             asynchronous copies of the attention"
        );
    }
    if !nvrtc_present() {
        bail!(
            "NVRTC (libnvrtc.so.13) is not on the library path: install PyPI's \
             nvidia-cuda-nvrtc for CUDA 13 (torch brings it) and add its lib folder \
             (site-packages/nvidia/cu13/lib) to LD_LIBRARY_PATH"
        );
    }
    Ok(())
}

/// NVRTC's options for `arch`. For a real architecture NVRTC runs ptxas, whose verbose log
/// reports each kernel's resources.
fn options(arch: &str) -> [String; 3] {
    [format!("--gpu-architecture={arch}"), "--std=c++17".into(), "--ptxas-options=-v".into()]
}

/// One kernel file compiled with NVRTC for `arch`.
pub fn compile(file: &'static str, src: &str, arch: &str) -> Result<Compiled> {
    ready(arch)?;
    let t = Instant::now();
    // `#line` keeps NVRTC's messages at the file's own lines.
    let src = format!("#line 1 \"reduce.cuh\"\n{COMMON}\n#line 1 \"{file}\"\n{src}");
    let src = CString::new(src).context("a kernel source holds a NUL byte")?;
    let name = CString::new(file).context("a kernel file name holds a NUL byte")?;
    let program = nvrtc::create_program(&src, Some(&name))
        .map_err(|e| anyhow!("NVRTC could not take {file}: {e:?}"))?;
    // SAFETY: `program` is live until destroyed at the end, and `src` and `name` outlive it.
    let (compiled, log, ptx, cubin) = unsafe {
        let compiled = nvrtc::compile_program(program, &options(arch));
        let log = nvrtc::get_program_log(program);
        let ptx = compiled.is_ok().then(|| nvrtc::get_ptx(program));
        let cubin = compiled.is_ok().then(|| get_cubin(program));
        let _ = nvrtc::destroy_program(program);
        (compiled, log, ptx, cubin)
    };
    let text = |chars: Vec<std::ffi::c_char>| {
        let bytes: Vec<u8> = chars.into_iter().take_while(|&c| c != 0).map(|c| c as u8).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    };
    let log = log.map(text).unwrap_or_default();
    if compiled.is_err() {
        bail!("{file} does not compile for {arch}:\n{log}");
    }
    let ptx = ptx.expect("compiled").map_err(|e| anyhow!("NVRTC's PTX of {file}: {e:?}"))?;
    let cubin = cubin.expect("compiled").map_err(|e| anyhow!("NVRTC's CUBIN of {file}: {e:?}"))?;
    let resources = parse_ptxas_log(&log);
    let seconds = t.elapsed().as_secs_f64();
    Ok(Compiled { file, ptx: text(ptx), cubin, seconds, resources })
}

/// The CUBIN of a compiled program.
///
/// # Safety
/// `program` was compiled for a real architecture and is not destroyed.
unsafe fn get_cubin(program: sys::nvrtcProgram) -> Result<Vec<u8>, nvrtc::NvrtcError> {
    let mut size = 0usize;
    // SAFETY: the caller's promise; the buffer holds the size NVRTC gives.
    unsafe {
        sys::nvrtcGetCUBINSize(program, &mut size).result()?;
        let mut cubin = vec![0u8; size];
        sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr().cast()).result()?;
        Ok(cubin)
    }
}

/// NVRTC's version, as "major.minor".
fn nvrtc_version() -> Result<String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two integers to write; the library is present (the caller checked).
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| anyhow!("NVRTC's version: {e:?}"))?;
    Ok(format!("{major}.{minor}"))
}

/// Every kernel file's CUBIN for `arch`, from the cache folder (`kernels/` under
/// [`cache_dir`]) where this version of the sources was compiled before by this version of
/// NVRTC, else compiled now and cached. Each GPU test and run opens a device, so this spares
/// all but the first the seconds NVRTC takes.
pub fn kernel_images(arch: &str) -> Result<Vec<(&'static str, Vec<u8>)>> {
    kernel_images_in(&cache_dir().join("kernels"), arch)
}

/// [`kernel_images`] with the cache in `dir`.
fn kernel_images_in(dir: &Path, arch: &str) -> Result<Vec<(&'static str, Vec<u8>)>> {
    ready(arch)?;
    let cache = Cache::new(dir, arch)?;
    // The files compile side by side (NVRTC takes separate programs on separate threads).
    KERNELS
        .par_iter()
        .map(|&(file, src)| {
            if let Some(cubin) = cache.get(file, src) {
                return Ok((file, cubin));
            }
            let cubin = compile(file, src, arch)?.cubin;
            cache.put(file, src, &cubin);
            Ok((file, cubin))
        })
        .collect()
}

/// The folder of compiled kernels: a CUBIN per kernel file, architecture, and version of the
/// sources, of NVRTC and of its options.
struct Cache {
    dir: PathBuf,
    arch: String,
    nvrtc: String,
}

impl Cache {
    /// The cache in `dir`; NVRTC is present (`ready`).
    fn new(dir: &Path, arch: &str) -> Result<Cache> {
        Ok(Cache { dir: dir.to_path_buf(), arch: arch.to_string(), nvrtc: nvrtc_version()? })
    }

    fn path(&self, file: &str, src: &str) -> PathBuf {
        let stem = file.trim_end_matches(".cu");
        let options = options(&self.arch).join(" ");
        let sources = [COMMON, src, &self.nvrtc, &options].map(str::as_bytes);
        let key = content_key(&sources);
        self.dir.join(format!("{stem}-{}-{key}.cubin", self.arch))
    }

    /// The cached CUBIN of `file`, if there is one that is an ELF image (what the driver
    /// loads), not a truncated or foreign file.
    fn get(&self, file: &str, src: &str) -> Option<Vec<u8>> {
        std::fs::read(self.path(file, src)).ok().filter(|bytes| bytes.starts_with(b"\x7fELF"))
    }

    /// Keeps `cubin` for `file`. A cache that cannot be written costs the next run time,
    /// nothing else.
    fn put(&self, file: &str, src: &str, cubin: &[u8]) {
        let _ = std::fs::create_dir_all(&self.dir)
            .map_err(anyhow::Error::from)
            .and_then(|_| write_atomic(&self.path(file, src), cubin));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether NVRTC can be used here; where it cannot, the tests that need it pass with a
    /// note, unless `ATTNRES_REQUIRE_NVRTC` is set (CI sets it and puts PyPI's NVRTC on the
    /// library path, so there they run).
    fn nvrtc_or_skip(test: &str) -> bool {
        if nvrtc_present() {
            return true;
        }
        assert!(
            std::env::var_os("ATTNRES_REQUIRE_NVRTC").is_none(),
            "{test}: ATTNRES_REQUIRE_NVRTC is set but NVRTC (libnvrtc.so.13) is not on the library path"
        );
        eprintln!("{test}: skipped, NVRTC (libnvrtc.so.13) is not on the library path");
        false
    }

    /// Every kernel file compiles for Hopper, and its PTX holds an entry for each kernel the
    /// source declares.
    #[test]
    fn every_kernel_compiles_for_hopper() {
        if !nvrtc_or_skip("every_kernel_compiles_for_hopper") {
            return;
        }
        let cache = tempfile::tempdir().unwrap();
        let compiled = compile_all_in(cache.path(), "sm_90").unwrap();
        assert_eq!(compiled.len(), KERNELS.len());
        // What a device opened next loads, from the cache.
        let cached = Cache::new(cache.path(), "sm_90").unwrap();
        for (k, &(file, src)) in compiled.iter().zip(KERNELS) {
            assert_eq!(cached.get(file, src).as_ref(), Some(&k.cubin), "{file}: not cached");
        }
        for (k, &(file, src)) in compiled.iter().zip(KERNELS) {
            assert_eq!(k.file, file);
            assert!(k.ptx.contains(".target sm_90"), "{file}: not compiled for sm_90");
            let names = kernel_names(src);
            assert!(!names.is_empty(), "{file} declares no kernel");
            for name in &names {
                assert!(k.ptx.contains(&format!(".entry {name}(")), "{file}: no entry {name}");
            }
            let mut reported: Vec<&str> = k.resources.iter().map(|r| r.kernel.as_str()).collect();
            let mut declared = names.clone();
            reported.sort_unstable();
            declared.sort_unstable();
            assert_eq!(reported, declared, "{file}: ptxas's report");
            for r in &k.resources {
                // The CUDA-core attention kernels (the exact fp32 path) hold a head per thread
                // in arrays of 128 values, which cannot be registers; every other kernel keeps
                // its values in registers.
                let per_thread_heads = file == "attention.cu"
                    && r.kernel != "attention_backward_delta"
                    && r.kernel != "attention_backward_delta_bf16";
                assert!(per_thread_heads || r.in_registers(), "{file}: {r:?} uses local memory");
                assert!(r.registers > 0 && r.registers <= 255, "{file}: {r:?}");
                // The most threads the engine launches the kernel with fit its registers, as
                // the GPU checks only at launch: a block has 65,536, given to each warp in
                // units of 256. Attention's blocks are of 64 or 128 threads (any count of
                // registers fits); column_sums takes 1024 (rmsnorm.rs); per_row at most 512.
                let launched = match r.kernel.as_str() {
                    _ if file == "attention.cu" || file == "flash.cu" => 128,
                    "column_sums" => 1024,
                    _ => 512,
                };
                let fit = 65_536 / (32 * r.registers).next_multiple_of(256) * 32;
                assert!(launched <= fit, "{file}: {r:?} fits {fit} threads, not {launched}");
            }
        }
    }

    /// The kernels' machine code is compiled once per version of the sources and of NVRTC, then
    /// read from the cache; an unreadable entry is compiled again.
    #[test]
    fn kernel_images_are_compiled_once_then_cached() {
        if !nvrtc_or_skip("kernel_images_are_compiled_once_then_cached") {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let first = kernel_images_in(dir.path(), "sm_90").unwrap();
        assert_eq!(first.len(), KERNELS.len());
        let mut cached: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        cached.sort();
        assert_eq!(cached.len(), KERNELS.len(), "{cached:?}");
        assert!(cached[0].starts_with("attention-sm_90-") && cached[0].ends_with(".cubin"));
        for (file, cubin) in &first {
            // An ELF file, as the driver loads it.
            assert_eq!(&cubin[..4], b"\x7fELF", "{file}");
        }
        // The cache is what the next call reads: a marked ELF entry comes back as it is, an
        // empty one or one that is not ELF is made again.
        std::fs::write(dir.path().join(&cached[0]), b"\x7fELF marked").unwrap();
        std::fs::write(dir.path().join(&cached[1]), b"").unwrap();
        std::fs::write(dir.path().join(&cached[2]), b"<html>").unwrap();
        let second = kernel_images_in(dir.path(), "sm_90").unwrap();
        assert_eq!(second[0].1, b"\x7fELF marked");
        assert_eq!(second[1..], first[1..]);
        for i in 1..3 {
            assert_eq!(std::fs::read(dir.path().join(&cached[i])).unwrap(), first[i].1);
        }
    }

    #[test]
    fn ptxas_s_report_is_read_per_kernel() {
        let log = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'dkv' for 'sm_90'
ptxas info    : Function properties for dkv
ptxas         .     768 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads
ptxas info    : Used 146 registers, used 1 barriers, 768 bytes cumulative stack size, 33536 bytes smem
ptxas info    : Compile time = 549.625 ms
ptxas info    : Compiling entry function 'scale' for 'sm_90'
ptxas info    : Function properties for scale
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers
";
        let want = [
            Resources {
                kernel: "dkv".into(),
                registers: 146,
                stack_bytes: 768,
                spill_bytes: 20,
                shared_bytes: 33536,
            },
            Resources { kernel: "scale".into(), registers: 8, ..Resources::default() },
        ];
        assert_eq!(parse_ptxas_log(log), want);
        assert!(!want[0].in_registers() && want[1].in_registers());
    }

    #[test]
    fn a_kernel_that_does_not_compile_is_named_with_nvrtc_s_log() {
        if !nvrtc_or_skip("a_kernel_that_does_not_compile_is_named_with_nvrtc_s_log") {
            return;
        }
        let src = "extern \"C\" __global__ void f(float* y) { y[0] = no_such_name; }";
        let err = compile("broken.cu", src, "sm_90").unwrap_err().to_string();
        assert!(err.contains("broken.cu does not compile for sm_90"), "{err}");
        assert!(err.contains("no_such_name"), "{err}");
    }

    #[test]
    fn an_architecture_is_written_sm_and_its_number() {
        for arch in ["90", "sm_", "sm_9.0", "compute_90"] {
            let err = compile("k.cu", "", arch).unwrap_err().to_string();
            assert!(err.contains("write it sm_XY"), "{arch}: {err}");
        }
        for arch in ["sm_75", "sm_70"] {
            let err = compile("k.cu", "", arch).unwrap_err().to_string();
            assert!(err.contains("need sm_80 (Ampere) or later"), "{arch}: {err}");
        }
    }
}
