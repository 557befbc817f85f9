/* SPDX-License-Identifier: Apache-2.0 */
/* libmoe public API: runtime and MoE layer objects, status codes. Plain C11, no CUDA/MPI types. */
#ifndef MOE_MOE_H
#define MOE_MOE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_VERSION_MAJOR 0
#define MOE_VERSION_MINOR 1
#define MOE_VERSION_PATCH 0

/* Value for integer and enum config fields that lets libmoe choose. */
#define MOE_AUTO 0

/* ------------------------------------------------------------------------------------------ */
/* Status                                                                                      */
/* ------------------------------------------------------------------------------------------ */

typedef enum moe_status {
    MOE_STATUS_SUCCESS = 0,
    MOE_STATUS_INVALID_ARGUMENT = 1, /* a bad value; moe_last_error() names it */
    MOE_STATUS_NOT_SUPPORTED = 2,    /* valid, but not built or not available here */
    MOE_STATUS_OUT_OF_MEMORY = 3,
    MOE_STATUS_INVALID_STATE = 4, /* call out of order (weights missing) or object broken */
    MOE_STATUS_IO_ERROR = 5,      /* open/read/write failed */
    MOE_STATUS_FORMAT_ERROR = 6,  /* malformed file (safetensors, JSON, config) */
    MOE_STATUS_MISMATCH = 7,      /* ranks passed different arguments to a collective */
    MOE_STATUS_TIMEOUT = 8,       /* a peer did not answer within the runtime's timeout */
    MOE_STATUS_PEER_FAILURE = 9,  /* another rank reported an error in a collective */
    MOE_STATUS_CUDA_ERROR = 10,
    MOE_STATUS_NCCL_ERROR = 11,
    MOE_STATUS_MPI_ERROR = 12,
    MOE_STATUS_NUMERIC_ERROR = 13, /* NaN/Inf found in an input while checking is on */
    MOE_STATUS_INTERNAL_ERROR = 14
} moe_status_t;

#define MOE_STATUS_COUNT 15

/* Name of a status ("MOE_STATUS_TIMEOUT"); never NULL. */
const char *moe_status_string(moe_status_t status);

/* Message of the last failed call on this thread (names the bad value); "" if none.
 * The pointer stays valid until the next libmoe call on this thread. */
const char *moe_last_error(void);

/* Version of the library that is linked (may differ from the header's MOE_VERSION_*). */
void moe_version(int *major, int *minor, int *patch);

/* ------------------------------------------------------------------------------------------ */
/* Enums                                                                                       */
/* ------------------------------------------------------------------------------------------ */

typedef enum moe_dtype {
    MOE_DTYPE_INVALID = 0,
    MOE_DTYPE_F32 = 1,
    MOE_DTYPE_BF16 = 2,
    MOE_DTYPE_F16 = 3,
    MOE_DTYPE_FP8_E4M3 = 4 /* OCP E4M3FN: no Inf, NaN = 0x7f/0xff, max 448 */
} moe_dtype_t;

/* How FP8 weights are scaled: real = fp8 * scale. */
typedef enum moe_scale_kind {
    MOE_SCALE_NONE = 0,       /* unquantised dtypes */
    MOE_SCALE_PER_TENSOR = 1, /* one float per weight matrix */
    MOE_SCALE_BLOCK_128 = 2,  /* one float per 128x128 block: [ceil(rows/128), ceil(cols/128)] */
    MOE_SCALE_PER_CHANNEL = 3 /* one float per output channel (row): [rows, 1] */
} moe_scale_kind_t;

