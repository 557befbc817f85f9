/* SPDX-License-Identifier: Apache-2.0 */
/* CPU backend: host weights, C reference kernels, MPI transport. Always reduces in a fixed
 * order (top-k slots in order; TP and shared partials by the fixed tree), so it is the
 * deterministic reference on any layout; with deterministic = 0 the all-gather mode instead
 * sums partials with MPI_Reduce_scatter (MPI's order). */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "kernels/cpu/moe_cpu.h"
#include "base/numeric.h"
#include "base/diag.h"
#include "runtime/layer.h"

typedef struct cpu_state {
    moe_matrix_t router, bias, sgate;
    moe_matrix_t *experts; /* [num_local][3]: gate, up, down */
    moe_matrix_t shared[3];
} cpu_state_t;

/* Buffers of one forward step on this rank. */
typedef struct step {
    int64_t T, Tg;        /* this rank's and all ranks' tokens */
    int64_t *tokens;      /* [world] tokens per rank */
    int64_t *token_displ; /* [world] first global token of each rank */
    float *x;             /* [T, H] */
    int32_t *ids;         /* [T, K] */
    int32_t *slot;        /* [T, K]: the physical slot serving each (t, j) */
    float *w;             /* [T, K] */
    float *routed;        /* [T, H] */
    float *xall;          /* [Tg, H] when needed */
    int32_t *ids_all;     /* [Tg, K] (all-gather mode) */
    float *w_all;         /* [Tg, K] (all-gather, non-deterministic) */
} step_t;

/* Send plan of (token, slot, tp) rows, destination-major, (token, slot) order inside. */
typedef struct send_plan {
    int64_t *count, *displ; /* [world] */
    int64_t *pos;           /* [T * K * tp]: row of (t, j, q) in the send order */
    int64_t total;
} send_plan_t;

/* ------------------------------------------------------------------------------------------ */
/* Weights                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* Expert matrices of 2 MiB and more sit on 2 MiB boundaries and ask for transparent huge pages:
 * a placement change fills fresh ones, and 4 KiB pages would cost it a fault per page (and the
 * forward a TLB miss per page). */
#define HUGE_PAGE ((size_t)2 << 20)

static void *weight_alloc(size_t bytes)
{
    void *p = NULL;
    const size_t whole = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    if (bytes < HUGE_PAGE)
        return malloc(bytes);
    if (posix_memalign(&p, HUGE_PAGE, whole) != 0)
        return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, whole, MADV_HUGEPAGE); /* advice: without it, plain pages */
#endif
    return p;
}

static moe_status_t alloc_matrix(moe_layer_t *l, moe_weight_kind_t kind, moe_matrix_t *m)
{
    int64_t fr, fc, r0, c0;
    moe_layer_weight_shape(l, kind, &m->rows, &m->cols, &fr, &fc, &r0, &c0);
    moe_layer_weight_storage(l, kind, &m->dtype, &m->scale_kind);
    m->data = weight_alloc(moe_matrix_data_bytes(m->dtype, m->rows, m->cols) + 1);
    if (m->data)
        memset(m->data, 0, moe_matrix_data_bytes(m->dtype, m->rows, m->cols) + 1);
    m->scale = calloc(moe_matrix_scale_count(m->scale_kind, m->rows, m->cols) + 1, sizeof(float));
    if (!m->data || !m->scale)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "weights: %zu bytes",
                         moe_matrix_data_bytes(m->dtype, m->rows, m->cols));
    l->weight_bytes += moe_matrix_data_bytes(m->dtype, m->rows, m->cols) +
                       sizeof(float) * moe_matrix_scale_count(m->scale_kind, m->rows, m->cols);
    return MOE_STATUS_SUCCESS;
}

static void free_matrix(moe_matrix_t *m)
{
    free(m->data);
    free(m->scale);
}

static moe_matrix_t *slot(cpu_state_t *s, moe_weight_kind_t kind, int local)
{
    switch (kind) {
    case MOE_WEIGHT_ROUTER:
        return &s->router;
    case MOE_WEIGHT_ROUTER_BIAS:
        return &s->bias;
    case MOE_WEIGHT_SHARED_EXPERT_GATE:
        return &s->sgate;
    case MOE_WEIGHT_GATE_PROJ:
    case MOE_WEIGHT_UP_PROJ:
    case MOE_WEIGHT_DOWN_PROJ:
        return &s->experts[local * 3 + (kind - MOE_WEIGHT_GATE_PROJ)];
    default:
        return &s->shared[kind - MOE_WEIGHT_SHARED_GATE_PROJ];
    }
}

static void cpu_fini(moe_layer_t *l)
{
    cpu_state_t *s = l->state;
    int i;
    if (!s)
        return;
    free_matrix(&s->router);
    free_matrix(&s->bias);
    free_matrix(&s->sgate);
    for (i = 0; s->experts && i < l->plan.num_local_experts * 3; i++)
        free_matrix(&s->experts[i]);
    free(s->experts);
    for (i = 0; i < 3; i++)
        free_matrix(&s->shared[i]);
    free(s);
    l->state = NULL;
}

