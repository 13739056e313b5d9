/* Decode gemv with integer activations for AVX2 + FMA + F16C CPUs (no AVX-512), included
 * by quant_matmul.c where its AVX-512 paths do not compile.
 *
 * Each row of x is quantized once per call per block of 32, x ~ d * q. q8 takes int16,
 * d = max|x| / 32767, so every activation moves by at most d / 2 = max|x| / 65534 of its block:
 * finer than the VNNI path's int8 pairs (max|x| / 32512) and than bfloat16; its codes are
 * widened to int16 and meet x in vpmaddwd. q8 in groups
 * of 16 takes a block at a time in "even/odd" order (block_codes_eo): one vector holds the
 * codes of weights 2w | 16 + 2w, the other of 2w + 1 | 17 + 2w (w < 8, the two 128-bit
 * lanes), the order in which q8's int16 words hold them, so no lane-crossing widen; they meet
 * a copy of x in that order in two vpmaddwd, whose sum has 4 weights per int32 lane (|.| <
 * 2^24: exact in float32), the low lane from group 2b and the high lane from group 2b + 1,
 * scaled in one conversion and one FMA. q8 in groups of 32 takes a block at a time in weight
 * order (block_codes_i16), two vpmaddwd, one conversion and one FMA.
 * q4 (Q4_0/Q4_1/Q4_K, int4) takes int8, d = max|x| / 127, as llama.cpp's Q8 activations: its
 * blocks come in pairs (q4_run_pairs: one 32-byte load split into two vectors of codes, two
 * vpmaddubsw against x stored in the pair's order, one vpmaddwd, one FMA for both blocks).
 * Against int16 activations (four vpmaddwd on codes spread to words) it measured 1.09-1.33x
 * a block in L2 on SmolLM2's rows (benchmarks/gemv_avx2_bench.py --compare) and 0.87-0.94x
 * the time per decoded token at two threads (one request on the built-in Q4_1 file).
 * q5/q6 (Q5_0/Q5_1/Q5_K/Q6_K) take int8 too, so an activation moves by at most
 * max|x| / 254 of its block (llama.cpp's Q8_0/Q8_K step; a quarter of Q6_K's own half step,
 * max|w| / 62 of a group): their raw codes (0..31 / 0..63, block_codes_u8, in weight order,
 * `zero` left to the minimum term) meet x in one vpmaddubsw (|pair| <= 2 * 63 * 127 < 32767:
 * no saturation) and one vpmaddwd with ones, 4 weights per int32 lane (low lane weights 0-15,
 * one group of 16 or half a group of 32), one conversion and one FMA: 16 instructions a Q6_K
 * block against 19 widening to int16 (benchmarks/gemv_avx2_bench.py --kinds) while q6 held
 * bit-planes, half of them their spread into bytes; about 11 since q6 keeps Q6_K's own bytes (packed.py).
 * i4 (IQ4_NL/IQ4_XS) takes int8 too: its codebook values (one vpshufb, quant_i4_codes32_avx2)
 * are signed (-127..113), so they enter vpmaddubsw as |w| against x with w's signs (vpsignb,
 * llama.cpp's mul_sum_i8_pairs; |pair| <= 2 * 127 * 127 < 32767). Measured against int16
 * activations and codes widened by vpmovsxbw (as q8): 4.1 vs 5.8 cycles per 32 weights in L2,
 * 0.67 vs 1.00 ms a 2048x5632 gemv from memory (one thread, AVX2 EPYC).
 * q2/q3 (Q2_K/Q3_K) take int8 too, in quant_k2.h: their integer sub-scales stay integers there.
 * Minimums (and q4/q5/q6's `zero` * s_w) meet the per-block sums d * sum(q) once per 8 blocks.
 *
 * Threads take contiguous, equal ranges of output rows and prefetch the codes a few rows
 * ahead, as the VNNI path does.
 *
 * Many rows (a prompt on q4/q5/q6/q8, a fused decode step of up to 128): rows_many_i16 runs tiles of
 * weight rows against every pass of rows of x; q4 in groups of 32 from Q4T_MIN_ROWS rows takes
 * q4_rows_many, q5/q6 (groups of 32 or 16) and i4 from U8T_MIN_ROWS u8_rows_many (a tile's codes
 * expanded once into scratch), q8 in groups of 32 from Q8T_MIN_ROWS q8_rows_many (tiles sized
 * with their rows of int16 x to stay in L1), 4 rows of x per weight row with the gemv's float
 * operations per row (so each row's result is the bits of that row alone, at any row count and
 * thread split).
 * Each row's result is independent of the others on every path here: a row's accumulators are its own.
 */
#ifndef PIPESERVE_QUANT_GEMV_AVX2_H
#define PIPESERVE_QUANT_GEMV_AVX2_H

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_codes.h"
#include "vec_math.h"

#define I16_ROWS 8   /* rows of x per pass over the weights */
#define I16_QB 32    /* activation block */
#define I16_RUN 8    /* blocks whose scales are read as one vector */
#ifndef I16_PF_ROWS
#define I16_PF_ROWS 8
#endif

/* The activations of one call: q8's q [M, K] int16 in x's order, and in one place after it
 * the same values in the even/odd order of block_codes_eo (qe, eo_perm_i16); the other kinds
 * instead x8 [M, K] int8 where q starts, in x's order (q4: in the order its pairs of blocks
 * meet them, q4_x8_offset); per block (padded with zeros to a multiple of I16_RUN) d, d * sum(q),
 * and per half block d * sum(q) (groups of 16). */
typedef struct {
    int16_t *q, *qe;
    int8_t *x8;   /* every kind but q8: int8 instead of q and qe (act_int8) */
    float *d, *sum, *sum16;
    int64_t K, nb, nbp;
} act_i16;

/* Every kind but q8 meets int8 activations (d = max|x| / 127) in vpmaddubsw: raw codes (q5/q6:
 * 0..63, unsigned) times int8 pairs stay below 2 * 63 * 127 < 32767, so no saturation. i4's
 * signed codebook values (-127..113) enter as |w| against x with w's sign (u8_block). */
static inline int act_int8(int kind) {
    return kind == 4 || kind == QUANT_Q4K || kind == 5 || kind == QUANT_Q5K || kind == 6 || kind == QUANT_Q6K
           || kind == QUANT_I4
           || kind == QUANT_Q2 || kind == QUANT_Q3;
}

/* q4's codes and activations (q4, and q4k: q4 with Q4_K's two-level scales). */
#define IS_Q4(kind) ((kind) == 4 || (kind) == QUANT_Q4K)

/* q4k, q5k: run (super-block) u's 8 scales d * sub and minimums -dmin * min, exact in float32, from
 * its d, -dmin and 16 sub-scale bytes (quant_codes.h): one widening, conversion and product each,
 * where q4's float16 run is one load and conversion. */
static inline __attribute__((always_inline)) void
q4k_run_scales(const uint16_t *d, const uint16_t *dm, const uint8_t *h, int64_t u, __m256 *s, __m256 *b) {
    const uint8_t *p = h + u * QUANT_Q4K_HIGH;
    *s = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(d[u])),
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))));
    *b = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(dm[u])),
                       _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p + 8)))));
}

/* Run r's (8 blocks of 32) scales and minimums (mn may be NULL: zeros) as 8 floats each: q4k's and
 * q5k's from their two levels (q4k_run_scales), the others' float16 ones as they are. */
static inline __attribute__((always_inline)) void
run_scales(int kind, const uint16_t *sc, const uint16_t *mn, const uint8_t *qh, int64_t r, __m256 *s, __m256 *b) {
    if (quant_k4_scales(kind)) {
        q4k_run_scales(sc, mn, qh, r, s, b);
        return;
    }
    *s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + r * I16_RUN)));
    *b = mn ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + r * I16_RUN))) : _mm256_setzero_ps();
}

static inline float hsum8(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

static inline int32_t hsum8i(__m256i v) {
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, _MM_SHUFFLE(2, 3, 0, 1))));
}

