// Causal attention on the tensor cores, bf16 operands and f32 sums: flash attention in
// FlashAttention-2's order, forward and backward. In the forward a warp owns 32 query rows of
// one (sequence, head) (16 for heads of more than 64 values); keys and values stream through
// shared memory FLASH_KEYS at a time; the scores, the online softmax and the output stay in
// registers. It keeps the softmax statistics [B, H, T, 2] of attention.cu's kernels, from
// which backward recomputes the probabilities: dq by query rows, dk and dv by key rows (summed
// over each kv head's group), so without atomics.
// The softmax's sums are taken of the f32 probabilities; the products take the probabilities
// and their gradients rounded to bf16. The tensor cores leave the other instructions little
// room, so the softmax is lean: base 2, a probability one fused multiply-add and one exp2; the
// causal mask applied only to tiles that cross the diagonal or the sequence's end; bf16 pairs
// rounded by one conversion.
//
// The head size HD is a template parameter, instantiated for the sizes FLASH_HEADS lists in
// src/gpu/attention.rs (kernels NAME_hdHD): every loop over a head's fragments then unrolls, so
// the fragments stay in registers (a loop bound known only at run time would put them in local
// memory). `attnres device --compile-for sm_90` shows each kernel's registers.
//
// The tensor cores run mma.m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"): with
// g = lane / 4 and q = lane % 4, a lane holds of A (16 x 16, row-major) rows g and g + 8 at
// columns 2q, 2q + 1 and 2q + 8, 2q + 9 (registers: row g low columns, row g + 8 low, row g
// high, row g + 8 high); of B (16 x 8) column g at rows 2q, 2q + 1 and 2q + 8, 2q + 9; of C
// rows g and g + 8 at columns 2q, 2q + 1. Two bf16 share a register, the lower column (or
// row) in the low half. The emulator runs the same product through warp shuffles
// (mma_shuffled); mma_check holds the two to each other on a GPU. Fragments come from shared
// memory through ldmatrix, which the emulator reads word by word (fragment_check).

// Warps a block; the rows a block of the backward owns, 16 a warp (the forward's warps may own
// more: ForwardTiles).
#define FLASH_WARPS 4
#define FLASH_ROWS (16 * FLASH_WARPS)
#define FLASH_KEYS 64

__device__ inline float low_f32(unsigned int x) { return __uint_as_float(x << 16); }
__device__ inline float high_f32(unsigned int x) { return __uint_as_float(x & 0xffff0000u); }
// 2^x in one instruction (ex2.approx.ftz: relative error below 2^-22, results below 2^-126
// flushed to zero), where expf takes several. The softmax runs in base 2, its scores scaled by
// scale * log2(e), so that each probability is one fused multiply-add and one exp2.
#define LOG2E 1.4426950408889634f
__device__ inline float exp2_approx(float x) {
#ifndef ATTNRES_EMULATOR
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
#else
    return exp2f(x);
#endif
}

// The base-2 exponent that turns a row's raw score s into its probability, p =
// exp2(s * scale * log2(e) + bias), from the forward's statistics (largest scaled score m,
// 1 / sum inv): minus infinity (p = 0) for a row past the sequence.
__device__ inline float softmax_bias(float m, float inv, bool in_sequence) {
    return in_sequence ? log2f(inv) - m * LOG2E : NEG_INF;
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

// A tile of ROWS rows of a head (HD bf16 values each) in shared memory, as pairs. A row takes
// HD / 2 + 4 words: with that stride the fragment reads below (8 rows by 4 words, or 4 rows by
// 8 columns) fall in 32 different banks.
template <int HD, int ROWS = FLASH_KEYS> struct Tile {
    static constexpr int PAIRS = HD / 2, STRIDE = HD / 2 + 4, WORDS = ROWS * STRIDE;
};

// Rows r0.. of columns col0..col0 + HD of a [B*T, width] buffer into a tile of ROWS rows (zeros
// past the sequence), 16 bytes a load.
template <int HD, int ROWS = FLASH_KEYS>
__device__ inline void load_tile(unsigned int* tile, const bf16* src, int b, int r0, int col0,
                                 int width, int t) {
    constexpr int QUADS = HD / 8;
    for (int e = threadIdx.x; e < ROWS * QUADS; e += blockDim.x) {
        int r = e / QUADS, k = e % QUADS;
        Quad v = {{0u, 0u, 0u, 0u}};
        if (r0 + r < t) v = quad_at(src + ((size_t)b * t + r0 + r) * width + col0 + 8 * k);
        quad_store(tile + r * Tile<HD>::STRIDE + 4 * k, v);
    }
}

// A fragments of a warp's 16 rows from `r0` of head columns `col0..col0 + HD` of a
// [B*T, width] buffer (zeros past the sequence).
template <int HD>
__device__ inline void a_rows(unsigned int (*fa)[4], const bf16* src, int b, int r0, int col0,
                              int width, int t) {
    int lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int c = 0; c < HD / 16; c++) {
#pragma unroll
        for (int r = 0; r < 4; r++) {
            int row = r0 + g + 8 * (r & 1), col = c * 16 + 2 * q + 8 * (r >> 1);
            fa[c][r] = row < t ? pair_at(src + ((size_t)b * t + row) * width + col0 + col) : 0u;
        }
    }
}

