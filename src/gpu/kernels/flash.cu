// Causal attention on the tensor cores, bf16 operands and f32 sums: flash attention in
// FlashAttention-2's order, forward and backward. In the forward a warp owns 16 query rows of
// one (sequence, head); keys and values stream through shared memory FLASH_KEYS at a time; the
// scores, the online softmax and the output stay in registers. It keeps the softmax statistics
// [B, H, T, 2] of attention.cu's kernels, from which backward recomputes the probabilities: dq
// by query rows, dk and dv by key rows (summed over each kv head's group), so without atomics.
// The softmax's sums are taken of the f32 probabilities; the products take the probabilities
// and their gradients rounded to bf16.
//
// The tensor cores run mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"): with
// g = lane / 4 and q = lane % 4, a lane holds of A (16 x 16, row-major) rows g and g + 8 at
// columns 2q, 2q + 1 and 2q + 8, 2q + 9 (registers: row g low columns, row g + 8 low, row g
// high, row g + 8 high); of B (16 x 8) column g at rows 2q, 2q + 1 and 2q + 8, 2q + 9; of C
// rows g and g + 8 at columns 2q, 2q + 1. Two bf16 share a register, the lower column (or
// row) in the low half. The emulator runs the same product through warp shuffles
// (mma_shuffled); mma_check holds the two to each other on a GPU.

#define FLASH_WARPS 4
#define FLASH_ROWS (16 * FLASH_WARPS)
#define FLASH_KEYS 64
#define FLASH_MAX_HD 128

__device__ inline float low_f32(unsigned int x) { return __uint_as_float(x << 16); }
__device__ inline float high_f32(unsigned int x) { return __uint_as_float(x & 0xffff0000u); }
__device__ inline unsigned int pack_bf16(float lo, float hi) {
    return (unsigned int)from_f32<bf16>(lo).bits | ((unsigned int)from_f32<bf16>(hi).bits << 16);
}

// d = a * b + c for one warp's fragments, through shuffles: lane (g, q) fetches the A values
// of its rows and the B values of its columns from the lanes that hold them.
__device__ void mma_shuffled(float* d, const unsigned int* a, const unsigned int* b,
                             const float* c) {
    int lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3;
    float acc[4] = {c[0], c[1], c[2], c[3]};
    for (int k = 0; k < 16; k += 2) {
        int high = k >= 8, holder = (k % 8) / 2;
        unsigned int a_lo = __shfl_sync(0xffffffffu, high ? a[2] : a[0], g * 4 + holder);
        unsigned int a_hi = __shfl_sync(0xffffffffu, high ? a[3] : a[1], g * 4 + holder);
        unsigned int b0 = __shfl_sync(0xffffffffu, high ? b[1] : b[0], (2 * q) * 4 + holder);
        unsigned int b1 = __shfl_sync(0xffffffffu, high ? b[1] : b[0], (2 * q + 1) * 4 + holder);
        acc[0] += low_f32(a_lo) * low_f32(b0) + high_f32(a_lo) * high_f32(b0);
        acc[1] += low_f32(a_lo) * low_f32(b1) + high_f32(a_lo) * high_f32(b1);
        acc[2] += low_f32(a_hi) * low_f32(b0) + high_f32(a_hi) * high_f32(b0);
        acc[3] += low_f32(a_hi) * low_f32(b1) + high_f32(a_hi) * high_f32(b1);
    }
    for (int i = 0; i < 4; i++) d[i] = acc[i];
}

#ifndef ATTNRES_EMULATOR
// d = a * b + c on the tensor cores.
__device__ inline void mma_tensor(float* d, const unsigned int* a, const unsigned int* b,
                                  const float* c) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%10, %11, %12, %13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
          "f"(c[2]), "f"(c[3]));
}
#define mma_bf16 mma_tensor
#else
#define mma_bf16 mma_shuffled
#endif

// Two adjacent bf16 at `p` (an even offset of a 4-byte aligned buffer) as one register.
__device__ inline unsigned int pair_at(const bf16* p) { return *(const unsigned int*)p; }

