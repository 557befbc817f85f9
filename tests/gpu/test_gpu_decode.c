/* SPDX-License-Identifier: Apache-2.0 */
/* The fused decode kernel (kernels/decode.h) in whole layers on one GPU: against the CPU
 * reference (bf16, and W8A8 against the CPU's W8A8) for softmax and sigmoid grouped routing with
 * bias, silu and gelu, a gated and an ungated shared expert, f32 and bf16 tokens, odd shapes
 * (tails along k and n), 1 .. 64 tokens, outputs poisoned first; against the grouped path on the
 * same weights; a token's output bitwise the same in every batch; graph replays; the explain
 * text and the forced variant's refusals; a stalled launch ends, bounded, and says so. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include "gpu_test.h"

#include "kernels/decode.h"
#include "runtime/oracle.h"
#include "launch/layer_gen.h"
#include "moe/moe.h"
#include "testutil.h"

typedef struct dec_case {
    const char *name;
    int E, k, H, I, shared_I, shared_gate;
    moe_scoring_t scoring;
    int use_bias, n_group, topk_group;
    float scaling;
    moe_activation_t act;
    moe_dtype_t xt;         /* tokens and output */
    moe_dtype_t wt;         /* BF16, or FP8_E4M3 (W8A8) */
    moe_scale_kind_t scale; /* fp8: PER_TENSOR, PER_CHANNEL (cases), BLOCK_128 (block_cases) */
    int static_scales;      /* fp8 per-tensor: a checkpoint's input_scale per matrix (some 0) */
} dec_case_t;

static const dec_case_t cases[] = {
    {"qwen3-like bf16", 32, 8, 1024, 256, 0, 0, MOE_SCORING_SOFTMAX, 0, 0, 0, 1.0f,
     MOE_ACTIVATION_SILU, MOE_DTYPE_F32, MOE_DTYPE_BF16, MOE_SCALE_NONE},
    {"odd H520 I136 sigmoid grouped + gated shared, bf16 x", 16, 4, 520, 136, 200, 1,
     MOE_SCORING_SIGMOID, 1, 4, 2, 2.5f, MOE_ACTIVATION_SILU, MOE_DTYPE_BF16, MOE_DTYPE_BF16,
     MOE_SCALE_NONE},
    {"mixtral-like gelu bf16", 8, 2, 2048, 1792, 0, 0, MOE_SCORING_SOFTMAX, 0, 0, 0, 1.0f,
     MOE_ACTIVATION_GELU, MOE_DTYPE_F32, MOE_DTYPE_BF16, MOE_SCALE_NONE},
    {"qwen3-like fp8 per-tensor", 32, 8, 1024, 384, 0, 0, MOE_SCORING_SOFTMAX, 0, 0, 0, 1.0f,
     MOE_ACTIVATION_SILU, MOE_DTYPE_F32, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_TENSOR},
    {"mixtral-like fp8 per-channel", 8, 2, 1024, 1792, 0, 0, MOE_SCORING_SOFTMAX, 0, 0, 0, 1.0f,
     MOE_ACTIVATION_SILU, MOE_DTYPE_F32, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL},
    {"odd H1040 I272 sigmoid + shared fp8 per-tensor, bf16 x", 16, 4, 1040, 272, 512, 0,
     MOE_SCORING_SIGMOID, 1, 4, 2, 2.5f, MOE_ACTIVATION_SILU, MOE_DTYPE_BF16, MOE_DTYPE_FP8_E4M3,
     MOE_SCALE_PER_TENSOR},
    /* the shared MLP a multiple of the experts' width: inside the kernel with MOE_DECODE_SHARED=1
     * (as 4, 1 and 2 more experts), on the grouped path before it without */
    {"qwen2-like gated shared 4x, bf16", 16, 4, 512, 128, 512, 1, MOE_SCORING_SOFTMAX, 0, 0, 0,
     1.0f, MOE_ACTIVATION_SILU, MOE_DTYPE_F32, MOE_DTYPE_BF16, MOE_SCALE_NONE},
    {"dsv3-like sigmoid grouped + shared 1x fp8 per-channel, bf16 x", 16, 4, 1024, 256, 256, 0,
     MOE_SCORING_SIGMOID, 1, 4, 2, 2.5f, MOE_ACTIVATION_SILU, MOE_DTYPE_BF16, MOE_DTYPE_FP8_E4M3,
     MOE_SCALE_PER_CHANNEL},
    {"gelu gated shared 2x fp8 per-tensor", 8, 2, 768, 192, 384, 1, MOE_SCORING_SOFTMAX, 0, 0, 0,
     1.0f, MOE_ACTIVATION_GELU, MOE_DTYPE_F32, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_TENSOR},
    /* static activation scales (moe_gen_set_weights_static: some experts' GEMM 1 or GEMM 2
     * dynamic), quantised by the kernel as it loads x and h */
    {"mixtral-like fp8 per-tensor, static scales", 8, 2, 1024, 512, 0, 0, MOE_SCORING_SOFTMAX, 0, 0,
     0, 1.0f, MOE_ACTIVATION_SILU, MOE_DTYPE_F32, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_TENSOR, 1},
    /* a wide hidden size: one token's fp8 x (12800 codes, 25600 bytes as f16) in each CTA's shared
     * memory, more tokens' in global memory (kernels/cuda/decode_sm90.cu, XS_TOKENS) */
    {"wide H12800 fp8 per-tensor", 8, 2, 12800, 128, 0, 0, MOE_SCORING_SOFTMAX, 0, 0, 0, 1.0f,
     MOE_ACTIVATION_SILU, MOE_DTYPE_F32, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_TENSOR},
};
#define NUM_CASES ((int)(sizeof(cases) / sizeof(cases[0])))

