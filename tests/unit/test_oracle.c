/* SPDX-License-Identifier: Apache-2.0 */
/* The oracle without a GPU: the built-in tables reproduce the fixed thresholds they replaced,
 * tuned tables round-trip through a tune file, bad tune files leave the defaults with one
 * warning, and forced variants are checked by name, arch, dtype and scale kind. */
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include "kernels/expert_gemm.h"
#include "kernels/expert_gemm_table.h"
#include "runtime/oracle.h"

/* ---- the built-in thresholds as measured (bench/RESULTS.md, "Tuning"; a fixture) ---------- */

typedef struct old_bucket {
    double max;
    const char *name;
} old_bucket_t;

static const old_bucket_t old_sm90[] = {
    {5.66, "sm90_swapab_n8"},           {11.3, "sm90_swapab_n16"},
    {22.6, "sm90_swapab_w128_n32"},     {45.3, "sm90_wgmma_tma_m64n256_pp"},
    {119.7, "sm90_wgmma_tma_m128n256"}, {180.0, "sm90_wgmma_tma_m192n128"},
    {247.9, "sm90_wgmma_tma_m256n128"}, {1e300, "sm90_wgmma_tma_m128n256"}};
static const old_bucket_t old_fp8[] = {
    {11.3, "sm90_fp8_swapab_n8_pp"},     {22.6, "sm90_fp8_swapab_n16_pp"},
    {55.4, "sm90_fp8_swapab_n32_pp_p4"}, {119.7, "sm90_fp8_m128n128_p4"},
    {207.4, "sm90_fp8_m192n128_p4"},     {286.2, "sm90_fp8_m128n128_p4"},
    {724.1, "sm90_fp8_m192n128_p4"},     {1e300, "sm90_fp8_m128n192_p4"}};
static const old_bucket_t old_fp8b[] = {
    {5.66, "sm90_fp8_block_swapab_n8_pp"},  {16.0, "sm90_fp8_block_swapab_n16_pp"},
    {32.0, "sm90_fp8_block_swapab_n32_pp"}, {55.4, "sm90_fp8_block_m64n128"},
    {119.7, "sm90_fp8_block_m128n128"},     {362.0, "sm90_fp8_block_m192n128"},
    {1e300, "sm90_fp8_block_m192n128_la"}};
static const old_bucket_t old_sm80[] = {{32.0, "sm80_mma_m32n128"}, {1e300, "sm80_mma_m64n128"}};
#define OLD_N(b) ((int)(sizeof(b) / sizeof((b)[0])))

static const char *old_pick(const old_bucket_t *b, int n, double rows)
{
    for (int i = 0; i < n; i++)
        if (rows <= b[i].max)
            return b[i].name;
    return NULL;
}

static const char *old_select(int arch, moe_dtype_t d, moe_scale_kind_t s, double rows)
{
    if (d == MOE_DTYPE_FP8_E4M3 && s == MOE_SCALE_PER_CHANNEL)
        return arch == 90 ? old_pick(old_fp8, OLD_N(old_fp8), rows) : NULL;
    if (d == MOE_DTYPE_FP8_E4M3 && s == MOE_SCALE_BLOCK_128)
        return arch == 90 ? old_pick(old_fp8b, OLD_N(old_fp8b), rows) : NULL;
    if (d != MOE_DTYPE_BF16 || s != MOE_SCALE_NONE)
        return NULL;
    if (arch == 90)
        return old_pick(old_sm90, OLD_N(old_sm90), rows);
    return arch >= 80 ? old_pick(old_sm80, OLD_N(old_sm80), rows) : NULL;
}

static void old_explain(int arch, double rows, char *text, size_t len)
{
    const old_bucket_t *b = arch == 90 ? old_sm90 : arch >= 80 ? old_sm80 : NULL;
    const int n = arch == 90 ? OLD_N(old_sm90) : OLD_N(old_sm80);
    double lo = 0.0;
    for (int i = 0; b && i < n; i++) {
        if (rows <= b[i].max) {
            if (b[i].max >= 1e300)
                snprintf(text, len, "%s (built-in table for sm_%d: rows/expert %.3g > %g)",
                         b[i].name, arch, rows, lo);
            else
                snprintf(text, len, "%s (built-in table for sm_%d: rows/expert %.3g in (%g, %g])",
                         b[i].name, arch, rows, lo, b[i].max);
            return;
        }
        lo = b[i].max;
    }
    snprintf(text, len, "simt_ref (no tuned variant for sm_%d)", arch);
}

static const double rows_list[] = {
    0,   0.25,  1,     1.99, 2,     2.0001, 3,     5.66,  5.67, 7.5, 8,   11.3, 11.4, 15.9,  16,
    17,  22.6,  22.7,  31.9, 32,    32.1,   45.3,  45.4,  48,   64,  95., 96,   96.5, 119.7, 119.8,
    128, 135.8, 135.9, 180,  180.1, 183.8,  183.9, 247.9, 248,  255, 256, 1000, 4096, 1e5,   1e9};
#define NUM_ROWS ((int)(sizeof(rows_list) / sizeof(rows_list[0])))
static const int arch_list[] = {60, 70, 75, 80, 86, 89, 90, 100, 120};
static const struct {
    moe_dtype_t d;
    moe_scale_kind_t s;
} kinds[] = {{MOE_DTYPE_BF16, MOE_SCALE_NONE},          {MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL},
             {MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128}, {MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_TENSOR},
             {MOE_DTYPE_BF16, MOE_SCALE_PER_CHANNEL},   {MOE_DTYPE_F32, MOE_SCALE_NONE}};

static void assert_same_name(const char *a, const char *b, const char *what, int arch, double r)
{
    if ((a == NULL) != (b == NULL) || (a && strcmp(a, b)))
        fail_msg("%s at sm_%d, %g rows/expert: %s, expected %s", what, arch, r, a ? a : "(none)",
                 b ? b : "(none)");
}

/* The defaults (and a default oracle) pick what the measured thresholds say. */
static void test_defaults_match_old_table(void **state)
{
    moe_oracle_t o;
    (void)state;
    moe_oracle_init(&o);
    for (size_t a = 0; a < sizeof(arch_list) / sizeof(arch_list[0]); a++)
        for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++)
            for (int i = 0; i < NUM_ROWS; i++) {
                const int arch = arch_list[a];
                const double r = rows_list[i];
                const char *want = old_select(arch, kinds[k].d, kinds[k].s, r);
                const moe_gemm_variant_t *v = moe_gemm_select(arch, kinds[k].d, kinds[k].s, r);
                const moe_oracle_query_t q = {arch, kinds[k].d, kinds[k].s, 4, 2, MOE_ORACLE_LSA,
                                              r,    0,          0.0,        0, 0};
                moe_oracle_choice_t c;
                assert_same_name(v ? v->name : NULL, want, "moe_gemm_select", arch, r);
                moe_oracle_pick_gemm(&o, &q, &c);
                assert_same_name(c.name, want, "moe_oracle_pick_gemm", arch, r);
                if (c.name)
                    assert_int_equal(c.source, MOE_ORACLE_DEFAULT);
                if (kinds[k].d == MOE_DTYPE_BF16 && kinds[k].s == MOE_SCALE_NONE) {
                    char got[256], exp[256];
                    moe_gemm_explain(arch, r, got, sizeof(got));
                    old_explain(arch, r, exp, sizeof(exp));
                    assert_string_equal(got, exp);
                }
            }
    /* no built-in transport table: the backend's own rule */
    {
        const moe_oracle_query_t q = {
            90, MOE_DTYPE_BF16, MOE_SCALE_NONE, 8, 1, MOE_ORACLE_ANY, 64, 0, 0.0, 0, 0};
        moe_oracle_choice_t c;
        assert_int_equal(moe_oracle_pick_transport(&o, &q, &c), 0);
        assert_null(c.name);
    }
}

/* ---- tuned tables ----------------------------------------------------------------------- */

static const moe_oracle_target_t h200 = {"NVIDIA H200", 90, {4096, 14336, 8, 2}};

static void add_bucket(moe_oracle_group_t *g, double max, const char *name, double at)
{
    moe_oracle_bucket_t *b = &g->bucket[g->num_buckets++];
    b->max = max;
    snprintf(b->name, sizeof(b->name), "%s", name);
    b->at = at;
    b->time_us = at > 0 ? 10.0 + at / 3.0 : 0;
}

/* A table as moe-tune would write it: a bf16 table for one shape and layout, an FP8 table for
 * any shape, a bf16 table for another shape, a transport table. */
/* t as a tune file's text (malloc'd; its length in *n). */
static char *format_text(const moe_oracle_table_t *t, size_t *n)
{
    char *text;
    *n = moe_oracle_format(t, NULL, 0);
    text = malloc(*n + 1);
    assert_non_null(text);
    assert_int_equal(moe_oracle_format(t, text, *n + 1), *n);
    return text;
}

