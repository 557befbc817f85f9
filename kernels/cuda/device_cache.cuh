/* SPDX-License-Identifier: Apache-2.0 */
/* The one idiom for values cached per CUDA device (multiprocessor count, arch, whether a
 * kernel's shared-memory attribute is set): a static array indexed by device, read and written
 * atomically; 0 means "not yet". Racing threads may both compute a value: harmless, the value
 * is the same. And environment knobs read once (moe_env_once). */
#ifndef MOE_DEVICE_CACHE_CUH
#define MOE_DEVICE_CACHE_CUH

#include "base/diag.h"

#define MOE_MAX_DEVICES 64

/* An integer from the environment (knob ranges: base/env.c, all >= 0), read once into *cache
 * (starts at -1). */
static inline int moe_env_once(int *cache, const char *name, int dflt)
{
    int v = __atomic_load_n(cache, __ATOMIC_RELAXED);
    if (v < 0) {
        v = (int)moe_env_int(name, dflt);
        __atomic_store_n(cache, v, __ATOMIC_RELAXED);
    }
    return v;
}

/* cache[dev], computed by compute(dev) (> 0 on success, <= 0: error, not cached) on first
 * use; devices past MOE_MAX_DEVICES are computed every time. */
template <typename F> static inline int moe_device_cached(int *cache, int dev, F compute)
{
    int v = dev >= 0 && dev < MOE_MAX_DEVICES ? __atomic_load_n(&cache[dev], __ATOMIC_ACQUIRE) : 0;
    if (v > 0)
        return v;
    v = compute(dev);
    if (v > 0 && dev >= 0 && dev < MOE_MAX_DEVICES)
        __atomic_store_n(&cache[dev], v, __ATOMIC_RELEASE);
    return v;
}

#endif /* MOE_DEVICE_CACHE_CUH */
