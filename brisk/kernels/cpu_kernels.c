/* brisk's CPU kernels, compiled at first use by brisk/kernels/cpu_kernels.py with the system C compiler for one
 * x86 instruction set: the "avx512" build (-march=native on a CPU with AVX-512) or the "avx2" build (-march=native
 * -mno-avx512f: AVX2 + FMA, also how an AVX-512 machine tests the code other CPUs run). Both with -O3 -ffast-math
 * -fopenmp, linked without -ffast-math (see cpu_kernels.py), called through ctypes. The matmul has hand-written
 * kernels for each instruction set; the other kernels are loops over contiguous fp32 that the compiler vectorizes
 * for the target (16 or 8 lanes; bf16 widened by a shift), expf through glibc's vector math library.
 *
 * brisk_decode_attention: paged decode attention, one new query token per sequence, read against the sequence's
 * KV blocks where they lie in the cache (no gather, no padded copy), online softmax in fp32, GQA, sliding window,
 * attention sinks.
 * brisk_rms_norm: RMSNorm of rows, in fp32 whatever the input dtype (Hugging Face's numerics), in one call
 * instead of the half dozen ops torch's CPU rms_norm runs.
 * brisk_clamped_swiglu: gpt-oss's expert activation in one pass instead of eight elementwise ops.
 * brisk_silu_and_mul: Llama's MLP activation (silu(gate) * up) in one pass instead of two ops.
 * brisk_linear: a decode step's rows times a weight (bf16 or fp32), reading the weight once per call: 8 rows per
 * pass over L2-sized weight tiles (AVX-512: bf16 with AVX512-BF16 dot products where the CPU has them; AVX2: bf16
 * widened to fp32 and FMA); fp32 from 3 rows on with AVX-512: all rows past each group of 4 weight rows, 6 rows x 4
 * weight rows a pass (fp32_blocks512). oneDNN's and MKL's matmuls read a weight at half that speed or less at a few
 * rows (docs/performance.md).
 * brisk_moe_experts: gpt-oss's experts for a decode step's tokens in one call (sort by expert, matmuls, activation,
 * weighted sum).
 * brisk_sample_rows: one random token per row of logits by inverse transform (one uniform draw per row).
 * brisk_row_max_argmax: each row's max and the index of its first max (greedy decoding), as torch.max(dim=-1).
 * brisk_apply_token_bitmask: structured outputs' mask, -inf where a row's grammar bitmask forbids the token.
 * brisk_vector_bits: 512 or 256, the build's instruction set (cpu_kernels.py checks it is the one asked for).
 *
 * -ffast-math assumes finite values: nothing here relies on infinities (the running max starts at -FLT_MAX,
 * masked keys are never visited), and a sequence whose own cache holds NaN only poisons its own output.
 *
 * Attention layouts (element offsets): q[row * q_stride + head * head_dim + i] fp32; out likewise (out_stride);
 * caches [num_blocks, block_size, num_kv_heads, head_dim] in fp32, bf16 or FP8 E4M3 (cache_dtype: CACHE_*); an FP8
 * cache is decoded by e4m3_to_float times its static per-KV-head scales k_scales / v_scales [num_kv_heads] (NULL:
 * 1), the K scale folded into the score scale and the V scale applied to the output (attention is linear in V), so
 * accumulation stays fp32; block_tables[seq * table_stride + j]
 * int32; seq_lens[seq] int32 = context length including the new token, whose position is seq_len - 1.
 * rows[s] / seq_ids[s]: the q/out row and the table/seq_lens row of the s-th sequence computed (NULL: s).
 */
#if !(defined(__AVX2__) && defined(__FMA__))
#error "brisk's CPU kernels need AVX2 and FMA (cpu_kernels.py builds them only for such CPUs; others run PyTorch ops)"
#endif
#include <float.h>
#include <math.h>
#include <omp.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
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

enum { CACHE_FP32 = 0, CACHE_BF16 = 1, CACHE_FP8_E4M3 = 2 };

/* An E4M3 (float8_e4m3fn) code as fp32, exactly, by integer ops: a loop over a row vectorizes it, one select per
 * lane (a 256-entry table lookup compiled to gathers: with AVX-512, FP8 rows were read 1.6x slower than bf16 ones,
 * whose conversion is a shift). Exponent field e > 0: rebias the exponent (bias 7 -> 127) and widen the 3 mantissa
 * bits; e = 0: the subnormal m * 2^-9, through an int -> float conversion, so no fp32 subnormal arises (the result
 * never depends on the denormals-are-zero flag); 0x7F / 0xFF are NaN (E4M3fn has no infinity). The selects are on
 * integers, which -ffinite-math-only leaves alone. */
