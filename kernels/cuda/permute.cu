/* SPDX-License-Identifier: Apache-2.0 */
/* Permute kernels: per-expert counts, padded offsets, block table and row maps in one block;
 * the gather of token rows into the GEMM's bf16 A buffer. No host synchronisation. */
#include "kernels/permute.h"

#include <cuda_bf16.h>
#include "kernels/cuda/aligned.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_cache.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/route_topk.cuh"
#include "kernels/cuda/slot.cuh"
#include "kernels/cuda/sticky.cuh"
#include "kernels/cuda/vec8.cuh"

namespace
{

constexpr int META_THREADS = 1024;
constexpr int META_WARPS = META_THREADS / 32;

/* prefix[r] (shared, r <= regions) = the live entries of the regions before r, `per` entries a
 * live token (counts clamped to [0, rg.rows]); returns the total. Every thread of the CTA calls
 * it (one barrier). */
__device__ __forceinline__ int region_prefix(const moe_permute_regions_t &rg, int per, int *prefix)
{
    if (threadIdx.x == 0) {
        int run = 0;
        for (int r = 0; r < rg.regions; r++) {
            prefix[r] = run;
            run += min(max(rg.counts[r], 0), (int)rg.rows) * per;
        }
        prefix[rg.regions] = run;
    }
    __syncthreads();
    return prefix[rg.regions];
}

/* Live entry i (i < prefix[regions]) as an index of the whole layout, `span` entries a region. */
__device__ __forceinline__ int region_index(const int *prefix, int regions, int64_t span, int i)
{
    int r = 0;
    while (r + 1 < regions && i >= prefix[r + 1])
        r++;
    return (int)(r * span) + i - prefix[r];
}

/* The entries a pass walks (a template argument, so that the plain layout's kernels are the
 * code they were before the regions came). plain_slots: slot i of ids, ids outside [0, E) no
 * expert. region_slots: the live slots of the receive regions, in order, with global ids made
 * local (moe_permute_regions_t). setup: every thread of the CTA calls it; it returns the entries
 * to walk; `prefix` is shared [MOE_PERMUTE_MAX_REGIONS + 1]; with `record`, CTA 0 records a
 * failed step in the sticky word. */
struct plain_slots {
    const int32_t *ids;

    __device__ __forceinline__ int setup(const int32_t *idv, int n, int,
                                         const moe_permute_regions_t &, bool, int *)
    {
        ids = idv;
        return n;
    }
    __device__ __forceinline__ int slot(int i) const
    {
        return i;
    }
    __device__ __forceinline__ int expert(int slot, int E) const
    {
        const int e = __ldg(ids + slot);
        return e >= 0 && e < E ? e : -1;
    }
};

struct region_slots {
    const int32_t *ids;
    int first, regions;
    bool none;    /* a failed step: no slot has an expert */
    int64_t span; /* slots a region */
    const int *prefix;

