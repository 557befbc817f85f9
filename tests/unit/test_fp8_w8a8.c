/* SPDX-License-Identifier: Apache-2.0 */
/* FP8 W8A8 on the CPU reference: e4m3 quantisation (saturation, NaN, ties, subnormals), activation
 * quantisation round trips, the W8A8 product on hand-computed cases, a whole layer against an
 * independent implementation of docs/SEMANTICS.md's W8A8 rules, W8A8 vs W8A16 error, the static
 * scale rule of gate/up and the generator's static scales. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/moe_cpu.h"
#include "base/numeric.h"
#include "launch/layer_gen.h"

static float e4m3(float v)
{
    return moe_fp8e4m3_to_f32(moe_f32_to_fp8e4m3(v));
}

/* ------------------------------------------------------------------------------------------ */
/* e4m3 quantisation                                                                           */
/* ------------------------------------------------------------------------------------------ */

static void test_e4m3_quantize(void **state)
{
    (void)state;
    /* saturation: finite values never become NaN */
    assert_int_equal(moe_fp8e4m3_quantize(1e6f, 1.0f), 0x7e);
    assert_int_equal(moe_fp8e4m3_quantize(-1e6f, 1.0f), 0xfe);
    assert_true(moe_fp8e4m3_to_f32(moe_fp8e4m3_quantize(1e6f, 1.0f)) == 448.0f);
    assert_true(moe_fp8e4m3_to_f32(moe_fp8e4m3_quantize(-1e6f, 1.0f)) == -448.0f);
    assert_int_equal(moe_fp8e4m3_quantize(464.0f, 1.0f), 0x7e); /* would round up to 480 */
    assert_int_equal(moe_fp8e4m3_quantize(449.0f, 1.0f), 0x7e);
    assert_int_equal(moe_fp8e4m3_quantize(INFINITY, 1.0f), 0x7e);
    assert_int_equal(moe_fp8e4m3_quantize(-INFINITY, 1.0f), 0xfe);
    assert_int_equal(moe_fp8e4m3_quantize(3.0f, 1e-9f), 0x7e); /* a tiny static scale */
    /* NaN stays NaN */
    assert_int_equal(moe_fp8e4m3_quantize(NAN, 1.0f) & 0x7f, 0x7f);
    assert_true(isnan(moe_fp8e4m3_to_f32(moe_fp8e4m3_quantize(NAN, 2.0f))));
    /* the value divided by the scale, then rounded */
    assert_true(moe_fp8e4m3_to_f32(moe_fp8e4m3_quantize(6.0f, 2.0f)) == 3.0f);
    /* round to nearest even at ties: spacing 1/8 in [1, 2) */
    assert_int_equal(moe_fp8e4m3_quantize(1.0625f, 1.0f), 0x38); /* -> 1.0 (even) */
    assert_int_equal(moe_fp8e4m3_quantize(1.1875f, 1.0f), 0x3a); /* -> 1.25 (even) */
    assert_int_equal(moe_fp8e4m3_quantize(2.125f, 2.0f), 0x38);  /* 1.0625 after the scale */
    assert_int_equal(moe_fp8e4m3_quantize(1.0626f, 1.0f), 0x39); /* past the tie */
    assert_int_equal(moe_fp8e4m3_quantize(-1.0625f, 1.0f), 0xb8);
    /* subnormals: multiples of 2^-9 below 2^-6 */
    assert_int_equal(moe_fp8e4m3_quantize(0x1p-9f, 1.0f), 0x01);
    assert_int_equal(moe_fp8e4m3_quantize(7 * 0x1p-9f, 1.0f), 0x07);
    assert_int_equal(moe_fp8e4m3_quantize(0x1p-10f, 1.0f), 0x00);     /* tie -> 0 (even) */
    assert_int_equal(moe_fp8e4m3_quantize(3 * 0x1p-10f, 1.0f), 0x02); /* tie -> 2^-8 (even) */
    assert_int_equal(moe_fp8e4m3_quantize(0x1p-12f, 1.0f), 0x00);
    assert_int_equal(moe_fp8e4m3_quantize(-0x1p-9f, 1.0f), 0x81);
    assert_true(moe_fp8e4m3_to_f32(0x01) == 0x1p-9f);
    assert_true(moe_fp8e4m3_to_f32(0x08) == 0x1p-6f); /* smallest normal */
    /* dynamic scales: amax / 448, floored so zeros stay exact zeros */
    assert_true(moe_fp8_dynamic_scale(7.0f) == 7.0f / 448.0f);
    assert_true(moe_fp8_dynamic_scale(0.0f) > 0.0f && isfinite(moe_fp8_dynamic_scale(0.0f)));
    assert_int_equal(moe_fp8e4m3_quantize(0.0f, moe_fp8_dynamic_scale(0.0f)), 0x00);
    assert_true(moe_fp8_dynamic_scale(1e-30f) > 0.0f);
}

/* |dequantised - x| within half an e4m3 step: 2^-4 |x| for normals, 2^-10 s below 2^-6 s. */
static void check_round_trip(const float *x, int64_t n, int64_t k, int64_t group)
{
    const int64_t ng = group > 0 ? (k + group - 1) / group : 1, gw = group > 0 ? group : k;
    uint8_t *q = malloc((size_t)(n * k));
    float *s = malloc(sizeof(float) * (size_t)(n * ng));
    float *amax = malloc(sizeof(float) * (size_t)ng);
    int64_t i, c;
    assert_true(q && s && amax);
    moe_cpu_fp8_quantize_rows(x, n, k, group, 0.0f, q, s);
    for (i = 0; i < n; i++) {
        for (int64_t g = 0; g < ng; g++) {
            amax[g] = 0.0f;
            for (c = g * gw; c < (g + 1) * gw && c < k; c++)
                amax[g] = fmaxf(amax[g], fabsf(x[i * k + c]));
            assert_true(s[i * ng + g] == moe_fp8_dynamic_scale(amax[g]));
        }
        for (c = 0; c < k; c++) {
            const float sc = s[i * ng + c / gw], v = x[i * k + c];
            const float d = moe_fp8e4m3_to_f32(q[i * k + c]) * sc;
            const float tol = fmaxf(fabsf(v) * 0x1p-4f, sc * 0x1p-10f) * 1.0001f;
            if (!(fabsf(d - v) <= tol))
                fail_msg("row %lld col %lld: %g -> %g (scale %g)", (long long)i, (long long)c,
                         (double)v, (double)d, (double)sc);
            if (fabsf(v) == amax[c / gw] && v != 0.0f) /* the group's largest: +-448 */
                assert_true(fabsf(moe_fp8e4m3_to_f32(q[i * k + c])) == 448.0f);
        }
    }
    free(q);
    free(s);
    free(amax);
}

