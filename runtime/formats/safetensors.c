/* SPDX-License-Identifier: Apache-2.0 */
/* safetensors reader (validated header, pread of exact byte ranges) and writer. */
#define _POSIX_C_SOURCE 200809L
#include "runtime/formats/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/diag.h"

/* Bounce buffer for coalesced column-slice reads. */
#define COALESCE_BUFFER_BYTES (8u << 20)
/* Row segments separated by at most this many bytes are read together: the gap lies in pages
 * the kernel reads anyway, and one large read beats many small ones. */
#define COALESCE_MAX_GAP 4096u
/* One pread moves at most this much (Linux caps a read at about 2 GiB anyway). */
#define MAX_PREAD_BYTES (1u << 30)

static const struct {
    const char *name;
    size_t size;
} dtype_table[MOE_ST_DTYPE_COUNT] = {
    [MOE_ST_INVALID] = {"INVALID", 0}, [MOE_ST_BOOL] = {"BOOL", 1},
    [MOE_ST_U8] = {"U8", 1},           [MOE_ST_I8] = {"I8", 1},
    [MOE_ST_F8_E4M3] = {"F8_E4M3", 1}, [MOE_ST_F8_E5M2] = {"F8_E5M2", 1},
    [MOE_ST_F8_E8M0] = {"F8_E8M0", 1}, [MOE_ST_I16] = {"I16", 2},
    [MOE_ST_U16] = {"U16", 2},         [MOE_ST_F16] = {"F16", 2},
    [MOE_ST_BF16] = {"BF16", 2},       [MOE_ST_I32] = {"I32", 4},
    [MOE_ST_U32] = {"U32", 4},         [MOE_ST_F32] = {"F32", 4},
    [MOE_ST_I64] = {"I64", 8},         [MOE_ST_U64] = {"U64", 8},
    [MOE_ST_F64] = {"F64", 8},
};

const char *moe_st_dtype_name(moe_st_dtype_t dtype)
{
    return (unsigned)dtype < MOE_ST_DTYPE_COUNT ? dtype_table[dtype].name : "INVALID";
}

size_t moe_st_dtype_size(moe_st_dtype_t dtype)
{
    return (unsigned)dtype < MOE_ST_DTYPE_COUNT ? dtype_table[dtype].size : 0;
}

moe_st_dtype_t moe_st_dtype_from_name(const char *name)
{
    for (int i = 1; i < MOE_ST_DTYPE_COUNT; i++)
        if (!strcmp(dtype_table[i].name, name))
            return (moe_st_dtype_t)i;
    return MOE_ST_INVALID;
}

moe_dtype_t moe_st_to_moe_dtype(moe_st_dtype_t dtype)
{
    switch (dtype) {
    case MOE_ST_F32:
        return MOE_DTYPE_F32;
    case MOE_ST_BF16:
        return MOE_DTYPE_BF16;
    case MOE_ST_F16:
        return MOE_DTYPE_F16;
    case MOE_ST_F8_E4M3:
        return MOE_DTYPE_FP8_E4M3;
    default:
        return MOE_DTYPE_INVALID;
    }
}