    __device__ __forceinline__ int setup(const int32_t *idv, int n, int top_k,
                                         const moe_permute_regions_t &rg, bool record, int *pre)
    {
        (void)n;
        ids = idv;
        first = rg.first;
        regions = rg.regions;
        none = moe_first_failure(rg.flags, rg.regions, rg.sticky,
                                 record && blockIdx.x == 0 && threadIdx.x == 0) >= 0;
        span = rg.rows * top_k;
        prefix = pre;
        return region_prefix(rg, top_k, pre);
    }
    __device__ __forceinline__ int slot(int i) const
    {
        return region_index(prefix, regions, span, i);
    }
    __device__ __forceinline__ int expert(int slot, int E) const
    {
        const int e = none ? -1 : __ldg(ids + slot) - first;
        return e >= 0 && e < E ? e : -1;
    }
};

/* Ids a warp handles next, PREFETCH x 32 of them loaded at once (latency, not bandwidth, bounds
 * this kernel); entry u of lane l is entry i0 + 32 u + l, so the order stays ascending. Entries
 * with no expert here and entries past `end` read as -1. */
constexpr int PREFETCH = 8;

template <typename Slots>
__device__ __forceinline__ void load_ids(const Slots &ids, int i0, int end, int E, int lane,
                                         int *ev)
{
#pragma unroll
    for (int u = 0; u < PREFETCH; u++) {
        const int i = i0 + u * 32 + lane;
        ev[u] = i < end ? ids.expert(ids.slot(i), E) : -1;
    }
}

/* Counts of a warp's ids [begin, end) per expert into wc[e] (a row of the CTA's [warp][E]
 * table, zeroed here). */
template <typename Slots>
__device__ __forceinline__ void warp_count(const Slots &ids, int begin, int end, int E, int lane,
                                           int *wc)
{
    for (int e = lane; e < E; e += 32)
        wc[e] = 0;
    __syncwarp();
    for (int i0 = begin; i0 < end; i0 += 32 * PREFETCH) {
        int ev[PREFETCH];
        load_ids(ids, i0, end, E, lane, ev);
#pragma unroll
        for (int u = 0; u < PREFETCH; u++) {
            const int e = ev[u];
            const unsigned peers = __match_any_sync(0xffffffffu, e);
            if (e >= 0 && lane == __ffs(peers) - 1)
                wc[e] += __popc(peers);
            __syncwarp();
        }
    }
}

/* Exclusive prefix over the CTA's warps per expert, in place; tot[e] = the CTA's count. The
 * 32 counts of an expert are loaded before any is overwritten: all in flight at once, not one
 * dependent shared-memory round trip per warp. */
__device__ __forceinline__ void warps_prefix(int *wcnt, int *tot, int E)
{
    for (int e = threadIdx.x; e < E; e += META_THREADS) {
        int c[META_WARPS], run = 0;
#pragma unroll
        for (int v = 0; v < META_WARPS; v++)
            c[v] = wcnt[v * E + e];
#pragma unroll
        for (int v = 0; v < META_WARPS; v++) {
            wcnt[v * E + e] = run;
            run += c[v];
        }
        tot[e] = run;
    }
}

/* Places a warp's ids [begin, end): row = base[e] + the warp's prefix wc[e] + the lanes before
 * it with the same expert (stable: ascending i within each expert). */
template <typename Slots>
__device__ __forceinline__ void
warp_place(const Slots &ids, int begin, int end, int E, int lane, int *wc, const int *base,
           int32_t *__restrict__ row_of_slot, int32_t *__restrict__ slot_of_row)
{
    const unsigned lt = (1u << lane) - 1u;
    for (int i0 = begin; i0 < end; i0 += 32 * PREFETCH) {
        int ev[PREFETCH];
        load_ids(ids, i0, end, E, lane, ev);
#pragma unroll
        for (int u = 0; u < PREFETCH; u++) {
            const int i = i0 + u * 32 + lane, e = ev[u];
            const unsigned peers = __match_any_sync(0xffffffffu, e);
            int row = -1;
            if (e >= 0)
                row = base[e] + wc[e] + __popc(peers & lt);
            __syncwarp();
            if (e >= 0 && lane == __ffs(peers) - 1)
                wc[e] += __popc(peers);
            __syncwarp();
            if (i < end) {
                const int slot = ids.slot(i);
                row_of_slot[slot] = row;
                if (row >= 0)
                    slot_of_row[row] = slot;
            }
        }
    }
}

/* From the per-expert counts cnt[E] (shared): padded offsets offs[E + 1] (shared, exclusive
 * scan of the padded sizes), the counts, offsets, block table and block count in global
 * memory, and -1 in the padding rows of slot_of_row. One CTA of META_THREADS. */
__device__ __forceinline__ void block_table(const int *cnt, int *offs, int E, int br,
                                            int max_blocks, int32_t *__restrict__ expert_counts,
                                            int32_t *__restrict__ expert_offsets,
                                            int32_t *__restrict__ block_expert,
                                            int32_t *__restrict__ num_blocks,
                                            int32_t *__restrict__ slot_of_row)
{
    const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    for (int e = tid; e < E; e += META_THREADS) {
        expert_counts[e] = cnt[e];
        offs[e] = (cnt[e] + br - 1) / br * br;
    }
    __syncthreads();
    if (w == 0) { /* exclusive scan of the padded sizes: lane-contiguous runs, then a warp scan */
        const int per = (E + 31) / 32, b0 = min(lane * per, E), b1 = min(b0 + per, E);
        int local = 0;
        for (int e = b0; e < b1; e++)
            local += offs[e];
        int incl = local;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o)
                incl += v;
        }
        int run = incl - local;
        for (int e = b0; e < b1; e++) {
            const int v = offs[e];
            offs[e] = run;
            run += v;
        }
        if (lane == 31)
            offs[E] = incl;
    }
    __syncthreads();
    const int total = offs[E], nb = total / br;
    if (tid == 0)
        *num_blocks = nb;
    for (int e = tid; e <= E; e += META_THREADS)
        expert_offsets[e] = offs[e];
    for (int b = tid; b < max_blocks; b += META_THREADS) {
        int e = -1;
        if (b < nb) { /* last expert whose first row is <= this block's first row */
            const int row = b * br;
            int lo = 0, hi = E; /* offs[lo] <= row < offs[hi] */
            while (hi - lo > 1) {
                const int mid = (lo + hi) >> 1;
                if (offs[mid] <= row)
                    lo = mid;
                else
                    hi = mid;
            }
            e = lo;
        }
        block_expert[b] = e;
    }
    for (int e = tid; e < E; e += META_THREADS)
        for (int r = offs[e] + cnt[e]; r < offs[e + 1]; r++)
            slot_of_row[r] = -1;
}

/* The warp range [begin, end) of this CTA's rows [c0, c1). */
__device__ __forceinline__ void warp_range(int c0, int c1, int *begin, int *end)
{
    const int chunk = (c1 - c0 + META_WARPS - 1) / META_WARPS, w = threadIdx.x >> 5;
    *begin = min(c0 + w * chunk, c1);
    *end = min(*begin + chunk, c1);
}

/* Few rows: everything in one CTA (every thread calls it; n: the entries `ids` walks). Each warp
 * owns a contiguous chunk of the rows, so counting per (warp, expert) and a prefix over warps
 * gives every row its stable place with no atomics (deterministic). */
template <typename Slots>
__device__ __forceinline__ void
meta_pass(const Slots &ids, int n, int E, int br, int max_blocks, int *smem,
          int32_t *__restrict__ expert_counts, int32_t *__restrict__ expert_offsets,
          int32_t *__restrict__ block_expert, int32_t *__restrict__ num_blocks,
          int32_t *__restrict__ row_of_slot, int32_t *__restrict__ slot_of_row)
{
    int *wcnt = smem;                 /* [META_WARPS][E]: count, then exclusive prefix */
    int *cnt = wcnt + META_WARPS * E; /* [E] */
    int *offs = cnt + E;              /* [E + 1] padded offsets */
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int begin, end;
    warp_range(0, n, &begin, &end);
    warp_count(ids, begin, end, E, lane, wcnt + w * E);
    __syncthreads();
    warps_prefix(wcnt, cnt, E);
    __syncthreads();
    block_table(cnt, offs, E, br, max_blocks, expert_counts, expert_offsets, block_expert,
                num_blocks, slot_of_row);
    warp_place(ids, begin, end, E, lane, wcnt + w * E, offs, row_of_slot, slot_of_row);
}

