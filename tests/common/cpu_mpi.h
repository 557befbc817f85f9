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

#endif /* MOE_CPU_MPI_H */
