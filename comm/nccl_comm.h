/* SPDX-License-Identifier: Apache-2.0 */
/* NCCL transport for the CUDA backend, bootstrapped over MPI. CUDA/NCCL-free header: streams
 * cross as void *. Every operation is stream-ordered; moe_nccl_wait bounds the wait for the
 * peers (async errors polled, the communicator aborted on a timeout). */
#ifndef MOE_NCCL_COMM_H
#define MOE_NCCL_COMM_H

#include <stddef.h>
#include <stdint.h>
#include "comm/comm.h"
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_nccl moe_nccl_t;

typedef enum { MOE_NCCL_WORLD = 0, MOE_NCCL_EP = 1, MOE_NCCL_TP = 2 } moe_nccl_group_t;

/* Collective over `mpi`: one NCCL communicator for the world (rank order of `mpi`), split
 * into EP groups (same tp_rank) and TP groups (same ep_rank), rank = ep_rank * tp + tp_rank.
 * The current CUDA device must be set. Bounded by timeout_ms. */
moe_status_t moe_nccl_create(moe_comm_t *mpi, int ep_size, int tp_size, int timeout_ms,
                             moe_nccl_t **nccl);
void moe_nccl_destroy(moe_nccl_t *nccl);
int moe_nccl_size(const moe_nccl_t *nccl, moe_nccl_group_t group);
int moe_nccl_rank(const moe_nccl_t *nccl, moe_nccl_group_t group);
/* NCCL's version as major*10000+minor*100+patch. */
int moe_nccl_version(void);

/* Grouped send/recv: to peer p send_bytes[p] bytes at send + send_off[p]; from peer p
 * recv_bytes[p] at recv + recv_off[p] (host-known sizes). */
moe_status_t moe_nccl_all_to_all_v(moe_nccl_t *nccl, moe_nccl_group_t group, const void *send,
                                   const size_t *send_bytes, const size_t *send_off, void *recv,
                                   const size_t *recv_bytes, const size_t *recv_off, void *stream);
/* Same bytes to and from every peer (slot p of `bytes` each). */
moe_status_t moe_nccl_all_to_all(moe_nccl_t *nccl, moe_nccl_group_t group, const void *send,
                                 void *recv, size_t bytes, void *stream);
moe_status_t moe_nccl_all_gather(moe_nccl_t *nccl, moe_nccl_group_t group, const void *send,
                                 void *recv, size_t bytes, void *stream);
/* Sum of count elements of dtype (F32 or BF16) per rank slot. */
moe_status_t moe_nccl_reduce_scatter(moe_nccl_t *nccl, moe_nccl_group_t group, const void *send,
                                     void *recv, size_t count, moe_dtype_t dtype, void *stream);
moe_status_t moe_nccl_all_reduce(moe_nccl_t *nccl, moe_nccl_group_t group, const void *send,
                                 void *recv, size_t count, moe_dtype_t dtype, void *stream);

/* Brackets several calls above into one NCCL group (one launch). */
moe_status_t moe_nccl_group_start(void);
moe_status_t moe_nccl_group_end(moe_nccl_t *nccl);

/* Waits until `stream` has finished, at most the timeout; polls the communicators' async
 * errors. On a timeout or a NCCL error the communicators are aborted (unusable afterwards):
 * MOE_STATUS_TIMEOUT / MOE_STATUS_NCCL_ERROR. */
moe_status_t moe_nccl_wait(moe_nccl_t *nccl, void *stream);
/* Non-blocking check of the communicators' async errors. */
moe_status_t moe_nccl_check(moe_nccl_t *nccl);

#ifdef __cplusplus
}
#endif

#endif /* MOE_NCCL_COMM_H */
