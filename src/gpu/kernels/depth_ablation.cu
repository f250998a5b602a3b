// The depth attention with the ablation options (the attn_res_* config keys), as
// src/kernels/depth/ablation.rs computes it on the CPU: one consumer in one pass over the K
// sources it reads, per token (sources and their gradients f32 or bf16, T; queries, weights,
// logits and sums f32):
//   logit_{i,g} = r_i <w_g, v_{i,g}>   (r_i = 1/rms(v_i) with key norm, else 1; g a head's
//                                       channels) | c_i (a learned scalar per source)
//   alpha       = softmax over i | sigmoid | the logit itself (dense)
//   h_g         = sum_i alpha_{i,g} v_{i,g}
// A consumer reads the embedding, the completed sources first .. first + nc - 2 (a window: the
// latest of them; without one, all after the embedding) and, inside a block, the partial sum
// (p non-null) last. `values` and `rstds` hold every completed source ([n, rows, d], [n, rows]).
// The query w is [d] for every token (stride 0) or one per token ([rows, d], stride d), times
// the key-norm gain `gain` when given; scalars (non-null) are a consumer's learned logits over
// all of the model's sources ([n_cols]), the partial sum's at `partial_col`. A block of a power
// of two of threads takes a token; its threads take the columns in turn.

#define GATE_SOFTMAX 0
#define GATE_SIGMOID 1
#define GATE_IDENTITY 2

// What a consumer reads, as the kernels take it.
template <typename T> struct Read {
    const T* values;
    const float* rstds;
    const T* p;
    const float* pr;
    int first, nc, rows, d;
    __device__ int k() const { return nc + (p != 0); }
    // The completed source that source i < nc is.
    __device__ int index(int i) const { return i == 0 ? 0 : first + i - 1; }
    __device__ const T* row(int i, int t) const {
        size_t at = (size_t)t * d;
        return i < nc ? values + (size_t)index(i) * rows * d + at : p + at;
    }
    __device__ float rstd(int i, int t) const {
        return i < nc ? rstds[(size_t)index(i) * rows + t] : pr[t];
    }
};

// The effective query of token t at column c.
__device__ inline float query_at(const float* w, int stride, const float* gain, int t, int c) {
    float q = w[(size_t)t * stride + c];
    return gain ? q * gain[c] : q;
}

// Scores of every (source, head) pair of token t into s ([k, heads]): 8 pairs' dot products
// summed over the block at a time.
template <typename T>
__device__ void pair_dots(float* s, const Read<T>& rd, const T* other, const float* w,
                          int stride, const float* gain, int heads, int t) {
    int pairs = rd.k() * heads, hd = rd.d / heads;
    for (int p0 = 0; p0 < pairs; p0 += 8) {
        float part[8];
        #pragma unroll
        for (int q = 0; q < 8; q++) {
            part[q] = 0.0f;
            int p = p0 + q;
            if (p >= pairs) continue;
            int i = p / heads, g = p % heads;
            const T* v = rd.row(i, t);
            for (int c = g * hd + threadIdx.x; c < (g + 1) * hd; c += blockDim.x) {
                float x = other ? to_f32(other[(size_t)t * rd.d + c])
                                : query_at(w, stride, gain, t, c);
                part[q] += x * to_f32(v[c]);
            }
        }
        block_sums(part);
        if (threadIdx.x == 0)
            for (int q = 0; q < 8 && p0 + q < pairs; q++) s[p0 + q] = part[q];
    }
}

// The scalar logit of source i.
template <typename T>
__device__ inline float scalar_of(const float* scalars, const Read<T>& rd, int i,
                                  int partial_col) {
    return scalars[i < rd.nc ? rd.index(i) : partial_col];
}

