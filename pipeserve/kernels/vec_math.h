/* Math shared by the CPU kernels: exp, tanh and bfloat16 conversions, scalar and
 * in AVX-512 (16 lanes) and AVX2 + FMA (8 lanes) registers.
 * Included by paged_attention.c and elementwise.c (build.py hashes the headers
 * of this folder into each kernel's cache key). */
#ifndef PIPESERVE_VEC_MATH_H
#define PIPESERVE_VEC_MATH_H
#include <stdint.h>

/* bfloat16 bits -> float. */
static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } x;
    x.u = (uint32_t)v << 16;
    return x.f;
}

/* float -> bfloat16 bits, round to nearest even as PyTorch (NaN stays NaN). */
static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } x = {f};
    if ((x.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x.u >> 16) | 0x40u);
    return (uint16_t)((x.u + 0x7fffu + ((x.u >> 16) & 1u)) >> 16);
}

/* exp(x), x clamped to [-87, 88] (the float range), vectorisable: 2^n * p(r)
 * with r = x - n ln2 in [-ln2/2, ln2/2] (ln2 split in a high and a low part,
 * Cody-Waite) and a degree-6 polynomial: relative error about 2e-7, like expf. */
#pragma omp declare simd
static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    /* Round to nearest by the 1.5 * 2^23 trick: vectorises, unlike roundf. */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.3888889e-3f;
    p = p * r + 8.3333333e-3f;
    p = p * r + 4.1666667e-2f;
    p = p * r + 1.6666667e-1f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { uint32_t u; float f; } scale;
    scale.u = (uint32_t)((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|): absolute error about
 * 1e-7 (what a soft-capped score needs; the relative error grows near 0). */
#pragma omp declare simd
static inline float tanh_f32(float x) {
    const float e = exp_f32(-2.0f * (x < 0 ? -x : x));
    const float t = (1.0f - e) / (1.0f + e);
    return x < 0 ? -t : t;
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* 16 bfloat16 values at p as float32 (exact). */
static inline __attribute__((always_inline)) __m512 load_bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* exp16 without its clamp, for arguments already in [-87, 88]. */
static inline __attribute__((always_inline)) __m512 exp16_core(__m512 x) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.3888889e-3f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3333333e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1666667e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666667e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* 2^t for t up to ~127 without a clamp (t far below -126 gives 0 through vscalefps; NaN stays
 * NaN): t = n + f, |f| <= 1/2, 2^f by its Taylor polynomial of degree 6 (relative error ~1.2e-7).
 * One rounding and a subtraction where exp16_core's Cody-Waite reduction takes three. */
static inline __attribute__((always_inline)) __m512 exp2_16(__m512 t) {
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(1.5403530e-4f);   /* ln2^6 / 6! */
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* exp_f32 of 16 lanes (the same polynomial, scaled by 2^n with vscalefps). */
static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
    return exp16_core(_mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f)));
}

/* tanh_f32 of 16 lanes. */
static inline __attribute__((always_inline)) __m512 tanh16(__m512 x) {
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 e = exp16(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-2.0f)));
    const __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u));
    const __m512 out = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
    return _mm512_mask_mov_ps(out, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);   /* NaN stays NaN (exp16 clamps) */
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* exp_f32 of 8 lanes (the same polynomial; 2^n built in the exponent field, which
 * the clamp keeps in range). */
static inline __attribute__((always_inline)) __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.3888889e-3f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3333333e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1666667e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666667e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* tanh_f32 of 8 lanes. */
static inline __attribute__((always_inline)) __m256 tanh8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    const __m256 e = exp8(_mm256_mul_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(-2.0f)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    const __m256 out = _mm256_or_ps(t, _mm256_and_ps(x, sign));
    return _mm256_blendv_ps(out, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));   /* NaN stays NaN (exp8 clamps) */
}
#endif
#endif
