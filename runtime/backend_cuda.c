/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA backend on one GPU: device weights and one workspace planned at init; forward runs
 * route -> permute -> GEMM1 (act * up) -> GEMM2 -> combine on the caller's stream with no host
 * synchronisation and no allocation, so a step can be captured in a CUDA graph.
 *
 * Routing weights are applied in combine (f32), not in GEMM2's row_scale epilogue: GEMM2
 * writes each expert row unweighted in bf16 and combine sums w_tj * row in a fixed j order. */
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/a2a.h"
#include "kernels/combine.h"
#include "kernels/decode.h"
#include "kernels/cpu/moe_cpu.h"
#include "kernels/ep.h"
#include "kernels/expert_gemm_simple.h"
#include "kernels/gpu.h"
#include "kernels/numeric.h"
#include "kernels/permute.h"
#include "kernels/prepare.h"
#include "kernels/quant.h"
#include "kernels/route.h"
#include "runtime/backend_cuda.h"
#include "runtime/diag.h"
#include "runtime/ep_rounds.h"

/* MOE_PROFILE=1: synchronise after each forward and fill the layer's stats per phase (read at
 * every forward, so a benchmark can profile one step; ignored while a graph is captured). */
#define MOE_PROFILE_DEFAULT 0

static size_t align_up(size_t x)
{
    return (x + 255) & ~(size_t)255;
}

void *moe_cuda_take(carve_t *c, size_t bytes)
{
    void *p = c->base ? c->base + c->off : NULL;
    c->off += align_up(bytes);
    return p;
}

/* The GEMMs' scale kind: none (bf16), per row (W8A8 per-tensor / per-channel weights, their
 * scales expanded per row) or 128 x 128 blocks with 1 x 128 activation groups. */
static moe_scale_kind_t f8_scale_kind(const cuda_layer_t *s)
{
    return s->f8 == 2 ? MOE_SCALE_BLOCK_128 : s->f8 ? MOE_SCALE_PER_CHANNEL : MOE_SCALE_NONE;
}

/* 128-wide k slices of a row of `k` with block scales, else 1 (one scale per row). */
static size_t f8_groups(const cuda_layer_t *s, int64_t k)
{
    return s->f8 == 2 ? (size_t)((k + 127) / 128) : 1;
}

/* The oracle's choice (not forced) at rows_per_expert. Deterministic mode: the built-in
 * table's at one row per expert whatever the batch, layout or tune file, so a row's sum order
 * never changes with the batch size, its position or the EP size. */
static int oracle_choice(const cuda_layer_t *s, double rows_per_expert, moe_oracle_choice_t *c)
{
    moe_oracle_query_t q = s->oq;
    q.value = s->deterministic ? 1.0 : rows_per_expert;
    return moe_oracle_pick_gemm(s->deterministic ? NULL : &s->oracle, &q, c);
}

/* The variant for a step at rows_per_expert (moe_cuda_variant_for), and in *hi the most rows
 * per expert it is picked up to from there (HUGE_VAL: forced, deterministic, or no bucket). */
static const moe_gemm_variant_t *variant_upto(const cuda_layer_t *s, double rows_per_expert,
                                              double *hi)
{
    const moe_gemm_variant_t *v = NULL;
    moe_oracle_choice_t c;
    *hi = HUGE_VAL;
    if (s->forced)
        return s->forced;
    if (oracle_choice(s, rows_per_expert, &c)) {
        v = moe_gemm_variant_by_name(c.name);
        if (!s->deterministic)
            *hi = c.hi;
    }
    if (s->f8) /* create checked that sm_90a has them */
        return v;
    return v ? v : moe_gemm_simple_variant();
}

/* Adds v with the bound `upto` to the list (the larger bound where v is there already). */
static int add_candidate(const moe_gemm_variant_t **out, double *upto, int n, int cap,
                         const moe_gemm_variant_t *v, double bound)
{
    for (int i = 0; i < n; i++)
        if (out[i] == v) {
            upto[i] = bound > upto[i] ? bound : upto[i];
            return n;
        }
    if (n < cap) {
        out[n] = v;
        upto[n++] = bound;
    }
    return n;
}

/* Every variant forward may pick on this device, each with the most rows per expert at which it
 * is picked (HUGE_VAL: any): the forced one alone, or the oracle's buckets (tuned or built in)
 * walked in order; deterministic mode runs one variant at every size. Where the walk meets
 * anything unexpected, every variant of the dtype at any size (the old, larger plan). */
static int candidate_variants(const cuda_layer_t *s, const moe_gemm_variant_t **out, double *upto,
                              int cap)
{
    int n = 0, count = 0, i, step;
    double value = 0.0;
    const moe_gemm_variant_t *table;
    for (step = 0; step < 64; step++) {
        double hi;
        const moe_gemm_variant_t *v = variant_upto(s, value, &hi);
        if (!v || !(hi >= value))
            break;
        n = add_candidate(out, upto, n, cap, v, hi);
        if (isinf(hi))
            return n;
        value = nextafter(hi, HUGE_VAL);
    }
    n = 0;
    table = moe_gemm_variants(&count);
    for (i = 0; i < count; i++)
        if (moe_gemm_variant_runs_on(&table[i], s->arch) &&
            table[i].ab_dtype == (s->f8 ? MOE_DTYPE_FP8_E4M3 : MOE_DTYPE_BF16) &&
            table[i].scale_kind == f8_scale_kind(s))
            n = add_candidate(out, upto, n, cap, &table[i], HUGE_VAL);
    return add_candidate(out, upto, n, cap, moe_gemm_simple_variant(), HUGE_VAL);
}

static void plan_workspace(cuda_layer_t *s, carve_t *c)
{
    const moe_gemm_variant_t *v[64];
    double upto[64];
    const int nv = candidate_variants(s, v, upto, 64);
    const int64_t tm = s->max_tokens, rows = tm * s->k;
    /* the shared MLP's rows: this rank's tokens where it holds the whole MLP (one GPU, or EP
     * without TP), else every rank's all-gathered tokens (its TP slice) */
    const int64_t stm = s->world == 1 || s->shared_local ? s->tm : tm;
    int64_t max_rows = 0, s_rows = 0;
    int i;

    s->max_blocks = 0;
    s->s_max_blocks = 0;
    for (i = 0; i < nv; i++) {
        const int br = v[i]->block_rows;
        /* One GPU: a variant picked at up to r rows per expert gets at most r E rows (T k / E
         * <= r), and the shared MLP's T rows at most r (its value is T). With EP a rank may
         * receive more rows than its own tokens' estimate says: the whole capacity. (A step
         * past the plan still stops with INTERNAL_ERROR before any kernel runs.) */
        const int bounded = s->world == 1 && isfinite(upto[i]);
        const int64_t r = bounded ? (int64_t)(upto[i] * (double)s->E) + 1 : rows;
        const int64_t sr = bounded ? (int64_t)upto[i] + 1 : stm;
        const int64_t mb = moe_permute_max_blocks(r < rows ? r : rows, s->E, br);
        const int64_t smb = ((sr < stm ? sr : stm) + br - 1) / br;
        if (mb > s->max_blocks)
            s->max_blocks = (int)mb;
        if (mb * br > max_rows)
            max_rows = mb * br;
        if (smb > s->s_max_blocks)
            s->s_max_blocks = (int)smb;
        if (smb * br > s_rows)
            s_rows = smb * br;
    }
    s->logits = moe_cuda_take(c, sizeof(float) * (size_t)(tm * s->E_total));
    s->ids = moe_cuda_take(c, sizeof(int32_t) * (size_t)rows);
    s->weights = moe_cuda_take(c, sizeof(float) * (size_t)rows);
    s->counts = moe_cuda_take(c, sizeof(int32_t) * (size_t)s->E);
    s->offsets = moe_cuda_take(c, sizeof(int32_t) * (size_t)(s->E + 1));
    s->block_expert = moe_cuda_take(c, sizeof(int32_t) * (size_t)s->max_blocks);
    s->num_blocks = moe_cuda_take(c, sizeof(int32_t));
    s->row_of_slot = moe_cuda_take(c, sizeof(int32_t) * (size_t)rows);
    s->slot_of_row = moe_cuda_take(c, sizeof(int32_t) * (size_t)max_rows);
    s->perm_scratch_count = moe_permute_scratch_count(rows, s->E);
    s->perm_scratch = moe_cuda_take(c, sizeof(int32_t) * (size_t)s->perm_scratch_count);
    if (!s->f8) /* W8A8 quantises GEMM 1's rows straight from x (no bf16 copy) */
        s->a = moe_cuda_take(c, 2 * (size_t)max_rows * (size_t)s->H);
    s->h = moe_cuda_take(c, 2 * (size_t)max_rows * (size_t)s->is);
    s->o = moe_cuda_take(c, 2 * (size_t)max_rows * (size_t)s->H);
    if (s->f8) {
        s->a8 = moe_cuda_take(c, (size_t)max_rows * (size_t)s->H);
        s->h8 = moe_cuda_take(c, (size_t)max_rows * (size_t)s->is);
        s->as = moe_cuda_take(c, sizeof(float) * (size_t)max_rows * f8_groups(s, s->H));
        s->hs = moe_cuda_take(c, sizeof(float) * (size_t)max_rows * f8_groups(s, s->is));
    }
    if (s->ss > 0) {
        s->sa = moe_cuda_take(c, 2 * (size_t)s_rows * (size_t)s->H);
        s->sh = moe_cuda_take(c, 2 * (size_t)s_rows * (size_t)s->ss);
        s->so = moe_cuda_take(c, 2 * (size_t)s_rows * (size_t)s->H);
        s->s_block_expert = moe_cuda_take(c, sizeof(int32_t) * (size_t)s->s_max_blocks);
        s->s_num_blocks = moe_cuda_take(c, sizeof(int32_t));
        s->s_gate_logit = moe_cuda_take(c, sizeof(float) * (size_t)stm);
        if (s->f8) {
            s->sa8 = moe_cuda_take(c, (size_t)s_rows * (size_t)s->H);
            s->sh8 = moe_cuda_take(c, (size_t)s_rows * (size_t)s->ss);
            s->sas = moe_cuda_take(c, sizeof(float) * (size_t)s_rows * f8_groups(s, s->H));
            s->shs = moe_cuda_take(c, sizeof(float) * (size_t)s_rows * f8_groups(s, s->ss));
        }
    }
    if (s->dec_ok) {
        const size_t dr = (size_t)s->dec_tokens * (size_t)s->k;
        s->dec_h = moe_cuda_take(c, 2 * dr * (size_t)s->is);
        s->dec_o = moe_cuda_take(c, sizeof(float) * (size_t)s->dec_split * dr * (size_t)s->H);
        if (s->f8) {
            s->dec_xq = moe_cuda_take(c, (size_t)s->dec_tokens * (size_t)s->H);
            s->dec_xs = moe_cuda_take(c, sizeof(float) * (size_t)s->dec_tokens);
        }
    }
    if (s->world > 1)
        moe_cuda_ep_plan_workspace(s, c);
}

