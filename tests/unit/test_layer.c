/* SPDX-License-Identifier: Apache-2.0 */
/* The whole layer on one rank (CPU backend) against the naive per-token formula, for each
 * routing family and weight dtype, plus edge cases: 0 and 1 token, every token to one expert,
 * ties, batch invariance, router logits given vs computed. */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/moe_cpu.h"
#include "base/numeric.h"
#include "launch/layer_gen.h"

static moe_layer_config_t small(void)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    c.num_experts = 8;
    c.top_k = 2;
    c.hidden = 64;
    c.intermediate = 96;
    c.max_tokens_per_rank = 64;
    return c;
}

/* Runs T random tokens through a layer of config c and compares with the naive formula
 * (using the layer's own routing decisions, checked separately). Returns the rel. error. */
static double run_vs_naive(moe_layer_config_t c, int64_t T, moe_dtype_t io_dtype, uint64_t seed)
{
    const int64_t H = c.hidden;
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    tu_weights_t w;
    float *x = malloc(sizeof(float) * (size_t)(T * H + 1));
    float *y = malloc(sizeof(float) * (size_t)(T * H + 1));
    float *ref = malloc(sizeof(float) * (size_t)(T * H + 1));
    float *tw = malloc(sizeof(float) * (size_t)(T * c.top_k + 1));
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(T * c.top_k + 1));
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(T * H + 1));
    uint16_t *yb = malloc(sizeof(uint16_t) * (size_t)(T * H + 1));
    int64_t i;
    double err;

    assert_true(x && y && ref && tw && ids && xb && yb);
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, seed));
    moe_gen_tokens(seed + 1, 0, T, (int)H, x);
    for (i = 0; i < T * H; i++)
        y[i] = NAN; /* poisoned: every element must be written */
    a.num_tokens = T;
    a.dtype = io_dtype;
    if (io_dtype == MOE_DTYPE_BF16) {
        moe_convert_from_f32(MOE_DTYPE_BF16, x, xb, (size_t)(T * H));
        moe_convert_to_f32(MOE_DTYPE_BF16, xb, x, (size_t)(T * H)); /* reference sees these */
        for (i = 0; i < T * H; i++)
            yb[i] = 0x7fc0; /* bf16 NaN */
        a.x = xb;
        a.y = yb;
    } else {
        a.x = x;
        a.y = y;
    }
    a.topk_ids = ids;
    a.topk_weights = tw;
    TU_OK(moe_layer_forward(l, &a));
    if (io_dtype == MOE_DTYPE_BF16)
        moe_convert_to_f32(MOE_DTYPE_BF16, yb, y, (size_t)(T * H));
    assert_int_equal(tu_count_nan(y, T * H), 0);
    tu_weights_make(&c, seed, &w);
    tu_naive_layer(&c, &w, x, T, ids, tw, ref);
    err = tu_rel_err(y, ref, T * H);
    tu_weights_free(&w);
    TU_OK(moe_layer_destroy(l));
    free(x);
    free(y);
    free(ref);
    free(tw);
    free(ids);
    free(xb);
    free(yb);
    return err;
}

static void test_mixtral_like(void **state)
{
    uint64_t seed = tu_seed("mixtral_like");
    double e;
    (void)state;
    e = run_vs_naive(small(), 37, MOE_DTYPE_F32, seed);
    print_message("mixtral-like bf16 weights, f32 io: rel err %.3g\n", e);
    assert_true(e < 1e-5);
}

static void test_f32_weights_and_bf16_io(void **state)
{
    uint64_t seed = tu_seed("f32_bf16io");
    moe_layer_config_t c = small();
    double e;
    (void)state;
    c.weight_dtype = MOE_DTYPE_F32;
    c.hidden = 60; /* f32 needs no alignment */
    assert_true(run_vs_naive(c, 21, MOE_DTYPE_F32, seed) < 1e-5);
    c.hidden = 64;
    e = run_vs_naive(c, 21, MOE_DTYPE_BF16, seed);
    assert_true(e < 1e-2); /* output rounded to bf16 */
}

