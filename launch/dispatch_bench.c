/* SPDX-License-Identifier: Apache-2.0 */
/* moe-bench --dispatch-only: the expert-parallel dispatch and combine of a layer across the
 * ranks (one per GPU), per tokens/rank, next to NCCL's own all-to-all of the same bytes
 * (grouped ncclSend/ncclRecv, graph-replayed) measured in the same run. Rank 0 prints.
 *
 * dispatch = the layer's phase from routing done to the expert rows gathered (all-gather of
 * the tokens + ids, local ids, permute, gather); combine = rows scattered, reduce-scatter back,
 * weighted sum. Both from one step profiled with MOE_PROFILE=1 (events), median over steps.
 * The "same bytes" are the logical payload: tokens x top_k x hidden x 2 bytes per rank each
 * way. This program links NCCL and CUDA itself (a benchmark, not the library). */
#define _POSIX_C_SOURCE 200809L
#include "dispatch_bench.h"

#include <stdio.h>

#ifndef MOE_HAVE_NCCL
int moe_dispatch_bench_main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    fprintf(stderr, "moe-bench --dispatch-only: this build has no NCCL\n");
    return 2;
}
#else
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "kernels/a2a.h"
#include "layer_gen.h"
#include "moe/moe.h"
#include "moe/moe_mpi.h"

#define DIE(...)                                                                                   \
    do {                                                                                           \
        fprintf(stderr, "moe-bench --dispatch-only: " __VA_ARGS__);                                \
        fprintf(stderr, "\n");                                                                     \
        MPI_Abort(MPI_COMM_WORLD, 1);                                                              \
    } while (0)
#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            DIE("%s: %s", #call, cudaGetErrorString(e_));                                          \
    } while (0)
