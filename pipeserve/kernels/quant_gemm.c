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
 *   one vpermw lookup. q8: 16 codes -> float32 -> fma -> bf16. q5/q6 (compact
 *   5/6-bit codes, quant_codes.h): each run of 32 codes is expanded in registers
 *   (nibbles + masked adds of the high-bit planes), then dequantized as q8; i4 (IQ4's
 *   codebook indices) by one vpshufb, then as q8; q2/q3 (Q2_K/Q3_K's bit pairs, q3's
 *   hmask) as the AVX2 kernels expand them, times d * sub per 16 (plus q2's -dmin * min).
 *   q4's and q8's float16 scales and minimums are converted once a panel into float32
 *   that each run broadcasts from memory, and the next panel's bytes are prefetched
 *   while one dequantizes (prefetch_share).
 *
 *   So the result differs from bf16(x) . bf16(dequantize(W))^T in float32 only
 *   by summation order (and the final bfloat16 rounding of out).
 *
 * kind: 4, 8, 5, 6, 9, 2, 3, 10, 11 or 12 (q4, q8, q5, q6, i4, q2, q3, q4k, q6k, q5k: each panel's
 * two-level scales expanded into float32 first, quant_codes.h); qh and zero: q5/q6's high bits, q3's
 * hmask and sub-scales, q2's and the two-level layouts' sub-scales, and the code offset (ignored
 * otherwise). Returns 0;
 * -1 when scratch cannot be allocated; -3 for a layout it does not take (K not a multiple of 32,
 * a q8/q5/q6/i4 group not a multiple of 16, a q4 group not a multiple of 32, q2/q3 not in whole
 * super-blocks of 256 with a scale each, two-level layouts not in whole super-blocks of 256). Without
 * AVX512_BF16, pipeserve_quant_gemm_isa() says
 * "none" and the function returns -2: the caller keeps its portable path
 * (dequantized row tiles and PyTorch's matmul).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "quant_codes.h"

#include "bf16_tiles.h"

const char *pipeserve_quant_gemm_isa(void) {
    return PIPESERVE_BF16_ISA;
}

#ifdef PIPESERVE_BF16_TILES

/* q4's 32 weights k..k+31 of a row (its 16 bytes at q + k / 2: low nibbles k..k+15, high ones
 * k+16..k+31) as bfloat16: a table of bf16(i * scale + bias), i < 16 (entries 16..31 unused), looked
 * up by each code (vpermw). The bytes are loaded twice into one register as 32 words (a broadcast
 * load), the second half shifted right by 4 per word: one shuffle fewer than unpacking the two
 * halves apart and joining them. */
static inline __attribute__((always_inline)) __m512i q4_lookup(const uint8_t *q, int64_t k, __m512 scale,
                                                               __m512 bias) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(iota, scale, bias)));
    const __m512i twice = _mm512_cvtepu8_epi16(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(q + k / 2))));
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    return _mm512_permutexvar_epi16(_mm512_and_si512(_mm512_srlv_epi16(twice, shift), _mm512_set1_epi16(15)), table);
}

/* 32 int8 codes (c0: k..k+15, c1: k+16..k+31) as bfloat16 code * scale + bias, each half its own. */
static inline __attribute__((always_inline)) __m512i codes_bf16(__m128i c0, __m128i c1, __m512 s0, __m512 b0,
                                                                __m512 s1, __m512 b1) {
    const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c0)), s0, b0);
    const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c1)), s1, b1);
    return (__m512i)_mm512_cvtne2ps_pbh(w1, w0);
}

/* 32 weights k..k+31 of one row as bfloat16 (32 x 16 bits, in order), g0 and g1 the groups of k and
 * k + 16 (q4's group is a multiple of 32: g0 both); qh, zero: q5/q6/q3 only (q2: qh its
 * sub-scales). i4, q2 and q3 expand their codes as the AVX2 kernels do (quant_codes.h); q2/q3's
 * weights are code * (d * sub) + (-dmin * min) per group of 16 in float32 (d * sub exact, one
 * rounding), the values of packed.py's dequantize, then rounded to bfloat16. */
