/* SPDX-License-Identifier: Apache-2.0 */
/* Grouped expert GEMM for sm_90a: wgmma fed by TMA through an mbarrier ring, persistent CTAs,
 * a normal layout (tokens in wgmma M) and a swap-AB layout (weight rows in M, tokens in N).
 * The kernel template and its host launcher; the variants' entry points are instantiated in
 * expert_gemm*_sm90.cu, a few per file so they compile in parallel. */
#ifndef MOE_EXPERT_GEMM_SM90_CUH
#define MOE_EXPERT_GEMM_SM90_CUH
#include <cuda.h>
#include <cudaTypedefs.h>

/* Without sm_90a the kernel bodies below would compile to nothing: refuse instead. */
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "expert_gemm_sm90.cuh is sm_90a only (-gencode arch=compute_90a,code=sm_90a)"
#endif

#include "kernels/cuda/expert_gemm_common.cuh"
#include "kernels/cuda/expert_gemm_launch.h"
#include "kernels/cuda/pdl.cuh"

/* ---- device primitives -------------------------------------------------------------------- */

static __device__ __forceinline__ uint32_t smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

static __device__ __forceinline__ void mbar_init(uint64_t *bar, int count)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

static __device__ __forceinline__ void mbar_expect_tx(uint64_t *bar, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
                 "r"(bytes)
                 : "memory");
}

static __device__ __forceinline__ void mbar_arrive(uint64_t *bar)
{
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

static __device__ __forceinline__ void mbar_wait(uint64_t *bar, int phase)
{
    uint32_t done;
    do {
        asm volatile("{\n"
                     ".reg .pred p;\n"
                     "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n"
                     "}\n"
                     : "=r"(done)
                     : "r"(smem_u32(bar)), "r"(phase)
                     : "memory");
    } while (!done);
}

/* 2D tile load: c0 = column (k, innermost), c1 = row. Completes on `bar` with its bytes. */
static __device__ __forceinline__ void tma_load_2d(void *dst, const CUtensorMap *map, int c0,
                                                   int c1, uint64_t *bar)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];" ::"r"(smem_u32(dst)),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(smem_u32(bar))
                 : "memory");
}

/* The same box multicast to the CTAs of `mask` in the cluster (each at dst's offset, each
 * completing on its own barrier at bar's offset). */
static __device__ __forceinline__ void tma_load_2d_mc(void *dst, const CUtensorMap *map, int c0,
                                                      int c1, uint64_t *bar, uint16_t mask)
{
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(smem_u32(dst)),
                 "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(smem_u32(bar)), "h"(mask)
                 : "memory");
}

/* One arrival on the barrier at bar's offset in the cluster's CTA `cta` (this one included). A
 * plain arrive: with .release.cluster every k step paid a cluster-scope fence (docs/KERNELS.md,
 * "Missing / next"), as CUTLASS's ClusterBarrier does it. */
static __device__ __forceinline__ void mbar_arrive_cta(uint64_t *bar, uint32_t cta)
{
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote)
                 : "r"(smem_u32(bar)), "r"(cta));
    asm volatile("mbarrier.arrive.shared::cluster.b64 _, [%0];" ::"r"(remote) : "memory");
}

static __device__ __forceinline__ uint32_t cluster_ctarank()
{
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

/* Every thread of the cluster's CTAs (not .aligned: the producer warp's lanes arrive apart). */
static __device__ __forceinline__ void cluster_sync()
{
    asm volatile("barrier.cluster.arrive.release;\n\tbarrier.cluster.wait.acquire;" ::: "memory");
}

/* 2D tile store from shared memory (bulk group); coordinates as tma_load_2d. Parts of the box
 * past the tensor's extent are not written. */
static __device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, uint32_t src, int c0,
                                                    int c1)
{
    asm volatile(
        "cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(
            (uint64_t)map),
        "r"(src), "r"(c0), "r"(c1)
        : "memory");
}

/* 4-byte copy global -> shared (cp.async, L1-allocating); completes asynchronously. */
static __device__ __forceinline__ void cp_async_4(float *dst, const float *src)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_u32(dst)), "l"(src)
                 : "memory");
}

/* One arrival on `bar` once every cp.async this thread issued before has landed (noinc: the
 * barrier's count includes this arrival). */
static __device__ __forceinline__ void cp_async_arrive_noinc(uint64_t *bar)
{
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_u32(bar))
                 : "memory");
}