static void test_quantize_rows(void **state)
{
    uint64_t st = tu_seed("w8a8_rows");
    enum { N = 3, K = 300 };
    float *x = malloc(sizeof(float) * N * K);
    uint8_t q[K];
    float s[3];
    (void)state;
    assert_true(x != NULL);
    tu_fill_uniform(x, N * K, -3.0f, 3.0f, &st);
    for (int c = 128; c < 256; c++) /* a quiet middle group: 1x128 groups keep its precision */
        x[K + c] *= 1e-6f;
    check_round_trip(x, N, K, 0);
    check_round_trip(x, N, K, 128); /* 300 = 128 + 128 + 44: a partial last group */
    /* per-group precision: the quiet group's error is far below a per-row scale's */
    {
        uint8_t q1[K], q2[K];
        float s1[1], s2[3];
        double e1 = 0, e2 = 0;
        moe_cpu_fp8_quantize_rows(x + K, 1, K, 0, 0.0f, q1, s1);
        moe_cpu_fp8_quantize_rows(x + K, 1, K, 128, 0.0f, q2, s2);
        for (int c = 128; c < 256; c++) {
            e1 += fabs(moe_fp8e4m3_to_f32(q1[c]) * s1[0] - x[K + c]);
            e2 += fabs(moe_fp8e4m3_to_f32(q2[c]) * s2[1] - x[K + c]);
        }
        assert_true(e2 * 10 < e1);
    }
    /* a zero row: a positive scale and exact zeros */
    memset(x, 0, sizeof(float) * K);
    moe_cpu_fp8_quantize_rows(x, 1, K, 128, 0.0f, q, s);
    for (int c = 0; c < K; c++)
        assert_int_equal(q[c], 0);
    assert_true(s[0] > 0.0f && isfinite(s[0]));
    /* NaN stays NaN and does not spoil its group's scale */
    x[5] = NAN;
    x[6] = 2.0f;
    x[7] = -0.5f;
    moe_cpu_fp8_quantize_rows(x, 1, K, 0, 0.0f, q, s);
    assert_true(s[0] == 2.0f / 448.0f);
    assert_true(isnan(moe_fp8e4m3_to_f32(q[5])));
    assert_true(moe_fp8e4m3_to_f32(q[6]) == 448.0f);
    assert_true(moe_fp8e4m3_to_f32(q[7]) == -112.0f);
    /* a static scale: used as is, values past 448 s saturate */
    moe_cpu_fp8_quantize_rows(x, 1, K, 0, 1.0f / 128.0f, q, s);
    assert_true(s[0] == 1.0f / 128.0f);
    assert_true(moe_fp8e4m3_to_f32(q[6]) == 256.0f);
    x[6] = 1e4f;
    moe_cpu_fp8_quantize_rows(x, 1, K, 0, 1.0f / 128.0f, q, s);
    assert_true(moe_fp8e4m3_to_f32(q[6]) == 448.0f);
    free(x);
}

/* ------------------------------------------------------------------------------------------ */
/* The W8A8 product on hand-computed cases                                                     */
/* ------------------------------------------------------------------------------------------ */

/* x[0] = 7, x[1..63] = 1, x[64..127] = -0.5: amax 7, scale 7/448 = 2^-6 (exact), q = 448, 64,
 * -32. Row 0 of W: all 1.0; row 1: 2.0 then -1.0 (from column 64). */
static void hand_case(float *x, uint8_t *w, int64_t K)
{
    int64_t c;
    for (c = 0; c < 128; c++) {
        x[c] = c == 0 ? 7.0f : c < 64 ? 1.0f : -0.5f;
        w[c] = moe_f32_to_fp8e4m3(1.0f);
        w[K + c] = moe_f32_to_fp8e4m3(c < 64 ? 2.0f : -1.0f);
    }
    /* K = 256: a second group of 0.25 with one 0.875 (amax 0.875, scale 2^-9: q = 128, 448) */
    for (c = 128; c < K; c++) {
        x[c] = c == 200 ? 0.875f : 0.25f;
        w[c] = moe_f32_to_fp8e4m3(1.0f);
        w[K + c] = moe_f32_to_fp8e4m3(1.0f);
    }
}

static void test_matmul_hand_computed(void **state)
{
    float x[256], sa[2], y[2];
    uint8_t w[2 * 256], qa[256];
    float st[1] = {0.5f}, sc[2] = {0.5f, 0.25f}, sb[2] = {0.5f, 4.0f};
    moe_cpu_matrix_t m = {MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_TENSOR, 2, 128, w, st};
    (void)state;

    /* per tensor, K = 128: sum q_a q_w = 448 + 63 * 64 - 64 * 32 = 2432 -> 2^-6 * 0.5 * 2432 = 19
     * (= 7 * 0.5 + 63 * 0.5 - 64 * 0.25); row 1: 896 + 8064 + 2048 = 11008 -> 86 */
    hand_case(x, w, 128);
    moe_cpu_fp8_quantize_rows(x, 1, 128, moe_cpu_w8a8_group(&m), 0.0f, qa, sa);
    assert_true(sa[0] == 0x1p-6f);
    TU_OK(moe_cpu_matmul_w8a8(qa, sa, 1, &m, y));
    assert_true(y[0] == 19.0f);
    assert_true(y[1] == 86.0f);
    /* per channel: row 1 scaled by 0.25 -> 43 */
    m.scale_kind = MOE_SCALE_PER_CHANNEL;
    m.scale = sc;
    TU_OK(moe_cpu_matmul_w8a8(qa, sa, 1, &m, y));
    assert_true(y[0] == 19.0f);
    assert_true(y[1] == 43.0f);
    /* 128x128 blocks, K = 256 (one row block, two K blocks with weight scales 0.5 and 4): block 0
     * gives 19 as above; block 1: 448 + 127 * 128 = 16704 -> 2^-9 * 4 * 16704 = 130.5
     * (= 0.875 * 4 + 127 * 0.25 * 4); total 149.5. Row 1 block 0 with all-ones weights on
     * block 1: 896 + 8064 + 2048 = 11008 -> 86, plus 130.5 -> 216.5 */
    hand_case(x, w, 256);
    m.scale_kind = MOE_SCALE_BLOCK_128;
    m.scale = sb;
    m.cols = 256;
    moe_cpu_fp8_quantize_rows(x, 1, 256, moe_cpu_w8a8_group(&m), 0.0f, qa, sa);
    assert_true(sa[0] == 0x1p-6f && sa[1] == 0x1p-9f);
    TU_OK(moe_cpu_matmul_w8a8(qa, sa, 1, &m, y));
    assert_true(y[0] == 149.5f);
    assert_true(y[1] == 216.5f);
}