/* The arithmetic of FP8 (FP8_E4M3) layers; docs/SEMANTICS.md gives both exactly. */
typedef enum moe_fp8_math {
    /* The backend's choice: W8A16 on every backend today, so that the CPU and GPU defaults
     * give the same numbers; W8A8 must be asked for. */
    MOE_FP8_MATH_AUTO = 0,
    /* FP8 weights dequantised, activations not quantised (f32 on the CPU, bf16 on the GPU). */
    MOE_FP8_MATH_W8A16 = 1,
    /* Activations quantised to e4m3 too (one dynamic scale per token, or per 1x128 group along
     * K with 128x128 block weights; or the matrix's static input scale), f32 accumulation of
     * e4m3 x e4m3 products. The CPU backend and the CUDA backend on sm_90 (e4m3 wgmma; sm_80
     * refuses it at create). Needs weight_dtype FP8_E4M3. */
    MOE_FP8_MATH_W8A8 = 2,
    /* W8A8 whose e4m3 products a GPU may sum over the whole of K in the tensor cores' own
     * accumulator (fewer bits than f32), the scales applied once after it: what CUTLASS's
     * "fast accumulation" FP8 kernels and Triton's FP8 dot on sm_90 (vLLM's fused_moe with
     * per-tensor or per-channel weights) compute. Faster at large batches; off the W8A8
     * numbers by up to ~2e-2 relative (docs/SEMANTICS.md, "FP8 W8A8"). With 128x128 block
     * scales it is W8A8 (a block's scale changes every 128 of K, so its sums are promoted
     * anyway). The CPU backend computes W8A8. Needs FP8_E4M3 weights. */
    MOE_FP8_MATH_W8A8_FAST = 3
} moe_fp8_math_t;

typedef enum moe_backend {
    MOE_BACKEND_AUTO = 0, /* CUDA where a GPU is visible and built, else CPU */
    MOE_BACKEND_CPU = 1,  /* MPI transport, C reference kernels (float accumulation) */
    MOE_BACKEND_CUDA = 2  /* NCCL transport, fused CUDA kernels */
} moe_backend_t;

typedef enum moe_activation {
    MOE_ACTIVATION_SILU = 0, /* silu(gate) * up   (Mixtral, Qwen, DeepSeek) */
    MOE_ACTIVATION_GELU = 1  /* gelu_tanh(gate) * up */
} moe_activation_t;

typedef enum moe_scoring {
    MOE_SCORING_SOFTMAX = 0, /* softmax over all experts, then top-k */
    MOE_SCORING_SIGMOID = 1  /* sigmoid scores; optional bias and grouped top-k (DeepSeek-V3) */
} moe_scoring_t;

typedef enum moe_dispatch {
    MOE_DISPATCH_AUTO = 0,       /* chosen by tokens per rank */
    MOE_DISPATCH_ALL_TO_ALL = 1, /* rows sent only to the ranks owning their experts */
    MOE_DISPATCH_ALL_GATHER = 2  /* every rank sees every token; partial sums reduced back */
} moe_dispatch_t;

typedef enum moe_weight_kind {
    MOE_WEIGHT_ROUTER = 0,            /* [num_experts, hidden] */
    MOE_WEIGHT_ROUTER_BIAS = 1,       /* [1, num_experts] e_score_correction_bias (choice only) */
    MOE_WEIGHT_GATE_PROJ = 2,         /* per expert: W1 [intermediate, hidden] */
    MOE_WEIGHT_UP_PROJ = 3,           /* per expert: W3 [intermediate, hidden] */
    MOE_WEIGHT_DOWN_PROJ = 4,         /* per expert: W2 [hidden, intermediate] */
    MOE_WEIGHT_SHARED_GATE_PROJ = 5,  /* [shared_intermediate, hidden] */
    MOE_WEIGHT_SHARED_UP_PROJ = 6,    /* [shared_intermediate, hidden] */
    MOE_WEIGHT_SHARED_DOWN_PROJ = 7,  /* [hidden, shared_intermediate] */
    MOE_WEIGHT_SHARED_EXPERT_GATE = 8 /* [1, hidden]: y += sigmoid(g . x) * shared(x) */
} moe_weight_kind_t;

#define MOE_WEIGHT_KIND_COUNT 9

/* ------------------------------------------------------------------------------------------ */
/* Runtime: one per process, created collectively over an MPI communicator                    */
/* ------------------------------------------------------------------------------------------ */

typedef struct moe_runtime moe_runtime_t;

typedef struct moe_runtime_config {
    moe_backend_t backend;
    int device;     /* CUDA device ordinal; -1: node-local rank modulo visible devices */
    int timeout_ms; /* bound on every wait for a peer; 0: MOE_TIMEOUT_MS or 300000 */
    int bind;       /* 1: bind threads and memory to the GPU's NUMA node with hwloc */
} moe_runtime_config_t;

