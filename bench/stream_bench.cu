// SPDX-License-Identifier: Apache-2.0
// What HBM reads reach on this GPU (a program, not a test; docs/KERNELS.md, "Fused decode"):
// the fused decode kernel's weight access pattern against the best case, cold (caches flushed
// before every launch), median of the launches, TB/s over the CTAs' span and over the events.
// The pattern: each warp reads work items of 16 weight rows (8 gate rows and the 8 up rows an
// expert's inter size further, as GEMM 1's items) over a k range with 16-byte register loads, two
// batches in flight (the next batch asked before the current one is used), as
// kernels/cuda/decode_sm90.cu; the columns change how one load instruction covers the rows (RPI
// rows x 512 / RPI bytes), the order of the batches (rows first: every row advances a batch at a
// time, as the kernel; k first: one row end to end, then the next), the loads a lane has in a
// batch (U: 8 in the kernel, 4 a row) and the CTAs an SM. The best case: contiguous 512 bytes a
// warp load over the whole grid, and bulk copies (cp.async.bulk) into shared memory.
// Usage: stream_bench [launches]
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels/cuda/sticky.cuh"
#include "kernels/cuda/stream_load.cuh"
#include "bench/cuda_ok.h"

namespace
{

// span[0]: the first CTA's start, span[1]: the last CTA's end (global timer, ns)
__device__ __forceinline__ void span_start(unsigned long long *span)
{
    if (threadIdx.x == 0)
        atomicMin(span, (unsigned long long)moe_global_ns());
}
__device__ __forceinline__ void span_end(unsigned long long *span)
{
    __syncthreads();
    if (threadIdx.x == 0)
        atomicMax(span + 1, (unsigned long long)moe_global_ns());
}

struct shape {
    const char *name;
    int experts, inter, row_bytes, item_bytes; // rows: experts x 2 x inter
};

// RPI: rows one load instruction covers (512 / RPI bytes of each); KF: k first (each row end to
// end in turn) instead of rows first; U: 16-byte loads a lane per batch
template <int RPI, bool KF, int U>
__global__ void __launch_bounds__(256)
    stream(const uint8_t *w, shape s, int items, unsigned *sink, unsigned long long *span)
{
    span_start(span);
    constexpr int LPR = 32 / RPI, W = LPR * 16; // lanes a row, bytes a row per instruction
    const int lane = threadIdx.x & 31, rr = lane / LPR, cc = (lane % LPR) * 16;
    const int nw = gridDim.x * 8, ks = s.row_bytes / s.item_bytes;
    const int nk = s.item_bytes / W, nrs = 16 / RPI, chunks = nk * nrs;
    unsigned acc = 0;
    for (int i = threadIdx.x / 32 * gridDim.x + blockIdx.x; i < items; i += nw) {
        const int rg = i / ks, e = rg / (s.inter / 8), c = rg % (s.inter / 8);
        const int64_t a = (int64_t)e * 2 * s.inter + c * 8; // gate rows a .. a + 7, up a + inter ..
        const int k0 = i % ks * s.item_bytes;
        auto addr = [&](int q) {
            const int set = KF ? q / nk : q % nrs, kc = KF ? q % nk : q / nrs;
            const int row = set * RPI + rr; // 0 .. 15
            const int64_t r = a + (row < 8 ? row : s.inter + row - 8);
            return w + r * s.row_bytes + k0 + kc * W + cc;
        };
        uint4 cur[U], nxt[U];
#pragma unroll
        for (int u = 0; u < U; u++)
            cur[u] = u < chunks ? moe_ld_stream(addr(u)) : make_uint4(0, 0, 0, 0);
        for (int q = 0; q < chunks; q += U) {
#pragma unroll
            for (int u = 0; u < U; u++)
                nxt[u] =
                    q + U + u < chunks ? moe_ld_stream(addr(q + U + u)) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int u = 0; u < U; u++)
                acc ^= cur[u].x ^ cur[u].y ^ cur[u].z ^ cur[u].w, cur[u] = nxt[u];
        }
    }
    if (acc == 0x9e3779b9u) // keeps the loads; practically never true
        *sink = acc;
    span_end(span);
}

// the best case to compare with: every warp's loads 512 contiguous bytes, grid-stride, U a batch
template <int U>
__global__ void __launch_bounds__(256)
    linear(const uint8_t *w, int64_t bytes, unsigned *sink, unsigned long long *span)
{
    span_start(span);
    const int64_t stride = (int64_t)gridDim.x * 256 * 16;
    unsigned acc = 0;
    for (int64_t o = ((int64_t)blockIdx.x * 256 + threadIdx.x) * 16; o < bytes; o += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++)
            v[u] =
                o + u * stride < bytes ? moe_ld_stream(w + o + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < U; u++)
            acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x9e3779b9u)
        *sink = acc;
    span_end(span);
}

