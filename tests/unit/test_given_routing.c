/* SPDX-License-Identifier: Apache-2.0 */
/* Routing given by the caller (moe_forward_args_t.given_topk_ids/weights) on one rank, CPU
 * backend: the layer against the naive formula with those ids and weights, for a plain, a gated
 * shared and a sigmoid-with-bias layer (no ROUTER or ROUTER_BIAS needed), repeated ids, and every
 * bad argument (an id out of range, a weight not finite, one of the two, both routings). */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "launch/layer_gen.h"

static moe_layer_config_t small(void)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    c.num_experts = 8;
    c.top_k = 3;
    c.hidden = 64;
    c.intermediate = 96;
    c.max_tokens_per_rank = 64;
    return c;
}

/* Random ids in 0..E-1 (distinct within a token unless `repeat`) and weights in [-1, 2). */
static void make_routing(const moe_layer_config_t *c, int64_t T, int repeat, uint64_t *st,
                         int32_t *ids, float *w)
{
    int64_t t;
    int j, q;
    tu_fill_uniform(w, T * c->top_k, -1.0f, 2.0f, st);
    for (t = 0; t < T; t++)
        for (j = 0; j < c->top_k; j++) {
            float u;
            int32_t e, clash;
            do {
                tu_fill_uniform(&u, 1, 0.0f, (float)c->num_experts, st);
                e = (int32_t)u;
                e = e >= c->num_experts ? c->num_experts - 1 : e;
                for (clash = 0, q = 0; q < j && !repeat; q++)
                    clash |= ids[t * c->top_k + q] == e;
            } while (clash);
            ids[t * c->top_k + j] = e;
        }
    if (repeat && T > 0 && c->top_k > 1)
        ids[1] = ids[0]; /* token 0: two slots of one expert */
}

/* Layer of config c (all weights but the router's set unless with_router) on T tokens with
 * random given routing against the naive formula; returns the relative error. */
static double run_given(moe_layer_config_t c, int64_t T, int repeat, int with_router, uint64_t seed)
{
    const int64_t H = c.hidden, K = c.top_k;
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    tu_weights_t w;
    uint64_t st = seed * 7 + 1;
    float *x = malloc(sizeof(float) * (size_t)(T * H + 1));
    float *y = malloc(sizeof(float) * (size_t)(T * H + 1));
    float *ref = malloc(sizeof(float) * (size_t)(T * H + 1));
    float *gw = malloc(sizeof(float) * (size_t)(T * K + 1));
    float *ow = malloc(sizeof(float) * (size_t)(T * K + 1));
    int32_t *gid = malloc(sizeof(int32_t) * (size_t)(T * K + 1));
    int32_t *oid = malloc(sizeof(int32_t) * (size_t)(T * K + 1));
    int64_t i;
    double err;

    assert_true(x && y && ref && gw && ow && gid && oid);
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    TU_OK(with_router ? moe_gen_set_weights(l, &c, seed)
                      : moe_gen_set_weights_unrouted(l, &c, seed));
    moe_gen_tokens(seed + 1, 0, T, (int)H, x);
    make_routing(&c, T, repeat, &st, gid, gw);
    for (i = 0; i < T * H; i++)
        y[i] = NAN;
    for (i = 0; i < T * K; i++)
        oid[i] = -7, ow[i] = NAN;
    a.num_tokens = T;
    a.x = x;
    a.y = y;
    a.given_topk_ids = gid;
    a.given_topk_weights = gw;
    a.topk_ids = oid;
    a.topk_weights = ow;
    TU_OK(moe_layer_forward(l, &a));
    assert_int_equal(tu_count_nan(y, T * H), 0);
    assert_memory_equal(oid, gid, sizeof(int32_t) * (size_t)(T * K));
    assert_memory_equal(ow, gw, sizeof(float) * (size_t)(T * K));
    tu_weights_make(&c, seed, &w);
    tu_naive_layer(&c, &w, x, T, gid, gw, ref);
    err = tu_rel_err(y, ref, T * H);
    tu_weights_free(&w);
    TU_OK(moe_layer_destroy(l));
    free(x);
    free(y);
    free(ref);
    free(gw);
    free(ow);
    free(gid);
    free(oid);
    return err;
}

static void test_plain(void **state)
{
    uint64_t seed = tu_seed("given_plain");
    double e;
    (void)state;
    e = run_given(small(), 37, 0, 1, seed);
    print_message("given routing, bf16 weights: rel err %.3g\n", e);
    assert_true(e < 1e-5);
    assert_true(run_given(small(), 1, 0, 0, seed + 3) < 1e-5);
    assert_true(run_given(small(), 0, 0, 0, seed + 4) == 0.0);
}

