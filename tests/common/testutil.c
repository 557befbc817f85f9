/* SPDX-License-Identifier: Apache-2.0 */
/* Shared test helpers (see testutil.h). */
#include "testutil.h"

#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/numeric.h"
#include "launch/layer_gen.h"

double tu_rel_err(const float *a, const float *ref, int64_t n)
{
    double num = 0, den = 0;
    int64_t i;
    for (i = 0; i < n; i++) {
        double d = (double)a[i] - (double)ref[i];
        if (isnan(a[i]) || isnan(ref[i]))
            return INFINITY;
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

int64_t tu_count_nan(const float *a, int64_t n)
{
    int64_t i, c = 0;
    for (i = 0; i < n; i++)
        c += isnan(a[i]) ? 1 : 0;
    return c;
}

static uint64_t xorshift(uint64_t *s)
{
    uint64_t x = *s ? *s : 88172645463325252ULL;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

void tu_fill_uniform(float *v, int64_t n, float lo, float hi, uint64_t *state)
{
    int64_t i;
    for (i = 0; i < n; i++)
        v[i] = lo + (hi - lo) * (float)((xorshift(state) >> 40) * (1.0 / 16777216.0));
}

uint64_t tu_seed(const char *test)
{
    const char *env = getenv("MOE_TEST_SEED");
    /* Fixed per test (a hash of its name), so every run sees the same inputs; printed, and
     * MOE_TEST_SEED picks another. */
    uint64_t s = 1469598103934665603ULL;
    for (const char *c = test; *c; c++)
        s = (s ^ (unsigned char)*c) * 1099511628211ULL;
    if (env)
        s = strtoull(env, NULL, 0);
    int rank = 0, inited = 0;
    MPI_Initialized(&inited);
    if (inited) {
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        /* Every rank must use the same seed: the tests compare against global references. */
        MPI_Bcast(&s, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
    }
    if (rank == 0)
        fprintf(stderr, "[%s] seed 0x%llx (MOE_TEST_SEED to replay)\n", test,
                (unsigned long long)s);
    return s;
}

static int64_t share_weight(int r, int world)
{
    return (world > 1 && r == 1) ? 0 : r + 1;
}

void tu_uneven_share(int64_t Tg, int rank, int world, int64_t *t0, int64_t *n)
{
    int64_t acc = 0, tot = 0;
    int r;
    for (r = 0; r < world; r++) {
        if (r < rank)
            acc += share_weight(r, world);
        tot += share_weight(r, world);
    }
    *t0 = Tg * acc / tot;
    *n = Tg * (acc + share_weight(rank, world)) / tot - *t0;
}

moe_runtime_t *tu_runtime_cpu(void)
{
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    moe_runtime_t *rt = NULL;
    rc.backend = MOE_BACKEND_CPU;
    rc.timeout_ms = 60000;
    TU_OK(moe_runtime_create(&rc, NULL, &rt));
    return rt;
}

moe_runtime_t *tu_rt;

int tu_group_setup_cpu(void **state)
{
    (void)state;
    tu_rt = tu_runtime_cpu();
    return tu_rt ? 0 : -1;
}

int tu_group_teardown(void **state)
{
    (void)state;
    return moe_runtime_destroy(tu_rt) == MOE_STATUS_SUCCESS ? 0 : -1;
}

/* What the layer's storage does to a matrix: bf16 rounding or FP8 quantisation. */
static void as_stored(const moe_layer_config_t *cfg, float *m, int64_t rows, int64_t cols)
{
    int64_t i, n = rows * cols;
    if (cfg->weight_dtype == MOE_DTYPE_BF16) {
        for (i = 0; i < n; i++)
            m[i] = moe_bf16_to_f32(moe_f32_to_bf16(m[i]));
    } else if (cfg->weight_dtype == MOE_DTYPE_FP8_E4M3) {
        /* scale blocks of BR rows x BC cols: 128 x 128, 1 x cols (per channel) or all */
        const int64_t BR = cfg->scale_kind == MOE_SCALE_BLOCK_128     ? 128
                           : cfg->scale_kind == MOE_SCALE_PER_CHANNEL ? 1
                                                                      : rows;
        const int64_t BC = cfg->scale_kind == MOE_SCALE_BLOCK_128 ? 128 : cols;
        int64_t br, bc, r, c;
        for (br = 0; br < rows; br += BR)
            for (bc = 0; bc < cols; bc += BC) {
                float amax = 0, s;
                for (r = br; r < br + BR && r < rows; r++)
                    for (c = bc; c < bc + BC && c < cols; c++)
                        amax = fmaxf(amax, fabsf(m[r * cols + c]));
                s = amax > 0 ? amax / MOE_FP8_E4M3_MAX : 1.0f;
                for (r = br; r < br + BR && r < rows; r++)
                    for (c = bc; c < bc + BC && c < cols; c++)
                        m[r * cols + c] =
                            moe_fp8e4m3_to_f32(moe_f32_to_fp8e4m3(m[r * cols + c] / s)) * s;
            }
    }
}

static float *gen(const moe_layer_config_t *cfg, uint64_t seed, moe_weight_kind_t k, int e,
                  int64_t rows, int64_t cols, int stored)
{
    float *m = malloc(sizeof(float) * (size_t)(rows * cols + 1));
    assert_non_null(m);
    moe_gen_matrix(seed, k, e, 0, rows, 0, cols, cols, m);
    if (stored)
        as_stored(cfg, m, rows, cols);
    return m;
}

void tu_weights_make(const moe_layer_config_t *cfg, uint64_t seed, tu_weights_t *w)
{
    const int64_t E = cfg->num_experts, H = cfg->hidden, I = cfg->intermediate;
    int e;
    memset(w, 0, sizeof(*w));
    w->E = (int)E;
    w->H = (int)H;
    w->I = (int)I;
    w->S = cfg->num_shared_experts > 0
               ? (cfg->shared_intermediate ? cfg->shared_intermediate
                                           : cfg->num_shared_experts * cfg->intermediate)
               : 0;
    w->router = gen(cfg, seed, MOE_WEIGHT_ROUTER, -1, E, H, 0);
    if (cfg->use_score_bias)
        w->bias = gen(cfg, seed, MOE_WEIGHT_ROUTER_BIAS, -1, 1, E, 0);
    if (cfg->shared_expert_gate)
        w->sgate = gen(cfg, seed, MOE_WEIGHT_SHARED_EXPERT_GATE, -1, 1, H, 0);
    w->gate = malloc(sizeof(float) * (size_t)(E * I * H));
    w->up = malloc(sizeof(float) * (size_t)(E * I * H));
    w->down = malloc(sizeof(float) * (size_t)(E * I * H));
    assert_true(w->gate && w->up && w->down);
    for (e = 0; e < E; e++) {
        float *g = gen(cfg, seed, MOE_WEIGHT_GATE_PROJ, e, I, H, 1);
        float *u = gen(cfg, seed, MOE_WEIGHT_UP_PROJ, e, I, H, 1);
        float *d = gen(cfg, seed, MOE_WEIGHT_DOWN_PROJ, e, H, I, 1);
        memcpy(w->gate + e * I * H, g, sizeof(float) * (size_t)(I * H));
        memcpy(w->up + e * I * H, u, sizeof(float) * (size_t)(I * H));
        memcpy(w->down + e * I * H, d, sizeof(float) * (size_t)(I * H));
        free(g);
        free(u);
        free(d);
    }
    if (w->S > 0) {
        w->sg = gen(cfg, seed, MOE_WEIGHT_SHARED_GATE_PROJ, -1, w->S, H, 1);
        w->su = gen(cfg, seed, MOE_WEIGHT_SHARED_UP_PROJ, -1, w->S, H, 1);
        w->sd = gen(cfg, seed, MOE_WEIGHT_SHARED_DOWN_PROJ, -1, H, w->S, 1);
    }
}

void tu_weights_free(tu_weights_t *w)
{
    free(w->router);
    free(w->bias);
    free(w->sgate);
    free(w->gate);
    free(w->up);
    free(w->down);
    free(w->sg);
    free(w->su);
    free(w->sd);
}

static double act(moe_activation_t a, double g)
{
    if (a == MOE_ACTIVATION_GELU)
        return 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)));
    return g / (1.0 + exp(-g));
}

/* acc[H] += scale * W2 (act(W1 x) * W3 x) for one MLP of intermediate I. */
static void mlp(moe_activation_t a, const float *w1, const float *w3, const float *w2, int64_t I,
                int64_t H, const float *x, double scale, double *acc)
{
    double *h = malloc(sizeof(double) * (size_t)I);
    int64_t i, j;
    assert_non_null(h);
    for (i = 0; i < I; i++) {
        double g = 0, u = 0;
        for (j = 0; j < H; j++) {
            g += (double)w1[i * H + j] * x[j];
            u += (double)w3[i * H + j] * x[j];
        }
        h[i] = act(a, g) * u;
    }
    for (j = 0; j < H; j++) {
        double d = 0;
        for (i = 0; i < I; i++)
            d += (double)w2[j * I + i] * h[i];
        acc[j] += scale * d;
    }
    free(h);
}

void tu_naive_layer(const moe_layer_config_t *cfg, const tu_weights_t *w, const float *x, int64_t T,
                    const int32_t *ids, const float *topk_w, float *y)
{
    const int64_t H = w->H, I = w->I;
    double *acc = malloc(sizeof(double) * (size_t)H);
    int64_t t, j;
    assert_non_null(acc);
    for (t = 0; t < T; t++) {
        const float *xt = x + t * H;
        memset(acc, 0, sizeof(double) * (size_t)H);
        for (j = 0; j < cfg->top_k; j++) {
            int e = ids[t * cfg->top_k + j];
            mlp(cfg->activation, w->gate + e * I * H, w->up + e * I * H, w->down + e * I * H, I, H,
                xt, topk_w[t * cfg->top_k + j], acc);
        }
        if (w->S > 0) {
            double g = 1.0;
            if (w->sgate) {
                double d = 0;
                for (j = 0; j < H; j++)
                    d += (double)w->sgate[j] * xt[j];
                g = 1.0 / (1.0 + exp(-d));
            }
            mlp(cfg->activation, w->sg, w->su, w->sd, w->S, H, xt, g, acc);
        }
        for (j = 0; j < H; j++)
            y[t * H + j] = (float)acc[j];
    }
    free(acc);
}
