//! cuBLASLt, the GPU's matrix products, for the row-major matrices the engine keeps: fp32 with
//! TF32 off (the exact mode), or bf16 operands with f32 sums.
//!
//! cuBLASLt is column-major. A row-major `C[m, n]` is the column-major `Cᵀ[n, m]` at the same
//! address, so `C = op(A)·op(B)` is asked for as `Cᵀ = op(B)ᵀ·op(A)ᵀ`: the operands swap places
//! and keep their transpose flags.

use anyhow::{bail, Context, Result};
use cudarc::cublaslt::{result, sys};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// The type of a product's operands or result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    /// bfloat16 (`Bf16`): the products sum in f32 all the same.
    Bf16,
}

impl DType {
    fn cuda(self) -> sys::cudaDataType_t {
        match self {
            DType::F32 => sys::cudaDataType_t::CUDA_R_32F,
            DType::Bf16 => sys::cudaDataType_t::CUDA_R_16BF,
        }
    }
}

/// `C[m, n] = alpha·op(A)·op(B) + beta·C`, row-major: `op(A)` is `[m, k]`, stored as `A[m, k]`
/// (`lda` its row length, ≥ k) or, with `a_trans`, as `A[k, m]` (`lda` ≥ m); alike for B. A and
/// B are of type `ab`, C of type `c`; the sums are f32's.
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
    pub ab: DType,
    pub c: DType,
}

impl Gemm {
    /// `C = op(A)·op(B)` of matrices stored whole, each row right after the one before (the
    /// leading dimensions are the stored rows' lengths).
    pub fn packed(m: usize, n: usize, k: usize, a_trans: bool, b_trans: bool) -> Gemm {
        Gemm {
            m,
            n,
            k,
            a_trans,
            b_trans,
            lda: if a_trans { m } else { k },
            ldb: if b_trans { k } else { n },
            ldc: n,
            alpha: 1.0,
            beta: 0.0,
            ab: DType::F32,
            c: DType::F32,
        }
    }

    /// The same product with operands of type `ab` and result of type `c`.
    pub fn typed(self, ab: DType, c: DType) -> Gemm {
        Gemm { ab, c, ..self }
    }

    /// The product as a profile names it: `C[m, n] = A[m, k]·B[k, n]`, an operand stored
    /// transposed written as stored with ᵀ (`B[n, k]ᵀ`), `+=` where β ≠ 0, then the operands'
    /// type and the result's.
    pub fn label(&self) -> String {
        let operand = |name: &str, rows: usize, cols: usize, trans: bool| {
            if trans {
                format!("{name}[{cols}, {rows}]ᵀ")
            } else {
                format!("{name}[{rows}, {cols}]")
            }
        };
        let a = operand("A", self.m, self.k, self.a_trans);
        let b = operand("B", self.k, self.n, self.b_trans);
        let op = if self.beta == 0.0 { "=" } else { "+=" };
        let name = |d: DType| match d {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
        };
        let (m, n, ab, c) = (self.m, self.n, name(self.ab), name(self.c));
        format!("C[{m}, {n}] {op} {a}·{b} {ab}→{c}")
    }

    /// Values each operand spans from its first: A, B, C.
    pub fn spans(&self) -> (usize, usize, usize) {
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
    pub fn check(&self) {
        let a_cols = if self.a_trans { self.m } else { self.k };
        let b_cols = if self.b_trans { self.k } else { self.n };
        assert!(
            self.lda >= a_cols.max(1) && self.ldb >= b_cols.max(1) && self.ldc >= self.n.max(1),
            "leading dimensions shorter than their rows: {self:?}"
        );
    }
}

/// One matrix as a cuBLASLt layout describes it: column-major, `rows` × `cols`, each column
/// `ld` values after the one before.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct ColumnMajor {
    pub rows: u64,
    pub cols: u64,
    pub ld: u64,
}

