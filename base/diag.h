/* SPDX-License-Identifier: Apache-2.0 */
/* Diagnostics shared by every module: per-thread last error, logging, environment parameters.
 * In base/, the bottom room every other room may use (docs/ARCHITECTURE.md, "Rooms"). */
#ifndef MOE_DIAG_H
#define MOE_DIAG_H

#include <stdint.h>
#include "base/env.h"
#include "moe/moe.h"

#if defined(__GNUC__)
#define MOE_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define MOE_PRINTF(a, b)
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Records a message for moe_last_error() and returns `status` (logs it at MOE_DEBUG=INFO). */
moe_status_t moe_error(moe_status_t status, const char *fmt, ...) MOE_PRINTF(2, 3);
/* Clears the message at the entry of a public call. */
void moe_error_clear(void);

enum { MOE_LOG_NONE = 0, MOE_LOG_LEVEL_WARN = 1, MOE_LOG_LEVEL_INFO = 2, MOE_LOG_LEVEL_DEBUG = 3 };

/* Lines go to stderr (never stdout): "host:pid rank R gpu G [SUBSYS] LEVEL message". */
void moe_log(int level, const char *subsys, const char *fmt, ...) MOE_PRINTF(3, 4);
int moe_log_level(void);
void moe_log_set_identity(int rank, int device);

#define MOE_LOG_WARN(sub, ...) moe_log(MOE_LOG_LEVEL_WARN, sub, __VA_ARGS__)
#define MOE_LOG_INFO(sub, ...)                                                                     \
    do {                                                                                           \
        if (moe_log_level() >= MOE_LOG_LEVEL_INFO)                                                 \
            moe_log(MOE_LOG_LEVEL_INFO, sub, __VA_ARGS__);                                         \
    } while (0)
#define MOE_LOG_DEBUG(sub, ...)                                                                    \
    do {                                                                                           \
        if (moe_log_level() >= MOE_LOG_LEVEL_DEBUG)                                                \
            moe_log(MOE_LOG_LEVEL_DEBUG, sub, __VA_ARGS__);                                        \
    } while (0)

/* Environment parameters (getenv lives in base/env.c only; this file says what a bad value
 * means). Each parameter is declared next to its use with the default; an unparsable value is
 * a warning and the default is used. */
int64_t moe_env_int(const char *name, int64_t dflt);

/* Milliseconds from a monotonic clock (deadlines, timings): the one clock of the library. */
double moe_now_ms(void);
static inline double moe_now_us(void)
{
    return 1e3 * moe_now_ms();
}
/* Like moe_env_int, but a bad value is MOE_STATUS_INVALID_ARGUMENT with a message naming the
 * variable, its value and the valid range (for knobs where guessing is worse than stopping:
 * MOE_TIMEOUT_MS). */
moe_status_t moe_env_int_checked(const char *name, int64_t dflt, int64_t *out);

/* The only control flow hidden in macros. */
#define MOE_CHECK(expr)                                                                            \
    do {                                                                                           \
        moe_status_t moe_s_ = (expr);                                                              \
        if (moe_s_ != MOE_STATUS_SUCCESS)                                                          \
            return moe_s_;                                                                         \
    } while (0)

#define MOE_CHECK_GOTO(expr, st, label)                                                            \
    do {                                                                                           \
        (st) = (expr);                                                                             \
        if ((st) != MOE_STATUS_SUCCESS)                                                            \
            goto label;                                                                            \
    } while (0)

/* Returns MOE_STATUS_INVALID_ARGUMENT with a message when `cond` is false. */
#define MOE_ARG_CHECK(cond, ...)                                                                   \
    do {                                                                                           \
        if (!(cond))                                                                               \
            return moe_error(MOE_STATUS_INVALID_ARGUMENT, __VA_ARGS__);                            \
    } while (0)

#ifdef __cplusplus
}
#endif

#endif /* MOE_DIAG_H */
