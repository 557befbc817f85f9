/* SPDX-License-Identifier: Apache-2.0 */
/* The all-to-all transports' round (tp_size 1): rows go only to the ranks owning their
 * experts. lsa (CUDA IPC, NVLink loads/stores, one host): kernels/a2a.h stores each token row
 * into the receive arrays of its owners, with device-side counts, signals and bounded waits:
 * nothing waits on the host, so a step can be captured in a graph. p2p (NCCL send/recv, any
 * hosts): the same kernels into local staging arrays; the counts are read on the host (one
 * bounded synchronisation per step, not capturable), or (MOE_EP_P2P_HEADER=1) travel in-band
 * with each round's whole regions. The low-latency layout (MOE_EP_LL=1) stores rows straight
 * into the owners' GEMM-1 input. */

#include <stdlib.h>
#include <string.h>

#include "base/diag.h"
#include "kernels/a2a.h"
#include "kernels/gpu.h"
#include "kernels/permute.h"
#include "runtime/cuda/ep_internal.h"
#include "runtime/cuda/one_gpu.h"

/* local_experts hands the permute one receive region per rank of the all-to-all */
_Static_assert(MOE_A2A_MAX_WORLD <= MOE_PERMUTE_MAX_REGIONS,
               "the permute walks at most MOE_PERMUTE_MAX_REGIONS receive regions");

/* p2p: this rank's {count, status} words for rank r out, and rank r's for this rank in (inside
 * an NCCL group). */
static moe_status_t p2p_words(cuda_layer_t *s, int r, void *stream)
{
    MOE_CHECK(moe_nccl_send(s->nccl, s->sctrl + r * MOE_A2A_CTRL, 4 * MOE_A2A_CTRL, r, stream));
    return moe_nccl_recv(s->nccl, s->rctrl + r * MOE_A2A_CTRL, 4 * MOE_A2A_CTRL, r, stream);
}

/* p2p, dispatch side. Host-read sizes: the {count, status} words by NCCL, the counts read on
 * the host (one bounded wait), then exactly the rows each rank sends. In-band sizes
 * (p2p_header): the words and every region's m rows in one group, nothing read on the host.
 * host_io: [0, W) rows sent to each rank, [W, W + W * CTRL) the words received (rows from each
 * rank at COUNT). */
static moe_status_t p2p_rows(cuda_layer_t *s, void *stream)
{
    const int W = s->world, k = s->k;
    const int64_t m = s->m, H = s->H;
    int32_t *sent = s->host_io, *got = s->host_io + W;
    moe_status_t st = MOE_STATUS_SUCCESS, end;
    int r;

    if (!s->p2p_header) {
        MOE_CHECK(moe_nccl_group_start());
        for (r = 0; r < W && st == MOE_STATUS_SUCCESS; r++)
            st = p2p_words(s, r, stream);
        end = moe_nccl_group_end(s->nccl);
        MOE_CHECK(st);
        MOE_CHECK(end);
        MOE_CHECK(moe_gpu_memcpy_d2h_async(sent, s->sent, sizeof(int32_t) * (size_t)W, stream));
        MOE_CHECK(moe_gpu_memcpy_d2h_async(got, s->rctrl,
                                           sizeof(int32_t) * (size_t)W * MOE_A2A_CTRL, stream));
        MOE_CHECK(moe_nccl_wait(s->nccl, stream));
    }
    /* a row's four parts, each array m rows per rank: the bf16 row, its ids, its weights and its
     * token index; sent (then received) in this order */
    const struct {
        const char *send;
        char *recv;
        size_t row_bytes;
    } part[4] = {{(const char *)s->sx, (char *)s->rx, 2 * (size_t)H},
                 {(const char *)s->sids, (char *)s->rids, 4 * (size_t)k},
                 {(const char *)s->sw, (char *)s->rw, 4 * (size_t)k},
                 {(const char *)s->stok, (char *)s->rtok, 4}};
    int p;
    MOE_CHECK(moe_nccl_group_start());
    for (r = 0; r < W && st == MOE_STATUS_SUCCESS; r++) {
        /* in-band: m rows both ways, the same size on both sides (every rank's m is the same,
         * or the step fails: moe.h), of which the receiver reads its words' count */
        const int64_t n = s->p2p_header ? m : sent[r];
        const int64_t g = s->p2p_header ? m : got[r * MOE_A2A_CTRL + MOE_A2A_COUNT];
        const size_t at = (size_t)(r * m); /* rank r's region: its first row */
        if (s->p2p_header)
            st = p2p_words(s, r, stream);
        for (p = 0; p < 4 && n > 0 && st == MOE_STATUS_SUCCESS; p++)
            st = moe_nccl_send(s->nccl, part[p].send + at * part[p].row_bytes,
                               (size_t)n * part[p].row_bytes, r, stream);
        for (p = 0; p < 4 && g > 0 && st == MOE_STATUS_SUCCESS; p++)
            st = moe_nccl_recv(s->nccl, part[p].recv + at * part[p].row_bytes,
                               (size_t)g * part[p].row_bytes, r, stream);
    }
    end = moe_nccl_group_end(s->nccl);
    MOE_CHECK(st);
    return end;
}

