/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA backend on one GPU: device weights and one workspace planned at init; forward runs
 * route -> permute -> GEMM1 (act * up) -> GEMM2 -> combine on the caller's stream with no host
 * synchronisation and no allocation, so a step can be captured in a CUDA graph.
 *
 * Routing weights are applied in combine (f32), not in GEMM2's row_scale epilogue: GEMM2
 * writes each expert row unweighted in bf16 and combine sums w_tj * row in a fixed j order. */
#include <stdlib.h>
#include <string.h>

#include "comm/nccl_comm.h"
#include "kernels/combine.h"
#include "kernels/ep.h"
#include "kernels/expert_gemm.h"
#include "kernels/expert_gemm_simple.h"
#include "kernels/gpu.h"
#include "kernels/numeric.h"
#include "kernels/permute.h"
#include "kernels/route.h"
#include "runtime/diag.h"
#include "runtime/layer.h"

/* Events of a profiled forward (MOE_PROFILE=1): the boundaries of its phases. */
enum { EV_START, EV_ROUTE, EV_PERMUTE, EV_EXPERT, EV_SHARED, EV_COMBINE, EV_COUNT };

typedef struct cuda_layer {
    int device, arch;
    int E, k, H; /* E: experts on this rank */
    int E_total; /* experts of the layer: the router's rows */
    int64_t is, ss, max_tokens;
    moe_activation_t act;
    const moe_gemm_variant_t *forced; /* MOE_GEMM_VARIANT, else NULL (oracle per step) */

    /* weights (one allocation) */
    void *wmem;
    void *w13;     /* bf16 [E][2 is][H]: gate rows then up rows */
    void *w2;      /* bf16 [E][H][is] */
    float *router; /* f32 [E][H] */
    float *bias;   /* f32 [E] */
    void *sw13;    /* bf16 [2 ss][H] */
    void *sw2;     /* bf16 [H][ss] */
    float *sgate;  /* f32 [H] */

    /* workspace (one allocation), sized for max_tokens and every selectable variant */
    void *wsmem;
    int max_blocks, s_max_blocks;       /* caps over the variants */
    float *logits;                      /* [Tm][E] */
    int32_t *ids;                       /* [Tm][k] */
    float *weights;                     /* [Tm][k] */
    int32_t *counts, *offsets;          /* [E], [E + 1] */
    int32_t *block_expert, *num_blocks; /* [max_blocks], [1] */
    int32_t *row_of_slot;               /* [Tm k] */
    int32_t *slot_of_row;               /* [max_rows] */
    void *a, *h, *o;                    /* bf16 [max_rows][H], [max_rows][is], [max_rows][H] */
    void *sa, *sh, *so;                 /* bf16 [s_rows][H], [s_rows][ss], [s_rows][H] */
    int32_t *s_block_expert, *s_num_blocks;
    float *s_gate_logit; /* [Tm] */

    /* expert parallelism over NCCL (world > 1): every rank sees every token (all-gather of
     * tm = max_tokens_per_rank padded rows), computes its experts' rows, and the rows return
     * in a dense (token, slot) array by reduce-scatter, one contributor per entry */
    moe_nccl_t *nccl; /* the runtime's (not owned) */
    int world, first_local;
    int deterministic;
    int64_t tm;                  /* max tokens per rank */
    void *xsend, *xall;          /* bf16 [tm][H], [world tm][H] */
    int32_t *ids_all, *lids;     /* [world tm k] global, local expert ids (-1: not here) */
    void *dense, *mine;          /* bf16 [world tm k][H], [tm k][H] */
    void *smine;                 /* bf16 [tm][H]: this rank's tokens' shared output */
    int32_t *iota;               /* [tm k]: row of slot (t, j) in `mine` */
    float *w_all;                /* [world tm k] routing weights of every rank's slots */
    float *ones;                 /* [tm] */
    int32_t *one_block;          /* [2]: block table of the padded send rows */
    double last_rows_per_expert; /* the hint routed_experts got this step (same variant) */

    int profile;
    void *ev[EV_COUNT];
    int32_t *host_counts; /* [E], profiling only */
} cuda_layer_t;

/* MOE_PROFILE=1: synchronise after each forward and fill the layer's stats per phase (read at
 * every forward, so a benchmark can profile one step; ignored while a graph is captured). */
#define MOE_PROFILE_DEFAULT 0

static size_t align_up(size_t x)
{
    return (x + 255) & ~(size_t)255;
}

/* Carves consecutive 256-byte-aligned pieces out of one allocation (base NULL: sizing pass). */
typedef struct carve {
    char *base;
    size_t off;
} carve_t;

static void *take(carve_t *c, size_t bytes)
{
    void *p = c->base ? c->base + c->off : NULL;
    c->off += align_up(bytes);
    return p;
}

/* Every variant forward may pick on this device (the forced one alone if set). */
static int candidate_variants(const cuda_layer_t *s, const moe_gemm_variant_t **out, int cap)
{
    int n = 0, count = 0, i;
    const moe_gemm_variant_t *table;
    if (s->forced) {
        out[0] = s->forced;
        return 1;
    }
    table = moe_gemm_variants(&count);
    for (i = 0; i < count && n < cap - 1; i++)
        if (table[i].min_arch <= s->arch && table[i].ab_dtype == MOE_DTYPE_BF16 &&
            table[i].scale_kind == MOE_SCALE_NONE)
            out[n++] = &table[i];
    out[n++] = moe_gemm_simple_variant();
    return n;
}

