/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA backend across GPUs (world > 1). Three transports for the tokens and the results:
 *  - allgather (NCCL): every rank gets every rank's tokens (padded to the step's rows per
 *    rank), computes its experts' rows; they return summed per rank in f32 by reduce-scatter,
 *    or in the dense exact layout in deterministic mode. TP layouts use it.
 *  - lsa (CUDA IPC, NVLink loads/stores, one host): kernels/a2a.h stores each token row only
 *    into the receive arrays of the ranks owning its experts, with device-side counts, signals
 *    and bounded waits: nothing waits on the host, so a step can be captured in a graph.
 *  - p2p (NCCL send/recv, any hosts): the same kernels into local staging arrays; the counts
 *    are read on the host (one bounded synchronisation per step, not capturable), then NCCL
 *    moves exactly the rows sent; or (MOE_EP_P2P_HEADER=1) the counts travel in-band with
 *    each round's whole regions (no host read, capturable, bytes follow the round's rows).
 * Each step carries every rank's status, so every rank fails the same step together. */
#include <stdlib.h>
#include <string.h>

#include "kernels/a2a.h"
#include "kernels/combine.h"
#include "kernels/ep.h"
#include "kernels/gpu.h"
#include "kernels/gpu_topo.h"
#include "kernels/permute.h"
#include "kernels/route.h"
#include "runtime/backend_cuda.h"
#include "base/diag.h"
#include "runtime/ep_rounds.h"

/* local_experts hands the permute one receive region per rank of the all-to-all */
_Static_assert(MOE_A2A_MAX_WORLD <= MOE_PERMUTE_MAX_REGIONS,
               "the permute walks at most MOE_PERMUTE_MAX_REGIONS receive regions");

/* ---- the IPC buffer of the lsa transport (one per runtime, mapped by every rank) --------- */

typedef struct cuda_sym {
    char *local;
    size_t bytes;
    int world, rank;
    char *peer[MOE_A2A_MAX_WORLD]; /* peer[rank] = local */
    uint32_t *seq; /* device [3]: the runtime's EP step count ([2]: micro-batch lane 1's) */
    int32_t *dead; /* device scalar (seq[1]): a wait of this rank timed out, so its kernels
                      store nothing into peers any more (a rank that stopped waiting runs
                      ahead; its stores could land in a region a peer still reads) */
    int broken;    /* a wait timed out: the ranks' sequence numbers are out of step for good */
    int broken_rank;
} cuda_sym_t;

/* ctrl words first, at a fixed place for every layer (a later layer's arrays never alias them):
 * lane 0's, then micro-batch lane 1's */
#define SYM_LANE_CTRL (4 * MOE_A2A_MAX_WORLD * MOE_A2A_CTRL) /* a multiple of 256 */
#define SYM_CTRL_BYTES (2 * SYM_LANE_CTRL)

static size_t up256(size_t x)
{
    return (x + 255) & ~(size_t)255;
}

/* This lane's sequence number and its control words in rank r's buffer `b`. */
static uint32_t *lane_seq(const cuda_sym_t *y, const cuda_layer_t *s)
{
    return y ? y->seq + (s->lane ? 2 : 0) : NULL;
}

static int32_t *ctrl_at(char *b, const cuda_layer_t *s, int r)
{
    return (int32_t *)(b + s->off_ctrl) + (size_t)r * MOE_A2A_CTRL;
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
static size_t sym_layout(cuda_layer_t *s, size_t base)
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
    s->off_slot = s->off_cnt + up256(4 * W * (size_t)s->E_total);
    s->off_lla = s->off_slot + up256(4 * W * (size_t)s->ll_rows * k);
    return s->off_lla + up256(2 * (size_t)s->ll_cap * H);
}

