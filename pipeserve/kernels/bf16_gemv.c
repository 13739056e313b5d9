/* Decode rows against a plain bfloat16 weight: out[M, N] = x[M, K] . W[N, K]^T (+ bias), M <= 8.
 *
 * F.linear hands oneDNN the [N, K] weight as it is, and oneDNN reorders it into its blocked
 * layout on every call: at one to a few rows of x (decode) that is a read and a write of the
 * whole weight per call, and SmolLM2's bfloat16 layers ran at 13-17 GB/s a thread, 21-32 at two
 * (benchmarks/README.md, thirty-fourth session). Packing once (--prepack-weights) keeps a second
 * copy of every weight. This kernel reads the weight where it is, once per call: each thread takes
 * a contiguous range of weight rows, and each group of R rows (4 for up to 4 rows of x, else 2) is
 * read 64 bytes at a time against the same 32 columns of every row of x (in L1), into one
 * float32 accumulator per (x row, weight row) by vdpbf16ps (pairs of bfloat16 products; on
 * AVX-512 CPUs without AVX512_BF16, the bfloat16 widened to float32 and two FMAs), summed across
 * lanes at the row's end, plus the bias, rounded once to bfloat16 (to nearest even).
 *
 * Each output is one thread's float32 sum over k in the same order whatever M, N or the thread
 * count (batch-invariant); against F.linear it differs by float32 summation order only (on
 * SmolLM2's shapes at 1 and 3 rows every output was F.linear's).
 *
 * The layers take it for up to 8 rows (packed_linear.GEMV_MAX_ROWS), weights from memory: one
 * thread 2.1-2.2x F.linear at 1 row, 1.7-2.1x at 4, 2.1-2.2x at 8; two threads 1.5-2.1x, 1.4-1.8x
 * and 1.4-2.0x (benchmarks/bf16_gemv.py). Before the prefetches below, 4 rows measured 1.1-1.3x
 * and 8 rows 0.6-0.8x (one thread).
 *
 * pipeserve_bf16_gemv(w, N, K, x, M, bias or NULL, out, num_threads): returns 0; -2 on builds
 * without AVX-512 (pipeserve_bf16_gemv_isa() says "none": the caller keeps F.linear); -3 for M
 * outside [1, BF16_GEMV_MAX_ROWS].
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec_math.h"

#define BF16_GEMV_MAX_ROWS 8
/* Each 64 bytes of weights are asked for PF_BYTES ahead, into L2: with the dot products of 2-8
 * rows the hardware prefetchers fell behind (4 rows from memory, one thread: 17-21 GB/s without,
 * 1.34-1.93x with 8 KB ahead into L1; 2 threads 1.07-1.36x). On a Zen 4 host the L1 prefetches
 * stalled at the core's miss buffers: into L2 measured 1.5-2.5x at 2-8 rows (SmolLM2's head, 4
 * rows, one thread: 2,350 against 5,752 us), and at one row, where the prefetchers had kept up
 * on the earlier host (L1 prefetches 0.88-1.07x there), 1.2-1.8x at one thread (the head 2,885
 * against 4,861 us) and 0.95-1.7x at two; benchmarks/README.md, forty-third session. */
#define PF_BYTES 8192

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define GEMV_512 1
#include <immintrin.h>
#endif

const char *pipeserve_bf16_gemv_isa(void) {
#if defined(GEMV_512) && defined(__AVX512BF16__)
    return "avx512-bf16";
#elif defined(GEMV_512)
    return "avx512";
#else
    return "none";
#endif
}

int64_t pipeserve_bf16_gemv_max_rows(void) { return BF16_GEMV_MAX_ROWS; }

#ifdef GEMV_512
/* acc += the products of 32 bfloat16 pairs (lanes: pairs 2i, 2i + 1). */
static inline __attribute__((always_inline)) __m512 dot32(__m512 acc, __m512i a, __m512i b) {
#ifdef __AVX512BF16__
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
    /* the same pairs widened: the even elements (low halves of the dwords), then the odd ones */
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)),
                          acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, hi)), _mm512_castsi512_ps(_mm512_and_si512(b, hi)),
                           acc);
#endif
}

