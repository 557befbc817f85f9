/* SPDX-License-Identifier: Apache-2.0 */
/* The whole CUDA layer (backend ops on one GPU) against the CPU reference route and a naive
 * expert MLP on sampled tokens, at the token counts and model shapes of issue 4. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include "gpu_test.h"

#include "kernels/cpu/moe_cpu.h"
#include "runtime/layer.h"

typedef struct layer_case {
    const char *name;
    int E, k, H, I, shared_I, shared_gate;
    moe_scoring_t scoring;
    int use_bias, n_group, topk_group, renorm;
    float scaling;
    moe_activation_t act;
    moe_dtype_t xt;
    int ref_mlps;        /* expert-MLP evaluations the reference may spend per token count */
    const char *variant; /* MOE_GEMM_VARIANT for this layer, or NULL (the oracle) */
} layer_case_t;

static const layer_case_t cases[] = {
    {"small softmax + gated shared", 16, 4, 256, 128, 256, 1, MOE_SCORING_SOFTMAX, 0, 0, 0, 0, 1.0f,
     MOE_ACTIVATION_SILU, MOE_DTYPE_F32, 4096, NULL},
    {"small gelu simt_ref", 16, 4, 256, 128, 0, 0, MOE_SCORING_SOFTMAX, 0, 0, 0, 1, 1.0f,
     MOE_ACTIVATION_GELU, MOE_DTYPE_BF16, 4096, "simt_ref"},
    {"small sigmoid grouped + shared", 32, 8, 512, 256, 256, 0, MOE_SCORING_SIGMOID, 1, 4, 2, 1,
     2.5f, MOE_ACTIVATION_SILU, MOE_DTYPE_BF16, 4096, NULL},
    {"Mixtral-8x7B E8 k2 H4096 I14336", 8, 2, 4096, 14336, 0, 0, MOE_SCORING_SOFTMAX, 0, 0, 0, 1,
     1.0f, MOE_ACTIVATION_SILU, MOE_DTYPE_BF16, 6, NULL},
    {"Qwen3-30B-A3B E128 k8 H2048 I768", 128, 8, 2048, 768, 0, 0, MOE_SCORING_SOFTMAX, 0, 0, 0, 1,
     1.0f, MOE_ACTIVATION_SILU, MOE_DTYPE_BF16, 160, NULL},
    {"DeepSeek-V3 EP8 shard E32 k8 H7168 I2048", 32, 8, 7168, 2048, 2048, 0, MOE_SCORING_SIGMOID, 1,
     4, 2, 1, 2.5f, MOE_ACTIVATION_SILU, MOE_DTYPE_BF16, 24, NULL},
};

#define MAX_TOKENS 8192

/* Host copy of the weights: f32 (bf16-exact values) for the reference, bf16 for the device. */
typedef struct host_weights {
    float *w13, *w2, *router, *bias, *s13, *s2, *sgate; /* w13: [E][2I][H], w2: [E][H][I] */
} host_weights_t;

typedef struct fixture {
    moe_runtime_t rt;
    moe_layer_t layer;
    host_weights_t w;
} fixture_t;

static void store(moe_layer_t *l, moe_weight_kind_t kind, int local, const float *f, int64_t rows,
                  int64_t cols)
{
    moe_matrix_t m;
    const size_t n = (size_t)(rows * cols);
    const int f32 = kind == MOE_WEIGHT_ROUTER || kind == MOE_WEIGHT_ROUTER_BIAS ||
                    kind == MOE_WEIGHT_SHARED_EXPERT_GATE;
    void *data = malloc(f32 ? 4 * n : 2 * n);
    memset(&m, 0, sizeof(m));
    m.dtype = f32 ? MOE_DTYPE_F32 : MOE_DTYPE_BF16;
    m.rows = rows;
    m.cols = cols;
    m.data = data;
    if (f32)
        memcpy(data, f, 4 * n);
    else
        moe_convert_from_f32(MOE_DTYPE_BF16, f, data, n);
    gt_ok(moe_backend_cuda.store_weight(l, kind, local, &m), "store_weight");
    free(data);
}

