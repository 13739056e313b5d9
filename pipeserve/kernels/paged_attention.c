/* Paged decode attention for CPUs: one query token per sequence, keys and
 * values read in place from the paged cache (no gathered copy).
 *
 * Cache layout (as pipeserve.model.attention): K and V are each
 * [num_blocks, block_size, kv_heads, head_dim]; token p of sequence b lives in
 * block block_tables[b][p / block_size], row p % block_size.
 *
 * Work item = (sequence, kv head): the G = heads / kv_heads query heads that
 * share a kv head read each key and value row once. Scores are kept for the
 * whole context (two-pass softmax), accumulation is in float32 whatever the
 * cache dtype. Built by pipeserve/kernels/build.py with -O3 -march=native
 * -fopenmp; called through ctypes, which releases the GIL.
 *
 * Per call (one layer): a sliding window W > 0 limits the query at position p
 * to keys p - W < j <= p (transformers' convention; W = 0: no window), so a
 * decode reads only the blocks its window touches; a soft cap c > 0 maps each
 * scaled score s to c tanh(s / c) before the softmax (Gemma 2; c = 0: none).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

enum { DT_FLOAT32 = 0, DT_BFLOAT16 = 1, DT_FLOAT16 = 2 };

/* Row of `n` cache elements -> float32. */
static inline void load_row(const void *src, int dtype, int64_t n, float *restrict dst) {
    if (dtype == DT_FLOAT32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == DT_BFLOAT16) {
        const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            union { uint32_t u; float f; } v;
            v.u = (uint32_t)s[i] << 16;
            dst[i] = v.f;
        }
    } else {
        const _Float16 *s = (const _Float16 *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
    }
}

/* s <- c tanh(s / c): Gemma 2's attention logit soft cap. */
static void softcap_inplace(float *s, int64_t n, float cap) {
    const float inv = 1.0f / cap;
#pragma omp simd
    for (int64_t t = 0; t < n; t++) s[t] = cap * tanh_f32(s[t] * inv);
}

/* The first key a decode at position ctx - 1 sees. */
static inline int64_t window_start(int64_t ctx, int64_t window) {
    return window > 0 && ctx > window ? ctx - window : 0;
}

/* s <- exp(s - max s); returns 1 / sum (the caller scales the output once). */
static float softmax_inplace(float *s, int64_t n) {
    float m = s[0];
#pragma omp simd reduction(max : m)
    for (int64_t t = 1; t < n; t++) m = s[t] > m ? s[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        s[t] = exp_f32(s[t] - m);
        sum += s[t];
    }
    return 1.0f / sum;
}

/* Keys first .. ctx - 1 of one (sequence, kv head), any head_dim. */
static void attend_one(const float *restrict q, const char *k_cache, const char *v_cache, int dtype,
                       int64_t elem, const int64_t *table, int64_t first, int64_t ctx, int64_t kv_head,
                       int64_t group, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                       float scale, float softcap, float *restrict work, float *restrict out) {
    /* work: scores [group][n], then query [group][head_dim], row [head_dim], acc [group][head_dim] */
    const int64_t n = ctx - first;
    float *scores = work;
    float *qs = scores + group * n;
    float *row = qs + group * head_dim;
    float *acc = row + head_dim;
    const int64_t row_stride = kv_heads * head_dim * elem;      /* bytes between tokens of a block */
    const int64_t block_stride = block_size * row_stride;
    const int64_t head_offset = kv_head * head_dim * elem;

    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_dim; d++) qs[g * head_dim + d] = q[g * head_dim + d] * scale;

    for (int64_t t = first; t < ctx; t++) {
        load_row(k_cache + table[t / block_size] * block_stride + (t % block_size) * row_stride + head_offset,
                 dtype, head_dim, row);
        for (int64_t g = 0; g < group; g++) {
            const float *qg = qs + g * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * row[d];
            scores[g * n + t - first] = dot;
        }
    }

    float inv_sum[group];
    for (int64_t g = 0; g < group; g++) {
        if (softcap > 0.0f) softcap_inplace(scores + g * n, n, softcap);
        inv_sum[g] = softmax_inplace(scores + g * n, n);
    }

    memset(acc, 0, (size_t)(group * head_dim) * sizeof(float));
    for (int64_t t = first; t < ctx; t++) {
        load_row(v_cache + table[t / block_size] * block_stride + (t % block_size) * row_stride + head_offset,
                 dtype, head_dim, row);
        for (int64_t g = 0; g < group; g++) {
            const float p = scores[g * n + t - first];
            float *a = acc + g * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) a[d] += p * row[d];
        }
    }
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_dim; d++) out[g * head_dim + d] = acc[g * head_dim + d] * inv_sum[g];
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 cache elements -> 16 floats. `dtype` is a constant in each caller. */
static inline __attribute__((always_inline)) __m512 load16(const char *src, int dtype) {
    if (dtype == DT_BFLOAT16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
    if (dtype == DT_FLOAT16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src));
    return _mm512_loadu_ps((const float *)src);
}

/* Ask for the next block while the current one is used. */
/* Blocks ahead that the bf16 decode path prefetches. On the 2-core development VM
 * distances 1-4, the T0/T1/T2 hints and no prefetch at all measured within noise
 * (about 100-120 ns per key on scattered blocks, 60-80 on consecutive ones): its
 * hardware prefetcher does the work. Kept for CPUs whose prefetcher stops at a
 * block boundary. */
