//! Matrix products on the GPU through cuBLASLt, in fp32 with TF32 off (the exact mode), for the
//! row-major matrices the engine keeps: the Linear layers' forward and both backward products,
//! as `crate::kernels::matmul` computes them on the CPU.
//!
//! cuBLASLt is column-major. A row-major `C[m, n]` is the column-major `Cᵀ[n, m]` at the same
//! address, so `C = op(A)·op(B)` is asked for as `Cᵀ = op(B)ᵀ·op(A)ᵀ`: the operands swap places
//! and keep their transpose flags.

use super::device::{Arg, Buf, Device, Slice, SliceMut};
use anyhow::{bail, Context, Result};
use cudarc::cublaslt::{result, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::ffi::c_void;
use std::sync::Arc;

/// `C[m, n] = alpha·op(A)·op(B) + beta·C`, row-major: `op(A)` is `[m, k]`, stored as `A[m, k]`
/// (`lda` its row length, ≥ k) or, with `a_trans`, as `A[k, m]` (`lda` ≥ m); alike for B.
#[derive(Clone, Copy, Debug)]
pub struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a_trans: bool,
    pub b_trans: bool,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    pub alpha: f32,
    pub beta: f32,
}

impl Gemm {
    /// Values each operand spans from its first: A, B, C.
    fn spans(&self) -> (usize, usize, usize) {
        let span = |rows: usize, cols: usize, ld: usize| {
            if rows == 0 || cols == 0 {
                0
            } else {
                (rows - 1) * ld + cols
            }
        };
        let (ar, ac) = if self.a_trans { (self.k, self.m) } else { (self.m, self.k) };
        let (br, bc) = if self.b_trans { (self.n, self.k) } else { (self.k, self.n) };
        (span(ar, ac, self.lda), span(br, bc, self.ldb), span(self.m, self.n, self.ldc))
    }

    /// Each row holds what its leading dimension says it does.
    fn check(&self) {
        let a_cols = if self.a_trans { self.m } else { self.k };
        let b_cols = if self.b_trans { self.k } else { self.n };
        assert!(
            self.lda >= a_cols.max(1) && self.ldb >= b_cols.max(1) && self.ldc >= self.n.max(1),
            "leading dimensions shorter than their rows: {self:?}"
        );
    }
}

/// The cuBLASLt handle of a device and its workspace.
pub(super) struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
}

// SAFETY: the handle is used from one thread at a time (the device's), as cuBLASLt allows.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

/// cuBLASLt's library, as cudarc opens it.
const LIBRARY: &str = "libcublasLt.so.13";

impl Blas {
    pub(super) fn new(stream: &Arc<CudaStream>) -> Result<Blas> {
        // SAFETY: only tries to open the library (cudarc panics when it cannot).
        if !unsafe { sys::is_culib_present() } {
            bail!(
                "cuBLASLt ({LIBRARY}) is not on the library path: install PyPI's \
                 nvidia-cublas for CUDA 13 (torch brings it) and add its lib folder to \
                 LD_LIBRARY_PATH"
            );
        }
        let handle = result::create_handle().context("creating a cuBLASLt handle")?;
        // 32 MiB, what NVIDIA advises for Hopper.
        // SAFETY: cuBLASLt only uses it as scratch space.
        let workspace = unsafe { stream.alloc::<u8>(32 << 20) }?;
        Ok(Blas { handle, workspace })
    }

