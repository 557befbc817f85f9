/* SPDX-License-Identifier: Apache-2.0 */
/* The arithmetic of EP rounds (runtime/ep_rounds.h), which the CUDA backend runs on every
 * rank: every rank must count the same rounds and rows from the same m, each round's rows fit
 * the buffers (R), and a rank's tokens are covered exactly once, in order. */
#include "testutil.h"

#include "runtime/ep_rounds.h"

static void test_default_round_tokens(void **state)
{
    int64_t cap;
    int w;
    (void)state;
    assert_int_equal(moe_ep_round_tokens(8192, 2, 0), 4096);
    assert_int_equal(moe_ep_round_tokens(8192, 8, 0), 1024);
    assert_int_equal(moe_ep_round_tokens(8192, 64, 0), 256); /* at least 256 */
    assert_int_equal(moe_ep_round_tokens(320, 2, 0), 256);
    assert_int_equal(moe_ep_round_tokens(100, 8, 0), 100);  /* small capacity: one round */
    assert_int_equal(moe_ep_round_tokens(8192, 2, 48), 48); /* asked */
    for (cap = 1; cap <= 3000; cap += 7)
        for (w = 1; w <= 64; w++) {
            const int64_t r = moe_ep_round_tokens(cap, w, 0);
            assert_true(r >= 1 && r <= cap);
            /* the buffers: world x R rows, about one capacity (at most one more row a rank, or
             * 256 rows a rank where the capacity is larger than that) */
            assert_true(w * r <= cap + w - 1 || r == (cap < 256 ? cap : 256));
            assert_true((int64_t)w * r >= cap || r == cap); /* never more than W rounds... */
            assert_true(moe_ep_rounds(cap, r) <= w);        /* ...at full capacity */
        }
}

static void test_rounds_cover_the_step(void **state)
{
    int64_t m, R, T, i;
    (void)state;
    for (m = 1; m <= 70; m++)
        for (R = 1; R <= m + 2; R++) {
            const int64_t n = moe_ep_rounds(m, R);
            int64_t rows = 0;
            assert_true(n >= 1 && (n - 1) * R < m && n * R >= m);
            for (i = 0; i < n; i++) {
                const int64_t mi = moe_ep_round_rows(m, R, i);
                assert_true(mi >= 1 && mi <= R); /* fits the buffers, never empty */
                rows += mi;
            }
            assert_int_equal(rows, m);
            for (T = 0; T <= m; T++) { /* this rank's tokens: each once, in order */
                int64_t next = 0;
                for (i = 0; i < n; i++) {
                    const int64_t t = moe_ep_round_tokens_here(T, m, R, i);
                    assert_true(t >= 0 && t <= moe_ep_round_rows(m, R, i));
                    if (t > 0) {
                        assert_int_equal(i * R, next); /* they start at token i R */
                        next += t;
                    }
                }
                assert_int_equal(next, T);
            }
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_round_tokens),
        cmocka_unit_test(test_rounds_cover_the_step),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
