/* SPDX-License-Identifier: Apache-2.0 */
/* The oracle in the CUDA backend (one GPU): a tune file's variant is the one the layer runs
 * (bitwise the output of forcing it), its explanation names the file, a file that does not fit
 * leaves the built-in table with no error, forced variants are checked at create, and a decode
 * table sets the fused decode kernel's crossover. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "gpu_skip.h"
#include "kernels/gpu.h"
#include "runtime/oracle.h"
#include "launch/layer_gen.h"
#include "moe/moe.h"

/* A variant every sm_80+ device runs that the built-in tables never pick at 1 row/expert. */
#define TUNED_VARIANT "sm80_mma_m64n128"

static moe_runtime_t *rt;
static char path[256];
static int arch;
static char gpu[256];

static void ok(moe_status_t st, const char *what)
{
    if (st != MOE_STATUS_SUCCESS)
        fail_msg("%s: %s: %s", what, moe_status_string(st), moe_last_error());
}

static moe_layer_config_t config(void)
{
    moe_layer_config_t c = MOE_LAYER_CONFIG_INIT;
    c.num_experts = 8;
    c.top_k = 2;
    c.hidden = 256;
    c.intermediate = 512;
    c.max_tokens_per_rank = 64;
    return c;
}

/* A table of `kind` keyed to config()'s shape, bf16, on this device, with no buckets yet. */
static moe_oracle_group_t key_of(moe_oracle_kind_t kind)
{
    moe_oracle_group_t g;
    memset(&g, 0, sizeof(g));
    g.kind = kind;
    g.arch = arch;
    g.shape = (moe_oracle_shape_t){256, 512, 8, 2};
    g.dtype = MOE_DTYPE_BF16;
    g.scale = MOE_SCALE_NONE;
    g.transport = MOE_ORACLE_ANY;
    return g;
}

/* Bucket i of g: up to `max` (HUGE_VAL: open), `name`. */
static void set_bucket(moe_oracle_group_t *g, int i, double max, const char *name)
{
    g->bucket[i].max = max;
    snprintf(g->bucket[i].name, sizeof(g->bucket[i].name), "%s", name);
    g->num_buckets = i + 1;
}

/* The tune file at `path`: g alone, for the GPU named gpu_name. */
static void write_group(const char *gpu_name, moe_oracle_group_t *g)
{
    moe_oracle_table_t t;
    memset(&t, 0, sizeof(t));
    snprintf(t.gpu, sizeof(t.gpu), "%s", gpu_name);
    t.arch = arch;
    t.num_groups = 1;
    t.group = g;
    ok(moe_oracle_write(path, &t), "write tune file");
}

static void write_tune(const char *gpu_name, const char *variant)
{
    moe_oracle_group_t g = key_of(MOE_ORACLE_GEMM);
    set_bucket(&g, 0, HUGE_VAL, variant);
    write_group(gpu_name, &g);
}

/* Creates the layer under the current environment, runs T tokens, returns y (f32, host) and
 * the explanation. */
static float *run(int64_t T, char *why, size_t len)
{
    const moe_layer_config_t c = config();
    const size_t n = (size_t)T * (size_t)c.hidden;
    moe_layer_t *l = NULL;
    moe_forward_args_t a = MOE_FORWARD_ARGS_INIT;
    float *x = malloc(4 * n), *y = malloc(4 * n);
    void *dx, *dy;

    ok(moe_layer_create(rt, &c, &l), "create");
    ok(moe_gen_set_weights(l, &c, 7), "weights");
    ok(moe_layer_explain(l, T, why, len), "explain");
    moe_gen_tokens(11, 0, T, c.hidden, x);
    ok(moe_gpu_malloc(&dx, 4 * n), "malloc x");
    ok(moe_gpu_malloc(&dy, 4 * n), "malloc y");
    ok(moe_gpu_memcpy_h2d(dx, x, 4 * n), "x");
    a.num_tokens = T;
    a.dtype = MOE_DTYPE_F32;
    a.x = dx;
    a.y = dy;
    ok(moe_layer_forward(l, &a), "forward");
    ok(moe_layer_synchronize(l, NULL), "synchronize");
    ok(moe_gpu_memcpy_d2h(y, dy, 4 * n), "y");
    moe_gpu_free(dx);
    moe_gpu_free(dy);
    moe_layer_destroy(l);
    free(x);
    return y;
}

