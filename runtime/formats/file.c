/* SPDX-License-Identifier: Apache-2.0 */
/* The one way libmoe and its tools open a file: non-blocking, regular files only (file.h). */
#include "file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/diag.h"

const char *moe_file_kind(mode_t mode)
{
    if (S_ISDIR(mode))
        return "a directory";
    if (S_ISFIFO(mode))
        return "a FIFO (named pipe)";
    if (S_ISCHR(mode))
        return "a character device";
    if (S_ISBLK(mode))
        return "a block device";
    if (S_ISSOCK(mode))
        return "a socket";
    if (S_ISLNK(mode))
        return "a symbolic link";
    return "not a regular file";
}

/* After a non-blocking open: fstat, refuse anything but a regular file, drop O_NONBLOCK. */
static moe_status_t keep_regular(const char *path, int *fd)
{
    struct stat sb;
    int flags;

    if (fstat(*fd, &sb) != 0) {
        int err = errno;
        close(*fd);
        *fd = -1;
        return moe_error(MOE_STATUS_IO_ERROR, "%s: cannot stat: %s", path, strerror(err));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(*fd);
        *fd = -1;
        return moe_error(MOE_STATUS_IO_ERROR, "%s: is %s, not a regular file", path,
                         moe_file_kind(sb.st_mode));
    }
    /* A regular file: reads and writes never block; drop O_NONBLOCK so nothing else sees it. */
    flags = fcntl(*fd, F_GETFL);
    if (flags >= 0)
        (void)fcntl(*fd, F_SETFL, flags & ~O_NONBLOCK);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t open_error(const char *path, int err, const char *verb)
{
    struct stat sb;
    /* a socket cannot be opened at all (ENXIO), nor a FIFO for writing without a reader */
    if (err == ENXIO && lstat(path, &sb) == 0 && !S_ISREG(sb.st_mode))
        return moe_error(MOE_STATUS_IO_ERROR, "%s: is %s, not a regular file", path,
                         moe_file_kind(sb.st_mode));
    return moe_error(MOE_STATUS_IO_ERROR, "%s: cannot %s: %s", path, verb, strerror(err));
}

moe_status_t moe_open_regular(const char *path, int *fd, int *missing)
{
    *fd = -1;
    if (missing)
        *missing = 0;
    /* O_NONBLOCK: opening a FIFO without a writer, or some devices, would otherwise wait
     * forever. */
    *fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (*fd < 0) {
        int err = errno;
        if (err == ENOENT && missing) {
            *missing = 1;
            return MOE_STATUS_SUCCESS;
        }
        return open_error(path, err, "open");
    }
    return keep_regular(path, fd);
}

void *moe_open_regular_write(const char *path, moe_status_t *status)
{
    FILE *f;
    int fd = open(path, O_WRONLY | O_CREAT | O_NONBLOCK | O_CLOEXEC, 0644);

    if (fd < 0) {
        *status = open_error(path, errno, "write");
        return NULL;
    }
    if ((*status = keep_regular(path, &fd)) != MOE_STATUS_SUCCESS)
        return NULL;
    if (ftruncate(fd, 0) != 0 || !(f = fdopen(fd, "w"))) {
        *status = moe_error(MOE_STATUS_IO_ERROR, "%s: cannot write: %s", path, strerror(errno));
        close(fd);
        return NULL;
    }
    *status = MOE_STATUS_SUCCESS;
    return f;
}

moe_status_t moe_read_regular(const char *path, size_t cap, char **out, size_t *len, int *missing)
{
    struct stat sb;
    char *buf;
    size_t got = 0;
    int fd;

    *out = NULL;
    *len = 0;
    MOE_CHECK(moe_open_regular(path, &fd, missing));
    if (missing && *missing)
        return MOE_STATUS_SUCCESS;
    if (fstat(fd, &sb) != 0) {
        int err = errno;
        close(fd);
        return moe_error(MOE_STATUS_IO_ERROR, "%s: cannot stat: %s", path, strerror(err));
    }
    if ((uint64_t)sb.st_size > cap) {
        close(fd);
        return moe_error(MOE_STATUS_FORMAT_ERROR, "%s: %lld bytes, more than the %zu allowed", path,
                         (long long)sb.st_size, cap);
    }
    buf = malloc((size_t)sb.st_size + 1);
    if (!buf) {
        close(fd);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    while (got < (size_t)sb.st_size) {
        ssize_t r = read(fd, buf + got, (size_t)sb.st_size - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            free(buf);
            close(fd);
            return moe_error(MOE_STATUS_IO_ERROR, "%s: read failed: %s", path,
                             r < 0 ? strerror(errno) : "file shrank");
        }
        got += (size_t)r;
    }
    close(fd);
    buf[got] = '\0';
    *out = buf;
    *len = got;
    return MOE_STATUS_SUCCESS;
}

uint64_t moe_fnv1a(uint64_t h, const void *data, size_t len)
{
    const unsigned char *p = data;
    size_t i;
    for (i = 0; i < len; i++) {
        h ^= p[i];
        h *= 1099511628211ULL;
    }
    return h;
}
