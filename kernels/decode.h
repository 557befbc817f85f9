/* SPDX-License-Identifier: Apache-2.0 */
/* The small-batch decode step of the routed experts as one persistent kernel: GEMM 1 with the
 * activation, GEMM 2 and the weighted sum per token in one launch, the work split over every SM
 * by (expert, weight tile) so every SM streams a share of the touched experts' weights
 * (docs/KERNELS.md, "Fused decode"). CUDA-free. */
#ifndef MOE_DECODE_H
#define MOE_DECODE_H

#include <stddef.h>
#include <stdint.h>
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_DECODE_MAX_TOKENS 64   /* tokens per launch (an expert's tokens: 8 mma columns x 8) */
#define MOE_DECODE_MAX_ROWS 1024   /* (token, slot) rows per launch: 64 tokens x top_k 16 */
#define MOE_DECODE_MAX_EXPERTS 512 /* local experts (the per-CTA expert table) */
#define MOE_DECODE_MAX_SPLIT 8     /* GEMM 1's and GEMM 2's k splits */

/* The bit of the sticky verdict word (kernels/a2a.h's word: (rank << 8) | status) that a launch
 * sets, with MOE_STATUS_TIMEOUT when the word was 0, when one of its waits passed timeout_ns.
 * Its work items wait on earlier items, which is safe only with every CTA resident at once; a
 * kernel beside it that also waits on its own grid (a second layer's decode step on another
 * stream, an MPS client holding SMs) can keep CTAs out. Then the wait gives up, every later wait
 * of the launch returns at once, the launch ends (its counters left at zero, as always) and the
 * step's output is not valid. */
#define MOE_DECODE_STICKY_STALL (1 << 28)

/* args.trace (benchmarks: bench/decode_trace.c): a record of MOE_DECODE_TRACE_STRIDE int64 per
 * warp of the launch (warp w of CTA b: record w * CTAs + b, the order the items go round),
 * global-timer ns written by its lane 0: the kernel's entry, the expert table built, the item
 * loop left, the number of events, then up to MOE_DECODE_TRACE_EVENTS events of 4: (kind << 32 |
 * item), start, the wait over (0 where none), end. Zero the buffer before the launch: records
 * left at zero are CTAs that did not run. Only bf16 x and y and up to 8 tokens are traced. */
#define MOE_DECODE_TRACE_ENTRY 0
#define MOE_DECODE_TRACE_TABLE 1
#define MOE_DECODE_TRACE_EXIT 2
#define MOE_DECODE_TRACE_COUNT 3
#define MOE_DECODE_TRACE_HEAD 4
#define MOE_DECODE_TRACE_EVENTS 8
#define MOE_DECODE_TRACE_STRIDE (MOE_DECODE_TRACE_HEAD + 4 * MOE_DECODE_TRACE_EVENTS)
enum {
    MOE_DECODE_TRACE_XQ = 0,
    MOE_DECODE_TRACE_GEMM1,
    MOE_DECODE_TRACE_GEMM2,
    MOE_DECODE_TRACE_COMBINE
};

/* y[t] = sum_{j in order} w[t, j] * W2_e (act(W1_e x_t) * (W3_e x_t)) (+ g_t * shared[t]),
 * e = topk_ids[t, j], for T <= MOE_DECODE_MAX_TOKENS tokens on one GPU.
 *
 * bf16 (f8 = 0): x rounded to bf16 as the gather copies it, bf16 weights, f32 accumulation, h
 * rounded to bf16 (as GEMM 1 writes it on the grouped path), GEMM 2 rows in f32. f8 = 1 (W8A8
 * with one scale per weight row: per-tensor or per-channel): x and h quantised per row with
 * the dynamic scale max(amax, 1e-10) / 448 from their bf16 values (kernels/quant.h), e4m3
 * products, the two scales applied once per output. f8 = 2 (W8A8 with 128 x 128 weight blocks,
 * one token a launch, the routed form: no laid-out rows, shared MLP inside, static scales, GEMM 1
 * split or trace): x and h quantised per token and 128-wide group, each 128 of k's e4m3
 * partial sum added times its two scales in k order, as the CPU's W8A8. The routing weight and the
 * shared rows are added in f32 in slot order, as moe_combine_launch does; every element of y is
 * written. A token's output does not depend on the other tokens of the launch (no value crosses mma
 * columns; GEMM 2's k split depends on the layer's shape only). */
