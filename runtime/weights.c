/* SPDX-License-Identifier: Apache-2.0 */
/* Weight setting: shapes per kind, this rank's slice, dtype conversion and FP8 quantisation,
 * and the check that every needed weight was set. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/numeric.h"
#include "base/diag.h"
#include "runtime/layer.h"
#include "runtime/weights.h"

#define BLK 128

static const char *const kind_names[MOE_WEIGHT_KIND_COUNT] = {
    "ROUTER",           "ROUTER_BIAS",    "GATE_PROJ",        "UP_PROJ",           "DOWN_PROJ",
    "SHARED_GATE_PROJ", "SHARED_UP_PROJ", "SHARED_DOWN_PROJ", "SHARED_EXPERT_GATE"};

static int per_expert(moe_weight_kind_t k)
{
    return k == MOE_WEIGHT_GATE_PROJ || k == MOE_WEIGHT_UP_PROJ || k == MOE_WEIGHT_DOWN_PROJ;
}

void moe_layer_weight_storage(const moe_layer_t *l, moe_weight_kind_t kind, moe_dtype_t *dtype,
                              moe_scale_kind_t *scale_kind)
{
    const int f32 = kind == MOE_WEIGHT_ROUTER || kind == MOE_WEIGHT_ROUTER_BIAS ||
                    kind == MOE_WEIGHT_SHARED_EXPERT_GATE;
    *dtype = f32 ? MOE_DTYPE_F32 : l->cfg.weight_dtype;
    *scale_kind = f32 ? MOE_SCALE_NONE : l->cfg.scale_kind;
}

void moe_layer_weight_shape(const moe_layer_t *l, moe_weight_kind_t kind, int64_t *rows,
                            int64_t *cols, int64_t *full_rows, int64_t *full_cols,
                            int64_t *row_begin, int64_t *col_begin)
{
    const int64_t E = l->cfg.num_experts, H = l->cfg.hidden, I = l->cfg.intermediate;
    const int64_t S = l->plan.shared_intermediate;
    const int64_t is = l->plan.i_end - l->plan.i_begin, ss = l->plan.s_end - l->plan.s_begin;
    *row_begin = *col_begin = 0;
    switch (kind) {
    case MOE_WEIGHT_ROUTER:
        *full_rows = *rows = E, *full_cols = *cols = H;
        break;
    case MOE_WEIGHT_ROUTER_BIAS:
        *full_rows = *rows = 1, *full_cols = *cols = E;
        break;
    case MOE_WEIGHT_GATE_PROJ:
    case MOE_WEIGHT_UP_PROJ:
        *full_rows = I, *full_cols = *cols = H, *rows = is, *row_begin = l->plan.i_begin;
        break;
    case MOE_WEIGHT_DOWN_PROJ:
        *full_rows = *rows = H, *full_cols = I, *cols = is, *col_begin = l->plan.i_begin;
        break;
    case MOE_WEIGHT_SHARED_GATE_PROJ:
    case MOE_WEIGHT_SHARED_UP_PROJ:
        *full_rows = S, *full_cols = *cols = H, *rows = ss, *row_begin = l->plan.s_begin;
        break;
    case MOE_WEIGHT_SHARED_DOWN_PROJ:
        *full_rows = *rows = H, *full_cols = S, *cols = ss, *col_begin = l->plan.s_begin;
        break;
    default: /* SHARED_EXPERT_GATE */
        *full_rows = *rows = 1, *full_cols = *cols = H;
        break;
    }
}

size_t moe_matrix_data_bytes(moe_dtype_t dtype, int64_t rows, int64_t cols)
{
    return (size_t)rows * (size_t)cols * moe_dtype_size(dtype);
}

size_t moe_matrix_scale_count(moe_scale_kind_t kind, int64_t rows, int64_t cols)
{
    if (kind == MOE_SCALE_PER_TENSOR)
        return 1;
    if (kind == MOE_SCALE_BLOCK_128)
        return (size_t)((rows + BLK - 1) / BLK) * (size_t)((cols + BLK - 1) / BLK);
    if (kind == MOE_SCALE_PER_CHANNEL)
        return (size_t)rows;
    return 0;
}

static int64_t ceil_blk(int64_t x)
{
    return (x + BLK - 1) / BLK;
}