    /// # Safety
    /// `a`, `b`, `c` are device addresses of buffers that hold what `g` spans.
    unsafe fn matmul(
        &self,
        stream: &CudaStream,
        g: &Gemm,
        a: u64,
        b: u64,
        c: u64,
    ) -> Result<(), result::CublasError> {
        let f32_ = sys::cudaDataType_t::CUDA_R_32F;
        // Column-major: D[n, m] = op(B)ᵀ[n, k] · op(A)ᵀ[k, m].
        let (m, n, k) = (g.n as u64, g.m as u64, g.k as u64);
        let stored =
            |trans: bool, rows: u64, cols: u64| if trans { (cols, rows) } else { (rows, cols) };
        let (a_rows, a_cols) = stored(g.b_trans, m, k);
        let (b_rows, b_cols) = stored(g.a_trans, k, n);
        let la = Layout(result::create_matrix_layout(f32_, a_rows, a_cols, g.ldb as i64)?);
        let lb = Layout(result::create_matrix_layout(f32_, b_rows, b_cols, g.lda as i64)?);
        let lc = Layout(result::create_matrix_layout(f32_, m, n, g.ldc as i64)?);
        // fp32 products with fp32 accumulation: TF32 off.
        let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let desc = Desc(result::create_matmul_desc(compute, f32_)?);
        let set = |attr, v: i32| {
            // SAFETY: `attr` takes a 32-bit value.
            unsafe { result::set_matmul_desc_attribute(desc.0, attr, (&v as *const i32).cast(), 4) }
        };
        use sys::cublasLtMatmulDescAttributes_t as A;
        set(A::CUBLASLT_MATMUL_DESC_TRANSA, g.b_trans as i32)?;
        set(A::CUBLASLT_MATMUL_DESC_TRANSB, g.a_trans as i32)?;
        let pref = Pref(result::create_matmul_pref()?);
        let size = self.workspace.len();
        // SAFETY: the attribute takes a usize.
        unsafe {
            result::set_matmul_pref_attribute(
                pref.0,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&size as *const usize).cast(),
                size_of::<usize>(),
            )
        }?;
        // SAFETY: descriptors made above; the caller's promise for the addresses.
        unsafe {
            let h = result::get_matmul_algo_heuristic(
                self.handle,
                desc.0,
                la.0,
                lb.0,
                lc.0,
                lc.0,
                pref.0,
            )?;
            let (w, _) = self.workspace.device_ptr(stream);
            result::matmul(
                self.handle,
                desc.0,
                (&g.alpha as *const f32).cast(),
                (&g.beta as *const f32).cast(),
                b as *const c_void,
                la.0,
                a as *const c_void,
                lb.0,
                c as *const c_void,
                lc.0,
                c as *mut c_void,
                lc.0,
                &h.algo,
                w as *mut c_void,
                size,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: made in `new`, destroyed once.
        let _ = unsafe { result::destroy_handle(self.handle) };
    }
}

/// cuBLASLt descriptors, destroyed when dropped.
struct Layout(sys::cublasLtMatrixLayout_t);
struct Desc(sys::cublasLtMatmulDesc_t);
struct Pref(sys::cublasLtMatmulPreference_t);
impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: made once, destroyed once.
        let _ = unsafe { result::destroy_matrix_layout(self.0) };
    }
}
impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: as above.
        let _ = unsafe { result::destroy_matmul_desc(self.0) };
    }
}
impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: as above.
        let _ = unsafe { result::destroy_matmul_pref(self.0) };
    }
}

/// The product `g` of the matrices at `a`, `b` into `c`.
///
/// # Safety
/// `a`, `b` and `c` hold what `g` spans from them, and `c` overlaps neither.
pub unsafe fn gemm(dev: &Device, g: &Gemm, a: Arg, b: Arg, c: Arg) -> Result<()> {
    g.check();
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    // SAFETY: the caller's promise.
    unsafe { dev.matmul(g, a, b, c) }
}

/// Checks that buffer `x` holds `span` values from `at`.
fn holds(x: usize, at: usize, span: usize, what: &str) {
    assert!(at + span <= x, "{what}: {span} values from {at} past a buffer of {x}");
}

/// `y[rows, d_out] = x[rows, d_in] · wᵀ`, the weight `w[d_out, d_in]` (a tensor of the
/// model's parameters).
pub fn linear(
    dev: &Device,
    x: &Buf<f32>,
    w: Slice<f32>,
    rows: usize,
    d_in: usize,
    d_out: usize,
) -> Result<Buf<f32>> {
    let mut y = dev.zeros(rows * d_out)?;
    let g = Gemm {
        m: rows,
        n: d_out,
        k: d_in,
        a_trans: false,
        b_trans: true,
        lda: d_in,
        ldb: d_in,
        ldc: d_out,
        alpha: 1.0,
        beta: 0.0,
    };
    let (sa, sb, sc) = g.spans();
    holds(x.len(), 0, sa, "linear input");
    holds(w.len(), 0, sb, "linear weight");
    holds(y.len(), 0, sc, "linear output");
    // SAFETY: spans checked; `y` is new.
    unsafe { gemm(dev, &g, x.arg(), w.arg(), y.arg_mut()) }?;
    Ok(y)
}

