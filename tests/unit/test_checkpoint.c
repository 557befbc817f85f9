/* SPDX-License-Identifier: Apache-2.0 */
/* Checkpoints made here for each family (sharded or not, bf16 or fp8 with block scales) load
 * into a layer that computes what the same weights set by API compute; malformed checkpoints
 * and configs give a clear status and message. */
#define _POSIX_C_SOURCE 200809L
#include "testutil.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/numeric.h"
#include "moe/moe_checkpoint.h"
#include "runtime/formats/safetensors.h"

static moe_runtime_t *rt;
static char g_root[256];
static int g_seq;
/* Run under mpirun the test loads every rank's shard: EP over the ranks, or TP when
 * MOE_TEST_TP is set (tests/slurm/CMakeLists.txt registers both). */
static int g_world = 1, g_tp = 0;
/* check_fixture_as: the loaded layer gets this many redundant slots per EP rank and a placement
 * with replicas on several ranks, set before the load (0: neither) */
static int g_redundant_per_rank;

/* ---- a checkpoint generator ---------------------------------------------------------------- */

typedef struct fx_tensor {
    char name[200];
    moe_st_dtype_t dtype;
    int ndim;
    int64_t shape[2];
    void *data;
    /* set by API in the reference layer (NULL kind = not a layer weight) */
    int kind, expert; /* -1 when not a weight of the tested layer */
    float *scale;     /* fp8: the block scales tensor's data (owned by its own entry) */
    int64_t srows, scols;
} fx_tensor_t;

/* Enough for 256 experts' three FP8 matrices and their scales (a DeepSeek-V3-sized layer). */
#define FX_MAX_TENSORS 1600

typedef struct fixture {
    moe_model_family_t fam;
    int E, k, H, I, S, layer, fp8, shards, num_layers;
    int n_group, topk_group; /* DeepSeek-V3 grouped top-k (4 and 2 unless set) */
    char dir[300];
    char extra_config[512]; /* more config.json members, each starting with ',' */
    fx_tensor_t t[FX_MAX_TENSORS];
    int n;
    uint64_t rng;
} fixture_t;

static float frand(fixture_t *f, float a)
{
    f->rng ^= f->rng << 13;
    f->rng ^= f->rng >> 7;
    f->rng ^= f->rng << 17;
    return ((float)(f->rng >> 40) / (float)(1u << 24) * 2.0f - 1.0f) * a;
}

static fx_tensor_t *fx_add(fixture_t *f, const char *name, moe_st_dtype_t dt, int ndim, int64_t r,
                           int64_t c, int kind, int expert)
{
    fx_tensor_t *t = &f->t[f->n++];
    int64_t n = ndim == 1 ? r : r * c;
    assert_true(f->n <= FX_MAX_TENSORS);
    memset(t, 0, sizeof(*t));
    snprintf(t->name, sizeof(t->name), "%s", name);
    t->dtype = dt;
    t->ndim = ndim;
    t->shape[0] = r;
    t->shape[1] = c;
    t->data = calloc((size_t)n + 1, moe_st_dtype_size(dt));
    t->kind = kind;
    t->expert = expert;
    return t;
}

/* A matrix of random values in the checkpoint's dtype. fp8 1: a _scale_inv tensor of 128x128
 * block scales (DeepSeek-V3); fp8 2: one scale per matrix in a 0-dimensional _scale tensor and
 * a static input_scale beside it (AutoFP8 / common FP8 exporters). */
static void fx_matrix(fixture_t *f, const char *name, int64_t R, int64_t C, int kind, int expert,
                      int fp8, float a)
{
    float *v = malloc(sizeof(float) * (size_t)(R * C));
    fx_tensor_t *t;

    for (int64_t i = 0; i < R * C; i++)
        v[i] = frand(f, a);
    if (!fp8) {
        t = fx_add(f, name, MOE_ST_BF16, 2, R, C, kind, expert);
        moe_convert_from_f32(MOE_DTYPE_BF16, v, t->data, (size_t)(R * C));
    } else if (fp8 == 2) {
        char sname[200];
        fx_tensor_t *s;
        float amax = 0, sc;
        size_t nl = strlen(name) - strlen("weight");
        t = fx_add(f, name, MOE_ST_F8_E4M3, 2, R, C, kind, expert);
        snprintf(sname, sizeof(sname), "%s_scale", name);
        s = fx_add(f, sname, MOE_ST_F32, 0, 1, 1, -1, -1);
        for (int64_t i = 0; i < R * C; i++)
            amax = fmaxf(amax, fabsf(v[i]));
        sc = amax > 0 ? amax / 448.0f : 1.0f;
        ((float *)s->data)[0] = sc;
        for (int64_t i = 0; i < R * C; i++)
            ((uint8_t *)t->data)[i] = moe_f32_to_fp8e4m3(v[i] / sc);
        t->scale = s->data;
        t->srows = 1;
        t->scols = 1;
        snprintf(sname, sizeof(sname), "%.*sinput_scale", (int)nl, name);
        s = fx_add(f, sname, MOE_ST_F32, 0, 1, 1, -1, -1);
        ((float *)s->data)[0] = 0.02f;
    } else {
        int64_t sr = (R + 127) / 128, sc = (C + 127) / 128;
        char sname[200];
        fx_tensor_t *s;
        t = fx_add(f, name, MOE_ST_F8_E4M3, 2, R, C, kind, expert);
        snprintf(sname, sizeof(sname), "%s_scale_inv", name);
        s = fx_add(f, sname, MOE_ST_F32, 2, sr, sc, -1, -1);
        for (int64_t bi = 0; bi < sr; bi++)
            for (int64_t bj = 0; bj < sc; bj++) {
                float amax = 0;
                for (int64_t r = bi * 128; r < R && r < bi * 128 + 128; r++)
                    for (int64_t c = bj * 128; c < C && c < bj * 128 + 128; c++)
                        amax = fmaxf(amax, fabsf(v[r * C + c]));
                ((float *)s->data)[bi * sc + bj] = amax > 0 ? amax / 448.0f : 1.0f;
            }
        for (int64_t r = 0; r < R; r++)
            for (int64_t c = 0; c < C; c++)
                ((uint8_t *)t->data)[r * C + c] =
                    moe_f32_to_fp8e4m3(v[r * C + c] / ((float *)s->data)[(r / 128) * sc + c / 128]);
        t->scale = s->data;
        t->srows = sr;
        t->scols = sc;
    }
    free(v);
}

static const char *family_type(moe_model_family_t fam)
{
    switch (fam) {
    case MOE_FAMILY_MIXTRAL:
        return "mixtral";
    case MOE_FAMILY_QWEN2_MOE:
        return "qwen2_moe";
    case MOE_FAMILY_QWEN3_MOE:
        return "qwen3_moe";
    default:
        return "deepseek_v3";
    }
}

