/* A 16 x 16 transpose of 32-bit elements in zmm registers (AVX-512F), shared by the bfloat16
 * tiles (bf16_tiles.h) and the 8-bit many-row kernel (quant_gemm_i8.c). */
#ifndef PIPESERVE_AVX512_TRANSPOSE_H
#define PIPESERVE_AVX512_TRANSPOSE_H

#if defined(__AVX512F__)
#include <immintrin.h>

/* r[j] = 16 dwords of row j -> r[c] = column c (16 x 16 transpose of 32-bit elements). */
static inline __attribute__((always_inline)) void transpose16(__m512i r[16]) {
    __m512i a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {   /* b[4i + c], 128-bit lane L: column 4L + c of rows 4i..4i+3 */
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i e0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88), e1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xdd);
        const __m512i f0 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
        const __m512i f1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xdd);
        r[c] = _mm512_shuffle_i32x4(e0, f0, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(e0, f0, 0xdd);
        r[4 + c] = _mm512_shuffle_i32x4(e1, f1, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(e1, f1, 0xdd);
    }
}

#endif

#endif
