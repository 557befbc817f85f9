/* SPDX-License-Identifier: Apache-2.0 */
/* The oracle's tables (built in, tuned, forced), its picks, and the tune file reader/writer. */
#include "runtime/oracle.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/expert_gemm_table.h"
#include "base/diag.h"
#include "runtime/formats/file.h"
#include "base/json.h"

/* ---- built-in tables: rows per expert at or below which each variant is the default,
 * measured on the H200 (docs/KERNELS.md, bench/RESULTS.md "Tuning"). ---------------------- */

/* A built-in GEMM table for layers whose hidden (GEMM 1's k) is at most h (0: any shape, any
 * layout); a bounded table is placed before the one for any shape, which answers the rest. */
#define BUILTIN_GROUP(h, accum, arch, dtype, scale, n, ...)                                        \
    {                                                                                              \
        MOE_ORACLE_GEMM, arch, {0, 0, 0, 0}, dtype, scale, 0, 0, MOE_ORACLE_ANY, n, {__VA_ARGS__}, \
            h, "", accum                                                                           \
    }
#define BUILTIN_SHORT_K(h, arch, dtype, scale, n, ...)                                             \
    BUILTIN_GROUP(h, MOE_ORACLE_ACCUM_PROMOTED, arch, dtype, scale, n, __VA_ARGS__)
#define BUILTIN(arch, dtype, scale, n, ...) BUILTIN_SHORT_K(0, arch, dtype, scale, n, __VA_ARGS__)
/* fp8_math W8A8_FAST, per-row scales: MOE_ORACLE_PROMOTED_PATH where the promoted tables decide */
#define BUILTIN_FAST(h, n, ...)                                                                    \
    BUILTIN_GROUP(h, MOE_ORACLE_ACCUM_FAST, 90, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL, n,      \
                  __VA_ARGS__)
#define OPEN HUGE_VAL

