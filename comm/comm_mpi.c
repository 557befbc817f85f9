/* SPDX-License-Identifier: Apache-2.0 */
/* MPI bootstrap and CPU transport. Every collective is nonblocking underneath and waited on
 * with a deadline, so a dead or stuck peer gives MOE_STATUS_TIMEOUT instead of a hang. */
#include "comm/comm.h"

#include <limits.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "runtime/diag.h"

struct moe_comm {
    MPI_Comm comm;
    int rank, size;
    int timeout_ms;
    int failed; /* a wait timed out: the communicator may hold a pending operation */
};

static moe_status_t mpi_error(int rc, const char *what)
{
    char msg[MPI_MAX_ERROR_STRING] = "";
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    return moe_error(MOE_STATUS_MPI_ERROR, "%s failed: %s", what, msg);
}

#define MOE_MPI_CHECK(call, what)                                                              \
    do {                                                                                       \
        int moe_rc_ = (call);                                                                  \
        if (moe_rc_ != MPI_SUCCESS)                                                            \
            return mpi_error(moe_rc_, what);                                                   \
    } while (0)

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Polls the request until done or the deadline; backs off from busy polling to 1 ms sleeps
 * so that waiting ranks leave the cores to the working ones (oversubscribed runs). */
static moe_status_t wait_bounded(moe_comm_t *c, MPI_Request *req, const char *what)
{
    const double deadline = now_ms() + c->timeout_ms;
    long spins = 0;
    int done = 0;

    for (;;) {
        int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS)
            return mpi_error(rc, what);
        if (done)
            return MOE_STATUS_SUCCESS;
        if (++spins > 1000) {
            struct timespec ts = {0, spins > 20000 ? 1000000L : 50000L};
            nanosleep(&ts, NULL);
            if (now_ms() > deadline)
                break;
        }
    }
    c->failed = 1;
    return moe_error(MOE_STATUS_TIMEOUT,
                     "%s: a peer did not answer within %d ms (rank %d of %d); the "
                     "communicator is no longer usable",
                     what, c->timeout_ms, c->rank, c->size);
}

static moe_status_t check_usable(const moe_comm_t *c, const char *what)
{
    if (c->failed)
        return moe_error(MOE_STATUS_INVALID_STATE,
                         "%s: the communicator failed earlier (timeout); recreate the runtime",
                         what);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t comm_wrap(MPI_Comm mc, int timeout_ms, moe_comm_t **out)
{
    moe_comm_t *c = calloc(1, sizeof(*c));
    if (!c) {
        MPI_Comm_free(&mc);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "communicator");
    }
    c->comm = mc;
    c->timeout_ms = timeout_ms;
    MPI_Comm_set_errhandler(mc, MPI_ERRORS_RETURN);
    MPI_Comm_rank(mc, &c->rank);
    MPI_Comm_size(mc, &c->size);
    *out = c;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_comm_create(const void *mpi_comm, int timeout_ms, moe_comm_t **comm,
                             int *owns_mpi)
{
    MPI_Comm parent = mpi_comm ? *(const MPI_Comm *)mpi_comm : MPI_COMM_WORLD;
    MPI_Comm dup = MPI_COMM_NULL;
    MPI_Request req;
    moe_comm_t tmp = {0};
    int inited = 0, finalized = 0, provided = 0;
    moe_status_t st;

    *owns_mpi = 0;
    MPI_Finalized(&finalized);
    if (finalized)
        return moe_error(MOE_STATUS_INVALID_STATE, "MPI has been finalised");
    MPI_Initialized(&inited);
    if (!inited) {
        MOE_MPI_CHECK(MPI_Init_thread(NULL, NULL, MPI_THREAD_FUNNELED, &provided), "MPI_Init");
        *owns_mpi = 1;
        parent = MPI_COMM_WORLD;
    }
    MPI_Comm_set_errhandler(parent, MPI_ERRORS_RETURN);
    MOE_MPI_CHECK(MPI_Comm_idup(parent, &dup, &req), "MPI_Comm_idup");
    tmp.timeout_ms = timeout_ms;
    MPI_Comm_rank(parent, &tmp.rank);
    MPI_Comm_size(parent, &tmp.size);
    st = wait_bounded(&tmp, &req, "runtime bootstrap (MPI_Comm_idup)");
    if (st != MOE_STATUS_SUCCESS)
        return st;
    return comm_wrap(dup, timeout_ms, comm);
}

moe_status_t moe_comm_split(moe_comm_t *parent, int color, int key, moe_comm_t **comm)
{
    MPI_Comm mc;
    MOE_CHECK(check_usable(parent, "comm split"));
    MOE_MPI_CHECK(MPI_Comm_split(parent->comm, color, key, &mc), "MPI_Comm_split");
    return comm_wrap(mc, parent->timeout_ms, comm);
}

moe_status_t moe_comm_split_node(moe_comm_t *parent, moe_comm_t **comm)
{
    MPI_Comm mc;
    MOE_CHECK(check_usable(parent, "node split"));
    MOE_MPI_CHECK(MPI_Comm_split_type(parent->comm, MPI_COMM_TYPE_SHARED, parent->rank,
                                      MPI_INFO_NULL, &mc),
                  "MPI_Comm_split_type");
    return comm_wrap(mc, parent->timeout_ms, comm);
}

void moe_comm_destroy(moe_comm_t *comm)
{
    int finalized = 0;
    if (!comm)
        return;
    MPI_Finalized(&finalized);
    /* A communicator with a pending (timed-out) operation cannot be freed safely. */
    if (!finalized && !comm->failed)
        MPI_Comm_free(&comm->comm);
    free(comm);
}

void moe_comm_finalize_mpi(int owns_mpi)
{
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_mpi && !finalized)
        MPI_Finalize();
}