/* An on/off environment switch that must be alike on every rank (collective): 0 or 1 into *on. */
static moe_status_t agreed_switch(moe_layer_t *l, const char *name, int *on)
{
    const int64_t want = moe_env_int(name, 0);
    int64_t v[2] = {want, -want};
    MOE_CHECK(moe_comm_allreduce_i64(l->rt->comm, v, 2, MOE_REDUCE_MAX));
    if (v[0] != -v[1])
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "%s=%lld on rank %d differs from another rank's: set it alike on every "
                         "rank",
                         name, (long long)want, l->plan.rank);
    if (want != 0 && want != 1)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "%s=%lld: expected 0 or 1", name,
                         (long long)want);
    *on = (int)want;
    return MOE_STATUS_SUCCESS;
}

/* MOE_EP_LL=0|1 (default 0; every rank alike): the low-latency layout for steps of at most
 * ll_rows rows per rank (lsa, bf16 GEMMs, at most MOE_A2A_LL_MAX_EXPERTS experts). Off by
 * default until it is measured against the regular lsa step on two GPUs. */
static moe_status_t pick_ll(moe_layer_t *l, cuda_layer_t *s)
{
    int want = 0;
    const char *why = s->transport != MOE_EP_LSA ? "the lsa transport"
                      : s->f8                    ? "bf16 GEMMs (W8A8 quantises GEMM 1's rows "
                                                   "through the permute's map)"
                      : s->E_total > MOE_A2A_LL_MAX_EXPERTS ? "at most 1024 experts"
                      : s->k > 32                           ? "top_k <= 32"
                                                            : NULL;
    MOE_CHECK(agreed_switch(l, "MOE_EP_LL", &want));
    if (want && why)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "MOE_EP_LL=1 (the low-latency all-to-all layout) needs %s", why);
    s->ll = want;
    s->ll_rows = s->tm < MOE_A2A_LL_MAX_TOKENS ? s->tm : MOE_A2A_LL_MAX_TOKENS;
    if (s->ll_rows * s->k > MOE_A2A_LL_MAX_PAIRS)
        s->ll_rows = MOE_A2A_LL_MAX_PAIRS / s->k;
    return MOE_STATUS_SUCCESS;
}

/* MOE_EP_MICROBATCH=0|1 (default 0; every rank alike): two lanes of rounds (backend_cuda.h),
 * each holding half a round, so a step of more than one lane's round overlaps one round's
 * exchange with the other's GEMMs. lsa only, and not with the low-latency layout (its
 * dispatch waits in every CTA, which could keep the other lane's GEMMs from SMs). */
static moe_status_t pick_lanes(moe_layer_t *l, cuda_layer_t *s)
{
    int want = 0;
    MOE_CHECK(agreed_switch(l, "MOE_EP_MICROBATCH", &want));
    s->lanes = 1;
    if (!want)
        return MOE_STATUS_SUCCESS;
    if (s->transport != MOE_EP_LSA || s->ll)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "MOE_EP_MICROBATCH=1 (two micro-batches in flight) needs the lsa "
                         "transport without MOE_EP_LL (this layer: %s%s)",
                         moe_cuda_ep_transport_name(s->transport), s->ll ? ", MOE_EP_LL=1" : "");
    s->lanes = 2;
    s->tm = (s->tm + 1) / 2; /* the same buffers as one round of the configured size */
    s->max_tokens = s->tm * s->world;
    s->m = s->tm;
    l->ep_round_tokens = s->tm;
    return MOE_STATUS_SUCCESS;
}

/* MOE_EP_P2P_HEADER=0|1 (default 0; every rank alike): how p2p makes each step's sizes known.
 * 0: the counts are read on the host (one bounded synchronisation a step, then exactly the rows
 * sent move). 1: every round sends each rank its whole region of m rows (m = the round's rows
 * per rank: max_tokens_across_ranks where told, else the round size) with the {count, status}
 * words in the same NCCL group; the receiver uses the first `count` rows. Nothing waits on the
 * host, so the step can be captured in a CUDA graph, and the bytes follow m, not the rows. */