static void fixture_table(moe_oracle_table_t *t)
{
    moe_oracle_group_t *g;
    memset(t, 0, sizeof(*t));
    snprintf(t->gpu, sizeof(t->gpu), "%s", "NVIDIA H200");
    t->arch = 90;
    t->group = calloc(8, sizeof(*t->group));
    assert_non_null(t->group);

    g = &t->group[t->num_groups++];
    g->kind = MOE_ORACLE_GEMM, g->arch = 90, g->shape = h200.shape;
    g->dtype = MOE_DTYPE_BF16, g->scale = MOE_SCALE_NONE;
    g->ep_size = 8, g->tp_size = 1, g->transport = MOE_ORACLE_LSA;
    add_bucket(g, 1.0 / 3.0, "sm90_swapab_n16", 0.25);
    add_bucket(g, 5.656854249492381, "sm90_swapab_n32", 4);
    add_bucket(g, 45.254833995939045, "sm90_swapab_n64", 32);
    add_bucket(g, HUGE_VAL, "sm90_wgmma_tma_m64n256", 256);

    g = &t->group[t->num_groups++];
    g->kind = MOE_ORACLE_GEMM, g->arch = 90;
    g->dtype = MOE_DTYPE_BF16, g->scale = MOE_SCALE_NONE, g->transport = MOE_ORACLE_ANY;
    add_bucket(g, HUGE_VAL, "sm90_swapab_n64", 0);

    g = &t->group[t->num_groups++];
    g->kind = MOE_ORACLE_GEMM, g->arch = 90;
    g->dtype = MOE_DTYPE_FP8_E4M3, g->scale = MOE_SCALE_BLOCK_128, g->transport = MOE_ORACLE_ANY;
    add_bucket(g, 64, "sm90_fp8_block_swapab_n32", 0);
    add_bucket(g, HUGE_VAL, "sm90_fp8_block_m64n128", 0);

    g = &t->group[t->num_groups++];
    g->kind = MOE_ORACLE_GEMM, g->arch = 90, g->shape = (moe_oracle_shape_t){7168, 2048, 256, 8};
    g->dtype = MOE_DTYPE_BF16, g->scale = MOE_SCALE_NONE, g->transport = MOE_ORACLE_ANY;
    add_bucket(g, HUGE_VAL, "sm90_swapab_n8", 0);

    g = &t->group[t->num_groups++];
    g->kind = MOE_ORACLE_TRANSPORT, g->arch = 90, g->shape = h200.shape;
    g->ep_size = 8, g->tp_size = 1, g->transport = MOE_ORACLE_ANY;
    add_bucket(g, 48, "allgather", 32);
    add_bucket(g, 1024, "lsa", 512);
    add_bucket(g, HUGE_VAL, "p2p", 4096);
}

/* Every pick of a and b agree (name, source, bucket) over layouts, kinds and rows. */
static void assert_same_picks(const moe_oracle_t *a, const moe_oracle_t *b)
{
    static const int layouts[][3] = {{1, 1, MOE_ORACLE_ANY},
                                     {8, 1, MOE_ORACLE_LSA},
                                     {8, 1, MOE_ORACLE_P2P},
                                     {4, 2, MOE_ORACLE_ALLGATHER}};
    for (int l = 0; l < 4; l++)
        for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++)
            for (int i = 0; i < NUM_ROWS; i++) {
                const moe_oracle_query_t q = {90,
                                              kinds[k].d,
                                              kinds[k].s,
                                              layouts[l][0],
                                              layouts[l][1],
                                              layouts[l][2],
                                              rows_list[i],
                                              0,
                                              0.0,
                                              0,
                                              0};
                moe_oracle_choice_t ca, cb;
                assert_int_equal(moe_oracle_pick_gemm(a, &q, &ca),
                                 moe_oracle_pick_gemm(b, &q, &cb));
                assert_same_name(ca.name, cb.name, "round trip", 90, rows_list[i]);
                assert_int_equal(ca.source, cb.source);
                assert_true(ca.lo == cb.lo && ca.hi == cb.hi);
                assert_int_equal(moe_oracle_pick_transport(a, &q, &ca),
                                 moe_oracle_pick_transport(b, &q, &cb));
                assert_same_name(ca.name, cb.name, "transport round trip", 90, rows_list[i]);
            }
}

static char *temp_path(const char *name)
{
    static char path[200];
    const char *tmp = getenv("TMPDIR");
    snprintf(path, sizeof(path), "%s/moe_test_oracle_%d_%s", tmp && *tmp ? tmp : "/tmp",
             (int)getpid(), name);
    return path;
}

/* No built-in promoted table names a variant that sums FP8 products on the tensor cores alone
 * (fast_accum: those change the layer's numerics and run only in the tables fp8_math W8A8_FAST
 * layers ask, fp8 per-row scales alone), and no built-in table one on trial (built, not yet
 * checked on a GPU). */
static void test_defaults_never_fast_accum(void **state)
{
    int ng = 0, nv = 0, fast = 0, fast_tables = 0;
    const moe_oracle_group_t *g = moe_oracle_defaults(&ng);
    const moe_gemm_variant_t *v = moe_gemm_variants(&nv);
    (void)state;
    for (int i = 0; i < nv; i++)
        if (v[i].fast_accum) {
            fast++;
            assert_int_equal(v[i].ab_dtype, MOE_DTYPE_FP8_E4M3);
            assert_int_equal(v[i].scale_kind, MOE_SCALE_PER_CHANNEL);
        }
    assert_true(fast >= 1);
    for (int i = 0; i < ng; i++) {
        if (g[i].accum == MOE_ORACLE_ACCUM_FAST) {
            fast_tables++;
            assert_int_equal(g[i].kind, MOE_ORACLE_GEMM);
            assert_int_equal(g[i].dtype, MOE_DTYPE_FP8_E4M3);
            assert_int_equal(g[i].scale, MOE_SCALE_PER_CHANNEL);
        } else {
            assert_int_equal(g[i].accum, MOE_ORACLE_ACCUM_PROMOTED);
        }
        for (int b = 0; b < g[i].num_buckets; b++) {
            const moe_gemm_variant_t *bv = moe_gemm_variant_by_name(g[i].bucket[b].name);
            if (bv && g[i].accum != MOE_ORACLE_ACCUM_FAST)
                assert_int_equal(bv->fast_accum, 0);
            if (!bv && g[i].kind == MOE_ORACLE_GEMM) /* a fast table's deferral alone */
                assert_string_equal(g[i].bucket[b].name, MOE_ORACLE_PROMOTED_PATH);
            assert_int_equal(moe_gemm_variant_on_trial(bv), 0);
        }
    }
    assert_true(fast_tables >= 1);
}

static moe_oracle_query_t fp8_query(moe_scale_kind_t s, int accum, double rows, int hidden)
{
    moe_oracle_query_t q;
    memset(&q, 0, sizeof(q));
    q.arch = 90;
    q.dtype = MOE_DTYPE_FP8_E4M3;
    q.scale = s;
    q.ep_size = q.tp_size = 1;
    q.transport = MOE_ORACLE_ANY;
    q.value = rows;
    q.hidden = hidden;
    q.accum = accum;
    return q;
}

/* A W8A8_FAST layer's query: the fast m128n256 tile past 207.4 rows per expert (with hidden <=
 * 2048 the fast m64n256_pp past 32), the promoted tables' choice below (the deferral resolved,
 * never returned); promoted queries never get a fast variant; block scales have no fast table. */
static void test_fast_accum_picks(void **state)
{
    static const double rows[] = {0.5, 8, 32, 32.5, 64, 200, 207.4, 207.5, 256, 1000, 8192, 1e9};
    static const int hidden[] = {0, 1024, 2048, 2049, 4096, 7168};
    (void)state;
    for (size_t h = 0; h < sizeof(hidden) / sizeof(hidden[0]); h++)
        for (size_t r = 0; r < sizeof(rows) / sizeof(rows[0]); r++) {
            const moe_oracle_query_t f = fp8_query(MOE_SCALE_PER_CHANNEL, MOE_ORACLE_ACCUM_FAST,
                                                   rows[r], hidden[h]),
                                     p = fp8_query(MOE_SCALE_PER_CHANNEL, MOE_ORACLE_ACCUM_PROMOTED,
                                                   rows[r], hidden[h]),
                                     bf = fp8_query(MOE_SCALE_BLOCK_128, MOE_ORACLE_ACCUM_FAST,
                                                    rows[r], hidden[h]),
                                     bp = fp8_query(MOE_SCALE_BLOCK_128, MOE_ORACLE_ACCUM_PROMOTED,
                                                    rows[r], hidden[h]);
            const int short_k = hidden[h] > 0 && hidden[h] <= 2048;
            const double bound = short_k ? 32.0 : 207.4;
            const int fast_here = rows[r] > bound;
            moe_oracle_choice_t cf, cp, cbf, cbp;
            assert_int_equal(moe_oracle_pick_gemm(NULL, &f, &cf), 1);
            assert_int_equal(moe_oracle_pick_gemm(NULL, &p, &cp), 1);
            assert_int_equal(moe_oracle_pick_gemm(NULL, &bf, &cbf), 1);
            assert_int_equal(moe_oracle_pick_gemm(NULL, &bp, &cbp), 1);
            assert_int_equal(moe_gemm_variant_by_name(cp.name)->fast_accum, 0);
            assert_same_name(cf.name,
                             !fast_here ? cp.name
                             : short_k  ? "sm90_fp8_fast_m64n256_pp"
                                        : "sm90_fp8_fast_m128n256",
                             "fast query", 90, rows[r]);
            assert_int_equal(cf.source, MOE_ORACLE_DEFAULT);
            /* the bucket holds the value and, deferred, stays inside the promoted one and below
             * the fast tile's bound */
            assert_true(cf.lo < rows[r] && rows[r] <= cf.hi);
            if (!fast_here)
                assert_true(cf.lo >= cp.lo && cf.hi <= cp.hi && cf.hi <= bound);
            else
                assert_true(cf.lo >= bound);
            assert_same_name(cbf.name, cbp.name, "block, fast query", 90, rows[r]);
        }
}

