/* The decode attention's read patterns alone (no arithmetic): how fast one core reads a batch's
 * K cache, SmolLM2's shape (3 KV heads of 64 bfloat16, blocks of 16 tokens, 64 sequences x 512
 * keys, each sequence's blocks at random places in a pool eight times larger; a fresh table each
 * round so the bytes come from memory). Issue 12 asks for decode attention near the memory's
 * bandwidth; this says what each way of walking the cache allows before any arithmetic:
 *   mode 0: each block's K (all kv heads, 6 KiB) read in one contiguous pass (no prefetch)
 *   mode 3: the same, the block PF blocks ahead prefetched (_MM_HINT_T1)
 *   mode 1: today's kernel's walk (paged_attention.c, per kv head): a pass per kv head over the
 *           sequence, 128 bytes of every 384-byte token row, PF keys ahead prefetched
 *   mode 2: a head-major block ([block][kv head][16 tokens][64]): a pass per kv head, 2 KiB
 *           contiguous a block, PF blocks ahead prefetched
 *   gcc -O2 -march=native benchmarks/kv_read_patterns.c -o kv_read_patterns
 *   ./kv_read_patterns MODE PF     (e.g. 1 32, 2 2, 3 1; best of 15 rounds, GB/s of K read) */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define KVH 3
#define HB 128   /* bytes of one kv head's row: 64 bfloat16 */
#define BS 16
#define SEQS 64
#define CTX 512
#define ROUNDS 16

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static uint64_t rng = 88172645463325252ull;
static uint64_t xr(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static __m512 walk(const char *k, const int64_t *table, int mode, int pf, __m512 acc) {
    const int64_t bps = CTX / BS, block_bytes = BS * KVH * HB, head_block = BS * HB;
    for (int64_t s = 0; s < SEQS; s++) {
        const int64_t *tb = table + s * bps;
        if (mode == 0 || mode == 3) {
            for (int64_t b = 0; b < bps; b++) {
                if (mode == 3 && b + pf < bps)
                    for (int64_t l = 0; l < block_bytes; l += 64) _mm_prefetch(k + tb[b + pf] * block_bytes + l, _MM_HINT_T1);
                for (int64_t l = 0; l < block_bytes; l += 64)
                    acc = _mm512_add_ps(acc, _mm512_loadu_ps(k + tb[b] * block_bytes + l));
            }
        } else if (mode == 2) {
            for (int h = 0; h < KVH; h++)
                for (int64_t b = 0; b < bps; b++) {
                    if (pf && b + pf < bps)
                        for (int64_t l = 0; l < head_block; l += 64)
                            _mm_prefetch(k + tb[b + pf] * block_bytes + h * head_block + l, _MM_HINT_T1);
                    for (int64_t l = 0; l < head_block; l += 64)
                        acc = _mm512_add_ps(acc, _mm512_loadu_ps(k + tb[b] * block_bytes + h * head_block + l));
                }
        } else {
            for (int h = 0; h < KVH; h++)
                for (int64_t t = 0; t < CTX; t++) {
                    if (pf && t + pf < CTX) {
                        const char *q = k + tb[(t + pf) / BS] * block_bytes + ((t + pf) % BS) * KVH * HB + h * HB;
                        _mm_prefetch(q, _MM_HINT_T1);
                        _mm_prefetch(q + 64, _MM_HINT_T1);
                    }
                    const char *p = k + tb[t / BS] * block_bytes + (t % BS) * KVH * HB + h * HB;
                    acc = _mm512_add_ps(acc, _mm512_loadu_ps(p));
                    acc = _mm512_add_ps(acc, _mm512_loadu_ps(p + 64));
                }
        }
    }
    return acc;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODE [PF]\n", argv[0]);
        return 1;
    }
    const int mode = atoi(argv[1]), pf = argc > 2 ? atoi(argv[2]) : 0;
    const int64_t bps = CTX / BS, pool = SEQS * bps * 8, block_bytes = BS * KVH * HB;
    const size_t bytes = (size_t)(pool * block_bytes);
    char *k = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (k == MAP_FAILED) return 1;
    madvise(k, bytes, MADV_HUGEPAGE);   /* as the engine's KV cache (model_runner.py) */
    memset(k, 1, bytes);
    int64_t *tables = malloc(sizeof(int64_t) * ROUNDS * SEQS * bps);
    for (int64_t i = 0; i < ROUNDS * SEQS * bps; i++) tables[i] = (int64_t)(xr() % (uint64_t)pool);
    double best = 1e9;
    __m512 acc = _mm512_setzero_ps();
    for (int r = 0; r < ROUNDS; r++) {
        const double t0 = now();
        acc = walk(k, tables + r * SEQS * bps, mode, pf, acc);
        const double dt = now() - t0;
        if (r > 0 && dt < best) best = dt;   /* round 0 warms the TLB and the code */
    }
    volatile float sink = _mm512_reduce_add_ps(acc);
    (void)sink;
    const double gb = (double)SEQS * CTX * KVH * HB / 1e9;
    printf("mode %d pf %d: %.1f us  %.1f GB/s\n", mode, pf, best * 1e6, gb / best);
    return 0;
}
