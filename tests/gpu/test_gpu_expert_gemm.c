/* SPDX-License-Identifier: Apache-2.0 */
/* Every compiled grouped-GEMM variant against a float host reference: uneven rows per expert
 * (0 and 1 too), padding blocks, unused trailing blocks, all epilogues, row_scale, bf16/f32
 * output, the three model shapes; outputs poisoned with NaN first. Exit 77 without a GPU.
 * The inputs are e4m3 values times a power-of-two scale per row and per 128-wide k block (exact
 * in bf16), so the FP8 variants (e4m3 codes with per-row scales of both operands, or with 1 x
 * 128 / 128 x 128 block scales) have the same reference. */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/cuda_ok.h"
#include "kernels/expert_gemm_table.h"
#include "runtime/oracle.h"
#include "gpu_skip.h"
#include "base/diag.h"

#define TOL 1e-2

typedef struct shape {
    const char *name;
    int num_experts, n, k;
    int rows[8];
} shape_t;

static const shape_t shapes[] = {
    {"small", 5, 256, 128, {0, 1, 3, 17, 130}},
    {"small2", 3, 768, 320, {64, 0, 9}},
    {"mixtral_w13", 2, 28672, 4096, {3, 1}},
    {"mixtral_w2", 2, 4096, 14336, {2, 5}},
    {"qwen3_w13", 8, 1536, 2048, {1, 0, 9, 2, 0, 0, 33, 1}},
    {"qwen3_w2", 8, 2048, 768, {1, 0, 9, 2, 0, 0, 33, 1}},
    {"dsv3_w13", 3, 4096, 7168, {2, 0, 5}},
    {"dsv3_w2", 3, 7168, 2048, {2, 0, 5}},
    /* K and N tails: HF's tiny test configs (H 64, I 96), Qwen3-30B-A3B and Qwen2-MoE at TP8
     * (I 96, 176), gpt-oss (2880), and a k one 16-byte unit past a tile (1032). */
    {"tiny_w13", 3, 192, 64, {5, 0, 40}},
    {"tiny_w2", 3, 64, 96, {5, 0, 40}},
    {"qwen3_tp8_w13", 4, 192, 2048, {1, 9, 0, 70}},
    {"qwen3_tp8_w2", 4, 2048, 96, {1, 9, 0, 70}},
    {"qwen2_tp8_w13", 3, 352, 2048, {2, 33, 1}},
    {"qwen2_tp8_w2", 3, 2048, 176, {2, 33, 1}},
    {"gptoss_w13", 2, 5760, 2880, {3, 20}},
    {"gptoss_w2", 2, 2880, 2880, {3, 20}},
    {"odd", 3, 208, 1032, {1, 65, 7}},
    /* one expert, as the shared MLP runs (test_gpu_fp8's DeepSeek-like shape: H 2048, shared
     * 512), and its routed I 384 (three 128-wide k slices in a four-slice stage) */
    {"shared_w13", 1, 1024, 2048, {7}},
    {"shared_w2", 1, 2048, 512, {1}},
    {"i384_w2", 4, 2048, 384, {1, 0, 7, 2}},
};

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static float rnd(void) /* uniform [-1, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (float)((rng_state >> 40) * (1.0 / 8388608.0)) - 1.0f;
}

static uint16_t f2bf(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static float bf2f(uint16_t h)
{
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static float act_mul(moe_gemm_epilogue_t epi, float g, float u)
{
    if (epi == MOE_GEMM_EPI_SILU_MUL)
        return g / (1.0f + expf(-g)) * u;
    float t = tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g));
    return 0.5f * g * (1.0f + t) * u;
}

/* OCP e4m3fn: 0x7f / 0xff NaN, no Inf. */
static float e4m3_value(uint8_t c)
{
    const int e = (c >> 3) & 15, m = c & 7;
    const float v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
    if ((c & 0x7f) == 0x7f)
        return NAN;
    return c & 0x80 ? -v : v;
}

/* A random e4m3 code of magnitude in [2^-4, 2^2) or 0. */
static uint8_t rnd_e4m3(void)
{
    const float u = rnd();
    const int e = 3 + (int)((u + 1.0f) * 3.0f) % 6; /* biased exponent 3..8 */
    const int m = (int)((rnd() + 1.0f) * 4.0f) & 7;
    if (u > 0.98f)
        return 0;
    return (uint8_t)((rnd() < 0 ? 0x80 : 0) | e << 3 | m);
}