#ifndef PF_DIST
#define PF_DIST 2
#endif
static inline void prefetch_lines(const char *start, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(start + b, _MM_HINT_T0);
}

/* The block that holds tokens start .. start + rows - 1 (start a multiple of
 * block_size), for walking a sequence's blocks in order; asks for the block
 * PF_DIST ahead meanwhile. */
static inline __attribute__((always_inline)) const char *walk_block(
        const char *cache, const int64_t *table, int64_t start, int64_t ctx, int64_t block_size,
        int64_t block_stride, int64_t *rows) {
    *rows = ctx - start < block_size ? ctx - start : block_size;
    if (start + PF_DIST * block_size < ctx)
        prefetch_lines(cache + table[start / block_size + PF_DIST] * block_stride, block_stride);
    return cache + table[start / block_size] * block_stride;
}

/* Sixteen vectors -> one vector of their sixteen horizontal sums (lane j = sum of d[j]):
 * a transposing tree of 45 shuffles and adds instead of 16 separate reductions. */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 d[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)  /* 128-bit lane: [d0 a+c, d1 a+c, d0 b+d, d1 b+d] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]),
                             _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* 128-bit lane: partial sums of d[4i .. 4i+3] */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

enum { DOT_FMA = 0, DOT_BF16 = 1 };

/* q_h . k for one key row: DOT_FMA widens `nvec` vectors of 16 cache elements
 * and multiplies them with float32 q; DOT_BF16 (AVX512_BF16, bf16 caches)
 * multiplies `nvec` pairs of 32 bf16 with vdpbf16ps. `kind` is a constant in
 * each caller. Returns 16 partial sums. */
static inline __attribute__((always_inline)) __m512 row_dot(const char *qh, const char *src, const int kind,
                                                            const int dtype, const int64_t elem,
                                                            const int64_t nvec) {
#if defined(__AVX512BF16__)
    if (kind == DOT_BF16) {
        const __m512bh *q = (const __m512bh *)qh;
        __m512 dot = _mm512_setzero_ps();
        for (int64_t w = 0; w < nvec; w++)
            dot = _mm512_dpbf16_ps(dot, q[w], (__m512bh)_mm512_loadu_si512(src + 64 * w));
        return dot;
    }
#endif
    const __m512 *q = (const __m512 *)qh;
    __m512 dot = _mm512_mul_ps(q[0], load16(src, dtype));
    for (int64_t v = 1; v < nvec; v++) dot = _mm512_fmadd_ps(q[v], load16(src + 16 * v * elem, dtype), dot);
    return dot;
}

/* Scores of one sequence: scores[h][t - first] = q_h . k_t for every head and
 * key t in first .. ctx - 1, the blocks walked once each (all kv heads of a row
 * together, so every cache line is read once and in order), sixteen keys per
 * tree reduction. qs holds each head's query, q_head_bytes apart, in the form
 * row_dot takes. */
static inline __attribute__((always_inline)) void score_pass(
        const char *qs, int64_t q_head_bytes, const int kind, const int dtype, const int64_t elem,
        const int64_t nvec, const char *k_cache, const int64_t *table, int64_t first, int64_t ctx, int64_t heads,
        int64_t group, int64_t head_bytes, int64_t row_stride, int64_t block_size, float *restrict scores) {
    const int64_t block_stride = block_size * row_stride, n = ctx - first;
    const int64_t first_block = first / block_size;
    for (int64_t b = first_block; b < first_block + PF_DIST && b * block_size < ctx; b++)
        prefetch_lines(k_cache + table[b] * block_stride, block_stride);
    for (int64_t start = first_block * block_size; start < ctx; start += block_size) {
        int64_t rows;
        const char *block = walk_block(k_cache, table, start, ctx, block_size, block_stride, &rows);
        const int64_t skip = start < first ? first - start : 0;   /* rows before the window */
        for (int64_t h = 0; h < heads; h++) {
            const char *qh = qs + h * q_head_bytes;
            const char *head = block + (h / group) * head_bytes + skip * row_stride;
            float *sh = scores + h * n + (start + skip - first);
            int64_t i = 0;
            for (; i + 16 <= rows - skip; i += 16) {
                __m512 dots[16];
                for (int j = 0; j < 16; j++) dots[j] = row_dot(qh, head + (i + j) * row_stride, kind, dtype, elem, nvec);
                _mm512_storeu_ps(sh + i, hsum16(dots));
            }
            for (; i < rows - skip; i++)
                sh[i] = _mm512_reduce_add_ps(row_dot(qh, head + i * row_stride, kind, dtype, elem, nvec));
        }
    }
}

/* Soft cap (c > 0) and softmax of each head's n scores; inv_sum[h] = 1 / sum. */
static void normalise_scores(float *scores, int64_t heads, int64_t n, float softcap, float *inv_sum) {
    for (int64_t h = 0; h < heads; h++) {
        if (softcap > 0.0f) softcap_inplace(scores + h * n, n, softcap);
        inv_sum[h] = softmax_inplace(scores + h * n, n);
    }
}