/* The scale kind an FP8 tensor's scale shape says. */
static moe_status_t fp8_scale_kind(const moe_tensor_t *t, const char *what, moe_scale_kind_t *k)
{
    if (!t->scale)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "%s: FP8_E4M3 tensor without scale", what);
    if (t->scale_rows == ceil_blk(t->rows) && t->scale_cols == ceil_blk(t->cols))
        *k = MOE_SCALE_BLOCK_128; /* also right for one block: both readings agree */
    else if (t->scale_rows * t->scale_cols == 1)
        *k = MOE_SCALE_PER_TENSOR;
    else if (t->scale_rows == t->rows && t->scale_cols == 1)
        *k = MOE_SCALE_PER_CHANNEL;
    else
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "%s: scale shape [%lld, %lld] fits neither per-tensor [1, 1], "
                         "per-channel [rows, 1] nor 128x128 blocks [%lld, %lld] of a [%lld, %lld] "
                         "weight",
                         what, (long long)t->scale_rows, (long long)t->scale_cols,
                         (long long)ceil_blk(t->rows), (long long)ceil_blk(t->cols),
                         (long long)t->rows, (long long)t->cols);
    return MOE_STATUS_SUCCESS;
}

static float scale_at(const moe_tensor_t *t, moe_scale_kind_t k, int64_t r, int64_t c)
{
    if (k == MOE_SCALE_BLOCK_128)
        return t->scale[(r / BLK) * t->scale_cols + c / BLK];
    if (k == MOE_SCALE_PER_CHANNEL)
        return t->scale[r];
    return t->scale[0];
}

/* out[rows, cols] = t[r0.., c0..] as f32 (FP8 dequantised). */
static void extract_f32(const moe_tensor_t *t, moe_scale_kind_t sk, int64_t r0, int64_t c0,
                        int64_t rows, int64_t cols, float *out)
{
    const size_t es = moe_dtype_size(t->dtype);
    int64_t r, c;
    for (r = 0; r < rows; r++) {
        const char *src = (const char *)t->data + ((size_t)(r0 + r) * (size_t)t->cols + c0) * es;
        moe_convert_to_f32(t->dtype, src, out + r * cols, (size_t)cols);
        if (t->dtype == MOE_DTYPE_FP8_E4M3)
            for (c = 0; c < cols; c++)
                out[r * cols + c] *= scale_at(t, sk, r0 + r, c0 + c);
    }
}

/* The scale of a block whose largest |value| is amax: amax / 448, or 1 where that is 0 (all
 * zeros, or an amax so small that the division underflows: its values quantise to 0, not to
 * 0 / 0 = NaN). */
static float scale_of_amax(float amax)
{
    const float s = amax / MOE_FP8_E4M3_MAX;
    return s > 0.0f ? s : 1.0f;
}

/* Index of element (r, c)'s scale in a [rows, cols] matrix's scale array of kind k. */
static int64_t scale_index(moe_scale_kind_t k, int64_t cols, int64_t r, int64_t c)
{
    if (k == MOE_SCALE_BLOCK_128)
        return (r / BLK) * ceil_blk(cols) + c / BLK;
    return k == MOE_SCALE_PER_CHANNEL ? r : 0;
}

/* Quantises f32 [rows, cols] to FP8 with per-tensor, per-channel or 128x128 block scales
 * (amax / 448). `given`: the scales are already in `scale` (from the whole matrix). */
static void quantize_fp8(const float *in, int64_t rows, int64_t cols, moe_scale_kind_t k,
                         uint8_t *out, float *scale, int given)
{
    int64_t r, c, n = (int64_t)moe_matrix_scale_count(k, rows, cols), i;
    float *amax = scale;
    if (!given) {
        for (i = 0; i < n; i++)
            amax[i] = 0.0f;
        for (r = 0; r < rows; r++)
            for (c = 0; c < cols; c++) {
                float *a = &amax[scale_index(k, cols, r, c)];
                float v = fabsf(in[r * cols + c]);
                *a = v > *a ? v : *a;
            }
        for (i = 0; i < n; i++)
            scale[i] = scale_of_amax(amax[i]);
    }
    for (r = 0; r < rows; r++)
        for (c = 0; c < cols; c++)
            out[r * cols + c] =
                moe_f32_to_fp8e4m3(in[r * cols + c] / scale[scale_index(k, cols, r, c)]);
}

