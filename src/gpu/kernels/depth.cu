// The depth attention of Attention Residuals, as src/kernels/depth computes it on the CPU
// (sources, inputs and their gradients f32 or bf16, T; queries, weights, statistics and sums
// f32): per token, a softmax over sources with a static query w = q * gamma and RMS-normalised
// keys, over raw values:
//   logit_i = r_i <w, v_i>,  alpha = softmax(logit),  h = sum_i alpha_i v_i.
// The forward is the two-phase form (phase 1 scores a block's completed sources for all of its
// consumers at once; phase 2 merges each consumer's partial sum, made in the same pass, and
// normalises the result for the sublayer); the backward takes a partial sum's gradient with its
// consumer's norm, and a completed source's from all of its readers at once. A block of a
// power of two of threads takes a token at a time (row_dot, row_rstd, norm_row: reduce.cuh).

// Consumers one launch of phase 1 scores; more run in further launches along the grid's y.
#define PHASE1_CONSUMERS 8

// out = a + b (b null: a alone), and the per-row 1/rms of the result into rstd: a completed
// source (the embedding, or a block's sum), with the statistic its keys need.
template <typename T>
__device__ void depth_sum_rstd_t(T* out, float* rstd, const T* a, const T* b, int d, float eps) {
    size_t at = (size_t)blockIdx.x * d;
    for_chunks(c, d) {
        float x[CHUNK], y[CHUNK];
        load_chunk(x, a + at + c, d - c);
        if (b) {
            load_chunk(y, b + at + c, d - c);
            for (int i = 0; i < CHUNK; i++) x[i] += y[i];
        }
        store_chunk(out + at + c, x, d - c);
    }
    // Each thread reads back the values it wrote.
    float r = row_rstd(out + at, d, eps);
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}
extern "C" __global__ void depth_sum_rstd(float* out, float* rstd, const float* a, const float* b,
                                          int d, float eps) {
    depth_sum_rstd_t(out, rstd, a, b, d, eps);
}
extern "C" __global__ void depth_sum_rstd_bf16(bf16* out, float* rstd, const bf16* a,
                                               const bf16* b, int d, float eps) {
    depth_sum_rstd_t(out, rstd, a, b, d, eps);
}