#define MOE_RUNTIME_CONFIG_INIT                                                                    \
    {                                                                                              \
        MOE_BACKEND_AUTO, -1, 0, 0                                                                 \
    }

typedef struct moe_runtime_info {
    int rank, world_size;
    int local_rank, local_size; /* within this host */
    moe_backend_t backend;      /* resolved */
    int device;                 /* CUDA device, -1 for the CPU backend */
    int numa_node;              /* -1 if unknown or not bound */
    char hostname[64];
    char cpuset[64]; /* cores bound to, "" if not bound */
    /* CUDA backend: bytes of the one device workspace that all layers of this runtime share
     * (the largest layer's need; 0 before the first layer), with the all-to-all's IPC receive
     * buffer (lsa transport) where there is one. Total device memory for a model is the
     * layers' weight_bytes plus this. */
    size_t workspace_bytes;
} moe_runtime_info_t;

/* Collective over `mpi_comm`, which points to an MPI_Comm (NULL: MPI_COMM_WORLD). If MPI is not
 * initialised, libmoe initialises it (and finalises it in moe_runtime_destroy). The runtime
 * duplicates the communicator. All ranks must call it; an error on one rank is returned on
 * all ranks. See moe_mpi.h for a typed wrapper. */
moe_status_t moe_runtime_create(const moe_runtime_config_t *config, const void *mpi_comm,
                                moe_runtime_t **runtime);

/* Not collective. Destroy layers first. NULL is fine. */
moe_status_t moe_runtime_destroy(moe_runtime_t *runtime);

moe_status_t moe_runtime_get_info(const moe_runtime_t *runtime, moe_runtime_info_t *info);

/* Collective over the runtime's ranks, on the host: *max_tokens_across_ranks = the largest
 * num_tokens any rank passes, for moe_forward_args_t.max_tokens_across_ranks of the coming step
 * (every layer of it). For callers that do not know that bound already (a serving engine knows
 * it from its batch metadata): one small host all-reduce a step (bounded by the runtime's
 * timeout) instead of a step sized by the capacity, which with expert parallelism on the CUDA
 * backend runs ceil(capacity / ep_round_tokens) rounds, W by default, however few tokens it has
 * (docs/KERNELS.md, "Rounds"). num_tokens must be >= 0; a rank whose arguments fail returns
 * INVALID_ARGUMENT and every other rank PEER_FAILURE naming it (a NULL runtime cannot take
 * part: its peers get TIMEOUT). */
moe_status_t moe_runtime_max_tokens(moe_runtime_t *runtime, int64_t num_tokens,
                                    int64_t *max_tokens_across_ranks);

/* ------------------------------------------------------------------------------------------ */
/* Layer                                                                                       */
/* ------------------------------------------------------------------------------------------ */

typedef struct moe_layer moe_layer_t;