/* Per-tensor and per-channel scales of a slice [r0, r0 + m->rows) x [c0, ...) from the whole
 * tensor t (all of it, or each whole row), so that a TP slice is quantised exactly as one rank
 * holding the whole matrix would quantise it. Block scales need not: TP slices are 128-aligned.
 * Returns 0 (nothing given) for block scales. */
static int whole_matrix_scales(const moe_tensor_t *t, moe_scale_kind_t sk, int64_t r0,
                               moe_matrix_t *m, float *row)
{
    int64_t r, c, rr;
    if (m->scale_kind == MOE_SCALE_PER_TENSOR) {
        float amax = 0.0f;
        for (r = 0; r < t->rows; r++) {
            extract_f32(t, sk, r, 0, 1, t->cols, row);
            for (c = 0; c < t->cols; c++) /* other ranks check their parts: skip non-finite */
                amax = isfinite(row[c]) && fabsf(row[c]) > amax ? fabsf(row[c]) : amax;
        }
        m->scale[0] = scale_of_amax(amax);
        return 1;
    }
    if (m->scale_kind == MOE_SCALE_PER_CHANNEL) {
        for (rr = 0; rr < m->rows; rr++) {
            float amax = 0.0f;
            extract_f32(t, sk, r0 + rr, 0, 1, t->cols, row);
            for (c = 0; c < t->cols; c++)
                amax = isfinite(row[c]) && fabsf(row[c]) > amax ? fabsf(row[c]) : amax;
            m->scale[rr] = scale_of_amax(amax);
        }
        return 1;
    }
    return 0;
}

/* FP8 in, same scale kind stored: copy the bytes and the scales of the slice. */
static void copy_fp8(const moe_tensor_t *t, moe_scale_kind_t sk, int64_t r0, int64_t c0,
                     moe_matrix_t *m)
{
    int64_t r, c;
    for (r = 0; r < m->rows; r++)
        memcpy((uint8_t *)m->data + r * m->cols, (const uint8_t *)t->data + (r0 + r) * t->cols + c0,
               (size_t)m->cols);
    if (sk == MOE_SCALE_PER_TENSOR) {
        m->scale[0] = t->scale[0];
        return;
    }
    if (sk == MOE_SCALE_PER_CHANNEL) { /* the slice's rows; a column slice keeps its row's */
        for (r = 0; r < m->rows; r++)
            m->scale[r] = t->scale[r0 + r];
        return;
    }
    for (r = 0; r < ceil_blk(m->rows); r++)
        for (c = 0; c < ceil_blk(m->cols); c++)
            m->scale[r * ceil_blk(m->cols) + c] =
                t->scale[(r0 / BLK + r) * t->scale_cols + c0 / BLK + c];
}

static moe_status_t check_tensor(const moe_layer_t *l, moe_weight_kind_t kind, int expert,
                                 const moe_tensor_t *t)
{
    MOE_ARG_CHECK((int)kind >= 0 && (int)kind < MOE_WEIGHT_KIND_COUNT,
                  "kind = %d: not a moe_weight_kind_t", (int)kind);
    MOE_ARG_CHECK(t != NULL, "tensor = NULL for %s", kind_names[kind]);
    MOE_ARG_CHECK(t->dtype == MOE_DTYPE_F32 || t->dtype == MOE_DTYPE_BF16 ||
                      t->dtype == MOE_DTYPE_F16 || t->dtype == MOE_DTYPE_FP8_E4M3,
                  "%s: tensor dtype = %d is not F32, BF16, F16 or FP8_E4M3", kind_names[kind],
                  (int)t->dtype);
    MOE_ARG_CHECK(t->data != NULL, "%s: tensor data = NULL", kind_names[kind]);
    MOE_ARG_CHECK(t->rows > 0 && t->cols > 0, "%s: shape [%lld, %lld] must be positive",
                  kind_names[kind], (long long)t->rows, (long long)t->cols);
    if (per_expert(kind))
        MOE_ARG_CHECK(expert >= 0 && expert < l->cfg.num_experts, "%s: expert = %d not in 0..%d",
                      kind_names[kind], expert, l->cfg.num_experts - 1);
    MOE_ARG_CHECK(kind != MOE_WEIGHT_ROUTER_BIAS || l->cfg.use_score_bias,
                  "ROUTER_BIAS: the layer has use_score_bias = 0");
    MOE_ARG_CHECK(kind < MOE_WEIGHT_SHARED_GATE_PROJ || l->plan.shared_intermediate > 0,
                  "%s: the layer has no shared experts", kind_names[kind]);
    MOE_ARG_CHECK(kind != MOE_WEIGHT_SHARED_EXPERT_GATE || l->cfg.shared_expert_gate,
                  "SHARED_EXPERT_GATE: the layer has shared_expert_gate = 0");
    return MOE_STATUS_SUCCESS;
}

