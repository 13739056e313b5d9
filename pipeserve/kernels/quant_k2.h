/* Matmuls against q2 / q3 weights (GGUF Q2_K / Q3_K as their files hold them:
 * model/quant/packed.py), included by quant_matmul.c after its float helpers (f16_to_f32,
 * f32_to_bf16, store) and, on AVX2 builds, quant_gemv_avx2.h's activations (act_i16).
 *
 * A row is super-blocks of QUANT_K2_SUPER (256) weights: 64 bytes of 2-bit codes (qs), in qh
 * 16 integer sub-scales, one per group of 16 (q3: after the 32 bytes of its hmask; int8 -32..31;
 * q2: a byte each, its 4-bit scale low and its 4-bit minimum high), a float16 d (sc) and for q2
 * a float16 -dmin (mn). Weight i of group g: d * sub_g * (code_i - zero) + (-dmin) * min_g.
 *
 * AVX2 integer path (k2_rows_many, quant_rows' q2/q3): the int8 activations of
 * quant_gemv_avx2.h (blocks of 32, d_x = max|x| / 127, in x's order). Per block of 32 (two
 * groups) and weight row the raw codes (0..3 / 0..7, quant_k2_codes32_avx2) once and the two
 * sub-scales as the high bytes of 16-bit words (one vpshufb of the super-block's 16 bytes: sub_g *
 * 256, the low lane group 2j, the high lane 2j + 1); per row of x one vpmaddubsw (|pair| <= 2 * 7
 * * 127), one vpmaddwd with those words (the integer sum of sub_g * code * x per 4 weights, |.| <=
 * 2^25 and a multiple of 256: exact in float32), one conversion and one FMA with d * d_x / 256
 * (a broadcast from a per-row array of the super-block's 8 blocks). The zero (q3: -4 * d * sub_g)
 * and minimum (q2: -dmin * min_g) terms meet d_x * sum(q_x) per group of 16 (act_i16's sum16) in
 * two FMAs per super-block and row. So the float work is one multiply per block of activations;
 * the old layout (a float16 scale, and minimum, per 16: 1.16x / 1.52x the file) needed its 16
 * scales converted and multiplied per super-block and row.
 *
 * Float paths (k2_gemv_float, k2_dequant: portable decode, float activations, prefill tiles): a
 * row is expanded into int8 codes (quant_expand_row) and float32 scale and minimum per 16
 * (k2_group_scales: d * sub and -dmin * min, exact), then code * s + b, one rounding (the product
 * is exact): the bits of packed.py's dequantize.
 */
#ifndef PIPESERVE_QUANT_K2_H
#define PIPESERVE_QUANT_K2_H

#include <stdint.h>
#include <stdlib.h>

#include "quant_codes.h"

static inline int quant_is_k2(int kind) { return kind == QUANT_Q2 || kind == QUANT_Q3; }

/* Whether a q2/q3 weight's arguments are its layout's: a scale per super-block, whole super-blocks. */
static inline int k2_shape_ok(int64_t K, int64_t group) {
    return group == QUANT_K2_SUPER && K % QUANT_K2_SUPER == 0;
}

/* A row's scale s and minimum b per group of 16, float32 (K / 16 each): d * sub, -dmin * min
 * (q3, or q2 without minimums: 0). Exact: a float16 times an integer below 64. */
static inline void k2_group_scales(int kind, const uint8_t *qh, const uint16_t *sc, const uint16_t *mn, int64_t K,
                                   float *s, float *b) {
    const int64_t hs = quant_k2_high(kind);
    for (int64_t j = 0; j < K / QUANT_K2_SUPER; j++) {
        const float d = f16_to_f32(sc[j]), m = kind == QUANT_Q2 && mn ? f16_to_f32(mn[j]) : 0.0f;
        const uint8_t *h = qh + j * hs;
        for (int g = 0; g < 16; g++) quant_k2_group(kind, h, g, d, m, s + 16 * j + g, b + 16 * j + g);
    }
}

/* Per-thread scratch of the float paths for rows of K: int8 codes, the per-16 scales and
 * minimums, a float32 row. */