// Forward: out[B*T, H*hd] and stats. Grid (ceil(T / FLASH_ROWS), B*H), 32 * FLASH_WARPS
// threads; hd a multiple of 16 up to FLASH_MAX_HD.
extern "C" __global__ void flash_forward_bf16(bf16* out, float* stats, const bf16* qkv, int t,
                                              int h, int kv, int hd, float scale) {
    __shared__ unsigned int keys[FLASH_KEYS * FLASH_MAX_HD / 2];  // [key][hd / 2] pairs
    __shared__ bf16 values[FLASH_KEYS * FLASH_MAX_HD];            // [key][hd]
    int b = blockIdx.y / h, head = blockIdx.y % h, group = head / (h / kv);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3;
    int width = (h + 2 * kv) * hd, chunks = hd / 16, pairs = hd / 2;
    int q0 = blockIdx.x * FLASH_ROWS + warp * 16;
    // The warp's queries as A fragments, one per 16 columns of the head.
    unsigned int qa[FLASH_MAX_HD / 16][4];
    for (int c = 0; c < chunks; c++) {
        for (int r = 0; r < 4; r++) {
            int row = q0 + g + 8 * (r & 1), col = c * 16 + 2 * q + 8 * (r >> 1);
            qa[c][r] = row < t ? pair_at(qkv + ((size_t)b * t + row) * width + head * hd + col) : 0u;
        }
    }
    float o[FLASH_MAX_HD / 8][4];
    for (int n = 0; n < hd / 8; n++)
        for (int i = 0; i < 4; i++) o[n][i] = 0.0f;
    // Per row (g, g + 8): the largest scaled score so far and this lane's share of the sum.
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    int last = (int)(blockIdx.x + 1) * FLASH_ROWS;  // keys this block's rows see: below it
    if (last > t) last = t;
    for (int k0 = 0; k0 < last; k0 += FLASH_KEYS) {
        __syncthreads();
        for (int e = threadIdx.x; e < FLASH_KEYS * pairs; e += blockDim.x) {
            int key = e / pairs, p = e % pairs;
            unsigned int kk = 0u, vv = 0u;
            if (k0 + key < t) {
                const bf16* row = qkv + ((size_t)b * t + k0 + key) * width;
                kk = pair_at(row + (h + group) * hd + 2 * p);
                vv = pair_at(row + (h + kv + group) * hd + 2 * p);
            }
            keys[key * pairs + p] = kk;
            values[key * hd + 2 * p] = bf16{(unsigned short)(vv & 0xffffu)};
            values[key * hd + 2 * p + 1] = bf16{(unsigned short)(vv >> 16)};
        }
        __syncthreads();
        if (k0 > q0 + 15) continue;  // every key of the tile is after the warp's rows
        // Scores of the warp's 16 rows against the tile's keys, 8 keys per fragment.
        float s[FLASH_KEYS / 8][4];
        for (int n = 0; n < FLASH_KEYS / 8; n++) {
            for (int i = 0; i < 4; i++) s[n][i] = 0.0f;
            int key = n * 8 + g;
            for (int c = 0; c < chunks; c++) {
                unsigned int kb[2] = {keys[key * pairs + c * 8 + q], keys[key * pairs + c * 8 + q + 4]};
                mma_bf16(s[n], qa[c], kb, s[n]);
            }
        }
        for (int r = 0; r < 2; r++) {
            int row = q0 + g + 8 * r;
            float mx = NEG_INF;
            for (int n = 0; n < FLASH_KEYS / 8; n++) {
                for (int j = 0; j < 2; j++) {
                    int key = k0 + n * 8 + 2 * q + j;
                    float v = key <= row && key < t ? s[n][2 * r + j] * scale : NEG_INF;
                    s[n][2 * r + j] = v;
                    mx = fmaxf(mx, v);
                }
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            float m_new = fmaxf(m[r], mx);
            // A row that has seen no key yet (one past the sequence) keeps zeros.
            float base = m_new == NEG_INF ? 0.0f : m_new;
            float keep = expf(m[r] - base);
            l[r] *= keep;
            for (int n = 0; n < hd / 8; n++) {
                o[n][2 * r] *= keep;
                o[n][2 * r + 1] *= keep;
            }
            for (int n = 0; n < FLASH_KEYS / 8; n++) {
                for (int j = 0; j < 2; j++) {
                    float p = expf(s[n][2 * r + j] - base);
                    s[n][2 * r + j] = p;
                    l[r] += p;
                }
            }
            m[r] = m_new;
        }
        // out += P V: the probabilities, as the scores' fragments left them, are A fragments.
        for (int j = 0; j < FLASH_KEYS / 16; j++) {
            unsigned int pa[4] = {pack_bf16(s[2 * j][0], s[2 * j][1]), pack_bf16(s[2 * j][2], s[2 * j][3]),
                                  pack_bf16(s[2 * j + 1][0], s[2 * j + 1][1]),
                                  pack_bf16(s[2 * j + 1][2], s[2 * j + 1][3])};
            int key = j * 16 + 2 * q;
            for (int n = 0; n < hd / 8; n++) {
                int col = n * 8 + g;
                unsigned int vb[2] = {
                    (unsigned int)values[key * hd + col].bits | ((unsigned int)values[(key + 1) * hd + col].bits << 16),
                    (unsigned int)values[(key + 8) * hd + col].bits | ((unsigned int)values[(key + 9) * hd + col].bits << 16)};
                mma_bf16(o[n], pa, vb, o[n]);
            }
        }
    }
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        int row = q0 + g + 8 * r;
        if (row >= t) continue;
        float inv = 1.0f / l[r];
        bf16* dst = out + ((size_t)b * t + row) * h * hd + head * hd;
        for (int n = 0; n < hd / 8; n++) {
            dst[n * 8 + 2 * q] = from_f32<bf16>(o[n][2 * r] * inv);
            dst[n * 8 + 2 * q + 1] = from_f32<bf16>(o[n][2 * r + 1] * inv);
        }
        if (q == 0) {
            size_t at = (((size_t)b * h + head) * t + row) * 2;
            stats[at] = m[r];
            stats[at + 1] = inv;
        }
    }
}

