/* SPDX-License-Identifier: Apache-2.0 */
/* Grouped expert GEMM fallback for sm_80+ (runs on sm_90 too): mma.sync m16n8k16 bf16 with a
 * cp.async multi-stage pipeline, persistent CTAs over (row block, weight tile) items. */
#include "kernels/cuda/expert_gemm_common.cuh"
#include "kernels/cuda/expert_gemm_launch.h"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "expert_gemm_sm80.cu needs sm_80 or newer (cp.async, bf16 mma.sync)"
#endif

/* A CTA = 4 warps computing BM token rows x (2 x 64) weight rows: for STORE 128 consecutive
 * weight rows (128 output columns); for the *_MUL epilogues 64 gate rows and the 64 up rows of
 * the same output columns (64 output columns), so a thread holds gate and up of its outputs. */
constexpr int S80_BK = 64;
constexpr int S80_LD = S80_BK + 8; /* padded row (144 B): conflict-free ldmatrix */
constexpr int S80_WROWS = 128;
constexpr int S80_GROUP = 16;

template <int BM> struct sm80_cfg {
    static constexpr int WM_WARPS = BM / 32;
    static constexpr int WN_WARPS = 4 / WM_WARPS;
    static constexpr int WCOLS = 64 / WN_WARPS; /* per warp, per half */
    static constexpr int NFRAG = WCOLS / 8;
    static constexpr int ROWS = BM + S80_WROWS;
    static constexpr int STAGE_ELEMS = ROWS * S80_LD;
    static constexpr int STAGES = 4;
    static constexpr int SMEM = STAGES * STAGE_ELEMS * 2;
};

static __device__ __forceinline__ void cp_async16(void *dst, const void *src)
{
    asm volatile(
        "cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((uint32_t)__cvta_generic_to_shared(dst)),
        "l"(src)
        : "memory");
}
/* As cp_async16, but copies `src_bytes` (0 or 16) and zero-fills the rest: the k and n tails. */
static __device__ __forceinline__ void cp_async16_zfill(void *dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(
                     (uint32_t)__cvta_generic_to_shared(dst)),
                 "l"(src), "r"(src_bytes)
                 : "memory");
}
static __device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N> static __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

static __device__ __forceinline__ void ldsm_x4(uint32_t *r, const __nv_bfloat16 *p)
{
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"((uint32_t)__cvta_generic_to_shared(p)));
}

static __device__ __forceinline__ void mma_bf16(float *d, const uint32_t *a, const uint32_t *b)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

static __device__ __forceinline__ void sm80_item(int t, int nb, int n_tiles, int *b, int *jt)
{
    int per_group = S80_GROUP * n_tiles;
    int g = t / per_group;
    int rem = t - g * per_group;
    int gsize = min(S80_GROUP, nb - g * S80_GROUP);
    *jt = rem / gsize;
    *b = g * S80_GROUP + rem % gsize;
}