__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity)
{
    asm volatile("{\n .reg .pred p;\n WAIT_%=:\n"
                 " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra WAIT_%=;\n}"
                 :
                 : "r"(bar), "r"(parity)
                 : "memory");
}

// the same bytes as bulk copies (TMA: cp.async.bulk, global to shared memory) of CH
// bytes, chunks grid-stride, S stages a CTA in flight, issued by one thread; nothing reads them
template <int S, int CH>
__global__ void __launch_bounds__(32)
    bulk(const uint8_t *w, int64_t bytes, unsigned long long *span)
{
    extern __shared__ __align__(128) uint8_t ring[];
    __shared__ __align__(8) uint64_t bars[S];
    span_start(span);
    if (threadIdx.x == 0) {
        for (int s = 0; s < S; s++)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(
                             (uint32_t)__cvta_generic_to_shared(&bars[s]))
                         : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        const int64_t n = (bytes + CH - 1) / CH;
        int j = 0;
        for (int64_t c = blockIdx.x; c < n; c += gridDim.x, j++) {
            const int s = j % S;
            const uint32_t bar = (uint32_t)__cvta_generic_to_shared(&bars[s]);
            if (j >= S)
                bar_wait(bar, (uint32_t)(j / S - 1) & 1);
            const uint32_t size = (uint32_t)(bytes - c * CH < CH ? bytes - c * CH : CH);
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                         "r"(size)
                         : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], "
                         "[%1], %2, [%3];" ::"r"((uint32_t)__cvta_generic_to_shared(ring + s * CH)),
                         "l"(w + c * CH), "r"(size), "r"(bar)
                         : "memory");
        }
        for (int k = j - S > 0 ? j - S : 0; k < j; k++) // the last S in flight
            bar_wait((uint32_t)__cvta_generic_to_shared(&bars[k % S]), (uint32_t)(k / S) & 1);
    }
    span_end(span);
}

struct rate {
    float event, kernel; // TB/s over the events' time (launch included) and the CTAs' span
};

template <typename L>
rate timed(double bytes, int launches, void *flush, unsigned long long *span, L launch)
{
    cudaEvent_t b, e;
    CUDA_OK(cudaEventCreate(&b));
    CUDA_OK(cudaEventCreate(&e));
    float t[64], k[64];
    for (int l = 0; l < launches; l++) {
        const unsigned long long init[2] = {~0ull, 0ull};
        unsigned long long got[2];
        CUDA_OK(cudaMemcpy(span, init, sizeof(init), cudaMemcpyHostToDevice));
        CUDA_OK(cudaMemset(flush, l, (size_t)512 << 20));
        CUDA_OK(cudaEventRecord(b));
        launch();
        CUDA_OK(cudaGetLastError());
        CUDA_OK(cudaEventRecord(e));
        CUDA_OK(cudaEventSynchronize(e));
        CUDA_OK(cudaEventElapsedTime(&t[l], b, e));
        CUDA_OK(cudaMemcpy(got, span, sizeof(got), cudaMemcpyDeviceToHost));
        k[l] = (float)(got[1] - got[0]) * 1e-6f;
    }
    for (int i = 0; i < launches; i++) // medians
        for (int j = i + 1; j < launches; j++) {
            if (t[j] < t[i]) {
                const float x = t[i];
                t[i] = t[j], t[j] = x;
            }
            if (k[j] < k[i]) {
                const float x = k[i];
                k[i] = k[j], k[j] = x;
            }
        }
    CUDA_OK(cudaEventDestroy(b));
    CUDA_OK(cudaEventDestroy(e));
    return {(float)(bytes / (t[launches / 2] * 1e-3) / 1e12),
            (float)(bytes / (k[launches / 2] * 1e-3) / 1e12)};
}

int sm_count()
{
    int sms = 0, dev = 0;
    CUDA_OK(cudaGetDevice(&dev));
    CUDA_OK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    return sms;
}

template <int RPI, bool KF, int U>
rate run(const uint8_t *w, const shape &s, int ctas_per_sm, int launches, void *flush,
         unsigned *sink, unsigned long long *span)
{
    const int items = s.experts * 2 * s.inter / 16 * (s.row_bytes / s.item_bytes);
    const int grid = sm_count() * ctas_per_sm;
    return timed((double)s.experts * 2 * s.inter * s.row_bytes, launches, flush, span,
                 [&] { stream<RPI, KF, U><<<grid, 256>>>(w, s, items, sink, span); });
}

} // namespace