#ifndef ATTNRES_EMULATOR
// Four 8x8 matrices of bf16 from shared memory in one instruction (PTX ISA, "ldmatrix"): lane
// l gives the address of row l % 8 of matrix l / 8 (16-byte aligned); each lane receives in
// r[i] row g of matrix i at columns 2q, 2q + 1 or, with TRANS, column g at rows 2q, 2q + 1:
// an mma fragment of the matrix or of its transpose.
template <bool TRANS> __device__ inline void ldmatrix_x4(unsigned int* r, const unsigned int* row) {
    unsigned int at = (unsigned int)__cvta_generic_to_shared(row);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(at));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(at));
}
#endif

// Value d of row `row` of a tile.
template <int HD> __device__ inline unsigned int elem(const unsigned int* tile, int row, int d) {
    unsigned int p = tile[row * Tile<HD>::STRIDE + d / 2];
    return d % 2 ? p >> 16 : p & 0xffffu;
}

// B fragments of two products against 16 tile rows from r0, the rows as n (8 a product) and
// head columns 16c .. 16c + 15 as k: b[0], b[1] for rows r0 .. r0 + 7 (row g at columns 2q,
// 2q + 1 and 2q + 8, 2q + 9), b[2], b[3] for rows r0 + 8 ... The emulator reads what each lane
// receives; a GPU loads it with ldmatrix (the_fragments_load_as_emulated checks both agree).
template <int HD>
__device__ inline void row_fragments(unsigned int* b, const unsigned int* tile, int r0, int c) {
    int lane = threadIdx.x % 32;
    // ldmatrix's matrix i: rows r0 + 8 (i / 2) .., columns 16c + 8 (i % 2) ...
    int i = lane / 8;
    const unsigned int* address = tile + (r0 + 8 * (i / 2) + lane % 8) * Tile<HD>::STRIDE + 8 * c + 4 * (i % 2);
#ifndef ATTNRES_EMULATOR
    ldmatrix_x4<false>(b, address);
#else
    emu::check_aligned16(address);
    int g = lane >> 2, q = lane & 3;
    for (int i = 0; i < 4; i++) b[i] = tile[(r0 + 8 * (i / 2) + g) * Tile<HD>::STRIDE + 8 * c + 4 * (i % 2) + q];
#endif
}

// B fragments of two products whose k is 16 tile rows from r0 and whose n is head columns
// n0 .. n0 + 15 (8 a product): b[0], b[1] for columns n0 .. n0 + 7 (column g at rows 2q,
// 2q + 1 and 2q + 8, 2q + 9), b[2], b[3] for columns n0 + 8 ...
template <int HD>
__device__ inline void column_fragments(unsigned int* b, const unsigned int* tile, int r0, int n0) {
    int lane = threadIdx.x % 32;
    // ldmatrix's matrix i: rows r0 + 8 (i % 2) .., columns n0 + 8 (i / 2) .., transposed.
    int i = lane / 8;
    const unsigned int* address = tile + (r0 + 8 * (i % 2) + lane % 8) * Tile<HD>::STRIDE + (n0 + 8 * (i / 2)) / 2;
#ifndef ATTNRES_EMULATOR
    ldmatrix_x4<true>(b, address);
#else
    emu::check_aligned16(address);
    int g = lane >> 2, q = lane & 3;
    for (int i = 0; i < 4; i++) {
        int row = r0 + 8 * (i % 2) + 2 * q, col = n0 + 8 * (i / 2) + g;
        b[i] = elem<HD>(tile, row, col) | (elem<HD>(tile, row + 1, col) << 16);
    }
#endif
}

// The A fragment of 16 tile rows from r0 at head columns 16c .. 16c + 15: rows g and g + 8 at
// columns 2q, 2q + 1 and 2q + 8, 2q + 9, in mma's register order.
template <int HD>
__device__ inline void a_fragment(unsigned int* a, const unsigned int* tile, int r0, int c) {
    int lane = threadIdx.x % 32;
    // ldmatrix's matrix i: rows r0 + 8 (i % 2) .., columns 16c + 8 (i / 2) ...
    int i = lane / 8;
    const unsigned int* address = tile + (r0 + 8 * (i % 2) + lane % 8) * Tile<HD>::STRIDE + 8 * c + 4 * (i / 2);
#ifndef ATTNRES_EMULATOR
    ldmatrix_x4<false>(a, address);
#else
    emu::check_aligned16(address);
    int g = lane >> 2, q = lane & 3;
    for (int i = 0; i < 4; i++) a[i] = tile[(r0 + 8 * (i % 2) + g) * Tile<HD>::STRIDE + 8 * c + 4 * (i / 2) + q];
#endif
}