/* p2p, combine side: each rank's f32 partials back (counts known from p2p_rows; in-band sizes:
 * whole regions, of which the source sums the rows it sent). */
static moe_status_t p2p_results(cuda_layer_t *s, void *stream)
{
    const int W = s->world;
    const int64_t m = s->m, H = s->H;
    const int32_t *sent = s->host_io, *got = s->host_io + W;
    moe_status_t st = MOE_STATUS_SUCCESS, end;
    int r;
    MOE_CHECK(moe_nccl_group_start());
    for (r = 0; r < W && st == MOE_STATUS_SUCCESS; r++) {
        const int64_t n = s->p2p_header ? m : got[r * MOE_A2A_CTRL + MOE_A2A_COUNT];
        const int64_t back = s->p2p_header ? m : sent[r];
        if (n > 0)
            st = moe_nccl_send(s->nccl, s->sret + r * m * H, 4 * (size_t)(n * H), r, stream);
        if (back > 0 && st == MOE_STATUS_SUCCESS)
            st = moe_nccl_recv(s->nccl, (float *)s->ret + r * m * H, 4 * (size_t)(back * H), r,
                               stream);
    }
    end = moe_nccl_group_end(s->nccl);
    MOE_CHECK(st);
    return end;
}

/* The step's receive arrays: in the IPC buffer (lsa; re-derived each step, the buffer may have
 * grown for a later layer) or the workspace (p2p, carved there). */
static cuda_sym_t *bind_sym(const moe_layer_t *l, cuda_layer_t *s)
{
    cuda_sym_t *y = l->rt->gpu_sym;
    if (s->transport != MOE_EP_LSA)
        return NULL;
    s->rctrl = ctrl_at(y->local, s, 0);
    s->rx = y->local + s->off_x;
    s->rids = (int32_t *)(y->local + s->off_ids);
    s->rw = (float *)(y->local + s->off_w);
    s->rtok = (int32_t *)(y->local + s->off_tok);
    s->ret = y->local + s->off_ret;
    return y;
}

/* The ROWS word of this round (kernels/a2a.h): its m, the step's rows and the round's index,
 * mixed (FNV-1a), never 0. Ranks whose steps differ in rows or rounds disagree on it in the
 * first round they pair up, so that step fails on every rank instead of pairing rounds of
 * different steps. */
static int32_t rows_tag(const cuda_layer_t *s)
{
    const int64_t f[3] = {s->m, s->step_rows, s->round};
    uint32_t h = 2166136261u;
    int i, b;
    for (i = 0; i < 3; i++)
        for (b = 0; b < 8; b++) {
            h ^= (uint32_t)((f[i] >> (8 * b)) & 0xff);
            h *= 16777619u;
        }
    return h ? (int32_t)h : 1;
}