// One warp: d[16 x 8] = a[16 x 16] b[16 x 8] (row-major bf16) through the fragments, on the
// tensor cores into `tensor` and through mma_shuffled into `shuffled` (both through the
// emulation where there is no GPU).
extern "C" __global__ void mma_check(float* tensor, float* shuffled, const bf16* a, const bf16* b) {
    int lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3;
    unsigned int fa[4], fb[2];
    for (int r = 0; r < 4; r++) fa[r] = pair_at(a + (g + 8 * (r & 1)) * 16 + 2 * q + 8 * (r >> 1));
    for (int r = 0; r < 2; r++) {
        int k = 2 * q + 8 * r;
        fb[r] = (unsigned int)b[k * 8 + g].bits | ((unsigned int)b[(k + 1) * 8 + g].bits << 16);
    }
    float zero[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d1[4], d2[4];
    mma_bf16(d1, fa, fb, zero);
    mma_shuffled(d2, fa, fb, zero);
    for (int i = 0; i < 4; i++) {
        int at = (g + 8 * (i >> 1)) * 8 + 2 * q + (i & 1);
        tensor[at] = d1[i];
        shuffled[at] = d2[i];
    }
}

// Value d of row `row` of a tile held as bf16 pairs ([row][hd / 2]).
__device__ inline unsigned int elem(const unsigned int* tile, int row, int d, int pairs) {
    unsigned int p = tile[row * pairs + d / 2];
    return d % 2 ? p >> 16 : p & 0xffffu;
}

// The B fragment of a product whose k runs over the tile's rows (keys or queries) and whose
// n is value d = column `col` of the tile: rows 2q, 2q + 1 and 2q + 8, 2q + 9 from `r0`.
__device__ inline void b_across_rows(unsigned int* fb, const unsigned int* tile, int r0, int col,
                                     int pairs) {
    int q = (threadIdx.x % 32) & 3;
    fb[0] = elem(tile, r0 + 2 * q, col, pairs) | (elem(tile, r0 + 2 * q + 1, col, pairs) << 16);
    fb[1] = elem(tile, r0 + 2 * q + 8, col, pairs) | (elem(tile, r0 + 2 * q + 9, col, pairs) << 16);
}

// A fragments of a warp's 16 rows from `r0` of head columns `col0..col0 + hd` of a
// [B*T, width] buffer (zeros past the sequence).
__device__ inline void a_rows(unsigned int (*fa)[4], const bf16* src, int b, int r0, int col0,
                              int width, int t, int hd) {
    int lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3;
    for (int c = 0; c < hd / 16; c++) {
        for (int r = 0; r < 4; r++) {
            int row = r0 + g + 8 * (r & 1), col = c * 16 + 2 * q + 8 * (r >> 1);
            fa[c][r] = row < t ? pair_at(src + ((size_t)b * t + row) * width + col0 + col) : 0u;
        }
    }
}

// Rows r0.. of columns col0..col0 + hd of a [B*T, width] buffer into a tile of pairs (zeros
// past the sequence).
__device__ inline void load_pairs(unsigned int* tile, const bf16* src, int b, int r0, int col0,
                                  int width, int t, int hd, int rows) {
    int pairs = hd / 2;
    for (int e = threadIdx.x; e < rows * pairs; e += blockDim.x) {
        int r = e / pairs, p = e % pairs;
        tile[e] = r0 + r < t ? pair_at(src + ((size_t)b * t + r0 + r) * width + col0 + 2 * p) : 0u;
    }
}

// The product of a warp's A fragments (16 rows, hd columns) with the tile's rows n0.. (as B:
// k over the head's values, n over 8 tile rows per fragment): 16 x FLASH_KEYS scores.
__device__ inline void scores(float (*s)[4], unsigned int (*fa)[4], const unsigned int* tile,
                              int hd) {
    int lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3, pairs = hd / 2;
    for (int n = 0; n < FLASH_KEYS / 8; n++) {
        for (int i = 0; i < 4; i++) s[n][i] = 0.0f;
        int row = n * 8 + g;
        for (int c = 0; c < hd / 16; c++) {
            unsigned int fb[2] = {tile[row * pairs + c * 8 + q], tile[row * pairs + c * 8 + q + 4]};
            mma_bf16(s[n], fa[c], fb, s[n]);
        }
    }
}

// acc[hd / 8][4] += x * tile, x (16 x FLASH_KEYS, as the scores' fragments hold it) rounded
// to bf16, the tile's rows as k.
__device__ inline void times_tile(float (*acc)[4], float (*x)[4], const unsigned int* tile,
                                  int hd) {
    int g = (threadIdx.x % 32) >> 2;
    for (int j = 0; j < FLASH_KEYS / 16; j++) {
        unsigned int fa[4] = {pack_bf16(x[2 * j][0], x[2 * j][1]), pack_bf16(x[2 * j][2], x[2 * j][3]),
                              pack_bf16(x[2 * j + 1][0], x[2 * j + 1][1]),
                              pack_bf16(x[2 * j + 1][2], x[2 * j + 1][3])};
        for (int n = 0; n < hd / 8; n++) {
            unsigned int fb[2];
            b_across_rows(fb, tile, j * 16, n * 8 + g, hd / 2);
            mma_bf16(acc[n], fa, fb, acc[n]);
        }
    }
}

// Backward to the queries: the q columns of dqkv, from dout, the forward's statistics and
// delta = <dout, out> (attention_backward_delta). Grid and block as the forward.
extern "C" __global__ void flash_backward_dq_bf16(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                                  const float* stats, const float* delta, int t,
                                                  int h, int kv, int hd, float scale) {
    __shared__ unsigned int keys[FLASH_KEYS * FLASH_MAX_HD / 2];
    __shared__ unsigned int vals[FLASH_KEYS * FLASH_MAX_HD / 2];
    int b = blockIdx.y / h, head = blockIdx.y % h, group = head / (h / kv);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3;
    int width = (h + 2 * kv) * hd;
    int q0 = blockIdx.x * FLASH_ROWS + warp * 16;
    unsigned int qa[FLASH_MAX_HD / 16][4], da[FLASH_MAX_HD / 16][4];
    a_rows(qa, qkv, b, q0, head * hd, width, t, hd);
    a_rows(da, dout, b, q0, head * hd, h * hd, t, hd);
    float m[2], inv[2], dl[2];
    for (int r = 0; r < 2; r++) {
        int row = q0 + g + 8 * r;
        size_t at = ((size_t)b * h + head) * t + (row < t ? row : 0);
        m[r] = stats[2 * at];
        inv[r] = stats[2 * at + 1];
        dl[r] = delta[at];
    }
    float dq[FLASH_MAX_HD / 8][4];
    for (int n = 0; n < hd / 8; n++)
        for (int i = 0; i < 4; i++) dq[n][i] = 0.0f;
    int last = (int)(blockIdx.x + 1) * FLASH_ROWS;
    if (last > t) last = t;
    for (int k0 = 0; k0 < last; k0 += FLASH_KEYS) {
        __syncthreads();
        load_pairs(keys, qkv, b, k0, (h + group) * hd, width, t, hd, FLASH_KEYS);
        load_pairs(vals, qkv, b, k0, (h + kv + group) * hd, width, t, hd, FLASH_KEYS);
        __syncthreads();
        if (k0 > q0 + 15) continue;
        float s[FLASH_KEYS / 8][4], dp[FLASH_KEYS / 8][4];
        scores(s, qa, keys, hd);
        scores(dp, da, vals, hd);
        for (int n = 0; n < FLASH_KEYS / 8; n++) {
            for (int i = 0; i < 4; i++) {
                int row = q0 + g + 8 * (i >> 1), key = k0 + n * 8 + 2 * q + (i & 1);
                int r = i >> 1;
                float p = key <= row && row < t ? expf(s[n][i] * scale - m[r]) * inv[r] : 0.0f;
                s[n][i] = p * (dp[n][i] - dl[r]);
            }
        }
        times_tile(dq, s, keys, hd);
    }
    for (int r = 0; r < 2; r++) {
        int row = q0 + g + 8 * r;
        if (row >= t) continue;
        bf16* dst = dqkv + ((size_t)b * t + row) * width + head * hd;
        for (int n = 0; n < hd / 8; n++) {
            dst[n * 8 + 2 * q] = from_f32<bf16>(dq[n][2 * r] * scale);
            dst[n * 8 + 2 * q + 1] = from_f32<bf16>(dq[n][2 * r + 1] * scale);
        }
    }
}

// Backward to the keys and values: their columns of dqkv, summed over the query heads of each
// kv head's group. Grid (ceil(T / FLASH_ROWS), B*KV), 32 * FLASH_WARPS threads; a warp owns 16
// keys.
extern "C" __global__ void flash_backward_dkv_bf16(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                                   const float* stats, const float* delta, int t,
                                                   int h, int kv, int hd, float scale) {
    __shared__ unsigned int qs[FLASH_KEYS * FLASH_MAX_HD / 2];
    __shared__ unsigned int dys[FLASH_KEYS * FLASH_MAX_HD / 2];
    __shared__ float st_m[FLASH_KEYS], st_inv[FLASH_KEYS], st_delta[FLASH_KEYS];
    int b = blockIdx.y / kv, group = blockIdx.y % kv, heads = h / kv;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3;
    int width = (h + 2 * kv) * hd;
    int j0 = blockIdx.x * FLASH_ROWS + warp * 16;
    unsigned int ka[FLASH_MAX_HD / 16][4], va[FLASH_MAX_HD / 16][4];
    a_rows(ka, qkv, b, j0, (h + group) * hd, width, t, hd);
    a_rows(va, qkv, b, j0, (h + kv + group) * hd, width, t, hd);
    float dk[FLASH_MAX_HD / 8][4], dv[FLASH_MAX_HD / 8][4];
    for (int n = 0; n < hd / 8; n++)
        for (int i = 0; i < 4; i++) dk[n][i] = dv[n][i] = 0.0f;
    int first = blockIdx.x * FLASH_ROWS;  // the first query any of this block's keys meets
    for (int head = group * heads; head < (group + 1) * heads; head++) {
        for (int i0 = first / FLASH_KEYS * FLASH_KEYS; i0 < t; i0 += FLASH_KEYS) {
            __syncthreads();
            load_pairs(qs, qkv, b, i0, head * hd, width, t, hd, FLASH_KEYS);
            load_pairs(dys, dout, b, i0, head * hd, h * hd, t, hd, FLASH_KEYS);
            for (int r = threadIdx.x; r < FLASH_KEYS; r += blockDim.x) {
                size_t at = ((size_t)b * h + head) * t + (i0 + r < t ? i0 + r : 0);
                st_m[r] = stats[2 * at];
                st_inv[r] = stats[2 * at + 1];
                st_delta[r] = delta[at];
            }
            __syncthreads();
            if (i0 + FLASH_KEYS <= j0) continue;  // every query of the tile is before the keys
            float s[FLASH_KEYS / 8][4], dp[FLASH_KEYS / 8][4];
            scores(s, ka, qs, hd);
            scores(dp, va, dys, hd);
            for (int n = 0; n < FLASH_KEYS / 8; n++) {
                for (int i = 0; i < 4; i++) {
                    int key = j0 + g + 8 * (i >> 1), r = n * 8 + 2 * q + (i & 1), row = i0 + r;
                    bool seen = key <= row && row < t && key < t;
                    float p = seen ? expf(s[n][i] * scale - st_m[r]) * st_inv[r] : 0.0f;
                    s[n][i] = p;
                    dp[n][i] = p * (dp[n][i] - st_delta[r]);
                }
            }
            times_tile(dv, s, dys, hd);
            times_tile(dk, dp, qs, hd);
        }
    }
    for (int r = 0; r < 2; r++) {
        int key = j0 + g + 8 * r;
        if (key >= t) continue;
        bf16* row = dqkv + ((size_t)b * t + key) * width;
        for (int n = 0; n < hd / 8; n++) {
            for (int j = 0; j < 2; j++) {
                int col = n * 8 + 2 * q + j;
                row[(h + group) * hd + col] = from_f32<bf16>(dk[n][2 * r + j] * scale);
                row[(h + kv + group) * hd + col] = from_f32<bf16>(dv[n][2 * r + j]);
            }
        }
    }
}
