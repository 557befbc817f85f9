/* SPDX-License-Identifier: Apache-2.0 */
/* A step across GPUs (world > 1): its rounds (runtime/ep_rounds.h) on one or two micro-batch
 * lanes, each round's route, exchange and experts (ep_allgather.c or ep_a2a.c; ep.h says how
 * each transport moves the rows), and the profile. Each step carries every rank's status, so
 * every rank fails the same step together. */

#include <stdlib.h>
#include <string.h>

#include "base/diag.h"
#include "kernels/a2a.h"
#include "kernels/ep.h"
#include "kernels/gpu.h"
#include "runtime/cuda/ep_internal.h"
#include "runtime/cuda/one_gpu.h"
#include "runtime/ep_rounds.h"

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

/* Payload bytes this rank sent to other ranks in the step just profiled (synchronised). */
static moe_status_t profile_bytes(moe_layer_t *l, cuda_layer_t *s, int64_t T, int accumulate,
                                  void *stream)
{
    const int64_t W = s->world, m = s->m, H = s->H, k = s->k, me = l->plan.rank;
    moe_status_t st = MOE_STATUS_SUCCESS;
    int64_t b = 0, r;
    if (s->transport == MOE_EP_ALLGATHER) {
        b = (W - 1) * m * (2 * H + 4 * k + 4 + (s->deterministic ? 0 : 4 * k));
        b += s->deterministic ? (W - 1) * m * k * H * 2 : (W - 1) * m * H * 4;
    } else {
        /* rows (lsa, p2p: one per (token, rank); the low-latency layout: one per (token, slot)
         * to another rank, and its counts per expert), per row the slots' ids or rows, weights
         * and the token index out; f32 partials back (summed mode). Every count in one
         * synchronisation: [W (CTRL + 1), + W) of host_io is spare, and its start (p2p_rows'
         * words) is not in use once the step is done. */
        int32_t *sent = s->host_io + W * (MOE_A2A_CTRL + 1), *got = s->host_io, *ids = NULL;
        int64_t i;
        if (s->ll_step && !(ids = malloc(sizeof(int32_t) * (size_t)(T * k + 1))))
            return moe_error(MOE_STATUS_OUT_OF_MEMORY, "profile: %lld ids", (long long)(T * k));
        MOE_CHECK_GOTO(moe_gpu_memcpy_d2h_async(sent, s->sent, sizeof(int32_t) * (size_t)W, stream),
                       st, done);
        MOE_CHECK_GOTO(
            moe_gpu_memcpy_d2h_async(got, s->counts_all, sizeof(int32_t) * (size_t)W, stream), st,
            done);
        if (ids)
            MOE_CHECK_GOTO(moe_gpu_memcpy_d2h_async(ids, s->slot_ids,
                                                    sizeof(int32_t) * (size_t)(T * k), stream),
                           st, done);
        MOE_CHECK_GOTO(moe_gpu_stream_synchronize(stream), st, done);
        for (i = 0; ids && i < T * k; i++)
            if (ids[i] >= 0 && l->plan.slot_owner[ids[i]] != me)
                b += 2 * H;
        for (r = 0; r < W; r++) {
            /* in-band p2p sizes: whole regions both ways, whatever the counts */
            const int64_t out = s->p2p_header ? m : sent[r], in = s->p2p_header ? m : got[r];
            if (r != me)
                b += out * (8 * k + 4) + (ids ? 4 * (int64_t)s->n_slots : out * 2 * H) +
                     (s->deterministic ? 0 : in * 4 * H);
        }
    done:
        free(ids);
        MOE_CHECK(st);
    }
    l->stats.bytes_sent = b + (accumulate ? l->stats.bytes_sent : 0);
    return MOE_STATUS_SUCCESS;
}

/* One round of a step across the ranks (every rank calls it, num_tokens may be 0): s->m rows
 * per rank. `ok`: this round's slice of the caller's arguments, NULL where this rank's
 * arguments failed (or were not given). accumulate: add the profile to the earlier rounds'. */
