/* SPDX-License-Identifier: Apache-2.0 */
/* GPU permute (counts, padded offsets, block table, row maps), gather and combine against the
 * CPU reference (moe_cpu_group_rows and plain loops). */
#include "gpu_test.h"

#include "kernels/combine.h"
#include "kernels/cpu/moe_cpu.h"
#include "kernels/permute.h"

typedef struct perm_case {
    int E, k, block_rows;
    int skip_percent; /* ids set to -1 (not this rank's expert) */
} perm_case_t;

static const perm_case_t cases[] = {
    {8, 2, 128, 0}, {128, 8, 16, 0}, {32, 8, 64, 10},   {512, 16, 8, 0},
    {60, 4, 32, 0}, {1, 1, 16, 0},   {256, 8, 128, 50},
};

/* Distinct random experts per token; some skipped. */
static void random_ids(int32_t *ids, int64_t T, int E, int k, int skip_percent)
{
    int64_t t;
    int j, i;
    for (t = 0; t < T; t++)
        for (j = 0; j < k; j++) {
            int e, dup;
            do {
                e = gt_below(E);
                dup = 0;
                for (i = 0; i < j; i++)
                    dup |= ids[t * k + i] == e;
            } while (dup);
            ids[t * k + j] = e;
        }
    for (t = 0; t < T * k; t++)
        if (gt_below(100) < skip_percent)
            ids[t] = -1;
}

typedef struct dev_perm {
    int32_t *counts, *offsets, *block_expert, *num_blocks, *row_of_slot, *slot_of_row;
} dev_perm_t;

/* multi: give the permute its scratch (the multi-CTA pass past MOE_PERMUTE_CHUNK_ROWS rows);
 * 0: none (one CTA whatever the rows). Both must give the same stable grouping. */
