/* SPDX-License-Identifier: Apache-2.0 */
/* moe-run: the main job. Builds one MoE layer (preset, explicit sizes or a checkpoint), runs a
 * global batch of tokens split over the MPI ranks, prints per-phase timing, tokens/s, the
 * rank map, per-expert load and an output checksum (rank 0, stdout; --json FILE too). */
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "layer_gen.h"
#include "moe/moe.h"
#include "moe/moe_mpi.h"
#ifdef MOE_RUN_HAVE_MODEL
#include "moe/moe_checkpoint.h"
#include "run_model.h"
#endif
#ifdef MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif

typedef struct opts {
    const char *preset, *json, *dispatch, *backend, *dtype, *scoring;
    const char *model, *input, *output;
    int layer_index;
    moe_layer_config_t cfg;
    int64_t tokens;
    uint64_t seed;
    int iters, warmup, bind, ep, tp, deterministic, quiet;
    int tokens_given; /* --tokens on the command line (else --input's row count) */
} opts_t;

static int rank_g = 0;

#define DIE(...)                                                                                   \
    do {                                                                                           \
        fprintf(stderr, "moe-run: rank %d: ", rank_g);                                             \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fprintf(stderr, "\n");                                                                     \
        MPI_Abort(MPI_COMM_WORLD, 2);                                                              \
    } while (0)

#define CHECK(call)                                                                                \
    do {                                                                                           \
        moe_status_t s_ = (call);                                                                  \
        if (s_ != MOE_STATUS_SUCCESS) {                                                            \
            fprintf(stderr, "moe-run: rank %d: %s: %s (%s)\n", rank_g, #call,                      \
                    moe_status_string(s_), moe_last_error());                                      \
            MPI_Finalize();                                                                        \
            exit(1);                                                                               \
        }                                                                                          \
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
           "  --backend auto|cpu|cuda   --bind (hwloc)   --iters N --warmup N\n"
           "  --model DIR --layer N [--input FILE] [--output FILE]   a checkpoint's layer\n"
           "  --json FILE          also write the results as JSON\n",
           moe_gen_preset_names());
}

static int64_t num_arg(const char *v, const char *name)
{
    char *end = NULL;
    long long x = strtoll(v, &end, 0);
    if (!*v || *end)
        DIE("%s %s: not an integer", name, v);
    return x;
}

static int need_value(const char *v, const char *name)
{
    if (!v)
        DIE("%s needs a value", name);
    return 1;
}

