/* SPDX-License-Identifier: Apache-2.0 */
/* The local slot of logical expert e for the token at position `pos` (first_token + t + rank:
 * kernels/ep.h, moe_ep_slot_ids_args_t): e's replicas taken in turn. */
#ifndef MOE_SLOT_CUH
#define MOE_SLOT_CUH

#include <stdint.h>

__device__ __forceinline__ int32_t moe_replica_slot(int32_t e, int64_t pos,
                                                    const int32_t *__restrict__ replica_begin,
                                                    const int32_t *__restrict__ replica_slot)
{
    const int b = replica_begin[e], ne = replica_begin[e + 1] - b;
    return replica_slot[b + (ne == 1 ? 0 : (int)(pos % ne))];
}

/* A pair's local slot: moe_replica_slot for logical expert e at `pos`, -1 for e < 0 (no expert
 * here); the pair counted in load[e] when load is not NULL (moe_ep_slot_ids_args_t's window). */
__device__ __forceinline__ int32_t moe_pair_slot(int32_t e, int64_t pos,
                                                 const int32_t *__restrict__ replica_begin,
                                                 const int32_t *__restrict__ replica_slot,
                                                 unsigned long long *load)
{
    if (e < 0)
        return -1;
    if (load)
        atomicAdd(load + e, 1ULL);
    return moe_replica_slot(e, pos, replica_begin, replica_slot);
}

#endif /* MOE_SLOT_CUH */