static void test_qwen2_gated_shared_expert(void **state)
{
    uint64_t seed = tu_seed("qwen2");
    moe_layer_config_t c = small();
    (void)state;
    c.num_experts = 12;
    c.top_k = 4;
    c.renormalize = 0;
    c.num_shared_experts = 1;
    c.shared_intermediate = 160;
    c.shared_expert_gate = 1;
    assert_true(run_vs_naive(c, 29, MOE_DTYPE_F32, seed) < 1e-5);
}

static void test_deepseek_grouped_sigmoid(void **state)
{
    uint64_t seed = tu_seed("deepseek");
    moe_layer_config_t c = small();
    (void)state;
    c.num_experts = 16;
    c.top_k = 4;
    c.scoring = MOE_SCORING_SIGMOID;
    c.use_score_bias = 1;
    c.n_group = 4;
    c.topk_group = 2;
    c.routed_scaling_factor = 2.5f;
    c.num_shared_experts = 2; /* shared I = 2 * 96 */
    assert_true(run_vs_naive(c, 33, MOE_DTYPE_F32, seed) < 1e-5);
}

static void test_gelu_activation(void **state)
{
    uint64_t seed = tu_seed("gelu");
    moe_layer_config_t c = small();
    (void)state;
    c.activation = MOE_ACTIVATION_GELU;
    assert_true(run_vs_naive(c, 19, MOE_DTYPE_F32, seed) < 1e-5);
}

static void test_fp8_block_and_per_tensor(void **state)
{
    uint64_t seed = tu_seed("fp8");
    moe_layer_config_t c = small();
    (void)state;
    c.hidden = 256;
    c.intermediate = 384;
    c.weight_dtype = MOE_DTYPE_FP8_E4M3;
    c.scale_kind = MOE_SCALE_BLOCK_128;
    assert_true(run_vs_naive(c, 9, MOE_DTYPE_F32, seed) < 1e-5);
    c.scale_kind = MOE_SCALE_PER_TENSOR;
    assert_true(run_vs_naive(c, 9, MOE_DTYPE_F32, seed) < 1e-5);
    c.scale_kind = MOE_SCALE_PER_CHANNEL;
    assert_true(run_vs_naive(c, 9, MOE_DTYPE_F32, seed) < 1e-5);
}

/* max_tokens_across_ranks: 0 or in num_tokens..max_tokens_per_rank; else the value is named. */
static void test_max_tokens_across_ranks(void **state)
{
    moe_layer_config_t c = small();
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    float *x = calloc((size_t)(8 * c.hidden), sizeof(float));
    float *y = calloc((size_t)(8 * c.hidden), sizeof(float));
    (void)state;
    assert_true(x && y);
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, 5));
    a.num_tokens = 8;
    a.x = x;
    a.y = y;
    a.max_tokens_across_ranks = 8;
    TU_OK(moe_layer_forward(l, &a));
    a.max_tokens_across_ranks = 7;
    assert_int_equal(moe_layer_forward(l, &a), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "exceeds max_tokens_across_ranks = 7"));
    a.max_tokens_across_ranks = c.max_tokens_per_rank + 1;
    assert_int_equal(moe_layer_forward(l, &a), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "max_tokens_across_ranks = 65"));
    a.max_tokens_across_ranks = -1;
    assert_int_equal(moe_layer_forward(l, &a), MOE_STATUS_INVALID_ARGUMENT);
    a.max_tokens_across_ranks = 0; /* the capacity, as before */
    TU_OK(moe_layer_forward(l, &a));
    TU_OK(moe_layer_destroy(l));
    free(x);
    free(y);
}

