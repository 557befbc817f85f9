/* SPDX-License-Identifier: Apache-2.0 */
/* Create-time loading of every kernel a step can launch, so that lazy module loading or a
 * driver JIT (PTX on a newer GPU) happens at create and never inside a step, where one rank's
 * stall would hold up its peers. CUDA-free. */
#ifndef MOE_PREPARE_H
#define MOE_PREPARE_H

#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Every family below on the current device; arch picks the GEMM variants that run there. */
moe_status_t moe_kernels_prepare(int arch);

moe_status_t moe_route_prepare(void);
moe_status_t moe_permute_prepare(void);
moe_status_t moe_combine_prepare(void);
moe_status_t moe_ep_prepare(void);
moe_status_t moe_a2a_prepare(void);
moe_status_t moe_quant_prepare(void);
/* Each grouped-GEMM variant that runs on `arch` (and simt_ref), every epilogue: a launch with
 * max_blocks = 0, which loads the kernel and sets its attributes but runs nothing. */
moe_status_t moe_gemm_prepare(int arch);

#ifdef __cplusplus
}
#endif

#endif /* MOE_PREPARE_H */