static const moe_oracle_group_t defaults[] = {
    /* moe-tune on the H200 for Mixtral, Qwen3-30B-A3B and the DeepSeek-V3 EP8 shard at 1, 2, 4,
     * ... 256 rows per expert (2026-12-01, commit b627729; bench/RESULTS.md, "Tuning"): the variant
     * with the smallest worst loss over the three shapes, bounds halfway (geometrically) between
     * the points */
    /* ... and one block per expert where most experts fit one: m192n128 (three consumer
     * warpgroups) at about 120 to 180 rows per expert on average, m256n128 (four) up to 248. Each
     * weight tile is then read once per expert, not twice (docs/KERNELS.md, "How the thresholds
     * were chosen").
     * Up to 45 rows, where one 64-row item covers an expert, the ping-pong m64n256 (two consumer
     * warpgroups on alternate items: one's epilogue under the other's wgmmas) is 2-6% faster
     * than m64n256 (the same section) */
    BUILTIN(90, MOE_DTYPE_BF16, MOE_SCALE_NONE, 8, {5.66, "sm90_swapab_n8", 0, 0},
            {11.3, "sm90_swapab_n16", 0, 0}, {22.6, "sm90_swapab_w128_n32", 0, 0},
            {45.3, "sm90_wgmma_tma_m64n256_pp", 0, 0}, {119.7, "sm90_wgmma_tma_m128n256", 0, 0},
            {180.0, "sm90_wgmma_tma_m192n128", 0, 0}, {247.9, "sm90_wgmma_tma_m256n128", 0, 0},
            {OPEN, "sm90_wgmma_tma_m128n256", 0, 0}),
    /* FP8 per-tensor / per-channel (per-row scales): measured as above; m192n128 (one block per
     * expert) at 120..184 rows per expert, 3-23% faster there (docs/KERNELS.md, "FP8 W8A8
     * (sm_90a)"). The swap-AB tiles as ping-pong (_pp: two consumer warpgroups on alternate
     * items), 1-26% faster than one (2026-12-03, bench/RESULTS.md, "Layer step, FP8 W8A8").
     * n8_pp up to 11.3 (0.0625..8 rows: 1-4% faster than n16_pp, Mixtral at 2 rows 1% slower);
     * the tiles promoted every 512 of k (_p4): m128n128_p4 2-9% faster at 64..512 rows,
     * m192n128_p4 1-4% on Mixtral and the DeepSeek-V3 shard at 128 (Qwen3 1% slower), n32_pp_p4
     * 1-4% faster than n32_pp at 48 and 64 rows and 4-7% faster than m128n128_p4 at 48 (Qwen3
     * 17%), so it runs to 55.4. From moe-tune on the three shapes at 48..320 rows (the same
     * day, bench/RESULTS.md, "Tuning"), the smallest worst loss per point: m192n128_p4 also at 192
     * (worst loss 1.5% against m128n128_p4's 7.7%) and 320 (4-5% faster on all three), m128n128_p4
     * at 224 (8-26% faster) and 256 (worst loss 2.9% against 4.0%) (docs/KERNELS.md, "Promotion
     * interval"). Past 320 rows m192n128_p4 as well (it was m128n128_p4): forced against it at 512
     * and 2048 rows per expert (2026-12-04, 3e6d478, two runs, bench/RESULTS.md, "Layer step, FP8
     * W8A8"), Mixtral 0.89-0.91 / 0.96, the DeepSeek-V3 shard 0.97-0.99 / 0.93, Qwen3 at 512 0.98:
     * a weight tile read once per 192 rows instead of 128 (the L2's bytes per flop). Past 724.1
     * rows (halfway between 512 and 1024) the n192 tile (two consumer warpgroups, 96 outputs a
     * row each): forced against the table before (2026-12-05, 2f6a09f, two runs, capacity 8192,
     * bench/RESULTS.md, "Wider promoted tiles"), Mixtral 0.944-0.955 at 1024 / 2048 rows per
     * expert and 1.02-1.04 at 256 / 512, the DeepSeek-V3 shard 0.937-0.988 at 1024 / 2048 and
     * 0.97-1.00 at 256 / 512. Block scales keep m192n128: their n192 tile (a promotion every 128
     * of k over 96 partial sums) was 1.01-1.19 at every one of those points. Not in the short-k
     * table: Qwen3's GEMM 2 (n 2048, k 768) lost with it in gemm_bench at every count. */
    /* FP8, hidden <= 2048 (GEMM 1's k 16 slices of 128, GEMM 2's the intermediate): the ping-pong
     * m64n128 tiles (two consumer warpgroups on alternate 64-row items: one's promotions and
     * epilogue under the other's wgmmas) against the tables below, forced at 16..512 rows per
     * expert on Qwen3-30B-A3B (I 768), Qwen2-MoE (I 1408, 60 experts, top 4) and Qwen3 with
     * I 1536 (2026-12-03, bench/RESULTS.md, "Ping-pong fp8 tiles"): per-row scales 0.87-0.97 at
     * 32..68 rows, at 128..136 0.88 / 0.91 (Qwen3, I 1536) and 1.04 (Qwen2), 0.92 at 192
     * (Qwen3), 0.98-1.03 at 256..273, 1.03-1.09 at 512, 1.13 at 16; block scales 0.67-0.90 at
     * 16..68, 0.95 / 1.13 at 128..136, 1.05-1.11 at 512. With hidden 4096 (Mixtral, I 2048) or
     * 7168 (the DeepSeek-V3 shard, I 768 / 1024 / 2048) they were 1-17 % slower at every point
     * from 16 rows, hence the bound. */
    BUILTIN_SHORT_K(2048, 90, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL, 5,
                    {11.3, "sm90_fp8_swapab_n8_pp", 0, 0}, {22.6, "sm90_fp8_swapab_n16_pp", 0, 0},
                    {221.7, "sm90_fp8_m64n128_pp_p4", 0, 0}, {286.2, "sm90_fp8_m128n128_p4", 0, 0},
                    {OPEN, "sm90_fp8_m192n128_p4", 0, 0}),
    BUILTIN_SHORT_K(
        2048, 90, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128, 5,
        {5.66, "sm90_fp8_block_swapab_n8_pp", 0, 0}, {11.3, "sm90_fp8_block_swapab_n16_pp", 0, 0},
        {90.5, "sm90_fp8_block_m64n128_pp", 0, 0}, {119.7, "sm90_fp8_block_m128n128", 0, 0},
        {OPEN, "sm90_fp8_block_m192n128", 0, 0}),
    BUILTIN(90, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL, 8, {11.3, "sm90_fp8_swapab_n8_pp", 0, 0},
            {22.6, "sm90_fp8_swapab_n16_pp", 0, 0}, {55.4, "sm90_fp8_swapab_n32_pp_p4", 0, 0},
            {119.7, "sm90_fp8_m128n128_p4", 0, 0}, {207.4, "sm90_fp8_m192n128_p4", 0, 0},
            {286.2, "sm90_fp8_m128n128_p4", 0, 0}, {724.1, "sm90_fp8_m192n128_p4", 0, 0},
            {OPEN, "sm90_fp8_m128n192_p4", 0, 0}),
    /* FP8 128x128 blocks: the bf16 table's first crossovers (not tuned), m192n128 at 136..184
     * rows per expert, 10-20% faster there (measured as the per-row table's); the swap-AB tiles
     * as ping-pong, n16 0-5% faster, n32 6% on Qwen3 at 32 rows per expert and level on the other
     * two (2026-12-03, as above). n8_pp (this table and the short-k one) up to 5.66 rows, halfway
     * from its last measured point: 1-9 % faster than n16_pp at 0.06..4 rows per expert on the
     * three shapes (2026-12-04, bench/RESULTS.md, "Layer step, FP8 W8A8"; 8 rows unmeasured).
     * m192n128 from 119.7 rows on (the per-row tables' bound; it was m128n128 outside 136..184):
     * forced at 128, 512 and 2048 rows per expert (2026-12-04, ca8b374's tree, two runs), Mixtral
     * 0.85-0.87 / 0.90-0.92 / 0.93-0.95, the DeepSeek-V3 shard 0.91 / 0.89-0.92 / 0.93-0.94,
     * Qwen3 at 128 / 512 0.96 / 0.91-0.92. m128n128 from 55.4 rows (it was 96: the bf16 table's
     * crossover), halfway between measured points: forced against m64n128 (2026-12-04, 4b498e6,
     * two runs, bench/RESULTS.md, "Layer step, FP8 W8A8"), Mixtral 1.10-1.13 / 0.98-1.00 / 0.78 at
     * 48 / 64 / 96 rows per expert, the DeepSeek-V3 shard 1.01-1.09 / 0.92-0.94 / 0.76-0.77.
     * Past 362 rows (halfway, geometrically, between 256 and 512) m192n128_la, the same tile with
     * each consumer warpgroup's next item's first stage issued before its epilogue: forced
     * against the table (2026-12-05, 8631004, one H100, two runs, capacity 8192; bench/RESULTS.md,
     * "Epilogue under the next item"), the DeepSeek-V3 shard 1.01-1.04 / 0.96 / 0.94 / 0.91-0.95
     * at 256 / 512 / 1024 / 2048 rows per expert, Mixtral 0.91-0.96 / 0.93-0.95 at 512 / 2048.
     * Not in the short-k table (Qwen3-30B-A3B's block layer unmeasured with it). */
    BUILTIN(
        90, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128, 7, {5.66, "sm90_fp8_block_swapab_n8_pp", 0, 0},
        {16.0, "sm90_fp8_block_swapab_n16_pp", 0, 0}, {32.0, "sm90_fp8_block_swapab_n32_pp", 0, 0},
        {55.4, "sm90_fp8_block_m64n128", 0, 0}, {119.7, "sm90_fp8_block_m128n128", 0, 0},
        {362.0, "sm90_fp8_block_m192n128", 0, 0}, {OPEN, "sm90_fp8_block_m192n128_la", 0, 0}),
    /* fp8_math W8A8_FAST with hidden <= 2048 (the table for any shape is next): the fast
     * m64n256 tile as ping-pong (two consumer warpgroups on alternate 64-row items: one's
     * epilogue under the other's wgmmas) from 32.0 rows per expert (halfway between 16 and 64):
     * forced on Qwen3-30B-A3B (hidden 2048) against the built-in choice of the day (2026-12-05,
     * one H200, two runs, capacity 8192,
     * bench/RESULTS.md "Fast accumulation"), 1.05 at 16 rows per expert (against the promoted
     * n16_pp), 0.95 at 64 and 0.93 at 128 (m64n128_pp_p4), 0.95 at 256 and 0.97-0.98 at 512
     * (fast m128n256). With hidden 4096 (Mixtral) 0.97-0.98 at 128, 0.95 at 512 and level at
     * 256 / 1024 but 1.03-1.04 at 2048; with 7168 (the DeepSeek-V3 shard) 0.96-1.08 at 256..2048:
     * not in the table for any shape. */
    BUILTIN_FAST(2048, 2, {32.0, MOE_ORACLE_PROMOTED_PATH, 0, 0},
                 {OPEN, "sm90_fp8_fast_m64n256_pp", 0, 0}),
    /* fp8_math W8A8_FAST (no promotion allowed) with per-row scales: the fast m128n256 tile
     * (no second accumulator set, so 128 gate + 128 up weight rows an item) past 207.4 rows per
     * expert, where the promoted table's one-block m192n128_p4 ends. Forced for every GEMM of the
     * step against the built-in tiles, Mixtral-8x7B / the DeepSeek-V3 shard at 128 rows per
     * expert 1.03 / 0.99, at 512 0.81 / 0.81, at 2048 0.77 / 0.79 (2026-12-02, d8b75f0), and at
     * Mixtral's 2048 0.81-0.83 of m128n128_p4 (2026-12-04), of which the m192n128_p4 and n192
     * tiles since took 4-11 % (bench/RESULTS.md, "Layer step, FP8 W8A8"). Against the built-in
     * W8A8 choice at a capacity of 8192 (2026-12-05, 8631004, one H100, bench/RESULTS.md, "Fast
     * accumulation"): Mixtral 0.89 / 0.90 and the DeepSeek-V3 shard 0.87 / 0.93 at 512 / 2048
     * rows per expert; Mixtral at 256 rows 0.94 (against m128n128_p4), but at 128 and 160 rows
     * 1.07-1.11 and 1.25-1.27 against the one-block m192n128_p4 (2026-12-05, one H200). */
    BUILTIN_FAST(0, 2, {207.4, MOE_ORACLE_PROMOTED_PATH, 0, 0},
                 {OPEN, "sm90_fp8_fast_m128n256", 0, 0}),
    /* sm_80 .. sm_89 and anything newer than sm_90 (the sm_80 family's PTX) */
    BUILTIN(80, MOE_DTYPE_BF16, MOE_SCALE_NONE, 2, {32.0, "sm80_mma_m32n128", 0, 0},
            {OPEN, "sm80_mma_m64n128", 0, 0}),
};
#define NUM_DEFAULTS ((int)(sizeof(defaults) / sizeof(defaults[0])))