static inline __attribute__((always_inline)) __m512i
dequant32(int kind, const uint8_t *q, const uint8_t *qh, int zero, const uint16_t *s, const uint16_t *b,
          int64_t g0, int64_t g1, int64_t k, int f32) {
    if (kind == 4) {   /* q4k (f32: its float32 scales; the one-level q4 takes panel_runs' float path) */
        const int64_t g = g0;
        const float sg = quant_scale_at(s, g, f32);
        return q4_lookup(q, k, _mm512_set1_ps(sg),
                         _mm512_set1_ps((b ? quant_scale_at(b, g, f32) : 0.0f) - (float)zero * sg));
    }
    if (kind == QUANT_Q2 || kind == QUANT_Q3) {   /* group 256: the run's two groups of 16, d * sub exact */
        const __m256i c = quant_later_codes32_avx2(kind, q, qh, zero, k / 32);
        const int64_t sup = k / QUANT_K2_SUPER, g = k % QUANT_K2_SUPER / 16;
        const uint8_t *h = qh + sup * quant_k2_high(kind);
        const float d = _cvtsh_ss(s[sup]), m = kind == QUANT_Q2 && b ? _cvtsh_ss(b[sup]) : 0.0f;
        float sc[2], mn[2];
        for (int i = 0; i < 2; i++) quant_k2_group(kind, h, (int)g + i, d, m, sc + i, mn + i);
        const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(c))),
                                          _mm512_set1_ps(sc[0]), _mm512_set1_ps(mn[0]));
        const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(c, 1))),
                                          _mm512_set1_ps(sc[1]), _mm512_set1_ps(mn[1]));
        return (__m512i)_mm512_cvtne2ps_pbh(w1, w0);
    }
    /* q5, q6, i4 (q8 takes panel_runs' float path): group is a multiple of 16 (Q6_K has 16) */
    __m128i c0, c1;   /* codes k..k+15, k+16..k+31 as int8 */
    if (kind == QUANT_I4 || kind == 6) {   /* the codebook's values (one vpshufb), or q6's own bytes */
        const __m256i c = kind == 6 ? _mm256_sub_epi8(quant_q6_codes32_avx2(q, qh, k / 32), _mm256_set1_epi8((char)zero))
                                    : quant_i4_codes32_avx2(q, k / 32);
        c0 = _mm256_castsi256_si128(c);
        c1 = _mm256_extracti128_si256(c, 1);
    } else {   /* q5: expanded from the run's nibbles and high-bit plane */
        const __m128i v = _mm_loadu_si128((const __m128i *)(q + k / 2)), lo4 = _mm_set1_epi8(15);
        c0 = _mm_and_si128(v, lo4);
        c1 = _mm_and_si128(_mm_srli_epi16(v, 4), lo4);
        uint32_t plane;
        memcpy(&plane, qh + k / 32 * 4, 4);
        const __m128i add = _mm_set1_epi8(16);
        c0 = _mm_mask_add_epi8(c0, (__mmask16)plane, c0, add);
        c1 = _mm_mask_add_epi8(c1, (__mmask16)(plane >> 16), c1, add);
        c0 = _mm_sub_epi8(c0, _mm_set1_epi8((char)zero));
        c1 = _mm_sub_epi8(c1, _mm_set1_epi8((char)zero));
    }
    return codes_bf16(c0, c1, _mm512_set1_ps(quant_scale_at(s, g0, f32)),   /* f32: q5k's, q6k's scales */
                      _mm512_set1_ps(b ? quant_scale_at(b, g0, f32) : 0.0f), _mm512_set1_ps(quant_scale_at(s, g1, f32)),
                      _mm512_set1_ps(b ? quant_scale_at(b, g1, f32) : 0.0f));
}

