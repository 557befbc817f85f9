/* SPDX-License-Identifier: Apache-2.0 */
/* The one place libmoe reads the environment. */
#include "diag.h"

#include <errno.h>
#include <stdlib.h>

const char *moe_env_str(const char *name, const char *dflt)
{
    const char *v = getenv(name);
    return (v && *v) ? v : dflt;
}

int64_t moe_env_int(const char *name, int64_t dflt)
{
    const char *v = getenv(name);
    char *end = NULL;
    long long x;

    if (!v || !*v)
        return dflt;
    errno = 0;
    x = strtoll(v, &end, 0);
    if (errno || *end) {
        MOE_LOG_WARN("ENV", "%s=%s is not an integer; using %lld", name, v, (long long)dflt);
        return dflt;
    }
    return x;
}
