/* Compact 5/6-bit codes of kept-quantized weights (layouts "q5" / "q6",
 * pipeserve/model/quant/packed.py), IQ4's 4-bit codebook indices (layout "i4") and Q2_K's /
 * Q3_K's 2/3-bit codes (layouts "q2" / "q3") expanded into int8 codes, the "q8" layout.
 *
 * q5: a row of K weights is K / 2 nibble bytes (per run of 32: byte j holds weight j
 * low, weight j + 16 high) and K / 32 * 4 bytes of high bits (per run a little-endian
 * 32-bit plane, bit j = bit 4 of weight j).
 * q6 keeps GGUF Q6_K's own code bytes: per 128 weights (QUANT_Q6_HALF) 64 nibble bytes, byte l
 * holding weight l low and weight 64 + l high, and 32 bytes of high bit pairs, byte l holding
 * bits 4-5 of weights l, 32 + l, 64 + l, 96 + l in its bit pairs 0, 2, 4, 6. So run r's 32 codes
 * (weights 32r ..) are one 32-byte nibble load shifted by 4 * (r % 4 / 2), masked, or'ed with
 * one 32-byte load of high bits shifted into bits 4-5: five instructions, and a 64-weight chunk's
 * three (quant_matmul.c's chunk_codes6), against the 7-16 of bit-planes (measured: benchmarks/README.md).
 * code = nibble | high bits << 4, minus `zero`. i4 is q4's nibbles alone, each an index into
 * IQ4's 16 signed values (QUANT_IQ4_VALUES; code = value[nibble], no `zero`): one byte
 * shuffle per 32 weights on AVX2, as llama.cpp does. quant_expand_row serves the float
 * decode and tiled paths (a row into an L1 scratch row, then their q8 code); the VNNI
 * decode path (quant_matmul.c, chunk_codes_hb / chunk_codes6), the AVX2 decode path (quant_gemv_avx2.h:
 * quant_q5_codes32_avx2 / quant_q6_codes32_avx2) and the many-row kernel
 * (quant_gemm.c, dequant32) expand in registers. Either way the weights cross the memory bus at
 * 4.5-7 bits each (i4: 4.5).
 *
 * q2 / q3 keep GGUF Q2_K's / Q3_K's own code bytes: per 128 weights 32 bytes, byte l holding
 * weights l, l + 32, l + 64, l + 96 in its bit pairs 0, 2, 4, 6 (so run r's 32 codes are one
 * 32-byte load shifted right by 2 * (r % 4), masked with 3); q3's qh holds per 256 weights
 * (QUANT_K2_SUPER) Q3_K's hmask, 32 bytes, bit p of byte l the third bit of weight 32p + l (run r:
 * bit r % 8 of the 32 bytes), then its 16 sub-scales (int8); q2's qh the 16 sub-scale bytes alone
 * (quant_k2_high). code = low | high << 2, minus `zero` (Q3_K: 4). Three (q2) or six (q3)
 * instructions a run on AVX2, against the two of q5; 2.6 / 3.6 bits a weight cross the bus,
 * sub-scales included (quant_k2.h takes those).
 * Every build takes all seven layouts, and q4 / q5 / q6 with Q4_K's / Q5_K's / Q6_K's two-level scales
 * (quant_takes_kind).
 * AVX-512 builds expand i4, q2 and q3 with
 * the AVX2 code here (quant_later_codes32_avx2): their VNNI decode takes AVX2's int8 kernels for
 * them (quant_matmul.c, AVX2_LATER), their float paths quant_expand_row, the bfloat16 many-row
 * kernel (quant_gemm.c) dequant32; the VNNI chunk expansions are q5's and q6's alone.
 */
#ifndef PIPESERVE_QUANT_CODES_H
#define PIPESERVE_QUANT_CODES_H

#include <stdint.h>
#include <string.h>

