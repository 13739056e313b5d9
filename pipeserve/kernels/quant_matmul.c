/* Matmuls against weights kept quantized (pipeserve/model/quant/packed.py).
 *
 * Layouts: a row of `K` weights is K / group float16 scales (and minimums)
 * plus codes, either "q4" (16 bytes per 32 weights: weight j in the low
 * nibble of byte j, weight j + 16 in its high nibble) or "q8" (one int8 per
 * weight), or "q5" (q4's nibbles plus a bit-plane of high bits) or "q6" (Q6_K's own
 * nibble and high-bit-pair bytes), minus a constant `zero` (quant_codes.h), or "i4" (q4's nibbles, each an index into
 * IQ4's 16 signed values), or "q2" / "q3" (Q2_K's / Q3_K's 2-bit pairs, q3 with a high-bit
 * mask, and their integer sub-scales per 16 under a float16 scale per 256: quant_k2.h takes
 * them on every path), or "q4k" / "q5k" / "q6k" (q4's / q5's / q6's codes under Q4_K's / Q5_K's / Q6_K's two-level
 * scales, d * sub exact in float32: in registers on the integer decodes, float32 scratch in L1
 * on the float and dequantize paths, quant_codes.h; every build takes all ten,
 * pipeserve_quant_takes). A weight
 * is scale * (q - zero) + min (q4's `zero`: Q4_0's 8, so it needs no minimum array; q8's is 0).
 * q5/q6/i4/q2/q3 codes cross the memory bus at their compact size: the integer-activation
 * path expands each chunk of 64 (AVX2: block of 32) in registers (chunk_codes_hb: q5's raw
 * codes in q4's order; chunk_codes6: q6's in weight order; quant_gemv_avx2.h's block_codes_u8:
 * the bytes a q8 row holds); the float and
 * dequantize paths expand a row into a per-thread scratch row (in L1) just before using
 * it as q8.
 *
 * pipeserve_quant_gemv: out[M, N] = x[M, K] . W[N, K]^T for a few rows of x
 *   (decode). Each thread takes a contiguous range of output rows and reads
 *   their codes once (prefetching a few rows ahead); with float activations it
 *   dequantizes 16 weights at a time in registers (fma(q, scale, min)) and
 *   multiplies them into up to 4 rows of x; with integer activations (below)
 *   it takes integer dot products of the codes.
 * pipeserve_quant_dequant: rows [r0, r1) of W as float32 or bfloat16, so a
 *   prefill can run a dense matmul per tile.
 * x and out are float32 or bfloat16 (the flags); accumulation is float32.
 *
 * Integer activations (flag act_i8, AVX512-VNNI builds, groups a multiple of 32):
 *   each row of x is quantized once per call into blocks of 32. q8 weights:
 *   two int8 terms, x ~ d * (256 * q1 + q2) with d = max|x| / (127 * 256)
 *   (llama.cpp uses q1 alone; on SmolLM2 that costs ~2 points of top-1
 *   agreement), two vpdpbusd per block (codes enter unsigned as q + 128, the
 *   128 * s_w * d * sum(x') excess folded into the min term). q4 weights: one
 *   int16 term, x ~ d * q with d = max|x| / 32767, two vpdpwssd per pair of
 *   blocks (fewer instructions than two int8 terms, and finer). A row is read
 *   in chunks of 64 weights (two blocks, 16 int32 lanes); each lane is scaled
 *   by its block's s_w * d (a permute of a 16-block vector of them), the
 *   minimums meet d * sum(x') once per 16 blocks, and the lanes are summed
 *   once per row. Groups of 16 (Q6_K) take this path too: each lane of a chunk is one
 *   group (4 lanes per 16 weights), scaled from two 16-lane vectors of s_w * d, and
 *   the offset term meets per-half-block activation sums. q5/q6 (compact codes) take
 *   q8's two int8 terms, their raw codes expanded in registers (chunk_codes_hb: q5 in q4's
 *   order; chunk_codes6: q6 in weight order, as q8; their -zero * s_w term as q4's). i4/q2/q3 take the AVX2 path below instead
 *   (quant_gemv_avx2.h, quant_k2.h: int8 activations, AVX2_LATER). Error vs float activations
 *   per element: at most d (q8, q5, q6: half a step of q2, a whole one where it saturates) or
 *   d / 2 (q4), both at most max|x| / 32512 of the block.
 * AVX2 + FMA + F16C builds without AVX-512 ("avx2") take integer activations too (quant_gemv_avx2.h):
 *   int16 for q8, error at most max|x| / 65534 of the block per element; int8 for q4/q5/q6/i4/q2/q3, at most
 *   max|x| / 254 (their codes meet it in vpmaddubsw, as llama.cpp's Q8 activations do); their float
 *   path and the dequantize below use 256-bit vectors.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "vec_math.h"
#include "quant_codes.h"

#define MAX_M 4  /* rows of x per pass over the weights (float path) */
/* quant_gemv_avx2.h: AVX2 builds' integer decode (HAVE_AVX2_I16), which AVX-512 VNNI builds take
 * for i4, q2 and q3 (AVX2_LATER) */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#if !(defined(__AVX512F__) && defined(__AVX512BW__))
#define HAVE_AVX2_I16 1
#define HAVE_AVX2_INT 1
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_AVX2_INT 1
#endif
#endif
#ifdef HAVE_AVX2_INT
#include "quant_gemv_avx2.h"
#endif
#define GEMV_ROWS 8  /* rows of x per pass on the int8-activation path */

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

static inline void store(void *out, int out_bf16, int64_t index, float v) {
    if (out_bf16) ((uint16_t *)out)[index] = f32_to_bf16(v);
    else ((float *)out)[index] = v;
}

const char *pipeserve_quant_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512-vnni";
#elif defined(__AVX512F__) && defined(__AVX512BW__)
    return "avx512";
#elif defined(HAVE_AVX2_I16)
    return "avx2";
#else
    return "portable";
#endif
}

/* 1 when this build's kernels take layout `kind` (4, 8, 5, 6, 9 = i4, 2 = q2, 3 = q3): the loader
 * keeps IQ4 / Q2_K / Q3_K weights as i4 / q2 / q3 only where they do, widened to q8 otherwise
 * (every build takes them now; a library from before them answers no, or lacks the question). */
int pipeserve_quant_takes(int kind) { return quant_takes_kind(kind); }

/* One output row's dot products with `m_rows` rows of x (float32, [m_rows, K]). */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

