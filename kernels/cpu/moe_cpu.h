/* SPDX-License-Identifier: Apache-2.0 */
/* CPU reference kernels for every stage of a MoE layer: the oracle for the CUDA kernels. */
#ifndef MOE_CPU_H
#define MOE_CPU_H

#include <stddef.h>
#include <stdint.h>
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Leaves of the fixed reduction tree over an expert's intermediate dimension. A down
 * projection over a slice that is an aligned subtree (TP size a power of two dividing this)
 * gives bitwise the same node value as the full reduction computes for that subtree. */
#define MOE_CPU_TREE_LEAVES 64

/* A weight matrix [rows, cols] in its storage dtype (F32, BF16, FP8_E4M3 with scales). */
typedef struct moe_cpu_matrix {
    moe_dtype_t dtype;
    moe_scale_kind_t scale_kind;
    int64_t rows, cols;
    const void *data;
    const float *scale; /* FP8: 1 float, [rows] per channel, or [ceil(rows/128), ceil(cols/128)] */
} moe_cpu_matrix_t;

/* sum_i a[i] * b[i] in f32, in a fixed order: eight interleaved partial sums (vectorisable)
 * combined pairwise, then the tail. The same inputs always give the same bits. */
float moe_cpu_dot(const float *a, const float *b, int64_t n);

/* MOE_CPU_DOT_ROWS rows of a (row t at a + t * lda) each dotted with b: out[t] has the bits of
 * moe_cpu_dot(a + t * lda, b, n). One pass over b for all of them, their partial sums side by
 * side (four times the independent adds of one dot: the loop is no longer one chain of add
 * latencies). */
#define MOE_CPU_DOT_ROWS 4
void moe_cpu_dot_rows(const float *a, int64_t lda, const float *b, int64_t n, float *out);
/* The same without AVX (what moe_cpu_dot_rows runs where the CPU has none; the tests compare
 * both with moe_cpu_dot) */
void moe_cpu_dot_rows_portable(const float *a, int64_t lda, const float *b, int64_t n, float *out);

/* Tokens a product takes at a time with rows of `cols` values: about 256 KB of f32 token rows
 * (a multiple of MOE_CPU_DOT_ROWS), so each weight row is used on a block that stays in the
 * core's cache instead of streaming every token row from memory once a row; at least 64, so
 * that converting the row again for each block (long rows) stays a small part of its dots. */
int64_t moe_cpu_token_block(int64_t cols);

/* out[i] = moe_cpu_dot(a + i * lda, b, n) for i < rows, MOE_CPU_DOT_ROWS at a time. */
void moe_cpu_dots(const float *a, int64_t lda, int64_t rows, const float *b, int64_t n, float *out,
                  int64_t out_stride);

/* Row r of m as f32 (FP8 dequantised with its scale). */
void moe_cpu_matrix_row(const moe_cpu_matrix_t *m, int64_t r, float *out);

/* y[n, m.rows] = x[n, m.cols] . m^T, f32, each dot by moe_cpu_dot (weight rows over
 * moe_cpu_for_rows' threads: the same bits at any thread count). */
moe_status_t moe_cpu_matmul_nt(const float *x, int64_t n, const moe_cpu_matrix_t *m, float *y);

/* The threads a large CPU product runs on: MOE_CPU_THREADS (1..64; 0 or unset: auto) where
 * set, else the CPUs this process may run on (its affinity), divided among the host's ranks
 * (moe_cpu_set_host_ranks) unless it is bound to a share of them; at most 64. */
int moe_cpu_threads(void);

/* The ranks on this process's host (a runtime's MPI node communicator; 1 before one says). */
void moe_cpu_set_host_ranks(int n);

/* fn(ctx, r0, r1, scratch) over [0, rows) in contiguous ranges, one a thread, each with its own
 * scratch of scratch_floats floats; `work` (multiply-adds) decides how many threads: one below
 * 2^22, then at most one per 2^21 and moe_cpu_threads(); one inside another's range. fn must
 * write only what its rows determine, so the output is the same at any thread count. A thread
 * that cannot start runs its range on the caller. Fails only without memory for one scratch
 * (`what` names it). */
typedef void (*moe_cpu_rows_fn)(void *ctx, int64_t r0, int64_t r1, float *scratch);
#define MOE_CPU_PAR_MIN_WORK (1 << 22) /* multiply-adds below which a product has one thread */
moe_status_t moe_cpu_for_rows(int64_t rows, double work, size_t scratch_floats, moe_cpu_rows_fn fn,
                              void *ctx, const char *what);

typedef struct moe_route_params {
    int num_experts, top_k;
    moe_scoring_t scoring;
    int use_bias; /* sigmoid: bias added for choosing only */
    int n_group;  /* <= 1: no grouping */
    int topk_group;
    int renormalize;
    float scaling; /* routed_scaling_factor (applied after renormalising) */
} moe_route_params_t;

