// Rotary position embedding in the "rotate half" layout, as src/kernels/rope.rs computes it:
// dimension j of a head pairs with j + half; the cos/sin tables come from the host (the CPU's
// own values) and the products and sums round one by one, without fused multiply-adds, so that
// in f32 the GPU gives the CPU's bits. Values f32 or bf16 (T), arithmetic f32.

// Rotates, in place, `heads` consecutive heads from column `col0` of each row of x[rows, width];
// row r at position pos[r]; sign -1 applies the transpose (the backward pass). One thread per
// pair of values.
template <typename T>
__device__ void rope_apply_t(T* x, const float* cos, const float* sin, const unsigned int* pos,
                             long long rows, int width, int col0, int heads, int half, float sign) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * heads * half) return;
    int j = (int)(i % half);
    long long row_head = i / half;
    int h = (int)(row_head % heads);
    long long row = row_head / heads;
    T* a = x + row * width + col0 + (long long)h * 2 * half;
    long long at = (long long)pos[row] * half + j;
    float c = cos[at], s = sign * sin[at];
    float x1 = to_f32(a[j]), x2 = to_f32(a[j + half]);
    a[j] = from_f32<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    a[j + half] = from_f32<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
}
extern "C" __global__ void rope_apply(float* x, const float* cos, const float* sin,
                                      const unsigned int* pos, long long rows, int width, int col0,
                                      int heads, int half, float sign) {
    rope_apply_t(x, cos, sin, pos, rows, width, col0, heads, half, sign);
}
extern "C" __global__ void rope_apply_bf16(bf16* x, const float* cos, const float* sin,
                                           const unsigned int* pos, long long rows, int width,
                                           int col0, int heads, int half, float sign) {
    rope_apply_t(x, cos, sin, pos, rows, width, col0, heads, half, sign);
}
