/* SPDX-License-Identifier: Apache-2.0 */
/* The CUDA backend's private state: one layer's device data, workspace pieces and expert-parallel
 * fields (cuda_layer_t), and the carving of one allocation into 256-byte-aligned pieces. The
 * one-GPU half (runtime/cuda/one_gpu.h), the expert-parallel half (runtime/cuda/ep.h) and the
 * backend's entry (runtime/cuda/backend.c) include it; it includes neither half. */
#ifndef MOE_CUDA_LAYER_H
#define MOE_CUDA_LAYER_H

#include <stddef.h>
#include <stdint.h>
#include "comm/nccl_comm.h"
#include "kernels/decode.h"
#include "kernels/expert_gemm.h"
#include "kernels/permute.h"
#include "runtime/layer.h"
#include "runtime/oracle.h"

/* Events of a profiled forward (MOE_PROFILE=1): the boundaries of its phases. */
enum { EV_START, EV_ROUTE, EV_PERMUTE, EV_EXPERT, EV_SHARED, EV_COMBINE, EV_COUNT };

typedef struct cuda_layer {
    int device, arch;
    int E, k, H; /* E: this rank's expert slots (n_slots below) */
    int E_total; /* experts of the layer: the router's rows */
    /* The layer's physical slots (E_total + num_redundant_experts; docs/EPLB.md): what dispatch,
     * permute, GEMMs and combine call experts. After routing each (token, logical expert) pair
     * becomes the slot of one replica (moe_ep_slot_ids_launch, slot_ids). */
    int n_slots;
    int64_t is, ss, max_tokens;
    moe_activation_t act;
    const moe_gemm_variant_t *forced; /* MOE_FORCE_VARIANT / MOE_GEMM_VARIANT, or simt_ref where
                                       * no table has this arch; else NULL (oracle per step) */
    const char *forced_env; /* the variable that forced it (NULL: the simt_ref fallback) */
    moe_oracle_t oracle;    /* built-in tables + MOE_TUNE_FILE's for this GPU and shape */
    moe_oracle_query_t oq;  /* this layer's key: arch, dtype, scales, ep, tp, transport */
    moe_oracle_choice_t transport_why; /* world > 1: where s->transport came from */
    /* W8A8 (fp8_math = W8A8, per-tensor or per-channel e4m3 weights, sm_90a): the expert
     * matrices stay e4m3 with one f32 scale per weight row (per-tensor scales expanded), the
     * activations into each GEMM are quantised per row; else FP8 weights are bf16 (W8A16). */
    int f8;

    /* weights and the layer's persistent device data (one allocation) */
    void *wmem;
    void *w13;                        /* bf16 [E][2 is][H]: gate rows then up rows */
    void *w2;                         /* bf16 [E][H][is] */
    float *router;                    /* f32 [E][H] */
    uint16_t *router3;                /* bf16 [3][E][H]: router split hi, mid, lo (tensor cores) */
    int router_planes;                /* 1: mid and lo are zero (a bf16 router), else 3 */
    float *bias;                      /* f32 [E] */
    void *sw13;                       /* bf16 [2 ss][H] */
    void *sw2;                        /* bf16 [H][ss] */
    float *sgate;                     /* f32 [H] */
    float *w13s, *w2s, *sw13s, *sw2s; /* W8A8: [E][2 is], [E][H], [2 ss], [H] row scales */
    /* W8A8 per-row: a gate / up, down, shared gate / up, shared down matrix whose scales differ
     * along its rows was stored (sticky). While 0, each expert's gate, up and down rows have
     * one scale each (per-tensor weights), which the GEMMs may read once a half
     * (moe_gemm_args_t.b_scale_uniform). */
    int scales_vary[4];
    int32_t *iota; /* EP: [tm k], row of slot (t, j) in `mine` */
    float *ones;   /* EP: [tm] */
    /* The placement on the device (runtime/cuda/placement.c): each logical expert's slots
     * replica_slot[replica_begin[e] .. replica_begin[e + 1]), ascending, and the rows each
     * logical expert got from this rank's tokens since the load window began */
    int32_t *replica_begin, *replica_slot; /* [E_total + 1], [n_slots] */
    unsigned long long *load;              /* [E_total] */
    int32_t *sticky; /* host-mapped pinned scalar: the first failed step's (rank << 8) | status
                      * since the last synchronize, written by the device (0: none) */
    /* W8A8 per-row scale layers: static activation scales (a checkpoint's input_scale) of the
     * GEMM1 input (moe_fp8_pair_static_scale of gate's and up's) and the GEMM2 input (down's)
     * per local expert, [E] each, and the shared MLP's, [1] each; 0: dynamic for that expert. */
    float *in13, *in2, *sin13, *sin2;
    float *host_in; /* their source: [E + 1][3] gate, up, down input_scale (row E: shared) */
    int has_in[4];  /* in13, in2, sin13, sin2 hold a scale > 0: else the dynamic path */

    /* Workspace: carved at each forward out of the runtime's one shared buffer (layers of a
     * runtime run one at a time), sized for max_tokens and every selectable variant. */
    size_t ws_bytes;                    /* this layer's need */
    void *ws_base;                      /* the runtime buffer the pointers below were carved from */
    int max_blocks, s_max_blocks;       /* caps over the variants */
    float *logits;                      /* [Tm][E] */
    int32_t *ids;                       /* [Tm][k]: the router's logical experts */
    int32_t *slot_ids;                  /* [Tm][k]: the replica slot of each */
    float *weights;                     /* [Tm][k] */
    int32_t *counts, *offsets;          /* [E], [E + 1] */
    int32_t *block_expert, *num_blocks; /* [max_blocks], [1] */
    int32_t *row_of_slot;               /* [Tm k] */
    int32_t *slot_of_row;               /* [max_rows] */
    int32_t *perm_scratch;              /* the multi-CTA permute's [chunks][E] */
    int64_t perm_scratch_count;
    int32_t *perm_done;           /* persistent [2], a lane's each: its counter, 0 */
    void *a, *h, *o;              /* bf16 [max_rows][H], [max_rows][is], [max_rows][H] */
    void *sa, *sh, *so;           /* bf16 [s_rows][H], [s_rows][ss], [s_rows][H] */
    uint8_t *a8, *h8, *sa8, *sh8; /* W8A8: e4m3 copies of a, h, sa, sh */
    float *as, *hs, *sas, *shs;   /* W8A8: their row scales */
    /* W8A8, h_amax: h's and sh's row (block scales: 1 x 128 group) maxima, taken by GEMM 1's
     * epilogue so that h's quantisation converts in one pass */
    float *hamax, *shamax;
    int32_t *s_block_expert, *s_num_blocks;
    float *s_gate_logit; /* [Tm] */

    /* expert parallelism over NCCL (world > 1): every rank sees every token (all-gather of
     * tm = max_tokens_per_rank padded rows), computes its experts' rows; the rows return
     * summed per rank in f32 by reduce-scatter, or (deterministic) in a dense (token, slot)
     * array with one contributor per entry */
    moe_nccl_t *nccl; /* the runtime's (not owned) */
    int world, first_local;
    int deterministic;
    int scatter_rows; /* MOE_SCATTER_ROWS (default 1): GEMM 1's rows by scatter, not gather */
    int skip_pad; /* MOE_GEMM_SKIP_PAD (default 1): GEMMs get the expert counts (few rows/expert) */
    int h_amax;   /* MOE_QUANT_H_AMAX (default 1): W8A8 GEMM 1 takes h's maxima (same codes) */
    int early_w;  /* MOE_GEMM_EARLY_W (default 0): the GEMMs' moe_gemm_args_t.early_weights */
    int route_permute;   /* MOE_ROUTE_PERMUTE=1 (default 0): one GPU, at most
                            MOE_ROUTE_PERMUTE_MAX_TOKENS tokens: top-k, slot ids and permute in one
                            launch */
    int shared_local;    /* the whole shared MLP here, run on this rank's tokens */
    int64_t cap;         /* max_tokens_per_rank */
    int64_t tm;          /* EP: tokens per rank of one round (ep_round_tokens); one
                          * GPU: cap */
    int64_t step_rows;   /* EP: rows per rank this step (max_tokens_across_ranks or
                          * cap), run in ceil(step_rows / tm) rounds */
    int64_t m;           /* EP: rows per rank this round (<= tm) */
    int64_t round;       /* EP: this round's index in its step */
    int64_t step_tokens; /* EP: this rank's tokens in the whole step (0: its arguments failed) */
    /* MOE_EP_SHARED_OVERLAP=1 (read at init; EP with the whole shared MLP here): the shared
     * MLP runs on the side stream while the main stream moves rows and runs the routed
     * experts; ev_join orders its output before the main stream reads it */
    void *side, *ev_fork, *ev_join;
    int shared_pending;          /* the side stream's shared MLP is not yet joined */
    void *xsend, *xall;          /* bf16 [tm][H], [world tm][H] */
    int32_t *ids_all, *lids;     /* [world tm k] global, local expert ids (-1: not here) */
    void *dense, *mine;          /* summed: f32 [world tm][H], [tm][H];
                                  * deterministic: bf16 [world tm k][H], [tm k][H] */
    void *smine;                 /* bf16 [tm][H]: this rank's tokens' shared output */
    float *w_all;                /* [world tm k] routing weights of every rank's slots */
    int32_t *one_block;          /* [2]: block table of the padded send rows */
    int32_t *flag;               /* [1]: this rank's status code for the step (0: fine) */
    int32_t *flags_all;          /* [world]: every rank's */
    double last_rows_per_expert; /* the hint routed_experts got this step (same variant) */

    /* All-to-all transports (tp_size 1): rows go only to the ranks owning their experts.
     * lsa: the receive arrays live in the runtime's IPC-mapped buffer and peers store into
     * them; p2p: the same kernels on local staging arrays, moved by NCCL send/recv with the
     * counts read on the host. Receive arrays (this rank's): rx bf16 [W tm][H], rids/rw
     * [W tm][k], rtok [W tm], ret (summed f32 [W tm][H]; deterministic bf16 [tm k][H]),
     * rctrl [W][MOE_A2A_CTRL]. */
    int transport; /* MOE_EP_* below */
    int num_sms;
    int32_t *owner;      /* persistent [n_slots]: rank of each slot */
    uint64_t *a2a_chain; /* persistent scratch of the dispatch (zeroed at init) */
    int32_t *a2a_done;   /* persistent [2]: last-CTA counters, 0 between launches */
    int32_t *round_skip; /* persistent scalar: round 0's verdict on the later rounds (lsa;
                          * kernels/a2a.h, moe_a2a_skip_t) */
    size_t off_x, off_ids, off_w, off_tok, off_ret; /* lsa: offsets in the IPC buffer */
    void *rx, *ret;
    int32_t *rids, *rtok, *rctrl;
    float *rw;
    void *sx; /* p2p staging: the same arrays, region d for rank d */
    int32_t *sids, *stok, *sctrl;
    float *sw, *sret;
    /* lsa low-latency layout (MOE_EP_LL=1): a step of at most ll_rows rows per rank stores
     * each (token, slot) row straight into its owner's GEMM-1 input, grouped by expert (no
     * permute, no gather there; kernels/a2a.h, moe_a2a_ll_args_t). In the IPC buffer: the
     * count matrix [W][n_slots], the row of each slot [W ll_rows][k], the GEMM-1 input
     * bf16 [ll_cap][H]. */
    int ll, ll_step;           /* MOE_EP_LL; the last step used it */
    int ll_kernels;            /* MOE_EP_LL_KERNELS (1 or 2), agreed at create */
    int chunk_tokens, ll_ctas; /* MOE_EP_CHUNK_TOKENS, MOE_EP_LL_CTAS (read at init) */
    int32_t *ll_plan;          /* persistent: the two-kernel dispatch's plan (MOE_EP_LL_KERNELS=2;
                                  NULL: one kernel) */
    int64_t ll_rows, ll_cap;
    size_t off_cnt, off_slot, off_lla;
    int32_t *pos;               /* [W][tm]: row of token t in region d, -1 */
    int32_t *sent, *counts_all; /* [W]: rows sent to / received from each rank */
    int32_t *host_io;           /* pinned [4 W]: p2p counts, profile */
    int p2p_header;    /* MOE_EP_P2P_HEADER=1 (p2p): whole regions, counts in-band, no host read */
    void *last_stream; /* a step with no arguments (args = NULL) runs here */
    /* Micro-batches (MOE_EP_MICROBATCH=1, lsa): two lanes of rounds of tm tokens, each with its
     * own workspace half, IPC arrays, control words and sequence number; round i of a step
     * runs on lane i % 2, lane 1 on its own stream, so one round's exchange overlaps the other
     * round's GEMMs. lane: this view's (lane 1's view is a copy made at each step). */
    int lanes, lane;
    int gemm_max_ctas;  /* the persistent GEMMs' most CTAs (0: one per SM; lanes: fewer) */
    int finish_wait;    /* MOE_EP_FINISH_WAIT=1: the finish after a one-CTA wait (lanes: always) */
    size_t off_ctrl;    /* lsa: this lane's control words in the IPC buffer */
    size_t sym_end;     /* lsa: the end of lane 0's arrays (lane 1's start there) */
    void *lane_stream;  /* lane 1's stream */
    void *ev_lane_fork; /* the caller's stream before the step: lane 1 starts after it */
    void *ev_lane_skip; /* round 0's wait (its round_skip word): lane 1 reads it */
    void *ev_lane_join; /* lane 1's last round: the caller's stream goes on after it */

    /* The fused small-batch decode kernel (kernels/decode.h): one GPU, bf16 or per-row W8A8, not
     * deterministic. dec_max: the most tokens a step runs it at (0: never); dec_forced: 1
     * MOE_FORCE_VARIANT=sm90_fused_decode, -1 another variant forced, 0 the oracle's crossover
     * (dec_tuned: from the tune file's decode table, else the built-in one).
     * Its workspace holds dec_tokens tokens; dec_sync is persistent (zero between steps).
     * dec_split, dec_split1: GEMM 2's and GEMM 1's k splits (dec_o1: GEMM 1's pieces).
     * dec_nsh: the shared MLP runs inside the kernel as dec_nsh experts of the routed width
     * (MOE_DECODE_SHARED=1; 0: on the grouped path before it); its workspace and split count
     * them (slots of k + dec_nsh a token). */
    int dec_ok, dec_max, dec_forced, dec_tuned, dec_tokens, dec_split, dec_split1, dec_nsh;
    void *dec_h;
    float *dec_o, *dec_o1, *dec_xs;
    uint8_t *dec_xq;
    int32_t *dec_sync;

    int profile;
    void *ev[EV_COUNT];
    int32_t *host_counts; /* [E], profiling only */
} cuda_layer_t;

