// RMSNorm with a learnable gain, fp32, as src/kernels/rmsnorm.rs computes it:
// y = x * rstd * g with rstd = 1 / sqrt(mean(x^2) + eps), one thread block per row.

// block_sum comes from reduce.cuh; one block of a power of two of threads per row.

// The reciprocal RMS of row `x` (`d` values). Where the squares overflow f32 although every
// value is finite, the statistic is taken again in f64, as the CPU kernel does.
__device__ float row_rstd(const float* x, int d, float eps) {
    float s = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) s += x[j] * x[j];
    float rstd = 1.0f / sqrtf(block_sum(s) / (float)d + eps);
    if (rstd != 0.0f) return rstd;
    double s64 = 0.0;
    int finite = 1;
    for (int j = threadIdx.x; j < d; j += blockDim.x) {
        s64 += (double)x[j] * (double)x[j];
        finite &= isfinite(x[j]);
    }
    // The f64 partials summed in shared memory.
    __shared__ double parts[1024];
    __shared__ int all_finite;
    if (threadIdx.x == 0) all_finite = 1;
    __syncthreads();
    parts[threadIdx.x] = s64;
    if (!finite) atomicAnd(&all_finite, 0);
    __syncthreads();
    if (!all_finite) return rstd;
    for (int n = blockDim.x / 2; n > 0; n >>= 1) {
        if (threadIdx.x < n) parts[threadIdx.x] += parts[threadIdx.x + n];
        __syncthreads();
    }
    return (float)(1.0 / sqrt(parts[0] / (double)d + (double)eps));
}

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
extern "C" __global__ void rmsnorm_backward(float* dx, const float* dy, const float* x,
                                            const float* g, const float* rstd, int d) {
    size_t at = (size_t)blockIdx.x * d;
    float r = rstd[blockIdx.x], ux = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) ux += g[j] * dy[at + j] * x[at + j];
    float c = r * r * r * block_sum(ux) / (float)d;
    for (int j = threadIdx.x; j < d; j += blockDim.x) dx[at + j] = r * g[j] * dy[at + j] - c * x[at + j];
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
