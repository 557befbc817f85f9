/* SPDX-License-Identifier: Apache-2.0 */
/* The grouped expert GEMM variant table: every variant compiled ahead of time, by name, arch,
 * dtype and scale kind (CUDA-free). Which one a step runs is the oracle's choice
 * (runtime/oracle.h); the variants' interface is kernels/expert_gemm.h. */
#ifndef MOE_EXPERT_GEMM_TABLE_H
#define MOE_EXPERT_GEMM_TABLE_H

#include "kernels/expert_gemm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* All variants (static table). A build without CUDA has the same table with launch = NULL
 * (names, archs and dtypes for the oracle and the tune file reader). */
const moe_gemm_variant_t *moe_gemm_variants(int *count);
const moe_gemm_variant_t *moe_gemm_variant_by_name(const char *name);
/* 1 if the variant has an image that runs on a device of compute capability `arch` (90, 100,
 * ...): sm_90a variants on 90 only, sm_80 ones (SASS + PTX) on 80 and newer. */
int moe_gemm_variant_runs_on(const moe_gemm_variant_t *v, int arch);
/* 1 if the variant is on trial: built, but not yet checked on a GPU against the CPU reference
 * nor measured (its note in kernels/expert_gemm_table.c). MOE_FORCE_VARIANT and the GPU tests run
 * it; moe-tune leaves it out unless MOE_TUNE_TRIAL=1; no built-in table names it. */
int moe_gemm_variant_on_trial(const moe_gemm_variant_t *v);

#ifdef __cplusplus
}
#endif

#endif /* MOE_EXPERT_GEMM_TABLE_H */