static __device__ __forceinline__ void named_bar_sync(int id, int threads)
{
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

static __device__ __forceinline__ void wgmma_fence()
{
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
static __device__ __forceinline__ void wgmma_commit()
{
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N> static __device__ __forceinline__ void wgmma_wait()
{
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
/* Keeps the compiler from moving accumulator reads/writes across wgmma fences and waits. */
static __device__ __forceinline__ void reg_fence(float &r)
{
    asm volatile("" : "+f"(r)::"memory");
}

/* Shared-memory matrix descriptor for a K-major tile of 64 bf16 (128 B) per row, written by TMA
 * with the 128-byte swizzle: 8-row atoms 1024 B apart (stride byte offset), leading byte offset
 * unused (1), layout type 1 = SWIZZLE_128B in bits 62-63. */
static __device__ __forceinline__ uint64_t sw128_desc(uint32_t saddr)
{
    return (uint64_t)((saddr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) |
           ((uint64_t)(1024 >> 4) << 32) | ((uint64_t)1 << 62);
}

/* d[N/2] += A(64 x 16, smem desc) . B(N x 16, smem desc)^T, f32 accumulators. */
template <int N> __device__ __forceinline__ void wgmma_bf16(float *d, uint64_t da, uint64_t db);
#include "kernels/cuda/expert_gemm_wgmma.inc"
/* The same over 32 e4m3 values of k (32 bytes, as the bf16 form's 16 values); sd = 0 overwrites
 * d instead of adding to it (a promoted slice's first k step: no zeroing pass). */
template <int N>
__device__ __forceinline__ void wgmma_fp8(float *d, uint64_t da, uint64_t db, int sd = 1);
#include "kernels/cuda/expert_gemm_wgmma_fp8.inc"

/* ---- the kernel ------------------------------------------------------------------------------
 * One CTA = NWG consumer warpgroups + 1 producer warpgroup (one thread issues TMA). Work item t
 * (persistent, strided by gridDim.x) = (row block b, weight tile jt). A weight tile is HALVES
 * slices of WR weight rows: for STORE consecutive rows, for the *_MUL epilogues the gate rows
 * and the up rows of the same output columns.
 *   normal (SWAP=0): wgmma M = tokens (64 per consumer warpgroup), N = WR weight rows per
 *     slice, one accumulator per slice, so a thread holds gate and up of its outputs.
 *   swap-AB (SWAP=1): wgmma M = the weight rows of the tile, 64 per wgmma, WM = 1 or 2
 *     wgmmas (HALVES x WR = 64 WM: for *_MUL gate rows first, then up rows), N = TOK tokens;
 *     the epilogue goes through shared memory (pairs gate with up, writes rows of c
 *     coalesced). 32 WM output columns per item for *_MUL keeps items small, so few-token
 *     steps still spread over every SM. */
constexpr int BK = 64;            /* bf16 elements per row of a stage: one 128 B swizzle row */
constexpr int ROW_BYTES = BK * 2; /* 128 (e4m3: 128 elements) */

/* F8, the kernels' element kind: 0 bf16; e4m3 with 1 per-row scales, each 128 of k promoted
 * (added to f32 accumulators on the CUDA cores); 2 128 x 128 block scales, promoted likewise;
 * 3 per-row scales, not promoted (the tensor cores sum all of k: "fast accumulation");
 * 4 per-row scales, promoted every F8_PI slices of 128 k (p.promo_pi: MOE_GEMM_PROMO_SLICES
 * can change it, whole stages at least), the wgmmas in flight between.
 * Elements of k per 128-byte stage row: 64 bf16 or 128 e4m3. */
constexpr int F8_PI = 4;
/* Kinds whose per-row scales the epilogue applies (1, 3, 4), and kinds that promote a partial
 * into a second, f32 set of accumulators (1, 2, 4). */
constexpr bool f8_row_scales(int f8)
{
    return f8 == 1 || f8 >= 3;
}
constexpr bool f8_promoted(int f8)
{
    return f8 == 1 || f8 == 2 || f8 == 4;
}
template <int F8> struct sm90_elem {
    static constexpr int BKE = F8 ? 128 : 64;
};
constexpr int GROUP_BLOCKS = 16; /* at most this many row blocks a sweep (L2 reuse) */

template <int SWAP, int TOK, int WR, int HALVES, int STAGES, int KB, int F8, int PING = 0>
struct sm90_cfg {
    /* PING (normal with TOK = 64, or swap-AB): two consumer warpgroups take alternate
     * items, so one's epilogue runs while the other's wgmmas do */
    static constexpr int NWG = PING ? 2 : SWAP ? 1 : TOK / 64;
    /* normal layout: the epilogue writes bf16 rows through shared memory and TMA stores
     * (TS_BYTES per consumer warpgroup: 64 rows x WR output columns, in boxes of TSW columns:
     * 64 (128-byte rows, 128-byte swizzle), or 32 where WR is 96 (64-byte rows and swizzle) */
    static constexpr bool TS = !SWAP && (WR == 128 || WR == 64 || WR == 96);
    static constexpr int TSW = WR % 64 ? 32 : 64;
    static constexpr int TS_BYTES = 64 * WR * 2;
    static constexpr int THREADS = (NWG + 1) * 128;
    static constexpr int WN = SWAP ? TOK : WR; /* wgmma N */
    static constexpr int ACC = WN / 2;         /* f32 accumulators per thread per wgmma */
    static constexpr int WM = SWAP ? HALVES * WR / 64 : 1; /* swap-AB: m64 wgmmas per k16 */
    static constexpr int NACC = SWAP ? WM : HALVES;
    static constexpr int SUB_W = HALVES * WR * ROW_BYTES; /* one 64-wide k slice of weights */
    static constexpr int SUB_T = TOK * ROW_BYTES;         /* one 64-wide k slice of tokens */
    static constexpr int W_BYTES = KB * SUB_W;            /* a stage holds KB k slices */
    static constexpr int TOK_BYTES = KB * SUB_T;
    static constexpr int STAGE_BYTES = W_BYTES + TOK_BYTES;
    static constexpr int EPI_LD = TOK + 1; /* swap-AB staging row (floats), odd: no conflicts */
    /* swap-AB: a consumer warpgroup's staging, its rows + the item's row scales */
    static constexpr int EPI_WG_FLOATS = 64 * WM * EPI_LD + 64;
    static constexpr int EPI_BYTES = SWAP ? NWG * EPI_WG_FLOATS * 4 : TS ? NWG * TS_BYTES : 0;
    /* F8 = 2 (block scales), swap-AB: per stage and 128-wide k slice, the TOK A rows' scales
     * and one weight scale per half, copied in by the producer warp with the tiles (the normal
     * tiles load theirs in the promotion: docs/KERNELS.md, "FP8 W8A8") */
    static constexpr bool SSC = F8 == 2 && SWAP;
    static constexpr int SC_SLICE = SSC ? TOK + HALVES : 0;
    static constexpr int SC_BYTES = (STAGES * KB * SC_SLICE * 4 + 15) / 16 * 16;
    /* the producer warpgroup's registers: 40; the scale copies need more (two consumer
     * warpgroups then take 224 each instead of 232) */
    static constexpr int PRODUCER_REGS = SSC ? 56 : 40;
    /* + PING's two turn barriers; 1024: the alignment of the tiles */
    static constexpr int SMEM =
        STAGES * STAGE_BYTES + EPI_BYTES + SC_BYTES + (2 * STAGES + (PING ? 2 : 0)) * 8 + 1024;
    static_assert(!SWAP || HALVES * WR == 64 || HALVES * WR == 128, "swap-AB: 64 or 128 rows");
    static_assert(SWAP || HALVES * WR <= 256, "normal: the halves in one wgmma, N <= 256");
    static_assert(TOK_BYTES % 1024 == 0 && W_BYTES % 1024 == 0, "1024 B aligned tiles");
    static_assert(SMEM <= 227 * 1024, "shared memory");
    static_assert(EPI_BYTES % 1024 == 0 || SWAP, "TMA store buffers: 1024 B aligned");
    static_assert(!PING || SWAP || TOK == 64, "ping-pong: swap-AB, or 64-row normal items");
    static_assert(F8 != 4 || F8_PI % KB == 0, "promotion interval: whole stages");
};

/* Maps work item t to (row block b, weight tile jt); row blocks are taken `group` at a time
 * across all weight tiles so the group's token rows and the swept weight tiles stay in L2. */
static __device__ __forceinline__ void sm90_item(int t, int nb, int n_tiles, int *b, int *jt,
                                                 int group)
{
    int per_group = group * n_tiles;
    int g = t / per_group;
    int rem = t - g * per_group;
    int gsize = min(group, nb - g * group);
    *jt = rem / gsize;
    *b = g * group + rem % gsize;
}

/* A read-only global load kept in the order written among the kernel's asm statements (asm
 * volatile): the scale loads stay where their loop puts them (before the main loop, or after
 * it, a pair of columns at a time). */
__device__ __forceinline__ float ldg_at(const float *ptr)
{
    float v;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(ptr));
    return v;
}

/* FP8 (F8 = 1): e4m3 A and B, f32 accumulation; the epilogue multiplies each output by the
 * A row's scale and the weight row's scale (per-tensor scales come expanded per row). */
__device__ __forceinline__ float sm90_f8_scale(const moe_gemm_kparams &p, int64_t row, int e,
                                               int wrow)
{
    return __ldg(p.a_scale + row) * __ldg(p.b_scale + (int64_t)e * p.n + wrow);
}

/* MC (normal layout, no PING): the CTAs of a 2-CTA cluster take the two weight tiles 2 q and
 * 2 q + 1 of one row block, and each loads half of the block's token tile and multicasts it to
 * both (docs/KERNELS.md, "Token-tile multicast"): a CTA reads TOK / 2 token rows a stage from
 * the L2 instead of TOK. */
template <int SWAP, int TOK, int WR, int HALVES, int EPI, int STAGES, int KB, int F8, int PING,
          int MC, int LA>
__global__ void __launch_bounds__(sm90_cfg<SWAP, TOK, WR, HALVES, STAGES, KB, F8, PING>::THREADS, 1)
    moe_gemm_sm90_kernel(const __grid_constant__ CUtensorMap tm_tok,
                         const __grid_constant__ CUtensorMap tm_w,
                         const __grid_constant__ CUtensorMap tm_c, const moe_gemm_kparams p)
{
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using C = sm90_cfg<SWAP, TOK, WR, HALVES, STAGES, KB, F8, PING>;
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = (uint8_t *)(((uintptr_t)smem_raw + 1023) & ~(uintptr_t)1023);
    float *sepi = (float *)(smem + STAGES * C::STAGE_BYTES);
    float *sscl = (float *)(smem + STAGES * C::STAGE_BYTES + C::EPI_BYTES);
    uint64_t *full = (uint64_t *)(smem + STAGES * C::STAGE_BYTES + C::EPI_BYTES + C::SC_BYTES);
    uint64_t *empty = full + STAGES;
    /* PING: turn[w] completes a phase when warpgroup w may start its next item's main loop */
    uint64_t *turn = empty + STAGES;
    const int wg = threadIdx.x / 128;
    const int tid = threadIdx.x % 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) {
            /* SSC: + the producer warp's 32 lanes, each when its scale copies land */
            mbar_init(&full[s], C::SSC ? 33 : 1);
            /* lane 0 of each consumer warp that reads the stage (PING: one warpgroup's; MC:
             * of both CTAs, whose token halves each CTA's producer writes into both) */
            mbar_init(&empty[s], (PING ? 1 : C::NWG) * 4 * (MC ? 2 : 1));
        }
        if (PING) {
            mbar_init(&turn[0], 1);
            mbar_init(&turn[1], 1);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        if (PING)
            mbar_arrive(&turn[0]); /* warpgroup 0 goes first */
        asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&tm_w) : "memory");
        asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&tm_tok) : "memory");
        if (C::TS)
            asm volatile("prefetch.tensormap [%0];" ::"l"((uint64_t)&tm_c) : "memory");
    }
    static_assert(!MC || (!SWAP && !PING && KB == 1 && TOK / 2 * ROW_BYTES % 1024 == 0),
                  "multicast: normal cooperative tiles, halves of whole swizzle atoms");
    /* MC: the peer's barriers are initialised before anything is multicast or arrived there */
    if (MC)
        cluster_sync();
    else
        __syncthreads();
    /* Programmatic dependent launch: everything above overlaps the previous kernel's tail;
     * nothing it writes (a, block_expert, num_blocks) is read before this wait. EW (the caller's
     * early_weights: the block tables were final before the previous kernel started): the
     * consumers wait below, and the producer's thread loads its first item's weight stages
     * before it waits, so they stream under the previous kernel's tail. */
    const bool ew = SWAP && !C::SSC && p.early_w;
    if (!ew)
        moe_pdl_wait();

    /* past the wait (or, EW, written before the previous kernel started): moe_pdl_ld, never an
     * __ldg the compiler may hoist above the branch's wait */
    const int nb = min(moe_pdl_ld(p.num_blocks), p.max_blocks);
    /* MC: work units are pairs of weight tiles (the pair's second past n_tiles where n_tiles is
     * odd: that CTA computes nothing, but loads and multicasts its token half), cluster c taking
     * units c, c + clusters, ... */
    const uint32_t rank = MC ? cluster_ctarank() : 0;
    const int units = MC ? (p.n_tiles + 1) / 2 : p.n_tiles;
    const int total = nb * units;
    const int first = MC ? blockIdx.x / 2 : blockIdx.x;
    const int stride = MC ? gridDim.x / 2 : gridDim.x;
    /* Row blocks per sweep: set (MOE_GEMM_GROUP), or for the normal layout the step's blocks
     * per expert within [4, GROUP_BLOCKS] (one expert's blocks share each weight tile while it
     * is in L2; fewer blocks a sweep measured faster where experts have few blocks: docs/
     * KERNELS.md, "The variants"), GROUP_BLOCKS for swap-AB. */
    const int group = p.group > 0 ? p.group
                      : SWAP      ? GROUP_BLOCKS
                                  : min(GROUP_BLOCKS, max(4, nb / max(p.num_experts, 1)));
    /* p.group < 0 (normal layout, the permute's counts and offsets given: MOE_GEMM_EXPERT_GROUPS):
     * the sweeps follow the experts. Expert e's blocks fb .. fb + nbe - 1 (fb = its first padded
     * row / TOK, nbe = its rows / TOK rounded up) own items fb x units .. (fb + nbe) x units - 1,
     * taken in ceil(nbe / GROUP_BLOCKS) equal sweeps of its blocks, so no sweep holds the last
     * blocks of one expert and the first of the next (which reads the next expert's weight tiles
     * for a block or two, then again for the rest). A block of no expert keeps its own items. */
    auto item_of = [&](int t, int *b, int *jt) {
        if (p.group >= 0) {
            sm90_item(t, nb, units, b, jt, group);
        } else {
            const int b0 = t / units, e0 = __ldg(p.block_expert + b0);
            if (e0 >= 0 && e0 < p.num_experts) {
                const int fb = __ldg(p.expert_offsets + e0) / TOK;
                const int nbe = (__ldg(p.expert_counts + e0) + TOK - 1) / TOK;
                const int sweeps = (nbe + GROUP_BLOCKS - 1) / GROUP_BLOCKS;
                sm90_item(t - fb * units, nbe, units, b, jt, (nbe + sweeps - 1) / sweeps);
                *b += fb;
            } else {
                *b = b0;
                *jt = t - b0 * units;
            }
        }
        if (MC)
            *jt = 2 * *jt + (int)rank;
    };
    /* item t's (row block, weight tile) and the block's expert, or -1 for a block of no expert
     * (skipped alike by the producer, the consumers and the consumers' look-ahead) */
    auto item_expert = [&](int t, int *b, int *jt) {
        item_of(t, b, jt);
        const int e = __ldg(p.block_expert + *b);
        return e >= 0 && e < p.num_experts ? e : -1;
    };
    constexpr int BKE = sm90_elem<F8>::BKE;
    const int kt_count = (p.k + BKE - 1) / BKE; /* the k tail: TMA zero fill */

    if (wg == C::NWG) { /* producer */
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(C::PRODUCER_REGS));
        /* one thread issues the TMA; SSC: the warp copies the stage's scales beside it */
        if (tid < (C::SSC ? 32 : 1)) {
            int s = 0, ph = 0;
            /* EW: stages filled with weights only before the wait (the first item's first
             * stages, 0 .. pend - 1, k steps 0, KB, ...); their token tiles (row block pb)
             * follow the wait */
            int early = ew ? STAGES : 0, pend = 0, pb = 0;
            /* slice sub of stage si's token tile (k step kt, row block b) */
            auto load_tok = [&](int si, int kt, int b, int sub) {
                uint8_t *st = smem + si * C::STAGE_BYTES;
                if (MC)
                    tma_load_2d_mc(st + C::W_BYTES + sub * C::SUB_T + rank * (TOK / 2) * ROW_BYTES,
                                   &tm_tok, (kt + sub) * BKE, b * TOK + (int)rank * (TOK / 2),
                                   &full[si], 0x3);
                else
                    tma_load_2d(st + C::W_BYTES + sub * C::SUB_T, &tm_tok, (kt + sub) * BKE,
                                b * TOK, &full[si]);
            };
            const int kbn = (p.k + 127) / 128; /* 128-wide k slices (block scales) */
            /* the output columns a weight tile may hold (the n tail: a half past it is empty) */
            const int nlim = EPI == MOE_GEMM_EPI_STORE ? p.n : p.n / 2;
            for (int t = first; t < total; t += stride) {
                int b, jt;
                const int e = item_expert(t, &b, &jt);
                if (e < 0)
                    continue;
                /* MC: a pair's second tile past n (odd n_tiles) loads its token half alone */
                const bool wload = !MC || jt < p.n_tiles;
                int wrow[HALVES];
                bool win[HALVES]; /* the half's first output column is inside n */
#pragma unroll
                for (int h = 0; h < HALVES; h++) {
                    wrow[h] = e * p.n + (EPI == MOE_GEMM_EPI_STORE ? jt * HALVES * WR + h * WR
                                                                   : h * (p.n / 2) + jt * WR);
                    win[h] =
                        (EPI == MOE_GEMM_EPI_STORE ? jt * HALVES * WR + h * WR : jt * WR) < nlim;
                }
                for (int kt = 0; kt < kt_count; kt += KB) {
                    /* k slices past k (last stage, k not a multiple of KB * 64) come back
                     * zero-filled from TMA and still count their bytes: they add nothing. */
                    mbar_wait(&empty[s], ph ^ 1);
                    uint8_t *st = smem + s * C::STAGE_BYTES;
                    if (tid == 0) {
                        /* MC: both token halves land here, this CTA's and the peer's */
                        mbar_expect_tx(&full[s], wload ? C::STAGE_BYTES : C::TOK_BYTES);
#pragma unroll
                        for (int sub = 0; sub < KB; sub++) {
#pragma unroll
                            for (int h = 0; h < HALVES; h++)
                                if (wload)
                                    tma_load_2d(st + sub * C::SUB_W + h * WR * ROW_BYTES, &tm_w,
                                                (kt + sub) * BKE, wrow[h], &full[s]);
                            if (early == 0)
                                load_tok(s, kt, b, sub);
                        }
                        if (early > 0) {
                            pend++;
                            pb = b;
                        }
                    }
                    if (C::SSC) {
                        /* the scales the consumers' promotion of each slice reads, so no
                         * global load waits between two wgmma groups: slice sub's A rows,
                         * then one weight scale per half (slices past k and halves past n
                         * are left alone: the consumers do not read them) */
                        float *sc = sscl + s * KB * C::SC_SLICE;
                        constexpr int SCS = C::SC_SLICE > 0 ? C::SC_SLICE : 1;
                        for (int i = tid; i < KB * C::SC_SLICE; i += 32) {
                            const int sub = i / SCS, j = i - sub * SCS;
                            const int ks = kt + sub;
                            /* the half j - TOK without a run-time index into wrow / win (which
                             * would put them in local memory) */
                            static_assert(HALVES <= 2, "swap-AB: one or two halves");
                            const bool h1 = HALVES > 1 && j > TOK;
                            if (ks >= kbn || (j >= TOK && !(h1 ? win[HALVES - 1] : win[0])))
                                continue;
                            const int hrow = h1 ? wrow[HALVES - 1] : wrow[0];
                            const float *src = j < TOK
                                                   ? p.a_scale + ((int64_t)b * TOK + j) * kbn + ks
                                                   : p.b_scale + (int64_t)hrow * kbn + ks;
                            cp_async_4(sc + i, src);
                        }
                        cp_async_arrive_noinc(&full[s]);
                    }
                    if (++s == STAGES) {
                        s = 0;
                        ph ^= 1;
                    }
                    /* EW: the stages are all asked for, or the item has no more: wait for the
                     * previous kernel, then the held stages' token tiles */
                    if (early > 0 && (--early == 0 || kt + KB >= kt_count)) {
                        early = 0;
                        moe_pdl_wait();
                        for (int j = 0; j < pend; j++)
                            for (int sub = 0; sub < KB; sub++)
                                load_tok(j, j * KB, pb, sub);
                    }
                }
            }
        }
        /* MC: the peer multicasts into this CTA and arrives on its barriers until it is done */
        if (MC)
            cluster_sync();
        return;
    }

    /* The consumers' registers: what the producer gives back (down to PRODUCER_REGS) out of the
     * launch's per-thread share (168 at 384 threads, 128 at 512 (three consumer warpgroups, 64
     * accumulators each), 96 at 640 (four)), split evenly in multiples of 8, at most 232: 232
     * for one or two consumer warpgroups (224 beside a 56-register producer), 152 for three,
     * 104 for four. More would wait forever: setmaxnreg.inc only takes registers the CTA
     * already holds. */
    constexpr int LAUNCH_REGS = (65536 / C::THREADS > 255 ? 255 : 65536 / C::THREADS) / 8 * 8;
    constexpr int CONSUMER_SHARE = (LAUNCH_REGS * (C::NWG + 1) - C::PRODUCER_REGS) / C::NWG / 8 * 8;
    constexpr int CONSUMER_REGS = CONSUMER_SHARE < 232 ? CONSUMER_SHARE : 232;
    static_assert(LAUNCH_REGS * (C::NWG + 1) >= C::PRODUCER_REGS + CONSUMER_REGS * C::NWG,
                  "setmaxnreg.inc beyond the CTA's registers never returns");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
    if (ew) { /* the consumers read scales, tokens and write c only past this wait */
        moe_pdl_wait();
    }
    const int warp = tid / 32, lane = tid % 32;
    float acc[C::NACC][C::ACC];
    /* The wgmmas of one 64-wide k slice `sub` of the stage at shared address st; fresh (FP8):
     * the first k step overwrites d (a promoted slice's partial starts from nothing). */
    auto mma_slice = [&](float(&d)[C::NACC][C::ACC], uint32_t st, int sub, int wgi,
                         bool fresh = false) {
        const uint32_t sw = st + sub * C::SUB_W;
        const uint32_t stk = st + C::W_BYTES + sub * C::SUB_T;
#pragma unroll
        for (int kk = 0; kk < BK / 16; kk++) {
            /* if constexpr: only the wgmma shapes of this instance are named (defined) */
            if constexpr (SWAP) {
#pragma unroll
                for (int j = 0; j < C::WM; j++) {
                    const uint64_t da = sw128_desc(sw + j * 64 * ROW_BYTES + kk * 32);
                    const uint64_t db = sw128_desc(stk + kk * 32);
                    if constexpr (F8 != 0)
                        wgmma_fp8<C::WN>(d[j], da, db, !(fresh && kk == 0));
                    else
                        wgmma_bf16<C::WN>(d[j], da, db);
                }
            } else {
                /* The halves' weight rows lie one after the other in the stage (two TMA boxes
                 * of WR rows, 128 B a row), so one wgmma of N = HALVES x WR reads them both: its
                 * accumulator i < ACC is half 0's element i, i >= ACC half 1's element i - ACC
                 * (column 8 (i / 4) + ...: the second half's columns start at WR), the layout
                 * of d[HALVES][ACC]. One m64n128k32 (fp8) or m64n256k16 (bf16) instead of two
                 * of half the N: half the wgmma issues and descriptors a slice, and the fp8
                 * tiles' 32-cycle m64n64k32 become 64-cycle ones. */
                const uint64_t da = sw128_desc(stk + wgi * 64 * ROW_BYTES + kk * 32);
                const uint64_t db = sw128_desc(sw + kk * 32);
                if constexpr (F8 != 0)
                    wgmma_fp8<HALVES * WR>(&d[0][0], da, db, !(fresh && kk == 0));
                else
                    wgmma_bf16<HALVES * WR>(&d[0][0], da, db);
            }
        }
    };
    /* FP8: each 128 of k accumulates in `part` on the tensor cores, then is added to acc on the
     * CUDA cores in f32, as DeepGEMM promotes: the tensor cores' FP8 accumulation keeps fewer
     * bits than f32 (measured: ~3e-4 relative within one 128-k slice), so a long k would drift
     * without it. */
    constexpr bool PRO = F8 == 1 || F8 == 2; /* promotion (F8 = 3: the tensor cores sum all k) */
    constexpr bool PRI = F8 == 4;            /* promotion every F8_PI slices */
    constexpr bool ERS = !SWAP && f8_row_scales(F8); /* per-row scales in the epilogue, below */
    constexpr bool SRS = SWAP && f8_row_scales(F8);  /* the same for swap-AB, p.swap_fold */
    /* p.amax: the *_MUL epilogues of the fp8 tiles take each row's max |h| (moe_gemm_args_t) */
    constexpr bool AMX = F8 != 0 && EPI != MOE_GEMM_EPI_STORE;
    float part[f8_promoted(F8) ? C::NACC : 1][f8_promoted(F8) ? C::ACC : 1];
    using acc_t = float(&)[C::NACC][C::ACC];
    const int kbn = (p.k + 127) / 128; /* 128-wide k slices (block scales) */
    /* d += part (F8 = 2: times the block scales of each element's A row and weight row). The
     * element -> (row, column) map of a wgmma accumulator: row 16 warp + lane/4 + 8 ((i%4)/2),
     * column 8 (i/4) + 2 (lane%4) + i%2.
     * Block scales: a weight tile (WR rows, WR | 128, aligned in its own matrix: gate, up or
     * down) lies in one 128-row block, so its rows share one scale per k slice -- loaded once per
     * slice, not per element (the backend's per-row scales repeat it; layer.c keeps TP slices
     * 128-aligned); a 96-row one (XB, below) in at most two, two scales a slice. A thread's
     * accumulators touch 2 A rows (normal) or ACC/2 tokens (swap-AB). Swap-AB (SSC): the scales of
     * slice ks come from shared memory, `sc` (the producer copied them in with the stage); normal
     * tiles load them here (e, row0: the item's expert and first A row). */
    auto sc_of = [&](int stage, int sub) { return sscl + (stage * KB + sub) * C::SC_SLICE; };
    constexpr int NA = SWAP ? C::ACC / 2 : 2; /* A rows (tokens) a thread's accumulators touch */
    /* XB: block scales on weight tiles of 96 rows a half (n192), which may cross a 128-row scale
     * block (at column 32 or 64 of the half; multiples of 8, so an accumulator's 8-column group
     * lies on one side): set h's scale is sb[h] below column bc[h] and sb[NACC + h] from it
     * (bc[h] = WR: no boundary). Tiles of 32, 64 or 128 rows lie in one block: sb[h] alone. */
    constexpr bool XB = F8 == 2 && !SWAP && 128 % WR != 0;
    constexpr int NSB = XB ? 2 * C::NACC : C::NACC, NBC = XB ? C::NACC : 1;
    /* XB: the column of a half starting at matrix column c0 from which the next 128-row scale
     * block (and, for GEMM 1's output, the next 1 x 128 group of h) begins, where that column
     * is inside the half and below lim; else WR */
    auto block_split = [](int c0, int lim) {
        const int b = 128 - c0 % 128;
        return b < WR && c0 + b < lim ? b : WR;
    };
    /* The scales of slice ks for this thread's accumulators (F8 = 2; else nothing): sb per
     * accumulator set, sa per A row. Normal tiles load them before the slice's wgmmas, so the
     * loads run under the tensor cores. */
    auto load_scales = [&](float(&sb)[NSB], float(&sa)[NA], int(&bc)[NBC], int ks, int e,
                           int64_t row0, int jt, const float *sc) {
        if (F8 != 2)
            return;
        /* slices past k (a last stage's zero fill) have no scales: nothing to add */
        const bool kin = ks < kbn;
        const int nlim = EPI == MOE_GEMM_EPI_STORE ? p.n : p.n / 2;
#pragma unroll
        for (int h = 0; h < C::NACC; h++) {
            /* the half hh of weight tile rows (gate or up for *_MUL) this accumulator set holds:
             * swap-AB rows 64 h + 16 warp .. + 15 (WR >= 32: one half), normal: slice h */
            const int hh = SWAP ? (64 * h + 16 * warp) / WR : h;
            const int lc0 = EPI == MOE_GEMM_EPI_STORE ? jt * HALVES * WR + hh * WR : jt * WR;
            const int wl0 = EPI == MOE_GEMM_EPI_STORE ? lc0 : hh * (p.n / 2) + lc0;
            if (C::SSC)
                sb[h] = kin && lc0 < nlim ? sc[TOK + hh] : 0.0f;
            else
                sb[h] = kin && lc0 < nlim ? __ldg(p.b_scale + ((int64_t)e * p.n + wl0) * kbn + ks)
                                          : 0.0f;
            if constexpr (XB) {
                /* the first row past the block of the half's first row (matrix rows lc0 ..:
                 * gate and up share their blocks' bounds, I a multiple of 128), and its scale
                 * where that row is inside n */
                bc[h] = block_split(lc0, nlim);
                sb[C::NACC + h] =
                    bc[h] < WR && kin
                        ? __ldg(p.b_scale + ((int64_t)e * p.n + wl0 + bc[h]) * kbn + ks)
                        : sb[h];
            }
        }
#pragma unroll
        for (int j = 0; j < NA; j++) {
            /* normal: rows r16 + 8 j; swap-AB: token columns 8 (j/2) + 2 (lane%4) + j%2 */
            if (C::SSC) /* swap-AB: the item's tokens, from the stage's copy */
                sa[j] = kin ? sc[8 * (j >> 1) + 2 * (lane & 3) + (j & 1)] : 0.0f;
            else {
                const int64_t arow =
                    SWAP ? row0 + 8 * (j >> 1) + 2 * (lane & 3) + (j & 1)
                         : row0 + (PING ? 0 : wg * 64) + 16 * warp + (lane >> 2) + 8 * j;
                sa[j] = kin ? __ldg(p.a_scale + arow * kbn + ks) : 0.0f;
            }
        }
    };
    /* d += pp (F8 = 2: times the scales load_scales gave) */
    auto apply = [&](acc_t d, acc_t pp, const float(&sb)[NSB], const float(&sa)[NA],
                     const int(&bc)[NBC]) {
#pragma unroll
        for (int h = 0; h < C::NACC; h++)
#pragma unroll
            for (int i = 0; i < C::ACC; i++) {
                reg_fence(pp[h][i]);
                const int j = SWAP ? 2 * (i >> 2) + (i & 1) : (i & 3) >> 1;
                if constexpr (XB) /* element i's 8-column group starts at column 8 (i / 4) */
                    d[h][i] +=
                        pp[h][i] * (sa[j] * (8 * (i >> 2) < bc[h] ? sb[h] : sb[C::NACC + h]));
                else if constexpr (F8 == 2)
                    d[h][i] += pp[h][i] * (sa[j] * sb[h]);
                else
                    d[h][i] += pp[h][i];
            }
    };
    /* a stage read: lane 0 of each consumer warp frees it (MC: in both CTAs) */
    auto release = [&](int stage) {
        if (MC) {
            mbar_arrive_cta(&empty[stage], 0);
            mbar_arrive_cta(&empty[stage], 1);
        } else
            mbar_arrive(&empty[stage]);
    };
    /* A consumer warpgroup whose 64 rows of item (e, row0) are all padding (below) */
    auto pad_of = [&](int e, int64_t row0) {
        return !PING && C::NWG > 1 && wg > 0 && p.expert_counts &&
               __ldg(p.expert_counts + e) - (int)(row0 - __ldg(p.expert_offsets + e)) <= wg * 64;
    };
    /* LA (promoted every F8_PI slices, cooperative, no cluster): once an item's main loop is
     * done, the warpgroup issues the first stage of its next item's wgmmas into the partial
     * sums and runs the epilogue (on acc) while the tensor cores compute them; `pre`: the
     * current item's first stage is in flight (ring stage pre_stage), its main loop starts at
     * the second. docs/KERNELS.md, "Epilogue under the next item's first stage". */
    constexpr bool LAH = LA && (F8 == 4 || (F8 == 2 && KB == 1)) && !SWAP && !PING && !MC;
    static_assert(!LA || LAH, "LA: the promoted fp8 tiles (block scales: one slice a stage)");
    bool pre = false;
    int pre_stage = 0;
    int s = 0, ph = 0, mine = 0, tph = 0;
    for (int t = first; t < total; t += stride) {
        int b, jt;
        const int e = item_expert(t, &b, &jt);
        if (e < 0)
            continue;
        /* PING: the other warpgroup's item; its stages go by in the ring (same count for every
         * item: k is the same). Then this one's main loop waits for its turn: the other's main
         * loop has passed all its stages, so this one's first stages are at most one phase
         * ahead of their barriers (a parity wait further ahead would pass on an old phase). */
        if (PING) {
            if ((mine++ & 1) != wg) {
                for (int kt = 0; kt < kt_count; kt += KB)
                    if (++s == STAGES) {
                        s = 0;
                        ph ^= 1;
                    }
                continue;
            }
            mbar_wait(&turn[wg], tph);
            tph ^= 1;
        }
#pragma unroll
        for (int h = 0; h < C::NACC; h++)
#pragma unroll
            for (int i = 0; i < C::ACC; i++) {
                acc[h][i] = 0.0f;
                reg_fence(acc[h][i]);
            }
        const int64_t row0 = (int64_t)b * TOK;
        /* An expert's last block is mostly padding when its rows just pass a multiple of TOK
         * (130 rows: 128 + 2). A consumer warpgroup whose 64 rows are all padding passes the
         * item's stages through (the other one runs the tensor cores alone, about twice as
         * fast) and stores nothing: padding rows of c are never read. */
        const bool pad = pad_of(e, row0);
        /* MC: so does every warpgroup of a pair's second tile past n */
        if (pad || (MC && jt >= p.n_tiles)) {
            for (int kt = 0; kt < kt_count; kt += KB) {
                mbar_wait(&full[s], ph);
                if (lane == 0)
                    release(s);
                if (++s == STAGES) {
                    s = 0;
                    ph ^= 1;
                }
            }
            continue;
        }
        /* FP8 per-row scales, normal layout: each accumulator is multiplied by its A row's and
         * weight row's scale once the main loop is done (acc *= (s_a x s_b), then the epilogue
         * as bf16's). A thread's 2 A rows and the weight rows of its output columns (column
         * 8 g + 2 (lane % 4) + u of set h's WR: fb[h][g][u]) are loaded before the main loop
         * where the registers allow (two consumer warpgroups, 32 scales a thread: the loop hides
         * their latency); else (m192's 128 registers a thread, the fast tiles' 64 scales) their
         * lines are asked into L1 here and read after the loop, two columns at a time. Loaded
         * per output between the epilogue's stores (which may alias them), each waited in turn:
         * Nsight Compute had Qwen3's GEMM 2 at M = 8192 stalled on them half its cycles.
         * p.b_uniform (per-tensor weights): one weight scale a set, read after the loop. */
        constexpr int NG = ERS ? C::ACC / 4 : 1;
        constexpr bool EARLY = C::NWG <= 2 && NG <= 8;
        const int64_t frow = row0 + (PING ? 0 : wg * 64) + 16 * warp + (lane >> 2); /* +0, +8 */
        auto fcol = [&](int h, int g, int u) {
            const int wc = 8 * g + 2 * (lane & 3) + u;
            return EPI == MOE_GEMM_EPI_STORE ? jt * HALVES * WR + h * WR + wc : jt * WR + wc;
        };
        /* the weight row of output column col, set h */
        auto fptr = [&](int h, int col) {
            return p.b_scale + (int64_t)e * p.n +
                   (EPI == MOE_GEMM_EPI_STORE ? col : h * (p.n / 2) + col);
        };
        float fa[2] = {1.0f, 1.0f}, fb[EARLY ? C::NACC : 1][EARLY ? NG : 1][2];
        if (ERS && EARLY) {
            fa[0] = ldg_at(p.a_scale + frow);
            fa[1] = ldg_at(p.a_scale + frow + 8);
            if (!p.b_uniform) {
#pragma unroll
                for (int h = 0; h < C::NACC; h++)
#pragma unroll
                    for (int g = 0; g < NG; g++)
#pragma unroll
                        for (int u = 0; u < 2; u++) {
                            const int col = fcol(h, g, u);
                            fb[h][g][u] = col < p.n_out ? ldg_at(fptr(h, col)) : 0.0f;
                        }
            }
        } else if (ERS) {
            /* 32 scales a 128-byte line: the set's WR columns, the warpgroup's 64 rows */
            constexpr int LINES = WR / 32;
            if (tid < C::NACC * LINES) {
                const int h = tid / LINES,
                          col = (EPI == MOE_GEMM_EPI_STORE ? jt * HALVES * WR + h * WR : jt * WR) +
                                32 * (tid % LINES);
                if (col < p.n_out && !p.b_uniform) /* b_uniform: one scale a set, read after */
                    asm volatile("prefetch.global.L1 [%0];" ::"l"(fptr(h, col)));
            } else if (tid >= 64 && tid < 66)
                asm volatile("prefetch.global.L1 [%0];" ::"l"(
                    p.a_scale + row0 + (PING ? 0 : wg * 64) + 32 * (tid - 64)));
        }
        /* Swap-AB, per-row scales (p.swap_fold): a thread's accumulators lie on 2 weight rows a
         * wgmma (sb[j][q]: row 64 j + 16 warp + lane / 4 + 8 q of the tile) and TOK / 4 tokens
         * (sa[g][u]: token 8 g + 2 (lane % 4) + u), their scales loaded here and multiplied in
         * after the main loop, so the epilogue's loop over the staged outputs loads none
         * between its stores. */
        constexpr int SG = SRS ? TOK / 8 : 1;
        float sa[SG][2], sb[SRS ? C::WM : 1][2];
        const bool sfold = SRS && p.swap_fold;
        if (sfold) {
#pragma unroll
            for (int g = 0; g < SG; g++)
#pragma unroll
                for (int u = 0; u < 2; u++)
                    sa[g][u] = ldg_at(p.a_scale + row0 + 8 * g + 2 * (lane & 3) + u);
            constexpr int OC = 64 * C::WM / HALVES; /* output columns of the item */
#pragma unroll
            for (int j = 0; j < (SRS ? C::WM : 1); j++)
#pragma unroll
                for (int q = 0; q < 2; q++) {
                    const int r = 64 * j + 16 * warp + (lane >> 2) + 8 * q; /* staging row */
                    const int half = r / OC, col = jt * OC + r % OC;
                    sb[j][q] = col < p.n_out
                                   ? ldg_at(p.b_scale + (int64_t)e * p.n + half * (p.n / 2) + col)
                                   : 0.0f;
                }
        }
        int s_prev = -1;
        /* PRI: slices summed in the partial since its last promotion (every p.promo_pi; the
         * cooperative tiles' warpgroups staggered by a fraction of an interval measured level:
         * bench/RESULTS.md, "Tried and rejected") */
        int pcnt = 0;
        bool pfresh = true; /* the partial's next slice overwrites it */
        int kt0 = 0;
        if constexpr (LAH) {
            if (__all_sync(0xffffffffu, pre)) { /* the first stage went out under the epilogue */
                pre = false;
                kt0 = KB;
                pcnt = KB;
                pfresh = false;
                s_prev = pre_stage;
                /* promoted now where the stage is a whole interval: block scales' every slice
                 * (with its scales), or a per-row interval of one stage */
                if (PRO || pcnt >= p.promo_pi) {
                    float sb[NSB] = {}, sa[NA] = {};
                    int bc[NBC] = {};
                    load_scales(sb, sa, bc, 0, e, row0, jt, sc_of(pre_stage, 0)); /* PRO only */
                    wgmma_wait<0>();
                    if (lane == 0)
                        release(s_prev);
                    s_prev = -1;
                    pcnt = 0;
                    pfresh = true;
                    apply(acc, reinterpret_cast<acc_t>(part), sb, sa, bc);
                }
            }
        }
        for (int kt = kt0; kt < kt_count; kt += KB) {
            mbar_wait(&full[s], ph);
            const uint32_t st = smem_u32(smem + s * C::STAGE_BYTES);
            if (PRO) {
                /* promote after every 128 of k (one slice), as DeepGEMM does: the slice's
                 * wgmmas are waited for before its partial is read (reading it while other
                 * wgmmas are in flight makes ptxas serialize every wgmma: C7514) */
#pragma unroll
                for (int sub = 0; sub < KB; sub++) {
                    /* the block scales first: their loads run under the wgmmas */
                    float sb[NSB], sa[NA];
                    int bc[NBC];
                    load_scales(sb, sa, bc, kt + sub, e, row0, jt, sc_of(s, sub));
                    wgmma_fence();
                    mma_slice(reinterpret_cast<acc_t>(part), st, sub, PING ? 0 : wg, true);
                    wgmma_commit();
                    wgmma_wait<0>();
                    /* the stage is read (the scales are not in it): free it before the adds */
                    if (sub == KB - 1 && !C::SSC && lane == 0)
                        release(s);
                    apply(acc, reinterpret_cast<acc_t>(part), sb, sa, bc);
                }
                if (C::SSC) {
                    __syncwarp();
                    if (lane == 0)
                        release(s);
                }
            } else {
                /* one stage's wgmma group kept in flight across stages; PRI: into the partial,
                 * which sums F8_PI slices and is read (promoted) only once all of them are
                 * waited for, at the interval's last stage or k's */
                acc_t d = PRI ? reinterpret_cast<acc_t>(part) : acc;
                wgmma_fence();
#pragma unroll
                for (int sub = 0; sub < KB; sub++)
                    mma_slice(d, st, sub, PING ? 0 : wg, PRI && pfresh && sub == 0);
                wgmma_commit();
                pfresh = false;
                pcnt += KB;
                if (PRI && (pcnt >= p.promo_pi || kt + KB >= kt_count)) {
                    pcnt = 0;
                    pfresh = true;
                    wgmma_wait<0>();
                    if (lane == 0) {
                        if (s_prev >= 0)
                            release(s_prev);
                        release(s);
                    }
                    s_prev = -1;
                    /* per-row scales: the epilogue's */
                    const float sb[NSB] = {}, sa[NA] = {};
                    const int bc[NBC] = {};
                    apply(acc, d, sb, sa, bc);
                } else {
                    /* the previous stage's wgmmas are done: its stage is free */
                    wgmma_wait<1>();
                    if (s_prev >= 0 && lane == 0)
                        release(s_prev);
                    s_prev = s;
                }
            }
            if (++s == STAGES) {
                s = 0;
                ph ^= 1;
            }
        }
        if (PING && tid == 0)
            mbar_arrive(&turn[wg ^ 1]); /* every stage of this item waited for: its turn */
        wgmma_wait<0>();
#pragma unroll
        for (int h = 0; h < C::NACC; h++)
#pragma unroll
            for (int i = 0; i < C::ACC; i++)
                reg_fence(acc[h][i]);
        if (s_prev >= 0 && lane == 0)
            release(s_prev);
        if constexpr (LAH) {
            /* the next item this warpgroup computes (items of no expert skipped, as the loop
             * does), unless its rows are padding here or its k is one stage */
            int t2 = t + stride, b2 = 0, jt2 = 0, e2 = -1;
            while (t2 < total && (e2 = item_expert(t2, &b2, &jt2)) < 0)
                t2 += stride;
            /* a vote: ptxas must see the branches as uniform, or it serializes every wgmma of
             * the kernel (C7518) */
            const bool go = __all_sync(0xffffffffu, t2 < total && kt_count > KB &&
                                                        !pad_of(e2, (int64_t)b2 * TOK));
            if (go)
                mbar_wait(&full[s], ph);
            /* Issued either way: the partial sums defined on one path only would need a copy
             * where the paths join, and ptxas waits for the wgmmas before it (C7517), so the
             * epilogue would not run under them. Without a next item the group reads this
             * item's last stage again (released, perhaps being refilled): its sums are never
             * read (a later item's first wgmma starts the partial afresh, behind it). */
            const int sx = go ? s : (s + STAGES - 1) % STAGES;
            const uint32_t st = smem_u32(smem + sx * C::STAGE_BYTES);
            wgmma_fence();
#pragma unroll
            for (int sub = 0; sub < KB; sub++)
                mma_slice(reinterpret_cast<acc_t>(part), st, sub, wg, sub == 0);
            wgmma_commit();
            pre = go;
            pre_stage = s;
            if (go && ++s == STAGES) {
                s = 0;
                ph ^= 1;
            }
        }
        if (sfold) {
#pragma unroll
            for (int j = 0; j < (SRS ? C::WM : 1); j++)
#pragma unroll
                for (int i = 0; i < C::ACC; i++) /* row 8 ((i % 4) / 2), token 8 (i / 4) + i % 2 */
                    acc[j][i] *= sa[i >> 2][i & 1] * sb[j][(i & 3) >> 1];
        }
        if (ERS && !EARLY) {
            fa[0] = ldg_at(p.a_scale + frow);
            fa[1] = ldg_at(p.a_scale + frow + 8);
        }
        if (ERS && p.b_uniform) {
            /* one weight scale a set (fptr(h, 0): the expert's first row of set h; STORE's
             * sets share it), columns past n_out times 0 as below */
            float bu[C::NACC];
#pragma unroll
            for (int h = 0; h < C::NACC; h++)
                bu[h] = ldg_at(fptr(h, 0));
#pragma unroll
            for (int h = 0; h < C::NACC; h++)
#pragma unroll
                for (int g = 0; g < NG; g++)
#pragma unroll
                    for (int v = 0; v < 4; v++)
                        acc[h][4 * g + v] *=
                            fcol(h, g, v & 1) < p.n_out ? fa[v >> 1] * bu[h] : 0.0f;
        } else if (ERS) {
#pragma unroll
            for (int h = 0; h < C::NACC; h++)
#pragma unroll
                for (int g = 0; g < NG; g++) {
                    float b[2];
#pragma unroll
                    for (int u = 0; u < 2; u++) {
                        const int col = fcol(h, g, u);
                        b[u] = EARLY           ? fb[EARLY ? h : 0][EARLY ? g : 0][u]
                               : col < p.n_out ? ldg_at(fptr(h, col))
                                               : 0.0f;
                    }
                    /* element 4 g + v: row 8 (v / 2), column u = v % 2 */
#pragma unroll
                    for (int v = 0; v < 4; v++)
                        acc[h][4 * g + v] *= fa[v >> 1] * b[v & 1];
                }
        }

        /* moe_gemm_args_t.row_amax: each row's max |output| (block scales: per 128 columns,
         * the next GEMM's 1 x 128 groups; an item's columns lie in one group, but for XB's 96
         * columns, which may span two: those from the item's column gb on (a multiple of 8;
         * WR: none) go to the second), so the quantisation of h need not find it. amax_pair
         * takes a thread's two outputs at columns col, col + 1 (those past n_out left out);
         * amax_rows reduces rows r0 and r0 + 8 over the quad that holds them (lanes 4j .. 4j +
         * 3) and puts them. */
        const int gb = XB ? block_split(jt * WR, p.n_out) : WR;
        auto amax_at = [&](int64_t row, int col) {
            return p.amax + (F8 == 2 ? row * ((p.n_out + 127) / 128) + col / 128 : row);
        };
        auto amax_pair = [&](float &m, int col, float v0, float v1) {
            if (col < p.n_out)
                m = fmaxf(m, fabsf(v0));
            if (col + 1 < p.n_out)
                m = fmaxf(m, fabsf(v1));
        };
        auto amax_rows = [&](float(&m)[2], int64_t r0, int col0) {
            if (!p.amax)
                return;
#pragma unroll
            for (int q = 0; q < 2; q++) {
                m[q] = fmaxf(m[q], __shfl_xor_sync(0xffffffffu, m[q], 1));
                m[q] = fmaxf(m[q], __shfl_xor_sync(0xffffffffu, m[q], 2));
                if ((lane & 3) == 0)
                    moe_gemm_amax_put(p, amax_at(r0 + 8 * q, col0), m[q]);
            }
        };

        /* Epilogue. Accumulator i of a thread: wgmma row 16*warp + lane/4 + 8*((i%4)/2),
         * column 8*(i/4) + 2*(lane%4) + i%2. (row0: the item's first A row, above.) */
        if (SWAP) {
            constexpr int OC = 64 * C::WM / HALVES;                /* output columns of the item */
            float *se = sepi + (PING ? wg : 0) * C::EPI_WG_FLOATS; /* this warpgroup's staging */
            float *sscale = se + 64 * C::WM * C::EPI_LD;
            named_bar_sync(2 + wg, 128); /* the last item's readers are done */
            if (tid < TOK)
                sscale[tid] = moe_gemm_row_scale(p, row0 + tid);
#pragma unroll
            for (int i = 0; i < C::ACC; i++) {
                int wr = 16 * warp + (lane >> 2) + 8 * ((i & 3) >> 1);
                int tk = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
#pragma unroll
                for (int j = 0; j < C::WM; j++)
                    se[(64 * j + wr) * C::EPI_LD + tk] = acc[j][i];
            }
            named_bar_sync(2 + wg, 128);
            /* OC is 32 or 64: a warp's 32 outputs of one pass lie on one token row (amax) */
            static_assert(OC % 32 == 0 && 128 % OC == 0, "swap-AB epilogue: whole warps a row");
            for (int idx = tid; idx < OC * TOK; idx += 128) {
                int oc = idx % OC, tk = idx / OC;
                const int col = jt * OC + oc;
                float v = se[oc * C::EPI_LD + tk];
                const bool in = col < p.n_out;
                if (in || !F8) {
                    if (f8_row_scales(F8) && !sfold)
                        v *= sm90_f8_scale(p, row0 + tk, e, col);
                    if (EPI != MOE_GEMM_EPI_STORE) {
                        float u = se[(OC + oc) * C::EPI_LD + tk];
                        if (f8_row_scales(F8) && !sfold)
                            u *= sm90_f8_scale(p, row0 + tk, e, p.n / 2 + col);
                        v = moe_gemm_act_mul<EPI>(v, u);
                    }
                    v *= sscale[tk];
                    moe_gemm_put1(p, row0 + tk, col, v);
                }
                if (AMX && p.amax) {
                    const unsigned m = __reduce_max_sync(
                        0xffffffffu, __float_as_uint(in ? fmaxf(0.0f, fabsf(v)) : 0.0f));
                    if (lane == 0)
                        moe_gemm_amax_put(p, amax_at(row0 + tk, jt * OC), __uint_as_float(m));
                }
            }
        } else if (C::TS && p.tma_store) {
            /* bf16 rows through shared memory: each consumer warpgroup writes its 64 rows x WR
             * columns (a slice of STORE's 2 WR, or *_MUL's WR outputs) into [64 x TSW] boxes
             * with the swizzle of their rows (TSW 64, 128-byte rows: 16-byte chunk j of row r
             * at j ^ (r % 8); TSW 32, 64-byte rows: at j ^ (r / 2 % 4); either way a warp's
             * stores of one accumulator pair, 8 rows x 16 bytes, cover 32 banks), then one
             * thread stores the boxes by TMA and the warpgroup goes on to its next item while
             * they drain. */
            const uint32_t sbuf = smem_u32((uint8_t *)sepi + wg * C::TS_BYTES);
            const int r = 16 * warp + (lane >> 2); /* rows r and r + 8 of the warpgroup's 64 */
            const int64_t grow = row0 + (PING ? 0 : wg * 64);
            const float sc[2] = {moe_gemm_row_scale(p, grow + r),
                                 moe_gemm_row_scale(p, grow + r + 8)};
            constexpr int ROUNDS = EPI == MOE_GEMM_EPI_STORE ? HALVES : 1;
            float mx[2] = {0.0f, 0.0f}, mxh[2] = {0.0f, 0.0f}; /* AMX: rows r, r + 8 (XB: gb on) */
#pragma unroll
            for (int h = 0; h < ROUNDS; h++) {
                /* the buffer is free once the last boxes stored from it have been read */
                if (tid == 0)
                    asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
                named_bar_sync(2 + wg, 128);
#pragma unroll
                for (int i = 0; i < C::ACC; i += 2) {
                    const int q = (i & 3) >> 1, row = r + 8 * q;
                    const int wc = 8 * (i >> 2) + 2 * (lane & 3); /* column in the 128 */
                    float v0, v1;
                    if (EPI == MOE_GEMM_EPI_STORE) {
                        v0 = acc[h][i] * sc[q];
                        v1 = acc[h][i + 1] * sc[q];
                    } else {
                        v0 = moe_gemm_act_mul<EPI>(acc[0][i], acc[C::NACC - 1][i]) * sc[q];
                        v1 = moe_gemm_act_mul<EPI>(acc[0][i + 1], acc[C::NACC - 1][i + 1]) * sc[q];
                        if (AMX)
                            amax_pair(XB && wc >= gb ? mxh[q] : mx[q], jt * WR + wc, v0, v1);
                    }
                    constexpr int TRB = C::TSW * 2; /* bytes a box row */
                    const uint32_t off =
                        (wc / C::TSW) * (64 * TRB) + row * TRB +
                        ((((wc % C::TSW) >> 3) ^ (C::TSW == 64 ? row & 7 : (row >> 1) & 3)) << 4) +
                        (wc & 7) * 2;
                    __nv_bfloat162 v = __floats2bfloat162_rn(v0, v1);
                    asm volatile("st.shared.b32 [%0], %1;" ::"r"(sbuf + off),
                                 "r"(*reinterpret_cast<uint32_t *>(&v))
                                 : "memory");
                }
                /* the generic-proxy writes must be visible to the TMA (async proxy) reads */
                asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
                named_bar_sync(2 + wg, 128);
                if (tid == 0) {
                    const int col0 =
                        EPI == MOE_GEMM_EPI_STORE ? jt * HALVES * WR + h * WR : jt * WR;
#pragma unroll
                    for (int bx = 0; bx < WR / C::TSW; bx++)
                        if (col0 + bx * C::TSW < p.n_out)
                            tma_store_2d(&tm_c, sbuf + bx * 64 * C::TSW * 2, col0 + bx * C::TSW,
                                         (int)grow);
                    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
                }
            }
            if (AMX) {
                amax_rows(mx, grow + r, jt * WR);
                if (XB && gb < WR)
                    amax_rows(mxh, grow + r, jt * WR + gb);
            }
        } else {
            /* a thread's outputs lie on two rows: 8 apart */
            const int64_t row = row0 + (PING ? 0 : wg * 64) + 16 * warp + (lane >> 2);
            const float sc[2] = {moe_gemm_row_scale(p, row), moe_gemm_row_scale(p, row + 8)};
            float mx[2] = {0.0f, 0.0f}, mxh[2] = {0.0f, 0.0f}; /* AMX: rows row, row + 8 */
#pragma unroll
            for (int i = 0; i < C::ACC; i += 2) {
                const int q = (i & 3) >> 1;
                const int wc = 8 * (i >> 2) + 2 * (lane & 3);
                if (EPI == MOE_GEMM_EPI_STORE) {
#pragma unroll
                    for (int h = 0; h < HALVES; h++)
                        moe_gemm_put2(p, row + 8 * q, jt * HALVES * WR + h * WR + wc,
                                      acc[h][i] * sc[q], acc[h][i + 1] * sc[q]);
                } else {
                    const float v0 = moe_gemm_act_mul<EPI>(acc[0][i], acc[C::NACC - 1][i]) * sc[q];
                    const float v1 =
                        moe_gemm_act_mul<EPI>(acc[0][i + 1], acc[C::NACC - 1][i + 1]) * sc[q];
                    moe_gemm_put2(p, row + 8 * q, jt * WR + wc, v0, v1);
                    if (AMX)
                        amax_pair(XB && wc >= gb ? mxh[q] : mx[q], jt * WR + wc, v0, v1);
                }
            }
            if (AMX) {
                amax_rows(mx, row, jt * WR);
                if (XB && gb < WR)
                    amax_rows(mxh, row, jt * WR + gb);
            }
        }
    }
    if constexpr (LAH) /* the last item's look-ahead group: done before the CTA goes */
        wgmma_wait<0>();
    /* the last boxes must be written before the CTA (and its shared memory) goes */
    if (C::TS && p.tma_store && tid == 0)
        asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    if (MC) /* the producer's cluster_sync, above */
        cluster_sync();