/// A row-major [`Gemm`] as the column-major product cuBLASLt is asked for: `D = α·op(A)·op(B) +
/// β·C` with D at C's address, where cuBLASLt's A is the row-major B and its B the row-major A
/// ([`LtCall::addresses`]). The layouts carry the product's dimensions.
#[derive(Clone, Copy, Debug)]
pub(super) struct LtCall {
    pub trans_a: bool,
    pub trans_b: bool,
    pub a: ColumnMajor,
    pub b: ColumnMajor,
    pub c: ColumnMajor,
}

impl LtCall {
    /// The row-major product `g`'s call: `Cᵀ[n, m] = op(B)ᵀ·op(A)ᵀ`.
    pub fn of(g: &Gemm) -> LtCall {
        let (m, n, k) = (g.n as u64, g.m as u64, g.k as u64);
        // A matrix stored transposed has its dimensions swapped in its layout.
        let stored = |trans: bool, rows: u64, cols: u64, ld: usize| {
            let (rows, cols) = if trans { (cols, rows) } else { (rows, cols) };
            ColumnMajor { rows, cols, ld: ld as u64 }
        };
        LtCall {
            trans_a: g.b_trans,
            trans_b: g.a_trans,
            a: stored(g.b_trans, m, k, g.ldb),
            b: stored(g.a_trans, k, n, g.lda),
            c: ColumnMajor { rows: m, cols: n, ld: g.ldc as u64 },
        }
    }

    /// cuBLASLt's A, B and C for the row-major product's operands at `a`, `b`, `c`.
    pub fn addresses(a: u64, b: u64, c: u64) -> [u64; 3] {
        [b, a, c]
    }
}

/// What a product's cuBLASLt plan depends on: its shape and types, and the alignment of its
/// operands' addresses (cuBLASLt's heuristic otherwise assumes 256 bytes, which a weight
/// inside the parameters' buffer need not have).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct PlanKey {
    mnk: [usize; 3],
    trans: [bool; 2],
    ld: [usize; 3],
    types: [DType; 2],
    /// Of cuBLASLt's A, B and C ([`LtCall::addresses`]).
    align: [u32; 3],
}

/// The descriptors and the algorithm of one product, made once per [`PlanKey`].
struct Plan {
    desc: Desc,
    /// cuBLASLt's A, B and C (= D).
    layouts: [Layout; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

/// The largest power of two, up to 256, that divides `address`.
fn alignment(address: u64) -> u32 {
    if address == 0 {
        return 256;
    }
    (address & address.wrapping_neg()).min(256) as u32
}

/// The cuBLASLt handle of a device, its workspace, and the plans of the products it ran.
pub struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    /// A training step runs the same few shapes again and again: each one's descriptors and
    /// heuristic query are made once.
    plans: Mutex<HashMap<PlanKey, Plan>>,
}

// SAFETY: the handle is used from one thread at a time (the device's), as cuBLASLt allows;
// the plans are behind a lock.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

/// cuBLASLt's library, as cudarc opens it.
const LIBRARY: &str = "libcublasLt.so.13";

impl Blas {
    pub fn new(stream: &Arc<CudaStream>) -> Result<Blas> {
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
        Ok(Blas { handle, workspace, plans: Mutex::default() })
    }

