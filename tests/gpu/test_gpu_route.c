/* SPDX-License-Identifier: Apache-2.0 */
/* GPU routing against the CPU reference: top-k ids exact, weights and logits to rounding. */
#include "gpu_test.h"

#include "kernels/cpu/moe_cpu.h"
#include "base/numeric.h"
#include "kernels/permute.h"
#include "kernels/route.h"

typedef struct route_case {
    const char *name;
    moe_route_params_t p;
} route_case_t;

static const route_case_t cases[] = {
    {"mixtral E8 k2 softmax", {8, 2, MOE_SCORING_SOFTMAX, 0, 0, 0, 1, 1.0f}},
    {"qwen3 E128 k8 softmax", {128, 8, MOE_SCORING_SOFTMAX, 0, 0, 0, 1, 1.0f}},
    {"qwen2 E60 k4 softmax raw", {60, 4, MOE_SCORING_SOFTMAX, 0, 0, 0, 0, 1.0f}},
    {"deepseek shard E32 k8 sigmoid g4/2", {32, 8, MOE_SCORING_SIGMOID, 1, 4, 2, 1, 2.5f}},
    {"deepseek E256 k8 sigmoid g8/4", {256, 8, MOE_SCORING_SIGMOID, 1, 8, 4, 1, 2.5f}},
    {"E512 k16 softmax", {512, 16, MOE_SCORING_SOFTMAX, 0, 0, 0, 1, 1.0f}},
    {"E64 k6 sigmoid plain", {64, 6, MOE_SCORING_SIGMOID, 0, 0, 0, 0, 1.0f}},
    {"E1 k1", {1, 1, MOE_SCORING_SOFTMAX, 0, 0, 0, 1, 1.0f}},
};

/* Runs the GPU route on host logits and checks it against moe_cpu_route. */
static void check_route(const route_case_t *c, int64_t T, const float *logits, const float *bias)
{
    const int E = c->p.num_experts, K = c->p.top_k;
    const size_t nk = (size_t)T * K;
    int32_t *ref_ids = malloc(sizeof(int32_t) * (nk + 1)),
            *ids = malloc(sizeof(int32_t) * (nk + 1));
    float *ref_w = malloc(sizeof(float) * (nk + 1)), *w = malloc(sizeof(float) * (nk + 1));
    float *d_logits = gt_dup(logits, sizeof(float) * (size_t)T * E + 4);
    float *d_bias = gt_dup(bias, sizeof(float) * (size_t)E);
    int32_t *d_ids = gt_dalloc(sizeof(int32_t) * (nk + 1));
    float *d_w = gt_dalloc(sizeof(float) * (nk + 1));
    moe_route_args_t a = {c->p, d_logits, d_bias, d_ids, d_w, T};
    size_t i;

    gt_poison(d_ids, GT_POISON_INT, sizeof(int32_t) * (nk + 1));
    gt_poison(d_w, GT_POISON_FLOAT, sizeof(float) * (nk + 1));
    gt_ok(moe_route_launch(&a, NULL), c->name);
    gt_get(ids, d_ids, sizeof(int32_t) * (nk + 1));
    gt_get(w, d_w, sizeof(float) * (nk + 1));
    gt_ok(moe_cpu_route(&c->p, logits, bias, T, ref_ids, ref_w), "cpu route");
    for (i = 0; i < nk; i++) {
        if (ids[i] != ref_ids[i] ||
            !(fabsf(w[i] - ref_w[i]) <= 1e-5f * fmaxf(1.0f, fabsf(ref_w[i])))) {
            fprintf(stderr, "%s T=%lld: token %zu slot %zu: gpu (%d, %.9g) cpu (%d, %.9g)\n",
                    c->name, (long long)T, i / K, i % K, ids[i], (double)w[i], ref_ids[i],
                    (double)ref_w[i]);
            fail();
        }
    }
    /* nothing written past the end */
    assert_int_equal(ids[nk], 0x7F7F7F7F);
    free(ref_ids), free(ids), free(ref_w), free(w);
    moe_gpu_free(d_logits), moe_gpu_free(d_bias), moe_gpu_free(d_ids), moe_gpu_free(d_w);
}