static void test_gated_shared_without_router(void **state)
{
    uint64_t seed = tu_seed("given_qwen2");
    moe_layer_config_t c = small();
    (void)state;
    c.num_shared_experts = 1;
    c.shared_intermediate = 160;
    c.shared_expert_gate = 1;
    c.weight_dtype = MOE_DTYPE_F32;
    assert_true(run_given(c, 29, 0, 0, seed) < 1e-5);
}

/* Sigmoid scoring with a bias, groups and scaling: none of it applies to given routing. */
static void test_sigmoid_bias_groups_ignored(void **state)
{
    uint64_t seed = tu_seed("given_ds");
    moe_layer_config_t c = small();
    (void)state;
    c.scoring = MOE_SCORING_SIGMOID;
    c.use_score_bias = 1;
    c.n_group = 4;
    c.topk_group = 2;
    c.routed_scaling_factor = 2.5f;
    c.num_shared_experts = 2;
    assert_true(run_given(c, 33, 0, 0, seed) < 1e-5);
}

static void test_repeated_ids(void **state)
{
    uint64_t seed = tu_seed("given_repeat");
    (void)state;
    assert_true(run_given(small(), 9, 1, 1, seed) < 1e-5);
}

/* One bad argument: the status and the words its message must hold. */
static void expect_bad(moe_layer_t *l, moe_forward_args_t *a, moe_status_t want, const char *w1,
                       const char *w2)
{
    moe_status_t s = moe_layer_forward(l, a);
    assert_int_equal(s, want);
    print_message("%s\n", moe_last_error());
    assert_non_null(strstr(moe_last_error(), w1));
    if (w2)
        assert_non_null(strstr(moe_last_error(), w2));
}

static void test_bad_arguments(void **state)
{
    moe_layer_config_t c = small();
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    float x[4 * 64], y[4 * 64], w[4 * 3], logits[4 * 8] = {0};
    int32_t ids[4 * 3];
    uint64_t st = 5;
    int i;
    (void)state;
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    TU_OK(moe_gen_set_weights_unrouted(l, &c, 11));
    tu_fill_uniform(x, 4 * 64, -1.0f, 1.0f, &st);
    make_routing(&c, 4, 0, &st, ids, w);
    a.num_tokens = 4;
    a.x = x;
    a.y = y;
    /* no router set and no routing given */
    expect_bad(l, &a, MOE_STATUS_INVALID_STATE, "ROUTER", "given_topk_ids");
    a.given_topk_ids = ids;
    TU_OK(moe_layer_forward(
        l, &(moe_forward_args_t){4, MOE_DTYPE_F32, x, y, NULL, NULL, NULL, NULL, 0, ids, w}));
    expect_bad(l, &a, MOE_STATUS_INVALID_ARGUMENT, "give both or neither", NULL);
    a.given_topk_ids = NULL;
    a.given_topk_weights = w;
    expect_bad(l, &a, MOE_STATUS_INVALID_ARGUMENT, "give both or neither", NULL);
    a.given_topk_ids = ids;
    a.router_logits = logits;
    expect_bad(l, &a, MOE_STATUS_INVALID_ARGUMENT, "one routing only", NULL);
    a.router_logits = NULL;
    ids[2 * 3 + 1] = 8;
    expect_bad(l, &a, MOE_STATUS_INVALID_ARGUMENT, "given_topk_ids[2][1] = 8", "0..num_experts-1");
    ids[2 * 3 + 1] = -1;
    expect_bad(l, &a, MOE_STATUS_INVALID_ARGUMENT, "given_topk_ids[2][1] = -1", NULL);
    ids[2 * 3 + 1] = 3;
    ids[2 * 3 + 0] = ids[2 * 3 + 2] = 0;
    w[3 * 3 + 2] = NAN;
    expect_bad(l, &a, MOE_STATUS_NUMERIC_ERROR, "given_topk_weights[3][2]", "not finite");
    w[3 * 3 + 2] = INFINITY;
    expect_bad(l, &a, MOE_STATUS_NUMERIC_ERROR, "given_topk_weights[3][2] = inf", NULL);
    w[3 * 3 + 2] = 0.5f;
    for (i = 0; i < 4 * 64; i++)
        y[i] = NAN;
    TU_OK(moe_layer_forward(l, &a)); /* the layer is fine after the bad calls */
    assert_int_equal(tu_count_nan(y, 4 * 64), 0);
    TU_OK(moe_layer_destroy(l));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_plain),
        cmocka_unit_test(test_gated_shared_without_router),
        cmocka_unit_test(test_sigmoid_bias_groups_ignored),
        cmocka_unit_test(test_repeated_ids),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, tu_group_setup_cpu, tu_group_teardown);
}