/* ------------------------------------------------------------------------------------------ */
/* A layer against an independent implementation                                               */
/* ------------------------------------------------------------------------------------------ */

enum { XH = 256, XI = 256, XT = 3 };

/* One expert's weights: e4m3 codes of small integers (|v| <= 2) and power-of-two scales that
 * depend on the row (block) only, so that with the tokens below every GEMM1 result is exact in
 * f32 whatever the order of the sums (at most 23 significant bits). */
typedef struct ref_expert {
    uint8_t gate[XI * XH], up[XI * XH], down[XH * XI];
    float sg[XI * 2], su[XI * 2], sd[XH * 2]; /* room for any kind's scales */
} ref_expert_t;

static int64_t nscales(moe_scale_kind_t k, int64_t rows, int64_t cols)
{
    return k == MOE_SCALE_PER_TENSOR    ? 1
           : k == MOE_SCALE_PER_CHANNEL ? rows
                                        : ((rows + 127) / 128) * ((cols + 127) / 128);
}

static float row_scale(moe_scale_kind_t k, int64_t r)
{
    if (k == MOE_SCALE_PER_TENSOR)
        return 0x1p-5f;
    if (k == MOE_SCALE_PER_CHANNEL)
        return ldexpf(1.0f, -5 - (int)(r % 3));
    return ldexpf(1.0f, -5 - (int)((r / 128) % 2));
}

static void make_matrix(moe_scale_kind_t k, int64_t rows, int64_t cols, uint8_t *q, float *s,
                        uint64_t *st)
{
    float v[1];
    int64_t i, r;
    for (i = 0; i < rows * cols; i++) {
        tu_fill_uniform(v, 1, -2.5f, 2.5f, st);
        q[i] = moe_f32_to_fp8e4m3(truncf(v[0]));
    }
    if (k == MOE_SCALE_BLOCK_128) {
        for (r = 0; r < (rows + 127) / 128; r++)
            for (i = 0; i < (cols + 127) / 128; i++)
                s[r * ((cols + 127) / 128) + i] = row_scale(k, r * 128);
    } else {
        for (r = 0; r < nscales(k, rows, cols); r++)
            s[r] = row_scale(k, r);
    }
}

static float wscale(moe_scale_kind_t k, const float *s, int64_t cols, int64_t r, int64_t c)
{
    if (k == MOE_SCALE_BLOCK_128)
        return s[(r / 128) * ((cols + 127) / 128) + c / 128];
    return k == MOE_SCALE_PER_CHANNEL ? s[r] : s[0];
}

/* Tokens whose two 128-groups differ by 2^10 in scale: group 0 has +-7 (scale 2^-6) and
 * multiples of 2^-6 up to 8 * 2^-6; group 1 has +-448 * 2^-16 (scale 2^-16) and values of up to
 * 4 significant bits times 2^-16, which a per-token scale rounds into e4m3 subnormals. All are
 * bf16 values. */
static void make_tokens(float *x, uint64_t *st)
{
    static const float odd[] = {9, 11, 13, 15, -9, -11, -13, -15};
    float v[2];
    int64_t t, c;
    for (t = 0; t < XT; t++)
        for (c = 0; c < XH; c++) {
            tu_fill_uniform(v, 2, -8.5f, 8.5f, st);
            if (c < 128)
                x[t * XH + c] = c == 0 ? (v[1] < 0 ? -7.0f : 7.0f) : truncf(v[0]) * 0x1p-6f;
            else if (c == 128)
                x[t * XH + c] = (v[1] < 0 ? -448.0f : 448.0f) * 0x1p-16f;
            else
                x[t * XH + c] = (v[1] < 0 ? odd[(int)fabsf(v[0]) % 8] : truncf(v[0])) * 0x1p-16f;
        }
}

/* The W8A8 rules written out plainly: quantise in groups (per token or 1x128), decoded e4m3
 * products summed in double, scales applied as docs/SEMANTICS.md says. `stat` > 0: that static
 * scale instead of dynamic ones. */
static void ref_quantize(const float *v, int64_t k, int64_t group, float stat, float *qv, float *sv)
{
    const int64_t gw = group ? group : k;
    for (int64_t g = 0; g * gw < k; g++) {
        float amax = 0.0f, s;
        for (int64_t c = g * gw; c < (g + 1) * gw && c < k; c++)
            amax = fmaxf(amax, fabsf(v[c]));
        s = stat > 0.0f ? stat : fmaxf(amax, 1e-10f) / 448.0f;
        sv[g] = s;
        for (int64_t c = g * gw; c < (g + 1) * gw && c < k; c++)
            qv[c] = e4m3(v[c] / s);
    }
}

static double ref_gemm(moe_scale_kind_t k, const float *qa, const float *sa, const uint8_t *w,
                       const float *sw, int64_t cols, int64_t r, double *abs_sum)
{
    double y = 0.0, part = 0.0, apart = 0.0;
    *abs_sum = 0.0;
    for (int64_t c = 0; c < cols; c++) {
        const double p = (double)qa[c] * moe_fp8e4m3_to_f32(w[r * cols + c]);
        const int last = c + 1 == cols || (k == MOE_SCALE_BLOCK_128 && (c + 1) % 128 == 0);
        part += p;
        apart += fabs(p);
        if (last) {
            const double scale =
                (double)sa[k == MOE_SCALE_BLOCK_128 ? c / 128 : 0] * wscale(k, sw, cols, r, c);
            y += scale * part;
            *abs_sum += scale * apart;
            part = apart = 0.0;
        }
    }
    return y;
}

/* y[XH] and bound[XH] of one token: 1e-5 of the sum of |terms| of the down projection, well above
 * what f32 sums of 256 terms (moe_cpu_dot: ~35 additions deep) can round (~2e-6 of it). */
static void ref_mlp(moe_scale_kind_t k, const ref_expert_t *e, const float *x, const float *stat,
                    float *y, double *bound)
{
    const int64_t group = k == MOE_SCALE_BLOCK_128 ? 128 : 0;
    float qa[XH], sa[2], g[XI], u[XI], h[XI], qh[XI], sh[2], xb[XH];
    double dummy;
    int64_t i;
    for (i = 0; i < XH; i++) /* the token as the GPU gathers it: bf16 */
        xb[i] = moe_bf16_to_f32(moe_f32_to_bf16(x[i]));
    ref_quantize(xb, XH, group, stat[0] > stat[1] ? stat[0] : stat[1], qa, sa);
    for (i = 0; i < XI; i++) { /* exact sums: f32 and double agree */
        g[i] = (float)ref_gemm(k, qa, sa, e->gate, e->sg, XH, i, &dummy);
        u[i] = (float)ref_gemm(k, qa, sa, e->up, e->su, XH, i, &dummy);
    }
    moe_cpu_act_mul(MOE_ACTIVATION_SILU, g, u, h, XI); /* act(gate) * up in f32 */
    for (i = 0; i < XI; i++)                           /* held in bf16 between the GEMMs */
        h[i] = moe_bf16_to_f32(moe_f32_to_bf16(h[i]));
    ref_quantize(h, XI, group, stat[2], qh, sh);
    for (i = 0; i < XH; i++) {
        double a;
        y[i] = (float)ref_gemm(k, qh, sh, e->down, e->sd, XI, i, &a);
        bound[i] = 1e-5 * a + 1e-30;
    }
}