/* 8 floats to 8 int16 (rounded to nearest; |v| <= 32767 by construction) and their sum. */
static inline __m128i round_to_i16(__m256 v, int32_t *sum) {
    const __m256i i = _mm256_cvtps_epi32(v);
    *sum += hsum8i(i);
    return _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
}

/* q4's codes of blocks 2p and 2p + 1 come in one 32-byte load, block 2p in the low lane: byte j
 * of a lane holds weight j in its low nibble and j + 16 in its high one, so one vpand and one
 * vpsrlw + vpand give two vectors of 32 codes, weights 0-15 and 16-31 of both blocks. q4's
 * int8 activations are stored in the order those two vectors take them: per pair of blocks,
 * 64 bytes, x(2p) 0-15, x(2p + 1) 0-15, x(2p) 16-31, x(2p + 1) 16-31. A lone last block (an
 * odd number of blocks) keeps x's order. */
static inline int64_t q4_x8_offset(int64_t nb, int64_t b, int half) {
    if (b == nb - 1 && nb % 2) return b * I16_QB + half * 16;
    return (b & ~(int64_t)1) * I16_QB + half * 32 + (b & 1) * 16;
}

/* Block b of row m of int8 x, in weight order (q4's pair order undone). */
static inline __attribute__((always_inline)) __m256i x8_block(int kind, const act_i16 *a, int m, int64_t b) {
    const int8_t *x = a->x8 + m * a->K;
    if (!IS_Q4(kind)) return _mm256_loadu_si256((const __m256i *)(x + b * I16_QB));
    return _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(x + q4_x8_offset(a->nb, b, 1))),
                            _mm_loadu_si128((const __m128i *)(x + q4_x8_offset(a->nb, b, 0))));
}

/* A block of x (int16, in order) as block_codes_eo's two vectors take it: weights 2w then
 * 16 + 2w, then 2w + 1 then 17 + 2w (w < 8). */
static inline void eo_perm_i16(const int16_t *x, int16_t *out) {
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 2; l++)
            for (int w = 0; w < 8; w++) out[h * 16 + l * 8 + w] = x[l * 16 + 2 * w + h];
}

/* x in order, and in the order the layout `kind` reads it: q4's pairs, or q8's even/odd blocks;
 * q5/q6/i4 int8 in order (an act_i16 serves pipeserve_quant_rows for the kind it was prepared for). */
static void quantize_rows_i16(int kind, const float *x, int64_t M, const act_i16 *a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t m = 0; m < M; m++) {
        for (int64_t b = a->nb; b < a->nbp; b++) {
            a->d[m * a->nbp + b] = a->sum[m * a->nbp + b] = 0.0f;
            a->sum16[2 * (m * a->nbp + b)] = a->sum16[2 * (m * a->nbp + b) + 1] = 0.0f;
        }
        for (int64_t b = 0; b < a->nb; b++) {
            const float *xb = x + m * a->K + b * I16_QB;
            __m256 v[4];
            __m256 mx = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
            const float top = act_int8(kind) ? 127.0f : 32767.0f;
            const __m256 id = _mm256_set1_ps(amax > 0.0f ? top / amax : 0.0f);
            int16_t *q = a->q + m * a->K + b * I16_QB;
            int32_t s0 = 0, s1 = 0;
            const __m128i q0 = round_to_i16(_mm256_mul_ps(v[0], id), &s0), q1 = round_to_i16(_mm256_mul_ps(v[1], id), &s0);
            const __m128i q2 = round_to_i16(_mm256_mul_ps(v[2], id), &s1), q3 = round_to_i16(_mm256_mul_ps(v[3], id), &s1);
            const float d = amax / top;
            a->d[m * a->nbp + b] = d;
            a->sum[m * a->nbp + b] = d * (float)(s0 + s1);
            a->sum16[2 * (m * a->nbp + b)] = d * (float)s0;
            a->sum16[2 * (m * a->nbp + b) + 1] = d * (float)s1;
            if (act_int8(kind)) {
                int8_t *q8 = a->x8 + m * a->K;
                const int64_t lo = kind == 4 ? q4_x8_offset(a->nb, b, 0) : b * I16_QB;
                const int64_t hi = kind == 4 ? q4_x8_offset(a->nb, b, 1) : b * I16_QB + 16;
                _mm_storeu_si128((__m128i *)(q8 + lo), _mm_packs_epi16(q0, q1));
                _mm_storeu_si128((__m128i *)(q8 + hi), _mm_packs_epi16(q2, q3));
                continue;
            }
            _mm_storeu_si128((__m128i *)q, q0);
            _mm_storeu_si128((__m128i *)(q + 8), q1);
            _mm_storeu_si128((__m128i *)(q + 16), q2);
            _mm_storeu_si128((__m128i *)(q + 24), q3);
            eo_perm_i16(q, a->qe + m * a->K + b * I16_QB);   /* q8 */
        }
    }
}

/* The 32 codes of q8 block b as two vectors of 16 int16 (weights 0-15, 16-31). */
static inline __attribute__((always_inline)) void block_codes_i16(const uint8_t *q, int64_t b, __m256i *c0, __m256i *c1) {
    *c0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + b * 32)));
    *c1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + b * 32 + 16)));
}

/* The 32 raw codes (nothing subtracted: `zero` is folded into the minimum term) of q5/q6
 * block b as bytes in weight order, weights 0-15 (group 2b of 16) in the low lane:
 * quant_q5_codes32_avx2 (a byte shuffle and a compare spread the plane's bits) and
 * quant_q6_codes32_avx2 (Q6_K's own bytes: two loads, each shifted by a count and masked, the
 * high bits shifted into place, one or). */
static inline __attribute__((always_inline)) __m256i
block_codes_u8(int kind, const uint8_t *q, const uint8_t *qh, int64_t b) {
    if (kind == QUANT_I4) return quant_i4_codes32_avx2(q, b);   /* signed: u8_block takes |w| */
    if (IS_Q4(kind)) {   /* q4: a lone block (its pairs take q4_pair_i8) */
        const __m128i v = _mm_loadu_si128((const __m128i *)(q + b * 16)), lo = _mm_set1_epi8(15);
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), lo), _mm_and_si128(v, lo));
    }
    if (quant_codes_kind(kind) == 5) return quant_q5_codes32_avx2(q, qh, 0, b);   /* q5, q5k */
    return quant_q6_codes32_avx2(q, qh, b);
}

/* The 32 codes of q8 block b in even/odd order: *e holds weights 2w | 16 + 2w, *o weights
 * 2w + 1 | 17 + 2w (int16, w < 8, one per 128-bit lane): the int16 words of the block's 32
 * bytes, sign-extended low and high bytes. */
static inline __attribute__((always_inline)) void block_codes_eo(const uint8_t *q, int64_t b, __m256i *e, __m256i *o) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(q + b * 32));
    *e = _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8);
    *o = _mm256_srai_epi16(v, 8);
}

/* q4 blocks b and b + 1 (codes q2, b even) against m_rows rows of int8 x: the codes split once
 * into weights 0-15 and 16-31 of both blocks (block b in the low lane), then per row two
 * vpmaddubsw against x in the pair's order (q4_x8_offset; |pair| <= 2 * 15 * 127, their sum
 * < 32767), one vpmaddwd with ones (block b's sums in lanes 0-3), one conversion and one FMA
 * with sdp = (s_w * d of block b) x 4 | (of b + 1) x 4. */
static inline __attribute__((always_inline)) void
q4_pair_i8(const uint8_t *q2, const act_i16 *a, int64_t b, int m_rows, const __m256 *sdp, __m256 *acc) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)q2), lo = _mm256_set1_epi8(15);
    const __m256i c0 = _mm256_and_si256(v, lo), c1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
    for (int m = 0; m < m_rows; m++) {
        const int8_t *xp = a->x8 + m * a->K + b * I16_QB;
        const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(c0, _mm256_loadu_si256((const __m256i *)xp)),
                                           _mm256_maddubs_epi16(c1, _mm256_loadu_si256((const __m256i *)(xp + 32))));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(t, _mm256_set1_epi16(1))), sdp[m], acc[m]);
    }
}