moe_st_dtype_t moe_st_from_moe_dtype(moe_dtype_t dtype)
{
    switch (dtype) {
    case MOE_DTYPE_F32:
        return MOE_ST_F32;
    case MOE_DTYPE_BF16:
        return MOE_ST_BF16;
    case MOE_DTYPE_F16:
        return MOE_ST_F16;
    case MOE_DTYPE_FP8_E4M3:
        return MOE_ST_F8_E4M3;
    default:
        return MOE_ST_INVALID;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Header                                                                                      */
/* ------------------------------------------------------------------------------------------ */

static int cmp_by_name(const void *a, const void *b)
{
    return strcmp(((const moe_st_tensor_t *)a)->name, ((const moe_st_tensor_t *)b)->name);
}

static int cmp_by_offset(const void *a, const void *b)
{
    const moe_st_tensor_t *x = *(const moe_st_tensor_t *const *)a;
    const moe_st_tensor_t *y = *(const moe_st_tensor_t *const *)b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return 0;
}

/* Names in messages are cut so that a hostile 1 MB key cannot flood a log. */
#define NAME_FMT "\"%.200s\""

static moe_status_t parse_metadata(const moe_json_t *m, const char *what)
{
    if (m->type != MOE_JSON_OBJECT)
        return moe_error(MOE_STATUS_FORMAT_ERROR, "%s: __metadata__ is a %s, expected an object",
                         what, moe_json_type_name(m->type));
    for (const moe_json_t *v = m->child; v; v = v->next)
        if (v->type != MOE_JSON_STRING)
            return moe_error(MOE_STATUS_FORMAT_ERROR,
                             "%s: __metadata__ value of " NAME_FMT " is a %s, expected a string",
                             what, v->key, moe_json_type_name(v->type));
    return MOE_STATUS_SUCCESS;
}

static moe_status_t parse_tensor(const moe_json_t *e, uint64_t data_bytes, const char *what,
                                 moe_st_tensor_t *t)
{
    const moe_json_t *dt, *shape, *offs, *b, *en;
    const char *name = e->key;
    uint64_t elems = 1, span = 1, esize;

    memset(t, 0, sizeof(*t));
    t->name = name;
    if (e->type != MOE_JSON_OBJECT)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: tensor " NAME_FMT " is a %s, expected an "
                         "object with dtype, shape and data_offsets",
                         what, name, moe_json_type_name(e->type));
    dt = moe_json_get(e, "dtype");
    shape = moe_json_get(e, "shape");
    offs = moe_json_get(e, "data_offsets");
    if (!dt || dt->type != MOE_JSON_STRING)
        return moe_error(MOE_STATUS_FORMAT_ERROR, "%s: tensor " NAME_FMT " has %s dtype", what,
                         name, dt ? "a non-string" : "no");
    t->dtype = moe_st_dtype_from_name(dt->string);
    if (t->dtype == MOE_ST_INVALID)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: tensor " NAME_FMT " has unknown or unsupported dtype \"%.40s\"", what,
                         name, dt->string);
    esize = moe_st_dtype_size(t->dtype);
    if (!shape || shape->type != MOE_JSON_ARRAY)
        return moe_error(MOE_STATUS_FORMAT_ERROR, "%s: tensor " NAME_FMT " has %s shape", what,
                         name, shape ? "a non-array" : "no");
    if (shape->count > MOE_ST_MAX_DIMS)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: tensor " NAME_FMT " has %zu dimensions (at most %d supported)", what,
                         name, shape->count, MOE_ST_MAX_DIMS);
    t->ndim = (int)shape->count;
    t->rows = 1;
    t->cols = 1;
    {
        int i = 0;
        for (const moe_json_t *d = shape->child; d; d = d->next, i++) {
            if (d->type != MOE_JSON_NUMBER || !d->is_int || d->integer < 0)
                return moe_error(MOE_STATUS_FORMAT_ERROR,
                                 "%s: tensor " NAME_FMT " shape[%d] is not a non-negative "
                                 "integer",
                                 what, name, i);
            /* The product of the non-zero dimensions (times the dtype size) must fit in
             * int64 even when another dimension is 0, since rows and cols are kept too; check
             * before multiplying. */
            if (d->integer != 0 && span > (uint64_t)INT64_MAX / esize / (uint64_t)d->integer)
                return moe_error(MOE_STATUS_FORMAT_ERROR,
                                 "%s: tensor " NAME_FMT " shape overflows (dimension %d is %lld)",
                                 what, name, i, (long long)d->integer);
            if (d->integer != 0)
                span *= (uint64_t)d->integer;
            elems *= (uint64_t)d->integer;
            t->shape[i] = d->integer;
            if (i == 0)
                t->rows = d->integer;
            else
                t->cols *= d->integer;
        }
    }
    if (!offs || offs->type != MOE_JSON_ARRAY || offs->count != 2)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: tensor " NAME_FMT " data_offsets must be an array [begin, end]", what,
                         name);
    b = offs->child;
    en = b->next;
    if (b->type != MOE_JSON_NUMBER || !b->is_int || b->integer < 0 || en->type != MOE_JSON_NUMBER ||
        !en->is_int || en->integer < 0)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: tensor " NAME_FMT " data_offsets are not non-negative integers", what,
                         name);
    t->begin = (uint64_t)b->integer;
    t->end = (uint64_t)en->integer;
    if (t->end < t->begin)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: tensor " NAME_FMT " data_offsets [%llu, %llu] end before begin", what,
                         name, (unsigned long long)t->begin, (unsigned long long)t->end);
    if (t->end > data_bytes)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: tensor " NAME_FMT " data_offsets [%llu, %llu] run past the end of "
                         "the data (%llu bytes)",
                         what, name, (unsigned long long)t->begin, (unsigned long long)t->end,
                         (unsigned long long)data_bytes);
    if (t->end - t->begin != elems * esize)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: tensor " NAME_FMT " holds %llu bytes but its dtype %s and shape "
                         "need %llu",
                         what, name, (unsigned long long)(t->end - t->begin),
                         moe_st_dtype_name(t->dtype), (unsigned long long)(elems * esize));
    return MOE_STATUS_SUCCESS;
}

