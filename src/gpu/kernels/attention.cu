// Causal multi-head attention with grouped-query heads, as src/kernels/attention.rs computes it
// (values f32 or bf16, T; arithmetic, tiles and statistics f32), over the packed qkv[B*T, (H + 2*KV)*hd] (query heads, key heads, value heads;
// query head h reads kv head h / (H / KV)). Memory grows with T, not T^2: forward keeps per row
// only the softmax statistics (the largest scaled score and 1 / the sum of exponentials,
// stats[B, H, T, 2], the CPU's), from which backward recomputes the probabilities.
//
// One thread per query row (forward, dq) or key row (dk, dv), in blocks of ROWS; the other
// side's rows pass through shared memory TILE at a time. The head's vectors live in per-thread
// arrays of MAX_HD. Written for exactness first, on the CUDA cores; a tensor-core kernel is to
// come.

#define ROWS 64
#define TILE 32
#define MAX_HD 128

struct Heads {
    int t, h, kv, hd;
    __device__ int width() const { return (h + 2 * kv) * hd; }
    __device__ int k_col(int g) const { return (h + g) * hd; }
    __device__ int v_col(int g) const { return (h + kv + g) * hd; }
};

// Rows r0..r0+TILE of sequence b, columns col..col+hd of a [B*T, width] buffer, into tile
// [TILE][hd] (rows past T left as they are; nobody reads them).
template <typename T>
__device__ void load_tile(float* tile, const T* src, int b, int r0, int col, int width,
                          const Heads& s) {
    for (int e = threadIdx.x; e < TILE * s.hd; e += blockDim.x) {
        int r = e / s.hd, c = e % s.hd;
        if (r0 + r < s.t) tile[e] = to_f32(src[((size_t)b * s.t + r0 + r) * width + col + c]);
    }
}

// Forward: out[B*T, H*hd] and stats. Grid (ceil(T / ROWS), B*H), ROWS threads; dynamic shared
// memory 2 * TILE * hd floats.
template <typename T>
__device__ void attention_forward_t(T* out, float* stats, const T* qkv, int t, int h, int kv,
                                    int hd, float scale) {
    Heads s{t, h, kv, hd};
    int b = blockIdx.y / h, head = blockIdx.y % h, g = head / (h / kv);
    int i = blockIdx.x * ROWS + threadIdx.x;
    int width = s.width();
    DYNAMIC_SHARED(float, shared);
    float* ks = shared;
    float* vs = shared + TILE * hd;
    float q[MAX_HD], o[MAX_HD];
    bool live = i < t;
    for (int d = 0; d < hd; d++) {
        q[d] = live ? to_f32(qkv[((size_t)b * t + i) * width + head * hd + d]) : 0.0f;
        o[d] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    int last = min(t, (int)(blockIdx.x + 1) * ROWS);  // keys this block's rows see
    for (int j0 = 0; j0 < last; j0 += TILE) {
        __syncthreads();
        load_tile(ks, qkv, b, j0, s.k_col(g), width, s);
        load_tile(vs, qkv, b, j0, s.v_col(g), width, s);
        __syncthreads();
        if (!live || j0 > i) continue;
        int n = min(TILE, i - j0 + 1);
        float sc[TILE];
        float tile_max = NEG_INF;
        for (int jj = 0; jj < n; jj++) {
            float dot = 0.0f;
            for (int d = 0; d < hd; d++) dot += q[d] * ks[jj * hd + d];
            sc[jj] = dot * scale;
            tile_max = fmaxf(tile_max, sc[jj]);
        }
        float m_new = fmaxf(m, tile_max);
        float keep = expf(m - m_new);
        l *= keep;
        for (int d = 0; d < hd; d++) o[d] *= keep;
        for (int jj = 0; jj < n; jj++) {
            float p = expf(sc[jj] - m_new);
            l += p;
            for (int d = 0; d < hd; d++) o[d] += p * vs[jj * hd + d];
        }
        m = m_new;
    }
    if (!live) return;
    float inv = 1.0f / l;
    for (int d = 0; d < hd; d++)
        out[((size_t)b * t + i) * h * hd + head * hd + d] = from_f32<T>(o[d] * inv);
    size_t at = (((size_t)b * h + head) * t + i) * 2;
    stats[at] = m;
    stats[at + 1] = inv;
}
extern "C" __global__ void attention_forward(float* out, float* stats, const float* qkv, int t,
                                             int h, int kv, int hd, float scale) {
    attention_forward_t(out, stats, qkv, t, h, kv, hd, scale);
}
extern "C" __global__ void attention_forward_bf16(bf16* out, float* stats, const bf16* qkv, int t,
                                                  int h, int kv, int hd, float scale) {
    attention_forward_t(out, stats, qkv, t, h, kv, hd, scale);
}

// delta[B, H, T] = per row and head, <dout, out>: the softmax backward's correction. One
// thread per value.
template <typename T>
__device__ void attention_backward_delta_t(float* delta, const T* dout, const T* out,
                                           long long rows, int t, int h, int hd) {
    long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= rows * h) return;
    long long row = e / h;
    int head = (int)(e % h);
    const T* a = dout + row * h * hd + head * hd;
    const T* c = out + row * h * hd + head * hd;
    float sum = 0.0f;
    for (int d = 0; d < hd; d++) sum += to_f32(a[d]) * to_f32(c[d]);
    long long b = row / t, i = row % t;
    delta[(b * h + head) * t + i] = sum;
}
extern "C" __global__ void attention_backward_delta(float* delta, const float* dout,
                                                    const float* out, long long rows, int t,
                                                    int h, int hd) {
    attention_backward_delta_t(delta, dout, out, rows, t, h, hd);
}
extern "C" __global__ void attention_backward_delta_bf16(float* delta, const bf16* dout,
                                                         const bf16* out, long long rows, int t,
                                                         int h, int hd) {
    attention_backward_delta_t(delta, dout, out, rows, t, h, hd);
}