/* A run of I16_RUN q4 blocks (codes q) as four pairs, against activations in pair order; sd:
 * s_w * d of the run's blocks per row of x, reordered 0 2 4 6 | 1 3 5 7 so that an in-lane
 * vpermilps makes each pair's scales. Per pair, against the one block at a time of the other
 * layouts: no vpmovzxbw (the codes spread in-lane), one conversion and one FMA instead of two,
 * and the scales come from registers, not from broadcasts of a just-stored array (measured
 * 1.25x in the hot loop, 1.1-1.3x on SmolLM2's rows of 576). */
static inline __attribute__((always_inline)) void
q4_run_pairs(const uint8_t *q, const act_i16 *a, int64_t b0, int m_rows, int pairs, const __m256 *sd, __m256 *acc,
             __m256 *acc2) {
    const __m256i even_odd = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m256 s[I16_ROWS], t[I16_ROWS];
    for (int m = 0; m < m_rows; m++) s[m] = _mm256_permutevar8x32_ps(sd[m], even_odd);
    for (int m = 0; m < m_rows; m++) t[m] = _mm256_permute_ps(s[m], 0x00);
    q4_pair_i8(q, a, b0, m_rows, t, acc);
    if (pairs < 2) return;
    for (int m = 0; m < m_rows; m++) t[m] = _mm256_permute_ps(s[m], 0x55);
    q4_pair_i8(q + 32, a, b0 + 2, m_rows, t, acc2);
    if (pairs < 3) return;
    for (int m = 0; m < m_rows; m++) t[m] = _mm256_permute_ps(s[m], 0xaa);
    q4_pair_i8(q + 64, a, b0 + 4, m_rows, t, acc);
    if (pairs < 4) return;
    for (int m = 0; m < m_rows; m++) t[m] = _mm256_permute_ps(s[m], 0xff);
    q4_pair_i8(q + 96, a, b0 + 6, m_rows, t, acc2);
}

/* One block's codes (block_codes_eo) against m_rows rows of x: per row two vpmaddwd, one
 * conversion and one FMA with that row's scales s (lanes 0-3: weights 0-15, 4-7: 16-31). */
static inline __attribute__((always_inline)) void
eo_block_i16(__m256i e, __m256i o, const act_i16 *a, int64_t b, int m_rows, const __m256 *s, __m256 *acc) {
    for (int m = 0; m < m_rows; m++) {
        const int16_t *x = a->qe + m * a->K + b * I16_QB;
        const __m256i t = _mm256_add_epi32(_mm256_madd_epi16(e, _mm256_loadu_si256((const __m256i *)x)),
                                           _mm256_madd_epi16(o, _mm256_loadu_si256((const __m256i *)(x + 16))));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), s[m], acc[m]);
    }
}

/* One block's raw q5/q6 codes (block_codes_u8) against m_rows rows of int8 x: per row one
 * vpmaddubsw, one vpmaddwd with ones (4 weights per int32 lane, the low lane from weights
 * 0-15), one conversion and one FMA with that row's scales s. i4's signed codes enter as |w|,
 * and each row of x with w's signs (vpsignb; llama.cpp's mul_sum_i8_pairs): |pair| <= 2 * 127
 * * 127 < 32767. */
static inline __attribute__((always_inline)) void
u8_block(int kind, __m256i c, const act_i16 *a, int64_t b, int m_rows, const __m256 *s, __m256 *acc) {
    const __m256i u = kind == QUANT_I4 ? _mm256_sign_epi8(c, c) : c;
    for (int m = 0; m < m_rows; m++) {
        __m256i x = x8_block(kind, a, m, b);
        if (kind == QUANT_I4) x = _mm256_sign_epi8(x, c);
        const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), s[m], acc[m]);
    }
}

/* Element i of each 128-bit lane of v in all four of that lane (an immediate vpermilps, i a
 * constant once inlined: vpermilps by a vector index cost a broadcast from a general register). */
/* Groups of 16 (two a block), the run of blocks b0 .. b0 + I16_RUN - 1: its 16 scales as
 * s0e / s1e (groups g0 g2 g4 g6 | g1 g3 g5 g7 of blocks 0-3 / 4-7) and their minimum terms m0 / m1
 * (scale * zw + minimum, in the groups' order). The one-row gemv and the many-row kernel both
 * take them from here, so a row of the one is the other's bit for bit. */
static inline __attribute__((always_inline)) void
g16_run_scales(const uint16_t *sc, const uint16_t *mn, const int8_t *sub, int64_t b0, float zw, __m256 *s0e,
               __m256 *s1e, __m256 *m0, __m256 *m1) {
    const __m256i eo = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    __m256 s0, s1;
    if (sub) {   /* q6k: the run is super-block b0 / 8, its d times its 16 sub-scales, exact */
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(sc[b0 / I16_RUN]));
        s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sub + 2 * b0)))));
        s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)(sub + 2 * b0 + 8)))));
    } else {
        s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 2 * b0)));
        s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 2 * b0 + 8)));
    }
    *s0e = _mm256_permutevar8x32_ps(s0, eo);
    *s1e = _mm256_permutevar8x32_ps(s1, eo);
    *m0 = _mm256_fmadd_ps(s0, _mm256_set1_ps(zw), mn ? _mm256_cvtph_ps(
        _mm_loadu_si128((const __m128i *)(mn + 2 * b0))) : _mm256_setzero_ps());
    *m1 = _mm256_fmadd_ps(s1, _mm256_set1_ps(zw), mn ? _mm256_cvtph_ps(
        _mm_loadu_si128((const __m128i *)(mn + 2 * b0 + 8))) : _mm256_setzero_ps());
}

static inline __attribute__((always_inline)) __m256 lane_splat(__m256 v, int i) {
    switch (i) {
    case 0: return _mm256_permute_ps(v, 0x00);
    case 1: return _mm256_permute_ps(v, 0x55);
    case 2: return _mm256_permute_ps(v, 0xaa);
    default: return _mm256_permute_ps(v, 0xff);
    }
}

/* a + b * c with the product rounded before the sum, whatever the compiler contracts. */
static inline float add_mul_ss(float a, float b, float c) {
    return _mm_cvtss_f32(_mm_add_ss(_mm_set_ss(a), _mm_mul_ss(_mm_set_ss(b), _mm_set_ss(c))));
}

/* One weight row against m_rows quantized rows of x. `per`: blocks of 32 per group (0: groups of 16);
 * `left`: scales from this row's to the matrix's end. Runs of 8 blocks (one group each, or two
 * of 16) read their scales and minimums as vectors, the minimum term in one FMA per run, and
 * s_w * d per block and row: q4's pairs (q4_run_pairs) in registers; groups of 32 into a stack
 * array (one broadcast per block and row); groups of 16 in two registers reordered so that one
 * in-lane vpermilps gives a block's two groups (g2j x 4 | g2j+1 x 4). The blocks of a shorter
 * last run (q4: but its pairs, where 8 scales can be read), or of larger groups, take their
 * scales one at a time. Per block (q4: pair) and weight row the codes once, then per row of x:
 * q4's pairs q4_pair_i8; q5/q6 (and a lone q4 block) u8_block (raw codes against int8 x); q8 in groups of 16
 * eo_block_i16 (the codes in even/odd order), in groups of 32 two vpmaddwd of the codes in
 * weight order (block_codes_i16: widened straight from memory), one conversion and one FMA.
 * Groups of 16 add their minimum term to acc2 (one register fewer: with a third
 * accumulator, one row of x kept it on the stack across the run). Even and odd blocks (q4: pairs) go to separate accumulators (two FMA
 * chains; two or four weight rows at once, for more chains and x loaded once, measured no
 * faster). kind and m_rows are constants here. row_dot_i16_from takes the accumulators from
 * block b0 on (q4_row_tile hands it the blocks after its full runs); row_dot_i16 from zero. */