/* The 64-byte lines that hold [p, p + bytes), prefetched into L2 `per` lines a call (at most as
 * many calls as there are runs of 32 k: per = ceil(lines / runs)). A panel's rows are read 32
 * weights at a time, 16 streams a row apart that the hardware prefetchers do not follow (as
 * quant_gemm_i8.c's panel_bytes says): without this the code loads waited on memory, half of
 * dequant_panel's samples (perf, SmolLM2's gate_up at 16 rows). Past the matrix's end the lines
 * are nobody's (a prefetch does not fault). */
typedef struct {
    uintptr_t first;
    int64_t lines, per;
} line_span;

static inline line_span span_of(const void *p, int64_t bytes, int64_t runs) {
    line_span s;
    s.first = (uintptr_t)p & ~(uintptr_t)63;
    s.lines = (int64_t)(((uintptr_t)p + (uintptr_t)bytes + 63 - s.first) / 64);
    s.per = (s.lines + runs - 1) / runs;
    return s;
}

static inline __attribute__((always_inline)) void prefetch_share(const line_span *s, int64_t part) {
    const int64_t end = (part + 1) * s->per < s->lines ? (part + 1) * s->per : s->lines;
    for (int64_t l = part * s->per; l < end; l++) _mm_prefetch((const char *)(s->first + (uintptr_t)l * 64), _MM_HINT_T1);
}

/* dequant_panel's runs of 32 k. flt (a constant: the one-level q4 and q8 layouts, ck 4 or 8 as a
 * constant too): fs, fb are the panel's scales and biases (min - zero * scale; q8: min) in float32,
 * row j's groups at j * groups, so a run broadcasts them from memory (a float16 scale converted
 * and broadcast in registers had taken two of a run's shuffles). Otherwise each row's runs go
 * through dequant32 with rs, rm (its float16 scales and minimums, or two-level's float32 ones). */
static inline __attribute__((always_inline)) void
panel_runs(const int ck, const int two, const int flt, int kind, const uint8_t *qs, const uint16_t *sc,
           const uint16_t *mn, int64_t K, int64_t group, int64_t n0, int64_t rows, uint32_t *wp, const uint8_t *qh,
           int zero, const uint16_t *const *rs, const uint16_t *const *rm, const float *fs, const float *fb) {
    const int64_t row_bytes = quant_row_bytes(kind, K), high_bytes = quant_high_row_bytes(kind, K);
    const int64_t spr = quant_scales_per_row(kind, K, group), next = n0 + NB;
    /* the next panel's bytes, a share each 32 k (prefetch_share) */
    const line_span pq = span_of(qs + next * row_bytes, NB * row_bytes, K / 32);
    const line_span ph = span_of(qh ? qh + next * high_bytes : NULL, qh ? NB * high_bytes : 0, K / 32);
    const line_span ps = span_of(sc + next * spr, NB * spr * 2, K / 32);
    const line_span pm = span_of(mn ? mn + next * spr : NULL, mn ? NB * spr * 2 : 0, K / 32);
    for (int64_t k = 0; k < K; k += 32) {
        prefetch_share(&pq, k / 32);
        prefetch_share(&ph, k / 32);
        prefetch_share(&ps, k / 32);
        prefetch_share(&pm, k / 32);
        /* the groups of k .. k + 15 and k + 16 .. k + 31, once for the 16 rows (a division a row
         * had cost more than the rest of q4's run) */
        const int64_t g0 = k / group, g1 = (k + 16) / group;
        __m512i r[NB];
        for (int64_t j = 0; j < NB; j++) {
            const int64_t n = n0 + j;
            if (flt) {   /* q4 (group a multiple of 32: g0 both halves') and q8 */
                const float *js = fs + j * (K / group), *jb = fb + j * (K / group);
                const uint8_t *q = qs + n * row_bytes;
                if (j >= rows) r[j] = _mm512_setzero_si512();
                else if (ck == 4) r[j] = q4_lookup(q, k, _mm512_set1_ps(js[g0]), _mm512_set1_ps(jb[g0]));
                else r[j] = codes_bf16(_mm_loadu_si128((const __m128i *)(q + k)),
                                       _mm_loadu_si128((const __m128i *)(q + k + 16)), _mm512_set1_ps(js[g0]),
                                       _mm512_set1_ps(jb[g0]), _mm512_set1_ps(js[g1]), _mm512_set1_ps(jb[g1]));
                continue;
            }
            r[j] = j < rows ? dequant32(ck, qs + n * row_bytes,
                                        qh && ck != 4 ? quant_high_bits_at(kind, qh + n * high_bytes, K) : NULL, zero,
                                        rs[j], rm[j], g0, g1, k, two)
                            : _mm512_setzero_si512();
        }
        transpose16(r);   /* r[c] = pair k / 2 + c of the 16 rows */
        for (int c = 0; c < 16; c++) _mm512_store_si512((void *)(wp + (k / 2 + c) * NB), r[c]);
    }
}