/* Top-k per token from logits [T, E]. Ties: lower expert id first. ids[T, k] in order of
 * falling choice score; weights[T, k] as docs/SEMANTICS.md says for each scoring. */
moe_status_t moe_cpu_route(const moe_route_params_t *p, const float *logits, const float *bias,
                           int64_t num_tokens, int32_t *topk_ids, float *topk_weights);

/* h[i] = act(gate[i]) * up[i]. */
void moe_cpu_act_mul(moe_activation_t act, const float *gate, const float *up, float *h, int64_t n);

/* One expert's (or the shared MLP's) slice of weights: gate/up [Is, H], down [H, Is]. */
typedef struct moe_cpu_mlp {
    moe_cpu_matrix_t gate, up, down;
    int64_t slice_begin;       /* first intermediate index of the slice */
    int64_t full_intermediate; /* I of the whole matrix (all slices) */
    /* FP8 W8A8 with per-tensor scales only: static scales of the inputs of gate, up and down (a
     * checkpoint's input_scale); 0: dynamic. moe_cpu_mlp ignores them. */
    float input_scale[3];
} moe_cpu_mlp_t;

/* The gate and up products of an MLP on n rows: *g and *u, [n, is] f32 each, for the caller to
 * free (also after a failure, which names `what`). */
moe_status_t moe_cpu_mlp_buffers(int64_t n, int64_t is, const char *what, float **g, float **u);

/* out[n, H] = down . (act(gate . x) * (up . x)) over the slice: unweighted partial sums.
 * The down projection reduces over the MOE_CPU_TREE_LEAVES tree when the slice is aligned to
 * it, else sequentially. */
moe_status_t moe_cpu_mlp(const moe_cpu_mlp_t *w, moe_activation_t act, const float *x, int64_t n,
                         float *out);

/* out[n] = parts[0] + ... + parts[count-1]: a pairwise tree when count is a power of two
 * (matching the down projection's tree), else left to right. */
void moe_cpu_tree_sum(const float *const *parts, int count, int64_t n, float *out);

/* ---- FP8 W8A8 (docs/SEMANTICS.md, "FP8 W8A8"): what a GPU W8A8 kernel computes ---------- */

/* Activation groups along K of a W8A8 product with `m`: 128 for 128x128 block weights
 * (DeepSeek-V3 / DeepGEMM 1x128 groups), 0 (one group: the whole row) otherwise. */
int64_t moe_cpu_w8a8_group(const moe_cpu_matrix_t *m);

/* Quantises x[n, k] (row-major) to e4m3: q[n, k] and scale[n, groups] with groups = 1 when
 * group == 0, else ceil(k / group) (the last group may be partial). Each group's scale is
 * `static_scale` when > 0, else moe_fp8_dynamic_scale(max |x| of the group) (NaN skipped);
 * q = moe_fp8e4m3_quantize(x, scale). */
void moe_cpu_fp8_quantize_rows(const float *x, int64_t n, int64_t k, int64_t group,
                               float static_scale, uint8_t *q, float *scale);

/* y[n, m.rows] = W8A8 product of qa[n, m.cols] (scales sa from moe_cpu_fp8_quantize_rows with
 * group moe_cpu_w8a8_group(m)) and the FP8 matrix m. Per-tensor / per-channel:
 * acc = sum_k qa * qw (f32, moe_cpu_dot order), y = s_a * (s_w * acc). Block 128: per K block b
 * in order, acc_b likewise over the block, y += (s_a[b] * s_w[row block, b]) * acc_b from 0. */
moe_status_t moe_cpu_matmul_w8a8(const uint8_t *qa, const float *sa, int64_t n,
                                 const moe_cpu_matrix_t *m, float *y);

/* moe_cpu_mlp with W8A8 arithmetic (all three matrices FP8): x rounded to bf16 and quantised
 * (static scale: the larger of input_scale[0] and [1] when both are set and the weights are
 * per-tensor), gate and up by moe_cpu_matmul_w8a8, h = act(gate) * up in f32 rounded to bf16 (as
 * the GPU holds it between its GEMMs) and quantised the same way over this slice (static:
 * input_scale[2]), down by moe_cpu_matmul_w8a8. Unweighted partials. */
moe_status_t moe_cpu_mlp_w8a8(const moe_cpu_mlp_t *w, moe_activation_t act, const float *x,
                              int64_t n, float *out);

/* Stable counting sort of rows by group: offsets[num_groups + 1], order[n] = row ids. */
moe_status_t moe_cpu_group_rows(const int32_t *group_of_row, int64_t n, int num_groups,
                                int64_t *offsets, int64_t *order);

#ifdef __cplusplus
}
#endif

#endif /* MOE_CPU_H */