#endif
}

/* ---- host side ------------------------------------------------------------------------------ */

static PFN_cuTensorMapEncodeTiled_v12000 encode_fn(void)
{
    static PFN_cuTensorMapEncodeTiled_v12000 fn;
    PFN_cuTensorMapEncodeTiled_v12000 f = __atomic_load_n(&fn, __ATOMIC_ACQUIRE);
    if (f)
        return f;
    void *ptr = NULL;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess || !ptr)
        return NULL;
    f = (PFN_cuTensorMapEncodeTiled_v12000)ptr;
    __atomic_store_n(&fn, f, __ATOMIC_RELEASE);
    return f;
}

/* Row-major bf16 [rows, k] with a box of [box_rows, 64] (e4m3, f8 = 1: [box_rows, 128]),
 * 128-byte swizzle; box_k 32 (bf16): [box_rows, 32], 64-byte swizzle. */
static moe_status_t encode_map(CUtensorMap *map, const void *ptr, int64_t rows, int k, int box_rows,
                               const char *name, int f8 = 0, int box_k = BK)
{
    PFN_cuTensorMapEncodeTiled_v12000 f = encode_fn();
    if (!f)
        return moe_error(MOE_STATUS_CUDA_ERROR, "%s: cuTensorMapEncodeTiled not found in driver",
                         name);
    cuuint64_t dims[2] = {(cuuint64_t)k, (cuuint64_t)rows};
    cuuint64_t strides[1] = {(cuuint64_t)k * (f8 ? 1 : 2)};
    cuuint32_t box[2] = {(cuuint32_t)(f8 ? 128 : box_k), (cuuint32_t)box_rows};
    cuuint32_t estr[2] = {1, 1};
    CUresult r = f(map, f8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2,
                   (void *)ptr, dims, strides, box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                   !f8 && box_k == 32 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B,
                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS)
        return moe_error(MOE_STATUS_CUDA_ERROR,
                         "%s: cuTensorMapEncodeTiled(rows %lld, k %d, box %d) failed: %d", name,
                         (long long)rows, k, box_rows, (int)r);
    return MOE_STATUS_SUCCESS;
}

