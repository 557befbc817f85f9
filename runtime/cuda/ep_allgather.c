/* SPDX-License-Identifier: Apache-2.0 */
/* The allgather transport's round (NCCL): every rank gets every rank's tokens, computes its
 * experts' rows over all of them, and the rows return summed per rank in f32 by
 * reduce-scatter, or in the dense exact layout in deterministic mode. TP layouts use it. */

#include <stdlib.h>
#include <string.h>

#include "base/diag.h"
#include "kernels/combine.h"
#include "kernels/ep.h"
#include "kernels/gpu.h"
#include "kernels/permute.h"
#include "kernels/route.h"
#include "runtime/cuda/ep_internal.h"
#include "runtime/cuda/one_gpu.h"

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
        MOE_CHECK(moe_gpu_memset_async(s->slot_ids + T * k, 0xff,
                                       sizeof(int32_t) * (size_t)((tm - T) * k), stream));
    MOE_CHECK(moe_rows_launch(&r, stream));
    /* one NCCL group: tokens, ids, flags and (for the summed return) routing weights */
    MOE_CHECK(moe_nccl_group_start());
    st = moe_nccl_all_gather(s->nccl, s->xsend, s->xall, 2 * (size_t)(tm * H), stream);
    if (st == MOE_STATUS_SUCCESS)
        st = moe_nccl_all_gather(s->nccl, s->slot_ids, s->ids_all,
                                 sizeof(int32_t) * (size_t)(tm * k), stream);
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

    if (s->ss > 0 && !s->shared_local && l->cfg.shared_expert_gate) { /* every token's gate */
        moe_route_logits_args_t g = {s->xall, MOE_DTYPE_BF16, s->sgate, s->s_gate_logit, W * tm, 1,
                                     s->H,    NULL,           0};
        MOE_CHECK(moe_route_logits_launch(&g, stream));
    }
    memset(&c, 0, sizeof(c));
    c.expert_out = s->o;
    c.row_of_slot = s->row_of_slot; /* -1 for the slots of other ranks' experts */
    c.topk_weights = s->w_all;
    c.shared_out = s->ss > 0 && !s->shared_local ? s->so : NULL; /* a slice of every token's */
    c.shared_gate_logit = c.shared_out && l->cfg.shared_expert_gate ? s->s_gate_logit : NULL;
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
    c.shared_out = s->ss > 0 && s->shared_local ? s->so : NULL; /* whole, on this rank's tokens */
    c.shared_gate_logit = c.shared_out && l->cfg.shared_expert_gate ? s->s_gate_logit : NULL;
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
    if (s->ss > 0 && !s->shared_local)
        MOE_CHECK(moe_cuda_shared_gate(l, a));
    return moe_cuda_combine(l, a, s->mine, s->iota, s->weights, s->shared_local ? s->so : s->smine);
}

/* A round on the allgather transport: the whole shared MLP (no TP) on this rank's tokens, as
 * one GPU runs it; every rank's tokens here; this rank's experts on all of them; the return. */
moe_status_t moe_cuda_ep_allgather_step(moe_layer_t *l, const moe_forward_args_t *ok, int64_t T,
                                        void *stream)
{
    cuda_layer_t *s = l->state;
    const int64_t W = s->world, tm = s->m;
    /* the whole shared MLP (no TP) on this rank's tokens, as one GPU runs it */
    if (s->shared_local)
        MOE_CHECK(moe_cuda_ep_shared_fork(l, ok, T, stream));
    MOE_CHECK(ep_dispatch(l, ok ? ok->x : NULL, ok ? ok->dtype : MOE_DTYPE_BF16, T, stream));
    /* rows per local expert if every rank brought as many tokens as this one */
    s->last_rows_per_expert = (double)T * W * s->k / l->cfg.num_experts;
    MOE_CHECK(moe_cuda_routed_experts(s, s->xall, MOE_DTYPE_BF16, W * tm, s->lids, NULL,
                                      s->last_rows_per_expert, stream));
    MOE_CHECK(moe_cuda_record(s, EV_EXPERT, stream));
    if (s->ss > 0 && !s->shared_local)
        MOE_CHECK(moe_cuda_shared_experts(s, s->xall, MOE_DTYPE_BF16, W * tm, stream));
    MOE_CHECK(moe_cuda_record(s, EV_SHARED, stream));
    MOE_CHECK(moe_cuda_ep_shared_join(s, stream)); /* the return reads its output */
    if (!s->deterministic)
        return ep_return_summed(l, ok, stream);
    return ep_return_dense(l, ok, stream);
}
