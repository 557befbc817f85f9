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
#define MOE_A2A_CTRL 16     /* int32 control words per (rank, peer) (9 used) */
enum {
    MOE_A2A_COUNT = 0,       /* rows the peer sent here this step */
    MOE_A2A_STATUS = 1,      /* the peer's status code for the step (0: fine) */
    MOE_A2A_SENT = 2,        /* sequence number: the peer's dispatch rows are here */
    MOE_A2A_LL_COUNTS = 3,   /* sequence number: the peer's per-expert counts are here (ll) */
    MOE_A2A_RETURNED = 4,    /* sequence number: the peer's combine rows are here */
    MOE_A2A_RET_STATUS = 5,  /* 0, or the peer lost rows this step (its wait timed out) */
    MOE_A2A_LL_BR = 6,       /* the block rows the peer padded this rank's experts to (ll) */
    MOE_A2A_ROWS = 7,        /* the peer's layout of this round (its rows_tag: its m, its step's
                                rows and the round's index): a region laid out otherwise than
                                this rank's, or a round of another step's shape, fails the step
                                whatever the count */
    MOE_A2A_STEP_TOKENS = 8, /* the peer's tokens in the whole step (all its rounds) */
};

/* Rounds (runtime/ep_rounds.h): a step of more rows per rank than the buffers hold runs in
 * rounds, and round 0's SENT wait leaves in a device word the rows a later round must start
 * below to have work: the largest STEP_TOKENS over the ranks, or 0 when any rank's status for
 * the step is not 0 (its arguments, rows laid out otherwise, such as ranks whose told
 * max_tokens_across_ranks give different round counts, or a timeout). Every rank reads the
 * same words, so every rank skips the same rounds. A skipped round (skip.rows set and
 * *skip.rows <= skip.first, its first row) stores nothing into peers, signals nothing, waits
 * for nothing, and leaves the sequence number alone; its counts read 0, so the kernels after
 * it (permute, scatter, GEMMs) find no rows. So a step told or sized for more rows than any
 * rank brings pays no exchange for the empty rounds, and ranks with different round counts
 * fail that one step and stay in step. */
typedef struct moe_a2a_skip {
    const int32_t *rows; /* device scalar or NULL (never skip: round 0, and p2p) */
    int64_t first;       /* the round's first row per rank */
} moe_a2a_skip_t;

/* This rank's side of a step, the same for both dispatch kernels. */
typedef struct moe_a2a_source {
    const void *x; /* device [T][hidden], x_dtype (F32 or BF16); sent as bf16 */
    moe_dtype_t x_dtype;
    int64_t num_tokens; /* T <= region_rows */
    int hidden, top_k, rank, world;
    int64_t region_rows;   /* m */
    int32_t rows_tag;      /* the ROWS word (nonzero: m, the step's rows and the round, mixed by
                              the host; 0: m) */
    const int32_t *ids;    /* device [T][k] global expert ids */
    const float *weights;  /* device [T][k] */
    const int32_t *owner;  /* device [num_experts]: rank of each expert */
    const int32_t *status; /* device scalar: this rank's status code for the step */
    const uint32_t *seq;   /* device scalar: the step's sequence number */
    int32_t *dead;         /* device scalar or NULL: nonzero, nothing is stored into peers (and the
                              low-latency dispatch's timeout marks it as moe_a2a_wait does) */
    int64_t step_tokens;   /* this rank's tokens in the whole step (STEP_TOKENS) */
    moe_a2a_skip_t skip;   /* a skipped round: counts 0, nothing else */
} moe_a2a_source_t;

/* Dispatch: rows of this rank's T tokens to every rank owning one of their experts. */
typedef struct moe_a2a_dispatch_args {
    moe_a2a_source_t src;
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
    int chunk_tokens; /* tokens per CTA (0: 8; at most 256); up to one chunk, one CTA and one
                         launch, else a count pass and ceil(T / chunk) CTAs, at most the SMs */
} moe_a2a_dispatch_args_t;