static moe_tensor_t fp8_tensor(moe_scale_kind_t k, int64_t rows, int64_t cols, const uint8_t *q,
                               const float *s)
{
    moe_tensor_t t = {MOE_DTYPE_FP8_E4M3, rows, cols, q, s, 1, 1};
    if (k == MOE_SCALE_PER_CHANNEL)
        t.scale_rows = rows;
    if (k == MOE_SCALE_BLOCK_128)
        t.scale_rows = (rows + 127) / 128, t.scale_cols = (cols + 127) / 128;
    return t;
}

/* Max over elements of |a - ref| / bound, and ||a - ref|| / ||ref||. */
static double ratio_to_bound(const float *a, const float *ref, const double *bound, int64_t n)
{
    double worst = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double d = fabs((double)a[i] - ref[i]) / bound[i];
        worst = isnan(d) ? INFINITY : d > worst ? d : worst;
    }
    return worst;
}

/* The two-expert layer of the tests below (E 2, k 1, FP8 weights of scale kind k) and its two
 * experts' matrices; logits (optional) send token t to expert t % 2 with weight exactly 1. */
static moe_layer_config_t two_experts(moe_scale_kind_t k, ref_expert_t *ex, float *logits,
                                      uint64_t *st)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    c.num_experts = 2;
    c.top_k = 1;
    c.hidden = XH;
    c.intermediate = XI;
    c.max_tokens_per_rank = XT;
    c.weight_dtype = MOE_DTYPE_FP8_E4M3;
    c.scale_kind = k;
    for (int e = 0; e < 2; e++) {
        make_matrix(k, XI, XH, ex[e].gate, ex[e].sg, st);
        make_matrix(k, XI, XH, ex[e].up, ex[e].su, st);
        make_matrix(k, XH, XI, ex[e].down, ex[e].sd, st);
    }
    for (int t = 0; logits && t < XT; t++) {
        logits[t * 2] = t % 2 ? -1.0f : 1.0f;
        logits[t * 2 + 1] = -logits[t * 2];
    }
    return c;
}

/* Layer E 2, k 1 (the chosen expert's weight is exactly 1), router logits given, W8A8 vs the
 * reference above; W8A16 of the same layer must differ (the test sees the arithmetic). */
static void test_layer_vs_independent(void **state)
{
    static const moe_scale_kind_t kinds[3] = {MOE_SCALE_PER_TENSOR, MOE_SCALE_PER_CHANNEL,
                                              MOE_SCALE_BLOCK_128};
    uint64_t st = tu_seed("w8a8_exact");
    ref_expert_t *ex = malloc(sizeof(ref_expert_t) * 2);
    float x[XT * XH], y[XT * XH], ref[XT * XH], logits[XT * 2], y16[XT * XH];
    double bound[XT * XH];
    const float nostat[3] = {0, 0, 0};
    (void)state;
    assert_true(ex != NULL);
    make_tokens(x, &st);
    for (int ki = 0; ki < 3; ki++) {
        const moe_scale_kind_t k = kinds[ki];
        moe_layer_config_t c = two_experts(k, ex, logits, &st);
        moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
        moe_layer_t *l = NULL;
        double worst, e16;
        for (int mode = 0; mode < 2; mode++) {
            c.fp8_math = mode == 0 ? MOE_FP8_MATH_W8A8 : MOE_FP8_MATH_W8A16;
            TU_OK(moe_layer_create(tu_rt, &c, &l));
            for (int e = 0; e < 2; e++) {
                moe_tensor_t tg = fp8_tensor(k, XI, XH, ex[e].gate, ex[e].sg);
                moe_tensor_t tu = fp8_tensor(k, XI, XH, ex[e].up, ex[e].su);
                moe_tensor_t td = fp8_tensor(k, XH, XI, ex[e].down, ex[e].sd);
                TU_OK(moe_layer_set_weight(l, MOE_WEIGHT_GATE_PROJ, e, &tg));
                TU_OK(moe_layer_set_weight(l, MOE_WEIGHT_UP_PROJ, e, &tu));
                TU_OK(moe_layer_set_weight(l, MOE_WEIGHT_DOWN_PROJ, e, &td));
            }
            for (int i = 0; i < XT * XH; i++)
                (mode == 0 ? y : y16)[i] = NAN;
            a.num_tokens = XT;
            a.dtype = MOE_DTYPE_F32;
            a.x = x;
            a.y = mode == 0 ? y : y16;
            a.router_logits = logits;
            TU_OK(moe_layer_forward(l, &a));
            TU_OK(moe_layer_destroy(l));
        }
        for (int t = 0; t < XT; t++)
            ref_mlp(k, &ex[t % 2], x + t * XH, nostat, ref + t * XH, bound + t * XH);
        worst = ratio_to_bound(y, ref, bound, XT * XH);
        e16 = tu_rel_err(y16, ref, XT * XH);
        fprintf(stderr,
                "w8a8 exact, scale kind %d: worst |y - ref| / bound %.3g; W8A16 vs the "
                "W8A8 reference: rel. error %.3g\n",
                (int)k, worst, e16);
        assert_true(worst <= 1.0);
        assert_true(e16 > 1e-3); /* the W8A8 path is really another arithmetic */
    }
    free(ex);
}

/* moe_cpu_mlp_w8a8 with static input scales (per-tensor weights): gate/up use the larger of
 * their two scales, down its own; a small down scale saturates part of h at +-448. */