/* A tune file's fast table: read and written with "accum": "fast", answers fast queries only;
 * a promoted query beside it gets the built-in choice. */
static void test_fast_accum_tune_table(void **state)
{
    static const char text[] =
        "{\"libmoe_tune\": 1, \"gpu\": \"NVIDIA H200\", \"arch\": 90, \"gemm\": [{\"dtype\": "
        "\"fp8_e4m3\", \"scales\": \"per_channel\", \"accum\": \"fast\", \"buckets\": "
        "[{\"max_rows_per_expert\": 100, \"variant\": \"sm90_fp8_swapab_n16_pp\"}, {\"variant\": "
        "\"sm90_fp8_fast_m64n256\"}]}]}";
    moe_oracle_t o, back;
    moe_oracle_choice_t c;
    moe_oracle_query_t f = fp8_query(MOE_SCALE_PER_CHANNEL, MOE_ORACLE_ACCUM_FAST, 50, 4096);
    const moe_oracle_query_t p =
        fp8_query(MOE_SCALE_PER_CHANNEL, MOE_ORACLE_ACCUM_PROMOTED, 500, 4096);
    char *out;
    size_t n;
    (void)state;
    moe_oracle_init(&o);
    assert_int_equal(moe_oracle_load_text(&o, text, strlen(text), "fast fixture", &h200), 1);
    assert_int_equal(o.tuned.group[0].accum, MOE_ORACLE_ACCUM_FAST);
    assert_int_equal(moe_oracle_pick_gemm(&o, &f, &c), 1);
    assert_string_equal(c.name, "sm90_fp8_swapab_n16_pp");
    assert_int_equal(c.source, MOE_ORACLE_TUNED);
    f.value = 500;
    assert_int_equal(moe_oracle_pick_gemm(&o, &f, &c), 1);
    assert_string_equal(c.name, "sm90_fp8_fast_m64n256");
    assert_int_equal(moe_oracle_pick_gemm(&o, &p, &c), 1);
    assert_int_equal(c.source, MOE_ORACLE_DEFAULT);
    assert_int_equal(moe_gemm_variant_by_name(c.name)->fast_accum, 0);
    /* written back with its key, read back the same */
    n = moe_oracle_format(&o.tuned, NULL, 0);
    out = malloc(n + 1);
    assert_non_null(out);
    moe_oracle_format(&o.tuned, out, n + 1);
    assert_non_null(strstr(out, "\"accum\": \"fast\""));
    moe_oracle_init(&back);
    assert_int_equal(moe_oracle_load_text(&back, out, n, "round trip", &h200), 1);
    assert_int_equal(back.tuned.group[0].accum, MOE_ORACLE_ACCUM_FAST);
    assert_int_equal(moe_oracle_pick_gemm(&back, &f, &c), 1);
    assert_string_equal(c.name, "sm90_fp8_fast_m64n256");
    free(out);
    moe_oracle_free(&back);
    moe_oracle_free(&o);
}

/* A variant on trial is in the table by a name that exists (test_defaults_never_fast_accum: in
 * no built-in table). */
static void test_on_trial_named(void **state)
{
    int nv = 0, trial = 0;
    const moe_gemm_variant_t *v = moe_gemm_variants(&nv);
    (void)state;
    for (int i = 0; i < nv; i++)
        trial += moe_gemm_variant_on_trial(&v[i]);
    assert_true(trial >= 1);
    assert_int_equal(moe_gemm_variant_on_trial(moe_gemm_variant_by_name("sm90_fp8_m128n192_p4")),
                     0);
    assert_int_equal(moe_gemm_variant_on_trial(NULL), 0);
}

/* The fp8 tables for hidden <= 2048 answer only layers whose hidden is known and that short;
 * the rest get the tables for any shape. */
static void test_defaults_short_k(void **state)
{
    static const struct {
        moe_scale_kind_t s;
        double rows;
        int hidden;
        const char *want;
    } cases[] = {
        {MOE_SCALE_PER_CHANNEL, 64, 2048, "sm90_fp8_m64n128_pp_p4"},
        {MOE_SCALE_PER_CHANNEL, 200, 1024, "sm90_fp8_m64n128_pp_p4"},
        {MOE_SCALE_PER_CHANNEL, 64, 2049, "sm90_fp8_m128n128_p4"},
        {MOE_SCALE_PER_CHANNEL, 64, 0, "sm90_fp8_m128n128_p4"},
        {MOE_SCALE_PER_CHANNEL, 8, 2048, "sm90_fp8_swapab_n8_pp"},
        {MOE_SCALE_PER_CHANNEL, 512, 2048, "sm90_fp8_m192n128_p4"},
        /* the n192 tile past 724.1 rows, but not on the short-k shapes */
        {MOE_SCALE_PER_CHANNEL, 1000, 2048, "sm90_fp8_m192n128_p4"},
        {MOE_SCALE_PER_CHANNEL, 1000, 4096, "sm90_fp8_m128n192_p4"},
        {MOE_SCALE_PER_CHANNEL, 724, 7168, "sm90_fp8_m192n128_p4"},
        {MOE_SCALE_BLOCK_128, 2048, 7168, "sm90_fp8_block_m192n128_la"},
        {MOE_SCALE_BLOCK_128, 300, 7168, "sm90_fp8_block_m192n128"},
        {MOE_SCALE_BLOCK_128, 2048, 2048, "sm90_fp8_block_m192n128"},
        {MOE_SCALE_BLOCK_128, 64, 2048, "sm90_fp8_block_m64n128_pp"},
        {MOE_SCALE_BLOCK_128, 48, 7168, "sm90_fp8_block_m64n128"},
        {MOE_SCALE_BLOCK_128, 64, 7168, "sm90_fp8_block_m128n128"},
        {MOE_SCALE_BLOCK_128, 96, 4096, "sm90_fp8_block_m128n128"},
        {MOE_SCALE_BLOCK_128, 150, 2048, "sm90_fp8_block_m192n128"},
        {MOE_SCALE_BLOCK_128, 4, 2048, "sm90_fp8_block_swapab_n8_pp"},
        {MOE_SCALE_BLOCK_128, 8, 2048, "sm90_fp8_block_swapab_n16_pp"},
        {MOE_SCALE_BLOCK_128, 4, 7168, "sm90_fp8_block_swapab_n8_pp"},
    };
    (void)state;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const moe_oracle_query_t q = {90,
                                      MOE_DTYPE_FP8_E4M3,
                                      cases[i].s,
                                      1,
                                      1,
                                      MOE_ORACLE_ANY,
                                      cases[i].rows,
                                      cases[i].hidden,
                                      0.0,
                                      0,
                                      0};
        moe_oracle_choice_t c;
        assert_int_equal(moe_oracle_pick_gemm(NULL, &q, &c), 1);
        assert_same_name(c.name, cases[i].want, "short-k table", 90, cases[i].rows);
        assert_non_null(moe_gemm_variant_by_name(c.name));
        if (cases[i].hidden > 0 && cases[i].hidden <= 2048) {
            char why[256];
            moe_oracle_describe(&c, "rows/expert", cases[i].rows, why, sizeof(why));
            assert_non_null(strstr(why, "hidden <= 2048"));
        }
    }
    /* bf16 has no such table: hidden changes nothing */
    {
        const moe_oracle_query_t
            a = {90, MOE_DTYPE_BF16, MOE_SCALE_NONE, 1, 1, MOE_ORACLE_ANY, 64, 2048, 0.0, 0, 0},
            b = {90, MOE_DTYPE_BF16, MOE_SCALE_NONE, 1, 1, MOE_ORACLE_ANY, 64, 0, 0.0, 0, 0};
        moe_oracle_choice_t ca, cb;
        assert_int_equal(moe_oracle_pick_gemm(NULL, &a, &ca), 1);
        assert_int_equal(moe_oracle_pick_gemm(NULL, &b, &cb), 1);
        assert_string_equal(ca.name, cb.name);
    }
}

/* A GEMM table records the built-in tables it was measured against; another id at load keeps
 * the table and says so in the warning; a malformed id makes the file ignored. */
