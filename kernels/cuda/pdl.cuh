/* SPDX-License-Identifier: Apache-2.0 */
/* Programmatic dependent launch for the small kernels of a step: each one may be scheduled
 * while its predecessor drains, and waits (griddepcontrol.wait) before touching memory. */
#ifndef MOE_PDL_CUH
#define MOE_PDL_CUH

#include <cuda_runtime.h>
#include "kernels/cuda/device_cache.cuh"
#include "base/diag.h"

/* The wait alone (moe_pdl_wait without its trigger), for a kernel that spins on other ranks'
 * signals: it does not let its dependent launch early (that happens at its end), so no
 * early-resident CTAs of the next kernel hold SM slots while it spins (ranks sharing a GPU need
 * those slots to make progress). */
__device__ __forceinline__ void moe_pdl_wait_only()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* Lets the next kernel on the stream launch (once every CTA of this one has said so or ended)
 * without waiting for anything: for a kernel launched without PDL whose successor waits on
 * its own before it reads (kernels/quant.h, trigger_next). */
__device__ __forceinline__ void moe_pdl_trigger()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

/* First statement of every kernel launched through moe_launch: nothing is read or written
 * before the previous kernel on the stream has completed and flushed; then the next kernel may
 * launch. */
__device__ __forceinline__ void moe_pdl_wait()
{
    moe_pdl_wait_only();
    moe_pdl_trigger();
}

/* A value the previous kernel wrote, read past moe_pdl_wait: a strong load in volatile asm, which
 * stays after the wait. An __ldg (ld.global.nc, an invariant load to the compiler) may be hoisted
 * above it: in the sm_90a GEMM, once the wait sat in a branch (MOE_GEMM_EARLY_W), the load of
 * num_blocks moved to the kernel's first instructions and read the layout kernel's count before
 * it was written (test_gpu_eplb, deterministic lsa-ll, on an H100, 2026-12-05). */
__device__ __forceinline__ int moe_pdl_ld(const int *p)
{
    int v;
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

/* MOE_PDL=0 turns programmatic dependent launch off (then launches are plainly ordered). It
 * is used on sm_90+ only. */
static inline bool moe_pdl_enabled()
{
    static int cached[MOE_MAX_DEVICES]; /* 1: sm_90+, 2: older */
    static int env = -1;
    int dev = 0;
    if (!moe_env_once(&env, "MOE_PDL", 1) || cudaGetDevice(&dev) != cudaSuccess)
        return false;
    return moe_device_cached(cached, dev, [](int d) {
               int major = 0;
               if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, d) !=
                   cudaSuccess)
                   return 0;
               return major >= 9 ? 1 : 2;
           }) == 1;
}

/* MOE_EP_PDL=1 (default 0): the expert-parallel step's own kernels (a2a.cu, ep.cu) launched
 * with PDL too, where moe_pdl_enabled(). Off by default: with two ranks on one H200 under MPS it
 * was within noise at one token per rank and 20-40 us slower a step at eight (early-resident
 * CTAs of the next kernel hold SM slots the other rank needs; bench/RESULTS.md, "Tried and
 * rejected"). To be measured on two GPUs. */
static inline bool moe_ep_pdl_enabled()
{
    static int env = -1;
    return moe_env_once(&env, "MOE_EP_PDL", 0) != 0 && moe_pdl_enabled();
}

/* kernel<<<grid, block, smem, stream>>>(args...), with the PDL attribute when pdl is true. */
template <typename... P, typename... A>
static cudaError_t moe_launch_pdl(bool pdl, void (*kernel)(P...), dim3 grid, dim3 block,
                                  size_t smem, cudaStream_t stream, A... args)
{
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1];
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    if (pdl) {
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
    }
    return cudaLaunchKernelEx(&cfg, kernel, static_cast<P>(args)...);
}

/* kernel<<<grid, block, smem, stream>>>(args...) with the PDL attribute where enabled. */
template <typename... P, typename... A>
static cudaError_t moe_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                              cudaStream_t stream, A... args)
{
    return moe_launch_pdl(moe_pdl_enabled(), kernel, grid, block, smem, stream, args...);
}

/* The same for the expert-parallel step's kernels: PDL only with MOE_EP_PDL=1. */
template <typename... P, typename... A>
static cudaError_t moe_ep_launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                                 cudaStream_t stream, A... args)
{
    return moe_launch_pdl(moe_ep_pdl_enabled(), kernel, grid, block, smem, stream, args...);
}

#endif /* MOE_PDL_CUH */