/* One sequence, every head, for head_dim = 16 * nvec (nvec <= 16). Blocks are
 * walked once each for K and for V, all kv heads of a row together, so every
 * cache line is read from memory once and in order. Each caller passes a
 * constant nvec, so the per-head accumulators live in registers. */
static inline __attribute__((always_inline)) void attend_seq_avx512(
        const float *restrict q, const char *k_cache, const char *v_cache, const int dtype,
        const int64_t elem, const int64_t nvec, const int64_t *table, int64_t first, int64_t ctx, int64_t heads,
        int64_t kv_heads, int64_t block_size, float scale, float softcap, float *restrict work,
        float *restrict out) {
    const int64_t group = heads / kv_heads, n = ctx - first;
    float *scores = work;                         /* [heads][n] */
    float *acc = scores + heads * n;              /* [heads][16 * nvec] */
    __m512 qs[heads * nvec];
    const int64_t head_bytes = 16 * nvec * elem;
    const int64_t row_stride = kv_heads * head_bytes;   /* bytes between tokens of a block */
    const int64_t block_stride = block_size * row_stride;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < heads * nvec; i++) qs[i] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * i), vscale);

    score_pass((const char *)qs, nvec * (int64_t)sizeof(__m512), DOT_FMA, dtype, elem, nvec, k_cache, table, first,
               ctx, heads, group, head_bytes, row_stride, block_size, scores);

    float inv_sum[heads];
    normalise_scores(scores, heads, n, softcap, inv_sum);

    /* Values: out_h = sum_t p_h[t] v[t], one head at a time over a block (the
     * block stays in L1 for the next head). */
    memset(acc, 0, (size_t)(heads * nvec * 16) * sizeof(float));
    for (int64_t start = first - first % block_size; start < ctx; start += block_size) {
        int64_t rows;
        const char *block = walk_block(v_cache, table, start, ctx, block_size, block_stride, &rows);
        const int64_t skip = start < first ? first - start : 0;
        rows -= skip;
        for (int64_t h = 0; h < heads; h++) {
            const float *ph = scores + h * n + (start + skip - first);
            const char *head = block + (h / group) * head_bytes + skip * row_stride;
            __m512 a[nvec];
            for (int64_t v = 0; v < nvec; v++) a[v] = _mm512_loadu_ps(acc + (h * nvec + v) * 16);
            for (int64_t i = 0; i < rows; i++) {
                const char *src = head + i * row_stride;
                const __m512 p = _mm512_set1_ps(ph[i]);
                for (int64_t v = 0; v < nvec; v++)
                    a[v] = _mm512_fmadd_ps(p, load16(src + 16 * v * elem, dtype), a[v]);
            }
            for (int64_t v = 0; v < nvec; v++) _mm512_storeu_ps(acc + (h * nvec + v) * 16, a[v]);
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        const __m512 inv = _mm512_set1_ps(inv_sum[h]);
        for (int64_t v = 0; v < nvec; v++)
            _mm512_storeu_ps(out + (h * nvec + v) * 16,
                             _mm512_mul_ps(_mm512_loadu_ps(acc + (h * nvec + v) * 16), inv));
    }
}

/* One function per (cache dtype, head_dim): 64 and 128 get constant loop
 * bounds, other multiples of 16 share a generic one. */
#define ATTEND_AVX512(NAME, DTYPE, ELEM, NVEC)                                                         \
    static void NAME(const float *q, const char *k, const char *v, const int64_t *table, int64_t first, \
                     int64_t ctx, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, \
                     float scale, float softcap, float *work, float *out) {                            \
        attend_seq_avx512(q, k, v, DTYPE, ELEM, (NVEC) ? (NVEC) : head_dim / 16, table, first, ctx,    \
                          heads, kv_heads, block_size, scale, softcap, work, out);                     \
    }
ATTEND_AVX512(attend_avx512_f32_64, DT_FLOAT32, 4, 4)
ATTEND_AVX512(attend_avx512_bf16_64, DT_BFLOAT16, 2, 4)
ATTEND_AVX512(attend_avx512_f16_64, DT_FLOAT16, 2, 4)
ATTEND_AVX512(attend_avx512_f32_128, DT_FLOAT32, 4, 8)
ATTEND_AVX512(attend_avx512_bf16_128, DT_BFLOAT16, 2, 8)
ATTEND_AVX512(attend_avx512_f16_128, DT_FLOAT16, 2, 8)
ATTEND_AVX512(attend_avx512_f32_any, DT_FLOAT32, 4, 0)
ATTEND_AVX512(attend_avx512_bf16_any, DT_BFLOAT16, 2, 0)
ATTEND_AVX512(attend_avx512_f16_any, DT_FLOAT16, 2, 0)

typedef void (*attend_fn)(const float *, const char *, const char *, const int64_t *, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, float, float, float *, float *);

#if defined(__AVX512BF16__)
/* bfloat16 caches on CPUs with AVX512_BF16: products of bf16 pairs summed in
 * float32 by one instruction (vdpbf16ps), so rows are never widened.
 * Scores: q (rounded to bf16) . k, 32 dims per instruction. Values: two
 * tokens per instruction, their rows interleaved, against the pair of their
 * probabilities (rounded to bf16, as the PyTorch path does before its PV
 * matmul). head_dim = 32 * npair. */

