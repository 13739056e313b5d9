/* Fused elementwise kernels for bfloat16 and float32 activations on CPUs.
 *
 * A decoder layer's small ops (RMSNorm with its float32 statistics, the
 * residual add, RoPE, SiLU times up) are each several PyTorch passes over the
 * activations with a float32 copy in between; here each is one pass per row.
 * Every result is rounded to bfloat16 at the same points as the PyTorch code
 * it replaces (pipeserve.model.layers), so outputs match it up to the order
 * of the float32 sum of squares. The float32 versions are the same math without
 * the roundings: RMSNorm up to that order too, RoPE exactly, SiLU up to exp's last
 * bit (exp_f32, not PyTorch's Sleef). Plain C that gcc vectorises (-O3
 * -march=native; `omp simd` allows the reductions to be reordered), with
 * explicit AVX-512 / AVX2 for SiLU's exp.
 */
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* RMSNorm over rows of `dim`, optionally after a residual add:
 *   x = delta ? bf16(h + delta) : h          (x is written to x_out when delta is given)
 *   out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))
 * as `w * (x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)).to(bf16)`. */
void pipeserve_rmsnorm_bf16(const uint16_t *h, const uint16_t *delta, uint16_t *x_out, const uint16_t *w,
                            uint16_t *out, int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *hr = h + r * dim;
        uint16_t *orow = out + r * dim;
        const uint16_t *xr = hr;
        if (delta) {
            const uint16_t *dr = delta + r * dim;
            uint16_t *xo = x_out + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) xo[d] = f32_to_bf16(bf16_to_f32(hr[d]) + bf16_to_f32(dr[d]));
            xr = xo;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < dim; d++) {
            const float x = bf16_to_f32(xr[d]);
            ss += x * x;
        }
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t d = 0; d < dim; d++)
            orow[d] = f32_to_bf16(bf16_to_f32(w[d]) * round_bf16(bf16_to_f32(xr[d]) * inv));
    }
}

#if defined(__AVX512BF16__)
/* bf16 rounding in one instruction (vcvtneps2bf16: round to nearest even; it
 * flushes float32 subnormals, |x| < 1.2e-38, to zero, where PyTorch keeps them). */
static inline __m256i to_bf16x16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256 load_bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* f32_to_bf16 of 8 lanes, the bits in the low half of each dword. */
static inline __m256i bf16_bits8(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), odd), 16);
    const __m256i quiet = _mm256_srli_epi32(_mm256_or_si256(u, _mm256_set1_epi32(0x400000)), 16);   /* NaN */
    return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}

static inline __m256 round_bf16x8(__m256 x) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(x), 16)); }

static inline void store_bf16x8(uint16_t *p, __m256 x) {
    const __m256i b = bf16_bits8(x);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}
#endif

/* Which explicit SiLU path this build compiled: "avx512", "avx2" or "portable". */
const char *pipeserve_elementwise_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "portable";
#endif
}

/* SwiGLU's activation: gate_up rows are [gate (inter) | up (inter)];
 *   out = bf16(bf16(silu(gate)) * up)   as `F.silu(gate) * up` in bf16. */
void pipeserve_silu_mul_bf16(const uint16_t *gate_up, uint16_t *out, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gate_up + r * 2 * inter, *u = g + inter;
        uint16_t *o = out + r * inter;
        int64_t i = 0;
#if defined(__AVX512BF16__)
        for (; i + 16 <= inter; i += 16) {
            const __m512 x = load_bf16x16(g + i);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            const __m512 sr = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16x16(s)), 16));
            _mm256_storeu_si256((__m256i *)(o + i), to_bf16x16(_mm512_mul_ps(sr, load_bf16x16(u + i))));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= inter; i += 8) {
            const __m256 x = load_bf16x8(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            const __m256 s = round_bf16x8(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
            store_bf16x8(o + i, _mm256_mul_ps(s, load_bf16x8(u + i)));
        }
#endif
#pragma omp simd
        for (int64_t j = i; j < inter; j++) {
            const float x = bf16_to_f32(g[j]);
            const float s = round_bf16(x / (1.0f + exp_f32(-x)));
            o[j] = f32_to_bf16(s * bf16_to_f32(u[j]));
        }
    }
}

/* Rotate-half RoPE of one tensor: x [n][heads][D] with row stride `stride`
 * (elements between tokens; x may be a slice of the fused qkv output) ->
 * out [n][heads][D] contiguous. cos/sin: [n][D] float32, rounded to bf16 first;
 *   out = bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))   as the PyTorch path. */
