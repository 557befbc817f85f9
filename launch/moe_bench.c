/* SPDX-License-Identifier: Apache-2.0 */
/* moe-bench: times one MoE layer step on this GPU per token count, nccl-tests style, against
 * the hardware limit (weight bytes / HBM bandwidth, flops / tensor-core rate).
 *
 * The layer runs through the public API only. The benchmark itself (device buffers, streams,
 * events, graph capture, the copy and cuBLAS reference rates) talks to the CUDA runtime and
 * cuBLAS directly: this is a program, not the library, and it links CUDA::cudart and
 * CUDA::cublas itself. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "dispatch_bench.h"
#include "layer_gen.h"
#include "tool_check.h"
#include "moe/moe.h"
#include "moe/moe_mpi.h"

/* H200 datasheet figures the score is measured against. */
#define HBM_BYTES_PER_S 4.8e12
#define BF16_FLOPS_PER_S 989e12
#define FP8_FLOPS_PER_S 1979e12
#define MAX_POINTS 64

#define CUDA_OK(call) MOE_TOOL_CUDA_OK("moe-bench", call)
#define MOE_OK(call) MOE_TOOL_OK("moe-bench", call)

typedef struct point {
    int64_t m;
    int distinct, graph, iters;
    double time_us, min_us, flops, bytes, limit_us;
    double limit_exp_us;      /* the limit from the expected experts touched, E (1 - (1 - k/E)^M) */
    moe_layer_stats_t phases; /* one step run with MOE_PROFILE=1 */
} point_t;

typedef struct options {
    const char *preset, *json;
    moe_layer_config_t cfg;
    int64_t tokens[MAX_POINTS];
    int num_tokens;
    int64_t graph_max; /* graph-replay steps of at most this many tokens */
    double seconds;    /* time spent per point, roughly */
    int help;
    int explain;             /* --explain: per point, what the layer runs and why */
    int fp8;                 /* --dtype fp8: W8A8 */
    moe_scale_kind_t scales; /* --scales (fp8; default per-tensor) */
    FILE *json_file;         /* opened before the run, so a bad path fails before minutes of work */
    char err[512];           /* why this rank rejected its options */
} options_t;

/* Bounds: every size stays inside an int (nothing wraps) and every buffer size in int64. */
#define MAX_DIM (INT64_C(1) << 20)
#define MAX_M (INT64_C(1) << 30) /* the library's max_tokens_per_rank */

#define REJECT(...) (snprintf(o->err, sizeof(o->err), __VA_ARGS__), 0)

static void usage(void)
{
    printf("usage: moe-bench [--preset NAME] [--experts E --top-k K --hidden H --intermediate I]\n"
           "                 [--tokens 1,8,64,512,2048,8192] [--graph-max M] [--seconds S]\n"
           "                 [--json FILE] [--explain] [--dtype bf16|fp8 [--scales "
           "tensor|channel|block]]\n"
           "         (fp8: e4m3 weights and activations, W8A8, f32 accumulation)\n"
           "       mpirun -np N moe-bench --dispatch-only [--max-tokens T] [--capacity C] "
           "[--told]\n"
           "         (expert-parallel dispatch/combine next to NCCL all-to-all; --capacity: a\n"
           "         serving engine's max_tokens_per_rank for every point; --told: pass\n"
           "         max_tokens_across_ranks = the point's tokens)\n"
           "presets: %s\n",
           moe_gen_preset_names());
}

/* A comma-separated list of token counts, each in 1..MAX_M, at most MAX_POINTS of them. */
static int parse_tokens(const char *s, options_t *o)
{
    char item[32];
    const char *p = s;
    int64_t v;
    o->num_tokens = 0;
    while (1) {
        size_t n = strcspn(p, ",");
        if (o->num_tokens == MAX_POINTS)
            return REJECT("--tokens %s: more than %d token counts", s, MAX_POINTS);
        if (n == 0 || n >= sizeof(item))
            return REJECT("--tokens %s: expected counts like 1,8,64", s);
        memcpy(item, p, n);
        item[n] = '\0';
        if (moe_cli_int("--tokens", item, 1, MAX_M, &v, o->err, sizeof(o->err)))
            return 0;
        o->tokens[o->num_tokens++] = v;
        if (!p[n])
            return 1;
        p += n + 1;
    }
}

