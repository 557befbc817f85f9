// SPDX-License-Identifier: Apache-2.0
// GPU all-to-all expert parallelism: dispatch (rows only to the ranks owning their experts),
// bounded waits on peers' signals, combine at the expert side (weighted f32 partial per
// (token, rank), or each (token, slot) row), and the source's rank-ordered sum. See a2a.h.
#include "kernels/a2a.h"
#include "kernels/prepare.h"

#include <cuda_bf16.h>
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/sticky.cuh"
#include "kernels/cuda/vec8.cuh"

namespace
{

constexpr int A2A_THREADS = 256;
constexpr int A2A_WARPS = A2A_THREADS / 32;
constexpr int A2A_ONE_CTA_TOKENS = 256; // tokens a CTA takes in one round (one a thread)
// Tokens per CTA of the dispatch by default: up to 8 tokens one CTA and one launch, more a
// count pass and ceil(T / 8) CTAs (at most the SM count), so the rows go out over many CTAs.
// Measured with two ranks on one H200 under MPS (2026-12-01, commit 3b2a430), dispatch
// phase at 32 / 128 / 512 tokens per rank: 87 / 251 / 778 us with 256 tokens per CTA, 57 / 69 /
// 158 us with 8 (16: 68 / 82 / 178; 32: 85 / 104 / 181); 1 and 8 tokens unchanged.
constexpr int A2A_CHUNK_TOKENS = 8;

__device__ __forceinline__ uint32_t load_acquire_sys(const int32_t *p)
{
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release_sys(int32_t *p, uint32_t v)
{
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// This step already timed out on some wait (the sticky word's timeout bit).
__device__ __forceinline__ bool step_timed_out(const int32_t *sticky)
{
    return sticky && (*(volatile const int32_t *)sticky & MOE_A2A_STICKY_TIMEOUT);
}

// A wait of this rank timed out in this or an earlier step (the runtime-wide word holds that
// step's sequence number).
__device__ __forceinline__ bool rank_dead(const int32_t *dead)
{
    return dead && *(volatile const int32_t *)dead;
}

// A wait of this rank timed out in an earlier step: its regions in the peers may be laid out
// otherwise by now, so this step stores nothing into them. (The step that timed out still
// returns what it computed, with RET_STATUS telling the peers it lost rows.)
__device__ __forceinline__ bool rank_silenced(const int32_t *dead, const uint32_t *seq)
{
    if (!dead)
        return false;
    const int32_t d = *(volatile const int32_t *)dead;
    return d != 0 && d != (int32_t)*seq;
}

// Records a timeout waiting for rank s in step seq: the sticky word (moe_sticky_mark), and
// (once) the step in the runtime-wide word.
__device__ __forceinline__ void note_timeout(int32_t *sticky, int32_t *dead, uint32_t seq, int s)
{
    if (dead)
        atomicCAS(dead, 0, seq ? (int32_t)seq : 1);
    moe_sticky_mark(sticky, s, MOE_STATUS_TIMEOUT, MOE_A2A_STICKY_TIMEOUT);
}

// Spins until ctrl[word] reaches seq (wrap-safe), at most timeout_ns; false on a timeout, and
// at once when this rank already timed out (this layer's step: the sticky timeout bit; any
// layer, any earlier step: the runtime-wide word): one dead peer costs one timeout, not one
// per wait or per layer before the caller synchronizes.
__device__ bool wait_word(const int32_t *ctrl, uint32_t seq, int64_t timeout_ns,
                          const int32_t *sticky, const int32_t *dead)
{
    const int64_t t0 = moe_global_ns();
    while ((int32_t)(load_acquire_sys(ctrl) - seq) < 0) {
        if (moe_global_ns() - t0 > timeout_ns || step_timed_out(sticky) || rank_dead(dead))
            return false;
        __nanosleep(64);
    }
    return true;
}

// A round every rank skips (a2a.h, moe_a2a_skip_t): written by round 0's wait, stream-ordered.
__device__ __forceinline__ bool skipped(const moe_a2a_skip_t &k)
{
    return k.rows && (int64_t)*k.rows <= k.first;
}

// A skipped round of a dispatch (Args: moe_a2a_dispatch_args_t or moe_a2a_ll_args_t): the
// counts sent read 0, nothing else (every kernel of the dispatch returns).
template <typename Args> __device__ __forceinline__ bool dispatch_skipped(const Args &a)
{
    if (!skipped(a.src.skip))
        return false;
    if (blockIdx.x == 0 && threadIdx.x < a.src.world)
        a.counts[threadIdx.x] = 0;
    return true;
}

// A source's header words for one destination, before its SENT word: {count, status}, its
// round's layout (ROWS: the host's tag, or m where it gave none) and its step's tokens.
__device__ __forceinline__ void put_header(volatile int32_t *c, int32_t count,
                                           const moe_a2a_source_t &src)
{
    c[MOE_A2A_COUNT] = count;
    c[MOE_A2A_STATUS] = *src.status;
    c[MOE_A2A_ROWS] = src.rows_tag ? src.rows_tag : (int32_t)src.region_rows;
    c[MOE_A2A_STEP_TOKENS] = (int32_t)(src.step_tokens < 0x7fffffff ? src.step_tokens : 0x7fffffff);
}

// Bit d set when rank d owns one of token t's experts.
__device__ __forceinline__ unsigned dest_mask(const int32_t *ids, const int32_t *owner, int64_t t,
                                              int k)
{
    unsigned m = 0;
    for (int j = 0; j < k; j++) {
        const int32_t e = ids[t * k + j];
        if (e >= 0)
            m |= 1u << owner[e];
    }
    return m;
}

// Tokens [begin, end) of CTA c: an even split of T over the grid.
__device__ __forceinline__ void chunk_of(int64_t T, int c, int G, int64_t *b, int64_t *e)
{
    *b = T * c / G;
    *e = T * (c + 1) / G;
}

// Pass 0 (grids of more than one CTA): each CTA's rows per destination into chain[c][d].
__global__ void __launch_bounds__(A2A_THREADS) a2a_count_kernel(moe_a2a_dispatch_args_t a)
{
    moe_pdl_wait();
    __shared__ int cnt[MOE_A2A_MAX_WORLD];
    int64_t b, e;
    if (skipped(a.src.skip))
        return;
    if (threadIdx.x < MOE_A2A_MAX_WORLD)
        cnt[threadIdx.x] = 0;
    __syncthreads();
    chunk_of(a.src.num_tokens, blockIdx.x, gridDim.x, &b, &e);
    for (int64_t t = b + threadIdx.x; t < e; t += A2A_THREADS) {
        const unsigned m = dest_mask(a.src.ids, a.src.owner, t, a.src.top_k);
        for (int d = 0; d < a.src.world; d++)
            if (m >> d & 1)
                atomicAdd(&cnt[d], 1);
    }
    __syncthreads();
    if (threadIdx.x < a.src.world)
        a.chain[blockIdx.x * MOE_A2A_MAX_WORLD + threadIdx.x] = (uint64_t)cnt[threadIdx.x];
}

// Copies token t's row (as bf16) to `dst` with one warp.
template <typename TX>
__device__ __forceinline__ void copy_row(const TX *x, int64_t t, int H, __nv_bfloat16 *dst)
{
    const int lane = threadIdx.x & 31;
    for (int c = lane * 8; c < H; c += 32 * 8) {
        float v[8];
        moe_load8(x + t * H + c, v);
        moe_store8(dst + c, v);
    }
}

__device__ __forceinline__ void copy_row(const __nv_bfloat16 *x, int64_t t, int H,
                                         __nv_bfloat16 *dst)
{
    const int lane = threadIdx.x & 31;
    const uint4 *src = reinterpret_cast<const uint4 *>(x + t * H);
    uint4 *d = reinterpret_cast<uint4 *>(dst);
    for (int c = lane; c < H / 8; c += 32)
        d[c] = src[c];
}

// The last CTA to finish (counted on `done`) signals: __threadfence_system by every CTA after
// its stores, then the last one sees them all (cumulativity) before its release store.
__device__ bool last_cta(int32_t *done)
{
    __shared__ bool last;
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int prev = atomicAdd(done, 1);
        last = prev == (int)gridDim.x - 1;
        if (last)
            *done = 0; // for the next launch (stream-ordered after this one)
    }
    __syncthreads();
    if (last)
        __threadfence_system();
    return last;
}

// Each thread's token's place among this CTA's tokens (in thread order) for every destination d
// its mask mk names, -1 for the others: warp ballots, then the warps before. Every thread
// calls it (two __syncthreads); wcnt[w][d] is left holding warp w's tokens for d.
__device__ __forceinline__ void place_in_cta(unsigned mk, int W, int (*wcnt)[MOE_A2A_MAX_WORLD],
                                             int (&p)[MOE_A2A_MAX_WORLD])
{
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    for (int d = 0; d < W; d++) {
        const unsigned bal = __ballot_sync(0xffffffffu, mk >> d & 1);
        if (lane == 0)
            wcnt[warp][d] = __popc(bal);
        p[d] = __popc(bal & ((1u << lane) - 1u));
    }
    __syncthreads();
    for (int d = 0; d < W; d++) {
        int before = 0;
        for (int w = 0; w < warp; w++)
            before += wcnt[w][d];
        p[d] = (mk >> d & 1) ? before + p[d] : -1;
    }
    __syncthreads();
}

// Pass 1: positions (prefix over the CTAs before this one, then warp ballots in token order),
// the rows and their metadata into the destinations, then the signal.
template <typename TX>
__global__ void __launch_bounds__(A2A_THREADS) a2a_send_kernel(moe_a2a_dispatch_args_t a)
{
    moe_pdl_wait();
    __shared__ int base[MOE_A2A_MAX_WORLD];
    __shared__ int wcnt[A2A_WARPS][MOE_A2A_MAX_WORLD];
    __shared__ int pos_s[A2A_THREADS][MOE_A2A_MAX_WORLD];
    __shared__ unsigned mask_s[A2A_THREADS];
    const int W = a.src.world, k = a.src.top_k, H = a.src.hidden, warp = threadIdx.x / 32,
              lane = threadIdx.x & 31;
    const int64_t m = a.src.region_rows;
    const TX *x = static_cast<const TX *>(a.src.x);
    const bool quiet =
        rank_silenced(a.src.dead, a.src.seq); /* positions, counts; nothing to peers */
    int64_t b, e;

    if (dispatch_skipped(a))
        return;
    chunk_of(a.src.num_tokens, blockIdx.x, gridDim.x, &b, &e);
    if (threadIdx.x < W) {
        int s = 0;
        for (int c = 0; c < (int)blockIdx.x; c++)
            s += (int)a.chain[c * MOE_A2A_MAX_WORLD + threadIdx.x];
        base[threadIdx.x] = s;
    }
    __syncthreads();
    for (int64_t p0 = b; p0 < e; p0 += A2A_THREADS) {
        const int64_t t = p0 + threadIdx.x;
        const unsigned mk = t < e ? dest_mask(a.src.ids, a.src.owner, t, k) : 0u;
        int place[MOE_A2A_MAX_WORLD];
        mask_s[threadIdx.x] = mk;
        place_in_cta(mk, W, wcnt, place);
        for (int d = 0; d < W; d++) {
            const int p = place[d] >= 0 ? base[d] + place[d] : -1;
            if (t < e)
                a.pos[(int64_t)d * m + t] = p;
            pos_s[threadIdx.x][d] = p;
        }
        __syncthreads();
        if (threadIdx.x < W) {
            int s = 0;
            for (int w = 0; w < A2A_WARPS; w++)
                s += wcnt[w][threadIdx.x];
            base[threadIdx.x] += s;
        }
        // rows: one warp per (token, destination)
        const int n = (int)(e - p0 < A2A_THREADS ? e - p0 : A2A_THREADS);
        for (int q = warp; q < n * W && !quiet; q += A2A_WARPS) {
            const int i = q / W, d = q % W;
            if (!(mask_s[i] >> d & 1))
                continue;
            const int64_t tt = p0 + i, p = pos_s[i][d];
            copy_row(x, tt, H, static_cast<__nv_bfloat16 *>(a.dst_x[d]) + p * H);
            if (lane < k) {
                a.dst_ids[d][p * k + lane] = a.src.ids[tt * k + lane];
                a.dst_w[d][p * k + lane] = a.src.weights[tt * k + lane];
            }
            if (lane == 0)
                a.dst_tok[d][p] = (int32_t)tt;
        }
        __syncthreads();
    }
    // T = 0 tokens still reach here (one CTA): every destination gets its count and signal
    if (!last_cta(a.done))
        return;
    if (threadIdx.x < W) {
        const int d = threadIdx.x;
        // one CTA: its running base is the total; more: the count pass's chain holds each CTA's
        int total = gridDim.x == 1 ? base[d] : 0;
        for (int c = 0; gridDim.x > 1 && c < (int)gridDim.x; c++)
            total += (int)a.chain[c * MOE_A2A_MAX_WORLD + d];
        a.counts[d] = total;
        if (a.dst_ctrl[d] && !quiet) {
            put_header(a.dst_ctrl[d], total, a.src);
            __threadfence_system();
            store_release_sys(a.dst_ctrl[d] + MOE_A2A_SENT, *a.src.seq);
        } else if (a.ctrl_out) {
            put_header(a.ctrl_out + d * MOE_A2A_CTRL, total, a.src);
        }
    }
}

// Source s's words of this wait (thread s); round 0 (most, bad not NULL): its step's tokens
// into *most, and *bad = 1 when its status is not 0.
__device__ void wait_one(const moe_a2a_wait_args_t &a, int s, int32_t *most, int32_t *bad)
{
    const int32_t *c = a.ctrl + s * MOE_A2A_CTRL;
    bool ok = true;
    if (a.word >= 0)
        ok = wait_word(c + a.word, *a.seq, a.timeout_ns, a.sticky, a.dead);
    if (!ok)
        note_timeout(a.sticky, a.dead, *a.seq, s);
    if (ok && a.word == MOE_A2A_RETURNED && a.sticky &&
        ((volatile const int32_t *)c)[MOE_A2A_RET_STATUS])
        atomicCAS(a.sticky, 0, (s << 8) | MOE_STATUS_PEER_FAILURE);
    int32_t status = ok ? ((volatile const int32_t *)c)[MOE_A2A_STATUS] : MOE_STATUS_TIMEOUT;
    if (a.counts) {
        int32_t n = ok ? ((volatile const int32_t *)c)[MOE_A2A_COUNT] : 0;
        const int32_t mine = a.rows_tag ? a.rows_tag : (int32_t)a.region_rows;
        const int32_t rows = ok ? ((volatile const int32_t *)c)[MOE_A2A_ROWS] : mine;
        /* out of step with this rank: use none of it */
        if (n < 0 || n > a.region_rows || rows != mine) {
            moe_sticky_mark(a.sticky, s, MOE_STATUS_INVALID_ARGUMENT, MOE_A2A_STICKY_ROWS);
            status = MOE_STATUS_INVALID_ARGUMENT; /* no rank computes a row this step */
            n = 0;
        }
        a.counts[s] = n;
    }
    if (a.statuses)
        a.statuses[s] = status;
    if (most) {
        if (status != 0)
            *bad = 1;
        const int32_t st = ok ? ((volatile const int32_t *)c)[MOE_A2A_STEP_TOKENS] : 0;
        atomicMax(most, st);
    }
}

__global__ void a2a_wait_kernel(moe_a2a_wait_args_t a)
{
    moe_pdl_wait_only();          // spins on peers: its dependents launch at its end
    __shared__ int32_t most, bad; /* round 0 (skip_out): the ranks' largest step, any failure */
    const int s = threadIdx.x;
    if (threadIdx.x == 0) {
        most = 0;
        bad = 0;
    }
    __syncthreads();
    if (a.skip_out && s < a.world)
        wait_one(a, s, &most, &bad);
    __syncthreads();
    if (a.skip_out) {
        if (threadIdx.x == 0)
            *a.skip_out = bad ? 0 : most;
        return;
    }
    if (s >= a.world)
        return;
    if (skipped(a.skip)) {
        if (a.counts)
            a.counts[s] = 0;
        if (a.statuses)
            a.statuses[s] = 0;
        return;
    }
    wait_one(a, s, NULL, NULL);
}

// Region and row of the r-th received row (regions in rank order, counts[s] rows each).
__device__ __forceinline__ bool region_row(const int32_t *counts, int W, int64_t r, int *s,
                                           int64_t *i)
{
    for (int q = 0; q < W; q++) {
        if (r < counts[q]) {
            *s = q;
            *i = r;
            return true;
        }
        r -= counts[q];
    }
    return false;
}

// One warp per received row.
__global__ void __launch_bounds__(A2A_THREADS) a2a_combine_kernel(moe_a2a_combine_args_t a)
{
    moe_pdl_wait();
    const int W = a.world, k = a.top_k, H = a.hidden, lane = threadIdx.x & 31;
    const int64_t m = a.region_rows;
    const __nv_bfloat16 *rows = static_cast<const __nv_bfloat16 *>(a.rows);
    const bool quiet = rank_silenced(a.dead, a.seq); /* nothing into the peers */
    int64_t total = 0;
    if (skipped(a.skip))
        return;
    for (int q = 0; q < W && !quiet; q++)
        total += a.counts[q];
    for (int64_t r = (int64_t)blockIdx.x * A2A_WARPS + threadIdx.x / 32; r < total;
         r += (int64_t)gridDim.x * A2A_WARPS) {
        int s;
        int64_t i;
        region_row(a.counts, W, r, &s, &i);
        const int64_t slot0 = ((int64_t)s * m + i) * k;
        if (a.deterministic) {
            const int64_t t = a.tok[(int64_t)s * m + i];
            __nv_bfloat16 *dst = static_cast<__nv_bfloat16 *>(a.dst_ret[s]);
            for (int j = 0; j < k; j++) {
                const int32_t row = a.row_of_slot[slot0 + j];
                if (row < 0)
                    continue;
                const uint4 *src = reinterpret_cast<const uint4 *>(rows + (int64_t)row * H);
                uint4 *d = reinterpret_cast<uint4 *>(dst + (t * k + j) * H);
                for (int c = lane; c < H / 8; c += 32)
                    d[c] = src[c];
            }
            continue;
        }
        float *dst = static_cast<float *>(a.dst_ret[s]) + i * H;
        for (int c = lane * 8; c < H; c += 32 * 8) {
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int j = 0; j < k; j++) {
                const int32_t row = a.row_of_slot[slot0 + j];
                if (row < 0)
                    continue;
                const float w = a.w[slot0 + j];
                float v[8];
                moe_load8(rows + (int64_t)row * H + c, v);
#pragma unroll
                for (int u = 0; u < 8; u++)
                    acc[u] += w * v[u];
            }
            moe_store8(dst + c, acc);
        }
    }
    if (!last_cta(a.done))
        return;
    if (threadIdx.x < W && a.dst_ctrl[threadIdx.x] && !quiet) {
        /* rows lost here (a timeout) or not used (a peer out of step): every source hears it */
        const int32_t lost = a.sticky && (*(volatile const int32_t *)a.sticky &
                                          (MOE_A2A_STICKY_TIMEOUT | MOE_A2A_STICKY_ROWS)) != 0;
        ((volatile int32_t *)a.dst_ctrl[threadIdx.x])[MOE_A2A_RET_STATUS] = lost;
        __threadfence_system();
        store_release_sys(a.dst_ctrl[threadIdx.x] + MOE_A2A_RETURNED, *a.seq);
    }
}

// One thread per 8 columns of a token, grid-stride; threads < W of each CTA wait for the
// returns first.
template <typename TY>
__global__ void __launch_bounds__(A2A_THREADS) a2a_finish_kernel(moe_a2a_finish_args_t a)
{
    moe_pdl_wait_only(); // spins on peers: its dependents launch at its end
    __shared__ int timed_out;
    const int W = a.world, H = a.hidden;
    if (skipped(a.skip))
        return;
    if (threadIdx.x == 0)
        timed_out = 0;
    __syncthreads();
    if (a.ctrl && threadIdx.x < W &&
        !wait_word(a.ctrl + threadIdx.x * MOE_A2A_CTRL + MOE_A2A_RETURNED, *a.seq, a.timeout_ns,
                   a.sticky, a.dead)) {
        timed_out = 1;
        note_timeout(a.sticky, a.dead, *a.seq, threadIdx.x);
    } else if (a.ctrl && threadIdx.x < W && a.sticky &&
               ((volatile const int32_t *)
                    a.ctrl)[threadIdx.x * MOE_A2A_CTRL + MOE_A2A_RET_STATUS]) {
        atomicCAS(a.sticky, 0, (threadIdx.x << 8) | MOE_STATUS_PEER_FAILURE);
    }
    __syncthreads();
    const int per = H / 8;
    for (int64_t idx = (int64_t)blockIdx.x * A2A_THREADS + threadIdx.x; idx < a.num_tokens * per;
         idx += (int64_t)gridDim.x * A2A_THREADS) {
        const int64_t t = idx / per;
        const int c = (int)(idx % per) * 8;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int d = 0; d < W && !timed_out; d++) {
            const int32_t p = a.pos[(int64_t)d * a.region_rows + t];
            if (p < 0)
                continue;
            float v[8];
            moe_load8(a.ret + ((int64_t)d * a.region_rows + p) * H + c, v);
#pragma unroll
            for (int u = 0; u < 8; u++)
                acc[u] += v[u];
        }
        if (a.shared_out) {
            const float g =
                a.shared_gate_logit ? 1.0f / (1.0f + __expf(-a.shared_gate_logit[t])) : 1.0f;
            float v[8];
            moe_load8(static_cast<const __nv_bfloat16 *>(a.shared_out) + t * H + c, v);
#pragma unroll
            for (int u = 0; u < 8; u++)
                acc[u] += g * v[u];
        }
        moe_store8(static_cast<TY *>(a.y) + t * H + c, acc);
    }
}