int moe_comm_rank(const moe_comm_t *comm)
{
    return comm->rank;
}

int moe_comm_size(const moe_comm_t *comm)
{
    return comm->size;
}

const void *moe_comm_mpi_handle(const moe_comm_t *comm)
{
    return &comm->comm;
}

moe_status_t moe_comm_barrier(moe_comm_t *c)
{
    MPI_Request req;
    MOE_CHECK(check_usable(c, "barrier"));
    MOE_MPI_CHECK(MPI_Ibarrier(c->comm, &req), "MPI_Ibarrier");
    return wait_bounded(c, &req, "barrier");
}

moe_status_t moe_comm_bcast(moe_comm_t *c, void *buf, size_t bytes, int root)
{
    MPI_Request req;
    MOE_CHECK(check_usable(c, "bcast"));
    if (bytes > INT_MAX)
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "bcast of %zu bytes", bytes);
    MOE_MPI_CHECK(MPI_Ibcast(buf, (int)bytes, MPI_BYTE, root, c->comm, &req), "MPI_Ibcast");
    return wait_bounded(c, &req, "bcast");
}

static MPI_Op mpi_op(moe_reduce_op_t op)
{
    return op == MOE_REDUCE_MIN ? MPI_MIN : op == MOE_REDUCE_MAX ? MPI_MAX : MPI_SUM;
}

moe_status_t moe_comm_allreduce_i64(moe_comm_t *c, int64_t *vals, int n, moe_reduce_op_t op)
{
    MPI_Request req;
    MOE_CHECK(check_usable(c, "allreduce"));
    MOE_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, vals, n, MPI_INT64_T, mpi_op(op), c->comm, &req),
                  "MPI_Iallreduce");
    return wait_bounded(c, &req, "allreduce");
}

moe_status_t moe_comm_allreduce_f64(moe_comm_t *c, double *vals, int n, moe_reduce_op_t op)
{
    MPI_Request req;
    MOE_CHECK(check_usable(c, "allreduce"));
    MOE_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, vals, n, MPI_DOUBLE, mpi_op(op), c->comm, &req),
                  "MPI_Iallreduce");
    return wait_bounded(c, &req, "allreduce");
}

moe_status_t moe_comm_alltoall_i64(moe_comm_t *c, const int64_t *send, int64_t *recv)
{
    MPI_Request req;
    MOE_CHECK(check_usable(c, "alltoall"));
    MOE_MPI_CHECK(MPI_Ialltoall(send, 1, MPI_INT64_T, recv, 1, MPI_INT64_T, c->comm, &req),
                  "MPI_Ialltoall");
    return wait_bounded(c, &req, "alltoall (counts)");
}

/* MPI counts are int: elements are sent as one contiguous datatype of elem_bytes, so the
 * limit is 2^31 rows, not 2^31 bytes. */
static moe_status_t to_int_arrays(const moe_comm_t *c, const int64_t *a, const int64_t *b,
                                  int *ia, int *ib, const char *what)
{
    int i;
    for (i = 0; i < c->size; i++) {
        if (a[i] < 0 || a[i] > INT_MAX || (b && (b[i] < 0 || b[i] > INT_MAX)))
            return moe_error(MOE_STATUS_NOT_SUPPORTED, "%s: count %lld for rank %d", what,
                             (long long)a[i], i);
        ia[i] = (int)a[i];
        if (b)
            ib[i] = (int)b[i];
    }
    return MOE_STATUS_SUCCESS;
}