    /// The plan of `g` with operands at `a`, `b`, `c`, from `plans` where it was made before.
    fn plan<'a>(
        &self,
        plans: &'a mut HashMap<PlanKey, Plan>,
        g: &Gemm,
        a: u64,
        b: u64,
        c: u64,
    ) -> Result<&'a Plan, result::CublasError> {
        let key = PlanKey {
            mnk: [g.m, g.n, g.k],
            trans: [g.a_trans, g.b_trans],
            ld: [g.lda, g.ldb, g.ldc],
            types: [g.ab, g.c],
            align: LtCall::addresses(a, b, c).map(alignment),
        };
        if plans.contains_key(&key) {
            return Ok(&plans[&key]);
        }
        let (f32_, ab, c_type) = (sys::cudaDataType_t::CUDA_R_32F, g.ab.cuda(), g.c.cuda());
        let call = LtCall::of(g);
        let layout = |ty, x: ColumnMajor| {
            result::create_matrix_layout(ty, x.rows, x.cols, x.ld as i64).map(Layout)
        };
        let (la, lb, lc) = (layout(ab, call.a)?, layout(ab, call.b)?, layout(c_type, call.c)?);
        // f32 accumulation (bf16 operands run on the tensor cores); fp32 operands keep TF32 off.
        let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let desc = Desc(result::create_matmul_desc(compute, f32_)?);
        let set = |attr, v: i32| {
            // SAFETY: `attr` takes a 32-bit value.
            unsafe { result::set_matmul_desc_attribute(desc.0, attr, (&v as *const i32).cast(), 4) }
        };
        use sys::cublasLtMatmulDescAttributes_t as A;
        set(A::CUBLASLT_MATMUL_DESC_TRANSA, call.trans_a as i32)?;
        set(A::CUBLASLT_MATMUL_DESC_TRANSB, call.trans_b as i32)?;
        let pref = Pref(result::create_matmul_pref()?);
        let set_pref = |attr, value: *const c_void, size: usize| {
            // SAFETY: `value` points at `size` bytes of the type `attr` takes.
            unsafe { result::set_matmul_pref_attribute(pref.0, attr, value, size) }
        };
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        let size = self.workspace.len();
        set_pref(P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, (&size as *const usize).cast(), 8)?;
        // A product split along k adds its parts in f32 in the workspace, or is not split: the
        // other schemes add them in the output's type (bf16 rounded at every part) or in place
        // in an order that varies.
        use sys::cublasLtReductionScheme_t as R;
        let schemes = R::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
        let schemes = schemes | R::CUBLASLT_REDUCTION_SCHEME_NONE as u32;
        set_pref(
            P::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
            (&schemes as *const u32).cast(),
            4,
        )?;
        // D is C.
        let [align_a, align_b, align_c] = key.align;
        for (attr, align) in [
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c),
            (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c),
        ] {
            set_pref(attr, (&align as *const u32).cast(), 4)?;
        }
        // SAFETY: descriptors made above.
        let heuristic = unsafe {
            result::get_matmul_algo_heuristic(self.handle, desc.0, la.0, lb.0, lc.0, lc.0, pref.0)
        }?;
        let plan = Plan { desc, layouts: [la, lb, lc], algo: heuristic.algo };
        Ok(plans.entry(key).or_insert(plan))
    }

    /// # Safety
    /// `a`, `b`, `c` are device addresses of buffers that hold what `g` spans.
    pub unsafe fn matmul(
        &self,
        stream: &CudaStream,
        g: &Gemm,
        a: u64,
        b: u64,
        c: u64,
    ) -> Result<(), result::CublasError> {
        let mut plans = self.plans.lock().unwrap_or_else(|e| e.into_inner());
        let plan = self.plan(&mut plans, g, a, b, c)?;
        let [la, lb, lc] = &plan.layouts;
        let [a, b, c] = LtCall::addresses(a, b, c);
        let (w, _) = self.workspace.device_ptr(stream);
        // SAFETY: the plan's descriptors are live while it is; the caller's promise for the
        // addresses.
        unsafe {
            result::matmul(
                self.handle,
                plan.desc.0,
                (&g.alpha as *const f32).cast(),
                (&g.beta as *const f32).cast(),
                a as *const c_void,
                la.0,
                b as *const c_void,
                lb.0,
                c as *const c_void,
                lc.0,
                c as *mut c_void,
                lc.0,
                &plan.algo,
                w as *mut c_void,
                self.workspace.len(),
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

#[cfg(test)]
mod tests {
    use super::alignment;

    #[test]
    fn an_address_s_alignment_is_its_largest_power_of_two_up_to_256() {
        for (address, want) in [(0x1000, 256), (0x1080, 128), (0x1002, 2), (0x1004, 4), (0, 256)] {
            assert_eq!(alignment(address), want, "{address:#x}");
        }
    }
}