// ---- low-latency dispatch (a2a.h: moe_a2a_ll_args_t) ---------------------------------------

constexpr int LL_T = MOE_A2A_LL_MAX_TOKENS;
constexpr int LL_P = MOE_A2A_LL_MAX_PAIRS;
constexpr int LL_E = MOE_A2A_LL_MAX_EXPERTS;
static_assert(LL_T <= A2A_THREADS, "one token a thread in the region-row pass");
static_assert(MOE_A2A_MAX_WORLD <= A2A_WARPS, "one warp a destination in the layout scan");

// Exclusive scan (one warp) of the sizes of experts [b, e) rounded up to br: off[x] += rows of
// the experts before x; returns the rows of all of them.
__device__ int64_t warp_padded_scan(const int *sz, int b, int e, int br, int *off)
{
    const int lane = threadIdx.x & 31;
    int64_t run = 0;
    for (int x0 = b; x0 < e; x0 += 32) {
        const int x = x0 + lane;
        const int64_t v = x < e ? ((int64_t)sz[x] + br - 1) / br * br : 0;
        int64_t inc = v;
        for (int o = 1; o < 32; o <<= 1) {
            const int64_t n = __shfl_up_sync(0xffffffffu, inc, o);
            if (lane >= o)
                inc += n;
        }
        if (x < e)
            off[x] += (int)(run + inc - v);
        run += __shfl_sync(0xffffffffu, inc, 31);
    }
    return run;
}