#define NK(call)                                                                                   \
    do {                                                                                           \
        ncclResult_t r_ = (call);                                                                  \
        if (r_ != ncclSuccess)                                                                     \
            DIE("%s: %s", #call, ncclGetErrorString(r_));                                          \
    } while (0)
#define MK(call)                                                                                   \
    do {                                                                                           \
        moe_status_t s_ = (call);                                                                  \
        if (s_ != MOE_STATUS_SUCCESS)                                                              \
            DIE("%s: %s: %s", #call, moe_status_string(s_), moe_last_error());                     \
    } while (0)

/* `g` instantiated and replayed (a few warm-up launches, then each timed by events after a
 * barrier); median microseconds. Destroys g. */
static double replay_us(cudaGraph_t g, cudaStream_t s, int iters)
{
    cudaGraphExec_t ge;
    cudaEvent_t e0, e1;
    double *t = malloc(sizeof(double) * (size_t)iters), med;
    float ms;
    int i;
    CK(cudaGraphInstantiate(&ge, g, 0));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (i = 0; i < 5; i++)
        CK(cudaGraphLaunch(ge, s));
    CK(cudaStreamSynchronize(s));
    for (i = 0; i < iters; i++) {
        MPI_Barrier(MPI_COMM_WORLD);
        CK(cudaEventRecord(e0, s));
        CK(cudaGraphLaunch(ge, s));
        CK(cudaEventRecord(e1, s));
        CK(cudaEventSynchronize(e1));
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t[i] = ms * 1e3;
    }
    moe_cli_sort(t, iters);
    med = t[iters / 2];
    free(t);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    return med;
}

/* NCCL grouped send/recv all-to-all of `bytes` per rank (split evenly over the peers),
 * captured once in a graph and replayed; median microseconds. */
static double nccl_a2a_us(ncclComm_t comm, int world, size_t bytes, void *sbuf, void *rbuf,
                          cudaStream_t s, int iters)
{
    const size_t per = bytes / (size_t)world;
    cudaGraph_t g;
    int p;

    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    NK(ncclGroupStart());
    for (p = 0; p < world; p++) {
        NK(ncclSend((char *)sbuf + per * p, per, ncclUint8, p, comm, s));
        NK(ncclRecv((char *)rbuf + per * p, per, ncclUint8, p, comm, s));
    }
    NK(ncclGroupEnd());
    CK(cudaStreamEndCapture(s, &g));
    return replay_us(g, s, iters);
}

/* --max-tokens T (default: the largest size), --capacity C (max_tokens_per_rank of every
 * point's layer, as a serving engine sets it; default: the point's own token count),
 * --told (pass max_tokens_across_ranks = the point's tokens), --ask (get it from
 * moe_runtime_max_tokens before every step, as a caller that does not know it would; the wall
 * column then includes that all-reduce) and --round-tokens R (the
 * layers' ep_round_tokens, at most each point's capacity; 0: the library's default), checked
 * and agreed among the ranks before the first collective; nonzero (after one message) on a
 * bad or mismatched one. */
static const char *const transport_names[] = {"allgather", "lsa", "p2p", "lsa-ll", "p2p-hdr"};
/* lsa-ll: lsa with MOE_EP_LL=1, at up to 128 rows per rank; p2p-hdr: p2p with
 * MOE_EP_P2P_HEADER=1 (whole regions, sizes in-band, no host read) */
enum { NT = 5, LSA_LL = 3, P2P_HDR = 4 };
/* how a step learns max_tokens_across_ranks: not at all, from the caller, by asking */
enum { UNTOLD = 0, TOLD = 1, ASK = 2 };

static int agree_options(int argc, char **argv, int64_t largest, int64_t *tmax, int64_t *cap,
                         int *told, int *transport, int64_t *round)
{
    char err[256] = "";
    int i, j, bad = 0;
    moe_cli_field_t f[5] = {{"--max-tokens", 0, 0},
                            {"--capacity", 0, 0},
                            {"--told/--ask", 0, 0},
                            {"--transport", 0, 0},
                            {"--round-tokens", 0, 0}};

    *tmax = largest;
    *cap = 0;
    *round = 0;
    *told = 0;
    *transport = -1; /* all */
    for (i = 1; i < argc && !bad; i++) {
        if (!strcmp(argv[i], "--dispatch-only"))
            continue;
        if (!strcmp(argv[i], "--told") || !strcmp(argv[i], "--ask")) {
            const int mode = argv[i][2] == 't' ? TOLD : ASK;
            if (*told && *told != mode)
                bad = snprintf(err, sizeof(err), "--told and --ask: one or the other") > 0;
            *told = mode;
        } else if (!strcmp(argv[i], "--transport") && i + 1 < argc) {
            const char *v = argv[++i];
            for (j = 0; j < NT && strcmp(v, transport_names[j]); j++)
                ;
            if (j < NT)
                *transport = j;
            else if (strcmp(v, "all"))
                bad =
                    snprintf(err, sizeof(err),
                             "--transport %s: expected all, allgather, lsa, p2p, lsa-ll or p2p-hdr",
                             v) > 0;
        } else if (!strcmp(argv[i], "--max-tokens") && i + 1 < argc)
            bad = moe_cli_int("--max-tokens", argv[++i], 1, INT64_C(1) << 30, tmax, err,
                              sizeof(err)) != 0;
        else if (!strcmp(argv[i], "--capacity") && i + 1 < argc)
            bad = moe_cli_int("--capacity", argv[++i], 1, INT64_C(1) << 20, cap, err,
                              sizeof(err)) != 0;
        else if (!strcmp(argv[i], "--round-tokens") && i + 1 < argc)
            bad = moe_cli_int("--round-tokens", argv[++i], 0, INT64_C(1) << 20, round, err,
                              sizeof(err)) != 0;
        else
            bad = snprintf(err, sizeof(err), "--dispatch-only: unknown option %s", argv[i]) > 0;
    }
    if (!bad && *cap && *cap < *tmax && *tmax != largest)
        bad = snprintf(err, sizeof(err), "--capacity %lld is below --max-tokens %lld",
                       (long long)*cap, (long long)*tmax) > 0;
    f[0].value = *tmax;
    f[1].value = *cap;
    f[2].value = *told;
    f[3].value = *transport;
    f[4].value = *round;
    return moe_cli_agree("moe-bench --dispatch-only", bad, err, f, 5);
}

/* Two ranks on one GPU (the device machine's one-GPU case, MPS or time slicing): 0 when no two
 * ranks share one, else 1: NCCL refuses them, so the bench then runs the lsa transports alone;
 * or 2 when every rank has its own NCCL_HOSTID (bench/shared_gpu_rank.sh), so NCCL takes them
 * for hosts and joins them over sockets: every transport runs, at socket speed. */
static int ranks_share_gpu(int world)
{
    typedef struct {
        char bus[32], host[96]; /* PCI bus id; NCCL_HOSTID ("" when unset) */
    } gpu_id_t;
    gpu_id_t mine = {{0}, {0}}, *all = calloc((size_t)world, sizeof(gpu_id_t));
    const char *host = getenv("NCCL_HOSTID");
    int dev = 0, r, q, shared = 0, hosts = 1;
    CK(cudaGetDevice(&dev));
    CK(cudaDeviceGetPCIBusId(mine.bus, sizeof(mine.bus), dev));
    snprintf(mine.host, sizeof(mine.host), "%s", host ? host : "");
    MPI_Allgather(&mine, sizeof(mine), MPI_BYTE, all, sizeof(mine), MPI_BYTE, MPI_COMM_WORLD);
    for (r = 0; r < world; r++)
        for (q = r + 1; q < world; q++) {
            shared |= !strcmp(all[r].bus, all[q].bus);
            hosts &= all[r].host[0] && strcmp(all[r].host, all[q].host);
        }
    free(all);
    return shared ? 1 + hosts : 0;
}

/* What the caller sees, unprofiled: the median of forward + synchronize (after a barrier), as
 * the first table was taken; with `ask`, moe_runtime_max_tokens on it first. t: scratch
 * [iters]. */
static double wall_us(moe_layer_t *layer, moe_forward_args_t *a, moe_runtime_t *ask, double *t,
                      int iters)
{
    int it;
    for (it = 0; it < iters; it++) {
        double t0;
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = MPI_Wtime();
        if (ask)
            MK(moe_runtime_max_tokens(ask, a->num_tokens, &a->max_tokens_across_ranks));
        MK(moe_layer_forward(layer, a));
        MK(moe_layer_synchronize(layer, a->stream));
        t[it] = (MPI_Wtime() - t0) * 1e6;
    }
    moe_cli_sort(t, iters);
    return t[iters / 2];
}

/* The step captured once in a CUDA graph and replayed (a serving engine's decode): median GPU
 * time of a replay, or -1 on every rank when any rank's forward refuses capture (host-read
 * p2p). */
static double graph_us(moe_layer_t *layer, const moe_forward_args_t *a, int iters)
{
    cudaStream_t s = (cudaStream_t)a->stream;
    cudaGraph_t g = NULL;
    moe_status_t st;
    double med;
    int ok;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    st = moe_layer_forward(layer, a);
    CK(cudaStreamEndCapture(s, &g));
    ok = st == MOE_STATUS_SUCCESS;
    MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!ok) {
        if (g)
            cudaGraphDestroy(g);
        return -1.0;
    }
    med = replay_us(g, s, iters);
    MK(moe_layer_synchronize(layer, a->stream)); /* the replays' statuses */
    return med;
}

/* One point: the layer's dispatch, combine and step (median over steps, max over ranks) and
 * the payload this rank sent (max over ranks). */
typedef struct point {
    double dispatch, combine, step;
    double wall, graph; /* unprofiled: forward + synchronize; the step graph-replayed (< 0: the
                           transport refuses capture) */
    int64_t bytes;
    double ws_mib; /* the layer's workspace (IPC buffer included), max over ranks */
} point_t;

static point_t run_point(moe_runtime_t *rt, moe_layer_config_t cfg, int64_t T, int told, void *dx,
                         void *dy, cudaStream_t s, int iters, int rank)
{
    moe_layer_t *layer = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    moe_layer_stats_t st;
    moe_layer_info_t info;
    double *d = malloc(sizeof(double) * iters), *c = malloc(sizeof(double) * iters), v[6];
    double *tot = malloc(sizeof(double) * iters);
    uint16_t *hx = malloc(2 * (size_t)T * cfg.hidden);
    float *fx = malloc(4 * (size_t)T * cfg.hidden);
    int64_t j, bytes = 0;
    point_t p;
    int it;
    MK(moe_layer_create(rt, &cfg, &layer));
    MK(moe_gen_set_weights(layer, &cfg, 7));
    MK(moe_layer_get_info(layer, &info));
    moe_gen_tokens(7, (int64_t)rank * T, T, cfg.hidden, fx);
    for (j = 0; j < T * cfg.hidden; j++) { /* f32 -> bf16 by truncation is fine here */
        uint32_t u;
        memcpy(&u, &fx[j], 4);
        hx[j] = (uint16_t)(u >> 16);
    }
    CK(cudaMemcpy(dx, hx, 2 * (size_t)T * cfg.hidden, cudaMemcpyHostToDevice));
    a.num_tokens = T;
    a.dtype = MOE_DTYPE_BF16;
    a.x = dx;
    a.y = dy;
    a.stream = s;
    a.max_tokens_across_ranks = told == TOLD ? T : 0;
    if (told == ASK) /* the profiled steps and the graph: what the all-reduce gives */
        MK(moe_runtime_max_tokens(rt, T, &a.max_tokens_across_ranks));
    setenv("MOE_PROFILE", "1", 1);
    for (it = 0; it < 3; it++)
        MK(moe_layer_forward(layer, &a));
    for (it = 0; it < iters; it++) {
        MPI_Barrier(MPI_COMM_WORLD);
        MK(moe_layer_forward(layer, &a));
        MK(moe_layer_synchronize(layer, s));
        MK(moe_layer_get_stats(layer, &st));
        d[it] = st.dispatch_us;
        c[it] = st.combine_us;
        tot[it] = st.total_us;
        bytes = st.bytes_sent;
    }
    setenv("MOE_PROFILE", "0", 1);
    moe_cli_sort(d, iters);
    moe_cli_sort(c, iters);
    moe_cli_sort(tot, iters);
    v[0] = d[iters / 2];
    v[1] = c[iters / 2];
    v[2] = tot[iters / 2];
    v[3] = info.workspace_bytes / 1048576.0;
    v[4] = wall_us(layer, &a, told == ASK ? rt : NULL, tot, iters);
    v[5] = graph_us(layer, &a, iters);
    MPI_Allreduce(MPI_IN_PLACE, v, 6, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &bytes, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    p.dispatch = v[0];
    p.combine = v[1];
    p.step = v[2];
    p.ws_mib = v[3];
    p.wall = v[4];
    p.graph = v[5];
    p.bytes = bytes;
    MK(moe_layer_destroy(layer));
    free(d);
    free(c);
    free(tot);
    free(hx);
    free(fx);
    return p;
}

int moe_dispatch_bench_main(int argc, char **argv)
{
    static const int64_t sizes[] = {1, 8, 32, 128, 512, 4096};
    const int nsizes = (int)(sizeof(sizes) / sizeof(sizes[0]));
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    moe_layer_config_t cfg = MOE_LAYER_CONFIG_INIT;
    moe_runtime_t *rt = NULL;
    int rank, world, i, q, iters = 20, max_sizes = nsizes, told, transport, shared_gpu, no_nccl;
    int64_t tmax, cap, round, routed; /* routed: the point's payload as lsa or p2p sent it */
    ncclUniqueId id;
    ncclComm_t comm;
    cudaStream_t s;
    void *sbuf, *rbuf, *dx, *dy;
    size_t maxb;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (agree_options(argc, argv, sizes[nsizes - 1], &tmax, &cap, &told, &transport, &round))
        return 2;
    if (cap && cap < tmax)
        tmax = cap; /* no point above the capacity */
    for (max_sizes = 0; max_sizes < nsizes && sizes[max_sizes] <= tmax; max_sizes++)
        ;
    tmax = sizes[max_sizes - 1];
    /* DeepSeek-V3-like routing: 256 experts, top-8, H 7168; small experts (I 256): their GEMMs
     * are not what this measures. */
    cfg.num_experts = 256;
    cfg.top_k = 8;
    cfg.hidden = 7168;
    cfg.intermediate = 256;
    cfg.scoring = MOE_SCORING_SIGMOID;
    cfg.use_score_bias = 1;
    cfg.n_group = 8;
    cfg.topk_group = 4;
    cfg.routed_scaling_factor = 2.5f;
    rc.backend = MOE_BACKEND_CUDA;
    MK(moe_runtime_create_mpi(&rc, MPI_COMM_WORLD, &rt));
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    shared_gpu = ranks_share_gpu(world);
    no_nccl = shared_gpu == 1;
    if (rank == 0 && !no_nccl)
        NK(ncclGetUniqueId(&id));
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    if (!no_nccl)
        NK(ncclCommInitRank(&comm, world, id, rank));
    /* the largest payload: every token to every rank, rows out and f32 partials back */
    maxb = (size_t)tmax * world * (cfg.hidden * 6 + 64 * cfg.top_k + 64) + 4096;
    CK(cudaMalloc(&sbuf, maxb));
    CK(cudaMalloc(&rbuf, maxb));
    CK(cudaMemset(sbuf, 1, maxb));
    CK(cudaMalloc(&dx, 2 * (size_t)tmax * cfg.hidden));
    CK(cudaMalloc(&dy, 2 * (size_t)tmax * cfg.hidden));
    if (rank == 0) {
        int v = 0;
        ncclGetVersion(&v);
        printf("# moe-bench --dispatch-only: %d ranks (GPUs), E%d top-%d H%d bf16, NCCL %d, "
               "DeepSeek-V3 grouped routing\n"
               "# dispatch: routing done -> expert rows gathered (transport, counts, permute); "
               "combine: expert rows -> y (return and sum); events, median of %d steps, max "
               "over ranks\n"
               "# sent: payload bytes a rank sent to the others (max over ranks); nccl: two "
               "grouped ncclSend/ncclRecv all-to-alls of half that payload each, graph-replayed; "
               "ratio = (dispatch + combine) / nccl (p2p-hdr, which moves whole regions: nccl "
               "of the routed payload, lsa's or p2p's sent at the point); ws: the layer's "
               "workspace with the IPC buffer (moe_layer_info_t, max over ranks); wall: "
               "forward + synchronize unprofiled, as a caller sees it; graph: the step "
               "captured once and replayed (- where the transport refuses capture)\n"
               "# capacity (max_tokens_per_rank): %s; max_tokens_across_ranks: %s\n#\n"
               "# %9s %10s %12s %12s %10s %10s %8s %9s %9s %9s %9s\n",
               world, cfg.num_experts, cfg.top_k, cfg.hidden, v, iters,
               cap ? "fixed (--capacity)" : "each point's tokens",
               told == TOLD  ? "the point's tokens (--told)"
               : told == ASK ? "moe_runtime_max_tokens before each step (--ask; in wall)"
                             : "not given",
               "tok/rank", "transport", "dispatch(us)", "combine(us)", "sent(MB)", "nccl(us)",
               "ratio", "step(us)", "ws(MiB)", "wall(us)", "graph(us)");
        if (cap)
            printf("# capacity %lld tokens per rank\n", (long long)cap);
        if (round)
            printf("# rounds of at most %lld tokens per rank (--round-tokens)\n", (long long)round);
        if (no_nccl)
            printf("# ranks share a GPU: lsa transports only, no NCCL column (NCCL refuses "
                   "two ranks on one GPU); not the two-GPU numbers\n");
        else if (shared_gpu)
            printf("# ranks share a GPU, each with its own NCCL_HOSTID: NCCL joins them as "
                   "hosts over loopback sockets; a smoke run, not NVLink's or a NIC's numbers\n");
    }
    for (i = 0; i < max_sizes; i++) {
        const int64_t T = sizes[i];
        cfg.max_tokens_per_rank = cap ? cap : T;
        cfg.ep_round_tokens = round < cfg.max_tokens_per_rank ? round : cfg.max_tokens_per_rank;
        routed = -1;
        for (q = 0; q < NT; q++) {
            point_t p;
            double a2a = 0.0;
            size_t half;
            /* rows per rank this step: told, else the capacity */
            const int64_t m = told ? T : cfg.max_tokens_per_rank;
            if ((transport >= 0 && q != transport) || (q == LSA_LL && m > MOE_A2A_LL_MAX_TOKENS) ||
                (no_nccl && q != 1 && q != LSA_LL))
                continue;
            setenv("MOE_EP_TRANSPORT",
                   q == LSA_LL    ? "lsa"
                   : q == P2P_HDR ? "p2p"
                                  : transport_names[q],
                   1);
            setenv("MOE_EP_LL", q == LSA_LL ? "1" : "0", 1);
            setenv("MOE_EP_P2P_HEADER", q == P2P_HDR ? "1" : "0", 1);
            p = run_point(rt, cfg, T, told, dx, dy, s, iters, rank);
            if (q == 1 || q == 2) /* lsa, p2p: exactly the routed rows and their partials */
                routed = p.bytes;
            /* p2p-hdr moves whole regions: its reference moves the routed payload */
            half = (size_t)((q == P2P_HDR && routed >= 0 ? routed : p.bytes) / 2) + 16;
            if (half > maxb / 2)
                half = maxb / 2;
            if (!no_nccl)
                a2a = 2 * nccl_a2a_us(comm, world, half * world / (world > 1 ? world - 1 : 1), sbuf,
                                      rbuf, s, iters);
            MPI_Allreduce(MPI_IN_PLACE, &a2a, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (rank == 0) {
                char graph[16] = "-";
                if (p.graph >= 0)
                    snprintf(graph, sizeof(graph), "%.1f", p.graph);
                printf("  %9lld %10s %12.1f %12.1f %10.3f %10.1f %8.2f %9.1f %9.1f %9.1f %9s\n",
                       (long long)T, transport_names[q], p.dispatch, p.combine, p.bytes / 1e6, a2a,
                       a2a > 0 ? (p.dispatch + p.combine) / a2a : 0.0, p.step, p.ws_mib, p.wall,
                       graph);
            }
            fflush(stdout);
        }
    }
    unsetenv("MOE_EP_TRANSPORT");
    unsetenv("MOE_EP_LL");
    unsetenv("MOE_EP_P2P_HEADER");
    if (rank == 0)
        printf("# target: ratio <= 1.2 from 128 tokens per rank\n");
    if (!no_nccl)
        ncclCommDestroy(comm);
    cudaFree(sbuf), cudaFree(rbuf), cudaFree(dx), cudaFree(dy);
    cudaStreamDestroy(s);
    MK(moe_runtime_destroy(rt));
    return 0;
}
#endif /* MOE_HAVE_NCCL */