static void expect_in(const char *text, const char *needle)
{
    if (!strstr(text, needle))
        fail_msg("'%s' does not say '%s'", text, needle);
}

static void test_tuned_is_what_runs(void **state)
{
    const int64_t T = 4; /* 1 row per expert */
    char why_t[1024], why_f[1024], why_d[1024];
    float *yt, *yf, *yd;
    (void)state;
    unsetenv("MOE_TUNE_FILE");
    yd = run(T, why_d, sizeof(why_d));
    expect_in(why_d, "built-in table");

    write_tune(gpu, TUNED_VARIANT);
    setenv("MOE_TUNE_FILE", path, 1);
    yt = run(T, why_t, sizeof(why_t));
    unsetenv("MOE_TUNE_FILE");
    expect_in(why_t, TUNED_VARIANT " (tuned from ");
    expect_in(why_t, path);

    setenv("MOE_FORCE_VARIANT", TUNED_VARIANT, 1);
    yf = run(T, why_f, sizeof(why_f));
    unsetenv("MOE_FORCE_VARIANT");
    expect_in(why_f, TUNED_VARIANT " (forced by MOE_FORCE_VARIANT)");
    assert_memory_equal(yt, yf, sizeof(float) * (size_t)T * 256);
    print_message("default: %s\ntuned: %s\n", why_d, why_t);
    free(yt), free(yf), free(yd);
}

/* A tune file's decode table (moe-tune's crossover of the fused decode kernel): the layer runs
 * the kernel up to the table's bound and the grouped path above it, says so with the file's
 * name, and at the bound computes what the forced kernel computes. */
static void test_tuned_decode_crossover(void **state)
{
    moe_oracle_group_t g = key_of(MOE_ORACLE_DECODE);
    char why_t[1024], why_f[1024], why_9[1024];
    float *yt, *yf, *y9;
    (void)state;
    if (arch != 90) {
        print_message("sm_%d: the fused decode kernel runs on sm_90 only\n", arch);
        skip();
    }
    set_bucket(&g, 0, 8, MOE_ORACLE_FUSED_DECODE);
    set_bucket(&g, 1, HUGE_VAL, MOE_ORACLE_GROUPED_PATH);
    write_group(gpu, &g);
    setenv("MOE_TUNE_FILE", path, 1);
    yt = run(8, why_t, sizeof(why_t));
    y9 = run(9, why_9, sizeof(why_9));
    unsetenv("MOE_TUNE_FILE");
    expect_in(why_t, MOE_ORACLE_FUSED_DECODE);
    expect_in(why_t, "at up to 8 tokens (crossover tuned from ");
    expect_in(why_t, path);
    if (strstr(why_9, MOE_ORACLE_FUSED_DECODE))
        fail_msg("9 tokens, past the tuned crossover: '%s'", why_9);
    setenv("MOE_FORCE_VARIANT", MOE_ORACLE_FUSED_DECODE, 1);
    yf = run(8, why_f, sizeof(why_f));
    unsetenv("MOE_FORCE_VARIANT");
    assert_memory_equal(yt, yf, sizeof(float) * 8 * 256);
    print_message("tuned decode: %s\n", why_t);
    free(yt), free(yf), free(y9);
}