/* One block's values for GN query heads sharing a kv head (head_dim = 32 * npair):
 * acc_g += p_g[t] v[t] over the block's rows, two rows per vdpbf16ps (their
 * rows interleaved, against the pair of their bf16 probabilities). A missing
 * second row is zero, so whatever probability pairs with it adds nothing. */
#define PV_MAX_G 4
#define PV_MAX_PAIRS 8
/* Fully unrolled loops over heads and vectors keep the accumulators in registers. */
#define UNROLL _Pragma("GCC unroll 16")
static inline __attribute__((always_inline)) void pv_block_bf16(
        const char *head, int64_t rows, int64_t row_stride, const uint16_t *p, int64_t pstride,
        float *acc, int64_t acc_stride, const int GN, const int64_t npair) {
    if (npair > PV_MAX_PAIRS) __builtin_unreachable();   /* head_dim <= 256 (pick_avx512) */
    __m512 lo[PV_MAX_G][PV_MAX_PAIRS], hi[PV_MAX_G][PV_MAX_PAIRS];
    UNROLL
    for (int g = 0; g < GN; g++) {
        UNROLL
        for (int64_t w = 0; w < npair; w++) {
            lo[g][w] = _mm512_loadu_ps(acc + g * acc_stride + 32 * w);
            hi[g][w] = _mm512_loadu_ps(acc + g * acc_stride + 32 * w + 16);
        }
    }
    for (int64_t i = 0; i < rows; i += 2) {
        const char *src0 = head + i * row_stride;
        const int second = i + 1 < rows;
        __m512bh ulo[PV_MAX_PAIRS], uhi[PV_MAX_PAIRS];
        UNROLL
        for (int64_t w = 0; w < npair; w++) {
            const __m512i r0 = _mm512_loadu_si512(src0 + 64 * w);
            const __m512i r1 = second ? _mm512_loadu_si512(src0 + row_stride + 64 * w) : _mm512_setzero_si512();
            ulo[w] = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
            uhi[w] = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
        }
        UNROLL
        for (int g = 0; g < GN; g++) {
            uint32_t pair;
            memcpy(&pair, p + g * pstride + i, sizeof pair);
            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
            UNROLL
            for (int64_t w = 0; w < npair; w++) {
                lo[g][w] = _mm512_dpbf16_ps(lo[g][w], ulo[w], pp);
                hi[g][w] = _mm512_dpbf16_ps(hi[g][w], uhi[w], pp);
            }
        }
    }
    UNROLL
    for (int g = 0; g < GN; g++) {
        UNROLL
        for (int64_t w = 0; w < npair; w++) {
            _mm512_storeu_ps(acc + g * acc_stride + 32 * w, lo[g][w]);
            _mm512_storeu_ps(acc + g * acc_stride + 32 * w + 16, hi[g][w]);
        }
    }
}

static inline __attribute__((always_inline)) void attend_seq_bf16dp(
        const float *restrict q, const char *k_cache, const char *v_cache, const int64_t npair,
        const int64_t *table, int64_t first, int64_t ctx, int64_t heads, int64_t kv_heads, int64_t block_size,
        float scale, float softcap, float *restrict work, float *restrict out) {
    const int64_t group = heads / kv_heads, n = ctx - first;
    const int64_t head_dim = 32 * npair;
    float *scores = work;                         /* [heads][n] */
    float *acc = scores + heads * n;              /* [heads][2][head_dim]: lo and hi halves */
    __m512bh qs[heads * npair];
    const int64_t head_bytes = head_dim * 2;
    const int64_t row_stride = kv_heads * head_bytes;
    const int64_t block_stride = block_size * row_stride;
    for (int64_t h = 0; h < heads; h++)
        for (int64_t w = 0; w < npair; w++) {
            const float *src = q + h * head_dim + 32 * w;
            qs[h * npair + w] = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(src + 16), _mm512_set1_ps(scale)),
                                                    _mm512_mul_ps(_mm512_loadu_ps(src), _mm512_set1_ps(scale)));
        }

    score_pass((const char *)qs, npair * (int64_t)sizeof(__m512bh), DOT_BF16, DT_BFLOAT16, 2, npair, k_cache, table,
               first, ctx, heads, group, head_bytes, row_stride, block_size, scores);

    const int64_t first_block = first / block_size;
    for (int64_t b = first_block; b < first_block + PF_DIST && b * block_size < ctx; b++)
        prefetch_lines(v_cache + table[b] * block_stride, block_stride);   /* the first values, during the softmax */
    float inv_sum[heads];
    normalise_scores(scores, heads, n, softcap, inv_sum);

    /* Probabilities -> bf16 once (the PyTorch path rounds them before its PV matmul too). */
    uint16_t *probs = (uint16_t *)(acc + heads * 2 * head_dim);   /* [heads][n + 2] */
    const int64_t pstride = n + 2;
    for (int64_t h = 0; h < heads; h++) {
        const float *sh = scores + h * n;
        uint16_t *ph = probs + h * pstride;
        int64_t t = 0;
        for (; t + 32 <= n; t += 32)
            _mm512_storeu_si512(ph + t, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(sh + t + 16),
                                                                     _mm512_loadu_ps(sh + t)));
        for (; t < n; t++) ph[t] = f32_to_bf16(sh[t]);
        ph[n] = ph[n + 1] = 0;   /* the pair partner of a last odd row */
    }

    /* Values: each kv head's rows are loaded and interleaved once per block for
     * up to gmax of the query heads that share it (as many as keep their
     * accumulators in registers). */
    memset(acc, 0, (size_t)(heads * 2 * head_dim) * sizeof(float));
    const int gmax = npair <= 2 ? 4 : npair <= 4 ? 2 : 1;
    for (int64_t start = first_block * block_size; start < ctx; start += block_size) {
        int64_t rows;
        const char *block = walk_block(v_cache, table, start, ctx, block_size, block_stride, &rows);
        const int64_t skip = start < first ? first - start : 0;
        rows -= skip;
        for (int64_t kvh = 0; kvh < kv_heads; kvh++) {
            const char *head = block + kvh * head_bytes + skip * row_stride;
            for (int64_t g0 = 0; g0 < group; g0 += gmax) {
                const int64_t h0 = kvh * group + g0;
                const int gn = group - g0 < gmax ? (int)(group - g0) : gmax;
                const uint16_t *p = probs + h0 * pstride + (start + skip - first);
                float *a = acc + h0 * 2 * head_dim;
                switch (gn) {
                    case 4: pv_block_bf16(head, rows, row_stride, p, pstride, a, 2 * head_dim, 4, npair); break;
                    case 3: pv_block_bf16(head, rows, row_stride, p, pstride, a, 2 * head_dim, 3, npair); break;
                    case 2: pv_block_bf16(head, rows, row_stride, p, pstride, a, 2 * head_dim, 2, npair); break;
                    default: pv_block_bf16(head, rows, row_stride, p, pstride, a, 2 * head_dim, 1, npair); break;
                }
            }
        }
    }
    /* Lane 4L + k of lo[w] holds dim 32w + 8L + k, of hi[w] dim 32w + 8L + 4 + k (k < 4). */
    for (int64_t h = 0; h < heads; h++) {
        const float *ah = acc + h * 2 * head_dim;
        float *oh = out + h * head_dim;
        for (int64_t w = 0; w < npair; w++)
            for (int64_t lane = 0; lane < 4; lane++)
                for (int64_t k = 0; k < 4; k++) {
                    oh[32 * w + 8 * lane + k] = ah[32 * w + 4 * lane + k] * inv_sum[h];
                    oh[32 * w + 8 * lane + 4 + k] = ah[32 * w + 16 + 4 * lane + k] * inv_sum[h];
                }
    }
}

