/* SPDX-License-Identifier: Apache-2.0 */
/* GPU e4m3 activation quantisation (the W8A8 path's moe_quant_rows_launch) against the CPU
 * reference (moe_cpu_fp8_quantize_rows): per row and per 1 x 128 group, bf16 and f32 input,
 * rows of zeros, NaN, values that saturate at +-448 under a static scale, static scales per
 * expert through the block table (experts with 0 and padding blocks dynamic), a partial last
 * group, rows past *num_blocks left alone, the permute's gather fused in (rows from their
 * tokens, padding rows zero, f32 x rounded to bf16 first); every case again with each row's
 * (group's) maximum given (the one-pass form h's quantisation takes when GEMM 1's epilogue found
 * the maxima), and the first pass zeroing the next GEMM's maxima on its rows only; outputs
 * poisoned first. Codes and scales must be equal. */
#include "gpu_test.h"

#include "kernels/cpu/moe_cpu.h"
#include "kernels/quant.h"

/* Block b's expert in the static cases: every block expert 0 with one expert, else a spread
 * over -1 (padding) .. num_experts - 1. */
static int32_t block_expert_of(int64_t b, int num_experts)
{
    return num_experts == 1 ? 0 : (int32_t)((b * 5 + 2) % (num_experts + 1)) - 1;
}

/* Codes and scales that differ from the reference (rows < used), or from the poison (rows past
 * it: left alone). */
static int64_t count_bad(const uint8_t *got, const uint8_t *want, const float *gs, const float *ws,
                         int64_t rows, int cols, int ng, int64_t used)
{
    int64_t r, i, bad = 0;
    for (r = 0; r < rows; r++) {
        for (i = 0; i < cols; i++) {
            const uint8_t g = got[r * cols + i];
            bad += r < used ? g != want[r * cols + i] : g != 0x55;
        }
        for (i = 0; i < ng; i++) {
            uint32_t bits;
            memcpy(&bits, &gs[r * ng + i], 4);
            bad += r < used ? gs[r * ng + i] != ws[r * ng + i] : bits != 0xffffffffu;
        }
    }
    return bad;
}

/* One case: rows x cols of random values (scaled by 10^(row % 5 - 2)), a few specials.
 * static_scale (NULL: none): device-side scales of num_experts experts, row r's expert given by
 * block_expert_of(r / block_rows); the CPU reference quantises each row with its expert's scale
 * (0 and padding blocks: dynamic). */
