/* SPDX-License-Identifier: Apache-2.0 */
/* A small strict JSON (RFC 8259) parser for safetensors headers and config.json, written for
 * hostile input: bounded nesting, bounded node count, no allocation larger than the input. */
#ifndef MOE_JSON_H
#define MOE_JSON_H

#include <stddef.h>
#include <stdint.h>
#include "moe/moe.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Nesting deeper than this is a format error (config.json nests 3-4 levels). */
#define MOE_JSON_MAX_DEPTH 64
/* Bounds on one object: members, and bytes of one key (decoded). Tensor names are under 200
 * bytes and the largest published index maps about 10^5 tensors. Over either is a format
 * error naming the limit. */
#define MOE_JSON_MAX_MEMBERS 1048576
#define MOE_JSON_MAX_KEY_BYTES 4096
/* Default bound on the number of values in one document (about 10 per safetensors tensor). */
#define MOE_JSON_DEFAULT_MAX_NODES (2 * 1024 * 1024)

typedef enum moe_json_type {
    MOE_JSON_NULL = 0,
    MOE_JSON_BOOL,
    MOE_JSON_NUMBER,
    MOE_JSON_STRING,
    MOE_JSON_ARRAY,
    MOE_JSON_OBJECT
} moe_json_type_t;

/* One value. Children of arrays and objects form a singly linked list in document order;
 * members of an object carry their key. Strings are NUL-terminated UTF-8 ("\u0000" is
 * rejected so that C string functions see the whole string). */
typedef struct moe_json {
    moe_json_type_t type;
    int boolean;        /* MOE_JSON_BOOL */
    int is_int;         /* number written without fraction/exponent and fits in int64 */
    int64_t integer;    /* valid when is_int */
    double number;      /* every number */
    const char *string; /* MOE_JSON_STRING */
    size_t string_len;
    const char *key; /* member of an object: its key; else NULL */
    size_t key_len;
    struct moe_json *child; /* first element/member */
    struct moe_json *next;  /* next sibling */
    size_t count;           /* elements/members */
    /* objects of more than 8 members: the members sorted by key (moe_json_get searches it) */
    const struct moe_json *const *sorted;
} moe_json_t;

typedef struct moe_json_doc moe_json_doc_t;

/* Parses `len` bytes (no NUL needed). On error returns MOE_STATUS_FORMAT_ERROR with a message
 * "<what>: line L column C: <reason>" (or OUT_OF_MEMORY); *doc is NULL then. max_nodes 0 means
 * MOE_JSON_DEFAULT_MAX_NODES. Duplicate keys in one object are an error, and so is an object
 * over MOE_JSON_MAX_MEMBERS members or a key over MOE_JSON_MAX_KEY_BYTES. Time is
 * O(len log len) whatever the input. */
moe_status_t moe_json_parse(const char *text, size_t len, size_t max_nodes, const char *what,
                            moe_json_doc_t **doc);
/* NULL is fine. */
void moe_json_free(moe_json_doc_t *doc);
const moe_json_t *moe_json_root(const moe_json_doc_t *doc);

/* Member `key` of an object, or NULL (also when `obj` is NULL or not an object). O(log n) for
 * large objects. */
const moe_json_t *moe_json_get(const moe_json_t *obj, const char *key);
/* Element i of an array, or NULL. */
const moe_json_t *moe_json_at(const moe_json_t *arr, size_t i);

/* Typed reads of an optional member: return 1 and set *out when present with the right type,
 * 0 when absent or null, -1 when present with another type (caller reports the error). */
int moe_json_member_int(const moe_json_t *obj, const char *key, int64_t *out);
int moe_json_member_number(const moe_json_t *obj, const char *key, double *out);
int moe_json_member_bool(const moe_json_t *obj, const char *key, int *out);
int moe_json_member_string(const moe_json_t *obj, const char *key, const char **out);

const char *moe_json_type_name(moe_json_type_t type);

/* Byte c as the text it takes inside a JSON string (the writers' one rule: '"' and '\\'
 * backslashed, control characters as \\u00XX, every other byte itself) into out, NUL-terminated;
 * its length (1, 2 or 6). */
size_t moe_json_escape_byte(unsigned char c, char out[7]);

#ifdef __cplusplus
}
#endif

#endif /* MOE_JSON_H */