/* The code of v * 2^d for an e4m3 code of v (0 stays 0; the exponents used stay normal). */
static uint8_t e4m3_shift(uint8_t c, int d)
{
    const int e = (c >> 3) & 15;
    return (c & 0x7f) == 0 ? c : (uint8_t)((c & 0x87) | (e + d) << 3);
}

/* One shape's inputs: token rows per expert (bf16 as float too) and the reference a . b^T.
 * x = q * xs[row] * 2^(kb % 2) and w = q * ws[row] * 2^((kb / 2) % 2) for the 128-wide k block
 * kb (the product of the two block factors varies along k, so a slice's scales read from the
 * wrong k block show):
 * per-row codes (x8, w8) fold the block factor in, block codes (x8b, w8b) leave it to the
 * block scales; the weights' block scales also vary by expert and 128-row block, as a
 * checkpoint's do (within a block the rows share them; ws[row]'s variation is in w8b). */
typedef struct inputs {
    const shape_t *s;
    int total_rows;
    int row_off[9]; /* first logical row of each expert */
    uint16_t *x;    /* [total_rows, k] */
    uint8_t *x8;    /* [total_rows, k] e4m3 codes of x / xs */
    uint8_t *x8b;   /* [total_rows, k] e4m3 codes of x / (xs 2^(kb % 2)) */
    float *xs;      /* [total_rows] */
    float *ref;     /* [total_rows, n] */
    void *d_b;      /* device weights */
    void *d_b8;     /* device e4m3 weights */
    float *d_bs;    /* device [num_experts * n] scales of the weight rows */
    void *d_b8b;    /* device e4m3 weights for block scales */
    float *d_bsb;   /* device [num_experts * n][kbn] block scales (expanded per weight row) */
    /* device [num_experts * n] one scale for all rows (per-tensor weights expanded: the runs with
     * moe_gemm_args_t.b_scale_uniform), 2^wexp where d_bs has 2^(wexp - row % 3): the product of
     * weight row `row` with a row of x is ref's times 2^(row % 3) */
    float *d_bsu;
} inputs_t;

