// SPDX-License-Identifier: Apache-2.0
// The fused small-batch decode step (kernels/decode.h), its kernel and launch templates: one
// persistent launch runs the fp8 activation quantisation, GEMM 1 + activation, GEMM 2 and the
// weighted sum per token.
//
// fp8: CTA b first quantises x's token rows b, b + CTAs, ... (waiting on nothing; at one token
// every CTA quantises the row into its own shared memory, XS_TOKENS). Then work
// items, one warp each, in one order that every warp walks with a stride of the warp count
// (item i on warp i mod W): [GEMM 1: (expert, 8 output columns of h, k split)] [GEMM 2: (expert,
// 16 rows of hidden, k split)]. An item waits only on the quantised x (fp8 GEMM 1) and on items
// before it (GEMM 2 on every GEMM 1 item of its expert), and a warp takes its items in order, so
// the lowest unfinished item can always run: no deadlock, with no grid-wide barrier. The last GEMM
// 1 piece of a column tile sums the tile's pieces and applies the activation; the last GEMM 2 item
// of a row tile sums that tile for every token. A waiting item issues its first weight loads before
// it waits.
//
// Tensor cores through mma.sync with the weights as the M side (swap-AB): a warp's 16 weight
// rows x 16 bytes of k per thread come straight from global memory into registers (no shared
// memory), the tokens of the expert are the 8 mma columns. The k order inside a 16-byte load
// is permuted the same way for weights and tokens, so the sum is a dot product in another
// order: bf16 m16n8k16 takes 2 x 8 values of each row per 16-byte load (32 k), e4m3 m16n8k32
// 2 x 16 (64 k). At one fp8 token GEMM 1 takes x as f16 from shared memory (the codes' values,
// exact) and unpacks only the weights, in the four f16 m16n8k16 that ptxas makes of the two e4m3
// ones (mma2 of raw_t): the same sums, bitwise.
#ifndef MOE_DECODE_SM90_CUH
#define MOE_DECODE_SM90_CUH

#include "kernels/decode.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include "kernels/cuda/act.cuh"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/device_cache.cuh"
#include "kernels/cuda/pdl.cuh"
#include "kernels/cuda/sticky.cuh"
#include "kernels/cuda/stream_load.cuh"
#include "base/numeric.h"
#include "kernels/prepare.h"

