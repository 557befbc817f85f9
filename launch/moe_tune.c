/* SPDX-License-Identifier: Apache-2.0 */
/* moe-tune: measures, on this machine's GPUs, which grouped-GEMM variant is fastest at each
 * rows-per-expert point, (with several ranks) which expert-parallel transport is fastest at
 * each tokens-per-rank point and (on one sm_90 GPU) up to how many tokens per step the fused
 * decode kernel beats the grouped path, for one layer shape, and writes the oracle's tune file
 * (docs/KERNELS.md, "Tune file"), which MOE_TUNE_FILE then loads.
 *
 * Each candidate runs through the public API, forced by the oracle's own switches
 * (MOE_FORCE_VARIANT, MOE_FORCE_TRANSPORT) at layer create; a step is timed with CUDA events
 * between back-to-back forwards, and a point's time is the largest over the ranks of each rank's
 * median. The candidates and the tune file come from the CUDA-free oracle header (a tool that
 * knows the library's variant table). Every rank runs the same steps; rank 0 writes the file. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <cuda_runtime.h>
#include <errno.h>
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/diag.h"
#include "cli.h"
#include "kernels/decode.h"
#include "kernels/expert_gemm_table.h"
#include "runtime/layer.h"
#include "runtime/oracle.h"
#include "layer_gen.h"
#include "runtime/formats/file.h"
#include "tool_check.h"
#include "moe/moe.h"
#include "moe/moe_mpi.h"

#define MAX_POINTS MOE_ORACLE_MAX_BUCKETS
/* a GEMM point keeps the built-in pick when it is within this fraction of the fastest */
#define TUNE_MARGIN 0.01
#define MAX_CAND 32
#define MAX_DIM (INT64_C(1) << 20)

#define CUDA_OK(call) MOE_TOOL_CUDA_OK("moe-tune", call)
#define MOE_OK(call) MOE_TOOL_OK("moe-tune", call)

typedef struct options {
    const char *preset, *out;
    moe_layer_config_t cfg;
    double rows[MAX_POINTS]; /* GEMM points: rows per expert */
    int num_rows;
    int64_t tokens[MAX_POINTS]; /* transport points: tokens per rank */
    int num_tokens;
    int64_t decode[MAX_POINTS]; /* fused-decode points: tokens per step (one GPU) */
    int num_decode;
    int tp, iters, fp8, fast, help, no_transport, no_decode;
    moe_scale_kind_t scales;
    moe_oracle_table_t keep; /* --out's tables that this run does not replace */
    char err[512];
} options_t;

#define REJECT(...) (snprintf(o->err, sizeof(o->err), __VA_ARGS__), 0)

static void usage(void)
{
    printf("usage: mpirun -np N moe-tune --out FILE [--preset NAME]\n"
           "                [--experts E --top-k K --hidden H --intermediate I] [--tp T]\n"
           "                [--dtype bf16|fp8 [--scales tensor|channel|block]\n"
           "                [--accum promoted|fast]]\n"
           "                [--rows 1,2,4,8,16,32,64,96,128,160,192,224,256,320]\n"
           "                [--tokens 1,8,64,512,4096]\n"
           "                [--decode 1,2,4,8,16,32,64] [--iters N] [--no-transport]\n"
           "                [--no-decode]\n"
           "  Times every grouped-GEMM variant that runs this layer here at each rows-per-expert\n"
           "  point (--rows), with N > 1 ranks every transport (allgather, lsa, p2p) at each\n"
           "  tokens-per-rank point (--tokens), on one sm_90 GPU the fused decode kernel against\n"
           "  the grouped path at each tokens-per-step point (--decode, at most %d), and writes\n"
           "  the tune file FILE (rank 0). A FILE that holds tables of this GPU keeps those of\n"
           "  other shapes, dtypes and layouts.\n"
           "  Use it with MOE_TUNE_FILE=FILE (moe-bench --explain shows the choices).\n"
           "presets: %s\n",
           MOE_DECODE_MAX_TOKENS, moe_gen_preset_names());
}

