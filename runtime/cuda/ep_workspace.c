/* SPDX-License-Identifier: Apache-2.0 */
/* The expert-parallel half's memory: the exchange's workspace pieces and persistent arrays
 * after the one-GPU half's, the lsa transport's IPC buffer (one per runtime, mapped by every
 * rank), and the layer's EP setup and teardown (NCCL, streams, slot and owner tables). */

#include <stdlib.h>
#include <string.h>

#include "base/diag.h"
#include "kernels/a2a.h"
#include "kernels/gpu.h"
#include "kernels/permute.h"
#include "runtime/cuda/ep_internal.h"
#include "runtime/cuda/one_gpu.h"

static size_t up256(size_t x)
{
    return (x + 255) & ~(size_t)255;
}

static void sym_unmap(cuda_sym_t *y)
{
    int r;
    for (r = 0; r < y->world; r++)
        if (r != y->rank && y->peer[r]) {
            moe_gpu_ipc_close(y->peer[r]);
            y->peer[r] = NULL;
        }
}

static void sym_free(void *p)
{
    cuda_sym_t *y = p;
    if (!y)
        return;
    moe_gpu_device_synchronize();
    sym_unmap(y);
    moe_gpu_free(y->local);
    moe_gpu_free(y->seq);
    free(y);
}

/* Grows the runtime's IPC buffer to `bytes` (collective: every rank creates the same layers in
 * the same order). The old one is released only when this device is idle: every peer store
 * into it belongs to a step this device has waited for, so none is still in flight. */
static moe_status_t sym_reserve(moe_runtime_t *rt, size_t bytes)
{
    cuda_sym_t *y = rt->gpu_sym;
    const int W = rt->info.world_size, me = rt->info.rank;
    char h[MOE_GPU_IPC_HANDLE_BYTES], *all = NULL;
    int64_t cnt[MOE_A2A_MAX_WORLD], dsp[MOE_A2A_MAX_WORLD];
    moe_status_t st;
    int r;

    if (y && y->bytes >= bytes)
        return MOE_STATUS_SUCCESS;
    if (!y) {
        y = calloc(1, sizeof(*y));
        if (!y)
            return moe_error(MOE_STATUS_OUT_OF_MEMORY, "IPC buffer state");
        y->world = W;
        y->rank = me;
        MOE_CHECK_GOTO(moe_gpu_malloc((void **)&y->seq, 3 * sizeof(uint32_t)), st, fail);
        y->dead = (int32_t *)(y->seq + 1); /* zeroed once; seq is zeroed below at every reserve */
        MOE_CHECK_GOTO(moe_gpu_memset(y->dead, 0, sizeof(int32_t)), st, fail);
        rt->gpu_sym = y;
        rt->gpu_sym_free = sym_free;
    } else {
        MOE_CHECK(moe_gpu_device_synchronize());
        sym_unmap(y);
        MOE_CHECK(moe_comm_barrier(rt->comm)); /* no peer maps the old buffer any more */
        MOE_CHECK(moe_gpu_free(y->local));
        y->local = NULL;
        y->bytes = 0;
        rt->gpu_sym_bytes = 0;
    }
    MOE_CHECK(moe_gpu_memset(y->seq, 0, sizeof(uint32_t)));
    MOE_CHECK(moe_gpu_memset(y->seq + 2, 0, sizeof(uint32_t)));
    MOE_CHECK(moe_gpu_malloc((void **)&y->local, bytes));
    MOE_CHECK(moe_gpu_memset(y->local, 0, bytes));
    y->bytes = bytes;
    rt->gpu_sym_bytes = bytes;
    y->peer[me] = y->local;
    MOE_CHECK(moe_gpu_ipc_handle(y->local, h));
    all = malloc((size_t)W * MOE_GPU_IPC_HANDLE_BYTES);
    if (!all)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "IPC handles");
    for (r = 0; r < W; r++) {
        cnt[r] = 1;
        dsp[r] = r;
    }
    st = moe_comm_allgatherv(rt->comm, h, 1, all, cnt, dsp, MOE_GPU_IPC_HANDLE_BYTES);
    for (r = 0; r < W && st == MOE_STATUS_SUCCESS; r++)
        if (r != me)
            st = moe_gpu_ipc_open(all + (size_t)r * MOE_GPU_IPC_HANDLE_BYTES, (void **)&y->peer[r]);
    free(all);
    /* One verdict, and the barrier before the first store: every rank mapped every buffer, or
     * every rank fails (a rank whose map failed must not leave the others in a barrier). */
    st = moe_comm_agree(rt->comm, st);
    if (st != MOE_STATUS_SUCCESS)
        y->bytes = 0; /* unusable: a later layer maps it again rather than store through it */
    return st;
