/* Paged attention kernels for CPUs: keys and values read in place from the
 * paged cache (no gathered copy). Built by pipeserve/kernels/build.py with -O3
 * -march=native -fopenmp; called through ctypes, which releases the GIL.
 *
 * Cache layout (as pipeserve.model.attention): K and V are each
 * [num_blocks, block_size, kv_heads, head_dim]; token p of sequence b lives in
 * block block_tables[b][p / block_size], row p % block_size.
 *
 * Per call (one layer): a sliding window W > 0 limits the query at position p
 * to keys p - W < j <= p (transformers' convention; W = 0: no window), so a
 * decode reads only the blocks its window touches; a soft cap c > 0 maps each
 * scaled score s to c tanh(s / c) before the softmax (Gemma 2; c = 0: none).
 *
 * Decode (one query token per sequence) is a stream over memory: each key and
 * value row is used once per step, so the kernel is built to keep the memory
 * busy rather than to save arithmetic.
 * - Work item = (sequence, range of keys), every kv head. The G = heads / kv_heads
 *   query heads that share a kv head are scored against up to 16 keys at
 *   once (a tile, within one block), folded into a running max and sum (online
 *   softmax, as flash decoding), and the same rows' values are accumulated
 *   right away: one pass over K and V, accumulation in float32 whatever the
 *   cache dtype. The AVX512_BF16 path folds a chunk of up to 256 keys at a time
 *   instead of a tile (every tile's scores, then the chunk's max and
 *   probabilities, then its values: independent work where a tile at a time was
 *   one chain of latencies).
 * - AVX2 path: a tile is done for every kv head before the next, its key rows
 *   read in address order (all kv heads of a token are one contiguous row), so
 *   each block of K and V is streamed whole, once. Blocks sit anywhere in
 *   memory and the hardware prefetcher stops at each one's end, so the loop
 *   asks for the tile's V rows while it scores its keys, and for the next
 *   tile's K rows while it sums the values: about two half-tiles (K and V of
 *   one block) in L1 at a time. Measured on the 2-core development VM (float32,
 *   SmolLM2's shape, one core): ~42 ns per key and kv head from memory, against
 *   ~70 for the earlier item = (range, kv head) walk, which read each block in
 *   three strided passes.
 * - AVX-512 paths: a tile is done for every kv head of a pass (up to PASS_MAX_HEADS
 *   query heads) before the next, so each key's row and each block is read as one
 *   run, asking for the rows PF_AHEAD_ROWS keys ahead (into L2: K's before a kv
 *   head's scores, V's before its values, a kv head's part at a time between their
 *   work: reading 6 KiB blocks in random order went from ~4 to ~9 GB/s on one core
 *   with prefetching, K's and V's apart from one burst 1.19-1.39x again, and the
 *   one-pass walk 1.2-1.4x the earlier pass per kv head from memory;
 *   benchmarks/README.md). The portable path makes a pass per kv head.
 * - Split-K: when one sequence holds a large share of the step's keys (a single
 *   long request), its keys are cut into ranges of whole blocks so every thread
 *   has work; each range leaves per query head its max m, sum l of exp(s - m)
 *   and unnormalised output, and a last pass merges the ranges of a sequence
 *   (out = sum_r e^(m_r - M) acc_r / sum_r e^(m_r - M) l_r).
 * - Vector paths: AVX-512 (16 lanes; AVX512_BF16 products for bf16 rows), else AVX2 +
 *   FMA + F16C (8 lanes, the same single pass: attend_range_avx2), else portable C
 *   (pipeserve_decode_isa says which was compiled).
 * - 8-bit caches (--kv-cache-dtype int8 | fp8, pipeserve/model/kv_quant.py):
 *   a row is head_dim codes then its float32 scale. Codes are widened to
 *   float32 in registers (fp8 e4m3 through its float16 bit pattern, which is
 *   the value / 256, exact); the key's scale multiplies its 16 scores, the
 *   value's scale its probability before the PV FMAs, so nothing is
 *   dequantized in memory and the sum of probabilities is untouched.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int int8_on_codes(void);   /* how an int8 cache's bf16 decodes go (pipeserve_decode_i8_codes) */

#include "vec_math.h"

enum { DT_FLOAT32 = 0, DT_BFLOAT16 = 1, DT_FLOAT16 = 2, DT_INT8 = 3, DT_FP8 = 4 };

/* 8-bit caches: each row's codes are followed by a float32 scale. */
#define SCALE_BYTES 4
static inline int is_8bit(int dtype) { return dtype == DT_INT8 || dtype == DT_FP8; }
static inline int64_t elem_bytes(int dtype) { return dtype == DT_FLOAT32 ? 4 : is_8bit(dtype) ? 1 : 2; }
/* Bytes of one (token, kv head) row. */
static inline int64_t head_row_bytes(int dtype, int64_t head_dim) {
    return head_dim * elem_bytes(dtype) + (is_8bit(dtype) ? SCALE_BYTES : 0);
}

/* fp8 e4m3 bits -> the float16 bits of its value / 256 (exact, subnormals included:
 * the exponent field moves from 4 to 5 bits with the bias gap 15 - 7 = 8). */
static inline uint16_t fp8_as_f16_bits(uint8_t b) {
    return (uint16_t)(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7));
}

/* The scale of an 8-bit row whose codes start at src (fp8: times 256, see fp8_as_f16_bits). */
static inline float row_scale(const char *src, int dtype, int64_t head_dim) {
    float s;
    memcpy(&s, src + head_dim, sizeof s);
    return dtype == DT_FP8 ? s * 256.0f : s;
}

/* Keys per tile: one tree reduction (hsum16) scores 16 keys of a head. */
#define TILE 16
/* Keys ahead whose rows the AVX-512 passes prefetch (they read every kv head of a key's row).
 * A pass per kv head had taken 32 (16, 32 and 64 alike; no prefetch or whole blocks at once ~2x
 * slower on blocks in random order); every kv head's rows are 3x as many bytes. 20-40 measured alike
 * (SmolLM2's shape, 64 x 512 keys from memory, one thread: 11.5-12.3 ns a key and kv head), 16
 * 13.3, 8 19.8; 32 alone fell out at 14.3-16.7 (benchmarks/README.md, thirty-first session), all
 * into L1; into L2 (prefetch_part_ahead_of), 24, 32 and 48 alike (forty-third session). */
#ifndef PF_AHEAD_ROWS
#define PF_AHEAD_ROWS 24
#endif
/* Query heads one such pass scores at most (its chunk's scores and probabilities stay ~50 KiB). */
#define PASS_MAX_HEADS 32
/* Split-K: aim for this many key ranges per thread over the step, so that
 * dynamic scheduling evens out; a range is at least SPLIT_MIN_KEYS keys (the
 * merge and the per-range setup cost about as much as a few keys). */
#define SPLIT_PER_THREAD 8
#define SPLIT_MIN_KEYS 128
/* A fixed share of a step per thread (pipeserve_decode_share) cuts a sequence at the
 * share's first block where the step has this many keys a thread; a smaller step is
 * shared out in whole sequences (merging the parts would cost more than it evens out). */
#define SHARE_MIN_KEYS 64
/* A step of fewer (key, kv head) rows than this runs on the calling thread: at ~40 ns
 * a row on one AVX2 core that is under ~80 us, less than a thread team's fork and join
 * cost once the machine is loaded (the join waits for every thread to be scheduled). */
#define PARALLEL_MIN_ROWS 2048

/* Row of `n` cache elements -> float32. */
static inline void load_row(const void *src, int dtype, int64_t n, float *restrict dst) {
    if (dtype == DT_FLOAT32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == DT_BFLOAT16) {
        const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    } else if (dtype == DT_FLOAT16) {
        const _Float16 *s = (const _Float16 *)src;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i];
    } else if (dtype == DT_INT8) {
        const int8_t *s = (const int8_t *)src;
        const float scale = row_scale((const char *)src, dtype, n);
#pragma omp simd
        for (int64_t i = 0; i < n; i++) dst[i] = (float)s[i] * scale;
    } else {
        const uint8_t *s = (const uint8_t *)src;
        const float scale = row_scale((const char *)src, dtype, n);
        for (int64_t i = 0; i < n; i++) {
            const uint16_t bits = fp8_as_f16_bits(s[i]);
            _Float16 h;
            memcpy(&h, &bits, sizeof h);
            dst[i] = (float)h * scale;
        }
    }
}

/* The first key a decode at position ctx - 1 sees. */
static inline int64_t window_start(int64_t ctx, int64_t window) {
    return window > 0 && ctx > window ? ctx - window : 0;
}

/* One work item: keys begin .. end - 1 of one sequence, every kv head (the per-head
 * passes of the AVX-512 and portable paths see one kv head: kv_heads 1, head_offset set). */
typedef struct {
    const char *k, *v;          /* the layer's caches */
    const int64_t *table;       /* the sequence's block table */
    int64_t begin, end;
    int64_t head_offset;        /* bytes from a row's start to the first kv head attended */
    int64_t row_stride;         /* bytes between tokens of a block */
    int64_t block_size, kv_heads, group;
    float scale, softcap;
} key_range;

/* Byte offset of key t's row (this kv head) in either cache. */
static inline int64_t key_offset(const key_range *r, int64_t t) {
    return (r->table[t / r->block_size] * r->block_size + t % r->block_size) * r->row_stride + r->head_offset;
}

/* Keys of the tile that starts at t: up to TILE, never past the range or the block. */
static inline int64_t tile_rows(const key_range *r, int64_t t) {
    const int64_t to_block_end = r->block_size - t % r->block_size;
    int64_t rows = r->end - t < TILE ? r->end - t : TILE;
    return rows < to_block_end ? rows : to_block_end;
}

/* Key t of a range walked in order: row `row` of the sequence's block `block`,
 * advanced without a division per step (a 64-bit divide costs about as much
 * as scoring a key). */
typedef struct {
    int64_t t, block, row;
} key_cursor;

static inline key_cursor cursor_at(const key_range *r, int64_t t) {
    return (key_cursor){t, t / r->block_size, t % r->block_size};
}

static inline int64_t cursor_offset(const key_range *r, const key_cursor *c) {
    return (r->table[c->block] * r->block_size + c->row) * r->row_stride + r->head_offset;
}

/* Keys of the tile at c: up to TILE, never past the range or the block. */
static inline int64_t cursor_rows(const key_range *r, const key_cursor *c) {
    const int64_t to_block_end = r->block_size - c->row;
    const int64_t rows = r->end - c->t < TILE ? r->end - c->t : TILE;
    return rows < to_block_end ? rows : to_block_end;
}

static inline void cursor_advance(const key_range *r, key_cursor *c, int64_t n) {
    c->t += n;
    c->row += n;
    while (c->row >= r->block_size) {
        c->row -= r->block_size;
        c->block++;
    }
}

/* What an item leaves per query head, PART_HEAD + head_dim floats: the running
 * max m, the sum l of exp(s - m), then the unnormalised output. */
#define PART_HEAD 2

static void start_parts(float *part, int64_t group, int64_t head_dim) {
    for (int64_t g = 0; g < group; g++) {
        float *pg = part + g * (PART_HEAD + head_dim);
        pg[0] = -INFINITY;
        pg[1] = 0.0f;
        memset(pg + PART_HEAD, 0, (size_t)head_dim * sizeof(float));
    }
}

/* Fold scores s[0 .. rows) of one head into its part: s <- exp(s - m_new), and
 * the head's output so far scaled by exp(m - m_new) (skipped when the max holds). */
static void fold_scores(float *s, int64_t rows, float softcap, float *part, int64_t head_dim) {
    if (softcap > 0.0f)
        for (int64_t i = 0; i < rows; i++) s[i] = softcap * tanh_f32(s[i] / softcap);
    float mx = part[0];
    for (int64_t i = 0; i < rows; i++) mx = s[i] > mx ? s[i] : mx;
    const float alpha = exp_f32(part[0] - mx);   /* exactly 1 when the max holds */
    float sum = 0.0f;
    for (int64_t i = 0; i < rows; i++) {
        s[i] = exp_f32(s[i] - mx);
        sum += s[i];
    }
    part[0] = mx;
    part[1] = part[1] * alpha + sum;
    if (alpha != 1.0f)
        for (int64_t d = 0; d < head_dim; d++) part[PART_HEAD + d] *= alpha;
}

/* Any head_dim, any CPU. */
static void attend_range_scalar(const float *restrict q, const key_range *r, int dtype, int64_t head_dim,
                                float *restrict part) {
    const int64_t group = r->group, pstride = PART_HEAD + head_dim;
    float qs[group * head_dim], row[head_dim], s[group][TILE];
    for (int64_t i = 0; i < group * head_dim; i++) qs[i] = q[i] * r->scale;
    start_parts(part, group, head_dim);
    for (int64_t t = r->begin; t < r->end;) {
        const int64_t rows = tile_rows(r, t);
        for (int64_t i = 0; i < rows; i++) {
            load_row(r->k + key_offset(r, t + i), dtype, head_dim, row);
            for (int64_t g = 0; g < group; g++) {
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < head_dim; d++) dot += qs[g * head_dim + d] * row[d];
                s[g][i] = dot;
            }
        }
        for (int64_t g = 0; g < group; g++) fold_scores(s[g], rows, r->softcap, part + g * pstride, head_dim);
        for (int64_t i = 0; i < rows; i++) {
            load_row(r->v + key_offset(r, t + i), dtype, head_dim, row);
            for (int64_t g = 0; g < group; g++) {
                float *acc = part + g * pstride + PART_HEAD;
                const float p = s[g][i];
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) acc[d] += p * row[d];
            }
        }
        t += rows;
    }
}

/* Attends a range of keys: q [kv_heads * group, head_dim], part [kv_heads * group, PART_HEAD + head_dim]. */
typedef void (*range_fn)(const float *, const key_range *, int, int64_t, float *);

/* `one` over r's kv heads `per` at a time (one attends its range's kv heads from head_offset). */
static void kv_passes(range_fn one, const float *q, const key_range *r, int dtype, int64_t head_dim, float *part,
                      int64_t per) {
    key_range pass = *r;
    for (int64_t kvh = 0; kvh < r->kv_heads; kvh += per) {
        pass.kv_heads = r->kv_heads - kvh < per ? r->kv_heads - kvh : per;
        pass.head_offset = r->head_offset + kvh * head_row_bytes(dtype, head_dim);
        one(q + kvh * r->group * head_dim, &pass, dtype, head_dim, part + kvh * r->group * (PART_HEAD + head_dim));
    }
}

/* The portable path walks a range once per kv head. */
static void each_kv_head(range_fn one, const float *q, const key_range *r, int dtype, int64_t head_dim,
                         float *part) {
    kv_passes(one, q, r, dtype, head_dim, part, 1);
}

/* The AVX-512 paths take as many kv heads a pass as keep its query heads within
 * PASS_MAX_HEADS: every kv head of a row at once where they fit, reading each key's row in one
 * contiguous run (a block's in one) instead of one strided pass per kv head. */
static __attribute__((unused)) void each_kv_group(range_fn one, const float *q, const key_range *r, int dtype,
                                                  int64_t head_dim, float *part) {
    kv_passes(one, q, r, dtype, head_dim, part, r->group >= PASS_MAX_HEADS ? 1 : PASS_MAX_HEADS / r->group);
}

/* The scales of a tile's `rows` 8-bit rows at src, row_stride apart (0 past rows). */
static inline void row_scales(const char *src, int64_t rows, int64_t row_stride, int dtype, int64_t head_dim,
                              float *out) {
    for (int64_t j = 0; j < TILE; j++) out[j] = j < rows ? row_scale(src + j * row_stride, dtype, head_dim) : 0.0f;
}