static inline float e4m3_to_float(uint8_t code) {
    const uint32_t magnitude = code & 0x7Fu;
    const float subnormal = (float)(magnitude & 7u) * 0x1p-9f;
    uint32_t subnormal_bits, bits;
    memcpy(&subnormal_bits, &subnormal, sizeof(subnormal_bits));
    bits = magnitude >= 8u ? (magnitude << 20) + (120u << 23) : subnormal_bits;
    bits = magnitude == 0x7Fu ? 0x7FC00000u : bits;
    bits |= (uint32_t)(code & 0x80u) << 24;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

/* A cache row as fp32: read in place from an fp32 cache, converted into buf from a bf16 or FP8 one (unscaled). */
static inline const float *cache_row(const void *cache, int cache_dtype, int64_t offset, int d, float *buf) {
    if (cache_dtype == CACHE_FP32) return (const float *)cache + offset;
    if (cache_dtype == CACHE_BF16) {
        load_row(cache, 1, offset, d, buf);
    } else {
        const uint8_t *src = (const uint8_t *)cache + offset;
        for (int i = 0; i < d; i++) buf[i] = e4m3_to_float(src[i]);
    }
    return buf;
}

/* One (sequence, KV head): its query heads against the sequence's keys and values. Inlined with a constant d
 * for the common head sizes, so the loops over d compile to fixed, fully vectorized code. */
static inline __attribute__((always_inline)) void attend(
    const int s, const int kvh, const int d, const float *q, int64_t q_stride, float *out, int64_t out_stride,
    const int32_t *rows, const int32_t *seq_ids, const void *k_cache, const void *v_cache, int cache_dtype,
    const float *k_scales, const float *v_scales, const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, const float *sinks, int group,
    int num_kv_heads, int block_size, float scale, int window) {
    const int row = rows ? rows[s] : s, seq = seq_ids ? seq_ids[s] : s;
    const int len = seq_lens[seq];
    const int first = (window > 0 && len > window) ? len - window : 0;
    const int32_t *table = block_tables + (int64_t)seq * table_stride;
    const float *qh = q + (int64_t)row * q_stride + (int64_t)kvh * group * d;
    float acc[group * d], probs[group * block_size], kbuf[d], vbuf[d];
    float run_max[group], run_sum[group], block_max[group];
    const float k_scale = scale * (k_scales ? k_scales[kvh] : 1.0f), v_scale = v_scales ? v_scales[kvh] : 1.0f;
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
            const float *krow = cache_row(k_cache, cache_dtype,
                                          ((block * block_size + offset + t) * num_kv_heads + kvh) * d, d, kbuf);
            for (int g = 0; g < group; g++) {
                float dot = 0.0f;
                for (int i = 0; i < d; i++) dot += qh[g * d + i] * krow[i];
                dot *= k_scale;
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
            const float *vrow = cache_row(v_cache, cache_dtype,
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
        const float inv = v_scale / run_sum[g];
        for (int i = 0; i < d; i++) oh[g * d + i] = acc[g * d + i] * inv;
    }
}

void brisk_decode_attention(const float *q, int64_t q_stride, float *out, int64_t out_stride,
                            const int32_t *rows, const int32_t *seq_ids, const void *k_cache,
                            const void *v_cache, int cache_dtype, const float *k_scales,
                            const float *v_scales, const int32_t *block_tables,
                            int64_t table_stride, const int32_t *seq_lens, const float *sinks, int num_seqs,
                            int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                            int window, int num_threads) {
    const int group = num_heads / num_kv_heads;
#define ATTEND(D) attend(s, kvh, D, q, q_stride, out, out_stride, rows, seq_ids, k_cache, v_cache, cache_dtype, \
                         k_scales, v_scales, block_tables, table_stride, seq_lens, sinks, group, num_kv_heads, block_size, scale, window)
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

/* sigmoid(x) = 1 / (1 + exp(-x)) without ever exponentiating a positive number: e^x / (1 + e^x) for x < 0. The
 * plain form overflows exp to +inf below x = -88.7, where the exact 1 / inf = 0 is not what runs: -ffast-math lets
 * GCC vectorize the division as a reciprocal estimate (vrcp14ps / vrcpps) refined by a Newton step, r * (2 - d * r),
 * which for d = inf computes inf * 0 = NaN. Here the denominator stays in [1, 2]. */
static inline float sigmoid(float x) {
    const float e = expf(-fabsf(x));
    return (x < 0.0f ? e : 1.0f) / (1.0f + e);
}

/* gpt-oss's activation of gate_up rows: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate,
 * limit), with gate i / up i at columns i / inter + i (halves) or 2i / 2i + 1 (interleaved). g has no lower clamp:
 * random (dummy) MXFP4 experts reach gates of -1000 and below, where the sigmoid underflows to 0 (see sigmoid).
 * bf16 rows are rounded after every op, as torch's eager bf16 ops round (tests: identical to them). */
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
                const float sig = round_bf16(sigmoid(round_bf16(g * alpha)));
                act[i] = round_bf16(round_bf16(u + 1.0f) * round_bf16(g * sig));
            } else {
                act[i] = (u + 1.0f) * (g * sigmoid(g * alpha));
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

/* Structured outputs: logits[row, t] = -inf where bit t of bitmask[row] is 0 (t < vocab), for the listed rows
 * (xgrammar's bitmask layout: int32 words, bit j of word w is token 32 w + j). A word at a time: words that allow
 * all 32 tokens are skipped, the rest select per lane (vectorized). The logits are handled as their bit patterns
 * (uint32), so -ffast-math's finite-math assumption never meets the infinity written. */
void brisk_apply_token_bitmask(void *logits, int64_t logits_stride, const int32_t *bitmask, int64_t bitmask_stride,
                               const int64_t *rows, int num_rows, int vocab, int num_threads) {
    const uint32_t neg_inf = 0xFF800000u;
    const int full = vocab / 32, rest = vocab % 32;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int r = 0; r < num_rows; r++) {
        uint32_t *x = (uint32_t *)logits + rows[r] * logits_stride;
        const uint32_t *words = (const uint32_t *)bitmask + rows[r] * bitmask_stride;
        for (int w = 0; w < full; w++) {
            const uint32_t bits = words[w];
            if (bits == 0xFFFFFFFFu) continue;
            uint32_t *xw = x + 32 * w;
            for (int j = 0; j < 32; j++) xw[j] = (bits >> j) & 1u ? xw[j] : neg_inf;
        }
        if (rest) {
            const uint32_t bits = words[full];
            uint32_t *xw = x + 32 * full;
            for (int j = 0; j < rest; j++) xw[j] = (bits >> j) & 1u ? xw[j] : neg_inf;
        }
    }
}

/* Llama's MLP activation of gate_up rows [gate | up] (inter columns each): silu(gate) * up in one pass instead of
 * torch's silu and mul over the two halves. silu(g) = g * sigmoid(g) (see sigmoid). bf16 rounds where torch's eager
 * ops round: the silu, then the product. */
void brisk_silu_and_mul(const void *gate_up, int64_t in_stride, void *out, int64_t out_stride, int is_bf16, int rows,
                        int inter) {
    for (int r = 0; r < rows; r++) {
        if (is_bf16) {
            const uint16_t *src = (const uint16_t *)gate_up + (int64_t)r * in_stride;
            uint16_t *dst = (uint16_t *)out + (int64_t)r * out_stride;
            for (int i = 0; i < inter; i++) {
                const float g = bf16_to_float(src[i]);
                dst[i] = float_to_bf16(round_bf16(g * sigmoid(g)) * bf16_to_float(src[inter + i]));
            }
        } else {
            const float *src = (const float *)gate_up + (int64_t)r * in_stride;
            float *dst = (float *)out + (int64_t)r * out_stride;
            for (int i = 0; i < inter; i++) dst[i] = src[i] * sigmoid(src[i]) * src[inter + i];
        }
    }
}

/* y[m, n] = bias[n] + sum_k x[m, k] * w[n, k] for the rows m of a decode step: x [M, K] (rows x_stride apart),
 * w [N, K] row-major, bias [N] or NULL, y [M, N] (rows y_stride apart), all bf16 (is_bf16) or all fp32; products
 * summed in fp32, bf16 rounded once at the end (as torch's bf16 matmul does).
 *
 * Up to 8 rows of x pass over weight rows [n0, n1) together: each weight vector is loaded once for all of them and
 * each row's products accumulate in their own named register (an indexed array of accumulators is kept in memory
 * by the compiler: a store-load chain per instruction, measured 2x slower). */
typedef void (*rows_fn)(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int64_t y_stride,
                        int n0, int n1, int K);

#if defined(__AVX512F__) && defined(__AVX512BW__)
/* AVX-512: 16 fp32 lanes; K needs no particular multiple: the last chunk of a row is loaded masked, zeros beyond K.
 * bf16 uses the AVX512-BF16 dot-product instruction (two products per fp32 lane) where the CPU has it; without it
 * bf16 takes the AVX2 kernels below. */
/* The sums of 4 accumulators by one fixed tree, the same for each of the 4 slots: the fp32 kernels below reduce a
 * single accumulator with it too (hsum4_512(a, a, a, a)), so that 1-2 rows and the 4 x 6 blocks from 3 rows on
 * round alike. */
static inline __m128 hsum4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), hi);
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

#define ROWS512_KERNEL(NAME, ROWS, T, LANES, MASK_T, LOAD, FMA, STORE)                                         \
    static void NAME##_##ROWS(const void *xv, int64_t x_stride, const void *wv, const void *biasv, void *yv,        \
                              int64_t y_stride, int n0, int n1, int K) {                                            \
        const T *x = (const T *)xv, *w = (const T *)wv, *bias = (const T *)biasv;                                   \
        T *y = (T *)yv;                                                                                             \
        const int R = ROWS, full = K - K % LANES;                                                                   \
        const MASK_T all = (MASK_T)~(MASK_T)0, tail = (MASK_T)((((uint64_t)1) << (K % LANES)) - 1);                 \
        for (int n = n0; n < n1; n++) {                                                                             \
            const T *row = w + (int64_t)n * K;                                                                      \
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;         \
            for (int k = 0; k < full; k += LANES) {                                                                 \
                const __m512i wk = LOAD(all, row + k);                                                              \
                ACC512(0, all, LOAD, FMA) ACC512(1, all, LOAD, FMA) ACC512(2, all, LOAD, FMA)                       \
                ACC512(3, all, LOAD, FMA) ACC512(4, all, LOAD, FMA) ACC512(5, all, LOAD, FMA)                       \
                ACC512(6, all, LOAD, FMA) ACC512(7, all, LOAD, FMA)                                                 \
            }                                                                                                       \
            if (tail) {                                                                                             \
                const int k = full;                                                                                 \
                const __m512i wk = LOAD(tail, row + k);                                                             \
                ACC512(0, tail, LOAD, FMA) ACC512(1, tail, LOAD, FMA) ACC512(2, tail, LOAD, FMA)                    \
                ACC512(3, tail, LOAD, FMA) ACC512(4, tail, LOAD, FMA) ACC512(5, tail, LOAD, FMA)                    \
                ACC512(6, tail, LOAD, FMA) ACC512(7, tail, LOAD, FMA)                                               \
            }                                                                                                       \
            STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) STORE(6) STORE(7)                                 \
        }                                                                                                           \
    }
