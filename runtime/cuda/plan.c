/* SPDX-License-Identifier: Apache-2.0 */
/* The variants a CUDA layer may run (forced, or the oracle's per step) and the memory planned
 * at init for every one of them: the workspace pieces of one GPU's step and the persistent
 * weights block. Carved twice: a sizing pass (base NULL), then into the allocation. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/decode.h"
#include "kernels/expert_gemm_simple.h"
#include "kernels/expert_gemm_table.h"
#include "kernels/permute.h"
#include "runtime/cuda/one_gpu.h"

/* The oracle's choice (not forced) at rows_per_expert. Deterministic mode: the built-in
 * table's at one row per expert whatever the batch, layout or tune file, so a row's sum order
 * never changes with the batch size, its position or the EP size. */
static int oracle_choice(const cuda_layer_t *s, double rows_per_expert, moe_oracle_choice_t *c)
{
    moe_oracle_query_t q = s->oq;
    q.value = s->deterministic ? 1.0 : rows_per_expert;
    return moe_oracle_pick_gemm(s->deterministic ? NULL : &s->oracle, &q, c);
}

/* The variant for a step at rows_per_expert (moe_cuda_variant_for), and in *hi the most rows
 * per expert it is picked up to from there (HUGE_VAL: forced, deterministic, or no bucket). */
static const moe_gemm_variant_t *variant_upto(const cuda_layer_t *s, double rows_per_expert,
                                              double *hi)
{
    const moe_gemm_variant_t *v = NULL;
    moe_oracle_choice_t c;
    *hi = HUGE_VAL;
    if (s->forced)
        return s->forced;
    if (oracle_choice(s, rows_per_expert, &c)) {
        v = moe_gemm_variant_by_name(c.name);
        if (!s->deterministic)
            *hi = c.hi;
    }
    if (s->f8) /* create checked that sm_90a has them */
        return v;
    return v ? v : moe_gemm_simple_variant();
}

/* Adds v with the bound `upto` to the list (the larger bound where v is there already). */
static int add_candidate(const moe_gemm_variant_t **out, double *upto, int n, int cap,
                         const moe_gemm_variant_t *v, double bound)
{
    for (int i = 0; i < n; i++)
        if (out[i] == v) {
            upto[i] = bound > upto[i] ? bound : upto[i];
            return n;
        }
    if (n < cap) {
        out[n] = v;
        upto[n++] = bound;
    }
    return n;
}

/* Every variant forward may pick on this device, each with the most rows per expert at which it
 * is picked (HUGE_VAL: any): the forced one alone, or the oracle's buckets (tuned or built in)
 * walked in order; deterministic mode runs one variant at every size. Where the walk meets
 * anything unexpected, every variant of the dtype at any size (the old, larger plan). */
static int candidate_variants(const cuda_layer_t *s, const moe_gemm_variant_t **out, double *upto,
                              int cap)
{
    int n = 0, count = 0, i, step;
    double value = 0.0;
    const moe_gemm_variant_t *table;
    for (step = 0; step < 64; step++) {
        double hi;
        const moe_gemm_variant_t *v = variant_upto(s, value, &hi);
        if (!v || !(hi >= value))
            break;
        n = add_candidate(out, upto, n, cap, v, hi);
        if (isinf(hi))
            return n;
        value = nextafter(hi, HUGE_VAL);
    }
    n = 0;
    table = moe_gemm_variants(&count);
    for (i = 0; i < count; i++)
        if (moe_gemm_variant_runs_on(&table[i], s->arch) &&
            table[i].ab_dtype == (s->f8 ? MOE_DTYPE_FP8_E4M3 : MOE_DTYPE_BF16) &&
            table[i].scale_kind == f8_scale_kind(s))
            n = add_candidate(out, upto, n, cap, &table[i], HUGE_VAL);
    return add_candidate(out, upto, n, cap, moe_gemm_simple_variant(), HUGE_VAL);
}

const moe_gemm_variant_t *moe_cuda_variant_for(const cuda_layer_t *s, double rows_per_expert)
{
    double hi;
    return variant_upto(s, rows_per_expert, &hi);
}