/* MOE_GEMM_PDL=0 turns programmatic dependent launch off: the kernel's prologue then no longer
 * overlaps the previous kernel on the stream. */
static int pdl_enabled(void)
{
    static int cached = -1;
    return moe_env_once(&cached, "MOE_GEMM_PDL", 1) != 0;
}

/* MOE_GEMM_TMA_STORE=0 makes the normal-layout epilogue (bf16 and fp8) store from registers
 * instead of through shared memory and TMA. */
static int tma_store_enabled(void)
{
    static int cached = -1;
    return moe_env_once(&cached, "MOE_GEMM_TMA_STORE", 1) != 0;
}

/* MOE_GEMM_SWAP_FOLD=0 makes the swap-AB fp8 tiles (per-row scales) load each output's two
 * scales in the epilogue instead of multiplying them in after the main loop (an A/B knob). */
static int swap_fold_enabled(void)
{
    static int cached = -1;
    return moe_env_once(&cached, "MOE_GEMM_SWAP_FOLD", 1) != 0;
}

/* The normal tiles read one weight scale a half where the caller says b_scale is uniform
 * (moe_gemm_args_t.b_scale_uniform) instead of one a column after the main loop, two at a time
 * (5.5 % of the n192 SiLU tile's stall samples: bench/RESULTS.md, "SiLU and scale loads").
 * Measured against the per-column reads (2026-12-05, 8631004, one H100, two runs, capacity
 * 8192): per-tensor Mixtral-8x7B 0.98 / 0.98-0.99 and Qwen3-30B-A3B 0.99 / 0.95 at 2048 / 8192
 * tokens (bench/RESULTS.md, "Uniform weight scales"). MOE_GEMM_B_UNIFORM=0 (an A/B knob) keeps
 * the per-column reads. */