static moe_status_t cpu_init(moe_layer_t *l)
{
    cpu_state_t *s = calloc(1, sizeof(*s));
    int e, k;
    if (!s)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "cpu backend state");
    l->state = s;
    s->experts = calloc((size_t)l->plan.num_local_experts * 3 + 1, sizeof(moe_matrix_t));
    if (!s->experts)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "expert table");
    MOE_CHECK(alloc_matrix(l, MOE_WEIGHT_ROUTER, &s->router));
    if (l->cfg.use_score_bias)
        MOE_CHECK(alloc_matrix(l, MOE_WEIGHT_ROUTER_BIAS, &s->bias));
    if (l->cfg.shared_expert_gate)
        MOE_CHECK(alloc_matrix(l, MOE_WEIGHT_SHARED_EXPERT_GATE, &s->sgate));
    for (e = 0; e < l->plan.num_local_experts; e++)
        for (k = MOE_WEIGHT_GATE_PROJ; k <= MOE_WEIGHT_DOWN_PROJ; k++)
            MOE_CHECK(alloc_matrix(l, (moe_weight_kind_t)k, slot(s, (moe_weight_kind_t)k, e)));
    if (l->plan.shared_intermediate > 0)
        for (k = MOE_WEIGHT_SHARED_GATE_PROJ; k <= MOE_WEIGHT_SHARED_DOWN_PROJ; k++)
            MOE_CHECK(alloc_matrix(l, (moe_weight_kind_t)k, slot(s, (moe_weight_kind_t)k, -1)));
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cpu_store_weight(moe_layer_t *l, moe_weight_kind_t kind, int local,
                                     const moe_matrix_t *m)
{
    moe_matrix_t *dst = slot(l->state, kind, local);
    if (dst->rows != m->rows || dst->cols != m->cols || dst->dtype != m->dtype)
        return moe_error(MOE_STATUS_INTERNAL_ERROR, "store_weight: shape/dtype disagree");
    memcpy(dst->data, m->data, moe_matrix_data_bytes(m->dtype, m->rows, m->cols));
    memcpy(dst->scale, m->scale,
           sizeof(float) * moe_matrix_scale_count(m->scale_kind, m->rows, m->cols));
    dst->input_scale = m->input_scale;
    return MOE_STATUS_SUCCESS;
}

static moe_cpu_matrix_t view(const moe_matrix_t *m)
{
    moe_cpu_matrix_t v = {m->dtype, m->scale_kind, m->rows, m->cols, m->data, m->scale};
    return v;
}

/* One MLP (an expert's or the shared one's slice) in the layer's arithmetic: W8A8 for FP8
 * layers configured so, else the W8A16 / f32 reference. */
static moe_status_t run_mlp(const moe_layer_t *l, const moe_cpu_mlp_t *w, const float *x, int64_t n,
                            float *out)
{
    if (moe_cfg_w8a8(&l->cfg)) /* W8A8_FAST too: f32 sums are the W8A8 numbers */
        return moe_cpu_mlp_w8a8(w, l->cfg.activation, x, n, out);
    return moe_cpu_mlp(w, l->cfg.activation, x, n, out);
}

/* The MLP of local expert `local` (or the shared MLP, local = -1) on this rank's slice. */
static moe_cpu_mlp_t mlp_view(const moe_layer_t *l, int local)
{
    const cpu_state_t *s = l->state;
    const moe_matrix_t *m = local >= 0 ? &s->experts[local * 3] : s->shared;
    moe_cpu_mlp_t w;
    w.gate = view(&m[0]);
    w.up = view(&m[1]);
    w.down = view(&m[2]);
    w.slice_begin = local >= 0 ? l->plan.i_begin : l->plan.s_begin;
    w.full_intermediate = local >= 0 ? l->cfg.intermediate : l->plan.shared_intermediate;
    w.input_scale[0] = m[0].input_scale;
    w.input_scale[1] = m[1].input_scale;
    w.input_scale[2] = m[2].input_scale;
    return w;
}

/* ------------------------------------------------------------------------------------------ */
/* Step stages                                                                                 */
/* ------------------------------------------------------------------------------------------ */

static void step_free(step_t *s)
{
    free(s->tokens);
    free(s->token_displ);
    free(s->x);
    free(s->ids);
    free(s->slot);
    free(s->w);
    free(s->routed);
    free(s->xall);
    free(s->ids_all);
    free(s->w_all);
}

static void plan_free(send_plan_t *p)
{
    free(p->count);
    free(p->displ);
    free(p->pos);
}

static moe_status_t check_finite(const float *v, int64_t n, const char *what)
{
    int64_t i;
    for (i = 0; i < n; i++)
        if (!isfinite(v[i]))
            return moe_error(MOE_STATUS_NUMERIC_ERROR, "%s[%lld] = %g is not finite", what,
                             (long long)i, (double)v[i]);
    return MOE_STATUS_SUCCESS;
}

/* The caller's routing (moe_forward_args_t.given_topk_ids/weights), checked, as the step's. */
static moe_status_t take_given_routing(const moe_layer_t *l, const moe_forward_args_t *a, step_t *s)
{
    const int k = l->cfg.top_k, E = l->cfg.num_experts;
    int64_t i;
    for (i = 0; i < s->T * k; i++) {
        if (a->given_topk_ids[i] < 0 || a->given_topk_ids[i] >= E)
            return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                             "given_topk_ids[%lld][%d] = %d: must be in 0..num_experts-1 (%d)",
                             (long long)(i / k), (int)(i % k), (int)a->given_topk_ids[i], E - 1);
        if (!isfinite(a->given_topk_weights[i]))
            return moe_error(MOE_STATUS_NUMERIC_ERROR,
                             "given_topk_weights[%lld][%d] = %g is not finite", (long long)(i / k),
                             (int)(i % k), (double)a->given_topk_weights[i]);
    }
    memcpy(s->ids, a->given_topk_ids, sizeof(int32_t) * (size_t)(s->T * k));
    memcpy(s->w, a->given_topk_weights, sizeof(float) * (size_t)(s->T * k));
    return MOE_STATUS_SUCCESS;
}