/* moe_layer_explain: one line naming the backend; bad arguments named. */
static void test_explain(void **state)
{
    moe_layer_config_t c = small();
    moe_layer_t *l = NULL;
    char text[256];
    (void)state;
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    TU_OK(moe_layer_explain(l, 7, text, sizeof(text)));
    assert_non_null(strstr(text, "backend"));
    assert_int_equal(moe_layer_explain(l, c.max_tokens_per_rank + 1, text, sizeof(text)),
                     MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "num_tokens"));
    assert_int_equal(moe_layer_explain(l, 1, NULL, 8), MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_layer_explain(NULL, 1, text, sizeof(text)), MOE_STATUS_INVALID_ARGUMENT);
    TU_OK(moe_layer_explain(l, 1, text, 4)); /* truncated, still terminated */
    assert_true(strlen(text) <= 3);
    TU_OK(moe_layer_destroy(l));
}

static void test_zero_and_one_token(void **state)
{
    uint64_t seed = tu_seed("zero_one");
    moe_layer_config_t c = small();
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    (void)state;
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, seed));
    a.num_tokens = 0; /* x and y may be NULL */
    TU_OK(moe_layer_forward(l, &a));
    TU_OK(moe_layer_destroy(l));
    assert_true(run_vs_naive(c, 1, MOE_DTYPE_F32, seed) < 1e-5);
}

/* Given logits that send every token to experts 3 then 5, only those two see load. */
static void test_all_tokens_to_one_expert(void **state)
{
    uint64_t seed = tu_seed("hot_expert");
    moe_layer_config_t c = small();
    const int64_t T = 50, H = c.hidden;
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    float *x = malloc(sizeof(float) * T * H), *y = malloc(sizeof(float) * T * H);
    float *ref = malloc(sizeof(float) * T * H), *logits = calloc(T * 8, sizeof(float));
    float tw[2 * 50];
    int32_t ids[2 * 50];
    int64_t load[8];
    tu_weights_t w;
    int64_t t;
    (void)state;
    assert_true(x && y && ref && logits);
    for (t = 0; t < T; t++) {
        logits[t * 8 + 3] = 5.0f + 0.01f * (float)t;
        logits[t * 8 + 5] = 4.0f;
    }
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, seed));
    moe_gen_tokens(seed, 0, T, (int)H, x);
    a.num_tokens = T;
    a.x = x;
    a.y = y;
    a.router_logits = logits;
    a.topk_ids = ids;
    a.topk_weights = tw;
    TU_OK(moe_layer_forward(l, &a));
    TU_OK(moe_layer_get_expert_load(l, load, 8));
    assert_int_equal(load[3], T);
    assert_int_equal(load[5], T);
    assert_int_equal(load[0] + load[1] + load[2] + load[4] + load[6] + load[7], 0);
    for (t = 0; t < T; t++)
        assert_true(ids[2 * t] == 3 && ids[2 * t + 1] == 5);
    tu_weights_make(&c, seed, &w);
    tu_naive_layer(&c, &w, x, T, ids, tw, ref);
    assert_true(tu_rel_err(y, ref, T * H) < 1e-5);
    tu_weights_free(&w);
    TU_OK(moe_layer_destroy(l));
    free(x);
    free(y);
    free(ref);
    free(logits);
}

/* A token's output is bitwise the same alone, first or last in a batch of any size. */
static void test_batch_invariance(void **state)
{
    uint64_t seed = tu_seed("batch_invariance");
    moe_layer_config_t c = small();
    const int64_t H = c.hidden, T = 40;
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    float *x = malloc(sizeof(float) * T * H), *y = malloc(sizeof(float) * T * H);
    float one[64];
    int64_t t;
    (void)state;
    c.num_shared_experts = 1;
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, seed));
    moe_gen_tokens(seed, 0, T, (int)H, x);
    a.num_tokens = T;
    a.x = x;
    a.y = y;
    TU_OK(moe_layer_forward(l, &a));
    for (t = 0; t < T; t += 13) {
        a.num_tokens = 1;
        a.x = x + t * H;
        a.y = one;
        TU_OK(moe_layer_forward(l, &a));
        assert_memory_equal(one, y + t * H, sizeof(float) * (size_t)H);
    }
    TU_OK(moe_layer_destroy(l));
    free(x);
    free(y);
}

