/* SPDX-License-Identifier: Apache-2.0 */
/* CPU reference: weight matrix rows in f32 and x . W^T with f32 accumulation. */
#include "kernels/cpu/moe_cpu.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include "base/numeric.h"

#define MOE_BLOCK 128

void moe_cpu_matrix_row(const moe_cpu_matrix_t *m, int64_t r, float *out)
{
    const int64_t cols = m->cols;
    int64_t c;

    switch (m->dtype) {
    case MOE_DTYPE_FP8_E4M3: {
        const uint8_t *row = (const uint8_t *)m->data + r * cols;
        const int64_t scale_cols = (cols + MOE_BLOCK - 1) / MOE_BLOCK;
        for (c = 0; c < cols; c++) {
            float s = 1.0f;
            if (m->scale_kind == MOE_SCALE_PER_TENSOR)
                s = m->scale[0];
            else if (m->scale_kind == MOE_SCALE_BLOCK_128)
                s = m->scale[(r / MOE_BLOCK) * scale_cols + c / MOE_BLOCK];
            else if (m->scale_kind == MOE_SCALE_PER_CHANNEL)
                s = m->scale[r];
            out[c] = moe_fp8e4m3_to_f32(row[c]) * s;
        }
        break;
    }
    default:
        moe_convert_to_f32(m->dtype,
                           (const char *)m->data + (size_t)(r * cols) * moe_dtype_size(m->dtype),
                           out, (size_t)cols);
        break;
    }
}

float moe_cpu_dot(const float *a, const float *b, int64_t n)
{
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}, s;
    int64_t i = 0;
    int j;
    for (; i + 8 <= n; i += 8)
        for (j = 0; j < 8; j++)
            acc[j] += a[i + j] * b[i + j];
    s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

#if defined(__GNUC__)
/* Four lanes of the eight partial sums in one vector (GCC and Clang vector extensions; the same
 * IEEE adds and multiplies lane by lane as moe_cpu_dot's loop) */
typedef float v4f __attribute__((vector_size(16)));

