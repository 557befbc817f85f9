/* SPDX-License-Identifier: Apache-2.0 */
/* Launch entry points of the compiled grouped-GEMM variants (CUDA-free), for the table. */
#ifndef MOE_EXPERT_GEMM_LAUNCH_H
#define MOE_EXPERT_GEMM_LAUNCH_H

#include "kernels/expert_gemm.h"

#ifdef __cplusplus
extern "C" {
#endif

moe_status_t moe_gemm_sm90_m128_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_m64_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_m64pp_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_m192_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_m256_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_swap8_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_swap16_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_swap32_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_swap64_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_swap32w_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8_m128_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8_m192_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8_m64_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8f_m128_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8i_m128_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8i_m128w_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8i_m128wla_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8i_m192la_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8i_m128la_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8b_m128la_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8b_m192la_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8i_m64wpp_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8b_m128w_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8b_m64wpp_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8i_m192_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8f_m64_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8f_m64pp_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8i_m64pp_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8b_m64pp_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8_swap16_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8_swap16pp_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8_swap32pp_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8_swap16wpp_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8_swap8pp_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8_swap16ppi_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8_swap32ppi_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8_swap32_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8_swap64_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8f_swap8pp_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8f_swap16pp_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8f_swap32pp_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8b_m128_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8b_m192_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8b_m64_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8b_swap16_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8b_swap16pp_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8b_swap8pp_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8b_swap32pp_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8b_swap32_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8i_m128mc_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8i_m192mc_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8b_m128mc_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm90_fp8b_m192mc_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm80_m64_launch(const moe_gemm_args_t *args, void *stream);
moe_status_t moe_gemm_sm80_m32_launch(const moe_gemm_args_t *args, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_EXPERT_GEMM_LAUNCH_H */
