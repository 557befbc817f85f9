/* SPDX-License-Identifier: Apache-2.0 */
/* "simt_ref": a plain SIMT grouped GEMM (16-row blocks, f32 accumulation), correct and slow. */
#include "kernels/expert_gemm_simple.h"

#include <cuda_bf16.h>
#include <math.h>
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/pdl.cuh"

namespace
{

constexpr int BR = 16; /* rows per block (the variant's block_rows) */
constexpr int BN = 64; /* output columns per block */
constexpr int BK = 32; /* k per shared-memory step */
constexpr int THREADS = 256;

/* Thread (tr, tc) computes row tr, columns tc + 16 c (c < 4); *_MUL epilogues also compute
 * the matching up columns. Each dot sums its k sequentially (fixed order). */
template <int EPI>
__global__ void __launch_bounds__(THREADS)
    simt_kernel(const __nv_bfloat16 *__restrict__ a, const __nv_bfloat16 *__restrict__ b,
                void *__restrict__ c, const float *__restrict__ row_scale,
                const int32_t *__restrict__ block_expert, const int32_t *__restrict__ num_blocks,
                int n, int k, int n_out, int c_f32)
{
    moe_pdl_wait();
    constexpr bool MUL = EPI != MOE_GEMM_EPI_STORE;
    constexpr int NB = MUL ? 2 * BN : BN;
    __shared__ float as[BR][BK + 1];
    __shared__ float bs[NB][BK + 1];
    const int blk = blockIdx.y;
    if (blk >= *num_blocks)
        return;
    const int e = block_expert[blk];
    if (e < 0)
        return;
    const int tid = threadIdx.x, tr = tid / 16, tc = tid % 16;
    const int col0 = blockIdx.x * BN;
    const int64_t row0 = (int64_t)blk * BR;
    const __nv_bfloat16 *be = b + (size_t)e * n * k;
    float acc[4] = {0, 0, 0, 0}, accu[4] = {0, 0, 0, 0};

    for (int k0 = 0; k0 < k; k0 += BK) {
        for (int i = tid; i < BR * BK; i += THREADS) {
            const int r = i / BK, kk = i % BK;
            as[r][kk] = k0 + kk < k ? __bfloat162float(a[(row0 + r) * k + k0 + kk]) : 0.0f;
        }
        for (int i = tid; i < NB * BK; i += THREADS) {
            const int r = i / BK, kk = i % BK;
            /* rows [0, BN): gate (or plain) columns; [BN, 2BN): the matching up columns */
            const int col = col0 + (r % BN);
            const int brow = (r < BN) ? col : col + n / 2;
            bs[r][kk] = (col < n_out && k0 + kk < k)
                            ? __bfloat162float(be[(size_t)brow * k + k0 + kk])
                            : 0.0f;
        }
        __syncthreads();
        for (int kk = 0; kk < BK; kk++) {
            const float av = as[tr][kk];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                acc[j] += av * bs[tc + 16 * j][kk];
                if (MUL)
                    accu[j] += av * bs[BN + tc + 16 * j][kk];
            }
        }
        __syncthreads();
    }
    const int64_t row = row0 + tr;
    const float s = row_scale ? row_scale[row] : 1.0f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int col = col0 + tc + 16 * j;
        if (col >= n_out)
            continue;
        float v = acc[j];
        if (EPI == MOE_GEMM_EPI_SILU_MUL)
            v = v / (1.0f + expf(-v)) * accu[j];
        else if (EPI == MOE_GEMM_EPI_GELU_MUL)
            v = 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v))) * accu[j];
        v *= s;
        if (c_f32)
            ((float *)c)[row * n_out + col] = v;
        else
            ((__nv_bfloat16 *)c)[row * n_out + col] = __float2bfloat16_rn(v);
    }
}

template <int EPI> moe_status_t launch(const moe_gemm_args_t *a, int n_out, cudaStream_t s)
{
    dim3 grid((n_out + BN - 1) / BN, a->max_blocks);
    MOE_CUDA_CHECK(moe_launch((simt_kernel<EPI>), dim3(grid), dim3(THREADS), 0, s,
                              (const __nv_bfloat16 *)a->a, (const __nv_bfloat16 *)a->b, a->c,
                              a->row_scale, a->block_expert, a->num_blocks, a->n, a->k, n_out,
                              a->c_f32));
    MOE_CUDA_CHECK_LAUNCH("simt_ref");
    return MOE_STATUS_SUCCESS;
}

moe_status_t simt_launch(const moe_gemm_args_t *a, void *stream)
{
    const cudaStream_t s = (cudaStream_t)stream;
    MOE_ARG_CHECK(a && a->a && a->b && a->c && a->block_expert && a->num_blocks,
                  "simt_ref: a NULL operand or block table");
    MOE_ARG_CHECK(a->n > 0 && a->k > 0 && a->max_blocks >= 0 && a->max_blocks <= 65535,
                  "simt_ref: n = %d, k = %d, max_blocks = %d (<= 65535)", a->n, a->k,
                  a->max_blocks);
    if (a->ab_dtype != MOE_DTYPE_BF16 || a->scale_kind != MOE_SCALE_NONE)
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "simt_ref: dtype %s with scales %d (bf16 only)",
                         moe_dtype_name(a->ab_dtype), (int)a->scale_kind);
    if (a->row_amax)
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "simt_ref: row_amax (sm_90a variants only)");
    if (a->max_blocks == 0) { /* nothing to run: load the kernels (create-time prepare) */
        MOE_CUDA_PREPARE(simt_kernel<MOE_GEMM_EPI_STORE>);
        MOE_CUDA_PREPARE(simt_kernel<MOE_GEMM_EPI_SILU_MUL>);
        MOE_CUDA_PREPARE(simt_kernel<MOE_GEMM_EPI_GELU_MUL>);
        return MOE_STATUS_SUCCESS;
    }
    switch (a->epilogue) {
    case MOE_GEMM_EPI_STORE:
        return launch<MOE_GEMM_EPI_STORE>(a, a->n, s);
    case MOE_GEMM_EPI_SILU_MUL:
        MOE_ARG_CHECK(a->n % 2 == 0, "simt_ref: n = %d must be even for SILU_MUL", a->n);
        return launch<MOE_GEMM_EPI_SILU_MUL>(a, a->n / 2, s);
    case MOE_GEMM_EPI_GELU_MUL:
        MOE_ARG_CHECK(a->n % 2 == 0, "simt_ref: n = %d must be even for GELU_MUL", a->n);
        return launch<MOE_GEMM_EPI_GELU_MUL>(a, a->n / 2, s);
    default:
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "simt_ref: epilogue %d", (int)a->epilogue);
    }
}

const moe_gemm_variant_t simt_variant = {"simt_ref",     80,          BR, 0, MOE_DTYPE_BF16,
                                         MOE_SCALE_NONE, simt_launch, 0};

} /* namespace */

extern "C" const moe_gemm_variant_t *moe_gemm_simple_variant(void)
{
    return &simt_variant;
}
