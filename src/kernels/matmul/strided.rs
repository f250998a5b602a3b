//! An operand of a matrix product seen through its strides, shared by the portable and the
//! x86 product.

/// A strided view for `gemm`: element (r, c) lives at `ptr + r*rs + c*cs`.
#[derive(Clone, Copy)]
pub struct Strided {
    pub ptr: *const f32,
    pub rs: isize,
    pub cs: isize,
}

impl Strided {
    /// Row-major `[rows, cols]` matrix.
    pub fn rows(m: &[f32], cols: usize) -> Self {
        Strided { ptr: m.as_ptr(), rs: cols as isize, cs: 1 }
    }
    /// The transpose of a row-major `[rows, cols]` matrix.
    pub fn transposed(m: &[f32], cols: usize) -> Self {
        Strided { ptr: m.as_ptr(), rs: 1, cs: cols as isize }
    }
}
