/* SPDX-License-Identifier: Apache-2.0 */
/* The CPU reference's products on several threads (kernels/cpu/parallel.c): every row range
 * once, the thread count from MOE_CPU_THREADS, and bitwise the single-thread outputs of the bf16,
 * W8A8 (per-channel and 128 x 128 blocks) and tree-reduced (a TP slice) products, and of whole
 * layers whose experts go over threads (many small ones) or one after another (few large); the
 * products' several-row dots (moe_cpu_dot_rows) bitwise moe_cpu_dot. */
#include "testutil.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/moe_cpu.h"
#include "base/numeric.h"
#include "launch/layer_gen.h"

static void set_threads(const char *v)
{
    if (v)
        setenv("MOE_CPU_THREADS", v, 1);
    else
        unsetenv("MOE_CPU_THREADS");
}

/* MOE_CPU_THREADS: a count from 1 to 64 where set and valid; else (unset, 0, or a bad value, said
 * once) the host's share (at least 1) */
static void test_thread_count(void **state)
{
    int dflt;
    (void)state;
    set_threads(NULL);
    dflt = moe_cpu_threads();
    assert_true(dflt >= 1 && dflt <= 64);
    set_threads("5");
    assert_int_equal(moe_cpu_threads(), 5);
    set_threads("64");
    assert_int_equal(moe_cpu_threads(), 64);
    set_threads("65");
    assert_int_equal(moe_cpu_threads(), dflt);
    set_threads("0");
    assert_int_equal(moe_cpu_threads(), dflt);
    set_threads("3x");
    assert_int_equal(moe_cpu_threads(), dflt);
    set_threads("-2");
    assert_int_equal(moe_cpu_threads(), dflt);
    /* two ranks on the host: half the CPUs each, unless this process is bound to a share */
    set_threads(NULL);
    moe_cpu_set_host_ranks(2);
    {
        const int two = moe_cpu_threads();
        assert_true(two == (dflt / 2 > 0 ? dflt / 2 : 1) || two == dflt);
    }
    moe_cpu_set_host_ranks(1);
    assert_int_equal(moe_cpu_threads(), dflt);
}

typedef struct visits {
    int *count;
    size_t scratch;
    atomic_int ranges;
} visits_t;

static void visit(void *arg, int64_t r0, int64_t r1, float *scratch)
{
    const visits_t *v = arg;
    for (size_t i = 0; i < v->scratch; i++) /* the scratch is this range's own */
        scratch[i] = (float)r0;
    for (int64_t r = r0; r < r1; r++)
        v->count[r]++; /* distinct rows per range: no two threads write one */
    atomic_fetch_add((atomic_int *)&v->ranges, 1);
    for (size_t i = 0; i < v->scratch; i++)
        assert_true(scratch[i] == (float)r0);
}

/* Every row once, whatever the threads, rows and work; small work one range (on the caller),
 * large work min(threads, rows) ranges */
static void test_every_row_once(void **state)
{
    static const char *const threads[] = {"1", "2", "3", "7", "64"};
    int count[40];
    (void)state;
    for (size_t t = 0; t < sizeof(threads) / sizeof(threads[0]); t++) {
        set_threads(threads[t]);
        for (int64_t rows = 0; rows <= 40; rows += rows < 8 ? 1 : 11)
            for (int big = 0; big < 2; big++) {
                visits_t v = {count, 33, 0};
                const int nt = atoi(threads[t]);
                memset(count, 0, sizeof(count));
                TU_OK(moe_cpu_for_rows(rows, big ? 1e9 : 100.0, v.scratch, visit, &v, "test"));
                for (int64_t r = 0; r < 40; r++)
                    assert_int_equal(count[r], r < rows ? 1 : 0);
                assert_int_equal(atomic_load(&v.ranges), rows == 0   ? 0
                                                         : !big      ? 1
                                                         : rows < nt ? (int)rows
                                                                     : nt);
            }
    }
    set_threads(NULL);
}

/* Shapes past the threads' work bound (2^22 multiply-adds), odd sizes */
enum { N = 19, K = 1152, R = 520 };

static void fill_e4m3(uint8_t *q, size_t n, uint64_t *st)
{
    float *v = malloc(sizeof(float) * n);
    assert_non_null(v);
    tu_fill_uniform(v, (int64_t)n, -3.0f, 3.0f, st);
    for (size_t i = 0; i < n; i++)
        q[i] = moe_fp8e4m3_quantize(v[i], 1.0f);
    free(v);
}

