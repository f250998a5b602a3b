//! The CUDA kernels (`kernels/*.cu`, built into the binary) compiled with NVRTC for an
//! architecture, which needs the NVRTC library but no GPU.

use anyhow::{bail, Result};
use std::time::Instant;

/// What every kernel file starts with when compiled: the bf16 type and the block-wide
/// reductions.
pub(crate) const COMMON: &str = include_str!("kernels/reduce.cuh");

/// The engine's CUDA kernels: (file name, source).
pub const KERNELS: &[(&str, &str)] = &[
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("cross_entropy.cu", include_str!("kernels/cross_entropy.cu")),
    ("depth.cu", include_str!("kernels/depth.cu")),
    ("embedding.cu", include_str!("kernels/embedding.cu")),
    ("flash.cu", include_str!("kernels/flash.cu")),
    ("optim.cu", include_str!("kernels/optim.cu")),
    ("residual.cu", include_str!("kernels/residual.cu")),
    ("rmsnorm.cu", include_str!("kernels/rmsnorm.cu")),
    ("rope.cu", include_str!("kernels/rope.cu")),
    ("swiglu.cu", include_str!("kernels/swiglu.cu")),
];

/// The kernels a source file declares (`extern "C" __global__ void NAME(`).
pub fn kernel_names(src: &str) -> Vec<&str> {
    let heads = src.split("extern \"C\" __global__ void ").skip(1);
    heads.map(|s| s.split('(').next().unwrap_or("").trim()).collect()
}

/// Whether the NVRTC library can be opened.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// One kernel file compiled to PTX.
#[derive(Debug)]
pub struct Compiled {
    pub file: &'static str,
    pub ptx: String,
    pub seconds: f64,
}

/// Every kernel file compiled with NVRTC for `arch` (`sm_90`, …); the first that fails ends it
/// with NVRTC's log.
pub fn compile_all(arch: &str) -> Result<Vec<Compiled>> {
    KERNELS.iter().map(|&(file, src)| compile(file, src, arch)).collect()
}

/// One kernel file compiled with NVRTC for `arch`.
pub fn compile(file: &'static str, src: &str, arch: &str) -> Result<Compiled> {
    let digits = arch.strip_prefix("sm_").unwrap_or("");
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_alphanumeric()) {
        bail!("architecture {arch:?}: write it sm_XY, as sm_90 for Hopper");
    }
    if !nvrtc_present() {
        bail!(
            "NVRTC (libnvrtc.so.13) is not on the library path: install PyPI's \
             nvidia-cuda-nvrtc for CUDA 13 (torch brings it) and add its lib folder \
             (site-packages/nvidia/cu13/lib) to LD_LIBRARY_PATH"
        );
    }
    let t = Instant::now();
    let opts = cudarc::nvrtc::CompileOptions {
        name: Some(file.to_string()),
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".to_string()],
        ..Default::default()
    };
    // `#line` keeps NVRTC's messages at the file's own lines.
    let src = format!("#line 1 \"reduce.cuh\"\n{COMMON}\n#line 1 \"{file}\"\n{src}");
    match cudarc::nvrtc::compile_ptx_with_opts(src, opts) {
        Ok(ptx) => Ok(Compiled { file, ptx: ptx.to_src(), seconds: t.elapsed().as_secs_f64() }),
        Err(cudarc::nvrtc::CompileError::CompileError { log, .. }) => {
            bail!("{file} does not compile for {arch}:\n{}", log.to_string_lossy())
        }
        Err(e) => bail!("NVRTC failed on {file}: {e:?}"),
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
        let compiled = compile_all("sm_90").unwrap();
        assert_eq!(compiled.len(), KERNELS.len());
        for (k, &(file, src)) in compiled.iter().zip(KERNELS) {
            assert_eq!(k.file, file);
            assert!(k.ptx.contains(".target sm_90"), "{file}: not compiled for sm_90");
            let names = kernel_names(src);
            assert!(!names.is_empty(), "{file} declares no kernel");
            for name in names {
                assert!(k.ptx.contains(&format!(".entry {name}(")), "{file}: no entry {name}");
            }
        }
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
    }
}
