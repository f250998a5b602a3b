// Token embedding, as src/kernels/embedding.rs computes it: out[t] = table[ids[t]], and the
// gradient dtable[ids[t]] += dout[t]. The table and its gradient are f32 (the weights); out and
// dout f32 or bf16 (T). Ids are checked against the vocabulary before.

// One thread per value of out[tokens, d].
template <typename T>
__device__ void embedding_forward_t(T* out, const float* table, const unsigned int* ids,
                                    long long tokens, int d) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= tokens * d) return;
    long long t = i / d;
    out[i] = from_f32<T>(table[(long long)ids[t] * d + i % d]);
}
extern "C" __global__ void embedding_forward(float* out, const float* table,
                                             const unsigned int* ids, long long tokens, int d) {
    embedding_forward_t(out, table, ids, tokens, d);
}
extern "C" __global__ void embedding_forward_bf16(bf16* out, const float* table,
                                                  const unsigned int* ids, long long tokens, int d) {
    embedding_forward_t(out, table, ids, tokens, d);
}

// One thread per value of dout; tokens with the same id add into the same row, so the sums are
// atomic and their order (hence the last bits) varies from run to run.
template <typename T>
__device__ void embedding_backward_t(float* dtable, const T* dout, const unsigned int* ids,
                                     long long tokens, int d) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= tokens * d) return;
    long long t = i / d;
    atomicAdd(&dtable[(long long)ids[t] * d + i % d], to_f32(dout[i]));
}
extern "C" __global__ void embedding_backward(float* dtable, const float* dout,
                                              const unsigned int* ids, long long tokens, int d) {
    embedding_backward_t(dtable, dout, ids, tokens, d);
}
extern "C" __global__ void embedding_backward_bf16(float* dtable, const bf16* dout,
                                                   const unsigned int* ids, long long tokens, int d) {
    embedding_backward_t(dtable, dout, ids, tokens, d);
}