#define ATTEND_BF16DP(NAME, NPAIR)                                                                     \
    static void NAME(const float *q, const char *k, const char *v, const int64_t *table, int64_t first, \
                     int64_t ctx, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, \
                     float scale, float softcap, float *work, float *out) {                            \
        attend_seq_bf16dp(q, k, v, (NPAIR) ? (NPAIR) : head_dim / 32, table, first, ctx, heads,        \
                          kv_heads, block_size, scale, softcap, work, out);                            \
    }
ATTEND_BF16DP(attend_bf16dp_64, 2)
ATTEND_BF16DP(attend_bf16dp_128, 4)
ATTEND_BF16DP(attend_bf16dp_any, 0)
#endif

static attend_fn pick_avx512(int dtype, int64_t head_dim) {
#if defined(__AVX512BF16__)
    if (dtype == DT_BFLOAT16 && head_dim % 32 == 0 && head_dim <= 256)
        return head_dim == 64 ? attend_bf16dp_64 : head_dim == 128 ? attend_bf16dp_128 : attend_bf16dp_any;
#endif
    static const attend_fn table[3][3] = {
        {attend_avx512_f32_64, attend_avx512_f32_128, attend_avx512_f32_any},
        {attend_avx512_bf16_64, attend_avx512_bf16_128, attend_avx512_bf16_any},
        {attend_avx512_f16_64, attend_avx512_f16_128, attend_avx512_f16_any},
    };
    if (head_dim % 16 != 0 || head_dim > 256) return 0;
    return table[dtype][head_dim == 64 ? 0 : head_dim == 128 ? 1 : 2];
}
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

/* One thread's work buffer (64-byte aligned, freed with free); when it cannot be
 * had, *failed is set and the caller's entry point returns -1. */
static void *thread_scratch(size_t bytes, int *failed) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) {
#pragma omp atomic write
        *failed = 1;
    }
    return p;
}

/* q: [batch, heads, head_dim] float32; out: the same shape, float32.
 * block_tables: [batch, max_blocks] int64; context_lens: [batch] int64 (>= 1).
 * window: sliding window in tokens (0: none); softcap: logit soft cap (0: none).
 * Returns 0, or -1 when a work buffer cannot be allocated. */
int pipeserve_paged_decode(const float *q, const void *k_cache, const void *v_cache, int dtype,
                           const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens,
                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, int64_t window, float softcap, float *out,
                           int num_threads) {
    const int64_t group = heads / kv_heads;
    const int64_t elem = dtype == DT_FLOAT32 ? 4 : 2;
    int64_t max_ctx = 1;   /* the most keys one decode attends */
    for (int64_t b = 0; b < batch; b++) {
        const int64_t n = context_lens[b] - window_start(context_lens[b], window);
        max_ctx = n > max_ctx ? n : max_ctx;
    }
#if HAVE_AVX512
    const attend_fn seq_fn = pick_avx512(dtype, head_dim);
#else
    const void *seq_fn = 0;
#endif
    /* Work items: whole sequences (vector path) or (sequence, kv head) pairs. */
    const int64_t per_item = seq_fn ? kv_heads : 1;
    const int64_t items = seq_fn ? batch : batch * kv_heads;
    /* scores, accumulators and a row (per kv head), plus the bf16 probabilities of the bf16 path */
    const int64_t work_floats = per_item * (group * max_ctx + 2 * group * head_dim + head_dim)
                                + heads * (max_ctx / 2 + 2);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *work = (float *)thread_scratch((size_t)work_floats * sizeof(float), &failed);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!work) continue;