/* f(...) with 1 thread and with 2, 3 and 8: the same bits */
#define SAME_AT_EVERY_COUNT(out, n, call)                                                          \
    do {                                                                                           \
        static const char *const counts_[] = {"2", "3", "8"};                                      \
        float *one_ = malloc(sizeof(float) * (size_t)(n));                                         \
        assert_non_null(one_);                                                                     \
        set_threads("1");                                                                          \
        TU_OK(call);                                                                               \
        memcpy(one_, out, sizeof(float) * (size_t)(n));                                            \
        for (size_t c_ = 0; c_ < 3; c_++) {                                                        \
            set_threads(counts_[c_]);                                                              \
            memset(out, 0xff, sizeof(float) * (size_t)(n)); /* NaN: every element written */       \
            TU_OK(call);                                                                           \
            assert_memory_equal(out, one_, sizeof(float) * (size_t)(n));                           \
        }                                                                                          \
        free(one_);                                                                                \
        set_threads(NULL);                                                                         \
    } while (0)

static void test_products_bitwise(void **state)
{
    uint64_t st = tu_seed("cpu_threads");
    float *x = malloc(sizeof(float) * N * K), *y = malloc(sizeof(float) * N * R);
    float *wf = malloc(sizeof(float) * R * K), *sa = malloc(sizeof(float) * N * (K / 128));
    uint16_t *wb = malloc(sizeof(uint16_t) * R * K);
    uint8_t *qa = malloc((size_t)N * K), *qw = malloc((size_t)R * K);
    float sch[R], sblk[((R + 127) / 128) * (K / 128)];
    (void)state;
    assert_true(x && y && wf && sa && wb && qa && qw);
    tu_fill_uniform(x, N * K, -1.0f, 1.0f, &st);
    tu_fill_uniform(wf, R * K, -0.05f, 0.05f, &st);
    moe_convert_from_f32(MOE_DTYPE_BF16, wf, wb, (size_t)R * K);
    tu_fill_uniform(sa, N * (K / 128), 0.01f, 0.02f, &st);
    tu_fill_uniform(sch, R, 0.001f, 0.002f, &st);
    tu_fill_uniform(sblk, (int64_t)(sizeof(sblk) / sizeof(sblk[0])), 0.001f, 0.002f, &st);
    fill_e4m3(qa, (size_t)N * K, &st);
    fill_e4m3(qw, (size_t)R * K, &st);
    {
        const moe_cpu_matrix_t m = {MOE_DTYPE_BF16, MOE_SCALE_NONE, R, K, wb, NULL};
        SAME_AT_EVERY_COUNT(y, N * R, moe_cpu_matmul_nt(x, N, &m, y));
    }
    {
        const moe_cpu_matrix_t m = {MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL, R, K, qw, sch};
        SAME_AT_EVERY_COUNT(y, N * R, moe_cpu_matmul_w8a8(qa, sa, N, &m, y));
    }
    {
        const moe_cpu_matrix_t m = {MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128, R, K, qw, sblk};
        SAME_AT_EVERY_COUNT(y, N * R, moe_cpu_matmul_w8a8(qa, sa, N, &m, y));
    }
    {
        /* an MLP slice [512, 1024) of I = 2048 (aligned: the tree down projection) over H = R */
        enum { H = R, IS = 512 };
        moe_cpu_mlp_t w;
        float *xh = malloc(sizeof(float) * N * H), *out = malloc(sizeof(float) * N * H);
        assert_true(xh && out);
        tu_fill_uniform(xh, N * H, -1.0f, 1.0f, &st);
        memset(&w, 0, sizeof(w));
        w.gate = (moe_cpu_matrix_t){MOE_DTYPE_BF16, MOE_SCALE_NONE, IS, H, wb, NULL};
        w.up = (moe_cpu_matrix_t){MOE_DTYPE_BF16, MOE_SCALE_NONE, IS, H, wb + IS * H, NULL};
        w.down = (moe_cpu_matrix_t){MOE_DTYPE_BF16, MOE_SCALE_NONE, H, IS, wb, NULL};
        w.slice_begin = 512;
        w.full_intermediate = 2048;
        SAME_AT_EVERY_COUNT(out, N * H, moe_cpu_mlp(&w, MOE_ACTIVATION_SILU, xh, N, out));
        free(xh);
        free(out);
    }
    free(x);
    free(y);
    free(wf);
    free(sa);
    free(wb);
    free(qa);
    free(qw);
}

/* moe_cpu_dot_rows (AVX where the CPU has it), its portable form and moe_cpu_dots: each row's
 * sum bitwise moe_cpu_dot's, at every length 0 .. 70 and past (the tails, the all-tail short
 * products of the down projection's leaves), with a row stride past the length. */
