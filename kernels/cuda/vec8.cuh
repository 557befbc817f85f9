/* SPDX-License-Identifier: Apache-2.0 */
/* The one set of 8-wide (16- or 32-byte) row accessors of the small kernels: load 8 bf16 or
 * f32 values as floats, pack 8 floats to bf16 (round to nearest even), store 8 values. The
 * pointers must be 16-byte aligned. */
#ifndef MOE_VEC8_CUH
#define MOE_VEC8_CUH

#include <cuda_bf16.h>
#include <stdint.h>

__device__ __forceinline__ void moe_load8(const __nv_bfloat16 *p, float *v)
{
    const uint4 u = *reinterpret_cast<const uint4 *>(p);
    const __nv_bfloat162 *h = reinterpret_cast<const __nv_bfloat162 *>(&u);
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const float2 f = __bfloat1622float2(h[i]);
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void moe_load8(const float *p, float *v)
{
    const float4 a = reinterpret_cast<const float4 *>(p)[0];
    const float4 b = reinterpret_cast<const float4 *>(p)[1];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

__device__ __forceinline__ uint4 moe_pack8(const float *v)
{
    uint4 r;
    __nv_bfloat162 h[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
        h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    r.x = *reinterpret_cast<unsigned *>(&h[0]);
    r.y = *reinterpret_cast<unsigned *>(&h[1]);
    r.z = *reinterpret_cast<unsigned *>(&h[2]);
    r.w = *reinterpret_cast<unsigned *>(&h[3]);
    return r;
}

__device__ __forceinline__ void moe_store8(__nv_bfloat16 *p, const float *v)
{
    *reinterpret_cast<uint4 *>(p) = moe_pack8(v);
}

__device__ __forceinline__ void moe_store8(float *p, const float *v)
{
    float4 *d = reinterpret_cast<float4 *>(p);
    d[0] = make_float4(v[0], v[1], v[2], v[3]);
    d[1] = make_float4(v[4], v[5], v[6], v[7]);
}

#endif /* MOE_VEC8_CUH */