static void check_quant(int64_t rows, int cols, int group, moe_dtype_t dtype,
                        const float *static_scale, int num_experts, int used_blocks, int block_rows)
{
    const int64_t n = rows * cols, nb = (rows + block_rows - 1) / block_rows;
    const int ng = group ? (cols + group - 1) / group : 1;
    const int64_t used = used_blocks >= 0 ? (int64_t)used_blocks * block_rows : rows;
    int32_t *be = malloc(sizeof(int32_t) * (size_t)(nb + 1)), *dbe = NULL;
    int nstatic = 0;
    float *x = malloc(sizeof(float) * (size_t)(n + 1));
    uint16_t *xb = malloc(2 * (size_t)(n + 1));
    uint8_t *want = malloc((size_t)(n + 1)), *got = malloc((size_t)(n + 1));
    float *ws = malloc(sizeof(float) * (size_t)(rows * ng + 1));
    float *gs = malloc(sizeof(float) * (size_t)(rows * ng + 1));
    void *dx;
    uint8_t *dq;
    float *dscale, *dstatic = NULL;
    int32_t *dnb = NULL;
    int64_t r, i, bad = 0;

    gt_fill_bf16(x, xb, (size_t)n, 1.0f);
    for (r = 0; r < rows; r++)
        for (i = 0; i < cols; i++) {
            float v = x[r * cols + i] * powf(10.0f, (float)(r % 5) - 2.0f);
            if (r % 7 == 3) /* a row of zeros */
                v = 0.0f;
            if (r % 11 == 5 && i == cols / 2)
                v = NAN;
            x[r * cols + i] = moe_bf16_to_f32(moe_f32_to_bf16(v)); /* bf16-exact either way */
            xb[r * cols + i] = moe_f32_to_bf16(v);
        }
    for (i = 0; i < nb; i++)
        be[i] = block_expert_of(i, num_experts);
    for (r = 0; r < used; r++) { /* row by row: each with its expert's static scale or none */
        const int32_t e = static_scale ? be[r / block_rows] : -1;
        const float st = e >= 0 ? static_scale[e] : 0.0f;
        nstatic += st > 0.0f;
        moe_cpu_fp8_quantize_rows(x + r * cols, 1, cols, group, st, want + r * cols, ws + r * ng);
    }
    dx = dtype == MOE_DTYPE_BF16 ? gt_dup(xb, 2 * (size_t)n) : gt_dup(x, 4 * (size_t)n);
    dq = gt_dalloc((size_t)n);
    dscale = gt_dalloc(sizeof(float) * (size_t)(rows * ng));
    gt_poison(dq, 0x55, (size_t)n);
    gt_poison(dscale, 0xff, sizeof(float) * (size_t)(rows * ng));
    if (static_scale) {
        dstatic = gt_dup(static_scale, sizeof(float) * (size_t)num_experts);
        dbe = gt_dup(be, sizeof(int32_t) * (size_t)nb);
    }
    if (used_blocks >= 0)
        dnb = gt_dup(&used_blocks, sizeof(int32_t));
    /* the pass that finds each maximum, zeroing a next GEMM's maxima on its rows (3 a row) */
    float *dzero = gt_dalloc(sizeof(float) * (size_t)(rows * 3));
    float *zero = malloc(sizeof(float) * (size_t)(rows * 3));
    int64_t bad_zero = 0, bad_known;
    gt_poison(dzero, 0xff, sizeof(float) * (size_t)(rows * 3));
    {
        moe_quant_rows_args_t a = {dx,  dtype, rows,   dnb,   block_rows, cols, dstatic,
                                   dbe, dq,    dscale, group, NULL,       0};
        a.zero_amax = dzero;
        a.zero_cols = 3;
        gt_ok(moe_quant_rows_launch(&a, NULL), "quant rows");
    }
    gt_get(got, dq, (size_t)n);
    gt_get(gs, dscale, sizeof(float) * (size_t)(rows * ng));
    gt_get(zero, dzero, sizeof(float) * (size_t)(rows * 3));
    bad = count_bad(got, want, gs, ws, rows, cols, ng, used);
    for (i = 0; i < rows * 3; i++) {
        uint32_t bits;
        memcpy(&bits, &zero[i], 4);
        bad_zero += i / 3 < used ? bits != 0 : bits != 0xffffffffu;
    }
    /* the same rows with their maxima given (as GEMM 1's epilogue takes h's): one pass, the
     * same codes and scales (not with the gather) */
    {
        float *am = malloc(sizeof(float) * (size_t)(rows * ng));
        float *dam;
        for (r = 0; r < rows; r++)
            for (i = 0; i < ng; i++) {
                const int c0 = group ? (int)i * group : 0, c1 = group ? c0 + group : cols;
                float m = 0.0f;
                for (int c = c0; c < c1 && c < cols; c++)
                    m = fmaxf(m, fabsf(x[r * cols + c])); /* NaN dropped, as the kernels do */
                am[r * ng + i] = m;
            }
        dam = gt_dup(am, sizeof(float) * (size_t)(rows * ng));
        gt_poison(dq, 0x55, (size_t)n);
        gt_poison(dscale, 0xff, sizeof(float) * (size_t)(rows * ng));
        moe_quant_rows_args_t a = {dx,  dtype, rows,   dnb,   block_rows, cols, dstatic,
                                   dbe, dq,    dscale, group, NULL,       0};
        a.amax = dam;
        a.trigger_next = 1; /* its successor may launch early: the same outputs */
        gt_ok(moe_quant_rows_launch(&a, NULL), "quant rows, maxima given");
        gt_get(got, dq, (size_t)n);
        gt_get(gs, dscale, sizeof(float) * (size_t)(rows * ng));
        bad_known = count_bad(got, want, gs, ws, rows, cols, ng, used);
        moe_gpu_free(dam);
        free(am);
    }
    fprintf(stderr,
            "quant %lld x %d, group %d, %s, %d static expert scales (%d rows static), rows used "
            "%lld: %lld mismatches, maxima given %lld, maxima not zeroed %lld\n",
            (long long)rows, cols, group, moe_dtype_name(dtype), static_scale ? num_experts : 0,
            nstatic, (long long)used, (long long)bad, (long long)bad_known, (long long)bad_zero);
    assert_int_equal(bad, 0);
    assert_int_equal(bad_known, 0);
    assert_int_equal(bad_zero, 0);
    moe_gpu_free(dzero);
    free(zero);
    moe_gpu_free(dx);
    moe_gpu_free(dq);
    moe_gpu_free(dscale);
    moe_gpu_free(dstatic);
    moe_gpu_free(dnb);
    moe_gpu_free(dbe);
    free(be);
    free(x);
    free(xb);
    free(want);
    free(got);
    free(ws);
    free(gs);
}