#if HAVE_AVX512
            if (seq_fn) {
                seq_fn(q + item * heads * head_dim, (const char *)k_cache, (const char *)v_cache,
                       block_tables + item * max_blocks, window_start(context_lens[item], window),
                       context_lens[item], heads, kv_heads, head_dim, block_size, scale, softcap, work,
                       out + item * heads * head_dim);
                continue;
            }
#endif
            const int64_t b = item / kv_heads, h = item % kv_heads;
            const int64_t offset = (b * heads + h * group) * head_dim;
            attend_one(q + offset, (const char *)k_cache, (const char *)v_cache, dtype, elem,
                       block_tables + b * max_blocks, window_start(context_lens[b], window), context_lens[b],
                       h, group, kv_heads, head_dim, block_size, scale, softcap, work, out + offset);
        }
        free(work);
    }
    return failed ? -1 : 0;
}

/* ---------------------------------------------------------------------------
 * Paged prefill attention for bfloat16 caches on CPUs with AVX512_BF16.
 *
 * The queries of one sequence sit at positions ctx - q_len .. ctx - 1 and
 * attend causally to keys 0 .. their own position, read from the paged cache
 * (the runner writes the new keys first), so a fresh prompt, a chunk after
 * cached tokens and a prefix-cache hit are the same case.
 *
 * Work item = (sequence, kv head). Its keys and values are first copied into
 * a scratch laid out for vdpbf16ps (16-key tiles; keys transposed so one
 * instruction scores 16 keys against a pair of query dims, values interleaved
 * by key pairs), then every query row of the G heads that share the kv head
 * walks the tiles from its window's start (the first tile without a window)
 * up to its position with an online softmax (flash attention:
 * running max and sum, output rescaled when the max grows). R rows go
 * together so that their accumulators fill the registers; probabilities are
 * rounded to bf16 before the PV product, as the PyTorch path does.
 * ------------------------------------------------------------------------- */
#if defined(__AVX512BF16__)
#define PREFILL_KERNEL 1
/* Array bounds are fixed (not R, NV) so that, once inlined with constant R and
 * NV, the arrays become registers instead of stack VLAs. */
#define PF_MAX_R 4
#define PF_MAX_NV 16

/* The max of 16 lanes, in every lane. */
static inline __attribute__((always_inline)) __m512 max16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, 0x4E));
    x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));
    x = _mm512_max_ps(x, _mm512_permute_ps(x, 0x4E));
    return _mm512_max_ps(x, _mm512_permute_ps(x, 0xB1));
}

/* Keys and values base .. ctx - 1 of one kv head -> the scratch (base a multiple of 16;
 * staged key u is the key at position base + u).
 * kt: [tiles][head_dim / 2][16] dwords, dword (tile, k, j) = dims 2k, 2k+1 of key 16 tile + j.
 * vi: [tiles][8][head_dim] dwords, dword (tile, j, d) = dim d of keys 16 tile + 2j and + 2j + 1.
 * Keys past ctx are zero (they are always masked; zero keeps NaN out). */
static void stage_kv_tiles(const char *k_cache, const char *v_cache, const int64_t *table, int64_t base,
                           int64_t ctx, int64_t kv_head, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                           uint32_t *restrict kt, uint16_t *restrict vi) {
    const int64_t pairs = head_dim / 2, tiles = (ctx - base + 15) / 16;
    const int64_t row_stride = kv_heads * head_dim * 2, block_stride = block_size * row_stride;
    const int64_t head_offset = kv_head * head_dim * 2;
    memset(kt, 0, (size_t)(tiles * pairs * 16) * sizeof(uint32_t));
    memset(vi, 0, (size_t)(tiles * 16 * head_dim) * sizeof(uint16_t));
    for (int64_t t = base; t < ctx; t++) {
        const int64_t offset = table[t / block_size] * block_stride + (t % block_size) * row_stride + head_offset;
        const uint32_t *kr = (const uint32_t *)(k_cache + offset);
        const uint16_t *vr = (const uint16_t *)(v_cache + offset);
        const int64_t u = t - base;
        uint32_t *kd = kt + (u / 16) * pairs * 16 + u % 16;
        for (int64_t k = 0; k < pairs; k++) kd[k * 16] = kr[k];
        uint16_t *vd = vi + (((u / 16) * 8 + (u % 16) / 2) * head_dim) * 2 + (u % 2);
        for (int64_t d = 0; d < head_dim; d++) vd[2 * d] = vr[d];
    }
}

/* The first key position the prefill queries from first_pos on see; staging starts
 * at its tile (a multiple of 16). */
static inline int64_t prefill_base(int64_t first_pos, int64_t window) {
    const int64_t first = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
    return first - first % 16;
}