enum { MOE_EP_ALLGATHER = 0, MOE_EP_LSA = 1, MOE_EP_P2P = 2 };

/* Carves consecutive 256-byte-aligned pieces out of one allocation (base NULL: sizing pass). */
typedef struct carve {
    char *base;
    size_t off;
} carve_t;

static inline size_t align_up(size_t x)
{
    return (x + 255) & ~(size_t)255;
}

static inline void *moe_cuda_take(carve_t *c, size_t bytes)
{
    void *p = c->base ? c->base + c->off : NULL;
    c->off += align_up(bytes);
    return p;
}

/* ints of the fused decode kernel's sync array (dec_sync) */
static inline size_t moe_cuda_decode_sync_count(const cuda_layer_t *s)
{
    const int n = s->dec_nsh; /* the shared MLP's: one more maximum a token */
    return moe_decode_sync_count(s->E + n, s->H, (int)s->is, s->dec_split1,
                                 s->dec_tokens * (s->k + n + (n > 0)));
}

/* slots a token in the fused decode kernel's workspace: top_k, and the shared MLP's chunks */
static inline int64_t moe_cuda_decode_slots(const cuda_layer_t *s)
{
    return s->k + s->dec_nsh;
}

/* The GEMMs' scale kind: none (bf16), per row (W8A8 per-tensor / per-channel weights, their
 * scales expanded per row) or 128 x 128 blocks with 1 x 128 activation groups. */
static inline moe_scale_kind_t f8_scale_kind(const cuda_layer_t *s)
{
    return s->f8 == 2 ? MOE_SCALE_BLOCK_128 : s->f8 ? MOE_SCALE_PER_CHANNEL : MOE_SCALE_NONE;
}

/* 128-wide k slices of a row of `k` with block scales, else 1 (one scale per row). */
static inline size_t f8_groups(const cuda_layer_t *s, int64_t k)
{
    return s->f8 == 2 ? (size_t)((k + 127) / 128) : 1;
}

#endif /* MOE_CUDA_LAYER_H */