static inline __attribute__((always_inline)) void
row_dot_i16_from(int kind, const uint8_t *q, const uint8_t *qh, int zero, const uint16_t *sc,
            const uint16_t *mn, int64_t per, int64_t left, const act_i16 *a, int m_rows, int64_t b0,
            __m256 *acc, __m256 *acc2, __m256 *accm, float *res) {
    const int64_t nb = a->nb, nbp = a->nbp, K = a->K;
    const uint8_t *hq = quant_high_bits_at(kind, qh, K);   /* q5/q6's high bits (q5k, q6k: after their scales) */
    const int g16 = !IS_Q4(kind) && per == 0;   /* q4 comes in groups of 32k (pipeserve_quant_act_bytes) */
    const float zw = kind != 8 ? -(float)zero : 0.0f;   /* q4/q5/q6 codes keep their offset */
    float mins[I16_ROWS];
    for (int m = 0; m < m_rows; m++) mins[m] = 0.0f;
    for (; per <= 1 && b0 + I16_RUN <= nb; b0 += I16_RUN) {
        if (g16) {   /* groups 2 * b0 ... 2 * b0 + 15, two per block */
            __m256 s0e, s1e, m0, m1;
            g16_run_scales(sc, mn, kind == QUANT_Q6K ? quant_q6k_sub(qh, K) : NULL, b0, zw, &s0e, &s1e, &m0, &m1);
            const __m256i lo = _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3), hi = _mm256_setr_epi32(4, 5, 6, 7, 4, 5, 6, 7);
            __m256 sd0[I16_ROWS], sd1[I16_ROWS];   /* blocks 0-3, 4-7: g0 g2 g4 g6 | g1 g3 g5 g7 */
            for (int m = 0; m < m_rows; m++) {
                const __m256 d = _mm256_loadu_ps(a->d + m * nbp + b0);
                sd0[m] = _mm256_mul_ps(s0e, _mm256_permutevar8x32_ps(d, lo));
                sd1[m] = _mm256_mul_ps(s1e, _mm256_permutevar8x32_ps(d, hi));
                const float *xs = a->sum16 + 2 * (m * nbp + b0);
                acc2[m] = _mm256_fmadd_ps(m0, _mm256_loadu_ps(xs), acc2[m]);   /* one register fewer than accm */
                acc2[m] = _mm256_fmadd_ps(m1, _mm256_loadu_ps(xs + 8), acc2[m]);
            }
#pragma GCC unroll 8   /* j a constant: lane_splat's immediates, acc or acc2 */
            for (int j = 0; j < I16_RUN; j++) {
                __m256 s[I16_ROWS];
                for (int m = 0; m < m_rows; m++)
                    s[m] = lane_splat(j < 4 ? sd0[m] : sd1[m], j & 3);
                if (act_int8(kind)) {
                    u8_block(kind, block_codes_u8(kind, q, hq, b0 + j), a, b0 + j, m_rows, s, j & 1 ? acc2 : acc);
                    continue;
                }
                __m256i e, o;
                block_codes_eo(q, b0 + j, &e, &o);
                eo_block_i16(e, o, a, b0 + j, m_rows, s, j & 1 ? acc2 : acc);
            }
            continue;
        }
        float sd[I16_ROWS][I16_RUN] __attribute__((aligned(32)));
        __m256 sdv[I16_ROWS];   /* q4: s_w * d in registers, for q4_run_pairs */
        __m256 s, mw;   /* q4k, q5k: a run is a super-block: sc, mn its d, -dmin; qh its sub-scales */
        run_scales(kind, sc, mn, qh, b0 / I16_RUN, &s, &mw);
        mw = _mm256_fmadd_ps(s, _mm256_set1_ps(zw), mw);
        for (int m = 0; m < m_rows; m++) {
            sdv[m] = _mm256_mul_ps(s, _mm256_loadu_ps(a->d + m * nbp + b0));
            if (!IS_Q4(kind)) _mm256_store_ps(sd[m], sdv[m]);
            accm[m] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(a->sum + m * nbp + b0), accm[m]);
        }
        if (IS_Q4(kind)) {
            q4_run_pairs(q + b0 * 16, a, b0, m_rows, I16_RUN / 2, sdv, acc, acc2);
            continue;
        }
#pragma GCC unroll 8   /* j a constant: acc or acc2 */
        for (int j = 0; j < I16_RUN; j++) {
            if (act_int8(kind)) {
                __m256 s[I16_ROWS];
                for (int m = 0; m < m_rows; m++) s[m] = _mm256_broadcast_ss(&sd[m][j]);
                u8_block(kind, block_codes_u8(kind, q, hq, b0 + j), a, b0 + j, m_rows, s, j & 1 ? acc2 : acc);
                continue;
            }
            __m256i c0, c1;
            block_codes_i16(q, b0 + j, &c0, &c1);
            for (int m = 0; m < m_rows; m++) {
                const int16_t *x = a->q + m * K + (b0 + j) * I16_QB;
                const __m256i t = _mm256_add_epi32(_mm256_madd_epi16(c0, _mm256_loadu_si256((const __m256i *)x)),
                                                   _mm256_madd_epi16(c1, _mm256_loadu_si256((const __m256i *)(x + 16))));
                const __m256 f = _mm256_cvtepi32_ps(t), sdj = _mm256_broadcast_ss(&sd[m][j]);
                if (j & 1) acc2[m] = _mm256_fmadd_ps(f, sdj, acc2[m]);
                else acc[m] = _mm256_fmadd_ps(f, sdj, acc[m]);
            }
        }
    }
    if (kind == 4 && per == 1 && b0 + 2 <= nb && b0 + I16_RUN <= left) {   /* q4: a shorter last run's pairs
                                                                          * (two-level rows are whole runs) */
        const int n = (int)(nb - b0) & ~1;   /* the vector loads read on into the next row: masked */
        const __m128i keep = _mm_cmpgt_epi16(_mm_set1_epi16((short)n), _mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 s = _mm256_cvtph_ps(_mm_and_si128(_mm_loadu_si128((const __m128i *)(sc + b0)), keep));
        const __m256 mw = _mm256_fmadd_ps(s, _mm256_set1_ps(zw), mn ? _mm256_cvtph_ps(_mm_and_si128(
            _mm_loadu_si128((const __m128i *)(mn + b0)), keep)) : _mm256_setzero_ps());
        __m256 sdv[I16_ROWS];
        for (int m = 0; m < m_rows; m++) {   /* d and the sums are padded with zeros to nbp */
            sdv[m] = _mm256_mul_ps(s, _mm256_loadu_ps(a->d + m * nbp + b0));
            accm[m] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(a->sum + m * nbp + b0), accm[m]);
        }
        q4_run_pairs(q + b0 * 16, a, b0, m_rows, n / 2, sdv, acc, acc2);
        b0 += n;
    }
    for (int64_t b = b0; b < nb; b++) {   /* scales one block (or group of 16) at a time */
        const int64_t g = g16 ? 2 * b : b / per;
        const float s0 = _cvtsh_ss(sc[g]), s1 = g16 ? _cvtsh_ss(sc[g + 1]) : s0;
        /* the scalar minimum terms spelt out (fmaf, add_mul_ss) as GCC 12 compiled the one-row
         * gemv (q4's product fused into the sum, the others' not): left to contraction, the
         * several-row passes fused them otherwise in some rows, so q5's rows were not their decode */
        const float w0 = fmaf(zw, s0, mn ? _cvtsh_ss(mn[g]) : 0.0f);
        const float w1 = g16 ? fmaf(zw, s1, mn ? _cvtsh_ss(mn[g + 1]) : 0.0f) : 0.0f;
        if (g16 || act_int8(kind)) {
            __m256 s[I16_ROWS];
            for (int m = 0; m < m_rows; m++) {
                const float d = a->d[m * nbp + b];
                s[m] = _mm256_set_m128(_mm_set1_ps(s1 * d), _mm_set1_ps(s0 * d));
                mins[m] = g16 ? mins[m] + fmaf(w0, a->sum16[2 * (m * nbp + b)], w1 * a->sum16[2 * (m * nbp + b) + 1])
                        : kind == 4 ? fmaf(w0, a->sum[m * nbp + b], mins[m]) : add_mul_ss(mins[m], w0, a->sum[m * nbp + b]);
            }
            if (act_int8(kind)) {
                u8_block(kind, block_codes_u8(kind, q, hq, b), a, b, m_rows, s, acc);
                continue;
            }
            __m256i e, o;
            block_codes_eo(q, b, &e, &o);
            eo_block_i16(e, o, a, b, m_rows, s, acc);
            continue;
        }
        __m256i c0, c1;
        block_codes_i16(q, b, &c0, &c1);
        for (int m = 0; m < m_rows; m++) {
            const int16_t *x = a->q + m * K + b * I16_QB;
            const float d = a->d[m * nbp + b];
            const __m256i p0 = _mm256_madd_epi16(c0, _mm256_loadu_si256((const __m256i *)x));
            const __m256i p1 = _mm256_madd_epi16(c1, _mm256_loadu_si256((const __m256i *)(x + 16)));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)), _mm256_set1_ps(s0 * d), acc[m]);
            mins[m] += w0 * a->sum[m * nbp + b];
        }
    }
    for (int m = 0; m < m_rows; m++)
        res[m] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[m], acc2[m]), accm[m])) + mins[m];
}