static void test_builtin_id(void **state)
{
    const char *id = moe_oracle_builtin_id();
    const char *other = strcmp(id, "0123456789abcdef") ? "0123456789abcdef" : "fedcba9876543210";
    moe_oracle_table_t t;
    moe_oracle_t o;
    char *text;
    size_t n;
    (void)state;
    assert_int_equal(strlen(id), 16);
    assert_int_equal(strspn(id, "0123456789abcdef"), 16);
    assert_ptr_equal(moe_oracle_builtin_id(), id);
    fixture_table(&t);
    for (int pass = 0; pass < 3; pass++) {
        const char *mark = pass == 0 ? id : pass == 1 ? other : "not-hex-digits!!";
        for (int i = 0; i < t.num_groups; i++)
            if (t.group[i].kind == MOE_ORACLE_GEMM)
                snprintf(t.group[i].builtin, sizeof(t.group[i].builtin), "%s", mark);
        text = format_text(&t, &n);
        assert_non_null(strstr(text, "\"builtin\""));
        moe_oracle_init(&o);
        const int got = moe_oracle_load_text(&o, text, n, "fixture", &h200);
        if (pass == 0) {
            assert_int_equal(got, 4);
            assert_string_equal(o.warning, "");
        } else if (pass == 1) {
            assert_int_equal(got, 4); /* still used */
            assert_non_null(strstr(o.warning, "other built-in tables"));
            assert_non_null(strstr(o.warning, other));
        } else {
            assert_int_equal(got, 0);
            assert_non_null(strstr(o.warning, "ignored"));
            assert_non_null(strstr(o.warning, "16 hex digits"));
        }
        moe_oracle_free(&o);
        free(text);
    }
    moe_oracle_table_free(&t);
}

static void test_round_trip(void **state)
{
    moe_oracle_table_t t, back;
    moe_oracle_t direct, loaded, from_file;
    char *text, *path = temp_path("tune.json");
    size_t n;
    (void)state;

    fixture_table(&t);
    text = format_text(&t, &n);

    /* the whole file parses back to the same tables */
    TU_OK(moe_oracle_parse(text, n, "fixture", &back));
    assert_string_equal(back.gpu, t.gpu);
    assert_int_equal(back.arch, t.arch);
    assert_int_equal(back.num_groups, t.num_groups);
    for (int i = 0; i < t.num_groups; i++) {
        const moe_oracle_group_t *a = &t.group[i], *b = &back.group[i];
        assert_int_equal(a->kind, b->kind);
        assert_memory_equal(&a->shape, &b->shape, sizeof(a->shape));
        assert_int_equal(a->ep_size, b->ep_size);
        assert_int_equal(a->transport, b->transport);
        assert_int_equal(a->num_buckets, b->num_buckets);
        for (int j = 0; j < a->num_buckets; j++) {
            assert_true(a->bucket[j].max == b->bucket[j].max);
            assert_true(a->bucket[j].at == b->bucket[j].at);
            assert_true(a->bucket[j].time_us == b->bucket[j].time_us);
            assert_string_equal(a->bucket[j].name, b->bucket[j].name);
        }
    }
    moe_oracle_table_free(&back);

    /* direct: the tables of this shape, as a layer would hold them */
    moe_oracle_init(&direct);
    direct.tuned.group = calloc(8, sizeof(moe_oracle_group_t));
    for (int i = 0; i < t.num_groups; i++)
        if (t.group[i].shape.hidden == 0 || t.group[i].shape.hidden == h200.shape.hidden)
            direct.tuned.group[direct.tuned.num_groups++] = t.group[i];
    snprintf(direct.file, sizeof(direct.file), "%s", "fixture");
    moe_oracle_init(&loaded);
    assert_int_equal(moe_oracle_load_text(&loaded, text, n, "fixture", &h200), 4);
    assert_string_equal(loaded.warning, "");
    assert_same_picks(&direct, &loaded);

    TU_OK(moe_oracle_write(path, &t));
    moe_oracle_init(&from_file);
    assert_int_equal(moe_oracle_load(&from_file, path, &h200), 4);
    assert_string_equal(from_file.file, path);
    snprintf(direct.file, sizeof(direct.file), "%s", path);
    assert_same_picks(&direct, &from_file);

    { /* what the tuned tables say, and that the explanation names the file */
        moe_oracle_query_t q = {
            90, MOE_DTYPE_BF16, MOE_SCALE_NONE, 8, 1, MOE_ORACLE_LSA, 3, 0, 0.0, 0, 0};
        moe_oracle_choice_t c;
        char why[512];
        assert_int_equal(moe_oracle_pick_gemm(&from_file, &q, &c), 1);
        assert_string_equal(c.name, "sm90_swapab_n32");
        assert_int_equal(c.source, MOE_ORACLE_TUNED);
        moe_oracle_describe(&c, "rows/expert", 3, why, sizeof(why));
        assert_non_null(strstr(why, "tuned from "));
        assert_non_null(strstr(why, path));
        q.transport = MOE_ORACLE_P2P; /* the layout-free bf16 table */
        moe_oracle_pick_gemm(&from_file, &q, &c);
        assert_string_equal(c.name, "sm90_swapab_n64");
        q.dtype = MOE_DTYPE_FP8_E4M3, q.scale = MOE_SCALE_PER_CHANNEL; /* not tuned */
        moe_oracle_pick_gemm(&from_file, &q, &c);
        assert_string_equal(c.name, "sm90_fp8_swapab_n8_pp");
        assert_int_equal(c.source, MOE_ORACLE_DEFAULT);
        q.scale = MOE_SCALE_BLOCK_128, q.value = 100;
        moe_oracle_pick_gemm(&from_file, &q, &c);
        assert_string_equal(c.name, "sm90_fp8_block_m64n128");
        q.value = 2000;
        assert_int_equal(moe_oracle_pick_transport(&from_file, &q, &c), 1);
        assert_string_equal(c.name, "p2p");
        q.value = 48;
        moe_oracle_pick_transport(&from_file, &q, &c);
        assert_string_equal(c.name, "allgather");
        q.ep_size = 4; /* no transport table for EP4 */
        assert_int_equal(moe_oracle_pick_transport(&from_file, &q, &c), 0);
        q.arch = 80; /* tuned tables are for sm_90 only */
        q.dtype = MOE_DTYPE_BF16, q.scale = MOE_SCALE_NONE, q.value = 3;
        moe_oracle_pick_gemm(&from_file, &q, &c);
        assert_string_equal(c.name, "sm80_mma_m32n128");
        assert_int_equal(c.source, MOE_ORACLE_DEFAULT);
    }
    { /* the other shape's table is the one kept for it */
        moe_oracle_target_t ds = h200;
        moe_oracle_t o;
        moe_oracle_query_t q = {
            90, MOE_DTYPE_BF16, MOE_SCALE_NONE, 1, 1, MOE_ORACLE_ANY, 500, 0, 0.0, 0, 0};
        moe_oracle_choice_t c;
        ds.shape = (moe_oracle_shape_t){7168, 2048, 256, 8};
        moe_oracle_init(&o);
        assert_int_equal(moe_oracle_load(&o, path, &ds), 3);
        moe_oracle_pick_gemm(&o, &q, &c);
        assert_string_equal(c.name, "sm90_swapab_n64"); /* the any-shape table comes first */
        moe_oracle_free(&o);
    }
    unlink(path);
    moe_oracle_free(&direct);
    moe_oracle_free(&loaded);
    moe_oracle_free(&from_file);
    moe_oracle_table_free(&t);
    free(text);
}

/* ---- bad tune files --------------------------------------------------------------------- */

#define GOOD_HEAD "{\"libmoe_tune\": 1, \"gpu\": \"NVIDIA H200\", \"arch\": 90, "
#define GOOD_BUCKETS                                                                               \
    "\"buckets\": [{\"max_rows_per_expert\": 8, \"variant\": \"sm90_swapab_n32\"}, "               \
    "{\"variant\": \"sm90_swapab_n64\"}]"

