/* float16 <-> float32 in portable C (no F16C): the GGUF repack kernels' scales, rounded as
 * numpy's astype(np.float16) rounds, so the C and numpy paths agree bit for bit. */
#ifndef PIPESERVE_HALF_H
#define PIPESERVE_HALF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, mant = h & 1023;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {   /* subnormal: normalise */
            int e = -1;
            uint32_t m = mant;
            do {
                e++;
                m <<= 1;
            } while (!(m & 1024));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((m & 1023) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* float32 -> float16, round to nearest even; overflow to infinity, NaN stays NaN. */
static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return sign | (ax > 0x7f800000u ? 0x7e00 : 0x7c00);
    if (ax >= 0x477ff000u) return sign | 0x7c00;   /* rounds to 65520 or more: infinity */
    if (ax < 0x38800000u) {                          /* below 2^-14: a subnormal half (or 0), mant * 2^-24 */
        float a;
        memcpy(&a, &ax, 4);
        return sign | (uint16_t)nearbyintf(a * 16777216.0f);   /* exact scaling, then to nearest even */
    }
    const uint32_t m = ax - 0x38000000u;             /* exponent bias 127 -> 15 */
    uint32_t v = m >> 13;
    const uint32_t r = m & 0x1fff;
    if (r > 0x1000 || (r == 0x1000 && (v & 1))) v++;   /* a carry into the exponent is right */
    return sign | (uint16_t)v;
}

#endif
