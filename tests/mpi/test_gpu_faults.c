/* SPDX-License-Identifier: Apache-2.0 */
/* GPU fault test (2+ ranks, a GPU each or sharing one): the last rank stops (SIGSTOP) at several
 * points of a run, one trial each, with a fresh runtime per trial:
 *   0. before its third step (between steps);
 *   1. right after its third forward call: the step's GPU work is queued and runs, its host is
 *      stopped before the synchronize (with lsa the peers' step can complete; the next one
 *      cannot);
 *   2.. stopped by rank 0 from a thread while every rank steps in a loop, after 0.05, 0.6 and
 *      1.7 s: anywhere in a step (launching kernels, in the synchronize, between steps).
 * Every other rank's failing step must end with MOE_STATUS_TIMEOUT (or a NCCL error) within
 * timeout_ms + 2 s of its forward call (and, for the stops from outside, of the stop), never
 * hang; the layer then refuses later steps (INVALID_STATE), and moe_layer_destroy and
 * moe_runtime_destroy return within timeout_ms + 2 s. Rank 0 then wakes the stopped rank
 * (SIGCONT), whose steps return (any status) and which cleans up too; MPI itself is unaffected,
 * so the job ends with exit code 0. */
#include "gpu_mpi.h"
#include "testutil.h"

#include <cuda_runtime.h>
#include <mpi.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "launch/layer_gen.h"

/* the runtime's timeout: 3 s, or MOE_TEST_FAULT_TIMEOUT_MS (slower runs: compute-sanitizer) */
static int timeout_ms = 3000;
#define BOUND_S (timeout_ms / 1000.0 + 2.0)
#define LOOP_S 60.0 /* a trial's steps end by then, or it failed */

static int rank, world, victim;
static pid_t *pids;
static MPI_Comm survivors = MPI_COMM_NULL; /* every rank but the victim */

/* seconds on the host's monotonic clock: the same for every process of this host */
static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* One step; *t0: when its forward was called. */
static moe_status_t step(moe_layer_t *l, void *dx, void *dy, int64_t n, double *t0,
                         int stop_after_forward)
{
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    moe_status_t st;
    *t0 = now_s();
    a.num_tokens = n;
    a.x = dx;
    a.y = dy;
    st = moe_layer_forward(l, &a);
    if (stop_after_forward) {
        fprintf(stderr, "rank %d: stopping itself after its forward call\n", rank);
        raise(SIGSTOP); /* until rank 0's SIGCONT */
    }
    if (st == MOE_STATUS_SUCCESS)
        st = moe_layer_synchronize(l, NULL);
    return st;
}

typedef struct stopper {
    double delay_s, at;
} stopper_t;

static void *stop_victim(void *p)
{
    stopper_t *s = p;
    struct timespec ts = {(time_t)s->delay_s,
                          (long)((s->delay_s - (double)(time_t)s->delay_s) * 1e9)};
    nanosleep(&ts, NULL);
    s->at = now_s();
    kill(pids[victim], SIGSTOP);
    return NULL;
}