/* A comma-separated list of up to MAX_POINTS numbers in [lo, hi], sorted, duplicates dropped. */
static int parse_list(options_t *o, const char *opt, const char *s, double lo, double hi,
                      double *out, int *n)
{
    char item[32];
    const char *p = s;
    *n = 0;
    while (1) {
        size_t len = strcspn(p, ",");
        double v;
        int i, j;
        if (*n == MAX_POINTS)
            return REJECT("%s %s: more than %d points", opt, s, MAX_POINTS);
        if (len == 0 || len >= sizeof(item))
            return REJECT("%s %s: expected numbers like 1,8,64", opt, s);
        memcpy(item, p, len);
        item[len] = '\0';
        if (moe_cli_double(opt, item, lo, hi, &v, o->err, sizeof(o->err)))
            return 0;
        for (i = 0; i < *n && out[i] < v; i++)
            ;
        if (i == *n || out[i] != v) {
            for (j = *n; j > i; j--)
                out[j] = out[j - 1];
            out[i] = v;
            (*n)++;
        }
        if (!p[len])
            return 1;
        p += len + 1;
    }
}

/* A list of whole token counts in [1, hi] (parse_list's rules), into out[*n]. */
static int parse_counts(options_t *o, const char *a, const char *v, double hi, int64_t *out, int *n)
{
    double t[MAX_POINTS];
    if (!parse_list(o, a, v, 1, hi, t, n))
        return 0;
    for (int i = 0; i < *n; i++) {
        if (t[i] != floor(t[i]))
            return REJECT("%s %s: %g is not a whole number of tokens", a, v, t[i]);
        out[i] = (int64_t)t[i];
    }
    return 1;
}

static int parse_value(options_t *o, const char *a, const char *v, const moe_layer_config_t *init)
{
    {
        const int sh = moe_gen_shape_option(a, v, &o->cfg, &o->preset, o->err, sizeof(o->err));
        if (sh >= 0)
            return sh;
    }
    if (!strcmp(a, "--tp")) {
        int64_t x;
        if (moe_cli_int(a, v, 1, 4096, &x, o->err, sizeof(o->err)))
            return 0;
        o->tp = (int)x;
        return 1;
    }
    if (!strcmp(a, "--iters")) {
        int64_t x;
        if (moe_cli_int(a, v, 3, 100000, &x, o->err, sizeof(o->err)))
            return 0;
        o->iters = (int)x;
        return 1;
    }
    if (!strcmp(a, "--rows"))
        return parse_list(o, a, v, 1.0 / 64, 1 << 20, o->rows, &o->num_rows);
    if (!strcmp(a, "--tokens"))
        return parse_counts(o, a, v, 1 << 24, o->tokens, &o->num_tokens);
    if (!strcmp(a, "--decode"))
        return parse_counts(o, a, v, MOE_DECODE_MAX_TOKENS, o->decode, &o->num_decode);
    if (!strcmp(a, "--out")) {
        o->out = v;
        return 1;
    }
    {
        const int f =
            moe_gen_fp8_option(a, v, &o->fp8, &o->scales, &o->fast, o->err, sizeof(o->err));
        if (f >= 0)
            return f;
    }
    return REJECT("unknown option %s (see --help)", a);
}

/* The command line into *o; 0 with o->err on the first bad option. */
static int parse(int argc, char **argv, options_t *o)
{
    const moe_layer_config_t init = MOE_LAYER_CONFIG_INIT;
    memset(o, 0, sizeof(*o));
    o->cfg = init;
    o->preset = "mixtral-8x7b";
    o->tp = 1;
    o->iters = 30;
    moe_gen_preset(o->preset, &o->cfg);
    parse_list(o, "--rows", "1,2,4,8,16,32,64,96,128,160,192,224,256,320", 1, 1 << 20, o->rows,
               &o->num_rows);
    o->num_tokens = 5;
    memcpy(o->tokens, (int64_t[]){1, 8, 64, 512, 4096}, sizeof(int64_t) * 5);
    o->num_decode = 7;
    memcpy(o->decode, (int64_t[]){1, 2, 4, 8, 16, 32, 64}, sizeof(int64_t) * 7);
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))
            return o->help = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--no-transport")) {
            o->no_transport = 1;
            continue;
        }
        if (!strcmp(a, "--no-decode")) {
            o->no_decode = 1;
            continue;
        }
        if (!v)
            return REJECT("%s needs a value (or is unknown: see --help)", a);
        i++;
        if (!parse_value(o, a, v, &init))
            return 0;
    }
    if (!o->out)
        return REJECT("--out FILE is required (the tune file to write)");
    return moe_gen_fp8_check(o->fp8, o->scales, o->fast, o->err, sizeof(o->err));
}

