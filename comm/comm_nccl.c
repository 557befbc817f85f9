/* SPDX-License-Identifier: Apache-2.0 */
/* NCCL communicators from an MPI bootstrap (unique id broadcast, then ncclCommSplit for EP and
 * TP), stream-ordered collectives, and bounded waits with abort. Communicators are blocking:
 * the non-blocking mode hands every operation to a helper thread that the caller then has to
 * poll, which cost ~70 us per NCCL call on two H200s (measured: dispatch of one token took
 * 197 us). Init is bounded by agreeing over MPI first (every rank has the id and is alive);
 * a step stuck on a dead peer is bounded by moe_nccl_wait (async errors, then abort). */
#include "comm/nccl_comm.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "runtime/diag.h"

struct moe_nccl {
    ncclComm_t comm[3]; /* world, EP, TP */
    int timeout_ms;
    int aborted;
};

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void nap(long spins)
{
    struct timespec ts = {0, spins > 1000 ? 200000L : 20000L};
    nanosleep(&ts, NULL);
}

static moe_status_t nccl_error(ncclResult_t r, const char *what)
{
    return moe_error(MOE_STATUS_NCCL_ERROR, "%s: %s (%s)", what, ncclGetErrorString(r),
                     ncclGetLastError(NULL));
}

static void abort_all(moe_nccl_t *n)
{
    int i;
    for (i = 0; i < 3; i++)
        if (n->comm[i])
            ncclCommAbort(n->comm[i]);
    memset(n->comm, 0, sizeof(n->comm));
    n->aborted = 1;
}

/* Waits while `c` reports ncclInProgress (non-blocking init or group), bounded. */
static moe_status_t settle(moe_nccl_t *n, ncclComm_t c, const char *what)
{
    const double deadline = now_ms() + n->timeout_ms;
    ncclResult_t r = ncclInProgress, a;
    long spins = 0;
    while (r == ncclInProgress) {
        a = ncclCommGetAsyncError(c, &r);
        if (a != ncclSuccess)
            return nccl_error(a, what);
        if (r == ncclInProgress) {
            /* Sleep between polls: busy polling was measured 3-6x slower per step on two
             * H200s (it competes with NCCL's own progress threads). */
            if (now_ms() > deadline) {
                abort_all(n);
                return moe_error(MOE_STATUS_TIMEOUT,
                                 "%s: NCCL did not finish within %d ms; communicators aborted",
                                 what, n->timeout_ms);
            }
            nap(++spins);
        }
    }
    return r == ncclSuccess ? MOE_STATUS_SUCCESS : nccl_error(r, what);
}

static moe_status_t usable(const moe_nccl_t *n, const char *what)
{
    if (!n->aborted && (!n->comm[0]))
        return moe_error(MOE_STATUS_INVALID_STATE, "%s: no NCCL communicator", what);
    if (n->aborted)
        return moe_error(MOE_STATUS_INVALID_STATE,
                         "%s: NCCL communicators were aborted after an earlier failure", what);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t split(moe_nccl_t *n, int color, int key, int idx, const char *what)
{
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    ncclResult_t r;
    cfg.blocking = 1;
    r = ncclCommSplit(n->comm[0], color, key, &n->comm[idx], &cfg);
    if (r != ncclSuccess && r != ncclInProgress)
        return nccl_error(r, what);
    if (!n->comm[idx])
        return moe_error(MOE_STATUS_NCCL_ERROR, "%s returned no communicator", what);
    return settle(n, n->comm[idx], what);
}

moe_status_t moe_nccl_create(moe_comm_t *mpi, int ep_size, int tp_size, int timeout_ms,
                             moe_nccl_t **out)
{
    const int rank = moe_comm_rank(mpi), world = moe_comm_size(mpi);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    ncclUniqueId id;
    moe_nccl_t *n;
    moe_status_t st;
    ncclResult_t r;

    *out = NULL;
    if (ep_size * tp_size != world)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "nccl: ep %d x tp %d != world %d", ep_size,
                         tp_size, world);
    n = calloc(1, sizeof(*n));
    if (!n)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "nccl state");
    n->timeout_ms = timeout_ms;
    memset(&id, 0, sizeof(id));
    st = MOE_STATUS_SUCCESS;
    if (rank == 0 && (r = ncclGetUniqueId(&id)) != ncclSuccess)
        st = nccl_error(r, "ncclGetUniqueId");
    /* rank 0's failure must reach the others before they wait for its id */
    st = moe_comm_agree(mpi, st);
    if (st != MOE_STATUS_SUCCESS)
        goto fail;
    MOE_CHECK_GOTO(moe_comm_bcast(mpi, &id, sizeof(id), 0), st, fail);
    MOE_CHECK_GOTO(moe_comm_barrier(mpi), st, fail);
    cfg.blocking = 1;
    r = ncclCommInitRankConfig(&n->comm[0], world, id, rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        st = nccl_error(r, "ncclCommInitRankConfig");
        goto fail;
    }
    MOE_CHECK_GOTO(settle(n, n->comm[0], "ncclCommInitRank"), st, fail);
    /* EP and TP groups only when they differ from the world (the GPU path moves tokens over
     * the world communicator today). */
    if (ep_size > 1 && tp_size > 1) {
        MOE_CHECK_GOTO(split(n, rank % tp_size, rank, 1, "ncclCommSplit (EP)"), st, fail);
        MOE_CHECK_GOTO(split(n, rank / tp_size, rank, 2, "ncclCommSplit (TP)"), st, fail);
    }
    *out = n;
    return MOE_STATUS_SUCCESS;