void moe_cuda_plan_workspace(cuda_layer_t *s, carve_t *c)
{
    const moe_gemm_variant_t *v[64];
    double upto[64];
    const int nv = candidate_variants(s, v, upto, 64);
    const int64_t tm = s->max_tokens, rows = tm * s->k;
    /* the shared MLP's rows: this rank's tokens where it holds the whole MLP (one GPU, or EP
     * without TP), else every rank's all-gathered tokens (its TP slice) */
    const int64_t stm = s->world == 1 || s->shared_local ? s->tm : tm;
    int64_t max_rows = 0, s_rows = 0;
    int i;

    s->max_blocks = 0;
    s->s_max_blocks = 0;
    for (i = 0; i < nv; i++) {
        const int br = v[i]->block_rows;
        /* One GPU: a variant picked at up to r rows per expert gets at most r E rows (T k / E
         * <= r), and the shared MLP's T rows at most r (its value is T). With EP a rank may
         * receive more rows than its own tokens' estimate says: the whole capacity. (A step
         * past the plan still stops with INTERNAL_ERROR before any kernel runs.) */
        const int bounded = s->world == 1 && isfinite(upto[i]);
        const int64_t r = bounded ? (int64_t)(upto[i] * (double)s->E) + 1 : rows;
        const int64_t sr = bounded ? (int64_t)upto[i] + 1 : stm;
        const int64_t mb = moe_permute_max_blocks(r < rows ? r : rows, s->E, br);
        const int64_t smb = ((sr < stm ? sr : stm) + br - 1) / br;
        if (mb > s->max_blocks)
            s->max_blocks = (int)mb;
        if (mb * br > max_rows)
            max_rows = mb * br;
        if (smb > s->s_max_blocks)
            s->s_max_blocks = (int)smb;
        if (smb * br > s_rows)
            s_rows = smb * br;
    }
    s->logits = moe_cuda_take(c, sizeof(float) * (size_t)(tm * s->E_total));
    s->ids = moe_cuda_take(c, sizeof(int32_t) * (size_t)rows);
    s->slot_ids = moe_cuda_take(c, sizeof(int32_t) * (size_t)rows);
    s->weights = moe_cuda_take(c, sizeof(float) * (size_t)rows);
    s->counts = moe_cuda_take(c, sizeof(int32_t) * (size_t)s->E);
    s->offsets = moe_cuda_take(c, sizeof(int32_t) * (size_t)(s->E + 1));
    s->block_expert = moe_cuda_take(c, sizeof(int32_t) * (size_t)s->max_blocks);
    s->num_blocks = moe_cuda_take(c, sizeof(int32_t));
    s->row_of_slot = moe_cuda_take(c, sizeof(int32_t) * (size_t)rows);
    s->slot_of_row = moe_cuda_take(c, sizeof(int32_t) * (size_t)max_rows);
    s->perm_scratch_count = moe_permute_scratch_count(rows, s->E);
    s->perm_scratch = moe_cuda_take(c, sizeof(int32_t) * (size_t)s->perm_scratch_count);
    if (!s->f8) /* W8A8 quantises GEMM 1's rows straight from x (no bf16 copy) */
        s->a = moe_cuda_take(c, 2 * (size_t)max_rows * (size_t)s->H);
    s->h = moe_cuda_take(c, 2 * (size_t)max_rows * (size_t)s->is);
    s->o = moe_cuda_take(c, 2 * (size_t)max_rows * (size_t)s->H);
    if (s->f8) {
        s->a8 = moe_cuda_take(c, (size_t)max_rows * (size_t)s->H);
        s->h8 = moe_cuda_take(c, (size_t)max_rows * (size_t)s->is);
        s->as = moe_cuda_take(c, sizeof(float) * (size_t)max_rows * f8_groups(s, s->H));
        s->hs = moe_cuda_take(c, sizeof(float) * (size_t)max_rows * f8_groups(s, s->is));
        if (s->h_amax)
            s->hamax = moe_cuda_take(c, sizeof(float) * (size_t)max_rows * f8_groups(s, s->is));
    }
    if (s->ss > 0) {
        s->sa = moe_cuda_take(c, 2 * (size_t)s_rows * (size_t)s->H);
        s->sh = moe_cuda_take(c, 2 * (size_t)s_rows * (size_t)s->ss);
        s->so = moe_cuda_take(c, 2 * (size_t)s_rows * (size_t)s->H);
        s->s_block_expert = moe_cuda_take(c, sizeof(int32_t) * (size_t)s->s_max_blocks);
        s->s_num_blocks = moe_cuda_take(c, sizeof(int32_t));
        s->s_gate_logit = moe_cuda_take(c, sizeof(float) * (size_t)stm);
        if (s->f8) {
            s->sa8 = moe_cuda_take(c, (size_t)s_rows * (size_t)s->H);
            s->sh8 = moe_cuda_take(c, (size_t)s_rows * (size_t)s->ss);
            s->sas = moe_cuda_take(c, sizeof(float) * (size_t)s_rows * f8_groups(s, s->H));
            s->shs = moe_cuda_take(c, sizeof(float) * (size_t)s_rows * f8_groups(s, s->ss));
            if (s->h_amax)
                s->shamax = moe_cuda_take(c, sizeof(float) * (size_t)s_rows * f8_groups(s, s->ss));
        }
    }
    if (s->dec_ok) { /* the fused decode kernel's: rows by slot, its k split's partials */
        const size_t dr = (size_t)s->dec_tokens * (size_t)moe_cuda_decode_slots(s);
        s->dec_h = moe_cuda_take(c, 2 * dr * (size_t)s->is);
        s->dec_o = moe_cuda_take(c, sizeof(float) * (size_t)s->dec_split * dr * (size_t)s->H);
        if (s->dec_split1 > 1)
            s->dec_o1 =
                moe_cuda_take(c, sizeof(float) * (size_t)s->dec_split1 * dr * 2 * (size_t)s->is);
        if (s->f8) { /* by token; an EP step's laid-out rows: by slot */
            const size_t xr = s->world > 1 ? dr : (size_t)s->dec_tokens;
            s->dec_xq = moe_cuda_take(c, xr * (size_t)s->H);
            s->dec_xs = moe_cuda_take(c, sizeof(float) * xr);
        }
    }
}

