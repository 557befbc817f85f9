/* SPDX-License-Identifier: Apache-2.0 */
/* The expert-placement planner (EPLB): DeepSeek's hierarchical algorithm over measured loads.
 * Pure: no communication, no layer, no allocation visible to the caller. docs/EPLB.md
 * describes the steps and their tie rules. */
#include <stdlib.h>
#include <string.h>

#include "moe/moe.h"
#include "base/diag.h"

struct keyed {
    double load;
    int item;
};

/* Scratch of one plan: every array sized once from E, R and the ranks. */
typedef struct eplb_work {
    double *item_load;   /* items of the packing at hand (groups, or one node's replicas) */
    double *node_load;   /* [E / nodes]: load of one node's logical experts */
    struct keyed *order; /* items sorted by falling load */
    int *pack_of;        /* [item] -> pack */
    int *rank_in_pack;   /* [item] -> position in its pack */
    double *pack_load;
    int *pack_items;
    int *node_logical; /* [E]: node-major logical experts (node n's E/nodes, group order) */
    int *replicas;     /* [E]: replicas of each node-local expert */
    int *phys_logical; /* [slots per node]: node-local expert of each physical expert */
} eplb_work_t;

/* Falling load, ties to the lower index, so the plan is the same on every machine. */
static int by_falling_load(const void *a, const void *b)
{
    const struct keyed *x = a, *y = b;
    if (x->load != y->load)
        return x->load > y->load ? -1 : 1;
    return x->item < y->item ? -1 : (x->item > y->item);
}

/* Packs n items into `packs` packs of exactly n / packs items each: heaviest item first, each
 * to the lightest pack that still has room (ties to the lower pack). */
static void balanced_packing(eplb_work_t *w, int n, int packs)
{
    const int per_pack = n / packs;
    int i, p;

    for (i = 0; i < n; i++) {
        w->order[i].load = w->item_load[i];
        w->order[i].item = i;
    }
    qsort(w->order, (size_t)n, sizeof(w->order[0]), by_falling_load);
    for (p = 0; p < packs; p++) {
        w->pack_load[p] = 0.0;
        w->pack_items[p] = 0;
    }
    for (i = 0; i < n; i++) {
        const int item = w->order[i].item;
        int best = -1;
        for (p = 0; p < packs; p++)
            if (w->pack_items[p] < per_pack && (best < 0 || w->pack_load[p] < w->pack_load[best]))
                best = p;
        w->pack_of[item] = best;
        w->rank_in_pack[item] = w->pack_items[best]++;
        w->pack_load[best] += w->item_load[item];
    }
}

/* Step 1: groups of E / groups experts to nodes, balanced by their summed load. Fills
 * node_logical: node n's experts at [n * E / nodes, ...), its groups in packing order. */
static void groups_to_nodes(eplb_work_t *w, const int64_t *load, int E, int groups, int nodes)
{
    const int gsize = E / groups, per_node = groups / nodes;
    int g, e;

    for (g = 0; g < groups; g++) {
        w->item_load[g] = 0.0;
        for (e = 0; e < gsize; e++)
            w->item_load[g] += (double)load[g * gsize + e];
    }
    balanced_packing(w, groups, nodes);
    for (g = 0; g < groups; g++) {
        const int at = (w->pack_of[g] * per_node + w->rank_in_pack[g]) * gsize;
        for (e = 0; e < gsize; e++)
            w->node_logical[at + e] = g * gsize + e;
    }
}

/* Step 2, for one node of n experts and m >= n physical slots: each redundant slot replicates
 * the expert of the largest load per replica (ties to the lower node-local index). */
static void replicate(eplb_work_t *w, const double *load, int n, int m)
{
    int i, e;

    for (e = 0; e < n; e++) {
        w->replicas[e] = 1;
        w->phys_logical[e] = e;
    }
    for (i = n; i < m; i++) {
        int best = 0;
        for (e = 1; e < n; e++)
            if (load[e] / w->replicas[e] > load[best] / w->replicas[best])
                best = e;
        w->phys_logical[i] = best;
        w->replicas[best]++;
    }
}

static moe_status_t check_plan_args(const int64_t *load, int E, int groups, int ranks,
                                    int ranks_per_node, int R, const int32_t *map, int n)
{
    int e;
    MOE_ARG_CHECK(load != NULL, "load = NULL");
    MOE_ARG_CHECK(map != NULL, "map = NULL");
    MOE_ARG_CHECK(E > 0, "num_experts = %d: must be > 0", E);
    MOE_ARG_CHECK(ranks > 0, "num_ranks = %d: must be > 0", ranks);
    MOE_ARG_CHECK(R >= 0, "num_redundant = %d: must be >= 0", R);
    MOE_ARG_CHECK(groups >= 0, "num_groups = %d: must be >= 0 (0 or 1: no groups)", groups);
    MOE_ARG_CHECK(ranks_per_node >= 0 && (ranks_per_node == 0 || ranks % ranks_per_node == 0),
                  "ranks_per_node = %d: must divide num_ranks = %d (0: one node)", ranks_per_node,
                  ranks);
    MOE_ARG_CHECK(E % ranks == 0, "num_experts = %d: must be a multiple of num_ranks = %d", E,
                  ranks);
    MOE_ARG_CHECK(R % ranks == 0, "num_redundant = %d: must be a multiple of num_ranks = %d", R,
                  ranks);
    MOE_ARG_CHECK(n == E + R, "map length = %d: must be num_experts + num_redundant = %d", n,
                  E + R);
    for (e = 0; e < E; e++)
        MOE_ARG_CHECK(load[e] >= 0, "load[%d] = %lld: must be >= 0", e, (long long)load[e]);
    return MOE_STATUS_SUCCESS;
}