static void make_layer(fixture_t *fx, const layer_case_t *c, int world, moe_dtype_t wdt)
{
    moe_layer_t *l = &fx->layer;
    moe_layer_config_t cfg = MOE_LAYER_CONFIG_INIT;
    memset(fx, 0, sizeof(*fx));
    fx->rt.info.world_size = world;
    fx->rt.info.device = 0;
    fx->rt.info.backend = MOE_BACKEND_CUDA;
    cfg.num_experts = c->E;
    cfg.top_k = c->k;
    cfg.hidden = c->H;
    cfg.intermediate = c->I;
    cfg.num_shared_experts = c->shared_I > 0;
    cfg.shared_intermediate = c->shared_I;
    cfg.shared_expert_gate = c->shared_gate;
    cfg.activation = c->act;
    cfg.scoring = c->scoring;
    cfg.use_score_bias = c->use_bias;
    cfg.n_group = c->n_group;
    cfg.topk_group = c->topk_group;
    cfg.renormalize = c->renorm;
    cfg.routed_scaling_factor = c->scaling;
    cfg.weight_dtype = wdt;
    cfg.max_tokens_per_rank = MAX_TOKENS;
    cfg.ep_size = world;
    cfg.tp_size = 1;
    l->rt = &fx->rt;
    l->cfg = cfg;
    l->plan.world = world;
    l->plan.ep_size = world;
    l->plan.tp_size = 1;
    l->plan.num_local_experts = c->E / world;
    l->plan.i_end = c->I;
    l->plan.shared_intermediate = c->shared_I;
    l->plan.s_end = c->shared_I;
    /* the placement tables the backend routes by (slot e holds expert e) */
    gt_ok(moe_plan_init_placement(&l->plan, c->E, 0), "placement");
    l->expert_load = calloc((size_t)c->E, sizeof(int64_t));
    l->ops = &moe_backend_cuda;
}

/* The power of two nearest to x (scaling bf16 values by it stays exact). */
static float pow2_scale(float x)
{
    return exp2f(roundf(log2f(x)));
}

static void gen_weights(fixture_t *fx, const layer_case_t *c)
{
    host_weights_t *w = &fx->w;
    const size_t E = (size_t)c->E, H = (size_t)c->H, I = (size_t)c->I, S = (size_t)c->shared_I;
    size_t e;
    w->w13 = malloc(4 * E * 2 * I * H);
    w->w2 = malloc(4 * E * H * I);
    w->router = malloc(4 * E * H);
    w->bias = malloc(4 * E);
    gt_fill_pool(w->w13, E * 2 * I * H, pow2_scale(2.0f / sqrtf((float)H)));
    gt_fill_pool(w->w2, E * H * I, pow2_scale(2.0f / sqrtf((float)I)));
    gt_fill_bf16(w->router, NULL, E * H, 1.0f / sqrtf((float)H));
    for (e = 0; e < E; e++)
        w->bias[e] = 0.5f * (float)gt_below(2);
    if (S > 0) {
        w->s13 = malloc(4 * 2 * S * H);
        w->s2 = malloc(4 * H * S);
        w->sgate = malloc(4 * H);
        gt_fill_pool(w->s13, 2 * S * H, pow2_scale(2.0f / sqrtf((float)H)));
        gt_fill_pool(w->s2, H * S, pow2_scale(2.0f / sqrtf((float)S)));
        gt_fill_bf16(w->sgate, NULL, H, 2.0f / sqrtf((float)H));
    }
}

static void upload_weights(fixture_t *fx, const layer_case_t *c)
{
    host_weights_t *w = &fx->w;
    moe_layer_t *l = &fx->layer;
    const size_t E = (size_t)c->E, H = (size_t)c->H, I = (size_t)c->I, S = (size_t)c->shared_I;
    size_t e;
    for (e = 0; e < E; e++) {
        store(l, MOE_WEIGHT_GATE_PROJ, (int)e, w->w13 + e * 2 * I * H, (int64_t)I, (int64_t)H);
        store(l, MOE_WEIGHT_UP_PROJ, (int)e, w->w13 + e * 2 * I * H + I * H, (int64_t)I,
              (int64_t)H);
        store(l, MOE_WEIGHT_DOWN_PROJ, (int)e, w->w2 + e * H * I, (int64_t)H, (int64_t)I);
    }
    store(l, MOE_WEIGHT_ROUTER, -1, w->router, (int64_t)E, (int64_t)H);
    store(l, MOE_WEIGHT_ROUTER_BIAS, -1, w->bias, 1, (int64_t)E);
    if (S > 0) {
        store(l, MOE_WEIGHT_SHARED_GATE_PROJ, -1, w->s13, (int64_t)S, (int64_t)H);
        store(l, MOE_WEIGHT_SHARED_UP_PROJ, -1, w->s13 + S * H, (int64_t)S, (int64_t)H);
        store(l, MOE_WEIGHT_SHARED_DOWN_PROJ, -1, w->s2, (int64_t)H, (int64_t)S);
        if (c->shared_gate)
            store(l, MOE_WEIGHT_SHARED_EXPERT_GATE, -1, w->sgate, 1, (int64_t)H);
    }
}

