/* SPDX-License-Identifier: Apache-2.0 */
/* One NCCL communicator from an MPI bootstrap (unique id broadcast), stream-ordered
 * collectives, and bounded waits with abort.
 *
 * The communicator is blocking: the non-blocking mode hands every operation to a helper thread
 * that the caller then has to poll, which cost ~70 us per NCCL call on two H200s (measured:
 * dispatch of one token took 197 us). So the calls that wait on peers are bounded another way:
 *   - init runs on a helper thread while the caller waits at most timeout_ms (a peer that never
 *     joins leaves that thread behind; it aborts its communicator if init ever returns);
 *   - finalize runs on the caller's thread with a watchdog thread that aborts the communicator
 *     at the deadline (ncclCommAbort from another thread is NCCL's way to end a blocked call);
 *   - a step stuck on a dead peer is bounded by moe_nccl_wait (async errors, then abort). */
#include "comm/nccl_comm.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/diag.h"

struct moe_nccl {
    ncclComm_t comm;
    int timeout_ms;
    int aborted;
};

static void nap(long spins)
{
    struct timespec ts = {0, spins > 1000 ? 200000L : 20000L};
    nanosleep(&ts, NULL);
}

static moe_status_t nccl_error(ncclResult_t r, const char *what)
{
    const char *last = ncclGetLastError(NULL);
    /* NCCL refuses two ranks on one GPU of one host (one rank per GPU; for tests on a one-GPU
     * machine, a host id per rank: README, bench/shared_gpu_rank.sh) */
    const int dup = last && strstr(last, "Duplicate GPU") != NULL;
    return moe_error(
        MOE_STATUS_NCCL_ERROR, "%s: %s (%s)%s", what, ncclGetErrorString(r), last ? last : "",
        dup ? "; NCCL needs one rank per GPU: launch as many ranks per host as it "
              "has GPUs (to test on one GPU, give each rank its own NCCL_HOSTID, as "
              "bench/shared_gpu_rank.sh does), or, for EP alone, the lsa transport, which "
              "needs no NCCL"
            : "");
}

static void abort_comm(moe_nccl_t *n)
{
    if (n->comm)
        ncclCommAbort(n->comm);
    n->comm = NULL;
    n->aborted = 1;
}

static moe_status_t usable(const moe_nccl_t *n, const char *what)
{
    if (n->aborted)
        return moe_error(MOE_STATUS_INVALID_STATE,
                         "%s: the NCCL communicator was aborted after an earlier failure", what);
    if (!n->comm)
        return moe_error(MOE_STATUS_INVALID_STATE, "%s: no NCCL communicator", what);
    return MOE_STATUS_SUCCESS;
}

/* ---- bounded init: a helper thread runs the blocking init -------------------------------- */

typedef struct init_job {
    pthread_mutex_t mu;
    ncclUniqueId id;
    int world, rank, device;
    ncclComm_t comm;
    ncclResult_t result;
    int done;      /* init returned */
    int abandoned; /* the caller gave up: the thread cleans up */
} init_job_t;

static void job_free(init_job_t *j)
{
    pthread_mutex_destroy(&j->mu);
    free(j);
}

static void *init_thread(void *arg)
{
    init_job_t *j = arg;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    ncclComm_t comm = NULL;
    ncclResult_t r;
    int abandoned;
    cfg.blocking = 1;
    r = cudaSetDevice(j->device) == cudaSuccess
            ? ncclCommInitRankConfig(&comm, j->world, j->id, j->rank, &cfg)
            : ncclUnhandledCudaError;
    pthread_mutex_lock(&j->mu);
    j->comm = comm;
    j->result = r;
    j->done = 1;
    abandoned = j->abandoned;
    pthread_mutex_unlock(&j->mu);
    if (abandoned) {
        if (comm)
            ncclCommAbort(comm);
        job_free(j);
    }
    return NULL;
}