static inline __attribute__((always_inline)) void
row_dot(int kind, const uint8_t *q, const uint16_t *sc, const uint16_t *mn, int zero, int64_t K, int64_t group,
        const float *x, int m_rows, float *res, int f32) {
    __m512 acc0[MAX_M], acc1[MAX_M];
    for (int m = 0; m < m_rows; m++) acc0[m] = acc1[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < K / group; g++) {
        /* F16C: one instruction per scale (the portable f16_to_f32 costs as much as the dot);
         * f32: the two-level layouts' float32 scratch */
        const float sg = quant_scale_at(sc, g, f32);
        const __m512 s = _mm512_set1_ps(sg);
        const __m512 b = _mm512_set1_ps((mn ? quant_scale_at(mn, g, f32) : 0.0f) - (float)zero * sg);
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
                          const uint16_t *sb, const uint16_t *ma, const uint16_t *mb, int zero, int64_t K,
                          int64_t group, const float *x, float *res, int f32) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, b0 = a0, b1 = a0;
    for (int64_t g = 0; g < K / group; g++) {
        const float fa = quant_scale_at(sa, g, f32), fb = quant_scale_at(sb, g, f32);
        const __m512 s_a = _mm512_set1_ps(fa), s_b = _mm512_set1_ps(fb);
        const __m512 m_a = _mm512_set1_ps((ma ? quant_scale_at(ma, g, f32) : 0.0f) - (float)zero * fa);
        const __m512 m_b = _mm512_set1_ps((mb ? quant_scale_at(mb, g, f32) : 0.0f) - (float)zero * fb);
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
#elif defined(HAVE_AVX2_I16)
/* Codes to floats 8 at a time: q4 weights k..k+31 from 16 bytes (w[0..3] = weights
 * k, k+8, k+16, k+24 onwards), q8 weights k..k+15 from 16 bytes (w[0..1]). */
static inline __attribute__((always_inline)) void
weights_avx2(int kind, const uint8_t *q, int64_t k, __m256 s, __m256 b, __m256 *w) {
    if (kind == 4) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(q + k / 2));
        const __m256i b0 = _mm256_cvtepu8_epi32(raw), b1 = _mm256_cvtepu8_epi32(_mm_srli_si128(raw, 8));
        const __m256i lo = _mm256_set1_epi32(15);
        w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, lo)), s, b);
        w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, lo)), s, b);
        w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), s, b);
        w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), s, b);
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(q + k));
        w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), s, b);
        w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8))), s, b);
    }
}

/* Group g's scale and offset, broadcast: a weight is code * s + b (b: its minimum, less
 * `zero` codes' worth of scale). */
static inline __attribute__((always_inline)) void
group_scale_avx2(const uint16_t *sc, const uint16_t *mn, int zero, int64_t g, __m256 *s, __m256 *b, int f32) {
    const float sg = quant_scale_at(sc, g, f32);
    *s = _mm256_set1_ps(sg);
    *b = _mm256_set1_ps((mn ? quant_scale_at(mn, g, f32) : 0.0f) - (float)zero * sg);
}

static inline __attribute__((always_inline)) void
row_dot(int kind, const uint8_t *q, const uint16_t *sc, const uint16_t *mn, int zero, int64_t K, int64_t group,
        const float *x, int m_rows, float *res, int f32) {
    __m256 acc0[MAX_M], acc1[MAX_M];
    const int step = kind == 4 ? 32 : 16, nw = step / 8;   /* a q8 group may be 16 (Q6_K) */
    for (int m = 0; m < m_rows; m++) acc0[m] = acc1[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < K / group; g++) {
        __m256 s, b;
        group_scale_avx2(sc, mn, zero, g, &s, &b, f32);
        for (int64_t k = g * group; k < (g + 1) * group; k += step) {
            __m256 w[4];
            weights_avx2(kind, q, k, s, b, w);
            for (int m = 0; m < m_rows; m++)
                for (int i = 0; i < nw; i++) {
                    __m256 *acc = i & 1 ? &acc1[m] : &acc0[m];
                    *acc = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(x + m * K + k + 8 * i), *acc);
                }
        }
    }
    for (int m = 0; m < m_rows; m++) res[m] = hsum8(_mm256_add_ps(acc0[m], acc1[m]));
}

/* float -> bfloat16, round to nearest even (weights are finite: no NaN case). */
static inline __m128i bf16x8(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                             _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1))));
    u = _mm256_srli_epi32(u, 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
}

/* One row of codes (q4 nibbles, or int8) dequantized into out[o, o + K). */
static void dequant_row_avx2(int kind, const uint8_t *q, const uint16_t *sc, const uint16_t *mn, int zero,
                             int64_t K, int64_t group, void *out, int out_bf16, int64_t o, int f32) {
    const int step = kind == 4 ? 32 : 16, nw = step / 8;
    for (int64_t g = 0; g < K / group; g++) {
        __m256 s, b;
        group_scale_avx2(sc, mn, zero, g, &s, &b, f32);
        for (int64_t k = g * group; k < (g + 1) * group; k += step) {
            __m256 w[4];
            weights_avx2(kind, q, k, s, b, w);
            for (int i = 0; i < nw; i++) {
                if (out_bf16) _mm_storeu_si128((__m128i *)((uint16_t *)out + o + k + 8 * i), bf16x8(w[i]));
                else _mm256_storeu_ps((float *)out + o + k + 8 * i, w[i]);
            }
        }
    }
}
#else
static inline void row_dot(int kind, const uint8_t *q, const uint16_t *sc, const uint16_t *mn, int zero, int64_t K,
                           int64_t group, const float *x, int m_rows, float *res, int f32) {
    for (int m = 0; m < m_rows; m++) res[m] = 0.0f;
    for (int64_t g = 0; g < K / group; g++) {
        const float s = quant_scale_at(sc, g, f32), b = (mn ? quant_scale_at(mn, g, f32) : 0.0f) - (float)zero * s;
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_VNNI 1
#define QB 32      /* activation block */
#ifndef PF_ROWS
#define PF_ROWS 8
#endif
#ifndef PF_BYTES
#define PF_BYTES 8192
#endif
#define CHUNK 64   /* weights per 512-bit dot product: two blocks */

/* Activations of the int8 path, per row of x, quantized once per call:
 * x1, x2 [M, chunks, 64] int8, the two terms of x ~ d * (256 * q1 + q2) per block of 32
 * (d = max|x| / 127 / 256), each chunk of two blocks b, b + 1 in the order the weight
 * unpack produces (q4, and q5's two terms: x_b[0:16], x_b+1[0:16], x_b[16:32], x_b+1[16:32];
 * q8, q6: x_b, x_b+1;
 * a trailing odd block pairs with zeros); xd, xc [M, nbp] float (nbp = blocks rounded up
 * to 16, zero padded): d and d * (256 * sum q1 + sum q2) per block.
 * q1 = round(x / 256d); q2 = the remainder rounded in steps of d (|q2| <= 128, clamped
 * to 127): about 15 bits per activation, finer than the bfloat16 input. */
typedef struct {
    int8_t *x1, *x2;    /* q8/q5/q6 weights: two int8 terms */
    int16_t *xw;        /* q4 weights: one int16 term, [M, chunks, 64] */
    float *xd, *xc;
    float *xc16;        /* int8 terms, groups of 16 (Q6_K): d * (256 * sum q1 + sum q2) per half block, [M, 2 * nbp] */
    int64_t nb, nch, nbp;
} act_i8;

/* q4 weights take 16-bit activations instead (vpdpwssd): x ~ d * q, d = max|x| / 32767 per
 * block, each chunk as [x_b[0:16], x_b+1[0:16], x_b[16:32], x_b+1[16:32]] (the order of
 * the zero-extended code bytes' low, then high, nibbles). One product term where the
 * two-term int8 form needs two plus a shift, and finer (half a step is max|x| / 65534). */
static void quantize_rows16(const float *x, int64_t M, int64_t K, const act_i8 *a) {
    for (int64_t m = 0; m < M; m++) {
        if (a->nb & 1) memset(a->xw + (m * a->nch + a->nch - 1) * CHUNK, 0, CHUNK * sizeof(int16_t));
        for (int64_t b = a->nb; b < a->nbp; b++) a->xd[m * a->nbp + b] = a->xc[m * a->nbp + b] = 0.0f;
        for (int64_t b = 0; b < a->nb; b++) {
            const float *xb = x + m * K + b * QB;
            const __m512 u = _mm512_loadu_ps(xb), v = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(u), _mm512_abs_ps(v)));
            const __m512 id = _mm512_set1_ps(amax > 0.0f ? 32767.0f / amax : 0.0f);
            const __m512i iu = _mm512_cvtps_epi32(_mm512_mul_ps(u, id)), iv = _mm512_cvtps_epi32(_mm512_mul_ps(v, id));
            int16_t *c = a->xw + (m * a->nch + b / 2) * CHUNK + (b & 1) * 16;
            _mm256_storeu_si256((__m256i *)c, _mm512_cvtsepi32_epi16(iu));
            _mm256_storeu_si256((__m256i *)(c + 32), _mm512_cvtsepi32_epi16(iv));
            const float d = amax / 32767.0f;
            a->xd[m * a->nbp + b] = d;
            a->xc[m * a->nbp + b] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(iu, iv));
        }
    }
}

