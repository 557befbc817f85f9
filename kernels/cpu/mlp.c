/* SPDX-License-Identifier: Apache-2.0 */
/* CPU reference expert MLP with a fixed reduction tree, and row grouping by expert. */
#include "kernels/cpu/moe_cpu.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "base/diag.h"

void moe_cpu_act_mul(moe_activation_t act, const float *gate, const float *up, float *h, int64_t n)
{
    int64_t i;
    for (i = 0; i < n; i++) {
        const float g = gate[i];
        float a;
        if (act == MOE_ACTIVATION_GELU) /* tanh approximation, as gelu_pytorch_tanh */
            a = 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
        else
            a = g / (1.0f + expf(-g));
        h[i] = a * up[i];
    }
}

/* Leaf l of the tree over an intermediate of size I starts at floor(l * I / LEAVES). */
static int64_t leaf_start(int64_t full, int l)
{
    return (full * l) / MOE_CPU_TREE_LEAVES;
}

/* The leaf range [l0, l1) whose bounds are exactly [s0, s1), if it is an aligned power-of-two
 * subtree; returns 0 otherwise. */
static int aligned_subtree(int64_t full, int64_t s0, int64_t s1, int *l0, int *l1)
{
    int width, a;
    /* Largest first: with fewer than LEAVES columns some leaves are empty, and the largest
     * aligned block with these bounds is the one a TP split of that many ranks holds. */
    for (width = MOE_CPU_TREE_LEAVES; width >= 1; width /= 2) {
        for (a = 0; a + width <= MOE_CPU_TREE_LEAVES; a += width) {
            if (leaf_start(full, a) == s0 && leaf_start(full, a + width) == s1) {
                *l0 = a;
                *l1 = a + width;
                return 1;
            }
        }
    }
    return 0;
}

/* Pairwise in-place reduction of v[0..n), n a power of two: ((v0+v1)+(v2+v3))... */
static float pairwise(float *v, int n)
{
    int w, j;
    for (w = 1; w < n; w *= 2)
        for (j = 0; j + w < n; j += 2 * w)
            v[j] += v[j + w];
    return v[0];
}

/* pairwise() on MOE_CPU_DOT_ROWS trees side by side (v[l][t]: tree t's leaf l), each summed
 * in pairwise()'s order */
static void pairwise4(float (*v)[MOE_CPU_DOT_ROWS], int n)
{
    for (int w = 1; w < n; w *= 2)
        for (int j = 0; j + w < n; j += 2 * w)
            for (int t = 0; t < MOE_CPU_DOT_ROWS; t++)
                v[j][t] += v[j + w][t];
}

typedef struct down_ctx {
    const moe_cpu_mlp_t *w;
    const float *h;
    int64_t n;
    int l0, l1; /* the slice's leaves of the full reduction tree */
    float *out;
} down_ctx_t;

/* Down-projection rows r0 .. r1 - 1, a token block at a time: each leaf's dot, then the leaves'
 * pairwise sum */
static void down_rows(void *arg, int64_t r0, int64_t r1, float *row)
{
    const down_ctx_t *c = arg;
    const moe_cpu_matrix_t *m = &c->w->down;
    const int64_t is = m->cols, s0 = c->w->slice_begin, full = c->w->full_intermediate;
    const int64_t tb = moe_cpu_token_block(is);
    const int nl = c->l1 - c->l0;
    float leaves[MOE_CPU_TREE_LEAVES], lv4[MOE_CPU_TREE_LEAVES][MOE_CPU_DOT_ROWS];
    int64_t lc[MOE_CPU_TREE_LEAVES + 1]; /* leaf l0 + j's columns: lc[j] .. lc[j + 1] - 1 */
    for (int l = c->l0; l <= c->l1; l++)
        lc[l - c->l0] = leaf_start(full, l) - s0;
    for (int64_t i0 = 0; i0 < c->n; i0 += tb) {
        const int64_t i1 = c->n - i0 < tb ? c->n : i0 + tb;
        for (int64_t r = r0; r < r1; r++) {
            moe_cpu_matrix_row(m, r, row);
            int64_t i = i0;
            /* MOE_CPU_DOT_ROWS tokens' leaves at a time (lv4[l][t]), then one at a time */
            for (; i + MOE_CPU_DOT_ROWS <= i1; i += MOE_CPU_DOT_ROWS) {
                for (int l = 0; l < nl; l++)
                    moe_cpu_dot_rows(c->h + i * is + lc[l], is, row + lc[l], lc[l + 1] - lc[l],
                                     lv4[l]);
                pairwise4(lv4, nl);
                for (int t = 0; t < MOE_CPU_DOT_ROWS; t++)
                    c->out[(i + t) * m->rows + r] = lv4[0][t];
            }
            for (; i < i1; i++) {
                const float *hi = c->h + i * is;
                for (int l = 0; l < nl; l++)
                    leaves[l] = moe_cpu_dot(hi + lc[l], row + lc[l], lc[l + 1] - lc[l]);
                c->out[i * m->rows + r] = pairwise(leaves, nl);
            }
        }
    }
}

