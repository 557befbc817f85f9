/* SPDX-License-Identifier: Apache-2.0 */
/* Expert placement on the CUDA backend (docs/EPLB.md): the device copy of the slot tables (each
 * logical expert's replica slots, and with EP each slot's rank), the collective placement change
 * (moe_backend_ops_t.set_placement: the weights of the slots this rank newly holds, staged
 * through host memory and moved by MPI point-to-point, moe_comm_exchange) and the device load
 * window (rows per logical expert of this rank's tokens, counted by the slot kernel). */
#include <stdlib.h>
#include <string.h>

#include "base/diag.h"
#include "base/numeric.h"
#include "kernels/gpu.h"
#include "runtime/cuda/one_gpu.h"

moe_status_t moe_cuda_upload_placement(const moe_plan_t *p, cuda_layer_t *s)
{
    const int E = s->E_total, n = s->n_slots;
    int32_t *h = malloc(sizeof(int32_t) * ((size_t)E + 1 + (size_t)n));
    moe_status_t st;
    int i;

    if (p->num_slots != n)
        return moe_error(MOE_STATUS_INTERNAL_ERROR, "placement of %d slots, layer of %d",
                         p->num_slots, n);
    if (!h)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "placement tables of %d slots", n);
    for (i = 0; i <= E; i++)
        h[i] = p->replica_begin[i];
    for (i = 0; i < n; i++)
        h[E + 1 + i] = p->replica_slot[i];
    st = moe_gpu_memcpy_h2d(s->replica_begin, h, sizeof(int32_t) * ((size_t)E + 1));
    if (st == MOE_STATUS_SUCCESS)
        st = moe_gpu_memcpy_h2d(s->replica_slot, h + E + 1, sizeof(int32_t) * (size_t)n);
    if (st == MOE_STATUS_SUCCESS && s->owner) { /* EP (tp_size 1 on the all-to-all) */
        for (i = 0; i < n; i++)
            h[i] = p->slot_owner[i] * p->tp_size;
        st = moe_gpu_memcpy_h2d(s->owner, h, sizeof(int32_t) * (size_t)n);
    }
    free(h);
    return st;
}

/* The forwards queued so far have finished. One GPU: the whole device, whatever stream they
 * ran on. Across GPUs the last forward's stream, bounded (a dead peer must not hang the call):
 * through NCCL's watchdog, or (lsa) by the host's deadline as moe_cuda_host_wait bounds it. */
static moe_status_t drain(const moe_layer_t *l)
{
    const cuda_layer_t *s = l->state;
    if (s->nccl)
        return moe_nccl_wait(s->nccl, s->last_stream);
    if (l->plan.world > 1)
        return moe_gpu_stream_wait_bounded(s->last_stream, (int64_t)l->rt->timeout_ms + 1000,
                                           "the forwards before a placement change or load read");
    return moe_gpu_device_synchronize();
}

/* ------------------------------------------------------------------------------------------ */
/* Load window                                                                                 */
/* ------------------------------------------------------------------------------------------ */

moe_status_t moe_cuda_load_window(const moe_layer_t *l, int64_t *counts)
{
    const cuda_layer_t *s = l->state;
    const int E = l->cfg.num_experts;
    unsigned long long *h;
    moe_status_t st;
    int e;

    if (!s)
        return moe_error(MOE_STATUS_INVALID_STATE, "CUDA layer not initialised");
    h = malloc(sizeof(unsigned long long) * (size_t)E);
    if (!h)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "load window of %d experts", E);
    st = drain(l);
    if (st == MOE_STATUS_SUCCESS)
        st = moe_gpu_memcpy_d2h(h, s->load, sizeof(unsigned long long) * (size_t)E);
    for (e = 0; st == MOE_STATUS_SUCCESS && e < E; e++)
        counts[e] += (int64_t)h[e];
    free(h);
    return st;
}

moe_status_t moe_cuda_reset_load_window(moe_layer_t *l)
{
    cuda_layer_t *s = l->state;
    if (!s)
        return moe_error(MOE_STATUS_INVALID_STATE, "CUDA layer not initialised");
    MOE_CHECK(drain(l));
    return moe_gpu_memset(s->load, 0, sizeof(unsigned long long) * (size_t)l->cfg.num_experts);
}

/* ------------------------------------------------------------------------------------------ */
/* Placement change                                                                            */
/* ------------------------------------------------------------------------------------------ */

/* One local slot's weights as one host blob: gate/up, down, (W8A8) their row scales, (W8A8 per
 * row) the three input scales. */
typedef struct slot_layout {
    size_t w13, w2, w13s, w2s, meta, bytes; /* the pieces' bytes; bytes: their sum */
} slot_layout_t;