static void test_route_random(void **state)
{
    size_t c;
    int t;
    (void)state;
    for (c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const int E = cases[c].p.num_experts;
        float *bias = malloc(sizeof(float) * (size_t)E);
        /* Values on coarse grids: distinct choice scores stay far apart compared with the
         * ulp differences of expf between the device and libm, so ids must match exactly. */
        for (t = 0; t < E; t++)
            bias[t] = 0.5f * (float)gt_below(2);
        for (t = 0; t < GT_NUM_TOKEN_COUNTS; t++) {
            const int64_t T = gt_token_counts[t];
            float *logits = malloc(sizeof(float) * (size_t)(T * E + 1));
            int64_t i;
            for (i = 0; i < T * E; i++)
                logits[i] = (float)gt_below(257) / 32.0f - 4.0f;
            check_route(&cases[c], T, logits, bias);
            free(logits);
        }
        free(bias);
    }
}

/* Exact ties everywhere: the rule (lower expert id first) must match the reference. */
static void test_route_ties(void **state)
{
    size_t c;
    (void)state;
    for (c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const int E = cases[c].p.num_experts;
        const int64_t T = 255;
        float *logits = malloc(sizeof(float) * (size_t)(T * E));
        float *bias = calloc((size_t)E, sizeof(float));
        int64_t i;
        for (i = 0; i < T * E; i++)
            logits[i] = (float)gt_below(3);
        for (i = 0; i < E; i++)
            bias[i] = 0.25f * (float)gt_below(2);
        check_route(&cases[c], T, logits, bias);
        free(logits);
        free(bias);
    }
}

/* Router weights [E][H] and, for the tensor-core path, their three bf16 planes on the device. */
static float *router_weights(int E, int H, uint16_t **d_split)
{
    const size_t n = (size_t)E * H;
    float *w = malloc(sizeof(float) * n);
    uint16_t *planes = malloc(3 * sizeof(uint16_t) * n);
    size_t i;
    for (i = 0; i < n; i++)
        w[i] = gt_uniform() / sqrtf((float)H);
    moe_split_bf16x3(w, planes, planes + n, planes + 2 * n, n);
    *d_split = gt_dup(planes, 3 * sizeof(uint16_t) * n);
    free(planes);
    return w;
}

/* Router logits (the GEMV, tiled and blocked SIMT paths, and with `split` the tensor-core path)
 * against a double-precision dot, outputs poisoned first. */
static void check_logits(int E, int H, int64_t T, moe_dtype_t xt, int split)
{
    const size_t nx = (size_t)T * H, nl = (size_t)T * E;
    float *x = malloc(sizeof(float) * nx + 4), *w;
    uint16_t *xb = malloc(2 * nx + 4), *d_split;
    float *out = malloc(sizeof(float) * nl + 4);
    void *d_x;
    float *d_w, *d_l;
    int64_t t;
    int e, h;

    gt_fill_bf16(x, xb, nx, 1.0f);
    for (size_t i = 0; xt == MOE_DTYPE_F32 && i < nx; i++) /* f32 x with all 24 bits in use */
        x[i] *= 1.0f + 0.3f * gt_uniform();
    w = router_weights(E, H, &d_split);
    d_x = xt == MOE_DTYPE_BF16 ? gt_dup(xb, 2 * nx + 4) : gt_dup(x, 4 * nx + 4);
    d_w = gt_dup(w, sizeof(float) * (size_t)E * H);
    d_l = gt_dalloc(sizeof(float) * nl + 4);
    gt_poison(d_l, GT_POISON_FLOAT, sizeof(float) * nl + 4);
    {
        moe_route_logits_args_t a = {d_x, xt, d_w, d_l, T, E, H, split ? d_split : NULL, 0};
        gt_ok(moe_route_logits_launch(&a, NULL), "logits");
    }
    gt_get(out, d_l, sizeof(float) * nl);
    for (t = 0; t < T; t++)
        for (e = 0; e < E; e++) {
            double ref = 0.0, mag = 0.0;
            for (h = 0; h < H; h++) {
                ref += (double)x[t * H + h] * w[(size_t)e * H + h];
                mag += fabs((double)x[t * H + h] * w[(size_t)e * H + h]);
            }
            if (!(fabs(out[t * E + e] - ref) <= 1e-5 * mag + 1e-6)) {
                fprintf(stderr, "logits E%d H%d T%lld %s%s: [%lld, %d] gpu %.9g ref %.9g\n", E, H,
                        (long long)T, moe_dtype_name(xt), split ? " split" : "", (long long)t, e,
                        (double)out[t * E + e], ref);
                fail();
            }
        }
    free(x), free(w), free(xb), free(out);
    moe_gpu_free(d_x), moe_gpu_free(d_w), moe_gpu_free(d_l), moe_gpu_free(d_split);
}

