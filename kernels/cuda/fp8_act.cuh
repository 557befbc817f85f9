/* SPDX-License-Identifier: Apache-2.0 */
/* The W8A8 activation arithmetic of the CUDA kernels that quantise rows to e4m3 (quant.cu, and
 * the swap-AB GEMM 1 tiles that quantise h themselves): the scale of a dynamic row or 1 x 128
 * group, and 8 values to e4m3 -- the CPU reference's arithmetic (kernels/quant.h). */
#ifndef MOE_FP8_ACT_CUH
#define MOE_FP8_ACT_CUH

#include <cuda_fp8.h>
#include <stdint.h>

#include "base/numeric.h"

/* As moe_fp8_dynamic_scale: amax floored at MOE_FP8_ACT_AMAX_MIN, over 448. */
__device__ __forceinline__ float moe_fp8_act_scale(float amax)
{
    return __fdiv_rn(amax > MOE_FP8_ACT_AMAX_MIN ? amax : MOE_FP8_ACT_AMAX_MIN, MOE_FP8_E4M3_MAX);
}

/* q[0..8) = e4m3(v[i] / s), rounded to nearest even and saturated (NaN stays NaN): 8 bytes. */
__device__ __forceinline__ void moe_store_e4m3x8(uint8_t *q, const float *v, float s)
{
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const uint32_t b = __nv_cvt_float_to_fp8(__fdiv_rn(v[i], s), __NV_SATFINITE, __NV_E4M3);
        if (i < 4)
            lo |= b << (8 * i);
        else
            hi |= b << (8 * (i - 4));
    }
    *reinterpret_cast<uint2 *>(q) = make_uint2(lo, hi);
}

#endif /* MOE_FP8_ACT_CUH */
