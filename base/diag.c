/* SPDX-License-Identifier: Apache-2.0 */
/* Per-thread last error, status names, stderr logging with host/rank/GPU identity, and what a
 * bad environment knob says (base/env.c reads and parses it). */
#include "base/diag.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MOE_ERROR_LEN 1024

static _Thread_local char tls_error[MOE_ERROR_LEN];
static int log_rank = -1;
static int log_device = -1;
static int log_level_cached = -1;

static const char *const status_names[MOE_STATUS_COUNT] = {
    "MOE_STATUS_SUCCESS",       "MOE_STATUS_INVALID_ARGUMENT", "MOE_STATUS_NOT_SUPPORTED",
    "MOE_STATUS_OUT_OF_MEMORY", "MOE_STATUS_INVALID_STATE",    "MOE_STATUS_IO_ERROR",
    "MOE_STATUS_FORMAT_ERROR",  "MOE_STATUS_MISMATCH",         "MOE_STATUS_TIMEOUT",
    "MOE_STATUS_PEER_FAILURE",  "MOE_STATUS_CUDA_ERROR",       "MOE_STATUS_NCCL_ERROR",
    "MOE_STATUS_MPI_ERROR",     "MOE_STATUS_NUMERIC_ERROR",    "MOE_STATUS_INTERNAL_ERROR"};

const char *moe_status_string(moe_status_t status)
{
    if ((int)status < 0 || (int)status >= MOE_STATUS_COUNT)
        return "MOE_STATUS_UNKNOWN";
    return status_names[status];
}

const char *moe_last_error(void)
{
    return tls_error;
}

void moe_error_clear(void)
{
    tls_error[0] = '\0';
}

moe_status_t moe_error(moe_status_t status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_error, sizeof(tls_error), fmt, ap);
    va_end(ap);
    MOE_LOG_INFO("ERROR", "%s: %s", moe_status_string(status), tls_error);
    return status;
}

void moe_version(int *major, int *minor, int *patch)
{
    if (major)
        *major = MOE_VERSION_MAJOR;
    if (minor)
        *minor = MOE_VERSION_MINOR;
    if (patch)
        *patch = MOE_VERSION_PATCH;
}

int moe_log_level(void)
{
    /* MOE_DEBUG: NONE|WARN|INFO|DEBUG (default WARN). Read once. */
    if (log_level_cached < 0) {
        const char *v = moe_env_str("MOE_DEBUG", "WARN");
        int lvl = MOE_LOG_LEVEL_WARN;
        if (!strcmp(v, "NONE"))
            lvl = MOE_LOG_NONE;
        else if (!strcmp(v, "INFO"))
            lvl = MOE_LOG_LEVEL_INFO;
        else if (!strcmp(v, "DEBUG") || !strcmp(v, "TRACE"))
            lvl = MOE_LOG_LEVEL_DEBUG;
        log_level_cached = lvl;
    }
    return log_level_cached;
}

void moe_log_set_identity(int rank, int device)
{
    log_rank = rank;
    log_device = device;
}

void moe_log(int level, const char *subsys, const char *fmt, ...)
{
    static const char *const names[] = {"", "WARN", "INFO", "DEBUG"};
    char host[64] = "?";
    char msg[1024];
    va_list ap;

    if (level > moe_log_level() || level <= MOE_LOG_NONE)
        return;
    gethostname(host, sizeof(host) - 1);
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    /* One fprintf per line so lines from threads do not interleave. */
    fprintf(stderr, "%s:%d rank %d gpu %d [%s] %s %s\n", host, (int)getpid(), log_rank, log_device,
            subsys, names[level], msg);
}

const char *moe_dtype_name(moe_dtype_t dtype)
{
    switch (dtype) {
    case MOE_DTYPE_F32:
        return "f32";
    case MOE_DTYPE_BF16:
        return "bf16";
    case MOE_DTYPE_F16:
        return "f16";
    case MOE_DTYPE_FP8_E4M3:
        return "fp8_e4m3";
    default:
        return "invalid";
    }
}

size_t moe_dtype_size(moe_dtype_t dtype)
{
    switch (dtype) {
    case MOE_DTYPE_F32:
        return 4;
    case MOE_DTYPE_BF16:
    case MOE_DTYPE_F16:
        return 2;
    case MOE_DTYPE_FP8_E4M3:
        return 1;
    default:
        return 0;
    }
}

const char *moe_backend_name(moe_backend_t backend)
{
    switch (backend) {
    case MOE_BACKEND_CPU:
        return "cpu";
    case MOE_BACKEND_CUDA:
        return "cuda";
    default:
        return "auto";
    }
}

double moe_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* What a bad knob says (base/env.c parses it): an error for the checked knobs, else a warning
 * and the default. */
moe_status_t moe_env_int_checked(const char *name, int64_t dflt, int64_t *out)
{
    int64_t min, max, x = dflt;
    const char *why = moe_env_int_parse(name, dflt, &x, &min, &max);

    if (why)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "%s=%s: %s (expected %lld..%lld)", name,
                         moe_env_str(name, ""), why, (long long)min, (long long)max);
    *out = x;
    return MOE_STATUS_SUCCESS;
}

int64_t moe_env_int(const char *name, int64_t dflt)
{
    int64_t min, max, x = dflt;
    const char *why = moe_env_int_parse(name, dflt, &x, &min, &max);

    if (why) {
        MOE_LOG_WARN("ENV", "%s=%s: %s (expected %lld..%lld); using %lld", name,
                     moe_env_str(name, ""), why, (long long)min, (long long)max, (long long)dflt);
        return dflt;
    }
    return x;
}
