/* SPDX-License-Identifier: Apache-2.0 */
/* Multi-GPU test helpers (one rank per GPU): the one skip/fail verdict for all ranks, and the
 * three runtimes the comparisons use (CUDA over the world, CUDA on this rank alone, CPU on this
 * rank alone). */
#ifndef MOE_GPU_MPI_H
#define MOE_GPU_MPI_H

#include <cuda_runtime.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "launch/layer_gen.h"
#include "testutil.h"

#include "gpu_skip.h"
#include "moe/moe.h"

/* 0 to run (a GPU per rank on every rank), else the exit code every rank returns after
 * MPI_Finalize: GT_SKIP only when some rank has too few devices and none failed. */
/* MOE_TEST_SHARED_GPU=1: the ranks may share GPUs (a one-GPU machine). NCCL refuses two ranks
 * on one GPU of one host, so each rank takes its own NCCL_HOSTID (gt_mpi_gpu_gate, before any
 * NCCL call): NCCL then sees a host per rank and joins them with its socket transport over
 * loopback, and the NCCL transports (allgather, p2p, TP) run too -- as the path between hosts
 * runs, for correctness, not speed. MOE_TEST_SHARED_GPU=lsa: no NCCL, only lsa is tested. */
static inline int gt_shared_gpu(void)
{
    const char *v = getenv("MOE_TEST_SHARED_GPU");
    return v && (v[0] == '1' || !strcmp(v, "lsa"));
}

/* whether the NCCL transports can run here (not on ranks sharing a GPU without host ids) */
static inline int gt_nccl_runs(void)
{
    const char *v = getenv("MOE_TEST_SHARED_GPU");
    return !gt_shared_gpu() || strcmp(v, "lsa") != 0;
}