// The product of a warp's A operand (M tiles of 16 rows, HD columns) with the tile's ROWS rows
// (as B: k over the head's values, n over 8 tile rows per fragment): M x 16 x ROWS scores.
// The A operand is the fragments `fa` or, with `a_tile`, that tile's rows a_r0 ... Each B
// fragment loaded serves the M row tiles.
template <int HD, int ROWS = FLASH_KEYS, int M = 1>
__device__ inline void scores(float (*s)[ROWS / 8][4], const unsigned int (*fa)[HD / 16][4],
                              const unsigned int* tile, const unsigned int* a_tile = nullptr,
                              int a_r0 = 0) {
#pragma unroll
    for (int m = 0; m < M; m++)
#pragma unroll
        for (int n = 0; n < ROWS / 8; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) s[m][n][i] = 0.0f;
#pragma unroll
    for (int n = 0; n < ROWS / 8; n += 2) {
#pragma unroll
        for (int c = 0; c < HD / 16; c++) {
            unsigned int fb[4];
            row_fragments<HD>(fb, tile, n * 8, c);
#pragma unroll
            for (int m = 0; m < M; m++) {
                unsigned int a[4];
                if (a_tile) {
                    a_fragment<HD>(a, a_tile, a_r0 + 16 * m, c);
                } else {
#pragma unroll
                    for (int i = 0; i < 4; i++) a[i] = fa[m][c][i];
                }
                mma_bf16(s[m][n], a, fb, s[m][n]);
                mma_bf16(s[m][n + 1], a, fb + 2, s[m][n + 1]);
            }
        }
    }
}

// acc[m][HD / 8][4] += x[m] * tile for each of M row tiles, x (16 x ROWS a tile, as the
// scores' fragments hold it) rounded to bf16, the tile's rows as k. Each B fragment loaded
// serves the M row tiles.
template <int HD, int ROWS = FLASH_KEYS, int M = 1>
__device__ inline void times_tile(float (*acc)[HD / 8][4], float (*x)[ROWS / 8][4],
                                  const unsigned int* tile) {
#pragma unroll
    for (int j = 0; j < ROWS / 16; j++) {
        unsigned int fa[M][4];
#pragma unroll
        for (int m = 0; m < M; m++) {
            fa[m][0] = pack_bf16(x[m][2 * j][0], x[m][2 * j][1]);
            fa[m][1] = pack_bf16(x[m][2 * j][2], x[m][2 * j][3]);
            fa[m][2] = pack_bf16(x[m][2 * j + 1][0], x[m][2 * j + 1][1]);
            fa[m][3] = pack_bf16(x[m][2 * j + 1][2], x[m][2 * j + 1][3]);
        }
#pragma unroll
        for (int n = 0; n < HD / 8; n += 2) {
            unsigned int fb[4];
            column_fragments<HD>(fb, tile, j * 16, n * 8);
#pragma unroll
            for (int m = 0; m < M; m++) {
                mma_bf16(acc[m][n], fa[m], fb, acc[m][n]);
                mma_bf16(acc[m][n + 1], fa[m], fb + 2, acc[m][n + 1]);
            }
        }
    }
}

// One warp: the fragments row_fragments, column_fragments and a_fragment give of the last 16
// columns of a 16 x 32 bf16 tile (HD = 32), each lane's 12 words into out[lane * 12 ..]: on a
// GPU through ldmatrix, which the test holds to mma's fragment layout.
extern "C" __global__ void fragment_check(unsigned int* out, const bf16* tile_values) {
    __shared__ __align__(16) unsigned int tile[16 * Tile<32>::STRIDE];
    int lane = threadIdx.x % 32;
    for (int e = lane; e < 16 * 16; e += 32)
        tile[(e / 16) * Tile<32>::STRIDE + e % 16] = pair_at(tile_values + 2 * e);
    __syncwarp();
    row_fragments<32>(out + lane * 12, tile, 0, 1);
    column_fragments<32>(out + lane * 12 + 4, tile, 0, 16);
    a_fragment<32>(out + lane * 12 + 8, tile, 0, 1);
}

// 16 bytes from global memory into shared memory without passing through registers
// (cp.async), zeros where `valid` is false (then `src` is only a valid address); the copy lands
// after copies_wait and a barrier. The emulator lands it at the wait, not before.
__device__ inline void copy_async16(unsigned int* dst, const bf16* src, bool valid) {
#ifndef ATTNRES_EMULATOR
    unsigned int at = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(at), "l"(src),
                 "r"(valid ? 16 : 0));
#else
    emu::copy_async16(dst, src, valid);
#endif
}

// Closes the group of copies issued since the last call.
__device__ inline void copies_commit() {
#ifndef ATTNRES_EMULATOR
    asm volatile("cp.async.commit_group;\n" ::);
#else
    emu::copies_commit();
#endif
}

// Waits until at most PENDING of the latest groups of copies are still in flight.
template <int PENDING> __device__ inline void copies_wait() {
#ifndef ATTNRES_EMULATOR
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
#else
    emu::copies_wait(PENDING);
#endif
}