/* Index of the first value of row `p` (n elements of `dt`) that is NaN or +-Inf, or -1. Done
 * on the bits: no conversion, and the same answer on every compiler and flag. */
static int64_t first_nonfinite(moe_dtype_t dt, const void *p, int64_t n)
{
    int64_t i;

    switch (dt) {
    case MOE_DTYPE_F32:
        for (i = 0; i < n; i++) {
            uint32_t b;
            memcpy(&b, (const char *)p + 4 * i, 4);
            if ((b & 0x7F800000u) == 0x7F800000u)
                return i;
        }
        return -1;
    case MOE_DTYPE_BF16:
    case MOE_DTYPE_F16: {
        const uint16_t mask = dt == MOE_DTYPE_BF16 ? 0x7F80u : 0x7C00u;
        for (i = 0; i < n; i++) {
            uint16_t b;
            memcpy(&b, (const char *)p + 2 * i, 2);
            if ((b & mask) == mask)
                return i;
        }
        return -1;
    }
    case MOE_DTYPE_FP8_E4M3: /* e4m3fn: no Inf, NaN is S.1111.111 */
        for (i = 0; i < n; i++)
            if ((((const uint8_t *)p)[i] & 0x7F) == 0x7F)
                return i;
        return -1;
    default:
        return -1;
    }
}

static const char *value_name(float v)
{
    return isnan(v) ? "NaN" : v > 0 ? "+Inf" : "-Inf";
}

/* An FP8 scale multiplies e4m3 values of magnitude up to 448 (and, as an input scale, divides
 * activations). One whose product with 448 overflows f32 gives Inf and NaN; one whose product
 * with 448 is below f32's smallest normal makes every weight it scales subnormal, which the
 * GEMMs flush to zero: both are refused, as are 0, negatives, NaN and Inf. */
#define E4M3_MAX 448.0f
#define SCALE_MAX (FLT_MAX / E4M3_MAX)
#define SCALE_MIN (FLT_MIN / E4M3_MAX)

