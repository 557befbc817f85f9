/* SPDX-License-Identifier: Apache-2.0 */
/* moe-run: the main job. Builds one MoE layer (preset, explicit sizes or a checkpoint), runs a
 * global batch of tokens split over the MPI ranks, prints per-phase timing, tokens/s, the
 * rank map, per-expert load and an output checksum (rank 0, stdout; --json FILE too). */
#include <errno.h>
#include <math.h>
#include <mpi.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli.h"
#include "layer_gen.h"
#include "base/numeric.h"
#include "runtime/formats/file.h"
#include "moe/moe.h"
#include "moe/moe_mpi.h"
#ifdef MOE_RUN_HAVE_MODEL
#include "moe/moe_checkpoint.h"
#include "run_model.h"
#endif
#ifdef MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

enum { NUM_SHAPE = 8 };

typedef struct opts {
    const char *preset, *json, *dispatch, *backend, *dtype, *scoring;
    const char *model, *input, *output;
    const char *fp8_math_name; /* --fp8-math */
    const char *x_dtype_name;  /* --x-dtype */
    moe_dtype_t x_dtype;       /* x and y of the forward: F32 (default) or BF16 */
    moe_fp8_math_t fp8_math;
    const char *synthetic; /* the first option that shapes a synthetic layer (not --model's) */
    int layer_index;
    int num_layers; /* --layers: layers created and run in turn (memory per rank reported) */
    moe_layer_config_t cfg;
    moe_dtype_t dtype_kind; /* --dtype (synthetic layers; with --model: converted at load) */
    moe_scale_kind_t dtype_scale;
    int64_t tokens;
    int64_t round_tokens; /* --round-tokens: ep_round_tokens (0: the library's default) */
    uint64_t seed;
    int iters, warmup, bind, ep, tp, deterministic, quiet, help;
    int redundant;    /* --redundant-experts R */
    int eplb;         /* --eplb: rebalance once after the warm-up steps */
    double skew;      /* --route-skew S: Zipf router logits (0: the layer's router) */
    int tokens_given; /* --tokens on the command line (else --input's row count) */
    int dtype_given;  /* --dtype on the command line */
    FILE *json_file;  /* rank 0: --json, opened before the run so a bad path fails first */
    int64_t model_id, input_id; /* what --model and --input hold (moe_cli_path_identity) */
    int shape[NUM_SHAPE];       /* --experts ... --topk-group (shape_opt) */
    unsigned shape_set;         /* which of them were given */
    int preset_given;
    moe_backend_t backend_kind;
    char err[512]; /* why this rank rejected its options */
} opts_t;

#define MAX_LAYERS 1024

static int rank_g = 0;
static moe_runtime_t *rt_g;
static moe_layer_t *layers_g[MAX_LAYERS];
static int num_layers_g;

static void destroy_layers(void)
{
    while (num_layers_g > 0)
        moe_layer_destroy(layers_g[--num_layers_g]);
}

/* For failures of this rank alone after the ranks agreed on the options: the others may be in
 * (or on their way to) a collective this rank never joins, so only MPI_Abort ends the job
 * promptly. The library itself never aborts; the tool does (docs/RELIABILITY.md). */
#define DIE(...)                                                                                   \
    do {                                                                                           \
        fprintf(stderr, "moe-run: rank %d: ", rank_g);                                             \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fprintf(stderr, "\n");                                                                     \
        MPI_Abort(MPI_COMM_WORLD, 2);                                                              \
    } while (0)

static void sleep_ms(int64_t ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR)
        ;
}

/* How long a rank that saw a peer fail waits before it ends the job: the runtime's timeout
 * and 2 s (the others' waits end by then, even on a loaded host), at most 15 s. */
static int64_t abort_grace_ms(void)
{
    const char *v = getenv("MOE_TIMEOUT_MS");
    long long t = v && *v ? strtoll(v, NULL, 10) : 300000;
    t = t > 0 ? t + 2000 : 2000;
    return t > 15000 ? 15000 : t;
}

/* A failed libmoe call. `agreed`: a collective call whose verdict every rank shares (a bad
 * config, a peer's error), after which every rank can leave cleanly. Anything else, and any
 * status that leaves a collective pending (timeout, dead peer, broken object), ends the job
 * with MPI_Abort: MPI_Finalize would wait for, or crash on, the pending requests. */