fail:
    moe_nccl_destroy(n);
    return st;
}

void moe_nccl_destroy(moe_nccl_t *n)
{
    int i;
    if (!n)
        return;
    for (i = 2; i >= 0; i--)
        if (n->comm[i]) {
            /* Finalize flushes pending work and may wait on peers: bounded, else abort. */
            ncclResult_t s = ncclCommFinalize(n->comm[i]);
            double deadline = now_ms() + n->timeout_ms;
            while (s == ncclInProgress || s == ncclSuccess) {
                if (ncclCommGetAsyncError(n->comm[i], &s) != ncclSuccess || s != ncclInProgress)
                    break;
                if (now_ms() > deadline)
                    break;
                nap(2000);
            }
            if (s == ncclSuccess)
                ncclCommDestroy(n->comm[i]);
            else
                ncclCommAbort(n->comm[i]);
        }
    free(n);
}

/* A group's communicator; EP/TP fall back to the world one when no split was made. */
static ncclComm_t group_comm(const moe_nccl_t *n, moe_nccl_group_t g)
{
    return n->comm[g] ? n->comm[g] : n->comm[0];
}

int moe_nccl_size(const moe_nccl_t *n, moe_nccl_group_t g)
{
    int s = 0;
    if (n && group_comm(n, g))
        ncclCommCount(group_comm(n, g), &s);
    return s;
}

int moe_nccl_rank(const moe_nccl_t *n, moe_nccl_group_t g)
{
    int r = -1;
    if (n && group_comm(n, g))
        ncclCommUserRank(group_comm(n, g), &r);
    return r;
}

int moe_nccl_version(void)
{
    int v = 0;
    ncclGetVersion(&v);
    return v;
}

static ncclDataType_t nccl_type(moe_dtype_t d)
{
    return d == MOE_DTYPE_BF16 ? ncclBfloat16 : d == MOE_DTYPE_F16 ? ncclFloat16 : ncclFloat32;
}

/* Ends a group: in non-blocking mode it may return ncclInProgress; wait (bounded). */
static moe_status_t group_end(moe_nccl_t *n, ncclComm_t c, const char *what)
{
    ncclResult_t r = ncclGroupEnd();
    if (r == ncclInProgress)
        return settle(n, c, what);
    return r == ncclSuccess ? MOE_STATUS_SUCCESS : nccl_error(r, what);
}

static moe_status_t issued(moe_nccl_t *n, ncclComm_t c, ncclResult_t r, const char *what)
{
    if (r == ncclInProgress)
        return settle(n, c, what);
    return r == ncclSuccess ? MOE_STATUS_SUCCESS : nccl_error(r, what);
}

moe_status_t moe_nccl_all_to_all_v(moe_nccl_t *n, moe_nccl_group_t g, const void *send,
                                   const size_t *send_bytes, const size_t *send_off, void *recv,
                                   const size_t *recv_bytes, const size_t *recv_off, void *stream)
{
    ncclComm_t c;
    int p, size;
    ncclResult_t r = ncclSuccess;
    MOE_CHECK(usable(n, "all-to-all"));
    c = group_comm(n, g);
    size = moe_nccl_size(n, g);
    ncclGroupStart();
    for (p = 0; p < size && r == ncclSuccess; p++) {
        if (send_bytes[p])
            r = ncclSend((const char *)send + send_off[p], send_bytes[p], ncclUint8, p, c,
                         (cudaStream_t)stream);
        if (r == ncclSuccess && recv_bytes[p])
            r = ncclRecv((char *)recv + recv_off[p], recv_bytes[p], ncclUint8, p, c,
                         (cudaStream_t)stream);
    }
    if (r != ncclSuccess && r != ncclInProgress) {
        ncclGroupEnd();
        return nccl_error(r, "ncclSend/ncclRecv");
    }
    return group_end(n, c, "all-to-all (grouped send/recv)");
}

