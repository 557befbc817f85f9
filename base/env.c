/* SPDX-License-Identifier: Apache-2.0 */
/* The one place libmoe reads the environment, and the one parser of its integer knobs. What a
 * bad value says (a warning or an error) is base/diag.c's: this file reports nothing. */
#include "base/env.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

/* The integer knobs and their valid ranges. A knob not listed here must fit an int (callers
 * store it in one); nothing wraps silently. */
static const struct knob {
    const char *name;
    int64_t min, max;
} knobs[] = {
    {"MOE_TIMEOUT_MS", 1, 24 * 3600 * 1000}, /* a wait for a peer: 1 ms .. 24 h */
    {"MOE_DEVICE", -1, 4095},
    {"MOE_AG_MAX_TOKENS", 0, INT64_C(1) << 30},
    {"MOE_DETERMINISTIC", 0, 1},
    {"MOE_BIND", 0, 1},
    {"MOE_PROFILE", 0, 1},
    {"MOE_GEMM_PDL", 0, 1},
    {"MOE_GEMM_TMA_STORE", 0, 1},
    {"MOE_GEMM_SWAP_FOLD", 0, 1},
    {"MOE_SCATTER_ROWS", 0, 1},
    {"MOE_GEMM_SKIP_PAD", 0, 1},
    {"MOE_FUSED_DECODE", 0, 1},
    {"MOE_EP_LL", 0, 1},
    {"MOE_EP_MICROBATCH", 0, 1},
    {"MOE_EP_P2P_HEADER", 0, 1},
    {"MOE_EP_LL_KERNELS", 1, 2},
    {"MOE_EP_CHUNK_TOKENS", 0, INT64_C(1) << 30},
    {"MOE_EP_LL_CTAS", 0, 4096},
    {"MOE_EP_FINISH_WAIT", 0, 1},
    {"MOE_EP_SHARED_OVERLAP", 0, 1},
    {"MOE_GEMM_GROUP", 0, 4096},      /* row blocks a sweep; 0: by blocks per expert */
    {"MOE_GEMM_EXPERT_GROUPS", 0, 1}, /* sm_90 normal tiles: one expert's blocks a sweep */
    {"MOE_GEMM_MAX_CTAS", 0, 4096},   /* sm_90 GEMM grid cap (an experiment); 0: the SMs */
    {"MOE_DECODE_K1_SPLIT", 0, 8},    /* fused decode's GEMM 1 k split; 0: by shape, 1: none */
    {"MOE_DECODE_SHARED", 0, 1},      /* fused decode: the shared MLP inside (default 1) */
    {"MOE_GEMM_PROMO_SLICES", 1, 64}, /* the _p4 fp8 tiles' promotion interval (an A/B knob) */
    {"MOE_QUANT_GROUP_HELD", 0, 1},   /* long rows' 1 x 128 group quantisation held (A/B knob) */
    {"MOE_QUANT_H_AMAX", 0, 1},       /* W8A8 GEMM 1 takes h's maxima for its quantisation */
    {"MOE_SLOT_LOAD_HIST", 0, 1},     /* slot ids: expert loads counted per CTA (A/B knob) */
    {"MOE_CPU_THREADS", 0, 64},       /* CPU backend products' threads; 0: by the host */
    {"MOE_GEMM_EARLY_W", 0, 1},       /* GEMM 2's first weight stages before its PDL wait */
};

static void knob_range(const char *name, int64_t *min, int64_t *max)
{
    size_t i;
    for (i = 0; i < sizeof(knobs) / sizeof(knobs[0]); i++)
        if (!strcmp(knobs[i].name, name)) {
            *min = knobs[i].min;
            *max = knobs[i].max;
            return;
        }
    *min = -2147483647 - 1;
    *max = 2147483647;
}

const char *moe_env_str(const char *name, const char *dflt)
{
    const char *v = getenv(name);
    return (v && *v) ? v : dflt;
}

/* Decimal or 0x hex (never octal: "010" is ten), the whole string, inside [min, max]. Returns
 * NULL and sets *x, or what is wrong with the value. */
static const char *parse_int(const char *v, int64_t min, int64_t max, int64_t *x)
{
    const char *p = v;
    char *end = NULL;
    long long r;

    if (*p == '-' || *p == '+')
        p++;
    if (*p < '0' || *p > '9')
        return "not an integer";
    errno = 0;
    r = strtoll(v, &end, p[0] == '0' && (p[1] == 'x' || p[1] == 'X') ? 16 : 10);
    if (end == v || *end)
        return "not an integer";
    if (errno == ERANGE || r < min || r > max)
        return "out of range";
    *x = (int64_t)r;
    return NULL;
}

const char *moe_env_int_parse(const char *name, int64_t dflt, int64_t *out, int64_t *min,
                              int64_t *max)
{
    const char *v = getenv(name), *why;
    int64_t x = dflt;

    knob_range(name, min, max);
    if (v && *v && (why = parse_int(v, *min, *max, &x)) != NULL)
        return why;
    *out = x;
    return NULL;
}
