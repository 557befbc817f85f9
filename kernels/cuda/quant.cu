// SPDX-License-Identifier: Apache-2.0
// e4m3 rows with one scale per row (W8A8 activations): amax by a warp, then the conversion;
// or the row's expert's static scale.
#include "kernels/quant.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/device_cache.cuh"
#include "kernels/cuda/vec8.cuh"
#include "base/numeric.h"
#include "kernels/prepare.h"

namespace
{

// As moe_fp8_dynamic_scale: amax floored at MOE_FP8_ACT_AMAX_MIN, over 448.
__device__ __forceinline__ float dynamic_scale(float amax)
{
    return __fdiv_rn(amax > MOE_FP8_ACT_AMAX_MIN ? amax : MOE_FP8_ACT_AMAX_MIN, MOE_FP8_E4M3_MAX);
}

// q[0..8) = e4m3(v[i] / s), rounded to nearest even and saturated (NaN stays NaN): 8 bytes.
__device__ __forceinline__ void store_e4m3x8(uint8_t *q, const float *v, float s)
{
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const uint32_t b = __nv_cvt_float_to_fp8(__fdiv_rn(v[i], s), __NV_SATFINITE, __NV_E4M3);
        if (i < 4)
            lo |= b << (8 * i);
        else
            hi |= b << (8 * (i - 4));
    }
    *reinterpret_cast<uint2 *>(q) = make_uint2(lo, hi);
}

// One CTA per row. Rows of up to Q_HELD_MIN_COLS values: 128 threads looping over the row
// twice (max, then convert). Longer rows (HELD): the CTA sized to the row, Q_VPT 8-wide vectors
// a thread, read once into registers with all loads in flight, then reduced and converted from
// there (up to Q_VPT x 8 x Q_MAX_THREADS = 32768 values; longer rows loop as above). Measured
// (2026-12-03, Nsight Compute, eight tokens): Mixtral's h (14336) 27.2 -> 18.3 us held; held
// for every row length it was slower on short rows (Qwen3's 2048 / 768: 6.6 / 6.2 -> 13.7 /
// 10.3 us; Mixtral's 4096: 6.4 -> 10.8), so short rows keep the 128-thread kernel.
constexpr int Q_VPT = 8, Q_MIN_THREADS = 128, Q_MAX_THREADS = 512, Q_HELD_MIN_COLS = 8192;

// v[0..8) = the row's values c .. c + 7: zeros for a padding row (x NULL); with `round`, f32
// values rounded to bf16 (the gather's copy, fused: a no-op for bf16 x).
template <typename T>
__device__ __forceinline__ void load_row8(const T *x, int c, bool round, float *v)
{
    if (!x) {
#pragma unroll
        for (int i = 0; i < 8; i++)
            v[i] = 0.0f;
        return;
    }
    moe_load8(x + c, v);
    if (round)
#pragma unroll
        for (int i = 0; i < 8; i++)
            v[i] = __bfloat162float(__float2bfloat16_rn(v[i]));
}

// Row `row`'s static scale: its expert's (block table), or 0 (dynamic: no table, a padding block
// or an expert without one).
__device__ __forceinline__ float row_static_scale(const moe_quant_rows_args_t &a, int64_t row)
{
    if (!a.static_scale)
        return 0.0f;
    const int32_t e = a.block_expert[row / a.block_rows];
    return e >= 0 ? a.static_scale[e] : 0.0f;
}

