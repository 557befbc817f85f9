/* SPDX-License-Identifier: Apache-2.0 */
/* Routing given by the caller (moe_forward_args_t.given_topk_ids/weights) on the CUDA backend,
 * one rank per GPU: one GPU and EP over the ranks against the CPU backend with the same ids and
 * weights (no ROUTER set, outputs poisoned first), f32 and bf16 tokens, repeated ids, a forward
 * captured in a CUDA graph and replayed with new routing, and a bad id or weight on one rank
 * failing the step at synchronize on every rank (then a good step runs). */
#include "gpu_mpi.h"
#include "testutil.h"

#include <cuda_runtime.h>
#include <math.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>

#include "base/numeric.h"
#include "launch/layer_gen.h"

static int rank, world;

static moe_layer_config_t shape(int shared)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    c.num_experts = 16;
    c.top_k = 4;
    c.hidden = 512;
    c.intermediate = 256;
    c.max_tokens_per_rank = 320; /* tu_uneven_share gives rank 0 all 300 tokens */
    if (shared) { /* DeepSeek-style: none of its routing options apply to given routing */
        c.scoring = MOE_SCORING_SIGMOID;
        c.use_score_bias = 1;
        c.n_group = 4;
        c.topk_group = 2;
        c.routed_scaling_factor = 2.5f;
        c.num_shared_experts = 1;
    }
    return c;
}

/* Routing of global tokens [t0, t0 + n): distinct ids but token 0's first two slots (repeated),
 * weights in [-1, 2). */
static void routing(const moe_layer_config_t *c, int64_t t0, int64_t n, int32_t *ids, float *w)
{
    for (int64_t t = 0; t < n; t++)
        for (int j = 0; j < c->top_k; j++) {
            const uint64_t g = (uint64_t)(t0 + t), h = g * 2654435761u + (uint64_t)j * 40503u;
            ids[t * c->top_k + j] =
                (int32_t)((g * 5u + (uint64_t)j * 3u) % (uint64_t)c->num_experts);
            w[t * c->top_k + j] = -1.0f + 3.0f * (float)(h % 1000u) / 1000.0f;
        }
    if (n > 0 && t0 == 0)
        ids[1] = ids[0];
}

/* y = layer(x) with the given routing on runtime rt; returns forward's status and puts
 * synchronize's (CUDA) into *sync. x and y host f32; io: the dtype x and y cross in. */
static moe_status_t run_given(moe_runtime_t *rt, moe_layer_config_t c, const float *x, int64_t n,
                              const int32_t *ids, const float *w, moe_dtype_t io, float *y,
                              moe_status_t *sync)
{
    moe_runtime_info_t ri;
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    const size_t nx = (size_t)(n * c.hidden), nk = (size_t)(n * c.top_k);
    const size_t xb = nx * moe_dtype_size(io);
    void *hx = malloc(xb + 4), *hy = malloc(xb + 4), *dx = NULL, *dy = NULL, *di = NULL, *dw = NULL;
    moe_status_t st;

    assert_true(hx && hy);
    TU_OK(moe_runtime_get_info(rt, &ri));
    TU_OK(moe_layer_create(rt, &c, &l));
    TU_OK(moe_gen_set_weights_unrouted(l, &c, 7));
    moe_convert_from_f32(io, x, hx, nx);
    a.num_tokens = n;
    a.dtype = io;
    *sync = MOE_STATUS_SUCCESS;
    if (ri.backend == MOE_BACKEND_CUDA) {
        assert_int_equal(cudaMalloc(&dx, xb + 4), cudaSuccess);
        assert_int_equal(cudaMalloc(&dy, xb + 4), cudaSuccess);
        assert_int_equal(cudaMalloc(&di, 4 * nk + 4), cudaSuccess);
        assert_int_equal(cudaMalloc(&dw, 4 * nk + 4), cudaSuccess);
        assert_int_equal(cudaMemcpy(dx, hx, xb, cudaMemcpyHostToDevice), cudaSuccess);
        assert_int_equal(cudaMemcpy(di, ids, 4 * nk, cudaMemcpyHostToDevice), cudaSuccess);
        assert_int_equal(cudaMemcpy(dw, w, 4 * nk, cudaMemcpyHostToDevice), cudaSuccess);
        assert_int_equal(cudaMemset(dy, 0xff, xb + 4), cudaSuccess); /* NaN poison */
        a.x = dx;
        a.y = dy;
        a.given_topk_ids = di;
        a.given_topk_weights = dw;
        st = moe_layer_forward(l, &a);
        *sync = moe_layer_synchronize(l, NULL);
        assert_int_equal(cudaMemcpy(hy, dy, xb, cudaMemcpyDeviceToHost), cudaSuccess);
        cudaFree(dx);
        cudaFree(dy);
        cudaFree(di);
        cudaFree(dw);
    } else {
        memset(hy, 0xff, xb);
        a.x = hx;
        a.y = hy;
        a.given_topk_ids = ids;
        a.given_topk_weights = w;
        st = moe_layer_forward(l, &a);
    }
    moe_convert_to_f32(io, hy, y, nx);
    TU_OK(moe_layer_destroy(l));
    free(hx);
    free(hy);
    return st;
}

