/* SPDX-License-Identifier: Apache-2.0 */
/* Routing kernels: router logits (bf16 tensor cores on a three-way split of the f32 weight, or
 * blocked SIMT f32) and fused top-k scoring. */
#include "kernels/route.h"

#include <cuda_bf16.h>
#include <math.h>
#include "kernels/cuda/aligned.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_cache.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/route_topk.cuh"
#include "kernels/cuda/vec8.cuh"

namespace
{

/* ---- logits ------------------------------------------------------------------------------ */

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v)
{
    return v;
}
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v)
{
    return __bfloat162float(v);
}

/* Few tokens: one warp per weight row, GEMV_TOKENS tokens at a time. The weight row streams
 * once per token chunk; lanes own strided columns and reduce by a fixed shuffle tree. */
constexpr int GEMV_TOKENS = 8;
constexpr int GEMV_MAX_TOKENS = 32;
constexpr int GEMV_WARPS = 4;

template <typename T>
__global__ void logits_gemv_kernel(const T *__restrict__ x, const float *__restrict__ w,
                                   float *__restrict__ logits, int num_tokens, int num_rows,
                                   int hidden)
{
    moe_pdl_wait();
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (r >= num_rows)
        return;
    const float *wr = w + (size_t)r * hidden;
    for (int t0 = 0; t0 < num_tokens; t0 += GEMV_TOKENS) {
        float acc[GEMV_TOKENS];
#pragma unroll
        for (int i = 0; i < GEMV_TOKENS; i++)
            acc[i] = 0.0f;
        for (int h = lane; h < hidden; h += 32) {
            const float wv = wr[h];
#pragma unroll
            for (int i = 0; i < GEMV_TOKENS; i++)
                if (t0 + i < num_tokens)
                    acc[i] += wv * to_f32(x[(size_t)(t0 + i) * hidden + h]);
        }
#pragma unroll
        for (int i = 0; i < GEMV_TOKENS; i++) {
            float v = acc[i];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0 && t0 + i < num_tokens)
                logits[(size_t)(t0 + i) * num_rows + r] = v;
        }
    }
}

/* Many tokens: 32 tokens x 64 rows per block, k in steps of 32 through shared memory, 2 x 4
 * outputs per thread; each output sums its k sequentially (fixed order). */
constexpr int TM = 32, TN = 64, TK = 32;