moe_status_t moe_nccl_all_to_all(moe_nccl_t *n, moe_nccl_group_t g, const void *send, void *recv,
                                 size_t bytes, void *stream)
{
    size_t *b;
    moe_status_t st;
    int p, size;
    MOE_CHECK(usable(n, "all-to-all"));
    size = moe_nccl_size(n, g);
    b = malloc(sizeof(size_t) * 2 * (size_t)size);
    if (!b)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "all-to-all sizes");
    for (p = 0; p < size; p++) {
        b[p] = bytes;
        b[size + p] = bytes * (size_t)p;
    }
    st = moe_nccl_all_to_all_v(n, g, send, b, b + size, recv, b, b + size, stream);
    free(b);
    return st;
}

moe_status_t moe_nccl_all_gather(moe_nccl_t *n, moe_nccl_group_t g, const void *send, void *recv,
                                 size_t bytes, void *stream)
{
    MOE_CHECK(usable(n, "all-gather"));
    return issued(
        n, group_comm(n, g),
        ncclAllGather(send, recv, bytes, ncclUint8, group_comm(n, g), (cudaStream_t)stream),
        "ncclAllGather");
}

moe_status_t moe_nccl_reduce_scatter(moe_nccl_t *n, moe_nccl_group_t g, const void *send,
                                     void *recv, size_t count, moe_dtype_t dtype, void *stream)
{
    MOE_CHECK(usable(n, "reduce-scatter"));
    return issued(n, group_comm(n, g),
                  ncclReduceScatter(send, recv, count, nccl_type(dtype), ncclSum, group_comm(n, g),
                                    (cudaStream_t)stream),
                  "ncclReduceScatter");
}

moe_status_t moe_nccl_all_reduce(moe_nccl_t *n, moe_nccl_group_t g, const void *send, void *recv,
                                 size_t count, moe_dtype_t dtype, void *stream)
{
    MOE_CHECK(usable(n, "all-reduce"));
    return issued(n, group_comm(n, g),
                  ncclAllReduce(send, recv, count, nccl_type(dtype), ncclSum, group_comm(n, g),
                                (cudaStream_t)stream),
                  "ncclAllReduce");
}

moe_status_t moe_nccl_group_start(void)
{
    ncclResult_t r = ncclGroupStart();
    return r == ncclSuccess ? MOE_STATUS_SUCCESS : nccl_error(r, "ncclGroupStart");
}

moe_status_t moe_nccl_group_end(moe_nccl_t *n)
{
    MOE_CHECK(usable(n, "group"));
    return group_end(n, n->comm[0], "ncclGroupEnd");
}

moe_status_t moe_nccl_check(moe_nccl_t *n)
{
    int i;
    MOE_CHECK(usable(n, "check"));
    for (i = 0; i < 3; i++) {
        ncclResult_t s = ncclSuccess;
        if (!n->comm[i])
            continue;
        if (ncclCommGetAsyncError(n->comm[i], &s) != ncclSuccess ||
            (s != ncclSuccess && s != ncclInProgress)) {
            moe_status_t st = nccl_error(s, "NCCL async error");
            abort_all(n);
            return st;
        }
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_nccl_wait(moe_nccl_t *n, void *stream)
{
    const double deadline = now_ms() + n->timeout_ms;
    long spins = 0;
    for (;;) {
        cudaError_t e = cudaStreamQuery((cudaStream_t)stream);
        if (e == cudaSuccess)
            return MOE_STATUS_SUCCESS;
        if (e != cudaErrorNotReady)
            return moe_error(MOE_STATUS_CUDA_ERROR, "cudaStreamQuery: %s", cudaGetErrorString(e));
        MOE_CHECK(moe_nccl_check(n));
        if (now_ms() > deadline) {
            abort_all(n);
            return moe_error(MOE_STATUS_TIMEOUT,
                             "GPU step did not finish within %d ms (a peer is stuck or dead); "
                             "NCCL communicators aborted",
                             n->timeout_ms);
        }
        if (++spins > 100)
            nap(spins);
    }
}
