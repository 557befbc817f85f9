/* SPDX-License-Identifier: Apache-2.0 */
/* The fused decode kernel's timeline (a program, not a test): launches moe_decode_launch on one
 * model's shape with the trace on (kernels/decode.h, MOE_DECODE_TRACE_*), caches flushed and
 * a fresh routing before each launch, and prints when its phases start and end, relative to the
 * first warp's entry, as the median over launches of each statistic: the entry and expert table,
 * and for each kind of item (x quantisation, GEMM 1, GEMM 2, combine) its count and the
 * min / median / max of its start, of its wait's end and of its end, then the loop's exit.
 * Usage: decode_trace [qwen3 | mixtral | dsv3_ep8] [tokens] [bf16 | fp8] [GEMM 1 k split]
 *        [launches] */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/decode.h"
#include "kernels/gpu.h"
#include "base/diag.h"
#include "moe/moe.h"

#define OK(x)                                                                                      \
    do {                                                                                           \
        moe_status_t s_ = (x);                                                                     \
        if (s_ != MOE_STATUS_SUCCESS) {                                                            \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, moe_last_error());          \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define FLUSH_BYTES ((size_t)512 << 20) /* past the H200's 60 MB of L2 */
#define MAX_LAUNCHES 64
#define KINDS 4
#define NSTAT (3 + KINDS * 10) /* per launch: entry spread, table, exit; per kind: n, 3 x 3 */

typedef struct model {
    const char *name;
    int num_experts, top_k, hidden, inter;
} model_t;

static const model_t models[] = {
    {"qwen3", 128, 8, 2048, 768},
    {"mixtral", 8, 2, 4096, 14336},
    {"dsv3_ep8", 32, 8, 7168, 2048},
};

static const char *kind_name[KINDS] = {"x quantisation", "GEMM 1", "GEMM 2", "combine"};

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* min, median and max of v[0..n) into out[0..3) (zeros when n = 0); sorts v */
static void min_med_max(double *v, int n, double *out)
{
    if (n == 0) {
        out[0] = out[1] = out[2] = 0.0;
        return;
    }
    qsort(v, (size_t)n, sizeof(double), cmp_d);
    out[0] = v[0], out[1] = v[n / 2], out[2] = v[n - 1];
}

/* one launch's statistics, us from the first entry, into st[NSTAT] */
static void analyse(const int64_t *tr, int warps, double *st, double *scratch)
{
    int64_t t0 = INT64_MAX, last_entry = 0, exit_max = 0;
    double table = 0.0;
    int ran = 0;
    for (int w = 0; w < warps; w++) {
        const int64_t *r = tr + (size_t)w * MOE_DECODE_TRACE_STRIDE;
        if (!r[MOE_DECODE_TRACE_ENTRY])
            continue;
        ran++;
        t0 = r[MOE_DECODE_TRACE_ENTRY] < t0 ? r[MOE_DECODE_TRACE_ENTRY] : t0;
        last_entry =
            r[MOE_DECODE_TRACE_ENTRY] > last_entry ? r[MOE_DECODE_TRACE_ENTRY] : last_entry;
        exit_max = r[MOE_DECODE_TRACE_EXIT] > exit_max ? r[MOE_DECODE_TRACE_EXIT] : exit_max;
        table += 1e-3 * (double)(r[MOE_DECODE_TRACE_TABLE] - r[MOE_DECODE_TRACE_ENTRY]);
    }
    st[0] = 1e-3 * (double)(last_entry - t0);
    st[1] = ran ? table / ran : 0.0;
    st[2] = 1e-3 * (double)(exit_max - t0);
    for (int k = 0; k < KINDS; k++) {
        double *o = st + 3 + k * 10;
        for (int f = 0; f < 3; f++) { /* start, wait over, end */
            int n = 0;
            for (int w = 0; w < warps; w++) {
                const int64_t *r = tr + (size_t)w * MOE_DECODE_TRACE_STRIDE;
                const int64_t ne = r[MOE_DECODE_TRACE_COUNT] < MOE_DECODE_TRACE_EVENTS
                                       ? r[MOE_DECODE_TRACE_COUNT]
                                       : MOE_DECODE_TRACE_EVENTS;
                if (!r[MOE_DECODE_TRACE_ENTRY])
                    continue;
                for (int64_t e = 0; e < ne; e++) {
                    const int64_t *ev = r + MOE_DECODE_TRACE_HEAD + 4 * e;
                    if ((int)(ev[0] >> 32) != k || ev[1 + f] == 0)
                        continue;
                    scratch[n++] = 1e-3 * (double)(ev[1 + f] - t0);
                }
            }
            if (f == 0)
                o[0] = n;
            min_med_max(scratch, n, o + 1 + 3 * f);
        }
    }
}

int main(int argc, char **argv)
{
    const char *name = argc > 1 ? argv[1] : "qwen3";
    const int T = argc > 2 ? atoi(argv[2]) : 1;
    const int f8 = argc > 3 && strcmp(argv[3], "fp8") == 0;
    const int split1 = argc > 4 ? atoi(argv[4]) : 1;
    int launches = argc > 5 ? atoi(argv[5]) : 20;
    const model_t *m = NULL;
    int sms = 0;
    for (size_t i = 0; i < sizeof(models) / sizeof(models[0]); i++)
        if (strcmp(models[i].name, name) == 0)
            m = &models[i];
    if (!m || T < 1 || T > 8 || split1 < 1 || split1 > MOE_DECODE_MAX_SPLIT) {
        fprintf(stderr,
                "usage: decode_trace [qwen3|mixtral|dsv3_ep8] [tokens 1..8] [bf16|fp8] "
                "[GEMM 1 k split 1..%d] [launches]\n",
                MOE_DECODE_MAX_SPLIT);
        return 2;
    }
    if (launches < 1 || launches > MAX_LAUNCHES)
        launches = MAX_LAUNCHES;
    OK(moe_gpu_set_device(0));
    OK(moe_gpu_sm_count(0, &sms));
    OK(moe_decode_check(m->num_experts, m->top_k, m->hidden, m->inter, f8));
    OK(moe_decode_prepare());
    const int E = m->num_experts, K = m->top_k, H = m->hidden, I = m->inter, rows = T * K;
    const size_t es = f8 ? 1 : 2, n13 = (size_t)E * 2 * I * H, n2 = (size_t)E * H * I;
    const int split = moe_decode_split(E, K, H, I, sms);
    /* records for every warp that could be resident: 8 CTAs an SM is past the kernel's bound */
    const int warps = sms * 8 * 8;
    const size_t trace_bytes = sizeof(int64_t) * (size_t)warps * MOE_DECODE_TRACE_STRIDE;
    const size_t nsync = moe_decode_sync_count(E, H, I, split1, rows);
    moe_decode_args_t a;
    void *flush = NULL, *start = NULL, *stop = NULL;
    int32_t ids[8 * 16];
    float w[8 * 16];
    int64_t *tr = malloc(trace_bytes);
    double *stats = malloc(sizeof(double) * MAX_LAUNCHES * NSTAT), *col = NULL, *scratch = NULL;
    double med[NSTAT], kernel_us[MAX_LAUNCHES];
    if (!tr || !stats)
        return 1;
    scratch = malloc(sizeof(double) * (size_t)warps * MOE_DECODE_TRACE_EVENTS);
    col = malloc(sizeof(double) * MAX_LAUNCHES);
    if (!scratch || !col)
        return 1;
    memset(&a, 0, sizeof(a));
    OK(moe_gpu_malloc((void **)&a.w13, n13 * es));
    OK(moe_gpu_malloc((void **)&a.w2, n2 * es));
    /* weights 0x3c bytes: bf16 0.0115, e4m3 1.5; the values do not change the timeline */
    OK(moe_gpu_memset((void *)a.w13, 0x3c, n13 * es));
    OK(moe_gpu_memset((void *)a.w2, 0x3c, n2 * es));
    if (f8) {
        OK(moe_gpu_malloc((void **)&a.w13_scale, sizeof(float) * (size_t)E * 2 * I));
        OK(moe_gpu_malloc((void **)&a.w2_scale, sizeof(float) * (size_t)E * H));
        OK(moe_gpu_memset((void *)a.w13_scale, 0x3b, sizeof(float) * (size_t)E * 2 * I));
        OK(moe_gpu_memset((void *)a.w2_scale, 0x3b, sizeof(float) * (size_t)E * H));
        OK(moe_gpu_malloc((void **)&a.xq, (size_t)T * H));
        OK(moe_gpu_malloc((void **)&a.xs, sizeof(float) * T));
    }
    OK(moe_gpu_malloc((void **)&a.x, 2 * (size_t)T * H));
    OK(moe_gpu_memset((void *)a.x, 0x3c, 2 * (size_t)T * H));
    OK(moe_gpu_malloc((void **)&a.topk_ids, sizeof(ids)));
    OK(moe_gpu_malloc((void **)&a.topk_weights, sizeof(w)));
    OK(moe_gpu_malloc(&a.y, 2 * (size_t)T * H));
    OK(moe_gpu_malloc(&a.h, 2 * (size_t)rows * I));
    OK(moe_gpu_malloc((void **)&a.o, sizeof(float) * (size_t)split * rows * H));
    if (split1 > 1)
        OK(moe_gpu_malloc((void **)&a.o1, sizeof(float) * (size_t)split1 * rows * 2 * I));
    OK(moe_gpu_malloc((void **)&a.sync, sizeof(int32_t) * nsync));
    OK(moe_gpu_memset(a.sync, 0, sizeof(int32_t) * nsync));
    OK(moe_gpu_malloc((void **)&a.trace, trace_bytes));
    OK(moe_gpu_malloc(&flush, FLUSH_BYTES));
    OK(moe_gpu_event_create(&start));
    OK(moe_gpu_event_create(&stop));
    a.x_dtype = a.y_dtype = MOE_DTYPE_BF16;
    a.num_tokens = T;
    a.top_k = K;
    a.num_experts = E;
    a.hidden = H;
    a.inter = I;
    a.f8 = f8;
    a.split = split;
    a.split1 = split1;
    a.timeout_ns = 1000000000ll;
    srand(12345);
    for (int l = -1; l < launches; l++) { /* launch -1: the first, not counted */
        for (int t = 0; t < T; t++)
            for (int j = 0; j < K; j++) { /* K distinct experts a token */
                int e, dup;
                do {
                    e = rand() % E, dup = 0;
                    for (int q = 0; q < j; q++)
                        dup |= ids[t * K + q] == e;
                } while (dup);
                ids[t * K + j] = e, w[t * K + j] = 1.0f / (float)K;
            }
        OK(moe_gpu_memcpy_h2d((void *)a.topk_ids, ids, sizeof(int32_t) * rows));
        OK(moe_gpu_memcpy_h2d((void *)a.topk_weights, w, sizeof(float) * rows));
        OK(moe_gpu_memset(a.trace, 0, trace_bytes));
        OK(moe_gpu_memset(flush, l & 0xff, FLUSH_BYTES));
        OK(moe_gpu_event_record(start, NULL));
        OK(moe_decode_launch(&a, NULL));
        OK(moe_gpu_event_record(stop, NULL));
        OK(moe_gpu_device_synchronize());
        if (l < 0)
            continue;
        float ms = 0.0f;
        OK(moe_gpu_event_elapsed_ms(start, stop, &ms));
        kernel_us[l] = 1e3 * ms;
        OK(moe_gpu_memcpy_d2h(tr, a.trace, trace_bytes));
        analyse(tr, warps, stats + (size_t)l * NSTAT, scratch);
    }
    for (int s = 0; s < NSTAT; s++) {
        for (int l = 0; l < launches; l++)
            col[l] = stats[(size_t)l * NSTAT + s];
        qsort(col, (size_t)launches, sizeof(double), cmp_d);
        med[s] = col[launches / 2];
    }
    qsort(kernel_us, (size_t)launches, sizeof(double), cmp_d);
    const double bytes = (double)(n13 + n2) * (double)es / E * (rows < E ? rows : E);
    printf("%s %s, %d token(s), GEMM 1 k split %d, GEMM 2 k split %d, %d SMs; median of %d "
           "launches, us from the first warp's entry\n",
           m->name, f8 ? "fp8" : "bf16", T, split1, split, sms, launches);
    printf("kernel (events) %.1f us; floor (at most %d experts' weights / 4.8 TB/s) %.1f us\n",
           kernel_us[launches / 2], rows < E ? rows : E, bytes / 4.8e12 * 1e6);
    printf("last warp's entry %.2f, expert table %.2f (mean a warp), last warp out of the loop "
           "%.2f\n",
           med[0], med[1], med[2]);
    printf("%-15s %6s | %-20s | %-20s | %-20s\n", "item", "count", "start min/med/max",
           "wait over min/med/max", "end min/med/max");
    for (int k = 0; k < KINDS; k++) {
        const double *o = med + 3 + k * 10;
        if (o[0] == 0)
            continue;
        printf("%-15s %6.0f | %6.2f %6.2f %6.2f | %6.2f %6.2f %6.2f | %6.2f %6.2f %6.2f\n",
               kind_name[k], o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7], o[8], o[9]);
    }
    free(tr), free(stats), free(scratch), free(col);
    return 0;
}
