/* A stage's decoder layers for one decode step, in one call and one thread team.
 *
 * Decoding a few tokens, a layer is ten small operations; run from Python each is
 * a ctypes call, a tensor allocation and (matmuls, attention) an OpenMP fork/join:
 * about 6 ms of a 16 ms token of SmolLM2-135M on two cores, against 10 ms for
 * the kernels themselves. Here the stage's layers run in one parallel region:
 * the matmuls split output rows over the threads and the attention its work items
 * (key ranges x kv heads), the small row operations run on one thread, and the
 * threads meet at a barrier between operations (about 10 per layer).
 *
 * It computes what the Python decoder computes, with the same kernels, reached
 * through the function pointers the caller passes (quant_matmul.c's two-phase
 * integer gemv, paged_attention.c's decode phases, elementwise.c's RMSNorm, RoPE and
 * SiLU·up), in the same order: float32 or bfloat16 activations (rounded where the
 * Python path rounds them: every matmul, norm, RoPE and SiLU output, the attention
 * output and the bias and residual adds), weights kept quantized, a KV cache in the
 * activations' dtype or in 8 bits (--kv-cache-dtype int8 | fp8: each row of a kv head
 * head_dim codes and its float32 scale, quantized here as kv_quant.quantize does it, bit
 * for bit). A bfloat16 stage's linear layers may also be plain bfloat16 weights (a
 * safetensors checkpoint under --quantization auto): those multiply up to 8 rows by
 * bf16_gemv.c, as layers.Linear does (QW_DENSE). Only the split of the attention over the threads
 * differs (the Python path runs a small step's attention on one thread): with one
 * thread the result is bit for bit the Python path's, with more it differs by the
 * order in which the partial softmaxes are merged.
 *
 * The layer: x, r = rmsnorm(h + r); qkv = x Wqkv^T (+ b); q, k = rope(q, k) (after an
 * RMSNorm over each head of q and k where the family has one: Qwen3);
 * cache[slot] = k, v; a = attention(q); o = a Wo^T; x, r = rmsnorm(o + r);
 * gu = x Wgu^T; h = (silu(g) * u) Wdown^T. The stage returns h + r.
 *
 * --profile: with a step's ``prof`` set, thread 0 adds the wall time between the
 * team's meeting points to the class of work done there (``PROF_*``: the matmuls
 * with their activation quantization, the attention with its plan, the KV write,
 * the row operations), splitting a one-thread block by its parts' clock times.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "vec_math.h"

/* The team meets, where it has more than one thread. libgomp makes a one-thread region a team
 * too, and its barrier (also a single's implied one) ends in a futex wake-up, a system call: ~165
 * of them per decode step of a 15-layer stage. So every single here is nowait, followed by this. */
#define TEAM_BARRIER(T) \
    do {                 \
        if ((T) > 1) {   \
            _Pragma("omp barrier") \
        }                \
    } while (0)

/* The elementwise kernels of the activations' dtype (float or uint16_t bfloat16 elements). */
typedef void (*rmsnorm_fn)(const void *h, const void *delta, void *x_out, const void *w, void *out,
                           int64_t rows, int64_t dim, float eps);
typedef void (*rope_fn)(const void *x, int64_t stride, void *out, int64_t n, int64_t heads, int64_t head_dim,
                        const float *cos, const float *sin);
typedef void (*silu_mul_fn)(const void *gate_up, void *out, int64_t rows, int64_t inter);
typedef int64_t (*act_bytes_fn)(int kind, int64_t K, int64_t group, int64_t M);
typedef void (*prepare_fn)(int kind, int64_t K, const float *x, int64_t M, void *act);
typedef void (*rows_fn)(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N, int64_t K,
                        int64_t group, const uint8_t *qh, int zero, const void *act, int64_t M, int64_t n0,
                        int64_t n1, float *out);
typedef int (*m_rows_fn)(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N, int64_t K,
                         int64_t group, const uint8_t *qh, int zero, const void *act, int64_t M, int64_t n0,
                         int64_t n1, float *out);
typedef int64_t (*plan_bytes_fn)(int64_t batch, int64_t heads, int64_t head_dim, int num_threads);
typedef int64_t (*plan_fn)(void *plan, const int64_t *context_lens, int64_t batch, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t window, int num_threads);
typedef void (*items_fn)(const void *plan, const float *q, const void *k_cache, const void *v_cache, int dtype,
                         const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens, float scale,
                         float softcap, int bf16_math, int64_t i0, int64_t i1);