/* The tensors must tile the data section: sorted by offset, each begins where the last ended. */
static moe_status_t check_layout(moe_st_header_t *h, const char *what)
{
    const moe_st_tensor_t **order;
    uint64_t pos = 0;
    moe_status_t st = MOE_STATUS_SUCCESS;

    if (h->num_tensors == 0) {
        if (h->data_bytes)
            return moe_error(MOE_STATUS_FORMAT_ERROR,
                             "%s: no tensors but %llu bytes of data after the header", what,
                             (unsigned long long)h->data_bytes);
        return MOE_STATUS_SUCCESS;
    }
    order = malloc(h->num_tensors * sizeof(*order));
    if (!order)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory", what);
    for (size_t i = 0; i < h->num_tensors; i++)
        order[i] = &h->tensors[i];
    qsort(order, h->num_tensors, sizeof(*order), cmp_by_offset);
    for (size_t i = 0; i < h->num_tensors; i++) {
        const moe_st_tensor_t *t = order[i];
        if (t->begin < pos) {
            st = moe_error(MOE_STATUS_FORMAT_ERROR,
                           "%s: tensor " NAME_FMT
                           " data_offsets [%llu, %llu] overlap tensor " NAME_FMT,
                           what, t->name, (unsigned long long)t->begin, (unsigned long long)t->end,
                           order[i - 1]->name);
            goto out;
        }
        if (t->begin > pos) {
            st = moe_error(MOE_STATUS_FORMAT_ERROR,
                           "%s: gap in the data before tensor " NAME_FMT " (bytes %llu..%llu "
                           "belong to no tensor)",
                           what, t->name, (unsigned long long)pos, (unsigned long long)t->begin);
            goto out;
        }
        pos = t->end;
    }
    if (pos != h->data_bytes)
        st = moe_error(MOE_STATUS_FORMAT_ERROR,
                       "%s: tensors cover %llu bytes but the data section has %llu", what,
                       (unsigned long long)pos, (unsigned long long)h->data_bytes);
out:
    free(order);
    return st;
}