/* The scales of a tile's 8-bit K and V rows (0 past rows). */
static inline void tile_scales(const char *keys, const char *values, int64_t rows, int64_t row_stride, int dtype,
                               int64_t head_dim, float *ks, float *vs) {
    row_scales(keys, rows, row_stride, dtype, head_dim, ks);
    row_scales(values, rows, row_stride, dtype, head_dim, vs);
}

/* The vector decode paths: AVX-512, or else AVX2 + FMA (+ F16C for float16 and fp8 rows). */
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define VECTOR_DECODE 1
#include <immintrin.h>

/* Fully unrolled loops over heads and vectors keep the accumulators in registers. */
#define UNROLL _Pragma("GCC unroll 16")

#endif

#if defined(__AVX512F__)

/* Ask for bytes [lo, hi) (a kv head's part) of the rows of `base` (K or V) of the next `rows`
 * keys from pf, which runs PF_AHEAD_ROWS keys ahead of the tile being computed; the caller moves
 * pf past the tile once every kv head's part is asked for. K's before a kv head's scores, V's
 * before its values (each with its own cursor): K's and V's together at the tile's start were
 * one burst of prefetches that the scores' own loads queued behind (bfloat16, one thread:
 * 1.19-1.39x the time per call; benchmarks/README.md, twenty-fourth session), and so were all
 * of a key's kv heads at once (20.5 against 14.7 ns a key and kv head, thirty-first session).
 * Into L2 (T1): on a Zen 4 host the T0 prefetches stalled at the core's miss buffers (a
 * quarter of the kernel's samples on the instruction after a prefetcht0) and T1 measured 2x as
 * fast from memory (SmolLM2's shape, 100 x 400 keys: 16.2-17.2 against 33-35 ns a key and kv
 * head at one thread, 9.5 against 18.2 at two, a 70B's shape 46.8 against 78.2; level in L2),
 * where the thirty-first session's host had T0 ahead by 2-10 % (12.0 against 12.2-12.6 ns at one
 * thread; benchmarks/README.md, forty-third session). */
static inline __attribute__((always_inline)) void prefetch_part_ahead_of(const key_range *r, key_cursor pf,
                                                                         int64_t rows, int64_t lo, int64_t hi,
                                                                         const char *base) {
    for (; rows > 0 && pf.t < r->end; rows--) {
        const int64_t off = cursor_offset(r, &pf);
        for (int64_t b = lo; b < hi; b += 64) _mm_prefetch(base + off + b, _MM_HINT_T1);
        cursor_advance(r, &pf, 1);
    }
}

/* The first PF_AHEAD_ROWS keys' rows, at the start of an item. */
static void prefetch_first(const key_range *r, int64_t head_bytes) {
    const int64_t stop = r->begin + PF_AHEAD_ROWS < r->end ? r->begin + PF_AHEAD_ROWS : r->end;
    for (int64_t u = r->begin; u < stop; u++)
        for (int64_t b = 0; b < head_bytes; b += 64) {
            _mm_prefetch(r->k + key_offset(r, u) + b, _MM_HINT_T1);
            _mm_prefetch(r->v + key_offset(r, u) + b, _MM_HINT_T1);
        }
}
/* 16 cache elements -> 16 floats. `dtype` is a constant in each caller. */
static inline __attribute__((always_inline)) __m512 load16(const char *src, int dtype) {
    if (dtype == DT_BFLOAT16) return load_bf16x16((const uint16_t *)src);
    if (dtype == DT_FLOAT16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)src));
    if (dtype == DT_INT8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src)));
    if (dtype == DT_FP8) {   /* codes only: the row's scale carries the 256 (fp8_as_f16_bits) */
        const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src));
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                          _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
        return _mm512_cvtph_ps(h);
    }
    return _mm512_loadu_ps((const float *)src);
}

/* The max of 16 lanes, in every lane. */
static inline __attribute__((always_inline)) __m512 max16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, 0x4E));
    x = _mm512_max_ps(x, _mm512_shuffle_f32x4(x, x, 0xB1));
    x = _mm512_max_ps(x, _mm512_permute_ps(x, 0x4E));
    return _mm512_max_ps(x, _mm512_permute_ps(x, 0xB1));
}

/* Sixteen vectors -> one vector of their sixteen horizontal sums (lane j = sum of d[j]):
 * a transposing tree of 45 shuffles and adds instead of 16 separate reductions. */
static inline __attribute__((always_inline)) __m512 hsum16(const __m512 d[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)  /* 128-bit lane: [d0 a+c, d1 a+c, d0 b+d, d1 b+d] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(d[2 * i], d[2 * i + 1]),
                             _mm512_unpackhi_ps(d[2 * i], d[2 * i + 1]));
    for (int i = 0; i < 4; i++)  /* 128-bit lane: partial sums of d[4i .. 4i+3] */
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

enum { DOT_FMA = 0, DOT_BF16 = 1 };

/* q_h . k for one key row: DOT_FMA widens `nvec` vectors of 16 cache elements
 * and multiplies them with float32 q; DOT_BF16 (AVX512_BF16, bf16 caches)
 * multiplies `nvec` pairs of 32 bf16 with vdpbf16ps. `kind` is a constant in
 * each caller. Returns 16 partial sums. */
static inline __attribute__((always_inline)) __m512 row_dot(const char *qh, const char *src, const int kind,
                                                            const int dtype, const int64_t elem,
                                                            const int64_t nvec) {
#if defined(__AVX512BF16__)
    if (kind == DOT_BF16) {
        const __m512bh *q = (const __m512bh *)qh;
        __m512 dot = _mm512_setzero_ps();
        for (int64_t w = 0; w < nvec; w++)
            dot = _mm512_dpbf16_ps(dot, q[w], (__m512bh)_mm512_loadu_si512(src + 64 * w));
        return dot;
    }
#endif
    const __m512 *q = (const __m512 *)qh;
    __m512 dot = _mm512_mul_ps(q[0], load16(src, dtype));
    for (int64_t v = 1; v < nvec; v++) dot = _mm512_fmadd_ps(q[v], load16(src + 16 * v * elem, dtype), dot);
    return dot;
}

/* Scores of one head against the tile's `rows` keys (lanes past rows: -inf),
 * times the keys' scales when kscale is given (8-bit caches), soft-capped, folded into the head's part (running max and sum, output
 * rescaled when the max grows). Returns the probabilities exp(s - m), 0 past rows. */
static inline __attribute__((always_inline)) __m512 tile_probs(const char *qh, const char *keys, int64_t rows,
                                                               int64_t row_stride, const int kind, const int dtype,
                                                               const int64_t elem, const int64_t nvec,
                                                               const float *kscale, float softcap, float *part,
                                                               int64_t acc_len) {
    __m512 dots[TILE];
    UNROLL
    for (int j = 0; j < TILE; j++)
        dots[j] = j < rows ? row_dot(qh, keys + j * row_stride, kind, dtype, elem, nvec) : _mm512_setzero_ps();
    __m512 s = hsum16(dots);
    if (kscale) s = _mm512_mul_ps(s, _mm512_loadu_ps(kscale));
    if (softcap > 0.0f)
        s = _mm512_mul_ps(_mm512_set1_ps(softcap), tanh16(_mm512_mul_ps(s, _mm512_set1_ps(1.0f / softcap))));
    const __mmask16 valid = (__mmask16)((1u << rows) - 1u);
    s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, s);
    const __m512 m_new = _mm512_max_ps(max16(s), _mm512_set1_ps(part[0]));
    const float m = _mm512_cvtss_f32(m_new);
    if (m > part[0]) {   /* rescale what was summed so far */
        const float alpha = exp_f32(part[0] - m);
        const __m512 va = _mm512_set1_ps(alpha);
        part[1] *= alpha;
        for (int64_t d = 0; d < acc_len; d += 16)
            _mm512_storeu_ps(part + PART_HEAD + d, _mm512_mul_ps(_mm512_loadu_ps(part + PART_HEAD + d), va));
        part[0] = m;
    }
    const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, m_new)));
    part[1] += _mm512_reduce_add_ps(p);
    return p;
}

/* head_dim = 16 * nvec (nvec <= 16), any cache dtype: rows widened to float32,
 * FMAs (8-bit rows: scores and probabilities times the rows' scales). Each
 * caller passes constant dtype and nvec. */
/* A tile's 8-bit codes widened to float32 once (exact: no scale), head_dim apart, so that the
 * group's heads read floats instead of widening every row again per head for K and for V. */
static inline __attribute__((always_inline)) void widen_tile(const char *src, int64_t rows, int64_t row_stride,
                                                             const int dtype, const int64_t nvec, float *dst) {
    for (int64_t j = 0; j < rows; j++)
        for (int64_t v = 0; v < nvec; v++) _mm512_storeu_ps(dst + (j * nvec + v) * 16, load16(src + j * row_stride + 16 * v, dtype));
}

static inline __attribute__((always_inline)) void attend_range_fma(
        const float *restrict q, const key_range *r, const int dtype, const int64_t elem, const int64_t nvec,
        float *restrict part) {
    const int64_t group = r->group, head_dim = 16 * nvec, pstride = PART_HEAD + head_dim;
    const int64_t kvh_n = r->kv_heads, heads = kvh_n * group;   /* every kv head of a tile, in turn */
    const int64_t head_bytes = head_row_bytes(dtype, head_dim), key_bytes = kvh_n * head_bytes;
    const int quant = is_8bit(dtype);
    /* What the math reads: the rows in place, or (8-bit) their codes widened per tile. */
    const int math_dtype = quant ? DT_FLOAT32 : dtype;
    const int64_t math_elem = quant ? 4 : elem, row_stride = quant ? head_dim * 4 : r->row_stride;
    float ks[TILE], vs[TILE];
    float kw[quant ? TILE * head_dim : 1], vw[quant ? TILE * head_dim : 1];
    __m512 qs[heads * nvec];
    for (int64_t i = 0; i < heads * nvec; i++)
        qs[i] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * i), _mm512_set1_ps(r->scale));
    start_parts(part, heads, head_dim);
    prefetch_first(r, key_bytes);
    float p[group][TILE];
    /* pf: PF_AHEAD_ROWS keys past the tile, for K's rows and then V's (one pass over both) */
    key_cursor at = cursor_at(r, r->begin), pf = cursor_at(r, r->begin + PF_AHEAD_ROWS);
    while (at.t < r->end) {
        const int64_t rows = cursor_rows(r, &at), off = cursor_offset(r, &at);
        for (int64_t kvh = 0; kvh < kvh_n; kvh++) {
            const int64_t lo = kvh * head_bytes, hi = lo + head_bytes;
            prefetch_part_ahead_of(r, pf, rows, lo, hi, r->k);
            const char *keys = r->k + off + lo, *values = r->v + off + lo;
            if (quant) {
                tile_scales(keys, values, rows, r->row_stride, dtype, head_dim, ks, vs);
                widen_tile(keys, rows, r->row_stride, dtype, nvec, kw);
                widen_tile(values, rows, r->row_stride, dtype, nvec, vw);
                keys = (const char *)kw;
                values = (const char *)vw;
            }
            const __m512 *qh = qs + kvh * group * nvec;
            float *ph = part + kvh * group * pstride;
            for (int64_t g = 0; g < group; g++) {
                const __m512 pg = tile_probs((const char *)(qh + g * nvec), keys, rows, row_stride, DOT_FMA,
                                             math_dtype, math_elem, nvec, quant ? ks : NULL, r->softcap,
                                             ph + g * pstride, head_dim);
                _mm512_storeu_ps(p[g], quant ? _mm512_mul_ps(pg, _mm512_loadu_ps(vs)) : pg);
            }
            prefetch_part_ahead_of(r, pf, rows, lo, hi, r->v);
            for (int64_t g = 0; g < group; g++) {
                float *acc = ph + g * pstride + PART_HEAD;
                __m512 a[nvec];
                for (int64_t v = 0; v < nvec; v++) a[v] = _mm512_loadu_ps(acc + 16 * v);
                for (int64_t i = 0; i < rows; i++) {
                    const __m512 pi = _mm512_set1_ps(p[g][i]);
                    for (int64_t v = 0; v < nvec; v++)
                        a[v] = _mm512_fmadd_ps(pi, load16(values + i * row_stride + 16 * v * math_elem, math_dtype),
                                               a[v]);
                }
                for (int64_t v = 0; v < nvec; v++) _mm512_storeu_ps(acc + 16 * v, a[v]);
            }
        }
        cursor_advance(r, &at, rows);
        cursor_advance(r, &pf, rows);
    }
}

#if defined(__AVX512BF16__)
/* bfloat16 caches on CPUs with AVX512_BF16: products of bf16 pairs summed in
 * float32 by one instruction (vdpbf16ps), so rows are never widened.
 * Scores: q (rounded to bf16) . k, 32 dims per instruction. Values: two
 * tokens per instruction, their rows interleaved, against the pair of their
 * probabilities (rounded to bf16, as the PyTorch path rounds its
 * probabilities before the PV matmul). head_dim = 32 * npair. */
#define PV_MAX_G 4
#define PV_MAX_PAIRS 8

/* One tile's values for GN query heads sharing a kv head:
 * acc_g += p_g[t] v[t] over the tile's rows, two rows per vdpbf16ps. A missing
 * second row is zero, so whatever probability pairs with it adds nothing.
 * acc_g keeps its dims in vdpbf16ps' order (see unscramble). */
static inline __attribute__((always_inline)) void pv_tile_bf16(
        const char *head, int64_t rows, int64_t row_stride, const uint16_t *p, int64_t pstride,
        float *acc, int64_t acc_stride, const int GN, const int64_t npair) {
    if (npair > PV_MAX_PAIRS) __builtin_unreachable();   /* head_dim <= 256 (pick_range) */
    __m512 lo[PV_MAX_G][PV_MAX_PAIRS], hi[PV_MAX_G][PV_MAX_PAIRS];
    UNROLL
    for (int g = 0; g < GN; g++) {
        UNROLL
        for (int64_t w = 0; w < npair; w++) {
            lo[g][w] = _mm512_loadu_ps(acc + g * acc_stride + 32 * w);
            hi[g][w] = _mm512_loadu_ps(acc + g * acc_stride + 32 * w + 16);
        }
    }
    for (int64_t i = 0; i < rows; i += 2) {
        const char *src0 = head + i * row_stride;
        const int second = i + 1 < rows;
        __m512bh ulo[PV_MAX_PAIRS], uhi[PV_MAX_PAIRS];
        UNROLL
        for (int64_t w = 0; w < npair; w++) {
            const __m512i r0 = _mm512_loadu_si512(src0 + 64 * w);
            const __m512i r1 = second ? _mm512_loadu_si512(src0 + row_stride + 64 * w) : _mm512_setzero_si512();
            ulo[w] = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
            uhi[w] = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
        }
        UNROLL
        for (int g = 0; g < GN; g++) {
            uint32_t pair;
            memcpy(&pair, p + g * pstride + i, sizeof pair);
            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
            UNROLL
            for (int64_t w = 0; w < npair; w++) {
                lo[g][w] = _mm512_dpbf16_ps(lo[g][w], ulo[w], pp);
                hi[g][w] = _mm512_dpbf16_ps(hi[g][w], uhi[w], pp);
            }
        }
    }
    UNROLL
    for (int g = 0; g < GN; g++) {
        UNROLL
        for (int64_t w = 0; w < npair; w++) {
            _mm512_storeu_ps(acc + g * acc_stride + 32 * w, lo[g][w]);
            _mm512_storeu_ps(acc + g * acc_stride + 32 * w + 16, hi[g][w]);
        }
    }
}

/* pv_tile_bf16's order -> dim order: lane 4L + k of lo[w] (acc + 32w) holds dim
 * 32w + 8L + k, of hi[w] (acc + 32w + 16) dim 32w + 8L + 4 + k (k < 4). */