typedef struct moe_layer_config {
    int num_experts;  /* routed experts E */
    int top_k;        /* experts per token k <= E */
    int hidden;       /* H */
    int intermediate; /* I of each routed expert */

    int num_shared_experts;  /* always-on experts, fused into one MLP; 0 = none */
    int shared_intermediate; /* that MLP's I; MOE_AUTO: num_shared_experts * intermediate */
    int shared_expert_gate;  /* 1: y += sigmoid(Wsg . x) * shared(x) (Qwen2-MoE) */

    moe_activation_t activation;
    moe_scoring_t scoring;
    int use_score_bias;          /* sigmoid: add ROUTER_BIAS to scores for choosing only */
    int n_group;                 /* grouped top-k: groups of E/n_group experts; 0/1: off */
    int topk_group;              /* groups kept */
    int renormalize;             /* divide the k weights by their sum */
    float routed_scaling_factor; /* multiplies the k weights; 0 means 1 */

    moe_dtype_t weight_dtype; /* F32, BF16 or FP8_E4M3 */
    moe_scale_kind_t scale_kind;

    int64_t max_tokens_per_rank; /* sizes every buffer; forward rejects more */

    int ep_size; /* expert parallel; MOE_AUTO: world / tp_size */
    int tp_size; /* tensor parallel over intermediate; MOE_AUTO: 1 */
    moe_dispatch_t dispatch;
    int deterministic; /* 1: fixed reduction order, bitwise equal across batch/layout/mode;
                          MOE_AUTO: MOE_DETERMINISTIC env */
    int check_inputs;  /* 1: reject NaN/Inf in x and logits (MOE_STATUS_NUMERIC_ERROR) */
    /* 0 (default): moe_layer_set_weight and moe_layer_load reject NaN/Inf weights and FP8
     * scales that are not finite and > 0 (MOE_STATUS_NUMERIC_ERROR naming the tensor and the
     * first bad element); 1: skip that scan of every weight (faster loads of trusted files). */
    int skip_weight_check;
    /* FP8 layers: W8A16, W8A8 or W8A8_FAST arithmetic (MOE_FP8_MATH_AUTO: the backend's
     * choice, today W8A16). W8A8 and W8A8_FAST with a weight_dtype other than FP8_E4M3 are
     * rejected (INVALID_ARGUMENT); W8A16 and AUTO are what every non-FP8 layer computes anyway.
     * The CUDA backend computes W8A8 on sm_90a GPUs and rejects it on older ones
     * (MOE_STATUS_NOT_SUPPORTED). */
    moe_fp8_math_t fp8_math;
    /* Expert parallelism on the CUDA backend: a forward step runs in rounds of at most this
     * many tokens per rank, and the EP buffers (received rows, their GEMM rows and partials)
     * are sized for one round, world x ep_round_tokens rows, not world x max_tokens_per_rank.
     * A step has ceil(m / ep_round_tokens) rounds, m = max_tokens_across_ranks where given,
     * else max_tokens_per_rank (so tell it: a decode step is then one round). With the lsa
     * transport the rounds past every rank's tokens exchange nothing (their kernels are still
     * launched and exit at once); with p2p and allgather they run. 0 (default):
     * max(ceil(max_tokens_per_rank / world), min(max_tokens_per_rank, 256)), so the workspace
     * grows with max_tokens_per_rank x top_k x hidden but not also with the world size;
     * max_tokens_per_rank: one round per step (the most memory; each round reads the local
     * experts' weights once). Must be 0..max_tokens_per_rank. The CPU backend and one GPU
     * ignore it. */
    int64_t ep_round_tokens;
    /* Redundant expert slots R (EPLB): the layer holds E + R physical expert slots, (E + R) /
     * ep_size on each EP rank, each slot a copy of one logical expert; a hot expert placed in
     * several slots has its tokens split over them (docs/SEMANTICS.md, "Replicas"). 0 (default):
     * E slots, expert e on EP rank e / (E / ep_size) as without it. R must be a multiple of
     * ep_size and, when > 0, num_experts too. The default placement puts rank g's R / ep_size
     * redundant slots on the first experts of rank g + 1 (mod ep_size); moe_layer_set_placement
     * and moe_layer_rebalance move them. Both backends (the CUDA backend moves the weights
     * through host memory for now: docs/EPLB.md). */
    int num_redundant_experts;
} moe_layer_config_t;

#define MOE_LAYER_CONFIG_INIT                                                                      \
    {                                                                                              \
        0, 0, 0, 0, 0, MOE_AUTO, 0, MOE_ACTIVATION_SILU, MOE_SCORING_SOFTMAX, 0, 0, 0, 1, 1.0f,    \
            MOE_DTYPE_BF16, MOE_SCALE_NONE, 0, MOE_AUTO, MOE_AUTO, MOE_DISPATCH_AUTO, MOE_AUTO, 0, \
            0, MOE_FP8_MATH_AUTO, 0, 0                                                             \
    }