/// Both backward products of [`linear`]: `dx = dy · w` (added into `dx` with `accumulate_dx`,
/// else written) and `dw += dyᵀ · x`.
#[allow(clippy::too_many_arguments)]
pub fn linear_backward(
    dev: &Device,
    dx: &mut Buf<f32>,
    dw: &mut SliceMut<f32>,
    dy: &Buf<f32>,
    x: &Buf<f32>,
    w: Slice<f32>,
    rows: usize,
    d_in: usize,
    d_out: usize,
    accumulate_dx: bool,
) -> Result<()> {
    let input = Gemm {
        m: rows,
        n: d_in,
        k: d_out,
        a_trans: false,
        b_trans: false,
        lda: d_out,
        ldb: d_in,
        ldc: d_in,
        alpha: 1.0,
        beta: if accumulate_dx { 1.0 } else { 0.0 },
    };
    let weight = Gemm {
        m: d_out,
        n: d_in,
        k: rows,
        a_trans: true,
        b_trans: false,
        lda: d_out,
        ldb: d_in,
        ldc: d_in,
        alpha: 1.0,
        beta: 1.0,
    };
    let (sa, sb, sc) = input.spans();
    holds(dy.len(), 0, sa, "linear output gradient");
    holds(w.len(), 0, sb, "linear weight");
    holds(dx.len(), 0, sc, "linear input gradient");
    let (sa, sb, sc) = weight.spans();
    holds(dy.len(), 0, sa, "linear output gradient");
    holds(x.len(), 0, sb, "linear input");
    holds(dw.len(), 0, sc, "linear weight gradient");
    // SAFETY: spans checked; `dx` and `dw` are `&mut` of their own, so overlap no input.
    unsafe {
        gemm(dev, &input, dy.arg(), w.arg(), dx.arg_mut())?;
        gemm(dev, &weight, dy.arg(), x.arg(), dw.arg_mut())
    }
}

impl Device {
    /// # Safety
    /// As [`gemm`].
    unsafe fn matmul(&self, g: &Gemm, a: Arg, b: Arg, c: Arg) -> Result<()> {
        match self.blas() {
            // SAFETY: the caller's promise.
            Some((blas, stream)) => unsafe { blas.matmul(stream, g, a.bits(), b.bits(), c.bits()) }
                .with_context(|| format!("cuBLASLt failed on {g:?}")),
            // SAFETY: the caller's promise; the emulated device's addresses are host ones.
            None => unsafe { host_matmul(g, a.bits(), b.bits(), c.bits()) },
        }
    }
}