static int b_uniform_enabled(void)
{
    static int cached = -1;
    return moe_env_once(&cached, "MOE_GEMM_B_UNIFORM", 1) != 0;
}

/* MOE_GEMM_PROMO_SLICES=N: the slices of 128 k a promotion of the F8 = 4 tiles sums (default
 * F8_PI; the swap-AB tiles promote at whole stages, so at least their KB). An A/B knob: more
 * slices, fewer drains of the wgmma pipeline and fewer bits kept (docs/KERNELS.md, "Promotion
 * interval"). */
static int promo_slices(void)
{
    static int cached = -1;
    return moe_env_once(&cached, "MOE_GEMM_PROMO_SLICES", F8_PI); /* 1..64: base/env.c */
}

/* MOE_GEMM_GROUP=N sweeps N row blocks at a time over the weight tiles; 0 or unset: the
 * kernel's rule (by blocks per expert). */
static int sweep_group(void)
{
    static int cached = -1;
    return moe_env_once(&cached, "MOE_GEMM_GROUP", 0);
}

/* MOE_GEMM_EXPERT_GROUPS=0 makes the normal layout's sweeps take row blocks `group` at a time
 * across experts (the rule before 2026-12-04) instead of one expert's blocks at a time. */
static int expert_groups_enabled(void)
{
    static int cached = -1;
    return moe_env_once(&cached, "MOE_GEMM_EXPERT_GROUPS", 1) != 0;
}

