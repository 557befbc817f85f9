/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA permute: group token-expert rows by expert, padded to the GEMM's block_rows, and gather
 * the token rows into the GEMM's A buffer. Everything stays on the device. CUDA-free. */
#ifndef MOE_PERMUTE_H
#define MOE_PERMUTE_H

#include <stdint.h>
#include "moe/moe.h"
#include "kernels/ep.h"
#include "kernels/route.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Upper bound of the blocks one step needs, known on the host: each expert hit adds at most
 * one partial block, so sum_e ceil(c_e / br) <= ceil(n / br) + min(E, n) with n = rows. */
static inline int64_t moe_permute_max_blocks(int64_t rows, int num_experts, int block_rows)
{
    const int64_t hit = rows < num_experts ? rows : num_experts;
    return (rows + block_rows - 1) / block_rows + hit;
}

/* Rows per CTA of the multi-CTA metadata pass; fewer rows than this use one CTA (one launch),
 * more use ceil(rows / chunk) CTAs (at most MOE_PERMUTE_MAX_CHUNKS) in two launches: count (the
 * CTA that finishes last scans the counts) and place. */
#define MOE_PERMUTE_CHUNK_ROWS 4096
#define MOE_PERMUTE_MAX_CHUNKS 512

static inline int moe_permute_chunks(int64_t rows)
{
    const int64_t g = (rows + MOE_PERMUTE_CHUNK_ROWS - 1) / MOE_PERMUTE_CHUNK_ROWS;
    return g < 1 ? 1 : g > MOE_PERMUTE_MAX_CHUNKS ? MOE_PERMUTE_MAX_CHUNKS : (int)g;
}

/* int32 scratch the metadata pass needs for `rows` rows (0: one CTA does it all). */
static inline int64_t moe_permute_scratch_count(int64_t rows, int num_experts)
{
    const int g = moe_permute_chunks(rows);
    return g > 1 ? (int64_t)g * num_experts : 0;
}

/* Expert parallelism's receive layout (kernels/a2a.h): topk_ids holds `regions` regions of
 * `rows` tokens each (num_tokens = regions * rows), of which region r's first counts[r] (device,
 * at most `rows`) are live, and the ids are global: a live slot's local expert is id - first
 * when that lies in [0, num_experts). The work (and the multi-CTA chunks) follows the live
 * slots, not num_tokens: slots past a region's count are neither read nor written (their
 * row_of_slot is left as it was, so readers must stop at the counts as well). With scratch, few
 * live slots (<= MOE_PERMUTE_CHUNK_ROWS) take the one-CTA pass inside the first launch, and the
 * second returns at once. `flags`: the step's statuses, one per region (or NULL); when any is
 * nonzero no live slot gets a row (-1) and `sticky` (when not NULL and still 0) records the
 * first as (region << 8) | code. */
#define MOE_PERMUTE_MAX_REGIONS 8

typedef struct moe_permute_regions {
    const int32_t *counts; /* device [regions]; NULL: the plain layout */
    int64_t rows;
    int regions, first;
    const int32_t *flags;
    int32_t *sticky;
} moe_permute_regions_t;

/* Metadata pass. Rows are (t, j) pairs in order t * top_k + j; within an expert
 * they keep that order (stable). Ids outside [0, num_experts) are skipped (row_of_slot -1):
 * expert parallelism passes local ids and marks remote experts that way. */
typedef struct moe_permute_args {
    const int32_t *topk_ids; /* device [num_tokens, top_k] */
    int64_t num_tokens;
    int top_k, num_experts;  /* num_experts <= MOE_PERMUTE_MAX_EXPERTS */
    int block_rows;          /* the GEMM variant's padding */
    int max_blocks;          /* >= moe_permute_max_blocks(num_tokens * top_k, ...) */
    int32_t *expert_counts;  /* out [num_experts]: rows of each expert (unpadded) */
    int32_t *expert_offsets; /* out [num_experts + 1]: first row of each expert (padded) */
    int32_t *block_expert;   /* out [max_blocks]: expert of each block, -1 past the last */
    int32_t *num_blocks;     /* out scalar: blocks used */
    int32_t *row_of_slot;    /* out [num_tokens * top_k]: row of (t, j) in A, -1 if skipped */
    int32_t *slot_of_row;    /* out [max_blocks * block_rows]: t * top_k + j, -1 for padding
                                (written for rows < num_blocks * block_rows) */
    int32_t *scratch;        /* device [scratch_count] (moe_permute_scratch_count), or NULL:
                                one CTA whatever the rows (slow past a few thousand rows) */
    int64_t scratch_count;
    int32_t *done;                 /* device int, required with scratch: 0 before the first launch,
                                      and every launch leaves it 0 (the multi-CTA pass counts its
                                      finished CTAs there). Persistent: not memory that anything
                                      else writes between launches, and one per stream that
                                      permutes concurrently */
    moe_permute_regions_t regions; /* zero: the plain layout */
} moe_permute_args_t;