/* What the layer resolved on this rank. */
typedef struct moe_layer_info {
    int ep_size, tp_size, ep_rank, tp_rank;
    /* This rank's expert slots and, when they hold a contiguous block of distinct experts
     * (the default with num_redundant_experts = 0), the first; else -1
     * (moe_layer_get_placement says which experts they hold). */
    int num_local_experts, first_local_expert;
    int intermediate_begin, intermediate_end; /* this rank's slice of each expert's I */
    int shared_begin, shared_end;             /* this rank's slice of the shared MLP's I */
    moe_dispatch_t dispatch;                  /* as configured (AUTO resolves per step) */
    int deterministic;
    size_t weight_bytes; /* expert + shared + router weights held by this rank */
    /* Scratch this layer needs per step. CUDA backend: taken from the runtime's one shared
     * workspace (moe_runtime_info_t.workspace_bytes), not held per layer; with the lsa
     * transport it counts the layer's part of the IPC receive buffer too. */
    size_t workspace_bytes;
    /* Tokens per rank of one EP round (moe_layer_config_t.ep_round_tokens resolved; the CUDA
     * backend with EP), else max_tokens_per_rank: a step runs in rounds of this many. With
     * MOE_EP_MICROBATCH=1 (two micro-batch lanes, README) a lane's round: half of it, rounded
     * up. */
    int64_t ep_round_tokens;
} moe_layer_info_t;

/* Collective over the runtime's communicator: every rank must call it with the same config.
 * Validates the config (error names the field), checks that all ranks agree (else
 * MOE_STATUS_MISMATCH on every rank) and plans all buffers. */
moe_status_t moe_layer_create(moe_runtime_t *runtime, const moe_layer_config_t *config,
                              moe_layer_t **layer);

/* Not collective. NULL is fine. */
moe_status_t moe_layer_destroy(moe_layer_t *layer);

moe_status_t moe_layer_get_info(const moe_layer_t *layer, moe_layer_info_t *info);

/* A host tensor, row-major and contiguous. FP8 tensors carry their scales: one float for
 * MOE_SCALE_PER_TENSOR, [ceil(rows/128), ceil(cols/128)] for MOE_SCALE_BLOCK_128, [rows, 1]
 * for MOE_SCALE_PER_CHANNEL (the scale kind is read from this shape). */
typedef struct moe_tensor {
    moe_dtype_t dtype;
    int64_t rows, cols;
    const void *data;
    const float *scale;
    int64_t scale_rows, scale_cols;
} moe_tensor_t;

/* Not collective; host memory, copied before return. `expert` is the global expert id for the
 * per-expert kinds and ignored (-1) otherwise. A rank that does not own the expert returns
 * success and keeps nothing. The tensor may be the full matrix (each rank keeps its TP slice)
 * or this rank's slice only (shape of the slice). Data in F32/BF16/F16 is converted to the
 * layer's weight dtype; FP8 layers quantise it with scales of the layer's scale kind (per-tensor
 * and per-channel scales taken over the whole matrix or row when the full matrix is given, so
 * a TP slice is quantised as one rank holding everything would; from the slice otherwise). Unless
 * the layer has skip_weight_check, the part this rank keeps is scanned first: a NaN/Inf value, or
 * an FP8 scale that is not finite and > 0, gives MOE_STATUS_NUMERIC_ERROR naming the kind and
 * the first bad element, and nothing is kept. */
moe_status_t moe_layer_set_weight(moe_layer_t *layer, moe_weight_kind_t kind, int expert,
                                  const moe_tensor_t *tensor);

/* moe_layer_set_weight for an FP8 matrix with a static activation scale (a checkpoint's
 * `input_scale`, `activation_scheme: static`; vLLM's a1_scale / a2_scale): the layer's W8A8
 * arithmetic then quantises this matrix's input with it, q = e4m3(v / input_scale), instead of
 * with a dynamic scale per token (docs/SEMANTICS.md, "FP8 W8A8": gate_proj and up_proj share
 * GEMM 1's input, quantised statically with the larger of their two scales when both have one).
 * For GATE_PROJ, UP_PROJ, DOWN_PROJ and the SHARED_ three, on a layer with weight_dtype
 * FP8_E4M3, per-tensor scales and fp8_math W8A8, the only arithmetic that reads it.
 * input_scale 0: none (moe_layer_set_weight). Anything else gives MOE_STATUS_INVALID_ARGUMENT
 * naming it (a scale that is not finite, not > 0 or outside the FP8 scales' range:
 * MOE_STATUS_NUMERIC_ERROR), checked on every rank whether or not it owns the expert, and
 * nothing is kept. */