/* row_dot_i16_from the start: every accumulator at zero. */
static inline __attribute__((always_inline)) void
row_dot_i16(int kind, const uint8_t *q, const uint8_t *qh, int zero, const uint16_t *sc,
            const uint16_t *mn, int64_t per, int64_t left, const act_i16 *a, int m_rows, float *res) {
    __m256 acc[I16_ROWS], acc2[I16_ROWS], accm[I16_ROWS];
    for (int m = 0; m < m_rows; m++) acc[m] = acc2[m] = accm[m] = _mm256_setzero_ps();
    row_dot_i16_from(kind, q, qh, zero, sc, mn, per, left, a, m_rows, 0, acc, acc2, accm, res);
}

/* Weight row f's codes, high bits (qh: high bytes a row, may be 0), scales and minimums
 * (mn may be NULL; per_row of each a row) into L2 (QUANT_PREFETCH_HINT says why not L1). */
static inline __attribute__((always_inline)) void
prefetch_row(const uint8_t *qs, int64_t row_bytes, const uint8_t *qh, int64_t high, const uint16_t *sc,
             const uint16_t *mn, int64_t per_row, int64_t f) {
    for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch((const char *)(qs + f * row_bytes + o), QUANT_PREFETCH_HINT);
    for (int64_t o = 0; o < high; o += 64) _mm_prefetch((const char *)(qh + f * high + o), QUANT_PREFETCH_HINT);
    _mm_prefetch((const char *)(sc + f * per_row), QUANT_PREFETCH_HINT);
    if (mn) _mm_prefetch((const char *)(mn + f * per_row), QUANT_PREFETCH_HINT);
}

/* Output rows [n0, n1); the codes (and scales) of row n + I16_PF_ROWS are prefetched
 * while row n is computed, but q5's and q6's (q5k, q6k too): their expansions make the gemv issue-bound, the
 * hardware prefetchers keep up, and the prefetches took issue slots (one Q5_K_M / Q6_K token's
 * gemvs from memory 1.09-1.22x / 1.05-1.20x faster without them, -march=haswell on Zen 4;
 * i4/q2/q3 measured level within this host's noise, so they keep them: benchmarks/README.md). */
static inline __attribute__((always_inline)) void
rows_i16(int kind, int m_rows, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t per,
         int64_t group, const act_i16 *a, int64_t n0, int64_t n1, int64_t N, float *out, const uint8_t *qh,
         int zero) {
    const int64_t K = a->K, row_bytes = quant_row_bytes(kind, K), high_bytes = quant_high_row_bytes(kind, K);
    const int64_t groups = quant_scales_per_row(kind, K, group);
    for (int64_t n = n0; n < n1; n++) {
        const int64_t f = n + I16_PF_ROWS;
        if (f < n1 && quant_codes_kind(kind) != 5 && quant_codes_kind(kind) != 6) prefetch_row(qs, row_bytes, qh, high_bytes, sc, mn, groups, f);
        float res[I16_ROWS];
        row_dot_i16(kind, qs + n * row_bytes, qh ? qh + n * high_bytes : NULL, zero, sc + n * groups,
                    mn ? mn + n * groups : NULL, per, (N - n) * groups, a, m_rows, res);
        for (int m = 0; m < m_rows; m++) out[m * N + n] = res[m];
    }
}

/* kind and m_rows as constants: the row loop unrolls and the accumulators stay in registers. */
static void rows_range_i16(int kind, int m_rows, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                           int64_t per, int64_t group, const act_i16 *a, int64_t n0, int64_t n1, int64_t N,
                           float *out, const uint8_t *qh, int zero) {
#define CASE(k, r) case r: rows_i16(k, r, qs, sc, mn, per, group, a, n0, n1, N, out, qh, zero); break;
#define ALL(k) switch (m_rows) { CASE(k, 1) CASE(k, 2) CASE(k, 3) CASE(k, 4) CASE(k, 5) CASE(k, 6) CASE(k, 7) \
                                 default: rows_i16(k, I16_ROWS, qs, sc, mn, per, group, a, n0, n1, N, out, qh, \
                                                   zero); break; }
    switch (kind) {
    QUANT_GROUP_KIND_CASES(ALL)
    case QUANT_I4: ALL(QUANT_I4) break;
    default: ALL(8) break;
    }
#undef ALL
#undef CASE
}

/* Rows of x [m0, m0 + I16_ROWS) of a prepared buffer of several passes' rows, as a buffer of their own. */
static inline act_i16 act_i16_rows(const act_i16 *a, int64_t m0) {
    act_i16 v = *a;
    v.q = a->q + m0 * a->K;
    v.qe = a->qe + m0 * a->K;
    v.x8 = a->x8 + m0 * a->K;
    v.d = a->d + m0 * a->nbp;
    v.sum = a->sum + m0 * a->nbp;
    v.sum16 = a->sum16 + 2 * m0 * a->nbp;
    return v;
}

#ifndef Q4T_ROWS
#define Q4T_ROWS 4       /* rows of x per q4 many-row micro-kernel */
#endif
#ifndef Q4T_MIN_ROWS
#define Q4T_MIN_ROWS 16  /* from this many rows of x, q4 takes it */
#endif
#ifndef Q4T_TILE
#define Q4T_TILE 16384   /* bytes of codes per tile of weight rows */
#endif

/* The activation scales of Q4T_ROWS rows of x as q4_rows_tile reads them: per row and pair p
 * of the full runs' blocks, d(2p) x 4 | d(2p + 1) x 4. */
static inline void q4_pair_scales(const act_i16 *a, int64_t pairs, __m256 *dd) {
    for (int m = 0; m < Q4T_ROWS; m++)
        for (int64_t p = 0; p < pairs; p++) {
            const float *d = a->d + m * a->nbp + 2 * p;
            dd[m * pairs + p] = _mm256_set_m128(_mm_set1_ps(d[1]), _mm_set1_ps(d[0]));
        }
}

/* One q4 weight row (groups of 32) against Q4T_ROWS rows of x, the many-row shape of row_dot_i16
 * with its arithmetic: the same float operations on the same values in the same order per row of
 * x, so the same bits. Its pairs' scales s_w * d as one product per pair and row, of s_w's pair
 * (s_w(2p) x 4 | s_w(2p + 1) x 4, from the run's 8 scales in one vpermps and one vpermilps per
 * pair) and dd (q4_pair_scales); its minimum terms in a loop of their own. Per pair the codes
 * are split once for the Q4T_ROWS rows, and the only registers kept are acc and acc2 (8 for 4
 * rows): row_dot_i16 at 8 rows held acc, acc2, accm and both rows' scales (24 + 16) and spilled.
 * The blocks after the full runs take row_dot_i16_from. */
