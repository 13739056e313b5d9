/* The 8-bit many-row kernel's micro-kernel shapes, alone: P panels of 16 weight rows x R rows of x,
 * the instructions of quant_gemm_i8.c's micro() (per group of 4 k: P weight loads, per row one
 * vpbroadcastd of 4 int8 codes and P vpdpbusd; per block of 32: the conversion, the scale's product
 * and the minimum's term) on operands that stay in L1, so only the instruction mix is timed; and
 * the core's vpdpbusd peak. Thread CPU time, one thread.
 *   gcc -O3 -march=native benchmarks/i8_micro_shapes.c -o /tmp/i8_micro_shapes && /tmp/i8_micro_shapes
 * Prints GOPS (two per multiply-add) per shape. With the loop over a block's groups of 4 k unrolled
 * they run alike here (~750-780 GOPS of ~1,000): the kernel's gain from groups of 4 panels is in
 * reading x from L2 a quarter as often, which this loop (x in L1) does not see (benchmarks/README.md,
 * twenty-ninth session). */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define K 576   /* SmolLM2's hidden size */
#define NB (K / 32)
#define MAXR 10
#define MAXP 4

static int8_t xq[MAXR * K] __attribute__((aligned(64)));
static float dx[MAXR * NB], xs[MAXR * NB];
static uint32_t wp[MAXP][K / 4 * 16] __attribute__((aligned(64)));
static float ws[MAXP][NB * 16] __attribute__((aligned(64))), wm[MAXP][NB * 16] __attribute__((aligned(64)));
static float out[MAXR * MAXP * 16];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define SHAPE(NAME, P, R)                                                                                    \
    __attribute__((noinline)) static void NAME(void) {                                                       \
        __m512 acc[R][P];                                                                                    \
        for (int i = 0; i < R; i++)                                                                          \
            for (int p = 0; p < P; p++) acc[i][p] = _mm512_setzero_ps();                                     \
        for (int b = 0; b < NB; b++) {                                                                       \
            __m512i dot[R][P];                                                                               \
            for (int i = 0; i < R; i++)                                                                      \
                for (int p = 0; p < P; p++) dot[i][p] = _mm512_setzero_si512();                              \
            _Pragma("GCC unroll 8") for (int g = 0; g < 8; g++) {                                            \
                __m512i w[P];                                                                                \
                for (int p = 0; p < P; p++) w[p] = _mm512_load_si512(wp[p] + (b * 8 + g) * 16);              \
                for (int i = 0; i < R; i++) {                                                                \
                    int32_t v;                                                                               \
                    memcpy(&v, xq + i * K + b * 32 + g * 4, 4);                                              \
                    const __m512i xb = _mm512_set1_epi32(v);                                                 \
                    for (int p = 0; p < P; p++) dot[i][p] = _mm512_dpbusd_epi32(dot[i][p], w[p], xb);        \
                }                                                                                            \
            }                                                                                                \
            for (int i = 0; i < R; i++) {                                                                    \
                const __m512 d = _mm512_set1_ps(dx[i * NB + b]), m = _mm512_set1_ps(xs[i * NB + b]);         \
                for (int p = 0; p < P; p++) {                                                                \
                    const __m512 sd = _mm512_mul_ps(_mm512_load_ps(ws[p] + b * 16), d);                      \
                    acc[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][p]), sd, acc[i][p]);               \
                    acc[i][p] = _mm512_fmadd_ps(_mm512_load_ps(wm[p] + b * 16), m, acc[i][p]);               \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        for (int i = 0; i < R; i++)                                                                          \
            for (int p = 0; p < P; p++) _mm512_storeu_ps(out + (i * P + p) * 16, acc[i][p]);                 \
    }

SHAPE(p1r10, 1, 10)
SHAPE(p2r6, 2, 6)
SHAPE(p3r4, 3, 4)
SHAPE(p4r3, 4, 3)

/* vpdpbusd's peak: 12 independent accumulators, operands in registers (kernels/flops_probe.c
 * measures vdpbf16ps's the same way, the roofline `pipeserve plan --calibrate` divides by). */
static void peak(void) {
    const long it = 20000000;
    __m512i a[12];
    for (int j = 0; j < 12; j++) a[j] = _mm512_setzero_si512();
    __m512i u = _mm512_set1_epi32(0x01010101), v = _mm512_set1_epi32(0x02020202);
    double t = now();
    for (long i = 0; i < it; i++) {
#pragma GCC unroll 12
        for (int j = 0; j < 12; j++) a[j] = _mm512_dpbusd_epi32(a[j], u, v);
        __asm__ volatile("" : "+v"(u));
    }
    t = now() - t;
    int s = 0;
    for (int j = 0; j < 12; j++) s += _mm512_reduce_add_epi32(a[j]);
    printf("vpdpbusd peak      %6.0f GOPS%s\n", it * 12.0 * 64 * 2 / t / 1e9, s == 1 ? " " : "");
}

int main(void) {
    for (int i = 0; i < MAXR * K; i++) xq[i] = (int8_t)(i % 7);
    for (int p = 0; p < MAXP; p++) {
        for (int i = 0; i < K / 4 * 16; i++) wp[p][i] = (uint32_t)i * 2654435761u;
        for (int i = 0; i < NB * 16; i++) ws[p][i] = 1e-3f, wm[p][i] = 1e-4f;
    }
    for (int i = 0; i < MAXR * NB; i++) dx[i] = 0.01f, xs[i] = 0.5f;
    peak();
    const int n = 100000;
    struct { const char *name; void (*fn)(void); int p, r; } shapes[] = {
        {"1 panel x 10 rows", p1r10, 1, 10}, {"2 panels x 6 rows", p2r6, 2, 6},
        {"3 panels x 4 rows", p3r4, 3, 4}, {"4 panels x 3 rows", p4r3, 4, 3}};
    for (int round = 0; round < 2; round++)
        for (int s = 0; s < 4; s++) {
            double t = now();
            for (int r = 0; r < n; r++) shapes[s].fn();
            t = now() - t;
            printf("%-18s %6.0f GOPS\n", shapes[s].name, (double)n * shapes[s].r * shapes[s].p * 16 * K * 2 / t / 1e9);
        }
    return 0;
}