moe_status_t moe_layer_set_weight_with_input_scale(moe_layer_t *layer, moe_weight_kind_t kind,
                                                   int expert, const moe_tensor_t *tensor,
                                                   float input_scale);

typedef struct moe_forward_args {
    int64_t num_tokens;         /* this rank's tokens, 0..max_tokens_per_rank */
    moe_dtype_t dtype;          /* of x and y: F32 or BF16 */
    const void *x;              /* [num_tokens, hidden] */
    void *y;                    /* [num_tokens, hidden], may not alias x */
    const float *router_logits; /* optional [num_tokens, num_experts]; NULL: x . ROUTER^T */
    int32_t *topk_ids;          /* optional out [num_tokens, top_k] */
    float *topk_weights;        /* optional out [num_tokens, top_k] */
    void *stream;               /* CUDA backend: cudaStream_t (NULL: legacy default stream) */
    /* Optional (0: max_tokens_per_rank): the largest num_tokens of any rank in this step, the
     * same value on every rank (a serving engine knows it from its batch metadata). With
     * expert parallelism on the CUDA backend the step then moves and computes this many rows
     * per rank instead of the configured capacity. A value that differs among ranks fails the
     * step on every rank with the all-to-all transports (INVALID_ARGUMENT or PEER_FAILURE at
     * synchronize; the next agreed step runs). With lsa that holds whatever rounds the values
     * make (ceil(value / ep_round_tokens), moe_layer_config_t): the ranks compare them in the
     * first round and skip the rest. With p2p it holds only when the values make the same
     * number of rounds; otherwise the ranks' rounds go out of step and a rank's last round
     * waits for a partner that never comes (TIMEOUT at synchronize, bounded by the runtime's
     * timeout); with p2p and MOE_EP_P2P_HEADER=1 (each round's regions move whole, sized by
     * this value) and with allgather it is undefined behaviour of the collectives (bounded by
     * the runtime's timeout). */
    int64_t max_tokens_across_ranks;
    /* Optional routing given by the caller, both or neither (a serving engine that routes by
     * itself; vLLM's fused_experts): given_topk_ids [num_tokens, top_k] int32 global expert ids
     * and given_topk_weights [num_tokens, top_k] f32, in the memory of x. The layer then runs
     * no router (ROUTER, ROUTER_BIAS and router_logits are not needed, and scoring, grouping,
     * renormalize and routed_scaling_factor do not apply): y = sum over j of
     * given_topk_weights[t, j] * expert_{given_topk_ids[t, j]}(x_t) (+ the shared experts), in
     * slot order j as the router's own choice would be summed. An id may repeat within a token
     * (two slots of one expert). Every id must be in 0..num_experts-1 and every weight finite:
     * the CPU backend returns INVALID_ARGUMENT (an id) or NUMERIC_ERROR (a weight) naming the
     * first bad element; the CUDA backend checks on the device (no host synchronisation) and
     * fails the step at moe_layer_synchronize with the same statuses, every rank with EP, the
     * step's y unspecified (bad slots are computed as expert 0 with weight 0, so nothing is
     * read out of bounds). topk_ids / topk_weights, when given, receive a copy. */
    const int32_t *given_topk_ids;
    const float *given_topk_weights;
} moe_forward_args_t;

#define MOE_FORWARD_ARGS_INIT                                                                      \
    {                                                                                              \
        0, MOE_DTYPE_F32, NULL, NULL, NULL, NULL, NULL, NULL, 0, NULL, NULL                        \
    }

/* Collective: every rank calls it once per step (num_tokens may be 0 on any rank). Pointers
 * are host memory for the CPU backend, device memory for the CUDA backend (stream-ordered on
 * `stream`; the call returns without waiting for the GPU in the steady state).
 *
 * One verdict on every rank: a rank whose arguments fail (NULL args or x, num_tokens over
 * max_tokens_per_rank, ...) returns that status at once but still takes part in the step, and
 * the step fails on every rank. CPU backend: every rank's forward returns the first failing
 * rank's status. CUDA backend (the GPU work is asynchronous): the other ranks' forward returns
 * success, the step skips its routed compute on every rank, and every rank's
 * moe_layer_synchronize returns the first failing rank's status; y is unspecified for that
 * step. The same holds for check_inputs (NaN/Inf in x or the router logits: the CUDA backend
 * scans on the device, MOE_STATUS_NUMERIC_ERROR at synchronize). The next step is unaffected.
 *
 * The layers of one runtime share its workspace: their forwards must run one at a time (on one
 * stream, or ordered by events), and the runtime's layers should all be created before a CUDA
 * graph captures a forward (a later, larger layer moves the workspace). */
