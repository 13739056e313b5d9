/* GGUF IQ4_NL, IQ4_XS, Q3_K and Q2_K blocks -> byte-per-code q8 rows (model/quant/gguf_widen.py
 * says why and how), one pass over the file's bytes; or (`nibbles` / `compact` set) -> the
 * compact layouts the AVX2 and portable kernels take: IQ4's i4 (its nibbles as they are, a
 * float16 scale per 32), Q3_K's q3 and Q2_K's q2 (their code bytes and integer sub-scales as
 * they are, Q3_K's unpacked to a byte each; the float16 d, and -dmin, per 256). The numpy path
 * there takes 10-30 MB/s
 * of file bytes: a 70B Q3_K_M stage (10 GB of file) would spend minutes widening at start-up
 * and at every restart. Bit for bit the numpy path: the same codes, and scales d * sc (and
 * -dmin * m) multiplied in float32 and rounded to float16 to nearest even.
 *
 * Each function takes `blocks` blocks one after another (rows * blocks per row), shared over
 * `num_threads` threads, and writes per block its weights' int8 codes in order (IQ4 with
 * `nibbles` set: its 16 bytes of nibbles per 32 weights instead) and a float16 scale (and
 * minimum) per group: 32 weights for IQ4_NL / IQ4_XS, 16 for Q3_K / Q2_K.
 */
#include <stdint.h>
#include <string.h>

#include "half.h"
#include "quant_codes.h"

static uint16_t u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* Run r's 16 bytes of nibbles -> `codes`: as they are (nibbles set: i4's bytes are the file's),
 * or 32 codebook entries, low nibbles first, then high ones (quant_codes.h's quant_i4_run). */
static void iq4_run(const uint8_t *q, int nibbles, int64_t r, int8_t *codes) {
    if (nibbles) memcpy(codes + r * 16, q, 16);
    else quant_i4_run(q, codes + r * 32);
}

/* Block of 32 (18 bytes): d, 16 bytes of nibbles. */
void pipeserve_widen_iq4_nl(const uint8_t *in, int64_t blocks, int8_t *codes, uint16_t *scale, int nibbles,
                            int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *x = in + b * 18;
        scale[b] = u16(x);                    /* d itself: float16 already */
        iq4_run(x + 2, nibbles, b, codes);
    }
}

/* Block of 256 (136 bytes): d, scales_h (2 bits a run), scales_l (a nibble a run), 8 runs of
 * 16 bytes of nibbles; run j's scale d * (6-bit - 32). */
void pipeserve_widen_iq4_xs(const uint8_t *in, int64_t blocks, int8_t *codes, uint16_t *scale, int nibbles,
                            int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *x = in + b * 136;
        const float d = half_to_float(u16(x));
        const uint16_t high = u16(x + 2);
        for (int j = 0; j < 8; j++) {
            const int ls = ((x[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4);
            scale[b * 8 + j] = float_to_half(d * (float)(ls - 32));
            iq4_run(x + 8 + 16 * j, nibbles, b * 8 + j, codes);
        }
    }
}

/* Block of 256 (110 bytes): hmask 32, qs 64 (2-bit codes), 12 bytes of sixteen 6-bit scales,
 * d. Weight 128h + 32j + l: bits 2j of qs[32h + l], minus 4 where bit 4h + j of hmask[l] is
 * clear; group 8h + 2j + l / 16. `compact`: the q3 layout, qs into `codes` (64 bytes a block),
 * into `qh` (48 a block) the hmask as it is and the scales less 32 as int8, d into `scale` (one
 * a block); else int8 codes, 256 a block (quant_k2_run, zero 4), and d * (scale - 32) per 16. */
void pipeserve_widen_q3_k(const uint8_t *in, int64_t blocks, int8_t *codes, uint8_t *qh, uint16_t *scale,
                          int compact, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *x = in + b * 110, *hmask = x, *qs = x + 32, *sc = x + 96;
        const float d = half_to_float(u16(x + 108));
        int8_t sub[16];
        for (int s = 0; s < 16; s++) {
            const int low = s < 8 ? sc[s] & 15 : sc[s - 8] >> 4, high = (sc[8 + s % 4] >> (2 * (s / 4))) & 3;
            sub[s] = (int8_t)((low | (high << 4)) - 32);
        }
        if (compact) {
            memcpy(codes + b * 64, qs, 64);
            memcpy(qh + b * 48, hmask, 32);
            memcpy(qh + b * 48 + 32, sub, 16);
            scale[b] = u16(x + 108);
            continue;
        }
        for (int s = 0; s < 16; s++) scale[b * 16 + s] = float_to_half(d * (float)sub[s]);
        for (int r = 0; r < 8; r++) quant_k2_run(qs, hmask, 32, 4, r, codes + b * 256 + r * 32);
    }
}

/* Block of 256 (84 bytes): 16 bytes of scales (low nibble: scale, high: minimum, a group of
 * 16 each), qs 64 (2-bit codes as in Q3_K), d, dmin: weight = d * sc * code - dmin * m.
 * `compact`: the q2 layout, qs into `codes` (64 bytes a block) and the scale bytes into `qh`
 * (16) as they are, d into `scale` and -dmin (its sign bit flipped) into `minv`, one a block;
 * else int8 codes, d * sc and -dmin * m per 16. */
void pipeserve_widen_q2_k(const uint8_t *in, int64_t blocks, int8_t *codes, uint8_t *qh, uint16_t *scale,
                          uint16_t *minv, int compact, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *x = in + b * 84, *qs = x + 16;
        if (compact) {
            memcpy(codes + b * 64, qs, 64);
            memcpy(qh + b * 16, x, 16);
            scale[b] = u16(x + 80);
            minv[b] = (uint16_t)(u16(x + 82) ^ 0x8000);
            continue;
        }
        const float d = half_to_float(u16(x + 80)), dmin = half_to_float(u16(x + 82));
        for (int g = 0; g < 16; g++) {
            scale[b * 16 + g] = float_to_half(d * (float)(x[g] & 15));
            minv[b * 16 + g] = float_to_half(-dmin * (float)(x[g] >> 4));
        }
        for (int r = 0; r < 8; r++) quant_k2_run(qs, NULL, 0, 0, r, codes + b * 256 + r * 32);
    }
}