/* Fills f->t with the tensors of layer f->layer (plus some others a real checkpoint has). */
static void fx_build(fixture_t *f)
{
    char p[64], n[160];
    const int mix = f->fam == MOE_FAMILY_MIXTRAL;
    const char *ex[3] = {mix ? "w1" : "gate_proj", mix ? "w3" : "up_proj",
                         mix ? "w2" : "down_proj"};
    const int kinds[3] = {MOE_WEIGHT_GATE_PROJ, MOE_WEIGHT_UP_PROJ, MOE_WEIGHT_DOWN_PROJ};

    f->rng = 0x9E3779B97F4A7C15ull ^ (uint64_t)f->fam;
    snprintf(p, sizeof(p), mix ? "model.layers.%d.block_sparse_moe" : "model.layers.%d.mlp",
             f->layer);
    fx_matrix(f, "model.embed_tokens.weight", 32, f->H, -1, -1, 0, 1.0f);
    snprintf(n, sizeof(n), "model.layers.%d.self_attn.q_proj.weight", f->layer);
    fx_matrix(f, n, f->H, f->H, -1, -1, 0, 0.1f);
    snprintf(n, sizeof(n), "%s.gate.weight", p);
    fx_matrix(f, n, f->E, f->H, MOE_WEIGHT_ROUTER, -1, 0, 0.5f);
    if (f->fam == MOE_FAMILY_DEEPSEEK_V3) {
        fx_tensor_t *b;
        snprintf(n, sizeof(n), "%s.gate.e_score_correction_bias", p);
        b = fx_add(f, n, MOE_ST_F32, 1, f->E, 1, MOE_WEIGHT_ROUTER_BIAS, -1);
        for (int e = 0; e < f->E; e++)
            ((float *)b->data)[e] = frand(f, 0.05f);
    }
    for (int e = 0; e < f->E; e++)
        for (int j = 0; j < 3; j++) {
            int down = j == 2;
            snprintf(n, sizeof(n), "%s.experts.%d.%s.weight", p, e, ex[j]);
            fx_matrix(f, n, down ? f->H : f->I, down ? f->I : f->H, kinds[j], e, f->fp8,
                      down ? 1.5f / sqrtf((float)f->I) : 1.5f / sqrtf((float)f->H));
        }
    if (f->S) {
        const char *sp = f->fam == MOE_FAMILY_QWEN2_MOE ? "shared_expert" : "shared_experts";
        const int sk[3] = {MOE_WEIGHT_SHARED_GATE_PROJ, MOE_WEIGHT_SHARED_UP_PROJ,
                           MOE_WEIGHT_SHARED_DOWN_PROJ};
        for (int j = 0; j < 3; j++) {
            int down = j == 2;
            snprintf(n, sizeof(n), "%s.%s.%s.weight", p, sp, ex[j]);
            fx_matrix(f, n, down ? f->H : f->S, down ? f->S : f->H, sk[j], -1, f->fp8,
                      down ? 1.5f / sqrtf((float)f->S) : 1.5f / sqrtf((float)f->H));
        }
        if (f->fam == MOE_FAMILY_QWEN2_MOE) {
            snprintf(n, sizeof(n), "%s.shared_expert_gate.weight", p);
            fx_matrix(f, n, 1, f->H, MOE_WEIGHT_SHARED_EXPERT_GATE, -1, 0, 0.2f);
        }
    }
}

static void write_text(const char *dir, const char *name, const char *text)
{
    char path[400];
    FILE *fp;
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    fp = fopen(path, "w");
    assert_non_null(fp);
    fputs(text, fp);
    fclose(fp);
}

/* Appends "key": value unless the fixture's extra_config sets that key itself. */
static void kv(const fixture_t *f, char *cfg, size_t cap, const char *key, const char *fmt, ...)
{
    char quoted[80];
    size_t o = strlen(cfg);
    va_list ap;

    snprintf(quoted, sizeof(quoted), "\"%s\"", key);
    if (strstr(f->extra_config, quoted))
        return;
    o += (size_t)snprintf(cfg + o, cap - o, "%s\n  %s: ", o > 2 ? "," : "", quoted);
    va_start(ap, fmt);
    vsnprintf(cfg + o, cap - o, fmt, ap);
    va_end(ap);
}

static void fx_write_config(const fixture_t *f)
{
    char cfg[2048] = "{";
    const size_t n = sizeof(cfg);

    kv(f, cfg, n, "architectures", "[\"X\"]");
    kv(f, cfg, n, "model_type", "\"%s\"", family_type(f->fam));
    kv(f, cfg, n, "hidden_size", "%d", f->H);
    kv(f, cfg, n, "num_hidden_layers", "%d", f->num_layers);
    kv(f, cfg, n, "num_experts_per_tok", "%d", f->k);
    kv(f, cfg, n, "hidden_act", "\"silu\"");
    kv(f, cfg, n, "torch_dtype", "\"bfloat16\"");
    kv(f, cfg, n, "rope_scaling", "null");
    switch (f->fam) {
    case MOE_FAMILY_MIXTRAL:
        kv(f, cfg, n, "num_local_experts", "%d", f->E);
        kv(f, cfg, n, "intermediate_size", "%d", f->I);
        break;
    case MOE_FAMILY_QWEN2_MOE:
        kv(f, cfg, n, "num_experts", "%d", f->E);
        kv(f, cfg, n, "moe_intermediate_size", "%d", f->I);
        kv(f, cfg, n, "intermediate_size", "5632");
        kv(f, cfg, n, "shared_expert_intermediate_size", "%d", f->S);
        kv(f, cfg, n, "norm_topk_prob", "false");
        kv(f, cfg, n, "decoder_sparse_step", "1");
        kv(f, cfg, n, "mlp_only_layers", "[0]");
        break;
    case MOE_FAMILY_QWEN3_MOE:
        kv(f, cfg, n, "num_experts", "%d", f->E);
        kv(f, cfg, n, "moe_intermediate_size", "%d", f->I);
        kv(f, cfg, n, "norm_topk_prob", "true");
        kv(f, cfg, n, "decoder_sparse_step", "2");
        kv(f, cfg, n, "mlp_only_layers", "[]");
        break;
    default:
        kv(f, cfg, n, "n_routed_experts", "%d", f->E);
        kv(f, cfg, n, "moe_intermediate_size", "%d", f->I);
        kv(f, cfg, n, "n_shared_experts", "%d", f->S / f->I);
        kv(f, cfg, n, "first_k_dense_replace", "1");
        kv(f, cfg, n, "moe_layer_freq", "1");
        kv(f, cfg, n, "n_group", "%d", f->n_group ? f->n_group : 4);
        kv(f, cfg, n, "topk_group", "%d", f->topk_group ? f->topk_group : 2);
        kv(f, cfg, n, "norm_topk_prob", "true");
        kv(f, cfg, n, "routed_scaling_factor", "2.5");
        kv(f, cfg, n, "scoring_func", "\"sigmoid\"");
        kv(f, cfg, n, "topk_method", "\"noaux_tc\"");
        if (f->fp8 == 1)
            kv(f, cfg, n, "quantization_config",
               "{\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\", "
               "\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]}");
        break;
    }
    if (f->fp8 == 2)
        kv(f, cfg, n, "quantization_config",
           "{\"activation_scheme\": \"static\", \"quant_method\": \"fp8\", "
           "\"ignored_layers\": [\"lm_head\"]}");
    snprintf(cfg + strlen(cfg), n - strlen(cfg), "%s\n}\n", f->extra_config);
    write_text(f->dir, "config.json", cfg);
}

/* Writes the tensors as one model.safetensors or `shards` files plus the index. Tensors go to
 * shards round-robin so one layer spans every file; the index lists them. */
