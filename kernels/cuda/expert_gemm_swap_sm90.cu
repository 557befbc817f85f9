/* SPDX-License-Identifier: Apache-2.0 */
/* Grouped expert GEMM variants for sm_90a (expert_gemm_sm90.cuh): bf16, swap-AB layout (weight rows
 * in wgmma M). */
#include "kernels/cuda/expert_gemm_sm90.cuh"

extern "C" {
moe_status_t moe_gemm_sm90_swap8_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<8, 4>(a, stream, "sm90_swapab_n8");
}
moe_status_t moe_gemm_sm90_swap16_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<16, 4>(a, stream, "sm90_swapab_n16");
}
moe_status_t moe_gemm_sm90_swap32_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<32, 2>(a, stream, "sm90_swapab_n32");
}
moe_status_t moe_gemm_sm90_swap64_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<64, 2>(a, stream, "sm90_swapab_n64");
}
moe_status_t moe_gemm_sm90_swap32w_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<32, 2, 2>(a, stream, "sm90_swapab_w128_n32");
}
}