/* Rows [n0, n0 + NB) of W, dequantized to bfloat16 and pair-interleaved:
 * wp[k / 2][j] = (w[n0 + j, k], w[n0 + j, k + 1]) as 32 bits (rows past N are zero). */
static void dequant_panel(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N,
                          int64_t K, int64_t group, int64_t n0, uint32_t *wp, const uint8_t *qh, int zero,
                          float *scales) {
    const int64_t groups = K / group;
    const int64_t rows = N - n0 < NB ? N - n0 : NB;
    const int two = quant_two_level(kind), ck = quant_codes_kind(kind);
    if ((ck == 4 || ck == 8) && !two) {   /* the float16 scales and minimums as panel_runs' float path takes them */
        float *fs = scales, *fb = scales + NB * groups;
        const __m512 z = _mm512_set1_ps(ck == 4 ? (float)zero : 0.0f);   /* q8's codes have no offset */
        for (int64_t j = 0; j < rows; j++)
            for (int64_t g = 0; g < groups; g += 16) {
                const __mmask16 live = (__mmask16)(groups - g >= 16 ? 0xffff : (1u << (groups - g)) - 1u);
                const int64_t at = (n0 + j) * groups + g;
                const __m512 s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, sc + at));
                const __m512 m = mn ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, mn + at)) : _mm512_setzero_ps();
                _mm512_mask_storeu_ps(fs + j * groups + g, live, s);
                /* min - zero * scale in one rounding, as dequant32 rounds q4k's */
                _mm512_mask_storeu_ps(fb + j * groups + g, live, _mm512_fnmadd_ps(z, s, m));
            }
        if (ck == 4) panel_runs(4, 0, 1, kind, qs, sc, mn, K, group, n0, rows, wp, qh, zero, NULL, NULL, fs, fb);
        else panel_runs(8, 0, 1, kind, qs, sc, mn, K, group, n0, rows, wp, qh, zero, NULL, NULL, fs, fb);
        return;
    }
    /* each row's scales and minimums (two-level: float32, expanded into `scales`) */
    const uint16_t *rs[NB], *rm[NB];
    for (int64_t j = 0; j < rows; j++) {
        const int64_t n = n0 + j;
        rs[j] = two ? (const uint16_t *)(scales + j * groups) : sc + n * groups;
        rm[j] = quant_k4_scales(kind) ? (const uint16_t *)(scales + (NB + j) * groups) : mn ? mn + n * groups : NULL;
    }
    for (int64_t j = 0; two && j < rows; j++)
        quant_two_level_row(kind, sc, mn, qh, K, n0 + j, scales + j * groups, scales + (NB + j) * groups);
    panel_runs(ck, two, 0, kind, qs, sc, mn, K, group, n0, rows, wp, qh, zero, rs, rm, NULL, NULL);
}

/* Whether the bfloat16 kernels (vdpbf16ps and AMX) take this layout: K a multiple of 32, a group a
 * multiple of 16 (q4: 32), q2/q3 in whole super-blocks of 256 with a scale each. */
static int gemm_takes(int kind, int64_t K, int64_t group) {
    if (K % 32 != 0 || group % 16 != 0 || (kind == 4 && group % 32 != 0)) return 0;
    if (!quant_shape_ok(kind, K, group)) return 0;
    return !((kind == QUANT_Q2 || kind == QUANT_Q3) && (group != QUANT_K2_SUPER || K % QUANT_K2_SUPER != 0));
}

