/* SPDX-License-Identifier: Apache-2.0 */
/* The tools' one number parser and their agreement on options across ranks (see cli.h). */
#include "cli.h"

#include <errno.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int moe_cli_int(const char *opt, const char *s, int64_t min, int64_t max, int64_t *out, char *err,
                size_t len)
{
    const char *p = s;
    char *end = NULL;
    long long x;
    int base = 10;

    if (!s || !*s) {
        snprintf(err, len, "%s: needs an integer value", opt);
        return -1;
    }
    /* Decimal, or hex with 0x; never octal ("010" is ten, as a user means it). */
    if (*p == '-' || *p == '+')
        p++;
    if (p[0] == '0' && (p[1] == 'x' || p[1] == 'X'))
        base = 16;
    errno = 0;
    x = strtoll(s, &end, base);
    if (end == s || *end || (*p < '0' || *p > '9')) {
        snprintf(err, len, "%s %s: not an integer", opt, s);
        return -1;
    }
    if (errno == ERANGE || x < min || x > max) {
        snprintf(err, len, "%s %s: out of range (%lld..%lld)", opt, s, (long long)min,
                 (long long)max);
        return -1;
    }
    *out = (int64_t)x;
    return 0;
}

int moe_cli_double(const char *opt, const char *s, double min, double max, double *out, char *err,
                   size_t len)
{
    char *end = NULL;
    double x;

    if (!s || !*s) {
        snprintf(err, len, "%s: needs a number", opt);
        return -1;
    }
    errno = 0;
    x = strtod(s, &end);
    if (end == s || *end) {
        snprintf(err, len, "%s %s: not a number", opt, s);
        return -1;
    }
    if (!isfinite(x) || errno == ERANGE || x < min || x > max) {
        snprintf(err, len, "%s %s: must be a finite number in %g..%g", opt, s, min, max);
        return -1;
    }
    *out = x;
    return 0;
}

#define FNV_PRIME 1099511628211ULL

int64_t moe_cli_hash(const char *s)
{
    uint64_t h = MOE_CLI_HASH_SEED;
    if (!s)
        return 0;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * FNV_PRIME;
    return (int64_t)(h >> 1); /* never 0 for a string, so NULL and "" differ */
}

uint64_t moe_cli_hash_list(uint64_t h, const int64_t *v, int n)
{
    int i;
    for (i = 0; i < n; i++)
        h = (h ^ (uint64_t)v[i]) * FNV_PRIME;
    return h;
}

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

void moe_cli_sort(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
}

/* Slots per rank: error flag, tool, field count, the fields. */
enum { SLOT_ERR, SLOT_TOOL, SLOT_N, SLOT_FIELDS, SLOTS = SLOT_FIELDS + MOE_CLI_MAX_FIELDS };

/* The first (rank, field) that differs from rank 0; field -1: the tool or the count differs. */
static int find_difference(const int64_t *all, int world, int n, int *field)
{
    int r, i;
    for (r = 1; r < world; r++) {
        const int64_t *a = all + (size_t)r * SLOTS;
        if (a[SLOT_TOOL] != all[SLOT_TOOL] || a[SLOT_N] != all[SLOT_N]) {
            *field = -1;
            return r;
        }
        for (i = 0; i < n; i++)
            if (a[SLOT_FIELDS + i] != all[SLOT_FIELDS + i]) {
                *field = i;
                return r;
            }
    }
    return -1;
}

int moe_cli_agree(const char *tool, int local_error, const char *error, const moe_cli_field_t *f,
                  int n)
{
    int64_t mine[SLOTS] = {0}, *all;
    int rank, world, r, first_bad = -1, field = -1, i;

    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (n > MOE_CLI_MAX_FIELDS) {
        fprintf(stderr, "%s: rank %d: internal: %d option fields (at most %d)\n", tool, rank, n,
                MOE_CLI_MAX_FIELDS);
        local_error = 1, error = NULL, n = 0;
    }
    mine[SLOT_ERR] = local_error != 0;
    mine[SLOT_TOOL] = moe_cli_hash(tool);
    mine[SLOT_N] = n;
    for (i = 0; i < n; i++)
        mine[SLOT_FIELDS + i] = f[i].value;
    all = malloc(sizeof(int64_t) * SLOTS * (size_t)world);
    if (!all) { /* cannot agree: say so and let MPI take every rank down */
        fprintf(stderr, "%s: rank %d: out of memory checking the options\n", tool, rank);
        MPI_Abort(MPI_COMM_WORLD, 2);
        return 2;
    }
    MPI_Allgather(mine, SLOTS, MPI_INT64_T, all, SLOTS, MPI_INT64_T, MPI_COMM_WORLD);
    for (r = 0; r < world && first_bad < 0; r++)
        if (all[(size_t)r * SLOTS + SLOT_ERR])
            first_bad = r;
    if (first_bad >= 0) {
        if (rank == first_bad && error)
            fprintf(stderr, "%s: rank %d: %s\n", tool, rank, error);
        free(all);
        return 2;
    }
    r = find_difference(all, world, n, &field);
    if (r < 0) {
        free(all);
        return 0;
    }
    if (field < 0)
        fprintf(stderr,
                "%s: rank %d: the ranks run different programs or versions (rank 0 and rank %d); "
                "start every rank with the same tool\n",
                tool, rank, r);
    else if (f[field].hashed)
        fprintf(stderr,
                "%s: rank %d: options differ among ranks: %s differs between rank 0 and rank %d "
                "(every rank needs the same options)\n",
                tool, rank, f[field].name, r);
    else
        fprintf(stderr,
                "%s: rank %d: options differ among ranks: %s is %lld on rank 0 but %lld on rank "
                "%d (every rank needs the same options)\n",
                tool, rank, f[field].name, (long long)all[SLOT_FIELDS + field],
                (long long)all[(size_t)r * SLOTS + SLOT_FIELDS + field], r);
    free(all);
    return 2;
}
