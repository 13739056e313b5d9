/* Many-row matmul (prefill, batched decode) against weights kept quantized, in 8-bit
 * integers on AVX512-VNNI (vpdpbusd), as llama.cpp multiplies its quantized types.
 *
 * pipeserve_quant_gemm_i8: out[M, N] = x[M, K] . W[N, K]^T, x and out bfloat16 or float32.
 *
 *   Activations: each row of x is quantized per block of 32 (k = 32b .. 32b + 31) to int8,
 *   xq = round(x / dx) with dx = max|x| / 127 (round to nearest even), and the block's
 *   xs = dx * sum(xq) is kept for the weights' offsets (and per half of 16 the integer sum and
 *   dx times it). So every activation moves by at most dx / 2: |out - x . W^T| <= sum_k |w_k| *
 *   dx(k) / 2 plus float32 rounding, the bound the AVX2 builds' int8 prompts have (and
 *   llama.cpp's Q8 activations).
 *
 *   Weights: every layout taken here is, per block of 32 (or 16) weights of a row, w = s * u + m
 *   with u an unsigned 8-bit code and s, m float32: q4 and q5 (Q4_0, Q4_1, Q5_0, Q5_1: u the nibble,
 *   plus 16 for q5's high bit, s its float16 scale, m the float16 minimum minus zero * s), q4k
 *   and q5k (Q4_K, Q5_K: s = d * sub, m = -dmin * min, exact) and q8 (Q8_0: u = code + 128,
 *   m = min - 128 * s), i4 (IQ4_NL, IQ4_XS: u = the codebook's value + 128, m = -128 * s); and per
 *   16 weights q6k and q3 (Q6_K, Q3_K): w = s * (u - zero), u the 6- or 3-bit code, s = d * sub
 *   (exact), no minimums; q2 (Q2_K): w = s * u + m, s = d * sub, m = -dmin * min. Each thread
 *   takes panels of 16 weight rows: the panel's codes are unpacked once into
 *   [K / 4][16 rows][4 codes] (one zmm a group of 4 k), its s and m into [K / 32 (or K / 16)][16];
 *   then every block of up to MR rows of x runs against it: per group of 4 k one load and one
 *   vpdpbusd a row of x with its 4 int8 codes broadcast (lanes = the panel's 16 weight rows), and
 *   per block of 32 the exact int32 dot is converted and added as acc += dot * (s * dx) + m * xs.
 *   Per 16 (q6k, q3): the dot starts at
 *   -zero * sum(xq) of the 16 (exact in int32), then acc += dot * (s * dx): one more conversion and
 *   product per 32 weights than the others; q2 adds m * dx * sum(xq) per 16.
 *
 * kind: 4, 5, 8, 9, 2, 3, 10, 11 or 12 (q4, q5, q8, i4, q2, q3, q4k, q6k, q5k); zero: the code
 * offset (Q4_0's 8, Q5_0's 16, Q6_K's 32, Q3_K's 4); qh: q5's high-bit planes, q4k's sub-scales,
 * q5k's and q6k's sub-scales then planes or bit pairs, q3's hmask and sub-scales, q2's sub-scales.
 * Returns 0; -1 when scratch cannot be allocated; -3 for a layout it does not take (K not a
 * multiple of 32, a group not a multiple of 32, the K-quants not in whole super-blocks of 256,
 * another kind). Without AVX512-VNNI (+ BW, VL) pipeserve_quant_gemm_i8_isa() says "none" and the
 * function returns -2: the caller keeps its other paths.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_codes.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) \
    && defined(__F16C__)
#define I8_GEMM 1
#endif

const char *pipeserve_quant_gemm_i8_isa(void) {
#ifdef I8_GEMM
    return "avx512-vnni";
#else
    return "none";
#endif
}

/* Whether the kernel takes this layout (kind, K, group): what the caller asks before it quantizes. */
int pipeserve_quant_gemm_i8_takes(int kind, int64_t K, int64_t group) {
#ifdef I8_GEMM
    if (kind == QUANT_Q6K) return q6k_shape_ok(K, group);
    if (kind == QUANT_Q2 || kind == QUANT_Q3) return K % QUANT_K2_SUPER == 0 && group == QUANT_K2_SUPER;
    if (K % 32 != 0 || group % 32 != 0) return 0;
    if (kind == QUANT_Q4K || kind == QUANT_Q5K) return q4k_shape_ok(K, group);
    return kind == 4 || kind == 5 || kind == 8 || kind == QUANT_I4;
#else
    (void)kind; (void)K; (void)group;
    return 0;
#endif
}

/* The rows of x from which this kernel is taken for a layout it takes (below them the decode
 * gemv, which reads the codes as they are and keeps finer activations): IQ4's i4 from 2 (its gemv
 * on AVX-512 builds is AVX2's: this kernel 1.31-1.44x at 2 rows), q4 (Q4_0, Q4_1), Q4_K and q8 from
 * 4, the others (Q5_0, Q5_1, Q5_K, Q6_K, Q3_K, Q2_K) from 5. Measured once panel_bytes prefetched
 * the next panel (one thread; SmolLM2 also two): at those rows 1.07-1.53x the gemv on every shape
 * measured, one row fewer 0.83-1.37x (benchmarks/README.md, twenty-fourth
 * session). Before, with the unpack waiting on memory, q8 took it from 9, q4 and i4 from 6, the
 * others from 8. */