template <typename T>
__global__ void __launch_bounds__(256)
    logits_tiled_kernel(const T *__restrict__ x, const float *__restrict__ w,
                        float *__restrict__ logits, int num_tokens, int num_rows, int hidden)
{
    moe_pdl_wait();
    __shared__ float xs[TM][TK + 1];
    __shared__ float ws[TN][TK + 1];
    const int tid = threadIdx.x;
    const int ty = tid / 16, tx = tid % 16;
    const int t0 = blockIdx.x * TM, r0 = blockIdx.y * TN;
    float acc[2][4] = {};

    for (int k0 = 0; k0 < hidden; k0 += TK) {
#pragma unroll
        for (int i = 0; i < (TM * TK) / 256; i++) {
            const int idx = tid + i * 256, m = idx / TK, kk = idx % TK;
            const int t = t0 + m, k = k0 + kk;
            xs[m][kk] = (t < num_tokens && k < hidden) ? to_f32(x[(size_t)t * hidden + k]) : 0.0f;
        }
#pragma unroll
        for (int i = 0; i < (TN * TK) / 256; i++) {
            const int idx = tid + i * 256, n = idx / TK, kk = idx % TK;
            const int r = r0 + n, k = k0 + kk;
            ws[n][kk] = (r < num_rows && k < hidden) ? w[(size_t)r * hidden + k] : 0.0f;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < TK; kk++) {
            const float a0 = xs[ty * 2][kk], a1 = xs[ty * 2 + 1][kk];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const float b = ws[tx + 16 * j][kk];
                acc[0][j] += a0 * b;
                acc[1][j] += a1 * b;
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int t = t0 + ty * 2 + i, r = r0 + tx + 16 * j;
            if (t < num_tokens && r < num_rows)
                logits[(size_t)t * num_rows + r] = acc[i][j];
        }
}

/* The main path (hidden a multiple of 8, 16-byte aligned rows): BLK_ROWS rows x BLK_TOK tokens
 * per block; the block's warps split hidden into 256-wide chunks (32 lanes x 8 values, 16-byte
 * loads, a dozen in flight per lane). Each output is summed lane-sequentially, then by a fixed
 * shuffle tree, then over warps in order: the same order at every token count. */
constexpr int BLK_ROWS = 8, BLK_TOK = 8, BLK_WARPS = 8, BLK_MAX_GROUPS = 8;

template <typename T>
__global__ void __launch_bounds__(BLK_WARPS * 32)
    logits_blk_kernel(const T *__restrict__ x, const float *__restrict__ w,
                      float *__restrict__ logits, int num_tokens, int num_rows, int hidden,
                      int groups)
{
    moe_pdl_wait();
    __shared__ float red[BLK_WARPS][BLK_ROWS * BLK_TOK];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = blockIdx.y * BLK_ROWS, nr = min(BLK_ROWS, num_rows - r0);
    /* `groups` groups of BLK_TOK tokens per block, one after another: the block's weight rows
     * come from L1 after the first group instead of from L2 per group. The order of every sum
     * is the group's own, so the result does not depend on the grouping. */
    for (int g = 0; g < groups; g++) {
        const int t0 = (blockIdx.x * groups + g) * BLK_TOK;
        if (t0 >= num_tokens)
            break;
        const int ntk = min(BLK_TOK, num_tokens - t0);
        float acc[BLK_ROWS][BLK_TOK];
#pragma unroll
        for (int i = 0; i < BLK_ROWS; i++)
#pragma unroll
            for (int j = 0; j < BLK_TOK; j++)
                acc[i][j] = 0.0f;

        for (int base = (warp * 32 + lane) * 8; base < hidden; base += BLK_WARPS * 256) {
            float xv[BLK_TOK][8];
#pragma unroll
            for (int j = 0; j < BLK_TOK; j++) {
                if (j < ntk) {
                    moe_load8(x + (size_t)(t0 + j) * hidden + base, xv[j]);
                } else {
#pragma unroll
                    for (int q = 0; q < 8; q++)
                        xv[j][q] = 0.0f;
                }
            }
#pragma unroll
            for (int i = 0; i < BLK_ROWS; i++) {
                if (i < nr) {
                    float wv[8];
                    moe_load8(w + (size_t)(r0 + i) * hidden + base, wv);
#pragma unroll
                    for (int j = 0; j < BLK_TOK; j++)
#pragma unroll
                        for (int q = 0; q < 8; q++)
                            acc[i][j] += wv[q] * xv[j][q];
                }
            }
        }
#pragma unroll
        for (int i = 0; i < BLK_ROWS; i++)
#pragma unroll
            for (int j = 0; j < BLK_TOK; j++) {
                float v = acc[i][j];
#pragma unroll
                for (int o = 16; o > 0; o >>= 1)
                    v += __shfl_xor_sync(0xffffffffu, v, o);
                if (lane == 0)
                    red[warp][i * BLK_TOK + j] = v;
            }
        __syncthreads();
        if (threadIdx.x < BLK_ROWS * BLK_TOK) {
            const int i = threadIdx.x / BLK_TOK, j = threadIdx.x % BLK_TOK;
            if (i < nr && j < ntk) {
                float v = 0.0f;
#pragma unroll
                for (int k = 0; k < BLK_WARPS; k++)
                    v += red[k][threadIdx.x];
                logits[(size_t)(t0 + j) * num_rows + r0 + i] = v;
            }
        }
        __syncthreads(); /* red is reused by the next group */
    }
}

/* Tensor-core path: x against w given as three bf16 planes (w = hi + mid + lo exactly,
 * moe_split_bf16x3), mma.sync m16n8k16 with f32 accumulation. bf16 x times each plane is exact,
 * so the three products make an f32 dot product with another summation order. f32 x is split
 * the same way as it is loaded, and the six products whose planes sum to at most 2^-16 of the
 * leading one are taken (the three dropped ones are below f32 rounding, 2^-24 relative).
 * A block holds MT x 16 tokens by NT x 8 rows. Its TC_WARPS warps split hidden into
 * TC_KC-wide chunks (warp w: chunks w, w + TC_WARPS, ...) and the block then sums the warps'
 * partials in warp order. A lane loads 16 contiguous values of a row and gives them to four
 * mmas as its k slots {2c, 2c+1, 2c+8, 2c+9}: A and B use the same permutation of k, so each mma
 * adds an exact sub-sum of the dot product. For one output the sequence of operations depends
 * on hidden only, never on the tile shape or the token count: a token's logits are bitwise the
 * same in every batch. */
constexpr int TC_WARPS = 8, TC_KC = 64;

__device__ __forceinline__ void mma_bf16_16816(float *d, uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1)
{
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* 16 bf16 at p (two 16-byte loads; either may be out of range: zeros) as eight words. */
__device__ __forceinline__ void load16_words(const uint16_t *p, bool ok0, bool ok1, uint32_t *w)
{
    const uint4 z = make_uint4(0u, 0u, 0u, 0u);
    const uint4 u0 = ok0 ? __ldg(reinterpret_cast<const uint4 *>(p)) : z;
    const uint4 u1 = ok1 ? __ldg(reinterpret_cast<const uint4 *>(p + 8)) : z;
    w[0] = u0.x, w[1] = u0.y, w[2] = u0.z, w[3] = u0.w;
    w[4] = u1.x, w[5] = u1.y, w[6] = u1.z, w[7] = u1.w;
}

/* The top 16 bits of v (a bf16 by truncation), in place in an f32's bits. */
__device__ __forceinline__ uint32_t top16(float v)
{
    return __float_as_uint(v) & 0xffff0000u;
}

/* 16 f32 at p (either half may be out of range: zeros) split exactly as moe_split_bf16x3 does,
 * as eight words per plane: w[0] hi, w[1] mid, w[2] lo. */
__device__ __forceinline__ void load16_words(const float *p, bool ok0, bool ok1, uint32_t (*w)[8])
{
    const float4 z = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 f[4];
    f[0] = ok0 ? __ldg(reinterpret_cast<const float4 *>(p)) : z;
    f[1] = ok0 ? __ldg(reinterpret_cast<const float4 *>(p) + 1) : z;
    f[2] = ok1 ? __ldg(reinterpret_cast<const float4 *>(p) + 2) : z;
    f[3] = ok1 ? __ldg(reinterpret_cast<const float4 *>(p) + 3) : z;
    const float *v = reinterpret_cast<const float *>(f);
#pragma unroll
    for (int i = 0; i < 8; i++) {
        uint32_t part[2][3];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            const float x = v[2 * i + e];
            const uint32_t h = top16(x);
            const float r1 = x - __uint_as_float(h);
            const uint32_t m = top16(r1);
            part[e][0] = h, part[e][1] = m, part[e][2] = top16(r1 - __uint_as_float(m));
        }
#pragma unroll
        for (int q = 0; q < 3; q++) /* element 2i in the low half, as in memory */
            w[q][i] = (part[0][q] >> 16) | part[1][q];
    }
}

/* x planes held per value: 1 for bf16 x, 3 (hi, mid, lo) for f32 x. */
template <typename XT> struct x_planes {
    static constexpr int n = sizeof(XT) == 4 ? 3 : 1;
};

/* The products of one k slice, smallest first: bf16 x: (x, w_lo), (x, w_mid), (x, w_hi); f32
 * x: every (x_p, w_q) with p + q <= 2, by falling p + q. With one w plane (wp = 1: w_mid = w_lo
 * = 0) the same sequence without its zero products: (x, w_hi), or (x_lo, w_hi), (x_mid, w_hi),
 * (x_hi, w_hi). */
__device__ __forceinline__ constexpr int n_terms(int xp, int wp)
{
    return xp == 3 ? (wp == 3 ? 6 : 3) : wp;
}
__device__ __forceinline__ constexpr int term_x(int xp, int wp, int i)
{
    return xp == 3 ? (wp == 1 ? 2 - i : i == 0 ? 2 : i == 1 ? 1 : i == 3 ? 1 : 0) : 0;
}
__device__ __forceinline__ constexpr int term_w(int xp, int wp, int i)
{
    return wp == 1 ? 0 : xp == 3 ? (i == 1 ? 1 : i == 2 ? 2 : i == 4 ? 1 : 0) : 2 - i;
}

template <typename XT, int MT, int NT, int WP>
__global__ void __launch_bounds__(TC_WARPS * 32)
    logits_tc_kernel(const XT *__restrict__ x, const uint16_t *__restrict__ w3,
                     float *__restrict__ logits, int num_tokens, int num_rows, int hidden)
{
    moe_pdl_wait();
    constexpr int XP = x_planes<XT>::n, TERMS = n_terms(XP, WP);
    __shared__ float red[TC_WARPS][16][NT * 8 + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int t0 = blockIdx.x * MT * 16, r0 = blockIdx.y * NT * 8;
    const size_t plane = (size_t)num_rows * hidden;
    /* The small tiles (MT x NT <= 2) of a step with one token tile (decode: up to 16 tokens,
     * few CTAs): the warp's whole share of the weights asked of the L2 first, so the k loop's
     * loads, two chunks in flight at a time, wait for the L2 rather than one DRAM round trip per
     * pair of chunks (hidden / 1024 of them: 7 for DeepSeek-V3). With more token tiles every
     * one would ask for the same weights, and other CTAs hide the chain. The same values and
     * sums; measured in bench/RESULTS.md, "Fused decode (one kernel), one H200". */
    if (MT * NT <= 2 && gridDim.x == 1)
        for (int k0 = warp * TC_KC; k0 < hidden; k0 += TC_WARPS * TC_KC) {
            const int k = k0 + 16 * c;
#pragma unroll
            for (int n = 0; n < NT; n++) {
                const int r = r0 + n * 8 + g;
                if (k < hidden && r < num_rows)
#pragma unroll
                    for (int p = 0; p < WP; p++)
                        asm volatile("prefetch.global.L2 [%0];" ::"l"(w3 + p * plane +
                                                                      (size_t)r * hidden + k));
            }
        }
    float acc[MT][NT][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int q = 0; q < 4; q++)
                acc[m][n][q] = 0.0f;

#pragma unroll(MT *NT <= 2 ? 2 : 1)
    for (int k0 = warp * TC_KC; k0 < hidden; k0 += TC_WARPS * TC_KC) {
        const int k = k0 + 16 * c;
        const bool ok0 = k < hidden, ok1 = k + 8 < hidden;
        uint32_t a[MT][2][XP][8]; /* [m tile][token g, g + 8][x plane][word] */
#pragma unroll
        for (int m = 0; m < MT; m++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int t = t0 + m * 16 + g + 8 * h;
                const bool tv = t < num_tokens;
                const XT *p = x + (size_t)(tv ? t : 0) * hidden + k;
                if constexpr (XP == 3)
                    load16_words(p, tv && ok0, tv && ok1, a[m][h]);
                else
                    load16_words(reinterpret_cast<const uint16_t *>(p), tv && ok0, tv && ok1,
                                 a[m][h][0]);
            }
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const int r = r0 + n * 8 + g;
            const bool rv = r < num_rows;
            const uint16_t *q = w3 + (size_t)(rv ? r : 0) * hidden + k;
            uint32_t b[WP][8];
#pragma unroll
            for (int p = 0; p < WP; p++)
                load16_words(q + p * plane, rv && ok0, rv && ok1, b[p]);
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int i = 0; i < TERMS; i++) {
                    const int px = term_x(XP, WP, i), pw = term_w(XP, WP, i);
#pragma unroll
                    for (int m = 0; m < MT; m++)
                        mma_bf16_16816(acc[m][n], a[m][0][px][2 * j], a[m][1][px][2 * j],
                                       a[m][0][px][2 * j + 1], a[m][1][px][2 * j + 1], b[pw][2 * j],
                                       b[pw][2 * j + 1]);
                }
        }
    }

#pragma unroll
    for (int m = 0; m < MT; m++) {
#pragma unroll
        for (int n = 0; n < NT; n++) {
            red[warp][g][n * 8 + 2 * c] = acc[m][n][0];
            red[warp][g][n * 8 + 2 * c + 1] = acc[m][n][1];
            red[warp][g + 8][n * 8 + 2 * c] = acc[m][n][2];
            red[warp][g + 8][n * 8 + 2 * c + 1] = acc[m][n][3];
        }
        __syncthreads();
        for (int i = threadIdx.x; i < 16 * NT * 8; i += TC_WARPS * 32) {
            const int row = i / (NT * 8), col = i % (NT * 8);
            const int t = t0 + m * 16 + row, r = r0 + col;
            if (t < num_tokens && r < num_rows) {
                float v = 0.0f;
#pragma unroll
                for (int w = 0; w < TC_WARPS; w++)
                    v += red[w][row][col];
                logits[(size_t)t * num_rows + r] = v;
            }
        }
        __syncthreads(); /* red is reused by the next m tile */
    }
}