static inline __attribute__((always_inline)) void
q4_row_tile(int kind, const uint8_t *q, const uint8_t *qh, const uint16_t *sc, const uint16_t *mn, int zero,
            int64_t left, const act_i16 *a, const __m256 *dd, int64_t pairs, float *res) {
    const int64_t runs = a->nb / I16_RUN, nbp = a->nbp, K = a->K;
    const __m256i eo = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7), lo = _mm256_set1_epi8(15);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[I16_ROWS], acc2[I16_ROWS], accm[I16_ROWS];
    for (int m = 0; m < Q4T_ROWS; m++) acc[m] = acc2[m] = accm[m] = _mm256_setzero_ps();
    for (int64_t r = 0; r < runs; r++) {
        __m256 s = _mm256_setzero_ps(), unused;
        if (kind == QUANT_Q4K) q4k_run_scales(sc, mn, qh, r, &s, &unused);   /* q4k: made per run */
        else s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + r * I16_RUN)));
        const __m256 se = _mm256_permutevar8x32_ps(s, eo);
#pragma GCC unroll 4   /* j a constant: lane_splat's immediates, acc or acc2 */
        for (int j = 0; j < I16_RUN / 2; j++) {
            const int64_t b = r * I16_RUN + 2 * j;
            const __m256 ss = lane_splat(se, j);
            const __m256i v = _mm256_loadu_si256((const __m256i *)(q + b * 16));
            const __m256i c0 = _mm256_and_si256(v, lo), c1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
            for (int m = 0; m < Q4T_ROWS; m++) {
                const int8_t *xp = a->x8 + m * K + b * I16_QB;
                const __m256i t = _mm256_add_epi16(
                    _mm256_maddubs_epi16(c0, _mm256_loadu_si256((const __m256i *)xp)),
                    _mm256_maddubs_epi16(c1, _mm256_loadu_si256((const __m256i *)(xp + 32))));
                const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(t, ones));
                const __m256 sd = _mm256_mul_ps(ss, dd[m * pairs + r * (I16_RUN / 2) + j]);
                if (j & 1) acc2[m] = _mm256_fmadd_ps(f, sd, acc2[m]);
                else acc[m] = _mm256_fmadd_ps(f, sd, acc[m]);
            }
        }
    }
    const float zw = -(float)zero;
    for (int64_t r = 0; r < runs; r++) {
        __m256 s, mw0;
        run_scales(kind, sc, mn, qh, r, &s, &mw0);
        const __m256 mw = _mm256_fmadd_ps(s, _mm256_set1_ps(zw), mw0);
        for (int m = 0; m < Q4T_ROWS; m++)
            accm[m] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(a->sum + m * nbp + r * I16_RUN), accm[m]);
    }
    row_dot_i16_from(kind, q, qh, zero, sc, mn, 1, left, a, Q4T_ROWS, runs * I16_RUN, acc, acc2, accm, res);
}

/* q4 output rows [n0, n1) for M rows of x (groups of 32, at least one run of blocks): tiles of
 * weight rows against every Q4T_ROWS rows of x in turn (q4_row_tile), the last M % Q4T_ROWS
 * rows as rows_range_i16. Returns -1 when its scratch (the activation scales of Q4T_ROWS rows)
 * cannot be had, then nothing is written. */
static int q4_rows_many(int kind, int64_t M, const uint8_t *qs, const uint8_t *qh, const uint16_t *sc,
                        const uint16_t *mn, const act_i16 *a, int64_t n0, int64_t n1, int64_t N, float *out, int zero) {
    const int64_t K = a->K, pairs = a->nb / I16_RUN * (I16_RUN / 2), row_bytes = K / 2;
    const int64_t groups = quant_scales_per_row(kind, K, I16_QB), high = quant_high_row_bytes(kind, K);
    __m256 *dd = aligned_alloc(32, (size_t)(Q4T_ROWS * pairs * sizeof(__m256)));
    if (!dd) return -1;
    const int64_t tile = row_bytes >= Q4T_TILE / 4 ? 4 : Q4T_TILE / row_bytes, full = M / Q4T_ROWS * Q4T_ROWS;
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
        const int64_t t1 = t0 + tile < n1 ? t0 + tile : n1;
        for (int64_t m0 = 0; m0 < full; m0 += Q4T_ROWS) {
            const act_i16 v = act_i16_rows(a, m0);
            q4_pair_scales(&v, pairs, dd);
            for (int64_t n = t0; n < t1; n++) {
                float res[Q4T_ROWS];
                if (kind == QUANT_Q4K)
                    q4_row_tile(QUANT_Q4K, qs + n * row_bytes, qh + n * high, sc + n * groups, mn + n * groups,
                                zero, (N - n) * groups, &v, dd, pairs, res);
                else
                    q4_row_tile(4, qs + n * row_bytes, NULL, sc + n * groups, mn ? mn + n * groups : NULL, zero,
                                (N - n) * groups, &v, dd, pairs, res);
                for (int m = 0; m < Q4T_ROWS; m++) out[(m0 + m) * N + n] = res[m];
            }
        }
        if (full < M) {
            const act_i16 v = act_i16_rows(a, full);
            rows_range_i16(kind, (int)(M - full), qs, sc, mn, 1, I16_QB, &v, t0, t1, N, out + full * N, qh, zero);
        }
    }
    free(dd);
    return 0;
}

#ifndef U8T_ROWS
#define U8T_ROWS 4       /* rows of x per q5/q6 many-row micro-kernel */
#endif
#ifndef U8T_MIN_ROWS
#define U8T_MIN_ROWS 16  /* from this many rows of x, q5/q6 take it */
#endif
#ifndef U8T_CODES
#define U8T_CODES 16384  /* bytes of a tile's expanded codes (one byte a weight) */
#endif

/* Whether u8_rows_many takes this layout: q5/q6 (Q5_0/Q5_1/Q5_K in groups of 32, Q6_K in groups
 * of 16; per: blocks per group, 0 for 16) and i4 (IQ4_NL/IQ4_XS, groups of 32) with at least one
 * run of blocks. */
static inline int u8_many_applies(int kind, int64_t per, const act_i16 *a) {
    return ((kind == 5 || kind == QUANT_Q5K || kind == 6 || kind == QUANT_Q6K) && per <= 1
            || kind == QUANT_I4 && per == 1) && a->nb >= I16_RUN;
}

/* One q5/q6/i4 weight row (groups of 32, or of 16 with g16) against U8T_ROWS rows of int8 x, the
 * many-row shape of row_dot_i16 with its arithmetic: the same float operations on the same values
 * in the same order per row of x, so the same bits. Per block the raw codes once
 * (block_codes_u8) for the U8T_ROWS rows, then per row u8_block's vpmaddubsw (i4: |w| made once
 * a block, x with w's signs per row), vpmaddwd, conversion and FMA, with s_w * d as one product per block and row: s_w's (groups of 16: the
 * block's two groups, lanes 0-3 | 4-7) from the run's scales in one in-lane vpermilps, times a
 * broadcast of the row's d; the gemv's product of the run's vectors holds the same values in its
 * lanes. Only acc and acc2 stay in registers (8 for 4 rows; row_dot_i16 at 8 rows held 24
 * accumulators and its rows' scales, and spilled). Groups of 32 add their minimum terms in a loop
 * of their own (accm: a chain apart); groups of 16 into acc2 at each run's start, as the gemv.
 * The blocks after the full runs take row_dot_i16_from (`left` 0: q4's alone reads it). */
