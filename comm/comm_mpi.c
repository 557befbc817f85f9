/* SPDX-License-Identifier: Apache-2.0 */
/* MPI bootstrap and CPU transport. Every collective is nonblocking underneath and waited on
 * with a deadline, so a dead or stuck peer gives MOE_STATUS_TIMEOUT instead of a hang.
 *
 * MPI never sees the caller's buffers: a collective copies its send data into a staging block
 * of its own, receives there and copies out once it completed. A collective that timed out
 * cannot be cancelled and completes whenever the late peer joins (MPI progresses it inside any
 * later MPI call, MPI_Finalize included), so its staging block is parked with the request
 * instead of freed: the late completion writes there, never into memory the caller reused. */
#include "comm/comm.h"

#include <limits.h>
#include <mpi.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "base/diag.h"

/* A request abandoned by a failed wait and the staging memory MPI may still write. */
typedef struct parked {
    MPI_Request req;
    void *mem;
    struct parked *next;
} parked_t;

struct moe_comm {
    MPI_Comm comm;
    int rank, size;
    int timeout_ms;
    int failed;       /* a wait failed: the communicator may hold a pending operation */
    parked_t *parked; /* the abandoned requests */
};

static moe_status_t mpi_error(int rc, const char *what)
{
    char msg[MPI_MAX_ERROR_STRING] = "";
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    return moe_error(MOE_STATUS_MPI_ERROR, "%s failed: %s", what, msg);
}

#define MOE_MPI_CHECK(call, what)                                                                  \
    do {                                                                                           \
        int moe_rc_ = (call);                                                                      \
        if (moe_rc_ != MPI_SUCCESS)                                                                \
            return mpi_error(moe_rc_, what);                                                       \
    } while (0)

/* Keeps a failed request's staging memory (*mem, then set to NULL) until destroy finds the
 * request complete, or for good. A request that ended with an error is already freed by MPI,
 * but the parts of its schedule still posted may write later, so its memory is just leaked;
 * so is everything when there is no memory for the record. */
static void park(moe_comm_t *c, MPI_Request *req, void **mem)
{
    parked_t *p;
    c->failed = 1;
    if (!mem || !*mem)
        return;
    p = *req != MPI_REQUEST_NULL ? malloc(sizeof(*p)) : NULL;
    if (p) {
        p->req = *req;
        p->mem = *mem;
        p->next = c->parked;
        c->parked = p;
    }
    *mem = NULL;
}

/* Polls the request until done or the deadline; backs off from busy polling to 1 ms sleeps
 * so that waiting ranks leave the cores to the working ones (oversubscribed runs). On failure
 * the request's staging memory (*mem, may be NULL) is parked and *mem set to NULL. */
static moe_status_t wait_bounded(moe_comm_t *c, MPI_Request *req, void **mem, const char *what)
{
    const double deadline = moe_now_ms() + c->timeout_ms;
    long spins = 0;
    int done = 0;

    for (;;) {
        int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
        if (rc != MPI_SUCCESS) {
            park(c, req, mem);
            return mpi_error(rc, what);
        }
        if (done)
            return MOE_STATUS_SUCCESS;
        if (++spins > 1000) {
            struct timespec ts = {0, spins > 20000 ? 1000000L : 50000L};
            nanosleep(&ts, NULL);
            if (moe_now_ms() > deadline)
                break;
        }
    }
    park(c, req, mem);
    return moe_error(MOE_STATUS_TIMEOUT,
                     "%s: a peer did not answer within %d ms (rank %d of %d); the "
                     "communicator is no longer usable",
                     what, c->timeout_ms, c->rank, c->size);
}

static moe_status_t check_usable(const moe_comm_t *c, const char *what)
{
    if (c->failed)
        return moe_error(MOE_STATUS_INVALID_STATE,
                         "%s: the communicator failed earlier (timeout or MPI error); recreate "
                         "the runtime",
                         what);
    return MOE_STATUS_SUCCESS;
}

/* A staging block of `bytes` (at least 1) holding a copy of `src` (NULL: uninitialised). */
static void *stage(const void *src, size_t bytes)
{
    void *m = malloc(bytes ? bytes : 1);
    if (m && src && bytes)
        memcpy(m, src, bytes);
    return m;
}

/* Bounded wait on `req`, then, on success, `bytes` of the staging block back to `dst`; the
 * block is freed unless it was parked. */
