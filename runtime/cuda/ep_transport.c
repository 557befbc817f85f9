/* SPDX-License-Identifier: Apache-2.0 */
/* The expert-parallel transport: allgather, lsa or p2p (forced, tuned, or the built-in rule
 * from the layout and the hardware), and its switches (MOE_EP_LL, MOE_EP_MICROBATCH,
 * MOE_EP_P2P_HEADER), agreed by every rank before the workspace is planned. */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/diag.h"
#include "kernels/a2a.h"
#include "kernels/gpu.h"
#include "kernels/gpu_topo.h"
#include "runtime/cuda/ep_internal.h"
#include "runtime/cuda/one_gpu.h"

/* An on/off switch, read and agreed by every rank at layer create (runtime/knobs.h). */
static moe_status_t agreed_switch(moe_layer_t *l, moe_knob_t knob, int *on)
{
    *on = l->knobs.v[knob] != 0;
    return MOE_STATUS_SUCCESS;
}

/* MOE_EP_LL=0|1 (default 0; every rank alike): the low-latency layout for steps of at most
 * ll_rows rows per rank (lsa, at most MOE_A2A_LL_MAX_EXPERTS experts; bf16, or W8A8 with
 * per-row scales where the fused decode kernel runs every such step: plan_decode checks it and
 * bounds ll_rows). Off by default until it is measured against the regular lsa step on two
 * GPUs. */
static moe_status_t pick_ll(moe_layer_t *l, cuda_layer_t *s)
{
    int want = 0;
    const char *why = s->transport != MOE_EP_LSA ? "the lsa transport"
                      : s->f8 == 2 ? "bf16 or per-row W8A8 weights (the grouped GEMMs quantise "
                                     "GEMM 1's rows through the permute's map; the fused decode "
                                     "kernel takes no block scales)"
                      : s->n_slots > MOE_A2A_LL_MAX_EXPERTS ? "at most 1024 expert slots"
                      : s->k > 32                           ? "top_k <= 32"
                                                            : NULL;
    MOE_CHECK(agreed_switch(l, MOE_KNOB_EP_LL, &want));
    if (want && why)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "MOE_EP_LL=1 (the low-latency all-to-all layout) needs %s", why);
    s->ll = want;
    s->ll_kernels = (int)l->knobs.v[MOE_KNOB_EP_LL_KERNELS];
    s->ll_rows = s->tm < MOE_A2A_LL_MAX_TOKENS ? s->tm : MOE_A2A_LL_MAX_TOKENS;
    if (s->ll_rows * s->k > MOE_A2A_LL_MAX_PAIRS)
        s->ll_rows = MOE_A2A_LL_MAX_PAIRS / s->k;
    return MOE_STATUS_SUCCESS;
}

/* MOE_EP_MICROBATCH=0|1 (default 0; every rank alike): two lanes of rounds (runtime/cuda/layer.h),
 * each holding half a round, so a step of more than one lane's round overlaps one round's
 * exchange with the other's GEMMs. lsa only, and not with the low-latency layout (its
 * dispatch waits in every CTA, which could keep the other lane's GEMMs from SMs). */
static moe_status_t pick_lanes(moe_layer_t *l, cuda_layer_t *s)
{
    int want = 0;
    MOE_CHECK(agreed_switch(l, MOE_KNOB_EP_MICROBATCH, &want));
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
    MOE_CHECK(agreed_switch(l, MOE_KNOB_EP_P2P_HEADER, &want));
    if (want && s->transport != MOE_EP_P2P)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "MOE_EP_P2P_HEADER=1 (p2p sizes in-band) needs the p2p transport (this "
                         "layer: %s)",
                         moe_cuda_ep_transport_name(s->transport));
    s->p2p_header = want;
    return MOE_STATUS_SUCCESS;
}

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

void moe_cuda_ep_explain(const cuda_layer_t *s, char *text, size_t len)
{
    char why[320], ll[160] = "", rounds[256] = "";
    if (s->world == 1) {
        snprintf(text, len, "one GPU");
        return;
    }
    if (s->transport_why.source == MOE_ORACLE_DEFAULT)
        snprintf(why, sizeof(why), "%s (built-in rule)", moe_cuda_ep_transport_name(s->transport));
    else
        moe_oracle_describe(&s->transport_why, "max tokens/rank", (double)s->cap, why, sizeof(why));
    if (s->ll)
        snprintf(ll, sizeof(ll),
                 "; low-latency layout (MOE_EP_LL=1) at up to %lld rows per rank: rows stored "
                 "grouped by expert into the owners' GEMM input",
                 (long long)s->ll_rows);
    if (s->lanes > 1)
        snprintf(rounds, sizeof(rounds),
                 "; a step in rounds of at most %lld tokens per rank on two micro-batch lanes "
                 "(MOE_EP_MICROBATCH=1: one round's exchange beside the other's GEMMs; buffers "
                 "for one round each)",
                 (long long)s->tm);
    else if (s->tm < s->cap)
        snprintf(rounds, sizeof(rounds),
                 "; a step in rounds of at most %lld tokens per rank (ep_round_tokens; buffers "
                 "for one round)",
                 (long long)s->tm);
    snprintf(text, len, "EP transport %s: %s%s%s", why,
             s->transport == MOE_EP_LSA ? "rows stored only into the ranks owning their experts "
                                          "(CUDA IPC, one host)"
             : s->transport == MOE_EP_P2P && s->p2p_header
                 ? "rows sent only to the ranks owning their experts (NCCL send/recv; sizes "
                   "in-band, MOE_EP_P2P_HEADER=1: each round's whole regions move, no host "
                   "read)"
             : s->transport == MOE_EP_P2P
                 ? "rows sent only to the ranks owning their experts (NCCL send/recv; sizes "
                   "read on the host, one synchronisation a step)"
             : s->deterministic ? "all-gather of the tokens, dense exact return (deterministic)"
                                : "all-gather of the tokens (max_tokens_across_ranks rows per rank "
                                  "when given, else the capacity), f32 reduce-scatter return",
             ll, rounds);
}
