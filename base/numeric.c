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
    int sign = v & 0x80;
    int exp = (v >> 3) & 0xf;
    int man = v & 0x7;
    float r;
    if ((v & 0x7f) == 0x7f)
        return sign ? -NAN : NAN;
    if (exp == 0)
        r = ldexpf((float)man, -9); /* subnormal: man/8 * 2^-6 */
    else
        r = ldexpf(1.0f + (float)man / 8.0f, exp - 7);
    return sign ? -r : r;
}

uint8_t moe_f32_to_fp8e4m3(float f)
{
    uint8_t sign = (uint8_t)((f32_bits(f) >> 24) & 0x80u);
    float a = fabsf(f), r;
    int e;
    if (isnan(f))
        return (uint8_t)(sign | 0x7f);
    if (a >= MOE_FP8_E4M3_MAX) /* satfinite: +-Inf and overflow clamp to +-448 */
        return (uint8_t)(sign | 0x7e);
    r = round_to_format(a, 3, -6);
    if (r >= MOE_FP8_E4M3_MAX) /* 464 would round up: clamp */
        return (uint8_t)(sign | 0x7e);
    if (r == 0.0f)
        return sign;
    frexpf(r, &e);
    e -= 1;
    if (e < -6) /* subnormal: r = man * 2^-9 */
        return (uint8_t)(sign | (uint8_t)(r * 512.0f));
    return (uint8_t)(sign | (uint8_t)((e + 7) << 3) |
                     (uint8_t)((uint32_t)(ldexpf(r, -e) * 8.0f) & 0x7u));
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
