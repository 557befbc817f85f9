/* SPDX-License-Identifier: Apache-2.0 */
/* The stages of a CUDA step on one GPU (the expert-parallel half runs them on its rows):
 * route -> permute -> GEMM1 (act * up) -> GEMM2 -> combine on the caller's stream with no host
 * synchronisation and no allocation, so a step can be captured in a CUDA graph.
 *
 * Routing weights are applied in combine (f32), not in GEMM2's row_scale epilogue: GEMM2
 * writes each expert row unweighted in bf16 and combine sums w_tj * row in a fixed j order. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/diag.h"
#include "kernels/a2a.h"
#include "kernels/combine.h"
#include "kernels/decode.h"
#include "kernels/ep.h"
#include "kernels/gpu.h"
#include "kernels/permute.h"
#include "kernels/quant.h"
#include "kernels/route.h"
#include "runtime/cuda/one_gpu.h"

/* The expert MLP's two GEMMs on the rows of a (bf16); W8A8: each GEMM's input quantised per
 * row first (a -> a8, h -> h8), e4m3 weights with per-row scales; in13 / in2 (optional): each
 * expert's static scale of that input (0: dynamic). */
typedef struct mlp_io {
    const void *a; /* bf16 rows; W8A8 with src_slot: NULL, GEMM 1's input gathered from x */
    const void *x; /* W8A8 gather: tokens [T][H] of x_dtype, row r = x[src_slot[r] / k] */
    moe_dtype_t x_dtype;
    const int32_t *src_slot;
    int src_k;
    void *h, *o;
    uint8_t *a8, *h8;
    float *as, *hs;
    const void *w13, *w2;
    const float *w13s, *w2s;
    const float *in13, *in2;
    int64_t inter;
    int num_experts;
    /* W8A8 (optional): h's maxima, zeroed by GEMM 1's input quantisation, taken by GEMM 1's
     * epilogue, read by h's quantisation (one pass instead of two) */
    float *hamax;
    /* W8A8 per-row: w13s / w2s hold one scale a matrix (moe_gemm_args_t.b_scale_uniform) */
    int w13s_uniform, w2s_uniform;
} mlp_io_t;

/* h's maxima taken by GEMM 1 (mlp_io_t.hamax) where that measured faster than the
 * quantisation finding them (2026-12-04, bench/RESULTS.md, "Layer step, FP8 W8A8"): with the
 * normal tiles (0.98-0.99 of the step at 512 .. 8192 tokens) and with the swap-AB tiles when
 * h's rows are long (Mixtral's 14336: 0.92-0.99 at 1 .. 64 tokens); with the swap-AB tiles and
 * rows of 768 or 2048 (Qwen3-30B-A3B, the DeepSeek-V3 shard) level or up to 1 % slower. */
#define H_AMAX_SWAP_MIN_COLS 8192