static void unscramble(float *acc, int64_t npair) {
    for (int64_t w = 0; w < npair; w++) {
        float tmp[32];
        for (int64_t lane = 0; lane < 4; lane++)
            for (int64_t k = 0; k < 4; k++) {
                tmp[8 * lane + k] = acc[32 * w + 4 * lane + k];
                tmp[8 * lane + 4 + k] = acc[32 * w + 16 + 4 * lane + k];
            }
        memcpy(acc + 32 * w, tmp, sizeof tmp);
    }
}

/* A tile's 8-bit rows -> bf16 rows (code * scale, rounded to nearest even), head_dim apart. */
static inline __attribute__((always_inline)) void dequant_tile_bf16(const char *src, int64_t rows, int64_t row_stride,
                                                                    const int dtype, const int64_t nvec,
                                                                    uint16_t *dst) {
    for (int64_t j = 0; j < rows; j++) {
        const char *row = src + j * row_stride;
        const __m512 scale = _mm512_set1_ps(row_scale(row, dtype, 16 * nvec));
        UNROLL
        for (int64_t v = 0; v < nvec; v += 2)   /* nvec is even: head_dim = 32 * npair */
            _mm512_storeu_si512(dst + (j * nvec + v) * 16,
                                (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(load16(row + 16 * (v + 1), dtype), scale),
                                                             _mm512_mul_ps(load16(row + 16 * v, dtype), scale)));
    }
}

/* Kv head kvh's rows of the tile at `off` in `base` (K or V), as stored, after asking for that kv
 * head's part of the rows ahead (pf's). */
static inline __attribute__((always_inline)) const char *kv_head_rows(const key_range *r, key_cursor pf, int64_t rows,
                                                                      int64_t off, int64_t kvh, const char *base,
                                                                      int64_t head_bytes) {
    prefetch_part_ahead_of(r, pf, rows, kvh * head_bytes, (kvh + 1) * head_bytes, base);
    return base + off + kvh * head_bytes;
}

/* kv_head_rows as the bf16 products read them (8-bit rows dequantized into buf). */
static inline __attribute__((always_inline)) const char *kv_head_tile(const key_range *r, key_cursor pf, int64_t rows,
                                                                      int64_t off, int64_t kvh, const char *base,
                                                                      const int dtype, const int64_t npair,
                                                                      uint16_t *buf) {
    const char *src = kv_head_rows(r, pf, rows, off, kvh, base, head_row_bytes(dtype, 32 * npair));
    if (!is_8bit(dtype)) return src;
    dequant_tile_bf16(src, rows, r->row_stride, dtype, 2 * npair, buf);
    return (const char *)buf;
}

#if defined(__AVX512VNNI__)
/* An int8 cache's scores without dequantizing its K rows: each query head scaled by the
 * attention scale and rounded to int16 against its max (q = qi * qsc[g], 15 bits where the
 * bf16 products keep 8), the codes sign-extended to int16, vpdpwssd, and the tile's 16 sums
 * times each row's scale and the head's qsc. The products are exact in int32, their lane sums
 * exact in float32 up to head_dim 64 (4 products a lane, |sum| < 2^24). A head whose q is not
 * finite gets a NaN scale, so its scores are NaN as the bf16 path's would be. */
static void quantize_q_i16(const float *q, int64_t heads, int64_t head_dim, float scale, int16_t *qi, float *qsc) {
    for (int64_t g = 0; g < heads; g++) {
        const float *qg = q + g * head_dim;
        float m = 0.0f;
        int finite = 1;
        for (int64_t d = 0; d < head_dim; d++) {
            const float a = fabsf(qg[d] * scale);
            finite &= isfinite(a);
            m = a > m ? a : m;
        }
        const float inv = finite && m > 0.0f ? 32767.0f / m : 0.0f;
        qsc[g] = finite ? m / 32767.0f : NAN;
        for (int64_t d = 0; d < head_dim; d++) qi[g * head_dim + d] = (int16_t)lrintf(qg[d] * scale * inv);
    }
}

/* The scores of the group's query heads g0 .. g0 + group against a tile's `rows` int8 K rows of
 * one kv head at src (rows row_stride apart, codes then the float32 scale), into sc (heads
 * sstride apart, at column n), soft-capped; lanes past rows score 0 (the caller masks them). */
static inline __attribute__((always_inline)) void tile_scores_i8(const char *src, int64_t rows, int64_t row_stride,
                                                                 const int64_t npair, const int16_t *qi,
                                                                 const float *qsc, int64_t g0, int64_t group,
                                                                 float softcap, int16_t *k16, float *sc,
                                                                 int64_t sstride, int64_t n) {
    const int64_t head_dim = 32 * npair;
    float ks[TILE];
    row_scales(src, rows, row_stride, DT_INT8, head_dim, ks);
    for (int64_t j = 0; j < rows; j++) {
        for (int64_t w = 0; w < npair; w++) {
            const __m256i codes = _mm256_loadu_si256((const __m256i *)(src + j * row_stride + 32 * w));
            _mm512_storeu_si512(k16 + (j * npair + w) * 32, _mm512_cvtepi8_epi16(codes));
        }
    }
    const __m512 vks = _mm512_loadu_ps(ks);
    for (int64_t g = g0; g < g0 + group; g++) {
        const int16_t *qg = qi + g * head_dim;
        __m512 dots[TILE];
        UNROLL
        for (int j = 0; j < TILE; j++) {
            __m512i acc = _mm512_setzero_si512();
            for (int64_t w = 0; j < rows && w < npair; w++)
                acc = _mm512_dpwssd_epi32(acc, _mm512_loadu_si512(qg + 32 * w),
                                          _mm512_loadu_si512(k16 + (j * npair + w) * 32));
            dots[j] = _mm512_cvtepi32_ps(acc);
        }
        __m512 s = _mm512_mul_ps(hsum16(dots), _mm512_mul_ps(vks, _mm512_set1_ps(qsc[g])));
        if (softcap > 0.0f)
            s = _mm512_mul_ps(_mm512_set1_ps(softcap), tanh16(_mm512_mul_ps(s, _mm512_set1_ps(1.0f / softcap))));
        _mm512_storeu_ps(sc + g * sstride + n, s);
    }
}

/* One tile's int8 V rows of a kv head at src for GN query heads, on the codes: acc_g += sum_t
 * e_g[t] vs[t] v[t] (e_g: the heads' exp(s - m), pstride apart, lanes past `valid` dropped;
 * vs: the rows' scales). Each head's e_g[t] vs[t] is rounded to int16 against the largest
 * scale of the tile (pscale = vs * 32767 / that scale; e <= 1), the codes are sign-extended, two
 * rows a vpdpwssd as pv_tile_bf16 pairs them (same lane order, see unscramble), and the int32
 * sums (at most 16 products of 32767 x 127 a lane) go into acc times inv = that scale / 32767. */
static inline __attribute__((always_inline)) void pv_tile_i8(const char *src, int64_t rows, int64_t row_stride,
                                                             const float *e, int64_t pstride, __mmask16 valid,
                                                             __m512 pscale, float inv, float *acc, int64_t acc_stride,
                                                             const int GN, const int64_t npair) {
    if (npair > PV_MAX_PAIRS) __builtin_unreachable();   /* head_dim <= 256 (pick_range) */
    int16_t pq[PV_MAX_G][TILE];
    UNROLL
    for (int g = 0; g < GN; g++) {
        const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, e + g * pstride), pscale);
        _mm256_storeu_si256((__m256i *)pq[g], _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(p)));   /* saturates */
    }
    __m512i lo[PV_MAX_G][PV_MAX_PAIRS], hi[PV_MAX_G][PV_MAX_PAIRS];
    UNROLL
    for (int g = 0; g < GN; g++) {
        UNROLL
        for (int64_t w = 0; w < npair; w++) lo[g][w] = hi[g][w] = _mm512_setzero_si512();
    }
    for (int64_t i = 0; i < rows; i += 2) {
        const char *src0 = src + i * row_stride;
        const int second = i + 1 < rows;
        __m512i ulo[PV_MAX_PAIRS], uhi[PV_MAX_PAIRS];
        UNROLL
        for (int64_t w = 0; w < npair; w++) {
            const __m512i r0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(src0 + 32 * w)));
            const __m512i r1 = second ? _mm512_cvtepi8_epi16(
                                            _mm256_loadu_si256((const __m256i *)(src0 + row_stride + 32 * w)))
                                      : _mm512_setzero_si512();
            ulo[w] = _mm512_unpacklo_epi16(r0, r1);
            uhi[w] = _mm512_unpackhi_epi16(r0, r1);
        }
        UNROLL
        for (int g = 0; g < GN; g++) {
            uint32_t pair;
            memcpy(&pair, pq[g] + i, sizeof pair);
            const __m512i pp = _mm512_set1_epi32((int)pair);
            UNROLL
            for (int64_t w = 0; w < npair; w++) {
                lo[g][w] = _mm512_dpwssd_epi32(lo[g][w], ulo[w], pp);
                hi[g][w] = _mm512_dpwssd_epi32(hi[g][w], uhi[w], pp);
            }
        }
    }
    const __m512 vinv = _mm512_set1_ps(inv);
    UNROLL
    for (int g = 0; g < GN; g++) {
        UNROLL
        for (int64_t w = 0; w < npair; w++) {
            float *a = acc + g * acc_stride + 32 * w;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[g][w]), vinv, _mm512_loadu_ps(a)));
            _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[g][w]), vinv, _mm512_loadu_ps(a + 16)));
        }
    }
}

/* A tile's int8 V rows of kv head kvh (at src) summed for its group's heads on the codes
 * (pv_tile_i8): the rows' scales, the tile's largest, then gmax heads at a time. A scale that is
 * NaN makes inv NaN, so the heads' outputs are NaN as dequantized rows would make them. */
static inline __attribute__((always_inline)) void values_tile_i8(const key_range *r, const char *src, int64_t rows,
                                                                 int64_t kvh, const int64_t npair, const float *e,
                                                                 int64_t sstride, float *part, int64_t pstride,
                                                                 const int gmax) {
    const int64_t head_dim = 32 * npair, group = r->group;
    float vs[TILE];
    row_scales(src, rows, r->row_stride, DT_INT8, head_dim, vs);
    const __m512 vvs = _mm512_loadu_ps(vs);
    const float vmax = _mm512_reduce_max_ps(vvs);
    const float inv = _mm512_cmp_ps_mask(vvs, vvs, _CMP_UNORD_Q) ? NAN : vmax / 32767.0f;
    const __m512 pscale = _mm512_mul_ps(vvs, _mm512_set1_ps(vmax > 0.0f ? 32767.0f / vmax : 0.0f));
    const __mmask16 valid = rows >= TILE ? (__mmask16)0xffff : (__mmask16)((1u << rows) - 1u);
    for (int64_t g0 = 0; g0 < group; g0 += gmax) {
        const int gn = group - g0 < gmax ? (int)(group - g0) : gmax;
        float *a = part + (kvh * group + g0) * pstride + PART_HEAD;
        const float *eg = e + (kvh * group + g0) * sstride;
        switch (gn) {
            case 4: pv_tile_i8(src, rows, r->row_stride, eg, sstride, valid, pscale, inv, a, pstride, 4, npair); break;
            case 3: pv_tile_i8(src, rows, r->row_stride, eg, sstride, valid, pscale, inv, a, pstride, 3, npair); break;
            case 2: pv_tile_i8(src, rows, r->row_stride, eg, sstride, valid, pscale, inv, a, pstride, 2, npair); break;
            default: pv_tile_i8(src, rows, r->row_stride, eg, sstride, valid, pscale, inv, a, pstride, 1, npair); break;
        }
    }
}
#endif

/* Keys whose scores are taken before any of their values are summed (attend_range_bf16dp):
 * [group][CHUNK_KEYS] floats of scores and as many bf16 probabilities, in L1. */
#define CHUNK_KEYS 256

/* r's kv heads (each_kv_group's pass) tile by tile: a tile's rows hold every kv head's
 * part of each key, contiguous, read once. dtype DT_BFLOAT16: rows read in place; DT_INT8 /
 * DT_FP8 (a bfloat16 model): each tile's K and V rows of a kv head dequantized to bf16 once,
 * for all the group's heads, then the same; DT_INT8's rows, where AVX512-VNNI is, are not
 * dequantized: the scores come from the K codes (tile_scores_i8; one key and kv head 25.0 ->
 * 22.8 ns from memory, 19.3 -> 16.1 in cache, one thread; benchmarks/README.md, thirty-seventh
 * session) and the values are summed on the V codes (values_tile_i8; 23.1 -> 20.1 from memory,
 * 17.3 -> 14.6 in cache, thirty-eighth session), each chunk's exp(s - m) kept in float32 for it.
 * In chunks of up to CHUNK_KEYS keys, three passes each: every tile's scores for every head
 * (vdpbf16ps, hsum16), then per head the chunk's max, the output so far rescaled once if it
 * grew, exp(s - m) 16 at a time and their sum, then the values, tile by tile. A tile at a time
 * (scores, max, exp, sum, values) was one chain of dependent latencies per tile and head: the
 * next tile's max waited on this one's; here the chunk's tiles and vectors are independent
 * work (256 keys from cache: 1.33x, one thread; benchmarks/README.md, twenty-sixth session). */
static inline __attribute__((always_inline)) void attend_range_bf16dp(
        const float *restrict q, const key_range *r, const int dtype, const int64_t npair, float *restrict part) {
    const int64_t group = r->group, head_dim = 32 * npair, pstride = PART_HEAD + head_dim;
    const int64_t kvh_n = r->kv_heads, heads = kvh_n * group;   /* every kv head of a tile, in turn */
    const int64_t head_bytes = head_row_bytes(dtype, head_dim), key_bytes = kvh_n * head_bytes;
    const int quant = is_8bit(dtype);
    const int64_t row_stride = quant ? head_dim * 2 : r->row_stride;   /* of the rows the math reads */
    uint16_t kq[quant ? TILE * head_dim : 1], vq[quant ? TILE * head_dim : 1];
#if defined(__AVX512VNNI__)
    const int on_codes = dtype == DT_INT8 && int8_on_codes();   /* tile_scores_i8, values_tile_i8 */
#else
    const int on_codes = 0;
#endif
    __m512bh qs[on_codes ? 1 : heads * npair];   /* the bf16 products' queries */
    int16_t qi[on_codes ? heads * head_dim : 1];
    float qsc[on_codes ? heads : 1];
    const __m512 vscale = _mm512_set1_ps(r->scale);
    for (int64_t i = 0; !on_codes && i < heads * npair; i++)
        qs[i] = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(q + 32 * i + 16), vscale),
                                    _mm512_mul_ps(_mm512_loadu_ps(q + 32 * i), vscale));
#if defined(__AVX512VNNI__)
    if (on_codes) quantize_q_i16(q, heads, head_dim, r->scale, qi, qsc);