static moe_status_t route(moe_layer_t *l, const moe_forward_args_t *a, step_t *s)
{
    const moe_layer_config_t *c = &l->cfg;
    const cpu_state_t *st = l->state;
    moe_route_params_t p = {
        c->num_experts, c->top_k,      c->scoring,     c->use_score_bias,
        c->n_group,     c->topk_group, c->renormalize, c->routed_scaling_factor};
    const float *logits = a->router_logits;
    float *own = NULL;
    moe_status_t r;
    int64_t i;

    moe_convert_to_f32(a->dtype, a->x, s->x, (size_t)(s->T * c->hidden));
    if (c->check_inputs) {
        MOE_CHECK(check_finite(s->x, s->T * c->hidden, "x"));
        if (logits)
            MOE_CHECK(check_finite(logits, s->T * c->num_experts, "router_logits"));
    }
    if (a->given_topk_ids) {
        r = take_given_routing(l, a, s);
    } else if (!logits) {
        moe_cpu_matrix_t wg = view(&st->router);
        own = malloc(sizeof(float) * (size_t)(s->T * c->num_experts + 1));
        if (!own)
            return moe_error(MOE_STATUS_OUT_OF_MEMORY, "router logits");
        r = moe_cpu_matmul_nt(s->x, s->T, &wg, own);
        logits = own;
        if (r != MOE_STATUS_SUCCESS) {
            free(own);
            return r;
        }
    }
    if (!a->given_topk_ids)
        r = moe_cpu_route(&p, logits, c->use_score_bias ? st->bias.data : NULL, s->T, s->ids, s->w);
    free(own);
    if (r != MOE_STATUS_SUCCESS)
        return r;
    memset(l->expert_load, 0, sizeof(int64_t) * (size_t)c->num_experts);
    for (i = 0; i < s->T * c->top_k; i++) {
        l->expert_load[s->ids[i]]++;
        l->load_window[s->ids[i]]++;
        s->slot[i] = moe_plan_route_slot(&l->plan, s->ids[i], i / c->top_k, l->plan.rank);
    }
    if (a->topk_ids)
        memcpy(a->topk_ids, s->ids, sizeof(int32_t) * (size_t)(s->T * c->top_k));
    if (a->topk_weights)
        memcpy(a->topk_weights, s->w, sizeof(float) * (size_t)(s->T * c->top_k));
    return MOE_STATUS_SUCCESS;
}

/* Every rank learns every rank's token count; a rank whose arguments failed sends
 * -(status) so all ranks stop together. */
static moe_status_t exchange_counts(moe_layer_t *l, moe_status_t local, step_t *s)
{
    const int world = l->plan.world;
    int64_t *one = calloc((size_t)world, sizeof(int64_t)), *displ = NULL;
    moe_status_t st;
    int r;

    displ = calloc((size_t)world, sizeof(int64_t));
    if (!one || !displ) {
        free(one);
        free(displ);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "token counts");
    }
    for (r = 0; r < world; r++)
        one[r] = 1, displ[r] = r;
    s->tokens[l->plan.rank] = local == MOE_STATUS_SUCCESS ? s->T : -(int64_t)local;
    st = moe_comm_allgatherv(l->rt->comm, &s->tokens[l->plan.rank], 1, s->tokens, one, displ,
                             sizeof(int64_t));
    free(one);
    free(displ);
    if (st != MOE_STATUS_SUCCESS)
        return st;
    if (local != MOE_STATUS_SUCCESS)
        return local;
    s->Tg = 0;
    for (r = 0; r < world; r++) {
        if (s->tokens[r] < 0)
            return moe_error(MOE_STATUS_PEER_FAILURE, "rank %d rejected its forward arguments (%s)",
                             r, moe_status_string((moe_status_t)-s->tokens[r]));
        s->token_displ[r] = s->Tg;
        s->Tg += s->tokens[r];
    }
    return MOE_STATUS_SUCCESS;
}

/* Rows (t, j, q) of this rank's tokens to rank owner(slot_tj) * tp + q, destination-major. */
static moe_status_t make_send_plan(const moe_layer_t *l, const int32_t *slots, int64_t T,
                                   send_plan_t *p)
{
    const int K = l->cfg.top_k, tp = l->plan.tp_size, world = l->plan.world;
    int64_t *cur, i;
    int q, r;

    p->count = calloc((size_t)world, sizeof(int64_t));
    p->displ = calloc((size_t)world, sizeof(int64_t));
    p->pos = malloc(sizeof(int64_t) * (size_t)(T * K * tp + 1));
    cur = calloc((size_t)world, sizeof(int64_t));
    if (!p->count || !p->displ || !p->pos || !cur) {
        free(cur);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "send plan for %lld rows",
                         (long long)(T * K * tp));
    }
    for (i = 0; i < T * K; i++)
        for (q = 0; q < tp; q++)
            p->count[l->plan.slot_owner[slots[i]] * tp + q]++;
    p->total = 0;
    for (r = 0; r < world; r++) {
        p->displ[r] = p->total;
        p->total += p->count[r];
    }
    for (i = 0; i < T * K; i++)
        for (q = 0; q < tp; q++) {
            int d = l->plan.slot_owner[slots[i]] * tp + q;
            p->pos[i * tp + q] = p->displ[d] + cur[d]++;
        }
    free(cur);
    return MOE_STATUS_SUCCESS;
}

/* out[n, H] = partial MLP of row i (x row xrow[i] of xbase) with local expert lexp[i]. Rows
 * are grouped by expert so each expert's weights are read once per step. */
typedef struct experts_ctx {
    const moe_layer_t *l;
    const int64_t *off; /* expert e's rows: off[e] .. off[e + 1] - 1 */
    const float *xin;
    float *xo;
    atomic_int st; /* a range's failure (out of memory, a moe_status_t), the first one kept */
} experts_ctx_t;

/* Local experts e0 .. e1 - 1 on their rows (a thread's share: moe_cpu_for_rows) */
static void expert_rows(void *arg, int64_t e0, int64_t e1, float *scratch)
{
    experts_ctx_t *c = arg;
    const int64_t H = c->l->cfg.hidden;
    (void)scratch;
    for (int64_t e = e0; e < e1; e++) {
        moe_cpu_mlp_t w = mlp_view(c->l, (int)e);
        const moe_status_t st = run_mlp(c->l, &w, c->xin + c->off[e] * H, c->off[e + 1] - c->off[e],
                                        c->xo + c->off[e] * H);
        if (st != MOE_STATUS_SUCCESS) {
            /* what went wrong is in this thread's error text: the status goes back */
            int none = MOE_STATUS_SUCCESS;
            atomic_compare_exchange_strong(&c->st, &none, (int)st);
            return;
        }
    }
}

