/* SPDX-License-Identifier: Apache-2.0 */
/* The CUDA backend's one-GPU half: the variants a layer may run and the memory planned for
 * them (runtime/cuda/plan.c), the weights' upload (runtime/cuda/weights.c), the placement
 * (runtime/cuda/placement.c) and the stages of a
 * step, route -> permute -> expert GEMMs -> shared MLP -> combine (runtime/cuda/step.c). The
 * expert-parallel half (runtime/cuda/ep.h) builds on this interface; nothing here calls it. */
#ifndef MOE_CUDA_ONE_GPU_H
#define MOE_CUDA_ONE_GPU_H

#include "runtime/cuda/layer.h"

/* plan.c: the workspace pieces and the persistent weights block of one GPU's step (the
 * expert-parallel half adds its own after them, runtime/cuda/ep.h). */
void moe_cuda_plan_workspace(cuda_layer_t *s, carve_t *c);
void moe_cuda_plan_weights(cuda_layer_t *s, carve_t *c);
/* The variant for this step: forced, or the oracle's choice for the expected rows per expert
 * (host-known, so a captured graph replays the same choice). */
const moe_gemm_variant_t *moe_cuda_variant_for(const cuda_layer_t *s, double rows_per_expert);
/* The variant a GEMM of this layer gets at rows_per_expert, and why (moe_layer_explain). */
void moe_cuda_explain_gemm(const cuda_layer_t *s, double rows_per_expert, char *text, size_t len);

/* placement.c: the placement's tables on the device (from plan p: each logical expert's slots,
 * with EP each slot's rank), moe_backend_ops_t.set_placement and the device load window. */
moe_status_t moe_cuda_upload_placement(const moe_plan_t *p, cuda_layer_t *s);
moe_status_t moe_cuda_set_placement(moe_layer_t *l, const int32_t *map, int move_weights,
                                    moe_placement_stats_t *stats);
moe_status_t moe_cuda_load_window(const moe_layer_t *l, int64_t *counts);
moe_status_t moe_cuda_reset_load_window(moe_layer_t *l);

/* weights.c: moe_backend_ops_t.store_weight. */
moe_status_t moe_cuda_store_weight(moe_layer_t *l, moe_weight_kind_t kind, int local,
                                   const moe_matrix_t *m);

/* step.c: the stages. */
moe_status_t moe_cuda_record(const cuda_layer_t *s, int ev, void *stream);
/* The step's routing into ids/w: the router, or the caller's given_topk_ids/weights checked
 * on the device (a bad one sets *flag: INVALID_ARGUMENT for an id, NUMERIC_ERROR for a
 * weight). */
moe_status_t moe_cuda_route(moe_layer_t *l, const moe_forward_args_t *a, int32_t *ids, float *w,
                            int32_t *flag);
/* The router's logical experts of T tokens (ids, [T][k]) -> their replica slots (out): token t
 * is token first_token + t of this rank's forward (docs/SEMANTICS.md, "Replicas"); counts every
 * pair into the device load window. */
moe_status_t moe_cuda_slot_ids(moe_layer_t *l, const int32_t *ids, int64_t T, int64_t first_token,
                               int32_t *out, void *stream);
/* T token rows of x through their experts (ids: local, -1 for none), or with `regions` (else
 * NULL) the all-to-all's receive regions of x and global ids (kernels/permute.h): the permute
 * and the scatter then follow the live rows, not T. */
moe_status_t moe_cuda_routed_experts(cuda_layer_t *s, const void *x, moe_dtype_t x_dtype, int64_t T,
                                     const int32_t *ids, const moe_permute_regions_t *regions,
                                     double rows_per_expert, void *stream);
/* The routed GEMMs on rows already grouped by expert (a, bf16) with the layout in s->counts,
 * s->offsets, s->block_expert, s->num_blocks (at most max_blocks blocks of v's rows). */
moe_status_t moe_cuda_experts_laid_out(cuda_layer_t *s, const moe_gemm_variant_t *v, const void *a,
                                       int max_blocks, double rows_per_expert, void *stream);
moe_status_t moe_cuda_shared_experts(cuda_layer_t *s, const void *x, moe_dtype_t x_dtype, int64_t T,
                                     void *stream);
moe_status_t moe_cuda_shared_gate(moe_layer_t *l, const moe_forward_args_t *a);
moe_status_t moe_cuda_combine(moe_layer_t *l, const moe_forward_args_t *a, const void *rows,
                              const int32_t *row_of_slot, const float *w, const void *shared);
/* The host's wait for a step's work (`obj`: a stream, or an event when is_event): with peers
 * (world > 1) bounded by the device's deadline, the runtime's timeout and 1 s for the step's
 * own work (moe_gpu_stream_wait_bounded), so a peer stopped at any point of an lsa step ends
 * in MOE_STATUS_TIMEOUT on the host even where a device-side wait did not end; one GPU waits
 * for its own work, however long. */
moe_status_t moe_cuda_host_wait(moe_layer_t *l, void *obj, int is_event, const char *what);
/* The profiled step's phase times, and the rows this rank's experts received (accumulate: added
 * to the earlier rounds' times and counts instead of replacing them). Synchronises. */
moe_status_t moe_cuda_finish_profile(moe_layer_t *l, int accumulate, void *stream);
/* check_inputs: NaN/Inf in x or the given router logits sets *flag = NUMERIC_ERROR. */
moe_status_t moe_cuda_scan_inputs(moe_layer_t *l, const moe_forward_args_t *a, int32_t *flag);
/* Whether a step of T tokens (x: its tokens, or NULL) takes the fused decode kernel. */
int moe_cuda_use_decode(const cuda_layer_t *s, int64_t T, const void *x);
/* Whether an EP step of m rows per rank runs the fused decode kernel on the low-latency
 * layout's rows (moe_cuda_decode_laid_out) instead of the grouped GEMMs. */
int moe_cuda_ep_use_decode(const cuda_layer_t *s, int64_t m);
/* The fused decode kernel on rows laid out by the low-latency dispatch (`rows`, bf16), an EP
 * step of m rows per rank: each row through its expert into s->o, as the grouped GEMM 2 writes
 * it (after moe_a2a_ll_layout_launch wrote s->counts and s->offsets). */
moe_status_t moe_cuda_decode_laid_out(const moe_layer_t *l, const void *rows, int64_t m,
                                      void *stream);
/* Whether the fused decode step runs the shared MLP inside the kernel (dec_nsh, and no static
 * activation scale of the shared MLP, which the kernel does not take). */
int moe_cuda_decode_shared_inside(const cuda_layer_t *s);
/* The fused decode kernel's wait bound, ms (runtime/cuda/step.c). */
int moe_cuda_decode_timeout_ms(const moe_layer_t *l);
/* The rows the fused decode step picks its shared MLP's variant for (the same at every batch). */
double moe_cuda_decode_shared_rows(const cuda_layer_t *s);
/* Whether a one-GPU step of T tokens (not the fused decode kernel's) runs the top-k, slot ids
 * and permute as one launch (MOE_ROUTE_PERMUTE=1; a caller's given routing keeps three). */
int moe_cuda_route_permutes(const cuda_layer_t *s, int64_t T, int given_routing);
/* One step on one GPU (world 1, arguments checked, num_tokens > 0). */
moe_status_t moe_cuda_forward_one_gpu(moe_layer_t *l, const moe_forward_args_t *a);

#endif /* MOE_CUDA_ONE_GPU_H */