// Phase 1 for consumers PHASE1_CONSUMERS * blockIdx.y onward (of `s`) of one block, over the
// `c` completed sources (sources [c, rows, d], rstds [c, rows]; queries ws [s, d]): per
// consumer and token the logits [s, rows, c], their maximum m1 and sum of exponentials l1
// ([s, rows]), and the normalised mix o1 [s, rows, d]. Shared memory: PHASE1_CONSUMERS * c.
template <typename T>
__device__ void depth_phase1_t(float* logits, float* m1, float* l1, T* o1, const T* sources,
                               const float* rstds, const float* ws, int rows, int d, int c, int s) {
    DYNAMIC_SHARED(float, weights);
    int t = blockIdx.x, j0 = blockIdx.y * PHASE1_CONSUMERS;
    int n = s - j0 < PHASE1_CONSUMERS ? s - j0 : PHASE1_CONSUMERS;
    size_t plane = (size_t)rows * d, at = (size_t)t * d;
    // The logits of every (source, consumer) pair, eight pairs at a time (sources outer), their
    // dot products summed over the block together: a block of one consumer (Full AttnRes)
    // takes eight sources at once.
    int pairs = c * n;
    for (int p0 = 0; p0 < pairs; p0 += 8) {
        int src[8], con[8];
        float part[8];
        #pragma unroll
        for (int q = 0; q < 8; q++) {
            int p = p0 + q < pairs ? p0 + q : pairs - 1;
            src[q] = p / n;
            con[q] = p % n;
            part[q] = 0.0f;
        }
        for_chunks(col, d) {
            #pragma unroll
            for (int q = 0; q < 8; q++) {
                if (p0 + q >= pairs) continue;
                float x[CHUNK], w[CHUNK];
                load_chunk(x, sources + src[q] * plane + at + col, d - col);
                load_chunk(w, ws + (size_t)(j0 + con[q]) * d + col, d - col);
                for (int e = 0; e < CHUNK; e++) part[q] += w[e] * x[e];
            }
        }
        block_sums(part);
        if (threadIdx.x == 0)
            for (int q = 0; q < 8 && p0 + q < pairs; q++)
                weights[con[q] * c + src[q]] = rstds[(size_t)src[q] * rows + t] * part[q];
    }
    __syncthreads();
    if (threadIdx.x < n) {
        // The softmax of one consumer: logits out, weights divided by their sum in place.
        int g = threadIdx.x;
        size_t row = (size_t)(j0 + g) * rows + t;
        float* e = weights + g * c;
        float m = NEG_INF, z = 0.0f;
        for (int i = 0; i < c; i++) {
            logits[row * c + i] = e[i];
            m = fmaxf(m, e[i]);
        }
        for (int i = 0; i < c; i++) {
            e[i] = expf(e[i] - m);
            z += e[i];
        }
        float inv = 1.0f / z;
        for (int i = 0; i < c; i++) e[i] *= inv;
        m1[row] = m;
        l1[row] = z;
    }
    __syncthreads();
    // The consumer loops run to the constant bound, unrolled, so that acc stays in registers;
    // n is the same in every thread.
    for_chunks(col, d) {
        float acc[PHASE1_CONSUMERS][CHUNK];
        #pragma unroll
        for (int g = 0; g < PHASE1_CONSUMERS; g++)
            for (int e = 0; e < CHUNK; e++) acc[g][e] = 0.0f;
        for (int i = 0; i < c; i++) {
            float x[CHUNK];
            load_chunk(x, sources + i * plane + at + col, d - col);
            #pragma unroll
            for (int g = 0; g < PHASE1_CONSUMERS; g++) {
                if (g >= n) continue;
                for (int e = 0; e < CHUNK; e++) acc[g][e] += weights[g * c + i] * x[e];
            }
        }
        #pragma unroll
        for (int g = 0; g < PHASE1_CONSUMERS; g++)
            if (g < n) store_chunk(o1 + ((size_t)(j0 + g) * rows + t) * d + col, acc[g], d - col);
    }
}
extern "C" __global__ void depth_phase1(float* logits, float* m1, float* l1, float* o1,
                                        const float* sources, const float* rstds, const float* ws,
                                        int rows, int d, int c, int s) {
    depth_phase1_t(logits, m1, l1, o1, sources, rstds, ws, rows, d, c, s);
}
extern "C" __global__ void depth_phase1_bf16(float* logits, float* m1, float* l1, bf16* o1,
                                             const bf16* sources, const float* rstds,
                                             const float* ws, int rows, int d, int c, int s) {
    depth_phase1_t(logits, m1, l1, o1, sources, rstds, ws, rows, d, c, s);
}