moe_status_t moe_st_header_parse(const char *json, size_t len, uint64_t data_bytes,
                                 const char *what, moe_st_header_t **header)
{
    moe_st_header_t *h;
    const moe_json_t *root;
    moe_status_t st;
    size_t n = 0;

    *header = NULL;
    if (!what)
        what = "safetensors";
    if (len < 2 || json[0] != '{')
        return moe_error(MOE_STATUS_FORMAT_ERROR, "%s: header does not start with '{'", what);
    h = calloc(1, sizeof(*h));
    if (!h)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory", what);
    h->data_bytes = data_bytes;
    MOE_CHECK_GOTO(moe_json_parse(json, len, 0, what, &h->doc), st, fail);
    root = moe_json_root(h->doc);
    h->tensors = calloc(root->count ? root->count : 1, sizeof(*h->tensors));
    if (!h->tensors) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory for %zu tensors", what,
                       root->count);
        goto fail;
    }
    for (const moe_json_t *e = root->child; e; e = e->next) {
        if (!strcmp(e->key, "__metadata__")) {
            MOE_CHECK_GOTO(parse_metadata(e, what), st, fail);
            h->metadata = e;
            continue;
        }
        MOE_CHECK_GOTO(parse_tensor(e, data_bytes, what, &h->tensors[n]), st, fail);
        n++;
    }
    h->num_tensors = n;
    MOE_CHECK_GOTO(check_layout(h, what), st, fail);
    qsort(h->tensors, n, sizeof(*h->tensors), cmp_by_name);
    *header = h;
    return MOE_STATUS_SUCCESS;
fail:
    moe_st_header_free(h);
    return st;
}

static uint64_t read_le64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

/* Checks the 8-byte header length against the file size and the cap; returns it in *len. */
static moe_status_t check_header_len(const unsigned char *first8, uint64_t file_bytes,
                                     const char *what, uint64_t *len)
{
    uint64_t n = 0;

    if (file_bytes < 8)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: file is %llu bytes, shorter than the 8-byte header length", what,
                         (unsigned long long)file_bytes);
    n = read_le64(first8);
    if (n > MOE_ST_MAX_HEADER_BYTES)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: header length %llu exceeds the limit of %llu bytes", what,
                         (unsigned long long)n, (unsigned long long)MOE_ST_MAX_HEADER_BYTES);
    if (n > file_bytes - 8)
        return moe_error(MOE_STATUS_FORMAT_ERROR,
                         "%s: header length %llu runs past the end of the file (%llu bytes)", what,
                         (unsigned long long)n, (unsigned long long)file_bytes);
    *len = n;
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_st_parse_buffer(const void *buf, size_t size, const char *what,
                                 moe_st_header_t **header)
{
    uint64_t n = 0;

    *header = NULL;
    if (!what)
        what = "safetensors buffer";
    if (!buf && size)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "%s: NULL buffer", what);
    MOE_CHECK(check_header_len(buf, size, what, &n));
    return moe_st_header_parse((const char *)buf + 8, (size_t)n, size - 8 - n, what, header);
}

void moe_st_header_free(moe_st_header_t *header)
{
    if (!header)
        return;
    moe_json_free(header->doc);
    free(header->tensors);
    free(header);
}

const moe_st_tensor_t *moe_st_header_find(const moe_st_header_t *header, const char *name)
{
    moe_st_tensor_t key;

    if (!header || !name || !header->num_tensors)
        return NULL;
    key.name = name;
    return bsearch(&key, header->tensors, header->num_tensors, sizeof(key), cmp_by_name);
}

