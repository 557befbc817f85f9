/* SPDX-License-Identifier: Apache-2.0 */
/* The one alignment test of the kernel launchers: 16-byte vector loads and stores need it. */
#ifndef MOE_ALIGNED_CUH
#define MOE_ALIGNED_CUH

#include <stdint.h>

static inline bool moe_aligned16(const void *p)
{
    return ((uintptr_t)p & 15u) == 0;
}

#endif /* MOE_ALIGNED_CUH */