// The probability of query row i at key j, from the saved statistics (the scaled score `sc`).
__device__ float prob(float sc, const float* stats, size_t at) {
    return expf(sc - stats[at]) * stats[at + 1];
}

// Backward to the queries: the q columns of dqkv. Grid and block as forward; dynamic shared
// memory 2 * TILE * hd floats.
template <typename T>
__device__ void attention_backward_dq_t(T* dqkv, const T* dout, const T* qkv, const float* stats,
                                        const float* delta, int t, int h, int kv, int hd,
                                        float scale) {
    Heads s{t, h, kv, hd};
    int b = blockIdx.y / h, head = blockIdx.y % h, g = head / (h / kv);
    int i = blockIdx.x * ROWS + threadIdx.x;
    int width = s.width();
    DYNAMIC_SHARED(float, shared);
    float* ks = shared;
    float* vs = shared + TILE * hd;
    float q[MAX_HD], dq[MAX_HD], dy[MAX_HD];
    bool live = i < t;
    size_t row = (size_t)b * t + (live ? i : 0);
    for (int d = 0; d < hd; d++) {
        q[d] = to_f32(qkv[row * width + head * hd + d]);
        dy[d] = to_f32(dout[row * h * hd + head * hd + d]);
        dq[d] = 0.0f;
    }
    size_t st = (((size_t)b * h + head) * t + (live ? i : 0)) * 2;
    float dl = delta[st / 2];
    int last = min(t, (int)(blockIdx.x + 1) * ROWS);
    for (int j0 = 0; j0 < last; j0 += TILE) {
        __syncthreads();
        load_tile(ks, qkv, b, j0, s.k_col(g), width, s);
        load_tile(vs, qkv, b, j0, s.v_col(g), width, s);
        __syncthreads();
        if (!live || j0 > i) continue;
        int n = min(TILE, i - j0 + 1);
        for (int jj = 0; jj < n; jj++) {
            float dot = 0.0f, dp = 0.0f;
            for (int d = 0; d < hd; d++) {
                dot += q[d] * ks[jj * hd + d];
                dp += dy[d] * vs[jj * hd + d];
            }
            float ds = prob(dot * scale, stats, st) * (dp - dl);
            for (int d = 0; d < hd; d++) dq[d] += ds * ks[jj * hd + d];
        }
    }
    if (!live) return;
    for (int d = 0; d < hd; d++) dqkv[row * width + head * hd + d] = from_f32<T>(dq[d] * scale);
}
extern "C" __global__ void attention_backward_dq(float* dqkv, const float* dout, const float* qkv,
                                                 const float* stats, const float* delta, int t,
                                                 int h, int kv, int hd, float scale) {
    attention_backward_dq_t(dqkv, dout, qkv, stats, delta, t, h, kv, hd, scale);
}
extern "C" __global__ void attention_backward_dq_bf16(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                                      const float* stats, const float* delta,
                                                      int t, int h, int kv, int hd, float scale) {
    attention_backward_dq_t(dqkv, dout, qkv, stats, delta, t, h, kv, hd, scale);
}