/* 128 x 128 weight blocks: the kernel forced runs them one token a step (kernels/decode.h), so
 * these are checked at one token only (test_decode_block_scales); I and H past a multiple of 128
 * in the second (a last group of 16) */
static const dec_case_t block_cases[] = {
    {"qwen3-like fp8 block", 32, 8, 1024, 384, 0, 0, MOE_SCORING_SOFTMAX, 0, 0, 0, 1.0f,
     MOE_ACTIVATION_SILU, MOE_DTYPE_F32, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128},
    {"odd H1040 I272 sigmoid grouped gelu fp8 block, bf16 x", 16, 4, 1040, 272, 0, 0,
     MOE_SCORING_SIGMOID, 1, 4, 2, 2.5f, MOE_ACTIVATION_GELU, MOE_DTYPE_BF16, MOE_DTYPE_FP8_E4M3,
     MOE_SCALE_BLOCK_128},
};

static moe_runtime_t *rt_gpu, *rt_cpu;
static int arch; /* the kernel is built for sm_90a: the tests skip elsewhere */

#define REQUIRE_SM90()                                                                             \
    do {                                                                                           \
        if (arch != 90) {                                                                          \
            fprintf(stderr, "  sm_%d: the fused decode kernel runs on sm_90 only\n", arch);        \
            skip();                                                                                \
        }                                                                                          \
    } while (0)

static moe_layer_config_t config_of(const dec_case_t *c, int64_t cap)
{
    moe_layer_config_t l = MOE_LAYER_CONFIG_INIT;
    l.num_experts = c->E;
    l.top_k = c->k;
    l.hidden = c->H;
    l.intermediate = c->I;
    l.num_shared_experts = c->shared_I > 0;
    l.shared_intermediate = c->shared_I;
    l.shared_expert_gate = c->shared_gate;
    l.scoring = c->scoring;
    l.use_score_bias = c->use_bias;
    l.n_group = c->n_group;
    l.topk_group = c->topk_group;
    l.routed_scaling_factor = c->scaling;
    l.activation = c->act;
    l.weight_dtype = c->wt;
    l.max_tokens_per_rank = cap;
    if (c->wt == MOE_DTYPE_FP8_E4M3) {
        l.scale_kind = c->scale;
        l.fp8_math = MOE_FP8_MATH_W8A8;
    }
    return l;
}

/* f32 values rounded to bf16 in place (the tokens a bf16 caller holds) */
static void round_bf16(float *x, size_t n)
{
    uint16_t b;
    for (size_t i = 0; i < n; i++) {
        moe_convert_from_f32(MOE_DTYPE_BF16, x + i, &b, 1);
        moe_convert_to_f32(MOE_DTYPE_BF16, &b, x + i, 1);
    }
}

/* `steps` forwards of n tokens each (x: steps * n rows) through layer l into y (f32 on the
 * host); on the GPU in c->xt, y poisoned with NaN before each. */
static void run_steps(moe_layer_t *l, const dec_case_t *c, int gpu, const float *x, int64_t n,
                      int steps, float *y)
{
    const size_t H = (size_t)c->H, es = c->xt == MOE_DTYPE_BF16 && gpu ? 2 : 4;
    const size_t bytes = es * (size_t)n * H + 16;
    void *dx = NULL, *dy = NULL, *tmp = malloc(bytes);
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    assert_non_null(tmp);
    if (gpu) {
        dx = gt_dalloc(bytes);
        dy = gt_dalloc(bytes);
    }
    for (int r = 0; r < steps; r++) {
        const float *xr = x + (size_t)r * n * H;
        float *yr = y + (size_t)r * n * H;
        a.num_tokens = n;
        a.dtype = gpu ? c->xt : MOE_DTYPE_F32;
        if (gpu) {
            if (es == 2)
                moe_convert_from_f32(MOE_DTYPE_BF16, xr, tmp, (size_t)n * H);
            else
                memcpy(tmp, xr, 4 * (size_t)n * H);
            gt_ok(moe_gpu_memcpy_h2d(dx, tmp, es * (size_t)n * H), "x");
            gt_poison(dy, GT_POISON_FLOAT, bytes);
            a.x = dx;
            a.y = dy;
        } else {
            for (size_t i = 0; i < (size_t)n * H; i++)
                yr[i] = NAN;
            a.x = xr;
            a.y = yr;
        }
        gt_ok(moe_layer_forward(l, &a), c->name);
        gt_ok(moe_layer_synchronize(l, NULL), "synchronize");
        if (gpu) {
            gt_get(tmp, dy, es * (size_t)n * H);
            if (es == 2)
                moe_convert_to_f32(MOE_DTYPE_BF16, tmp, yr, (size_t)n * H);
            else
                memcpy(yr, tmp, 4 * (size_t)n * H);
        }
    }
    moe_gpu_free(dx);
    moe_gpu_free(dy);
    free(tmp);
}

static moe_layer_t *make(moe_runtime_t *rt, const dec_case_t *c, int64_t cap, uint64_t seed)
{
    moe_layer_config_t cfg = config_of(c, cap);
    moe_layer_t *l = NULL;
    gt_ok(moe_layer_create(rt, &cfg, &l), c->name);
    gt_ok(c->static_scales ? moe_gen_set_weights_static(l, &cfg, seed)
                           : moe_gen_set_weights(l, &cfg, seed),
          "weights");
    return l;
}

/* Whether the layer runs the fused kernel at n tokens (its explain text says so). */
static int runs_fused(const moe_layer_t *l, int64_t n)
{
    char text[2048];
    gt_ok(moe_layer_explain(l, n, text, sizeof(text)), "explain");
    return strstr(text, "sm90_fused_decode") != NULL;
}

/* The GEMM 1 k split a fused layer runs (its explain text), and the shape's rule for a case */
static int k1_split_of(const moe_layer_t *l)
{
    char text[2048];
    const char *at;
    gt_ok(moe_layer_explain(l, 1, text, sizeof(text)), "explain");
    at = strstr(text, "GEMM 1 k split ");
    assert_non_null(at);
    return atoi(at + strlen("GEMM 1 k split "));
}

