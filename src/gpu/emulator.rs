//! The engine's CUDA kernels run on the CPU, for the tests: each kernel file is compiled as C++
//! by the system's `g++` against `emulator/emu.h` (CUDA's built-ins as threads and barriers),
//! into one shared library that `Device` launches kernels from. So every kernel and its host
//! side is checked against the CPU engine in CI, which has no GPU; the same tests run on a GPU
//! with `--ignored`.

use super::blas::{ColumnMajor, Gemm, LtCall};
use super::nvrtc::{kernel_names, COMMON, KERNELS};
use anyhow::{bail, ensure, Context, Result};
use cudarc::driver::LaunchConfig;
use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

const HEADER: &str = include_str!("emulator/emu.h");

/// The fibers' switch, once for the library: save the callee-saved registers on the stack
/// left, swap stack pointers, pop them from the stack entered (x86-64 System V).
const RUNTIME: &str = r#"
#if defined(__x86_64__)
asm(R"(
    .text
    .globl emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
    .section .note.GNU-stack,"",@progbits
)");
#endif
"#;

/// `emu_NAME(config, args)`: 0 when the launch ran (else as `emu::run` says).
type Entry = unsafe extern "C" fn(*const Config, *mut *mut c_void) -> i32;

#[repr(C)]
struct Config {
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: u32,
}

pub struct Kernels {
    entries: HashMap<&'static str, Entry>,
    /// Keeps the entries' code loaded.
    _library: libloading::Library,
}

impl Kernels {
    /// Runs kernel `name` over `cfg` on the CPU.
    ///
    /// # Safety
    /// As [`Device::launch`].
    pub unsafe fn run(
        &self,
        name: &str,
        cfg: LaunchConfig,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        let entry = self.entries.get(name).with_context(|| format!("no kernel {name}"))?;
        let (g, b) = (cfg.grid_dim, cfg.block_dim);
        let config = Config {
            grid: [g.0, g.1, g.2],
            block: [b.0, b.1, b.2],
            shared_bytes: cfg.shared_mem_bytes,
        };
        // SAFETY: the caller's promise.
        match unsafe { entry(&config, params.as_mut_ptr()) } {
            0 => Ok(()),
            1 => bail!("{name}: a block of {b:?} threads (1 to 1024 in all)"),
            2 => bail!("{name}: threads left waiting at a barrier that never fills"),
            _ => bail!("{name}: a 16-byte load, store or copy at an address not 16-byte aligned"),
        }
    }
}

/// The kernels built for the CPU, once per process, or why they cannot be.
pub fn kernels() -> Result<Arc<Kernels>, String> {
    static BUILT: OnceLock<Result<Arc<Kernels>, String>> = OnceLock::new();
    BUILT.get_or_init(|| build().map(Arc::new).map_err(|e| format!("{e:#}"))).clone()
}

/// Each kernel file as a C++ file, after the emulation header and the shared reductions, in
/// a namespace of its own, with an entry per kernel it declares.
fn cpp_source(file: &str, src: &str) -> Result<String> {
    let (common, src) = (poison_static_shared(COMMON)?, poison_static_shared(src)?);
    let mut out = format!(
        "#include \"emu.h\"\nnamespace {{\n#line 1 \"reduce.cuh\"\n{common}\n\
         #line 1 \"{file}\"\n{src}\n}}\n"
    );
    for name in kernel_names(&src) {
        out.push_str(&format!("EMU_KERNEL({name})\n"));
    }
    Ok(out)
}

/// `src` with `EMU_POISON_SHARED(name);` after each static `__shared__` declaration, on its
/// line (so that line numbers stay), for each variable it declares: the emulator fills them
/// with NaN at the start of every block (`emu::poison_shared`).
fn poison_static_shared(src: &str) -> Result<String> {
    let mut out = String::with_capacity(src.len());
    for (i, line) in src.lines().enumerate() {
        out.push_str(line);
        let code = line.split("//").next().unwrap_or_default();
        if let Some((_, declared)) = code.split_once("__shared__") {
            if !code.contains("extern") && !code.trim_start().starts_with('#') {
                let Some((declared, _)) = declared.split_once(';') else {
                    bail!("line {}: a __shared__ declaration on one line: {line}", i + 1);
                };
                for name in declared_variables(declared) {
                    if name.is_empty() {
                        bail!("line {}: a __shared__ declaration without a name: {line}", i + 1);
                    }
                    out.push_str(&format!(" EMU_POISON_SHARED({name});"));
                }
            }
        }
        out.push('\n');
    }
    Ok(out)
}