const moe_oracle_group_t *moe_oracle_defaults(int *count)
{
    *count = NUM_DEFAULTS;
    return defaults;
}

/* FNV-1a over the built-in tables' keys, bounds (as text: the same on every host) and names. */
static void fnv(uint64_t *h, const char *text)
{
    for (; *text; text++)
        *h = (*h ^ (unsigned char)*text) * 0x100000001b3ull;
}

static char builtin_id[17];

static void builtin_id_init(void)
{
    uint64_t h = 0xcbf29ce484222325ull;
    char item[128];
    for (int i = 0; i < NUM_DEFAULTS; i++) {
        const moe_oracle_group_t *g = &defaults[i];
        snprintf(item, sizeof(item), "%d %d %d %d %d %d %d %d|", (int)g->kind, g->arch,
                 (int)g->dtype, (int)g->scale, g->transport, g->max_hidden, g->num_buckets,
                 g->accum);
        fnv(&h, item);
        for (int j = 0; j < g->num_buckets; j++) {
            snprintf(item, sizeof(item), "%.9g %s|", g->bucket[j].max, g->bucket[j].name);
            fnv(&h, item);
        }
    }
    snprintf(builtin_id, sizeof(builtin_id), "%016llx", (unsigned long long)h);
}

const char *moe_oracle_builtin_id(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, builtin_id_init);
    return builtin_id;
}

/* ---- names ------------------------------------------------------------------------------ */

static const char *const transport_names[] = {"allgather", "lsa", "p2p"};

const char *moe_oracle_transport_name(int t)
{
    return t >= 0 && t < 3 ? transport_names[t] : "any";
}

int moe_oracle_transport_by_name(const char *name)
{
    if (!name)
        return -2;
    if (!strcmp(name, "any"))
        return MOE_ORACLE_ANY;
    for (int i = 0; i < 3; i++)
        if (!strcmp(name, transport_names[i]))
            return i;
    return -2;
}

const char *moe_oracle_dtype_name(moe_dtype_t d)
{
    return d == MOE_DTYPE_BF16 ? "bf16" : d == MOE_DTYPE_FP8_E4M3 ? "fp8_e4m3" : "invalid";
}

const char *moe_oracle_scale_name(moe_scale_kind_t s)
{
    switch (s) {
    case MOE_SCALE_NONE:
        return "none";
    case MOE_SCALE_PER_TENSOR:
        return "per_tensor";
    case MOE_SCALE_BLOCK_128:
        return "block_128";
    case MOE_SCALE_PER_CHANNEL:
        return "per_channel";
    }
    return "invalid";
}

/* ---- tables and picks ------------------------------------------------------------------- */

void moe_oracle_init(moe_oracle_t *o)
{
    memset(o, 0, sizeof(*o));
}

void moe_oracle_table_free(moe_oracle_table_t *t)
{
    if (!t)
        return;
    free(t->group);
    memset(t, 0, sizeof(*t));
}

void moe_oracle_free(moe_oracle_t *o)
{
    if (!o)
        return;
    moe_oracle_table_free(&o->tuned);
    moe_oracle_init(o);
}

/* The built-in tables know sm_90a and the sm_80 family (what runs on every newer device). */
static int default_arch(int arch)
{
    return arch == 90 ? 90 : arch >= 80 ? 80 : 0;
}

static int key_fits(const moe_oracle_group_t *g, const moe_oracle_query_t *q, int tuned)
{
    if (tuned ? g->arch != q->arch : g->arch != default_arch(q->arch))
        return 0;
    if (g->kind != MOE_ORACLE_TRANSPORT && (g->dtype != q->dtype || g->scale != q->scale))
        return 0;
    if (g->kind == MOE_ORACLE_GEMM && g->transport != MOE_ORACLE_ANY &&
        g->transport != q->transport)
        return 0;
    if (g->kind == MOE_ORACLE_GEMM && g->accum != q->accum)
        return 0;
    if (g->max_hidden > 0 && (q->hidden <= 0 || q->hidden > g->max_hidden))
        return 0;
    return (!g->ep_size || g->ep_size == q->ep_size) && (!g->tp_size || g->tp_size == q->tp_size);
}

/* The bucket of `value` in g (0 if none: NaN). */
static int pick_in(const moe_oracle_group_t *g, double value, moe_oracle_choice_t *c)
{
    double lo = 0.0;
    for (int i = 0; i < g->num_buckets; i++) {
        if (value <= g->bucket[i].max) {
            c->name = g->bucket[i].name;
            c->lo = lo;
            c->hi = g->bucket[i].max;
            return 1;
        }
        lo = g->bucket[i].max;
    }
    return 0;
}

static int pick_key(const moe_oracle_t *o, moe_oracle_kind_t kind, const moe_oracle_query_t *q,
                    moe_oracle_choice_t *c)
{
    memset(c, 0, sizeof(*c));
    c->arch = q->arch;
    for (int i = 0; o && i < o->tuned.num_groups; i++) {
        const moe_oracle_group_t *g = &o->tuned.group[i];
        if (g->kind == kind && key_fits(g, q, 1) && pick_in(g, q->value, c)) {
            c->source = MOE_ORACLE_TUNED;
            c->origin = o->file;
            return 1;
        }
    }
    for (int i = 0; i < NUM_DEFAULTS; i++)
        if (defaults[i].kind == kind && key_fits(&defaults[i], q, 0) &&
            pick_in(&defaults[i], q->value, c)) {
            c->max_hidden = defaults[i].max_hidden;
            return 1;
        }
    c->name = NULL;
    return 0;
}

/* pick_key; a fast-accumulation query that no fast table answers, or whose table defers
 * (MOE_ORACLE_PROMOTED_PATH), takes the promoted tables' answer, its bucket cut to the
 * deferring one's (the range where that variant is what the layer runs). */
static int pick(const moe_oracle_t *o, moe_oracle_kind_t kind, const moe_oracle_query_t *q,
                moe_oracle_choice_t *c)
{
    const int hit = pick_key(o, kind, q, c);
    if (hit && strcmp(c->name, MOE_ORACLE_PROMOTED_PATH))
        return 1;
    if (kind == MOE_ORACLE_GEMM && q->accum == MOE_ORACLE_ACCUM_FAST) {
        const double lo = hit ? c->lo : 0.0, hi = hit ? c->hi : HUGE_VAL;
        moe_oracle_query_t p = *q;
        p.accum = MOE_ORACLE_ACCUM_PROMOTED;
        if (!pick_key(o, kind, &p, c))
            return 0;
        c->lo = c->lo > lo ? c->lo : lo;
        c->hi = c->hi < hi ? c->hi : hi;
        return 1;
    }
    c->name = NULL;
    return 0;
}

int moe_oracle_pick_gemm(const moe_oracle_t *o, const moe_oracle_query_t *q, moe_oracle_choice_t *c)
{
    return pick(o, MOE_ORACLE_GEMM, q, c);
}

int moe_oracle_pick_transport(const moe_oracle_t *o, const moe_oracle_query_t *q,
                              moe_oracle_choice_t *c)
{
    return pick(o, MOE_ORACLE_TRANSPORT, q, c);
}

/* One bucket (max, name) after those in g: widened where the last has the same name. */
static int push_bucket(moe_oracle_group_t *g, double max, const char *name, double at, double us)
{
    moe_oracle_bucket_t *k = g->num_buckets ? &g->bucket[g->num_buckets - 1] : NULL;
    if (!k || strcmp(k->name, name)) {
        if (g->num_buckets == MOE_ORACLE_MAX_BUCKETS)
            return -1;
        k = &g->bucket[g->num_buckets++];
        memset(k, 0, sizeof(*k));
        snprintf(k->name, sizeof(k->name), "%s", name);
    }
    if (at > 0.0 && k->at == 0.0) {
        k->at = at;
        k->time_us = us;
    }
    k->max = max;
    return 0;
}