static int k1_rule(const dec_case_t *c)
{
    int sms = 0;
    gt_ok(moe_gpu_sm_count(0, &sms), "SM count");
    return moe_decode_split1(c->E, c->k, c->H, c->I, sms);
}

typedef struct layers {
    moe_layer_t *cpu, *fused, *grouped;
} layers_t;

/* The fused layers a case is run with: GEMM 1 whole, GEMM 1 split along k by the shape's rule
 * (MOE_DECODE_K1_SPLIT=0), and where the shared MLP's width is a multiple of the experts' the
 * shared MLP inside the kernel (MOE_DECODE_SHARED=1). NULL past the last mode or for a mode the
 * case does not take. */
enum { MODE_WHOLE, MODE_K1_SPLIT, MODE_SHARED_INSIDE, NUM_MODES };
static const char *const mode_name[NUM_MODES] = {"GEMM 1 whole", "GEMM 1 split",
                                                 "shared MLP inside"};

static moe_layer_t *make_fused(const dec_case_t *c, int mode, uint64_t seed)
{
    moe_layer_t *l;
    if (mode == MODE_SHARED_INSIDE && !(c->shared_I > 0 && c->shared_I % c->I == 0))
        return NULL;
    if (mode == MODE_K1_SPLIT && c->static_scales) /* static scales take GEMM 1 whole */
        return NULL;
    setenv("MOE_FORCE_VARIANT", "sm90_fused_decode", 1);
    if (mode == MODE_K1_SPLIT)
        setenv("MOE_DECODE_K1_SPLIT", "0", 1);
    setenv("MOE_DECODE_SHARED", mode == MODE_SHARED_INSIDE ? "1" : "0", 1);
    l = make(rt_gpu, c, 64, seed);
    unsetenv("MOE_DECODE_K1_SPLIT");
    unsetenv("MOE_DECODE_SHARED");
    unsetenv("MOE_FORCE_VARIANT");
    {
        char text[2048];
        gt_ok(moe_layer_explain(l, 1, text, sizeof(text)), "explain");
        assert_true((strstr(text, "inside the fused decode kernel") != NULL) ==
                    (mode == MODE_SHARED_INSIDE));
    }
    return l;
}

/* One case at n tokens, fused (forced up to 64 tokens) against the CPU reference and the
 * grouped path. Below 16 tokens the check runs ceil(16 / n) steps of distinct tokens and takes
 * the error over all of them (for W8A8 one token's error is one draw of an e4m3 rounding of h:
 * docs/KERNELS.md, "FP8 W8A8"). */
static int check_case(const dec_case_t *c, const layers_t *ls, int64_t n)
{
    const uint64_t seed = tu_seed("gpu_decode");
    const int steps = n < 16 ? (int)((16 + n - 1) / n) : 1;
    const int64_t nt = n * steps;
    const size_t len = (size_t)nt * (size_t)c->H;
    float *x = malloc(4 * len), *ref = malloc(4 * len), *y = malloc(4 * len), *yg = malloc(4 * len);
    double ef, eg, efg;
    int bad = 0;
    assert_true(x && ref && y && yg);
    moe_gen_tokens(seed, 1000 * n, nt, c->H, x);
    if (c->xt == MOE_DTYPE_BF16)
        round_bf16(x, len);
    run_steps(ls->cpu, c, 0, x, n, steps, ref);
    assert_true(runs_fused(ls->fused, n));
    run_steps(ls->fused, c, 1, x, n, steps, y);
    assert_false(runs_fused(ls->grouped, n));
    run_steps(ls->grouped, c, 1, x, n, steps, yg);
    ef = tu_rel_err(y, ref, (int64_t)len);
    eg = tu_rel_err(yg, ref, (int64_t)len);
    efg = tu_rel_err(y, yg, (int64_t)len);
    bad = tu_count_nan(y, (int64_t)len) != 0 || !(ef <= 1e-2) || !(efg <= 1e-2);
    fprintf(stderr,
            "  %-56s %2lld tok x %2d: fused vs CPU %.2e, grouped vs CPU %.2e, fused vs grouped "
            "%.2e%s\n",
            c->name, (long long)n, steps, ef, eg, efg, bad ? "  FAIL" : "");
    free(x), free(ref), free(y), free(yg);
    return bad;
}

/* the grouped path's variant beside the kernel: the built-in table's at a few rows per expert */
static const char *grouped_of(const dec_case_t *c)
{
    if (c->wt == MOE_DTYPE_FP8_E4M3)
        return c->scale == MOE_SCALE_BLOCK_128 ? "sm90_fp8_block_swapab_n16_pp"
                                               : "sm90_fp8_swapab_n16_pp";
    return "sm90_swapab_n8";
}

static void test_decode_against_cpu(void **state)
{
    static const int64_t counts[] = {1, 2, 5, 8, 13, 16, 31, 64};
    const char *only = getenv("MOE_TEST_ONLY");
    const uint64_t seed = tu_seed("gpu_decode_w");
    int fails = 0;
    (void)state;
    REQUIRE_SM90();
    for (int i = 0; i < NUM_CASES; i++) {
        const dec_case_t *c = &cases[i];
        layers_t ls;
        if (only && !strstr(c->name, only))
            continue;
        ls.cpu = make(rt_cpu, c, 64, seed);
        setenv("MOE_FORCE_VARIANT", grouped_of(c), 1);
        ls.grouped = make(rt_gpu, c, 64, seed);
        unsetenv("MOE_FORCE_VARIANT");
        for (int mode = 0; mode < NUM_MODES; mode++) {
            if (!(ls.fused = make_fused(c, mode, seed)))
                continue;
            assert_int_equal(k1_split_of(ls.fused), mode == MODE_K1_SPLIT ? k1_rule(c) : 1);
            fprintf(stderr, "  (%s)\n", mode_name[mode]);
            for (size_t j = 0; j < sizeof(counts) / sizeof(counts[0]); j++)
                fails += check_case(c, &ls, counts[j]);
            moe_layer_destroy(ls.fused);
        }
        moe_layer_destroy(ls.cpu);
        moe_layer_destroy(ls.grouped);
    }
    assert_int_equal(fails, 0);
}

