/* SPDX-License-Identifier: Apache-2.0 */
/* The CUDA backend on the shapes users run (issue 11): every listed model shape, one GPU and
 * EP = world and TP = world, at 1, 7, 64, 512 and 4096 tokens per rank, against the CPU
 * backend; one verdict on every rank when one rank's arguments fail; one workspace per runtime.
 * Expert counts are cut (each shape's hidden, intermediate, top_k and shared experts are the
 * model's; the intermediate values 768..96 and 1408..176 are the slices TP 1..8 gives) so that the
 * CPU reference and the weights stay affordable: the GEMM coverage depends on hidden and the
 * intermediate slice, not on the number of experts. Output row t depends on token t alone, so the
 * CPU reference computes the first rows only. */
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

#define REF_ROWS 12 /* rows checked against the CPU backend per step */
static const int64_t token_counts[] = {1, 7, 64, 512, 4096};
#define NUM_COUNTS ((int)(sizeof(token_counts) / sizeof(token_counts[0])))

/* The largest count run: the last, or the last within MOE_TEST_MAX_TOKENS (at least the first) */
static int64_t counts_max(void)
{
    int64_t m = token_counts[0];
    for (int i = 1; i < NUM_COUNTS; i++)
        if (token_counts[i] <= gt_max_tokens())
            m = token_counts[i];
    return m;
}

typedef struct model_shape {
    const char *name;
    int experts, top_k, hidden, intermediate; /* the full I: one GPU and EP hold all of it, TP
                                               * a 1/world slice */
    int shared;                               /* shared_intermediate (0: none) */
    int deepseek_routing;
    int f32_weights; /* float32 weights (converted to bf16 as the CUDA backend loads them) */
    int fp8; /* FP8 e4m3 weights: 1 per-tensor, 2 128x128 block, 3 per-channel scales (W8A16 on
              * the GPU for now) */
} model_shape_t;

static const model_shape_t shapes[] = {
    {"qwen3-30b-a3b i768", 16, 8, 2048, 768, 0, 0, 0, 0},
    {"qwen3-30b-a3b i384", 16, 8, 2048, 384, 0, 0, 0, 0},
    {"qwen3-30b-a3b i192", 16, 8, 2048, 192, 0, 0, 0, 0},
    {"qwen3-30b-a3b i96", 16, 8, 2048, 96, 0, 0, 0, 0},
    {"qwen2-moe i1408", 8, 4, 2048, 1408, 5632, 0, 0, 0},
    {"qwen2-moe i704", 8, 4, 2048, 704, 5632, 0, 0, 0},
    {"qwen2-moe i352", 8, 4, 2048, 352, 5632, 0, 0, 0},
    {"qwen2-moe i176", 8, 4, 2048, 176, 5632, 0, 0, 0},
    {"mixtral-8x22b", 2, 2, 6144, 16384, 0, 0, 0, 0},
    {"gpt-oss-like", 8, 4, 2880, 2880, 0, 0, 0, 0},
    {"deepseek-v2-lite", 8, 6, 2048, 1408, 2816, 0, 0, 0},
    {"qwen3-235b-a22b", 16, 8, 4096, 1536, 0, 0, 0, 0},
    {"llama-4-scout-like", 4, 1, 5120, 8192, 8192, 0, 0, 0},
    {"hf-tiny", 8, 2, 64, 96, 0, 1, 0, 0},
    {"hf-tiny f32", 8, 2, 64, 96, 0, 1, 1, 0},
    {"dsv3-like fp8 block", 8, 4, 2048, 512, 1024, 1, 0, 2},
    {"mixtral-like fp8 tensor", 8, 2, 1024, 1024, 0, 0, 0, 1},
    {"qwen-like fp8 channel", 16, 4, 1024, 384, 0, 0, 0, 3},
};
#define NUM_SHAPES ((int)(sizeof(shapes) / sizeof(shapes[0])))

/* ep x tp: the layout (1 x 1 on one GPU's own runtime, world x 1, 1 x world). */
static moe_layer_config_t config_of(const model_shape_t *s, int ep, int tp, int64_t max_tokens)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    c.num_experts = s->experts;
    c.top_k = s->top_k;
    c.hidden = s->hidden;
    c.intermediate = s->intermediate;
    c.max_tokens_per_rank = max_tokens;
    c.ep_size = ep;
    c.tp_size = tp;
    if (s->shared) {
        c.num_shared_experts = 1;
        c.shared_intermediate = s->shared;
    }
    if (s->f32_weights)
        c.weight_dtype = MOE_DTYPE_F32;
    if (s->fp8) {
        c.weight_dtype = MOE_DTYPE_FP8_E4M3;
        c.scale_kind = s->fp8 == 2   ? MOE_SCALE_BLOCK_128
                       : s->fp8 == 3 ? MOE_SCALE_PER_CHANNEL
                                     : MOE_SCALE_PER_TENSOR;
    }
    if (s->deepseek_routing) {
        c.scoring = MOE_SCORING_SIGMOID;
        c.use_score_bias = 1;
        c.n_group = 4;
        c.topk_group = 2;
        c.routed_scaling_factor = 2.5f;
    }
    return c;
}

