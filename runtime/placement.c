/* SPDX-License-Identifier: Apache-2.0 */
/* Expert placement of a layer: the physical-to-logical slot map and its derived tables, the
 * collective placement change (validated, agreed, weights moved by the backend), the load
 * window and the rebalance that plans from it. */
#include <stdlib.h>
#include <string.h>

#include "base/diag.h"
#include "runtime/layer.h"
#include "runtime/weights.h"

/* Replica lists, local slots, the first replica of each expert and the local block, from
 * slot_logical / slot_owner / slot_local. */
static void derive_tables(moe_plan_t *p, int E)
{
    int s, e, n = 0;

    for (e = 0; e <= E; e++)
        p->replica_begin[e] = 0;
    for (s = 0; s < p->num_slots; s++)
        p->replica_begin[p->slot_logical[s] + 1]++;
    for (e = 0; e < E; e++)
        p->replica_begin[e + 1] += p->replica_begin[e];
    for (e = 0; e < E; e++)
        p->expert_owner[e] = -1;
    for (s = 0; s < p->num_slots; s++) {
        const int le = p->slot_logical[s];
        int at = p->replica_begin[le];
        while (at < p->replica_begin[le + 1] && p->replica_slot[at] >= 0)
            at++;
        p->replica_slot[at] = s;
        if (p->expert_owner[le] < 0) {
            p->expert_owner[le] = p->slot_owner[s];
            p->expert_local_index[le] = p->slot_local[s];
        }
        if (p->slot_owner[s] == p->ep_rank)
            p->local_logical[n++] = le;
    }
    p->num_local_experts = n;
    p->first_local_expert = n > 0 ? p->local_logical[0] : -1;
    for (s = 1; s < n; s++)
        if (p->local_logical[s] != p->local_logical[0] + s)
            p->first_local_expert = -1;
}

moe_status_t moe_plan_set_map(moe_plan_t *p, int E, const int32_t *map)
{
    const int S = p->num_slots / p->ep_size;
    int s;
    for (s = 0; s < p->num_slots; s++) {
        p->slot_logical[s] = map[s];
        p->slot_owner[s] = s / S;
        p->slot_local[s] = s % S;
        p->replica_slot[s] = -1;
    }
    p->placed = 1;
    derive_tables(p, E);
    return MOE_STATUS_SUCCESS;
}

/* Rank g's slots: its block of E / ep experts, then R / ep redundant slots holding the first
 * experts of rank g + 1 (mod ep). */
static void default_map(int E, int R, int ep, int32_t *map)
{
    const int B = E / ep, S = (E + R) / ep;
    int g, i;
    for (g = 0; g < ep; g++)
        for (i = 0; i < S; i++)
            map[g * S + i] = i < B ? g * B + i : ((g + 1) % ep) * B + (i - B) % B;
}

moe_status_t moe_plan_init_placement(moe_plan_t *p, int E, int R)
{
    const size_t n = (size_t)(E + R) + 1;
    int g, e;

    p->num_slots = E + R;
    p->slot_logical = malloc(sizeof(int32_t) * n);
    p->slot_owner = malloc(sizeof(int) * n);
    p->slot_local = malloc(sizeof(int) * n);
    p->replica_begin = malloc(sizeof(int) * ((size_t)E + 1));
    p->replica_slot = malloc(sizeof(int) * n);
    p->local_logical = malloc(sizeof(int) * n);
    p->expert_owner = malloc(sizeof(int) * (size_t)E);
    p->expert_local_index = malloc(sizeof(int) * (size_t)E);
    if (!p->slot_logical || !p->slot_owner || !p->slot_local || !p->replica_begin ||
        !p->replica_slot || !p->local_logical || !p->expert_owner || !p->expert_local_index)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "placement tables for %d slots", E + R);
    if (E % p->ep_size == 0) {
        default_map(E, R, p->ep_size, p->slot_logical);
        return moe_plan_set_map(p, E, p->slot_logical);
    }
    /* R = 0 (validated): contiguous blocks by the floor split, slot e holding expert e. */
    p->placed = 0;
    for (g = 0; g < p->ep_size; g++) {
        const int b = (int)moe_split_begin(E, p->ep_size, g);
        const int end = (int)moe_split_begin(E, p->ep_size, g + 1);
        for (e = b; e < end; e++) {
            p->slot_logical[e] = e;
            p->slot_owner[e] = g;
            p->slot_local[e] = e - b;
            p->replica_slot[e] = -1;
        }
    }
    derive_tables(p, E);
    return MOE_STATUS_SUCCESS;
}

void moe_plan_free_placement(moe_plan_t *p)
{
    free(p->slot_logical);
    free(p->slot_owner);
    free(p->slot_local);
    free(p->replica_begin);
    free(p->replica_slot);
    free(p->local_logical);
    free(p->expert_owner);
    free(p->expert_local_index);
}

/* ------------------------------------------------------------------------------------------ */
/* Placement change                                                                            */
/* ------------------------------------------------------------------------------------------ */

