/* SPDX-License-Identifier: Apache-2.0 */
/* bf16 / f16 / fp8 e4m3 conversions: exhaustive over codes, rounding, saturation, NaN. */
#include "testutil.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/numeric.h"

static void test_fp8_all_codes_round_trip(void **state)
{
    int c;
    (void)state;
    for (c = 0; c < 256; c++) {
        float f = moe_fp8e4m3_to_f32((uint8_t)c);
        if ((c & 0x7f) == 0x7f) {
            assert_true(isnan(f));
            assert_int_equal(moe_f32_to_fp8e4m3(f), c); /* sign of NaN kept */
            continue;
        }
        assert_true(isfinite(f));
        assert_int_equal(moe_f32_to_fp8e4m3(f), c);
    }
}

static void test_fp8_known_values(void **state)
{
    (void)state;
    assert_true(moe_fp8e4m3_to_f32(0x7e) == 448.0f);
    assert_true(moe_fp8e4m3_to_f32(0xfe) == -448.0f);
    assert_true(moe_fp8e4m3_to_f32(0x08) == ldexpf(1.0f, -6)); /* smallest normal */
    assert_true(moe_fp8e4m3_to_f32(0x01) == ldexpf(1.0f, -9)); /* smallest subnormal */
    assert_true(moe_fp8e4m3_to_f32(0x07) == 7 * ldexpf(1.0f, -9));
    assert_true(moe_fp8e4m3_to_f32(0x38) == 1.0f);
    assert_true(moe_fp8e4m3_to_f32(0x39) == 1.125f);
    assert_true(moe_fp8e4m3_to_f32(0x80) == 0.0f && signbit(moe_fp8e4m3_to_f32(0x80)));
}

static void test_fp8_monotonic(void **state)
{
    int c;
    (void)state;
    for (c = 0; c < 0x7e; c++)
        assert_true(moe_fp8e4m3_to_f32((uint8_t)c) < moe_fp8e4m3_to_f32((uint8_t)(c + 1)));
}

static void test_fp8_rounding_and_saturation(void **state)
{
    (void)state;
    /* ties to even: 1.0625 is between 1.0 (0x38, even) and 1.125 (0x39) */
    assert_int_equal(moe_f32_to_fp8e4m3(1.0625f), 0x38);
    /* 1.1875 between 1.125 (0x39) and 1.25 (0x3a, even) */
    assert_int_equal(moe_f32_to_fp8e4m3(1.1875f), 0x3a);
    assert_int_equal(moe_f32_to_fp8e4m3(1.07f), 0x39);
    /* subnormal tie: 0.5 * 2^-9 rounds to 0 (even) */
    assert_int_equal(moe_f32_to_fp8e4m3(ldexpf(1.0f, -10)), 0x00);
    assert_int_equal(moe_f32_to_fp8e4m3(ldexpf(3.0f, -10)), 0x02); /* 1.5 -> 2 */
    assert_int_equal(moe_f32_to_fp8e4m3(449.0f), 0x7e);
    assert_int_equal(moe_f32_to_fp8e4m3(1e30f), 0x7e);
    assert_int_equal(moe_f32_to_fp8e4m3(INFINITY), 0x7e);
    assert_int_equal(moe_f32_to_fp8e4m3(-INFINITY), 0xfe);
    assert_int_equal(moe_f32_to_fp8e4m3(NAN) & 0x7f, 0x7f);
    assert_int_equal(moe_f32_to_fp8e4m3(-0.0f), 0x80);
    assert_int_equal(moe_f32_to_fp8e4m3(1e-30f), 0x00);
}

/* f's e4m3 code is the nearest of the format's values (ties: the even code), saturating to
 * +-448 and keeping NaN and the sign, judged against its decoded neighbours. */