/* rt (CUDA) against the CPU backend on this rank's uneven share of 300 global tokens. */
static void compare(moe_runtime_t *rt, int shared, moe_dtype_t io)
{
    const moe_layer_config_t c = shape(shared);
    int64_t t0, n;
    moe_status_t sync;
    tu_uneven_share(300, rank, world, &t0, &n);
    if (rt == gt_rts.gpu_self)
        t0 = 0, n = 201;
    float *x = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
    float *y = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
    float *ref = malloc(sizeof(float) * (size_t)(n * c.hidden + 1));
    float *w = malloc(sizeof(float) * (size_t)(n * c.top_k + 1));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(n * c.top_k + 1));
    assert_true(x && y && ref && w && ids);
    moe_gen_tokens(3, t0, n, c.hidden, x);
    routing(&c, t0, n, ids, w);
    TU_OK(run_given(gt_rts.cpu_self, c, x, n, ids, w, io, ref, &sync));
    TU_OK(run_given(rt, c, x, n, ids, w, io, y, &sync));
    TU_OK(sync);
    assert_int_equal(tu_count_nan(y, n * c.hidden), 0);
    if (n > 0 && tu_rel_err(y, ref, n * c.hidden) > 1e-2)
        fail_msg("rank %d: rel err %.3g against the CPU backend", rank,
                 tu_rel_err(y, ref, n * c.hidden));
    free(x);
    free(y);
    free(ref);
    free(w);
    free(ids);
}

static void test_one_gpu(void **state)
{
    (void)state;
    compare(gt_rts.gpu_self, 0, MOE_DTYPE_F32);
    compare(gt_rts.gpu_self, 1, MOE_DTYPE_BF16);
}

static void test_ep(void **state)
{
    (void)state;
    compare(gt_rts.gpu, 0, MOE_DTYPE_BF16);
    compare(gt_rts.gpu, 1, MOE_DTYPE_F32);
}

/* A bad id (then a bad weight) on the last rank: every rank's synchronize fails with its
 * status; a good step after it succeeds. */
static void bad_on_last_rank(moe_runtime_t *rt, int last)
{
    const moe_layer_config_t c = shape(0);
    float x[8 * 512], y[8 * 512], w[8 * 4];
    int32_t ids[8 * 4];
    moe_status_t st, sync;
    moe_gen_tokens(5, 0, 8, c.hidden, x);
    for (int bad = 0; bad < 3; bad++) {
        routing(&c, 8 * rank, 8, ids, w);
        if (last && bad == 0)
            ids[13] = c.num_experts;
        if (last && bad == 1)
            w[6] = INFINITY;
        st = run_given(rt, c, x, 8, ids, w, MOE_DTYPE_F32, y, &sync);
        TU_OK(st); /* the check runs on the device */
        if (bad == 2)
            TU_OK(sync);
        else
            assert_int_equal(sync,
                             bad == 0 ? MOE_STATUS_INVALID_ARGUMENT : MOE_STATUS_NUMERIC_ERROR);
    }
}

static void test_bad_routing(void **state)
{
    (void)state;
    bad_on_last_rank(gt_rts.gpu_self, 1);
    bad_on_last_rank(gt_rts.gpu, rank == world - 1);
}

