/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA backend across GPUs (world > 1) over NCCL: all-gather dispatch, per-rank expert compute,
 * f32 summed return by reduce-scatter (or the dense deterministic return), and the step's
 * verdict carried in the dispatch so that every rank fails the same step together. */
#include <stdlib.h>
#include <string.h>

#include "kernels/combine.h"
#include "kernels/ep.h"
#include "kernels/gpu.h"
#include "kernels/permute.h"
#include "kernels/route.h"
#include "runtime/backend_cuda.h"
#include "runtime/diag.h"

void moe_cuda_ep_plan_workspace(cuda_layer_t *s, carve_t *c)
{
    const size_t H = (size_t)s->H, k = (size_t)s->k, t1 = (size_t)s->tm, tm = (size_t)s->max_tokens;
    /* summed return: f32 [W tm][H] partials; deterministic: bf16 [W tm k][H] entries */
    const size_t dense = s->deterministic ? 2 * tm * k * H : sizeof(float) * tm * H;
    const size_t mine = s->deterministic ? 2 * t1 * k * H : sizeof(float) * t1 * H;
    s->xsend = moe_cuda_take(c, 2 * t1 * H);
    s->xall = moe_cuda_take(c, 2 * tm * H);
    s->ids_all = moe_cuda_take(c, sizeof(int32_t) * tm * k);
    s->lids = moe_cuda_take(c, sizeof(int32_t) * tm * k);
    s->dense = moe_cuda_take(c, dense);
    s->mine = moe_cuda_take(c, mine);
    s->smine = moe_cuda_take(c, 2 * t1 * H);
    s->w_all = moe_cuda_take(c, sizeof(float) * tm * k);
    s->one_block = moe_cuda_take(c, sizeof(int32_t) * 2);
    s->flag = moe_cuda_take(c, sizeof(int32_t));
    s->flags_all = moe_cuda_take(c, sizeof(int32_t) * (size_t)s->world);
}

void moe_cuda_ep_plan_persistent(cuda_layer_t *s, carve_t *c)
{
    s->iota = moe_cuda_take(c, sizeof(int32_t) * (size_t)(s->tm * s->k));
    s->ones = moe_cuda_take(c, sizeof(float) * (size_t)s->tm);
}

/* The runtime's NCCL communicator (made by the first multi-GPU layer; collective, bounded by
 * the runtime's timeout). */
static moe_status_t ep_connect(moe_layer_t *l, cuda_layer_t *s)
{
#ifdef MOE_HAVE_NCCL
    if (!l->rt->gpu_ctx)
        MOE_CHECK(moe_nccl_create(l->rt->comm, l->rt->timeout_ms, (moe_nccl_t **)&l->rt->gpu_ctx));
    s->nccl = l->rt->gpu_ctx;
    return MOE_STATUS_SUCCESS;
#else
    (void)l;
    (void)s;
    return moe_error(MOE_STATUS_NOT_SUPPORTED, "multi-GPU needs NCCL");
#endif
}

static moe_status_t ep_fill_iota(cuda_layer_t *s)
{
    const int64_t n = s->tm * s->k;
    int32_t *h = malloc(sizeof(int32_t) * (size_t)(n + 1));
    moe_status_t st;
    int64_t i;
    if (!h)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "slot table");
    for (i = 0; i < n; i++)
        h[i] = (int32_t)i;
    st = moe_gpu_memcpy_h2d(s->iota, h, sizeof(int32_t) * (size_t)n);
    for (i = 0; i < s->tm && st == MOE_STATUS_SUCCESS; i++)
        ((float *)h)[i] = 1.0f;
    if (st == MOE_STATUS_SUCCESS)
        st = moe_gpu_memcpy_h2d(s->ones, h, sizeof(float) * (size_t)s->tm);
    free(h);
    return st;
}

moe_status_t moe_cuda_ep_init(moe_layer_t *l, cuda_layer_t *s)
{
    /* see make_plan: deterministic EP keeps the whole shared MLP on every rank */
    s->shared_local = s->deterministic && s->ss > 0 && s->ss == l->plan.shared_intermediate;
    MOE_CHECK(ep_connect(l, s));
    if (l->cfg.dispatch == MOE_DISPATCH_ALL_TO_ALL)
        MOE_LOG_WARN("CUDA", "dispatch = all-to-all is not built for the CUDA backend yet: this "
                             "layer uses the all-gather dispatch (same results)");
    return ep_fill_iota(s);
}

/* Dispatch: this rank's tokens (bf16, padded to tm rows, ids -1 past T) and its status flag to
 * every rank by all-gather; then the local experts' ids, all -1 if any rank's flag is set.
 * T = 0 and no x for a rank whose arguments failed. */