// load_tile through cp.async: the copies are issued, and land after copies_wait. The block's
// 32 * FLASH_WARPS threads (every launch of these kernels) share the tile's 16-byte quads,
// thread i taking quads i, i + 32 * FLASH_WARPS, ...: a loop of known length whose divisions
// are by constants, so that each copy costs a few instructions beside the tensor cores' work.
template <int HD, int ROWS>
__device__ inline void load_tile_async(unsigned int* tile, const bf16* src, int b, int r0,
                                       int col0, int width, int t) {
    constexpr int QUADS = HD / 8, THREADS = 32 * FLASH_WARPS, COPIES = ROWS * QUADS;
    int rows_in = t - r0;  // the tile's rows inside the sequence
    if constexpr (THREADS % QUADS == 0 && COPIES % THREADS == 0) {
        // Each thread copies the same quad of rows STEP apart: one address, then a stride.
        constexpr int STEP = THREADS / QUADS;
        int r = threadIdx.x / QUADS, k = threadIdx.x % QUADS;
        const bf16* from = src + ((size_t)b * t + r0 + r) * width + col0 + 8 * k;
        unsigned int* to = tile + r * Tile<HD>::STRIDE + 4 * k;
        size_t stride = (size_t)STEP * width;
#pragma unroll
        for (int i = 0; i < ROWS / STEP; i++) {
            bool valid = r + i * STEP < rows_in;
            copy_async16(to + i * STEP * Tile<HD>::STRIDE, valid ? from + i * stride : src, valid);
        }
    } else {
        const bf16* base = src + ((size_t)b * t + r0) * width + col0;
#pragma unroll
        for (int i = 0; i < (COPIES + THREADS - 1) / THREADS; i++) {
            int e = threadIdx.x + i * THREADS;
            if (COPIES % THREADS != 0 && e >= COPIES) break;
            int r = e / QUADS, k = e % QUADS;
            bool valid = r < rows_in;
            copy_async16(tile + r * Tile<HD>::STRIDE + 4 * k,
                         valid ? base + r * width + 8 * k : src, valid);
        }
    }
}

// Minus infinity for each score of a warp's 16 rows from r0 against the tile's columns from
// c0 (as scores() leaves them) where the key is after the query or past the sequence: the rows
// are queries and the columns keys, or with KEY_ROWS the other way round.
template <int COLUMNS, bool KEY_ROWS = false>
__device__ inline void mask_causal(float (*s)[4], int r0, int c0, int t) {
    int lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int n = 0; n < COLUMNS / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int row = r0 + g + 8 * (i >> 1), column = c0 + n * 8 + 2 * q + (i & 1);
            int key = KEY_ROWS ? row : column, query = KEY_ROWS ? column : row;
            if (key > query || key >= t) s[n][i] = NEG_INF;
        }
}

// Keys per tile of the forward and of dq, whose key and value tiles are double-buffered: 64,
// 32 above 64 values a head (four tiles then fit the 48 KB of static shared memory).
template <int HD> struct KeyTiles {
    static constexpr int KEYS = HD > 64 ? 32 : 64;
};

// Row tiles of 16 queries a warp owns in the forward: two for heads of up to 64 values, so
// that each key and value fragment loaded from shared memory serves two tensor-core products
// (and a block's tiles serve 128 queries), one for longer heads, whose accumulators would not
// fit the registers twice. forward_warp_rows in src/gpu/attention.rs mirrors it.
template <int HD> struct ForwardTiles {
    static constexpr int M = HD <= 64 ? 2 : 1;
};