#endif
    start_parts(part, heads, head_dim);
    prefetch_first(r, key_bytes);
    /* A chunk's scores and bf16 probabilities per head (TILE past the chunk: a tile's 16 lanes
     * are stored whole; the pair partner of a last odd row is 0). */
    const int64_t sstride = CHUNK_KEYS + TILE;
    float sc[heads * sstride];
    uint16_t p[heads * sstride];
    /* Values: each row pair is interleaved once for up to gmax heads (as many as keep
     * their accumulators in registers). */
    const int gmax = npair <= 2 ? 4 : npair <= 4 ? 2 : 1;
    key_cursor at = cursor_at(r, r->begin), pf = cursor_at(r, r->begin + PF_AHEAD_ROWS), pfv = pf;
    while (at.t < r->end) {
        const key_cursor start = at;
        int64_t n = 0;   /* the chunk's keys */
        while (at.t < r->end && n + TILE <= CHUNK_KEYS) {   /* scores */
            const int64_t rows = cursor_rows(r, &at), off = cursor_offset(r, &at);
            for (int64_t kvh = 0; kvh < kvh_n; kvh++) {
#if defined(__AVX512VNNI__)
                if (on_codes) {
                    tile_scores_i8(kv_head_rows(r, pf, rows, off, kvh, r->k, head_bytes), rows, r->row_stride, npair,
                                   qi, qsc, kvh * group, group, r->softcap, (int16_t *)kq, sc, sstride, n);
                    continue;
                }
#endif
                const char *keys = kv_head_tile(r, pf, rows, off, kvh, r->k, dtype, npair, kq);
                for (int64_t g = kvh * group; g < (kvh + 1) * group; g++) {
                    __m512 dots[TILE];
                    const char *qg = (const char *)(qs + g * npair);
                    if (rows == TILE) {   /* the common case without a test per row */
                        UNROLL
                        for (int j = 0; j < TILE; j++)
                            dots[j] = row_dot(qg, keys + j * row_stride, DOT_BF16, DT_BFLOAT16, 2, npair);
                    } else {
                        UNROLL
                        for (int j = 0; j < TILE; j++)
                            dots[j] = j < rows ? row_dot(qg, keys + j * row_stride, DOT_BF16, DT_BFLOAT16, 2, npair)
                                               : _mm512_setzero_ps();
                    }
                    __m512 s = hsum16(dots);
                    if (r->softcap > 0.0f)
                        s = _mm512_mul_ps(_mm512_set1_ps(r->softcap),
                                          tanh16(_mm512_mul_ps(s, _mm512_set1_ps(1.0f / r->softcap))));
                    _mm512_storeu_ps(sc + g * sstride + n, s);
                }
            }
            n += rows;
            cursor_advance(r, &at, rows);
            cursor_advance(r, &pf, rows);
        }
        const __mmask16 tail = (__mmask16)((1u << (n % 16)) - 1u);
        for (int64_t g = 0; g < heads; g++) {   /* the chunk's max, exp(s - m), sum */
            float *pg = part + g * pstride, *sg = sc + g * sstride;
            __m512 mx = _mm512_set1_ps(pg[0]);
            int64_t i = 0;
            for (; i + 16 <= n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sg + i));
            if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_loadu_ps(sg + i));
            mx = max16(mx);
            const float m = _mm512_cvtss_f32(mx);
            if (m > pg[0]) {   /* rescale what was summed so far */
                const float alpha = exp_f32(pg[0] - m);
                const __m512 va = _mm512_set1_ps(alpha);
                pg[1] *= alpha;
                for (int64_t d = 0; d < head_dim; d += 16)
                    _mm512_storeu_ps(pg + PART_HEAD + d, _mm512_mul_ps(_mm512_loadu_ps(pg + PART_HEAD + d), va));
                pg[0] = m;
            }
            __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
            for (i = 0; i < n; i += 16) {
                const __mmask16 valid = i + 16 <= n ? (__mmask16)0xffff : tail;
                const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + i), mx)));
                if (i & 16) sum1 = _mm512_add_ps(sum1, e);
                else sum0 = _mm512_add_ps(sum0, e);
                if (on_codes) _mm512_storeu_ps(sg + i, e);   /* the values on the codes take e itself */
                else _mm256_storeu_si256((__m256i *)(p + g * sstride + i), (__m256i)_mm512_cvtneps_pbh(e));
            }
            if (!on_codes) p[g * sstride + n] = 0;
            pg[1] += _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
        }
        key_cursor vc = start;
        for (int64_t i = 0; i < n;) {   /* values */
            const int64_t rows = cursor_rows(r, &vc), off = cursor_offset(r, &vc);
            for (int64_t kvh = 0; kvh < kvh_n; kvh++) {
#if defined(__AVX512VNNI__)
                if (on_codes) {
                    values_tile_i8(r, kv_head_rows(r, pfv, rows, off, kvh, r->v, head_bytes), rows, kvh, npair,
                                   sc + i, sstride, part, pstride, gmax);
                    continue;
                }
#endif
                const char *values = kv_head_tile(r, pfv, rows, off, kvh, r->v, dtype, npair, vq);
                for (int64_t g0 = 0; g0 < group; g0 += gmax) {
                    const int gn = group - g0 < gmax ? (int)(group - g0) : gmax;
                    float *a = part + (kvh * group + g0) * pstride + PART_HEAD;
                    const uint16_t *pp = p + (kvh * group + g0) * sstride + i;
                    switch (gn) {
                        case 4: pv_tile_bf16(values, rows, row_stride, pp, sstride, a, pstride, 4, npair); break;
                        case 3: pv_tile_bf16(values, rows, row_stride, pp, sstride, a, pstride, 3, npair); break;
                        case 2: pv_tile_bf16(values, rows, row_stride, pp, sstride, a, pstride, 2, npair); break;
                        default: pv_tile_bf16(values, rows, row_stride, pp, sstride, a, pstride, 1, npair); break;
                    }
                }
            }
            i += rows;
            cursor_advance(r, &vc, rows);
            cursor_advance(r, &pfv, rows);
        }
    }
    for (int64_t g = 0; g < heads; g++) unscramble(part + g * pstride + PART_HEAD, npair);
}

#define RANGE_BF16DP(NAME, DTYPE, NPAIR)                                                                \
    static void NAME##_one(const float *q, const key_range *r, int dtype, int64_t head_dim, float *part) { \
        (void)dtype;                                                                                   \
        attend_range_bf16dp(q, r, DTYPE, (NPAIR) ? (NPAIR) : head_dim / 32, part);                     \
    }                                                                                                  \
    static void NAME(const float *q, const key_range *r, int dtype, int64_t head_dim, float *part) {    \
        each_kv_group(NAME##_one, q, r, dtype, head_dim, part);                                        \
    }
RANGE_BF16DP(range_bf16dp_64, DT_BFLOAT16, 2)
RANGE_BF16DP(range_bf16dp_128, DT_BFLOAT16, 4)
RANGE_BF16DP(range_bf16dp_any, DT_BFLOAT16, 0)
RANGE_BF16DP(range_i8dp_64, DT_INT8, 2)
RANGE_BF16DP(range_i8dp_128, DT_INT8, 4)
RANGE_BF16DP(range_i8dp_any, DT_INT8, 0)
RANGE_BF16DP(range_fp8dp_64, DT_FP8, 2)
RANGE_BF16DP(range_fp8dp_128, DT_FP8, 4)
RANGE_BF16DP(range_fp8dp_any, DT_FP8, 0)
#endif
#endif

#if !defined(__AVX512F__) && defined(VECTOR_DECODE)
/* AVX2 + FMA (no AVX-512): the same single pass as attend_range_fma in 8-lane
 * registers. A chunk is 16 cache elements, widened into two vectors (a, b):
 * float32, float16 and 8-bit rows as elements 0-7 and 8-15; bfloat16 rows as the
 * even and the odd elements of one 32-byte load (the low half of each dword
 * shifted up, the high half masked), which saves the widening shuffles. The
 * query is laid out the same way (a dot product does not care about the order)
 * and the output accumulators too, put back in dim order at the end of the range. */

/* One chunk of 16 cache elements -> *a, *b. `dtype` is a constant in each caller. */
static inline __attribute__((always_inline)) void load_chunk(const char *src, int dtype, __m256 *a, __m256 *b) {
    if (dtype == DT_BFLOAT16) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)src);
        *a = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        *b = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xFFFF0000u)));
    } else if (dtype == DT_FLOAT16) {
        *a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src));
        *b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 16)));
    } else if (dtype == DT_INT8) {
        *a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)src)));
        *b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + 8))));
    } else if (dtype == DT_FP8) {   /* codes only: the row's scale carries the 256 (fp8_as_f16_bits) */
        const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)src));
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                          _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
        *a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        *b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    } else {
        *a = _mm256_loadu_ps((const float *)src);
        *b = _mm256_loadu_ps((const float *)src + 8);
    }
}

/* Eight vectors -> one vector of their eight horizontal sums (lane j = sum of d[j]). */
static inline __attribute__((always_inline)) __m256 hsum8(const __m256 d[8]) {
    const __m256 t0 = _mm256_hadd_ps(d[0], d[1]), t1 = _mm256_hadd_ps(d[2], d[3]);
    const __m256 t2 = _mm256_hadd_ps(d[4], d[5]), t3 = _mm256_hadd_ps(d[6], d[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);   /* 128-bit halves: d0..3 | d4..7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The max of 8 lanes, in every lane. */
static inline __attribute__((always_inline)) __m256 max8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_permute2f128_ps(x, x, 0x01));
    x = _mm256_max_ps(x, _mm256_permute_ps(x, 0x4E));
    return _mm256_max_ps(x, _mm256_permute_ps(x, 0xB1));
}

static inline __attribute__((always_inline)) float hsum_lanes(__m256 x) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

/* One key row of one kv head against the G query heads that share it (q: G x 2 nchunk
 * vectors): dots[g * TILE] gets a vector whose lanes sum to q_g . k (hsum8 finishes 8 keys
 * at once). The row is loaded once for all G heads, 4 chunks (8 registers) at a time. */
static inline __attribute__((always_inline)) void key_dots8(const __m256 *q, const char *src, const int dtype,
                                                            const int64_t elem, const int64_t nchunk, int64_t group,
                                                            __m256 *dots) {
    for (int64_t w0 = 0; w0 < nchunk; w0 += 4) {
        const int64_t nw = nchunk - w0 < 4 ? nchunk - w0 : 4;
        __m256 k[8];
        UNROLL
        for (int64_t w = 0; w < 4; w++)
            if (w < nw) load_chunk(src + 16 * (w0 + w) * elem, dtype, &k[2 * w], &k[2 * w + 1]);
        for (int64_t g = 0; g < group; g++) {
            const __m256 *qg = q + g * 2 * nchunk + 2 * w0;
            __m256 a = _mm256_mul_ps(qg[0], k[0]), b = _mm256_mul_ps(qg[1], k[1]);
            UNROLL
            for (int64_t w = 1; w < 4; w++)
                if (w < nw) {
                    a = _mm256_fmadd_ps(qg[2 * w], k[2 * w], a);
                    b = _mm256_fmadd_ps(qg[2 * w + 1], k[2 * w + 1], b);
                }
            const __m256 d = _mm256_add_ps(a, b);
            dots[g * TILE] = w0 ? _mm256_add_ps(dots[g * TILE], d) : d;
        }
    }
}

/* Every head's probabilities for a tile of `rows` (<= 16) keys, from the key_dots8 vectors
 * dots [heads][TILE] (lanes past `rows` are ignored): scores times the keys' scales (8-bit
 * caches: ks [kv_heads][TILE]), soft-capped, folded into each head's part (running max and
 * sum, output rescaled when the max grows); p [heads][TILE] gets exp(s - m) (times the
 * values' scales vs, 8-bit caches), 0 past rows. Two passes over the heads (scores and
 * max, then probabilities), each over independent heads, so that the out-of-order core
 * overlaps the heads' long chains (a reduction, then exp). */
static inline __attribute__((always_inline)) void tile_probs8(const __m256 *dots, int64_t heads, int64_t group,
                                                              int64_t rows, const float *ks, const float *vs,
                                                              float softcap, float *part, int64_t pstride,
                                                              float *s, float *p) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 valid0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)rows), iota));
    const __m256 valid1 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)rows - 8), iota));
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t h = 0; h < heads; h++) {   /* scores, and the max of each head's part */
        const __m256 *d = dots + h * TILE;
        __m256 s0 = hsum8(d), s1 = rows > 8 ? hsum8(d + 8) : _mm256_setzero_ps();
        if (ks) {
            s0 = _mm256_mul_ps(s0, _mm256_loadu_ps(ks + (h / group) * TILE));
            s1 = _mm256_mul_ps(s1, _mm256_loadu_ps(ks + (h / group) * TILE + 8));
        }
        if (softcap > 0.0f) {
            s0 = _mm256_mul_ps(_mm256_set1_ps(softcap), tanh8(_mm256_mul_ps(s0, _mm256_set1_ps(1.0f / softcap))));
            s1 = _mm256_mul_ps(_mm256_set1_ps(softcap), tanh8(_mm256_mul_ps(s1, _mm256_set1_ps(1.0f / softcap))));
        }
        s0 = _mm256_blendv_ps(ninf, s0, valid0);
        s1 = _mm256_blendv_ps(ninf, s1, valid1);
        _mm256_storeu_ps(s + h * TILE, s0);
        _mm256_storeu_ps(s + h * TILE + 8, s1);
        float *ph = part + h * pstride;
        const float m = _mm256_cvtss_f32(max8(_mm256_max_ps(s0, s1)));
        if (m > ph[0]) {   /* rescale what was summed so far */
            const float alpha = exp_f32(ph[0] - m);
            const __m256 va = _mm256_set1_ps(alpha);
            ph[1] *= alpha;
            for (int64_t d = PART_HEAD; d < pstride; d += 8)
                _mm256_storeu_ps(ph + d, _mm256_mul_ps(_mm256_loadu_ps(ph + d), va));
            ph[0] = m;
        }
    }
    for (int64_t h = 0; h < heads; h++) {   /* probabilities */
        float *ph = part + h * pstride;
        const __m256 m = _mm256_set1_ps(ph[0]);
        __m256 p0 = _mm256_and_ps(valid0, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + h * TILE), m)));
        __m256 p1 = _mm256_and_ps(valid1, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + h * TILE + 8), m)));
        ph[1] += hsum_lanes(_mm256_add_ps(p0, p1));
        if (vs) {
            p0 = _mm256_mul_ps(p0, _mm256_loadu_ps(vs + (h / group) * TILE));
            p1 = _mm256_mul_ps(p1, _mm256_loadu_ps(vs + (h / group) * TILE + 8));
        }
        _mm256_storeu_ps(p + h * TILE, p0);
        _mm256_storeu_ps(p + h * TILE + 8, p1);
    }
}

/* Chunks of the output accumulated per pass over a tile's values: 4 chunks = 8
 * vectors stay in registers next to the loaded row. */
#define PV_CHUNKS 4

/* acc (one head, dims in chunk order) += sum over the tile's rows of p[i] v_i. */
static inline __attribute__((always_inline)) void pv_tile8(const char *values, int64_t rows, int64_t row_stride,
                                                           const float *p, float *acc, const int dtype,
                                                           const int64_t elem, const int64_t nchunk) {
    for (int64_t w0 = 0; w0 < nchunk; w0 += PV_CHUNKS) {
        const int64_t nw = nchunk - w0 < PV_CHUNKS ? nchunk - w0 : PV_CHUNKS;
        __m256 a[2 * PV_CHUNKS];
        UNROLL
        for (int64_t w = 0; w < 2 * PV_CHUNKS; w++)
            if (w < 2 * nw) a[w] = _mm256_loadu_ps(acc + 16 * w0 + 8 * w);
        for (int64_t i = 0; i < rows; i++) {
            const __m256 pi = _mm256_set1_ps(p[i]);
            const char *src = values + i * row_stride + 16 * w0 * elem;
            UNROLL
            for (int64_t w = 0; w < PV_CHUNKS; w++)
                if (w < nw) {
                    __m256 x, y;
                    load_chunk(src + 16 * w * elem, dtype, &x, &y);
                    a[2 * w] = _mm256_fmadd_ps(pi, x, a[2 * w]);
                    a[2 * w + 1] = _mm256_fmadd_ps(pi, y, a[2 * w + 1]);
                }
        }
        UNROLL
        for (int64_t w = 0; w < 2 * PV_CHUNKS; w++)
            if (w < 2 * nw) _mm256_storeu_ps(acc + 16 * w0 + 8 * w, a[w]);
    }
}

