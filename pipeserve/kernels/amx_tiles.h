/* Intel AMX tile state, shared by the kernels that multiply on tiles (quant_gemm.c's
 * kept-quantized matmul, paged_attention.c's prompt attention). Include where
 * __AMX_TILE__ and __AMX_BF16__ are defined (-march=native on a CPU with AMX-BF16).
 *
 * amx_ready(): whether Linux grants this process the tile state (arch_prctl
 * ARCH_REQ_XCOMP_PERM for XTILEDATA), asked once per library (idempotent).
 * amx_tile_config(): this thread's tile configuration, the one every kernel here
 * uses: all 8 tiles 16 rows by 64 bytes (16 x 32 bfloat16 A tiles, 16 pairs of k by
 * 16 columns B tiles, 16 x 16 float32 C tiles). Tile state is per thread: call it in
 * each thread before its first tile instruction. */
#ifndef PIPESERVE_AMX_TILES_H
#define PIPESERVE_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_REQ_PERM 0x1023   /* arch_prctl ARCH_REQ_XCOMP_PERM */
#define AMX_XTILEDATA 18      /* XFEATURE_XTILEDATA */

static inline int amx_ready(void) {
    static int state = 0;
    if (state == 0) state = syscall(SYS_arch_prctl, AMX_REQ_PERM, AMX_XTILEDATA) == 0 ? 1 : -1;
    return state > 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) amx_config;

static inline void amx_tile_config(void) {
    amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

#endif