template <typename Slots>
__global__ void __launch_bounds__(META_THREADS)
    permute_meta_kernel(const int32_t *__restrict__ idv, int n, int top_k, int E, int br,
                        int max_blocks, int32_t *__restrict__ expert_counts,
                        int32_t *__restrict__ expert_offsets, int32_t *__restrict__ block_expert,
                        int32_t *__restrict__ num_blocks, int32_t *__restrict__ row_of_slot,
                        int32_t *__restrict__ slot_of_row, moe_permute_regions_t rg)
{
    moe_pdl_wait();
    extern __shared__ int smem[];
    __shared__ int prefix[MOE_PERMUTE_MAX_REGIONS + 1];
    Slots ids;
    n = ids.setup(idv, n, top_k, rg, true, prefix);
    meta_pass(ids, n, E, br, max_blocks, smem, expert_counts, expert_offsets, block_expert,
              num_blocks, row_of_slot, slot_of_row);
}

/* ---- a small step's route, slot ids and metadata in one CTA (moe_route_permute_launch) ----
 * Measured level with the three launches (2026-12-03: 0.98-1.00 of their step time at 1 and 8
 * tokens, 1.02-1.03 at 64): the runtime takes it only with MOE_ROUTE_PERMUTE=1. */

/* The slots the route + permute kernel walks: this CTA's shared slot ids. */
struct shared_slots {
    const int *sl;

    __device__ __forceinline__ int slot(int i) const
    {
        return i;
    }
    __device__ __forceinline__ int expert(int slot, int E) const
    {
        const int e = sl[slot];
        return e >= 0 && e < E ? e : -1;
    }
};

constexpr int RP_MAX_SLOTS = MOE_ROUTE_PERMUTE_MAX_TOKENS * MOE_ROUTE_MAX_TOP_K;

/* Dynamic shared memory of the route + permute kernel: the metadata pass's, which first holds
 * every warp's choice row (NPL * 32 floats, the grouped selection's). */
static size_t route_permute_smem(size_t meta, int npl)
{
    const size_t rows = sizeof(float) * META_WARPS * 32 * (size_t)npl;
    return meta > rows ? meta : rows;
}

/* Top-k of every token (every warp, a token each in turn) with the ids kept in shared memory
 * too, the local slot of each pair there (and in slots.out), then the metadata pass over them:
 * the three kernels' work with no global round trip between them. */
template <int NPL>
__global__ void __launch_bounds__(META_THREADS)
    route_permute_kernel(moe_route_args_t r, moe_ep_slot_ids_args_t sa, moe_permute_args_t pa,
                         route_kparams p)
{
    moe_pdl_wait();
    extern __shared__ int smem[];
    __shared__ int sl[RP_MAX_SLOTS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int T = (int)r.num_tokens, K = p.top_k, n = T * K;
    float *choice_row = reinterpret_cast<float *>(smem) + warp * NPL * 32;

    for (int t = warp; t < T; t += META_WARPS)
        route_topk_token<NPL>(r.logits, r.bias, r.topk_ids, r.topk_weights, t, p, lane, choice_row,
                              sl + t * K);
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += META_THREADS) {
        const int out = moe_pair_slot(sl[i], sa.first_token + i / K + sa.rank, sa.replica_begin,
                                      sa.replica_slot, sa.load);
        sl[i] = out;
        sa.out[i] = out;
    }
    __syncthreads();
    const shared_slots ids = {sl};
    meta_pass(ids, n, pa.num_experts, pa.block_rows, pa.max_blocks, smem, pa.expert_counts,
              pa.expert_offsets, pa.block_expert, pa.num_blocks, pa.row_of_slot, pa.slot_of_row);
}

constexpr int SCAN_LOADS = 8;

/* The last chunk's CTA: part[g][e] becomes the chunk's first row within expert e (exclusive
 * prefix over the chunks, in chunk order: stable), and the block table from the totals. The
 * parts were stored by other CTAs of this grid: read through the L2 (__ldcg), never a stale L1
 * line. */
__device__ __forceinline__ void
scan_parts(int G, int E, int br, int max_blocks, int *smem, int32_t *__restrict__ part,
           int32_t *__restrict__ expert_counts, int32_t *__restrict__ expert_offsets,
           int32_t *__restrict__ block_expert, int32_t *__restrict__ num_blocks,
           int32_t *__restrict__ slot_of_row)
{
    int *cnt = smem, *offs = cnt + E;
    for (int e = threadIdx.x; e < E; e += META_THREADS) {
        int run = 0;
        /* SCAN_LOADS chunks' counts loaded before any is overwritten, so that they are in
         * flight together rather than G round trips one after another */
        for (int g0 = 0; g0 < G; g0 += SCAN_LOADS) {
            int c[SCAN_LOADS];
#pragma unroll
            for (int u = 0; u < SCAN_LOADS; u++)
                c[u] = g0 + u < G ? __ldcg(part + (size_t)(g0 + u) * E + e) : 0;
#pragma unroll
            for (int u = 0; u < SCAN_LOADS; u++)
                if (g0 + u < G) {
                    part[(size_t)(g0 + u) * E + e] = run;
                    run += c[u];
                }
        }
        cnt[e] = run;
    }
    __syncthreads();
    block_table(cnt, offs, E, br, max_blocks, expert_counts, expert_offsets, block_expert,
                num_blocks, slot_of_row);
}

/* Whether this CTA finished the grid's counts last (counted on `done`, which it leaves 0 for the
 * next launch, stream-ordered after this one). Every CTA fences its part's stores before it
 * counts, so the last one sees them all. Every thread calls it. */