/* One forward captured in a CUDA graph, replayed after the routing buffers were rewritten. */
static void test_graph(void **state)
{
    const moe_layer_config_t c = shape(1);
    const int64_t n = 5;
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    float x[5 * 512], y[5 * 512], ref[5 * 512], w[5 * 4];
    int32_t ids[5 * 4];
    void *dx, *dy, *di, *dw, *stream, *graph, *exec;
    moe_status_t sync;
    (void)state;
    moe_gen_tokens(9, 0, n, c.hidden, x);
    TU_OK(moe_layer_create(gt_rts.gpu_self, &c, &l));
    TU_OK(moe_gen_set_weights_unrouted(l, &c, 7));
    assert_int_equal(cudaMalloc(&dx, sizeof(x)), cudaSuccess);
    assert_int_equal(cudaMalloc(&dy, sizeof(y)), cudaSuccess);
    assert_int_equal(cudaMalloc(&di, sizeof(ids)), cudaSuccess);
    assert_int_equal(cudaMalloc(&dw, sizeof(w)), cudaSuccess);
    assert_int_equal(cudaMemcpy(dx, x, sizeof(x), cudaMemcpyHostToDevice), cudaSuccess);
    routing(&c, 0, n, ids, w);
    assert_int_equal(cudaMemcpy(di, ids, sizeof(ids), cudaMemcpyHostToDevice), cudaSuccess);
    assert_int_equal(cudaMemcpy(dw, w, sizeof(w), cudaMemcpyHostToDevice), cudaSuccess);
    /* the copies and the poison below run on the legacy stream, the layer on a non-blocking one:
     * only a device synchronisation orders them (unordered, this test failed once on one of two
     * ranks sharing the H200 with the same inputs as the other, rel err 1.11: 2026-12-04) */
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    TU_OK(moe_gpu_stream_create(&stream));
    a.num_tokens = n;
    a.x = dx;
    a.y = dy;
    a.given_topk_ids = di;
    a.given_topk_weights = dw;
    a.stream = stream;
    TU_OK(moe_layer_forward(l, &a)); /* warm-up */
    TU_OK(moe_layer_synchronize(l, stream));
    TU_OK(moe_gpu_graph_capture_begin(stream));
    TU_OK(moe_layer_forward(l, &a));
    TU_OK(moe_gpu_graph_capture_end(stream, &graph));
    TU_OK(moe_gpu_graph_instantiate(graph, &exec));
    routing(&c, 40, n, ids, w); /* new routing into the captured buffers */
    assert_int_equal(cudaMemcpy(di, ids, sizeof(ids), cudaMemcpyHostToDevice), cudaSuccess);
    assert_int_equal(cudaMemcpy(dw, w, sizeof(w), cudaMemcpyHostToDevice), cudaSuccess);
    assert_int_equal(cudaMemset(dy, 0xff, sizeof(y)), cudaSuccess);
    assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
    TU_OK(moe_gpu_graph_launch(exec, stream));
    TU_OK(moe_layer_synchronize(l, stream));
    assert_int_equal(cudaMemcpy(y, dy, sizeof(y), cudaMemcpyDeviceToHost), cudaSuccess);
    TU_OK(run_given(gt_rts.cpu_self, c, x, n, ids, w, MOE_DTYPE_F32, ref, &sync));
    assert_int_equal(tu_count_nan(y, n * c.hidden), 0);
    if (tu_rel_err(y, ref, n * c.hidden) > 1e-2)
        fail_msg("rank %d: graph replay rel err %.3g against the CPU backend", rank,
                 tu_rel_err(y, ref, n * c.hidden));
    TU_OK(moe_gpu_graph_exec_destroy(exec));
    TU_OK(moe_gpu_graph_destroy(graph));
    TU_OK(moe_gpu_stream_destroy(stream));
    cudaFree(dx);
    cudaFree(dy);
    cudaFree(di);
    cudaFree(dw);
    TU_OK(moe_layer_destroy(l));
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_one_gpu),
    cmocka_unit_test(test_ep),
    cmocka_unit_test(test_bad_routing),
    cmocka_unit_test(test_graph),
};

GT_MPI_MAIN(tests, gt_group_setup, gt_group_teardown, rank, world)