static inline v4f load4(const float *p)
{
    v4f v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* The tail k = i .. n - 1 of the rows' sums s (one row a lane): s[t] += a[t][k] * b[k] in k
 * order, as moe_cpu_dot's tail, the rows side by side (short products, e.g. the down
 * projection's tree leaves, are all tail) */
static inline void tail_rows(const float *a, int64_t lda, const float *b, int64_t i, int64_t n,
                             v4f s, float *out)
{
    static_assert(MOE_CPU_DOT_ROWS == 4, "one row a lane of v4f");
    for (int64_t k = i; k < n; k++) {
        const v4f ak = {a[k], a[lda + k], a[2 * lda + k], a[3 * lda + k]};
        s += ak * b[k];
    }
    memcpy(out, &s, sizeof(s));
}

void moe_cpu_dot_rows_portable(const float *a, int64_t lda, const float *b, int64_t n, float *out)
{
    v4f lo[MOE_CPU_DOT_ROWS], hi[MOE_CPU_DOT_ROWS];
    int64_t i = 0;
    for (int t = 0; t < MOE_CPU_DOT_ROWS; t++)
        lo[t] = hi[t] = (v4f){0.0f, 0.0f, 0.0f, 0.0f};
    for (; i + 8 <= n; i += 8) {
        const v4f b0 = load4(b + i), b1 = load4(b + i + 4);
        for (int t = 0; t < MOE_CPU_DOT_ROWS; t++) {
            lo[t] += load4(a + t * lda + i) * b0;
            hi[t] += load4(a + t * lda + i + 4) * b1;
        }
    }
    v4f s;
    for (int t = 0; t < MOE_CPU_DOT_ROWS; t++)
        s[t] = ((lo[t][0] + lo[t][1]) + (lo[t][2] + lo[t][3])) +
               ((hi[t][0] + hi[t][1]) + (hi[t][2] + hi[t][3]));
    tail_rows(a, lda, b, i, n, s, out);
}
#else
void moe_cpu_dot_rows_portable(const float *a, int64_t lda, const float *b, int64_t n, float *out)
{
    for (int t = 0; t < MOE_CPU_DOT_ROWS; t++)
        out[t] = moe_cpu_dot(a + t * lda, b, n);
}
#endif

#if defined(__GNUC__) && defined(__x86_64__)
/* All eight partial sums in one AVX vector: the same operations again, twice the width (AVX
 * has no fused multiply-add, and none is asked for) */
typedef float v8f __attribute__((vector_size(32)));

__attribute__((target("avx"))) static void dot_rows_avx(const float *a, int64_t lda, const float *b,
                                                        int64_t n, float *out)
{
    v8f acc[MOE_CPU_DOT_ROWS];
    int64_t i = 0;
    for (int t = 0; t < MOE_CPU_DOT_ROWS; t++)
        acc[t] = (v8f){0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (; i + 8 <= n; i += 8) {
        v8f bv, av;
        memcpy(&bv, b + i, sizeof(bv));
        for (int t = 0; t < MOE_CPU_DOT_ROWS; t++) {
            memcpy(&av, a + t * lda + i, sizeof(av));
            acc[t] += av * bv;
        }
    }
    v4f s;
    for (int t = 0; t < MOE_CPU_DOT_ROWS; t++)
        s[t] = ((acc[t][0] + acc[t][1]) + (acc[t][2] + acc[t][3])) +
               ((acc[t][4] + acc[t][5]) + (acc[t][6] + acc[t][7]));
    tail_rows(a, lda, b, i, n, s, out);
}

void moe_cpu_dot_rows(const float *a, int64_t lda, const float *b, int64_t n, float *out)
{
    if (n < 8) /* all tail: the sums start at +0, as the eight lanes' combined zeros */
        tail_rows(a, lda, b, 0, n, (v4f){0.0f, 0.0f, 0.0f, 0.0f}, out);
    else if (__builtin_cpu_supports("avx"))
        dot_rows_avx(a, lda, b, n, out);
    else
        moe_cpu_dot_rows_portable(a, lda, b, n, out);
}
#else
void moe_cpu_dot_rows(const float *a, int64_t lda, const float *b, int64_t n, float *out)
{
    moe_cpu_dot_rows_portable(a, lda, b, n, out);
}
#endif

int64_t moe_cpu_token_block(int64_t cols)
{
    const int64_t tb = (int64_t)65536 / (cols > 0 ? cols : 1) / MOE_CPU_DOT_ROWS * MOE_CPU_DOT_ROWS;
    return tb > 64 ? tb : 64;
}

void moe_cpu_dots(const float *a, int64_t lda, int64_t rows, const float *b, int64_t n, float *out,
                  int64_t out_stride)
{
    float d[MOE_CPU_DOT_ROWS];
    int64_t i = 0;
    for (; i + MOE_CPU_DOT_ROWS <= rows; i += MOE_CPU_DOT_ROWS) {
        moe_cpu_dot_rows(a + i * lda, lda, b, n, d);
        for (int t = 0; t < MOE_CPU_DOT_ROWS; t++)
            out[(i + t) * out_stride] = d[t];
    }
    for (; i < rows; i++)
        out[i * out_stride] = moe_cpu_dot(a + i * lda, b, n);
}

typedef struct matmul_ctx {
    const float *x;
    int64_t n;
    const moe_cpu_matrix_t *m;
    float *y;
} matmul_ctx_t;

/* Token blocks outer (moe_cpu_token_block), then weight rows: each row is converted once a
 * block and used for the block's tokens. */
static void matmul_rows(void *arg, int64_t r0, int64_t r1, float *row)
{
    const matmul_ctx_t *c = arg;
    const moe_cpu_matrix_t *m = c->m;
    const int64_t tb = moe_cpu_token_block(m->cols);
    for (int64_t i0 = 0; i0 < c->n; i0 += tb) {
        const int64_t cnt = c->n - i0 < tb ? c->n - i0 : tb;
        for (int64_t r = r0; r < r1; r++) {
            moe_cpu_matrix_row(m, r, row);
            moe_cpu_dots(c->x + i0 * m->cols, m->cols, cnt, row, m->cols, c->y + i0 * m->rows + r,
                         m->rows);
        }
    }
}

moe_status_t moe_cpu_matmul_nt(const float *x, int64_t n, const moe_cpu_matrix_t *m, float *y)
{
    matmul_ctx_t c = {x, n, m, y};
    if (n == 0 || m->rows == 0)
        return MOE_STATUS_SUCCESS;
    return moe_cpu_for_rows(m->rows, (double)m->rows * (double)n * (double)m->cols,
                            (size_t)(m->cols > 0 ? m->cols : 1), matmul_rows, &c, "cpu matmul");
}