moe_status_t moe_scales_check(const float *scale, int64_t rows, int64_t cols, const char *what,
                              int64_t row_off, int64_t col_off)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            float v = scale[r * cols + c];
            const long long sr = (long long)(r + row_off / BLK),
                            sc = (long long)(c + col_off / BLK);
            if (!isfinite(v) || !(v > 0.0f))
                return moe_error(MOE_STATUS_NUMERIC_ERROR,
                                 "%s: scale [%lld, %lld] is %g (FP8 scales must be finite and > "
                                 "0)",
                                 what, sr, sc, (double)v);
            if (v > SCALE_MAX)
                return moe_error(MOE_STATUS_NUMERIC_ERROR,
                                 "%s: scale [%lld, %lld] is %g: times the e4m3 maximum 448 it "
                                 "overflows f32 (FP8 scales must be at most %.4g)",
                                 what, sr, sc, (double)v, (double)SCALE_MAX);
            if (v < SCALE_MIN)
                return moe_error(MOE_STATUS_NUMERIC_ERROR,
                                 "%s: scale [%lld, %lld] is %g: times the e4m3 maximum 448 it is "
                                 "below f32's smallest normal %.4g, so every weight it scales "
                                 "flushes to zero (FP8 scales must be at least %.4g)",
                                 what, sr, sc, (double)v, (double)FLT_MIN, (double)SCALE_MIN);
        }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_tensor_check_values(const moe_tensor_t *t, moe_scale_kind_t scale_kind, int64_t r0,
                                     int64_t c0, int64_t rows, int64_t cols, const char *what,
                                     int64_t row_off, int64_t col_off)
{
    const size_t es = moe_dtype_size(t->dtype);

    if (t->dtype == MOE_DTYPE_FP8_E4M3 && t->scale && rows > 0 && cols > 0) {
        if (scale_kind == MOE_SCALE_BLOCK_128) {
            /* only the blocks of the slice; scale indices relative to t's scale grid */
            int64_t br0 = r0 / BLK, br1 = (r0 + rows - 1) / BLK;
            int64_t bc0 = c0 / BLK, bc1 = (c0 + cols - 1) / BLK;
            for (int64_t br = br0; br <= br1; br++)
                MOE_CHECK(moe_scales_check(t->scale + br * t->scale_cols + bc0, 1, bc1 - bc0 + 1,
                                           what, row_off + br * BLK, col_off + bc0 * BLK));
        } else if (scale_kind == MOE_SCALE_PER_CHANNEL) {
            MOE_CHECK(moe_scales_check(t->scale + r0, rows, 1, what, row_off + r0, 0));
        } else {
            MOE_CHECK(moe_scales_check(t->scale, 1, 1, what, 0, 0));
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)t->data + ((size_t)(r0 + r) * (size_t)t->cols + c0) * es;
        int64_t c = first_nonfinite(t->dtype, row, cols);
        float v;
        if (c < 0)
            continue;
        moe_convert_to_f32(t->dtype, row + (size_t)c * es, &v, 1);
        return moe_error(MOE_STATUS_NUMERIC_ERROR, "%s: element [%lld, %lld] is %s", what,
                         (long long)(r0 + r + row_off), (long long)(c0 + c + col_off),
                         value_name(v));
    }
    return MOE_STATUS_SUCCESS;
}

int moe_layer_checks_weight_values(const moe_layer_t *l)
{
    return l && !l->cfg.skip_weight_check;
}

static unsigned char *set_mark(moe_layer_t *l, moe_weight_kind_t kind, int local)
{
    return &l->weight_set[(size_t)(local + 1) * MOE_WEIGHT_KIND_COUNT + kind];
}

/* Converts this rank's slice of `t` into `m` (storage dtype, already allocated). */
static moe_status_t convert_slice(const moe_tensor_t *t, int64_t r0, int64_t c0, moe_matrix_t *m,
                                  const char *what)
{
    moe_scale_kind_t sk = MOE_SCALE_NONE;
    float *tmp;

    if (t->dtype == MOE_DTYPE_FP8_E4M3)
        MOE_CHECK(fp8_scale_kind(t, what, &sk));
    if (t->dtype == MOE_DTYPE_FP8_E4M3 && m->dtype == MOE_DTYPE_FP8_E4M3 && sk == m->scale_kind) {
        copy_fp8(t, sk, r0, c0, m);
        return MOE_STATUS_SUCCESS;
    }
    tmp = malloc(sizeof(float) * (size_t)m->rows * (size_t)m->cols);
    if (!tmp)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: staging [%lld, %lld]", what,
                         (long long)m->rows, (long long)m->cols);
    extract_f32(t, sk, r0, c0, m->rows, m->cols, tmp);
    if (m->dtype == MOE_DTYPE_FP8_E4M3) {
        float *row = malloc(sizeof(float) * (size_t)(t->cols > 0 ? t->cols : 1));
        int given;
        if (!row) {
            free(tmp);
            return moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: staging a row of %lld", what,
                             (long long)t->cols);
        }
        given = whole_matrix_scales(t, sk, r0, m, row);
        quantize_fp8(tmp, m->rows, m->cols, m->scale_kind, m->data, m->scale, given);
        free(row);
    } else {
        moe_convert_from_f32(m->dtype, tmp, m->data, (size_t)m->rows * (size_t)m->cols);
    }
    free(tmp);
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_layer_set_weight(moe_layer_t *l, moe_weight_kind_t kind, int expert,
                                  const moe_tensor_t *t)
{
    moe_error_clear();
    return moe_layer_set_weight_from(l, kind, expert, t, 0.0f, NULL, 0, 0);
}