static const char *const bad_files[] = {
    "",
    " ",
    "{",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", " GOOD_BUCKETS,
    "[]",
    "null",
    "{}",
    "{\"libmoe_tune\": 2, \"gpu\": \"NVIDIA H200\", \"arch\": 90}",
    "{\"libmoe_tune\": 0, \"gpu\": \"NVIDIA H200\", \"arch\": 90}",
    "{\"libmoe_tune\": \"1\", \"gpu\": \"NVIDIA H200\", \"arch\": 90}",
    "{\"libmoe_tune\": 1.5, \"gpu\": \"NVIDIA H200\", \"arch\": 90}",
    "{\"libmoe_tune\": 1, \"gpu\": 7, \"arch\": 90}",
    "{\"libmoe_tune\": 1, \"arch\": 90}",
    "{\"libmoe_tune\": 1, \"gpu\": \"NVIDIA H100 80GB HBM3\", \"arch\": 90, \"gemm\": [{\"dtype\": "
    "\"bf16\", \"scales\": \"none\", " GOOD_BUCKETS "}]}",
    "{\"libmoe_tune\": 1, \"gpu\": \"NVIDIA H200\", \"arch\": 80, \"gemm\": []}",
    "{\"libmoe_tune\": 1, \"gpu\": \"NVIDIA H200\", \"arch\": 1e400}",
    "{\"libmoe_tune\": 99999999999999999999999, \"gpu\": \"NVIDIA H200\", \"arch\": 90}",
    GOOD_HEAD "\"gemm\": {}}",
    GOOD_HEAD "\"gemm\": [7]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\"}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"buckets\": []}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"buckets\": {}}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": 3, " GOOD_BUCKETS "}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"f32\", \"scales\": \"none\", " GOOD_BUCKETS "}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"block_128\", " GOOD_BUCKETS "}]}",
    GOOD_HEAD
    "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"ep_size\": -1, " GOOD_BUCKETS "}]}",
    GOOD_HEAD
    "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"ep_size\": 1e999, " GOOD_BUCKETS
    "}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"transport\": "
              "\"nvlink\", " GOOD_BUCKETS "}]}",
    GOOD_HEAD
    "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"shape\": [1, 2], " GOOD_BUCKETS "}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"shape\": {\"hidden\": "
              "4096}, " GOOD_BUCKETS "}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"buckets\": [{\"variant\": "
              "\"sm90_swapab_n128\"}]}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"buckets\": [{\"variant\": "
              "\"sm90_fp8_m64n128\"}]}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"buckets\": [{\"variant\": "
              "\"simt_ref\"}]}]}",
    /* fast accumulation: a promoted table naming a fast variant (a file moe-tune wrote before
     * "accum" existed, asked to try the fast tiles), "accum" on another key, an unknown one, the
     * built-in tables' deferral as a name */
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"fp8_e4m3\", \"scales\": \"per_channel\", \"buckets\": "
              "[{\"variant\": \"sm90_fp8_fast_m128n256\"}]}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"fp8_e4m3\", \"scales\": \"per_channel\", \"accum\": "
              "\"promoted\", \"buckets\": [{\"variant\": \"sm90_fp8_fast_m128n256\"}]}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"accum\": \"fast\", "
              "\"buckets\": [{\"variant\": \"sm90_swapab_n32\"}]}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"fp8_e4m3\", \"scales\": \"block_128\", \"accum\": "
              "\"fast\", \"buckets\": [{\"variant\": \"sm90_fp8_block_m128n128\"}]}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"fp8_e4m3\", \"scales\": \"per_channel\", \"accum\": "
              "\"sloppy\", \"buckets\": [{\"variant\": \"sm90_fp8_fast_m128n256\"}]}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"fp8_e4m3\", \"scales\": \"per_channel\", \"accum\": "
              "7, \"buckets\": [{\"variant\": \"sm90_fp8_fast_m128n256\"}]}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"fp8_e4m3\", \"scales\": \"per_channel\", \"accum\": "
              "\"fast\", \"buckets\": [{\"variant\": \"promoted\"}]}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"buckets\": [{\"variant\": "
              "7}]}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"buckets\": [{\"variant\": "
              "\"sm90_swapab_n32\", \"max_rows_per_expert\": 8}]}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"buckets\": [{\"variant\": "
              "\"sm90_swapab_n32\"}, {\"variant\": \"sm90_swapab_n64\"}]}]}",
    GOOD_HEAD
    "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"buckets\": [{\"variant\": "
    "\"sm90_swapab_n32\", \"max_rows_per_expert\": 8}, {\"variant\": \"sm90_swapab_n16\", "
    "\"max_rows_per_expert\": 4}, {\"variant\": \"sm90_swapab_n64\"}]}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"buckets\": [{\"variant\": "
              "\"sm90_swapab_n32\", \"max_rows_per_expert\": 1e400}, {\"variant\": "
              "\"sm90_swapab_n64\"}]}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"buckets\": [{\"variant\": "
              "\"sm90_swapab_n32\", \"max_rows_per_expert\": -3}, {\"variant\": "
              "\"sm90_swapab_n64\"}]}]}",
    GOOD_HEAD "\"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"buckets\": [{\"variant\": "
              "\"sm90_swapab_n32\", \"max_rows_per_expert\": \"8\"}, {\"variant\": "
              "\"sm90_swapab_n64\"}]}]}",
    GOOD_HEAD "\"transport\": [{\"buckets\": [{\"transport\": \"nvlink\"}]}]}",
    GOOD_HEAD
    "\"transport\": [{\"buckets\": [{\"max_tokens_per_rank\": 0, \"transport\": \"lsa\"}, "
    "{\"transport\": \"p2p\"}]}]}",
    GOOD_HEAD "\"transport\": [{\"buckets\": [{\"transport\": \"any\"}]}]}",
    /* decode tables: a path that is neither, the fused kernel after the grouped path (it runs up
     * to one bound), the fused kernel for block scales past one token (bounded and open), no
     * dtype, not an array */
    GOOD_HEAD "\"decode\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"buckets\": [{\"path\": "
              "\"fused\"}]}]}",
    GOOD_HEAD "\"decode\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"buckets\": "
              "[{\"max_tokens_per_step\": 8, \"path\": \"grouped\"}, {\"path\": "
              "\"sm90_fused_decode\"}]}]}",
    GOOD_HEAD "\"decode\": [{\"dtype\": \"fp8_e4m3\", \"scales\": \"block_128\", \"buckets\": "
              "[{\"max_tokens_per_step\": 8, \"path\": \"sm90_fused_decode\"}, {\"path\": "
              "\"grouped\"}]}]}",
    GOOD_HEAD "\"decode\": [{\"dtype\": \"fp8_e4m3\", \"scales\": \"block_128\", \"buckets\": "
              "[{\"path\": \"sm90_fused_decode\"}]}]}",
    GOOD_HEAD "\"decode\": [{\"buckets\": [{\"path\": \"grouped\"}]}]}",
    GOOD_HEAD "\"decode\": 7}",
    /* valid, but no table for this layer's shape */
    GOOD_HEAD "\"gemm\": [{\"shape\": {\"hidden\": 7168, \"intermediate\": 2048, \"experts\": 256, "
              "\"top_k\": 8}, \"dtype\": \"bf16\", \"scales\": \"none\", " GOOD_BUCKETS "}]}",
    GOOD_HEAD "\"gemm\": []}",
};

/* o holds the defaults and one warning naming the file. */
static void assert_defaults(const moe_oracle_t *o, const char *what)
{
    moe_oracle_t def;
    if (!o->warning[0])
        fail_msg("%s: no warning", what);
    if (!strstr(o->warning, "built-in tables used"))
        fail_msg("%s: warning '%s'", what, o->warning);
    assert_int_equal(o->tuned.num_groups, 0);
    assert_null(o->tuned.group);
    moe_oracle_init(&def);
    assert_same_picks(o, &def);
}

static void test_bad_tune_files(void **state)
{
    char *path = temp_path("bad.json");
    (void)state;
    for (size_t i = 0; i < sizeof(bad_files) / sizeof(bad_files[0]); i++) {
        moe_oracle_t o;
        FILE *f;
        char what[32];
        const size_t n = strlen(bad_files[i]);
        char *copy = malloc(n + 1); /* exactly n bytes readable: no NUL read past the text */
        memcpy(copy, bad_files[i], n);
        snprintf(what, sizeof(what), "bad file %zu", i);
        moe_oracle_init(&o);
        assert_int_equal(moe_oracle_load_text(&o, copy, n, what, &h200), 0);
        assert_defaults(&o, what);
        assert_non_null(strstr(o.warning, what));
        moe_oracle_free(&o);
        free(copy);
        /* and through a file */
        f = fopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(bad_files[i], 1, n, f), n);
        assert_int_equal(fclose(f), 0);
        assert_int_equal(moe_oracle_load(&o, path, &h200), 0);
        assert_defaults(&o, bad_files[i]);
        assert_non_null(strstr(o.warning, path));
        moe_oracle_free(&o);
    }
    { /* every prefix of a good file (truncated writes) */
        moe_oracle_table_t t;
        char buf[8192];
        size_t n;
        fixture_table(&t);
        n = moe_oracle_format(&t, buf, sizeof(buf));
        assert_true(n < sizeof(buf));
        for (size_t cut = 0; cut + 2 < n; cut += 7) {
            moe_oracle_t o;
            moe_oracle_init(&o);
            assert_int_equal(moe_oracle_load_text(&o, buf, cut, "truncated", &h200), 0);
            assert_defaults(&o, "truncated");
            moe_oracle_free(&o);
        }
        moe_oracle_table_free(&t);
    }
    { /* missing file, a directory, no GPU name */
        moe_oracle_t o;
        moe_oracle_target_t nogpu = h200;
        moe_oracle_init(&o);
        assert_int_equal(moe_oracle_load(&o, "/nonexistent/moe_tune.json", &h200), 0);
        assert_defaults(&o, "missing");
        assert_int_equal(moe_oracle_load(&o, "/", &h200), 0);
        assert_defaults(&o, "directory");
        nogpu.gpu = NULL;
        assert_int_equal(moe_oracle_load_text(&o, GOOD_HEAD "\"gemm\": []}",
                                              strlen(GOOD_HEAD "\"gemm\": []}"), "x", &nogpu),
                         0);
        assert_defaults(&o, "no gpu name");
        /* no file named: defaults and no warning */
        assert_int_equal(moe_oracle_load(&o, NULL, &h200), 0);
        assert_string_equal(o.warning, "");
        unsetenv("MOE_TUNE_FILE");
        assert_int_equal(moe_oracle_load_env(&o, &h200), 0);
        assert_string_equal(o.warning, "");
        setenv("MOE_TUNE_FILE", "/nonexistent/tune.json", 1);
        assert_int_equal(moe_oracle_load_env(&o, &h200), 0);
        assert_defaults(&o, "MOE_TUNE_FILE missing");
        unsetenv("MOE_TUNE_FILE");
        moe_oracle_free(&o);
    }
    { /* a good file with unknown members and any-layout tables loads */
        static const char ok[] = GOOD_HEAD
            "\"note\": {\"x\": [1, 2]}, \"gemm\": [{\"dtype\": \"bf16\", \"scales\": \"none\", "
            "\"extra\": true, " GOOD_BUCKETS "}]}";
        moe_oracle_t o;
        moe_oracle_init(&o);
        assert_int_equal(moe_oracle_load_text(&o, ok, strlen(ok), "ok", &h200), 1);
        assert_string_equal(o.warning, "");
        moe_oracle_free(&o);
    }
    unlink(path);
}