moe_status_t moe_layer_forward(moe_layer_t *layer, const moe_forward_args_t *args);

/* Waits until the work of the forward calls queued on `stream` has finished on this rank,
 * bounded by the runtime's timeout: a peer that died or hangs gives MOE_STATUS_TIMEOUT (the
 * NCCL communicators are then aborted and the layer is unusable) instead of a hang in
 * cudaStreamSynchronize. Then returns the verdict of the steps since the last synchronize (see
 * moe_layer_forward): a step that failed on any rank fails here on every rank. Not collective.
 * CPU backend: returns at once (forward is synchronous there). */
moe_status_t moe_layer_synchronize(moe_layer_t *layer, void *stream);

/* One line of text on what a step of `num_tokens` tokens on this rank would run and why: the
 * backend, the grouped-GEMM variant of the routed and shared experts with the reason and its
 * source (the built-in table's bucket of rows per expert, "tuned from FILE" (MOE_TUNE_FILE),
 * "forced by MOE_FORCE_VARIANT" or MOE_GEMM_VARIANT, deterministic mode), and the
 * expert-parallel exchange with where its transport came from. Not collective; runs nothing.
 * `text` gets at most `len` bytes, NUL-terminated. */
moe_status_t moe_layer_explain(const moe_layer_t *layer, int64_t num_tokens, char *text,
                               size_t len);

/* Wall-clock time of the last forward's phases on this rank (CPU backend; CUDA backend when
 * MOE_PROFILE=1, synchronising), in microseconds. */
typedef struct moe_layer_stats {
    double route_us, dispatch_us, expert_us, combine_us, shared_us, total_us;
    int64_t rows_received; /* token-expert rows this rank computed in the last forward */
    /* Bytes of the last forward's expert-parallel payload (token rows and their ids/weights
     * out, expert results back) this rank sent to other ranks (CUDA backend with
     * MOE_PROFILE=1; 0 otherwise). */
    int64_t bytes_sent;
} moe_layer_stats_t;

moe_status_t moe_layer_get_stats(const moe_layer_t *layer, moe_layer_stats_t *stats);

/* Rows each global expert received in the last forward (summed over the tokens this rank
 * brought): counts[num_experts]. Not collective. The CUDA backend instead counts the rows
 * this rank's own experts received from all ranks (a logical expert's local replicas summed),
 * and only in forwards run with MOE_PROFILE=1 (reading them needs a host synchronisation);
 * otherwise the counts of the last profiled step stay (zeros at first). Summed over the ranks,
 * both give the global load. moe_layer_get_expert_load_window counts on the device in every
 * forward. */
moe_status_t moe_layer_get_expert_load(const moe_layer_t *layer, int64_t *counts, int n);

/* ------------------------------------------------------------------------------------------ */
/* Expert placement and load balancing (EPLB)                                                  */
/* ------------------------------------------------------------------------------------------ */

/* Plans a placement of num_experts logical experts and num_redundant redundant slots on
 * num_ranks EP ranks from a load per logical expert (rows, or any non-negative weight), by
 * DeepSeek's hierarchical EPLB: groups of num_experts / num_groups experts are packed onto
 * nodes of ranks_per_node ranks by their summed load (0 or 1 group, a group count that does not
 * split evenly over the nodes, or ranks_per_node 0: one level over all ranks); inside a node
 * each redundant slot replicates the expert of the largest load per replica; the replicas, each
 * carrying load / replicas, are packed onto the node's ranks, (E + R) / num_ranks each, heaviest
 * first to the lightest rank with room. Ties go to the lower index, so every rank computes the
 * same map. Writes map[num_experts + num_redundant]: the logical expert of each physical slot,
 * rank-major (rank r holds slots r * S .. r * S + S - 1, S = map_len / num_ranks). num_experts
 * and num_redundant must be multiples of num_ranks. Pure: not collective, no layer needed. */
