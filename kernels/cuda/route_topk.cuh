/* SPDX-License-Identifier: Apache-2.0 */
/* Scoring and top-k of one token by one warp (softmax or sigmoid, grouped selection with a
 * bias, renormalisation, scaling): the route kernel's body, shared with the small-step
 * route + permute kernel (permute.cu). */
#ifndef MOE_ROUTE_TOPK_CUH
#define MOE_ROUTE_TOPK_CUH

#include <math.h>
#include <stdint.h>
#include <type_traits>
#include "kernels/route.h"

namespace
{

struct route_kparams {
    int num_experts, top_k, scoring, use_bias, n_group, topk_group, renormalize;
    float scaling;
};

/* f(std::integral_constant<int, NPL>) with NPL the experts per lane E needs (E <= 512): the
 * one place that picks the top-k instantiation. */
template <typename F> static inline auto route_with_npl(int E, F f)
{
    if (E <= 32)
        return f(std::integral_constant<int, 1>{});
    if (E <= 64)
        return f(std::integral_constant<int, 2>{});
    if (E <= 128)
        return f(std::integral_constant<int, 4>{});
    if (E <= 256)
        return f(std::integral_constant<int, 8>{});
    return f(std::integral_constant<int, 16>{});
}

static inline route_kparams route_kparams_of(const moe_route_params_t *q)
{
    const route_kparams p = {q->num_experts, q->top_k,      (int)q->scoring, q->use_bias,
                             q->n_group,     q->topk_group, q->renormalize,  q->scaling};
    return p;
}

/* A float as an unsigned key that orders as the value does, for the warp's max reduction
 * (redux.sync): +0 and -0 alike, NaN below every number; 0 is no key (no candidate). */
__device__ __forceinline__ uint32_t order_key(float v)
{
    if (v != v)
        return 1u;
    const uint32_t u = __float_as_uint(v == 0.0f ? 0.0f : v);
    return (u >> 31) ? ~u : u | 0x80000000u;
}

/* The warp's best candidate: the lane's key (0: none) and id; the largest key, then the lowest
 * id, in two redux.sync (every lane gets the id; -1 when no lane has a candidate). */
__device__ __forceinline__ int warp_best(uint32_t key, int id)
{
    const uint32_t top = __reduce_max_sync(0xffffffffu, key);
    const uint32_t mine = top != 0u && key == top ? (uint32_t)id : 0xffffffffu;
    const uint32_t win = __reduce_min_sync(0xffffffffu, mine);
    return top == 0u ? -1 : (int)win;
}

/* NPL experts per lane: expert e = lane + 32 * i lives in register slot i of lane e % 32. One
 * warp scores token t (its E logits) and selects its top-k; lane 0 stores the ids and weights
 * (and the ids into sm_ids[0 .. K) when not NULL). choice_row: this warp's shared [NPL * 32]
 * floats (the grouped selection). */
template <int NPL>
__device__ __forceinline__ void
route_topk_token(const float *__restrict__ logits, const float *__restrict__ bias,
                 int32_t *__restrict__ topk_ids, float *__restrict__ topk_weights, int t,
                 route_kparams p, int lane, float *choice_row, int *sm_ids)
{
    const int E = p.num_experts, K = p.top_k;
    const float *l = logits + (size_t)t * E;
    float score[NPL], choice[NPL];
    unsigned allowed = 0; /* bit i: expert lane + 32 i may still be chosen */

#pragma unroll
    for (int i = 0; i < NPL; i++) {
        const int e = lane + 32 * i;
        score[i] = e < E ? l[e] : -INFINITY;
        if (e < E)
            allowed |= 1u << i;
    }
    if (p.scoring == MOE_SCORING_SOFTMAX) {
        float mx = -INFINITY, sum = 0.0f;
#pragma unroll
        for (int i = 0; i < NPL; i++)
            mx = fmaxf(mx, score[i]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
#pragma unroll
        for (int i = 0; i < NPL; i++) {
            score[i] = (allowed >> i) & 1u ? expf(score[i] - mx) : 0.0f;
            sum += score[i];
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
#pragma unroll
        for (int i = 0; i < NPL; i++)
            score[i] = score[i] / sum;
    } else {
#pragma unroll
        for (int i = 0; i < NPL; i++)
            score[i] = 1.0f / (1.0f + expf(-score[i]));
    }
#pragma unroll
    for (int i = 0; i < NPL; i++) {
        const int e = lane + 32 * i;
        choice[i] = score[i];
        if (p.scoring == MOE_SCORING_SIGMOID && p.use_bias && bias && e < E)
            choice[i] += bias[e];
    }

    if (p.n_group > 1) {
        /* Lane g scores group g (contiguous experts) by its two best choice values. */
        const int gsize = E / p.n_group;
#pragma unroll
        for (int i = 0; i < NPL; i++)
            choice_row[lane + 32 * i] = choice[i];
        __syncwarp();
        float gscore = -INFINITY;
        int gid = -1;
        if (lane < p.n_group) {
            float b1 = -INFINITY, b2 = -INFINITY;
            for (int e = lane * gsize; e < (lane + 1) * gsize; e++) {
                const float c = choice_row[e];
                if (c > b1) {
                    b2 = b1;
                    b1 = c;
                } else if (c > b2) {
                    b2 = c;
                }
            }
            gscore = gsize >= 2 ? b1 + b2 : b1;
            gid = lane;
        }
        unsigned kept = 0;
        uint32_t gkey = gid >= 0 ? order_key(gscore) : 0u;
        for (int j = 0; j < p.topk_group; j++) {
            const int id = warp_best(gkey, gid);
            kept |= 1u << id;
            if (lane == id)
                gkey = 0u; /* taken */
        }
#pragma unroll
        for (int i = 0; i < NPL; i++) {
            const int e = lane + 32 * i;
            if (e < E && !((kept >> (e / gsize)) & 1u))
                allowed &= ~(1u << i);
        }
    }

    /* each round: the lane's best allowed expert (ids grow with i: the first of equal keys is
     * the lower id), the warp's best of those, and the owner lane clears it and broadcasts its
     * unbiased score */
    uint32_t key[NPL];
#pragma unroll
    for (int i = 0; i < NPL; i++)
        key[i] = (allowed >> i) & 1u ? order_key(choice[i]) : 0u;
    int ids[MOE_ROUTE_MAX_TOP_K];
    float w[MOE_ROUTE_MAX_TOP_K];
    float wsum = 0.0f;
#pragma unroll
    for (int j = 0; j < MOE_ROUTE_MAX_TOP_K; j++) {
        ids[j] = -1;
        w[j] = 0.0f;
        if (j < K) {
            uint32_t bk = 0u;
            int bi = 0;
#pragma unroll
            for (int i = 0; i < NPL; i++)
                if (key[i] > bk) {
                    bk = key[i];
                    bi = i;
                }
            const int id = warp_best(bk, lane + 32 * bi);
            float s = 0.0f;
            if (id >= 0 && (id & 31) == lane) {
#pragma unroll
                for (int i = 0; i < NPL; i++)
                    if (lane + 32 * i == id) {
                        key[i] = 0u;
                        s = score[i];
                    }
            }
            s = __shfl_sync(0xffffffffu, s, id >= 0 ? (id & 31) : 0);
            ids[j] = id;
            w[j] = s;
            wsum += s;
        }
    }
    if (lane == 0) {
        const float denom = p.scoring == MOE_SCORING_SIGMOID ? wsum + 1e-20f : wsum;
        const int scale = p.scaling != 0.0f && p.scaling != 1.0f;
#pragma unroll
        for (int j = 0; j < MOE_ROUTE_MAX_TOP_K; j++) {
            if (j < K) {
                float v = w[j];
                if (p.renormalize)
                    v /= denom;
                if (scale)
                    v *= p.scaling;
                topk_ids[(size_t)t * K + j] = ids[j];
                topk_weights[(size_t)t * K + j] = v;
                if (sm_ids)
                    sm_ids[j] = ids[j];
            }
        }
    }
}

} /* namespace */

#endif /* MOE_ROUTE_TOPK_CUH */
