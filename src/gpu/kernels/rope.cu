// Rotary position embedding in the "rotate half" layout, as src/kernels/rope.rs computes it:
// dimension j of a head pairs with j + half; the cos/sin tables come from the host (the CPU's
// own values) and the products and sums round one by one, without fused multiply-adds, so that
// in f32 the GPU gives the CPU's bits. Values f32 or bf16 (T), arithmetic f32.

// Rotates, in place, `heads` consecutive heads from column `col0` of each row of x[rows, width];
// row r at position pos[r]; sign -1 applies the transpose (the backward pass). One thread per
// chunk of a head's first half (reduce.cuh: 8 values) and the chunk it pairs with.
template <typename T>
__device__ void rope_apply_t(T* x, const float* cos, const float* sin, const unsigned int* pos,
                             long long rows, int width, int col0, int heads, int half, float sign) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int chunks = (half + CHUNK - 1) / CHUNK;
    if (i >= rows * heads * chunks) return;
    int j = (int)(i % chunks) * CHUNK;
    long long row_head = i / chunks;
    int h = (int)(row_head % heads);
    long long row = row_head / heads;
    T* a = x + row * width + col0 + (long long)h * 2 * half + j;
    long long at = (long long)pos[row] * half + j;
    float c[CHUNK], s[CHUNK], x1[CHUNK], x2[CHUNK];
    load_chunk(c, cos + at, half - j);
    load_chunk(s, sin + at, half - j);
    load_chunk(x1, a, half - j);
    load_chunk(x2, a + half, half - j);
    for (int e = 0; e < CHUNK; e++) {
        float se = sign * s[e], y1 = __fsub_rn(__fmul_rn(x1[e], c[e]), __fmul_rn(x2[e], se));
        x2[e] = __fadd_rn(__fmul_rn(x2[e], c[e]), __fmul_rn(x1[e], se));
        x1[e] = y1;
    }
    store_chunk(a, x1, half - j);
    store_chunk(a + half, x2, half - j);
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
