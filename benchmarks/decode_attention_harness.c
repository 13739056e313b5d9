/* Decode attention in C alone: pipeserve_paged_decode of a build of paged_attention.c (a .so,
 * e.g. from ~/.cache/pipeserve/kernels, or a copy built with
 * `gcc -O3 -march=native -fopenmp -fPIC -shared -std=gnu11 -Ipipeserve/kernels X.c -o X.so -lm`)
 * over SmolLM2's shape (9 query heads, 3 KV heads of 64, blocks of 16; HEADS=, KV_HEADS=,
 * HEAD_DIM= set another) with the blocks in random order, then a plain read of the same bytes.
 * WS_MB (default 256) sets the KV working set: WS_MB=1 keeps it in L2 (the arithmetic alone)
 * where one call's KV fits (bfloat16: BATCH x CTX x 768 bytes, e.g. 2 x 512; at 64 x 512 it is
 * 25 MB whatever WS_MB says), 256 streams it from memory. SPLIT=n runs the fused stage's way
 * (a plan cut for n threads, every item on this one).
 * BS=n: blocks of n tokens (default 16). BF16_MATH=1: the paths a bfloat16 model takes (8-bit
 * caches: AVX512_BF16 products; 0, the default: a float32 model's). The caches are advised for
 * 2 MiB pages, as the engine's.
 *   gcc -O3 -march=native -fopenmp benchmarks/decode_attention_harness.c -o harness -ldl
 *   WS_MB=1 ./harness ./X.so BATCH CTX THREADS REPS [dtype: 0 float32, 1 bf16, 2 f16, 3 int8, 4 fp8]
 * It prints the thread CPU time's median per call (and GB/s, ns per key and KV head), the wall
 * time's median and best, and that as a share of the plain read. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <omp.h>
#include <linux/perf_event.h>
#include <sys/syscall.h>
#include <unistd.h>
static int pe_open(uint64_t config) {
    struct perf_event_attr a; memset(&a, 0, sizeof a); a.type = PERF_TYPE_HARDWARE; a.size = sizeof a; a.config = config;
    a.exclude_kernel = 1; a.exclude_hv = 1; a.inherit = 1;
    return (int)syscall(__NR_perf_event_open, &a, 0, -1, -1, 0);
}
static uint64_t pe_read(int fd) { uint64_t v = 0; if (fd >= 0 && read(fd, &v, sizeof v) != sizeof v) v = 0; return v; }
static double cpu_now(void) { struct timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

#include <immintrin.h>
typedef int (*decode_fn)(const float *, const void *, const void *, int, const int64_t *, int64_t, const int64_t *,
                         int64_t, int64_t, int64_t, int64_t, int64_t, float, int64_t, float, float *, int, int);
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static uint64_t rng = 88172645463325252ull;
static uint64_t xr(void) { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; return rng; }
int main(int argc, char **argv) {
    if (argc < 6) { fprintf(stderr, "so batch ctx threads reps [dtype elem]\n"); return 1; }
    void *lib = dlopen(argv[1], RTLD_NOW);
    decode_fn fn = (decode_fn)dlsym(lib, "pipeserve_paged_decode");
    typedef int64_t (*pb_fn)(int64_t, int64_t, int64_t, int);
    typedef int64_t (*pl_fn)(void *, const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int);
    typedef void (*it_fn)(const void *, const float *, const void *, const void *, int, const int64_t *, int64_t,
                          const int64_t *, float, float, int, int64_t, int64_t);
    typedef void (*mg_fn)(const void *, int64_t, int64_t, float *);
    pb_fn plan_bytes = (pb_fn)dlsym(lib, "pipeserve_decode_plan_bytes");
    pl_fn plan_fn = (pl_fn)dlsym(lib, "pipeserve_decode_plan");
    it_fn items_fn = (it_fn)dlsym(lib, "pipeserve_decode_items");
    mg_fn merge_fn = (mg_fn)dlsym(lib, "pipeserve_decode_merge");
    const int split = getenv("SPLIT") ? atoi(getenv("SPLIT")) : 0;
    const int bf16_math = getenv("BF16_MATH") ? atoi(getenv("BF16_MATH")) : 0;   /* a bfloat16 model's paths */
    int64_t batch = atoll(argv[2]), ctx = atoll(argv[3]); int threads = atoi(argv[4]), reps = atoi(argv[5]);
    int dtype = argc > 6 ? atoi(argv[6]) : 0; int64_t elem = dtype == 0 ? 4 : dtype <= 2 ? 2 : 1;
    const int64_t BS = getenv("BS") ? atoll(getenv("BS")) : 16;   /* BS=n: blocks of n tokens */
    const int64_t H = getenv("HEADS") ? atoll(getenv("HEADS")) : 9, KVH = getenv("KV_HEADS") ? atoll(getenv("KV_HEADS")) : 3,
                  D = getenv("HEAD_DIM") ? atoll(getenv("HEAD_DIM")) : 64;   /* another model's shape */
    int64_t rowb = D * elem + (dtype >= 3 ? 4 : 0);
    int64_t bps = (ctx + BS - 1) / BS, pool = batch * bps + 16, blockb = BS * KVH * rowb;
    int64_t kvbytes = 2 * batch * ctx * KVH * rowb;
    int64_t ws = getenv("WS_MB") ? atoll(getenv("WS_MB")) : 256; int64_t layers = (ws << 20) / kvbytes; if (layers < 1) layers = 1;
    size_t bytes = (size_t)(layers * pool * blockb);
    char *k = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *v = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    madvise(k, bytes, MADV_HUGEPAGE); madvise(v, bytes, MADV_HUGEPAGE);
    for (size_t i = 0; i < bytes; i++) { k[i] = (char)(xr() & 0x3f); v[i] = (char)(xr() & 0x3f); }
    if (dtype == 0) { float *kf = (float *)k, *vf = (float *)v; for (size_t i = 0; i < bytes / 4; i++) { kf[i] = (float)(xr() % 1000) / 500.0f - 1; vf[i] = (float)(xr() % 1000) / 500.0f - 1; } }
    int64_t *tables = malloc(sizeof(int64_t) * layers * batch * bps), *lens = malloc(sizeof(int64_t) * batch);
    int64_t *order = malloc(sizeof(int64_t) * pool);
    for (int64_t l = 0; l < layers; l++) {
        for (int64_t i = 0; i < pool; i++) order[i] = i;
        for (int64_t i = pool - 1; i > 0; i--) { int64_t j = xr() % (i + 1), t = order[i]; order[i] = order[j]; order[j] = t; }
        for (int64_t i = 0; i < batch * bps; i++) tables[l * batch * bps + i] = l * pool + order[i];
    }
    for (int64_t b = 0; b < batch; b++) lens[b] = ctx;
    float *q = malloc(sizeof(float) * batch * H * D), *out = malloc(sizeof(float) * batch * H * D);
    for (int64_t i = 0; i < batch * H * D; i++) q[i] = (float)(xr() % 1000) / 500.0f - 1;
    double *ts = malloc(sizeof(double) * reps), *cs = malloc(sizeof(double) * reps);
    int fc = pe_open(PERF_COUNT_HW_CPU_CYCLES), fi = pe_open(PERF_COUNT_HW_INSTRUCTIONS);
    uint64_t c0 = 0, i0 = 0;
    for (int r = -1; r < reps; r++) {
        if (r == 0) { c0 = pe_read(fc); i0 = pe_read(fi); }
        double t0 = now(), u0 = cpu_now();
        for (int64_t l = 0; l < layers; l++)
            if (split) {   /* the fused stage's way: a plan cut for `split` threads, all items on this one */
                static void *plan; if (!plan) plan = malloc(plan_bytes(batch, H, D, split));
                int64_t items = plan_fn(plan, lens, batch, H, KVH, D, BS, 0, split);
                items_fn(plan, q, k, v, dtype, tables + l * batch * bps, bps, lens, 0.125f, 0.0f, bf16_math, 0, items);
                merge_fn(plan, 0, batch * H, out);
            } else
            fn(q, k, v, dtype, tables + l * batch * bps, bps, lens, batch, H, KVH, D, BS, 0.125f, 0, 0.0f, out, threads, bf16_math);
        if (r >= 0) { ts[r] = (now() - t0) / layers; cs[r] = (cpu_now() - u0) / layers; }
    }
    double calls = (double)reps * layers, rowsk = (double)batch * ctx * KVH;
    double cyc = (pe_read(fc) - c0) / calls / rowsk, ins = (pe_read(fi) - i0) / calls / rowsk;
    for (int i = 0; i < reps; i++) for (int j = i + 1; j < reps; j++) if (cs[j] < cs[i]) { double t = cs[i]; cs[i] = cs[j]; cs[j] = t; }
    double cpumed = cs[reps / 2];
    /* median */
    for (int i = 0; i < reps; i++) for (int j = i + 1; j < reps; j++) if (ts[j] < ts[i]) { double t = ts[i]; ts[i] = ts[j]; ts[j] = t; }
    double med = ts[reps / 2], best = ts[0];
    /* plain read of the same working set */
    double rb = 1e9;
    for (int r = 0; r < 5; r++) {
        double t0 = now(); double s = 0;
#pragma omp parallel for num_threads(threads) reduction(+:s) schedule(static)
        for (size_t i = 0; i < bytes / 4; i += 32) { const float *f = (const float *)k + i;
            __m256 a = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)), _mm256_add_ps(_mm256_loadu_ps(f + 16), _mm256_loadu_ps(f + 24)));
            s += a[0]; }
        double t = now() - t0; if (t < rb) rb = t; if (s == 1.2345) puts("");
    }
    double readgbs = bytes / rb / 1e9;
    printf("cpu-time med %.1f us (%.2f GB/s, %.1f ns/row)  cycles/row %.1f  instr/row %.1f  | ", cpumed * 1e6 / threads, kvbytes / (cpumed / threads) / 1e9, cpumed / threads / rowsk * 1e9, cyc / threads, ins);
    printf("%lld x %lld thr %d: med %.1f us best %.1f us  %.2f GB/s (med) = %.0f%% of read %.1f GB/s; ns/key/kvh %.1f\n",
           (long long)batch, (long long)ctx, threads, med * 1e6, best * 1e6, kvbytes / med / 1e9,
           100 * kvbytes / med / 1e9 / readgbs, readgbs, med / (batch * ctx * KVH) * 1e9);
    return 0;
}