#define ACC512(r, mask, LOAD, FMA) if (R > r) a##r = FMA(a##r, LOAD(mask, x + r * x_stride + k), wk);

#define FP32_LOAD512(mask, p) _mm512_castps_si512(_mm512_maskz_loadu_ps(mask, p))
#define FP32_FMA512(acc, xk, wk) _mm512_fmadd_ps(_mm512_castsi512_ps(xk), _mm512_castsi512_ps(wk), acc)
#define FP32_STORE512(r) \
    if (R > r) y[r * y_stride + n] = _mm_cvtss_f32(hsum4_512(a##r, a##r, a##r, a##r)) + (bias ? bias[n] : 0.0f);
#define FP32_ROWS512(ROWS) \
    ROWS512_KERNEL(fp32_rows512, ROWS, float, 16, __mmask16, FP32_LOAD512, FP32_FMA512, FP32_STORE512)
FP32_ROWS512(1) FP32_ROWS512(2) FP32_ROWS512(3) FP32_ROWS512(4)
FP32_ROWS512(5) FP32_ROWS512(6) FP32_ROWS512(7) FP32_ROWS512(8)
static const rows_fn fp32_rows512[8] = {fp32_rows512_1, fp32_rows512_2, fp32_rows512_3, fp32_rows512_4,
                                        fp32_rows512_5, fp32_rows512_6, fp32_rows512_7, fp32_rows512_8};

/* fp32 from 3 rows on (AVX-512; at 1-2 rows a weight of K = 2880 streamed 10% slower than through the kernel
 * above): 4 weight rows x up to 6 rows of x at a time, 24 accumulators. Each vector loaded serves 4 or 6 FMAs
 * (10 loads for 24 FMAs; the one-weight-row kernel above loads 9 for 8 FMAs and runs at the load ports' speed).
 * All M rows pass over a group of 4 weight rows before the next group, so the weight streams from memory once
 * while its 8-32 KB sit in L1, the next group prefetched during the first pass (tiling for L2 and passing 8 rows
 * at a time read it from memory on the first pass only, with the FMAs waiting). An accumulator sums its products
 * in k order and hsum4_512 reduces the 4 of a row by one fixed tree whatever slot a weight row sits in, the tree
 * the 1-2 row kernel above uses: a row's result depends neither on the other rows of the step nor on how the
 * weight rows are split among threads. Past the last weight row, a group repeats it (sums not stored). */

#define TAIL_LOAD512(p) _mm512_maskz_loadu_ps(tail, p)
#define BLOCK512_ROW(r, LOADX)                                                                                     \
    if (R > r) {                                                                                                   \
        const __m512 xr = LOADX(x + r * x_stride + k);                                                             \
        a##r##0 = _mm512_fmadd_ps(xr, v0, a##r##0), a##r##1 = _mm512_fmadd_ps(xr, v1, a##r##1);                   \
        a##r##2 = _mm512_fmadd_ps(xr, v2, a##r##2), a##r##3 = _mm512_fmadd_ps(xr, v3, a##r##3);                   \
    }
#define BLOCK512_STORE(r)                                                                                          \
    if (R > r) {                                                                                                   \
        float sums[4];                                                                                             \
        _mm_storeu_ps(sums, hsum4_512(a##r##0, a##r##1, a##r##2, a##r##3));                                        \
        for (int j = 0; j < nw; j++) y[r * y_stride + n + j] = sums[j] + (bias ? bias[n + j] : 0.0f);              \
    }

/* y[0:R, n:n+nw] for weight rows w0..w3 (nw of them distinct), R <= 6 rows of x (a constant once inlined); next:
 * the 4 weight rows to prefetch meanwhile, or NULL. */
static inline __attribute__((always_inline)) void fp32_block512(const int R, const float *x, int64_t x_stride,
                                                                const float *w0, const float *w1, const float *w2,
                                                                const float *w3, const float *bias, float *y,
                                                                int64_t y_stride, int n, int nw, int K,
                                                                const float *next) {
    const int full = K - K % 16;
    const __mmask16 tail = (__mmask16)((1u << (K % 16)) - 1);
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m512 a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    __m512 a40 = a00, a41 = a00, a42 = a00, a43 = a00, a50 = a00, a51 = a00, a52 = a00, a53 = a00;
    int k = 0;
    for (; k < full; k += 16) {
        const __m512 v0 = _mm512_loadu_ps(w0 + k), v1 = _mm512_loadu_ps(w1 + k);
        const __m512 v2 = _mm512_loadu_ps(w2 + k), v3 = _mm512_loadu_ps(w3 + k);
        if (next) {
            _mm_prefetch((const char *)(next + k), _MM_HINT_T0);
            _mm_prefetch((const char *)(next + K + k), _MM_HINT_T0);
            _mm_prefetch((const char *)(next + 2 * K + k), _MM_HINT_T0);
            _mm_prefetch((const char *)(next + 3 * K + k), _MM_HINT_T0);
        }
        BLOCK512_ROW(0, _mm512_loadu_ps) BLOCK512_ROW(1, _mm512_loadu_ps) BLOCK512_ROW(2, _mm512_loadu_ps)
        BLOCK512_ROW(3, _mm512_loadu_ps) BLOCK512_ROW(4, _mm512_loadu_ps) BLOCK512_ROW(5, _mm512_loadu_ps)
    }
    if (tail) {
        const __m512 v0 = TAIL_LOAD512(w0 + k), v1 = TAIL_LOAD512(w1 + k);
        const __m512 v2 = TAIL_LOAD512(w2 + k), v3 = TAIL_LOAD512(w3 + k);
        BLOCK512_ROW(0, TAIL_LOAD512) BLOCK512_ROW(1, TAIL_LOAD512) BLOCK512_ROW(2, TAIL_LOAD512)
        BLOCK512_ROW(3, TAIL_LOAD512) BLOCK512_ROW(4, TAIL_LOAD512) BLOCK512_ROW(5, TAIL_LOAD512)
    }
    BLOCK512_STORE(0) BLOCK512_STORE(1) BLOCK512_STORE(2) BLOCK512_STORE(3) BLOCK512_STORE(4) BLOCK512_STORE(5)
}

/* All M rows x weight rows [n0, n1) (see fp32_block512). */
static void fp32_blocks512(const float *x, int64_t x_stride, const float *w, const float *bias, float *y,
                           int64_t y_stride, int M, int n0, int n1, int K) {
    for (int n = n0; n < n1; n += 4) {
        const int nw = n1 - n < 4 ? n1 - n : 4;
        const float *w0 = w + (int64_t)n * K, *w1 = w0 + (int64_t)(nw > 1 ? 1 : 0) * K;
        const float *w2 = w0 + (int64_t)(nw > 2 ? 2 : nw - 1) * K, *w3 = w0 + (int64_t)(nw - 1) * K;
        const float *next = n + 8 <= n1 ? w0 + 4 * (int64_t)K : NULL;
        for (int m = 0; m < M; m += 6) {
            const float *xm = x + (int64_t)m * x_stride;
            float *ym = y + (int64_t)m * y_stride;
            const float *pf = m ? NULL : next;
            switch (M - m < 6 ? M - m : 6) {
            case 1: fp32_block512(1, xm, x_stride, w0, w1, w2, w3, bias, ym, y_stride, n, nw, K, pf); break;
            case 2: fp32_block512(2, xm, x_stride, w0, w1, w2, w3, bias, ym, y_stride, n, nw, K, pf); break;
            case 3: fp32_block512(3, xm, x_stride, w0, w1, w2, w3, bias, ym, y_stride, n, nw, K, pf); break;
            case 4: fp32_block512(4, xm, x_stride, w0, w1, w2, w3, bias, ym, y_stride, n, nw, K, pf); break;
            case 5: fp32_block512(5, xm, x_stride, w0, w1, w2, w3, bias, ym, y_stride, n, nw, K, pf); break;
            default: fp32_block512(6, xm, x_stride, w0, w1, w2, w3, bias, ym, y_stride, n, nw, K, pf); break;
            }
        }
    }
}

#ifdef __AVX512BF16__
#define BF16_LOAD512(mask, p) _mm512_maskz_loadu_epi16(mask, p)
#define BF16_FMA512(acc, xk, wk) _mm512_dpbf16_ps(acc, (__m512bh)(xk), (__m512bh)(wk))
#define BF16_STORE512(r)                                                                                          \
    if (R > r) y[r * y_stride + n] = float_to_bf16(_mm512_reduce_add_ps(a##r) + (bias ? bf16_to_float(bias[n]) : 0.0f));
#define BF16_ROWS512(ROWS) \
    ROWS512_KERNEL(bf16_rows512, ROWS, uint16_t, 32, __mmask32, BF16_LOAD512, BF16_FMA512, BF16_STORE512)
BF16_ROWS512(1) BF16_ROWS512(2) BF16_ROWS512(3) BF16_ROWS512(4)
BF16_ROWS512(5) BF16_ROWS512(6) BF16_ROWS512(7) BF16_ROWS512(8)
static const rows_fn bf16_rows512[8] = {bf16_rows512_1, bf16_rows512_2, bf16_rows512_3, bf16_rows512_4,
                                        bf16_rows512_5, bf16_rows512_6, bf16_rows512_7, bf16_rows512_8};
#endif
#endif

/* AVX2 + FMA: 8 fp32 lanes. x always comes in fp32 (bf16 rows are widened once per call, see brisk_linear); bf16
 * weights are widened to fp32 by a shift (bf16 is the top half of an fp32), so every product is exact in fp32 and
 * summed by FMA. Columns go in chunks of KC256, so the 8 rows' chunk of x (32 KB) stays in L1 while the tile's
 * weight rows pass (whole rows of x fell out of L1 at gpt-oss's K = 2880: 4x slower at 32 rows); partial sums per
 * (row, weight row) in `sums`. Up to 4 rows take two accumulators a row (two weight vectors per iteration): one
 * FMA chain a row waits on the FMA latency (measured: half the memory speed at 1 row). The last K % 8 columns of a
 * row are summed in scalar code. */
static inline float hsum256(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    return _mm_cvtss_f32(_mm_add_ss(lo, _mm_movehdup_ps(lo)));
}

#define KC256 1024
#define ROWS256_KERNEL(NAME, ROWS, TW, LOADW, W_TO_FLOAT, STORE)                                                     \
    static void NAME##_##ROWS(const void *xv, int64_t x_stride, const void *wv, const void *biasv, void *yv,        \
                              int64_t y_stride, int n0, int n1, int K) {                                            \
        const float *x = (const float *)xv;                                                                         \
        const TW *w = (const TW *)wv, *bias = (const TW *)biasv;                                                    \
        TW *y = (TW *)yv;                                                                                           \
        const int R = ROWS, width = n1 - n0;                                                                        \
        float sums[ROWS * width];                                                                                   \
        memset(sums, 0, sizeof(sums));                                                                              \
        for (int k0 = 0; k0 < K; k0 += KC256) {                                                                     \
            const int k1 = k0 + KC256 < K ? k0 + KC256 : K;                                                         \
            const int end16 = k0 + (k1 - k0) / 16 * 16, end8 = k0 + (k1 - k0) / 8 * 8;                             \
            for (int n = n0; n < n1; n++) {                                                                         \
                const TW *row = w + (int64_t)n * K;                                                                 \
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;     \
                __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;                                                          \
                int k = k0;                                                                                         \
                if (R <= 4)                                                                                         \
                    for (; k < end16; k += 16) {                                                                    \
                        const __m256 wk = LOADW(row + k), wk2 = LOADW(row + k + 8);                                 \
                        ACC2(0) ACC2(1) ACC2(2) ACC2(3)                                                             \
                    }                                                                                               \
                for (; k < end8; k += 8) {                                                                          \
                    const __m256 wk = LOADW(row + k);                                                               \
                    ACC256(0) ACC256(1) ACC256(2) ACC256(3) ACC256(4) ACC256(5) ACC256(6) ACC256(7)                 \
                }                                                                                                   \
                float *s = sums + (n - n0);                                                                         \
                for (; k < k1; k++)                                                                                 \
                    for (int r = 0; r < R; r++) s[r * width] += x[r * x_stride + k] * W_TO_FLOAT(row[k]);          \
                a0 = _mm256_add_ps(a0, b0), a1 = _mm256_add_ps(a1, b1);                                             \
                a2 = _mm256_add_ps(a2, b2), a3 = _mm256_add_ps(a3, b3);                                             \
                SUM256(0) SUM256(1) SUM256(2) SUM256(3) SUM256(4) SUM256(5) SUM256(6) SUM256(7)                     \
            }                                                                                                       \
        }                                                                                                           \
        for (int r = 0; r < R; r++)                                                                                 \
            for (int n = n0; n < n1; n++) STORE(r, n, sums[r * width + n - n0]);                                    \
    }
#define ACC2(r)                                                                         \
    if (R > r) {                                                                        \
        a##r = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * x_stride + k), wk, a##r);        \
        b##r = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * x_stride + k + 8), wk2, b##r);   \
    }
#define ACC256(r) if (R > r) a##r = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * x_stride + k), wk, a##r);
#define SUM256(r) if (R > r) s[r * width] += hsum256(a##r);
#define FP32_LOAD256(p) _mm256_loadu_ps(p)
#define FLOAT_AS_IS(v) (v)
#define FP32_STORE256(r, n, sum) y[r * y_stride + n] = sum + (bias ? bias[n] : 0.0f);
#define BF16_LOAD256(p) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define BF16_STORE256(r, n, sum) y[r * y_stride + n] = float_to_bf16(sum + (bias ? bf16_to_float(bias[n]) : 0.0f));
#define FP32_ROWS256(ROWS) ROWS256_KERNEL(fp32_rows256, ROWS, float, FP32_LOAD256, FLOAT_AS_IS, FP32_STORE256)
#define BF16_ROWS256(ROWS) ROWS256_KERNEL(bf16_rows256, ROWS, uint16_t, BF16_LOAD256, bf16_to_float, BF16_STORE256)
FP32_ROWS256(1) FP32_ROWS256(2) FP32_ROWS256(3) FP32_ROWS256(4)
FP32_ROWS256(5) FP32_ROWS256(6) FP32_ROWS256(7) FP32_ROWS256(8)
BF16_ROWS256(1) BF16_ROWS256(2) BF16_ROWS256(3) BF16_ROWS256(4)
BF16_ROWS256(5) BF16_ROWS256(6) BF16_ROWS256(7) BF16_ROWS256(8)
static const rows_fn fp32_rows256[8] __attribute__((unused)) = {
    fp32_rows256_1, fp32_rows256_2, fp32_rows256_3, fp32_rows256_4,
    fp32_rows256_5, fp32_rows256_6, fp32_rows256_7, fp32_rows256_8};
static const rows_fn bf16_rows256[8] __attribute__((unused)) = {
    bf16_rows256_1, bf16_rows256_2, bf16_rows256_3, bf16_rows256_4,
    bf16_rows256_5, bf16_rows256_6, bf16_rows256_7, bf16_rows256_8};

/* The kernels for this dtype in this build; *x_in_fp32: they take x in fp32 whatever the dtype. */
static const rows_fn *vector_rows(int is_bf16, int *x_in_fp32) {
    *x_in_fp32 = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
#ifdef __AVX512BF16__
    if (is_bf16) return bf16_rows512;
#endif
    if (!is_bf16) return fp32_rows512;
#else
    if (!is_bf16) return fp32_rows256;
#endif
    *x_in_fp32 = 1;
    return bf16_rows256;
}

/* All M rows against the weight, 8 at a time. Each thread takes tiles of weight rows small enough (~256 KB) to stay
 * in its L2 cache while every group of 8 rows passes over them: the weight is read from memory once per call.
 * x_elt / elt: the bytes of an element of x / of the weight and y. */
static void linear_tiled(const rows_fn by_rows[8], size_t x_elt, size_t elt, const char *x, int64_t x_stride,
                         const void *w, const void *bias, char *y, int64_t y_stride, int M, int N, int K,
                         int num_threads) {
    int tile = (int)((256 << 10) / ((size_t)K * elt));
    const int per_thread = (N + num_threads - 1) / num_threads;
    if (tile > per_thread) tile = per_thread;
    if (tile > 512) tile = 512; /* bounds the AVX2 kernels' partial sums on the stack (8 x 512 floats) */
    if (tile < 1) tile = 1;
    const int num_tiles = (N + tile - 1) / tile;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int t = 0; t < num_tiles; t++) {
        const int n0 = t * tile, n1 = n0 + tile < N ? n0 + tile : N;
        for (int m = 0; m < M; m += 8) {
            const int rows = M - m < 8 ? M - m : 8;
            by_rows[rows - 1](x + (size_t)m * x_stride * x_elt, x_stride, w, bias, y + (size_t)m * y_stride * elt,
                              y_stride, n0, n1, K);
        }
    }
}

int brisk_vector_bits(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return 512;
#else
    return 256;
#endif
}

void brisk_linear(const void *x, int64_t x_stride, const void *w, const void *bias, void *y, int64_t y_stride, int M,
                  int N, int K, int is_bf16, int num_threads) {
    const size_t elt = is_bf16 ? 2 : 4;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (!is_bf16 && M >= 3) {
        /* weight rows split among the threads in groups of 4 */
        const int groups = (N + 3) / 4, per_thread = (groups + num_threads - 1) / num_threads;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
        for (int t = 0; t < num_threads; t++) {
            const int n0 = t * per_thread * 4, n1 = n0 + per_thread * 4 < N ? n0 + per_thread * 4 : N;
            if (n0 < n1)
                fp32_blocks512((const float *)x, x_stride, (const float *)w, (const float *)bias, (float *)y,
                               y_stride, M, n0, n1, K);
        }
        return;
    }
#endif
    int x_in_fp32;
    const rows_fn *by_rows = vector_rows(is_bf16, &x_in_fp32);
    if (!x_in_fp32 || !is_bf16) {
        linear_tiled(by_rows, elt, elt, x, x_stride, w, bias, y, y_stride, M, N, K, num_threads);
        return;
    }
    float *xf = malloc((size_t)M * K * sizeof(float)); /* a decode step's rows: at most 64 x K */
    for (int m = 0; m < M; m++) load_row(x, 1, (int64_t)m * x_stride, K, xf + (size_t)m * K);
    linear_tiled(by_rows, sizeof(float), elt, (const char *)xf, K, w, bias, y, y_stride, M, N, K, num_threads);
    free(xf);
}

/* ---- MXFP4 (gpt-oss's experts) ------------------------------------------------------------------------------------
 * A weight [N, K] as stored in the checkpoint: blocks uint8 [N, K / 32, 16] (two E2M1 codes a byte, the low nibble
 * the even element), scales uint8 [N, K / 32] (E8M0: 2^(byte - 127)), value = E2M1 * scale (layers/mxfp4.py).
 * brisk_mxfp4_linear reads the blocks and scales where they lie and decodes them in registers, reading 4.25 bits a
 * weight once per call. Per block and weight row: the 16-entry E2M1 table times the block's scale (exact: a power
 * of two), the low and the high nibbles looked up in it (vpermps: 16 lanes with AVX-512; AVX2's 8-lane one takes
 * the magnitudes, the sign bit set from bit 3), each vector FMA'd with the x elements its lanes hold: x is regrouped
 * once per call (MXFP4_REGROUP), in fp32 whatever its dtype. AVX-512 broadcasts the block's 16 bytes to the four
 * 128-bit lanes and shifts each lane's dwords by 0, 8, 16 or 24 bits (+ 4 for the high nibbles): lane 4j + q then
 * holds byte 4q + j, with no byte-to-dword widening on the shuffle port (measured: 4.3 -> 3.5 cycles a block and
 * weight row at one row; vdpbf16ps on bf16 lookups (vpermw) ran slower still, 5.3). Every product is exact in fp32
 * and only the order of the sums differs from torch's matmul of the dequantized weight (tests: to fp32 rounding).
 * Up to MXFP4_ROWS rows of x pass over 4 (AVX-512) or 2 (AVX2) weight rows together, a block decoded once for all
 * of them; more rows pass again over an L2-sized tile of weight rows.
 * brisk_mxfp4_dequantize: the weight in bf16 or fp32 (what dequantize_mxfp4 computes), for prompt-sized matmuls. */
#define MXFP4_BLOCK 32
#define MXFP4_ROWS 4
static const float E2M1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
/* 2^(byte - 127) as fp32 bits: byte 0 is the subnormal 2^-127, 255 is +inf (as dequantize_mxfp4's exp2). */
#define E8M0_4(s) (s) << 23, (s + 1) << 23, (s + 2) << 23, (s + 3) << 23
#define E8M0_16(s) E8M0_4(s), E8M0_4(s + 4), E8M0_4(s + 8), E8M0_4(s + 12)
#define E8M0_64(s) E8M0_16(s), E8M0_16(s + 16), E8M0_16(s + 32), E8M0_16(s + 48)
static const union {
    uint32_t bits[256];
    float value[256];
} E8M0 = {{0x00400000u, 1u << 23, 2u << 23, 3u << 23, E8M0_4(4u), E8M0_4(8u), E8M0_4(12u), E8M0_16(16u),
           E8M0_16(32u), E8M0_16(48u), E8M0_64(64u), E8M0_64(128u), E8M0_64(192u)}};

/* Sums of R rows of x against 4 / 2 weight rows (w[j]: the blocks, s[j]: the scales of weight row j), into sums[r][j]. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define MXFP4_WROWS 4
/* Regrouped position p of a block holds element MXFP4_REGROUP(p): lane L = 4j + q of the low nibbles holds byte
 * 4q + j (its element 2 (4q + j)), then the high nibbles' lanes. */
#define MXFP4_REGROUP(p) (2 * (4 * ((p) % 16 % 4) + (p) % 16 / 4) + (p) / 16)
#define MXFP4_SUMS512(r) if (R > r) _mm_storeu_ps(sums[r], hsum4_512(a##r##0, a##r##1, a##r##2, a##r##3));
static inline __attribute__((always_inline)) void mxfp4_sums_fp32(const int R, const float *x, int64_t x_stride,
                                                                  const uint8_t *const w[4], const uint8_t *const s[4],
                                                                  int G, float sums[][4]) {
    const __m512 lut = _mm512_loadu_ps(E2M1);
    const __m512i lo_shift = _mm512_set_epi32(24, 24, 24, 24, 16, 16, 16, 16, 8, 8, 8, 8, 0, 0, 0, 0);
    const __m512i hi_shift = _mm512_add_epi32(lo_shift, _mm512_set1_epi32(4));
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m512 a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    for (int g = 0; g < G; g++) {
#define MXFP4_FP32_DECODE(j)                                                                               \
    const __m512i d##j = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(w[j] + 16 * g)));       \
    const __m512 t##j = _mm512_mul_ps(lut, _mm512_set1_ps(E8M0.value[s[j][g]]));                          \
    const __m512 lo##j = _mm512_permutexvar_ps(_mm512_srlv_epi32(d##j, lo_shift), t##j);                   \
    const __m512 hi##j = _mm512_permutexvar_ps(_mm512_srlv_epi32(d##j, hi_shift), t##j);
        MXFP4_FP32_DECODE(0) MXFP4_FP32_DECODE(1) MXFP4_FP32_DECODE(2) MXFP4_FP32_DECODE(3)
#undef MXFP4_FP32_DECODE
#define MXFP4_FP32_ROW(r)                                                                                  \
    if (R > r) {                                                                                           \
        const __m512 xe = _mm512_loadu_ps(x + r * x_stride + MXFP4_BLOCK * g), xo = _mm512_loadu_ps(x + r * x_stride + MXFP4_BLOCK * g + 16); \
        a##r##0 = _mm512_fmadd_ps(hi0, xo, _mm512_fmadd_ps(lo0, xe, a##r##0));                             \
        a##r##1 = _mm512_fmadd_ps(hi1, xo, _mm512_fmadd_ps(lo1, xe, a##r##1));                             \
        a##r##2 = _mm512_fmadd_ps(hi2, xo, _mm512_fmadd_ps(lo2, xe, a##r##2));                             \
        a##r##3 = _mm512_fmadd_ps(hi3, xo, _mm512_fmadd_ps(lo3, xe, a##r##3));                             \
    }
        MXFP4_FP32_ROW(0) MXFP4_FP32_ROW(1) MXFP4_FP32_ROW(2) MXFP4_FP32_ROW(3)
#undef MXFP4_FP32_ROW
    }
    MXFP4_SUMS512(0) MXFP4_SUMS512(1) MXFP4_SUMS512(2) MXFP4_SUMS512(3)
#undef MXFP4_SUMS512
}
#else
#define MXFP4_WROWS 2
/* Regrouped: a block's 16 even elements (the low nibbles of its bytes in order), then its 16 odd ones. */
#define MXFP4_REGROUP(p) (2 * ((p) % 16) + (p) / 16)
/* The weights of one block as fp32: e[0], e[1] its even elements 0-14 and 16-30, o[0], o[1] the odd ones. */
static inline __attribute__((always_inline)) void mxfp4_decode256(const uint8_t *p, float scale, __m256 e[2],
                                                                  __m256 o[2]) {
    const __m256 lut = _mm256_mul_ps(_mm256_loadu_ps(E2M1), _mm256_set1_ps(scale)); /* the 8 magnitudes */
    const __m256i sign = _mm256_set1_epi32((int)0x80000000u);
    for (int h = 0; h < 2; h++) {
        const __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8 * h)));
        const __m256i hi = _mm256_srli_epi32(d, 4);
        e[h] = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, d), _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 28), sign)));
        o[h] = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, hi), _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(d, 24), sign)));
    }
}
static inline __attribute__((always_inline)) void mxfp4_sums_fp32(const int R, const float *x, int64_t x_stride,
                                                                  const uint8_t *const w[2], const uint8_t *const s[2],
                                                                  int G, float sums[][4]) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (int g = 0; g < G; g++) {
        __m256 e[2], o[2];
#define MXFP4_AVX2_ROW(r, j)                                                                                     \
    if (R > r) {                                                                                                 \
        const float *xr = x + r * x_stride + MXFP4_BLOCK * g;                                                    \
        a##r##j = _mm256_fmadd_ps(e[0], _mm256_loadu_ps(xr), a##r##j);                                            \
        a##r##j = _mm256_fmadd_ps(e[1], _mm256_loadu_ps(xr + 8), a##r##j);                                       \
        a##r##j = _mm256_fmadd_ps(o[0], _mm256_loadu_ps(xr + 16), a##r##j);                                      \
        a##r##j = _mm256_fmadd_ps(o[1], _mm256_loadu_ps(xr + 24), a##r##j);                                      \
    }
        mxfp4_decode256(w[0] + 16 * g, E8M0.value[s[0][g]], e, o);
        MXFP4_AVX2_ROW(0, 0) MXFP4_AVX2_ROW(1, 0) MXFP4_AVX2_ROW(2, 0) MXFP4_AVX2_ROW(3, 0)
        mxfp4_decode256(w[1] + 16 * g, E8M0.value[s[1][g]], e, o);
        MXFP4_AVX2_ROW(0, 1) MXFP4_AVX2_ROW(1, 1) MXFP4_AVX2_ROW(2, 1) MXFP4_AVX2_ROW(3, 1)
#undef MXFP4_AVX2_ROW
    }
