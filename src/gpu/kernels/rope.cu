// Rotary position embedding in the "rotate half" layout, fp32, as src/kernels/rope.rs computes
// it: dimension j of a head pairs with j + half; the cos/sin tables come from the host (the
// CPU's own values) and the products and sums round one by one, without fused multiply-adds,
// so the GPU gives the CPU's bits.

// Rotates, in place, `heads` consecutive heads from column `col0` of each row of x[rows, width];
// row r at position pos[r]; sign -1 applies the transpose (the backward pass). One thread per
// pair of values.
extern "C" __global__ void rope_apply(float* x, const float* cos, const float* sin,
                                      const unsigned int* pos, long long rows, int width, int col0,
                                      int heads, int half, float sign) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * heads * half) return;
    int j = (int)(i % half);
    long long row_head = i / half;
    int h = (int)(row_head % heads);
    long long row = row_head / heads;
    float* a = x + row * width + col0 + (long long)h * 2 * half;
    long long at = (long long)pos[row] * half + j;
    float c = cos[at], s = sign * sin[at];
    float x1 = a[j], x2 = a[j + half];
    a[j] = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
    a[j + half] = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}