int64_t pipeserve_quant_gemm_i8_from(int kind) {
    return kind == QUANT_I4 ? 2 : kind == 4 || kind == 8 || kind == QUANT_Q4K ? 4 : 5;
}

#ifdef I8_GEMM
#include <immintrin.h>

#include "avx512_transpose.h"

#define PR 16   /* weight rows per panel: one zmm of 16 int32 lanes */
#define MR 10   /* rows of x per micro-kernel call: 10 int32 + 10 float32 accumulators (12 spilled, measured) */

/* Rows [m0, m1) of x quantized per block of 32: xq [M][K] int8, dx and xs [M][K / 32]. */
static void quantize_rows(const void *x, int bf16, int64_t K, int64_t m0, int64_t m1, int8_t *xq, float *dx,
                          float *xs, int32_t *sum16, float *xs16) {
    const int64_t nb = K / 32;
    const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    for (int64_t m = m0; m < m1; m++) {
        for (int64_t b = 0; b < nb; b++) {
            __m512 v0, v1;
            if (bf16) {
                const uint16_t *p = (const uint16_t *)x + m * K + b * 32;
                v0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
                v1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 16))), 16));
            } else {
                const float *p = (const float *)x + m * K + b * 32;
                v0 = _mm512_loadu_ps(p);
                v1 = _mm512_loadu_ps(p + 16);
            }
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(v0, absmask), _mm512_and_ps(v1, absmask)));
            const float d = amax / 127.0f, inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
            _mm_storeu_si128((__m128i *)(xq + m * K + b * 32), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(xq + m * K + b * 32 + 16), _mm512_cvtsepi32_epi8(q1));
            const int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
            dx[m * nb + b] = d;
            xs[m * nb + b] = d * (float)(s0 + s1);
            sum16[m * 2 * nb + 2 * b] = s0;
            sum16[m * 2 * nb + 2 * b + 1] = s1;
            xs16[m * 2 * nb + 2 * b] = d * (float)s0;
            xs16[m * 2 * nb + 2 * b + 1] = d * (float)s1;
        }
    }
}

/* 32 codes of a q5 block as unsigned bytes: the 16 bytes at q hold k..k+15 in their low nibbles,
 * k+16..k+31 in the high ones, plus 16 where the block's plane (32 high bits, bit i code i) is set. */
static inline __attribute__((always_inline)) __m256i codes32(const uint8_t *q, const uint8_t *plane) {
    const __m128i lo4 = _mm_set1_epi8(15), v = _mm_loadu_si128((const __m128i *)q);
    const __m256i c = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_and_si128(v, lo4)),
                                              _mm_and_si128(_mm_srli_epi16(v, 4), lo4), 1);
    uint32_t bits;
    memcpy(&bits, plane, 4);
    return _mm256_mask_add_epi8(c, (__mmask32)bits, c, _mm256_set1_epi8(16));
}

/* q5's 64 codes (k .. k + 63, two blocks; the second zero past K) of a row as unsigned bytes (hb: the
 * row's high-bit planes, 4 bytes a block): unpack_panel's path for q5 without AVX512_BITALG, the
 * other layouts' codes being transposed as the file's bytes. */
static inline __attribute__((always_inline)) __m512i q5_codes64(const uint8_t *row, const uint8_t *hb, int64_t k,
                                                               int64_t K) {
    const __m256i ca = codes32(row + k / 2, hb + k / 32 * 4);
    if (k + 64 > K) return _mm512_castsi256_si512(ca);
    return _mm512_inserti64x4(_mm512_castsi256_si512(ca), codes32(row + k / 2 + 16, hb + k / 32 * 4 + 4), 1);
}

/* How a layout's scales go: 0 per 32 (a minimum per 32, or a code offset), 1 per 16 without a
 * minimum (Q6_K, Q3_K: w = s * (u - zero)), 2 per 16 with one (Q2_K): the micro-kernel's `per16`. */
static inline int scale_form(int kind) {
    return kind == QUANT_Q6K || kind == QUANT_Q3 ? 1 : kind == QUANT_Q2 ? 2 : 0;
}

/* Rows-major [PR][cols] floats (a row every `stride`) -> dst [cols][PR], column c at dst + c * os
 * (os >= PR: panels side by side), 16 columns at a time through one transpose16 (columns past
 * `cols` of the last 16 are not stored). */
static void transpose_to_panel(const float *src, int64_t stride, int64_t cols, float *dst, int64_t os) {
    for (int64_t c0 = 0; c0 < cols; c0 += 16) {
        __m512i r[PR];
        for (int64_t j = 0; j < PR; j++) r[j] = _mm512_loadu_si512((const void *)(src + j * stride + c0));
        transpose16(r);   /* r[c] = column c0 + c of the 16 rows */
        const int64_t n = cols - c0 < 16 ? cols - c0 : 16;
        for (int64_t c = 0; c < n; c++) _mm512_store_si512((void *)(dst + (c0 + c) * os), r[c]);
    }
}