static inline __attribute__((always_inline)) void
u8_row_tile(int kind, int g16, const uint8_t *codes, const uint8_t *q, const uint8_t *qh, const uint16_t *sc,
            const uint16_t *mn, int zero, const act_i16 *a, float *res) {
    const int64_t runs = a->nb / I16_RUN, nbp = a->nbp, K = a->K;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i lo = _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3), hi = _mm256_setr_epi32(4, 5, 6, 7, 4, 5, 6, 7);
    const float zw = -(float)zero;
    __m256 acc[I16_ROWS], acc2[I16_ROWS], accm[I16_ROWS];
    for (int m = 0; m < U8T_ROWS; m++) acc[m] = acc2[m] = accm[m] = _mm256_setzero_ps();
    float sd[U8T_ROWS][2][I16_RUN] __attribute__((aligned(32)));   /* the run's s_w * d per row of x */
    for (int64_t r = 0; r < runs; r++) {
        const int64_t b0 = r * I16_RUN;
        if (g16) {   /* groups 2 * b0 ... 2 * b0 + 15 as g0 g2 g4 g6 | g1 g3 g5 g7 times d, the gemv's sd0 / sd1 */
            __m256 s0, s1, m0, m1;
            g16_run_scales(sc, mn, kind == QUANT_Q6K ? quant_q6k_sub(qh, K) : NULL, b0, zw, &s0, &s1, &m0, &m1);
            for (int m = 0; m < U8T_ROWS; m++) {
                const __m256 d = _mm256_loadu_ps(a->d + m * nbp + b0);
                _mm256_store_ps(sd[m][0], _mm256_mul_ps(s0, _mm256_permutevar8x32_ps(d, lo)));
                _mm256_store_ps(sd[m][1], _mm256_mul_ps(s1, _mm256_permutevar8x32_ps(d, hi)));
                const float *xs = a->sum16 + 2 * (m * nbp + b0);
                acc2[m] = _mm256_fmadd_ps(m0, _mm256_loadu_ps(xs), acc2[m]);
                acc2[m] = _mm256_fmadd_ps(m1, _mm256_loadu_ps(xs + 8), acc2[m]);
            }
        } else {     /* the gemv's sdv */
            __m256 s, unused;
            if (kind == QUANT_Q5K) q4k_run_scales(sc, mn, qh, r, &s, &unused);
            else s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + b0)));
            for (int m = 0; m < U8T_ROWS; m++)
                _mm256_store_ps(sd[m][0], _mm256_mul_ps(s, _mm256_loadu_ps(a->d + m * nbp + b0)));
        }
#pragma GCC unroll 8   /* j a constant: lane_splat's immediates, acc or acc2 */
        for (int j = 0; j < I16_RUN; j++) {
            const int64_t b = b0 + j;
            const __m256i c = _mm256_load_si256((const __m256i *)(codes + b * I16_QB));
            const __m256i u = kind == QUANT_I4 ? _mm256_sign_epi8(c, c) : c;   /* u8_block's |w| */
            for (int m = 0; m < U8T_ROWS; m++) {
                __m256i x = _mm256_loadu_si256((const __m256i *)(a->x8 + m * K + b * I16_QB));
                if (kind == QUANT_I4) x = _mm256_sign_epi8(x, c);
                const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones));
                const __m256 sdj = g16 ? lane_splat(_mm256_load_ps(sd[m][j >> 2]), j & 3) : _mm256_broadcast_ss(&sd[m][0][j]);
                if (j & 1) acc2[m] = _mm256_fmadd_ps(f, sdj, acc2[m]);
                else acc[m] = _mm256_fmadd_ps(f, sdj, acc[m]);
            }
        }
    }
    for (int64_t r = 0; !g16 && r < runs; r++) {
        __m256 s, mw0;
        run_scales(kind, sc, mn, qh, r, &s, &mw0);
        const __m256 mw = _mm256_fmadd_ps(s, _mm256_set1_ps(zw), mw0);
        for (int m = 0; m < U8T_ROWS; m++)
            accm[m] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(a->sum + m * nbp + r * I16_RUN), accm[m]);
    }
    row_dot_i16_from(kind, q, qh, zero, sc, mn, g16 ? 0 : 1, 0, a, U8T_ROWS, runs * I16_RUN, acc, acc2, accm, res);
}

/* u8_rows_many with kind and g16 as constants; codes: scratch for a tile's codes. */
static inline __attribute__((always_inline)) void
u8_rows_many_of(int kind, int g16, int64_t M, const uint8_t *qs, const uint8_t *qh, const uint16_t *sc,
                const uint16_t *mn, const act_i16 *a, int64_t n0, int64_t n1, int64_t N, float *out, int zero,
                int64_t tile, uint8_t *codes) {
    const int64_t K = a->K, row_bytes = quant_row_bytes(kind, K), high_bytes = quant_high_row_bytes(kind, K);
    const int64_t groups = quant_scales_per_row(kind, K, g16 ? 16 : I16_QB);
    const int64_t runs = a->nb / I16_RUN, full = M / U8T_ROWS * U8T_ROWS;
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
        const int64_t t1 = t0 + tile < n1 ? t0 + tile : n1;
        for (int64_t n = t0; n < t1; n++)   /* the runs' raw codes, once for all rows of x */
            for (int64_t b = 0; b < runs * I16_RUN; b++)
                _mm256_store_si256((__m256i *)(codes + (n - t0) * K + b * I16_QB),
                                   block_codes_u8(kind, qs + n * row_bytes,
                                                  quant_high_bits_at(kind, qh + n * high_bytes, K), b));
        for (int64_t m0 = 0; m0 < full; m0 += U8T_ROWS) {
            const act_i16 v = act_i16_rows(a, m0);
            for (int64_t n = t0; n < t1; n++) {
                float res[U8T_ROWS];
                u8_row_tile(kind, g16, codes + (n - t0) * K, qs + n * row_bytes, qh + n * high_bytes,
                            sc + n * groups, mn ? mn + n * groups : NULL, zero, &v, res);
                for (int m = 0; m < U8T_ROWS; m++) out[(m0 + m) * N + n] = res[m];
            }
        }
        if (full < M) {
            const act_i16 v = act_i16_rows(a, full);
            rows_range_i16(kind, (int)(M - full), qs, sc, mn, g16 ? 0 : 1, g16 ? 16 : I16_QB, &v, t0, t1, N,
                           out + full * N, qh, zero);
        }
    }
}

/* q5/q6 output rows [n0, n1) for M rows of x (u8_many_applies): tiles of weight rows whose raw
 * codes (block_codes_u8: 6-13 instructions a block) are expanded once into U8T_CODES bytes of
 * scratch, against every U8T_ROWS rows of x in turn (u8_row_tile), the last M % U8T_ROWS rows as
 * rows_range_i16. Returns -1 when the scratch cannot be had, then nothing is written. */
static int u8_rows_many(int kind, int64_t per, int64_t M, const uint8_t *qs, const uint8_t *qh, const uint16_t *sc,
                        const uint16_t *mn, const act_i16 *a, int64_t n0, int64_t n1, int64_t N, float *out,
                        int zero) {
    const int64_t tile = a->K >= U8T_CODES / 4 ? 4 : U8T_CODES / a->K;
    uint8_t *codes = aligned_alloc(32, (size_t)(tile * a->K));
    if (!codes) return -1;
    if (kind == QUANT_I4) u8_rows_many_of(QUANT_I4, 0, M, qs, qh, sc, mn, a, n0, n1, N, out, zero, tile, codes);
    else if (kind == 5 && per == 1) u8_rows_many_of(5, 0, M, qs, qh, sc, mn, a, n0, n1, N, out, zero, tile, codes);
    else if (kind == QUANT_Q5K) u8_rows_many_of(QUANT_Q5K, 0, M, qs, qh, sc, mn, a, n0, n1, N, out, zero, tile, codes);
    else if (kind == 5) u8_rows_many_of(5, 1, M, qs, qh, sc, mn, a, n0, n1, N, out, zero, tile, codes);
    else if (kind == QUANT_Q6K) u8_rows_many_of(QUANT_Q6K, 1, M, qs, qh, sc, mn, a, n0, n1, N, out, zero, tile, codes);
    else if (per == 1) u8_rows_many_of(6, 0, M, qs, qh, sc, mn, a, n0, n1, N, out, zero, tile, codes);
    else u8_rows_many_of(6, 1, M, qs, qh, sc, mn, a, n0, n1, N, out, zero, tile, codes);
    free(codes);
    return 0;
}

#ifndef Q8T_ROWS
#define Q8T_ROWS 4       /* rows of x per q8 many-row micro-kernel */
#endif
#ifndef Q8T_MIN_ROWS
#define Q8T_MIN_ROWS 16  /* from this many rows of x, q8 takes it */
#endif
#ifndef Q8T_L1
#define Q8T_L1 24576     /* bytes of a tile's codes and its Q8T_ROWS rows of int16 x together */
#endif