static void test_static_scales(void **state)
{
    uint64_t st = tu_seed("w8a8_static");
    ref_expert_t *e = malloc(sizeof(ref_expert_t));
    const moe_scale_kind_t k = MOE_SCALE_PER_TENSOR;
    float x[XT * XH], y[XT * XH], ref[XT * XH], ydyn[XT * XH], hq[XI];
    double bound[XT * XH];
    moe_cpu_mlp_t w;
    (void)state;
    assert_true(e != NULL);
    make_tokens(x, &st);
    make_matrix(k, XI, XH, e->gate, e->sg, &st);
    make_matrix(k, XI, XH, e->up, e->su, &st);
    make_matrix(k, XH, XI, e->down, e->sd, &st);
    memset(&w, 0, sizeof(w));
    w.gate = (moe_cpu_matrix_t){MOE_DTYPE_FP8_E4M3, k, XI, XH, e->gate, e->sg};
    w.up = (moe_cpu_matrix_t){MOE_DTYPE_FP8_E4M3, k, XI, XH, e->up, e->su};
    w.down = (moe_cpu_matrix_t){MOE_DTYPE_FP8_E4M3, k, XH, XI, e->down, e->sd};
    w.full_intermediate = XI;
    TU_OK(moe_cpu_mlp_w8a8(&w, MOE_ACTIVATION_SILU, x, XT, ydyn));
    /* static: gate 2^-7 and up 2^-6 -> 2^-6 for both (x's amax is 7: no saturation); down: an
     * eighth of the first token's dynamic scale, so its larger h values saturate */
    {
        float qa[XH], sa[1], g[XI], u[XI];
        double dummy;
        ref_quantize(x, XH, 0, 0x1p-6f, qa, sa);
        for (int i = 0; i < XI; i++) {
            g[i] = (float)ref_gemm(k, qa, sa, e->gate, e->sg, XH, i, &dummy);
            u[i] = (float)ref_gemm(k, qa, sa, e->up, e->su, XH, i, &dummy);
        }
        moe_cpu_act_mul(MOE_ACTIVATION_SILU, g, u, hq, XI);
        float amax = 0.0f;
        for (int i = 0; i < XI; i++)
            amax = fmaxf(amax, fabsf(hq[i]));
        w.input_scale[2] = amax / 448.0f / 8.0f;
    }
    w.input_scale[0] = 0x1p-7f;
    w.input_scale[1] = 0x1p-6f;
    TU_OK(moe_cpu_mlp_w8a8(&w, MOE_ACTIVATION_SILU, x, XT, y));
    for (int t = 0; t < XT; t++) {
        const float stat[3] = {w.input_scale[0], w.input_scale[1], w.input_scale[2]};
        ref_mlp(k, e, x + t * XH, stat, ref + t * XH, bound + t * XH);
    }
    fprintf(stderr, "w8a8 static scales: worst |y - ref| / bound %.3g; vs dynamic %.3g\n",
            ratio_to_bound(y, ref, bound, XT * XH), tu_rel_err(ydyn, ref, XT * XH));
    assert_true(ratio_to_bound(y, ref, bound, XT * XH) <= 1.0);
    assert_true(tu_rel_err(ydyn, ref, XT * XH) > 1e-2); /* saturation changed the result */
    /* only one of gate/up static: dynamic for both */
    w.input_scale[0] = 0.0f;
    w.input_scale[2] = 0.0f;
    TU_OK(moe_cpu_mlp_w8a8(&w, MOE_ACTIVATION_SILU, x, XT, y));
    assert_memory_equal(y, ydyn, sizeof(y));
    free(e);
}

/* moe_layer_set_weight_with_input_scale, the public entry of static scales: a layer (E 2, k 1)
 * whose expert 0 has static scales on every matrix (gate 2^-7, up 2^-6: 2^-6 for GEMM 1; down 2^-9,
 * which saturates part of h) and expert 1 on gate alone (2^-8, which would saturate x: GEMM 1
 * stays dynamic by the pair rule) and down, against the reference above; then every refusal, each
 * naming what it refuses, and nothing kept by them. */
