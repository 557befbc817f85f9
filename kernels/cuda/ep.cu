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

// The L2 prefetch of the slot ids launch: each CTA past the mapping's asks for PF_CTA_BYTES of
// one pair's slot's w13 or w2, PF_PIECE bytes a thread.
constexpr int PF_PIECE = 1024;
constexpr int64_t PF_CTA_BYTES = (int64_t)PF_PIECE * EP_THREADS;

// Asks L2 for `bytes` at p (16-byte aligned, a multiple of 16): the bulk-copy unit's prefetch on
// sm_90, a 128-byte line at a time before.
__device__ __forceinline__ void l2_prefetch(const char *p, int bytes, int lines)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (!lines) {
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
        return;
    }
#endif
    for (int i = 0; i < bytes; i += 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i));
}

// CTA c (counted from the first prefetch CTA) of the prefetch: pair c % n, part c / n of its
// slot's w13 (parts13 of them) then w2.
__device__ void slot_prefetch(const int32_t *__restrict__ in, int64_t n, int top_k,
                              int64_t first_token, int rank,
                              const int32_t *__restrict__ replica_begin,
                              const int32_t *__restrict__ replica_slot, const char *w13,
                              const char *w2, int64_t bytes13, int64_t bytes2, int64_t c, int lines)
{
    const int64_t pair = c % n, part = c / n;
    const int64_t parts13 = (bytes13 + PF_CTA_BYTES - 1) / PF_CTA_BYTES;
    const int32_t e = in[pair];
    if (e < 0)
        return;
    const int32_t slot =
        moe_replica_slot(e, first_token + pair / top_k + rank, replica_begin, replica_slot);
    const bool up = part < parts13;
    const int64_t bytes = up ? bytes13 : bytes2;
    const int64_t off =
        (up ? part : part - parts13) * PF_CTA_BYTES + (int64_t)threadIdx.x * PF_PIECE;
    if (off >= bytes)
        return;
    const char *base = up ? w13 + slot * bytes13 : w2 + slot * bytes2;
    l2_prefetch(base + off, (int)min((int64_t)PF_PIECE, bytes - off), lines);
}

__global__ void slot_ids_kernel(const int32_t *__restrict__ in, int32_t *__restrict__ out,
                                int64_t n, int top_k, int64_t first_token, int rank,
                                const int32_t *__restrict__ replica_begin,
                                const int32_t *__restrict__ replica_slot, unsigned long long *load,
                                const char *w13, const char *w2, int64_t bytes13, int64_t bytes2,
                                int map_ctas, int lines)
{
    moe_pdl_wait();
    if ((int)blockIdx.x >= map_ctas) {
        slot_prefetch(in, n, top_k, first_token, rank, replica_begin, replica_slot, w13, w2,
                      bytes13, bytes2, blockIdx.x - map_ctas, lines);
        return;
    }
    const int64_t i = (int64_t)blockIdx.x * EP_THREADS + threadIdx.x;
    if (i >= n)
        return;
    out[i] =
        moe_pair_slot(in[i], first_token + i / top_k + rank, replica_begin, replica_slot, load);
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

extern "C" moe_status_t moe_ep_slot_ids_launch(const moe_ep_slot_ids_args_t *a, void *stream)
{
    if (a->n <= 0)
        return MOE_STATUS_SUCCESS;
    const int64_t map_ctas = (a->n + EP_THREADS - 1) / EP_THREADS;
    const int64_t b13 = a->w13 ? a->bytes13 : 0, b2 = a->w2 ? a->bytes2 : 0;
    if (b13 < 0 || b2 < 0 || b13 % 16 || b2 % 16 || ((uintptr_t)a->w13 | (uintptr_t)a->w2) % 16)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "ep slot ids: prefetch of %lld + %lld bytes a slot (multiples of 16 at "
                         "16-byte aligned matrices expected)",
                         (long long)a->bytes13, (long long)a->bytes2);
    const int64_t parts =
        (b13 + PF_CTA_BYTES - 1) / PF_CTA_BYTES + (b2 + PF_CTA_BYTES - 1) / PF_CTA_BYTES;
    const int64_t grid = map_ctas + a->n * parts;
    if (grid > INT32_MAX)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "ep slot ids: %lld pairs of %lld prefetch CTAs each is too many",
                         (long long)a->n, (long long)parts);
    const cudaStream_t st = (cudaStream_t)stream;
    const char *w13 = (const char *)a->w13, *w2 = (const char *)a->w2;
    const bool pdl = a->pdl ? moe_pdl_enabled() : moe_ep_pdl_enabled();
    MOE_CUDA_CHECK(moe_launch_pdl(pdl, (slot_ids_kernel), dim3((unsigned)grid), dim3(EP_THREADS), 0,
                                  st, a->in, a->out, a->n, a->top_k, a->first_token, a->rank,
                                  a->replica_begin, a->replica_slot, a->load, w13, w2, b13, b2,
                                  (int)map_ctas, moe_env_int("MOE_L2_PREFETCH_LINES", 0)));
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
