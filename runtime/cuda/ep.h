/* SPDX-License-Identifier: Apache-2.0 */
/* The CUDA backend's expert-parallel half (world > 1), used by the backend's entry
 * (runtime/cuda/backend.c); it builds on the one-GPU half (runtime/cuda/one_gpu.h). Three
 * transports for the tokens and the results:
 *  - allgather (NCCL): every rank gets every rank's tokens (padded to the step's rows per
 *    rank), computes its experts' rows; they return summed per rank in f32 by reduce-scatter,
 *    or in the dense exact layout in deterministic mode. TP layouts use it.
 *  - lsa (CUDA IPC, NVLink loads/stores, one host): kernels/a2a.h stores each token row only
 *    into the receive arrays of the ranks owning its experts, with device-side counts, signals
 *    and bounded waits: nothing waits on the host, so a step can be captured in a graph.
 *  - p2p (NCCL send/recv, any hosts): the same kernels into local staging arrays; the counts
 *    are read on the host (one bounded synchronisation per step, not capturable), then NCCL
 *    moves exactly the rows sent; or (MOE_EP_P2P_HEADER=1) the counts travel in-band with
 *    each round's whole regions (no host read, capturable, bytes follow the round's rows).
 * Each step carries every rank's status, so every rank fails the same step together. */
#ifndef MOE_CUDA_EP_H
#define MOE_CUDA_EP_H

#include "runtime/cuda/layer.h"

/* ep_workspace.c: the whole workspace / persistent allocation of an EP layer: the one-GPU
 * half's pieces (moe_cuda_plan_workspace / moe_cuda_plan_weights), then the exchange's. */
void moe_cuda_ep_plan_workspace(cuda_layer_t *s, carve_t *c);
void moe_cuda_ep_plan_persistent(cuda_layer_t *s, carve_t *c);
/* ep_transport.c. Before the workspace is planned (collective): the transport (MOE_EP_TRANSPORT,
 * else from cfg.dispatch and the hardware), agreed by every rank. */
moe_status_t moe_cuda_ep_choose(moe_layer_t *l, cuda_layer_t *s);
/* ep_workspace.c: the exchange's buffers, streams and (lsa) the runtime's IPC buffer. */
moe_status_t moe_cuda_ep_init(moe_layer_t *l, cuda_layer_t *s);
void moe_cuda_ep_fini(cuda_layer_t *s);
/* ep_step.c. synchronize saw the all-to-all time out waiting for `rank`: later steps are refused.
 */
void moe_cuda_ep_timed_out(moe_layer_t *l, int rank);
const char *moe_cuda_ep_transport_name(int transport);
/* The expert-parallel exchange, and where its transport came from (moe_layer_explain). */
void moe_cuda_ep_explain(const cuda_layer_t *s, char *text, size_t len);
/* One step across the ranks. `local` is this rank's argument verdict: on failure the rank
 * still joins every collective (with no tokens), its flag makes every rank skip the routed
 * compute, and every rank's synchronize returns the status. */
moe_status_t moe_cuda_ep_forward(moe_layer_t *l, const moe_forward_args_t *a, moe_status_t local);

#endif /* MOE_CUDA_EP_H */