// Forward: out[B*T, H*HD] and stats. A warp owns M tiles of 16 query rows; grid
// (ceil(T / (16 * M * FLASH_WARPS)), B*H), 32 * FLASH_WARPS threads.
template <int HD, int M>
__device__ void flash_forward_t(bf16* out, float* stats, const bf16* qkv, int t, int h, int kv,
                                float scale) {
    constexpr int KEYS = KeyTiles<HD>::KEYS, WARP_ROWS = 16 * M, ROWS = WARP_ROWS * FLASH_WARPS;
    __shared__ __align__(16) unsigned int keys[2][Tile<HD, KEYS>::WORDS];
    __shared__ __align__(16) unsigned int values[2][Tile<HD, KEYS>::WORDS];
    int b = blockIdx.y / h, head = blockIdx.y % h, group = head / (h / kv);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3;
    int width = (h + 2 * kv) * HD;
    int q0 = blockIdx.x * ROWS + warp * WARP_ROWS;
    // The warp's queries as A fragments: per row tile, one per 16 columns of the head.
    unsigned int qa[M][HD / 16][4];
#pragma unroll
    for (int i = 0; i < M; i++) a_rows<HD>(qa[i], qkv, b, q0 + 16 * i, head * HD, width, t);
    float o[M][HD / 8][4];
#pragma unroll
    for (int i = 0; i < M; i++)
#pragma unroll
        for (int n = 0; n < HD / 8; n++)
#pragma unroll
            for (int j = 0; j < 4; j++) o[i][n][j] = 0.0f;
    // Per row (g, g + 8 of each tile): the largest score so far (unscaled) and this lane's
    // share of the sum.
    float m[M][2], l[M][2];
#pragma unroll
    for (int i = 0; i < M; i++) m[i][0] = m[i][1] = NEG_INF, l[i][0] = l[i][1] = 0.0f;
    float scale2 = scale * LOG2E;
    int last = (int)(blockIdx.x + 1) * ROWS;  // keys this block's rows see: below it
    if (last > t) last = t;
    int kc = (h + group) * HD, vc = (h + kv + group) * HD;
    // The tiles stream through two buffers: the next one's copy runs while this one is used.
    load_tile_async<HD, KEYS>(keys[0], qkv, b, 0, kc, width, t);
    load_tile_async<HD, KEYS>(values[0], qkv, b, 0, vc, width, t);
    copies_commit();
    for (int k0 = 0, cur = 0; k0 < last; k0 += KEYS, cur ^= 1) {
        if (k0 + KEYS < last) {
            load_tile_async<HD, KEYS>(keys[cur ^ 1], qkv, b, k0 + KEYS, kc, width, t);
            load_tile_async<HD, KEYS>(values[cur ^ 1], qkv, b, k0 + KEYS, vc, width, t);
        }
        copies_commit();
        copies_wait<1>();
        __syncthreads();
        // A tile whose every key is after the warp's rows is skipped.
        if (k0 <= q0 + WARP_ROWS - 1) {
            // Scores of the warp's rows against the tile's keys, 8 keys per fragment.
            float s[M][KEYS / 8][4];
            scores<HD, KEYS, M>(s, qa, keys[cur]);
#pragma unroll
            for (int i = 0; i < M; i++) {
                // Only a row tile with a key after one of its rows or past the sequence is
                // masked.
                int r0 = q0 + 16 * i;
                if (k0 + KEYS - 1 > r0 || k0 + KEYS > t) mask_causal<KEYS>(s[i], r0, k0, t);
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    float mx = m[i][r];
#pragma unroll
                    for (int n = 0; n < KEYS / 8; n++)
                        mx = fmaxf(mx, fmaxf(s[i][n][2 * r], s[i][n][2 * r + 1]));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                    // A row that has seen no key yet (one past the sequence) keeps zeros.
                    float base = mx == NEG_INF ? 0.0f : mx * scale2;
                    float keep = exp2_approx(m[i][r] * scale2 - base);
                    l[i][r] *= keep;
#pragma unroll
                    for (int n = 0; n < HD / 8; n++) {
                        o[i][n][2 * r] *= keep;
                        o[i][n][2 * r + 1] *= keep;
                    }
#pragma unroll
                    for (int n = 0; n < KEYS / 8; n++) {
#pragma unroll
                        for (int j = 0; j < 2; j++) {
                            float p = exp2_approx(fmaf(s[i][n][2 * r + j], scale2, -base));
                            s[i][n][2 * r + j] = p;
                            l[i][r] += p;
                        }
                    }
                    m[i][r] = mx;
                }
            }
            // out += P V: the probabilities, as the scores' fragments left them, are A fragments.
            times_tile<HD, KEYS, M>(o, s, values[cur]);
        }
        // Every warp is done with the buffer before the copy two tiles on overwrites it.
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < M; i++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float sum = l[i][r];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            int row = q0 + 16 * i + g + 8 * r;
            if (row >= t) continue;
            float inv = 1.0f / sum;
            bf16* dst = out + ((size_t)b * t + row) * h * HD + head * HD;
#pragma unroll
            for (int n = 0; n < HD / 8; n++) {
                dst[n * 8 + 2 * q] = from_f32<bf16>(o[i][n][2 * r] * inv);
                dst[n * 8 + 2 * q + 1] = from_f32<bf16>(o[i][n][2 * r + 1] * inv);
            }
            if (q == 0) {
                size_t at = (((size_t)b * h + head) * t + row) * 2;
                stats[at] = m[i][r] * scale;
                stats[at + 1] = inv;
            }
        }
    }
}

