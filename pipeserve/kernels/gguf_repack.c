/* GGUF K-quant blocks -> the kept layouts (model/quant/gguf_repack.py says what each is), one
 * pass over the file's bytes. The numpy path there does the same in a dozen passes over
 * strided views and byte-per-code temporaries, ~110 MB/s of file bytes; a 70B Q4_K_M stage
 * (13 GB) spent minutes in it at start-up and at every restart. Bit for bit the numpy path:
 * the same codes, and the file's two-level scales as they are (d, -dmin and the integer
 * sub-scales, unpacked to a byte each).
 *
 * Each function takes `blocks` blocks of one row after another (rows * blocks_per_row), shared
 * over `num_threads` threads (the stage's), and writes, per block of 256 weights: qs 128 bytes (q4 nibbles: byte j of a run of 32 holds
 * weights j and j + 16; q6: Q6_K's ql as it is), qh (q4: the 16 sub-scale bytes; q5: the 16
 * sub-scale bytes before the row's high bits, 4 bytes a run; q6: the 16 sub-scales before the row's
 * high bits, Q6_K's 64 as they are), and the scales (and minimums): each block's d (and -dmin).
 */
#include <stdint.h>
#include <string.h>

static uint16_t read_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* Q4_K / Q5_K: sub-block j's 6-bit scale and minimum (llama.cpp's get_scale_min_k4). */
static void scale_min(const uint8_t *q, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Q4_K / Q5_K block b's two-level scales as q4k / q5k hold them: d as it is, -dmin (the sign bit
 * flipped: exact), and the eight sub-scales, then the eight sub-minimums, a byte each (16 bytes). */
static void k_two_level(const uint8_t *b, uint16_t *scale, uint16_t *minv, uint8_t *sub) {
    *scale = read_u16(b);
    *minv = (uint16_t)(read_u16(b + 2) ^ 0x8000u);
    for (int j = 0; j < 8; j++) {
        int sc, m;
        scale_min(b + 4, j, &sc, &m);
        sub[j] = (uint8_t)sc;
        sub[8 + j] = (uint8_t)m;
    }
}

/* Run r's 16 nibble bytes from its 32 codes (0..15). */
static void nibbles(const uint8_t *codes, uint8_t *out) {
    for (int j = 0; j < 16; j++) out[j] = (uint8_t)(codes[j] | (codes[j + 16] << 4));
}

/* Q4_K keeps its two-level scales (quant_codes.h's q4k; k_two_level: 16 bytes a block in qh). */
void pipeserve_repack_q4_k(const uint8_t *in, int64_t blocks, uint8_t *qs, uint16_t *scale, uint16_t *minv,
                           uint8_t *qh, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *b = in + i * 144, *q = b + 16;
        uint8_t *o = qs + i * 128;
        for (int c = 0; c < 4; c++) {   /* chunk c: run 2c in the low nibbles, 2c + 1 in the high */
            const uint8_t *lo = q + 32 * c, *hi = lo + 16;
            for (int j = 0; j < 16; j++) {
                o[32 * c + j] = (uint8_t)((lo[j] & 15) | ((hi[j] & 15) << 4));
                o[32 * c + 16 + j] = (uint8_t)((lo[j] >> 4) | (hi[j] & 0xF0));
            }
        }
        k_two_level(b, scale + i, minv + i, qh + i * 16);
    }
}

/* Q5_K keeps its two-level scales (quant_codes.h's q5k): a row's qh is its blocks' 16 bytes of
 * sub-scales each (k_two_level), then their high-bit planes (32 bytes each); `per_row` blocks a row. */
void pipeserve_repack_q5_k(const uint8_t *in, int64_t blocks, uint8_t *qs, uint8_t *qh, uint16_t *scale,
                           uint16_t *minv, int64_t per_row, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < blocks; i++) {
        uint8_t codes[32];
        const uint8_t *b = in + i * 176, *h = b + 16, *q = b + 48;
        const int64_t row = i / per_row, j = i % per_row;
        uint8_t *rh = qh + row * per_row * 48;
        for (int r = 0; r < 8; r++) {   /* run r: chunk r / 2's nibbles r % 2, bit r of qh */
            const uint8_t *chunk = q + 32 * (r / 2);
            uint32_t plane = 0;
            for (int w = 0; w < 32; w++) {
                codes[w] = (uint8_t)((chunk[w] >> (4 * (r % 2))) & 15);
                plane |= (uint32_t)((h[w] >> r) & 1) << w;
            }
            nibbles(codes, qs + i * 128 + 16 * r);
            memcpy(rh + per_row * 16 + j * 32 + 4 * r, &plane, 4);   /* little-endian: bit w is weight w */
        }
        k_two_level(b, scale + i, minv + i, rh + j * 16);
    }
}

/* Q6_K keeps its two-level scales (quant_codes.h's q6k): d as it is, and a row's qh is its blocks'
 * sixteen int8 sub-scales each, then their high bits (64 bytes each); `per_row` blocks a row. */
void pipeserve_repack_q6_k(const uint8_t *in, int64_t blocks, uint8_t *qs, uint8_t *qh, uint16_t *scale,
                           int64_t per_row, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *b = in + i * 210;
        const int64_t row = i / per_row, j = i % per_row;
        uint8_t *h = qh + row * per_row * 80;
        memcpy(qs + i * 128, b, 128);        /* the q6 layout is Q6_K's ql and qh */
        memcpy(h + j * 16, b + 192, 16);
        memcpy(h + per_row * 16 + j * 64, b + 128, 64);
        scale[i] = read_u16(b + 208);
    }
}