__device__ __forceinline__ bool last_chunk(int32_t *done)
{
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(done, 1) == (int)gridDim.x - 1;
        if (last)
            *done = 0;
    }
    __syncthreads();
    if (last)
        __threadfence();
    return last;
}

/* This CTA's chunk of the n entries (ceil(n / grid) each, by block index): its warp's range
 * [*begin, *end), counted per expert into the warp's row of wcnt [META_WARPS][E]. Every thread
 * calls it (one barrier). */
template <typename Slots>
__device__ __forceinline__ void count_chunk(const Slots &ids, int n, int E, int *wcnt, int *begin,
                                            int *end)
{
    const int chunk = (n + gridDim.x - 1) / gridDim.x;
    const int c0 = min((int)blockIdx.x * chunk, n), c1 = min(c0 + chunk, n);
    warp_range(c0, c1, begin, end);
    warp_count(ids, *begin, *end, E, threadIdx.x & 31, wcnt + (threadIdx.x >> 5) * E);
    __syncthreads();
}

/* Many rows, pass 1 of 2 (one CTA per chunk of the entries, ceil(n / grid) each): the chunk's
 * count per expert into part[g][e]; the CTA that finishes last scans them (scan_parts). With
 * the receive regions the entries are the live slots, known only here: when they are few
 * (n <= MOE_PERMUTE_CHUNK_ROWS, what a told step runs in one CTA) CTA 0 does the whole pass as
 * the one-CTA kernel does and the others return, as does pass 2 (each CTA reads the same n). */
template <typename Slots>
__global__ void __launch_bounds__(META_THREADS)
    permute_count_kernel(const int32_t *__restrict__ idv, int n, int top_k, int E, int br,
                         int max_blocks, int32_t *__restrict__ part, int32_t *__restrict__ done,
                         int32_t *__restrict__ expert_counts, int32_t *__restrict__ expert_offsets,
                         int32_t *__restrict__ block_expert, int32_t *__restrict__ num_blocks,
                         int32_t *__restrict__ row_of_slot, int32_t *__restrict__ slot_of_row,
                         moe_permute_regions_t rg)
{
    moe_pdl_wait();
    extern __shared__ int smem[];
    __shared__ int prefix[MOE_PERMUTE_MAX_REGIONS + 1];
    Slots ids;
    n = ids.setup(idv, n, top_k, rg, true, prefix);
    if (n <= MOE_PERMUTE_CHUNK_ROWS) {
        if (blockIdx.x == 0)
            meta_pass(ids, n, E, br, max_blocks, smem, expert_counts, expert_offsets, block_expert,
                      num_blocks, row_of_slot, slot_of_row);
        return;
    }
    int begin, end;
    count_chunk(ids, n, E, smem, &begin, &end);
    warps_prefix(smem, part + (size_t)blockIdx.x * E, E);
    if (last_chunk(done))
        scan_parts((int)gridDim.x, E, br, max_blocks, smem, part, expert_counts, expert_offsets,
                   block_expert, num_blocks, slot_of_row);
}

/* Pass 2 (one CTA per chunk): every row's place, from the expert's padded offset, the chunk's
 * first row within the expert and the warps before it in the chunk. */
template <typename Slots>
__global__ void __launch_bounds__(META_THREADS)
    permute_place_kernel(const int32_t *__restrict__ idv, int n, int top_k, int E,
                         const int32_t *__restrict__ part,
                         const int32_t *__restrict__ expert_offsets,
                         int32_t *__restrict__ row_of_slot, int32_t *__restrict__ slot_of_row,
                         moe_permute_regions_t rg)
{
    moe_pdl_wait();
    extern __shared__ int smem[];
    __shared__ int prefix[MOE_PERMUTE_MAX_REGIONS + 1];
    Slots ids;
    n = ids.setup(idv, n, top_k, rg, false, prefix);
    if (n <= MOE_PERMUTE_CHUNK_ROWS) /* pass 1's CTA 0 placed them */
        return;
    int *wcnt = smem, *base = wcnt + META_WARPS * E;
    int begin, end;
    count_chunk(ids, n, E, wcnt, &begin, &end);
    warps_prefix(wcnt, base, E); /* base is overwritten next: only the prefix is kept */
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += META_THREADS)
        base[e] = __ldg(expert_offsets + e) + __ldg(part + (size_t)blockIdx.x * E + e);
    __syncthreads();
    warp_place(ids, begin, end, E, threadIdx.x & 31, wcnt + (threadIdx.x >> 5) * E, base,
               row_of_slot, slot_of_row);
}

/* Copies one row of hidden values into bf16 dst (8 per 16-byte store when VEC), or zeroes it.
 * VEC: each thread issues COPY_UNROLL loads before its stores, so that a row's bytes are in
 * flight together (one load at a time left the copy latency-bound at about half the HBM rate). */
constexpr int COPY_UNROLL = 4;

/* The 8 values at src (16-byte aligned) as 8 bf16 in one 16-byte unit. */
template <typename T> __device__ __forceinline__ uint4 load_unit(const T *src)
{
    if (sizeof(T) == 2)
        return __ldg(reinterpret_cast<const uint4 *>(src));
    float f[8];
    moe_load8(reinterpret_cast<const float *>(src), f);
    return moe_pack8(f);
}

/* A thread's COPY_UNROLL units i0 + u * step (u < COPY_UNROLL) of a range of `total` 16-byte
 * units: all loaded (load(i); zeros past the range) before any is stored, then d[i] = v[u]. */
