/* SPDX-License-Identifier: Apache-2.0 */
/* Presets and counter-based random weights and tokens (public API only). */
#include "layer_gen.h"
#include "cli.h"
#include "base/numeric.h"
#include "kernels/cpu/moe_cpu.h"
#include "base/diag.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1) from a 64-bit hash (24 bits: exact in float). */
static float unit(uint64_t h)
{
    return (float)((int64_t)(h >> 40) - (1 << 23)) / (float)(1 << 23);
}

static uint64_t key(uint64_t seed, int kind, int expert, int64_t r, int64_t c)
{
    uint64_t h = mix64(seed ^ 0x6d6f65ULL);
    h = mix64(h ^ ((uint64_t)(kind + 1) << 48) ^ (uint64_t)(uint32_t)(expert + 1));
    h = mix64(h ^ (uint64_t)r);
    return mix64(h ^ ((uint64_t)c << 1));
}

float moe_gen_weight(uint64_t seed, moe_weight_kind_t kind, int expert, int64_t r, int64_t c,
                     int64_t full_cols)
{
    float a = 3.0f / sqrtf((float)full_cols);
    if (kind == MOE_WEIGHT_ROUTER_BIAS)
        a = 0.05f; /* a correction bias: small next to sigmoid scores */
    return a * unit(key(seed, (int)kind, expert, r, c));
}

typedef struct gen_ctx {
    uint64_t seed;
    moe_weight_kind_t kind;
    int expert;
    int64_t r0, c0, cols, full_cols;
    float *out;
} gen_ctx_t;

static void gen_rows(void *arg, int64_t a, int64_t b, float *scratch)
{
    const gen_ctx_t *g = arg;
    (void)scratch;
    for (int64_t r = a; r < b; r++)
        for (int64_t c = 0; c < g->cols; c++)
            g->out[r * g->cols + c] =
                moe_gen_weight(g->seed, g->kind, g->expert, g->r0 + r, g->c0 + c, g->full_cols);
}

void moe_gen_matrix(uint64_t seed, moe_weight_kind_t kind, int expert, int64_t r0, int64_t rows,
                    int64_t c0, int64_t cols, int64_t full_cols, float *out)
{
    gen_ctx_t g = {seed, kind, expert, r0, c0, cols, full_cols, out};
    /* each value a function of its place alone: rows over the CPU backend's threads (a hash is
     * worth some eight multiply-adds); a one-float scratch cannot fail to allocate but for a
     * machine out of memory, and then the rows are made here */
    if (moe_cpu_for_rows(rows, 8.0 * (double)rows * (double)cols, 1, gen_rows, &g, "gen") !=
        MOE_STATUS_SUCCESS) {
        moe_error_clear();
        gen_rows(&g, 0, rows, NULL);
    }
}

void moe_gen_tokens(uint64_t seed, int64_t t0, int64_t n, int hidden, float *x)
{
    int64_t t, h;
    for (t = 0; t < n; t++)
        for (h = 0; h < hidden; h++)
            x[t * hidden + h] = unit(key(seed, 99, 0, t0 + t, h));
}

void moe_gen_skewed_logits(uint64_t seed, int64_t t0, int64_t n, int num_experts, double skew,
                           float *logits)
{
    int64_t t;
    int e;
    for (t = 0; t < n; t++)
        for (e = 0; e < num_experts; e++) {
            /* u in (0, 1), 24 bits; -ln(-ln u) is a standard Gumbel draw */
            const double u = ((double)(key(seed, 97, e, t0 + t, 0) >> 40) + 0.5) / 16777216.0;
            logits[t * num_experts + e] = (float)(-skew * log(e + 1.0) - log(-log(u)));
        }
}