// The phases of the low-latency dispatch (a2a.h: moe_a2a_ll_args_t), each run by a whole CTA.

// 1. Each pair's rank within its expert (warp 0, in pair order: every CTA the same) into
//    prank, and this rank's pairs per expert into cnt (zeroed and synchronised before).
__device__ void ll_rank_pairs(const moe_a2a_ll_args_t &a, int *cnt, int *prank)
{
    const int pairs = (int)a.src.num_tokens * a.src.top_k, E = a.num_experts;
    const int lane = threadIdx.x & 31;
    if (threadIdx.x >= 32)
        return;
    for (int p0 = 0; p0 < pairs; p0 += 32) {
        const int p = p0 + lane;
        const int e = p < pairs ? a.src.ids[p] : -1;
        const unsigned same = __match_any_sync(0xffffffffu, e >= 0 ? e : E + lane);
        const int before = e >= 0 ? cnt[e] : 0;
        __syncwarp();
        if (e >= 0) {
            prank[p] = before + __popc(same & ((1u << lane) - 1u));
            if (__ffs(same) - 1 == lane)
                cnt[e] = before + __popc(same);
        }
        __syncwarp();
    }
}

// 2. Each token's row in each destination's region (one token a thread, T <= 256) into
//    pos_s (and a.pos where write_pos), and the rows to each destination into total.
__device__ void ll_place_tokens(const moe_a2a_ll_args_t &a, int (*pos_s)[MOE_A2A_MAX_WORLD],
                                int (*wcnt)[MOE_A2A_MAX_WORLD], int *total, bool write_pos)
{
    const int W = a.src.world, T = (int)a.src.num_tokens, t = threadIdx.x;
    const unsigned mk = t < T ? dest_mask(a.src.ids, a.src.owner, t, a.src.top_k) : 0u;
    int place[MOE_A2A_MAX_WORLD];
    place_in_cta(mk, W, wcnt, place);
    for (int d = 0; d < W; d++)
        if (t < T) {
            pos_s[t][d] = place[d];
            if (write_pos)
                a.pos[(int64_t)d * a.src.region_rows + t] = place[d];
        }
    if (t < W) {
        int n = 0;
        for (int w = 0; w < A2A_WARPS; w++)
            n += wcnt[w][t];
        total[t] = n;
    }
}