static moe_status_t compute_rows(moe_layer_t *l, const float *xbase, const int64_t *xrow,
                                 const int32_t *lexp, int64_t n, float *out)
{
    const int64_t H = l->cfg.hidden;
    const int ne = l->plan.num_local_experts;
    int64_t *off = malloc(sizeof(int64_t) * (size_t)(ne + 1)), *order = NULL, i;
    float *xin = NULL, *xo = NULL;
    moe_status_t st = MOE_STATUS_SUCCESS;

    order = malloc(sizeof(int64_t) * (size_t)(n + 1));
    xin = malloc(sizeof(float) * (size_t)(n * H + 1));
    xo = malloc(sizeof(float) * (size_t)(n * H + 1));
    if (!off || !order || !xin || !xo) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "expert rows: %lld x %lld", (long long)n,
                       (long long)H);
        goto out;
    }
    MOE_CHECK_GOTO(moe_cpu_group_rows(lexp, n, ne, off, order), st, out);
    for (i = 0; i < n; i++)
        memcpy(xin + i * H, xbase + xrow[order[i]] * H, sizeof(float) * (size_t)H);
    {
        /* Experts over threads where each one's products are too small for threads of their own
         * (decode-sized steps: kernels/cpu/parallel.c's bound), else one expert after another,
         * each product on threads. An expert's rows are computed as one thread computes them
         * either way, so the outputs do not depend on the split. */
        experts_ctx_t c = {l, off, xin, xo, MOE_STATUS_SUCCESS};
        const double work = (double)n * 3.0 * (double)H * (double)(l->plan.i_end - l->plan.i_begin);
        const int small = ne > 1 && work / ne < MOE_CPU_PAR_MIN_WORK;
        int fail;
        MOE_CHECK_GOTO(moe_cpu_for_rows(ne, small ? work : 0.0, 1, expert_rows, &c, "expert rows"),
                       st, out);
        fail = atomic_load(&c.st);
        if (fail != MOE_STATUS_SUCCESS) {
            st = moe_error((moe_status_t)fail, "expert MLPs on %lld rows: %s", (long long)n,
                           moe_status_string((moe_status_t)fail));
            goto out;
        }
    }
    for (i = 0; i < n; i++)
        memcpy(out + order[i] * H, xo + i * H, sizeof(float) * (size_t)H);
    l->stats.rows_received = n;
out:
    free(off);
    free(order);
    free(xin);
    free(xo);
    return st;
}

/* routed[t] = sum over slots j in order of w_tj * tree-sum over q of back[pos(t, j, q)]. */
static moe_status_t combine(const moe_layer_t *l, const step_t *s, const send_plan_t *p,
                            const float *back)
{
    const int64_t H = l->cfg.hidden;
    const int K = l->cfg.top_k, tp = l->plan.tp_size;
    const float **parts = malloc(sizeof(float *) * (size_t)tp);
    float *tmp = malloc(sizeof(float) * (size_t)H);
    int64_t t, h;
    int j, q;

    if (!parts || !tmp) {
        free(parts);
        free(tmp);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "combine");
    }
    for (t = 0; t < s->T; t++) {
        float *y = s->routed + t * H;
        memset(y, 0, sizeof(float) * (size_t)H);
        for (j = 0; j < K; j++) {
            const float w = s->w[t * K + j];
            for (q = 0; q < tp; q++)
                parts[q] = back + p->pos[(t * K + j) * tp + q] * H;
            moe_cpu_tree_sum(parts, tp, H, tmp);
            for (h = 0; h < H; h++)
                y[h] += w * tmp[h];
        }
    }
    free(parts);
    free(tmp);
    return MOE_STATUS_SUCCESS;
}

/* Sends the computed rows back along the reverse of `p` (their counts per rank are rcount)
 * and combines them at their source. */
static moe_status_t return_and_combine(moe_layer_t *l, step_t *s, const send_plan_t *p,
                                       const float *rows, const int64_t *rcount,
                                       const int64_t *rdispl)
{
    const size_t row_bytes = sizeof(float) * (size_t)l->cfg.hidden;
    float *back = malloc(row_bytes * (size_t)(p->total + 1));
    moe_status_t st;
    double t0 = moe_now_us();
    if (!back)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "combine buffer: %lld rows",
                         (long long)p->total);
    st = moe_comm_alltoallv(l->rt->comm, rows, rcount, rdispl, back, p->count, p->displ, row_bytes);
    if (st == MOE_STATUS_SUCCESS)
        st = combine(l, s, p, back);
    free(back);
    l->stats.combine_us = moe_now_us() - t0;
    return st;
}