/* A decode table (moe-tune's fused-decode crossover): its bound is the layer's crossover for
 * its dtype and scales only, it names the file, and it survives a write and a read. */
static void test_decode_table(void **state)
{
    static const char text[] = GOOD_HEAD
        "\"decode\": [{\"dtype\": \"bf16\", \"scales\": \"none\", \"ep_size\": 1, "
        "\"tp_size\": 1, \"buckets\": [{\"max_tokens_per_step\": 8, \"path\": "
        "\"sm90_fused_decode\", \"at\": 8, \"time_us\": 120.5}, {\"path\": \"grouped\"}]}, "
        "{\"dtype\": \"fp8_e4m3\", \"scales\": \"per_channel\", \"buckets\": "
        "[{\"path\": \"sm90_fused_decode\"}]}, "
        "{\"dtype\": \"fp8_e4m3\", \"scales\": \"block_128\", \"buckets\": "
        "[{\"max_tokens_per_step\": 1, \"path\": \"sm90_fused_decode\"}, {\"path\": "
        "\"grouped\"}]}]}";
    moe_oracle_query_t q = {90, MOE_DTYPE_BF16, MOE_SCALE_NONE, 1, 1, MOE_ORACLE_ANY, 0, 0, 0.0, 0,
                            0};
    moe_oracle_choice_t c;
    moe_oracle_table_t t;
    moe_oracle_t o, back;
    char *out;
    size_t n;
    (void)state;

    moe_oracle_init(&o);
    assert_int_equal(moe_oracle_load_text(&o, text, strlen(text), "decode.json", &h200), 3);
    assert_string_equal(o.warning, "");
    assert_int_equal(moe_oracle_decode_tokens(&o, &q, &c), 8);
    assert_int_equal(c.source, MOE_ORACLE_TUNED);
    assert_string_equal(c.name, MOE_ORACLE_FUSED_DECODE);
    assert_string_equal(c.origin, "decode.json");
    assert_true(c.hi == 8.0);
    /* the decode table is not a GEMM table: the GEMM choice stays the built-in one */
    q.value = 1;
    assert_int_equal(moe_oracle_pick_gemm(&o, &q, &c), 1);
    assert_int_equal(c.source, MOE_ORACLE_DEFAULT);
    /* per-row fp8: all of it fused (the open bucket), as far as the kernel goes */
    q.dtype = MOE_DTYPE_FP8_E4M3, q.scale = MOE_SCALE_PER_CHANNEL;
    assert_int_equal(moe_oracle_decode_tokens(&o, &q, &c), INT32_MAX);
    /* block scales: the file's one token; without the file the built-in crossover (never:
     * the step's bytes not known) */
    q.scale = MOE_SCALE_BLOCK_128;
    assert_int_equal(moe_oracle_decode_tokens(&o, &q, &c), 1);
    assert_int_equal(c.source, MOE_ORACLE_TUNED);
    assert_string_equal(c.name, MOE_ORACLE_FUSED_DECODE);
    assert_int_equal(moe_oracle_decode_tokens(NULL, &q, &c), 0);
    assert_int_equal(c.source, MOE_ORACLE_DEFAULT);
    assert_string_equal(c.name, MOE_ORACLE_GROUPED_PATH);
    q.dtype = MOE_DTYPE_BF16, q.scale = MOE_SCALE_NONE, q.arch = 100;
    assert_int_equal(moe_oracle_decode_tokens(&o, &q, &c), 0);
    q.arch = 90, q.ep_size = 2; /* the bf16 table is for one GPU */
    assert_int_equal(moe_oracle_decode_tokens(&o, &q, &c), 0);
    q.ep_size = 1, q.tp_size = 2;
    assert_int_equal(moe_oracle_decode_tokens(NULL, &q, NULL), 0);
    /* bf16 on one sm_90 GPU without a table: the built-in crossover, one token */
    q.tp_size = 1;
    assert_int_equal(moe_oracle_decode_tokens(NULL, &q, &c), 1);
    assert_int_equal(c.source, MOE_ORACLE_DEFAULT);
    assert_string_equal(c.name, MOE_ORACLE_FUSED_DECODE);
    assert_true(c.hi == 1.0);
    /* per-row fp8 without a table: one token where a token's expert weights are within 192 MiB
     * and there is no shared expert; else (or the bytes not known) never */
    q.dtype = MOE_DTYPE_FP8_E4M3, q.scale = MOE_SCALE_PER_TENSOR;
    assert_int_equal(moe_oracle_decode_tokens(NULL, &q, &c), 0); /* bytes not known */
    q.token_bytes = 8.0 * 3 * 2048 * 768;                        /* Qwen3-30B-A3B: 37.7 MB */
    assert_int_equal(moe_oracle_decode_tokens(NULL, &q, &c), 1);
    assert_int_equal(c.source, MOE_ORACLE_DEFAULT);
    assert_string_equal(c.name, MOE_ORACLE_FUSED_DECODE);
    q.scale = MOE_SCALE_BLOCK_128; /* block scales: the same rule */
    assert_int_equal(moe_oracle_decode_tokens(NULL, &q, &c), 1);
    assert_string_equal(c.name, MOE_ORACLE_FUSED_DECODE);
    q.scale = MOE_SCALE_PER_TENSOR;
    q.token_bytes = 192.0 * 1024 * 1024;
    assert_int_equal(moe_oracle_decode_tokens(NULL, &q, &c), 1);
    q.token_bytes = 2.0 * 3 * 4096 * 14336; /* Mixtral-8x7B: 352 MB */
    assert_int_equal(moe_oracle_decode_tokens(NULL, &q, &c), 0);
    assert_string_equal(c.name, MOE_ORACLE_GROUPED_PATH);
    q.scale = MOE_SCALE_BLOCK_128;
    assert_int_equal(moe_oracle_decode_tokens(NULL, &q, &c), 0);
    q.scale = MOE_SCALE_PER_TENSOR;
    q.token_bytes = 4.0 * 3 * 2048 * 1408, q.shared = 1; /* Qwen2-MoE-A2.7B */
    assert_int_equal(moe_oracle_decode_tokens(NULL, &q, &c), 0);
    q.dtype = MOE_DTYPE_BF16, q.scale = MOE_SCALE_NONE; /* bf16: any size, shared or not */
    assert_int_equal(moe_oracle_decode_tokens(NULL, &q, &c), 1);
    q.token_bytes = 0.0, q.shared = 0;

    /* written and read back: the same tables and crossover */
    TU_OK(moe_oracle_parse(text, strlen(text), "decode.json", &t));
    out = format_text(&t, &n);
    assert_non_null(strstr(out, "\"decode\": ["));
    assert_non_null(strstr(out, "\"max_tokens_per_step\": 8"));
    /* one GPU: a decode table names no transport (the decode list comes last) */
    assert_null(strstr(strstr(out, "\"decode\": ["), "\"transport\""));
    moe_oracle_init(&back);
    assert_int_equal(moe_oracle_load_text(&back, out, n, "back", &h200), 3);
    assert_int_equal(back.tuned.group[0].kind, MOE_ORACLE_DECODE);
    assert_int_equal(back.tuned.group[0].num_buckets, 2);
    assert_true(back.tuned.group[0].bucket[0].time_us == 120.5);
    assert_int_equal(moe_oracle_decode_tokens(&back, &q, &c), 8);
    moe_oracle_free(&back);
    moe_oracle_table_free(&t);
    moe_oracle_free(&o);
    free(out);
}

/* A FIFO named as the tune file, read (MOE_TUNE_FILE) and written (moe-tune --out): refused at
 * once with a warning or an error naming it, never waited on (a blocking open of a FIFO
 * without a peer waits forever: the alarm turns a hang into a failure). */
static void expect_error(moe_status_t st, moe_status_t want, const char *needle);

static void test_fifo_tune_file(void **state)
{
    char *path = temp_path("tune.fifo");
    moe_oracle_table_t t;
    moe_oracle_t o;
    (void)state;
    unlink(path);
    assert_int_equal(mkfifo(path, 0600), 0);
    alarm(30);
    moe_oracle_init(&o);
    assert_int_equal(moe_oracle_load(&o, path, &h200), 0);
    assert_defaults(&o, "fifo");
    if (!strstr(o.warning, "is a FIFO (named pipe), not a regular file"))
        fail_msg("warning '%s' does not say FIFO", o.warning);
    setenv("MOE_TUNE_FILE", path, 1);
    assert_int_equal(moe_oracle_load_env(&o, &h200), 0);
    assert_defaults(&o, "MOE_TUNE_FILE fifo");
    unsetenv("MOE_TUNE_FILE");
    moe_oracle_free(&o);
    fixture_table(&t);
    expect_error(moe_oracle_write(path, &t), MOE_STATUS_IO_ERROR, "is a FIFO");
    moe_oracle_table_free(&t);
    alarm(0);
    unlink(path);
}