namespace moe_dec
{

constexpr int THREADS = 256, WARPS = THREADS / 32;
// 16-byte loads per row in flight per batch (two batches in turn), two CTAs an SM (8 with one
// CTA an SM was 10-50 % slower: docs/KERNELS.md, "Fused decode")
constexpr int U_WIDE = 4;
constexpr int TILE1 = 8;  // GEMM 1: output columns of h per item (8 gate + 8 up rows)
constexpr int TILE2 = 16; // GEMM 2: output columns of y per item
constexpr int MAX_ROWS = MOE_DECODE_MAX_ROWS; // slots: tokens x top_k (top_k <= 16)
// fp8 steps of one token (XS_TOKENS) whose x fits XS_MAX bytes as f16: every CTA quantises x
// into its own shared memory, so GEMM 1 waits on no other CTA (the global copy's signal and polls
// took ~3.5 us past the quantisation, bench/decode_trace) and reads its operand from shared
// memory. One token: 0.95 / 0.99 / 0.96 of the global copy's step (Qwen3-30B-A3B / the
// DeepSeek-V3 shard / Mixtral, fp8, 2026-12-04), and with x stored as f16 (no unpacking of x's
// codes for every weight load) 0.93 / 0.98 / 0.96-0.98 of that; at 2 .. 8 tokens a round trip
// per token and pass made it 0.98 .. 1.04, so those keep the global copy (docs/KERNELS.md,
// "Fused decode")
constexpr int XS_TOKENS = 1, XS_MAX = 96 * 1024;
template <bool F8, int NG> constexpr bool local_x()
{
    return F8 && NG == 1;
}

// sync[] layout: done counter, x quantised counter, GEMM 1 column tiles done per expert (one
// 128-byte line each: many warps poll them), GEMM 2 items done per row tile (one 32-byte sector
// each), GEMM 1 pieces done per (expert, column tile) with a k split (dense: never polled, each
// left at zero by its last piece), then |h| max per slot (f8; float bits).
// SYNC_ABORT (between them, zeroed with the rest): a wait of this launch timed out.
// SYNC_NEXT, SYNC_QNEXT (LO): the next work item, and the next row to quantise, to claim.
constexpr int SYNC_DONE = 0, SYNC_ABORT = 16, SYNC_XQ = 32, SYNC_NEXT = 48, SYNC_QNEXT = 56,
              SYNC_E1 = 64, E1_STRIDE = 32, COL_STRIDE = 8;
__host__ __device__ __forceinline__ int sync_col(int E)
{
    return SYNC_E1 + E * E1_STRIDE;
}
__host__ __device__ __forceinline__ int sync_tile(int E, int H)
{
    return sync_col(E) + (H + 15) / 16 * COL_STRIDE;
}
__host__ __device__ __forceinline__ int sync_hmax(int E, int H, int I, int split1)
{
    return sync_tile(E, H) + (split1 > 1 ? E * (I / TILE1) : 0);
}

struct smem_t {
    int cnt[MOE_DECODE_MAX_EXPERTS];
    int off[MOE_DECODE_MAX_EXPERTS];
    int uniq[MOE_DECODE_MAX_EXPERTS];
    int slots[MAX_ROWS];
    short pos[MAX_ROWS];
    float amax[WARPS];   // fp8: the x quantisation's maximum per warp
    float xs[XS_TOKENS]; // local_x: the token's scale
    int nuniq;
    int nslots; // the rows of every expert together
    int last;
};

struct params {
    const void *x;
    const int32_t *ids;
    const float *w;
    const uint8_t *w13, *w2;
    const float *w13s, *w2s;
    const __nv_bfloat16 *shared;
    const float *gate_logit;
    void *y;
    int32_t *counts;
    __nv_bfloat16 *h;
    float *o, *o1;
    uint8_t *xq;
    float *xs;
    int32_t *sync;
    int32_t *sticky;
    int64_t *trace;
    int64_t timeout_ns;
    int T, k, E, H, I, split, split1, y_f32, gelu;
    int lo_cols, rank, sticky_bits;
    const int32_t *lo_cnt, *lo_off; // LO: rows per local expert, and each one's first row
    __nv_bfloat16 *rows_out;        // LO: [rows][H]
    // SH: the shared MLP as nsh more experts of the routed experts' width I (chunk c: gate rows
    // c I .. of sw13, up rows SI + c I .., columns c I .. of sw2's rows): every token's slots
    // kr .. kr + nsh - 1, weighted by its gate. p.E = Er + nsh, p.k = kr + nsh.
    const uint8_t *sw13, *sw2;
    const float *sw13s, *sw2s;
    int Er, kr, nsh, SI;
    // ST: static activation scales per expert (W8A8 checkpoints' input_scale): x's for GEMM 1,
    // h's for GEMM 2; 0 (or NULL) for an expert that quantises dynamically
    const float *in13, *in2;
    // BS (f8 = 2): 128 x 128 weight blocks; G1, G2: the 128-wide groups of H and of I (the
    // weights' scales [row][G], x's [G1] a token, h's maxima [slot][G2]); 0 with per-row scales
    int G1, G2;
};

// this launch quantises x in every CTA's shared memory (a local_x kernel, XS_TOKENS, XS_MAX)
template <bool F8, int NG> __host__ __device__ __forceinline__ bool uses_local_x(const params &p)
{
    return local_x<F8, NG>() && p.T <= XS_TOKENS && 2 * p.T * p.H <= XS_MAX;
}

// TR (args.trace, a benchmark's timeline): lane 0 of each warp stamps the global timer into its
// record (kernels/decode.h, MOE_DECODE_TRACE_*); ev: this item's event, NULL past the last one
__device__ __forceinline__ void stamp(int64_t *at)
{
    if (at && (threadIdx.x & 31) == 0)
        *at = moe_global_ns();
}

// data written earlier in this launch by other SMs: L2, not a stale L1 line
__device__ __forceinline__ uint4 ld_cg(const void *p)
{
    uint4 v;
    asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ float ld_cg_f32(const float *p)
{
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ int ld_relaxed(const int32_t *p)
{
    int v;
    asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// lane 0 spins until *c >= target; the warp's later loads see what the signalling warps wrote.
// The polls are relaxed and one fence makes the last of them an acquire: ld.acquire compiles to
// a strong load and an L1 invalidation (CCTL.IVALL) per poll, and a one-token step polled about
// a million times (Nsight Compute, 2026-12-04: 17 % of the warps' stall samples there).
// Bounded (kernels/decode.h, MOE_DECODE_STICKY_STALL): past p.timeout_ns the wait marks the
// launch aborted and the step's sticky word (naming this rank: LO, an EP step), and returns; so
// does every wait after it.
template <bool LO = false>
__device__ __forceinline__ void warp_wait(const params &p, const int32_t *c, int target)
{
    if ((threadIdx.x & 31) == 0) {
        if (ld_relaxed(c) < target) {
            const int64_t t0 = moe_global_ns();
            while (ld_relaxed(c) < target) {
                const int64_t waited = moe_global_ns() - t0;
                // another wait gave up (read only in long waits: it is one more hot line)
                if (waited > 100000 && ld_relaxed(p.sync + SYNC_ABORT) > 0)
                    break;
                if (p.timeout_ns > 0 && waited > p.timeout_ns) {
                    atomicExch(p.sync + SYNC_ABORT, 1);
                    moe_sticky_mark(p.sticky, LO ? p.rank : 0, MOE_STATUS_TIMEOUT,
                                    MOE_DECODE_STICKY_STALL | (LO ? p.sticky_bits : 0));
                    break;
                }
                __nanosleep(256); // hundreds of warps may poll one line: leave the L2 slice room
            }
        }
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
    __syncwarp();
}

// every lane's stores of this item, then one release of the count
__device__ __forceinline__ int warp_signal(int32_t *p)
{
    int old = 0;
    __syncwarp(); // orders the lanes' stores before lane 0's fence (cumulative) and count
    if ((threadIdx.x & 31) == 0) {
        __threadfence();
        old = atomicAdd(p, 1);
    }
    return __shfl_sync(0xffffffffu, old, 0);
}

template <bool F8>
__device__ __forceinline__ void mma(float *c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1)
{
    if (F8)
        asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                     "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                     : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// rows g and g + 8 (ra, rb) times the token column's 16 bytes (b): both mmas of one load
template <bool F8> __device__ __forceinline__ void mma2(float *c, uint4 ra, uint4 rb, uint4 b)
{
    mma<F8>(c, ra.x, rb.x, ra.y, rb.y, b.x, b.y);
    mma<F8>(c, ra.z, rb.z, ra.w, rb.w, b.z, b.w);
}

// two e4m3 codes (the low 16 bits of v) as an f16 pair: exact
__device__ __forceinline__ uint32_t f16x2_of_e4m3x2(uint32_t v)
{
    uint32_t r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((unsigned short)(v & 0xffffu)));
    return r;
}

__device__ __forceinline__ void mma_f16(float *c, uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// A token operand as loaded, before its conversion: 16 bytes, or 32 (TWO) where fp8 GEMM 2
// quantises 16 values of h after the load, or fp8 GEMM 1 holds 16 codes of x as f16
struct raw_t {
    uint4 a, b;
};

// fp8 GEMM 1 at one token: rows g and g + 8 (16 e4m3 weights each, ra / rb) times 16 values of x
// already f16 (b): four f16 m16n8k16 mmas with the weights unpacked here. The same instructions
// on the same registers in the same order as ptxas's two for each e4m3 m16n8k32 (cuobjdump, CUDA
// 13.0: the low code pair of each fragment register, then the high one), so the sums are bitwise
// those of mma2<true> (test_gpu_decode's batch invariance: one token against 7 and 64), without
// unpacking x's codes for every weight load
__device__ __forceinline__ void mma2(float *c, uint4 ra, uint4 rb, const raw_t &b)
{
    const uint32_t x[8] = {b.a.x, b.a.y, b.a.z, b.a.w, b.b.x, b.b.y, b.b.z, b.b.w};
    auto two = [&](uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, int o) {
        mma_f16(c, f16x2_of_e4m3x2(a0), f16x2_of_e4m3x2(a1), f16x2_of_e4m3x2(a2),
                f16x2_of_e4m3x2(a3), x[o], x[o + 2]);
        mma_f16(c, f16x2_of_e4m3x2(a0 >> 16), f16x2_of_e4m3x2(a1 >> 16), f16x2_of_e4m3x2(a2 >> 16),
                f16x2_of_e4m3x2(a3 >> 16), x[o + 1], x[o + 3]);
    };
    two(ra.x, rb.x, ra.y, rb.y, 0);
    two(ra.z, rb.z, ra.w, rb.w, 4);
}

// one weight load pair's mmas with its token operand: 16 bytes of codes (bf16, or e4m3 for
// GEMM 2), or 16 values of x as f16 (fp8 GEMM 1)
template <bool F8> __device__ __forceinline__ void mma_op(float *c, uint4 ra, uint4 rb, uint4 b)
{
    mma2<F8>(c, ra, rb, b);
}
template <bool F8>
__device__ __forceinline__ void mma_op(float *c, uint4 ra, uint4 rb, const raw_t &b)
{
    mma2(c, ra, rb, b);
}

// 1 / x rounded to nearest for a normal x with a normal reciprocal (every dynamic scale: 1e-10 /
// 448 .. bf16's largest / 448): __frcp_rn's result without its slow-path call for subnormals
__device__ __forceinline__ float rcp_rn_normal(float x)
{
    float r;
    asm("rcp.rn.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

__device__ __forceinline__ float dynamic_scale(float amax)
{
    return __fdiv_rn(amax > MOE_FP8_ACT_AMAX_MIN ? amax : MOE_FP8_ACT_AMAX_MIN, MOE_FP8_E4M3_MAX);
}

// four values over scale s (r = 1 / s rounded) as e4m3: the code of the correctly rounded
// quotient (moe_fp8_quotient), as the quantisation kernels' division gives it
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d, float s, float r)
{
    return (uint32_t)__nv_cvt_float_to_fp8(moe_fp8_quotient(a, s, r), __NV_SATFINITE, __NV_E4M3) |
           (uint32_t)__nv_cvt_float_to_fp8(moe_fp8_quotient(b, s, r), __NV_SATFINITE, __NV_E4M3)
               << 8 |
           (uint32_t)__nv_cvt_float_to_fp8(moe_fp8_quotient(c, s, r), __NV_SATFINITE, __NV_E4M3)
               << 16 |
           (uint32_t)__nv_cvt_float_to_fp8(moe_fp8_quotient(d, s, r), __NV_SATFINITE, __NV_E4M3)
               << 24;
}

__device__ __forceinline__ float bf(uint32_t w, int hi)
{
    return __uint_as_float(hi ? w & 0xffff0000u : w << 16);
}

__device__ __forceinline__ uint32_t pack_bf16(float a, float b)
{
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t *>(&v);
}

// 8 values of token row x at column c as bf16 (f32 x rounded, as the gather copies it)
template <typename XT> __device__ __forceinline__ uint4 load_x8(const XT *x, int64_t i)
{
    if (sizeof(XT) == 2)
        return *reinterpret_cast<const uint4 *>(x + i);
    const float4 a = *reinterpret_cast<const float4 *>(x + i);
    const float4 b = *reinterpret_cast<const float4 *>(x + i + 4);
    return make_uint4(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w), pack_bf16(b.x, b.y),
                      pack_bf16(b.z, b.w));
}

__device__ __forceinline__ float act_mul(bool gelu, float g, float u)
{
    if (gelu)
        return moe_act_gelu_tanh(g) * u;
    return moe_act_silu(g) * u;
}

// The expert table of this launch, built by every CTA alike: tokens per expert, the experts
// in id order, each expert's slots (their order inside an expert differs between CTAs; only
// the mma column of a slot depends on it, never a value).
// LO (laid-out rows, kernels/decode.h): the counts are given; expert e's m-th row is row
// p.lo_off[e] + m of x and rows_out, and its slot (h, o, xq, the maxima) s.off[e] + m, so
// s.slots[slot] is the slot's row. A negative count or rows past p.T: an empty table, the
// step's sticky word marked (every CTA reads the same counts, so every CTA agrees).
// SH: slot i = t k + j of token t is routed slot j of ids (j < kr) or shared chunk j - kr, the
// table's expert Er + j - kr; counts (profiling) for the routed experts alone.
template <bool SH> __device__ __forceinline__ int expert_of_slot(const params &p, int i)
{
    if (!SH)
        return p.ids[i];
    const int t = i / p.k, j = i - t * p.k;
    if (j >= p.kr)
        return p.Er + j - p.kr;
    const int e = p.ids[t * p.kr + j];
    return e < p.Er ? e : -1;
}

template <bool LO, bool SH = false> __device__ void build_table(const params &p, smem_t &s)
{
    const int rows = p.T * p.k;
    int bad = 0; // LO: a count out of bounds
    for (int e = threadIdx.x; e < p.E; e += THREADS) {
        s.cnt[e] = LO ? p.lo_cnt[e] : 0;
        bad |= LO && s.cnt[e] < 0;
    }
    if (LO)
        bad = __syncthreads_or(bad);
    else
        __syncthreads();
    if (!LO)
        for (int i = threadIdx.x; i < rows; i += THREADS) {
            const int e = expert_of_slot<SH>(p, i);
            s.pos[i] = e >= 0 && e < p.E ? (short)atomicAdd(&s.cnt[e], 1) : (short)-1;
        }
    __syncthreads();
    if (threadIdx.x < 32) { // one warp scans the counts: 16 experts a lane
        const int lane = threadIdx.x, per = (p.E + 31) / 32, e0 = lane * per;
        int sum = 0, nz = 0;
        for (int e = e0; e < e0 + per && e < p.E; e++)
            sum += s.cnt[e], nz += s.cnt[e] > 0;
        int isum = sum, inz = nz;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, isum, o),
                      b = __shfl_up_sync(0xffffffffu, inz, o);
            if (lane >= o)
                isum += a, inz += b;
        }
        int run = isum - sum, u = inz - nz;
        for (int e = e0; e < e0 + per && e < p.E; e++) {
            s.off[e] = run;
            run += s.cnt[e];
            if (s.cnt[e] > 0)
                s.uniq[u++] = e;
        }
        if (lane == 31)
            s.nuniq = inz;
        if (LO && lane == 31)
            s.nslots = isum;
    }
    __syncthreads();
    if (LO) {
        if (bad || s.nslots > rows) { // every CTA alike: no items, nothing written
            if (threadIdx.x == 0) {
                if (blockIdx.x == 0)
                    moe_sticky_mark(p.sticky, p.rank, MOE_STATUS_INTERNAL_ERROR, p.sticky_bits);
                s.nuniq = s.nslots = 0;
            }
        } else {
            const int lane = threadIdx.x & 31;
            for (int e = threadIdx.x / 32; e < p.E; e += WARPS)
                for (int m = lane; m < s.cnt[e]; m += 32)
                    s.slots[s.off[e] + m] = p.lo_off[e] + m;
        }
    } else {
        for (int i = threadIdx.x; i < rows; i += THREADS) {
            const int e = expert_of_slot<SH>(p, i);
            if (s.pos[i] >= 0)
                s.slots[s.off[e] + s.pos[i]] = i;
        }
        if (p.counts && blockIdx.x == 0)
            for (int e = threadIdx.x; e < (SH ? p.Er : p.E); e += THREADS)
                p.counts[e] = s.cnt[e];
    }
    __syncthreads();
}

// the largest |value| of 8 bf16 values
__device__ __forceinline__ float amax8(float m, uint4 v)
{
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++)
        m = fmaxf(m, fmaxf(fabsf(bf(w[i], 0)), fabsf(bf(w[i], 1))));
    return m;
}

// 8 bf16 values over scale sc (rs = 1 / sc rounded) as e4m3 codes: lo, hi
__device__ __forceinline__ uint2 e4m3x8(uint4 v, float sc, float rs)
{
    return make_uint2(e4m3x4(bf(v.x, 0), bf(v.x, 1), bf(v.y, 0), bf(v.y, 1), sc, rs),
                      e4m3x4(bf(v.z, 0), bf(v.z, 1), bf(v.w, 0), bf(v.w, 1), sc, rs));
}

// 16 bf16 values (a token operand as loaded) over scale sc as e4m3 codes
__device__ __forceinline__ uint4 e4m3x16(const raw_t &r, float sc, float rs)
{
    const uint2 lo = e4m3x8(r.a, sc, rs), hi = e4m3x8(r.b, sc, rs);
    return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

// 8 e4m3 codes (lo, hi) as their values in f16
__device__ __forceinline__ uint4 f16x8_of_e4m3x8(uint2 q)
{
    return make_uint4(f16x2_of_e4m3x2(q.x), f16x2_of_e4m3x2(q.x >> 16), f16x2_of_e4m3x2(q.y),
                      f16x2_of_e4m3x2(q.y >> 16));
}

// fp8: token t's row of x (as bf16) quantised with its dynamic scale by a whole CTA into dst (a
// row of hidden bytes: global or shared memory), before the CTA's items (GEMM 1 waits on it: one
// warp a row took 4.4 us at hidden 2048 and 9.6 at 7168, bench/decode_trace, 2026-12-04): each
// thread 8 values of every 2048 of the row, the maximum through shared memory, then the
// conversion from the same (L1) lines. Returns the scale; every thread's stores are done.
template <typename XT, bool HALF = false>
__device__ float quantise_row(const params &p, smem_t &s, int t, uint8_t *dst)
{
    const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
    const XT *x = static_cast<const XT *>(p.x) + (int64_t)t * p.H;
    float m = 0.0f;
#pragma unroll 4
    for (int c = threadIdx.x * 8; c < p.H; c += THREADS * 8) {
        const uint4 v = load_x8(x, c);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; i++)
            m = fmaxf(m, fmaxf(fabsf(bf(w[i], 0)), fabsf(bf(w[i], 1))));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0)
        s.amax[warp] = m;
    __syncthreads();
#pragma unroll
    for (int i = 0; i < WARPS; i++)
        m = fmaxf(m, s.amax[i]);
    const float sc = dynamic_scale(m), rs = __frcp_rn(sc);
#pragma unroll 4
    for (int c = threadIdx.x * 8; c < p.H; c += THREADS * 8) {
        const uint2 q = e4m3x8(load_x8(x, c), sc, rs);
        if (HALF) // the codes' values as f16, 2 bytes each
            *reinterpret_cast<uint4 *>(dst + 2 * c) = f16x8_of_e4m3x8(q);
        else
            *reinterpret_cast<uint2 *>(dst + c) = q;
    }
    __syncthreads(); // every thread's stores (and reads of s.amax) before the caller's release
    return sc;
}

// into global memory for every CTA: row t of x as row i of the codes, the scale, then one
// release of the count
template <typename XT> __device__ void quantise_x(const params &p, smem_t &s, int t, int i)
{
    const float sc = quantise_row<XT>(p, s, t, p.xq + (int64_t)i * p.H);
    if (threadIdx.x == 0) {
        p.xs[i] = sc;
        __threadfence();
        atomicAdd(p.sync + SYNC_XQ, 1);
    }
}

// BS: token t's row quantised per 128-wide group (the grouped path's 1 x 128 activation groups)
// into dst as the codes' values in f16, each group's scale into gs[group]: a pass of the CTA
// covers 2048 values, 16 threads' 8 a group, so a group's maximum is four shuffles within the
// half-warp and each thread converts its 8 values in the same pass.
template <typename XT>
__device__ void quantise_row_groups(const params &p, int t, uint8_t *dst, float *gs)
{
    const XT *x = static_cast<const XT *>(p.x) + (int64_t)t * p.H;
    for (int base = 0; base < p.H; base += THREADS * 8) { // every lane of a warp goes round
        const int c = base + threadIdx.x * 8;
        const bool in = c < p.H; // H is a multiple of 16: 8 values in or out
        const uint4 v = in ? load_x8(x, c) : make_uint4(0, 0, 0, 0);
        float m = amax8(0.0f, v);
#pragma unroll
        for (int o = 8; o > 0; o >>= 1)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        const float sc = dynamic_scale(m), rs = __frcp_rn(sc);
        if (in) {
            *reinterpret_cast<uint4 *>(dst + 2 * c) = f16x8_of_e4m3x8(e4m3x8(v, sc, rs));
            if ((threadIdx.x & 15) == 0)
                gs[c / 128] = sc;
        }
    }
}

// BS, local_x: x's group scales in the dynamic shared memory after the one token's codes
__device__ __forceinline__ float *x_group_scales(const params &p, uint8_t *xql)
{
    return reinterpret_cast<float *>(xql + (2 * p.H + 15) / 16 * 16);
}

// local_x: the one token's row into this CTA's shared memory xq (the codes' values as f16, as
// GEMM 1's mmas take them), its scale in s.xs (BS: its groups' scales after the codes)
template <typename XT, bool BS = false>
__device__ void quantise_x_local(const params &p, smem_t &s, uint8_t *xq)
{
    if constexpr (BS) {
        quantise_row_groups<XT>(p, 0, xq, x_group_scales(p, xq));
    } else {
        const float sc = quantise_row<XT, true>(p, s, 0, xq);
        if (threadIdx.x == 0)
            s.xs[0] = sc;
    }
    __syncthreads();
}

// Token operands (k step, column group) of a batch loaded before any of their mmas: with one
// column group, 4 16-byte registers a lane (TWO: 32 bytes an operand, 2 of them); with more, one
// (the registers of more spilled in the loops of 2 groups and up, at 128 a thread). The loads are
// volatile asm and so are the mmas: loaded one at a time, each load waits for its own L2 round
// trip after the previous mma (docs/KERNELS.md, "Fused decode")
template <int NG, bool TWO> constexpr int fetch_pairs()
{
    return NG > 1 ? 1 : TWO ? 2 : 4;
}

// no block scales (dot_rows without PB)
struct no_scales {
    template <typename... A> __device__ void operator()(A &&...) const
    {
    }
};

// One weight-row pair's dot products with up to NG x 8 token columns over k in [k0, k1):
// rows ra / rb (byte pointers at k = 0), B columns from make(ng, fetch(ng, k)) (16 bytes for this
// lane's column, zero where the column or k is past its end: fetch loads, make converts).
// wait() runs after the first loads.
// PB (fp8, 128 x 128 weight blocks; k0 a multiple of 128): the mmas of each 128 of k go into a
// partial, then acc += part * (weight row's scale * column's scale) for that group, in k order
// (the CPU's W8A8 and DeepGEMM's promotion). For the two groups of the batch from kb on (zero past
// k1): wscales(kb, ws) gives ws[q][0 / 1], rows ra / rb's (L1 lines: asked as the batch starts);
// cscales(kb, cs) gives cs[q][g], this lane's B column's of group g (the C columns take theirs
// from the lanes that hold those B columns), asked one batch ahead with the weights (the first
// batch's after wait()); make(g, raw, cs) converts with it.
template <bool F8, int NG, int U, bool TWO, bool PB = false, typename Fetch, typename Make,
          typename W, typename WS = no_scales, typename CS = no_scales>
__device__ __forceinline__ void dot_rows(float (&acc)[NG][4], const uint8_t *ra, const uint8_t *rb,
                                         int k0, int k1, int ncols, Fetch fetch, Make make, W wait,
                                         WS wscales = WS(), CS cscales = CS())
{
    static_assert(!PB || (F8 && U == 4), "block scales: fp8, two 128-wide groups a batch");
    constexpr int EPT = F8 ? 16 : 8; // k per 16-byte load
    constexpr int CK = 4 * EPT;      // k per load of the 4 lanes of a row
    constexpr int ES = F8 ? 1 : 2;   // bytes per weight
    // token operands: NP pairs (k step i, column group g) = i * NG + g, FP of them a batch
    constexpr int FP = fetch_pairs<NG, TWO>(), NP = U * NG;
    const int t = threadIdx.x & 3;
    uint4 ca[U], cb[U];
#pragma unroll
    for (int g = 0; g < NG; g++)
#pragma unroll
        for (int i = 0; i < 4; i++)
            acc[g][i] = 0.0f;
    auto load = [&](int kb, uint4 *a, uint4 *b) {
#pragma unroll
        for (int i = 0; i < U; i++) {
            const int k = kb + i * CK + t * EPT;
            if (k < k1) {
                a[i] = moe_ld_stream(ra + (int64_t)k * ES);
                b[i] = moe_ld_stream(rb + (int64_t)k * ES);
            } else {
                a[i] = b[i] = make_uint4(0, 0, 0, 0);
            }
        }
    };
    // PB: the partial sums of the group, and the scales of this batch's two groups (ws, cs) and
    // the next batch's column scales (ncs)
    float part[PB ? NG : 1][4] = {}, ws[2][2] = {}, cs[2][PB ? NG : 1] = {};
    auto promote = [&](int q) {
#pragma unroll
        for (int g = 0; g < NG; g++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                // C column 2t + c % 2 is the B column of lanes 4 (2t + c % 2) ..
                const float sc = __shfl_sync(0xffffffffu, cs[q][g], (2 * t + (c & 1)) * 4);
                acc[g][c] += part[g][c] * (ws[q][c >> 1] * sc);
                part[g][c] = 0.0f;
            }
    };
    load(k0, ca, cb);
    wait();
    if constexpr (PB)
        cscales(k0, cs);
    for (int kb = k0; kb < k1; kb += U * CK) {
        uint4 na[U], nb[U];
        float ncs[2][PB ? NG : 1];
        load(kb + U * CK, na, nb);
        if constexpr (PB) {
            cscales(kb + U * CK, ncs);
            wscales(kb, ws);
        }
#pragma unroll
        for (int p0 = 0; p0 < NP; p0 += FP) {
            raw_t r[FP];
#pragma unroll
            for (int j = 0; j < FP; j++) {
                const int i = (p0 + j) / NG, g = (p0 + j) % NG;
                if (p0 + j < NP && g * 8 < ncols)
                    r[j] = fetch(g, kb + i * CK + t * EPT);
            }
#pragma unroll
            for (int j = 0; j < FP; j++) {
                const int i = (p0 + j) / NG, g = (p0 + j) % NG;
                if constexpr (PB) {
                    if (p0 + j < NP && g * 8 < ncols)
                        mma_op<F8>(part[g], ca[i], cb[i], make(g, r[j], cs[i / 2][g]));
                    // a 128-wide group is two loads of the row's four lanes (CK = 64)
                    if (p0 + j < NP && g == NG - 1 && (i & 1))
                        promote(i / 2);
                } else {
                    if (p0 + j < NP && g * 8 < ncols)
                        mma_op<F8>(acc[g], ca[i], cb[i], make(g, r[j]));
                }
            }
        }
#pragma unroll
        for (int i = 0; i < U; i++)
            ca[i] = na[i], cb[i] = nb[i];
        if constexpr (PB)
#pragma unroll
            for (int q = 0; q < 2; q++)
#pragma unroll
                for (int g = 0; g < NG; g++)
                    cs[q][g] = ncs[q][g];
    }
}

// The slot (h, o, the maxima and, LO, xq) of the m-th token of an item's list: list[m], or LO
// (laid-out rows: list[m] is the row, and s.slots is indexed by slot) its index in s.slots
template <bool LO>
__device__ __forceinline__ int slot_of(const smem_t &s, const int *list, int e, int m)
{
    return LO ? (int)(list - s.slots) + m : list[m];
}

// LO: an expert's rows in passes of 8 NG columns (the launch's NG follows the expected rows an
// expert, lo_cols; an expert with more runs more passes, each streaming its weights again): the
// item's tokens from `base` on
template <bool LO, int NG>
__device__ __forceinline__ int pass_tokens(const smem_t &s, int e, int base)
{
    if (!LO)
        return s.cnt[e];
    const int left = s.cnt[e] - base;
    return left < 8 * NG ? left : 8 * NG;
}

// SH: the |h| maximum of a shared chunk's slot is its token's over the whole shared MLP (one
// dynamic scale a row of its h, as the grouped path and the CPU's W8A8 take it), at rows + t
template <bool SH>
__device__ __forceinline__ int hmax_index(const params &p, int e, int slot, int rows)
{
    return SH && e >= p.Er ? rows + slot / p.k : slot;
}

// GEMM 1 item: expert e, h columns c0 .. c0 + 7 for the expert's n tokens, k piece q of
// p.split1 (K1: split1 > 1; pieces of a multiple of 4 x 16 bytes of k)
// (LO: the pass of the expert's tokens from `base` on; `last`: its last pass, which signals)
// BS (one token, x in shared memory): each 128 of k promoted with the rows' block scales and x's
// group scale; |h| max per slot and 128-wide group of columns
template <bool F8, int NG, int U, typename XT, bool K1, bool TR, bool XLT, bool LO, bool SH,
          bool ST, bool BS = false>
__device__ void gemm1(const params &p, const smem_t &s, int e, int c0, int q, int64_t *tw,
                      const uint8_t *xql, int base, bool last)
{
    constexpr bool XL = local_x<F8, NG>() && XLT; // the quantised x in this CTA's xql
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n = pass_tokens<LO, NG>(s, e, base), *list = s.slots + s.off[e] + (LO ? base : 0);
    constexpr int ES = F8 ? 1 : 2;
    int64_t rg = (int64_t)e * 2 * p.I + c0 + g; // gate row; up row rg + I
    const uint8_t *ra = p.w13 + rg * p.H * ES, *rb = p.w13 + (rg + p.I) * p.H * ES;
    int64_t up = p.I;
    const float *ws = p.w13s;
    if constexpr (SH)
        if (e >= p.Er) { // a chunk of the shared MLP: up row rg + SI
            rg = (int64_t)(e - p.Er) * p.I + c0 + g;
            up = p.SI;
            ra = p.sw13 + rg * p.H * ES;
            rb = ra + up * p.H * ES;
            ws = p.sw13s;
        }
    // ST: this expert's static scale of x (0: dynamic), x quantised with it as it is loaded
    float sx = 0.0f, rx = 0.0f;
    if constexpr (ST) {
        sx = p.in13 ? __ldg(p.in13 + e) : 0.0f;
        rx = sx > 0.0f ? __frcp_rn(sx) : 0.0f;
    }
    // this lane's B column's row of x (bf16, or ST's static fp8) or xq (fp8) per group (-1:
    // none): the token (LO: the row, or for xq the slot)
    int tok[NG];
#pragma unroll
    for (int i = 0; i < NG; i++)
        if constexpr (LO)
            tok[i] = i * 8 + g < n
                         ? F8 && !(sx > 0.0f) ? slot_of<LO>(s, list, e, i * 8 + g) : list[i * 8 + g]
                         : -1;
        else
            tok[i] = i * 8 + g < n ? list[i * 8 + g] / p.k : -1;
    const XT *x = static_cast<const XT *>(p.x);
    // x is the layer's input (plain loads: packed to bf16 as they arrive); xq was written in this
    // launch (L2)
    // XL: 16 codes' values as f16 from this CTA's copy; else 16 bytes of codes or bf16 x
    auto fetch = [&](int i, int k) -> raw_t {
        raw_t r = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
        if (tok[i] >= 0 && k < p.H) {
            if (XL) {
                const uint4 *v = reinterpret_cast<const uint4 *>(xql + 2 * (tok[i] * p.H + k));
                r.a = v[0], r.b = v[1];
            } else if (ST && sx > 0.0f) { // 16 values of x, quantised in make
                r.a = load_x8(x + (int64_t)tok[i] * p.H, k);
                r.b = load_x8(x + (int64_t)tok[i] * p.H, k + 8);
            } else {
                r.a = F8 ? ld_cg(p.xq + (int64_t)tok[i] * p.H + k)
                         : load_x8(x + (int64_t)tok[i] * p.H, k);
            }
        }
        return r;
    };
    auto make = [&](int, const raw_t &r) {
        if constexpr (XL) {
            return r;
        } else if constexpr (ST) {
            if (!(sx > 0.0f))
                return r.a;
            return e4m3x16(r, sx, rx);
        } else {
            return r.a;
        }
    };
    auto wait = [&]() {
        if (F8 && !XL && !(ST && sx > 0.0f))
            warp_wait<LO>(p, p.sync + SYNC_XQ, LO ? s.nslots : p.T);
        if (TR)
            stamp(tw);
    };
    constexpr int CK = F8 ? 64 : 32; // k per 16-byte load of the 4 lanes of a row
    const int s1 = K1 ? p.split1 : 1;
    const int per = K1 ? ((p.H + s1 - 1) / s1 + CK - 1) / CK * CK : p.H;
    const int k0 = !K1 ? 0 : q * per < p.H ? q * per : p.H;
    const int k1 = !K1 ? p.H : k0 + per < p.H ? k0 + per : p.H;
    float acc[NG][4];
    // XL: 32 bytes of f16 x an operand, two a batch (as GEMM 2's fp8 h); ST: 32 bytes of bf16
    // x, alike; else four of 16 bytes
    if constexpr (BS) {
        static_assert(XL && !K1 && !LO && !SH && !ST, "block scales: one token, GEMM 1 whole");
        const float *xg = x_group_scales(p, const_cast<uint8_t *>(xql));
        auto make_bs = [&](int, const raw_t &r, float) { return r; };
        // the gate and up rows' block scales, and x's group scale (every column: one token)
        auto wscales = [&](int kb, float(&w)[2][2]) {
#pragma unroll
            for (int q = 0; q < 2; q++) {
                const int kk = kb + 128 * q, gi = kk / 128;
                const bool in = kk < k1;
                w[q][0] = in ? __ldg(ws + rg * p.G1 + gi) : 0.0f;
                w[q][1] = in ? __ldg(ws + (rg + up) * p.G1 + gi) : 0.0f;
            }
        };
        auto cscales = [&](int kb, float(&c)[2][NG]) {
#pragma unroll
            for (int q = 0; q < 2; q++)
#pragma unroll
                for (int i = 0; i < NG; i++)
                    c[q][i] = kb + 128 * q < k1 ? xg[(kb + 128 * q) / 128] : 0.0f;
        };
        dot_rows<F8, NG, U, true, true>(acc, ra, rb, k0, k1, n, fetch, make_bs, wait, wscales,
                                        cscales);
    } else {
        dot_rows<F8, NG, U, XL || ST>(acc, ra, rb, k0, k1, n, fetch, make, wait);
    }
    // c0, c1: gate of column c0 + g for tokens 2t, 2t + 1 of the group; c2, c3: up
    const int col = c0 + g;
    if (K1) {
        // this piece's sums by slot; the tile's last piece adds every piece in split order
        // (the same order whichever piece ends last) and goes on with the whole sums
        const int64_t rows = (int64_t)p.T * p.k, I2 = 2 * (int64_t)p.I;
        int32_t *done = p.sync + sync_tile(p.E, p.H) + e * (p.I / TILE1) + c0 / TILE1;
#pragma unroll
        for (int i = 0; i < NG; i++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int m = i * 8 + 2 * t + j;
                if (i * 8 < n && m < n) {
                    float *o = p.o1 + (q * rows + slot_of<LO>(s, list, e, m)) * I2 + col;
                    o[0] = acc[i][j];
                    o[p.I] = acc[i][2 + j];
                }
            }
        if (warp_signal(done) != p.split1 - 1)
            return;
        __threadfence();
#pragma unroll
        for (int i = 0; i < NG; i++)
#pragma unroll
            for (int j = 0; j < 2; j++) {
                const int m = i * 8 + 2 * t + j;
                float gv = 0.0f, uv = 0.0f;
                if (i * 8 < n && m < n)
                    for (int r = 0; r < p.split1; r++) {
                        const float *o = p.o1 + (r * rows + slot_of<LO>(s, list, e, m)) * I2 + col;
                        gv += ld_cg_f32(o);
                        uv += ld_cg_f32(o + p.I);
                    }
                acc[i][j] = gv;
                acc[i][2 + j] = uv;
            }
        if (lane == 0)
            *done = 0; // every piece of this launch has counted: ready for the next launch
    }
    float sg = 1.0f, su = 1.0f;
    if (F8 && SH)
        sg = __ldg(ws + rg), su = __ldg(ws + rg + up);
    else if (F8 && !BS) // BS: every group's scales applied in the sums
        sg = __ldg(p.w13s + rg), su = __ldg(p.w13s + rg + p.I);
#pragma unroll
    for (int i = 0; i < NG; i++) {
        if (i * 8 >= n)
            break;
        float hm[2] = {0.0f, 0.0f};
        int slot[2];
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int m = i * 8 + 2 * t + j;
            slot[j] = m < n ? slot_of<LO>(s, list, e, m) : -1;
            if (slot[j] < 0)
                continue;
            float gv = acc[i][j], uv = acc[i][2 + j];
            if (F8 && !BS) {
                const float xs = XL                ? s.xs[slot[j] / p.k]
                                 : ST && sx > 0.0f ? sx
                                                   : p.xs[slot[j] / p.k];
                gv = gv * xs * sg;
                uv = uv * xs * su;
            }
            const __nv_bfloat16 hv = __float2bfloat16_rn(act_mul(p.gelu, gv, uv));
            p.h[(int64_t)slot[j] * p.I + col] = hv;
            hm[j] = fabsf(__bfloat162float(hv));
        }
        if (F8) { // the row's |h| max, over the 8 columns of this item (lanes of one t)
#pragma unroll
            for (int j = 0; j < 2; j++) {
#pragma unroll
                for (int o = 4; o < 32; o <<= 1)
                    hm[j] = fmaxf(hm[j], __shfl_xor_sync(0xffffffffu, hm[j], o));
                if (g == 0 && slot[j] >= 0)
                    atomicMax(p.sync + sync_hmax(p.E, p.H, p.I, s1) +
                                  (BS ? slot[j] * p.G2 + c0 / 128
                                      : hmax_index<SH>(p, e, slot[j], p.T * p.k)),
                              __float_as_int(hm[j]));
            }
        }
    }
    if (!LO || last)
        warp_signal(p.sync + SYNC_E1 + e * E1_STRIDE);
}

__device__ __forceinline__ float4 ld_cg_f4(const float *p)
{
    float4 v;
    asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "l"(p));
    return v;
}

// The last GEMM 2 item of row tile r: y[t][r * 16 .. + 16) for every token, 4 columns a lane;
// slot order, as moe_combine_launch. The rows of CB slots are loaded before any is added (the
// loads are volatile asm: one at a time, each would wait for its own L2 round trip), split
// piece by piece; each slot's pieces are added in split order, then weighted in slot order
constexpr int CB = 8;
template <typename YT, bool SH = false> __device__ void combine_tile(const params &p, int r)
{
    const int lane = threadIdx.x & 31;
    const int64_t rows = (int64_t)p.T * p.k;
    for (int i = lane; i < p.T * (TILE2 / 4); i += 32) {
        const int t = i / (TILE2 / 4), c = r * TILE2 + i % (TILE2 / 4) * 4;
        if (c >= p.H) /* hidden % 8 == 0: a group of 4 is whole or out */
            continue;
        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int j0 = 0; j0 < p.k; j0 += CB) {
            const int64_t slot0 = (int64_t)t * p.k + j0;
            float4 v[CB];
#pragma unroll
            for (int j = 0; j < CB; j++)
                v[j] = j0 + j < p.k ? ld_cg_f4(p.o + (slot0 + j) * p.H + c)
                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            for (int q = 1; q < p.split; q++) {
                float4 b[CB];
#pragma unroll
                for (int j = 0; j < CB; j++)
                    b[j] = j0 + j < p.k ? ld_cg_f4(p.o + (q * rows + slot0 + j) * p.H + c)
                                        : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
                for (int j = 0; j < CB; j++)
                    v[j].x += b[j].x, v[j].y += b[j].y, v[j].z += b[j].z, v[j].w += b[j].w;
            }
            if constexpr (SH) {
                // the shared chunks' slots (kr ..) weighted by the token's gate
                const float gt = p.gate_logit ? 1.0f / (1.0f + expf(-p.gate_logit[t])) : 1.0f;
#pragma unroll
                for (int j = 0; j < CB; j++) {
                    const int jj = j0 + j;
                    const int64_t ri = (int64_t)t * p.kr + jj;
                    if (jj < p.k && (jj >= p.kr || p.ids[ri] >= 0)) {
                        const float w = jj >= p.kr ? gt : p.w[ri];
                        acc[0] += w * v[j].x, acc[1] += w * v[j].y;
                        acc[2] += w * v[j].z, acc[3] += w * v[j].w;
                    }
                }
            } else {
#pragma unroll
                for (int j = 0; j < CB; j++)
                    if (j0 + j < p.k && p.ids[slot0 + j] >= 0) {
                        const float w = p.w[slot0 + j];
                        acc[0] += w * v[j].x, acc[1] += w * v[j].y;
                        acc[2] += w * v[j].z, acc[3] += w * v[j].w;
                    }
            }
        }
        if (p.shared) {
            const float gt = p.gate_logit ? 1.0f / (1.0f + expf(-p.gate_logit[t])) : 1.0f;
            const uint2 sv = *reinterpret_cast<const uint2 *>(p.shared + (int64_t)t * p.H + c);
            acc[0] += gt * bf(sv.x, 0), acc[1] += gt * bf(sv.x, 1);
            acc[2] += gt * bf(sv.y, 0), acc[3] += gt * bf(sv.y, 1);
        }
#pragma unroll
        for (int m = 0; m < 4; m++)
            if (sizeof(YT) == 4)
                reinterpret_cast<float *>(p.y)[(int64_t)t * p.H + c + m] = acc[m];
            else
                reinterpret_cast<__nv_bfloat16 *>(p.y)[(int64_t)t * p.H + c + m] =
                    __float2bfloat16_rn(acc[m]);
    }
}

