/* SPDX-License-Identifier: Apache-2.0 */
/* The weights' upload to the device (moe_layer_set_weight on a CUDA layer): f32 router (and
 * its bf16 split for the tensor cores), bf16 expert matrices, or e4m3 with per-row scales and
 * static activation scales (W8A8). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/diag.h"
#include "base/numeric.h"
#include "kernels/cpu/moe_cpu.h"
#include "kernels/gpu.h"
#include "runtime/cuda/one_gpu.h"

/* Copies a host f32 (or bf16) matrix as f32 to device memory. */
static moe_status_t store_f32(float *dst, const moe_matrix_t *m)
{
    const size_t n = (size_t)m->rows * (size_t)m->cols;
    float *tmp;
    moe_status_t st;
    if (m->dtype == MOE_DTYPE_F32)
        return moe_gpu_memcpy_h2d(dst, m->data, sizeof(float) * n);
    tmp = malloc(sizeof(float) * (n ? n : 1));
    if (!tmp)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "weight conversion: %zu floats", n);
    moe_convert_to_f32(m->dtype, m->data, tmp, n);
    st = moe_gpu_memcpy_h2d(dst, tmp, sizeof(float) * n);
    free(tmp);
    return st;
}

/* The router as f32 (the SIMT kernels, f32 x) and split in three bf16 planes (tensor cores,
 * bf16 x; moe_split_bf16x3). */
static moe_status_t store_router(cuda_layer_t *s, const moe_matrix_t *m)
{
    const size_t n = (size_t)m->rows * (size_t)m->cols;
    float *f = malloc(sizeof(float) * (n ? n : 1));
    uint16_t *planes = malloc(3 * sizeof(uint16_t) * (n ? n : 1));
    moe_status_t st;
    if (!f || !planes) {
        free(f), free(planes);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "router split: %zu floats", n);
    }
    moe_convert_to_f32(m->dtype, m->data, f, n);
    moe_split_bf16x3(f, planes, planes + n, planes + 2 * n, n);
    /* a router exact in bf16 (checkpoints ship bf16 routers) has zero mid and lo planes: the
     * logits then read and multiply one plane (the same values, moe_route_logits_args_t) */
    s->router_planes = 1;
    for (size_t i = n; i < 3 * n && s->router_planes == 1; i++)
        if (planes[i] != 0)
            s->router_planes = 3;
    st = moe_gpu_memcpy_h2d(s->router, f, sizeof(float) * n);
    if (st == MOE_STATUS_SUCCESS)
        st = moe_gpu_memcpy_h2d(s->router3, planes, 3 * sizeof(uint16_t) * n);
    free(f), free(planes);
    return st;
}

/* Copies a host bf16 matrix, or converts it to bf16 first (round to nearest even): f32, or
 * FP8 e4m3 dequantised with its per-tensor or 128x128 block scales exactly as the CPU reference
 * reads it (moe_cpu_matrix_row). FP8 layers compute in bf16 on the GPU until FP8 kernels are
 * built: W8A16, the same numbers as the CPU backend, not yet the FP8 bandwidth. */
static moe_status_t store_bf16(void *dst, const moe_matrix_t *m)
{
    const size_t n = (size_t)m->rows * (size_t)m->cols;
    uint16_t *tmp;
    float *row = NULL;
    moe_status_t st;
    if (m->dtype == MOE_DTYPE_BF16)
        return moe_gpu_memcpy_h2d(dst, m->data, 2 * n);
    if (m->dtype != MOE_DTYPE_F32 && m->dtype != MOE_DTYPE_FP8_E4M3)
        return moe_error(MOE_STATUS_NOT_SUPPORTED,
                         "CUDA backend: expert weights in %s (BF16, or F32/FP8 converted at load)",
                         moe_dtype_name(m->dtype));
    tmp = malloc(2 * (n ? n : 1));
    if (m->dtype == MOE_DTYPE_FP8_E4M3)
        row = malloc(sizeof(float) * (size_t)(m->cols ? m->cols : 1));
    if (!tmp || (m->dtype == MOE_DTYPE_FP8_E4M3 && !row)) {
        free(tmp);
        free(row);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "weight conversion: %zu values", n);
    }
    if (m->dtype == MOE_DTYPE_F32) {
        moe_convert_from_f32(MOE_DTYPE_BF16, m->data, tmp, n);
    } else {
        const moe_cpu_matrix_t cm = {m->dtype, m->scale_kind, m->rows, m->cols, m->data, m->scale};
        for (int64_t r = 0; r < m->rows; r++) {
            moe_cpu_matrix_row(&cm, r, row);
            moe_convert_from_f32(MOE_DTYPE_BF16, row, tmp + (size_t)r * (size_t)m->cols,
                                 (size_t)m->cols);
        }
    }
    st = moe_gpu_memcpy_h2d(dst, tmp, 2 * n);
    free(tmp);
    free(row);
    return st;
}