static moe_status_t ep_round(moe_layer_t *l, const moe_forward_args_t *ok, moe_status_t local,
                             int accumulate, void *stream)
{
    cuda_layer_t *s = l->state;
    const int64_t T = ok ? ok->num_tokens : 0;
    const moe_a2a_skip_t skip = round_skip(s);

    MOE_CHECK(moe_cuda_record(s, EV_START, stream));
    MOE_CHECK(moe_step_flag_set_launch(
        s->flag, (int32_t)local, s->transport == MOE_EP_LSA ? lane_seq(l->rt->gpu_sym, s) : NULL,
        skip.rows, skip.first, stream));
    if (ok)
        MOE_CHECK(moe_cuda_scan_inputs(l, ok, s->flag));
    if (T > 0) {
        MOE_CHECK(moe_cuda_route(l, ok, s->ids, s->weights, s->flag));
        /* this round's tokens start at round * tm among the caller's (args_slice) */
        MOE_CHECK(moe_cuda_slot_ids(l, s->ids, T, s->round * s->tm, s->slot_ids, stream));
    }
    MOE_CHECK(moe_cuda_record(s, EV_ROUTE, stream));
    if (s->transport != MOE_EP_ALLGATHER)
        MOE_CHECK(moe_cuda_ep_a2a_step(l, ok, T, stream));
    else
        MOE_CHECK(moe_cuda_ep_allgather_step(l, ok, T, stream));
    MOE_CHECK(copy_topk(s, ok));
    MOE_CHECK(moe_cuda_record(s, EV_COMBINE, stream));
    if (!ok || !s->profile)
        return MOE_STATUS_SUCCESS;
    {
        moe_status_t st = moe_cuda_finish_profile(l, accumulate, stream);
        if (st == MOE_STATUS_TIMEOUT) /* the host's deadline: the ranks are out of step */
            moe_cuda_ep_timed_out(l, -1);
        MOE_CHECK(st);
    }
    return profile_bytes(l, s, T, accumulate, stream);
}

/* `a`'s tokens [first, first + n) as arguments of their own (n > 0). */
static moe_forward_args_t args_slice(const moe_layer_t *l, const moe_forward_args_t *a,
                                     int64_t first, int64_t n)
{
    moe_forward_args_t r = *a;
    const size_t row = moe_dtype_size(a->dtype) * (size_t)l->cfg.hidden;
    const int64_t k = l->cfg.top_k;
    r.num_tokens = n;
    if (first == 0)
        return r;
    r.x = (const char *)a->x + row * (size_t)first;
    r.y = (char *)a->y + row * (size_t)first;
    if (a->router_logits)
        r.router_logits = a->router_logits + first * l->cfg.num_experts;
    if (a->topk_ids)
        r.topk_ids = a->topk_ids + first * k;
    if (a->topk_weights)
        r.topk_weights = a->topk_weights + first * k;
    if (a->given_topk_ids) {
        r.given_topk_ids = a->given_topk_ids + first * k;
        r.given_topk_weights = a->given_topk_weights + first * k;
    }
    return r;
}

/* Round i of the step (rows [i tm, i tm + m) of every rank's step, this rank's tokens among
 * them) on state v (the layer's, or lane 1's view) and stream `on`. */
static moe_status_t run_round(moe_layer_t *l, cuda_layer_t *v, const moe_forward_args_t *ok,
                              moe_status_t local, int64_t T, int64_t i, void *on)
{
    cuda_layer_t *s = l->state;
    const int64_t here = moe_ep_round_tokens_here(T, s->step_rows, s->tm, i);
    moe_forward_args_t part;
    moe_status_t st;
    v->m = moe_ep_round_rows(s->step_rows, s->tm, i);
    v->round = i;
    if (ok) {
        part = args_slice(l, ok, here > 0 ? i * s->tm : 0, here);
        part.stream = on;
    }
    l->state = v;
    st = ep_round(l, ok ? &part : NULL, local, i > 0, on); /* profile: summed */
    l->state = s;
    return st;
}

/* Lane 1's view of the layer (micro-batches): lane 0's state on the workspace's second half,
 * with lane 1's IPC arrays, control words, sequence number, dispatch scratch and permute
 * counter, no profile and no side stream. */
static void lane_view(const moe_layer_t *l, const cuda_layer_t *s, cuda_layer_t *t)
{
    carve_t c = {NULL, 0};

    *t = *s;
    t->lane = 1;
    t->profile = 0;
    t->side = NULL;
    t->shared_pending = 0;
    c.base = (char *)l->rt->gpu_ws + s->ws_bytes;
    moe_cuda_ep_plan_workspace(t, &c);
    t->a2a_chain = s->a2a_chain + MOE_A2A_MAX_CTAS * MOE_A2A_MAX_WORLD;
    t->a2a_done = s->a2a_done + 2;
    t->perm_done = s->perm_done + 1;
    moe_cuda_ep_sym_layout(t, s->sym_end);
}

/* A step of two or more rounds on two lanes: round i on lane i % 2, lane 1 on its own stream
 * after the caller's stream's earlier work and round 0's wait (the round_skip word), the
 * caller's stream after lane 1's last round. Each lane keeps the one-lane order among its own
 * rounds, so its buffers are reused only as one lane's are. The persistent GEMMs leave two SMs
 * to the other lane's one-CTA waits. No per-phase profile: the phases overlap (MOE_PROFILE
 * leaves the stats zero). */