/* ---- forcing ---------------------------------------------------------------------------- */

static void expect_error(moe_status_t st, moe_status_t want, const char *needle)
{
    if (st != want)
        fail_msg("want %s, got %s (%s)", moe_status_string(want), moe_status_string(st),
                 moe_last_error());
    if (!strstr(moe_last_error(), needle))
        fail_msg("message '%s' does not name '%s'", moe_last_error(), needle);
}

static void test_forced(void **state)
{
    const char *name, *env;
    (void)state;
    unsetenv("MOE_FORCE_VARIANT");
    unsetenv("MOE_GEMM_VARIANT");
    TU_OK(moe_oracle_forced_variant(&name, &env));
    assert_null(name);
    setenv("MOE_GEMM_VARIANT", "sm90_swapab_n16", 1);
    TU_OK(moe_oracle_forced_variant(&name, &env));
    assert_string_equal(name, "sm90_swapab_n16");
    assert_string_equal(env, "MOE_GEMM_VARIANT");
    setenv("MOE_FORCE_VARIANT", "sm90_swapab_n16", 1);
    TU_OK(moe_oracle_forced_variant(&name, &env));
    assert_string_equal(env, "MOE_FORCE_VARIANT");
    setenv("MOE_FORCE_VARIANT", "sm90_swapab_n32", 1);
    expect_error(moe_oracle_forced_variant(&name, &env), MOE_STATUS_INVALID_ARGUMENT,
                 "MOE_FORCE_VARIANT=sm90_swapab_n32 and MOE_GEMM_VARIANT=sm90_swapab_n16");
    unsetenv("MOE_GEMM_VARIANT");
    TU_OK(moe_oracle_forced_variant(&name, &env));
    assert_string_equal(name, "sm90_swapab_n32");
    unsetenv("MOE_FORCE_VARIANT");

    unsetenv("MOE_FORCE_TRANSPORT");
    setenv("MOE_EP_TRANSPORT", "auto", 1);
    TU_OK(moe_oracle_forced_transport(&name, &env));
    assert_null(name);
    setenv("MOE_FORCE_TRANSPORT", "lsa", 1);
    TU_OK(moe_oracle_forced_transport(&name, &env));
    assert_string_equal(name, "lsa");
    assert_string_equal(env, "MOE_FORCE_TRANSPORT");
    setenv("MOE_EP_TRANSPORT", "p2p", 1);
    expect_error(moe_oracle_forced_transport(&name, &env), MOE_STATUS_INVALID_ARGUMENT,
                 "MOE_FORCE_TRANSPORT=lsa and MOE_EP_TRANSPORT=p2p");
    unsetenv("MOE_FORCE_TRANSPORT");
    TU_OK(moe_oracle_forced_transport(&name, &env));
    assert_string_equal(name, "p2p");
    assert_string_equal(env, "MOE_EP_TRANSPORT");
    unsetenv("MOE_EP_TRANSPORT");

    /* eligibility: by name, arch, dtype and scale kind */
    TU_OK(moe_oracle_check_variant("MOE_FORCE_VARIANT", "sm90_swapab_n16", 90, MOE_DTYPE_BF16,
                                   MOE_SCALE_NONE));
    TU_OK(moe_oracle_check_variant("MOE_FORCE_VARIANT", "sm80_mma_m32n128", 90, MOE_DTYPE_BF16,
                                   MOE_SCALE_NONE));
    TU_OK(moe_oracle_check_variant("MOE_FORCE_VARIANT", "sm80_mma_m64n128", 100, MOE_DTYPE_BF16,
                                   MOE_SCALE_NONE));
    TU_OK(moe_oracle_check_variant("MOE_FORCE_VARIANT", "simt_ref", 80, MOE_DTYPE_BF16,
                                   MOE_SCALE_NONE));
    TU_OK(moe_oracle_check_variant("MOE_FORCE_VARIANT", "sm90_fp8_block_m64n128", 90,
                                   MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128));
    /* the fused decode kernel: sm_90, bf16, per-row fp8 and fp8 with block scales */
    TU_OK(moe_oracle_check_variant("MOE_FORCE_VARIANT", "sm90_fused_decode", 90, MOE_DTYPE_BF16,
                                   MOE_SCALE_NONE));
    TU_OK(moe_oracle_check_variant("MOE_FORCE_VARIANT", "sm90_fused_decode", 90, MOE_DTYPE_FP8_E4M3,
                                   MOE_SCALE_PER_CHANNEL));
    TU_OK(moe_oracle_check_variant("MOE_FORCE_VARIANT", "sm90_fused_decode", 90, MOE_DTYPE_FP8_E4M3,
                                   MOE_SCALE_BLOCK_128));
    assert_true(moe_oracle_fused_decode_runs(90, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128));
    assert_false(moe_oracle_fused_decode_runs(80, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128));
    expect_error(moe_oracle_check_variant("MOE_FORCE_VARIANT", "sm90_fused_decode", 80,
                                          MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128),
                 MOE_STATUS_NOT_SUPPORTED, "MOE_FORCE_VARIANT=sm90_fused_decode runs on sm_90");
    expect_error(moe_oracle_check_variant("MOE_GEMM_VARIANT", "sm90_fused_decode", 80,
                                          MOE_DTYPE_BF16, MOE_SCALE_NONE),
                 MOE_STATUS_NOT_SUPPORTED, "this layer: sm_80");
    {
        const moe_oracle_query_t
            q = {90, MOE_DTYPE_BF16, MOE_SCALE_NONE, 1, 1, MOE_ORACLE_ANY, 1, 0, 0.0, 0, 0},
            f8 = {90, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_TENSOR, 1, 1, MOE_ORACLE_ANY, 1, 0, 0.0, 0,
                  0};
        assert_int_equal(moe_oracle_decode_tokens(NULL, &q, NULL), 1);
        assert_int_equal(moe_oracle_decode_tokens(NULL, &f8, NULL), 0);
    }
    expect_error(moe_oracle_check_variant("MOE_FORCE_VARIANT", "sm90_nope", 90, MOE_DTYPE_BF16,
                                          MOE_SCALE_NONE),
                 MOE_STATUS_INVALID_ARGUMENT, "MOE_FORCE_VARIANT=sm90_nope: no such variant");
    expect_error(
        moe_oracle_check_variant("MOE_GEMM_VARIANT", "", 90, MOE_DTYPE_BF16, MOE_SCALE_NONE),
        MOE_STATUS_INVALID_ARGUMENT, "no such variant");
    expect_error(moe_oracle_check_variant("MOE_FORCE_VARIANT", "sm90_swapab_n16", 80,
                                          MOE_DTYPE_BF16, MOE_SCALE_NONE),
                 MOE_STATUS_NOT_SUPPORTED, "MOE_FORCE_VARIANT=sm90_swapab_n16 is built for sm_90a");
    expect_error(moe_oracle_check_variant("MOE_FORCE_VARIANT", "sm90_swapab_n16", 100,
                                          MOE_DTYPE_BF16, MOE_SCALE_NONE),
                 MOE_STATUS_NOT_SUPPORTED, "(device: sm_100)");
    expect_error(moe_oracle_check_variant("MOE_FORCE_VARIANT", "sm80_mma_m32n128", 75,
                                          MOE_DTYPE_BF16, MOE_SCALE_NONE),
                 MOE_STATUS_NOT_SUPPORTED, "built for sm_80+");
    expect_error(moe_oracle_check_variant("MOE_FORCE_VARIANT", "sm90_fp8_m64n128", 90,
                                          MOE_DTYPE_BF16, MOE_SCALE_NONE),
                 MOE_STATUS_NOT_SUPPORTED, "is a fp8_e4m3 variant");
    expect_error(moe_oracle_check_variant("MOE_GEMM_VARIANT", "sm90_swapab_n16", 90,
                                          MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL),
                 MOE_STATUS_NOT_SUPPORTED, "MOE_GEMM_VARIANT=sm90_swapab_n16 is a bf16 variant");
    expect_error(moe_oracle_check_variant("MOE_FORCE_VARIANT", "sm90_fp8_m64n128", 90,
                                          MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128),
                 MOE_STATUS_NOT_SUPPORTED, "this layer computes in fp8_e4m3 (scales block_128)");
    expect_error(moe_oracle_check_variant("MOE_FORCE_VARIANT", "simt_ref", 90, MOE_DTYPE_FP8_E4M3,
                                          MOE_SCALE_PER_CHANNEL),
                 MOE_STATUS_NOT_SUPPORTED, "simt_ref is a bf16 variant");

    { /* a forced choice explains itself */
        moe_oracle_choice_t c = {
            "sm90_swapab_n16", MOE_ORACLE_FORCED, 0, 0, "MOE_FORCE_VARIANT", 90, 0};
        char why[256];
        moe_oracle_describe(&c, "rows/expert", 3, why, sizeof(why));
        assert_string_equal(why, "sm90_swapab_n16 (forced by MOE_FORCE_VARIANT)");
    }
}