typedef void (*merge_fn)(const void *plan, int64_t bh0, int64_t bh1, float *out);
typedef void (*share_fn)(const void *plan, int t, int64_t *i0, int64_t *i1);
typedef int (*dense_rows_fn)(const uint16_t *w, int64_t N, int64_t K, const uint16_t *x, int64_t M,
                             const uint16_t *bias, int64_t n0, int64_t n1, uint16_t *out);

/* The kernels of the other libraries (the caller resolves them once). */
typedef struct {
    rmsnorm_fn rmsnorm;
    rope_fn rope;
    silu_mul_fn silu_mul;
    act_bytes_fn act_bytes;
    prepare_fn prepare;
    rows_fn rows;
    plan_bytes_fn plan_bytes;
    plan_fn plan;
    items_fn items;
    merge_fn merge;
    share_fn share;   /* thread t's items of the plan: its part of the step's keys */
    /* quant_gemm_i8.c's many-row 8-bit kernel in the same two phases (AVX512-VNNI), or NULL:
     * a linear layer whose every part it takes at the step's rows multiplies them in one pass
     * of it (m_act_bytes is 0 for a layout it does not take, or for too few rows: up to
     * pipeserve_quant_gemm_i8_from's rows: i4 from 2, q4, Q4_K and q8 from 4, the others from 5) */
    act_bytes_fn m_act_bytes;
    prepare_fn m_prepare;
    m_rows_fn m_rows;
    /* bf16_gemv.c's rows for plain bfloat16 weights (QW_DENSE parts), or NULL: the bfloat16 output
     * with the bias added before its rounding, as layers.Linear's decode rows */
    dense_rows_fn d_rows;
    /* quant_gemm.c's AMX kernel in the same two phases (CPUs with AMX-BF16), or NULL: a linear
     * whose every part it takes, at a_min_rows rows or more and at least N / a_per_out for each
     * part of N rows (cpu_kernels.amx_from), multiplies them in one pass of it instead of m_rows */
    act_bytes_fn a_act_bytes;
    prepare_fn a_prepare;
    m_rows_fn a_rows;
    int64_t a_min_rows, a_per_out;
} stage_kernels;

/* many_rows' answers: the linear's one pass of the 8-bit kernel (m_*) or of the AMX one (a_*) */
#define MANY_I8 1
#define MANY_AMX 2

/* A quantized weight [N, K] as quant_matmul.c takes it; or, kind QW_DENSE, a plain bfloat16
 * weight at qs (the layer's only part; nothing else set). */
#define QW_DENSE (-1)
typedef struct {
    const uint8_t *qs, *qh;
    const uint16_t *sc, *mn;
    int64_t N, K, group;
    int32_t kind, zero;
} qweight;

/* A linear layer's output columns in up to MAX_PARTS weights of one K, in order: a GGUF
 * whose q, k and v (or gate and up) have different types keeps each in its own (a
 * Q4_K_M file's attn_v is Q6_K in some layers, its q and k Q4_K). */
#define MAX_PARTS 3
typedef struct {
    qweight part[MAX_PARTS];
    int64_t parts;
} qlinear;

static int64_t linear_n(const qlinear *w) {
    int64_t n = 0;
    for (int64_t i = 0; i < w->parts; i++) n += w->part[i].N;
    return n;
}

/* The activations part i reads: those of the first part of its kind (the quantized x
 * depends on the layout's kind only), each kind prepared once. */
static int64_t act_slot(const qlinear *w, int64_t i) {
    for (int64_t j = 0; j < i; j++)
        if (w->part[j].kind == w->part[i].kind) return j;
    return i;
}

typedef struct {
    const void *input_norm, *post_norm;    /* RMSNorm weights [hidden] */
    qlinear qkv, o, gate_up, down;
    const void *qkv_bias;                  /* [q + 2 kv] or NULL */
    const void *q_norm, *k_norm;           /* RMSNorm weights [head_dim] over each head of q and k, or NULL */
    char *k_cache, *v_cache;               /* [blocks, block_size, kv_heads, head_dim], the activations' dtype */
    int64_t window;                        /* sliding window (0: none) */
    float softcap;                         /* attention logit soft cap (0: none) */
    int32_t pad;
} stage_layer;

typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    const float *cos, *sin;                /* [rows, head_dim] each, or the rotary table (positions) */
    const int64_t *slots;                  /* [rows] cache slot of each new token */
    const int64_t *block_tables;           /* [rows, max_blocks] */
    const int64_t *context_lens;           /* [rows] */
    int64_t max_blocks, block_size;
    int64_t bf16;                          /* activations, weights of the norms and bias: bfloat16 */
    double *prof;                          /* NULL, or PROF_N nanosecond totals to add to */
    int64_t kv_dtype;                      /* the cache's, as paged_attention.c's DT_*: the activations'
                                            * (0 float32, 1 bfloat16), or 3 int8, 4 fp8 (e4m3) */
    const int64_t *positions;              /* NULL: row m's cos and sin are rows m of cos and sin; else
                                            * [rows]: rows positions[m] of them (the model's rotary table,
                                            * which reaches past every position: a step's rows picked here,
                                            * not by four PyTorch ops a step, ~90-125 us cold) */
} stage_step;

enum { KV_INT8 = 3, KV_FP8 = 4 };   /* paged_attention.c's DT_INT8, DT_FP8 */

enum { PROF_GEMM, PROF_ATTENTION, PROF_KV_WRITE, PROF_ROWS, PROF_N };

static double stamp(const double *prof) {
    if (!prof) return 0.0;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* Thread 0: the time since *last goes to the classes c[0..n): the first n - 1 their
 * measured part[i], the last the rest. */
static void account(double *prof, int t, double *last, const int *c, const double *part, int n) {
    if (!prof || t) return;
    const double now = stamp(prof);
    double rest = now - *last;
    for (int i = 0; i < n - 1; i++) {
        prof[c[i]] += part[i];
        rest -= part[i];
    }
    prof[c[n - 1]] += rest > 0 ? rest : 0;
    *last = now;
}

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static int64_t align64(int64_t n) { return (n + 63) & ~(int64_t)63; }

/* Activations in the stage's dtype: e(base, i) is element i of a buffer. */
typedef struct {
    int bf16;
    int64_t es;   /* element size */
} act_type;

static inline void *e(const act_type *a, void *base, int64_t i) { return (char *)base + i * a->es; }

static void to_f32(const act_type *a, const void *src, float *dst, int64_t n) {
    if (!a->bf16) {
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(((const uint16_t *)src)[i]);
}

/* Elements [i0, i1) of src rounded to the activations' dtype (a copy for float32). */
static void from_f32(const act_type *a, const float *src, void *dst, int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
        if (a->bf16) ((uint16_t *)dst)[i] = f32_to_bf16(src[i]);
        else ((float *)dst)[i] = src[i];
    }
}

/* float32 -> float8 e4m3 (finite, no infinities; |f| <= 448 here, clamped before), rounded to
 * nearest even as torch's .to(torch.float8_e4m3fn): below e4m3's smallest normal (2^-6) the value is
 * added to 2^14, whose float32 ulp is e4m3's subnormal step 2^-9, so the FPU rounds it; above, the
 * float32 mantissa's low 20 bits are rounded off (ties to the even kept bit) with the exponent rebased. */
static uint8_t f32_to_e4m3(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    const uint32_t sign = bits & 0x80000000u;
    bits ^= sign;
    uint8_t r;
    if (bits >= 0x43f00000u) {   /* 480 and above (not after the clamp): NaN */
        r = 0x7f;
    } else if (bits < (121u << 23)) {
        float g;
        memcpy(&g, &bits, 4);
        g += 16384.0f;
        memcpy(&bits, &g, 4);
        r = (uint8_t)(bits - (141u << 23));
    } else {
        bits += (uint32_t)(7 - 127) * (1u << 23) + 0x7ffffu + ((bits >> 20) & 1u);
        r = (uint8_t)(bits >> 20);
    }
    return (uint8_t)(r | (sign >> 24));
}

#if defined(__AVX512F__)
/* Values i .. i + 15 of x (the activations' dtype) as float32. */
static inline __m512 load_act16(const act_type *a, const void *x, int64_t i) {
    return a->bf16 ? load_bf16x16((const uint16_t *)x + i) : _mm512_loadu_ps((const float *)x + i);
}

/* quantize_kv_row's int8 case 16 values at a time (D a multiple of 16), the same operations lane by
 * lane (a true division, round to nearest even, the clamp), so the same bytes (one value at a time,
 * a prompt's rows took 2.2 ns a value; 16 at a time, 0.8 with the scattered writes). */
static void quantize_int8_row16(const act_type *a, const void *x, int64_t D, uint8_t *dst) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16)
        amax = _mm512_max_ps(_mm512_abs_ps(load_act16(a, x, i)), amax);   /* a NaN value is passed over */
    const float m = _mm512_reduce_max_ps(amax);
    const float scale = m > 0.0f ? m / 127.0f : 1.0f;
    const __m512 vs = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int64_t i = 0; i < D; i += 16) {
        const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(load_act16(a, x, i), vs),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm_storeu_si128((__m128i *)(dst + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(
                                                   _mm512_min_ps(_mm512_max_ps(q, lo), hi))));
    }
    memcpy(dst + D, &scale, sizeof(float));
}
#endif