static void parse(int argc, char **argv, opts_t *o)
{
    moe_layer_config_t dflt = MOE_LAYER_CONFIG_INIT;
    int i, explicit_sizes = 0;

    memset(o, 0, sizeof(*o));
    o->cfg = dflt;
    o->preset = "tiny";
    o->tokens = 64;
    o->seed = 1;
    o->iters = 5;
    o->warmup = 1;
    o->dtype = "bf16";
    o->layer_index = -1;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define OPT(name) (!strcmp(a, name) && need_value(v, name) && ++i)
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            if (rank_g == 0)
                usage();
            MPI_Finalize();
            exit(0);
        } else if (!strcmp(a, "--deterministic")) {
            o->deterministic = 1;
        } else if (!strcmp(a, "--bind")) {
            o->bind = 1;
        } else if (!strcmp(a, "--quiet")) {
            o->quiet = 1;
        } else if (OPT("--preset")) {
            o->preset = v;
        } else if (OPT("--experts")) {
            o->cfg.num_experts = (int)num_arg(v, a), explicit_sizes = 1;
        } else if (OPT("--top-k")) {
            o->cfg.top_k = (int)num_arg(v, a), explicit_sizes = 1;
        } else if (OPT("--hidden")) {
            o->cfg.hidden = (int)num_arg(v, a), explicit_sizes = 1;
        } else if (OPT("--intermediate")) {
            o->cfg.intermediate = (int)num_arg(v, a), explicit_sizes = 1;
        } else if (OPT("--shared")) {
            o->cfg.num_shared_experts = (int)num_arg(v, a);
        } else if (OPT("--shared-intermediate")) {
            o->cfg.shared_intermediate = (int)num_arg(v, a);
        } else if (OPT("--scoring")) {
            o->scoring = v;
        } else if (OPT("--n-group")) {
            o->cfg.n_group = (int)num_arg(v, a);
        } else if (OPT("--topk-group")) {
            o->cfg.topk_group = (int)num_arg(v, a);
        } else if (OPT("--dtype")) {
            o->dtype = v;
        } else if (OPT("--tokens")) {
            o->tokens = num_arg(v, a);
            o->tokens_given = 1;
        } else if (OPT("--seed")) {
            o->seed = (uint64_t)num_arg(v, a);
        } else if (OPT("--ep")) {
            o->ep = (int)num_arg(v, a);
        } else if (OPT("--tp")) {
            o->tp = (int)num_arg(v, a);
        } else if (OPT("--dispatch")) {
            o->dispatch = v;
        } else if (OPT("--backend")) {
            o->backend = v;
        } else if (OPT("--iters")) {
            o->iters = (int)num_arg(v, a);
        } else if (OPT("--warmup")) {
            o->warmup = (int)num_arg(v, a);
        } else if (OPT("--json")) {
            o->json = v;
        } else if (OPT("--model")) {
            o->model = v;
        } else if (OPT("--layer")) {
            o->layer_index = (int)num_arg(v, a);
        } else if (OPT("--input")) {
            o->input = v;
        } else if (OPT("--output")) {
            o->output = v;
        } else {
            DIE("unknown option %s (see --help)", a);
        }
#undef OPT
    }
    if (!explicit_sizes && !o->model && !moe_gen_preset(o->preset, &o->cfg))
        DIE("unknown preset %s (known: %s)", o->preset, moe_gen_preset_names());
    if (o->scoring && !strcmp(o->scoring, "sigmoid"))
        o->cfg.scoring = MOE_SCORING_SIGMOID;
    else if (o->scoring && strcmp(o->scoring, "softmax"))
        DIE("--scoring %s: expected softmax or sigmoid", o->scoring);
    if (!strcmp(o->dtype, "f32"))
        o->cfg.weight_dtype = MOE_DTYPE_F32;
    else if (!strcmp(o->dtype, "bf16"))
        o->cfg.weight_dtype = MOE_DTYPE_BF16;
    else if (!strcmp(o->dtype, "fp8"))
        o->cfg.weight_dtype = MOE_DTYPE_FP8_E4M3, o->cfg.scale_kind = MOE_SCALE_BLOCK_128;
    else
        DIE("--dtype %s: expected f32, bf16 or fp8", o->dtype);
    if (o->tokens < 0)
        DIE("--tokens %lld: must be >= 0", (long long)o->tokens);
    if (o->iters < 1 || o->warmup < 0)
        DIE("--iters must be >= 1 and --warmup >= 0");
    if (o->model && o->layer_index < 0)
        DIE("--model needs --layer N");
}

static moe_dispatch_t dispatch_of(const char *s)
{
    if (!s || !strcmp(s, "auto"))
        return MOE_DISPATCH_AUTO;
    if (!strcmp(s, "all-to-all") || !strcmp(s, "a2a"))
        return MOE_DISPATCH_ALL_TO_ALL;
    if (!strcmp(s, "all-gather") || !strcmp(s, "ag"))
        return MOE_DISPATCH_ALL_GATHER;
    DIE("--dispatch %s: expected auto, all-to-all or all-gather", s);
    return MOE_DISPATCH_AUTO;
}

static moe_backend_t backend_of(const char *s)
{
    if (!s || !strcmp(s, "auto"))
        return MOE_BACKEND_AUTO;
    if (!strcmp(s, "cpu"))
        return MOE_BACKEND_CPU;
    if (!strcmp(s, "cuda"))
        return MOE_BACKEND_CUDA;
    DIE("--backend %s: expected auto, cpu or cuda", s);
    return MOE_BACKEND_AUTO;
}