/* Device buffers of one layer's steps: x [T][H], y [T][H] (f32). */
typedef struct bufs {
    void *dx, *dy;
    size_t bytes;
} bufs_t;

static void bufs_init(bufs_t *b, const float *x, int64_t T, int H)
{
    b->bytes = sizeof(float) * (size_t)(T * H);
    assert_int_equal(cudaMalloc(&b->dx, b->bytes), cudaSuccess);
    assert_int_equal(cudaMalloc(&b->dy, b->bytes), cudaSuccess);
    assert_int_equal(cudaMemcpy(b->dx, x, b->bytes, cudaMemcpyHostToDevice), cudaSuccess);
}

static void bufs_free(bufs_t *b)
{
    cudaFree(b->dx);
    cudaFree(b->dy);
}

/* One step of `n` tokens on a CUDA layer; the first `rows` rows of y come back to `out`. */
static moe_status_t gpu_step(moe_layer_t *l, bufs_t *b, int64_t n, int H, float *out, int rows)
{
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    moe_status_t st;
    assert_int_equal(cudaMemset(b->dy, 0xff, b->bytes), cudaSuccess); /* NaN poison */
    a.num_tokens = n;
    a.x = b->dx;
    a.y = b->dy;
    st = moe_layer_forward(l, &a);
    if (st == MOE_STATUS_SUCCESS)
        st = moe_layer_synchronize(l, NULL);
    if (st == MOE_STATUS_SUCCESS && rows > 0)
        assert_int_equal(
            cudaMemcpy(out, b->dy, sizeof(float) * (size_t)rows * H, cudaMemcpyDeviceToHost),
            cudaSuccess);
    return st;
}

static void cpu_reference(const model_shape_t *s, uint64_t seed, const float *x, float *ref)
{
    moe_layer_config_t c = config_of(s, 1, 1, REF_ROWS);
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    moe_layer_t *l = NULL;
    TU_OK(moe_layer_create(gt_rts.cpu_self, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, seed));
    a.num_tokens = REF_ROWS;
    a.x = x;
    a.y = ref;
    TU_OK(moe_layer_forward(l, &a));
    TU_OK(moe_layer_destroy(l));
}

/* One shape in one layout at every token count; returns the worst relative error. */
static double run_layout(const model_shape_t *s, moe_runtime_t *rt, int ep, int tp, uint64_t seed,
                         const float *x, const float *ref)
{
    const int64_t tmax = counts_max();
    moe_layer_config_t c = config_of(s, ep, tp, tmax);
    float *out = malloc(sizeof(float) * REF_ROWS * (size_t)s->hidden);
    moe_layer_t *l = NULL;
    double worst = 0.0;
    bufs_t b;
    assert_non_null(out);
    TU_OK(moe_layer_create(rt, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, seed));
    bufs_init(&b, x, tmax, s->hidden);
    for (int i = 0; i < NUM_COUNTS && token_counts[i] <= tmax; i++) {
        const int64_t n = token_counts[i];
        const int rows = n < REF_ROWS ? (int)n : REF_ROWS;
        double err;
        TU_OK(gpu_step(l, &b, n, s->hidden, out, rows));
        assert_int_equal(tu_count_nan(out, (int64_t)rows * s->hidden), 0);
        err = tu_rel_err(out, ref, (int64_t)rows * s->hidden);
        if (err > worst)
            worst = err;
        if (err > 1e-2)
            print_error("rank %d: %s ep %d tp %d, %lld tokens: rel err %.3g\n", rank, s->name, ep,
                        tp, (long long)n, err);
        assert_true(err <= 1e-2);
    }
    bufs_free(&b);
    TU_OK(moe_layer_destroy(l));
    free(out);
    return worst;
}

/* Every shape: one GPU (each rank on its own), EP = world, TP = world; the EP error is no
 * worse than the one-GPU error (the return sums in f32). */
