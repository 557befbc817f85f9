/* SPDX-License-Identifier: Apache-2.0 */
/* GPU all-to-all expert parallelism: the kernels that send each token row only to the ranks
 * owning one of its experts (once per rank), return one weighted f32 partial per (token, rank)
 * (or, deterministic, each (token, slot) row), and sum the partials at the source in rank
 * order. Counts and offsets are computed on the device; nothing waits on the host.
 *
 * Layout. Every rank holds the same receive arrays, region s for the rows of source rank s,
 * `region_rows` (m: the step's rows per rank, agreed by every rank) rows each:
 *   x [W][m][H] bf16, ids [W][m][k] (global expert ids), w [W][m][k] f32, tok [W][m] (the
 *   row's token index at its source), and a control word block ctrl [W][MOE_A2A_CTRL].
 * A source sends at most its T <= m tokens to a destination, each at most once, so a region
 * can never overflow: the buffers hold the worst case by construction.
 *
 * Signals (the "lsa" transport: peers' arrays mapped by CUDA IPC, NVLink loads/stores): after
 * its rows, a source writes {count, status} and then the step's sequence number into the
 * destination's ctrl[source]; the destination's wait spins on it, bounded by a deadline (a dead
 * peer makes the step fail with MOE_STATUS_TIMEOUT in the sticky verdict, never a hang). The
 * "p2p" transport runs the same kernels on local staging arrays with no signal and moves them
 * with NCCL send/recv. CUDA-free. */
#ifndef MOE_A2A_H
#define MOE_A2A_H

#include <stdint.h>
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_A2A_MAX_WORLD 8 /* ranks sharing one all-to-all (one host's GPUs) */
#define MOE_A2A_CTRL 8      /* int32 control words per (rank, peer) */
enum {
    MOE_A2A_COUNT = 0,      /* rows the peer sent here this step */
    MOE_A2A_STATUS = 1,     /* the peer's status code for the step (0: fine) */
    MOE_A2A_SENT = 2,       /* sequence number: the peer's dispatch rows are here */
    MOE_A2A_RETURNED = 4,   /* sequence number: the peer's combine rows are here */
    MOE_A2A_RET_STATUS = 5, /* 0, or the peer lost rows this step (its wait timed out) */
};

/* Dispatch: rows of this rank's T tokens to every rank owning one of their experts. */
typedef struct moe_a2a_dispatch_args {
    const void *x; /* device [T][hidden], x_dtype (F32 or BF16); sent as bf16 */
    moe_dtype_t x_dtype;
    int64_t num_tokens; /* T <= region_rows */
    int hidden, top_k, rank, world;
    int64_t region_rows;   /* m */
    const int32_t *ids;    /* device [T][k] global expert ids */
    const float *weights;  /* device [T][k] */
    const int32_t *owner;  /* device [num_experts]: rank of each expert */
    const int32_t *status; /* device scalar: this rank's status code for the step */
    const uint32_t *seq;   /* device scalar: the step's sequence number */
    const int32_t *dead;   /* device scalar or NULL: nonzero, nothing is stored into peers */
    void *dst_x[MOE_A2A_MAX_WORLD];       /* region `rank` of rank d's arrays (bf16 [m][H]) */
    int32_t *dst_ids[MOE_A2A_MAX_WORLD];  /* [m][k] */
    float *dst_w[MOE_A2A_MAX_WORLD];      /* [m][k] */
    int32_t *dst_tok[MOE_A2A_MAX_WORLD];  /* [m] */
    int32_t *dst_ctrl[MOE_A2A_MAX_WORLD]; /* ctrl[rank] of rank d (signalled), or NULL: the
                                             {count, status} go to ctrl_out[d] unsignalled */
    int32_t *ctrl_out;                    /* [W][MOE_A2A_CTRL] (p2p), or NULL */
    int32_t *pos;    /* out [W][m]: row of token t in region d, -1 when not sent there */
    int32_t *counts; /* out [W]: rows sent to each rank */
    uint64_t *chain; /* scratch [MOE_A2A_MAX_CTAS][W], persistent (zeroed once) */
    int32_t *done;   /* scratch scalar, persistent, 0 between launches */
    int num_sms;
} moe_a2a_dispatch_args_t;

#define MOE_A2A_MAX_CTAS 256

moe_status_t moe_a2a_dispatch_launch(const moe_a2a_dispatch_args_t *args, void *stream);

/* The sticky verdict word: (rank << 8) | status of the first failure, and this bit once any
 * wait of the step timed out, whatever came first (a peer's bad arguments, say): a timeout
 * must short-circuit the later waits and mark the runtime broken in every case. */