static int fp8_code_is_nearest(float f)
{
    const uint8_t c = moe_f32_to_fp8e4m3(f), sign = signbit(f) ? 0x80 : 0, m = c & 0x7f;
    const double a = fabs((double)f);
    if ((c & 0x80) != sign)
        return 0;
    if (isnan(f))
        return m == 0x7f;
    if (a >= 448.0)
        return m == 0x7e;
    if (m > 0x7e)
        return 0;
    const double d = fabs(a - moe_fp8e4m3_to_f32(m));
    for (int nb = m - 1; nb <= m + 1; nb += 2) {
        if (nb < 0 || nb > 0x7e)
            continue;
        const double dn = fabs(a - moe_fp8e4m3_to_f32((uint8_t)nb));
        if (d > dn || (d == dn && (m & 1)))
            return 0;
    }
    return 1;
}

/* moe_f32_to_fp8e4m3 on a sweep of f32 bit patterns (every 251st: every exponent, both signs,
 * NaNs and infinities) and at and beside every midpoint between two neighbouring codes. */
static void test_fp8_encode_nearest_even(void **state)
{
    (void)state;
    for (uint64_t x = 0; x <= 0xffffffffu; x += 251) {
        const uint32_t u = (uint32_t)x;
        float f;
        memcpy(&f, &u, 4);
        if (!fp8_code_is_nearest(f))
            fail_msg("f32 0x%08x: code 0x%02x", u, moe_f32_to_fp8e4m3(f));
    }
    for (int m = 0; m < 0x7e; m++) {
        const float mid =
            0.5f * (moe_fp8e4m3_to_f32((uint8_t)m) + moe_fp8e4m3_to_f32((uint8_t)(m + 1)));
        const float at[3] = {mid, nextafterf(mid, 0.0f), nextafterf(mid, INFINITY)};
        for (int i = 0; i < 3; i++) {
            assert_true(fp8_code_is_nearest(at[i]));
            assert_true(fp8_code_is_nearest(-at[i]));
        }
    }
    assert_int_equal(moe_f32_to_fp8e4m3(nextafterf(448.0f, 0.0f)), 0x7e);
    assert_int_equal(moe_f32_to_fp8e4m3(ldexpf(15.5f, -10)), 0x08); /* 7.75 * 2^-9: up to 2^-6 */
}

/* moe_fp8_dynamic_scale_bf16 (the fused decode kernel's per-group scale of h without a division)
 * equals moe_fp8_dynamic_scale for every bf16 value: zero, subnormals, the smallest maxima (below
 * 1e-10), the largest and infinity. */
static void test_fp8_dynamic_scale_bf16(void **state)
{
    uint32_t v;
    (void)state;
    for (v = 0; v <= 0x7f80; v++) {
        const float a = moe_bf16_to_f32((uint16_t)v);
        const float want = moe_fp8_dynamic_scale(a), got = moe_fp8_dynamic_scale_bf16(a);
        if (memcmp(&want, &got, sizeof(float)) != 0)
            fail_msg("amax %g (bf16 0x%04x): %a by the FMA step, %a by division", (double)a, v,
                     (double)got, (double)want);
    }
    assert_true(moe_fp8_dynamic_scale_bf16(INFINITY) == INFINITY);
    assert_true(moe_fp8_dynamic_scale_bf16(0.0f) == moe_fp8_dynamic_scale(MOE_FP8_ACT_AMAX_MIN));
}

/* Nearest-value property against a brute-force search over all codes. */
/* moe_fp8_quotient (the GPU kernels' division for e4m3 quantisation: a reciprocal and one FMA
 * step) gives the e4m3 code of the correctly rounded quotient for bf16 values up to the group's
 * maximum, over a grid of maxima (every 61st positive bf16 code, tiny, huge and subnormal ones
 * among them) and every bf16 value of either sign up to each; an exhaustive run over all pairs
 * (1.07e9) agreed as well. */