static void fx_write(fixture_t *f)
{
    char path[400];
    moe_st_entry_t *e = calloc((size_t)f->n, sizeof(*e));

    snprintf(f->dir, sizeof(f->dir), "%s/ckpt%d", g_root, g_seq++);
    assert_int_equal(mkdir(f->dir, 0700), 0);
    fx_write_config(f);
    if (f->shards <= 1) {
        for (int i = 0; i < f->n; i++)
            e[i] = (moe_st_entry_t){f->t[i].name,
                                    f->t[i].dtype,
                                    f->t[i].ndim,
                                    {f->t[i].shape[0], f->t[i].shape[1]},
                                    f->t[i].data};
        snprintf(path, sizeof(path), "%s/model.safetensors", f->dir);
        TU_OK(moe_st_write(path, e, (size_t)f->n, (const char *[]){"format", "pt"}, 1));
    } else {
        size_t cap = 64 + (size_t)f->n * 256, o = 0;
        char *index = malloc(cap);
        o += (size_t)snprintf(index, cap, "{\"metadata\": {\"total_size\": 0}, \"weight_map\": {");
        for (int s = 0; s < f->shards; s++) {
            int m = 0;
            char fname[64];
            snprintf(fname, sizeof(fname), "model-%05d-of-%05d.safetensors", s + 1, f->shards);
            for (int i = s; i < f->n; i += f->shards) {
                e[m++] = (moe_st_entry_t){f->t[i].name,
                                          f->t[i].dtype,
                                          f->t[i].ndim,
                                          {f->t[i].shape[0], f->t[i].shape[1]},
                                          f->t[i].data};
                o += (size_t)snprintf(index + o, cap - o, "%s\n  \"%s\": \"%s\"", o > 60 ? "," : "",
                                      f->t[i].name, fname);
            }
            snprintf(path, sizeof(path), "%s/%s", f->dir, fname);
            TU_OK(moe_st_write(path, e, (size_t)m, NULL, 0));
        }
        snprintf(index + o, cap - o, "\n}}\n");
        write_text(f->dir, "model.safetensors.index.json", index);
        free(index);
    }
    free(e);
}

static void fx_free(fixture_t *f)
{
    for (int i = 0; i < f->n; i++)
        free(f->t[i].data);
    f->n = 0;
}

/* The layer's config as the test knows it (independent of the checkpoint reader). */
static moe_layer_config_t fx_config(const fixture_t *f)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    c.num_experts = f->E;
    c.top_k = f->k;
    c.hidden = f->H;
    c.intermediate = f->I;
    c.max_tokens_per_rank = 32;
    c.tp_size = g_tp;
    c.weight_dtype = f->fp8 ? MOE_DTYPE_FP8_E4M3 : MOE_DTYPE_BF16;
    c.scale_kind = f->fp8 == 2 ? MOE_SCALE_PER_TENSOR
                   : f->fp8    ? MOE_SCALE_BLOCK_128
                               : MOE_SCALE_NONE;
    switch (f->fam) {
    case MOE_FAMILY_MIXTRAL:
        c.renormalize = 1;
        break;
    case MOE_FAMILY_QWEN2_MOE:
        c.renormalize = 0;
        c.num_shared_experts = 1;
        c.shared_intermediate = f->S;
        c.shared_expert_gate = 1;
        break;
    case MOE_FAMILY_QWEN3_MOE:
        c.renormalize = 1;
        break;
    default:
        c.scoring = MOE_SCORING_SIGMOID;
        c.use_score_bias = 1;
        c.n_group = f->n_group ? f->n_group : 4;
        c.topk_group = f->topk_group ? f->topk_group : 2;
        c.renormalize = 1;
        c.routed_scaling_factor = 2.5f;
        c.num_shared_experts = f->S / f->I;
        c.shared_intermediate = f->S;
        break;
    }
    return c;
}

static void forward(moe_layer_t *layer, const float *x, int64_t T, int H, float *y)
{
    moe_forward_args_t fa = MOE_FORWARD_ARGS_INIT;
    fa.num_tokens = T;
    fa.dtype = MOE_DTYPE_F32;
    fa.x = x;
    fa.y = y;
    for (int64_t i = 0; i < T * H; i++)
        y[i] = NAN; /* poisoned: every element must be written */
    TU_OK(moe_layer_forward(layer, &fa));
}

/* Loads the fixture's layer from disk and by API; both forwards must agree exactly. */
static void check_fixture_as(fixture_t *f, moe_dtype_t layer_dtype)
{
    moe_checkpoint_t *ck = NULL;
    moe_layer_config_t want = fx_config(f), got = MOE_LAYER_CONFIG_INIT;
    moe_layer_t *a = NULL, *b = NULL;
    moe_checkpoint_info_t info;
    const int64_t T = 24;
    float *x = malloc(sizeof(float) * (size_t)(T * f->H));
    float *ya = malloc(sizeof(float) * (size_t)(T * f->H));
    float *yb = malloc(sizeof(float) * (size_t)(T * f->H));
    uint64_t seed = tu_seed("checkpoint");
    double abs_sum = 0;

    TU_OK(moe_checkpoint_open(f->dir, &ck));
    TU_OK(moe_checkpoint_get_info(ck, &info));
    assert_int_equal(info.family, f->fam);
    assert_string_equal(info.model_type, family_type(f->fam));
    assert_int_equal(info.num_layers, f->num_layers);
    assert_int_equal(info.num_files, f->shards > 1 ? f->shards : 1);
    assert_int_equal(info.num_tensors, f->n);

    got.max_tokens_per_rank = 32;
    got.tp_size = g_tp;
    TU_OK(moe_checkpoint_layer_config(ck, f->layer, &got));
    assert_int_equal(got.num_experts, want.num_experts);
    assert_int_equal(got.top_k, want.top_k);
    assert_int_equal(got.hidden, want.hidden);
    assert_int_equal(got.intermediate, want.intermediate);
    assert_int_equal(got.num_shared_experts, want.num_shared_experts);
    assert_int_equal(got.shared_intermediate, want.shared_intermediate);
    assert_int_equal(got.shared_expert_gate, want.shared_expert_gate);
    assert_int_equal(got.scoring, want.scoring);
    assert_int_equal(got.use_score_bias, want.use_score_bias);
    assert_int_equal(got.n_group, want.n_group);
    assert_int_equal(got.topk_group, want.topk_group);
    assert_int_equal(got.renormalize, want.renormalize);
    assert_true(got.routed_scaling_factor == want.routed_scaling_factor);
    assert_int_equal(got.weight_dtype, want.weight_dtype);
    assert_int_equal(got.scale_kind, want.scale_kind);
    assert_int_equal(got.max_tokens_per_rank, 32); /* deployment fields untouched */
    if (layer_dtype != MOE_DTYPE_INVALID) {
        /* The caller keeps the layer in another dtype than the checkpoint's. */
        got.weight_dtype = want.weight_dtype = layer_dtype;
        got.scale_kind = want.scale_kind = MOE_SCALE_NONE;
    }

    if (g_redundant_per_rank) {
        const int ep = g_world / (g_tp ? g_tp : 1),
                  n = want.num_experts + g_redundant_per_rank * ep;
        int32_t *map = malloc(sizeof(int32_t) * (size_t)n);
        assert_non_null(map);
        for (int i = 0; i < n; i++) /* every expert, backwards, then the first ones again */
            map[i] = i < want.num_experts ? want.num_experts - 1 - i : i - want.num_experts;
        got.num_redundant_experts = g_redundant_per_rank * ep;
        TU_OK(moe_layer_create(rt, &got, &a));
        TU_OK(moe_layer_set_placement(a, map, n));
        free(map);
    } else {
        TU_OK(moe_layer_create(rt, &got, &a));
    }
    TU_OK(moe_layer_load(a, ck, f->layer));
    TU_OK(moe_checkpoint_close(ck));

    TU_OK(moe_layer_create(rt, &want, &b));
    for (int i = 0; i < f->n; i++) {
        fx_tensor_t *t = &f->t[i];
        moe_tensor_t mt = {moe_st_to_moe_dtype(t->dtype),
                           t->ndim == 1 ? 1 : t->shape[0],
                           t->ndim == 1 ? t->shape[0] : t->shape[1],
                           t->data,
                           t->scale,
                           t->srows,
                           t->scols};
        if (t->kind < 0)
            continue;
        TU_OK(moe_layer_set_weight(b, (moe_weight_kind_t)t->kind, t->expert, &mt));
    }

    tu_fill_uniform(x, T * f->H, -1.0f, 1.0f, &seed);
    forward(a, x, T, f->H, ya);
    forward(b, x, T, f->H, yb);
    assert_int_equal(tu_count_nan(ya, T * f->H), 0);
    for (int64_t i = 0; i < T * f->H; i++)
        abs_sum += fabs(ya[i]);
    assert_true(abs_sum > 1e-3); /* the layer did something */
    assert_memory_equal(ya, yb, sizeof(float) * (size_t)(T * f->H));

    moe_layer_destroy(a);
    moe_layer_destroy(b);
    free(x);
    free(ya);
    free(yb);
}