/* Weights and the layer's persistent data. */
static void plan_weights(cuda_layer_t *s, carve_t *c)
{
    const size_t E = (size_t)s->E, H = (size_t)s->H, is = (size_t)s->is, ss = (size_t)s->ss;
    const size_t eb = s->f8 ? 1 : 2; /* bytes per weight */
    s->w13 = moe_cuda_take(c, eb * E * 2 * is * H);
    s->w2 = moe_cuda_take(c, eb * E * H * is);
    if (s->f8) {
        s->w13s = moe_cuda_take(c, sizeof(float) * E * 2 * is * f8_groups(s, s->H));
        s->w2s = moe_cuda_take(c, sizeof(float) * E * H * f8_groups(s, s->is));
        if (ss > 0) {
            s->sw13s = moe_cuda_take(c, sizeof(float) * 2 * ss * f8_groups(s, s->H));
            s->sw2s = moe_cuda_take(c, sizeof(float) * H * f8_groups(s, s->ss));
        }
    }
    if (s->f8 == 1) { /* static activation scales: per-tensor weights only (never blocks) */
        s->in13 = moe_cuda_take(c, sizeof(float) * E);
        s->in2 = moe_cuda_take(c, sizeof(float) * E);
        if (ss > 0) {
            s->sin13 = moe_cuda_take(c, sizeof(float));
            s->sin2 = moe_cuda_take(c, sizeof(float));
        }
    }
    s->router = moe_cuda_take(c, sizeof(float) * (size_t)s->E_total * H); /* every expert's row */
    s->router3 = moe_cuda_take(c, 3 * sizeof(uint16_t) * (size_t)s->E_total * H);
    s->bias = moe_cuda_take(c, sizeof(float) * (size_t)s->E_total);
    s->perm_done = moe_cuda_take(c, 2 * sizeof(int32_t)); /* lane 0's, lane 1's */
    if (s->dec_ok)
        s->dec_sync = moe_cuda_take(c, sizeof(int32_t) *
                                           moe_decode_sync_count(s->E, s->H, s->dec_tokens * s->k));
    if (ss > 0) {
        s->sw13 = moe_cuda_take(c, eb * 2 * ss * H);
        s->sw2 = moe_cuda_take(c, eb * H * ss);
        s->sgate = moe_cuda_take(c, sizeof(float) * H);
    }
    if (s->world > 1)
        moe_cuda_ep_plan_persistent(s, c);
}

/* The runtime's one workspace grows to the largest layer's need (layers of one runtime run one
 * at a time, see moe.h). Growing frees the old buffer (cudaFree waits for the device); the
 * other layers carve their pointers again at their next forward. */
static moe_status_t reserve_workspace(moe_runtime_t *rt, size_t bytes)
{
    void *p = NULL;
    if (bytes <= rt->gpu_ws_bytes)
        return MOE_STATUS_SUCCESS;
    MOE_CHECK(moe_gpu_free(rt->gpu_ws));
    rt->gpu_ws = NULL;
    rt->gpu_ws_bytes = 0;
    MOE_CHECK(moe_gpu_malloc(&p, bytes));
    rt->gpu_ws = p;
    rt->gpu_ws_bytes = bytes;
    return MOE_STATUS_SUCCESS;
}

void moe_cuda_carve_workspace(cuda_layer_t *s, char *base)
{
    carve_t c = {base, 0};
    plan_workspace(s, &c);
}

/* Points the layer's workspace pieces into the runtime's buffer (again if it moved). */
static void bind_workspace(moe_layer_t *l, cuda_layer_t *s)
{
    carve_t c = {NULL, 0};
    if (s->ws_base == l->rt->gpu_ws)
        return;
    c.base = l->rt->gpu_ws;
    plan_workspace(s, &c);
    s->ws_base = l->rt->gpu_ws;
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
    moe_gpu_host_free(s->sticky);
    moe_cuda_ep_fini(s);
    moe_oracle_free(&s->oracle);
    free(s->host_counts);
    free(s->host_in);
    free(s);
    l->state = NULL;
}

/* Every GEMM of the layer is in the variant table's coverage (moe_gemm_check_shape), so no
 * step can meet a shape its kernel refuses, whatever the token count. */