// 3. This rank's counts into row `rank` of every count matrix, then (release) the signal.
__device__ void ll_publish_counts(const moe_a2a_ll_args_t &a, const int *cnt, uint32_t seq)
{
    const int W = a.src.world, E = a.num_experts;
    for (int i = threadIdx.x; i < W * E; i += A2A_THREADS)
        a.dst_cnt[i / E][i % E] = cnt[i % E];
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x < W) {
        ((volatile int32_t *)a.dst_ctrl[threadIdx.x])[MOE_A2A_LL_BR] = a.block_rows;
        __threadfence_system();
        store_release_sys(a.dst_ctrl[threadIdx.x] + MOE_A2A_LL_COUNTS, seq);
    }
}

// 4. Every rank's counts here (bounded wait), the same variant everywhere; *go = 0 otherwise.
__device__ void ll_wait_counts(const moe_a2a_ll_args_t &a, uint32_t seq, int *go)
{
    if (threadIdx.x >= a.src.world)
        return;
    const int s = threadIdx.x;
    const int32_t *c = a.ctrl + s * MOE_A2A_CTRL;
    if (!wait_word(c + MOE_A2A_LL_COUNTS, seq, a.timeout_ns, a.sticky, a.src.dead)) {
        note_timeout(a.sticky, a.src.dead, seq, s);
        *go = 0;
    } else if (((volatile const int32_t *)c)[MOE_A2A_LL_BR] != a.block_rows) {
        /* the ranks picked different GEMM variants (different tune files, say) */
        moe_sticky_mark(a.sticky, s, MOE_STATUS_INVALID_ARGUMENT, MOE_A2A_STICKY_ROWS);
        *go = 0;
    }
}