template <typename XT, int MT, int NT, int WP>
cudaError_t launch_tc(const moe_route_logits_args_t *a, cudaStream_t s)
{
    const int nt = (int)a->num_tokens;
    dim3 grid((nt + MT * 16 - 1) / (MT * 16), (a->num_rows + NT * 8 - 1) / (NT * 8));
    return moe_launch((logits_tc_kernel<XT, MT, NT, WP>), grid, dim3(TC_WARPS * 32), 0, s,
                      (const XT *)a->x, a->w_split, a->logits, nt, a->num_rows, a->hidden);
}

/* The largest tile that still gives a wave of blocks (more rows and tokens per block: less L2
 * traffic), else the smallest; NT = 1 when there are at most 8 rows; f32 x (three planes in
 * registers) at most two m tiles. */
template <typename XT>
moe_status_t launch_logits_tc(const moe_route_logits_args_t *a, cudaStream_t s, int sms)
{
    static const int tiles[][2] = {{4, 4}, {2, 4}, {4, 1}, {1, 4}, {2, 1}, {1, 1}};
    const int64_t want = sms > 0 ? sms : 132;
    int i, pick = 5;
    for (i = 0; i < 5; i++) {
        const int mt = tiles[i][0], ntl = tiles[i][1];
        if ((ntl > 1 && a->num_rows <= 8) || (mt > 2 && x_planes<XT>::n > 1))
            continue;
        if ((a->num_tokens + mt * 16 - 1) / (mt * 16) * ((a->num_rows + ntl * 8 - 1) / (ntl * 8)) >=
            want) {
            pick = i;
            break;
        }
    }
    /* f32 x never picks MT = 4 (skipped above): its entries are the MT = 2 kernels */
    constexpr int MT4 = x_planes<XT>::n == 1 ? 4 : 2;
    static cudaError_t (*const launch[2][6])(const moe_route_logits_args_t *, cudaStream_t) = {
        {launch_tc<XT, MT4, 4, 3>, launch_tc<XT, 2, 4, 3>, launch_tc<XT, MT4, 1, 3>,
         launch_tc<XT, 1, 4, 3>, launch_tc<XT, 2, 1, 3>, launch_tc<XT, 1, 1, 3>},
        {launch_tc<XT, MT4, 4, 1>, launch_tc<XT, 2, 4, 1>, launch_tc<XT, MT4, 1, 1>,
         launch_tc<XT, 1, 4, 1>, launch_tc<XT, 2, 1, 1>, launch_tc<XT, 1, 1, 1>}};
    MOE_CUDA_CHECK(launch[a->w_split_planes == 1][pick](a, s));
    MOE_CUDA_CHECK_LAUNCH("logits_tc_kernel");
    return MOE_STATUS_SUCCESS;
}