#define MOE_A2A_MAX_CTAS 256

moe_status_t moe_a2a_dispatch_launch(const moe_a2a_dispatch_args_t *args, void *stream);

/* Low-latency dispatch (lsa, decode: at most MOE_A2A_LL_MAX_TOKENS rows per rank): the rows
 * land in each destination's GEMM-1 input already grouped by its local experts and padded to
 * the GEMM's block rows, so the destination runs no permute and no gather. One kernel:
 *  1. every CTA ranks this rank's (token, slot) pairs within their expert, in pair order (one
 *     warp, so every CTA gets the same answer), and each token's row in each destination's
 *     region (as moe_a2a_dispatch);
 *  2. CTA 0 stores this rank's count per global expert into row `rank` of every rank's count
 *     matrix cnt [W][E] and the block rows, then (release) the sequence number into
 *     ctrl[rank][LL_COUNTS];
 *  3. every CTA waits (bounded) for all W rows of its own count matrix, and derives the first
 *     row of each expert at its owner: the experts' padded sizes in order (sum over sources),
 *     then the rows of the sources before this one;
 *  4. each (token, slot) row is stored at its row in its owner's GEMM-1 input; per (token,
 *     destination) the row of each slot (-1 where another rank owns it), the weights and the
 *     token index go to region `rank` (the combine's input, as after a permute);
 *  5. the last CTA stores {count, status} and the SENT word as moe_a2a_dispatch does.
 * Sizes: a destination's rows are sum_e roundup(c_e, br) <= W m k + br min(E_d, W m k) (every
 * source sends at most m k pairs); each rank checks that against the same bound from the same
 * counts (rows_cap and the GEMM's blocks), and a dispatch that would not fit stores nothing to
 * that destination and fails the step on every rank (INVALID_ARGUMENT, MOE_A2A_STICKY_ROWS):
 * no store past the buffer, never a silent overflow. Buffer reuse is safe by causality as for
 * moe_a2a_dispatch: the next step's counts and rows reach a rank only after every source
 * waited for that rank's returns of this step, which it sends after its GEMMs and after reading
 * the count matrix. */
#define MOE_A2A_LL_MAX_TOKENS 128
#define MOE_A2A_LL_MAX_PAIRS 2048   /* m k */
#define MOE_A2A_LL_MAX_EXPERTS 1024 /* global experts */

typedef struct moe_a2a_ll_args {
    moe_a2a_source_t src; /* T <= m <= MOE_A2A_LL_MAX_TOKENS */
    int num_experts;
    int first[MOE_A2A_MAX_WORLD + 1]; /* rank d owns global experts [first[d], first[d+1]) */
    int block_rows;                   /* the GEMM variant's padding (every rank the same) */
    int64_t rows_cap;                 /* rows of every rank's GEMM-1 input (ll_a) */
    int32_t *sticky;                  /* this rank's verdict (host-mapped) */
    int64_t timeout_ns;
    const int32_t *cnt;                   /* this rank's count matrix [W][E] */
    const int32_t *ctrl;                  /* this rank's ctrl [W][MOE_A2A_CTRL] */
    int32_t *dst_cnt[MOE_A2A_MAX_WORLD];  /* row `rank` of rank d's count matrix [E] */
    void *dst_a[MOE_A2A_MAX_WORLD];       /* rank d's GEMM-1 input, bf16 [rows_cap][H] */
    int32_t *dst_slot[MOE_A2A_MAX_WORLD]; /* region `rank` of rank d's row of slot [m][k] */
    float *dst_w[MOE_A2A_MAX_WORLD];      /* [m][k] */
    int32_t *dst_tok[MOE_A2A_MAX_WORLD];  /* [m] */
    int32_t *dst_ctrl[MOE_A2A_MAX_WORLD]; /* ctrl[rank] of rank d */
    int32_t *pos, *counts, *done;         /* as in moe_a2a_dispatch_args_t */
    int num_sms;
    /* Two kernels (plan not NULL): one CTA ranks the pairs, exchanges the counts, waits for
     * them and lays out the rows, leaving it all in plan; then the grid copies the rows and
     * signals, with no CTA waiting on a peer. NULL: one kernel whose every CTA waits for the
     * counts (each CTA ranks the pairs itself). plan: persistent int32 scratch of
     * MOE_A2A_LL_PLAN_INTS(E) (E = num_experts). */
    int32_t *plan;
} moe_a2a_ll_args_t;