/* Rows r0 .. r0 + nr - 1 (row = query token * group + head in group) of one
 * (sequence, kv head); R rows at a time, head_dim = 16 * NV. The staged keys
 * start at position base; a row at position p sees keys p - window < j <= p
 * (window 0: every j <= p). */
static inline __attribute__((always_inline)) void prefill_rows(
        const uint16_t *q, uint16_t *out, int64_t r0, int nr, const int R, const int NV, int64_t first_pos,
        int64_t group, int64_t kv_head, int64_t heads, const uint32_t *kt, const uint16_t *vi, float scale,
        int64_t base, int64_t window, float softcap) {
    const int64_t head_dim = 16 * NV, pairs = 8 * NV;
    const uint32_t *qp[PF_MAX_R];
    uint16_t *op[PF_MAX_R];
    int64_t pos[PF_MAX_R];
    UNROLL
    for (int i = 0; i < R; i++) {
        const int64_t r = r0 + (i < nr ? i : nr - 1);   /* spare lanes repeat the last row, unused */
        const int64_t token = r / group, head = kv_head * group + r % group;
        pos[i] = first_pos + token;
        qp[i] = (const uint32_t *)(q + (token * heads + head) * head_dim);
        op[i] = out + (token * heads + head) * head_dim;
    }
    __m512 acc[PF_MAX_R][PF_MAX_NV], lsum[PF_MAX_R], m[PF_MAX_R];   /* m: the running max, in every lane */
    UNROLL
    for (int i = 0; i < R; i++) {
        UNROLL
        for (int c = 0; c < NV; c++) acc[i][c] = _mm512_setzero_ps();
        lsum[i] = _mm512_setzero_ps();
        m[i] = _mm512_set1_ps(-INFINITY);
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    /* Rows are in position order: the first row's window starts first, the last row ends last. */
    const int64_t first_key = window > 0 && pos[0] - window + 1 > base ? pos[0] - window + 1 : base;
    const int64_t tiles = (pos[nr - 1] - base) / 16 + 1;
    for (int64_t tile = (first_key - base) / 16; tile < tiles; tile++) {
        const uint32_t *kb = kt + tile * pairs * 16;
        __m512 s0[PF_MAX_R], s1[PF_MAX_R];   /* two chains per row: the dot products are latency-bound otherwise */
        UNROLL
        for (int i = 0; i < R; i++) s0[i] = s1[i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < pairs; k += 2) {
            const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kb + k * 16);
            const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kb + (k + 1) * 16);
            UNROLL
            for (int i = 0; i < R; i++) {
                s0[i] = _mm512_dpbf16_ps(s0[i], k0, (__m512bh)_mm512_set1_epi32((int)qp[i][k]));
                s1[i] = _mm512_dpbf16_ps(s1[i], k1, (__m512bh)_mm512_set1_epi32((int)qp[i][k + 1]));
            }
        }
        const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32((int)(base + tile * 16)), iota);
        uint32_t pb[PF_MAX_R][8];   /* probabilities as bf16 pairs (keys 2j, 2j + 1) */
        UNROLL
        for (int i = 0; i < R; i++) {
            /* A row with no valid key in this tile (its position is before the tile, or
             * its window starts after it) keeps its max, and its probabilities are 0.
             * Until its first valid key the max is -inf: the lanes computed from it are
             * NaN, but masked to 0, and the first rescale multiplies zeros. */
            const __mmask16 valid = _mm512_mask_cmpgt_epi32_mask(
                _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32((int)pos[i])), keys,
                _mm512_set1_epi32(window > 0 ? (int)(pos[i] - window) : -1));
            __m512 x = _mm512_mul_ps(_mm512_add_ps(s0[i], s1[i]), vscale);
            if (softcap > 0.0f)
                x = _mm512_mul_ps(_mm512_set1_ps(softcap), tanh16(_mm512_mul_ps(x, _mm512_set1_ps(1.0f / softcap))));
            x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, x);
            const __m512 m_new = _mm512_max_ps(m[i], max16(x));
            if (_mm512_cmp_ps_mask(m_new, m[i], _CMP_GT_OQ)) {   /* rescale what was summed so far */
                const __m512 alpha = exp16(_mm512_sub_ps(m[i], m_new));
                UNROLL
                for (int c = 0; c < NV; c++) acc[i][c] = _mm512_mul_ps(acc[i][c], alpha);
                lsum[i] = _mm512_mul_ps(lsum[i], alpha);
                m[i] = m_new;
            }
            const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(x, m_new)));
            const __m256bh p16 = _mm512_cvtneps_pbh(p);
            /* Sum the rounded probabilities: numerator and denominator then agree. */
            lsum[i] = _mm512_add_ps(lsum[i], _mm512_cvtpbh_ps(p16));
            _mm256_storeu_si256((__m256i *)pb[i], (__m256i)p16);
        }
        const uint16_t *vb = vi + tile * 16 * head_dim;
        UNROLL
        for (int j = 0; j < 8; j++) {
            __m512bh v[PF_MAX_NV];
            UNROLL
            for (int c = 0; c < NV; c++) v[c] = (__m512bh)_mm512_loadu_si512(vb + (j * head_dim + 16 * c) * 2);
            UNROLL
            for (int i = 0; i < R; i++) {
                const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pb[i][j]);
                UNROLL
                for (int c = 0; c < NV; c++) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], v[c], pp);
            }
        }
    }
    for (int i = 0; i < nr; i++) {
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(lsum[i]));
        UNROLL
        for (int c = 0; c < NV; c++)
            _mm256_storeu_si256((__m256i *)(op[i] + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[i][c], inv)));
    }
}

