// SPDX-License-Identifier: Apache-2.0
// Expert-parallel helper kernels: replica slots of logical experts, local expert ids, and rows
// scattered into the dense (token, slot) layout.
#include "kernels/ep.h"

#include <cuda_bf16.h>
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/slot.cuh"
#include "kernels/cuda/sticky.cuh"

namespace
{

constexpr int EP_THREADS = 256;

__global__ void local_ids_kernel(const int32_t *__restrict__ in, int32_t *__restrict__ out,
                                 int64_t n, int first, int count, const int32_t *flags, int world,
                                 int32_t *sticky)
{
    moe_pdl_wait();
    const int64_t i = (int64_t)blockIdx.x * EP_THREADS + threadIdx.x;
    const int bad = moe_first_failure(flags, world, sticky, i == 0);
    if (i >= n)
        return;
    const int32_t e = in[i];
    out[i] = bad < 0 && e >= first && e < first + count ? e - first : -1;
}

/* With the loads counted (num_experts > 0): each CTA takes SLOT_PAIRS pairs (SLOT_UNROLL a
 * thread, loaded before any is used), counts them per logical expert in shared memory and adds
 * each count to load[e] once: at most num_experts global atomics a CTA instead of one a pair
 * (65536 on 128 addresses at Qwen3-30B-A3B's 8192 tokens). The sums are integers: the same
 * totals in any order. An id past num_experts is counted in load as before. */
constexpr int SLOT_UNROLL = 4, SLOT_PAIRS = SLOT_UNROLL * EP_THREADS;
constexpr int SLOT_HIST_MAX = 8192; /* logical experts a CTA's histogram holds (32 KB) */

__global__ void slot_ids_kernel(const int32_t *__restrict__ in, int32_t *__restrict__ out,
                                int64_t n, int top_k, int64_t first_token, int rank,
                                const int32_t *__restrict__ replica_begin,
                                const int32_t *__restrict__ replica_slot, unsigned long long *load,
                                int num_experts)
{
    moe_pdl_wait();
    if (num_experts <= 0) {
        const int64_t i = (int64_t)blockIdx.x * EP_THREADS + threadIdx.x;
        if (i >= n)
            return;
        out[i] =
            moe_pair_slot(in[i], first_token + i / top_k + rank, replica_begin, replica_slot, load);
        return;
    }
    extern __shared__ unsigned hist[];
    for (int e = threadIdx.x; e < num_experts; e += EP_THREADS)
        hist[e] = 0;
    __syncthreads();
    const int64_t base = (int64_t)blockIdx.x * SLOT_PAIRS + threadIdx.x;
    int32_t ev[SLOT_UNROLL];
#pragma unroll
    for (int u = 0; u < SLOT_UNROLL; u++) {
        const int64_t i = base + u * EP_THREADS;
        ev[u] = i < n ? in[i] : -1;
    }
#pragma unroll
    for (int u = 0; u < SLOT_UNROLL; u++) {
        const int64_t i = base + u * EP_THREADS;
        if (i >= n)
            break;
        const int32_t e = ev[u];
        out[i] =
            moe_pair_slot(e, first_token + i / top_k + rank, replica_begin, replica_slot, NULL);
        if (e >= 0 && e < num_experts)
            atomicAdd(&hist[e], 1u);
        else if (e >= 0)
            atomicAdd(load + e, 1ULL);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < num_experts; e += EP_THREADS)
        if (hist[e])
            atomicAdd(load + e, (unsigned long long)hist[e]);
}

__global__ void flag_set_kernel(int32_t *flag, int32_t value, uint32_t *seq,
                                const int32_t *skip_rows, int64_t first)
{
    moe_pdl_wait();
    if (skip_rows && (int64_t)*skip_rows <= first)
        return;
    *flag = value;
    if (seq)
        *seq += 1;
}

template <typename T> __device__ __forceinline__ bool finite_val(T v)
{
    return isfinite((float)v);
}

template <typename T>
__global__ void scan_finite_kernel(const T *__restrict__ x, int64_t n, int32_t *flag, int32_t code)
{
    moe_pdl_wait();
    bool bad = false;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x)
        bad |= !finite_val(x[i]);
    if (__syncthreads_or(bad) && threadIdx.x == 0)
        *flag = code;
}

