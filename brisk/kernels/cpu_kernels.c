/* brisk's CPU kernels, compiled at first use by brisk/kernels/cpu_kernels.py with the system C compiler
 * (-O3 -march=native -ffast-math -fopenmp; linked without -ffast-math, see cpu_kernels.py) and called through
 * ctypes:
 *
 * brisk_decode_attention: paged decode attention, one new query token per sequence, read against the sequence's
 * KV blocks where they lie in the cache (no gather, no padded copy), online softmax in fp32, GQA, sliding window,
 * attention sinks.
 * brisk_rms_norm: RMSNorm of rows, in fp32 whatever the input dtype (Hugging Face's numerics), in one call
 * instead of the half dozen ops torch's CPU rms_norm runs.
 * brisk_clamped_swiglu: gpt-oss's expert activation in one pass instead of eight elementwise ops.
 * brisk_linear: a few rows times a weight (bf16 or fp32), streaming the weight at memory speed (up to 8 rows
 * per pass with AVX512-BF16 dot products where the CPU has them, else one row per pass): decode steps of a few
 * sequences read every weight once, and oneDNN's and MKL's matmuls read them at half that speed or less at a
 * few rows (docs/performance.md).
 *
 * -ffast-math assumes finite values: nothing here relies on infinities (the running max starts at -FLT_MAX,
 * masked keys are never visited), and a sequence whose own cache holds NaN only poisons its own output.
 *
 * Attention layouts (element offsets): q[row * q_stride + head * head_dim + i] fp32; out likewise (out_stride);
 * caches [num_blocks, block_size, num_kv_heads, head_dim] in fp32 or bf16; block_tables[seq * table_stride + j]
 * int32; seq_lens[seq] int32 = context length including the new token, whose position is seq_len - 1.
 * rows[s] / seq_ids[s]: the q/out row and the table/seq_lens row of the s-th sequence computed (NULL: s).
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#ifdef __AVX512BF16__
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t x) {
    uint32_t bits = (uint32_t)x << 16; /* bf16 is the top half of an fp32 */
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t bits;
    memcpy(&bits, &f, sizeof(bits));
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float x) { return bf16_to_float(float_to_bf16(x)); }

static inline void load_row(const void *cache, int cache_is_bf16, int64_t offset, int d, float *dst) {
    if (cache_is_bf16) {
        const uint16_t *src = (const uint16_t *)cache + offset;
        for (int i = 0; i < d; i++) dst[i] = bf16_to_float(src[i]);
    } else {
        memcpy(dst, (const float *)cache + offset, (size_t)d * sizeof(float));
    }
}

/* A cache row as fp32: read in place from an fp32 cache, converted into buf from a bf16 one. */
static inline const float *cache_row(const void *cache, int cache_is_bf16, int64_t offset, int d, float *buf) {
    if (!cache_is_bf16) return (const float *)cache + offset;
    load_row(cache, 1, offset, d, buf);
    return buf;
}

/* One (sequence, KV head): its query heads against the sequence's keys and values. Inlined with a constant d
 * for the common head sizes, so the loops over d compile to fixed, fully vectorized code. */