// LO: the last GEMM 2 item of row tile r writes that tile of every slot's row of rows_out: its
// k split's pieces added in split order (as combine_tile does), rounded to bf16 as the grouped
// GEMM 2 writes its rows. Each lane 4 columns of a slot, the pieces' loads issued before any add
__device__ inline void rows_tile(const params &p, const smem_t &s, int r)
{
    const int lane = threadIdx.x & 31;
    const int64_t rows = (int64_t)p.T * p.k;
    for (int i = lane; i < s.nslots * (TILE2 / 4); i += 32) {
        const int sl = i / (TILE2 / 4), c = r * TILE2 + i % (TILE2 / 4) * 4;
        if (c >= p.H) /* hidden % 8 == 0: a group of 4 is whole or out */
            continue;
        float4 a = ld_cg_f4(p.o + sl * p.H + c);
        for (int q = 1; q < p.split; q++) {
            const float4 v = ld_cg_f4(p.o + (q * rows + sl) * p.H + c);
            a.x += v.x, a.y += v.y, a.z += v.z, a.w += v.w;
        }
        *reinterpret_cast<uint2 *>(p.rows_out + (int64_t)s.slots[sl] * p.H + c) =
            make_uint2(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w));
    }
}

// GEMM 2 item: expert e, rows r * 16 .. + 16 of hidden, k split q (K1: GEMM 1 split too)
// BS: h quantised per slot and 128-wide group (its maxima from GEMM 1's epilogues), each 128 of k
// promoted with the rows' block scales and the group's scale; pieces of a multiple of 128
template <bool F8, int NG, int U, bool K1, bool TR, bool LO, bool SH, bool ST, bool BS = false>
__device__ void gemm2(const params &p, const smem_t &s, int e, int r, int q, int n1, int64_t *tw,
                      int base)
{
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int n = pass_tokens<LO, NG>(s, e, base), *list = s.slots + s.off[e] + (LO ? base : 0);
    constexpr int ES = F8 ? 1 : 2, CK = F8 ? 64 : 32;
    const int row0 = r * TILE2 + g, row1 = row0 + 8 < p.H ? row0 + 8 : row0;
    const uint8_t *ra = p.w2 + ((int64_t)e * p.H + row0) * p.I * ES;
    const uint8_t *rb = p.w2 + ((int64_t)e * p.H + row1) * p.I * ES;
    const bool shx = SH && e >= p.Er; // a chunk of the shared MLP: columns (e - Er) I .. of sw2
    if constexpr (SH)
        if (shx) {
            ra = p.sw2 + ((int64_t)row0 * p.SI + (int64_t)(e - p.Er) * p.I) * ES;
            rb = p.sw2 + ((int64_t)row1 * p.SI + (int64_t)(e - p.Er) * p.I) * ES;
        }
    constexpr int PK = BS ? 128 : CK; // a piece's granule
    const int per = ((p.I + p.split - 1) / p.split + PK - 1) / PK * PK;
    const int k0 = q * per, k1 = k0 + per < p.I ? k0 + per : p.I;
    const float *hmax =
        reinterpret_cast<const float *>(p.sync + sync_hmax(p.E, p.H, p.I, K1 ? p.split1 : 1));
    int slot[NG];
    float hs[NG], hr[NG]; // GEMM 2's scale of each column's h, and its reciprocal
#pragma unroll
    for (int i = 0; i < NG; i++) {
        slot[i] = i * 8 + g < n ? slot_of<LO>(s, list, e, i * 8 + g) : -1;
        hs[i] = hr[i] = 1.0f;
    }
    auto wait = [&]() {
        if constexpr (SH) {
            if (F8 && shx) // the token's maximum covers every chunk: all of them written
                for (int c = 0; c < p.nsh; c++)
                    warp_wait<LO>(p, p.sync + SYNC_E1 + (p.Er + c) * E1_STRIDE, n1);
            else
                warp_wait<LO>(p, p.sync + SYNC_E1 + e * E1_STRIDE, n1);
        } else {
            warp_wait<LO>(p, p.sync + SYNC_E1 + e * E1_STRIDE, n1);
        }
        if (F8 && !BS) // BS: the groups' scales come with the weights (scales below)
#pragma unroll
            for (int i = 0; i < NG; i++)
                if (slot[i] >= 0) {
                    if constexpr (ST) { // this expert's static scale of h where it has one
                        const float st = p.in2 ? __ldg(p.in2 + e) : 0.0f;
                        hs[i] = st > 0.0f ? st : dynamic_scale(ld_cg_f32(hmax + slot[i]));
                    } else {
                        hs[i] = dynamic_scale(
                            ld_cg_f32(hmax + hmax_index<SH>(p, e, slot[i], p.T * p.k)));
                    }
                    hr[i] = __frcp_rn(hs[i]);
                }
        if (TR)
            stamp(tw);
    };
    auto fetch = [&](int i, int k) -> raw_t {
        raw_t r = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
        if (slot[i] < 0 || k >= k1)
            return r;
        const __nv_bfloat16 *hp = p.h + (int64_t)slot[i] * p.I + k;
        r.a = ld_cg(hp);
        if (F8)
            r.b = ld_cg(hp + 8);
        return r;
    };
    auto make = [&](int i, const raw_t &r) -> uint4 {
        if (!F8)
            return r.a;
        return e4m3x16(r, hs[i], hr[i]);
    };
    float acc[NG][4];
    if constexpr (BS) {
        static_assert(F8 && !K1 && !LO && !SH && !ST, "block scales: the routed form alone");
        // the 16 values of r quantised with their group's scale sc
        auto make_bs = [&](int, const raw_t &r, float sc) -> uint4 {
            return e4m3x16(r, sc, rcp_rn_normal(sc));
        };
        // the item's block scale (its 16 rows lie in one 128-row block: row0 and row1 share it)
        auto wscales = [&](int kb, float(&w)[2][2]) {
#pragma unroll
            for (int q = 0; q < 2; q++)
                w[q][0] = w[q][1] =
                    kb + 128 * q < k1
                        ? __ldg(p.w2s + ((int64_t)e * p.H + row0) * p.G2 + (kb + 128 * q) / 128)
                        : 0.0f;
        };
        // each column's h scale (1 for a column without a token: its operand is zero)
        auto cscales = [&](int kb, float(&c)[2][NG]) {
#pragma unroll
            for (int q = 0; q < 2; q++)
#pragma unroll
                for (int i = 0; i < NG; i++)
                    c[q][i] = kb + 128 * q < k1 && slot[i] >= 0
                                  ? moe_fp8_dynamic_scale_bf16(
                                        ld_cg_f32(hmax + slot[i] * p.G2 + (kb + 128 * q) / 128))
                                  : 1.0f;
        };
        dot_rows<F8, NG, U, F8, true>(acc, ra, rb, k0, k1, n, fetch, make_bs, wait, wscales,
                                      cscales);
    } else {
        dot_rows<F8, NG, U, F8>(acc, ra, rb, k0, k1, n, fetch, make, wait);
    }
    float s0 = 1.0f, s1 = 1.0f;
    if (F8 && SH && shx)
        s0 = __ldg(p.sw2s + row0), s1 = __ldg(p.sw2s + row1);
    else if (F8 && !BS)
        s0 = __ldg(p.w2s + (int64_t)e * p.H + row0), s1 = __ldg(p.w2s + (int64_t)e * p.H + row1);
    const int rows = p.T * p.k;
    float *o = p.o + (int64_t)q * rows * p.H;
#pragma unroll
    for (int i = 0; i < NG; i++) {
        if (i * 8 >= n)
            break;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const int m = i * 8 + 2 * t + j;
            // slot m's h scale: lane (2t + j) * 4 took it in wait() (column g = 2t + j); BS: in
            // the sums
            const float sc = F8 && !BS ? __shfl_sync(0xffffffffu, hs[i], (2 * t + j) * 4) : 1.0f;
            if (m >= n)
                continue;
            const int sl = slot_of<LO>(s, list, e, m);
            o[(int64_t)sl * p.H + row0] = acc[i][j] * sc * s0;
            if (row0 + 8 < p.H)
                o[(int64_t)sl * p.H + row0 + 8] = acc[i][2 + j] * sc * s1;
        }
    }
}