/* W8A8: the e4m3 bytes as stored, and the scales per weight row: one (a per-tensor scale
 * repeated), or (block) one per 128-wide k slice, the row's 128 x 128 block's. */
static moe_status_t store_e4m3(cuda_layer_t *s, moe_weight_kind_t kind, int local,
                               const moe_matrix_t *m)
{
    const size_t H = (size_t)s->H, is = (size_t)s->is, ss = (size_t)s->ss;
    const size_t rows = (size_t)m->rows, cols = (size_t)m->cols, g = f8_groups(s, m->cols);
    char *dst;
    float *sdst, *rs;
    int *vary; /* the matrix's cuda_layer_t.scales_vary */
    moe_status_t st;
    size_t r, b;
    if (m->dtype != MOE_DTYPE_FP8_E4M3 || (s->f8 == 2 ? m->scale_kind != MOE_SCALE_BLOCK_128
                                                      : m->scale_kind != MOE_SCALE_PER_TENSOR &&
                                                            m->scale_kind != MOE_SCALE_PER_CHANNEL))
        return moe_error(MOE_STATUS_INTERNAL_ERROR,
                         "W8A8 store: a %s matrix with scale kind %d (e4m3 with the layer's scale "
                         "kind expected)",
                         moe_dtype_name(m->dtype), (int)m->scale_kind);
    switch (kind) {
    case MOE_WEIGHT_GATE_PROJ:
    case MOE_WEIGHT_UP_PROJ:
        dst = (char *)s->w13 + (size_t)local * 2 * is * H;
        sdst = s->w13s + (size_t)local * 2 * is * g;
        if (kind == MOE_WEIGHT_UP_PROJ)
            dst += is * H, sdst += is * g;
        vary = &s->scales_vary[0];
        break;
    case MOE_WEIGHT_DOWN_PROJ:
        dst = (char *)s->w2 + (size_t)local * H * is;
        sdst = s->w2s + (size_t)local * H * g;
        vary = &s->scales_vary[1];
        break;
    case MOE_WEIGHT_SHARED_GATE_PROJ:
    case MOE_WEIGHT_SHARED_UP_PROJ:
        dst = (char *)s->sw13 + (kind == MOE_WEIGHT_SHARED_UP_PROJ ? ss * H : 0);
        sdst = s->sw13s + (kind == MOE_WEIGHT_SHARED_UP_PROJ ? ss * g : 0);
        vary = &s->scales_vary[2];
        break;
    default:
        dst = (char *)s->sw2;
        sdst = s->sw2s;
        vary = &s->scales_vary[3];
        break;
    }
    rs = malloc(sizeof(float) * (rows ? rows * g : 1));
    if (!rs)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "W8A8 row scales");
    for (r = 0; r < rows; r++)
        for (b = 0; b < g; b++)
            rs[r * g + b] = m->scale_kind == MOE_SCALE_BLOCK_128    ? m->scale[(r / 128) * g + b]
                            : m->scale_kind == MOE_SCALE_PER_TENSOR ? m->scale[0]
                                                                    : m->scale[r];
    /* one value down the rows (per-tensor, or per-channel alike): the GEMM may read one */
    for (r = 1; r < rows * g; r++)
        if (memcmp(&rs[r], &rs[0], sizeof(float)) != 0) {
            *vary = 1;
            break;
        }
    st = moe_gpu_memcpy_h2d(dst, m->data, rows * cols);
    if (st == MOE_STATUS_SUCCESS)
        st = moe_gpu_memcpy_h2d(sdst, rs, sizeof(float) * rows * g);
    free(rs);
    return st;
}

/* W8A8 per-row scale layers: keeps the matrix's static activation scale (its input_scale;
 * per-tensor weights only, 0: none) and uploads the GEMM input scale it changes, as the CPU
 * reference (kernels/cpu/w8a8.c) takes them: GEMM1's is moe_fp8_pair_static_scale(gate, up),
 * recomputed whichever of the two arrives (the other's kept value, 0 until it comes), GEMM2's
 * is down's. `local`: the expert's index on this rank (the shared MLP: row E). */