static void quantize_rows(int kind, const float *x, int64_t M, int64_t K, const act_i8 *a) {
    const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
    const __m512 k256 = _mm512_set1_ps(256.0f);
    for (int64_t m = 0; m < M; m++) {
        if (a->nb & 1) {   /* the zero half of the last chunk */
            memset(a->x1 + (m * a->nch + a->nch - 1) * CHUNK, 0, CHUNK);
            memset(a->x2 + (m * a->nch + a->nch - 1) * CHUNK, 0, CHUNK);
        }
        for (int64_t b = a->nb; b < a->nbp; b++) {
            a->xd[m * a->nbp + b] = a->xc[m * a->nbp + b] = 0.0f;
            a->xc16[2 * (m * a->nbp + b)] = a->xc16[2 * (m * a->nbp + b) + 1] = 0.0f;
        }
        for (int64_t b = 0; b < a->nb; b++) {
            const float *xb = x + m * K + b * QB;
            const __m512 u = _mm512_loadu_ps(xb), v = _mm512_loadu_ps(xb + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(u), _mm512_abs_ps(v)));
            const __m512 id = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
            const __m512 su = _mm512_mul_ps(u, id), sv = _mm512_mul_ps(v, id);   /* units of 256d */
            const __m512 ru = _mm512_roundscale_ps(su, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512 rv = _mm512_roundscale_ps(sv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i iu = _mm512_cvtps_epi32(ru), iv = _mm512_cvtps_epi32(rv);
            const __m512i ju = _mm512_max_epi32(_mm512_min_epi32(
                _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(su, ru), k256)), hi), lo);
            const __m512i jv = _mm512_max_epi32(_mm512_min_epi32(
                _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(sv, rv), k256)), hi), lo);
            const int64_t c = (m * a->nch + b / 2) * CHUNK;
            /* q8, q6: x_b, x_b+1; q5: q4's order, x_b[0:16], x_b+1[0:16], x_b[16:32], x_b+1[16:32] */
            const int in_order = kind == 8 || kind == 6;
            const int64_t p0 = (b & 1) * (in_order ? 32 : 16), p1 = p0 + (in_order ? 16 : 32);
            _mm_storeu_si128((__m128i *)(a->x1 + c + p0), _mm512_cvtsepi32_epi8(iu));
            _mm_storeu_si128((__m128i *)(a->x1 + c + p1), _mm512_cvtsepi32_epi8(iv));
            _mm_storeu_si128((__m128i *)(a->x2 + c + p0), _mm512_cvtepi32_epi8(ju));
            _mm_storeu_si128((__m128i *)(a->x2 + c + p1), _mm512_cvtepi32_epi8(jv));
            const float d = amax / 127.0f / 256.0f;
            const float su1 = 256.0f * (float)_mm512_reduce_add_epi32(iu) + (float)_mm512_reduce_add_epi32(ju);
            const float sv1 = 256.0f * (float)_mm512_reduce_add_epi32(iv) + (float)_mm512_reduce_add_epi32(jv);
            a->xd[m * a->nbp + b] = d;
            a->xc[m * a->nbp + b] = d * (su1 + sv1);
            a->xc16[2 * (m * a->nbp + b)] = d * su1;
            a->xc16[2 * (m * a->nbp + b) + 1] = d * sv1;
        }
    }
}

/* The float16 scales (or minimums) of blocks [b0, b0 + n) of a row, n <= 16, one per lane
 * (lanes >= n are 0); `per` blocks share a scale (group / 32). */
static inline __m512 block_scales(const uint16_t *s, int64_t b0, int n, int64_t per) {
    if (per == 1) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), s + b0));
    float t[16] = {0};
    for (int j = 0; j < n; j++) t[j] = _cvtsh_ss(s[(b0 + j) / per]);
    return _mm512_loadu_ps(t);
}

/* q8: the codes of the chunk starting at block b as 64 unsigned bytes (code + 128).
 * `half`: block b is the row's last and has no partner (the activations are zero there). */
static inline __attribute__((always_inline)) __m512i chunk_codes8(const uint8_t *q, int64_t b, int half) {
    const __m512i w = half ? _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(q + b * 32)))
                           : _mm512_loadu_si512(q + b * 32);
    return _mm512_xor_si512(w, _mm512_set1_epi8((char)0x80));
}

/* q5: the raw codes (0-31, nothing subtracted: the kernel folds `zero` into the minimums
 * term as q4 does) of the chunk starting at block b as 64 bytes in q4's order
 * [b 0-15, b+1 0-15, b 16-31, b+1 16-31], the order of their activations. From 32 nibble
 * bytes and the blocks' high-bit planes (quant_codes.h): the nibble bytes broadcast to both
 * halves, the upper half shifted right by 4, masked; then one vpshufbitqmb picks each byte's
 * bit from its block's plane (the planes of blocks b, b + 1 permuted into the qwords of their
 * bytes) and a masked add adds 16. Fewer instructions than the weight order, whose mask wants
 * the planes of two blocks joined in general registers (as VNNI builds without AVX512_BITALG
 * still do, in this order: the same codes). */
static inline __attribute__((always_inline)) __m512i
chunk_codes_hb(const uint8_t *q, const uint8_t *qh, int64_t b, int half) {
    const __m256i raw = half ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(q + b * 16)))
                             : _mm256_loadu_si256((const __m256i *)(q + b * 16));
    const __m512i up = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);   /* the upper half's high nibbles */
    const __m512i c = _mm512_and_si512(_mm512_srlv_epi64(_mm512_broadcast_i64x4(raw), up), _mm512_set1_epi8(15));
#ifndef __AVX512BITALG__
    /* VNNI without BITALG (Cascade Lake): the plane's mask joined in general registers, byte i
     * taking bit i % 16 (+ 16 from byte 32 on) of block b's plane (bytes 0-15, 32-47) or b + 1's */
    uint32_t lo = 0, hi = 0;
    memcpy(&lo, qh + b * 4, 4);
    if (!half) memcpy(&hi, qh + (b + 1) * 4, 4);
    const __mmask64 m = (uint64_t)(lo & 0xffff) | (uint64_t)(hi & 0xffff) << 16 | (uint64_t)(lo >> 16) << 32
                        | (uint64_t)(hi >> 16) << 48;