// K1: GEMM 1 split along k (p.split1 > 1), a kernel of its own so that the others keep their
// registers; TR: with the timeline (p.trace), a kernel of its own too; XS: x quantised into every
// CTA's shared memory (uses_local_x: one fp8 token), a kernel of its own, so that the kernel for
// 2 .. 8 tokens keeps its registers; LO: laid-out rows (kernels/decode.h, lo_counts), bf16 x;
// BS: 128 x 128 weight blocks (f8 = 2), one token (XS) of the routed form
template <bool F8, int NG, int U, typename XT, typename YT, bool K1, bool TR, bool XS,
          bool LO = false, bool SH = false, bool ST = false, bool BS = false>
__global__ void __launch_bounds__(THREADS, 2) decode_kernel(params p)
{
    __shared__ smem_t s;
    moe_pdl_wait_only(); // no early launch of the next kernel: this grid waits on itself
    int64_t *tr = nullptr;
    int nev = 0;
    if (TR) {
        tr = p.trace +
             (int64_t)(threadIdx.x / 32 * gridDim.x + blockIdx.x) * MOE_DECODE_TRACE_STRIDE;
        stamp(tr + MOE_DECODE_TRACE_ENTRY);
    }
    // the next event record of this warp: kind and item, start, wait over, end
    auto event = [&](int kind, int item) -> int64_t * {
        if (!TR || nev >= MOE_DECODE_TRACE_EVENTS)
            return nullptr;
        int64_t *ev = tr + MOE_DECODE_TRACE_HEAD + 4 * nev++;
        if ((threadIdx.x & 31) == 0)
            ev[0] = (int64_t)kind << 32 | item, ev[2] = 0;
        stamp(ev + 1);
        return ev;
    };
    build_table<LO, SH>(p, s);
    if (TR)
        stamp(tr + MOE_DECODE_TRACE_TABLE);
    // item i on warp i mod nw, warps numbered across the CTAs first: consecutive items (one
    // expert's tiles) spread over every SM
    const int warp = threadIdx.x / 32, nw = gridDim.x * WARPS;
    const int nu = s.nuniq;
    const int s1 = K1 ? p.split1 : 1;
    const int t1 = p.I / TILE1, n1 = nu * t1 * s1;
    const int t2 = (p.H + TILE2 - 1) / TILE2, n2 = nu * t2 * p.split;
    int32_t *col_done = p.sync + sync_col(p.E);
    // fp8: every CTA quantises the one token's x into its shared memory (uses_local_x), or CTA b
    // tokens b, b + CTAs, ... into global memory (either waits on nothing)
    extern __shared__ __align__(16) uint8_t xql[];
    static_assert(!XS || local_x<F8, NG>(), "x in shared memory: fp8, one column group");
    static_assert(!LO || (!XS && !TR && !K1),
                  "laid-out rows: x in global memory, no timeline, GEMM 1 whole");
    static_assert(!SH || (!LO && !TR && !K1), "the shared MLP inside: routed tokens, GEMM 1 whole");
    static_assert(!ST || (F8 && !XS && !TR && !K1 && !SH),
                  "static scales: fp8, x in global memory, GEMM 1 whole, no shared MLP inside");
    static_assert(!BS || (F8 && XS && !TR && !K1 && !LO && !SH && !ST),
                  "block scales: fp8, one token (x in shared memory), the routed form alone");
    if (XS) {
        int64_t *ev = event(MOE_DECODE_TRACE_XQ, 0);
        quantise_x_local<XT, BS>(p, s, xql);
        if (TR && ev)
            stamp(ev + 3);
    } else if (F8 && LO) { // slot i's row, s.slots[i], each claimed by a resident CTA
        for (;;) {
            if (threadIdx.x == 0)
                s.last = atomicAdd(p.sync + SYNC_QNEXT, 1);
            __syncthreads();
            const int i = s.last;
            __syncthreads(); // every thread's read before the next claim
            if (i >= s.nslots)
                break;
            quantise_x<XT>(p, s, s.slots[i], i);
        }
    } else if (F8) {
        for (int t = blockIdx.x; t < p.T; t += gridDim.x) {
            int64_t *ev = event(MOE_DECODE_TRACE_XQ, t);
            quantise_x<XT>(p, s, t, t);
            if (TR && ev)
                stamp(ev + 3);
        }
    }
    // LO: each warp claims its next item (an EP step: other processes' kernels, under MPS, may
    // keep some CTAs from being resident; a claimed item is on a running warp and waits only on
    // lower ones, so every wait ends without the whole grid resident)
    auto claim = [&]() {
        int i = 0;
        if ((threadIdx.x & 31) == 0)
            i = atomicAdd(p.sync + SYNC_NEXT, 1);
        return __shfl_sync(0xffffffffu, i, 0);
    };
    for (int item = LO ? claim() : warp * gridDim.x + blockIdx.x; item < n1 + n2;
         item = LO ? claim() : item + nw) {
        if (item < n1) {
            const int i = item; // (expert, column tile, k piece), the pieces adjacent
            int64_t *ev = event(MOE_DECODE_TRACE_GEMM1, i);
            const int e = s.uniq[i / (t1 * s1)], c0 = i / s1 % t1 * TILE1;
            if constexpr (LO) // passes of 8 NG of the expert's rows
                for (int b = 0; b < s.cnt[e]; b += 8 * NG)
                    gemm1<F8, NG, U, XT, K1, TR, XS, LO, SH, ST, BS>(
                        p, s, e, c0, i % s1, nullptr, xql, b, b + 8 * NG >= s.cnt[e]);
            else
                gemm1<F8, NG, U, XT, K1, TR, XS, LO, SH, ST, BS>(
                    p, s, e, c0, i % s1, ev ? ev + 2 : nullptr, xql, 0, true);
            if (TR && ev)
                stamp(ev + 3);
        } else {
            const int i = item - n1;
            const int u = i / (t2 * p.split), r = i / p.split % t2, q = i % p.split;
            int64_t *ev = event(MOE_DECODE_TRACE_GEMM2, i);
            if constexpr (LO)
                for (int b = 0; b < s.cnt[s.uniq[u]]; b += 8 * NG)
                    gemm2<F8, NG, U, K1, TR, LO, SH, ST, BS>(p, s, s.uniq[u], r, q, t1, nullptr, b);
            else
                gemm2<F8, NG, U, K1, TR, LO, SH, ST, BS>(p, s, s.uniq[u], r, q, t1,
                                                         ev ? ev + 2 : nullptr, 0);
            if (TR && ev)
                stamp(ev + 3);
            if (warp_signal(col_done + r * COL_STRIDE) == nu * p.split - 1) {
                __threadfence();
                ev = event(MOE_DECODE_TRACE_COMBINE, r);
                if (LO)
                    rows_tile(p, s, r);
                else
                    combine_tile<YT, SH>(p, r);
                if (TR && ev)
                    stamp(ev + 3);
            }
        }
    }
    if (TR) {
        stamp(tr + MOE_DECODE_TRACE_EXIT);
        if ((threadIdx.x & 31) == 0)
            tr[MOE_DECODE_TRACE_COUNT] = nev;
    }
    // the last CTA leaves the counters at zero for the next launch
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        s.last = atomicAdd(p.sync + SYNC_DONE, 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (s.last) {
        __threadfence();
        // (the GEMM 1 piece counters between them are left at zero by their last pieces)
        const int nt = sync_tile(p.E, p.H), nh = sync_hmax(p.E, p.H, p.I, s1);
        for (int i = 1 + threadIdx.x; i < nt; i += THREADS)
            p.sync[i] = 0;
        for (int i = nh + threadIdx.x;
             i < nh + (F8 ? p.T * p.k * (BS ? p.G2 : 1) + (SH ? p.T : 0) : 0); i += THREADS)
            p.sync[i] = 0;
        __syncthreads();
        if (threadIdx.x == 0)
            p.sync[SYNC_DONE] = 0;
    }
}

// CTAs that fit on the device at once (every one must be resident: items wait on others) with
// dyn bytes of dynamic shared memory: cached for dyn = 0; the local_x kernels' limit is raised
// to XS_MAX once, and a launch with dynamic bytes (one fp8 token) takes its count afresh
template <bool F8, int NG, int U, typename XT, typename YT, bool K1, bool TR, bool XS, bool LO,
          bool SH, bool ST, bool BS>
int resident_ctas(int dyn)
{
    static int cached[MOE_MAX_DEVICES];
    int dev = 0, per = 0;
    if (cudaGetDevice(&dev) != cudaSuccess)
        return 0;
    const int n = moe_device_cached(cached, dev, [](int d) {
        const auto k = decode_kernel<F8, NG, U, XT, YT, K1, TR, XS, LO, SH, ST, BS>;
        int sms = 0, per0 = 0;
        if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, d) != cudaSuccess ||
            (XS && cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, XS_MAX) !=
                       cudaSuccess) ||
            cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per0, k, THREADS, 0) != cudaSuccess)
            return 0;
        return sms * per0;
    });
    if (dyn == 0 || n <= 0)
        return n;
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &per, decode_kernel<F8, NG, U, XT, YT, K1, TR, XS, LO, SH, ST, BS>, THREADS, dyn) !=
            cudaSuccess)
        return 0;
    return sms * per;
}