static moe_status_t check_shapes(const moe_layer_t *l)
{
    const int64_t H = l->cfg.hidden, is = l->plan.i_end - l->plan.i_begin;
    const int64_t ss = l->plan.s_end - l->plan.s_begin;
    const moe_gemm_epilogue_t mul = MOE_GEMM_EPI_SILU_MUL;
    if (H % MOE_GEMM_ALIGN)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "CUDA backend: hidden = %lld is not a multiple of %d (16-byte rows)",
                         (long long)H, MOE_GEMM_ALIGN);
    if (is % MOE_GEMM_ALIGN)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "CUDA backend: this rank's slice of intermediate = %lld (intermediate %d "
                         "/ tp_size %d) is not a multiple of %d (16-byte rows)",
                         (long long)is, l->cfg.intermediate, l->plan.tp_size, MOE_GEMM_ALIGN);
    if (ss > 0 && ss % MOE_GEMM_ALIGN)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "CUDA backend: this rank's slice of shared_intermediate = %lld (of %lld "
                         "over %d ranks) is not a multiple of %d (16-byte rows)",
                         (long long)ss, (long long)l->plan.shared_intermediate, l->plan.world,
                         MOE_GEMM_ALIGN);
    MOE_CHECK(moe_gemm_check_shape("gate_up_proj", (int)(2 * is), (int)H, mul));
    MOE_CHECK(moe_gemm_check_shape("down_proj", (int)H, (int)is, MOE_GEMM_EPI_STORE));
    if (ss > 0) {
        MOE_CHECK(moe_gemm_check_shape("shared gate_up_proj", (int)(2 * ss), (int)H, mul));
        MOE_CHECK(moe_gemm_check_shape("shared down_proj", (int)H, (int)ss, MOE_GEMM_EPI_STORE));
    }
    return MOE_STATUS_SUCCESS;
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
    if (c->weight_dtype != MOE_DTYPE_BF16 && c->weight_dtype != MOE_DTYPE_F32 &&
        c->weight_dtype != MOE_DTYPE_FP8_E4M3)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "CUDA backend: weight_dtype = %s; use BF16, F32 or FP8_E4M3 "
                         "(converted to BF16 at load) or MOE_BACKEND=cpu",
                         moe_dtype_name(c->weight_dtype));
    if (c->fp8_math == MOE_FP8_MATH_W8A8) { /* e4m3 rows: k in whole 16-byte units */
        const int64_t is = l->plan.i_end - l->plan.i_begin, ss = l->plan.s_end - l->plan.s_begin;
        if (c->hidden % 16 || is % 16 || ss % 16)
            return moe_error(MOE_STATUS_NOT_SUPPORTED,
                             "CUDA backend: W8A8 needs hidden (%d), this rank's intermediate "
                             "slice (%lld) and shared slice (%lld) to be multiples of 16",
                             c->hidden, (long long)is, (long long)ss);
    }
    if (c->num_experts > MOE_ROUTE_MAX_EXPERTS || c->top_k > MOE_ROUTE_MAX_TOP_K)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "CUDA backend: num_experts = %d, top_k = %d (routing is built for up "
                         "to %d experts and top_k %d)",
                         c->num_experts, c->top_k, MOE_ROUTE_MAX_EXPERTS, MOE_ROUTE_MAX_TOP_K);
    if (c->n_group > MOE_ROUTE_MAX_GROUPS)
        return moe_error(MOE_STATUS_NOT_SUPPORTED, "CUDA backend: n_group = %d (at most %d)",
                         c->n_group, MOE_ROUTE_MAX_GROUPS);
    if (c->max_tokens_per_rank * c->top_k * l->plan.world > INT32_MAX / 4)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "CUDA backend: max_tokens_per_rank = %lld x top_k = %d x world %d rows "
                         "exceed 32-bit row indices",
                         (long long)c->max_tokens_per_rank, c->top_k, l->plan.world);
    return check_shapes(l);
}

static moe_status_t pick_forced_variant(cuda_layer_t *s)
{
    /* MOE_FORCE_VARIANT (or MOE_GEMM_VARIANT) = <name>: every GEMM of this layer uses that
     * variant ("simt_ref": the plain reference kernel), if it runs this layer on this device. */
    const char *name, *env;
    MOE_CHECK(moe_oracle_forced_variant(&name, &env));
    if (!name)
        return MOE_STATUS_SUCCESS;
    MOE_CHECK(moe_oracle_check_variant(env, name, s->arch, s->oq.dtype, s->oq.scale));
    s->dec_forced = -1; /* another variant: the grouped path at every size */
    if (!strcmp(name, MOE_ORACLE_FUSED_DECODE)) {
        s->dec_forced = 1;
        s->forced_env = env;
        return MOE_STATUS_SUCCESS;
    }
    if (!strcmp(name, moe_gemm_simple_variant()->name))
        s->forced = moe_gemm_simple_variant();
    else
        s->forced = moe_gemm_variant_by_name(name);
    s->forced_env = env;
    return MOE_STATUS_SUCCESS;
}

/* The oracle's key for this layer, and MOE_TUNE_FILE's tables for this GPU and shape (a file
 * that does not fit gives one warning and the built-in tables, never an error). */
static void load_oracle(const moe_layer_t *l, cuda_layer_t *s)
{
    char gpu[256];
    const moe_oracle_target_t t = {
        gpu, s->arch, {l->cfg.hidden, l->cfg.intermediate, l->cfg.num_experts, l->cfg.top_k}};
    s->oq.arch = s->arch;
    s->oq.dtype = s->f8 ? MOE_DTYPE_FP8_E4M3 : MOE_DTYPE_BF16;
    s->oq.scale = f8_scale_kind(s);
    s->oq.ep_size = l->plan.ep_size;
    s->oq.tp_size = l->plan.tp_size;
    s->oq.transport = MOE_ORACLE_ANY;
    moe_oracle_init(&s->oracle);
    if (!moe_env_str("MOE_TUNE_FILE", NULL))
        return;
    if (moe_gpu_name(s->device, gpu, sizeof(gpu)) != MOE_STATUS_SUCCESS) {
        moe_error_clear(); /* the file then fits no GPU: a warning, the built-in tables */
        gpu[0] = '\0';
    }
    moe_oracle_load_env(&s->oracle, &t);
}

static void init_shape(moe_layer_t *l, cuda_layer_t *s)
{
    s->E = l->plan.num_local_experts;
    s->E_total = l->cfg.num_experts;
    s->k = l->cfg.top_k;
    s->H = l->cfg.hidden;
    s->is = l->plan.i_end - l->plan.i_begin;
    s->ss = l->plan.s_end - l->plan.s_begin;
    s->world = l->plan.world;
    /* see make_plan: without TP every rank keeps the whole shared MLP, run on its own tokens */
    s->shared_local = s->world > 1 && s->ss > 0 && s->ss == l->plan.shared_intermediate;
    s->first_local = l->plan.first_local_expert;
    s->deterministic = l->cfg.deterministic;
    s->scatter_rows = moe_env_int("MOE_SCATTER_ROWS", 1) != 0;
    s->skip_pad = moe_env_int("MOE_GEMM_SKIP_PAD", 1) != 0;
    s->cap = l->cfg.max_tokens_per_rank;
    /* EP: the buffers hold one round (runtime/ep_rounds.h) */
    s->tm = s->world > 1 ? moe_ep_round_tokens(s->cap, s->world, l->cfg.ep_round_tokens) : s->cap;
    l->ep_round_tokens = s->tm;
    s->step_rows = s->cap; /* EP rows per rank until a step says otherwise */
    s->m = s->tm;
    s->f8 = l->cfg.weight_dtype == MOE_DTYPE_FP8_E4M3 && l->cfg.fp8_math == MOE_FP8_MATH_W8A8
                ? (l->cfg.scale_kind == MOE_SCALE_BLOCK_128 ? 2 : 1)
                : 0;
    /* With EP every rank computes over all ranks' (padded) tokens. */
    s->max_tokens = s->tm * s->world;
    s->act = l->cfg.activation;
}

/* Whether and up to how many tokens a step takes the fused decode kernel (one GPU, sm_90,
 * bf16 or per-row W8A8, not deterministic: that mode keeps one path at every batch). A layer
 * whose experts the kernel cannot run keeps the grouped path (forced: the create fails). */