/* The built-in table's choices on (lo, hi) (hi excluded; HUGE_VAL: open), or `fallback` where
 * it has none. */
static int push_builtin(moe_oracle_group_t *g, double lo, double hi, const char *fallback)
{
    moe_oracle_query_t q = {g->arch,      g->dtype, g->scale,        g->ep_size, g->tp_size,
                            g->transport, 0,        g->shape.hidden, 0.0,        0,
                            g->accum};
    const double end = isinf(hi) ? HUGE_VAL : nextafter(hi, 0.0);
    double x = lo;
    while (x < end) {
        moe_oracle_choice_t c;
        q.value = nextafter(x, HUGE_VAL);
        if (!pick(NULL, g->kind, &q, &c))
            return push_bucket(g, isinf(hi) ? HUGE_VAL : end, fallback, 0, 0);
        x = c.hi < end ? c.hi : end;
        if (push_bucket(g, x, c.name, 0, 0) < 0)
            return -1;
    }
    return 0;
}

int moe_oracle_buckets_from_points(moe_oracle_group_t *g, const double *at,
                                   const char *const *winner, const double *best_us, int n)
{
    int prev = -1;
    g->num_buckets = 0;
    for (int i = 0; i < n; i++) {
        if (!winner[i])
            continue;
        if (prev < 0 || strcmp(winner[prev], winner[i])) {
            /* below the first point, or between neighbours that disagree: the built-in table */
            if (push_builtin(g, prev < 0 ? 0.0 : at[prev], at[i], winner[i]) < 0)
                return -1;
        }
        if (push_bucket(g, at[i], winner[i], at[i], best_us ? best_us[i] : 0) < 0)
            return -1;
        prev = i;
    }
    if (prev < 0)
        return 0;
    /* above the last point: the built-in table */
    if (push_builtin(g, at[prev], HUGE_VAL, winner[prev]) < 0)
        return -1;
    g->bucket[g->num_buckets - 1].max = HUGE_VAL;
    return g->num_buckets;
}

void moe_oracle_describe(const moe_oracle_choice_t *c, const char *unit, double value, char *text,
                         size_t len)
{
    char table[320];
    if (!text || !len)
        return;
    if (!c->name) {
        snprintf(text, len, "(no table)");
        return;
    }
    if (c->source == MOE_ORACLE_FORCED) {
        snprintf(text, len, "%s (forced by %s)", c->name, c->origin ? c->origin : "environment");
        return;
    }
    if (c->source == MOE_ORACLE_TUNED)
        snprintf(table, sizeof(table), "tuned from %s for sm_%d", c->origin, c->arch);
    else if (c->max_hidden > 0)
        snprintf(table, sizeof(table), "built-in table for sm_%d, hidden <= %d", c->arch,
                 c->max_hidden);
    else
        snprintf(table, sizeof(table), "built-in table for sm_%d", c->arch);
    if (isinf(c->hi))
        snprintf(text, len, "%s (%s: %s %.3g > %g)", c->name, table, unit, value, c->lo);
    else
        snprintf(text, len, "%s (%s: %s %.3g in (%g, %g])", c->name, table, unit, value, c->lo,
                 c->hi);
}

/* ---- forcing ---------------------------------------------------------------------------- */

static moe_status_t forced(const char *new_env, const char *old_env, const char *skip,
                           const char **name, const char **env)
{
    const char *a = moe_env_str(new_env, NULL), *b = moe_env_str(old_env, NULL);
    if (a && skip && !strcmp(a, skip))
        a = NULL;
    if (b && skip && !strcmp(b, skip))
        b = NULL;
    *name = NULL;
    *env = NULL;
    if (a && b && strcmp(a, b))
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "%s=%s and %s=%s disagree (they mean the same: set one)", new_env, a,
                         old_env, b);
    if (a || b) {
        *name = a ? a : b;
        *env = a ? new_env : old_env;
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_oracle_forced_variant(const char **name, const char **env)
{
    return forced("MOE_FORCE_VARIANT", "MOE_GEMM_VARIANT", NULL, name, env);
}

moe_status_t moe_oracle_forced_transport(const char **name, const char **env)
{
    return forced("MOE_FORCE_TRANSPORT", "MOE_EP_TRANSPORT", "auto", name, env);
}

/* The built-in bound is the largest token count at which the fused kernel beat the grouped path
 * on all three presets (moe-bench, graph-replayed, weights rotated past L2, one H200;
 * bench/RESULTS.md, "Fused decode (one kernel), one H200"; 2026-12-04, 2e515b3, fused / grouped
 * at 1 / 2 / 4 / 8 / 16 tokens, two runs each):
 * - bf16: one token (Qwen3-30B-A3B 0.89, Mixtral-8x7B 0.96, the DeepSeek-V3 EP8 shard 0.95);
 *   at two, Mixtral and the shard are 1.01-1.03 (Qwen3 wins up to four: a tune file's table);
 * - fp8 per-row scales: one token where the step's expert weights are few and there is no
 *   shared expert (2026-12-04, a6e1484, capacity 8192, two runs; bench/RESULTS.md, "Fused
 *   decode"): Qwen3-30B-A3B's shape with I = 384 / 768 / 1536 / 3072 (19 / 38 / 75 / 151 MB a
 *   token) 0.87 / 0.85 / 0.86 / 0.92, Mixtral-8x7B and the shard (352 MB) 1.12-1.14 and
 *   1.06-1.09, Qwen2-MoE-A2.7B (35 MB and a shared expert) 1.01; the bound, 192 MiB, lies between
 *   151 and 352 MB, below where the Qwen3 shapes' line crosses 1 (~250 MB). At two tokens only the
 *   smallest two won (0.88, 0.98; I = 1536 / 3072 1.05 / 1.09), so one token. A shared MLP
 *   the kernel streams itself (MOE_DECODE_SHARED, the default: q->shared is 0 then) counts as
 *   none: Qwen2-MoE-A2.7B fp8 per-tensor, one token, 48.4 us fused against 79.9 grouped
 *   (2026-12-05, 019bc91; bench/RESULTS.md, "Fused decode").
 * - fp8 with 128 x 128 blocks (the kernel runs one token a step with them): the same rule,
 *   forced against the grouped path (2026-12-05, 8631004, one H100, two runs each): Qwen3-30B-A3B
 *   (38 MB a token) 0.92, Mixtral-8x7B 1.07, the DeepSeek-V3 shard 1.05 (352 MB each). A shared
 *   MLP stays on the grouped path with block scales, so such a layer keeps the grouped path.
 * One GPU only (the kernel does not run with EP or TP). */
static const struct {
    moe_dtype_t dtype;
    int tokens;
    double max_token_bytes; /* 0: any; else the step's one-token bytes must be known and within */
    int with_shared;        /* 0: not for a layer with a shared expert */
} decode_builtin[] = {{MOE_DTYPE_BF16, 1, 0.0, 1}, {MOE_DTYPE_FP8_E4M3, 1, 192.0 * 1024 * 1024, 0}};

int moe_oracle_decode_tokens(const moe_oracle_t *o, const moe_oracle_query_t *q,
                             moe_oracle_choice_t *c)
{
    moe_oracle_choice_t tmp;
    if (!c)
        c = &tmp;
    memset(c, 0, sizeof(*c));
    c->arch = q->arch;
    c->name = MOE_ORACLE_GROUPED_PATH;
    c->hi = HUGE_VAL;
    for (int i = 0; o && i < o->tuned.num_groups; i++) {
        const moe_oracle_group_t *g = &o->tuned.group[i];
        double bound = 0.0;
        if (g->kind != MOE_ORACLE_DECODE || !key_fits(g, q, 1))
            continue;
        for (int j = 0; j < g->num_buckets && !strcmp(g->bucket[j].name, MOE_ORACLE_FUSED_DECODE);
             j++)
            bound = g->bucket[j].max;
        c->source = MOE_ORACLE_TUNED;
        c->origin = o->file;
        if (bound > 0.0) {
            c->name = MOE_ORACLE_FUSED_DECODE;
            c->hi = bound;
        }
        return bound >= (double)INT32_MAX ? INT32_MAX : (int)bound;
    }
    if (q->ep_size > 1 || q->tp_size > 1 ||
        !moe_oracle_fused_decode_runs(q->arch, q->dtype, q->scale))
        return 0;
    for (size_t i = 0; i < sizeof(decode_builtin) / sizeof(decode_builtin[0]); i++)
        if (decode_builtin[i].dtype == q->dtype && (decode_builtin[i].with_shared || !q->shared) &&
            (decode_builtin[i].max_token_bytes == 0.0 ||
             (q->token_bytes > 0.0 && q->token_bytes <= decode_builtin[i].max_token_bytes))) {
            c->name = MOE_ORACLE_FUSED_DECODE;
            c->hi = decode_builtin[i].tokens;
            return decode_builtin[i].tokens;
        }
    return 0;
}

int moe_oracle_fused_decode_runs(int arch, moe_dtype_t dtype, moe_scale_kind_t scale)
{
    (void)dtype, (void)scale; /* bf16, per-row fp8 and fp8 with 128 x 128 blocks alike */
    return arch == 90;
}

moe_status_t moe_oracle_check_variant(const char *env, const char *name, int arch,
                                      moe_dtype_t dtype, moe_scale_kind_t scale)
{
    const moe_gemm_variant_t *v;
    if (!name)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "%s: no variant name", env);
    if (!strcmp(name, MOE_ORACLE_FUSED_DECODE)) {
        if (!moe_oracle_fused_decode_runs(arch, dtype, scale))
            return moe_error(MOE_STATUS_NOT_SUPPORTED,
                             "%s=%s runs on sm_90 with bf16 or fp8 weights; this layer: "
                             "sm_%d, %s (scales %s)",
                             env, name, arch, moe_oracle_dtype_name(dtype),
                             moe_oracle_scale_name(scale));
        return MOE_STATUS_SUCCESS;
    }
    if (!strcmp(name, MOE_ORACLE_SIMT_REF)) {
        if (dtype != MOE_DTYPE_BF16 || scale != MOE_SCALE_NONE)
            return moe_error(MOE_STATUS_NOT_SUPPORTED,
                             "%s=%s is a bf16 variant; this layer computes in %s (scales %s)", env,
                             name, moe_oracle_dtype_name(dtype), moe_oracle_scale_name(scale));
        return MOE_STATUS_SUCCESS;
    }
    v = moe_gemm_variant_by_name(name);
    if (!v)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "%s=%s: no such variant", env, name);
    if (!moe_gemm_variant_runs_on(v, arch))
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "%s=%s is built for sm_%d%s (device: sm_%d)",
                         env, name, v->min_arch, v->min_arch == 90 ? "a only" : "+", arch);
    if (v->ab_dtype != dtype || v->scale_kind != scale)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "%s=%s is a %s variant (scales %s); this layer computes in %s (scales %s)",
                         env, name, moe_oracle_dtype_name(v->ab_dtype),
                         moe_oracle_scale_name(v->scale_kind), moe_oracle_dtype_name(dtype),
                         moe_oracle_scale_name(scale));
    return MOE_STATUS_SUCCESS;
}