/* 64 bytes (those in `live`) of each of a panel's `rows` rows, `stride` bytes apart from p (rows past
 * `rows`: zero), transposed: r[c] = dword c of the 16 rows. Each row's load goes with a prefetch of
 * the same bytes of the row `ahead` rows on into L2 (the next panel's, or with panels in groups the
 * same panel of the next group, so that all of it arrives while this group's dot products run; one
 * panel ahead in groups of 4, SmolLM2's head from memory at 16 rows took 0.86x the one-panel
 * kernel's time, twenty-ninth session): a panel's rows are read a column of 64 bytes at a
 * time, 16 streams a row apart that the hardware prefetchers do not follow, so from memory the
 * unpack waited on every column (SmolLM2's Q8_0 head at 16 rows of x, one thread: 140-153 ns a
 * weight row from memory against 88-97 from L2 or L3; with these prefetches 95). One panel ahead
 * and spread over the loads: the same prefetches issued all at once at the panel's start, one or
 * more panels ahead, changed nothing (benchmarks/README.md, twenty-fourth session). Past the
 * matrix's end they fetch bytes nobody reads (a prefetch does not fault). */
static inline __attribute__((always_inline)) void panel_bytes(const uint8_t *p, int64_t stride, int64_t rows,
                                                              __mmask64 live, __m512i r[PR], int64_t ahead) {
    for (int64_t j = 0; j < PR; j++) {
        r[j] = j < rows ? _mm512_maskz_loadu_epi8(live, p + j * stride) : _mm512_setzero_si512();
        _mm_prefetch((const char *)(p + (ahead + j) * stride), _MM_HINT_T1);
    }
    transpose16(r);
}

/* Panel rows [n0, n0 + rows), rows <= PR: codes into wp [K / 4][PR] dwords, s and m into
 * [K / 32][PR] (q6k, q3, q2: per 16, [K / 16][PR]; rows past `rows`: zero codes and scales),
 * each group of PR os dwords (floats) from the last: os = NP * PR puts NP panels side by side
 * (and so many rows on are the ones panel_bytes prefetches).
 * The scales are made a row at a time into ts, tm ([PR][tstride] floats, tstride >= the row's
 * scales rounded up to 16; Q4_0-Q8_0 and IQ4_NL's float16 ones 16 at a time) and turned into the
 * panel's order by 16 x 16 transposes, where each was a scalar store 64 bytes from the last. The
 * codes of every layout but q8 (whose bytes are codes) are transposed as the file's bytes, then
 * split: a byte's codes sit at the byte's own position (q4 and i4 nibbles, Q6_K's nibbles and bit
 * pairs, Q2_K / Q3_K's bit pairs and hmask, q5's planes with AVX512_BITALG), so this gives the same
 * dwords as unpacking each row and then transposing with a third to a half of the instructions. At 16 rows
 * of x the unpacking had taken longer than the panel's dot products (perf, SmolLM2's gate_up);
 * together 1.07-1.59x at 16 rows, 0.99-1.22x at 64 (benchmarks/README.md, twenty-third session). */
static void unpack_panel(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t rows, int64_t K,
                         int64_t group, int64_t n0, int zero, const uint8_t *qh, uint32_t *wp, float *ws, float *wm,
                         float *ts, float *tm, int64_t tstride, int64_t os) {
    const int64_t nb = K / 32, row_bytes = quant_row_bytes(kind, K), high_bytes = quant_high_row_bytes(kind, K);
    const int ck = quant_codes_kind(kind);
    const int per16 = scale_form(kind) != 0;
    const int64_t cols = per16 ? 2 * nb : nb;
    for (int64_t j = 0; j < PR; j++) {
        float *rs = ts + j * tstride, *rm = tm + j * tstride;
        if (j >= rows) {
            memset(rs, 0, (size_t)tstride * sizeof(float));
            memset(rm, 0, (size_t)tstride * sizeof(float));
            continue;
        }
        const int64_t n = n0 + j;
        if (kind == QUANT_Q6K) {   /* no minimums (micro reads none per 16 without them) */
            quant_two_level_row(kind, sc, mn, qh, K, n, rs, NULL);
            continue;
        }
        if (kind == QUANT_Q2 || kind == QUANT_Q3) {   /* d * sub and (q2) -dmin * min per 16, exact */
            const int64_t sup = K / QUANT_K2_SUPER;
            for (int64_t u = 0; u < sup; u++) {
                const uint8_t *h = qh + n * high_bytes + u * quant_k2_high(kind);
                const float d = _cvtsh_ss(sc[n * sup + u]);
                const float m = kind == QUANT_Q2 && mn ? _cvtsh_ss(mn[n * sup + u]) : 0.0f;
                for (int g = 0; g < 16; g++) quant_k2_group(kind, h, g, d, m, rs + u * 16 + g, rm + u * 16 + g);
            }
            continue;
        }
        if (kind == QUANT_Q4K || kind == QUANT_Q5K) {
            quant_two_level_row(kind, sc, mn, qh, K, n, rs, rm);
            for (int64_t b = 0; b < nb; b++) rm[b] -= (float)zero * rs[b];
            continue;
        }
        const float off = (float)(kind == 8 || kind == QUANT_I4 ? 128 : zero);
        if (group == 32) {   /* a float16 scale (and minimum) per block: 16 blocks a vector */
            for (int64_t b = 0; b < nb; b += 16) {
                const __mmask16 live = (__mmask16)(nb - b >= 16 ? 0xffffu : (1u << (nb - b)) - 1u);
                const __m512 s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, sc + n * nb + b));
                const __m512 m = mn ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, mn + n * nb + b))
                                    : _mm512_setzero_ps();
                _mm512_storeu_ps(rs + b, s);
                _mm512_storeu_ps(rm + b, _mm512_sub_ps(m, _mm512_mul_ps(_mm512_set1_ps(off), s)));
            }
            continue;
        }
        const int64_t groups = K / group;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t g = b * 32 / group;
            const float s = _cvtsh_ss(sc[n * groups + g]), m = mn ? _cvtsh_ss(mn[n * groups + g]) : 0.0f;
            rs[b] = s;
            rm[b] = m - off * s;
        }
    }
    transpose_to_panel(ts, tstride, cols, ws, os);
    transpose_to_panel(tm, tstride, cols, wm, os);
    if (ck == 8) {   /* q8: the code bytes transposed as they are, + 128 */
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        for (int64_t k = 0; k < K; k += 64) {
            const __mmask64 live = K - k >= 64 ? ~(__mmask64)0 : ((__mmask64)1 << (K - k)) - 1;
            __m512i r[PR];
            panel_bytes(qs + n0 * row_bytes + k, row_bytes, rows, live, r, os);   /* r[c]: codes k + 4c .. k + 4c + 3 */
            const int64_t groups4 = (K - k < 64 ? K - k : 64) / 4;
            for (int64_t c = 0; c < groups4; c++)
                _mm512_store_si512((void *)(wp + (k / 4 + c) * os), _mm512_xor_si512(r[c], flip));
        }
        return;
    }