float moe_gen_input_scale(uint64_t seed, moe_weight_kind_t kind, int expert)
{
    const float u = unit(key(seed, 98, expert, (int64_t)kind, 0)); /* [-1, 1) */
    switch (kind) {
    case MOE_WEIGHT_GATE_PROJ:
    case MOE_WEIGHT_SHARED_GATE_PROJ:
        return (1.125f + 0.125f * u) / 448.0f;
    case MOE_WEIGHT_UP_PROJ:
    case MOE_WEIGHT_SHARED_UP_PROJ:
        return expert % 4 == 3 ? 0.0f : (1.125f + 0.125f * u) / 448.0f;
    case MOE_WEIGHT_DOWN_PROJ:
    case MOE_WEIGHT_SHARED_DOWN_PROJ:
        return expert % 3 == 1 ? 0.0f : (12.0f + 2.0f * u) / 448.0f;
    default:
        return 0.0f;
    }
}

/* Sets rows [r0, r0 + rows) x cols [c0, c0 + cols) of a [full_rows, full_cols] matrix: the
 * slice, or (`whole`) the whole matrix, which the layer slices itself. FP8 layers with one
 * scale per matrix or per row get the whole matrix, so that a TP slice is quantised with the
 * scales one rank holding everything would use. `input_scale` > 0: the matrix's static
 * activation scale. */
static moe_status_t set_one(moe_layer_t *layer, uint64_t seed, moe_weight_kind_t kind, int expert,
                            int64_t r0, int64_t rows, int64_t c0, int64_t cols, int64_t full_rows,
                            int64_t full_cols, int whole, float input_scale, float *buf)
{
    moe_tensor_t t = {MOE_DTYPE_F32, rows, cols, buf, NULL, 0, 0};
    if (rows <= 0 || cols <= 0)
        return MOE_STATUS_SUCCESS; /* an empty slice (more ranks than columns) */
    if (whole) {
        r0 = c0 = 0;
        t.rows = rows = full_rows;
        t.cols = cols = full_cols;
    }
    moe_gen_matrix(seed, kind, expert, r0, rows, c0, cols, full_cols, buf);
    if (input_scale > 0.0f)
        return moe_layer_set_weight_with_input_scale(layer, kind, expert, &t, input_scale);
    return moe_layer_set_weight(layer, kind, expert, &t);
}

/* The logical experts of this rank's slots (*mine[num_local_experts], malloc'd; -1 where an
 * earlier slot holds the same expert): the contiguous block, or the placement's slots. */
static moe_status_t local_experts(moe_layer_t *layer, const moe_layer_config_t *cfg,
                                  const moe_layer_info_t *info, int **mine)
{
    const int n = cfg->num_experts + cfg->num_redundant_experts, S = info->num_local_experts;
    int32_t *map = NULL;
    moe_status_t st = MOE_STATUS_SUCCESS;
    int i, j;

    *mine = malloc(sizeof(int) * ((size_t)S + 1));
    if (!*mine)
        return MOE_STATUS_OUT_OF_MEMORY;
    if (info->first_local_expert >= 0) {
        for (i = 0; i < S; i++)
            (*mine)[i] = info->first_local_expert + i;
        return MOE_STATUS_SUCCESS;
    }
    map = malloc(sizeof(int32_t) * (size_t)n);
    if (!map)
        return MOE_STATUS_OUT_OF_MEMORY;
    st = moe_layer_get_placement(layer, map, n);
    for (i = 0; st == MOE_STATUS_SUCCESS && i < S; i++) { /* slots of EP rank r: r * S .. */
        (*mine)[i] = map[info->ep_rank * S + i];
        for (j = 0; j < i; j++)
            if (map[info->ep_rank * S + j] == (*mine)[i])
                (*mine)[i] = -1;
    }
    free(map);
    return st;
}

/* moe_gen_set_weights; `input_scales`: the expert and shared matrices with moe_gen_input_scale's
 * static activation scales; `router` 0: no ROUTER nor ROUTER_BIAS. */