#else
    /* dwords [b x 4, b+1 x 4, b x 4, b+1 x 4] of the blocks' planes; byte i is weight
     * (i % 16) + (i >= 32 ? 16 : 0) of its block: that bit of its qword */
    const __m128i v = half ? _mm_loadu_si32(qh + b * 4) : _mm_loadl_epi64((const __m128i *)(qh + b * 4));
    const __m512i planes = _mm512_permutexvar_epi32(_mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0),
                                                    _mm512_castsi128_si512(v));
    const __m512i bit0 = _mm512_set_epi64(0x1f1e1d1c1b1a1918, 0x1716151413121110, 0x1f1e1d1c1b1a1918,
                                          0x1716151413121110, 0x0f0e0d0c0b0a0908, 0x0706050403020100,
                                          0x0f0e0d0c0b0a0908, 0x0706050403020100);
    const __mmask64 m = _mm512_bitshuffle_epi64_mask(planes, bit0);
#endif
    return _mm512_mask_add_epi8(c, m, c, _mm512_set1_epi8(16));
}

/* q6: the raw codes (0-63; `zero` folded into the minimums term) of the chunk starting at block
 * b (even) in weight order, from Q6_K's own bytes (quant_codes.h): blocks 4h, 4h + 1 are the low
 * nibbles of stretch h's 64 nibble bytes, blocks 4h + 2, 4h + 3 their high nibbles (one 16-bit
 * shift); the high bits: the stretch's 32 bytes in both halves, each qword rotated to bring the
 * chunk's bit pair to bits 4-5 (pair 0 | 1 of each byte for the first chunk, 2 | 3 for the second),
 * masked, and joined to the nibbles by one vpternlog: three or four instructions, where
 * chunk_codes_hb's q5 takes five. */
static inline __attribute__((always_inline)) __m512i chunk_codes6(const uint8_t *q, const uint8_t *qh, int64_t b) {
    const int second = (int)(b >> 1) & 1;
    const __m512i v = _mm512_loadu_si512(q + b / 4 * 64);
    const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qh + b / 4 * 32)));
    const __m512i rot = second ? _mm512_set_epi64(62, 62, 62, 62, 0, 0, 0, 0) : _mm512_set_epi64(2, 2, 2, 2, 4, 4, 4, 4);
    const __m512i hb = _mm512_and_si512(_mm512_rolv_epi64(h, rot), _mm512_set1_epi8(0x30));
    /* (A & C) | B: A the nibbles, B the high bits, C 0x0f */
    return _mm512_ternarylogic_epi64(second ? _mm512_srli_epi16(v, 4) : v, hb, _mm512_set1_epi8(15), 0xec);
}

/* q4: dot products of the chunk starting at block b with 16-bit activations: the 32 code
 * bytes zero-extended to words, low nibbles then high nibbles, two vpdpwssd; lanes 0-7
 * belong to block b, 8-15 to b + 1. */
static inline __attribute__((always_inline)) __m512 chunk_dot4(const uint8_t *q, int64_t b, int half, const int16_t *xw) {
    const __m256i raw = half ? _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(q + b * 16)))
                             : _mm256_loadu_si256((const __m256i *)(q + b * 16));
    const __m512i w = _mm512_cvtepu8_epi16(raw);
    const __m512i lo = _mm512_and_si512(w, _mm512_set1_epi16(15)), hi = _mm512_srli_epi16(w, 4);
    return _mm512_cvtepi32_ps(_mm512_dpwssd_epi32(
        _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xw)), hi, _mm512_loadu_si512(xw + 32)));
}

/* 256 * dot(w, q1) + dot(w, q2) per lane: |.| < 2^31 for codes <= 255 (exact in float
 * below 2^24, as for q5/q6's raw codes <= 63) */
static inline __attribute__((always_inline)) __m512 chunk_dot(__m512i w, const int8_t *x1, const int8_t *x2) {
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(
        _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_loadu_si512(x1)), 8),
        w, _mm512_loadu_si512(x2)));
}

/* q4k, q5k: the scales and minimums of blocks [g, g + n) of a row (g a multiple of 16, n 8 or 16:
 * whole super-blocks), d * sub and -dmin * min exact in float32 as quant_q4k_scales makes them,
 * in registers (lanes >= n are 0): the super-blocks' 16 sub-scale bytes, reordered (sub | sub |
 * min | min), widened, times d (or -dmin) of each lane's super-block. Per 16 blocks about ten
 * more instructions than q4's two float16 loads: 2.85-2.98 cycles per 32 weights hot against
 * q4's 2.70, where a scratch of the rows' scales (the other paths') took 3.25, and these
 * products rounded through float16 in registers 4.4 (Zen 4's vcvtps2ph of a zmm is slow). */
static inline __attribute__((always_inline)) void
q4k_block_scales(const uint16_t *d, const uint16_t *dm, const uint8_t *h, int64_t g, int n, __m512 *s, __m512 *b) {
    const int64_t u = g / 8;
    __m128i sub, low, dd, mm;
    if (n == 16) {
        const __m256i v = _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)(h + u * QUANT_Q4K_HIGH)), 0xd8);
        sub = _mm256_castsi256_si128(v);
        low = _mm256_extracti128_si256(v, 1);
        dd = _mm_loadu_si32(d + u);
        mm = _mm_loadu_si32(dm + u);
    } else {   /* the row's last super-block alone: nothing read past it */
        const __m128i v = _mm_loadu_si128((const __m128i *)(h + u * QUANT_Q4K_HIGH));
        sub = _mm_move_epi64(v);
        low = _mm_srli_si128(v, 8);
        dd = _mm_cvtsi32_si128(d[u]);
        mm = _mm_cvtsi32_si128(dm[u]);
    }
    const __m512i two = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512 sd = _mm512_permutexvar_ps(two, _mm512_castps128_ps512(_mm_cvtph_ps(dd)));
    const __m512 sm = _mm512_permutexvar_ps(two, _mm512_castps128_ps512(_mm_cvtph_ps(mm)));
    *s = _mm512_mul_ps(sd, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sub)));
    *b = _mm512_mul_ps(sm, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)));
}

/* One weight row against m_rows quantized rows of x. Per chunk of 64 weights: the codes
 * as 64 unsigned bytes (q8: loaded, + 128; q5/q6: expanded in registers, raw), two vpdpbusd
 * into 16 int32 lanes (q4: two vpdpwssd), then one FMA with each lane's s_w * d_x, taken from
 * a 16-block vector of them by a permute. Minimums (and q8's -128 * s_w, q4/q5/q6's
 * -zero * s_w) meet the block sums d * sum(x') in one FMA per 16 blocks. Groups of 16 (Q6_K;
 * `per` 0): each lane of a chunk is in one group (four lanes a group), so the 32 groups of 16
 * blocks are two vectors of s_w * d_x, read with one two-source permute per chunk, and the
 * offset term meets the half-block sums.
 * Even and odd chunks go to separate accumulators (two FMA chains in flight); all lanes
 * are summed once at the end of the row. kind and m_rows are constants where this is inlined. */
