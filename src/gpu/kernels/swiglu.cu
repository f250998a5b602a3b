// SwiGLU over a fused gate/up buffer, as src/kernels/swiglu.rs computes it: gu[rows, 2F] holds
// the gate projection in columns 0..F and the up projection in F..2F; act = silu(gate) * up.
// One thread per value of act; values f32 or bf16 (T), arithmetic f32.

__device__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename T> __device__ void swiglu_forward_t(T* act, const T* gu, long long rows, int f) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * f) return;
    long long row = i / f;
    int j = (int)(i % f);
    float g = to_f32(gu[row * 2 * f + j]), u = to_f32(gu[row * 2 * f + f + j]);
    act[i] = from_f32<T>(g * sigmoid(g) * u);
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
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * f) return;
    long long row = i / f;
    int j = (int)(i % f);
    float g = to_f32(gu[row * 2 * f + j]), u = to_f32(gu[row * 2 * f + f + j]);
    float da = to_f32(dact[i]), s = sigmoid(g);
    dgu[row * 2 * f + f + j] = from_f32<T>(da * g * s);
    dgu[row * 2 * f + j] = from_f32<T>(da * u * s * (1.0f + g * (1.0f - s)));
}
extern "C" __global__ void swiglu_backward(float* dgu, const float* dact, const float* gu,
                                           long long rows, int f) {
    swiglu_backward_t(dgu, dact, gu, rows, f);
}
extern "C" __global__ void swiglu_backward_bf16(bf16* dgu, const bf16* dact, const bf16* gu,
                                                long long rows, int f) {
    swiglu_backward_t(dgu, dact, gu, rows, f);
}