// One block per row; 16-byte copies when hidden % 8 == 0 (the layer requires it for bf16).
__global__ void scatter_kernel(const uint4 *__restrict__ rows,
                               const int32_t *__restrict__ slot_of_row,
                               const int32_t *__restrict__ num_blocks, int block_rows,
                               int vec_per_row, uint4 *__restrict__ dense)
{
    moe_pdl_wait();
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
    if (a->n <= 0 && !a->sticky)
        return MOE_STATUS_SUCCESS;
    MOE_CUDA_CHECK(moe_ep_launch((local_ids_kernel),
                                 dim3((unsigned)((a->n + EP_THREADS) / EP_THREADS)),
                                 dim3(EP_THREADS), 0, (cudaStream_t)stream, a->in, a->out, a->n,
                                 a->first, a->count, a->flags, a->world, a->sticky));
    MOE_CUDA_CHECK_LAUNCH("ep local ids");
    return MOE_STATUS_SUCCESS;
}

/* MOE_SLOT_LOAD_HIST=0: every pair adds to the expert loads by its own global atomic (an A/B
 * knob) */
static int slot_hist_enabled(void)
{
    static int cached = -1;
    return moe_env_once(&cached, "MOE_SLOT_LOAD_HIST", 1) != 0;
}

extern "C" moe_status_t moe_ep_slot_ids_launch(const moe_ep_slot_ids_args_t *a, void *stream)
{
    if (a->n <= 0)
        return MOE_STATUS_SUCCESS;
    const bool pdl = a->pdl ? moe_pdl_enabled() : moe_ep_pdl_enabled();
    /* the per-CTA histogram where loads are counted, the experts fit it and the pairs fill
     * more than one CTA (a decode step's few pairs keep the kernel as measured there) */
    const int hist = a->load && a->num_experts > 0 && a->num_experts <= SLOT_HIST_MAX &&
                             a->n > SLOT_PAIRS && slot_hist_enabled()
                         ? a->num_experts
                         : 0;
    const int per = hist ? SLOT_PAIRS : EP_THREADS;
    MOE_CUDA_CHECK(moe_launch_pdl(
        pdl, (slot_ids_kernel), dim3((unsigned)((a->n + per - 1) / per)), dim3(EP_THREADS),
        sizeof(unsigned) * (size_t)hist, (cudaStream_t)stream, a->in, a->out, a->n, a->top_k,
        a->first_token, a->rank, a->replica_begin, a->replica_slot, a->load, hist));
    MOE_CUDA_CHECK_LAUNCH("ep slot ids");
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
    MOE_CUDA_CHECK(moe_ep_launch((scatter_kernel), dim3((unsigned)rows), dim3(128), 0,
                                 (cudaStream_t)stream, (const uint4 *)a->rows, a->slot_of_row,
                                 a->num_blocks, a->block_rows, a->hidden / 8, (uint4 *)a->dense));
    MOE_CUDA_CHECK_LAUNCH("ep scatter");
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_step_flag_set_launch(int32_t *flag, int32_t value, uint32_t *seq,
                                                 const int32_t *skip_rows, int64_t first,
                                                 void *stream)
{
    MOE_CUDA_CHECK(moe_ep_launch((flag_set_kernel), dim3(1), dim3(1), 0, (cudaStream_t)stream, flag,
                                 value, seq, skip_rows, first));
    MOE_CUDA_CHECK_LAUNCH("step flag");
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_scan_finite_launch(const void *x, moe_dtype_t dtype, int64_t n,
                                               int32_t *flag, int32_t code, void *stream)
{
    const unsigned grid =
        (unsigned)(n / (EP_THREADS * 8) + 1 < 1024 ? n / (EP_THREADS * 8) + 1 : 1024);
    cudaStream_t s = (cudaStream_t)stream;
    if (n <= 0)
        return MOE_STATUS_SUCCESS;
    if (dtype == MOE_DTYPE_F32)
        MOE_CUDA_CHECK(moe_ep_launch((scan_finite_kernel<float>), dim3(grid), dim3(EP_THREADS), 0,
                                     s, (const float *)x, n, flag, code));
    else if (dtype == MOE_DTYPE_BF16)
        MOE_CUDA_CHECK(moe_ep_launch((scan_finite_kernel<__nv_bfloat16>), dim3(grid),
                                     dim3(EP_THREADS), 0, s, (const __nv_bfloat16 *)x, n, flag,
                                     code));
    else
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "finite scan: dtype %s", moe_dtype_name(dtype));
    MOE_CUDA_CHECK_LAUNCH("finite scan");
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_ep_prepare(void)
{
    MOE_CUDA_PREPARE(local_ids_kernel);
    MOE_CUDA_PREPARE(slot_ids_kernel);
    MOE_CUDA_PREPARE(scatter_kernel);
    MOE_CUDA_PREPARE(flag_set_kernel);
    MOE_CUDA_PREPARE(scan_finite_kernel<float>);
    MOE_CUDA_PREPARE(scan_finite_kernel<__nv_bfloat16>);
    return MOE_STATUS_SUCCESS;
}