/* Weights and the layer's persistent data. */
void moe_cuda_plan_weights(cuda_layer_t *s, carve_t *c)
{
    const size_t E = (size_t)s->E, H = (size_t)s->H, is = (size_t)s->is, ss = (size_t)s->ss;
    const size_t eb = s->f8 ? 1 : 2; /* bytes per weight */
    s->w13 = moe_cuda_take(c, eb * E * 2 * is * H);
    s->w2 = moe_cuda_take(c, eb * E * H * is);
    if (s->f8) {
        s->w13s = moe_cuda_take(c, sizeof(float) * E * 2 * is * f8_groups(s, s->H));
        s->w2s = moe_cuda_take(c, sizeof(float) * E * H * f8_groups(s, s->is));
        if (ss > 0) {
            s->sw13s = moe_cuda_take(c, sizeof(float) * 2 * ss * f8_groups(s, s->H));
            s->sw2s = moe_cuda_take(c, sizeof(float) * H * f8_groups(s, s->ss));
        }
    }
    if (s->f8 == 1) { /* static activation scales: per-tensor weights only (never blocks) */
        s->in13 = moe_cuda_take(c, sizeof(float) * E);
        s->in2 = moe_cuda_take(c, sizeof(float) * E);
        if (ss > 0) {
            s->sin13 = moe_cuda_take(c, sizeof(float));
            s->sin2 = moe_cuda_take(c, sizeof(float));
        }
    }
    s->router = moe_cuda_take(c, sizeof(float) * (size_t)s->E_total * H); /* every expert's row */
    s->router3 = moe_cuda_take(c, 3 * sizeof(uint16_t) * (size_t)s->E_total * H);
    s->bias = moe_cuda_take(c, sizeof(float) * (size_t)s->E_total);
    s->replica_begin = moe_cuda_take(c, sizeof(int32_t) * ((size_t)s->E_total + 1));
    s->replica_slot = moe_cuda_take(c, sizeof(int32_t) * (size_t)s->n_slots);
    s->load = moe_cuda_take(c, sizeof(unsigned long long) * (size_t)s->E_total);
    s->perm_done = moe_cuda_take(c, 2 * sizeof(int32_t)); /* lane 0's, lane 1's */
    if (s->dec_ok)
        s->dec_sync = moe_cuda_take(c, sizeof(int32_t) * moe_cuda_decode_sync_count(s));
    if (ss > 0) {
        s->sw13 = moe_cuda_take(c, eb * 2 * ss * H);
        s->sw2 = moe_cuda_take(c, eb * H * ss);
        s->sgate = moe_cuda_take(c, sizeof(float) * H);
    }
}

void moe_cuda_explain_gemm(const cuda_layer_t *s, double rows_per_expert, char *text, size_t len)
{
    moe_oracle_choice_t c;
    if (s->forced && !s->forced_env) {
        snprintf(text, len, "%s (no tuned variant for this GPU)", s->forced->name);
        return;
    }
    if (s->forced) {
        const moe_oracle_choice_t f = {s->forced->name, MOE_ORACLE_FORCED, 0, 0,
                                       s->forced_env,   s->arch,           0};
        moe_oracle_describe(&f, "rows/expert", rows_per_expert, text, len);
        return;
    }
    if (!oracle_choice(s, rows_per_expert, &c)) {
        snprintf(text, len, "%s (no table for sm_%d)", moe_gemm_simple_variant()->name, s->arch);
        return;
    }
    /* deterministic mode pins the variant of one row per expert: see oracle_choice */
    moe_oracle_describe(&c,
                        s->oq.accum == MOE_ORACLE_ACCUM_FAST ? "W8A8_FAST, rows/expert"
                        : s->f8                              ? "W8A8, rows/expert"
                                                             : "rows/expert",
                        s->deterministic ? 1.0 : rows_per_expert, text, len);
    if (s->deterministic && strlen(text) + 1 < len)
        snprintf(text + strlen(text), len - strlen(text), ", pinned by deterministic mode");
}