/* One cache row of an 8-bit cache from D values of the activations' dtype: D codes and the float32
 * scale after them, as kv_quant.quantize makes it: scale = max|x| / 127 (int8) or / 448 (fp8), 1
 * for a zero row; int8 code = x / scale rounded to nearest even, clamped to +-127; fp8: x / scale
 * clamped to +-448, then rounded to e4m3. */
static void quantize_kv_row(const act_type *a, const void *x, int64_t D, int fp8, uint8_t *dst) {
#if defined(__AVX512F__)
    if (!fp8 && D % 16 == 0) {
        quantize_int8_row16(a, x, D, dst);
        return;
    }
#endif
    float v[D];
    float amax = 0.0f;
    for (int64_t i = 0; i < D; i++) {
        v[i] = a->bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
        amax = fabsf(v[i]) > amax ? fabsf(v[i]) : amax;
    }
    const float scale = amax > 0.0f ? amax / (fp8 ? 448.0f : 127.0f) : 1.0f;
    for (int64_t i = 0; i < D; i++) {
        const float q = v[i] / scale;
        if (fp8) {
            dst[i] = f32_to_e4m3(q < -448.0f ? -448.0f : q > 448.0f ? 448.0f : q);
        } else {
            const float r = rintf(q);
            dst[i] = (uint8_t)(int8_t)(r < -127.0f ? -127.0f : r > 127.0f ? 127.0f : r);
        }
    }
    memcpy(dst + D, &scale, sizeof(float));
}

/* quantize_kv_row of D float32 values (the tests compare it with kv_quant.quantize). */
void pipeserve_quantize_kv_row(const float *x, int64_t D, int fp8, uint8_t *dst) {
    const act_type f32 = {0, 4};
    quantize_kv_row(&f32, x, D, fp8, dst);
}

/* A prompt's new rows into an int8 cache (the Python layers' KV write; the fused stage's is write_kv):
 * row i of x (x_stride bytes apart: kv_heads x D values, bfloat16 where bf16, else float32) quantized
 * per kv head (quantize_kv_row) into cache slot slots[i], and read back as the cache holds it (code
 * times scale, rounded to x's dtype) into back [n, kv_heads, D]: kv_quant.write_rows' bytes and
 * result, without its dozen tensor ops a layer (5.3-5.9 % of a stage's time on the reference
 * workload with an int8 cache; benchmarks/README.md, thirty-eighth session). */
void pipeserve_write_kv_int8(const void *x, int64_t x_stride, int bf16, const int64_t *slots, int64_t n,
                             int64_t kv_heads, int64_t D, uint8_t *cache, void *back) {
    const act_type a = {bf16, bf16 ? 2 : 4};
    const int64_t row = D + (int64_t)sizeof(float);
    for (int64_t i = 0; i < n; i++)
        for (int64_t h = 0; h < kv_heads; h++) {
            uint8_t *dst = cache + (slots[i] * kv_heads + h) * row;
            quantize_kv_row(&a, (const char *)x + i * x_stride + h * D * a.es, D, 0, dst);
            float scale;
            memcpy(&scale, dst + D, sizeof scale);
            const int64_t at = (i * kv_heads + h) * D;
#if defined(__AVX512BF16__)
            if (D % 16 == 0) {   /* code times scale rounded to nearest even, 16 at a time */
                const __m512 vs = _mm512_set1_ps(scale);
                for (int64_t d = 0; d < D; d += 16) {
                    const __m512 value = _mm512_mul_ps(
                        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(dst + d)))), vs);
                    if (bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)back + at + d),
                                                  (__m256i)_mm512_cvtneps_pbh(value));
                    else _mm512_storeu_ps((float *)back + at + d, value);
                }
                continue;
            }
#endif
            for (int64_t d = 0; d < D; d++) {
                const float value = (float)(int8_t)dst[d] * scale;
                if (bf16) ((uint16_t *)back)[at + d] = f32_to_bf16(value);
                else ((float *)back)[at + d] = value;
            }
        }
}

/* The step's new k and v rows (rotated k in kr, v in vr: kv_heads x D values each, the activations'
 * dtype) into the caches at `slot`: copied, or quantized per kv head into an 8-bit cache. */
