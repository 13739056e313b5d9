/* Many-row matmul (prefill, batched decode) against weights kept quantized
 * (layouts: pipeserve/model/quant/packed.py, "q4" and "q8").
 *
 * pipeserve_quant_gemm: out[M, N] = x[M, K] . W[N, K]^T, x and out bfloat16,
 *   float32 accumulation, on AVX512_BF16 builds (vdpbf16ps).
 *
 *   x is repacked once per call into blocks of 16 rows, "pair-interleaved":
 *   xp[m / 16][k / 2][m % 16] is the 32-bit pair (x[m, k], x[m, k + 1]), so one
 *   64-byte load holds one pair of 16 rows. Each thread takes panels of NB = 16
 *   weight rows: it dequantizes the panel once into bfloat16 (L1/L2-resident,
 *   row-major) and runs it against every 16-row block of x; the micro-kernel
 *   keeps 16 x 16 float32 accumulators (lanes = rows of x, one register per
 *   weight row), and per pair of k does one load of x and 16 vdpbf16ps with the
 *   weight pair broadcast. The 16 x 16 tile is transposed on the way out.
 *
 *   Dequantizing: a weight is bf16(scale * q + min), rounded to nearest even as
 *   PyTorch's .to(bfloat16) rounds the float32 dequantized weight (what the
 *   bfloat16 model of --quantization none holds). q4: the 16 values of a group
 *   are computed once into a 32-entry bf16 table and each run of 32 codes is
 *   one vpermw lookup. q8: 16 codes -> float32 -> fma -> bf16.
 *
 *   So the result differs from bf16(x) . bf16(dequantize(W))^T in float32 only
 *   by summation order (and the final bfloat16 rounding of out).
 *
 * Without AVX512_BF16 the function is absent from the answer of
 * pipeserve_quant_gemm_isa() ("none") and returns -2: the caller keeps its
 * portable path (dequantized row tiles and PyTorch's matmul).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

const char *pipeserve_quant_gemm_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
    return "avx512-bf16";
#else
    return "none";
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#include <immintrin.h>

#define NB 16   /* weight rows per panel = accumulators per 16-row block of x */

/* Rows [n0, n0 + NB) of W as bfloat16 [NB, K] (rows past N are zero). */
static void dequant_panel(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N,
                          int64_t K, int64_t group, int64_t n0, uint16_t *wp) {
    const int64_t row_bytes = kind == 4 ? K / 2 : K, groups = K / group;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t j = 0; j < NB; j++) {
        uint16_t *dst = wp + j * K;
        const int64_t n = n0 + j;
        if (n >= N) {
            memset(dst, 0, sizeof(uint16_t) * K);
            continue;
        }
        const uint8_t *q = qs + n * row_bytes;
        const uint16_t *s = sc + n * groups, *b = mn ? mn + n * groups : NULL;
        if (kind == 4) {   /* group is a multiple of 32 */
            const __m128i lo4 = _mm_set1_epi8(15);
            for (int64_t g = 0; g < groups; g++) {
                const __m512 sv = _mm512_set1_ps(_cvtsh_ss(s[g])), bv = _mm512_set1_ps(b ? _cvtsh_ss(b[g]) : 0.0f);
                /* table[i] = bf16(i * s + min), i < 16 (entries 16..31 unused) */
                const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(iota, sv, bv)));
                for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
                    const __m128i v = _mm_loadu_si128((const __m128i *)(q + k / 2));
                    const __m256i codes = _mm256_inserti128_si256(
                        _mm256_castsi128_si256(_mm_and_si128(v, lo4)), _mm_and_si128(_mm_srli_epi16(v, 4), lo4), 1);
                    const __m512i w = _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes), table);
                    _mm512_storeu_si512((void *)(dst + k), w);
                }
            }
        } else {           /* group is a multiple of 16 (Q6_K has 16) */
            for (int64_t k = 0; k < K; k += 32) {
                const int64_t g0 = k / group, g1 = (k + 16) / group;
                const __m512 s0 = _mm512_set1_ps(_cvtsh_ss(s[g0])), s1 = _mm512_set1_ps(_cvtsh_ss(s[g1]));
                const __m512 b0 = _mm512_set1_ps(b ? _cvtsh_ss(b[g0]) : 0.0f);
                const __m512 b1 = _mm512_set1_ps(b ? _cvtsh_ss(b[g1]) : 0.0f);
                const __m512 w0 = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + k)))), s0, b0);
                const __m512 w1 = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + k + 16)))), s1, b1);
                _mm512_storeu_si512((void *)(dst + k), (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
            }
        }
    }
}

