/* SPDX-License-Identifier: Apache-2.0 */
/* CPU reference: weight matrix rows in f32 and x . W^T with f32 accumulation. */
#include "kernels/cpu/moe_cpu.h"

#include <stdlib.h>
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

typedef struct matmul_ctx {
    const float *x;
    int64_t n;
    const moe_cpu_matrix_t *m;
    float *y;
} matmul_ctx_t;

/* Weight rows outer: each row is converted once and used for every token. */
static void matmul_rows(void *arg, int64_t r0, int64_t r1, float *row)
{
    const matmul_ctx_t *c = arg;
    const moe_cpu_matrix_t *m = c->m;
    for (int64_t r = r0; r < r1; r++) {
        moe_cpu_matrix_row(m, r, row);
        for (int64_t i = 0; i < c->n; i++)
            c->y[i * m->rows + r] = moe_cpu_dot(c->x + i * m->cols, row, m->cols);
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
