/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA combine: each token's top-k expert rows summed with their routing weights, plus the
 * shared expert. The routing weight is applied here (not in GEMM2), in f32. CUDA-free. */
#ifndef MOE_COMBINE_H
#define MOE_COMBINE_H

#include <stdint.h>
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* y[t] = sum_{j = 0..top_k-1, in this order} w[t, j] * expert_out[row_of_slot[t * top_k + j]]
 *        (+ g_t * shared_out[t]),  g_t = sigmoid(shared_gate_logit[t]) or 1 when that is NULL.
 * f32 accumulation; slots with row -1 are skipped; every element of y is written. */
typedef struct moe_combine_args {
    const void *expert_out;         /* device bf16 (f32: expert_out_f32) [rows, hidden] */
    const int32_t *row_of_slot;     /* device [num_tokens * top_k] */
    const float *topk_weights;      /* device [num_tokens * top_k] */
    const void *shared_out;         /* optional device bf16 [num_tokens, hidden] */
    const float *shared_gate_logit; /* optional device [num_tokens] */
    void *y;                        /* device [num_tokens, hidden], y_dtype */
    moe_dtype_t y_dtype;            /* F32 or BF16 */
    int64_t num_tokens;
    int hidden, top_k;
    int expert_out_f32; /* 1: expert_out holds f32 rows (the EP return's sums) */
} moe_combine_args_t;

moe_status_t moe_combine_launch(const moe_combine_args_t *args, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_COMBINE_H */