static inline __attribute__((always_inline)) void attend(
    const int s, const int kvh, const int d, const float *q, int64_t q_stride, float *out, int64_t out_stride,
    const int32_t *rows, const int32_t *seq_ids, const void *k_cache, const void *v_cache, int cache_is_bf16,
    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, const float *sinks, int group,
    int num_kv_heads, int block_size, float scale, int window) {
    const int row = rows ? rows[s] : s, seq = seq_ids ? seq_ids[s] : s;
    const int len = seq_lens[seq];
    const int first = (window > 0 && len > window) ? len - window : 0;
    const int32_t *table = block_tables + (int64_t)seq * table_stride;
    const float *qh = q + (int64_t)row * q_stride + (int64_t)kvh * group * d;
    float acc[group * d], probs[group * block_size], kbuf[d], vbuf[d];
    float run_max[group], run_sum[group], block_max[group];
    memset(acc, 0, sizeof(acc));
    for (int g = 0; g < group; g++) {
        /* A sink is one more logit in the softmax denominator with no value: start the running max at it
         * and the running sum at exp(sink - max) = 1. */
        run_max[g] = sinks ? sinks[kvh * group + g] : -FLT_MAX;
        run_sum[g] = sinks ? 1.0f : 0.0f;
    }
    for (int pos = first; pos < len;) {
        const int64_t block = table[pos / block_size];
        const int offset = pos % block_size;
        const int n = block_size - offset < len - pos ? block_size - offset : len - pos;
        for (int g = 0; g < group; g++) block_max[g] = -FLT_MAX;
        for (int t = 0; t < n; t++) {
            const float *krow = cache_row(k_cache, cache_is_bf16,
                                          ((block * block_size + offset + t) * num_kv_heads + kvh) * d, d, kbuf);
            for (int g = 0; g < group; g++) {
                float dot = 0.0f;
                for (int i = 0; i < d; i++) dot += qh[g * d + i] * krow[i];
                dot *= scale;
                probs[g * block_size + t] = dot;
                block_max[g] = dot > block_max[g] ? dot : block_max[g];
            }
        }
        for (int g = 0; g < group; g++) {
            const float new_max = run_max[g] > block_max[g] ? run_max[g] : block_max[g];
            const float rescale = expf(run_max[g] - new_max);
            run_max[g] = new_max;
            run_sum[g] *= rescale;
            for (int i = 0; i < d; i++) acc[g * d + i] *= rescale;
            float *p = probs + g * block_size;
            for (int t = 0; t < n; t++) p[t] = expf(p[t] - new_max);
            for (int t = 0; t < n; t++) run_sum[g] += p[t];
        }
        for (int t = 0; t < n; t++) {
            const float *vrow = cache_row(v_cache, cache_is_bf16,
                                          ((block * block_size + offset + t) * num_kv_heads + kvh) * d, d, vbuf);
            for (int g = 0; g < group; g++) {
                const float w = probs[g * block_size + t];
                for (int i = 0; i < d; i++) acc[g * d + i] += w * vrow[i];
            }
        }
        pos += n;
    }
    float *oh = out + (int64_t)row * out_stride + (int64_t)kvh * group * d;
    for (int g = 0; g < group; g++) {
        const float inv = 1.0f / run_sum[g];
        for (int i = 0; i < d; i++) oh[g * d + i] = acc[g * d + i] * inv;
    }
}

void brisk_decode_attention(const float *q, int64_t q_stride, float *out, int64_t out_stride,
                            const int32_t *rows, const int32_t *seq_ids, const void *k_cache,
                            const void *v_cache, int cache_is_bf16, const int32_t *block_tables,
                            int64_t table_stride, const int32_t *seq_lens, const float *sinks, int num_seqs,
                            int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                            int window, int num_threads) {
    const int group = num_heads / num_kv_heads;
#define ATTEND(D) attend(s, kvh, D, q, q_stride, out, out_stride, rows, seq_ids, k_cache, v_cache, cache_is_bf16, \
                         block_tables, table_stride, seq_lens, sinks, group, num_kv_heads, block_size, scale, window)
#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int s = 0; s < num_seqs; s++) {
        for (int kvh = 0; kvh < num_kv_heads; kvh++) {
            switch (head_dim) {
                case 64: ATTEND(64); break;
                case 128: ATTEND(128); break;
                case 32: ATTEND(32); break;
                default: ATTEND(head_dim);
            }
        }
    }
#undef ATTEND
}

/* out[r] = norm(x[r]) for rows of `hidden` values: x * rsqrt(mean(x^2) + eps) in fp32, then times the weight.
 * weight_in_fp32: multiply in fp32 and round once (gpt-oss); else round to the model dtype, multiply, round
 * (Llama, Qwen3). x, out: bf16 when is_bf16 else fp32, rows `stride` elements apart; weight likewise typed. */
