// The standard residual stream's backward: each sublayer's input gradient added to the
// stream's (forward's sums are rmsnorm_add_forward, with the next norm). Values f32 or bf16
// (T), sums f32. One thread per value. Also the conversion of f32 values to bf16 (the weights'
// bf16 copy, f32 sums handed on as bf16 activations).

// y += x.
template <typename T> __device__ void add_into_t(T* y, const T* x, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = from_f32<T>(to_f32(y[i]) + to_f32(x[i]));
}
extern "C" __global__ void add_into(float* y, const float* x, long long n) { add_into_t(y, x, n); }
extern "C" __global__ void add_into_bf16(bf16* y, const bf16* x, long long n) {
    add_into_t(y, x, n);
}

// y = bf16(x).
extern "C" __global__ void to_bf16(bf16* y, const float* x, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = from_f32<bf16>(x[i]);
}