/* The command line into *o; 0 with o->err on the first bad option. */
static int parse(int argc, char **argv, options_t *o)
{
    int i;
    moe_layer_config_t init = MOE_LAYER_CONFIG_INIT;
    memset(o, 0, sizeof(*o));
    o->cfg = init;
    o->preset = "mixtral-8x7b";
    o->graph_max = 512;
    o->seconds = 0.3;
    parse_tokens("1,8,64,512,2048,8192", o);
    moe_gen_preset(o->preset, &o->cfg);
    for (i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))
            return o->help = 1;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int ok = 1;
        if (!strcmp(a, "--explain")) {
            o->explain = 1;
            continue;
        }
        if (!v)
            return REJECT("%s needs a value (or is unknown: see --help)", a);
        i++;
        ok = moe_gen_shape_option(a, v, &o->cfg, &o->preset, o->err, sizeof(o->err));
        if (ok < 0)
            ok = moe_gen_fp8_option(a, v, &o->fp8, &o->scales, o->err, sizeof(o->err));
        if (ok >= 0) { /* a shape or arithmetic option (0: bad value, o->err says why) */
            if (!ok)
                return 0;
            continue;
        }
        ok = 1;
        if (!strcmp(a, "--tokens")) {
            ok = parse_tokens(v, o);
        } else if (!strcmp(a, "--graph-max")) {
            ok = !moe_cli_int(a, v, 0, MAX_M, &o->graph_max, o->err, sizeof(o->err));
        } else if (!strcmp(a, "--seconds")) {
            ok = !moe_cli_double(a, v, 1e-3, 3600.0, &o->seconds, o->err, sizeof(o->err));
        } else if (!strcmp(a, "--json")) {
            o->json = v;
        } else {
            return REJECT("unknown option %s (see --help)", a);
        }
        if (!ok)
            return 0;
    }
    return 1;
}

/* Local checks before any collective: the buffers' sizes, and rank 0's --json file. */
static int resolve(options_t *o, int rank)
{
    int64_t max_m = 0;
    int i;
    for (i = 0; i < o->num_tokens; i++)
        max_m = o->tokens[i] > max_m ? o->tokens[i] : max_m;
    /* x, y: max_m x hidden bf16; topk ids max_m x top_k; weights up to E x H x 2 bytes */
    if (max_m * o->cfg.hidden > (INT64_C(1) << 36))
        return REJECT("--tokens %lld x --hidden %d: %lld values per buffer is too many",
                      (long long)max_m, o->cfg.hidden, (long long)(max_m * o->cfg.hidden));
    if (o->json && rank == 0 && !(o->json_file = fopen(o->json, "w")))
        return REJECT("--json %s: cannot write: %s", o->json, strerror(errno));
    return 1;
}

/* FNV-1a over the token counts, so a list enters one field. */
static uint64_t token_list_hash(const options_t *o, uint64_t h)
{
    int i;
    for (i = 0; i < o->num_tokens; i++)
        h = (h ^ (uint64_t)o->tokens[i]) * 1099511628211ULL;
    return h;
}

/* The options that shape the collectives, the same on every rank (cli.h). 0: go on. */
static int agree_options(const options_t *o, int bad)
{
    uint64_t h = 1469598103934665603ULL;
    const moe_cli_field_t f[] = {
        {"--help", o->help, 0},
        {"--explain", o->explain, 0},
        {"--experts", o->cfg.num_experts, 0},
        {"--top-k", o->cfg.top_k, 0},
        {"--hidden", o->cfg.hidden, 0},
        {"--intermediate", o->cfg.intermediate, 0},
        {"--preset", moe_cli_hash(o->preset), 1},
        {"--graph-max", o->graph_max, 0},
        {"--tokens", (int64_t)(token_list_hash(o, h) >> 1), 1},
        {"--dtype", o->fp8, 0},
        {"--scales", o->scales, 0},
    };
    return moe_cli_agree("moe-bench", bad, o->err, f, (int)(sizeof(f) / sizeof(f[0])));
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Device-to-device copy rate, counting read + write bytes (as the figure in the device notes). */
static double copy_gbps(cudaStream_t s)
{
    const size_t bytes = (size_t)1 << 30;
    void *a, *b;
    cudaEvent_t e0, e1;
    float ms = 0;
    int i;
    CUDA_OK(cudaMalloc(&a, bytes));
    CUDA_OK(cudaMalloc(&b, bytes));
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    CUDA_OK(cudaMemsetAsync(a, 1, bytes, s));
    CUDA_OK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s));
    CUDA_OK(cudaEventRecord(e0, s));
    for (i = 0; i < 10; i++)
        CUDA_OK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s));
    CUDA_OK(cudaEventRecord(e1, s));
    CUDA_OK(cudaEventSynchronize(e1));
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    CUDA_OK(cudaFree(a));
    CUDA_OK(cudaFree(b));
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return 10.0 * 2.0 * (double)bytes / (ms * 1e-3) / 1e9;
}