static void test_quant_rows(void **state)
{
    (void)state;
    check_quant(40, 2048, 0, MOE_DTYPE_BF16, NULL, 0, -1, 16);
    check_quant(40, 14336, 0, MOE_DTYPE_BF16, NULL, 0, -1, 16); /* Mixtral's h rows */
    check_quant(7, 12296, 0, MOE_DTYPE_F32, NULL, 0, -1, 16);   /* held, a CTA of 224 */
    check_quant(6, 36872, 0, MOE_DTYPE_BF16, NULL, 0, -1, 16);  /* past 32768: read twice */
    check_quant(6, 36872, 0, MOE_DTYPE_F32, NULL, 0, -1, 16);
    check_quant(33, 1032, 0, MOE_DTYPE_F32, NULL, 0, -1, 16);
    check_quant(64, 2048, 0, MOE_DTYPE_BF16, NULL, 0, 2, 16); /* rows past 2 blocks untouched */
}

static void test_quant_groups(void **state)
{
    (void)state;
    check_quant(40, 2048, 128, MOE_DTYPE_BF16, NULL, 0, -1, 16);
    check_quant(25, 384, 128, MOE_DTYPE_BF16, NULL, 0, -1, 16);
    check_quant(17, 200, 128, MOE_DTYPE_F32, NULL, 0, -1, 16); /* a partial last group */
    check_quant(48, 7168, 128, MOE_DTYPE_BF16, NULL, 0, 1, 16);
    check_quant(9, 14336, 128, MOE_DTYPE_BF16, NULL, 0, -1, 16); /* 224 threads, 8 vectors each */
    /* past 512 threads x 8 vectors (32768): a second round; a partial last group */
    check_quant(5, 40000, 128, MOE_DTYPE_F32, NULL, 0, -1, 16);
}

/* A static scale small enough that most values saturate at +-448 (never NaN), NaN stays NaN. */
static void test_quant_static_saturates(void **state)
{
    static const float small = 1e-3f, quarter = 0.25f;
    (void)state;
    check_quant(20, 1024, 0, MOE_DTYPE_BF16, &small, 1, -1, 16);
    check_quant(20, 1024, 0, MOE_DTYPE_F32, &quarter, 1, -1, 16);
}

/* Static scales per expert (a checkpoint's input_scale per expert): row r takes the scale of
 * block r / block_rows's expert; experts with 0 and padding blocks (-1) are dynamic; some
 * scales saturate, some are near the rows' own. */
static void test_quant_static_per_expert(void **state)
{
    static const float sc[6] = {1e-3f, 0.0f, 0.05f, 0.0f, 2.0f / 448.0f, 0.25f};
    (void)state;
    check_quant(200, 2048, 0, MOE_DTYPE_BF16, sc, 6, -1, 16);
    check_quant(90, 1032, 0, MOE_DTYPE_F32, sc, 5, -1, 8);      /* a partial last block */
    check_quant(64, 14336, 0, MOE_DTYPE_BF16, sc, 6, -1, 64);   /* Mixtral's h rows */
    check_quant(128, 2048, 0, MOE_DTYPE_BF16, sc, 6, 5, 16);    /* rows past 5 blocks untouched */
    check_quant(40, 512, 0, MOE_DTYPE_BF16, sc + 1, 1, -1, 16); /* one expert, 0: all dynamic */
}

/* The permute's gather fused in: row r quantises token src_slot[r] / k of x (f32 x rounded to
 * bf16 first, as the gather's copy would be), a zero row where src_slot[r] < 0; compared with
 * the CPU's gather-then-quantise, code for code and scale for scale. */