/* Buffers the layer reads and writes: host memory, or device memory for the CUDA backend. */
typedef struct io {
    int device;
    void *x, *y; /* what forward sees */
    float *hx, *hy;
} io_t;

static void io_setup(io_t *io, int cuda, const float *hx, int64_t n)
{
    io->device = cuda;
    io->hx = (float *)hx;
    io->hy = malloc(sizeof(float) * (size_t)(n + 1));
    if (!io->hy)
        DIE("out of host memory for %lld outputs", (long long)n);
    if (!cuda) {
        io->x = io->hx;
        io->y = io->hy;
        return;
    }
#ifdef MOE_HAVE_CUDA
    if (cudaMalloc(&io->x, sizeof(float) * (size_t)(n + 1)) != cudaSuccess ||
        cudaMalloc(&io->y, sizeof(float) * (size_t)(n + 1)) != cudaSuccess ||
        cudaMemcpy(io->x, hx, sizeof(float) * (size_t)n, cudaMemcpyHostToDevice) != cudaSuccess)
        DIE("cuda: cannot place %lld floats on the device", (long long)n);
#endif
}

static void io_fetch(io_t *io, int64_t n)
{
#ifdef MOE_HAVE_CUDA
    if (io->device && (cudaDeviceSynchronize() != cudaSuccess ||
                       cudaMemcpy(io->hy, io->y, sizeof(float) * (size_t)n,
                                  cudaMemcpyDeviceToHost) != cudaSuccess))
        DIE("cuda: cannot read the output back");
#else
    (void)io;
    (void)n;
#endif
}

static void io_free(io_t *io)
{
#ifdef MOE_HAVE_CUDA
    if (io->device) {
        cudaFree(io->x);
        cudaFree(io->y);
    }
#endif
    free(io->hy);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
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
    double phase_us[PH_N]; /* median over iterations, max over ranks */
    double checksum, abs_sum;
    uint64_t hash;
    double tokens_per_s;
} results_t;