/* x [M, K] bfloat16 -> xp [ceil(M / 16)][K / 2][16] 32-bit pairs (rows past M zero). */
static void pack_x(const uint16_t *x, int64_t M, int64_t K, uint32_t *xp, int num_threads) {
    const int64_t K2 = K / 2, blocks = (M + 15) / 16;
    const __m512i stride = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32((int)K2));
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && blocks > 1)
    for (int64_t mb = 0; mb < blocks; mb++) {
        const int64_t rows = M - mb * 16 < 16 ? M - mb * 16 : 16;
        const __mmask16 valid = (__mmask16)((1u << rows) - 1u);
        const int *base = (const int *)(x + mb * 16 * K);
        uint32_t *dst = xp + mb * K2 * 16;
        for (int64_t p = 0; p < K2; p++)
            _mm512_storeu_si512((void *)(dst + p * 16),
                                _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, stride, base + p, 4));
    }
}

/* acc[j] (lanes = 16 rows of x) += x block . W panel row j, over all of K. */
static inline __attribute__((always_inline)) void
micro_16x16(const uint32_t *xb, const uint16_t *wp, int64_t K, __m512 acc[NB]) {
    const int64_t K2 = K / 2;
    const uint32_t *w32 = (const uint32_t *)wp;
    for (int j = 0; j < NB; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t p = 0; p < K2; p++) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xb + p * 16));
#pragma GCC unroll 16
        for (int j = 0; j < NB; j++)
            acc[j] = _mm512_dpbf16_ps(acc[j], xv, (__m512bh)_mm512_set1_epi32((int)w32[j * K2 + p]));
    }
}

/* Transpose the 16 x 16 float tile acc[j][m] and store rows m < rows of out[m, n0 + j] (j < cols), bfloat16. */
static inline void store_tile(const __m512 acc[NB], uint16_t *out, int64_t N, int64_t n0, int64_t m0,
                              int64_t rows, int64_t cols) {
    float t[NB * 16];
    for (int j = 0; j < NB; j++) _mm512_storeu_ps(t + j * 16, acc[j]);
    const __m512i col = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(16));
    const __mmask16 keep = (__mmask16)((1u << cols) - 1u);
    for (int64_t m = 0; m < rows; m++) {
        const __m512 v = _mm512_i32gather_ps(col, t + m, 4);   /* t[j][m], j = 0..15 */
        _mm256_mask_storeu_epi16(out + (m0 + m) * N + n0, keep, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

int pipeserve_quant_gemm(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N,
                         int64_t K, int64_t group, const uint16_t *x, int64_t M, uint16_t *out, int num_threads) {
    if (K % 32 != 0 || group % 16 != 0 || (kind == 4 && group % 32 != 0)) return -3;
    const int64_t blocks = (M + 15) / 16, panels = (N + NB - 1) / NB;
    uint32_t *xp = aligned_alloc(64, (size_t)(blocks * 16 * K * 2 + 63) / 64 * 64);
    if (!xp) return -1;
    pack_x(x, M, K, xp, num_threads);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        uint16_t *wp = aligned_alloc(64, (size_t)(NB * K * 2 + 63) / 64 * 64);
        if (!wp) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t pn = 0; pn < panels; pn++) {
            if (!wp) continue;
            const int64_t n0 = pn * NB, cols = N - n0 < NB ? N - n0 : NB;
            dequant_panel(kind, qs, sc, mn, N, K, group, n0, wp);
            for (int64_t mb = 0; mb < blocks; mb++) {
                __m512 acc[NB];
                micro_16x16(xp + mb * (K / 2) * 16, wp, K, acc);
                store_tile(acc, out, N, n0, mb * 16, M - mb * 16 < 16 ? M - mb * 16 : 16, cols);
            }
        }
        free(wp);
    }
    free(xp);
    return failed ? -1 : 0;
}

#else

int pipeserve_quant_gemm(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N,
                         int64_t K, int64_t group, const uint16_t *x, int64_t M, uint16_t *out, int num_threads) {
    (void)kind; (void)qs; (void)sc; (void)mn; (void)N; (void)K; (void)group; (void)x; (void)M; (void)out;
    (void)num_threads;
    return -2;
}

#endif
