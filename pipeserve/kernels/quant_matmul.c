/* Matmuls against weights kept quantized (pipeserve/model/quant/packed.py).
 *
 * Layouts: a row of `K` weights is K / group float16 scales (and minimums)
 * plus codes, either "q4" (16 bytes per 32 weights: weight j in the low
 * nibble of byte j, weight j + 16 in its high nibble) or "q8" (one int8 per
 * weight). A weight is scale * q + min.
 *
 * pipeserve_quant_gemv: out[M, N] = x[M, K] . W[N, K]^T for a few rows of x
 *   (decode). Bandwidth-bound: each thread takes a range of output rows and
 *   reads their codes once, dequantizing 16 weights at a time in registers
 *   (fma(q, scale, min)) and multiplying them into up to 4 rows of x.
 * pipeserve_quant_dequant: rows [r0, r1) of W as float32 or bfloat16, so a
 *   prefill can run a dense matmul per tile.
 * x and out are float32 or bfloat16 (the flags); accumulation is float32.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_math.h"

#define MAX_M 4  /* rows of x per pass over the weights */

static inline float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0x1fu) {
        v.u = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        v.u = sign | ((exp + 112u) << 23) | (mant << 13);
    } else {  /* zero or subnormal: mant * 2^-24 */
        v.f = (float)mant * 5.9604644775390625e-8f;
        v.u |= sign;
    }
    return v.f;
}

const char *pipeserve_quant_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    return "avx512";
#else
    return "portable";
#endif
}

/* One output row's dot products with `m_rows` rows of x (float32, [m_rows, K]). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

static inline __attribute__((always_inline)) void
row_dot(int kind, const uint8_t *q, const uint16_t *sc, const uint16_t *mn, int64_t K, int64_t group,
        const float *x, int m_rows, float *res) {
    __m512 acc0[MAX_M], acc1[MAX_M];
    for (int m = 0; m < m_rows; m++) acc0[m] = acc1[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / group; g++) {
        /* F16C: one instruction per scale (the portable f16_to_f32 costs as much as the dot). */
        const __m512 s = _mm512_set1_ps(_cvtsh_ss(sc[g]));
        const __m512 b = _mm512_set1_ps(mn ? _cvtsh_ss(mn[g]) : 0.0f);
        if (kind == 4) {  /* group is a multiple of 32 */
            for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
                const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + k / 2)));
                const __m512 w0 = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15))), s, b);
                const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), s, b);
                for (int m = 0; m < m_rows; m++) {
                    acc0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + k), acc0[m]);
                    acc1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * K + k + 16), acc1[m]);
                }
            }
        } else {  /* group is a multiple of 16 (Q6_K has 16) */
            for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
                const __m512 w = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + k)))), s, b);
                if ((k >> 4) & 1)
                    for (int m = 0; m < m_rows; m++) acc1[m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * K + k), acc1[m]);
                else
                    for (int m = 0; m < m_rows; m++) acc0[m] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * K + k), acc0[m]);
            }
        }
    }
    for (int m = 0; m < m_rows; m++) res[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m]));
}

/* Decode's common case, one row of x: two weight rows at once, so four FMA
 * chains are in flight instead of two (one chain is bound by FMA latency). */
static void two_rows_dot1(int kind, const uint8_t *qa, const uint8_t *qb, const uint16_t *sa,
                          const uint16_t *sb, const uint16_t *ma, const uint16_t *mb, int64_t K,
                          int64_t group, const float *x, float *res) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    for (int64_t g = 0; g < K / group; g++) {
        const __m512 s_a = _mm512_set1_ps(_cvtsh_ss(sa[g])), s_b = _mm512_set1_ps(_cvtsh_ss(sb[g]));
        const __m512 m_a = _mm512_set1_ps(ma ? _cvtsh_ss(ma[g]) : 0.0f);
        const __m512 m_b = _mm512_set1_ps(mb ? _cvtsh_ss(mb[g]) : 0.0f);
        if (kind == 4) {
            for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
                const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
                const __m512i ba = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qa + k / 2)));
                const __m512i bb = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qb + k / 2)));
                const __m512i lo = _mm512_set1_epi32(15);
                a0 = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(ba, lo)), s_a, m_a), x0, a0);
                a1 = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(ba, 4)), s_a, m_a), x1, a1);
                b0 = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bb, lo)), s_b, m_b), x0, b0);
                b1 = _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bb, 4)), s_b, m_b), x1, b1);
            }
        } else {
            for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
                const __m512 x0 = _mm512_loadu_ps(x + k);
                const __m512 wa = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qa + k)))), s_a, m_a);
                const __m512 wb = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qb + k)))), s_b, m_b);
                if ((k >> 4) & 1) {
                    a1 = _mm512_fmadd_ps(wa, x0, a1);
                    b1 = _mm512_fmadd_ps(wb, x0, b1);
                } else {
                    a0 = _mm512_fmadd_ps(wa, x0, a0);
                    b0 = _mm512_fmadd_ps(wb, x0, b0);
                }
            }
        }
    }
    res[0] = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    res[1] = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
}
#define HAVE_TWO_ROWS 1
#else
static inline void row_dot(int kind, const uint8_t *q, const uint16_t *sc, const uint16_t *mn, int64_t K,
                           int64_t group, const float *x, int m_rows, float *res) {
    for (int m = 0; m < m_rows; m++) res[m] = 0.0f;
    for (int64_t g = 0; g < K / group; g++) {
        const float s = f16_to_f32(sc[g]), b = mn ? f16_to_f32(mn[g]) : 0.0f;
        for (int64_t k = g * group; k < (g + 1) * group; k++) {
            const int64_t j = k % 32, base = k - j;
            const float code = kind == 4 ? (float)(j < 16 ? q[base / 2 + j] & 15 : q[base / 2 + j - 16] >> 4)
                                         : (float)((const int8_t *)q)[k];
            const float w = code * s + b;
            for (int m = 0; m < m_rows; m++) res[m] += w * x[m * K + k];
        }
    }
}
#endif

