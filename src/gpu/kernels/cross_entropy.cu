// Softmax cross-entropy over the vocabulary, fused with its gradient, as
// src/kernels/cross_entropy.rs computes it; one block per row of logits[rows, V]. Logits and
// their gradient f32 or bf16 (T); the statistics and the loss f32. block_max and block_sum come
// from reduce.cuh.

// row_loss[r] = ln(sum exp(x - m)) + m - x[target]; with dlogits (else null), also
// dlogits[r] = (softmax(x) - onehot(target)) * inv, inv = 1 / rows.
template <typename T>
__device__ void cross_entropy_t(T* dlogits, float* row_loss, const T* logits,
                                const unsigned int* targets, int v, float inv) {
    size_t at = (size_t)blockIdx.x * v;
    const T* x = logits + at;
    float m = NEG_INF;
    for (int j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, to_f32(x[j]));
    m = block_max(m);
    float z = 0.0f;
    for (int j = threadIdx.x; j < v; j += blockDim.x) z += expf(to_f32(x[j]) - m);
    z = block_sum(z);
    unsigned int t = targets[blockIdx.x];
    if (threadIdx.x == 0) row_loss[blockIdx.x] = (float)log((double)z) + m - to_f32(x[t]);
    if (dlogits == 0) return;
    float scale = inv / z;
    for (int j = threadIdx.x; j < v; j += blockDim.x) {
        float e = expf(to_f32(x[j]) - m) * scale;
        dlogits[at + j] = from_f32<T>(j == (int)t ? e - inv : e);
    }
}
extern "C" __global__ void cross_entropy(float* dlogits, float* row_loss, const float* logits,
                                         const unsigned int* targets, int v, float inv) {
    cross_entropy_t(dlogits, row_loss, logits, targets, v, inv);
}
extern "C" __global__ void cross_entropy_bf16(bf16* dlogits, float* row_loss, const bf16* logits,
                                              const unsigned int* targets, int v, float inv) {
    cross_entropy_t(dlogits, row_loss, logits, targets, v, inv);
}