#define MOE_PERMUTE_MAX_EXPERTS 1024

moe_status_t moe_permute_launch(const moe_permute_args_t *args, void *stream);

/* A small step's scoring + top-k, local slot ids and permute metadata in one launch (one CTA):
 * the results of moe_route_launch(&route), moe_ep_slot_ids_launch(&slots) and
 * moe_permute_launch(&permute) in turn, with two kernel boundaries fewer (a decode step's fixed
 * cost). route.num_tokens <= MOE_ROUTE_PERMUTE_MAX_TOKENS; slots.in is route.topk_ids,
 * slots.n = num_tokens * top_k; permute.topk_ids is slots.out, the plain layout (no regions).
 * Anything else: MOE_STATUS_INVALID_ARGUMENT naming the value. */
#define MOE_ROUTE_PERMUTE_MAX_TOKENS 64
typedef struct moe_route_permute_args {
    moe_route_args_t route;
    moe_ep_slot_ids_args_t slots;
    moe_permute_args_t permute;
} moe_route_permute_args_t;

moe_status_t moe_route_permute_launch(const moe_route_permute_args_t *args, void *stream);

/* a[row] = bf16(x[slot_of_row[row] / top_k]) for the rows of the first *num_blocks blocks;
 * padding rows are zeroed. The grid is sized from max_blocks; blocks past *num_blocks exit.
 * With row_of_slot (the permute's) the same rows come from a scatter instead: each of the
 * num_tokens rows of x is read once and stored into its top_k rows of a (a gather reads a token
 * row once per copy: top_k times from DRAM when x does not fit the L2), and padding rows are not
 * written: the grouped GEMM never lets a padding row reach a real output (test_gpu_expert_gemm
 * puts NaN there). */
typedef struct moe_gather_args {
    const void *x;       /* device [num_tokens, hidden], x_dtype */
    moe_dtype_t x_dtype; /* F32 or BF16 */
    int hidden, top_k;
    const int32_t *slot_of_row;
    const int32_t *num_blocks;
    int block_rows, max_blocks;
    void *a;                    /* device bf16 [max_blocks * block_rows, hidden] */
    const int32_t *row_of_slot; /* optional device [num_tokens * top_k]: the scatter form */
    int64_t num_tokens;
    /* The scatter form over the permute's receive regions (counts NULL: every token): only
     * region r's first counts[r] tokens are read, by a grid that does not grow past
     * MOE_GATHER_MAX_CTAS however large num_tokens is. */
    moe_permute_regions_t regions;
} moe_gather_args_t;

#define MOE_GATHER_MAX_CTAS 1024

moe_status_t moe_gather_launch(const moe_gather_args_t *args, void *stream);

/* Rows of every token as one group (the shared MLP): a[t] = bf16(x[t]) for t < num_tokens,
 * zero up to max_blocks * block_rows; block_expert[b] = 0 for the ceil(num_tokens/block_rows)
 * used blocks, -1 after; *num_blocks set. One launch. */
typedef struct moe_rows_args {
    const void *x;
    moe_dtype_t x_dtype;
    int64_t num_tokens;
    int hidden, block_rows, max_blocks; /* max_blocks * block_rows >= num_tokens */
    void *a;                            /* device bf16 [max_blocks * block_rows, hidden] */
    int32_t *block_expert;              /* device [max_blocks] */
    int32_t *num_blocks;                /* device scalar */
} moe_rows_args_t;

moe_status_t moe_rows_launch(const moe_rows_args_t *args, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* MOE_PERMUTE_H */