#ifdef __AVX512BITALG__
    if (ck == 5) {   /* q5, q5k: q4's transposed nibbles, and each code's bit from its block's plane (bit i: code i),
                      * the 16 rows' planes of a block in one vector, picked per byte by vpshufbitqmb */
        const __m512i lo4 = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
        const uint8_t *hb0 = quant_high_bits_at(kind, qh, K);
        for (int64_t k = 0; k < K; k += 128) {
            const int64_t blocks = (K - k) / 32 < 4 ? (K - k) / 32 : 4;
            const __mmask64 live = blocks == 4 ? ~(__mmask64)0 : ((__mmask64)1 << (16 * blocks)) - 1;
            __m512i r[PR], pl[PR];
            panel_bytes(qs + n0 * row_bytes + k / 2, row_bytes, rows, live, r, os);   /* r[4b + d]: dword d of block b */
            panel_bytes(hb0 + n0 * high_bytes + k / 32 * 4, high_bytes, rows, (__mmask64)((1u << (4 * blocks)) - 1u),
                        pl, os);                                                   /* pl[b]: block b's plane */
            for (int64_t b = 0; b < blocks; b++)
                for (int d = 0; d < 4; d++) {
                    /* byte i of dword lane 2q (2q + 1) takes bit 4d + i (+ 16 for the high nibbles) of its plane:
                     * bit 4d + i (32 + 4d + i) of qword q */
                    const uint64_t sel = (uint64_t)(4 * d) * 0x0101010101010101ull + 0x2322212003020100ull;
                    const __mmask64 mlo = _mm512_bitshuffle_epi64_mask(pl[b], _mm512_set1_epi64((long long)sel));
                    const __mmask64 mhi = _mm512_bitshuffle_epi64_mask(
                        pl[b], _mm512_set1_epi64((long long)(sel + 16 * 0x0101010101010101ull)));
                    const __m512i lo = _mm512_and_si512(r[4 * b + d], lo4);
                    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(r[4 * b + d], 4), lo4);
                    uint32_t *g = wp + (k / 4 + 8 * b + d) * os;
                    _mm512_store_si512((void *)g, _mm512_mask_add_epi8(lo, mlo, lo, sixteen));
                    _mm512_store_si512((void *)(g + 4 * os), _mm512_mask_add_epi8(hi, mhi, hi, sixteen));
                }
        }
        return;
    }
