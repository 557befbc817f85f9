/* SPDX-License-Identifier: Apache-2.0 */
/* Optional typed helpers for callers that use MPI: pass an MPI_Comm by value. */
#ifndef MOE_MOE_MPI_H
#define MOE_MOE_MPI_H

#include <mpi.h>
#include "moe/moe.h"

/* Collective over `comm`; see moe_runtime_create. */
static inline moe_status_t moe_runtime_create_mpi(const moe_runtime_config_t *config, MPI_Comm comm,
                                                  moe_runtime_t **runtime)
{
    return moe_runtime_create(config, &comm, runtime);
}

#endif /* MOE_MOE_MPI_H */