static moe_status_t plan_decode(cuda_layer_t *s)
{
    int sms = 0;
    s->dec_ok = 0;
    s->dec_max = 0;
    /* MOE_FUSED_DECODE=0: the grouped path at every size, unless the kernel is forced */
    if (!s->dec_forced && !moe_env_int("MOE_FUSED_DECODE", 1))
        return MOE_STATUS_SUCCESS;
    if (s->dec_forced < 0 || s->world > 1 || s->deterministic || s->arch != 90 || s->f8 == 2 ||
        moe_decode_check(s->E, s->k, s->H, (int)s->is, s->f8) != MOE_STATUS_SUCCESS) {
        if (s->dec_forced > 0)
            return moe_error(MOE_STATUS_NOT_SUPPORTED, "%s=%s: this layer cannot run it (%s)",
                             s->forced_env, MOE_ORACLE_FUSED_DECODE,
                             s->world > 1       ? "expert parallelism: one GPU only"
                             : s->deterministic ? "deterministic mode"
                             : s->f8 == 2       ? "block scales"
                             : s->arch != 90    ? "sm_90 only"
                                                : moe_last_error());
        moe_error_clear();
        return MOE_STATUS_SUCCESS;
    }
    s->dec_max = s->dec_forced > 0 ? MOE_DECODE_MAX_TOKENS : moe_oracle_decode_tokens(&s->oq);
    if (s->dec_max > s->cap)
        s->dec_max = (int)s->cap;
    if (s->dec_max <= 0)
        return MOE_STATUS_SUCCESS;
    MOE_CHECK(moe_gpu_sm_count(s->device, &sms));
    s->dec_ok = 1;
    s->dec_tokens = s->dec_max;
    s->dec_split = moe_decode_split(s->E, s->k, s->H, (int)s->is, sms);
    return MOE_STATUS_SUCCESS;
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
    init_shape(l, s);
    if (s->f8 && s->arch != 90) {
        st = moe_error(MOE_STATUS_NOT_SUPPORTED,
                       "CUDA backend: W8A8 needs FP8 tensor cores (sm_90a); this device is sm_%d: "
                       "use MOE_FP8_MATH_W8A16 or AUTO (weights dequantised to bf16)",
                       s->arch);
        goto fail;
    }
    load_oracle(l, s);
    if (s->world > 1) { /* collective; the transport shapes the workspace */
        MOE_CHECK_GOTO(moe_cuda_ep_choose(l, s), st, fail);
        s->oq.transport = moe_oracle_transport_by_name(moe_cuda_ep_transport_name(s->transport));
    }
    MOE_CHECK_GOTO(pick_forced_variant(s), st, fail);
    if (!s->forced && !moe_gemm_select(s->arch, MOE_DTYPE_BF16, MOE_SCALE_NONE, 1.0))
        s->forced = moe_gemm_simple_variant(); /* no tuned variant for this arch */
    MOE_CHECK_GOTO(plan_decode(s), st, fail);
    /* Every kernel a step can launch is loaded now, never inside a step. */
    MOE_CHECK_GOTO(moe_kernels_prepare(s->arch), st, fail);
    if (l->cfg.weight_dtype == MOE_DTYPE_FP8_E4M3 && !s->f8)
        MOE_LOG_INFO("CUDA", "FP8 layer, fp8_math W8A16: weights dequantised to BF16 at load (the "
                             "CPU backend's numbers; MOE_FP8_MATH_W8A8 keeps them e4m3)");

    plan_weights(s, &c);
    l->weight_bytes = c.off;
    MOE_CHECK_GOTO(moe_gpu_malloc(&s->wmem, c.off), st, fail);
    c.base = s->wmem;
    c.off = 0;
    plan_weights(s, &c);
    MOE_CHECK_GOTO(moe_gpu_memset(s->bias, 0, sizeof(float) * (size_t)s->E_total), st, fail);
    MOE_CHECK_GOTO(moe_gpu_memset(s->perm_done, 0, 2 * sizeof(int32_t)), st, fail);
    if (s->dec_ok)
        MOE_CHECK_GOTO(moe_gpu_memset(s->dec_sync, 0,
                                      sizeof(int32_t) *
                                          moe_decode_sync_count(s->E, s->H, s->dec_tokens * s->k)),
                       st, fail);
    if (s->f8 == 1) { /* no static scale until a weight brings one: every expert dynamic */
        MOE_CHECK_GOTO(moe_gpu_memset(s->in13, 0, sizeof(float) * (size_t)s->E), st, fail);
        MOE_CHECK_GOTO(moe_gpu_memset(s->in2, 0, sizeof(float) * (size_t)s->E), st, fail);
        if (s->ss > 0) {
            MOE_CHECK_GOTO(moe_gpu_memset(s->sin13, 0, sizeof(float)), st, fail);
            MOE_CHECK_GOTO(moe_gpu_memset(s->sin2, 0, sizeof(float)), st, fail);
        }
        s->host_in = calloc(3 * ((size_t)s->E + 1), sizeof(float));
        if (!s->host_in) {
            st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "static activation scales");
            goto fail;
        }
    }
    MOE_CHECK_GOTO(moe_gpu_host_alloc((void **)&s->sticky, sizeof(int32_t)), st, fail);
    *s->sticky = 0;

    c.base = NULL;
    c.off = 0;
    plan_workspace(s, &c);
    s->ws_bytes = c.off; /* one lane's; micro-batches take a second one after it */
    l->workspace_bytes = c.off * (size_t)(s->lanes > 1 ? s->lanes : 1);
    MOE_CHECK_GOTO(reserve_workspace(l->rt, l->workspace_bytes), st, fail);
    bind_workspace(l, s);
    if (s->world > 1)
        MOE_CHECK_GOTO(moe_cuda_ep_init(l, s), st, fail);

    s->host_counts = malloc(sizeof(int32_t) * (size_t)s->E);
    if (!s->host_counts) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "profile counts");
        goto fail;
    }
    for (i = 0; i < EV_COUNT; i++)
        MOE_CHECK_GOTO(moe_gpu_event_create(&s->ev[i]), st, fail);
    MOE_LOG_INFO("CUDA",
                 "layer on device %d (sm_%d): %zu weight bytes, %zu workspace bytes (runtime: "
                 "%zu), max_blocks %d, gemm %s",
                 s->device, s->arch, l->weight_bytes, l->workspace_bytes, l->rt->gpu_ws_bytes,
                 s->max_blocks, s->forced ? s->forced->name : "oracle");
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

/* The router as f32 (the SIMT kernels, f32 x) and split in three bf16 planes (tensor cores,
 * bf16 x; moe_split_bf16x3). */
static moe_status_t store_router(cuda_layer_t *s, const moe_matrix_t *m)
{
    const size_t n = (size_t)m->rows * (size_t)m->cols;
    float *f = malloc(sizeof(float) * (n ? n : 1));
    uint16_t *planes = malloc(3 * sizeof(uint16_t) * (n ? n : 1));
    moe_status_t st;
    if (!f || !planes) {
        free(f), free(planes);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "router split: %zu floats", n);
    }
    moe_convert_to_f32(m->dtype, m->data, f, n);
    moe_split_bf16x3(f, planes, planes + n, planes + 2 * n, n);
    /* a router exact in bf16 (checkpoints ship bf16 routers) has zero mid and lo planes: the
     * logits then read and multiply one plane (the same values, moe_route_logits_args_t) */
    s->router_planes = 1;
    for (size_t i = n; i < 3 * n && s->router_planes == 1; i++)
        if (planes[i] != 0)
            s->router_planes = 3;
    st = moe_gpu_memcpy_h2d(s->router, f, sizeof(float) * n);
    if (st == MOE_STATUS_SUCCESS)
        st = moe_gpu_memcpy_h2d(s->router3, planes, 3 * sizeof(uint16_t) * n);
    free(f), free(planes);
    return st;
}

/* Copies a host bf16 matrix, or converts it to bf16 first (round to nearest even): f32, or
 * FP8 e4m3 dequantised with its per-tensor or 128x128 block scales exactly as the CPU reference
 * reads it (moe_cpu_matrix_row). FP8 layers compute in bf16 on the GPU until FP8 kernels are
 * built: W8A16, the same numbers as the CPU backend, not yet the FP8 bandwidth. */
static moe_status_t store_bf16(void *dst, const moe_matrix_t *m)
{
    const size_t n = (size_t)m->rows * (size_t)m->cols;
    uint16_t *tmp;
    float *row = NULL;
    moe_status_t st;
    if (m->dtype == MOE_DTYPE_BF16)
        return moe_gpu_memcpy_h2d(dst, m->data, 2 * n);
    if (m->dtype != MOE_DTYPE_F32 && m->dtype != MOE_DTYPE_FP8_E4M3)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "CUDA backend: expert weights in %s (BF16, or F32/FP8 converted at load)",
                         moe_dtype_name(m->dtype));
    tmp = malloc(2 * (n ? n : 1));
    if (m->dtype == MOE_DTYPE_FP8_E4M3)
        row = malloc(sizeof(float) * (size_t)(m->cols ? m->cols : 1));
    if (!tmp || (m->dtype == MOE_DTYPE_FP8_E4M3 && !row)) {
        free(tmp);
        free(row);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "weight conversion: %zu values", n);
    }
    if (m->dtype == MOE_DTYPE_F32) {
        moe_convert_from_f32(MOE_DTYPE_BF16, m->data, tmp, n);
    } else {
        const moe_cpu_matrix_t cm = {m->dtype, m->scale_kind, m->rows, m->cols, m->data, m->scale};
        for (int64_t r = 0; r < m->rows; r++) {
            moe_cpu_matrix_row(&cm, r, row);
            moe_convert_from_f32(MOE_DTYPE_BF16, row, tmp + (size_t)r * (size_t)m->cols,
                                 (size_t)m->cols);
        }
    }
    st = moe_gpu_memcpy_h2d(dst, tmp, 2 * n);
    free(tmp);
    free(row);
    return st;
}

/* W8A8: the e4m3 bytes as stored, and the scales per weight row: one (a per-tensor scale
 * repeated), or (block) one per 128-wide k slice, the row's 128 x 128 block's. */