#endif
    if (ck == 4 || ck == QUANT_I4) {   /* q4, q4k, i4: the nibble bytes transposed as they are, 128 weights
                                         * (four blocks) at a time; i4's nibbles then looked up (+ 128) */
        const __m512i lo4 = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
        const __m512i values = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)QUANT_IQ4_VALUES));
        const int i4 = ck == QUANT_I4;
        for (int64_t k = 0; k < K; k += 128) {
            const int64_t blocks = (K - k) / 32 < 4 ? (K - k) / 32 : 4;
            const __mmask64 live = blocks == 4 ? ~(__mmask64)0 : ((__mmask64)1 << (16 * blocks)) - 1;
            __m512i r[PR];
            /* r[4b + d] = dword d of block b's 16 bytes in the 16 rows: codes 4d.. in the low nibbles,
             * 16 + 4d.. in the high ones */
            panel_bytes(qs + n0 * row_bytes + k / 2, row_bytes, rows, live, r, os);
            for (int64_t b = 0; b < blocks; b++)
                for (int d = 0; d < 4; d++) {
                    uint32_t *g = wp + (k / 4 + 8 * b + d) * os;
                    __m512i lo = _mm512_and_si512(r[4 * b + d], lo4), hi = _mm512_and_si512(_mm512_srli_epi16(r[4 * b + d], 4), lo4);
                    if (i4) {
                        lo = _mm512_xor_si512(_mm512_shuffle_epi8(values, lo), flip);
                        hi = _mm512_xor_si512(_mm512_shuffle_epi8(values, hi), flip);
                    }
                    _mm512_store_si512((void *)g, lo);
                    _mm512_store_si512((void *)(g + 4 * os), hi);
                }
        }
        return;
    }
    if (ck == 6) {   /* q6k: the nibble bytes and high bit pairs transposed as they are, 256 weights at a time */
        const __m512i lo4 = _mm512_set1_epi8(15), pair = _mm512_set1_epi8(0x30);
        const uint8_t *hb0 = quant_high_bits_at(kind, qh, K);
        for (int64_t k = 0; k < K; k += 256) {
            __m512i h[PR];   /* h[8t + c]: dword c of stretch t's 32 bytes of bit pairs, in the 16 rows */
            panel_bytes(hb0 + n0 * high_bytes + k / 4, high_bytes, rows, ~(__mmask64)0, h, os);
            for (int64_t t = 0; t < 2; t++) {
                __m512i r[PR];
                /* r[c]: dword c of the stretch's 64 nibble bytes, weights 4c.. (runs 0 | 1) in the low
                 * nibbles, 64 + 4c.. (runs 2 | 3) in the high ones */
                panel_bytes(qs + n0 * row_bytes + (k + 128 * t) / 2, row_bytes, rows, ~(__mmask64)0, r, os);
                for (int c = 0; c < 16; c++) {
                    const __m512i v = r[c], hp = h[8 * t + c % 8];
                    const int run = c / 8;   /* run 0 or 1 from the low nibbles, 2 or 3 from the high ones */
                    /* code = nibble | bit pair (h >> 2 * run) << 4: (A & C) | B, A the nibbles, C 0x0f */
                    const __m512i b0 = _mm512_and_si512(run ? _mm512_slli_epi16(hp, 2) : _mm512_slli_epi16(hp, 4), pair);
                    const __m512i b1 = _mm512_and_si512(run ? _mm512_srli_epi16(hp, 2) : hp, pair);
                    const int64_t g = (k + 128 * t) / 4 + 8 * run + c % 8;
                    _mm512_store_si512((void *)(wp + g * os), _mm512_ternarylogic_epi64(v, b0, lo4, 0xec));
                    _mm512_store_si512((void *)(wp + (g + 16) * os),
                                       _mm512_ternarylogic_epi64(_mm512_srli_epi16(v, 4), b1, lo4, 0xec));
                }
            }
        }
        return;
    }
    if (ck == QUANT_Q2 || ck == QUANT_Q3) {   /* the bit-pair bytes (and q3's hmask) transposed as they are, per
                                             * super-block of 256 */
        const __m512i three = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4);
        for (int64_t k = 0; k < K; k += QUANT_K2_SUPER) {
            __m512i r[PR], h[PR];
            /* r[8t + c]: dword c of stretch t's 32 bytes; byte l holds weights l, l + 32, l + 64, l + 96 of
             * the stretch in its bit pairs 0, 2, 4, 6 */
            panel_bytes(qs + n0 * row_bytes + k / 4, row_bytes, rows, ~(__mmask64)0, r, os);
            if (ck == QUANT_Q3) {
                panel_bytes(qh + n0 * high_bytes + k / QUANT_K2_SUPER * 48, high_bytes, rows, (__mmask64)0xffffffffu,
                            h, os);   /* h[c], c < 8: dword c of the hmask, bit p of byte l weight 32p + l's third bit */
            }
            for (int c = 0; c < 16; c++) {
                const int t = c / 8, cc = c % 8;
                for (int q = 0; q < 4; q++) {   /* run q of stretch t: weights 128t + 32q + 4cc .. */
                    __m512i code = _mm512_and_si512(q ? _mm512_srli_epi16(r[c], 2 * q) : r[c], three);
                    if (ck == QUANT_Q3) {
                        const int p = 4 * t + q;
                        const __m512i hb = p >= 2 ? _mm512_srli_epi16(h[cc], p - 2) : _mm512_slli_epi16(h[cc], 2 - p);
                        code = _mm512_or_si512(code, _mm512_and_si512(hb, four));
                    }
                    _mm512_store_si512((void *)(wp + (k / 4 + 32 * t + 8 * q + cc) * os), code);
                }
            }
        }
        return;
    }
    /* q5, q5k without AVX512_BITALG (Cascade Lake): each row's codes unpacked, then transposed */
    for (int64_t k = 0; k < K; k += 64) {
        __m512i r[PR];
        for (int64_t j = 0; j < PR; j++)
            r[j] = j < rows ? q5_codes64(qs + (n0 + j) * row_bytes,
                                         quant_high_bits_at(kind, qh + (n0 + j) * high_bytes, K), k, K)
                            : _mm512_setzero_si512();
        transpose16(r);   /* r[c] = dword c (codes 4c .. 4c + 3) of the 16 rows */
        const int64_t groups4 = (K - k < 64 ? K - k : 64) / 4;
        for (int64_t c = 0; c < groups4; c++) _mm512_store_si512((void *)(wp + (k / 4 + c) * os), r[c]);
    }
}

/* float32 -> bfloat16, round to nearest even: one vcvtneps2bf16 where AVX512_BF16 is; on VNNI CPUs
 * without it (Cascade Lake, Ice Lake), which could not build this file before, the same rounding in
 * integers (subnormals kept, where the instruction flushes them to zero; NaN inputs do not arise). */
static inline __attribute__((always_inline)) __m256i to_bf16x16(__m512 x) {
#ifdef __AVX512BF16__
    return (__m256i)_mm512_cvtneps_pbh(x);
#else
    const __m512i b = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16));
#endif
}

/* Panels per micro-kernel call, and rows of x for each count of panels (P panels x R rows: P * R
 * int32 and as many float32 accumulators, P weight vectors, a broadcast). Each row's broadcast of
 * 4 codes feeds P vpdpbusd, and a call over M rows of x reads x once per P panels: with every
 * operand in L1 the shapes run alike (benchmarks/i8_micro_shapes.c), but a prompt's x is in L2
 * (256 rows of SmolLM2: 144 KiB), and four panels at a time read it a quarter as often
 * (benchmarks/README.md, twenty-ninth session). */