static void write_kv(const act_type *a, const stage_step *s, const stage_layer *L, int64_t slot, const void *kr,
                     const void *vr) {
    const int64_t D = s->head_dim, kvn = s->kv_heads * D;
    if (s->kv_dtype != KV_INT8 && s->kv_dtype != KV_FP8) {
        memcpy(L->k_cache + slot * kvn * a->es, kr, (size_t)(kvn * a->es));
        memcpy(L->v_cache + slot * kvn * a->es, vr, (size_t)(kvn * a->es));
        return;
    }
    const int64_t row = D + (int64_t)sizeof(float);   /* one byte a code, then the scale */
    for (int64_t h = 0; h < s->kv_heads; h++) {
        const int64_t at = (slot * s->kv_heads + h) * row;
        quantize_kv_row(a, e(a, (void *)kr, h * D), D, s->kv_dtype == KV_FP8, (uint8_t *)L->k_cache + at);
        quantize_kv_row(a, e(a, (void *)vr, h * D), D, s->kv_dtype == KV_FP8, (uint8_t *)L->v_cache + at);
    }
}

/* x (M rows of K) quantized once per kind of w's parts into act (part i's at slot
 * act_slot(w, i), act_stride bytes apart), by one thread: the matmul's first phase. `many`:
 * for the many-row kernel, once for every part (slot 0). */
static void prepare(const stage_kernels *k, const act_type *a, const qlinear *w, const void *x, int64_t M,
                    float *xf, char *act, int64_t act_stride, int many) {
    const int64_t K = w->part[0].K;
    if (w->part[0].kind == QW_DENSE) return;   /* the layer's only part, which reads x itself */
    if (a->bf16) to_f32(a, x, xf, M * K);
    if (many) {
        (many == MANY_AMX ? k->a_prepare : k->m_prepare)(w->part[0].kind, K, a->bf16 ? xf : (const float *)x, M, act);
        return;
    }
    for (int64_t i = 0; i < w->parts; i++)
        if (act_slot(w, i) == i)
            k->prepare(w->part[i].kind, K, a->bf16 ? xf : (const float *)x, M, act + i * act_stride);
}

/* Rows of activations one gemv call takes (cpu_kernels.GEMV_MAX_ROWS) where the kernels
 * take no more at once (VNNI builds): a step of more decodes multiplies in passes of this many
 * rows, as the Python layers do. AVX2 builds take every row in one pass (their kernel runs the
 * passes over tiles of weight rows, which then come from memory once). */
#define PASS_ROWS 8

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Whether w multiplies a step's M rows in one pass of a many-row kernel: MANY_AMX (k->a_*) where
 * it takes every part at M rows (as QuantKernels.matmul gives a linear's parts to it), else
 * MANY_I8 (k->m_*) where the 8-bit kernel takes every part's layout at M rows (more than a gemv
 * pass; i4 from 6: m_act_bytes says), else 0. */
static int many_rows(const stage_kernels *k, const qlinear *w, int64_t M) {
    int amx = k->a_rows != NULL && w->part[0].kind != QW_DENSE;
    for (int64_t i = 0; amx && i < w->parts; i++) {
        const qweight *p = &w->part[i];
        amx = M >= k->a_min_rows && M >= p->N / k->a_per_out && k->a_act_bytes(p->kind, p->K, p->group, M) > 0;
    }
    if (amx) return MANY_AMX;
    if (!k->m_rows) return 0;
    for (int64_t i = 0; i < w->parts; i++)
        if (k->m_act_bytes(w->part[i].kind, w->part[i].K, w->part[i].group, M) == 0) return 0;
    return MANY_I8;
}

/* Thread t of T's output rows of out [M, N] = x W^T (+ bias), per part contiguous equal
 * ranges as schedule(static). One float32 part writes out in place; otherwise part i goes
 * through its own region of the float scratch f32 ([M, N_i] at M * its column offset, so
 * no thread's part overwrites what another still copies) and is copied to its columns,
 * rounded as the gemv rounds bfloat16 outputs; then the bias is added and rounded as
 * PyTorch adds it. A plain bfloat16 weight (QW_DENSE, the layer's only part) reads x (the bfloat16
 * rows) and writes its columns of out itself, bias included. `many`: by the many-row kernel.
 * Returns 0, or -1 when its scratch cannot be had (or bf16_gemv.c refuses the rows, which the
 * caller's row limit rules out). */