static moe_status_t set_weights(moe_layer_t *layer, const moe_layer_config_t *cfg, uint64_t seed,
                                int input_scales, int router)
{
    const int64_t H = cfg->hidden, E = cfg->num_experts, I = cfg->intermediate;
    moe_layer_info_t info;
    moe_status_t st;
    int64_t is, S, ss, big;
    float *buf;
    int *mine = NULL;
    int e, i, whole;

    if ((st = moe_layer_get_info(layer, &info)) != MOE_STATUS_SUCCESS)
        return st;
    is = info.intermediate_end - info.intermediate_begin;
    ss = info.shared_end - info.shared_begin;
    S = cfg->num_shared_experts > 0
            ? (cfg->shared_intermediate ? cfg->shared_intermediate
                                        : (int64_t)cfg->num_shared_experts * I)
            : 0;
    whole = cfg->weight_dtype == MOE_DTYPE_FP8_E4M3 &&
            (cfg->scale_kind == MOE_SCALE_PER_TENSOR || cfg->scale_kind == MOE_SCALE_PER_CHANNEL);
    /* static activation scales are read by W8A8 on per-tensor FP8 weights alone (the public
     * entry refuses them elsewhere): other layers get none, and compute as they would anyway */
    if (cfg->weight_dtype != MOE_DTYPE_FP8_E4M3 || cfg->scale_kind != MOE_SCALE_PER_TENSOR ||
        cfg->fp8_math != MOE_FP8_MATH_W8A8)
        input_scales = 0;
    big = E * H;
    if ((whole ? I : is) * H > big)
        big = (whole ? I : is) * H;
    if ((whole ? S : ss) * H > big)
        big = (whole ? S : ss) * H;
    buf = malloc(sizeof(float) * (size_t)(big + 1));
    if (!buf)
        return MOE_STATUS_OUT_OF_MEMORY;
#define SET(kind, expert, ...)                                                                     \
    do {                                                                                           \
        const float in_ = input_scales ? moe_gen_input_scale(seed, kind, expert) : 0.0f;           \
        if ((st = set_one(layer, seed, kind, expert, __VA_ARGS__, in_, buf)) !=                    \
            MOE_STATUS_SUCCESS)                                                                    \
            goto out;                                                                              \
    } while (0)
    if (router)
        SET(MOE_WEIGHT_ROUTER, -1, 0, E, 0, H, E, H, 0);
    if (router && cfg->use_score_bias)
        SET(MOE_WEIGHT_ROUTER_BIAS, -1, 0, 1, 0, E, 1, E, 0);
    if ((st = local_experts(layer, cfg, &info, &mine)) != MOE_STATUS_SUCCESS)
        goto out;
    for (i = 0; i < info.num_local_experts; i++) {
        if ((e = mine[i]) < 0)
            continue; /* a second local replica: set_weight fills every one */
        SET(MOE_WEIGHT_GATE_PROJ, e, info.intermediate_begin, is, 0, H, I, H, whole);
        SET(MOE_WEIGHT_UP_PROJ, e, info.intermediate_begin, is, 0, H, I, H, whole);
        SET(MOE_WEIGHT_DOWN_PROJ, e, 0, H, info.intermediate_begin, is, H, I, whole);
    }
    if (S > 0) {
        SET(MOE_WEIGHT_SHARED_GATE_PROJ, -1, info.shared_begin, ss, 0, H, S, H, whole);
        SET(MOE_WEIGHT_SHARED_UP_PROJ, -1, info.shared_begin, ss, 0, H, S, H, whole);
        SET(MOE_WEIGHT_SHARED_DOWN_PROJ, -1, 0, H, info.shared_begin, ss, H, S, whole);
    }
    if (cfg->shared_expert_gate)
        SET(MOE_WEIGHT_SHARED_EXPERT_GATE, -1, 0, 1, 0, H, 1, H, 0);
#undef SET
out:
    free(buf);
    free(mine);
    return st;
}

moe_status_t moe_gen_set_weights(moe_layer_t *layer, const moe_layer_config_t *cfg, uint64_t seed)
{
    return set_weights(layer, cfg, seed, 0, 1);
}

moe_status_t moe_gen_set_weights_unrouted(moe_layer_t *layer, const moe_layer_config_t *cfg,
                                          uint64_t seed)
{
    return set_weights(layer, cfg, seed, 0, 0);
}

