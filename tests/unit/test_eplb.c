/* SPDX-License-Identifier: Apache-2.0 */
/* The EPLB planner (moe_eplb_plan): hand-worked cases, argument errors, the hierarchy's
 * constraints on random loads, and its balance against a brute-force optimum on small cases. */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Every slot holds a logical expert and every expert is placed. */
static void assert_valid(const int32_t *map, int n, int E)
{
    int *seen = calloc((size_t)E, sizeof(int)), i;
    assert_non_null(seen);
    for (i = 0; i < n; i++) {
        assert_in_range(map[i], 0, E - 1);
        seen[map[i]]++;
    }
    for (i = 0; i < E; i++)
        assert_true(seen[i] >= 1);
    free(seen);
}

static double max_rank_load(const int64_t *load, int E, const int32_t *map, int n, int ranks)
{
    double rl[64], mx = 0.0;
    int r;
    assert_true(ranks <= 64);
    TU_OK(moe_eplb_rank_loads(load, E, map, n, ranks, rl));
    for (r = 0; r < ranks; r++)
        mx = rl[r] > mx ? rl[r] : mx;
    return mx;
}

/* The smallest max rank load of any map of n slots (each expert at least once), by trying
 * every map: E^n of them, the loads computed inline (no allocation per map). */
static void brute_next(const int64_t *load, int E, int n, int ranks, int32_t *map, int at,
                       int *replicas, double *best)
{
    int e;
    if (at == n) {
        const int S = n / ranks;
        double mx = 0.0;
        int r, i;
        for (e = 0; e < E; e++)
            if (!replicas[e])
                return;
        for (r = 0; r < ranks; r++) {
            double rl = 0.0;
            for (i = r * S; i < (r + 1) * S; i++)
                rl += (double)load[map[i]] / replicas[map[i]];
            mx = rl > mx ? rl : mx;
        }
        *best = mx < *best ? mx : *best;
        return;
    }
    for (e = 0; e < E; e++) {
        map[at] = e;
        replicas[e]++;
        brute_next(load, E, n, ranks, map, at + 1, replicas, best);
        replicas[e]--;
    }
}

static double brute_optimum(const int64_t *load, int E, int R, int ranks)
{
    int32_t map[16];
    int replicas[16] = {0};
    double best = INFINITY;
    assert_true(E + R <= 16 && E <= 16);
    brute_next(load, E, E + R, ranks, map, 0, replicas, &best);
    return best;
}

static void test_hand_no_redundancy(void **state)
{
    /* loads 10, 1, 1, 10 on 2 ranks: heaviest first to the lightest rank with room: 0 -> r0,
     * 3 -> r1, 1 -> r0 (tie: lower rank), 2 -> r1 */
    const int64_t load[4] = {10, 1, 1, 10};
    const int32_t want[4] = {0, 1, 3, 2};
    int32_t map[4];
    (void)state;
    TU_OK(moe_eplb_plan(load, 4, 0, 2, 0, 0, map, 4));
    assert_memory_equal(map, want, sizeof(want));
}

static void test_hand_replicates_hottest(void **state)
{
    /* 100, 10, 10, 10 with 2 redundant slots: expert 0 gets both (100/2 = 50 > 10, then
     * 100/3 = 33.3 > 10); replicas 33.3 x3 and 10 x3 packed 3 per rank: r0 {0, 0, 3},
     * r1 {0, 1, 2} (loads 76.7, 53.3) */
    const int64_t load[4] = {100, 10, 10, 10};
    const int32_t want[6] = {0, 0, 3, 0, 1, 2};
    int32_t map[6];
    (void)state;
    TU_OK(moe_eplb_plan(load, 4, 0, 2, 0, 2, map, 6));
    assert_memory_equal(map, want, sizeof(want));
}

static void test_hand_groups_to_nodes(void **state)
{
    /* 8 experts in 4 groups of 2 on 2 nodes of 2 ranks: group loads 11, 2, 20, 3 -> node 0
     * {group 2, group 1}, node 1 {group 0, group 3}; inside node 0 the experts 4, 5, 2, 3 */
    const int64_t load[8] = {10, 1, 1, 1, 10, 10, 2, 1};
    int32_t map[8];
    int i;
    (void)state;
    TU_OK(moe_eplb_plan(load, 8, 4, 4, 2, 0, map, 8));
    assert_valid(map, 8, 8);
    for (i = 0; i < 4; i++) /* node 0 = ranks 0, 1 = slots 0..3: groups 2 and 1 */
        assert_true(map[i] / 2 == 2 || map[i] / 2 == 1);
    for (i = 4; i < 8; i++)
        assert_true(map[i] / 2 == 0 || map[i] / 2 == 3);
}

static void test_uniform_load_keeps_one_replica_each(void **state)
{
    int64_t load[16];
    int32_t map[16];
    int i;
    (void)state;
    for (i = 0; i < 16; i++)
        load[i] = 7;
    TU_OK(moe_eplb_plan(load, 16, 0, 4, 0, 0, map, 16));
    assert_valid(map, 16, 16);
    assert_true(max_rank_load(load, 16, map, 16, 4) == 28.0);
}