/* One q8 weight row (groups of 32) against Q8T_ROWS rows of int16 x, the many-row shape of
 * row_dot_i16 with its arithmetic: the same float operations on the same values in the same
 * order per row of x, so the same bits. Per block the codes are widened once for the rows; the
 * minimum terms (zero for q8, kept for the bits) in a loop of their own, so that only acc and
 * acc2 stay in registers (8 for 4 rows; row_dot_i16 at 8 rows held 24 and spilled). The blocks
 * after the full runs take row_dot_i16_from. */
static inline __attribute__((always_inline)) void
q8_row_tile(const uint8_t *q, const uint16_t *sc, int64_t left, const act_i16 *a, float *res) {
    const int64_t runs = a->nb / I16_RUN, nbp = a->nbp, K = a->K;
    __m256 acc[I16_ROWS], acc2[I16_ROWS], accm[I16_ROWS];
    for (int m = 0; m < Q8T_ROWS; m++) acc[m] = acc2[m] = accm[m] = _mm256_setzero_ps();
    for (int64_t r = 0; r < runs; r++) {
        const __m256 s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + r * I16_RUN)));
        float sd[Q8T_ROWS][I16_RUN] __attribute__((aligned(32)));
        for (int m = 0; m < Q8T_ROWS; m++) _mm256_store_ps(sd[m], _mm256_mul_ps(s, _mm256_loadu_ps(a->d + m * nbp + r * I16_RUN)));
#pragma GCC unroll 8   /* j a constant: acc or acc2 */
        for (int j = 0; j < I16_RUN; j++) {
            const int64_t b = r * I16_RUN + j;
            __m256i c0, c1;
            block_codes_i16(q, b, &c0, &c1);
            for (int m = 0; m < Q8T_ROWS; m++) {
                const int16_t *x = a->q + m * K + b * I16_QB;
                const __m256i t = _mm256_add_epi32(_mm256_madd_epi16(c0, _mm256_loadu_si256((const __m256i *)x)),
                                                   _mm256_madd_epi16(c1, _mm256_loadu_si256((const __m256i *)(x + 16))));
                const __m256 f = _mm256_cvtepi32_ps(t), sdj = _mm256_broadcast_ss(&sd[m][j]);
                if (j & 1) acc2[m] = _mm256_fmadd_ps(f, sdj, acc2[m]);
                else acc[m] = _mm256_fmadd_ps(f, sdj, acc[m]);
            }
        }
    }
    for (int64_t r = 0; r < runs; r++) {
        __m256 s, mw0;
        run_scales(8, sc, NULL, NULL, r, &s, &mw0);
        const __m256 mw = _mm256_fmadd_ps(s, _mm256_setzero_ps(), mw0);
        for (int m = 0; m < Q8T_ROWS; m++)
            accm[m] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(a->sum + m * nbp + r * I16_RUN), accm[m]);
    }
    row_dot_i16_from(8, q, NULL, 0, sc, NULL, 1, left, a, Q8T_ROWS, runs * I16_RUN, acc, acc2, accm, res);
}

/* q8 output rows [n0, n1) for M rows of x (groups of 32): tiles of weight rows against every
 * Q8T_ROWS rows of x in turn (q8_row_tile), a tile's codes and those rows of x (int16: twice
 * q4's int8 bytes) about Q8T_L1 together, so both stay in L1; the last M % Q8T_ROWS rows as
 * rows_range_i16. */
static void q8_rows_many(int64_t M, const uint8_t *qs, const uint16_t *sc, const act_i16 *a, int64_t n0, int64_t n1,
                         int64_t N, float *out) {
    const int64_t K = a->K, row_bytes = K, groups = K / I16_QB, room = Q8T_L1 - Q8T_ROWS * K * 2;
    const int64_t tile = room / row_bytes > 2 ? room / row_bytes : 2, full = M / Q8T_ROWS * Q8T_ROWS;
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
        const int64_t t1 = t0 + tile < n1 ? t0 + tile : n1;
        for (int64_t m0 = 0; m0 < full; m0 += Q8T_ROWS) {
            const act_i16 v = act_i16_rows(a, m0);
            for (int64_t n = t0; n < t1; n++) {
                float res[Q8T_ROWS];
                q8_row_tile(qs + n * row_bytes, sc + n * groups, (N - n) * groups, &v, res);
                for (int m = 0; m < Q8T_ROWS; m++) out[(m0 + m) * N + n] = res[m];
            }
        }
        if (full < M) {
            const act_i16 v = act_i16_rows(a, full);
            rows_range_i16(8, (int)(M - full), qs, sc, NULL, 1, I16_QB, &v, t0, t1, N, out + full * N, NULL, 0);
        }
    }
}

/* Output rows [n0, n1) for M rows of x, any M: tiles of weight rows (about 16 KiB of codes, so
 * they stay in L1/L2) against every pass of I16_ROWS rows of x in turn, so the weights are
 * read from memory once for all the rows instead of once per pass (a batched decode, the LM
 * head of a mixed step). */
static void rows_many_i16(int kind, int64_t M, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn,
                          int64_t per, int64_t group, const act_i16 *a, int64_t n0, int64_t n1, int64_t N,
                          float *out, const uint8_t *qh, int zero) {
    if (M <= I16_ROWS) {
        rows_range_i16(kind, (int)M, qs, sc, mn, per, group, a, n0, n1, N, out, qh, zero);
        return;
    }
    if (IS_Q4(kind) && per == 1 && a->nb >= I16_RUN && M >= Q4T_MIN_ROWS
        && q4_rows_many(kind, M, qs, qh, sc, mn, a, n0, n1, N, out, zero) == 0)
        return;
    if (kind == 8 && per == 1 && M >= Q8T_MIN_ROWS && !mn) {
        q8_rows_many(M, qs, sc, a, n0, n1, N, out);
        return;
    }
    if (M >= U8T_MIN_ROWS && u8_many_applies(kind, per, a)
        && u8_rows_many(kind, per, M, qs, qh, sc, mn, a, n0, n1, N, out, zero) == 0)
        return;
    const int64_t row_bytes = quant_row_bytes(kind, a->K) + quant_high_row_bytes(kind, a->K);
    const int64_t tile = row_bytes >= 4096 ? 4 : 16384 / row_bytes;
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
        const int64_t t1 = t0 + tile < n1 ? t0 + tile : n1;
        for (int64_t m0 = 0; m0 < M; m0 += I16_ROWS) {
            const act_i16 v = act_i16_rows(a, m0);
            const int m_rows = M - m0 < I16_ROWS ? (int)(M - m0) : I16_ROWS;
            rows_range_i16(kind, m_rows, qs, sc, mn, per, group, &v, t0, t1, N, out + m0 * N, qh, zero);
        }
    }
}

/* Whether the integer path takes this layout: blocks of 32, groups of 32k or 16 (any number of rows). */
static inline int i16_applies(int64_t K, int64_t group) {
    return K % I16_QB == 0 && (group % I16_QB == 0 || group == 16);
}

/* The activation buffer of M rows of K: int16 codes in x's and in even/odd or q4's pair order, then
 * per block d, d * sum(q) and the two half-block sums. i16_act_bind points an act_i16 at one
 * (malloc-aligned) of i16_act_bytes. */
static inline int64_t i16_act_bytes(int64_t M, int64_t K) {
    const int64_t nbp = (K / I16_QB + I16_RUN - 1) / I16_RUN * I16_RUN;
    return 2 * (int64_t)sizeof(int16_t) * M * K + 4 * (int64_t)sizeof(float) * M * nbp;
}

static inline void i16_act_bind(act_i16 *a, void *buf, int64_t M, int64_t K) {
    a->K = K;
    a->nb = K / I16_QB;
    a->nbp = (a->nb + I16_RUN - 1) / I16_RUN * I16_RUN;
    a->q = (int16_t *)buf;
    a->qe = a->q + M * K;
    a->x8 = (int8_t *)a->q;
    a->d = (float *)(a->qe + M * K);
    a->sum = a->d + M * a->nbp;
    a->sum16 = a->sum + M * a->nbp;
}

#endif
