/* SPDX-License-Identifier: Apache-2.0 */
/* Programmatic dependent launch for the small kernels of a step: each one may be scheduled
 * while its predecessor drains, and waits (griddepcontrol.wait) before touching memory. */
#ifndef MOE_PDL_CUH
#define MOE_PDL_CUH

#include <cuda_runtime.h>
#include "kernels/cuda/device_cache.cuh"
#include "runtime/diag.h"

/* First statement of every kernel launched through moe_launch: nothing is read or written
 * before the previous kernel on the stream has completed and flushed. */
__device__ __forceinline__ void moe_pdl_wait()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

/* MOE_PDL=0 turns programmatic dependent launch off (then launches are plainly ordered). It
 * is used on sm_90+ only. */
static inline bool moe_pdl_enabled()
{
    static int cached[MOE_MAX_DEVICES]; /* 1: sm_90+, 2: older */
    static int env = -1;
    int dev = 0;
    int e = __atomic_load_n(&env, __ATOMIC_RELAXED);
    if (e < 0) {
        e = moe_env_int("MOE_PDL", 1) != 0;
        __atomic_store_n(&env, e, __ATOMIC_RELAXED);
    }
    if (!e || cudaGetDevice(&dev) != cudaSuccess)
        return false;
    return moe_device_cached(cached, dev, [](int d) {
               int major = 0;
               if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d) !=
                   cudaSuccess)
                   return 0;
               return major >= 9 ? 1 : 2;
           }) == 1;
}

/* kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute where enabled. */
template <typename... P, typename... A>
static cudaError_t moe_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                              cudaStream_t stream, A... args)
{
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    if (moe_pdl_enabled()) {
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
    }
    return cudaLaunchKernelEx(&cfg, kernel, static_cast<P>(args)...);
}

#endif /* MOE_PDL_CUH */