static moe_status_t ep_dispatch(moe_layer_t *l, const void *x, moe_dtype_t dtype, int64_t T,
                                void *stream)
{
    cuda_layer_t *s = l->state;
    const int64_t tm = s->m, k = s->k, H = s->H;
    moe_rows_args_t r = {x, dtype, T, s->H, (int)tm, 1, s->xsend, s->one_block, s->one_block + 1};
    moe_ep_local_ids_args_t li = {s->ids_all, s->lids,      s->world * tm * k, s->first_local,
                                  s->E,       s->flags_all, s->world,          s->sticky};
    moe_status_t st, end;

    if (T < tm)
        MOE_CHECK(moe_gpu_memset_async(s->ids + T * k, 0xff,
                                       sizeof(int32_t) * (size_t)((tm - T) * k), stream));
    MOE_CHECK(moe_rows_launch(&r, stream));
    /* one NCCL group: tokens, ids, flags and (for the summed return) routing weights */
    MOE_CHECK(moe_nccl_group_start());
    st = moe_nccl_all_gather(s->nccl, s->xsend, s->xall, 2 * (size_t)(tm * H), stream);
    if (st == MOE_STATUS_SUCCESS)
        st = moe_nccl_all_gather(s->nccl, s->ids, s->ids_all, sizeof(int32_t) * (size_t)(tm * k),
                                 stream);
    if (st == MOE_STATUS_SUCCESS)
        st = moe_nccl_all_gather(s->nccl, s->flag, s->flags_all, sizeof(int32_t), stream);
    if (st == MOE_STATUS_SUCCESS && !s->deterministic)
        st = moe_nccl_all_gather(s->nccl, s->weights, s->w_all, sizeof(float) * (size_t)(tm * k),
                                 stream);
    end = moe_nccl_group_end(s->nccl);
    MOE_CHECK(st);
    MOE_CHECK(end);
    return moe_ep_local_ids_launch(&li, stream);
}

/* Return, default mode: each rank sums its slots of every token with their weights (and its
 * slice of the shared MLP) into an f32 partial of all tokens; a reduce-scatter adds the ranks'
 * partials in f32 (k times fewer bytes than the dense return); a last pass writes this rank's
 * T rows of y in the caller's dtype (none when `a` is NULL: this rank's arguments failed). */
static moe_status_t ep_return_summed(moe_layer_t *l, const moe_forward_args_t *a, void *stream)
{
    cuda_layer_t *s = l->state;
    const int64_t tm = s->m, W = s->world, H = s->H;
    moe_combine_args_t c;

    if (s->ss > 0 && l->cfg.shared_expert_gate) { /* the gate of every token */
        moe_route_logits_args_t g = {s->xall, MOE_DTYPE_BF16, s->sgate, s->s_gate_logit, W * tm, 1,
                                     s->H};
        MOE_CHECK(moe_route_logits_launch(&g, stream));
    }
    memset(&c, 0, sizeof(c));
    c.expert_out = s->o;
    c.row_of_slot = s->row_of_slot; /* -1 for the slots of other ranks' experts */
    c.topk_weights = s->w_all;
    c.shared_out = s->ss > 0 ? s->so : NULL;
    c.shared_gate_logit = s->ss > 0 && l->cfg.shared_expert_gate ? s->s_gate_logit : NULL;
    c.y = s->dense; /* f32 [W tm, H] partial */
    c.y_dtype = MOE_DTYPE_F32;
    c.num_tokens = W * tm;
    c.hidden = s->H;
    c.top_k = s->k;
    MOE_CHECK(moe_combine_launch(&c, stream));
    MOE_CHECK(moe_nccl_reduce_scatter(s->nccl, s->dense, s->mine, (size_t)(tm * H), MOE_DTYPE_F32,
                                      stream));
    if (!a || a->num_tokens == 0)
        return MOE_STATUS_SUCCESS;
    memset(&c, 0, sizeof(c));
    c.expert_out = s->mine;
    c.expert_out_f32 = 1;
    c.row_of_slot = s->iota;
    c.topk_weights = s->ones;
    c.y = a->y;
    c.y_dtype = a->dtype;
    c.num_tokens = a->num_tokens;
    c.hidden = s->H;
    c.top_k = 1;
    return moe_combine_launch(&c, stream);
}

/* Return, deterministic mode: each computed row into its (token, slot) entry of a zeroed
 * dense array, which a reduce-scatter brings to the source rank (one contributor per entry:
 * exact); the source combines in slot order. */