static void test_route_logits(void **state)
{
    static const int shapes[][2] = {{8, 4096}, {128, 2048}, {32, 7168}, {1, 2048},
                                    {60, 200}, {5, 203},    {9, 136}};
    static const int64_t tokens[] = {1, 3, 17, 33, 64, 255};
    size_t s, t;
    (void)state;
    for (s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
        for (t = 0; t < sizeof(tokens) / sizeof(tokens[0]); t++) {
            check_logits(shapes[s][0], shapes[s][1], tokens[t], MOE_DTYPE_F32, 0);
            check_logits(shapes[s][0], shapes[s][1], tokens[t], MOE_DTYPE_BF16, 0);
            check_logits(shapes[s][0], shapes[s][1], tokens[t], MOE_DTYPE_BF16, 1);
            check_logits(shapes[s][0], shapes[s][1], tokens[t], MOE_DTYPE_F32, 1);
        }
    check_logits(128, 2048, 1024, MOE_DTYPE_BF16, 0);
    check_logits(128, 2048, 4096, MOE_DTYPE_BF16, 1); /* the largest tensor-core tiles */
    check_logits(8, 4096, 8192, MOE_DTYPE_BF16, 1);
    check_logits(128, 2048, 4096, MOE_DTYPE_F32, 1);
    check_logits(8, 512, 8192, MOE_DTYPE_F32, 0);
}

/* Tensor-core logits of tokens first..first+n-1 of d_x into host out ([n][E]), from the three
 * planes (planes 3) or the hi plane alone (1). */
static void tc_logits_planes(const void *d_x, moe_dtype_t xt, const uint16_t *d_split, float *d_l,
                             int64_t first, int64_t n, int E, int H, int planes, float *out)
{
    moe_route_logits_args_t a;
    memset(&a, 0, sizeof(a));
    a.x = (const char *)d_x + (size_t)first * H * (xt == MOE_DTYPE_F32 ? 4 : 2);
    a.x_dtype = xt;
    a.w = (const float *)d_split; /* 16-byte aligned; the f32 weight is not read on this path */
    a.logits = d_l;
    a.num_tokens = n;
    a.num_rows = E;
    a.hidden = H;
    a.w_split = d_split;
    a.w_split_planes = planes;
    gt_poison(d_l, GT_POISON_FLOAT, sizeof(float) * (size_t)n * E);
    gt_ok(moe_route_logits_launch(&a, NULL), "logits");
    gt_get(out, d_l, sizeof(float) * (size_t)n * E);
}

static void tc_logits(const void *d_x, moe_dtype_t xt, const uint16_t *d_split, float *d_l,
                      int64_t first, int64_t n, int E, int H, float *out)
{
    tc_logits_planes(d_x, xt, d_split, d_l, first, n, E, H, 3, out);
}

/* A router exact in bf16 (zero mid and lo planes): the one-plane kernels give every logit the
 * value of the three-plane ones (equal as floats: only a zero's sign may differ), for both x
 * dtypes, the tile shapes of 1..2047 tokens and a k tail. */
static void test_route_logits_one_plane(void **state)
{
    static const int shapes[][2] = {{128, 2048}, {8, 4096}, {60, 200}, {256, 7168}};
    static const int64_t counts[] = {1, 16, 33, 700, 2047};
    size_t s, c;
    int f32;
    (void)state;
    for (s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
        for (f32 = 0; f32 < 2; f32++)
            for (c = 0; c < sizeof(counts) / sizeof(counts[0]); c++) {
                const int E = shapes[s][0], H = shapes[s][1];
                const int64_t T = counts[c];
                const moe_dtype_t xt = f32 ? MOE_DTYPE_F32 : MOE_DTYPE_BF16;
                const size_t n = (size_t)E * H;
                float *xf = malloc(sizeof(float) * (size_t)T * H), *w = malloc(sizeof(float) * n);
                float *three = malloc(sizeof(float) * (size_t)T * E);
                float *one = malloc(sizeof(float) * (size_t)T * E);
                uint16_t *xb = malloc(2 * (size_t)T * H), *planes = malloc(3 * 2 * n), *d_split;
                float *d_l = gt_dalloc(sizeof(float) * (size_t)T * E);
                void *d_x;
                size_t i;
                gt_fill_bf16(xf, xb, (size_t)T * H, 1.0f);
                for (i = 0; f32 && i < (size_t)T * H; i++)
                    xf[i] *= 1.0f + 0.3f * gt_uniform();
                for (i = 0; i < n; i++) /* exact in bf16 */
                    w[i] = moe_bf16_to_f32(moe_f32_to_bf16(gt_uniform() / sqrtf((float)H)));
                moe_split_bf16x3(w, planes, planes + n, planes + 2 * n, n);
                for (i = n; i < 3 * n; i++)
                    assert_int_equal(planes[i], 0);
                d_split = gt_dup(planes, 3 * 2 * n);
                d_x = f32 ? gt_dup(xf, 4 * (size_t)T * H) : gt_dup(xb, 2 * (size_t)T * H);
                tc_logits_planes(d_x, xt, d_split, d_l, 0, T, E, H, 3, three);
                tc_logits_planes(d_x, xt, d_split, d_l, 0, T, E, H, 1, one);
                for (i = 0; i < (size_t)T * E; i++)
                    if (!(one[i] == three[i])) {
                        fprintf(stderr, "E%d H%d %s T%lld: logit %zu: one plane %.9g, three %.9g\n",
                                E, H, moe_dtype_name(xt), (long long)T, i, (double)one[i],
                                (double)three[i]);
                        fail();
                    }
                free(xf), free(w), free(three), free(one), free(xb), free(planes);
                moe_gpu_free(d_split), moe_gpu_free(d_l), moe_gpu_free(d_x);
            }
}

/* The tensor-core logits of a token are bitwise the same whatever the batch around it: the
 * launcher picks other tiles at other token counts, but never another order of summation. */
static void test_route_logits_batch_invariant(void **state)
{
    static const int shapes[][2] = {{128, 2048}, {8, 4096}, {32, 7168}, {60, 200}};
    static const int64_t counts[] = {1, 5, 16, 100, 700, 2047};
    const int64_t T = 4096;
    size_t s, c;
    int f32;
    (void)state;
    for (s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
        for (f32 = 0; f32 < 2; f32++) {
            const int E = shapes[s][0], H = shapes[s][1];
            const moe_dtype_t xt = f32 ? MOE_DTYPE_F32 : MOE_DTYPE_BF16;
            float *xf = malloc(sizeof(float) * (size_t)T * H), *w;
            float *full = malloc(sizeof(float) * (size_t)T * E);
            float *part = malloc(sizeof(float) * (size_t)T * E);
            uint16_t *xb = malloc(2 * (size_t)T * H), *d_split;
            float *d_l = gt_dalloc(sizeof(float) * (size_t)T * E);
            void *d_x;
            int64_t i;
            gt_fill_bf16(xf, xb, (size_t)T * H, 1.0f);
            for (i = 0; f32 && i < T * H; i++) /* f32 values with all 24 bits in use */
                xf[i] *= 1.0f + 0.3f * gt_uniform();
            w = router_weights(E, H, &d_split);
            d_x = f32 ? gt_dup(xf, 4 * (size_t)T * H) : gt_dup(xb, 2 * (size_t)T * H);
            tc_logits(d_x, xt, d_split, d_l, 0, T, E, H, full);
            for (c = 0; c < sizeof(counts) / sizeof(counts[0]); c++) {
                const int64_t n = counts[c], first = T - n; /* a batch ending at the last token */
                tc_logits(d_x, xt, d_split, d_l, first, n, E, H, part);
                for (i = 0; i < n * E; i++)
                    if (memcmp(&part[i], &full[(size_t)first * E + i], sizeof(float)) != 0) {
                        fprintf(stderr,
                                "E%d H%d %s: token %lld: %.9g in a batch of %lld, %.9g in %lld\n",
                                E, H, moe_dtype_name(xt), (long long)(first + i / E),
                                (double)part[i], (long long)n, (double)full[(size_t)first * E + i],
                                (long long)T);
                        fail();
                    }
            }
            free(xf), free(xb), free(w), free(full), free(part);
            moe_gpu_free(d_x), moe_gpu_free(d_l), moe_gpu_free(d_split);
        }
}

static void test_route_rejects(void **state)
{
    moe_route_args_t a;
    (void)state;
    memset(&a, 0, sizeof(a));
    a.params.num_experts = 1024;
    a.params.top_k = 8;
    a.num_tokens = 1;
    assert_int_equal(moe_route_launch(&a, NULL), MOE_STATUS_NOT_SUPPORTED);
    a.params.num_experts = 64;
    a.params.top_k = 17;
    assert_int_equal(moe_route_launch(&a, NULL), MOE_STATUS_NOT_SUPPORTED);
    a.params.top_k = 65;
    assert_int_equal(moe_route_launch(&a, NULL), MOE_STATUS_INVALID_ARGUMENT);
}

/* The one-launch route + slot ids + permute of a small step against the three launches it
 * replaces, every output bitwise (the same top-k code; the slots and layout by the same rule):
 * every routing case, replicas of two experts taken in turn (rank 1, first token 3), the
 * expert loads counted, token counts 0 .. MOE_ROUTE_PERMUTE_MAX_TOKENS, several block sizes. */
enum { RP_OUT = 9 };
static void route_permute_run(const route_case_t *c, int64_t T, int br, const float *d_logits,
                              const float *d_bias, const int32_t *d_rb, const int32_t *d_rs,
                              int slots, int fused, void *out[RP_OUT], const size_t bytes[RP_OUT])
{
    const int K = c->p.top_k;
    const int mb = (int)moe_permute_max_blocks(T * K, slots, br);
    for (int i = 0; i < RP_OUT; i++) {
        out[i] = gt_dalloc(bytes[i]);
        gt_poison(out[i], GT_POISON_INT, bytes[i]);
    }
    gt_ok(moe_gpu_memset(out[8], 0, bytes[8]), "zero loads");
    moe_route_permute_args_t a;
    memset(&a, 0, sizeof(a));
    a.route = (moe_route_args_t){c->p, d_logits, d_bias, out[0], out[1], T};
    /* the separate launch counts the loads per CTA (num_experts given), the fused one per pair */
    a.slots = (moe_ep_slot_ids_args_t){out[0], out[2], T * K,           K, 3, 1, d_rb, d_rs,
                                       out[8], 0,      c->p.num_experts};
    a.permute = (moe_permute_args_t){out[2], T,      K,      slots,  br,     mb,
                                     out[3], out[4], out[5], out[6], out[7], NULL};
    /* slot_of_row comes last in the layout outputs: its own buffer */
    a.permute.slot_of_row = (int32_t *)out[7] + bytes[7] / sizeof(int32_t) / 2;
    a.permute.row_of_slot = out[7];
    if (fused) {
        gt_ok(moe_route_permute_launch(&a, NULL), c->name);
    } else {
        gt_ok(moe_route_launch(&a.route, NULL), c->name);
        a.slots.pdl = (int)(T % 2); /* the one-GPU step's launch at odd token counts */
        gt_ok(moe_ep_slot_ids_launch(&a.slots, NULL), c->name);
        gt_ok(moe_permute_launch(&a.permute, NULL), c->name);
    }
    gt_ok(moe_gpu_device_synchronize(), c->name);
}

static void test_route_permute(void **state)
{
    static const int64_t counts[] = {0, 1, 2, 5, 8, 13, 31, MOE_ROUTE_PERMUTE_MAX_TOKENS};
    static const int brs[] = {8, 16, 64, 128};
    (void)state;
    for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
        const int E = cases[c].p.num_experts, K = cases[c].p.top_k;
        /* experts 0 and E - 1 get a second slot (the last slots) */
        const int extra = E > 1 ? 2 : 0, slots = E + extra;
        int32_t *rb = malloc(sizeof(int32_t) * (size_t)(E + 1)),
                *rs = malloc(sizeof(int32_t) * (size_t)slots);
        int n = 0;
        for (int e = 0; e < E; e++) {
            rb[e] = n;
            rs[n++] = e;
            if (extra && (e == 0 || e == E - 1))
                rs[n++] = e == 0 ? E : E + 1;
        }
        rb[E] = n;
        int32_t *d_rb = gt_dup(rb, sizeof(int32_t) * (size_t)(E + 1));
        int32_t *d_rs = gt_dup(rs, sizeof(int32_t) * (size_t)slots);
        float *bias = malloc(sizeof(float) * (size_t)E);
        for (int e = 0; e < E; e++)
            bias[e] = 0.5f * (float)gt_below(2);
        float *d_bias = gt_dup(bias, sizeof(float) * (size_t)E);
        for (size_t t = 0; t < sizeof(counts) / sizeof(counts[0]); t++) {
            const int64_t T = counts[t];
            const int br = brs[(c + t) % 4];
            const size_t nk = (size_t)T * K;
            const int mb = (int)moe_permute_max_blocks(T * K, slots, br);
            float *logits = malloc(sizeof(float) * (size_t)(T * E + 1));
            for (int64_t i = 0; i < T * E; i++)
                logits[i] = (float)gt_below(257) / 32.0f - 4.0f;
            float *d_logits = gt_dup(logits, sizeof(float) * (size_t)(T * E + 1));
            const size_t bytes[RP_OUT] = {4 * (nk + 1),
                                          4 * (nk + 1),
                                          4 * (nk + 1),
                                          4 * (size_t)slots,
                                          4 * (size_t)(slots + 1),
                                          4 * (size_t)mb,
                                          4,
                                          4 * 2 *
                                              (nk + (size_t)mb * br > 0 ? nk + (size_t)mb * br : 1),
                                          sizeof(unsigned long long) * (size_t)E};
            void *sep[RP_OUT], *fus[RP_OUT];
            route_permute_run(&cases[c], T, br, d_logits, d_bias, d_rb, d_rs, slots, 0, sep, bytes);
            route_permute_run(&cases[c], T, br, d_logits, d_bias, d_rb, d_rs, slots, 1, fus, bytes);
            for (int i = 0; i < RP_OUT; i++) {
                uint8_t *x = malloc(bytes[i]), *y = malloc(bytes[i]);
                gt_get(x, sep[i], bytes[i]);
                gt_get(y, fus[i], bytes[i]);
                if (memcmp(x, y, bytes[i])) {
                    fprintf(stderr, "%s T=%lld br=%d: output %d differs\n", cases[c].name,
                            (long long)T, br, i);
                    fail();
                }
                free(x), free(y);
                moe_gpu_free(sep[i]), moe_gpu_free(fus[i]);
            }
            free(logits);
            moe_gpu_free(d_logits);
        }
        free(rb), free(rs), free(bias);
        moe_gpu_free(d_rb), moe_gpu_free(d_rs), moe_gpu_free(d_bias);
    }
}

/* Arguments that do not chain the three steps, or too many tokens, are refused by name. */
static void test_route_permute_rejects(void **state)
{
    moe_route_permute_args_t a;
    int32_t *d = gt_dalloc(4096);
    (void)state;
    memset(&a, 0, sizeof(a));
    a.route.params = cases[1].p;
    a.route.num_tokens = MOE_ROUTE_PERMUTE_MAX_TOKENS + 1;
    a.route.topk_ids = d;
    a.slots.in = d;
    a.slots.out = d + 512;
    a.slots.top_k = 8;
    a.slots.n = a.route.num_tokens * 8;
    a.permute = (moe_permute_args_t){d + 512, a.route.num_tokens, 8, 128, 16, 1024};
    assert_int_equal(moe_route_permute_launch(&a, NULL), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "num_tokens = 65"));
    a.route.num_tokens = a.permute.num_tokens = 8;
    a.slots.n = 64;
    a.slots.out = d + 1024; /* not the permute's ids */
    assert_int_equal(moe_route_permute_launch(&a, NULL), MOE_STATUS_INVALID_ARGUMENT);
    assert_non_null(strstr(moe_last_error(), "do not chain"));
    moe_gpu_free(d);
}

/* The slot ids of a step with more pairs than one CTA takes (the expert loads counted per CTA in
 * shared memory, then added once per expert) against the same launch without the expert count
 * (a global atomic per pair) and a count on the host: slots and loads bitwise, ids of no expert
 * (-1) and replicas of two experts included, 128 and 32 logical experts. */
static void test_slot_loads_per_cta(void **state)
{
    static const int64_t sizes[] = {1025, 3000, 65536};
    static const int experts[] = {128, 32};
    (void)state;
    for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++)
        for (size_t ei = 0; ei < sizeof(experts) / sizeof(experts[0]); ei++) {
            const int64_t n = sizes[si];
            const int E = experts[ei], K = 8, slots = E + 2;
            int32_t *ids = malloc(sizeof(int32_t) * (size_t)n), rb[129], rs[130];
            unsigned long long *want = calloc((size_t)E, sizeof(unsigned long long)),
                               *got = malloc(sizeof(unsigned long long) * (size_t)E),
                               *got0 = malloc(sizeof(unsigned long long) * (size_t)E);
            int32_t *o1 = malloc(sizeof(int32_t) * (size_t)n),
                    *o0 = malloc(sizeof(int32_t) * (size_t)n);
            int m = 0;
            for (int e = 0; e < E; e++) { /* experts 0 and 1 have a second slot */
                rb[e] = m;
                rs[m++] = e;
                if (e < 2)
                    rs[m++] = E + e;
            }
            rb[E] = m;
            for (int64_t i = 0; i < n; i++) {
                /* a skewed choice (expert 0 and 1 often), some pairs of no expert */
                const int r = (int)gt_below(4 * E);
                ids[i] = r < 8 ? -1 : r < E ? r % 2 : r % E;
                if (ids[i] >= 0)
                    want[ids[i]]++;
            }
            int32_t *d_ids = gt_dup(ids, sizeof(int32_t) * (size_t)n);
            int32_t *d_rb = gt_dup(rb, sizeof(int32_t) * (size_t)(E + 1));
            int32_t *d_rs = gt_dup(rs, sizeof(int32_t) * (size_t)slots);
            int32_t *d_out = gt_dalloc(sizeof(int32_t) * (size_t)n);
            unsigned long long *d_load = gt_dalloc(sizeof(unsigned long long) * (size_t)E);
            for (int hist = 1; hist >= 0; hist--) {
                moe_ep_slot_ids_args_t a = {d_ids, d_out, n,      K, 5,           1,
                                            d_rb,  d_rs,  d_load, 1, hist ? E : 0};
                gt_poison(d_out, GT_POISON_INT, sizeof(int32_t) * (size_t)n);
                gt_ok(moe_gpu_memset(d_load, 0, sizeof(unsigned long long) * (size_t)E), "zero");
                gt_ok(moe_ep_slot_ids_launch(&a, NULL), "slot ids");
                gt_ok(moe_gpu_device_synchronize(), "slot ids");
                gt_get(hist ? o1 : o0, d_out, sizeof(int32_t) * (size_t)n);
                gt_get(hist ? got : got0, d_load, sizeof(unsigned long long) * (size_t)E);
            }
            assert_memory_equal(o1, o0, sizeof(int32_t) * (size_t)n);
            assert_memory_equal(got, want, sizeof(unsigned long long) * (size_t)E);
            assert_memory_equal(got0, want, sizeof(unsigned long long) * (size_t)E);
            for (int64_t i = 0; i < n; i++) /* the slot rule, spot-checked on the host */
                if (ids[i] < 2)
                    assert_int_equal(o1[i], ids[i] < 0            ? -1
                                            : (5 + i / K + 1) % 2 ? E + ids[i]
                                                                  : ids[i]);
                else
                    assert_int_equal(o1[i], ids[i]);
            moe_gpu_free(d_ids), moe_gpu_free(d_rb), moe_gpu_free(d_rs);
            moe_gpu_free(d_out), moe_gpu_free(d_load);
            free(ids), free(want), free(got), free(got0), free(o1), free(o0);
        }
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_route_random),       cmocka_unit_test(test_route_ties),
    cmocka_unit_test(test_route_logits),       cmocka_unit_test(test_route_logits_batch_invariant),
    cmocka_unit_test(test_route_rejects),      cmocka_unit_test(test_route_logits_one_plane),
    cmocka_unit_test(test_route_permute),      cmocka_unit_test(test_route_permute_rejects),
    cmocka_unit_test(test_slot_loads_per_cta),
};

GT_MAIN(tests)