static inline int64_t k2_scratch_bytes(int64_t K) { return K + 2 * (K / 16) * 4 + 4 * K + 64; }

/* A row's K weights as float32 into w (scratch: k2_scratch_bytes, w may be its own). */
static inline const float *k2_dequant_row(int kind, const uint8_t *qs, const uint8_t *qh, const uint16_t *sc,
                                          const uint16_t *mn, int zero, int64_t K, char *scratch, float *w) {
    float *s = (float *)scratch, *b = s + K / 16;
    int8_t *codes = (int8_t *)(b + K / 16);
    if (!w) w = (float *)(((uintptr_t)(codes + K) + 63) & ~(uintptr_t)63);
    quant_expand_row(kind, qs, qh, zero, K, codes);
    k2_group_scales(kind, qh, sc, mn, K, s, b);
    for (int64_t g = 0; g < K / 16; g++) {
        const float sg = s[g], bg = b[g];
#pragma omp simd
        for (int i = 0; i < 16; i++) w[16 * g + i] = (float)codes[16 * g + i] * sg + bg;
    }
    return w;
}

/* out [M, N] = xf [M, K] . W^T with float activations: each row dequantized once into scratch. */
static int k2_gemv_float(int kind, const uint8_t *qs, const uint8_t *qh, const uint16_t *sc, const uint16_t *mn,
                         int zero, int64_t N, int64_t K, const float *xf, int64_t M, void *out, int out_bf16,
                         int num_threads) {
    const int64_t row_bytes = quant_row_bytes(kind, K), high = quant_high_row_bytes(kind, K);
    const int64_t supers = K / QUANT_K2_SUPER;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        char *scratch = aligned_alloc(64, (size_t)(k2_scratch_bytes(K) + 63) / 64 * 64);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (!scratch) continue;
            const float *w = k2_dequant_row(kind, qs + n * row_bytes, qh + n * high, sc + n * supers,
                                            mn ? mn + n * supers : NULL, zero, K, scratch, NULL);
            for (int64_t m = 0; m < M; m++) {
                const float *x = xf + m * K;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t k = 0; k < K; k++) dot += w[k] * x[k];
                store(out, out_bf16, m * N + n, dot);
            }
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* Rows [r0, r1) dequantized into out (float32 or bfloat16, [r1 - r0, K]). */
static int k2_dequant(int kind, const uint8_t *qs, const uint8_t *qh, const uint16_t *sc, const uint16_t *mn,
                      int zero, int64_t K, int64_t r0, int64_t r1, void *out, int out_bf16, int num_threads) {
    const int64_t row_bytes = quant_row_bytes(kind, K), high = quant_high_row_bytes(kind, K);
    const int64_t supers = K / QUANT_K2_SUPER;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        char *scratch = aligned_alloc(64, (size_t)(k2_scratch_bytes(K) + 63) / 64 * 64);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = r0; n < r1; n++) {
            if (!scratch) continue;
            float *dst = out_bf16 ? NULL : (float *)out + (n - r0) * K;
            const float *w = k2_dequant_row(kind, qs + n * row_bytes, qh + n * high, sc + n * supers,
                                            mn ? mn + n * supers : NULL, zero, K, scratch, dst);
            if (out_bf16)
                for (int64_t k = 0; k < K; k++) ((uint16_t *)out)[(n - r0) * K + k] = f32_to_bf16(w[k]);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

#ifdef HAVE_AVX2_INT
/* Block j's two sub-scales (groups 2j, 2j + 1) of a super-block's 16 bytes (in both lanes) as
 * the high bytes of 16-bit words: sub * 256, group 2j in the low lane, 2j + 1 in the high one. */
static inline __attribute__((always_inline)) __m256i k2_block_subs(__m256i subs, int j) {
    const __m128i lo = _mm_set1_epi16((short)((2 * j) << 8 | 0x80));
    const __m128i hi = _mm_set1_epi16((short)((2 * j + 1) << 8 | 0x80));
    return _mm256_shuffle_epi8(subs, _mm256_set_m128i(hi, lo));
}

/* Block j (0..7, a constant once inlined: immediate shifts and shuffle indices) of a super-block
 * against m_rows rows of int8 x: its raw codes from v (the 32 bytes of bit pairs of blocks j & ~3
 * .. j | 3) and q3's hmask h (bit j of each byte as 4), its two sub-scales from subs. */
static inline __attribute__((always_inline)) void
k2_block(int kind, int j, __m256i v, __m256i h, __m256i subs, const int8_t *x, int64_t K, int m_rows,
         float (*sd)[8], __m256 *acc) {
    __m256i c = _mm256_and_si256(_mm256_srli_epi16(v, 2 * (j % 4)), _mm256_set1_epi8(3));
    if (kind == QUANT_Q3) {   /* as quant_k2_codes32_avx2: no bit crosses into bit 2 of another byte */
        const __m256i hb = j >= 2 ? _mm256_srli_epi16(h, j - 2) : _mm256_slli_epi16(h, 2 - j);
        c = _mm256_or_si256(c, _mm256_and_si256(hb, _mm256_set1_epi8(4)));
    }
    const __m256i sw = k2_block_subs(subs, j);
    for (int m = 0; m < m_rows; m++) {
        const __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(c, _mm256_loadu_si256((const __m256i *)(x + m * K))), sw);
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_broadcast_ss(&sd[m][j]), acc[m]);
    }
}