static void test_bad_arguments(void **state)
{
    int64_t load[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    int32_t map[12];
    (void)state;
    assert_int_equal(moe_eplb_plan(load, 8, 0, 3, 0, 0, map, 8), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "num_experts = 8"));
    assert_int_equal(moe_eplb_plan(load, 8, 0, 4, 0, 2, map, 10), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "num_redundant = 2"));
    assert_int_equal(moe_eplb_plan(load, 8, 0, 4, 0, 4, map, 8), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "map length = 8"));
    assert_int_equal(moe_eplb_plan(load, 8, 0, 4, 3, 0, map, 8), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "ranks_per_node = 3"));
    load[5] = -1;
    assert_int_equal(moe_eplb_plan(load, 8, 0, 4, 0, 0, map, 8), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "load[5] = -1"));
    assert_int_equal(moe_eplb_plan(NULL, 8, 0, 4, 0, 0, map, 8), MOE_STATUS_INVALID_ARGUMENT);
}

static uint64_t next_rand(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Zipf-like loads (expert i ~ 1 / (i + 1)^skew, in a shuffled order) plus noise. */
static void random_loads(int64_t *load, int E, double skew, uint64_t *s)
{
    int i;
    for (i = 0; i < E; i++)
        load[i] = (int64_t)(10000.0 / pow(i + 1, skew)) + (int64_t)(next_rand(s) % 100);
    for (i = E - 1; i > 0; i--) {
        const int j = (int)(next_rand(s) % (uint64_t)(i + 1));
        const int64_t t = load[i];
        load[i] = load[j];
        load[j] = t;
    }
}

/* Small cases, every map tried: the plan is valid, never better than the optimum (which checks
 * the brute force) and within 4/3 of it. The worst ratio seen is printed. */
static void test_against_brute_force(void **state)
{
    static const int cases[][3] = {{4, 0, 2}, {4, 2, 2}, {4, 4, 2}, {6, 2, 2},
                                   {4, 4, 4}, {6, 0, 2}, {6, 0, 3}, {4, 2, 1}};
    uint64_t s = tu_seed("eplb_brute");
    double worst = 1.0;
    size_t c;
    int rep;
    (void)state;
    for (c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const int E = cases[c][0], R = cases[c][1], ranks = cases[c][2];
        const int reps = (E + R) >= 8 ? 3 : 20;
        for (rep = 0; rep < reps; rep++) {
            int64_t load[8];
            int32_t map[16];
            double got, opt;
            random_loads(load, E, rep % 2 ? 1.2 : 0.5, &s);
            TU_OK(moe_eplb_plan(load, E, 0, ranks, 0, R, map, E + R));
            assert_valid(map, E + R, E);
            got = max_rank_load(load, E, map, E + R, ranks);
            opt = brute_optimum(load, E, R, ranks);
            assert_true(got >= opt - 1e-9);
            if (got > opt * 4.0 / 3.0 + 1e-9)
                fail_msg("E %d R %d ranks %d: plan %.1f vs optimum %.1f", E, R, ranks, got, opt);
            worst = got / opt > worst ? got / opt : worst;
        }
    }
    print_message("eplb: worst plan / optimum over the small cases: %.3f\n", worst);
}

/* DeepSeek-V3's shape: 256 experts in 8 groups, 32 redundant slots, 4 nodes of 8 ranks. The
 * plan keeps each group on one node, holds every expert, and balances better than the
 * default placement. */
static void test_deepseek_shape(void **state)
{
    enum { E = 256, R = 32, RANKS = 32, RPN = 8, GROUPS = 8 };
    uint64_t s = tu_seed("eplb_deepseek");
    int64_t load[E];
    int32_t map[E + R], dflt[E + R];
    int i, node;
    (void)state;
    random_loads(load, E, 1.0, &s);
    TU_OK(moe_eplb_plan(load, E, GROUPS, RANKS, RPN, R, map, E + R));
    assert_valid(map, E + R, E);
    for (node = 0; node < RANKS / RPN; node++) {
        const int per = (E + R) / (RANKS / RPN);
        int groups_seen[GROUPS] = {0}, n = 0;
        for (i = node * per; i < (node + 1) * per; i++)
            groups_seen[map[i] / (E / GROUPS)] = 1;
        for (i = 0; i < GROUPS; i++)
            n += groups_seen[i];
        assert_int_equal(n, GROUPS / (RANKS / RPN)); /* whole groups per node */
    }
    for (i = 0; i < E + R; i++) /* default: blocks, redundant slots on the next rank's */
        dflt[i] = i % ((E + R) / RANKS) < E / RANKS
                      ? (i / ((E + R) / RANKS)) * (E / RANKS) + i % ((E + R) / RANKS)
                      : 0;
    assert_true(max_rank_load(load, E, map, E + R, RANKS) <
                max_rank_load(load, E, dflt, E + R, RANKS));
}

/* With as many redundant slots as experts on a uniform load of one hot expert, the hot one
 * is spread over every rank. */
static void test_hot_expert_spreads(void **state)
{
    int64_t load[8] = {800, 10, 10, 10, 10, 10, 10, 10};
    int32_t map[16];
    double rl[4];
    int r, i, hot;
    (void)state;
    TU_OK(moe_eplb_plan(load, 8, 0, 4, 0, 8, map, 16));
    assert_valid(map, 16, 8);
    TU_OK(moe_eplb_rank_loads(load, 8, map, 16, 4, rl));
    for (r = 0; r < 4; r++) {
        for (hot = 0, i = r * 4; i < r * 4 + 4; i++)
            hot += map[i] == 0;
        assert_true(hot >= 1);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hand_no_redundancy),
        cmocka_unit_test(test_hand_replicates_hottest),
        cmocka_unit_test(test_hand_groups_to_nodes),
        cmocka_unit_test(test_uniform_load_keeps_one_replica_each),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_against_brute_force),
        cmocka_unit_test(test_deepseek_shape),
        cmocka_unit_test(test_hot_expert_spreads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