/* 128 x 128 weight blocks, the kernel forced: one token a step runs it (16 steps of distinct
 * tokens against the CPU's W8A8 and the grouped path, outputs poisoned first), two tokens the
 * grouped path; without the force the built-in crossover (as per-row fp8: these cases' few
 * expert bytes a token, no shared MLP) takes it at one token and not at two. */
static void test_decode_block_scales(void **state)
{
    const uint64_t seed = tu_seed("gpu_decode_block");
    int fails = 0;
    (void)state;
    REQUIRE_SM90();
    for (size_t i = 0; i < sizeof(block_cases) / sizeof(block_cases[0]); i++) {
        const dec_case_t *c = &block_cases[i];
        layers_t ls;
        moe_layer_t *plain = make(rt_gpu, c, 64, seed);
        assert_true(runs_fused(plain, 1));
        assert_false(runs_fused(plain, 2));
        moe_layer_destroy(plain);
        ls.cpu = make(rt_cpu, c, 64, seed);
        setenv("MOE_FORCE_VARIANT", grouped_of(c), 1);
        ls.grouped = make(rt_gpu, c, 64, seed);
        ls.fused = make_fused(c, MODE_WHOLE, seed);
        assert_int_equal(k1_split_of(ls.fused), 1);
        assert_false(runs_fused(ls.fused, 2));
        fails += check_case(c, &ls, 1);
        moe_layer_destroy(ls.fused);
        moe_layer_destroy(ls.cpu);
        moe_layer_destroy(ls.grouped);
    }
    assert_int_equal(fails, 0);
}

/* A token's output is bitwise the same alone, in a batch of 7 and in one of 64 (forced). */
static void test_decode_batch_invariant(void **state)
{
    (void)state;
    REQUIRE_SM90();
    for (int i = 0; i < NUM_CASES; i++) {
        const dec_case_t *c = &cases[i];
        const uint64_t seed = tu_seed("gpu_decode_inv");
        const size_t H = (size_t)c->H;
        float *x = malloc(4 * 64 * H), *y64 = malloc(4 * 64 * H), *y7 = malloc(4 * 7 * H),
              *y1 = malloc(4 * H);
        moe_layer_t *l;
        moe_gen_tokens(seed, 0, 64, c->H, x);
        for (int mode = 0; mode < NUM_MODES; mode++) {
            if (!(l = make_fused(c, mode, seed)))
                continue;
            run_steps(l, c, 1, x, 64, 1, y64);
            run_steps(l, c, 1, x + 20 * H, 7, 1, y7); /* tokens 20 .. 26 */
            run_steps(l, c, 1, x + 23 * H, 1, 1, y1); /* token 23 */
            moe_layer_destroy(l);
            assert_int_equal(tu_count_nan(y64, (int64_t)(64 * H)), 0);
            assert_memory_equal(y7, y64 + 20 * H, 4 * 7 * H);
            assert_memory_equal(y1, y64 + 23 * H, 4 * H);
            fprintf(stderr, "  %-56s batch-invariant (1 / 7 / 64 tokens), %s\n", c->name,
                    mode_name[mode]);
        }
        free(x), free(y64), free(y7), free(y1);
    }
}

/* Graph replays give bitwise the direct step's output (the kernel's counters reset themselves
 * at the end of each launch); forced, the kernel runs up to MOE_DECODE_MAX_TOKENS and not past
 * it; without a force the built-in crossover (runtime/oracle.c: fp8 one token where a token's
 * expert weights are few and there is no shared expert, as this case) decides, and a layer with a
 * shared expert keeps the grouped path; a layer the kernel cannot run refuses the forced name at
 * create, naming it. */