static moe_status_t finish(moe_comm_t *c, MPI_Request *req, void *mem, void *dst, size_t bytes,
                           const char *what)
{
    moe_status_t st = wait_bounded(c, req, &mem, what);
    if (st == MOE_STATUS_SUCCESS && dst && bytes)
        memcpy(dst, mem, bytes);
    free(mem);
    return st;
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

moe_status_t moe_comm_create(const void *mpi_comm, int timeout_ms, moe_comm_t **comm, int *owns_mpi)
{
    MPI_Comm parent = mpi_comm ? *(const MPI_Comm *)mpi_comm : MPI_COMM_WORLD;
    MPI_Comm *dup, mc;
    MPI_Request req;
    moe_comm_t tmp = {0};
    int inited = 0, finalized = 0, provided = 0, rc;
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
    /* MPI_COMM_NULL would reach the caller's fatal error handler below and abort the job. */
    if (parent == MPI_COMM_NULL)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "mpi_comm points to MPI_COMM_NULL: pass a communicator or NULL "
                         "(MPI_COMM_WORLD)");
    MPI_Comm_set_errhandler(parent, MPI_ERRORS_RETURN);
    /* MPI writes the new handle when the idup completes: after a timeout that can be during
     * any later MPI call, so the handle lives on the heap and is then never freed. */
    dup = malloc(sizeof(*dup));
    if (!dup)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "communicator handle");
    *dup = MPI_COMM_NULL;
    rc = MPI_Comm_idup(parent, dup, &req);
    if (rc != MPI_SUCCESS) {
        free(dup);
        return mpi_error(rc, "MPI_Comm_idup");
    }
    tmp.timeout_ms = timeout_ms;
    MPI_Comm_rank(parent, &tmp.rank);
    MPI_Comm_size(parent, &tmp.size);
    st = wait_bounded(&tmp, &req, NULL, "runtime bootstrap (MPI_Comm_idup)");
    if (st != MOE_STATUS_SUCCESS)
        return st; /* dup is left to the pending request, on purpose */
    mc = *dup;
    free(dup);
    return comm_wrap(mc, timeout_ms, comm);
}

void moe_comm_destroy(moe_comm_t *comm)
{
    int finalized = 0;
    parked_t *p, *next;
    if (!comm)
        return;
    MPI_Finalized(&finalized);
    /* Staging memory of a request that has not completed stays allocated: MPI may still
     * write it. The communicator itself is not freed either while it may hold one. */
    for (p = comm->parked; p; p = next) {
        int done = 0;
        next = p->next;
        if (!finalized && MPI_Test(&p->req, &done, MPI_STATUS_IGNORE) == MPI_SUCCESS && done) {
            free(p->mem);
            free(p);
        }
    }
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
    return wait_bounded(c, &req, NULL, "barrier");
}

moe_status_t moe_comm_bcast(moe_comm_t *c, void *buf, size_t bytes, int root)
{
    MPI_Request req;
    void *mem;
    int rc;
    MOE_CHECK(check_usable(c, "bcast"));
    if (bytes > INT_MAX)
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "bcast of %zu bytes", bytes);
    mem = stage(c->rank == root ? buf : NULL, bytes);
    if (!mem)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "bcast staging: %zu bytes", bytes);
    rc = MPI_Ibcast(mem, (int)bytes, MPI_BYTE, root, c->comm, &req);
    if (rc != MPI_SUCCESS) {
        free(mem);
        return mpi_error(rc, "MPI_Ibcast");
    }
    return finish(c, &req, mem, buf, bytes, "bcast");
}

static MPI_Op mpi_op(moe_reduce_op_t op)
{
    return op == MOE_REDUCE_MIN ? MPI_MIN : op == MOE_REDUCE_MAX ? MPI_MAX : MPI_SUM;
}

static moe_status_t allreduce(moe_comm_t *c, void *vals, int n, size_t elem_bytes,
                              MPI_Datatype type, moe_reduce_op_t op)
{
    const size_t bytes = elem_bytes * (size_t)(n > 0 ? n : 0);
    MPI_Request req;
    void *mem;
    int rc;
    MOE_CHECK(check_usable(c, "allreduce"));
    mem = stage(vals, bytes);
    if (!mem)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "allreduce staging: %zu bytes", bytes);
    rc = MPI_Iallreduce(MPI_IN_PLACE, mem, n, type, mpi_op(op), c->comm, &req);
    if (rc != MPI_SUCCESS) {
        free(mem);
        return mpi_error(rc, "MPI_Iallreduce");
    }
    return finish(c, &req, mem, vals, bytes, "allreduce");
}