static void test_model_shapes(void **state)
{
    const uint64_t seed = tu_seed("gpu_shapes");
    (void)state;
    for (int si = 0; si < NUM_SHAPES; si++) {
        const model_shape_t *s = &shapes[si];
        const int64_t tmax = counts_max();
        float *x = malloc(sizeof(float) * (size_t)(tmax * s->hidden));
        float *ref = malloc(sizeof(float) * REF_ROWS * (size_t)s->hidden);
        double e1, eep, etp;
        assert_true(x && ref);
        /* each rank its own tokens; the reference is its first REF_ROWS */
        moe_gen_tokens(seed, (int64_t)rank * tmax, tmax, s->hidden, x);
        cpu_reference(s, seed, x, ref);
        e1 = run_layout(s, gt_rts.gpu_self, 1, 1, seed, x, ref);
        eep = s->experts % world == 0 ? run_layout(s, gt_rts.gpu, world, 1, seed, x, ref) : 0.0;
        /* TP needs the allgather transport (NCCL): not with MOE_TEST_SHARED_GPU=lsa */
        etp = !gt_nccl_runs() ? 0.0 : run_layout(s, gt_rts.gpu, 1, world, seed, x, ref);
        if (rank == 0)
            print_message("%-22s H%-5d I%-5d E%-3d k%d%s: rel err one GPU %.2e, EP%d %.2e, TP%d "
                          "%.2e%s\n",
                          s->name, s->hidden, s->intermediate, s->experts, s->top_k,
                          s->shared ? " +shared" : "", e1, world, eep, world, etp,
                          !gt_nccl_runs() ? " (TP not run: no NCCL)" : "");
        /* EP sums the same bf16 rows in f32: its error tracks the one-GPU error */
        assert_true(eep <= 1.25 * e1 + 1e-4);
        free(x);
        free(ref);
    }
}

/* One rank's bad arguments: every rank gets the same status from synchronize (the bad rank
 * from forward too), promptly, and the next step works. */
static void test_one_verdict(void **state)
{
    const uint64_t seed = tu_seed("gpu_verdict");
    const model_shape_t *s = &shapes[0];
    moe_layer_config_t c = config_of(s, world, 1, 64);
    float *x = malloc(sizeof(float) * 64 * (size_t)s->hidden);
    float *ref = malloc(sizeof(float) * REF_ROWS * (size_t)s->hidden);
    float *out = malloc(sizeof(float) * REF_ROWS * (size_t)s->hidden);
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    moe_layer_t *l = NULL;
    moe_status_t st, sy;
    bufs_t b;
    (void)state;
    assert_true(x && ref && out);
    moe_gen_tokens(seed, (int64_t)rank * 64, 64, s->hidden, x);
    cpu_reference(s, seed, x, ref);
    TU_OK(moe_layer_create(gt_rts.gpu, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, seed));
    bufs_init(&b, x, 64, s->hidden);
    for (int kind = 0; kind < 3; kind++) {
        const int bad = world - 1 - kind % world; /* the failing rank */
        double t0 = MPI_Wtime(), dt;
        a.num_tokens = 32;
        a.x = b.dx;
        a.y = b.dy;
        if (rank == bad && kind == 0)
            a.num_tokens = 65; /* over max_tokens_per_rank */
        if (rank == bad && kind == 1)
            a.x = NULL;
        st = moe_layer_forward(l, rank == bad && kind == 2 ? NULL : &a);
        sy = moe_layer_synchronize(l, NULL);
        dt = MPI_Wtime() - t0;
        print_message("rank %d: bad rank %d, case %d: forward %s, synchronize %s (%s) in %.3f s\n",
                      rank, bad, kind, moe_status_string(st), moe_status_string(sy),
                      moe_last_error(), dt);
        assert_int_equal(st, rank == bad ? MOE_STATUS_INVALID_ARGUMENT : MOE_STATUS_SUCCESS);
        assert_int_equal(sy, MOE_STATUS_INVALID_ARGUMENT);
        assert_non_null(strstr(moe_last_error(), "rank"));
        assert_true(dt < 10.0); /* generous: the point is "not the 120 s timeout" */
        /* the next step works and is right */
        TU_OK(gpu_step(l, &b, 32, s->hidden, out, REF_ROWS));
        assert_true(tu_rel_err(out, ref, (int64_t)REF_ROWS * s->hidden) <= 1e-2);
    }
    bufs_free(&b);
    TU_OK(moe_layer_destroy(l));
    free(x);
    free(ref);
    free(out);
}