template <bool F8, int NG, int U, typename XT, typename YT, bool K1, bool TR, bool XS,
          bool LO = false, bool SH = false, bool ST = false, bool BS = false>
moe_status_t launch_xs(const params &p, int max_ctas, cudaStream_t stream)
{
    // XS: the codes as f16 (BS: then x's group scales, x_group_scales)
    const int dyn = XS ? (2 * p.T * p.H + 15) / 16 * 16 + (BS ? 4 * p.G1 : 0) : 0;
    if (dyn > XS_MAX)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "decode: hidden = %d: one token's x and its scales take %d bytes of "
                         "shared memory (at most %d)",
                         p.H, dyn, XS_MAX);
    int ctas = resident_ctas<F8, NG, U, XT, YT, K1, TR, XS, LO, SH, ST, BS>(dyn);
    if (ctas <= 0)
        return moe_error(MOE_STATUS_CUDA_ERROR, "decode: no CTA fits on the device");
    if (max_ctas > 0 && max_ctas < ctas)
        ctas = max_ctas;
    MOE_CUDA_CHECK(moe_launch(decode_kernel<F8, NG, U, XT, YT, K1, TR, XS, LO, SH, ST, BS>,
                              dim3(ctas), dim3(THREADS), dyn, stream, p));
    MOE_CUDA_CHECK_LAUNCH("decode_kernel");
    return MOE_STATUS_SUCCESS;
}

