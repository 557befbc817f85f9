/* SPDX-License-Identifier: Apache-2.0 */
/* Combine kernel: weighted sum of each token's expert rows (fixed order) plus shared expert. */
#include "kernels/combine.h"

#include <cuda_bf16.h>
#include "kernels/cuda/aligned.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/vec8.cuh"

namespace
{

constexpr int COMBINE_THREADS = 256;

__device__ __forceinline__ float load1(const __nv_bfloat16 *src)
{
    return __bfloat162float(*src);
}
__device__ __forceinline__ float load1(const float *src)
{
    return *src;
}

__device__ __forceinline__ void store1(float *y, float v)
{
    *y = v;
}
__device__ __forceinline__ void store1(__nv_bfloat16 *y, float v)
{
    *y = __float2bfloat16_rn(v);
}

/* A token's slots handled SLOTS at a time: their rows' ids and weights, then the rows
 * themselves, loaded as one batch each (two round trips to the L2 for up to SLOTS slots, where
 * a loop slot by slot waits for each id, then for its row: at one decode token that chain is
 * most of the kernel), then added in slot order (the same sums at any SLOTS). Steps of up to
 * BATCH_TOKENS tokens take SLOTS_BATCH (1-2 % off Qwen3's steps at 1-64 tokens); larger ones
 * slot by slot: there the batch's registers cost more than the chain (the combine of a
 * DeepSeek-V3 shard step of 8192 tokens 275 -> 575 µs). bench/RESULTS.md, "Fused decode (one
 * kernel), one H200". */
constexpr int SLOTS_BATCH = 8;
constexpr int64_t BATCH_TOKENS = 64;

/* One thread per 8 columns of a token (VEC), or per column. */
template <typename TY, typename TO, bool VEC, int SLOTS>
__global__ void __launch_bounds__(COMBINE_THREADS)
    combine_kernel(const TO *__restrict__ out, const int32_t *__restrict__ row_of_slot,
                   const float *__restrict__ topk_weights, const __nv_bfloat16 *__restrict__ shared,
                   const float *__restrict__ gate_logit, TY *__restrict__ y, int num_tokens,
                   int hidden, int top_k)
{
    moe_pdl_wait();
    constexpr int V = VEC ? 8 : 1;
    const int per_token = hidden / V;
    const int64_t idx = (int64_t)blockIdx.x * COMBINE_THREADS + threadIdx.x;
    if (idx >= (int64_t)num_tokens * per_token)
        return;
    const int t = (int)(idx / per_token), c = (int)(idx % per_token) * V;
    float acc[V];
#pragma unroll
    for (int i = 0; i < V; i++)
        acc[i] = 0.0f;
    for (int j0 = 0; j0 < top_k; j0 += SLOTS) {
        int row[SLOTS];
        float w[SLOTS], v[SLOTS][V];
#pragma unroll
        for (int u = 0; u < SLOTS; u++) {
            const bool in = j0 + u < top_k;
            row[u] = in ? row_of_slot[(size_t)t * top_k + j0 + u] : -1;
            w[u] = in ? topk_weights[(size_t)t * top_k + j0 + u] : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < SLOTS; u++) {
            if (row[u] < 0)
                continue;
            const TO *src = out + (size_t)row[u] * hidden + c;
            if (VEC)
                moe_load8(src, v[u]);
            else
                v[u][0] = load1(src);
        }
#pragma unroll
        for (int u = 0; u < SLOTS; u++)
            if (row[u] >= 0)
#pragma unroll
                for (int i = 0; i < V; i++)
                    acc[i] += w[u] * v[u][i];
    }
    if (shared) {
        const float g = gate_logit ? 1.0f / (1.0f + expf(-gate_logit[t])) : 1.0f;
        const __nv_bfloat16 *src = shared + (size_t)t * hidden + c;
        float v[V];
        if (VEC)
            moe_load8(src, v);
        else
            v[0] = __bfloat162float(src[0]);
#pragma unroll
        for (int i = 0; i < V; i++)
            acc[i] += g * v[i];
    }
    if (VEC)
        moe_store8(y + (size_t)t * hidden + c, acc);
    else
        store1(y + (size_t)t * hidden + c, acc[0]);
}

template <typename TY, typename TO, int SLOTS>
moe_status_t launch(const moe_combine_args_t *a, bool vec, cudaStream_t s)
{
    const int64_t threads = a->num_tokens * (vec ? a->hidden / 8 : a->hidden);
    const unsigned grid = (unsigned)((threads + COMBINE_THREADS - 1) / COMBINE_THREADS);
    const TO *out = (const TO *)a->expert_out;
    const __nv_bfloat16 *sh = (const __nv_bfloat16 *)a->shared_out;
    if (vec)
        MOE_CUDA_CHECK(moe_launch((combine_kernel<TY, TO, true, SLOTS>), dim3(grid),
                                  dim3(COMBINE_THREADS), 0, s, out, a->row_of_slot, a->topk_weights,
                                  sh, a->shared_gate_logit, (TY *)a->y, (int)a->num_tokens,
                                  a->hidden, a->top_k));
    else
        MOE_CUDA_CHECK(moe_launch((combine_kernel<TY, TO, false, SLOTS>), dim3(grid),
                                  dim3(COMBINE_THREADS), 0, s, out, a->row_of_slot, a->topk_weights,
                                  sh, a->shared_gate_logit, (TY *)a->y, (int)a->num_tokens,
                                  a->hidden, a->top_k));
    MOE_CUDA_CHECK_LAUNCH("combine_kernel");
    return MOE_STATUS_SUCCESS;
}

template <typename TY, typename TO>
moe_status_t launch_slots(const moe_combine_args_t *a, bool vec, cudaStream_t s)
{
    return a->num_tokens <= BATCH_TOKENS ? launch<TY, TO, SLOTS_BATCH>(a, vec, s)
                                         : launch<TY, TO, 1>(a, vec, s);
}

template <typename TY>
moe_status_t launch_out(const moe_combine_args_t *a, bool vec, cudaStream_t s)
{
    return a->expert_out_f32 ? launch_slots<TY, float>(a, vec, s)
                             : launch_slots<TY, __nv_bfloat16>(a, vec, s);
}

} /* namespace */

