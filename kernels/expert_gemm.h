/* SPDX-License-Identifier: Apache-2.0 */
/* Grouped expert GEMM for the expert MLP: C-callable, CUDA-free. Every variant is compiled
 * ahead of time; the variant table is keyed by (arch, dtype, scale kind, rows-per-expert
 * bucket). Token counts are run-time values read on the device: no variant is specialised on
 * them. */
#ifndef MOE_EXPERT_GEMM_H
#define MOE_EXPERT_GEMM_H

#include <stdint.h>
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum moe_gemm_epilogue {
    MOE_GEMM_EPI_STORE = 0,    /* c = a . b_e^T                                   (n_out = n) */
    MOE_GEMM_EPI_SILU_MUL = 1, /* c = silu(a . gate_e^T) * (a . up_e^T)            (n_out = n/2) */
    MOE_GEMM_EPI_GELU_MUL = 2  /* c = gelu_tanh(a . gate_e^T) * (a . up_e^T)       (n_out = n/2) */
} moe_gemm_epilogue_t;

/* A holds rows grouped by expert; each expert's group is padded to a multiple of the
 * variant's block_rows, so every block of block_rows rows belongs to one expert
 * (block_expert[b]; < 0: padding block, skipped). Pad rows are computed but never read. */
typedef struct moe_gemm_args {
    const void *a;          /* [max_blocks * block_rows, k], ab_dtype */
    const void *b;          /* num_experts x [n, k] row-major (k contiguous), ab_dtype;
                             *_MUL epilogues: rows [0, n/2) gate, [n/2, n) up */
    void *c;                /* [max_blocks * block_rows, n_out], bf16 (or f32: c_f32) */
    const float *row_scale; /* optional [max_blocks * block_rows]: row r of c *= row_scale[r] */
    const int32_t *block_expert; /* device [max_blocks] */
    const int32_t *num_blocks;   /* device scalar: blocks used this step (<= max_blocks) */
    int max_blocks;              /* grid is sized from this; blocks past *num_blocks exit */
    int num_experts, n, k;
    moe_gemm_epilogue_t epilogue;
    int c_f32;
    moe_dtype_t ab_dtype;        /* MOE_DTYPE_BF16 now; FP8_E4M3 later */
    moe_scale_kind_t scale_kind; /* MOE_SCALE_NONE now */
    const float *a_scale, *b_scale;
    /* optional (both or neither), the permute's: rows of each expert [num_experts] and its first
     * (padded) row [num_experts + 1]. With them a variant may skip the all-padding part of an
     * expert's last block (sm_90a m128: the second 64 rows). */
    const int32_t *expert_counts, *expert_offsets;
    /* optional: at most this many CTAs for a variant whose grid is persistent (0: its own, about
     * one per SM). The EP micro-batches cap it so that the other micro-batch's waiting kernels
     * (one CTA each, spinning on a peer) can never keep a GEMM CTA from an SM. */
    int max_ctas;
    /* optional, *_MUL epilogues of the sm_90a variants (others refuse it): each row's maximum of
     * |c| as stored (bf16-rounded) is taken into row_amax[row] by atomicMax on its bits (FP8
     * block-scale variants: into row_amax[row][col / 128], ceil(n_out / 128) a row), which the
     * caller zeroed, so the quantisation of c for the next GEMM converts in one pass
     * (moe_quant_rows_args_t.amax). */
    float *row_amax;
    /* optional, per-row fp8 scales (scale_kind PER_CHANNEL): 1 says b_scale holds one value for
     * each expert's rows (STORE) or for each of its halves (*_MUL: gate rows, up rows), as
     * per-tensor weights expanded per row do; a variant may then read one scale instead of one
     * a column (the sm_90a normal tiles, unless MOE_GEMM_B_UNIFORM=0). 0: no promise. */
    int b_scale_uniform;
    /* optional: 1 says block_expert, num_blocks and the expert counts and offsets were final
     * before the kernel ahead of this GEMM on the stream started (written two launches back or
     * earlier, each kernel between waiting on its own predecessor before it lets the next one
     * start). The sm_90a swap-AB variants (not their block-scale forms) launched with
     * programmatic dependent launch may then read them and load their first weight stages
     * before they wait on that kernel, so the weights stream under its tail. Asked for only
     * where MOE_GEMM_EARLY_W=1 (runtime/cuda/step.c: GEMM 2, and W8A8's GEMM 1; off by
     * default, docs/KERNELS.md "Integration notes"). 0: no promise. */
    int early_weights;
} moe_gemm_args_t;

typedef struct moe_gemm_variant {
    const char *name; /* "sm90_wgmma_tma_m128n128", "sm90_swapab_n16", "sm80_mma_m64n128" */
    int min_arch;     /* 80 or 90 (sm_90a) */
    int block_rows;   /* padding of each expert's rows this variant needs */
    int swap_ab;      /* computes C^T = B . A^T: weight rows fill wgmma M, tokens sit in N */
    moe_dtype_t ab_dtype;
    moe_scale_kind_t scale_kind;
    /* Checks args (returns MOE_STATUS_INVALID_ARGUMENT / NOT_SUPPORTED with a message) and
     * launches on `stream` (cudaStream_t); checks the launch. Never synchronises. */
    moe_status_t (*launch)(const moe_gemm_args_t *args, void *stream);
    /* 1: FP8 products summed over all of k by the tensor cores alone (no promotion to f32 every
     * 128 of k; fewer bits kept: docs/KERNELS.md, "Fast accumulation"). Only the oracle's
     * fast-accumulation tables name such a variant (fp8_math W8A8_FAST layers: their built-in
     * table, and moe-tune --accum fast); MOE_FORCE_VARIANT runs it on any W8A8 layer. */
    int fast_accum;
} moe_gemm_variant_t;

/* The shapes every bf16 variant runs at every row count: rows of whole 16-byte units
 * (k % 8, TMA's stride unit), n % 8 and, for the gate|up epilogues, n/2 % 8. Tails past a tile
 * are handled inside the kernels (zero fill along k, masked stores along n). */
#define MOE_GEMM_ALIGN 8

/* MOE_STATUS_SUCCESS if (n, k, epilogue) is in every variant's coverage, else
 * MOE_STATUS_NOT_SUPPORTED with a message naming `what` and the dimension. */
moe_status_t moe_gemm_check_shape(const char *what, int n, int k, moe_gemm_epilogue_t epilogue);

#ifdef __cplusplus
}
#endif

#endif /* MOE_EXPERT_GEMM_H */