/* This rank's side of the step for either dispatch (x NULL and T 0 for a rank whose arguments
 * failed). */
static moe_a2a_source_t a2a_source(const moe_layer_t *l, const cuda_layer_t *s, const cuda_sym_t *y,
                                   const moe_forward_args_t *ok, int64_t T)
{
    moe_a2a_source_t src;
    memset(&src, 0, sizeof(src));
    src.x = ok ? ok->x : NULL;
    src.x_dtype = ok ? ok->dtype : MOE_DTYPE_BF16;
    src.num_tokens = T;
    src.hidden = s->H;
    src.top_k = s->k;
    src.rank = l->plan.rank;
    src.world = s->world;
    src.region_rows = s->m;
    src.rows_tag = rows_tag(s);
    src.ids = s->slot_ids; /* slots: the owner table is per slot */
    src.weights = s->weights;
    src.owner = s->owner;
    src.status = s->flag;
    src.seq = lane_seq(y, s);
    src.dead = y ? y->dead : NULL;
    src.step_tokens = ok ? s->step_tokens : 0;
    src.skip = round_skip(s);
    return src;
}

/* The low-latency dispatch (a step of m <= ll_rows rows per rank with MOE_EP_LL=1): every
 * (token, slot) row into its owner's GEMM-1 input at the variant v's padding. */
static moe_status_t ll_dispatch(moe_layer_t *l, cuda_layer_t *s, cuda_sym_t *y,
                                const moe_a2a_source_t *src, const moe_gemm_variant_t *v,
                                void *stream)
{
    const int W = s->world, me = l->plan.rank, k = s->k;
    const int64_t m = s->m;
    moe_a2a_ll_args_t d;
    int r;

    memset(&d, 0, sizeof(d));
    d.src = *src;
    d.num_experts = s->n_slots;
    for (r = 0; r <= W; r++)
        d.first[r] = (int)moe_split_begin(s->n_slots, W, r);
    d.block_rows = v->block_rows;
    d.rows_cap = s->ll_cap;
    d.sticky = s->sticky;
    d.timeout_ns = (int64_t)l->rt->timeout_ms * 1000000;
    d.cnt = (const int32_t *)(y->local + s->off_cnt);
    d.ctrl = s->rctrl;
    for (r = 0; r < W; r++) {
        char *b = y->peer[r];
        d.dst_cnt[r] = (int32_t *)(b + s->off_cnt) + (size_t)me * s->n_slots;
        d.dst_a[r] = b + s->off_lla;
        d.dst_slot[r] = (int32_t *)(b + s->off_slot) + me * m * k;
        d.dst_w[r] = (float *)(b + s->off_w) + me * m * k;
        d.dst_tok[r] = (int32_t *)(b + s->off_tok) + me * m;
        d.dst_ctrl[r] = ctrl_at(b, s, me);
    }
    d.pos = s->pos;
    d.counts = s->sent;
    d.done = s->a2a_done;
    d.num_sms = s->ll_ctas;
    d.plan = s->ll_plan;
    return moe_a2a_ll_dispatch_launch(&d, stream);
}

/* The destination's side: the GEMM layout from the count matrix, then the GEMMs on the rows
 * the sources stored, or at a small step the fused decode kernel on them (one launch for GEMM 1,
 * the activation and GEMM 2: moe_cuda_ep_use_decode). */
