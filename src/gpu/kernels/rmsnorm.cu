// RMSNorm with a learnable gain, fp32, as src/kernels/rmsnorm.rs computes it:
// y = x * rstd * g with rstd = 1 / sqrt(mean(x^2) + eps), one thread block per row.

// block_sum, row_dot and row_rstd come from reduce.cuh; one block of a power of two of threads
// per row.

// Forward: y[rows, d] and rstd[rows]; one block per row.
extern "C" __global__ void rmsnorm_forward(float* y, float* rstd, const float* x, const float* g,
                                           int d, float eps) {
    const float* xr = x + (size_t)blockIdx.x * d;
    float* yr = y + (size_t)blockIdx.x * d;
    float r = row_rstd(xr, d, eps);
    for (int j = threadIdx.x; j < d; j += blockDim.x) yr[j] = xr[j] * r * g[j];
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

// Backward to the input: with u = g * dy, dx = r * u - (r^3 / d) * <u, x> * x; one block per row.
// `dxx` (null for none): each row's <dx, x>, which the depth attention's backward takes.
extern "C" __global__ void rmsnorm_backward(float* dx, float* dxx, const float* dy, const float* x,
                                            const float* g, const float* rstd, int d) {
    size_t at = (size_t)blockIdx.x * d;
    float r = rstd[blockIdx.x], ux = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) ux += g[j] * dy[at + j] * x[at + j];
    float c = r * r * r * block_sum(ux) / (float)d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) dx[at + j] = r * g[j] * dy[at + j] - c * x[at + j];
    if (dxx) {
        float s = row_dot(dx + at, x + at, d);
        if (threadIdx.x == 0) dxx[blockIdx.x] = s;
    }
}

// Backward to the gain, added into dg[d]: dg[j] += sum over rows of dy * x * rstd; one thread
// per column.
extern "C" __global__ void rmsnorm_backward_gain(float* dg, const float* dy, const float* x,
                                                 const float* rstd, int rows, int d) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= d) return;
    float s = 0.0f;
    for (int t = 0; t < rows; t++) s += dy[(size_t)t * d + j] * x[(size_t)t * d + j] * rstd[t];
    dg[j] += s;
}
