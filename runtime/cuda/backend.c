/* SPDX-License-Identifier: Apache-2.0 */
/* The CUDA backend's entry (moe_backend_ops_t): a layer's lifetime (checks, the oracle, the
 * weights block and the runtime's one workspace), the step on one GPU or across GPUs, the
 * bounded synchronize and its verdict, and moe_layer_explain. Above both halves: the one-GPU
 * half (runtime/cuda/one_gpu.h) and the expert-parallel half (runtime/cuda/ep.h).
 *
 * One GPU: device weights and one workspace planned at init; forward runs route -> permute ->
 * GEMM1 (act * up) -> GEMM2 -> combine on the caller's stream with no host synchronisation and
 * no allocation, so a step can be captured in a CUDA graph (runtime/cuda/step.c). */
#include <stdio.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/diag.h"
#include "kernels/a2a.h"
#include "kernels/decode.h"
#include "kernels/expert_gemm_simple.h"
#include "kernels/expert_gemm_table.h"
#include "kernels/gpu.h"
#include "kernels/prepare.h"
#include "kernels/route.h"
#include "runtime/cuda/ep.h"
#include "runtime/cuda/one_gpu.h"
#include "runtime/ep_rounds.h"

/* MOE_PROFILE=1: synchronise after each forward and fill the layer's stats per phase (read at
 * every forward, so a benchmark can profile one step; ignored while a graph is captured). */
#define MOE_PROFILE_DEFAULT 0

/* The workspace: one GPU's pieces, then (EP) the exchange's after them. */
static void plan_workspace(cuda_layer_t *s, carve_t *c)
{
    if (s->world > 1)
        moe_cuda_ep_plan_workspace(s, c);
    else
        moe_cuda_plan_workspace(s, c);
}

/* Weights and the layer's persistent data: one GPU's, then (EP) the exchange's. */
static void plan_weights(cuda_layer_t *s, carve_t *c)
{
    if (s->world > 1)
        moe_cuda_ep_plan_persistent(s, c);
    else
        moe_cuda_plan_weights(s, c);
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
    if (moe_cfg_w8a8(c)) { /* e4m3 rows: k in whole 16-byte units */
        const int64_t is = l->plan.i_end - l->plan.i_begin, ss = l->plan.s_end - l->plan.s_begin;
        if (c->hidden % 16 || is % 16 || ss % 16)
            return moe_error(MOE_STATUS_NOT_SUPPORTED,
                             "CUDA backend: W8A8 needs hidden (%d), this rank's intermediate "
                             "slice (%lld) and shared slice (%lld) to be multiples of 16",
                             c->hidden, (long long)is, (long long)ss);
    }
    if (l->plan.num_local_experts > MOE_PERMUTE_MAX_EXPERTS)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "CUDA backend: %d expert slots on this rank ((num_experts %d + "
                         "num_redundant_experts %d) / ep_size %d; the permute takes at most %d)",
                         l->plan.num_local_experts, c->num_experts, c->num_redundant_experts,
                         l->plan.ep_size, MOE_PERMUTE_MAX_EXPERTS);
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
    s->oq.hidden = l->cfg.hidden;
    /* e4m3 (W8A8) weights: a byte a value; else bf16 on the GPU */
    s->oq.token_bytes =
        (double)l->cfg.top_k * 3.0 * l->cfg.hidden * l->cfg.intermediate * (s->f8 ? 1.0 : 2.0);
    s->oq.shared = l->plan.shared_intermediate > 0;
    s->oq.accum = moe_cfg_fast_accum(&l->cfg) ? MOE_ORACLE_ACCUM_FAST : MOE_ORACLE_ACCUM_PROMOTED;
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
    s->n_slots = l->plan.num_slots;
    s->k = l->cfg.top_k;
    s->H = l->cfg.hidden;
    s->is = l->plan.i_end - l->plan.i_begin;
    s->ss = l->plan.s_end - l->plan.s_begin;
    s->world = l->plan.world;
    /* see make_plan: without TP every rank keeps the whole shared MLP, run on its own tokens */
    s->shared_local = s->world > 1 && s->ss > 0 && s->ss == l->plan.shared_intermediate;
    /* this rank's slots are one block (g S .., or the floor split's without a placement) */
    s->first_local = 0;
    for (int i = l->plan.num_slots - 1; i >= 0; i--)
        if (l->plan.slot_owner[i] == l->plan.ep_rank)
            s->first_local = i;
    s->deterministic = l->cfg.deterministic;
    s->scatter_rows = l->knobs.v[MOE_KNOB_SCATTER_ROWS] != 0;
    /* off until measured on a GPU (docs/KERNELS.md, "Integration notes") */
    s->route_permute = moe_env_int("MOE_ROUTE_PERMUTE", 0) != 0;
    s->skip_pad = l->knobs.v[MOE_KNOB_GEMM_SKIP_PAD] != 0;
    /* the same codes and scales either way (an A/B knob): docs/KERNELS.md, "FP8 W8A8" */
    s->h_amax = moe_env_int("MOE_QUANT_H_AMAX", 1) != 0;
    /* off: 0.98-1.06 of the step without it (docs/KERNELS.md, "Integration notes") */
    s->early_w = moe_env_int("MOE_GEMM_EARLY_W", 0) != 0;
    s->cap = l->cfg.max_tokens_per_rank;
    /* EP: the buffers hold one round (runtime/ep_rounds.h) */
    s->tm = s->world > 1 ? moe_ep_round_tokens(s->cap, s->world, l->cfg.ep_round_tokens) : s->cap;
    l->ep_round_tokens = s->tm;
    s->step_rows = s->cap; /* EP rows per rank until a step says otherwise */
    s->m = s->tm;
    s->f8 = moe_cfg_w8a8(&l->cfg) ? (l->cfg.scale_kind == MOE_SCALE_BLOCK_128 ? 2 : 1) : 0;
    /* With EP every rank computes over all ranks' (padded) tokens. */
    s->max_tokens = s->tm * s->world;
    s->act = l->cfg.activation;
}