static inline int gt_mpi_gpu_gate(int world)
{
    int g = gt_gpu_gate(gt_shared_gpu() ? 1 : world);
    if (gt_shared_gpu() && gt_nccl_runs()) {
        char id[64];
        int rank = 0;
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        snprintf(id, sizeof(id), "moe-test-shared-gpu-rank-%d", rank);
        setenv("NCCL_HOSTID", id, 1);
        setenv("NCCL_SOCKET_IFNAME", "lo", 0);
        setenv("NCCL_IB_DISABLE", "1", 0);
    }
    g = g == GT_SKIP ? 1 : g == 0 ? 0 : 2; /* a failure wins over a skip */
    MPI_Allreduce(MPI_IN_PLACE, &g, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return g == 0 ? 0 : g == 1 ? GT_SKIP : 1;
}

static inline int moe_gpu_count_for_tests(void)
{
    int n = 0;
    return moe_gpu_probe(&n) == MOE_STATUS_SUCCESS && n > 0 ? n : 1;
}

typedef struct gt_runtimes {
    moe_runtime_t *gpu, *gpu_self, *cpu_self;
} gt_runtimes_t;

static inline int gt_runtimes_create(gt_runtimes_t *r, int rank, int timeout_ms)
{
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    MPI_Comm self = MPI_COMM_SELF;
    rc.timeout_ms = timeout_ms;
    rc.backend = MOE_BACKEND_CUDA;
    if (moe_runtime_create(&rc, NULL, &r->gpu))
        return -1;
    /* the one-rank runtime on this rank's own GPU (single node) */
    rc.device = gt_shared_gpu() ? rank % moe_gpu_count_for_tests() : rank;
    if (moe_runtime_create(&rc, &self, &r->gpu_self))
        return -1;
    rc.device = -1;
    rc.backend = MOE_BACKEND_CPU;
    return moe_runtime_create(&rc, &self, &r->cpu_self) ? -1 : 0;
}

static inline void gt_runtimes_destroy(gt_runtimes_t *r)
{
    moe_runtime_destroy(r->cpu_self);
    moe_runtime_destroy(r->gpu_self);
    moe_runtime_destroy(r->gpu);
}

/* The runtimes of a multi-GPU cmocka group (its setup and teardown; peers time out at 120 s,
 * or MOE_TEST_PEER_TIMEOUT_MS: under compute-sanitizer NCCL's start-up alone can take longer). */
static gt_runtimes_t gt_rts;

static inline int gt_group_setup(void **state)
{
    int rank = 0;
    const char *v = getenv("MOE_TEST_PEER_TIMEOUT_MS");
    const long ms = v ? strtol(v, NULL, 10) : 0;
    (void)state;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    return gt_runtimes_create(&gt_rts, rank, ms > 0 && ms <= 3600000 ? (int)ms : 120000);
}

/* MOE_TEST_MAX_TOKENS: the largest token count the shape tests run (a sanitizer's scale: every
 * shape and kernel variant, fewer rows); unset or invalid: no bound. */
static inline int64_t gt_max_tokens(void)
{
    const char *v = getenv("MOE_TEST_MAX_TOKENS");
    const long long n = v ? strtoll(v, NULL, 10) : 0;
    return n > 0 ? (int64_t)n : INT64_MAX;
}

static inline int gt_group_teardown(void **state)
{
    (void)state;
    gt_runtimes_destroy(&gt_rts);
    return 0;
}

/* main() of a multi-GPU cmocka test: MPI up, the gate, rank r on GPU r (single node), the
 * group run on every rank (rank 0 prints), one exit code for all. Needs cmocka.h first. */
#define GT_MPI_MAIN(tests, setup, teardown, rank_var, world_var)                                   \
    int main(int argc, char **argv)                                                                \
    {                                                                                              \
        int rc_;                                                                                   \
        MPI_Init(&argc, &argv);                                                                    \
        MPI_Comm_rank(MPI_COMM_WORLD, &rank_var);                                                  \
        MPI_Comm_size(MPI_COMM_WORLD, &world_var);                                                 \
        rc_ = gt_mpi_gpu_gate(world_var);                                                          \
        if (rc_ == 0) {                                                                            \
            int ngpu_ = 1; /* ranks sharing one GPU (MOE_TEST_SHARED_GPU) all take device 0 */     \
            if (moe_gpu_probe(&ngpu_) != MOE_STATUS_SUCCESS || ngpu_ < 1)                          \
                ngpu_ = 1;                                                                         \
            moe_gpu_set_device(rank_var % ngpu_);                                                  \
            if (rank_var != 0)                                                                     \
                cmocka_set_message_output(CM_OUTPUT_SUBUNIT);                                      \
            gt_test_filter(); /* e.g. MOE_TEST_FILTER=test_ep*: a subset */                        \
            rc_ = cmocka_run_group_tests(tests, setup, teardown) ? 1 : 0;                          \
            MPI_Allreduce(MPI_IN_PLACE, &rc_, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);                \
        }                                                                                          \
        MPI_Finalize();                                                                            \
        return rc_;                                                                                \
    }

/* y (host) = layer(x (host)) on runtime rt (weights from moe_gen_set_weights(seed), or
 * `static_scales`: moe_gen_set_weights_static(seed)), as `steps` forwards of n tokens each on
 * one layer (rows r n .. r n + n - 1 in step r); device buffers, y poisoned with NaN first,
 * when it is a CUDA runtime. */
static inline void gt_run_layer_steps(moe_runtime_t *rt, moe_layer_config_t c, uint64_t seed,
                                      int static_scales, const float *x, int64_t n, int steps,
                                      const float *logits, float *y,
                                      int64_t max_tokens_across_ranks)
{
    moe_runtime_info_t ri;
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    const size_t bytes = sizeof(float) * (size_t)(n * c.hidden + 1);
    void *dx = NULL, *dy = NULL, *dl = NULL;
    int64_t i;

    TU_OK(moe_runtime_get_info(rt, &ri));
    TU_OK(moe_layer_create(rt, &c, &l));
    if (static_scales)
        TU_OK(moe_gen_set_weights_static(l, &c, seed));
    else
        TU_OK(moe_gen_set_weights(l, &c, seed));
    if (ri.backend == MOE_BACKEND_CUDA) {
        assert_int_equal(cudaMalloc(&dx, bytes), cudaSuccess);
        assert_int_equal(cudaMalloc(&dy, bytes), cudaSuccess);
        if (logits)
            assert_int_equal(cudaMalloc(&dl, sizeof(float) * (size_t)(n * c.num_experts + 1)), 0);
    }
    for (int r = 0; r < steps; r++) {
        const float *xr = x + (size_t)r * n * c.hidden;
        const float *lr = logits ? logits + (size_t)r * n * c.num_experts : NULL;
        float *yr = y + (size_t)r * n * c.hidden;
        a.num_tokens = n;
        a.max_tokens_across_ranks = max_tokens_across_ranks;
        if (ri.backend == MOE_BACKEND_CUDA) {
            assert_int_equal(cudaMemcpy(dx, xr, bytes - sizeof(float), cudaMemcpyHostToDevice), 0);
            assert_int_equal(cudaMemset(dy, 0xff, bytes), cudaSuccess); /* NaN poison */
            if (lr)
                assert_int_equal(cudaMemcpy(dl, lr, sizeof(float) * (size_t)(n * c.num_experts),
                                            cudaMemcpyHostToDevice),
                                 0);
            a.x = dx;
            a.y = dy;
            a.router_logits = dl;
        } else {
            for (i = 0; i < n * c.hidden; i++)
                yr[i] = NAN;
            a.x = xr;
            a.y = yr;
            a.router_logits = lr;
        }
        TU_OK(moe_layer_forward(l, &a));
        if (ri.backend == MOE_BACKEND_CUDA) {
            assert_int_equal(cudaDeviceSynchronize(), cudaSuccess);
            assert_int_equal(cudaMemcpy(yr, dy, bytes - sizeof(float), cudaMemcpyDeviceToHost), 0);
        }
    }
    if (ri.backend == MOE_BACKEND_CUDA) {
        cudaFree(dx);
        cudaFree(dy);
        cudaFree(dl);
    }
    TU_OK(moe_layer_destroy(l));
}

static inline void gt_run_layer(moe_runtime_t *rt, moe_layer_config_t c, uint64_t seed,
                                const float *x, int64_t n, const float *logits, float *y,
                                int64_t max_tokens_across_ranks)
{
    gt_run_layer_steps(rt, c, seed, 0, x, n, 1, logits, y, max_tokens_across_ranks);
}

#endif /* MOE_GPU_MPI_H */