// 5. From every rank's counts: this rank's first row of each expert at its owner (the experts'
//    padded sizes in order, then the rows of the ranks before this one) into off, and the
//    destinations whose rows would not fit into *skip. cnt is overwritten.
__device__ void ll_layout_own(const moe_a2a_ll_args_t &a, int *cnt, int *off, unsigned *skip)
{
    const int W = a.src.world, E = a.num_experts, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    for (int e = threadIdx.x; e < E; e += A2A_THREADS) {
        int tot = 0, before = 0;
        for (int s = 0; s < W; s++) {
            const int v = ((volatile const int32_t *)a.cnt)[(int64_t)s * E + e];
            tot += v;
            before += s < a.src.rank ? v : 0;
        }
        cnt[e] = tot;
        off[e] = before;
    }
    __syncthreads();
    if (warp < W) { // warp d: rank d's experts, padded, in order
        const int64_t rows =
            warp_padded_scan(cnt, a.first[warp], a.first[warp + 1], a.block_rows, off);
        if (lane == 0 && rows > a.rows_cap) {
            atomicOr(skip, 1u << warp);
            moe_sticky_mark(a.sticky, warp, MOE_STATUS_INVALID_ARGUMENT, MOE_A2A_STICKY_ROWS);
        }
    }
    __syncthreads();
}

// 6. The rows (one warp a pair, over the grid), then per (token, destination) the row of each
//    slot, the weights and the token index. pos(t, d): the token's row in region d, or -1.
template <typename TX, typename Pos>
__device__ void ll_store_rows(const moe_a2a_ll_args_t &a, const int *off, const int *prank,
                              unsigned skip, Pos pos)
{
    const int W = a.src.world, k = a.src.top_k, H = a.src.hidden, T = (int)a.src.num_tokens;
    const int pairs = T * k, warp = threadIdx.x / 32;
    const TX *x = static_cast<const TX *>(a.src.x);
    const int gw = (int)blockIdx.x * A2A_WARPS + warp, nw = (int)gridDim.x * A2A_WARPS;
    for (int p = gw; p < pairs; p += nw) {
        const int e = a.src.ids[p];
        if (e < 0)
            continue;
        const int d = a.src.owner[e];
        if (skip >> d & 1)
            continue;
        copy_row(x, p / k, H,
                 static_cast<__nv_bfloat16 *>(a.dst_a[d]) + (int64_t)(off[e] + prank[p]) * H);
    }
    const int gt = (int)blockIdx.x * A2A_THREADS + threadIdx.x, nt = (int)gridDim.x * A2A_THREADS;
    for (int u = gt; u < T * W; u += nt) {
        const int t = u / W, d = u % W, i = pos(t, d);
        if (i < 0 || (skip >> d & 1))
            continue;
        for (int j = 0; j < k; j++) {
            const int e = a.src.ids[t * k + j];
            a.dst_slot[d][i * k + j] =
                e >= 0 && a.src.owner[e] == d ? off[e] + prank[t * k + j] : -1;
            a.dst_w[d][i * k + j] = a.src.weights[t * k + j];
        }
        a.dst_tok[d][i] = t;
    }
}

