// RMSNorm with a learnable gain, as src/kernels/rmsnorm.rs computes it: y = x * rstd * g with
// rstd = 1 / sqrt(mean(x^2) + eps). Rows x, y, dy, dx are f32 or bf16 (T); the gain, its
// gradient and the statistics are f32.

// block_sum, row_dot, row_rstd and the row passes come from reduce.cuh; a block of a power of
// two of threads takes a row at a time.

// Forward: y[rows, d] and rstd[rows]; one block per row.
template <typename T>
__device__ void rmsnorm_forward_t(T* y, float* rstd, const T* x, const float* g, int d, float eps) {
    size_t at = (size_t)blockIdx.x * d;
    float r = norm_row(y + at, x + at, g, d, eps);
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}
extern "C" __global__ void rmsnorm_forward(float* y, float* rstd, const float* x, const float* g,
                                           int d, float eps) {
    rmsnorm_forward_t(y, rstd, x, g, d, eps);
}
extern "C" __global__ void rmsnorm_forward_bf16(bf16* y, float* rstd, const bf16* x,
                                                const float* g, int d, float eps) {
    rmsnorm_forward_t(y, rstd, x, g, d, eps);
}

// The standard residual's next sublayer input h = a + b (the stream and a sublayer's output)
// and its norm y, rstd, in one pass; one block per row. Each thread normalises the values it
// wrote, as they were rounded.
template <typename T>
__device__ void rmsnorm_add_forward_t(T* h, T* y, float* rstd, const T* a, const T* b,
                                      const float* g, int d, float eps) {
    size_t at = (size_t)blockIdx.x * d;
    for_chunks(c, d) {
        float x[CHUNK], y[CHUNK];
        load_chunk(x, a + at + c, d - c);
        load_chunk(y, b + at + c, d - c);
        for (int i = 0; i < CHUNK; i++) x[i] += y[i];
        store_chunk(h + at + c, x, d - c);
    }
    float r = norm_row(y + at, h + at, g, d, eps);
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}
extern "C" __global__ void rmsnorm_add_forward(float* h, float* y, float* rstd, const float* a,
                                               const float* b, const float* g, int d, float eps) {
    rmsnorm_add_forward_t(h, y, rstd, a, b, g, d, eps);
}
extern "C" __global__ void rmsnorm_add_forward_bf16(bf16* h, bf16* y, float* rstd, const bf16* a,
                                                    const bf16* b, const float* g, int d,
                                                    float eps) {
    rmsnorm_add_forward_t(h, y, rstd, a, b, g, d, eps);
}

// Backward: dx, and the gain's gradient, in one pass over dy and x. Each block takes
// `per_block` consecutive rows (norm_backward_row, reduce.cuh) and writes its sums of the
// gain's gradient to row blockIdx.x of `parts` ([gridDim.x, d]); column_sums adds them up.
// With `accumulate`, dx is added to what dx holds (the standard residual's stream gradient,
// rounded once). `dxx` (null for none): each row's <dx, x>, of dx as stored, which the depth
// attention's backward takes. Shared memory: a row of sums (d floats, rounded up to whole
// chunks).
template <typename T>
__device__ void rmsnorm_backward_t(T* dx, float* dxx, float* parts, const T* dy, const T* x,
                                   const float* g, const float* rstd, int rows, int d,
                                   int per_block, int accumulate) {
    DYNAMIC_SHARED(float, gain);
    row_sums_clear(gain, d);
    for (int t = rows_from(per_block); t < rows_to(per_block, rows); t++) {
        size_t at = (size_t)t * d;
        norm_backward_row(dx + at, gain, dy + at, x + at, g, rstd[t], d, accumulate);
        if (dxx) {
            float s = row_dot(dx + at, x + at, d);
            if (threadIdx.x == 0) dxx[t] = s;
        }
    }
    row_sums_store(parts + (size_t)blockIdx.x * d, gain, d);
}
extern "C" __global__ void rmsnorm_backward(float* dx, float* dxx, float* parts, const float* dy,
                                            const float* x, const float* g, const float* rstd,
                                            int rows, int d, int per_block, int accumulate) {
    rmsnorm_backward_t(dx, dxx, parts, dy, x, g, rstd, rows, d, per_block, accumulate);
}
extern "C" __global__ void rmsnorm_backward_bf16(bf16* dx, float* dxx, float* parts,
                                                 const bf16* dy, const bf16* x, const float* g,
                                                 const float* rstd, int rows, int d,
                                                 int per_block, int accumulate) {
    rmsnorm_backward_t(dx, dxx, parts, dy, x, g, rstd, rows, d, per_block, accumulate);
}

// sums[j] += the sum over n of parts[n, j] (n < count), for the 32 columns of block
// blockIdx.x (1024 threads): warp w sums rows w, w + 32, ... of its lane's column, then thread
// j of warp 0 adds the warps' sums in order, so the result does not vary from run to run.
extern "C" __global__ void column_sums(float* sums, const float* parts, int count, int d) {
    __shared__ float warps[32][33];
    int lane = threadIdx.x % 32, w = threadIdx.x / 32, j = blockIdx.x * 32 + lane;
    float s = 0.0f;
    if (j < d)
        for (int n = w; n < count; n += 32) s += parts[(size_t)n * d + j];
    warps[w][lane] = s;
    __syncthreads();
    if (w == 0 && j < d) {
        float total = 0.0f;
        for (int i = 0; i < 32; i++) total += warps[i][lane];
        sums[j] += total;
    }
}