static moe_status_t run_mlp_gemms(const cuda_layer_t *s, const moe_gemm_variant_t *v,
                                  const mlp_io_t *m, const int32_t *block_expert,
                                  const int32_t *num_blocks, int max_blocks, const int32_t *counts,
                                  const int32_t *offsets, void *stream)
{
    const int64_t rows = (int64_t)max_blocks * v->block_rows;
    float *hamax = m->hamax && (!v->swap_ab || m->inter > H_AMAX_SWAP_MIN_COLS) ? m->hamax : NULL;
    /* W8A8: what both GEMMs' input quantisations share (the step's blocks, per row or group) */
    const moe_quant_rows_args_t q0 = {.x_dtype = MOE_DTYPE_BF16,
                                      .rows = rows,
                                      .num_blocks = num_blocks,
                                      .block_rows = v->block_rows,
                                      .block_expert = block_expert,
                                      .group = s->f8 == 2 ? 128 : 0};
    moe_gemm_args_t g;
    memset(&g, 0, sizeof(g));
    g.expert_counts = counts; /* the permute's: lets a variant skip all-padding rows */
    g.expert_offsets = offsets;
    g.a = m->a;
    g.b = m->w13;
    g.c = m->h;
    g.block_expert = block_expert;
    g.num_blocks = num_blocks;
    g.max_blocks = max_blocks;
    g.num_experts = m->num_experts;
    g.n = (int)(2 * m->inter);
    g.k = s->H;
    g.epilogue = s->act == MOE_ACTIVATION_GELU ? MOE_GEMM_EPI_GELU_MUL : MOE_GEMM_EPI_SILU_MUL;
    g.ab_dtype = MOE_DTYPE_BF16;
    g.scale_kind = MOE_SCALE_NONE;
    if (s->f8) {
        moe_quant_rows_args_t q = q0;
        q.x = m->a;
        q.cols = s->H;
        q.static_scale = m->in13;
        q.q = m->a8;
        q.scale = m->as;
        if (m->src_slot) { /* the permute's gather fused in: no bf16 copy of the rows */
            q.x = m->x;
            q.x_dtype = m->x_dtype;
            q.src_slot = m->src_slot;
            q.src_k = m->src_k;
        }
        if (hamax) {
            q.zero_amax = hamax;
            q.zero_cols = s->f8 == 2 ? (int)((m->inter + 127) / 128) : 1;
            g.row_amax = hamax;
        }
        /* MOE_GEMM_EARLY_W: the quantisation is launched without PDL, so the block tables were
         * final before it started; GEMM 1 may launch under it and load weights early */
        q.trigger_next = s->early_w;
        g.early_weights = s->early_w;
        MOE_CHECK(moe_quant_rows_launch(&q, stream));
        g.a = m->a8;
        g.a_scale = m->as;
        g.b_scale = m->w13s;
        g.b_scale_uniform = s->f8 == 1 && m->w13s_uniform;
        g.ab_dtype = MOE_DTYPE_FP8_E4M3;
        g.scale_kind = f8_scale_kind(s);
    }
    g.max_ctas = s->gemm_max_ctas;
    MOE_CHECK(v->launch(&g, stream));
    g.a = m->h;
    g.b = m->w2;
    g.c = m->o;
    g.n = s->H;
    g.k = (int)m->inter;
    g.epilogue = MOE_GEMM_EPI_STORE;
    g.row_amax = NULL;
    /* the block tables GEMM 1 read: final before the kernel ahead of GEMM 2 (GEMM 1, or h's
     * quantisation after it) started, since GEMM 1 lets its successor start only past its own
     * wait for the kernels before it */
    g.early_weights = s->early_w;
    if (s->f8) {
        moe_quant_rows_args_t q = q0;
        q.x = m->h;
        q.cols = (int)m->inter;
        q.static_scale = m->in2;
        q.q = m->h8;
        q.scale = m->hs;
        q.amax = hamax;
        q.trigger_next = s->early_w; /* GEMM 2 may start under it (kernels/quant.h) */
        MOE_CHECK(moe_quant_rows_launch(&q, stream));
        g.a = m->h8;
        g.a_scale = m->hs;
        g.b_scale = m->w2s;
        g.b_scale_uniform = s->f8 == 1 && m->w2s_uniform;
    }
    return v->launch(&g, stream);
}

moe_status_t moe_cuda_record(const cuda_layer_t *s, int ev, void *stream)
{
    return s->profile ? moe_gpu_event_record(s->ev[ev], stream) : MOE_STATUS_SUCCESS;
}

/* The router logits (launched unless the caller gave them) and the scoring + top-k's arguments
 * over them. */
