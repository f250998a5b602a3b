// The conversion of f32 values to bf16: the weights' bf16 copy, and f32 sums handed on as
// bf16 activations. One thread per value.

// y = bf16(x).
extern "C" __global__ void to_bf16(bf16* y, const float* x, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = from_f32<bf16>(x[i]);
}