static void test_input_scale_api(void **state)
{
    const moe_scale_kind_t k = MOE_SCALE_PER_TENSOR;
    const float stat[2][3] = {{0x1p-7f, 0x1p-6f, 0x1p-9f}, {0x1p-8f, 0.0f, 0x1p-6f}};
    /* what the reference is given: GEMM 1's scale from gate and up by hand (expert 1: none) */
    const float want[2][3] = {{0x1p-6f, 0x1p-6f, 0x1p-9f}, {0.0f, 0.0f, 0x1p-6f}};
    const float wrong[3] = {0x1p-8f, 0x1p-8f, 0x1p-6f}; /* expert 1 with gate's scale used */
    uint64_t st = tu_seed("w8a8_input_scale_api");
    ref_expert_t *ex = malloc(sizeof(ref_expert_t) * 2);
    float x[XT * XH], y[XT * XH], ydyn[XT * XH], ref[XT * XH], logits[XT * 2];
    double bound[XT * XH];
    moe_layer_config_t c;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    moe_layer_t *l = NULL;
    (void)state;
    assert_true(ex != NULL);
    make_tokens(x, &st);
    c = two_experts(k, ex, logits, &st);
    c.fp8_math = MOE_FP8_MATH_W8A8;
    a.num_tokens = XT;
    a.dtype = MOE_DTYPE_F32;
    a.x = x;
    a.router_logits = logits;
    for (int with = 0; with < 2; with++) { /* dynamic (input scales 0), then static */
        TU_OK(moe_layer_create(tu_rt, &c, &l));
        for (int e = 0; e < 2; e++) {
            moe_tensor_t tg = fp8_tensor(k, XI, XH, ex[e].gate, ex[e].sg);
            moe_tensor_t tu = fp8_tensor(k, XI, XH, ex[e].up, ex[e].su);
            moe_tensor_t td = fp8_tensor(k, XH, XI, ex[e].down, ex[e].sd);
            TU_OK(moe_layer_set_weight_with_input_scale(l, MOE_WEIGHT_GATE_PROJ, e, &tg,
                                                        with ? stat[e][0] : 0.0f));
            TU_OK(moe_layer_set_weight_with_input_scale(l, MOE_WEIGHT_UP_PROJ, e, &tu,
                                                        with ? stat[e][1] : 0.0f));
            TU_OK(moe_layer_set_weight_with_input_scale(l, MOE_WEIGHT_DOWN_PROJ, e, &td,
                                                        with ? stat[e][2] : 0.0f));
        }
        for (int i = 0; i < XT * XH; i++)
            (with ? y : ydyn)[i] = NAN;
        a.y = with ? y : ydyn;
        TU_OK(moe_layer_forward(l, &a));
        if (with) { /* the refusals, on a layer whose weights are all set */
            moe_tensor_t tg = fp8_tensor(k, XI, XH, ex[0].gate, ex[0].sg);
            float y2[XT * XH];
            assert_int_equal(
                moe_layer_set_weight_with_input_scale(l, MOE_WEIGHT_ROUTER, -1, &tg, 0.5f),
                MOE_STATUS_INVALID_ARGUMENT);
            assert_non_null(strstr(moe_last_error(), "an input scale belongs"));
            assert_int_equal(
                moe_layer_set_weight_with_input_scale(l, MOE_WEIGHT_GATE_PROJ, 0, &tg, NAN),
                MOE_STATUS_NUMERIC_ERROR);
            assert_non_null(strstr(moe_last_error(), "GATE_PROJ: input_scale"));
            assert_int_equal(
                moe_layer_set_weight_with_input_scale(l, MOE_WEIGHT_GATE_PROJ, 0, &tg, -0.5f),
                MOE_STATUS_NUMERIC_ERROR);
            assert_non_null(strstr(moe_last_error(), "finite and > 0"));
            assert_int_equal(
                moe_layer_set_weight_with_input_scale(l, MOE_WEIGHT_GATE_PROJ, 0, &tg, 1e38f),
                MOE_STATUS_NUMERIC_ERROR);
            /* nothing was kept: the same output */
            a.y = y2;
            TU_OK(moe_layer_forward(l, &a));
            assert_memory_equal(y, y2, sizeof(y));
        }
        TU_OK(moe_layer_destroy(l));
    }
    for (int t = 0; t < XT; t++)
        ref_mlp(k, &ex[t % 2], x + t * XH, want[t % 2], ref + t * XH, bound + t * XH);
    {
        float r1[XH];
        double b1[XH], off;
        ref_mlp(k, &ex[1], x + XH, wrong, r1, b1);
        off = ratio_to_bound(y + XH, r1, b1, XH);
        fprintf(stderr,
                "input scales by the public entry: worst |y - ref| / bound %.3g; dynamic %.3g; "
                "token 1 against gate's scale used alone %.3g\n",
                ratio_to_bound(y, ref, bound, XT * XH), tu_rel_err(ydyn, ref, XT * XH), off);
        assert_true(off > 1.0); /* the pair rule is seen */
    }
    assert_true(ratio_to_bound(y, ref, bound, XT * XH) <= 1.0);
    assert_true(tu_rel_err(ydyn, ref, XT * XH) > 1e-3); /* the static scales were used */

    /* layers that never read one: per-channel or block weights, W8A16, bf16 (0 is still fine) */
    for (int bad = 0; bad < 4; bad++) {
        moe_layer_config_t b = c;
        uint8_t *q = ex[0].gate;
        float sc[XI];
        moe_tensor_t t = fp8_tensor(k, XI, XH, q, ex[0].sg);
        if (bad == 0)
            b.scale_kind = MOE_SCALE_PER_CHANNEL;
        else if (bad == 1)
            b.scale_kind = MOE_SCALE_BLOCK_128;
        else if (bad == 2)
            b.fp8_math = MOE_FP8_MATH_W8A16;
        else {
            b.weight_dtype = MOE_DTYPE_BF16;
            b.scale_kind = MOE_SCALE_NONE;
            b.fp8_math = MOE_FP8_MATH_AUTO;
        }
        if (b.scale_kind != MOE_SCALE_PER_TENSOR) { /* the tensor's own scales in that kind */
            for (int i = 0; i < XI; i++)
                sc[i] = ex[0].sg[0];
            t = fp8_tensor(b.scale_kind == MOE_SCALE_NONE ? k : b.scale_kind, XI, XH, q, sc);
        }
        TU_OK(moe_layer_create(tu_rt, &b, &l));
        assert_int_equal(moe_layer_set_weight_with_input_scale(l, MOE_WEIGHT_UP_PROJ, 1, &t, 0.5f),
                         MOE_STATUS_INVALID_ARGUMENT);
        assert_non_null(strstr(moe_last_error(), "UP_PROJ: input_scale = 0.5"));
        assert_non_null(strstr(moe_last_error(), "per-tensor FP8 weights only"));
        TU_OK(moe_layer_set_weight_with_input_scale(l, MOE_WEIGHT_UP_PROJ, 1, &t, 0.0f));
        TU_OK(moe_layer_destroy(l));
    }
    free(ex);
}

/* ------------------------------------------------------------------------------------------ */
/* W8A8 vs W8A16 of the same layer                                                             */
/* ------------------------------------------------------------------------------------------ */

/* y[T, H] (f32 of the bf16 output) = the layer `c` on T tokens of moe_gen_tokens(seed + 1) in
 * bf16, weights from moe_gen_set_weights(seed) (`static_scales`: moe_gen_set_weights_static). */
static void run_gen_layer(moe_layer_config_t c, int64_t T, uint64_t seed, int static_scales,
                          float *y)
{
    const int64_t H = c.hidden;
    float *x = malloc(sizeof(float) * (size_t)(T * H));
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)(T * H));
    uint16_t *yb = malloc(sizeof(uint16_t) * (size_t)(T * H));
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    assert_true(x && xb && yb);
    moe_gen_tokens(seed + 1, 0, T, (int)H, x);
    moe_convert_from_f32(MOE_DTYPE_BF16, x, xb, (size_t)(T * H));
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    if (static_scales)
        TU_OK(moe_gen_set_weights_static(l, &c, seed));
    else
        TU_OK(moe_gen_set_weights(l, &c, seed));
    a.num_tokens = T;
    a.dtype = MOE_DTYPE_BF16;
    a.x = xb;
    a.y = yb;
    for (int64_t i = 0; i < T * H; i++)
        yb[i] = 0x7fc0; /* bf16 NaN: every element must be written */
    TU_OK(moe_layer_forward(l, &a));
    moe_convert_to_f32(MOE_DTYPE_BF16, yb, y, (size_t)(T * H));
    TU_OK(moe_layer_destroy(l));
    free(x);
    free(xb);
    free(yb);
}

static double w8a8_vs_w8a16(moe_layer_config_t c, int64_t T, uint64_t seed)
{
    const int64_t H = c.hidden;
    float *y8 = malloc(sizeof(float) * (size_t)(T * H));
    float *y16 = malloc(sizeof(float) * (size_t)(T * H));
    double err;
    assert_true(y8 && y16);
    c.fp8_math = MOE_FP8_MATH_W8A8;
    run_gen_layer(c, T, seed, 0, y8);
    c.fp8_math = MOE_FP8_MATH_W8A16;
    run_gen_layer(c, T, seed, 0, y16);
    err = tu_rel_err(y8, y16, T * H);
    free(y8);
    free(y16);
    return err;
}

/* The bound. W8A8 and W8A16 share the stored FP8 weights: they differ only by the two activation
 * quantisations. Rounding to e4m3 (3 mantissa bits) errs by at most 2^-4 of a value and, over a
 * binade, by ~0.024 of it in RMS. Three independent errors reach the output: x's (through both
 * gate and up, whose weights differ) and h's, each of about that size relative to what it feeds,
 * and with many terms per sum the norm-wise relative error of a sum is about the RMS relative
 * error of its terms: sqrt(3) * 0.024 ~ 0.042, as measured (0.042-0.044). 0.06 leaves room for
 * other seeds; a missing scale or a wrong group would be a factor off, and the exact test above
 * checks the arithmetic itself. The lower bound: activations really were quantised. */