static void check_fixture(fixture_t *f)
{
    check_fixture_as(f, MOE_DTYPE_INVALID);
}

static fixture_t *fx_new_grouped(moe_model_family_t fam, int E, int k, int H, int I, int S, int fp8,
                                 int shards, int layer, int n_group, int topk_group)
{
    fixture_t *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    f->n_group = n_group;
    f->topk_group = topk_group;
    f->fam = fam;
    f->E = E;
    f->k = k;
    f->H = H;
    f->I = I;
    f->S = S;
    f->fp8 = fp8;
    f->shards = shards;
    f->layer = layer;
    f->num_layers = 4;
    fx_build(f);
    return f;
}

static fixture_t *fx_new(moe_model_family_t fam, int E, int k, int H, int I, int S, int fp8,
                         int shards, int layer)
{
    return fx_new_grouped(fam, E, k, H, I, S, fp8, shards, layer, 0, 0);
}

static void fx_delete(fixture_t *f)
{
    fx_free(f);
    free(f);
}

/* ---- good checkpoints ----------------------------------------------------------------------- */

static void test_mixtral_single_file(void **state)
{
    fixture_t *f = fx_new(MOE_FAMILY_MIXTRAL, 8, 2, 64, 96, 0, 0, 1, 0);
    fx_write(f);
    check_fixture(f);
    fx_delete(f);
}

/* A layer with redundant slots and a placement set before the load reads each expert its slots
 * hold (once) and fills every replica: the output is the plain layer's, bit for bit. */
static void test_redundant_slots_load(void **state)
{
    fixture_t *f = fx_new(MOE_FAMILY_QWEN3_MOE, 8, 2, 64, 96, 0, 0, 2, 1);
    fx_write(f);
    g_redundant_per_rank = 2;
    check_fixture(f);
    g_redundant_per_rank = 0;
    fx_delete(f);
}

static void test_mixtral_sharded(void **state)
{
    fixture_t *f = fx_new(MOE_FAMILY_MIXTRAL, 4, 2, 32, 48, 0, 0, 3, 2);
    fx_write(f);
    check_fixture(f);
    fx_delete(f);
}

static void test_qwen2_moe_sharded_shared_gate(void **state)
{
    fixture_t *f = fx_new(MOE_FAMILY_QWEN2_MOE, 8, 4, 64, 32, 96, 0, 2, 1);
    fx_write(f);
    check_fixture(f);
    fx_delete(f);
}

static void test_qwen3_moe(void **state)
{
    fixture_t *f = fx_new(MOE_FAMILY_QWEN3_MOE, 16, 4, 64, 48, 0, 0, 1, 3);
    fx_write(f);
    check_fixture(f);
    fx_delete(f);
}

static void test_deepseek_v3_bf16(void **state)
{
    fixture_t *f = fx_new(MOE_FAMILY_DEEPSEEK_V3, 8, 2, 64, 32, 32, 0, 1, 1);
    fx_write(f);
    check_fixture(f);
    fx_delete(f);
}

/* FP8 e4m3 with 128x128 block scales; a hidden size that is not a multiple of 128 (partial
 * blocks); intermediate sizes that split into 128-aligned TP slices over 2 ranks. */
static void test_deepseek_v3_fp8_sharded(void **state)
{
    fixture_t *f = fx_new(MOE_FAMILY_DEEPSEEK_V3, 8, 2, 320, 256, 256, 1, 3, 2);
    fx_write(f);
    check_fixture(f);
    fx_delete(f);
}

/* FP8 e4m3 with one scale per matrix and static input scales (AutoFP8's format, as Mixtral and
 * Qwen FP8 checkpoints ship): sharded, under the world's TP. */
static void test_mixtral_fp8_per_tensor(void **state)
{
    fixture_t *f = fx_new(MOE_FAMILY_MIXTRAL, 8, 2, 128, 256, 0, 2, 2, 1);
    (void)state;
    fx_write(f);
    check_fixture(f);
    fx_delete(f);
}

/* Layer `f->layer` of f loaded with fp8_math `math`; y = forward of fixed tokens. */
static void load_forward(fixture_t *f, moe_fp8_math_t math, int64_t T, float *y)
{
    moe_checkpoint_t *ck = NULL;
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    moe_layer_t *l = NULL;
    uint64_t seed = 12345;
    float *x = malloc(sizeof(float) * (size_t)(T * f->H));

    assert_non_null(x);
    c.max_tokens_per_rank = T;
    c.tp_size = g_tp;
    TU_OK(moe_checkpoint_open(f->dir, &ck));
    TU_OK(moe_checkpoint_layer_config(ck, f->layer, &c));
    c.fp8_math = math;
    TU_OK(moe_layer_create(rt, &c, &l));
    TU_OK(moe_layer_load(l, ck, f->layer));
    TU_OK(moe_checkpoint_close(ck));
    tu_fill_uniform(x, T * f->H, -1.0f, 1.0f, &seed);
    forward(l, x, T, f->H, y);
    assert_int_equal(tu_count_nan(y, T * f->H), 0);
    moe_layer_destroy(l);
    free(x);
}

/* A per-tensor checkpoint's static input_scale reaches W8A8 layers: the output differs from the
 * same file without input_scale tensors (dynamic scales), while W8A16 ignores them. */
static void test_fp8_static_input_scale_w8a8(void **state)
{
    fixture_t *f = fx_new(MOE_FAMILY_MIXTRAL, 8, 2, 128, 256, 0, 2, 1, 1);
    const int64_t T = 16, n = T * 128;
    float *y = malloc(sizeof(float) * (size_t)(4 * n));
    int i, m = 0;
    (void)state;
    assert_non_null(y);
    fx_write(f);
    load_forward(f, MOE_FP8_MATH_W8A16, T, y);
    load_forward(f, MOE_FP8_MATH_W8A8, T, y + n);
    for (i = 0; i < f->n; i++) { /* the same checkpoint without its input_scale tensors */
        const size_t len = strlen(f->t[i].name);
        if (len >= 11 && !strcmp(f->t[i].name + len - 11, "input_scale"))
            free(f->t[i].data);
        else
            f->t[m++] = f->t[i];
    }
    assert_true(m < f->n);
    f->n = m;
    fx_write(f);
    load_forward(f, MOE_FP8_MATH_W8A16, T, y + 2 * n);
    load_forward(f, MOE_FP8_MATH_W8A8, T, y + 3 * n);
    fprintf(stderr,
            "static input_scale: W8A8 static vs dynamic %.4f, static vs W8A16 %.4f, "
            "dynamic vs W8A16 %.4f\n",
            tu_rel_err(y + n, y + 3 * n, n), tu_rel_err(y + n, y, n), tu_rel_err(y + 3 * n, y, n));
    assert_memory_equal(y, y + 2 * n, sizeof(float) * (size_t)n); /* W8A16: not used */
    assert_true(tu_rel_err(y + n, y + 3 * n, n) > 1e-3);          /* W8A8: used */
    assert_true(tu_rel_err(y + n, y, n) < 0.2);                   /* and still close */
    assert_true(tu_rel_err(y + 3 * n, y, n) < 0.06);
    free(y);
    fx_delete(f);
}