#define MXFP4_SUMS256(r) if (R > r) sums[r][0] = hsum256(a##r##0), sums[r][1] = hsum256(a##r##1);
    MXFP4_SUMS256(0) MXFP4_SUMS256(1) MXFP4_SUMS256(2) MXFP4_SUMS256(3)
#undef MXFP4_SUMS256
}
#endif

/* y[m, n] for the R rows of x from row m0 and weight rows [n, n + nw) (nw <= MXFP4_WROWS; missing ones repeat the
 * last, their sums not stored). */
static inline __attribute__((always_inline)) void mxfp4_rows(const int R, const float *x, int64_t x_stride, int m0,
                                                             const uint8_t *blocks, const uint8_t *scales,
                                                             const void *bias, void *y, int64_t y_stride, int y_bf16,
                                                             int n, int nw, int G) {
    const uint8_t *w[MXFP4_WROWS], *s[MXFP4_WROWS];
    for (int j = 0; j < MXFP4_WROWS; j++) {
        const int64_t row = n + (j < nw ? j : nw - 1);
        w[j] = blocks + row * G * 16, s[j] = scales + row * G;
    }
    float sums[MXFP4_ROWS][4];
    mxfp4_sums_fp32(R, x + m0 * x_stride, x_stride, w, s, G, sums);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < nw; j++) {
            const int64_t at = (int64_t)(m0 + r) * y_stride + n + j;
            if (y_bf16)
                ((uint16_t *)y)[at] = float_to_bf16(sums[r][j] + (bias ? bf16_to_float(((const uint16_t *)bias)[n + j]) : 0.0f));
            else
                ((float *)y)[at] = sums[r][j] + (bias ? ((const float *)bias)[n + j] : 0.0f);
        }
}