/* ---- the tune file: reading ------------------------------------------------------------- */

/* The tune file's words per table kind: its list, a bucket's bound and a bucket's choice. */
static const char *const list_key[MOE_ORACLE_KINDS] = {"gemm", "transport", "decode"};
static const char *const bound_key[MOE_ORACLE_KINDS] = {
    "max_rows_per_expert", "max_tokens_per_rank", "max_tokens_per_step"};
static const char *const name_key[MOE_ORACLE_KINDS] = {"variant", "transport", "path"};

typedef struct pctx {
    const char *what;
    char *err;
    size_t len;
} pctx_t;

static int bad(pctx_t *p, const char *fmt, ...) MOE_PRINTF(2, 3);
static int bad(pctx_t *p, const char *fmt, ...)
{
    va_list ap;
    int n = snprintf(p->err, p->len, "%s: ", p->what);
    va_start(ap, fmt);
    if (n >= 0 && (size_t)n < p->len)
        vsnprintf(p->err + n, p->len - (size_t)n, fmt, ap);
    va_end(ap);
    return -1;
}

/* An integer member in [lo, hi]: 1 read, 0 absent/null, -1 bad (message in p). */
static int get_int(pctx_t *p, const moe_json_t *obj, const char *where, const char *key, int64_t lo,
                   int64_t hi, int *out)
{
    int64_t v = 0;
    int r = moe_json_member_int(obj, key, &v);
    if (r < 0)
        return bad(p, "%s\"%s\" is not an integer", where, key);
    if (r == 0)
        return 0;
    if (v < lo || v > hi)
        return bad(p, "%s\"%s\" = %lld is out of range (%lld..%lld)", where, key, (long long)v,
                   (long long)lo, (long long)hi);
    *out = (int)v;
    return 1;
}

static int get_str(pctx_t *p, const moe_json_t *obj, const char *where, const char *key,
                   const char **out)
{
    int r = moe_json_member_string(obj, key, out);
    if (r < 0)
        return bad(p, "%s\"%s\" is not a string", where, key);
    return r;
}

static int get_num(pctx_t *p, const moe_json_t *obj, const char *where, const char *key,
                   double *out)
{
    int r = moe_json_member_number(obj, key, out);
    if (r < 0)
        return bad(p, "%s\"%s\" is not a number", where, key);
    if (r > 0 && !(isfinite(*out) && *out >= 0))
        return bad(p, "%s\"%s\" = %g is not a finite number >= 0", where, key, *out);
    return r;
}

static int parse_shape(pctx_t *p, const moe_json_t *g, const char *where, moe_oracle_shape_t *s)
{
    static const char *const keys[4] = {"hidden", "intermediate", "experts", "top_k"};
    int *field[4] = {&s->hidden, &s->intermediate, &s->experts, &s->top_k};
    const moe_json_t *sh = moe_json_get(g, "shape");
    memset(s, 0, sizeof(*s));
    if (!sh || sh->type == MOE_JSON_NULL)
        return 0; /* any shape */
    if (sh->type != MOE_JSON_OBJECT)
        return bad(p, "%s\"shape\" is not an object", where);
    for (int i = 0; i < 4; i++) {
        int r = get_int(p, sh, where, keys[i], 1, 1 << 30, field[i]);
        if (r < 0)
            return r;
        if (r == 0)
            return bad(p, "%s\"shape\" has no \"%s\"", where, keys[i]);
    }
    return 0;
}