/* MOE_GEMM_MAX_CTAS=N caps the sm_90 GEMMs' persistent grid at N CTAs (0 or unset: one per SM):
 * measures whether few-item steps are limited by the SMs streaming or by HBM (split-K's case). */
static int max_ctas(void)
{
    static int cached = -1;
    return moe_env_once(&cached, "MOE_GEMM_MAX_CTAS", 0);
}

/* The launch attribute of the _mc tiles' 2-CTA clusters (along x). */
static cudaLaunchAttribute cluster_pair_attr(void)
{
    cudaLaunchAttribute a = {};
    a.id = cudaLaunchAttributeClusterDimension;
    a.val.clusterDim.x = 2;
    a.val.clusterDim.y = 1;
    a.val.clusterDim.z = 1;
    return a;
}

/* The most 2-CTA clusters of `kernel` resident at once on device dev (its GPCs' SM counts
 * decide: one CTA an SM), asked once per device; 0 on error. */
static int mc_clusters(const void *kernel, int smem, int threads, int dev, int *cache)
{
    int n = __atomic_load_n(&cache[dev], __ATOMIC_ACQUIRE);
    if (n > 0)
        return n;
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[1] = {cluster_pair_attr()};
    cfg.gridDim = dim3(2);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess || n <= 0) {
        (void)cudaGetLastError(); /* not left for a later launch check to report */
        return 0;
    }
    __atomic_store_n(&cache[dev], n, __ATOMIC_RELEASE);
    return n;
}