void pipeserve_rope_bf16(const uint16_t *x, int64_t stride, uint16_t *out, int64_t n, int64_t heads,
                         int64_t head_dim, const float *cos, const float *sin) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < n; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xi = x + t * stride + h * head_dim;
            uint16_t *o = out + (t * heads + h) * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float x1 = bf16_to_f32(xi[d]), x2 = bf16_to_f32(xi[d + half]);
                o[d] = f32_to_bf16(round_bf16(x1 * round_bf16(c[d])) + round_bf16(-x2 * round_bf16(s[d])));
                o[d + half] = f32_to_bf16(round_bf16(x2 * round_bf16(c[d + half]))
                                          + round_bf16(x1 * round_bf16(s[d + half])));
            }
        }
    }
}

/* float32 RMSNorm, optionally after a residual add:
 *   x = delta ? h + delta : h          (x is written to x_out when delta is given)
 *   out = w * (x * (1 / sqrt(mean(x^2) + eps)))
 * as `w * (x * rsqrt(x.pow(2).mean(-1) + eps))` in float32. */
void pipeserve_rmsnorm_f32(const float *h, const float *delta, float *x_out, const float *w, float *out,
                           int64_t rows, int64_t dim, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = h + r * dim;
        float *orow = out + r * dim;
        if (delta) {
            const float *hr = xr, *dr = delta + r * dim;
            float *xo = x_out + r * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; d++) xo[d] = hr[d] + dr[d];
            xr = xo;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t d = 0; d < dim; d++) ss += xr[d] * xr[d];
        const float inv = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
        for (int64_t d = 0; d < dim; d++) orow[d] = w[d] * (xr[d] * inv);
    }
}

/* float32 SwiGLU activation: out = silu(gate) * up, silu(x) = x / (1 + exp(-x)). */
void pipeserve_silu_mul_f32(const float *gate_up, float *out, int64_t rows, int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= inter; i += 16) {
            const __m512 x = _mm512_loadu_ps(g + i);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            const __m512 s = _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
        }
#elif defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= inter; i += 8) {
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), x));
            const __m256 s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
        }
#endif
        for (int64_t j = i; j < inter; j++) o[j] = g[j] / (1.0f + exp_f32(-g[j])) * u[j];
    }
}

/* float32 rotate-half RoPE, layout as pipeserve_rope_bf16:
 *   out = x * cos + rotate_half(x) * sin, each product rounded before the sum as the
 * PyTorch path (so no fused multiply-add here: the result is exact to it). */
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void pipeserve_rope_f32(const float *x, int64_t stride, float *out, int64_t n, int64_t heads, int64_t head_dim,
                        const float *cos, const float *sin) {
    const int64_t half = head_dim / 2;
    for (int64_t t = 0; t < n; t++) {
        const float *c = cos + t * head_dim, *s = sin + t * head_dim;
        for (int64_t h = 0; h < heads; h++) {
            const float *xi = x + t * stride + h * head_dim;
            float *o = out + (t * heads + h) * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float x1 = xi[d], x2 = xi[d + half];
                o[d] = x1 * c[d] + -x2 * s[d];
                o[d + half] = x2 * c[d + half] + x1 * s[d + half];
            }
        }
    }
}
#pragma GCC pop_options

/* Per row of `n` bfloat16 values, the index of the first maximum, as NumPy's argmax of the row
 * widened to float32 (torch's argmax too): the first NaN where there is one; -0 and +0 equal.
 * A greedy step's logits, read once as they come from the head, without the float32 copy.
 * The values are compared as 16-bit integers that order as the floats do (negatives' magnitude
 * bits flipped, -0 taken as +0): a max pass gcc vectorises, then the first index holding it. */
static inline int16_t bf16_order_key(uint16_t b) {
    if (b == 0x8000) b = 0;
    return (int16_t)(b & 0x8000 ? b ^ 0x7FFF : b);
}

/* The first index in [0, n) whose value's key is `key` (NaN: the first NaN), past chunks of 64
 * tested at once. */
static int64_t first_with_key(const uint16_t *row, int64_t n, int16_t key, int nan) {
    int64_t c = 0;
    for (; c + 64 <= n; c += 64) {
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = c; i < c + 64; i++)
            hit |= nan ? (row[i] & 0x7FFF) > 0x7F80 : bf16_order_key(row[i]) == key;
        if (hit) break;
    }
    for (; c < n; c++)
        if (nan ? (row[c] & 0x7FFF) > 0x7F80 : bf16_order_key(row[c]) == key) return c;
    return 0;
}