/* The GEMM table's key: dtype, scales, transport. */
static int parse_gemm_key(pctx_t *p, const moe_json_t *g, const char *where, moe_oracle_group_t *o)
{
    const char *d = NULL, *s = NULL, *t = NULL;
    if (get_str(p, g, where, "dtype", &d) < 0 || get_str(p, g, where, "scales", &s) < 0 ||
        get_str(p, g, where, "transport", &t) < 0)
        return -1;
    if (!d || !s)
        return bad(p, "%sneeds \"dtype\" and \"scales\"", where);
    if (!strcmp(d, "bf16") && !strcmp(s, "none")) {
        o->dtype = MOE_DTYPE_BF16;
        o->scale = MOE_SCALE_NONE;
    } else if (!strcmp(d, "fp8_e4m3") && (!strcmp(s, "per_channel") || !strcmp(s, "block_128"))) {
        o->dtype = MOE_DTYPE_FP8_E4M3;
        o->scale = !strcmp(s, "per_channel") ? MOE_SCALE_PER_CHANNEL : MOE_SCALE_BLOCK_128;
    } else {
        return bad(p,
                   "%s\"dtype\" \"%.32s\" with \"scales\" \"%.32s\": expected bf16/none, "
                   "fp8_e4m3/per_channel or fp8_e4m3/block_128",
                   where, d, s);
    }
    o->transport = MOE_ORACLE_ANY;
    if (t && (o->transport = moe_oracle_transport_by_name(t)) == -2)
        return bad(p, "%s\"transport\" \"%.32s\": expected any, allgather, lsa or p2p", where, t);
    return 0;
}

/* A GEMM table's "accum": "promoted" (also when absent) or "fast" (FP8 per-row scales only). */
static int parse_accum(pctx_t *p, const moe_json_t *g, const char *where, moe_oracle_group_t *o)
{
    const char *a = NULL;
    if (get_str(p, g, where, "accum", &a) < 0)
        return -1;
    o->accum = MOE_ORACLE_ACCUM_PROMOTED;
    if (!a || !strcmp(a, "promoted"))
        return 0;
    if (strcmp(a, "fast"))
        return bad(p, "%s\"accum\" \"%.32s\": expected promoted or fast", where, a);
    if (o->dtype != MOE_DTYPE_FP8_E4M3 || o->scale != MOE_SCALE_PER_CHANNEL)
        return bad(p, "%s\"accum\" \"fast\" is for fp8_e4m3/per_channel tables (this one: %s/%s)",
                   where, moe_oracle_dtype_name(o->dtype), moe_oracle_scale_name(o->scale));
    o->accum = MOE_ORACLE_ACCUM_FAST;
    return 0;
}

/* Whether a GEMM table's variant fits its key and the file's arch (a stale name fails). */
static int check_name(pctx_t *p, const moe_oracle_group_t *g, const char *where, const char *name)
{
    const moe_gemm_variant_t *v;
    if (g->kind == MOE_ORACLE_TRANSPORT) {
        if (moe_oracle_transport_by_name(name) < 0)
            return bad(p, "%stransport \"%.48s\": expected allgather, lsa or p2p", where, name);
        return 0;
    }
    if (g->kind == MOE_ORACLE_DECODE) {
        if (!strcmp(name, MOE_ORACLE_GROUPED_PATH))
            return 0;
        if (strcmp(name, MOE_ORACLE_FUSED_DECODE))
            return bad(p, "%spath \"%.48s\": expected %s or %s", where, name,
                       MOE_ORACLE_FUSED_DECODE, MOE_ORACLE_GROUPED_PATH);
        if (!moe_oracle_fused_decode_runs(g->arch, g->dtype, g->scale))
            return bad(p, "%s%s does not run %s/%s on sm_%d", where, name,
                       moe_oracle_dtype_name(g->dtype), moe_oracle_scale_name(g->scale), g->arch);
        return 0;
    }
    v = moe_gemm_variant_by_name(name);
    if (!v)
        return bad(p, "%svariant \"%.48s\" is unknown to this build (a stale file?)", where, name);
    if (!moe_gemm_variant_runs_on(v, g->arch) || v->ab_dtype != g->dtype ||
        v->scale_kind != g->scale)
        return bad(p, "%svariant \"%s\" does not run %s/%s on sm_%d", where, name,
                   moe_oracle_dtype_name(g->dtype), moe_oracle_scale_name(g->scale), g->arch);
    if (v->fast_accum && g->accum != MOE_ORACLE_ACCUM_FAST)
        return bad(p,
                   "%svariant \"%s\" accumulates without promotion: only a table with "
                   "\"accum\": \"fast\" (fp8_math W8A8_FAST layers) may name it",
                   where, name);
    return 0;
}

static int parse_buckets(pctx_t *p, const moe_json_t *g, const char *where, moe_oracle_group_t *o)
{
    const char *bound = bound_key[o->kind];
    const char *namekey = name_key[o->kind];
    const moe_json_t *b = moe_json_get(g, "buckets"), *e;
    double prev = 0.0;
    int i = 0;
    char at[160];

    if (!b || b->type != MOE_JSON_ARRAY)
        return bad(p, "%sneeds \"buckets\" (an array)", where);
    if (b->count < 1 || b->count > MOE_ORACLE_MAX_BUCKETS)
        return bad(p, "%s%zu buckets (1..%d)", where, b->count, MOE_ORACLE_MAX_BUCKETS);
    for (e = b->child; e; e = e->next, i++) {
        moe_oracle_bucket_t *k = &o->bucket[i];
        const char *name = NULL;
        const int last = e->next == NULL;
        int r;
        snprintf(at, sizeof(at), "%sbucket %d: ", where, i);
        if (e->type != MOE_JSON_OBJECT)
            return bad(p, "%snot an object", at);
        r = get_num(p, e, at, bound, &k->max);
        if (r < 0)
            return -1;
        if (last && r > 0)
            return bad(p, "%sthe last bucket is open: no \"%s\"", at, bound);
        if (!last && r == 0)
            return bad(p, "%sneeds \"%s\" (only the last bucket is open)", at, bound);
        if (last)
            k->max = OPEN;
        else if (!(k->max > prev))
            return bad(p, "%s\"%s\" = %g does not rise above %g", at, bound, k->max, prev);
        prev = k->max;
        if (get_num(p, e, at, "at", &k->at) < 0 || get_num(p, e, at, "time_us", &k->time_us) < 0)
            return -1;
        if (get_str(p, e, at, namekey, &name) < 0)
            return -1;
        if (!name)
            return bad(p, "%sneeds \"%s\"", at, namekey);
        if (strlen(name) >= MOE_ORACLE_NAME_LEN)
            return bad(p, "%s\"%s\" is too long", at, namekey);
        if (check_name(p, o, at, name) < 0)
            return -1;
        /* block scales: the kernel runs steps of one token */
        if (o->kind == MOE_ORACLE_DECODE && o->scale == MOE_SCALE_BLOCK_128 &&
            !strcmp(name, MOE_ORACLE_FUSED_DECODE) && k->max > 1.0)
            return bad(p, "%s%s with block_128 scales runs one token a step: \"%s\" must be 1 (%s)",
                       at, name, bound, last ? "the last bucket is open" : "it is larger");
        /* a layer runs the fused kernel up to one bound: its buckets lead */
        if (o->kind == MOE_ORACLE_DECODE && i > 0 && !strcmp(name, MOE_ORACLE_FUSED_DECODE) &&
            strcmp(o->bucket[i - 1].name, MOE_ORACLE_FUSED_DECODE))
            return bad(p, "%s%s after %s: its buckets must come first (one crossover)", at, name,
                       o->bucket[i - 1].name);
        strcpy(k->name, name);
    }
    o->num_buckets = i;
    return 0;
}