moe_status_t moe_layer_set_weight_with_input_scale(moe_layer_t *l, moe_weight_kind_t kind,
                                                   int expert, const moe_tensor_t *t,
                                                   float input_scale)
{
    moe_error_clear();
    MOE_ARG_CHECK(l != NULL, "layer = NULL");
    MOE_ARG_CHECK((kind >= MOE_WEIGHT_GATE_PROJ && kind <= MOE_WEIGHT_DOWN_PROJ) ||
                      (kind >= MOE_WEIGHT_SHARED_GATE_PROJ && kind <= MOE_WEIGHT_SHARED_DOWN_PROJ),
                  "kind = %d: an input scale belongs to GATE_PROJ, UP_PROJ, DOWN_PROJ or their "
                  "SHARED_ kinds",
                  (int)kind);
    if (input_scale != 0.0f) {
        char what[96];
        MOE_ARG_CHECK(l->cfg.weight_dtype == MOE_DTYPE_FP8_E4M3 &&
                          l->cfg.scale_kind == MOE_SCALE_PER_TENSOR && moe_cfg_w8a8(&l->cfg),
                      "%s: input_scale = %g: static activation scales are read by W8A8 "
                      "arithmetic on per-tensor FP8 weights only (this layer: weight_dtype %s, "
                      "scale_kind %d, fp8_math %d; want FP8_E4M3, PER_TENSOR 1, W8A8 2 or "
                      "W8A8_FAST 3)",
                      kind_names[kind], (double)input_scale, moe_dtype_name(l->cfg.weight_dtype),
                      (int)l->cfg.scale_kind, (int)l->cfg.fp8_math);
        snprintf(what, sizeof(what), "%s: input_scale", kind_names[kind]);
        MOE_CHECK(moe_scales_check(&input_scale, 1, 1, what, 0, 0));
    }
    return moe_layer_set_weight_from(l, kind, expert, t, input_scale, NULL, 0, 0);
}

moe_status_t moe_layer_set_weight_from(moe_layer_t *l, moe_weight_kind_t kind, int expert,
                                       const moe_tensor_t *t, float input_scale, const char *origin,
                                       int64_t row_off, int64_t col_off)
{
    int64_t rows, cols, frows, fcols, r0, c0;
    moe_matrix_t m = {0};
    moe_status_t st;
    char what[64], where[512];
    int local = -1;

    MOE_ARG_CHECK(l != NULL, "layer = NULL");
    MOE_CHECK(check_tensor(l, kind, expert, t));
    moe_layer_weight_shape(l, kind, &rows, &cols, &frows, &fcols, &r0, &c0);
    snprintf(what, sizeof(what), per_expert(kind) ? "%s of expert %d" : "%s", kind_names[kind],
             expert);
    if (origin)
        snprintf(where, sizeof(where), "%s (%s)", origin, what);
    else
        snprintf(where, sizeof(where), "%s", what);
    if (t->rows == frows && t->cols == fcols) {
        /* full tensor: keep the slice at (r0, c0) */
    } else if (t->rows == rows && t->cols == cols) {
        r0 = c0 = 0; /* this rank's slice */
    } else {
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "%s: shape [%lld, %lld] is neither the full [%lld, %lld] nor this "
                         "rank's slice [%lld, %lld]",
                         what, (long long)t->rows, (long long)t->cols, (long long)frows,
                         (long long)fcols, (long long)rows, (long long)cols);
    }
    if (per_expert(kind)) {
        /* the first of this rank's slots that hold the expert (it may hold several replicas) */
        for (local = 0; local < l->plan.num_local_experts; local++)
            if (l->plan.local_logical[local] == expert)
                break;
        if (local == l->plan.num_local_experts)
            return MOE_STATUS_SUCCESS; /* another rank's expert */
    }
    if (!l->cfg.skip_weight_check) {
        /* Before anything is kept: a bad weight leaves the layer as it was. */
        moe_scale_kind_t sk = MOE_SCALE_NONE;
        if (t->dtype == MOE_DTYPE_FP8_E4M3)
            MOE_CHECK(fp8_scale_kind(t, what, &sk));
        MOE_CHECK(moe_tensor_check_values(t, sk, r0, c0, rows, cols, where, row_off, col_off));
        if (input_scale != 0.0f) {
            char iw[600];
            snprintf(iw, sizeof(iw), "%s: input_scale", where);
            MOE_CHECK(moe_scales_check(&input_scale, 1, 1, iw, 0, 0));
        }
    }
    moe_layer_weight_storage(l, kind, &m.dtype, &m.scale_kind);
    m.rows = rows;
    m.cols = cols;
    m.input_scale = m.scale_kind == MOE_SCALE_PER_TENSOR ? input_scale : 0.0f;
    m.data = malloc(moe_matrix_data_bytes(m.dtype, rows, cols) + 1);
    m.scale = calloc(moe_matrix_scale_count(m.scale_kind, rows, cols) + 1, sizeof(float));
    if (!m.data || !m.scale) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: %zu bytes", what,
                       moe_matrix_data_bytes(m.dtype, rows, cols));
        goto out;
    }
    MOE_CHECK_GOTO(convert_slice(t, r0, c0, &m, what), st, out);
    MOE_CHECK_GOTO(l->ops->store_weight(l, kind, local, &m), st, out);
    *set_mark(l, kind, local) = 1;
    while (local >= 0 && ++local < l->plan.num_local_experts) /* its other local replicas */
        if (l->plan.local_logical[local] == expert) {
            MOE_CHECK_GOTO(l->ops->store_weight(l, kind, local, &m), st, out);
            *set_mark(l, kind, local) = 1;
        }