#include "half.h"
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* Layout kinds as the C functions take them: 4 q4, 8 q8, 5 q5, 6 q6, QUANT_I4 i4, 2 q2, 3 q3,
 * QUANT_Q4K q4 with Q4_K's two-level scales, QUANT_Q5K q5 with Q5_K's, QUANT_Q6K q6 with Q6_K's
 * (below). */
#define QUANT_I4 9
#define QUANT_Q2 2
#define QUANT_Q3 3
#define QUANT_Q4K 10
#define QUANT_Q6K 11
#define QUANT_Q5K 12
static const int8_t QUANT_IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* Whether the codes are expanded into q8's int8 codes where they are computed with. */
static inline int quant_is_compact(int kind) {
    return kind == 5 || kind == 6 || kind == QUANT_Q5K || kind == QUANT_Q6K || kind == QUANT_I4 || kind == QUANT_Q2 || kind == QUANT_Q3;
}
/* An i4 run's 32 codebook values from its 16 bytes, in weight order (low nibbles, then high
 * ones), one table lookup each: the portable expansion, and gguf_widen.c's widening of IQ4 to q8. */
static inline void quant_i4_run(const uint8_t *q, int8_t *dst) {
    for (int j = 0; j < 16; j++) {
        dst[j] = QUANT_IQ4_VALUES[q[j] & 15];
        dst[j + 16] = QUANT_IQ4_VALUES[q[j] >> 4];
    }
}

/* Bits above the nibble: 1 for q5, 2 for q6, else 0. */
static inline int quant_high_bits(int kind) { return kind == 5 || kind == 6 ? kind - 4 : 0; }

/* q6: weights in one self-contained stretch of nibble and high-bit bytes (64 + 32); rows are a
 * multiple of it (packed.py checks). */
#define QUANT_Q6_HALF 128
/* q6 weight k's raw code (0..63): the portable expansion, and the reference of the others. */
static inline int quant_q6_code(const uint8_t *qs, const uint8_t *qh, int64_t k) {
    const int64_t h = k / QUANT_Q6_HALF, l = k % QUANT_Q6_HALF;
    const int nib = (qs[h * 64 + l % 64] >> (4 * (int)(l / 64))) & 15;
    return nib | ((qh[h * 32 + l % 32] >> (2 * (int)(l / 32))) & 3) << 4;
}

/* Whether this build's kernels take layout `kind` (every build takes all ten). */
static inline int quant_takes_kind(int kind) {
    return kind == 4 || kind == 8 || kind == QUANT_Q4K || quant_is_compact(kind);   /* q5k, q6k: compact */
}

/* q4k (packed.py's q4 with qh): q4's codes, and Q4_K's scales as the file holds them: per 256
 * weights (QUANT_Q4K_SUPER) a float16 d in `sc` and -dmin in `mn`, and 16 bytes in `qh`, the
 * eight 6-bit sub-scales of its runs of 32, then their eight sub-minimums: 4.625 bits a weight,
 * where q4's float16 scale and minimum per 32 took 5. Run r's scale is d * sub and its minimum
 * -dmin * min in float32, exact (a float16 times an integer below 64; as ggml dequantizes them,
 * and packed.py's dequantize): the integer decode paths compute them in registers (quant_matmul.c's
 * q4k_block_scales, quant_gemv_avx2.h's q4k_run_scales); the float, dequantize and bfloat16
 * many-row paths expand a row's (or a panel's) into float32 scratch (quant_q4k_scales) and read
 * them where q4 reads its float16 ones (quant_scale_at). */