/* cuBLAS bf16 GEMM 8192^3 (f32 accumulation) in TFLOP/s. */
static double cublas_tflops(cudaStream_t s)
{
    const int n = 8192;
    const size_t bytes = 2 * (size_t)n * n;
    void *a, *b, *c;
    uint16_t *h = malloc(bytes);
    uint64_t st = 12345;
    float alpha = 1.0f, beta = 0.0f, ms = 0;
    cublasHandle_t handle;
    cudaEvent_t e0, e1;
    int i;
    moe_gen_fill_bf16(h, (size_t)n * n, 1.0f, &st);
    CUDA_OK(cudaMalloc(&a, bytes));
    CUDA_OK(cudaMalloc(&b, bytes));
    CUDA_OK(cudaMalloc(&c, bytes));
    CUDA_OK(cudaMemcpy(a, h, bytes, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(b, h, bytes, cudaMemcpyHostToDevice));
    if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "moe-bench: cublasCreate failed\n");
        return 0.0;
    }
    cublasSetStream(handle, s);
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    for (i = 0; i < 23; i++) {
        if (i == 3)
            CUDA_OK(cudaEventRecord(e0, s));
        if (cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b,
                         CUDA_R_16BF, n, &beta, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
            fprintf(stderr, "moe-bench: cublasGemmEx failed\n");
            return 0.0;
        }
    }
    CUDA_OK(cudaEventRecord(e1, s));
    CUDA_OK(cudaEventSynchronize(e1));
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    cublasDestroy(handle);
    cudaFree(a), cudaFree(b), cudaFree(c), free(h);
    cudaEventDestroy(e0), cudaEventDestroy(e1);
    return 20.0 * 2.0 * (double)n * n * n / (ms * 1e-3) / 1e12;
}

/* Distinct experts hit by the step's actual routing. */
static int count_distinct(moe_layer_t *layer, moe_forward_args_t a, int32_t *d_ids, int E, int k,
                          cudaStream_t s)
{
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(a.num_tokens * k));
    unsigned char *hit = calloc((size_t)E, 1);
    int64_t i;
    int n = 0;
    a.topk_ids = d_ids;
    MOE_OK(moe_layer_forward(layer, &a));
    CUDA_OK(cudaStreamSynchronize(s));
    CUDA_OK(cudaMemcpy(ids, d_ids, sizeof(int32_t) * (size_t)(a.num_tokens * k),
                       cudaMemcpyDeviceToHost));
    for (i = 0; i < a.num_tokens * k; i++)
        if (ids[i] >= 0 && ids[i] < E && !hit[ids[i]]) {
            hit[ids[i]] = 1;
            n++;
        }
    free(ids);
    free(hit);
    return n;
}