#define MOE_A2A_STICKY_TIMEOUT (1 << 30)
/* ... and this bit when a peer's COUNT exceeded this rank's rows per region (the ranks disagree
 * on max_tokens_across_ranks): the step fails on every rank rather than read past a region. */
#define MOE_A2A_STICKY_ROWS (1 << 29)

/* Wait (one CTA): for each peer s, until ctrl[s][word] reaches *seq (wrap-safe) or the
 * deadline; then counts[s] = ctrl[s][COUNT], statuses[s] = ctrl[s][STATUS] (word = SENT);
 * with word = RETURNED a nonzero RET_STATUS (the peer lost this rank's rows) sets *sticky to
 * (s << 8) | MOE_STATUS_PEER_FAILURE.
 * word < 0: no wait (p2p: the words came by NCCL). On a timeout the peer's count is 0, its
 * status MOE_STATUS_TIMEOUT, *sticky (when 0) = (s << 8) | MOE_STATUS_TIMEOUT, and
 * MOE_A2A_STICKY_TIMEOUT is set in it. */
typedef struct moe_a2a_wait_args {
    const int32_t *ctrl; /* [W][MOE_A2A_CTRL] */
    int world, word;
    const uint32_t *seq;
    int64_t timeout_ns;
    int32_t *counts, *statuses; /* out [W] each, or NULL */
    int32_t *sticky;            /* host-mapped, or NULL */
    int32_t *dead;       /* device scalar or NULL: set on a timeout; nonzero, no wait waits */
    int64_t region_rows; /* m (with counts): a larger COUNT sets MOE_A2A_STICKY_ROWS */
} moe_a2a_wait_args_t;

moe_status_t moe_a2a_wait_launch(const moe_a2a_wait_args_t *args, void *stream);

/* Combine, at the expert side: for region s (counts[s] rows) row i,
 *   summed:        dst_ret[s][i][:] = sum_j (in j order, local slots) w[s][i][j] * rows[slot]
 *                  (f32, [m][H] region `rank` of s's return array);
 *   deterministic: dst_ret[s][(tok[s][i] * k + j)][:] = rows[slot] (bf16 [T][k][H] of s),
 * then ctrl[rank][RETURNED] of s = *seq (when dst_ctrl[s] is given). */
typedef struct moe_a2a_combine_args {
    const void *rows;           /* bf16 [rows][H]: GEMM 2's output */
    const int32_t *row_of_slot; /* [W m k]: row of (region row, j), -1 when not local */
    const float *w;             /* [W m k] routing weights (the receive array) */
    const int32_t *tok;         /* [W m] (the receive array) */
    const int32_t *counts;      /* [W] rows received from each rank this step */
    int hidden, top_k, rank, world, deterministic;
    int64_t region_rows;
    const uint32_t *seq;
    void *dst_ret[MOE_A2A_MAX_WORLD];
    int32_t *dst_ctrl[MOE_A2A_MAX_WORLD];
    int32_t *done; /* persistent scalar, 0 between launches */
    int num_sms;
    const int32_t *sticky; /* this rank's verdict: a timeout or an out-of-step COUNT there
                              goes out as RET_STATUS, so every source fails the step too */
    const int32_t *dead;   /* device scalar or NULL: nonzero, nothing is stored into peers */
} moe_a2a_combine_args_t;

moe_status_t moe_a2a_combine_launch(const moe_a2a_combine_args_t *args, void *stream);

/* Source side, summed mode: after waiting for ctrl[d][RETURNED] >= *seq of every rank d (when
 * ctrl is given; bounded like moe_a2a_wait), y[t] = sum_{d = 0..W-1, pos[d][t] >= 0}
 * ret[d][pos[d][t]] (f32, in rank order) + g_t * shared[t]. */
typedef struct moe_a2a_finish_args {
    const float *ret;    /* [W][m][H] */
    const int32_t *pos;  /* [W][m] */
    const int32_t *ctrl; /* [W][MOE_A2A_CTRL] or NULL (no wait) */
    const uint32_t *seq;
    int64_t timeout_ns;
    int32_t *sticky;
    int32_t *dead; /* as in moe_a2a_wait_args_t */
    int64_t num_tokens, region_rows;
    int hidden, world;
    const void *shared_out;         /* bf16 [T][H] or NULL */
    const float *shared_gate_logit; /* [T] or NULL */
    void *y;
    moe_dtype_t y_dtype;
} moe_a2a_finish_args_t;

moe_status_t moe_a2a_finish_launch(const moe_a2a_finish_args_t *args, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_A2A_H */
