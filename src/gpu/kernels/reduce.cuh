// What every kernel file shares, put before it when it is compiled (src/gpu/nvrtc.rs): the
// bfloat16 type, rows read and written in 16-byte chunks, and block-wide reductions. The
// kernels that reduce run with a power of two of threads per block, 32 to 1024.

// NVRTC has no math.h: minus infinity by its bits.
#define NEG_INF __int_as_float(0xff800000)

// The launch's dynamic shared memory as `type* name` (src/gpu/emulator/emu.h defines it for
// the CPU).
#ifndef DYNAMIC_SHARED
#define DYNAMIC_SHARED(type, name)                                      \
    extern __shared__ __align__(16) unsigned char dynamic_shared_raw[]; \
    type* name = reinterpret_cast<type*>(dynamic_shared_raw)
#endif

// bfloat16 as the kernels store it: the upper half of an f32's bits (the host's `Bf16`).
// Kernels that take f32 or bf16 activations are templates instantiated twice, `NAME` and
// `NAME_bf16`; they load values to f32 (exactly) with to_f32, compute in f32, and store with
// from_f32<T>, which rounds to the nearest bf16, ties to even.
struct bf16 {
    unsigned short bits;
};
__device__ inline float to_f32(float x) { return x; }
__device__ inline float to_f32(bf16 x) { return __uint_as_float((unsigned int)x.bits << 16); }
template <typename T> __device__ inline T from_f32(float x);
template <> __device__ inline float from_f32<float>(float x) { return x; }
// On a GPU one instruction (cvt.rn.bf16.f32), which makes every NaN the canonical 0x7fff; the
// emulator rounds the bits as the host's `half` crate does (a NaN keeps its sign and payload,
// its quiet bit set), the same value for every other input.
template <> __device__ inline bf16 from_f32<bf16>(float x) {
#ifndef ATTNRES_EMULATOR
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(x));
    return bf16{h};
#else
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bf16{(unsigned short)((u >> 16) | 0x40u)};
    return bf16{(unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16)};
#endif
}
// lo and hi rounded to bf16 in one register, lo in the low half: on a GPU one instruction
// (cvt.rn.bf16x2.f32).
__device__ inline unsigned int pack_bf16(float lo, float hi) {
#ifndef ATTNRES_EMULATOR
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
#else
    return (unsigned int)from_f32<bf16>(lo).bits | ((unsigned int)from_f32<bf16>(hi).bits << 16);
#endif
}

// Sixteen bytes, eight bf16 or four f32, as one load or store.
struct __align__(16) Quad {
    unsigned int w[4];
};

// The 16 bytes at p, which must be 16-byte aligned: a GPU faults on any other address, and the
// emulator makes the launch an error.
__device__ inline Quad quad_at(const void* p) {
#ifndef ATTNRES_EMULATOR
    return *(const Quad*)p;
#else
    emu::check_aligned16(p);
    Quad q;
    __builtin_memcpy(&q, p, sizeof q);
    return q;
#endif
}
__device__ inline void quad_store(void* p, Quad q) {
#ifndef ATTNRES_EMULATOR
    *(Quad*)p = q;
#else
    emu::check_aligned16(p);
    __builtin_memcpy(p, &q, sizeof q);
#endif
}

// The row kernels read and write a row of d values in chunks of CHUNK: thread i of a block
// owns chunks i, i + blockDim.x, ... (`for_chunks`), so a kernel reading a row that another
// wrote with the same threads finds each value in the thread that wrote it, and every kernel
// sums a row's products in the same order. A whole chunk at a 16-byte aligned address moves in
// 16-byte loads and stores (one for bf16, two for f32); a row's tail, or a chunk of a row whose
// length is no multiple of 8, moves value by value.
#define CHUNK 8
#define for_chunks(c, d) for (int c = CHUNK * (int)threadIdx.x; c < (d); c += CHUNK * (int)blockDim.x)

__device__ inline bool whole_and_aligned(const void* p, int left) {
    return left >= CHUNK && ((unsigned long long)p & 15) == 0;
}

// The chunk at p (`left` values from p to the row's end) in f32, zeros past the row's end.
__device__ inline void load_chunk(float (&x)[CHUNK], const bf16* p, int left) {
    if (whole_and_aligned(p, left)) {
        Quad q = quad_at(p);
        for (int i = 0; i < 4; i++) {
            x[2 * i] = __uint_as_float(q.w[i] << 16);
            x[2 * i + 1] = __uint_as_float(q.w[i] & 0xffff0000u);
        }
    } else {
        for (int i = 0; i < CHUNK; i++) x[i] = i < left ? to_f32(p[i]) : 0.0f;
    }
}
__device__ inline void load_chunk(float (&x)[CHUNK], const float* p, int left) {
    if (whole_and_aligned(p, left)) {
        Quad a = quad_at(p), b = quad_at(p + 4);
        for (int i = 0; i < 4; i++) {
            x[i] = __uint_as_float(a.w[i]);
            x[4 + i] = __uint_as_float(b.w[i]);
        }
    } else {
        for (int i = 0; i < CHUNK; i++) x[i] = i < left ? p[i] : 0.0f;
    }
}