int pipeserve_quant_gemm(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N,
                         int64_t K, int64_t group, const uint16_t *x, int64_t M, uint16_t *out, int num_threads,
                         const uint8_t *qh, int zero) {
    if (!gemm_takes(kind, K, group)) return -3;
    if (M <= 0 || N <= 0) return 0;
    const int64_t blocks = (M + 15) / 16, panels = (N + NB - 1) / NB;
    uint32_t *xp = aligned_alloc(64, (size_t)(blocks * 16 * K * 2 + 63) / 64 * 64);
    if (!xp) return -1;
    pack_x(x, M, K, xp);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        uint32_t *wp = aligned_alloc(64, (size_t)(NB * K * 2 + 63) / 64 * 64);
        /* a panel's scales and minimums in float32 (two-level: expanded, quant_codes.h; q4: dequant_panel) */
        float *scales = malloc(sizeof(float) * 2 * NB * (K / 16));
        const int ok = wp != NULL && scales != NULL;
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t pn = 0; pn < panels; pn++) {
            if (!ok) continue;
            const int64_t n0 = pn * NB, cols = N - n0 < NB ? N - n0 : NB;
            dequant_panel(kind, qs, sc, mn, N, K, group, n0, wp, qh, zero, scales);
            for (int64_t mb = 0; mb < blocks; mb++)
                micro_rows(xp + mb * (K / 2) * 16, wp, K, out, N, n0, mb * 16,
                           M - mb * 16 < 16 ? M - mb * 16 : 16, (__mmask16)((1u << cols) - 1u));
        }
        free(wp);
        free(scales);
    }
    free(xp);
    return failed ? -1 : 0;
}

/* pipeserve_quant_gemm_amx: the same product on Intel AMX (AMX-BF16 tile multiplies), where the
 * CPU has it and Linux grants this process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM).
 * Same arguments, same dequantized bfloat16 panels (dequant_panel: wp[k / 2][16 rows] pairs is
 * the layout a B tile reads, 16 pairs of k by 64 bytes); the rows of x are A tiles as they lie
 * (16 rows by 32 k, the row stride K * 2 bytes; a last block of fewer than 16 rows from a zeroed
 * copy). Each thread takes groups of AMX_PAIRS pairs of panels (128 weight rows, dequantized once
 * into L2) and runs every pair of 16-row blocks of x (then in L1) against each pair of the group:
 * 2 x 2 float32 C tiles, per 32 k two A and two B tile loads and four tdpbf16ps. (A pair of panels
 * at a time, x's tiles came from L2 for every pair: at 256-512 rows the grouping measured 1.06-1.15x
 * on gate_up's [3072, 576] and 1.14-1.29x on the 49152-row head, the other layers within 5 %.)
 * The result differs from bf16(x) . bf16(dequantize(W))^T in float32 only by summation order and
 * the final bfloat16 rounding, as the vdpbf16ps kernel's. Returns as it does, and -2
 * where there is no AMX (pipeserve_quant_gemm_amx_isa() says "none"). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define QUANT_AMX 1
#include "amx_tiles.h"

#ifndef AMX_PAIRS
#define AMX_PAIRS 4   /* pairs of panels a thread dequantizes before running x against them */
#endif

/* One 16-row block of out's columns n0 .. n0 + cols from the float32 tile stored in c: bfloat16
 * (rounded to nearest even), or float32 where f32. */
static inline void amx_write(const float *c, void *out, int f32, int64_t N, int64_t n0, int64_t m0, int64_t rows,
                             int64_t cols) {
    const __mmask16 keep = (__mmask16)((1u << cols) - 1u);
    for (int64_t r = 0; r < rows; r++) {
        if (f32)
            _mm512_mask_storeu_ps((float *)out + (m0 + r) * N + n0, keep, _mm512_load_ps(c + r * 16));
        else
            _mm256_mask_storeu_epi16((uint16_t *)out + (m0 + r) * N + n0, keep,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + r * 16)));
    }
}