template <typename T> moe_status_t launch_logits(const moe_route_logits_args_t *a, cudaStream_t s)
{
    const T *x = (const T *)a->x;
    const int nt = (int)a->num_tokens;
    if (a->hidden % 8 == 0 && moe_aligned16(a->x) && moe_aligned16(a->w)) {
        static int sms_cache[MOE_MAX_DEVICES];
        int dev = 0;
        MOE_CUDA_CHECK(cudaGetDevice(&dev));
        const int sms = moe_device_cached(sms_cache, dev, [](int d) {
            int n = 0;
            return cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, d) == cudaSuccess ? n
                                                                                                : 0;
        });
        if (a->w_split && moe_aligned16(a->w_split))
            return launch_logits_tc<T>(a, s, sms);
        /* token groups per block: enough blocks for about two waves of 8 per SM, no more */
        const int64_t row_blocks = (a->num_rows + BLK_ROWS - 1) / BLK_ROWS;
        const int64_t blocks1 = (int64_t)((nt + BLK_TOK - 1) / BLK_TOK) * row_blocks;
        const int64_t want = 16 * (int64_t)(sms > 0 ? sms : 132);
        const int groups = (int)(blocks1 / want < 1                ? 1
                                 : blocks1 / want > BLK_MAX_GROUPS ? BLK_MAX_GROUPS
                                                                   : blocks1 / want);
        dim3 grid((nt + BLK_TOK * groups - 1) / (BLK_TOK * groups), (unsigned)row_blocks);
        MOE_CUDA_CHECK(moe_launch((logits_blk_kernel<T>), grid, dim3(BLK_WARPS * 32), 0, s, x, a->w,
                                  a->logits, nt, a->num_rows, a->hidden, groups));
        MOE_CUDA_CHECK_LAUNCH("logits_blk_kernel");
    } else if (nt <= GEMV_MAX_TOKENS) {
        dim3 grid((a->num_rows + GEMV_WARPS - 1) / GEMV_WARPS);
        MOE_CUDA_CHECK(moe_launch((logits_gemv_kernel<T>), dim3(grid), dim3(GEMV_WARPS * 32), 0, s,
                                  x, a->w, a->logits, nt, a->num_rows, a->hidden));
        MOE_CUDA_CHECK_LAUNCH("logits_gemv_kernel");
    } else {
        dim3 grid((nt + TM - 1) / TM, (a->num_rows + TN - 1) / TN);
        MOE_CUDA_CHECK(moe_launch((logits_tiled_kernel<T>), dim3(grid), dim3(256), 0, s, x, a->w,
                                  a->logits, nt, a->num_rows, a->hidden));
        MOE_CUDA_CHECK_LAUNCH("logits_tiled_kernel");
    }
    return MOE_STATUS_SUCCESS;
}

