/* SPDX-License-Identifier: Apache-2.0 */
/* The CPU-backend runtimes of a multi-rank cmocka group: one over MPI_COMM_WORLD and one on this
 * rank alone, with the group's setup and teardown (rank and world filled in). */
#ifndef MOE_CPU_MPI_H
#define MOE_CPU_MPI_H

#include <mpi.h>

#include "moe/moe.h"

static moe_runtime_t *rt_world, *rt_self;
static int rank, world;

static int setup(void **state)
{
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    MPI_Comm self = MPI_COMM_SELF;
    (void)state;
    rc.backend = MOE_BACKEND_CPU;
    rc.timeout_ms = 60000;
    if (moe_runtime_create(&rc, NULL, &rt_world) || moe_runtime_create(&rc, &self, &rt_self))
        return -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    moe_runtime_destroy(rt_self);
    moe_runtime_destroy(rt_world);
    return 0;
}

/* main() of a multi-rank cmocka test over these runtimes: rank 0 reports, every rank returns
 * the worst exit code. */
#define CPU_MPI_MAIN(tests)                                                                        \
    int main(int argc, char **argv)                                                                \
    {                                                                                              \
        int rc_, r_;                                                                               \
        MPI_Init(&argc, &argv);                                                                    \
        MPI_Comm_rank(MPI_COMM_WORLD, &r_);                                                        \
        if (r_ != 0) /* one report; failures still set every rank's exit code */                   \
            cmocka_set_message_output(CM_OUTPUT_SUBUNIT);                                          \
        rc_ = cmocka_run_group_tests(tests, setup, teardown);                                      \
        MPI_Allreduce(MPI_IN_PLACE, &rc_, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);                    \
        MPI_Finalize();                                                                            \
        return rc_ ? 1 : 0;                                                                        \
    }

#endif /* MOE_CPU_MPI_H */
