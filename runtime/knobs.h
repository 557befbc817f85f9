/* SPDX-License-Identifier: Apache-2.0 */
/* The environment knobs that change what ranks exchange: read once at layer create and agreed
 * by every rank in the layer's agreement (docs/RELIABILITY.md, "Ranks agree on the knobs"). */
#ifndef MOE_KNOBS_H
#define MOE_KNOBS_H

#include <stdint.h>
#include "moe/moe.h"
#include "comm/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Integer knobs (ranges in env.c); backends read them from the layer, never from getenv. */
typedef enum {
    MOE_KNOB_AG_MAX_TOKENS,     /* CPU AUTO dispatch: all-gather up to this many tokens a rank */
    MOE_KNOB_DETERMINISTIC,     /* MOE_AUTO's determinism */
    MOE_KNOB_EP_LL,             /* CUDA EP: the low-latency layout */
    MOE_KNOB_EP_MICROBATCH,     /* CUDA EP: two lanes of rounds */
    MOE_KNOB_EP_P2P_HEADER,     /* CUDA EP p2p: sizes in-band */
    MOE_KNOB_EP_LL_KERNELS,     /* CUDA EP: low-latency dispatch in 1 or 2 kernels */
    MOE_KNOB_EP_CHUNK_TOKENS,   /* CUDA EP: the dispatch's tokens per CTA (0: default) */
    MOE_KNOB_EP_LL_CTAS,        /* CUDA EP: the low-latency dispatch's CTAs (0: the SMs) */
    MOE_KNOB_EP_FINISH_WAIT,    /* CUDA EP: the finish's wait kernel */
    MOE_KNOB_EP_SHARED_OVERLAP, /* CUDA EP: the shared MLP on a side stream */
    MOE_KNOB_SCATTER_ROWS,      /* CUDA: rows scattered by the permute */
    MOE_KNOB_GEMM_SKIP_PAD,     /* CUDA: GEMMs skip padded rows */
    MOE_KNOB_INT_COUNT
} moe_knob_t;

/* String knobs: the transport and GEMM variant forced, and the tune file (by content). */
enum {
    MOE_KNOB_FORCE_TRANSPORT,
    MOE_KNOB_EP_TRANSPORT,
    MOE_KNOB_FORCE_VARIANT,
    MOE_KNOB_GEMM_VARIANT,
    MOE_KNOB_TUNE_FILE,
    MOE_KNOB_STR_COUNT
};

/* The words every rank contributes to the agreement. */
#define MOE_KNOB_WORDS (MOE_KNOB_INT_COUNT + MOE_KNOB_STR_COUNT)

typedef struct moe_knobs {
    int64_t v[MOE_KNOB_INT_COUNT];
    int64_t word[MOE_KNOB_WORDS]; /* what is agreed: the values, then the strings' hashes */
} moe_knobs_t;

/* Local: reads every knob (defaults where unset). A value that does not parse or is out of
 * range is MOE_STATUS_INVALID_ARGUMENT naming the variable, its value and the range; the
 * caller carries that status into the agreement, so that every rank answers. */
moe_status_t moe_knobs_read(moe_knobs_t *k);

/* Collective, called by every rank when the agreed MAX and MIN of some word differ (every rank
 * sees the same): MOE_STATUS_MISMATCH naming the first differing knob and its values on two
 * ranks, e.g. "MOE_AG_MAX_TOKENS differs among ranks: 0 on rank 0, 32 on rank 1". */
moe_status_t moe_knobs_mismatch(moe_comm_t *comm, const moe_knobs_t *k, const int64_t *max,
                                const int64_t *min);

#ifdef __cplusplus
}
#endif

#endif /* MOE_KNOBS_H */