template <int SWAP, int TOK, int WR, int HALVES, int EPI, int STAGES, int KB = 1, int F8 = 0,
          int PING = 0, int MC = 0, int LA = 0>
static moe_status_t launch_one(const moe_gemm_args_t *a, cudaStream_t stream, const char *name)
{
    using C = sm90_cfg<SWAP, TOK, WR, HALVES, STAGES, KB, F8, PING>;
    static int smem_done[MOE_MAX_DEVICES], clusters[MOE_MAX_DEVICES];
    auto kernel = moe_gemm_sm90_kernel<SWAP, TOK, WR, HALVES, EPI, STAGES, KB, F8, PING, MC, LA>;
    int dev, sms;
    MOE_CHECK(moe_gemm_device_sms(name, &dev, &sms));
    MOE_CHECK(moe_gemm_smem_once(name, (const void *)kernel, C::SMEM, dev, smem_done));

    moe_gemm_kparams p = moe_gemm_base_params(a);
    if (EPI == MOE_GEMM_EPI_STORE) {
        p.n_out = a->n;
        p.n_tiles = (a->n + HALVES * WR - 1) / (HALVES * WR);
    } else {
        p.n_out = a->n / 2;
        p.n_tiles = (a->n / 2 + WR - 1) / WR; /* the n tail: masked stores */
    }
    /* MC: the clusters resident at once, asked at prepare (max_blocks 0) rather than in a step;
     * none (a device that fits no pair) fails the launches of this variant only */
    const int pairs =
        MC ? mc_clusters((const void *)kernel, C::SMEM, C::THREADS, dev, clusters) : 0;
    int64_t items = (int64_t)a->max_blocks * p.n_tiles;
    if (items == 0)
        return MOE_STATUS_SUCCESS;
    if (MC && pairs <= 0)
        return moe_error(MOE_STATUS_CUDA_ERROR, "%s: no 2-CTA cluster fits on device %d", name,
                         dev);
    CUtensorMap tm_tok, tm_w;
    /* MC: each CTA of a pair loads half of the token tile */
    MOE_CHECK(encode_map(&tm_tok, a->a, (int64_t)a->max_blocks * TOK, a->k, MC ? TOK / 2 : TOK,
                         name, F8));
    MOE_CHECK(encode_map(&tm_w, a->b, (int64_t)a->num_experts * a->n, a->k, WR, name, F8));
    /* c as [rows, n_out] bf16 in [64 x TSW] boxes (the TMA-store epilogue; else unused) */
    CUtensorMap tm_c = tm_tok;
    p.tma_store = C::TS && !a->c_f32 && tma_store_enabled();
    if (p.tma_store)
        MOE_CHECK(
            encode_map(&tm_c, a->c, (int64_t)a->max_blocks * TOK, p.n_out, 64, name, 0, C::TSW));
    int grid = (int)(items < sms ? items : sms);
    if (max_ctas() > 0 && grid > max_ctas())
        grid = max_ctas();
    if (a->max_ctas > 0 && grid > a->max_ctas)
        grid = a->max_ctas;
    if (MC) {
        /* pairs of CTAs, as many as are resident at once (a pair waits on its peer) and at
         * most one a pair of weight tiles */
        const int64_t units = (int64_t)a->max_blocks * ((p.n_tiles + 1) / 2);
        int64_t g = grid / 2 < pairs ? grid / 2 : pairs;
        if (g > units)
            g = units;
        grid = 2 * (int)(g > 0 ? g : 1);
    }
    p.group = sweep_group();
    if (!p.group && !SWAP && a->expert_counts && a->expert_offsets && expert_groups_enabled())
        p.group = -1; /* one expert's blocks a sweep */
    p.swap_fold = SWAP && f8_row_scales(F8) && swap_fold_enabled();
    p.b_uniform = !SWAP && f8_row_scales(F8) && a->b_scale_uniform && b_uniform_enabled();
    p.promo_pi = F8 == 4 ? promo_slices() : F8_PI;
    p.early_w = a->early_weights && pdl_enabled(); /* the kernel takes it where it can */
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute attr[2];
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(C::THREADS);
    cfg.dynamicSmemBytes = C::SMEM;
    cfg.stream = stream;
    cfg.attrs = attr;
    if (pdl_enabled()) {
        attr[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[cfg.numAttrs++].val.programmaticStreamSerializationAllowed = 1;
    }
    if (MC)
        attr[cfg.numAttrs++] = cluster_pair_attr();
    cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, tm_tok, tm_w, tm_c, p);
    if (err != cudaSuccess)
        return moe_error(MOE_STATUS_CUDA_ERROR, "%s: launch: %s", name, cudaGetErrorString(err));
    return moe_gemm_check_launch(name);
}

