/* SPDX-License-Identifier: Apache-2.0 */
/* Times every grouped-GEMM variant on the expert MLP of three models (GEMM1 x W13 with the
 * SiLU*up epilogue, GEMM2 x W2 with the routing-weight epilogue) and prints a markdown table:
 * microseconds, weight TB/s, TFLOP/s, fraction of the H200 floor. FP8 variants run on e4m3
 * operands with unit scales (per row, or per 128-wide k slice for block scales) and their own
 * floor (one byte a weight, the FP8 tensor-core rate). Each step passes the permute's expert
 * counts and offsets, as the layer does.
 * Usage: gemm_bench [model substring | all] [max rows per expert] [min rows] [variant name]. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/expert_gemm_table.h"
#include "runtime/oracle.h"
#include "base/diag.h"
#include "bench/cuda_ok.h"

#define HBM_BPS 4.8e12
#define PEAK_FLOPS 989e12
#define PEAK_FLOPS_FP8 1979e12
#define SETS 16 /* rotating sets of active experts: no weight reuse in L2 between launches */

typedef struct model {
    const char *name;
    int num_experts, top_k, hidden, inter;
} model_t;

static const model_t models[] = {
    {"mixtral", 8, 2, 4096, 14336},
    {"qwen3", 128, 8, 2048, 768},
    {"dsv3_ep8", 32, 8, 7168, 2048},
    /* tails (issue 11): each odd shape next to its nearest aligned one */
    {"qwen3_tp8_i96", 128, 8, 2048, 96},
    {"qwen3_al_i128", 128, 8, 2048, 128},
    {"qwen2_tp8_i176", 60, 4, 2048, 176},
    {"qwen2_al_i192", 60, 4, 2048, 192},
    {"gptoss_h2880", 32, 4, 2880, 2880},
    {"gptoss_al_h3072", 32, 4, 3072, 3072},
};

typedef struct bench_case {
    int active, rows; /* experts with rows, rows per active expert */
} case_t;

