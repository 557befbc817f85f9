/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer target: the weight-value check (NaN/Inf values; FP8 scales finite, > 0 and within
 * [FLT_MIN / 448, FLT_MAX / 448], runtime/weights.c) on
 * arbitrary bytes, against a plain reference that converts every element to f32. Layout of an
 * input: dtype, rows, cols, slice (r0, c0, rows, cols), scale kind, then the data and the
 * scales (short inputs are padded with zeros). */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "base/numeric.h"
#include "runtime/weights.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define BLK 128

static uint8_t byte_at(const uint8_t *d, size_t n, size_t i)
{
    return i < n ? d[i] : 0;
}

/* 1 for a scale the check refuses: not finite, not > 0, or out of e4m3's f32 range. */
static int scale_bad(float s)
{
    return !isfinite(s) || !(s > 0) || s > FLT_MAX / 448.0f || s < FLT_MIN / 448.0f;
}

/* 1 when the slice holds a non-finite value or uses a bad scale. */
static int reference_bad(const moe_tensor_t *t, moe_scale_kind_t sk, int64_t r0, int64_t c0,
                         int64_t rows, int64_t cols)
{
    const size_t es = moe_dtype_size(t->dtype);
    for (int64_t r = r0; r < r0 + rows; r++)
        for (int64_t c = c0; c < c0 + cols; c++) {
            float v;
            moe_convert_to_f32(t->dtype, (const char *)t->data + (size_t)(r * t->cols + c) * es, &v,
                               1);
            if (!isfinite(v))
                return 1;
            if (t->dtype == MOE_DTYPE_FP8_E4M3) {
                float s = sk == MOE_SCALE_BLOCK_128 ? t->scale[(r / BLK) * t->scale_cols + c / BLK]
                                                    : t->scale[0];
                if (scale_bad(s))
                    return 1;
            }
        }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const moe_dtype_t dtypes[4] = {MOE_DTYPE_F32, MOE_DTYPE_BF16, MOE_DTYPE_F16,
                                          MOE_DTYPE_FP8_E4M3};
    moe_tensor_t t = {0};
    moe_scale_kind_t sk;
    int64_t R, C, r0, c0, rows, cols, sr, sc;
    size_t es, nbytes, nscale, o = 8;
    uint8_t *buf;
    float *scale;
    moe_status_t st;
    int bad;

    t.dtype = dtypes[byte_at(data, size, 0) & 3];
    /* up to 136 x 260: partial 128-blocks both ways, three of them across */
    R = 1 + byte_at(data, size, 1) % 136;
    C = 1 + (byte_at(data, size, 3) | (byte_at(data, size, 4) & 1) << 8) % 260;
    r0 = byte_at(data, size, 5) % R;
    c0 = byte_at(data, size, 6) % C;
    rows = 1 + byte_at(data, size, 7) % (R - r0);
    cols = 1 + byte_at(data, size, 2) % (C - c0);
    sk = (byte_at(data, size, 4) & 2) ? MOE_SCALE_PER_TENSOR : MOE_SCALE_BLOCK_128;
    es = moe_dtype_size(t.dtype);
    nbytes = (size_t)(R * C) * es;
    sr = sk == MOE_SCALE_BLOCK_128 ? (R + BLK - 1) / BLK : 1;
    sc = sk == MOE_SCALE_BLOCK_128 ? (C + BLK - 1) / BLK : 1;
    nscale = (size_t)(sr * sc);
    buf = calloc(nbytes, 1);
    scale = calloc(nscale, sizeof(float));
    if (!buf || !scale)
        abort();
    /* the input's bytes repeat over the data so that short inputs still fill big tensors */
    for (size_t i = 0; size > o && i < nbytes; i += size - o)
        memcpy(buf + i, data + o, nbytes - i < size - o ? nbytes - i : size - o);
    for (size_t i = 0; i < nscale; i++) {
        size_t at = size > o ? o + (i * 4) % (size - o) : 0;
        uint32_t b = (uint32_t)byte_at(data, size, at) |
                     (uint32_t)byte_at(data, size, at + 1) << 8 |
                     (uint32_t)byte_at(data, size, at + 2) << 16 |
                     (uint32_t)byte_at(data, size, at + 3) << 24;
        memcpy(&scale[i], &b, 4);
    }
    t.rows = R;
    t.cols = C;
    t.data = buf;
    if (t.dtype == MOE_DTYPE_FP8_E4M3) {
        t.scale = scale;
        t.scale_rows = sr;
        t.scale_cols = sc;
    }
    st = moe_tensor_check_values(&t, sk, r0, c0, rows, cols, "fuzz", 0, 0);
    bad = reference_bad(&t, sk, r0, c0, rows, cols);
    if ((st == MOE_STATUS_NUMERIC_ERROR) != bad || (st != MOE_STATUS_SUCCESS && !bad))
        abort();
    st = moe_scales_check(scale, sr, sc, "fuzz", 0, 0);
    bad = 0;
    for (size_t i = 0; i < nscale; i++)
        bad |= scale_bad(scale[i]);
    if ((st == MOE_STATUS_NUMERIC_ERROR) != bad)
        abort();
    free(buf);
    free(scale);
    return 0;
}