/// The variables of a declaration without its `;`, e.g. `__align__(16) float a[2][N], b` gives
/// `a` and `b`: each declarator's last word before its first `[`.
fn declared_variables(declaration: &str) -> Vec<&str> {
    let mut depth = 0i32;
    let mut names = Vec::new();
    let mut start = 0;
    let is_word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    for (i, c) in declaration.char_indices().chain([(declaration.len(), ',')]) {
        match c {
            '(' | '[' | '<' => depth += 1,
            ')' | ']' | '>' => depth -= 1,
            ',' if depth == 0 => {
                let part = &declaration[start..i];
                let head = part.split('[').next().unwrap_or_default();
                let head = head.split(')').next_back().unwrap_or_default().trim_end();
                let from = head.rfind(|c| !is_word(c)).map_or(0, |p| p + 1);
                names.push(&head[from..]);
                start = i + 1;
            }
            _ => {}
        }
    }
    names
}

/// Whether `ATTNRES_EMULATOR_ASAN` asks for the kernels built with AddressSanitizer, so that a
/// kernel that reads or writes outside its buffers (on a GPU an illegal address, or another
/// buffer's values) stops the test that runs it with a report that names the kernel. The
/// test binary then needs ASan's runtime loaded first, or ASan stops it at once:
/// `LD_PRELOAD=$(g++ -print-file-name=libasan.so)`.
fn sanitized() -> bool {
    std::env::var_os("ATTNRES_EMULATOR_ASAN").is_some_and(|v| !v.is_empty() && v != "0")
}

fn build() -> Result<Kernels> {
    // A folder per version of the sources and build, so that a stale library is never loaded.
    let mut hash = std::hash::DefaultHasher::new();
    std::hash::Hash::hash(&(HEADER, RUNTIME, COMMON, KERNELS, sanitized()), &mut hash);
    let dir = std::env::temp_dir()
        .join(format!("attnres-gpu-emulator-{:016x}", std::hash::Hasher::finish(&hash)));
    let library = dir.join("kernels.so");
    if !library.exists() {
        compile(&dir, &library)?;
    }
    // SAFETY: a library built above from the kernels' sources; loading runs no code of ours.
    let lib = unsafe { libloading::Library::new(&library) }
        .with_context(|| format!("loading {}", library.display()))?;
    let mut entries = HashMap::new();
    for &(file, src) in KERNELS {
        for name in kernel_names(src) {
            let symbol = format!("emu_{name}");
            // SAFETY: EMU_KERNEL defines every `emu_NAME` with the type of `Entry`.
            let entry: Entry = *unsafe { lib.get::<Entry>(symbol.as_bytes()) }
                .with_context(|| format!("{file}: no {symbol} in the library"))?;
            entries.insert(name, entry);
        }
    }
    Ok(Kernels { entries, _library: lib })
}

/// Compiles the kernels into `library`, written under a temporary name and renamed, so that
/// test processes running at once never load a half-written file.
fn compile(dir: &Path, library: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(dir.join("emu.h"), HEADER)?;
    let runtime = dir.join("runtime.cpp");
    std::fs::write(&runtime, RUNTIME)?;
    let mut sources: Vec<PathBuf> = vec![runtime];
    for &(file, src) in KERNELS {
        let path = dir.join(format!("{file}.cpp"));
        std::fs::write(&path, cpp_source(file, src)?)?;
        sources.push(path);
    }
    let partial = dir.join(format!("kernels.so.{}", std::process::id()));
    // No fused multiply-adds: the CPU kernels have none either, and the kernels that promise
    // the CPU's bits (RoPE, AdamW) round each operation on their own on the GPU.
    let asan: &[&str] = match sanitized() {
        true => &["-fsanitize=address", "-fno-omit-frame-pointer", "-g"],
        false => &[],
    };
    let out = Command::new("g++")
        .args(["-std=c++20", "-O2", "-fPIC", "-shared", "-pthread", "-ffp-contract=off"])
        .args(asan)
        .args(&sources)
        .arg("-o")
        .arg(&partial)
        .output()
        .context("running g++ (the kernels run on the CPU through it)")?;
    if !out.status.success() {
        bail!("g++ could not compile the kernels:\n{}", String::from_utf8_lossy(&out.stderr));
    }
    std::fs::rename(&partial, library)?;
    Ok(())
}