// 7. The last CTA: {count, status}, then SENT (a rank that skipped a destination still
//    signals it: its verdict already fails the step).
__device__ void ll_signal(const moe_a2a_ll_args_t &a, const int *total, unsigned skip, bool quiet,
                          uint32_t seq)
{
    if (!last_cta(a.done))
        return;
    if (threadIdx.x < a.src.world) {
        const int d = threadIdx.x;
        const int n = (skip >> d & 1) ? 0 : total[d];
        a.counts[d] = n;
        if (!quiet) {
            put_header(a.dst_ctrl[d], n, a.src);
            __threadfence_system();
            store_release_sys(a.dst_ctrl[d] + MOE_A2A_SENT, seq);
        }
    }
}

// One kernel: every CTA ranks the pairs, CTA 0 publishes the counts, every CTA waits for them.
template <typename TX>
__global__ void __launch_bounds__(A2A_THREADS) a2a_ll_dispatch_kernel(moe_a2a_ll_args_t a)
{
    moe_pdl_wait_only();        // spins on peers: its dependents launch at its end
    __shared__ int cnt[LL_E];   // this rank's pairs per expert, then every rank's
    __shared__ int off[LL_E];   // this rank's first row of each expert at its owner
    __shared__ int prank[LL_P]; // rank of each pair within its expert (pair order)
    __shared__ int pos_s[LL_T][MOE_A2A_MAX_WORLD];
    __shared__ int wcnt[A2A_WARPS][MOE_A2A_MAX_WORLD];
    __shared__ int total[MOE_A2A_MAX_WORLD];
    __shared__ unsigned skip; // bit d: nothing goes to rank d this step
    __shared__ int go;
    const uint32_t seq = *a.src.seq;
    const bool quiet = rank_silenced(a.src.dead, a.src.seq); /* positions, counts only */

    if (dispatch_skipped(a))
        return;
    for (int e = threadIdx.x; e < a.num_experts; e += A2A_THREADS)
        cnt[e] = 0;
    if (threadIdx.x == 0) {
        skip = 0;
        go = !quiet;
    }
    __syncthreads();
    ll_rank_pairs(a, cnt, prank);
    ll_place_tokens(a, pos_s, wcnt, total, blockIdx.x == 0);
    __syncthreads();
    if (blockIdx.x == 0 && !quiet)
        ll_publish_counts(a, cnt, seq);
    if (!quiet)
        ll_wait_counts(a, seq, &go);
    __syncthreads();
    if (go) {
        ll_layout_own(a, cnt, off, &skip);
        ll_store_rows<TX>(a, off, prank, skip, [&](int t, int d) { return pos_s[t][d]; });
    }
    ll_signal(a, total, skip, quiet, seq);
}

// Two kernels, pass 1 (one CTA): the pairs' ranks, the positions, the count exchange and this
// rank's layout at every owner, into a.plan.
__global__ void __launch_bounds__(A2A_THREADS) a2a_ll_plan_kernel(moe_a2a_ll_args_t a)
{
    moe_pdl_wait_only(); // spins on peers: its dependents launch at its end
    __shared__ int cnt[LL_E];
    __shared__ int off[LL_E];
    __shared__ int pos_s[LL_T][MOE_A2A_MAX_WORLD];
    __shared__ int wcnt[A2A_WARPS][MOE_A2A_MAX_WORLD];
    __shared__ int total[MOE_A2A_MAX_WORLD];
    __shared__ unsigned skip;
    __shared__ int go;
    const int W = a.src.world, E = a.num_experts;
    int32_t *plan_off = a.plan + 2 + MOE_A2A_MAX_WORLD, *plan_prank = plan_off + E;
    const uint32_t seq = *a.src.seq;
    const bool quiet = rank_silenced(a.src.dead, a.src.seq);

    if (dispatch_skipped(a))
        return;
    for (int e = threadIdx.x; e < E; e += A2A_THREADS)
        cnt[e] = 0;
    if (threadIdx.x == 0) {
        skip = 0;
        go = !quiet;
    }
    __syncthreads();
    ll_rank_pairs(a, cnt, plan_prank); /* straight into the plan: the send pass reads it */
    ll_place_tokens(a, pos_s, wcnt, total, true);
    __syncthreads();
    if (!quiet) {
        ll_publish_counts(a, cnt, seq);
        ll_wait_counts(a, seq, &go);
    }
    __syncthreads();
    if (go)
        ll_layout_own(a, cnt, off, &skip);
    for (int e = threadIdx.x; e < E; e += A2A_THREADS)
        plan_off[e] = off[e];
    if (threadIdx.x < W)
        a.plan[2 + threadIdx.x] = total[threadIdx.x];
    if (threadIdx.x == 0) {
        a.plan[0] = go;
        a.plan[1] = (int32_t)skip;
    }
}

// Two kernels, pass 2 (the grid): the rows from the plan, then the signal.
template <typename TX>
__global__ void __launch_bounds__(A2A_THREADS) a2a_ll_send_kernel(moe_a2a_ll_args_t a)
{
    moe_pdl_wait();
    __shared__ int off[LL_E];
    __shared__ int prank[LL_P];
    __shared__ int total[MOE_A2A_MAX_WORLD];
    const int W = a.src.world, E = a.num_experts, pairs = (int)a.src.num_tokens * a.src.top_k;
    const int32_t *plan_off = a.plan + 2 + MOE_A2A_MAX_WORLD, *plan_prank = plan_off + E;
    const bool quiet = rank_silenced(a.src.dead, a.src.seq);
    const int64_t m = a.src.region_rows;

    if (skipped(a.src.skip)) /* pass 1 wrote the counts */
        return;
    for (int e = threadIdx.x; e < E; e += A2A_THREADS)
        off[e] = plan_off[e];
    for (int p = threadIdx.x; p < pairs; p += A2A_THREADS)
        prank[p] = plan_prank[p];
    if (threadIdx.x < W)
        total[threadIdx.x] = a.plan[2 + threadIdx.x];
    __syncthreads();
    const unsigned skip = (unsigned)a.plan[1];
    if (a.plan[0])
        ll_store_rows<TX>(a, off, prank, skip,
                          [&](int t, int d) { return a.pos[(int64_t)d * m + t]; });
    ll_signal(a, total, skip, quiet, *a.src.seq);
}