/// The product on the CPU, for the emulated device: each value summed in f64 (closer to
/// exact than either engine, which the tests compare within their bounds).
///
/// # Safety
/// As [`gemm`], with host addresses.
unsafe fn host_matmul(g: &Gemm, a: u64, b: u64, c: u64) -> Result<()> {
    use rayon::prelude::*;
    let (sa, sb, sc) = g.spans();
    // SAFETY: the caller's promise: the spans lie inside the buffers, `c` overlaps neither.
    let (a, b, c) = unsafe {
        (
            std::slice::from_raw_parts(a as *const f32, sa),
            std::slice::from_raw_parts(b as *const f32, sb),
            std::slice::from_raw_parts_mut(c as *mut f32, sc),
        )
    };
    let at_a = |i: usize, p: usize| if g.a_trans { a[p * g.lda + i] } else { a[i * g.lda + p] };
    let at_b = |p: usize, j: usize| if g.b_trans { b[j * g.ldb + p] } else { b[p * g.ldb + j] };
    c.par_chunks_mut(g.ldc).enumerate().for_each(|(i, row)| {
        for (j, out) in row.iter_mut().take(g.n).enumerate() {
            let s: f64 = (0..g.k).map(|p| at_a(i, p) as f64 * at_b(p, j) as f64).sum();
            let before = if g.beta == 0.0 { 0.0 } else { g.beta * *out };
            *out = g.alpha * s as f32 + before;
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::matmul as cpu;
    use crate::testutil::{assert_close_to_largest, rand_vec};

    /// The Linear products against the CPU's, over shapes that are not multiples of anything.
    fn linear_matches_the_cpu(dev: &Device) {
        for (rows, d_in, d_out) in [(1, 3, 5), (37, 96, 200), (130, 257, 64)] {
            let x = rand_vec(rows * d_in, 1, 1.0);
            // The weight sits inside a larger buffer, as a model's parameters do.
            let w_at = 11;
            let params = rand_vec(w_at + d_in * d_out + 5, 2, 0.5);
            let w = &params[w_at..w_at + d_in * d_out];
            let dy = rand_vec(rows * d_out, 3, 1.0);
            let want_y = cpu::linear(&x, w, rows, d_in, d_out);
            let mut want_dx = rand_vec(rows * d_in, 4, 1.0);
            let mut want_dw = rand_vec(d_in * d_out, 5, 1.0);
            let (dx0, dw0) = (want_dx.clone(), want_dw.clone());
            cpu::linear_backward(&mut want_dx, &mut want_dw, &dy, &x, w, rows, d_in, d_out, true);

            let (xd, pd, dyd) =
                (dev.upload(&x).unwrap(), dev.upload(&params).unwrap(), dev.upload(&dy).unwrap());
            let wr = w_at..w_at + d_in * d_out;
            let y = linear(dev, &xd, pd.slice(wr.clone()), rows, d_in, d_out).unwrap();
            let mut dx = dev.upload(&dx0).unwrap();
            let mut dw_all = vec![7.0f32; params.len()];
            dw_all[w_at..w_at + d_in * d_out].copy_from_slice(&dw0);
            let mut dw = dev.upload(&dw_all).unwrap();
            let (dwr, wv) = (&mut dw.slice_mut(wr.clone()), pd.slice(wr.clone()));
            linear_backward(dev, &mut dx, dwr, &dyd, &xd, wv, rows, d_in, d_out, true).unwrap();
            let at = format!("{rows}x{d_in}->{d_out}");
            let dw = dev.download(&dw).unwrap();
            assert!(
                dw[..w_at].iter().chain(&dw[w_at + d_in * d_out..]).all(|&v| v == 7.0),
                "{at}: the weight gradient wrote outside its range"
            );
            for (name, got, want) in [
                ("y", dev.download(&y).unwrap(), want_y),
                ("dx", dev.download(&dx).unwrap(), want_dx),
                ("dw", dw[w_at..w_at + d_in * d_out].to_vec(), want_dw),
            ] {
                assert_close_to_largest(&got, &want, 1e-5, &format!("{at}: {name}"));
            }
            // Written, not added, without `accumulate_dx`.
            let mut dx = dev.upload(&dx0).unwrap();
            let mut scratch = dev.zeros(d_in * d_out).unwrap();
            let (dwr, wv) = (&mut scratch.all_mut(), pd.slice(wr.clone()));
            linear_backward(dev, &mut dx, dwr, &dyd, &xd, wv, rows, d_in, d_out, false).unwrap();
            let want = cpu::linear(&dy, &transpose(w, d_out, d_in), rows, d_out, d_in);
            assert_close_to_largest(
                &dev.download(&dx).unwrap(),
                &want,
                1e-5,
                &format!("{at}: dx written"),
            );
        }
    }
    crate::gpu::on_cpu_and_gpu!(linear_matches_the_cpu);

    /// `w[r, c]` as `[c, r]`.
    fn transpose(w: &[f32], r: usize, c: usize) -> Vec<f32> {
        (0..c).flat_map(|j| (0..r).map(move |i| w[i * c + j])).collect()
    }
}