static inline __attribute__((always_inline)) void
row_dot_i8(int kind, const uint8_t *q, const uint8_t *qh, int zero, const uint16_t *sc, const uint16_t *mn,
           int64_t per, const act_i8 *a, int m_rows, float *res) {
    const int64_t nb = a->nb, nch = a->nch, nbp = a->nbp;
    const int g16 = per == 0, q4 = kind == 4 || kind == QUANT_Q4K;   /* q4k: q4's codes, its own scales */
    const uint8_t *hq = quant_high_bits_at(kind, qh, nb * QB);         /* q5/q6's high bits (q5k, q6k: after their scales) */
    const __m512i step = _mm512_set1_epi32(g16 ? 4 : 2);
    /* lane -> scale in the chunk: lanes 0-7 block b, 8-15 block b + 1 (q8, q6, q4), groups of 16 lane / 4
     * (q8, q6); q5 (q4's byte order): lanes 0-3 b[0:16], 4-7 b+1[0:16], 8-11 b[16:32], 12-15 b+1[16:32] */
    const int hb = quant_codes_kind(kind) == 5;   /* q5, q5k */
    const __m512i first = g16 ? (hb ? _mm512_set_epi32(3, 3, 3, 3, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0, 0)
                                    : _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0))
                              : (hb ? _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)
                                    : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m512i dup_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i dup_hi = _mm512_add_epi32(dup_lo, _mm512_set1_epi32(8));
    /* what each code's scale meets in the minimum term: q8 codes enter as q + 128; q4/q5/q6 codes
     * carry their offset `zero` (Q4_0: 8, Q6_K: 32) */
    const __m512 off = _mm512_set1_ps(kind == 8 ? -128.0f : -(float)zero);
    __m512 acc[GEMV_ROWS], acc2[GEMV_ROWS];
    for (int m = 0; m < m_rows; m++) acc[m] = acc2[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < nb; g += 16) {
        const int n = nb - g < 16 ? (int)(nb - g) : 16;
        __m512 sd[GEMV_ROWS], sd1[GEMV_ROWS];   /* sd1: groups of 16 only, the run's second 16 groups */
        if (g16) {
            const int n0 = 2 * n < 16 ? 2 * n : 16, n1 = 2 * n - n0;
            __m512 s0, s1;
            if (kind == QUANT_Q6K) {   /* groups 0-15 of these 16 blocks are super-block g / 8, 16-31 the next */
                const int8_t *sub = quant_q6k_sub(qh, nb * QB) + 2 * g;   /* before the row's high bits */
                s0 = _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(sc[g / 8])),
                                   _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)sub))));
                s1 = n1 ? _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(sc[g / 8 + 1])), _mm512_cvtepi32_ps(
                              _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sub + 16)))))
                        : _mm512_setzero_ps();
            } else {
                s0 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n0) - 1), sc + 2 * g));
                s1 = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n1) - 1), sc + 2 * g + 16));
            }
            __m512 mw0 = mn ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n0) - 1), mn + 2 * g))
                            : _mm512_setzero_ps();
            __m512 mw1 = mn ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16)((1u << n1) - 1), mn + 2 * g + 16))
                            : _mm512_setzero_ps();
            mw0 = _mm512_fmadd_ps(s0, off, mw0);
            mw1 = _mm512_fmadd_ps(s1, off, mw1);
            for (int m = 0; m < m_rows; m++) {
                const __m512 d = _mm512_loadu_ps(a->xd + m * nbp + g);
                sd[m] = _mm512_mul_ps(s0, _mm512_permutexvar_ps(dup_lo, d));
                sd1[m] = _mm512_mul_ps(s1, _mm512_permutexvar_ps(dup_hi, d));
                const float *xc = a->xc16 + 2 * (m * nbp + g);
                acc2[m] = _mm512_fmadd_ps(mw0, _mm512_loadu_ps(xc), acc2[m]);
                acc2[m] = _mm512_fmadd_ps(mw1, _mm512_loadu_ps(xc + 16), acc2[m]);
            }
        } else {
            __m512 s, mw;
            if (quant_k4_scales(kind)) {   /* q4k, q5k: their sub-scales first in qh */
                q4k_block_scales(sc, mn, qh, g, n, &s, &mw);
            } else {
                s = block_scales(sc, g, n, per);
                mw = mn ? block_scales(mn, g, n, per) : _mm512_setzero_ps();
            }
            mw = _mm512_fmadd_ps(s, off, mw);
            for (int m = 0; m < m_rows; m++) {
                sd[m] = _mm512_mul_ps(s, _mm512_loadu_ps(a->xd + m * nbp + g));
                acc2[m] = _mm512_fmadd_ps(mw, _mm512_loadu_ps(a->xc + m * nbp + g), acc2[m]);
            }
        }
        __m512i idx = first;
        int64_t b = g;
        /* the dot products of chunk c (blocks c, c + 1; half: c is the row's odd last block)
         * with row m of x, as 16 float lanes; the codes of the chunk (q8, q5, q6) into w8 */
#define DOT(c, half, m) (q4 ? chunk_dot4(q, c, half, a->xw + ((m) * nch + (c) / 2) * CHUNK) \
                                   : chunk_dot(w8, a->x1 + ((m) * nch + (c) / 2) * CHUNK, a->x2 + ((m) * nch + (c) / 2) * CHUNK))
#define CODES(c, half) (kind == 8 ? chunk_codes8(q, c, half) : quant_codes_kind(kind) == 6 ? chunk_codes6(q, hq, c) \
                                                                : chunk_codes_hb(q, hq, c, half))
#define SCALE(m, i) (g16 ? _mm512_permutex2var_ps(sd[m], i, sd1[m]) : _mm512_permutexvar_ps(i, sd[m]))
        __m512i w8 = _mm512_setzero_si512();
        for (; b + 4 <= g + n; b += 4) {   /* two full chunks */
            const __m512i idx2 = _mm512_add_epi32(idx, step);
            if (!q4) w8 = CODES(b, 0);
            for (int m = 0; m < m_rows; m++)
                acc[m] = _mm512_fmadd_ps(DOT(b, 0, m), SCALE(m, idx), acc[m]);
            if (!q4) w8 = CODES(b + 2, 0);
            for (int m = 0; m < m_rows; m++)
                acc2[m] = _mm512_fmadd_ps(DOT(b + 2, 0, m), SCALE(m, idx2), acc2[m]);
            idx = _mm512_add_epi32(idx2, step);
        }
        if (b < g + n) {   /* one more chunk, full or the row's odd last block */
            if (!q4) w8 = CODES(b, b + 1 == nb);
            for (int m = 0; m < m_rows; m++)
                acc[m] = _mm512_fmadd_ps(DOT(b, b + 1 == nb, m), SCALE(m, idx), acc[m]);
            if (b + 2 < g + n) {   /* and one after it (three chunks left: only in a short last group) */
                idx = _mm512_add_epi32(idx, step);
                if (!q4) w8 = CODES(b + 2, b + 3 == nb);
                for (int m = 0; m < m_rows; m++)
                    acc2[m] = _mm512_fmadd_ps(DOT(b + 2, b + 3 == nb, m), SCALE(m, idx), acc2[m]);
            }
        }