const char *moe_st_header_metadata(const moe_st_header_t *header, const char *key)
{
    const moe_json_t *v = header ? moe_json_get(header->metadata, key) : NULL;
    return v ? v->string : NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Files                                                                                       */
/* ------------------------------------------------------------------------------------------ */

struct moe_st_file {
    int fd;
    char *path;
    uint64_t file_bytes;
    uint64_t data_start; /* 8 + header length */
    moe_st_header_t *header;
    uint64_t bytes_read, reads;
};

/* pread of exactly `len` bytes at `off`; a short file is an IO error naming it. */
static moe_status_t pread_full(moe_st_file_t *f, void *dst, uint64_t len, uint64_t off)
{
    char *p = dst;

    while (len) {
        size_t chunk = len > MAX_PREAD_BYTES ? MAX_PREAD_BYTES : (size_t)len;
        ssize_t got = pread(f->fd, p, chunk, (off_t)off);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            return moe_error(MOE_STATUS_IO_ERROR,
                             "%s: read of %zu bytes at offset %llu failed: "
                             "%s",
                             f->path, chunk, (unsigned long long)off, strerror(errno));
        if (got == 0)
            return moe_error(MOE_STATUS_IO_ERROR,
                             "%s: unexpected end of file at offset %llu (file shrank since "
                             "open?)",
                             f->path, (unsigned long long)off);
        f->reads++;
        f->bytes_read += (uint64_t)got;
        p += got;
        off += (uint64_t)got;
        len -= (uint64_t)got;
    }
    return MOE_STATUS_SUCCESS;
}

moe_status_t moe_st_open(const char *path, moe_st_file_t **file)
{
    moe_st_file_t *f;
    struct stat sb;
    unsigned char first8[8];
    char *json = NULL;
    uint64_t n = 0;
    moe_status_t st;

    *file = NULL;
    if (!path)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "safetensors: NULL path");
    f = calloc(1, sizeof(*f));
    if (!f || !(f->path = strdup(path))) {
        free(f);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    MOE_CHECK_GOTO(moe_open_regular(path, &f->fd, NULL), st, fail);
    if (fstat(f->fd, &sb) != 0) {
        st = moe_error(MOE_STATUS_IO_ERROR, "%s: cannot stat: %s", path, strerror(errno));
        goto fail;
    }
    f->file_bytes = (uint64_t)sb.st_size;
    memset(first8, 0, sizeof(first8));
    if (f->file_bytes >= 8)
        MOE_CHECK_GOTO(pread_full(f, first8, 8, 0), st, fail);
    MOE_CHECK_GOTO(check_header_len(first8, f->file_bytes, path, &n), st, fail);
    /* n <= file size - 8 and <= 100 MB: the allocation is bounded by what is really there. */
    json = malloc(n ? (size_t)n : 1);
    if (!json) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory for a %llu-byte header", path,
                       (unsigned long long)n);
        goto fail;
    }
    MOE_CHECK_GOTO(pread_full(f, json, n, 8), st, fail);
    f->data_start = 8 + n;
    MOE_CHECK_GOTO(
        moe_st_header_parse(json, (size_t)n, f->file_bytes - f->data_start, path, &f->header), st,
        fail);
    free(json);
    f->bytes_read = 0;
    f->reads = 0;
    *file = f;
    return MOE_STATUS_SUCCESS;
fail:
    free(json);
    moe_st_close(f);
    return st;
}

void moe_st_close(moe_st_file_t *file)
{
    if (!file)
        return;
    if (file->fd >= 0)
        close(file->fd);
    moe_st_header_free(file->header);
    free(file->path);
    free(file);
}

const moe_st_header_t *moe_st_file_header(const moe_st_file_t *file)
{
    return file ? file->header : NULL;
}

const char *moe_st_file_path(const moe_st_file_t *file)
{
    return file ? file->path : NULL;
}

const moe_st_tensor_t *moe_st_find(const moe_st_file_t *file, const char *name)
{
    return file ? moe_st_header_find(file->header, name) : NULL;
}

void moe_st_file_stats(const moe_st_file_t *file, uint64_t *bytes_read, uint64_t *reads)
{
    if (bytes_read)
        *bytes_read = file ? file->bytes_read : 0;
    if (reads)
        *reads = file ? file->reads : 0;
}