#define QUANT_Q4K_SUPER 256
#define QUANT_Q4K_HIGH 16
static inline int q4k_shape_ok(int64_t K, int64_t group) { return K % QUANT_Q4K_SUPER == 0 && group == 32; }
/* q6k (packed.py's q6 with two-level scales): q6's codes and high bits, and Q6_K's scales as the
 * file holds them: a float16 d per 256 weights in `sc`, and its sixteen int8 sub-scales (one per
 * 16 weights) in `qh` before the row's high bits (a row's qh: K / 16 bytes of sub-scales, then K / 4
 * of high bits; so a row is read forward: with them after the high bits, the jump back from them to
 * the high bits at every 16 blocks cost a q6 decode from memory ~25 %): 6.5625 bits a weight, the
 * file's, where a float16 scale per 16 took 7. Group g's scale is d * sub_g in float32, exact; no
 * minimums. Taken as q4k's: in registers on the integer decodes, float32 scratch elsewhere. */
static inline int q6k_shape_ok(int64_t K, int64_t group) { return K % QUANT_Q4K_SUPER == 0 && group == 16; }
/* q5k (packed.py's q5 with two-level scales): q5's codes and high-bit planes, and Q5_K's scales
 * as q4k holds Q4_K's (the same two levels: d, -dmin per 256 in `sc`, `mn`, and per 256 the eight
 * 6-bit sub-scales then the eight sub-minimums), a row's 16-byte groups of them in `qh` before its
 * high-bit planes (K / 16 bytes, then K / 8; forward, as q6k): 5.625 bits a weight (the file 5.5),
 * where a float16 scale and minimum per 32 took 6. Its scales are q4k's everywhere (quant_k4_scales). */
/* The two-level layouts, and the scales a row of one holds in `sc` (one per 256 weights). */
static inline int quant_two_level(int kind) { return kind == QUANT_Q4K || kind == QUANT_Q5K || kind == QUANT_Q6K; }
/* The layouts whose scales are Q4_K's two levels (d, -dmin and 16 sub-scale bytes per 256): q4k, q5k. */
static inline int quant_k4_scales(int kind) { return kind == QUANT_Q4K || kind == QUANT_Q5K; }
/* Whether K and group fit the layout: the two-level ones hold whole super-blocks of 256, in
 * groups of 32 (q4k, q5k) or 16 (q6k). */
static inline int quant_shape_ok(int kind, int64_t K, int64_t group) {
    return quant_k4_scales(kind) ? q4k_shape_ok(K, group) : kind == QUANT_Q6K ? q6k_shape_ok(K, group) : 1;
}
/* The layout whose codes a kernel computes with (q4k: q4's, q5k: q5's, q6k: q6's). */
static inline int quant_codes_kind(int kind) {
    return kind == QUANT_Q4K ? 4 : kind == QUANT_Q5K ? 5 : kind == QUANT_Q6K ? 6 : kind;
}
/* q6k row `qh`'s sub-scales (its first K / 16 bytes), and any row's high bits (q5k, q6k: after
 * their K / 16 bytes of sub-scales). */
static inline const int8_t *quant_q6k_sub(const uint8_t *qh, int64_t K) { (void)K; return (const int8_t *)qh; }
static inline const uint8_t *quant_high_bits_at(int kind, const uint8_t *qh, int64_t K) {
    return (kind == QUANT_Q6K || kind == QUANT_Q5K) && qh ? qh + K / 16 : qh;
}
/* Scales (and minimums) a row holds in `sc` (`mn`): one per super-block for the two-level
 * layouts, one per group otherwise. */
static inline int64_t quant_scales_per_row(int kind, int64_t K, int64_t group) {
    return quant_two_level(kind) ? K / QUANT_Q4K_SUPER : K / group;
}

/* One q4k / q5k row of K weights (sc, mn, qh at it): its scales and minimums per run of 32 in
 * float32, K / 32 of each, into s and b. */