#undef SCALE
#undef CODES
#undef DOT
    }
    for (int m = 0; m < m_rows; m++) res[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acc2[m]));
}

/* Output rows [n0, n1) for m_rows rows of x; the codes of the row PF_ROWS ahead, or PF_BYTES of
 * codes ahead where rows are short (SmolLM2's 576-wide q4 rows are 288 bytes: 8 rows ahead kept
 * too few lines in flight; a token's gemvs 1.025-1.044x with 8-16 KB ahead, 1.01x with 4 KB), are
 * prefetched (into L2: QUANT_PREFETCH_HINT) while row n is computed, but q6's and q5's: their gemvs are bound
 * by issuing vector operations (~3.5 and ~5 cycles per 32 weights hot), the hardware prefetchers
 * keep up with that, and the prefetch instructions took issue slots (a Q6_K token's gemvs from
 * memory at one thread 29.6 ms without them, 31.2 with; as bit-planes 36.7 against 39.8; a Q5_K_M
 * token's ~4 % faster without them, hot 1.07-1.09x; Zen 4, benchmarks/README.md). */
static inline __attribute__((always_inline)) void
rows_i8(int kind, int m_rows, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t per,
        int64_t K, int64_t group, const act_i8 *a, int64_t n0, int64_t n1, int64_t N, void *out, int out_bf16,
        const uint8_t *qh, int zero) {
    const int64_t row_bytes = quant_row_bytes(kind, K), high_bytes = quant_high_row_bytes(kind, K);
    const int64_t groups = quant_scales_per_row(kind, K, group);
    const int64_t ahead = PF_ROWS > PF_BYTES / row_bytes ? PF_ROWS : PF_BYTES / row_bytes;
    for (int64_t n = n0; n < n1; n++) {
        if (quant_codes_kind(kind) != 6 && quant_codes_kind(kind) != 5 && n + ahead < N) {
            const uint8_t *p = qs + (n + ahead) * row_bytes;
            for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch((const char *)(p + o), QUANT_PREFETCH_HINT);
            for (int64_t o = 0; o < high_bytes; o += 64)
                _mm_prefetch((const char *)(qh + (n + ahead) * high_bytes + o), QUANT_PREFETCH_HINT);
            _mm_prefetch((const char *)(sc + (n + ahead) * groups), QUANT_PREFETCH_HINT);
            if (mn) _mm_prefetch((const char *)(mn + (n + ahead) * groups), QUANT_PREFETCH_HINT);
        }
        float res[GEMV_ROWS];
        row_dot_i8(kind, qs + n * row_bytes, qh ? qh + n * high_bytes : NULL, zero, sc + n * groups,
                   mn ? mn + n * groups : NULL, per, a, m_rows, res);
        for (int m = 0; m < m_rows; m++) store(out, out_bf16, m * N + n, res[m]);
    }
}

/* kind and m_rows as constants: the row loop unrolls, the accumulators stay in registers,
 * the layout's branches fold away, and nothing is set up again per output row. */
static void rows_range_i8(int kind, int m_rows, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                          int64_t per, int64_t K, int64_t group, const act_i8 *a, int64_t n0, int64_t n1,
                          int64_t N, void *out, int out_bf16, const uint8_t *qh, int zero) {
#define CASE(k, r) case r: rows_i8(k, r, qs, sc, mn, per, K, group, a, n0, n1, N, out, out_bf16, qh, zero); break;
#define ALL(k) switch (m_rows) { CASE(k, 1) CASE(k, 2) CASE(k, 3) CASE(k, 4) CASE(k, 5) CASE(k, 6) CASE(k, 7) \
                                 default: rows_i8(k, GEMV_ROWS, qs, sc, mn, per, K, group, a, n0, n1, N, out, \
                                                  out_bf16, qh, zero); break; }
    switch (kind) {
    QUANT_GROUP_KIND_CASES(ALL)
    default: ALL(8) break;
    }
#undef ALL
#undef CASE
}
#endif

/* Specialised per m_rows so the compiler unrolls the row loop and keeps the
 * accumulators in registers. */
static void rows_dot(int kind, const uint8_t *q, const uint16_t *sc, const uint16_t *mn, int zero, int64_t K,
                     int64_t group, const float *x, int m_rows, float *res, int f32) {
    switch (m_rows) {
    case 1: row_dot(kind, q, sc, mn, zero, K, group, x, 1, res, f32); break;
    case 2: row_dot(kind, q, sc, mn, zero, K, group, x, 2, res, f32); break;
    case 3: row_dot(kind, q, sc, mn, zero, K, group, x, 3, res, f32); break;
    default: row_dot(kind, q, sc, mn, zero, K, group, x, 4, res, f32); break;
    }
}

#include "quant_k2.h"

/* 1 when pipeserve_quant_gemv honours act_i8 for this layout (else it runs the float path). */
int pipeserve_quant_i8_applies(int64_t K, int64_t group, int64_t M) {
#if defined(HAVE_VNNI)
    return K % QB == 0 && (group % QB == 0 || group == 16) && M <= GEMV_ROWS;
#elif defined(HAVE_AVX2_I16)
    (void)M;
    return i16_applies(K, group);
#else
    (void)K; (void)group; (void)M;
    return 0;
#endif
}

#if defined(HAVE_VNNI) && defined(HAVE_AVX2_INT)
/* i4, q2 and q3 on VNNI builds: quant_gemv_avx2.h's int8 activations and kernels (k2_rows_many,
 * rows_many_i16), whose code expansions are AVX2's; the VNNI row_dot_i8 expands q5/q6 only. */
#define AVX2_LATER(kind) ((kind) == QUANT_I4 || quant_is_k2(kind))
#else
#define AVX2_LATER(kind) 0
#endif

#ifdef HAVE_VNNI
/* The activation buffer of M rows of K (int8 pairs or int16 chunks, then per block d and
 * the sums); bind_i8 points an act_i8 at one (malloc-aligned) of act_i8_bytes. */
static int64_t act_i8_bytes(int64_t M, int64_t K) {
    const int64_t nb = K / QB, nch = (nb + 1) / 2, nbp = (nb + 15) & ~(int64_t)15;
    return 2 * M * nch * CHUNK + 4 * (int64_t)sizeof(float) * M * nbp;
}

static void bind_i8(act_i8 *a, void *buf, int64_t M, int64_t K) {
    a->nb = K / QB;
    a->nch = (a->nb + 1) / 2;
    a->nbp = (a->nb + 15) & ~(int64_t)15;
    a->x1 = (int8_t *)buf;
    a->x2 = a->x1 + M * a->nch * CHUNK;   /* q8: two int8 terms; q4: one int16 term (the same bytes) */
    a->xw = (int16_t *)buf;
    a->xd = (float *)(a->x1 + 2 * M * a->nch * CHUNK);
    a->xc = a->xd + M * a->nbp;
    a->xc16 = a->xc + M * a->nbp;
}
#endif

/* 1 when this build's integer activations for layout `kind` are one int8 per activation (step
 * max|x| / 127 of its block of 32): AVX2 builds' q4/q5/q6/i4/q2/q3, and VNNI builds' i4/q2/q3,
 * which take AVX2's kernels (AVX2_LATER); 0 for the finer int16 or two-int8 codes, or none. */