static void plan_workspace(cuda_layer_t *s, carve_t *c)
{
    const moe_gemm_variant_t *v[64];
    const int nv = candidate_variants(s, v, 64);
    const int64_t tm = s->max_tokens, rows = tm * s->k;
    int64_t max_rows = 0, s_rows = 0;
    int i;

    s->max_blocks = 0;
    s->s_max_blocks = 0;
    for (i = 0; i < nv; i++) {
        const int br = v[i]->block_rows;
        const int64_t mb = moe_permute_max_blocks(rows, s->E, br);
        const int64_t smb = (tm + br - 1) / br;
        if (mb > s->max_blocks)
            s->max_blocks = (int)mb;
        if (mb * br > max_rows)
            max_rows = mb * br;
        if (smb > s->s_max_blocks)
            s->s_max_blocks = (int)smb;
        if (smb * br > s_rows)
            s_rows = smb * br;
    }
    s->logits = take(c, sizeof(float) * (size_t)(tm * s->E_total));
    s->ids = take(c, sizeof(int32_t) * (size_t)rows);
    s->weights = take(c, sizeof(float) * (size_t)rows);
    s->counts = take(c, sizeof(int32_t) * (size_t)s->E);
    s->offsets = take(c, sizeof(int32_t) * (size_t)(s->E + 1));
    s->block_expert = take(c, sizeof(int32_t) * (size_t)s->max_blocks);
    s->num_blocks = take(c, sizeof(int32_t));
    s->row_of_slot = take(c, sizeof(int32_t) * (size_t)rows);
    s->slot_of_row = take(c, sizeof(int32_t) * (size_t)max_rows);
    s->a = take(c, 2 * (size_t)max_rows * (size_t)s->H);
    s->h = take(c, 2 * (size_t)max_rows * (size_t)s->is);
    s->o = take(c, 2 * (size_t)max_rows * (size_t)s->H);
    if (s->ss > 0) {
        s->sa = take(c, 2 * (size_t)s_rows * (size_t)s->H);
        s->sh = take(c, 2 * (size_t)s_rows * (size_t)s->ss);
        s->so = take(c, 2 * (size_t)s_rows * (size_t)s->H);
        s->s_block_expert = take(c, sizeof(int32_t) * (size_t)s->s_max_blocks);
        s->s_num_blocks = take(c, sizeof(int32_t));
        s->s_gate_logit = take(c, sizeof(float) * (size_t)tm);
    }
    if (s->world > 1) {
        const size_t H = (size_t)s->H, k = (size_t)s->k, t1 = (size_t)s->tm;
        s->xsend = take(c, 2 * t1 * H);
        s->xall = take(c, 2 * (size_t)tm * H);
        s->ids_all = take(c, sizeof(int32_t) * (size_t)tm * k);
        s->lids = take(c, sizeof(int32_t) * (size_t)tm * k);
        s->dense = take(c, 2 * (size_t)tm * k * H);
        s->mine = take(c, 2 * t1 * k * H);
        s->smine = take(c, 2 * t1 * H);
        s->iota = take(c, sizeof(int32_t) * t1 * k);
        s->w_all = take(c, sizeof(float) * (size_t)tm * k);
        s->ones = take(c, sizeof(float) * t1);
        s->one_block = take(c, sizeof(int32_t) * 2);
    }
}

static void plan_weights(cuda_layer_t *s, carve_t *c)
{
    const size_t E = (size_t)s->E, H = (size_t)s->H, is = (size_t)s->is, ss = (size_t)s->ss;
    s->w13 = take(c, 2 * E * 2 * is * H);
    s->w2 = take(c, 2 * E * H * is);
    s->router = take(c, sizeof(float) * (size_t)s->E_total * H); /* every expert's row */
    s->bias = take(c, sizeof(float) * (size_t)s->E_total);
    if (ss > 0) {
        s->sw13 = take(c, 2 * 2 * ss * H);
        s->sw2 = take(c, 2 * H * ss);
        s->sgate = take(c, sizeof(float) * H);
    }
}

static void cuda_fini(moe_layer_t *l)
{
    cuda_layer_t *s = l->state;
    int i;
    if (!s)
        return;
    for (i = 0; i < EV_COUNT; i++)
        moe_gpu_event_destroy(s->ev[i]);
    moe_gpu_free(s->wmem);
    moe_gpu_free(s->wsmem);
    free(s->host_counts);
    free(s);
    l->state = NULL;
}

static moe_status_t check_supported(const moe_layer_t *l)
{
    const moe_layer_config_t *c = &l->cfg;
#ifndef MOE_HAVE_NCCL
    if (l->plan.world > 1)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "CUDA backend with world size %d: libmoe was built without NCCL; use "
                         "one rank or MOE_BACKEND=cpu",
                         l->plan.world);
