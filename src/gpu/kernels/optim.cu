// The optimisers' kernels and the gradient norms they clip by.

// AdamW, as src/kernels/adamw.rs updates a parameter: in f64, each operation rounded on its
// own (the _rn intrinsics are never fused into multiply-adds), so the GPU gives the CPU's
// bits. The gradient is first scaled by `clip` in f32, as the CPU clips it (1 where it does
// not); with `w16` (else null) the updated parameter's bf16 copy is written in the same pass.
// One thread per parameter; bc1, bc2 are the bias corrections 1 - beta^t.
extern "C" __global__ void adamw(float* p, bf16* w16, float* m, float* v, const float* g,
                                 float clip, long long n, double beta1, double beta2, double bc1,
                                 double bc2, double eps, double lr, double weight_decay) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    double gi = (double)__fmul_rn(g[i], clip);
    double mi = __dadd_rn(__dmul_rn(beta1, (double)m[i]), __dmul_rn(__dsub_rn(1.0, beta1), gi));
    double vi = __dadd_rn(__dmul_rn(beta2, (double)v[i]),
                          __dmul_rn(__dmul_rn(__dsub_rn(1.0, beta2), gi), gi));
    m[i] = __double2float_rn(mi);
    v[i] = __double2float_rn(vi);
    double denom = __dadd_rn(__dsqrt_rn(__ddiv_rn(vi, bc2)), eps);
    double step = __dadd_rn(__ddiv_rn(__ddiv_rn(mi, bc1), denom), __dmul_rn(weight_decay, (double)p[i]));
    float updated = __double2float_rn(__dsub_rn((double)p[i], __dmul_rn(lr, step)));
    p[i] = updated;
    if (w16) w16[i] = from_f32<bf16>(updated);
}

// Partial sums of squares of each tensor of g, in f64: tensor y = blockIdx.y spans
// starts[y]..starts[y + 1]; block x of gridDim.x sums every gridDim.x-th stretch of it into
// partial[y * gridDim.x + x]. The host adds the partials in order. Blocks of 256 threads.
extern "C" __global__ void tensor_squares(double* partial, const float* g,
                                          const long long* starts) {
    __shared__ double sums[256];
    long long from = starts[blockIdx.y], to = starts[blockIdx.y + 1];
    double s = 0.0;
    for (long long i = from + (long long)blockIdx.x * blockDim.x + threadIdx.x; i < to;
         i += (long long)gridDim.x * blockDim.x) {
        double v = (double)g[i];
        s += v * v;
    }
    sums[threadIdx.x] = s;
    __syncthreads();
    for (int n = blockDim.x / 2; n > 0; n >>= 1) {
        if (threadIdx.x < n) sums[threadIdx.x] += sums[threadIdx.x + n];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.y * gridDim.x + blockIdx.x] = sums[0];
}

// x *= s, in f32 (the CPU's clipping and averaging). One thread per value.
extern "C" __global__ void scale(float* x, float s, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}

// Muon's Nesterov momentum, as src/train/optim.rs takes it, from the gradient scaled by
// `clip` (as adamw): buf = mu * buf + g, and the direction dir = g + mu * buf, rounded one
// operation at a time. One thread per value.
extern "C" __global__ void muon_momentum(float* buf, float* dir, const float* g, float clip,
                                         float mu, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float gi = __fmul_rn(g[i], clip);
    float b = __fadd_rn(__fmul_rn(mu, buf[i]), gi);
    buf[i] = b;
    dir[i] = __fadd_rn(gi, __fmul_rn(mu, b));
}

// out = alpha * p + beta * q (out may be p or q), rounded one operation at a time: the
// Newton-Schulz steps' sums.
extern "C" __global__ void combine(float* out, const float* p, float alpha, const float* q,
                                   float beta, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __fadd_rn(__fmul_rn(alpha, p[i]), __fmul_rn(beta, q[i]));
}

// x /= d. One thread per value.
extern "C" __global__ void divide(float* x, float d, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __fdiv_rn(x[i], d);
}

// out[cols, rows] = in[rows, cols] transposed. One thread per value.
extern "C" __global__ void transpose(float* out, const float* in, int rows, int cols) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * cols) return;
    long long r = i / cols, c = i % cols;
    out[c * rows + r] = in[i];
}

// Muon's update with decoupled weight decay, in f64 as the CPU takes it:
// p = p * decay - lr_scale * o, with its bf16 copy where w16 is not null (as adamw). One
// thread per value.
extern "C" __global__ void muon_apply(float* p, bf16* w16, const float* o, double decay,
                                      double lr_scale, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float updated = __double2float_rn(__dsub_rn(__dmul_rn((double)p[i], decay), __dmul_rn(lr_scale, (double)o[i])));
    p[i] = updated;
    if (w16) w16[i] = from_f32<bf16>(updated);
}