moe_status_t moe_comm_allreduce_i64(moe_comm_t *c, int64_t *vals, int n, moe_reduce_op_t op)
{
    return allreduce(c, vals, n, sizeof(int64_t), MPI_INT64_T, op);
}

moe_status_t moe_comm_alltoall_i64(moe_comm_t *c, const int64_t *send, int64_t *recv)
{
    const size_t bytes = sizeof(int64_t) * (size_t)c->size;
    MPI_Request req;
    int64_t *mem; /* [size] received, then [size] sent */
    int rc;
    MOE_CHECK(check_usable(c, "alltoall"));
    mem = stage(NULL, 2 * bytes);
    if (!mem)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "alltoall staging");
    memcpy(mem + c->size, send, bytes);
    rc = MPI_Ialltoall(mem + c->size, 1, MPI_INT64_T, mem, 1, MPI_INT64_T, c->comm, &req);
    if (rc != MPI_SUCCESS) {
        free(mem);
        return mpi_error(rc, "MPI_Ialltoall");
    }
    return finish(c, &req, mem, recv, bytes, "alltoall (counts)");
}

/* Staging for the v-collectives: the caller's per-rank segments (counts and displacements in
 * elements) are packed back to back, so MPI gets int counts and displacements into one block.
 * MPI counts are int: elements are sent as one contiguous datatype of elem_bytes, so the
 * limit is 2^31 rows, not 2^31 bytes. */
typedef struct vlayout {
    int *counts, *displs; /* [size] each, packed */
    int64_t total;        /* elements */
} vlayout_t;

static moe_status_t pack_layout(const moe_comm_t *c, const int64_t *counts, vlayout_t *v,
                                const char *what)
{
    int i;
    v->total = 0;
    for (i = 0; i < c->size; i++) {
        if (counts[i] < 0 || counts[i] > INT_MAX || v->total > INT_MAX)
            return moe_error(MOE_STATUS_NOT_SUPPORTED, "%s: count %lld for rank %d", what,
                             (long long)counts[i], i);
        v->counts[i] = (int)counts[i];
        v->displs[i] = (int)v->total;
        v->total += counts[i];
    }
    return MOE_STATUS_SUCCESS;
}

/* Each rank's segment of the caller's buffer (at displs) into the packed staging area. */
static void pack_segments(const moe_comm_t *c, const vlayout_t *v, char *packed, const char *user,
                          const int64_t *displs, size_t elem_bytes)
{
    int i;
    for (i = 0; i < c->size; i++)
        if (v->counts[i])
            memcpy(packed + (size_t)v->displs[i] * elem_bytes,
                   user + (size_t)displs[i] * elem_bytes, (size_t)v->counts[i] * elem_bytes);
}

/* The reverse: packed staging area to the caller's buffer at displs. */
static void unpack_segments(const moe_comm_t *c, const vlayout_t *v, const char *packed, char *user,
                            const int64_t *displs, size_t elem_bytes)
{
    int i;
    for (i = 0; i < c->size; i++)
        if (v->counts[i])
            memcpy(user + (size_t)displs[i] * elem_bytes,
                   packed + (size_t)v->displs[i] * elem_bytes, (size_t)v->counts[i] * elem_bytes);
}

