/* SPDX-License-Identifier: Apache-2.0 */
/* Pieces shared by the grouped expert GEMM families (sm_90a and sm_80): argument checks,
 * epilogue math, device properties, the one-time shared-memory attribute. */
#ifndef MOE_EXPERT_GEMM_COMMON_CUH
#define MOE_EXPERT_GEMM_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels/cuda/act.cuh"
#include "kernels/cuda/device_cache.cuh"
#include "kernels/expert_gemm.h"
#include "base/diag.h"

/* Plain values every kernel needs; the operand pointers travel in tensor maps (sm_90a) or
 * next to this struct (sm_80). */
struct moe_gemm_kparams {
    void *c;
    const float *row_scale;
    const int32_t *block_expert;
    const int32_t *num_blocks;
    const float *a_scale; /* FP8: [rows] per A row (block: [rows][ceil(k/128)]) */
    const float *b_scale; /* FP8: [num_experts][n] per weight row (block: [..][ceil(k/128)]) */
    const int32_t *expert_counts, *expert_offsets; /* optional: see moe_gemm_args_t */
    float *amax; /* moe_gemm_args_t.row_amax (sm_90a *_MUL epilogues) */
    int max_blocks, num_experts, n, k, n_out, c_f32, n_tiles;
    int tma_store; /* sm_90a normal layout: bf16 c through shared memory and TMA */
    int group; /* sm_90a: row blocks swept together over the weight tiles (0: by the step; < 0: one
                * expert's blocks a sweep, the normal layout with the permute's counts) */
    int swap_fold; /* sm_90a swap-AB, per-row fp8 scales: multiplied in after the main loop */
    int promo_pi;  /* sm_90a fp8 per-row scales (F8 = 4): 128-k slices a promotion sums */
    /* sm_90a normal layout, per-row fp8 scales: b_scale is one value a half of each expert
     * (moe_gemm_args_t.b_scale_uniform; MOE_GEMM_B_UNIFORM=0: not): the epilogue reads one */
    int b_uniform;
    /* sm_90a swap-AB (not block scales): moe_gemm_args_t.early_weights under programmatic
     * dependent launch: the first weight stages before the wait */
    int early_w;
};
/* Past 128 bytes of parameters ptxas spilled 20-110 more bytes in the m192 and fast fp8 tiles,
 * whose code had not changed (two more pointers, 2026-12-03: docs/KERNELS.md, "The variants"). */
static_assert(sizeof(moe_gemm_kparams) <= 128, "moe_gemm_kparams past 128 bytes");

/* The fields every variant takes straight from the launch arguments (n_out and n_tiles are
 * the variant's to set). */
static inline moe_gemm_kparams moe_gemm_base_params(const moe_gemm_args_t *a)
{
    moe_gemm_kparams p;
    p.c = a->c;
    p.row_scale = a->row_scale;
    p.block_expert = a->block_expert;
    p.num_blocks = a->num_blocks;
    p.max_blocks = a->max_blocks;
    p.num_experts = a->num_experts;
    p.n = a->n;
    p.k = a->k;
    p.c_f32 = a->c_f32;
    p.n_out = 0;
    p.n_tiles = 0;
    p.tma_store = 0;
    p.group = 0;
    p.swap_fold = 0;
    p.promo_pi = 1;
    p.b_uniform = 0;
    p.early_w = 0;
    p.expert_counts = a->expert_counts; /* both or neither: moe_gemm_check_common */
    p.expert_offsets = a->expert_offsets;
    p.a_scale = a->a_scale;
    p.b_scale = a->b_scale;
    p.amax = a->row_amax;
    return p;
}

/* Takes m (a maximum of |c| over some of a row's outputs, before c's rounding) into the row's
 * maximum as stored: bf16 rounding is monotone and symmetric, so the rounded maximum is the
 * maximum of the rounded values. m >= 0 (NaN dropped by fmaxf, as the quantisation's own max
 * drops it), so its bits order as unsigned integers. */