/* bfloat16 chunk order (even dims, then odd dims, per 16) <-> dim order. */
static void bf16_chunk_order(const float *src, float *dst, int64_t head_dim) {
    for (int64_t c = 0; c < head_dim; c += 16)
        for (int64_t i = 0; i < 8; i++) {
            dst[c + i] = src[c + 2 * i];
            dst[c + 8 + i] = src[c + 2 * i + 1];
        }
}

static void bf16_dim_order(float *acc, int64_t head_dim) {
    for (int64_t c = 0; c < head_dim; c += 16) {
        float tmp[16];
        for (int64_t i = 0; i < 8; i++) {
            tmp[2 * i] = acc[c + i];
            tmp[2 * i + 1] = acc[c + 8 + i];
        }
        memcpy(acc + c, tmp, sizeof tmp);
    }
}

/* Ask for the lines of bytes from src on. */
static inline __attribute__((always_inline)) void prefetch_rows(const char *src, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(src + b, _MM_HINT_T0);
}

/* head_dim = 16 * nchunk (nchunk <= 16), any cache dtype, every kv head of the range
 * (r->head_offset is 0). Each caller passes constant dtype and nchunk. */
static inline __attribute__((always_inline)) void attend_range_avx2(
        const float *restrict q, const key_range *r, const int dtype, const int64_t elem, const int64_t nchunk,
        float *restrict part) {
    const int64_t group = r->group, kv_heads = r->kv_heads, heads = kv_heads * group, head_dim = 16 * nchunk;
    const int64_t pstride = PART_HEAD + head_dim, head_bytes = head_row_bytes(dtype, head_dim);
    const int64_t row_stride = r->row_stride, nv = 2 * nchunk;
    const int quant = is_8bit(dtype);
    float ks[kv_heads * TILE], vs[kv_heads * TILE], sc[heads * TILE], p[heads * TILE];
    __m256 qs[heads * nv], dots[heads * TILE];
    memset(dots, 0, sizeof dots);   /* a short tile's lanes past its rows are read (and masked) */
    for (int64_t h = 0; h < heads; h++) {
        float qh[head_dim];
        if (dtype == DT_BFLOAT16) bf16_chunk_order(q + h * head_dim, qh, head_dim);
        else memcpy(qh, q + h * head_dim, sizeof qh);
        for (int64_t i = 0; i < nv; i++)
            qs[h * nv + i] = _mm256_mul_ps(_mm256_loadu_ps(qh + 8 * i), _mm256_set1_ps(r->scale));
    }
    start_parts(part, heads, head_dim);
    key_cursor at = cursor_at(r, r->begin);
    while (at.t < r->end) {
        const int64_t rows = cursor_rows(r, &at), off = cursor_offset(r, &at);
        key_cursor next = at;
        cursor_advance(r, &next, rows);
        const int64_t next_rows = next.t < r->end ? cursor_rows(r, &next) : 0;
        const int64_t next_off = next_rows ? cursor_offset(r, &next) : 0;
        /* Scores: key rows in address order, every kv head of a row at once. */
        for (int64_t j = 0; j < rows; j++) {
            prefetch_rows(r->v + off + j * row_stride, row_stride);
            for (int64_t kvh = 0; kvh < kv_heads; kvh++)
                key_dots8(qs + kvh * group * nv, r->k + off + j * row_stride + kvh * head_bytes, dtype, elem, nchunk,
                          group, dots + kvh * group * TILE + j);
        }
        if (quant)
            for (int64_t kvh = 0; kvh < kv_heads; kvh++)
                tile_scales(r->k + off + kvh * head_bytes, r->v + off + kvh * head_bytes, rows, row_stride, dtype,
                            head_dim, ks + kvh * TILE, vs + kvh * TILE);
        tile_probs8(dots, heads, group, rows, quant ? ks : NULL, quant ? vs : NULL, r->softcap, part, pstride, sc, p);
        for (int64_t kvh = 0; kvh < kv_heads; kvh++) {
            if (next_rows) {
                const int64_t j0 = next_rows * kvh / kv_heads, j1 = next_rows * (kvh + 1) / kv_heads;
                prefetch_rows(r->k + next_off + j0 * row_stride, (j1 - j0) * row_stride);
            }
            const char *values = r->v + off + kvh * head_bytes;
            for (int64_t g = 0; g < group; g++) {
                const int64_t h = kvh * group + g;
                pv_tile8(values, rows, row_stride, p + h * TILE, part + h * pstride + PART_HEAD, dtype, elem, nchunk);
            }
        }
        at = next;
    }
    if (dtype == DT_BFLOAT16)
        for (int64_t h = 0; h < heads; h++) bf16_dim_order(part + h * pstride + PART_HEAD, head_dim);
}
#endif

#if defined(VECTOR_DECODE)
/* The decode pass, specialised per cache dtype and head size (64, 128, any multiple of 16). */
#if defined(__AVX512F__)
#define RANGE_VEC(NAME, DTYPE, ELEM, NCHUNK)                                                            \
    static void NAME##_one(const float *q, const key_range *r, int dtype, int64_t head_dim, float *part) { \
        (void)dtype;                                                                                   \
        attend_range_fma(q, r, DTYPE, ELEM, (NCHUNK) ? (NCHUNK) : head_dim / 16, part);                \
    }                                                                                                  \
    static void NAME(const float *q, const key_range *r, int dtype, int64_t head_dim, float *part) {    \
        each_kv_group(NAME##_one, q, r, dtype, head_dim, part);                                        \
    }
#else
#define RANGE_VEC(NAME, DTYPE, ELEM, NCHUNK)                                                            \
    static void NAME(const float *q, const key_range *r, int dtype, int64_t head_dim, float *part) {    \
        (void)dtype;                                                                                   \
        attend_range_avx2(q, r, DTYPE, ELEM, (NCHUNK) ? (NCHUNK) : head_dim / 16, part);               \
    }
#endif
RANGE_VEC(range_f32_64, DT_FLOAT32, 4, 4)
RANGE_VEC(range_bf16_64, DT_BFLOAT16, 2, 4)
RANGE_VEC(range_f16_64, DT_FLOAT16, 2, 4)
RANGE_VEC(range_f32_128, DT_FLOAT32, 4, 8)
RANGE_VEC(range_bf16_128, DT_BFLOAT16, 2, 8)
RANGE_VEC(range_f16_128, DT_FLOAT16, 2, 8)
RANGE_VEC(range_f32_any, DT_FLOAT32, 4, 0)
RANGE_VEC(range_bf16_any, DT_BFLOAT16, 2, 0)
RANGE_VEC(range_f16_any, DT_FLOAT16, 2, 0)
RANGE_VEC(range_i8_64, DT_INT8, 1, 4)
RANGE_VEC(range_i8_128, DT_INT8, 1, 8)
RANGE_VEC(range_i8_any, DT_INT8, 1, 0)
RANGE_VEC(range_fp8_64, DT_FP8, 1, 4)
RANGE_VEC(range_fp8_128, DT_FP8, 1, 8)
RANGE_VEC(range_fp8_any, DT_FP8, 1, 0)
#endif

static void range_scalar_one(const float *q, const key_range *r, int dtype, int64_t head_dim, float *part) {
    attend_range_scalar(q, r, dtype, head_dim, part);
}

static void range_scalar(const float *q, const key_range *r, int dtype, int64_t head_dim, float *part) {
    each_kv_head(range_scalar_one, q, r, dtype, head_dim, part);
}


/* How a bfloat16 model's decodes read an int8 cache on AVX512-VNNI builds: 1 on its codes
 * (tile_scores_i8, values_tile_i8: int16 queries against the sign-extended codes), 0 through tiles
 * dequantized to bfloat16 (dequant_tile_bf16, the fp8 cache's way). Chosen per CPU at the first
 * decode: on Intel hosts the codes were the faster (thirty-seventh and thirty-eighth sessions), on
 * AMD Zen 4 the dequantized tiles (benchmarks/decode_attention_harness.c, SmolLM2's shape, 100 x 400
 * keys from memory: 16.8-17.2 against 20.0 ns a key and kv head on one thread, 8.8-10.0 against
 * 10.2-11.4 on two; forty-third and forty-eighth sessions). -1: not chosen yet;
 * pipeserve_decode_i8_codes sets it (tests, benchmarks). */
static int i8_codes = -1;

static __attribute__((unused)) int int8_on_codes(void) {
    int v = __atomic_load_n(&i8_codes, __ATOMIC_RELAXED);
    if (v < 0) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_cpu_init();
        v = !__builtin_cpu_is("amd");
#else
        v = 1;
#endif
        __atomic_store_n(&i8_codes, v, __ATOMIC_RELAXED);
    }
    return v;
}

/* Set (0 or 1) or, with -1, only read which way an int8 cache's bf16 decodes go (above); returns it.
 * Builds without AVX512-VNNI always dequantize: they return 0. */
int pipeserve_decode_i8_codes(int set) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    if (set >= 0) __atomic_store_n(&i8_codes, set != 0, __ATOMIC_RELAXED);
    return int8_on_codes();
#else
    (void)set;
    return 0;
#endif
}

/* Which decode path this build compiled: "avx512", "avx2" or "portable" (logged, and
 * checked by the tests that force a build). */
const char *pipeserve_decode_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(VECTOR_DECODE)
    return "avx2";
#else
    return "portable";
#endif
}

/* The fastest item function for this cache dtype and head size on this CPU. bf16_math:
 * an 8-bit cache may be read through bf16 products (a bfloat16 model; not for float32). */
static range_fn pick_range(int dtype, int64_t head_dim, int bf16_math) {
#if defined(__AVX512BF16__)
    static const range_fn dp[3][3] = {
        {range_bf16dp_64, range_bf16dp_128, range_bf16dp_any},
        {range_i8dp_64, range_i8dp_128, range_i8dp_any},
        {range_fp8dp_64, range_fp8dp_128, range_fp8dp_any},
    };
    const int row = dtype == DT_BFLOAT16 ? 0 : bf16_math && dtype == DT_INT8 ? 1 : bf16_math && dtype == DT_FP8 ? 2 : -1;
    if (row >= 0 && head_dim % 32 == 0 && head_dim <= 256)
        return dp[row][head_dim == 64 ? 0 : head_dim == 128 ? 1 : 2];
#else
    (void)bf16_math;
#endif
#if defined(VECTOR_DECODE)
    static const range_fn table[5][3] = {
        {range_f32_64, range_f32_128, range_f32_any},
        {range_bf16_64, range_bf16_128, range_bf16_any},
        {range_f16_64, range_f16_128, range_f16_any},
        {range_i8_64, range_i8_128, range_i8_any},
        {range_fp8_64, range_fp8_128, range_fp8_any},
    };
    if (head_dim % 16 == 0 && head_dim <= 256) return table[dtype][head_dim == 64 ? 0 : head_dim == 128 ? 1 : 2];
#endif
    return range_scalar;
}

/* One thread's work buffer (64-byte aligned, freed with free); when it cannot be
 * had, *failed is set and the caller's entry point returns -1. */
static __attribute__((unused)) void *thread_scratch(size_t bytes, int *failed) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) {
#pragma omp atomic write
        *failed = 1;
    }
    return p;
}

/* The keys a decode step of these contexts attends to (each sequence from its window's start). */
static int64_t step_keys(const int64_t *context_lens, int64_t batch, int64_t window) {
    int64_t keys = 0;
    for (int64_t b = 0; b < batch; b++) keys += context_lens[b] - window_start(context_lens[b], window);
    return keys;
}

/* Keys per range when splitting a step of `keys` keys: 0 (no split) for one thread, else about
 * 1 / (threads * SPLIT_PER_THREAD) of them, whole blocks, at least SPLIT_MIN_KEYS. */
static int64_t split_span(int64_t keys, int64_t block_size, int num_threads) {
    if (num_threads <= 1) return 0;
    int64_t span = keys / ((int64_t)num_threads * SPLIT_PER_THREAD);
    span = span > SPLIT_MIN_KEYS ? span : SPLIT_MIN_KEYS;
    return (span + block_size - 1) / block_size * block_size;
}

/* split_span for tests: keys per range a decode step of these contexts is cut into (0: none). */
int64_t pipeserve_decode_split_span(const int64_t *context_lens, int64_t batch, int64_t window, int64_t block_size,
                                    int num_threads) {
    return split_span(step_keys(context_lens, batch, window), block_size, num_threads);
}

/* out_h = sum_r e^(m_r - M) acc_r / sum_r e^(m_r - M) l_r over the ranges r of one head. */
static void merge_parts(const float *part, int64_t ranges, int64_t range_stride, int64_t head_dim, float *out) {
    float m = -INFINITY, l = 0.0f;
    for (int64_t c = 0; c < ranges; c++) m = part[c * range_stride] > m ? part[c * range_stride] : m;
    for (int64_t d = 0; d < head_dim; d++) out[d] = 0.0f;
    for (int64_t c = 0; c < ranges; c++) {
        const float *pc = part + c * range_stride;
        const float w = exp_f32(pc[0] - m);
        l += w * pc[1];
        for (int64_t d = 0; d < head_dim; d++) out[d] += w * pc[PART_HEAD + d];
    }
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < head_dim; d++) out[d] *= inv;
}

/* The step's new K (or V) rows into the cache: row i of src, row_bytes long (all kv heads
 * of one token, in the cache's dtype), to slot slots[i]; the rows lie src_stride bytes apart
 * (a slice of the fused qkv projection's rows, as v is). One memcpy per token instead of
 * index_copy_'s dispatch (and, for a slice, a copy to make it contiguous first), which cost
 * more than the copy itself. */
void pipeserve_write_rows_strided(char *cache, const int64_t *slots, int64_t n, const char *src, int64_t src_stride,
                                  int64_t row_bytes) {
    for (int64_t i = 0; i < n; i++) memcpy(cache + slots[i] * row_bytes, src + i * src_stride, (size_t)row_bytes);
}

/* A decode step's attention in three phases, for pipeserve_paged_decode and for callers that
 * run their own threads (decode_stage.c): pipeserve_decode_plan cuts the step into work
 * items (a range of keys of one sequence, every kv head); pipeserve_decode_items attends items [i0, i1) into their
 * partial results; pipeserve_decode_merge combines the partials of (sequence, head) rows
 * [bh0, bh1) into the output. The plan lives in a caller's buffer of
 * pipeserve_decode_plan_bytes: the header, then its arrays. */
typedef struct {
    int64_t batch, heads, kv_heads, group, head_dim, pstride, block_size, window, span, ranges, items;
    int64_t *first_range;   /* [batch + 1]: sequence b's ranges are first_range[b] .. first_range[b + 1] */
    int64_t *range_seq;     /* [ranges]: the sequence of each range */
    int64_t *range_lo;      /* [ranges]: its keys are positions range_lo .. range_hi of its sequence */
    int64_t *range_hi;
    int64_t *share;         /* [threads + 1]: thread t's items are share[t] .. share[t + 1] */
    float *parts;           /* [items, heads, pstride]: each item's partial result per query head */
} decode_plan;

/* At most this many ranges: the cut (split_span) gives about num_threads * SPLIT_PER_THREAD
 * spans of whole blocks over the step's keys, plus up to two partial spans per sequence, plus
 * the num_threads - 1 cuts between the threads' shares. */
static int64_t max_ranges(int64_t batch, int num_threads) {
    return num_threads <= 1 ? batch : 2 * batch + (int64_t)num_threads * (SPLIT_PER_THREAD + 1);
}