// Phase 2 of one consumer, fused with what comes before and after it: the consumer's input h
// from its rows of phase 1 (o1 [rows, d], logits1 [rows, c], m1, l1) and, inside a block, its
// partial sum, then h's RMSNorm y with gain g (1/rms into rstd), as the sublayer (or the final
// norm) takes it. The partial sum is made first, in place in `p`, which holds the output of the
// sublayer before: p += prev, the sum before it (prev null: the block's second sublayer reads
// that output alone), and its 1/rms goes to pr; then it is merged by online softmax. p null:
// a block's first consumer, whose h is o1. The weights and logits over its k = c (+1)
// sources, completed first, go to alpha and logits. Each thread reads back only the values it
// wrote, as they were rounded, which is what backward reads.
template <typename T>
__device__ void depth_input_t(T* h, T* y, float* rstd, float* alpha, float* logits, T* p,
                              float* pr, const T* prev, const T* o1, const float* logits1,
                              const float* m1, const float* l1, const float* w, const float* g,
                              int d, int c, float eps) {
    int t = blockIdx.x, k = c + (p != 0);
    size_t at = (size_t)t * d;
    float m = m1[t], z = l1[t];
    if (p) {
        T* pt = p + at;
        if (prev)
            for_chunks(col, d) {
                float x[CHUNK], y[CHUNK];
                load_chunk(x, pt + col, d - col);
                load_chunk(y, prev + at + col, d - col);
                for (int e = 0; e < CHUNK; e++) x[e] += y[e];
                store_chunk(pt + col, x, d - col);
            }
        // Its 1/rms and its dot product with the query, summed together.
        float sums[2] = {0.0f, 0.0f};
        for_chunks(col, d) {
            float x[CHUNK], wc[CHUNK];
            load_chunk(x, pt + col, d - col);
            load_chunk(wc, w + col, d - col);
            for (int e = 0; e < CHUNK; e++) {
                sums[0] += x[e] * x[e];
                sums[1] += wc[e] * x[e];
            }
        }
        block_sums(sums);
        float r = 1.0f / sqrtf(sums[0] / (float)d + eps);
        // Squares past f32's range: row_rstd takes them again in f64.
        if (r == 0.0f) r = row_rstd(pt, d, eps);
        float lp = r * sums[1];
        float mm = fmaxf(m, lp);
        float s1 = expf(m - mm) * z, sp = expf(lp - mm);
        z = s1 + sp;
        m = mm;
        float a1 = s1 / z, ap = sp / z;
        for_chunks(col, d) {
            float x[CHUNK], y[CHUNK];
            load_chunk(x, o1 + at + col, d - col);
            load_chunk(y, pt + col, d - col);
            for (int e = 0; e < CHUNK; e++) x[e] = a1 * x[e] + ap * y[e];
            store_chunk(h + at + col, x, d - col);
        }
        if (threadIdx.x == 0) {
            pr[t] = r;
            alpha[(size_t)t * k + c] = ap;
            logits[(size_t)t * k + c] = lp;
        }
    } else {
        for_chunks(col, d) {
            float x[CHUNK];
            load_chunk(x, o1 + at + col, d - col);
            store_chunk(h + at + col, x, d - col);
        }
    }
    for (int i = threadIdx.x; i < c; i += blockDim.x) {
        float l = logits1[(size_t)t * c + i];
        logits[(size_t)t * k + i] = l;
        alpha[(size_t)t * k + i] = expf(l - m) / z;
    }
    float r = norm_row(y + at, h + at, g, d, eps);
    if (threadIdx.x == 0) rstd[t] = r;
}
extern "C" __global__ void depth_input(float* h, float* y, float* rstd, float* alpha,
                                       float* logits, float* p, float* pr, const float* prev,
                                       const float* o1, const float* logits1, const float* m1,
                                       const float* l1, const float* w, const float* g, int d,
                                       int c, float eps) {
    depth_input_t(h, y, rstd, alpha, logits, p, pr, prev, o1, logits1, m1, l1, w, g, d, c, eps);
}
extern "C" __global__ void depth_input_bf16(bf16* h, bf16* y, float* rstd, float* alpha,
                                            float* logits, bf16* p, float* pr, const bf16* prev,
                                            const bf16* o1, const float* logits1, const float* m1,
                                            const float* l1, const float* w, const float* g,
                                            int d, int c, float eps) {
    depth_input_t(h, y, rstd, alpha, logits, p, pr, prev, o1, logits1, m1, l1, w, g, d, c, eps);
}

// y = a * b, n values: a consumer's effective query q * gamma.
extern "C" __global__ void depth_query(float* y, const float* a, const float* b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] * b[i];
}

// y += a * b, n values: the gradient of q (a = dw, b = gamma) or of gamma (b = q).
extern "C" __global__ void depth_query_grad(float* y, const float* a, const float* b, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += a[i] * b[i];
}

