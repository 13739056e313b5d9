/* Compact 5/6-bit codes of kept-quantized weights (layouts "q5" / "q6",
 * pipeserve/model/quant/packed.py) expanded into int8 codes, the "q8" layout.
 *
 * A row of K weights is K / 2 nibble bytes (per run of 32: byte j holds weight j
 * low, weight j + 16 high) and K / 32 * 4 * hbits bytes of high bits (per run:
 * hbits little-endian 32-bit planes, bit j of plane p = bit 4 + p of weight j).
 * code = nibble | plane bits << 4, minus `zero`. quant_expand_row serves the float
 * decode and tiled paths (a row into an L1 scratch row, then their q8 code); the VNNI
 * decode path (quant_matmul.c, chunk_codes_hb), the AVX2 decode path (quant_gemv_avx2.h:
 * quant_codes32_avx2 for groups of 32, block_codes_eo for groups of 16) and the many-row kernel
 * (quant_gemm.c, dequant32) expand in registers. Either way the weights cross the memory bus at
 * 5.5-7 bits each.
 */
#ifndef PIPESERVE_QUANT_CODES_H
#define PIPESERVE_QUANT_CODES_H

#include <stdint.h>
#include <string.h>

/* Layout kinds as the C functions take them: 4 q4, 8 q8, 5 q5, 6 q6. */
static inline int quant_is_compact(int kind) { return kind == 5 || kind == 6; }

/* Bytes of one row's codes in `qs` (nibbles for q4/q5/q6) and in `qh` (high-bit planes). */
static inline int64_t quant_row_bytes(int kind, int64_t K) { return kind == 8 ? K : K / 2; }
static inline int64_t quant_high_row_bytes(int kind, int64_t K) { return quant_is_compact(kind) ? K / 8 * (kind - 4) : 0; }

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

static inline void quant_expand_row(int kind, const uint8_t *qs, const uint8_t *qh, int zero, int64_t K, int8_t *dst) {
    const int hbits = kind - 4;
    const __m256i lo4 = _mm256_set1_epi8(15), z = _mm256_set1_epi8((char)zero);
    const __m256i b4 = _mm256_set1_epi8(16), b5 = _mm256_set1_epi8(32);
    for (int64_t r = 0; r < K / 32; r++) {
        const __m128i v = _mm_loadu_si128((const __m128i *)(qs + r * 16));
        const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(v), _mm_srli_epi16(v, 4), 1);
        __m256i c = _mm256_and_si256(both, lo4);
        uint32_t p0;
        memcpy(&p0, qh + r * 4 * hbits, 4);
        c = _mm256_mask_add_epi8(c, (__mmask32)p0, c, b4);
        if (hbits == 2) {
            uint32_t p1;
            memcpy(&p1, qh + r * 8 + 4, 4);
            c = _mm256_mask_add_epi8(c, (__mmask32)p1, c, b5);
        }
        _mm256_storeu_si256((__m256i *)(dst + r * 32), _mm256_sub_epi8(c, z));
    }
}

#elif defined(__AVX2__)
#include <immintrin.h>

/* The 32 codes of run r as int8 (code - zero), in weight order: the nibbles (low halves
 * then high halves of the 16 bytes) plus each plane's bit, spread to a byte per weight
 * by a byte shuffle (byte j / 8 of the plane to byte j) and a compare with bit j % 8. */
static inline __attribute__((always_inline)) __m256i
quant_codes32_avx2(int hbits, const uint8_t *qs, const uint8_t *qh, int zero, int64_t r) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(qs + r * 16));
    __m256i c = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(15));
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                             0x0101010101010101, 0x0000000000000000);
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    for (int p = 0; p < hbits; p++) {
        uint32_t plane;
        memcpy(&plane, qh + (r * hbits + p) * 4, 4);
        const __m256i sel = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)plane), spread), bit);
        c = _mm256_add_epi8(c, _mm256_and_si256(_mm256_cmpeq_epi8(sel, bit), _mm256_set1_epi8((char)(16 << p))));
    }
    return _mm256_sub_epi8(c, _mm256_set1_epi8((char)zero));
}

static inline void quant_expand_row(int kind, const uint8_t *qs, const uint8_t *qh, int zero, int64_t K, int8_t *dst) {
    for (int64_t r = 0; r < K / 32; r++)
        _mm256_storeu_si256((__m256i *)(dst + r * 32), quant_codes32_avx2(kind - 4, qs, qh, zero, r));
}

#else

static inline void quant_expand_row(int kind, const uint8_t *qs, const uint8_t *qh, int zero, int64_t K, int8_t *dst) {
    const int hbits = kind - 4;
    for (int64_t r = 0; r < K / 32; r++) {
        uint32_t p[2] = {0, 0};
        memcpy(p, qh + r * 4 * hbits, 4 * (size_t)hbits);
        for (int j = 0; j < 32; j++) {
            const uint8_t nib = j < 16 ? qs[r * 16 + j] & 15 : qs[r * 16 + j - 16] >> 4;
            const int code = nib | (int)((p[0] >> j) & 1) << 4 | (int)((p[1] >> j) & 1) << 5;
            dst[r * 32 + j] = (int8_t)(code - zero);
        }
    }
}

#endif

/* The codes of row n as q8 (int8, K of them): the row itself for q8, or its expansion
 * into `scratch` for q5/q6. Not for q4 (its kernels read nibbles). */
static inline const uint8_t *quant_q8_row(int kind, const uint8_t *qs, const uint8_t *qh, int zero, int64_t K,
                                          int64_t n, int8_t *scratch) {
    if (!quant_is_compact(kind)) return qs + n * K;
    quant_expand_row(kind, qs + n * (K / 2), qh + n * quant_high_row_bytes(kind, K), zero, K, scratch);
    return (const uint8_t *)scratch;
}

#endif