/* All-to-all: rows travel only to the ranks that own their experts. */
static moe_status_t routed_all_to_all(moe_layer_t *l, step_t *s)
{
    const int64_t H = l->cfg.hidden;
    const int K = l->cfg.top_k, tp = l->plan.tp_size, world = l->plan.world;
    const size_t row_bytes = sizeof(float) * (size_t)H;
    send_plan_t p = {0};
    int64_t *rcount = calloc((size_t)world, sizeof(int64_t));
    int64_t *rdispl = calloc((size_t)world, sizeof(int64_t));
    int64_t i, nrecv = 0, *xrow = NULL;
    int32_t *smeta = NULL, *rmeta = NULL;
    float *spay = NULL, *rpay = NULL, *out = NULL;
    moe_status_t st;
    double t0 = moe_now_us();
    int q, r;

    if (!rcount || !rdispl) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "counts");
        goto out;
    }
    MOE_CHECK_GOTO(make_send_plan(l, s->slot, s->T, &p), st, out);
    smeta = malloc(sizeof(int32_t) * (size_t)(p.total + 1));
    spay = malloc(row_bytes * (size_t)(p.total + 1));
    if (!smeta || !spay) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "dispatch buffers: %lld rows", (long long)p.total);
        goto out;
    }
    for (i = 0; i < s->T * K; i++)
        for (q = 0; q < tp; q++) {
            int64_t at = p.pos[i * tp + q];
            smeta[at] = l->plan.slot_local[s->slot[i]];
            memcpy(spay + at * H, s->x + (i / K) * H, row_bytes);
        }
    MOE_CHECK_GOTO(moe_comm_alltoall_i64(l->rt->comm, p.count, rcount), st, out);
    for (r = 0; r < world; r++) {
        rdispl[r] = nrecv;
        nrecv += rcount[r];
    }
    rmeta = malloc(sizeof(int32_t) * (size_t)(nrecv + 1));
    rpay = malloc(row_bytes * (size_t)(nrecv + 1));
    out = malloc(row_bytes * (size_t)(nrecv + 1));
    xrow = malloc(sizeof(int64_t) * (size_t)(nrecv + 1));
    if (!rmeta || !rpay || !out || !xrow) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "receive buffers: %lld rows", (long long)nrecv);
        goto out;
    }
    MOE_CHECK_GOTO(moe_comm_alltoallv(l->rt->comm, smeta, p.count, p.displ, rmeta, rcount, rdispl,
                                      sizeof(int32_t)),
                   st, out);
    MOE_CHECK_GOTO(
        moe_comm_alltoallv(l->rt->comm, spay, p.count, p.displ, rpay, rcount, rdispl, row_bytes),
        st, out);
    l->stats.dispatch_us = moe_now_us() - t0;
    t0 = moe_now_us();
    for (i = 0; i < nrecv; i++)
        xrow[i] = i;
    MOE_CHECK_GOTO(compute_rows(l, rpay, xrow, rmeta, nrecv, out), st, out);
    l->stats.expert_us = moe_now_us() - t0;
    st = return_and_combine(l, s, &p, out, rcount, rdispl);
out:
    plan_free(&p);
    free(rcount);
    free(rdispl);
    free(smeta);
    free(rmeta);
    free(spay);
    free(rpay);
    free(out);
    free(xrow);
    return st;
}

static moe_status_t gather_tokens(moe_layer_t *l, step_t *s)
{
    if (s->xall)
        return MOE_STATUS_SUCCESS;
    s->xall = malloc(sizeof(float) * (size_t)(s->Tg * l->cfg.hidden + 1));
    if (!s->xall)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "all-gather of %lld tokens", (long long)s->Tg);
    return moe_comm_allgatherv(l->rt->comm, s->x, s->T, s->xall, s->tokens, s->token_displ,
                               sizeof(float) * (size_t)l->cfg.hidden);
}

/* Rows this rank computes in all-gather mode: global (t, j) whose expert it owns, ordered
 * by source rank, then (t, j): the order each source expects back from this rank. */
static moe_status_t ag_rows(const moe_layer_t *l, const step_t *s, int64_t *n, int64_t **xrow,
                            int32_t **lexp, int32_t **slot_of, int64_t *count, int64_t *displ)
{
    const int K = l->cfg.top_k;
    int64_t i, m = 0;
    int r;
    *xrow = malloc(sizeof(int64_t) * (size_t)(s->Tg * K + 1));
    *lexp = malloc(sizeof(int32_t) * (size_t)(s->Tg * K + 1));
    *slot_of = malloc(sizeof(int32_t) * (size_t)(s->Tg * K + 1));
    if (!*xrow || !*lexp || !*slot_of)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "all-gather rows");
    for (r = 0; r < l->plan.world; r++) {
        displ[r] = m;
        for (i = s->token_displ[r] * K; i < (s->token_displ[r] + s->tokens[r]) * K; i++) {
            const int slot =
                moe_plan_route_slot(&l->plan, s->ids_all[i], i / K - s->token_displ[r], r);
            if (l->plan.slot_owner[slot] != l->plan.ep_rank)
                continue;
            (*xrow)[m] = i / K;
            (*lexp)[m] = l->plan.slot_local[slot];
            (*slot_of)[m] = (int32_t)(i % K);
            m++;
        }
        count[r] = m - displ[r];
    }
    *n = m;
    return MOE_STATUS_SUCCESS;
}

/* Non-deterministic all-gather: weighted partials summed by MPI_Reduce_scatter. */
static moe_status_t ag_reduce_scatter(moe_layer_t *l, step_t *s, const float *out, int64_t n,
                                      const int64_t *xrow, const int32_t *slot_of)
{
    const int64_t H = l->cfg.hidden;
    const int K = l->cfg.top_k;
    float *contrib = calloc((size_t)(s->Tg * H + 1), sizeof(float));
    int64_t *cnt = malloc(sizeof(int64_t) * (size_t)l->plan.world), i, h;
    moe_status_t st;
    int r;
    if (!contrib || !cnt) {
        free(contrib);
        free(cnt);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "reduce-scatter buffer");
    }
    for (i = 0; i < n; i++) {
        const float w = s->w_all[xrow[i] * K + slot_of[i]];
        for (h = 0; h < H; h++)
            contrib[xrow[i] * H + h] += w * out[i * H + h];
    }
    for (r = 0; r < l->plan.world; r++)
        cnt[r] = s->tokens[r] * H;
    st = moe_comm_reduce_scatter_f32(l->rt->comm, contrib, s->routed, cnt);
    free(contrib);
    free(cnt);
    return st;
}