static int parse_group(pctx_t *p, const moe_json_t *g, moe_oracle_kind_t kind, int index,
                       moe_oracle_table_t *t)
{
    moe_oracle_group_t *o = &t->group[t->num_groups];
    char where[64];
    snprintf(where, sizeof(where), "\"%s\"[%d]: ", list_key[kind], index);
    if (g->type != MOE_JSON_OBJECT)
        return bad(p, "%snot an object", where);
    memset(o, 0, sizeof(*o));
    o->kind = kind;
    o->arch = t->arch;
    o->transport = MOE_ORACLE_ANY;
    if (parse_shape(p, g, where, &o->shape) < 0)
        return -1;
    if (kind != MOE_ORACLE_TRANSPORT && parse_gemm_key(p, g, where, o) < 0)
        return -1;
    if (kind == MOE_ORACLE_DECODE)
        o->transport = MOE_ORACLE_ANY; /* one GPU: no transport */
    if (kind == MOE_ORACLE_GEMM) {
        const char *id = NULL;
        const int r = get_str(p, g, where, "builtin", &id);
        if (r < 0)
            return -1;
        if (r > 0) {
            if (strlen(id) != 16 || strspn(id, "0123456789abcdef") != 16)
                return bad(p, "%s\"builtin\" = \"%.40s\" is not 16 hex digits", where, id);
            memcpy(o->builtin, id, 17);
        }
        if (parse_accum(p, g, where, o) < 0)
            return -1;
    }
    if (get_int(p, g, where, "ep_size", 1, 65536, &o->ep_size) < 0 ||
        get_int(p, g, where, "tp_size", 1, 65536, &o->tp_size) < 0)
        return -1;
    if (parse_buckets(p, g, where, o) < 0)
        return -1;
    t->num_groups++;
    return 0;
}

static int parse_root(pctx_t *p, const moe_json_t *r, moe_oracle_table_t *t)
{
    const char *gpu = NULL;
    size_t total = 0;
    int version = 0;

    if (r->type != MOE_JSON_OBJECT)
        return bad(p, "not a JSON object");
    if (get_int(p, r, "", "libmoe_tune", 0, 1 << 30, &version) <= 0)
        return p->err[0] ? -1 : bad(p, "not a libmoe tune file (no \"libmoe_tune\" version)");
    if (version != MOE_TUNE_VERSION)
        return bad(p, "version %d (this build reads version %d: run moe-tune again)", version,
                   MOE_TUNE_VERSION);
    if (get_str(p, r, "", "gpu", &gpu) <= 0)
        return p->err[0] ? -1 : bad(p, "no \"gpu\" name");
    if (strlen(gpu) >= sizeof(t->gpu))
        return bad(p, "\"gpu\" name is too long");
    strcpy(t->gpu, gpu);
    if (get_int(p, r, "", "arch", 10, 1000, &t->arch) <= 0)
        return p->err[0] ? -1 : bad(p, "no \"arch\"");
    for (int l = 0; l < MOE_ORACLE_KINDS; l++) {
        const moe_json_t *a = moe_json_get(r, list_key[l]);
        if (a && a->type != MOE_JSON_ARRAY && a->type != MOE_JSON_NULL)
            return bad(p, "\"%s\" is not an array", list_key[l]);
        total += a && a->type == MOE_JSON_ARRAY ? a->count : 0;
    }
    if (total > MOE_ORACLE_MAX_GROUPS)
        return bad(p, "%zu tables (at most %d)", total, MOE_ORACLE_MAX_GROUPS);
    t->group = calloc(total ? total : 1, sizeof(*t->group));
    if (!t->group)
        return bad(p, "out of memory");
    for (int l = 0; l < MOE_ORACLE_KINDS; l++) {
        const moe_json_t *a = moe_json_get(r, list_key[l]), *g;
        int i = 0;
        if (!a || a->type != MOE_JSON_ARRAY)
            continue;
        for (g = a->child; g; g = g->next, i++)
            if (parse_group(p, g, (moe_oracle_kind_t)l, i, t) < 0)
                return -1;
    }
    return 0;
}

/* Parses into t; 0, or -1 with the reason in err (no error recorded for moe_last_error()). */
static int parse_text(const char *text, size_t len, const char *what, moe_oracle_table_t *t,
                      char *err, size_t errlen)
{
    pctx_t p = {what, err, errlen};
    moe_json_doc_t *doc = NULL;
    int r;

    memset(t, 0, sizeof(*t));
    err[0] = '\0';
    if (moe_json_parse(text, len, 200000, what, &doc) != MOE_STATUS_SUCCESS) {
        snprintf(err, errlen, "%s", moe_last_error());
        moe_error_clear();
        return -1;
    }
    r = parse_root(&p, moe_json_root(doc), t);
    moe_json_free(doc);
    if (r < 0)
        moe_oracle_table_free(t);
    return r;
}

moe_status_t moe_oracle_parse(const char *text, size_t len, const char *what, moe_oracle_table_t *t)
{
    char err[512];
    if (parse_text(text, len, what, t, err, sizeof(err)) < 0)
        return moe_error(MOE_STATUS_FORMAT_ERROR, "%s", err);
    return MOE_STATUS_SUCCESS;
}

/* One warning line per distinct reason per process (60 layers, one bad file: one line). */
static void warn_once(const char *msg)
{
    static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    static char last[512];
    int seen;
    pthread_mutex_lock(&mu);
    seen = !strcmp(last, msg);
    if (!seen)
        snprintf(last, sizeof(last), "%s", msg);
    pthread_mutex_unlock(&mu);
    if (!seen)
        MOE_LOG_WARN("TUNE", "%s", msg);
}

static int ignore(moe_oracle_t *o, const char *fmt, ...) MOE_PRINTF(2, 3);
static int ignore(moe_oracle_t *o, const char *fmt, ...)
{
    va_list ap;
    char why[400];
    va_start(ap, fmt);
    vsnprintf(why, sizeof(why), fmt, ap);
    va_end(ap);
    moe_oracle_free(o);
    snprintf(o->warning, sizeof(o->warning), "tune file ignored, built-in tables used: %s", why);
    warn_once(o->warning);
    return 0;
}

static int shape_fits(const moe_oracle_shape_t *g, const moe_oracle_shape_t *s)
{
    if (!g->hidden && !g->intermediate && !g->experts && !g->top_k)
        return 1;
    return g->hidden == s->hidden && g->intermediate == s->intermediate &&
           g->experts == s->experts && g->top_k == s->top_k;
}

int moe_oracle_load_text(moe_oracle_t *o, const char *text, size_t len, const char *what,
                         const moe_oracle_target_t *target)
{
    moe_oracle_table_t t;
    char err[400];
    const moe_oracle_shape_t *s = &target->shape;
    int n = 0;

    moe_oracle_free(o);
    if (parse_text(text, len, what, &t, err, sizeof(err)) < 0)
        return ignore(o, "%s", err);
    if (!target->gpu || strcmp(t.gpu, target->gpu) || t.arch != target->arch) {
        ignore(o, "%s: tuned on \"%s\" (sm_%d); this GPU is \"%s\" (sm_%d)", what, t.gpu, t.arch,
               target->gpu ? target->gpu : "unknown", target->arch);
        moe_oracle_table_free(&t);
        return 0;
    }
    for (int i = 0; i < t.num_groups; i++) /* keep the tables of this shape, in file order */
        if (shape_fits(&t.group[i].shape, s))
            t.group[n++] = t.group[i];
    if (n == 0) {
        ignore(o,
               "%s: no table for this layer's shape (hidden %d, intermediate %d, experts %d, "
               "top_k %d)",
               what, s->hidden, s->intermediate, s->experts, s->top_k);
        moe_oracle_table_free(&t);
        return 0;
    }
    t.num_groups = n;
    o->tuned = t;
    snprintf(o->file, sizeof(o->file), "%s", what);
    for (int i = 0; i < n; i++) {
        const char *id = t.group[i].builtin;
        if (t.group[i].kind == MOE_ORACLE_GEMM && id[0] && strcmp(id, moe_oracle_builtin_id())) {
            snprintf(o->warning, sizeof(o->warning),
                     "%s: GEMM tables measured against other built-in tables (%s; this library's: "
                     "%s): used, but the built-in choice may now be faster; run moe-tune again",
                     what, id, moe_oracle_builtin_id());
            warn_once(o->warning);
            break;
        }
    }
    return n;
}