#define NP 4
/* Fewer rows of x than this take one panel at a time: the weights' bytes weigh more against the
 * dot products, and one panel's dot products overlap the next panel's prefetched bytes (SmolLM2's
 * Q8_0 head from memory, groups of 4 against one panel: 0.82-0.86x at 4 and 8 rows, 0.92x at 16,
 * 1.04-1.09x from 24). The layouts with scales per 16 (Q6_K, Q3_K, Q2_K) always take one panel:
 * in groups of 4 they measured 0.88-0.98x at 64 rows (twice the epilogues per dot product). */
#define GROUP_FROM_ROWS 24
/* A group's codes (K bytes a weight row) must stay in L1 (48 KiB on Zen 4) while its rows of x go by
 * three at a time: against the one-panel kernel, groups measured 1.0-1.35x at K = 576 (SmolLM2),
 * 0.82-0.87x at K = 1536 and 0.89-0.95x at K = 2048 from 32 to 256 rows (twenty-ninth session). */
#define GROUP_MAX_BYTES (40 << 10)
static const int rows_for[NP + 1] = {0, MR, 6, 4, 3};

/* Panels a micro-kernel call takes for M rows of x against this layout: NP (a group) or 1. */
static int panels_per_call(int kind, int64_t K, int64_t M) {
    return M >= GROUP_FROM_ROWS && scale_form(kind) == 0 && NP * K * PR <= GROUP_MAX_BYTES ? NP : 1;
}

/* Dwords (floats) from one group of 4 codes (one block's scales) of a panel to the next: panels
 * unpacked side by side in a group, or one panel alone. */
static inline int64_t panel_stride(int grouped) { return grouped ? NP * PR : PR; }

/* out rows [m0, m0 + R) of P panels' 16 columns each (panel p: columns n0 + 16p, its codes,
 * scales and minimums at wp, ws, wm + 16p, each group of 4 codes (each block's scales) PR from the
 * last, or NP * PR when `grouped`: the layout panel_rows unpacked them in, which a group's last
 * panel alone (P = 1) keeps; the last panel's valid columns `keep`).
 * per16 1 (q6k, q3): the weights' scales are per 16, w = s * (u - zero16);
 * each 16's dot starts at -zero16 * sum16 (its int8 sum of x), so it is exactly
 * sum (u - zero16) * xq, and adds dot * (s * dx); per16 2 (q2): and its minimum m * xs16
 * (dx * sum16). Every output is the one-panel kernel's, bit for bit (the same operations in the
 * same order per output). */
static inline __attribute__((always_inline)) void
micro(const int P, const int R, const int per16, const int grouped, const int zero16, const int8_t *xq,
      const float *dx, const float *xs, const int32_t *sum16, const float *xs16, const uint32_t *wp, const float *ws,
      const float *wm, int64_t K, int64_t m0, void *out, int bf16_out, int64_t N, int64_t n0, __mmask16 keep) {
    const int64_t os = panel_stride(grouped);   /* a constant here: in a register it cost 7-10 % */
    const int64_t nb = K / 32;
    __m512 acc[MR][NP];
    for (int i = 0; i < R; i++)
        for (int p = 0; p < P; p++) acc[i][p] = _mm512_setzero_ps();
    const int bl = per16 ? 16 : 32;   /* weights a scale covers: the dot's span */
    for (int64_t b = 0; b < K / bl; b++) {
        __m512i dot[MR][NP];
        for (int i = 0; i < R; i++) {
            const __m512i start =
                per16 ? _mm512_set1_epi32(-zero16 * sum16[(m0 + i) * 2 * nb + b]) : _mm512_setzero_si512();
            for (int p = 0; p < P; p++) dot[i][p] = start;
        }
#pragma GCC unroll 8
        for (int g = 0; g < bl / 4; g++) {   /* unrolled: a loop kept the dots in rotating register copies */
            __m512i w[NP];
            for (int p = 0; p < P; p++) w[p] = _mm512_load_si512((const void *)(wp + (b * (bl / 4) + g) * os + p * PR));
            for (int i = 0; i < R; i++) {
                int32_t xv;
                memcpy(&xv, xq + (m0 + i) * K + b * bl + g * 4, 4);
                const __m512i xb = _mm512_set1_epi32(xv);
                for (int p = 0; p < P; p++) dot[i][p] = _mm512_dpbusd_epi32(dot[i][p], w[p], xb);
            }
        }
        for (int i = 0; i < R; i++) {
            const __m512 d = _mm512_set1_ps(dx[(m0 + i) * nb + (per16 ? b / 2 : b)]);
            for (int p = 0; p < P; p++) {
                const __m512 sd = _mm512_mul_ps(_mm512_load_ps(ws + b * os + p * PR), d);
                acc[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][p]), sd, acc[i][p]);
                if (per16 != 1)   /* the minimum term: per 32 (xs), or q2's per 16 (xs16) */
                    acc[i][p] = _mm512_fmadd_ps(
                        _mm512_load_ps(wm + b * os + p * PR),
                        _mm512_set1_ps(per16 ? xs16[(m0 + i) * 2 * nb + b] : xs[(m0 + i) * nb + b]), acc[i][p]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int p = 0; p < P; p++) {
            const __mmask16 k = p == P - 1 ? keep : (__mmask16)0xffff;
            const int64_t at = (m0 + i) * N + n0 + p * PR;
            if (bf16_out)
                _mm256_mask_storeu_epi16((uint16_t *)out + at, k, to_bf16x16(acc[i][p]));
            else
                _mm512_mask_storeu_ps((float *)out + at, k, acc[i][p]);
        }
}

/* rows (<= rows_for[P]) of x against P panels: a constant P, R and form of the scales (per 32,
 * per 16, per 16 with minimums), so the loops unroll into registers. */
static void micro_rows(int P, int grouped, int64_t rows, int per16, int zero16, const int8_t *xq, const float *dx,
                       const float *xs, const int32_t *sum16, const float *xs16, const uint32_t *wp, const float *ws,
                       const float *wm, int64_t K, int64_t m0, void *out, int bf16_out, int64_t N, int64_t n0,
                       __mmask16 keep) {
#define ROWS(PP, R, Z, G) micro(PP, R, Z, G, zero16, xq, dx, xs, sum16, xs16, wp, ws, wm, K, m0, out, bf16_out, N, n0, \
                                keep); \
    break;
#define CASES1(Z, G) switch (rows) { \
    case 1: ROWS(1, 1, Z, G) case 2: ROWS(1, 2, Z, G) case 3: ROWS(1, 3, Z, G) case 4: ROWS(1, 4, Z, G) \
    case 5: ROWS(1, 5, Z, G) case 6: ROWS(1, 6, Z, G) case 7: ROWS(1, 7, Z, G) case 8: ROWS(1, 8, Z, G) \
    case 9: ROWS(1, 9, Z, G) default: ROWS(1, MR, Z, G) }