static int cmp_f(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* Median over samples of the mean time of `batch` launches, in microseconds; < 0 on error. */
static int once; /* GEMM_BENCH_ONCE=1: launch each kernel once (under ncu) */

/* The rotating sets' block tables and the permute's counts and offsets for each. */
typedef struct sets {
    int32_t *be[SETS], *counts[SETS], *offsets[SETS];
} sets_t;

static void use_set(moe_gemm_args_t *args, const sets_t *d, int s)
{
    args->block_expert = d->be[s];
    args->expert_counts = d->counts[s];
    args->expert_offsets = d->offsets[s];
}

static float time_launch(const moe_gemm_variant_t *v, moe_gemm_args_t *args, const sets_t *d,
                         cudaStream_t st, cudaEvent_t e0, cudaEvent_t e1)
{
    use_set(args, d, 0);
    if (v->launch(args, st) != MOE_STATUS_SUCCESS)
        return -1.0f;
    CUDA_OK(cudaStreamSynchronize(st));
    if (once)
        return 0.0f; /* one launch each, for a profiler */
    float probe_ms;
    CUDA_OK(cudaEventRecord(e0, st));
    for (int i = 0; i < 3; i++) {
        use_set(args, d, (i + 1) % SETS);
        v->launch(args, st);
    }
    CUDA_OK(cudaEventRecord(e1, st));
    CUDA_OK(cudaEventSynchronize(e1));
    CUDA_OK(cudaEventElapsedTime(&probe_ms, e0, e1));
    probe_ms /= 3;
    int batch = probe_ms < 0.05f ? 20 : probe_ms < 0.5f ? 5 : 1;
    int samples = probe_ms > 5.0f ? 5 : probe_ms > 1.0f ? 11 : 21;
    float t[32];
    int it = 0;
    for (int s = 0; s < samples; s++) {
        CUDA_OK(cudaEventRecord(e0, st));
        for (int b = 0; b < batch; b++, it++) {
            use_set(args, d, it % SETS);
            v->launch(args, st);
        }
        CUDA_OK(cudaEventRecord(e1, st));
        CUDA_OK(cudaEventSynchronize(e1));
        CUDA_OK(cudaEventElapsedTime(&t[s], e0, e1));
        t[s] = t[s] * 1000.0f / batch;
    }
    CUDA_OK(cudaGetLastError());
    qsort(t, samples, sizeof(float), cmp_f);
    return t[samples / 2];
}

static uint64_t xorshift64(uint64_t *x)
{
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

/* d filled with a 64 MB random pattern, repeated: bf16 in about [-1/16, 1/16] (sign, exponent
 * 119..122, random mantissa), or (fp8) e4m3 bytes of small magnitude (exponent field at most 6:
 * no NaN, no overflow). */
static void fill_pattern(void *d, size_t bytes, int fp8)
{
    size_t chunk = 64u << 20;
    uint8_t *h = malloc(chunk);
    uint64_t x = fp8 ? 0x2545f4914f6cdd1dull : 88172645463325252ull;
    for (size_t i = 0; i < chunk; i += fp8 ? 1 : 2) {
        const uint64_t r = xorshift64(&x);
        if (fp8) {
            h[i] = (uint8_t)((r & 0x80) | (r >> 9 & 0x37));
        } else {
            const uint16_t v =
                (uint16_t)(((r >> 20) & 0x8000) | ((119 + ((r >> 8) & 3)) << 7) | (r & 0x7f));
            memcpy(h + i, &v, sizeof(v));
        }
    }
    for (size_t off = 0; off < bytes; off += chunk) {
        size_t nb = bytes - off < chunk ? bytes - off : chunk;
        CUDA_OK(cudaMemcpy((char *)d + off, h, nb, cudaMemcpyHostToDevice));
    }
    free(h);
}

static void fill_ones(float *d, size_t n)
{
    float *h = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++)
        h[i] = 1.0f;
    CUDA_OK(cudaMemcpy(d, h, n * sizeof(float), cudaMemcpyHostToDevice));
    free(h);
}

int main(int argc, char **argv)
{
    const char *filter = argc > 1 && strcmp(argv[1], "all") ? argv[1] : NULL;
    const int max_case_rows = argc > 2 ? atoi(argv[2]) : 1 << 30;
    const int min_case_rows = argc > 3 ? atoi(argv[3]) : 0;
    const char *vfilter = argc > 4 ? argv[4] : NULL;
    once = getenv("GEMM_BENCH_ONCE") != NULL;
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        fprintf(stderr, "no CUDA device\n");
        return 77;
    }
    struct cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    int arch = prop.major * 10 + prop.minor;
    int count;
    const moe_gemm_variant_t *vs = moe_gemm_variants(&count);
    cudaStream_t st;
    cudaEvent_t e0, e1;
    CUDA_OK(cudaStreamCreate(&st));
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));

    printf("# grouped GEMM bench: %s (arch %d, %d SMs); floor = max(weight bytes / 4.8 TB/s, "
           "flops / 989 TFLOP/s; fp8: a byte a weight, 1979 TFLOP/s); GEMM1 = x.W13^T + "
           "silu*up (bf16 out), GEMM2 = h.W2^T * row_scale (bf16 out); fp8 variants on e4m3 "
           "operands, unit scales\n\n",
           prop.name, arch, prop.multiProcessorCount);
    printf("| model | M | experts x rows | variant | GEMM1 us | GEMM2 us | total us | floor us | "
           "frac | weight TB/s | TFLOP/s | select |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");

    for (size_t mi = 0; mi < sizeof(models) / sizeof(models[0]); mi++) {
        const model_t *m = &models[mi];
        if (filter && !strstr(m->name, filter))
            continue;
        const int E = m->num_experts, H = m->hidden, I = m->inter;
        case_t cases[16];
        int nc = 0;
        cases[nc++] = (case_t){mi == 0 ? 2 : 8, 1}; /* one token: top_k experts */
        const int rl[] = {1, 4, 8, 16, 32, 64, 128, 256, 1024, 2048};
        for (int i = 0; i < 10; i++)
            cases[nc++] = (case_t){E, rl[i]};
        size_t w13_bytes = (size_t)E * 2 * I * H * 2, w2_bytes = (size_t)E * H * I * 2;
        void *d_w13, *d_w2;
        CUDA_OK(cudaMalloc(&d_w13, w13_bytes));
        CUDA_OK(cudaMalloc(&d_w2, w2_bytes));
        fill_pattern(d_w13, w13_bytes, 0);
        fill_pattern(d_w2, w2_bytes, 0);
        /* activations sized for the largest case at the smallest block size */
        size_t max_rows = (size_t)E * (2048 + 128);
        void *d_x, *d_h, *d_y;
        float *d_scale;
        CUDA_OK(cudaMalloc(&d_x, max_rows * H * 2));
        CUDA_OK(cudaMalloc(&d_h, max_rows * I * 2));
        CUDA_OK(cudaMalloc(&d_y, max_rows * H * 2));
        CUDA_OK(cudaMalloc((void **)&d_scale, max_rows * 4));
        fill_pattern(d_x, max_rows * H * 2, 0);
        fill_pattern(d_h, max_rows * I * 2, 0);
        fill_pattern(d_scale, max_rows * 4, 0);
        /* FP8: e4m3 copies of the operands (GEMM 2's input apart from GEMM 1's bf16 output) and
         * unit scales, sized for block scales (one per row and 128-wide k slice) */
        const size_t kbn = (size_t)((H > I ? H : I) + 127) / 128,
                     wrows = (size_t)E * (2 * I > H ? 2 * I : H);
        void *d_w13q, *d_w2q, *d_xq, *d_hq;
        float *d_as, *d_bs;
        CUDA_OK(cudaMalloc(&d_w13q, w13_bytes / 2));
        CUDA_OK(cudaMalloc(&d_w2q, w2_bytes / 2));
        CUDA_OK(cudaMalloc(&d_xq, max_rows * H));
        CUDA_OK(cudaMalloc(&d_hq, max_rows * I));
        CUDA_OK(cudaMalloc((void **)&d_as, max_rows * kbn * 4));
        CUDA_OK(cudaMalloc((void **)&d_bs, wrows * kbn * 4));
        fill_pattern(d_w13q, w13_bytes / 2, 1);
        fill_pattern(d_w2q, w2_bytes / 2, 1);
        fill_pattern(d_xq, max_rows * H, 1);
        fill_pattern(d_hq, max_rows * I, 1);
        fill_ones(d_as, max_rows * kbn);
        fill_ones(d_bs, wrows * kbn);
        sets_t d_sets;
        int32_t *d_nb;
        int32_t *h_be = malloc(sizeof(int32_t) * max_rows), *h_cnt = malloc(sizeof(int32_t) * E),
                *h_off = malloc(sizeof(int32_t) * (E + 1));
        for (int s = 0; s < SETS; s++) {
            CUDA_OK(cudaMalloc((void **)&d_sets.be[s], max_rows * 4));
            CUDA_OK(cudaMalloc((void **)&d_sets.counts[s], sizeof(int32_t) * E));
            CUDA_OK(cudaMalloc((void **)&d_sets.offsets[s], sizeof(int32_t) * (E + 1)));
        }
        CUDA_OK(cudaMalloc((void **)&d_nb, 4));

        for (int ci = 0; ci < nc; ci++) {
            const case_t *c = &cases[ci];
            if (c->rows > max_case_rows || c->rows < min_case_rows)
                continue;
            double flops = 2.0 * c->active * c->rows * 3.0 * I * H;
            int tokens = (int)((double)c->active * c->rows / m->top_k + 0.5);
            for (int vi = 0; vi < count; vi++) {
                const moe_gemm_variant_t *v = &vs[vi];
                if (v->min_arch > arch || (vfilter && strcmp(v->name, vfilter)))
                    continue;
                const int f8 = v->ab_dtype == MOE_DTYPE_FP8_E4M3;
                const double bytes = (double)c->active * 3.0 * I * H * (f8 ? 1 : 2);
                const double floor_us =
                    fmax(bytes / HBM_BPS, flops / (f8 ? PEAK_FLOPS_FP8 : PEAK_FLOPS)) * 1e6;
                const moe_gemm_variant_t *sel =
                    moe_gemm_select(arch, v->ab_dtype, v->scale_kind, c->rows);
                if (v->swap_ab && c->rows > 4 * v->block_rows && c->rows > 64)
                    continue; /* swap-AB re-reads weights per block: only for few rows */
                if (v->min_arch == 80 && arch >= 90 && ci > 0 && c->rows != 16 && c->rows != 64 &&
                    c->rows != 1024)
                    continue; /* the fallback: a few points on Hopper */
                int br = v->block_rows;
                int per = (c->rows + br - 1) / br, nb = c->active * per;
                int max_blocks = nb + E; /* what a runtime sizes: + one partial block each */
                for (int s = 0; s < SETS; s++) {
                    /* set s: the active experts s * active .. (mod E), `per` blocks each */
                    for (int e = 0; e < E; e++)
                        h_cnt[e] = 0, h_off[e] = nb * br;
                    h_off[E] = nb * br;
                    for (int b = 0; b < max_blocks; b++)
                        h_be[b] = b < nb ? (b / per + s * c->active) % E : -1;
                    for (int j = 0; j < c->active; j++) {
                        const int e = (j + s * c->active) % E;
                        h_cnt[e] = c->rows;
                        h_off[e] = j * per * br;
                    }
                    CUDA_OK(cudaMemcpy(d_sets.be[s], h_be, max_blocks * 4, cudaMemcpyHostToDevice));
                    CUDA_OK(cudaMemcpy(d_sets.counts[s], h_cnt, sizeof(int32_t) * E,
                                       cudaMemcpyHostToDevice));
                    CUDA_OK(cudaMemcpy(d_sets.offsets[s], h_off, sizeof(int32_t) * (E + 1),
                                       cudaMemcpyHostToDevice));
                }
                CUDA_OK(cudaMemcpy(d_nb, &nb, 4, cudaMemcpyHostToDevice));
                moe_gemm_args_t a1;
                memset(&a1, 0, sizeof(a1));
                a1.a = d_x;
                a1.b = d_w13;
                a1.c = d_h;
                a1.num_blocks = d_nb;
                a1.max_blocks = max_blocks;
                a1.num_experts = E;
                a1.n = 2 * I;
                a1.k = H;
                a1.epilogue = MOE_GEMM_EPI_SILU_MUL;
                a1.ab_dtype = v->ab_dtype;
                a1.scale_kind = v->scale_kind;
                if (f8) {
                    a1.a = d_xq;
                    a1.b = d_w13q;
                    a1.a_scale = d_as;
                    a1.b_scale = d_bs;
                }
                moe_gemm_args_t a2 = a1;
                a2.a = f8 ? d_hq : d_h;
                a2.b = f8 ? d_w2q : d_w2;
                a2.c = d_y;
                a2.row_scale = d_scale;
                a2.n = H;
                a2.k = I;
                a2.epilogue = MOE_GEMM_EPI_STORE;
                float t1 = time_launch(v, &a1, &d_sets, st, e0, e1);
                float t2 = time_launch(v, &a2, &d_sets, st, e0, e1);
                if (t1 < 0 || t2 < 0) {
                    printf("| %s | %d | %dx%d | %s | - | - | - | %.1f | - | - | - | %s |\n",
                           m->name, tokens, c->active, c->rows, v->name, floor_us,
                           moe_last_error());
                    continue;
                }
                double tot = t1 + t2;
                printf("| %s | %d | %dx%d | %s | %.1f | %.1f | %.1f | %.1f | %.2f | %.2f | %.0f "
                       "| %s |\n",
                       m->name, tokens, c->active, c->rows, v->name, t1, t2, tot, floor_us,
                       floor_us / tot, bytes / (tot * 1e-6) / 1e12, flops / (tot * 1e-6) / 1e12,
                       v == sel ? "<-" : "");
                fflush(stdout);
            }
        }
        free(h_be), free(h_cnt), free(h_off);
        for (int s = 0; s < SETS; s++) {
            cudaFree(d_sets.be[s]);
            cudaFree(d_sets.counts[s]);
            cudaFree(d_sets.offsets[s]);
        }
        cudaFree(d_w13q);
        cudaFree(d_w2q);
        cudaFree(d_xq);
        cudaFree(d_hq);
        cudaFree(d_as);
        cudaFree(d_bs);
        cudaFree(d_nb);
        cudaFree(d_w13);
        cudaFree(d_w2);
        cudaFree(d_x);
        cudaFree(d_h);
        cudaFree(d_y);
        cudaFree(d_scale);
    }
    return 0;
}
