/* SPDX-License-Identifier: Apache-2.0 */
/* Small kernels of the GPU expert-parallel step: global -> local expert ids and the scatter of
 * expert rows into the dense per-(token, slot) layout the return reduce-scatter moves.
 * CUDA-free. */
#ifndef MOE_EP_H
#define MOE_EP_H

#include <stdint.h>
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out[i] = in[i] - first if first <= in[i] < first + count, else -1 (remote expert or a
 * padding slot, which holds -1 already). n = tokens * top_k. */
typedef struct moe_ep_local_ids_args {
    const int32_t *in;
    int32_t *out;
    int64_t n;
    int first, count;
} moe_ep_local_ids_args_t;

moe_status_t moe_ep_local_ids_launch(const moe_ep_local_ids_args_t *args, void *stream);

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

#ifdef __cplusplus
}
#endif

#endif /* MOE_EP_H */
