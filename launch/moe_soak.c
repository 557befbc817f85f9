/* SPDX-License-Identifier: Apache-2.0 */
/* moe-soak: N layers stepped for a given time with a random token count per rank every step,
 * max_tokens_across_ranks told or not at random, outputs checked against the one-rank CPU
 * reference every K steps, and host RSS (and device memory) reported as it runs
 * (docs/RELIABILITY.md, "Soak"). A program, not a test: it runs for minutes. */
#ifdef MOE_HAVE_CUDA
#include <cuda_runtime.h>
#endif
#include <math.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "layer_gen.h"
#include "moe/moe.h"
#include "moe/moe_mpi.h"

#define MAX_LAYERS 64

typedef struct opts {
    int64_t seconds, layers, every, cap, seed, report;
    int cuda;
    moe_layer_config_t cfg;
} opts_t;

static int rank_g, world_g;

/* Ends the job: a soak failure is one rank's own finding, and its peers may wait in a step. */
#define DIE(...)                                                                                   \
    do {                                                                                           \
        fprintf(stderr, "moe-soak: rank %d: ", rank_g);                                            \
        fprintf(stderr, __VA_ARGS__);                                                              \
        fprintf(stderr, "\n");                                                                     \
        fflush(stderr);                                                                            \
        MPI_Abort(MPI_COMM_WORLD, 1);                                                              \
        exit(1);                                                                                   \
    } while (0)

#define CHECK(call)                                                                                \
    do {                                                                                           \
        moe_status_t st_ = (call);                                                                 \
        if (st_ != MOE_STATUS_SUCCESS)                                                             \
            DIE("%s: %s (%s)", #call, moe_status_string(st_), moe_last_error());                   \
    } while (0)

/* xorshift64*: per rank (token counts) and shared (what every rank must agree on). */
static uint64_t next(uint64_t *s)
{
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ULL;
}

/* Resident set of this process, in KiB (/proc/self/status VmRSS; -1 where unknown). */
static int64_t rss_kib(void)
{
    char line[256];
    long long v = -1;
    FILE *f = fopen("/proc/self/status", "r");
    if (!f)
        return -1;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "VmRSS: %lld kB", &v) == 1)
            break;
    fclose(f);
    return v;
}

/* Device memory in use on this rank's GPU, in KiB (-1 without one). */
static int64_t device_used_kib(int cuda)
{
#ifdef MOE_HAVE_CUDA
    size_t fr = 0, tot = 0;
    if (cuda && cudaMemGetInfo(&fr, &tot) == cudaSuccess)
        return (int64_t)((tot - fr) / 1024);
#endif
    (void)cuda;
    return -1;
}

static int parse(int argc, char **argv, opts_t *o, char *err, size_t len)
{
    int i;
    const char *preset = NULL;
    o->seconds = 600, o->layers = 4, o->every = 16, o->cap = 96, o->seed = 1, o->report = 60;
    o->cuda = 0;
    o->cfg = (moe_layer_config_t)MOE_LAYER_CONFIG_INIT;
    o->cfg.num_experts = 16, o->cfg.top_k = 4, o->cfg.hidden = 256, o->cfg.intermediate = 256;
    o->cfg.num_shared_experts = 1, o->cfg.shared_intermediate = 256;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int r;
        if (!v) {
            snprintf(err, len, "%s: needs a value", a);
            return -1;
        }
        i++;
        if ((r = moe_gen_shape_option(a, v, &o->cfg, &preset, err, len)) >= 0) {
            if (!r)
                return -1;
        } else if (!strcmp(a, "--seconds")) {
            if (moe_cli_int(a, v, 1, 7 * 86400, &o->seconds, err, len))
                return -1;
        } else if (!strcmp(a, "--layers")) {
            if (moe_cli_int(a, v, 1, MAX_LAYERS, &o->layers, err, len))
                return -1;
        } else if (!strcmp(a, "--check-every")) {
            if (moe_cli_int(a, v, 1, 1 << 20, &o->every, err, len))
                return -1;
        } else if (!strcmp(a, "--capacity")) {
            if (moe_cli_int(a, v, 1, 1 << 16, &o->cap, err, len))
                return -1;
        } else if (!strcmp(a, "--seed")) {
            if (moe_cli_int(a, v, 0, INT64_MAX, &o->seed, err, len))
                return -1;
        } else if (!strcmp(a, "--report")) {
            if (moe_cli_int(a, v, 1, 86400, &o->report, err, len))
                return -1;
        } else if (!strcmp(a, "--backend")) {
            if (strcmp(v, "cpu") && strcmp(v, "cuda")) {
                snprintf(err, len, "--backend %s: expected cpu or cuda", v);
                return -1;
            }
            o->cuda = !strcmp(v, "cuda");
        } else {
            snprintf(err, len,
                     "unknown option %s (--seconds --layers --check-every --capacity "
                     "--seed --report --backend --preset --experts --top-k --hidden "
                     "--intermediate)",
                     a);
            return -1;
        }
    }
    o->cfg.max_tokens_per_rank = o->cap;
    return 0;
}