static int thread_rows(const stage_kernels *k, const act_type *a, const qlinear *w, const void *bias,
                       const char *act, int64_t act_stride, const void *x, int64_t M, void *out, float *f32, int t,
                       int T, int many) {
    const int64_t Nt = linear_n(w);
    const int direct = !a->bf16 && w->parts == 1;
    int64_t off = 0;
    for (int64_t i = 0; i < w->parts; off += w->part[i].N, i++) {
        const qweight *p = &w->part[i];
        const int64_t N = p->N, n0 = N * t / T, n1 = N * (t + 1) / T;
        if (p->kind == QW_DENSE) {   /* the only part: bfloat16 out with its bias, as layers.Linear */
            if (k->d_rows((const uint16_t *)p->qs, N, p->K, (const uint16_t *)x, M, (const uint16_t *)bias, n0, n1,
                          (uint16_t *)out) != 0)
                return -1;
            continue;
        }
        float *res = direct ? (float *)out : f32 + M * off;
        if (many) {
            if ((many == MANY_AMX ? k->a_rows : k->m_rows)(p->kind, p->qs, p->sc, p->mn, N, p->K, p->group, p->qh,
                                                           p->zero, act, M, n0, n1, res) != 0)
                return -1;
        } else {
            k->rows(p->kind, p->qs, p->sc, p->mn, N, p->K, p->group, p->qh, p->zero,
                    act + act_slot(w, i) * act_stride, M, n0, n1, res);
        }
        for (int64_t m = 0; m < M; m++) {
            if (!direct) from_f32(a, res + m * N, e(a, out, m * Nt + off), n0, n1);
            if (!bias) continue;
            for (int64_t n = n0; n < n1; n++) {
                if (a->bf16) {
                    uint16_t *o = (uint16_t *)out + m * Nt + off + n;
                    *o = f32_to_bf16(bf16_to_f32(*o) + bf16_to_f32(((const uint16_t *)bias)[off + n]));
                } else {
                    ((float *)out)[m * Nt + off + n] += ((const float *)bias)[off + n];
                }
            }
        }
    }
    return 0;
}

/* All T threads: out [M, N] = x W^T (+ bias) in passes of P rows; the caller has prepared
 * the first pass's activations (the first min(M, P) rows of x) in act. Before a later pass
 * overwrites act, the team meets (every thread is done reading it). `many`: the many-row kernel
 * (P = M). Returns 0, or -1 (this thread's scratch). */
static int team_rows(const stage_kernels *k, const act_type *a, const qlinear *w, const void *bias,
                     const void *x, int64_t M, int64_t P, void *out, float *f32, float *xf, char *act,
                     int64_t act_stride, int t, int T, int many) {
    int rc = 0;
    const int64_t K = w->part[0].K, N = linear_n(w);
    for (int64_t m0 = 0; m0 < M; m0 += P) {
        const int64_t mc = min64(P, M - m0);
        if (m0 > 0) {
            TEAM_BARRIER(T);
#pragma omp single nowait
            prepare(k, a, w, e(a, (void *)x, m0 * K), mc, xf, act, act_stride, many);
            TEAM_BARRIER(T);
        }
        rc |= thread_rows(k, a, w, bias, act, act_stride, e(a, (void *)x, m0 * K), mc, e(a, out, m0 * N), f32, t, T,
                          many);
    }
    return rc;
}

/* h [rows, hidden] in the activations' dtype: the stage's input, overwritten with its
 * output. Returns 0, -1 when scratch cannot be allocated, -2 when a layer's attention
 * plan cannot be made. */