static void check_case(const perm_case_t *c, int64_t T, moe_dtype_t xt, int multi)
{
    const int E = c->E, k = c->k, br = c->block_rows, H = 72; /* 72: 9 vectors of 8 */
    const int64_t n = T * k;
    const int mb = (int)moe_permute_max_blocks(n, E, br) + 3;
    const int64_t max_rows = (int64_t)mb * br;
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)(n + 1));
    int32_t *counts = malloc(sizeof(int32_t) * (size_t)E),
            *offsets = malloc(sizeof(int32_t) * (size_t)(E + 1));
    int32_t *bexp = malloc(sizeof(int32_t) * (size_t)mb), nb = 0;
    int32_t *ros = malloc(sizeof(int32_t) * (size_t)(n + 1)),
            *sor = malloc(sizeof(int32_t) * (size_t)max_rows);
    int32_t *grp = malloc(sizeof(int32_t) * (size_t)(n + 1));
    int64_t *roffs = malloc(sizeof(int64_t) * (size_t)(E + 2)),
            *order = malloc(sizeof(int64_t) * (size_t)(n + 1));
    float *x = malloc(sizeof(float) * (size_t)(T * H + 1));
    uint16_t *xb = malloc(2 * (size_t)(T * H + 1)), *a = malloc(2 * (size_t)max_rows * H);
    int64_t i, valid = 0, r;
    int e, expect_offset = 0;
    dev_perm_t d;
    int32_t *d_ids;
    void *d_x, *d_a;

    const int64_t scratch_count = multi ? moe_permute_scratch_count(n, E) : 0;
    int32_t *scratch =
        scratch_count ? gt_dalloc(sizeof(int32_t) * (size_t)scratch_count) : (int32_t *)NULL;
    int32_t *d_done = gt_dalloc(sizeof(int32_t)), done = -1;
    if (scratch)
        gt_poison(scratch, GT_POISON_INT, sizeof(int32_t) * (size_t)scratch_count);
    gt_ok(moe_gpu_memset_async(d_done, 0, sizeof(int32_t), NULL), "done");
    random_ids(ids, T, E, k, c->skip_percent);
    gt_fill_bf16(x, xb, (size_t)(T * H), 3.0f);
    d_ids = gt_dup(ids, sizeof(int32_t) * (size_t)(n + 1));
    d.counts = gt_dalloc(sizeof(int32_t) * (size_t)E);
    d.offsets = gt_dalloc(sizeof(int32_t) * (size_t)(E + 1));
    d.block_expert = gt_dalloc(sizeof(int32_t) * (size_t)mb);
    d.num_blocks = gt_dalloc(sizeof(int32_t));
    d.row_of_slot = gt_dalloc(sizeof(int32_t) * (size_t)(n + 1));
    d.slot_of_row = gt_dalloc(sizeof(int32_t) * (size_t)max_rows);
    gt_poison(d.counts, GT_POISON_INT, sizeof(int32_t) * (size_t)E);
    gt_poison(d.offsets, GT_POISON_INT, sizeof(int32_t) * (size_t)(E + 1));
    gt_poison(d.block_expert, GT_POISON_INT, sizeof(int32_t) * (size_t)mb);
    gt_poison(d.num_blocks, GT_POISON_INT, sizeof(int32_t));
    gt_poison(d.row_of_slot, GT_POISON_INT, sizeof(int32_t) * (size_t)(n + 1));
    gt_poison(d.slot_of_row, GT_POISON_INT, sizeof(int32_t) * (size_t)max_rows);
    d_x = xt == MOE_DTYPE_BF16 ? gt_dup(xb, 2 * (size_t)(T * H + 1))
                               : gt_dup(x, 4 * (size_t)(T * H + 1));
    d_a = gt_dalloc(2 * (size_t)max_rows * H);
    gt_poison(d_a, GT_POISON_FLOAT, 2 * (size_t)max_rows * H);
    {
        moe_permute_args_t p = {d_ids,
                                T,
                                k,
                                E,
                                br,
                                mb,
                                d.counts,
                                d.offsets,
                                d.block_expert,
                                d.num_blocks,
                                d.row_of_slot,
                                d.slot_of_row,
                                scratch,
                                scratch_count,
                                d_done,
                                {0}};
        moe_gather_args_t g = {d_x, xt,   H, k,  d.slot_of_row, d.num_blocks, br, mb,
                               d_a, NULL, 0, {0}};
        gt_ok(moe_permute_launch(&p, NULL), "permute");
        gt_ok(moe_gather_launch(&g, NULL), "gather");
    }
    gt_get(counts, d.counts, sizeof(int32_t) * (size_t)E);
    gt_get(offsets, d.offsets, sizeof(int32_t) * (size_t)(E + 1));
    gt_get(bexp, d.block_expert, sizeof(int32_t) * (size_t)mb);
    gt_get(&nb, d.num_blocks, sizeof(int32_t));
    gt_get(ros, d.row_of_slot, sizeof(int32_t) * (size_t)(n + 1));
    gt_get(sor, d.slot_of_row, sizeof(int32_t) * (size_t)max_rows);
    gt_get(a, d_a, 2 * (size_t)max_rows * H);
    gt_get(&done, d_done, sizeof(int32_t));
    assert_int_equal(done, 0); /* left for the next launch */

    /* Reference: stable grouping of the valid rows; skipped rows go to group E. */
    for (i = 0; i < n; i++)
        grp[i] = ids[i] >= 0 ? ids[i] : E;
    gt_ok(moe_cpu_group_rows(grp, n, E + 1, roffs, order), "cpu group rows");
    for (e = 0; e < E; e++) {
        const int cnt = (int)(roffs[e + 1] - roffs[e]);
        int j;
        assert_int_equal(counts[e], cnt);
        assert_int_equal(offsets[e], expect_offset);
        for (j = 0; j < cnt; j++) {
            const int64_t slot = order[roffs[e] + j];
            assert_int_equal(ros[slot], expect_offset + j);
            assert_int_equal(sor[expect_offset + j], slot);
        }
        for (j = cnt; j < (cnt + br - 1) / br * br; j++)
            assert_int_equal(sor[expect_offset + j], -1);
        for (j = 0; j < (cnt + br - 1) / br; j++)
            assert_int_equal(bexp[expect_offset / br + j], e);
        expect_offset += (cnt + br - 1) / br * br;
        valid += cnt;
    }
    assert_int_equal(offsets[E], expect_offset);
    assert_int_equal(nb, expect_offset / br);
    assert_true(nb <= moe_permute_max_blocks(n, E, br));
    for (i = nb; i < mb; i++)
        assert_int_equal(bexp[i], -1);
    for (i = 0; i < n; i++)
        if (ids[i] < 0)
            assert_int_equal(ros[i], -1);
    (void)valid;
    /* Gather: every used row is x's row in bf16, padding rows are zero. */
    for (r = 0; r < (int64_t)nb * br; r++) {
        const int32_t slot = sor[r];
        int h;
        for (h = 0; h < H; h++) {
            const uint16_t want = slot >= 0 ? xb[(slot / k) * H + h] : 0;
            if (a[r * H + h] != want) {
                fprintf(stderr, "gather E%d k%d br%d T%lld: row %lld col %d: %04x want %04x\n", E,
                        k, br, (long long)T, (long long)r, h, a[r * H + h], want);
                fail();
            }
        }
    }
    /* The scatter form: the same used rows; padding rows and rows past the blocks unwritten
     * (still poisoned). */
    {
        moe_gather_args_t g = {d_x,           xt, H,  k, d.slot_of_row, d.num_blocks, br, mb, d_a,
                               d.row_of_slot, T,  {0}};
        uint16_t poison;
        memset(&poison, GT_POISON_FLOAT, sizeof(poison));
        gt_poison(d_a, GT_POISON_FLOAT, 2 * (size_t)max_rows * H);
        gt_ok(moe_gather_launch(&g, NULL), "scatter");
        gt_get(a, d_a, 2 * (size_t)max_rows * H);
        for (r = 0; r < max_rows; r++) {
            const int32_t slot = r < (int64_t)nb * br ? sor[r] : -1;
            int h;
            for (h = 0; h < H; h++) {
                const uint16_t want = slot >= 0 ? xb[(slot / k) * H + h] : poison;
                if (a[r * H + h] != want) {
                    fprintf(stderr, "scatter E%d k%d br%d T%lld: row %lld col %d: %04x want %04x\n",
                            E, k, br, (long long)T, (long long)r, h, a[r * H + h], want);
                    fail();
                }
            }
        }
    }
    free(ids), free(counts), free(offsets), free(bexp), free(ros), free(sor), free(grp);
    free(roffs), free(order), free(x), free(xb), free(a);
    moe_gpu_free(d_ids), moe_gpu_free(d_x), moe_gpu_free(d_a);
    moe_gpu_free(d.counts), moe_gpu_free(d.offsets), moe_gpu_free(d.block_expert);
    moe_gpu_free(d.num_blocks), moe_gpu_free(d.row_of_slot), moe_gpu_free(d.slot_of_row);
    moe_gpu_free(scratch), moe_gpu_free(d_done);
}