/* Runs the blocking init on a detached thread, waiting at most timeout_ms for it. */
static moe_status_t bounded_init(moe_nccl_t *n, const ncclUniqueId *id, int world, int rank)
{
    const double deadline = moe_now_ms() + n->timeout_ms;
    init_job_t *j = calloc(1, sizeof(*j));
    pthread_attr_t attr;
    pthread_t th;
    long spins = 0;
    int done = 0, gave_up = 0, rc;
    if (!j)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "nccl init job");
    if (cudaGetDevice(&j->device) != cudaSuccess) {
        free(j);
        return moe_error(MOE_STATUS_CUDA_ERROR, "nccl init: no current CUDA device");
    }
    pthread_mutex_init(&j->mu, NULL);
    j->id = *id;
    j->world = world;
    j->rank = rank;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    rc = pthread_create(&th, &attr, init_thread, j);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        job_free(j);
        return moe_error(MOE_STATUS_INTERNAL_ERROR, "nccl init: pthread_create failed (%d)", rc);
    }
    for (;;) {
        pthread_mutex_lock(&j->mu);
        done = j->done;
        if (!done && moe_now_ms() > deadline)
            gave_up = j->abandoned = 1; /* from now on the thread owns (and frees) the job */
        pthread_mutex_unlock(&j->mu);
        if (done)
            break;
        if (gave_up)
            return moe_error(MOE_STATUS_TIMEOUT,
                             "ncclCommInitRank did not finish within %d ms (a peer never "
                             "joined); left to its thread, which aborts it if it returns",
                             n->timeout_ms);
        nap(++spins);
    }
    n->comm = j->comm;
    rc = j->result;
    job_free(j);
    if (rc != ncclSuccess) {
        abort_comm(n);
        n->aborted = 0;
        return nccl_error((ncclResult_t)rc, "ncclCommInitRankConfig");
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_nccl_create(moe_comm_t *mpi, int timeout_ms, moe_nccl_t **out)
{
    const int rank = moe_comm_rank(mpi), world = moe_comm_size(mpi);
    ncclUniqueId id;
    moe_nccl_t *n;
    moe_status_t st;
    ncclResult_t r;

    *out = NULL;
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
    MOE_CHECK_GOTO(bounded_init(n, &id, world, rank), st, fail);
    *out = n;
    return MOE_STATUS_SUCCESS;
fail:
    moe_nccl_destroy(n);
    return st;
}

/* ---- bounded finalize: a watchdog aborts the communicator at the deadline ---------------- */

typedef struct watchdog {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    ncclComm_t comm;
    int timeout_ms;
    int finished; /* finalize returned: the watchdog stands down */
    int fired;    /* the watchdog aborted the communicator */
} watchdog_t;

static void *watchdog_thread(void *arg)
{
    watchdog_t *w = arg;
    struct timespec ts;
    int rc = 0;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += w->timeout_ms / 1000;
    ts.tv_nsec += (long)(w->timeout_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&w->mu);
    while (!w->finished && rc == 0)
        rc = pthread_cond_timedwait(&w->cv, &w->mu, &ts);
    if (!w->finished) {
        w->fired = 1;
        ncclCommAbort(w->comm); /* ends the blocked finalize on the other thread */
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

void moe_nccl_destroy(moe_nccl_t *n)
{
    watchdog_t w;
    pthread_t th;
    ncclResult_t r;
    if (!n)
        return;
    if (!n->comm) {
        free(n);
        return;
    }
    memset(&w, 0, sizeof(w));
    pthread_mutex_init(&w.mu, NULL);
    pthread_cond_init(&w.cv, NULL);
    w.comm = n->comm;
    w.timeout_ms = n->timeout_ms;
    if (pthread_create(&th, NULL, watchdog_thread, &w) != 0) {
        ncclCommAbort(n->comm); /* no watchdog: never risk an unbounded finalize */
    } else {
        /* Finalize flushes pending work and may wait on peers. */
        r = ncclCommFinalize(n->comm);
        pthread_mutex_lock(&w.mu);
        w.finished = 1;
        pthread_cond_signal(&w.cv);
        pthread_mutex_unlock(&w.mu);
        pthread_join(th, NULL);
        if (w.fired)
            MOE_LOG_WARN("NCCL", "ncclCommFinalize did not finish within %d ms: aborted",
                         n->timeout_ms);
        else if (r == ncclSuccess)
            ncclCommDestroy(n->comm);
        else
            ncclCommAbort(n->comm);
    }
    pthread_cond_destroy(&w.cv);
    pthread_mutex_destroy(&w.mu);
    free(n);
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

static moe_status_t issued(ncclResult_t r, const char *what)
{
    return r == ncclSuccess ? MOE_STATUS_SUCCESS : nccl_error(r, what);
}

moe_status_t moe_nccl_all_gather(moe_nccl_t *n, const void *send, void *recv, size_t bytes,
                                 void *stream)
{
    MOE_CHECK(usable(n, "all-gather"));
    return issued(ncclAllGather(send, recv, bytes, ncclUint8, n->comm, (cudaStream_t)stream),
                  "ncclAllGather");
}

moe_status_t moe_nccl_send(moe_nccl_t *n, const void *buf, size_t bytes, int peer, void *stream)
{
    MOE_CHECK(usable(n, "send"));
    return issued(ncclSend(buf, bytes, ncclUint8, peer, n->comm, (cudaStream_t)stream), "ncclSend");
}

moe_status_t moe_nccl_recv(moe_nccl_t *n, void *buf, size_t bytes, int peer, void *stream)
{
    MOE_CHECK(usable(n, "recv"));
    return issued(ncclRecv(buf, bytes, ncclUint8, peer, n->comm, (cudaStream_t)stream), "ncclRecv");
}

moe_status_t moe_nccl_reduce_scatter(moe_nccl_t *n, const void *send, void *recv, size_t count,
                                     moe_dtype_t dtype, void *stream)
{
    MOE_CHECK(usable(n, "reduce-scatter"));
    return issued(ncclReduceScatter(send, recv, count, nccl_type(dtype), ncclSum, n->comm,
                                    (cudaStream_t)stream),
                  "ncclReduceScatter");
}

moe_status_t moe_nccl_group_start(void)
{
    return issued(ncclGroupStart(), "ncclGroupStart");
}

moe_status_t moe_nccl_group_end(moe_nccl_t *n)
{
    /* closed whatever the communicator's state: a group left open would defer every later
     * NCCL call of this thread, on any communicator */
    const ncclResult_t r = ncclGroupEnd();
    MOE_CHECK(usable(n, "group"));
    return issued(r, "ncclGroupEnd");
}

moe_status_t moe_nccl_check(moe_nccl_t *n)
{
    ncclResult_t s = ncclSuccess;
    MOE_CHECK(usable(n, "check"));
    if (ncclCommGetAsyncError(n->comm, &s) != ncclSuccess ||
        (s != ncclSuccess && s != ncclInProgress)) {
        moe_status_t st = nccl_error(s, "NCCL async error");
        abort_comm(n);
        return st;
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_nccl_wait(moe_nccl_t *n, void *stream)
{
    const double deadline = moe_now_ms() + n->timeout_ms;
    long spins = 0;
    for (;;) {
        cudaError_t e = cudaStreamQuery((cudaStream_t)stream);
        if (e == cudaSuccess)
            return MOE_STATUS_SUCCESS;
        if (e != cudaErrorNotReady)
            return moe_error(MOE_STATUS_CUDA_ERROR, "cudaStreamQuery: %s", cudaGetErrorString(e));
        MOE_CHECK(moe_nccl_check(n));
        if (moe_now_ms() > deadline) {
            abort_comm(n);
            return moe_error(MOE_STATUS_TIMEOUT,
                             "GPU step did not finish within %d ms (a peer is stuck or dead); "
                             "the NCCL communicator was aborted",
                             n->timeout_ms);
        }
        /* Sleep between polls after a short spin: busy polling was measured 3-6x slower per
         * step on two H200s (it competes with NCCL's own progress threads). */
        if (++spins > 100)
            nap(spins);
    }
}