#endif
    if (c->weight_dtype != MOE_DTYPE_BF16)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "CUDA backend: weight_dtype = %s; only BF16 expert weights are built "
                         "(FP8 kernels come later); use BF16 or MOE_BACKEND=cpu",
                         moe_dtype_name(c->weight_dtype));
    if (c->num_experts > MOE_ROUTE_MAX_EXPERTS || c->top_k > MOE_ROUTE_MAX_TOP_K)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "CUDA backend: num_experts = %d, top_k = %d (routing is built for up "
                         "to %d experts and top_k %d)",
                         c->num_experts, c->top_k, MOE_ROUTE_MAX_EXPERTS, MOE_ROUTE_MAX_TOP_K);
    if (c->n_group > MOE_ROUTE_MAX_GROUPS)
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "CUDA backend: n_group = %d (at most %d)",
                         c->n_group, MOE_ROUTE_MAX_GROUPS);
    if (c->max_tokens_per_rank * c->top_k > INT32_MAX / 4)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "CUDA backend: max_tokens_per_rank = %lld x top_k = %d rows exceed "
                         "32-bit row indices",
                         (long long)c->max_tokens_per_rank, c->top_k);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t pick_forced_variant(cuda_layer_t *s)
{
    /* MOE_GEMM_VARIANT=<name>: every GEMM of this layer uses that variant ("simt_ref": the
     * plain reference kernel). */
    const char *name = moe_env_str("MOE_GEMM_VARIANT", NULL);
    if (!name)
        return MOE_STATUS_SUCCESS;
    if (!strcmp(name, moe_gemm_simple_variant()->name))
        s->forced = moe_gemm_simple_variant();
    else
        s->forced = moe_gemm_variant_by_name(name);
    if (!s->forced)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "MOE_GEMM_VARIANT=%s: no such variant", name);
    if (s->forced->min_arch > s->arch)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "MOE_GEMM_VARIANT=%s needs sm_%d (device: sm_%d)", name,
                         s->forced->min_arch, s->arch);
    return MOE_STATUS_SUCCESS;
}

/* The runtime's NCCL communicator (made by the first multi-GPU layer; collective, bounded by
 * the runtime's timeout). */
static moe_status_t ep_connect(moe_layer_t *l, cuda_layer_t *s)
{
#ifdef MOE_HAVE_NCCL
    if (!l->rt->gpu_ctx)
        MOE_CHECK(moe_nccl_create(l->rt->comm, s->world, 1, l->rt->timeout_ms,
                                  (moe_nccl_t **)&l->rt->gpu_ctx));
    s->nccl = l->rt->gpu_ctx;
    return MOE_STATUS_SUCCESS;
#else
    (void)l;
    (void)s;
    return moe_error(MOE_STATUS_NOT_SUPPORTED, "multi-GPU needs NCCL");
#endif
}

static moe_status_t ep_fill_iota(cuda_layer_t *s)
{
    const int64_t n = s->tm * s->k;
    int32_t *h = malloc(sizeof(int32_t) * (size_t)(n + 1));
    moe_status_t st;
    int64_t i;
    if (!h)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "slot table");
    for (i = 0; i < n; i++)
        h[i] = (int32_t)i;
    st = moe_gpu_memcpy_h2d(s->iota, h, sizeof(int32_t) * (size_t)n);
    for (i = 0; i < s->tm && st == MOE_STATUS_SUCCESS; i++)
        ((float *)h)[i] = 1.0f;
    if (st == MOE_STATUS_SUCCESS)
        st = moe_gpu_memcpy_h2d(s->ones, h, sizeof(float) * (size_t)s->tm);
    free(h);
    return st;
}