/* All-gather: every rank sees every token and computes the rows of the experts it owns. */
static moe_status_t routed_all_gather(moe_layer_t *l, step_t *s)
{
    const int K = l->cfg.top_k, world = l->plan.world;
    const size_t row_bytes = sizeof(float) * (size_t)l->cfg.hidden;
    int64_t *count = calloc((size_t)world, sizeof(int64_t));
    int64_t *displ = calloc((size_t)world, sizeof(int64_t));
    int64_t n = 0, *xrow = NULL;
    int32_t *lexp = NULL, *slot_of = NULL;
    float *out = NULL;
    send_plan_t p = {0};
    moe_status_t st;
    double t0 = moe_now_us();

    s->ids_all = malloc(sizeof(int32_t) * (size_t)(s->Tg * K + 1));
    s->w_all = malloc(sizeof(float) * (size_t)(s->Tg * K + 1));
    if (!count || !displ || !s->ids_all || !s->w_all) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "all-gather routing");
        goto out;
    }
    MOE_CHECK_GOTO(gather_tokens(l, s), st, out);
    MOE_CHECK_GOTO(moe_comm_allgatherv(l->rt->comm, s->ids, s->T, s->ids_all, s->tokens,
                                       s->token_displ, sizeof(int32_t) * (size_t)K),
                   st, out);
    if (!l->cfg.deterministic)
        MOE_CHECK_GOTO(moe_comm_allgatherv(l->rt->comm, s->w, s->T, s->w_all, s->tokens,
                                           s->token_displ, sizeof(float) * (size_t)K),
                       st, out);
    l->stats.dispatch_us = moe_now_us() - t0;
    t0 = moe_now_us();
    MOE_CHECK_GOTO(ag_rows(l, s, &n, &xrow, &lexp, &slot_of, count, displ), st, out);
    out = malloc(row_bytes * (size_t)(n + 1));
    if (!out) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "expert output: %lld rows", (long long)n);
        goto out;
    }
    MOE_CHECK_GOTO(compute_rows(l, s->xall, xrow, lexp, n, out), st, out);
    l->stats.expert_us = moe_now_us() - t0;
    if (!l->cfg.deterministic) {
        t0 = moe_now_us();
        st = ag_reduce_scatter(l, s, out, n, xrow, slot_of);
        l->stats.combine_us = moe_now_us() - t0;
        goto out;
    }
    MOE_CHECK_GOTO(make_send_plan(l, s->slot, s->T, &p), st, out);
    st = return_and_combine(l, s, &p, out, count, displ);
out:
    plan_free(&p);
    free(count);
    free(displ);
    free(xrow);
    free(lexp);
    free(slot_of);
    free(out);
    return st;
}

/* The shared MLP, split over all ranks: partials of every token, reduced at the source. */
static moe_status_t shared_experts(moe_layer_t *l, step_t *s, float *shared)
{
    const int64_t H = l->cfg.hidden;
    const int world = l->plan.world;
    const size_t row_bytes = sizeof(float) * (size_t)H;
    moe_cpu_mlp_t w = mlp_view(l, -1);
    float *part = malloc(row_bytes * (size_t)(s->Tg + 1)), *back = NULL;
    const float **parts = NULL;
    int64_t *cnt = calloc((size_t)world, sizeof(int64_t)), *rdispl = NULL, *scount = NULL;
    moe_status_t st;
    int r;

    rdispl = calloc((size_t)world, sizeof(int64_t));
    scount = calloc((size_t)world, sizeof(int64_t));
    parts = malloc(sizeof(float *) * (size_t)world);
    back = malloc(row_bytes * (size_t)(s->T * world + 1));
    if (!part || !cnt || !rdispl || !scount || !parts || !back) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "shared experts");
        goto out;
    }
    MOE_CHECK_GOTO(gather_tokens(l, s), st, out);
    MOE_CHECK_GOTO(run_mlp(l, &w, s->xall, s->Tg, part), st, out);
    if (!l->cfg.deterministic && world > 1) {
        for (r = 0; r < world; r++)
            cnt[r] = s->tokens[r] * H;
        st = moe_comm_reduce_scatter_f32(l->rt->comm, part, shared, cnt);
        goto out;
    }
    /* Rank r gets its tokens' partial from every rank, then sums them by the fixed tree. */
    for (r = 0; r < world; r++) {
        cnt[r] = s->T;
        rdispl[r] = (int64_t)r * s->T;
        scount[r] = s->tokens[r];
    }
    MOE_CHECK_GOTO(
        moe_comm_alltoallv(l->rt->comm, part, scount, s->token_displ, back, cnt, rdispl, row_bytes),
        st, out);
    for (r = 0; r < world; r++)
        parts[r] = back + (int64_t)r * s->T * H;
    moe_cpu_tree_sum(parts, world, s->T * H, shared);
out:
    free(part);
    free(back);
    free(parts);
    free(cnt);
    free(rdispl);
    free(scount);
    return st;
}

/* y = routed + [sigmoid(g . x)] * shared, converted to the caller's dtype. */
static moe_status_t finish(moe_layer_t *l, step_t *s, const moe_forward_args_t *a)
{
    const int64_t H = l->cfg.hidden;
    const cpu_state_t *cs = l->state;
    float *shared = NULL;
    int64_t t, h;
    double t0 = moe_now_us();

    if (l->plan.shared_intermediate > 0) {
        shared = malloc(sizeof(float) * (size_t)(s->T * H + 1));
        if (!shared)
            return moe_error(MOE_STATUS_OUT_OF_MEMORY, "shared output");
        {
            moe_status_t st = shared_experts(l, s, shared);
            if (st != MOE_STATUS_SUCCESS) {
                free(shared);
                return st;
            }
        }
        for (t = 0; t < s->T; t++) {
            float g = 1.0f;
            if (l->cfg.shared_expert_gate) {
                const float *wg = cs->sgate.data;
                float d = 0.0f;
                for (h = 0; h < H; h++)
                    d += wg[h] * s->x[t * H + h];
                g = 1.0f / (1.0f + expf(-d));
            }
            for (h = 0; h < H; h++)
                s->routed[t * H + h] += g * shared[t * H + h];
        }
    }
    l->stats.shared_us = moe_now_us() - t0;
    moe_convert_from_f32(a->dtype, s->routed, a->y, (size_t)(s->T * H));
    free(shared);
    return MOE_STATUS_SUCCESS;
}

/* All-gather for small steps (fewer bytes and messages than 3 all-to-alls would move);
 * MOE_AG_MAX_TOKENS (default 32) is the largest per-rank batch that uses it. */