// Backward to the queries: the q columns of dqkv, from dout, the forward's statistics and
// delta = <dout, out> (attention_backward_delta). Grid (ceil(T / FLASH_ROWS), B*H),
// 32 * FLASH_WARPS threads; a warp owns 16 query rows.
template <int HD>
__device__ void flash_backward_dq_t(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                    const float* stats, const float* delta, int t, int h, int kv,
                                    float scale) {
    constexpr int KEYS = KeyTiles<HD>::KEYS;
    __shared__ __align__(16) unsigned int keys[2][Tile<HD, KEYS>::WORDS];
    __shared__ __align__(16) unsigned int vals[2][Tile<HD, KEYS>::WORDS];
    int b = blockIdx.y / h, head = blockIdx.y % h, group = head / (h / kv);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3;
    int width = (h + 2 * kv) * HD;
    int q0 = blockIdx.x * FLASH_ROWS + warp * 16;
    unsigned int qa[HD / 16][4], da[HD / 16][4];
    a_rows<HD>(qa, qkv, b, q0, head * HD, width, t);
    a_rows<HD>(da, dout, b, q0, head * HD, h * HD, t);
    float bias[2], dl[2], scale2 = scale * LOG2E;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int row = q0 + g + 8 * r;
        size_t at = ((size_t)b * h + head) * t + (row < t ? row : 0);
        bias[r] = softmax_bias(stats[2 * at], stats[2 * at + 1], row < t);
        dl[r] = delta[at];
    }
    float dq[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) dq[n][i] = 0.0f;
    int last = (int)(blockIdx.x + 1) * FLASH_ROWS;
    if (last > t) last = t;
    int kc = (h + group) * HD, vc = (h + kv + group) * HD;
    // Double-buffered tiles, as in the forward.
    load_tile_async<HD, KEYS>(keys[0], qkv, b, 0, kc, width, t);
    load_tile_async<HD, KEYS>(vals[0], qkv, b, 0, vc, width, t);
    copies_commit();
    for (int k0 = 0, cur = 0; k0 < last; k0 += KEYS, cur ^= 1) {
        if (k0 + KEYS < last) {
            load_tile_async<HD, KEYS>(keys[cur ^ 1], qkv, b, k0 + KEYS, kc, width, t);
            load_tile_async<HD, KEYS>(vals[cur ^ 1], qkv, b, k0 + KEYS, vc, width, t);
        }
        copies_commit();
        copies_wait<1>();
        __syncthreads();
        if (k0 <= q0 + 15) {
            float s[KEYS / 8][4], dp[KEYS / 8][4];
            scores<HD, KEYS>(&s, &qa, keys[cur]);
            scores<HD, KEYS>(&dp, &da, vals[cur]);
            if (k0 + KEYS - 1 > q0 || k0 + KEYS > t) mask_causal<KEYS>(s, q0, k0, t);
#pragma unroll
            for (int n = 0; n < KEYS / 8; n++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float p = exp2_approx(fmaf(s[n][i], scale2, bias[i >> 1]));
                    s[n][i] = p * (dp[n][i] - dl[i >> 1]);
                }
            }
            times_tile<HD, KEYS>(&dq, &s, keys[cur]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int row = q0 + g + 8 * r;
        if (row >= t) continue;
        bf16* dst = dqkv + ((size_t)b * t + row) * width + head * HD;
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
            dst[n * 8 + 2 * q] = from_f32<bf16>(dq[n][2 * r] * scale);
            dst[n * 8 + 2 * q + 1] = from_f32<bf16>(dq[n][2 * r + 1] * scale);
        }
    }
}

// Queries per tile of dk/dv, whose query and output-gradient tiles are double-buffered beside
// the block's values: as many as the registers hold without spilling and four tiles the 48 KB
// of static shared memory: 64, 32 for heads of 96 values, 16 for 128.
template <int HD> struct QueryTiles {
    static constexpr int QUERIES = HD <= 64 ? 64 : HD <= 96 ? 32 : 16;
    static_assert(QUERIES <= 32 * FLASH_WARPS, "a thread per query loads the statistics");
};