fail:
    free(y);
    return st;
}

/* This lane's arrays in the IPC buffer from `base` (lane 0: SYM_CTRL_BYTES; lane 1: lane 0's
 * end); returns their end. The same offsets on every rank (the config agrees). */
size_t moe_cuda_ep_sym_layout(cuda_layer_t *s, size_t base)
{
    const size_t W = (size_t)s->world, tm = (size_t)s->tm, H = (size_t)s->H, k = (size_t)s->k;
    s->off_ctrl = (size_t)s->lane * SYM_LANE_CTRL;
    s->off_x = base;
    s->off_ids = s->off_x + up256(2 * W * tm * H);
    s->off_w = s->off_ids + up256(4 * W * tm * k);
    s->off_tok = s->off_w + up256(4 * W * tm * k);
    s->off_ret = s->off_tok + up256(4 * W * tm);
    s->off_cnt = s->off_ret + up256(s->deterministic ? 2 * tm * k * H : 4 * W * tm * H);
    if (!s->ll)
        return s->off_cnt;
    s->off_slot = s->off_cnt + up256(4 * W * (size_t)s->n_slots);
    s->off_lla = s->off_slot + up256(4 * W * (size_t)s->ll_rows * k);
    return s->off_lla + up256(2 * (size_t)s->ll_cap * H);
}

/* Rows of the low-latency GEMM-1 input: the most any step of up to ll_rows rows per rank needs
 * at any rank, sum_e roundup(c_e, br) <= W m k + br min(E_d, W m k), over the variants those
 * steps pick (the same walk on every rank: the same shape and tables). */
static int64_t ll_capacity(const moe_layer_t *l, const cuda_layer_t *s)
{
    const int W = s->world;
    const int e_max = (s->n_slots + W - 1) / W; /* slots per rank */
    int64_t cap = 0, m;
    for (m = 1; m <= s->ll_rows; m++) {
        const moe_gemm_variant_t *v =
            moe_cuda_variant_for(s, (double)m * W * s->k / l->cfg.num_experts);
        const int64_t need =
            moe_permute_max_blocks(W * m * s->k, e_max, v->block_rows) * v->block_rows;
        cap = need > cap ? need : cap;
    }
    return cap;
}