/* Weight rows [n, n + R) against the M rows of x: R and M constants where inlined. */
static inline __attribute__((always_inline)) void rows_block(const uint16_t *w, int64_t K, const uint16_t *x, int M,
                                                             int R, int64_t n, const uint16_t *bias, int64_t N,
                                                             uint16_t *out) {
    __m512 acc[BF16_GEMV_MAX_ROWS][4];
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) acc[m][r] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i wv[4];
        for (int r = 0; r < R; r++) {
            wv[r] = _mm512_loadu_si512((const void *)(w + (n + r) * K + k));
            _mm_prefetch((const char *)(w + (n + r) * K + k) + PF_BYTES, _MM_HINT_T1);
        }
        for (int m = 0; m < M; m++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(x + m * K + k));
            for (int r = 0; r < R; r++) acc[m][r] = dot32(acc[m][r], xv, wv[r]);
        }
    }
    if (k < K) {   /* the last K % 32 columns: zeros past them on both sides */
        const __mmask32 live = (__mmask32)((1ull << (K - k)) - 1);
        __m512i wv[4];
        for (int r = 0; r < R; r++) wv[r] = _mm512_maskz_loadu_epi16(live, w + (n + r) * K + k);
        for (int m = 0; m < M; m++) {
            const __m512i xv = _mm512_maskz_loadu_epi16(live, x + m * K + k);
            for (int r = 0; r < R; r++) acc[m][r] = dot32(acc[m][r], xv, wv[r]);
        }
    }
    for (int m = 0; m < M; m++)
        for (int r = 0; r < R; r++) {
            const float b = bias ? bf16_to_f32(bias[n + r]) : 0.0f;
            out[m * N + n + r] = f32_to_bf16(_mm512_reduce_add_ps(acc[m][r]) + b);
        }
}

/* Rows [n0, n1) of out for M rows of x: groups of R weight rows, then single rows. */
static void rows_range(const uint16_t *w, int64_t K, const uint16_t *x, int M, int64_t n0, int64_t n1,
                       const uint16_t *bias, int64_t N, uint16_t *out) {
#define RANGE(MM, RR)                                                                   \
    {                                                                                   \
        int64_t n = n0;                                                                 \
        for (; n + (RR) <= n1; n += (RR)) rows_block(w, K, x, MM, RR, n, bias, N, out); \
        for (; n < n1; n++) rows_block(w, K, x, MM, 1, n, bias, N, out);                \
    }                                                                                   \
    break;
    switch (M) {
    case 1: RANGE(1, 4)
    case 2: RANGE(2, 4)
    case 3: RANGE(3, 4)
    case 4: RANGE(4, 4)
    case 5: RANGE(5, 2)
    case 6: RANGE(6, 2)
    case 7: RANGE(7, 2)
    default: RANGE(8, 2)
    }
#undef RANGE
}
#endif

/* One thread's share, for callers that run their own threads (decode_stage.c): out rows [n0, n1),
 * the same outputs as pipeserve_bf16_gemv's (an output does not depend on how rows are shared).
 * Returns 0, -2 or -3 as it does. */
int pipeserve_bf16_gemv_rows(const uint16_t *w, int64_t N, int64_t K, const uint16_t *x, int64_t M,
                             const uint16_t *bias, int64_t n0, int64_t n1, uint16_t *out) {
#ifdef GEMV_512
    if (M < 1 || M > BF16_GEMV_MAX_ROWS) return -3;
    if (n0 < n1) rows_range(w, K, x, (int)M, n0, n1, bias, N, out);
    return 0;
#else
    (void)w; (void)N; (void)K; (void)x; (void)M; (void)bias; (void)n0; (void)n1; (void)out;
    return -2;
#endif
}

int pipeserve_bf16_gemv(const uint16_t *w, int64_t N, int64_t K, const uint16_t *x, int64_t M, const uint16_t *bias,
                        uint16_t *out, int num_threads) {
#ifdef GEMV_512
    if (M < 1 || M > BF16_GEMV_MAX_ROWS) return -3;
    /* each thread a contiguous range of whole groups of 4 weight rows */
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
#else
        const int t = 0, T = 1;
#endif
        const int64_t groups = (N + 3) / 4;
        const int64_t g0 = groups * t / T, g1 = groups * (t + 1) / T;
        const int64_t n0 = g0 * 4, n1 = g1 * 4 < N ? g1 * 4 : N;
        if (n0 < n1) rows_range(w, K, x, (int)M, n0, n1, bias, N, out);
    }
    return 0;
#else
    (void)w; (void)N; (void)K; (void)x; (void)M; (void)bias; (void)out; (void)num_threads;
    return -2;
#endif
}
