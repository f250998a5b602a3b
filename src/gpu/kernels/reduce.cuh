// Block-wide reductions, put before every kernel file when it is compiled (src/gpu/mod.rs).
// The kernels that use them run with a power of two of threads per block, 32 to 1024.

// NVRTC has no math.h: minus infinity by its bits.
#define NEG_INF __int_as_float(0xff800000)

// The launch's dynamic shared memory as `type* name` (src/gpu/emulator/emu.h defines it for
// the CPU).
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(type, name)                                      \
    extern __shared__ __align__(16) unsigned char dynamic_shared_raw[]; \
    type* name = reinterpret_cast<type*>(dynamic_shared_raw)
#endif

// The sum of `v` over the block's threads, in every thread.
__device__ float block_sum(float v) {
    __shared__ float warps[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) warps[warp] = v;
    __syncthreads();
    v = lane < blockDim.x / 32 ? warps[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The largest `v` over the block's threads, in every thread.
__device__ float block_max(float v) {
    __shared__ float warps[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) warps[warp] = v;
    __syncthreads();
    v = lane < blockDim.x / 32 ? warps[lane] : NEG_INF;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// <a, b> over a row of `d` values, in every thread. The kernels that must agree on a dot
// product to the bit take it here with the same threads per block: rmsnorm's <dx, x> and the
// depth attention's <dh, v>, which must cancel exactly where a consumer reads one source.
__device__ float row_dot(const float* a, const float* b, int d) {
    float s = 0.0f;
    for (int j = threadIdx.x; j < d; j += blockDim.x) s += a[j] * b[j];
    return block_sum(s);
}

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