static moe_status_t cuda_init(moe_layer_t *l)
{
    cuda_layer_t *s;
    carve_t c = {NULL, 0};
    moe_status_t st;
    int i;

    MOE_CHECK(check_supported(l));
    s = calloc(1, sizeof(*s));
    if (!s)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "CUDA layer state");
    l->state = s;
    s->device = l->rt ? l->rt->info.device : -1;
    if (s->device >= 0)
        MOE_CHECK_GOTO(moe_gpu_set_device(s->device), st, fail);
    else
        MOE_CHECK_GOTO(moe_gpu_get_device(&s->device), st, fail);
    MOE_CHECK_GOTO(moe_gpu_arch(s->device, &s->arch), st, fail);
    s->E = l->plan.num_local_experts;
    s->E_total = l->cfg.num_experts;
    s->k = l->cfg.top_k;
    s->H = l->cfg.hidden;
    s->is = l->plan.i_end - l->plan.i_begin;
    s->ss = l->plan.s_end - l->plan.s_begin;
    s->world = l->plan.world;
    s->first_local = l->plan.first_local_expert;
    s->deterministic = l->cfg.deterministic;
    s->tm = l->cfg.max_tokens_per_rank;
    /* With EP every rank computes over all ranks' (padded) tokens. */
    s->max_tokens = s->tm * s->world;
    s->act = l->cfg.activation;
    if (s->world > 1)
        MOE_CHECK_GOTO(ep_connect(l, s), st, fail);
    if (s->world > 1 && l->cfg.dispatch == MOE_DISPATCH_ALL_TO_ALL)
        MOE_LOG_WARN("CUDA", "dispatch = all-to-all is not built for the CUDA backend yet: this "
                             "layer uses the all-gather dispatch (same results)");
    MOE_CHECK_GOTO(pick_forced_variant(s), st, fail);
    if (!s->forced && !moe_gemm_select(s->arch, MOE_DTYPE_BF16, MOE_SCALE_NONE, 1.0))
        s->forced = moe_gemm_simple_variant(); /* no tuned variant for this arch */

    plan_weights(s, &c);
    l->weight_bytes = c.off;
    MOE_CHECK_GOTO(moe_gpu_malloc(&s->wmem, c.off), st, fail);
    c.base = s->wmem;
    c.off = 0;
    plan_weights(s, &c);
    MOE_CHECK_GOTO(moe_gpu_memset(s->bias, 0, sizeof(float) * (size_t)s->E_total), st, fail);

    c.base = NULL;
    c.off = 0;
    plan_workspace(s, &c);
    l->workspace_bytes = c.off;
    MOE_CHECK_GOTO(moe_gpu_malloc(&s->wsmem, c.off), st, fail);
    c.base = s->wsmem;
    c.off = 0;
    plan_workspace(s, &c);
    if (s->world > 1)
        MOE_CHECK_GOTO(ep_fill_iota(s), st, fail);

    s->host_counts = malloc(sizeof(int32_t) * (size_t)s->E);
    if (!s->host_counts) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "profile counts");
        goto fail;
    }
    for (i = 0; i < EV_COUNT; i++)
        MOE_CHECK_GOTO(moe_gpu_event_create(&s->ev[i]), st, fail);
    if (l->cfg.check_inputs)
        MOE_LOG_WARN("CUDA", "check_inputs = 1: the CUDA backend does not scan x or the logits "
                             "for NaN/Inf (that would need a host synchronisation)");
    MOE_LOG_INFO("CUDA",
                 "layer on device %d (sm_%d): %zu weight bytes, %zu workspace bytes, "
                 "max_blocks %d, gemm %s",
                 s->device, s->arch, l->weight_bytes, l->workspace_bytes, s->max_blocks,
                 s->forced ? s->forced->name : "oracle");
    return MOE_STATUS_SUCCESS;
fail:
    cuda_fini(l);
    return st;
}

/* Copies a host f32 (or bf16) matrix as f32 to device memory. */
static moe_status_t store_f32(float *dst, const moe_matrix_t *m)
{
    const size_t n = (size_t)m->rows * (size_t)m->cols;
    float *tmp;
    moe_status_t st;
    if (m->dtype == MOE_DTYPE_F32)
        return moe_gpu_memcpy_h2d(dst, m->data, sizeof(float) * n);
    tmp = malloc(sizeof(float) * (n ? n : 1));
    if (!tmp)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "weight conversion: %zu floats", n);
    moe_convert_to_f32(m->dtype, m->data, tmp, n);
    st = moe_gpu_memcpy_h2d(dst, tmp, sizeof(float) * n);
    free(tmp);
    return st;
}

static moe_status_t cuda_store_weight(moe_layer_t *l, moe_weight_kind_t kind, int local,
                                      const moe_matrix_t *m)
{
    cuda_layer_t *s = l->state;
    const size_t H = (size_t)s->H, is = (size_t)s->is, ss = (size_t)s->ss;
    const size_t bytes = (size_t)m->rows * (size_t)m->cols * 2;
    char *dst;

    switch (kind) {
    case MOE_WEIGHT_ROUTER:
        return store_f32(s->router, m);
    case MOE_WEIGHT_ROUTER_BIAS:
        return store_f32(s->bias, m);
    case MOE_WEIGHT_SHARED_EXPERT_GATE:
        return store_f32(s->sgate, m);
    default:
        break;
    }
    if (m->dtype != MOE_DTYPE_BF16)
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "CUDA backend: weight kind %d in %s (BF16 only)",
                         (int)kind, moe_dtype_name(m->dtype));
    switch (kind) {
    case MOE_WEIGHT_GATE_PROJ:
    case MOE_WEIGHT_UP_PROJ:
        MOE_ARG_CHECK(local >= 0 && local < s->E && (size_t)m->rows == is && (size_t)m->cols == H,
                      "CUDA store: expert %d [%lld, %lld]", local, (long long)m->rows,
                      (long long)m->cols);
        dst = (char *)s->w13 + 2 * (size_t)local * 2 * is * H;
        if (kind == MOE_WEIGHT_UP_PROJ)
            dst += 2 * is * H;
        break;
    case MOE_WEIGHT_DOWN_PROJ:
        MOE_ARG_CHECK(local >= 0 && local < s->E && (size_t)m->rows == H && (size_t)m->cols == is,
                      "CUDA store: expert %d [%lld, %lld]", local, (long long)m->rows,
                      (long long)m->cols);
        dst = (char *)s->w2 + 2 * (size_t)local * H * is;
        break;
    case MOE_WEIGHT_SHARED_GATE_PROJ:
    case MOE_WEIGHT_SHARED_UP_PROJ:
        MOE_ARG_CHECK(ss > 0 && (size_t)m->rows == ss && (size_t)m->cols == H,
                      "CUDA store: shared [%lld, %lld]", (long long)m->rows, (long long)m->cols);
        dst = (char *)s->sw13 + (kind == MOE_WEIGHT_SHARED_UP_PROJ ? 2 * ss * H : 0);
        break;
    case MOE_WEIGHT_SHARED_DOWN_PROJ:
        MOE_ARG_CHECK(ss > 0 && (size_t)m->rows == H && (size_t)m->cols == ss,
                      "CUDA store: shared down [%lld, %lld]", (long long)m->rows,
                      (long long)m->cols);
        dst = (char *)s->sw2;
        break;
    default:
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "CUDA store: weight kind %d", (int)kind);
    }
    return moe_gpu_memcpy_h2d(dst, m->data, bytes);
}