__device__ __forceinline__ void moe_gemm_amax_put(const moe_gemm_kparams &p, float *at, float m)
{
    if (!p.c_f32)
        m = __bfloat162float(__float2bfloat16_rn(m));
    atomicMax(reinterpret_cast<unsigned int *>(at), __float_as_uint(m));
}

template <int EPI> __device__ __forceinline__ float moe_gemm_act_mul(float g, float u)
{
    if (EPI == MOE_GEMM_EPI_SILU_MUL)
        return moe_act_silu(g) * u;
    return moe_act_gelu_tanh(g) * u;
}

/* Row r's epilogue scale (1 without row_scale). Loaded once per row and item: c may alias
 * nothing, but the compiler cannot know, so a load next to each store would repeat. */
__device__ __forceinline__ float moe_gemm_row_scale(const moe_gemm_kparams &p, int64_t row)
{
    return p.row_scale ? __ldg(p.row_scale + row) : 1.0f;
}

/* Stores one output element (bf16 or f32 output), already scaled. Columns past n_out (the
 * N tail of the last weight tile, computed from zero-filled or neighbouring rows) are dropped. */
__device__ __forceinline__ void moe_gemm_put1(const moe_gemm_kparams &p, int64_t row, int col,
                                              float v)
{
    if (col >= p.n_out)
        return;
    if (p.c_f32)
        ((float *)p.c)[row * p.n_out + col] = v;
    else
        ((__nv_bfloat16 *)p.c)[row * p.n_out + col] = __float2bfloat16_rn(v);
}

/* Stores two adjacent output elements (col even, n_out even: both or neither), already
 * scaled; dropped past n_out like moe_gemm_put1. */
__device__ __forceinline__ void moe_gemm_put2(const moe_gemm_kparams &p, int64_t row, int col,
                                              float v0, float v1)
{
    if (col >= p.n_out)
        return;
    if (p.c_f32)
        *(float2 *)((float *)p.c + row * p.n_out + col) = make_float2(v0, v1);
    else
        *(__nv_bfloat162 *)((__nv_bfloat16 *)p.c + row * p.n_out + col) =
            __floats2bfloat162_rn(v0, v1);
}

/* Checks what every tuned variant needs (the shape rule: moe_gemm_check_shape). f8: the FP8
 * variants (e4m3 A and B, k a multiple of 16 for TMA's 16-byte rows), 1: per-row scales of
 * both, 2: 1 x 128 groups of A and 128 x 128 blocks of B, expanded per weight row. */