static slot_layout_t slot_layout(const cuda_layer_t *s)
{
    const size_t H = (size_t)s->H, is = (size_t)s->is, eb = s->f8 ? 1 : 2;
    slot_layout_t b;
    b.w13 = eb * 2 * is * H;
    b.w2 = eb * H * is;
    b.w13s = s->f8 ? sizeof(float) * 2 * is * f8_groups(s, s->H) : 0;
    b.w2s = s->f8 ? sizeof(float) * H * f8_groups(s, s->is) : 0;
    b.meta = s->f8 == 1 ? 3 * sizeof(float) : 0;
    b.bytes = b.w13 + b.w2 + b.w13s + b.w2s + b.meta;
    return b;
}

/* Local slot i's weights from the device into blob (dir 0), or from blob to the device (1). */
static moe_status_t slot_copy(cuda_layer_t *s, const slot_layout_t *b, int i, char *blob, int dir)
{
    struct {
        char *dev;
        size_t bytes;
    } part[4] = {{(char *)s->w13 + b->w13 * (size_t)i, b->w13},
                 {(char *)s->w2 + b->w2 * (size_t)i, b->w2},
                 {s->f8 ? (char *)s->w13s + b->w13s * (size_t)i : NULL, b->w13s},
                 {s->f8 ? (char *)s->w2s + b->w2s * (size_t)i : NULL, b->w2s}};
    int k;
    for (k = 0; k < 4; k++) {
        if (part[k].bytes == 0)
            continue;
        if (dir == 0)
            MOE_CHECK(moe_gpu_memcpy_d2h(blob, part[k].dev, part[k].bytes));
        else
            MOE_CHECK(moe_gpu_memcpy_h2d(part[k].dev, blob, part[k].bytes));
        blob += part[k].bytes;
    }
    if (b->meta && dir == 0)
        memcpy(blob, s->host_in + 3 * (size_t)i, b->meta);
    else if (b->meta)
        memcpy(s->host_in + 3 * (size_t)i, blob, b->meta);
    return MOE_STATUS_SUCCESS;
}

/* W8A8 per row: each local slot's GEMM input scales from the host copies (after a change). */
static moe_status_t upload_static_scales(cuda_layer_t *s)
{
    float *v = malloc(sizeof(float) * 2 * ((size_t)s->E + 1));
    moe_status_t st;
    int i;
    if (!v)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "static activation scales");
    s->has_in[0] = s->has_in[1] = 0;
    for (i = 0; i < s->E; i++) {
        const float *h = s->host_in + 3 * (size_t)i;
        v[i] = moe_fp8_pair_static_scale(h[0], h[1]);
        v[s->E + 1 + i] = h[2];
        s->has_in[0] |= v[i] > 0.0f;
        s->has_in[1] |= v[s->E + 1 + i] > 0.0f;
    }
    st = moe_gpu_memcpy_h2d(s->in13, v, sizeof(float) * (size_t)s->E);
    if (st == MOE_STATUS_SUCCESS)
        st = moe_gpu_memcpy_h2d(s->in2, v + s->E + 1, sizeof(float) * (size_t)s->E);
    free(v);
    return st;
}

/* This rank's moves from the old placement (l->plan) to map, as the CPU backend derives them
 * (docs/EPLB.md, "Moving the weights"): new slot i of EP rank g copies an old local slot of
 * the same expert where g had one, else receives it from the ((g + i) mod replicas)-th old
 * replica, between the ranks of the same TP index. One message per slot (its whole blob), in
 * the same (g, i) order on both sides of every pair. src_local[i]: the old local slot new
 * slot i copies (-1: received); a second new slot from one old slot counts as copied. */
static void plan_moves(const moe_layer_t *l, const int32_t *map, size_t blob, char *old_h,
                       char *new_h, int *src_local, moe_comm_msg_t *sends, int *ns,
                       moe_comm_msg_t *recvs, int *nr, moe_placement_stats_t *stats)
{
    const moe_plan_t *p = &l->plan;
    const int S = p->num_local_experts, tp = p->tp_size, me = p->ep_rank, q = p->tp_rank;
    int g, i, j;
    *ns = *nr = 0;
    for (g = 0; g < p->ep_size; g++)
        for (i = 0; i < S; i++) {
            const int e = map[g * S + i], mine = moe_plan_local_slot_of(p, e, g);
            int n, slot, src;
            if (mine >= 0) {
                if (g == me) {
                    src_local[i] = mine;
                    for (j = 0; j < i; j++)
                        if (src_local[j] == mine) {
                            stats->slots_copied++;
                            break;
                        }
                }
                continue;
            }
            n = p->replica_begin[e + 1] - p->replica_begin[e];
            slot = p->replica_slot[p->replica_begin[e] + (g + i) % n];
            src = p->slot_owner[slot];
            if (g == me) {
                src_local[i] = -1;
                recvs[(*nr)++] = (moe_comm_msg_t){src * tp + q, new_h + blob * (size_t)i, blob};
                stats->slots_received++;
                stats->bytes_received += (int64_t)blob;
            }
            if (src == me) {
                sends[(*ns)++] =
                    (moe_comm_msg_t){g * tp + q, old_h + blob * (size_t)p->slot_local[slot], blob};
                stats->bytes_sent += (int64_t)blob;
            }
        }
}