template <int BM, int EPI>
__global__ void __launch_bounds__(128)
    moe_gemm_sm80_kernel(const __nv_bfloat16 *__restrict__ A, const __nv_bfloat16 *__restrict__ B,
                         const moe_gemm_kparams p)
{
    using C = sm80_cfg<BM>;
    extern __shared__ __align__(16) __nv_bfloat16 sm[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = warp / C::WN_WARPS, wn = warp % C::WN_WARPS;
    const int nb = min(__ldg(p.num_blocks), p.max_blocks);
    const int total = nb * p.n_tiles;
    const int kt_count = (p.k + S80_BK - 1) / S80_BK; /* the k tail: zero fill */

    for (int t = blockIdx.x; t < total; t += gridDim.x) {
        int b, jt;
        sm80_item(t, nb, p.n_tiles, &b, &jt);
        const int e = __ldg(p.block_expert + b);
        if (e < 0 || e >= p.num_experts)
            continue;

        /* Loads k-step kt into stage st: 16-byte chunks, 8 per 64-element row. Chunks past k
         * and weight rows past the expert's n (or n/2 per half) are zero-filled, never read. */
        auto load = [&](int kt, int st) {
            __nv_bfloat16 *dst = sm + st * C::STAGE_ELEMS;
            for (int c = threadIdx.x; c < C::ROWS * 8; c += 128) {
                int r = c >> 3, ch = c & 7;
                int kc = kt * S80_BK + ch * 8;
                bool ok = kc < p.k;
                const __nv_bfloat16 *src;
                if (r < BM) {
                    src = A + ((int64_t)b * BM + r) * p.k;
                } else {
                    int wr = r - BM, h = wr >> 6, rr = wr & 63;
                    int grow, lim;
                    if (EPI == MOE_GEMM_EPI_STORE) {
                        grow = jt * 128 + h * 64 + rr;
                        lim = p.n;
                    } else {
                        grow = jt * 64 + rr;
                        lim = p.n / 2;
                    }
                    ok = ok && grow < lim;
                    if (EPI != MOE_GEMM_EPI_STORE)
                        grow += h * (p.n / 2);
                    src = B + ((int64_t)e * p.n + grow) * p.k;
                }
                if (ok)
                    cp_async16(dst + r * S80_LD + ch * 8, src + kc);
                else
                    cp_async16_zfill(dst + r * S80_LD + ch * 8, A, 0);
            }
        };

        float acc[2][2][C::NFRAG][4];
#pragma unroll
        for (int h = 0; h < 2; h++)
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int nj = 0; nj < C::NFRAG; nj++)
#pragma unroll
                    for (int q = 0; q < 4; q++)
                        acc[h][mi][nj][q] = 0.0f;

#pragma unroll
        for (int st = 0; st < C::STAGES - 1; st++) {
            if (st < kt_count)
                load(st, st);
            cp_async_commit();
        }
        for (int kt = 0; kt < kt_count; kt++) {
            cp_async_wait<C::STAGES - 2>();
            __syncthreads();
            int nk = kt + C::STAGES - 1;
            if (nk < kt_count)
                load(nk, nk % C::STAGES);
            cp_async_commit();
            const __nv_bfloat16 *sA = sm + (kt % C::STAGES) * C::STAGE_ELEMS;
            const __nv_bfloat16 *sW = sA + BM * S80_LD;
#pragma unroll
            for (int kk = 0; kk < S80_BK / 16; kk++) {
                uint32_t af[2][4], bfr[2][C::NFRAG][2];
                /* ldmatrix x4: lanes 0-7, 8-15, 16-23, 24-31 address the rows of the four 8x8
                 * matrices; A: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
                 * (rows 8-15, k 8-15) = the m16n8k16 A fragment in register order. */
#pragma unroll
                for (int mi = 0; mi < 2; mi++)
                    ldsm_x4(af[mi],
                            sA + (wm * 32 + mi * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * S80_LD +
                                kk * 16 + (lane >> 4) * 8);
                    /* B (weights [n][k]): (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7),
                     * (n 8-15, k 8-15) = the B fragments of two n8 tiles. */
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int nj = 0; nj < C::NFRAG; nj += 2) {
                        uint32_t r[4];
                        ldsm_x4(r, sW +
                                       (h * 64 + wn * C::WCOLS + nj * 8 + (lane & 7) +
                                        (lane >> 4) * 8) *
                                           S80_LD +
                                       kk * 16 + ((lane >> 3) & 1) * 8);
                        bfr[h][nj][0] = r[0];
                        bfr[h][nj][1] = r[1];
                        bfr[h][nj + 1][0] = r[2];
                        bfr[h][nj + 1][1] = r[3];
                    }
#pragma unroll
                for (int h = 0; h < 2; h++)
#pragma unroll
                    for (int mi = 0; mi < 2; mi++)
#pragma unroll
                        for (int nj = 0; nj < C::NFRAG; nj++)
                            mma_bf16(acc[h][mi][nj], af[mi], bfr[h][nj]);
            }
        }
        cp_async_wait<0>();
        __syncthreads(); /* the next item's prologue overwrites every stage */

        /* Accumulator q of fragment (mi, nj): row 16*mi + lane/4 + 8*(q/2), column
         * 8*nj + 2*(lane%4) + q%2 of the warp's sub-tile. */
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int qq = 0; qq < 2; qq++) {
                const int64_t row = (int64_t)b * BM + wm * 32 + mi * 16 + (lane >> 2) + 8 * qq;
                const float sc = moe_gemm_row_scale(p, row);
#pragma unroll
                for (int nj = 0; nj < C::NFRAG; nj++) {
                    const int wc = wn * C::WCOLS + nj * 8 + 2 * (lane & 3);
                    const float *a0 = acc[0][mi][nj], *a1 = acc[1][mi][nj];
                    if (EPI == MOE_GEMM_EPI_STORE) {
                        moe_gemm_put2(p, row, jt * 128 + wc, a0[2 * qq] * sc, a0[2 * qq + 1] * sc);
                        moe_gemm_put2(p, row, jt * 128 + 64 + wc, a1[2 * qq] * sc,
                                      a1[2 * qq + 1] * sc);
                    } else {
                        moe_gemm_put2(p, row, jt * 64 + wc,
                                      moe_gemm_act_mul<EPI>(a0[2 * qq], a1[2 * qq]) * sc,
                                      moe_gemm_act_mul<EPI>(a0[2 * qq + 1], a1[2 * qq + 1]) * sc);
                    }
                }
            }
    }
}