static moe_status_t route_args(moe_layer_t *l, const moe_forward_args_t *a, int32_t *ids, float *w,
                               moe_route_args_t *r)
{
    cuda_layer_t *s = l->state;
    const float *logits = a->router_logits;
    if (!logits) {
        moe_route_logits_args_t g = {a->x,      a->dtype,      s->router,
                                     s->logits, a->num_tokens, s->E_total,
                                     s->H,      s->router3,    s->router_planes};
        MOE_CHECK(moe_route_logits_launch(&g, a->stream));
        logits = s->logits;
    }
    memset(r, 0, sizeof(*r));
    r->params.num_experts = l->cfg.num_experts;
    r->params.top_k = l->cfg.top_k;
    r->params.scoring = l->cfg.scoring;
    r->params.use_bias = l->cfg.use_score_bias;
    r->params.n_group = l->cfg.n_group;
    r->params.topk_group = l->cfg.topk_group;
    r->params.renormalize = l->cfg.renormalize;
    r->params.scaling = l->cfg.routed_scaling_factor;
    r->logits = logits;
    r->bias = l->cfg.use_score_bias ? s->bias : NULL;
    r->topk_ids = ids;
    r->topk_weights = w;
    r->num_tokens = a->num_tokens;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_route(moe_layer_t *l, const moe_forward_args_t *a, int32_t *ids, float *w,
                            int32_t *flag)
{
    moe_route_args_t r;

    if (a->given_topk_ids) {
        moe_route_given_args_t g = {a->given_topk_ids,
                                    a->given_topk_weights,
                                    ids,
                                    w,
                                    a->num_tokens,
                                    l->cfg.top_k,
                                    l->cfg.num_experts,
                                    flag,
                                    MOE_STATUS_INVALID_ARGUMENT,
                                    MOE_STATUS_NUMERIC_ERROR};
        return moe_route_given_launch(&g, a->stream);
    }
    MOE_CHECK(route_args(l, a, ids, w, &r));
    return moe_route_launch(&r, a->stream);
}

static moe_ep_slot_ids_args_t slot_ids_args(moe_layer_t *l, const int32_t *ids, int64_t T,
                                            int64_t first_token, int32_t *out)
{
    cuda_layer_t *s = l->state;
    /* one GPU: with PDL, as the route and permute around it */
    const moe_ep_slot_ids_args_t r = {ids,
                                      out,
                                      T * s->k,
                                      s->k,
                                      first_token,
                                      l->plan.rank,
                                      s->replica_begin,
                                      s->replica_slot,
                                      s->load,
                                      l->plan.world == 1,
                                      s->E_total};
    return r;
}

moe_status_t moe_cuda_slot_ids(moe_layer_t *l, const int32_t *ids, int64_t T, int64_t first_token,
                               int32_t *out, void *stream)
{
    const moe_ep_slot_ids_args_t r = slot_ids_args(l, ids, T, first_token, out);
    return moe_ep_slot_ids_launch(&r, stream);
}

moe_status_t moe_cuda_scan_inputs(moe_layer_t *l, const moe_forward_args_t *a, int32_t *flag)
{
    cuda_layer_t *s = l->state;
    if (!l->cfg.check_inputs || a->num_tokens == 0)
        return MOE_STATUS_SUCCESS;
    MOE_CHECK(moe_scan_finite_launch(a->x, a->dtype, a->num_tokens * s->H, flag,
                                     MOE_STATUS_NUMERIC_ERROR, a->stream));
    if (a->router_logits)
        MOE_CHECK(moe_scan_finite_launch(a->router_logits, MOE_DTYPE_F32,
                                         a->num_tokens * s->E_total, flag, MOE_STATUS_NUMERIC_ERROR,
                                         a->stream));
    return MOE_STATUS_SUCCESS;
}

/* GEMM 1, the activation and GEMM 2 over the expert-grouped rows of the layout in s->counts,
 * s->offsets, s->block_expert, s->num_blocks: from `a` (bf16), or (W8A8, a NULL) gathered from
 * x through s->slot_of_row by GEMM 1's quantisation. */
static moe_status_t routed_gemms(cuda_layer_t *s, const moe_gemm_variant_t *v, const void *a,
                                 const void *x, moe_dtype_t x_dtype, int mb, double rows_per_expert,
                                 void *stream)
{
    const float *in13 = s->has_in[0] ? s->in13 : NULL, *in2 = s->has_in[1] ? s->in2 : NULL;
    mlp_io_t m = {.a = a,
                  .x_dtype = MOE_DTYPE_INVALID,
                  .h = s->h,
                  .o = s->o,
                  .a8 = s->a8,
                  .h8 = s->h8,
                  .as = s->as,
                  .hs = s->hs,
                  .w13 = s->w13,
                  .w2 = s->w2,
                  .w13s = s->w13s,
                  .w2s = s->w2s,
                  .in13 = in13,
                  .in2 = in2,
                  .inter = s->is,
                  .num_experts = s->E,
                  .hamax = s->hamax,
                  .w13s_uniform = !s->scales_vary[0],
                  .w2s_uniform = !s->scales_vary[1]};
    if (!a) {
        m.x = x;
        m.x_dtype = x_dtype;
        m.src_slot = s->slot_of_row;
        m.src_k = (int)s->k;
    }
    /* The counts let the m128 variants idle a consumer warpgroup on an all-padding half
     * block. Measured in one run (2026-12-01, commit 60251c7): 2-3.5 % faster at up to 1.5 blocks
     * of rows per expert, 4-15 % slower at 2-4 blocks per expert, so only the former. */
    const int skip = s->skip_pad && rows_per_expert <= 1.5 * v->block_rows;
    return run_mlp_gemms(s, v, &m, s->block_expert, s->num_blocks, mb, skip ? s->counts : NULL,
                         skip ? s->offsets : NULL, stream);
}

/* The permute's arguments for T tokens of ids laid out for variant v; *mb: its blocks. */
static moe_status_t permute_args(cuda_layer_t *s, const moe_gemm_variant_t *v, int64_t T,
                                 const int32_t *ids, const moe_permute_regions_t *regions, int *mb,
                                 moe_permute_args_t *out)
{
    const int br = v->block_rows;
    *mb = (int)moe_permute_max_blocks(T * s->k, s->E, br);
    const moe_permute_args_t p = {ids,
                                  T,
                                  s->k,
                                  s->E,
                                  br,
                                  *mb,
                                  s->counts,
                                  s->offsets,
                                  s->block_expert,
                                  s->num_blocks,
                                  s->row_of_slot,
                                  s->slot_of_row,
                                  s->perm_scratch,
                                  s->perm_scratch_count,
                                  s->perm_done,
                                  {0}};
    *out = p;
    if (regions)
        out->regions = *regions;
    if (*mb > s->max_blocks)
        return moe_error(MOE_STATUS_INTERNAL_ERROR, "variant %s needs %d blocks > planned %d",
                         v->name, *mb, s->max_blocks);
    return MOE_STATUS_SUCCESS;
}

/* After the permute: the gather (bf16; W8A8's GEMM 1 quantisation gathers itself) and the GEMMs. */
static moe_status_t permuted_experts(cuda_layer_t *s, const moe_gemm_variant_t *v, const void *x,
                                     moe_dtype_t x_dtype, int64_t T, int mb,
                                     const moe_permute_regions_t *regions, double rows_per_expert,
                                     void *stream)
{
    const int br = v->block_rows;
    /* the scatter form: each token row of x read once (padding rows of a left unwritten) */
    moe_gather_args_t g = {x,    x_dtype, s->H, s->k, s->slot_of_row, s->num_blocks, br, mb,
                           s->a, NULL,    0,    {0}};
    if (s->scatter_rows) {
        g.row_of_slot = s->row_of_slot;
        g.num_tokens = T;
    }
    if (regions)
        g.regions = *regions;
    if (!s->f8)
        MOE_CHECK(moe_gather_launch(&g, stream));
    MOE_CHECK(moe_cuda_record(s, EV_PERMUTE, stream));
    return routed_gemms(s, v, s->f8 ? NULL : s->a, x, x_dtype, mb, rows_per_expert, stream);
}

/* Token rows of `x` (T tokens) through their experts (ids, -1: not on this rank): permute,
 * gather, GEMM1 (act * up), GEMM2 into s->o. rows_per_expert picks the GEMM variant. */
moe_status_t moe_cuda_routed_experts(cuda_layer_t *s, const void *x, moe_dtype_t x_dtype, int64_t T,
                                     const int32_t *ids, const moe_permute_regions_t *regions,
                                     double rows_per_expert, void *stream)
{
    const moe_gemm_variant_t *v = moe_cuda_variant_for(s, rows_per_expert);
    moe_permute_args_t p;
    int mb;
    MOE_CHECK(permute_args(s, v, T, ids, regions, &mb, &p));
    MOE_CHECK(moe_permute_launch(&p, stream));
    return permuted_experts(s, v, x, x_dtype, T, mb, regions, rows_per_expert, stream);
}

/* One GPU, a small step (moe_cuda_route_permutes): the router logits, then the top-k, the slot
 * ids and the permute in one launch, then the gather and GEMMs. */
static moe_status_t route_permuted_experts(moe_layer_t *l, const moe_forward_args_t *a,
                                           int32_t *ids, float *w, double rpe)
{
    cuda_layer_t *s = l->state;
    const int64_t T = a->num_tokens;
    const moe_gemm_variant_t *v = moe_cuda_variant_for(s, rpe);
    moe_route_permute_args_t rp;
    int mb;
    MOE_CHECK(route_args(l, a, ids, w, &rp.route));
    rp.slots = slot_ids_args(l, ids, T, 0, s->slot_ids);
    MOE_CHECK(permute_args(s, v, T, s->slot_ids, NULL, &mb, &rp.permute));
    MOE_CHECK(moe_route_permute_launch(&rp, a->stream));
    MOE_CHECK(moe_cuda_record(s, EV_ROUTE, a->stream));
    return permuted_experts(s, v, a->x, a->dtype, T, mb, NULL, rpe, a->stream);
}

int moe_cuda_route_permutes(const cuda_layer_t *s, int64_t T, int given_routing)
{
    return s->route_permute && !given_routing && T <= MOE_ROUTE_PERMUTE_MAX_TOKENS;
}

moe_status_t moe_cuda_experts_laid_out(cuda_layer_t *s, const moe_gemm_variant_t *v, const void *a,
                                       int max_blocks, double rows_per_expert, void *stream)
{
    if (s->f8 || max_blocks > s->max_blocks)
        return moe_error(MOE_STATUS_INTERNAL_ERROR,
                         "laid-out experts: %s, variant %s needs %d blocks (planned %d)",
                         s->f8 ? "W8A8" : "bf16", v->name, max_blocks, s->max_blocks);
    MOE_CHECK(moe_cuda_record(s, EV_PERMUTE, stream));
    return routed_gemms(s, v, a, NULL, MOE_DTYPE_INVALID, max_blocks, rows_per_expert, stream);
}

/* The shared MLP (this rank's slice) on T tokens of x into s->so, with variant v. */
static moe_status_t shared_mlp(cuda_layer_t *s, const moe_gemm_variant_t *v, const void *x,
                               moe_dtype_t x_dtype, int64_t T, void *stream)
{
    const int br = v->block_rows;
    const int mb = (int)((T + br - 1) / br);
    moe_rows_args_t r = {x, x_dtype, T, s->H, br, mb, s->sa, s->s_block_expert, s->s_num_blocks};

    if (mb > s->s_max_blocks)
        return moe_error(MOE_STATUS_INTERNAL_ERROR, "shared: %d blocks > planned %d", mb,
                         s->s_max_blocks);
    MOE_CHECK(moe_rows_launch(&r, stream));
    {
        const float *in13 = s->has_in[2] ? s->sin13 : NULL, *in2 = s->has_in[3] ? s->sin2 : NULL;
        const mlp_io_t m = {.a = s->sa,
                            .x_dtype = MOE_DTYPE_INVALID,
                            .h = s->sh,
                            .o = s->so,
                            .a8 = s->sa8,
                            .h8 = s->sh8,
                            .as = s->sas,
                            .hs = s->shs,
                            .w13 = s->sw13,
                            .w2 = s->sw2,
                            .w13s = s->sw13s,
                            .w2s = s->sw2s,
                            .in13 = in13,
                            .in2 = in2,
                            .inter = s->ss,
                            .num_experts = 1,
                            .hamax = s->shamax,
                            .w13s_uniform = !s->scales_vary[2],
                            .w2s_uniform = !s->scales_vary[3]};
        return run_mlp_gemms(s, v, &m, s->s_block_expert, s->s_num_blocks, mb, NULL, NULL, stream);
    }
}

moe_status_t moe_cuda_shared_experts(cuda_layer_t *s, const void *x, moe_dtype_t x_dtype, int64_t T,
                                     void *stream)
{
    return shared_mlp(s, moe_cuda_variant_for(s, (double)T), x, x_dtype, T, stream);
}

/* sigmoid input of Qwen2's shared-expert gate for this rank's tokens. */
moe_status_t moe_cuda_shared_gate(moe_layer_t *l, const moe_forward_args_t *a)
{
    cuda_layer_t *s = l->state;
    moe_route_logits_args_t g = {a->x, a->dtype, s->sgate, s->s_gate_logit, a->num_tokens, 1,
                                 s->H, NULL,     0};
    if (!l->cfg.shared_expert_gate || a->num_tokens == 0)
        return MOE_STATUS_SUCCESS;
    return moe_route_logits_launch(&g, a->stream);
}

moe_status_t moe_cuda_host_wait(moe_layer_t *l, void *obj, int is_event, const char *what)
{
    const int64_t ms = (int64_t)l->rt->timeout_ms + 1000;
    if (l->plan.world == 1) /* no peer to wait for: the step's own work, however long */
        return is_event ? moe_gpu_event_synchronize(obj) : moe_gpu_stream_synchronize(obj);
    return is_event ? moe_gpu_event_wait_bounded(obj, ms, what)
                    : moe_gpu_stream_wait_bounded(obj, ms, what);
}

moe_status_t moe_cuda_finish_profile(moe_layer_t *l, int accumulate, void *stream)
{
    cuda_layer_t *s = l->state;
    float ms[EV_COUNT] = {0};
    int64_t rows = 0;
    int i;
    /* the step's earlier rounds (EP rounds), which this one adds to */
    const moe_layer_stats_t prev = accumulate ? l->stats : (moe_layer_stats_t){0};

    /* bounded like every other wait: through NCCL's watchdog with EP */
    if (s->nccl)
        MOE_CHECK(moe_nccl_wait(s->nccl, stream));
    else
        MOE_CHECK(moe_cuda_host_wait(l, s->ev[EV_COMBINE], 1, "the step's profile"));
    for (i = 1; i < EV_COUNT; i++)
        MOE_CHECK(moe_gpu_event_elapsed_ms(s->ev[i - 1], s->ev[i], &ms[i]));
    l->stats.route_us = prev.route_us + 1e3 * ms[EV_ROUTE];
    l->stats.dispatch_us = prev.dispatch_us + 1e3 * ms[EV_PERMUTE];
    l->stats.expert_us = prev.expert_us + 1e3 * ms[EV_EXPERT];
    l->stats.shared_us = prev.shared_us + 1e3 * ms[EV_SHARED];
    l->stats.combine_us = prev.combine_us + 1e3 * ms[EV_COMBINE];
    MOE_CHECK(moe_gpu_event_elapsed_ms(s->ev[EV_START], s->ev[EV_COMBINE], &ms[0]));
    l->stats.total_us = prev.total_us + 1e3 * ms[0];
    MOE_CHECK(moe_gpu_memcpy_d2h_async(s->host_counts, s->counts, sizeof(int32_t) * (size_t)s->E,
                                       stream));
    MOE_CHECK(moe_cuda_host_wait(l, stream, 0, "the step's expert counts"));
    /* rows per local slot, summed per logical expert (replicas of one expert add up) */
    if (!accumulate)
        memset(l->expert_load, 0, sizeof(int64_t) * (size_t)l->cfg.num_experts);
    for (i = 0; i < s->E; i++) {
        l->expert_load[l->plan.local_logical[i]] += s->host_counts[i];
        rows += s->host_counts[i];
    }
    l->stats.rows_received = prev.rows_received + rows;
    return MOE_STATUS_SUCCESS;
}

/* y = sum over slots in order of w * expert rows (+ [gated] shared rows), into args->y. */
moe_status_t moe_cuda_combine(moe_layer_t *l, const moe_forward_args_t *a, const void *rows,
                              const int32_t *row_of_slot, const float *w, const void *shared)
{
    cuda_layer_t *s = l->state;
    moe_combine_args_t c;
    memset(&c, 0, sizeof(c));
    c.expert_out = rows;
    c.row_of_slot = row_of_slot;
    c.topk_weights = w;
    c.shared_out = s->ss > 0 ? shared : NULL;
    c.shared_gate_logit = s->ss > 0 && l->cfg.shared_expert_gate ? s->s_gate_logit : NULL;
    c.y = a->y;
    c.y_dtype = a->dtype;
    c.num_tokens = a->num_tokens;
    c.hidden = s->H;
    c.top_k = s->k;
    return moe_combine_launch(&c, a->stream);
}

/* Static activation scales of the routed experts (W8A8), which the fused decode kernel takes
 * with GEMM 1 whole */
static int routed_static(const cuda_layer_t *s)
{
    return s->f8 && (s->has_in[0] || s->has_in[1]);
}

/* The fused decode kernel's crossover, and what it cannot run: static activation scales with
 * GEMM 1 split, x not 16-byte aligned. One GPU. */
int moe_cuda_use_decode(const cuda_layer_t *s, int64_t T, const void *x)
{
    return s->world == 1 && s->dec_ok && T <= s->dec_max &&
           !(routed_static(s) && s->dec_split1 > 1) && (!x || ((uintptr_t)x & 15) == 0);
}

/* An EP step of m rows per rank takes the fused decode kernel on the rows the low-latency
 * dispatch laid out (runtime/cuda/ep_a2a.c): the layout's step, and at most dec_max rows for
 * one expert (each source token sends an expert one row at most: world x m). A decision of
 * this rank alone (the dispatch and combine are the same either way). */
int moe_cuda_ep_use_decode(const cuda_layer_t *s, int64_t m)
{
    return s->world > 1 && s->ll && m <= s->ll_rows && s->dec_ok && s->world * m <= s->dec_max;
}

/* The bound of the fused decode kernel's waits: the runtime's timeout, at least 1 s (its own
 * waits last microseconds to a few milliseconds, a time slice of another context milliseconds)
 * and at most 10 s (they wait on the same GPU, not on a peer: a stall there is a launch whose CTAs
 * cannot all be resident, and a serving step should hear of it in seconds, not after the
 * 300 s a slow peer may be given). */
int moe_cuda_decode_timeout_ms(const moe_layer_t *l)
{
    const int ms = l->rt->timeout_ms;
    return ms < 1000 ? 1000 : ms > 10000 ? 10000 : ms;
}

int moe_cuda_decode_shared_inside(const cuda_layer_t *s)
{
    return s->dec_nsh > 0 &&
           !(s->f8 && (s->has_in[0] || s->has_in[1] || s->has_in[2] || s->has_in[3]));
}

/* The rows the fused decode step picks its shared MLP's variant for: its bound, so one variant
 * runs at every batch it takes (fp8 tiles differ in where they promote the tensor cores' sums,
 * every 128 or 512 of k, which would make the shared rows, and so a token's output, depend on
 * the batch). */
double moe_cuda_decode_shared_rows(const cuda_layer_t *s)
{
    return (double)s->dec_max;
}

/* The fused decode kernel's arguments every launch shares: the layer's weights, shape and
 * workspace, and its waits' bound. */
static void decode_common(const moe_layer_t *l, moe_decode_args_t *d)
{
    const cuda_layer_t *s = l->state;
    memset(d, 0, sizeof(*d));
    d->w13 = s->w13;
    d->w2 = s->w2;
    d->w13_scale = s->w13s;
    d->w2_scale = s->w2s;
    d->h = s->dec_h;
    d->o = s->dec_o;
    d->o1 = s->dec_o1;
    d->xq = s->dec_xq;
    d->xs = s->dec_xs;
    d->sync = s->dec_sync;
    d->num_experts = s->E;
    d->hidden = s->H;
    d->inter = (int)s->is;
    d->f8 = s->f8;
    d->gelu = s->act == MOE_ACTIVATION_GELU;
    d->split = s->dec_split;
    d->split1 = s->dec_split1;
    /* a wait past moe_cuda_decode_timeout_ms ends the launch and marks the step:
     * MOE_DECODE_STICKY_STALL */
    d->sticky = s->sticky;
    d->timeout_ns = (int64_t)moe_cuda_decode_timeout_ms(l) * 1000000;
    if (routed_static(s)) { /* per expert, 0 where one quantises dynamically; GEMM 1 whole */
        d->input_scale13 = s->has_in[0] ? s->in13 : NULL;
        d->input_scale2 = s->has_in[1] ? s->in2 : NULL;
        d->split1 = 1;
        d->o1 = NULL;
    }
}

moe_status_t moe_cuda_decode_laid_out(const moe_layer_t *l, const void *rows, int64_t m,
                                      void *stream)
{
    const cuda_layer_t *s = l->state;
    moe_decode_args_t d;
    decode_common(l, &d);
    d.x = rows;
    d.x_dtype = MOE_DTYPE_BF16;
    d.y_dtype = MOE_DTYPE_BF16;
    d.lo_counts = s->counts;
    d.lo_offsets = s->offsets;
    d.rows_out = s->o;
    { /* the kernel's columns a pass: twice the rows an expert gets on average (an expert with
       * more takes more passes), at most world x m (one row a source token) */
        const int64_t most = s->world * m, k = s->k, E = l->cfg.num_experts;
        const int64_t twice = 2 * ((most * k + E - 1) / E);
        d.lo_cols = (int)(twice < 1 ? 1 : twice > most ? most : twice);
    }
    d.num_tokens = (int64_t)s->dec_tokens * s->k; /* the workspace's rows (plan.c) */
    d.top_k = 1;
    d.sticky_rank = l->plan.rank;
    d.sticky_bits = MOE_A2A_STICKY_ROWS; /* the combine tells every source: they fail too */
    return moe_decode_launch(&d, stream);
}

/* The fused decode step: route, the shared MLP (grouped path; with dec_nsh, inside the kernel
 * unless it has static activation scales, which the kernel does not take), then one kernel for
 * GEMM 1, the activation, GEMM 2 and the weighted sum with the shared rows. Profiled, the
 * expert phase holds the shared MLP and the sum. */
static moe_status_t decode_forward(moe_layer_t *l, const moe_forward_args_t *a, int32_t *ids,
                                   float *w)
{
    cuda_layer_t *s = l->state;
    const int inside = moe_cuda_decode_shared_inside(s);
    moe_decode_args_t d;
    MOE_CHECK(moe_cuda_record(s, EV_START, a->stream));
    MOE_CHECK(moe_cuda_scan_inputs(l, a, s->sticky));
    MOE_CHECK(moe_cuda_route(l, a, ids, w, s->sticky));
    MOE_CHECK(moe_cuda_slot_ids(l, ids, a->num_tokens, 0, s->slot_ids, a->stream));
    MOE_CHECK(moe_cuda_record(s, EV_ROUTE, a->stream));
    MOE_CHECK(moe_cuda_record(s, EV_PERMUTE, a->stream));
    if (s->ss > 0) {
        if (!inside)
            MOE_CHECK(shared_mlp(s, moe_cuda_variant_for(s, moe_cuda_decode_shared_rows(s)), a->x,
                                 a->dtype, a->num_tokens, a->stream));
        MOE_CHECK(moe_cuda_shared_gate(l, a));
    }
    decode_common(l, &d);
    d.x = a->x;
    d.x_dtype = a->dtype;
    d.topk_ids = s->slot_ids; /* the local slots (weights per slot) */
    d.topk_weights = w;
    d.shared_out = s->ss > 0 && !inside ? s->so : NULL;
    d.shared_gate_logit = s->ss > 0 && l->cfg.shared_expert_gate ? s->s_gate_logit : NULL;
    if (inside) {
        d.shared_w13 = s->sw13;
        d.shared_w2 = s->sw2;
        d.shared_w13_scale = s->sw13s;
        d.shared_w2_scale = s->sw2s;
        d.shared_inter = (int)s->ss;
    }
    d.y = a->y;
    d.y_dtype = a->dtype;
    d.counts = s->counts;
    d.num_tokens = a->num_tokens;
    d.top_k = s->k;
    MOE_CHECK(moe_decode_launch(&d, a->stream));
    MOE_CHECK(moe_cuda_record(s, EV_EXPERT, a->stream));
    MOE_CHECK(moe_cuda_record(s, EV_SHARED, a->stream));
    MOE_CHECK(moe_cuda_record(s, EV_COMBINE, a->stream));
    return s->profile ? moe_cuda_finish_profile(l, 0, a->stream) : MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_forward_one_gpu(moe_layer_t *l, const moe_forward_args_t *a)
{
    cuda_layer_t *s = l->state;
    int32_t *ids = a->topk_ids ? a->topk_ids : s->ids;
    float *w = a->topk_weights ? a->topk_weights : s->weights;
    const double rpe = (double)a->num_tokens * s->k / s->E; /* picks the GEMM variant */

    if (moe_cuda_use_decode(s, a->num_tokens, a->x))
        return decode_forward(l, a, ids, w);

    MOE_CHECK(moe_cuda_record(s, EV_START, a->stream));
    MOE_CHECK(moe_cuda_scan_inputs(l, a, s->sticky));
    if (moe_cuda_route_permutes(s, a->num_tokens, a->given_topk_ids != NULL)) {
        MOE_CHECK(route_permuted_experts(l, a, ids, w, rpe));
    } else {
        MOE_CHECK(moe_cuda_route(l, a, ids, w, s->sticky));
        MOE_CHECK(moe_cuda_slot_ids(l, ids, a->num_tokens, 0, s->slot_ids, a->stream));
        MOE_CHECK(moe_cuda_record(s, EV_ROUTE, a->stream));
        MOE_CHECK(moe_cuda_routed_experts(s, a->x, a->dtype, a->num_tokens, s->slot_ids, NULL, rpe,
                                          a->stream));
    }
    MOE_CHECK(moe_cuda_record(s, EV_EXPERT, a->stream));
    if (s->ss > 0) {
        MOE_CHECK(moe_cuda_shared_experts(s, a->x, a->dtype, a->num_tokens, a->stream));
        MOE_CHECK(moe_cuda_shared_gate(l, a));
    }
    MOE_CHECK(moe_cuda_record(s, EV_SHARED, a->stream));
    MOE_CHECK(moe_cuda_combine(l, a, s->o, s->row_of_slot, w, s->so));
    MOE_CHECK(moe_cuda_record(s, EV_COMBINE, a->stream));
    return s->profile ? moe_cuda_finish_profile(l, 0, a->stream) : MOE_STATUS_SUCCESS;
}