static void fail(moe_status_t s, const char *call, int agreed)
{
    int fatal = s == MOE_STATUS_TIMEOUT || s == MOE_STATUS_MPI_ERROR ||
                s == MOE_STATUS_NCCL_ERROR || s == MOE_STATUS_CUDA_ERROR ||
                s == MOE_STATUS_INVALID_STATE || s == MOE_STATUS_INTERNAL_ERROR;
    fprintf(stderr, "moe-run: rank %d: %s: %s (%s)\n", rank_g, call, moe_status_string(s),
            moe_last_error());
    fflush(stderr);
    if (fatal) {
        /* A peer failed or stopped: the other survivors are in the same wait and reach their
         * own deadline about now. Tear down (as a serving process would: bounded, no peer
         * needed), then give them a grace period to print their own status before MPI_Abort
         * ends the job, including a stopped rank (docs/RELIABILITY.md, "Every survivor
         * reports"). */
        destroy_layers();
        moe_runtime_destroy(rt_g);
        sleep_ms(abort_grace_ms());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (!agreed)
        MPI_Abort(MPI_COMM_WORLD, 1);
    destroy_layers();
    moe_runtime_destroy(rt_g);
    MPI_Finalize();
    exit(1);
}

/* CHECK: a call of this rank alone. CHECK_ALL: a collective call with one verdict for all. */
#define CHECK(call)                                                                                \
    do {                                                                                           \
        moe_status_t s_ = (call);                                                                  \
        if (s_ != MOE_STATUS_SUCCESS)                                                              \
            fail(s_, #call, 0);                                                                    \
    } while (0)
#define CHECK_ALL(call)                                                                            \
    do {                                                                                           \
        moe_status_t s_ = (call);                                                                  \
        if (s_ != MOE_STATUS_SUCCESS)                                                              \
            fail(s_, #call, 1);                                                                    \
    } while (0)

static void usage(void)
{
    printf("usage: moe-run [options]   (under mpirun -np N for N ranks)\n"
           "  --preset NAME        %s (default tiny)\n"
           "  --experts E --top-k K --hidden H --intermediate I   explicit sizes\n"
           "  --shared N --shared-intermediate S --scoring softmax|sigmoid\n"
           "  --n-group G --topk-group G --dtype f32|bf16|fp8 (fp8: 128x128 block scales)\n"
           "  --tokens N           global batch, split over the ranks (default 64, or the\n"
           "                       rows of --input's hidden_states)\n"
           "  --seed S             weights and tokens (default 1)\n"
           "  --ep N --tp N        parallel layout (default: EP over all ranks)\n"
           "  --dispatch auto|all-to-all|all-gather   --deterministic\n"
           "  --round-tokens N     CUDA EP: tokens per rank of one round (ep_round_tokens; 0,\n"
           "                       the default: the library's, about the batch / ranks)\n"
           "  --backend auto|cpu|cuda   --bind (hwloc)   --iters N --warmup N\n"
           "  --model DIR --layer N [--input FILE] [--output FILE]   a checkpoint's layer\n"
           "                       (its sizes come from DIR: no --preset/--experts/... with it;\n"
           "                       --dtype f32|bf16 converts its weights at load)\n"
           "  --x-dtype f32|bf16   the tokens' dtype in and out of the layer (default f32;\n"
           "                       bf16 is what serving engines pass)\n"
           "  --fp8-math w8a16|w8a8|w8a8-fast   FP8 layers' arithmetic (default: the\n"
           "                       backend's, W8A16 today; w8a8: CPU, and CUDA on sm_90;\n"
           "                       w8a8-fast: W8A8 whose sums a GPU need not promote)\n"
           "  --layers N           N layers (a model's worth), run in turn each step; reports\n"
           "                       the memory per rank (weights + the one shared workspace)\n"
           "  --redundant-experts R   R redundant expert slots (EPLB; a multiple of the EP\n"
           "                       size; default 0)\n"
           "  --eplb               rebalance the experts over the ranks once, after the warm-up\n"
           "                       steps, from their load; prints the rank load imbalance\n"
           "                       before and after\n"
           "  --route-skew S       router logits so expert e's popularity follows (e+1)^-S\n"
           "                       (Zipf; expert 0 the hottest); 0 (default): the layer's router\n"
           "  --json FILE          also write the results as JSON\n"
           "Every rank must get the same options (checked before the first collective).\n",
           moe_gen_preset_names());
}

/* Largest global batch: its values (tokens x hidden) are gathered into one MPI buffer. */
#define MAX_TOKENS ((int64_t)INT32_MAX)
#define MAX_DIM (INT64_C(1) << 20) /* hidden, intermediate: far above any model's */

#define REJECT(...) (snprintf(o->err, sizeof(o->err), __VA_ARGS__), -1)

/* An integer option into an int or int64 field; -1 with o->err on a bad value. */
static int int_opt(opts_t *o, const char *a, const char *v, int64_t lo, int64_t hi, int64_t *out)
{
    return moe_cli_int(a, v, lo, hi, out, o->err, sizeof(o->err));
}

static int int_field(opts_t *o, const char *a, const char *v, int64_t lo, int64_t hi, int *out)
{
    int64_t x;
    if (int_opt(o, a, v, lo, hi, &x))
        return -1;
    *out = (int)x;
    return 0;
}

/* Options that shape the synthetic layer: the int field each sets and its bounds (the library
 * checks the combinations). The bounds keep every value inside an int, so nothing wraps. */
static const struct shape_opt {
    const char *name;
    size_t off;
    int64_t lo, hi;
} shape[NUM_SHAPE] = {
    {"--experts", offsetof(moe_layer_config_t, num_experts), 1, 65536},
    {"--top-k", offsetof(moe_layer_config_t, top_k), 1, 64},
    {"--hidden", offsetof(moe_layer_config_t, hidden), 1, MAX_DIM},
    {"--intermediate", offsetof(moe_layer_config_t, intermediate), 1, MAX_DIM},
    {"--shared", offsetof(moe_layer_config_t, num_shared_experts), 0, 65536},
    {"--shared-intermediate", offsetof(moe_layer_config_t, shared_intermediate), 0, MAX_DIM},
    {"--n-group", offsetof(moe_layer_config_t, n_group), 0, 65536},
    {"--topk-group", offsetof(moe_layer_config_t, topk_group), 0, 65536},
};

/* A shape option's value into o->shape; *handled = 0 if `a` is not one. */
static int shape_opt(opts_t *o, const char *a, const char *v, int *handled)
{
    int i;
    for (i = 0; i < NUM_SHAPE; i++) {
        if (strcmp(a, shape[i].name))
            continue;
        *handled = 1;
        if (!o->synthetic)
            o->synthetic = shape[i].name;
        o->shape_set |= 1u << i;
        return int_field(o, a, v, shape[i].lo, shape[i].hi, &o->shape[i]);
    }
    *handled = 0;
    return 0;
}

/* The synthetic layer: the preset (when named, or when no size is given), then the sizes. */
static int synthetic_config(opts_t *o)
{
    int i;
    if ((o->preset_given || !(o->shape_set & 0xfu)) && !moe_gen_preset(o->preset, &o->cfg))
        return REJECT("--preset %s: unknown (known: %s)", o->preset, moe_gen_preset_names());
    for (i = 0; i < NUM_SHAPE; i++)
        if (o->shape_set & (1u << i))
            *(int *)((char *)&o->cfg + shape[i].off) = o->shape[i];
    return 0;
}

static void opts_init(opts_t *o)
{
    moe_layer_config_t dflt = MOE_LAYER_CONFIG_INIT;
    memset(o, 0, sizeof(*o));
    o->cfg = dflt;
    o->preset = "tiny";
    o->tokens = 64;
    o->seed = 1;
    o->iters = 5;
    o->warmup = 1;
    o->layer_index = -1;
}

/* One option (and its value); -1 with o->err on a bad one. *used: 1 if the value was taken. */
static int parse_one(opts_t *o, const char *a, const char *v, int *used)
{
    int64_t x;
    int handled;

    *used = 0;
    if (!strcmp(a, "--deterministic"))
        return o->deterministic = 1, 0;
    if (!strcmp(a, "--bind"))
        return o->bind = 1, 0;
    if (!strcmp(a, "--quiet"))
        return o->quiet = 1, 0;
    if (!strcmp(a, "--eplb"))
        return o->eplb = 1, 0;
    if (strncmp(a, "--", 2))
        return REJECT("unexpected argument %s (see --help)", a);
    if (!v)
        return REJECT("%s needs a value (or is unknown: see --help)", a);
    *used = 1;
    if (shape_opt(o, a, v, &handled))
        return -1;
    if (handled)
        return 0;
    if (!strcmp(a, "--preset")) {
        o->preset = v;
        o->preset_given = 1;
        if (!o->synthetic)
            o->synthetic = "--preset";
    } else if (!strcmp(a, "--scoring")) {
        o->scoring = v;
        if (!o->synthetic)
            o->synthetic = "--scoring";
    } else if (!strcmp(a, "--dtype")) {
        o->dtype = v;
    } else if (!strcmp(a, "--fp8-math")) {
        o->fp8_math_name = v;
    } else if (!strcmp(a, "--x-dtype")) {
        o->x_dtype_name = v;
    } else if (!strcmp(a, "--layers")) {
        return int_field(o, a, v, 1, MAX_LAYERS, &o->num_layers);
    } else if (!strcmp(a, "--tokens")) {
        if (int_opt(o, a, v, 0, MAX_TOKENS, &o->tokens))
            return -1;
        o->tokens_given = 1;
    } else if (!strcmp(a, "--redundant-experts")) {
        return int_field(o, a, v, 0, 65536, &o->redundant);
    } else if (!strcmp(a, "--route-skew")) {
        return moe_cli_double(a, v, 0.0, 16.0, &o->skew, o->err, sizeof(o->err));
    } else if (!strcmp(a, "--round-tokens")) {
        return int_opt(o, a, v, 0, MAX_TOKENS, &o->round_tokens);
    } else if (!strcmp(a, "--seed")) {
        if (int_opt(o, a, v, 0, INT64_MAX, &x))
            return -1;
        o->seed = (uint64_t)x;
    } else if (!strcmp(a, "--ep")) {
        return int_field(o, a, v, 0, 65536, &o->ep);
    } else if (!strcmp(a, "--tp")) {
        return int_field(o, a, v, 0, 65536, &o->tp);
    } else if (!strcmp(a, "--iters")) {
        return int_field(o, a, v, 1, 1000000, &o->iters);
    } else if (!strcmp(a, "--warmup")) {
        return int_field(o, a, v, 0, 1000000, &o->warmup);
    } else if (!strcmp(a, "--layer")) {
        return int_field(o, a, v, 0, 1000000, &o->layer_index);
    } else if (!strcmp(a, "--dispatch")) {
        o->dispatch = v;
    } else if (!strcmp(a, "--backend")) {
        o->backend = v;
    } else if (!strcmp(a, "--json")) {
        o->json = v;
    } else if (!strcmp(a, "--model")) {
        o->model = v;
    } else if (!strcmp(a, "--input")) {
        o->input = v;
    } else if (!strcmp(a, "--output")) {
        o->output = v;
    } else {
        return REJECT("unknown option %s (see --help)", a);
    }
    return 0;
}

/* --dispatch and --backend into the config; -1 with o->err on an unknown name. */
static int modes(opts_t *o)
{
    const char *d = o->dispatch ? o->dispatch : "auto", *b = o->backend ? o->backend : "auto";
    if (!strcmp(d, "auto"))
        o->cfg.dispatch = MOE_DISPATCH_AUTO;
    else if (!strcmp(d, "all-to-all") || !strcmp(d, "a2a"))
        o->cfg.dispatch = MOE_DISPATCH_ALL_TO_ALL;
    else if (!strcmp(d, "all-gather") || !strcmp(d, "ag"))
        o->cfg.dispatch = MOE_DISPATCH_ALL_GATHER;
    else
        return REJECT("--dispatch %s: expected auto, all-to-all or all-gather", d);
    if (!strcmp(b, "auto"))
        o->backend_kind = MOE_BACKEND_AUTO;
    else if (!strcmp(b, "cpu"))
        o->backend_kind = MOE_BACKEND_CPU;
    else if (!strcmp(b, "cuda"))
        o->backend_kind = MOE_BACKEND_CUDA;
    else
        return REJECT("--backend %s: expected auto, cpu or cuda", b);
    return 0;
}

/* The command line into *o; -1 with o->err on the first bad option or combination. */
static int parse(int argc, char **argv, opts_t *o)
{
    const char *dtype;
    int i, used;

    opts_init(o);
    o->num_layers = 1;
    for (i = 1; i < argc; i++)
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help"))
            return o->help = 1, 0;
    for (i = 1; i < argc; i++) {
        if (parse_one(o, argv[i], i + 1 < argc ? argv[i + 1] : NULL, &used))
            return -1;
        i += used;
    }
    o->dtype_given = o->dtype != NULL;
    if (o->model && o->synthetic)
        return REJECT("%s with --model: the layer's shape comes from --model %s (its "
                      "config.json); drop %s",
                      o->synthetic, o->model, o->synthetic);
    if (o->layer_index >= 0 && !o->model)
        return REJECT("--layer %d needs --model DIR (without --model the layer is synthetic: "
                      "--preset or --experts ...)",
                      o->layer_index);
    if (o->model && o->layer_index < 0)
        return REJECT("--model needs --layer N");
    if (!o->model && synthetic_config(o))
        return -1;
    if (o->scoring && !strcmp(o->scoring, "sigmoid"))
        o->cfg.scoring = MOE_SCORING_SIGMOID;
    else if (o->scoring && strcmp(o->scoring, "softmax"))
        return REJECT("--scoring %s: expected softmax or sigmoid", o->scoring);
    dtype = o->dtype ? o->dtype : "bf16";
    o->dtype_scale = MOE_SCALE_NONE;
    if (!strcmp(dtype, "f32"))
        o->dtype_kind = MOE_DTYPE_F32;
    else if (!strcmp(dtype, "bf16"))
        o->dtype_kind = MOE_DTYPE_BF16;
    else if (!strcmp(dtype, "fp8"))
        o->dtype_kind = MOE_DTYPE_FP8_E4M3, o->dtype_scale = MOE_SCALE_BLOCK_128;
    else
        return REJECT("--dtype %s: expected f32, bf16 or fp8", dtype);
    if (o->model && o->dtype && o->dtype_kind == MOE_DTYPE_FP8_E4M3)
        return REJECT("--dtype fp8 with --model: a checkpoint's weights convert to f32 or bf16 "
                      "(an FP8 checkpoint loads as FP8 without --dtype)");
    if (!o->model) {
        o->cfg.weight_dtype = o->dtype_kind;
        o->cfg.scale_kind = o->dtype_scale;
    }
    o->dtype = dtype;
    if (!o->fp8_math_name)
        o->fp8_math = MOE_FP8_MATH_AUTO;
    else if (!strcmp(o->fp8_math_name, "w8a16"))
        o->fp8_math = MOE_FP8_MATH_W8A16;
    else if (!strcmp(o->fp8_math_name, "w8a8"))
        o->fp8_math = MOE_FP8_MATH_W8A8;
    else if (!strcmp(o->fp8_math_name, "w8a8-fast"))
        o->fp8_math = MOE_FP8_MATH_W8A8_FAST;
    else
        return REJECT("--fp8-math %s: expected w8a16, w8a8 or w8a8-fast", o->fp8_math_name);
    if (o->eplb && o->warmup < 1)
        return REJECT("--eplb rebalances from the warm-up steps' load: it needs --warmup >= 1");
    if (o->skew > 0.0 && o->model)
        return REJECT("--route-skew with --model: the checkpoint's router routes its tokens");
    o->cfg.num_redundant_experts = o->redundant;
    if (!o->x_dtype_name || !strcmp(o->x_dtype_name, "f32"))
        o->x_dtype = MOE_DTYPE_F32;
    else if (!strcmp(o->x_dtype_name, "bf16"))
        o->x_dtype = MOE_DTYPE_BF16;
    else
        return REJECT("--x-dtype %s: expected f32 or bf16", o->x_dtype_name);
    return modes(o);
}

/* Buffers the layer reads and writes: host memory, or device memory for the CUDA backend. */
typedef struct io {
    int bf16; /* x and y are bf16 (host copies in xb, yb) */
    uint16_t *xb, *yb;
    int device;
    void *x, *y; /* what forward sees */
    float *hx, *hy;
    float *logits; /* --route-skew: router logits where forward reads them, else NULL */
} io_t;

/* x (n values, f32 on the host) where forward reads it, as f32 or (bf16) rounded to bf16. */
static void io_setup(io_t *io, int cuda, int bf16, const float *hx, int64_t n)
{
    const size_t es = bf16 ? 2 : 4;
    io->device = cuda;
    io->bf16 = bf16;
    io->hx = (float *)hx;
    io->hy = malloc(sizeof(float) * (size_t)(n + 1));
    if (bf16) {
        io->xb = malloc(2 * (size_t)(n + 1));
        io->yb = malloc(2 * (size_t)(n + 1));
    }
    if (!io->hy || (bf16 && (!io->xb || !io->yb)))
        DIE("out of host memory for %lld outputs", (long long)n);
    if (bf16)
        moe_convert_from_f32(MOE_DTYPE_BF16, hx, io->xb, (size_t)n);
    if (!cuda) {
        io->x = bf16 ? (void *)io->xb : (void *)io->hx;
        io->y = bf16 ? (void *)io->yb : (void *)io->hy;
        return;
    }
#ifdef MOE_HAVE_CUDA
    if (cudaMalloc(&io->x, es * (size_t)(n + 1)) != cudaSuccess ||
        cudaMalloc(&io->y, es * (size_t)(n + 1)) != cudaSuccess ||
        cudaMemcpy(io->x, bf16 ? (const void *)io->xb : (const void *)hx, es * (size_t)n,
                   cudaMemcpyHostToDevice) != cudaSuccess)
        DIE("cuda: cannot place %lld inputs on the device", (long long)n);
#else
    (void)es;
#endif
}

/* y back to the host as f32 (hy). */
static void io_fetch(io_t *io, int64_t n)
{
#ifdef MOE_HAVE_CUDA
    if (io->device &&
        (cudaDeviceSynchronize() != cudaSuccess ||
         cudaMemcpy(io->bf16 ? (void *)io->yb : (void *)io->hy, io->y,
                    (io->bf16 ? 2 : 4) * (size_t)n, cudaMemcpyDeviceToHost) != cudaSuccess))
        DIE("cuda: cannot read the output back");
#endif
    if (io->bf16)
        moe_convert_to_f32(MOE_DTYPE_BF16, io->yb, io->hy, (size_t)n);
}

/* --route-skew: this rank's router logits [n, E] where forward reads them. */
static void io_logits(io_t *io, const opts_t *o, int64_t t0, int64_t n)
{
    const int E = o->cfg.num_experts;
    float *h;
    if (o->skew <= 0.0)
        return;
    h = malloc(sizeof(float) * (size_t)(n * E + 1));
    if (!h)
        DIE("out of host memory for %lld x %d router logits", (long long)n, E);
    moe_gen_skewed_logits(o->seed, t0, n, E, o->skew, h);
    io->logits = h;
#ifdef MOE_HAVE_CUDA
    if (io->device) {
        void *d = NULL;
        if (cudaMalloc(&d, sizeof(float) * (size_t)(n * E + 1)) != cudaSuccess ||
            cudaMemcpy(d, h, sizeof(float) * (size_t)(n * E), cudaMemcpyHostToDevice) !=
                cudaSuccess)
            DIE("cuda: cannot place %lld x %d router logits on the device", (long long)n, E);
        free(h);
        io->logits = d;
    }
#endif
}

static void io_free(io_t *io)
{
#ifdef MOE_HAVE_CUDA
    if (io->device) {
        cudaFree(io->x);
        cudaFree(io->y);
        cudaFree(io->logits);
        io->logits = NULL;
    }
#endif
    free(io->logits);
    free(io->hy);
    free(io->xb);
    free(io->yb);
}

static double median(double *v, int n)
{
    moe_cli_sort(v, n);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* FNV-1a over the bits of the gathered output (rank 0). */
static uint64_t bits_hash(const float *v, int64_t n)
{
    uint64_t h = 1469598103934665603ULL;
    int64_t i;
    for (i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &v[i], 4);
        h = (h ^ u) * 1099511628211ULL;
    }
    return h;
}

enum { PH_ROUTE, PH_DISPATCH, PH_EXPERT, PH_COMBINE, PH_SHARED, PH_TOTAL, PH_N };

typedef struct results {
    double phase_us[PH_N];                    /* median over iterations, max over ranks */
    double imbalance_before, imbalance_after; /* rows per rank, max / mean (--eplb: before) */
    double rebalance_s, rebalance_mib;        /* --eplb: max over ranks (last layer) */
    double checksum, abs_sum;
    uint64_t hash;
    double tokens_per_s;
} results_t;

/* Rows the ranks computed in the layer's last forward: max / mean (0 when nothing counted them:
 * the CUDA backend counts them with MOE_PROFILE=1 only). */
static double rank_imbalance(moe_layer_t *layer)
{
    moe_layer_stats_t st;
    CHECK(moe_layer_get_stats(layer, &st));
    return moe_cli_rank_imbalance(st.rows_received);
}

/* --eplb: every layer rebalanced from the warm-up steps' load. */
static void rebalance(moe_layer_t **layers, int nl, results_t *res)
{
    moe_placement_stats_t ps;
    double v[2], mx[2];
    int l;
    res->imbalance_before = rank_imbalance(layers[nl - 1]);
    for (l = 0; l < nl; l++)
        CHECK_ALL(moe_layer_rebalance(layers[l]));
    CHECK(moe_layer_get_placement_stats(layers[nl - 1], &ps));
    v[0] = ps.seconds;
    v[1] = ps.bytes_received / 1048576.0;
    MPI_Allreduce(v, mx, 2, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    res->rebalance_s = mx[0];
    res->rebalance_mib = mx[1];
}

/* One step = every layer's forward in turn on the same tokens (layers of one runtime run one
 * at a time: they share its workspace); phases are the last layer's. */
/* The steps' barrier, bounded by the runtime's timeout (libmoe's agreement): a peer stopped or
 * killed between two steps gives MOE_STATUS_TIMEOUT here instead of a wait without end in
 * MPI_Barrier (with lsa a stopped rank's queued GPU work still completes the step, so its
 * peers meet the stop here). */
static void bounded_barrier(void)
{
    int64_t m = 0;
    CHECK_ALL(moe_runtime_max_tokens(rt_g, 0, &m));
}

static void time_steps(moe_layer_t **layers, int nl, const moe_forward_args_t *fa, const opts_t *o,
                       results_t *res)
{
    double *ph = calloc((size_t)o->iters * PH_N, sizeof(double)), med[PH_N], wall0, wall = 0;
    moe_layer_stats_t st;
    int i, p, l;

    if (!ph)
        DIE("out of memory");
    for (i = 0; i < o->warmup; i++)
        for (l = 0; l < nl; l++)
            CHECK_ALL(moe_layer_forward(layers[l], fa));
    if (o->warmup)
        CHECK(moe_layer_synchronize(layers[nl - 1], NULL));
    if (o->eplb)
        rebalance(layers, nl, res);
    for (i = 0; i < o->iters; i++) {
        bounded_barrier();
        wall0 = MPI_Wtime();
        for (l = 0; l < nl; l++)
            CHECK_ALL(moe_layer_forward(layers[l], fa));
        for (l = 0; l < nl; l++) /* each layer's verdict (one stream: the first waits) */
            CHECK(moe_layer_synchronize(layers[l], NULL));
        CHECK(moe_layer_get_stats(layers[nl - 1], &st));
        bounded_barrier();
        wall += MPI_Wtime() - wall0;
        ph[PH_ROUTE * o->iters + i] = st.route_us;
        ph[PH_DISPATCH * o->iters + i] = st.dispatch_us;
        ph[PH_EXPERT * o->iters + i] = st.expert_us;
        ph[PH_COMBINE * o->iters + i] = st.combine_us;
        ph[PH_SHARED * o->iters + i] = st.shared_us;
        ph[PH_TOTAL * o->iters + i] = (MPI_Wtime() - wall0) * 1e6;
    }
    res->imbalance_after = rank_imbalance(layers[nl - 1]);
    for (p = 0; p < PH_N; p++)
        med[p] = median(ph + p * o->iters, o->iters);
    MPI_Reduce(med, res->phase_us, PH_N, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    res->tokens_per_s = wall > 0 ? (double)o->tokens * o->iters / wall : 0;
    free(ph);
}

/* Device memory in use now (CUDA backend), for the memory report; 0 elsewhere. */
static double device_used_mib(int cuda)
{
#ifdef MOE_HAVE_CUDA
    size_t free_b = 0, total_b = 0;
    if (cuda && cudaMemGetInfo(&free_b, &total_b) == cudaSuccess)
        return (double)(total_b - free_b) / 1048576.0;
#else
    (void)cuda;
#endif
    return 0.0;
}

/* Weights and workspace per rank over every layer, max over ranks (rank 0 prints). With the
 * CUDA backend the layers share the runtime's one workspace. */
static void print_memory(const moe_runtime_info_t *ri, int nl, double dev_before)
{
    double v[5] = {0, 0, 0, 0, 0}, mx[5];
    moe_runtime_info_t now;
    moe_layer_info_t li;
    int l, cuda = ri->backend == MOE_BACKEND_CUDA;
    CHECK(moe_runtime_get_info(rt_g, &now));
    for (l = 0; l < nl; l++) {
        CHECK(moe_layer_get_info(layers_g[l], &li));
        v[0] += li.weight_bytes / 1048576.0;
        v[1] = li.workspace_bytes / 1048576.0 > v[1] ? li.workspace_bytes / 1048576.0 : v[1];
        v[2] += li.workspace_bytes / 1048576.0;
    }
    v[3] = cuda ? now.workspace_bytes / 1048576.0 : v[2];
    v[4] = cuda ? device_used_mib(1) - dev_before : 0.0;
    MPI_Reduce(v, mx, 5, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank_g == 0)
        printf("# memory per rank (max over ranks): %d layer(s): weights %.1f MiB + workspace "
               "%.1f MiB (%s; largest layer's %.1f MiB, sum of the layers' %.1f MiB) = %.1f MiB"
               "%s",
               nl, mx[0], mx[3], cuda ? "one per runtime" : "per layer", mx[1], mx[2],
               mx[0] + mx[3], cuda ? "" : "\n");
    if (rank_g == 0 && cuda)
        printf("; device memory taken since the runtime's creation %.1f MiB\n", mx[4]);
}

static void checksum(const io_t *io, int64_t my_tokens, int hidden, int world, results_t *res)
{
    int64_t n = my_tokens * hidden;
    int *counts = NULL, *displs = NULL, r, total = 0;
    float *all = NULL;
    int cnt = (int)n;

    if (rank_g == 0) {
        counts = calloc((size_t)world, sizeof(int));
        displs = calloc((size_t)world, sizeof(int));
    }
    MPI_Gather(&cnt, 1, MPI_INT, counts, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (rank_g == 0) {
        for (r = 0; r < world; r++) {
            displs[r] = total;
            total += counts[r];
        }
        all = malloc(sizeof(float) * (size_t)(total + 1));
        if (!all)
            DIE("out of memory gathering %d outputs", total);
    }
    MPI_Gatherv(io->hy, cnt, MPI_FLOAT, all, counts, displs, MPI_FLOAT, 0, MPI_COMM_WORLD);
    if (rank_g == 0) {
        double s = 0, a = 0;
        int i;
        for (i = 0; i < total; i++) {
            s += all[i];
            a += fabs(all[i]);
        }
        res->checksum = s;
        res->abs_sum = a;
        res->hash = bits_hash(all, total);
    }
    free(all);
    free(counts);
    free(displs);
}

static void print_rank_map(const moe_runtime_info_t *ri, const moe_layer_info_t *li,
                           int64_t my_tokens, int world)
{
    char line[256], experts[32], *all = NULL;
    int r;
    if (li->first_local_expert >= 0)
        snprintf(experts, sizeof(experts), "%5d..%-5d", li->first_local_expert,
                 li->first_local_expert + li->num_local_experts - 1);
    else /* redundant slots or a placement: not one block */
        snprintf(experts, sizeof(experts), "%4d slots  ", li->num_local_experts);
    snprintf(line, sizeof(line), "#  %4d  %-16s %4d %5d  %-14s %8lld  %s %5d..%-5d %10.1f",
             ri->rank, ri->hostname, ri->device, ri->numa_node, ri->cpuset[0] ? ri->cpuset : "-",
             (long long)my_tokens, experts, li->intermediate_begin, li->intermediate_end,
             li->weight_bytes / 1048576.0);
    if (rank_g == 0)
        all = malloc(sizeof(line) * (size_t)world);
    MPI_Gather(line, sizeof(line), MPI_CHAR, all, sizeof(line), MPI_CHAR, 0, MPI_COMM_WORLD);
    if (rank_g == 0) {
        printf("#  rank  host             gpu  numa  cores            tokens  experts      "
               "I-slice      weight_MiB\n");
        for (r = 0; r < world; r++)
            printf("%s\n", all + (size_t)r * sizeof(line));
    }
    free(all);
}

static void print_load(moe_layer_t *layer, int E)
{
    int64_t *mine = calloc((size_t)E, sizeof(int64_t)), *sum = calloc((size_t)E, sizeof(int64_t));
    int64_t mx = 0, mn = INT64_MAX, tot = 0;
    int e;
    if (!mine || !sum)
        DIE("out of memory");
    CHECK(moe_layer_get_expert_load(layer, mine, E));
    MPI_Reduce(mine, sum, E, MPI_INT64_T, MPI_SUM, 0, MPI_COMM_WORLD);
    if (rank_g == 0) {
        for (e = 0; e < E; e++) {
            mx = sum[e] > mx ? sum[e] : mx;
            mn = sum[e] < mn ? sum[e] : mn;
            tot += sum[e];
        }
        printf("# load per expert (rows): min %lld max %lld mean %.1f imbalance %.2f\n#  ",
               (long long)mn, (long long)mx, (double)tot / E, tot ? mx * (double)E / tot : 0.0);
        for (e = 0; e < E && e < 64; e++)
            printf("%lld%s", (long long)sum[e], e + 1 < E && e < 63 ? " " : "");
        printf("%s\n", E > 64 ? " ..." : "");
    }
    free(mine);
    free(sum);
}

static void print_results(opts_t *o, const results_t *r, const moe_runtime_info_t *ri,
                          const moe_layer_info_t *li)
{
    static const char *names[PH_N] = {"route", "dispatch", "expert", "combine", "shared", "total"};
    FILE *j;
    int p;
    printf("# phase (us, median of %d, max over ranks):", o->iters);
    for (p = 0; p < PH_N; p++)
        printf(" %s %.1f", names[p], r->phase_us[p]);
    printf("\ntokens/s %.1f\n", r->tokens_per_s);
    if (o->eplb)
        printf("# rebalance: %.3f s, %.1f MiB of weights received (max over ranks)\n"
               "rank load imbalance (max/mean): before %.3f after %.3f\n",
               r->rebalance_s, r->rebalance_mib, r->imbalance_before, r->imbalance_after);
    else
        printf("rank load imbalance (max/mean): %.3f\n", r->imbalance_after);
    printf("checksum %.6e abs %.6e\n", r->checksum, r->abs_sum);
    printf("output_hash 0x%016llx\n", (unsigned long long)r->hash);
    if (!o->json_file)
        return;
    j = o->json_file;
    fprintf(j,
            "{\n  \"backend\": \"%s\", \"ranks\": %d, \"ep\": %d, \"tp\": %d,\n"
            "  \"experts\": %d, \"top_k\": %d, \"hidden\": %d, \"intermediate\": %d,\n"
            "  \"dtype\": \"%s\", \"tokens\": %lld, \"iters\": %d,\n  \"phase_us\": {",
            moe_backend_name(ri->backend), ri->world_size, li->ep_size, li->tp_size,
            o->cfg.num_experts, o->cfg.top_k, o->cfg.hidden, o->cfg.intermediate,
            o->model ? moe_dtype_name(o->cfg.weight_dtype) : o->dtype, (long long)o->tokens,
            o->iters);
    for (p = 0; p < PH_N; p++)
        fprintf(j, "%s\"%s\": %.3f", p ? ", " : "", names[p], r->phase_us[p]);
    fprintf(j,
            "},\n  \"tokens_per_s\": %.3f,\n  \"checksum\": %.9e,\n  \"abs_sum\": %.9e,\n"
            "  \"output_hash\": \"0x%016llx\",\n  \"redundant_experts\": %d, \"eplb\": %d, "
            "\"route_skew\": %g,\n  \"rank_load_imbalance\": {\"before\": %.4f, \"after\": %.4f}"
            "\n}\n",
            r->tokens_per_s, r->checksum, r->abs_sum, (unsigned long long)r->hash, o->redundant,
            o->eplb, o->skew, o->eplb ? r->imbalance_before : r->imbalance_after,
            r->imbalance_after);
    if (fclose(j) != 0)
        DIE("--json %s: write failed: %s", o->json, strerror(errno));
}

/* Local work before any collective: the checkpoint's layer config, --input's token count, the
 * sizes that must fit the run, and rank 0's --json file. -1 with o->err on failure. */
static int resolve(opts_t *o, int world)
{
    int64_t per_rank;
#ifdef MOE_RUN_HAVE_MODEL
    moe_status_t st;
    uint64_t id = 0;
    if (o->model && (st = moe_run_model_config(o->model, o->layer_index, &o->cfg)))
        return REJECT("--model %s --layer %d: %s (%s)", o->model, o->layer_index,
                      moe_status_string(st), moe_last_error());
    if (o->model && o->dtype_given) { /* the weights are converted as they load */
        o->cfg.weight_dtype = o->dtype_kind;
        o->cfg.scale_kind = o->dtype_scale;
    }
    /* every rank must read the same checkpoint and tokens: compared by content (a copy on
     * another host agrees; another file at the same path does not) */
    if (o->model && moe_cli_path_identity("--model", o->model, &id, o->err, sizeof(o->err)))
        return -1;
    o->model_id = o->model ? (int64_t)(id >> 1) : 0;
    if (o->input && moe_cli_path_identity("--input", o->input, &id, o->err, sizeof(o->err)))
        return -1;
    o->input_id = o->input ? (int64_t)(id >> 1) : 0;
    if (o->input && !o->tokens_given) { /* the global batch is the file's tokens */
        moe_dtype_t dt;
        int64_t cols;
        st = moe_safetensors_tensor_info(o->input, "hidden_states", &dt, &o->tokens, &cols);
        if (st != MOE_STATUS_SUCCESS)
            return REJECT("--input %s: %s (%s)", o->input, moe_status_string(st), moe_last_error());
        if (o->tokens > MAX_TOKENS)
            return REJECT("--input %s: %lld tokens: more than %lld", o->input, (long long)o->tokens,
                          (long long)MAX_TOKENS);
    }
#else
    if (o->model)
        return REJECT("--model: this build has no checkpoint support");
    if (o->input || o->output)
        return REJECT("--%s: this build has no safetensors support", o->input ? "input" : "output");
#endif
    o->cfg.fp8_math = o->fp8_math;
    if ((o->fp8_math == MOE_FP8_MATH_W8A8 || o->fp8_math == MOE_FP8_MATH_W8A8_FAST) &&
        o->cfg.weight_dtype != MOE_DTYPE_FP8_E4M3)
        return REJECT("--fp8-math %s: the layer's weights are %s, not FP8 (--dtype fp8, or an "
                      "FP8 checkpoint without --dtype)",
                      o->fp8_math_name, moe_dtype_name(o->cfg.weight_dtype));
    per_rank = (o->tokens + world - 1) / world;
    if (per_rank > (INT64_C(1) << 30))
        return REJECT("--tokens %lld: %lld per rank over %d rank(s); at most %lld",
                      (long long)o->tokens, (long long)per_rank, world,
                      (long long)(INT64_C(1) << 30));
    /* checksum() and --output gather every value to rank 0 with int counts */
    if (o->tokens * o->cfg.hidden > INT32_MAX)
        return REJECT("--tokens %lld x hidden %d = %lld values: more than one MPI gather holds "
                      "(%d)",
                      (long long)o->tokens, o->cfg.hidden, (long long)(o->tokens * o->cfg.hidden),
                      INT32_MAX);
    if (o->json && rank_g == 0) {
        moe_status_t js;
        if (!(o->json_file = moe_open_regular_write(o->json, &js)))
            return REJECT("--json %s", moe_last_error());
    }
    return 0;
}

/* Every rank's verdict on its options, and the options that shape the collectives, compared
 * before the first collective: a rank started with other options would wait in a collective
 * the others never post. Returns 0 when the run can go on. */
static int agree_options(const opts_t *o, int bad)
{
    const moe_layer_config_t *c = &o->cfg;
    const moe_cli_field_t f[] = {
        {"--help", o->help, 0},
        {"--input (given or not)", o->input != NULL, 0},
        {"--output (given or not)", o->output != NULL, 0},
        {"--model (given or not)", o->model != NULL, 0},
        {"--model's content (file names, sizes, JSON, safetensors headers, sampled weights)",
         o->model_id, 1},
        {"--input's content", o->input_id, 1},
        {"--iters", o->iters, 0},
        {"--warmup", o->warmup, 0},
        {"--tokens", o->tokens, 0},
        {"--layer", o->layer_index, 0},
        {"--layers", o->num_layers, 0},
        {"--experts", c->num_experts, 0},
        {"--top-k", c->top_k, 0},
        {"--hidden", c->hidden, 0},
        {"--intermediate", c->intermediate, 0},
        {"--shared", c->num_shared_experts, 0},
        {"--shared-intermediate", c->shared_intermediate, 0},
        {"shared expert gate", c->shared_expert_gate, 0},
        {"--scoring", c->scoring, 0},
        {"--n-group", c->n_group, 0},
        {"--topk-group", c->topk_group, 0},
        {"--dtype", c->weight_dtype, 0},
        {"--fp8-math", c->fp8_math, 0},
        {"--x-dtype", o->x_dtype, 0},
        {"--ep", o->ep, 0},
        {"--tp", o->tp, 0},
        {"--dispatch", c->dispatch, 0},
        {"--backend", o->backend_kind, 0},
        {"--deterministic", o->deterministic, 0},
        {"--seed", (int64_t)o->seed, 0},
        {"--round-tokens", o->round_tokens, 0},
        {"--redundant-experts", o->redundant, 0},
        {"--eplb", o->eplb, 0},
        {"--route-skew (x 1e6)", (int64_t)llround(o->skew * 1e6), 0},
    };
    return moe_cli_agree("moe-run", bad, o->err, f, (int)(sizeof(f) / sizeof(f[0])));
}

int main(int argc, char **argv)
{
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    moe_runtime_info_t ri;
    moe_layer_info_t li;
    moe_forward_args_t fa = MOE_FORWARD_ARGS_INIT;
    results_t res;
    opts_t o;
    io_t io = {0};
    float *x;
    int64_t t0, my_tokens;
    double dev_before;
    int world, bad, l;

    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_g);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    bad = parse(argc, argv, &o);
    if (!bad && !o.help)
        bad = resolve(&o, world);
    if (agree_options(&o, bad)) {
        if (o.json_file)
            fclose(o.json_file);
        MPI_Finalize();
        return 2;
    }
    if (o.help) {
        if (rank_g == 0)
            usage();
        MPI_Finalize();
        return 0;
    }
    rc.backend = o.backend_kind;
    rc.bind = o.bind;
    dev_before = device_used_mib(o.backend_kind != MOE_BACKEND_CPU);
    CHECK_ALL(moe_runtime_create_mpi(&rc, MPI_COMM_WORLD, &rt_g));
    CHECK(moe_runtime_get_info(rt_g, &ri));
    o.cfg.ep_size = o.ep;
    o.cfg.tp_size = o.tp;
    o.cfg.deterministic = o.deterministic ? 1 : MOE_AUTO;
    /* The global batch split evenly: rank r gets tokens [t0, t0 + my_tokens). No overflow:
     * tokens < 2^31 and rank < 2^31. */
    t0 = o.tokens * rank_g / world;
    my_tokens = o.tokens * (rank_g + 1) / world - t0;
    o.cfg.max_tokens_per_rank = my_tokens > 0 ? my_tokens : 1;
    MPI_Allreduce(MPI_IN_PLACE, &o.cfg.max_tokens_per_rank, 1, MPI_INT64_T, MPI_MAX,
                  MPI_COMM_WORLD);
    /* at most the capacity (the tokens per rank): more would be one round anyway */
    o.cfg.ep_round_tokens =
        o.round_tokens < o.cfg.max_tokens_per_rank ? o.round_tokens : o.cfg.max_tokens_per_rank;
    for (l = 0; l < o.num_layers; l++) {
        CHECK_ALL(moe_layer_create(rt_g, &o.cfg, &layers_g[l]));
        num_layers_g = l + 1;
    }
    CHECK(moe_layer_get_info(layers_g[0], &li));
    if (rank_g == 0)
        printf(
            "# libmoe %d.%d.%d moe-run: backend %s%s, %d rank(s), ep %d x tp %d, dispatch %s%s\n"
            "# layer %s: E%d k%d H%d I%d shared %d (I %d) dtype %s%s scoring %s%s, "
            "x %s, tokens %lld, seed %llu\n",
            MOE_VERSION_MAJOR, MOE_VERSION_MINOR, MOE_VERSION_PATCH, moe_backend_name(ri.backend),
            ri.backend == MOE_BACKEND_CPU ? " (no GPU backend in use)" : "", world, li.ep_size,
            li.tp_size, o.dispatch ? o.dispatch : "auto", li.deterministic ? ", deterministic" : "",
            o.model ? o.model : o.preset, o.cfg.num_experts, o.cfg.top_k, o.cfg.hidden,
            o.cfg.intermediate, o.cfg.num_shared_experts, o.cfg.shared_intermediate,
            moe_dtype_name(o.cfg.weight_dtype),
            o.cfg.fp8_math == MOE_FP8_MATH_W8A8        ? " (W8A8)"
            : o.cfg.fp8_math == MOE_FP8_MATH_W8A8_FAST ? " (W8A8_FAST)"
            : o.cfg.fp8_math == MOE_FP8_MATH_W8A16     ? " (W8A16)"
                                                       : "",
            o.cfg.scoring == MOE_SCORING_SIGMOID ? "sigmoid" : "softmax",
            o.cfg.n_group > 1 ? " grouped" : "", moe_dtype_name(o.x_dtype), (long long)o.tokens,
            (unsigned long long)o.seed);
    if (rank_g == 0 && (o.redundant || o.eplb || o.skew > 0.0))
        printf("# EPLB: %d redundant expert slot(s) (%d per EP rank), route skew %g%s\n",
               o.redundant, o.redundant / li.ep_size, o.skew,
               o.eplb ? ", one rebalance after the warm-up" : "");
    if (rank_g == 0 && li.ep_round_tokens < o.cfg.max_tokens_per_rank)
        printf(
            "# EP rounds of %lld tokens per rank (ep_round_tokens): %lld per step\n",
            (long long)li.ep_round_tokens,
            (long long)((o.cfg.max_tokens_per_rank + li.ep_round_tokens - 1) / li.ep_round_tokens));
    x = malloc(sizeof(float) * (size_t)(my_tokens * o.cfg.hidden + 1));
    if (!x)
        DIE("out of memory for %lld tokens", (long long)my_tokens);
    /* layer l of --layers: the same weights (--model's layer, or --seed's) in every copy */
    for (l = 0; l < o.num_layers; l++) {
#ifdef MOE_RUN_HAVE_MODEL
        if (o.model)
            CHECK_ALL(moe_run_model_load(layers_g[l], o.model, o.layer_index));
        else
            CHECK(moe_gen_set_weights(layers_g[l], &o.cfg, o.seed));
#else
        CHECK(moe_gen_set_weights(layers_g[l], &o.cfg, o.seed));
#endif
    }
#ifdef MOE_RUN_HAVE_MODEL
    /* tokens from --input (any layer), else random from --seed */
    CHECK_ALL(moe_run_model_tokens(o.input, o.seed, t0, my_tokens, o.cfg.hidden, x));
#else
    moe_gen_tokens(o.seed, t0, my_tokens, o.cfg.hidden, x);
#endif
    CHECK(moe_layer_get_info(layers_g[0], &li));
    print_rank_map(&ri, &li, my_tokens, world);
    print_memory(&ri, o.num_layers, dev_before);
    io_setup(&io, ri.backend == MOE_BACKEND_CUDA, o.x_dtype == MOE_DTYPE_BF16, x,
             my_tokens * o.cfg.hidden);
    fa.num_tokens = my_tokens;
    fa.dtype = o.x_dtype;
    fa.x = io.x;
    fa.y = io.y;
    io_logits(&io, &o, t0, my_tokens);
    fa.router_logits = io.logits;
    memset(&res, 0, sizeof(res));
    time_steps(layers_g, o.num_layers, &fa, &o, &res);
    io_fetch(&io, my_tokens * o.cfg.hidden);
    print_load(layers_g[o.num_layers - 1], o.cfg.num_experts);
    checksum(&io, my_tokens, o.cfg.hidden, world, &res);
#ifdef MOE_RUN_HAVE_MODEL
    if (o.output)
        CHECK_ALL(moe_run_model_write_output(o.output, io.hy, my_tokens, o.cfg.hidden));
#endif
    if (rank_g == 0)
        print_results(&o, &res, &ri, &li);
    fflush(stdout);
    io_free(&io);
    free(x);
    destroy_layers();
    CHECK(moe_runtime_destroy(rt_g));
    rt_g = NULL;
    MPI_Finalize();
    return 0;
}