moe_status_t moe_gen_set_weights_static(moe_layer_t *layer, const moe_layer_config_t *cfg,
                                        uint64_t seed)
{
    return set_weights(layer, cfg, seed, 1, 1);
}

typedef struct preset {
    const char *name;
    int E, k, H, I, shared, shared_I, sgate;
    moe_scoring_t scoring;
    int bias, n_group, topk_group, renorm;
    float scaling;
} preset_t;

static const preset_t presets[] = {
    {"tiny", 8, 2, 256, 512, 1, 256, 0, MOE_SCORING_SOFTMAX, 0, 0, 0, 1, 1.0f},
    {"mixtral-8x7b", 8, 2, 4096, 14336, 0, 0, 0, MOE_SCORING_SOFTMAX, 0, 0, 0, 1, 1.0f},
    {"qwen3-30b-a3b", 128, 8, 2048, 768, 0, 0, 0, MOE_SCORING_SOFTMAX, 0, 0, 0, 1, 1.0f},
    {"qwen2-moe-a2.7b", 60, 4, 2048, 1408, 1, 5632, 1, MOE_SCORING_SOFTMAX, 0, 0, 0, 0, 1.0f},
    {"deepseek-v3", 256, 8, 7168, 2048, 1, 2048, 0, MOE_SCORING_SIGMOID, 1, 8, 4, 1, 2.5f},
    {"deepseek-v3-ep8", 32, 8, 7168, 2048, 0, 0, 0, MOE_SCORING_SIGMOID, 1, 4, 2, 1, 2.5f},
};

const char *moe_gen_preset_names(void)
{
    return "tiny, mixtral-8x7b, qwen3-30b-a3b, qwen2-moe-a2.7b, deepseek-v3, deepseek-v3-ep8";
}

int moe_gen_preset(const char *name, moe_layer_config_t *cfg)
{
    size_t i;
    for (i = 0; i < sizeof(presets) / sizeof(presets[0]); i++) {
        const preset_t *p = &presets[i];
        if (strcmp(name, p->name))
            continue;
        cfg->num_experts = p->E;
        cfg->top_k = p->k;
        cfg->hidden = p->H;
        cfg->intermediate = p->I;
        cfg->num_shared_experts = p->shared;
        cfg->shared_intermediate = p->shared_I;
        cfg->shared_expert_gate = p->sgate;
        cfg->scoring = p->scoring;
        cfg->use_score_bias = p->bias;
        cfg->n_group = p->n_group;
        cfg->topk_group = p->topk_group;
        cfg->renormalize = p->renorm;
        cfg->routed_scaling_factor = p->scaling;
        return 1;
    }
    return 0;
}

void moe_gen_fill_bf16(uint16_t *p, size_t n, float a, uint64_t *state)
{
    size_t i;
    for (i = 0; i < n; i++) {
        uint64_t x = *state;
        float f;
        uint32_t u;
        x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
        *state = x;
        f = a * ((float)((x * 2685821657736338717ULL) >> 40) / 8388608.0f - 1.0f);
        memcpy(&u, &f, 4);
        p[i] = (uint16_t)(u >> 16);
    }
}

/* The scale array shape of an FP8 matrix [rows, cols] of scale kind k. */
static void fp8_scale_shape(moe_scale_kind_t k, int64_t rows, int64_t cols, moe_tensor_t *t)
{
    t->scale_rows = k == MOE_SCALE_PER_CHANNEL ? rows
                    : k == MOE_SCALE_BLOCK_128 ? (rows + 127) / 128
                                               : 1;
    t->scale_cols = k == MOE_SCALE_BLOCK_128 ? (cols + 127) / 128 : 1;
}

/* One expert matrix kind from the shared buffer: bf16 as generated, or (FP8 layers) the e4m3
 * codes of the same values with one scale everywhere, so that no set-time quantisation runs. */