// The destination's GEMM layout from its count matrix (one CTA).
__global__ void __launch_bounds__(A2A_THREADS) a2a_ll_layout_kernel(moe_a2a_ll_layout_args_t a)
{
    moe_pdl_wait();
    __shared__ int sz[LL_E];
    __shared__ int off[LL_E];
    __shared__ int64_t rows;
    __shared__ int none;
    const int W = a.world, E = a.experts;
    if (threadIdx.x == 0) {
        /* the first failing rank's status into the sticky word, as the permute records it */
        none = moe_first_failure(a.statuses, W, a.sticky, true) >= 0 || skipped(a.skip) ||
               step_timed_out(a.sticky) ||
               (a.sticky && (*(volatile const int32_t *)a.sticky & MOE_A2A_STICKY_ROWS));
    }
    for (int e = threadIdx.x; e < E; e += A2A_THREADS) {
        int tot = 0;
        for (int s = 0; s < W; s++)
            tot += a.cnt[(int64_t)s * a.num_experts + a.first + e];
        sz[e] = tot;
        off[e] = 0;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        const int64_t r = warp_padded_scan(sz, 0, E, a.block_rows, off);
        if (threadIdx.x == 0)
            rows = r;
    }
    __syncthreads();
    if (threadIdx.x == 0 && !none &&
        (rows > a.rows_cap || rows > (int64_t)a.max_blocks * a.block_rows)) {
        none = 1;
        moe_sticky_mark(a.sticky, a.rank, MOE_STATUS_INVALID_ARGUMENT, MOE_A2A_STICKY_ROWS);
    }
    __syncthreads();
    const int nb = none ? 0 : (int)(rows / a.block_rows);
    for (int e = threadIdx.x; e < E; e += A2A_THREADS) {
        a.counts[e] = none ? 0 : sz[e];
        a.offsets[e] = none ? 0 : off[e];
        const int b0 = off[e] / a.block_rows, b1 = b0 + (sz[e] + a.block_rows - 1) / a.block_rows;
        for (int b = b0; b < b1 && !none; b++)
            a.block_expert[b] = e;
    }
    for (int b = nb + threadIdx.x; b < a.max_blocks; b += A2A_THREADS)
        a.block_expert[b] = -1;
    if (threadIdx.x == 0) {
        a.offsets[E] = nb * a.block_rows;
        *a.num_blocks = nb;
    }
}

} // namespace

