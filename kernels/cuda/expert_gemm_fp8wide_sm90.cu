/* SPDX-License-Identifier: Apache-2.0 */
/* Grouped expert GEMM variants for sm_90a (expert_gemm_sm90.cuh): FP8 e4m3 with per-row scales
 * (promoted every F8_PI slices) or 128 x 128 block scales (promoted every slice), on n192 tiles
 * (96 gate + 96 up weight rows, or 192 of STORE's):
 * one m64n192k32 wgmma per 32 of k, the accumulators and the partial sums 96 registers each
 * (docs/KERNELS.md, "Wider promoted tiles"). Not in a built-in table until measured: moe-tune
 * and MOE_FORCE_VARIANT. */
#include "kernels/cuda/expert_gemm_sm90.cuh"

extern "C" {
/* two consumer warpgroups on one 128-row item (cooperative) */
moe_status_t moe_gemm_sm90_fp8i_m128w_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<128, 4, 96>(a, stream, "sm90_fp8_m128n192_p4");
}
/* the same, each warpgroup's epilogue run while the tensor cores compute the first stage of
 * its next item (LA: docs/KERNELS.md, "Epilogue under the next item's first stage"); on trial
 * (kernels/expert_gemm_table.c) until tested and measured on a GPU */
moe_status_t moe_gemm_sm90_fp8i_m128wla_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<128, 4, 96, 0, 0, 1>(a, stream, "sm90_fp8_m128n192_p4_la");
}
/* two consumer warpgroups on alternate 64-row items (ping-pong) */
moe_status_t moe_gemm_sm90_fp8i_m64wpp_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<64, 4, 96, 1>(a, stream, "sm90_fp8_m64n192_pp_p4");
}
/* 128 x 128 block scales, promoted every slice: a 96-row half may cross a scale block (two
 * scales a slice, chosen per 8-column group) */
moe_status_t moe_gemm_sm90_fp8b_m128w_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<128, 2, 96>(a, stream, "sm90_fp8_block_m128n192");
}
moe_status_t moe_gemm_sm90_fp8b_m64wpp_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<64, 2, 96, 1>(a, stream, "sm90_fp8_block_m64n192_pp");
}
}
