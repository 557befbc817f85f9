/* SPDX-License-Identifier: Apache-2.0 */
/* Multi-GPU (one rank per GPU, NCCL): EP and TP layouts of the CUDA backend against the CPU
 * backend on the same global tokens, uneven tokens per rank (one rank with none), every token
 * to one rank's experts, and deterministic mode bitwise equal across EP sizes; each EP
 * transport (MOE_EP_TRANSPORT = allgather, lsa, p2p) at 1 and 7 tokens per rank, a 300/0
 * split, a full batch, a hot rank and a capacity of 8192 with one token per rank; lsa also
 * with the low-latency layout (MOE_EP_LL=1) wherever a step has at most 128 rows per rank; steps
 * in rounds (ep_round_tokens): results, router outputs, profile and workspace. */
#include "gpu_mpi.h"
#include "testutil.h"

#include <cuda_runtime.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/a2a.h"
#include "kernels/gpu.h"
#include "base/numeric.h"
#include "launch/layer_gen.h"

static int rank, world;
static int64_t told_m;       /* max_tokens_across_ranks run() passes (0: not given) */
static int64_t round_tokens; /* ep_round_tokens of compare_tokens' layers (0: default) */

static moe_layer_config_t shape(int deepseek)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    c.num_experts = 16;
    c.top_k = 4;
    c.hidden = 1024;
    c.intermediate = 512;
    c.max_tokens_per_rank = 320;
    if (deepseek) {
        c.scoring = MOE_SCORING_SIGMOID;
        c.use_score_bias = 1;
        c.n_group = 4;
        c.topk_group = 2;
        c.routed_scaling_factor = 2.5f;
        c.num_shared_experts = 1;
    }
    return c;
}

static void run(moe_runtime_t *rt, moe_layer_config_t c, uint64_t seed, const float *x, int64_t n,
                const float *logits, float *y)
{
    gt_run_layer(rt, c, seed, x, n, logits, y, told_m);
}

static void compare_layout(int deepseek, int tp, const float *logits_for_hot)
{
    const uint64_t seed = tu_seed("gpu_ep");
    moe_layer_config_t c = shape(deepseek);
    int64_t t0, n;
    float *x, *y, *ref;
    double err;
    tu_uneven_share(300, rank, world, &t0, &n);
    if (logits_for_hot)
        t0 = 0, n = 64;
    x = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
    y = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
    ref = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
    assert_true(x && y && ref);
    moe_gen_tokens(seed, t0, n, c.hidden, x);
    run(gt_rts.cpu_self, c, seed, x, n, logits_for_hot, ref);
    c.tp_size = tp;
    c.ep_size = world / tp;
    run(gt_rts.gpu, c, seed, x, n, logits_for_hot, y);
    assert_int_equal(tu_count_nan(y, n * c.hidden), 0);
    err = n ? tu_rel_err(y, ref, n * c.hidden) : 0.0;
    print_message("rank %d: %s ep %d tp %d, %lld tokens: rel err %.3g\n", rank,
                  deepseek ? "deepseek" : "mixtral", world / tp, tp, (long long)n, err);
    assert_true(err <= 1e-2);
    free(x);
    free(y);
    free(ref);
}

static void test_ep_mixtral(void **state)
{
    (void)state;
    compare_layout(0, 1, NULL);
}

static void test_ep_deepseek_shared(void **state)
{
    (void)state;
    compare_layout(1, 1, NULL);
}

static void test_tp(void **state)
{
    (void)state;
    if (!gt_nccl_runs()) /* TP needs the allgather transport: NCCL */
        return;
    compare_layout(0, world, NULL);
}

static void test_hot_rank(void **state)
{
    float *logits = calloc(64 * 16, sizeof(float));
    int i;
    (void)state;
    for (i = 0; i < 64; i++) { /* experts 0..3 live on rank 0 */
        logits[i * 16 + 0] = 4.0f + 0.01f * (float)i;
        logits[i * 16 + 1] = 3.0f;
        logits[i * 16 + 2] = 2.5f;
        logits[i * 16 + 3] = 2.0f;
    }
    compare_layout(0, 1, logits);
    free(logits);
}

/* The same tokens on one GPU and on EP = world GPUs: bitwise equal outputs, without and with
 * a shared expert (and DeepSeek's grouped sigmoid routing). */
static void deterministic_across_ep(int deepseek)
{
    const uint64_t seed = tu_seed("gpu_det");
    moe_layer_config_t c = shape(deepseek);
    const int64_t n = 40;
    float *x = malloc(sizeof(float) * n * 1024), *y1 = malloc(sizeof(float) * n * 1024);
    float *yn = malloc(sizeof(float) * n * 1024);
    c.deterministic = 1;
    moe_gen_tokens(seed, rank * n, n, c.hidden, x);
    run(gt_rts.gpu_self, c, seed, x, n, NULL, y1);
    run(gt_rts.gpu, c, seed, x, n, NULL, yn);
    assert_memory_equal(y1, yn, sizeof(float) * n * 1024);
    free(x);
    free(y1);
    free(yn);
}

/* max_tokens_across_ranks: a step that moves max(num_tokens) rows per rank instead of the
 * capacity gives bitwise the output of the capacity step, in both return modes. */
