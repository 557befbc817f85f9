/* SPDX-License-Identifier: Apache-2.0 */
/* The weight stream's 16-byte load: read-only, not kept in L1, the L2 asked for 256 bytes around
 * it (the fused decode kernel's weight rows; bench/stream_bench measures the same instruction). */
#ifndef MOE_STREAM_LOAD_CUH
#define MOE_STREAM_LOAD_CUH

#include <stdint.h>

__device__ __forceinline__ uint4 moe_ld_stream(const uint8_t *p)
{
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

#endif /* MOE_STREAM_LOAD_CUH */
