/* SPDX-License-Identifier: Apache-2.0 */
/* Grouped expert GEMM variants for sm_90a (expert_gemm_sm90.cuh): FP8 e4m3 with 128 x 128 block
 * scales. */
#include "kernels/cuda/expert_gemm_sm90.cuh"

extern "C" {
/* FP8 with 128 x 128 weight blocks and 1 x 128 activation groups (DeepSeek-V3): the scales
 * multiply each 128-wide k slice's partial as it is promoted. */
moe_status_t moe_gemm_sm90_fp8b_m128_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<128, 2>(a, stream, "sm90_fp8_block_m128n128");
}
moe_status_t moe_gemm_sm90_fp8b_m192_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<192, 2>(a, stream, "sm90_fp8_block_m192n128");
}
/* each warpgroup's epilogue under the first slice of its next item (LA; on trial:
 * kernels/expert_gemm_table.c) */
moe_status_t moe_gemm_sm90_fp8b_m128la_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<128, 2, 0, 0, 0, 1>(a, stream, "sm90_fp8_block_m128n128_la");
}
moe_status_t moe_gemm_sm90_fp8b_m192la_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<192, 2, 0, 0, 0, 1>(a, stream, "sm90_fp8_block_m192n128_la");
}
moe_status_t moe_gemm_sm90_fp8b_m64_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<64, 2>(a, stream, "sm90_fp8_block_m64n128");
}
/* Two consumer warpgroups on alternate 64-row items: one's per-slice promotions run while the
 * other's wgmmas do. */
moe_status_t moe_gemm_sm90_fp8b_m64pp_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<64, 2, 0, 1>(a, stream, "sm90_fp8_block_m64n128_pp");
}
moe_status_t moe_gemm_sm90_fp8b_swap16_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<16, 4, 1, 2>(a, stream, "sm90_fp8_block_swapab_n16");
}
moe_status_t moe_gemm_sm90_fp8b_swap32_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<32, 2, 1, 2>(a, stream, "sm90_fp8_block_swapab_n32");
}
moe_status_t moe_gemm_sm90_fp8b_swap16pp_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<16, 4, 1, 2, 1>(a, stream, "sm90_fp8_block_swapab_n16_pp");
}
moe_status_t moe_gemm_sm90_fp8b_swap32pp_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<32, 2, 1, 2, 1>(a, stream, "sm90_fp8_block_swapab_n32_pp");
}
/* Eight token columns (m64n8k32 wgmmas), ping-pong: half the token tile and epilogue of n16_pp
 * for steps of a few rows per expert, as the per-row tables' n8_pp */
moe_status_t moe_gemm_sm90_fp8b_swap8pp_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<8, 4, 1, 2, 1>(a, stream, "sm90_fp8_block_swapab_n8_pp");
}
}