static moe_status_t check_map(const moe_layer_t *l, const int32_t *map, int n)
{
    const int E = l->cfg.num_experts, slots = l->plan.num_slots, ep = l->plan.ep_size;
    int *seen, i;

    if (!l->ops->set_placement)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "the %s backend does not change expert placement", l->ops->name);
    MOE_ARG_CHECK(map != NULL, "map = NULL");
    MOE_ARG_CHECK(n == slots, "n = %d: must be num_experts + num_redundant_experts = %d + %d = %d",
                  n, E, l->cfg.num_redundant_experts, slots);
    MOE_ARG_CHECK(l->plan.placed,
                  "num_experts + num_redundant_experts = %d slots do not split equally over "
                  "ep_size = %d ranks: a placement needs the same number of slots on every rank",
                  slots, ep);
    seen = calloc((size_t)E, sizeof(int));
    if (!seen)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "placement check of %d experts", E);
    for (i = 0; i < n; i++) {
        if (map[i] < 0 || map[i] >= E) {
            free(seen);
            return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                             "map[%d] = %d (slot %d of EP rank %d): not a logical expert 0..%d", i,
                             map[i], i % (n / ep), i / (n / ep), E - 1);
        }
        seen[map[i]]++;
    }
    for (i = 0; i < E; i++)
        if (!seen[i]) {
            free(seen);
            return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                             "logical expert %d is in no slot of the map: every expert must be "
                             "placed at least once",
                             i);
        }
    free(seen);
    return MOE_STATUS_SUCCESS;
}

/* Every rank passed the same map: MAX over {hash, -hash} gives max and -min. */
static moe_status_t agree_map(moe_layer_t *l, const int32_t *map, int n)
{
    uint64_t h = 1469598103934665603ULL;
    int64_t v[2];
    int i, b;
    for (i = 0; i < n; i++)
        for (b = 0; b < 4; b++) {
            h ^= (uint64_t)(((uint32_t)map[i] >> (8 * b)) & 0xff);
            h *= 1099511628211ULL;
        }
    v[0] = (int64_t)(h >> 1);
    v[1] = -v[0];
    MOE_CHECK(moe_comm_allreduce_i64(l->rt->comm, v, 2, MOE_REDUCE_MAX));
    if (v[0] != -v[1])
        return moe_error(MOE_STATUS_MISMATCH,
                         "ranks passed different maps to moe_layer_set_placement");
    return MOE_STATUS_SUCCESS;
}

/* Whether weights move: some expert weights set on some rank ([0]) and some not ([1]). */
static moe_status_t agree_weights(moe_layer_t *l, int *move)
{
    const int state = moe_layer_expert_weights_state(l);
    int64_t v[2] = {state != 0, state != 1};
    MOE_CHECK(moe_comm_allreduce_i64(l->rt->comm, v, 2, MOE_REDUCE_MAX));
    if (v[0] && v[1])
        return moe_error(MOE_STATUS_INVALID_STATE,
                         "some expert weights are set and others not (this rank: %s): set all "
                         "of them before a placement change, or none",
                         state == 0   ? "none"
                         : state == 1 ? "all"
                                      : "some");
    *move = (int)v[0];
    return MOE_STATUS_SUCCESS;
}

static int comm_failure(moe_status_t st)
{
    return st == MOE_STATUS_TIMEOUT || st == MOE_STATUS_MPI_ERROR || st == MOE_STATUS_NCCL_ERROR;
}