static void free_fixture(fixture_t *fx)
{
    if (fx->layer.state)
        moe_backend_cuda.fini(&fx->layer);
    moe_gpu_free(fx->rt.gpu_ws); /* the runtime's shared workspace (this fixture's runtime) */
    fx->rt.gpu_ws = NULL;
    free(fx->layer.expert_load);
    moe_plan_free_placement(&fx->layer.plan);
    free(fx->w.w13), free(fx->w.w2), free(fx->w.router), free(fx->w.bias);
    free(fx->w.s13), free(fx->w.s2), free(fx->w.sgate);
}

/* Dot in double with four accumulators (the reference's own rounding is negligible). */
static double dot(const float *a, const float *b, size_t n)
{
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        s0 += (double)a[i] * b[i];
        s1 += (double)a[i + 1] * b[i + 1];
        s2 += (double)a[i + 2] * b[i + 2];
        s3 += (double)a[i + 3] * b[i + 3];
    }
    for (; i < n; i++)
        s0 += (double)a[i] * b[i];
    return (s0 + s1) + (s2 + s3);
}

/* out += scale * W2 (act(W1 x) * (W3 x)) for one token. */
static void ref_mlp(const float *w13, const float *w2, size_t H, size_t I, moe_activation_t act,
                    const float *x, float scale, double *out, float *h)
{
    size_t i, r;
    for (i = 0; i < I; i++) {
        const float g = (float)dot(w13 + i * H, x, H), u = (float)dot(w13 + (I + i) * H, x, H);
        moe_cpu_act_mul(act, &g, &u, &h[i], 1);
    }
    for (r = 0; r < H; r++)
        out[r] += scale * dot(w2 + r * I, h, I);
}