void moe_cuda_ep_plan_workspace(cuda_layer_t *s, carve_t *c)
{
    const size_t H = (size_t)s->H, k = (size_t)s->k, t1 = (size_t)s->tm, tm = (size_t)s->max_tokens;
    const size_t W = (size_t)s->world;
    moe_cuda_plan_workspace(s, c);        /* one GPU's pieces first, the exchange's after them */
    if (s->transport == MOE_EP_ALLGATHER) /* the all-to-all's permute makes its ids local */
        s->lids = moe_cuda_take(c, sizeof(int32_t) * tm * k);
    s->flag = moe_cuda_take(c, sizeof(int32_t));
    s->flags_all = moe_cuda_take(c, sizeof(int32_t) * W);
    if (s->transport != MOE_EP_ALLGATHER) {
        s->pos = moe_cuda_take(c, sizeof(int32_t) * tm); /* [W][t1] */
        s->sent = moe_cuda_take(c, sizeof(int32_t) * W);
        s->counts_all = moe_cuda_take(c, sizeof(int32_t) * W);
        if (s->transport == MOE_EP_P2P) { /* receive arrays and staging, both [W][t1] rows */
            s->rx = moe_cuda_take(c, 2 * tm * H);
            s->rids = moe_cuda_take(c, 4 * tm * k);
            s->rw = moe_cuda_take(c, 4 * tm * k);
            s->rtok = moe_cuda_take(c, 4 * tm);
            s->ret = moe_cuda_take(c, 4 * tm * H);
            s->rctrl = moe_cuda_take(c, 4 * W * MOE_A2A_CTRL);
            s->sx = moe_cuda_take(c, 2 * tm * H);
            s->sids = moe_cuda_take(c, 4 * tm * k);
            s->sw = moe_cuda_take(c, 4 * tm * k);
            s->stok = moe_cuda_take(c, 4 * tm);
            s->sret = moe_cuda_take(c, 4 * tm * H);
            s->sctrl = moe_cuda_take(c, 4 * W * MOE_A2A_CTRL);
        }
        return;
    }
    {
        /* summed return: f32 [W tm][H] partials; deterministic: bf16 [W tm k][H] entries */
        const size_t dense = s->deterministic ? 2 * tm * k * H : sizeof(float) * tm * H;
        const size_t mine = s->deterministic ? 2 * t1 * k * H : sizeof(float) * t1 * H;
        s->xsend = moe_cuda_take(c, 2 * t1 * H);
        s->xall = moe_cuda_take(c, 2 * tm * H);
        s->ids_all = moe_cuda_take(c, sizeof(int32_t) * tm * k);
        s->dense = moe_cuda_take(c, dense);
        s->mine = moe_cuda_take(c, mine);
        s->smine = moe_cuda_take(c, 2 * t1 * H);
        s->w_all = moe_cuda_take(c, sizeof(float) * tm * k);
        s->one_block = moe_cuda_take(c, sizeof(int32_t) * 2);
    }
}