/* The variant for this step: forced, or the oracle's choice for the expected rows per expert
 * (host-known, so a captured graph replays the same choice). */
static const moe_gemm_variant_t *variant_for(const cuda_layer_t *s, double rows_per_expert)
{
    const moe_gemm_variant_t *v;
    if (s->forced)
        return s->forced;
    /* Deterministic mode: one variant whatever the batch, so a row's sum order never
     * changes with the batch size, its position or the EP size. */
    if (s->deterministic)
        rows_per_expert = 1.0;
    v = moe_gemm_select(s->arch, MOE_DTYPE_BF16, MOE_SCALE_NONE, rows_per_expert);
    return v ? v : moe_gemm_simple_variant();
}

static moe_status_t run_mlp_gemms(const cuda_layer_t *s, const moe_gemm_variant_t *v, const void *a,
                                  void *h, void *o, const void *w13, const void *w2, int64_t inter,
                                  int num_experts, const int32_t *block_expert,
                                  const int32_t *num_blocks, int max_blocks, void *stream)
{
    moe_gemm_args_t g;
    memset(&g, 0, sizeof(g));
    g.a = a;
    g.b = w13;
    g.c = h;
    g.block_expert = block_expert;
    g.num_blocks = num_blocks;
    g.max_blocks = max_blocks;
    g.num_experts = num_experts;
    g.n = (int)(2 * inter);
    g.k = s->H;
    g.epilogue = s->act == MOE_ACTIVATION_GELU ? MOE_GEMM_EPI_GELU_MUL : MOE_GEMM_EPI_SILU_MUL;
    g.ab_dtype = MOE_DTYPE_BF16;
    g.scale_kind = MOE_SCALE_NONE;
    MOE_CHECK(v->launch(&g, stream));
    g.a = h;
    g.b = w2;
    g.c = o;
    g.n = s->H;
    g.k = (int)inter;
    g.epilogue = MOE_GEMM_EPI_STORE;
    return v->launch(&g, stream);
}

static moe_status_t record(const cuda_layer_t *s, int ev, void *stream)
{
    return s->profile ? moe_gpu_event_record(s->ev[ev], stream) : MOE_STATUS_SUCCESS;
}

static moe_status_t route_step(moe_layer_t *l, const moe_forward_args_t *a, int32_t *ids, float *w)
{
    cuda_layer_t *s = l->state;
    const float *logits = a->router_logits;
    moe_route_args_t r;

    if (!logits) {
        moe_route_logits_args_t g = {a->x,          a->dtype,   s->router, s->logits,
                                     a->num_tokens, s->E_total, s->H};
        MOE_CHECK(moe_route_logits_launch(&g, a->stream));
        logits = s->logits;
    }
    memset(&r, 0, sizeof(r));
    r.params.num_experts = l->cfg.num_experts;
    r.params.top_k = l->cfg.top_k;
    r.params.scoring = l->cfg.scoring;
    r.params.use_bias = l->cfg.use_score_bias;
    r.params.n_group = l->cfg.n_group;
    r.params.topk_group = l->cfg.topk_group;
    r.params.renormalize = l->cfg.renormalize;
    r.params.scaling = l->cfg.routed_scaling_factor;
    r.logits = logits;
    r.bias = l->cfg.use_score_bias ? s->bias : NULL;
    r.topk_ids = ids;
    r.topk_weights = w;
    r.num_tokens = a->num_tokens;
    return moe_route_launch(&r, a->stream);
}

/* Token rows of `x` (T tokens) through their experts (ids, -1: not on this rank): permute,
 * gather, GEMM1 (act * up), GEMM2 into s->o. rows_per_expert picks the GEMM variant. */