static void test_permute_gather(void **state)
{
    size_t c;
    int t;
    (void)state;
    for (c = 0; c < sizeof(cases) / sizeof(cases[0]); c++)
        for (t = 0; t < GT_NUM_TOKEN_COUNTS; t++) {
            check_case(&cases[c], gt_token_counts[t], (t & 1) ? MOE_DTYPE_BF16 : MOE_DTYPE_F32, 1);
            if (gt_token_counts[t] * cases[c].k > MOE_PERMUTE_CHUNK_ROWS) /* the one-CTA path */
                check_case(&cases[c], gt_token_counts[t], MOE_DTYPE_BF16, 0);
        }
}

/* The all-to-all's receive regions: W regions of `rows` tokens, region r live for its first
 * counts[r] tokens (clamped to rows), global ids of which [first, first + E) are this rank's.
 * The region permute and scatter must give what the plain ones give on the local ids with every
 * dead slot -1 (test_permute_gather checks those against the CPU), must not touch a dead slot's
 * row_of_slot, and with a failed region (bad >= 0, status code 3) place nothing and record it. */
typedef struct region_case {
    int W;
    int64_t rows;
    int64_t counts[MOE_PERMUTE_MAX_REGIONS];
    int k, E, br, multi, bad;
} region_case_t;