static moe_status_t pick_p2p_header(moe_layer_t *l, cuda_layer_t *s)
{
    int want = 0;
    MOE_CHECK(agreed_switch(l, "MOE_EP_P2P_HEADER", &want));
    if (want && s->transport != MOE_EP_P2P)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "MOE_EP_P2P_HEADER=1 (p2p sizes in-band) needs the p2p transport (this "
                         "layer: %s)",
                         moe_cuda_ep_transport_name(s->transport));
    s->p2p_header = want;
    return MOE_STATUS_SUCCESS;
}

/* Rows of the low-latency GEMM-1 input: the most any step of up to ll_rows rows per rank needs
 * at any rank, sum_e roundup(c_e, br) <= W m k + br min(E_d, W m k), over the variants those
 * steps pick (the same walk on every rank: the same shape and tables). */
static int64_t ll_capacity(const moe_layer_t *l, const cuda_layer_t *s)
{
    const int W = s->world;
    const int e_max = (l->cfg.num_experts + W - 1) / W;
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

void moe_cuda_ep_timed_out(moe_layer_t *l, int rank)
{
    cuda_sym_t *y = l->rt->gpu_sym;
    if (y && !y->broken) {
        y->broken = 1;
        y->broken_rank = rank;
    }
}

/* ---- transport choice ------------------------------------------------------------------- */

const char *moe_cuda_ep_transport_name(int t)
{
    return t == MOE_EP_LSA ? "lsa" : t == MOE_EP_P2P ? "p2p" : "allgather";
}

/* The tune file's transport for this layout and capacity (cfg.dispatch AUTO only), or -1. */
static int tuned_transport(const moe_layer_t *l, cuda_layer_t *s)
{
    moe_oracle_query_t q = s->oq;
    moe_oracle_choice_t c;
    q.value = (double)s->cap;
    if (l->cfg.dispatch != MOE_DISPATCH_AUTO || !moe_oracle_pick_transport(&s->oracle, &q, &c))
        return -1;
    for (int t = MOE_EP_ALLGATHER; t <= MOE_EP_P2P; t++)
        if (!strcmp(c.name, moe_cuda_ep_transport_name(t))) {
            s->transport_why = c;
            return t;
        }
    return -1;
}

/* MOE_FORCE_TRANSPORT or MOE_EP_TRANSPORT = auto|lsa|p2p|allgather (default auto) over
 * cfg.dispatch. auto: the tune file's choice (MOE_TUNE_FILE) where it fits the layout; else
 * lsa where every rank is on this host and reaches every other's GPU directly (tp_size 1);
 * else allgather, or p2p when the config asks for all-to-all. The same on every rank: the
 * request, the tuned choice and each rank's view of the hardware are gathered first. */
static moe_status_t pick_transport(moe_layer_t *l, cuda_layer_t *s)
{
    const char *forced = NULL, *ename = NULL, *env;
    const int W = s->world, me = l->plan.rank, tp = l->plan.tp_size;
    /* per rank: the request, on this host, the tuned transport, then its GPU's PCI bus id
     * (device ordinals mean nothing in another process with another CUDA_VISIBLE_DEVICES) */
    enum { FIXED = 3, WORDS = FIXED + MOE_GPU_BUS_ID_BYTES / 4 };
    int32_t mine[WORDS], *all;
    int64_t cnt[64], dsp[64];
    int want, tuned, local_rank = 0, local_size = 0, lsa_ok, r, same = 1, tuned_same = 1;
    moe_status_t st;

    memset(&s->transport_why, 0, sizeof(s->transport_why));
    MOE_CHECK(moe_oracle_forced_transport(&forced, &ename));
    env = forced ? forced : "auto";
    if (!ename)
        ename = "MOE_EP_TRANSPORT";
    if (!forced)
        want = -1;
    else if (!strcmp(env, "lsa"))
        want = MOE_EP_LSA;
    else if (!strcmp(env, "p2p"))
        want = MOE_EP_P2P;
    else if (!strcmp(env, "allgather"))
        want = MOE_EP_ALLGATHER;
    else
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "%s=%s: expected auto, lsa, p2p or allgather",
                         ename, env);
    if (want >= 0) {
        s->transport_why.name = moe_cuda_ep_transport_name(want);
        s->transport_why.source = MOE_ORACLE_FORCED;
        s->transport_why.origin = ename;
    }
    if (W > 64)
        return want == -1 || want == MOE_EP_ALLGATHER
                   ? (s->transport = MOE_EP_ALLGATHER, MOE_STATUS_SUCCESS)
                   : moe_error(MOE_STATUS_NOT_SUPPORTED,
                               "%s=%s: built for up to 64 ranks (world %d)", ename, env, W);
    tuned = want < 0 ? tuned_transport(l, s) : -1;
    MOE_CHECK(moe_comm_node_rank(l->rt->comm, &local_rank, &local_size));
    all = malloc(sizeof(int32_t) * WORDS * (size_t)W);
    if (!all)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "transport agreement");
    for (r = 0; r < W; r++) {
        cnt[r] = WORDS;
        dsp[r] = WORDS * r;
    }
    memset(mine, 0, sizeof(mine));
    mine[0] = want;
    mine[1] = local_size == W && W <= MOE_A2A_MAX_WORLD;
    mine[2] = tuned;
    if (moe_gpu_pci_bus_id(s->device, (char *)(mine + FIXED), MOE_GPU_BUS_ID_BYTES) !=
        MOE_STATUS_SUCCESS)
        memset(mine + FIXED, 0, MOE_GPU_BUS_ID_BYTES); /* unknown: no lsa with this rank */
    ((char *)(mine + FIXED))[MOE_GPU_BUS_ID_BYTES - 1] = '\0';
    st = moe_comm_allgatherv(l->rt->comm, mine, WORDS, all, cnt, dsp, sizeof(int32_t));
    lsa_ok = tp == 1 && W <= MOE_A2A_MAX_WORLD;
    for (r = 0; r < W && st == MOE_STATUS_SUCCESS; r++) {
        char *bus = (char *)(all + WORDS * r + FIXED);
        bus[MOE_GPU_BUS_ID_BYTES - 1] = '\0';
        same &= all[WORDS * r] == want;
        tuned_same &= all[WORDS * r + 2] == tuned;
        lsa_ok &= all[WORDS * r + 1] != 0;
        if (r != me && lsa_ok)
            lsa_ok &= moe_gpu_can_access_peer_bus(s->device, bus);
    }
    free(all);
    MOE_CHECK(st);
    if (!same)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "%s=%s on rank %d differs from another rank's: set it "
                         "alike on every rank",
                         ename, env, me);
    { /* this rank's peer access must hold on every rank */
        int64_t v = lsa_ok, *allv = malloc(sizeof(int64_t) * (size_t)W);
        if (!allv)
            return moe_error(MOE_STATUS_OUT_OF_MEMORY, "transport agreement");
        for (r = 0; r < W; r++)
            cnt[r] = 1, dsp[r] = r;
        st = moe_comm_allgatherv(l->rt->comm, &v, 1, allv, cnt, dsp, sizeof(int64_t));
        for (r = 0; r < W && st == MOE_STATUS_SUCCESS; r++)
            lsa_ok &= allv[r] != 0;
        free(allv);
        MOE_CHECK(st);
    }
    if (want == MOE_EP_LSA && !lsa_ok)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "%s=lsa needs tp_size 1 (got %d), every rank on one host "
                         "(%d of %d here), at most %d ranks, and direct access between every "
                         "pair of GPUs",
                         ename, tp, local_size, W, MOE_A2A_MAX_WORLD);
    if (want == MOE_EP_P2P && (tp != 1 || s->deterministic || W > MOE_A2A_MAX_WORLD))
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "%s=p2p needs tp_size 1 (got %d), deterministic 0 (got "
                         "%d; its exact return is built for lsa and allgather) and at most %d "
                         "ranks (got %d)",
                         ename, tp, s->deterministic, MOE_A2A_MAX_WORLD, W);
    if (tuned >= 0 && tuned_same &&
        (tuned == MOE_EP_ALLGATHER || (tuned == MOE_EP_LSA && lsa_ok) ||
         (tuned == MOE_EP_P2P && tp == 1 && !s->deterministic && W <= MOE_A2A_MAX_WORLD))) {
        want = tuned; /* transport_why says tuned */
    } else if (tuned >= 0) {
        MOE_LOG_WARN("CUDA", "MOE_TUNE_FILE: transport %s %s; the built-in rule decides",
                     moe_cuda_ep_transport_name(tuned),
                     tuned_same ? "does not run this layout here"
                                : "differs among the ranks' tune files");
        memset(&s->transport_why, 0, sizeof(s->transport_why));
    }
    if (want >= 0)
        s->transport = want;
    else if (l->cfg.dispatch == MOE_DISPATCH_ALL_GATHER)
        s->transport = MOE_EP_ALLGATHER;
    else if (lsa_ok)
        s->transport = MOE_EP_LSA;
    else if (l->cfg.dispatch == MOE_DISPATCH_ALL_TO_ALL && tp == 1 && !s->deterministic &&
             W <= MOE_A2A_MAX_WORLD)
        s->transport = MOE_EP_P2P;
    else
        s->transport = MOE_EP_ALLGATHER;
    if (l->cfg.dispatch == MOE_DISPATCH_ALL_TO_ALL && s->transport == MOE_EP_ALLGATHER)
        MOE_LOG_WARN("CUDA",
                     "dispatch = all-to-all: this layout (tp_size %d%s) uses the "
                     "all-gather dispatch (same results)",
                     tp, s->deterministic ? ", deterministic across hosts" : "");
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_ep_choose(moe_layer_t *l, cuda_layer_t *s)
{
    /* With TP every rank of an EP group adds a GEMM-2 partial to the same (token, slot) entry,
     * and NCCL sums them in bf16 in an order of its own choosing (by message size): neither
     * exact nor fixed, so the deterministic guarantee does not hold there. */
    if (s->deterministic && l->plan.tp_size > 1)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "deterministic = 1 with tp_size %d on the CUDA backend: the tensor-"
                         "parallel partials are summed by NCCL in bf16, in no fixed order (use "
                         "tp_size 1, or the CPU backend)",
                         l->plan.tp_size);
    MOE_CHECK(pick_transport(l, s));
    MOE_CHECK(pick_ll(l, s));
    MOE_CHECK(pick_lanes(l, s));
    MOE_CHECK(pick_p2p_header(l, s));
    return moe_gpu_sm_count(s->device, &s->num_sms);
}