void brisk_mxfp4_linear(const void *x, int64_t x_stride, const uint8_t *blocks, const uint8_t *scales,
                        const void *bias, void *y, int64_t y_stride, int M, int N, int K, int is_bf16,
                        int num_threads) {
    const int G = K / MXFP4_BLOCK;
    float *regrouped = malloc((size_t)M * K * sizeof(float)); /* x in fp32, each block regrouped */
    for (int m = 0; m < M; m++) {
        float row[K], *dst = regrouped + (size_t)m * K;
        load_row(x, is_bf16, (int64_t)m * x_stride, K, row);
        for (int g = 0; g < G; g++)
            for (int p = 0; p < MXFP4_BLOCK; p++) dst[MXFP4_BLOCK * g + p] = row[MXFP4_BLOCK * g + MXFP4_REGROUP(p)];
    }
    /* Tiles of weight rows that stay in L2 (~128 KB of blocks) while every group of rows of x passes over them. */
    int tile = (int)((128 << 10) / ((size_t)G * 17));
    const int per_thread = (N + num_threads - 1) / num_threads;
    if (tile > per_thread) tile = per_thread;
    tile = (tile + MXFP4_WROWS - 1) / MXFP4_WROWS * MXFP4_WROWS;
    const int num_tiles = (N + tile - 1) / tile;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int t = 0; t < num_tiles; t++) {
        const int n0 = t * tile, n1 = n0 + tile < N ? n0 + tile : N;
        for (int m = 0; m < M; m += MXFP4_ROWS)
            for (int n = n0; n < n1; n += MXFP4_WROWS) {
                const int nw = n1 - n < MXFP4_WROWS ? n1 - n : MXFP4_WROWS;
                switch (M - m < MXFP4_ROWS ? M - m : MXFP4_ROWS) {
                case 1: mxfp4_rows(1, regrouped, K, m, blocks, scales, bias, y, y_stride, is_bf16, n, nw, G); break;
                case 2: mxfp4_rows(2, regrouped, K, m, blocks, scales, bias, y, y_stride, is_bf16, n, nw, G); break;
                case 3: mxfp4_rows(3, regrouped, K, m, blocks, scales, bias, y, y_stride, is_bf16, n, nw, G); break;
                default: mxfp4_rows(4, regrouped, K, m, blocks, scales, bias, y, y_stride, is_bf16, n, nw, G); break;
                }
            }
    }
    free(regrouped);
}

