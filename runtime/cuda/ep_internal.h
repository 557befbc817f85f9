/* SPDX-License-Identifier: Apache-2.0 */
/* What the files of the CUDA backend's expert-parallel half share among themselves: the lsa
 * transport's IPC buffer and the entry points of each transport's step. Private to
 * runtime/cuda/ep_*.c. */
#ifndef MOE_CUDA_EP_INTERNAL_H
#define MOE_CUDA_EP_INTERNAL_H

#include "kernels/a2a.h"
#include "runtime/cuda/ep.h"

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

/* This lane's sequence number and its control words in rank r's buffer `b`. */
static inline uint32_t *lane_seq(const cuda_sym_t *y, const cuda_layer_t *s)
{
    return y ? y->seq + (s->lane ? 2 : 0) : NULL;
}

static inline int32_t *ctrl_at(char *b, const cuda_layer_t *s, int r)
{
    return (int32_t *)(b + s->off_ctrl) + (size_t)r * MOE_A2A_CTRL;
}

/* This round's skip (kernels/a2a.h): rounds after the first, on lsa, whose words come from
 * round 0's wait. p2p moves its words by NCCL on the host, which cannot skip. */
static inline moe_a2a_skip_t round_skip(const cuda_layer_t *s)
{
    moe_a2a_skip_t k = {NULL, 0};
    if (s->transport == MOE_EP_LSA && s->round > 0) {
        k.rows = s->round_skip;
        k.first = s->round * s->tm;
    }
    return k;
}

/* ep_workspace.c: this lane's arrays in the IPC buffer from `base` (lane 0: SYM_CTRL_BYTES;
 * lane 1: lane 0's end); returns their end. */
size_t moe_cuda_ep_sym_layout(cuda_layer_t *s, size_t base);
/* ep_shared.c: the shared MLP beside the exchange (on the side stream with
 * MOE_EP_SHARED_OVERLAP=1), and the join before its output is read. */
moe_status_t moe_cuda_ep_shared_fork(moe_layer_t *l, const moe_forward_args_t *ok, int64_t T,
                                     void *stream);
moe_status_t moe_cuda_ep_shared_join(cuda_layer_t *s, void *stream);
/* ep_allgather.c: a round's exchange and experts on the allgather transport. */
moe_status_t moe_cuda_ep_allgather_step(moe_layer_t *l, const moe_forward_args_t *ok, int64_t T,
                                        void *stream);
/* ep_a2a.c: a round's exchange and experts on the lsa or p2p transport. */
moe_status_t moe_cuda_ep_a2a_step(moe_layer_t *l, const moe_forward_args_t *ok, int64_t T,
                                  void *stream);

#endif /* MOE_CUDA_EP_INTERNAL_H */