/* Runs one forward at T tokens and checks ids, weights, finiteness and sampled tokens. */
static void run_tokens(fixture_t *fx, const layer_case_t *c, int64_t T, int with_logits,
                       void *stream)
{
    moe_layer_t *l = &fx->layer;
    const size_t H = (size_t)c->H, E = (size_t)c->E, K = (size_t)c->k;
    const size_t xs = c->xt == MOE_DTYPE_F32 ? 4 : 2;
    float *x = malloc(4 * (T * H + 1)), *logits = malloc(4 * (T * E + 1));
    uint16_t *xb = malloc(2 * (T * H + 1));
    float *y = malloc(4 * (T * H + 1)), *w = malloc(4 * (T * K + 1)),
          *ref_w = malloc(4 * (T * K + 1));
    int32_t *ids = malloc(4 * (T * K + 1)), *ref_ids = malloc(4 * (T * K + 1));
    void *d_x, *d_y;
    float *d_logits, *d_w;
    int32_t *d_ids;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    moe_route_params_t rp = {
        c->E,          c->k,      c->scoring, c->use_bias, c->n_group > 1 ? c->n_group : 0,
        c->topk_group, c->renorm, c->scaling};
    int64_t t, samples, s;
    double num = 0, den = 0;
    size_t i;

    gt_fill_bf16(x, xb, T * H, 1.0f);
    for (i = 0; i < T * E; i++)
        logits[i] = (float)gt_below(257) / 32.0f - 4.0f;
    d_x = c->xt == MOE_DTYPE_F32 ? gt_dup(x, 4 * (T * H + 1)) : gt_dup(xb, 2 * (T * H + 1));
    d_logits = gt_dup(logits, 4 * (T * E + 1));
    d_y = gt_dalloc(xs * (T * H + 1));
    d_ids = gt_dalloc(4 * (T * K + 1));
    d_w = gt_dalloc(4 * (T * K + 1));
    gt_poison(d_y, GT_POISON_FLOAT, xs * (T * H + 1));
    gt_poison(d_ids, GT_POISON_INT, 4 * (T * K + 1));
    gt_poison(d_w, GT_POISON_FLOAT, 4 * (T * K + 1));
    a.num_tokens = T;
    a.dtype = c->xt;
    a.x = d_x;
    a.y = d_y;
    a.router_logits = with_logits ? d_logits : NULL;
    a.topk_ids = d_ids;
    a.topk_weights = d_w;
    a.stream = stream;
    gt_ok(moe_backend_cuda.forward(l, &a), c->name);
    gt_ok(moe_gpu_stream_synchronize(stream), "sync");
    if (c->xt == MOE_DTYPE_F32) {
        gt_get(y, d_y, 4 * T * H);
    } else {
        gt_get(xb, d_y, 2 * T * H); /* xb is free now: x keeps the f32 values */
        moe_convert_to_f32(MOE_DTYPE_BF16, xb, y, T * H);
    }
    gt_get(ids, d_ids, 4 * T * K);
    gt_get(w, d_w, 4 * T * K);
    if (!gt_all_finite(y, T * H)) {
        int64_t bad = 0, first = -1, last = -1, bad_tokens = 0;
        for (t = 0; t < T; t++) {
            int64_t tb = 0;
            for (i = 0; i < H; i++)
                tb += !isfinite(y[t * H + i]);
            if (tb) {
                bad_tokens++;
                last = t;
                if (first < 0)
                    first = t;
                if (bad_tokens <= 4)
                    fprintf(stderr, "  token %lld: %lld bad of %zu, ids %d %d ...\n", (long long)t,
                            (long long)tb, H, ids[t * K], ids[t * K + 1]);
            }
            bad += tb;
        }
        fprintf(stderr,
                "%s T=%lld: y has %lld unwritten or non-finite elements in %lld tokens "
                "(first %lld, last %lld)\n",
                c->name, (long long)T, (long long)bad, (long long)bad_tokens, (long long)first,
                (long long)last);
        fail();
    }
    if (with_logits) {
        gt_ok(moe_cpu_route(&rp, logits, fx->w.bias, T, ref_ids, ref_w), "cpu route");
        for (i = 0; i < T * K; i++)
            if (ids[i] != ref_ids[i] ||
                !(fabsf(w[i] - ref_w[i]) <= 1e-5f * fmaxf(1.0f, fabsf(ref_w[i])))) {
                fprintf(stderr, "%s T=%lld: slot %zu: gpu (%d, %g) cpu (%d, %g)\n", c->name,
                        (long long)T, i, ids[i], (double)w[i], ref_ids[i], (double)ref_w[i]);
                fail();
            }
    } else {
        /* The router logits came from the device: check them loosely through the ids (every
         * chosen id valid and distinct) and use the device's choice for the reference. */
        for (t = 0; t < T; t++)
            for (i = 0; i < K; i++) {
                size_t j;
                assert_true(ids[t * K + i] >= 0 && ids[t * K + i] < c->E);
                for (j = 0; j < i; j++)
                    assert_true(ids[t * K + j] != ids[t * K + i]);
            }
    }
    /* Reference on sampled tokens: first, last and random ones. */
    samples = c->ref_mlps / c->k;
    if (samples < 2)
        samples = 2;
    if (samples > T)
        samples = T;
    {
        double *acc = malloc(sizeof(double) * H);
        float *hbuf = malloc(4 * (size_t)(c->I > c->shared_I ? c->I : c->shared_I));
        for (s = 0; s < samples; s++) {
            const int64_t tok =
                samples == T ? s : (s == 0 ? 0 : (s == 1 ? T - 1 : gt_below((int)T)));
            const float *xt = x + tok * H;
            size_t j;
            memset(acc, 0, sizeof(double) * H);
            for (j = 0; j < K; j++) {
                const size_t e = (size_t)ids[tok * K + j];
                ref_mlp(fx->w.w13 + e * 2 * c->I * H, fx->w.w2 + e * H * c->I, H, (size_t)c->I,
                        c->act, xt, w[tok * K + j], acc, hbuf);
            }
            if (c->shared_I > 0) {
                float g = 1.0f;
                if (c->shared_gate)
                    g = 1.0f / (1.0f + expf(-(float)dot(fx->w.sgate, xt, H)));
                ref_mlp(fx->w.s13, fx->w.s2, H, (size_t)c->shared_I, c->act, xt, g, acc, hbuf);
            }
            for (j = 0; j < H; j++) {
                const double d = y[tok * H + j] - acc[j];
                num += d * d;
                den += acc[j] * acc[j];
            }
        }
        free(acc);
        free(hbuf);
    }
    if (T > 0) {
        const double rel = sqrt(num / (den > 0 ? den : 1));
        fprintf(stderr, "  %-44s T=%5lld %s: rel error %.2e over %lld tokens\n", c->name,
                (long long)T, with_logits ? "logits" : "router", rel, (long long)samples);
        if (!(rel <= 1e-2))
            fail();
    }
    free(x), free(logits), free(xb), free(y), free(w), free(ref_w), free(ids), free(ref_ids);
    moe_gpu_free(d_x), moe_gpu_free(d_logits), moe_gpu_free(d_y), moe_gpu_free(d_ids),
        moe_gpu_free(d_w);
}