static void work_free(eplb_work_t *w)
{
    free(w->item_load);
    free(w->node_load);
    free(w->order);
    free(w->pack_of);
    free(w->rank_in_pack);
    free(w->pack_load);
    free(w->pack_items);
    free(w->node_logical);
    free(w->replicas);
    free(w->phys_logical);
}

static moe_status_t work_alloc(eplb_work_t *w, int E, int slots, int ranks)
{
    const size_t n = (size_t)(slots > E ? slots : E) + 1;
    memset(w, 0, sizeof(*w));
    w->item_load = malloc(sizeof(double) * n);
    w->node_load = malloc(sizeof(double) * n);
    w->order = malloc(sizeof(w->order[0]) * n);
    w->pack_of = malloc(sizeof(int) * n);
    w->rank_in_pack = malloc(sizeof(int) * n);
    w->pack_load = malloc(sizeof(double) * ((size_t)ranks + 1));
    w->pack_items = malloc(sizeof(int) * ((size_t)ranks + 1));
    w->node_logical = malloc(sizeof(int) * n);
    w->replicas = malloc(sizeof(int) * n);
    w->phys_logical = malloc(sizeof(int) * n);
    if (!w->item_load || !w->node_load || !w->order || !w->pack_of || !w->rank_in_pack ||
        !w->pack_load || !w->pack_items || !w->node_logical || !w->replicas || !w->phys_logical) {
        work_free(w);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "eplb plan of %d slots", slots);
    }
    return MOE_STATUS_SUCCESS;
}

/* Steps 2 and 3 for node `node`: replicate its experts into its slots, then pack the replicas
 * (each carrying load / replicas) onto its ranks, S slots each. */
static void place_node(eplb_work_t *w, const int64_t *load, int E, int slots, int nodes,
                       int ranks_per_node, int node, int32_t *map)
{
    const int n = E / nodes, m = slots / nodes, S = slots / (nodes * ranks_per_node);
    const int *logical = w->node_logical + node * n;
    double *node_load = w->node_load;
    int i;

    for (i = 0; i < n; i++)
        node_load[i] = (double)load[logical[i]];
    replicate(w, node_load, n, m);
    for (i = 0; i < m; i++)
        w->item_load[i] = node_load[w->phys_logical[i]] / w->replicas[w->phys_logical[i]];
    balanced_packing(w, m, ranks_per_node);
    for (i = 0; i < m; i++) {
        const int rank = node * ranks_per_node + w->pack_of[i];
        map[rank * S + w->rank_in_pack[i]] = logical[w->phys_logical[i]];
    }
}

moe_status_t moe_eplb_plan(const int64_t *load, int num_experts, int num_groups, int num_ranks,
                           int ranks_per_node, int num_redundant, int32_t *map, int map_len)
{
    const int E = num_experts, slots = num_experts + num_redundant;
    int nodes, rpn, groups, node;
    eplb_work_t w;

    moe_error_clear();
    MOE_CHECK(check_plan_args(load, E, num_groups, num_ranks, ranks_per_node, num_redundant, map,
                              map_len));
    rpn = ranks_per_node ? ranks_per_node : num_ranks;
    nodes = num_ranks / rpn;
    groups = num_groups > 1 ? num_groups : 1;
    /* The hierarchy needs whole groups per node (DeepSeek's rule); else one global level. */
    if (groups == 1 || E % groups != 0 || groups % nodes != 0) {
        groups = 1;
        nodes = 1;
        rpn = num_ranks;
    }
    MOE_CHECK(work_alloc(&w, E, slots, num_ranks));
    groups_to_nodes(&w, load, E, groups, nodes);
    for (node = 0; node < nodes; node++)
        place_node(&w, load, E, slots, nodes, rpn, node, map);
    work_free(&w);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_eplb_rank_loads(const int64_t *load, int num_experts, const int32_t *map,
                                 int map_len, int num_ranks, double *rank_load)
{
    int *replicas = NULL;
    int i, S;

    moe_error_clear();
    MOE_ARG_CHECK(load != NULL && map != NULL && rank_load != NULL,
                  "load, map and rank_load must not be NULL");
    MOE_ARG_CHECK(num_experts > 0 && num_ranks > 0 && map_len > 0 && map_len % num_ranks == 0,
                  "map length = %d: must be a positive multiple of num_ranks = %d", map_len,
                  num_ranks);
    replicas = calloc((size_t)num_experts, sizeof(int));
    if (!replicas)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "replica counts of %d experts", num_experts);
    for (i = 0; i < map_len; i++) {
        if (map[i] < 0 || map[i] >= num_experts) {
            free(replicas);
            return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                             "map[%d] = %d: not a logical expert (0..%d)", i, map[i],
                             num_experts - 1);
        }
        replicas[map[i]]++;
    }
    S = map_len / num_ranks;
    for (i = 0; i < num_ranks; i++)
        rank_load[i] = 0.0;
    for (i = 0; i < map_len; i++)
        rank_load[i / S] += (double)load[map[i]] / replicas[map[i]];
    free(replicas);
    return MOE_STATUS_SUCCESS;
}