int64_t pipeserve_decode_plan_bytes(int64_t batch, int64_t heads, int64_t head_dim, int num_threads) {
    const int64_t ranges = max_ranges(batch, num_threads), threads = num_threads > 1 ? num_threads : 1;
    return (int64_t)sizeof(decode_plan) + (batch + 1 + 3 * ranges + threads + 1) * (int64_t)sizeof(int64_t)
           + ranges * heads * (PART_HEAD + head_dim) * (int64_t)sizeof(float) + 64;
}

/* Ranges of keys cut for num_threads threads (no cut for one), in sequence order: spans of
 * split_span keys from each sequence's first whole block (for callers that hand ranges out
 * as threads come free), and cuts at the block nearest to each t / num_threads of the step's
 * keys, so that thread t's share (items share[t] .. share[t + 1], for callers that hand each
 * thread a fixed share: decode_stage.c) holds its part of the keys to within a block, however
 * few the sequences (to within a sequence in a step of under SHARE_MIN_KEYS keys a thread).
 * Returns the number of items (-1 only if the cut outgrew max_ranges, which its bound rules out). */
int64_t pipeserve_decode_plan(void *buf, const int64_t *context_lens, int64_t batch, int64_t heads,
                              int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t window,
                              int num_threads) {
    decode_plan *p = (decode_plan *)buf;
    const int64_t most = max_ranges(batch, num_threads), T = num_threads > 1 ? num_threads : 1;
    p->batch = batch;
    p->heads = heads;
    p->kv_heads = kv_heads;
    p->group = heads / kv_heads;
    p->head_dim = head_dim;
    p->pstride = PART_HEAD + head_dim;
    p->block_size = block_size;
    p->window = window;
    p->first_range = (int64_t *)(p + 1);
    p->range_seq = p->first_range + batch + 1;
    p->range_lo = p->range_seq + most;
    p->range_hi = p->range_lo + most;
    p->share = p->range_hi + most;
    p->parts = (float *)(((uintptr_t)(p->share + T + 1) + 63) & ~(uintptr_t)63);
    const int64_t keys = step_keys(context_lens, batch, window);
    p->span = split_span(keys, block_size, num_threads);
    const int cut_inside = keys >= T * SHARE_MIN_KEYS;   /* else the shares are whole sequences */
    int64_t ranges = 0, seen = 0, t = 1;   /* seen: the keys of the sequences before b */
    p->share[0] = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t ctx = context_lens[b], first = window_start(ctx, window), base = first - first % block_size;
        p->first_range[b] = ranges;
        for (int64_t lo = first; lo < ctx;) {
            int64_t hi = p->span ? base + ((lo - base) / p->span + 1) * p->span : ctx;
            hi = hi < ctx ? hi : ctx;
            while (t < T) {   /* thread t's share starts at the block (or sequence) nearest its first key */
                const int64_t x = first + keys * t / T - seen;
                const int64_t cut = !cut_inside ? (2 * x <= first + ctx ? first : ctx)
                                    : x <= lo   ? lo
                                                : (x + block_size / 2) / block_size * block_size;
                if (cut <= lo) p->share[t++] = ranges;
                else {
                    hi = cut < hi ? cut : hi;
                    break;
                }
            }
            if (ranges == most) return -1;
            p->range_seq[ranges] = b;
            p->range_lo[ranges] = lo;
            p->range_hi[ranges++] = hi;
            lo = hi;
        }
        seen += ctx - first;
    }
    while (t <= T) p->share[t++] = ranges;
    p->first_range[batch] = ranges;
    p->ranges = ranges;
    p->items = ranges;   /* an item is a range of keys, every kv head */
    return p->items;
}

/* Item c of a plan: its sequence and its keys' positions [*lo, *hi) (for tests). */
void pipeserve_decode_item(const void *plan, int64_t c, int64_t *seq, int64_t *lo, int64_t *hi) {
    const decode_plan *p = (const decode_plan *)plan;
    *seq = p->range_seq[c];
    *lo = p->range_lo[c];
    *hi = p->range_hi[c];
}

/* Thread t's share of the plan's items: [*i0, *i1). */
void pipeserve_decode_share(const void *plan, int t, int64_t *i0, int64_t *i1) {
    const decode_plan *p = (const decode_plan *)plan;
    *i0 = p->share[t];
    *i1 = p->share[t + 1];
}

void pipeserve_decode_items(const void *plan, const float *q, const void *k_cache, const void *v_cache, int dtype,
                            const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens,
                            float scale, float softcap, int bf16_math, int64_t i0, int64_t i1) {
    const decode_plan *p = (const decode_plan *)plan;
    const int64_t head_bytes = head_row_bytes(dtype, p->head_dim);
    const range_fn fn = pick_range(dtype, p->head_dim, bf16_math);
    (void)context_lens;   /* the plan holds each item's keys */
    for (int64_t c = i0; c < i1; c++) {
        const int64_t b = p->range_seq[c];
        key_range r = {(const char *)k_cache, (const char *)v_cache, block_tables + b * max_blocks, p->range_lo[c],
                       p->range_hi[c], 0, p->kv_heads * head_bytes, p->block_size, p->kv_heads, p->group, scale,
                       softcap};
        fn(q + b * p->heads * p->head_dim, &r, dtype, p->head_dim, p->parts + c * p->heads * p->pstride);
    }
}

/* The output row of (sequence, head) row bh, from its ranges' parts. */
static void merge_row(const decode_plan *p, int64_t bh, float *dst) {
    const int64_t b = bh / p->heads, h = bh % p->heads;
    const int64_t slot = (p->first_range[b] * p->kv_heads + h / p->group) * p->group + h % p->group;
    merge_parts(p->parts + slot * p->pstride, p->first_range[b + 1] - p->first_range[b],
                p->kv_heads * p->group * p->pstride, p->head_dim, dst);
}

void pipeserve_decode_merge(const void *plan, int64_t bh0, int64_t bh1, float *out) {
    const decode_plan *p = (const decode_plan *)plan;
    for (int64_t bh = bh0; bh < bh1; bh++) merge_row(p, bh, out + bh * p->head_dim);
}

/* Merged rows [bh0, bh1) as bfloat16 (rounded to nearest even, as torch's .to). */
static void merge_bf16(const void *plan, int64_t bh0, int64_t bh1, uint16_t *out) {
    const decode_plan *p = (const decode_plan *)plan;
    float row[p->head_dim];
    for (int64_t bh = bh0; bh < bh1; bh++) {
        merge_row(p, bh, row);
        for (int64_t d = 0; d < p->head_dim; d++) out[bh * p->head_dim + d] = f32_to_bf16(row[d]);
    }
}

/* q: [batch, heads, head_dim]; out: the same shape; both float32, or both bfloat16 when
 * io_bf16 (a bfloat16 model's query read and its output written here, which saves the
 * caller two conversions per layer: a small decode's glue costs as much as its keys).
 * block_tables: [batch, max_blocks] int64; context_lens: [batch] int64 (>= 1).
 * window: sliding window in tokens (0: none); softcap: logit soft cap (0: none).
 * bf16_math: an 8-bit cache may be read as bf16 (the model is bfloat16).
 * Returns 0, or -1 when a work buffer cannot be allocated. */
int pipeserve_paged_decode_io(const void *q, const void *k_cache, const void *v_cache, int dtype,
                              const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens,
                              int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                              int64_t block_size, float scale, int64_t window, float softcap, void *out,
                              int num_threads, int bf16_math, int io_bf16) {
    if (step_keys(context_lens, batch, window) * kv_heads < PARALLEL_MIN_ROWS) num_threads = 1;
    const int64_t plan_bytes = (pipeserve_decode_plan_bytes(batch, heads, head_dim, num_threads) + 63) / 64 * 64;
    const int64_t nq = batch * heads * head_dim;
    const int64_t q_bytes = io_bf16 ? (nq * (int64_t)sizeof(float) + 63) / 64 * 64 : 0;   /* sizes: multiples of 64 */
    char *buf = aligned_alloc(64, (size_t)(plan_bytes + q_bytes));
    if (!buf) return -1;
    void *plan = buf;
    const int64_t items = pipeserve_decode_plan(plan, context_lens, batch, heads, kv_heads, head_dim, block_size,
                                                window, num_threads);
    if (items < 0) {
        free(buf);
        return -1;
    }
    const float *qf = (const float *)q;
    if (io_bf16) {
        float *qw = (float *)(buf + plan_bytes);
        for (int64_t i = 0; i < nq; i++) qw[i] = bf16_to_f32(((const uint16_t *)q)[i]);
        qf = qw;
    }
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++)
            pipeserve_decode_items(plan, qf, k_cache, v_cache, dtype, block_tables, max_blocks, context_lens, scale,
                                   softcap, bf16_math, item, item + 1);
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < batch * heads; bh++) {
            if (io_bf16) merge_bf16(plan, bh, bh + 1, (uint16_t *)out);
            else pipeserve_decode_merge(plan, bh, bh + 1, (float *)out);
        }
    }
    free(buf);
    return 0;
}

/* pipeserve_paged_decode_io with float32 q and out (the entry point older builds share). */
int pipeserve_paged_decode(const float *q, const void *k_cache, const void *v_cache, int dtype,
                           const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens,
                           int64_t batch, int64_t heads, int64_t kv_heads, int64_t head_dim,
                           int64_t block_size, float scale, int64_t window, float softcap, float *out,
                           int num_threads, int bf16_math) {
    return pipeserve_paged_decode_io(q, k_cache, v_cache, dtype, block_tables, max_blocks, context_lens, batch, heads,
                                     kv_heads, head_dim, block_size, scale, window, softcap, out, num_threads,
                                     bf16_math, 0);
}

/* ---------------------------------------------------------------------------
 * Paged prefill attention for bfloat16 caches on CPUs with AVX512_BF16.
 *
 * The queries of one sequence sit at positions ctx - q_len .. ctx - 1 and
 * attend causally to keys 0 .. their own position, read from the paged cache
 * (the runner writes the new keys first), so a fresh prompt, a chunk after
 * cached tokens and a prefix-cache hit are the same case.
 *
 * Work item = (sequence, kv head). Its keys and values are first copied into
 * a scratch laid out for vdpbf16ps (16-key tiles; keys transposed so one
 * instruction scores 16 keys against a pair of query dims, values interleaved
 * by key pairs), then every query row of the G heads that share the kv head
 * walks the tiles from its window's start (the first tile without a window)
 * up to its position with an online softmax (flash attention: running max and
 * sum, output rescaled when the max grows), R rows and T tiles (16 T keys) a
 * block (prefill_block). The max a row's probabilities are taken against moves
 * only when a score passes it by more than RESCALE_SLACK (e^8 keeps them far
 * inside float and bf16), so the exponentials need not wait for each block's
 * max. Probabilities are rounded to bf16 before the PV product, as the PyTorch
 * path does.
 * ------------------------------------------------------------------------- */
#if defined(__AVX512BF16__)
#define PREFILL_KERNEL 1
#include "avx512_transpose.h"
/* Array bounds are fixed (not R, NV, T) so that, once inlined with constant R,
 * NV and T, the arrays become registers instead of stack VLAs. */
#define PF_MAX_R 4
#define PF_MAX_NV 16
#define PF_MAX_T 16
#define RESCALE_SLACK 8.0f
#define STAGE_AHEAD 16

/* Keys and values base .. ctx - 1 of one kv head -> the scratch (base a multiple of 16;
 * staged key u is the key at position base + u).
 * kt: [tiles][head_dim / 2][16] dwords, dword (tile, k, j) = dims 2k, 2k+1 of key 16 tile + j.
 * vi: [tiles][8][head_dim] dwords, dword (tile, j, d) = dim d of keys 16 tile + 2j and + 2j + 1.
 * Keys past ctx are zero (they are always masked; zero keeps NaN out).
 * A tile at a time: its 16 key rows transposed 16 dwords by 16 (transpose16), its value rows
 * interleaved in pairs (vpermt2w). An 8-bit cache's rows are dequantized (code * scale, rounded
 * to bf16) into a bf16 copy of the tile first. */
static void stage_kv_tiles(const char *k_cache, const char *v_cache, int dtype, const int64_t *table, int64_t base,
                           int64_t ctx, int64_t kv_head, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                           uint32_t *restrict kt, uint16_t *restrict vi) {
    const int64_t pairs = head_dim / 2, tiles = (ctx - base + 15) / 16, head_bytes = head_row_bytes(dtype, head_dim);
    /* The kv head's rows walked with cursors (no division per key), and STAGE_AHEAD keys ahead. */
    const key_range range = {.k = k_cache, .v = v_cache, .table = table, .begin = base, .end = ctx,
                             .head_offset = kv_head * head_bytes, .row_stride = kv_heads * head_bytes,
                             .block_size = block_size, .kv_heads = 1};
    key_cursor at = cursor_at(&range, base), ahead = cursor_at(&range, base + STAGE_AHEAD);
    static const uint16_t zero_row[PF_MAX_NV * 16];
    uint16_t kq[16][PF_MAX_NV * 16], vq[16][PF_MAX_NV * 16];   /* a tile's dequantized rows (8-bit caches) */
    float row[PF_MAX_NV * 16];
    /* vpermt2w indices: dims 16 h .. 16 h + 15 of rows a (0..31) and b (32..63), interleaved. */
    __m512i mix[2];
    for (int h = 0; h < 2; h++) {
        uint16_t idx[32];
        for (int i = 0; i < 32; i++) idx[i] = (uint16_t)(16 * h + i / 2 + (i % 2) * 32);
        mix[h] = _mm512_loadu_si512(idx);
    }
    for (int64_t tile = 0; tile < tiles; tile++) {
        const uint16_t *kr[16], *vr[16];
        for (int j = 0; j < 16; j++) {
            if (at.t >= ctx) {
                kr[j] = vr[j] = zero_row;
                continue;
            }
            if (ahead.t < ctx) {   /* the rows' blocks are scattered: ask for them ahead */
                const int64_t off = cursor_offset(&range, &ahead);
                for (int64_t b = 0; b < head_bytes; b += 64) {
                    _mm_prefetch(k_cache + off + b, _MM_HINT_T0);
                    _mm_prefetch(v_cache + off + b, _MM_HINT_T0);
                }
            }
            const int64_t offset = cursor_offset(&range, &at);
            cursor_advance(&range, &at, 1);
            cursor_advance(&range, &ahead, 1);
            kr[j] = (const uint16_t *)(k_cache + offset);
            vr[j] = (const uint16_t *)(v_cache + offset);
            if (is_8bit(dtype)) {
                load_row(k_cache + offset, dtype, head_dim, row);
                for (int64_t d = 0; d < head_dim; d++) kq[j][d] = f32_to_bf16(row[d]);
                load_row(v_cache + offset, dtype, head_dim, row);
                for (int64_t d = 0; d < head_dim; d++) vq[j][d] = f32_to_bf16(row[d]);
                kr[j] = kq[j];
                vr[j] = vq[j];
            }
        }
        uint32_t *kd = kt + tile * pairs * 16;
        for (int64_t c = 0; c < pairs; c += 16) {   /* dwords c .. c + 15 of the 16 keys */
            __m512i r[16];
            for (int j = 0; j < 16; j++) r[j] = _mm512_loadu_si512(kr[j] + 2 * c);
            transpose16(r);
            for (int k = 0; k < 16; k++) _mm512_storeu_si512(kd + (c + k) * 16, r[k]);
        }
        uint16_t *vd = vi + tile * 16 * head_dim;
        for (int j = 0; j < 8; j++)
            for (int64_t d = 0; d < head_dim; d += 32) {   /* dims d .. d + 31 of keys 2j, 2j + 1 */
                const __m512i va = _mm512_loadu_si512(vr[2 * j] + d), vb = _mm512_loadu_si512(vr[2 * j + 1] + d);
                _mm512_storeu_si512(vd + (j * head_dim + d) * 2, _mm512_permutex2var_epi16(va, mix[0], vb));
                _mm512_storeu_si512(vd + (j * head_dim + d + 16) * 2, _mm512_permutex2var_epi16(va, mix[1], vb));
            }
    }
}