static moe_status_t store_e4m3(cuda_layer_t *s, moe_weight_kind_t kind, int local,
                               const moe_matrix_t *m)
{
    const size_t H = (size_t)s->H, is = (size_t)s->is, ss = (size_t)s->ss;
    const size_t rows = (size_t)m->rows, cols = (size_t)m->cols, g = f8_groups(s, m->cols);
    char *dst;
    float *sdst, *rs;
    moe_status_t st;
    size_t r, b;
    if (m->dtype != MOE_DTYPE_FP8_E4M3 || (s->f8 == 2 ? m->scale_kind != MOE_SCALE_BLOCK_128
                                                      : m->scale_kind != MOE_SCALE_PER_TENSOR &&
                                                            m->scale_kind != MOE_SCALE_PER_CHANNEL))
        return moe_error(MOE_STATUS_INTERNAL_ERROR,
                         "W8A8 store: a %s matrix with scale kind %d (e4m3 with the layer's scale "
                         "kind expected)",
                         moe_dtype_name(m->dtype), (int)m->scale_kind);
    switch (kind) {
    case MOE_WEIGHT_GATE_PROJ:
    case MOE_WEIGHT_UP_PROJ:
        dst = (char *)s->w13 + (size_t)local * 2 * is * H;
        sdst = s->w13s + (size_t)local * 2 * is * g;
        if (kind == MOE_WEIGHT_UP_PROJ)
            dst += is * H, sdst += is * g;
        break;
    case MOE_WEIGHT_DOWN_PROJ:
        dst = (char *)s->w2 + (size_t)local * H * is;
        sdst = s->w2s + (size_t)local * H * g;
        break;
    case MOE_WEIGHT_SHARED_GATE_PROJ:
    case MOE_WEIGHT_SHARED_UP_PROJ:
        dst = (char *)s->sw13 + (kind == MOE_WEIGHT_SHARED_UP_PROJ ? ss * H : 0);
        sdst = s->sw13s + (kind == MOE_WEIGHT_SHARED_UP_PROJ ? ss * g : 0);
        break;
    default:
        dst = (char *)s->sw2;
        sdst = s->sw2s;
        break;
    }
    rs = malloc(sizeof(float) * (rows ? rows * g : 1));
    if (!rs)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "W8A8 row scales");
    for (r = 0; r < rows; r++)
        for (b = 0; b < g; b++)
            rs[r * g + b] = m->scale_kind == MOE_SCALE_BLOCK_128    ? m->scale[(r / 128) * g + b]
                            : m->scale_kind == MOE_SCALE_PER_TENSOR ? m->scale[0]
                                                                    : m->scale[r];
    st = moe_gpu_memcpy_h2d(dst, m->data, rows * cols);
    if (st == MOE_STATUS_SUCCESS)
        st = moe_gpu_memcpy_h2d(sdst, rs, sizeof(float) * rows * g);
    free(rs);
    return st;
}

/* W8A8 per-row scale layers: keeps the matrix's static activation scale (its input_scale;
 * per-tensor weights only, 0: none) and uploads the GEMM input scale it changes, as the CPU
 * reference (kernels/cpu/w8a8.c) takes them: GEMM1's is moe_fp8_pair_static_scale(gate, up),
 * recomputed whichever of the two arrives (the other's kept value, 0 until it comes), GEMM2's
 * is down's. `local`: the expert's index on this rank (the shared MLP: row E). */