template <int BM, int EPI>
static moe_status_t launch_one80(const moe_gemm_args_t *a, cudaStream_t stream, const char *name)
{
    using C = sm80_cfg<BM>;
    static int smem_done[MOE_MAX_DEVICES];
    auto kernel = moe_gemm_sm80_kernel<BM, EPI>;
    int dev, sms;
    MOE_CHECK(moe_gemm_device_sms(name, &dev, &sms));
    MOE_CHECK(moe_gemm_smem_once(name, (const void *)kernel, C::SMEM, dev, smem_done));
    moe_gemm_kparams p = moe_gemm_base_params(a);
    p.n_out = EPI == MOE_GEMM_EPI_STORE ? a->n : a->n / 2;
    p.n_tiles = EPI == MOE_GEMM_EPI_STORE ? (a->n + 127) / 128 : (a->n / 2 + 63) / 64;
    int64_t items = (int64_t)a->max_blocks * p.n_tiles;
    if (items == 0)
        return MOE_STATUS_SUCCESS;
    int64_t cap = (int64_t)sms * 2;
    if (a->max_ctas > 0 && cap > a->max_ctas)
        cap = a->max_ctas;
    int grid = (int)(items < cap ? items : cap);
    kernel<<<grid, 128, C::SMEM, stream>>>((const __nv_bfloat16 *)a->a, (const __nv_bfloat16 *)a->b,
                                           p);
    return moe_gemm_check_launch(name);
}

template <int BM>
static moe_status_t launch80(const moe_gemm_args_t *a, void *stream, const char *name)
{
    MOE_CHECK(moe_gemm_check_common(a, name));
    if ((int64_t)a->max_blocks * BM >= ((int64_t)1 << 31))
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "%s: max_blocks = %d too large", name,
                         a->max_blocks);
    cudaStream_t s = (cudaStream_t)stream;
    switch (a->epilogue) {
    case MOE_GEMM_EPI_STORE:
        return launch_one80<BM, MOE_GEMM_EPI_STORE>(a, s, name);
    case MOE_GEMM_EPI_SILU_MUL:
        return launch_one80<BM, MOE_GEMM_EPI_SILU_MUL>(a, s, name);
    case MOE_GEMM_EPI_GELU_MUL:
        return launch_one80<BM, MOE_GEMM_EPI_GELU_MUL>(a, s, name);
    default:
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "%s: epilogue %d", name, (int)a->epilogue);
    }
}

extern "C" {
moe_status_t moe_gemm_sm80_m64_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch80<64>(a, stream, "sm80_mma_m64n128");
}
moe_status_t moe_gemm_sm80_m32_launch(const moe_gemm_args_t *a, void *stream)
{
    return launch80<32>(a, stream, "sm80_mma_m32n128");
}
}