static void test_decode_graph_explain_refusals(void **state)
{
    const dec_case_t *c = &cases[3];
    const int64_t T = 5;
    const size_t n = (size_t)T * (size_t)c->H;
    const uint64_t seed = tu_seed("gpu_decode_graph");
    const moe_oracle_query_t q = {90,
                                  MOE_DTYPE_FP8_E4M3,
                                  MOE_SCALE_PER_CHANNEL,
                                  1,
                                  1,
                                  MOE_ORACLE_ANY,
                                  1.0,
                                  0,
                                  (double)c->k * 3 * c->H * c->I,
                                  c->shared_I > 0};
    float *x = malloc(4 * n), *y1 = malloc(4 * n), *y2 = malloc(4 * n);
    void *stream = NULL, *graph = NULL, *exec = NULL, *dx, *dy;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    moe_layer_config_t cfg;
    moe_layer_t *l, *bad = NULL;
    (void)state;
    REQUIRE_SM90();

    l = make(rt_gpu, c, 4096, seed);
    assert_int_equal(moe_oracle_decode_tokens(NULL, &q, NULL), 1);
    assert_true(runs_fused(l, 1));
    assert_false(runs_fused(l, 2));
    moe_layer_destroy(l);
    l = make(rt_gpu, &cases[5], 4096, seed); /* fp8, a shared MLP left outside: the grouped path */
    assert_false(runs_fused(l, 1));
    moe_layer_destroy(l);
    l = make(rt_gpu, &cases[7], 4096, seed); /* fp8, the shared MLP inside (the default) */
    assert_true(cases[7].shared_I % cases[7].I == 0);
    assert_true(runs_fused(l, 1));
    assert_false(runs_fused(l, 2));
    moe_layer_destroy(l);
    setenv("MOE_FORCE_VARIANT", "sm90_fused_decode", 1);
    l = make(rt_gpu, c, 4096, seed);
    unsetenv("MOE_FORCE_VARIANT");
    assert_true(runs_fused(l, 1));
    assert_true(runs_fused(l, MOE_DECODE_MAX_TOKENS));
    assert_false(runs_fused(l, MOE_DECODE_MAX_TOKENS + 1));
    gt_ok(moe_gpu_stream_create(&stream), "stream");
    moe_gen_tokens(seed, 0, T, c->H, x);
    dx = gt_dup(x, 4 * n);
    dy = gt_dalloc(4 * n);
    a.num_tokens = T;
    a.dtype = MOE_DTYPE_F32;
    a.x = dx;
    a.y = dy;
    a.stream = stream;
    gt_poison(dy, GT_POISON_FLOAT, 4 * n);
    gt_ok(moe_layer_forward(l, &a), "forward");
    gt_ok(moe_layer_synchronize(l, stream), "sync");
    gt_get(y1, dy, 4 * n);
    assert_true(gt_all_finite(y1, n));
    gt_poison(dy, GT_POISON_FLOAT, 4 * n);
    gt_ok(moe_gpu_graph_capture_begin(stream), "capture begin");
    gt_ok(moe_layer_forward(l, &a), "forward in capture");
    gt_ok(moe_gpu_graph_capture_end(stream, &graph), "capture end");
    gt_ok(moe_gpu_graph_instantiate(graph, &exec), "instantiate");
    for (int i = 0; i < 3; i++)
        gt_ok(moe_gpu_graph_launch(exec, stream), "graph launch");
    gt_ok(moe_layer_synchronize(l, stream), "sync");
    gt_get(y2, dy, 4 * n);
    assert_memory_equal(y1, y2, 4 * n);
    moe_gpu_graph_exec_destroy(exec);
    moe_gpu_graph_destroy(graph);
    moe_gpu_stream_destroy(stream);
    moe_layer_destroy(l);
    moe_gpu_free(dx), moe_gpu_free(dy);

    /* deterministic mode keeps one path at every batch */
    setenv("MOE_FORCE_VARIANT", "sm90_fused_decode", 1);
    cfg = config_of(&cases[0], 64);
    cfg.deterministic = 1;
    assert_int_equal(moe_layer_create(rt_gpu, &cfg, &bad), MOE_STATUS_NOT_SUPPORTED);
    assert_non_null(strstr(moe_last_error(), "deterministic"));
    unsetenv("MOE_FORCE_VARIANT");
    cfg.deterministic = 1;
    gt_ok(moe_layer_create(rt_gpu, &cfg, &bad), "deterministic layer");
    assert_false(runs_fused(bad, 1));
    moe_layer_destroy(bad);
    free(x), free(y1), free(y2);
}

static int setup(void **state)
{
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    (void)state;
    rc.backend = MOE_BACKEND_CUDA;
    if (moe_runtime_create(&rc, NULL, &rt_gpu) || moe_gpu_arch(0, &arch))
        return -1;
    rc.backend = MOE_BACKEND_CPU;
    rc.device = -1;
    return moe_runtime_create(&rc, NULL, &rt_cpu) ? -1 : 0;
}

static int teardown(void **state)
{
    (void)state;
    moe_runtime_destroy(rt_cpu);
    moe_runtime_destroy(rt_gpu);
    return 0;
}

/* The shape rules for the k splits and the sync array's size, and the launch's refusals of bad
 * splits: host code, run with or without a GPU. */
static void test_decode_split_rules(void **state)
{
    moe_decode_args_t a;
    float o = 0.0f;
    (void)state;
    /* one token's GEMM 1 items against 132 SMs x 16 warps: Qwen3-30B-A3B has 8 x 96 = 768 */
    assert_int_equal(moe_decode_split1(128, 8, 2048, 768, 132), 2);
    assert_int_equal(moe_decode_split1(8, 2, 4096, 14336, 132), 1); /* Mixtral: 3584 items */
    assert_int_equal(moe_decode_split1(32, 8, 7168, 2048, 132), 1); /* DeepSeek-V3 shard */
    assert_int_equal(moe_decode_split1(32, 8, 1024, 256, 132), 4);  /* at least 256 k a piece */
    assert_int_equal(moe_decode_split1(8, 2, 128, 64, 132), 1);     /* k < 512: one piece */
    assert_int_equal(moe_decode_split1(1, 1, 65536, 8, 132), MOE_DECODE_MAX_SPLIT);
    assert_int_equal(moe_decode_split1(16, 4, 1024, 96, 0), 4);    /* 0 SMs: 132 assumed */
    assert_int_equal(moe_decode_split(128, 8, 2048, 768, 132), 2); /* GEMM 2: 1024 items */
    /* the piece counters only with a GEMM 1 split: E x inter / 8 ints */
    assert_true(moe_decode_sync_count(128, 2048, 768, 1, 64) ==
                moe_decode_sync_count(128, 2048, 768, 0, 64));
    assert_true(moe_decode_sync_count(128, 2048, 768, 2, 64) ==
                moe_decode_sync_count(128, 2048, 768, 1, 64) + 128 * 768 / 8);
    /* refused before anything runs: a split past the bound, a split without its workspace */
    memset(&a, 0, sizeof(a));
    a.num_tokens = 1;
    a.top_k = 2;
    a.num_experts = 8;
    a.hidden = 1024;
    a.inter = 256;
    a.split = 1;
    a.x_dtype = a.y_dtype = MOE_DTYPE_BF16;
    a.split1 = MOE_DECODE_MAX_SPLIT + 1;
    assert_int_equal(moe_decode_launch(&a, NULL), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "split1 = 9"));
    a.split1 = 2;
    assert_int_equal(moe_decode_launch(&a, NULL), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "o1 workspace"));
    a.o1 = &o;
    a.split1 = -1;
    assert_int_equal(moe_decode_launch(&a, NULL), MOE_STATUS_INVALID_ARGUMENT);
    /* block scales (f8 = 2): one token a launch of the routed form; the maxima of h per 128-wide
     * group of inter in the sync array; one token's x and scales within shared memory */
    a.split1 = 1;
    a.f8 = 2;
    a.num_tokens = 2;
    assert_int_equal(moe_decode_launch(&a, NULL), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "block scales take one token a launch (not 2)"));
    a.f8 = 3;
    assert_int_equal(moe_decode_launch(&a, NULL), MOE_STATUS_NOT_SUPPORTED);
    assert_non_null(strstr(moe_last_error(), "f8 = 3"));
    assert_int_equal(moe_decode_check(8, 2, 1024, 256, 2), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_decode_check(8, 2, 49152, 256, 2), MOE_STATUS_NOT_SUPPORTED);
    assert_non_null(strstr(moe_last_error(), "hidden = 49152 with block scales"));
    assert_int_equal(moe_decode_check(8, 2, 49152, 256, 1), MOE_STATUS_SUCCESS);
    assert_true(moe_decode_sync_count(8, 1024, 384, 1, 64) ==
                moe_decode_sync_count(8, 1024, 256, 1, 64) + 64);
}

