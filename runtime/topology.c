/* SPDX-License-Identifier: Apache-2.0 */
/* hwloc binding: a GPU rank to the cores and memory of its GPU's NUMA node (PCI locality); a
 * CPU rank to its share of the host's cores. Failure to bind is a warning, not an error. */
#include "runtime/topology.h"

#include <hwloc.h>
#include <stdio.h>
#include "base/diag.h"
#ifdef MOE_HAVE_CUDA
#include "kernels/gpu_topo.h"
#endif

/* The cpuset of a GPU: the first non-I/O ancestor of its PCI device. */
static hwloc_const_cpuset_t gpu_cpuset(hwloc_topology_t topo, const moe_runtime_t *rt)
{
#ifdef MOE_HAVE_CUDA
    char bus[32];
    hwloc_obj_t obj;
    if (rt->info.device < 0 || moe_gpu_pci_bus_id(rt->info.device, bus, sizeof(bus)))
        return NULL;
    obj = hwloc_get_pcidev_by_busidstring(topo, bus);
    if (!obj)
        return NULL;
    obj = hwloc_get_non_io_ancestor_obj(topo, obj);
    return obj ? obj->cpuset : NULL;
#else
    (void)topo;
    (void)rt;
    return NULL;
#endif
}

/* Rank i of n on the host gets the i-th of n equal slices of the host's cores. */
static hwloc_bitmap_t share_of_cores(hwloc_topology_t topo, int i, int n)
{
    int ncores = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE);
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    int c, lo, hi;
    if (ncores <= 0 || !set)
        return set;
    lo = (int)((long)ncores * i / n);
    hi = (int)((long)ncores * (i + 1) / n);
    if (hi == lo) /* more ranks than cores: share one */
        hi = lo + 1 > ncores ? ncores : lo + 1, lo = hi - 1;
    for (c = lo; c < hi; c++) {
        hwloc_obj_t core = hwloc_get_obj_by_type(topo, HWLOC_OBJ_CORE, (unsigned)c);
        if (core)
            hwloc_bitmap_or(set, set, core->cpuset);
    }
    return set;
}

moe_status_t moe_topology_bind(moe_runtime_t *rt)
{
    hwloc_topology_t topo;
    hwloc_bitmap_t set = NULL, nodes = NULL;
    hwloc_const_cpuset_t gset;
    hwloc_obj_t numa;

    if (hwloc_topology_init(&topo) != 0)
        return moe_error(MOE_STATUS_INTERNAL_ERROR, "hwloc_topology_init failed");
    hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
    if (hwloc_topology_load(topo) != 0) {
        hwloc_topology_destroy(topo);
        return moe_error(MOE_STATUS_INTERNAL_ERROR, "hwloc_topology_load failed");
    }
    gset = gpu_cpuset(topo, rt);
    set = gset ? hwloc_bitmap_dup(gset)
               : share_of_cores(topo, rt->info.local_rank, rt->info.local_size);
    if (set && !hwloc_bitmap_iszero(set)) {
        if (hwloc_set_cpubind(topo, set, HWLOC_CPUBIND_THREAD) != 0)
            MOE_LOG_WARN("INIT", "hwloc: could not bind to the cores chosen");
        hwloc_bitmap_list_snprintf(rt->info.cpuset, sizeof(rt->info.cpuset), set);
        nodes = hwloc_bitmap_alloc();
        hwloc_cpuset_to_nodeset(topo, set, nodes);
        numa = hwloc_get_next_obj_covering_cpuset_by_type(topo, set, HWLOC_OBJ_NUMANODE, NULL);
        rt->info.numa_node = numa ? (int)numa->os_index : -1;
        if (hwloc_set_membind(topo, nodes, HWLOC_MEMBIND_BIND,
                              HWLOC_MEMBIND_THREAD | HWLOC_MEMBIND_BYNODESET) != 0)
            MOE_LOG_INFO("INIT", "hwloc: memory binding not available here");
    }
    hwloc_bitmap_free(nodes);
    hwloc_bitmap_free(set);
    hwloc_topology_destroy(topo);
    return MOE_STATUS_SUCCESS;
}