static void test_fp8_quotient_by_reciprocal(void **state)
{
    uint32_t a, v;
    long checked = 0;
    (void)state;
    for (a = 1; a < 0x7f80; a += 61) {
        const float amax = moe_bf16_to_f32((uint16_t)a);
        const float s = moe_fp8_dynamic_scale(amax), r = 1.0f / s;
        for (v = 0; v < 0x7f80; v++) {
            const float x = moe_bf16_to_f32((uint16_t)v);
            int sg;
            if (x > amax)
                break;
            for (sg = 0; sg < 2; sg++) {
                const float y = sg ? -x : x;
                const uint8_t want = moe_fp8e4m3_quantize(y, s);
                const uint8_t got = moe_f32_to_fp8e4m3(moe_fp8_quotient(y, s, r));
                if (want != got)
                    fail_msg("amax %g, v %g: e4m3 0x%02x by the quotient, 0x%02x by division",
                             (double)amax, (double)y, got, want);
                checked++;
            }
        }
    }
    assert_true(checked > 1000000);
}

static void test_fp8_nearest_random(void **state)
{
    uint64_t s = tu_seed("fp8_nearest");
    float v[4096];
    int i, c;
    (void)state;
    tu_fill_uniform(v, 4096, -500.0f, 500.0f, &s);
    for (i = 0; i < 4096; i++) {
        float x = v[i] * (i % 3 == 0 ? 1e-3f : 1.0f);
        float got = moe_fp8e4m3_to_f32(moe_f32_to_fp8e4m3(x));
        float best = 0;
        for (c = 0; c < 256; c++) {
            float f = moe_fp8e4m3_to_f32((uint8_t)c);
            if (!isnan(f) && fabsf(f - x) < fabsf(best - x))
                best = f;
        }
        if (fabsf(x) >= 448.0f)
            best = copysignf(448.0f, x);
        assert_true(fabsf(got - x) <= fabsf(best - x));
    }
}

static void test_bf16_all_codes_round_trip(void **state)
{
    uint32_t c;
    (void)state;
    for (c = 0; c < 65536; c++) {
        float f = moe_bf16_to_f32((uint16_t)c);
        if (isnan(f)) {
            assert_true(isnan(moe_bf16_to_f32(moe_f32_to_bf16(f))));
            continue;
        }
        assert_int_equal(moe_f32_to_bf16(f), c);
    }
}

static void test_bf16_rounding(void **state)
{
    (void)state;
    /* 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0) */
    assert_int_equal(moe_f32_to_bf16(1.0f + ldexpf(1.0f, -8)), 0x3f80);
    /* 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6: goes up */
    assert_int_equal(moe_f32_to_bf16(1.0f + 3 * ldexpf(1.0f, -8)), 0x3f82);
    assert_int_equal(moe_f32_to_bf16(INFINITY), 0x7f80);
    assert_int_equal(moe_f32_to_bf16(-INFINITY), 0xff80);
    assert_true(isnan(moe_bf16_to_f32(moe_f32_to_bf16(NAN))));
    assert_int_equal(moe_f32_to_bf16(3.4e38f), 0x7f80); /* rounds past the max: Inf */
}

static void test_f16_all_codes_round_trip(void **state)
{
    uint32_t c;
    (void)state;
    for (c = 0; c < 65536; c++) {
        float f = moe_f16_to_f32((uint16_t)c);
        if (isnan(f))
            continue;
        assert_int_equal(moe_f32_to_f16(f), c);
    }
    assert_true(moe_f16_to_f32(0x3c00) == 1.0f);
    assert_true(moe_f16_to_f32(0x0001) == ldexpf(1.0f, -24));
    assert_int_equal(moe_f32_to_f16(70000.0f), 0x7c00);
}

static void test_bulk_conversions(void **state)
{
    float src[5] = {1.0f, -2.5f, 0.0f, 448.0f, 0.1f}, back[5];
    uint16_t b[5];
    uint8_t f8[5];
    (void)state;
    moe_convert_from_f32(MOE_DTYPE_BF16, src, b, 5);
    moe_convert_to_f32(MOE_DTYPE_BF16, b, back, 5);
    assert_true(back[1] == -2.5f && back[3] == 448.0f);
    moe_convert_from_f32(MOE_DTYPE_FP8_E4M3, src, f8, 5);
    moe_convert_to_f32(MOE_DTYPE_FP8_E4M3, f8, back, 5);
    assert_true(back[0] == 1.0f && back[3] == 448.0f && fabsf(back[4] - 0.1f) < 0.01f);
}