/* An FP8 checkpoint into a BF16 layer: the layer dequantises; under TP 2 the slices (96 of
 * 192) cut through scale blocks and the loader dequantises them itself. */
static void test_fp8_checkpoint_bf16_layer(void **state)
{
    fixture_t *f = fx_new(MOE_FAMILY_DEEPSEEK_V3, 8, 2, 320, 192, 192, 1, 2, 1);
    fx_write(f);
    check_fixture_as(f, MOE_DTYPE_BF16);
    fx_delete(f);
}

/* The malformed-checkpoint tests expect the same error on every rank, which needs one rank
 * (with several, a rank that does not own the broken expert loads fine). */
static int one_rank(void)
{
    if (g_world > 1)
        print_message("skipped: runs with one rank only\n");
    return g_world == 1;
}

/* Open by a .safetensors path; the public single-tensor helpers. */
static void test_public_tensor_files(void **state)
{
    char path[400];
    float v[6] = {1.5f, -2.0f, 3.25f, 0.0f, 1e-3f, -7.0f}, got[6];
    uint16_t bf[6], gotb[6];
    const char *names[2] = {"hidden_states", "w"};
    uint8_t q[4] = {0x38, 0x40, 0xb8, 0x00};
    float qs[1] = {0.5f};
    moe_tensor_t ts[2] = {{MOE_DTYPE_BF16, 3, 2, bf, NULL, 0, 0},
                          {MOE_DTYPE_FP8_E4M3, 2, 2, q, qs, 1, 1}};
    moe_dtype_t dt;
    int64_t r, c;
    moe_checkpoint_t *ck = NULL;
    moe_checkpoint_info_t info;
    moe_layer_config_t cfg = MOE_LAYER_CONFIG_INIT;

    moe_convert_from_f32(MOE_DTYPE_BF16, v, bf, 6);
    snprintf(path, sizeof(path), "%s/io.safetensors", g_root);
    TU_OK(moe_safetensors_write(path, 2, names, ts));
    TU_OK(moe_safetensors_tensor_info(path, "hidden_states", &dt, &r, &c));
    assert_int_equal(dt, MOE_DTYPE_BF16);
    assert_int_equal(r, 3);
    assert_int_equal(c, 2);
    TU_OK(moe_safetensors_read_rows(path, "hidden_states", 1, 3, MOE_DTYPE_F32, got));
    for (int i = 0; i < 4; i++)
        assert_true(got[i] == moe_bf16_to_f32(bf[2 + i]));
    TU_OK(moe_safetensors_read_rows(path, "hidden_states", 0, 3, MOE_DTYPE_BF16, gotb));
    assert_memory_equal(gotb, bf, sizeof(bf));
    TU_OK(moe_safetensors_tensor_info(path, "w_scale_inv", &dt, &r, &c));
    assert_int_equal(dt, MOE_DTYPE_F32);
    assert_int_equal(moe_safetensors_read_rows(path, "w", 0, 1, MOE_DTYPE_F32, got),
                     MOE_STATUS_FORMAT_ERROR);
    assert_int_equal(moe_safetensors_read_rows(path, "hidden_states", 2, 4, MOE_DTYPE_F32, got),
                     MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_safetensors_tensor_info(path, "nope", NULL, NULL, NULL),
                     MOE_STATUS_FORMAT_ERROR);
    assert_non_null(strstr(moe_last_error(), "no tensor \"nope\""));

    /* A lone file opens as a checkpoint; without config.json it has no layer config. */
    TU_OK(moe_checkpoint_open(path, &ck));
    TU_OK(moe_checkpoint_get_info(ck, &info));
    assert_int_equal(info.family, MOE_FAMILY_UNKNOWN);
    assert_int_equal(info.num_tensors, 3);
    assert_int_equal(moe_checkpoint_layer_config(ck, 0, &cfg), MOE_STATUS_FORMAT_ERROR);
    assert_non_null(strstr(moe_last_error(), "no config.json"));
    moe_checkpoint_close(ck);
    assert_int_equal(moe_checkpoint_close(NULL), MOE_STATUS_SUCCESS);
}

/* ---- bad checkpoints and configs -------------------------------------------------------- */

static char g_msg[1024];

/* moe_checkpoint_open + layer_config + layer_load on f; returns the first failing status and
 * keeps its message in g_msg (the clean-up calls clear moe_last_error). */
static moe_status_t try_load(fixture_t *f, int layer)
{
    moe_checkpoint_t *ck = NULL;
    moe_layer_config_t cfg = MOE_LAYER_CONFIG_INIT;
    moe_layer_t *l = NULL;
    moe_status_t st;

    cfg.max_tokens_per_rank = 8;
    st = moe_checkpoint_open(f->dir, &ck);
    if (st == MOE_STATUS_SUCCESS)
        st = moe_checkpoint_layer_config(ck, layer, &cfg);
    if (st == MOE_STATUS_SUCCESS) {
        TU_OK(moe_layer_create(rt, &cfg, &l));
        st = moe_layer_load(l, ck, layer);
    }
    snprintf(g_msg, sizeof(g_msg), "%s", moe_last_error());
    moe_layer_destroy(l);
    moe_checkpoint_close(ck);
    return st;
}

#define EXPECT_LOAD(f, layer, status, needle)                                                      \
    do {                                                                                           \
        moe_status_t st_ = try_load(f, layer);                                                     \
        if (st_ != (status) || !strstr(g_msg, needle))                                             \
            fail_msg("line %d: got %s \"%s\", expected %s with \"%s\"", __LINE__,                  \
                     moe_status_string(st_), g_msg, moe_status_string(status), needle);            \
    } while (0)

static fx_tensor_t *fx_find(fixture_t *f, const char *suffix)
{
    size_t n = strlen(suffix);
    for (int i = 0; i < f->n; i++) {
        size_t m = strlen(f->t[i].name);
        if (m >= n && !strcmp(f->t[i].name + m - n, suffix))
            return &f->t[i];
    }
    fail_msg("no tensor ending in %s", suffix);
    return NULL;
}