static moe_status_t store_static_scale(cuda_layer_t *s, moe_weight_kind_t kind, int local,
                                       const moe_matrix_t *m)
{
    const int shared = kind == MOE_WEIGHT_SHARED_GATE_PROJ || kind == MOE_WEIGHT_SHARED_UP_PROJ ||
                       kind == MOE_WEIGHT_SHARED_DOWN_PROJ;
    const int which = kind == MOE_WEIGHT_GATE_PROJ || kind == MOE_WEIGHT_SHARED_GATE_PROJ ? 0
                      : kind == MOE_WEIGHT_UP_PROJ || kind == MOE_WEIGHT_SHARED_UP_PROJ   ? 1
                                                                                          : 2;
    const int row = shared ? s->E : local, slot = 2 * shared + (which == 2);
    float *h = s->host_in + 3 * (size_t)row, *dst, v;
    int e;

    h[which] =
        m->scale_kind == MOE_SCALE_PER_TENSOR && m->input_scale > 0.0f ? m->input_scale : 0.0f;
    v = which == 2 ? h[2] : moe_fp8_pair_static_scale(h[0], h[1]);
    if (shared)
        dst = which == 2 ? s->sin2 : s->sin13;
    else
        dst = (which == 2 ? s->in2 : s->in13) + local;
    MOE_CHECK(moe_gpu_memcpy_h2d(dst, &v, sizeof(float)));
    /* an array with no scale at all is not passed: the quantisation stays the dynamic kernel */
    s->has_in[slot] = 0;
    for (e = shared ? s->E : 0; e < (shared ? s->E + 1 : s->E); e++) {
        const float *he = s->host_in + 3 * (size_t)e;
        s->has_in[slot] |= (which == 2 ? he[2] : moe_fp8_pair_static_scale(he[0], he[1])) > 0.0f;
    }
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_store_weight(moe_layer_t *l, moe_weight_kind_t kind, int local,
                                      const moe_matrix_t *m)
{
    cuda_layer_t *s = l->state;
    const size_t H = (size_t)s->H, is = (size_t)s->is, ss = (size_t)s->ss;
    char *dst;

    switch (kind) {
    case MOE_WEIGHT_ROUTER:
        return store_router(s, m);
    case MOE_WEIGHT_ROUTER_BIAS:
        return store_f32(s->bias, m);
    case MOE_WEIGHT_SHARED_EXPERT_GATE:
        return store_f32(s->sgate, m);
    default:
        break;
    }
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
    if (s->f8) {
        MOE_CHECK(store_e4m3(s, kind, local, m));
        /* block layers never get an input_scale (weights.c keeps it for per-tensor only) */
        return s->f8 == 1 ? store_static_scale(s, kind, local, m) : MOE_STATUS_SUCCESS;
    }
    return store_bf16(dst, m); /* W8A16: the input_scale is not used, as on the CPU */
}

/* The variant for this step: forced, or the oracle's choice for the expected rows per expert
 * (host-known, so a captured graph replays the same choice). */
const moe_gemm_variant_t *moe_cuda_variant_for(const cuda_layer_t *s, double rows_per_expert)
{
    double hi;
    return variant_upto(s, rows_per_expert, &hi);
}

/* The expert MLP's two GEMMs on the rows of a (bf16); W8A8: each GEMM's input quantised per
 * row first (a -> a8, h -> h8), e4m3 weights with per-row scales; in13 / in2 (optional): each
 * expert's static scale of that input (0: dynamic). */
typedef struct mlp_io {
    const void *a; /* bf16 rows; W8A8 with src_slot: NULL, GEMM 1's input gathered from x */
    const void *x; /* W8A8 gather: tokens [T][H] of x_dtype, row r = x[src_slot[r] / k] */
    moe_dtype_t x_dtype;
    const int32_t *src_slot;
    int src_k;
    void *h, *o;
    uint8_t *a8, *h8;
    float *as, *hs;
    const void *w13, *w2;
    const float *w13s, *w2s;
    const float *in13, *in2;
    int64_t inter;
    int num_experts;
} mlp_io_t;

static moe_status_t run_mlp_gemms(const cuda_layer_t *s, const moe_gemm_variant_t *v,
                                  const mlp_io_t *m, const int32_t *block_expert,
                                  const int32_t *num_blocks, int max_blocks, const int32_t *counts,
                                  const int32_t *offsets, void *stream)
{
    const int64_t rows = (int64_t)max_blocks * v->block_rows;
    moe_gemm_args_t g;
    memset(&g, 0, sizeof(g));
    g.expert_counts = counts; /* the permute's: lets a variant skip all-padding rows */
    g.expert_offsets = offsets;
    g.a = m->a;
    g.b = m->w13;
    g.c = m->h;
    g.block_expert = block_expert;
    g.num_blocks = num_blocks;
    g.max_blocks = max_blocks;
    g.num_experts = m->num_experts;
    g.n = (int)(2 * m->inter);
    g.k = s->H;
    g.epilogue = s->act == MOE_ACTIVATION_GELU ? MOE_GEMM_EPI_GELU_MUL : MOE_GEMM_EPI_SILU_MUL;
    g.ab_dtype = MOE_DTYPE_BF16;
    g.scale_kind = MOE_SCALE_NONE;
    if (s->f8) {
        moe_quant_rows_args_t q = {
            m->a,         MOE_DTYPE_BF16, rows,  num_blocks,           v->block_rows, s->H, m->in13,
            block_expert, m->a8,          m->as, s->f8 == 2 ? 128 : 0, NULL,          0};
        if (m->src_slot) { /* the permute's gather fused in: no bf16 copy of the rows */
            q.x = m->x;
            q.x_dtype = m->x_dtype;
            q.src_slot = m->src_slot;
            q.src_k = m->src_k;
        }
        MOE_CHECK(moe_quant_rows_launch(&q, stream));
        g.a = m->a8;
        g.a_scale = m->as;
        g.b_scale = m->w13s;
        g.ab_dtype = MOE_DTYPE_FP8_E4M3;
        g.scale_kind = f8_scale_kind(s);
    }
    g.max_ctas = s->gemm_max_ctas;
    MOE_CHECK(v->launch(&g, stream));
    g.a = m->h;
    g.b = m->w2;
    g.c = m->o;
    g.n = s->H;
    g.k = (int)m->inter;
    g.epilogue = MOE_GEMM_EPI_STORE;
    if (s->f8) {
        moe_quant_rows_args_t q = {
            m->h,   MOE_DTYPE_BF16, rows,  num_blocks, v->block_rows,        (int)m->inter,
            m->in2, block_expert,   m->h8, m->hs,      s->f8 == 2 ? 128 : 0, NULL,
            0};
        MOE_CHECK(moe_quant_rows_launch(&q, stream));
        g.a = m->h8;
        g.a_scale = m->hs;
        g.b_scale = m->w2s;
    }
    return v->launch(&g, stream);
}

moe_status_t moe_cuda_record(const cuda_layer_t *s, int ev, void *stream)
{
    return s->profile ? moe_gpu_event_record(s->ev[ev], stream) : MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_route(moe_layer_t *l, const moe_forward_args_t *a, int32_t *ids, float *w)
{
    cuda_layer_t *s = l->state;
    const float *logits = a->router_logits;
    moe_route_args_t r;

    if (!logits) {
        moe_route_logits_args_t g = {a->x,      a->dtype,      s->router,
                                     s->logits, a->num_tokens, s->E_total,
                                     s->H,      s->router3,    s->router_planes};
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

moe_status_t moe_cuda_scan_inputs(moe_layer_t *l, const moe_forward_args_t *a, int32_t *flag)
{
    cuda_layer_t *s = l->state;
    if (!l->cfg.check_inputs || a->num_tokens == 0)
        return MOE_STATUS_SUCCESS;
    MOE_CHECK(moe_scan_finite_launch(a->x, a->dtype, a->num_tokens * s->H, flag,
                                     MOE_STATUS_NUMERIC_ERROR, a->stream));
    if (a->router_logits)
        MOE_CHECK(moe_scan_finite_launch(a->router_logits, MOE_DTYPE_F32,
                                         a->num_tokens * s->E_total, flag, MOE_STATUS_NUMERIC_ERROR,
                                         a->stream));
    return MOE_STATUS_SUCCESS;
}

/* GEMM 1, the activation and GEMM 2 over the expert-grouped rows of the layout in s->counts,
 * s->offsets, s->block_expert, s->num_blocks: from `a` (bf16), or (W8A8, a NULL) gathered from
 * x through s->slot_of_row by GEMM 1's quantisation. */
static moe_status_t routed_gemms(cuda_layer_t *s, const moe_gemm_variant_t *v, const void *a,
                                 const void *x, moe_dtype_t x_dtype, int mb, double rows_per_expert,
                                 void *stream)
{
    const float *in13 = s->has_in[0] ? s->in13 : NULL, *in2 = s->has_in[1] ? s->in2 : NULL;
    mlp_io_t m = {
        a,      NULL,  MOE_DTYPE_INVALID, NULL,   0,    s->h, s->o,  s->a8, s->h8, s->as, s->hs,
        s->w13, s->w2, s->w13s,           s->w2s, in13, in2,  s->is, s->E};
    if (!a) {
        m.x = x;
        m.x_dtype = x_dtype;
        m.src_slot = s->slot_of_row;
        m.src_k = (int)s->k;
    }
    /* The counts let the m128 variants idle a consumer warpgroup on an all-padding half
     * block. Measured in one run (bench/RESULTS.md): 2-3.5 % faster at up to 1.5 blocks of
     * rows per expert, 4-15 % slower at 2-4 blocks per expert, so only the former. */
    const int skip = s->skip_pad && rows_per_expert <= 1.5 * v->block_rows;
    return run_mlp_gemms(s, v, &m, s->block_expert, s->num_blocks, mb, skip ? s->counts : NULL,
                         skip ? s->offsets : NULL, stream);
}

/* Token rows of `x` (T tokens) through their experts (ids, -1: not on this rank): permute,
 * gather, GEMM1 (act * up), GEMM2 into s->o. rows_per_expert picks the GEMM variant. */
moe_status_t moe_cuda_routed_experts(cuda_layer_t *s, const void *x, moe_dtype_t x_dtype, int64_t T,
                                     const int32_t *ids, const moe_permute_regions_t *regions,
                                     double rows_per_expert, void *stream)
{
    const int64_t rows = T * s->k;
    const moe_gemm_variant_t *v = moe_cuda_variant_for(s, rows_per_expert);
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
                            s->slot_of_row,
                            s->perm_scratch,
                            s->perm_scratch_count,
                            s->perm_done,
                            {0}};
    /* the scatter form: each token row of x read once (padding rows of a left unwritten) */
    moe_gather_args_t g = {x,    x_dtype, s->H, s->k, s->slot_of_row, s->num_blocks, br, mb,
                           s->a, NULL,    0,    {0}};
    if (s->scatter_rows) {
        g.row_of_slot = s->row_of_slot;
        g.num_tokens = T;
    }
    if (regions) {
        p.regions = *regions;
        g.regions = *regions;
    }

    if (mb > s->max_blocks)
        return moe_error(MOE_STATUS_INTERNAL_ERROR, "variant %s needs %d blocks > planned %d",
                         v->name, mb, s->max_blocks);
    MOE_CHECK(moe_permute_launch(&p, stream));
    if (!s->f8) /* W8A8: GEMM 1's quantisation gathers the rows itself */
        MOE_CHECK(moe_gather_launch(&g, stream));
    MOE_CHECK(moe_cuda_record(s, EV_PERMUTE, stream));
    return routed_gemms(s, v, s->f8 ? NULL : s->a, x, x_dtype, mb, rows_per_expert, stream);
}

moe_status_t moe_cuda_experts_laid_out(cuda_layer_t *s, const moe_gemm_variant_t *v, const void *a,
                                       int max_blocks, double rows_per_expert, void *stream)
{
    if (s->f8 || max_blocks > s->max_blocks)
        return moe_error(MOE_STATUS_INTERNAL_ERROR,
                         "laid-out experts: %s, variant %s needs %d blocks (planned %d)",
                         s->f8 ? "W8A8" : "bf16", v->name, max_blocks, s->max_blocks);
    MOE_CHECK(moe_cuda_record(s, EV_PERMUTE, stream));
    return routed_gemms(s, v, a, NULL, MOE_DTYPE_INVALID, max_blocks, rows_per_expert, stream);
}

/* The shared MLP (this rank's slice) on T tokens of x into s->so. */
moe_status_t moe_cuda_shared_experts(cuda_layer_t *s, const void *x, moe_dtype_t x_dtype, int64_t T,
                                     void *stream)
{
    const moe_gemm_variant_t *v = moe_cuda_variant_for(s, (double)T);
    const int br = v->block_rows;
    const int mb = (int)((T + br - 1) / br);
    moe_rows_args_t r = {x, x_dtype, T, s->H, br, mb, s->sa, s->s_block_expert, s->s_num_blocks};

    if (mb > s->s_max_blocks)
        return moe_error(MOE_STATUS_INTERNAL_ERROR, "shared: %d blocks > planned %d", mb,
                         s->s_max_blocks);
    MOE_CHECK(moe_rows_launch(&r, stream));
    {
        const float *in13 = s->has_in[2] ? s->sin13 : NULL, *in2 = s->has_in[3] ? s->sin2 : NULL;
        const mlp_io_t m = {
            s->sa,  NULL,   MOE_DTYPE_INVALID, NULL,   0,        s->sh,   s->so, s->sa8, s->sh8,
            s->sas, s->shs, s->sw13,           s->sw2, s->sw13s, s->sw2s, in13,  in2,    s->ss,
            1};
        return run_mlp_gemms(s, v, &m, s->s_block_expert, s->s_num_blocks, mb, NULL, NULL, stream);
    }
}

/* sigmoid input of Qwen2's shared-expert gate for this rank's tokens. */
moe_status_t moe_cuda_shared_gate(moe_layer_t *l, const moe_forward_args_t *a)
{
    cuda_layer_t *s = l->state;
    moe_route_logits_args_t g = {a->x, a->dtype, s->sgate, s->s_gate_logit, a->num_tokens, 1,
                                 s->H, NULL,     0};
    if (!l->cfg.shared_expert_gate || a->num_tokens == 0)
        return MOE_STATUS_SUCCESS;
    return moe_route_logits_launch(&g, a->stream);
}

moe_status_t moe_cuda_finish_profile(moe_layer_t *l, int accumulate, void *stream)
{
    cuda_layer_t *s = l->state;
    float ms[EV_COUNT] = {0};
    int64_t rows = 0;
    int i;
    /* the step's earlier rounds (EP rounds), which this one adds to */
    const moe_layer_stats_t prev = accumulate ? l->stats : (moe_layer_stats_t){0};

    /* bounded like every other wait: through NCCL's watchdog with EP */
    if (s->nccl)
        MOE_CHECK(moe_nccl_wait(s->nccl, stream));
    else
        MOE_CHECK(moe_gpu_event_synchronize(s->ev[EV_COMBINE]));
    for (i = 1; i < EV_COUNT; i++)
        MOE_CHECK(moe_gpu_event_elapsed_ms(s->ev[i - 1], s->ev[i], &ms[i]));
    l->stats.route_us = prev.route_us + 1e3 * ms[EV_ROUTE];
    l->stats.dispatch_us = prev.dispatch_us + 1e3 * ms[EV_PERMUTE];
    l->stats.expert_us = prev.expert_us + 1e3 * ms[EV_EXPERT];
    l->stats.shared_us = prev.shared_us + 1e3 * ms[EV_SHARED];
    l->stats.combine_us = prev.combine_us + 1e3 * ms[EV_COMBINE];
    MOE_CHECK(moe_gpu_event_elapsed_ms(s->ev[EV_START], s->ev[EV_COMBINE], &ms[0]));
    l->stats.total_us = prev.total_us + 1e3 * ms[0];
    MOE_CHECK(moe_gpu_memcpy_d2h_async(s->host_counts, s->counts, sizeof(int32_t) * (size_t)s->E,
                                       stream));
    MOE_CHECK(moe_gpu_stream_synchronize(stream));
    for (i = 0; i < s->E; i++) {
        l->expert_load[l->plan.first_local_expert + i] =
            s->host_counts[i] + (accumulate ? l->expert_load[l->plan.first_local_expert + i] : 0);
        rows += s->host_counts[i];
    }
    l->stats.rows_received = prev.rows_received + rows;
    return MOE_STATUS_SUCCESS;
}

/* y = sum over slots in order of w * expert rows (+ [gated] shared rows), into args->y. */
moe_status_t moe_cuda_combine(moe_layer_t *l, const moe_forward_args_t *a, const void *rows,
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

/* Whether a step of T tokens takes the fused decode kernel: its crossover, and what it cannot
 * run (static activation scales of the routed experts, x not 16-byte aligned). */
static int use_decode(const cuda_layer_t *s, int64_t T, const void *x)
{
    return s->dec_ok && T <= s->dec_max && !(s->f8 && (s->has_in[0] || s->has_in[1])) &&
           (!x || ((uintptr_t)x & 15) == 0);
}

/* The fused decode step: route, the shared MLP (grouped path), then one kernel for GEMM 1, the
 * activation, GEMM 2 and the weighted sum with the shared rows. Profiled, the expert phase
 * holds the shared MLP and the sum. */
static moe_status_t decode_forward(moe_layer_t *l, const moe_forward_args_t *a, int32_t *ids,
                                   float *w)
{
    cuda_layer_t *s = l->state;
    moe_decode_args_t d;
    MOE_CHECK(moe_cuda_record(s, EV_START, a->stream));
    MOE_CHECK(moe_cuda_scan_inputs(l, a, s->sticky));
    MOE_CHECK(moe_cuda_route(l, a, ids, w));
    MOE_CHECK(moe_cuda_record(s, EV_ROUTE, a->stream));
    MOE_CHECK(moe_cuda_record(s, EV_PERMUTE, a->stream));
    if (s->ss > 0) {
        MOE_CHECK(moe_cuda_shared_experts(s, a->x, a->dtype, a->num_tokens, a->stream));
        MOE_CHECK(moe_cuda_shared_gate(l, a));
    }
    memset(&d, 0, sizeof(d));
    d.x = a->x;
    d.x_dtype = a->dtype;
    d.topk_ids = ids;
    d.topk_weights = w;
    d.w13 = s->w13;
    d.w2 = s->w2;
    d.w13_scale = s->w13s;
    d.w2_scale = s->w2s;
    d.shared_out = s->ss > 0 ? s->so : NULL;
    d.shared_gate_logit = s->ss > 0 && l->cfg.shared_expert_gate ? s->s_gate_logit : NULL;
    d.y = a->y;
    d.y_dtype = a->dtype;
    d.counts = s->counts;
    d.h = s->dec_h;
    d.o = s->dec_o;
    d.xq = s->dec_xq;
    d.xs = s->dec_xs;
    d.sync = s->dec_sync;
    d.num_tokens = a->num_tokens;
    d.top_k = s->k;
    d.num_experts = s->E;
    d.hidden = s->H;
    d.inter = (int)s->is;
    d.f8 = s->f8;
    d.gelu = s->act == MOE_ACTIVATION_GELU;
    d.split = s->dec_split;
    MOE_CHECK(moe_decode_launch(&d, a->stream));
    MOE_CHECK(moe_cuda_record(s, EV_EXPERT, a->stream));
    MOE_CHECK(moe_cuda_record(s, EV_SHARED, a->stream));
    MOE_CHECK(moe_cuda_record(s, EV_COMBINE, a->stream));
    return s->profile ? moe_cuda_finish_profile(l, 0, a->stream) : MOE_STATUS_SUCCESS;
}

static moe_status_t one_gpu_forward(moe_layer_t *l, const moe_forward_args_t *a)
{
    cuda_layer_t *s = l->state;
    int32_t *ids = a->topk_ids ? a->topk_ids : s->ids;
    float *w = a->topk_weights ? a->topk_weights : s->weights;

    if (use_decode(s, a->num_tokens, a->x))
        return decode_forward(l, a, ids, w);

    MOE_CHECK(moe_cuda_record(s, EV_START, a->stream));
    MOE_CHECK(moe_cuda_scan_inputs(l, a, s->sticky));
    MOE_CHECK(moe_cuda_route(l, a, ids, w));
    MOE_CHECK(moe_cuda_record(s, EV_ROUTE, a->stream));
    MOE_CHECK(moe_cuda_routed_experts(s, a->x, a->dtype, a->num_tokens, ids, NULL,
                                      (double)a->num_tokens * s->k / s->E, a->stream));
    MOE_CHECK(moe_cuda_record(s, EV_EXPERT, a->stream));
    if (s->ss > 0) {
        MOE_CHECK(moe_cuda_shared_experts(s, a->x, a->dtype, a->num_tokens, a->stream));
        MOE_CHECK(moe_cuda_shared_gate(l, a));
    }
    MOE_CHECK(moe_cuda_record(s, EV_SHARED, a->stream));
    MOE_CHECK(moe_cuda_combine(l, a, s->o, s->row_of_slot, w, s->so));
    MOE_CHECK(moe_cuda_record(s, EV_COMBINE, a->stream));
    return s->profile ? moe_cuda_finish_profile(l, 0, a->stream) : MOE_STATUS_SUCCESS;
}

/* MOE_PROFILE (read at every forward, so a benchmark can profile one step); never while the
 * stream is being captured. */
static moe_status_t read_profile(cuda_layer_t *s, void *stream)
{
    int capturing = 0;
    s->profile = (int)moe_env_int("MOE_PROFILE", MOE_PROFILE_DEFAULT) != 0;
    if (s->profile) {
        MOE_CHECK(moe_gpu_stream_is_capturing(stream, &capturing));
        s->profile = !capturing;
    }
    return MOE_STATUS_SUCCESS;
}

static moe_status_t cuda_forward(moe_layer_t *l, const moe_forward_args_t *a)
{
    cuda_layer_t *s = l->state;
    if (!s)
        return moe_error(MOE_STATUS_INVALID_STATE, "CUDA layer not initialised");
    bind_workspace(l, s);
    /* With EP the rank takes part in the step's collectives even with bad arguments. */
    if (s->world > 1) {
        if (l->input_status == MOE_STATUS_SUCCESS)
            MOE_CHECK(read_profile(s, a->stream));
        else
            s->profile = 0;
        return moe_cuda_ep_forward(l, a, l->input_status);
    }
    if (l->input_status != MOE_STATUS_SUCCESS)
        return l->input_status;
    if (a->num_tokens == 0) {
        memset(&l->stats, 0, sizeof(l->stats));
        return MOE_STATUS_SUCCESS;
    }
    MOE_CHECK(read_profile(s, a->stream));
    return one_gpu_forward(l, a);
}

/* Bounded wait, then the verdict of the steps since the last synchronize: a step that failed
 * on any rank (bad arguments there, or NaN/Inf input with check_inputs) fails here on every
 * rank, with the same status. */
static moe_status_t cuda_synchronize(moe_layer_t *l, void *stream)
{
    cuda_layer_t *s = l->state;
    int32_t v;
    int rank;
    if (!s)
        return moe_error(MOE_STATUS_INVALID_STATE, "CUDA layer not initialised");
    if (s->nccl)
        MOE_CHECK(moe_nccl_wait(s->nccl, stream));
    else
        MOE_CHECK(moe_gpu_stream_synchronize(stream));
    v = __atomic_load_n(s->sticky, __ATOMIC_ACQUIRE);
    if (v == 0)
        return MOE_STATUS_SUCCESS;
    *s->sticky = 0;
    rank = (v >> 8) & 0xffff;         /* the first failure's rank (the flag bits sit above it) */
    if (v & MOE_A2A_STICKY_TIMEOUT) { /* the timed-out rank, or one whose failure came first */
        moe_cuda_ep_timed_out(l, rank);
        return moe_error(MOE_STATUS_TIMEOUT,
                         "the all-to-all waited %d ms (the runtime's timeout) for a rank (%d%s) "
                         "that never sent its rows or results (dead or stalled); this runtime's "
                         "all-to-all is unusable now",
                         l->rt->timeout_ms, rank,
                         (v & 0xff) == MOE_STATUS_TIMEOUT ? "" : ", or the first to fail before");
    }
    if (v & MOE_A2A_STICKY_ROWS)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "rank %d's step does not match this rank's (different "
                         "max_tokens_across_ranks, a low-latency dispatch too large for the GEMM "
                         "input, or different GEMM variants: tune files); the step was skipped",
                         rank);
    if ((v & 0xff) == MOE_STATUS_NUMERIC_ERROR)
        return moe_error(MOE_STATUS_NUMERIC_ERROR,
                         "check_inputs: rank %d's x or router logits hold NaN or Inf; the step "
                         "was skipped on every rank",
                         rank);
    return moe_error((moe_status_t)(v & 0xff),
                     "rank %d's moe_layer_forward failed (%s; its message says why there); the "
                     "step was skipped on every rank",
                     rank, moe_status_string((moe_status_t)(v & 0xff)));
}

/* The variant a GEMM of this layer gets at rows_per_expert, and why. */
static void explain_gemm(const cuda_layer_t *s, double rows_per_expert, char *text, size_t len)
{
    moe_oracle_choice_t c;
    if (s->forced && !s->forced_env) {
        snprintf(text, len, "%s (no tuned variant for this GPU)", s->forced->name);
        return;
    }
    if (s->forced) {
        const moe_oracle_choice_t f = {s->forced->name, MOE_ORACLE_FORCED, 0, 0, s->forced_env,
                                       s->arch};
        moe_oracle_describe(&f, "rows/expert", rows_per_expert, text, len);
        return;
    }
    if (!oracle_choice(s, rows_per_expert, &c)) {
        snprintf(text, len, "%s (no table for sm_%d)", moe_gemm_simple_variant()->name, s->arch);
        return;
    }
    /* deterministic mode pins the variant of one row per expert: see oracle_choice */
    moe_oracle_describe(&c, s->f8 ? "W8A8, rows/expert" : "rows/expert",
                        s->deterministic ? 1.0 : rows_per_expert, text, len);
    if (s->deterministic && strlen(text) + 1 < len)
        snprintf(text + strlen(text), len - strlen(text), ", pinned by deterministic mode");
}

/* The expert-parallel exchange, and where its transport came from. */
static void explain_ep(const cuda_layer_t *s, char *text, size_t len)
{
    char why[320], ll[160] = "", rounds[256] = "";
    if (s->world == 1) {
        snprintf(text, len, "one GPU");
        return;
    }
    if (s->transport_why.source == MOE_ORACLE_DEFAULT)
        snprintf(why, sizeof(why), "%s (built-in rule)", moe_cuda_ep_transport_name(s->transport));
    else
        moe_oracle_describe(&s->transport_why, "max tokens/rank", (double)s->cap, why, sizeof(why));
    if (s->ll)
        snprintf(ll, sizeof(ll),
                 "; low-latency layout (MOE_EP_LL=1) at up to %lld rows per rank: rows stored "
                 "grouped by expert into the owners' GEMM input",
                 (long long)s->ll_rows);
    if (s->lanes > 1)
        snprintf(rounds, sizeof(rounds),
                 "; a step in rounds of at most %lld tokens per rank on two micro-batch lanes "
                 "(MOE_EP_MICROBATCH=1: one round's exchange beside the other's GEMMs; buffers "
                 "for one round each)",
                 (long long)s->tm);
    else if (s->tm < s->cap)
        snprintf(rounds, sizeof(rounds),
                 "; a step in rounds of at most %lld tokens per rank (ep_round_tokens; buffers "
                 "for one round)",
                 (long long)s->tm);
    snprintf(text, len, "EP transport %s: %s%s%s", why,
             s->transport == MOE_EP_LSA ? "rows stored only into the ranks owning their experts "
                                          "(CUDA IPC, one host)"
             : s->transport == MOE_EP_P2P && s->p2p_header
                 ? "rows sent only to the ranks owning their experts (NCCL send/recv; sizes "
                   "in-band, MOE_EP_P2P_HEADER=1: each round's whole regions move, no host "
                   "read)"
             : s->transport == MOE_EP_P2P
                 ? "rows sent only to the ranks owning their experts (NCCL send/recv; sizes "
                   "read on the host, one synchronisation a step)"
             : s->deterministic ? "all-gather of the tokens, dense exact return (deterministic)"
                                : "all-gather of the tokens (max_tokens_across_ranks rows per rank "
                                  "when given, else the capacity), f32 reduce-scatter return",
             ll, rounds);
}

static void cuda_explain(const moe_layer_t *l, int64_t T, char *text, size_t len)
{
    const cuda_layer_t *s = l->state;
    char routed[512], shared[512] = "", ep[1024];
    /* the hint the forward uses: with EP, as if every rank brought as many tokens (at most a
     * round's) */
    const int64_t Tr = s->world > 1 && T > s->tm ? s->tm : T;
    const double rpe =
        s->world > 1 ? (double)Tr * s->world * s->k / l->cfg.num_experts : (double)T * s->k / s->E;
    if (use_decode(s, T, NULL))
        snprintf(routed, sizeof(routed),
                 "%s (one persistent kernel: GEMM 1, activation, GEMM 2 and the weighted sum%s; "
                 "GEMM 2 k split %d) at up to %d tokens (%s%s)",
                 MOE_ORACLE_FUSED_DECODE, s->f8 ? ", x and h quantised inside" : "", s->dec_split,
                 s->dec_max, s->dec_forced > 0 ? "forced by " : "built-in crossover",
                 s->dec_forced > 0 ? s->forced_env : "");
    else
        explain_gemm(s, rpe, routed, sizeof(routed));
    if (s->ss > 0)
        explain_gemm(s, s->world > 1 && !s->shared_local ? (double)Tr * s->world : (double)Tr,
                     shared, sizeof(shared));
    explain_ep(s, ep, sizeof(ep));
    snprintf(text, len,
             "cuda backend (sm_%d): %lld tokens, %.3g rows/expert: routed GEMMs %s%s%s; %s",
             s->arch, (long long)T, rpe, routed, s->ss > 0 ? "; shared GEMMs " : "", shared, ep);
}

const moe_backend_ops_t moe_backend_cuda = {
    "cuda", cuda_init, cuda_fini, cuda_store_weight, cuda_forward, cuda_synchronize, cuda_explain};
