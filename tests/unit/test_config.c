/* SPDX-License-Identifier: Apache-2.0 */
/* Bad input gets the right status and a message naming the value: layer configs, weights,
 * forward arguments, runtime arguments. */
#include "testutil.h"

#include <math.h>
#include <string.h>

#include "launch/layer_gen.h"

static moe_layer_config_t good(void)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    c.num_experts = 8;
    c.top_k = 2;
    c.hidden = 64;
    c.intermediate = 128;
    c.max_tokens_per_rank = 16;
    return c;
}

/* Creates with `c`, expects `want` and a message containing `needle`. */
static void expect(moe_layer_config_t c, moe_status_t want, const char *needle)
{
    moe_layer_t *l = (moe_layer_t *)0x1;
    moe_status_t st = moe_layer_create(tu_rt, &c, &l);
    if (st != want)
        fail_msg("want %s, got %s (%s)", moe_status_string(want), moe_status_string(st),
                 moe_last_error());
    if (strstr(moe_last_error(), needle) == NULL)
        fail_msg("message '%s' does not name '%s'", moe_last_error(), needle);
    assert_null(l);
}

#define BAD(field_expr, needle)                                                                    \
    do {                                                                                           \
        moe_layer_config_t c = good();                                                             \
        field_expr;                                                                                \
        expect(c, MOE_STATUS_INVALID_ARGUMENT, needle);                                            \
    } while (0)

static void test_bad_layer_configs(void **state)
{
    (void)state;
    BAD(c.num_experts = 0, "num_experts = 0");
    BAD(c.num_experts = -3, "num_experts = -3");
    BAD(c.top_k = 0, "top_k = 0");
    BAD(c.top_k = 9, "top_k = 9");
    BAD(c.hidden = -1, "hidden = -1");
    BAD(c.intermediate = 0, "intermediate = 0");
    BAD(c.hidden = 60, "hidden = 60"); /* bf16 rows need multiples of 8 */
    BAD(c.intermediate = 100, "intermediate = 100");
    BAD(c.num_shared_experts = -1, "num_shared_experts = -1");
    BAD(c.shared_expert_gate = 1, "shared_expert_gate");
    BAD(c.activation = (moe_activation_t)7, "activation = 7");
    BAD(c.scoring = (moe_scoring_t)5, "scoring = 5");
    BAD(c.n_group = 3; c.topk_group = 1, "n_group = 3");
    BAD(c.n_group = 4; c.topk_group = 5, "topk_group = 5");
    BAD(c.n_group = 4; c.topk_group = 1; c.top_k = 3, "top_k = 3");
    BAD(c.use_score_bias = 1, "use_score_bias");
    BAD(c.routed_scaling_factor = NAN, "routed_scaling_factor");
    BAD(c.routed_scaling_factor = -1.0f, "routed_scaling_factor");
    BAD(c.weight_dtype = (moe_dtype_t)42, "weight_dtype = 42");
    BAD(c.weight_dtype = MOE_DTYPE_F16, "weight_dtype = 3");
    BAD(c.weight_dtype = MOE_DTYPE_FP8_E4M3, "scale_kind = 0");
    BAD(c.scale_kind = MOE_SCALE_BLOCK_128, "only FP8_E4M3");
    BAD(c.max_tokens_per_rank = 0, "max_tokens_per_rank = 0");
    BAD(c.ep_round_tokens = -1, "ep_round_tokens = -1");
    BAD(c.ep_round_tokens = 17, "ep_round_tokens = 17");
    BAD(c.ep_size = 2, "ep_size = 2");
    BAD(c.tp_size = 3, "tp_size = 3");
    BAD(c.ep_size = -1, "ep_size = -1");
    BAD(c.dispatch = (moe_dispatch_t)9, "dispatch = 9");
    BAD(c.deterministic = 5, "deterministic = 5");
    BAD(c.check_inputs = 2, "check_inputs = 2");
    {
        moe_layer_t *l = NULL;
        assert_int_equal(moe_layer_create(tu_rt, NULL, &l), MOE_STATUS_INVALID_ARGUMENT);
        assert_non_null(strstr(moe_last_error(), "config = NULL"));
        assert_int_equal(moe_layer_create(NULL, NULL, &l), MOE_STATUS_INVALID_ARGUMENT);
        assert_int_equal(moe_layer_create(tu_rt, NULL, NULL), MOE_STATUS_INVALID_ARGUMENT);
    }
}

static void test_good_config_and_null_destroy(void **state)
{
    moe_layer_config_t c = good();
    moe_layer_t *l = NULL;
    moe_layer_info_t info;
    (void)state;
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    TU_OK(moe_layer_get_info(l, &info));
    assert_int_equal(info.ep_size * info.tp_size, 1);
    assert_int_equal(info.num_local_experts, 8);
    assert_true(info.weight_bytes >= (size_t)8 * 3 * 64 * 128 * 2);
    assert_int_equal(info.ep_round_tokens, 16); /* one GPU / CPU: one round, the capacity */
    TU_OK(moe_layer_destroy(l));
    c.ep_round_tokens = 16; /* the capacity: valid */
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    TU_OK(moe_layer_destroy(l));
    TU_OK(moe_layer_destroy(NULL));
    TU_OK(moe_runtime_destroy(NULL));
}