void moe_cuda_ep_plan_workspace(cuda_layer_t *s, carve_t *c)
{
    const size_t H = (size_t)s->H, k = (size_t)s->k, t1 = (size_t)s->tm, tm = (size_t)s->max_tokens;
    const size_t W = (size_t)s->world;
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
    s->iota = moe_cuda_take(c, sizeof(int32_t) * (size_t)(s->tm * s->k));
    s->ones = moe_cuda_take(c, sizeof(float) * (size_t)s->tm);
    s->owner = moe_cuda_take(c, sizeof(int32_t) * (size_t)s->E_total);
    const size_t lanes = (size_t)(s->lanes > 1 ? s->lanes : 1); /* each lane's own */
    s->a2a_chain =
        moe_cuda_take(c, lanes * sizeof(uint64_t) * MOE_A2A_MAX_CTAS * MOE_A2A_MAX_WORLD);
    s->a2a_done = moe_cuda_take(c, lanes * sizeof(int32_t) * 2);
    s->round_skip = moe_cuda_take(c, sizeof(int32_t));
    /* MOE_EP_LL_KERNELS=1|2 (default 2): the low-latency dispatch in one kernel (every CTA
     * waits for the counts) or two (one CTA waits, then the grid copies) */
    s->ll_plan = s->ll && moe_env_int("MOE_EP_LL_KERNELS", 2) != 1
                     ? moe_cuda_take(c, sizeof(int32_t) * MOE_A2A_LL_PLAN_INTS(s->E_total))
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

/* The rank of each expert (tp_size 1: its EP rank), for the all-to-all's destinations. */
static moe_status_t fill_owner(const moe_layer_t *l, cuda_layer_t *s)
{
    int32_t *h = malloc(sizeof(int32_t) * (size_t)s->E_total);
    moe_status_t st;
    int e;
    if (!h)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "expert owners");
    for (e = 0; e < s->E_total; e++)
        h[e] = l->plan.expert_owner[e] * l->plan.tp_size;
    st = moe_gpu_memcpy_h2d(s->owner, h, sizeof(int32_t) * (size_t)s->E_total);
    free(h);
    return st;
}