static moe_status_t elem_type(size_t elem_bytes, MPI_Datatype *t)
{
    if (elem_bytes == 0 || elem_bytes > INT_MAX)
        return moe_error(MOE_STATUS_INTERNAL_ERROR, "element of %zu bytes", elem_bytes);
    MOE_MPI_CHECK(MPI_Type_contiguous((int)elem_bytes, MPI_BYTE, t), "MPI_Type_contiguous");
    MOE_MPI_CHECK(MPI_Type_commit(t), "MPI_Type_commit");
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_comm_alltoallv(moe_comm_t *c, const void *send, const int64_t *send_counts,
                                const int64_t *send_displs, void *recv,
                                const int64_t *recv_counts, const int64_t *recv_displs,
                                size_t elem_bytes)
{
    int *buf = NULL;
    MPI_Datatype t = MPI_DATATYPE_NULL;
    MPI_Request req;
    moe_status_t st;
    int rc;

    MOE_CHECK(check_usable(c, "alltoallv"));
    buf = malloc(sizeof(int) * 4 * (size_t)c->size);
    if (!buf)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "alltoallv counts");
    MOE_CHECK_GOTO(to_int_arrays(c, send_counts, send_displs, buf, buf + c->size, "alltoallv"),
                   st, out);
    MOE_CHECK_GOTO(to_int_arrays(c, recv_counts, recv_displs, buf + 2 * c->size,
                                 buf + 3 * c->size, "alltoallv"),
                   st, out);
    MOE_CHECK_GOTO(elem_type(elem_bytes, &t), st, out);
    rc = MPI_Ialltoallv(send, buf, buf + c->size, t, recv, buf + 2 * c->size, buf + 3 * c->size,
                        t, c->comm, &req);
    if (rc != MPI_SUCCESS) {
        st = mpi_error(rc, "MPI_Ialltoallv");
        goto out;
    }
    st = wait_bounded(c, &req, "alltoallv");
out:
    if (t != MPI_DATATYPE_NULL)
        MPI_Type_free(&t);
    free(buf);
    return st;
}

moe_status_t moe_comm_allgatherv(moe_comm_t *c, const void *send, int64_t send_count,
                                 void *recv, const int64_t *recv_counts,
                                 const int64_t *recv_displs, size_t elem_bytes)
{
    int *buf = NULL;
    MPI_Datatype t = MPI_DATATYPE_NULL;
    MPI_Request req;
    moe_status_t st;
    int rc;

    MOE_CHECK(check_usable(c, "allgatherv"));
    buf = malloc(sizeof(int) * 2 * (size_t)c->size);
    if (!buf)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "allgatherv counts");
    MOE_CHECK_GOTO(to_int_arrays(c, recv_counts, recv_displs, buf, buf + c->size, "allgatherv"),
                   st, out);
    MOE_CHECK_GOTO(elem_type(elem_bytes, &t), st, out);
    rc = MPI_Iallgatherv(send, (int)send_count, t, recv, buf, buf + c->size, t, c->comm, &req);
    if (rc != MPI_SUCCESS) {
        st = mpi_error(rc, "MPI_Iallgatherv");
        goto out;
    }
    st = wait_bounded(c, &req, "allgatherv");
out:
    if (t != MPI_DATATYPE_NULL)
        MPI_Type_free(&t);
    free(buf);
    return st;
}

moe_status_t moe_comm_reduce_scatter_f32(moe_comm_t *c, const float *send, float *recv,
                                         const int64_t *recv_counts)
{
    int *counts = malloc(sizeof(int) * (size_t)c->size);
    MPI_Request req;
    moe_status_t st;
    int rc;

    if (!counts)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "reduce_scatter counts");
    MOE_CHECK_GOTO(check_usable(c, "reduce_scatter"), st, out);
    MOE_CHECK_GOTO(to_int_arrays(c, recv_counts, NULL, counts, NULL, "reduce_scatter"), st, out);
    rc = MPI_Ireduce_scatter(send, recv, counts, MPI_FLOAT, MPI_SUM, c->comm, &req);
    if (rc != MPI_SUCCESS) {
        st = mpi_error(rc, "MPI_Ireduce_scatter");
        goto out;
    }
    st = wait_bounded(c, &req, "reduce_scatter");
out:
    free(counts);
    return st;
}

moe_status_t moe_comm_agree(moe_comm_t *c, moe_status_t status)
{
    /* MIN over failing ranks of (rank * 64 + status): the first failing rank and its status. */
    int64_t v = status != MOE_STATUS_SUCCESS ? (int64_t)c->rank * 64 + (int64_t)status
                                             : INT64_MAX;
    MOE_CHECK(moe_comm_allreduce_i64(c, &v, 1, MOE_REDUCE_MIN));
    if (v == INT64_MAX)
        return MOE_STATUS_SUCCESS;
    if (status != MOE_STATUS_SUCCESS)
        return status; /* keep this rank's own message */
    return moe_error(MOE_STATUS_PEER_FAILURE, "rank %lld failed with %s", (long long)(v / 64),
                     moe_status_string((moe_status_t)(v % 64)));
}