static moe_status_t down_proj(const moe_cpu_mlp_t *w, const float *h, int64_t n, float *out)
{
    const moe_cpu_matrix_t *m = &w->down;
    const int64_t is = m->cols, s0 = w->slice_begin;
    down_ctx_t c = {w, h, n, 0, 0, out};

    if (!aligned_subtree(w->full_intermediate, s0, s0 + is, &c.l0, &c.l1))
        return moe_cpu_matmul_nt(h, n, m, out);
    if (n == 0 || m->rows == 0)
        return MOE_STATUS_SUCCESS;
    return moe_cpu_for_rows(m->rows, (double)m->rows * (double)n * (double)is,
                            (size_t)(is > 0 ? is : 1), down_rows, &c, "cpu down projection");
}

moe_status_t moe_cpu_mlp_buffers(int64_t n, int64_t is, const char *what, float **g, float **u)
{
    *g = malloc(sizeof(float) * (size_t)(n * (is > 0 ? is : 1)));
    *u = malloc(sizeof(float) * (size_t)(n * (is > 0 ? is : 1)));
    if (!*g || !*u)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: %lld x %lld floats", what, (long long)n,
                         (long long)is);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cpu_mlp(const moe_cpu_mlp_t *w, moe_activation_t act, const float *x, int64_t n,
                         float *out)
{
    const int64_t is = w->gate.rows;
    float *g = NULL, *u = NULL;
    moe_status_t st;

    if (n == 0)
        return MOE_STATUS_SUCCESS;
    MOE_CHECK_GOTO(moe_cpu_mlp_buffers(n, is, "cpu mlp", &g, &u), st, out);
    MOE_CHECK_GOTO(moe_cpu_matmul_nt(x, n, &w->gate, g), st, out);
    MOE_CHECK_GOTO(moe_cpu_matmul_nt(x, n, &w->up, u), st, out);
    moe_cpu_act_mul(act, g, u, g, n * is);
    st = down_proj(w, g, n, out);
out:
    free(g);
    free(u);
    return st;
}

static float tree_elem(const float *const *parts, int lo, int hi, int64_t e)
{
    int mid;
    if (hi - lo == 1)
        return parts[lo][e];
    mid = lo + (hi - lo) / 2;
    return tree_elem(parts, lo, mid, e) + tree_elem(parts, mid, hi, e);
}

void moe_cpu_tree_sum(const float *const *parts, int count, int64_t n, float *out)
{
    int64_t e;
    int c;
    if (count <= 0) {
        memset(out, 0, sizeof(float) * (size_t)n);
        return;
    }
    if ((count & (count - 1)) == 0) {
        for (e = 0; e < n; e++)
            out[e] = tree_elem(parts, 0, count, e);
        return;
    }
    for (e = 0; e < n; e++) {
        float acc = parts[0][e];
        for (c = 1; c < count; c++)
            acc += parts[c][e];
        out[e] = acc;
    }
}

moe_status_t moe_cpu_group_rows(const int32_t *group_of_row, int64_t n, int num_groups,
                                int64_t *offsets, int64_t *order)
{
    int64_t i;
    int g;
    for (g = 0; g <= num_groups; g++)
        offsets[g] = 0;
    for (i = 0; i < n; i++) {
        if (group_of_row[i] < 0 || group_of_row[i] >= num_groups)
            return moe_error(MOE_STATUS_INTERNAL_ERROR, "row %lld has group %d of %d", (long long)i,
                             group_of_row[i], num_groups);
        offsets[group_of_row[i] + 1]++;
    }
    for (g = 0; g < num_groups; g++)
        offsets[g + 1] += offsets[g];
    {
        /* Stable placement: a running cursor per group, from a copy of the offsets. */
        int64_t *cur = malloc(sizeof(int64_t) * (size_t)(num_groups > 0 ? num_groups : 1));
        if (!cur)
            return moe_error(MOE_STATUS_OUT_OF_MEMORY, "group rows: %d groups", num_groups);
        memcpy(cur, offsets, sizeof(int64_t) * (size_t)num_groups);
        for (i = 0; i < n; i++)
            order[cur[group_of_row[i]]++] = i;
        free(cur);
    }
    return MOE_STATUS_SUCCESS;
}