static moe_status_t ll_experts(moe_layer_t *l, cuda_layer_t *s, cuda_sym_t *y,
                               const moe_gemm_variant_t *v, int mb, void *stream)
{
    moe_a2a_ll_layout_args_t g;
    memset(&g, 0, sizeof(g));
    g.cnt = (const int32_t *)(y->local + s->off_cnt);
    g.statuses = s->flags_all;
    g.world = s->world;
    g.rank = l->plan.rank;
    g.num_experts = s->n_slots;
    g.first = s->first_local;
    g.experts = s->E;
    g.block_rows = v->block_rows;
    g.max_blocks = mb;
    g.rows_cap = s->ll_cap;
    g.sticky = s->sticky;
    g.counts = s->counts;
    g.offsets = s->offsets;
    g.block_expert = s->block_expert;
    g.num_blocks = s->num_blocks;
    g.skip = round_skip(s);
    MOE_CHECK(moe_a2a_ll_layout_launch(&g, stream));
    if (moe_cuda_ep_use_decode(s, s->m)) {
        MOE_CHECK(moe_cuda_record(s, EV_PERMUTE, stream));
        return moe_cuda_decode_laid_out(l, y->local + s->off_lla, s->m, stream);
    }
    return moe_cuda_experts_laid_out(s, v, y->local + s->off_lla, mb, s->last_rows_per_expert,
                                     stream);
}

/* The regular dispatch (lsa, p2p): each token row once to every rank owning one of its
 * experts, into region `me` of their receive arrays (lsa) or into staging region r (p2p). */
static moe_status_t regular_dispatch(const moe_layer_t *l, cuda_layer_t *s, cuda_sym_t *y,
                                     const moe_a2a_source_t *src, void *stream)
{
    const int W = s->world, me = l->plan.rank, k = s->k;
    const int64_t m = s->m, H = s->H;
    moe_a2a_dispatch_args_t d;
    int r;
    memset(&d, 0, sizeof(d));
    d.src = *src;
    for (r = 0; r < W; r++) {
        if (y) { /* region `me` of rank r's arrays */
            char *b = y->peer[r];
            d.dst_x[r] = b + s->off_x + 2 * (size_t)(me * m * H);
            d.dst_ids[r] = (int32_t *)(b + s->off_ids) + me * m * k;
            d.dst_w[r] = (float *)(b + s->off_w) + me * m * k;
            d.dst_tok[r] = (int32_t *)(b + s->off_tok) + me * m;
            d.dst_ctrl[r] = ctrl_at(b, s, me);
        } else { /* staging region r */
            d.dst_x[r] = (char *)s->sx + 2 * (size_t)(r * m * H);
            d.dst_ids[r] = s->sids + r * m * k;
            d.dst_w[r] = s->sw + r * m * k;
            d.dst_tok[r] = s->stok + r * m;
        }
    }
    d.ctrl_out = y ? NULL : s->sctrl;
    d.pos = s->pos;
    d.counts = s->sent;
    d.chain = s->a2a_chain;
    d.done = s->a2a_done;
    d.num_sms = s->num_sms;
    d.chunk_tokens = s->chunk_tokens;
    MOE_CHECK(moe_a2a_dispatch_launch(&d, stream));
    return y ? MOE_STATUS_SUCCESS : p2p_rows(s, stream);
}

/* The SENT wait: every peer's rows, counts and statuses here (round 0 also leaves the later
 * rounds' skip word). Returns the arguments, which the RETURNED waits reuse. */
static moe_status_t wait_rows(moe_layer_t *l, cuda_layer_t *s, cuda_sym_t *y, void *stream,
                              moe_a2a_wait_args_t *wa)
{
    memset(wa, 0, sizeof(*wa));
    wa->ctrl = s->rctrl;
    wa->world = s->world;
    wa->word = y ? MOE_A2A_SENT : -1;
    wa->seq = lane_seq(y, s);
    wa->dead = y ? y->dead : NULL;
    wa->timeout_ns = (int64_t)l->rt->timeout_ms * 1000000;
    wa->counts = s->counts_all;
    wa->region_rows = s->m;
    wa->rows_tag = rows_tag(s);
    wa->statuses = s->flags_all;
    wa->sticky = s->sticky;
    wa->skip = round_skip(s);
    wa->skip_out = y && s->round == 0 ? s->round_skip : NULL;
    MOE_CHECK(moe_a2a_wait_launch(wa, stream));
    if (s->lanes > 1 && s->round == 0) /* lane 1's rounds read round_skip */
        MOE_CHECK(moe_gpu_event_record(s->ev_lane_skip, stream));
    wa->word = MOE_A2A_RETURNED; /* from here on: the RETURNED waits */
    wa->counts = NULL;
    wa->statuses = NULL;
    wa->skip_out = NULL;
    return MOE_STATUS_SUCCESS;
}