static void test_bad_files_leave_defaults(void **state)
{
    char why[1024];
    float *y;
    (void)state;
    write_tune("Some Other GPU", TUNED_VARIANT); /* another GPU */
    setenv("MOE_TUNE_FILE", path, 1);
    y = run(4, why, sizeof(why));
    expect_in(why, "built-in table");
    free(y);
    { /* stale: a variant this build does not have */
        FILE *f = fopen(path, "w");
        assert_non_null(f);
        fprintf(f,
                "{\"libmoe_tune\": 1, \"gpu\": \"%s\", \"arch\": %d, \"gemm\": [{\"dtype\": "
                "\"bf16\", \"scales\": \"none\", \"buckets\": [{\"variant\": \"sm90_gone\"}]}]}",
                gpu, arch);
        fclose(f);
    }
    y = run(4, why, sizeof(why));
    expect_in(why, "built-in table");
    free(y);
    setenv("MOE_TUNE_FILE", "/nonexistent/tune.json", 1);
    y = run(4, why, sizeof(why));
    expect_in(why, "built-in table");
    free(y);
    unsetenv("MOE_TUNE_FILE");
}

static void expect_create(moe_status_t want, const char *needle)
{
    const moe_layer_config_t c = config();
    moe_layer_t *l = NULL;
    moe_status_t st = moe_layer_create(rt, &c, &l);
    if (st != want)
        fail_msg("want %s, got %s (%s)", moe_status_string(want), moe_status_string(st),
                 moe_last_error());
    expect_in(moe_last_error(), needle);
    moe_layer_destroy(l);
}

static void test_forced_checked(void **state)
{
    (void)state;
    setenv("MOE_FORCE_VARIANT", "sm90_fp8_m64n128", 1); /* an e4m3 variant, a bf16 layer */
    expect_create(MOE_STATUS_NOT_SUPPORTED, "MOE_FORCE_VARIANT=sm90_fp8_m64n128");
    setenv("MOE_FORCE_VARIANT", "sm90_nope", 1);
    expect_create(MOE_STATUS_INVALID_ARGUMENT, "MOE_FORCE_VARIANT=sm90_nope: no such variant");
    setenv("MOE_FORCE_VARIANT", "sm80_mma_m32n128", 1);
    setenv("MOE_GEMM_VARIANT", "sm80_mma_m64n128", 1);
    expect_create(MOE_STATUS_INVALID_ARGUMENT, "disagree");
    unsetenv("MOE_FORCE_VARIANT");
    /* the old name goes through the same checks: a variant of the other arch */
    setenv("MOE_GEMM_VARIANT", arch == 90 ? "sm90_fp8_block_m64n128" : "sm90_swapab_n16", 1);
    expect_create(MOE_STATUS_NOT_SUPPORTED, "MOE_GEMM_VARIANT=");
    unsetenv("MOE_GEMM_VARIANT");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tuned_is_what_runs),
        cmocka_unit_test(test_tuned_decode_crossover),
        cmocka_unit_test(test_bad_files_leave_defaults),
        cmocka_unit_test(test_forced_checked),
    };
    moe_runtime_config_t rc = MOE_RUNTIME_CONFIG_INIT;
    const char *tmp = getenv("TMPDIR");
    int gate = gt_gpu_gate(1), dev = 0, r;

    if (gate)
        return gate;
    rc.backend = MOE_BACKEND_CUDA;
    if (moe_runtime_create(&rc, NULL, &rt) != MOE_STATUS_SUCCESS ||
        moe_gpu_get_device(&dev) != MOE_STATUS_SUCCESS ||
        moe_gpu_arch(dev, &arch) != MOE_STATUS_SUCCESS ||
        moe_gpu_name(dev, gpu, sizeof(gpu)) != MOE_STATUS_SUCCESS) {
        fprintf(stderr, "CUDA runtime: %s\n", moe_last_error());
        return 1;
    }
    snprintf(path, sizeof(path), "%s/moe_test_gpu_oracle_%d.json", tmp && *tmp ? tmp : "/tmp",
             (int)getpid());
    unsetenv("MOE_FORCE_VARIANT");
    unsetenv("MOE_GEMM_VARIANT");
    r = cmocka_run_group_tests(tests, NULL, NULL);
    unlink(path);
    moe_runtime_destroy(rt);
    return r;
}