template <typename T, bool HELD>
__global__ void __launch_bounds__(HELD ? Q_MAX_THREADS : Q_MIN_THREADS)
    quant_rows_kernel(moe_quant_rows_args_t a)
{
    constexpr int MAX_THREADS = HELD ? Q_MAX_THREADS : Q_MIN_THREADS;
    constexpr int VPT = HELD ? Q_VPT : 1; /* 8-wide vectors a thread holds */
    __shared__ float warp_max[MAX_THREADS / 32];
    __shared__ float row_scale;
    if (a.trigger_next) /* kernels/quant.h */
        moe_pdl_trigger();
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const int nt = HELD ? (int)blockDim.x : Q_MIN_THREADS;
    const int64_t row = blockIdx.x;
    if (a.num_blocks && row >= (int64_t)*a.num_blocks * a.block_rows)
        return;
    if (a.zero_amax) /* for the next GEMM's epilogue maxima (kernels/quant.h) */
        for (int i = threadIdx.x; i < a.zero_cols; i += nt)
            a.zero_amax[row * a.zero_cols + i] = 0.0f;
    const T *x = static_cast<const T *>(a.x);
    const bool round = a.src_slot && sizeof(T) == 4; // f32 x: as the bf16 gather would copy it
    if (a.src_slot) {
        const int32_t slot = a.src_slot[row];
        x = slot >= 0 ? x + (int64_t)(slot / a.src_k) * a.cols : nullptr;
    } else {
        x += row * a.cols;
    }
    if (a.group) { /* 1 x 128 groups: 16 lanes (one half-warp) per group of 8-wide vectors;
                    * VPT vectors a thread loaded before the first is stored (HELD: the row's
                    * loads in flight at once, not one round trip per nt vectors) */
        const int nvec = a.cols / 8, ng = (a.cols + 127) / 128;
        uint8_t *q = a.q + row * a.cols;
        for (int v0 = 0; v0 < nvec; v0 += nt * VPT) {
            float vals[VPT][8];
#pragma unroll
            for (int i = 0; i < VPT; i++) {
                const int v = v0 + i * nt + threadIdx.x;
                if (v < nvec)
                    load_row8(x, v * 8, round, vals[i]);
            }
#pragma unroll
            for (int i = 0; i < VPT; i++) {
                const int v = v0 + i * nt + threadIdx.x;
                float m = 0.0f;
                if (v < nvec)
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        m = fmaxf(m, fabsf(vals[i][j]));
#pragma unroll
                for (int o = 8; o > 0; o >>= 1) /* within the 16 lanes of the group */
                    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
                const float sg = dynamic_scale(m);
                if (v < nvec) {
                    if (v % 16 == 0)
                        a.scale[row * ng + v / 16] = sg;
                    store_e4m3x8(q + (int64_t)v * 8, vals[i], sg);
                }
            }
        }
        return;
    }
    const int nvec = a.cols / 8;
    const bool held = HELD && nvec <= VPT * nt; /* the row in registers: read once */
    float vals[VPT][8];
    if (held)
#pragma unroll
        for (int i = 0; i < VPT; i++) {
            const int v = threadIdx.x + i * nt;
            if (v < nvec)
                load_row8(x, v * 8, round, vals[i]);
        }
    const float st = row_static_scale(a, row); /* the same for the whole CTA */
    if (st > 0.0f) { /* as the CPU's `!(s > 0)`: 0 (and NaN) mean dynamic */
        if (threadIdx.x == 0)
            row_scale = st;
    } else {
        float m = 0.0f; // fmaxf drops NaN: a NaN value stays NaN below
        if (held) {
#pragma unroll
            for (int i = 0; i < VPT; i++)
                if (threadIdx.x + i * nt < nvec)
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        m = fmaxf(m, fabsf(vals[i][j]));
        } else {
#pragma unroll 4
            for (int c = threadIdx.x * 8; c < a.cols; c += nt * 8) {
                float v[8];
                load_row8(x, c, round, v);
#pragma unroll
                for (int i = 0; i < 8; i++)
                    m = fmaxf(m, fabsf(v[i]));
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0)
            warp_max[warp] = m;
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int w = 1; w < nt / 32; w++)
                m = fmaxf(m, warp_max[w]);
            row_scale = dynamic_scale(m);
        }
    }
    __syncthreads();
    const float s = row_scale;
    if (threadIdx.x == 0)
        a.scale[row] = s;
    uint8_t *q = a.q + row * a.cols;
    if (held) {
#pragma unroll
        for (int i = 0; i < VPT; i++) {
            const int v = threadIdx.x + i * nt;
            if (v < nvec)
                store_e4m3x8(q + (int64_t)v * 8, vals[i], s);
        }
        return;
    }
#pragma unroll 4
    for (int c = threadIdx.x * 8; c < a.cols; c += nt * 8) {
        float v[8];
        load_row8(x, c, round, v);
        store_e4m3x8(q + c, v, s);
    }
}

// Rows whose maxima are known (a.amax): CTA (row, chunk) converts Q_KNOWN_THREADS 8-wide
// vectors of the row, one a thread, so a row is read once and split over CTAs (a few rows of a
// decode step fill the GPU instead of one CTA a row looping over it). The scale of a row or
// 1 x 128 group is quant_rows_kernel's: static if the row's expert has one, else from the max.
constexpr int Q_KNOWN_THREADS = 128;

template <typename T>
__global__ void __launch_bounds__(Q_KNOWN_THREADS) quant_known_kernel(moe_quant_rows_args_t a)
{
    if (a.trigger_next) /* kernels/quant.h */
        moe_pdl_trigger();
    const int64_t row = blockIdx.x;
    if (a.num_blocks && row >= (int64_t)*a.num_blocks * a.block_rows)
        return;
    const int nvec = a.cols / 8, v = blockIdx.y * Q_KNOWN_THREADS + threadIdx.x;
    if (v >= nvec)
        return;
    const int ng = a.group ? (a.cols + 127) / 128 : 1, g = a.group ? v / 16 : 0;
    const float st = row_static_scale(a, row);
    const float s = st > 0.0f ? st : dynamic_scale(__ldg(a.amax + row * ng + g));
    if (a.group ? v % 16 == 0 : v == 0)
        a.scale[row * ng + g] = s;
    float vals[8];
    load_row8(static_cast<const T *>(a.x) + row * a.cols, v * 8, false, vals);
    store_e4m3x8(a.q + row * a.cols + (int64_t)v * 8, vals, s);
}

} // namespace

