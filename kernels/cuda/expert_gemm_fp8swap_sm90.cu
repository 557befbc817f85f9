/* SPDX-License-Identifier: Apache-2.0 */
/* Grouped expert GEMM variants for sm_90a (expert_gemm_sm90.cuh): FP8 e4m3 with per-row scales,
 * swap-AB layout. */
#include "kernels/cuda/expert_gemm_sm90.cuh"

extern "C" {
moe_status_t moe_gemm_sm90_fp8_swap16_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<16, 4, 1, 1>(a, stream, "sm90_fp8_swapab_n16");
}
moe_status_t moe_gemm_sm90_fp8_swap32_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<32, 2, 1, 1>(a, stream, "sm90_fp8_swapab_n32");
}
/* Swap-AB FP8 with two consumer warpgroups on alternate items (ping-pong): one's epilogue and
 * promotion waits run while the other's wgmmas do */
moe_status_t moe_gemm_sm90_fp8_swap16pp_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<16, 4, 1, 1, 1>(a, stream, "sm90_fp8_swapab_n16_pp");
}
moe_status_t moe_gemm_sm90_fp8_swap32pp_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<32, 2, 1, 1, 1>(a, stream, "sm90_fp8_swapab_n32_pp");
}
/* Eight token columns (m64n8k32 wgmmas): half the epilogue and token tile of n16 for steps of at
 * most a few rows per expert (the per-row tables' first bucket, to 11.3 rows: runtime/oracle.c) */
moe_status_t moe_gemm_sm90_fp8_swap8pp_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<8, 4, 1, 1, 1>(a, stream, "sm90_fp8_swapab_n8_pp");
}
/* The same, promoted once a stage (every F8_PI = 4 slices of 128 k: n16's stage, two of n32's)
 * instead of after every slice; not in a built-in table until measured */
moe_status_t moe_gemm_sm90_fp8_swap16ppi_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<16, 4, 1, 4, 1>(a, stream, "sm90_fp8_swapab_n16_pp_p4");
}
moe_status_t moe_gemm_sm90_fp8_swap32ppi_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<32, 2, 1, 4, 1>(a, stream, "sm90_fp8_swapab_n32_pp_p4");
}
/* 128 weight rows an item (two m64 wgmmas), ping-pong: half the items of n16_pp for steps with
 * many short items (Qwen3's GEMM 2); two 128-k slices a stage */
moe_status_t moe_gemm_sm90_fp8_swap16wpp_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<16, 2, 2, 1, 1>(a, stream, "sm90_fp8_swapab_w128_n16_pp");
}
moe_status_t moe_gemm_sm90_fp8_swap64_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<64, 2, 1, 1>(a, stream, "sm90_fp8_swapab_n64");
}
/* Without promotion (F8 = 3, fast_accum: fp8_math W8A8_FAST layers): the ping-pong tiles with
 * one stage's wgmma group kept in flight across stages, as the bf16 ones, instead of a wait and
 * the adds after every 128 of k */
moe_status_t moe_gemm_sm90_fp8f_swap8pp_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<8, 4, 1, 3, 1>(a, stream, "sm90_fp8_fast_swapab_n8_pp");
}
moe_status_t moe_gemm_sm90_fp8f_swap16pp_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<16, 4, 1, 3, 1>(a, stream, "sm90_fp8_fast_swapab_n16_pp");
}
moe_status_t moe_gemm_sm90_fp8f_swap32pp_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_swap<32, 2, 1, 3, 1>(a, stream, "sm90_fp8_fast_swapab_n32_pp");
}
}