static const region_case_t region_cases[] = {
    {2, 8192, {1, 0}, 8, 32, 64, 1, -1},    /* an untold decode round: capacity 8192, 1 token */
    {2, 8192, {1, 0}, 8, 32, 64, 0, -1},    /* the same in one CTA */
    {2, 8192, {0, 0}, 8, 32, 64, 1, -1},    /* a skipped (empty) round */
    {2, 300, {300, 0}, 8, 32, 64, 1, -1},   /* the 300/0 split */
    {2, 4096, {4096, 1}, 1, 16, 16, 1, -1}, /* 4097 live slots: the chunks, across regions */
    {4, 100, {7, 100, 0, 55}, 8, 16, 16, 1, -1},
    {8, 3000, {3000, 17, 0, 2999, 1, 3005, 1500, 64}, 4, 60, 128, 1, -1}, /* 3005: clamped */
    {2, 64, {64, 10}, 8, 32, 64, 1, 1},    /* region 1's step failed */
    {3, 50, {50, 50, 50}, 2, 8, 16, 0, 0}, /* region 0's, one CTA */
};

static void check_regions(const region_case_t *c)
{
    const int W = c->W, k = c->k, E = c->E, br = c->br, H = 72, first = E;
    const int64_t T = W * c->rows, n = T * k;
    const int mb = (int)moe_permute_max_blocks(n, E, br);
    const int64_t max_rows = (int64_t)mb * br;
    const int64_t scratch_count = c->multi ? moe_permute_scratch_count(n, E) : 0;
    int32_t *gids = malloc(sizeof(int32_t) * (size_t)n),
            *lids = malloc(sizeof(int32_t) * (size_t)n);
    int32_t *want[6], *got[6], cnt[MOE_PERMUTE_MAX_REGIONS], flags[MOE_PERMUTE_MAX_REGIONS];
    const size_t sizes[6] = {sizeof(int32_t) * (size_t)E,  sizeof(int32_t) * (size_t)(E + 1),
                             sizeof(int32_t) * (size_t)mb, sizeof(int32_t),
                             sizeof(int32_t) * (size_t)n,  sizeof(int32_t) * (size_t)max_rows};
    int32_t *dev[2][6], *d_ids[2], *d_cnt, *d_flags, *d_sticky, sticky = -1, *d_done, done = -1;
    int32_t *scratch =
        scratch_count ? gt_dalloc(sizeof(int32_t) * (size_t)scratch_count) : (int32_t *)NULL;
    uint16_t *xb = malloc(2 * (size_t)(T * H)), *a = malloc(2 * (size_t)max_rows * H), poison16;
    float *x = malloc(sizeof(float) * (size_t)(T * H));
    int32_t poison32;
    void *d_x, *d_a;
    int64_t i, r;
    int v, f, nb;

    memset(&poison32, GT_POISON_INT, sizeof(poison32));
    memset(&poison16, GT_POISON_FLOAT, sizeof(poison16));
    random_ids(gids, T, 4 * E, k, 10); /* 4 E experts in all, a tenth of the slots -1 */
    for (r = 0; r < W; r++) {
        cnt[r] = (int32_t)c->counts[r];
        flags[r] = r == c->bad ? 3 : 0;
    }
    for (i = 0; i < n; i++) {
        const int64_t reg = i / (c->rows * k), tok = i % (c->rows * k) / k;
        const int e = gids[i] - first;
        lids[i] = c->bad < 0 && tok < c->counts[reg] && e >= 0 && e < E ? e : -1;
    }
    d_ids[0] = gt_dup(lids, sizeof(int32_t) * (size_t)n);
    d_ids[1] = gt_dup(gids, sizeof(int32_t) * (size_t)n);
    d_cnt = gt_dup(cnt, sizeof(int32_t) * (size_t)W);
    d_flags = gt_dup(flags, sizeof(int32_t) * (size_t)W);
    d_sticky = gt_dalloc(sizeof(int32_t));
    gt_ok(moe_gpu_memset_async(d_sticky, 0, sizeof(int32_t), NULL), "sticky");
    d_done = gt_dalloc(sizeof(int32_t)); /* both launches count on it */
    gt_ok(moe_gpu_memset_async(d_done, 0, sizeof(int32_t), NULL), "done");
    for (v = 0; v < 2; v++) /* 0: plain on the local ids, 1: the regions on the global ones */
        for (f = 0; f < 6; f++) {
            dev[v][f] = gt_dalloc(sizes[f]);
            gt_poison(dev[v][f], GT_POISON_INT, sizes[f]);
        }
    for (v = 0; v < 2; v++) {
        moe_permute_args_t p = {
            d_ids[v],  T,         k,         E,         br,        mb,      dev[v][0],
            dev[v][1], dev[v][2], dev[v][3], dev[v][4], dev[v][5], scratch, scratch_count,
            d_done,    {0}};
        if (v == 1) {
            p.regions.counts = d_cnt;
            p.regions.rows = c->rows;
            p.regions.regions = W;
            p.regions.first = first;
            p.regions.flags = d_flags;
            p.regions.sticky = d_sticky;
        }
        gt_ok(moe_permute_launch(&p, NULL), v ? "region permute" : "plain permute");
    }
    for (f = 0; f < 6; f++) {
        want[f] = malloc(sizes[f]);
        got[f] = malloc(sizes[f]);
        gt_get(want[f], dev[0][f], sizes[f]);
        gt_get(got[f], dev[1][f], sizes[f]);
    }
    gt_get(&sticky, d_sticky, sizeof(int32_t));
    gt_get(&done, d_done, sizeof(int32_t));
    assert_int_equal(done, 0);
    nb = want[3][0];
    assert_int_equal(got[3][0], nb);
    assert_memory_equal(got[0], want[0], sizes[0]);
    assert_memory_equal(got[1], want[1], sizes[1]);
    assert_memory_equal(got[2], want[2], sizes[2]);
    assert_memory_equal(got[5], want[5], sizeof(int32_t) * (size_t)nb * br);
    for (i = 0; i < n; i++) { /* a live slot's row, a dead slot untouched */
        const int64_t reg = i / (c->rows * k), tok = i % (c->rows * k) / k;
        if (got[4][i] != (tok < c->counts[reg] ? want[4][i] : poison32)) {
            fprintf(stderr, "regions W%d rows %lld: row_of_slot[%lld] = %d\n", W,
                    (long long)c->rows, (long long)i, got[4][i]);
            fail();
        }
    }
    assert_int_equal(sticky, c->bad >= 0 ? (c->bad << 8) | 3 : 0);
    if (c->bad >= 0)
        assert_int_equal(nb, 0);

    /* the scatter over the regions: the used rows from x, the rest untouched */
    gt_fill_bf16(x, xb, (size_t)(T * H), 3.0f);
    d_x = gt_dup(xb, 2 * (size_t)(T * H));
    d_a = gt_dalloc(2 * (size_t)max_rows * H);
    gt_poison(d_a, GT_POISON_FLOAT, 2 * (size_t)max_rows * H);
    {
        moe_gather_args_t g = {d_x, MOE_DTYPE_BF16, H, k,  dev[1][5], dev[1][3], br, mb,
                               d_a, dev[1][4],      T, {0}};
        g.regions.counts = d_cnt;
        g.regions.rows = c->rows;
        g.regions.regions = W;
        gt_ok(moe_gather_launch(&g, NULL), "region scatter");
    }
    gt_get(a, d_a, 2 * (size_t)max_rows * H);
    for (r = 0; r < max_rows; r++) {
        const int32_t slot = r < (int64_t)nb * br ? got[5][r] : -1;
        int h;
        for (h = 0; h < H; h++) {
            const uint16_t w = slot >= 0 ? xb[(slot / k) * H + h] : poison16;
            if (a[r * H + h] != w) {
                fprintf(stderr, "region scatter W%d rows %lld: row %lld col %d: %04x want %04x\n",
                        W, (long long)c->rows, (long long)r, h, a[r * H + h], w);
                fail();
            }
        }
    }
    for (f = 0; f < 6; f++) {
        free(want[f]), free(got[f]);
        moe_gpu_free(dev[0][f]), moe_gpu_free(dev[1][f]);
    }
    free(gids), free(lids), free(xb), free(a), free(x);
    moe_gpu_free(d_ids[0]), moe_gpu_free(d_ids[1]), moe_gpu_free(d_cnt), moe_gpu_free(d_flags);
    moe_gpu_free(d_sticky), moe_gpu_free(scratch), moe_gpu_free(d_x), moe_gpu_free(d_a);
    moe_gpu_free(d_done);
}