/* One weight row against m_rows rows of int8 x (the file comment says how). */
static inline __attribute__((always_inline)) void
k2_row(int kind, const uint8_t *q, const uint8_t *qh, const uint16_t *sc, const uint16_t *mn, int zero,
       const act_i16 *a, int m_rows, float *res) {
    const int64_t supers = a->K / QUANT_K2_SUPER, nbp = a->nbp, K = a->K, hs = quant_k2_high(kind);
    __m256 acc[I16_ROWS], acc2[I16_ROWS];
    for (int m = 0; m < m_rows; m++) acc[m] = acc2[m] = _mm256_setzero_ps();
    for (int64_t s = 0; s < supers; s++) {
        const int64_t b0 = 8 * s;   /* its first block of 32 */
        const __m128i raw = _mm_loadu_si128((const __m128i *)(qh + s * hs + (kind == QUANT_Q3 ? 32 : 0)));
        const __m256i subs = _mm256_broadcastsi128_si256(kind == QUANT_Q3 ? raw : _mm_and_si128(raw, _mm_set1_epi8(15)));
        const float d = _cvtsh_ss(sc[s]);
        __m256 w0, w1;   /* groups 0-7, 8-15: what multiplies d_x * sum(q_x) */
        if (kind == QUANT_Q3) {
            const __m256 z = _mm256_set1_ps(-(float)zero * d);
            w0 = _mm256_mul_ps(z, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)));
            w1 = _mm256_mul_ps(z, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8))));
        } else {
            const __m128i mins = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15));
            const __m256 mv = _mm256_set1_ps(mn ? _cvtsh_ss(mn[s]) : 0.0f);
            w0 = _mm256_mul_ps(mv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mins)));
            w1 = _mm256_mul_ps(mv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(mins, 8))));
        }
        float sd[I16_ROWS][8] __attribute__((aligned(32)));   /* d * d_x / 256 per block and row */
        const __m256 d256 = _mm256_set1_ps(d * (1.0f / 256));
        for (int m = 0; m < m_rows; m++) {
            _mm256_store_ps(sd[m], _mm256_mul_ps(d256, _mm256_loadu_ps(a->d + m * nbp + b0)));
            const float *xs = a->sum16 + 2 * (m * nbp + b0);
            acc2[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xs), acc2[m]);
            acc2[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xs + 8), acc2[m]);
        }
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(q + s * 64));
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(q + s * 64 + 32));
        const __m256i h = kind == QUANT_Q3 ? _mm256_loadu_si256((const __m256i *)(qh + s * hs)) : _mm256_setzero_si256();
        const int8_t *x = a->x8 + b0 * I16_QB;
        k2_block(kind, 0, v0, h, subs, x, K, m_rows, sd, acc);
        k2_block(kind, 1, v0, h, subs, x + 32, K, m_rows, sd, acc2);
        k2_block(kind, 2, v0, h, subs, x + 64, K, m_rows, sd, acc);
        k2_block(kind, 3, v0, h, subs, x + 96, K, m_rows, sd, acc2);
        k2_block(kind, 4, v1, h, subs, x + 128, K, m_rows, sd, acc);
        k2_block(kind, 5, v1, h, subs, x + 160, K, m_rows, sd, acc2);
        k2_block(kind, 6, v1, h, subs, x + 192, K, m_rows, sd, acc);
        k2_block(kind, 7, v1, h, subs, x + 224, K, m_rows, sd, acc2);
    }
    for (int m = 0; m < m_rows; m++) res[m] = hsum8(_mm256_add_ps(acc[m], acc2[m]));
}