/* Every wait of the kernel is bounded (kernels/decode.h, MOE_DECODE_STICKY_STALL): with its
 * per-expert counters set so that no GEMM 2 item's wait can end (as when CTAs holding GEMM 1
 * items never run), the launch still ends, within about its timeout, with MOE_STATUS_TIMEOUT and
 * the stall bit in the sticky word; it leaves its counters ready, so the next launch computes
 * bitwise what a launch before it did and reports nothing. */
static void test_decode_stall_bounded(void **state)
{
    enum { E = 8, K = 2, H = 256, I = 128, T = 1 };
    const int32_t ids[T * K] = {1, 5};
    const float w[T * K] = {0.625f, 0.375f};
    const size_t n13 = (size_t)E * 2 * I * H, n2 = (size_t)E * H * I;
    const size_t nsync = moe_decode_sync_count(E, H, I, 1, T * K);
    uint16_t *w13 = malloc(2 * n13), *w2 = malloc(2 * n2), x[T * H];
    int32_t *poison = malloc(sizeof(int32_t) * nsync), *sticky = NULL;
    float y0[T * H], y1[T * H];
    moe_decode_args_t a;
    struct timespec t0, t1;
    double secs;
    (void)state;
    REQUIRE_SM90();
    assert_non_null(w13);
    assert_non_null(w2);
    assert_non_null(poison);
    gt_ok(moe_decode_prepare(), "moe_decode_prepare");
    gt_fill_bf16(NULL, w13, n13, 0.05f);
    gt_fill_bf16(NULL, w2, n2, 0.05f);
    gt_fill_bf16(NULL, x, T * H, 1.0f);
    gt_ok(moe_gpu_host_alloc((void **)&sticky, sizeof(int32_t)), "sticky word");
    memset(&a, 0, sizeof(a));
    a.x = gt_dup(x, sizeof(x));
    a.x_dtype = MOE_DTYPE_BF16;
    a.topk_ids = gt_dup(ids, sizeof(ids));
    a.topk_weights = gt_dup(w, sizeof(w));
    a.w13 = gt_dup(w13, 2 * n13);
    a.w2 = gt_dup(w2, 2 * n2);
    a.y = gt_dalloc(sizeof(y0));
    a.y_dtype = MOE_DTYPE_F32;
    a.h = gt_dalloc(2 * (size_t)T * K * I);
    a.o = gt_dalloc(sizeof(float) * (size_t)T * K * H);
    a.sync = gt_dalloc(sizeof(int32_t) * nsync);
    a.num_tokens = T;
    a.top_k = K;
    a.num_experts = E;
    a.hidden = H;
    a.inter = I;
    a.split = a.split1 = 1;
    a.sticky = sticky;
    a.timeout_ns = 50 * 1000000ll; /* 50 ms */
    gt_poison(a.sync, 0, sizeof(int32_t) * nsync);

    *sticky = 0; /* a launch as the layer makes it: nothing to report */
    gt_poison(a.y, GT_POISON_FLOAT, sizeof(y0));
    gt_ok(moe_decode_launch(&a, NULL), "decode launch");
    gt_get(y0, a.y, sizeof(y0));
    assert_int_equal(*sticky, 0);
    assert_true(gt_all_finite(y0, T * H));

    /* every counter but the launch's done count far below any target, so no wait ends (the
     * launch's abort word among them: only a positive one aborts) */
    for (size_t i = 0; i < nsync; i++)
        poison[i] = i ? -1000000 : 0;
    assert_int_equal(moe_gpu_memcpy_h2d(a.sync, poison, sizeof(int32_t) * nsync),
                     MOE_STATUS_SUCCESS);
    assert_int_equal(moe_gpu_device_synchronize(), MOE_STATUS_SUCCESS);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    gt_ok(moe_decode_launch(&a, NULL), "decode launch, stalled");
    assert_int_equal(moe_gpu_device_synchronize(), MOE_STATUS_SUCCESS);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    print_message("  stalled launch ended after %.3f s (timeout 0.05 s a wait)\n", secs);
    assert_true(secs < 10.0);
    assert_int_equal(*sticky, MOE_DECODE_STICKY_STALL | (int32_t)MOE_STATUS_TIMEOUT);

    *sticky = 0; /* the next launch: the counters were left ready */
    gt_poison(a.y, GT_POISON_FLOAT, sizeof(y1));
    gt_ok(moe_decode_launch(&a, NULL), "decode launch after the stall");
    gt_get(y1, a.y, sizeof(y1));
    assert_int_equal(*sticky, 0);
    assert_memory_equal(y0, y1, sizeof(y0));

    moe_gpu_free((void *)a.x);
    moe_gpu_free((void *)a.topk_ids);
    moe_gpu_free((void *)a.topk_weights);
    moe_gpu_free((void *)a.w13);
    moe_gpu_free((void *)a.w2);
    moe_gpu_free(a.y);
    moe_gpu_free(a.h);
    moe_gpu_free(a.o);
    moe_gpu_free(a.sync);
    moe_gpu_host_free(sticky);
    free(w13), free(w2), free(poison);
}