void moe_cuda_ep_plan_persistent(cuda_layer_t *s, carve_t *c)
{
    moe_cuda_plan_weights(s, c); /* one GPU's weights and data first, the exchange's after */
    s->iota = moe_cuda_take(c, sizeof(int32_t) * (size_t)(s->tm * s->k));
    s->ones = moe_cuda_take(c, sizeof(float) * (size_t)s->tm);
    s->owner = moe_cuda_take(c, sizeof(int32_t) * (size_t)s->n_slots);
    const size_t lanes = (size_t)(s->lanes > 1 ? s->lanes : 1); /* each lane's own */
    s->a2a_chain =
        moe_cuda_take(c, lanes * sizeof(uint64_t) * MOE_A2A_MAX_CTAS * MOE_A2A_MAX_WORLD);
    s->a2a_done = moe_cuda_take(c, lanes * sizeof(int32_t) * 2);
    s->round_skip = moe_cuda_take(c, sizeof(int32_t));
    /* MOE_EP_LL_KERNELS=1|2 (default 2): the low-latency dispatch in one kernel (every CTA
     * waits for the counts) or two (one CTA waits, then the grid copies) */
    s->ll_plan = s->ll && s->ll_kernels != 1
                     ? moe_cuda_take(c, sizeof(int32_t) * MOE_A2A_LL_PLAN_INTS(s->n_slots))
                     : NULL;
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
    /* s->shared_local (init_shape): the whole shared MLP here, sized for this rank's tokens */
    if (s->transport != MOE_EP_LSA) /* lsa needs no NCCL: its waits are bounded on the device */
        MOE_CHECK(ep_connect(l, s));
    MOE_CHECK(ep_fill_iota(s));
    MOE_CHECK(
        moe_gpu_memset(s->a2a_chain, 0,
                       (size_t)s->lanes * sizeof(uint64_t) * MOE_A2A_MAX_CTAS * MOE_A2A_MAX_WORLD));
    MOE_CHECK(moe_gpu_memset(s->a2a_done, 0, (size_t)s->lanes * sizeof(int32_t) * 2));
    MOE_CHECK(moe_gpu_memset(s->round_skip, 0, sizeof(int32_t)));
    MOE_CHECK(moe_gpu_host_alloc((void **)&s->host_io,
                                 sizeof(int32_t) * (size_t)s->world * (MOE_A2A_CTRL + 2)));
    /* measurement knobs, read once: the dispatch's tokens per CTA (0: the kernel's default)
     * and the low-latency dispatch's most CTAs (0: up to the SM count) */
    s->chunk_tokens = (int)l->knobs.v[MOE_KNOB_EP_CHUNK_TOKENS];
    s->ll_ctas = (int)l->knobs.v[MOE_KNOB_EP_LL_CTAS];
    if (s->ll_ctas <= 0 || s->ll_ctas > s->num_sms)
        s->ll_ctas = s->num_sms;
    /* MOE_EP_FINISH_WAIT=1: the summed finish waits for the returns in a one-CTA wait kernel
     * first, not in every CTA of its grid (one launch more; measures whether the spinning grid
     * keeps other work off the GPU; measured 2026-12-01, commit 1b760af) */
    s->finish_wait = l->knobs.v[MOE_KNOB_EP_FINISH_WAIT] != 0;
    if (s->ll)
        s->ll_cap = ll_capacity(l, s);
    /* MOE_EP_SHARED_OVERLAP=1: the whole shared MLP (no TP) on a side stream (off by default
     * until measured on two GPUs) */
    if (l->knobs.v[MOE_KNOB_EP_SHARED_OVERLAP] != 0 && s->ss > 0 && s->shared_local) {
        MOE_CHECK(moe_gpu_stream_create(&s->side));
        MOE_CHECK(moe_gpu_event_create_untimed(&s->ev_fork));
        MOE_CHECK(moe_gpu_event_create_untimed(&s->ev_join));
    }
    if (s->lanes > 1) {
        MOE_CHECK(moe_gpu_stream_create(&s->lane_stream));
        MOE_CHECK(moe_gpu_event_create_untimed(&s->ev_lane_fork));
        MOE_CHECK(moe_gpu_event_create_untimed(&s->ev_lane_skip));
        MOE_CHECK(moe_gpu_event_create_untimed(&s->ev_lane_join));
    }
    if (s->transport == MOE_EP_LSA) { /* the receive arrays: part of this layer's scratch */
        size_t bytes = s->sym_end = moe_cuda_ep_sym_layout(s, SYM_CTRL_BYTES);
        if (s->lanes > 1) { /* lane 1's after lane 0's */
            cuda_layer_t t = *s;
            t.lane = 1;
            bytes = moe_cuda_ep_sym_layout(&t, s->sym_end);
        }
        l->workspace_bytes += bytes;
        MOE_CHECK(sym_reserve(l->rt, bytes));
    }
    MOE_LOG_INFO("CUDA", "EP %d ranks: transport %s", s->world,
                 moe_cuda_ep_transport_name(s->transport));
    return MOE_STATUS_SUCCESS;
}

void moe_cuda_ep_fini(cuda_layer_t *s)
{
    if (s->side)
        moe_gpu_stream_synchronize(s->side);
    moe_gpu_event_destroy(s->ev_fork);
    moe_gpu_event_destroy(s->ev_join);
    moe_gpu_stream_destroy(s->side);
    s->side = s->ev_fork = s->ev_join = NULL;
    if (s->lane_stream)
        moe_gpu_stream_synchronize(s->lane_stream);
    moe_gpu_event_destroy(s->ev_lane_fork);
    moe_gpu_event_destroy(s->ev_lane_skip);
    moe_gpu_event_destroy(s->ev_lane_join);
    moe_gpu_stream_destroy(s->lane_stream);
    s->lane_stream = s->ev_lane_fork = s->ev_lane_skip = s->ev_lane_join = NULL;
    moe_gpu_host_free(s->host_io);
    s->host_io = NULL;
}