/* The new map's tables on the device (a plan of the new map, built aside). */
static moe_status_t upload_map(moe_layer_t *l, cuda_layer_t *s, const int32_t *map)
{
    moe_plan_t np = l->plan;
    moe_status_t st =
        moe_plan_init_placement(&np, l->cfg.num_experts, l->cfg.num_redundant_experts);
    if (st == MOE_STATUS_SUCCESS)
        st = moe_plan_set_map(&np, l->cfg.num_experts, map);
    if (st == MOE_STATUS_SUCCESS)
        st = moe_cuda_upload_placement(&np, s);
    moe_plan_free_placement(&np);
    return st;
}

moe_status_t moe_cuda_set_placement(moe_layer_t *l, const int32_t *map, int move_weights,
                                    moe_placement_stats_t *stats)
{
    cuda_layer_t *s = l->state;
    const int S = l->plan.num_local_experts, W = l->plan.ep_size;
    const slot_layout_t b = slot_layout(s);
    char *old_h = NULL, *new_h = NULL;
    int *src_local = NULL, ns = 0, nr = 0, i;
    moe_comm_msg_t *sends = NULL, *recvs = NULL;
    moe_status_t st;

    /* the queued forwards read the weights and tables about to change */
    st = drain(l);
    if (st == MOE_STATUS_SUCCESS && move_weights) {
        old_h = malloc(b.bytes * (size_t)S + 1);
        new_h = malloc(b.bytes * (size_t)S + 1);
        src_local = malloc(sizeof(int) * ((size_t)S + 1));
        sends = malloc(sizeof(moe_comm_msg_t) * ((size_t)S * (size_t)W + 1));
        recvs = malloc(sizeof(moe_comm_msg_t) * ((size_t)S + 1));
        if (!old_h || !new_h || !src_local || !sends || !recvs)
            st = moe_error(MOE_STATUS_OUT_OF_MEMORY,
                           "placement: host staging of %d slots of %zu bytes", S, b.bytes);
        for (i = 0; i < S && st == MOE_STATUS_SUCCESS; i++)
            st = slot_copy(s, &b, i, old_h + b.bytes * (size_t)i, 0);
        if (st == MOE_STATUS_SUCCESS)
            plan_moves(l, map, b.bytes, old_h, new_h, src_local, sends, &ns, recvs, &nr, stats);
    }
    st = moe_comm_agree(l->rt->comm, st);
    if (st == MOE_STATUS_SUCCESS && move_weights) {
        st = moe_comm_exchange(l->rt->comm, sends, ns, recvs, nr);
        if (st == MOE_STATUS_TIMEOUT || st == MOE_STATUS_MPI_ERROR) {
            /* MPI may still read old_h and write new_h: both are left to it */
            free(src_local), free(sends), free(recvs);
            return st;
        }
        st = moe_comm_agree(l->rt->comm, st);
    }
    if (st == MOE_STATUS_SUCCESS) {
        /* every rank has its new slots on the host: the device switches now */
        for (i = 0; move_weights && i < S && st == MOE_STATUS_SUCCESS; i++) {
            if (src_local[i] >= 0)
                memcpy(new_h + b.bytes * (size_t)i, old_h + b.bytes * (size_t)src_local[i],
                       b.bytes);
            st = slot_copy(s, &b, i, new_h + b.bytes * (size_t)i, 1);
        }
        if (st == MOE_STATUS_SUCCESS && move_weights && s->f8 == 1)
            st = upload_static_scales(s);
        if (st == MOE_STATUS_SUCCESS)
            st = upload_map(l, s, map);
        st = moe_comm_agree(l->rt->comm, st);
        if (st != MOE_STATUS_SUCCESS) {
            /* some rank's device holds the new placement and the host plan the old one */
            l->broken = 1;
            moe_error(st,
                      "placement change: the device copy failed on a rank after the exchange "
                      "(%s); the layer is unusable",
                      moe_status_string(st));
        }
    }
    free(old_h), free(new_h), free(src_local), free(sends), free(recvs);
    return st;
}