static void time_steps(moe_layer_t *layer, const moe_forward_args_t *fa, const opts_t *o,
                       results_t *res)
{
    double *ph = calloc((size_t)o->iters * PH_N, sizeof(double)), med[PH_N], wall0, wall = 0;
    moe_layer_stats_t st;
    int i, p;

    if (!ph)
        DIE("out of memory");
    for (i = 0; i < o->warmup; i++)
        CHECK(moe_layer_forward(layer, fa));
    for (i = 0; i < o->iters; i++) {
        MPI_Barrier(MPI_COMM_WORLD);
        wall0 = MPI_Wtime();
        CHECK(moe_layer_forward(layer, fa));
        CHECK(moe_layer_synchronize(layer, NULL));
        CHECK(moe_layer_get_stats(layer, &st));
        MPI_Barrier(MPI_COMM_WORLD);
        wall += MPI_Wtime() - wall0;
        ph[PH_ROUTE * o->iters + i] = st.route_us;
        ph[PH_DISPATCH * o->iters + i] = st.dispatch_us;
        ph[PH_EXPERT * o->iters + i] = st.expert_us;
        ph[PH_COMBINE * o->iters + i] = st.combine_us;
        ph[PH_SHARED * o->iters + i] = st.shared_us;
        ph[PH_TOTAL * o->iters + i] = (MPI_Wtime() - wall0) * 1e6;
    }
    for (p = 0; p < PH_N; p++)
        med[p] = median(ph + p * o->iters, o->iters);
    MPI_Reduce(med, res->phase_us, PH_N, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    res->tokens_per_s = wall > 0 ? (double)o->tokens * o->iters / wall : 0;
    free(ph);
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
    char line[256], *all = NULL;
    int r;
    snprintf(line, sizeof(line), "#  %4d  %-16s %4d %5d  %-14s %8lld  %5d..%-5d %5d..%-5d %10.1f",
             ri->rank, ri->hostname, ri->device, ri->numa_node, ri->cpuset[0] ? ri->cpuset : "-",
             (long long)my_tokens, li->first_local_expert,
             li->first_local_expert + li->num_local_experts - 1, li->intermediate_begin,
             li->intermediate_end, li->weight_bytes / 1048576.0);
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

static void print_results(const opts_t *o, const results_t *r, const moe_runtime_info_t *ri,
                          const moe_layer_info_t *li)
{
    static const char *names[PH_N] = {"route", "dispatch", "expert", "combine", "shared", "total"};
    FILE *j;
    int p;
    printf("# phase (us, median of %d, max over ranks):", o->iters);
    for (p = 0; p < PH_N; p++)
        printf(" %s %.1f", names[p], r->phase_us[p]);
    printf("\ntokens/s %.1f\n", r->tokens_per_s);
    printf("checksum %.6e abs %.6e\n", r->checksum, r->abs_sum);
    printf("output_hash 0x%016llx\n", (unsigned long long)r->hash);
    if (!o->json)
        return;
    j = fopen(o->json, "w");
    if (!j)
        DIE("cannot write %s", o->json);
    fprintf(j,
            "{\n  \"backend\": \"%s\", \"ranks\": %d, \"ep\": %d, \"tp\": %d,\n"
            "  \"experts\": %d, \"top_k\": %d, \"hidden\": %d, \"intermediate\": %d,\n"
            "  \"dtype\": \"%s\", \"tokens\": %lld, \"iters\": %d,\n  \"phase_us\": {",
            moe_backend_name(ri->backend), ri->world_size, li->ep_size, li->tp_size,
            o->cfg.num_experts, o->cfg.top_k, o->cfg.hidden, o->cfg.intermediate, o->dtype,
            (long long)o->tokens, o->iters);
    for (p = 0; p < PH_N; p++)
        fprintf(j, "%s\"%s\": %.3f", p ? ", " : "", names[p], r->phase_us[p]);
    fprintf(j,
            "},\n  \"tokens_per_s\": %.3f,\n  \"checksum\": %.9e,\n  \"abs_sum\": %.9e,\n"
            "  \"output_hash\": \"0x%016llx\"\n}\n",
            r->tokens_per_s, r->checksum, r->abs_sum, (unsigned long long)r->hash);
    fclose(j);
}

int main(int argc, char **argv)
{
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    moe_runtime_t *rt = NULL;
    moe_layer_t *layer = NULL;
    moe_runtime_info_t ri;
    moe_layer_info_t li;
    moe_forward_args_t fa = MOE_FORWARD_ARGS_INIT;
    results_t res;
    opts_t o;
    io_t io = {0};
    float *x;
    int64_t t0, my_tokens;
    int world;

    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_g);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    parse(argc, argv, &o);
    rc.backend = backend_of(o.backend);
    rc.bind = o.bind;
    CHECK(moe_runtime_create_mpi(&rc, MPI_COMM_WORLD, &rt));
    CHECK(moe_runtime_get_info(rt, &ri));
#ifdef MOE_RUN_HAVE_MODEL
    if (o.model)
        CHECK(moe_run_model_config(o.model, o.layer_index, &o.cfg));
    if (o.input && !o.tokens_given) { /* the global batch is the file's tokens */
        moe_dtype_t dt;
        int64_t cols;
        CHECK(moe_safetensors_tensor_info(o.input, "hidden_states", &dt, &o.tokens, &cols));
    }
#else
    if (o.model)
        DIE("--model: this build has no checkpoint support");
#endif
    o.cfg.ep_size = o.ep;
    o.cfg.tp_size = o.tp;
    o.cfg.dispatch = dispatch_of(o.dispatch);
    o.cfg.deterministic = o.deterministic ? 1 : MOE_AUTO;
    /* The global batch split evenly: rank r gets tokens [t0, t0 + my_tokens). */
    t0 = o.tokens * rank_g / world;
    my_tokens = o.tokens * (rank_g + 1) / world - t0;
    o.cfg.max_tokens_per_rank = my_tokens > 0 ? my_tokens : 1;
    MPI_Allreduce(MPI_IN_PLACE, &o.cfg.max_tokens_per_rank, 1, MPI_INT64_T, MPI_MAX,
                  MPI_COMM_WORLD);
    CHECK(moe_layer_create(rt, &o.cfg, &layer));
    CHECK(moe_layer_get_info(layer, &li));
    if (rank_g == 0)
        printf(
            "# libmoe %d.%d.%d moe-run: backend %s%s, %d rank(s), ep %d x tp %d, dispatch %s%s\n"
            "# layer %s: E%d k%d H%d I%d shared %d (I %d) dtype %s scoring %s%s, "
            "tokens %lld, seed %llu\n",
            MOE_VERSION_MAJOR, MOE_VERSION_MINOR, MOE_VERSION_PATCH, moe_backend_name(ri.backend),
            ri.backend == MOE_BACKEND_CPU ? " (no GPU backend in use)" : "", world, li.ep_size,
            li.tp_size, o.dispatch ? o.dispatch : "auto", li.deterministic ? ", deterministic" : "",
            o.model ? o.model : o.preset, o.cfg.num_experts, o.cfg.top_k, o.cfg.hidden,
            o.cfg.intermediate, o.cfg.num_shared_experts, o.cfg.shared_intermediate,
            moe_dtype_name(o.cfg.weight_dtype),
            o.cfg.scoring == MOE_SCORING_SIGMOID ? "sigmoid" : "softmax",
            o.cfg.n_group > 1 ? " grouped" : "", (long long)o.tokens, (unsigned long long)o.seed);
    x = malloc(sizeof(float) * (size_t)(my_tokens * o.cfg.hidden + 1));
    if (!x)
        DIE("out of memory for %lld tokens", (long long)my_tokens);
#ifdef MOE_RUN_HAVE_MODEL
    if (o.model)
        CHECK(moe_run_model_load(layer, o.model, o.layer_index));
    else
        CHECK(moe_gen_set_weights(layer, &o.cfg, o.seed));
    /* tokens from --input (any layer), else random from --seed */
    CHECK(moe_run_model_tokens(o.input, o.seed, t0, my_tokens, o.cfg.hidden, x));
#else
    if (o.input)
        DIE("--input: this build has no safetensors support");
    CHECK(moe_gen_set_weights(layer, &o.cfg, o.seed));
    moe_gen_tokens(o.seed, t0, my_tokens, o.cfg.hidden, x);
#endif
    CHECK(moe_layer_get_info(layer, &li));
    print_rank_map(&ri, &li, my_tokens, world);
    io_setup(&io, ri.backend == MOE_BACKEND_CUDA, x, my_tokens * o.cfg.hidden);
    fa.num_tokens = my_tokens;
    fa.dtype = MOE_DTYPE_F32;
    fa.x = io.x;
    fa.y = io.y;
    memset(&res, 0, sizeof(res));
    time_steps(layer, &fa, &o, &res);
    io_fetch(&io, my_tokens * o.cfg.hidden);
    print_load(layer, o.cfg.num_experts);
    checksum(&io, my_tokens, o.cfg.hidden, world, &res);
#ifdef MOE_RUN_HAVE_MODEL
    if (o.output)
        CHECK(moe_run_model_write_output(o.output, io.hy, my_tokens, o.cfg.hidden));
#endif
    if (rank_g == 0)
        print_results(&o, &res, &ri, &li);
    fflush(stdout);
    io_free(&io);
    free(x);
    CHECK(moe_layer_destroy(layer));
    CHECK(moe_runtime_destroy(rt));
    MPI_Finalize();
    return 0;
}