static void run_point(moe_layer_t *layer, const options_t *o, moe_forward_args_t a, int32_t *d_ids,
                      cudaStream_t s, point_t *p)
{
    const moe_layer_config_t *c = &o->cfg;
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaEvent_t e0, e1, *ev;
    double *t, first;
    float ms;
    int i, n;

    p->m = a.num_tokens;
    p->distinct = count_distinct(layer, a, d_ids, c->num_experts, c->top_k, s);
    p->graph = a.num_tokens <= o->graph_max;
    if (p->graph) {
        CUDA_OK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        MOE_OK(moe_layer_forward(layer, &a));
        CUDA_OK(cudaStreamEndCapture(s, &graph));
        CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    }
    CUDA_OK(cudaEventCreate(&e0));
    CUDA_OK(cudaEventCreate(&e1));
    /* warm-up, and one timed step to size the run */
    for (i = 0; i < 4; i++) {
        CUDA_OK(cudaEventRecord(e0, s));
        if (p->graph)
            CUDA_OK(cudaGraphLaunch(exec, s));
        else
            MOE_OK(moe_layer_forward(layer, &a));
        CUDA_OK(cudaEventRecord(e1, s));
    }
    CUDA_OK(cudaEventSynchronize(e1));
    CUDA_OK(cudaEventElapsedTime(&ms, e0, e1));
    first = ms * 1e-3;
    n = (int)(o->seconds / (first > 1e-6 ? first : 1e-6));
    n = n < 20 ? 20 : (n > 1000 ? 1000 : n);
    /* every rank runs the same number of steps (a step is collective over the ranks) */
    MPI_Allreduce(MPI_IN_PLACE, &n, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    /* Back to back, an event between steps: the queue never drains, so each interval is the
     * GPU's time for one step (no host launch latency inside it). */
    t = malloc(sizeof(double) * (size_t)n);
    ev = malloc(sizeof(cudaEvent_t) * (size_t)(n + 1));
    for (i = 0; i <= n; i++)
        CUDA_OK(cudaEventCreate(&ev[i]));
    CUDA_OK(cudaEventRecord(ev[0], s));
    for (i = 0; i < n; i++) {
        if (p->graph)
            CUDA_OK(cudaGraphLaunch(exec, s));
        else
            MOE_OK(moe_layer_forward(layer, &a));
        CUDA_OK(cudaEventRecord(ev[i + 1], s));
    }
    CUDA_OK(cudaEventSynchronize(ev[n]));
    for (i = 0; i < n; i++) {
        CUDA_OK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
        t[i] = ms * 1e3;
    }
    for (i = 0; i <= n; i++)
        cudaEventDestroy(ev[i]);
    free(ev);
    /* One more step with the library's per-phase events (it synchronises; not timed above). */
    setenv("MOE_PROFILE", "1", 1);
    MOE_OK(moe_layer_forward(layer, &a));
    unsetenv("MOE_PROFILE");
    MOE_OK(moe_layer_get_stats(layer, &p->phases));
    qsort(t, (size_t)n, sizeof(double), cmp_double);
    p->iters = n;
    p->time_us = t[n / 2];
    p->min_us = t[0];
    p->flops = 2.0 * (double)a.num_tokens * c->top_k * 3.0 * c->hidden * c->intermediate;
    {
        /* fp8: 1 byte per weight (+ one f32 scale per row) at the FP8 tensor-core rate */
        const int f8 = c->weight_dtype == MOE_DTYPE_FP8_E4M3;
        const double wb = f8 ? 1.0 + 4.0 / c->hidden : 2.0;
        const double rate = f8 ? FP8_FLOPS_PER_S : BF16_FLOPS_PER_S;
        /* uniform routing: each expert is missed by a token with probability 1 - k/E */
        const double E = c->num_experts, k = c->top_k;
        const double touched = E * (1.0 - pow(1.0 - k / E, (double)a.num_tokens));
        p->bytes = (double)p->distinct * 3.0 * c->hidden * c->intermediate * wb;
        p->limit_us = fmax(p->bytes / HBM_BYTES_PER_S, p->flops / rate) * 1e6;
        p->limit_exp_us = fmax(touched * 3.0 * c->hidden * c->intermediate * wb / HBM_BYTES_PER_S,
                               p->flops / rate) *
                          1e6;
    }
    free(t);
    if (exec)
        cudaGraphExecDestroy(exec);
    if (graph)
        cudaGraphDestroy(graph);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
}

/* Into the file opened at start; nonzero if a write failed. */
static int write_json(const options_t *o, const char *gpu, double copy, double blas,
                      const point_t *p, int n)
{
    FILE *f = o->json_file;
    const moe_layer_config_t *c = &o->cfg;
    int i;
    fprintf(f,
            "{\"preset\": \"%s\", \"gpu\": \"%s\", \"experts\": %d, \"top_k\": %d, "
            "\"hidden\": %d, \"intermediate\": %d, \"copy_gbps\": %.1f, "
            "\"cublas_bf16_tflops\": %.1f, \"hbm_bytes_per_s\": %.3g, \"bf16_flops_per_s\": %.3g, "
            "\"points\": [",
            o->preset, gpu, c->num_experts, c->top_k, c->hidden, c->intermediate, copy, blas,
            HBM_BYTES_PER_S, BF16_FLOPS_PER_S);
    for (i = 0; i < n; i++)
        fprintf(f,
                "%s\n  {\"m\": %lld, \"distinct_experts\": %d, \"graph\": %d, \"iters\": %d, "
                "\"time_us\": %.2f, \"min_us\": %.2f, \"tflops\": %.2f, \"weight_gbps\": %.1f, "
                "\"limit_us\": %.2f, \"limit_expected_us\": %.2f, \"score\": %.3f, "
                "\"phases_us\": {\"route\": %.1f, "
                "\"permute\": %.1f, \"experts\": %.1f, \"shared\": %.1f, \"combine\": %.1f}}",
                i ? "," : "", (long long)p[i].m, p[i].distinct, p[i].graph, p[i].iters,
                p[i].time_us, p[i].min_us, p[i].flops / p[i].time_us / 1e6,
                p[i].bytes / p[i].time_us / 1e3, p[i].limit_us, p[i].limit_exp_us,
                p[i].limit_us / p[i].time_us, p[i].phases.route_us, p[i].phases.dispatch_us,
                p[i].phases.expert_us, p[i].phases.shared_us, p[i].phases.combine_us);
    fprintf(f, "\n]}\n");
    return (ferror(f) != 0) | (fclose(f) != 0);
}

int main(int argc, char **argv)
{
    options_t o;
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    moe_runtime_t *rt = NULL;
    moe_layer_t *layer = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    struct cudaDeviceProp prop;
    point_t pts[MAX_POINTS];
    cudaStream_t s;
    void *d_x, *d_y;
    int32_t *d_ids;
    uint16_t *hx;
    uint64_t st = 777;
    int64_t max_m = 0;
    double copy, blas, score_sum = 0;
    int i, dev = 0, rank = 0, bad;
    moe_layer_info_t info;
    time_t now = time(NULL);
    char date[32];

    MPI_Init(&argc, &argv);
    for (i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--dispatch-only")) {
            int rc2 = moe_dispatch_bench_main(argc, argv);
            MPI_Finalize();
            return rc2;
        }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    bad = !parse(argc, argv, &o) || (!o.help && !resolve(&o, rank));
    if (agree_options(&o, bad)) { /* a bad option, or ranks started with different ones */
        if (o.json_file)
            fclose(o.json_file);
        MPI_Finalize();
        return 2;
    }
    if (o.help) {
        if (rank == 0)
            usage();
        MPI_Finalize();
        return 0;
    }
    for (i = 0; i < o.num_tokens; i++)
        max_m = o.tokens[i] > max_m ? o.tokens[i] : max_m;
    o.cfg.max_tokens_per_rank = max_m;
    moe_gen_apply_fp8(&o.cfg, o.fp8, o.scales);
    rc.backend = MOE_BACKEND_CUDA;
    MOE_OK(moe_runtime_create_mpi(&rc, MPI_COMM_WORLD, &rt));
    CUDA_OK(cudaGetDevice(&dev));
    CUDA_OK(cudaGetDeviceProperties(&prop, dev));
    CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    MOE_OK(moe_layer_create(rt, &o.cfg, &layer));
    MOE_OK(moe_layer_get_info(layer, &info));
    MOE_OK(moe_gen_set_weights_fast(layer, &o.cfg));

    hx = malloc(2 * (size_t)(max_m * o.cfg.hidden));
    moe_gen_fill_bf16(hx, (size_t)(max_m * o.cfg.hidden), 1.0f, &st);
    CUDA_OK(cudaMalloc(&d_x, 2 * (size_t)(max_m * o.cfg.hidden)));
    CUDA_OK(cudaMalloc(&d_y, 2 * (size_t)(max_m * o.cfg.hidden)));
    CUDA_OK(cudaMalloc((void **)&d_ids, sizeof(int32_t) * (size_t)(max_m * o.cfg.top_k)));
    CUDA_OK(cudaMemcpy(d_x, hx, 2 * (size_t)(max_m * o.cfg.hidden), cudaMemcpyHostToDevice));
    free(hx);

    copy = copy_gbps(s);
    blas = cublas_tflops(s);
    strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", gmtime(&now));
    printf("# moe-bench %s: %s E%d k%d H%d I%d%s, %s weights, x/y bf16\n", date, o.preset,
           o.cfg.num_experts, o.cfg.top_k, o.cfg.hidden, o.cfg.intermediate,
           o.cfg.num_shared_experts ? " + shared" : "",
           !o.fp8                                      ? "bf16"
           : o.cfg.scale_kind == MOE_SCALE_PER_CHANNEL ? "fp8 e4m3 W8A8 per-channel"
                                                       : "fp8 e4m3 W8A8 per-tensor");
    printf("# GPU %d: %s, %d SMs; weights %.2f GB, workspace %.2f GB\n", dev, prop.name,
           prop.multiProcessorCount, info.weight_bytes / 1e9, info.workspace_bytes / 1e9);
    printf("# measured: device copy %.0f GB/s (read+write), cuBLAS bf16 8192^3 %.0f TFLOP/s\n",
           copy, blas);
    printf("# limit = max(touched expert bytes / %.1f TB/s, flops / %.0f TFLOP/s); "
           "score = limit / time\n",
           HBM_BYTES_PER_S / 1e12, (o.fp8 ? FP8_FLOPS_PER_S : BF16_FLOPS_PER_S) / 1e12);
    printf("# limit_exp = the same with the experts a uniform routing would touch, "
           "E (1 - (1 - k/E)^M)\n");
    printf("#\n# %8s %8s %6s %6s %10s %10s %9s %9s %10s %10s %7s\n", "tokens", "experts", "mode",
           "iters", "time(us)", "min(us)", "TFLOP/s", "GB/s", "limit(us)", "limit_exp", "score");
    a.dtype = MOE_DTYPE_BF16;
    a.x = d_x;
    a.y = d_y;
    a.stream = s;
    for (i = 0; i < o.num_tokens; i++) {
        point_t *p = &pts[i];
        a.num_tokens = o.tokens[i];
        run_point(layer, &o, a, d_ids, s, p);
        printf("  %8lld %8d %6s %6d %10.1f %10.1f %9.1f %9.0f %10.1f %10.1f %7.3f\n",
               (long long)p->m, p->distinct, p->graph ? "graph" : "stream", p->iters, p->time_us,
               p->min_us, p->flops / p->time_us / 1e6, p->bytes / p->time_us / 1e3, p->limit_us,
               p->limit_exp_us, p->limit_us / p->time_us);
        printf("  %8s phases (one profiled step, us): route %.1f  permute+gather %.1f  "
               "experts %.1f  shared %.1f  combine %.1f\n",
               "", p->phases.route_us, p->phases.dispatch_us, p->phases.expert_us,
               p->phases.shared_us, p->phases.combine_us);
        if (o.explain) {
            char why[2048]; /* the variants, their tables (tune file paths) and the transport */
            MOE_OK(moe_layer_explain(layer, p->m, why, sizeof(why)));
            printf("  %8s explain: %s\n", "", why);
        }
        fflush(stdout);
        score_sum += p->limit_us / p->time_us;
    }
    printf("# avg score: %.3f over %d token counts\n", score_sum / o.num_tokens, o.num_tokens);
    if (o.json_file && write_json(&o, prop.name, copy, blas, pts, o.num_tokens)) {
        fprintf(stderr, "moe-bench: --json %s: write failed\n", o.json);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    cudaFree(d_x), cudaFree(d_y), cudaFree(d_ids);
    cudaStreamDestroy(s);
    moe_layer_destroy(layer);
    moe_runtime_destroy(rt);
    MPI_Finalize();
    return 0;
}