static moe_status_t routed_experts(cuda_layer_t *s, const void *x, moe_dtype_t x_dtype, int64_t T,
                                   const int32_t *ids, double rows_per_expert, void *stream)
{
    const int64_t rows = T * s->k;
    const moe_gemm_variant_t *v = variant_for(s, rows_per_expert);
    const int br = v->block_rows;
    const int mb = (int)moe_permute_max_blocks(rows, s->E, br);
    moe_permute_args_t p = {ids,
                            T,
                            s->k,
                            s->E,
                            br,
                            mb,
                            s->counts,
                            s->offsets,
                            s->block_expert,
                            s->num_blocks,
                            s->row_of_slot,
                            s->slot_of_row};
    moe_gather_args_t g = {x, x_dtype, s->H, s->k, s->slot_of_row, s->num_blocks, br, mb, s->a};

    if (mb > s->max_blocks)
        return moe_error(MOE_STATUS_INTERNAL_ERROR, "variant %s needs %d blocks > planned %d",
                         v->name, mb, s->max_blocks);
    MOE_CHECK(moe_permute_launch(&p, stream));
    MOE_CHECK(moe_gather_launch(&g, stream));
    MOE_CHECK(record(s, EV_PERMUTE, stream));
    return run_mlp_gemms(s, v, s->a, s->h, s->o, s->w13, s->w2, s->is, s->E, s->block_expert,
                         s->num_blocks, mb, stream);
}

/* The shared MLP (this rank's slice) on T tokens of x into s->so. */
static moe_status_t shared_experts(cuda_layer_t *s, const void *x, moe_dtype_t x_dtype, int64_t T,
                                   void *stream)
{
    const moe_gemm_variant_t *v = variant_for(s, (double)T);
    const int br = v->block_rows;
    const int mb = (int)((T + br - 1) / br);
    moe_rows_args_t r = {x, x_dtype, T, s->H, br, mb, s->sa, s->s_block_expert, s->s_num_blocks};

    if (mb > s->s_max_blocks)
        return moe_error(MOE_STATUS_INTERNAL_ERROR, "shared: %d blocks > planned %d", mb,
                         s->s_max_blocks);
    MOE_CHECK(moe_rows_launch(&r, stream));
    return run_mlp_gemms(s, v, s->sa, s->sh, s->so, s->sw13, s->sw2, s->ss, 1, s->s_block_expert,
                         s->s_num_blocks, mb, stream);
}

/* sigmoid input of Qwen2's shared-expert gate for this rank's tokens. */
static moe_status_t shared_gate(moe_layer_t *l, const moe_forward_args_t *a)
{
    cuda_layer_t *s = l->state;
    moe_route_logits_args_t g = {a->x, a->dtype, s->sgate, s->s_gate_logit, a->num_tokens, 1, s->H};
    if (!l->cfg.shared_expert_gate || a->num_tokens == 0)
        return MOE_STATUS_SUCCESS;
    return moe_route_logits_launch(&g, a->stream);
}

static moe_status_t finish_profile(moe_layer_t *l, const moe_forward_args_t *a)
{
    cuda_layer_t *s = l->state;
    float ms[EV_COUNT] = {0};
    int64_t rows = 0;
    int i;

    MOE_CHECK(moe_gpu_event_synchronize(s->ev[EV_COMBINE]));
    for (i = 1; i < EV_COUNT; i++)
        MOE_CHECK(moe_gpu_event_elapsed_ms(s->ev[i - 1], s->ev[i], &ms[i]));
    l->stats.route_us = 1e3 * ms[EV_ROUTE];
    l->stats.dispatch_us = 1e3 * ms[EV_PERMUTE];
    l->stats.expert_us = 1e3 * ms[EV_EXPERT];
    l->stats.shared_us = 1e3 * ms[EV_SHARED];
    l->stats.combine_us = 1e3 * ms[EV_COMBINE];
    MOE_CHECK(moe_gpu_event_elapsed_ms(s->ev[EV_START], s->ev[EV_COMBINE], &ms[0]));
    l->stats.total_us = 1e3 * ms[0];
    MOE_CHECK(moe_gpu_memcpy_d2h_async(s->host_counts, s->counts, sizeof(int32_t) * (size_t)s->E,
                                       a->stream));
    MOE_CHECK(moe_gpu_stream_synchronize(a->stream));
    for (i = 0; i < s->E; i++) {
        l->expert_load[l->plan.first_local_expert + i] = s->host_counts[i];
        rows += s->host_counts[i];
    }
    l->stats.rows_received = rows;
    return MOE_STATUS_SUCCESS;
}

/* y = sum over slots in order of w * expert rows (+ [gated] shared rows), into args->y. */
static moe_status_t combine(moe_layer_t *l, const moe_forward_args_t *a, const void *rows,
                            const int32_t *row_of_slot, const float *w, const void *shared)
{
    cuda_layer_t *s = l->state;
    moe_combine_args_t c;
    memset(&c, 0, sizeof(c));
    c.expert_out = rows;
    c.row_of_slot = row_of_slot;
    c.topk_weights = w;
    c.shared_out = s->ss > 0 ? shared : NULL;
    c.shared_gate_logit = s->ss > 0 && l->cfg.shared_expert_gate ? s->s_gate_logit : NULL;
    c.y = a->y;
    c.y_dtype = a->dtype;
    c.num_tokens = a->num_tokens;
    c.hidden = s->H;
    c.top_k = s->k;
    return moe_combine_launch(&c, a->stream);
}

/* Dispatch: this rank's tokens (bf16, padded to tm rows, ids -1 past num_tokens) to every
 * rank by all-gather; then the local experts' ids. */