static void told_max(int deterministic)
{
    const uint64_t seed = tu_seed("gpu_told");
    moe_layer_config_t c = shape(1);
    int64_t t0, n, m;
    float *x, *y0, *y1;
    c.deterministic = deterministic;
    tu_uneven_share(60, rank, world, &t0, &n); /* capacity 320, at most ~40 rows per rank */
    m = n;
    MPI_Allreduce(MPI_IN_PLACE, &m, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    x = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
    y0 = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
    y1 = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
    assert_true(x && y0 && y1);
    moe_gen_tokens(seed, t0, n, c.hidden, x);
    told_m = 0;
    run(gt_rts.gpu, c, seed, x, n, NULL, y0);
    told_m = m;
    run(gt_rts.gpu, c, seed, x, n, NULL, y1);
    told_m = 0;
    print_message("rank %d: %lld tokens, max_tokens_across_ranks %lld of capacity %lld\n", rank,
                  (long long)n, (long long)m, (long long)c.max_tokens_per_rank);
    assert_memory_equal(y0, y1, sizeof(float) * (size_t)(n * c.hidden));
    free(x);
    free(y0);
    free(y1);
}

static void test_told_max_tokens(void **state)
{
    (void)state;
    told_max(0);
    told_max(1);
}

static void test_deterministic_across_ep(void **state)
{
    (void)state;
    deterministic_across_ep(0);
}

static void test_deterministic_shared_across_ep(void **state)
{
    (void)state;
    deterministic_across_ep(1);
}

/* "lsa-ll": lsa with the low-latency layout (MOE_EP_LL=1), which takes steps of at most 128
 * rows per rank: those entries pass max_tokens_across_ranks (the largest batch of any rank).
 * "p2p-hdr": p2p with the sizes in-band (MOE_EP_P2P_HEADER=1: whole regions, no host read),
 * told as well, as a serving engine would run it (untold, a region is the round size).
 * "lsa-ll-fused": the low-latency layout with the fused decode kernel forced
 * (MOE_FORCE_VARIANT=sm90_fused_decode): steps of at most 64 / world rows per rank run it on the
 * rows the dispatch laid out, larger ones the grouped GEMMs (sm_90 only: skipped elsewhere). */
static const char *const transports[] = {"allgather", "lsa",     "p2p",
                                         "lsa-ll",    "p2p-hdr", "lsa-ll-fused"};
enum { LSA_LL = 3, P2P_HDR = 4, LSA_LL_FUSED = 5 };

static int microbatch; /* MOE_EP_MICROBATCH=1 is set: lsa alone takes it */

/* this rank's GPU runs the fused decode kernel (sm_90) */
static int gt_sm90(void)
{
    int dev = 0, arch = 0;
    return cudaGetDevice(&dev) == cudaSuccess && moe_gpu_arch(dev, &arch) == MOE_STATUS_SUCCESS &&
           arch == 90;
}

/* Ranks sharing one GPU without NCCL (MOE_TEST_SHARED_GPU=lsa): lsa only. */
static int transport_runs(int i)
{
    if (microbatch)
        return i == 1;
    return gt_nccl_runs() || !strncmp(transports[i], "lsa", 3);
}

/* Sets the environment for transports[i] with n tokens on this rank; returns 0 where the entry
 * does not apply (the low-latency layout past its 128 rows per rank). */
static int use_transport(int i, int64_t n)
{
    int64_t m = n;
    MPI_Allreduce(MPI_IN_PLACE, &m, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    const int ll = i == LSA_LL || i == LSA_LL_FUSED;
    if (i == LSA_LL_FUSED && !gt_sm90())
        return 0;
    setenv("MOE_EP_TRANSPORT", ll ? "lsa" : i == P2P_HDR ? "p2p" : transports[i], 1);
    setenv("MOE_EP_LL", ll ? "1" : "0", 1);
    setenv("MOE_EP_P2P_HEADER", i == P2P_HDR ? "1" : "0", 1);
    if (i == LSA_LL_FUSED)
        setenv("MOE_FORCE_VARIANT", "sm90_fused_decode", 1);
    else
        unsetenv("MOE_FORCE_VARIANT");
    told_m = ll || i == P2P_HDR ? m : 0;
    /* rounds of at most 128 tokens take the layout in every round */
    return !ll || m <= MOE_A2A_LL_MAX_TOKENS ||
           (round_tokens > 0 && round_tokens <= MOE_A2A_LL_MAX_TOKENS);
}

static void end_transports(void)
{
    unsetenv("MOE_EP_TRANSPORT");
    unsetenv("MOE_EP_LL");
    unsetenv("MOE_EP_P2P_HEADER");
    unsetenv("MOE_FORCE_VARIANT");
    told_m = 0;
}

/* n tokens on this rank (global rows t0..t0+n of the generator), capacity cap, every
 * transport: the CUDA layer against the CPU backend on the same tokens. */
static void compare_tokens(int deepseek, int64_t t0, int64_t n, int64_t cap, const float *logits,
                           const char *what)
{
    const uint64_t seed = tu_seed("gpu_a2a");
    moe_layer_config_t c = shape(deepseek);
    float *x = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
    float *y = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
    float *ref = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
    size_t i;
    assert_true(x && y && ref);
    c.max_tokens_per_rank = cap;
    c.ep_round_tokens = round_tokens;
    moe_gen_tokens(seed, t0, n, c.hidden, x);
    run(gt_rts.cpu_self, c, seed, x, n, logits, ref);
    for (i = 0; i < sizeof(transports) / sizeof(transports[0]); i++) {
        double err;
        if (!transport_runs((int)i) || !use_transport((int)i, n))
            continue;
        run(gt_rts.gpu, c, seed, x, n, logits, y);
        assert_int_equal(tu_count_nan(y, n * c.hidden), 0);
        err = n ? tu_rel_err(y, ref, n * c.hidden) : 0.0;
        print_message("rank %d: %s %s, %lld tokens (capacity %lld, rounds of %lld): %s rel err "
                      "%.3g\n",
                      rank, deepseek ? "deepseek" : "mixtral", what, (long long)n, (long long)cap,
                      (long long)round_tokens, transports[i], err);
        assert_true(err <= 1e-2);
    }
    end_transports();
    free(x);
    free(y);
    free(ref);
}

static void test_transport_small_batches(void **state)
{
    (void)state;
    compare_tokens(0, rank, 1, 320, NULL, "1 token/rank");
    compare_tokens(1, 7 * rank, 7, 320, NULL, "7 tokens/rank");
}

static void test_transport_split_and_full(void **state)
{
    (void)state;
    /* 300 tokens on rank 0, none elsewhere */
    compare_tokens(1, 0, rank == 0 ? 300 : 0, 320, NULL, "300/0 split");
    compare_tokens(0, 320 * rank, 320, 320, NULL, "full capacity");
}

static void test_transport_hot_rank(void **state)
{
    float *logits = calloc(64 * 16, sizeof(float));
    int i;
    (void)state;
    for (i = 0; i < 64; i++) { /* every token to experts 0..3: rank 0's */
        logits[i * 16 + 0] = 4.0f + 0.01f * (float)i;
        logits[i * 16 + 1] = 3.0f;
        logits[i * 16 + 2] = 2.5f;
        logits[i * 16 + 3] = 2.0f;
    }
    compare_tokens(0, 0, 64, 320, logits, "hot rank");
    free(logits);
}

static void test_transport_large_capacity(void **state)
{
    (void)state;
    compare_tokens(1, rank, 1, 8192, NULL, "capacity 8192");
}

/* Deterministic mode on 40 tokens a rank: the EP layer on every transport that takes it (not
 * p2p), in rounds of each of rounds_of[] tokens (0: the default), bitwise equal to one GPU. */
static void det_vs_one_gpu(const char *seed_name, const char *what, const int64_t *rounds_of,
                           int nr)
{
    const uint64_t seed = tu_seed(seed_name);
    moe_layer_config_t c = shape(1);
    const int64_t n = 40;
    const size_t bytes = sizeof(float) * (size_t)(n * c.hidden);
    float *x = malloc(bytes), *y1 = malloc(bytes), *yn = malloc(bytes);
    int i, r;
    assert_true(x && y1 && yn);
    c.deterministic = 1;
    moe_gen_tokens(seed, rank * n, n, c.hidden, x);
    run(gt_rts.gpu_self, c, seed, x, n, NULL, y1);
    for (i = 0; i <= LSA_LL; i++) {
        if (i == 2 || !transport_runs(i) || !use_transport(i, n)) /* p2p refuses it */
            continue;
        for (r = 0; r < nr; r++) {
            c.ep_round_tokens = rounds_of[r];
            run(gt_rts.gpu, c, seed, x, n, NULL, yn);
            print_message("rank %d: deterministic %s, %s, rounds of %lld, vs one GPU\n", rank,
                          transports[i], what,
                          (long long)(rounds_of[r] ? rounds_of[r] : c.max_tokens_per_rank));
            assert_memory_equal(y1, yn, bytes);
        }
    }
    end_transports();
    free(x);
    free(y1);
    free(yn);
}

/* Deterministic: one GPU, and EP over allgather and lsa, bitwise equal. */
static void test_deterministic_across_transports(void **state)
{
    static const int64_t rounds_of[] = {0, 16}; /* one round; rounds of 16, 16 and 8 tokens */
    (void)state;
    det_vs_one_gpu("gpu_det_a2a", "transports", rounds_of, 2);
}

/* Steps in rounds (ep_round_tokens): uneven batches over several rounds, told and not, and a
 * round count the ranks' own tokens do not reach, against the CPU backend on every transport. */
static void test_rounds(void **state)
{
    (void)state;
    round_tokens = 64;
    /* 300 tokens on rank 0, 7 elsewhere: 5 rounds, rank 1's tokens all in the first */
    compare_tokens(1, 300 * rank, rank == 0 ? 300 : 7, 320, NULL, "300/7 split");
    /* capacity 8192, one token per rank, not told: 128 rounds, 127 of them empty */
    compare_tokens(0, rank, 1, 8192, NULL, "capacity 8192");
    round_tokens = 100; /* a round size that does not divide the batch */
    compare_tokens(0, 250 * rank, 250, 320, NULL, "250 tokens");
    round_tokens = 0;
}

/* The router's choices come back per round at the right rows, and the profile adds up the
 * rounds: the rows received equal one round's step. */
static void test_rounds_topk_and_profile(void **state)
{
    const uint64_t seed = tu_seed("gpu_round_topk");
    const int64_t n = 200, H = 1024, k = 4;
    moe_layer_config_t c = shape(0);
    int32_t *ids[2];
    int64_t rows[2];
    float *x = malloc(sizeof(float) * (size_t)(n * H));
    void *dx = NULL, *dy = NULL, *dids = NULL;
    int pass;
    (void)state;
    if (world < 2) { /* one GPU: one round */
        free(x);
        return;
    }
    assert_non_null(x);
    moe_gen_tokens(seed, n * rank, n, H, x);
    assert_int_equal(cudaMalloc(&dx, sizeof(float) * (size_t)(n * H)), cudaSuccess);
    assert_int_equal(cudaMalloc(&dy, sizeof(float) * (size_t)(n * H)), cudaSuccess);
    assert_int_equal(cudaMalloc(&dids, sizeof(int32_t) * (size_t)(n * k)), cudaSuccess);
    assert_int_equal(cudaMemcpy(dx, x, sizeof(float) * (size_t)(n * H), cudaMemcpyHostToDevice),
                     cudaSuccess);
    setenv("MOE_PROFILE", "1", 1);
    for (pass = 0; pass < 2; pass++) { /* one round, then rounds of 48 tokens (5) */
        moe_layer_t *l = NULL;
        moe_layer_info_t info;
        moe_layer_stats_t st;
        moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
        c.ep_round_tokens = pass ? 48 : 320;
        ids[pass] = malloc(sizeof(int32_t) * (size_t)(n * k));
        assert_non_null(ids[pass]);
        TU_OK(moe_layer_create(gt_rts.gpu, &c, &l));
        TU_OK(moe_gen_set_weights(l, &c, seed));
        TU_OK(moe_layer_get_info(l, &info));
        assert_int_equal(info.ep_round_tokens, c.ep_round_tokens);
        assert_int_equal(cudaMemset(dids, 0xff, sizeof(int32_t) * (size_t)(n * k)), cudaSuccess);
        a.num_tokens = n;
        a.x = dx;
        a.y = dy;
        a.topk_ids = dids;
        a.max_tokens_across_ranks = n;
        TU_OK(moe_layer_forward(l, &a));
        TU_OK(moe_layer_synchronize(l, NULL));
        TU_OK(moe_layer_get_stats(l, &st));
        rows[pass] = st.rows_received;
        assert_int_equal(
            cudaMemcpy(ids[pass], dids, sizeof(int32_t) * (size_t)(n * k), cudaMemcpyDeviceToHost),
            cudaSuccess);
        print_message("rank %d: rounds of %lld: %lld rows received, %.1f us\n", rank,
                      (long long)c.ep_round_tokens, (long long)rows[pass], st.total_us);
        TU_OK(moe_layer_destroy(l));
    }
    unsetenv("MOE_PROFILE");
    assert_memory_equal(ids[0], ids[1], sizeof(int32_t) * (size_t)(n * k));
    assert_true(rows[0] > 0);
    assert_int_equal(rows[0], rows[1]);
    free(ids[0]);
    free(ids[1]);
    free(x);
    cudaFree(dx);
    cudaFree(dy);
    cudaFree(dids);
}

/* The default rounds keep the EP workspace at about one capacity of GEMM rows (capacity x k),
 * where one round per step holds world x capacity x k of them. */
static void test_rounds_workspace(void **state)
{
    moe_layer_config_t c = shape(1);
    size_t bytes[2];
    int pass;
    (void)state;
    if (world < 2)
        return;
    c.max_tokens_per_rank = 8192;
    for (pass = 0; pass < 2; pass++) {
        moe_layer_t *l = NULL;
        moe_layer_info_t info;
        c.ep_round_tokens = pass ? 8192 : 0;
        TU_OK(moe_layer_create(gt_rts.gpu, &c, &l));
        TU_OK(moe_layer_get_info(l, &info));
        assert_int_equal(info.ep_round_tokens, pass ? 8192 : (8192 + world - 1) / world);
        bytes[pass] = info.workspace_bytes;
        TU_OK(moe_layer_destroy(l));
    }
    print_message("rank %d: capacity 8192, %d ranks: workspace %.1f MiB in rounds, %.1f MiB in "
                  "one\n",
                  rank, world, bytes[0] / 1048576.0, bytes[1] / 1048576.0);
    /* the GEMM rows (most of it) shrink by the world size */
    assert_true(bytes[0] * 3 < bytes[1] * 2);
}

/* MOE_EP_SHARED_OVERLAP=1: the shared MLP on a side stream gives the same results (against the
 * CPU backend on every transport; deterministic bitwise equal to one GPU), in rounds too. */
static void test_shared_overlap(void **state)
{
    static const int64_t one_round[] = {0};
    (void)state;
    setenv("MOE_EP_SHARED_OVERLAP", "1", 1);
    compare_tokens(1, 7 * rank, 7, 320, NULL, "shared overlap, 7 tokens/rank");
    round_tokens = 64;
    compare_tokens(1, 300 * rank, rank == 0 ? 300 : 7, 320, NULL, "shared overlap, 300/7 split");
    round_tokens = 0;
    det_vs_one_gpu("gpu_overlap", "shared overlap", one_round, 1);
    unsetenv("MOE_EP_SHARED_OVERLAP");
}

/* create refuses c on every rank with status st and an error naming `what`. */
static void create_fails(const moe_layer_config_t *c, moe_status_t st, const char *what)
{
    moe_layer_t *l = NULL;
    assert_int_equal(moe_layer_create(gt_rts.gpu, c, &l), st);
    assert_non_null(strstr(moe_last_error(), what));
    assert_null(l);
}

/* Two micro-batches in flight (MOE_EP_MICROBATCH=1, lsa): a step's rounds alternate between two
 * lanes of half a round each, lane 1 on its own stream. Against the CPU backend over one lane's
 * round, many rounds and rounds past every rank's tokens; deterministic mode bitwise equal to
 * one GPU; the layouts it cannot take are refused at create on every rank. */
static void test_microbatch(void **state)
{
    static const int64_t rounds_of_16[] = {16}; /* lanes of 8 tokens: five rounds a step */
    moe_layer_config_t c = shape(1);
    moe_layer_t *l = NULL;
    moe_layer_info_t info;
    char text[2048];
    (void)state;
    if (world < 2)
        return;
    setenv("MOE_EP_MICROBATCH", "1", 1);
    microbatch = 1;
    /* capacity 320: rounds of 256, lanes of 128: three rounds a step when not told */
    compare_tokens(1, 7 * rank, 7, 320, NULL, "micro-batches, 7 tokens/rank");
    compare_tokens(0, 320 * rank, 320, 320, NULL, "micro-batches, full capacity");
    round_tokens = 64; /* lanes of 32 tokens: ten rounds on rank 0, rank 1's in the first */
    compare_tokens(1, 300 * rank, rank == 0 ? 300 : 7, 320, NULL, "micro-batches, 300/7 split");
    round_tokens = 0;
    compare_tokens(0, rank, 1, 8192, NULL, "micro-batches, capacity 8192");
    det_vs_one_gpu("gpu_microbatch", "micro-batches", rounds_of_16, 1);
    setenv("MOE_EP_TRANSPORT", "lsa", 1);
    c.ep_round_tokens = 16;
    TU_OK(moe_layer_create(gt_rts.gpu, &c, &l));
    TU_OK(moe_layer_get_info(l, &info));
    assert_int_equal(info.ep_round_tokens, 8); /* a lane holds half a round */
    TU_OK(moe_layer_explain(l, 8, text, sizeof(text)));
    assert_non_null(strstr(text, "micro-batch lanes"));
    TU_OK(moe_layer_destroy(l));
    setenv("MOE_EP_LL", "1", 1);
    create_fails(&c, MOE_STATUS_NOT_SUPPORTED, "MOE_EP_MICROBATCH=1");
    unsetenv("MOE_EP_LL");
    setenv("MOE_EP_MICROBATCH", rank == 0 ? "1" : "0", 1);
    create_fails(&c, MOE_STATUS_MISMATCH, "differs");
    microbatch = 0;
    unsetenv("MOE_EP_MICROBATCH");
    end_transports();
    /* one lane with the lanes' finish (after a one-CTA wait) */
    setenv("MOE_EP_FINISH_WAIT", "1", 1);
    compare_tokens(1, 7 * rank, 7, 320, NULL, "finish after a one-CTA wait, 7 tokens/rank");
    unsetenv("MOE_EP_FINISH_WAIT");
}

/* A step captured in a CUDA graph and replayed twice gives the direct step's output bitwise
 * (lsa): one round, rounds told and not (the rounds past every rank's tokens skipped on the
 * device), and micro-batch lanes. The sequence numbers advance on the device at each replay.
 * With NCCL (not on a shared GPU): p2p with the sizes in-band (MOE_EP_P2P_HEADER=1) likewise,
 * and p2p with host-read sizes refuses the capture on every rank. */
static void test_graph_capture(void **state)
{
    static const struct {
        int64_t rounds_of;
        int told, lanes, p2p; /* p2p: 1 in-band sizes, 2 host-read sizes (refused) */
        const char *what;
    } cases[] = {
        {320, 0, 0, 0, "one round, not told"},
        {0, 0, 0, 0, "default rounds (256), not told"},
        {64, 1, 0, 0, "rounds of 64, told"},
        {64, 0, 0, 0, "rounds of 64, not told"},
        {64, 1, 1, 0, "micro-batch lanes of 32, told"},
        {64, 1, 0, 1, "p2p, sizes in-band, rounds of 64, told"},
        {0, 0, 0, 1, "p2p, sizes in-band, default rounds, not told"},
        {0, 1, 0, 2, "p2p, sizes read on the host"},
    };
    const uint64_t seed = tu_seed("gpu_graph");
    moe_layer_config_t c = shape(1);
    const int64_t n = 100 + 50 * rank, H = c.hidden;
    const size_t bytes = sizeof(float) * (size_t)(n * H);
    float *x = malloc(bytes), *y0 = malloc(bytes), *y1 = malloc(bytes);
    void *dx = NULL, *dy = NULL;
    cudaStream_t st = NULL;
    int64_t m = n;
    size_t i;
    int rep;
    (void)state;
    assert_true(x && y0 && y1);
    if (world < 2) {
        free(x);
        free(y0);
        free(y1);
        return;
    }
    MPI_Allreduce(MPI_IN_PLACE, &m, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    moe_gen_tokens(seed, 150 * rank, n, H, x);
    assert_int_equal(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaMalloc(&dx, bytes), cudaSuccess);
    assert_int_equal(cudaMalloc(&dy, bytes), cudaSuccess);
    assert_int_equal(cudaMemcpy(dx, x, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    for (i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        moe_layer_t *l = NULL;
        moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
        cudaGraph_t g = NULL;
        cudaGraphExec_t ge = NULL;
        if (cases[i].p2p && !gt_nccl_runs()) /* MOE_TEST_SHARED_GPU=lsa: no NCCL */
            continue;
        setenv("MOE_EP_TRANSPORT", cases[i].p2p ? "p2p" : "lsa", 1);
        setenv("MOE_EP_P2P_HEADER", cases[i].p2p == 1 ? "1" : "0", 1);
        if (cases[i].lanes)
            setenv("MOE_EP_MICROBATCH", "1", 1);
        else
            unsetenv("MOE_EP_MICROBATCH");
        c.ep_round_tokens = cases[i].rounds_of;
        TU_OK(moe_layer_create(gt_rts.gpu, &c, &l));
        TU_OK(moe_gen_set_weights(l, &c, seed));
        a.num_tokens = n;
        a.x = dx;
        a.y = dy;
        a.stream = st;
        a.max_tokens_across_ranks = cases[i].told ? m : 0;
        assert_int_equal(cudaMemsetAsync(dy, 0xff, bytes, st), cudaSuccess);
        TU_OK(moe_layer_forward(l, &a));
        TU_OK(moe_layer_synchronize(l, st));
        assert_int_equal(cudaMemcpy(y0, dy, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
        assert_int_equal(tu_count_nan(y0, n * H), 0);
        assert_int_equal(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        if (cases[i].p2p == 2) { /* refused before any collective, on every rank */
            assert_int_equal(moe_layer_forward(l, &a), MOE_STATUS_NOT_SUPPORTED);
            assert_non_null(strstr(moe_last_error(), "MOE_EP_P2P_HEADER=1"));
            assert_int_equal(cudaStreamEndCapture(st, &g), cudaSuccess);
            assert_int_equal(cudaGraphDestroy(g), cudaSuccess);
            TU_OK(moe_layer_destroy(l));
            continue;
        }
        TU_OK(moe_layer_forward(l, &a));
        assert_int_equal(cudaStreamEndCapture(st, &g), cudaSuccess);
        assert_int_equal(cudaGraphInstantiate(&ge, g, 0), cudaSuccess);
        for (rep = 0; rep < 2; rep++) {
            assert_int_equal(cudaMemsetAsync(dy, 0xff, bytes, st), cudaSuccess);
            assert_int_equal(cudaGraphLaunch(ge, st), cudaSuccess);
            TU_OK(moe_layer_synchronize(l, st));
            assert_int_equal(cudaMemcpy(y1, dy, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
            print_message("rank %d: graph replay %d, %s: %s\n", rank, rep, cases[i].what,
                          memcmp(y0, y1, bytes) ? "differs" : "bitwise equal");
            assert_memory_equal(y0, y1, bytes);
        }
        assert_int_equal(cudaGraphExecDestroy(ge), cudaSuccess);
        assert_int_equal(cudaGraphDestroy(g), cudaSuccess);
        TU_OK(moe_layer_destroy(l));
    }
    unsetenv("MOE_EP_MICROBATCH");
    end_transports();
    cudaStreamDestroy(st);
    cudaFree(dx);
    cudaFree(dy);
    free(x);
    free(y0);
    free(y1);
}

/* Kernels of a captured graph whose names hold `what` (the graph's kernel names printed). */
static int kernels_named(cudaGraph_t g, const char *what, const char *tag)
{
    size_t n = 0, i;
    int count = 0;
    cudaGraphNode_t *nodes;
    assert_int_equal(cudaGraphGetNodes(g, NULL, &n), cudaSuccess);
    nodes = calloc(n + 1, sizeof(*nodes));
    assert_non_null(nodes);
    assert_int_equal(cudaGraphGetNodes(g, nodes, &n), cudaSuccess);
    for (i = 0; i < n; i++) {
        enum cudaGraphNodeType type;
        struct cudaKernelNodeParams kp;
        const char *name = NULL;
        assert_int_equal(cudaGraphNodeGetType(nodes[i], &type), cudaSuccess);
        if (type != cudaGraphNodeTypeKernel)
            continue;
        assert_int_equal(cudaGraphKernelNodeGetParams(nodes[i], &kp), cudaSuccess);
        if (!kp.func || cudaFuncGetName(&name, kp.func) != cudaSuccess || !name) {
            (void)cudaGetLastError();
            name = "(a kernel without a runtime name)";
        }
        if (tag && rank == 0)
            print_message("  %s: kernel %s\n", tag, name);
        count += strstr(name, what) != NULL;
    }
    free(nodes);
    return count;
}

/* The low-latency layout's step with the fused decode kernel on the laid-out rows (forced, 4
 * tokens a rank): its captured graph holds the decode kernel once and no GEMM (the experts are
 * that one launch between the dispatch and the combine); without the kernel, GEMMs and no
 * decode kernel. Replays give the direct step's output bitwise. sm_90, world > 1. */
static void test_ll_fused_launches(void **state)
{
    const uint64_t seed = tu_seed("gpu_ll_fused");
    moe_layer_config_t c = shape(0); /* no shared MLP: its GEMMs would run beside */
    const int64_t n = 4, H = c.hidden;
    const size_t bytes = sizeof(float) * (size_t)(n * H);
    float *x = malloc(bytes), *y0 = malloc(bytes), *y1 = malloc(bytes);
    void *dx = NULL, *dy = NULL;
    cudaStream_t st = NULL;
    int fused;
    (void)state;
    assert_true(x && y0 && y1);
    if (world < 2 || !gt_sm90()) {
        free(x), free(y0), free(y1);
        return;
    }
    moe_gen_tokens(seed, n * rank, n, H, x);
    assert_int_equal(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
    assert_int_equal(cudaMalloc(&dx, bytes), cudaSuccess);
    assert_int_equal(cudaMalloc(&dy, bytes), cudaSuccess);
    assert_int_equal(cudaMemcpy(dx, x, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    setenv("MOE_EP_TRANSPORT", "lsa", 1);
    setenv("MOE_EP_LL", "1", 1);
    for (fused = 1; fused >= 0; fused--) {
        moe_layer_t *l = NULL;
        moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
        cudaGraph_t g = NULL;
        cudaGraphExec_t ge = NULL;
        if (fused)
            setenv("MOE_FORCE_VARIANT", "sm90_fused_decode", 1);
        else
            unsetenv("MOE_FORCE_VARIANT");
        TU_OK(moe_layer_create(gt_rts.gpu, &c, &l));
        TU_OK(moe_gen_set_weights(l, &c, seed));
        a.num_tokens = n;
        a.x = dx;
        a.y = dy;
        a.stream = st;
        a.max_tokens_across_ranks = n;
        TU_OK(moe_layer_forward(l, &a));
        TU_OK(moe_layer_synchronize(l, st));
        assert_int_equal(cudaMemcpy(y0, dy, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
        assert_int_equal(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        TU_OK(moe_layer_forward(l, &a));
        assert_int_equal(cudaStreamEndCapture(st, &g), cudaSuccess);
        {
            const int dec = kernels_named(g, "decode_kernel", fused ? "fused" : "grouped");
            const int gemm = kernels_named(g, "gemm", NULL);
            print_message("rank %d: low-latency step, %s: %d decode kernel(s), %d GEMM(s)\n", rank,
                          fused ? "fused decode kernel" : "grouped GEMMs", dec, gemm);
            assert_int_equal(dec, fused ? 1 : 0);
            assert_true(fused ? gemm == 0 : gemm >= 2);
        }
        assert_int_equal(cudaGraphInstantiate(&ge, g, 0), cudaSuccess);
        assert_int_equal(cudaMemsetAsync(dy, 0xff, bytes, st), cudaSuccess);
        assert_int_equal(cudaGraphLaunch(ge, st), cudaSuccess);
        TU_OK(moe_layer_synchronize(l, st));
        assert_int_equal(cudaMemcpy(y1, dy, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
        assert_memory_equal(y0, y1, bytes);
        assert_int_equal(cudaGraphExecDestroy(ge), cudaSuccess);
        assert_int_equal(cudaGraphDestroy(g), cudaSuccess);
        TU_OK(moe_layer_destroy(l));
    }
    end_transports();
    cudaStreamDestroy(st);
    cudaFree(dx);
    cudaFree(dy);
    free(x), free(y0), free(y1);
}

/* Ranks that pass different max_tokens_across_ranks lay their regions out differently: the step
 * fails on every rank with a status (never a silent result from misread rows), and the next step
 * with an agreed value is right again. lsa and its low-latency layout. */
static void told_disagree(int64_t rounds_of)
{
    const uint64_t seed = tu_seed("gpu_told_bad");
    moe_layer_config_t c = shape(0);
    const int64_t n = 4 + 4 * rank, H = c.hidden;
    static const int lsa_entries[] = {1, LSA_LL}; /* lsa, lsa-ll */
    float *x, *y, *ref;
    size_t e;
    if (world < 2)
        return;
    c.ep_round_tokens = rounds_of;
    x = malloc(sizeof(float) * (size_t)(n * H));
    y = malloc(sizeof(float) * (size_t)(n * H));
    ref = malloc(sizeof(float) * (size_t)(n * H));
    assert_true(x && y && ref);
    moe_gen_tokens(seed, 8 * rank, n, H, x);
    run(gt_rts.cpu_self, c, seed, x, n, NULL, ref);
    for (e = 0; e < sizeof(lsa_entries) / sizeof(lsa_entries[0]); e++) {
        const int i = lsa_entries[e];
        moe_layer_t *l = NULL;
        moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
        void *dx = NULL, *dy = NULL;
        moe_status_t st;
        int64_t m = n;
        use_transport(i, n);
        TU_OK(moe_layer_create(gt_rts.gpu, &c, &l));
        TU_OK(moe_gen_set_weights(l, &c, seed));
        assert_int_equal(cudaMalloc(&dx, sizeof(float) * (size_t)(n * H)), cudaSuccess);
        assert_int_equal(cudaMalloc(&dy, sizeof(float) * (size_t)(n * H)), cudaSuccess);
        assert_int_equal(cudaMemcpy(dx, x, sizeof(float) * (size_t)(n * H), cudaMemcpyHostToDevice),
                         cudaSuccess);
        a.num_tokens = n;
        a.x = dx;
        a.y = dy;
        a.max_tokens_across_ranks = n; /* 4 on rank 0, 8 on rank 1: not the same */
        TU_OK(moe_layer_forward(l, &a));
        st = moe_layer_synchronize(l, NULL);
        print_message("rank %d: %s, rounds of %lld, max_tokens_across_ranks %lld (ranks differ): "
                      "%s: %s\n",
                      rank, transports[i], (long long)rounds_of, (long long)n,
                      moe_status_string(st), moe_last_error());
        assert_true(st == MOE_STATUS_INVALID_ARGUMENT || st == MOE_STATUS_PEER_FAILURE);
        MPI_Allreduce(MPI_IN_PLACE, &m, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
        a.max_tokens_across_ranks = m; /* agreed: the next step is right */
        assert_int_equal(cudaMemset(dy, 0xff, sizeof(float) * (size_t)(n * H)), cudaSuccess);
        TU_OK(moe_layer_forward(l, &a));
        TU_OK(moe_layer_synchronize(l, NULL));
        assert_int_equal(cudaMemcpy(y, dy, sizeof(float) * (size_t)(n * H), cudaMemcpyDeviceToHost),
                         cudaSuccess);
        assert_int_equal(tu_count_nan(y, n * H), 0);
        assert_true(tu_rel_err(y, ref, n * H) <= 1e-2);
        cudaFree(dx);
        cudaFree(dy);
        TU_OK(moe_layer_destroy(l));
    }
    end_transports();
    free(x);
    free(y);
    free(ref);
}

static void test_told_disagree(void **state)
{
    (void)state;
    told_disagree(0); /* one round on every rank */
}

/* Told values that make different round counts: rank 0 one round of 4 tokens, rank 1 two. The
 * ranks compare their rounds' layouts in the first round, every rank skips the rest, the step
 * fails on both, and the next agreed step runs (they would stay a round apart otherwise, and
 * that step would time out). */
static void test_told_disagree_rounds(void **state)
{
    (void)state;
    told_disagree(4);
}

/* A transport the layout cannot use, or a misspelt one, fails create on every rank. */
static void test_transport_refused(void **state)
{
    moe_layer_config_t c = shape(0);
    moe_layer_t *l = NULL;
    (void)state;
    if (world < 2) /* one rank has no transport */
        return;
    setenv("MOE_EP_TRANSPORT", "nvlink", 1);
    create_fails(&c, MOE_STATUS_INVALID_ARGUMENT, "MOE_EP_TRANSPORT=nvlink");
    setenv("MOE_EP_TRANSPORT", "p2p", 1);
    c.deterministic = 1;
    create_fails(&c, MOE_STATUS_NOT_SUPPORTED, "deterministic");
    c.deterministic = 0;
    c.tp_size = world;
    c.ep_size = 1;
    setenv("MOE_EP_TRANSPORT", "lsa", 1);
    create_fails(&c, MOE_STATUS_NOT_SUPPORTED, "tp_size");
    /* the low-latency layout: lsa only, 0 or 1, alike on every rank; explain says it is on */
    c.tp_size = 1;
    c.ep_size = world;
    setenv("MOE_EP_LL", "2", 1);
    create_fails(&c, MOE_STATUS_INVALID_ARGUMENT, "MOE_EP_LL=2");
    setenv("MOE_EP_LL", rank == 0 ? "1" : "0", 1);
    create_fails(&c, MOE_STATUS_MISMATCH, "differs");
    setenv("MOE_EP_LL", "1", 1);
    if (gt_nccl_runs()) {
        setenv("MOE_EP_TRANSPORT", "allgather", 1);
        create_fails(&c, MOE_STATUS_NOT_SUPPORTED, "MOE_EP_LL=1");
    }
    setenv("MOE_EP_TRANSPORT", "lsa", 1);
    {
        char text[2048];
        TU_OK(moe_layer_create(gt_rts.gpu, &c, &l));
        TU_OK(moe_layer_explain(l, 8, text, sizeof(text)));
        assert_non_null(strstr(text, "low-latency layout"));
        TU_OK(moe_layer_destroy(l));
        l = NULL;
        /* the fused decode kernel forced: at 8 tokens a rank it runs the laid-out rows (up to
         * 64 rows an expert), past 64 / world tokens the grouped GEMMs */
        if (gt_sm90()) {
            setenv("MOE_FORCE_VARIANT", "sm90_fused_decode", 1);
            TU_OK(moe_layer_create(gt_rts.gpu, &c, &l));
            TU_OK(moe_layer_explain(l, 64 / world, text, sizeof(text)));
            assert_non_null(strstr(text, "sm90_fused_decode"));
            assert_non_null(strstr(text, "laid them out"));
            TU_OK(moe_layer_explain(l, 64 / world + 1, text, sizeof(text)));
            assert_null(strstr(text, "sm90_fused_decode"));
            TU_OK(moe_layer_destroy(l));
            l = NULL;
        }
    }
    unsetenv("MOE_EP_LL");
    if (gt_sm90()) { /* forced without the layout: refused on every rank, naming it */
        setenv("MOE_FORCE_VARIANT", "sm90_fused_decode", 1);
        create_fails(&c, MOE_STATUS_NOT_SUPPORTED, "MOE_EP_LL=1");
        unsetenv("MOE_FORCE_VARIANT");
    }
    /* in-band p2p sizes: p2p only, alike on every rank */
    setenv("MOE_EP_P2P_HEADER", "1", 1);
    create_fails(&c, MOE_STATUS_NOT_SUPPORTED, "MOE_EP_P2P_HEADER=1");
    setenv("MOE_EP_P2P_HEADER", rank == 0 ? "1" : "0", 1);
    create_fails(&c, MOE_STATUS_MISMATCH, "differs");
    unsetenv("MOE_EP_P2P_HEADER");
    unsetenv("MOE_EP_TRANSPORT");
    c.tp_size = world;
    c.ep_size = 1;
    /* deterministic with TP: NCCL would sum the TP partials in bf16 in no fixed order */
    c.deterministic = 1;
    create_fails(&c, MOE_STATUS_NOT_SUPPORTED, "deterministic = 1 with tp_size");
    assert_null(l);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_ep_mixtral),
    cmocka_unit_test(test_ep_deepseek_shared),
    cmocka_unit_test(test_tp),
    cmocka_unit_test(test_hot_rank),
    cmocka_unit_test(test_deterministic_across_ep),
    cmocka_unit_test(test_deterministic_shared_across_ep),
    cmocka_unit_test(test_told_max_tokens),
    cmocka_unit_test(test_transport_small_batches),
    cmocka_unit_test(test_transport_split_and_full),
    cmocka_unit_test(test_transport_hot_rank),
    cmocka_unit_test(test_transport_large_capacity),
    cmocka_unit_test(test_deterministic_across_transports),
    cmocka_unit_test(test_told_disagree),
    cmocka_unit_test(test_told_disagree_rounds),
    cmocka_unit_test(test_transport_refused),
    cmocka_unit_test(test_rounds),
    cmocka_unit_test(test_rounds_topk_and_profile),
    cmocka_unit_test(test_rounds_workspace),
    cmocka_unit_test(test_shared_overlap),
    cmocka_unit_test(test_microbatch),
    cmocka_unit_test(test_graph_capture),
    cmocka_unit_test(test_ll_fused_launches),
};

GT_MPI_MAIN(tests, gt_group_setup, gt_group_teardown, rank, world)
