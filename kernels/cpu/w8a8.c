/* SPDX-License-Identifier: Apache-2.0 */
/* CPU reference FP8 W8A8 arithmetic: activation quantisation, e4m3 x e4m3 products with f32
 * accumulation and the expert MLP built on them (the oracle for GPU W8A8 kernels). */
#include <math.h>
#include <stdlib.h>

#include "kernels/cpu/moe_cpu.h"
#include "base/numeric.h"
#include "base/diag.h"

#define W8A8_BLOCK 128

int64_t moe_cpu_w8a8_group(const moe_cpu_matrix_t *m)
{
    return m->scale_kind == MOE_SCALE_BLOCK_128 ? W8A8_BLOCK : 0;
}

static int64_t num_groups(int64_t k, int64_t group)
{
    return group > 0 ? (k + group - 1) / group : 1;
}

void moe_cpu_fp8_quantize_rows(const float *x, int64_t n, int64_t k, int64_t group,
                               float static_scale, uint8_t *q, float *scale)
{
    const int64_t ng = num_groups(k, group), gw = group > 0 ? group : k;
    int64_t i, g, c;

    for (i = 0; i < n; i++)
        for (g = 0; g < ng; g++) {
            const int64_t c0 = g * gw, c1 = c0 + gw < k ? c0 + gw : k;
            const float *xr = x + i * k;
            float s = static_scale;
            if (!(s > 0.0f)) {
                float amax = 0.0f;
                for (c = c0; c < c1; c++) /* NaN never wins the comparison: it is skipped */
                    amax = fabsf(xr[c]) > amax ? fabsf(xr[c]) : amax;
                s = moe_fp8_dynamic_scale(amax);
            }
            scale[i * ng + g] = s;
            for (c = c0; c < c1; c++)
                q[i * k + c] = moe_fp8e4m3_quantize(xr[c], s);
        }
}

/* The scale of weight element row r, K block b (b = 0 for the kinds without blocks). */
static float weight_scale(const moe_cpu_matrix_t *m, int64_t r, int64_t b)
{
    if (m->scale_kind == MOE_SCALE_BLOCK_128)
        return m->scale[(r / W8A8_BLOCK) * num_groups(m->cols, W8A8_BLOCK) + b];
    if (m->scale_kind == MOE_SCALE_PER_CHANNEL)
        return m->scale[r];
    return m->scale[0];
}

typedef struct w8a8_ctx {
    const float *a, *sa; /* the codes as f32, [n, K]; the activation scales */
    int64_t n, K, group, ng, gw;
    const moe_cpu_matrix_t *m;
    float *y;
} w8a8_ctx_t;

/* Tokens i0 .. i0 + cnt - 1 (cnt MOE_CPU_DOT_ROWS or 1) against weight row r (codes w) with
 * block scales: per K block each token's partial sum, scaled and added to its f32 result in
 * block order (the promotion DeepGEMM does). */
static void w8a8_block_tokens(const w8a8_ctx_t *c, int64_t i0, int cnt, int64_t r, const float *w)
{
    const moe_cpu_matrix_t *m = c->m;
    const int64_t K = c->K;
    float acc[MOE_CPU_DOT_ROWS] = {0}, part[MOE_CPU_DOT_ROWS];
    for (int64_t b = 0; b < c->ng; b++) {
        const int64_t c0 = b * c->gw, len = c0 + c->gw < K ? c->gw : K - c0;
        const float ws = weight_scale(m, r, b);
        if (cnt == MOE_CPU_DOT_ROWS)
            moe_cpu_dot_rows(c->a + i0 * K + c0, K, w + c0, len, part);
        else
            part[0] = moe_cpu_dot(c->a + i0 * K + c0, w + c0, len);
        for (int t = 0; t < cnt; t++)
            acc[t] += (c->sa[(i0 + t) * c->ng + b] * ws) * part[t];
    }
    for (int t = 0; t < cnt; t++)
        c->y[(i0 + t) * m->rows + r] = acc[t];
}

/* Weight rows r0 .. r1 - 1 for every token, a token block at a time (moe_cpu_token_block);
 * w: one row's codes as f32 */
static void w8a8_rows(void *arg, int64_t r0, int64_t r1, float *w)
{
    const w8a8_ctx_t *c = arg;
    const moe_cpu_matrix_t *m = c->m;
    const int64_t K = c->K, tb = moe_cpu_token_block(K);
    for (int64_t i0 = 0; i0 < c->n; i0 += tb) {
        const int64_t i1 = c->n - i0 < tb ? c->n : i0 + tb;
        for (int64_t r = r0; r < r1; r++) {
            moe_convert_to_f32(MOE_DTYPE_FP8_E4M3, (const uint8_t *)m->data + r * K, w, (size_t)K);
            if (c->group == 0) {
                /* the sums, then y = s_a * (s_w * sum) in place */
                float *y = c->y + r;
                const float ws = weight_scale(m, r, 0);
                moe_cpu_dots(c->a + i0 * K, K, i1 - i0, w, K, y + i0 * m->rows, m->rows);
                for (int64_t i = i0; i < i1; i++)
                    y[i * m->rows] = c->sa[i] * (ws * y[i * m->rows]);
                continue;
            }
            int64_t i = i0;
            for (; i + MOE_CPU_DOT_ROWS <= i1; i += MOE_CPU_DOT_ROWS)
                w8a8_block_tokens(c, i, MOE_CPU_DOT_ROWS, r, w);
            for (; i < i1; i++)
                w8a8_block_tokens(c, i, 1, r, w);
        }
    }
}

