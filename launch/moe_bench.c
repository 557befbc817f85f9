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
#include <unistd.h>

#include "cli.h"
#include "dispatch_bench.h"
#include "eplb_bench.h"
#include "layer_gen.h"
#include "base/json.h"
#include "runtime/formats/file.h"
#include "runtime/layer.h"
#include "tool_check.h"
#include "moe/moe.h"
#include "moe/moe_mpi.h"
#include "moe_commit.h"

/* H200 datasheet figures the score is measured against. */
#define HBM_BYTES_PER_S 4.8e12
#define BF16_FLOPS_PER_S 989e12
#define FP8_FLOPS_PER_S 1979e12
#define MAX_POINTS 64
#define FIRST_CALL_COUNTS 20  /* --first-call's default: this many new token counts */
#define FIRST_CALL_REPEATS 7  /* steady steps per count after the first; their median */
#define FIRST_CALL_TARGET 1.1 /* first / steady at a new count, at most */
#define CREATE_TARGET 2.0     /* the first forward after create / steady, at most */
#define MAX_ROTATE 16         /* copies of the layer the table's steps rotate over, at most */

#define CUDA_OK(call) MOE_TOOL_CUDA_OK("moe-bench", call)
#define MOE_OK(call) MOE_TOOL_OK("moe-bench", call)

typedef struct point {
    int64_t m;
    int distinct, graph, iters;
    double time_us, min_us, flops, bytes, limit_us;
    double limit_exp_us;      /* the limit from the expected experts touched, E (1 - (1 - k/E)^M) */
    moe_layer_stats_t phases; /* one step run with MOE_PROFILE=1 */
    char explain[2048];       /* moe_layer_explain at m: what ran (kernel, variants, tables) */
} point_t;

typedef struct options {
    const char *preset, *json;
    moe_layer_config_t cfg;
    int64_t tokens[MAX_POINTS];
    int num_tokens;
    int tokens_given;     /* --tokens was given (--first-call: else a spread over the capacity) */
    int64_t capacity;     /* --capacity: max_tokens_per_rank (0: the largest count) */
    int64_t round_tokens; /* --round-tokens: ep_round_tokens (0: the library's default) */
    int64_t probe;        /* --first-call: the count of the first forward after create */
    int64_t graph_max;    /* graph-replay steps of at most this many tokens */
    double seconds;       /* time spent per point, roughly */
    int help;
    int explain;             /* --explain: per point, what the layer runs and why */
    int first_call;          /* --first-call: first step at new counts against the steady one */
    int fp8;                 /* --dtype fp8: W8A8 */
    int rotate;              /* --rotate: copies of the layer (0: enough to defeat the L2) */
    moe_scale_kind_t scales; /* --scales (fp8; default per-tensor) */
    int fast;                /* --accum fast: fp8_math W8A8_FAST */
    int act_static;          /* --act-scales static: static activation scales (fp8 tensor) */
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
           "                 [--accum promoted|fast] [--act-scales dynamic|static]\n"
           "                 [--capacity C] [--rotate R] [--round-tokens N]\n"
           "         (fp8: e4m3 weights and activations, W8A8, f32 accumulation; --accum fast:\n"
           "         W8A8_FAST, the tensor cores may sum a whole k; --act-scales\n"
           "         static: the activations quantised with each matrix's static scale (a\n"
           "         checkpoint's input_scale) instead of per token, --scales tensor only; "
           "--capacity:\n"
           "         the layer's max_tokens_per_rank, default the largest of --tokens; --rotate:\n"
           "         step i runs copy i %% R of the layer, each with its own weights, default\n"
           "         the fewest copies whose weights a step reads add up to 2 x L2, at most %d\n"
           "         and what fits in half the free memory; 1: one layer, as before. Backend:\n"
           "         MOE_BACKEND, else CUDA where a GPU is visible; on the CPU backend the\n"
           "         steps are eager, timed by the wall clock; --round-tokens: with EP, the\n"
           "         layer's ep_round_tokens, 0 the library's default)\n"
           "       mpirun -np N moe-bench --first-call [--capacity C] [--tokens LIST] [shape]\n"
           "         (every rank: the time of the first step at each of 20 token counts the\n"
           "         layer never ran, default odd counts spread over 1..C, C = 8192, over the\n"
           "         steady step at that count; and of the first forward after create. Eager\n"
           "         steps on any backend (MOE_BACKEND), wall clock to moe_layer_synchronize)\n"
           "       mpirun -np N moe-bench --eplb [--help]   expert placement (EPLB)\n"
           "       mpirun -np N moe-bench --dispatch-only [--max-tokens T] [--capacity C] "
           "[--told | --ask]\n"
           "                 [--round-tokens R]\n"
           "         (expert-parallel dispatch/combine next to NCCL all-to-all; --capacity: a\n"
           "         serving engine's max_tokens_per_rank for every point; --told: pass\n"
           "         max_tokens_across_ranks = the point's tokens; --ask: get it from\n"
           "         moe_runtime_max_tokens before each step; --round-tokens: the layers'\n"
           "         ep_round_tokens, 0 the library's default)\n"
           "presets: %s\n",
           MAX_ROTATE, moe_gen_preset_names());
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
    int64_t r;
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
        if (!strcmp(a, "--explain") || !strcmp(a, "--first-call")) { /* the flags */
            o->explain |= !strcmp(a, "--explain");
            o->first_call |= !strcmp(a, "--first-call");
            continue;
        }
        if (!v)
            return REJECT("%s needs a value (or is unknown: see --help)", a);
        i++;
        ok = moe_gen_shape_option(a, v, &o->cfg, &o->preset, o->err, sizeof(o->err));
        if (ok < 0)
            ok = moe_gen_fp8_option(a, v, &o->fp8, &o->scales, &o->fast, o->err, sizeof(o->err));
        if (ok >= 0) { /* a shape or arithmetic option (0: bad value, o->err says why) */
            if (!ok)
                return 0;
            continue;
        }
        ok = 1;
        if (!strcmp(a, "--tokens")) {
            ok = o->tokens_given = parse_tokens(v, o);
        } else if (!strcmp(a, "--capacity")) {
            ok = !moe_cli_int(a, v, 1, MAX_M, &o->capacity, o->err, sizeof(o->err));
        } else if (!strcmp(a, "--round-tokens")) {
            ok = !moe_cli_int(a, v, 0, MAX_M, &o->round_tokens, o->err, sizeof(o->err));
        } else if (!strcmp(a, "--rotate")) {
            ok = !moe_cli_int(a, v, 1, MAX_ROTATE, &r, o->err, sizeof(o->err));
            o->rotate = (int)r;
        } else if (!strcmp(a, "--graph-max")) {
            ok = !moe_cli_int(a, v, 0, MAX_M, &o->graph_max, o->err, sizeof(o->err));
        } else if (!strcmp(a, "--seconds")) {
            ok = !moe_cli_double(a, v, 1e-3, 3600.0, &o->seconds, o->err, sizeof(o->err));
        } else if (!strcmp(a, "--json")) {
            o->json = v;
        } else if (!strcmp(a, "--act-scales")) {
            if (strcmp(v, "dynamic") && strcmp(v, "static"))
                return REJECT("--act-scales %s: expected dynamic or static", v);
            o->act_static = !strcmp(v, "static");
        } else {
            return REJECT("unknown option %s (see --help)", a);
        }
        if (!ok)
            return 0;
    }
    return 1;
}

