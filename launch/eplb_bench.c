/* SPDX-License-Identifier: Apache-2.0 */
/* moe-bench --eplb: expert placement measured through the public API (any backend that places
 * experts). Rank 0 prints.
 *
 * step: the EP step (forward + synchronize between barriers, median) of the layer at skewed
 * routing without redundant slots, and with R of them after one rebalance from warm-up steps,
 * with the rank load imbalance (rows per rank, max / mean) of each.
 * move: the weights a placement change moves per second: the rebalance above, and a shift of
 * every rank's slots to the next rank (every expert moves: the most a change can move), next to
 * the link's rate measured in the same run by plain MPI_Sendrecv of the same messages (each
 * matrix of each expert) between the same ranks, and as one message of the same bytes; the best
 * of as many passes as moves (at least 2). Rate = bytes this rank received / the change's wall
 * time, the slowest rank's. */
#include "eplb_bench.h"

#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "layer_gen.h"
#include "moe/moe.h"
#include "moe/moe_mpi.h"
#include "tool_check.h"

#define DIE(...)                                                                                   \
    do {                                                                                           \
        fprintf(stderr, "moe-bench --eplb: " __VA_ARGS__);                                         \
        fprintf(stderr, "\n");                                                                     \
        MPI_Abort(MPI_COMM_WORLD, 1);                                                              \
    } while (0)
#define MK(call) MOE_TOOL_OK("moe-bench --eplb", call)

typedef struct eplb_opts {
    moe_layer_config_t cfg;
    const char *preset;
    int64_t tokens; /* per rank */
    double skew;
    int redundant, iters, warmup, moves, help, step;
    moe_backend_t backend;
    char err[512];
} eplb_opts_t;

static int rank_g, world_g;

static void usage(void)
{
    printf("usage: mpirun -np N moe-bench --eplb [--preset NAME | --experts E --top-k K\n"
           "         --hidden H --intermediate I] [--tokens T] [--route-skew S]\n"
           "         [--redundant-experts R]"
           "         [--iters N] [--warmup N] [--moves N] [--no-step] [--backend cpu|cuda|auto]\n"
           "  step: the EP step at route skew S (default 1.2) without redundant slots and with R\n"
           "        (default: the EP size) after one rebalance from the warm-up steps' load;\n"
           "        T tokens per rank (default 256); --no-step skips it\n"
           "  move: the rebalance's weights per second, and of N (default 2) shifts of every\n"
           "        rank's slots to the next rank, against MPI_Sendrecv of the same messages\n");
}

static int parse(int argc, char **argv, eplb_opts_t *o)
{
    const moe_layer_config_t init = MOE_LAYER_CONFIG_INIT;
    int i, r;
    memset(o, 0, sizeof(*o));
    o->cfg = init;
    o->preset = "custom";
    o->cfg.num_experts = 64;
    o->cfg.top_k = 8;
    o->cfg.hidden = 1024;
    o->cfg.intermediate = 512;
    o->tokens = 256;
    o->skew = 1.2;
    o->redundant = -1;
    o->iters = 5;
    o->warmup = 1;
    o->moves = 2;
    o->step = 1;
    for (i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int64_t x;
        if (!strcmp(a, "--eplb"))
            continue;
        if (!strcmp(a, "-h") || !strcmp(a, "--help"))
            return o->help = 1, 0;
        if (!strcmp(a, "--no-step")) {
            o->step = 0;
            continue;
        }
        if (!v)
            return snprintf(o->err, sizeof(o->err), "%s needs a value (or is unknown)", a), -1;
        i++;
        r = moe_gen_shape_option(a, v, &o->cfg, &o->preset, o->err, sizeof(o->err));
        if (r == 0)
            return -1;
        if (r == 1)
            continue;
        if (!strcmp(a, "--tokens")) {
            if (moe_cli_int(a, v, 1, INT64_C(1) << 24, &o->tokens, o->err, sizeof(o->err)))
                return -1;
        } else if (!strcmp(a, "--route-skew")) {
            if (moe_cli_double(a, v, 0.0, 16.0, &o->skew, o->err, sizeof(o->err)))
                return -1;
        } else if (!strcmp(a, "--backend")) {
            o->backend = !strcmp(v, "cpu")    ? MOE_BACKEND_CPU
                         : !strcmp(v, "cuda") ? MOE_BACKEND_CUDA
                                              : MOE_BACKEND_AUTO;
            if (o->backend == MOE_BACKEND_AUTO && strcmp(v, "auto"))
                return snprintf(o->err, sizeof(o->err), "--backend %s: cpu, cuda or auto", v), -1;
        } else {
            int *f = !strcmp(a, "--redundant-experts") ? &o->redundant
                     : !strcmp(a, "--iters")           ? &o->iters
                     : !strcmp(a, "--warmup")          ? &o->warmup
                     : !strcmp(a, "--moves")           ? &o->moves
                                                       : NULL;
            if (!f)
                return snprintf(o->err, sizeof(o->err), "unknown option %s (see --help)", a), -1;
            if (moe_cli_int(a, v, f == &o->iters ? 1 : 0, 65536, &x, o->err, sizeof(o->err)))
                return -1;
            *f = (int)x;
        }
    }
    if (o->warmup < 1 && o->step)
        return snprintf(o->err, sizeof(o->err), "--warmup %d: the rebalance needs >= 1", o->warmup),
               -1;
    return 0;
}

