/* SPDX-License-Identifier: Apache-2.0 */
/* NCCL transport for the CUDA backend, bootstrapped over MPI: one communicator over the world.
 * CUDA/NCCL-free header: streams cross as void *. Every operation is stream-ordered;
 * moe_nccl_wait bounds the wait for the peers (async errors polled, the communicator aborted
 * on a timeout), and create and destroy are bounded by the same timeout. */
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

/* Collective over `mpi`: one NCCL communicator in the rank order of `mpi`. The current CUDA
 * device must be set. Bounded by timeout_ms: a peer that never joins gives MOE_STATUS_TIMEOUT
 * (the init thread is then left behind and aborts its communicator if it ever returns). */
moe_status_t moe_nccl_create(moe_comm_t *mpi, int timeout_ms, moe_nccl_t **nccl);
/* Finalizes (bounded by the timeout, else aborts) and frees. NULL is fine. */
void moe_nccl_destroy(moe_nccl_t *nccl);
/* NCCL's version as major*10000+minor*100+patch. */
int moe_nccl_version(void);

moe_status_t moe_nccl_all_gather(moe_nccl_t *nccl, const void *send, void *recv, size_t bytes,
                                 void *stream);
/* Sum of count elements of dtype (F32 or BF16) per rank slot. */
moe_status_t moe_nccl_reduce_scatter(moe_nccl_t *nccl, const void *send, void *recv, size_t count,
                                     moe_dtype_t dtype, void *stream);

/* Point to point, inside a group with the matching calls of the peer. */
moe_status_t moe_nccl_send(moe_nccl_t *nccl, const void *buf, size_t bytes, int peer, void *stream);
moe_status_t moe_nccl_recv(moe_nccl_t *nccl, void *buf, size_t bytes, int peer, void *stream);

/* Brackets several calls above into one NCCL group (one launch). */
moe_status_t moe_nccl_group_start(void);
moe_status_t moe_nccl_group_end(moe_nccl_t *nccl);

/* Waits until `stream` has finished, at most the timeout; polls the communicator's async
 * error. On a timeout or a NCCL error the communicator is aborted (unusable afterwards):
 * MOE_STATUS_TIMEOUT / MOE_STATUS_NCCL_ERROR. */
moe_status_t moe_nccl_wait(moe_nccl_t *nccl, void *stream);
/* Non-blocking check of the communicator's async error. */
moe_status_t moe_nccl_check(moe_nccl_t *nccl);

#ifdef __cplusplus
}
#endif

#endif /* MOE_NCCL_COMM_H */