int pipeserve_quant_act_int8(int kind) {
#if defined(HAVE_VNNI)
    return AVX2_LATER(kind);
#elif defined(HAVE_AVX2_I16)
    return act_int8(kind);
#else
    (void)kind;
    return 0;
#endif
}

/* Decode in two phases, for callers that run their own threads (decode_stage.c) and for
 * pipeserve_quant_gemv's integer path: pipeserve_quant_prepare quantizes M rows of x once
 * into a buffer of pipeserve_quant_act_bytes, then any thread computes output rows
 * [n0, n1) from it with pipeserve_quant_rows (float32 out [M, N]). act_bytes is 0 where
 * this build has no integer activations for the layout (the float path then runs). */
int64_t pipeserve_quant_act_bytes(int kind, int64_t K, int64_t group, int64_t M) {
    if (!quant_takes_kind(kind) || (quant_is_k2(kind) && !k2_shape_ok(K, group))) return 0;
    if (!quant_shape_ok(kind, K, group)) return 0;
    kind = quant_codes_kind(kind);   /* q4k's activations are q4's, q5k's q5's, q6k's q6's */
#if defined(HAVE_VNNI)
#ifdef HAVE_AVX2_INT
    if (AVX2_LATER(kind)) return pipeserve_quant_i8_applies(K, group, M) ? i16_act_bytes(M, K) : 0;
#endif
    return pipeserve_quant_i8_applies(K, group, M) && (kind != 4 || group % QB == 0) ? act_i8_bytes(M, K) : 0;
#elif defined(HAVE_AVX2_I16)
    return i16_applies(K, group) && (kind != 4 || group % I16_QB == 0) ? i16_act_bytes(M, K) : 0;
#else
    (void)kind; (void)K; (void)group; (void)M;
    return 0;
#endif
}

void pipeserve_quant_prepare(int kind, int64_t K, const float *x, int64_t M, void *act) {
    kind = quant_codes_kind(kind);
#if defined(HAVE_VNNI)
#ifdef HAVE_AVX2_INT
    if (AVX2_LATER(kind)) {
        act_i16 v;
        i16_act_bind(&v, act, M, K);
        quantize_rows_i16(kind, x, M, &v);
        return;
    }
#endif
    act_i8 a;
    bind_i8(&a, act, M, K);
    if (kind == 4) quantize_rows16(x, M, K, &a);
    else quantize_rows(kind, x, M, K, &a);
#elif defined(HAVE_AVX2_I16)
    act_i16 a;
    i16_act_bind(&a, act, M, K);
    quantize_rows_i16(kind, x, M, &a);
#else
    (void)kind; (void)K; (void)x; (void)M; (void)act;
#endif
}

void pipeserve_quant_rows(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N, int64_t K,
                          int64_t group, const uint8_t *qh, int zero, const void *act, int64_t M, int64_t n0,
                          int64_t n1, float *out) {
#if defined(HAVE_VNNI)
#ifdef HAVE_AVX2_INT
    if (AVX2_LATER(kind)) {
        act_i16 v;
        i16_act_bind(&v, (void *)act, M, K);
        if (quant_is_k2(kind)) k2_rows_many(kind, M, qs, qh, sc, mn, zero, &v, n0, n1, N, out);
        else rows_many_i16(kind, M, qs, sc, mn, group / I16_QB, group, &v, n0, n1, N, out, qh, zero);
        return;
    }
#endif
    act_i8 a;
    bind_i8(&a, (void *)act, M, K);
    rows_range_i8(kind, (int)M, qs, sc, mn, group / QB, K, group, &a, n0, n1, N, out, 0, qh, zero);
#elif defined(HAVE_AVX2_I16)
    act_i16 a;
    i16_act_bind(&a, (void *)act, M, K);
    if (quant_is_k2(kind)) {   /* their sub-scales in integers (quant_k2.h) */
        k2_rows_many(kind, M, qs, qh, sc, mn, zero, &a, n0, n1, N, out);
        return;
    }
    rows_many_i16(kind, M, qs, sc, mn, group / I16_QB, group, &a, n0, n1, N, out, qh, zero);
#else
    (void)kind; (void)qs; (void)sc; (void)mn; (void)N; (void)K; (void)group; (void)qh; (void)zero; (void)act;
    (void)M; (void)n0; (void)n1; (void)out;
#endif
}

/* out [M, N] = xf [M, K] . W^T through the two phases, threads over contiguous, equal
 * ranges of output rows (as schedule(static)). Returns 0, or -1 when scratch cannot be had. */
static int gemv_int(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N, int64_t K,
                    int64_t group, const float *xf, int64_t M, void *out, int out_bf16, int num_threads,
                    const uint8_t *qh, int zero) {
    const int64_t act = pipeserve_quant_act_bytes(kind, K, group, M);
    char *buf = malloc(act + (out_bf16 ? sizeof(float) * M * N : 0));
    if (!buf) return -1;
    float *res = out_bf16 ? (float *)(buf + act) : (float *)out;
    pipeserve_quant_prepare(kind, K, xf, M, buf);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        pipeserve_quant_rows(kind, qs, sc, mn, N, K, group, qh, zero, buf, M, N * t / T, N * (t + 1) / T, res);
    }
    if (out_bf16)
        for (int64_t i = 0; i < M * N; i++) ((uint16_t *)out)[i] = f32_to_bf16(res[i]);
    free(buf);
    return 0;
}

/* Two-level row n's float32 scales expanded into buf (quant_two_level_row: q4k's / q5k's per 32
 * then their minimums, 2 * K / 32; q6k's per 16, K / 16); returns buf (as the float16 pointer the
 * float paths take, with their f32 flag). */
static const uint16_t *two_level_row(int kind, const uint16_t *sc, const uint16_t *mn, const uint8_t *qh, int64_t K,
                                     int64_t n, float *buf) {
    quant_two_level_row(kind, sc, mn, qh, K, n, buf, buf + K / 32);
    return (const uint16_t *)buf;
}

/* kind: 4, 8, 5, 6, 9, 2, 3, 10, 11 or 12 (q4, q8, q5, q6, i4, q2, q3, q4k, q6k, q5k); mn may be NULL; qh and zero: q5/q6/q3's high bits and
 * code offset (ignored otherwise; last, so callers built against the two-layout
 * signature still bind); act_i8: quantize x to int8 blocks where
 * pipeserve_quant_i8_applies. Returns 0, -1 when scratch cannot be allocated, -2 for a
 * layout this build does not take (pipeserve_quant_takes), -3 for q2/q3 arguments not in
 * whole super-blocks with a scale each (quant_k2.h) or two-level arguments not in whole super-blocks of 256
 * in their groups (quant_shape_ok). */