/* Exact ties in the logits: lower expert id first, every time. */
static void test_tie_break_is_deterministic(void **state)
{
    moe_layer_config_t c = small();
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    float x[3 * 64] = {0}, y[3 * 64], logits[3 * 8];
    int32_t ids[6];
    int i;
    (void)state;
    for (i = 0; i < 24; i++)
        logits[i] = (i % 8 == 6 || i % 8 == 2 || i % 8 == 4) ? 1.0f : 0.0f;
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, 5));
    a.num_tokens = 3;
    a.x = x;
    a.y = y;
    a.router_logits = logits;
    a.topk_ids = ids;
    TU_OK(moe_layer_forward(l, &a));
    for (i = 0; i < 3; i++)
        assert_true(ids[2 * i] == 2 && ids[2 * i + 1] == 4);
    TU_OK(moe_layer_destroy(l));
}

/* The CPU down projection's tree: an aligned TP slice's partials sum (by the same tree) to
 * exactly the full result. */
static void test_tree_slices_sum_bitwise(void **state)
{
    uint64_t s = tu_seed("tree");
    const int H = 16, I = 256, n = 3;
    float x[3 * 16], *wg = malloc(sizeof(float) * I * H), *wu = malloc(sizeof(float) * I * H);
    float *wd = malloc(sizeof(float) * H * I), full[3 * 16], part[4][3 * 16], sum[3 * 16];
    int tp, q;
    (void)state;
    tu_fill_uniform(x, n * H, -1, 1, &s);
    tu_fill_uniform(wg, I * H, -0.2f, 0.2f, &s);
    tu_fill_uniform(wu, I * H, -0.2f, 0.2f, &s);
    tu_fill_uniform(wd, I * H, -0.2f, 0.2f, &s);
    for (tp = 1; tp <= 4; tp *= 2) {
        const float *parts[4];
        for (q = 0; q < tp; q++) {
            const int is = I / tp, i0 = q * is;
            float *dslice = malloc(sizeof(float) * H * is);
            int r;
            moe_cpu_mlp_t w;
            for (r = 0; r < H; r++)
                memcpy(dslice + r * is, wd + r * I + i0, sizeof(float) * is);
            w.gate = (moe_cpu_matrix_t){MOE_DTYPE_F32, MOE_SCALE_NONE, is, H, wg + i0 * H, NULL};
            w.up = (moe_cpu_matrix_t){MOE_DTYPE_F32, MOE_SCALE_NONE, is, H, wu + i0 * H, NULL};
            w.down = (moe_cpu_matrix_t){MOE_DTYPE_F32, MOE_SCALE_NONE, H, is, dslice, NULL};
            w.slice_begin = i0;
            w.full_intermediate = I;
            TU_OK(moe_cpu_mlp(&w, MOE_ACTIVATION_SILU, x, n, tp == 1 ? full : part[q]));
            parts[q] = part[q];
            free(dslice);
        }
        if (tp > 1) {
            moe_cpu_tree_sum(parts, tp, n * H, sum);
            assert_memory_equal(sum, full, sizeof(full));
        }
    }
    free(wg);
    free(wu);
    free(wd);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mixtral_like),
        cmocka_unit_test(test_f32_weights_and_bf16_io),
        cmocka_unit_test(test_qwen2_gated_shared_expert),
        cmocka_unit_test(test_deepseek_grouped_sigmoid),
        cmocka_unit_test(test_gelu_activation),
        cmocka_unit_test(test_fp8_block_and_per_tensor),
        cmocka_unit_test(test_explain),
        cmocka_unit_test(test_max_tokens_across_ranks),
        cmocka_unit_test(test_zero_and_one_token),
        cmocka_unit_test(test_all_tokens_to_one_expert),
        cmocka_unit_test(test_batch_invariance),
        cmocka_unit_test(test_tie_break_is_deterministic),
        cmocka_unit_test(test_tree_slices_sum_bitwise),
    };
    return cmocka_run_group_tests(tests, tu_group_setup_cpu, tu_group_teardown);
}