/* plan: [0] go (rows may be stored), [1] the skip mask (destinations whose rows would not fit),
 * [2, 2 + W) rows to each destination, then off [E] (this rank's first row of each expert at
 * its owner), then prank [MOE_A2A_LL_MAX_PAIRS] (each pair's rank within its expert). */
#define MOE_A2A_LL_PLAN_INTS(E) (2 + MOE_A2A_MAX_WORLD + (E) + MOE_A2A_LL_MAX_PAIRS)

moe_status_t moe_a2a_ll_dispatch_launch(const moe_a2a_ll_args_t *args, void *stream);

/* The destination's side of the low-latency layout (one CTA, after the SENT wait): from its
 * count matrix, for its E local experts (global first .. first + E - 1): counts[e] = rows,
 * offsets[e] = first row (padded to block_rows), offsets[E] = rows used, block_expert[b] for b
 * < max_blocks (-1 past the last), *num_blocks. No rows (num_blocks 0) when a rank's status is
 * set, this step already failed here, or the rows exceed rows_cap or max_blocks (then the
 * verdict as the dispatch sets it). */
typedef struct moe_a2a_ll_layout_args {
    const int32_t *cnt;      /* [W][num_experts] */
    const int32_t *statuses; /* [W] (the SENT wait's) */
    int world, rank, num_experts, first, experts, block_rows, max_blocks;
    int64_t rows_cap;
    int32_t *sticky;
    int32_t *counts, *offsets, *block_expert, *num_blocks;
    moe_a2a_skip_t skip; /* a skipped round: no rows */
} moe_a2a_ll_layout_args_t;

moe_status_t moe_a2a_ll_layout_launch(const moe_a2a_ll_layout_args_t *args, void *stream);

/* The sticky verdict word: (rank << 8) | status of the first failure, and this bit once any
 * wait of the step timed out, whatever came first (a peer's bad arguments, say): a timeout
 * must short-circuit the later waits and mark the runtime broken in every case. */
#define MOE_A2A_STICKY_TIMEOUT (1 << 30)
/* ... and this bit when a peer's step does not fit this rank's: its ROWS differ from this rank's
 * rows per region or its COUNT exceeds them (the ranks passed different
 * max_tokens_across_ranks), a low-latency dispatch would not fit a GEMM input, or the ranks'
 * GEMM variants differ: the step fails on every rank rather than read a region laid out
 * otherwise or store past a buffer. */
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
    int32_t rows_tag;    /* this rank's ROWS word (as moe_a2a_source_t's; 0: m): another
                            peer's sets MOE_A2A_STICKY_ROWS */
    moe_a2a_skip_t skip; /* a skipped round: counts and statuses 0, no wait */
    int32_t *skip_out;   /* round 0's SENT wait (with counts), or NULL: the rows a later round
                            must start below (moe_a2a_skip_t) */
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
    moe_a2a_skip_t skip;   /* a skipped round: nothing */
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
    int num_sms; /* the grid is at most 4 CTAs of 256 threads an SM (grid-stride): its waiting
                    CTAs never fill a GPU that other work (another process's, under MPS) needs */
    moe_a2a_skip_t skip; /* a skipped round: nothing (no wait, y untouched) */
} moe_a2a_finish_args_t;

moe_status_t moe_a2a_finish_launch(const moe_a2a_finish_args_t *args, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_A2A_H */