static moe_status_t lanes_forward(moe_layer_t *l, const moe_forward_args_t *ok, moe_status_t local,
                                  int64_t T, int64_t rounds, void *stream)
{
    cuda_layer_t *s = l->state, t;
    moe_status_t st = MOE_STATUS_SUCCESS;
    int64_t i;

    if (s->profile) /* asked for, but the phases overlap: no stale numbers either */
        memset(&l->stats, 0, sizeof(l->stats));
    s->profile = 0;
    lane_view(l, s, &t);
    s->gemm_max_ctas = t.gemm_max_ctas = s->num_sms > 4 ? s->num_sms - 2 : 0;
    MOE_CHECK(moe_gpu_event_record(s->ev_lane_fork, stream));
    MOE_CHECK(moe_gpu_stream_wait_event(s->lane_stream, s->ev_lane_fork));
    for (i = 0; i < rounds && st == MOE_STATUS_SUCCESS; i++) {
        if (i == 1)
            st = moe_gpu_stream_wait_event(s->lane_stream, s->ev_lane_skip);
        if (st == MOE_STATUS_SUCCESS)
            st = run_round(l, i & 1 ? &t : s, ok, local, T, i, i & 1 ? s->lane_stream : stream);
    }
    s->gemm_max_ctas = 0;
    MOE_CHECK(st);
    MOE_CHECK(moe_gpu_event_record(s->ev_lane_join, s->lane_stream));
    return moe_gpu_stream_wait_event(stream, s->ev_lane_join);
}

/* One step across the ranks (every rank calls it, num_tokens may be 0), in rounds of at most
 * s->tm rows per rank (moe.h, ep_round_tokens): the buffers hold one round. No host
 * synchronisation: the round count comes from max_tokens_across_ranks or the capacity, both
 * known alike on every rank, so it can be captured. Every check that can fail on one rank
 * alone runs before the first collective; after it, the calls are the same on every rank and
 * only a CUDA or NCCL failure can stop them. */
moe_status_t moe_cuda_ep_forward(moe_layer_t *l, const moe_forward_args_t *a, moe_status_t local)
{
    cuda_layer_t *s = l->state;
    const moe_forward_args_t *ok = local == MOE_STATUS_SUCCESS ? a : NULL; /* NULL: failed */
    /* the caller's stream even when its other arguments failed, so that the next step and
     * moe_layer_synchronize(stream) are ordered after this one's collectives */
    void *stream = a ? a->stream : s->last_stream;
    const int64_t T = ok ? a->num_tokens : 0;
    int64_t rounds, i;

    /* Rows per rank this step: max_tokens_across_ranks (the same on every rank) where given,
     * so a decode step moves and computes its tokens, not the capacity. A rank whose other
     * arguments failed still uses a valid value of it (the collectives' sizes must match); a
     * rank with no arguments at all (args NULL) keeps the previous step's value, the likeliest
     * to match its peers' (a mismatch ends in the bounded timeout, as moe.h says). */
    if (a)
        s->step_rows = a->max_tokens_across_ranks > 0 && a->max_tokens_across_ranks <= s->cap
                           ? a->max_tokens_across_ranks
                           : s->cap;
    rounds = moe_ep_rounds(s->step_rows, s->tm);

    if (s->transport == MOE_EP_P2P && !s->p2p_header) { /* every rank: a failed one too */
        int capturing = 0;
        MOE_CHECK(moe_gpu_stream_is_capturing(stream, &capturing));
        if (capturing) /* before the first collective: the peers time out, bounded */
            return moe_error(MOE_STATUS_NOT_SUPPORTED,
                             "MOE_EP_TRANSPORT=p2p reads each step's counts on the host: it "
                             "cannot be captured in a CUDA graph (lsa, allgather and p2p with "
                             "MOE_EP_P2P_HEADER=1 can)");
    }
    if (s->nccl)
        MOE_CHECK(moe_nccl_check(s->nccl));
    if (s->transport == MOE_EP_LSA && ((cuda_sym_t *)l->rt->gpu_sym)->broken) {
        const int r = ((cuda_sym_t *)l->rt->gpu_sym)->broken_rank;
        if (r < 0) /* the host's deadline passed first (moe_cuda_host_wait) */
            return moe_error(MOE_STATUS_INVALID_STATE,
                             "an earlier step did not finish within the runtime's timeout (a "
                             "peer stopped mid-step): the ranks' buffers are out of step for "
                             "good; destroy the runtime");
        return moe_error(MOE_STATUS_INVALID_STATE,
                         "an earlier step's all-to-all timed out waiting for rank %d: the ranks' "
                         "buffers are out of step for good; destroy the runtime",
                         r);
    }
    s->last_stream = stream;
    s->step_tokens = T;
    if (s->lanes > 1 && rounds > 1) {
        MOE_CHECK(lanes_forward(l, ok, local, T, rounds, stream));
        return ok ? MOE_STATUS_SUCCESS : local;
    }
    for (i = 0; i < rounds; i++)
        MOE_CHECK(run_round(l, s, ok, local, T, i, stream));
    return ok ? MOE_STATUS_SUCCESS : local;
}

void moe_cuda_ep_timed_out(moe_layer_t *l, int rank)
{
    cuda_sym_t *y = l->rt->gpu_sym;
    if (y && !y->broken) {
        y->broken = 1;
        y->broken_rank = rank;
    }
}
