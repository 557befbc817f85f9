/* SPDX-License-Identifier: Apache-2.0 */
/* The activations of GEMM 1's epilogue, one definition for the grouped expert GEMMs
 * (expert_gemm_common.cuh) and the fused decode kernel (decode_sm90.cuh). kernels/cpu computes
 * the same functions in IEEE float; the GPU tests compare within 1e-2. */
#ifndef MOE_ACT_CUH
#define MOE_ACT_CUH

#include <cuda_runtime.h>

/* x / (1 + e^-x). e^-x as 2^(-x log2 e) through ex2.approx.ftz (one MUFU.EX2: __expf, without
 * ftz, adds a range test and two scalings an element), and the fast division (MUFU.RCP +
 * FMUL: the IEEE one compiled to a range check and a slow-path call an element, about half the
 * instructions of the fp8 m128n192 SiLU epilogue; bench/RESULTS.md, "SiLU and scale loads").
 * x > 87: e^-x flushes to 0, the result x; x < -88: e^-x is inf, the result -0 (the limit). */
__device__ __forceinline__ float moe_act_silu(float x)
{
    float t;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(t) : "f"(x * -1.4426950408889634f));
    return __fdividef(x, 1.0f + t);
}

/* gelu with the tanh approximation, as kernels/cpu computes it. */
__device__ __forceinline__ float moe_act_gelu_tanh(float x)
{
    const float k0 = 0.7978845608028654f; /* sqrt(2/pi) */
    return 0.5f * x * (1.0f + tanhf(k0 * (x + 0.044715f * x * x * x)));
}

#endif /* MOE_ACT_CUH */