// The backward of a consumer that reads a partial sum, through its input's RMSNorm and into
// the partial sum, in one pass per token. First the norm's, as rmsnorm_backward takes it: from
// dy, the gradient of the normalised input (h the input, with 1/rms rstd and gain g), into dh,
// and <dh, h> into dhh. Then the partial sum p's gradient (1/rms pr, at the last of the
// consumer's k columns of alpha and logits; query w), added into acc, the gradient of the
// block's earlier outputs, as depth_source_grads adds a single reader's:
//   dl = alpha (<dh, p> - dhh),  b = dl pr,  acc += alpha dh + b w - (pr^2 / d) dl logit p.
// Each block takes `per_block` consecutive tokens and sums their shares of the gain's gradient
// (dy h rstd) and of the query's (b p) in shared memory (two rows of sums, row_slot), written
// to rows blockIdx.x and gridDim.x + blockIdx.x of `parts` ([2 * gridDim.x, d]).
template <typename T>
__device__ void depth_partial_backward_t(T* dh, float* dhh, T* acc, float* parts, const T* dy,
                                         const T* h, const float* g, const float* rstd,
                                         const T* p, const float* pr, const float* alpha,
                                         const float* logits, const float* w, int k, int rows,
                                         int d, int per_block) {
    DYNAMIC_SHARED(float, gain);
    float* query = gain + (d + CHUNK - 1) / CHUNK * CHUNK;
    row_sums_clear(gain, d);
    row_sums_clear(query, d);
    for (int t = rows_from(per_block); t < rows_to(per_block, rows); t++) {
        size_t at = (size_t)t * d;
        norm_backward_row(dh + at, gain, dy + at, h + at, g, rstd[t], d, 0);
        // <dh, h> and <dh, p> summed together, of the values of dh each thread stored, as they
        // were rounded, as the completed sources' gradients will read them.
        float dots[2] = {0.0f, 0.0f};
        for_chunks(c, d) {
            float x[CHUNK], y[CHUNK], v[CHUNK];
            load_chunk(x, dh + at + c, d - c);
            load_chunk(y, h + at + c, d - c);
            load_chunk(v, p + at + c, d - c);
            for (int e = 0; e < CHUNK; e++) {
                dots[0] += x[e] * y[e];
                dots[1] += x[e] * v[e];
            }
        }
        block_sums(dots);
        float s = dots[0], a = alpha[(size_t)t * k + k - 1], r = pr[t];
        float dl = a * (dots[1] - s);
        float b = dl * r;
        float cv = dl * logits[(size_t)t * k + k - 1] * r * r / (float)d;
        if (threadIdx.x == 0) dhh[t] = s;
        for_chunks(c, d) {
            float x[CHUNK], v[CHUNK], wc[CHUNK], out[CHUNK];
            load_chunk(out, acc + at + c, d - c);
            load_chunk(x, dh + at + c, d - c);
            load_chunk(v, p + at + c, d - c);
            load_chunk(wc, w + c, d - c);
            for (int e = 0; e < CHUNK; e++) {
                out[e] = out[e] + (a * x[e] + b * wc[e]) - cv * v[e];
                query[row_slot(c, e, d)] += b * v[e];
            }
            store_chunk(acc + at + c, out, d - c);
        }
    }
    row_sums_store(parts + (size_t)blockIdx.x * d, gain, d);
    row_sums_store(parts + (size_t)(gridDim.x + blockIdx.x) * d, query, d);
}
extern "C" __global__ void depth_partial_backward(float* dh, float* dhh, float* acc, float* parts,
                                                  const float* dy, const float* h, const float* g,
                                                  const float* rstd, const float* p,
                                                  const float* pr, const float* alpha,
                                                  const float* logits, const float* w, int k,
                                                  int rows, int d, int per_block) {
    depth_partial_backward_t(dh, dhh, acc, parts, dy, h, g, rstd, p, pr, alpha, logits, w, k,
                             rows, d, per_block);
}
extern "C" __global__ void depth_partial_backward_bf16(bf16* dh, float* dhh, bf16* acc,
                                                       float* parts, const bf16* dy, const bf16* h,
                                                       const float* g, const float* rstd,
                                                       const bf16* p, const float* pr,
                                                       const float* alpha, const float* logits,
                                                       const float* w, int k, int rows, int d,
                                                       int per_block) {
    depth_partial_backward_t(dh, dhh, acc, parts, dy, h, g, rstd, p, pr, alpha, logits, w, k,
                             rows, d, per_block);
}

