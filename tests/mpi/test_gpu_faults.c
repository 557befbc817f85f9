/* SPDX-License-Identifier: Apache-2.0 */
/* GPU fault test (2+ GPUs, one rank each): the last rank stops (SIGSTOP) in the middle of a run,
 * before its third step. Every other rank's third step must end with MOE_STATUS_TIMEOUT (or a
 * NCCL error; the default transport on one host is lsa, whose device-side waits time out) within
 * timeout_ms + 1 s of its forward call, never hang, and the layer refuses later steps. Rank 0 then
 * wakes the stopped rank (SIGCONT), whose step returns (any status: its peers' halves may have
 * landed before they aborted), and every rank cleans up and exits normally: MPI itself is
 * unaffected, so the job ends with exit code 0. */
#include "gpu_mpi.h"
#include "testutil.h"

#include <cuda_runtime.h>
#include <mpi.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "launch/layer_gen.h"

#define TIMEOUT_MS 3000

static int rank, world;

/* One step; *s: its seconds from the forward call (p2p reads the counts on the host, so its
 * forward is where a dead peer is waited for) to the synchronize's return. */
static moe_status_t step(moe_layer_t *l, void *dx, void *dy, int64_t n, double *s)
{
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    moe_status_t st;
    const double t0 = MPI_Wtime();
    a.num_tokens = n;
    a.x = dx;
    a.y = dy;
    st = moe_layer_forward(l, &a);
    if (st == MOE_STATUS_SUCCESS)
        st = moe_layer_synchronize(l, NULL);
    *s = MPI_Wtime() - t0;
    return st;
}

static int run(void)
{
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    moe_runtime_t *rt = NULL;
    moe_layer_t *l = NULL;
    const int64_t n = 16;
    const int victim = world - 1;
    float *x = malloc(sizeof(float) * 16 * 256);
    void *dx = NULL, *dy = NULL;
    pid_t *pids = calloc((size_t)world, sizeof(pid_t));
    pid_t me = getpid();
    double dt = 0.0;
    moe_status_t st;
    int ok = 1;

    if (!x || !pids)
        return 1;
    MPI_Allgather(&me, sizeof(pid_t), MPI_BYTE, pids, sizeof(pid_t), MPI_BYTE, MPI_COMM_WORLD);
    rc.backend = MOE_BACKEND_CUDA;
    rc.timeout_ms = TIMEOUT_MS;
    c.num_experts = 8;
    c.top_k = 2;
    c.hidden = 256;
    c.intermediate = 128;
    c.max_tokens_per_rank = n;
    TU_OK(moe_runtime_create(&rc, NULL, &rt));
    TU_OK(moe_layer_create(rt, &c, &l));
    TU_OK(moe_gen_set_weights(l, &c, tu_seed("gpu_faults")));
    moe_gen_tokens(1, 0, n, c.hidden, x);
    if (cudaMalloc(&dx, sizeof(float) * 16 * 256) || cudaMalloc(&dy, sizeof(float) * 16 * 256) ||
        cudaMemcpy(dx, x, sizeof(float) * 16 * 256, cudaMemcpyHostToDevice))
        return 1;
    for (int i = 0; i < 2; i++)
        TU_OK(step(l, dx, dy, n, &dt));
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == victim) {
        fprintf(stderr, "rank %d: stopping itself before step 3\n", rank);
        raise(SIGSTOP); /* until rank 0's SIGCONT */
        st = step(l, dx, dy, n, &dt);
        /* its peers' halves of the step may have landed before they aborted: any status, as
         * long as it returns */
        fprintf(stderr, "rank %d (woken): step 3 got %s after %.2f s\n", rank,
                moe_status_string(st), dt);
    } else {
        st = step(l, dx, dy, n, &dt);
        fprintf(stderr, "survivor rank %d: step 3 got %s after %.2f s (timeout %d ms): %s\n", rank,
                moe_status_string(st), dt, TIMEOUT_MS, moe_last_error());
        ok = (st == MOE_STATUS_TIMEOUT || st == MOE_STATUS_NCCL_ERROR) &&
             dt <= TIMEOUT_MS / 1000.0 + 1.0;
        /* a later call on the broken layer fails at once, naming the earlier failure */
        ok = ok && step(l, dx, dy, n, &dt) == MOE_STATUS_INVALID_STATE;
        if (rank == 0) {
            sleep(1); /* the other survivors are past their timeout too */
            kill(pids[victim], SIGCONT);
        }
    }
    TU_OK(moe_layer_destroy(l));
    TU_OK(moe_runtime_destroy(rt));
    fprintf(stderr, "rank %d cleaned up: %s\n", rank, ok ? "ok" : "FAIL");
    cudaFree(dx);
    cudaFree(dy);
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
