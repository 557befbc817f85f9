/* SPDX-License-Identifier: Apache-2.0 */
/* Command-line helpers shared by the tools (moe-run, moe-bench): range-checked number parsing
 * and the check that every rank was started with the options that shape the collectives. */
#ifndef MOE_CLI_H
#define MOE_CLI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Parses the whole of `s` as an integer (decimal, or 0x hex) in [min, max] into *out. Returns 0,
 * or -1 with a message "OPT S: ..." naming the option `opt` and the value in err[len]
 * (not an integer, trailing characters, out of range). *out is untouched on error. */
int moe_cli_int(const char *opt, const char *s, int64_t min, int64_t max, int64_t *out, char *err,
                size_t len);

/* Same for a finite floating-point number in [min, max] (nan, inf and overflow are errors). */
int moe_cli_double(const char *opt, const char *s, double min, double max, double *out, char *err,
                   size_t len);

/* One option whose value must be the same on every rank: a name for the message, the value (a
 * flag as 0/1) and whether the value is a hash of a string (moe_cli_hash: then the message names
 * the ranks, not the values). */
typedef struct moe_cli_field {
    const char *name;
    int64_t value;
    int hashed;
} moe_cli_field_t;

#define MOE_CLI_MAX_FIELDS 48

/* FNV-1a of a string (0 for NULL): how a string-valued option enters a moe_cli_field_t. */
int64_t moe_cli_hash(const char *s);

/* FNV-1a over v[0..n), one 64-bit value at a time, continuing from h (MOE_CLI_HASH_SEED to
 * start): how a list-valued option enters a moe_cli_field_t, as (int64_t)(h >> 1), hashed. */
#define MOE_CLI_HASH_SEED 1469598103934665603ULL
uint64_t moe_cli_hash_list(uint64_t h, const int64_t *v, int n);

/* What a path argument that every rank must read alike holds, as a 64-bit hash for a hashed
 * moe_cli_field_t ((int64_t)(h >> 1)): the content, not the name, so copies on other hosts
 * agree and other files at the same path do not. A regular file: all its bytes. A directory
 * (a checkpoint): the names and sizes of its .json and .safetensors files, the whole .json
 * files, each .safetensors file whole up to 64 MiB, above that its header and 16 blocks of
 * 64 KiB spread over its data from the first byte to the last. Every file is opened by the
 * library's one non-blocking regular-file open (a FIFO is refused, never waited on). 0, or -1 with
 * err[len] naming the path and what is wrong. */
int moe_cli_path_identity(const char *opt, const char *path, uint64_t *h, char *err, size_t len);

/* v[0..n) in ascending order (the tools' step times, for their medians). */
void moe_cli_sort(double *v, int n);

/* Collective over MPI_COMM_WORLD, and the first collective a tool makes. Every rank passes
 * `local_error` (nonzero: this rank rejected its options and holds the message in `error`) and
 * the same list of fields. Returns 0 when no rank failed and all agree. Otherwise returns 2 on
 * every rank, after one message on stderr: the lowest failing rank prints its own `error`, or,
 * when the options differ, every rank prints the same line naming the first field that differs
 * and its values on rank 0 and on the first rank that differs. Field lists are compared
 * position by position; more than MOE_CLI_MAX_FIELDS is a programming error (returns 2). */
int moe_cli_agree(const char *tool, int local_error, const char *error, const moe_cli_field_t *f,
                  int n);

/* Collective over MPI_COMM_WORLD: the ranks' largest `rows` over their mean (a layer's rows
 * received in its last forward: the rank load imbalance the EPLB tools print), 0 when no rank
 * counted any. */
double moe_cli_rank_imbalance(int64_t rows);

#ifdef __cplusplus
}
#endif

#endif /* MOE_CLI_H */
