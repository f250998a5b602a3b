// Token embedding, as src/kernels/embedding.rs computes it: out[t] = table[ids[t]], and the
// gradient dtable[ids[t]] += dout[t] for t in order. The table and its gradient are f32 (the weights); out and
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

// A block per id that occurs, rows[g], its threads over the columns: the id's tokens
// order[starts[g]] .. order[starts[g + 1] - 1] (in token order) added into its row one after
// another, as the CPU adds them, so the sums have the CPU's bits whatever the schedule (atomic
// sums would meet in any order).
template <typename T>
__device__ void embedding_backward_t(float* dtable, const T* dout, const unsigned int* order,
                                     const unsigned int* starts, const unsigned int* rows, int d) {
    unsigned int from = starts[blockIdx.x], to = starts[blockIdx.x + 1];
    float* row = dtable + (size_t)rows[blockIdx.x] * d;
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float sum = row[c];
        for (unsigned int i = from; i < to; i++) sum += to_f32(dout[(size_t)order[i] * d + c]);
        row[c] = sum;
    }
}
extern "C" __global__ void embedding_backward(float* dtable, const float* dout,
                                              const unsigned int* order, const unsigned int* starts,
                                              const unsigned int* rows, int d) {
    embedding_backward_t(dtable, dout, order, starts, rows, d);
}
extern "C" __global__ void embedding_backward_bf16(float* dtable, const bf16* dout,
                                                   const unsigned int* order,
                                                   const unsigned int* starts,
                                                   const unsigned int* rows, int d) {
    embedding_backward_t(dtable, dout, order, starts, rows, d);
}