/* The received rows through the local experts: the permute and scatter over the live rows of
 * the W regions (global ids made local there, none if any rank's step failed), GEMMs; or the
 * GEMMs on the rows the low-latency dispatch laid out. */
static moe_status_t local_experts(moe_layer_t *l, cuda_layer_t *s, cuda_sym_t *y, int64_t T,
                                  const moe_gemm_variant_t *llv, void *stream)
{
    const int W = s->world, k = s->k;
    const int64_t m = s->m;
    moe_permute_regions_t rg;
    /* the variant's hint: the low-latency layout's comes from m, which every rank agrees on */
    s->last_rows_per_expert = (double)(llv ? m : T) * W * k / l->cfg.num_experts;
    if (llv)
        return ll_experts(l, s, y, llv,
                          (int)moe_permute_max_blocks(W * m * k, s->E, llv->block_rows), stream);
    memset(&rg, 0, sizeof(rg));
    rg.counts = s->counts_all;
    rg.rows = m;
    rg.regions = W;
    rg.first = s->first_local;
    rg.flags = s->flags_all;
    rg.sticky = s->sticky;
    return moe_cuda_routed_experts(s, s->rx, MOE_DTYPE_BF16, W * m, s->rids, &rg,
                                   s->last_rows_per_expert, stream);
}

/* Combine at the expert side: the weighted partials (or exact slot rows) straight back into
 * region `me` of each source's return array (lsa), or staging (p2p, then moved by NCCL). */
static moe_status_t return_rows(moe_layer_t *l, cuda_layer_t *s, cuda_sym_t *y, int ll,
                                void *stream)
{
    const int W = s->world, me = l->plan.rank;
    const int64_t m = s->m, H = s->H;
    moe_a2a_combine_args_t c;
    int r;
    memset(&c, 0, sizeof(c));
    c.rows = s->o;
    c.row_of_slot = ll ? (const int32_t *)(y->local + s->off_slot) : s->row_of_slot;
    c.w = s->rw;
    c.tok = s->rtok;
    c.counts = s->counts_all;
    c.hidden = s->H;
    c.top_k = s->k;
    c.rank = me;
    c.world = W;
    c.deterministic = s->deterministic;
    c.region_rows = m;
    c.seq = lane_seq(y, s);
    c.dead = y ? y->dead : NULL;
    for (r = 0; r < W; r++) {
        if (y) {
            char *b = y->peer[r] + s->off_ret;
            c.dst_ret[r] = s->deterministic ? (void *)b : (void *)(b + 4 * (size_t)(me * m * H));
            c.dst_ctrl[r] = ctrl_at(y->peer[r], s, me);
        } else {
            c.dst_ret[r] = s->sret + r * m * H;
        }
    }
    c.done = s->a2a_done + 1;
    c.num_sms = s->num_sms;
    c.sticky = s->sticky;
    c.skip = round_skip(s);
    MOE_CHECK(moe_a2a_combine_launch(&c, stream));
    return y ? MOE_STATUS_SUCCESS : p2p_results(s, stream);
}