// Backward to the keys and values: the k and v columns of dqkv, summed over the query heads
// of each kv head's group. Grid (ceil(T / ROWS), B*KV), ROWS threads, one per key row;
// dynamic shared memory 2 * TILE * hd + 3 * TILE floats.
template <typename T>
__device__ void attention_backward_dkv_t(T* dqkv, const T* dout, const T* qkv, const float* stats,
                                         const float* delta, int t, int h, int kv, int hd,
                                         float scale) {
    Heads s{t, h, kv, hd};
    int b = blockIdx.y / kv, g = blockIdx.y % kv, group = h / kv;
    int j = blockIdx.x * ROWS + threadIdx.x;
    int width = s.width();
    DYNAMIC_SHARED(float, shared);
    float* qs = shared;
    float* dys = shared + TILE * hd;
    float* st_m = shared + 2 * TILE * hd;  // per tile row: largest score, 1 / sum, delta
    float* st_inv = st_m + TILE;
    float* st_delta = st_inv + TILE;
    float k[MAX_HD], v[MAX_HD], dk[MAX_HD], dv[MAX_HD];
    bool live = j < t;
    size_t row = (size_t)b * t + (live ? j : 0);
    for (int d = 0; d < hd; d++) {
        k[d] = to_f32(qkv[row * width + s.k_col(g) + d]);
        v[d] = to_f32(qkv[row * width + s.v_col(g) + d]);
        dk[d] = 0.0f;
        dv[d] = 0.0f;
    }
    int first = blockIdx.x * ROWS;  // the first query row any of this block's keys meets
    for (int head = g * group; head < (g + 1) * group; head++) {
        for (int i0 = first / TILE * TILE; i0 < t; i0 += TILE) {
            __syncthreads();
            load_tile(qs, qkv, b, i0, head * hd, width, s);
            load_tile(dys, dout, b, i0, head * hd, h * hd, s);
            for (int r = threadIdx.x; r < TILE; r += blockDim.x) {
                if (i0 + r < t) {
                    size_t at = ((size_t)b * h + head) * t + i0 + r;
                    st_m[r] = stats[2 * at];
                    st_inv[r] = stats[2 * at + 1];
                    st_delta[r] = delta[at];
                }
            }
            __syncthreads();
            if (!live) continue;
            for (int r = 0; r < TILE && i0 + r < t; r++) {
                if (i0 + r < j) continue;
                float dot = 0.0f, dp = 0.0f;
                for (int d = 0; d < hd; d++) {
                    dot += qs[r * hd + d] * k[d];
                    dp += dys[r * hd + d] * v[d];
                }
                float p = expf(dot * scale - st_m[r]) * st_inv[r];
                float ds = p * (dp - st_delta[r]);
                for (int d = 0; d < hd; d++) {
                    dv[d] += p * dys[r * hd + d];
                    dk[d] += ds * qs[r * hd + d];
                }
            }
        }
    }
    if (!live) return;
    for (int d = 0; d < hd; d++) {
        dqkv[row * width + s.k_col(g) + d] = from_f32<T>(dk[d] * scale);
        dqkv[row * width + s.v_col(g) + d] = from_f32<T>(dv[d]);
    }
}
extern "C" __global__ void attention_backward_dkv(float* dqkv, const float* dout, const float* qkv,
                                                  const float* stats, const float* delta, int t,
                                                  int h, int kv, int hd, float scale) {
    attention_backward_dkv_t(dqkv, dout, qkv, stats, delta, t, h, kv, hd, scale);
}
extern "C" __global__ void attention_backward_dkv_bf16(bf16* dqkv, const bf16* dout,
                                                       const bf16* qkv, const float* stats,
                                                       const float* delta, int t, int h, int kv,
                                                       int hd, float scale) {
    attention_backward_dkv_t(dqkv, dout, qkv, stats, delta, t, h, kv, hd, scale);
}