static moe_status_t check_displs(const moe_comm_t *c, const int64_t *displs, const char *what)
{
    int i;
    for (i = 0; displs && i < c->size; i++)
        if (displs[i] < 0)
            return moe_error(MOE_STATUS_INTERNAL_ERROR, "%s: displacement %lld for rank %d", what,
                             (long long)displs[i], i);
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

/* One block: [int arrays][send data][receive data], each part 16-byte aligned. */
static size_t align16(size_t n)
{
    return (n + 15) & ~(size_t)15;
}

/* Bytes of the send part: never 0, because Open MPI's nonblocking collectives (libnbc) take a
 * send buffer equal to the receive buffer for MPI_IN_PLACE. */
static size_t send_part(size_t bytes)
{
    return align16(bytes + 1);
}

moe_status_t moe_comm_alltoallv(moe_comm_t *c, const void *send, const int64_t *send_counts,
                                const int64_t *send_displs, void *recv, const int64_t *recv_counts,
                                const int64_t *recv_displs, size_t elem_bytes)
{
    const size_t ints = align16(sizeof(int) * 4 * (size_t)c->size);
    vlayout_t sv, rv;
    MPI_Datatype t = MPI_DATATYPE_NULL;
    MPI_Request req;
    char *mem = NULL, *sbuf, *rbuf;
    void *m;
    moe_status_t st;
    int rc;

    MOE_CHECK(check_usable(c, "alltoallv"));
    MOE_CHECK(check_displs(c, send_displs, "alltoallv"));
    MOE_CHECK(check_displs(c, recv_displs, "alltoallv"));
    mem = stage(NULL, ints);
    if (!mem)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "alltoallv counts");
    sv.counts = (int *)mem, sv.displs = sv.counts + c->size;
    rv.counts = sv.displs + c->size, rv.displs = rv.counts + c->size;
    MOE_CHECK_GOTO(pack_layout(c, send_counts, &sv, "alltoallv"), st, out);
    MOE_CHECK_GOTO(pack_layout(c, recv_counts, &rv, "alltoallv"), st, out);
    m = realloc(mem, ints + send_part((size_t)sv.total * elem_bytes) +
                         (size_t)rv.total * elem_bytes + 1);
    if (!m) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "alltoallv staging: %lld + %lld rows",
                       (long long)sv.total, (long long)rv.total);
        goto out;
    }
    mem = m;
    sv.counts = (int *)mem, sv.displs = sv.counts + c->size;
    rv.counts = sv.displs + c->size, rv.displs = rv.counts + c->size;
    sbuf = mem + ints;
    rbuf = sbuf + send_part((size_t)sv.total * elem_bytes);
    pack_segments(c, &sv, sbuf, send, send_displs, elem_bytes);
    MOE_CHECK_GOTO(elem_type(elem_bytes, &t), st, out);
    rc =
        MPI_Ialltoallv(sbuf, sv.counts, sv.displs, t, rbuf, rv.counts, rv.displs, t, c->comm, &req);
    if (rc != MPI_SUCCESS) {
        st = mpi_error(rc, "MPI_Ialltoallv");
        goto out;
    }
    m = mem;
    st = wait_bounded(c, &req, &m, "alltoallv");
    if (st == MOE_STATUS_SUCCESS)
        unpack_segments(c, &rv, rbuf, recv, recv_displs, elem_bytes);
    mem = m; /* NULL when parked */
out:
    if (t != MPI_DATATYPE_NULL)
        MPI_Type_free(&t); /* freeing a datatype a pending request uses is allowed */
    free(mem);
    return st;
}

moe_status_t moe_comm_allgatherv(moe_comm_t *c, const void *send, int64_t send_count, void *recv,
                                 const int64_t *recv_counts, const int64_t *recv_displs,
                                 size_t elem_bytes)
{
    const size_t ints = align16(sizeof(int) * 2 * (size_t)c->size);
    vlayout_t rv;
    MPI_Datatype t = MPI_DATATYPE_NULL;
    MPI_Request req;
    char *mem = NULL, *sbuf, *rbuf;
    void *m;
    moe_status_t st;
    int rc;

    MOE_CHECK(check_usable(c, "allgatherv"));
    MOE_CHECK(check_displs(c, recv_displs, "allgatherv"));
    if (send_count < 0 || send_count > INT_MAX)
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "allgatherv: count %lld", (long long)send_count);
    mem = stage(NULL, ints);
    if (!mem)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "allgatherv counts");
    rv.counts = (int *)mem, rv.displs = rv.counts + c->size;
    MOE_CHECK_GOTO(pack_layout(c, recv_counts, &rv, "allgatherv"), st, out);
    m = realloc(mem, ints + send_part((size_t)send_count * elem_bytes) +
                         (size_t)rv.total * elem_bytes + 1);
    if (!m) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "allgatherv staging: %lld rows",
                       (long long)rv.total);
        goto out;
    }
    mem = m;
    rv.counts = (int *)mem, rv.displs = rv.counts + c->size;
    sbuf = mem + ints;
    rbuf = sbuf + send_part((size_t)send_count * elem_bytes);
    if (send_count)
        memcpy(sbuf, send, (size_t)send_count * elem_bytes);
    MOE_CHECK_GOTO(elem_type(elem_bytes, &t), st, out);
    rc = MPI_Iallgatherv(sbuf, (int)send_count, t, rbuf, rv.counts, rv.displs, t, c->comm, &req);
    if (rc != MPI_SUCCESS) {
        st = mpi_error(rc, "MPI_Iallgatherv");
        goto out;
    }
    m = mem;
    st = wait_bounded(c, &req, &m, "allgatherv");
    if (st == MOE_STATUS_SUCCESS)
        unpack_segments(c, &rv, rbuf, recv, recv_displs, elem_bytes);
    mem = m;