/* The GEMMs' dtype and scale kind for this layer (per-tensor weights run per-row GEMMs). */
static void gemm_key(const options_t *o, moe_dtype_t *d, moe_scale_kind_t *s)
{
    *d = o->fp8 ? MOE_DTYPE_FP8_E4M3 : MOE_DTYPE_BF16;
    *s = !o->fp8                            ? MOE_SCALE_NONE
         : o->scales == MOE_SCALE_BLOCK_128 ? MOE_SCALE_BLOCK_128
                                            : MOE_SCALE_PER_CHANNEL;
}

static int same_key(const moe_oracle_group_t *a, const moe_oracle_group_t *b)
{
    return a->kind == b->kind && !memcmp(&a->shape, &b->shape, sizeof(a->shape)) &&
           a->ep_size == b->ep_size && a->tp_size == b->tp_size &&
           (a->kind == MOE_ORACLE_TRANSPORT ||
            (a->dtype == b->dtype && a->scale == b->scale && a->transport == b->transport &&
             (a->kind != MOE_ORACLE_GEMM || a->accum == b->accum)));
}

/* Rank 0, before any measuring: an existing --out must be a tune file of this GPU (its tables
 * are kept), and the folder must be writable. */
static int check_out(options_t *o, const char *gpu, int arch)
{
    char *buf = NULL;
    size_t n = 0;
    int missing = 0;
    moe_status_t st;
    FILE *f;
    /* the library's one non-blocking regular-file open: a FIFO or device is refused at once */
    if (moe_read_regular(o->out, MOE_TUNE_MAX_BYTES, &buf, &n, &missing) != MOE_STATUS_SUCCESS)
        return REJECT("--out %s (remove it or pick another)", moe_last_error());
    if (missing) {
        if (!(f = moe_open_regular_write(o->out, &st)))
            return REJECT("--out %s", moe_last_error());
        fclose(f);
        remove(o->out);
        return 1;
    }
    st = moe_oracle_parse(buf, (size_t)n, o->out, &o->keep);
    free(buf);
    if (st != MOE_STATUS_SUCCESS)
        return REJECT("--out %s exists and is not a tune file this build reads (%s): remove it or "
                      "pick another",
                      o->out, moe_last_error());
    if (strcmp(o->keep.gpu, gpu) || o->keep.arch != arch)
        return REJECT(
            "--out %.200s holds tables of \"%.100s\" (sm_%d), not of this \"%.100s\" (sm_%d)",
            o->out, o->keep.gpu, o->keep.arch, gpu, arch);
    return 1;
}

static int agree_options(const options_t *o, int bad)
{
    int64_t rows64[MAX_POINTS]; /* rows per expert in 1/64ths: whole numbers to hash */
    uint64_t h;
    int i;
    for (i = 0; i < o->num_rows; i++)
        rows64[i] = (int64_t)(o->rows[i] * 64.0);
    h = moe_cli_hash_list(MOE_CLI_HASH_SEED, rows64, o->num_rows);
    h = moe_cli_hash_list(h, o->tokens, o->num_tokens);
    h = moe_cli_hash_list(h, o->decode, o->num_decode);
    {
        const moe_cli_field_t f[] = {
            {"--help", o->help, 0},
            {"--experts", o->cfg.num_experts, 0},
            {"--top-k", o->cfg.top_k, 0},
            {"--hidden", o->cfg.hidden, 0},
            {"--intermediate", o->cfg.intermediate, 0},
            {"--preset", moe_cli_hash(o->preset), 1},
            {"--tp", o->tp, 0},
            {"--iters", o->iters, 0},
            {"--dtype", o->fp8, 0},
            {"--scales", o->scales, 0},
            {"--accum", o->fast, 0},
            {"--no-transport", o->no_transport, 0},
            {"--no-decode", o->no_decode, 0},
            {"--rows/--tokens/--decode", (int64_t)(h >> 1), 1},
        };
        return moe_cli_agree("moe-tune", bad, o->err, f, (int)(sizeof(f) / sizeof(f[0])));
    }
}

/* The device buffers every run shares: x, y of the largest step. */
typedef struct bench {
    moe_runtime_t *rt;
    cudaStream_t stream;
    void *x, *y;
    int world, iters;
} bench_t;