template <bool F8, int NG, int U, typename XT, typename YT, bool K1, bool TR = false,
          bool SH = false>
moe_status_t launch_k1(const params &p, int max_ctas, cudaStream_t stream)
{
    if constexpr (local_x<F8, NG>())
        if (uses_local_x<F8, NG>(p))
            return launch_xs<F8, NG, U, XT, YT, K1, TR, true, false, SH>(p, max_ctas, stream);
    return launch_xs<F8, NG, U, XT, YT, K1, TR, false, false, SH>(p, max_ctas, stream);
}

template <bool F8, int NG, int U, typename XT, typename YT, bool TR = false>
moe_status_t launch(const params &p, int max_ctas, cudaStream_t stream)
{
    if constexpr (!TR) { // the shared MLP inside, static scales (moe_decode_launch: GEMM 1 whole)
        if (p.nsh > 0)
            return launch_k1<F8, NG, U, XT, YT, false, false, true>(p, max_ctas, stream);
        if constexpr (F8)
            if (p.in13 || p.in2)
                return launch_xs<F8, NG, U, XT, YT, false, false, false, false, false, true>(
                    p, max_ctas, stream);
    }
    return p.split1 > 1 ? launch_k1<F8, NG, U, XT, YT, true, TR>(p, max_ctas, stream)
                        : launch_k1<F8, NG, U, XT, YT, false, TR>(p, max_ctas, stream);
}