void brisk_rms_norm(const void *x, int64_t x_stride, void *out, int64_t out_stride, const void *weight,
                    int is_bf16, int weight_in_fp32, int rows, int hidden, float eps) {
    float w[hidden];
    load_row(weight, is_bf16, 0, hidden, w);
    for (int r = 0; r < rows; r++) {
        float row[hidden];
        load_row(x, is_bf16, (int64_t)r * x_stride, hidden, row);
        float sum = 0.0f;
        for (int i = 0; i < hidden; i++) sum += row[i] * row[i];
        const float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        if (!is_bf16) {
            float *dst = (float *)out + (int64_t)r * out_stride;
            for (int i = 0; i < hidden; i++) dst[i] = w[i] * (row[i] * inv);
        } else {
            uint16_t *dst = (uint16_t *)out + (int64_t)r * out_stride;
            if (weight_in_fp32)
                for (int i = 0; i < hidden; i++) dst[i] = float_to_bf16(w[i] * (row[i] * inv));
            else
                for (int i = 0; i < hidden; i++) dst[i] = float_to_bf16(w[i] * round_bf16(row[i] * inv));
        }
    }
}

/* gpt-oss's activation of gate_up rows: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate,
 * limit), with gate i / up i at columns i / inter + i (halves) or 2i / 2i + 1 (interleaved). bf16 rows are rounded
 * after every op, as torch's eager bf16 ops round (tests: identical to them). */
void brisk_clamped_swiglu(const void *gate_up, int64_t in_stride, void *out, int64_t out_stride, int is_bf16,
                          int halves, int rows, int inter, float alpha, float limit) {
    const int gate_step = halves ? 1 : 2, up_offset = halves ? inter : 1;
    for (int r = 0; r < rows; r++) {
        float gate[inter], up[inter], act[inter];
        if (is_bf16) {
            const uint16_t *src = (const uint16_t *)gate_up + (int64_t)r * in_stride;
            for (int i = 0; i < inter; i++) {
                gate[i] = bf16_to_float(src[i * gate_step]);
                up[i] = bf16_to_float(src[i * gate_step + up_offset]);
            }
        } else {
            const float *src = (const float *)gate_up + (int64_t)r * in_stride;
            for (int i = 0; i < inter; i++) {
                gate[i] = src[i * gate_step];
                up[i] = src[i * gate_step + up_offset];
            }
        }
        for (int i = 0; i < inter; i++) {
            const float g = gate[i] < limit ? gate[i] : limit;
            const float u = up[i] < -limit ? -limit : (up[i] > limit ? limit : up[i]);
            if (is_bf16) {
                const float sig = round_bf16(1.0f / (1.0f + expf(-round_bf16(g * alpha))));
                act[i] = round_bf16(round_bf16(u + 1.0f) * round_bf16(g * sig));
            } else {
                act[i] = (u + 1.0f) * (g * (1.0f / (1.0f + expf(-(g * alpha)))));
            }
        }
        if (is_bf16) {
            uint16_t *dst = (uint16_t *)out + (int64_t)r * out_stride;
            for (int i = 0; i < inter; i++) dst[i] = float_to_bf16(act[i]);
        } else {
            memcpy((float *)out + (int64_t)r * out_stride, act, sizeof(act));
        }
    }
}

/* y[m, n] = bias[n] + sum_k x[m, k] * w[n, k] for a few rows m: x [M, K] (rows x_stride apart), w [N, K] row-major,
 * bias [N] or NULL, y [M, N] (rows y_stride apart), all bf16 (is_bf16) or all fp32; products summed in fp32, bf16
 * rounded once at the end (as torch's bf16 matmul does). Rows of w are split over threads. */

static inline float row_dot(const float *xf, const void *w, int is_bf16, int64_t n, int K) {
    float acc = 0.0f;
    if (is_bf16) {
        const uint16_t *row = (const uint16_t *)w + n * K;
        for (int k = 0; k < K; k++) acc += xf[k] * bf16_to_float(row[k]);
    } else {
        const float *row = (const float *)w + n * K;
        for (int k = 0; k < K; k++) acc += xf[k] * row[k];
    }
    return acc;
}

