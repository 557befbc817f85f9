/* SPDX-License-Identifier: Apache-2.0 */
/* The tools' number parser (launch/cli.c) and the library's environment knobs (base/env.c):
 * whole strings only, ranges enforced, nothing wraps, errors name the option and the value. */
#include "testutil.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "launch/cli.h"
#include "base/diag.h"

/* In diag.h once runtime.c reads MOE_TIMEOUT_MS with it; the same declaration is harmless. */
moe_status_t moe_env_int_checked(const char *name, int64_t dflt, int64_t *out);

static void expect_int_error(const char *s, int64_t lo, int64_t hi, const char *msg)
{
    char err[256] = "";
    int64_t x = 42;
    assert_int_equal(moe_cli_int("--opt", s, lo, hi, &x, err, sizeof(err)), -1);
    assert_int_equal(x, 42); /* untouched */
    if (!strstr(err, msg))
        fail_msg("\"%s\": message \"%s\" lacks \"%s\"", s, err, msg);
}

static void test_cli_int(void **state)
{
    char err[256];
    int64_t x = 0;
    (void)state;
    assert_int_equal(moe_cli_int("--opt", "17", 0, 100, &x, err, sizeof(err)), 0);
    assert_int_equal(x, 17);
    assert_int_equal(moe_cli_int("--opt", "010", 0, 100, &x, err, sizeof(err)), 0);
    assert_int_equal(x, 10); /* decimal, never octal */
    assert_int_equal(moe_cli_int("--opt", "0x20", 0, 100, &x, err, sizeof(err)), 0);
    assert_int_equal(x, 32);
    assert_int_equal(moe_cli_int("--opt", "-3", -5, 5, &x, err, sizeof(err)), 0);
    assert_int_equal(x, -3);
    assert_int_equal(
        moe_cli_int("--opt", "9223372036854775807", 0, INT64_MAX, &x, err, sizeof(err)), 0);
    assert_true(x == INT64_MAX);
    expect_int_error("4294967304", 1, 65536, "--opt 4294967304: out of range (1..65536)");
    expect_int_error("9223372036854775808", 0, INT64_MAX, "out of range");
    expect_int_error("-9223372036854775809", INT64_MIN, INT64_MAX, "out of range");
    expect_int_error("", 0, 10, "--opt: needs an integer value");
    expect_int_error("12abc", 0, 100, "--opt 12abc: not an integer");
    expect_int_error(" 5", 0, 10, "not an integer");
    expect_int_error("5 ", 0, 10, "not an integer");
    expect_int_error("0x", 0, 10, "not an integer");
    expect_int_error("--5", -10, 10, "not an integer");
    expect_int_error("1e3", 0, 10000, "not an integer");
    expect_int_error("-1", 0, 10, "--opt -1: out of range (0..10)");
}

static void test_cli_double(void **state)
{
    static const char *bad[] = {"nan", "NaN", "inf", "-inf", "1e999", "-1", "0", "1s", "", "x"};
    char err[256];
    double d = 0;
    size_t i;
    (void)state;
    assert_int_equal(moe_cli_double("--seconds", "0.25", 1e-3, 3600, &d, err, sizeof(err)), 0);
    assert_true(d == 0.25);
    for (i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        d = 7;
        assert_int_equal(moe_cli_double("--seconds", bad[i], 1e-3, 3600, &d, err, sizeof(err)), -1);
        assert_true(d == 7);
        assert_non_null(strstr(err, "--seconds"));
    }
}

static void test_cli_hash(void **state)
{
    (void)state;
    assert_true(moe_cli_hash(NULL) == 0);
    assert_true(moe_cli_hash("") != 0);
    assert_true(moe_cli_hash("bf16") != moe_cli_hash("fp8"));
    assert_true(moe_cli_hash("bf16") == moe_cli_hash("bf16"));
}

/* MOE_TIMEOUT_MS: 1 ms .. 24 h; a bad value is an error naming it (checked) or a warning and
 * the default (plain); unknown knobs must fit an int. */
static void test_env_knobs(void **state)
{
    static const char *bad[] = {"-1", "0", "4294967295", "abc", "86400001", "10x", "1e3"};
    int64_t v = 0;
    size_t i;
    (void)state;
    unsetenv("MOE_TIMEOUT_MS");
    TU_OK(moe_env_int_checked("MOE_TIMEOUT_MS", 300000, &v));
    assert_int_equal(v, 300000);
    setenv("MOE_TIMEOUT_MS", "86400000", 1);
    TU_OK(moe_env_int_checked("MOE_TIMEOUT_MS", 300000, &v));
    assert_int_equal(v, 86400000);
    for (i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char want[64];
        setenv("MOE_TIMEOUT_MS", bad[i], 1);
        v = 5;
        assert_int_equal(moe_env_int_checked("MOE_TIMEOUT_MS", 300000, &v),
                         MOE_STATUS_INVALID_ARGUMENT);
        assert_int_equal(v, 5);
        snprintf(want, sizeof(want), "MOE_TIMEOUT_MS=%s", bad[i]);
        assert_non_null(strstr(moe_last_error(), want));
        assert_int_equal(moe_env_int("MOE_TIMEOUT_MS", 300000), 300000);
    }
    unsetenv("MOE_TIMEOUT_MS");
    setenv("MOE_TEST_KNOB", "4294967296", 1); /* would wrap to 0 in an int */
    assert_int_equal(moe_env_int("MOE_TEST_KNOB", 3), 3);
    setenv("MOE_TEST_KNOB", "-7", 1);
    assert_int_equal(moe_env_int("MOE_TEST_KNOB", 3), -7);
    unsetenv("MOE_TEST_KNOB");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cli_int),
        cmocka_unit_test(test_cli_double),
        cmocka_unit_test(test_cli_hash),
        cmocka_unit_test(test_env_knobs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
