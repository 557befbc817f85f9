/* SPDX-License-Identifier: Apache-2.0 */
/* The CUDA adapter of the MOE_CHECK family: every CUDA runtime call and launch goes through it. */
#ifndef MOE_CUDA_CHECK_H
#define MOE_CUDA_CHECK_H

#include <cuda_runtime.h>
#include "base/diag.h"

/* Returns MOE_STATUS_CUDA_ERROR naming the call and CUDA's message when `call` fails. */
#define MOE_CUDA_CHECK(call)                                                                       \
    do {                                                                                           \
        cudaError_t moe_ce_ = (call);                                                              \
        if (moe_ce_ != cudaSuccess)                                                                \
            return moe_error(MOE_STATUS_CUDA_ERROR, "%s failed: %s (%s:%d)", #call,                \
                             cudaGetErrorString(moe_ce_), __FILE__, __LINE__);                     \
    } while (0)

/* After a <<<>>> launch: a bad configuration is reported here, not at the next sync. */
#define MOE_CUDA_CHECK_LAUNCH(kernel_name)                                                         \
    do {                                                                                           \
        cudaError_t moe_ce_ = cudaGetLastError();                                                  \
        if (moe_ce_ != cudaSuccess)                                                                \
            return moe_error(MOE_STATUS_CUDA_ERROR, "launch of %s failed: %s (%s:%d)",             \
                             kernel_name, cudaGetErrorString(moe_ce_), __FILE__, __LINE__);        \
    } while (0)

/* Loads a kernel now (with lazy module loading the first launch would): create-time prepare
 * functions call it on every instantiation a step can launch. */
#define MOE_CUDA_PREPARE(kernel)                                                                   \
    do {                                                                                           \
        cudaFuncAttributes moe_fa_;                                                                \
        MOE_CUDA_CHECK(cudaFuncGetAttributes(&moe_fa_, (const void *)(kernel)));                   \
    } while (0)

#endif /* MOE_CUDA_CHECK_H */