// Forward: h [rows, d], and per token the weights and logits [rows, k, heads]. Shared memory:
// k * heads floats.
template <typename T>
__device__ void depth_ablation_forward_t(T* h, float* alpha, float* logits, Read<T> rd,
                                         const float* w, int stride, const float* gain,
                                         const float* scalars, int partial_col, int gate,
                                         int key_norm, int heads) {
    DYNAMIC_SHARED(float, a);
    int t = blockIdx.x, k = rd.k(), d = rd.d, hd = d / heads;
    if (scalars) {
        for (int i = threadIdx.x; i < k; i += blockDim.x)
            a[i] = scalar_of(scalars, rd, i, partial_col);
    } else {
        pair_dots(a, rd, (const T*)0, w, stride, gain, heads, t);
        if (threadIdx.x == 0 && key_norm)
            for (int p = 0; p < k * heads; p++) a[p] *= rd.rstd(p / heads, t);
    }
    __syncthreads();
    size_t row = (size_t)t * k * heads;
    for (int g = threadIdx.x; g < heads; g += blockDim.x) {
        float m = NEG_INF, z = 0.0f;
        for (int i = 0; i < k; i++) {
            logits[row + i * heads + g] = a[i * heads + g];
            m = fmaxf(m, a[i * heads + g]);
        }
        for (int i = 0; i < k; i++) {
            float l = a[i * heads + g];
            float x = gate == GATE_SOFTMAX   ? expf(l - m)
                    : gate == GATE_SIGMOID ? 1.0f / (1.0f + expf(-l))
                                           : l;
            a[i * heads + g] = x;
            z += x;
        }
        for (int i = 0; i < k; i++) {
            if (gate == GATE_SOFTMAX) a[i * heads + g] /= z;
            alpha[row + i * heads + g] = a[i * heads + g];
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        int g = c / hd;
        float s = 0.0f;
        for (int i = 0; i < k; i++) s += a[i * heads + g] * to_f32(rd.row(i, t)[c]);
        h[(size_t)t * d + c] = from_f32<T>(s);
    }
}

// Backward: from dh, the gradient of h, adds each source's gradient into dvalues (the completed
// sources', f32, laid out as values) or dp (the partial sum's, T), and writes the query's
// gradient of token t: with scalars, row t of dq ([rows, n_cols]: the sources' columns, zero
// elsewhere); else row t of dq ([rows, d]) with the effective query's (summed over the tokens
// afterwards for a query shared by all). Shared memory: 3 k heads + k floats.
template <typename T>
__device__ void depth_ablation_backward_t(float* dvalues, T* dp, float* dq, const T* dh,
                                          Read<T> rd, const float* alpha, const float* logits,
                                          const float* w, int stride, const float* gain,
                                          const float* scalars, int partial_col, int n_cols,
                                          int gate, int key_norm, int heads) {
    DYNAMIC_SHARED(float, da);
    int t = blockIdx.x, k = rd.k(), d = rd.d, hd = d / heads, kh = k * heads;
    float *ds = da + kh, *a = ds + kh, *coef = a + kh;
    size_t row = (size_t)t * kh, at = (size_t)t * d;
    // da_{i,g} = <dh_g, v_{i,g}>.
    pair_dots(da, rd, dh, w, stride, gain, heads, t);
    for (int p = threadIdx.x; p < kh; p += blockDim.x) a[p] = alpha[row + p];
    __syncthreads();
    for (int g = threadIdx.x; g < heads; g += blockDim.x) {
        float dot = 0.0f;
        if (gate == GATE_SOFTMAX)
            for (int i = 0; i < k; i++) dot += a[i * heads + g] * da[i * heads + g];
        for (int i = 0; i < k; i++) {
            int p = i * heads + g;
            ds[p] = gate == GATE_SOFTMAX ? a[p] * (da[p] - dot)
                  : gate == GATE_SIGMOID ? da[p] * a[p] * (1.0f - a[p])
                                         : da[p];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < k; i += blockDim.x) {
        float s = 0.0f;
        for (int g = 0; g < heads; g++) s += ds[i * heads + g] * logits[row + i * heads + g];
        coef[i] = s;
    }
    if (scalars) {
        for (int c = threadIdx.x; c < n_cols; c += blockDim.x) dq[(size_t)t * n_cols + c] = 0.0f;
        __syncthreads();
        if (threadIdx.x == 0)
            for (int i = 0; i < k; i++)
                dq[(size_t)t * n_cols + (i < rd.nc ? rd.index(i) : partial_col)] = ds[i];
    }
    __syncthreads();
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        int g = c / hd;
        float dhc = to_f32(dh[at + c]), wc = scalars ? 0.0f : query_at(w, stride, gain, t, c);
        float dw = 0.0f;
        for (int i = 0; i < k; i++) {
            int p = i * heads + g;
            float v = to_f32(rd.row(i, t)[c]);
            // The value path, then (with a query) the key path, through 1/rms with key norm.
            float grad = a[p] * dhc;
            if (!scalars) {
                float r = key_norm ? rd.rstd(i, t) : 1.0f;
                grad += ds[p] * r * wc;
                dw += ds[p] * r * v;
                if (key_norm) grad -= coef[i] * r * r / (float)d * v;
            }
            if (i < rd.nc) {
                dvalues[(size_t)rd.index(i) * rd.rows * d + at + c] += grad;
            } else {
                dp[at + c] = from_f32<T>(to_f32(dp[at + c]) + grad);
            }
        }
        if (!scalars) dq[at + c] = dw;
    }
}

// x = the sum of the sources a consumer reads (the input-dependent query's input).
template <typename T> __device__ void depth_ablation_read_sum_t(T* x, Read<T> rd) {
    int t = blockIdx.x;
    for (int c = threadIdx.x; c < rd.d; c += blockDim.x) {
        float s = 0.0f;
        for (int i = 0; i < rd.k(); i++) s += to_f32(rd.row(i, t)[c]);
        x[(size_t)t * rd.d + c] = from_f32<T>(s);
    }
}

// Adds dx, the gradient of that sum, into the gradient of every source read.
template <typename T>
__device__ void depth_ablation_read_spread_t(float* dvalues, T* dp, const T* dx, Read<T> rd) {
    int t = blockIdx.x;
    size_t at = (size_t)t * rd.d;
    for (int c = threadIdx.x; c < rd.d; c += blockDim.x) {
        float g = to_f32(dx[at + c]);
        for (int i = 0; i < rd.nc; i++)
            dvalues[(size_t)rd.index(i) * rd.rows * rd.d + at + c] += g;
        if (rd.p) dp[at + c] = from_f32<T>(to_f32(dp[at + c]) + g);
    }
}

// The input-dependent query's backward through the gain, n = rows * d values: from dw, the
// effective query's gradient, dq = dw * gain (the gradient of q = W x^, in T for its product's
// backward) and parts = dw * q (summed over the tokens into the gain's gradient); without a
// gain dq = dw.
template <typename T>
__device__ void depth_ablation_query_backward_t(T* dq, float* parts, const float* dw,
                                                const float* q, const float* gain, int d,
                                                long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    if (gain) {
        dq[i] = from_f32<T>(dw[i] * gain[i % d]);
        parts[i] = dw[i] * q[i];
    } else {
        dq[i] = from_f32<T>(dw[i]);
    }
}

// y = x in T, n values: a completed source's gradient, summed in f32, as the sublayers take it.
template <typename T> __device__ void depth_ablation_narrow_t(T* y, const float* x, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = from_f32<T>(x[i]);
}

// The entry points, f32 and bf16; a consumer's reads come as (values, rstds, p, pr, first, nc,
// rows, d).
extern "C" __global__ void depth_ablation_forward(float* h, float* alpha, float* logits,
        const float* values, const float* rstds, const float* p,
        const float* pr, int first, int nc, int rows, int d, const float* w,
        int stride, const float* gain, const float* scalars, int partial_col, int gate,
        int key_norm, int heads) {
    Read<float> rd{values, rstds, p, pr, first, nc, rows, d};
    depth_ablation_forward_t(h, alpha, logits, rd, w, stride, gain, scalars, partial_col, gate,
                             key_norm, heads);
}
extern "C" __global__ void depth_ablation_backward(float* dvalues, float* dp, float* dq,
        const float* dh, const float* values, const float* rstds, const float* p,
        const float* pr, int first, int nc, int rows, int d,
        const float* alpha, const float* logits, const float* w, int stride, const float* gain,
        const float* scalars, int partial_col, int n_cols, int gate, int key_norm, int heads) {
    Read<float> rd{values, rstds, p, pr, first, nc, rows, d};
    depth_ablation_backward_t(dvalues, dp, dq, dh, rd, alpha, logits, w, stride, gain, scalars,
                              partial_col, n_cols, gate, key_norm, heads);
}
extern "C" __global__ void depth_ablation_read_sum(float* x, const float* values,
        const float* rstds, const float* p,
        const float* pr, int first, int nc, int rows, int d) {
    Read<float> rd{values, rstds, p, pr, first, nc, rows, d};
    depth_ablation_read_sum_t(x, rd);
}
extern "C" __global__ void depth_ablation_read_spread(float* dvalues, float* dp,
        const float* dx,
        const float* values, const float* rstds, const float* p,
        const float* pr, int first, int nc, int rows, int d) {
    Read<float> rd{values, rstds, p, pr, first, nc, rows, d};
    depth_ablation_read_spread_t(dvalues, dp, dx, rd);
}
extern "C" __global__ void depth_ablation_query_backward(float* dq, float* parts,
        const float* dw, const float* q, const float* gain, int d, long long n) {
    depth_ablation_query_backward_t(dq, parts, dw, q, gain, d, n);
}
extern "C" __global__ void depth_ablation_narrow(float* y, const float* x, long long n) {
    depth_ablation_narrow_t(y, x, n);
}
extern "C" __global__ void depth_ablation_forward_bf16(bf16* h, float* alpha, float* logits,
        const bf16* values, const float* rstds, const bf16* p,
        const float* pr, int first, int nc, int rows, int d, const float* w,
        int stride, const float* gain, const float* scalars, int partial_col, int gate,
        int key_norm, int heads) {
    Read<bf16> rd{values, rstds, p, pr, first, nc, rows, d};
    depth_ablation_forward_t(h, alpha, logits, rd, w, stride, gain, scalars, partial_col, gate,
                             key_norm, heads);
}
extern "C" __global__ void depth_ablation_backward_bf16(float* dvalues, bf16* dp, float* dq,
        const bf16* dh, const bf16* values, const float* rstds, const bf16* p,
        const float* pr, int first, int nc, int rows, int d,
        const float* alpha, const float* logits, const float* w, int stride, const float* gain,
        const float* scalars, int partial_col, int n_cols, int gate, int key_norm, int heads) {
    Read<bf16> rd{values, rstds, p, pr, first, nc, rows, d};
    depth_ablation_backward_t(dvalues, dp, dq, dh, rd, alpha, logits, w, stride, gain, scalars,
                              partial_col, n_cols, gate, key_norm, heads);
}
extern "C" __global__ void depth_ablation_read_sum_bf16(bf16* x, const bf16* values,
        const float* rstds, const bf16* p,
        const float* pr, int first, int nc, int rows, int d) {
    Read<bf16> rd{values, rstds, p, pr, first, nc, rows, d};
    depth_ablation_read_sum_t(x, rd);
}
extern "C" __global__ void depth_ablation_read_spread_bf16(float* dvalues, bf16* dp,
        const bf16* dx,
        const bf16* values, const float* rstds, const bf16* p,
        const float* pr, int first, int nc, int rows, int d) {
    Read<bf16> rd{values, rstds, p, pr, first, nc, rows, d};
    depth_ablation_read_spread_t(dvalues, dp, dx, rd);
}
extern "C" __global__ void depth_ablation_query_backward_bf16(bf16* dq, float* parts,
        const float* dw, const float* q, const float* gain, int d, long long n) {
    depth_ablation_query_backward_t(dq, parts, dw, q, gain, d, n);
}
extern "C" __global__ void depth_ablation_narrow_bf16(bf16* y, const float* x, long long n) {
    depth_ablation_narrow_t(y, x, n);
}