int pipeserve_decode_stage(const stage_kernels *k, const stage_layer *layers, int64_t num_layers,
                           const stage_step *s, void *h, int num_threads) {
    const act_type at = {(int)s->bf16, s->bf16 ? 2 : 4}, *a = &at;
    const int64_t M = s->rows;
    const int64_t D = s->head_dim, qn = s->heads * D, kvn = s->kv_heads * D, qkv_n = qn + 2 * kvn;
    const int64_t widest = max64(max64(qkv_n, 2 * s->inter), s->hidden);
    int64_t P = M;     /* rows of one gemv pass: all of them where every part's kernel takes them */
    for (int64_t l = 0; l < num_layers; l++) {
        const qlinear *ws[4] = {&layers[l].qkv, &layers[l].o, &layers[l].gate_up, &layers[l].down};
        for (int i = 0; i < 4; i++) {
            if (many_rows(k, ws[i], M)) continue;   /* one pass of the many-row kernel */
            for (int64_t j = 0; j < ws[i]->parts; j++)
                if (ws[i]->part[j].kind != QW_DENSE
                    && k->act_bytes(ws[i]->part[j].kind, ws[i]->part[j].K, ws[i]->part[j].group, M) == 0)
                    P = min64(M, PASS_ROWS);
        }
    }
    int64_t act = 0;   /* the largest prepared activations of one part */
    for (int64_t l = 0; l < num_layers; l++) {
        const qlinear *ws[4] = {&layers[l].qkv, &layers[l].o, &layers[l].gate_up, &layers[l].down};
        for (int i = 0; i < 4; i++) {
            const int many = many_rows(k, ws[i], M);
            for (int64_t j = 0; j < ws[i]->parts; j++) {
                const qweight *p = &ws[i]->part[j];
                if (p->kind == QW_DENSE) continue;
                act = max64(act, many == MANY_AMX ? k->a_act_bytes(p->kind, p->K, p->group, M)
                                 : many ? k->m_act_bytes(p->kind, p->K, p->group, M)
                                        : k->act_bytes(p->kind, p->K, p->group, P));
            }
        }
    }
    const int64_t act_stride = align64(act);
    /* residual, normed x, qkv, rotated q|k, attention out, o out, gate|up, silu out (the
     * activations' dtype); the float q, attention out, a matmul's input and output (float) */
    const int64_t sizes[12] = {M * s->hidden, M * s->hidden, M * qkv_n, M * (qn + kvn), M * qn, M * s->hidden,
                               M * 2 * s->inter, M * s->inter, M * qn, M * qn, M * widest, M * widest};
    int64_t bytes = MAX_PARTS * act_stride + align64(k->plan_bytes(M, s->heads, D, num_threads));
    for (int i = 0; i < 12; i++) bytes += align64(sizes[i] * (i < 8 ? a->es : (int64_t)sizeof(float)));
    char *buf = aligned_alloc(64, (size_t)bytes);
    if (!buf) return -1;
    void *f[12];
    char *p = buf;
    for (int i = 0; i < 12; i++) {
        f[i] = p;
        p += align64(sizes[i] * (i < 8 ? a->es : (int64_t)sizeof(float)));
    }
    void *res = f[0], *x = f[1], *qkv = f[2], *qk = f[3], *attn = f[4], *o = f[5], *gu = f[6], *act_in = f[7];
    float *q = f[8], *attn32 = f[9], *xf = f[10], *out32 = f[11];
    char *actbuf = p;
    void *plan = p + MAX_PARTS * act_stride;
    int failed = 0, scratch_failed = 0;
    int64_t items = 0;
    double *prof = s->prof;
    double part[2];                        /* a one-thread block's measured parts (--profile) */
    static const int rows_gemm[2] = {PROF_ROWS, PROF_GEMM}, gemm[1] = {PROF_GEMM}, attention[1] = {PROF_ATTENTION},
                     rope_write_plan[3] = {PROF_ROWS, PROF_KV_WRITE, PROF_ATTENTION};
#pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        double last = t == 0 ? stamp(prof) : 0.0;
        for (int64_t l = 0; l < num_layers && !failed; l++) {
            const stage_layer *L = &layers[l];
            /* per linear: the many-row kernel in one pass, or gemv passes of P rows */
            const int m_qkv = many_rows(k, &L->qkv, M), m_o = many_rows(k, &L->o, M);
            const int m_gu = many_rows(k, &L->gate_up, M), m_down = many_rows(k, &L->down, M);
            const int64_t P_qkv = m_qkv ? M : P, P_o = m_o ? M : P, P_gu = m_gu ? M : P, P_down = m_down ? M : P;
            int rc = 0;
#pragma omp single nowait
            {   /* x, r = rmsnorm(h + r) (the first layer: r = h) */
                const double t0 = stamp(prof);
                if (l == 0) k->rmsnorm(h, NULL, NULL, L->input_norm, x, M, s->hidden, s->eps);
                else k->rmsnorm(h, res, res, L->input_norm, x, M, s->hidden, s->eps);
                if (l == 0) memcpy(res, h, (size_t)(M * s->hidden * a->es));
                part[0] = stamp(prof) - t0;
                prepare(k, a, &L->qkv, x, P_qkv, xf, actbuf, act_stride, m_qkv);
            }
            TEAM_BARRIER(T);
            account(prof, t, &last, rows_gemm, part, 2);
            rc |= team_rows(k, a, &L->qkv, L->qkv_bias, x, M, P_qkv, qkv, out32, xf, actbuf, act_stride, t, T, m_qkv);
            TEAM_BARRIER(T);
            account(prof, t, &last, gemm, part, 1);
#pragma omp single nowait
            {   /* norm each head of q and k (Qwen3), in place; rotate q and k (adjacent in each
                 * row) in one call; cache k and v; plan */
                const double t0 = stamp(prof);
                for (int64_t m = 0; L->q_norm && m < M; m++) {
                    void *row = e(a, qkv, m * qkv_n);
                    k->rmsnorm(row, NULL, NULL, L->q_norm, row, s->heads, D, s->eps);
                    k->rmsnorm(e(a, row, qn), NULL, NULL, L->k_norm, e(a, row, qn), s->kv_heads, D, s->eps);
                }
                if (s->positions)
                    for (int64_t m = 0; m < M; m++)
                        k->rope(e(a, qkv, m * qkv_n), qkv_n, e(a, qk, m * (qn + kvn)), 1, s->heads + s->kv_heads, D,
                                s->cos + s->positions[m] * D, s->sin + s->positions[m] * D);
                else
                    k->rope(qkv, qkv_n, qk, M, s->heads + s->kv_heads, D, s->cos, s->sin);
                const double t1 = stamp(prof);
                for (int64_t m = 0; m < M; m++) {
                    to_f32(a, e(a, qk, m * (qn + kvn)), q + m * qn, qn);
                    write_kv(a, s, L, s->slots[m], e(a, qk, m * (qn + kvn) + qn), e(a, qkv, m * qkv_n + qn + kvn));
                }
                part[0] = t1 - t0;
                part[1] = stamp(prof) - t1;
                items = k->plan(plan, s->context_lens, M, s->heads, s->kv_heads, D, s->block_size, L->window, T);
                if (items < 0) failed = 1;
            }
            TEAM_BARRIER(T);
            account(prof, t, &last, rope_write_plan, part, 3);
            if (failed) break;
            {
                int64_t i0, i1;
                k->share(plan, t, &i0, &i1);
                k->items(plan, q, L->k_cache, L->v_cache, (int)s->kv_dtype, s->block_tables, s->max_blocks,
                         s->context_lens, s->scale, L->softcap, a->bf16, i0, i1);
            }
            TEAM_BARRIER(T);
            {
                const int64_t bh0 = M * s->heads * t / T, bh1 = M * s->heads * (t + 1) / T;
                k->merge(plan, bh0, bh1, attn32);
                from_f32(a, attn32, attn, bh0 * D, bh1 * D);
            }
            TEAM_BARRIER(T);
            account(prof, t, &last, attention, part, 1);
#pragma omp single nowait
            prepare(k, a, &L->o, attn, P_o, xf, actbuf, act_stride, m_o);
            TEAM_BARRIER(T);
            rc |= team_rows(k, a, &L->o, NULL, attn, M, P_o, o, out32, xf, actbuf, act_stride, t, T, m_o);
            TEAM_BARRIER(T);
            account(prof, t, &last, gemm, part, 1);
#pragma omp single nowait
            {   /* x, r = rmsnorm(o + r) */
                const double t0 = stamp(prof);
                k->rmsnorm(o, res, res, L->post_norm, x, M, s->hidden, s->eps);
                part[0] = stamp(prof) - t0;
                prepare(k, a, &L->gate_up, x, P_gu, xf, actbuf, act_stride, m_gu);
            }
            TEAM_BARRIER(T);
            account(prof, t, &last, rows_gemm, part, 2);
            rc |= team_rows(k, a, &L->gate_up, NULL, x, M, P_gu, gu, out32, xf, actbuf, act_stride, t, T, m_gu);
            TEAM_BARRIER(T);
            account(prof, t, &last, gemm, part, 1);
#pragma omp single nowait
            {
                const double t0 = stamp(prof);
                k->silu_mul(gu, act_in, M, s->inter);
                part[0] = stamp(prof) - t0;
                prepare(k, a, &L->down, act_in, P_down, xf, actbuf, act_stride, m_down);
            }
            TEAM_BARRIER(T);
            account(prof, t, &last, rows_gemm, part, 2);
            rc |= team_rows(k, a, &L->down, NULL, act_in, M, P_down, h, out32, xf, actbuf, act_stride, t, T, m_down);
            if (rc) {
#pragma omp atomic write
                scratch_failed = 1;
            }
            TEAM_BARRIER(T);
            account(prof, t, &last, gemm, part, 1);
            if (scratch_failed) break;   /* every thread sees it after the barrier */
        }
    }
    if (!failed && !scratch_failed) {   /* h + r, rounded as PyTorch's add */
        for (int64_t i = 0; i < M * s->hidden; i++) {
            if (a->bf16) {
                uint16_t *hi = (uint16_t *)h + i;
                *hi = f32_to_bf16(bf16_to_f32(*hi) + bf16_to_f32(((const uint16_t *)res)[i]));
            } else {
                ((float *)h)[i] += ((const float *)res)[i];
            }
        }
    }
    free(buf);
    return scratch_failed ? -1 : failed ? -2 : 0;
}
