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
 * integer gemv, paged_attention.c's decode phases, elementwise.c's float32 RMSNorm,
 * RoPE and SiLU·up), in the same order: float32 activations, weights kept
 * quantized, a float32 KV cache. Only the split of the attention over the threads
 * differs (the Python path runs a small step's attention on one thread): with one
 * thread the result is bit for bit the Python path's, with more it differs by the
 * order in which the partial softmaxes are merged.
 *
 * The layer: x, r = rmsnorm(h + r); qkv = x Wqkv^T (+ b); q, k = rope(q, k);
 * cache[slot] = k, v; a = attention(q); o = a Wo^T; x, r = rmsnorm(o + r);
 * gu = x Wgu^T; h = (silu(g) * u) Wdown^T. The stage returns h + r.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*rmsnorm_fn)(const float *h, const float *delta, float *x_out, const float *w, float *out,
                           int64_t rows, int64_t dim, float eps);
typedef void (*rope_fn)(const float *x, int64_t stride, float *out, int64_t n, int64_t heads, int64_t head_dim,
                        const float *cos, const float *sin);
typedef void (*silu_mul_fn)(const float *gate_up, float *out, int64_t rows, int64_t inter);
typedef int64_t (*act_bytes_fn)(int kind, int64_t K, int64_t group, int64_t M);
typedef void (*prepare_fn)(int kind, int64_t K, const float *x, int64_t M, void *act);
typedef void (*rows_fn)(int kind, const uint8_t *qs, const uint16_t *sc, const uint16_t *mn, int64_t N, int64_t K,
                        int64_t group, const uint8_t *qh, int zero, const void *act, int64_t M, int64_t n0,
                        int64_t n1, float *out);
typedef int64_t (*plan_bytes_fn)(int64_t batch, int64_t heads, int64_t head_dim, int num_threads);
typedef int64_t (*plan_fn)(void *plan, const int64_t *context_lens, int64_t batch, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t window, int num_threads);
typedef void (*items_fn)(const void *plan, const float *q, const void *k_cache, const void *v_cache, int dtype,
                         const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens, float scale,
                         float softcap, int bf16_math, int64_t i0, int64_t i1);
typedef void (*merge_fn)(const void *plan, int64_t bh0, int64_t bh1, float *out);

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
} stage_kernels;

/* A quantized weight [N, K] as quant_matmul.c takes it. */
typedef struct {
    const uint8_t *qs, *qh;
    const uint16_t *sc, *mn;
    int64_t N, K, group;
    int32_t kind, zero;
} qweight;

typedef struct {
    const float *input_norm, *post_norm;   /* RMSNorm weights [hidden] */
    qweight qkv, o, gate_up, down;
    const float *qkv_bias;                 /* [q + 2 kv] or NULL */
    char *k_cache, *v_cache;               /* [blocks, block_size, kv_heads, head_dim] float32 */
    int64_t window;                        /* sliding window (0: none) */
    float softcap;                         /* attention logit soft cap (0: none) */
    int32_t pad;
} stage_layer;

typedef struct {
    int64_t rows, hidden, heads, kv_heads, head_dim, inter;
    float eps, scale;
    const float *cos, *sin;                /* [rows, head_dim] each */
    const int64_t *slots;                  /* [rows] cache slot of each new token */
    const int64_t *block_tables;           /* [rows, max_blocks] */
    const int64_t *context_lens;           /* [rows] */
    int64_t max_blocks, block_size;
} stage_step;

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static int64_t align64(int64_t n) { return (n + 63) & ~(int64_t)63; }

/* Rows [n0, n1) of thread t of T: contiguous, equal ranges (as schedule(static)). */
static void thread_rows(const stage_kernels *k, const qweight *w, const void *act, int64_t M, float *out, int t,
                        int T) {
    k->rows(w->kind, w->qs, w->sc, w->mn, w->N, w->K, w->group, w->qh, w->zero, act, M, w->N * t / T,
            w->N * (t + 1) / T, out);
}

/* h [rows, hidden]: the stage's input, overwritten with its output. Returns 0, -1 when
 * scratch cannot be allocated, -2 when a layer's attention plan cannot be made. */
