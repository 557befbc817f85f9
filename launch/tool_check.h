/* SPDX-License-Identifier: Apache-2.0 */
/* The tools' checks (programs, not the library): a failed CUDA or libmoe call prints one
 * line naming the tool and ends the job with MPI_Abort (after the ranks agreed on the options,
 * a failure on one rank can leave the others in a collective; the library itself never
 * aborts). Needs mpi.h, stdio.h and moe/moe.h first; MOE_TOOL_CUDA_OK cuda_runtime.h too. */
#ifndef MOE_TOOL_CHECK_H
#define MOE_TOOL_CHECK_H

#define MOE_TOOL_CUDA_OK(tool, call)                                                               \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s: %s failed: %s\n", tool, #call, cudaGetErrorString(e_));           \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                          \
        }                                                                                          \
    } while (0)

#define MOE_TOOL_OK(tool, call)                                                                    \
    do {                                                                                           \
        moe_status_t s_ = (call);                                                                  \
        if (s_ != MOE_STATUS_SUCCESS) {                                                            \
            fprintf(stderr, "%s: %s failed: %s: %s\n", tool, #call, moe_status_string(s_),         \
                    moe_last_error());                                                             \
            MPI_Abort(MPI_COMM_WORLD, 1);                                                          \
        }                                                                                          \
    } while (0)

#endif /* MOE_TOOL_CHECK_H */
