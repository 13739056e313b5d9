/* The bfloat16 tile machinery shared by quant_gemm.c and bf16_gemm.c (AVX512_BF16
 * builds: PIPESERVE_BF16_TILES is defined where they compile, and PIPESERVE_BF16_ISA
 * names the path either way): 16 x 16 transposes of 32-bit pairs, packing
 * 16-row blocks of bfloat16 rows into k-pair-interleaved form, and the vdpbf16ps
 * micro-kernel of up to 16 activation rows against one 16-row weight panel. */
#ifndef PIPESERVE_BF16_TILES_H
#define PIPESERVE_BF16_TILES_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#define PIPESERVE_BF16_TILES 1
#define PIPESERVE_BF16_ISA "avx512-bf16"

#include <stdint.h>
#include <immintrin.h>

#include "avx512_transpose.h"

#define NB 16   /* weight rows per panel: one zmm of 16 float32 outputs */

/* x [M, K] bfloat16 -> xp [ceil(M / 16)][K / 2][16] 32-bit pairs (rows past M zero).
 * One thread: about 1 % of the matmul's time, and one parallel region (one barrier)
 * per call instead of two, which is what costs on a loaded machine. */
static void pack_x(const uint16_t *x, int64_t M, int64_t K, uint32_t *xp) {
    const int64_t K2 = K / 2, blocks = (M + 15) / 16;
    for (int64_t mb = 0; mb < blocks; mb++) {
        const int64_t rows = M - mb * 16 < 16 ? M - mb * 16 : 16;
        const uint32_t *src = (const uint32_t *)(x + mb * 16 * K);
        uint32_t *dst = xp + mb * K2 * 16;
        for (int64_t p = 0; p < K2; p += 16) {
            __m512i r[16];
            for (int64_t i = 0; i < 16; i++)
                r[i] = i < rows ? _mm512_loadu_si512((const void *)(src + i * K2 + p)) : _mm512_setzero_si512();
            transpose16(r);
            for (int c = 0; c < 16; c++) _mm512_store_si512((void *)(dst + (p + c) * 16), r[c]);
        }
    }
}

/* out[m0 + i, n0 .. n0 + cols) for i < MR: the rows of one 16-row block of x against one
 * weight panel, over all of K; accumulator i holds row i (lanes = the panel's 16 rows). */
static inline __attribute__((always_inline)) void
micro(const uint32_t *xb, const uint32_t *wp, int64_t K, const int MR, uint16_t *out, int64_t N, int64_t n0,
      int64_t m0, int64_t rows, __mmask16 keep) {
    __m512 acc[16];
    for (int i = 0; i < MR; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K / 2; p++) {
        const __m512bh wv = (__m512bh)_mm512_load_si512((const void *)(wp + p * NB));
        for (int i = 0; i < MR; i++)
            acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32((int)xb[p * 16 + i]), wv);
    }
    for (int i = 0; i < MR && i < rows; i++)
        _mm256_mask_storeu_epi16(out + (m0 + i) * N + n0, keep, (__m256i)_mm512_cvtneps_pbh(acc[i]));
}

static void micro_rows(const uint32_t *xb, const uint32_t *wp, int64_t K, uint16_t *out, int64_t N, int64_t n0,
                       int64_t m0, int64_t rows, __mmask16 keep) {
    if (rows <= 2) {   /* decode: one or two rows, not a block of 4 */
        if (rows == 1) micro(xb, wp, K, 1, out, N, n0, m0, rows, keep);
        else micro(xb, wp, K, 2, out, N, n0, m0, rows, keep);
        return;
    }
    switch ((rows + 3) / 4) {   /* a constant MR: the row loop unrolls into registers */
    case 1: micro(xb, wp, K, 4, out, N, n0, m0, rows, keep); break;
    case 2: micro(xb, wp, K, 8, out, N, n0, m0, rows, keep); break;
    case 3: micro(xb, wp, K, 12, out, N, n0, m0, rows, keep); break;
    default: micro(xb, wp, K, 16, out, N, n0, m0, rows, keep); break;
    }
}

#else
#define PIPESERVE_BF16_ISA "none"
#endif

#endif