/* Stages that fit in `budget` bytes of shared memory, at most `cap`. */
static constexpr int stages_for(int stage_bytes, int budget, int cap)
{
    return budget / stage_bytes < cap ? budget / stage_bytes : cap;
}

/* Normal layout: TOK tokens (64 per consumer warpgroup; PING: two warpgroups on alternate
 * 64-row items) x 2 x WR weight rows: WRB, or where it is 0 the kind's own (bf16 and F8 = 3:
 * 128; 64 for three and four consumer warpgroups is given). */
template <int TOK, int F8 = 0, int WRB = 0, int PING = 0, int MC = 0, int LA = 0>
static moe_status_t launch_normal(const moe_gemm_args_t *a, void *stream, const char *name)
{
    /* FP8 with promotion (F8 = 1, 2, 4) keeps a second set of accumulators: 64 weight rows a
     * half (n128), or 96 (n192: 96 accumulators and 96 partial sums a thread, two consumer
     * warpgroups at most); F8 = 3 (the tensor cores accumulate all of k) has the bf16 tile's */
    constexpr int WR = WRB ? WRB : f8_promoted(F8) ? 64 : 128;
    static_assert(!f8_promoted(F8) || WR == 64 || (WR == 96 && TOK / 64 <= 2),
                  "promoted fp8: n128, or n192 with one or two consumer warpgroups");
    /* The TMA-store buffers (64 x WR bf16 a consumer warpgroup) come out of the same budget
     * (bf16 m128: 4 stages of 48 KB + 32 KB; m64: 5 of 40 KB + 16 KB); fp8 keeps at most 200 KB
     * of stages (the fast m64n256_pp: 4 of 40 KB + 32 KB) */
    constexpr int BUDGET = 227 * 1024 - (PING ? 2 : TOK / 64) * 64 * WR * 2 - 2048;
    constexpr int ST =
        stages_for((TOK + 2 * WR) * ROW_BYTES, F8 && BUDGET > 200 * 1024 ? 200 * 1024 : BUDGET, 8);
    if ((int64_t)a->max_blocks * TOK >= ((int64_t)1 << 31))
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "%s: max_blocks = %d too large", name,
                         a->max_blocks);
    MOE_CHECK(moe_gemm_check_common(a, name, f8_row_scales(F8) ? 1 : F8, F8 != 0));
    cudaStream_t s = (cudaStream_t)stream;
    switch (a->epilogue) {
    case MOE_GEMM_EPI_STORE:
        return launch_one<0, TOK, WR, 2, MOE_GEMM_EPI_STORE, ST, 1, F8, PING, MC, LA>(a, s, name);
    case MOE_GEMM_EPI_SILU_MUL:
        return launch_one<0, TOK, WR, 2, MOE_GEMM_EPI_SILU_MUL, ST, 1, F8, PING, MC, LA>(a, s,
                                                                                         name);
    case MOE_GEMM_EPI_GELU_MUL:
        return launch_one<0, TOK, WR, 2, MOE_GEMM_EPI_GELU_MUL, ST, 1, F8, PING, MC, LA>(a, s,
                                                                                         name);
    default:
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "%s: epilogue %d", name, (int)a->epilogue);
    }
}

/* Swap-AB: 64 weight rows per item (64 output columns for STORE; 32 gate + 32 up rows, 32
 * output columns, for *_MUL) x TOK tokens; a stage holds KB slices of 64 k (longer contiguous
 * runs of each weight row per stage). PING: two consumer warpgroups on alternate items, each
 * with its own epilogue staging. */
template <int TOK, int KB, int WM = 1, int F8 = 0, int PING = 0>
static moe_status_t launch_swap(const moe_gemm_args_t *a, void *stream, const char *name)
{
    constexpr int ST = stages_for(KB * (TOK + 64 * WM) * ROW_BYTES,
                                  200 * 1024 - (PING ? 2 : 1) * (64 * WM * (TOK + 1) + 64) * 4, 12);
    if ((int64_t)a->max_blocks * TOK >= ((int64_t)1 << 31))
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "%s: max_blocks = %d too large", name,
                         a->max_blocks);
    MOE_CHECK(moe_gemm_check_common(a, name, f8_row_scales(F8) ? 1 : F8, F8 != 0));
    cudaStream_t s = (cudaStream_t)stream;
    switch (a->epilogue) {
    case MOE_GEMM_EPI_STORE:
        return launch_one<1, TOK, 64 * WM, 1, MOE_GEMM_EPI_STORE, ST, KB, F8, PING>(a, s, name);
    case MOE_GEMM_EPI_SILU_MUL:
        return launch_one<1, TOK, 32 * WM, 2, MOE_GEMM_EPI_SILU_MUL, ST, KB, F8, PING>(a, s, name);
    case MOE_GEMM_EPI_GELU_MUL:
        return launch_one<1, TOK, 32 * WM, 2, MOE_GEMM_EPI_GELU_MUL, ST, KB, F8, PING>(a, s, name);
    default:
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "%s: epilogue %d", name, (int)a->epilogue);
    }
}

#endif /* MOE_EXPERT_GEMM_SM90_CUH */
