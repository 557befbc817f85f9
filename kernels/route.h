/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA routing: router logits (x . Wg^T) and the fused scoring + top-k launch. CUDA-free. */
#ifndef MOE_ROUTE_H
#define MOE_ROUTE_H

#include <stdint.h>
#include "kernels/cpu/moe_cpu.h"
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest num_experts and top_k the scoring kernel is compiled for. */
#define MOE_ROUTE_MAX_EXPERTS 512
#define MOE_ROUTE_MAX_TOP_K 16
/* Largest n_group for grouped top-k (one lane per group). */
#define MOE_ROUTE_MAX_GROUPS 32

/* logits[t, r] = sum_h x[t, h] * w[r, h], f32 accumulation in a fixed order (deterministic).
 * Used for the router (rows = num_experts) and the shared-expert gate (rows = 1). */
typedef struct moe_route_logits_args {
    const void *x;       /* device [num_tokens, hidden], x_dtype */
    moe_dtype_t x_dtype; /* MOE_DTYPE_F32 or MOE_DTYPE_BF16 */
    const float *w;      /* device [num_rows, hidden] f32 */
    float *logits;       /* device [num_tokens, num_rows] */
    int64_t num_tokens;
    int num_rows, hidden;
    /* Optional: w split as moe_split_bf16x3 does, device [3][num_rows][hidden] bf16 (hi, mid,
     * lo planes), 16-byte aligned. With hidden % 8 == 0 and 16-byte aligned x the logits then
     * run on tensor cores (mma.sync bf16, f32 accumulation; bf16 x times each plane is exact,
     * f32 x is split in three planes too: the accuracy of the f32 kernel) in an order that is
     * the same at every token count: a token's logits are bitwise the same in any batch. NULL:
     * the f32 SIMT kernels. */
    const uint16_t *w_split;
    /* 1: the mid and lo planes of w_split are all zero (w is exact in bf16, as checkpoints ship
     * routers): only the hi plane is read and multiplied. The products skipped are exact zeros,
     * so every logit has the value the three planes give (the same bits, up to the sign of a
     * zero). 0 or 3: all three planes. */
    int w_split_planes;
} moe_route_logits_args_t;

moe_status_t moe_route_logits_launch(const moe_route_logits_args_t *args, void *stream);

/* One launch: scores (softmax, or sigmoid with optional bias and grouped top-k), top-k,
 * renormalisation and scaling, exactly as moe_cpu_route (ties: lower expert id first; ids in
 * falling order of the choice score). */
typedef struct moe_route_args {
    moe_route_params_t params; /* num_experts <= 512, top_k <= 16, n_group <= 32 */
    const float *logits;       /* device [num_tokens, num_experts] */
    const float *bias;         /* device [num_experts] or NULL (sigmoid + use_bias only) */
    int32_t *topk_ids;         /* device [num_tokens, top_k] */
    float *topk_weights;       /* device [num_tokens, top_k] */
    int64_t num_tokens;
} moe_route_args_t;

moe_status_t moe_route_launch(const moe_route_args_t *args, void *stream);
/* moe_route_launch's argument checks alone (MOE_STATUS_SUCCESS: it would launch). */
moe_status_t moe_route_check(const moe_route_args_t *args);

/* The caller's routing (moe_forward_args_t.given_topk_ids/weights) checked and copied into the
 * step's: an id outside 0..num_experts-1 becomes expert 0 with weight 0 and sets *flag =
 * bad_id_code, a weight that is not finite becomes 0 and sets *flag = bad_weight_code (plain
 * stores, as the finite scan does: the step's verdict word), so the kernels after it never
 * index out of bounds. */
typedef struct moe_route_given_args {
    const int32_t *given_ids;   /* device [num_tokens, top_k] */
    const float *given_weights; /* device [num_tokens, top_k] */
    int32_t *topk_ids;          /* device [num_tokens, top_k] (may be given_ids) */
    float *topk_weights;        /* device [num_tokens, top_k] (may be given_weights) */
    int64_t num_tokens;
    int top_k, num_experts;
    int32_t *flag; /* device or mapped host int32 */
    int32_t bad_id_code, bad_weight_code;
} moe_route_given_args_t;

moe_status_t moe_route_given_launch(const moe_route_given_args_t *args, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_ROUTE_H */