static inline void quant_q4k_scales(const uint16_t *sc, const uint16_t *mn, const uint8_t *qh, int64_t K, float *s,
                                    float *b) {
    for (int64_t i = 0; i < K / QUANT_Q4K_SUPER; i++) {
        const uint8_t *h = qh + i * QUANT_Q4K_HIGH;
#if defined(__F16C__) && defined(__AVX2__)
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(sc[i])), m = _mm256_set1_ps(_cvtsh_ss(mn[i]));
        _mm256_storeu_ps(s + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
            _mm_loadl_epi64((const __m128i *)h)))));
        _mm256_storeu_ps(b + 8 * i, _mm256_mul_ps(m, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
            _mm_loadl_epi64((const __m128i *)(h + 8))))));
#else
        const float d = half_to_float(sc[i]), m = half_to_float(mn[i]);
        for (int j = 0; j < 8; j++) {
            s[8 * i + j] = d * (float)h[j];
            b[8 * i + j] = m * (float)h[8 + j];
        }
#endif
    }
}

/* The cases of a switch over `kind` that instantiates a row kernel per layout (ALL(k): k a
 * constant there) for the layouts with scales per group: q4, q4k, q5, q5k, q6, q6k. */
#define QUANT_GROUP_KIND_CASES(ALL) \
    case 4: ALL(4) break; \
    case QUANT_Q4K: ALL(QUANT_Q4K) break; \
    case 5: ALL(5) break; \
    case QUANT_Q5K: ALL(QUANT_Q5K) break; \
    case 6: ALL(6) break; \
    case QUANT_Q6K: ALL(QUANT_Q6K) break;

/* One q6k row (sc, qh at it): its scales per 16 weights in float32, K / 16 of them, into s. */
static inline void quant_q6k_scales(const uint16_t *sc, const uint8_t *qh, int64_t K, float *s) {
    const int8_t *sub = quant_q6k_sub(qh, K);
    for (int64_t i = 0; i < K / QUANT_Q4K_SUPER; i++) {
#if defined(__F16C__) && defined(__AVX2__)
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(sc[i]));
        _mm256_storeu_ps(s + 16 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)(sub + 16 * i))))));
        _mm256_storeu_ps(s + 16 * i + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64((const __m128i *)(sub + 16 * i + 8))))));
#else
        const float d = half_to_float(sc[i]);
        for (int j = 0; j < 16; j++) s[16 * i + j] = d * (float)sub[16 * i + j];
#endif
    }
}

/* A run's scale (or minimum) g: float16, or (f32: the two-level layouts' scratch) float32. */
static inline float quant_scale_at(const uint16_t *p, int64_t g, int f32) {
#if defined(__F16C__)
    return f32 ? ((const float *)p)[g] : _cvtsh_ss(p[g]);
#else
    return f32 ? ((const float *)p)[g] : half_to_float(p[g]);
#endif
}

/* q2/q3: weights per super-block (a float16 scale, 16 integer sub-scales), and the qh bytes of one. */
#define QUANT_K2_SUPER 256
static inline int64_t quant_k2_high(int kind) { return kind == QUANT_Q3 ? 48 : 16; }
/* Group g's (of 16) scale d * sub and minimum -dmin * min in super-block qh bytes `h`, from its
 * float d and m (q3, or q2 without minimums: m 0). Exact: a float16 times an integer below 64. */
static inline void quant_k2_group(int kind, const uint8_t *h, int g, float d, float m, float *s, float *b) {
    *s = kind == QUANT_Q3 ? d * (float)(int8_t)h[32 + g] : d * (float)(h[g] & 15);
    *b = kind == QUANT_Q3 ? 0.0f : m * (float)(h[g] >> 4);
}

/* Bytes of one row's codes in `qs` (nibbles for q4/q5/q6/i4, bit pairs for q2/q3) and in `qh`
 * (high-bit planes; q2/q3: the sub-scales, q3's hmask before them). */
