/* SPDX-License-Identifier: Apache-2.0 */
/* CPU reference: a product's weight rows split over threads. Each output element is computed by
 * one thread in the order one thread would compute it, so the results are bitwise the same at
 * every thread count. */
#include "kernels/cpu/moe_cpu.h" /* _GNU_SOURCE (the build): sched_getaffinity, CPU_COUNT */

#include <pthread.h>
#include <stdatomic.h>
#include <sched.h>
#include <stdlib.h>
#include <unistd.h>
#include "base/diag.h"
#include "base/env.h"

/* Below MOE_CPU_PAR_MIN_WORK multiply-adds a product runs on the calling thread (a thread's
 * start costs tens of microseconds; 2^22 scalar multiply-adds take milliseconds), and each
 * further thread gets at least half as many. */
#define PAR_MAX_THREADS 64

/* The ranks of this process's host (moe_cpu_set_host_ranks), 1 until a runtime says */
static atomic_int host_ranks = 1;

void moe_cpu_set_host_ranks(int n)
{
    atomic_store(&host_ranks, n > 1 ? n : 1);
}

int moe_cpu_threads(void)
{
    static atomic_int warned = 0;
    int64_t n = 0, lo, hi;
    long online;
    cpu_set_t set;
    const char *why = moe_env_int_parse("MOE_CPU_THREADS", 0, &n, &lo, &hi);
    if (why) { /* read at every large product: said once */
        if (!atomic_exchange(&warned, 1))
            MOE_LOG_WARN("ENV",
                         "MOE_CPU_THREADS=%s: %s (expected %lld..%lld); using 0 (by the host)",
                         moe_env_str("MOE_CPU_THREADS", ""), why, (long long)lo, (long long)hi);
        n = 0;
    }
    if (n > 0)
        return n > PAR_MAX_THREADS ? PAR_MAX_THREADS : (int)n;
    online = sysconf(_SC_NPROCESSORS_ONLN);
    if (online < 1)
        online = 1;
    n = online;
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0)
        n = CPU_COUNT(&set);
    /* not bound to a share of the CPUs: the host's ranks share them */
    if (n >= online) {
        const int local = atomic_load(&host_ranks);
        n = n / local > 0 ? n / local : 1;
    }
    return n > PAR_MAX_THREADS ? PAR_MAX_THREADS : (int)n;
}

typedef struct par_task {
    moe_cpu_rows_fn fn;
    void *ctx;
    int64_t r0, r1;
    float *scratch;
} par_task_t;

/* Inside a range of moe_cpu_for_rows: a product there stays on its thread (no threads of
 * threads) */
static _Thread_local int in_range;

static void *par_run(void *arg)
{
    const par_task_t *t = arg;
    const int outer = in_range;
    in_range = 1;
    t->fn(t->ctx, t->r0, t->r1, t->scratch);
    in_range = outer;
    return NULL;
}

moe_status_t moe_cpu_for_rows(int64_t rows, double work, size_t scratch_floats, moe_cpu_rows_fn fn,
                              void *ctx, const char *what)
{
    par_task_t task[PAR_MAX_THREADS];
    pthread_t tid[PAR_MAX_THREADS];
    int started[PAR_MAX_THREADS];
    float *scratch = NULL;
    int nt = 1, i;

    if (rows <= 0)
        return MOE_STATUS_SUCCESS;
    if (work >= MOE_CPU_PAR_MIN_WORK && !in_range) {
        const double most = work / (MOE_CPU_PAR_MIN_WORK / 2);
        nt = moe_cpu_threads();
        if ((double)nt > most)
            nt = (int)most;
        if ((int64_t)nt > rows)
            nt = (int)rows;
        if (nt < 1)
            nt = 1;
    }
    /* one scratch a range; short of memory, fewer ranges */
    for (; nt >= 1; nt = nt > 1 ? nt / 2 : 0) {
        scratch = malloc(sizeof(float) * (scratch_floats > 0 ? scratch_floats : 1) * (size_t)nt);
        if (scratch)
            break;
    }
    if (!scratch)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: %zu floats", what, scratch_floats);
    if (nt == 1) { /* no threads: a product inside stays free to take them */
        fn(ctx, 0, rows, scratch);
        free(scratch);
        return MOE_STATUS_SUCCESS;
    }
    for (i = 0; i < nt; i++) {
        task[i].fn = fn;
        task[i].ctx = ctx;
        task[i].r0 = rows * i / nt;
        task[i].r1 = rows * (i + 1) / nt;
        task[i].scratch = scratch + (size_t)i * (scratch_floats > 0 ? scratch_floats : 1);
    }
    /* ranges 1.. on threads (a thread that cannot start: its range here, below), 0 here */
    for (i = 1; i < nt; i++)
        started[i] = pthread_create(&tid[i], NULL, par_run, &task[i]) == 0;
    par_run(&task[0]);
    for (i = 1; i < nt; i++) {
        if (started[i])
            pthread_join(tid[i], NULL);
        else
            par_run(&task[i]);
    }
    free(scratch);
    return MOE_STATUS_SUCCESS;
}