/* ---- scoring + top-k: one warp per token ------------------------------------------------- */

constexpr int ROUTE_WARPS = 4;

/* One warp per token (route_topk.cuh). */
template <int NPL>
__global__ void __launch_bounds__(ROUTE_WARPS * 32)
    route_topk_kernel(const float *__restrict__ logits, const float *__restrict__ bias,
                      int32_t *__restrict__ topk_ids, float *__restrict__ topk_weights,
                      int num_tokens, route_kparams p)
{
    moe_pdl_wait();
    __shared__ float choice_sm[ROUTE_WARPS][NPL * 32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t = blockIdx.x * ROUTE_WARPS + warp;
    if (t >= num_tokens)
        return;
    route_topk_token<NPL>(logits, bias, topk_ids, topk_weights, t, p, lane, choice_sm[warp], NULL);
}

template <int NPL> moe_status_t launch_topk(const moe_route_args_t *a, cudaStream_t s)
{
    const route_kparams p = route_kparams_of(&a->params);
    const int nt = (int)a->num_tokens;
    MOE_CUDA_CHECK(moe_launch((route_topk_kernel<NPL>), dim3((nt + ROUTE_WARPS - 1) / ROUTE_WARPS),
                              dim3(ROUTE_WARPS * 32), 0, s, a->logits, a->bias, a->topk_ids,
                              a->topk_weights, nt, p));
    MOE_CUDA_CHECK_LAUNCH("route_topk_kernel");
    return MOE_STATUS_SUCCESS;
}

__global__ void __launch_bounds__(256)
    route_given_kernel(const int32_t *__restrict__ in_ids, const float *__restrict__ in_w,
                       int32_t *out_ids, float *out_w, int64_t n, int num_experts, int32_t *flag,
                       int32_t bad_id, int32_t bad_weight)
{
    moe_pdl_wait();
    int32_t code = 0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (int64_t)gridDim.x * blockDim.x) {
        int32_t id = in_ids[i];
        float w = in_w[i];
        if (id < 0 || id >= num_experts) {
            code = bad_id;
            id = 0, w = 0.0f;
        } else if (!isfinite(w)) {
            code = code ? code : bad_weight;
            w = 0.0f;
        }
        out_ids[i] = id;
        out_w[i] = w;
    }
    if (code)
        *flag = code;
}

} /* namespace */

