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
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* exp(x) for x <= 0 (scores minus their max), vectorisable: 2^n * p(r) with
 * r = x - n ln2 in [-ln2/2, ln2/2] and a degree-6 polynomial (relative error
 * about 2e-7, like expf). Values below -87 flush to 0. */
#pragma omp declare simd
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) x = -87.0f;
    /* Round to nearest by the 1.5 * 2^23 trick: vectorises, unlike roundf. */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;          /* ln2 split in a high part ... */
    r = r + n * 2.12194440e-4f;              /* ... and a low part (Cody-Waite) */
    float p = 1.3888889e-3f;
    p = p * r + 8.3333333e-3f;
    p = p * r + 4.1666667e-2f;
    p = p * r + 1.6666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* s <- exp(s - max s); returns 1 / sum (the caller scales the output once). */
static float softmax_inplace(float *s, int64_t n) {
    float m = s[0];
#pragma omp simd reduction(max : m)
    for (int64_t t = 1; t < n; t++) m = s[t] > m ? s[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; t++) {
        s[t] = exp_nonpositive(s[t] - m);
        sum += s[t];
    }
    return 1.0f / sum;
}

static void attend_one(const float *restrict q, const char *k_cache, const char *v_cache, int dtype,
                       int64_t elem, const int64_t *table, int64_t ctx, int64_t kv_head,
                       int64_t group, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                       float scale, float *restrict work, float *restrict out) {
    /* work: scores [group][ctx], then query [group][head_dim], row [head_dim], acc [group][head_dim] */
    float *scores = work;
    float *qs = scores + group * ctx;
    float *row = qs + group * head_dim;
    float *acc = row + head_dim;
    const int64_t row_stride = kv_heads * head_dim * elem;      /* bytes between tokens of a block */
    const int64_t block_stride = block_size * row_stride;
    const int64_t head_offset = kv_head * head_dim * elem;

    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < head_dim; d++) qs[g * head_dim + d] = q[g * head_dim + d] * scale;

    for (int64_t start = 0; start < ctx; start += block_size) {
        const char *block = k_cache + table[start / block_size] * block_stride + head_offset;
        const int64_t rows = ctx - start < block_size ? ctx - start : block_size;
        for (int64_t i = 0; i < rows; i++) {
            load_row(block + i * row_stride, dtype, head_dim, row);
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qs + g * head_dim;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; d++) dot += qg[d] * row[d];
                scores[g * ctx + start + i] = dot;
            }
        }
    }

    float inv_sum[group];
    for (int64_t g = 0; g < group; g++) inv_sum[g] = softmax_inplace(scores + g * ctx, ctx);

    memset(acc, 0, (size_t)(group * head_dim) * sizeof(float));
    for (int64_t start = 0; start < ctx; start += block_size) {
        const char *block = v_cache + table[start / block_size] * block_stride + head_offset;
        const int64_t rows = ctx - start < block_size ? ctx - start : block_size;
        for (int64_t i = 0; i < rows; i++) {
            load_row(block + i * row_stride, dtype, head_dim, row);
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g * ctx + start + i];
                float *a = acc + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) a[d] += p * row[d];
            }
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
static inline void prefetch_lines(const char *start, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(start + b, _MM_HINT_T0);
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

/* One sequence, every head, for head_dim = 16 * nvec (nvec <= 16). Blocks are
 * walked once each for K and for V, all kv heads of a row together, so every
 * cache line is read from memory once and in order. Each caller passes a
 * constant nvec, so the per-head accumulators live in registers. */
static inline __attribute__((always_inline)) void attend_seq_avx512(
        const float *restrict q, const char *k_cache, const char *v_cache, const int dtype,
        const int64_t elem, const int64_t nvec, const int64_t *table, int64_t ctx, int64_t heads,
        int64_t kv_heads, int64_t block_size, float scale, float *restrict work, float *restrict out) {
    const int64_t group = heads / kv_heads;
    float *scores = work;                         /* [heads][ctx] */
    float *acc = scores + heads * ctx;            /* [heads][16 * nvec] */
    __m512 qs[heads * nvec];
    const int64_t head_bytes = 16 * nvec * elem;
    const int64_t row_stride = kv_heads * head_bytes;   /* bytes between tokens of a block */
    const int64_t block_stride = block_size * row_stride;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t i = 0; i < heads * nvec; i++) qs[i] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * i), vscale);

    /* Scores: q . k for every key, sixteen keys per tree reduction. */
    for (int64_t start = 0; start < ctx; start += block_size) {
        const char *block = k_cache + table[start / block_size] * block_stride;
        const int64_t rows = ctx - start < block_size ? ctx - start : block_size;
        if (start + block_size < ctx)
            prefetch_lines(k_cache + table[start / block_size + 1] * block_stride, block_stride);
        for (int64_t h = 0; h < heads; h++) {
            const __m512 *qh = qs + h * nvec;
            const char *head = block + (h / group) * head_bytes;
            float *sh = scores + h * ctx + start;
            int64_t i = 0;
            for (; i + 16 <= rows; i += 16) {
                __m512 dots[16];
                for (int j = 0; j < 16; j++) {
                    const char *src = head + (i + j) * row_stride;
                    __m512 dot = _mm512_mul_ps(qh[0], load16(src, dtype));
                    for (int64_t v = 1; v < nvec; v++)
                        dot = _mm512_fmadd_ps(qh[v], load16(src + 16 * v * elem, dtype), dot);
                    dots[j] = dot;
                }
                _mm512_storeu_ps(sh + i, hsum16(dots));
            }
            for (; i < rows; i++) {
                const char *src = head + i * row_stride;
                __m512 dot = _mm512_mul_ps(qh[0], load16(src, dtype));
                for (int64_t v = 1; v < nvec; v++)
                    dot = _mm512_fmadd_ps(qh[v], load16(src + 16 * v * elem, dtype), dot);
                sh[i] = _mm512_reduce_add_ps(dot);
            }
        }
    }

    float inv_sum[heads];
    for (int64_t h = 0; h < heads; h++) inv_sum[h] = softmax_inplace(scores + h * ctx, ctx);

    /* Values: out_h = sum_t p_h[t] v[t], one head at a time over a block (the
     * block stays in L1 for the next head). */
    memset(acc, 0, (size_t)(heads * nvec * 16) * sizeof(float));
    for (int64_t start = 0; start < ctx; start += block_size) {
        const char *block = v_cache + table[start / block_size] * block_stride;
        const int64_t rows = ctx - start < block_size ? ctx - start : block_size;
        if (start + block_size < ctx)
            prefetch_lines(v_cache + table[start / block_size + 1] * block_stride, block_stride);
        for (int64_t h = 0; h < heads; h++) {
            const float *ph = scores + h * ctx + start;
            const char *head = block + (h / group) * head_bytes;
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
    static void NAME(const float *q, const char *k, const char *v, const int64_t *table, int64_t ctx,  \
                     int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,            \
                     float scale, float *work, float *out) {                                           \
        attend_seq_avx512(q, k, v, DTYPE, ELEM, (NVEC) ? (NVEC) : head_dim / 16, table, ctx, heads,    \
                          kv_heads, block_size, scale, work, out);                                     \
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
                          int64_t, int64_t, int64_t, float, float *, float *);

#if defined(__AVX512BF16__)
/* bfloat16 caches on CPUs with AVX512_BF16: products of bf16 pairs summed in
 * float32 by one instruction (vdpbf16ps), so rows are never widened.
 * Scores: q (rounded to bf16) . k, 32 dims per instruction. Values: two
 * tokens per instruction, their rows interleaved, against the pair of their
 * probabilities (rounded to bf16, as the PyTorch path does before its PV
 * matmul). head_dim = 32 * npair. */
static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float x) {
    union { float f; uint32_t u; } v = {x};
    return (uint16_t)((v.u + 0x7FFF + ((v.u >> 16) & 1)) >> 16);   /* round to nearest even */
}

static inline __attribute__((always_inline)) void attend_seq_bf16dp(
        const float *restrict q, const char *k_cache, const char *v_cache, const int64_t npair,
        const int64_t *table, int64_t ctx, int64_t heads, int64_t kv_heads, int64_t block_size,
        float scale, float *restrict work, float *restrict out) {
    const int64_t group = heads / kv_heads;
    const int64_t head_dim = 32 * npair;
    float *scores = work;                         /* [heads][ctx] */
    float *acc = scores + heads * ctx;            /* [heads][2][head_dim]: lo and hi halves */
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

    for (int64_t start = 0; start < ctx; start += block_size) {
        const char *block = k_cache + table[start / block_size] * block_stride;
        const int64_t rows = ctx - start < block_size ? ctx - start : block_size;
        if (start + block_size < ctx)
            prefetch_lines(k_cache + table[start / block_size + 1] * block_stride, block_stride);
        for (int64_t h = 0; h < heads; h++) {
            const __m512bh *qh = qs + h * npair;
            const char *head = block + (h / group) * head_bytes;
            float *sh = scores + h * ctx + start;
            int64_t i = 0;
            for (; i + 16 <= rows; i += 16) {
                __m512 dots[16];
                for (int j = 0; j < 16; j++) {
                    const char *src = head + (i + j) * row_stride;
                    __m512 dot = _mm512_setzero_ps();
                    for (int64_t w = 0; w < npair; w++)
                        dot = _mm512_dpbf16_ps(dot, qh[w], (__m512bh)_mm512_loadu_si512(src + 64 * w));
                    dots[j] = dot;
                }
                _mm512_storeu_ps(sh + i, hsum16(dots));
            }
            for (; i < rows; i++) {
                const char *src = head + i * row_stride;
                __m512 dot = _mm512_setzero_ps();
                for (int64_t w = 0; w < npair; w++)
                    dot = _mm512_dpbf16_ps(dot, qh[w], (__m512bh)_mm512_loadu_si512(src + 64 * w));
                sh[i] = _mm512_reduce_add_ps(dot);
            }
        }
    }

    float inv_sum[heads];
    for (int64_t h = 0; h < heads; h++) inv_sum[h] = softmax_inplace(scores + h * ctx, ctx);

    memset(acc, 0, (size_t)(heads * 2 * head_dim) * sizeof(float));
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t start = 0; start < ctx; start += block_size) {
        const char *block = v_cache + table[start / block_size] * block_stride;
        const int64_t rows = ctx - start < block_size ? ctx - start : block_size;
        if (start + block_size < ctx)
            prefetch_lines(v_cache + table[start / block_size + 1] * block_stride, block_stride);
        for (int64_t h = 0; h < heads; h++) {
            const float *ph = scores + h * ctx + start;
            const char *head = block + (h / group) * head_bytes;
            float *ah = acc + h * 2 * head_dim;
            __m512 lo[npair], hi[npair];
            for (int64_t w = 0; w < npair; w++) {
                lo[w] = _mm512_loadu_ps(ah + 32 * w);
                hi[w] = _mm512_loadu_ps(ah + 32 * w + 16);
            }
            for (int64_t i = 0; i < rows; i += 2) {
                const int second = i + 1 < rows;
                const char *src0 = head + i * row_stride;
                const char *src1 = src0 + row_stride;
                const uint32_t pair = (uint32_t)f32_to_bf16(ph[i])
                                      | (uint32_t)(second ? f32_to_bf16(ph[i + 1]) : 0) << 16;
                const __m512bh p = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int64_t w = 0; w < npair; w++) {
                    const __m512i r0 = _mm512_loadu_si512(src0 + 64 * w);
                    const __m512i r1 = second ? _mm512_loadu_si512(src1 + 64 * w) : zero;
                    lo[w] = _mm512_dpbf16_ps(lo[w], (__m512bh)_mm512_unpacklo_epi16(r0, r1), p);
                    hi[w] = _mm512_dpbf16_ps(hi[w], (__m512bh)_mm512_unpackhi_epi16(r0, r1), p);
                }
            }
            for (int64_t w = 0; w < npair; w++) {
                _mm512_storeu_ps(ah + 32 * w, lo[w]);
                _mm512_storeu_ps(ah + 32 * w + 16, hi[w]);
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
    static void NAME(const float *q, const char *k, const char *v, const int64_t *table, int64_t ctx,  \
                     int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,            \
                     float scale, float *work, float *out) {                                           \
        attend_seq_bf16dp(q, k, v, (NPAIR) ? (NPAIR) : head_dim / 32, table, ctx, heads, kv_heads,     \
                          block_size, scale, work, out);                                               \
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

/* q: [batch, heads, head_dim] float32; out: the same shape, float32.
 * block_tables: [batch, max_blocks] int64; context_lens: [batch] int64 (>= 1).
 * Returns 0, or -1 when a work buffer cannot be allocated. */
int pipeserve_paged_decode(const float *q, const void *k_cache, const void *v_cache, int dtype,
                           const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens,
                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, float *out, int num_threads) {
    const int64_t group = heads / kv_heads;
    const int64_t elem = dtype == DT_FLOAT32 ? 4 : 2;
    int64_t max_ctx = 1;
    for (int64_t b = 0; b < batch; b++) max_ctx = context_lens[b] > max_ctx ? context_lens[b] : max_ctx;
#if HAVE_AVX512
    const attend_fn seq_fn = pick_avx512(dtype, head_dim);
#else
    const void *seq_fn = 0;
#endif
    /* Work items: whole sequences (vector path) or (sequence, kv head) pairs. */
    const int64_t per_item = seq_fn ? kv_heads : 1;
    const int64_t items = seq_fn ? batch : batch * kv_heads;
    const int64_t work_floats = per_item * (group * max_ctx + 2 * group * head_dim + head_dim);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        float *work = (float *)malloc((size_t)work_floats * sizeof(float));
        if (!work) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!work) continue;
#if HAVE_AVX512
            if (seq_fn) {
                seq_fn(q + item * heads * head_dim, (const char *)k_cache, (const char *)v_cache,
                       block_tables + item * max_blocks, context_lens[item], heads, kv_heads, head_dim,
                       block_size, scale, work, out + item * heads * head_dim);
                continue;
            }
#endif
            const int64_t b = item / kv_heads, h = item % kv_heads;
            const int64_t offset = (b * heads + h * group) * head_dim;
            attend_one(q + offset, (const char *)k_cache, (const char *)v_cache, dtype, elem,
                       block_tables + b * max_blocks, context_lens[b], h, group, kv_heads, head_dim,
                       block_size, scale, work, out + offset);
        }
        free(work);
    }
    return failed ? -1 : 0;
}
