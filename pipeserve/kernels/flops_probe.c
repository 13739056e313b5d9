/* The core's bfloat16 dot-product peak: what a GEMM's GFLOP/s is a fraction of.
 *
 * pipeserve_bf16_peak_loop(iters): 12 independent vdpbf16ps zmm accumulators
 * (more than latency x throughput on current cores), iters rounds, operands in
 * registers, so nothing but the instruction's throughput is timed. Returns the
 * FLOPs done (2 per bf16 multiply-add: 12 x 32 x 2 per round), or -2 on a
 * build without AVX512_BF16. The caller times it (thread CPU time on a shared
 * machine) and divides.
 */
#include <stdint.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

double pipeserve_bf16_peak_loop(int64_t iters) {
    __m512 acc[12];
    for (int j = 0; j < 12; j++) acc[j] = _mm512_setzero_ps();
    __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3c003c00);
    for (int64_t i = 0; i < iters; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) acc[j] = _mm512_dpbf16_ps(acc[j], a, b);
        __asm__ volatile("" : "+v"(a));   /* keeps the loop from being folded */
    }
    volatile float sink = 0.0f;
    for (int j = 0; j < 12; j++) sink += _mm512_reduce_add_ps(acc[j]);
    (void)sink;
    return (double)iters * 12.0 * 32.0 * 2.0;
}

#else

double pipeserve_bf16_peak_loop(int64_t iters) {
    (void)iters;
    return -2.0;
}

#endif