static moe_status_t ep_dispatch(moe_layer_t *l, const moe_forward_args_t *a)
{
    cuda_layer_t *s = l->state;
    const int64_t T = a->num_tokens, tm = s->tm, k = s->k, H = s->H;
    moe_rows_args_t r = {a->x,         a->dtype,        T, s->H, (int)tm, 1, s->xsend,
                         s->one_block, s->one_block + 1};
    moe_ep_local_ids_args_t li = {s->ids_all, s->lids, s->world * tm * k, s->first_local, s->E};
    moe_status_t st, end;

    if (T < tm)
        MOE_CHECK(moe_gpu_memset_async(s->ids + T * k, 0xff,
                                       sizeof(int32_t) * (size_t)((tm - T) * k), a->stream));
    MOE_CHECK(moe_rows_launch(&r, a->stream));
    /* one NCCL group: tokens, ids and (for the summed return) routing weights */
    MOE_CHECK(moe_nccl_group_start());
    st = moe_nccl_all_gather(s->nccl, MOE_NCCL_WORLD, s->xsend, s->xall, 2 * (size_t)(tm * H),
                             a->stream);
    if (st == MOE_STATUS_SUCCESS)
        st = moe_nccl_all_gather(s->nccl, MOE_NCCL_WORLD, s->ids, s->ids_all,
                                 sizeof(int32_t) * (size_t)(tm * k), a->stream);
    if (st == MOE_STATUS_SUCCESS && !s->deterministic)
        st = moe_nccl_all_gather(s->nccl, MOE_NCCL_WORLD, s->weights, s->w_all,
                                 sizeof(float) * (size_t)(tm * k), a->stream);
    end = moe_nccl_group_end(s->nccl);
    MOE_CHECK(st);
    MOE_CHECK(end);
    return moe_ep_local_ids_launch(&li, a->stream);
}

/* Return: each computed row into its (token, slot) entry of a zeroed dense array, which a
 * reduce-scatter brings to the source rank (entries with one contributor stay exact). */
/* Return, default mode: each rank sums its slots of every token with their weights (and its
 * slice of the shared MLP) into a bf16 partial y of all tokens, a reduce-scatter adds the
 * ranks' partials (k times fewer bytes than the dense return; the sum order across ranks is
 * NCCL's), and a last pass writes y in the caller's dtype. */
static moe_status_t ep_return_summed(moe_layer_t *l, const moe_forward_args_t *a)
{
    cuda_layer_t *s = l->state;
    const int64_t tm = s->tm, W = s->world, H = s->H;
    moe_combine_args_t c;

    if (s->ss > 0 && l->cfg.shared_expert_gate) { /* the gate of every token */
        moe_route_logits_args_t g = {s->xall, MOE_DTYPE_BF16, s->sgate, s->s_gate_logit, W * tm, 1,
                                     s->H};
        MOE_CHECK(moe_route_logits_launch(&g, a->stream));
    }
    memset(&c, 0, sizeof(c));
    c.expert_out = s->o;
    c.row_of_slot = s->row_of_slot; /* -1 for the slots of other ranks' experts */
    c.topk_weights = s->w_all;
    c.shared_out = s->ss > 0 ? s->so : NULL;
    c.shared_gate_logit = s->ss > 0 && l->cfg.shared_expert_gate ? s->s_gate_logit : NULL;
    c.y = s->dense; /* bf16 [W tm, H] partial */
    c.y_dtype = MOE_DTYPE_BF16;
    c.num_tokens = W * tm;
    c.hidden = s->H;
    c.top_k = s->k;
    MOE_CHECK(moe_combine_launch(&c, a->stream));
    MOE_CHECK(moe_nccl_reduce_scatter(s->nccl, MOE_NCCL_WORLD, s->dense, s->mine, (size_t)(tm * H),
                                      MOE_DTYPE_BF16, a->stream));
    memset(&c, 0, sizeof(c));
    c.expert_out = s->mine;
    c.row_of_slot = s->iota;
    c.topk_weights = s->ones;
    c.y = a->y;
    c.y_dtype = a->dtype;
    c.num_tokens = a->num_tokens;
    c.hidden = s->H;
    c.top_k = 1;
    return moe_combine_launch(&c, a->stream);
}

static moe_status_t ep_return(cuda_layer_t *s, void *stream)
{
    const int64_t tm = s->tm, k = s->k, H = s->H, W = s->world;
    const moe_gemm_variant_t *v = NULL;
    moe_ep_scatter_args_t sc;

    MOE_CHECK(moe_gpu_memset_async(s->dense, 0, 2 * (size_t)(W * tm * k * H), stream));
    v = variant_for(s, s->last_rows_per_expert);
    sc.rows = s->o;
    sc.slot_of_row = s->slot_of_row;
    sc.num_blocks = s->num_blocks;
    sc.block_rows = v->block_rows;
    sc.max_blocks = (int)moe_permute_max_blocks(W * tm * k, s->E, v->block_rows);
    sc.hidden = s->H;
    sc.dense = s->dense;
    MOE_CHECK(moe_ep_scatter_launch(&sc, stream));
    MOE_CHECK(moe_nccl_reduce_scatter(s->nccl, MOE_NCCL_WORLD, s->dense, s->mine,
                                      (size_t)(tm * k * H), MOE_DTYPE_BF16, stream));
    if (s->ss > 0)
        MOE_CHECK(moe_nccl_reduce_scatter(s->nccl, MOE_NCCL_WORLD, s->so, s->smine,
                                          (size_t)(tm * H), MOE_DTYPE_BF16, stream));
    return MOE_STATUS_SUCCESS;
}

