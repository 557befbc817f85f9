// SPDX-License-Identifier: Apache-2.0
// Expert-parallel helper kernels: local expert ids, and rows scattered into the dense
// (token, slot) layout.
#include "kernels/ep.h"

#include <cuda_bf16.h>
#include "kernels/cuda/cuda_check.h"

namespace
{

constexpr int EP_THREADS = 256;

__global__ void local_ids_kernel(const int32_t *__restrict__ in, int32_t *__restrict__ out,
                                 int64_t n, int first, int count)
{
    const int64_t i = (int64_t)blockIdx.x * EP_THREADS + threadIdx.x;
    if (i >= n)
        return;
    const int32_t e = in[i];
    out[i] = (e >= first && e < first + count) ? e - first : -1;
}

// One block per row; 16-byte copies when hidden % 8 == 0 (the layer requires it for bf16).
__global__ void scatter_kernel(const uint4 *__restrict__ rows,
                               const int32_t *__restrict__ slot_of_row,
                               const int32_t *__restrict__ num_blocks, int block_rows,
                               int vec_per_row, uint4 *__restrict__ dense)
{
    const int r = blockIdx.x;
    if (r >= *num_blocks * block_rows)
        return;
    const int32_t slot = slot_of_row[r];
    if (slot < 0)
        return;
    for (int c = threadIdx.x; c < vec_per_row; c += blockDim.x)
        dense[(size_t)slot * vec_per_row + c] = rows[(size_t)r * vec_per_row + c];
}

} // namespace

extern "C" moe_status_t moe_ep_local_ids_launch(const moe_ep_local_ids_args_t *a, void *stream)
{
    if (a->n <= 0)
        return MOE_STATUS_SUCCESS;
    local_ids_kernel<<<(unsigned)((a->n + EP_THREADS - 1) / EP_THREADS), EP_THREADS, 0,
                       (cudaStream_t)stream>>>(a->in, a->out, a->n, a->first, a->count);
    MOE_CUDA_CHECK_LAUNCH("ep local ids");
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_ep_scatter_launch(const moe_ep_scatter_args_t *a, void *stream)
{
    const int rows = a->max_blocks * a->block_rows;
    if (a->hidden % 8 != 0)
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "ep scatter: hidden = %d is not a multiple of 8",
                         a->hidden);
    if (rows <= 0)
        return MOE_STATUS_SUCCESS;
    scatter_kernel<<<rows, 128, 0, (cudaStream_t)stream>>>((const uint4 *)a->rows, a->slot_of_row,
                                                           a->num_blocks, a->block_rows,
                                                           a->hidden / 8, (uint4 *)a->dense);
    MOE_CUDA_CHECK_LAUNCH("ep scatter");
    return MOE_STATUS_SUCCESS;
}
