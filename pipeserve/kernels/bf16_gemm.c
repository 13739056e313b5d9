/* Many-row matmul for bfloat16 weights packed once at load (prefill, batched decode).
 *
 * pipeserve_bf16_gemm: out[M, N] = x[M, K] . W[N, K]^T, x, W and out bfloat16, float32
 *   accumulation, on AVX512_BF16 builds (vdpbf16ps). The same scheme as quant_gemm.c
 *   (whose tile helpers these are; they are duplicated here because that file belongs
 *   to the quantized path) without the dequantizing: the weight is laid out ONCE by
 *   pipeserve_bf16_pack into panels of 16 rows, pair-interleaved and transposed,
 *   wp[n / 16][k / 2][n % 16] = (w[n, k], w[n, k + 1]) as 32 bits (rows past N zero),
 *   so the micro-kernel loads one 64-byte k-pair of 16 weight rows and broadcasts the
 *   x pair of each of up to 16 activation rows (16 float32 accumulators, lanes = the
 *   panel's rows). x is packed once per call into 16-row blocks the same way.
 *   Loop order: each thread takes a contiguous range of panels; per chunk of x rows
 *   sized to stay in L2, each of its panels against the chunk's 16-row blocks, so a
 *   panel is read from memory once per chunk and stays in L1 while the blocks pass
 *   over it. No barrier between chunks: one per call (what costs on a loaded machine).
 *
 *   Each output is one thread's float32 sum in k order, rounded once: the same for any
 *   thread count; it differs from oneDNN's F.linear only by summation order.
 *
 * Returns 0; -1 when scratch cannot be allocated; -3 when K is not a multiple of 32.
 * Without AVX512_BF16, pipeserve_bf16_gemm_isa() says "none" and both functions
 * return -2 (the caller keeps oneDNN).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

const char *pipeserve_bf16_gemm_isa(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
    return "avx512-bf16";
#else
    return "none";
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
#include <immintrin.h>

#define NB 16          /* weight rows per panel: one zmm of 16 float32 outputs */
#define CHUNK_BYTES (512 * 1024)   /* packed x rows per chunk: about a quarter of a 2 MB L2 */

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

/* x [M, K] bfloat16 -> xp [ceil(M / 16)][K / 2][16] 32-bit pairs (rows past M zero).
 * One thread: about 1 % of the matmul's time. */
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

/* wp (size ceil(N / 16) * 16 * K bfloat16) <- w [N, K] in panels, see the top. */
int pipeserve_bf16_pack(const uint16_t *w, int64_t N, int64_t K, uint32_t *wp) {
    if (K % 32 != 0) return -3;
    pack_x(w, N, K, wp);   /* the weight's panels have the layout of x's blocks */
    return 0;
}

int pipeserve_bf16_gemm(const uint32_t *wp, int64_t N, int64_t K, const uint16_t *x, int64_t M, uint16_t *out,
                        int num_threads) {
    if (K % 32 != 0) return -3;
    if (M <= 0 || N <= 0) return 0;
    const int64_t blocks = (M + 15) / 16, panels = (N + NB - 1) / NB, K2 = K / 2;
    int64_t chunk = CHUNK_BYTES / (16 * K * 2);   /* 16-row blocks per chunk */
    if (chunk < 2) chunk = 2;
    uint32_t *xp = aligned_alloc(64, (size_t)(blocks * 16 * K * 2 + 63) / 64 * 64);
    if (!xp) return -1;
    pack_x(x, M, K, xp);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {   /* each thread its own range of panels through every chunk: one barrier per call */
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        for (int64_t b0 = 0; b0 < blocks; b0 += chunk) {
            const int64_t b1 = b0 + chunk < blocks ? b0 + chunk : blocks;
            for (int64_t pn = p0; pn < p1; pn++) {
                const int64_t n0 = pn * NB, cols = N - n0 < NB ? N - n0 : NB;
                for (int64_t mb = b0; mb < b1; mb++)
                    micro_rows(xp + mb * K2 * 16, wp + pn * K2 * NB, K, out, N, n0, mb * 16,
                               M - mb * 16 < 16 ? M - mb * 16 : 16, (__mmask16)((1u << cols) - 1u));
            }
        }
    }
    free(xp);
    return 0;
}

#else

int pipeserve_bf16_pack(const uint16_t *w, int64_t N, int64_t K, uint32_t *wp) {
    (void)w; (void)N; (void)K; (void)wp;
    return -2;
}

int pipeserve_bf16_gemm(const uint32_t *wp, int64_t N, int64_t K, const uint16_t *x, int64_t M, uint16_t *out,
                        int num_threads) {
    (void)wp; (void)N; (void)K; (void)x; (void)M; (void)out; (void)num_threads;
    return -2;
}

#endif