/* check_inputs on the GPU: NaN in one rank's x fails the step on every rank at synchronize. */
static void test_check_inputs(void **state)
{
    const uint64_t seed = tu_seed("gpu_check_inputs");
    const model_shape_t *s = &shapes[NUM_SHAPES - 5]; /* hf-tiny */
    moe_layer_config_t c = config_of(s, world, 1, 16);
    float *x = malloc(sizeof(float) * 16 * (size_t)s->hidden);
    moe_layer_t *l = NULL;
    bufs_t b;
    (void)state;
    assert_non_null(x);
    c.check_inputs = 1;
    moe_gen_tokens(seed, 0, 16, s->hidden, x);
    if (rank == 0)
        x[5 * s->hidden + 3] = NAN;
    TU_OK(moe_layer_create(gt_rts.gpu, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, seed));
    bufs_init(&b, x, 16, s->hidden);
    assert_int_equal(gpu_step(l, &b, 16, s->hidden, NULL, 0), MOE_STATUS_NUMERIC_ERROR);
    assert_non_null(strstr(moe_last_error(), "rank 0"));
    /* the next step is clean once x is */
    x[5 * s->hidden + 3] = 0.0f;
    assert_int_equal(cudaMemcpy(b.dx, x, b.bytes, cudaMemcpyHostToDevice), cudaSuccess);
    TU_OK(gpu_step(l, &b, 16, s->hidden, NULL, 0));
    bufs_free(&b);
    TU_OK(moe_layer_destroy(l));
    free(x);
}

/* Layers of one runtime share one workspace: the runtime's figure is the largest layer's
 * need (not the sum), and a layer created before a larger one still runs right after the
 * workspace moved. */
static void test_one_workspace(void **state)
{
    const uint64_t seed = tu_seed("gpu_workspace");
    const model_shape_t *s = &shapes[3];
    moe_layer_config_t small = config_of(s, 1, 1, 16), big = config_of(s, 1, 1, 2048);
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    moe_runtime_t *rt = NULL;
    moe_layer_t *a = NULL, *b2 = NULL;
    moe_layer_info_t ia, ib;
    moe_runtime_info_t ri;
    MPI_Comm self = MPI_COMM_SELF;
    float *x = malloc(sizeof(float) * 16 * (size_t)s->hidden);
    float *ref = malloc(sizeof(float) * REF_ROWS * (size_t)s->hidden);
    float *out = malloc(sizeof(float) * REF_ROWS * (size_t)s->hidden);
    bufs_t b;
    (void)state;
    assert_true(x && ref && out);
    rc.backend = MOE_BACKEND_CUDA;
    rc.device = gt_shared_gpu() ? rank % moe_gpu_count_for_tests() : rank;
    TU_OK(moe_runtime_create(&rc, &self, &rt));
    moe_gen_tokens(seed, 0, 16, s->hidden, x);
    cpu_reference(s, seed, x, ref);
    TU_OK(moe_layer_create(rt, &small, &a));
    TU_OK(moe_gen_set_weights(a, &small, seed));
    {
        char why[512];
        TU_OK(moe_layer_explain(a, 16, why, sizeof(why)));
        print_message("rank %d: explain: %s\n", rank, why);
        assert_non_null(strstr(why, "cuda backend"));
        assert_non_null(strstr(why, "routed GEMMs"));
    }
    bufs_init(&b, x, 16, s->hidden);
    TU_OK(gpu_step(a, &b, 16, s->hidden, out, REF_ROWS));
    assert_true(tu_rel_err(out, ref, (int64_t)REF_ROWS * s->hidden) <= 1e-2);
    TU_OK(moe_layer_create(rt, &big, &b2));
    TU_OK(moe_layer_get_info(a, &ia));
    TU_OK(moe_layer_get_info(b2, &ib));
    TU_OK(moe_runtime_get_info(rt, &ri));
    assert_true(ib.workspace_bytes > ia.workspace_bytes);
    assert_int_equal(ri.workspace_bytes, ib.workspace_bytes);
    TU_OK(gpu_step(a, &b, 16, s->hidden, out, REF_ROWS)); /* after the workspace moved */
    assert_true(tu_rel_err(out, ref, (int64_t)REF_ROWS * s->hidden) <= 1e-2);
    bufs_free(&b);
    TU_OK(moe_layer_destroy(b2));
    TU_OK(moe_layer_destroy(a));
    TU_OK(moe_runtime_destroy(rt));
    free(x);
    free(ref);
    free(out);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_one_verdict),
    cmocka_unit_test(test_check_inputs),
    cmocka_unit_test(test_one_workspace),
    cmocka_unit_test(test_model_shapes),
};

GT_MPI_MAIN(tests, gt_group_setup, gt_group_teardown, rank, world)