/* Blocks a0 (and a1 when TWO_M) of x, each 16 rows of K bfloat16, against panels w0
 * (and w1 when TWO_N) over all of K: tiles 0-3 accumulate, 4-5 hold x, 6-7 the weights. */
static inline __attribute__((always_inline)) void
amx_micro(const int TWO_M, const int TWO_N, const uint16_t *a0, const uint16_t *a1, const uint32_t *w0,
          const uint32_t *w1, int64_t K, float *c) {
    _tile_zero(0);
    if (TWO_N) _tile_zero(1);
    if (TWO_M) _tile_zero(2);
    if (TWO_M && TWO_N) _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
        _tile_loadd(4, a0 + k, K * 2);
        _tile_loadd(6, w0 + k / 2 * NB, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (TWO_N) {
            _tile_loadd(7, w1 + k / 2 * NB, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (TWO_M) {
            _tile_loadd(5, a1 + k, K * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (TWO_N) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, c, 64);
    if (TWO_N) _tile_stored(1, c + 256, 64);
    if (TWO_M) _tile_stored(2, c + 512, 64);
    if (TWO_M && TWO_N) _tile_stored(3, c + 768, 64);
}

/* A thread's AMX scratch, kept between calls and grown as needed (OpenMP's threads persist; as
 * quant_gemm_i8.c's panel scratch): room for 2 * AMX_PAIRS dequantized panels, a panel's scales
 * and minimums in float32 (two-level: expanded; q4, q8: converted, dequant_panel), and 4 C tiles
 * of floats. */
static __thread char *amx_buf;
static __thread int64_t amx_cap;

typedef struct {
    uint32_t *wp;
    float *scales, *c;
} amx_scratch;

/* This thread's scratch for a width K; 0 when it cannot be had. */
static int amx_scratch_for(int64_t K, amx_scratch *t) {
    const int64_t wp_bytes = (AMX_PAIRS * 2 * NB * K * 2 + 63) / 64 * 64;
    const int64_t scale_bytes = ((int64_t)sizeof(float) * 2 * NB * (K / 16) + 63) / 64 * 64;
    const int64_t need = wp_bytes + scale_bytes + 4 * 256 * (int64_t)sizeof(float);
    if (need > amx_cap) {
        free(amx_buf);
        amx_buf = aligned_alloc(64, (size_t)need);
        amx_cap = amx_buf ? need : 0;
    }
    if (!amx_buf) return 0;
    t->wp = (uint32_t *)amx_buf;
    t->scales = (float *)(amx_buf + wp_bytes);
    t->c = (float *)(amx_buf + wp_bytes + scale_bytes);
    return 1;
}

/* Out's columns [n0, n1) (at most AMX_PAIRS pairs of panels, row stride N) for the M rows of x:
 * block mb's 16 rows at x + mb * 16 * K for mb < full, the zero-padded tail after; in t's scratch. */
static void amx_range(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N, int64_t K,
                      int64_t group, const uint8_t *qh, int zero, const uint16_t *x, const uint16_t *tail,
                      int64_t full, int64_t M, int64_t n0, int64_t n1, void *out, int f32, const amx_scratch *t) {
    uint32_t *wp = t->wp;
    float *c = t->c;
    const int64_t blocks = (M + 15) / 16, np = (n1 - n0 + NB - 1) / NB;
    for (int64_t j = 0; j < np; j++)   /* rows past n1 dequantize to zero (n1 clips as N would) */
        dequant_panel(kind, qs, sc, mn, n1, K, group, n0 + j * NB, wp + j * (K / 2) * NB, qh, zero, t->scales);
    for (int64_t mb = 0; mb < blocks; mb += 2) {
        const int two_m = mb + 1 < blocks;
        const uint16_t *a0 = mb < full ? x + mb * 16 * K : tail;
        const uint16_t *a1 = two_m ? (mb + 1 < full ? x + (mb + 1) * 16 * K : tail) : NULL;
        const int64_t rows0 = M - mb * 16 < 16 ? M - mb * 16 : 16;
        const int64_t rows1 = two_m ? (M - (mb + 1) * 16 < 16 ? M - (mb + 1) * 16 : 16) : 0;
        for (int64_t j = 0; j < np; j += 2) {
            const int64_t p0 = n0 + j * NB, p1 = p0 + NB;
            const int two_n = j + 1 < np;
            const uint32_t *w0 = wp + j * (K / 2) * NB, *w1 = w0 + (K / 2) * NB;
            const int64_t cols0 = n1 - p0 < NB ? n1 - p0 : NB, cols1 = two_n ? (n1 - p1 < NB ? n1 - p1 : NB) : 0;
            if (two_m && two_n) amx_micro(1, 1, a0, a1, w0, w1, K, c);
            else if (two_m) amx_micro(1, 0, a0, a1, w0, w1, K, c);
            else if (two_n) amx_micro(0, 1, a0, a1, w0, w1, K, c);
            else amx_micro(0, 0, a0, a1, w0, w1, K, c);
            amx_write(c, out, f32, N, p0, mb * 16, rows0, cols0);
            if (two_n) amx_write(c + 256, out, f32, N, p1, mb * 16, rows0, cols1);
            if (two_m) {
                amx_write(c + 512, out, f32, N, p0, (mb + 1) * 16, rows1, cols0);
                if (two_n) amx_write(c + 768, out, f32, N, p1, (mb + 1) * 16, rows1, cols1);
            }
        }
    }
}

#endif

const char *pipeserve_quant_gemm_amx_isa(void) {
#ifdef QUANT_AMX
    return amx_ready() ? "amx-bf16" : "none";
#else
    return "none";
#endif
}

int pipeserve_quant_gemm_amx(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N,
                             int64_t K, int64_t group, const uint16_t *x, int64_t M, uint16_t *out,
                             int num_threads, const uint8_t *qh, int zero) {
#ifdef QUANT_AMX
    if (!gemm_takes(kind, K, group)) return -3;
    if (!amx_ready()) return -2;
    if (M <= 0 || N <= 0) return 0;
    const int64_t blocks = (M + 15) / 16, full = M / 16, span = AMX_PAIRS * 2 * NB, groups = (N + span - 1) / span;
    uint16_t *tail = NULL;   /* the last block's rows, zero-padded to 16 */
    if (full < blocks) {
        tail = aligned_alloc(64, (size_t)(16 * K * 2 + 63) / 64 * 64);
        if (!tail) return -1;
        memcpy(tail, x + full * 16 * K, (size_t)((M - full * 16) * K * 2));
        memset(tail + (M - full * 16) * K, 0, (size_t)((16 - (M - full * 16)) * K * 2));
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        amx_scratch t = {NULL, NULL, NULL};
        const int ok = amx_scratch_for(K, &t);
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
        if (ok) amx_tile_config();
#pragma omp for schedule(static)
        for (int64_t gp = 0; gp < groups; gp++) {
            if (!ok) continue;
            /* the group's panels dequantized once (L2), then every pair of blocks of x (L1) against them */
            const int64_t n0 = gp * span, n1 = N - n0 < span ? N : n0 + span;
            amx_range(kind, qs, sc, mn, N, K, group, qh, zero, x, tail, full, M, n0, n1, out, 0, &t);
        }
        if (ok) _tile_release();
    }
    free(tail);
    return failed ? -1 : 0;
#else
    (void)kind; (void)qs; (void)sc; (void)mn; (void)N; (void)K; (void)group; (void)x; (void)M; (void)out;
    (void)num_threads; (void)qh; (void)zero;
    return -2;
#endif
}

/* The AMX kernel in two phases, for callers that run their own threads (decode_stage.c, as
 * quant_gemm_i8.c's pipeserve_quant_i8m_*): the bytes of M rows' prepared activations (0: a
 * layout it does not take, or no AMX), the rows converted into them (float32 x, whose values are
 * bfloat16's in the stage that calls it, so exactly; one thread; zero rows up to a whole block),
 * and out [M, N] float32 columns [n0, n1) (one thread's share; the bfloat16 rounding is the
 * caller's). Every output is pipeserve_quant_gemm_amx's bit for bit, before its rounding. */
int64_t pipeserve_quant_amxm_act_bytes(int kind, int64_t K, int64_t group, int64_t M) {
#ifdef QUANT_AMX
    if (!gemm_takes(kind, K, group) || !amx_ready() || M <= 0) return 0;
    return (M + 15) / 16 * 16 * K * 2;
#else
    (void)kind; (void)K; (void)group; (void)M;
    return 0;
#endif
}

void pipeserve_quant_amxm_prepare(int kind, int64_t K, const float *x, int64_t M, void *act) {
    (void)kind;
    uint16_t *a = act;
    for (int64_t i = 0; i < M * K; i += 16)
        _mm256_storeu_si256((__m256i *)(a + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    memset(a + M * K, 0, (size_t)(((M + 15) / 16 * 16 - M) * K * 2));
}

int pipeserve_quant_amxm_rows(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N,
                              int64_t K, int64_t group, const uint8_t *qh, int zero, const void *act, int64_t M,
                              int64_t n0, int64_t n1, float *out) {
#ifdef QUANT_AMX
    if (!gemm_takes(kind, K, group)) return -3;
    if (!amx_ready()) return -2;
    if (M <= 0 || n1 <= n0) return 0;
    const int64_t span = AMX_PAIRS * 2 * NB;
    amx_scratch t;
    if (!amx_scratch_for(K, &t)) return -1;
    amx_tile_config();
    for (int64_t g0 = n0; g0 < n1; g0 += span)
        amx_range(kind, qs, sc, mn, N, K, group, qh, zero, act, NULL, (M + 15) / 16, M, g0,
                  n1 - g0 < span ? n1 : g0 + span, out, 1, &t);
    _tile_release();
    return 0;
#else
    (void)kind; (void)qs; (void)sc; (void)mn; (void)N; (void)K; (void)group; (void)qh; (void)zero; (void)act;
    (void)M; (void)n0; (void)n1; (void)out;
    return -2;
#endif
}

#else

const char *pipeserve_quant_gemm_amx_isa(void) {
    return "none";
}

int64_t pipeserve_quant_amxm_act_bytes(int kind, int64_t K, int64_t group, int64_t M) {
    (void)kind; (void)K; (void)group; (void)M;
    return 0;
}

void pipeserve_quant_amxm_prepare(int kind, int64_t K, const float *x, int64_t M, void *act) {
    (void)kind; (void)K; (void)x; (void)M; (void)act;
}

int pipeserve_quant_amxm_rows(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N,
                              int64_t K, int64_t group, const uint8_t *qh, int zero, const void *act, int64_t M,
                              int64_t n0, int64_t n1, float *out) {
    (void)kind; (void)qs; (void)sc; (void)mn; (void)N; (void)K; (void)group; (void)qh; (void)zero; (void)act;
    (void)M; (void)n0; (void)n1; (void)out;
    return -2;
}

int pipeserve_quant_gemm_amx(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N,
                             int64_t K, int64_t group, const uint16_t *x, int64_t M, uint16_t *out,
                             int num_threads, const uint8_t *qh, int zero) {
    (void)kind; (void)qs; (void)sc; (void)mn; (void)N; (void)K; (void)group; (void)x; (void)M; (void)out;
    (void)num_threads; (void)qh; (void)zero;
    return -2;
}

int pipeserve_quant_gemm(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N,
                         int64_t K, int64_t group, const uint16_t *x, int64_t M, uint16_t *out, int num_threads,
                         const uint8_t *qh, int zero) {
    (void)kind; (void)qs; (void)sc; (void)mn; (void)N; (void)K; (void)group; (void)x; (void)M; (void)out;
    (void)num_threads; (void)qh; (void)zero;
    return -2;
}

#endif
