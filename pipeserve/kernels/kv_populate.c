/* The KV cache's background population (worker/model_runner.py, populate_in_background) in one
 * call: chunks of every region in turn, each mapped writable with MADV_POPULATE_WRITE, at the
 * lowest priority (SCHED_IDLE, this thread only). In C so that the thread never holds Python's
 * GIL while it runs: the Python loop held it between its madvise calls, and a SCHED_IDLE thread
 * holding the GIL is starved by the stage's compute on the other core while the stage's reader
 * thread waits for that GIL (one request over two stages: 10 % of the hops 1.5-5 ms instead of
 * 0.25; benchmarks/README.md, thirtieth session). */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23   /* Linux 5.14+ */
#endif

/* The node's MemAvailable in bytes, or -1 where /proc/meminfo does not say. */
static int64_t available_bytes(void) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (!f) return -1;
    char line[256];
    long long kb = -1;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "MemAvailable:", 13) == 0) {
            if (sscanf(line + 13, "%lld", &kb) != 1) kb = -1;
            break;
        }
    fclose(f);
    return kb < 0 ? -1 : (int64_t)kb * 1024;
}

/* Regions [addr[i], addr[i] + size[i]), a chunk of each in turn from their starts. Before each
 * round of chunks it stops if *cancel is set (the caches were dropped) or the node has less than
 * reserve + n * chunk bytes available. Returns 0 when every region is populated, 1 stopped for
 * memory, 2 cancelled, or -errno of a failed madvise (EINVAL: the kernel has no
 * MADV_POPULATE_WRITE; ENOMEM: a region is no longer mapped). */
int pipeserve_populate(const uint64_t *addr, const int64_t *size, int n, int64_t chunk, int64_t reserve,
                       int64_t page, const volatile int *cancel) {
    struct sched_param param;
    memset(&param, 0, sizeof param);
    sched_setscheduler(0, SCHED_IDLE, &param);   /* best effort, this thread */
    int64_t longest = 0;
    for (int i = 0; i < n; i++)
        if (size[i] > longest) longest = size[i];
    for (int64_t offset = 0; offset < longest; offset += chunk) {
        if (*cancel) return 2;
        const int64_t available = available_bytes();
        if (available >= 0 && available < reserve + (int64_t)n * chunk) return 1;
        for (int i = 0; i < n; i++) {
            const uint64_t start = (addr[i] + (uint64_t)offset) / (uint64_t)page * (uint64_t)page;
            uint64_t stop = addr[i] + (uint64_t)offset + (uint64_t)chunk;
            if (stop > addr[i] + (uint64_t)size[i]) stop = addr[i] + (uint64_t)size[i];
            if (start >= stop) continue;
            if (madvise((void *)(uintptr_t)start, (size_t)(stop - start), MADV_POPULATE_WRITE) != 0) return -errno;
        }
    }
    return 0;
}