moe_status_t moe_eplb_plan(const int64_t *load, int num_experts, int num_groups, int num_ranks,
                           int ranks_per_node, int num_redundant, int32_t *map, int map_len);

/* The load each rank of a placement carries when every logical expert's load splits evenly
 * over its replicas: rank_load[num_ranks]. For comparing placements; not collective. */
moe_status_t moe_eplb_rank_loads(const int64_t *load, int num_experts, const int32_t *map,
                                 int map_len, int num_ranks, double *rank_load);

/* Collective over the runtime's ranks, on the host, between steps: every rank passes the same
 * map of n = num_experts + num_redundant_experts physical slots (the logical expert of each,
 * rank-major as moe_eplb_plan writes it; ranks that pass different maps get MOE_STATUS_MISMATCH).
 * Every logical expert must be placed at least once and the slots must split equally over the
 * EP ranks (else INVALID_ARGUMENT naming the value). Each rank then gets the weights of the
 * experts it newly holds from a rank that holds them (MPI on the CPU backend; nothing is read
 * from disk), keeps those it still holds, frees the others, and the next forward routes by the
 * new map. If no expert weight is set yet on any rank, only the map changes (set the weights
 * after it); a layer with some expert weights set and others not is INVALID_STATE. One verdict
 * on every rank. CUDA backend: the weights are staged through host memory and moved by MPI
 * (docs/EPLB.md), after the queued forwards have finished (as for the load window below). */
moe_status_t moe_layer_set_placement(moe_layer_t *layer, const int32_t *map, int n);

/* The placement in force: map[n], n = num_experts + num_redundant_experts. With R = 0 and a
 * num_experts that ep_size does not divide, the default floor split (rank g holds experts
 * E * g / ep_size .. E * (g + 1) / ep_size - 1) is written as the identity map. Not collective. */
moe_status_t moe_layer_get_placement(const moe_layer_t *layer, int32_t *map, int n);

/* Rows each logical expert received in the forwards since the layer was created, last
 * rebalanced or last reset (the load window), summed over the tokens this rank brought:
 * counts[num_experts]. Summed over the ranks it is the global load the rebalance plans from.
 * Counted on the host by the CPU backend, on the device by the CUDA backend (no host
 * synchronisation in the forward; this call waits for the queued forwards: one GPU's device, or
 * across GPUs the last forward's stream, which must still exist, within the timeout); not
 * collective. */
moe_status_t moe_layer_get_expert_load_window(const moe_layer_t *layer, int64_t *counts, int n);

/* Starts a new load window (zeros). Not collective. */
moe_status_t moe_layer_reset_expert_load(moe_layer_t *layer);

/* Collective: sums the ranks' load windows, plans with moe_eplb_plan (the layer's n_group
 * groups, the EP ranks of one host as a node, num_redundant_experts), sets that placement as
 * moe_layer_set_placement does, and starts a new window. A window with no rows keeps the
 * placement. */
moe_status_t moe_layer_rebalance(moe_layer_t *layer);

/* What the last placement change (moe_layer_set_placement or moe_layer_rebalance) did on this
 * rank. */
typedef struct moe_placement_stats {
    int slots_received;     /* slots whose expert this rank got from another rank */
    int slots_copied;       /* slots filled from another local slot (a new local replica) */
    int64_t bytes_received; /* weight bytes received (data and scales) */
    int64_t bytes_sent;     /* weight bytes sent to other ranks */
    double seconds;         /* wall time of the change on this rank (the move and the checks) */
} moe_placement_stats_t;

moe_status_t moe_layer_get_placement_stats(const moe_layer_t *layer, moe_placement_stats_t *stats);

/* Names for printing. */
const char *moe_dtype_name(moe_dtype_t dtype);
size_t moe_dtype_size(moe_dtype_t dtype);
const char *moe_backend_name(moe_backend_t backend);

#ifdef __cplusplus
}
#endif

#endif /* MOE_MOE_H */
