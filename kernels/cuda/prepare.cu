/* SPDX-License-Identifier: Apache-2.0 */
/* moe_kernels_prepare: every kernel family loaded on the current device (see prepare.h). */
#include "kernels/decode.h"
#include "kernels/prepare.h"
#include "runtime/diag.h"

extern "C" moe_status_t moe_kernels_prepare(int arch)
{
    MOE_CHECK(moe_route_prepare());
    MOE_CHECK(moe_permute_prepare());
    MOE_CHECK(moe_combine_prepare());
    MOE_CHECK(moe_ep_prepare());
    MOE_CHECK(moe_a2a_prepare());
    MOE_CHECK(moe_quant_prepare());
    if (arch == 90) /* the fused decode kernel is built for sm_90a only */
        MOE_CHECK(moe_decode_prepare());
    return moe_gemm_prepare(arch);
}