#define PREFILL_ROWS(NAME, R, NV)                                                                      \
    static void NAME(const uint16_t *q, uint16_t *out, int64_t r0, int nr, int64_t first_pos,          \
                     int64_t group, int64_t kv_head, int64_t heads, const uint32_t *kt,                \
                     const uint16_t *vi, float scale, int64_t base, int64_t window, float softcap) {   \
        prefill_rows(q, out, r0, nr, R, NV, first_pos, group, kv_head, heads, kt, vi, scale, base,    \
                     window, softcap);                                                                 \
    }
PREFILL_ROWS(prefill_rows_64, 4, 4)
PREFILL_ROWS(prefill_rows_128, 2, 8)
PREFILL_ROWS(prefill_rows_32, 4, 2)
PREFILL_ROWS(prefill_rows_256, 1, 16)
#endif

/* Can pipeserve_paged_prefill run this shape? (bf16 cache, AVX512_BF16 CPU,
 * head_dim 32, 64, 128 or 256.) */
int pipeserve_prefill_supported(int dtype, int64_t head_dim) {
#if defined(PREFILL_KERNEL)
    return dtype == DT_BFLOAT16 && (head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256);
#else
    (void)dtype;
    (void)head_dim;
    return 0;
#endif
}

/* q, out: [tokens, heads, head_dim] bfloat16 (the flat batch; only prefill rows are written).
 * Per prefill sequence s: seqs[4 s .. 4 s + 3] = (first row in the batch, q_len, context_len,
 * unused); block_tables: [num_seqs, max_blocks] int64. window: sliding window in tokens
 * (0: none); softcap: logit soft cap (0: none).
 * Returns 0; -1 when scratch memory cannot be allocated; -2 for an unsupported shape. */
int pipeserve_paged_prefill(const uint16_t *q, const void *k_cache, const void *v_cache,
                            const int64_t *seqs, int64_t num_seqs, const int64_t *block_tables,
                            int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            int64_t block_size, float scale, int64_t window, float softcap, uint16_t *out,
                            int num_threads) {
#if defined(PREFILL_KERNEL)
    if (!pipeserve_prefill_supported(DT_BFLOAT16, head_dim) || heads % kv_heads != 0) return -2;
    const int64_t group = heads / kv_heads;
    const int R = head_dim == 128 ? 2 : head_dim == 256 ? 1 : 4;
    int64_t max_tiles = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t ctx = seqs[4 * s + 2], base = prefill_base(ctx - seqs[4 * s + 1], window);
        const int64_t tiles = (ctx - base + 15) / 16;
        max_tiles = tiles > max_tiles ? tiles : max_tiles;
    }
    const size_t scratch = (size_t)max_tiles * 16 * head_dim * 2 * 2;   /* kt + vi bytes */
    const int64_t items = num_seqs * kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        char *work = (char *)thread_scratch(scratch, &failed);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!work) continue;
            const int64_t s = item / kv_heads, kv_head = item % kv_heads;
            const int64_t row = seqs[4 * s], q_len = seqs[4 * s + 1], ctx = seqs[4 * s + 2];
            uint32_t *kt = (uint32_t *)work;
            uint16_t *vi = (uint16_t *)(work + (size_t)max_tiles * 16 * head_dim * 2);
            const int64_t base = prefill_base(ctx - q_len, window);
            stage_kv_tiles((const char *)k_cache, (const char *)v_cache, block_tables + s * max_blocks, base, ctx,
                           kv_head, kv_heads, head_dim, block_size, kt, vi);
            const uint16_t *qs = q + row * heads * head_dim;
            uint16_t *os = out + row * heads * head_dim;
            const int64_t rows = q_len * group;
            for (int64_t r0 = 0; r0 < rows; r0 += R) {
                const int nr = rows - r0 < R ? (int)(rows - r0) : R;
                if (head_dim == 64)
                    prefill_rows_64(qs, os, r0, nr, ctx - q_len, group, kv_head, heads, kt, vi, scale, base,
                                     window, softcap);
                else if (head_dim == 128)
                    prefill_rows_128(qs, os, r0, nr, ctx - q_len, group, kv_head, heads, kt, vi, scale, base,
                                     window, softcap);
                else if (head_dim == 32)
                    prefill_rows_32(qs, os, r0, nr, ctx - q_len, group, kv_head, heads, kt, vi, scale, base,
                                     window, softcap);
                else
                    prefill_rows_256(qs, os, r0, nr, ctx - q_len, group, kv_head, heads, kt, vi, scale, base,
                                     window, softcap);
            }
        }
        free(work);
    }
    return failed ? -1 : 0;
#else
    (void)q; (void)k_cache; (void)v_cache; (void)seqs; (void)num_seqs; (void)block_tables; (void)max_blocks;
    (void)heads; (void)kv_heads; (void)head_dim; (void)block_size; (void)scale; (void)window; (void)softcap;
    (void)out; (void)num_threads;
    return -2;
#endif
}