static int use_all_gather(const moe_layer_t *l, const step_t *s)
{
    int64_t mx = 0;
    int r;
    if (l->cfg.dispatch != MOE_DISPATCH_AUTO)
        return l->cfg.dispatch == MOE_DISPATCH_ALL_GATHER;
    for (r = 0; r < l->plan.world; r++)
        mx = s->tokens[r] > mx ? s->tokens[r] : mx;
    return l->plan.world > 1 && mx <= l->knobs.v[MOE_KNOB_AG_MAX_TOKENS]; /* agreed at create */
}

static moe_status_t step_alloc(moe_layer_t *l, step_t *s)
{
    const int64_t H = l->cfg.hidden, K = l->cfg.top_k;
    s->tokens = calloc((size_t)l->plan.world, sizeof(int64_t));
    s->token_displ = calloc((size_t)l->plan.world, sizeof(int64_t));
    s->x = malloc(sizeof(float) * (size_t)(s->T * H + 1));
    s->ids = malloc(sizeof(int32_t) * (size_t)(s->T * K + 1));
    s->slot = malloc(sizeof(int32_t) * (size_t)(s->T * K + 1));
    s->w = malloc(sizeof(float) * (size_t)(s->T * K + 1));
    s->routed = malloc(sizeof(float) * (size_t)(s->T * H + 1));
    if (!s->tokens || !s->token_displ || !s->x || !s->ids || !s->slot || !s->w || !s->routed)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "step buffers for %lld tokens", (long long)s->T);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cpu_forward(moe_layer_t *l, const moe_forward_args_t *a)
{
    step_t s = {0};
    moe_status_t local = l->input_status, st;
    double t0 = moe_now_us(), t1;

    memset(&l->stats, 0, sizeof(l->stats));
    /* A rank whose arguments failed still takes part (with no tokens) in the first
     * collective, which carries its status to every rank. */
    s.T = local == MOE_STATUS_SUCCESS ? a->num_tokens : 0;
    st = step_alloc(l, &s);
    if (local == MOE_STATUS_SUCCESS)
        local = st;
    if (local == MOE_STATUS_SUCCESS)
        local = route(l, a, &s);
    l->stats.route_us = moe_now_us() - t0;
    if (!s.tokens) { /* out of memory: cannot take part; the peers time out (bounded) */
        step_free(&s);
        return local;
    }
    t1 = moe_now_us();
    MOE_CHECK_GOTO(exchange_counts(l, local, &s), st, out);
    l->stats.dispatch_us = moe_now_us() - t1;
    if (use_all_gather(l, &s))
        st = routed_all_gather(l, &s);
    else
        st = routed_all_to_all(l, &s);
    if (st == MOE_STATUS_SUCCESS)
        st = finish(l, &s, a);
out:
    step_free(&s);
    l->stats.total_us = moe_now_us() - t0;
    return st;
}

/* ------------------------------------------------------------------------------------------ */
/* Placement change                                                                            */
/* ------------------------------------------------------------------------------------------ */

/* The weight moves of one placement change, the same list on every rank: new slot i of EP
 * rank g takes logical expert e from g's own old slots when g held e, else from the
 * ((g + i) mod replicas)-th old replica of e, between the ranks of the same TP index. */
typedef struct move_plan {
    moe_matrix_t *next;  /* [S * 3]: the new slots' matrices */
    unsigned char *kept; /* [S]: old local slot j lives on in `next` */
    unsigned char *own;  /* [S]: next slot i's matrices allocated here: 1 a copy, 2 received */
    moe_comm_msg_t *sends, *recvs;
    int num_sends, num_recvs;
    float *meta; /* [S * 3] received, then [S * 3] sent: the matrices' static input scales */
} move_plan_t;

static moe_status_t alloc_like(const moe_matrix_t *src, moe_matrix_t *dst)
{
    *dst = *src;
    dst->data = weight_alloc(moe_matrix_data_bytes(src->dtype, src->rows, src->cols) + 1);
    dst->scale =
        calloc(moe_matrix_scale_count(src->scale_kind, src->rows, src->cols) + 1, sizeof(float));
    if (!dst->data || !dst->scale) {
        free(dst->data);
        free(dst->scale);
        dst->data = NULL;
        dst->scale = NULL;
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "placement: expert matrix of %zu bytes",
                         moe_matrix_data_bytes(src->dtype, src->rows, src->cols));
    }
    return MOE_STATUS_SUCCESS;
}

/* Adds the data and scale messages of the three matrices at m, and their input scales. */
static void add_msgs(moe_comm_msg_t *list, int *n, int peer, moe_matrix_t *m, float *meta,
                     int64_t *bytes)
{
    int k;
    for (k = 0; k < 3; k++) {
        const size_t db = moe_matrix_data_bytes(m[k].dtype, m[k].rows, m[k].cols);
        const size_t sb =
            sizeof(float) * moe_matrix_scale_count(m[k].scale_kind, m[k].rows, m[k].cols);
        list[(*n)++] = (moe_comm_msg_t){peer, m[k].data, db};
        if (sb)
            list[(*n)++] = (moe_comm_msg_t){peer, m[k].scale, sb};
        *bytes += (int64_t)(db + sb);
    }
    list[(*n)++] = (moe_comm_msg_t){peer, meta, 3 * sizeof(float)};
}