static inline moe_status_t moe_gemm_check_common(const moe_gemm_args_t *a, const char *name,
                                                 int f8 = 0, bool amax_ok = false)
{
    if (!a)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "%s: args is NULL", name);
    if (a->row_amax && (!amax_ok || a->epilogue == MOE_GEMM_EPI_STORE))
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "%s: row_amax with epilogue %d (the sm_90a variants' *_MUL epilogues "
                         "take it)",
                         name, (int)a->epilogue);
    if (!f8 && (a->ab_dtype != MOE_DTYPE_BF16 || a->scale_kind != MOE_SCALE_NONE))
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "%s: ab_dtype %d, scale_kind %d (this variant: bf16, no scales)", name,
                         (int)a->ab_dtype, (int)a->scale_kind);
    if (f8 && (a->ab_dtype != MOE_DTYPE_FP8_E4M3 ||
               a->scale_kind != (f8 == 2 ? MOE_SCALE_BLOCK_128 : MOE_SCALE_PER_CHANNEL) ||
               !a->a_scale || !a->b_scale || a->k % 16))
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "%s: ab_dtype %d, scale_kind %d, a_scale %p, b_scale %p, k %d (this "
                         "variant: e4m3 with %s scales of A and B, k a multiple of 16)",
                         name, (int)a->ab_dtype, (int)a->scale_kind, (const void *)a->a_scale,
                         (const void *)a->b_scale, a->k,
                         f8 == 2 ? "1x128 / 128x128 block" : "per-row");
    MOE_ARG_CHECK(a->max_blocks >= 0, "%s: max_blocks = %d < 0", name, a->max_blocks);
    MOE_ARG_CHECK(a->num_experts > 0, "%s: num_experts = %d <= 0", name, a->num_experts);
    MOE_ARG_CHECK(a->n > 0 && a->k > 0, "%s: n = %d, k = %d must be > 0", name, a->n, a->k);
    MOE_ARG_CHECK(a->epilogue >= MOE_GEMM_EPI_STORE && a->epilogue <= MOE_GEMM_EPI_GELU_MUL,
                  "%s: epilogue = %d", name, (int)a->epilogue);
    MOE_ARG_CHECK(!a->expert_counts == !a->expert_offsets,
                  "%s: expert_counts %p and expert_offsets %p: give both or neither", name,
                  (const void *)a->expert_counts, (const void *)a->expert_offsets);
    MOE_ARG_CHECK(a->a && a->b && a->c && a->block_expert && a->num_blocks,
                  "%s: a, b, c, block_expert and num_blocks must be device pointers (a=%p b=%p "
                  "c=%p block_expert=%p num_blocks=%p)",
                  name, a->a, a->b, a->c, (const void *)a->block_expert,
                  (const void *)a->num_blocks);
    MOE_ARG_CHECK(((uintptr_t)a->a % 16) == 0 && ((uintptr_t)a->b % 16) == 0 &&
                      ((uintptr_t)a->c % 16) == 0,
                  "%s: a, b and c must be 16-byte aligned", name);
    MOE_CHECK(moe_gemm_check_shape(name, a->n, a->k, a->epilogue));
    if ((int64_t)a->num_experts * a->n >= ((int64_t)1 << 31))
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "%s: num_experts * n = %lld too large", name,
                         (long long)a->num_experts * a->n);
    return MOE_STATUS_SUCCESS;
}

/* Multiprocessor count of the current device, cached per device. */
static inline moe_status_t moe_gemm_device_sms(const char *name, int *dev_out, int *sms_out)
{
    static int sms_cache[MOE_MAX_DEVICES];
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess)
        return moe_error(MOE_STATUS_CUDA_ERROR, "%s: cudaGetDevice: %s", name,
                         cudaGetErrorString(e));
    int sms = moe_device_cached(sms_cache, dev, [](int d) {
        int n = 0;
        return cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, d) == cudaSuccess ? n : 0;
    });
    if (sms <= 0)
        return moe_error(MOE_STATUS_CUDA_ERROR, "%s: multiprocessor count of device %d", name, dev);
    *dev_out = dev;
    *sms_out = sms;
    return MOE_STATUS_SUCCESS;
}

/* Raises a kernel's dynamic shared-memory limit once per device; `done` is the kernel's
 * per-device cache (moe_device_cached). */
static inline moe_status_t moe_gemm_smem_once(const char *name, const void *kernel, int smem,
                                              int dev, int *done)
{
    cudaError_t err = cudaSuccess;
    int ok = moe_device_cached(done, dev, [&](int) {
        err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        return err == cudaSuccess ? 1 : 0;
    });
    if (ok <= 0)
        return moe_error(MOE_STATUS_CUDA_ERROR, "%s: cudaFuncSetAttribute(smem %d): %s", name, smem,
                         cudaGetErrorString(err));
    return MOE_STATUS_SUCCESS;
}

static inline moe_status_t moe_gemm_check_launch(const char *name)
{
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return moe_error(MOE_STATUS_CUDA_ERROR, "%s: launch: %s", name, cudaGetErrorString(e));
    return MOE_STATUS_SUCCESS;
}

#endif /* MOE_EXPERT_GEMM_COMMON_CUH */
