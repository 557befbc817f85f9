/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers shared by the GPU tests: seeded random data, device buffers with poison, checks. */
#ifndef MOE_GPU_TEST_H
#define MOE_GPU_TEST_H

#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "gpu_skip.h"
#include "kernels/gpu.h"
#include "base/numeric.h"
#include "base/diag.h"

/* Token counts every stage is checked at. */
static const int64_t gt_token_counts[] = {0, 1, 3, 17, 64, 255, 1024, 8192};
#define GT_NUM_TOKEN_COUNTS ((int)(sizeof(gt_token_counts) / sizeof(gt_token_counts[0])))

/* Poison bytes: 0xFF makes every f32 / bf16 a NaN; 0x7F makes an int32 0x7F7F7F7F (no valid
 * id, row or count), so an element a kernel failed to write is caught. */
#define GT_POISON_FLOAT 0xFF
#define GT_POISON_INT 0x7F

static uint64_t gt_rng_state;

/* A fixed seed, printed (the same inputs on every run); MOE_TEST_SEED=<n> picks another. */
#define GT_DEFAULT_SEED 20261130ull
static inline void gt_seed(void)
{
    const char *env = getenv("MOE_TEST_SEED");
    gt_rng_state = env ? strtoull(env, NULL, 0) : GT_DEFAULT_SEED;
    if (!gt_rng_state)
        gt_rng_state = 1;
    fprintf(stderr, "MOE_TEST_SEED=%llu\n", (unsigned long long)gt_rng_state);
}

static inline uint64_t gt_next(void)
{
    uint64_t x = gt_rng_state; /* xorshift64* */
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    gt_rng_state = x;
    return x * 2685821657736338717ULL;
}

/* Uniform in [-1, 1). */
static inline float gt_uniform(void)
{
    return (float)((gt_next() >> 40) * (1.0 / 8388608.0)) - 1.0f;
}

static inline int gt_below(int n)
{
    return (int)((gt_next() >> 33) % (uint64_t)n);
}

/* A pool of bf16-exact uniform values in [-1, 1) that big fills copy from at random offsets:
 * every matrix differs, and gigabytes of weights take a second, not a minute. */
#define GT_POOL (1 << 22)
static float *gt_pool;

static inline void gt_fill_pool(float *f, size_t n, float scale)
{
    size_t i = 0;
    if (!gt_pool) {
        gt_pool = malloc(sizeof(float) * 2 * GT_POOL);
        for (i = 0; i < 2 * GT_POOL; i++)
            gt_pool[i] = moe_bf16_to_f32(moe_f32_to_bf16(gt_uniform()));
        i = 0;
    }
    while (i < n) {
        const size_t off = (size_t)gt_below(GT_POOL), len = n - i < GT_POOL ? n - i : GT_POOL;
        size_t j;
        for (j = 0; j < len; j++)
            f[i + j] = gt_pool[off + j] * scale; /* scale: a power of two keeps bf16 exactness */
        i += len;
    }
}

/* Fills f32 values uniform in [-scale, scale), rounded to bf16 so both dtypes hold them exactly;
 * bf16 copy in `b` if not NULL. */
static inline void gt_fill_bf16(float *f, uint16_t *b, size_t n, float scale)
{
    size_t i;
    for (i = 0; i < n; i++) {
        const uint16_t v = moe_f32_to_bf16(gt_uniform() * scale);
        if (f)
            f[i] = moe_bf16_to_f32(v);
        if (b)
            b[i] = v;
    }
}

static inline void *gt_dalloc(size_t bytes)
{
    void *p = NULL;
    if (moe_gpu_malloc(&p, bytes ? bytes : 16) != MOE_STATUS_SUCCESS) {
        fprintf(stderr, "moe_gpu_malloc(%zu): %s\n", bytes, moe_last_error());
        fail();
    }
    return p;
}

static inline void *gt_dup(const void *host, size_t bytes)
{
    void *p = gt_dalloc(bytes);
    assert_int_equal(moe_gpu_memcpy_h2d(p, host, bytes), MOE_STATUS_SUCCESS);
    return p;
}

/* cudaMemset may return before it is done, and the legacy stream it runs on does not order
 * non-blocking streams: wait, so no poison lands after the kernel under test wrote. */
static inline void gt_poison(void *dev, int byte, size_t bytes)
{
    assert_int_equal(moe_gpu_memset(dev, byte, bytes), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_gpu_device_synchronize(), MOE_STATUS_SUCCESS);
}

static inline void gt_get(void *host, const void *dev, size_t bytes)
{
    assert_int_equal(moe_gpu_device_synchronize(), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_gpu_memcpy_d2h(host, dev, bytes), MOE_STATUS_SUCCESS);
}

static inline void gt_ok(moe_status_t st, const char *what)
{
    if (st != MOE_STATUS_SUCCESS) {
        fprintf(stderr, "%s: %s: %s\n", what, moe_status_string(st), moe_last_error());
        fail();
    }
}

/* ||a - b|| / ||b|| over n values; NaN if any value of a is not finite. */
static inline double gt_rel_error(const float *a, const float *b, size_t n)
{
    double num = 0.0, den = 0.0;
    size_t i;
    for (i = 0; i < n; i++) {
        const double d = (double)a[i] - (double)b[i];
        if (!isfinite(a[i]))
            return NAN;
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0.0 ? sqrt(num / den) : sqrt(num);
}

static inline int gt_all_finite(const float *a, size_t n)
{
    size_t i;
    for (i = 0; i < n; i++)
        if (!isfinite(a[i]))
            return 0;
    return 1;
}

/* main(): skip (77) only without a device (gt_gpu_gate), else run the group (MOE_TEST_FILTER:
 * gt_test_filter). */
#define GT_MAIN(tests)                                                                             \
    int main(void)                                                                                 \
    {                                                                                              \
        int gate_ = gt_gpu_gate(1);                                                                \
        if (gate_)                                                                                 \
            return gate_;                                                                          \
        gt_seed();                                                                                 \
        gt_test_filter();                                                                          \
        return cmocka_run_group_tests(tests, NULL, NULL);                                          \
    }

#endif /* MOE_GPU_TEST_H */