/* --first-call's default counts: FIRST_CALL_COUNTS odd counts spread geometrically over
 * 1..capacity (dense among the small batches of decoding, up to the largest odd count). */
static int spread_tokens(options_t *o)
{
    const int n = FIRST_CALL_COUNTS;
    const int64_t top = o->capacity - !(o->capacity & 1);
    int64_t m, prev = -1;
    int i;
    if (top < 2 * n - 1)
        return REJECT("--capacity %lld: --first-call's %d odd token counts need a capacity of at "
                      "least %d (or give --tokens)",
                      (long long)o->capacity, n, 2 * n - 1);
    for (i = 0; i < n; i++) {
        m = (int64_t)pow((double)top, (double)i / (n - 1)) | 1;
        m = m > prev ? m : prev + 2;
        m = m < top - 2 * (n - 1 - i) ? m : top - 2 * (n - 1 - i); /* room for the rest */
        o->tokens[i] = prev = m;
    }
    o->num_tokens = n;
    return 1;
}

/* Whether m is among the first n counts of t. */
static int listed(const int64_t *t, int n, int64_t m)
{
    int i;
    for (i = 0; i < n && t[i] != m; i++)
        ;
    return i < n;
}

/* --first-call: each count once, and a count outside them for the first forward after create
 * (64, else the largest free one below; a list of MAX_POINTS counts that holds all of 1..64
 * leaves 65 free). */
static int first_call_counts(options_t *o)
{
    int i;
    for (i = 1; i < o->num_tokens; i++)
        if (listed(o->tokens, i, o->tokens[i]))
            return REJECT("--tokens: %lld twice (--first-call times the first step at each count)",
                          (long long)o->tokens[i]);
    o->probe = o->capacity < 64 ? o->capacity : 64;
    while (o->probe > 0 && listed(o->tokens, o->num_tokens, o->probe))
        o->probe--;
    if (!o->probe && o->capacity > 64)
        o->probe = 65;
    if (!o->probe)
        return REJECT("--tokens lists every count in 1..%lld: --first-call needs one more for the "
                      "first forward after create",
                      (long long)o->capacity);
    return 1;
}

/* Local checks before any collective: the counts and the capacity, the buffers' sizes, and rank
 * 0's --json file. Then the layer's capacity and arithmetic into o->cfg. */
static int resolve(options_t *o, int rank)
{
    int64_t max_m = 0;
    int i, n = 0;
    if (o->first_call && !o->tokens_given) {
        o->capacity = o->capacity ? o->capacity : 8192;
        if (!spread_tokens(o))
            return 0;
    }
    for (i = 0; i < o->num_tokens; i++) /* the default counts up to --capacity */
        if (o->tokens_given || !o->capacity || o->tokens[i] <= o->capacity)
            o->tokens[n++] = o->tokens[i];
    o->num_tokens = n;
    for (i = 0; i < o->num_tokens; i++)
        max_m = o->tokens[i] > max_m ? o->tokens[i] : max_m;
    if (o->capacity && max_m > o->capacity)
        return REJECT("--tokens %lld is over --capacity %lld", (long long)max_m,
                      (long long)o->capacity);
    o->capacity = o->capacity ? o->capacity : max_m;
    if (o->first_call && !first_call_counts(o))
        return 0;
    /* x, y: capacity x hidden bf16; topk ids capacity x top_k; weights up to E x H x 2 bytes */
    if (o->capacity * o->cfg.hidden > (INT64_C(1) << 36))
        return REJECT("capacity %lld x --hidden %d: %lld values per buffer is too many",
                      (long long)o->capacity, o->cfg.hidden,
                      (long long)(o->capacity * o->cfg.hidden));
    if (o->json && rank == 0) {
        moe_status_t js;
        if (!(o->json_file = moe_open_regular_write(o->json, &js)))
            return REJECT("--json %s", moe_last_error());
    }
    o->cfg.max_tokens_per_rank = o->capacity;
    if (o->round_tokens > o->capacity)
        return REJECT("--round-tokens %lld is over the capacity %lld", (long long)o->round_tokens,
                      (long long)o->capacity);
    o->cfg.ep_round_tokens = o->round_tokens;
    if (!moe_gen_fp8_check(o->fp8, o->scales, o->fast, o->err, sizeof(o->err)))
        return 0;
    moe_gen_apply_fp8(&o->cfg, o->fp8, o->scales, o->fast);
    if (o->act_static && (!o->fp8 || o->cfg.scale_kind != MOE_SCALE_PER_TENSOR))
        return REJECT("--act-scales static: static activation scales need --dtype fp8 --scales "
                      "tensor (W8A8 on per-tensor weights)");
    return 1;
}

