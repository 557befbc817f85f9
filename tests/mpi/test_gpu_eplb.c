/* SPDX-License-Identifier: Apache-2.0 */
/* Multi-GPU (one rank per GPU, or ranks sharing one with MOE_TEST_SHARED_GPU=1): expert
 * placement on the CUDA backend. Redundant slots and placement changes run on the CPU backend
 * only for now: the CUDA backend refuses them with MOE_STATUS_NOT_SUPPORTED on every rank, naming
 * why, and stays usable; its EP layer (the placement tables' default, slot e = expert e) matches
 * the CPU backend at skewed routing, the routing EPLB is for. */
#include "gpu_mpi.h"
#include "testutil.h"

#include <cuda_runtime.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "launch/layer_gen.h"

static int rank, world;

static moe_layer_config_t shape(void)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    c.num_experts = 16;
    c.top_k = 4;
    c.hidden = 1024;
    c.intermediate = 512;
    c.max_tokens_per_rank = 128;
    return c;
}

static void expect(moe_status_t got, moe_status_t want, const char *text)
{
    if (got != want)
        fail_msg("rank %d: got %s, want %s (%s)", rank, moe_status_string(got),
                 moe_status_string(want), moe_last_error());
    if (text && !strstr(moe_last_error(), text))
        fail_msg("rank %d: error \"%s\" does not name \"%s\"", rank, moe_last_error(), text);
}

static void test_redundant_slots_refused(void **state)
{
    moe_layer_config_t c = shape();
    moe_layer_t *l = (moe_layer_t *)0x1;
    (void)state;
    c.num_redundant_experts = world;
    expect(moe_layer_create(gt_rts.gpu, &c, &l), MOE_STATUS_NOT_SUPPORTED, "num_redundant_experts");
    assert_null(l);
}

static void test_placement_refused(void **state)
{
    moe_layer_config_t c = shape();
    moe_layer_t *l = NULL;
    int32_t map[16];
    int64_t win[16];
    int i;
    (void)state;
    TU_OK(moe_layer_create(gt_rts.gpu, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, 3));
    TU_OK(moe_layer_get_placement(l, map, 16));
    for (i = 0; i < 16; i++)
        assert_int_equal(map[i], i); /* the default: slot e holds expert e */
    expect(moe_layer_set_placement(l, map, 16), MOE_STATUS_NOT_SUPPORTED,
           "does not change expert placement");
    expect(moe_layer_rebalance(l), MOE_STATUS_NOT_SUPPORTED, "does not change expert placement");
    TU_OK(moe_layer_get_expert_load_window(l, win, 16));
    TU_OK(moe_layer_destroy(l));
}

/* Skewed routing (expert e ~ (e + 1)^-1.2, the hot experts on rank 0) after the refusals: the
 * CUDA layer against the CPU one on this rank's tokens. */
static void test_skewed_routing_matches_cpu(void **state)
{
    const uint64_t seed = tu_seed("gpu_eplb");
    moe_layer_config_t c = shape();
    const int64_t n = 96;
    float *x = malloc(sizeof(float) * (size_t)(n * c.hidden));
    float *y = malloc(sizeof(float) * (size_t)(n * c.hidden));
    float *ref = malloc(sizeof(float) * (size_t)(n * c.hidden));
    float *lg = malloc(sizeof(float) * (size_t)(n * c.num_experts));
    double err;
    (void)state;
    assert_true(x && y && ref && lg);
    moe_gen_tokens(seed, n * rank, n, c.hidden, x);
    moe_gen_skewed_logits(seed, n * rank, n, c.num_experts, 1.2, lg);
    gt_run_layer(gt_rts.cpu_self, c, seed, x, n, lg, ref, 0);
    c.ep_size = world;
    gt_run_layer(gt_rts.gpu, c, seed, x, n, lg, y, 0);
    assert_int_equal(tu_count_nan(y, n * c.hidden), 0);
    err = tu_rel_err(y, ref, n * c.hidden);
    print_message("rank %d: skewed routing, ep %d: rel err %.3g\n", rank, world, err);
    assert_true(err <= 1e-2);
    free(x);
    free(y);
    free(ref);
    free(lg);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_redundant_slots_refused),
    cmocka_unit_test(test_placement_refused),
    cmocka_unit_test(test_skewed_routing_matches_cpu),
};

GT_MPI_MAIN(tests, gt_group_setup, gt_group_teardown, rank, world)