/* The first key position the prefill queries from first_pos on see; staging starts
 * at its tile (a multiple of 16). */
static inline int64_t prefill_base(int64_t first_pos, int64_t window) {
    const int64_t first = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
    return first - first % 16;
}

/* T tiles from tile0 on, for R rows (qp, pos: their queries and positions; nr of them
 * real), head_dim = 16 * NV: the block's scores of all R rows first (R * T dot-product
 * chains, each query pair broadcast once for the T tiles), then each row's softmax over
 * the block (one max a block; the probabilities rounded to bf16 into pb), then the
 * block's values. The rows' state (acc, lsum, m) lives in memory (L1) between blocks:
 * the scores' R * T registers and the accumulators' R * NV do not fit in 32 together.
 * A row at position p sees keys p - window < j <= p (window 0: every j <= p). */
static inline __attribute__((always_inline)) void prefill_block(
        const uint32_t *const qp[PF_MAX_R], const int R, const int NV, const int T, const int64_t tile0,
        const int64_t *pos, int nr, const uint32_t *kt, const uint16_t *vi, float scale, int64_t base,
        int64_t window, float softcap, float acc[PF_MAX_R][PF_MAX_NV * 16], float *lsum, float *m) {
    const int64_t head_dim = 16 * NV, pairs = 8 * NV;
    __m512 s[PF_MAX_R][PF_MAX_T];
    UNROLL
    for (int i = 0; i < R; i++) {
        UNROLL
        for (int t = 0; t < T; t++) s[i][t] = _mm512_setzero_ps();
    }
    const uint32_t *kb = kt + tile0 * pairs * 16;
    /* Fewer than 8 chains (the last tiles of a range): two per score, over even and odd pairs. */
    const int C = R * T >= 8 ? 1 : 2;
    __m512 s2[PF_MAX_R][PF_MAX_T];
    UNROLL
    for (int i = 0; i < R; i++) {
        UNROLL
        for (int t = 0; t < T; t++) s2[i][t] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < pairs; k += C) {
        __m512bh qb[PF_MAX_R];
        UNROLL
        for (int i = 0; i < R; i++) qb[i] = (__m512bh)_mm512_set1_epi32((int)qp[i][k]);
        UNROLL
        for (int t = 0; t < T; t++) {
            const __m512bh kk = (__m512bh)_mm512_loadu_si512(kb + (t * pairs + k) * 16);
            UNROLL
            for (int i = 0; i < R; i++) s[i][t] = _mm512_dpbf16_ps(s[i][t], kk, qb[i]);
        }
        if (C == 2) {
            UNROLL
            for (int i = 0; i < R; i++) qb[i] = (__m512bh)_mm512_set1_epi32((int)qp[i][k + 1]);
            UNROLL
            for (int t = 0; t < T; t++) {
                const __m512bh kk = (__m512bh)_mm512_loadu_si512(kb + (t * pairs + k + 1) * 16);
                UNROLL
                for (int i = 0; i < R; i++) s2[i][t] = _mm512_dpbf16_ps(s2[i][t], kk, qb[i]);
            }
        }
    }
    if (C == 2) {
        UNROLL
        for (int i = 0; i < R; i++) {
            UNROLL
            for (int t = 0; t < T; t++) s[i][t] = _mm512_add_ps(s[i][t], s2[i][t]);
        }
    }
    /* Is every key of the block seen by every row? (Rows are in position order.) */
    const int64_t first = base + tile0 * 16, last = first + 16 * T - 1;
    const int full = last <= pos[0] && (window <= 0 || first > pos[nr - 1] - window);
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    uint32_t pb[PF_MAX_R][PF_MAX_T * 8];   /* probabilities as bf16 pairs (keys 2j, 2j + 1 of a tile) */
    float alpha[PF_MAX_R];
    UNROLL
    for (int i = 0; i < R; i++) {
        __m512 x[PF_MAX_T];
        __mmask16 valid[PF_MAX_T];
        __m512 mx = _mm512_set1_ps(-INFINITY);
        UNROLL
        for (int t = 0; t < T; t++) {
            x[t] = _mm512_mul_ps(s[i][t], vscale);
            if (softcap > 0.0f)
                x[t] = _mm512_mul_ps(_mm512_set1_ps(softcap),
                                     tanh16(_mm512_mul_ps(x[t], _mm512_set1_ps(1.0f / softcap))));
            valid[t] = 0xFFFF;
            if (!full) {
                /* A row with no valid key in a tile (its position is before the tile, or its window
                 * starts after it) gets probability 0 there; until its first valid key its max is
                 * -inf, the lanes computed from it NaN but masked to 0. */
                const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32((int)(first + 16 * t)), iota);
                valid[t] = _mm512_mask_cmpgt_epi32_mask(
                    _mm512_cmple_epi32_mask(keys, _mm512_set1_epi32((int)pos[i])), keys,
                    _mm512_set1_epi32(window > 0 ? (int)(pos[i] - window) : -1));
                x[t] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid[t], x[t]);
            }
            mx = _mm512_max_ps(mx, x[t]);
        }
        /* The probabilities are taken against a reference max that moves only when a score
         * passes it by more than RESCALE_SLACK (always at the first valid key): the branch
         * is predicted, so the exponentials do not wait for the block's max. */
        const float bm = _mm512_reduce_max_ps(mx);
        alpha[i] = 1.0f;
        if (__builtin_expect(bm > m[i] + RESCALE_SLACK, 0)) {
            alpha[i] = exp_f32(m[i] - bm);
            m[i] = bm;
        }
        const __m512 vm = _mm512_set1_ps(m[i]);
        __m512 sum = _mm512_setzero_ps();
        UNROLL
        for (int t = 0; t < T; t++) {
            const __m512 d = _mm512_max_ps(_mm512_sub_ps(x[t], vm), _mm512_set1_ps(-87.0f));   /* <= 8 */
            const __m512 p = _mm512_maskz_mov_ps(valid[t], exp16_core(d));
            const __m256bh p16 = _mm512_cvtneps_pbh(p);
            /* Sum the rounded probabilities: numerator and denominator then agree. */
            sum = _mm512_add_ps(sum, _mm512_cvtpbh_ps(p16));
            _mm256_storeu_si256((__m256i *)(pb[i] + 8 * t), (__m256i)p16);
        }
        lsum[i] = lsum[i] * alpha[i] + _mm512_reduce_add_ps(sum);
    }
    __m512 a[PF_MAX_R][PF_MAX_NV];
    UNROLL
    for (int i = 0; i < R; i++) {
        const __m512 va = _mm512_set1_ps(alpha[i]);
        UNROLL
        for (int c = 0; c < NV; c++) a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[i] + 16 * c), va);
    }
    const uint16_t *vb = vi + tile0 * 16 * head_dim;
    UNROLL
    for (int j = 0; j < 8 * T; j++) {
        __m512bh v[PF_MAX_NV];
        UNROLL
        for (int c = 0; c < NV; c++) v[c] = (__m512bh)_mm512_loadu_si512(vb + (j * head_dim + 16 * c) * 2);
        UNROLL
        for (int i = 0; i < R; i++) {
            const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pb[i][j]);
            UNROLL
            for (int c = 0; c < NV; c++) a[i][c] = _mm512_dpbf16_ps(a[i][c], v[c], pp);
        }
    }
    UNROLL
    for (int i = 0; i < R; i++) {
        UNROLL
        for (int c = 0; c < NV; c++) _mm512_storeu_ps(acc[i] + 16 * c, a[i][c]);
    }
}

/* Rows r0 .. r0 + nr - 1 (row = query token * group + head in group, nr <= R) of one
 * (sequence, kv head), from the staged keys (which start at position base) up to each
 * row's position, T tiles a block and the last ones in blocks of T / 2, T / 4, ... 1. */
static inline __attribute__((always_inline)) void prefill_rows(
        const uint16_t *q, uint16_t *out, int64_t r0, int nr, const int R, const int NV, const int T,
        int64_t first_pos, int64_t group, int64_t kv_head, int64_t heads, const uint32_t *kt, const uint16_t *vi,
        float scale, int64_t base, int64_t window, float softcap) {
    const int64_t head_dim = 16 * NV;
    const uint32_t *qp[PF_MAX_R];
    uint16_t *op[PF_MAX_R];
    int64_t pos[PF_MAX_R];
    float acc[PF_MAX_R][PF_MAX_NV * 16], lsum[PF_MAX_R], m[PF_MAX_R];
    UNROLL
    for (int i = 0; i < R; i++) {
        const int64_t r = r0 + (i < nr ? i : nr - 1);   /* spare lanes repeat the last row, unused */
        const int64_t token = r / group, head = kv_head * group + r % group;
        pos[i] = first_pos + token;
        qp[i] = (const uint32_t *)(q + (token * heads + head) * head_dim);
        op[i] = out + (token * heads + head) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) acc[i][d] = 0.0f;
        lsum[i] = 0.0f;
        m[i] = -INFINITY;
    }
    const int64_t first_key = window > 0 && pos[0] - window + 1 > base ? pos[0] - window + 1 : base;
    const int64_t end = (pos[nr - 1] - base) / 16 + 1;   /* tiles up to the last row's position */
    int64_t tile = (first_key - base) / 16;
    for (; tile + T <= end; tile += T)
        prefill_block(qp, R, NV, T, tile, pos, nr, kt, vi, scale, base, window, softcap, acc, lsum, m);
    /* The rest (fewer than T tiles) in blocks of T / 2, T / 4, ... 1 tiles, each at most once. */
    if (T >= 16 && end - tile >= 8) {
        prefill_block(qp, R, NV, 8, tile, pos, nr, kt, vi, scale, base, window, softcap, acc, lsum, m);
        tile += 8;
    }
    if (T >= 8 && end - tile >= 4) {
        prefill_block(qp, R, NV, 4, tile, pos, nr, kt, vi, scale, base, window, softcap, acc, lsum, m);
        tile += 4;
    }
    if (T >= 4 && end - tile >= 2) {
        prefill_block(qp, R, NV, 2, tile, pos, nr, kt, vi, scale, base, window, softcap, acc, lsum, m);
        tile += 2;
    }
    if (T >= 2 && end - tile >= 1)
        prefill_block(qp, R, NV, 1, tile, pos, nr, kt, vi, scale, base, window, softcap, acc, lsum, m);
    for (int i = 0; i < nr; i++) {
        const __m512 inv = _mm512_set1_ps(1.0f / lsum[i]);
        UNROLL
        for (int c = 0; c < NV; c++)
            _mm256_storeu_si256((__m256i *)(op[i] + 16 * c),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc[i] + 16 * c), inv)));
    }
}

#define PREFILL_ROWS(NAME, R, NV, T)                                                                   \
    static void NAME(const uint16_t *q, uint16_t *out, int64_t r0, int nr, int64_t first_pos,          \
                     int64_t group, int64_t kv_head, int64_t heads, const uint32_t *kt,                \
                     const uint16_t *vi, float scale, int64_t base, int64_t window, float softcap) {   \
        prefill_rows(q, out, r0, nr, R, NV, T, first_pos, group, kv_head, heads, kt, vi, scale, base, \
                     window, softcap);                                                                 \
    }
PREFILL_ROWS(prefill_rows_64, 4, 4, 4)
PREFILL_ROWS(prefill_rows_128, 2, 8, 8)
PREFILL_ROWS(prefill_rows_32, 4, 2, 4)
PREFILL_ROWS(prefill_rows_256, 1, 16, 16)

/* The same flash attention on Intel AMX tiles (AMX-BF16), where the CPU has them and Linux
 * grants the tile state: the staged scratch above is already what the tiles read. A block
 * of 16 query rows (row = query token * group + head in group, copied into a zeroed buffer:
 * the rows are not evenly spaced in q) against PA_KEYS keys at a time:
 * - scores (amx_scores): C tiles 0-3 (16 rows x 16 keys each), A tile 4 = 32 dims of the rows,
 *   B tile 5 = kt's 16 dim pairs x 16 keys of a key tile (contiguous, 64 bytes a row); stored to s;
 * - each row's softmax (amx_softmax_row): prefill_block's, in base 2 (2^(t - m2), t = score *
 *   scale * log2(e), one fmsub a vector where every key of the block is seen), with its causal /
 *   window mask, soft cap, reference max moved by RESCALE_SLACK and probabilities rounded to bf16
 *   and summed rounded; into p, zero past the block's keys to a multiple of 32;
 * - values: the rows' float32 outputs (o, in L1) as C tiles 0-3 (64 dims at a time), A tile 4 =
 *   32 keys' probabilities, B tile 5 = vi's 16 key pairs x 16 dims (two key tiles, head_dim * 4
 *   bytes a row). An odd last tile pairs with the tile after it: its probabilities are 0 and the
 *   caller zeroes one tile past the staged ones (0 x NaN would not be 0).
 * Differs from prefill_block by float32 summation order and the exponential's polynomial (both
 * within ~1.2e-7 relative). The softmax is most of the time: scores and values on the tiles
 * alone measured ~0.4 of it (benchmarks/README.md, thirty-sixth session). */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PREFILL_AMX 1
#include "amx_tiles.h"
#define PA_KEYS 64   /* keys a block: 4 key tiles, the C tiles 0-3 */
#define PA_LOG2E 1.44269504f   /* scores into base 2 */
#define PA_LN2 0.69314718f
/* The rows' outputs at oc (16 rows, stride bytes apart) <-> C tiles 0 .. nc - 1 (16 dims each;
 * nc 2 or 4): OP is _tile_loadd or _tile_stored (tile numbers must be constants). */
#define AMX_OUT_TILES(OP, oc, stride, nc)   \
    do {                                    \
        OP(0, (oc), (stride));              \
        OP(1, (oc) + 16, (stride));         \
        if ((nc) > 2) {                     \
            OP(2, (oc) + 32, (stride));     \
            OP(3, (oc) + 48, (stride));     \
        }                                   \
    } while (0)

/* One row's probabilities over a block of T key tiles (scores si, 16 T floats) into pi as bf16
 * (zero to a multiple of 32 keys), in base 2: t = score * scale * log2(e), p = 2^(t - m2)
 * with m2 the row's reference max, moved (and o, lsum rescaled) when a t passes it by more
 * than RESCALE_SLACK * log2(e); lsum gathers the rounded probabilities. FAST: every key seen,
 * no soft cap (one fmsub a vector before the exponential); else the causal / window mask and
 * the soft cap as prefill_block applies them. */
