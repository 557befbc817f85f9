/* SPDX-License-Identifier: Apache-2.0 */
/* Layer objects: config validation, the sharding plan, cross-rank agreement, weight setting
 * (slice + convert + quantise), and the collective forward entry. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/numeric.h"
#include "base/diag.h"
#include "runtime/layer.h"

#define MOE_MAX_EXPERTS 65536
#define MOE_MAX_TOP_K 64
#define MOE_FP8_BLOCK 128

/* ------------------------------------------------------------------------------------------ */
/* Validation                                                                                  */
/* ------------------------------------------------------------------------------------------ */

static int is_pow2(int x)
{
    return x > 0 && (x & (x - 1)) == 0;
}

static moe_status_t validate_sizes(const moe_layer_config_t *c)
{
    MOE_ARG_CHECK(c->num_experts > 0 && c->num_experts <= MOE_MAX_EXPERTS,
                  "num_experts = %d: must be in 1..%d", c->num_experts, MOE_MAX_EXPERTS);
    MOE_ARG_CHECK(c->top_k > 0 && c->top_k <= c->num_experts,
                  "top_k = %d: must be in 1..num_experts (%d)", c->top_k, c->num_experts);
    MOE_ARG_CHECK(c->top_k <= MOE_MAX_TOP_K, "top_k = %d: at most %d", c->top_k, MOE_MAX_TOP_K);
    MOE_ARG_CHECK(c->hidden > 0, "hidden = %d: must be > 0", c->hidden);
    MOE_ARG_CHECK(c->intermediate > 0, "intermediate = %d: must be > 0", c->intermediate);
    MOE_ARG_CHECK(c->num_shared_experts >= 0, "num_shared_experts = %d: must be >= 0",
                  c->num_shared_experts);
    MOE_ARG_CHECK(c->shared_intermediate >= 0, "shared_intermediate = %d: must be >= 0",
                  c->shared_intermediate);
    MOE_ARG_CHECK(c->shared_expert_gate == 0 || c->shared_expert_gate == 1,
                  "shared_expert_gate = %d: must be 0 or 1", c->shared_expert_gate);
    MOE_ARG_CHECK(!c->shared_expert_gate || c->num_shared_experts > 0,
                  "shared_expert_gate = 1 needs num_shared_experts > 0");
    MOE_ARG_CHECK(c->max_tokens_per_rank > 0 && c->max_tokens_per_rank <= (INT64_C(1) << 30),
                  "max_tokens_per_rank = %lld: must be in 1..2^30",
                  (long long)c->max_tokens_per_rank);
    MOE_ARG_CHECK(c->ep_round_tokens >= 0 && c->ep_round_tokens <= c->max_tokens_per_rank,
                  "ep_round_tokens = %lld: must be in 0..max_tokens_per_rank (%lld; 0: the "
                  "default)",
                  (long long)c->ep_round_tokens, (long long)c->max_tokens_per_rank);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t validate_routing(const moe_layer_config_t *c)
{
    MOE_ARG_CHECK(c->activation == MOE_ACTIVATION_SILU || c->activation == MOE_ACTIVATION_GELU,
                  "activation = %d: not a moe_activation_t", (int)c->activation);
    MOE_ARG_CHECK(c->scoring == MOE_SCORING_SOFTMAX || c->scoring == MOE_SCORING_SIGMOID,
                  "scoring = %d: not a moe_scoring_t", (int)c->scoring);
    MOE_ARG_CHECK(!c->use_score_bias || c->scoring == MOE_SCORING_SIGMOID,
                  "use_score_bias = 1 needs scoring = MOE_SCORING_SIGMOID");
    MOE_ARG_CHECK(c->n_group >= 0, "n_group = %d: must be >= 0", c->n_group);
    if (c->n_group > 1) {
        MOE_ARG_CHECK(c->num_experts % c->n_group == 0,
                      "n_group = %d does not divide num_experts = %d", c->n_group, c->num_experts);
        MOE_ARG_CHECK(c->topk_group >= 1 && c->topk_group <= c->n_group,
                      "topk_group = %d: must be in 1..n_group (%d)", c->topk_group, c->n_group);
        MOE_ARG_CHECK(c->top_k <= c->topk_group * (c->num_experts / c->n_group),
                      "top_k = %d exceeds the %d experts of topk_group = %d groups", c->top_k,
                      c->topk_group * (c->num_experts / c->n_group), c->topk_group);
    }
    MOE_ARG_CHECK(c->renormalize == 0 || c->renormalize == 1, "renormalize = %d: must be 0 or 1",
                  c->renormalize);
    MOE_ARG_CHECK(isfinite(c->routed_scaling_factor) && c->routed_scaling_factor >= 0.0f,
                  "routed_scaling_factor = %g: must be finite and >= 0",
                  (double)c->routed_scaling_factor);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t validate_dtype(const moe_layer_config_t *c)
{
    const int align = c->weight_dtype == MOE_DTYPE_FP8_E4M3 ? 16 : 8;
    MOE_ARG_CHECK(c->weight_dtype == MOE_DTYPE_F32 || c->weight_dtype == MOE_DTYPE_BF16 ||
                      c->weight_dtype == MOE_DTYPE_FP8_E4M3,
                  "weight_dtype = %d (%s): must be F32, BF16 or FP8_E4M3", (int)c->weight_dtype,
                  moe_dtype_name(c->weight_dtype));
    if (c->weight_dtype == MOE_DTYPE_FP8_E4M3)
        MOE_ARG_CHECK(c->scale_kind == MOE_SCALE_PER_TENSOR ||
                          c->scale_kind == MOE_SCALE_BLOCK_128 ||
                          c->scale_kind == MOE_SCALE_PER_CHANNEL,
                      "scale_kind = %d: FP8_E4M3 weights need MOE_SCALE_PER_TENSOR, "
                      "MOE_SCALE_PER_CHANNEL or MOE_SCALE_BLOCK_128",
                      (int)c->scale_kind);
    else
        MOE_ARG_CHECK(c->scale_kind == MOE_SCALE_NONE,
                      "scale_kind = %d: only FP8_E4M3 weights take scales", (int)c->scale_kind);
    MOE_ARG_CHECK(c->fp8_math == MOE_FP8_MATH_AUTO || c->fp8_math == MOE_FP8_MATH_W8A16 ||
                      c->fp8_math == MOE_FP8_MATH_W8A8 || c->fp8_math == MOE_FP8_MATH_W8A8_FAST,
                  "fp8_math = %d: not a moe_fp8_math_t (AUTO 0, W8A16 1, W8A8 2, W8A8_FAST 3)",
                  (int)c->fp8_math);
    MOE_ARG_CHECK((c->fp8_math != MOE_FP8_MATH_W8A8 && c->fp8_math != MOE_FP8_MATH_W8A8_FAST) ||
                      c->weight_dtype == MOE_DTYPE_FP8_E4M3,
                  "fp8_math = MOE_FP8_MATH_%s needs weight_dtype FP8_E4M3 (got %s)",
                  c->fp8_math == MOE_FP8_MATH_W8A8 ? "W8A8" : "W8A8_FAST",
                  moe_dtype_name(c->weight_dtype));
    if (c->weight_dtype != MOE_DTYPE_F32) {
        /* 16-byte rows for vector loads and TMA on the GPU; the CPU checks the same so that
         * a config valid here is valid on every backend. */
        MOE_ARG_CHECK(c->hidden % align == 0, "hidden = %d: %s weights need a multiple of %d",
                      c->hidden, moe_dtype_name(c->weight_dtype), align);
        MOE_ARG_CHECK(c->intermediate % align == 0,
                      "intermediate = %d: %s weights need a multiple of %d", c->intermediate,
                      moe_dtype_name(c->weight_dtype), align);
    }
    return MOE_STATUS_SUCCESS;
}

static moe_status_t validate_layout(moe_layer_config_t *c, int world, const moe_knobs_t *k)
{
    int64_t si;
    MOE_ARG_CHECK(c->ep_size >= 0, "ep_size = %d: must be >= 0 (0 = auto)", c->ep_size);
    MOE_ARG_CHECK(c->tp_size >= 0, "tp_size = %d: must be >= 0 (0 = auto)", c->tp_size);
    MOE_ARG_CHECK(c->tp_size <= world && world % (c->tp_size ? c->tp_size : 1) == 0,
                  "tp_size = %d: must divide the world size %d", c->tp_size, world);
    MOE_ARG_CHECK(c->ep_size <= world && world % (c->ep_size ? c->ep_size : 1) == 0,
                  "ep_size = %d: must divide the world size %d", c->ep_size, world);
    if (c->tp_size == MOE_AUTO)
        c->tp_size = c->ep_size ? world / c->ep_size : 1;
    if (c->ep_size == MOE_AUTO)
        c->ep_size = c->tp_size ? world / c->tp_size : world;
    MOE_ARG_CHECK((int64_t)c->ep_size * c->tp_size == world,
                  "ep_size (%d) x tp_size (%d) = %lld must equal the world size %d", c->ep_size,
                  c->tp_size, (long long)c->ep_size * c->tp_size, world);
    MOE_ARG_CHECK(c->ep_size <= c->num_experts, "ep_size = %d: more EP ranks than num_experts = %d",
                  c->ep_size, c->num_experts);
    MOE_ARG_CHECK(c->num_redundant_experts >= 0 && c->num_redundant_experts <= MOE_MAX_EXPERTS &&
                      c->num_redundant_experts % c->ep_size == 0,
                  "num_redundant_experts = %d: must be a multiple of ep_size = %d in 0..%d",
                  c->num_redundant_experts, c->ep_size, MOE_MAX_EXPERTS);
    MOE_ARG_CHECK(c->num_redundant_experts == 0 || c->num_experts % c->ep_size == 0,
                  "num_redundant_experts = %d needs num_experts (%d) a multiple of ep_size (%d): "
                  "every EP rank holds the same number of expert slots",
                  c->num_redundant_experts, c->num_experts, c->ep_size);
    MOE_ARG_CHECK(c->intermediate % c->tp_size == 0,
                  "intermediate = %d is not divisible by tp_size = %d", c->intermediate,
                  c->tp_size);
    MOE_ARG_CHECK(c->dispatch >= MOE_DISPATCH_AUTO && c->dispatch <= MOE_DISPATCH_ALL_GATHER,
                  "dispatch = %d: not a moe_dispatch_t", (int)c->dispatch);
    if (c->num_shared_experts > 0 && c->shared_intermediate == MOE_AUTO)
        c->shared_intermediate = c->num_shared_experts * c->intermediate;
    si = c->num_shared_experts > 0 ? c->shared_intermediate : 0;
    if (c->scale_kind == MOE_SCALE_BLOCK_128) {
        MOE_ARG_CHECK(c->tp_size == 1 || (c->intermediate / c->tp_size) % MOE_FP8_BLOCK == 0,
                      "intermediate / tp_size = %d: 128x128 block scales need TP slices that "
                      "are multiples of 128",
                      c->intermediate / c->tp_size);
        MOE_ARG_CHECK(world == 1 || si % ((int64_t)world * MOE_FP8_BLOCK) == 0,
                      "shared_intermediate = %lld: with block scales it must be a multiple of "
                      "128 x world size (%d)",
                      (long long)si, world);
    }
    if (c->deterministic == MOE_AUTO)
        c->deterministic = k->v[MOE_KNOB_DETERMINISTIC] ? 1 : 0;
    MOE_ARG_CHECK(c->deterministic == 0 || c->deterministic == 1,
                  "deterministic = %d: must be 0, 1 or MOE_AUTO", c->deterministic);
    if (c->deterministic) {
        if (!is_pow2(c->tp_size) || c->tp_size > 64)
            return moe_error(MOE_STATUS_NOT_SUPPORTED,
                             "deterministic mode needs tp_size a power of two <= 64 (got %d)",
                             c->tp_size);
        if (si > 0 && (!is_pow2(world) || world > 64))
            return moe_error(MOE_STATUS_NOT_SUPPORTED,
                             "deterministic mode with shared experts needs a world size that is "
                             "a power of two <= 64 (got %d)",
                             world);
    }
    MOE_ARG_CHECK(c->check_inputs == 0 || c->check_inputs == 1, "check_inputs = %d: must be 0 or 1",
                  c->check_inputs);
    return MOE_STATUS_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Plan and agreement                                                                          */
/* ------------------------------------------------------------------------------------------ */

static moe_status_t make_plan(moe_layer_t *l, int world, int rank)
{
    moe_plan_t *p = &l->plan;
    const moe_layer_config_t *c = &l->cfg;

    p->world = world;
    p->rank = rank;
    p->ep_size = c->ep_size;
    p->tp_size = c->tp_size;
    p->ep_rank = rank / c->tp_size;
    p->tp_rank = rank % c->tp_size;
    MOE_CHECK(moe_plan_init_placement(p, c->num_experts, c->num_redundant_experts));
    p->i_begin = moe_split_begin(c->intermediate, c->tp_size, p->tp_rank);
    p->i_end = moe_split_begin(c->intermediate, c->tp_size, p->tp_rank + 1);
    p->shared_intermediate = c->num_shared_experts > 0 ? c->shared_intermediate : 0;
    p->s_begin = moe_split_begin(p->shared_intermediate, world, rank);
    p->s_end = moe_split_begin(p->shared_intermediate, world, rank + 1);
    /* CUDA expert parallelism (no TP): every rank keeps the whole shared MLP and runs it on its
     * own tokens as one GPU would (replicated, as EP deployments do): no rank needs another's
     * tokens for it, so the all-to-all sends tokens only to their routed experts' ranks, and
     * deterministic mode is bitwise the same for every EP size (a split would sum partials
     * across ranks). */
    if (c->tp_size == 1 && world > 1 && l->rt->info.backend == MOE_BACKEND_CUDA) {
        p->s_begin = 0;
        p->s_end = p->shared_intermediate;
    }
    return MOE_STATUS_SUCCESS;
}

/* FNV-1a over the resolved config, field by field (no padding bytes). */
static uint64_t config_hash(const moe_layer_config_t *c)
{
    int64_t f[] = {c->num_experts,
                   c->top_k,
                   c->hidden,
                   c->intermediate,
                   c->num_shared_experts,
                   c->shared_intermediate,
                   c->shared_expert_gate,
                   c->activation,
                   c->scoring,
                   c->use_score_bias,
                   c->n_group,
                   c->topk_group,
                   c->renormalize,
                   (int64_t)(c->routed_scaling_factor * 1e6),
                   c->weight_dtype,
                   c->scale_kind,
                   c->max_tokens_per_rank,
                   c->ep_size,
                   c->tp_size,
                   c->dispatch,
                   c->deterministic,
                   c->check_inputs,
                   c->fp8_math,
                   c->ep_round_tokens,
                   c->num_redundant_experts};
    uint64_t h = 1469598103934665603ULL;
    size_t i, b;
    for (i = 0; i < sizeof(f) / sizeof(f[0]); i++)
        for (b = 0; b < 8; b++) {
            h ^= (uint64_t)((f[i] >> (8 * b)) & 0xff);
            h *= 1099511628211ULL;
        }
    return h;
}

/* Every rank learns whether all validated, all hold the same config and all read the same
 * knobs (knobs.h): MAX over {w, -w} of each word gives its max and -min, in one all-reduce. */
static moe_status_t agree_config(moe_layer_t *l, moe_status_t local)
{
    enum { N = 1 + MOE_KNOB_WORDS };
    moe_comm_t *comm = l->rt->comm;
    int64_t h[2 * N], max[MOE_KNOB_WORDS], min[MOE_KNOB_WORDS];
    int i;
    moe_status_t st = moe_comm_agree(comm, local);
    if (st != MOE_STATUS_SUCCESS)
        return st;
    h[0] = (int64_t)(config_hash(&l->cfg) >> 1);
    for (i = 0; i < MOE_KNOB_WORDS; i++)
        h[1 + i] = l->knobs.word[i];
    for (i = 0; i < N; i++)
        h[N + i] = -h[i];
    MOE_CHECK(moe_comm_allreduce_i64(comm, h, 2 * N, MOE_REDUCE_MAX));
    for (i = 0; i < MOE_KNOB_WORDS; i++)
        max[i] = h[1 + i], min[i] = -h[N + 1 + i];
    /* a knob first: MOE_DETERMINISTIC also changes the resolved config */
    MOE_CHECK(moe_knobs_mismatch(comm, &l->knobs, max, min));
    if (h[0] != -h[N])
        return moe_error(MOE_STATUS_MISMATCH,
                         "ranks passed different layer configs (or layouts) to moe_layer_create");
    return MOE_STATUS_SUCCESS;
}

static const moe_backend_ops_t *backend_ops(const moe_runtime_t *rt)
{
#ifdef MOE_HAVE_CUDA
    if (rt->info.backend == MOE_BACKEND_CUDA)
        return &moe_backend_cuda;
#endif
    return &moe_backend_cpu;
}

static void layer_free(moe_layer_t *l);

static moe_status_t layer_setup(moe_layer_t *l, const moe_layer_config_t *config)
{
    const int world = l->rt->info.world_size;
    l->cfg = *config;
    l->ep_round_tokens = config->max_tokens_per_rank; /* one round, unless the backend splits */
    MOE_CHECK(moe_knobs_read(&l->knobs));
    MOE_CHECK(validate_sizes(&l->cfg));
    MOE_CHECK(validate_routing(&l->cfg));
    MOE_CHECK(validate_dtype(&l->cfg));
    MOE_CHECK(validate_layout(&l->cfg, world, &l->knobs));
    if (l->cfg.routed_scaling_factor == 0.0f)
        l->cfg.routed_scaling_factor = 1.0f;
    if (l->cfg.n_group <= 1)
        l->cfg.n_group = 0, l->cfg.topk_group = 0;
    MOE_CHECK(make_plan(l, world, l->rt->info.rank));
    l->weight_set =
        calloc((size_t)MOE_WEIGHT_KIND_COUNT * (size_t)(l->plan.num_local_experts + 1), 1);
    l->expert_load = calloc((size_t)l->cfg.num_experts, sizeof(int64_t));
    l->load_window = calloc((size_t)l->cfg.num_experts, sizeof(int64_t));
    if (!l->weight_set || !l->expert_load || !l->load_window)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "layer bookkeeping");
    l->ops = backend_ops(l->rt);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_layer_create(moe_runtime_t *rt, const moe_layer_config_t *config,
                              moe_layer_t **layer)
{
    moe_layer_t *l;
    moe_status_t st, local;

    moe_error_clear();
    MOE_ARG_CHECK(rt != NULL, "runtime = NULL");
    MOE_ARG_CHECK(layer != NULL, "layer = NULL: need a place for the handle");
    *layer = NULL;
    l = calloc(1, sizeof(*l));
    if (!l)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "layer");
    l->rt = rt;
    /* Validation errors stay local until the agreement, so every rank answers. */
    local =
        config ? layer_setup(l, config) : moe_error(MOE_STATUS_INVALID_ARGUMENT, "config = NULL");
    st = agree_config(l, local);
    if (st == MOE_STATUS_SUCCESS) {
        local = l->ops->init(l);
        st = moe_comm_agree(rt->comm, local);
    }
    if (st != MOE_STATUS_SUCCESS) {
        layer_free(l);
        return st;
    }
    MOE_LOG_INFO("LAYER",
                 "layer E%d k%d H%d I%d: ep %d/%d tp %d/%d, %d local experts, "
                 "%zu weight bytes",
                 l->cfg.num_experts, l->cfg.top_k, l->cfg.hidden, l->cfg.intermediate,
                 l->plan.ep_rank, l->plan.ep_size, l->plan.tp_rank, l->plan.tp_size,
                 l->plan.num_local_experts, l->weight_bytes);
    *layer = l;
    return MOE_STATUS_SUCCESS;
}

/* Frees without touching the thread's error message (used on create's failure path). */
static void layer_free(moe_layer_t *l)
{
    if (l->ops && l->state)
        l->ops->fini(l);
    moe_plan_free_placement(&l->plan);
    free(l->weight_set);
    free(l->expert_load);
    free(l->load_window);
    free(l);
}

moe_status_t moe_layer_destroy(moe_layer_t *l)
{
    moe_error_clear();
    if (l)
        layer_free(l);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_layer_get_info(const moe_layer_t *l, moe_layer_info_t *info)
{
    moe_error_clear();
    MOE_ARG_CHECK(l != NULL, "layer = NULL");
    MOE_ARG_CHECK(info != NULL, "info = NULL");
    memset(info, 0, sizeof(*info));
    info->ep_size = l->plan.ep_size;
    info->tp_size = l->plan.tp_size;
    info->ep_rank = l->plan.ep_rank;
    info->tp_rank = l->plan.tp_rank;
    info->num_local_experts = l->plan.num_local_experts;
    info->first_local_expert = l->plan.first_local_expert;
    info->intermediate_begin = (int)l->plan.i_begin;
    info->intermediate_end = (int)l->plan.i_end;
    info->shared_begin = (int)l->plan.s_begin;
    info->shared_end = (int)l->plan.s_end;
    info->dispatch = l->cfg.dispatch;
    info->deterministic = l->cfg.deterministic;
    info->weight_bytes = l->weight_bytes;
    info->workspace_bytes = l->workspace_bytes;
    info->ep_round_tokens = l->ep_round_tokens;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_layer_get_stats(const moe_layer_t *l, moe_layer_stats_t *stats)
{
    moe_error_clear();
    MOE_ARG_CHECK(l != NULL, "layer = NULL");
    MOE_ARG_CHECK(stats != NULL, "stats = NULL");
    *stats = l->stats;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_layer_get_expert_load(const moe_layer_t *l, int64_t *counts, int n)
{
    moe_error_clear();
    MOE_ARG_CHECK(l != NULL, "layer = NULL");
    MOE_ARG_CHECK(counts != NULL, "counts = NULL");
    MOE_ARG_CHECK(n == l->cfg.num_experts, "n = %d: must equal num_experts = %d", n,
                  l->cfg.num_experts);
    memcpy(counts, l->expert_load, sizeof(int64_t) * (size_t)n);
    return MOE_STATUS_SUCCESS;
}

/* ------------------------------------------------------------------------------------------ */
/* Forward                                                                                     */
/* ------------------------------------------------------------------------------------------ */

static moe_status_t check_forward_args(const moe_layer_t *l, const moe_forward_args_t *a)
{
    MOE_ARG_CHECK(a != NULL, "args = NULL");
    MOE_ARG_CHECK(a->num_tokens >= 0 && a->num_tokens <= l->cfg.max_tokens_per_rank,
                  "num_tokens = %lld: must be in 0..max_tokens_per_rank (%lld)",
                  (long long)a->num_tokens, (long long)l->cfg.max_tokens_per_rank);
    MOE_ARG_CHECK(a->max_tokens_across_ranks >= 0 &&
                      a->max_tokens_across_ranks <= l->cfg.max_tokens_per_rank,
                  "max_tokens_across_ranks = %lld: must be in 0..max_tokens_per_rank (%lld)",
                  (long long)a->max_tokens_across_ranks, (long long)l->cfg.max_tokens_per_rank);
    MOE_ARG_CHECK(a->max_tokens_across_ranks == 0 || a->num_tokens <= a->max_tokens_across_ranks,
                  "num_tokens = %lld exceeds max_tokens_across_ranks = %lld",
                  (long long)a->num_tokens, (long long)a->max_tokens_across_ranks);
    MOE_ARG_CHECK(a->dtype == MOE_DTYPE_F32 || a->dtype == MOE_DTYPE_BF16,
                  "dtype = %d (%s): x and y must be F32 or BF16", (int)a->dtype,
                  moe_dtype_name(a->dtype));
    if (a->num_tokens > 0) {
        MOE_ARG_CHECK(a->x != NULL, "x = NULL with num_tokens = %lld", (long long)a->num_tokens);
        MOE_ARG_CHECK(a->y != NULL, "y = NULL with num_tokens = %lld", (long long)a->num_tokens);
        MOE_ARG_CHECK(a->x != (const void *)a->y, "y aliases x: the output needs its own buffer");
    }
    if (a->given_topk_ids || a->given_topk_weights) {
        MOE_ARG_CHECK(a->given_topk_ids && a->given_topk_weights,
                      "given_topk_ids = %p, given_topk_weights = %p: give both or neither",
                      (const void *)a->given_topk_ids, (const void *)a->given_topk_weights);
        MOE_ARG_CHECK(a->router_logits == NULL,
                      "router_logits and given_topk_ids/weights both given: one routing only");
        return moe_layer_check_weights(l, 0, 0);
    }
    return moe_layer_check_weights(l, a->router_logits == NULL, 1);
}

moe_status_t moe_layer_forward(moe_layer_t *l, const moe_forward_args_t *args)
{
    moe_status_t st;
    moe_error_clear();
    MOE_ARG_CHECK(l != NULL, "layer = NULL");
    if (l->broken)
        return moe_error(MOE_STATUS_INVALID_STATE,
                         "the layer is unusable after an earlier communication failure");
    /* Even with bad (or NULL) arguments the backend takes part in the step's first collective,
     * which carries this rank's status to the others. */
    l->input_status = check_forward_args(l, args);
    st = l->ops->forward(l, args);
    if (st == MOE_STATUS_TIMEOUT || st == MOE_STATUS_MPI_ERROR || st == MOE_STATUS_NCCL_ERROR)
        l->broken = 1;
    return st;
}

moe_status_t moe_layer_explain(const moe_layer_t *l, int64_t num_tokens, char *text, size_t len)
{
    moe_error_clear();
    MOE_ARG_CHECK(l != NULL, "layer = NULL");
    MOE_ARG_CHECK(text != NULL && len > 0, "text = %p, len = %zu: need a buffer", (void *)text,
                  len);
    MOE_ARG_CHECK(num_tokens >= 0 && num_tokens <= l->cfg.max_tokens_per_rank,
                  "num_tokens = %lld: must be in 0..max_tokens_per_rank (%lld)",
                  (long long)num_tokens, (long long)l->cfg.max_tokens_per_rank);
    if (l->ops->explain)
        l->ops->explain(l, num_tokens, text, len);
    else
        snprintf(text, len,
                 "%s backend: reference kernels, f32 accumulation; %d rank(s), ep %d x tp %d, "
                 "rows exchanged by %s",
                 l->ops->name, l->plan.world, l->plan.ep_size, l->plan.tp_size,
                 l->plan.world == 1                           ? "nobody (one rank)"
                 : l->cfg.dispatch == MOE_DISPATCH_ALL_GATHER ? "all-gather"
                 : l->cfg.dispatch == MOE_DISPATCH_ALL_TO_ALL ? "all-to-all"
                                                              : "all-to-all or all-gather "
                                                                "(AUTO, per step)");
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_layer_synchronize(moe_layer_t *l, void *stream)
{
    moe_status_t st;
    moe_error_clear();
    MOE_ARG_CHECK(l != NULL, "layer = NULL");
    if (!l->ops->synchronize)
        return MOE_STATUS_SUCCESS;
    st = l->ops->synchronize(l, stream);
    if (st == MOE_STATUS_TIMEOUT || st == MOE_STATUS_NCCL_ERROR)
        l->broken = 1;
    return st;
}