/* bench/tune-h200.json (moe-tune on the H200: the three presets in bf16, Qwen3-30B-A3B in fp8)
 * loads for each of its shapes, and picks what the measurement found best (bench/RESULTS.md,
 * "Tuning": every table timed with every variant there is). Mixtral's and the DeepSeek-V3
 * shard's fp8 tables were dropped when the built-in fp8 table took the same measurement
 * (2026-12-03): their fp8 steps get the built-in choice. Qwen3's fp8 decode table (the grouped
 * path at every size, measured before the kernel's fp8 one-token path) was dropped on 2026-12-04:
 * the built-in crossover (one fp8 token for that shape) answers. */
static void test_shipped_h200_file(void **state)
{
    static const struct {
        moe_oracle_shape_t shape;
        moe_dtype_t dtype;
        double rows;
        const char *want;
        moe_oracle_source_t source;
    } cases[] = {
        {{4096, 14336, 8, 2}, MOE_DTYPE_BF16, 64, "sm90_wgmma_tma_m128n256", MOE_ORACLE_TUNED},
        {{2048, 768, 128, 8}, MOE_DTYPE_BF16, 1, "sm90_swapab_n8", MOE_ORACLE_TUNED},
        {{7168, 2048, 32, 8}, MOE_DTYPE_BF16, 16, "sm90_wgmma_tma_m64n256", MOE_ORACLE_TUNED},
        /* where the built-in table loses most (8.1 % and 11.0 %, bench/RESULTS.md) */
        {{2048, 768, 128, 8}, MOE_DTYPE_BF16, 256, "sm90_wgmma_tma_m64n256_pp", MOE_ORACLE_TUNED},
        {{7168, 2048, 32, 8}, MOE_DTYPE_BF16, 224, "sm90_wgmma_tma_m128n256", MOE_ORACLE_TUNED},
        /* bf16 Mixtral: m256n128 at 256 rows per expert, where the built-in m128n256 loses 2.5 % */
        {{4096, 14336, 8, 2}, MOE_DTYPE_BF16, 256, "sm90_wgmma_tma_m256n128", MOE_ORACLE_TUNED},
        /* fp8 Mixtral and DeepSeek-V3 shard: no table in the file, the built-in choice */
        {{4096, 14336, 8, 2}, MOE_DTYPE_FP8_E4M3, 1, "sm90_fp8_swapab_n8_pp", MOE_ORACLE_DEFAULT},
        {{7168, 2048, 32, 8}, MOE_DTYPE_FP8_E4M3, 320, "sm90_fp8_m192n128_p4", MOE_ORACLE_DEFAULT},
        {{7168, 2048, 32, 8}, MOE_DTYPE_FP8_E4M3, 2048, "sm90_fp8_m128n192_p4", MOE_ORACLE_DEFAULT},
        /* fp8 Qwen3: the file's table was measured before the ping-pong normal tiles and dropped
         * (2026-12-03); the built-in short-k table answers (hidden 2048) */
        {{2048, 768, 128, 8}, MOE_DTYPE_FP8_E4M3, 8, "sm90_fp8_swapab_n8_pp", MOE_ORACLE_DEFAULT},
        {{2048, 768, 128, 8}, MOE_DTYPE_FP8_E4M3, 48, "sm90_fp8_m64n128_pp_p4", MOE_ORACLE_DEFAULT},
        {{2048, 768, 128, 8}, MOE_DTYPE_FP8_E4M3, 512, "sm90_fp8_m192n128_p4", MOE_ORACLE_DEFAULT},
    };
    (void)state;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        moe_oracle_target_t t = {"NVIDIA H200", 90, cases[i].shape};
        moe_oracle_t o;
        moe_oracle_choice_t c;
        const int bf16 = cases[i].dtype == MOE_DTYPE_BF16;
        const moe_oracle_query_t q = {90,
                                      cases[i].dtype,
                                      bf16 ? MOE_SCALE_NONE : MOE_SCALE_PER_CHANNEL,
                                      1,
                                      1,
                                      MOE_ORACLE_ANY,
                                      cases[i].rows,
                                      cases[i].shape.hidden,
                                      0.0,
                                      0,
                                      0};
        moe_oracle_init(&o);
        assert_int_equal(moe_oracle_load(&o, MOE_TUNE_H200, &t), 1); /* one bf16 GEMM table */
        assert_string_equal(o.warning, "");
        assert_int_equal(moe_oracle_pick_gemm(&o, &q, &c), 1);
        assert_string_equal(c.name, cases[i].want);
        assert_int_equal(c.source, cases[i].source);
        if (!bf16 && cases[i].shape.experts == 128) { /* Qwen3's fp8 token: the built-in kernel */
            moe_oracle_query_t d = q;
            d.token_bytes = 8.0 * 3 * 2048 * 768;
            assert_int_equal(moe_oracle_decode_tokens(&o, &d, &c), 1);
            assert_int_equal(c.source, MOE_ORACLE_DEFAULT);
        }
        moe_oracle_free(&o);
    }
}

/* moe-tune's buckets from a coarse grid (--rows 1,4,16,64,256, bf16): a point keeps its
 * winner, neighbours that agree keep theirs between them, and wherever they disagree (or beyond
 * the grid) the built-in choice stays: the grid's n32 win at 16 rows must not reach 8 or 30. */
static const char *bucket_pick(const moe_oracle_group_t *g, double v)
{
    for (int i = 0; i < g->num_buckets; i++)
        if (v <= g->bucket[i].max)
            return g->bucket[i].name;
    return NULL;
}

static void test_buckets_from_points(void **state)
{
    (void)state;
    moe_oracle_group_t g;
    memset(&g, 0, sizeof(g));
    g.kind = MOE_ORACLE_GEMM;
    g.arch = 90;
    g.dtype = MOE_DTYPE_BF16;
    g.scale = MOE_SCALE_NONE;
    g.transport = MOE_ORACLE_ANY;
    const double at[] = {1, 4, 16, 64, 256};
    const double us[] = {10, 11, 12, 13, 14};
    const char *w[] = {"sm90_swapab_n8", "sm90_swapab_n8", "sm90_swapab_n32",
                       "sm90_wgmma_tma_m128n256", "sm90_wgmma_tma_m128n256"};
    int n = moe_oracle_buckets_from_points(&g, at, w, us, 5);
    assert_int_equal(n, g.num_buckets);
    assert_true(n > 0 && n <= MOE_ORACLE_MAX_BUCKETS);
    for (int i = 1; i < n; i++)
        assert_true(g.bucket[i].max > g.bucket[i - 1].max);
    assert_true(isinf(g.bucket[n - 1].max));
    /* points and agreeing neighbours */
    assert_string_equal(bucket_pick(&g, 1), "sm90_swapab_n8");
    assert_string_equal(bucket_pick(&g, 2.5), "sm90_swapab_n8");
    assert_string_equal(bucket_pick(&g, 4), "sm90_swapab_n8");
    assert_string_equal(bucket_pick(&g, 16), "sm90_swapab_n32");
    assert_string_equal(bucket_pick(&g, 64), "sm90_wgmma_tma_m128n256");
    assert_string_equal(bucket_pick(&g, 100), "sm90_wgmma_tma_m128n256");
    assert_string_equal(bucket_pick(&g, 256), "sm90_wgmma_tma_m128n256");
    /* disagreeing neighbours and beyond the grid: the built-in table (old_select) */
    const double between[] = {0.5, 4.5, 8, 12, 15.9, 17, 30, 50, 63.9, 300, 5000};
    for (size_t i = 0; i < sizeof(between) / sizeof(between[0]); i++)
        assert_string_equal(bucket_pick(&g, between[i]),
                            old_select(90, MOE_DTYPE_BF16, MOE_SCALE_NONE, between[i]));
    /* the measured point's time is kept with its bucket */
    for (int i = 0; i < n; i++)
        if (g.bucket[i].at == 16)
            assert_true(g.bucket[i].time_us == 12);
    /* no point ran: no table; a point with no winner is skipped */
    const char *none[] = {NULL, NULL, NULL, NULL, NULL};
    assert_int_equal(moe_oracle_buckets_from_points(&g, at, none, us, 5), 0);
    const char *gap[] = {"sm90_swapab_n8", NULL, "sm90_swapab_n8", NULL, NULL};
    assert_true(moe_oracle_buckets_from_points(&g, at, gap, NULL, 5) > 0);
    assert_string_equal(bucket_pick(&g, 10), "sm90_swapab_n8");
    assert_string_equal(bucket_pick(&g, 30), old_select(90, MOE_DTYPE_BF16, MOE_SCALE_NONE, 30));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_defaults_match_old_table),
        cmocka_unit_test(test_defaults_short_k),
        cmocka_unit_test(test_builtin_id),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_bad_tune_files),
        cmocka_unit_test(test_decode_table),
        cmocka_unit_test(test_forced),
        cmocka_unit_test(test_shipped_h200_file),
        cmocka_unit_test(test_buckets_from_points),
        cmocka_unit_test(test_fifo_tune_file),
        cmocka_unit_test(test_defaults_never_fast_accum),
        cmocka_unit_test(test_fast_accum_picks),
        cmocka_unit_test(test_fast_accum_tune_table),
        cmocka_unit_test(test_on_trial_named),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