/* Median GPU time of one forward of T tokens per rank (largest over the ranks), in us. */
static double time_steps(const bench_t *b, moe_layer_t *layer, int64_t T)
{
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    cudaEvent_t *ev = malloc(sizeof(cudaEvent_t) * (size_t)(b->iters + 1));
    double *t = malloc(sizeof(double) * (size_t)b->iters), med;
    float ms;
    int i;
    if (!ev || !t) {
        fprintf(stderr, "moe-tune: out of host memory\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    a.num_tokens = T;
    a.dtype = MOE_DTYPE_BF16;
    a.x = b->x;
    a.y = b->y;
    a.stream = b->stream;
    a.max_tokens_across_ranks = T;
    for (i = 0; i < 3; i++) /* warm-up */
        MOE_OK(moe_layer_forward(layer, &a));
    MOE_OK(moe_layer_synchronize(layer, b->stream));
    for (i = 0; i <= b->iters; i++)
        CUDA_OK(cudaEventCreate(&ev[i]));
    CUDA_OK(cudaEventRecord(ev[0], b->stream));
    for (i = 0; i < b->iters; i++) { /* back to back: each interval is the GPU's step time */
        MOE_OK(moe_layer_forward(layer, &a));
        CUDA_OK(cudaEventRecord(ev[i + 1], b->stream));
    }
    MOE_OK(moe_layer_synchronize(layer, b->stream));
    for (i = 0; i < b->iters; i++) {
        CUDA_OK(cudaEventElapsedTime(&ms, ev[i], ev[i + 1]));
        t[i] = ms * 1e3;
    }
    for (i = 0; i <= b->iters; i++)
        cudaEventDestroy(ev[i]);
    moe_cli_sort(t, b->iters);
    med = t[b->iters / 2];
    MPI_Allreduce(MPI_IN_PLACE, &med, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    free(ev);
    free(t);
    return med;
}

/* Creates the layer with the forced variant / transport set in the environment; 0 when the
 * library refuses that combination here (the same verdict on every rank). */
static int make_layer(const bench_t *b, const moe_layer_config_t *cfg, moe_layer_t **layer)
{
    moe_status_t st = moe_layer_create(b->rt, cfg, layer);
    if (st == MOE_STATUS_NOT_SUPPORTED || st == MOE_STATUS_INVALID_ARGUMENT) {
        *layer = NULL;
        return 0;
    }
    MOE_OK(st);
    MOE_OK(moe_gen_set_weights_fast(*layer, cfg, 0));
    return 1;
}

/* Transport buckets from measured points (the transport rule has no built-in table to keep
 * between them): the winner at each point; a bound halfway (geometrically) between points whose
 * winners differ; the last bucket open. */
static void make_buckets(moe_oracle_group_t *g, const double *at, const int *win,
                         const double *best_us, char names[][MOE_ORACLE_NAME_LEN], int n)
{
    g->num_buckets = 0;
    for (int i = 0; i < n; i++) {
        moe_oracle_bucket_t *k;
        if (win[i] < 0)
            continue;
        if (g->num_buckets > 0 &&
            !strcmp(g->bucket[g->num_buckets - 1].name, names[win[i]])) /* same winner: widen */
            k = &g->bucket[g->num_buckets - 1];
        else {
            k = &g->bucket[g->num_buckets++];
            snprintf(k->name, sizeof(k->name), "%s", names[win[i]]);
            k->at = at[i];
            k->time_us = best_us[i];
        }
        k->max = i + 1 < n ? sqrt(at[i] * at[i + 1]) : HUGE_VAL;
    }
    if (g->num_buckets > 0)
        g->bucket[g->num_buckets - 1].max = HUGE_VAL;
}

/* Every eligible variant at every rows-per-expert point. */
static void tune_gemm(const bench_t *b, options_t *o, int arch, moe_oracle_group_t *g, int rank)
{
    char names[MAX_CAND][MOE_ORACLE_NAME_LEN];
    double at[MAX_POINTS], us[MAX_CAND][MAX_POINTS], best[MAX_POINTS];
    int64_t T[MAX_POINTS];
    int win[MAX_POINTS], nc = 0, np = 0, count = 0, i, j;
    const moe_gemm_variant_t *v = moe_gemm_variants(&count);
    const int64_t E = o->cfg.num_experts, k = o->cfg.top_k, W = b->world;
    moe_layer_config_t cfg = o->cfg;

    /* variants that sum FP8 products on the tensor cores alone change the numerics: a
     * W8A8_FAST layer's table (--accum fast) alone; those on trial are not yet checked on a
     * GPU: asked for */
    const int fast = g->accum == MOE_ORACLE_ACCUM_FAST;
    const int trial = moe_env_int("MOE_TUNE_TRIAL", 0) != 0;
    for (i = 0; i < count && nc < MAX_CAND; i++)
        if (moe_gemm_variant_runs_on(&v[i], arch) && v[i].ab_dtype == g->dtype &&
            v[i].scale_kind == g->scale && (!v[i].fast_accum || fast) &&
            (!moe_gemm_variant_on_trial(&v[i]) || trial))
            snprintf(names[nc++], MOE_ORACLE_NAME_LEN, "%s", v[i].name);
    for (i = 0; i < o->num_rows; i++) { /* tokens per rank giving about that many rows */
        int64_t t = (int64_t)ceil(o->rows[i] * (double)E / (double)(k * W));
        t = t < 1 ? 1 : t;
        if (np > 0 && T[np - 1] == t)
            continue;
        T[np] = t;
        at[np++] = (double)t * (double)(W * k) / (double)E; /* the layer's hint at t */
    }
    cfg.max_tokens_per_rank = T[np - 1];
    if (rank == 0) {
        printf("# GEMM: %d variants x %d points (%s, scales %s)\n#  %12s %8s", nc, np,
               moe_oracle_dtype_name(g->dtype), moe_oracle_scale_name(g->scale), "rows/expert",
               "tokens");
        for (j = 0; j < nc; j++)
            printf(" %s", names[j]);
        printf("\n");
    }
    for (j = 0; j < nc; j++) {
        moe_layer_t *layer;
        setenv("MOE_FORCE_VARIANT", names[j], 1);
        if (!make_layer(b, &cfg, &layer)) {
            if (rank == 0)
                printf("# %s: not run (%s)\n", names[j], moe_last_error());
            for (i = 0; i < np; i++)
                us[j][i] = HUGE_VAL;
            continue;
        }
        for (i = 0; i < np; i++)
            us[j][i] = time_steps(b, layer, T[i]);
        moe_layer_destroy(layer);
    }
    unsetenv("MOE_FORCE_VARIANT");
    for (i = 0; i < np; i++) {
        /* the built-in table's pick here, and what tuning gains over it */
        const moe_oracle_query_t q = {
            arch,  g->dtype,        g->scale, g->ep_size, g->tp_size, MOE_ORACLE_ANY,
            at[i], g->shape.hidden, 0.0,      0,          g->accum};
        moe_oracle_choice_t c;
        int d = -1, fastest = -1;
        if (moe_oracle_pick_gemm(NULL, &q, &c))
            for (j = 0; j < nc; j++)
                if (!strcmp(names[j], c.name))
                    d = j;
        for (j = 0; j < nc; j++)
            if (us[j][i] < HUGE_VAL && (fastest < 0 || us[j][i] < us[fastest][i]))
                fastest = j;
        /* a point keeps the built-in pick unless another variant beats it by more than the
         * noise margin: run-to-run spread alone must not make the table alternate between
         * near-equal variants (which also needs more buckets than a table holds) */
        win[i] = fastest;
        if (d >= 0 && fastest >= 0 && us[d][i] < HUGE_VAL &&
            us[d][i] <= us[fastest][i] * (1.0 + TUNE_MARGIN))
            win[i] = d;
        best[i] = win[i] >= 0 ? us[win[i]][i] : 0;
        if (rank == 0) {
            printf("   %12.3g %8lld", at[i], (long long)T[i]);
            for (j = 0; j < nc; j++)
                printf(" %*.1f", (int)strlen(names[j]), us[j][i]);
            printf("   best %s", fastest >= 0 ? names[fastest] : "(none)");
            if (d >= 0 && fastest >= 0 && us[d][i] < HUGE_VAL)
                printf(", default %s: %.1f us, best saves %.1f%%%s", names[d], us[d][i],
                       100.0 * (1.0 - us[fastest][i] / us[d][i]),
                       win[i] == d && d != fastest ? " (within the margin: default kept)" : "");
            printf("\n");
        }
    }
    {
        const char *w[MAX_POINTS];
        for (i = 0; i < np; i++)
            w[i] = win[i] >= 0 ? names[win[i]] : NULL;
        /* between points whose winners differ, the built-in choice stays (a coarse grid must
         * not make a step slower than the built-in table where nothing was measured) */
        if (moe_oracle_buckets_from_points(g, at, w, best, np) < 0) {
            g->num_buckets = 0;
            if (rank == 0)
                printf("# GEMM table not written: more than %d buckets\n", MOE_ORACLE_MAX_BUCKETS);
        }
    }
}

/* Every transport at every tokens-per-rank point (the capacity is the point: the transport is
 * chosen at create by max_tokens_per_rank). */
static void tune_transport(const bench_t *b, const options_t *o, moe_oracle_group_t *g, int rank)
{
    char names[3][MOE_ORACLE_NAME_LEN] = {"allgather", "lsa", "p2p"};
    double at[MAX_POINTS], us[3][MAX_POINTS], best[MAX_POINTS];
    int win[MAX_POINTS], i, j;
    moe_layer_config_t cfg = o->cfg;

    if (rank == 0)
        printf("# transport: %d points\n#  %12s %12s %12s %12s\n", o->num_tokens, "tokens/rank",
               names[0], names[1], names[2]);
    for (i = 0; i < o->num_tokens; i++) {
        at[i] = (double)o->tokens[i];
        cfg.max_tokens_per_rank = o->tokens[i];
        for (j = 0; j < 3; j++) {
            moe_layer_t *layer;
            us[j][i] = HUGE_VAL;
            setenv("MOE_FORCE_TRANSPORT", names[j], 1);
            if (!make_layer(b, &cfg, &layer))
                continue; /* not for this layout (lsa across hosts, p2p with TP) */
            us[j][i] = time_steps(b, layer, o->tokens[i]);
            moe_layer_destroy(layer);
        }
        win[i] = -1;
        for (j = 0; j < 3; j++)
            if (us[j][i] < HUGE_VAL && (win[i] < 0 || us[j][i] < us[win[i]][i]))
                win[i] = j;
        best[i] = win[i] >= 0 ? us[win[i]][i] : 0;
        if (rank == 0)
            printf("   %12lld %12.1f %12.1f %12.1f   best %s\n", (long long)o->tokens[i], us[0][i],
                   us[1][i], us[2][i], win[i] >= 0 ? names[win[i]] : "(none)");
    }
    unsetenv("MOE_FORCE_TRANSPORT");
    make_buckets(g, at, win, best, names, o->num_tokens);
}

/* The fused decode kernel (MOE_FORCE_VARIANT=sm90_fused_decode) against the grouped path
 * (MOE_FUSED_DECODE=0) at each tokens-per-step point, one GPU. The crossover is the largest
 * point up to which the kernel won at every point (a point it loses ends it: the layer runs the
 * kernel up to one bound and the grouped path above it). The table replaces the built-in
 * crossover for its key (bf16 on sm_90: one token), which is why the default points start at
 * one token. */
static void tune_decode(const bench_t *b, const options_t *o, moe_oracle_group_t *g, int rank)
{
    static const char *const names[2] = {MOE_ORACLE_GROUPED_PATH, MOE_ORACLE_FUSED_DECODE};
    double us[2][MAX_POINTS];
    int i, j, last = -1, np = o->num_decode;
    moe_layer_config_t cfg = o->cfg;

    /* block scales: the kernel runs one token a step, so only the points of one token */
    if (g->scale == MOE_SCALE_BLOCK_128)
        for (np = 0; np < o->num_decode && o->decode[np] <= 1; np++)
            ;
    if (np == 0) {
        if (rank == 0)
            printf("# decode: no point of one token (block scales: the kernel runs one a step)\n");
        g->num_buckets = 0;
        return;
    }
    cfg.max_tokens_per_rank = o->decode[np - 1];
    if (rank == 0)
        printf("# decode: %d points (%s, scales %s)\n#  %12s %12s %18s\n", np,
               moe_oracle_dtype_name(g->dtype), moe_oracle_scale_name(g->scale), "tokens", names[0],
               names[1]);
    for (j = 0; j < 2; j++) {
        moe_layer_t *layer;
        int made;
        setenv(j ? "MOE_FORCE_VARIANT" : "MOE_FUSED_DECODE", j ? MOE_ORACLE_FUSED_DECODE : "0", 1);
        made = make_layer(b, &cfg, &layer);
        unsetenv("MOE_FORCE_VARIANT");
        unsetenv("MOE_FUSED_DECODE");
        if (!made && rank == 0)
            printf("# %s: not run (%s)\n", names[j], moe_last_error());
        for (i = 0; i < np; i++)
            us[j][i] = made ? time_steps(b, layer, o->decode[i]) : HUGE_VAL;
        if (made)
            moe_layer_destroy(layer);
    }
    for (i = 0; i < np; i++) {
        const int fused = us[1][i] < us[0][i];
        if (fused && last == i - 1)
            last = i;
        if (rank == 0)
            printf("   %12lld %12.1f %18.1f   best %s\n", (long long)o->decode[i], us[0][i],
                   us[1][i], names[fused]);
    }
    g->num_buckets = 0;
    if (last >= 0) {
        moe_oracle_bucket_t *k = &g->bucket[g->num_buckets++];
        snprintf(k->name, sizeof(k->name), "%s", MOE_ORACLE_FUSED_DECODE);
        k->max = (double)o->decode[last];
        k->at = (double)o->decode[last];
        k->time_us = us[1][last];
    }
    {
        moe_oracle_bucket_t *k = &g->bucket[g->num_buckets++];
        memset(k, 0, sizeof(*k));
        snprintf(k->name, sizeof(k->name), "%s", MOE_ORACLE_GROUPED_PATH);
        k->max = HUGE_VAL;
        if (last + 1 < np && us[0][last + 1] < HUGE_VAL) {
            k->at = (double)o->decode[last + 1];
            k->time_us = us[0][last + 1];
        }
    }
    if (rank == 0)
        printf("# decode crossover: %s\n",
               last >= 0 ? "the fused kernel up to the last point it won" : "none (grouped)");
}

/* The new tables after --out's others; rank 0. */
static int write_file(options_t *o, const char *gpu, int arch, const moe_oracle_group_t *g, int n)
{
    moe_oracle_table_t t;
    int i, j;
    memset(&t, 0, sizeof(t));
    snprintf(t.gpu, sizeof(t.gpu), "%s", gpu);
    t.arch = arch;
    t.group = calloc((size_t)(o->keep.num_groups + n), sizeof(*t.group));
    if (!t.group)
        return fprintf(stderr, "moe-tune: out of host memory\n"), 1;
    for (i = 0; i < n; i++)
        if (g[i].num_buckets > 0) {
            t.group[t.num_groups] = g[i];
            if (g[i].kind == MOE_ORACLE_GEMM) /* what its picks were compared with */
                snprintf(t.group[t.num_groups].builtin, sizeof(t.group[0].builtin), "%s",
                         moe_oracle_builtin_id());
            t.num_groups++;
        }
    for (i = 0; i < o->keep.num_groups; i++) {
        for (j = 0; j < n && !same_key(&o->keep.group[i], &g[j]); j++)
            ;
        if (j == n && t.num_groups < MOE_ORACLE_MAX_GROUPS)
            t.group[t.num_groups++] = o->keep.group[i];
    }
    if (moe_oracle_write(o->out, &t) != MOE_STATUS_SUCCESS) {
        fprintf(stderr, "moe-tune: %s\n", moe_last_error());
        moe_oracle_table_free(&t);
        return 1;
    }
    printf("# wrote %s: %d table(s); use it with MOE_TUNE_FILE=%s\n", o->out, t.num_groups, o->out);
    moe_oracle_table_free(&t);
    return 0;
}

int main(int argc, char **argv)
{
    options_t o;
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    struct cudaDeviceProp prop;
    moe_oracle_group_t g[3];
    bench_t b;
    int rank = 0, dev = 0, arch, bad, ng = 0, rcode = 0;
    int64_t max_t = 0;

    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &b.world);
    memset(&prop, 0, sizeof(prop));
    bad = !parse(argc, argv, &o);
    if (!bad && !o.help && cudaGetDevice(&dev) == cudaSuccess &&
        cudaGetDeviceProperties(&prop, dev) == cudaSuccess) {
        arch = prop.major * 10 + prop.minor;
        if (b.world % o.tp) {
            snprintf(o.err, sizeof(o.err), "--tp %d does not divide %d ranks", o.tp, b.world);
            bad = 1;
        } else if (rank == 0) {
            bad = !check_out(&o, prop.name, arch);
        }
    } else if (!bad && !o.help) {
        snprintf(o.err, sizeof(o.err), "no CUDA device: moe-tune measures on the GPU");
        bad = 1;
    }
    if (agree_options(&o, bad)) {
        MPI_Finalize();
        return 2;
    }
    if (o.help) {
        if (rank == 0)
            usage();
        MPI_Finalize();
        return 0;
    }
    arch = prop.major * 10 + prop.minor;
    unsetenv("MOE_TUNE_FILE"); /* the built-in tables for every step not forced here */
    unsetenv("MOE_FORCE_VARIANT");
    unsetenv("MOE_GEMM_VARIANT");
    unsetenv("MOE_FORCE_TRANSPORT");
    unsetenv("MOE_EP_TRANSPORT");
    o.cfg.tp_size = o.tp;
    moe_gen_apply_fp8(&o.cfg, o.fp8, o.scales, o.fast);
    rc.backend = MOE_BACKEND_CUDA;
    MOE_OK(moe_runtime_create_mpi(&rc, MPI_COMM_WORLD, &b.rt));
    CUDA_OK(cudaStreamCreateWithFlags(&b.stream, cudaStreamNonBlocking));
    b.iters = o.iters;
    { /* x and y for the largest step of either part */
        const int64_t E = o.cfg.num_experts, k = o.cfg.top_k;
        int64_t t = (int64_t)ceil(o.rows[o.num_rows - 1] * (double)E / (double)(k * b.world));
        uint16_t *hx;
        uint64_t st = 777;
        max_t = t > 1 ? t : 1;
        for (int i = 0; i < o.num_tokens; i++)
            max_t = o.tokens[i] > max_t ? o.tokens[i] : max_t;
        for (int i = 0; i < o.num_decode; i++)
            max_t = o.decode[i] > max_t ? o.decode[i] : max_t;
        hx = malloc(2 * (size_t)(max_t * o.cfg.hidden));
        if (!hx) {
            fprintf(stderr, "moe-tune: out of host memory for %lld tokens\n", (long long)max_t);
            MPI_Abort(MPI_COMM_WORLD, 1);
        }
        moe_gen_fill_bf16(hx, (size_t)(max_t * o.cfg.hidden), 1.0f, &st);
        CUDA_OK(cudaMalloc(&b.x, 2 * (size_t)(max_t * o.cfg.hidden)));
        CUDA_OK(cudaMalloc(&b.y, 2 * (size_t)(max_t * o.cfg.hidden)));
        CUDA_OK(cudaMemcpy(b.x, hx, 2 * (size_t)(max_t * o.cfg.hidden), cudaMemcpyHostToDevice));
        free(hx);
    }
    if (rank == 0)
        printf("# moe-tune: %s E%d k%d H%d I%d on %d rank(s) (ep %d x tp %d), GPU %s (sm_%d)\n",
               o.preset, o.cfg.num_experts, o.cfg.top_k, o.cfg.hidden, o.cfg.intermediate, b.world,
               b.world / o.tp, o.tp, prop.name, arch);

    memset(g, 0, sizeof(g));
    g[0].kind = MOE_ORACLE_GEMM;
    g[0].arch = arch;
    g[0].shape =
        (moe_oracle_shape_t){o.cfg.hidden, o.cfg.intermediate, o.cfg.num_experts, o.cfg.top_k};
    gemm_key(&o, &g[0].dtype, &g[0].scale);
    g[0].ep_size = b.world / o.tp;
    g[0].tp_size = o.tp;
    g[0].transport = MOE_ORACLE_ANY;
    g[0].accum = moe_cfg_fast_accum(&o.cfg) ? MOE_ORACLE_ACCUM_FAST : MOE_ORACLE_ACCUM_PROMOTED;
    tune_gemm(&b, &o, arch, &g[0], rank);
    ng = 1;
    if (g[0].num_buckets == 0) { /* the same on every rank: the times were agreed */
        if (rank == 0)
            fprintf(stderr,
                    "moe-tune: no grouped-GEMM variant could run this layer here (the library "
                    "said: %s); nothing written\n",
                    moe_last_error());
        rcode = 1;
        ng = 0;
    }
    if (ng && b.world > 1 && !o.no_transport) {
        g[1] = g[0];
        g[1].kind = MOE_ORACLE_TRANSPORT;
        g[1].dtype = MOE_DTYPE_INVALID;
        g[1].scale = MOE_SCALE_NONE;
        tune_transport(&b, &o, &g[1], rank);
        ng = 2;
    }
    /* the fused decode kernel: one GPU, sm_90 (bf16, fp8 per-row and, one token, block scales) */
    if (ng && b.world == 1 && !o.no_decode &&
        moe_oracle_fused_decode_runs(arch, g[0].dtype, g[0].scale)) {
        g[ng] = g[0];
        g[ng].kind = MOE_ORACLE_DECODE;
        tune_decode(&b, &o, &g[ng], rank);
        ng++;
    }
    if (rank == 0 && ng)
        rcode = write_file(&o, prop.name, arch, g, ng);
    MPI_Bcast(&rcode, 1, MPI_INT, 0, MPI_COMM_WORLD);
    moe_oracle_table_free(&o.keep);
    cudaFree(b.x);
    cudaFree(b.y);
    cudaStreamDestroy(b.stream);
    moe_runtime_destroy(b.rt);
    MPI_Finalize();
    return rcode;
}