static inline int64_t quant_row_bytes(int kind, int64_t K) {
    return kind == 8 ? K : kind == QUANT_Q2 || kind == QUANT_Q3 ? K / 4 : K / 2;
}
static inline int64_t quant_high_row_bytes(int kind, int64_t K) {
    if (kind == QUANT_Q2 || kind == QUANT_Q3) return K / QUANT_K2_SUPER * quant_k2_high(kind);
    if (kind == QUANT_Q4K) return K / QUANT_Q4K_SUPER * QUANT_Q4K_HIGH;
    if (kind == QUANT_Q6K) return K / 16 + K / 4;   /* the sub-scales, then q6's high bits */
    if (kind == QUANT_Q5K) return K / 16 + K / 8;   /* q4k's sub-scales, then q5's planes */
    return K / 8 * quant_high_bits(kind);
}

/* Two-level row n of K weights: its float32 scales into s, and (q4k, q5k) its minimums into b
 * (q4k / q5k: K / 32 each, q6k: K / 16 scales): what the float, dequantize and bfloat16 many-row
 * paths read where the other layouts' float16 ones are. */
static inline void quant_two_level_row(int kind, const uint16_t *sc, const uint16_t *mn, const uint8_t *qh,
                                       int64_t K, int64_t n, float *s, float *b) {
    const int64_t sup = K / QUANT_Q4K_SUPER;
    const uint8_t *h = qh + n * quant_high_row_bytes(kind, K);
    if (kind == QUANT_Q6K) quant_q6k_scales(sc + n * sup, h, K, s);
    else quant_q4k_scales(sc + n * sup, mn + n * sup, h, K, s, b);
}

/* q2/q3 run r's 32 codes (weights 32r .. 32r + 31 of the row), low | high << 2 - zero, the
 * hmask (q3) `hstride` bytes a super-block: the portable expansion, and gguf_widen.c's widening
 * of Q2_K / Q3_K to q8. */
static inline void quant_k2_run(const uint8_t *qs, const uint8_t *qh, int64_t hstride, int zero, int64_t r,
                                int8_t *dst) {
    const uint8_t *lo = qs + r / 4 * 32, *hi = qh ? qh + r / 8 * hstride : NULL;
    const int shift = 2 * (int)(r % 4), bit = (int)(r % 8);
    for (int l = 0; l < 32; l++)
        dst[l] = (int8_t)((((lo[l] >> shift) & 3) | (hi ? ((hi[l] >> bit) & 1) << 2 : 0)) - zero);
}

#if defined(__AVX2__)
#include <immintrin.h>

/* Where the decode gemvs prefetch the weight rows they read next (quant_matmul.c's rows_i8,
 * quant_gemv_avx2.h's prefetch_row): into L2, not L1. A row's worth of L1 prefetches at once
 * (up to 40 lines) fills the core's miss buffers and stalls the loads the gemv is waiting on;
 * into L2 the same lines arrive as the L2 streamer's do. One decode token's gemvs of a Llama
 * Q8_0 / Q4_K_M file from memory, Zen 4: 45.2 -> 29.2 ms / 40.6 -> 31-37 ms at one thread,
 * Q4_K_M 29.3 -> 24.0 ms at two; the AVX2 build there 31.5 -> 27.2 ms (benchmarks/README.md). */
#define QUANT_PREFETCH_HINT _MM_HINT_T1

/* Run r's 32 nibbles as bytes, in weight order: the low halves, then the high halves of its 16 bytes. */
static inline __attribute__((always_inline)) __m256i quant_nibbles32_avx2(const uint8_t *qs, int64_t r) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(qs + r * 16));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
}

/* The 32 codes of q5 run r as int8 (code - zero), in weight order: the nibbles plus the plane's bit, spread to a byte per
 * weight by a byte shuffle (byte j / 8 of the plane to byte j) and a compare with bit j % 8. */
static inline __attribute__((always_inline)) __m256i
quant_q5_codes32_avx2(const uint8_t *qs, const uint8_t *qh, int zero, int64_t r) {
    const __m256i c = quant_nibbles32_avx2(qs, r);
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                             0x0101010101010101, 0x0000000000000000);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    uint32_t plane;
    memcpy(&plane, qh + r * 4, 4);
    const __m256i sel = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)plane), spread), bit);
    const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi8(sel, bit), _mm256_set1_epi8(16));
    return _mm256_sub_epi8(_mm256_add_epi8(c, high), _mm256_set1_epi8((char)zero));
}