static void test_w8a8_vs_w8a16(void **state)
{
    static const moe_scale_kind_t kinds[3] = {MOE_SCALE_PER_TENSOR, MOE_SCALE_PER_CHANNEL,
                                              MOE_SCALE_BLOCK_128};
    static const int shapes[2][2] = {{256, 384}, {320, 208}}; /* H, I: full and partial blocks */
    uint64_t seed = tu_seed("w8a8_vs_w8a16");
    (void)state;
    for (int s = 0; s < 2; s++)
        for (int ki = 0; ki < 3; ki++) {
            moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
            double err;
            c.num_experts = 8;
            c.top_k = 2;
            c.hidden = shapes[s][0];
            c.intermediate = shapes[s][1];
            c.num_shared_experts = 1; /* the shared MLP is FP8 and W8A8 too */
            c.max_tokens_per_rank = 32;
            c.weight_dtype = MOE_DTYPE_FP8_E4M3;
            c.scale_kind = kinds[ki];
            err = w8a8_vs_w8a16(c, 29, seed + (uint64_t)(s * 3 + ki));
            fprintf(stderr, "W8A8 vs W8A16, H %d I %d scale kind %d: rel. error %.4f\n", c.hidden,
                    c.intermediate, (int)c.scale_kind, err);
            assert_true(err < 0.06);
            assert_true(err > 1e-3); /* activations were quantised */
        }
}

/* The GEMM1 input's static scale from gate's and up's (the rule the CPU reference and the CUDA
 * backend share): the larger when both are > 0, else dynamic (0). */
static void test_pair_static_scale(void **state)
{
    (void)state;
    assert_true(moe_fp8_pair_static_scale(0x1p-7f, 0x1p-6f) == 0x1p-6f);
    assert_true(moe_fp8_pair_static_scale(0x1p-6f, 0x1p-7f) == 0x1p-6f);
    assert_true(moe_fp8_pair_static_scale(0.5f, 0.5f) == 0.5f);
    assert_true(moe_fp8_pair_static_scale(0.0f, 0.5f) == 0.0f);
    assert_true(moe_fp8_pair_static_scale(0.5f, 0.0f) == 0.0f);
    assert_true(moe_fp8_pair_static_scale(0.0f, 0.0f) == 0.0f);
    assert_true(moe_fp8_pair_static_scale(NAN, 0.5f) == 0.0f);
    assert_true(moe_fp8_pair_static_scale(0.5f, NAN) == 0.0f);
    assert_true(moe_fp8_pair_static_scale(-1.0f, 0.5f) == 0.0f);
}

/* The generator's static activation scales (moe_gen_set_weights_static, what the GPU test
 * compares the CUDA backend on): some experts' GEMM inputs static, some dynamic, by the rule in
 * layer_gen.h; a per-tensor W8A8 layer uses them (its output moves, within the W8A8 bound of
 * W8A16), W8A16 and per-channel layers ignore them (bitwise the same output). */
static void test_gen_static_scales(void **state)
{
    enum { T = 29 };
    uint64_t seed = tu_seed("w8a8_gen_static");
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    float *ys, *yd, *y16;
    double moved, err;
    int e, n13 = 0, n2 = 0;
    (void)state;
    for (e = 0; e < 8; e++) {
        const float g = moe_gen_input_scale(seed, MOE_WEIGHT_GATE_PROJ, e);
        const float u = moe_gen_input_scale(seed, MOE_WEIGHT_UP_PROJ, e);
        const float d = moe_gen_input_scale(seed, MOE_WEIGHT_DOWN_PROJ, e);
        assert_true(g * 448.0f >= 1.0f && g * 448.0f < 1.25f);
        assert_true(u == 0.0f ? e % 4 == 3 : u * 448.0f >= 1.0f && u * 448.0f < 1.25f);
        assert_true(d == 0.0f ? e % 3 == 1 : d * 448.0f >= 10.0f && d * 448.0f < 14.0f);
        n13 += moe_fp8_pair_static_scale(g, u) > 0.0f;
        n2 += d > 0.0f;
    }
    assert_int_equal(n13, 6); /* experts 3 and 7 dynamic */
    assert_int_equal(n2, 5);  /* experts 1, 4 and 7 dynamic */
    assert_true(moe_gen_input_scale(seed, MOE_WEIGHT_SHARED_UP_PROJ, -1) > 0.0f);
    assert_true(moe_gen_input_scale(seed, MOE_WEIGHT_SHARED_DOWN_PROJ, -1) > 0.0f);
    assert_true(moe_gen_input_scale(seed, MOE_WEIGHT_ROUTER, -1) == 0.0f);

    c.num_experts = 8;
    c.top_k = 2;
    c.hidden = 256;
    c.intermediate = 384;
    c.num_shared_experts = 1;
    c.max_tokens_per_rank = 32;
    c.weight_dtype = MOE_DTYPE_FP8_E4M3;
    c.scale_kind = MOE_SCALE_PER_TENSOR;
    ys = malloc(sizeof(float) * T * 256);
    yd = malloc(sizeof(float) * T * 256);
    y16 = malloc(sizeof(float) * T * 256);
    assert_true(ys && yd && y16);
    c.fp8_math = MOE_FP8_MATH_W8A8;
    run_gen_layer(c, T, seed, 1, ys);
    run_gen_layer(c, T, seed, 0, yd);
    c.fp8_math = MOE_FP8_MATH_W8A16;
    run_gen_layer(c, T, seed, 0, y16);
    moved = tu_rel_err(ys, yd, T * 256);
    err = tu_rel_err(ys, y16, T * 256);
    fprintf(stderr, "generator's static scales, W8A8 per-tensor: vs dynamic %.4f, vs W8A16 %.4f\n",
            moved, err);
    assert_true(moved > 1e-3);        /* the static scales were used */
    assert_true(err < 0.06);          /* test_w8a8_vs_w8a16's bound */
    run_gen_layer(c, T, seed, 1, ys); /* W8A16 computes as without them */
    assert_memory_equal(ys, y16, sizeof(float) * T * 256);
    c.scale_kind = MOE_SCALE_PER_CHANNEL; /* so do per-channel weights (the generator gives none) */
    c.fp8_math = MOE_FP8_MATH_W8A8;
    run_gen_layer(c, T, seed, 1, ys);
    run_gen_layer(c, T, seed, 0, yd);
    assert_memory_equal(ys, yd, sizeof(float) * T * 256);
    free(ys);
    free(yd);
    free(y16);
}