typedef struct moe_decode_args {
    const void *x;             /* device [T][hidden], x_dtype F32 or BF16, 16-byte aligned */
    moe_dtype_t x_dtype;       /* F32 or BF16 */
    const int32_t *topk_ids;   /* device [T][top_k]: local expert ids; < 0: not here */
    const float *topk_weights; /* device [T][top_k] */
    const void *w13;           /* device [E][2 inter][hidden]: gate rows, then up rows */
    const void *w2;            /* device [E][hidden][inter] */
    const float *w13_scale;    /* f8 1: device [E][2 inter], one scale per weight row;
                                * f8 2: [E][2 inter][ceil(hidden / 128)], each row's
                                * block's scale per 128 of k */
    const float *w2_scale;     /* f8 1: device [E][hidden]; 2: [E][hidden][ceil(inter / 128)] */
    const void *shared_out;    /* optional device bf16 [T][hidden], added (gated) to y */
    const float *shared_gate_logit; /* optional device [T]: shared rows times its sigmoid */
    void *y;                        /* device [T][hidden], y_dtype (F32 or BF16) */
    moe_dtype_t y_dtype;
    int32_t *counts; /* optional device [E]: tokens per expert (profiling), written */
    /* workspace (moe_decode_workspace_bytes) */
    void *h;       /* bf16 [T top_k][inter]: GEMM 1's rows by slot */
    float *o;      /* f32 [split][T top_k][hidden]: GEMM 2's rows by slot, per k split */
    float *o1;     /* split1 > 1: f32 [split1][T top_k][2 inter]: GEMM 1's gate and up sums by
                    * slot, per k split (NULL with split1 = 1) */
    uint8_t *xq;   /* f8: e4m3 [T][hidden] */
    float *xs;     /* f8: [T] (f8 2 keeps its one token's group scales in shared memory) */
    int32_t *sync; /* device, moe_decode_sync_count ints, zero between launches (the last CTA
                    * of each launch leaves them so; zero them once at create) */
    int64_t num_tokens;
    int top_k, num_experts, hidden, inter;
    int f8;              /* 0: bf16 weights; 1: e4m3 weights with per-row scales; 2: with
                          * 128 x 128 block scales (above) */
    int gelu;            /* 1: gelu (tanh) * up, else silu * up */
    int split;           /* GEMM 2's k split, moe_decode_split (1 .. MOE_DECODE_MAX_SPLIT) */
    int split1;          /* GEMM 1's k split (1 .. MOE_DECODE_MAX_SPLIT; moe_decode_split1 gives one
                          * from the shape); 0 is taken as 1 */
    int max_ctas;        /* at most this many CTAs (0: as many as fit on the GPU) */
    int32_t *sticky;     /* optional: the step's sticky verdict word (MOE_DECODE_STICKY_STALL) */
    int sticky_rank;     /* laid-out rows: the rank a mark there names ((rank << 8) | status) */
    int32_t sticky_bits; /* laid-out rows: bits added to each mark (an EP step's: the bit that
                          * makes its combine fail the step on every source) */
    int64_t timeout_ns;  /* a wait's bound (0: none) */
    int64_t *trace;      /* optional (benchmarks): the timeline, MOE_DECODE_TRACE_STRIDE int64 a
                          * warp of the grid (see above); NULL in a layer's step */
    /* Laid-out rows (an EP step's low-latency layout, kernels/a2a.h): lo_counts NULL for the
     * routed form above. Given, x (bf16) holds rows grouped by local expert: expert e's
     * lo_counts[e] rows from row lo_offsets[e] on (device arrays an earlier kernel wrote:
     * moe_a2a_ll_layout_launch). Each of those rows goes through its expert alone, unweighted,
     * into the same row of rows_out (bf16 [rows][hidden], as the grouped GEMM 2 writes it; other
     * rows untouched): rows_out[r] = W2_e (act(W1_e x_r) * (W3_e x_r)), the numbers of the
     * routed form's per-slot rows. topk_ids, topk_weights, shared_*, y, counts and trace unused;
     * GEMM 1 whole (split1 ignored); top_k must be 1, num_tokens the workspace's rows (h, o, xq
     * and the sync array's maxima hold that many; the rows of every expert together must not
     * pass it), at most MOE_DECODE_MAX_ROWS, and lo_cols the rows one expert is expected to have
     * (1 .. MOE_DECODE_MAX_TOKENS): an item takes an expert's rows in passes of 8 (lo_cols <= 8)
     * or 16, so an expert with more costs more passes over its weights, never a wrong row. Rows
     * past num_tokens, or a negative count, run no item: the launch marks the sticky word
     * MOE_STATUS_INTERNAL_ERROR and leaves rows_out as it was. */
    const int32_t *lo_counts, *lo_offsets;
    void *rows_out;
    int lo_cols;
    /* The shared MLP inside the launch (shared_w13 NULL: none, or shared_out's rows). Weights as
     * the routed experts' (shared_w13 [2 shared_inter][hidden]: gate rows, then up rows;
     * shared_w2 [hidden][shared_inter]; f8: one scale per row, shared_w13_scale [2
     * shared_inter], shared_w2_scale [hidden]); shared_inter a multiple of inter: the MLP runs
     * as C = shared_inter / inter more experts of the routed width (chunk c: gate and up rows
     * c inter .., down's columns c inter ..), whose rows for token t are added after its routed
     * ones times sigmoid(shared_gate_logit[t]) (1 without it); fp8 quantises a token's shared h
     * with one scale over all C chunks (the grouped path's and the CPU's). Needs top_k + C <= 16,
     * num_experts + C <= MOE_DECODE_MAX_EXPERTS, split1 <= 1, shared_out NULL, no laid-out rows
     * and no trace. The workspace holds num_tokens (top_k + C) rows (h, o), and the sync array
     * moe_decode_sync_count(num_experts + C, hidden, inter, 1, num_tokens (top_k + C + 1)) ints;
     * moe_decode_split(num_experts + C, top_k + C, ...) is the split that keeps a token's bits
     * the same at every batch. */
    const void *shared_w13, *shared_w2;
    const float *shared_w13_scale, *shared_w2_scale;
    int shared_inter;
    /* f8: static activation scales (a W8A8 checkpoint's input_scale), one per routed expert
     * [num_experts], or NULL: GEMM 1 quantises x with input_scale13[e] and GEMM 2 h with
     * input_scale2[e] (the grouped path's pair rule for GEMM 1 is the caller's), each as it is
     * loaded; an expert's 0 keeps the dynamic per-row scale for that GEMM. Needs split1 <= 1, no
     * shared MLP inside and no trace. */
    const float *input_scale13, *input_scale2;
} moe_decode_args_t;