/* ||a - b|| / ||b|| over n values (the GPU tests' measure; a NaN anywhere: inf). */
static double rel_err(const float *a, const float *b, int64_t n)
{
    double num = 0, den = 0;
    int64_t i;
    for (i = 0; i < n; i++) {
        const double d = (double)a[i] - (double)b[i];
        if (isnan(a[i]) || isnan(b[i]))
            return INFINITY;
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

typedef struct io {
    float *x, *y, *ref;
    int32_t *ids, *ref_ids; /* the step's routing (check steps), [n, top_k] */
    float *w, *ref_w;
    void *dx, *dy, *dids, *dw; /* device copies (cuda) */
} io_t;

/* One step of layer l; with `route` its routing comes back too (ids, w). */
static void forward(const opts_t *o, moe_layer_t *l, io_t *io, int64_t n, int64_t told, int route)
{
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    const size_t nk = (size_t)n * (size_t)o->cfg.top_k;
    a.num_tokens = n;
    a.dtype = MOE_DTYPE_F32;
    a.x = o->cuda ? io->dx : io->x;
    a.y = o->cuda ? io->dy : io->y;
    a.max_tokens_across_ranks = told;
    if (route) {
        a.topk_ids = o->cuda ? (int32_t *)io->dids : io->ids;
        a.topk_weights = o->cuda ? (float *)io->dw : io->w;
    }
    CHECK(moe_layer_forward(l, &a));
    CHECK(moe_layer_synchronize(l, NULL));
#ifdef MOE_HAVE_CUDA
    if (o->cuda && n &&
        (cudaMemcpy(io->y, io->dy, sizeof(float) * (size_t)(n * o->cfg.hidden),
                    cudaMemcpyDeviceToHost) != cudaSuccess ||
         (route &&
          (cudaMemcpy(io->ids, io->dids, sizeof(int32_t) * nk, cudaMemcpyDeviceToHost) !=
               cudaSuccess ||
           cudaMemcpy(io->w, io->dw, sizeof(float) * nk, cudaMemcpyDeviceToHost) != cudaSuccess))))
        DIE("cuda: cannot read y back");
#else
    (void)nk;
#endif
}

/* The token of [n, h] rows whose relative error is largest (*worst its error); *over: how many
 * tokens are over `bound`. For a failure's report: one bad row or a whole bad batch. */
static int64_t worst_token(const float *a, const float *b, int64_t n, int64_t h, double bound,
                           double *worst, int64_t *over)
{
    int64_t t, at = -1;
    *worst = 0;
    *over = 0;
    for (t = 0; t < n; t++) {
        const double e = rel_err(a + t * h, b + t * h, h);
        *over += !(e <= bound);
        if (at < 0 || !(e <= *worst)) {
            *worst = e;
            at = t;
        }
    }
    return at;
}

/* Tokens whose set of k experts differs between ids and ref (a near-tie of router scores
 * decided the other way: the GPU computes the logits on tensor cores, the reference in f32). */
static int64_t routing_flips(const int32_t *ids, const int32_t *ref, int64_t n, int k)
{
    int64_t t, flips = 0;
    for (t = 0; t < n; t++) {
        int j, i, same = 1;
        for (j = 0; j < k && same; j++) {
            int found = 0;
            for (i = 0; i < k; i++)
                found |= ids[t * k + j] == ref[t * k + i];
            same = found;
        }
        flips += !same;
    }
    return flips;
}

int main(int argc, char **argv)
{
    opts_t o;
    char err[512] = "";
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT, rc_ref = MOE_RUNTIME_CONFIG_INIT;
    moe_runtime_t *rt = NULL, *ref_rt = NULL;
    moe_layer_t *layer[MAX_LAYERS], *ref[MAX_LAYERS];
    moe_layer_config_t ref_cfg;
    io_t io;
    uint64_t mine, shared;
    int64_t step = 0, checks = 0, told_steps = 0, tokens = 0, rss0 = -1, dev0 = -1, i, bad;
    int64_t flips = 0; /* tokens whose routing was a near-tie decided the other way */
    double t0, last, worst = 0;
    int l;

    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank_g);
    MPI_Comm_size(MPI_COMM_WORLD, &world_g);
    bad = parse(argc, argv, &o, err, sizeof(err)) != 0;
    {
        moe_cli_field_t f[] = {{"--seconds", o.seconds, 0},
                               {"--layers", o.layers, 0},
                               {"--check-every", o.every, 0},
                               {"--capacity", o.cap, 0},
                               {"--seed", o.seed, 0},
                               {"--backend", o.cuda, 0},
                               {"--experts", o.cfg.num_experts, 0},
                               {"--top-k", o.cfg.top_k, 0},
                               {"--hidden", o.cfg.hidden, 0},
                               {"--intermediate", o.cfg.intermediate, 0}};
        if (moe_cli_agree("moe-soak", (int)bad, err, f, (int)(sizeof(f) / sizeof(f[0])))) {
            MPI_Finalize();
            return 2;
        }
    }
    rc.backend = o.cuda ? MOE_BACKEND_CUDA : MOE_BACKEND_CPU;
    rc_ref.backend = MOE_BACKEND_CPU; /* the reference: one rank, the CPU backend */
    CHECK(moe_runtime_create_mpi(&rc, MPI_COMM_WORLD, &rt));
    CHECK(moe_runtime_create_mpi(&rc_ref, MPI_COMM_SELF, &ref_rt));
    ref_cfg = o.cfg;
    ref_cfg.ep_size = ref_cfg.tp_size = MOE_AUTO;
    for (l = 0; l < o.layers; l++) {
        moe_layer_config_t c = o.cfg;
        /* vary what the layers exchange: AUTO (all-gather for small steps, all-to-all for
         * large), and every third layer deterministic */
        c.deterministic = l % 3 == 2;
        ref_cfg.deterministic = c.deterministic;
        CHECK(moe_layer_create(rt, &c, &layer[l]));
        CHECK(moe_gen_set_weights(layer[l], &c, (uint64_t)o.seed + (uint64_t)l));
        CHECK(moe_layer_create(ref_rt, &ref_cfg, &ref[l]));
        CHECK(moe_gen_set_weights(ref[l], &ref_cfg, (uint64_t)o.seed + (uint64_t)l));
    }
    const size_t vals = (size_t)(o.cap * o.cfg.hidden) + 1;
    io.x = malloc(sizeof(float) * vals);
    io.y = malloc(sizeof(float) * vals);
    io.ref = malloc(sizeof(float) * vals);
    const size_t kvals = (size_t)(o.cap * o.cfg.top_k) + 1;
    io.ids = malloc(sizeof(int32_t) * kvals);
    io.ref_ids = malloc(sizeof(int32_t) * kvals);
    io.w = malloc(sizeof(float) * kvals);
    io.ref_w = malloc(sizeof(float) * kvals);
    io.dx = io.dy = io.dids = io.dw = NULL;
    if (!io.x || !io.y || !io.ref || !io.ids || !io.ref_ids || !io.w || !io.ref_w)
        DIE("out of host memory");
#ifdef MOE_HAVE_CUDA
    if (o.cuda && (cudaMalloc(&io.dx, sizeof(float) * vals) != cudaSuccess ||
                   cudaMalloc(&io.dy, sizeof(float) * vals) != cudaSuccess ||
                   cudaMalloc(&io.dids, sizeof(int32_t) * kvals) != cudaSuccess ||
                   cudaMalloc(&io.dw, sizeof(float) * kvals) != cudaSuccess))
        DIE("cuda: cannot allocate x and y");
#endif
    mine = 0x9E3779B97F4A7C15ULL ^ ((uint64_t)o.seed * 1000003u + (uint64_t)rank_g + 1);
    shared = 0xD1B54A32D192ED03ULL ^ (uint64_t)o.seed;
    if (rank_g == 0)
        printf("moe-soak: %d ranks, backend %s, %lld layers E%d k%d H%d I%d (+1 shared), capacity "
               "%lld, check every %lld steps, %lld s\n",
               world_g, o.cuda ? "cuda" : "cpu", (long long)o.layers, o.cfg.num_experts,
               o.cfg.top_k, o.cfg.hidden, o.cfg.intermediate, (long long)o.cap, (long long)o.every,
               (long long)o.seconds);
    t0 = last = MPI_Wtime();
    for (;;) {
        int64_t n = (int64_t)(next(&mine) % (uint64_t)(o.cap + 1)), told = 0, m;
        int done, check = step % o.every == 0;
        /* one rank in eight steps idle now and then: 0 tokens are part of the contract */
        if (next(&mine) % 8 == 0)
            n = 0;
        if (next(&shared) % 2) { /* told: the agreed maximum, or any bound above it */
            CHECK(moe_runtime_max_tokens(rt, n, &m));
            told = m + (int64_t)(next(&shared) % (uint64_t)(o.cap - m + 1)); /* 0: untold */
            told_steps++;
        }
        moe_gen_tokens((uint64_t)o.seed ^ (uint64_t)step, (int64_t)rank_g * o.cap, n, o.cfg.hidden,
                       io.x);
#ifdef MOE_HAVE_CUDA
        if (o.cuda && n &&
            cudaMemcpy(io.dx, io.x, sizeof(float) * (size_t)(n * o.cfg.hidden),
                       cudaMemcpyHostToDevice) != cudaSuccess)
            DIE("cuda: cannot place x");
#endif
        for (l = 0; l < o.layers; l++) {
            for (i = 0; i < n * o.cfg.hidden; i++)
                io.y[i] = NAN; /* poisoned: a row never written fails the check */
            forward(&o, layer[l], &io, n, told, check);
            if (check) {
                moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
                double e, e_own = 0;
                int64_t f;
                a.num_tokens = n;
                a.dtype = MOE_DTYPE_F32;
                a.x = io.x;
                a.y = io.ref;
                a.topk_ids = io.ref_ids;
                a.topk_weights = io.ref_w;
                CHECK(moe_layer_forward(ref[l], &a));
                f = routing_flips(io.ids, io.ref_ids, n, o.cfg.top_k);
                if (f > 0) {
                    /* near-ties decided the other way: the reference again, with the routing
                     * this layer chose, so the experts' arithmetic is still checked exactly */
                    e_own = rel_err(io.y, io.ref, n * o.cfg.hidden);
                    a.topk_ids = NULL;
                    a.topk_weights = NULL;
                    a.given_topk_ids = io.ids;
                    a.given_topk_weights = io.w;
                    CHECK(moe_layer_forward(ref[l], &a));
                    flips += f;
                }
                e = rel_err(io.y, io.ref, n * o.cfg.hidden);
                worst = e > worst ? e : worst;
                /* the CPU backend computes as the reference does; the GPU's bf16 GEMMs round
                 * their inputs and h (test_gpu_ep's bound) */
                if (!(e <= (o.cuda ? 1e-2 : 1e-4))) {
                    char how[512] = "";
                    double te;
                    int64_t over, wt = worst_token(io.y, io.ref, n, o.cfg.hidden,
                                                   o.cuda ? 1e-2 : 1e-4, &te, &over);
                    (void)moe_layer_explain(layer[l], n, how, sizeof(how));
                    DIE("step %lld layer %d (%lld tokens, told %lld): output differs from the "
                        "CPU reference by %.3g (relative, L2; %lld tokens routed otherwise than "
                        "the reference's, error with the reference's own routing %.3g); %lld "
                        "tokens over the bound, the worst token %lld at %.3g; the step: %s",
                        (long long)step, l, (long long)n, (long long)told, e, (long long)f,
                        f ? e_own : e, (long long)over, (long long)wt, te, how);
                }
            }
        }
        checks += check;
        tokens += n;
        step++;
        { /* every rank decides together when to report and when to stop */
            double now = MPI_Wtime(), t[1] = {now};
            MPI_Bcast(t, 1, MPI_DOUBLE, 0, MPI_COMM_WORLD);
            done = t[0] - t0 >= (double)o.seconds;
            if (t[0] - last >= (double)o.report || done) {
                int64_t v[5] = {rss_kib(), device_used_kib(o.cuda), 0, 0, flips}, mx[5], mn[5],
                        sum[5];
                v[2] = tokens, v[3] = (int64_t)(worst * 1e15); /* < 9e3: a larger one died */
                MPI_Allreduce(v, mx, 5, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
                MPI_Allreduce(v, mn, 5, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
                MPI_Allreduce(v, sum, 5, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
                if (rss0 < 0) { /* the first report ends the warm-up: the reference for "flat" */
                    rss0 = mx[0];
                    dev0 = mx[1];
                }
                if (rank_g == 0) {
                    printf("t=%6.0fs steps=%lld checked=%lld told=%lld tokens/rank<=%lld "
                           "rss_kib=%lld..%lld dev_kib=%lld..%lld worst_rel_err=%.2e "
                           "routing_ties=%lld\n",
                           t[0] - t0, (long long)step, (long long)checks, (long long)told_steps,
                           (long long)mx[2], (long long)mn[0], (long long)mx[0], (long long)mn[1],
                           (long long)mx[1], (double)mx[3] * 1e-15, (long long)sum[4]);
                    fflush(stdout);
                }
                last = t[0];
                if (done) {
                    if (rank_g == 0)
                        printf("moe-soak: ok: %lld steps x %lld layers, %lld checked against "
                               "the CPU reference; host RSS after warm-up %lld KiB, at the end "
                               "%lld KiB (%+lld); device %lld KiB, at the end %lld KiB (%+lld)\n",
                               (long long)step, (long long)o.layers, (long long)checks,
                               (long long)rss0, (long long)mx[0], (long long)(mx[0] - rss0),
                               (long long)dev0, (long long)mx[1], (long long)(mx[1] - dev0));
                    break;
                }
            }
        }
    }
    for (l = 0; l < o.layers; l++) {
        CHECK(moe_layer_destroy(layer[l]));
        CHECK(moe_layer_destroy(ref[l]));
    }
#ifdef MOE_HAVE_CUDA
    if (o.cuda) {
        cudaFree(io.dx);
        cudaFree(io.dy);
        cudaFree(io.dids);
        cudaFree(io.dw);
    }
#endif
    free(io.x);
    free(io.y);
    free(io.ref);
    free(io.ids);
    free(io.ref_ids);
    free(io.w);
    free(io.ref_w);
    CHECK(moe_runtime_destroy(ref_rt));
    CHECK(moe_runtime_destroy(rt));
    MPI_Finalize();
    return 0;
}