extern "C" moe_status_t moe_quant_rows_launch(const moe_quant_rows_args_t *a, void *stream)
{
    if (a->cols % 8)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "e4m3 rows: cols = %d not a multiple of 8",
                         a->cols);
    if (a->rows <= 0)
        return MOE_STATUS_SUCCESS;
    if (a->group && (a->group != 128 || a->static_scale))
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "e4m3 rows: group = %d (0 or 128, without a static scale)", a->group);
    if (a->static_scale && (!a->block_expert || a->block_rows <= 0))
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "e4m3 rows: static scales per expert need the block table (block_expert "
                         "%s, block_rows %d)",
                         a->block_expert ? "set" : "NULL", a->block_rows);
    if (a->src_slot && a->src_k <= 0)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "e4m3 rows: gather with src_k = %d",
                         a->src_k);
    if (a->rows > INT32_MAX)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "e4m3 rows: %lld rows", (long long)a->rows);
    if (a->amax && a->src_slot)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "e4m3 rows: known maxima (amax) with a gather (src_slot)");
    if (a->zero_amax && a->zero_cols <= 0)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "e4m3 rows: zero_amax with zero_cols = %d",
                         a->zero_cols);
    const unsigned grid = (unsigned)a->rows;
    /* long rows (per row or, unless MOE_QUANT_GROUP_HELD=0, 1 x 128 groups): enough threads for
       Q_VPT vectors each (whole warps), within [Q_MIN, Q_MAX]_THREADS. Groups so: Mixtral's
       block steps 2-8 % faster (h: 14336); every group row held made the DeepSeek-V3 shard's
       (7168, 2048) and Qwen3's (2048, 768) 2-9 % slower (bench/RESULTS.md, "Layer step, FP8
       W8A8"). */
    static int group_held = -1;
    const bool held = a->cols > Q_HELD_MIN_COLS &&
                      (!a->group || moe_env_once(&group_held, "MOE_QUANT_GROUP_HELD", 1) != 0);
    const int64_t need = ((int64_t)a->cols / 8 + Q_VPT - 1) / Q_VPT;
    const int threads = !held || need <= Q_MIN_THREADS ? Q_MIN_THREADS
                        : need >= Q_MAX_THREADS        ? Q_MAX_THREADS
                                                       : (int)(need + 31) / 32 * 32;
    cudaStream_t s = (cudaStream_t)stream;
    if (a->x_dtype != MOE_DTYPE_BF16 && a->x_dtype != MOE_DTYPE_F32)
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "e4m3 rows from %s", moe_dtype_name(a->x_dtype));
    const bool bf = a->x_dtype == MOE_DTYPE_BF16;
    if (a->amax) {
        const dim3 kgrid(grid, (unsigned)((a->cols / 8 + Q_KNOWN_THREADS - 1) / Q_KNOWN_THREADS));
        if (a->zero_amax) /* one kernel does not both read and zero maxima */
            return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                             "e4m3 rows: amax and zero_amax in one call");
        if (bf)
            quant_known_kernel<__nv_bfloat16><<<kgrid, Q_KNOWN_THREADS, 0, s>>>(*a);
        else
            quant_known_kernel<float><<<kgrid, Q_KNOWN_THREADS, 0, s>>>(*a);
        MOE_CUDA_CHECK_LAUNCH("e4m3 rows (known maxima)");
        return MOE_STATUS_SUCCESS;
    }
    if (held && bf)
        quant_rows_kernel<__nv_bfloat16, true><<<grid, threads, 0, s>>>(*a);
    else if (held)
        quant_rows_kernel<float, true><<<grid, threads, 0, s>>>(*a);
    else if (bf)
        quant_rows_kernel<__nv_bfloat16, false><<<grid, threads, 0, s>>>(*a);
    else
        quant_rows_kernel<float, false><<<grid, threads, 0, s>>>(*a);
    MOE_CUDA_CHECK_LAUNCH("e4m3 rows");
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_quant_prepare(void)
{
    MOE_CUDA_PREPARE((quant_rows_kernel<__nv_bfloat16, false>));
    MOE_CUDA_PREPARE((quant_rows_kernel<float, false>));
    MOE_CUDA_PREPARE((quant_rows_kernel<__nv_bfloat16, true>));
    MOE_CUDA_PREPARE((quant_rows_kernel<float, true>));
    MOE_CUDA_PREPARE((quant_known_kernel<__nv_bfloat16>));
    MOE_CUDA_PREPARE((quant_known_kernel<float>));
    return MOE_STATUS_SUCCESS;
}