// Backward to the keys and values: their columns of dqkv, summed over the query heads of each
// kv head's group. Grid (ceil(T / FLASH_ROWS), B*KV), 32 * FLASH_WARPS threads; a warp owns 16
// keys and holds their keys and both gradients in registers (the block's values wait in shared
// memory). Queries and output gradients come QUERIES at a time, for each head of the group in
// turn, through two buffers: the next tile's copy (cp.async) and its statistics (loaded into
// registers) are under way while this tile is used.
template <int HD>
__device__ void flash_backward_dkv_t(bf16* dqkv, const bf16* dout, const bf16* qkv,
                                     const float* stats, const float* delta, int t, int h, int kv,
                                     float scale) {
    constexpr int QUERIES = QueryTiles<HD>::QUERIES;
    __shared__ __align__(16) unsigned int qs[2][Tile<HD, QUERIES>::WORDS];
    __shared__ __align__(16) unsigned int dys[2][Tile<HD, QUERIES>::WORDS];
    __shared__ __align__(16) unsigned int vs[Tile<HD, FLASH_ROWS>::WORDS];
    __shared__ float st_bias[2][QUERIES], st_delta[2][QUERIES];
    int b = blockIdx.y / kv, group = blockIdx.y % kv, heads = h / kv;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, q = lane & 3;
    int width = (h + 2 * kv) * HD;
    int j0 = blockIdx.x * FLASH_ROWS + warp * 16;
    unsigned int ka[HD / 16][4];
    a_rows<HD>(ka, qkv, b, j0, (h + group) * HD, width, t);
    // Read after the first barrier below.
    load_tile<HD, FLASH_ROWS>(vs, qkv, b, blockIdx.x * FLASH_ROWS, (h + kv + group) * HD, width, t);
    float dk[HD / 8][4], dv[HD / 8][4];
#pragma unroll
    for (int n = 0; n < HD / 8; n++)
#pragma unroll
        for (int i = 0; i < 4; i++) dk[n][i] = dv[n][i] = 0.0f;
    // The steps take each head of the group in turn, and for each its queries QUERIES at a time
    // from `first`, the first query any of this block's keys meets, to the sequence's end.
    int first = blockIdx.x * FLASH_ROWS;
    int steps = heads * ((t - first + QUERIES - 1) / QUERIES);
    int mine = threadIdx.x;  // the query whose statistics this thread loads, if below QUERIES
    float next_bias = 0.0f, next_delta = 0.0f, scale2 = scale * LOG2E;
    // Issues the copies of head `head`'s queries from i0 into buffer `buf` and loads their
    // statistics into registers.
    auto fetch = [&](int head, int i0, int buf) {
        load_tile_async<HD, QUERIES>(qs[buf], qkv, b, i0, head * HD, width, t);
        load_tile_async<HD, QUERIES>(dys[buf], dout, b, i0, head * HD, h * HD, t);
        if (mine < QUERIES) {
            bool in_sequence = i0 + mine < t;
            size_t at = ((size_t)b * h + head) * t + (in_sequence ? i0 + mine : 0);
            next_bias = softmax_bias(stats[2 * at], stats[2 * at + 1], in_sequence);
            next_delta = delta[at];
        }
    };
    // This step's first query, and the next step's head and first query (counted on, not
    // divided out: a division by a value known only at run time takes some twenty instructions).
    int i0 = first, next_head = group * heads, next_i0 = first;
    auto advance = [&]() {
        next_i0 += QUERIES;
        if (next_i0 >= t) next_i0 = first, next_head++;
    };
    fetch(next_head, next_i0, 0);
    advance();
    copies_commit();
    for (int step = 0, cur = 0; step < steps; step++, cur ^= 1) {
        if (mine < QUERIES) {
            st_bias[cur][mine] = next_bias;
            st_delta[cur][mine] = next_delta;
        }
        // The other buffers were last read before the barrier that ended the step before.
        if (step + 1 < steps) fetch(next_head, next_i0, cur ^ 1);
        copies_commit();
        copies_wait<1>();
        __syncthreads();
        if (i0 + QUERIES > j0) {  // else every query of the tile is before the keys
            const float *sb = st_bias[cur], *sd = st_delta[cur];
            float s[QUERIES / 8][4], dp[QUERIES / 8][4];
            scores<HD, QUERIES>(&s, &ka, qs[cur]);
            scores<HD, QUERIES>(&dp, nullptr, dys[cur], vs, warp * 16);
            // Queries past the sequence have a bias of minus infinity; only a tile with a key
            // after one of its queries, or past the sequence, is masked.
            if (j0 + 15 > i0 || j0 + 15 >= t) mask_causal<QUERIES, true>(s, j0, i0, t);
#pragma unroll
            for (int n = 0; n < QUERIES / 8; n++) {
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    int c = n * 8 + 2 * q + (i & 1);
                    float p = exp2_approx(fmaf(s[n][i], scale2, sb[c]));
                    s[n][i] = p;
                    dp[n][i] = p * (dp[n][i] - sd[c]);
                }
            }
            times_tile<HD, QUERIES>(&dv, &s, dys[cur]);
            times_tile<HD, QUERIES>(&dk, &dp, qs[cur]);
        }
        __syncthreads();
        i0 = next_i0;
        advance();
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int key = j0 + g + 8 * r;
        if (key >= t) continue;
        bf16* row = dqkv + ((size_t)b * t + key) * width;
#pragma unroll
        for (int n = 0; n < HD / 8; n++) {
#pragma unroll
            for (int j = 0; j < 2; j++) {
                int col = n * 8 + 2 * q + j;
                row[(h + group) * HD + col] = from_f32<bf16>(dk[n][2 * r + j] * scale);
                row[(h + kv + group) * HD + col] = from_f32<bf16>(dv[n][2 * r + j]);
            }
        }
    }
}