int moe_oracle_load(moe_oracle_t *o, const char *path, const moe_oracle_target_t *target)
{
    char *buf;
    size_t got;
    int n;

    moe_oracle_free(o);
    if (!path || !*path)
        return 0;
    /* the one non-blocking open: a FIFO or device is refused, never waited on */
    if (moe_read_regular(path, MOE_TUNE_MAX_BYTES, &buf, &got, NULL) != MOE_STATUS_SUCCESS) {
        n = ignore(o, "%s", moe_last_error());
        moe_error_clear();
        return n;
    }
    n = moe_oracle_load_text(o, buf, got, path, target);
    free(buf);
    return n;
}

int moe_oracle_load_env(moe_oracle_t *o, const moe_oracle_target_t *target)
{
    return moe_oracle_load(o, moe_env_str("MOE_TUNE_FILE", NULL), target);
}

/* ---- the tune file: writing ------------------------------------------------------------- */

typedef struct out {
    char *buf;
    size_t len, pos;
} out_t;

static void put(out_t *w, const char *fmt, ...) MOE_PRINTF(2, 3);
static void put(out_t *w, const char *fmt, ...)
{
    va_list ap;
    int n;
    va_start(ap, fmt);
    n = vsnprintf(w->pos < w->len ? w->buf + w->pos : NULL, w->pos < w->len ? w->len - w->pos : 0,
                  fmt, ap);
    va_end(ap);
    if (n > 0)
        w->pos += (size_t)n;
}

/* A JSON string: quotes, backslashes and control characters escaped. */
static void put_str(out_t *w, const char *s)
{
    put(w, "\"");
    for (; *s; s++) {
        char e[7];
        moe_json_escape_byte((unsigned char)*s, e);
        put(w, "%s", e);
    }
    put(w, "\"");
}

static void put_group(out_t *w, const moe_oracle_group_t *g)
{
    const moe_oracle_shape_t *s = &g->shape;
    put(w, "    {");
    if (s->hidden || s->intermediate || s->experts || s->top_k)
        put(w,
            "\"shape\": {\"hidden\": %d, \"intermediate\": %d, \"experts\": %d, \"top_k\": %d},\n  "
            "   ",
            s->hidden, s->intermediate, s->experts, s->top_k);
    if (g->kind != MOE_ORACLE_TRANSPORT)
        put(w, "\"dtype\": \"%s\", \"scales\": \"%s\", ", moe_oracle_dtype_name(g->dtype),
            moe_oracle_scale_name(g->scale));
    if (g->kind == MOE_ORACLE_GEMM)
        put(w, "\"transport\": \"%s\", ", moe_oracle_transport_name(g->transport));
    if (g->kind == MOE_ORACLE_GEMM && g->builtin[0])
        put(w, "\"builtin\": \"%s\", ", g->builtin);
    if (g->kind == MOE_ORACLE_GEMM && g->accum == MOE_ORACLE_ACCUM_FAST)
        put(w, "\"accum\": \"fast\", ");
    if (g->ep_size)
        put(w, "\"ep_size\": %d, ", g->ep_size);
    if (g->tp_size)
        put(w, "\"tp_size\": %d, ", g->tp_size);
    put(w, "\"buckets\": [");
    for (int i = 0; i < g->num_buckets; i++) {
        const moe_oracle_bucket_t *b = &g->bucket[i];
        put(w, "%s\n      {", i ? "," : "");
        if (i + 1 < g->num_buckets)
            put(w, "\"%s\": %.17g, ", bound_key[g->kind], b->max);
        put(w, "\"%s\": ", name_key[g->kind]);
        put_str(w, b->name);
        if (b->at > 0)
            put(w, ", \"at\": %.17g", b->at);
        if (b->time_us > 0)
            put(w, ", \"time_us\": %.17g", b->time_us);
        put(w, "}");
    }
    put(w, "]}");
}

size_t moe_oracle_format(const moe_oracle_table_t *t, char *buf, size_t len)
{
    out_t w = {buf, len, 0};
    put(&w, "{\n  \"libmoe_tune\": %d,\n  \"gpu\": ", MOE_TUNE_VERSION);
    put_str(&w, t->gpu);
    put(&w, ",\n  \"arch\": %d", t->arch);
    for (int l = 0; l < MOE_ORACLE_KINDS; l++) {
        int first = 1;
        put(&w, ",\n  \"%s\": [", list_key[l]);
        for (int i = 0; i < t->num_groups; i++) {
            if ((int)t->group[i].kind != l)
                continue;
            put(&w, "%s\n", first ? "" : ",");
            put_group(&w, &t->group[i]);
            first = 0;
        }
        put(&w, "]");
    }
    put(&w, "\n}\n");
    return w.pos;
}

moe_status_t moe_oracle_write(const char *path, const moe_oracle_table_t *t)
{
    const size_t n = moe_oracle_format(t, NULL, 0);
    char *buf = malloc(n + 1);
    FILE *f;
    moe_status_t st;
    int fail;
    if (!buf)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "tune file %s: %zu bytes", path, n);
    moe_oracle_format(t, buf, n + 1);
    f = moe_open_regular_write(path, &st);
    if (!f) {
        free(buf);
        return moe_error(st, "tune file %s", moe_last_error());
    }
    fail = fwrite(buf, 1, n, f) != n;
    fail |= fclose(f) != 0;
    free(buf);
    if (fail)
        return moe_error(MOE_STATUS_IO_ERROR, "tune file %s: write failed", path);
    return MOE_STATUS_SUCCESS;
}

/* The built-in choice (the default tables above), as the variant table's entries. */
static int pick_default(int arch, moe_dtype_t dtype, moe_scale_kind_t scale, double rows,
                        moe_oracle_choice_t *c)
{
    const moe_oracle_query_t q = {arch, dtype, scale, 1, 1, MOE_ORACLE_ANY, rows, 0, 0.0, 0, 0};
    return moe_oracle_pick_gemm(NULL, &q, c);
}

void moe_gemm_explain(int arch, double rows_per_expert, char *text, size_t len)
{
    moe_oracle_choice_t c;
    if (!text || !len)
        return;
    if (pick_default(arch, MOE_DTYPE_BF16, MOE_SCALE_NONE, rows_per_expert, &c))
        moe_oracle_describe(&c, "rows/expert", rows_per_expert, text, len);
    else
        snprintf(text, len, "simt_ref (no tuned variant for sm_%d)", arch);
}

const moe_gemm_variant_t *moe_gemm_select(int arch, moe_dtype_t dtype, moe_scale_kind_t scale,
                                          double rows_per_expert)
{
    moe_oracle_choice_t c;
    return pick_default(arch, dtype, scale, rows_per_expert, &c) ? moe_gemm_variant_by_name(c.name)
                                                                 : NULL;
}
