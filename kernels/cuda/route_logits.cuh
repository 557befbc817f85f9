/* SPDX-License-Identifier: Apache-2.0 */
/* Router logits on tensor cores, one warp's share: the logits kernel's body (route.cu), shared
 * with the fused decode kernel (decode_sm90.cu), which so computes the same bits. */
#ifndef MOE_ROUTE_LOGITS_CUH
#define MOE_ROUTE_LOGITS_CUH

#include <stddef.h>
#include <stdint.h>

namespace
{

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

/* Warp w's partial sums of a tile of MT x 16 tokens (from t0) by NT x 8 rows (from r0): its k
 * chunks w, w + TC_WARPS, ... (TC_KC wide), in that order. acc[m][n]: tokens t0 + 16 m + g
 * (0, 1) and + 8 (2, 3), rows r0 + 8 n + 2 c (0, 2) and + 1 (1, 3) (g = lane / 4, c = lane % 4).
 * The logit is the sum of the TC_WARPS partials in w order, from 0.0f. prefetch: the warp's
 * whole share of the weights asked of the L2 first (the same values). */
template <typename XT, int MT, int NT, int WP>
__device__ __forceinline__ void logits_tc_warp(const XT *__restrict__ x,
                                               const uint16_t *__restrict__ w3, int num_tokens,
                                               int num_rows, int hidden, int t0, int r0, int w,
                                               bool prefetch, float (&acc)[MT][NT][4])
{
    constexpr int XP = x_planes<XT>::n, TERMS = n_terms(XP, WP);
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const size_t plane = (size_t)num_rows * hidden;
    if (prefetch)
        for (int k0 = w * TC_KC; k0 < hidden; k0 += TC_WARPS * TC_KC) {
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
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int q = 0; q < 4; q++)
                acc[m][n][q] = 0.0f;

#pragma unroll(MT *NT <= 2 ? 2 : 1)
    for (int k0 = w * TC_KC; k0 < hidden; k0 += TC_WARPS * TC_KC) {
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
}

} /* namespace */

#endif /* MOE_ROUTE_LOGITS_CUH */