template <typename TY, typename TO> moe_status_t prepare_combine()
{
    MOE_CUDA_PREPARE((combine_kernel<TY, TO, true, SLOTS_BATCH>));
    MOE_CUDA_PREPARE((combine_kernel<TY, TO, false, SLOTS_BATCH>));
    MOE_CUDA_PREPARE((combine_kernel<TY, TO, true, 1>));
    MOE_CUDA_PREPARE((combine_kernel<TY, TO, false, 1>));
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_combine_prepare(void)
{
    MOE_CHECK((prepare_combine<float, float>()));
    MOE_CHECK((prepare_combine<float, __nv_bfloat16>()));
    MOE_CHECK((prepare_combine<__nv_bfloat16, float>()));
    return prepare_combine<__nv_bfloat16, __nv_bfloat16>();
}

extern "C" moe_status_t moe_combine_launch(const moe_combine_args_t *a, void *stream)
{
    bool vec;
    MOE_ARG_CHECK(a->num_tokens >= 0 && a->num_tokens * (int64_t)a->hidden <= (int64_t)1 << 40,
                  "combine: num_tokens = %lld", (long long)a->num_tokens);
    MOE_ARG_CHECK(a->hidden > 0 && a->top_k >= 0, "combine: hidden = %d, top_k = %d", a->hidden,
                  a->top_k);
    if (a->num_tokens == 0)
        return MOE_STATUS_SUCCESS;
    vec = a->hidden % 8 == 0 && moe_aligned16(a->y) && moe_aligned16(a->expert_out) &&
          (!a->shared_out || moe_aligned16(a->shared_out));
    switch (a->y_dtype) {
    case MOE_DTYPE_F32:
        return launch_out<float>(a, vec, (cudaStream_t)stream);
    case MOE_DTYPE_BF16:
        return launch_out<__nv_bfloat16>(a, vec, (cudaStream_t)stream);
    default:
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "combine: y dtype %s (F32 or BF16)",
                         moe_dtype_name(a->y_dtype));
    }
}