/* ints of the persistent sync array for a layer of these dimensions and GEMM 1 k split (with room
 * for block scales' maxima: max_rows x ceil(inter / 128)) */
size_t moe_decode_sync_count(int num_experts, int hidden, int inter, int split1, int max_rows);
/* GEMM 2's k split for a layer: enough (expert, row tile, split) items for every warp of the
 * GPU when one token's top_k experts are touched; from the shape only, so a token's sums do not
 * depend on the batch. */
int moe_decode_split(int num_experts, int top_k, int hidden, int inter, int num_sms);
/* GEMM 1's k split by the same rule: enough (expert, 8 columns of h, split) items for every warp
 * at one token, each piece at least 256 of k. GEMM 1's pieces are summed in split order by the
 * piece that finishes last, so the split changes a token's bits only with the layer's shape. */
int moe_decode_split1(int num_experts, int top_k, int hidden, int inter, int num_sms);
/* NOT_SUPPORTED (naming the value) where the kernel cannot run these dimensions. */
moe_status_t moe_decode_check(int num_experts, int top_k, int hidden, int inter, int f8);
moe_status_t moe_decode_launch(const moe_decode_args_t *args, void *stream);
moe_status_t moe_decode_prepare(void);

#ifdef __cplusplus
}
#endif

#endif /* MOE_DECODE_H */