static inline __attribute__((always_inline)) void amx_softmax_row(
        const float *si, uint16_t *pi, const int T, const int FAST, float scale, float softcap, int64_t first,
        int64_t pos, int64_t window, float *m2, __m512 *lsum, float *o, int64_t head_dim) {
    const float c2 = scale * PA_LOG2E;
    __m512 x[PA_KEYS / 16];
    __mmask16 valid[PA_KEYS / 16];
    __m512 mx = _mm512_set1_ps(-INFINITY);
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int t = 0; t < T; t++) {
        x[t] = _mm512_load_ps(si + 16 * t);   /* FAST: raw scores, scaled in the fmsub below */
        valid[t] = 0xFFFF;
        if (!FAST) {
            if (softcap > 0.0f) {
                x[t] = _mm512_mul_ps(_mm512_set1_ps(softcap),
                                     tanh16(_mm512_mul_ps(x[t], _mm512_set1_ps(scale / softcap))));
                x[t] = _mm512_mul_ps(x[t], _mm512_set1_ps(PA_LOG2E));
            } else {
                x[t] = _mm512_mul_ps(x[t], _mm512_set1_ps(c2));
            }
            const __m512i keys = _mm512_add_epi32(_mm512_set1_epi32((int)(first + 16 * t)), iota);
            valid[t] = _mm512_mask_cmpgt_epi32_mask(_mm512_cmple_epi32_mask(keys, _mm512_set1_epi32((int)pos)), keys,
                                                    _mm512_set1_epi32(window > 0 ? (int)(pos - window) : -1));
            x[t] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid[t], x[t]);
        }
        mx = _mm512_max_ps(mx, x[t]);
    }
    if (FAST) mx = _mm512_mul_ps(mx, _mm512_set1_ps(c2));   /* c2 > 0: the max of the scaled scores */
    /* (the lanes compared with m2 + slack: a horizontal max only when one passes it) */
    if (__builtin_expect(_mm512_cmp_ps_mask(mx, _mm512_set1_ps(*m2 + RESCALE_SLACK * PA_LOG2E), _CMP_GT_OQ), 0)) {
        const float bm = _mm512_reduce_max_ps(mx), alpha = exp_f32((*m2 - bm) * PA_LN2);
        *m2 = bm;
        const __m512 va = _mm512_set1_ps(alpha);
        *lsum = _mm512_mul_ps(*lsum, va);
        for (int64_t d = 0; d < head_dim; d += 16) _mm512_store_ps(o + d, _mm512_mul_ps(_mm512_load_ps(o + d), va));
    }
    const __m512 vm = _mm512_set1_ps(*m2);
    for (int t = 0; t < T; t++) {
        __m512 e;
        if (FAST) {
            e = exp2_16(_mm512_fmsub_ps(x[t], _mm512_set1_ps(c2), vm));
        } else {   /* a masked lane (or a row with no key yet: -inf - -inf) -> 0 */
            e = _mm512_maskz_mov_ps(valid[t], exp2_16(_mm512_max_ps(_mm512_sub_ps(x[t], vm), _mm512_set1_ps(-127.0f))));
        }
        const __m256bh p16 = _mm512_cvtneps_pbh(e);
        *lsum = _mm512_add_ps(*lsum, _mm512_cvtpbh_ps(p16));
        _mm256_store_si256((__m256i *)(pi + 16 * t), (__m256i)p16);
    }
    if (T & 1) _mm256_store_si256((__m256i *)(pi + 16 * T), _mm256_setzero_si256());
}

/* A block's scores: the 16 rows of qb against key tiles tile .. tile + T - 1 of kt, into C
 * tiles 0 .. T - 1 (A tile 4: 32 dims of the rows; B tile 5: those dims' pairs of a key tile). */
static inline __attribute__((always_inline)) void amx_scores(const uint16_t *qb, const uint32_t *kt, int64_t tile,
                                                             int T, int64_t pairs, int64_t head_dim) {
    _tile_zero(0);
    if (T > 1) _tile_zero(1);
    if (T > 2) _tile_zero(2);
    if (T > 3) _tile_zero(3);
    for (int64_t c = 0; c < head_dim; c += 32) {
        const uint32_t *kb = kt + (tile * pairs + c / 2) * 16;
        _tile_loadd(4, qb + c, head_dim * 2);
        _tile_loadd(5, kb, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (T > 1) {
            _tile_loadd(5, kb + pairs * 16, 64);
            _tile_dpbf16ps(1, 4, 5);
        }
        if (T > 2) {
            _tile_loadd(5, kb + 2 * pairs * 16, 64);
            _tile_dpbf16ps(2, 4, 5);
        }
        if (T > 3) {
            _tile_loadd(5, kb + 3 * pairs * 16, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
}

/* C tiles 0 .. T - 1 -> s (16 rows of PA_KEYS floats). */
static inline __attribute__((always_inline)) void amx_store_scores(float *s, int T) {
    _tile_stored(0, s, PA_KEYS * 4);
    if (T > 1) _tile_stored(1, s + 16, PA_KEYS * 4);
    if (T > 2) _tile_stored(2, s + 32, PA_KEYS * 4);
    if (T > 3) _tile_stored(3, s + 48, PA_KEYS * 4);
}

static void prefill_rows_amx(const uint16_t *q, uint16_t *out, int64_t r0, int nr, int64_t first_pos, int64_t group,
                             int64_t kv_head, int64_t heads, int64_t head_dim, const uint32_t *kt,
                             const uint16_t *vi, float scale, int64_t base, int64_t window, float softcap) {
    const int64_t pairs = head_dim / 2;
    uint16_t qb[16 * PF_MAX_NV * 16] __attribute__((aligned(64)));
    float s[16 * PA_KEYS] __attribute__((aligned(64)));
    uint16_t p[16 * PA_KEYS] __attribute__((aligned(64)));
    float o[16 * PF_MAX_NV * 16] __attribute__((aligned(64)));
    float m[16];
    __m512 lsum[16];   /* each row's sum of probabilities, 16 lanes (added up at the end) */
    int64_t pos[16];
    uint16_t *op[16];
    for (int i = 0; i < 16; i++) {
        m[i] = -INFINITY;
        lsum[i] = _mm512_setzero_ps();
        if (i < nr) {
            const int64_t r = r0 + i, token = r / group, head = kv_head * group + r % group;
            pos[i] = first_pos + token;
            op[i] = out + (token * heads + head) * head_dim;
            memcpy(qb + i * head_dim, q + (token * heads + head) * head_dim, head_dim * 2);
        } else {
            pos[i] = pos[nr - 1];
            memset(qb + i * head_dim, 0, head_dim * 2);
        }
    }
    memset(o, 0, 16 * head_dim * sizeof(float));
    const int64_t first_key = window > 0 && pos[0] - window + 1 > base ? pos[0] - window + 1 : base;
    const int64_t end = (pos[nr - 1] - base) / 16 + 1;   /* tiles up to the last row's position */
    for (int64_t tile = (first_key - base) / 16; tile < end; tile += PA_KEYS / 16) {
        const int T = end - tile < PA_KEYS / 16 ? (int)(end - tile) : PA_KEYS / 16, halves = (T + 1) / 2;
        amx_scores(qb, kt, tile, T, pairs, head_dim);
        amx_store_scores(s, T);
        /* each row's softmax over the block */
        const int64_t first = base + tile * 16, last = first + 16 * T - 1;
        const int full = last <= pos[0] && (window <= 0 || first > pos[nr - 1] - window);
        for (int i = 0; i < 16; i++) {
            uint16_t *pi = p + i * PA_KEYS;
            if (i >= nr) {
                memset(pi, 0, halves * 64);
                continue;
            }
            if (full && softcap <= 0.0f && T == PA_KEYS / 16)
                amx_softmax_row(s + i * PA_KEYS, pi, PA_KEYS / 16, 1, scale, 0.0f, first, pos[i], window, m + i,
                                lsum + i, o + i * head_dim, head_dim);
            else
                amx_softmax_row(s + i * PA_KEYS, pi, T, 0, scale, softcap, first, pos[i], window, m + i, lsum + i,
                                o + i * head_dim, head_dim);
        }
        /* values: o += p . v, 64 dims at a time */
        for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
            const int nc = head_dim - d0 < 64 ? (int)((head_dim - d0) / 16) : 4;
            float *oc = o + d0;
            AMX_OUT_TILES(_tile_loadd, oc, head_dim * 4, nc);
            for (int h = 0; h < halves; h++) {
                const uint16_t *vb = vi + ((tile + 2 * h) * 8 * head_dim + d0) * 2;
                _tile_loadd(4, p + 32 * h, PA_KEYS * 2);
                _tile_loadd(5, vb, head_dim * 4);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(5, vb + 32, head_dim * 4);
                _tile_dpbf16ps(1, 4, 5);
                if (nc > 2) {
                    _tile_loadd(5, vb + 64, head_dim * 4);
                    _tile_dpbf16ps(2, 4, 5);
                    _tile_loadd(5, vb + 96, head_dim * 4);
                    _tile_dpbf16ps(3, 4, 5);
                }
            }
            AMX_OUT_TILES(_tile_stored, oc, head_dim * 4, nc);
        }
    }
    for (int i = 0; i < nr; i++) {
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(lsum[i]));
        for (int64_t d = 0; d < head_dim; d += 16)
            _mm256_storeu_si256((__m256i *)(op[i] + d),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(o + i * head_dim + d), inv)));
    }
}
#endif
#endif

/* Can pipeserve_paged_prefill run this shape? (bf16 queries; a bf16 or 8-bit cache;
 * AVX512_BF16 CPU; head_dim 32, 64, 128 or 256.) */
int pipeserve_prefill_supported(int dtype, int64_t head_dim) {
#if defined(PREFILL_KERNEL)
    return (dtype == DT_BFLOAT16 || is_8bit(dtype)) &&
           (head_dim == 32 || head_dim == 64 || head_dim == 128 || head_dim == 256);
#else
    (void)dtype;
    (void)head_dim;
    return 0;
#endif
}

/* pipeserve_paged_prefill's work on the vdpbf16ps rows (amx 0) or the AMX tiles' (amx 1);
 * -2 where this build has no prefill kernel. */
static int paged_prefill(const uint16_t *q, const void *k_cache, const void *v_cache, int dtype, const int64_t *seqs,
                         int64_t num_seqs, const int64_t *block_tables, int64_t max_blocks, int64_t heads,
                         int64_t kv_heads, int64_t head_dim, int64_t block_size, float scale, int64_t window,
                         float softcap, uint16_t *out, int num_threads, int amx) {
#if defined(PREFILL_KERNEL)
    if (!pipeserve_prefill_supported(dtype, head_dim) || heads % kv_heads != 0) return -2;
    const int64_t group = heads / kv_heads;
    const int R = amx ? 16 : head_dim == 128 ? 2 : head_dim == 256 ? 1 : 4;
    int64_t max_tiles = 1;
    for (int64_t s = 0; s < num_seqs; s++) {
        const int64_t ctx = seqs[4 * s + 2], base = prefill_base(ctx - seqs[4 * s + 1], window);
        const int64_t tiles = (ctx - base + 15) / 16;
        max_tiles = tiles > max_tiles ? tiles : max_tiles;
    }
    const size_t tile_bytes = (size_t)16 * head_dim * 2;
    const size_t scratch = (2 * (size_t)max_tiles + 1) * tile_bytes;   /* kt, vi and a tile past vi's (AMX) */
    const int64_t items = num_seqs * kv_heads;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
    {
        char *work = (char *)thread_scratch(scratch, &failed);
#if defined(PREFILL_AMX)
        if (amx) amx_tile_config();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < items; item++) {
            if (!work) continue;
            const int64_t s = item / kv_heads, kv_head = item % kv_heads;
            const int64_t row = seqs[4 * s], q_len = seqs[4 * s + 1], ctx = seqs[4 * s + 2];
            uint32_t *kt = (uint32_t *)work;
            uint16_t *vi = (uint16_t *)(work + (size_t)max_tiles * tile_bytes);
            const int64_t base = prefill_base(ctx - q_len, window);
            stage_kv_tiles((const char *)k_cache, (const char *)v_cache, dtype, block_tables + s * max_blocks, base, ctx,
                           kv_head, kv_heads, head_dim, block_size, kt, vi);
            const uint16_t *qs = q + row * heads * head_dim;
            uint16_t *os = out + row * heads * head_dim;
            const int64_t rows = q_len * group;
            if (amx) {
#if defined(PREFILL_AMX)
                memset((char *)vi + (ctx - base + 15) / 16 * tile_bytes, 0, tile_bytes);
                for (int64_t r0 = 0; r0 < rows; r0 += R)
                    prefill_rows_amx(qs, os, r0, rows - r0 < R ? (int)(rows - r0) : R, ctx - q_len, group, kv_head,
                                     heads, head_dim, kt, vi, scale, base, window, softcap);
#endif
                continue;
            }
            for (int64_t r0 = 0; r0 < rows; r0 += R) {
                const int nr = rows - r0 < R ? (int)(rows - r0) : R;
                if (head_dim == 64)
                    prefill_rows_64(qs, os, r0, nr, ctx - q_len, group, kv_head, heads, kt, vi, scale, base,
                                     window, softcap);
                else if (head_dim == 128)
                    prefill_rows_128(qs, os, r0, nr, ctx - q_len, group, kv_head, heads, kt, vi, scale, base,
                                     window, softcap);
                else if (head_dim == 32)
                    prefill_rows_32(qs, os, r0, nr, ctx - q_len, group, kv_head, heads, kt, vi, scale, base,
                                     window, softcap);
                else
                    prefill_rows_256(qs, os, r0, nr, ctx - q_len, group, kv_head, heads, kt, vi, scale, base,
                                     window, softcap);
            }
        }
#if defined(PREFILL_AMX)
        if (amx) _tile_release();   /* as quant_gemm.c's AMX calls: the tile state back once done */
#endif
        free(work);
    }
    return failed ? -1 : 0;
#else
    (void)q; (void)k_cache; (void)v_cache; (void)dtype; (void)seqs; (void)num_seqs; (void)block_tables; (void)max_blocks;
    (void)heads; (void)kv_heads; (void)head_dim; (void)block_size; (void)scale; (void)window; (void)softcap;
    (void)out; (void)num_threads; (void)amx;
    return -2;
#endif
}

/* q, out: [tokens, heads, head_dim] bfloat16 (the flat batch; only prefill rows are written).
 * dtype: the cache's (DT_BFLOAT16, DT_INT8 or DT_FP8).
 * Per prefill sequence s: seqs[4 s .. 4 s + 3] = (first row in the batch, q_len, context_len,
 * unused); block_tables: [num_seqs, max_blocks] int64. window: sliding window in tokens
 * (0: none); softcap: logit soft cap (0: none).
 * Returns 0; -1 when scratch memory cannot be allocated; -2 for an unsupported shape. */
int pipeserve_paged_prefill(const uint16_t *q, const void *k_cache, const void *v_cache, int dtype,
                            const int64_t *seqs, int64_t num_seqs, const int64_t *block_tables,
                            int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            int64_t block_size, float scale, int64_t window, float softcap, uint16_t *out,
                            int num_threads) {
    return paged_prefill(q, k_cache, v_cache, dtype, seqs, num_seqs, block_tables, max_blocks, heads, kv_heads,
                         head_dim, block_size, scale, window, softcap, out, num_threads, 0);
}

static int prefill_amx_ready(void) {
#if defined(PREFILL_AMX)
    return amx_ready();
#else
    return 0;
#endif
}

/* "amx-bf16" where pipeserve_paged_prefill_amx runs here (an AMX-BF16 build and Linux's grant
 * of the tile state), else "none". */
const char *pipeserve_prefill_amx_isa(void) { return prefill_amx_ready() ? "amx-bf16" : "none"; }

/* pipeserve_paged_prefill on AMX tiles (prefill_rows_amx): same arguments and returns, and -2
 * where pipeserve_prefill_amx_isa() says "none". */
int pipeserve_paged_prefill_amx(const uint16_t *q, const void *k_cache, const void *v_cache, int dtype,
                                const int64_t *seqs, int64_t num_seqs, const int64_t *block_tables,
                                int64_t max_blocks, int64_t heads, int64_t kv_heads, int64_t head_dim,
                                int64_t block_size, float scale, int64_t window, float softcap, uint16_t *out,
                                int num_threads) {
    if (!prefill_amx_ready()) return -2;
    return paged_prefill(q, k_cache, v_cache, dtype, seqs, num_seqs, block_tables, max_blocks, heads, kv_heads,
                         head_dim, block_size, scale, window, softcap, out, num_threads, 1);
}