// the timeline's kernels: bf16 x and y, up to 8 tokens (a benchmark's; the others not compiled)
template <bool F8, typename XT, typename YT> struct traced {
    static moe_status_t run(const params &, int, cudaStream_t)
    {
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "decode: a trace needs bf16 x and y");
    }
};
template <bool F8> struct traced<F8, __nv_bfloat16, __nv_bfloat16> {
    static moe_status_t run(const params &p, int max_ctas, cudaStream_t stream)
    {
        return launch<F8, 1, U_WIDE, __nv_bfloat16, __nv_bfloat16, true>(p, max_ctas, stream);
    }
};

template <bool F8, typename XT, typename YT>
moe_status_t launch_ng(const params &p, int max_ctas, cudaStream_t stream)
{
    if constexpr (F8) // block scales: one token, the routed form (moe_decode_launch checks it)
        if (p.G1 > 0)
            return launch_xs<true, 1, U_WIDE, XT, YT, false, false, true, false, false, false,
                             true>(p, max_ctas, stream);
    if (p.trace)
        return p.T <= 8 ? traced<F8, XT, YT>::run(p, max_ctas, stream)
                        : moe_error(MOE_STATUS_NOT_SUPPORTED,
                                    "decode: a trace needs at most 8 tokens, not %d", p.T);
    if (p.T <= 8)
        return launch<F8, 1, U_WIDE, XT, YT>(p, max_ctas, stream);
    if (p.T <= 16)
        return launch<F8, 2, U_WIDE, XT, YT>(p, max_ctas, stream);
    if (p.T <= 32)
        return launch<F8, 4, U_WIDE, XT, YT>(p, max_ctas, stream);
    return launch<F8, 8, U_WIDE, XT, YT>(p, max_ctas, stream);
}

