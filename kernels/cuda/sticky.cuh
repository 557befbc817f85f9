/* SPDX-License-Identifier: Apache-2.0 */
/* The one way a kernel finds a step's first failing rank and records it in the sticky verdict
 * word (kernels/a2a.h: (rank << 8) | status, and the bits the all-to-all's kernels OR in). */
#ifndef MOE_STICKY_CUH
#define MOE_STICKY_CUH

#include <stdint.h>

/* The first r < n whose flags[r] is nonzero (-1: none, or flags NULL). With `record` (one thread
 * of the grid) it goes into *sticky (when not NULL) as (r << 8) | (flags[r] & 0xff), unless a
 * failure is there already: a compare-and-swap, since other kernels of the step (another
 * lane's) may set the word's bits at the same time. */
__device__ __forceinline__ int moe_first_failure(const int32_t *flags, int n, int32_t *sticky,
                                                 bool record)
{
    int bad = -1;
    for (int r = 0; flags && r < n && bad < 0; r++)
        if (flags[r])
            bad = r;
    if (record && bad >= 0 && sticky)
        atomicCAS(sticky, 0, (bad << 8) | (flags[bad] & 0xff));
    return bad;
}

/* A failure of rank s: (s << 8) | code when no failure came before, and `bit` always (the flag
 * bits above the rank: kernels/a2a.h, kernels/decode.h). sticky may be NULL. */
__device__ __forceinline__ void moe_sticky_mark(int32_t *sticky, int s, int32_t code, int32_t bit)
{
    if (!sticky)
        return;
    atomicCAS(sticky, 0, (s << 8) | code);
    atomicOr(sticky, bit);
}

/* The GPU's global timer, ns: the clock of the kernels' bounded waits. */
__device__ __forceinline__ int64_t moe_global_ns()
{
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return (int64_t)t;
}

#endif /* MOE_STICKY_CUH */
