// SwiGLU over a fused gate/up buffer, fp32, as src/kernels/swiglu.rs computes it: gu[rows, 2F]
// holds the gate projection in columns 0..F and the up projection in F..2F;
// act = silu(gate) * up. One thread per value of act.

__device__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

extern "C" __global__ void swiglu_forward(float* act, const float* gu, long long rows, int f) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * f) return;
    long long row = i / f;
    int j = (int)(i % f);
    float g = gu[row * 2 * f + j], u = gu[row * 2 * f + f + j];
    act[i] = g * sigmoid(g) * u;
}

// Overwrites dgu[rows, 2F] from dact[rows, F].
extern "C" __global__ void swiglu_backward(float* dgu, const float* dact, const float* gu,
                                           long long rows, int f) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * f) return;
    long long row = i / f;
    int j = (int)(i % f);
    float g = gu[row * 2 * f + j], u = gu[row * 2 * f + f + j], da = dact[i];
    float s = sigmoid(g);
    dgu[row * 2 * f + f + j] = da * g * s;
    dgu[row * 2 * f + j] = da * u * s * (1.0f + g * (1.0f - s));
}