moe_status_t moe_cuda_ep_init(moe_layer_t *l, cuda_layer_t *s)
{
    /* s->shared_local (init_shape): the whole shared MLP here, sized for this rank's tokens */
    if (s->transport != MOE_EP_LSA) /* lsa needs no NCCL: its waits are bounded on the device */
        MOE_CHECK(ep_connect(l, s));
    MOE_CHECK(ep_fill_iota(s));
    MOE_CHECK(fill_owner(l, s));
    MOE_CHECK(
        moe_gpu_memset(s->a2a_chain, 0,
                       (size_t)s->lanes * sizeof(uint64_t) * MOE_A2A_MAX_CTAS * MOE_A2A_MAX_WORLD));
    MOE_CHECK(moe_gpu_memset(s->a2a_done, 0, (size_t)s->lanes * sizeof(int32_t) * 2));
    MOE_CHECK(moe_gpu_memset(s->round_skip, 0, sizeof(int32_t)));
    MOE_CHECK(moe_gpu_host_alloc((void **)&s->host_io,
                                 sizeof(int32_t) * (size_t)s->world * (MOE_A2A_CTRL + 2)));
    /* measurement knobs, read once: the dispatch's tokens per CTA (0: the kernel's default)
     * and the low-latency dispatch's most CTAs (0: up to the SM count) */
    s->chunk_tokens = (int)moe_env_int("MOE_EP_CHUNK_TOKENS", 0);
    s->ll_ctas = (int)moe_env_int("MOE_EP_LL_CTAS", 0);
    if (s->ll_ctas <= 0 || s->ll_ctas > s->num_sms)
        s->ll_ctas = s->num_sms;
    /* MOE_EP_FINISH_WAIT=1: the summed finish waits for the returns in a one-CTA wait kernel
     * first, not in every CTA of its grid (one launch more; measures whether the spinning grid
     * keeps other work off the GPU: bench/RESULTS.md, eleventh session) */
    s->finish_wait = moe_env_int("MOE_EP_FINISH_WAIT", 0) != 0;
    if (s->ll)
        s->ll_cap = ll_capacity(l, s);
    /* MOE_EP_SHARED_OVERLAP=1: the whole shared MLP (no TP) on a side stream (off by default
     * until measured on two GPUs) */
    if (moe_env_int("MOE_EP_SHARED_OVERLAP", 0) != 0 && s->ss > 0 && s->shared_local) {
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
        size_t bytes = s->sym_end = sym_layout(s, SYM_CTRL_BYTES);
        if (s->lanes > 1) { /* lane 1's after lane 0's */
            cuda_layer_t t = *s;
            t.lane = 1;
            bytes = sym_layout(&t, s->sym_end);
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

/* ---- all-to-all step (lsa, p2p) ---------------------------------------------------------- */

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

/* This round's skip (kernels/a2a.h): rounds after the first, on lsa, whose words come from
 * round 0's wait. p2p moves its words by NCCL on the host, which cannot skip. */
static moe_a2a_skip_t round_skip(const cuda_layer_t *s)
{
    moe_a2a_skip_t k = {NULL, 0};
    if (s->transport == MOE_EP_LSA && s->round > 0) {
        k.rows = s->round_skip;
        k.first = s->round * s->tm;
    }
    return k;
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
    src.ids = s->ids;
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
    d.num_experts = s->E_total;
    for (r = 0; r <= W; r++)
        d.first[r] = (int)moe_split_begin(s->E_total, W, r);
    d.block_rows = v->block_rows;
    d.rows_cap = s->ll_cap;
    d.sticky = s->sticky;
    d.timeout_ns = (int64_t)l->rt->timeout_ms * 1000000;
    d.cnt = (const int32_t *)(y->local + s->off_cnt);
    d.ctrl = s->rctrl;
    for (r = 0; r < W; r++) {
        char *b = y->peer[r];
        d.dst_cnt[r] = (int32_t *)(b + s->off_cnt) + (size_t)me * s->E_total;
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
 * the sources stored. */
static moe_status_t ll_experts(moe_layer_t *l, cuda_layer_t *s, cuda_sym_t *y,
                               const moe_gemm_variant_t *v, int mb, void *stream)
{
    moe_a2a_ll_layout_args_t g;
    memset(&g, 0, sizeof(g));
    g.cnt = (const int32_t *)(y->local + s->off_cnt);
    g.statuses = s->flags_all;
    g.world = s->world;
    g.rank = l->plan.rank;
    g.num_experts = s->E_total;
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
    return moe_cuda_experts_laid_out(s, v, y->local + s->off_lla, mb, s->last_rows_per_expert,
                                     stream);
}

/* The whole shared MLP (and Qwen2's gate) on this rank's T tokens: on the stream, or where
 * MOE_EP_SHARED_OVERLAP=1 on the side stream after an event of the stream's, so it runs
 * while the stream goes on (shared_join orders its output before the stream reads it). */
static moe_status_t shared_fork(moe_layer_t *l, const moe_forward_args_t *ok, int64_t T,
                                void *stream)
{
    cuda_layer_t *s = l->state;
    moe_forward_args_t g;
    void *on = s->side ? s->side : stream;
    if (s->ss == 0 || T == 0)
        return MOE_STATUS_SUCCESS;
    if (s->side) {
        MOE_CHECK(moe_gpu_event_record(s->ev_fork, stream));
        MOE_CHECK(moe_gpu_stream_wait_event(s->side, s->ev_fork));
    }
    g = *ok;
    g.stream = on;
    MOE_CHECK(moe_cuda_shared_experts(s, ok->x, ok->dtype, T, on));
    MOE_CHECK(moe_cuda_shared_gate(l, &g));
    if (s->side) {
        MOE_CHECK(moe_gpu_event_record(s->ev_join, s->side));
        s->shared_pending = 1;
    }
    return MOE_STATUS_SUCCESS;
}

static moe_status_t shared_join(cuda_layer_t *s, void *stream)
{
    if (!s->shared_pending)
        return MOE_STATUS_SUCCESS;
    s->shared_pending = 0;
    return moe_gpu_stream_wait_event(stream, s->ev_join);
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
static moe_status_t a2a_step(moe_layer_t *l, const moe_forward_args_t *ok, int64_t T, void *stream)
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
        MOE_CHECK(shared_fork(l, ok, T, stream));
    MOE_CHECK(ll ? ll_dispatch(l, s, y, &src, llv, stream)
                 : regular_dispatch(l, s, y, &src, stream));
    if (!s->side) /* overlaps the rows in flight */
        MOE_CHECK(shared_fork(l, ok, T, stream));
    MOE_CHECK(wait_rows(l, s, y, stream, &wa));
    MOE_CHECK(local_experts(l, s, y, T, llv, stream));
    MOE_CHECK(moe_cuda_record(s, EV_EXPERT, stream));
    MOE_CHECK(moe_cuda_record(s, EV_SHARED, stream));
    MOE_CHECK(return_rows(l, s, y, ll, stream));
    MOE_CHECK(shared_join(s, stream)); /* the finish and its combine read its output */
    return finish_rows(l, s, y, ok, T, &wa, stream);
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
            MOE_CHECK_GOTO(
                moe_gpu_memcpy_d2h_async(ids, s->ids, sizeof(int32_t) * (size_t)(T * k), stream),
                st, done);
        MOE_CHECK_GOTO(moe_gpu_stream_synchronize(stream), st, done);
        for (i = 0; ids && i < T * k; i++)
            if (ids[i] >= 0 && l->plan.expert_owner[ids[i]] != me)
                b += 2 * H;
        for (r = 0; r < W; r++) {
            /* in-band p2p sizes: whole regions both ways, whatever the counts */
            const int64_t out = s->p2p_header ? m : sent[r], in = s->p2p_header ? m : got[r];
            if (r != me)
                b += out * (8 * k + 4) + (ids ? 4 * (int64_t)s->E_total : out * 2 * H) +
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
    const int64_t W = s->world, tm = s->m;
    const int64_t T = ok ? ok->num_tokens : 0;
    const moe_a2a_skip_t skip = round_skip(s);

    MOE_CHECK(moe_cuda_record(s, EV_START, stream));
    MOE_CHECK(moe_step_flag_set_launch(
        s->flag, (int32_t)local, s->transport == MOE_EP_LSA ? lane_seq(l->rt->gpu_sym, s) : NULL,
        skip.rows, skip.first, stream));
    if (ok)
        MOE_CHECK(moe_cuda_scan_inputs(l, ok, s->flag));
    if (T > 0)
        MOE_CHECK(moe_cuda_route(l, ok, s->ids, s->weights));
    MOE_CHECK(moe_cuda_record(s, EV_ROUTE, stream));
    if (s->transport != MOE_EP_ALLGATHER) {
        MOE_CHECK(a2a_step(l, ok, T, stream));
    } else {
        /* the whole shared MLP (no TP) on this rank's tokens, as one GPU runs it */
        if (s->shared_local)
            MOE_CHECK(shared_fork(l, ok, T, stream));
        MOE_CHECK(ep_dispatch(l, ok ? ok->x : NULL, ok ? ok->dtype : MOE_DTYPE_BF16, T, stream));
        /* rows per local expert if every rank brought as many tokens as this one */
        s->last_rows_per_expert = (double)T * W * s->k / l->cfg.num_experts;
        MOE_CHECK(moe_cuda_routed_experts(s, s->xall, MOE_DTYPE_BF16, W * tm, s->lids, NULL,
                                          s->last_rows_per_expert, stream));
        MOE_CHECK(moe_cuda_record(s, EV_EXPERT, stream));
        if (s->ss > 0 && !s->shared_local)
            MOE_CHECK(moe_cuda_shared_experts(s, s->xall, MOE_DTYPE_BF16, W * tm, stream));
        MOE_CHECK(moe_cuda_record(s, EV_SHARED, stream));
        MOE_CHECK(shared_join(s, stream)); /* the return reads its output */
        if (!s->deterministic)
            MOE_CHECK(ep_return_summed(l, ok, stream));
        else
            MOE_CHECK(ep_return_dense(l, ok, stream));
    }
    MOE_CHECK(copy_topk(s, ok));
    MOE_CHECK(moe_cuda_record(s, EV_COMBINE, stream));
    if (!ok || !s->profile)
        return MOE_STATUS_SUCCESS;
    MOE_CHECK(moe_cuda_finish_profile(l, accumulate, stream));
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
    *t = *s;
    t->lane = 1;
    t->profile = 0;
    t->side = NULL;
    t->shared_pending = 0;
    moe_cuda_carve_workspace(t, (char *)l->rt->gpu_ws + s->ws_bytes);
    t->a2a_chain = s->a2a_chain + MOE_A2A_MAX_CTAS * MOE_A2A_MAX_WORLD;
    t->a2a_done = s->a2a_done + 2;
    t->perm_done = s->perm_done + 1;
    sym_layout(t, s->sym_end);
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
    if (s->transport == MOE_EP_LSA && ((cuda_sym_t *)l->rt->gpu_sym)->broken)
        return moe_error(MOE_STATUS_INVALID_STATE,
                         "an earlier step's all-to-all timed out waiting for rank %d: the ranks' "
                         "buffers are out of step for good; destroy the runtime",
                         ((cuda_sym_t *)l->rt->gpu_sym)->broken_rank);
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