/* Output rows [n0, n1); the codes, sub-scales and scales of row n + I16_PF_ROWS are
 * prefetched while row n is computed. */
static inline __attribute__((always_inline)) void
k2_rows(int kind, int m_rows, const uint8_t *qs, const uint8_t *qh, const uint16_t *sc, const uint16_t *mn,
        int zero, const act_i16 *a, int64_t n0, int64_t n1, int64_t N, float *out) {
    const int64_t K = a->K, row_bytes = quant_row_bytes(kind, K), high = quant_high_row_bytes(kind, K);
    const int64_t supers = K / QUANT_K2_SUPER;
    for (int64_t n = n0; n < n1; n++) {
        const int64_t f = n + I16_PF_ROWS;
        if (f < n1) prefetch_row(qs, row_bytes, qh, high, sc, mn, supers, f);
        float res[I16_ROWS];
        k2_row(kind, qs + n * row_bytes, qh + n * high, sc + n * supers, mn ? mn + n * supers : NULL, zero, a,
               m_rows, res);
        for (int m = 0; m < m_rows; m++) out[m * N + n] = res[m];
    }
}

/* kind and m_rows as constants: the loops unroll and the accumulators stay in registers. */
static void k2_rows_range(int kind, int m_rows, const uint8_t *qs, const uint8_t *qh, const uint16_t *sc,
                          const uint16_t *mn, int zero, const act_i16 *a, int64_t n0, int64_t n1, int64_t N,
                          float *out) {
#define CASE(k, r) case r: k2_rows(k, r, qs, qh, sc, mn, zero, a, n0, n1, N, out); break;
#define ALL(k) switch (m_rows) { CASE(k, 1) CASE(k, 2) CASE(k, 3) CASE(k, 4) CASE(k, 5) CASE(k, 6) CASE(k, 7) \
                                 default: k2_rows(k, I16_ROWS, qs, qh, sc, mn, zero, a, n0, n1, N, out); break; }
    if (kind == QUANT_Q3) ALL(QUANT_Q3)
    else ALL(QUANT_Q2)
#undef ALL
#undef CASE
}

/* Output rows [n0, n1) for M rows of x, any M: tiles of weight rows (about 16 KiB of codes)
 * against every pass of I16_ROWS rows of x in turn, so the weights come from memory once
 * (a fused decode step of many requests, a few prompt rows). */
static void k2_rows_many(int kind, int64_t M, const uint8_t *qs, const uint8_t *qh, const uint16_t *sc,
                         const uint16_t *mn, int zero, const act_i16 *a, int64_t n0, int64_t n1, int64_t N,
                         float *out) {
    const int64_t row_bytes = quant_row_bytes(kind, a->K) + quant_high_row_bytes(kind, a->K);
    const int64_t tile = M <= I16_ROWS ? n1 - n0 : row_bytes >= 4096 ? 4 : 16384 / row_bytes;
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
        const int64_t t1 = t0 + tile < n1 ? t0 + tile : n1;
        for (int64_t m0 = 0; m0 < M; m0 += I16_ROWS) {
            const act_i16 v = act_i16_rows(a, m0);
            const int m_rows = M - m0 < I16_ROWS ? (int)(M - m0) : I16_ROWS;
            k2_rows_range(kind, m_rows, qs, qh, sc, mn, zero, &v, t0, t1, N, out + m0 * N);
        }
    }
}
#endif

#endif