/* Config: fp8_math values named; W8A8 needs FP8 weights; W8A16 and AUTO are fine anywhere. */
static void test_config(void **state)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    moe_layer_t *l = NULL;
    (void)state;
    c.num_experts = 4;
    c.top_k = 2;
    c.hidden = 128;
    c.intermediate = 128;
    c.max_tokens_per_rank = 4;
    c.fp8_math = (moe_fp8_math_t)4;
    assert_int_equal(moe_layer_create(tu_rt, &c, &l), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "fp8_math = 4"));
    assert_non_null(strstr(moe_last_error(), "W8A8_FAST 3"));
    c.fp8_math = MOE_FP8_MATH_W8A8; /* BF16 weights */
    assert_int_equal(moe_layer_create(tu_rt, &c, &l), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "MOE_FP8_MATH_W8A8 needs weight_dtype FP8_E4M3"));
    c.fp8_math = MOE_FP8_MATH_W8A8_FAST;
    assert_int_equal(moe_layer_create(tu_rt, &c, &l), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(
        strstr(moe_last_error(), "MOE_FP8_MATH_W8A8_FAST needs weight_dtype FP8_E4M3 (got bf16)"));
    c.fp8_math = MOE_FP8_MATH_W8A16;
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    TU_OK(moe_layer_destroy(l));
    c.weight_dtype = MOE_DTYPE_FP8_E4M3;
    c.scale_kind = MOE_SCALE_BLOCK_128;
    c.fp8_math = MOE_FP8_MATH_W8A8;
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    TU_OK(moe_layer_destroy(l));
    c.fp8_math = MOE_FP8_MATH_W8A8_FAST; /* block scales: W8A8 */
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    TU_OK(moe_layer_destroy(l));
}

/* W8A8_FAST on the CPU backend: W8A8's numbers, bitwise (its f32 sums are what the GPU's
 * promotion approximates), for every scale kind, with a shared MLP; and not W8A16's. */
static void test_fast_accum_cpu_is_w8a8(void **state)
{
    static const moe_scale_kind_t kinds[3] = {MOE_SCALE_PER_TENSOR, MOE_SCALE_PER_CHANNEL,
                                              MOE_SCALE_BLOCK_128};
    const uint64_t seed = tu_seed("w8a8_fast_cpu");
    enum { T = 13, H = 256 };
    float *y8 = malloc(sizeof(float) * T * H), *yf = malloc(sizeof(float) * T * H);
    float *y16 = malloc(sizeof(float) * T * H);
    (void)state;
    assert_true(y8 && yf && y16);
    for (int ki = 0; ki < 3; ki++) {
        moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
        c.num_experts = 8;
        c.top_k = 2;
        c.hidden = H;
        c.intermediate = 384;
        c.num_shared_experts = 1;
        c.max_tokens_per_rank = T;
        c.weight_dtype = MOE_DTYPE_FP8_E4M3;
        c.scale_kind = kinds[ki];
        c.fp8_math = MOE_FP8_MATH_W8A8;
        run_gen_layer(c, T, seed + (uint64_t)ki, 0, y8);
        c.fp8_math = MOE_FP8_MATH_W8A8_FAST;
        run_gen_layer(c, T, seed + (uint64_t)ki, 0, yf);
        c.fp8_math = MOE_FP8_MATH_W8A16;
        run_gen_layer(c, T, seed + (uint64_t)ki, 0, y16);
        assert_memory_equal(y8, yf, sizeof(float) * T * H);
        assert_true(tu_rel_err(yf, y16, T * H) > 1e-3); /* activations quantised */
    }
    free(y8);
    free(yf);
    free(y16);
}

/* Scales at set time: an FP8 tensor's block scale of +Inf is refused (naming it); an f32 matrix
 * of values so small that amax / 448 underflows quantises to zeros (scale 1), not to NaN. */
static void test_set_time_scales(void **state)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    moe_layer_t *l = NULL;
    enum { H = 256, I = 256 };
    uint8_t *q = calloc((size_t)I * H, 1);
    float *v = malloc(sizeof(float) * (size_t)I * H), sb[4] = {1, 1, INFINITY, 1};
    float x[H], y[H];
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    moe_tensor_t t = {MOE_DTYPE_FP8_E4M3, I, H, q, sb, 2, 2};
    (void)state;
    assert_true(q && v);
    c.num_experts = 2;
    c.top_k = 1;
    c.hidden = H;
    c.intermediate = I;
    c.max_tokens_per_rank = 1;
    c.weight_dtype = MOE_DTYPE_FP8_E4M3;
    c.scale_kind = MOE_SCALE_BLOCK_128;
    c.fp8_math = MOE_FP8_MATH_W8A8;
    TU_OK(moe_layer_create(tu_rt, &c, &l));
    assert_int_equal(moe_layer_set_weight(l, MOE_WEIGHT_GATE_PROJ, 1, &t),
                     MOE_STATUS_NUMERIC_ERROR);
    assert_non_null(strstr(moe_last_error(), "GATE_PROJ of expert 1: scale [1, 0] is inf"));
    for (int i = 0; i < I * H; i++)
        v[i] = (i % 3 - 1) * 1e-44f; /* subnormal: 1e-44 / 448 is 0 in f32 */
    t = (moe_tensor_t){MOE_DTYPE_F32, I, H, v, NULL, 0, 0};
    for (int e = 0; e < 2; e++)
        for (int k = MOE_WEIGHT_GATE_PROJ; k <= MOE_WEIGHT_DOWN_PROJ; k++)
            TU_OK(moe_layer_set_weight(l, (moe_weight_kind_t)k, e, &t));
    for (int i = 0; i < H; i++)
        x[i] = 1.0f, y[i] = NAN;
    a.num_tokens = 1;
    a.x = x;
    a.y = y;
    a.router_logits = (const float[]){1.0f, 0.0f};
    TU_OK(moe_layer_forward(l, &a));
    for (int i = 0; i < H; i++)
        assert_true(y[i] == 0.0f);
    TU_OK(moe_layer_destroy(l));
    free(q);
    free(v);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_e4m3_quantize),        cmocka_unit_test(test_quantize_rows),
        cmocka_unit_test(test_matmul_hand_computed), cmocka_unit_test(test_layer_vs_independent),
        cmocka_unit_test(test_static_scales),        cmocka_unit_test(test_input_scale_api),
        cmocka_unit_test(test_w8a8_vs_w8a16),        cmocka_unit_test(test_pair_static_scale),
        cmocka_unit_test(test_gen_static_scales),    cmocka_unit_test(test_config),
        cmocka_unit_test(test_set_time_scales),      cmocka_unit_test(test_fast_accum_cpu_is_w8a8),
    };
    return cmocka_run_group_tests(tests, tu_group_setup_cpu, tu_group_teardown);
}