moe_status_t moe_st_read_block(moe_st_file_t *file, const moe_st_tensor_t *t, int64_t r0,
                               int64_t r1, int64_t c0, int64_t c1, void *dst)
{
    uint64_t esize, row_bytes, seg, base, nrows;
    char *out = dst;

    if (!file || !t || (!dst && r1 > r0 && c1 > c0))
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "safetensors read: NULL argument");
    if (r0 < 0 || r1 < r0 || r1 > t->rows || c0 < 0 || c1 < c0 || c1 > t->cols)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT,
                         "%s: block rows [%lld, %lld) cols [%lld, %lld) outside tensor " NAME_FMT
                         " [%lld, %lld]",
                         file->path, (long long)r0, (long long)r1, (long long)c0, (long long)c1,
                         t->name, (long long)t->rows, (long long)t->cols);
    if (r1 == r0 || c1 == c0)
        return MOE_STATUS_SUCCESS;
    esize = moe_st_dtype_size(t->dtype);
    row_bytes = (uint64_t)t->cols * esize;
    seg = (uint64_t)(c1 - c0) * esize;
    nrows = (uint64_t)(r1 - r0);
    base = file->data_start + t->begin + (uint64_t)r0 * row_bytes + (uint64_t)c0 * esize;

    if (seg == row_bytes)
        return pread_full(file, out, nrows * row_bytes, base);
    if (row_bytes - seg > COALESCE_MAX_GAP || row_bytes > COALESCE_BUFFER_BYTES) {
        /* Gaps longer than a page: one pread per row segment, exactly the slice's bytes. */
        for (uint64_t r = 0; r < nrows; r++)
            MOE_CHECK(pread_full(file, out + r * seg, seg, base + r * row_bytes));
        return MOE_STATUS_SUCCESS;
    }
    {
        /* Gaps of at most a page: read spans from the first segment's start to the last
         * segment's end into a bounce buffer and copy the segments out. */
        uint64_t per = COALESCE_BUFFER_BYTES / row_bytes;
        char *bounce;
        moe_status_t st = MOE_STATUS_SUCCESS;

        if (per > nrows)
            per = nrows;
        bounce = malloc((size_t)((per - 1) * row_bytes + seg));
        if (!bounce)
            return moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory", file->path);
        for (uint64_t r = 0; r < nrows && st == MOE_STATUS_SUCCESS; r += per) {
            uint64_t k = nrows - r < per ? nrows - r : per;
            st = pread_full(file, bounce, (k - 1) * row_bytes + seg, base + r * row_bytes);
            for (uint64_t j = 0; j < k && st == MOE_STATUS_SUCCESS; j++)
                memcpy(out + (r + j) * seg, bounce + j * row_bytes, (size_t)seg);
        }
        free(bounce);
        return st;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* Writer                                                                                      */
/* ------------------------------------------------------------------------------------------ */

typedef struct strbuf {
    char *p;
    size_t len, cap;
    int oom;
} strbuf_t;

static void sb_put(strbuf_t *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        char *np;
        while (cap < b->len + n + 1)
            cap *= 2;
        np = realloc(b->p, cap);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void sb_str(strbuf_t *b, const char *s)
{
    sb_put(b, s, strlen(s));
}

static void sb_json_string(strbuf_t *b, const char *s)
{
    sb_put(b, "\"", 1);
    for (; *s; s++) {
        char esc[7];
        sb_put(b, esc, moe_json_escape_byte((unsigned char)*s, esc));
    }
    sb_put(b, "\"", 1);
}

static moe_status_t write_all(int fd, const void *p, uint64_t n, const char *path)
{
    const char *c = p;

    while (n) {
        size_t chunk = n > MAX_PREAD_BYTES ? MAX_PREAD_BYTES : (size_t)n;
        ssize_t put = write(fd, c, chunk);
        if (put < 0 && errno == EINTR)
            continue;
        if (put <= 0)
            return moe_error(MOE_STATUS_IO_ERROR, "%s: write failed: %s", path,
                             put < 0 ? strerror(errno) : "no progress");
        c += put;
        n -= (uint64_t)put;
    }
    return MOE_STATUS_SUCCESS;
}

/* The output path may be absent or a regular file (replaced). Anything else is refused: a
 * device or FIFO would be replaced by a regular file, and a symbolic link is not followed
 * (the rename would replace the link, not its target; say so rather than guess). */
static moe_status_t check_output_target(const char *path)
{
    struct stat sb;

    if (lstat(path, &sb) != 0) {
        if (errno == ENOENT)
            return MOE_STATUS_SUCCESS;
        return moe_error(MOE_STATUS_IO_ERROR, "%s: cannot stat the output path: %s", path,
                         strerror(errno));
    }
    if (S_ISLNK(sb.st_mode))
        return moe_error(MOE_STATUS_IO_ERROR,
                         "%s: the output path is a symbolic link; refusing to replace it (links "
                         "are not followed: pass the target path itself)",
                         path);
    if (!S_ISREG(sb.st_mode))
        return moe_error(MOE_STATUS_IO_ERROR,
                         "%s: the output path is %s; refusing to replace it with a regular file",
                         path, moe_file_kind(sb.st_mode));
    return MOE_STATUS_SUCCESS;
}

/* Creates the temporary file beside `path` (same directory, so the rename is atomic):
 * "PATH.tmp.PID", else "PATH.tmp.PID.N". O_EXCL | O_NOFOLLOW: a file or link already at a
 * candidate name (planted or left by a crash) is never opened or followed; the next name is
 * tried. */
static moe_status_t create_temp(const char *path, char **tmp_out, int *fd_out)
{
    const size_t cap = strlen(path) + 48;
    char *tmp = malloc(cap);

    *tmp_out = NULL;
    *fd_out = -1;
    if (!tmp)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory", path);
    for (int attempt = 0; attempt < 100; attempt++) {
        int fd;
        if (attempt == 0)
            snprintf(tmp, cap, "%s.tmp.%ld", path, (long)getpid());
        else
            snprintf(tmp, cap, "%s.tmp.%ld.%d", path, (long)getpid(), attempt);
        fd = open(tmp, O_CREAT | O_EXCL | O_NOFOLLOW | O_WRONLY | O_CLOEXEC, 0644);
        if (fd >= 0) {
            *tmp_out = tmp;
            *fd_out = fd;
            return MOE_STATUS_SUCCESS;
        }
        if (errno != EEXIST && errno != ELOOP) {
            moe_status_t st =
                moe_error(MOE_STATUS_IO_ERROR, "%s: cannot create: %s", tmp, strerror(errno));
            free(tmp);
            return st;
        }
    }
    free(tmp);
    return moe_error(MOE_STATUS_IO_ERROR,
                     "%s: cannot create a temporary file beside it: 100 candidate names "
                     "(%s.tmp.%ld.*) already exist",
                     path, path, (long)getpid());
}

/* Makes the rename durable: fsync of the directory holding `path` (best effort). */
static void sync_parent_dir(const char *path)
{
    const char *slash = strrchr(path, '/');
    char *dir = slash ? strndup(path, (size_t)(slash - path) + (slash == path)) : strdup(".");
    int fd;

    if (!dir)
        return;
    fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        (void)fsync(fd);
        close(fd);
    }
    free(dir);
}

moe_status_t moe_st_write(const char *path, const moe_st_entry_t *entries, size_t n,
                          const char *const *metadata, size_t n_metadata)
{
    strbuf_t hb = {0};
    uint64_t off = 0, *bytes = NULL;
    unsigned char len8[8];
    char *tmp = NULL, num[64];
    int fd = -1;
    moe_status_t st = MOE_STATUS_SUCCESS;

    if (!path || (n && !entries) || (n_metadata && !metadata))
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "safetensors write: NULL argument");
    bytes = calloc(n ? n : 1, sizeof(*bytes));
    if (!bytes)
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory", path);
    sb_str(&hb, "{");
    if (n_metadata) {
        sb_str(&hb, "\"__metadata__\":{");
        for (size_t i = 0; i < n_metadata; i++) {
            if (i)
                sb_str(&hb, ",");
            sb_json_string(&hb, metadata[2 * i]);
            sb_str(&hb, ":");
            sb_json_string(&hb, metadata[2 * i + 1]);
        }
        sb_str(&hb, "}");
    }
    for (size_t i = 0; i < n; i++) {
        const moe_st_entry_t *e = &entries[i];
        uint64_t elems = 1, esize = moe_st_dtype_size(e->dtype);
        if (!e->name || !esize || e->ndim < 0 || e->ndim > MOE_ST_MAX_DIMS ||
            !strcmp(e->name, "__metadata__")) {
            st = moe_error(MOE_STATUS_INVALID_ARGUMENT,
                           "%s: entry %zu has no name, a reserved name, an invalid dtype or an "
                           "invalid number of dimensions",
                           path, i);
            goto out;
        }
        for (int d = 0; d < e->ndim; d++) {
            if (e->shape[d] < 0 ||
                (e->shape[d] && elems > (uint64_t)INT64_MAX / esize / (uint64_t)e->shape[d])) {
                st = moe_error(MOE_STATUS_INVALID_ARGUMENT,
                               "%s: tensor " NAME_FMT " shape[%d] = %lld is invalid", path, e->name,
                               d, (long long)e->shape[d]);
                goto out;
            }
            elems *= (uint64_t)e->shape[d];
        }
        bytes[i] = elems * esize;
        if (bytes[i] && !e->data) {
            st = moe_error(MOE_STATUS_INVALID_ARGUMENT, "%s: tensor " NAME_FMT " has no data", path,
                           e->name);
            goto out;
        }
        sb_str(&hb, (i || n_metadata) ? "," : "");
        sb_json_string(&hb, e->name);
        sb_str(&hb, ":{\"dtype\":\"");
        sb_str(&hb, moe_st_dtype_name(e->dtype));
        sb_str(&hb, "\",\"shape\":[");
        for (int d = 0; d < e->ndim; d++) {
            snprintf(num, sizeof(num), "%s%lld", d ? "," : "", (long long)e->shape[d]);
            sb_str(&hb, num);
        }
        snprintf(num, sizeof(num), "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                 (unsigned long long)(off + bytes[i]));
        sb_str(&hb, num);
        off += bytes[i];
    }
    sb_str(&hb, "}");
    /* Pad with spaces so that the data section starts 8-byte aligned, as the reference does. */
    while ((hb.len + 8) % 8)
        sb_str(&hb, " ");
    if (hb.oom) {
        st = moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory for the header", path);
        goto out;
    }
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)((uint64_t)hb.len >> (8 * i));

    MOE_CHECK_GOTO(check_output_target(path), st, out);
    MOE_CHECK_GOTO(create_temp(path, &tmp, &fd), st, out);
    MOE_CHECK_GOTO(write_all(fd, len8, 8, tmp), st, out);
    MOE_CHECK_GOTO(write_all(fd, hb.p, hb.len, tmp), st, out);
    for (size_t i = 0; i < n; i++)
        MOE_CHECK_GOTO(write_all(fd, entries[i].data, bytes[i], tmp), st, out);
    if (fsync(fd) != 0) {
        st = moe_error(MOE_STATUS_IO_ERROR, "%s: fsync failed: %s", tmp, strerror(errno));
        goto out;
    }
    if (close(fd) != 0) {
        fd = -1;
        st = moe_error(MOE_STATUS_IO_ERROR, "%s: write failed: %s", tmp, strerror(errno));
        goto out;
    }
    fd = -1;
    if (rename(tmp, path) != 0) {
        st = moe_error(MOE_STATUS_IO_ERROR, "%s: cannot rename %s into place: %s", path, tmp,
                       strerror(errno));
        goto out;
    }
    sync_parent_dir(path);
out:
    if (fd >= 0)
        close(fd);
    if (st != MOE_STATUS_SUCCESS && tmp)
        unlink(tmp); /* our own O_EXCL file, never someone else's */
    free(tmp);
    free(hb.p);
    free(bytes);
    return st;
}