/* Fills `mp` for this rank: the new slots' matrices (kept, copied or fresh) and the messages. */
static moe_status_t plan_moves(moe_layer_t *l, const int32_t *map, move_plan_t *mp,
                               moe_placement_stats_t *stats)
{
    const moe_plan_t *p = &l->plan;
    const int S = p->num_local_experts, tp = p->tp_size, me = p->ep_rank, q = p->tp_rank;
    moe_matrix_t *old = ((cpu_state_t *)l->state)->experts;
    int g, i, k;

    mp->next = calloc((size_t)S * 3 + 1, sizeof(moe_matrix_t));
    mp->kept = calloc((size_t)S + 1, 1);
    mp->own = calloc((size_t)S + 1, 1);
    mp->meta = calloc((size_t)S * 6 + 1, sizeof(float));
    /* per slot at most 7 messages (3 data, 3 scales, 1 meta); a rank sends each of its S old
     * slots to at most ep_size ranks */
    mp->sends = malloc(sizeof(moe_comm_msg_t) * ((size_t)S * p->ep_size * 7 + 1));
    mp->recvs = malloc(sizeof(moe_comm_msg_t) * ((size_t)S * 7 + 1));
    if (!mp->next || !mp->kept || !mp->own || !mp->meta || !mp->sends || !mp->recvs)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "placement plan of %d slots", S);
    for (g = 0; g < p->ep_size; g++)
        for (i = 0; i < S; i++) {
            const int e = map[g * S + i], mine = moe_plan_local_slot_of(p, e, g);
            int src, n, slot;
            if (mine >= 0) {
                if (g != me)
                    continue;
                if (!mp->kept[mine]) { /* the old slot's matrices move over as they are */
                    mp->kept[mine] = 1;
                    memcpy(&mp->next[i * 3], &old[mine * 3], 3 * sizeof(moe_matrix_t));
                    continue;
                }
                mp->own[i] = 1; /* a second local replica: a copy */
                for (k = 0; k < 3; k++) {
                    moe_matrix_t *d = &mp->next[i * 3 + k], *o = &old[mine * 3 + k];
                    MOE_CHECK(alloc_like(o, d));
                    memcpy(d->data, o->data, moe_matrix_data_bytes(o->dtype, o->rows, o->cols));
                    memcpy(d->scale, o->scale,
                           sizeof(float) * moe_matrix_scale_count(o->scale_kind, o->rows, o->cols));
                }
                stats->slots_copied++;
                continue;
            }
            n = p->replica_begin[e + 1] - p->replica_begin[e];
            slot = p->replica_slot[p->replica_begin[e] + (g + i) % n];
            src = p->slot_owner[slot];
            if (g == me) {
                mp->own[i] = 2; /* received */
                for (k = 0; k < 3; k++)
                    MOE_CHECK(alloc_like(&old[k], &mp->next[i * 3 + k]));
                add_msgs(mp->recvs, &mp->num_recvs, src * tp + q, &mp->next[i * 3],
                         &mp->meta[i * 3], &stats->bytes_received);
                stats->slots_received++;
            }
            if (src == me) {
                float *meta = &mp->meta[(S + p->slot_local[slot]) * 3];
                for (k = 0; k < 3; k++)
                    meta[k] = old[p->slot_local[slot] * 3 + k].input_scale;
                add_msgs(mp->sends, &mp->num_sends, g * tp + q, &old[p->slot_local[slot] * 3], meta,
                         &stats->bytes_sent);
            }
        }
    return MOE_STATUS_SUCCESS;
}

/* Frees the matrices allocated for the new slots (a failed change) and the plan's lists. */
static void moves_free(move_plan_t *mp, int S, int drop_new)
{
    int i;
    for (i = 0; drop_new && mp->own && i < S; i++)
        if (mp->own[i]) {
            free_matrix(&mp->next[i * 3]);
            free_matrix(&mp->next[i * 3 + 1]);
            free_matrix(&mp->next[i * 3 + 2]);
        }
    if (drop_new)
        free(mp->next);
    free(mp->kept);
    free(mp->own);
    free(mp->meta);
    free(mp->sends);
    free(mp->recvs);
}

static moe_status_t cpu_set_placement(moe_layer_t *l, const int32_t *map, int move_weights,
                                      moe_placement_stats_t *stats)
{
    cpu_state_t *s = l->state;
    const int S = l->plan.num_local_experts;
    move_plan_t mp;
    moe_status_t st;
    int i;

    if (!move_weights)
        return MOE_STATUS_SUCCESS;
    double t0 = moe_now_us(), t1 = 0, t2 = 0;
    memset(&mp, 0, sizeof(mp));
    st = moe_comm_agree(l->rt->comm, plan_moves(l, map, &mp, stats));
    if (st == MOE_STATUS_SUCCESS) {
        t1 = moe_now_us();
        st = moe_comm_exchange(l->rt->comm, mp.sends, mp.num_sends, mp.recvs, mp.num_recvs);
        t2 = moe_now_us();
        if (st == MOE_STATUS_TIMEOUT || st == MOE_STATUS_MPI_ERROR) {
            /* MPI may still read the old slots and write the new ones: both are left to it */
            s->experts = calloc((size_t)S * 3 + 1, sizeof(moe_matrix_t));
            moves_free(&mp, S, 0);
            return st;
        }
        st = moe_comm_agree(l->rt->comm, st);
    }
    if (st != MOE_STATUS_SUCCESS) {
        moves_free(&mp, S, 1);
        return st;
    }
    for (i = 0; i < S; i++) {
        if (mp.own[i] == 2) { /* received: the input scales came in the meta message */
            mp.next[i * 3].input_scale = mp.meta[i * 3];
            mp.next[i * 3 + 1].input_scale = mp.meta[i * 3 + 1];
            mp.next[i * 3 + 2].input_scale = mp.meta[i * 3 + 2];
        }
        if (!mp.kept[i]) {
            free_matrix(&s->experts[i * 3]);
            free_matrix(&s->experts[i * 3 + 1]);
            free_matrix(&s->experts[i * 3 + 2]);
        }
    }
    free(s->experts);
    s->experts = mp.next;
    moves_free(&mp, S, 0);
    MOE_LOG_DEBUG("EPLB", "placement: plan and allocation %.1f ms, exchange %.1f ms, free %.1f ms",
                  (t1 - t0) * 1e-3, (t2 - t1) * 1e-3, (moe_now_us() - t2) * 1e-3);
    return MOE_STATUS_SUCCESS;
}

/* the load window: counted on the host into the layer's (no load_window hooks) */
const moe_backend_ops_t moe_backend_cpu = {"cpu",       cpu_init, cpu_fini, cpu_store_weight,
                                           cpu_forward, NULL,     NULL,     cpu_set_placement,
                                           NULL,        NULL};
