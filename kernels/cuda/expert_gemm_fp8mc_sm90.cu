/* SPDX-License-Identifier: Apache-2.0 */
/* Grouped expert GEMM variants for sm_90a (expert_gemm_sm90.cuh): the FP8 cooperative tiles as
 * 2-CTA clusters on adjacent weight tiles of one row block, the token tile multicast (each CTA
 * loads half of it: docs/KERNELS.md, "Token-tile multicast"). */
#include "kernels/cuda/expert_gemm_sm90.cuh"

extern "C" {
/* per-row scales, promoted every F8_PI slices (the _p4 tiles) */
moe_status_t moe_gemm_sm90_fp8i_m128mc_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<128, 4, 0, 0, 1>(a, stream, "sm90_fp8_m128n128_p4_mc");
}
moe_status_t moe_gemm_sm90_fp8i_m192mc_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<192, 4, 0, 0, 1>(a, stream, "sm90_fp8_m192n128_p4_mc");
}
/* 128 x 128 block scales */
moe_status_t moe_gemm_sm90_fp8b_m128mc_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<128, 2, 0, 0, 1>(a, stream, "sm90_fp8_block_m128n128_mc");
}
moe_status_t moe_gemm_sm90_fp8b_m192mc_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<192, 2, 0, 0, 1>(a, stream, "sm90_fp8_block_m192n128_mc");
}
}
