/* SPDX-License-Identifier: Apache-2.0 */
/* The reference grouped-GEMM variant "simt_ref": SIMT, f32 accumulation, slow and simple. */
#ifndef MOE_EXPERT_GEMM_SIMPLE_H
#define MOE_EXPERT_GEMM_SIMPLE_H

#include "kernels/expert_gemm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Runs on sm_80+; block_rows 16; bf16 A/B, any epilogue, bf16 or f32 C, optional row_scale.
 * A correctness fallback and a cross-check for the tuned variants; never selected by default
 * where a tuned variant exists. */
const moe_gemm_variant_t *moe_gemm_simple_variant(void);

#ifdef __cplusplus
}
#endif

#endif /* MOE_EXPERT_GEMM_SIMPLE_H */