/* The source's sum of what came back (after every peer's RETURNED) and the shared output. */
static moe_status_t finish_rows(moe_layer_t *l, cuda_layer_t *s, cuda_sym_t *y,
                                const moe_forward_args_t *ok, int64_t T,
                                const moe_a2a_wait_args_t *wa, void *stream)
{
    moe_a2a_finish_args_t f;
    /* With two lanes (or MOE_EP_FINISH_WAIT=1) the finish waits in a one-CTA wait first
     * instead of in every CTA: spinning CTAs on every SM could keep the other lane's GEMMs off
     * the GPU until a peer that needs those GEMMs answers. */
    const int wait_first = y && (s->lanes > 1 || s->finish_wait);
    if (s->deterministic) { /* lsa: every (token, slot) row is in `ret`: slot order, one GPU's */
        MOE_CHECK(moe_a2a_wait_launch(wa, stream));
        return !ok || T == 0 ? MOE_STATUS_SUCCESS
                             : moe_cuda_combine(l, ok, s->ret, s->iota, s->weights, s->so);
    }
    if (wait_first)
        MOE_CHECK(moe_a2a_wait_launch(wa, stream));
    memset(&f, 0, sizeof(f));
    f.ret = s->ret;
    f.pos = s->pos;
    f.ctrl = y && !wait_first ? s->rctrl : NULL;
    f.seq = wa->seq;
    f.dead = wa->dead;
    f.timeout_ns = wa->timeout_ns;
    f.sticky = s->sticky;
    f.num_tokens = T;
    f.region_rows = s->m;
    f.hidden = s->H;
    f.world = s->world;
    f.shared_out = s->ss > 0 && T > 0 ? s->so : NULL;
    f.shared_gate_logit = s->ss > 0 && l->cfg.shared_expert_gate ? s->s_gate_logit : NULL;
    f.y = ok ? ok->y : NULL;
    f.y_dtype = ok ? ok->dtype : MOE_DTYPE_BF16;
    f.num_sms = s->num_sms;
    f.skip = round_skip(s);
    return moe_a2a_finish_launch(&f, stream);
}

/* Rows to the ranks owning their experts; the shared MLP on this rank's tokens while they
 * travel; wait for every rank's rows; the local experts on them; weighted partials (or exact
 * slot rows) straight back; the rank-ordered sum. x is NULL and T 0 for a rank whose
 * arguments failed: it still sends its (empty) rows, status and signals. */
moe_status_t moe_cuda_ep_a2a_step(moe_layer_t *l, const moe_forward_args_t *ok, int64_t T,
                                  void *stream)
{
    cuda_layer_t *s = l->state;
    cuda_sym_t *y = bind_sym(l, s);
    /* the low-latency layout: m agreed by every rank, and the variant from it alone */
    const int ll = y && s->ll && s->m <= s->ll_rows;
    const moe_gemm_variant_t *llv =
        ll ? moe_cuda_variant_for(s, (double)s->m * s->world * s->k / l->cfg.num_experts) : NULL;
    const moe_a2a_source_t src = a2a_source(l, s, y, ok, T);
    moe_a2a_wait_args_t wa;

    s->ll_step = ll;
    if (s->side) /* from here to the finish, beside the exchange and the routed experts */
        MOE_CHECK(moe_cuda_ep_shared_fork(l, ok, T, stream));
    MOE_CHECK(ll ? ll_dispatch(l, s, y, &src, llv, stream)
                 : regular_dispatch(l, s, y, &src, stream));
    if (!s->side) /* overlaps the rows in flight */
        MOE_CHECK(moe_cuda_ep_shared_fork(l, ok, T, stream));
    MOE_CHECK(wait_rows(l, s, y, stream, &wa));
    MOE_CHECK(local_experts(l, s, y, T, llv, stream));
    MOE_CHECK(moe_cuda_record(s, EV_EXPERT, stream));
    MOE_CHECK(moe_cuda_record(s, EV_SHARED, stream));
    MOE_CHECK(return_rows(l, s, y, ll, stream));
    MOE_CHECK(moe_cuda_ep_shared_join(s, stream)); /* the finish and its combine read its output */
    return finish_rows(l, s, y, ok, T, &wa, stream);
}