static void test_permute_regions(void **state)
{
    size_t c;
    (void)state;
    for (c = 0; c < sizeof(region_cases) / sizeof(region_cases[0]); c++)
        check_regions(&region_cases[c]);
}

/* The shared-MLP rows: x in bf16, zero padding, one-group block table. */
static void test_rows(void **state)
{
    const int H = 36, br = 64; /* 36: not a multiple of 8, the scalar path */
    int t;
    (void)state;
    for (t = 0; t < GT_NUM_TOKEN_COUNTS; t++) {
        const int64_t T = gt_token_counts[t];
        const int mb = (int)((T + br - 1) / br) + 2;
        const size_t rows = (size_t)mb * br;
        float *x = malloc(sizeof(float) * (size_t)(T * H + 1));
        uint16_t *a = malloc(2 * rows * H);
        int32_t *be = malloc(sizeof(int32_t) * (size_t)mb), nb = -5;
        void *d_x = NULL, *d_a = gt_dalloc(2 * rows * H);
        int32_t *d_be = gt_dalloc(sizeof(int32_t) * (size_t)mb), *d_nb = gt_dalloc(4);
        size_t r;
        int h, b;
        gt_fill_bf16(x, NULL, (size_t)(T * H), 2.0f);
        d_x = gt_dup(x, sizeof(float) * (size_t)(T * H + 1));
        gt_poison(d_a, GT_POISON_FLOAT, 2 * rows * H);
        gt_poison(d_be, GT_POISON_INT, sizeof(int32_t) * (size_t)mb);
        gt_poison(d_nb, GT_POISON_INT, 4);
        {
            moe_rows_args_t ra = {d_x, MOE_DTYPE_F32, T, H, br, mb, d_a, d_be, d_nb};
            gt_ok(moe_rows_launch(&ra, NULL), "rows");
        }
        gt_get(a, d_a, 2 * rows * H);
        gt_get(be, d_be, sizeof(int32_t) * (size_t)mb);
        gt_get(&nb, d_nb, 4);
        assert_int_equal(nb, (T + br - 1) / br);
        for (b = 0; b < mb; b++)
            assert_int_equal(be[b], b < nb ? 0 : -1);
        for (r = 0; r < rows; r++)
            for (h = 0; h < H; h++)
                assert_int_equal(a[r * H + h], (int64_t)r < T ? moe_f32_to_bf16(x[r * H + h]) : 0);
        free(x), free(a), free(be);
        moe_gpu_free(d_x), moe_gpu_free(d_a), moe_gpu_free(d_be), moe_gpu_free(d_nb);
    }
}