/* Whether and up to how many tokens a step takes the fused decode kernel (sm_90, bf16 or
 * per-row W8A8, not deterministic: that mode keeps one path at every batch; one GPU, or an EP
 * step of the low-latency layout, where the kernel runs the rows the sources laid out:
 * dec_max then bounds world x rows per rank, the most rows one expert can receive). A layer
 * whose experts the kernel cannot run keeps the grouped path (forced: the create fails).
 * W8A8 with 128 x 128 blocks (docs/KERNELS.md, "Fused decode", "Block scales in the kernel"):
 * one GPU, one token a step, the shared MLP on the grouped path, GEMM 1 whole; the oracle's
 * built-in rule as for per-row scales (runtime/oracle.c, decode_builtin). */
static moe_status_t plan_decode(cuda_layer_t *s)
{
    int sms = 0, split1 = 1, nsh = 0;
    s->dec_ok = 0;
    s->dec_max = 0;
    /* MOE_FUSED_DECODE=0: the grouped path at every size, unless the kernel is forced */
    if (!s->dec_forced && !moe_env_int("MOE_FUSED_DECODE", 1))
        return MOE_STATUS_SUCCESS;
    if (s->dec_forced < 0 || (s->world > 1 && (!s->ll || s->f8 == 2)) || s->deterministic ||
        s->arch != 90 ||
        moe_decode_check(s->E, s->k, s->H, (int)s->is, s->f8) != MOE_STATUS_SUCCESS) {
        if (s->dec_forced > 0)
            return moe_error(MOE_STATUS_NOT_SUPPORTED, "%s=%s: this layer cannot run it (%s)",
                             s->forced_env, MOE_ORACLE_FUSED_DECODE,
                             s->world > 1 && s->f8 == 2 ? "block scales: one GPU only"
                             : s->world > 1 && !s->ll
                                 ? "expert parallelism: only with the low-latency layout "
                                   "(MOE_EP_TRANSPORT=lsa, MOE_EP_LL=1)"
                             : s->deterministic ? "deterministic mode"
                             : s->arch != 90    ? "sm_90 only"
                                                : moe_last_error());
        moe_error_clear();
        return MOE_STATUS_SUCCESS;
    }
    MOE_CHECK(moe_gpu_sm_count(s->device, &sms));
    /* MOE_DECODE_K1_SPLIT: GEMM 1's k split; 1 (default): none, 0: by the layer's shape
     * (moe_decode_split1), N: N pieces (an experiment until measured: docs/KERNELS.md) */
    split1 = s->f8 == 2 ? 1 : (int)moe_env_int("MOE_DECODE_K1_SPLIT", 1);
    if (split1 == 0)
        split1 = moe_decode_split1(s->E, s->k, s->H, (int)s->is, sms);
    /* MOE_DECODE_SHARED=0|1 (default 1): the shared MLP inside the kernel, as ss / is more
     * experts (one GPU, GEMM 1 whole, a width that divides: docs/KERNELS.md); the built-in
     * crossover then counts the layer as one without a shared MLP left on the grouped path */
    if (s->world == 1 && s->ss > 0 && s->ss % s->is == 0 && split1 <= 1 && s->f8 != 2 &&
        moe_env_int("MOE_DECODE_SHARED", 1) &&
        moe_decode_check((int)(s->E + s->ss / s->is), (int)(s->k + s->ss / s->is), s->H, (int)s->is,
                         s->f8) == MOE_STATUS_SUCCESS)
        nsh = (int)(s->ss / s->is);
    moe_error_clear();
    s->oq.shared = s->ss > 0 && nsh == 0;
    if (s->dec_forced > 0) {
        s->dec_max = MOE_DECODE_MAX_TOKENS;
    } else {
        moe_oracle_choice_t c;
        s->dec_max = moe_oracle_decode_tokens(&s->oracle, &s->oq, &c);
        s->dec_tuned = c.source == MOE_ORACLE_TUNED;
        if (s->dec_max > MOE_DECODE_MAX_TOKENS) /* a table's open bucket: as far as it goes */
            s->dec_max = MOE_DECODE_MAX_TOKENS;
    }
    if (s->f8 == 2 && s->dec_max > 1) /* block scales: one token a step, forced or not */
        s->dec_max = 1;
    if (s->world > 1 && s->dec_max > s->world * s->ll_rows) /* rows one expert can receive */
        s->dec_max = (int)(s->world * s->ll_rows);
    else if (s->world == 1 && s->dec_max > s->cap)
        s->dec_max = (int)s->cap;
    if (s->dec_max <= 0 || s->dec_max < s->world) /* EP: not even one row per rank */
        return MOE_STATUS_SUCCESS;
    if (s->world > 1 && s->f8 && s->ll_rows > s->dec_max / s->world)
        s->ll_rows = s->dec_max / s->world; /* W8A8: every low-latency step through the kernel */
    s->dec_ok = 1;
    s->dec_tokens = s->dec_max;
    s->dec_split1 = split1;
    s->dec_nsh = nsh;
    s->dec_split = moe_decode_split((int)(s->E + nsh), (int)(s->k + nsh), s->H, (int)s->is, sms);
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
    if (s->world > 1 && s->ll && s->f8 && !s->dec_ok) {
        st = moe_error(MOE_STATUS_NOT_SUPPORTED,
                       "MOE_EP_LL=1 with W8A8 weights runs its steps through the fused decode "
                       "kernel (%s), which this layer does not take at %d ranks (force it with "
                       "MOE_FORCE_VARIANT=%s, or give a tune file's decode crossover)",
                       MOE_ORACLE_FUSED_DECODE, s->world, MOE_ORACLE_FUSED_DECODE);
        goto fail;
    }
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
        MOE_CHECK_GOTO(
            moe_gpu_memset(s->dec_sync, 0, sizeof(int32_t) * moe_cuda_decode_sync_count(s)), st,
            fail);
    MOE_CHECK_GOTO(moe_cuda_upload_placement(&l->plan, s), st, fail);
    MOE_CHECK_GOTO(moe_gpu_memset(s->load, 0, sizeof(unsigned long long) * (size_t)s->E_total), st,
                   fail);
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
    s->last_stream = a->stream; /* what a placement change and the load window wait for */
    return moe_cuda_forward_one_gpu(l, a);
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
    if (s->nccl) {
        MOE_CHECK(moe_nccl_wait(s->nccl, stream));
    } else {
        /* lsa: the host polls with the device's deadline (runtime/cuda/step.c) */
        moe_status_t st = moe_cuda_host_wait(l, stream, 0, "moe_layer_synchronize");
        if (st == MOE_STATUS_TIMEOUT)
            moe_cuda_ep_timed_out(l, -1);
        MOE_CHECK(st);
    }
    v = __atomic_load_n(s->sticky, __ATOMIC_ACQUIRE);
    if (v == 0)
        return MOE_STATUS_SUCCESS;
    *s->sticky = 0;
    rank = (v >> 8) & 0xffff;        /* the first failure's rank (the flag bits sit above it) */
    if (v & MOE_DECODE_STICKY_STALL) /* one GPU: the fused decode kernel's own items */
        return moe_error(MOE_STATUS_TIMEOUT,
                         "the fused decode kernel (%s) waited %d ms (the runtime's timeout, "
                         "within 1 .. 10 s) for its own work items: its CTAs were not all "
                         "resident at once (another kernel that waits on its own grid beside it, "
                         "such as a second layer's decode step on another stream, or MPS clients "
                         "holding SMs); the step's output is not valid (MOE_FUSED_DECODE=0 keeps "
                         "the grouped path)",
                         MOE_ORACLE_FUSED_DECODE, moe_cuda_decode_timeout_ms(l));
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
                         "rank %d's given_topk_weights hold NaN or Inf, or (check_inputs) its x or "
                         "router logits do; the step was skipped on every rank",
                         rank);
    return moe_error((moe_status_t)(v & 0xff),
                     "rank %d's moe_layer_forward failed (%s; its message says why there, or its "
                     "given_topk_ids hold an id outside 0..%d); the step was skipped on every rank",
                     rank, moe_status_string((moe_status_t)(v & 0xff)), l->cfg.num_experts - 1);
}