static moe_status_t set_fast(moe_layer_t *layer, const moe_layer_config_t *c,
                             moe_weight_kind_t kind, int expert, int64_t rows, int64_t cols,
                             const uint16_t *bf16, const uint8_t *fp8, const float *scales,
                             float input_scale)
{
    moe_tensor_t t = {MOE_DTYPE_BF16, rows, cols, bf16, NULL, 0, 0};
    if (fp8) {
        t.dtype = MOE_DTYPE_FP8_E4M3;
        t.data = fp8;
        t.scale = scales;
        fp8_scale_shape(c->scale_kind, rows, cols, &t);
    }
    if (input_scale > 0.0f)
        return moe_layer_set_weight_with_input_scale(layer, kind, expert, &t, input_scale);
    return moe_layer_set_weight(layer, kind, expert, &t);
}

moe_status_t moe_gen_set_weights_fast(moe_layer_t *layer, const moe_layer_config_t *c,
                                      int static_act)
{
    static const moe_weight_kind_t routed[3] = {MOE_WEIGHT_GATE_PROJ, MOE_WEIGHT_UP_PROJ,
                                                MOE_WEIGHT_DOWN_PROJ};
    static const moe_weight_kind_t shared[3] = {
        MOE_WEIGHT_SHARED_GATE_PROJ, MOE_WEIGHT_SHARED_UP_PROJ, MOE_WEIGHT_SHARED_DOWN_PROJ};
    const int64_t H = c->hidden, I = c->intermediate, E = c->num_experts;
    const int64_t S = c->num_shared_experts > 0 ? c->shared_intermediate : 0;
    const int64_t imax = I > S ? I : S, widest = imax > H ? imax : H;
    const int64_t blocks = (widest + 127) / 128; /* 128 x 128 blocks along the widest side */
    const float a = 1.0f / sqrtf((float)H), scale = a / MOE_FP8_E4M3_MAX;
    /* scales of the largest matrix: one per row (per-channel) or per block, at most */
    const int64_t nscale = widest > blocks * blocks ? widest : blocks * blocks;
    int64_t big = imax * H, e, i;
    uint64_t st = 0x9e3779b97f4a7c15ULL;
    moe_tensor_t t = {MOE_DTYPE_BF16, 0, 0, NULL, NULL, 0, 0};
    moe_status_t r = MOE_STATUS_SUCCESS;
    uint16_t *buf;
    uint8_t *q = NULL;
    float *scales = NULL;

    big = big > E * H ? big : E * H;
    buf = malloc(2 * (size_t)big);
    if (c->weight_dtype == MOE_DTYPE_FP8_E4M3) {
        q = malloc((size_t)big);
        scales = malloc(sizeof(float) * (size_t)nscale);
    }
    if (!buf || (c->weight_dtype == MOE_DTYPE_FP8_E4M3 && (!q || !scales))) {
        free(buf), free(q), free(scales);
        return MOE_STATUS_OUT_OF_MEMORY;
    }
    moe_gen_fill_bf16(buf, (size_t)big, a, &st);
    for (i = 0; q && i < big; i++)
        q[i] = moe_fp8e4m3_quantize(moe_bf16_to_f32(buf[i]), scale);
    for (i = 0; scales && i < nscale; i++)
        scales[i] = scale;
    t.data = buf;
    t.rows = E, t.cols = H;
    r = moe_layer_set_weight(layer, MOE_WEIGHT_ROUTER, -1, &t);
    if (r == MOE_STATUS_SUCCESS && c->use_score_bias) {
        t.rows = 1, t.cols = E;
        r = moe_layer_set_weight(layer, MOE_WEIGHT_ROUTER_BIAS, -1, &t);
    }
    for (e = -1; e < E && r == MOE_STATUS_SUCCESS; e++) { /* -1: the shared MLP */
        const moe_weight_kind_t *kinds = e < 0 ? shared : routed;
        const int64_t inner = e < 0 ? S : I;
        if (e < 0 && S == 0)
            continue;
        for (i = 0; i < 3 && r == MOE_STATUS_SUCCESS; i++)
            r = set_fast(layer, c, kinds[i], (int)e, i < 2 ? inner : H, i < 2 ? H : inner, buf, q,
                         scales, !static_act ? 0.0f : (i < 2 ? 1.0f : 2.0f) / MOE_FP8_E4M3_MAX);
    }
    if (S > 0 && r == MOE_STATUS_SUCCESS && c->shared_expert_gate) {
        t.rows = 1, t.cols = H;
        r = moe_layer_set_weight(layer, MOE_WEIGHT_SHARED_EXPERT_GATE, -1, &t);
    }
    free(buf), free(q), free(scales);
    return r;
}