// The instantiations, one per head size of FLASH_HEADS (src/gpu/attention.rs); `hd` is the
// size the name gives. NAME_warp16 is the forward with one row tile a warp where it would
// take two, for measuring one against the other (ATTNRES_FLASH_WARP_ROWS in attention.rs).
extern "C" __global__ void flash_forward_bf16_hd16(bf16* out, float* stats, const bf16* qkv,
                                                   int t, int h, int kv, int hd, float scale) {
    flash_forward_t<16, ForwardTiles<16>::M>(out, stats, qkv, t, h, kv, scale);
}
extern "C" __global__ void flash_forward_bf16_hd16_warp16(bf16* out, float* stats,
                                                          const bf16* qkv, int t, int h, int kv,
                                                          int hd, float scale) {
    flash_forward_t<16, 1>(out, stats, qkv, t, h, kv, scale);
}
extern "C" __global__ void flash_backward_dq_bf16_hd16(bf16* dqkv, const bf16* dout,
                                                       const bf16* qkv, const float* stats,
                                                       const float* delta, int t, int h, int kv,
                                                       int hd, float scale) {
    flash_backward_dq_t<16>(dqkv, dout, qkv, stats, delta, t, h, kv, scale);
}
extern "C" __global__ void flash_backward_dkv_bf16_hd16(bf16* dqkv, const bf16* dout,
                                                        const bf16* qkv, const float* stats,
                                                        const float* delta, int t, int h, int kv,
                                                        int hd, float scale) {
    flash_backward_dkv_t<16>(dqkv, dout, qkv, stats, delta, t, h, kv, scale);
}
extern "C" __global__ void flash_forward_bf16_hd32(bf16* out, float* stats, const bf16* qkv,
                                                   int t, int h, int kv, int hd, float scale) {
    flash_forward_t<32, ForwardTiles<32>::M>(out, stats, qkv, t, h, kv, scale);
}
extern "C" __global__ void flash_forward_bf16_hd32_warp16(bf16* out, float* stats,
                                                          const bf16* qkv, int t, int h, int kv,
                                                          int hd, float scale) {
    flash_forward_t<32, 1>(out, stats, qkv, t, h, kv, scale);
}
extern "C" __global__ void flash_backward_dq_bf16_hd32(bf16* dqkv, const bf16* dout,
                                                       const bf16* qkv, const float* stats,
                                                       const float* delta, int t, int h, int kv,
                                                       int hd, float scale) {
    flash_backward_dq_t<32>(dqkv, dout, qkv, stats, delta, t, h, kv, scale);
}
extern "C" __global__ void flash_backward_dkv_bf16_hd32(bf16* dqkv, const bf16* dout,
                                                        const bf16* qkv, const float* stats,
                                                        const float* delta, int t, int h, int kv,
                                                        int hd, float scale) {
    flash_backward_dkv_t<32>(dqkv, dout, qkv, stats, delta, t, h, kv, scale);
}
extern "C" __global__ void flash_forward_bf16_hd64(bf16* out, float* stats, const bf16* qkv,
                                                   int t, int h, int kv, int hd, float scale) {
    flash_forward_t<64, ForwardTiles<64>::M>(out, stats, qkv, t, h, kv, scale);
}
extern "C" __global__ void flash_forward_bf16_hd64_warp16(bf16* out, float* stats,
                                                          const bf16* qkv, int t, int h, int kv,
                                                          int hd, float scale) {
    flash_forward_t<64, 1>(out, stats, qkv, t, h, kv, scale);
}
// Held to 168 registers, three blocks a multiprocessor, which it fits without spilling (ptxas
// would take 208, leaving room for two).
extern "C" __global__ void __launch_bounds__(32 * FLASH_WARPS, 3)
    flash_backward_dq_bf16_hd64(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* stats,
                                const float* delta, int t, int h, int kv, int hd, float scale) {
    flash_backward_dq_t<64>(dqkv, dout, qkv, stats, delta, t, h, kv, scale);
}
extern "C" __global__ void flash_backward_dkv_bf16_hd64(bf16* dqkv, const bf16* dout,
                                                        const bf16* qkv, const float* stats,
                                                        const float* delta, int t, int h, int kv,
                                                        int hd, float scale) {
    flash_backward_dkv_t<64>(dqkv, dout, qkv, stats, delta, t, h, kv, scale);
}
extern "C" __global__ void flash_forward_bf16_hd96(bf16* out, float* stats, const bf16* qkv,
                                                   int t, int h, int kv, int hd, float scale) {
    flash_forward_t<96, ForwardTiles<96>::M>(out, stats, qkv, t, h, kv, scale);
}
extern "C" __global__ void flash_backward_dq_bf16_hd96(bf16* dqkv, const bf16* dout,
                                                       const bf16* qkv, const float* stats,
                                                       const float* delta, int t, int h, int kv,
                                                       int hd, float scale) {
    flash_backward_dq_t<96>(dqkv, dout, qkv, stats, delta, t, h, kv, scale);
}
extern "C" __global__ void flash_backward_dkv_bf16_hd96(bf16* dqkv, const bf16* dout,
                                                        const bf16* qkv, const float* stats,
                                                        const float* delta, int t, int h, int kv,
                                                        int hd, float scale) {
    flash_backward_dkv_t<96>(dqkv, dout, qkv, stats, delta, t, h, kv, scale);
}
extern "C" __global__ void flash_forward_bf16_hd128(bf16* out, float* stats, const bf16* qkv,
                                                   int t, int h, int kv, int hd, float scale) {
    flash_forward_t<128, ForwardTiles<128>::M>(out, stats, qkv, t, h, kv, scale);
}
extern "C" __global__ void flash_backward_dq_bf16_hd128(bf16* dqkv, const bf16* dout,
                                                       const bf16* qkv, const float* stats,
                                                       const float* delta, int t, int h, int kv,
                                                       int hd, float scale) {
    flash_backward_dq_t<128>(dqkv, dout, qkv, stats, delta, t, h, kv, scale);
}
extern "C" __global__ void flash_backward_dkv_bf16_hd128(bf16* dqkv, const bf16* dout,
                                                        const bf16* qkv, const float* stats,
                                                        const float* delta, int t, int h, int kv,
                                                        int hd, float scale) {
    flash_backward_dkv_t<128>(dqkv, dout, qkv, stats, delta, t, h, kv, scale);
}