static double max_all(double v)
{
    double m;
    MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return m;
}

/* Rows per rank of the layer's last forward: max / mean. */
static double imbalance(moe_layer_t *l)
{
    moe_layer_stats_t st;
    MK(moe_layer_get_stats(l, &st));
    return moe_cli_rank_imbalance(st.rows_received);
}

static double step_us(moe_layer_t *l, const moe_forward_args_t *a, int iters)
{
    double *t = malloc(sizeof(double) * (size_t)iters), med;
    int i;
    if (!t)
        DIE("out of memory");
    for (i = 0; i < iters; i++) {
        double t0;
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        MK(moe_layer_forward(l, a));
        MK(moe_layer_synchronize(l, NULL));
        MPI_Barrier(MPI_COMM_WORLD);
        t[i] = (MPI_Wtime() - t0) * 1e6;
    }
    moe_cli_sort(t, iters);
    med = t[iters / 2];
    free(t);
    return med;
}

/* The layer at skewed routing with `redundant` slots: step time and imbalance; with R > 0 after
 * a rebalance from the warm-up steps, whose placement stats are returned in *ps. */
static void step_case(moe_runtime_t *rt, const eplb_opts_t *o, int redundant, const float *x,
                      const float *logits, float *y, double *us, double *imb,
                      moe_placement_stats_t *ps)
{
    moe_layer_config_t c = o->cfg;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    moe_layer_t *l = NULL;
    int i;
    c.num_redundant_experts = redundant;
    c.max_tokens_per_rank = o->tokens;
    MK(moe_layer_create(rt, &c, &l));
    MK(moe_gen_set_weights_fast(l, &c, 0));
    a.num_tokens = o->tokens;
    a.x = x;
    a.y = y;
    a.router_logits = logits;
    for (i = 0; i < o->warmup; i++)
        MK(moe_layer_forward(l, &a));
    MK(moe_layer_synchronize(l, NULL));
    if (redundant > 0) {
        MK(moe_layer_rebalance(l));
        MK(moe_layer_get_placement_stats(l, ps));
    }
    *us = step_us(l, &a, o->iters);
    *imb = imbalance(l);
    moe_layer_destroy(l);
}

/* One expert's matrices on a rank: gate + up [I/tp, H] and down [H, I/tp], in the weight
 * dtype (bf16: 2 bytes). */
static size_t matrix_bytes(const moe_layer_config_t *c, int tp)
{
    return (size_t)c->intermediate / (size_t)tp * (size_t)c->hidden *
           moe_dtype_size(c->weight_dtype);
}

/* The link between EP rank g and g + 1, as the shift uses it, measured two ways, best of `reps`
 * passes each; the faster counts (bytes per second received, the slowest rank's): the same
 * messages (each matrix of `experts` experts) by MPI_Sendrecv one after the other, and their
 * bytes as one message (MPI_Sendrecv in pieces of at most 1 GiB). */