out:
    if (t != MPI_DATATYPE_NULL)
        MPI_Type_free(&t);
    free(mem);
    return st;
}

moe_status_t moe_comm_reduce_scatter_f32(moe_comm_t *c, const float *send, float *recv,
                                         const int64_t *recv_counts)
{
    const size_t ints = align16(sizeof(int) * 2 * (size_t)c->size);
    vlayout_t rv;
    MPI_Request req;
    char *mem, *sbuf, *rbuf;
    void *m;
    size_t mine;
    moe_status_t st;
    int rc;

    MOE_CHECK(check_usable(c, "reduce_scatter"));
    mem = stage(NULL, ints);
    if (!mem)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "reduce_scatter counts");
    rv.counts = (int *)mem, rv.displs = rv.counts + c->size;
    MOE_CHECK_GOTO(pack_layout(c, recv_counts, &rv, "reduce_scatter"), st, out);
    mine = sizeof(float) * (size_t)rv.counts[c->rank];
    m = realloc(mem, ints + send_part(sizeof(float) * (size_t)rv.total) + mine + 1);
    if (!m) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "reduce_scatter staging: %lld floats",
                       (long long)rv.total);
        goto out;
    }
    mem = m;
    rv.counts = (int *)mem;
    sbuf = mem + ints;
    rbuf = sbuf + send_part(sizeof(float) * (size_t)rv.total);
    if (rv.total)
        memcpy(sbuf, send, sizeof(float) * (size_t)rv.total);
    rc = MPI_Ireduce_scatter(sbuf, rbuf, rv.counts, MPI_FLOAT, MPI_SUM, c->comm, &req);
    if (rc != MPI_SUCCESS) {
        st = mpi_error(rc, "MPI_Ireduce_scatter");
        goto out;
    }
    m = mem;
    st = wait_bounded(c, &req, &m, "reduce_scatter");
    if (st == MOE_STATUS_SUCCESS && mine)
        memcpy(recv, rbuf, mine);
    mem = m;
out:
    free(mem);
    return st;
}

/* Pieces of at most 1 GiB: MPI counts are int. */
#define MOE_EXCHANGE_PIECE ((size_t)1 << 30)
#define MOE_EXCHANGE_TAG 7177

static int exchange_pieces(const moe_comm_msg_t *m, int n)
{
    int64_t total = 0;
    int i;
    for (i = 0; i < n; i++)
        total += (int64_t)((m[i].bytes + MOE_EXCHANGE_PIECE - 1) / MOE_EXCHANGE_PIECE);
    return total > INT_MAX / 2 ? -1 : (int)total;
}