template <typename Load>
__device__ __forceinline__ void load_units(uint4 (&v)[COPY_UNROLL], int i0, int step, int total,
                                           Load load)
{
#pragma unroll
    for (int u = 0; u < COPY_UNROLL; u++) {
        const int i = i0 + u * step;
        v[u] = i < total ? load(i) : make_uint4(0, 0, 0, 0);
    }
}

__device__ __forceinline__ void store_units(const uint4 (&v)[COPY_UNROLL], int i0, int step,
                                            int total, uint4 *d)
{
#pragma unroll
    for (int u = 0; u < COPY_UNROLL; u++)
        if (i0 + u * step < total)
            d[i0 + u * step] = v[u];
}

template <typename T, bool VEC>
__device__ __forceinline__ void copy_row(const T *src, __nv_bfloat16 *dst, int hidden)
{
    if (VEC) {
        const int n = hidden / 8, step = blockDim.x;
        for (int c0 = threadIdx.x; c0 < n; c0 += step * COPY_UNROLL) {
            uint4 v[COPY_UNROLL];
            load_units(v, c0, step, n, [&](int c) {
                return src ? load_unit(src + 8 * c) : make_uint4(0, 0, 0, 0);
            });
            store_units(v, c0, step, n, reinterpret_cast<uint4 *>(dst));
        }
    } else {
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
            float v = 0.0f;
            if (src)
                v = sizeof(T) == 2 ? __bfloat162float(((const __nv_bfloat16 *)src)[c])
                                   : ((const float *)src)[c];
            dst[c] = __float2bfloat16_rn(v);
        }
    }
}

template <typename T, bool VEC>
__global__ void gather_kernel(const T *__restrict__ x, int hidden, int top_k,
                              const int32_t *__restrict__ slot_of_row,
                              const int32_t *__restrict__ num_blocks, int br,
                              __nv_bfloat16 *__restrict__ a)
{
    moe_pdl_wait();
    const int row = blockIdx.x;
    if (row >= *num_blocks * br)
        return;
    const int slot = slot_of_row[row];
    const T *src = slot >= 0 ? x + (size_t)(slot / top_k) * hidden : nullptr;
    copy_row<T, VEC>(src, a + (size_t)row * hidden, hidden);
}

/* The vectorised gather: GATHER_ROWS rows per CTA as one flat range of 16-byte units, with
 * COPY_UNROLL loads in flight per thread. One CTA per row made the CTA launch rate the limit
 * (65536 rows of 4 KB at Qwen3 M = 8192: 211 us, about a third of the HBM rate). */
constexpr int GATHER_ROWS = 8, GATHER_THREADS = 256;

template <typename T>
__global__ void __launch_bounds__(GATHER_THREADS)
    gather_rows_kernel(const T *__restrict__ x, int hidden, int top_k,
                       const int32_t *__restrict__ slot_of_row,
                       const int32_t *__restrict__ num_blocks, int br,
                       __nv_bfloat16 *__restrict__ a)
{
    moe_pdl_wait();
    const int n = hidden / 8, row0 = blockIdx.x * GATHER_ROWS;
    const int live = min(GATHER_ROWS, *num_blocks * br - row0);
    if (live <= 0)
        return;
    const int total = live * n;
    for (int i0 = threadIdx.x; i0 < total; i0 += GATHER_THREADS * COPY_UNROLL) {
        uint4 v[COPY_UNROLL];
        /* unit i of the range is unit c of row r: i = r * n + c */
        load_units(v, i0, GATHER_THREADS, total, [&](int i) {
            const int r = i / n, c = i - r * n, slot = __ldg(slot_of_row + row0 + r);
            return slot >= 0 ? load_unit(x + (size_t)(slot / top_k) * hidden + 8 * c)
                             : make_uint4(0, 0, 0, 0);
        });
        store_units(v, i0, GATHER_THREADS, total,
                    reinterpret_cast<uint4 *>(a + (size_t)row0 * hidden));
    }
}

/* The scatter form: SCATTER_TOKENS tokens per CTA (grid-stride); a thread loads COPY_UNROLL
 * 16-byte units of a token row once and stores them into each of the token's top_k rows. */
constexpr int SCATTER_TOKENS = 4;

template <typename T>
__device__ __forceinline__ void scatter_token(const T *__restrict__ x, int hidden, int top_k, int t,
                                              const int32_t *__restrict__ row_of_slot,
                                              __nv_bfloat16 *__restrict__ a)
{
    const int n = hidden / 8;
    const T *src = x + (size_t)t * hidden;
    /* a token with no row here (EP: another rank's experts, or a padding row) is not read: the
     * step's cost follows the rows, not the capacity */
    bool any = false;
    for (int j = 0; j < top_k && !any; j++)
        any = __ldg(row_of_slot + (size_t)t * top_k + j) >= 0;
    if (!any)
        return;
    for (int c0 = threadIdx.x; c0 < n; c0 += GATHER_THREADS * COPY_UNROLL) {
        uint4 v[COPY_UNROLL];
        load_units(v, c0, GATHER_THREADS, n, [&](int c) { return load_unit(src + 8 * c); });
        for (int j = 0; j < top_k; j++) {
            const int row = __ldg(row_of_slot + (size_t)t * top_k + j);
            if (row >= 0)
                store_units(v, c0, GATHER_THREADS, n,
                            reinterpret_cast<uint4 *>(a + (size_t)row * hidden));
        }
    }
}

