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