static moe_status_t store_static_scale(cuda_layer_t *s, moe_weight_kind_t kind, int local,
                                       const moe_matrix_t *m)
{
    const int shared = kind == MOE_WEIGHT_SHARED_GATE_PROJ || kind == MOE_WEIGHT_SHARED_UP_PROJ ||
                       kind == MOE_WEIGHT_SHARED_DOWN_PROJ;
    const int which = kind == MOE_WEIGHT_GATE_PROJ || kind == MOE_WEIGHT_SHARED_GATE_PROJ ? 0
                      : kind == MOE_WEIGHT_UP_PROJ || kind == MOE_WEIGHT_SHARED_UP_PROJ   ? 1
                                                                                          : 2;
    const int row = shared ? s->E : local, slot = 2 * shared + (which == 2);
    float *h = s->host_in + 3 * (size_t)row, *dst, v;
    int e;

    h[which] =
        m->scale_kind == MOE_SCALE_PER_TENSOR && m->input_scale > 0.0f ? m->input_scale : 0.0f;
    v = which == 2 ? h[2] : moe_fp8_pair_static_scale(h[0], h[1]);
    if (shared)
        dst = which == 2 ? s->sin2 : s->sin13;
    else
        dst = (which == 2 ? s->in2 : s->in13) + local;
    MOE_CHECK(moe_gpu_memcpy_h2d(dst, &v, sizeof(float)));
    /* an array with no scale at all is not passed: the quantisation stays the dynamic kernel */
    s->has_in[slot] = 0;
    for (e = shared ? s->E : 0; e < (shared ? s->E + 1 : s->E); e++) {
        const float *he = s->host_in + 3 * (size_t)e;
        s->has_in[slot] |= (which == 2 ? he[2] : moe_fp8_pair_static_scale(he[0], he[1])) > 0.0f;
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_cuda_store_weight(moe_layer_t *l, moe_weight_kind_t kind, int local,
                                   const moe_matrix_t *m)
{
    cuda_layer_t *s = l->state;
    const size_t H = (size_t)s->H, is = (size_t)s->is, ss = (size_t)s->ss;
    char *dst;

    switch (kind) {
    case MOE_WEIGHT_ROUTER:
        return store_router(s, m);
    case MOE_WEIGHT_ROUTER_BIAS:
        return store_f32(s->bias, m);
    case MOE_WEIGHT_SHARED_EXPERT_GATE:
        return store_f32(s->sgate, m);
    default:
        break;
    }
    switch (kind) {
    case MOE_WEIGHT_GATE_PROJ:
    case MOE_WEIGHT_UP_PROJ:
        MOE_ARG_CHECK(local >= 0 && local < s->E && (size_t)m->rows == is && (size_t)m->cols == H,
                      "CUDA store: expert %d [%lld, %lld]", local, (long long)m->rows,
                      (long long)m->cols);
        dst = (char *)s->w13 + 2 * (size_t)local * 2 * is * H;
        if (kind == MOE_WEIGHT_UP_PROJ)
            dst += 2 * is * H;
        break;
    case MOE_WEIGHT_DOWN_PROJ:
        MOE_ARG_CHECK(local >= 0 && local < s->E && (size_t)m->rows == H && (size_t)m->cols == is,
                      "CUDA store: expert %d [%lld, %lld]", local, (long long)m->rows,
                      (long long)m->cols);
        dst = (char *)s->w2 + 2 * (size_t)local * H * is;
        break;
    case MOE_WEIGHT_SHARED_GATE_PROJ:
    case MOE_WEIGHT_SHARED_UP_PROJ:
        MOE_ARG_CHECK(ss > 0 && (size_t)m->rows == ss && (size_t)m->cols == H,
                      "CUDA store: shared [%lld, %lld]", (long long)m->rows, (long long)m->cols);
        dst = (char *)s->sw13 + (kind == MOE_WEIGHT_SHARED_UP_PROJ ? 2 * ss * H : 0);
        break;
    case MOE_WEIGHT_SHARED_DOWN_PROJ:
        MOE_ARG_CHECK(ss > 0 && (size_t)m->rows == H && (size_t)m->cols == ss,
                      "CUDA store: shared down [%lld, %lld]", (long long)m->rows,
                      (long long)m->cols);
        dst = (char *)s->sw2;
        break;
    default:
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "CUDA store: weight kind %d", (int)kind);
    }
    if (s->f8) {
        MOE_CHECK(store_e4m3(s, kind, local, m));
        /* block layers never get an input_scale (weights.c keeps it for per-tensor only) */
        return s->f8 == 1 ? store_static_scale(s, kind, local, m) : MOE_STATUS_SUCCESS;
    }
    return store_bf16(dst, m); /* W8A16: the input_scale is not used, as on the CPU */
}
