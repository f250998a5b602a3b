// Softmax cross-entropy over the vocabulary, fused with its gradient, as
// src/kernels/cross_entropy.rs computes it; one block per row of logits[rows, V]. Logits and
// their gradient f32 or bf16 (T); the statistics and the loss f32. block_max and block_sum come
// from reduce.cuh.

// row_loss[r] = ln(sum exp(x - m)) + m - x[target]; with dlogits (else null), also
// dlogits[r] = (softmax(x) - onehot(target)) * inv, inv = 1 / rows. dlogits may be the logits
// themselves: every read of another thread's values comes before the reductions' barriers, and
// afterwards each thread reads only the chunks it then overwrites.
template <typename T>
__device__ void cross_entropy_t(T* dlogits, float* row_loss, const T* logits,
                                const unsigned int* targets, int v, float inv) {
    size_t at = (size_t)blockIdx.x * v;
    const T* x = logits + at;
    // The largest logit and the sum of exponentials in one pass over the row (online
    // softmax): each thread's sum is kept relative to its own maximum, then rescaled to the
    // row's.
    unsigned int t = targets[blockIdx.x];
    float target_logit = threadIdx.x == 0 ? to_f32(x[t]) : 0.0f;
    float m = NEG_INF, z = 0.0f;
    for_chunks(c, v) {
        float xs[CHUNK];
        load_chunk(xs, x + c, v - c);
        for (int i = 0; i < CHUNK && c + i < v; i++) {
            float xj = xs[i];
            if (xj > m) {
                z = z * expf(m - xj) + 1.0f;
                m = xj;
            } else if (m != NEG_INF) {
                z += expf(xj - m);
            }
        }
    }
    float row_max = block_max(m);
    z = block_sum(m == NEG_INF ? 0.0f : z * expf(m - row_max));
    m = row_max;
    if (threadIdx.x == 0) row_loss[blockIdx.x] = (float)log((double)z) + m - target_logit;
    if (dlogits == 0) return;
    float scale = inv / z;
    for_chunks(c, v) {
        float e[CHUNK];
        load_chunk(e, x + c, v - c);
        for (int i = 0; i < CHUNK; i++) {
            e[i] = expf(e[i] - m) * scale;
            if (c + i == (int)t) e[i] -= inv;
        }
        store_chunk(dlogits + at + c, e, v - c);
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
