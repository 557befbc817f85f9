/* SPDX-License-Identifier: Apache-2.0 */
/* Grouped expert GEMM variants for sm_90a (expert_gemm_sm90.cuh): bf16, normal layout (tokens in
 * wgmma M). */
#include "kernels/cuda/expert_gemm_sm90.cuh"

extern "C" {
moe_status_t moe_gemm_sm90_m128_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<128>(a, stream, "sm90_wgmma_tma_m128n256");
}
moe_status_t moe_gemm_sm90_m64_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<64>(a, stream, "sm90_wgmma_tma_m64n256");
}
/* 64 rows x 256 weight rows an item, two consumer warpgroups on alternate items (ping-pong):
 * one warpgroup's epilogue runs while the other's wgmmas do. */
moe_status_t moe_gemm_sm90_m64pp_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<64, 0, 0, 1>(a, stream, "sm90_wgmma_tma_m64n256_pp");
}
/* 192 rows (three consumer warpgroups) x 128 weight rows: an expert of 129..192 rows is one
 * block, so each weight tile is read once for it (m128: twice, the second mostly padding). */
moe_status_t moe_gemm_sm90_m192_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<192, 0, 64>(a, stream, "sm90_wgmma_tma_m192n128");
}
/* 256 rows (four consumer warpgroups) x 128 weight rows: the same for experts of 193..256 */
moe_status_t moe_gemm_sm90_m256_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<256, 0, 64>(a, stream, "sm90_wgmma_tma_m256n128");
}
}