static moe_status_t ep_return_dense(moe_layer_t *l, const moe_forward_args_t *a, void *stream)
{
    cuda_layer_t *s = l->state;
    const int64_t tm = s->m, k = s->k, H = s->H, W = s->world;
    const moe_gemm_variant_t *v = moe_cuda_variant_for(s, s->last_rows_per_expert);
    moe_ep_scatter_args_t sc;

    MOE_CHECK(moe_gpu_memset_async(s->dense, 0, 2 * (size_t)(W * tm * k * H), stream));
    sc.rows = s->o;
    sc.slot_of_row = s->slot_of_row;
    sc.num_blocks = s->num_blocks;
    sc.block_rows = v->block_rows;
    sc.max_blocks = (int)moe_permute_max_blocks(W * tm * k, s->E, v->block_rows);
    sc.hidden = s->H;
    sc.dense = s->dense;
    MOE_CHECK(moe_ep_scatter_launch(&sc, stream));
    MOE_CHECK(moe_nccl_reduce_scatter(s->nccl, s->dense, s->mine, (size_t)(tm * k * H),
                                      MOE_DTYPE_BF16, stream));
    if (s->ss > 0 && !s->shared_local)
        MOE_CHECK(moe_nccl_reduce_scatter(s->nccl, s->so, s->smine, (size_t)(tm * H),
                                          MOE_DTYPE_BF16, stream));
    if (!a || a->num_tokens == 0)
        return MOE_STATUS_SUCCESS;
    if (s->ss > 0 && s->shared_local) /* as one GPU runs it: bitwise the same for any EP size */
        MOE_CHECK(moe_cuda_shared_experts(s, a->x, a->dtype, a->num_tokens, stream));
    if (s->ss > 0)
        MOE_CHECK(moe_cuda_shared_gate(l, a));
    return moe_cuda_combine(l, a, s->mine, s->iota, s->weights, s->shared_local ? s->so : s->smine);
}

static moe_status_t copy_topk(const cuda_layer_t *s, const moe_forward_args_t *a)
{
    if (!a || a->num_tokens == 0)
        return MOE_STATUS_SUCCESS;
    if (a->topk_ids)
        MOE_CHECK(moe_gpu_memcpy_d2d_async(
            a->topk_ids, s->ids, sizeof(int32_t) * (size_t)(a->num_tokens * s->k), a->stream));
    if (a->topk_weights)
        MOE_CHECK(moe_gpu_memcpy_d2d_async(a->topk_weights, s->weights,
                                           sizeof(float) * (size_t)(a->num_tokens * s->k),
                                           a->stream));
    return MOE_STATUS_SUCCESS;
}

/* One step across the ranks (every rank calls it, num_tokens may be 0). No host
 * synchronisation: buffers are sized from max_tokens_per_rank, so it can be captured.
 * Every check that can fail on one rank alone runs before the first collective; after it,
 * the calls are the same on every rank and only a CUDA or NCCL failure can stop them. */
moe_status_t moe_cuda_ep_forward(moe_layer_t *l, const moe_forward_args_t *a, moe_status_t local)
{
    cuda_layer_t *s = l->state;
    const int64_t W = s->world;
    const moe_forward_args_t *ok = local == MOE_STATUS_SUCCESS ? a : NULL; /* NULL: failed */
    void *stream = ok ? a->stream : s->last_stream;
    const int64_t T = ok ? a->num_tokens : 0;
    int64_t tm;

    /* Rows per rank this step: max_tokens_across_ranks (the same on every rank) where given,
     * so a decode step moves and computes its tokens, not the capacity. A rank whose other
     * arguments failed still uses a valid value of it (the collectives' sizes must match). */
    s->m = s->tm;
    if (a && a->max_tokens_across_ranks > 0 && a->max_tokens_across_ranks <= s->tm)
        s->m = a->max_tokens_across_ranks;
    tm = s->m;

    MOE_CHECK(moe_nccl_check(s->nccl));
    s->last_stream = stream;
    MOE_CHECK(moe_cuda_record(s, EV_START, stream));
    MOE_CHECK(moe_step_flag_set_launch(s->flag, (int32_t)local, stream));
    if (ok)
        MOE_CHECK(moe_cuda_scan_inputs(l, ok, s->flag));
    if (T > 0)
        MOE_CHECK(moe_cuda_route(l, ok, s->ids, s->weights));
    MOE_CHECK(moe_cuda_record(s, EV_ROUTE, stream));
    MOE_CHECK(ep_dispatch(l, ok ? ok->x : NULL, ok ? ok->dtype : MOE_DTYPE_BF16, T, stream));
    /* rows per local expert if every rank brought as many tokens as this one */
    s->last_rows_per_expert = (double)T * W * s->k / l->cfg.num_experts;
    MOE_CHECK(moe_cuda_routed_experts(s, s->xall, MOE_DTYPE_BF16, W * tm, s->lids,
                                      s->last_rows_per_expert, stream));
    MOE_CHECK(moe_cuda_record(s, EV_EXPERT, stream));
    if (s->ss > 0 && !s->shared_local)
        MOE_CHECK(moe_cuda_shared_experts(s, s->xall, MOE_DTYPE_BF16, W * tm, stream));
    MOE_CHECK(moe_cuda_record(s, EV_SHARED, stream));
    if (!s->deterministic)
        MOE_CHECK(ep_return_summed(l, ok, stream));
    else
        MOE_CHECK(ep_return_dense(l, ok, stream));
    MOE_CHECK(copy_topk(s, ok));
    MOE_CHECK(moe_cuda_record(s, EV_COMBINE, stream));
    if (!ok)
        return local;
    return s->profile ? moe_cuda_finish_profile(l, stream) : MOE_STATUS_SUCCESS;
}