/* out [rows, G * 32] = the weight in bf16 (is_bf16, rounded to nearest even) or fp32, rows split among threads. */
void brisk_mxfp4_dequantize(const uint8_t *blocks, const uint8_t *scales, void *out, int64_t rows, int G, int is_bf16,
                            int num_threads) {
    const int64_t num_blocks = rows * G;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t b = 0; b < num_blocks; b++) {
        const uint8_t *p = blocks + 16 * b;
        const float scale = E8M0.value[scales[b]];
        float v[MXFP4_BLOCK];
#if defined(__AVX512F__) && defined(__AVX512BW__)
        const __m512 lut = _mm512_mul_ps(_mm512_loadu_ps(E2M1), _mm512_set1_ps(scale));
        const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        const __m512 lo = _mm512_permutexvar_ps(d, lut), hi = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), lut);
        const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        _mm512_storeu_ps(v, _mm512_permutex2var_ps(lo, first, hi));
        _mm512_storeu_ps(v + 16, _mm512_permutex2var_ps(lo, _mm512_add_epi32(first, _mm512_set1_epi32(8)), hi));
#else
        __m256 e[2], o[2];
        mxfp4_decode256(p, scale, e, o);
        for (int h = 0; h < 2; h++) {
            const __m256 a = _mm256_unpacklo_ps(e[h], o[h]), c = _mm256_unpackhi_ps(e[h], o[h]);
            _mm256_storeu_ps(v + 16 * h, _mm256_permute2f128_ps(a, c, 0x20));
            _mm256_storeu_ps(v + 16 * h + 8, _mm256_permute2f128_ps(a, c, 0x31));
        }
