// Token embedding, fp32, as src/kernels/embedding.rs computes it: out[t] = table[ids[t]], and
// the gradient dtable[ids[t]] += dout[t]. Ids are checked against the vocabulary before.

// One thread per value of out[tokens, d].
extern "C" __global__ void embedding_forward(float* out, const float* table,
                                             const unsigned int* ids, long long tokens, int d) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= tokens * d) return;
    long long t = i / d;
    out[i] = table[(long long)ids[t] * d + i % d];
}

// One thread per value of dout; tokens with the same id add into the same row, so the sums are
// atomic and their order (hence the last bits) varies from run to run.
extern "C" __global__ void embedding_backward(float* dtable, const float* dout,
                                              const unsigned int* ids, long long tokens, int d) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= tokens * d) return;
    long long t = i / d;
    atomicAdd(&dtable[(long long)ids[t] * d + i % d], dout[i]);
}