/* Debugging knobs: MOE_TEST_ONLY=<part of a case name>, MOE_TEST_TOKENS=<one token count>,
 * MOE_TEST_NO_SHARED=1 (drop the shared expert). */
static void run_case(const layer_case_t *c0)
{
    fixture_t *fx = calloc(1, sizeof(*fx));
    void *stream = NULL;
    const char *only = getenv("MOE_TEST_ONLY"), *tokens = getenv("MOE_TEST_TOKENS");
    layer_case_t cc = *c0;
    const layer_case_t *c = &cc;
    int t;
    if (only && !strstr(c0->name, only)) {
        free(fx);
        return;
    }
    if (getenv("MOE_TEST_NO_SHARED"))
        cc.shared_I = 0, cc.shared_gate = 0;
    make_layer(fx, c, 1, MOE_DTYPE_BF16);
    if (c->variant)
        setenv("MOE_GEMM_VARIANT", c->variant, 1);
    gt_ok(moe_backend_cuda.init(&fx->layer), c->name);
    if (c->variant)
        unsetenv("MOE_GEMM_VARIANT");
    assert_true(fx->layer.weight_bytes > 0 && fx->layer.workspace_bytes > 0);
    gen_weights(fx, c);
    upload_weights(fx, c);
    gt_ok(moe_gpu_stream_create(&stream), "stream");
    for (t = 0; t < GT_NUM_TOKEN_COUNTS; t++)
        if (!tokens || atoll(tokens) == gt_token_counts[t])
            run_tokens(fx, c, gt_token_counts[t], 1, stream);
    if (!tokens) {
        /* 600 and 900 tokens: 150 and 225 rows per expert at E / k = 4 (the small cases,
         * Mixtral, the DeepSeek-V3 shard), where the table picks m192n128 and m256n128 */
        run_tokens(fx, c, 600, 1, stream);
        run_tokens(fx, c, 900, 1, stream);
        run_tokens(fx, c, 64, 0, stream);
        run_tokens(fx, c, 1, 0, NULL); /* the legacy default stream */
    }
    moe_gpu_stream_destroy(stream);
    free_fixture(fx);
    free(fx);
}

static void test_layer_small(void **state)
{
    (void)state;
    run_case(&cases[0]);
    run_case(&cases[1]);
    run_case(&cases[2]);
}

static void test_layer_mixtral(void **state)
{
    (void)state;
    run_case(&cases[3]);
}

static void test_layer_qwen3(void **state)
{
    (void)state;
    run_case(&cases[4]);
}

static void test_layer_deepseek(void **state)
{
    (void)state;
    run_case(&cases[5]);
}

/* A forward captured in a CUDA graph gives bitwise the output of a direct forward; profiling
 * fills the stats and the expert load. */