#endif
        if (is_bf16) {
            uint16_t *dst = (uint16_t *)out + MXFP4_BLOCK * b;
            for (int i = 0; i < MXFP4_BLOCK; i++) dst[i] = float_to_bf16(v[i]);
        } else {
            memcpy((float *)out + MXFP4_BLOCK * b, v, sizeof(v));
        }
    }
}

/* One expert matrix of every expert: dense [E, N, K] in the activations' dtype (weight), or MXFP4 (blocks
 * [E, N, K / 32, 16], scales [E, N, K / 32]); bias [E, N] in the activations' dtype or NULL. */
typedef struct {
    const void *weight;
    const uint8_t *blocks, *scales;
    const void *bias;
} expert_matrix;

static void expert_matmul(const expert_matrix *w, int e, const char *x, char *y, int M, int N, int K, int is_bf16,
                          int num_threads) {
    const size_t elt = is_bf16 ? 2 : 4;
    const void *bias = w->bias ? (const char *)w->bias + (size_t)e * N * elt : NULL;
    if (w->weight)
        brisk_linear(x, K, (const char *)w->weight + (size_t)e * N * K * elt, bias, y, N, M, N, K, is_bf16,
                     num_threads);
    else
        brisk_mxfp4_linear(x, K, w->blocks + (size_t)e * N * (K / 2), w->scales + (size_t)e * N * (K / MXFP4_BLOCK),
                           bias, y, N, M, N, K, is_bf16, num_threads);
}

/* gpt-oss's experts for a decode step: out[t] = sum_j w[t, j] * down_e(act(gate_up_e(x[t]))), e = ids[t, j], in one
 * call instead of a sort, a gather, two matmuls per picked expert, the activation and a scatter in torch ops. The
 * (token, j) slots are grouped by expert (counting sort, stable), each expert's rows go through the matmul kernel
 * together (brisk_linear, or brisk_mxfp4_linear for MXFP4 experts), all rows through brisk_clamped_swiglu at once.
 * An id outside [0, num_experts) (-1: another rank's expert) contributes nothing. bf16 rounds where torch's ops
 * round: each matmul and activation output, each weighted row, the sum over j once at the end (tests: identical to
 * the torch path with these kernels). x [T, H] rows x_stride apart, out [T, H] rows out_stride apart, ids int64
 * [T, top_k], weights fp32 [T, top_k], gate_up [E, 2I, H], down [E, H, I] (see expert_matrix), x, out and biases
 * bf16 (is_bf16) or fp32; gate and up columns as `halves` says (see brisk_clamped_swiglu). */
static void moe_experts(const void *x, int64_t x_stride, void *out, int64_t out_stride, const int64_t *ids,
                        const float *weights, int T, int top_k, int num_experts, int H, int I,
                        const expert_matrix *gate_up, const expert_matrix *down, int is_bf16, int halves,
                        float alpha, float limit, int num_threads) {
    const size_t elt = is_bf16 ? 2 : 4;
    const int num_slots = T * top_k;
    int start[num_experts + 1], fill[num_experts], row_of_slot[num_slots];
    memset(start, 0, sizeof(start));
    for (int s = 0; s < num_slots; s++)
        if (ids[s] >= 0 && ids[s] < num_experts) start[ids[s] + 1]++;
    for (int e = 0; e < num_experts; e++) start[e + 1] += start[e];
    memcpy(fill, start, sizeof(fill));
    const int rows = start[num_experts];
    char *xs = malloc((size_t)rows * (H + 2 * I + I + H) * elt);
    char *gate_up_out = xs + (size_t)rows * H * elt, *act = gate_up_out + (size_t)rows * 2 * I * elt;
    char *ys = act + (size_t)rows * I * elt;
    for (int s = 0; s < num_slots; s++) {
        row_of_slot[s] = -1;
        if (ids[s] < 0 || ids[s] >= num_experts) continue;
        const int r = row_of_slot[s] = fill[ids[s]]++;
        memcpy(xs + (size_t)r * H * elt, (const char *)x + (size_t)(s / top_k) * x_stride * elt, H * elt);
    }
    for (int e = 0; e < num_experts; e++) {
        const int n = start[e + 1] - start[e];
        if (n == 0) continue;
        expert_matmul(gate_up, e, xs + (size_t)start[e] * H * elt, gate_up_out + (size_t)start[e] * 2 * I * elt, n,
                      2 * I, H, is_bf16, num_threads);
    }
    brisk_clamped_swiglu(gate_up_out, 2 * I, act, I, is_bf16, halves, rows, I, alpha, limit);
    for (int e = 0; e < num_experts; e++) {
        const int n = start[e + 1] - start[e];
        if (n == 0) continue;
        expert_matmul(down, e, act + (size_t)start[e] * I * elt, ys + (size_t)start[e] * H * elt, n, H, I, is_bf16,
                      num_threads);
    }
    for (int t = 0; t < T; t++) {
        float sum[H], y[H];
        memset(sum, 0, sizeof(sum));
        for (int j = 0; j < top_k; j++) {
            const int r = row_of_slot[t * top_k + j];
            if (r < 0) continue;
            load_row(ys, is_bf16, (int64_t)r * H, H, y);
            const float w = is_bf16 ? round_bf16(weights[t * top_k + j]) : weights[t * top_k + j];
            if (is_bf16)
                for (int h = 0; h < H; h++) sum[h] += round_bf16(y[h] * w);
            else
                for (int h = 0; h < H; h++) sum[h] += y[h] * w;
        }
        if (is_bf16) {
            uint16_t *dst = (uint16_t *)out + (int64_t)t * out_stride;
            for (int h = 0; h < H; h++) dst[h] = float_to_bf16(sum[h]);
        } else {
            memcpy((float *)out + (int64_t)t * out_stride, sum, sizeof(sum));
        }
    }
    free(xs);
}

