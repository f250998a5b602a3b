// The standard residual stream's sums, fp32: forward adds each sublayer's output to the
// stream, backward adds each sublayer's input gradient to the stream's. One thread per value.

// y = a + b.
extern "C" __global__ void add(float* y, const float* a, const float* b, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] + b[i];
}

// y += x.
extern "C" __global__ void add_into(float* y, const float* x, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += x[i];
}
