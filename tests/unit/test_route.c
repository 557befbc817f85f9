/* SPDX-License-Identifier: Apache-2.0 */
/* CPU reference routing against hand-worked cases: softmax (Mixtral/Qwen), DeepSeek-V3
 * grouped sigmoid with bias, ties, renormalisation and scaling. */
#include "testutil.h"

#include <math.h>
#include <string.h>

#include "kernels/cpu/moe_cpu.h"

static void test_softmax_top2_renormalized(void **state)
{
    /* logits 0, ln2, ln4, 0 -> p ~ 1,2,4,1 / 8: top-2 = {2, 1} with weights 4/6, 2/6 */
    float logits[4] = {0.0f, logf(2.0f), logf(4.0f), 0.0f};
    moe_route_params_t p = {4, 2, MOE_SCORING_SOFTMAX, 0, 0, 0, 1, 1.0f};
    int32_t ids[2];
    float w[2];
    (void)state;
    TU_OK(moe_cpu_route(&p, logits, NULL, 1, ids, w));
    assert_int_equal(ids[0], 2);
    assert_int_equal(ids[1], 1);
    assert_true(fabsf(w[0] - 4.0f / 6.0f) < 1e-6f);
    assert_true(fabsf(w[1] - 2.0f / 6.0f) < 1e-6f);
}

static void test_softmax_without_renorm(void **state)
{
    float logits[4] = {0.0f, logf(2.0f), logf(4.0f), 0.0f};
    moe_route_params_t p = {4, 2, MOE_SCORING_SOFTMAX, 0, 0, 0, 0, 1.0f};
    int32_t ids[2];
    float w[2];
    (void)state;
    TU_OK(moe_cpu_route(&p, logits, NULL, 1, ids, w));
    assert_true(fabsf(w[0] - 0.5f) < 1e-6f);  /* 4/8 */
    assert_true(fabsf(w[1] - 0.25f) < 1e-6f); /* 2/8 */
}

static void test_ties_go_to_lower_id(void **state)
{
    float logits[2][5] = {{1, 3, 3, 3, 0}, {2, 2, 2, 2, 2}};
    moe_route_params_t p = {5, 2, MOE_SCORING_SOFTMAX, 0, 0, 0, 1, 1.0f};
    int32_t ids[4];
    float w[4];
    (void)state;
    TU_OK(moe_cpu_route(&p, &logits[0][0], NULL, 2, ids, w));
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 2);
    assert_int_equal(ids[2], 0);
    assert_int_equal(ids[3], 1);
    assert_true(fabsf(w[2] - 0.5f) < 1e-6f);
}

/* DeepSeek-V3: 8 experts, 4 groups of 2, keep 2 groups, top-3; the bias changes the choice
 * but not the weights; renormalise (+1e-20) then scale by 2.5. */
static void test_deepseek_grouped_sigmoid_bias(void **state)
{
    /* sigmoid scores chosen through logits: s = sigmoid(l) */
    const float s[8] = {0.9f, 0.1f, 0.6f, 0.55f, 0.2f, 0.95f, 0.3f, 0.3f};
    const float bias[8] = {0, 0, 0, 0, 0.5f, 0, 0, 0};
    float logits[8];
    moe_route_params_t p = {8, 3, MOE_SCORING_SIGMOID, 1, 4, 2, 1, 2.5f};
    int32_t ids[3];
    float w[3], sum;
    int i;
    (void)state;
    for (i = 0; i < 8; i++)
        logits[i] = logf(s[i] / (1.0f - s[i]));
    /* choice b = s + bias: {0.9,0.1 | 0.6,0.55 | 0.7,0.95 | 0.3,0.3}
     * group scores (top-2 sums): 1.0, 1.15, 1.65, 0.6 -> keep groups 2 and 1
     * top-3 of b among experts 2..5: 5 (0.95), 4 (0.7), 2 (0.6) */
    TU_OK(moe_cpu_route(&p, logits, bias, 1, ids, w));
    assert_int_equal(ids[0], 5);
    assert_int_equal(ids[1], 4);
    assert_int_equal(ids[2], 2);
    /* weights from the unbiased scores: 0.95, 0.2, 0.6 */
    sum = 0.95f + 0.2f + 0.6f;
    assert_true(fabsf(w[0] - 2.5f * 0.95f / sum) < 1e-5f);
    assert_true(fabsf(w[1] - 2.5f * 0.2f / sum) < 1e-5f);
    assert_true(fabsf(w[2] - 2.5f * 0.6f / sum) < 1e-5f);
}

static void test_sigmoid_without_groups_or_renorm(void **state)
{
    float logits[4] = {0.0f, 2.0f, -1.0f, 1.0f};
    moe_route_params_t p = {4, 2, MOE_SCORING_SIGMOID, 0, 0, 0, 0, 1.0f};
    int32_t ids[2];
    float w[2];
    (void)state;
    TU_OK(moe_cpu_route(&p, logits, NULL, 1, ids, w));
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 3);
    assert_true(fabsf(w[0] - 1.0f / (1.0f + expf(-2.0f))) < 1e-6f);
}

static void test_bad_params(void **state)
{
    float logits[4] = {0};
    int32_t ids[8];
    float w[8];
    moe_route_params_t p = {4, 5, MOE_SCORING_SOFTMAX, 0, 0, 0, 1, 1.0f};
    (void)state;
    assert_int_equal(moe_cpu_route(&p, logits, NULL, 1, ids, w), MOE_STATUS_INVALID_ARGUMENT);
    p.top_k = 2;
    p.n_group = 3; /* does not divide 4 */
    p.topk_group = 1;
    assert_int_equal(moe_cpu_route(&p, logits, NULL, 1, ids, w), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "n_group = 3"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_softmax_top2_renormalized),
        cmocka_unit_test(test_softmax_without_renorm),
        cmocka_unit_test(test_ties_go_to_lower_id),
        cmocka_unit_test(test_deepseek_grouped_sigmoid_bias),
        cmocka_unit_test(test_sigmoid_without_groups_or_renorm),
        cmocka_unit_test(test_bad_params),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