static void test_bad_tensors(void **state)
{
    fixture_t *f;
    fx_tensor_t *t;

    if (!one_rank())
        skip();

    /* missing expert tensor */
    f = fx_new(MOE_FAMILY_MIXTRAL, 4, 2, 32, 32, 0, 0, 1, 0);
    t = fx_find(f, "experts.3.w2.weight");
    snprintf(t->name, sizeof(t->name), "renamed.tensor");
    fx_write(f);
    EXPECT_LOAD(f, 0, MOE_STATUS_FORMAT_ERROR,
                "tensor \"model.layers.0.block_sparse_moe.experts.3.w2.weight\" not found");
    fx_delete(f);

    /* wrong shape: up_proj transposed */
    f = fx_new(MOE_FAMILY_QWEN3_MOE, 4, 2, 32, 48, 0, 0, 1, 1);
    t = fx_find(f, "experts.1.up_proj.weight");
    t->shape[0] = 32;
    t->shape[1] = 48;
    fx_write(f);
    EXPECT_LOAD(f, 1, MOE_STATUS_FORMAT_ERROR, "has shape [32, 48] but config.json gives [48, 32]");
    fx_delete(f);

    /* wrong dtype: the router as I16 (same bytes as BF16) */
    f = fx_new(MOE_FAMILY_QWEN3_MOE, 4, 2, 32, 48, 0, 0, 2, 1);
    fx_find(f, "mlp.gate.weight")->dtype = MOE_ST_I16;
    fx_write(f);
    EXPECT_LOAD(f, 1, MOE_STATUS_FORMAT_ERROR, "has dtype I16");
    fx_delete(f);

    /* fp8 weight whose scales are missing, then of the wrong shape */
    f = fx_new(MOE_FAMILY_DEEPSEEK_V3, 8, 2, 256, 128, 128, 1, 1, 1);
    snprintf(fx_find(f, "experts.2.down_proj.weight_scale_inv")->name, 200, "x_scale");
    fx_write(f);
    EXPECT_LOAD(f, 1, MOE_STATUS_FORMAT_ERROR, "experts.2.down_proj.weight_scale_inv\" not found");
    fx_delete(f);
    f = fx_new(MOE_FAMILY_DEEPSEEK_V3, 8, 2, 256, 128, 128, 1, 1, 1);
    t = fx_find(f, "experts.0.gate_proj.weight_scale_inv");
    t->shape[0] = 2;
    t->shape[1] = 1;
    fx_write(f);
    EXPECT_LOAD(f, 1, MOE_STATUS_FORMAT_ERROR, "scale tensor");
    fx_delete(f);

    /* a 3-D tensor where a matrix belongs */
    f = fx_new(MOE_FAMILY_MIXTRAL, 4, 2, 32, 32, 0, 0, 1, 0);
    t = fx_find(f, "block_sparse_moe.gate.weight");
    t->ndim = 3;
    t->shape[0] = 4;
    t->shape[1] = 32;
    fx_write(f); /* the writer keeps shape[2] = 0: an empty 3-D tensor */
    EXPECT_LOAD(f, 0, MOE_STATUS_FORMAT_ERROR, "has 3 dimensions");
    fx_delete(f);
}

static void test_bad_index(void **state)
{
    fixture_t *f;
    char path[400], cmd[900];

    if (!one_rank())
        skip();
    f = fx_new(MOE_FAMILY_MIXTRAL, 4, 2, 32, 32, 0, 0, 2, 0);

    fx_write(f);
    /* index names a shard file that lacks the tensor */
    snprintf(path, sizeof(path), "%s/model.safetensors.index.json", f->dir);
    snprintf(cmd, sizeof(cmd),
             "sed -i 's/\"model.layers.0.block_sparse_moe.gate.weight\": "
             "\"model-00001-of-00002/\"model.layers.0.block_sparse_moe.gate.weight\": "
             "\"model-00002-of-00002/' '%s'",
             path);
    assert_int_equal(system(cmd), 0);
    EXPECT_LOAD(f, 0, MOE_STATUS_FORMAT_ERROR, "which has no such tensor");
    /* path traversal in the index */
    write_text(f->dir, "model.safetensors.index.json",
               "{\"weight_map\": {\"a\": \"../../etc/passwd\"}}");
    EXPECT_LOAD(f, 0, MOE_STATUS_FORMAT_ERROR, "not a plain file name");
    /* index without weight_map; bad JSON; a shard that is missing */
    write_text(f->dir, "model.safetensors.index.json", "{\"metadata\": {}}");
    EXPECT_LOAD(f, 0, MOE_STATUS_FORMAT_ERROR, "no \"weight_map\" object");
    write_text(f->dir, "model.safetensors.index.json", "{\"weight_map\": {\"a\": \"b\",}}");
    EXPECT_LOAD(f, 0, MOE_STATUS_FORMAT_ERROR, "line 1 column");
    write_text(f->dir, "model.safetensors.index.json",
               "{\"weight_map\": {\"model.layers.0.block_sparse_moe.gate.weight\": "
               "\"gone.safetensors\"}}");
    EXPECT_LOAD(f, 0, MOE_STATUS_IO_ERROR, "cannot open");
    /* Without the index only model.safetensors is read (transformers' rule): shards or any
     * other *.safetensors beside it are not part of the model. */
    fx_delete(f);
    f = fx_new(MOE_FAMILY_MIXTRAL, 4, 2, 32, 32, 0, 0, 2, 0);
    fx_write(f);
    snprintf(cmd, sizeof(cmd), "cd '%s' && mv model.safetensors.index.json index.bak", f->dir);
    assert_int_equal(system(cmd), 0);
    EXPECT_LOAD(f, 0, MOE_STATUS_IO_ERROR, "no model.safetensors.index.json or model.safetensors");
    snprintf(cmd, sizeof(cmd), "cd '%s' && cp model-00001-of-00002.safetensors model.safetensors",
             f->dir);
    assert_int_equal(system(cmd), 0);
    EXPECT_LOAD(f, 0, MOE_STATUS_FORMAT_ERROR, "not found in the checkpoint");
    snprintf(cmd, sizeof(cmd),
             "cd '%s' && rm model.safetensors && mv index.bak model.safetensors.index.json",
             f->dir);
    assert_int_equal(system(cmd), 0);
    assert_int_equal(try_load(f, 0), MOE_STATUS_SUCCESS); /* the index again: fine */
    /* a truncated shard */
    snprintf(cmd, sizeof(cmd), "truncate -s 100 '%s/model-00002-of-00002.safetensors'", f->dir);
    assert_int_equal(system(cmd), 0);
    EXPECT_LOAD(f, 0, MOE_STATUS_FORMAT_ERROR, "model-00002-of-00002.safetensors");
    /* no safetensors at all */
    snprintf(cmd, sizeof(cmd), "rm -f '%s'/*.safetensors '%s'/*.index.json", f->dir, f->dir);
    assert_int_equal(system(cmd), 0);
    EXPECT_LOAD(f, 0, MOE_STATUS_IO_ERROR, "no model.safetensors.index.json");
    fx_delete(f);

    {
        moe_checkpoint_t *ck = (moe_checkpoint_t *)0x1;
        snprintf(path, sizeof(path), "%s/does-not-exist", g_root);
        assert_int_equal(moe_checkpoint_open(path, &ck), MOE_STATUS_IO_ERROR);
        assert_null(ck);
    }
}

