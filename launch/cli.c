/* SPDX-License-Identifier: Apache-2.0 */
/* The tools' one number parser and their agreement on options across ranks (see cli.h). */
#include "cli.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "runtime/formats/file.h"

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

/* ---- path identity ------------------------------------------------------------------------ */

enum { ID_BLOCK = 64 << 10, ID_BLOCKS = 16, ID_WHOLE = 64 << 20 };

static int ends_with(const char *s, const char *tail)
{
    const size_t n = strlen(s), t = strlen(tail);
    return n >= t && !strcmp(s + n - t, tail);
}

/* Bytes [off, off + n) of fd into the hash. 0, or -1 on a short read. */
static int hash_range(int fd, off_t off, size_t n, unsigned char *buf, uint64_t *h)
{
    while (n > 0) {
        const size_t want = n < ID_BLOCK ? n : ID_BLOCK;
        const ssize_t r = pread(fd, buf, want, off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        *h = moe_fnv1a(*h, buf, (size_t)r);
        off += r;
        n -= (size_t)r;
    }
    return 0;
}

/* One file: its size and either all of it, or (a large .safetensors) its header and
 * ID_BLOCKS blocks spread over the rest. */
static int hash_file(const char *opt, const char *path, int sampled, uint64_t *h, char *err,
                     size_t len)
{
    unsigned char *buf = malloc(ID_BLOCK);
    struct stat sb;
    int fd = -1, rc = -1, i;
    uint64_t head = 0;

    if (!buf) {
        snprintf(err, len, "%s %s: out of memory", opt, path);
        return -1;
    }
    if (moe_open_regular(path, &fd, NULL) != MOE_STATUS_SUCCESS) {
        snprintf(err, len, "%s: %s", opt, moe_last_error());
        goto out;
    }
    if (fstat(fd, &sb) != 0)
        goto io;
    *h = moe_fnv1a(*h, &sb.st_size, sizeof(sb.st_size));
    if (!sampled || sb.st_size <= ID_WHOLE) {
        if (hash_range(fd, 0, (size_t)sb.st_size, buf, h))
            goto io;
        rc = 0;
        goto out;
    }
    /* safetensors: 8 bytes of header length, then the header */
    if (pread(fd, &head, 8, 0) != 8)
        goto io;
    head = head + 8 < (uint64_t)sb.st_size ? head + 8 : (uint64_t)sb.st_size;
    if (hash_range(fd, 0, (size_t)head, buf, h))
        goto io;
    for (i = 0; i < ID_BLOCKS; i++) {
        /* the first block starts the data, the last one ends it */
        const uint64_t data = (uint64_t)sb.st_size - head;
        const uint64_t span = data > ID_BLOCK ? data - ID_BLOCK : 0;
        const uint64_t at = head + span / (ID_BLOCKS - 1) * (uint64_t)i;
        const uint64_t n =
            (uint64_t)sb.st_size - at < ID_BLOCK ? (uint64_t)sb.st_size - at : ID_BLOCK;
        if (hash_range(fd, (off_t)at, (size_t)n, buf, h))
            goto io;
    }
    rc = 0;
    goto out;
io:
    snprintf(err, len, "%s %s: cannot read: %s", opt, path, strerror(errno ? errno : EIO));
out:
    if (fd >= 0)
        close(fd);
    free(buf);
    return rc;
}

static int cmp_names(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int moe_cli_path_identity(const char *opt, const char *path, uint64_t *h, char *err, size_t len)
{
    struct dirent *e;
    struct stat sb;
    char **names = NULL, full[4096];
    size_t n = 0, cap = 0, i;
    int rc = 0;
    DIR *d;

    *h = MOE_CLI_HASH_SEED;
    if (stat(path, &sb) != 0) {
        snprintf(err, len, "%s %s: %s", opt, path, strerror(errno));
        return -1;
    }
    if (!S_ISDIR(sb.st_mode))
        return hash_file(opt, path, 0, h, err, len);
    if (!(d = opendir(path))) {
        snprintf(err, len, "%s %s: cannot list: %s", opt, path, strerror(errno));
        return -1;
    }
    while ((e = readdir(d)) != NULL) {
        if (!ends_with(e->d_name, ".json") && !ends_with(e->d_name, ".safetensors"))
            continue;
        if (n == cap) {
            char **m = realloc(names, sizeof(char *) * (cap = cap ? 2 * cap : 16));
            if (!m) {
                rc = -1;
                break;
            }
            names = m;
        }
        if (!(names[n] = strdup(e->d_name))) {
            rc = -1;
            break;
        }
        n++;
    }
    closedir(d);
    if (rc)
        snprintf(err, len, "%s %s: out of memory", opt, path);
    if (names)
        qsort(names, n, sizeof(char *), cmp_names);
    for (i = 0; i < n && rc == 0; i++) {
        *h = moe_fnv1a(*h, names[i], strlen(names[i]) + 1);
        snprintf(full, sizeof(full), "%s/%s", path, names[i]);
        rc = hash_file(opt, full, ends_with(names[i], ".safetensors"), h, err, len);
    }
    for (i = 0; i < n; i++)
        free(names[i]);
    free(names);
    return rc;
}

double moe_cli_rank_imbalance(int64_t rows)
{
    int64_t mx, sum;
    int world;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Allreduce(&rows, &mx, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(&rows, &sum, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    return sum > 0 ? (double)mx * world / (double)sum : 0.0;
}