/* One trial (see the top of the file); returns 1 when this rank saw what it must. */
static int trial(int how, double delay_s, float *x)
{
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    moe_runtime_t *rt = NULL;
    moe_layer_t *l = NULL;
    const int64_t n = 16;
    void *dx = NULL, *dy = NULL;
    stopper_t stop = {delay_s, 0.0};
    pthread_t thr;
    moe_status_t st = MOE_STATUS_SUCCESS;
    double t0 = 0.0, verdict = 0.0, start;
    int ok = 1, i, steps = 0;

    rc.backend = MOE_BACKEND_CUDA;
    rc.timeout_ms = timeout_ms;
    c.num_experts = 8;
    c.top_k = 2;
    c.hidden = 256;
    c.intermediate = 128;
    c.max_tokens_per_rank = n;
    TU_OK(moe_runtime_create(&rc, NULL, &rt));
    TU_OK(moe_layer_create(rt, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, tu_seed("gpu_faults")));
    if (cudaMalloc(&dx, sizeof(float) * 16 * 256) || cudaMalloc(&dy, sizeof(float) * 16 * 256) ||
        cudaMemcpy(dx, x, sizeof(float) * 16 * 256, cudaMemcpyHostToDevice))
        return 0;
    for (i = 0; i < 2; i++)
        TU_OK(step(l, dx, dy, n, &t0, 0));
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0 && how >= 2 && pthread_create(&thr, NULL, stop_victim, &stop) != 0)
        return 0;
    start = now_s();
    if (rank == victim && how == 0) {
        fprintf(stderr, "rank %d: stopping itself before its third step\n", rank);
        raise(SIGSTOP);
    }
    /* every rank steps until a step fails (the survivors: the stop; the victim, once woken:
     * its peers stopped stepping) */
    while (st == MOE_STATUS_SUCCESS && now_s() - start < LOOP_S) {
        st = step(l, dx, dy, n, &t0, rank == victim && how == 1 && steps == 0);
        steps++;
    }
    verdict = now_s();
    if (rank == 0 && how >= 2)
        pthread_join(thr, NULL);
    if (rank != victim) {
        double since_stop = 0.0;
        fprintf(
            stderr, "trial %d: survivor rank %d: step %d got %s after %.2f s (timeout %d ms): %s\n",
            how, rank, steps, moe_status_string(st), verdict - t0, timeout_ms, moe_last_error());
        ok = (st == MOE_STATUS_TIMEOUT || st == MOE_STATUS_NCCL_ERROR) && verdict - t0 <= BOUND_S;
        if (how >= 2) { /* and within the bound of the stop itself */
            double at = stop.at;
            MPI_Bcast(&at, 1, MPI_DOUBLE, 0, survivors);
            since_stop = verdict - at;
            fprintf(stderr, "trial %d: survivor rank %d: verdict %.2f s after the stop\n", how,
                    rank, since_stop);
            ok = ok && since_stop <= BOUND_S;
        }
        /* a later call on the broken layer fails at once, naming the earlier failure */
        t0 = now_s();
        ok = ok && step(l, dx, dy, n, &t0, 0) == MOE_STATUS_INVALID_STATE && now_s() - t0 < 1.0;
        if (rank == 0) {
            sleep(1); /* the other survivors are past their timeout too */
            kill(pids[victim], SIGCONT);
        }
    } else {
        /* its peers' halves of a step may have landed before they aborted: any status, as long
         * as it returns */
        fprintf(stderr, "trial %d: rank %d (woken): step %d got %s\n", how, rank, steps,
                moe_status_string(st));
        ok = st != MOE_STATUS_SUCCESS;
    }
    /* teardown after the fault: bounded, and everything freed (compute-sanitizer's leak check
     * and ASan see the rest) */
    t0 = now_s();
    TU_OK(moe_layer_destroy(l));
    TU_OK(moe_runtime_destroy(rt));
    if (now_s() - t0 > BOUND_S) {
        fprintf(stderr, "trial %d: rank %d: teardown took %.2f s\n", how, rank, now_s() - t0);
        ok = 0;
    }
    cudaFree(dx);
    cudaFree(dy);
    fprintf(stderr, "trial %d: rank %d cleaned up: %s\n", how, rank, ok ? "ok" : "FAIL");
    MPI_Barrier(MPI_COMM_WORLD);
    return ok;
}

static int run(void)
{
    static const double delays[] = {0.05, 0.6, 1.7};
    float *x = malloc(sizeof(float) * 16 * 256);
    pid_t me = getpid();
    int ok = 1, how;

    pids = calloc((size_t)world, sizeof(pid_t));
    if (!x || !pids)
        return 1;
    victim = world - 1;
    if (getenv("MOE_TEST_FAULT_TIMEOUT_MS"))
        timeout_ms = atoi(getenv("MOE_TEST_FAULT_TIMEOUT_MS"));
    MPI_Allgather(&me, sizeof(pid_t), MPI_BYTE, pids, sizeof(pid_t), MPI_BYTE, MPI_COMM_WORLD);
    MPI_Comm_split(MPI_COMM_WORLD, rank == victim, rank, &survivors);
    moe_gen_tokens(1, 0, 16, 256, x);
    for (how = 0; how < 2 + (int)(sizeof(delays) / sizeof(delays[0])); how++)
        ok &= trial(how, how >= 2 ? delays[how - 2] : 0.0, x);
    MPI_Comm_free(&survivors);
    free(x);
    free(pids);
    return ok ? 0 : 1;
}

int main(int argc, char **argv)
{
    int rc, gate;
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    gate = world < 2 ? GT_SKIP : gt_mpi_gpu_gate(world);
    if (gate) {
        MPI_Finalize();
        return gate;
    }
    cudaSetDevice(gt_shared_gpu() ? 0 : rank);
    rc = run();
    MPI_Allreduce(MPI_IN_PLACE, &rc, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Finalize();
    return rc;
}
