/* SPDX-License-Identifier: Apache-2.0 */
/* The environment: the one place libmoe calls getenv, and the one parser of its integer knobs
 * (decimal or 0x hex, the whole string, inside the knob's range). Below base/diag.h: nothing
 * here logs or records an error; moe_env_int and moe_env_int_checked (base/diag.h) do. */
#ifndef MOE_ENV_H
#define MOE_ENV_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The variable's value, or dflt when it is unset or empty. */
const char *moe_env_str(const char *name, const char *dflt);

/* Integer knob `name`: NULL with *out set (dflt when unset or empty), or what is wrong with its
 * value ("not an integer", "out of range"; *out untouched). *min, *max: the knob's valid range
 * either way. */
const char *moe_env_int_parse(const char *name, int64_t dflt, int64_t *out, int64_t *min,
                              int64_t *max);

#ifdef __cplusplus
}
#endif

#endif /* MOE_ENV_H */