#define CASES2(Z) switch (rows) { \
    case 1: ROWS(2, 1, Z, 1) case 2: ROWS(2, 2, Z, 1) case 3: ROWS(2, 3, Z, 1) case 4: ROWS(2, 4, Z, 1) \
    case 5: ROWS(2, 5, Z, 1) default: ROWS(2, 6, Z, 1) }
#define CASES3(Z) switch (rows) { \
    case 1: ROWS(3, 1, Z, 1) case 2: ROWS(3, 2, Z, 1) case 3: ROWS(3, 3, Z, 1) default: ROWS(3, 4, Z, 1) }
#define CASES4(Z) switch (rows) { case 1: ROWS(4, 1, Z, 1) case 2: ROWS(4, 2, Z, 1) default: ROWS(4, 3, Z, 1) }
#define PANELS(Z) switch (P) { \
    case 1: if (grouped) { CASES1(Z, 1) } else { CASES1(Z, 0) } break; \
    case 2: CASES2(Z) break; case 3: CASES3(Z) break; default: CASES4(Z) break; }
    if (per16 == 0) {
        PANELS(0)
    } else if (per16 == 1) {
        PANELS(1)
    } else {
        PANELS(2)
    }
#undef PANELS
#undef CASES4
#undef CASES3
#undef CASES2
#undef CASES1
#undef ROWS
}

/* The activations of M rows as pipeserve_quant_i8m_prepare leaves them in `act`: xq [M][K] int8,
 * then dx and xs [M][K / 32] float32, then per 16 sum16 [M][K / 16] int32 (q6k's, q3's) and xs16
 * float32 (q2's). One layout for every kind: a fused linear's parts share it. */
static void act_parts(const void *act, int64_t K, int64_t M, int8_t **xq, float **dx, float **xs, int32_t **sum16,
                      float **xs16) {
    char *p = (char *)act;
    *xq = (int8_t *)p;
    *dx = (float *)(p + (M * K + 63) / 64 * 64);
    *xs = *dx + M * (K / 32);
    *sum16 = (int32_t *)(*xs + M * (K / 32));
    *xs16 = (float *)(*sum16 + M * (K / 16));
}

/* A thread's panel scratch, kept between calls (grown as needed; OpenMP's threads persist). */
static __thread char *panel_buf;
static __thread int64_t panel_cap;

/* Floats a row of unpack_panel's row-major scales takes: K / 16 (per 16), rounded up to 16. */
static int64_t scale_stride(int64_t K) { return (K / 16 + 15) / 16 * 16; }

/* NP panels side by side: codes [K / 4][NP * PR] dwords, scales and minimums [K / 16][NP * PR] floats each
 * (room for per 16), then unpack_panel's row-major scales and minimums. */
static char *panel_scratch(int64_t K) {
    const int64_t need = (K / 4) * NP * PR * 4 + 4 * (K / 32) * NP * PR * 4 + 2 * PR * scale_stride(K) * 4 + 3 * 64;
    if (need > panel_cap) {
        free(panel_buf);
        panel_buf = aligned_alloc(64, (size_t)(need + 63) / 64 * 64);
        panel_cap = panel_buf ? need : 0;
    }
    return panel_buf;
}