extern "C" moe_status_t moe_route_given_launch(const moe_route_given_args_t *a, void *stream)
{
    const int64_t n = a->num_tokens * a->top_k;
    const int64_t blocks = (n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024;
    MOE_ARG_CHECK(a->num_tokens >= 0 && a->top_k >= 1 && a->num_experts >= 1,
                  "route given: num_tokens = %lld, top_k = %d, num_experts = %d",
                  (long long)a->num_tokens, a->top_k, a->num_experts);
    if (n == 0)
        return MOE_STATUS_SUCCESS;
    MOE_CUDA_CHECK(moe_launch(route_given_kernel, dim3((unsigned)blocks), dim3(256), 0,
                              (cudaStream_t)stream, a->given_ids, a->given_weights, a->topk_ids,
                              a->topk_weights, n, a->num_experts, a->flag, a->bad_id_code,
                              a->bad_weight_code));
    MOE_CUDA_CHECK_LAUNCH("route_given_kernel");
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_route_logits_launch(const moe_route_logits_args_t *a, void *stream)
{
    MOE_ARG_CHECK(a->num_tokens >= 0 && a->num_tokens <= INT32_MAX,
                  "route logits: num_tokens = %lld", (long long)a->num_tokens);
    MOE_ARG_CHECK(a->num_rows > 0 && a->hidden > 0, "route logits: rows = %d, hidden = %d",
                  a->num_rows, a->hidden);
    if (a->num_tokens == 0)
        return MOE_STATUS_SUCCESS;
    switch (a->x_dtype) {
    case MOE_DTYPE_F32:
        return launch_logits<float>(a, (cudaStream_t)stream);
    case MOE_DTYPE_BF16:
        return launch_logits<__nv_bfloat16>(a, (cudaStream_t)stream);
    default:
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "route logits: x dtype %s (F32 or BF16)",
                         moe_dtype_name(a->x_dtype));
    }
}

template <typename T, int MT4, int WP> moe_status_t prepare_tc()
{
    MOE_CUDA_PREPARE((logits_tc_kernel<T, MT4, 4, WP>));
    MOE_CUDA_PREPARE((logits_tc_kernel<T, 2, 4, WP>));
    MOE_CUDA_PREPARE((logits_tc_kernel<T, MT4, 1, WP>));
    MOE_CUDA_PREPARE((logits_tc_kernel<T, 1, 4, WP>));
    MOE_CUDA_PREPARE((logits_tc_kernel<T, 2, 1, WP>));
    MOE_CUDA_PREPARE((logits_tc_kernel<T, 1, 1, WP>));
    return MOE_STATUS_SUCCESS;
}

template <typename T> moe_status_t prepare_logits()
{
    constexpr int MT4 = x_planes<T>::n == 1 ? 4 : 2; /* the tiles launch_logits_tc picks from */
    MOE_CUDA_PREPARE(logits_gemv_kernel<T>);
    MOE_CUDA_PREPARE(logits_tiled_kernel<T>);
    MOE_CUDA_PREPARE(logits_blk_kernel<T>);
    MOE_CHECK((prepare_tc<T, MT4, 3>()));
    return prepare_tc<T, MT4, 1>();
}

extern "C" moe_status_t moe_route_prepare(void)
{
    MOE_CHECK(prepare_logits<float>());
    MOE_CHECK(prepare_logits<__nv_bfloat16>());
    MOE_CUDA_PREPARE(route_topk_kernel<1>);
    MOE_CUDA_PREPARE(route_topk_kernel<2>);
    MOE_CUDA_PREPARE(route_topk_kernel<4>);
    MOE_CUDA_PREPARE(route_topk_kernel<8>);
    MOE_CUDA_PREPARE(route_topk_kernel<16>);
    MOE_CUDA_PREPARE(route_given_kernel);
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_route_check(const moe_route_args_t *a)
{
    const moe_route_params_t *p = &a->params;
    const int E = p->num_experts;

    MOE_ARG_CHECK(a->num_tokens >= 0 && a->num_tokens <= INT32_MAX, "route: num_tokens = %lld",
                  (long long)a->num_tokens);
    MOE_ARG_CHECK(p->top_k >= 1 && p->top_k <= E, "route: top_k = %d with %d experts", p->top_k, E);
    if (E > MOE_ROUTE_MAX_EXPERTS || p->top_k > MOE_ROUTE_MAX_TOP_K)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "route: num_experts = %d, top_k = %d (the CUDA kernel handles up to "
                         "%d experts and top_k %d)",
                         E, p->top_k, MOE_ROUTE_MAX_EXPERTS, MOE_ROUTE_MAX_TOP_K);
    if (p->n_group > 1) {
        MOE_ARG_CHECK(E % p->n_group == 0, "route: n_group = %d does not divide %d experts",
                      p->n_group, E);
        MOE_ARG_CHECK(p->topk_group >= 1 && p->topk_group <= p->n_group,
                      "route: topk_group = %d with n_group = %d", p->topk_group, p->n_group);
        MOE_ARG_CHECK(p->top_k <= p->topk_group * (E / p->n_group),
                      "route: top_k = %d exceeds the experts of %d groups", p->top_k,
                      p->topk_group);
        if (p->n_group > MOE_ROUTE_MAX_GROUPS)
            return moe_error(MOE_STATUS_NOT_SUPPORTED, "route: n_group = %d (at most %d)",
                             p->n_group, MOE_ROUTE_MAX_GROUPS);
    }
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_route_launch(const moe_route_args_t *a, void *stream)
{
    const cudaStream_t s = (cudaStream_t)stream;
    const int E = a->params.num_experts;

    MOE_CHECK(moe_route_check(a));
    if (a->num_tokens == 0)
        return MOE_STATUS_SUCCESS;
    return route_with_npl(E, [&](auto npl) { return launch_topk<decltype(npl)::value>(a, s); });
}
