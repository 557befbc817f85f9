/* SPDX-License-Identifier: Apache-2.0 */
/* FP8 (e4m3) activation quantisation of the W8A8 path: one scale per row,
 * s = max(amax(|row|), MOE_FP8_ACT_AMAX_MIN) / 448, q = e4m3(v / s) rounded to nearest even and
 * saturated to +-448 (NaN stays NaN) -- the CPU reference's arithmetic (docs/SEMANTICS.md).
 * Static scales (a checkpoint's input_scale, per expert): a row whose expert has a scale s > 0
 * takes it as is (q = e4m3(v / s), the row's scale = s), as moe_cpu_fp8_quantize_rows does with
 * static_scale = s; an expert with 0 is dynamic. CUDA-free. */
#ifndef MOE_QUANT_H
#define MOE_QUANT_H

#include <stdint.h>
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_quant_rows_args {
    const void *x; /* device [rows][cols], BF16 or F32 */
    moe_dtype_t x_dtype;
    int64_t rows;              /* rows the grid covers */
    const int32_t *num_blocks; /* optional device scalar: only rows < *num_blocks * block_rows */
    int block_rows;
    int cols; /* multiple of 8 */
    /* Optional static scales: device [num_experts], static_scale[e] > 0 the scale of every row of
     * expert e, else (0) that expert's rows are dynamic. Row r's expert is
     * block_expert[r / block_rows] (device [ceil(rows / block_rows)], the GEMM's block table); a
     * padding block (< 0) is dynamic. NULL: every row dynamic. Not with group. */
    const float *static_scale;
    const int32_t *block_expert;
    uint8_t *q;   /* device [rows][cols] e4m3 */
    float *scale; /* device [rows], or [rows][ceil(cols / 128)] with group */
    int group;    /* 0: one scale per row; 128: one per 1 x 128 group (block weights,
                     DeepSeek-V3); static_scale must be NULL then */
    /* Optional gather (the permute's copy fused in): row r quantises x row
     * src_slot[r] / src_k (a token of x [tokens][cols]; src_slot: the permute's slot_of_row,
     * device [rows]), or a row of zeros where src_slot[r] < 0 (padding); F32 x is rounded to
     * bf16 first, as the gather's bf16 copy would be. NULL: row r is x row r. */
    const int32_t *src_slot;
    int src_k;
    /* Optional: each row's |max| already known (device [rows], or [rows][ceil(cols / 128)] with
     * group): the kernel converts only, one pass over the row split across CTAs, with the scale
     * max(amax, MOE_FP8_ACT_AMAX_MIN) / 448 -- the same codes and scales as the pass that finds
     * the maximum itself when amax holds the maximum of |x| as stored (GEMM 1's epilogue takes
     * it over the bf16 h it writes: moe_gemm_args_t.row_amax). Not with src_slot. */
    const float *amax;
    /* Optional: the kernel zeroes zero_amax[r][0 .. zero_cols) for every row r it covers (rows
     * past *num_blocks * block_rows left alone), so that the next GEMM's epilogue can take its
     * rows' maxima into it (atomicMax). zero_cols >= 1 with it. */
    float *zero_amax;
    int zero_cols;
    /* Optional (sm_90+): 1 lets the next kernel on the stream launch as soon as every CTA of
     * this one has started (griddepcontrol.launch_dependents first), instead of at its end: a
     * GEMM launched with programmatic dependent launch may then take free SMs and load its
     * weights under this kernel (moe_gemm_args_t.early_weights); it still waits for this
     * kernel's completion before it reads what it wrote. */
    int trigger_next;
} moe_quant_rows_args_t;

moe_status_t moe_quant_rows_launch(const moe_quant_rows_args_t *args, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_QUANT_H */