out:
    free(m.data);
    free(m.scale);
    return st;
}

int moe_layer_num_experts(const moe_layer_t *l)
{
    return l->cfg.num_experts;
}

int moe_layer_slot_expert(const moe_layer_t *l, int slot)
{
    return slot >= 0 && slot < l->plan.num_local_experts ? l->plan.local_logical[slot] : -1;
}

int moe_layer_expert_weights_state(const moe_layer_t *l)
{
    int e, k, set = 0, total = 0;
    for (e = 0; e < l->plan.num_local_experts; e++)
        for (k = MOE_WEIGHT_GATE_PROJ; k <= MOE_WEIGHT_DOWN_PROJ; k++, total++)
            set += *set_mark((moe_layer_t *)l, (moe_weight_kind_t)k, e) != 0;
    return set == 0 ? 0 : set == total ? 1 : 2;
}

void moe_layer_mark_expert_weights(moe_layer_t *l, int set)
{
    int e, k;
    for (e = 0; e < l->plan.num_local_experts; e++)
        for (k = MOE_WEIGHT_GATE_PROJ; k <= MOE_WEIGHT_DOWN_PROJ; k++)
            *set_mark(l, (moe_weight_kind_t)k, e) = (unsigned char)(set != 0);
}

moe_status_t moe_layer_check_weights(const moe_layer_t *l, int need_router, int need_bias)
{
    int e, k;
    if (need_router && !*set_mark((moe_layer_t *)l, MOE_WEIGHT_ROUTER, -1))
        return moe_error(MOE_STATUS_INVALID_STATE, "ROUTER weight not set (or pass router_logits "
                                                   "or given_topk_ids/weights to forward)");
    if (need_bias && l->cfg.use_score_bias &&
        !*set_mark((moe_layer_t *)l, MOE_WEIGHT_ROUTER_BIAS, -1))
        return moe_error(MOE_STATUS_INVALID_STATE, "ROUTER_BIAS not set (use_score_bias = 1)");
    for (e = 0; e < l->plan.num_local_experts; e++)
        for (k = MOE_WEIGHT_GATE_PROJ; k <= MOE_WEIGHT_DOWN_PROJ; k++)
            if (!*set_mark((moe_layer_t *)l, (moe_weight_kind_t)k, e))
                return moe_error(MOE_STATUS_INVALID_STATE, "%s of expert %d not set", kind_names[k],
                                 l->plan.local_logical[e]);
    if (l->plan.shared_intermediate > 0)
        for (k = MOE_WEIGHT_SHARED_GATE_PROJ; k <= MOE_WEIGHT_SHARED_DOWN_PROJ; k++)
            if (!*set_mark((moe_layer_t *)l, (moe_weight_kind_t)k, -1))
                return moe_error(MOE_STATUS_INVALID_STATE, "%s not set", kind_names[k]);
    if (l->cfg.shared_expert_gate &&
        !*set_mark((moe_layer_t *)l, MOE_WEIGHT_SHARED_EXPERT_GATE, -1))
        return moe_error(MOE_STATUS_INVALID_STATE, "SHARED_EXPERT_GATE not set");
    return MOE_STATUS_SUCCESS;
}