/* config.json problems: each gives its status and names the key. */
static void test_bad_config(void **state)
{
    static const struct {
        const char *extra;
        int layer;
        moe_status_t status;
        const char *needle;
    } cases[] = {
        {"", 0, MOE_STATUS_INVALID_ARGUMENT, "is dense, not MoE (first_k_dense_replace = 1)"},
        {"", 4, MOE_STATUS_INVALID_ARGUMENT, "layer_index = 4: the checkpoint has layers 0..3"},
        {"", -1, MOE_STATUS_INVALID_ARGUMENT, "layer_index = -1"},
        {", \"moe_layer_freq\": 2", 3, MOE_STATUS_INVALID_ARGUMENT, "moe_layer_freq = 2"},
        {", \"hidden_act\": \"relu\"", 1, MOE_STATUS_NOT_SUPPORTED, "hidden_act \"relu\""},
        {", \"topk_method\": \"group_limited_greedy\"", 1, MOE_STATUS_NOT_SUPPORTED, "topk_method"},
        {", \"scoring_func\": 3", 1, MOE_STATUS_FORMAT_ERROR, "\"scoring_func\" is not a string"},
        {", \"routed_scaling_factor\": \"2.5\"", 1, MOE_STATUS_FORMAT_ERROR,
         "routed_scaling_factor"},
        {", \"n_group\": 3, \"topk_group\": 5", 1, MOE_STATUS_FORMAT_ERROR,
         "\"topk_group\" = 5 is outside [1, 3]"},
        {", \"quantization_config\": {\"quant_method\": \"gptq\"}", 1, MOE_STATUS_NOT_SUPPORTED,
         "quant_method \"gptq\""},
        {", \"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [64, 64]}",
         1, MOE_STATUS_NOT_SUPPORTED, "weight_block_size must be [128, 128]"},
        {", \"torch_dtype\": \"int8\", \"dtype\": \"int8\"", 1, MOE_STATUS_NOT_SUPPORTED,
         "dtype \"int8\""},
    };
    fixture_t *f;

    if (!one_rank())
        skip();
    f = fx_new(MOE_FAMILY_DEEPSEEK_V3, 8, 2, 64, 32, 32, 0, 1, 1);

    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        snprintf(f->extra_config, sizeof(f->extra_config), "%s", cases[i].extra);
        fx_write(f);
        EXPECT_LOAD(f, cases[i].layer, cases[i].status, cases[i].needle);
    }
    /* Broken JSON text, a missing key, a wrong type, an unknown family, a duplicate key. */
    write_text(f->dir, "config.json", "{\"model_type\": \"deepseek_v3\",\n \"hidden_size\" 64}");
    EXPECT_LOAD(f, 1, MOE_STATUS_FORMAT_ERROR, "config.json: line 2 column 16: expected ':'");
    write_text(f->dir, "config.json",
               "{\"model_type\": \"deepseek_v3\", \"num_hidden_layers\": 4, "
               "\"num_experts_per_tok\": 2, \"n_routed_experts\": 8, "
               "\"moe_intermediate_size\": 32}");
    EXPECT_LOAD(f, 1, MOE_STATUS_FORMAT_ERROR, "\"hidden_size\" is missing");
    write_text(f->dir, "config.json",
               "{\"model_type\": \"deepseek_v3\", \"num_hidden_layers\": 4, \"hidden_size\": "
               "\"64\"}");
    EXPECT_LOAD(f, 1, MOE_STATUS_FORMAT_ERROR, "\"hidden_size\" is not an integer");
    write_text(f->dir, "config.json",
               "{\"model_type\": \"deepseek_v3\", \"num_hidden_layers\": 4, \"hidden_size\": "
               "99999999999, \"first_k_dense_replace\": 0}");
    EXPECT_LOAD(f, 1, MOE_STATUS_FORMAT_ERROR, "\"hidden_size\" = 99999999999 is outside");
    write_text(f->dir, "config.json", "{\"model_type\": \"llama\", \"num_hidden_layers\": 4}");
    EXPECT_LOAD(f, 1, MOE_STATUS_NOT_SUPPORTED, "model_type \"llama\" is not supported");
    write_text(f->dir, "config.json", "{\"model_type\": \"mixtral\", \"model_type\": \"x\"}");
    EXPECT_LOAD(f, 1, MOE_STATUS_FORMAT_ERROR, "duplicate key \"model_type\"");
    write_text(f->dir, "config.json", "[1, 2]");
    EXPECT_LOAD(f, 1, MOE_STATUS_FORMAT_ERROR, "top level is a array");
    fx_delete(f);

    /* Qwen dense layers: mlp_only_layers and decoder_sparse_step name themselves. */
    f = fx_new(MOE_FAMILY_QWEN2_MOE, 4, 2, 32, 32, 32, 0, 1, 1);
    fx_write(f);
    EXPECT_LOAD(f, 0, MOE_STATUS_INVALID_ARGUMENT, "listed in mlp_only_layers");
    fx_delete(f);
    f = fx_new(MOE_FAMILY_QWEN3_MOE, 4, 2, 32, 32, 0, 0, 1, 1);
    fx_write(f);
    EXPECT_LOAD(f, 2, MOE_STATUS_INVALID_ARGUMENT, "decoder_sparse_step = 2");
    {
        moe_checkpoint_t *ck = NULL;
        int is_moe = -1;
        TU_OK(moe_checkpoint_open(f->dir, &ck));
        TU_OK(moe_checkpoint_layer_is_moe(ck, 2, &is_moe));
        assert_int_equal(is_moe, 0);
        TU_OK(moe_checkpoint_layer_is_moe(ck, 3, &is_moe));
        assert_int_equal(is_moe, 1);
        moe_checkpoint_close(ck);
    }
    fx_delete(f);
}

/* A layer made with other sizes than the checkpoint's is refused with the tensor's name. */
static void test_layer_mismatch(void **state)
{
    fixture_t *f;
    moe_checkpoint_t *ck = NULL;
    moe_layer_config_t cfg = MOE_LAYER_CONFIG_INIT;
    moe_layer_t *l = NULL;

    if (!one_rank())
        skip(); /* before any allocation: skip() leaves the test function */
    f = fx_new(MOE_FAMILY_MIXTRAL, 4, 2, 32, 32, 0, 0, 1, 0);
    fx_write(f);
    TU_OK(moe_checkpoint_open(f->dir, &ck));
    cfg.max_tokens_per_rank = 8;
    TU_OK(moe_checkpoint_layer_config(ck, 0, &cfg));
    cfg.num_experts = 8; /* more experts than the checkpoint has */
    TU_OK(moe_layer_create(rt, &cfg, &l));
    assert_int_equal(moe_layer_load(l, ck, 0), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "does not match layer 0"));
    moe_layer_destroy(l);
    cfg.num_experts = 4;
    cfg.hidden = 48;
    TU_OK(moe_layer_create(rt, &cfg, &l));
    assert_int_equal(moe_layer_load(l, ck, 0), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "ROUTER"));
    moe_layer_destroy(l);
    moe_checkpoint_close(ck);
    fx_delete(f);
}

static int setup(void **state)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(g_root, sizeof(g_root), "%s/moe_ckpt_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_root))
        return -1;
    rt = tu_runtime_cpu();
    if (rt) {
        moe_runtime_info_t ri;
        TU_OK(moe_runtime_get_info(rt, &ri));
        g_world = ri.world_size;
        g_tp = getenv("MOE_TEST_TP") ? atoi(getenv("MOE_TEST_TP")) : 0;
    }
    return rt ? 0 : -1;
}

static int teardown(void **state)
{
    char cmd[300];
    moe_runtime_destroy(rt);
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g_root); /* our own mkdtemp folder only */
    return system(cmd) == 0 ? 0 : -1;
}

/* Per-tensor FP8: a negative weight_scale, a NaN static input_scale, a scale with two values;
 * each named by its tensor. */
static void test_bad_per_tensor_scales(void **state)
{
    fixture_t *f;
    (void)state;
    if (!one_rank())
        return;
    f = fx_new(MOE_FAMILY_MIXTRAL, 8, 2, 128, 256, 0, 2, 1, 1);
    ((float *)fx_find(f, "experts.1.w2.weight_scale")->data)[0] = -0.25f;
    fx_write(f);
    EXPECT_LOAD(f, 1, MOE_STATUS_NUMERIC_ERROR, "experts.1.w2.weight_scale\": scale");
    fx_delete(f);
    f = fx_new(MOE_FAMILY_MIXTRAL, 8, 2, 128, 256, 0, 2, 1, 1);
    ((float *)fx_find(f, "experts.3.w1.input_scale")->data)[0] = NAN;
    fx_write(f);
    EXPECT_LOAD(f, 1, MOE_STATUS_NUMERIC_ERROR, "experts.3.w1.input_scale\": scale");
    fx_delete(f);
    f = fx_new(MOE_FAMILY_MIXTRAL, 8, 2, 128, 256, 0, 2, 1, 1);
    {
        fx_tensor_t *t = fx_find(f, "experts.0.w3.weight_scale");
        t->ndim = 1;
        t->shape[0] = 2; /* two values where one scale per matrix is expected */
        free(t->data);
        t->data = calloc(2, sizeof(float));
    }
    fx_write(f);
    EXPECT_LOAD(f, 1, MOE_STATUS_FORMAT_ERROR, "expected one F32 (one scale per matrix)");
    fx_delete(f);
}