static void test_layer_graph_and_profile(void **state)
{
    const layer_case_t *c = &cases[0];
    const int64_t T = 17;
    const size_t n = (size_t)T * c->H;
    fixture_t *fx = calloc(1, sizeof(*fx));
    float *x = malloc(4 * n), *y1 = malloc(4 * n), *y2 = malloc(4 * n);
    void *stream = NULL, *graph = NULL, *exec = NULL, *d_x, *d_y;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    int64_t total = 0;
    int e;
    (void)state;

    make_layer(fx, c, 1, MOE_DTYPE_BF16);
    gt_ok(moe_backend_cuda.init(&fx->layer), "init");
    gen_weights(fx, c);
    upload_weights(fx, c);
    gt_ok(moe_gpu_stream_create(&stream), "stream");
    gt_fill_bf16(x, NULL, n, 1.0f);
    d_x = gt_dup(x, 4 * n);
    d_y = gt_dalloc(4 * n);
    a.num_tokens = T;
    a.dtype = MOE_DTYPE_F32;
    a.x = d_x;
    a.y = d_y;
    a.stream = stream;
    gt_poison(d_y, GT_POISON_FLOAT, 4 * n);
    gt_ok(moe_backend_cuda.forward(&fx->layer, &a), "forward");
    gt_ok(moe_gpu_stream_synchronize(stream), "sync");
    gt_get(y1, d_y, 4 * n);
    gt_poison(d_y, GT_POISON_FLOAT, 4 * n);
    gt_ok(moe_gpu_graph_capture_begin(stream), "capture begin");
    gt_ok(moe_backend_cuda.forward(&fx->layer, &a), "forward in capture");
    gt_ok(moe_gpu_graph_capture_end(stream, &graph), "capture end");
    gt_ok(moe_gpu_graph_instantiate(graph, &exec), "instantiate");
    gt_ok(moe_gpu_graph_launch(exec, stream), "graph launch");
    gt_ok(moe_gpu_graph_launch(exec, stream), "graph launch");
    gt_ok(moe_gpu_stream_synchronize(stream), "sync");
    gt_get(y2, d_y, 4 * n);
    assert_true(gt_all_finite(y1, n));
    assert_memory_equal(y1, y2, 4 * n);
    moe_gpu_graph_exec_destroy(exec);
    moe_gpu_graph_destroy(graph);

    setenv("MOE_PROFILE", "1", 1);
    gt_ok(moe_backend_cuda.forward(&fx->layer, &a), "profiled forward");
    unsetenv("MOE_PROFILE");
    assert_int_equal(fx->layer.stats.rows_received, T * c->k);
    for (e = 0; e < c->E; e++)
        total += fx->layer.expert_load[e];
    assert_int_equal(total, T * c->k);
    assert_true(fx->layer.stats.total_us > 0.0);
    gt_get(y2, d_y, 4 * n);
    assert_memory_equal(y1, y2, 4 * n);

    moe_gpu_free(d_x), moe_gpu_free(d_y);
    moe_gpu_stream_destroy(stream);
    free(x), free(y1), free(y2);
    free_fixture(fx);
    free(fx);
}

/* A shape outside the GEMM table's coverage (rows that are not whole 16-byte units: an F32
 * layer's hidden 60, which create accepts for the CPU) is refused at init, naming the
 * dimension, never at forward (multi-GPU layouts: tests/mpi/test_gpu_*.c). */
static void test_layer_not_supported(void **state)
{
    fixture_t *fx = calloc(1, sizeof(*fx));
    (void)state;
    make_layer(fx, &cases[0], 1, MOE_DTYPE_F32);
    fx->layer.cfg.hidden = 60;
    assert_int_equal(moe_backend_cuda.init(&fx->layer), MOE_STATUS_NOT_SUPPORTED);
    assert_non_null(strstr(moe_last_error(), "hidden = 60"));
    assert_null(fx->layer.state);
    free_fixture(fx);
    free(fx);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_layer_not_supported), cmocka_unit_test(test_layer_graph_and_profile),
    cmocka_unit_test(test_layer_small),         cmocka_unit_test(test_layer_qwen3),
    cmocka_unit_test(test_layer_deepseek),      cmocka_unit_test(test_layer_mixtral),
};

GT_MAIN(tests)