/// The product on the CPU, for the emulated device, computed from the column-major call
/// cuBLASLt is given ([`LtCall`]) as its documentation defines one, so that the translation
/// from the engine's row-major products is checked without a GPU; each value summed in f64
/// (closer to exact than either engine, which the tests compare within their bounds).
///
/// # Safety
/// As `Device::matmul`, with host addresses.
pub unsafe fn host_matmul(g: &Gemm, a: u64, b: u64, c: u64) -> Result<()> {
    use super::blas::DType;
    // bfloat16 as the kernels store it (the device's `Bf16`: half's bits).
    use half::bf16;
    use rayon::prelude::*;
    let call = LtCall::of(g);
    let [a, b, c] = LtCall::addresses(a, b, c);
    // op(X)'s rows and columns: X's, swapped where X is transposed.
    let dims =
        |x: ColumnMajor, trans: bool| if trans { (x.cols, x.rows) } else { (x.rows, x.cols) };
    let ((m, k), (k_b, n)) = (dims(call.a, call.trans_a), dims(call.b, call.trans_b));
    // What cuBLASLt refuses: dimensions that do not chain, a column shorter than its rows.
    let columns_hold = [call.a, call.b, call.c].iter().all(|x| x.ld >= x.rows.max(1));
    ensure!(
        k == k_b && (call.c.rows, call.c.cols) == (m, n) && columns_hold,
        "cuBLASLt would refuse the product {call:?}, asked for {g:?}"
    );
    let span = |x: ColumnMajor| match x.rows * x.cols {
        0 => 0,
        _ => ((x.cols - 1) * x.ld + x.rows) as usize,
    };
    // Operands of either type read as f32, which holds every bfloat16 exactly.
    let read = |at: u64, n: usize| -> Vec<f32> {
        // SAFETY: the caller's promise: the products' spans lie inside the buffers.
        unsafe {
            match g.ab {
                DType::F32 => std::slice::from_raw_parts(at as *const f32, n).to_vec(),
                DType::Bf16 => std::slice::from_raw_parts(at as *const bf16, n)
                    .iter()
                    .map(|x| x.to_f32())
                    .collect(),
            }
        }
    };
    let (va, vb) = (read(a, span(call.a)), read(b, span(call.b)));
    // Row i, column j of op(X), X stored column by column.
    let op = |v: &[f32], x: ColumnMajor, trans: bool, i: u64, j: u64| {
        let (r, c) = if trans { (j, i) } else { (i, j) };
        v[(r + c * x.ld) as usize]
    };
    let value = |i: u64, j: u64, before: f32| {
        let s: f64 = (0..k)
            .map(|p| {
                let x = op(&va, call.a, call.trans_a, i, p);
                x as f64 * op(&vb, call.b, call.trans_b, p, j) as f64
            })
            .sum();
        let before = if g.beta == 0.0 { 0.0 } else { g.beta * before };
        g.alpha * s as f32 + before
    };
    // D = C, column by column. SAFETY: the caller's promise: `c` spans the result's values of
    // its type and overlaps neither operand.
    let (ld, sc) = (call.c.ld as usize, span(call.c));
    match g.c {
        DType::F32 => {
            let d = unsafe { std::slice::from_raw_parts_mut(c as *mut f32, sc) };
            d.par_chunks_mut(ld).enumerate().for_each(|(j, column)| {
                for (i, out) in column.iter_mut().take(m as usize).enumerate() {
                    *out = value(i as u64, j as u64, *out);
                }
            });
        }
        DType::Bf16 => {
            let d = unsafe { std::slice::from_raw_parts_mut(c as *mut bf16, sc) };
            d.par_chunks_mut(ld).enumerate().for_each(|(j, column)| {
                for (i, out) in column.iter_mut().take(m as usize).enumerate() {
                    *out = bf16::from_f32(value(i as u64, j as u64, out.to_f32()));
                }
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_shared_variables_are_found_and_poisoned() {
        let cases: [(&str, &[&str]); 4] = [
            ("    __shared__ float warps[32];", &["warps"]),
            (
                "    __shared__ __align__(16) unsigned int keys[2][Tile<HD, KEYS>::WORDS];",
                &["keys"],
            ),
            (
                "    __shared__ float st_bias[2][QUERIES], st_delta[2][QUERIES];",
                &["st_bias", "st_delta"],
            ),
            ("    __shared__ int all_finite;", &["all_finite"]),
        ];
        for (line, names) in cases {
            let out = poison_static_shared(line).unwrap();
            let calls: String = names.iter().map(|n| format!(" EMU_POISON_SHARED({n});")).collect();
            assert_eq!(out, format!("{line}{calls}\n"));
        }
        // Declared elsewhere, or not a declaration: left alone.
        for line in
            ["    extern __shared__ __align__(16) unsigned char raw[]; \\", "// __shared__ x;"]
        {
            assert_eq!(poison_static_shared(line).unwrap(), format!("{line}\n"));
        }
        assert!(poison_static_shared("    __shared__ float warps[32]").is_err());
    }
}