int moe_gen_shape_option(const char *opt, const char *value, moe_layer_config_t *cfg,
                         const char **preset, char *err, size_t err_len)
{
    static const struct {
        const char *name;
        int64_t max;
        size_t field;
    } sizes[] = {
        {"--experts", 65536, offsetof(moe_layer_config_t, num_experts)},
        {"--top-k", 64, offsetof(moe_layer_config_t, top_k)},
        {"--hidden", INT64_C(1) << 20, offsetof(moe_layer_config_t, hidden)},
        {"--intermediate", INT64_C(1) << 20, offsetof(moe_layer_config_t, intermediate)},
    };
    size_t i;
    int64_t x;
    if (!strcmp(opt, "--preset")) {
        const moe_layer_config_t init = MOE_LAYER_CONFIG_INIT;
        *preset = value;
        *cfg = init;
        if (moe_gen_preset(value, cfg))
            return 1;
        snprintf(err, err_len, "--preset %s: unknown (%s)", value, moe_gen_preset_names());
        return 0;
    }
    for (i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        if (strcmp(opt, sizes[i].name))
            continue;
        if (moe_cli_int(opt, value, 1, sizes[i].max, &x, err, err_len))
            return 0;
        *(int *)((char *)cfg + sizes[i].field) = (int)x;
        *preset = "custom";
        return 1;
    }
    return -1;
}

int moe_gen_fp8_option(const char *opt, const char *value, int *fp8, moe_scale_kind_t *scales,
                       int *fast, char *err, size_t err_len)
{
    if (!strcmp(opt, "--accum")) {
        if (strcmp(value, "promoted") && strcmp(value, "fast")) {
            snprintf(err, err_len, "--accum %s: expected promoted or fast", value);
            return 0;
        }
        *fast = !strcmp(value, "fast");
        return 1;
    }
    if (!strcmp(opt, "--dtype")) {
        if (strcmp(value, "bf16") && strcmp(value, "fp8")) {
            snprintf(err, err_len, "--dtype %s: expected bf16 or fp8", value);
            return 0;
        }
        *fp8 = !strcmp(value, "fp8");
        return 1;
    }
    if (strcmp(opt, "--scales"))
        return -1;
    if (!strcmp(value, "tensor"))
        *scales = MOE_SCALE_PER_TENSOR;
    else if (!strcmp(value, "channel"))
        *scales = MOE_SCALE_PER_CHANNEL;
    else if (!strcmp(value, "block"))
        *scales = MOE_SCALE_BLOCK_128;
    else {
        snprintf(err, err_len, "--scales %s: expected tensor, channel or block", value);
        return 0;
    }
    return 1;
}

int moe_gen_fp8_check(int fp8, moe_scale_kind_t scales, int fast, char *err, size_t err_len)
{
    if (!fp8 && (scales || fast)) {
        snprintf(err, err_len, "%s needs --dtype fp8", scales ? "--scales" : "--accum fast");
        return 0;
    }
    return 1;
}

void moe_gen_apply_fp8(moe_layer_config_t *cfg, int fp8, moe_scale_kind_t scales, int fast)
{
    cfg->weight_dtype = MOE_DTYPE_BF16;
    if (!fp8)
        return;
    cfg->weight_dtype = MOE_DTYPE_FP8_E4M3;
    cfg->scale_kind = scales ? scales : MOE_SCALE_PER_TENSOR;
    cfg->fp8_math = fast ? MOE_FP8_MATH_W8A8_FAST : MOE_FP8_MATH_W8A8;
}