int pipeserve_quant_gemv(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                         int64_t N, int64_t K, int64_t group, const void *x, int x_bf16, int64_t M,
                         void *out, int out_bf16, int act_i8, int num_threads, const uint8_t *qh, int zero) {
    if (!quant_takes_kind(kind)) return -2;
    if (quant_is_k2(kind) && !k2_shape_ok(K, group)) return -3;
    if (!quant_shape_ok(kind, K, group)) return -3;
    float *xf = malloc(sizeof(float) * M * K);
    if (!xf) return -1;
    for (int64_t i = 0; i < M * K; i++)
        xf[i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
    if (act_i8 && pipeserve_quant_act_bytes(kind, K, group, M) > 0) {
        const int rc = gemv_int(kind, qs, sc, mn, N, K, group, xf, M, out, out_bf16, num_threads, qh, zero);
        free(xf);
        return rc;
    }
    if (quant_is_k2(kind)) {
        const int rc = k2_gemv_float(kind, qs, qh, sc, mn, zero, N, K, xf, M, out, out_bf16, num_threads);
        free(xf);
        return rc;
    }
    const int ck = quant_codes_kind(kind) == 4 ? 4 : 8, compact = quant_is_compact(kind);   /* ck: the codes the dots read */
    const int z4 = ck == 4 ? zero : 0;   /* compact codes leave their expansion with zero subtracted */
    const int64_t groups = K / group;
    const int f32 = quant_two_level(kind);   /* scales: the two-level layouts' float32 scratch (SC, MN) */
    int failed = 0;
    /* row n's codes (q5/q6/i4: expanded into buf) */
#define ROW(n, buf) (ck == 4 ? qs + (n) * (K / 2) : quant_q8_row(kind, qs, qh, zero, K, (n), (buf)))
    /* row n's scales and minimums (two-level: expanded into `scales`, slot i of two) */
#define SC(n, i) (f32 ? two_level_row(kind, sc, mn, qh, K, (n), scales + (i) * 2 * groups) : sc + (n) * groups)
#define MN(n, i) (quant_k4_scales(kind) ? (const uint16_t *)(scales + (i) * 2 * groups + groups) \
                                    : mn ? mn + (n) * groups : NULL)
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        int8_t *scratch = compact ? aligned_alloc(64, (size_t)(2 * K + 63) / 64 * 64) : NULL;
        float *scales = f32 ? malloc(sizeof(float) * 4 * groups) : NULL;
        if ((compact && !scratch) || (f32 && !scales)) {
#pragma omp atomic write
            failed = 1;
        }
        const int ok = (!compact || scratch) && (!f32 || scales);
#ifdef HAVE_TWO_ROWS
        if (M == 1) {
#pragma omp for schedule(static)
            for (int64_t pair = 0; pair < (N + 1) / 2; pair++) {
                const int64_t n = 2 * pair;
                if (!ok) continue;
                if (n + 1 == N) {   /* an odd last row */
                    float res[1];
                    rows_dot(ck, ROW(n, scratch), SC(n, 0), MN(n, 0), z4, K, group, xf, 1, res, f32);
                    store(out, out_bf16, n, res[0]);
                    continue;
                }
                float res[2];
                const uint8_t *qa = ROW(n, scratch), *qb = ROW(n + 1, scratch + K);
                const uint16_t *sa = SC(n, 0), *sb = SC(n + 1, 1);
                two_rows_dot1(ck, qa, qb, sa, sb, MN(n, 0), MN(n + 1, 1), z4, K, group, xf, res, f32);
                store(out, out_bf16, n, res[0]);
                store(out, out_bf16, n + 1, res[1]);
            }
        } else
#endif
        {
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++) {
                if (!ok) continue;
                const uint8_t *q = ROW(n, scratch);
                const uint16_t *s = SC(n, 0), *b = MN(n, 0);
                for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
                    float res[MAX_M];
                    const int m_rows = M - m0 < MAX_M ? (int)(M - m0) : MAX_M;
                    rows_dot(ck, q, s, b, z4, K, group, xf + m0 * K, m_rows, res, f32);
                    for (int m = 0; m < m_rows; m++) store(out, out_bf16, (m0 + m) * N + n, res[m]);
                }
            }
        }
        free(scratch);
        free(scales);
    }
    free(xf);
    return failed ? -1 : 0;
}

/* Returns 0, -1 when scratch cannot be allocated (compact layouts), -2 for a layout this build does
 * not take, -3 as pipeserve_quant_gemv. */
int pipeserve_quant_dequant(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                            int64_t K, int64_t group, int64_t r0, int64_t r1, void *out, int out_bf16,
                            int num_threads, const uint8_t *qh, int zero) {
    if (!quant_takes_kind(kind)) return -2;
    if (quant_is_k2(kind))
        return k2_shape_ok(K, group) ? k2_dequant(kind, qs, qh, sc, mn, zero, K, r0, r1, out, out_bf16, num_threads)
                                     : -3;
    if (!quant_shape_ok(kind, K, group)) return -3;
    const int ck = quant_codes_kind(kind) == 4 ? 4 : 8, compact = quant_is_compact(kind), z4 = ck == 4 ? zero : 0;
    const int64_t groups = K / group;
    const int f32 = quant_two_level(kind);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        int8_t *scratch = compact ? aligned_alloc(64, (size_t)(K + 63) / 64 * 64) : NULL;
        float *scales = f32 ? malloc(sizeof(float) * 2 * groups) : NULL;
        if ((compact && !scratch) || (f32 && !scales)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = r0; n < r1; n++) {
            if ((compact && !scratch) || (f32 && !scales)) continue;
            const uint8_t *q = ROW(n, scratch);
            const uint16_t *s = SC(n, 0), *b = MN(n, 0);
            const int64_t o = (n - r0) * K;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
            if (ck == 4) {   /* the prefill tile path's common case, vectorised */
                for (int64_t g = 0; g < groups; g++) {
                    const float sg = quant_scale_at(s, g, f32);
                    const __m512 sv = _mm512_set1_ps(sg);
                    const __m512 bv = _mm512_set1_ps((b ? quant_scale_at(b, g, f32) : 0.0f) - (float)z4 * sg);
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
#elif defined(HAVE_AVX2_I16)
            dequant_row_avx2(ck, q, s, b, z4, K, group, out, out_bf16, o, f32);
            continue;
#endif
            for (int64_t g = 0; g < groups; g++) {
                const float scale = quant_scale_at(s, g, f32);
                const float bias = (b ? quant_scale_at(b, g, f32) : 0.0f) - (float)z4 * scale;
                const int step = ck == 4 ? 32 : 16;   /* a q8 group may be 16 (Q6_K) */
                for (int64_t k = g * group; k < (g + 1) * group; k += step) {
                    float w[32];
                    if (ck == 4) {
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
        free(scratch);
        free(scales);
    }
    return failed ? -1 : 0;
}
#undef MN
#undef SC
#undef ROW

/* Rows rows[0..n) of the weight, dequantized one after another into out [n, K] (an embedding's
 * lookup: a decode step's one or few token ids, without PyTorch's gather and float ops around
 * them). Each as pipeserve_quant_dequant computes it; -4 when an index is outside [0, N). */
int pipeserve_quant_dequant_at(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                               int64_t N, int64_t K, int64_t group, const int64_t *rows, int64_t n, void *out,
                               int out_bf16, const uint8_t *qh, int zero) {
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= N) return -4;
    char *o = out;
    const int64_t row_out = K * (out_bf16 ? 2 : 4);
    for (int64_t i = 0; i < n; i++) {
        const int rc = pipeserve_quant_dequant(kind, qs, sc, mn, K, group, rows[i], rows[i] + 1, o + i * row_out,
                                               out_bf16, 1, qh, zero);
        if (rc) return rc;
    }
    return 0;
}
