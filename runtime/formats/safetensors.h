/* SPDX-License-Identifier: Apache-2.0 */
/* safetensors files, read for hostile input (header validated against the file, reads by pread
 * of exactly the bytes asked for) and written (moe-run --output, tests). Internal. */
#ifndef MOE_SAFETENSORS_H
#define MOE_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>
#include "moe/moe.h"
#include "runtime/formats/file.h"
#include "base/json.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The format's own bound on the JSON header (the reference implementation's MAX_HEADER_SIZE). */
#define MOE_ST_MAX_HEADER_BYTES 100000000ull
/* Tensors of more dimensions are rejected (checkpoints use 0 to 3). */
#define MOE_ST_MAX_DIMS 8

typedef enum moe_st_dtype {
    MOE_ST_INVALID = 0,
    MOE_ST_BOOL,
    MOE_ST_U8,
    MOE_ST_I8,
    MOE_ST_F8_E4M3,
    MOE_ST_F8_E5M2,
    MOE_ST_F8_E8M0,
    MOE_ST_I16,
    MOE_ST_U16,
    MOE_ST_F16,
    MOE_ST_BF16,
    MOE_ST_I32,
    MOE_ST_U32,
    MOE_ST_F32,
    MOE_ST_I64,
    MOE_ST_U64,
    MOE_ST_F64,
    MOE_ST_DTYPE_COUNT
} moe_st_dtype_t;

/* "BF16" etc.; "INVALID" for unknown values. */
const char *moe_st_dtype_name(moe_st_dtype_t dtype);
/* Bytes per element; 0 for MOE_ST_INVALID. */
size_t moe_st_dtype_size(moe_st_dtype_t dtype);
/* MOE_ST_INVALID when `name` is not a dtype of the format (or a sub-byte one: F4, F6_*). */
moe_st_dtype_t moe_st_dtype_from_name(const char *name);
/* The libmoe dtype of the same encoding (F32, BF16, F16, F8_E4M3), else MOE_DTYPE_INVALID. */
moe_dtype_t moe_st_to_moe_dtype(moe_st_dtype_t dtype);
moe_st_dtype_t moe_st_from_moe_dtype(moe_dtype_t dtype);

/* One tensor of a validated header. `begin`/`end` are byte offsets in the data section (after
 * the header); end - begin == elements * dtype size. Viewed as a row-major matrix, a tensor
 * has `rows` = shape[0] (1 for 0-D) and `cols` = the product of the other dimensions. */
typedef struct moe_st_tensor {
    const char *name;
    moe_st_dtype_t dtype;
    int ndim;
    int64_t shape[MOE_ST_MAX_DIMS];
    int64_t rows, cols;
    uint64_t begin, end;
} moe_st_tensor_t;

typedef struct moe_st_header {
    moe_json_doc_t *doc;
    moe_st_tensor_t *tensors; /* sorted by name */
    size_t num_tensors;
    const moe_json_t *metadata; /* "__metadata__" object (string values), or NULL */
    uint64_t data_bytes;        /* size of the data section the header was checked against */
} moe_st_header_t;

/* Parses and validates a JSON header of `len` bytes against a data section of `data_bytes`:
 * known dtypes, shapes of at most MOE_ST_MAX_DIMS non-negative integers without overflow,
 * data_offsets [begin, end] with end - begin == elements * dtype size, tensors covering the
 * data section exactly once (no overlap, no gap, nothing past the end), __metadata__ a map of
 * strings. `what` names the file in messages. Errors: MOE_STATUS_FORMAT_ERROR. */
moe_status_t moe_st_header_parse(const char *json, size_t len, uint64_t data_bytes,
                                 const char *what, moe_st_header_t **header);
/* The same for a whole file held in memory (8-byte length, header, data). Used by the fuzz
 * target and by the file reader's checks of the first bytes. */
moe_status_t moe_st_parse_buffer(const void *buf, size_t size, const char *what,
                                 moe_st_header_t **header);
void moe_st_header_free(moe_st_header_t *header);
/* The tensor named `name`, or NULL. */
const moe_st_tensor_t *moe_st_header_find(const moe_st_header_t *header, const char *name);
/* A __metadata__ value, or NULL. */
const char *moe_st_header_metadata(const moe_st_header_t *header, const char *key);

/* An open file: the header is read and validated at open, tensor data on demand. */
typedef struct moe_st_file moe_st_file_t;

/* Opens (moe_open_regular) and validates `path` (header length within the file and the cap).
 * Errors: MOE_STATUS_IO_ERROR (open/stat/read), MOE_STATUS_FORMAT_ERROR (contents). */
moe_status_t moe_st_open(const char *path, moe_st_file_t **file);
void moe_st_close(moe_st_file_t *file);
const moe_st_header_t *moe_st_file_header(const moe_st_file_t *file);
const char *moe_st_file_path(const moe_st_file_t *file);
const moe_st_tensor_t *moe_st_find(const moe_st_file_t *file, const char *name);

/* Reads rows [r0, r1) x columns [c0, c1) of `t` (viewed as a matrix) into `dst`, contiguous
 * (r1 - r0) x (c1 - c0) elements in the file's dtype. Full-width row ranges take one pread;
 * column slices one pread per row segment, or, where the gaps between row segments are at
 * most 4 KiB (pages the kernel reads anyway), a few large preads through a bounded bounce
 * buffer. Nothing outside the rows asked for is read. */
moe_status_t moe_st_read_block(moe_st_file_t *file, const moe_st_tensor_t *t, int64_t r0,
                               int64_t r1, int64_t c0, int64_t c1, void *dst);
/* Bytes and pread calls issued for tensor data since open (tests check shard-only reads). */
void moe_st_file_stats(const moe_st_file_t *file, uint64_t *bytes_read, uint64_t *reads);

/* One tensor to write. */
typedef struct moe_st_entry {
    const char *name;
    moe_st_dtype_t dtype;
    int ndim;
    int64_t shape[MOE_ST_MAX_DIMS];
    const void *data; /* elements * dtype size bytes */
} moe_st_entry_t;

/* Writes a safetensors file (header padded to 8 bytes, data in entry order) through a
 * temporary file beside it (created with O_EXCL | O_NOFOLLOW, fsynced, renamed into place;
 * removed on every error). An existing `path` must be a regular file: a symbolic link, device,
 * FIFO or directory there is refused (IO_ERROR), never replaced or followed. `metadata` holds
 * n_metadata key/value string pairs (metadata[2i], metadata[2i+1]); may be NULL. Errors:
 * INVALID_ARGUMENT, IO_ERROR. */
moe_status_t moe_st_write(const char *path, const moe_st_entry_t *entries, size_t n,
                          const char *const *metadata, size_t n_metadata);

#ifdef __cplusplus
}
#endif

#endif /* MOE_SAFETENSORS_H */