/* n = 0 with NULL buffers (a forward with no tokens may pass NULL x and y): nothing is touched,
 * and no memcpy sees a NULL pointer (UBSan's nonnull check). */
static void test_convert_empty_null(void **state)
{
    static const moe_dtype_t dts[] = {MOE_DTYPE_F32, MOE_DTYPE_BF16, MOE_DTYPE_F16,
                                      MOE_DTYPE_FP8_E4M3};
    size_t i;
    (void)state;
    for (i = 0; i < sizeof(dts) / sizeof(dts[0]); i++) {
        moe_convert_to_f32(dts[i], NULL, NULL, 0);
        moe_convert_from_f32(dts[i], NULL, NULL, 0);
    }
}

/* hi + mid + lo == w exactly (summed in double, then compared as f32 bits) over random bit
 * patterns of every exponent that keeps lo normal, with the edge values; non-finite w in hi. */
static void test_split_bf16x3(void **state)
{
    enum { N = 200000 };
    static const float edges[] = {0.0f,
                                  -0.0f,
                                  1.0f,
                                  -1.0f,
                                  3.4028235e38f,
                                  -3.4028235e38f,
                                  1.1754944e-38f * 1048576.0f * 1024.0f * 1024.0f};
    float *w = malloc(sizeof(float) * N);
    uint16_t *p = malloc(3 * sizeof(uint16_t) * N);
    uint32_t r = 12345u;
    size_t i;
    (void)state;
    for (i = 0; i < N; i++) {
        uint32_t u;
        r = r * 1664525u + 1013904223u;
        /* exponents 2^-100 .. 2^127, any significand and sign */
        u = (r & 0x807fffffu) | ((27u + (r >> 8) % 227u) << 23);
        memcpy(&w[i], &u, sizeof(u));
    }
    memcpy(w, edges, sizeof(edges));
    moe_split_bf16x3(w, p, p + N, p + 2 * N, N);
    for (i = 0; i < N; i++) {
        const double sum = (double)moe_bf16_to_f32(p[i]) + (double)moe_bf16_to_f32(p[N + i]) +
                           (double)moe_bf16_to_f32(p[2 * N + i]);
        if (sum != (double)w[i]) {
            print_error("split %zu: %.9g != %.9g\n", i, sum, (double)w[i]);
            fail();
        }
    }
    w[0] = INFINITY, w[1] = -INFINITY, w[2] = NAN;
    moe_split_bf16x3(w, p, p + 3, p + 6, 3);
    assert_true(isinf(moe_bf16_to_f32(p[0])) && moe_bf16_to_f32(p[0]) > 0);
    assert_true(isinf(moe_bf16_to_f32(p[1])) && moe_bf16_to_f32(p[1]) < 0);
    assert_true(isnan(moe_bf16_to_f32(p[2])));
    for (i = 3; i < 9; i++)
        assert_int_equal(p[i], 0);
    free(w), free(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fp8_all_codes_round_trip),
        cmocka_unit_test(test_fp8_known_values),
        cmocka_unit_test(test_fp8_monotonic),
        cmocka_unit_test(test_fp8_rounding_and_saturation),
        cmocka_unit_test(test_fp8_encode_nearest_even),
        cmocka_unit_test(test_fp8_nearest_random),
        cmocka_unit_test(test_fp8_quotient_by_reciprocal),
        cmocka_unit_test(test_fp8_dynamic_scale_bf16),
        cmocka_unit_test(test_bf16_all_codes_round_trip),
        cmocka_unit_test(test_bf16_rounding),
        cmocka_unit_test(test_f16_all_codes_round_trip),
        cmocka_unit_test(test_bulk_conversions),
        cmocka_unit_test(test_convert_empty_null),
        cmocka_unit_test(test_split_bf16x3),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
