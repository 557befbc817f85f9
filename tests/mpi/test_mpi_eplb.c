/* SPDX-License-Identifier: Apache-2.0 */
/* Expert placement on the CPU backend (run under mpirun -np 1, 2, 4): redundant slots, placement
 * changes (weights moved between ranks) and rebalances keep the deterministic output bitwise
 * equal to one rank without them, in every EP x TP layout and both dispatch modes; a hot
 * expert's rows split evenly over its replicas; the load window and the rebalance; placement
 * errors agreed on every rank. */
#include "testutil.h"

#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "launch/layer_gen.h"

#include "cpu_mpi.h"

static moe_layer_config_t family(int deepseek)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    c.num_experts = 8;
    c.top_k = 2;
    c.hidden = 64;
    c.intermediate = 128;
    c.max_tokens_per_rank = 64;
    c.deterministic = 1;
    if (deepseek) {
        c.num_experts = 16;
        c.top_k = 4;
        c.scoring = MOE_SCORING_SIGMOID;
        c.use_score_bias = 1;
        c.n_group = 4;
        c.topk_group = 2;
        c.routed_scaling_factor = 2.5f;
        c.num_shared_experts = 1;
    }
    return c;
}

static moe_layer_t *make_layer(moe_runtime_t *rt, const moe_layer_config_t *c, uint64_t seed)
{
    moe_layer_t *l = NULL;
    TU_OK(moe_layer_create(rt, c, &l));
    TU_OK(moe_gen_set_weights(l, c, seed));
    return l;
}

static void forward(moe_layer_t *l, const float *x, int64_t n, const float *logits, float *y,
                    int hidden)
{
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    int64_t i;
    for (i = 0; i < n * hidden; i++)
        y[i] = NAN;
    a.num_tokens = n;
    a.x = x;
    a.y = y;
    a.router_logits = logits;
    TU_OK(moe_layer_forward(l, &a));
}

