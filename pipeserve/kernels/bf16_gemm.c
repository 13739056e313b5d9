/* Many-row matmul for bfloat16 weights packed once at load (prefill, batched decode).
 *
 * pipeserve_bf16_gemm: out[M, N] = x[M, K] . W[N, K]^T, x, W and out bfloat16, float32
 *   accumulation, on AVX512_BF16 builds (vdpbf16ps). The same scheme as quant_gemm.c
 *   (the tile helpers both use are bf16_tiles.h) without the dequantizing: the weight is laid out ONCE by
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

#include "bf16_tiles.h"

const char *pipeserve_bf16_gemm_isa(void) {
    return PIPESERVE_BF16_ISA;
}

#ifdef PIPESERVE_BF16_TILES

#define CHUNK_BYTES (512 * 1024)   /* packed x rows per chunk: about a quarter of a 2 MB L2 */

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