// The gradients of `sources` completed sources, from `first` on, from `readers` readers at once:
// the sources' values v [sources, rows, d] (from source `first`) with their 1/rms rstd
// [sources, rows]; source s sits at column first + s of every reader's k weights. Per token,
// source and reader, with dh the gradient of the reader's input h and dhh = <dh, h>:
//   dl = alpha (<dh, v> - dhh),  b = dl r,  out += alpha dh + b w,  coef += dl logit,
// then out -= (r^2 / d) coef v (the key norm's term); b goes to bs for the query's gradient (the
// sum over tokens of b v: a product, taken after). Each source is read once and its gradient
// written once (added to what it holds with `accumulate`), the sums in f32 in shared memory (a
// row of sums, row_slot). The buffers come from a table of addresses: per reader dh, dhh,
// alpha, logits and w (each field `readers` long, one after another), then each source's
// gradient. Reader i's b for source s goes to row rows_of[i] of bs + s * b_stride
// ([consumers, rows] per source), and its weights are ks[i] wide. The readers go eight at a
// time, their dot products with the source summed together (block_sums). One block per
// token.
template <typename T>
__device__ void depth_source_grads_t(T* bs, const long long* tables, const int* ks,
                                     const int* rows_of, int readers, int sources, const T* v,
                                     const float* rstd, int first, long long b_stride, int rows,
                                     int d, int accumulate) {
    DYNAMIC_SHARED(float, acc);
    int t = blockIdx.x;
    size_t at = (size_t)t * d;
    for (int s = 0; s < sources; s++) {
        T* out = (T*)tables[5 * readers + s] + at;
        const T* vr = v + (size_t)s * rows * d + at;
        int col = first + s;
        for_chunks(c, d) {
            float x[CHUNK];
            if (accumulate) load_chunk(x, out + c, d - c);
            for (int e = 0; e < CHUNK; e++) acc[row_slot(c, e, d)] = accumulate ? x[e] : 0.0f;
        }
        float r = rstd[(size_t)s * rows + t], coef = 0.0f;
        // Eight readers at a time: their dot products with the source summed together.
        for (int i0 = 0; i0 < readers; i0 += 8) {
            int m = readers - i0 < 8 ? readers - i0 : 8;
            float dots[8];
            #pragma unroll
            for (int g = 0; g < 8; g++) dots[g] = 0.0f;
            for_chunks(c, d) {
                float x[CHUNK];
                load_chunk(x, vr + c, d - c);
                #pragma unroll
                for (int g = 0; g < 8; g++) {
                    if (g >= m) continue;
                    float y[CHUNK];
                    load_chunk(y, (const T*)tables[i0 + g] + at + c, d - c);
                    for (int e = 0; e < CHUNK; e++) dots[g] += y[e] * x[e];
                }
            }
            block_sums(dots);
            float a[8], b[8];
            #pragma unroll
            for (int g = 0; g < 8; g++) {
                a[g] = b[g] = 0.0f;
                if (g >= m) continue;
                int i = i0 + g;
                const float* dhh = (const float*)tables[readers + i];
                const float* alpha = (const float*)tables[2 * readers + i];
                const float* logits = (const float*)tables[3 * readers + i];
                size_t k = (size_t)ks[i];
                a[g] = alpha[t * k + col];
                // A reader of one source weighs it 1 whatever the logit: no gradient flows
                // through the logit (on the CPU, the two dot products cancel exactly).
                float dl = k == 1 ? 0.0f : a[g] * (dots[g] - dhh[t]);
                b[g] = dl * r;
                coef += dl * logits[t * k + col];
                size_t at_b = s * b_stride + (size_t)rows_of[i] * rows + t;
                if (threadIdx.x == 0) bs[at_b] = from_f32<T>(b[g]);
            }
            for_chunks(c, d) {
                float sum[CHUNK];
                for (int e = 0; e < CHUNK; e++) sum[e] = acc[row_slot(c, e, d)];
                #pragma unroll
                for (int g = 0; g < 8; g++) {
                    if (g >= m) continue;
                    float x[CHUNK], wc[CHUNK];
                    load_chunk(x, (const T*)tables[i0 + g] + at + c, d - c);
                    load_chunk(wc, (const float*)tables[4 * readers + i0 + g] + c, d - c);
                    for (int e = 0; e < CHUNK; e++) sum[e] += a[g] * x[e] + b[g] * wc[e];
                }
                for (int e = 0; e < CHUNK; e++) acc[row_slot(c, e, d)] = sum[e];
            }
        }
        float cv = coef * r * r / (float)d;
        for_chunks(c, d) {
            float x[CHUNK];
            load_chunk(x, vr + c, d - c);
            for (int e = 0; e < CHUNK; e++) x[e] = acc[row_slot(c, e, d)] - cv * x[e];
            store_chunk(out + c, x, d - c);
        }
    }
}
extern "C" __global__ void depth_source_grads(float* bs, const long long* tables, const int* ks,
                                              const int* rows_of, int readers, int sources,
                                              const float* v, const float* rstd, int first,
                                              long long b_stride, int rows, int d,
                                              int accumulate) {
    depth_source_grads_t(bs, tables, ks, rows_of, readers, sources, v, rstd, first, b_stride,
                         rows, d, accumulate);
}
extern "C" __global__ void depth_source_grads_bf16(bf16* bs, const long long* tables,
                                                   const int* ks, const int* rows_of, int readers,
                                                   int sources, const bf16* v, const float* rstd,
                                                   int first, long long b_stride, int rows, int d,
                                                   int accumulate) {
    depth_source_grads_t(bs, tables, ks, rows_of, readers, sources, v, rstd, first, b_stride,
                         rows, d, accumulate);
}