static void make_inputs(const shape_t *s, inputs_t *in)
{
    size_t k = (size_t)s->k, n = (size_t)s->n;
    in->s = s;
    in->total_rows = 0;
    for (int e = 0; e < s->num_experts; e++) {
        in->row_off[e] = in->total_rows;
        in->total_rows += s->rows[e];
    }
    in->row_off[s->num_experts] = in->total_rows;
    in->x = malloc(sizeof(uint16_t) * (size_t)(in->total_rows ? in->total_rows : 1) * k);
    in->x8 = malloc((size_t)(in->total_rows ? in->total_rows : 1) * k);
    in->x8b = malloc((size_t)(in->total_rows ? in->total_rows : 1) * k);
    in->xs = malloc(sizeof(float) * (size_t)(in->total_rows ? in->total_rows : 1));
    for (int r = 0; r < in->total_rows; r++) {
        in->xs[r] = ldexpf(1.0f, (int)((rnd() + 1.0f) * 2.0f) - 2); /* 1/4 .. 2 */
        for (size_t i = 0; i < k; i++) {
            const size_t at = (size_t)r * k + i;
            in->x8b[at] = rnd_e4m3();
            in->x8[at] = e4m3_shift(in->x8b[at], (int)(i / 128) % 2);
            in->x[at] = f2bf(e4m3_value(in->x8[at]) * in->xs[r]);
        }
    }
    size_t wcount = (size_t)s->num_experts * n * k;
    uint16_t *w = malloc(sizeof(uint16_t) * wcount);
    uint8_t *w8 = malloc(wcount), *w8b = malloc(wcount);
    float *ws = malloc(sizeof(float) * (size_t)s->num_experts * n);
    const size_t kbn = (k + 127) / 128;
    float *wsb = malloc(sizeof(float) * (size_t)s->num_experts * n * kbn);
    /* magnitude ~ 2/sqrt(k): codes ~1 times 2^-(log2(k)/2) per row, varied by row */
    const int wexp = -(int)(log2((double)k) / 2.0);
    for (size_t row = 0; row < (size_t)s->num_experts * n; row++) {
        /* Block scales are one per 128 x 128 block of each matrix: g, a factor per expert and
         * 128-row block (blocks of gate and up coincide with those of the whole when n/2 is a
         * multiple of 128; else one per expert), the row's own factor in its codes. */
        const size_t e = row / n, local = row % n;
        const int g = (int)((e + ((n / 2) % 128 == 0 ? local / 128 : 0)) % 3);
        ws[row] = ldexpf(1.0f, wexp - (int)(row % 3));
        for (size_t i = 0; i < k; i++) {
            const uint8_t q = rnd_e4m3();
            w8b[row * k + i] = e4m3_shift(q, g - (int)(row % 3));
            w8[row * k + i] = e4m3_shift(q, (int)((i / 256) % 2));
            w[row * k + i] = f2bf(e4m3_value(w8[row * k + i]) * ws[row]);
        }
        for (size_t b = 0; b < kbn; b++)
            wsb[row * kbn + b] = ldexpf(1.0f, wexp - g) * ((b / 2) % 2 ? 2.0f : 1.0f);
    }
    CUDA_OK(cudaMalloc(&in->d_b, wcount * 2));
    CUDA_OK(cudaMemcpy(in->d_b, w, wcount * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMalloc(&in->d_b8, wcount));
    CUDA_OK(cudaMemcpy(in->d_b8, w8, wcount, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMalloc((void **)&in->d_bs, sizeof(float) * (size_t)s->num_experts * n));
    CUDA_OK(cudaMemcpy(in->d_bs, ws, sizeof(float) * (size_t)s->num_experts * n,
                       cudaMemcpyHostToDevice));
    for (size_t row = 0; row < (size_t)s->num_experts * n; row++)
        ws[row] = ldexpf(1.0f, wexp);
    CUDA_OK(cudaMalloc((void **)&in->d_bsu, sizeof(float) * (size_t)s->num_experts * n));
    CUDA_OK(cudaMemcpy(in->d_bsu, ws, sizeof(float) * (size_t)s->num_experts * n,
                       cudaMemcpyHostToDevice));
    CUDA_OK(cudaMalloc(&in->d_b8b, wcount));
    CUDA_OK(cudaMemcpy(in->d_b8b, w8b, wcount, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMalloc((void **)&in->d_bsb, sizeof(float) * (size_t)s->num_experts * n * kbn));
    CUDA_OK(cudaMemcpy(in->d_bsb, wsb, sizeof(float) * (size_t)s->num_experts * n * kbn,
                       cudaMemcpyHostToDevice));
    free(w8);
    free(w8b);
    free(ws);
    free(wsb);
    in->ref = malloc(sizeof(float) * (size_t)(in->total_rows ? in->total_rows : 1) * n);
    float *xf = malloc(sizeof(float) * k), *wf = malloc(sizeof(float) * k * 64);
    for (int e = 0; e < s->num_experts; e++) {
        for (size_t j0 = 0; j0 < n; j0 += 64) {
            const size_t nj = n - j0 < 64 ? n - j0 : 64; /* n tail */
            for (size_t j = 0; j < nj; j++)
                for (size_t i = 0; i < k; i++)
                    wf[j * k + i] = bf2f(w[((size_t)e * n + j0 + j) * k + i]);
            for (int r = in->row_off[e]; r < in->row_off[e + 1]; r++) {
                for (size_t i = 0; i < k; i++)
                    xf[i] = bf2f(in->x[(size_t)r * k + i]);
                for (size_t j = 0; j < nj; j++) {
                    float acc[8] = {0};
                    for (size_t i = 0; i < k; i += 8)
                        for (int q = 0; q < 8; q++)
                            acc[q] += xf[i + q] * wf[j * k + i + q];
                    in->ref[(size_t)r * n + j0 + j] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) +
                                                      ((acc[4] + acc[5]) + (acc[6] + acc[7]));
                }
            }
        }
    }
    free(xf);
    free(wf);
    free(w);
}

static void free_inputs(inputs_t *in)
{
    free(in->x);
    free(in->x8);
    free(in->x8b);
    free(in->xs);
    free(in->ref);
    cudaFree(in->d_b);
    cudaFree(in->d_b8);
    cudaFree(in->d_bs);
    cudaFree(in->d_b8b);
    cudaFree(in->d_bsb);
    cudaFree(in->d_bsu);
}

static int failures, checks;

/* The arguments both checks below share: variant v's operands of `in` (bf16, e4m3 with per-row
 * or block scales), d_a / d_as the A rows and their scales, max_blocks blocks of it. */
static moe_gemm_args_t args_for(const moe_gemm_variant_t *v, const inputs_t *in, void *d_a,
                                const float *d_as, void *d_c, const int32_t *d_be,
                                const int32_t *d_nb, int max_blocks, int num_experts)
{
    const int f8 = v->ab_dtype == MOE_DTYPE_FP8_E4M3;
    const int blk = f8 && v->scale_kind == MOE_SCALE_BLOCK_128;
    moe_gemm_args_t args;
    memset(&args, 0, sizeof(args));
    args.a = d_a;
    args.b = blk ? in->d_b8b : f8 ? in->d_b8 : in->d_b;
    args.c = d_c;
    args.a_scale = f8 ? d_as : NULL;
    args.b_scale = blk ? in->d_bsb : f8 ? in->d_bs : NULL;
    args.block_expert = d_be;
    args.num_blocks = d_nb;
    args.max_blocks = max_blocks;
    args.num_experts = num_experts;
    args.n = in->s->n;
    args.k = in->s->k;
    args.ab_dtype = v->ab_dtype;
    args.scale_kind = v->scale_kind;
    return args;
}

/* Runs one variant on one shape with every epilogue x output dtype x row_scale. */
static void run_variant(const moe_gemm_variant_t *v, const inputs_t *in)
{
    const shape_t *s = in->s;
    const int br = v->block_rows, k = s->k, n = s->n;
    const int f8 = v->ab_dtype == MOE_DTYPE_FP8_E4M3;
    const int blk = f8 && v->scale_kind == MOE_SCALE_BLOCK_128;
    const size_t kbn = blk ? ((size_t)k + 127) / 128 : 1; /* scales per A row */
    /* Block list: a padding block after expert 0's blocks, then the rest; two trailing blocks
     * past num_blocks (naming expert 0) must be left alone. */
    int be[512], row_of_block[512], nblk = 0;
    /* the permute's expert_counts / expert_offsets (first padded row) for this list */
    int32_t counts[64], offsets[65];
    for (int e = 0; e < s->num_experts; e++) {
        counts[e] = s->rows[e];
        offsets[e] = nblk * br;
        for (int r = 0; r < s->rows[e]; r += br) {
            be[nblk] = e;
            row_of_block[nblk++] = in->row_off[e] + r;
        }
        if (e == 0) {
            be[nblk] = -1;
            row_of_block[nblk++] = -1;
        }
    }
    const int num_blocks = nblk, max_blocks = nblk + 2;
    offsets[s->num_experts] = nblk * br;
    be[nblk] = 0;
    be[nblk + 1] = 0;
    row_of_block[nblk] = row_of_block[nblk + 1] = -1;
    /* logical row of each padded row (-1: pad row or unused block) */
    size_t prow = (size_t)max_blocks * br;
    int *logical = malloc(sizeof(int) * prow);
    uint16_t *a = malloc(sizeof(uint16_t) * prow * k);
    uint8_t *a8 = malloc(prow * k);
    float *scale = malloc(sizeof(float) * prow), *as = malloc(sizeof(float) * prow * kbn);
    for (size_t i = 0; i < prow * k; i++) {
        a[i] = 0x7fc0; /* NaN in pad rows: must not leak into real rows */
        a8[i] = 0x7f;
    }
    for (int b = 0; b < max_blocks; b++) {
        int e = b < num_blocks ? be[b] : -1;
        for (int r = 0; r < br; r++) {
            size_t pr = (size_t)b * br + r;
            int lr = e >= 0 ? row_of_block[b] + r : -1;
            if (e >= 0 && lr >= in->row_off[e + 1])
                lr = -1;
            logical[pr] = lr;
            scale[pr] = 0.5f + 0.5f * (rnd() + 1.0f);
            for (size_t kb = 0; kb < kbn; kb++)
                as[pr * kbn + kb] = lr < 0 ? 1.0f : in->xs[lr] * (kb % 2 ? 2.0f : 1.0f);
            if (lr >= 0) {
                memcpy(a + pr * k, in->x + (size_t)lr * k, sizeof(uint16_t) * k);
                memcpy(a8 + pr * k, (blk ? in->x8b : in->x8) + (size_t)lr * k, (size_t)k);
            }
        }
    }
    void *d_a, *d_c;
    float *d_scale, *d_as;
    int32_t *d_be, *d_nb, *d_counts, *d_offsets;
    CUDA_OK(cudaMalloc((void **)&d_counts, sizeof(counts)));
    CUDA_OK(cudaMalloc((void **)&d_offsets, sizeof(offsets)));
    CUDA_OK(cudaMemcpy(d_counts, counts, sizeof(counts), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_offsets, offsets, sizeof(offsets), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMalloc(&d_a, prow * k * 2));
    CUDA_OK(cudaMalloc((void **)&d_as, prow * 4 * kbn));
    CUDA_OK(cudaMemcpy(d_as, as, prow * 4 * kbn, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMalloc(&d_c, prow * n * 4));
    CUDA_OK(cudaMalloc((void **)&d_scale, prow * 4));
    CUDA_OK(cudaMalloc((void **)&d_be, max_blocks * 4));
    CUDA_OK(cudaMalloc((void **)&d_nb, 4));
    if (f8)
        CUDA_OK(cudaMemcpy(d_a, a8, prow * k, cudaMemcpyHostToDevice));
    else
        CUDA_OK(cudaMemcpy(d_a, a, prow * k * 2, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_scale, scale, prow * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_be, be, max_blocks * 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(d_nb, &num_blocks, 4, cudaMemcpyHostToDevice));
    void *c = malloc(prow * n * 4);
    /* fp8 *_MUL: each row's max |c| as stored (row_amax), per 128 columns with block scales */
    const int amax_g = blk ? (n / 2 + 127) / 128 : 1;
    float *amax = malloc(sizeof(float) * prow * amax_g), *d_amax;
    CUDA_OK(cudaMalloc((void **)&d_amax, sizeof(float) * prow * amax_g));

    for (int epi = 0; epi < 3; epi++)
        for (int f32 = 0; f32 < 2; f32++)
            for (int use_scale = 0; use_scale < 2; use_scale++) {
                int n_out = epi == MOE_GEMM_EPI_STORE ? n : n / 2;
                moe_gemm_args_t args =
                    args_for(v, in, d_a, d_as, d_c, d_be, d_nb, max_blocks, s->num_experts);
                args.row_scale = use_scale ? d_scale : NULL;
                args.epilogue = (moe_gemm_epilogue_t)epi;
                args.c_f32 = f32;
                if (use_scale) { /* half the runs may skip all-padding rows (the layer's way) */
                    args.expert_counts = d_counts;
                    args.expert_offsets = d_offsets;
                }
                /* per-row fp8, bf16 out with row_scale: one weight scale for every row, said
                 * (MOE_GEMM_B_UNIFORM=1 from main: the normal tiles read one) */
                const int uni = f8 && !blk && use_scale && !f32;
                if (uni) {
                    args.b_scale = in->d_bsu;
                    args.b_scale_uniform = 1;
                }
                /* half the runs with the first weight stages before the PDL wait (the tables
                 * were copied before the launch: final, as early_weights promises) */
                args.early_weights = (epi + f32 + use_scale) % 2;
                const int take_amax = f8 && epi != MOE_GEMM_EPI_STORE;
                if (take_amax) {
                    args.row_amax = d_amax;
                    CUDA_OK(cudaMemset(d_amax, 0, sizeof(float) * prow * amax_g));
                }
                CUDA_OK(cudaMemset(d_c, 0xff, prow * n * 4)); /* NaN in bf16 and f32 */
                moe_status_t st = v->launch(&args, NULL);
                CUDA_OK(cudaDeviceSynchronize());
                CUDA_OK(cudaMemcpy(c, d_c, prow * n_out * (f32 ? 4 : 2), cudaMemcpyDeviceToHost));
                double err2 = 0, ref2 = 0;
                long bad_nan = 0, bad_written = 0, bad_amax = 0;
                if (take_amax) { /* equal to the maxima of what c holds (NaN dropped) */
                    CUDA_OK(cudaMemcpy(amax, d_amax, sizeof(float) * prow * amax_g,
                                       cudaMemcpyDeviceToHost));
                    for (size_t pr = 0; pr < prow; pr++)
                        for (int g = 0; g < amax_g; g++) {
                            float m = 0.0f;
                            for (int j = g * 128; j < n_out && (!blk || j < g * 128 + 128); j++) {
                                const size_t idx = pr * n_out + j;
                                const float got =
                                    f32 ? ((float *)c)[idx] : bf2f(((uint16_t *)c)[idx]);
                                if (!isnan(got))
                                    m = fmaxf(m, fabsf(got));
                            }
                            bad_amax += amax[pr * amax_g + g] != m;
                        }
                }
                for (size_t pr = 0; pr < prow; pr++) {
                    int lr = logical[pr];
                    int b = (int)(pr / br);
                    int untouched = b >= num_blocks || be[b] < 0;
                    for (int j = 0; j < n_out; j++) {
                        size_t idx = pr * n_out + j;
                        float got = f32 ? ((float *)c)[idx] : bf2f(((uint16_t *)c)[idx]);
                        if (untouched) {
                            uint32_t bits = f32 ? ((uint32_t *)c)[idx] : ((uint16_t *)c)[idx];
                            bad_written += bits != (f32 ? 0xffffffffu : 0xffffu);
                            continue;
                        }
                        if (lr < 0)
                            continue;
                        const float *rr = in->ref + (size_t)lr * n;
                        /* uni: weight row (expert, col)'s scale 2^(row % 3) times d_bs's */
                        const size_t wrow = (size_t)be[b] * n;
                        const float fg = uni ? ldexpf(1.0f, (int)((wrow + j) % 3)) : 1.0f,
                                    fu = uni ? ldexpf(1.0f, (int)((wrow + n / 2 + j) % 3)) : 1.0f;
                        float want =
                            epi == MOE_GEMM_EPI_STORE
                                ? rr[j] * fg
                                : act_mul((moe_gemm_epilogue_t)epi, rr[j] * fg, rr[n / 2 + j] * fu);
                        if (use_scale)
                            want *= scale[pr];
                        if (isnan(got)) {
                            bad_nan++;
                            continue;
                        }
                        err2 += (double)(got - want) * (got - want);
                        ref2 += (double)want * want;
                    }
                }
                double rel = ref2 > 0 ? sqrt(err2 / ref2) : sqrt(err2);
                int ok = st == MOE_STATUS_SUCCESS && bad_nan == 0 && bad_written == 0 &&
                         bad_amax == 0 && rel <= TOL;
                checks++;
                failures += !ok;
                printf("%-26s %-12s %-5s %-4s %-5s %-3s rel %.2e nan %ld stray %ld amax %ld "
                       "%s%s%s\n",
                       v->name, s->name,
                       epi == 0   ? "store"
                       : epi == 1 ? "silu"
                                  : "gelu",
                       f32 ? "f32" : "bf16", use_scale ? "scale" : "-", uni ? "uni" : "-", rel,
                       bad_nan, bad_written, bad_amax, ok ? "ok" : "FAIL", st ? " " : "",
                       st ? moe_last_error() : "");
            }
    free(c);
    free(amax);
    cudaFree(d_amax);
    free(a);
    free(a8);
    free(scale);
    free(as);
    free(logical);
    cudaFree(d_a);
    cudaFree(d_as);
    cudaFree(d_c);
    cudaFree(d_scale);
    cudaFree(d_be);
    cudaFree(d_nb);
    cudaFree(d_counts);
    cudaFree(d_offsets);
}

static void expect(int cond, const char *what)
{
    checks++;
    if (!cond) {
        failures++;
        printf("FAIL: %s (%s)\n", what, moe_last_error());
    }
}

/* A row's output does not depend on where it sits in its tile or block (deterministic mode's
 * batch invariance rests on it: a token's rows move with the batch around them). One expert,
 * 128 rows (and the last block's padding) made of 64 distinct rows repeated: every row must
 * equal bitwise its copy in rows 0..63, another warpgroup's or another item's. */
static void check_row_invariant(const moe_gemm_variant_t *v, const inputs_t *in)
{
    const shape_t *s = in->s;
    const int br = v->block_rows, k = s->k, n = s->n;
    const int f8 = v->ab_dtype == MOE_DTYPE_FP8_E4M3;
    const int blk = f8 && v->scale_kind == MOE_SCALE_BLOCK_128;
    const size_t kbn = blk ? ((size_t)k + 127) / 128 : 1;
    const int nblk = (128 + br - 1) / br;
    const size_t prow = (size_t)nblk * br, esz = f8 ? 1 : 2;
    uint8_t *a = malloc(prow * (size_t)k * esz);
    float *as = malloc(sizeof(float) * prow * kbn), *c = malloc(sizeof(float) * prow * n);
    int32_t be[64] = {0};
    for (size_t i = 0; i < 64 * (size_t)k; i++) {
        const uint8_t q = rnd_e4m3();
        if (f8)
            a[i] = q;
        else
            ((uint16_t *)a)[i] = f2bf(e4m3_value(q));
    }
    for (size_t r = 64; r < prow; r++)
        memcpy(a + r * k * esz, a + (r % 64) * k * esz, (size_t)k * esz);
    for (size_t i = 0; i < prow * kbn; i++)
        as[i] = 1.0f;
    void *d_a, *d_c;
    float *d_as;
    int32_t *d_be, *d_nb;
    CUDA_OK(cudaMalloc(&d_a, prow * k * esz));
    CUDA_OK(cudaMemcpy(d_a, a, prow * k * esz, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMalloc((void **)&d_as, sizeof(float) * prow * kbn));
    CUDA_OK(cudaMemcpy(d_as, as, sizeof(float) * prow * kbn, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMalloc(&d_c, sizeof(float) * prow * n));
    CUDA_OK(cudaMalloc((void **)&d_be, sizeof(be)));
    CUDA_OK(cudaMemcpy(d_be, be, sizeof(be), cudaMemcpyHostToDevice));
    CUDA_OK(cudaMalloc((void **)&d_nb, 4));
    CUDA_OK(cudaMemcpy(d_nb, &nblk, 4, cudaMemcpyHostToDevice));
    moe_gemm_args_t args = args_for(v, in, d_a, d_as, d_c, d_be, d_nb, nblk, 1);
    args.epilogue = MOE_GEMM_EPI_STORE;
    args.c_f32 = 1;
    CUDA_OK(cudaMemset(d_c, 0xff, sizeof(float) * prow * n));
    const moe_status_t st = v->launch(&args, NULL);
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(c, d_c, sizeof(float) * prow * n, cudaMemcpyDeviceToHost));
    long differ = 0, nans = 0;
    for (size_t r = 0; r < prow; r++)
        for (int j = 0; j < n; j++) {
            nans += isnan(c[r * n + j]);
            differ += memcmp(&c[r * n + j], &c[(r % 64) * n + j], 4) != 0;
        }
    const int ok = st == MOE_STATUS_SUCCESS && nans == 0 && differ == 0;
    checks++;
    failures += !ok;
    printf("%-26s %-12s row-invariant (%zu rows of 64 repeated): nan %ld differ %ld %s\n", v->name,
           s->name, prow, nans, differ, ok ? "ok" : "FAIL");
    free(a);
    free(as);
    free(c);
    cudaFree(d_a);
    cudaFree(d_as);
    cudaFree(d_c);
    cudaFree(d_be);
    cudaFree(d_nb);
}

/* Bad arguments give a status and a message, never a launch. */
static void check_rejects(const moe_gemm_variant_t *v, const inputs_t *in)
{
    moe_gemm_args_t args;
    memset(&args, 0, sizeof(args));
    void *d;
    CUDA_OK(cudaMalloc(&d, 1 << 20));
    args.a = d;
    args.b = in->d_b;
    args.c = d;
    args.block_expert = d;
    args.num_blocks = d;
    args.max_blocks = 1;
    args.num_experts = 1;
    args.n = 256;
    args.k = 100; /* rows of 200 bytes: not whole 16-byte units */
    args.ab_dtype = v->ab_dtype;
    args.scale_kind = v->scale_kind;
    args.a_scale = args.b_scale = (const float *)d;
    expect(v->launch(&args, NULL) == MOE_STATUS_NOT_SUPPORTED && strstr(moe_last_error(), "100"),
           "k = 100 rejected");
    args.k = 128;
    args.ab_dtype = v->ab_dtype == MOE_DTYPE_BF16 ? MOE_DTYPE_FP8_E4M3 : MOE_DTYPE_BF16;
    expect(v->launch(&args, NULL) == MOE_STATUS_NOT_SUPPORTED, "other dtype rejected");
    args.ab_dtype = v->ab_dtype;
    args.scale_kind =
        v->scale_kind == MOE_SCALE_BLOCK_128 ? MOE_SCALE_PER_CHANNEL : MOE_SCALE_BLOCK_128;
    expect(v->launch(&args, NULL) == MOE_STATUS_NOT_SUPPORTED, "other scale kind rejected");
    args.scale_kind = v->scale_kind;
    if (v->ab_dtype == MOE_DTYPE_FP8_E4M3) {
        args.b_scale = NULL;
        expect(v->launch(&args, NULL) == MOE_STATUS_NOT_SUPPORTED, "fp8 without scales rejected");
        args.b_scale = (const float *)d;
        args.k = 1032; /* whole 16-byte units of bf16, not of e4m3 */
        expect(v->launch(&args, NULL) == MOE_STATUS_NOT_SUPPORTED, "fp8 k = 1032 rejected");
        args.k = 128;
    }
    args.expert_counts = (const int32_t *)d; /* without expert_offsets */
    expect(v->launch(&args, NULL) == MOE_STATUS_INVALID_ARGUMENT &&
               strstr(moe_last_error(), "both or neither"),
           "expert_counts without expert_offsets rejected");
    args.expert_counts = NULL;
    args.row_amax = (float *)d; /* maxima of a STORE epilogue's rows: not taken */
    expect(v->launch(&args, NULL) == MOE_STATUS_NOT_SUPPORTED &&
               strstr(moe_last_error(), "row_amax"),
           "row_amax with STORE rejected");
    args.epilogue = MOE_GEMM_EPI_SILU_MUL; /* bf16 variants take none */
    if (v->ab_dtype != MOE_DTYPE_FP8_E4M3)
        expect(v->launch(&args, NULL) == MOE_STATUS_NOT_SUPPORTED &&
                   strstr(moe_last_error(), "row_amax"),
               "row_amax of a bf16 variant rejected");
    args.epilogue = MOE_GEMM_EPI_STORE;
    args.row_amax = NULL;
    args.a = NULL;
    expect(v->launch(&args, NULL) == MOE_STATUS_INVALID_ARGUMENT, "a = NULL rejected");
    args.a = d;
    args.n = 204; /* n/2 = 102 */
    expect(v->launch(&args, NULL) == MOE_STATUS_NOT_SUPPORTED && strstr(moe_last_error(), "204"),
           "n = 204 rejected");
    CUDA_OK(cudaDeviceSynchronize());
    cudaFree(d);
}

/* --small: only shapes of at most 4M weight values per expert (for compute-sanitizer runs). */
int main(int argc, char **argv)
{
    const int small = argc > 1 && !strcmp(argv[1], "--small");
    /* the uniform weight scales' read (moe_gemm_args_t.b_scale_uniform, the default) on even
     * where the environment says MOE_GEMM_B_UNIFORM=0, before any launch reads the knob: the
     * runs that say so check it */
    setenv("MOE_GEMM_B_UNIFORM", "1", 1);
    int gate = gt_gpu_gate(1);
    if (gate)
        return gate;
    printf("seed 0x%llx (fixed)\n", (unsigned long long)rng_state);
    struct cudaDeviceProp prop;
    CUDA_OK(cudaGetDeviceProperties(&prop, 0));
    int arch = prop.major * 10 + prop.minor;
    printf("device %s, arch %d\n", prop.name, arch);

    int count = 0;
    const moe_gemm_variant_t *vs = moe_gemm_variants(&count);
    expect(count > 0, "variants compiled");
    const double rpe[] = {0.1, 1, 3, 8, 16, 40, 64, 100, 1000, 1e6};
    for (int i = 0; i < 10; i++) {
        expect(moe_gemm_select(90, MOE_DTYPE_BF16, MOE_SCALE_NONE, rpe[i]) != NULL, "select 90");
        expect(moe_gemm_select(80, MOE_DTYPE_BF16, MOE_SCALE_NONE, rpe[i]) != NULL, "select 80");
    }
    expect(moe_gemm_select(90, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_TENSOR, 1) == NULL,
           "per-tensor scales run as per-row (expanded at load): no variant of their own");
    for (int i = 0; i < 10; i++)
        expect(moe_gemm_select(90, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL, rpe[i]) != NULL &&
                   moe_gemm_select(90, MOE_DTYPE_FP8_E4M3, MOE_SCALE_BLOCK_128, rpe[i]) != NULL &&
                   moe_gemm_select(80, MOE_DTYPE_FP8_E4M3, MOE_SCALE_PER_CHANNEL, rpe[i]) == NULL,
               "select fp8: sm_90a only");
    expect(moe_gemm_variant_by_name("no_such_variant") == NULL, "unknown name");

    for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
        inputs_t in;
        if (small && (int64_t)shapes[si].n * shapes[si].k > (4 << 20))
            continue;
        make_inputs(&shapes[si], &in);
        for (int i = 0; i < count; i++) {
            if (!moe_gemm_variant_runs_on(&vs[i], arch))
                continue;
            expect(moe_gemm_variant_by_name(vs[i].name) == &vs[i], "by name");
            if (si == 0)
                check_rejects(&vs[i], &in);
            if (vs[i].ab_dtype == MOE_DTYPE_FP8_E4M3 && shapes[si].k % 16)
                continue; /* e4m3 rows need k % 16 (rejected: check_rejects) */
            run_variant(&vs[i], &in);
            if (!strcmp(shapes[si].name, "qwen3_w13")) /* k 2048: 16 slices of 128 */
                check_row_invariant(&vs[i], &in);
        }
        free_inputs(&in);
    }
    printf("%d checks, %d failures\n", checks, failures);
    return failures ? 1 : 0;
}
