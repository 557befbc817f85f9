/* SPDX-License-Identifier: Apache-2.0 */
/* Internal runtime and layer objects, the sharding plan and the backend interface. */
#ifndef MOE_LAYER_H
#define MOE_LAYER_H

#include <stdint.h>
#include "moe/moe.h"
#include "comm/comm.h"
#include "runtime/knobs.h"

#ifdef __cplusplus
extern "C" {
#endif

struct moe_runtime {
    moe_runtime_config_t config;
    moe_comm_t *comm; /* world, node-local; MPI */
    moe_runtime_info_t info;
    int owns_mpi;   /* libmoe called MPI_Init */
    int timeout_ms; /* resolved */
    int num_gpus;   /* visible CUDA devices (0 without the CUDA backend) */
    void *gpu_ctx;  /* CUDA backend: stream, NCCL communicators (opaque here) */
    /* CUDA backend: the one device workspace its layers share (they run one at a time); grows
     * to the largest layer's need at create */
    void *gpu_ws;
    size_t gpu_ws_bytes;
    /* CUDA backend, all-to-all over CUDA IPC: the buffer every rank maps (grows like gpu_ws,
     * collectively at layer create) and its destructor */
    void *gpu_sym;
    size_t gpu_sym_bytes; /* its size: the IPC buffer of the all-to-all (lsa) */
    void (*gpu_sym_free)(void *sym);
};

/* Where each expert lives and which slice of its intermediate dimension this rank keeps.
 * Rank r = ep_rank * tp_size + tp_rank; the ranks of one EP group hold the same experts and
 * split their intermediate dimension (TP); the shared MLP is split over all world ranks. */
typedef struct moe_plan {
    int world, rank;
    int ep_size, tp_size, ep_rank, tp_rank;
    int num_local_experts, first_local_expert; /* slots; first_local_expert -1 if not a block */
    /* The placement: num_slots physical expert slots (E + R), slot_logical the map. With
     * `placed` the slots split equally, S = num_slots / ep_size per EP rank, rank-major; without
     * (R = 0 and ep_size not dividing E) slot e holds expert e by the floor split. */
    int num_slots, placed;
    int32_t *slot_logical;   /* [num_slots] -> logical expert */
    int *slot_owner;         /* [num_slots] -> EP rank */
    int *slot_local;         /* [num_slots] -> index among its owner's slots */
    int *replica_begin;      /* [E + 1]: e's slots are replica_slot[replica_begin[e] ..] */
    int *replica_slot;       /* [num_slots]: slots by logical expert, ascending */
    int *local_logical;      /* [num_local_experts]: logical expert of each local slot */
    int *expert_owner;       /* [num_experts] -> EP rank of the expert's first replica */
    int *expert_local_index; /* [num_experts] -> that replica's index on its owner */
    int64_t i_begin, i_end;  /* this rank's slice of each routed expert's intermediate */
    int64_t s_begin, s_end;  /* this rank's slice of the shared MLP's intermediate */
    int64_t shared_intermediate;
} moe_plan_t;

/* The slice [begin, end) of `n` held by part `i` of `parts` (equal, floor-split). */
/* Whether a layer's configuration asks for W8A8 arithmetic (fp8_math W8A8 or W8A8_FAST on FP8
 * weights), and for the fast form's accumulation: per-row weight scales only (block scales
 * promote their sums anyway). */
static inline int moe_cfg_w8a8(const moe_layer_config_t *c)
{
    return c->weight_dtype == MOE_DTYPE_FP8_E4M3 &&
           (c->fp8_math == MOE_FP8_MATH_W8A8 || c->fp8_math == MOE_FP8_MATH_W8A8_FAST);
}
static inline int moe_cfg_fast_accum(const moe_layer_config_t *c)
{
    return moe_cfg_w8a8(c) && c->fp8_math == MOE_FP8_MATH_W8A8_FAST &&
           c->scale_kind != MOE_SCALE_BLOCK_128;
}

static inline int64_t moe_split_begin(int64_t n, int parts, int i)
{
    return (n * i) / parts;
}

/* The physical slot that serves logical expert e for token t (index on its rank) of source
 * rank src (docs/SEMANTICS.md, "Replicas"): its replicas in slot order, the
 * ((t + src) mod replicas)-th. */
static inline int moe_plan_route_slot(const moe_plan_t *p, int e, int64_t t, int src)
{
    const int b = p->replica_begin[e], n = p->replica_begin[e + 1] - b;
    return p->replica_slot[b + (n == 1 ? 0 : (int)((t + src) % n))];
}

/* The local slot of EP rank g that holds logical expert e under p, or -1 (a placement change
 * keeps such a slot instead of receiving e). */
static inline int moe_plan_local_slot_of(const moe_plan_t *p, int e, int g)
{
    for (int k = p->replica_begin[e]; k < p->replica_begin[e + 1]; k++)
        if (p->slot_owner[p->replica_slot[k]] == g)
            return p->slot_local[p->replica_slot[k]];
    return -1;
}

/* Weight matrix on a rank, in the layer's storage dtype (host or device memory). */
typedef struct moe_matrix {
    moe_dtype_t dtype;
    moe_scale_kind_t scale_kind;
    int64_t rows, cols;
    void *data;
    float *scale; /* NULL, 1 float, or [ceil(rows/128), ceil(cols/128)] */
    /* FP8 per-tensor layers: the static scale of this matrix's input activations (W8A8), 0:
     * none (dynamic) */
    float input_scale;
} moe_matrix_t;

struct moe_layer;

/* A backend owns where weights live and how forward runs. Weights reach it already sliced to
 * the rank's shard and converted to the storage dtype. */
typedef struct moe_backend_ops {
    const char *name;
    moe_status_t (*init)(struct moe_layer *layer);
    void (*fini)(struct moe_layer *layer);
    /* `local` is the local expert index for per-expert kinds, else -1. */
    moe_status_t (*store_weight)(struct moe_layer *layer, moe_weight_kind_t kind, int local,
                                 const moe_matrix_t *m);
    moe_status_t (*forward)(struct moe_layer *layer, const moe_forward_args_t *args);
    /* Bounded wait for the forwards queued on `stream`; NULL: forward is synchronous. */
    moe_status_t (*synchronize)(struct moe_layer *layer, void *stream);
    /* One line on what a step of num_tokens tokens on this rank runs and why; NULL: the
     * layer writes a generic line. */
    void (*explain)(const struct moe_layer *layer, int64_t num_tokens, char *text, size_t len);
    /* Collective: gives this rank the expert weights of new_map's slots (from the ranks that
     * hold them under layer->plan) when move_weights, else only resizes nothing; the layer
     * switches its plan after it succeeds on every rank. NULL: placement not supported. */
    moe_status_t (*set_placement)(struct moe_layer *layer, const int32_t *new_map, int move_weights,
                                  moe_placement_stats_t *stats);
    /* A load window the backend counts itself (on the device): adds its rows per logical expert
     * since the window began to counts[num_experts] (waiting for the queued forwards), and
     * starts a new one. NULL: the layer's load_window is the whole window. */
    moe_status_t (*load_window)(const struct moe_layer *layer, int64_t *counts);
    moe_status_t (*reset_load_window)(struct moe_layer *layer);
} moe_backend_ops_t;

extern const moe_backend_ops_t moe_backend_cpu;
#ifdef MOE_HAVE_CUDA
extern const moe_backend_ops_t moe_backend_cuda;
#endif

struct moe_layer {
    moe_runtime_t *rt;
    moe_layer_config_t cfg; /* validated, AUTO resolved */
    moe_plan_t plan;
    const moe_backend_ops_t *ops;
    void *state;               /* backend's */
    unsigned char *weight_set; /* [MOE_WEIGHT_KIND_COUNT * (num_local_experts + 1)] */
    moe_layer_stats_t stats;
    int64_t *expert_load; /* [num_experts] */
    int64_t *load_window; /* [num_experts]: rows per logical expert since the window began */
    moe_placement_stats_t placement_stats; /* of the last placement change */
    size_t weight_bytes, workspace_bytes;
    int64_t ep_round_tokens; /* resolved (moe_layer_info_t) */
    moe_knobs_t knobs;       /* read once at create, the same on every rank (knobs.h) */
    int broken; /* a collective failed: every later call returns MOE_STATUS_INVALID_STATE */
    /* Result of forward's local argument checks: a backend whose forward starts with a
     * collective carries it there so that every rank fails together instead of waiting. */
    moe_status_t input_status;
};

/* Shape of one matrix of `kind` on this rank (the slice) and in full. */
void moe_layer_weight_shape(const struct moe_layer *layer, moe_weight_kind_t kind, int64_t *rows,
                            int64_t *cols, int64_t *full_rows, int64_t *full_cols,
                            int64_t *row_begin, int64_t *col_begin);

/* The dtype and scale kind a matrix of `kind` is stored in: router, bias and the shared-expert
 * gate in f32; expert matrices in the layer's weight dtype and scale kind. */
void moe_layer_weight_storage(const struct moe_layer *layer, moe_weight_kind_t kind,
                              moe_dtype_t *dtype, moe_scale_kind_t *scale_kind);

/* Bytes of a matrix's data and scales in a storage dtype. */
size_t moe_matrix_data_bytes(moe_dtype_t dtype, int64_t rows, int64_t cols);
size_t moe_matrix_scale_count(moe_scale_kind_t kind, int64_t rows, int64_t cols);

/* Allocates the plan's placement tables and fills them with the default placement (ep_size,
 * ep_rank set). */
moe_status_t moe_plan_init_placement(moe_plan_t *p, int num_experts, int num_redundant);
void moe_plan_free_placement(moe_plan_t *p);

/* Builds the plan's placement tables from map[num_slots] (equal slots per EP rank). */
moe_status_t moe_plan_set_map(moe_plan_t *p, int num_experts, const int32_t *map);

/* Whether every weight this rank needs has been set; else an INVALID_STATE naming one. */
moe_status_t moe_layer_check_weights(const struct moe_layer *layer, int need_router, int need_bias);

#ifdef __cplusplus
}
#endif

#endif /* MOE_LAYER_H */
