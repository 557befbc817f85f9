/* SPDX-License-Identifier: Apache-2.0 */
/* The shape rule every grouped-GEMM variant covers (kernels/expert_gemm.h). */
#include "kernels/expert_gemm.h"

#include "base/diag.h"

moe_status_t moe_gemm_check_shape(const char *what, int n, int k, moe_gemm_epilogue_t epilogue)
{
    const int mul = epilogue != MOE_GEMM_EPI_STORE;
    if (k <= 0 || k % MOE_GEMM_ALIGN)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "%s: k = %d is not a multiple of %d (rows of whole 16-byte units)", what,
                         k, MOE_GEMM_ALIGN);
    if (n <= 0 || n % MOE_GEMM_ALIGN || (mul && (n / 2) % MOE_GEMM_ALIGN))
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "%s: n = %d: n%s must be a multiple of %d", what,
                         n, mul ? "/2" : "", MOE_GEMM_ALIGN);
    return MOE_STATUS_SUCCESS;
}
