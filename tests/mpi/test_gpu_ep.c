/* SPDX-License-Identifier: Apache-2.0 */
/* Multi-GPU (one rank per GPU, NCCL): EP and TP layouts of the CUDA backend against the CPU
 * backend on the same global tokens, uneven tokens per rank (one rank with none), every token
 * to one rank's experts, and deterministic mode bitwise equal across EP sizes. */
#include "gpu_mpi.h"
#include "testutil.h"

#include <cuda_runtime.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/numeric.h"
#include "launch/layer_gen.h"

static int rank, world;
static int64_t told_m; /* max_tokens_across_ranks run() passes (0: not given) */

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

/* y (host) = layer(x (host)) on runtime rt; device buffers when it is a CUDA runtime. */
static void run(moe_runtime_t *rt, moe_layer_config_t c, uint64_t seed, const float *x, int64_t n,
                const float *logits, float *y)
{
    moe_runtime_info_t ri;
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    const size_t bytes = sizeof(float) * (size_t)(n * c.hidden + 1);
    void *dx = NULL, *dy = NULL, *dl = NULL;
    int64_t i;

    TU_OK(moe_runtime_get_info(rt, &ri));
    TU_OK(moe_layer_create(rt, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, seed));
    a.num_tokens = n;
    a.max_tokens_across_ranks = told_m;
    if (ri.backend == MOE_BACKEND_CUDA) {
        assert_int_equal(cudaMalloc(&dx, bytes), cudaSuccess);
        assert_int_equal(cudaMalloc(&dy, bytes), cudaSuccess);
        assert_int_equal(cudaMemcpy(dx, x, bytes - sizeof(float), cudaMemcpyHostToDevice), 0);
        assert_int_equal(cudaMemset(dy, 0xff, bytes), cudaSuccess); /* NaN poison */
        if (logits) {
            assert_int_equal(cudaMalloc(&dl, sizeof(float) * (size_t)(n * c.num_experts + 1)), 0);
            assert_int_equal(cudaMemcpy(dl, logits, sizeof(float) * (size_t)(n * c.num_experts),
                                        cudaMemcpyHostToDevice),
                             0);
        }
        a.x = dx;
        a.y = dy;
        a.router_logits = dl;
    } else {
        for (i = 0; i < n * c.hidden; i++)
            y[i] = NAN;
        a.x = x;
        a.y = y;
        a.router_logits = logits;
    }
    TU_OK(moe_layer_forward(l, &a));
    if (ri.backend == MOE_BACKEND_CUDA) {
        assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
        assert_int_equal(cudaMemcpy(y, dy, bytes - sizeof(float), cudaMemcpyDeviceToHost), 0);
        cudaFree(dx);
        cudaFree(dy);
        cudaFree(dl);
    }
    TU_OK(moe_layer_destroy(l));
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

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_ep_mixtral),
    cmocka_unit_test(test_ep_deepseek_shared),
    cmocka_unit_test(test_tp),
    cmocka_unit_test(test_hot_rank),
    cmocka_unit_test(test_deterministic_across_ep),
    cmocka_unit_test(test_deterministic_shared_across_ep),
    cmocka_unit_test(test_told_max_tokens),
};

GT_MPI_MAIN(tests, gt_group_setup, gt_group_teardown, rank, world)