int main(int argc, char **argv)
{
    const int launches = argc > 1 ? atoi(argv[1]) : 9;
    if (launches < 1 || launches > 64) {
        fprintf(stderr, "usage: stream_bench [launches 1..64]\n");
        return 2;
    }
    // (experts, inter, row bytes, item bytes): one token's GEMM 1 (every touched expert's w13)
    const shape shapes[] = {
        {"qwen3 bf16 (768 items)", 8, 768, 4096, 4096},
        {"qwen3 bf16, k split 2 (1536)", 8, 768, 4096, 2048},
        {"qwen3 bf16, k split 4 (3072)", 8, 768, 4096, 1024},
        {"qwen3 fp8 (768)", 8, 768, 2048, 2048},
        {"mixtral bf16 (3584)", 2, 14336, 8192, 8192},
        {"dsv3 shard bf16 (2048)", 8, 2048, 14336, 14336},
    };
    uint8_t *w = nullptr;
    void *flush = nullptr;
    unsigned *sink = nullptr;
    unsigned long long *span = nullptr;
    CUDA_OK(cudaMalloc(&w, (size_t)480 << 20));
    CUDA_OK(cudaMemset(w, 1, (size_t)480 << 20));
    CUDA_OK(cudaMalloc(&flush, (size_t)512 << 20));
    CUDA_OK(cudaMalloc(&sink, sizeof(unsigned)));
    CUDA_OK(cudaMalloc(&span, 2 * sizeof(unsigned long long)));
    printf("TB/s, median of %d launches, caches flushed, 2 CTAs of 8 warps an SM unless said; "
           "each cell: over the CTAs' span (global timer) / over the events (launch "
           "included)\n\n",
           launches);
    printf("| shape | 8 rows x 64 B, rows first, 8 loads a batch (the kernel) | 16 loads | 4 x 128 "
           "B | 2 x 256 B | 1 x 512 B | 1 x 512 B, k first | 8 x 64 B, 16 loads, 1 CTA an SM "
           "|\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for (const shape &s : shapes) {
        const rate r[] = {run<8, false, 8>(w, s, 2, launches, flush, sink, span),
                          run<8, false, 16>(w, s, 2, launches, flush, sink, span),
                          run<4, false, 8>(w, s, 2, launches, flush, sink, span),
                          run<2, false, 8>(w, s, 2, launches, flush, sink, span),
                          run<1, false, 8>(w, s, 2, launches, flush, sink, span),
                          run<1, true, 8>(w, s, 2, launches, flush, sink, span),
                          run<8, false, 16>(w, s, 1, launches, flush, sink, span)};
        printf("| %s |", s.name);
        for (const rate &x : r)
            printf(" %.2f / %.2f |", x.kernel, x.event);
        printf("\n");
        fflush(stdout);
    }
    printf("\nThe best case: contiguous bytes read by every warp of the grid in turn (512 B a warp "
           "load, grid-stride), U loads a lane in flight; bulk copies of 32 KB into shared memory, "
           "grid-stride, 6 a CTA in flight, one CTA of one warp an SM\n\n| MB | U 4 | U 8 | U 16 "
           "| bulk |\n| ---: | ---: | ---: | ---: | ---: |\n");
    const int grid = sm_count() * 2;
    constexpr int BS = 6, BCH = 32 * 1024;
    CUDA_OK(
        cudaFuncSetAttribute(bulk<BS, BCH>, cudaFuncAttributeMaxDynamicSharedMemorySize, BS * BCH));
    for (int mb : {12, 25, 50, 100, 200, 470}) {
        const int64_t bytes = (int64_t)mb << 20;
        const rate a = timed((double)bytes, launches, flush, span,
                             [&] { linear<4><<<grid, 256>>>(w, bytes, sink, span); });
        const rate b = timed((double)bytes, launches, flush, span,
                             [&] { linear<8><<<grid, 256>>>(w, bytes, sink, span); });
        const rate c = timed((double)bytes, launches, flush, span,
                             [&] { linear<16><<<grid, 256>>>(w, bytes, sink, span); });
        const rate d = timed((double)bytes, launches, flush, span,
                             [&] { bulk<BS, BCH><<<grid / 2, 32, BS * BCH>>>(w, bytes, span); });
        printf("| %d | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f | %.2f / %.2f |\n", mb, a.kernel,
               a.event, b.kernel, b.event, c.kernel, c.event, d.kernel, d.event);
    }
    CUDA_OK(cudaFree(span));
    CUDA_OK(cudaFree(w));
    CUDA_OK(cudaFree(flush));
    CUDA_OK(cudaFree(sink));
    return 0;
}