/* FP8 scales that are finite and > 0 but absurd: 3e38 (times 448 it overflows f32: NaN outputs)
 * and 1e-45 (every weight it scales flushes to zero) are refused naming the tensor and the
 * value; a 1-D _scale_inv names the expected grid; config values are named as read. */
static void test_absurd_scales_and_config(void **state)
{
    static const struct {
        const char *tensor;
        float v;
        const char *needle;
    } per_tensor[] = {
        {"experts.1.w2.weight_scale", 3e38f,
         "experts.1.w2.weight_scale\": scale [0, 0] is 3e+38: "
         "times the e4m3 maximum 448 it overflows f32"},
        {"experts.2.w1.weight_scale", 1e-45f,
         "experts.2.w1.weight_scale\": scale [0, 0] is "
         "1.4013e-45: times the e4m3 maximum 448 it is below "
         "f32's smallest normal"},
        {"experts.3.w1.input_scale", 3e38f, "experts.3.w1.input_scale\": scale [0, 0] is 3e+38"},
    };
    fixture_t *f;
    fx_tensor_t *t;
    (void)state;
    if (!one_rank())
        return;
    for (size_t i = 0; i < sizeof(per_tensor) / sizeof(per_tensor[0]); i++) {
        f = fx_new(MOE_FAMILY_MIXTRAL, 8, 2, 128, 256, 0, 2, 1, 1);
        ((float *)fx_find(f, per_tensor[i].tensor)->data)[0] = per_tensor[i].v;
        fx_write(f);
        EXPECT_LOAD(f, 1, MOE_STATUS_NUMERIC_ERROR, per_tensor[i].needle);
        fx_delete(f);
    }
    /* a block scale of the DeepSeek-V3 format */
    f = fx_new(MOE_FAMILY_DEEPSEEK_V3, 8, 2, 256, 128, 128, 1, 1, 1);
    ((float *)fx_find(f, "experts.0.up_proj.weight_scale_inv")->data)[1] = 3e38f;
    fx_write(f);
    EXPECT_LOAD(f, 1, MOE_STATUS_NUMERIC_ERROR,
                "experts.0.up_proj.weight_scale_inv\": scale [0, 1] is 3e+38");
    fx_delete(f);
    /* a 1-D _scale_inv of the grid's count: gate_proj [128, 256] needs the grid [1, 2] */
    f = fx_new(MOE_FAMILY_DEEPSEEK_V3, 8, 2, 256, 128, 128, 1, 1, 1);
    t = fx_find(f, "experts.0.gate_proj.weight_scale_inv");
    t->ndim = 1;
    t->shape[0] = 2;
    fx_write(f);
    EXPECT_LOAD(f, 1, MOE_STATUS_FORMAT_ERROR,
                "is F32 [2] (1-D), expected the F32 grid [1, 2] (one scale per 128x128 block of "
                "the [128, 256] weight)");
    fx_delete(f);
    /* config values as read */
    f = fx_new(MOE_FAMILY_DEEPSEEK_V3, 8, 2, 64, 32, 32, 0, 1, 1);
    snprintf(f->extra_config, sizeof(f->extra_config), ", \"routed_scaling_factor\": 1e39");
    fx_write(f);
    EXPECT_LOAD(f, 1, MOE_STATUS_FORMAT_ERROR, "\"routed_scaling_factor\" is 1e+39");
    write_text(f->dir, "config.json", "{\"num_hidden_layers\": 4, \"hidden_size\": 64}");
    EXPECT_LOAD(f, 1, MOE_STATUS_FORMAT_ERROR, "config.json: no \"model_type\"");
    fx_delete(f);
}

/* test_checkpoint --write-fixtures DIR: writes one checkpoint per family into DIR/<name> for
 * the moe-run --model test under mpirun (tests/slurm/test_moe_run_model.sh); no MPI. */
static int write_fixtures(const char *dir)
{
    static const struct {
        const char *name;
        moe_model_family_t fam;
        int E, k, H, I, S, fp8, shards, layer, n_group, topk_group;
    } fx[] = {
        {"mixtral", MOE_FAMILY_MIXTRAL, 8, 2, 128, 256, 0, 0, 1, 1, 0, 0},
        {"qwen2_moe", MOE_FAMILY_QWEN2_MOE, 8, 4, 128, 128, 256, 0, 3, 1, 0, 0},
        {"qwen3_moe", MOE_FAMILY_QWEN3_MOE, 16, 4, 128, 128, 0, 0, 2, 1, 0, 0},
        {"deepseek_v3_fp8", MOE_FAMILY_DEEPSEEK_V3, 8, 2, 256, 256, 256, 1, 3, 1, 0, 0},
        /* DeepSeek-V3's routing and FP8 format (256 routed experts, 8 per token, 8 groups, 4
         * kept, one shared expert, 128x128 weight_scale_inv) at a small hidden size */
        {"deepseek_v3_fp8_e256", MOE_FAMILY_DEEPSEEK_V3, 256, 8, 256, 256, 256, 1, 4, 1, 8, 4},
    };
    char cmd[600];

    snprintf(g_root, sizeof(g_root), "%s", dir);
    for (size_t i = 0; i < sizeof(fx) / sizeof(fx[0]); i++) {
        fixture_t *f =
            fx_new_grouped(fx[i].fam, fx[i].E, fx[i].k, fx[i].H, fx[i].I, fx[i].S, fx[i].fp8,
                           fx[i].shards, fx[i].layer, fx[i].n_group, fx[i].topk_group);
        g_seq = (int)i;
        fx_write(f); /* DIR/ckpt<i> */
        snprintf(cmd, sizeof(cmd), "mv '%s' '%s/%s'", f->dir, dir, fx[i].name);
        fx_delete(f);
        if (system(cmd) != 0)
            return 1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mixtral_single_file),
        cmocka_unit_test(test_mixtral_sharded),
        cmocka_unit_test(test_redundant_slots_load),
        cmocka_unit_test(test_qwen2_moe_sharded_shared_gate),
        cmocka_unit_test(test_qwen3_moe),
        cmocka_unit_test(test_deepseek_v3_bf16),
        cmocka_unit_test(test_deepseek_v3_fp8_sharded),
        cmocka_unit_test(test_mixtral_fp8_per_tensor),
        cmocka_unit_test(test_bad_per_tensor_scales),
        cmocka_unit_test(test_absurd_scales_and_config),
        cmocka_unit_test(test_fp8_checkpoint_bf16_layer),
        cmocka_unit_test(test_fp8_static_input_scale_w8a8),
        cmocka_unit_test(test_public_tensor_files),
        cmocka_unit_test(test_bad_tensors),
        cmocka_unit_test(test_bad_index),
        cmocka_unit_test(test_bad_config),
        cmocka_unit_test(test_layer_mismatch),
    };
    if (argc == 3 && !strcmp(argv[1], "--write-fixtures"))
        return write_fixtures(argv[2]);
    return cmocka_run_group_tests(tests, setup, teardown);
}
