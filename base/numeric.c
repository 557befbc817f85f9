/* SPDX-License-Identifier: Apache-2.0 */
/* Scalar f32 <-> bf16/f16/fp8-e4m3 conversions, bit-exact, round to nearest even. */
#include "base/numeric.h"

#include <math.h>
#include <string.h>

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float moe_bf16_to_f32(uint16_t v)
{
    return bits_f32((uint32_t)v << 16);
}

uint16_t moe_f32_to_bf16(float f)
{
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep sign, force quiet */
        return (uint16_t)((u >> 16) | 0x0040u);
    /* Round to nearest even on the 16 dropped bits; carries into the exponent are right
     * (overflow to Inf included). */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float moe_f16_to_f32(uint16_t v)
{
    uint32_t sign = (uint32_t)(v & 0x8000u) << 16;
    uint32_t exp = (v >> 10) & 0x1fu;
    uint32_t man = v & 0x3ffu;
    if (exp == 0x1f)
        return bits_f32(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        /* zero or subnormal: man * 2^-24 */
        float m = (float)man * 0x1p-24f;
        return sign ? -m : m;
    }
    return bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

/* Round |x| (finite, >= 0) to a float with `mbits` mantissa bits and minimum normal exponent
 * `emin` (subnormals below it), to nearest even. Returns the rounded value as float. */
static float round_to_format(float a, int mbits, int emin)
{
    int e;
    float q;
    if (a == 0.0f)
        return 0.0f;
    frexpf(a, &e); /* a = m * 2^e, m in [0.5, 1) */
    e -= 1;        /* a = 1.x * 2^e */
    if (e < emin)
        e = emin;
    q = ldexpf(1.0f, e - mbits); /* spacing of representable values at this exponent */
    /* rintf rounds to nearest even in the default rounding mode; a/q is exact here. */
    return rintf(a / q) * q;
}

uint16_t moe_f32_to_f16(float f)
{
    uint32_t u = f32_bits(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    float a = fabsf(f), r;
    int e;
    if (isnan(f))
        return (uint16_t)(sign | 0x7e00u);
    if (a >= 65520.0f) /* rounds past the largest finite (65504) */
        return (uint16_t)(sign | 0x7c00u);
    r = round_to_format(a, 10, -14);
    if (r == 0.0f)
        return sign;
    frexpf(r, &e);
    e -= 1;
    if (e < -14) /* subnormal */
        return (uint16_t)(sign | (uint16_t)(r * 0x1p24f));
    return (uint16_t)(sign | (uint16_t)((e + 15) << 10) |
                      (uint16_t)((uint32_t)(ldexpf(r, -e) * 1024.0f) & 0x3ffu));
}

float moe_fp8e4m3_to_f32(uint8_t v)
{
    const uint32_t sign = (uint32_t)(v & 0x80) << 24, exp = (v >> 3) & 0xfu, man = v & 0x7u;
    if ((v & 0x7f) == 0x7f) /* NaN: the quiet NaN with v's sign */
        return bits_f32(sign | 0x7fc00000u);
    if (exp == 0) { /* subnormal: man/8 * 2^-6, exact; -0 for 0x80 */
        const float r = (float)man * 0x1p-9f;
        return sign ? -r : r;
    }
    return bits_f32(sign | ((exp + 120u) << 23) | (man << 20)); /* (1 + man/8) * 2^(exp - 7) */
}

/* On the bits: the f32 significand rounded to 3 bits (nearest even) where |f| is an e4m3
 * normal, |f| * 2^9 rounded to an integer (rintf: nearest even) below 2^-6. Every f32 bit
 * pattern gave the code of the frexpf / ldexpf grid rounding it replaced (2026-12-05, all 2^32
 * compared once); test_numeric judges a sweep of patterns and every midpoint by the decoded
 * neighbours. */
uint8_t moe_f32_to_fp8e4m3(float f)
{
    const uint32_t u = f32_bits(f), a = u & 0x7fffffffu;
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if (a > 0x7f800000u) /* NaN */
        return (uint8_t)(sign | 0x7f);
    if (a >= 0x43e00000u) /* |f| >= 448, +-Inf: satfinite, +-448 */
        return (uint8_t)(sign | 0x7e);
    if (a < 0x3c800000u) /* below 2^-6: man * 2^-9, man 0 .. 8 (8: the smallest normal) */
        return (uint8_t)(sign | (uint8_t)rintf(bits_f32(a) * 512.0f));
    /* a carry out of the significand moves the exponent up; below 448 it cannot pass 448 */
    const uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) & 0xfff00000u;
    return (uint8_t)(sign | (((r >> 23) - 120u) << 3) | ((r >> 20) & 0x7u));
}

uint8_t moe_fp8e4m3_quantize(float v, float scale)
{
    return moe_f32_to_fp8e4m3(v / scale);
}

float moe_fp8_dynamic_scale(float amax)
{
    /* `amax > MIN` is false for NaN too: a NaN amax (never produced by the callers, which skip
     * NaN) gives the floor instead of a NaN scale. */
    return (amax > MOE_FP8_ACT_AMAX_MIN ? amax : MOE_FP8_ACT_AMAX_MIN) / MOE_FP8_E4M3_MAX;
}

float moe_fp8_pair_static_scale(float gate, float up)
{
    if (!(gate > 0.0f) || !(up > 0.0f)) /* NaN is no scale either */
        return 0.0f;
    return gate > up ? gate : up;
}

void moe_convert_to_f32(moe_dtype_t dtype, const void *src, float *dst, size_t n)
{
    size_t i;
    if (n == 0) /* src and dst may be NULL then (a step with no tokens) */
        return;
    switch (dtype) {
    case MOE_DTYPE_F32:
        memcpy(dst, src, n * sizeof(float));
        break;
    case MOE_DTYPE_BF16:
        for (i = 0; i < n; i++)
            dst[i] = moe_bf16_to_f32(((const uint16_t *)src)[i]);
        break;
    case MOE_DTYPE_F16:
        for (i = 0; i < n; i++)
            dst[i] = moe_f16_to_f32(((const uint16_t *)src)[i]);
        break;
    case MOE_DTYPE_FP8_E4M3:
        for (i = 0; i < n; i++)
            dst[i] = moe_fp8e4m3_to_f32(((const uint8_t *)src)[i]);
        break;
    default:
        break;
    }
}

/* The bf16 that keeps the top 16 bits of f (truncation toward zero). */
static uint16_t bf16_trunc(float f, float *kept)
{
    uint32_t u = f32_bits(f) & 0xffff0000u;
    memcpy(kept, &u, sizeof(u));
    return (uint16_t)(u >> 16);
}

void moe_split_bf16x3(const float *w, uint16_t *hi, uint16_t *mid, uint16_t *lo, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++) {
        float h, m, l;
        hi[i] = bf16_trunc(w[i], &h);
        if (!isfinite(w[i])) {
            mid[i] = lo[i] = 0;
            continue;
        }
        mid[i] = bf16_trunc(w[i] - h, &m);
        lo[i] = bf16_trunc((w[i] - h) - m, &l);
    }
}

void moe_convert_from_f32(moe_dtype_t dtype, const float *src, void *dst, size_t n)
{
    size_t i;
    if (n == 0) /* src and dst may be NULL then (a step with no tokens) */
        return;
    switch (dtype) {
    case MOE_DTYPE_F32:
        memcpy(dst, src, n * sizeof(float));
        break;
    case MOE_DTYPE_BF16:
        for (i = 0; i < n; i++)
            ((uint16_t *)dst)[i] = moe_f32_to_bf16(src[i]);
        break;
    case MOE_DTYPE_F16:
        for (i = 0; i < n; i++)
            ((uint16_t *)dst)[i] = moe_f32_to_f16(src[i]);
        break;
    case MOE_DTYPE_FP8_E4M3:
        for (i = 0; i < n; i++)
            ((uint8_t *)dst)[i] = moe_f32_to_fp8e4m3(src[i]);
        break;
    default:
        break;
    }
}
