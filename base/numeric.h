/* SPDX-License-Identifier: Apache-2.0 */
/* Scalar conversions between f32 and bf16, f16, fp8 e4m3 (OCP E4M3FN), host and reference. */
#ifndef MOE_NUMERIC_H
#define MOE_NUMERIC_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include "moe/moe.h"

#ifdef __CUDACC__
#define MOE_HOST_DEVICE __host__ __device__
#else
#define MOE_HOST_DEVICE
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Largest finite e4m3 value. */
#define MOE_FP8_E4M3_MAX 448.0f

float moe_bf16_to_f32(uint16_t v);
/* Round to nearest even; NaN stays NaN (quiet), Inf stays Inf. */
uint16_t moe_f32_to_bf16(float f);
float moe_f16_to_f32(uint16_t v);
uint16_t moe_f32_to_f16(float f);
float moe_fp8e4m3_to_f32(uint8_t v);
/* Round to nearest even with saturation (satfinite): |x| > 448 and +-Inf -> +-448;
 * NaN -> 0x7f (sign kept: 0xff). Matches CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE,
 * __NV_E4M3). */
uint8_t moe_f32_to_fp8e4m3(float f);

/* FP8 quantisation of one value with scale `scale` (real = q * scale): e4m3(v / scale) by
 * moe_f32_to_fp8e4m3 (nearest even, saturating to +-448, NaN stays NaN). */
uint8_t moe_fp8e4m3_quantize(float v, float scale);

/* Dynamic activation scales (FP8 W8A8) never come from an absolute maximum below this: a group
 * of zeros (or of tiny values) gets a small normal scale and quantises to exact zeros. */
#define MOE_FP8_ACT_AMAX_MIN 1e-10f

/* The dynamic scale of a group whose largest |value| is `amax`: max(amax, 1e-10) / 448. */
float moe_fp8_dynamic_scale(float amax);

/* moe_fp8_dynamic_scale for an amax that is a bf16 value (|h| as GEMM 1 stores it), without a
 * division: the quotient by 1/448 rounded, then one FMA step on its exact remainder (as
 * moe_fp8_quotient). Equal to it for every bf16 value, infinity included (tests/unit/
 * test_numeric.c checks all of them); on a GPU no slow-path call (a division has one), for the
 * fused decode kernel's per-group scales inside its k loop. */
static inline MOE_HOST_DEVICE float moe_fp8_dynamic_scale_bf16(float amax)
{
    const float a = amax > MOE_FP8_ACT_AMAX_MIN ? amax : MOE_FP8_ACT_AMAX_MIN;
    const float r = 1.0f / MOE_FP8_E4M3_MAX, q = a * r;
    return isinf(a) ? a : fmaf(fmaf(-q, MOE_FP8_E4M3_MAX, a), r, q);
}

/* v / scale for an e4m3 quantisation, from recip = 1 / scale rounded to nearest: the quotient
 * rounded by recip, then one FMA step on its exact remainder (Markstein's correction: the
 * correctly rounded quotient wherever it is a normal f32), the sign of v kept for zeros. Three
 * instructions on a GPU, where a division is a reciprocal, a refinement and a slow-path branch.
 * Its e4m3 code equals moe_fp8e4m3_quantize(v, scale)'s for every bf16 v with |v| <= 448 * scale,
 * scale >= 1e-10 / 448: tests/unit/test_numeric.c checks a grid of scales, and a run over every
 * pair of bf16 values (1.07e9) found no difference. */
static inline MOE_HOST_DEVICE float moe_fp8_quotient(float v, float scale, float recip)
{
    const float q = v * recip;
    return copysignf(fmaf(fmaf(-q, scale, v), recip, q), v);
}

/* The static activation scale of one quantisation that feeds two products (gate_proj and
 * up_proj, as a fused gate_up kernel reads them) from their input_scale values: the larger when
 * both are > 0, else 0 (dynamic per row). The CPU reference and the CUDA backend both use it. */
float moe_fp8_pair_static_scale(float gate, float up);

/* Splits f32 values into three bf16 planes with w = hi + mid + lo exactly (each step
 * truncates, so every remainder is exact; bf16 keeps f32's exponent range, so three 8-bit
 * significands hold f32's 24, down to |w| ~ 2^-110 where lo's bits would be subnormal). Products
 * of a bf16 value with each plane are exact in f32, which lets bf16 tensor cores compute an
 * f32-weight product to f32 accuracy (the router logits). Inf/NaN go to hi; mid = lo = 0. */
void moe_split_bf16x3(const float *w, uint16_t *hi, uint16_t *mid, uint16_t *lo, size_t n);

/* Bulk conversions; MOE_DTYPE_F32 is a copy. */
void moe_convert_to_f32(moe_dtype_t dtype, const void *src, float *dst, size_t n);
void moe_convert_from_f32(moe_dtype_t dtype, const float *src, void *dst, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* MOE_NUMERIC_H */