static double link_rate(const moe_layer_config_t *c, int tp, int experts, int reps, double *per_msg,
                        double *one_msg)
{
    const size_t mb = matrix_bytes(c, tp), total = mb * 3 * (size_t)experts;
    const size_t piece = (size_t)1 << 30;
    char *s = malloc(total), *r = malloc(total);
    const int to = (rank_g + tp) % world_g, from = (rank_g - tp + world_g) % world_g;
    double t0;
    size_t off;
    int i, rep;
    if (!s || !r)
        DIE("out of memory for %zu bytes", total);
    memset(s, 1, total);
    memset(r, 0, total);
    *per_msg = *one_msg = 0.0;
    for (rep = 0; rep < reps; rep++) { /* best of reps, as the moves */
        double rate;
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        for (i = 0; i < 3 * experts; i++)
            MPI_Sendrecv(s + (size_t)i * mb, (int)mb, MPI_BYTE, to, 1, r + (size_t)i * mb, (int)mb,
                         MPI_BYTE, from, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        rate = (double)total / max_all(MPI_Wtime() - t0);
        *per_msg = rate > *per_msg ? rate : *per_msg;
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        for (off = 0; off < total; off += piece) {
            const int n = (int)(total - off < piece ? total - off : piece);
            MPI_Sendrecv(s + off, n, MPI_BYTE, to, 2, r + off, n, MPI_BYTE, from, 2, MPI_COMM_WORLD,
                         MPI_STATUS_IGNORE);
        }
        rate = (double)total / max_all(MPI_Wtime() - t0);
        *one_msg = rate > *one_msg ? rate : *one_msg;
    }
    free(s);
    free(r);
    return *per_msg > *one_msg ? *per_msg : *one_msg;
}

static void move_case(moe_runtime_t *rt, const eplb_opts_t *o, int redundant)
{
    moe_layer_config_t c = o->cfg;
    moe_layer_info_t li;
    moe_placement_stats_t ps;
    moe_layer_t *l = NULL;
    int32_t *map, *next;
    int n, S, i, m;
    double best = 0.0, link, per_msg = 0.0, one_msg = 0.0;

    c.num_redundant_experts = redundant;
    c.max_tokens_per_rank = 1;
    MK(moe_layer_create(rt, &c, &l));
    MK(moe_gen_set_weights_fast(l, &c, 0));
    MK(moe_layer_get_info(l, &li));
    n = c.num_experts + redundant;
    S = n / li.ep_size;
    map = malloc(sizeof(int32_t) * (size_t)n);
    next = malloc(sizeof(int32_t) * (size_t)n);
    if (!map || !next)
        DIE("out of memory");
    MK(moe_layer_get_placement(l, map, n));
    for (m = 0; m < o->moves; m++) { /* EP rank g's slots go to g + 1 */
        for (i = 0; i < n; i++)
            next[(i + S) % n] = map[i];
        memcpy(map, next, sizeof(int32_t) * (size_t)n);
        MK(moe_layer_set_placement(l, map, n));
        MK(moe_layer_get_placement_stats(l, &ps));
        {
            const double rate = (double)ps.bytes_received / max_all(ps.seconds);
            double worst;
            MPI_Allreduce(&rate, &worst, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
            best = worst > best ? worst : best;
        }
    }
    link = li.ep_size > 1
               ? link_rate(&c, li.tp_size, S, o->moves > 2 ? o->moves : 2, &per_msg, &one_msg)
               : 0.0;
    if (rank_g == 0 && li.ep_size > 1)
        printf("move   shift of every rank's %d slots to the next rank: %.1f MiB received per "
               "rank, best of %d: %.2f GB/s\n"
               "link   MPI_Sendrecv of %d slots' matrices (%.1f MiB): %d messages %.2f GB/s, one "
               "message %.2f GB/s\n"
               "move/link %.2f\n",
               S, (double)ps.bytes_received / 1048576.0, o->moves, best / 1e9, S,
               (double)matrix_bytes(&c, li.tp_size) * 3 * S / 1048576.0, 3 * S, per_msg / 1e9,
               one_msg / 1e9, link > 0 ? best / link : 0.0);
    else if (rank_g == 0)
        printf("move   one EP rank: nothing to move between ranks\n");
    free(map);
    free(next);
    moe_layer_destroy(l);
}

int moe_eplb_bench_main(int argc, char **argv)
{
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    moe_runtime_t *rt = NULL;
    moe_placement_stats_t ps;
    eplb_opts_t o;
    float *x = NULL, *y = NULL, *lg = NULL;
    double us0 = 0, us1 = 0, imb0 = 0, imb1 = 0;
    int bad, R;

    MPI_Comm_rank(MPI_COMM_WORLD, &rank_g);
    MPI_Comm_size(MPI_COMM_WORLD, &world_g);
    bad = parse(argc, argv, &o) != 0;
    {
        const moe_layer_config_t *c = &o.cfg;
        const moe_cli_field_t f[] = {
            {"--help", o.help, 0},
            {"--experts", c->num_experts, 0},
            {"--top-k", c->top_k, 0},
            {"--hidden", c->hidden, 0},
            {"--intermediate", c->intermediate, 0},
            {"--preset", moe_cli_hash(o.preset), 1},
            {"--tokens", o.tokens, 0},
            {"--route-skew (x 1e6)", (int64_t)(o.skew * 1e6), 0},
            {"--redundant-experts", o.redundant, 0},
            {"--iters", o.iters, 0},
            {"--warmup", o.warmup, 0},
            {"--moves", o.moves, 0},
            {"--no-step", !o.step, 0},
            {"--backend", o.backend, 0},
        };
        if (moe_cli_agree("moe-bench --eplb", bad, o.err, f, (int)(sizeof(f) / sizeof(f[0]))))
            return 2;
    }
    if (o.help) {
        if (rank_g == 0)
            usage();
        return 0;
    }
    rc.backend = o.backend;
    MK(moe_runtime_create_mpi(&rc, MPI_COMM_WORLD, &rt));
    {
        moe_runtime_info_t ri;
        MK(moe_runtime_get_info(rt, &ri));
        /* the same verdict on every rank: the runtime's backend is agreed */
        if (o.step && ri.backend == MOE_BACKEND_CUDA)
            DIE("the step case passes host buffers, the CPU backend's; on the "
                "CUDA backend use --no-step (the moves alone) or moe-run --eplb, or --backend cpu");
    }
    R = o.redundant >= 0 ? o.redundant : world_g;
    if (rank_g == 0)
        printf("# moe-bench --eplb: %d rank(s), layer %s E%d k%d H%d I%d %s, %lld tokens per "
               "rank, route skew %g, %d redundant slot(s)\n",
               world_g, o.preset, o.cfg.num_experts, o.cfg.top_k, o.cfg.hidden, o.cfg.intermediate,
               moe_dtype_name(o.cfg.weight_dtype), (long long)o.tokens, o.skew, R);
    if (o.step) {
        const size_t nx = (size_t)o.tokens * (size_t)o.cfg.hidden;
        x = malloc(sizeof(float) * nx);
        y = malloc(sizeof(float) * nx);
        lg = malloc(sizeof(float) * (size_t)o.tokens * (size_t)o.cfg.num_experts);
        if (!x || !y || !lg)
            DIE("out of memory for %lld tokens", (long long)o.tokens);
        moe_gen_tokens(1, o.tokens * rank_g, o.tokens, o.cfg.hidden, x);
        moe_gen_skewed_logits(1, o.tokens * rank_g, o.tokens, o.cfg.num_experts, o.skew, lg);
        memset(&ps, 0, sizeof(ps));
        step_case(rt, &o, 0, x, lg, y, &us0, &imb0, &ps);
        step_case(rt, &o, R, x, lg, y, &us1, &imb1, &ps);
        {
            const double rate = ps.seconds > 0 ? (double)ps.bytes_received / ps.seconds : 0.0;
            double s = max_all(ps.seconds), mib = max_all(ps.bytes_received / 1048576.0), mn;
            MPI_Allreduce(&rate, &mn, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
            if (rank_g == 0)
                printf("step   without EPLB: %.1f us, imbalance %.3f | R %d + rebalance: %.1f us, "
                       "imbalance %.3f | speedup %.2f\n"
                       "move   rebalance: %.3f s, %.1f MiB received (max over ranks)\n",
                       us0, imb0, R, us1, imb1, us1 > 0 ? us0 / us1 : 0.0, s, mib);
            (void)mn;
        }
    }
    if (o.moves > 0)
        move_case(rt, &o, R);
    free(x);
    free(y);
    free(lg);
    moe_runtime_destroy(rt);
    return 0;
}