/* One step across the ranks (every rank calls it, num_tokens may be 0). No host
 * synchronisation: buffers are sized from max_tokens_per_rank, so it can be captured. */
static moe_status_t ep_forward(moe_layer_t *l, const moe_forward_args_t *a)
{
    cuda_layer_t *s = l->state;
    const int64_t W = s->world, tm = s->tm;

    MOE_CHECK(moe_nccl_check(s->nccl));
    MOE_CHECK(record(s, EV_START, a->stream));
    if (a->num_tokens > 0)
        MOE_CHECK(route_step(l, a, s->ids, s->weights));
    MOE_CHECK(record(s, EV_ROUTE, a->stream));
    MOE_CHECK(ep_dispatch(l, a));
    /* rows per local expert if every rank brought as many tokens as this one */
    s->last_rows_per_expert = (double)a->num_tokens * W * s->k / l->cfg.num_experts;
    MOE_CHECK(routed_experts(s, s->xall, MOE_DTYPE_BF16, W * tm, s->lids, s->last_rows_per_expert,
                             a->stream));
    MOE_CHECK(record(s, EV_EXPERT, a->stream));
    if (s->ss > 0)
        MOE_CHECK(shared_experts(s, s->xall, MOE_DTYPE_BF16, W * tm, a->stream));
    MOE_CHECK(record(s, EV_SHARED, a->stream));
    if (!s->deterministic) {
        MOE_CHECK(ep_return_summed(l, a));
    } else {
        if (s->ss > 0)
            MOE_CHECK(shared_gate(l, a));
        MOE_CHECK(ep_return(s, a->stream));
        MOE_CHECK(combine(l, a, s->mine, s->iota, s->weights, s->smine));
    }
    if (a->num_tokens > 0 && a->topk_ids)
        MOE_CHECK(moe_gpu_memcpy_d2d_async(
            a->topk_ids, s->ids, sizeof(int32_t) * (size_t)(a->num_tokens * s->k), a->stream));
    if (a->num_tokens > 0 && a->topk_weights)
        MOE_CHECK(moe_gpu_memcpy_d2d_async(a->topk_weights, s->weights,
                                           sizeof(float) * (size_t)(a->num_tokens * s->k),
                                           a->stream));
    MOE_CHECK(record(s, EV_COMBINE, a->stream));
    return s->profile ? finish_profile(l, a) : MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_forward(moe_layer_t *l, const moe_forward_args_t *a)
{
    cuda_layer_t *s = l->state;
    int32_t *ids;
    float *w;

    if (l->input_status != MOE_STATUS_SUCCESS)
        return l->input_status;
    if (!s)
        return moe_error(MOE_STATUS_INVALID_STATE, "CUDA layer not initialised");
    if (a->num_tokens == 0 && s->world == 1) {
        memset(&l->stats, 0, sizeof(l->stats));
        return MOE_STATUS_SUCCESS;
    }
    ids = a->topk_ids ? a->topk_ids : s->ids;
    w = a->topk_weights ? a->topk_weights : s->weights;
    s->profile = (int)moe_env_int("MOE_PROFILE", MOE_PROFILE_DEFAULT) != 0;
    if (s->profile) {
        int capturing = 0;
        MOE_CHECK(moe_gpu_stream_is_capturing(a->stream, &capturing));
        s->profile = !capturing;
    }
    if (s->world > 1)
        return ep_forward(l, a);
    MOE_CHECK(record(s, EV_START, a->stream));
    MOE_CHECK(route_step(l, a, ids, w));
    MOE_CHECK(record(s, EV_ROUTE, a->stream));
    MOE_CHECK(routed_experts(s, a->x, a->dtype, a->num_tokens, ids,
                             (double)a->num_tokens * s->k / s->E, a->stream));
    MOE_CHECK(record(s, EV_EXPERT, a->stream));
    if (s->ss > 0) {
        MOE_CHECK(shared_experts(s, a->x, a->dtype, a->num_tokens, a->stream));
        MOE_CHECK(shared_gate(l, a));
    }
    MOE_CHECK(record(s, EV_SHARED, a->stream));
    MOE_CHECK(combine(l, a, s->o, s->row_of_slot, w, s->so));
    MOE_CHECK(record(s, EV_COMBINE, a->stream));
    return s->profile ? finish_profile(l, a) : MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_synchronize(moe_layer_t *l, void *stream)
{
    cuda_layer_t *s = l->state;
    if (s && s->nccl)
        return moe_nccl_wait(s->nccl, stream);
    return moe_gpu_stream_synchronize(stream);
}

const moe_backend_ops_t moe_backend_cuda = {
    "cuda", cuda_init, cuda_fini, cuda_store_weight, cuda_forward, cuda_synchronize};
