// SwiGLU over a fused gate/up buffer, as src/kernels/swiglu.rs computes it: gu[rows, 2F] holds
// the gate projection in columns 0..F and the up projection in F..2F; act = silu(gate) * up.
// One thread per chunk of act (reduce.cuh: 8 values, 16-byte loads where aligned); values f32
// or bf16 (T), arithmetic f32.

__device__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename T> __device__ void swiglu_forward_t(T* act, const T* gu, long long rows, int f) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, chunks = (f + CHUNK - 1) / CHUNK;
    if (i >= rows * chunks) return;
    long long row = i / chunks;
    int c = (int)(i % chunks) * CHUNK;
    float g[CHUNK], u[CHUNK];
    load_chunk(g, gu + row * 2 * f + c, f - c);
    load_chunk(u, gu + row * 2 * f + f + c, f - c);
    for (int e = 0; e < CHUNK; e++) g[e] = g[e] * sigmoid(g[e]) * u[e];
    store_chunk(act + row * f + c, g, f - c);
}
extern "C" __global__ void swiglu_forward(float* act, const float* gu, long long rows, int f) {
    swiglu_forward_t(act, gu, rows, f);
}
extern "C" __global__ void swiglu_forward_bf16(bf16* act, const bf16* gu, long long rows, int f) {
    swiglu_forward_t(act, gu, rows, f);
}

// Overwrites dgu[rows, 2F] from dact[rows, F].
template <typename T>
__device__ void swiglu_backward_t(T* dgu, const T* dact, const T* gu, long long rows, int f) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, chunks = (f + CHUNK - 1) / CHUNK;
    if (i >= rows * chunks) return;
    long long row = i / chunks;
    int c = (int)(i % chunks) * CHUNK;
    float g[CHUNK], u[CHUNK], da[CHUNK];
    load_chunk(g, gu + row * 2 * f + c, f - c);
    load_chunk(u, gu + row * 2 * f + f + c, f - c);
    load_chunk(da, dact + row * f + c, f - c);
    for (int e = 0; e < CHUNK; e++) {
        float s = sigmoid(g[e]), dg = da[e] * u[e] * s * (1.0f + g[e] * (1.0f - s));
        u[e] = da[e] * g[e] * s;
        g[e] = dg;
    }
    store_chunk(dgu + row * 2 * f + f + c, u, f - c);
    store_chunk(dgu + row * 2 * f + c, g, f - c);
}
extern "C" __global__ void swiglu_backward(float* dgu, const float* dact, const float* gu,
                                           long long rows, int f) {
    swiglu_backward_t(dgu, dact, gu, rows, f);
}
extern "C" __global__ void swiglu_backward_bf16(bf16* dgu, const bf16* dact, const bf16* gu,
                                                long long rows, int f) {
    swiglu_backward_t(dgu, dact, gu, rows, f);
}