int pipeserve_decode_stage(const stage_kernels *k, const stage_layer *layers, int64_t num_layers,
                           const stage_step *s, float *h, int num_threads) {
    const int64_t M = s->rows, D = s->head_dim, qn = s->heads * D, kvn = s->kv_heads * D, qkv_n = qn + 2 * kvn;
    int64_t act = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const qweight *ws[4] = {&layers[l].qkv, &layers[l].o, &layers[l].gate_up, &layers[l].down};
        for (int i = 0; i < 4; i++) act = max64(act, k->act_bytes(ws[i]->kind, ws[i]->K, ws[i]->group, M));
    }
    /* float scratch: residual, normed x, qkv, rotated q|k, q alone, attention out, o out,
     * gate|up, silu out (each 64-byte aligned) */
    const int64_t sizes[9] = {M * s->hidden, M * s->hidden, M * qkv_n, M * (qn + kvn), M * qn, M * qn,
                              M * s->hidden, M * 2 * s->inter, M * s->inter};
    int64_t bytes = align64(act) + align64(k->plan_bytes(M, s->heads, D, num_threads));
    for (int i = 0; i < 9; i++) bytes += align64(sizes[i] * (int64_t)sizeof(float));
    char *buf = aligned_alloc(64, (size_t)bytes);
    if (!buf) return -1;
    float *f[9];
    char *p = buf;
    for (int i = 0; i < 9; i++) {
        f[i] = (float *)p;
        p += align64(sizes[i] * (int64_t)sizeof(float));
    }
    float *res = f[0], *x = f[1], *qkv = f[2], *qk = f[3], *q = f[4], *attn = f[5], *o = f[6], *gu = f[7],
          *act_in = f[8];
    void *actbuf = p, *plan = p + align64(act);
    const int64_t row_bytes = kvn * (int64_t)sizeof(float);
    int failed = 0;
    int64_t items = 0;
#pragma omp parallel num_threads(num_threads)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        for (int64_t l = 0; l < num_layers && !failed; l++) {
            const stage_layer *L = &layers[l];
#pragma omp single
            {   /* x, r = rmsnorm(h + r) (the first layer: r = h) */
                if (l == 0) k->rmsnorm(h, NULL, NULL, L->input_norm, x, M, s->hidden, s->eps);
                else k->rmsnorm(h, res, res, L->input_norm, x, M, s->hidden, s->eps);
                if (l == 0) memcpy(res, h, (size_t)(M * s->hidden) * sizeof(float));
                k->prepare(L->qkv.kind, L->qkv.K, x, M, actbuf);
            }
            thread_rows(k, &L->qkv, actbuf, M, qkv, t, T);
            if (L->qkv_bias) {
                const int64_t n0 = qkv_n * t / T, n1 = qkv_n * (t + 1) / T;
                for (int64_t m = 0; m < M; m++)
                    for (int64_t n = n0; n < n1; n++) qkv[m * qkv_n + n] += L->qkv_bias[n];
            }
#pragma omp barrier
#pragma omp single
            {   /* rotate q and k (adjacent in each row) in one call; cache k and v; plan */
                k->rope(qkv, qkv_n, qk, M, s->heads + s->kv_heads, D, s->cos, s->sin);
                for (int64_t m = 0; m < M; m++) {
                    memcpy(q + m * qn, qk + m * (qn + kvn), (size_t)qn * sizeof(float));
                    memcpy(L->k_cache + s->slots[m] * row_bytes, qk + m * (qn + kvn) + qn, (size_t)row_bytes);
                    memcpy(L->v_cache + s->slots[m] * row_bytes, qkv + m * qkv_n + qn + kvn, (size_t)row_bytes);
                }
                items = k->plan(plan, s->context_lens, M, s->heads, s->kv_heads, D, s->block_size, L->window, T);
                if (items < 0) failed = 1;
            }
            if (failed) break;
            k->items(plan, q, L->k_cache, L->v_cache, 0, s->block_tables, s->max_blocks, s->context_lens, s->scale,
                     L->softcap, 0, items * t / T, items * (t + 1) / T);
#pragma omp barrier
            k->merge(plan, M * s->heads * t / T, M * s->heads * (t + 1) / T, attn);
#pragma omp barrier
#pragma omp single
            k->prepare(L->o.kind, L->o.K, attn, M, actbuf);
            thread_rows(k, &L->o, actbuf, M, o, t, T);
#pragma omp barrier
#pragma omp single
            {   /* x, r = rmsnorm(o + r) */
                k->rmsnorm(o, res, res, L->post_norm, x, M, s->hidden, s->eps);
                k->prepare(L->gate_up.kind, L->gate_up.K, x, M, actbuf);
            }
            thread_rows(k, &L->gate_up, actbuf, M, gu, t, T);
#pragma omp barrier
#pragma omp single
            {
                k->silu_mul(gu, act_in, M, s->inter);
                k->prepare(L->down.kind, L->down.K, act_in, M, actbuf);
            }
            thread_rows(k, &L->down, actbuf, M, h, t, T);
#pragma omp barrier
        }
    }
    if (!failed)
        for (int64_t i = 0; i < M * s->hidden; i++) h[i] += res[i];
    free(buf);
    return failed ? -2 : 0;
}