/* A launch's workspace for `rows` rows (its sync array zeroed), and its release. */
static void workspace(moe_decode_args_t *d, int f8, int split1, int rows, size_t nsync)
{
    d->h = gt_dalloc(2 * (size_t)rows * (size_t)d->inter);
    d->o = gt_dalloc(sizeof(float) * (size_t)d->split * (size_t)rows * (size_t)d->hidden);
    d->o1 = split1 > 1
                ? gt_dalloc(sizeof(float) * (size_t)split1 * (size_t)rows * 2 * (size_t)d->inter)
                : NULL;
    d->xq = f8 ? gt_dalloc((size_t)rows * (size_t)d->hidden) : NULL;
    d->xs = f8 ? gt_dalloc(sizeof(float) * (size_t)rows) : NULL;
    d->sync = gt_dalloc(sizeof(int32_t) * nsync);
    gt_poison(d->sync, 0, sizeof(int32_t) * nsync);
}

static void workspace_free(moe_decode_args_t *d)
{
    moe_gpu_free(d->h), moe_gpu_free(d->o), moe_gpu_free(d->o1), moe_gpu_free(d->xq);
    moe_gpu_free(d->xs), moe_gpu_free(d->sync);
}

/* Laid-out rows (kernels/decode.h, lo_counts: an EP step's low-latency layout, one GPU here):
 * each row through its expert into its own row of rows_out is bitwise the routed form's output
 * for the same rows as tokens of top_k 1 and weight 1, rounded to bf16 (no value crosses mma
 * columns; the k splits come from the shape), and rows outside the experts stay as they were.
 * bf16 and fp8 (per-row scales), with 16 columns a pass (lo_cols 30: experts of 17 and 30 rows
 * take two) and 8 (lo_cols 8: up to four passes), each launch twice (the counters left ready).
 * More rows than the workspace's run nothing and mark the sticky word with the rank and bits
 * given. */
