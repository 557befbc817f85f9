/* SPDX-License-Identifier: Apache-2.0 */
/* The one way libmoe and its tools open a file: non-blocking, regular files only. */
#ifndef MOE_FILE_H
#define MOE_FILE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a non-regular file is, for messages: "a directory", "a FIFO (named pipe)", ... */
const char *moe_file_kind(mode_t mode);

/* Opens `path` read-only for every reader (model, config, index, input, tune file): O_NONBLOCK
 * so that a FIFO or device cannot block, then fstat, and anything but a regular file is refused
 * (IO_ERROR naming the file and what it is: directory, FIFO, device, socket). The returned
 * descriptor is close-on-exec and blocking again. With `missing` not NULL, a path that does
 * not exist gives success, *missing = 1 and *fd = -1. */
moe_status_t moe_open_regular(const char *path, int *fd, int *missing);

/* Opens `path` for writing (created 0644 when missing, truncated when a regular file), by the
 * same rule: O_NONBLOCK, so a FIFO without a reader fails at once (ENXIO) and one with a reader
 * is refused after fstat, as is anything else that is not a regular file; nothing is truncated
 * before the check. Returns a FILE * (blocking again) or NULL with IO_ERROR in *status. */
void *moe_open_regular_write(const char *path, moe_status_t *status);

/* Reads a whole regular file of at most `cap` bytes (moe_open_regular) into a malloc'd buffer
 * with a 0 after its end. FORMAT_ERROR when larger; *missing as moe_open_regular. */
moe_status_t moe_read_regular(const char *path, size_t cap, char **out, size_t *len, int *missing);

/* FNV-1a over `len` bytes, continuing from `h` (start: MOE_FNV_BASIS). */
#define MOE_FNV_BASIS 1469598103934665603ULL
uint64_t moe_fnv1a(uint64_t h, const void *data, size_t len);

#ifdef __cplusplus
}
#endif

#endif /* MOE_FILE_H */
