// RMSNorm with a learnable gain, as src/kernels/rmsnorm.rs computes it: y = x * rstd * g with
// rstd = 1 / sqrt(mean(x^2) + eps), one thread block per row. Rows x, y, dy, dx are f32 or bf16
// (T); the gain, its gradient and the statistics are f32.

// block_sum, row_dot and row_rstd come from reduce.cuh; one block of a power of two of threads
// per row.

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

// Backward to the input: with u = g * dy, dx = r * u - (r^3 / d) * <u, x> * x; one block per row.
// With `accumulate`, dx is added to what dx holds (the standard residual's stream gradient,
// rounded once). `dxx` (null for none): each row's <dx, x>, which the depth attention's
// backward takes (of the stored dx, so that it is the dot product the depth attention takes of
// the same rows).
template <typename T>
__device__ void rmsnorm_backward_t(T* dx, float* dxx, const T* dy, const T* x, const float* g,
                                   const float* rstd, int d, int accumulate) {
    size_t at = (size_t)blockIdx.x * d;
    float r = rstd[blockIdx.x], ux = 0.0f;
    for_chunks(c, d) {
        float gc[CHUNK], u[CHUNK], v[CHUNK];
        load_chunk(gc, g + c, d - c);
        load_chunk(u, dy + at + c, d - c);
        load_chunk(v, x + at + c, d - c);
        for (int i = 0; i < CHUNK; i++) ux += gc[i] * u[i] * v[i];
    }
    float k = r * r * r * block_sum(ux) / (float)d;
    for_chunks(c, d) {
        float gc[CHUNK], u[CHUNK], v[CHUNK], prior[CHUNK];
        load_chunk(gc, g + c, d - c);
        load_chunk(u, dy + at + c, d - c);
        load_chunk(v, x + at + c, d - c);
        if (accumulate) load_chunk(prior, dx + at + c, d - c);
        for (int i = 0; i < CHUNK; i++) {
            float e = r * gc[i] * u[i] - k * v[i];
            u[i] = accumulate ? prior[i] + e : e;
        }
        store_chunk(dx + at + c, u, d - c);
    }
    if (dxx) {
        float s = row_dot(dx + at, x + at, d);
        if (threadIdx.x == 0) dxx[blockIdx.x] = s;
    }
}
extern "C" __global__ void rmsnorm_backward(float* dx, float* dxx, const float* dy, const float* x,
                                            const float* g, const float* rstd, int d,
                                            int accumulate) {
    rmsnorm_backward_t(dx, dxx, dy, x, g, rstd, d, accumulate);
}
extern "C" __global__ void rmsnorm_backward_bf16(bf16* dx, float* dxx, const bf16* dy,
                                                 const bf16* x, const float* g, const float* rstd,
                                                 int d, int accumulate) {
    rmsnorm_backward_t(dx, dxx, dy, x, g, rstd, d, accumulate);
}

// Backward to the gain, in two steps that keep the GPU busy however few columns there are:
// each block sums dy * x * rstd over `chunk_rows` rows for its columns into part[chunk, d] (grid
// (ceil(d / threads), chunks)); rmsnorm_gain_sum then adds the chunks' sums into dg[d], in
// order, so the result does not vary from run to run.
template <typename T>
__device__ void rmsnorm_backward_gain_t(float* part, const T* dy, const T* x, const float* rstd,
                                        int rows, int d, int chunk_rows) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    int r0 = blockIdx.y * chunk_rows, r1 = r0 + chunk_rows < rows ? r0 + chunk_rows : rows;
    float s = 0.0f;
    for (int t = r0; t < r1; t++)
        s += to_f32(dy[(size_t)t * d + j]) * to_f32(x[(size_t)t * d + j]) * rstd[t];
    part[(size_t)blockIdx.y * d + j] = s;
}
extern "C" __global__ void rmsnorm_backward_gain(float* part, const float* dy, const float* x,
                                                 const float* rstd, int rows, int d,
                                                 int chunk_rows) {
    rmsnorm_backward_gain_t(part, dy, x, rstd, rows, d, chunk_rows);
}
extern "C" __global__ void rmsnorm_backward_gain_bf16(float* part, const bf16* dy, const bf16* x,
                                                      const float* rstd, int rows, int d,
                                                      int chunk_rows) {
    rmsnorm_backward_gain_t(part, dy, x, rstd, rows, d, chunk_rows);
}

// dg[j] += the sum over chunks of part[chunk, j]; one thread per column.
extern "C" __global__ void rmsnorm_gain_sum(float* dg, const float* part, int chunks, int d) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    float s = 0.0f;
    for (int c = 0; c < chunks; c++) s += part[(size_t)c * d + j];
    dg[j] += s;
}