template <typename T, bool REGIONS>
__global__ void __launch_bounds__(GATHER_THREADS)
    scatter_rows_kernel(const T *__restrict__ x, int hidden, int top_k, int num_tokens,
                        const int32_t *__restrict__ row_of_slot, __nv_bfloat16 *__restrict__ a,
                        moe_permute_regions_t rg)
{
    moe_pdl_wait();
    __shared__ int prefix[MOE_PERMUTE_MAX_REGIONS + 1];
    /* receive regions: their live tokens only */
    const int tokens = REGIONS ? region_prefix(rg, 1, prefix) : num_tokens;
    for (int q0 = blockIdx.x * SCATTER_TOKENS; q0 < tokens; q0 += gridDim.x * SCATTER_TOKENS)
        for (int q = q0; q < min(tokens, q0 + SCATTER_TOKENS); q++)
            scatter_token(x, hidden, top_k,
                          REGIONS ? region_index(prefix, rg.regions, rg.rows, q) : q, row_of_slot,
                          a);
}

template <typename T, bool VEC>
__global__ void rows_kernel(const T *__restrict__ x, int num_tokens, int hidden, int br,
                            int max_blocks, __nv_bfloat16 *__restrict__ a,
                            int32_t *__restrict__ block_expert, int32_t *__restrict__ num_blocks)
{
    moe_pdl_wait();
    const int row = blockIdx.x;
    const int nb = (num_tokens + br - 1) / br;
    if (row == 0) {
        for (int b = threadIdx.x; b < max_blocks; b += blockDim.x)
            block_expert[b] = b < nb ? 0 : -1;
        if (threadIdx.x == 0)
            *num_blocks = nb;
    }
    const T *src = row < num_tokens ? x + (size_t)row * hidden : nullptr;
    copy_row<T, VEC>(src, a + (size_t)row * hidden, hidden);
}

int row_threads(int hidden, bool vec)
{
    const int units = vec ? hidden / 8 : hidden;
    return units >= 256 ? 256 : (units >= 128 ? 128 : 64);
}

template <typename T>
moe_status_t launch_gather(const moe_gather_args_t *g, unsigned rows, cudaStream_t s)
{
    const bool vec = g->hidden % 8 == 0 && moe_aligned16(g->x) && moe_aligned16(g->a);
    const int th = row_threads(g->hidden, vec);
    if (vec && g->row_of_slot) {
        int64_t grid = (g->num_tokens + SCATTER_TOKENS - 1) / SCATTER_TOKENS;
        if (g->regions.counts && grid > MOE_GATHER_MAX_CTAS)
            grid = MOE_GATHER_MAX_CTAS;
        if (grid > 0)
            MOE_CUDA_CHECK(moe_launch(
                g->regions.counts ? scatter_rows_kernel<T, true> : scatter_rows_kernel<T, false>,
                dim3((unsigned)grid), dim3(GATHER_THREADS), 0, s, (const T *)g->x, g->hidden,
                g->top_k, (int)g->num_tokens, g->row_of_slot, (__nv_bfloat16 *)g->a, g->regions));
    } else if (vec)
        MOE_CUDA_CHECK(
            moe_launch((gather_rows_kernel<T>), dim3((rows + GATHER_ROWS - 1) / GATHER_ROWS),
                       dim3(GATHER_THREADS), 0, s, (const T *)g->x, g->hidden, g->top_k,
                       g->slot_of_row, g->num_blocks, g->block_rows, (__nv_bfloat16 *)g->a));
    else
        MOE_CUDA_CHECK(moe_launch((gather_kernel<T, false>), dim3(rows), dim3(th), 0, s,
                                  (const T *)g->x, g->hidden, g->top_k, g->slot_of_row,
                                  g->num_blocks, g->block_rows, (__nv_bfloat16 *)g->a));
    MOE_CUDA_CHECK_LAUNCH("gather_kernel");
    return MOE_STATUS_SUCCESS;
}

template <typename T>
moe_status_t launch_rows(const moe_rows_args_t *r, unsigned rows, cudaStream_t s)
{
    const bool vec = r->hidden % 8 == 0 && moe_aligned16(r->x) && moe_aligned16(r->a);
    const int th = row_threads(r->hidden, vec);
    if (vec)
        MOE_CUDA_CHECK(moe_launch((rows_kernel<T, true>), dim3(rows), dim3(th), 0, s,
                                  (const T *)r->x, (int)r->num_tokens, r->hidden, r->block_rows,
                                  r->max_blocks, (__nv_bfloat16 *)r->a, r->block_expert,
                                  r->num_blocks));
    else
        MOE_CUDA_CHECK(moe_launch((rows_kernel<T, false>), dim3(rows), dim3(th), 0, s,
                                  (const T *)r->x, (int)r->num_tokens, r->hidden, r->block_rows,
                                  r->max_blocks, (__nv_bfloat16 *)r->a, r->block_expert,
                                  r->num_blocks));
    MOE_CUDA_CHECK_LAUNCH("rows_kernel");
    return MOE_STATUS_SUCCESS;
}

/* Opts the metadata kernel into the largest dynamic shared memory it can need (E = 1024), once
 * per device, so that no attribute call happens while a stream is being captured later. */
/* Dynamic shared memory of the meta kernels (the [warp][E] table and two [E + 1] arrays),
 * raised once per device to what MOE_PERMUTE_MAX_EXPERTS needs. */