moe_status_t moe_layer_set_placement(moe_layer_t *l, const int32_t *map, int n)
{
    moe_placement_stats_t stats;
    moe_status_t st;
    double t0 = moe_now_us();
    int move = 0;

    moe_error_clear();
    MOE_ARG_CHECK(l != NULL, "layer = NULL");
    if (l->broken)
        return moe_error(MOE_STATUS_INVALID_STATE,
                         "the layer is unusable after an earlier communication failure");
    memset(&stats, 0, sizeof(stats));
    st = moe_comm_agree(l->rt->comm, check_map(l, map, n));
    if (st == MOE_STATUS_SUCCESS)
        st = agree_map(l, map, n);
    if (st == MOE_STATUS_SUCCESS)
        st = agree_weights(l, &move);
    if (st == MOE_STATUS_SUCCESS)
        st = l->ops->set_placement(l, map, move, &stats);
    if (st != MOE_STATUS_SUCCESS) {
        if (comm_failure(st))
            l->broken = 1;
        return st;
    }
    moe_plan_set_map(&l->plan, l->cfg.num_experts, map);
    moe_layer_mark_expert_weights(l, move);
    stats.seconds = (moe_now_us() - t0) * 1e-6;
    l->placement_stats = stats;
    MOE_LOG_INFO("EPLB", "placement set: %d slots received (%lld bytes), %d copied, %.3f s",
                 stats.slots_received, (long long)stats.bytes_received, stats.slots_copied,
                 stats.seconds);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_layer_get_placement(const moe_layer_t *l, int32_t *map, int n)
{
    moe_error_clear();
    MOE_ARG_CHECK(l != NULL, "layer = NULL");
    MOE_ARG_CHECK(map != NULL, "map = NULL");
    MOE_ARG_CHECK(n == l->plan.num_slots,
                  "n = %d: must be num_experts + num_redundant_experts = %d", n, l->plan.num_slots);
    memcpy(map, l->plan.slot_logical, sizeof(int32_t) * (size_t)n);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_layer_get_placement_stats(const moe_layer_t *l, moe_placement_stats_t *stats)
{
    moe_error_clear();
    MOE_ARG_CHECK(l != NULL, "layer = NULL");
    MOE_ARG_CHECK(stats != NULL, "stats = NULL");
    *stats = l->placement_stats;
    return MOE_STATUS_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Load window and rebalance                                                                   */
/* ------------------------------------------------------------------------------------------ */

moe_status_t moe_layer_get_expert_load_window(const moe_layer_t *l, int64_t *counts, int n)
{
    moe_error_clear();
    MOE_ARG_CHECK(l != NULL, "layer = NULL");
    MOE_ARG_CHECK(counts != NULL, "counts = NULL");
    MOE_ARG_CHECK(n == l->cfg.num_experts, "n = %d: must equal num_experts = %d", n,
                  l->cfg.num_experts);
    memcpy(counts, l->load_window, sizeof(int64_t) * (size_t)n);
    return l->ops->load_window ? l->ops->load_window(l, counts) : MOE_STATUS_SUCCESS;
}

moe_status_t moe_layer_reset_expert_load(moe_layer_t *l)
{
    moe_error_clear();
    MOE_ARG_CHECK(l != NULL, "layer = NULL");
    memset(l->load_window, 0, sizeof(int64_t) * (size_t)l->cfg.num_experts);
    return l->ops->reset_load_window ? l->ops->reset_load_window(l) : MOE_STATUS_SUCCESS;
}

/* EP ranks per host when the hosts hold whole EP ranks evenly; 0 (one level) otherwise. */
static int ep_ranks_per_node(const moe_layer_t *l)
{
    const int local = l->rt->info.local_size, tp = l->plan.tp_size, ep = l->plan.ep_size;
    if (local <= 0 || local % tp != 0 || ep % (local / tp) != 0)
        return 0;
    return local / tp;
}

moe_status_t moe_layer_rebalance(moe_layer_t *l)
{
    const int E = l ? l->cfg.num_experts : 0;
    int64_t *load = NULL, total = 0;
    int32_t *map = NULL;
    moe_status_t st;
    int e;

    moe_error_clear();
    MOE_ARG_CHECK(l != NULL, "layer = NULL");
    if (l->broken)
        return moe_error(MOE_STATUS_INVALID_STATE,
                         "the layer is unusable after an earlier communication failure");
    if (!l->ops->set_placement)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "the %s backend does not change expert placement", l->ops->name);
    if (!l->plan.placed)
        return moe_error(MOE_STATUS_INVALID_STATE,
                         "num_experts = %d does not split equally over ep_size = %d ranks: a "
                         "placement needs the same number of slots on every rank",
                         E, l->plan.ep_size);
    load = malloc(sizeof(int64_t) * (size_t)E);
    map = malloc(sizeof(int32_t) * (size_t)l->plan.num_slots);
    st = load && map ? MOE_STATUS_SUCCESS
                     : moe_error(MOE_STATUS_OUT_OF_MEMORY, "rebalance of %d experts", E);
    if (st == MOE_STATUS_SUCCESS) {
        memcpy(load, l->load_window, sizeof(int64_t) * (size_t)E);
        if (l->ops->load_window) /* the device's window */
            st = l->ops->load_window(l, load);
    }
    st = moe_comm_agree(l->rt->comm, st);
    if (st == MOE_STATUS_SUCCESS) {
        st = moe_comm_allreduce_i64(l->rt->comm, load, E, MOE_REDUCE_SUM);
        if (comm_failure(st))
            l->broken = 1;
    }
    if (st == MOE_STATUS_SUCCESS) {
        for (e = 0; e < E; e++)
            total += load[e];
        /* the same sums on every rank: the same plan, the same verdict */
        if (total > 0) {
            st = moe_eplb_plan(load, E, l->cfg.n_group, l->plan.ep_size, ep_ranks_per_node(l),
                               l->cfg.num_redundant_experts, map, l->plan.num_slots);
            if (st == MOE_STATUS_SUCCESS)
                st = moe_layer_set_placement(l, map, l->plan.num_slots);
        }
    }
    if (st == MOE_STATUS_SUCCESS) {
        memset(l->load_window, 0, sizeof(int64_t) * (size_t)E);
        if (l->ops->reset_load_window)
            st = l->ops->reset_load_window(l);
    }
    free(load);
    free(map);
    return st;
}