static void cuda_explain(const moe_layer_t *l, int64_t T, char *text, size_t len)
{
    const cuda_layer_t *s = l->state;
    char routed[1024], shared[512] = "", ep[1024];
    /* the hint the forward uses: with EP, as if every rank brought as many tokens (at most a
     * round's) */
    const int64_t Tr = s->world > 1 && T > s->tm ? s->tm : T;
    const double rpe =
        s->world > 1 ? (double)Tr * s->world * s->k / l->cfg.num_experts : (double)T * s->k / s->E;
    const int dec = moe_cuda_use_decode(s, T, NULL);
    const int ep_dec = moe_cuda_ep_use_decode(s, Tr);
    if (dec || ep_dec)
        snprintf(routed, sizeof(routed),
                 "%s (one persistent kernel: GEMM 1, activation, GEMM 2 and %s%s; GEMM 1 k split "
                 "%d, GEMM 2 k split %d) at up to %d %s (%s%s)",
                 MOE_ORACLE_FUSED_DECODE,
                 ep_dec ? "each received row's expert output, on the rows as the low-latency "
                          "dispatch laid them out"
                        : "the weighted sum",
                 s->f8 == 2 ? ", x and h quantised inside per 128-wide group, each 128 of k "
                              "promoted with its block scales"
                 : s->f8    ? ", x and h quantised inside"
                            : "",
                 s->dec_split1, s->dec_split, s->dec_max,
                 ep_dec ? "rows an expert (ranks x tokens per rank)" : "tokens",
                 s->dec_forced > 0 ? "forced by "
                 : s->dec_tuned    ? "crossover tuned from "
                                   : "built-in crossover",
                 s->dec_forced > 0 ? s->forced_env
                 : s->dec_tuned    ? s->oracle.file
                                   : "");
    else
        moe_cuda_explain_gemm(s, rpe, routed, sizeof(routed));
    if (s->ss > 0 && dec && moe_cuda_decode_shared_inside(s))
        snprintf(shared, sizeof(shared),
                 "inside the fused decode kernel, as %d more experts of the routed width "
                 "(MOE_DECODE_SHARED=1)",
                 s->dec_nsh);
    else if (s->ss > 0)
        moe_cuda_explain_gemm(s,
                              dec                                ? moe_cuda_decode_shared_rows(s)
                              : s->world > 1 && !s->shared_local ? (double)Tr * s->world
                                                                 : (double)Tr,
                              shared, sizeof(shared));
    moe_cuda_ep_explain(s, ep, sizeof(ep));
    const int one_launch = s->world == 1 && !dec && moe_cuda_route_permutes(s, T, 0);
    snprintf(text, len,
             "cuda backend (sm_%d): %lld tokens, %.3g rows/expert: %srouted GEMMs %s%s%s; %s",
             s->arch, (long long)T, rpe,
             one_launch ? "top-k, slot ids and permute in one launch (MOE_ROUTE_PERMUTE); " : "",
             routed, s->ss > 0 ? "; shared GEMMs " : "", shared, ep);
}

const moe_backend_ops_t moe_backend_cuda = {"cuda",
                                            cuda_init,
                                            cuda_fini,
                                            moe_cuda_store_weight,
                                            cuda_forward,
                                            cuda_synchronize,
                                            cuda_explain,
                                            moe_cuda_set_placement,
                                            moe_cuda_load_window,
                                            moe_cuda_reset_load_window};
