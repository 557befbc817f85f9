/* SPDX-License-Identifier: Apache-2.0 */
/* The rounds of an expert-parallel step (moe.h, moe_layer_config_t.ep_round_tokens): pure
 * arithmetic, shared by the CUDA backend and its unit test. A step of m rows per rank (every
 * rank the same m) runs in rounds of at most R rows per rank; round i covers rows
 * [i R, i R + m_i) of every rank's step, and a rank with T <= m tokens brings the part of
 * [0, T) that falls there. */
#ifndef MOE_EP_ROUNDS_H
#define MOE_EP_ROUNDS_H

#include <stdint.h>

/* R: `asked` where given (1..cap), else max(ceil(cap / world), min(cap, 256)), so that world x
 * R rows stay about one capacity, with rounds of at least 256 tokens where the capacity allows. */
static inline int64_t moe_ep_round_tokens(int64_t cap, int world, int64_t asked)
{
    const int64_t least = cap < 256 ? cap : 256;
    const int64_t share = (cap + world - 1) / (world > 0 ? world : 1);
    if (asked > 0)
        return asked;
    return share > least ? share : least;
}

/* Rounds of a step of m rows per rank (m >= 1). */
static inline int64_t moe_ep_rounds(int64_t m, int64_t R)
{
    return (m + R - 1) / R;
}

/* Rows per rank of round i: m_i = min(R, m - i R). */
static inline int64_t moe_ep_round_rows(int64_t m, int64_t R, int64_t i)
{
    return m - i * R < R ? m - i * R : R;
}

/* This rank's tokens in round i (T <= m): min(max(T - i R, 0), m_i); they start at token i R. */
static inline int64_t moe_ep_round_tokens_here(int64_t T, int64_t m, int64_t R, int64_t i)
{
    const int64_t left = T - i * R, mi = moe_ep_round_rows(m, R, i);
    return left <= 0 ? 0 : left < mi ? left : mi;
}

#endif /* MOE_EP_ROUNDS_H */