// laid-out rows (bf16 x): the column groups for the most rows an expert may have
// laid-out rows (bf16 x, GEMM 1 whole): 8 columns a pass where an expert is expected to get at
// most 8 rows (lo_cols), else 16; an expert with more runs more passes
template <bool F8, int NG> moe_status_t launch_lo(const params &p, int max_ctas, cudaStream_t st)
{
    using B = __nv_bfloat16;
    if constexpr (F8) // static scales
        if (p.in13 || p.in2)
            return launch_xs<F8, NG, U_WIDE, B, B, false, false, false, true, false, true>(
                p, max_ctas, st);
    return launch_xs<F8, NG, U_WIDE, B, B, false, false, false, true>(p, max_ctas, st);
}

template <bool F8> moe_status_t launch_lo_ng(const params &p, int max_ctas, cudaStream_t stream)
{
    return p.lo_cols <= 8 ? launch_lo<F8, 1>(p, max_ctas, stream)
                          : launch_lo<F8, 2>(p, max_ctas, stream);
}

// The kernel's instances are compiled in translation units of their own, side by side
// (decode_*_sm90.cu: routed tokens by weight type, x dtype and y dtype, and the laid-out rows),
// each holding the explicit instantiations of one set of these (split by y dtype since
// 2026-12-05: an fp8 unit with both took 51 s alone, the build's longest, its halves 27 and 31 s);
// kernels/cuda/decode_sm90.cu calls them.
template <bool F8, typename XT, typename YT>
moe_status_t run_routed_y(const params &p, int max_ctas, cudaStream_t stream)
{
    return launch_ng<F8, XT, YT>(p, max_ctas, stream);
}

template <bool F8> moe_status_t run_laid_out(const params &p, int max_ctas, cudaStream_t stream)
{
    return launch_lo_ng<F8>(p, max_ctas, stream);
}

// Every instance a step of routed tokens with x of type XT and y of type YT can launch, loaded
// now
template <bool F8, typename XT, typename YT> moe_status_t prepare_routed_y()
{
#define MOE_DECODE_PREP(NG, K1, XS, SH, ST)                                                        \
    MOE_CUDA_PREPARE((decode_kernel<F8, NG, U_WIDE, XT, YT, K1, false, XS, false, SH, ST>));
#define MOE_DECODE_PREP_NG(K1, SH, ST)                                                             \
    MOE_DECODE_PREP(1, K1, false, SH, ST)                                                          \
    MOE_DECODE_PREP(2, K1, false, SH, ST)                                                          \
    MOE_DECODE_PREP(4, K1, false, SH, ST)                                                          \
    MOE_DECODE_PREP(8, K1, false, SH, ST)
    MOE_DECODE_PREP_NG(false, false, false)
    MOE_DECODE_PREP_NG(true, false, false)
    if constexpr (local_x<F8, 1>()) { /* one token's x in shared memory, the shared MLP too */
        MOE_DECODE_PREP(1, false, true, false, false)
        MOE_DECODE_PREP(1, true, true, false, false)
        MOE_DECODE_PREP(1, false, true, true, false)
    }
    MOE_DECODE_PREP_NG(false, true, false) /* the shared MLP inside (GEMM 1 whole) */
    if constexpr (F8) {                    /* static activation scales (GEMM 1 whole) */
        MOE_DECODE_PREP_NG(false, false, true)
        /* 128 x 128 weight blocks: one token */
        MOE_CUDA_PREPARE(
            (decode_kernel<F8, 1, U_WIDE, XT, YT, false, false, true, false, false, false, true>));
    }
#undef MOE_DECODE_PREP_NG
#undef MOE_DECODE_PREP
    return MOE_STATUS_SUCCESS;
}

// Every laid-out-rows instance (bf16 x and rows)
template <bool F8> moe_status_t prepare_laid_out()
{
    using B = __nv_bfloat16;
#define MOE_DECODE_PREP_LO(NG)                                                                     \
    MOE_CUDA_PREPARE((decode_kernel<F8, NG, U_WIDE, B, B, false, false, false, true>));            \
    if constexpr (F8) /* static activation scales */                                               \
        MOE_CUDA_PREPARE(                                                                          \
            (decode_kernel<F8, NG, U_WIDE, B, B, false, false, false, true, false, true>));
    MOE_DECODE_PREP_LO(1)
    MOE_DECODE_PREP_LO(2)
#undef MOE_DECODE_PREP_LO
    return MOE_STATUS_SUCCESS;
}

// One routed set: weights (F8), x and y types; instantiated (X empty) in its own translation unit
#define MOE_DECODE_ROUTED(X, F8, XT, YT)                                                           \
    X template moe_status_t run_routed_y<F8, XT, YT>(const params &, int, cudaStream_t);           \
    X template moe_status_t prepare_routed_y<F8, XT, YT>();
#define MOE_DECODE_PARTS(X)                                                                        \
    MOE_DECODE_ROUTED(X, false, float, float)                                                      \
    MOE_DECODE_ROUTED(X, false, float, __nv_bfloat16)                                              \
    MOE_DECODE_ROUTED(X, false, __nv_bfloat16, float)                                              \
    MOE_DECODE_ROUTED(X, false, __nv_bfloat16, __nv_bfloat16)                                      \
    MOE_DECODE_ROUTED(X, true, float, float)                                                       \
    MOE_DECODE_ROUTED(X, true, float, __nv_bfloat16)                                               \
    MOE_DECODE_ROUTED(X, true, __nv_bfloat16, float)                                               \
    MOE_DECODE_ROUTED(X, true, __nv_bfloat16, __nv_bfloat16)                                       \
    X template moe_status_t run_laid_out<false>(const params &, int, cudaStream_t);                \
    X template moe_status_t run_laid_out<true>(const params &, int, cudaStream_t);                 \
    X template moe_status_t prepare_laid_out<false>();                                             \
    X template moe_status_t prepare_laid_out<true>();
// instantiated only in their own translation units
MOE_DECODE_PARTS(extern)

// What kernels/cuda/decode_sm90.cu calls: the y dtype's set
template <bool F8, typename XT>
moe_status_t run_routed(const params &p, moe_dtype_t yt, int max_ctas, cudaStream_t stream)
{
    return yt == MOE_DTYPE_F32 ? run_routed_y<F8, XT, float>(p, max_ctas, stream)
                               : run_routed_y<F8, XT, __nv_bfloat16>(p, max_ctas, stream);
}
template <bool F8, typename XT> moe_status_t prepare_routed()
{
    MOE_CHECK((prepare_routed_y<F8, XT, float>()));
    return prepare_routed_y<F8, XT, __nv_bfloat16>();
}

} // namespace moe_dec

#endif /* MOE_DECODE_SM90_CUH */