// Stores the first `left` values of a chunk at p (all of them where left >= CHUNK), rounded to
// the row's type.
__device__ inline void store_chunk(bf16* p, const float (&x)[CHUNK], int left) {
    if (whole_and_aligned(p, left)) {
        Quad q;
        for (int i = 0; i < 4; i++)
            q.w[i] = pack_bf16(x[2 * i], x[2 * i + 1]);
        quad_store(p, q);
    } else {
        for (int i = 0; i < CHUNK && i < left; i++) p[i] = from_f32<bf16>(x[i]);
    }
}
__device__ inline void store_chunk(float* p, const float (&x)[CHUNK], int left) {
    if (whole_and_aligned(p, left)) {
        Quad a, b;
        for (int i = 0; i < 4; i++) {
            a.w[i] = __float_as_uint(x[i]);
            b.w[i] = __float_as_uint(x[4 + i]);
        }
        quad_store(p, a);
        quad_store(p + 4, b);
    } else {
        for (int i = 0; i < CHUNK && i < left; i++) p[i] = x[i];
    }
}

// The sum of `v` over the block's threads, in every thread.
__device__ float block_sum(float v) {
    __shared__ float warps[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) warps[warp] = v;
    __syncthreads();
    v = lane < blockDim.x / 32 ? warps[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The largest `v` over the block's threads, in every thread.
__device__ float block_max(float v) {
    __shared__ float warps[32];
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) warps[warp] = v;
    __syncthreads();
    v = lane < blockDim.x / 32 ? warps[lane] : NEG_INF;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// N sums over the block's threads at once (N a power of two, 2 to 32), in every thread: v[i]
// becomes the sum of v[i]. While a lane holds more than one value, each step of the warp's
// reduction halves them: the lane keeps the half its bit of the lane selects and adds in its
// partner's copy of that half. So eight sums take 9 shuffles a warp where eight block_sum take
// 80, and one pair of barriers where they take eight. (Another order of summation than
// block_sum's.)
template <int N> __device__ void block_sums(float (&v)[N]) {
    __shared__ float warps[32][N];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float x[N];
    #pragma unroll
    for (int i = 0; i < N; i++) x[i] = v[i];
    int held = N;
    #pragma unroll
    for (int bit = 16; bit >= 1; bit >>= 1) {
        if (held > 1) {
            bool high = lane & bit;
            held /= 2;
            #pragma unroll
            for (int i = 0; i < N / 2; i++) {
                if (i >= held) break;
                float keep = high ? x[held + i] : x[i], give = high ? x[i] : x[held + i];
                x[i] = keep + __shfl_xor_sync(0xffffffffu, give, bit);
            }
        } else {
            x[0] += __shfl_xor_sync(0xffffffffu, x[0], bit);
        }
    }
    // Lane l holds the warp's sum of value l / (32 / N).
    __syncthreads();
    if (lane % (32 / N) == 0) warps[warp][lane / (32 / N)] = x[0];
    __syncthreads();
    int n = blockDim.x / 32;
    #pragma unroll
    for (int i = 0; i < N; i++) {
        float s = 0.0f;
        for (int w = 0; w < n; w++) s += warps[w][i];
        v[i] = s;
    }
}

// <a, b> over a row of `d` values, in every thread.
template <typename A, typename B> __device__ float row_dot(const A* a, const B* b, int d) {
    float s = 0.0f;
    for_chunks(c, d) {
        float x[CHUNK], y[CHUNK];
        load_chunk(x, a + c, d - c);
        load_chunk(y, b + c, d - c);
        for (int i = 0; i < CHUNK; i++) s += x[i] * y[i];
    }
    return block_sum(s);
}

// The reciprocal RMS of row `x` (`d` values). Where the squares overflow f32 although every
// value is finite, the statistic is taken again in f64, as the CPU kernel does.
template <typename T> __device__ float row_rstd(const T* x, int d, float eps) {
    float s = 0.0f;
    for_chunks(c, d) {
        float v[CHUNK];
        load_chunk(v, x + c, d - c);
        for (int i = 0; i < CHUNK; i++) s += v[i] * v[i];
    }
    float rstd = 1.0f / sqrtf(block_sum(s) / (float)d + eps);
    if (rstd != 0.0f) return rstd;
    double s64 = 0.0;
    int finite = 1;
    for_chunks(c, d) {
        float v[CHUNK];
        load_chunk(v, x + c, d - c);
        for (int i = 0; i < CHUNK; i++) {
            s64 += (double)v[i] * (double)v[i];
            finite &= isfinite(v[i]);
        }
    }
    // The f64 partials summed in shared memory.
    __shared__ double parts[1024];
    __shared__ int all_finite;
    if (threadIdx.x == 0) all_finite = 1;
    __syncthreads();
    parts[threadIdx.x] = s64;
    if (!finite) atomicAnd(&all_finite, 0);
    __syncthreads();
    if (!all_finite) return rstd;
    for (int n = blockDim.x / 2; n > 0; n >>= 1) {
        if (threadIdx.x < n) parts[threadIdx.x] += parts[threadIdx.x + n];
        __syncthreads();
    }
    return (float)(1.0 / sqrt(parts[0] / (double)d + (double)eps));
}

// A row of d sums that a block keeps in shared memory while it runs over many rows (the
// gradient of a norm's gain, of a depth query), each thread adding into the slots of its own
// chunks: value e of the chunk at column c sits at e * chunks + c / CHUNK, so that a warp's
// threads, on chunks side by side, use 32 different banks. row_sums_clear starts it, and
// row_sums_store writes it out in order (each thread its own slots, so neither needs a barrier).
__device__ inline int row_slot(int c, int e, int d) {
    return e * ((d + CHUNK - 1) / CHUNK) + c / CHUNK;
}
__device__ inline void row_sums_clear(float* sums, int d) {
    for_chunks(c, d) for (int e = 0; e < CHUNK; e++) sums[row_slot(c, e, d)] = 0.0f;
}
__device__ inline void row_sums_store(float* out, const float* sums, int d) {
    for_chunks(c, d) {
        float x[CHUNK];
        for (int e = 0; e < CHUNK; e++) x[e] = sums[row_slot(c, e, d)];
        store_chunk(out + c, x, d - c);
    }
}

// The first and one-past-last rows of the block's share when each block takes `per_block`
// consecutive rows of `rows`.
__device__ inline int rows_from(int per_block) { return blockIdx.x * per_block; }
__device__ inline int rows_to(int per_block, int rows) {
    int end = (blockIdx.x + 1) * per_block;
    return end < rows ? end : rows;
}

// RMSNorm's backward for one row x with 1/rms r and gain g, from dy: with u = g * dy,
//   dx = r * u - (r^3 / d) * <u, x> * x,
// added to what dx holds with `accumulate`. The row's share of the gain's gradient,
// dy * x * r, goes into the block's row of sums `gain` (row_slot).
template <typename T>
__device__ void norm_backward_row(T* dx, float* gain, const T* dy, const T* x, const float* g,
                                  float r, int d, int accumulate) {
    float ux = 0.0f;
    for_chunks(c, d) {
        float gc[CHUNK], u[CHUNK], v[CHUNK];
        load_chunk(gc, g + c, d - c);
        load_chunk(u, dy + c, d - c);
        load_chunk(v, x + c, d - c);
        for (int i = 0; i < CHUNK; i++) {
            ux += gc[i] * u[i] * v[i];
            gain[row_slot(c, i, d)] += u[i] * v[i] * r;
        }
    }
    float k = r * r * r * block_sum(ux) / (float)d;
    for_chunks(c, d) {
        float gc[CHUNK], u[CHUNK], v[CHUNK], prior[CHUNK];
        load_chunk(gc, g + c, d - c);
        load_chunk(u, dy + c, d - c);
        load_chunk(v, x + c, d - c);
        if (accumulate) load_chunk(prior, dx + c, d - c);
        for (int i = 0; i < CHUNK; i++) {
            float e = r * gc[i] * u[i] - k * v[i];
            u[i] = accumulate ? prior[i] + e : e;
        }
        store_chunk(dx + c, u, d - c);
    }
}

// RMSNorm of row x into y with gain g (f32), as src/kernels/rmsnorm.rs: y = x * rstd * g with
// rstd = 1 / sqrt(mean(x^2) + eps), which it returns in every thread. The rmsnorm kernels take
// it, and the residual kernels that hand a sublayer its input and that input's norm at once.
template <typename T> __device__ float norm_row(T* y, const T* x, const float* g, int d, float eps) {
    float r = row_rstd(x, d, eps);
    for_chunks(c, d) {
        float v[CHUNK], gc[CHUNK];
        load_chunk(v, x + c, d - c);
        load_chunk(gc, g + c, d - c);
        for (int i = 0; i < CHUNK; i++) v[i] = v[i] * r * gc[i];
        store_chunk(y + c, v, d - c);
    }
    return r;
}
