/* SPDX-License-Identifier: Apache-2.0 */
/* Grouped expert GEMM variants for sm_90a (expert_gemm_sm90.cuh): FP8 e4m3 with per-row scales,
 * normal layout. */
#include "kernels/cuda/expert_gemm_sm90.cuh"

extern "C" {
/* FP8 e4m3 (W8A8, per-row scales of A and B): the same tiles, 128 k per stage row. */
moe_status_t moe_gemm_sm90_fp8_m128_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<128, 1>(a, stream, "sm90_fp8_m128n128");
}
moe_status_t moe_gemm_sm90_fp8_m192_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<192, 1>(a, stream, "sm90_fp8_m192n128");
}
moe_status_t moe_gemm_sm90_fp8_m64_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<64, 1>(a, stream, "sm90_fp8_m64n128");
}
/* FP8 per-row scales promoted every F8_PI (4) slices of 128 k instead of every one: the wgmmas
 * of the slices between stay in flight (one wait, one add pass per 512 of k). Not in a built-in
 * table until measured: moe-tune and MOE_FORCE_VARIANT. */
moe_status_t moe_gemm_sm90_fp8i_m128_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<128, 4>(a, stream, "sm90_fp8_m128n128_p4");
}
moe_status_t moe_gemm_sm90_fp8i_m192_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<192, 4>(a, stream, "sm90_fp8_m192n128_p4");
}
/* each warpgroup's epilogue under the first stage of its next item (LA; on trial:
 * kernels/expert_gemm_table.c) */
moe_status_t moe_gemm_sm90_fp8i_m192la_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<192, 4, 0, 0, 0, 1>(a, stream, "sm90_fp8_m192n128_p4_la");
}
moe_status_t moe_gemm_sm90_fp8i_m128la_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<128, 4, 0, 0, 0, 1>(a, stream, "sm90_fp8_m128n128_p4_la");
}
/* The _p4 promotion with two consumer warpgroups on alternate 64-row items (ping-pong, as the
 * bf16 m64n256_pp tile): one's promotions and epilogue run while the other's wgmmas do. */
moe_status_t moe_gemm_sm90_fp8i_m64pp_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<64, 4, 0, 1>(a, stream, "sm90_fp8_m64n128_pp_p4");
}
/* FP8 per-row scales without promotion: the tensor cores accumulate the whole k (their FP8
 * accumulation keeps fewer bits than f32: docs/KERNELS.md, "Fast accumulation"), so a
 * warpgroup holds one m64n256 accumulator set as bf16 does. Chosen only where the layer
 * allows it (fp8_math W8A8_FAST) or forced. */
moe_status_t moe_gemm_sm90_fp8f_m128_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<128, 3>(a, stream, "sm90_fp8_fast_m128n256");
}
moe_status_t moe_gemm_sm90_fp8f_m64_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<64, 3>(a, stream, "sm90_fp8_fast_m64n256");
}
/* ... and as ping-pong (two consumer warpgroups on alternate 64-row items, as the bf16
 * m64n256_pp tile): one's epilogue under the other's wgmmas (on trial) */
moe_status_t moe_gemm_sm90_fp8f_m64pp_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch_normal<64, 3, 0, 1>(a, stream, "sm90_fp8_fast_m64n256_pp");
}
}
