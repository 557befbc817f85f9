/* SPDX-License-Identifier: Apache-2.0 */
/* Multi-rank CPU backend (run under mpirun -np 1, 2, 4): every EP x TP layout, both
 * dispatch modes and deterministic on/off, for three routing families, against a one-rank
 * reference on the same global tokens; uneven tokens (a rank with none), a hot expert, and
 * collective error agreement (mismatched config, one rank's bad arguments); routing given by
 * the caller on every layout, and one rank's bad given routing. */
#include "testutil.h"

#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "launch/layer_gen.h"

#include "cpu_mpi.h"

enum { FAM_MIXTRAL, FAM_DEEPSEEK, FAM_QWEN2, FAM_N };

static moe_layer_config_t family(int f)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    c.num_experts = 8;
    c.top_k = 2;
    c.hidden = 64;
    c.intermediate = 128;
    c.max_tokens_per_rank = 64;
    if (f == FAM_DEEPSEEK) {
        c.num_experts = 16;
        c.top_k = 4;
        c.scoring = MOE_SCORING_SIGMOID;
        c.use_score_bias = 1;
        c.n_group = 4;
        c.topk_group = 2;
        c.routed_scaling_factor = 2.5f;
        c.num_shared_experts = 1;
    } else if (f == FAM_QWEN2) {
        c.num_experts = 12;
        c.top_k = 4;
        c.renormalize = 0;
        c.num_shared_experts = 1;
        c.shared_intermediate = 256;
        c.shared_expert_gate = 1;
    }
    return c;
}

/* y = layer(x) for n tokens on runtime rt with config c (weights from seed). */
static void run(moe_runtime_t *rt, moe_layer_config_t c, uint64_t seed, const float *x, int64_t n,
                const float *logits, float *y)
{
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    int64_t i;
    TU_OK(moe_layer_create(rt, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, seed));
    for (i = 0; i < n * c.hidden; i++)
        y[i] = NAN;
    a.num_tokens = n;
    a.x = x;
    a.y = y;
    a.router_logits = logits;
    TU_OK(moe_layer_forward(l, &a));
    TU_OK(moe_layer_destroy(l));
}