static void test_bad_weights(void **state)
{
    moe_layer_config_t c = good();
    moe_layer_t *l = NULL;
    float buf[128 * 64] = {0};
    moe_tensor_t t = {MOE_DTYPE_F32, 128, 64, buf, NULL, 0, 0};
    (void)state;
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    assert_int_equal(moe_layer_set_weight(l, MOE_WEIGHT_GATE_PROJ, 8, &t),
                     MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "expert = 8"));
    assert_int_equal(moe_layer_set_weight(l, MOE_WEIGHT_GATE_PROJ, 0, NULL),
                     MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_layer_set_weight(l, (moe_weight_kind_t)77, 0, &t),
                     MOE_STATUS_INVALID_ARGUMENT);
    t.rows = 64; /* wrong shape */
    assert_int_equal(moe_layer_set_weight(l, MOE_WEIGHT_GATE_PROJ, 0, &t),
                     MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "[64, 64]"));
    t.rows = 128;
    t.data = NULL;
    assert_int_equal(moe_layer_set_weight(l, MOE_WEIGHT_GATE_PROJ, 0, &t),
                     MOE_STATUS_INVALID_ARGUMENT);
    t.data = buf;
    t.dtype = MOE_DTYPE_FP8_E4M3; /* fp8 without scales */
    assert_int_equal(moe_layer_set_weight(l, MOE_WEIGHT_GATE_PROJ, 0, &t),
                     MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "without scale"));
    t.dtype = MOE_DTYPE_F32;
    assert_int_equal(moe_layer_set_weight(l, MOE_WEIGHT_SHARED_GATE_PROJ, -1, &t),
                     MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "no shared experts"));
    assert_int_equal(moe_layer_set_weight(l, MOE_WEIGHT_ROUTER_BIAS, -1, &t),
                     MOE_STATUS_INVALID_ARGUMENT);
    TU_OK(moe_layer_destroy(l));
}

static void test_bad_forward(void **state)
{
    moe_layer_config_t c = good();
    moe_layer_t *l = NULL;
    float x[17 * 64] = {0}, y[17 * 64];
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    (void)state;
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    a.num_tokens = 4;
    a.x = x;
    a.y = y;
    /* weights missing */
    assert_int_equal(moe_layer_forward(l, &a), MOE_STATUS_INVALID_STATE);
    assert_non_null(strstr(moe_last_error(), "ROUTER"));
    TU_OK(moe_gen_set_weights(l, &c, 3));
    TU_OK(moe_layer_forward(l, &a));
    a.num_tokens = 17;
    assert_int_equal(moe_layer_forward(l, &a), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "num_tokens = 17"));
    a.num_tokens = -1;
    assert_int_equal(moe_layer_forward(l, &a), MOE_STATUS_INVALID_ARGUMENT);
    a.num_tokens = 4;
    a.x = NULL;
    assert_int_equal(moe_layer_forward(l, &a), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "x = NULL"));
    a.x = x;
    a.dtype = MOE_DTYPE_FP8_E4M3;
    assert_int_equal(moe_layer_forward(l, &a), MOE_STATUS_INVALID_ARGUMENT);
    a.dtype = MOE_DTYPE_F32;
    a.y = x;
    assert_int_equal(moe_layer_forward(l, &a), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "alias"));
    assert_int_equal(moe_layer_forward(l, NULL), MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_layer_forward(NULL, &a), MOE_STATUS_INVALID_ARGUMENT);
    TU_OK(moe_layer_destroy(l));
}

static void test_check_inputs_rejects_nan(void **state)
{
    moe_layer_config_t c = good();
    moe_layer_t *l = NULL;
    float x[2 * 64] = {0}, y[2 * 64];
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    (void)state;
    c.check_inputs = 1;
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, 3));
    x[70] = NAN;
    a.num_tokens = 2;
    a.x = x;
    a.y = y;
    assert_int_equal(moe_layer_forward(l, &a), MOE_STATUS_NUMERIC_ERROR);
    assert_non_null(strstr(moe_last_error(), "x[70]"));
    TU_OK(moe_layer_destroy(l));
}

static void test_runtime_and_misc_args(void **state)
{
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    moe_runtime_t *r2 = NULL;
    moe_runtime_info_t info;
    (void)state;
    rc.backend = (moe_backend_t)9;
    assert_int_equal(moe_runtime_create(&rc, NULL, &r2), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "backend = 9"));
    rc.backend = MOE_BACKEND_AUTO;
    rc.timeout_ms = -5;
    assert_int_equal(moe_runtime_create(&rc, NULL, &r2), MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_runtime_create(NULL, NULL, NULL), MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_runtime_get_info(NULL, &info), MOE_STATUS_INVALID_ARGUMENT);
    TU_OK(moe_runtime_get_info(tu_rt, &info));
    assert_int_equal(info.backend, MOE_BACKEND_CPU);
    assert_string_equal(moe_status_string(MOE_STATUS_TIMEOUT), "MOE_STATUS_TIMEOUT");
    assert_string_equal(moe_status_string((moe_status_t)999), "MOE_STATUS_UNKNOWN");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_layer_configs),
        cmocka_unit_test(test_good_config_and_null_destroy),
        cmocka_unit_test(test_bad_weights),
        cmocka_unit_test(test_bad_forward),
        cmocka_unit_test(test_check_inputs_rejects_nan),
        cmocka_unit_test(test_runtime_and_misc_args),
    };
    return cmocka_run_group_tests(tests, tu_group_setup_cpu, tu_group_teardown);
}
