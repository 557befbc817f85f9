/* SPDX-License-Identifier: Apache-2.0 */
/* hwloc binding of a rank's threads and memory to its GPU's NUMA node (or to its share of
 * the host's cores on the CPU backend). */
#ifndef MOE_TOPOLOGY_H
#define MOE_TOPOLOGY_H

#include "runtime/layer.h"

/* Fills rt->info.numa_node and rt->info.cpuset; binds this thread (and the process's memory
 * policy) there. */
moe_status_t moe_topology_bind(moe_runtime_t *rt);

#endif /* MOE_TOPOLOGY_H */