/* The 32 raw codes (0..63, nothing subtracted) of q6 run r in weight order: its stretch's nibble
 * bytes (weights 0-63 low, 64-127 high) shifted into place and masked, or'ed with its high-bit
 * bytes' pair r % 4 shifted to bits 0-1 (a 16-bit shift: what crosses from the next byte lands
 * above bit 1), masked and shifted to bits 4-5. Shift counts from a register, not immediates:
 * as a four-way choice of immediates, the AVX2 gemv (run r a loop variable) took 8.0 cycles a
 * block against 5.1 for the bit-planes; this way 3.9 (Zen 4, -march=haswell). */
static inline __attribute__((always_inline)) __m256i
quant_q6_codes32_avx2(const uint8_t *qs, const uint8_t *qh, int64_t r) {
    const int k = (int)(r % 4);
    const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + r / 4 * 64 + 32 * (k & 1)));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(qh + r / 4 * 32));
    const __m256i nib = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(4 * (k >> 1))), _mm256_set1_epi8(15));
    const __m256i top = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * k)), _mm256_set1_epi8(3));
    return _mm256_or_si256(nib, _mm256_slli_epi16(top, 4));
}

/* The 32 int8 codebook values of i4 run r, in weight order: its nibbles looked up in one
 * vpshufb, the 16 values in each 128-bit lane. */
static inline __attribute__((always_inline)) __m256i quant_i4_codes32_avx2(const uint8_t *qs, int64_t r) {
    const __m256i idx = quant_nibbles32_avx2(qs, r);
    const __m128i values = _mm_loadu_si128((const __m128i *)QUANT_IQ4_VALUES);
    return _mm256_shuffle_epi8(_mm256_set_m128i(values, values), idx);
}

/* The 32 raw codes (nothing subtracted) of q2 / q3 run r in weight order: the bit pairs of the
 * run's 32-byte group shifted into place, and q3's hmask bit (r % 8) of each byte as 4. */
static inline __attribute__((always_inline)) __m256i
quant_k2_codes32_avx2(int kind, const uint8_t *qs, const uint8_t *qh, int64_t r) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + r / 4 * 32));
    __m256i c = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * (int)(r % 4))), _mm256_set1_epi8(3));
    if (kind == QUANT_Q3) {
        /* bit p = r % 8 of each hmask byte to bit 2: a 16-bit shift by p - 2 (or 2 - p) moves no
         * bit across a byte boundary into bit 2 of either byte (immediates where r % 8 is constant) */
        const __m256i h = _mm256_loadu_si256((const __m256i *)(qh + r / 8 * 48));
        const int p = (int)(r % 8);
        const __m256i hb = p >= 2 ? _mm256_srl_epi16(h, _mm_cvtsi32_si128(p - 2))
                                  : _mm256_sll_epi16(h, _mm_cvtsi32_si128(2 - p));
        c = _mm256_or_si256(c, _mm256_and_si256(hb, _mm256_set1_epi8(4)));
    }
    return c;
}

/* The 32 int8 codes (code - zero) of i4 / q2 / q3 run r in weight order: what a q8 row holds.
 * AVX-512 builds take these AVX2 expansions too (quant_expand_row). */
static inline __attribute__((always_inline)) __m256i
quant_later_codes32_avx2(int kind, const uint8_t *qs, const uint8_t *qh, int zero, int64_t r) {
    if (kind == QUANT_I4) return quant_i4_codes32_avx2(qs, r);
    return _mm256_sub_epi8(quant_k2_codes32_avx2(kind, qs, qh, r), _mm256_set1_epi8((char)zero));
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)   /* -mavx512f implies AVX2 */