extern "C" moe_status_t moe_a2a_dispatch_launch(const moe_a2a_dispatch_args_t *args, void *stream)
{
    moe_a2a_dispatch_args_t a = *args;
    cudaStream_t s = (cudaStream_t)stream;
    const int64_t T = a.src.num_tokens;
    int G = 1;
    if (a.src.world < 1 || a.src.world > MOE_A2A_MAX_WORLD || a.src.hidden % 8 ||
        a.src.top_k > 32 || T > a.src.region_rows)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "a2a dispatch: world %d (1..%d), hidden %d (multiple of 8), top_k %d "
                         "(<= 32), %lld tokens (<= region rows %lld)",
                         a.src.world, MOE_A2A_MAX_WORLD, a.src.hidden, a.src.top_k, (long long)T,
                         (long long)a.src.region_rows);
    if (a.src.x_dtype != MOE_DTYPE_BF16 && a.src.x_dtype != MOE_DTYPE_F32)
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "a2a dispatch: x in %s",
                         moe_dtype_name(a.src.x_dtype));
    const int chunk = a.chunk_tokens <= 0                   ? A2A_CHUNK_TOKENS
                      : a.chunk_tokens < A2A_ONE_CTA_TOKENS ? a.chunk_tokens
                                                            : A2A_ONE_CTA_TOKENS;
    if (T > chunk) {
        const int64_t want = (T + chunk - 1) / chunk;
        const int cap = a.num_sms < MOE_A2A_MAX_CTAS ? a.num_sms : MOE_A2A_MAX_CTAS;
        G = (int)(want < cap ? want : cap);
        if (G < 1)
            G = 1;
    }
    if (G > 1) {
        MOE_CUDA_CHECK(moe_ep_launch((a2a_count_kernel), dim3(G), dim3(A2A_THREADS), 0, s, a));
        MOE_CUDA_CHECK_LAUNCH("a2a count");
    }
    MOE_CUDA_CHECK(
        a.src.x_dtype == MOE_DTYPE_BF16
            ? moe_ep_launch((a2a_send_kernel<__nv_bfloat16>), dim3(G), dim3(A2A_THREADS), 0, s, a)
            : moe_ep_launch((a2a_send_kernel<float>), dim3(G), dim3(A2A_THREADS), 0, s, a));
    MOE_CUDA_CHECK_LAUNCH("a2a send");
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_a2a_wait_launch(const moe_a2a_wait_args_t *args, void *stream)
{
    MOE_CUDA_CHECK(
        moe_ep_launch((a2a_wait_kernel), dim3(1), dim3(32), 0, (cudaStream_t)stream, *args));
    MOE_CUDA_CHECK_LAUNCH("a2a wait");
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_a2a_combine_launch(const moe_a2a_combine_args_t *args, void *stream)
{
    const int G = args->num_sms > 0 ? 2 * args->num_sms : 64;
    if (args->hidden % 8)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "a2a combine: hidden %d", args->hidden);
    MOE_CUDA_CHECK(moe_ep_launch((a2a_combine_kernel), dim3(G), dim3(A2A_THREADS), 0,
                                 (cudaStream_t)stream, *args));
    MOE_CUDA_CHECK_LAUNCH("a2a combine");
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_a2a_finish_launch(const moe_a2a_finish_args_t *args, void *stream)
{
    const int64_t n = args->num_tokens * (args->hidden / 8);
    const int64_t most = 4 * (int64_t)(args->num_sms > 0 ? args->num_sms : 1);
    const int64_t want = n > 0 ? (n + A2A_THREADS - 1) / A2A_THREADS : 1;
    const unsigned grid = (unsigned)(want < most ? want : most);
    cudaStream_t s = (cudaStream_t)stream;
    if (args->hidden % 8)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "a2a finish: hidden %d", args->hidden);
    if (args->y_dtype == MOE_DTYPE_F32)
        MOE_CUDA_CHECK(
            moe_ep_launch((a2a_finish_kernel<float>), dim3(grid), dim3(A2A_THREADS), 0, s, *args));
    else if (args->y_dtype == MOE_DTYPE_BF16)
        MOE_CUDA_CHECK(moe_ep_launch((a2a_finish_kernel<__nv_bfloat16>), dim3(grid),
                                     dim3(A2A_THREADS), 0, s, *args));
    else
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "a2a finish: y in %s",
                         moe_dtype_name(args->y_dtype));
    MOE_CUDA_CHECK_LAUNCH("a2a finish");
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_a2a_ll_dispatch_launch(const moe_a2a_ll_args_t *args, void *stream)
{
    const moe_a2a_ll_args_t *a = args;
    const int64_t pairs = a->src.num_tokens * a->src.top_k;
    cudaStream_t s = (cudaStream_t)stream;
    int G = a->num_sms > 0 ? a->num_sms : 1;
    if (a->src.world < 1 || a->src.world > MOE_A2A_MAX_WORLD || a->src.hidden % 8 ||
        a->src.top_k > 32 || a->src.num_tokens > a->src.region_rows || a->src.region_rows > LL_T ||
        a->src.region_rows * a->src.top_k > LL_P || a->num_experts > LL_E || a->block_rows < 1)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "a2a low-latency dispatch: world %d (1..%d), hidden %d (multiple of 8), "
                         "top_k %d (<= 32), %lld tokens (<= region rows %lld <= %d, times top_k "
                         "<= %d), %d experts (<= %d), block rows %d",
                         a->src.world, MOE_A2A_MAX_WORLD, a->src.hidden, a->src.top_k,
                         (long long)a->src.num_tokens, (long long)a->src.region_rows, LL_T, LL_P,
                         a->num_experts, LL_E, a->block_rows);
    if (a->src.x_dtype != MOE_DTYPE_BF16 && a->src.x_dtype != MOE_DTYPE_F32)
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "a2a low-latency dispatch: x in %s",
                         moe_dtype_name(a->src.x_dtype));
    /* one warp a (token, slot) row: no more CTAs than rows need */
    if (G > (pairs + A2A_WARPS - 1) / A2A_WARPS)
        G = (int)((pairs + A2A_WARPS - 1) / A2A_WARPS);
    if (G > MOE_A2A_MAX_CTAS)
        G = MOE_A2A_MAX_CTAS;
    if (G < 1)
        G = 1;
    const bool bf16 = a->src.x_dtype == MOE_DTYPE_BF16;
    if (a->plan) {
        MOE_CUDA_CHECK(moe_ep_launch((a2a_ll_plan_kernel), dim3(1), dim3(A2A_THREADS), 0, s, *a));
        MOE_CUDA_CHECK_LAUNCH("a2a low-latency plan");
        MOE_CUDA_CHECK(bf16 ? moe_ep_launch((a2a_ll_send_kernel<__nv_bfloat16>), dim3(G),
                                            dim3(A2A_THREADS), 0, s, *a)
                            : moe_ep_launch((a2a_ll_send_kernel<float>), dim3(G), dim3(A2A_THREADS),
                                            0, s, *a));
    } else {
        MOE_CUDA_CHECK(bf16 ? moe_ep_launch((a2a_ll_dispatch_kernel<__nv_bfloat16>), dim3(G),
                                            dim3(A2A_THREADS), 0, s, *a)
                            : moe_ep_launch((a2a_ll_dispatch_kernel<float>), dim3(G),
                                            dim3(A2A_THREADS), 0, s, *a));
    }
    MOE_CUDA_CHECK_LAUNCH("a2a low-latency dispatch");
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_a2a_ll_layout_launch(const moe_a2a_ll_layout_args_t *args, void *stream)
{
    if (args->experts > LL_E || args->block_rows < 1 || args->world > MOE_A2A_MAX_WORLD)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "a2a low-latency layout: %d experts (<= %d), block rows %d, world %d",
                         args->experts, LL_E, args->block_rows, args->world);
    MOE_CUDA_CHECK(moe_ep_launch((a2a_ll_layout_kernel), dim3(1), dim3(A2A_THREADS), 0,
                                 (cudaStream_t)stream, *args));
    MOE_CUDA_CHECK_LAUNCH("a2a low-latency layout");
    return MOE_STATUS_SUCCESS;
}

extern "C" moe_status_t moe_a2a_prepare(void)
{
    MOE_CUDA_PREPARE(a2a_ll_dispatch_kernel<__nv_bfloat16>);
    MOE_CUDA_PREPARE(a2a_ll_dispatch_kernel<float>);
    MOE_CUDA_PREPARE(a2a_ll_layout_kernel);
    MOE_CUDA_PREPARE(a2a_ll_plan_kernel);
    MOE_CUDA_PREPARE(a2a_ll_send_kernel<__nv_bfloat16>);
    MOE_CUDA_PREPARE(a2a_ll_send_kernel<float>);
    MOE_CUDA_PREPARE(a2a_count_kernel);
    MOE_CUDA_PREPARE(a2a_send_kernel<__nv_bfloat16>);
    MOE_CUDA_PREPARE(a2a_send_kernel<float>);
    MOE_CUDA_PREPARE(a2a_wait_kernel);
    MOE_CUDA_PREPARE(a2a_combine_kernel);
    MOE_CUDA_PREPARE(a2a_finish_kernel<float>);
    MOE_CUDA_PREPARE(a2a_finish_kernel<__nv_bfloat16>);
    return MOE_STATUS_SUCCESS;
}