static void check_gather(int64_t tokens, int k, int64_t rows, int cols, int group,
                         moe_dtype_t dtype)
{
    const int64_t n = rows * cols, nx = tokens * cols;
    const int ng = group ? (cols + group - 1) / group : 1;
    float *x = malloc(sizeof(float) * (size_t)(nx + 1)), *row = malloc(sizeof(float) * cols);
    uint16_t *xb = malloc(2 * (size_t)(nx + 1));
    int32_t *slot = malloc(sizeof(int32_t) * (size_t)rows);
    uint8_t *want = malloc((size_t)n), *got = malloc((size_t)n);
    float *ws = malloc(sizeof(float) * (size_t)(rows * ng)),
          *gs = malloc(sizeof(float) * (size_t)(rows * ng));
    void *dx;
    int32_t *dslot;
    uint8_t *dq;
    float *dscale;
    int64_t r, i, bad = 0;

    gt_fill_bf16(x, xb, (size_t)nx, 1.0f);
    for (i = 0; i < nx; i++) /* f32 values between bf16 ones: the rounding shows */
        x[i] = x[i] * (1.0f + 1.0f / 512.0f) * powf(10.0f, (float)(i / cols % 5) - 2.0f);
    for (i = 0; i < nx; i++)
        xb[i] = moe_f32_to_bf16(x[i]);
    for (r = 0; r < rows; r++) {
        slot[r] = r % 5 == 4 ? -1 : (int32_t)((r * 7 + 3) % (tokens * k));
        for (i = 0; i < cols; i++)
            row[i] = slot[r] < 0 ? 0.0f : moe_bf16_to_f32(xb[(slot[r] / k) * cols + i]);
        moe_cpu_fp8_quantize_rows(row, 1, cols, group, 0.0f, want + r * cols, ws + r * ng);
    }
    dx = dtype == MOE_DTYPE_BF16 ? gt_dup(xb, 2 * (size_t)nx) : gt_dup(x, 4 * (size_t)nx);
    dslot = gt_dup(slot, sizeof(int32_t) * (size_t)rows);
    dq = gt_dalloc((size_t)n);
    dscale = gt_dalloc(sizeof(float) * (size_t)(rows * ng));
    gt_poison(dq, 0x55, (size_t)n);
    gt_poison(dscale, 0xff, sizeof(float) * (size_t)(rows * ng));
    {
        moe_quant_rows_args_t a = {dx,   dtype, rows,   NULL,  16,    cols, NULL,
                                   NULL, dq,    dscale, group, dslot, k};
        gt_ok(moe_quant_rows_launch(&a, NULL), "quant rows, gathered");
    }
    gt_get(got, dq, (size_t)n);
    gt_get(gs, dscale, sizeof(float) * (size_t)(rows * ng));
    for (i = 0; i < n; i++)
        bad += got[i] != want[i];
    for (i = 0; i < rows * ng; i++)
        bad += gs[i] != ws[i];
    fprintf(stderr,
            "quant gathered: %lld rows of %lld tokens x %d (k %d), group %d, %s: %lld mismatches\n",
            (long long)rows, (long long)tokens, cols, k, group, moe_dtype_name(dtype),
            (long long)bad);
    assert_int_equal(bad, 0);
    moe_gpu_free(dx);
    moe_gpu_free(dslot);
    moe_gpu_free(dq);
    moe_gpu_free(dscale);
    free(x);
    free(row);
    free(xb);
    free(slot);
    free(want);
    free(got);
    free(ws);
    free(gs);
}

static void test_quant_gather(void **state)
{
    (void)state;
    check_gather(9, 2, 48, 2048, 0, MOE_DTYPE_BF16);
    check_gather(9, 2, 48, 2048, 0, MOE_DTYPE_F32);
    check_gather(5, 8, 64, 7168, 128, MOE_DTYPE_BF16);
    check_gather(7, 4, 40, 200, 128, MOE_DTYPE_F32); /* a partial last group */
}

static void test_quant_rejects(void **state)
{
    static const float one = 1.0f;
    static float zero;
    moe_quant_rows_args_t a;
    (void)state;
    memset(&a, 0, sizeof(a));
    a.rows = 1;
    a.cols = 12; /* not a multiple of 8 */
    a.x_dtype = MOE_DTYPE_BF16;
    assert_int_equal(moe_quant_rows_launch(&a, NULL), MOE_STATUS_INVALID_ARGUMENT);
    a.cols = 128;
    a.group = 64;
    assert_int_equal(moe_quant_rows_launch(&a, NULL), MOE_STATUS_INVALID_ARGUMENT);
    a.group = 0;
    a.static_scale = &one; /* static scales without the block table */
    assert_int_equal(moe_quant_rows_launch(&a, NULL), MOE_STATUS_INVALID_ARGUMENT);
    a.static_scale = NULL;
    a.src_slot = (const int32_t *)&one; /* a gather without its k */
    assert_int_equal(moe_quant_rows_launch(&a, NULL), MOE_STATUS_INVALID_ARGUMENT);
    a.src_k = 2;
    a.amax = &one; /* known maxima with a gather */
    assert_int_equal(moe_quant_rows_launch(&a, NULL), MOE_STATUS_INVALID_ARGUMENT);
    a.src_slot = NULL;
    a.src_k = 0;
    a.amax = NULL;
    a.zero_amax = &zero; /* maxima to zero, 0 of them a row */
    assert_int_equal(moe_quant_rows_launch(&a, NULL), MOE_STATUS_INVALID_ARGUMENT);
    a.zero_cols = 1;
    a.amax = &one; /* reading and zeroing maxima in one call */
    assert_int_equal(moe_quant_rows_launch(&a, NULL), MOE_STATUS_INVALID_ARGUMENT);
    a.amax = NULL;
    a.zero_amax = NULL;
    a.zero_cols = 0;
    a.x_dtype = MOE_DTYPE_FP8_E4M3;
    assert_int_equal(moe_quant_rows_launch(&a, NULL), MOE_STATUS_NOT_SUPPORTED);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_quant_rows),
    cmocka_unit_test(test_quant_groups),
    cmocka_unit_test(test_quant_static_saturates),
    cmocka_unit_test(test_quant_static_per_expert),
    cmocka_unit_test(test_quant_gather),
    cmocka_unit_test(test_quant_rejects),
};

GT_MAIN(tests)