/* Any CPU, any K: one row at a time (each row one pass over the weight). */
static void linear_by_row(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int64_t y_stride,
                          int M, int N, int K, int is_bf16, int num_threads) {
    for (int m = 0; m < M; m++) {
        float xf[K];
        load_row(x, is_bf16, (int64_t)m * x_stride, K, xf);
#pragma omp parallel for schedule(static) num_threads(num_threads)
        for (int n = 0; n < N; n++) {
            float acc = row_dot(xf, w, is_bf16, n, K);
            if (is_bf16) {
                acc += bias ? bf16_to_float(((const uint16_t *)bias)[n]) : 0.0f;
                ((uint16_t *)y + (int64_t)m * y_stride)[n] = float_to_bf16(acc);
            } else {
                ((float *)y + (int64_t)m * y_stride)[n] = acc + (bias ? ((const float *)bias)[n] : 0.0f);
            }
        }
    }
}

#ifdef __AVX512BF16__
/* bf16 with K a multiple of 32 on CPUs with AVX512-BF16: up to 8 rows in one pass over the weight, each row's
 * products accumulated by dot-product instructions in its own named register (an indexed array of accumulators
 * is kept in memory by the compiler: a store-load chain per instruction, measured 2x slower). */
#define ACC(r)                                                                                                   \
    if (R > r) a##r = _mm512_dpbf16_ps(a##r, (__m512bh)_mm512_loadu_si512(x + r * x_stride + k), wv);
#define OUT(r)                                                                                                   \
    if (R > r) y[r * y_stride + n] = float_to_bf16(_mm512_reduce_add_ps(a##r) + b);
#define BF16_ROWS(ROWS)                                                                                          \
    static void bf16_rows_##ROWS(const uint16_t *x, int64_t x_stride, const uint16_t *w, const uint16_t *bias,   \
                                 uint16_t *y, int64_t y_stride, int N, int K, int num_threads) {                 \
        const int R = ROWS;                                                                                      \
        _Pragma("omp parallel for schedule(static) num_threads(num_threads)")                                    \
        for (int n = 0; n < N; n++) {                                                                            \
            const uint16_t *row = w + (int64_t)n * K;                                                            \
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;      \
            for (int k = 0; k < K; k += 32) {                                                                    \
                const __m512bh wv = (__m512bh)_mm512_loadu_si512(row + k);                                       \
                ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5) ACC(6) ACC(7)                                          \
            }                                                                                                    \
            const float b = bias ? bf16_to_float(bias[n]) : 0.0f;                                                \
            OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5) OUT(6) OUT(7)                                              \
        }                                                                                                        \
    }
BF16_ROWS(1) BF16_ROWS(2) BF16_ROWS(3) BF16_ROWS(4) BF16_ROWS(5) BF16_ROWS(6) BF16_ROWS(7) BF16_ROWS(8)
#undef ACC
#undef OUT
#undef BF16_ROWS
#endif

/* The number of rows brisk_linear takes in one pass over the weight (else: 1, each row a pass of its own). */
int brisk_linear_rows_per_pass(int is_bf16, int K) {
#ifdef __AVX512BF16__
    if (is_bf16 && K % 32 == 0) return 8;
#endif
    (void)is_bf16, (void)K;
    return 1;
}

void brisk_linear(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int64_t y_stride, int M,
                  int N, int K, int is_bf16, int num_threads) {
#ifdef __AVX512BF16__
    if (is_bf16 && K % 32 == 0) {
        static void (*const by_rows[8])(const uint16_t *, int64_t, const uint16_t *, const uint16_t *, uint16_t *,
                                        int64_t, int, int, int) = {bf16_rows_1, bf16_rows_2, bf16_rows_3, bf16_rows_4,
                                                                   bf16_rows_5, bf16_rows_6, bf16_rows_7, bf16_rows_8};
        for (int m = 0; m < M; m += 8) {
            const int rows = M - m < 8 ? M - m : 8;
            by_rows[rows - 1]((const uint16_t *)x + (int64_t)m * x_stride, x_stride, (const uint16_t *)w,
                              (const uint16_t *)bias, (uint16_t *)y + (int64_t)m * y_stride, y_stride, N, K,
                              num_threads);
        }
        return;
    }
#endif
    linear_by_row(x, x_stride, w, bias, y, y_stride, M, N, K, is_bf16, num_threads);
}