moe_status_t moe_cpu_matmul_w8a8(const uint8_t *qa, const float *sa, int64_t n,
                                 const moe_cpu_matrix_t *m, float *y)
{
    const int64_t K = m->cols, group = moe_cpu_w8a8_group(m), ng = num_groups(K, group);
    w8a8_ctx_t c;
    float *a = NULL;
    moe_status_t st;

    if (n == 0 || m->rows == 0)
        return MOE_STATUS_SUCCESS;
    if (m->dtype != MOE_DTYPE_FP8_E4M3 || !m->scale)
        return moe_error(MOE_STATUS_INTERNAL_ERROR, "w8a8 matmul: weights are %s, not FP8_E4M3",
                         moe_dtype_name(m->dtype));
    /* The e4m3 codes as f32 (exact): each product of two is exact in f32 too (4 x 4 bits of
     * significand), so only the order of the sums rounds. */
    a = malloc(sizeof(float) * (size_t)(n * K + 1));
    if (!a)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "w8a8 matmul: %lld x %lld floats", (long long)n,
                         (long long)K);
    moe_convert_to_f32(MOE_DTYPE_FP8_E4M3, qa, a, (size_t)(n * K));
    c.a = a;
    c.sa = sa;
    c.n = n;
    c.K = K;
    c.group = group;
    c.ng = ng;
    c.gw = group > 0 ? group : K;
    c.m = m;
    c.y = y;
    st = moe_cpu_for_rows(m->rows, (double)m->rows * (double)n * (double)K, (size_t)(K + 1),
                          w8a8_rows, &c, "w8a8 matmul");
    free(a);
    return st;
}

/* Quantises x[n, k] for a product with `m`; `round_bf16`: x is rounded to bf16 first (the
 * token rows, as the GPU gathers them). */
static moe_status_t quantize_for(const moe_cpu_matrix_t *m, const float *x, int64_t n, int64_t k,
                                 float static_scale, int round_bf16, uint8_t **q, float **s)
{
    const int64_t ng = num_groups(k, moe_cpu_w8a8_group(m));
    float *xb = NULL;
    int64_t i;

    *q = malloc((size_t)(n * k + 1));
    *s = malloc(sizeof(float) * (size_t)(n * ng + 1));
    if (round_bf16)
        xb = malloc(sizeof(float) * (size_t)(n * k + 1));
    if (!*q || !*s || (round_bf16 && !xb)) {
        free(xb);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "w8a8 activations: %lld x %lld", (long long)n,
                         (long long)k);
    }
    if (round_bf16) {
        for (i = 0; i < n * k; i++)
            xb[i] = moe_bf16_to_f32(moe_f32_to_bf16(x[i]));
        x = xb;
    }
    moe_cpu_fp8_quantize_rows(x, n, k, moe_cpu_w8a8_group(m), static_scale, *q, *s);
    free(xb);
    return MOE_STATUS_SUCCESS;
}

/* The static input scale of gate and up together: the larger of the two when both have one
 * (one quantisation feeds both products, as a fused gate_up kernel does), else 0 (dynamic). */
static float gate_up_static_scale(const moe_cpu_mlp_t *w)
{
    if (w->gate.scale_kind != MOE_SCALE_PER_TENSOR)
        return 0.0f;
    return moe_fp8_pair_static_scale(w->input_scale[0], w->input_scale[1]);
}

static float down_static_scale(const moe_cpu_mlp_t *w)
{
    const float d = w->input_scale[2];
    return w->down.scale_kind == MOE_SCALE_PER_TENSOR && d > 0.0f ? d : 0.0f;
}

moe_status_t moe_cpu_mlp_w8a8(const moe_cpu_mlp_t *w, moe_activation_t act, const float *x,
                              int64_t n, float *out)
{
    const int64_t is = w->gate.rows, H = w->gate.cols;
    float *g = NULL, *u = NULL, *sa = NULL;
    uint8_t *qa = NULL;
    moe_status_t st;

    if (n == 0)
        return MOE_STATUS_SUCCESS;
    MOE_CHECK_GOTO(moe_cpu_mlp_buffers(n, is, "cpu w8a8 mlp", &g, &u), st, out);
    MOE_CHECK_GOTO(quantize_for(&w->gate, x, n, H, gate_up_static_scale(w), 1, &qa, &sa), st, out);
    MOE_CHECK_GOTO(moe_cpu_matmul_w8a8(qa, sa, n, &w->gate, g), st, out);
    MOE_CHECK_GOTO(moe_cpu_matmul_w8a8(qa, sa, n, &w->up, u), st, out);
    free(qa);
    free(sa);
    qa = NULL;
    sa = NULL;
    moe_cpu_act_mul(act, g, u, g, n * is);
    /* h as the GPU holds it between its GEMMs: bf16 */
    MOE_CHECK_GOTO(quantize_for(&w->down, g, n, is, down_static_scale(w), 1, &qa, &sa), st, out);
    st = moe_cpu_matmul_w8a8(qa, sa, n, &w->down, out);
out:
    free(g);
    free(u);
    free(qa);
    free(sa);
    return st;
}