static inline void quant_expand_row(int kind, const uint8_t *qs, const uint8_t *qh, int zero, int64_t K, int8_t *dst) {
    if (kind != 5) {   /* i4, q2, q3, q6: AVX2's expansions */
        const __m256i z = _mm256_set1_epi8((char)zero);
        for (int64_t r = 0; r < K / 32; r++)
            _mm256_storeu_si256((__m256i *)(dst + r * 32),
                                kind == 6 ? _mm256_sub_epi8(quant_q6_codes32_avx2(qs, qh, r), z)
                                          : quant_later_codes32_avx2(kind, qs, qh, zero, r));
        return;
    }
    const __m256i lo4 = _mm256_set1_epi8(15), z = _mm256_set1_epi8((char)zero), b4 = _mm256_set1_epi8(16);
    for (int64_t r = 0; r < K / 32; r++) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(qs + r * 16));
        const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
        uint32_t p0;
        memcpy(&p0, qh + r * 4, 4);
        const __m256i c = _mm256_and_si256(both, lo4);
        _mm256_storeu_si256((__m256i *)(dst + r * 32), _mm256_sub_epi8(_mm256_mask_add_epi8(c, (__mmask32)p0, c, b4), z));
    }
}

#elif defined(__AVX2__)

static inline void quant_expand_row(int kind, const uint8_t *qs, const uint8_t *qh, int zero, int64_t K, int8_t *dst) {
    for (int64_t r = 0; r < K / 32; r++) {
        const __m256i c = kind == 6 ? _mm256_sub_epi8(quant_q6_codes32_avx2(qs, qh, r), _mm256_set1_epi8((char)zero))
                        : kind == 5 ? quant_q5_codes32_avx2(qs, qh, zero, r)
                                    : quant_later_codes32_avx2(kind, qs, qh, zero, r);
        _mm256_storeu_si256((__m256i *)(dst + r * 32), c);
    }
}

#else

static inline void quant_expand_row(int kind, const uint8_t *qs, const uint8_t *qh, int zero, int64_t K, int8_t *dst) {
    for (int64_t r = 0; r < K / 32; r++) {
        if (kind == QUANT_I4) {
            quant_i4_run(qs + r * 16, dst + r * 32);
            continue;
        }
        if (kind == QUANT_Q2 || kind == QUANT_Q3) {
            quant_k2_run(qs, kind == QUANT_Q3 ? qh : NULL, 48, zero, r, dst + r * 32);
            continue;
        }
        if (kind == 6) {
            for (int j = 0; j < 32; j++) dst[r * 32 + j] = (int8_t)(quant_q6_code(qs, qh, r * 32 + j) - zero);
            continue;
        }
        uint32_t p;   /* q5 */
        memcpy(&p, qh + r * 4, 4);
        for (int j = 0; j < 32; j++) {
            const uint8_t nib = j < 16 ? qs[r * 16 + j] & 15 : qs[r * 16 + j - 16] >> 4;
            dst[r * 32 + j] = (int8_t)((nib | (int)((p >> j) & 1) << 4) - zero);
        }
    }
}

#endif

/* The codes of row n as q8 (int8, K of them): the row itself for q8, or its expansion
 * into `scratch` for q5/q6/i4/q2/q3. Not for q4 (its kernels read nibbles). */
static inline const uint8_t *quant_q8_row(int kind, const uint8_t *qs, const uint8_t *qh, int zero, int64_t K,
                                          int64_t n, int8_t *scratch) {
    if (!quant_is_compact(kind)) return qs + n * K;
    quant_expand_row(quant_codes_kind(kind), qs + n * quant_row_bytes(kind, K),
                     qh ? quant_high_bits_at(kind, qh + n * quant_high_row_bytes(kind, K), K) : NULL, zero, K,
                     scratch);
    return (const uint8_t *)scratch;
}

#endif