/* FNV-1a over the token counts, so a list enters one field. */
/* The options that shape the collectives, the same on every rank (cli.h). 0: go on. */
static int agree_options(const options_t *o, int bad)
{
    const uint64_t h = moe_cli_hash_list(MOE_CLI_HASH_SEED, o->tokens, o->num_tokens);
    const moe_cli_field_t f[] = {
        {"--help", o->help, 0},
        {"--explain", o->explain, 0},
        {"--first-call", o->first_call, 0},
        {"--experts", o->cfg.num_experts, 0},
        {"--top-k", o->cfg.top_k, 0},
        {"--hidden", o->cfg.hidden, 0},
        {"--intermediate", o->cfg.intermediate, 0},
        {"--preset", moe_cli_hash(o->preset), 1},
        {"--graph-max", o->graph_max, 0},
        {"--rotate", o->rotate, 0},
        {"--tokens", (int64_t)(h >> 1), 1},
        {"--capacity", o->capacity, 0}, /* after --tokens: its default is their largest */
        {"--dtype", o->fp8, 0},
        {"--scales", o->scales, 0},
        {"--accum", o->fast, 0},
        {"--act-scales", o->act_static, 0},
        {"--round-tokens", o->round_tokens, 0},
    };
    return moe_cli_agree("moe-bench", bad, o->err, f, (int)(sizeof(f) / sizeof(f[0])));
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

/* `bytes` where the backend's forward reads and writes them (device memory for CUDA, host
 * memory for the CPU backend), a copy of `src` unless it is NULL. */
static void *io_alloc(int cuda, size_t bytes, const void *src)
{
    void *p = NULL;
    if (cuda) {
        CUDA_OK(cudaMalloc(&p, bytes));
        if (src)
            CUDA_OK(cudaMemcpy(p, src, bytes, cudaMemcpyHostToDevice));
        return p;
    }
    if (!(p = malloc(bytes ? bytes : 1))) {
        fprintf(stderr, "moe-bench: out of host memory (%zu bytes)\n", bytes);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (src)
        memcpy(p, src, bytes);
    return p;
}

static void io_free(int cuda, void *p)
{
    if (cuda)
        cudaFree(p);
    else
        free(p);
}

/* The table's layers: copies of one config, each with its own weights (its own memory), so a
 * step that runs another copy than the step before reads its weights from HBM, not L2. */
typedef struct bench {
    int cuda;        /* CUDA backend; else the CPU backend (wall clock, eager steps) */
    cudaStream_t s;  /* CUDA: the steps' stream (NULL on the CPU backend) */
    double l2_bytes; /* the GPU's L2 (0: CPU backend) */
    int rotate;      /* step i runs layers[i % rotate] */
    moe_layer_t *layers[MAX_ROTATE];
    char why[320]; /* how rotate was chosen */
} bench_t;

/* Bytes of one expert weight as the limits count them: fp8 1 (+ one f32 scale per row), else 2
 * (bf16). */
static double weight_size(const moe_layer_config_t *c)
{
    return c->weight_dtype == MOE_DTYPE_FP8_E4M3 ? 1.0 + 4.0 / c->hidden : 2.0;
}

/* b->rotate and b->why: --rotate, else the fewest copies whose weights one step reads at least
 * (this rank's slice of the experts one token routes to, and of the shared MLP) add up to 2 x L2
 * (so each copy's weights are evicted before its next step), at most MAX_ROTATE and 1 + what
 * fits in half the device memory free after the first copy; 1 on the CPU backend. Collective:
 * the fewest over the ranks (the copies are created collectively). */
static void choose_rotate(bench_t *b, const options_t *o, const moe_layer_info_t *info)
{
    const moe_layer_config_t *c = &o->cfg;
    const int k = c->top_k < info->num_local_experts ? c->top_k : info->num_local_experts;
    const double rows = (double)k * (info->intermediate_end - info->intermediate_begin) +
                        (info->shared_end - info->shared_begin);
    const double step = fmin(3.0 * c->hidden * rows * weight_size(c), (double)info->weight_bytes);
    const double copy = info->weight_bytes > 0 ? (double)info->weight_bytes : 1.0;
    size_t free_b = 0, total_b = 0;
    int want, fit, mine;
    char *w = b->why;
    const size_t len = sizeof(b->why);

    if (o->rotate) {
        b->rotate = o->rotate;
        snprintf(w, len, "--rotate %d", o->rotate);
    } else if (b->l2_bytes <= 0) {
        b->rotate = 1;
        snprintf(w, len, "no GPU L2 (backend cpu)");
    } else {
        want = step >= 2.0 * b->l2_bytes ? 1 : (int)fmin(MAX_ROTATE, ceil(2 * b->l2_bytes / step));
        CUDA_OK(cudaMemGetInfo(&free_b, &total_b));
        fit = 1 + (int)fmin(MAX_ROTATE, 0.5 * (double)free_b / copy);
        b->rotate = want < fit ? want : fit;
        if (want == 1)
            snprintf(w, len, "a step reads >= %.1f MB of weights, >= 2 x L2 alone", step / 1e6);
        else if (b->rotate == want)
            snprintf(w, len, "a step reads >= %.1f MB of weights: %d copies %s 2 x L2", step / 1e6,
                     want, want * step >= 2 * b->l2_bytes ? ">=" : "(the most) <");
        else
            snprintf(w, len,
                     "a step reads >= %.1f MB of weights: %d copies wanted, %d fit%s in half the "
                     "free device memory (%.2f GB free, %.2f GB a copy)",
                     step / 1e6, want, fit, fit == 1 ? " (no second copy)" : "", free_b / 1e9,
                     copy / 1e9);
    }
    mine = b->rotate;
    MPI_Allreduce(MPI_IN_PLACE, &b->rotate, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (b->rotate < mine) /* o->rotate is the same on every rank: only a computed one differs */
        snprintf(w + strlen(w), len - strlen(w), "; %d: another rank's fewest", b->rotate);
}

/* Distinct experts hit by the step's actual routing (on the first copy). */
static int count_distinct(const bench_t *b, moe_forward_args_t a, int32_t *d_ids, int E, int k)
{
    const size_t n_ids = (size_t)(a.num_tokens * k);
    int32_t *ids = io_alloc(0, sizeof(int32_t) * n_ids, NULL);
    unsigned char *hit = calloc((size_t)E, 1);
    size_t i;
    int n = 0;
    a.topk_ids = d_ids;
    MOE_OK(moe_layer_forward(b->layers[0], &a));
    MOE_OK(moe_layer_synchronize(b->layers[0], a.stream));
    if (b->cuda)
        CUDA_OK(cudaMemcpy(ids, d_ids, sizeof(int32_t) * n_ids, cudaMemcpyDeviceToHost));
    else
        memcpy(ids, d_ids, sizeof(int32_t) * n_ids);
    for (i = 0; i < n_ids; i++)
        if (ids[i] >= 0 && ids[i] < E && !hit[ids[i]]) {
            hit[ids[i]] = 1;
            n++;
        }
    free(ids);
    free(hit);
    return n;
}

/* Step i: copy i % rotate, its graph (exec, graph mode) or an eager forward. */
static void step(const bench_t *b, const cudaGraphExec_t *exec, const moe_forward_args_t *a, int i)
{
    const int r = i % b->rotate;
    if (exec)
        CUDA_OK(cudaGraphLaunch(exec[r], b->s));
    else
        MOE_OK(moe_layer_forward(b->layers[r], a));
}

/* Steps first .. first + n - 1 back to back, each one's microseconds into t. CUDA: an event
 * between steps, so the queue never drains and each interval is the GPU's time for one step (no
 * host launch latency inside it). CPU backend: the wall clock between steps (its forward
 * returns when its work is done). */
static void time_steps(const bench_t *b, const cudaGraphExec_t *exec, const moe_forward_args_t *a,
                       int first, int n, double *t)
{
    cudaEvent_t *ev;
    double t0 = MPI_Wtime(), t1;
    float ms;
    int i;
    if (!b->cuda) {
        for (i = 0; i < n; i++) {
            step(b, exec, a, first + i);
            MOE_OK(moe_layer_synchronize(b->layers[(first + i) % b->rotate], NULL));
            t1 = MPI_Wtime();
            t[i] = (t1 - t0) * 1e6;
            t0 = t1;
        }
        return;
    }
    ev = io_alloc(0, sizeof(cudaEvent_t) * (size_t)(n + 1), NULL);
    for (i = 0; i <= n; i++)
        CUDA_OK(cudaEventCreate(&ev[i]));
    CUDA_OK(cudaEventRecord(ev[0], b->s));
    for (i = 0; i < n; i++) {
        step(b, exec, a, first + i);
        CUDA_OK(cudaEventRecord(ev[i + 1], b->s));
    }
    CUDA_OK(cudaEventSynchronize(ev[n]));
    for (i = 0; i < n; i++) {
        CUDA_OK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
        t[i] = ms * 1e3;
    }
    for (i = 0; i <= n; i++)
        cudaEventDestroy(ev[i]);
    free(ev);
}

static void run_point(const bench_t *b, const options_t *o, moe_forward_args_t a, int32_t *d_ids,
                      point_t *p)
{
    const moe_layer_config_t *c = &o->cfg;
    cudaGraph_t graph[MAX_ROTATE] = {NULL};
    cudaGraphExec_t exec[MAX_ROTATE] = {NULL};
    const int warm = b->rotate > 4 ? b->rotate : 4; /* every copy's graph launched once */
    double *t, tw[MAX_ROTATE > 4 ? MAX_ROTATE : 4], first;
    int i, n;

    p->m = a.num_tokens;
    p->distinct = count_distinct(b, a, d_ids, c->num_experts, c->top_k);
    /* every copy's first step at this count eager (as the first copy's above), before capture */
    for (i = 1; i < b->rotate; i++) {
        MOE_OK(moe_layer_forward(b->layers[i], &a));
        MOE_OK(moe_layer_synchronize(b->layers[i], a.stream));
    }
    p->graph = b->cuda && a.num_tokens <= o->graph_max;
    for (i = 0; p->graph && i < b->rotate; i++) {
        CUDA_OK(cudaStreamBeginCapture(b->s, cudaStreamCaptureModeThreadLocal));
        MOE_OK(moe_layer_forward(b->layers[i], &a));
        CUDA_OK(cudaStreamEndCapture(b->s, &graph[i]));
        CUDA_OK(cudaGraphInstantiate(&exec[i], graph[i], 0));
    }
    /* warm-up; its last step sizes the run */
    time_steps(b, p->graph ? exec : NULL, &a, 0, warm, tw);
    first = tw[warm - 1] * 1e-6;
    n = (int)(o->seconds / (first > 1e-6 ? first : 1e-6));
    n = n < 20 ? 20 : (n > 1000 ? 1000 : n);
    /* every rank runs the same number of steps (a step is collective over the ranks) */
    MPI_Allreduce(MPI_IN_PLACE, &n, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    t = io_alloc(0, sizeof(double) * (size_t)n, NULL);
    /* on from the warm-up's copies: no copy runs twice in a row */
    time_steps(b, p->graph ? exec : NULL, &a, warm, n, t);
    /* One more step with the library's per-phase events (it synchronises; not timed above). */
    setenv("MOE_PROFILE", "1", 1);
    MOE_OK(moe_layer_forward(b->layers[0], &a));
    unsetenv("MOE_PROFILE");
    MOE_OK(moe_layer_get_stats(b->layers[0], &p->phases));
    moe_cli_sort(t, n);
    p->iters = n;
    p->time_us = t[n / 2];
    p->min_us = t[0];
    p->flops = 2.0 * (double)a.num_tokens * c->top_k * 3.0 * c->hidden * c->intermediate;
    {
        /* fp8: at the FP8 tensor-core rate */
        const double wb = weight_size(c);
        const double rate =
            c->weight_dtype == MOE_DTYPE_FP8_E4M3 ? FP8_FLOPS_PER_S : BF16_FLOPS_PER_S;
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
    for (i = 0; i < b->rotate; i++) {
        if (exec[i])
            cudaGraphExecDestroy(exec[i]);
        if (graph[i])
            cudaGraphDestroy(graph[i]);
    }
}

/* The commit the tool was built from: MOE_BENCH_COMMIT in the environment (a build without
 * .git, as on a copied tree), else the one read at build time (moe_commit.h, "-dirty" when the
 * tree differed from it), else "unknown". */
static const char *bench_commit(void)
{
    const char *e = getenv("MOE_BENCH_COMMIT");
    if (e && *e)
        return e;
#ifdef MOE_GIT_COMMIT
    return MOE_GIT_COMMIT;
#else
    return "unknown";
#endif
}

/* The first len bytes of `text` as the characters of a JSON string (moe_json_escape_byte). */
static void json_chars(FILE *f, const char *text, size_t len)
{
    for (size_t i = 0; i < len; i++) {
        char e[7];
        moe_json_escape_byte((unsigned char)text[i], e);
        fputs(e, f);
    }
}

static void json_string_body(FILE *f, const char *text)
{
    json_chars(f, text, strlen(text));
}

static int env_name_cmp(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* A NAME=VALUE entry "env" records: MOE_*, but MOE_BENCH_COMMIT (the "commit" field). */
static int env_recorded(const char *entry)
{
    return !strncmp(entry, "MOE_", 4) && strncmp(entry, "MOE_BENCH_COMMIT=", 17);
}

/* "env": the recorded variables of the environment (env_recorded) in name order: the knobs and
 * forced choices a run had (MOE_FORCE_VARIANT, MOE_FUSED_DECODE, ...), which its numbers depend
 * on. Then ", ". */
static void json_env(FILE *f)
{
    size_t n = 0, i;
    for (char **e = environ; e && *e; e++)
        n += (size_t)env_recorded(*e);
    const char **v = n ? malloc(n * sizeof(*v)) : NULL;
    fputs("\"env\": {", f);
    if (v) {
        n = 0;
        for (char **e = environ; *e; e++)
            if (env_recorded(*e))
                v[n++] = *e;
        qsort(v, n, sizeof(*v), env_name_cmp);
        for (i = 0; i < n; i++) {
            const char *eq = strchr(v[i], '=');
            fputs(i ? ", \"" : "\"", f);
            json_chars(f, v[i], eq ? (size_t)(eq - v[i]) : strlen(v[i]));
            fputs("\": \"", f);
            json_string_body(f, eq ? eq + 1 : "");
            fputs("\"", f);
        }
        free(v);
    }
    fputs("}, ", f);
}

/* The JSON reports' opening: "{", when and from what, the MOE_* environment, and the layer's
 * shape and weight types, ending in ", ". */
static void json_shape(FILE *f, const options_t *o)
{
    const moe_layer_config_t *c = &o->cfg;
    const int fp8 = c->weight_dtype == MOE_DTYPE_FP8_E4M3;
    time_t now = time(NULL);
    char date[32];
    strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    fprintf(f,
            "{\"date\": \"%s\", \"commit\": \"%s\", \"preset\": \"%s\", \"experts\": %d, "
            "\"top_k\": %d, \"hidden\": %d, \"intermediate\": %d, \"dtype\": \"%s\", "
            "\"scales\": \"%s\", \"accum\": \"%s\", \"act_scales\": \"%s\", ",
            date, bench_commit(), o->preset, c->num_experts, c->top_k, c->hidden, c->intermediate,
            fp8 ? "fp8_e4m3" : "bf16",
            !fp8                                     ? "none"
            : c->scale_kind == MOE_SCALE_PER_CHANNEL ? "per_channel"
            : c->scale_kind == MOE_SCALE_BLOCK_128   ? "block_128"
                                                     : "per_tensor",
            !fp8                    ? "none"
            : moe_cfg_fast_accum(c) ? "fast"
                                    : "promoted",
            !fp8            ? "none"
            : o->act_static ? "static"
                            : "dynamic");
    json_env(f);
}

/* Into the file opened at start; nonzero if a write failed. */
static int write_json(const options_t *o, const bench_t *b, const char *gpu, double copy,
                      double blas, const point_t *p, int n)
{
    FILE *f = o->json_file;
    int i;
    json_shape(f, o);
    fprintf(f,
            "\"backend\": \"%s\", \"gpu\": \"%s\", \"l2_bytes\": %.0f, \"rotate\": %d, "
            "\"copy_gbps\": %.1f, \"cublas_bf16_tflops\": %.1f, \"hbm_bytes_per_s\": %.3g, "
            "\"bf16_flops_per_s\": %.3g, \"points\": [",
            b->cuda ? "cuda" : "cpu", gpu, b->l2_bytes, b->rotate, copy, blas, HBM_BYTES_PER_S,
            BF16_FLOPS_PER_S);
    for (i = 0; i < n; i++) {
        fprintf(f,
                "%s\n  {\"m\": %lld, \"distinct_experts\": %d, \"graph\": %d, \"iters\": %d, "
                "\"time_us\": %.2f, \"min_us\": %.2f, \"tflops\": %.2f, \"weight_gbps\": %.1f, "
                "\"limit_us\": %.2f, \"limit_expected_us\": %.2f, \"score\": %.3f, "
                "\"phases_us\": {\"route\": %.1f, "
                "\"permute\": %.1f, \"experts\": %.1f, \"shared\": %.1f, \"combine\": %.1f}, "
                "\"explain\": \"",
                i ? "," : "", (long long)p[i].m, p[i].distinct, p[i].graph, p[i].iters,
                p[i].time_us, p[i].min_us, p[i].flops / p[i].time_us / 1e6,
                p[i].bytes / p[i].time_us / 1e3, p[i].limit_us, p[i].limit_exp_us,
                p[i].limit_us / p[i].time_us, p[i].phases.route_us, p[i].phases.dispatch_us,
                p[i].phases.expert_us, p[i].phases.shared_us, p[i].phases.combine_us);
        json_string_body(f, p[i].explain);
        fprintf(f, "\"}");
    }
    fprintf(f, "\n]}\n");
    return (ferror(f) != 0) | (fclose(f) != 0);
}

/* The steps' input: capacity x hidden random bf16, where the backend reads it. */
static void *make_x(int cuda, const options_t *o)
{
    const size_t n = (size_t)(o->capacity * o->cfg.hidden);
    uint16_t *h = io_alloc(0, 2 * n, NULL);
    uint64_t st = 777;
    void *x;
    moe_gen_fill_bf16(h, n, 1.0f, &st);
    if (!cuda)
        return h;
    x = io_alloc(1, 2 * n, h);
    free(h);
    return x;
}

/* Collective: the layer of the options with weights (timing needs no real values) and its info.
 * The wall seconds of moe_layer_create and of setting the weights, from a barrier, into t[0],
 * t[1]. */
static moe_layer_t *make_layer(moe_runtime_t *rt, const options_t *o, moe_layer_info_t *info,
                               double t[2])
{
    moe_layer_t *layer = NULL;
    double t0;
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = MPI_Wtime();
    MOE_OK(moe_layer_create(rt, &o->cfg, &layer));
    t[0] = MPI_Wtime() - t0;
    MOE_OK(moe_layer_get_info(layer, info));
    t0 = MPI_Wtime();
    MOE_OK(moe_gen_set_weights_fast(layer, &o->cfg, o->act_static));
    t[1] = MPI_Wtime() - t0;
    return layer;
}

static void print_title(const options_t *o)
{
    const moe_layer_config_t *c = &o->cfg;
    time_t now = time(NULL);
    char date[32];
    strftime(date, sizeof(date), "%Y-%m-%d %H:%M UTC", gmtime(&now));
    printf("# moe-bench %s: %s E%d k%d H%d I%d%s, %s weights%s%s, x/y bf16\n", date, o->preset,
           c->num_experts, c->top_k, c->hidden, c->intermediate,
           c->num_shared_experts ? " + shared" : "",
           !o->fp8                                  ? "bf16"
           : c->scale_kind == MOE_SCALE_PER_CHANNEL ? "fp8 e4m3 W8A8 per-channel"
           : c->scale_kind == MOE_SCALE_BLOCK_128   ? "fp8 e4m3 W8A8 128x128-block"
                                                    : "fp8 e4m3 W8A8 per-tensor",
           moe_cfg_fast_accum(c)                             ? " (fast accumulation)"
           : c->fp8_math == MOE_FP8_MATH_W8A8_FAST && o->fp8 ? " (W8A8_FAST: promoted)"
                                                             : "",
           o->act_static ? " (static activation scales)" : "");
}

static void print_explain_line(const char *why)
{
    printf("  %8s explain: %s\n", "", why);
}

static void print_explain(const moe_layer_t *layer, int64_t m)
{
    char why[2048]; /* the variants, their tables (tune file paths) and the transport */
    MOE_OK(moe_layer_explain(layer, m, why, sizeof(why)));
    print_explain_line(why);
}

/* ---- --first-call ---------------------------------------------------------------------------
 * Per rank, `per` doubles: create and weights seconds, then (first, steady) seconds of the first
 * forward after create (at o->probe), then of each count. */
enum { FC_CREATE, FC_WEIGHTS, FC_PROBE, FC_COUNTS = FC_PROBE + 2 };

/* Collective: one step of m tokens after a barrier; wall seconds from the forward call until its
 * work has finished on this rank (eager: a CUDA graph would replay what the first call set up). */
static double timed_step(moe_layer_t *layer, moe_forward_args_t a, int64_t m)
{
    double t0;
    a.num_tokens = m;
    a.max_tokens_across_ranks = m; /* as a serving engine tells it: every rank runs m */
    MPI_Barrier(MPI_COMM_WORLD);
    t0 = MPI_Wtime();
    MOE_OK(moe_layer_forward(layer, &a));
    MOE_OK(moe_layer_synchronize(layer, a.stream));
    return MPI_Wtime() - t0;
}

/* The first step of m tokens on this layer into t[0], the median of the next
 * FIRST_CALL_REPEATS into t[1]. */
static void first_and_steady(moe_layer_t *layer, moe_forward_args_t a, int64_t m, double t[2])
{
    double s[FIRST_CALL_REPEATS];
    int i;
    t[0] = timed_step(layer, a, m);
    for (i = 0; i < FIRST_CALL_REPEATS; i++)
        s[i] = timed_step(layer, a, m);
    moe_cli_sort(s, FIRST_CALL_REPEATS);
    t[1] = s[FIRST_CALL_REPEATS / 2];
}

/* Every rank's all[r * per + i] (divided by all[r * per + i + 1] when ratio) times scale, into f
 * with fmt, sep between them. Returns the rank with the largest value. */
static int put_ranks(FILE *f, const char *fmt, const char *sep, const double *all, int world,
                     int per, int i, int ratio, double scale)
{
    int r, worst = 0;
    double v, max = -1.0;
    for (r = 0; r < world; r++) {
        const double *t = all + (size_t)r * per + i;
        v = scale * t[0] / (ratio ? t[1] : 1.0);
        fprintf(f, "%s", r ? sep : "");
        fprintf(f, fmt, v);
        if (v > max)
            max = v, worst = r;
    }
    return worst;
}

/* One step's numbers in JSON: its count, and per rank first and steady times and their ratio. */
static void json_step(FILE *f, const double *all, int world, int per, int i, int64_t m)
{
    fprintf(f, "{\"m\": %lld, \"first_us\": [", (long long)m);
    put_ranks(f, "%.1f", ", ", all, world, per, i, 0, 1e6);
    fprintf(f, "], \"steady_us\": [");
    put_ranks(f, "%.1f", ", ", all, world, per, i + 1, 0, 1e6);
    fprintf(f, "], \"ratio\": [");
    put_ranks(f, "%.3f", ", ", all, world, per, i, 1, 1.0);
    fprintf(f, "]}");
}

/* Into the file opened at start; nonzero if a write failed. */
static int first_call_json(const options_t *o, const char *backend, const double *all, int world,
                           int per, double max_ratio, double after_create)
{
    FILE *f = o->json_file;
    int i;
    json_shape(f, o);
    fprintf(f,
            "\"mode\": \"first-call\", \"backend\": \"%s\", \"ranks\": %d, \"capacity\": %lld, "
            "\"repeats\": %d, \"target_ratio\": %.2f, \"target_first_forward\": %.2f, "
            "\"max_ratio\": %.3f, \"first_forward_ratio_max\": %.3f,\n \"create_ms\": [",
            backend, world, (long long)o->capacity, FIRST_CALL_REPEATS, FIRST_CALL_TARGET,
            CREATE_TARGET, max_ratio, after_create);
    put_ranks(f, "%.3f", ", ", all, world, per, FC_CREATE, 0, 1e3);
    fprintf(f, "], \"weights_ms\": [");
    put_ranks(f, "%.3f", ", ", all, world, per, FC_WEIGHTS, 0, 1e3);
    fprintf(f, "],\n \"first_forward\": ");
    json_step(f, all, world, per, FC_PROBE, o->probe);
    fprintf(f, ",\n \"points\": [");
    for (i = 0; i < o->num_tokens; i++) {
        fprintf(f, "%s\n  ", i ? "," : "");
        json_step(f, all, world, per, FC_COUNTS + 2 * i, o->tokens[i]);
    }
    fprintf(f, "\n]}\n");
    return (ferror(f) != 0) | (fclose(f) != 0);
}

/* Rank 0: the table of every rank's numbers `all` (see FC_*) and the verdicts. */
static void first_call_report(const options_t *o, const moe_runtime_info_t *ri,
                              const moe_layer_t *layer, const double *all, int per)
{
    const int world = ri->world_size;
    const double *t;
    double max_ratio = 0, after_create, v;
    int i, r, at = 0, at_rank = 0;
    print_title(o);
    printf("# --first-call: backend %s, %d rank(s), capacity %lld tokens per rank; eager steps "
           "(no CUDA graph: a graph would hide the first-call cost), max_tokens_across_ranks = "
           "the step's tokens\n",
           moe_backend_name(ri->backend), world, (long long)o->capacity);
    printf("# time: wall clock from moe_layer_forward to moe_layer_synchronize, after a barrier; "
           "steady: median of the %d steps after the first; ratio = first / steady\n#\n"
           "# moe_layer_create (ms), per rank:",
           FIRST_CALL_REPEATS);
    put_ranks(stdout, " %.3f", "", all, world, per, FC_CREATE, 0, 1e3);
    printf("\n# weights set (ms), per rank:     ");
    put_ranks(stdout, " %.3f", "", all, world, per, FC_WEIGHTS, 0, 1e3);
    printf("\n# first forward after create (%lld tokens), ratio per rank:", (long long)o->probe);
    t = all + (size_t)per * put_ranks(stdout, " %.3f", "", all, world, per, FC_PROBE, 1, 1.0) +
        FC_PROBE;
    after_create = t[0] / t[1];
    printf("  (the max rank: %.1f / %.1f us)%s\n#\n# %8s", 1e6 * t[0], 1e6 * t[1],
           after_create > CREATE_TARGET ? "  OVER 2.0" : "", "tokens");
    for (r = 0; r < world; r++) {
        char name[16];
        snprintf(name, sizeof(name), "rank%d", r);
        printf(" %7s", name);
    }
    printf(" %7s %12s %12s  (times: the max rank's)\n", "max", "first(us)", "steady(us)");
    for (i = 0; i < o->num_tokens; i++) {
        printf("  %8lld", (long long)o->tokens[i]);
        r = put_ranks(stdout, " %7.3f", "", all, world, per, FC_COUNTS + 2 * i, 1, 1.0);
        t = all + (size_t)per * r + FC_COUNTS + 2 * i;
        v = t[0] / t[1];
        printf(" %7.3f %12.1f %12.1f%s\n", v, 1e6 * t[0], 1e6 * t[1],
               v > FIRST_CALL_TARGET ? "  OVER 1.1" : "");
        if (o->explain)
            print_explain(layer, o->tokens[i]);
        if (v > max_ratio)
            max_ratio = v, at = i, at_rank = r;
    }
    printf("# first call / steady: max %.3f (%lld tokens, rank %d) over %d new counts x %d "
           "rank(s), target <= %.1f: %s; first forward after create / steady: max %.3f, target "
           "<= %.1f: %s\n",
           max_ratio, (long long)o->tokens[at], at_rank, o->num_tokens, world, FIRST_CALL_TARGET,
           max_ratio > FIRST_CALL_TARGET ? "OVER" : "ok", after_create, CREATE_TARGET,
           after_create > CREATE_TARGET ? "OVER" : "ok");
    if (o->json_file && first_call_json(o, moe_backend_name(ri->backend), all, world, per,
                                        max_ratio, after_create)) {
        fprintf(stderr, "moe-bench: --json %s: write failed\n", o->json);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
}

/* --first-call (see usage()): every rank runs the same steps in lockstep (they are collective)
 * and times its own; rank 0 gathers and prints. The backend is the runtime's AUTO choice
 * (MOE_BACKEND, else CUDA where a GPU is visible). */
static void first_call(const options_t *o, int rank)
{
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    moe_runtime_t *rt = NULL;
    moe_runtime_info_t ri;
    moe_layer_info_t info;
    moe_layer_t *layer;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    cudaStream_t s = NULL;
    const int per = FC_COUNTS + 2 * o->num_tokens;
    const size_t y_bytes = 2 * (size_t)(o->capacity * o->cfg.hidden);
    double t[FC_COUNTS + 2 * MAX_POINTS], *all = NULL;
    int i, cuda;

    MOE_OK(moe_runtime_create_mpi(&rc, MPI_COMM_WORLD, &rt));
    MOE_OK(moe_runtime_get_info(rt, &ri));
    cuda = ri.backend == MOE_BACKEND_CUDA;
    if (cuda)
        CUDA_OK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    layer = make_layer(rt, o, &info, t);
    a.dtype = MOE_DTYPE_BF16;
    a.x = make_x(cuda, o);
    a.y = io_alloc(cuda, y_bytes, NULL);
    a.stream = s;
    first_and_steady(layer, a, o->probe, t + FC_PROBE);
    for (i = 0; i < o->num_tokens; i++)
        first_and_steady(layer, a, o->tokens[i], t + FC_COUNTS + 2 * i);
    if (rank == 0)
        all = io_alloc(0, sizeof(double) * (size_t)per * (size_t)ri.world_size, NULL);
    MPI_Gather(t, per, MPI_DOUBLE, all, per, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (rank == 0)
        first_call_report(o, &ri, layer, all, per);
    free(all);
    io_free(cuda, (void *)a.x);
    io_free(cuda, a.y);
    if (cuda)
        cudaStreamDestroy(s);
    moe_layer_destroy(layer);
    moe_runtime_destroy(rt);
}

/* The table (see usage()): per token count, the step's time against the limit. The backend is
 * the runtime's AUTO choice (MOE_BACKEND, else CUDA where a GPU is visible); the CPU backend
 * runs eager steps timed by the wall clock, with no reference rates. */
static void table(const options_t *o)
{
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    moe_runtime_t *rt = NULL;
    moe_runtime_info_t ri;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    moe_layer_info_t info, info_i;
    struct cudaDeviceProp prop;
    point_t pts[MAX_POINTS];
    bench_t b;
    int32_t *d_ids;
    double copy = 0, blas = 0, score_sum = 0, t[2];
    int i, dev = 0, l2 = 0;

    memset(&b, 0, sizeof(b));
    MOE_OK(moe_runtime_create_mpi(&rc, MPI_COMM_WORLD, &rt));
    MOE_OK(moe_runtime_get_info(rt, &ri));
    b.cuda = ri.backend == MOE_BACKEND_CUDA;
    if (b.cuda) {
        CUDA_OK(cudaGetDevice(&dev));
        CUDA_OK(cudaGetDeviceProperties(&prop, dev));
        CUDA_OK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev));
        CUDA_OK(cudaStreamCreateWithFlags(&b.s, cudaStreamNonBlocking));
        b.l2_bytes = l2;
    }
    b.layers[0] = make_layer(rt, o, &info, t);
    a.dtype = MOE_DTYPE_BF16;
    a.x = make_x(b.cuda, o);
    a.y = io_alloc(b.cuda, 2 * (size_t)(o->capacity * o->cfg.hidden), NULL);
    a.stream = b.s;
    d_ids = io_alloc(b.cuda, sizeof(int32_t) * (size_t)(o->capacity * o->cfg.top_k), NULL);
    if (b.cuda) {
        copy = copy_gbps(b.s);
        blas = cublas_tflops(b.s);
    }
    choose_rotate(&b, o, &info); /* after the reference rates: their buffers are freed */
    for (i = 1; i < b.rotate; i++)
        b.layers[i] = make_layer(rt, o, &info_i, t);

    print_title(o);
    if (b.cuda) {
        printf("# GPU %d: %s, %d SMs; weights %.2f GB, workspace %.2f GB", dev, prop.name,
               prop.multiProcessorCount, info.weight_bytes / 1e9, info.workspace_bytes / 1e9);
        if (info.ep_round_tokens < o->capacity)
            printf("; EP rounds of %lld tokens/rank", (long long)info.ep_round_tokens);
        printf("\n");
        printf("# measured: device copy %.0f GB/s (read+write), cuBLAS bf16 8192^3 %.0f "
               "TFLOP/s\n",
               copy, blas);
    } else {
        printf("# backend %s, %d rank(s): eager steps, wall clock each; weights %.2f GB\n",
               moe_backend_name(ri.backend), ri.world_size, info.weight_bytes / 1e9);
    }
    printf("# weights rotated over %d cop%s (L2 %.1f MB): %s\n", b.rotate,
           b.rotate > 1 ? "ies" : "y", b.l2_bytes / 1e6, b.why);
    printf("# limit = max(touched expert bytes / %.1f TB/s, flops / %.0f TFLOP/s); "
           "score = limit / time\n",
           HBM_BYTES_PER_S / 1e12, (o->fp8 ? FP8_FLOPS_PER_S : BF16_FLOPS_PER_S) / 1e12);
    printf("# limit_exp = the same with the experts a uniform routing would touch, "
           "E (1 - (1 - k/E)^M)\n");
    printf("#\n# %8s %8s %6s %6s %10s %10s %9s %9s %10s %10s %7s\n", "tokens", "experts", "mode",
           "iters", "time(us)", "min(us)", "TFLOP/s", "GB/s", "limit(us)", "limit_exp", "score");
    for (i = 0; i < o->num_tokens; i++) {
        point_t *p = &pts[i];
        a.num_tokens = o->tokens[i];
        run_point(&b, o, a, d_ids, p);
        MOE_OK(moe_layer_explain(b.layers[0], p->m, p->explain, sizeof(p->explain)));
        printf("  %8lld %8d %6s %6d %10.1f %10.1f %9.1f %9.0f %10.1f %10.1f %7.3f\n",
               (long long)p->m, p->distinct,
               p->graph ? "graph"
               : b.cuda ? "stream"
                        : "eager",
               p->iters, p->time_us, p->min_us, p->flops / p->time_us / 1e6,
               p->bytes / p->time_us / 1e3, p->limit_us, p->limit_exp_us, p->limit_us / p->time_us);
        printf("  %8s phases (one profiled step, us): route %.1f  permute+gather %.1f  "
               "experts %.1f  shared %.1f  combine %.1f\n",
               "", p->phases.route_us, p->phases.dispatch_us, p->phases.expert_us,
               p->phases.shared_us, p->phases.combine_us);
        if (o->explain)
            print_explain_line(p->explain);
        fflush(stdout);
        score_sum += p->limit_us / p->time_us;
    }
    printf("# avg score: %.3f over %d token counts\n", score_sum / o->num_tokens, o->num_tokens);
    if (o->json_file &&
        write_json(o, &b, b.cuda ? prop.name : "none", copy, blas, pts, o->num_tokens)) {
        fprintf(stderr, "moe-bench: --json %s: write failed\n", o->json);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    io_free(b.cuda, (void *)a.x);
    io_free(b.cuda, a.y);
    io_free(b.cuda, d_ids);
    if (b.cuda)
        cudaStreamDestroy(b.s);
    for (i = 0; i < b.rotate; i++)
        moe_layer_destroy(b.layers[i]);
    moe_runtime_destroy(rt);
}

int main(int argc, char **argv)
{
    options_t o;
    int i, rank = 0, bad;

    MPI_Init(&argc, &argv);
    for (i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--dispatch-only")) {
            int rc2 = moe_dispatch_bench_main(argc, argv);
            MPI_Finalize();
            return rc2;
        } else if (!strcmp(argv[i], "--eplb")) {
            int rc2 = moe_eplb_bench_main(argc, argv);
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
    if (o.first_call)
        first_call(&o, rank);
    else
        table(&o);
    MPI_Finalize();
    return 0;
}