static uint64_t xs(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* A valid map from `seed` (the same on every rank): every expert once, R more at random,
 * shuffled over the slots. */
static void random_map(uint64_t seed, int E, int R, int32_t *map)
{
    uint64_t s = seed | 1;
    int i;
    for (i = 0; i < E + R; i++)
        map[i] = i < E ? i : (int32_t)(xs(&s) % (uint64_t)E);
    for (i = E + R - 1; i > 0; i--) {
        const int j = (int)(xs(&s) % (uint64_t)(i + 1));
        const int32_t t = map[i];
        map[i] = map[j];
        map[j] = t;
    }
}

static void assert_bitwise(const float *y, const float *ref, int64_t n, const char *what)
{
    if (n > 0 && memcmp(y, ref, sizeof(float) * (size_t)n))
        fail_msg("rank %d: %s: output differs bitwise from one rank without placement (rel err "
                 "%.3g)",
                 rank, what, tu_rel_err(y, ref, n));
}

/* Skewed router logits (expert e ~ (e + 1)^-1.5) for this rank's tokens. */
static float *skewed(uint64_t seed, int64_t t0, int64_t n, int E)
{
    float *lg = malloc(sizeof(float) * (size_t)(n * E + 1));
    assert_non_null(lg);
    moe_gen_skewed_logits(seed, t0, n, E, 1.5, lg);
    return lg;
}

static void test_replicas_bitwise(void **state)
{
    const uint64_t seed = tu_seed("eplb_bitwise");
    const int64_t Tg = 45;
    int64_t t0, n;
    int ds, tp, mode, rmul, checked = 0;
    (void)state;
    tu_uneven_share(Tg, rank, world, &t0, &n);
    for (ds = 0; ds <= 1; ds++) {
        moe_layer_config_t c = family(ds);
        const int64_t nv = n * c.hidden;
        float *x = malloc(sizeof(float) * (size_t)(nv + 1));
        float *ref = malloc(sizeof(float) * (size_t)(nv + 1));
        float *y = malloc(sizeof(float) * (size_t)(nv + 1));
        float *lg = skewed(seed, t0, n, c.num_experts);
        moe_layer_t *l;
        assert_true(x && ref && y);
        moe_gen_tokens(seed, t0, n, c.hidden, x);
        l = make_layer(rt_self, &c, seed);
        forward(l, x, n, ds ? NULL : lg, ref, c.hidden);
        moe_layer_destroy(l);
        for (tp = 1; tp <= world; tp *= 2)
            for (mode = MOE_DISPATCH_ALL_TO_ALL; mode <= MOE_DISPATCH_ALL_GATHER; mode++)
                for (rmul = 0; rmul <= 2; rmul++) {
                    moe_layer_config_t lc = c;
                    int32_t map[64];
                    char what[128];
                    lc.tp_size = tp;
                    lc.ep_size = world / tp;
                    lc.dispatch = (moe_dispatch_t)mode;
                    lc.num_redundant_experts = rmul * lc.ep_size;
                    snprintf(what, sizeof(what), "%s ep %d tp %d mode %d R %d",
                             ds ? "deepseek" : "mixtral", lc.ep_size, tp, mode,
                             lc.num_redundant_experts);
                    l = make_layer(rt_world, &lc, seed);
                    forward(l, x, n, ds ? NULL : lg, y, c.hidden);
                    assert_bitwise(y, ref, nv, what);
                    /* a new placement moves the weights; the output keeps its bits */
                    random_map(seed + (uint64_t)rmul, c.num_experts, lc.num_redundant_experts, map);
                    TU_OK(
                        moe_layer_set_placement(l, map, c.num_experts + lc.num_redundant_experts));
                    forward(l, x, n, ds ? NULL : lg, y, c.hidden);
                    assert_bitwise(y, ref, nv, what);
                    if (lc.ep_size > 1) { /* and weights did travel */
                        moe_placement_stats_t ps;
                        int moved;
                        TU_OK(moe_layer_get_placement_stats(l, &ps));
                        moved = ps.slots_received;
                        MPI_Allreduce(MPI_IN_PLACE, &moved, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
                        assert_true(moved > 0);
                    }
                    /* and a rebalance from the two steps' load */
                    TU_OK(moe_layer_rebalance(l));
                    forward(l, x, n, ds ? NULL : lg, y, c.hidden);
                    assert_bitwise(y, ref, nv, what);
                    moe_layer_destroy(l);
                    checked++;
                }
        free(x);
        free(ref);
        free(y);
        free(lg);
    }
    assert_true(checked == 2 * 2 * 3 * (world == 1 ? 1 : world == 2 ? 2 : 3));
}

/* Every token picks experts 0 and 1; expert 0 gets a replica on every EP rank: its rows split
 * over them within one row per source rank, as (t + rank) mod replicas makes them. */
static void test_hot_expert_splits(void **state)
{
    moe_layer_config_t c = family(0);
    const int64_t n = 40;
    const int ep = world, S = (8 + world) / world;
    float *x = malloc(sizeof(float) * (size_t)(n * c.hidden));
    float *y = malloc(sizeof(float) * (size_t)(n * c.hidden));
    float *lg = calloc((size_t)(n * 8), sizeof(float));
    int32_t map[16];
    moe_layer_stats_t st;
    moe_layer_t *l;
    int64_t t, rows, mx, mn, e0 = 0;
    int g, i;
    (void)state;
    assert_true(x && y && lg);
    moe_gen_tokens(5, n * rank, n, c.hidden, x);
    for (t = 0; t < n; t++) {
        lg[t * 8 + 0] = 4.0f;
        lg[t * 8 + 1] = 3.0f;
    }
    c.ep_size = ep;
    c.num_redundant_experts = ep;
    /* rank g: slot 0 holds expert 0, then its share of 1..7 (filled in order, the rest 7) */
    for (g = 0, i = 1; g < ep; g++) {
        int k;
        map[g * S] = 0;
        for (k = 1; k < S; k++)
            map[g * S + k] = i <= 7 ? i++ : 7;
    }
    l = make_layer(rt_world, &c, 3);
    TU_OK(moe_layer_set_placement(l, map, 8 + ep));
    forward(l, x, n, lg, y, c.hidden);
    TU_OK(moe_layer_get_stats(l, &st));
    /* rows of expert 0 this rank computed: n * world / ep each, since every source splits its
     * n tokens over the ep replicas */
    rows = st.rows_received;
    for (g = 0; g < ep; g++)
        for (i = 0; i < S; i++)
            if (map[g * S + i] == 1 && g == rank)
                e0 = 1; /* this rank also serves expert 1 (all n * world of its rows) */
    rows -= e0 * n * world;
    MPI_Allreduce(&rows, &mx, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(&rows, &mn, 1, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
    assert_true(mx - mn <= world);
    assert_true(mx <= (n * world + ep - 1) / ep + world);
    moe_layer_destroy(l);
    free(x);
    free(y);
    free(lg);
}

static void test_load_window_and_rebalance(void **state)
{
    moe_layer_config_t c = family(0);
    const int64_t n = 32;
    float *x = malloc(sizeof(float) * (size_t)(n * c.hidden));
    float *y = malloc(sizeof(float) * (size_t)(n * c.hidden));
    float *lg = skewed(11, n * rank, n, 8);
    int64_t last[8], win[8], glob[8];
    int32_t got[16], want[16];
    moe_layer_t *l;
    int e;
    (void)state;
    assert_true(x && y);
    moe_gen_tokens(11, n * rank, n, c.hidden, x);
    c.num_redundant_experts = world;
    l = make_layer(rt_world, &c, 11);
    forward(l, x, n, lg, y, c.hidden);
    forward(l, x, n, lg, y, c.hidden);
    TU_OK(moe_layer_get_expert_load(l, last, 8));
    TU_OK(moe_layer_get_expert_load_window(l, win, 8));
    for (e = 0; e < 8; e++)
        assert_int_equal(win[e], 2 * last[e]);
    MPI_Allreduce(win, glob, 8, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    TU_OK(moe_eplb_plan(glob, 8, 0, world, 0, world, want, 8 + world));
    TU_OK(moe_layer_rebalance(l));
    TU_OK(moe_layer_get_placement(l, got, 8 + world));
    assert_memory_equal(got, want, sizeof(int32_t) * (size_t)(8 + world));
    TU_OK(moe_layer_get_expert_load_window(l, win, 8));
    for (e = 0; e < 8; e++)
        assert_int_equal(win[e], 0);
    /* an empty window keeps the placement */
    TU_OK(moe_layer_rebalance(l));
    TU_OK(moe_layer_get_placement(l, got, 8 + world));
    assert_memory_equal(got, want, sizeof(int32_t) * (size_t)(8 + world));
    forward(l, x, n, lg, y, c.hidden);
    TU_OK(moe_layer_reset_expert_load(l));
    TU_OK(moe_layer_get_expert_load_window(l, win, 8));
    for (e = 0; e < 8; e++)
        assert_int_equal(win[e], 0);
    moe_layer_destroy(l);
    free(x);
    free(y);
    free(lg);
}

/* A placement set before any expert weight moves nothing; the weights set afterwards land in
 * the new slots (every replica). */
static void test_placement_before_weights(void **state)
{
    moe_layer_config_t c = family(0);
    const int64_t n = 20, nv = n * 64;
    float *x = malloc(sizeof(float) * (size_t)nv), *y = malloc(sizeof(float) * (size_t)nv);
    float *ref = malloc(sizeof(float) * (size_t)nv);
    int32_t map[16];
    moe_placement_stats_t ps;
    moe_layer_t *l = NULL;
    (void)state;
    assert_true(x && y && ref);
    moe_gen_tokens(21, n * rank, n, c.hidden, x);
    l = make_layer(rt_self, &c, 21);
    forward(l, x, n, NULL, ref, c.hidden);
    moe_layer_destroy(l);
    c.num_redundant_experts = 2 * world;
    random_map(77, 8, 2 * world, map);
    TU_OK(moe_layer_create(rt_world, &c, &l));
    TU_OK(moe_layer_set_placement(l, map, 8 + 2 * world));
    TU_OK(moe_layer_get_placement_stats(l, &ps));
    assert_int_equal(ps.slots_received, 0);
    assert_int_equal(ps.bytes_received, 0);
    TU_OK(moe_gen_set_weights(l, &c, 21));
    forward(l, x, n, NULL, y, c.hidden);
    assert_bitwise(y, ref, nv, "placement before weights");
    moe_layer_destroy(l);
    free(x);
    free(y);
    free(ref);
}

static void expect(moe_status_t got, moe_status_t want, const char *text)
{
    if (got != want)
        fail_msg("rank %d: got %s, want %s (%s)", rank, moe_status_string(got),
                 moe_status_string(want), moe_last_error());
    if (text && !strstr(moe_last_error(), text))
        fail_msg("rank %d: error \"%s\" does not name \"%s\"", rank, moe_last_error(), text);
}

static void test_placement_errors(void **state)
{
    moe_layer_config_t c = family(0);
    int32_t map[16];
    moe_layer_t *l = NULL;
    const int n = 8 + world;
    int i;
    (void)state;
    c.num_redundant_experts = world;
    l = make_layer(rt_world, &c, 1);
    TU_OK(moe_layer_get_placement(l, map, n));
    expect(moe_layer_set_placement(l, map, n - 1), MOE_STATUS_INVALID_ARGUMENT, "n = ");
    map[0] = 99;
    expect(moe_layer_set_placement(l, map, n), MOE_STATUS_INVALID_ARGUMENT, "map[0] = 99");
    for (i = 0; i < n; i++)
        map[i] = i % 7; /* expert 7 nowhere */
    expect(moe_layer_set_placement(l, map, n), MOE_STATUS_INVALID_ARGUMENT, "logical expert 7");
    /* one rank's bad map fails the call on every rank */
    random_map(5, 8, world, map);
    if (rank == world - 1)
        map[1] = -3;
    expect(moe_layer_set_placement(l, map, n),
           rank == world - 1 ? MOE_STATUS_INVALID_ARGUMENT : MOE_STATUS_PEER_FAILURE,
           rank == world - 1 ? "map[1] = -3" : "failed with MOE_STATUS_INVALID_ARGUMENT");
    if (world > 1) { /* valid maps that differ */
        random_map(5 + (uint64_t)rank, 8, world, map);
        expect(moe_layer_set_placement(l, map, n), MOE_STATUS_MISMATCH, "different maps");
    }
    /* the layer still runs on its old placement */
    random_map(9, 8, world, map);
    TU_OK(moe_layer_set_placement(l, map, n));
    moe_layer_destroy(l);

    /* some expert weights set, others not */
    TU_OK(moe_layer_create(rt_world, &c, &l));
    {
        float w[128 * 64] = {0};
        moe_tensor_t t = {MOE_DTYPE_F32, 128, 64, w, NULL, 0, 0};
        int32_t cur[16];
        TU_OK(moe_layer_get_placement(l, cur, n));
        TU_OK(moe_layer_set_weight(l, MOE_WEIGHT_GATE_PROJ, cur[rank * (n / world)], &t));
        expect(moe_layer_set_placement(l, cur, n), MOE_STATUS_INVALID_STATE,
               "some expert weights are set and others not");
    }
    moe_layer_destroy(l);

    /* redundant slots that do not split over the EP ranks, and uneven experts */
    if (world > 1) {
        c.num_redundant_experts = 1;
        expect(moe_layer_create(rt_world, &c, &l), MOE_STATUS_INVALID_ARGUMENT,
               "num_redundant_experts = 1");
    }
    if (world == 4) {
        int32_t id[6] = {0, 1, 2, 3, 4, 5};
        c.num_experts = 6;
        c.num_redundant_experts = 0;
        TU_OK(moe_layer_create(rt_world, &c, &l));
        expect(moe_layer_set_placement(l, id, 6), MOE_STATUS_INVALID_ARGUMENT,
               "do not split equally");
        expect(moe_layer_rebalance(l), MOE_STATUS_INVALID_STATE, "num_experts = 6");
        moe_layer_destroy(l);
        c.num_redundant_experts = 4;
        expect(moe_layer_create(rt_world, &c, &l), MOE_STATUS_INVALID_ARGUMENT,
               "needs num_experts (6) a multiple of ep_size (4)");
    }
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_replicas_bitwise),
    cmocka_unit_test(test_hot_expert_splits),
    cmocka_unit_test(test_load_window_and_rebalance),
    cmocka_unit_test(test_placement_before_weights),
    cmocka_unit_test(test_placement_errors),
};

CPU_MPI_MAIN(tests)
