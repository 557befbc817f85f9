/* SPDX-License-Identifier: Apache-2.0 */
/* Bootstrap and CPU transport over MPI: communicators and collectives bounded by a timeout. */
#ifndef MOE_COMM_H
#define MOE_COMM_H

#include <stddef.h>
#include <stdint.h>
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct moe_comm moe_comm_t;

typedef enum { MOE_REDUCE_SUM = 0, MOE_REDUCE_MIN = 1, MOE_REDUCE_MAX = 2 } moe_reduce_op_t;

/* Collective. Duplicates *(MPI_Comm *)mpi_comm (NULL: MPI_COMM_WORLD); initialises MPI if no
 * one has (then *owns_mpi = 1). Every wait is bounded by timeout_ms. */
moe_status_t moe_comm_create(const void *mpi_comm, int timeout_ms, moe_comm_t **comm,
                             int *owns_mpi);
/* Collective, bounded: this rank's index among the ranks on its host, and their number
 * (ranks with the same host name). */
moe_status_t moe_comm_node_rank(moe_comm_t *comm, int *local_rank, int *local_size);
void moe_comm_destroy(moe_comm_t *comm);
/* Finalises MPI if libmoe initialised it. */
void moe_comm_finalize_mpi(int owns_mpi);

int moe_comm_rank(const moe_comm_t *comm);
int moe_comm_size(const moe_comm_t *comm);
/* The MPI_Comm, as a pointer to it (for the NCCL bootstrap). */
const void *moe_comm_mpi_handle(const moe_comm_t *comm);

/* Bounded collectives: a peer that does not join within the timeout gives
 * MOE_STATUS_TIMEOUT (the communicator is then unusable: later calls fail fast). */
moe_status_t moe_comm_barrier(moe_comm_t *comm);
moe_status_t moe_comm_bcast(moe_comm_t *comm, void *buf, size_t bytes, int root);
moe_status_t moe_comm_allreduce_i64(moe_comm_t *comm, int64_t *vals, int n, moe_reduce_op_t op);
/* send[i] to rank i, recv[i] from rank i (one int64 each). */
moe_status_t moe_comm_alltoall_i64(moe_comm_t *comm, const int64_t *send, int64_t *recv);
/* Element counts and displacements (in elements of elem_bytes each) per rank. */
moe_status_t moe_comm_alltoallv(moe_comm_t *comm, const void *send, const int64_t *send_counts,
                                const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                const int64_t *recv_displs, size_t elem_bytes);
moe_status_t moe_comm_allgatherv(moe_comm_t *comm, const void *send, int64_t send_count, void *recv,
                                 const int64_t *recv_counts, const int64_t *recv_displs,
                                 size_t elem_bytes);
/* Sum over ranks of send[total], rank i keeps recv_counts[i] floats (MPI's order of summing). */
moe_status_t moe_comm_reduce_scatter_f32(moe_comm_t *comm, const float *send, float *recv,
                                         const int64_t *recv_counts);
/* One point-to-point message of an exchange: `bytes` at `buf` to or from rank `peer`. */
typedef struct moe_comm_msg {
    int peer;
    void *buf;
    size_t bytes;
} moe_comm_msg_t;

/* Posts every receive, then every send, and waits for all of them within the timeout. Not a
 * collective of the whole communicator: each pair of ranks must list the messages between them
 * in the same order on both sides (MPI matches them in that order). Unlike the collectives it
 * reads and writes the caller's buffers directly (the weights it moves are large); after a
 * failure (TIMEOUT, MPI_ERROR) the communicator is unusable and MPI may still read or write
 * those buffers, so the caller must never free or reuse them. Messages over 1 GiB go in
 * pieces. */
moe_status_t moe_comm_exchange(moe_comm_t *comm, const moe_comm_msg_t *sends, int num_sends,
                               const moe_comm_msg_t *recvs, int num_recvs);

/* All ranks agree that every rank's `status` is SUCCESS; else each returns the first failing
 * rank's status as MOE_STATUS_PEER_FAILURE (or its own). Used to end collective calls
 * with one verdict on all ranks. */
moe_status_t moe_comm_agree(moe_comm_t *comm, moe_status_t status);
/* The same agreement and, in the same all-reduce, *value = the largest *value over the ranks
 * (>= 0 each; left as it is unless every rank succeeded). */
moe_status_t moe_comm_agree_max(moe_comm_t *comm, moe_status_t status, int64_t *value);

#ifdef __cplusplus
}
#endif

#endif /* MOE_COMM_H */
