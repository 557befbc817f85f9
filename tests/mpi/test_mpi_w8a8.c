/* SPDX-License-Identifier: Apache-2.0 */
/* FP8 W8A8 on the multi-rank CPU backend (mpirun -np 1, 2, 4): expert parallelism over every
 * rank, both dispatch modes, deterministic on and off, gives one rank's output for every scale
 * kind; TP slices of block-scaled layers (128-aligned 1x128 groups) do too; ranks that disagree
 * on fp8_math get MOE_STATUS_MISMATCH. */
#include "testutil.h"

#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "launch/layer_gen.h"

#include "cpu_mpi.h"

/* y = layer(x) for n tokens on runtime rt with config c (weights from seed). */
static void run(moe_runtime_t *rt, moe_layer_config_t c, uint64_t seed, const float *x, int64_t n,
                float *y)
{
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    TU_OK(moe_layer_create(rt, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, seed));
    for (int64_t i = 0; i < n * c.hidden; i++)
        y[i] = NAN;
    a.num_tokens = n;
    a.x = x;
    a.y = y;
    TU_OK(moe_layer_forward(l, &a));
    TU_OK(moe_layer_destroy(l));
}

static moe_layer_config_t w8a8_config(moe_scale_kind_t k)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    c.num_experts = 8;
    c.top_k = 2;
    c.hidden = 320; /* 2.5 blocks of 128: a partial last group along H */
    c.intermediate = 128 * 4 + 64;
    c.max_tokens_per_rank = 64;
    c.weight_dtype = MOE_DTYPE_FP8_E4M3;
    c.scale_kind = k;
    c.fp8_math = MOE_FP8_MATH_W8A8;
    return c;
}

/* Routed experts over EP = world; with block scales also the shared MLP, whose slices over the
 * ranks are then whole 1x128 groups (a per-token scale of a slice is the slice's own: with
 * per-tensor or per-channel weights a split shared MLP is not one rank's, docs/SEMANTICS.md). */
static void test_ep_equals_one_rank(void **state)
{
    const uint64_t seed = tu_seed("w8a8_ep");
    static const moe_scale_kind_t kinds[3] = {MOE_SCALE_PER_TENSOR, MOE_SCALE_PER_CHANNEL,
                                              MOE_SCALE_BLOCK_128};
    int64_t t0, n;
    int checked = 0;
    (void)state;
    tu_uneven_share(45, rank, world, &t0, &n);
    for (int k = 0; k < 3; k++) {
        moe_layer_config_t c = w8a8_config(kinds[k]);
        float *x, *ref, *y, *y16;
        if (kinds[k] == MOE_SCALE_BLOCK_128) {
            c.num_shared_experts = 1;
            c.shared_intermediate = 128 * 4; /* a multiple of 128 x world for world <= 4 */
        }
        x = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
        ref = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
        y = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
        y16 = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
        assert_true(x && ref && y && y16);
        moe_gen_tokens(seed, t0, n, c.hidden, x);
        run(rt_self, c, seed, x, n, ref); /* one rank holds everything */
        for (int mode = MOE_DISPATCH_ALL_TO_ALL; mode <= MOE_DISPATCH_ALL_GATHER; mode++)
            for (int det = 0; det <= 1; det++) {
                moe_layer_config_t lc = c;
                double err;
                lc.ep_size = world;
                lc.tp_size = 1;
                lc.dispatch = (moe_dispatch_t)mode;
                lc.deterministic = det;
                run(rt_world, lc, seed, x, n, y);
                assert_int_equal(tu_count_nan(y, n * c.hidden), 0);
                err = tu_rel_err(y, ref, n * c.hidden);
                if (err > 1e-5)
                    fail_msg("scale kind %d ep %d mode %d det %d: W8A8 rel err %.3g against one "
                             "rank",
                             (int)kinds[k], world, mode, det, err);
                checked++;
            }
        /* the same layer in W8A16 is another arithmetic: the comparison can fail */
        c.fp8_math = MOE_FP8_MATH_W8A16;
        c.ep_size = world;
        run(rt_world, c, seed, x, n, y16);
        if (n > 0 && !(tu_rel_err(y16, ref, n * c.hidden) > 1e-3))
            fail_msg("scale kind %d: W8A16 within %.3g of W8A8", (int)kinds[k],
                     tu_rel_err(y16, ref, n * c.hidden));
        free(x);
        free(ref);
        free(y);
        free(y16);
    }
    assert_true(checked > 0);
}

/* Block scales under TP = world: slices of I are multiples of 128, so the 1x128 groups of h are
 * the ones one rank makes; only the order of sums differs. */
static void test_block_tp_equals_one_rank(void **state)
{
    const uint64_t seed = tu_seed("w8a8_tp");
    moe_layer_config_t c = w8a8_config(MOE_SCALE_BLOCK_128);
    int64_t t0, n;
    float *x, *ref, *y;
    double err;
    (void)state;
    c.intermediate = 128 * 4 * 2;
    tu_uneven_share(33, rank, world, &t0, &n);
    x = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
    ref = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
    y = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
    assert_true(x && ref && y);
    moe_gen_tokens(seed, t0, n, c.hidden, x);
    run(rt_self, c, seed, x, n, ref);
    c.tp_size = world;
    c.ep_size = 1;
    run(rt_world, c, seed, x, n, y);
    err = tu_rel_err(y, ref, n * c.hidden);
    if (err > 1e-5)
        fail_msg("block scales, tp %d: W8A8 rel err %.3g against one rank", world, err);
    free(x);
    free(ref);
    free(y);
}

/* fp8_math is part of the config the ranks must agree on. */
static void test_mismatched_fp8_math(void **state)
{
    moe_layer_config_t c = w8a8_config(MOE_SCALE_BLOCK_128);
    moe_layer_t *l = NULL;
    (void)state;
    if (world == 1)
        skip();
    if (rank == 0)
        c.fp8_math = MOE_FP8_MATH_W8A16;
    assert_int_equal(moe_layer_create(rt_world, &c, &l), MOE_STATUS_MISMATCH);
    assert_null(l);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_ep_equals_one_rank),
    cmocka_unit_test(test_block_tp_equals_one_rank),
    cmocka_unit_test(test_mismatched_fp8_math),
};

CPU_MPI_MAIN(tests)