/* Posts the pieces of n messages into req[*k...]; recv: Irecv, else Isend. */
static moe_status_t exchange_post(moe_comm_t *c, const moe_comm_msg_t *m, int n, int recv,
                                  MPI_Request *req, int *k)
{
    int i;
    for (i = 0; i < n; i++) {
        size_t off;
        MOE_ARG_CHECK(m[i].peer >= 0 && m[i].peer < c->size && (m[i].buf || !m[i].bytes),
                      "exchange: message %d to or from rank %d of %d (buffer %p)", i, m[i].peer,
                      c->size, m[i].buf);
        for (off = 0; off < m[i].bytes; off += MOE_EXCHANGE_PIECE) {
            const size_t left = m[i].bytes - off;
            const int cnt = (int)(left < MOE_EXCHANGE_PIECE ? left : MOE_EXCHANGE_PIECE);
            char *at = (char *)m[i].buf + off;
            int rc =
                recv ? MPI_Irecv(at, cnt, MPI_BYTE, m[i].peer, MOE_EXCHANGE_TAG, c->comm, &req[*k])
                     : MPI_Isend(at, cnt, MPI_BYTE, m[i].peer, MOE_EXCHANGE_TAG, c->comm, &req[*k]);
            if (rc != MPI_SUCCESS)
                return mpi_error(rc, recv ? "MPI_Irecv" : "MPI_Isend");
            ++*k;
        }
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_comm_exchange(moe_comm_t *c, const moe_comm_msg_t *sends, int num_sends,
                               const moe_comm_msg_t *recvs, int num_recvs)
{
    const int ns = exchange_pieces(sends, num_sends), nr = exchange_pieces(recvs, num_recvs);
    double deadline;
    MPI_Request *req;
    moe_status_t st;
    long spins = 0;
    int k = 0, done = 0;

    MOE_CHECK(check_usable(c, "exchange"));
    if (ns < 0 || nr < 0)
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "exchange: too many message pieces");
    req = malloc(sizeof(MPI_Request) * ((size_t)ns + (size_t)nr + 1));
    if (!req)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "exchange: %d requests", ns + nr);
    st = exchange_post(c, recvs, num_recvs, 1, req, &k);
    if (st == MOE_STATUS_SUCCESS)
        st = exchange_post(c, sends, num_sends, 0, req, &k);
    if (st != MOE_STATUS_SUCCESS) {
        c->failed = k > 0; /* posted requests may still touch the buffers */
        free(req);         /* they are abandoned with the communicator */
        return st;
    }
    deadline = moe_now_ms() + c->timeout_ms;
    for (;;) {
        int rc = MPI_Testall(k, req, &done, MPI_STATUSES_IGNORE);
        if (rc != MPI_SUCCESS) {
            c->failed = 1;
            free(req);
            return mpi_error(rc, "exchange");
        }
        if (done)
            break;
        if (++spins > 1000) {
            struct timespec ts = {0, spins > 20000 ? 1000000L : 50000L};
            nanosleep(&ts, NULL);
            if (moe_now_ms() > deadline) {
                c->failed = 1;
                free(req);
                return moe_error(MOE_STATUS_TIMEOUT,
                                 "exchange: a peer did not answer within %d ms (rank %d of %d); "
                                 "the communicator is no longer usable",
                                 c->timeout_ms, c->rank, c->size);
            }
        }
    }
    free(req);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_comm_agree_max(moe_comm_t *c, moe_status_t status, int64_t *value)
{
    /* MIN over failing ranks of (rank * 64 + status): the first failing rank and its status;
     * MIN of -value: the largest value, in the same all-reduce. */
    int64_t v[2];
    moe_status_t st;
    v[0] = status != MOE_STATUS_SUCCESS ? (int64_t)c->rank * 64 + (int64_t)status : INT64_MAX;
    v[1] = value ? -*value : 0;
    /* A rank whose own step failed on this communicator (a timeout) reports that failure,
     * not the communicator's state. */
    if (c->failed && status != MOE_STATUS_SUCCESS)
        return status;
    st = moe_comm_allreduce_i64(c, v, value ? 2 : 1, MOE_REDUCE_MIN);
    if (st != MOE_STATUS_SUCCESS)
        return st;
    if (v[0] == INT64_MAX) {
        if (value)
            *value = -v[1];
        return MOE_STATUS_SUCCESS;
    }
    if (status != MOE_STATUS_SUCCESS)
        return status; /* keep this rank's own message */
    return moe_error(MOE_STATUS_PEER_FAILURE, "rank %lld failed with %s", (long long)(v[0] / 64),
                     moe_status_string((moe_status_t)(v[0] % 64)));
}

moe_status_t moe_comm_agree(moe_comm_t *c, moe_status_t status)
{
    return moe_comm_agree_max(c, status, NULL);
}

moe_status_t moe_comm_node_rank(moe_comm_t *c, int *local_rank, int *local_size)
{
    /* Ranks with the same host name share a node. A bounded all-gather of the names instead
     * of MPI_Comm_split_type, which has no nonblocking form and could wait forever. */
    enum { NAME = 64 };
    char mine[NAME];
    char *all = malloc((size_t)NAME * (size_t)c->size);
    int64_t *cnt = malloc(sizeof(int64_t) * 2 * (size_t)c->size);
    moe_status_t st;
    int r;

    if (!all || !cnt) {
        free(all);
        free(cnt);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "node rank");
    }
    memset(mine, 0, sizeof(mine));
    gethostname(mine, NAME - 1);
    for (r = 0; r < c->size; r++) {
        cnt[r] = 1;
        cnt[c->size + r] = r;
    }
    st = moe_comm_allgatherv(c, mine, 1, all, cnt, cnt + c->size, NAME);
    if (st == MOE_STATUS_SUCCESS) {
        *local_rank = 0;
        *local_size = 0;
        for (r = 0; r < c->size; r++) {
            if (strncmp(all + (size_t)r * NAME, mine, NAME) != 0)
                continue;
            *local_size += 1;
            if (r < c->rank)
                *local_rank += 1;
        }
    }
    free(all);
    free(cnt);
    return st;
}