/* Unquantized experts: gate_up [E, 2I, H] (+ bias [E, 2I]), down [E, H, I] (+ bias [E, H] or NULL). */
void brisk_moe_experts(const void *x, int64_t x_stride, void *out, int64_t out_stride, const int64_t *ids,
                       const float *weights, int T, int top_k, int num_experts, int H, int I, const void *gate_up,
                       const void *gate_up_bias, const void *down, const void *down_bias, int is_bf16, int halves,
                       float alpha, float limit, int num_threads) {
    const expert_matrix gu = {gate_up, NULL, NULL, gate_up_bias}, dn = {down, NULL, NULL, down_bias};
    moe_experts(x, x_stride, out, out_stride, ids, weights, T, top_k, num_experts, H, I, &gu, &dn, is_bf16, halves,
                alpha, limit, num_threads);
}

/* MXFP4 experts, read where they lie: gate_up blocks [E, 2I, H / 32, 16] and scales [E, 2I, H / 32], down blocks
 * [E, H, I / 32, 16] and scales [E, H, I / 32]; biases as for brisk_moe_experts. */
void brisk_moe_experts_mxfp4(const void *x, int64_t x_stride, void *out, int64_t out_stride, const int64_t *ids,
                             const float *weights, int T, int top_k, int num_experts, int H, int I,
                             const uint8_t *gate_up_blocks, const uint8_t *gate_up_scales, const void *gate_up_bias,
                             const uint8_t *down_blocks, const uint8_t *down_scales, const void *down_bias,
                             int is_bf16, int halves, float alpha, float limit, int num_threads) {
    const expert_matrix gu = {NULL, gate_up_blocks, gate_up_scales, gate_up_bias};
    const expert_matrix dn = {NULL, down_blocks, down_scales, down_bias};
    moe_experts(x, x_stride, out, out_stride, ids, weights, T, top_k, num_experts, H, I, &gu, &dn, is_bf16, halves,
                alpha, limit, num_threads);
}

/* One token per row of fp32 logits [B, V] (rows `stride` apart) drawn from softmax(row) by inverse transform: the
 * token where the running sum of exp(x - max) passes u[r] * total, u[r] uniform in [0, 1). One uniform per row
 * instead of torch's V exponential draws (19 ns each: 124 ms a step for 32 rows of gpt-oss's 201,088-token
 * vocabulary). -inf logits (masked tokens: top-k, top-p...) weigh exactly 0, told by their bits because
 * -ffast-math assumes finite values; a +inf logit takes the row; a row of nothing but -inf gets token 0. The token
 * returned is always in [0, V). Sums run in CHUNK-sized pieces, each summed in
 * fp32 and added in fp64; the chunk the target falls in is summed again token by token. */
#define SAMPLE_CHUNK 1024
static inline uint32_t float_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof(bits));
    return bits;
}

static inline int is_minus_inf(float x) { return float_bits(x) == 0xFF800000u; }

static inline int is_finite_bits(float x) { return (float_bits(x) & 0x7F800000u) != 0x7F800000u; }

static inline float chunk_exps(const float *x, int n, float max, float *p) {
    float sum = 0.0f;
    for (int i = 0; i < n; i++) {
        p[i] = is_minus_inf(x[i]) ? 0.0f : expf(x[i] - max);
        sum += p[i];
    }
    return sum;
}

void brisk_sample_rows(const float *logits, int64_t stride, int B, int V, const double *u, int64_t *out,
                       int num_threads) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1 && B > 1)
    for (int r = 0; r < B; r++) {
        const float *x = logits + (int64_t)r * stride;
        float max = -FLT_MAX, p[SAMPLE_CHUNK];
        int argmax = 0;
        for (int i = 0; i < V; i++)
            if (!is_minus_inf(x[i]) && x[i] > max) max = x[i], argmax = i;
        if (!is_finite_bits(max)) {  /* +inf (a logit overflowed by a tiny temperature): it takes all the mass */
            out[r] = argmax;
            continue;
        }
        const int num_chunks = (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
        double *chunk_sums = malloc((size_t)num_chunks * sizeof(double)), total = 0.0;
        for (int c = 0; c < num_chunks; c++) {
            const int n = V - c * SAMPLE_CHUNK < SAMPLE_CHUNK ? V - c * SAMPLE_CHUNK : SAMPLE_CHUNK;
            chunk_sums[c] = chunk_exps(x + (int64_t)c * SAMPLE_CHUNK, n, max, p);
            total += chunk_sums[c];
        }
        const double target = u[r] * total;
        double running = 0.0;
        int c = 0;
        while (c < num_chunks - 1 && running + chunk_sums[c] <= target) running += chunk_sums[c++];
        const int n = V - c * SAMPLE_CHUNK < SAMPLE_CHUNK ? V - c * SAMPLE_CHUNK : SAMPLE_CHUNK;
        chunk_exps(x + (int64_t)c * SAMPLE_CHUNK, n, max, p);
        int token = -1;
        for (int i = 0; i < n; i++) {
            if (p[i] == 0.0f) continue;
            token = c * SAMPLE_CHUNK + i;  /* the last weighted token, should rounding leave the target beyond it */
            running += p[i];
            if (running > target) break;
        }
        /* No weighted token in the chunk (the target beyond its rounded sum, at its edge): the most likely token. */
        out[r] = token >= 0 ? token : argmax;
        free(chunk_sums);
    }
}

/* Greedy decoding's pick, the same (value, index) as torch.max(dim=-1): the first NaN where a row has one, else
 * the row's max (+inf and -inf compare as numbers) and its first index. torch's argmax walks the row element by
 * element (~4.5 ns each on one core); here one vector pass takes the max and checks for NaN, in integer lanes
 * because -ffast-math may fold float NaN tests, and a second pass over the row, still in cache, finds the first
 * element equal to it: the pair costs about one read of the logits. */
static inline int is_nan_bits(float x) { return (float_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }

static inline float hmax256(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static int64_t row_argmax(const float *x, int V) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), inf_bits = _mm256_set1_epi32(0x7F800000);
    const __m256 minus_inf = _mm256_castsi256_ps(_mm256_set1_epi32((int)0xFF800000u));
    __m256 m0 = minus_inf, m1 = minus_inf, m2 = minus_inf, m3 = minus_inf;
    __m256i nan = _mm256_setzero_si256();
#define MAX_AND_NAN(m, at)                                                                                         \
    {                                                                                                              \
        const __m256 v = _mm256_loadu_ps(x + (at));                                                                \
        m = _mm256_max_ps(m, v);                                                                                   \
        nan = _mm256_or_si256(nan, _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), abs_mask), inf_bits)); \
    }
    int i = 0;
    for (; i + 32 <= V; i += 32) {
        MAX_AND_NAN(m0, i) MAX_AND_NAN(m1, i + 8) MAX_AND_NAN(m2, i + 16) MAX_AND_NAN(m3, i + 24)
    }
    for (; i + 8 <= V; i += 8) MAX_AND_NAN(m0, i)
#undef MAX_AND_NAN
    float max = hmax256(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));
    int has_nan = !_mm256_testz_si256(nan, nan);
    for (; i < V; i++) {
        has_nan |= is_nan_bits(x[i]);
        if (x[i] > max) max = x[i];
    }
    if (has_nan) {
        for (int j = 0; j < V; j++)
            if (is_nan_bits(x[j])) return j;
    }
    const __m256 target = _mm256_set1_ps(max);
    int j = 0;
    for (; j + 8 <= V; j += 8) {
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + j), target, _CMP_EQ_OQ));
        if (hits) return j + __builtin_ctz((unsigned)hits);
    }
    for (; j < V; j++)
        if (x[j] == max) break;
    return j;
}

void brisk_row_max_argmax(const float *logits, int64_t stride, int B, int V, float *max_out, int64_t *index_out,
                          int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && B >= 64)
    for (int r = 0; r < B; r++) {
        const float *x = logits + (int64_t)r * stride;
        const int64_t j = index_out[r] = row_argmax(x, V);
        /* Copied as bytes: -ffast-math may give an equal float (0.0 for -0.0), the row's own bits are the answer. */
        memcpy(max_out + r, x + j, sizeof(float));
    }
}