/* Specialised per m_rows so the compiler unrolls the row loop and keeps the
 * accumulators in registers. */
static void rows_dot(int kind, const uint8_t *q, const uint16_t *sc, const uint16_t *mn, int64_t K,
                     int64_t group, const float *x, int m_rows, float *res) {
    switch (m_rows) {
    case 1: row_dot(kind, q, sc, mn, K, group, x, 1, res); break;
    case 2: row_dot(kind, q, sc, mn, K, group, x, 2, res); break;
    case 3: row_dot(kind, q, sc, mn, K, group, x, 3, res); break;
    default: row_dot(kind, q, sc, mn, K, group, x, 4, res); break;
    }
}

static void store(void *out, int out_bf16, int64_t index, float v) {
    if (out_bf16) ((uint16_t *)out)[index] = f32_to_bf16(v);
    else ((float *)out)[index] = v;
}

/* kind: 4 or 8; mn may be NULL. Returns 0, or -1 when scratch cannot be allocated. */
int pipeserve_quant_gemv(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                         int64_t N, int64_t K, int64_t group, const void *x, int x_bf16, int64_t M,
                         void *out, int out_bf16, int num_threads) {
    float *xf = malloc(sizeof(float) * M * K);
    if (!xf) return -1;
    for (int64_t i = 0; i < M * K; i++)
        xf[i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    const int64_t row_bytes = kind == 4 ? K / 2 : K, groups = K / group;
#ifdef HAVE_TWO_ROWS
    if (M == 1) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
        for (int64_t pair = 0; pair < N / 2; pair++) {
            const int64_t n = 2 * pair;
            float res[2];
            two_rows_dot1(kind, qs + n * row_bytes, qs + (n + 1) * row_bytes, sc + n * groups,
                          sc + (n + 1) * groups, mn ? mn + n * groups : NULL, mn ? mn + (n + 1) * groups : NULL,
                          K, group, xf, res);
            store(out, out_bf16, n, res[0]);
            store(out, out_bf16, n + 1, res[1]);
        }
        if (N % 2) {
            float res[1];
            rows_dot(kind, qs + (N - 1) * row_bytes, sc + (N - 1) * groups, mn ? mn + (N - 1) * groups : NULL,
                     K, group, xf, 1, res);
            store(out, out_bf16, N - 1, res[0]);
        }
        free(xf);
        return 0;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *q = qs + n * row_bytes;
        const uint16_t *s = sc + n * groups, *b = mn ? mn + n * groups : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
            float res[MAX_M];
            const int m_rows = M - m0 < MAX_M ? (int)(M - m0) : MAX_M;
            rows_dot(kind, q, s, b, K, group, xf + m0 * K, m_rows, res);
            for (int m = 0; m < m_rows; m++) store(out, out_bf16, (m0 + m) * N + n, res[m]);
        }
    }
    free(xf);
    return 0;
}

void pipeserve_quant_dequant(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                             int64_t K, int64_t group, int64_t r0, int64_t r1, void *out, int out_bf16,
                             int num_threads) {
    const int64_t row_bytes = kind == 4 ? K / 2 : K, groups = K / group;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t n = r0; n < r1; n++) {
        const uint8_t *q = qs + n * row_bytes;
        const uint16_t *s = sc + n * groups, *b = mn ? mn + n * groups : NULL;
        const int64_t o = (n - r0) * K;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
        if (kind == 4) {   /* the prefill tile path's common case, vectorised */
            for (int64_t g = 0; g < groups; g++) {
                const __m512 sv = _mm512_set1_ps(_cvtsh_ss(s[g])), bv = _mm512_set1_ps(b ? _cvtsh_ss(b[g]) : 0.0f);
                for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
                    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + k / 2)));
                    const __m512 w0 = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15))), sv, bv);
                    const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), sv, bv);
                    if (out_bf16) {
                        uint16_t *o16 = (uint16_t *)out + o + k;
                        _mm256_storeu_si256((__m256i *)o16, (__m256i)_mm512_cvtneps_pbh(w0));
                        _mm256_storeu_si256((__m256i *)(o16 + 16), (__m256i)_mm512_cvtneps_pbh(w1));
                    } else {
                        _mm512_storeu_ps((float *)out + o + k, w0);
                        _mm512_storeu_ps((float *)out + o + k + 16, w1);
                    }
                }
            }
            continue;
        }
#endif
        for (int64_t g = 0; g < groups; g++) {
            const float scale = f16_to_f32(s[g]), bias = b ? f16_to_f32(b[g]) : 0.0f;
            const int step = kind == 4 ? 32 : 16;   /* a q8 group may be 16 (Q6_K) */
            for (int64_t k = g * group; k < (g + 1) * group; k += step) {
                float w[32];
                if (kind == 4) {
#pragma omp simd
                    for (int j = 0; j < 16; j++) {
                        w[j] = (float)(q[k / 2 + j] & 15) * scale + bias;
                        w[j + 16] = (float)(q[k / 2 + j] >> 4) * scale + bias;
                    }
                } else {
#pragma omp simd
                    for (int j = 0; j < 16; j++) w[j] = (float)((const int8_t *)q)[k + j] * scale + bias;
                }
                if (out_bf16) {
#pragma omp simd
                    for (int j = 0; j < step; j++) ((uint16_t *)out)[o + k + j] = f32_to_bf16(w[j]);
                } else {
                    memcpy((float *)out + o + k, w, sizeof(float) * step);
                }
            }
        }
    }
}