static int all_ok(int ok)
{
    MPI_Allreduce(MPI_IN_PLACE, &ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    return ok;
}

static void test_layouts_modes_families(void **state)
{
    const uint64_t seed = tu_seed("layouts");
    const int64_t Tg = 45;
    int64_t t0, n;
    int f, tp, mode, det, checked = 0;
    (void)state;
    tu_uneven_share(Tg, rank, world, &t0, &n);
    for (f = 0; f < FAM_N; f++) {
        moe_layer_config_t c = family(f);
        float *x = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
        float *ref = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
        float *y = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
        assert_true(x && ref && y);
        moe_gen_tokens(seed, t0, n, c.hidden, x);
        run(rt_self, c, seed, x, n, NULL, ref); /* one rank holds everything */
        for (tp = 1; tp <= world; tp *= 2) {
            for (mode = MOE_DISPATCH_ALL_TO_ALL; mode <= MOE_DISPATCH_ALL_GATHER; mode++) {
                for (det = 0; det <= 1; det++) {
                    moe_layer_config_t lc = c;
                    double err;
                    lc.tp_size = tp;
                    lc.ep_size = world / tp;
                    lc.dispatch = (moe_dispatch_t)mode;
                    lc.deterministic = det;
                    run(rt_world, lc, seed, x, n, NULL, y);
                    assert_int_equal(tu_count_nan(y, n * c.hidden), 0);
                    err = tu_rel_err(y, ref, n * c.hidden);
                    if (det && n > 0 && memcmp(y, ref, sizeof(float) * (size_t)(n * c.hidden)))
                        fail_msg("family %d ep %d tp %d mode %d: deterministic output differs "
                                 "bitwise from one rank (rel err %.3g)",
                                 f, world / tp, tp, mode, err);
                    if (err > 1e-5)
                        fail_msg("family %d ep %d tp %d mode %d det %d: rel err %.3g", f,
                                 world / tp, tp, mode, det, err);
                    checked++;
                }
            }
        }
        free(x);
        free(ref);
        free(y);
    }
    assert_true(all_ok(checked > 0));
}

/* Every token chooses experts 0 and 1, which live on rank 0 (EP over all ranks). */
/* FP8 layers quantise at set time: a TP slice gets the scales of the whole matrix (per tensor,
 * per output row, or its 128x128 blocks), so every layout gives one rank's output. */
static void test_fp8_scales_under_tp(void **state)
{
    const uint64_t seed = tu_seed("fp8_tp");
    const moe_scale_kind_t kinds[3] = {MOE_SCALE_PER_TENSOR, MOE_SCALE_PER_CHANNEL,
                                       MOE_SCALE_BLOCK_128};
    int64_t t0, n;
    (void)state;
    tu_uneven_share(33, rank, world, &t0, &n);
    for (int k = 0; k < 3; k++) {
        moe_layer_config_t c = family(FAM_MIXTRAL);
        float *x, *ref, *y;
        double err;
        c.hidden = 128;
        c.intermediate = 128 * (world > 1 ? world : 1) * 2;
        c.weight_dtype = MOE_DTYPE_FP8_E4M3;
        c.scale_kind = kinds[k];
        x = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
        ref = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
        y = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
        assert_true(x && ref && y);
        moe_gen_tokens(seed, t0, n, c.hidden, x);
        run(rt_self, c, seed, x, n, NULL, ref);
        c.tp_size = world;
        c.ep_size = 1;
        run(rt_world, c, seed, x, n, NULL, y);
        err = tu_rel_err(y, ref, n * c.hidden);
        if (err > 1e-5)
            fail_msg("scale kind %d, tp %d: rel err %.3g against one rank", (int)kinds[k], world,
                     err);
        free(x);
        free(ref);
        free(y);
    }
}

static void test_hot_expert(void **state)
{
    const uint64_t seed = tu_seed("hot");
    moe_layer_config_t c = family(FAM_MIXTRAL);
    const int64_t n = 30;
    float *x = malloc(sizeof(float) * n * 64), *y = malloc(sizeof(float) * n * 64);
    float *ref = malloc(sizeof(float) * n * 64), *logits = calloc(n * 8, sizeof(float));
    int64_t i;
    (void)state;
    moe_gen_tokens(seed, rank * n, n, 64, x);
    for (i = 0; i < n; i++) {
        logits[i * 8 + 0] = 3.0f + 0.1f * (float)(i % 5);
        logits[i * 8 + 1] = 2.0f;
    }
    c.deterministic = 1;
    run(rt_self, c, seed, x, n, logits, ref);
    run(rt_world, c, seed, x, n, logits, y);
    assert_memory_equal(y, ref, sizeof(float) * n * 64);
    free(x);
    free(y);
    free(ref);
    free(logits);
}

/* Deterministic mode: a token's output is bitwise the same alone and in any batch, on any
 * layout. */
static void test_deterministic_batch_sizes(void **state)
{
    const uint64_t seed = tu_seed("det_batch");
    moe_layer_config_t c = family(FAM_DEEPSEEK);
    float x1[64], y1[64], *x = malloc(sizeof(float) * 20 * 64),
                          *y = malloc(sizeof(float) * 20 * 64);
    (void)state;
    c.deterministic = 1;
    c.tp_size = world >= 2 ? 2 : 1;
    moe_gen_tokens(seed, 100, 20, 64, x);
    memcpy(x1, x + 7 * 64, sizeof(x1));
    run(rt_world, c, seed, x, 20, NULL, y);
    run(rt_world, c, seed, x1, rank == 0 ? 1 : 0, NULL, y1);
    if (rank == 0)
        assert_memory_equal(y1, y + 7 * 64, sizeof(y1));
    free(x);
    free(y);
}

/* Rank 0 passes another hidden size: every rank gets an error, none hangs. */
static void test_mismatched_config(void **state)
{
    moe_layer_config_t c = family(FAM_MIXTRAL);
    moe_layer_t *l = NULL;
    moe_status_t st;
    double t0 = MPI_Wtime();
    (void)state;
    if (world == 1)
        skip();
    if (rank == 0)
        c.hidden = 128;
    st = moe_layer_create(rt_world, &c, &l);
    assert_int_equal(st, MOE_STATUS_MISMATCH);
    assert_null(l);
    assert_true(MPI_Wtime() - t0 < 30.0);
    /* one rank's invalid config: it gets INVALID_ARGUMENT, the others PEER_FAILURE */
    c = family(FAM_MIXTRAL);
    if (rank == world - 1)
        c.top_k = 99;
    st = moe_layer_create(rt_world, &c, &l);
    assert_int_equal(st, rank == world - 1 ? MOE_STATUS_INVALID_ARGUMENT : MOE_STATUS_PEER_FAILURE);
    assert_null(l);
}

/* One rank's bad forward arguments fail the step on every rank. */
static void test_bad_forward_on_one_rank(void **state)
{
    moe_layer_config_t c = family(FAM_MIXTRAL);
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    float x[4 * 64] = {0}, y[4 * 64];
    moe_status_t st;
    (void)state;
    if (world == 1)
        skip();
    TU_OK(moe_layer_create(rt_world, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, 1));
    a.num_tokens = rank == 0 ? 65 : 4; /* 65 > max_tokens_per_rank on rank 0 */
    a.x = x;
    a.y = y;
    st = moe_layer_forward(l, &a);
    assert_int_equal(st, rank == 0 ? MOE_STATUS_INVALID_ARGUMENT : MOE_STATUS_PEER_FAILURE);
    a.num_tokens = 4; /* the layer stays usable */
    TU_OK(moe_layer_forward(l, &a));
    TU_OK(moe_layer_destroy(l));
}

/* moe_runtime_max_tokens: the largest count on every rank; one rank's bad arguments fail the
 * call on every rank, naming it, and the runtime stays usable; the bound it gives serves a
 * step whose ranks bring different counts. */
static void test_max_tokens(void **state)
{
    moe_layer_config_t c = family(FAM_DEEPSEEK);
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    float *x, *y;
    int64_t m = -7, T = 5 * rank + 1;
    moe_status_t st;
    (void)state;
    TU_OK(moe_runtime_max_tokens(rt_world, T, &m));
    assert_int_equal(m, 5 * (world - 1) + 1);
    TU_OK(moe_runtime_max_tokens(rt_self, T, &m));
    assert_int_equal(m, T);
    TU_OK(moe_runtime_max_tokens(rt_world, 0, &m));
    assert_int_equal(m, 0);
    /* the last rank's count is negative, then rank 0 gives no place for the result */
    m = -7;
    st = moe_runtime_max_tokens(rt_world, rank == world - 1 ? -3 : 2, &m);
    assert_int_equal(st, rank == world - 1 ? MOE_STATUS_INVALID_ARGUMENT : MOE_STATUS_PEER_FAILURE);
    assert_int_equal(m, -7);
    if (rank != world - 1) {
        char want[96];
        snprintf(want, sizeof(want), "rank %d failed with %s", world - 1,
                 moe_status_string(MOE_STATUS_INVALID_ARGUMENT));
        assert_non_null(strstr(moe_last_error(), want));
    }
    st = moe_runtime_max_tokens(rt_world, 2, rank == 0 ? NULL : &m);
    assert_int_equal(st, rank == 0 ? MOE_STATUS_INVALID_ARGUMENT : MOE_STATUS_PEER_FAILURE);
    /* usable after: the bound of uneven counts passed to a step, against the CPU reference run
     * on one rank (each rank's tokens are its own: T of them) */
    TU_OK(moe_runtime_max_tokens(rt_world, T, &m));
    assert_int_equal(m, 5 * (world - 1) + 1);
    x = malloc(sizeof(float) * (size_t)(T * c.hidden));
    y = malloc(sizeof(float) * (size_t)(T * c.hidden));
    moe_gen_tokens(tu_seed("max_tokens"), 100 * rank, T, c.hidden, x);
    TU_OK(moe_layer_create(rt_world, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, 3));
    a.num_tokens = T;
    a.x = x;
    a.y = y;
    a.max_tokens_across_ranks = m;
    TU_OK(moe_layer_forward(l, &a));
    TU_OK(moe_layer_synchronize(l, NULL));
    TU_OK(moe_layer_destroy(l));
    {
        float *ref = malloc(sizeof(float) * (size_t)(T * c.hidden));
        run(rt_self, c, 3, x, T, NULL, ref);
        assert_true(tu_rel_err(y, ref, T * c.hidden) <= 1e-5);
        free(ref);
    }
    free(x);
    free(y);
}

/* Given routing of global tokens [t0, t0 + n): ids a hash of the token and slot (distinct within
 * a token), weights in [-1, 2); the same on every layout. */
static void given_routing(const moe_layer_config_t *c, int64_t t0, int64_t n, int32_t *ids,
                          float *w)
{
    int64_t t;
    int j;
    for (t = 0; t < n; t++)
        for (j = 0; j < c->top_k; j++) {
            const uint64_t h = (uint64_t)(t0 + t) * 2654435761u + (uint64_t)j * 40503u;
            ids[t * c->top_k + j] =
                (int32_t)(((uint64_t)(t0 + t) * 7u + (uint64_t)j * 3u) % (uint64_t)c->num_experts);
            w[t * c->top_k + j] = -1.0f + 3.0f * (float)(h % 1000u) / 1000.0f;
        }
}

static char given_error[512]; /* run_given's forward's message */

/* y = layer(x) with the given routing, on runtime rt (no ROUTER set). */
static moe_status_t run_given(moe_runtime_t *rt, moe_layer_config_t c, uint64_t seed,
                              const float *x, int64_t n, const int32_t *ids, const float *w,
                              float *y)
{
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    moe_status_t st;
    int64_t i;
    TU_OK(moe_layer_create(rt, &c, &l));
    TU_OK(moe_gen_set_weights_unrouted(l, &c, seed));
    for (i = 0; i < n * c.hidden; i++)
        y[i] = NAN;
    a.num_tokens = n;
    a.x = x;
    a.y = y;
    a.given_topk_ids = ids;
    a.given_topk_weights = w;
    st = moe_layer_forward(l, &a);
    snprintf(given_error, sizeof(given_error), "%s", moe_last_error());
    TU_OK(moe_layer_destroy(l));
    return st;
}

/* Given routing across ranks: every EP x TP layout and dispatch mode, without and with
 * redundant expert slots (EPLB), gives one rank's output. */
static void test_given_routing_layouts(void **state)
{
    const uint64_t seed = tu_seed("given_layouts");
    const int64_t Tg = 41;
    int64_t t0, n;
    int f, tp, mode, checked = 0;
    (void)state;
    tu_uneven_share(Tg, rank, world, &t0, &n);
    for (f = 0; f < FAM_N; f++) {
        moe_layer_config_t c = family(f);
        float *x = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
        float *ref = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
        float *y = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
        float *w = malloc(sizeof(float) * (size_t)(n * c.top_k + 1));
        int32_t *ids = malloc(sizeof(int32_t) * (size_t)(n * c.top_k + 1));
        assert_true(x && ref && y && w && ids);
        moe_gen_tokens(seed, t0, n, c.hidden, x);
        given_routing(&c, t0, n, ids, w);
        TU_OK(run_given(rt_self, c, seed, x, n, ids, w, ref));
        for (tp = 1; tp <= world; tp *= 2)
            for (mode = 0; mode < 4; mode++) {
                moe_layer_config_t lc = c;
                double err;
                lc.tp_size = tp;
                lc.ep_size = world / tp;
                lc.dispatch = (moe_dispatch_t)(MOE_DISPATCH_ALL_TO_ALL + mode % 2);
                lc.num_redundant_experts = mode / 2 * lc.ep_size; /* EPLB's replicas too */
                TU_OK(run_given(rt_world, lc, seed, x, n, ids, w, y));
                assert_int_equal(tu_count_nan(y, n * c.hidden), 0);
                err = tu_rel_err(y, ref, n * c.hidden);
                if (err > 1e-5)
                    fail_msg("given routing, family %d ep %d tp %d mode %d R %d: rel err %.3g", f,
                             world / tp, tp, mode % 2, lc.num_redundant_experts, err);
                checked++;
            }
        free(x);
        free(ref);
        free(y);
        free(w);
        free(ids);
    }
    assert_true(all_ok(checked > 0));
}

/* One rank's given id out of range (or weight not finite) fails the step on every rank. */
static void test_given_routing_bad_on_one_rank(void **state)
{
    moe_layer_config_t c = family(FAM_MIXTRAL);
    float x[4 * 64] = {0}, y[4 * 64], w[4 * 2];
    int32_t ids[4 * 2];
    int bad;
    (void)state;
    given_routing(&c, 0, 4, ids, w);
    for (bad = 0; bad < 2; bad++) {
        moe_status_t st, want_here = bad ? MOE_STATUS_NUMERIC_ERROR : MOE_STATUS_INVALID_ARGUMENT;
        if (rank == world - 1 && bad == 0)
            ids[5] = c.num_experts;
        if (rank == world - 1 && bad == 1)
            ids[5] = 1, w[2] = NAN;
        st = run_given(rt_world, c, 3, x, 4, ids, w, y);
        assert_int_equal(st, rank == world - 1 ? want_here : MOE_STATUS_PEER_FAILURE);
        if (rank == world - 1)
            assert_non_null(
                strstr(given_error, bad ? "given_topk_weights[1][0]" : "given_topk_ids[2][1]"));
        w[2] = 0.5f;
    }
    TU_OK(run_given(rt_world, c, 3, x, 4, ids, w, y)); /* good again */
}

/* All ranks of this test share one host: node-local ranks are the world ranks. */
static void test_node_local_rank(void **state)
{
    moe_runtime_info_t info;
    (void)state;
    TU_OK(moe_runtime_get_info(rt_world, &info));
    assert_int_equal(info.local_rank, rank);
    assert_int_equal(info.local_size, world);
    assert_int_equal(info.world_size, world);
    TU_OK(moe_runtime_get_info(rt_self, &info));
    assert_int_equal(info.local_rank, 0);
    assert_int_equal(info.local_size, 1);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_node_local_rank),
    cmocka_unit_test(test_layouts_modes_families),
    cmocka_unit_test(test_fp8_scales_under_tp),
    cmocka_unit_test(test_hot_expert),
    cmocka_unit_test(test_deterministic_batch_sizes),
    cmocka_unit_test(test_mismatched_config),
    cmocka_unit_test(test_bad_forward_on_one_rank),
    cmocka_unit_test(test_max_tokens),
    cmocka_unit_test(test_given_routing_layouts),
    cmocka_unit_test(test_given_routing_bad_on_one_rank),
};

CPU_MPI_MAIN(tests)