moe_status_t raise_smem_limit()
{
    static int done[MOE_MAX_DEVICES];
    const int need = (int)(sizeof(int) * ((size_t)META_WARPS * MOE_PERMUTE_MAX_EXPERTS +
                                          2 * (size_t)MOE_PERMUTE_MAX_EXPERTS + 2));
    cudaError_t err = cudaSuccess;
    int dev = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&dev));
    if (moe_device_cached(done, dev, [&](int d) {
            int optin = 0;
            const void *k[] = {(const void *)permute_meta_kernel<plain_slots>,
                               (const void *)permute_count_kernel<plain_slots>,
                               (const void *)permute_place_kernel<plain_slots>,
                               (const void *)permute_meta_kernel<region_slots>,
                               (const void *)permute_count_kernel<region_slots>,
                               (const void *)permute_place_kernel<region_slots>,
                               (const void *)route_permute_kernel<1>,
                               (const void *)route_permute_kernel<2>,
                               (const void *)route_permute_kernel<4>,
                               (const void *)route_permute_kernel<8>,
                               (const void *)route_permute_kernel<16>};
            err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, d);
            for (int i = 0; i < (int)(sizeof(k) / sizeof(k[0])) && err == cudaSuccess; i++)
                err = cudaFuncSetAttribute(k[i], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           need < optin ? need : optin);
            return err == cudaSuccess ? 1 : 0;
        }) <= 0)
        return moe_error(MOE_STATUS_CUDA_ERROR, "permute: shared memory attribute: %s",
                         cudaGetErrorString(err));
    return MOE_STATUS_SUCCESS;
}

} /* namespace */

template <typename T> moe_status_t prepare_rows()
{
    MOE_CUDA_PREPARE((gather_rows_kernel<T>));
    MOE_CUDA_PREPARE((scatter_rows_kernel<T, false>));
    MOE_CUDA_PREPARE((scatter_rows_kernel<T, true>));
    MOE_CUDA_PREPARE((gather_kernel<T, false>));
    MOE_CUDA_PREPARE((rows_kernel<T, true>));
    MOE_CUDA_PREPARE((rows_kernel<T, false>));
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_permute_prepare(void)
{
    MOE_CHECK(raise_smem_limit()); /* loads the meta kernels */
    MOE_CHECK(prepare_rows<float>());
    return prepare_rows<__nv_bfloat16>();
}

/* The metadata pass over n slots: one CTA, or count (and scan) / place over the chunks. */
template <typename Slots>
static moe_status_t launch_permute(const moe_permute_args_t *a, int64_t n, size_t smem,
                                   cudaStream_t s)
{
    const int G = moe_permute_chunks(n);
    if (G <= 1 || !a->scratch) {
        MOE_CUDA_CHECK(moe_launch((permute_meta_kernel<Slots>), dim3(1), dim3(META_THREADS), smem,
                                  s, a->topk_ids, (int)n, a->top_k, a->num_experts, a->block_rows,
                                  a->max_blocks, a->expert_counts, a->expert_offsets,
                                  a->block_expert, a->num_blocks, a->row_of_slot, a->slot_of_row,
                                  a->regions));
        MOE_CUDA_CHECK_LAUNCH("permute_meta_kernel");
        return MOE_STATUS_SUCCESS;
    }
    MOE_ARG_CHECK(a->scratch_count >= (int64_t)G * a->num_experts,
                  "permute: scratch of %lld ints < %lld needed", (long long)a->scratch_count,
                  (long long)G * a->num_experts);
    MOE_ARG_CHECK(a->done, "permute: the multi-CTA pass (%lld rows) needs its `done` counter",
                  (long long)n);
    MOE_CUDA_CHECK(moe_launch((permute_count_kernel<Slots>), dim3(G), dim3(META_THREADS), smem, s,
                              a->topk_ids, (int)n, a->top_k, a->num_experts, a->block_rows,
                              a->max_blocks, a->scratch, a->done, a->expert_counts,
                              a->expert_offsets, a->block_expert, a->num_blocks, a->row_of_slot,
                              a->slot_of_row, a->regions));
    MOE_CUDA_CHECK(moe_launch((permute_place_kernel<Slots>), dim3(G), dim3(META_THREADS), smem, s,
                              a->topk_ids, (int)n, a->top_k, a->num_experts,
                              (const int32_t *)a->scratch, (const int32_t *)a->expert_offsets,
                              a->row_of_slot, a->slot_of_row, a->regions));
    MOE_CUDA_CHECK_LAUNCH("permute count/place");
    return MOE_STATUS_SUCCESS;
}

/* The receive regions (when given) tile the num_tokens tokens. */
static moe_status_t check_regions(const moe_permute_regions_t *rg, int64_t num_tokens)
{
    if (!rg->counts)
        return MOE_STATUS_SUCCESS;
    MOE_ARG_CHECK(rg->regions >= 1 && rg->regions <= MOE_PERMUTE_MAX_REGIONS,
                  "permute: regions = %d (1..%d)", rg->regions, MOE_PERMUTE_MAX_REGIONS);
    MOE_ARG_CHECK(rg->rows >= 0 && rg->rows * rg->regions == num_tokens,
                  "permute: %d regions of %lld tokens for num_tokens = %lld", rg->regions,
                  (long long)rg->rows, (long long)num_tokens);
    return MOE_STATUS_SUCCESS;
}

/* moe_permute_launch's argument checks; *smem: the metadata pass's dynamic shared memory. */
static moe_status_t check_permute(const moe_permute_args_t *a, size_t *smem)
{
    const int64_t n = a->num_tokens * a->top_k;

    MOE_ARG_CHECK(a->num_tokens >= 0 && n <= INT32_MAX / 2, "permute: num_tokens = %lld",
                  (long long)a->num_tokens);
    MOE_ARG_CHECK(a->block_rows > 0, "permute: block_rows = %d", a->block_rows);
    MOE_ARG_CHECK(a->max_blocks >= moe_permute_max_blocks(n, a->num_experts, a->block_rows),
                  "permute: max_blocks = %d < %lld needed for %lld rows", a->max_blocks,
                  (long long)moe_permute_max_blocks(n, a->num_experts, a->block_rows),
                  (long long)n);
    if (a->num_experts < 1 || a->num_experts > MOE_PERMUTE_MAX_EXPERTS)
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "permute: num_experts = %d (1..%d)",
                         a->num_experts, MOE_PERMUTE_MAX_EXPERTS);
    *smem = sizeof(int) * ((size_t)META_WARPS * a->num_experts + 2 * (size_t)a->num_experts + 2);
    MOE_CHECK(raise_smem_limit());
    return check_regions(&a->regions, a->num_tokens);
}