/* out[m, n] (row stride N) for m < M and n in [n0, n1): panels of PR weight rows from n0. */
static int panel_rows(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N, int64_t K,
                      int64_t group, const uint8_t *qh, int zero, const void *act, int64_t M, int64_t n0, int64_t n1,
                      void *out, int bf16_out) {
    const int64_t nb = K / 32;
    char *buf = panel_scratch(K);
    if (!buf) return -1;
    const int per16 = scale_form(kind);
    const int np = panels_per_call(kind, K, M);
    const int64_t os = panel_stride(np > 1);
    uint32_t *wp = (uint32_t *)buf;
    float *ws = (float *)(buf + (K / 4) * os * 4);
    float *wm = ws + 2 * nb * os, *ts = wm + 2 * nb * os;   /* room for scales and minimums per 16 */
    const int64_t tstride = scale_stride(K);
    int8_t *xq;
    float *dx, *xs;
    int32_t *sum16;
    float *xs16;
    act_parts(act, K, M, &xq, &dx, &xs, &sum16, &xs16);
    for (int64_t p0 = n0; p0 < n1; p0 += np * PR) {   /* up to np panels at a time */
        int P = 0;
        int64_t cols = PR;
        for (; P < np && p0 + P * PR < n1; P++) {
            cols = n1 - (p0 + P * PR) < PR ? n1 - (p0 + P * PR) : PR;
            unpack_panel(kind, qs, sc, mn, cols, K, group, p0 + P * PR, zero, qh, wp + P * PR, ws + P * PR,
                         wm + P * PR, ts, ts + PR * tstride, tstride, os);
        }
        const __mmask16 keep = (__mmask16)((1u << cols) - 1u);   /* the last panel's columns */
        const int64_t R = rows_for[P];
        for (int64_t m0 = 0; m0 < M; m0 += R)
            micro_rows(P, np > 1, M - m0 < R ? M - m0 : R, per16, zero, xq, dx, xs, sum16, xs16, wp, ws, wm, K, m0,
                       out, bf16_out, N, p0, keep);   /* np > 1: a group's layout, even for its last panel alone */
    }
    return 0;
}
#endif

/* Two phases, for callers that run their own threads (decode_stage.c, as quant_matmul.c's gemv):
 * the bytes of M rows' prepared activations (0: a layout this kernel does not take, or fewer rows
 * than it is taken from, pipeserve_quant_gemm_i8_from), the rows
 * quantized into them (float32 x, one thread), and out [M, N] float32 columns [n0, n1). */
static int64_t act_size(int64_t K, int64_t M) {   /* act_parts' layout */
    return (M * K + 63) / 64 * 64 + 2 * M * (K / 32) * (int64_t)sizeof(float)
           + 2 * M * (K / 16) * (int64_t)sizeof(float);   /* sum16 (int32) and xs16 */
}

int64_t pipeserve_quant_i8m_act_bytes(int kind, int64_t K, int64_t group, int64_t M) {
    if (!pipeserve_quant_gemm_i8_takes(kind, K, group) || M < pipeserve_quant_gemm_i8_from(kind)) return 0;
    return act_size(K, M);
}

void pipeserve_quant_i8m_prepare(int kind, int64_t K, const float *x, int64_t M, void *act) {
    (void)kind;
#ifdef I8_GEMM
    int8_t *xq;
    float *dx, *xs;
    int32_t *sum16;
    float *xs16;
    act_parts(act, K, M, &xq, &dx, &xs, &sum16, &xs16);
    quantize_rows(x, 0, K, 0, M, xq, dx, xs, sum16, xs16);
#else
    (void)K; (void)x; (void)M; (void)act;
#endif
}

/* Returns 0, or -1 when the thread's panel scratch cannot be allocated (out is then not written). */
int pipeserve_quant_i8m_rows(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N, int64_t K,
                             int64_t group, const uint8_t *qh, int zero, const void *act, int64_t M, int64_t n0,
                             int64_t n1, float *out) {
#ifdef I8_GEMM
    return panel_rows(kind, qs, sc, mn, N, K, group, qh, zero, act, M, n0, n1, out, 0);
#else
    (void)kind; (void)qs; (void)sc; (void)mn; (void)N; (void)K; (void)group; (void)qh; (void)zero; (void)act;
    (void)M; (void)n0; (void)n1; (void)out;
    return -2;
#endif
}

int pipeserve_quant_gemm_i8(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N,
                            int64_t K, int64_t group, const void *x, int bf16_in, int64_t M, void *out, int bf16_out,
                            int num_threads, const uint8_t *qh, int zero) {
#ifdef I8_GEMM
    if (!pipeserve_quant_gemm_i8_takes(kind, K, group)) return -3;
    if (M <= 0 || N <= 0) return 0;
    const int64_t cols = panels_per_call(kind, K, M) * PR;   /* a thread's share: whole micro-kernel calls */
    const int64_t chunks = (N + cols - 1) / cols;
    void *act = aligned_alloc(64, (size_t)(act_size(K, M) + 63) / 64 * 64);
    if (!act) return -1;
    int8_t *xq;
    float *dx, *xs;
    int32_t *sum16;
    float *xs16;
    act_parts(act, K, M, &xq, &dx, &xs, &sum16, &xs16);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) quantize_rows(x, bf16_in, K, m, m + 1, xq, dx, xs, sum16, xs16);
#pragma omp for schedule(static)
        for (int64_t pn = 0; pn < chunks; pn++) {
            const int64_t n0 = pn * cols, n1 = N - n0 < cols ? N : n0 + cols;
            if (panel_rows(kind, qs, sc, mn, N, K, group, qh, zero, act, M, n0, n1, out, bf16_out) != 0) {
#pragma omp atomic write
                failed = 1;
            }
        }
    }
    free(act);
    return failed ? -1 : 0;
#else
    (void)kind; (void)qs; (void)sc; (void)mn; (void)N; (void)K; (void)group; (void)x; (void)bf16_in; (void)M;
    (void)out; (void)bf16_out; (void)num_threads; (void)qh; (void)zero;
    return -2;
#endif
}
