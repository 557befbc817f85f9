/* SPDX-License-Identifier: Apache-2.0 */
/* Small kernels of the GPU expert-parallel step: logical expert -> replica slot, global -> local
 * expert ids and the scatter of expert rows into the dense per-(token, slot) layout the return
 * reduce-scatter moves. CUDA-free. */
#ifndef MOE_EP_H
#define MOE_EP_H

#include <stdint.h>
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out[i] = in[i] - first if first <= in[i] < first + count, else -1 (remote expert or a
 * padding slot, which holds -1 already). n = tokens * top_k.
 * The step's verdict: flags[r] (r < world) is rank r's status code for this step (0: fine).
 * If any is nonzero every out[i] is -1, so no rank computes a routed row, and `sticky` (when
 * not NULL and still 0) records the first failing rank as (rank << 8) | code. */
typedef struct moe_ep_local_ids_args {
    const int32_t *in;
    int32_t *out;
    int64_t n;
    int first, count;
    const int32_t *flags; /* device [world], or NULL */
    int world;
    int32_t *sticky; /* device scalar, or NULL */
} moe_ep_local_ids_args_t;

moe_status_t moe_ep_local_ids_launch(const moe_ep_local_ids_args_t *args, void *stream);

/* Routing over replicas (docs/SEMANTICS.md, "Replicas"): pair i = t * top_k + j (i < n = tokens
 * * top_k) of logical expert e = in[i] goes to the physical slot
 * replica_slot[replica_begin[e] + (first_token + t + rank) mod n_e], n_e = replica_begin[e + 1] -
 * replica_begin[e] (e's slots in increasing order); in[i] < 0 stays -1. first_token: the index
 * of token 0 among the caller's tokens (a round's offset). load (device [num_experts], or NULL):
 * load[e] += 1 for every pair, so the window counts logical experts on the device. */
typedef struct moe_ep_slot_ids_args {
    const int32_t *in;
    int32_t *out;
    int64_t n;
    int top_k;
    int64_t first_token;
    int rank;
    const int32_t *replica_begin; /* device [num_experts + 1] */
    const int32_t *replica_slot;  /* device [num_slots] */
    unsigned long long *load;     /* device [num_experts], or NULL */
    int pdl; /* launched with programmatic dependent launch (the one-GPU step's kernels are);
              * 0: as the EP step's kernels (MOE_EP_PDL) */
    int num_experts; /* optional (0: unknown): load's length, so each CTA counts its pairs in
                      * shared memory and adds each expert's count once */
} moe_ep_slot_ids_args_t;

moe_status_t moe_ep_slot_ids_launch(const moe_ep_slot_ids_args_t *args, void *stream);

/* dense[slot_of_row[r]] = rows[r] (bf16 rows of `hidden`) for every row r < *num_blocks *
 * block_rows whose slot is >= 0. `dense` is zeroed by the caller first, so after the
 * reduce-scatter each (token, slot) holds exactly one rank's row (exact sums). */
typedef struct moe_ep_scatter_args {
    const void *rows;           /* device bf16 [max_blocks * block_rows, hidden] */
    const int32_t *slot_of_row; /* device [max_blocks * block_rows] */
    const int32_t *num_blocks;  /* device scalar */
    int block_rows, max_blocks, hidden;
    void *dense; /* device bf16 [slots, hidden] */
} moe_ep_scatter_args_t;

moe_status_t moe_ep_scatter_launch(const moe_ep_scatter_args_t *args, void *stream);

/* *flag = value, stream-ordered (a step's local status code before the exchange); and
 * *seq += 1 when seq is not NULL (the all-to-all's step sequence number). Neither when
 * skip_rows is not NULL and *skip_rows <= first: a round the all-to-all skips (kernels/a2a.h,
 * moe_a2a_skip_t) leaves the sequence number alone. */
moe_status_t moe_step_flag_set_launch(int32_t *flag, int32_t value, uint32_t *seq,
                                      const int32_t *skip_rows, int64_t first, void *stream);

/* check_inputs on the device: if any of the n values of x (F32 or BF16) is NaN or +-Inf,
 * *flag = code (else *flag is left alone). No host synchronisation. */
moe_status_t moe_scan_finite_launch(const void *x, moe_dtype_t dtype, int64_t n, int32_t *flag,
                                    int32_t code, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_EP_H */