extern "C" moe_status_t moe_permute_launch(const moe_permute_args_t *a, void *stream)
{
    const int64_t n = a->num_tokens * a->top_k;
    size_t smem;

    MOE_CHECK(check_permute(a, &smem));
    return a->regions.counts ? launch_permute<region_slots>(a, n, smem, (cudaStream_t)stream)
                             : launch_permute<plain_slots>(a, n, smem, (cudaStream_t)stream);
}

extern "C" moe_status_t moe_gather_launch(const moe_gather_args_t *g, void *stream)
{
    const int64_t rows = (int64_t)g->max_blocks * g->block_rows;
    MOE_ARG_CHECK(g->hidden > 0 && g->top_k > 0 && g->block_rows > 0 && g->max_blocks >= 0,
                  "gather: hidden = %d, top_k = %d, block_rows = %d", g->hidden, g->top_k,
                  g->block_rows);
    MOE_ARG_CHECK(rows <= INT32_MAX, "gather: %lld rows", (long long)rows);
    MOE_ARG_CHECK(!g->row_of_slot || (g->num_tokens >= 0 && g->num_tokens * g->top_k <= INT32_MAX),
                  "gather: num_tokens = %lld", (long long)g->num_tokens);
    MOE_CHECK(check_regions(&g->regions, g->num_tokens));
    if (rows == 0)
        return MOE_STATUS_SUCCESS;
    switch (g->x_dtype) {
    case MOE_DTYPE_F32:
        return launch_gather<float>(g, (unsigned)rows, (cudaStream_t)stream);
    case MOE_DTYPE_BF16:
        return launch_gather<__nv_bfloat16>(g, (unsigned)rows, (cudaStream_t)stream);
    default:
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "gather: x dtype %s (F32 or BF16)",
                         moe_dtype_name(g->x_dtype));
    }
}

extern "C" moe_status_t moe_rows_launch(const moe_rows_args_t *r, void *stream)
{
    const int64_t rows = (int64_t)r->max_blocks * r->block_rows;
    MOE_ARG_CHECK(r->hidden > 0 && r->block_rows > 0 && r->num_tokens >= 0,
                  "rows: hidden = %d, block_rows = %d", r->hidden, r->block_rows);
    MOE_ARG_CHECK(rows >= r->num_tokens && rows <= INT32_MAX,
                  "rows: %lld tokens do not fit %d blocks of %d", (long long)r->num_tokens,
                  r->max_blocks, r->block_rows);
    if (rows == 0)
        return MOE_STATUS_SUCCESS;
    switch (r->x_dtype) {
    case MOE_DTYPE_F32:
        return launch_rows<float>(r, (unsigned)rows, (cudaStream_t)stream);
    case MOE_DTYPE_BF16:
        return launch_rows<__nv_bfloat16>(r, (unsigned)rows, (cudaStream_t)stream);
    default:
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "rows: x dtype %s (F32 or BF16)",
                         moe_dtype_name(r->x_dtype));
    }
}

template <int NPL>
static moe_status_t launch_route_permute(const moe_route_permute_args_t *a, size_t smem,
                                         cudaStream_t s)
{
    MOE_CUDA_CHECK(moe_launch((route_permute_kernel<NPL>), dim3(1), dim3(META_THREADS),
                              route_permute_smem(smem, NPL), s, a->route, a->slots, a->permute,
                              route_kparams_of(&a->route.params)));
    MOE_CUDA_CHECK_LAUNCH("route_permute_kernel");
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_route_permute_launch(const moe_route_permute_args_t *a, void *stream)
{
    const moe_route_args_t *r = &a->route;
    const moe_permute_args_t *p = &a->permute;
    const int E = r->params.num_experts;
    const cudaStream_t s = (cudaStream_t)stream;
    size_t smem;

    MOE_CHECK(moe_route_check(r));
    MOE_CHECK(check_permute(p, &smem));
    MOE_ARG_CHECK(r->num_tokens <= MOE_ROUTE_PERMUTE_MAX_TOKENS,
                  "route + permute: num_tokens = %lld (at most %d)", (long long)r->num_tokens,
                  MOE_ROUTE_PERMUTE_MAX_TOKENS);
    MOE_ARG_CHECK(a->slots.in == r->topk_ids && a->slots.out == p->topk_ids &&
                      a->slots.n == r->num_tokens * r->params.top_k &&
                      a->slots.top_k == r->params.top_k && p->num_tokens == r->num_tokens &&
                      p->top_k == r->params.top_k && !p->regions.counts,
                  "route + permute: slots (in %p, out %p, n %lld, top_k %d) and permute (ids %p, "
                  "%lld tokens, top_k %d, regions %p) do not chain the route (ids %p, %lld tokens, "
                  "top_k %d)",
                  (const void *)a->slots.in, (void *)a->slots.out, (long long)a->slots.n,
                  a->slots.top_k, (const void *)p->topk_ids, (long long)p->num_tokens, p->top_k,
                  (const void *)p->regions.counts, (void *)r->topk_ids, (long long)r->num_tokens,
                  r->params.top_k);
    /* no tokens still launches: the metadata pass writes the empty layout */
    return route_with_npl(
        E, [&](auto npl) { return launch_route_permute<decltype(npl)::value>(a, smem, s); });
}