/* combine: weighted sum in slot order plus the (gated) shared row, f32 or bf16 y; 1..16 slots a
 * token. */
static void check_combine(int64_t T, int k, int H, int shared, int gate, moe_dtype_t yt)
{
    const int64_t rows = T * k + 7;
    uint16_t *out = malloc(2 * (size_t)(rows * H)), *sh = malloc(2 * (size_t)(T * H + 1));
    float *outf = malloc(sizeof(float) * (size_t)(rows * H)),
          *shf = malloc(sizeof(float) * (size_t)(T * H + 1));
    float *w = malloc(sizeof(float) * (size_t)(T * k + 1)),
          *g = malloc(sizeof(float) * (size_t)(T + 1));
    int32_t *ros = malloc(sizeof(int32_t) * (size_t)(T * k + 1));
    float *ref = malloc(sizeof(float) * (size_t)(T * H + 1)),
          *y = malloc(sizeof(float) * (size_t)(T * H + 1));
    uint16_t *yb = malloc(2 * (size_t)(T * H + 1));
    void *d_out, *d_sh, *d_y;
    float *d_w, *d_g;
    int32_t *d_ros;
    int64_t t, i;
    int j, h;

    gt_fill_bf16(outf, out, (size_t)(rows * H), 2.0f);
    gt_fill_bf16(shf, sh, (size_t)(T * H), 2.0f);
    for (i = 0; i < T * k; i++) {
        w[i] = 0.5f * (gt_uniform() + 1.0f);
        ros[i] = gt_below(10) == 0 ? -1 : gt_below((int)rows);
    }
    for (t = 0; t < T; t++)
        g[t] = 3.0f * gt_uniform();
    for (t = 0; t < T; t++)
        for (h = 0; h < H; h++) {
            float acc = 0.0f;
            for (j = 0; j < k; j++)
                if (ros[t * k + j] >= 0)
                    acc += w[t * k + j] * outf[(int64_t)ros[t * k + j] * H + h];
            if (shared)
                acc += (gate ? 1.0f / (1.0f + expf(-g[t])) : 1.0f) * shf[t * H + h];
            ref[t * H + h] = acc;
        }
    d_out = gt_dup(out, 2 * (size_t)(rows * H));
    d_sh = gt_dup(sh, 2 * (size_t)(T * H + 1));
    d_w = gt_dup(w, sizeof(float) * (size_t)(T * k + 1));
    d_g = gt_dup(g, sizeof(float) * (size_t)(T + 1));
    d_ros = gt_dup(ros, sizeof(int32_t) * (size_t)(T * k + 1));
    d_y = gt_dalloc(4 * (size_t)(T * H + 1));
    gt_poison(d_y, GT_POISON_FLOAT, 4 * (size_t)(T * H + 1));
    {
        moe_combine_args_t c = {d_out, d_ros, d_w, shared ? d_sh : NULL, gate ? d_g : NULL, d_y, yt,
                                T,     H,     k};
        gt_ok(moe_combine_launch(&c, NULL), "combine");
    }
    if (yt == MOE_DTYPE_F32) {
        gt_get(y, d_y, sizeof(float) * (size_t)(T * H));
    } else {
        gt_get(yb, d_y, 2 * (size_t)(T * H));
        moe_convert_to_f32(MOE_DTYPE_BF16, yb, y, (size_t)(T * H));
    }
    for (i = 0; i < T * H; i++) {
        const float tol = yt == MOE_DTYPE_F32 ? 1e-5f : 8e-3f;
        if (!(fabsf(y[i] - ref[i]) <= tol * fmaxf(1.0f, fabsf(ref[i])))) {
            fprintf(stderr, "combine T%lld k%d H%d: [%lld] %g vs %g\n", (long long)T, k, H,
                    (long long)i, (double)y[i], (double)ref[i]);
            fail();
        }
    }
    free(out), free(sh), free(outf), free(shf), free(w), free(g), free(ros), free(ref), free(y);
    free(yb);
    moe_gpu_free(d_out), moe_gpu_free(d_sh), moe_gpu_free(d_w), moe_gpu_free(d_g);
    moe_gpu_free(d_ros), moe_gpu_free(d_y);
}

static void test_combine(void **state)
{
    int t;
    (void)state;
    for (t = 0; t < GT_NUM_TOKEN_COUNTS; t++) {
        const int64_t T = gt_token_counts[t] > 1024 ? 1024 : gt_token_counts[t];
        check_combine(T, 8, 256, 0, 0, MOE_DTYPE_F32);
        check_combine(T, 2, 136, 1, 1, MOE_DTYPE_BF16);
        check_combine(T, 4, 33, 1, 0, MOE_DTYPE_F32); /* scalar path */
        /* past one batch of slots (kernels/cuda/combine.cu: 8 at up to 64 tokens, one at a time
         * above), a partial second one */
        check_combine(T, 11, 64, 1, 1, MOE_DTYPE_BF16);
        check_combine(T, 16, 40, 0, 0, MOE_DTYPE_F32);
    }
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_permute_gather),
    cmocka_unit_test(test_permute_regions),
    cmocka_unit_test(test_rows),
    cmocka_unit_test(test_combine),
};

GT_MAIN(tests)