static void test_decode_laid_out(void **state)
{
    enum { E = 8, H = 256, I = 128, PAD = 8, ROWS = 64, SPLIT = 2 };
    static const int cnt[E] = {3, 0, 17, 1, 30, 0, 5, 8}; /* 64 rows, at most 30 an expert */
    static const int cols[2] = {30, 8};                   /* 16 and 8 columns a pass */
    const size_t n13 = (size_t)E * 2 * I * H, n2 = (size_t)E * H * I;
    int32_t off[E + 1], ids[ROWS], row_of[ROWS], *sticky = NULL;
    float wt[ROWS], y[ROWS * H];
    int nrows = 0, t = 0, f8, ci, rep;
    (void)state;
    REQUIRE_SM90();
    gt_ok(moe_decode_prepare(), "moe_decode_prepare");
    for (int e = 0; e < E; e++) { /* every expert followed by at least one padding row */
        off[e] = nrows;
        nrows += (cnt[e] + PAD) / PAD * PAD;
        for (int m = 0; m < cnt[e]; m++, t++)
            ids[t] = e, wt[t] = 1.0f, row_of[t] = off[e] + m;
    }
    off[E] = nrows;
    assert_int_equal(t, ROWS);
    uint16_t *xl = malloc(2 * (size_t)nrows * H), *xt = malloc(2 * (size_t)ROWS * H);
    uint16_t *got = malloc(2 * (size_t)nrows * H), *w13 = malloc(2 * n13), *w2 = malloc(2 * n2);
    uint8_t *q13 = malloc(n13), *q2 = malloc(n2);
    float *s13 = malloc(sizeof(float) * E * 2 * I), *s2 = malloc(sizeof(float) * E * H);
    assert_true(xl && xt && got && w13 && w2 && q13 && q2 && s13 && s2);
    gt_fill_bf16(NULL, xl, (size_t)nrows * H, 1.0f);
    for (t = 0; t < ROWS; t++)
        memcpy(xt + (size_t)t * H, xl + (size_t)row_of[t] * H, 2 * (size_t)H);
    gt_fill_bf16(NULL, w13, n13, 0.05f);
    gt_fill_bf16(NULL, w2, n2, 0.05f);
    for (size_t i = 0; i < n13; i++) /* e4m3 codes of exponent field <= 13: no NaN */
        q13[i] = (uint8_t)(gt_below(0x70) | gt_below(2) << 7);
    for (size_t i = 0; i < n2; i++)
        q2[i] = (uint8_t)(gt_below(0x70) | gt_below(2) << 7);
    for (int i = 0; i < E * 2 * I; i++)
        s13[i] = (1.0f + gt_uniform()) / 256.0f;
    for (int i = 0; i < E * H; i++)
        s2[i] = (1.0f + gt_uniform()) / 256.0f;
    gt_ok(moe_gpu_host_alloc((void **)&sticky, sizeof(int32_t)), "sticky word");
    void *d_xl = gt_dup(xl, 2 * (size_t)nrows * H), *d_xt = gt_dup(xt, 2 * (size_t)ROWS * H);
    void *d_w13 = gt_dup(w13, 2 * n13), *d_w2 = gt_dup(w2, 2 * n2);
    void *d_q13 = gt_dup(q13, n13), *d_q2 = gt_dup(q2, n2);
    float *d_s13 = gt_dup(s13, sizeof(float) * E * 2 * I),
          *d_s2 = gt_dup(s2, sizeof(float) * E * H);
    int32_t *d_cnt = gt_dup(cnt, sizeof(cnt)), *d_off = gt_dup(off, sizeof(off));
    int32_t *d_ids = gt_dup(ids, sizeof(ids));
    float *d_w = gt_dup(wt, sizeof(wt));
    void *d_out = gt_dalloc(2 * (size_t)nrows * H), *d_y = gt_dalloc(sizeof(y));
    for (f8 = 0; f8 <= 1; f8++)
        for (ci = 0; ci < 2; ci++) {
            const size_t nsync = moe_decode_sync_count(E, H, I, 1, ROWS);
            moe_decode_args_t a, b;
            memset(&a, 0, sizeof(a));
            a.x_dtype = MOE_DTYPE_BF16;
            a.w13 = f8 ? d_q13 : d_w13;
            a.w2 = f8 ? d_q2 : d_w2;
            a.w13_scale = f8 ? d_s13 : NULL;
            a.w2_scale = f8 ? d_s2 : NULL;
            a.y_dtype = MOE_DTYPE_F32;
            a.num_tokens = ROWS;
            a.top_k = 1;
            a.num_experts = E;
            a.hidden = H;
            a.inter = I;
            a.f8 = f8;
            a.split = SPLIT;
            a.split1 = 1;
            a.sticky = sticky;
            a.timeout_ns = 1000 * 1000000ll;
            b = a; /* the laid-out launch: its own workspace, the same weights */
            workspace(&a, f8, 1, ROWS, nsync);
            workspace(&b, f8, 1, ROWS, nsync);
            a.x = d_xt;
            a.topk_ids = d_ids;
            a.topk_weights = d_w;
            a.y = d_y;
            *sticky = 0;
            gt_poison(a.y, GT_POISON_FLOAT, sizeof(y));
            gt_ok(moe_decode_launch(&a, NULL), "routed launch");
            gt_get(y, a.y, sizeof(y));
            assert_int_equal(*sticky, 0);
            b.x = d_xl;
            b.lo_counts = d_cnt;
            b.lo_offsets = d_off;
            b.rows_out = d_out;
            b.lo_cols = cols[ci];
            b.sticky_rank = 3;
            b.sticky_bits = 1 << 29;
            for (rep = 0; rep < 2; rep++) {
                int wrong = 0, touched = 0;
                gt_poison(d_out, 0xff, 2 * (size_t)nrows * H);
                gt_ok(moe_decode_launch(&b, NULL), "laid-out launch");
                gt_get(got, d_out, 2 * (size_t)nrows * H);
                assert_int_equal(*sticky, 0);
                for (t = 0; t < ROWS; t++)
                    for (int c = 0; c < H; c++)
                        wrong +=
                            got[(size_t)row_of[t] * H + c] != moe_f32_to_bf16(y[(size_t)t * H + c]);
                for (int e = 0; e < E; e++) /* the padding rows */
                    for (int r = off[e] + cnt[e]; r < off[e + 1]; r++)
                        for (int c = 0; c < H; c++)
                            touched += got[(size_t)r * H + c] != 0xffff;
                print_message("  laid-out rows, %s, lo_cols %d, launch %d: %d of %d values differ "
                              "from the routed form's, %d padding values written\n",
                              f8 ? "fp8" : "bf16", cols[ci], rep + 1, wrong, ROWS * H, touched);
                assert_int_equal(wrong, 0);
                assert_int_equal(touched, 0);
            }
            /* more rows than the workspace's: nothing runs, the sticky word names the rank */
            gt_poison(d_out, 0xff, 2 * (size_t)nrows * H);
            b.num_tokens = ROWS - 1;
            gt_ok(moe_decode_launch(&b, NULL), "laid-out launch, rows past the workspace");
            gt_get(got, d_out, 2 * (size_t)nrows * H);
            assert_int_equal(*sticky, 3 << 8 | (int32_t)MOE_STATUS_INTERNAL_ERROR | 1 << 29);
            for (size_t i = 0; i < (size_t)nrows * H; i++)
                assert_int_equal(got[i], 0xffff);
            *sticky = 0;
            workspace_free(&a);
            workspace_free(&b);
        }
    moe_gpu_free(d_xl), moe_gpu_free(d_xt), moe_gpu_free(d_w13), moe_gpu_free(d_w2);
    moe_gpu_free(d_q13), moe_gpu_free(d_q2), moe_gpu_free(d_s13), moe_gpu_free(d_s2);
    moe_gpu_free(d_cnt), moe_gpu_free(d_off), moe_gpu_free(d_ids), moe_gpu_free(d_w);
    moe_gpu_free(d_out), moe_gpu_free(d_y);
    moe_gpu_host_free(sticky);
    free(xl), free(xt), free(got), free(w13), free(w2), free(q13), free(q2), free(s13), free(s2);
}

static const struct CMUnitTest host_tests[] = {
    cmocka_unit_test(test_decode_split_rules),
};

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_decode_stall_bounded),
    cmocka_unit_test(test_decode_laid_out),
    cmocka_unit_test(test_decode_graph_explain_refusals),
    cmocka_unit_test(test_decode_batch_invariant),
    cmocka_unit_test(test_decode_against_cpu),
    cmocka_unit_test(test_decode_block_scales),
};

int main(void)
{
    int gate;
    if (cmocka_run_group_tests_name("decode host", host_tests, NULL, NULL))
        return 1; /* a failure, GPU or not */
    gate = gt_gpu_gate(1);
    if (gate)
        return gate;
    gt_seed();
    gt_test_filter();
    return cmocka_run_group_tests(tests, setup, teardown);
}