static void test_dot_rows_bitwise(void **state)
{
    enum { LDA = 1031, ROWS = 9 };
    uint64_t st = tu_seed("cpu_dot_rows");
    float *a = malloc(sizeof(float) * LDA * ROWS), *b = malloc(sizeof(float) * LDA);
    float want[ROWS], got[ROWS], got2[MOE_CPU_DOT_ROWS], strided[ROWS * 3];
    static const int64_t big[] = {127, 128, 129, 1000, 1031};
    (void)state;
    assert_non_null(a);
    assert_non_null(b);
    tu_fill_uniform(a, LDA * ROWS, -3.0f, 3.0f, &st);
    tu_fill_uniform(b, LDA, -2.0f, 2.0f, &st);
    for (int64_t k = 0; k < 70 + 5; k++) {
        const int64_t n = k < 70 ? k : big[k - 70];
        for (int t = 0; t < ROWS; t++)
            want[t] = moe_cpu_dot(a + t * LDA, b, n);
        moe_cpu_dot_rows(a, LDA, b, n, got);
        moe_cpu_dot_rows_portable(a, LDA, b, n, got2);
        assert_memory_equal(got, want, sizeof(float) * MOE_CPU_DOT_ROWS);
        assert_memory_equal(got2, want, sizeof(float) * MOE_CPU_DOT_ROWS);
        for (int64_t rows = 0; rows <= ROWS; rows++) {
            memset(strided, 0xff, sizeof(strided));
            moe_cpu_dots(a, LDA, rows, b, n, strided, 3);
            for (int64_t t = 0; t < ROWS; t++)
                if (t < rows)
                    assert_memory_equal(&strided[t * 3], &want[t], sizeof(float));
                else
                    assert_true(isnan(strided[t * 3])); /* nothing past the rows written */
        }
    }
    assert_int_equal(moe_cpu_token_block(1024), 64);
    assert_int_equal(moe_cpu_token_block(256), 256);
    assert_int_equal(moe_cpu_token_block(14336), 64);
    assert_int_equal(moe_cpu_token_block(0) % MOE_CPU_DOT_ROWS, 0);
    free(a);
    free(b);
}

/* The generator's matrices (launch/layer_gen.c, on the same threads): the same values */
static void test_generator_bitwise(void **state)
{
    enum { GR = 600, GC = 1000 };
    float *m = malloc(sizeof(float) * GR * GC);
    moe_status_t ok = MOE_STATUS_SUCCESS;
    (void)state;
    assert_non_null(m);
    SAME_AT_EVERY_COUNT(m, GR * GC,
                        (moe_gen_matrix(7, MOE_WEIGHT_GATE_PROJ, 3, 100, GR, 40, GC, 2048, m), ok));
    free(m);
}

/* One forward of T tokens (weights and tokens from seed) into y */
static moe_status_t layer_forward(const moe_layer_config_t *c, int64_t T, uint64_t seed, float *y)
{
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    float *x = malloc(sizeof(float) * (size_t)(T * c->hidden));
    moe_status_t st;
    assert_non_null(x);
    TU_OK(moe_layer_create(tu_rt, c, &l));
    TU_OK(moe_gen_set_weights(l, c, seed));
    moe_gen_tokens(seed + 1, 0, T, (int)c->hidden, x);
    a.num_tokens = T;
    a.dtype = MOE_DTYPE_F32;
    a.x = x;
    a.y = y;
    st = moe_layer_forward(l, &a);
    TU_OK(moe_layer_destroy(l));
    free(x);
    return st;
}

static void test_layers_bitwise(void **state)
{
    static const struct {
        int E, k, H, I, shared;
        int64_t T;
        moe_dtype_t wt;
    } shapes[] = {
        {64, 8, 256, 96, 0, 48, MOE_DTYPE_BF16},        /* many small experts: over threads */
        {64, 8, 256, 128, 256, 48, MOE_DTYPE_FP8_E4M3}, /* the same, W8A8 block, a shared MLP */
        {4, 2, 512, 1024, 0, 40, MOE_DTYPE_BF16}, /* few large ones: their products on threads */
    };
    uint64_t seed = tu_seed("cpu_threads_layer");
    (void)state;
    for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++) {
        moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
        const int64_t n = shapes[i].T * shapes[i].H;
        float *y = malloc(sizeof(float) * (size_t)n);
        assert_non_null(y);
        c.num_experts = shapes[i].E;
        c.top_k = shapes[i].k;
        c.hidden = shapes[i].H;
        c.intermediate = shapes[i].I;
        c.num_shared_experts = shapes[i].shared > 0;
        c.shared_intermediate = shapes[i].shared;
        c.weight_dtype = shapes[i].wt;
        if (shapes[i].wt == MOE_DTYPE_FP8_E4M3) {
            c.scale_kind = MOE_SCALE_BLOCK_128;
            c.fp8_math = MOE_FP8_MATH_W8A8;
        }
        c.max_tokens_per_rank = shapes[i].T;
        SAME_AT_EVERY_COUNT(y, n, layer_forward(&c, shapes[i].T, seed, y));
        free(y);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_thread_count),     cmocka_unit_test(test_every_row_once),
        cmocka_unit_test(test_products_bitwise), cmocka_unit_test(test_generator_bitwise),
        cmocka_unit_test(test_layers_bitwise),   cmocka_unit_test(test_dot_rows_bitwise),
    };
    return cmocka_run_group_tests(tests, tu_group_setup_cpu, tu_group_teardown);
}