#if defined(__AVX512BW__)
#include <immintrin.h>

/* 32 values' keys at once: negatives' magnitude bits flipped by their own sign (arithmetic shift).
 * -0 becomes -1 here, not 0 as in bf16_order_key: no other value has key -1 (the smallest
 * negative subnormal's is -2), so a maximum of -1 means -0 and one of 0 means +0 or -0 alike. */
static inline __m512i bf16_keys32(__m512i v) {
    return _mm512_xor_si512(v, _mm512_and_si512(_mm512_srai_epi16(v, 15), _mm512_set1_epi16(0x7FFF)));
}

/* The lanes of `live` in `v` that hold a NaN (either sign). */
static inline __mmask32 bf16_nans32(__mmask32 live, __m512i v) {
    return _mm512_mask_cmpgt_epu16_mask(live, _mm512_and_si512(v, _mm512_set1_epi16(0x7FFF)), _mm512_set1_epi16(0x7F80));
}

/* The lanes of `v` that hold the row's answer: a NaN where the row has one, else the key `best`
 * (0: +0 or -0). */
static inline __mmask32 bf16_hits32(__m512i v, int16_t best, int nan) {
    if (nan) return bf16_nans32(~(__mmask32)0, v);
    const __m512i k = bf16_keys32(v);
    __mmask32 hit = _mm512_cmpeq_epi16_mask(k, _mm512_set1_epi16(best));
    if (best == 0) hit |= _mm512_cmpeq_epi16_mask(k, _mm512_set1_epi16(-1));
    return hit;
}

/* One row, 32 values a step: the maximum key and whether a NaN is there, then the first lane that
 * holds the answer (the tail through a masked load). Same answer as the portable loop below; ~4x
 * fewer instructions than what gcc made of it (16 values a step, the key's branches as blends). */
static int64_t argmax_bf16_row(const uint16_t *row, int64_t n) {
    const int64_t whole = n & ~(int64_t)31;
    const __mmask32 tail = (__mmask32)((1ull << (n - whole)) - 1);
    const __mmask32 all = ~(__mmask32)0;
    __m512i best0 = _mm512_set1_epi16(INT16_MIN), best1 = best0;
    __mmask32 nan = 0;
    int64_t i = 0;
    for (; i + 64 <= whole; i += 64) {
        const __m512i a = _mm512_loadu_si512(row + i), b = _mm512_loadu_si512(row + i + 32);
        best0 = _mm512_max_epi16(best0, bf16_keys32(a));
        best1 = _mm512_max_epi16(best1, bf16_keys32(b));
        nan |= bf16_nans32(all, a) | bf16_nans32(all, b);
    }
    for (; i < whole; i += 32) {
        const __m512i a = _mm512_loadu_si512(row + i);
        best0 = _mm512_max_epi16(best0, bf16_keys32(a));
        nan |= bf16_nans32(all, a);
    }
    if (tail) {
        const __m512i a = _mm512_maskz_loadu_epi16(tail, row + whole);
        best1 = _mm512_mask_max_epi16(best1, tail, best1, bf16_keys32(a));
        nan |= bf16_nans32(tail, a);
    }
    int16_t lanes[32];
    _mm512_storeu_si512(lanes, _mm512_max_epi16(best0, best1));
    int16_t best = INT16_MIN;
    for (int l = 0; l < 32; l++) best = lanes[l] > best ? lanes[l] : best;
    if (best == -1) best = 0;     /* -0 is the maximum: it equals +0 */
    for (i = 0; i < whole; i += 32) {
        const __mmask32 hit = bf16_hits32(_mm512_loadu_si512(row + i), best, nan != 0);
        if (hit) return i + __builtin_ctz(hit);
    }
    if (tail) {
        const __mmask32 hit = bf16_hits32(_mm512_maskz_loadu_epi16(tail, row + whole), best, nan != 0) & tail;
        if (hit) return whole + __builtin_ctz(hit);
    }
    return 0;
}
#endif

void pipeserve_argmax_bf16(const uint16_t *x, int64_t rows, int64_t n, int64_t *out) {
#if defined(__AVX512BW__)
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_bf16_row(x + r * n, n);
#else   /* the portable loops */
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *row = x + r * n;
        int16_t best = INT16_MIN;
        int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
        for (int64_t i = 0; i < n; i++) {
            const int16_t k = bf16_order_key(row[i]);
            best = k > best ? k : best;
            nan |= (row[i] & 0x7FFF) > 0x7F80;
        }
        out[r] = first_with_key(row, n, best, nan);
    }
#endif
}
