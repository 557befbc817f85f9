/* SPDX-License-Identifier: Apache-2.0 */
/* Strict recursive-descent JSON parser with bounded depth and node count (see json.h). */
#include "base/json.h"

#include <locale.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/diag.h"

/* Nodes come from chunks so that a large document costs few mallocs. */
#define NODE_CHUNK 1024
/* Longest number literal accepted (a double needs 24 characters; 1e-300 style is short). */
#define MAX_NUMBER_CHARS 320
/* Objects of at most this many members are searched and checked for duplicates linearly. */
#define SMALL_OBJECT 8

typedef struct node_chunk {
    struct node_chunk *next;
    size_t used;
    moe_json_t nodes[NODE_CHUNK];
} node_chunk_t;

/* Members of one large object sorted by key (freed with the document). */
typedef struct member_index {
    struct member_index *next;
    const moe_json_t *members[];
} member_index_t;

struct moe_json_doc {
    node_chunk_t *chunks;
    member_index_t *indexes;
    char *strings; /* every decoded string and key; decoded text never outgrows its source */
    moe_json_t *root;
};

typedef struct parser {
    const char *text;
    size_t len, pos;
    size_t nodes, max_nodes;
    char *str_out; /* next free byte in doc->strings */
    moe_json_doc_t *doc;
    const char *what;
    moe_status_t status;
} parser_t;

static moe_status_t fail(parser_t *p, const char *reason)
{
    size_t line = 1, col = 1, i;

    if (p->status != MOE_STATUS_SUCCESS)
        return p->status;
    for (i = 0; i < p->pos && i < p->len; i++) {
        if (p->text[i] == '\n') {
            line++;
            col = 1;
        } else {
            col++;
        }
    }
    p->status = moe_error(MOE_STATUS_FORMAT_ERROR, "%s: line %zu column %zu: %s", p->what, line,
                          col, reason);
    return p->status;
}

/* fail() with a key quoted (cut to 100 bytes) in the reason. */
static moe_status_t fail_key(parser_t *p, const char *reason, const char *key)
{
    char msg[160];
    snprintf(msg, sizeof(msg), "%s \"%.100s\" in object", reason, key);
    return fail(p, msg);
}

/* fail() with a formatted reason (one that names a limit). */
static moe_status_t fail_limit(parser_t *p, const char *fmt, ...) MOE_PRINTF(2, 3);
static moe_status_t fail_limit(parser_t *p, const char *fmt, ...)
{
    char msg[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    return fail(p, msg);
}

static moe_json_t *new_node(parser_t *p, moe_json_type_t type)
{
    node_chunk_t *c = p->doc->chunks;
    moe_json_t *n;

    if (p->nodes >= p->max_nodes) {
        fail(p, "too many values in the document (limit reached)");
        return NULL;
    }
    if (!c || c->used == NODE_CHUNK) {
        c = malloc(sizeof(*c));
        if (!c) {
            p->status = moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory", p->what);
            return NULL;
        }
        c->used = 0;
        c->next = p->doc->chunks;
        p->doc->chunks = c;
    }
    n = &c->nodes[c->used++];
    memset(n, 0, sizeof(*n));
    n->type = type;
    p->nodes++;
    return n;
}

static void skip_ws(parser_t *p)
{
    while (p->pos < p->len) {
        char c = p->text[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
            break;
        p->pos++;
    }
}

static int peek(const parser_t *p)
{
    return p->pos < p->len ? (unsigned char)p->text[p->pos] : -1;
}

static int literal(parser_t *p, const char *word)
{
    size_t n = strlen(word);
    if (p->len - p->pos < n || memcmp(p->text + p->pos, word, n) != 0)
        return 0;
    p->pos += n;
    return 1;
}

static int hex4(const char *s, unsigned *out)
{
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = s[i];
        v <<= 4;
        if (c >= '0' && c <= '9')
            v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            v |= (unsigned)(c - 'A' + 10);
        else
            return 0;
    }
    *out = v;
    return 1;
}

static char *put_utf8(char *o, unsigned cp)
{
    if (cp < 0x80) {
        *o++ = (char)cp;
    } else if (cp < 0x800) {
        *o++ = (char)(0xC0 | (cp >> 6));
        *o++ = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        *o++ = (char)(0xE0 | (cp >> 12));
        *o++ = (char)(0x80 | ((cp >> 6) & 0x3F));
        *o++ = (char)(0x80 | (cp & 0x3F));
    } else {
        *o++ = (char)(0xF0 | (cp >> 18));
        *o++ = (char)(0x80 | ((cp >> 12) & 0x3F));
        *o++ = (char)(0x80 | ((cp >> 6) & 0x3F));
        *o++ = (char)(0x80 | (cp & 0x3F));
    }
    return o;
}

/* Length of the valid UTF-8 sequence at s (at most `avail` bytes), 0 if invalid (overlong
 * forms, surrogates and code points past U+10FFFF are invalid). */
static size_t utf8_seq(const unsigned char *s, size_t avail)
{
    unsigned c = s[0], cp;
    size_t n;

    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF)
        n = 2, cp = c & 0x1F;
    else if (c >= 0xE0 && c <= 0xEF)
        n = 3, cp = c & 0x0F;
    else if (c >= 0xF0 && c <= 0xF4)
        n = 4, cp = c & 0x07;
    else
        return 0;
    if (avail < n)
        return 0;
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        cp = (cp << 6) | (s[i] & 0x3F);
    }
    if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)) ||
        (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return n;
}

/* Decodes the string at p->pos (at the opening quote) into the string area. */
static moe_status_t parse_string(parser_t *p, const char **out, size_t *out_len)
{
    char *start = p->str_out, *o = p->str_out;

    p->pos++; /* opening quote */
    for (;;) {
        int c = peek(p);
        if (c < 0)
            return fail(p, "unterminated string");
        if (c == '"') {
            p->pos++;
            break;
        }
        if (c < 0x20)
            return fail(p, "control character in string");
        if (c == '\\') {
            unsigned cp, lo;
            if (p->len - p->pos < 2)
                return fail(p, "unterminated escape in string");
            c = (unsigned char)p->text[p->pos + 1];
            p->pos += 2;
            switch (c) {
            case '"':
            case '\\':
            case '/':
                *o++ = (char)c;
                continue;
            case 'b':
                *o++ = '\b';
                continue;
            case 'f':
                *o++ = '\f';
                continue;
            case 'n':
                *o++ = '\n';
                continue;
            case 'r':
                *o++ = '\r';
                continue;
            case 't':
                *o++ = '\t';
                continue;
            case 'u':
                break;
            default:
                p->pos -= 1;
                return fail(p, "invalid escape in string");
            }
            if (p->len - p->pos < 4 || !hex4(p->text + p->pos, &cp))
                return fail(p, "invalid \\u escape in string");
            p->pos += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                if (p->len - p->pos < 6 || p->text[p->pos] != '\\' || p->text[p->pos + 1] != 'u' ||
                    !hex4(p->text + p->pos + 2, &lo) || lo < 0xDC00 || lo > 0xDFFF)
                    return fail(p, "unpaired UTF-16 surrogate in \\u escape");
                p->pos += 6;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                return fail(p, "unpaired UTF-16 surrogate in \\u escape");
            } else if (cp == 0) {
                return fail(p, "\\u0000 in string is not supported");
            }
            o = put_utf8(o, cp);
            continue;
        }
        {
            size_t n = utf8_seq((const unsigned char *)p->text + p->pos, p->len - p->pos);
            if (n == 0)
                return fail(p, "invalid UTF-8 in string");
            memcpy(o, p->text + p->pos, n);
            o += n;
            p->pos += n;
        }
    }
    *o++ = '\0';
    p->str_out = o;
    *out = start;
    *out_len = (size_t)(o - start - 1);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t parse_number(parser_t *p, moe_json_t *n)
{
    size_t s = p->pos, digits_begin;
    int is_int = 1;
    char buf[MAX_NUMBER_CHARS + 1];
    char *end = NULL;
    const char *dp;

    if (peek(p) == '-')
        p->pos++;
    digits_begin = p->pos;
    if (peek(p) == '0') {
        p->pos++;
    } else if (peek(p) >= '1' && peek(p) <= '9') {
        while (peek(p) >= '0' && peek(p) <= '9')
            p->pos++;
    } else {
        return fail(p, "invalid number");
    }
    if (peek(p) == '.') {
        is_int = 0;
        p->pos++;
        if (!(peek(p) >= '0' && peek(p) <= '9'))
            return fail(p, "invalid number: digit expected after '.'");
        while (peek(p) >= '0' && peek(p) <= '9')
            p->pos++;
    }
    if (peek(p) == 'e' || peek(p) == 'E') {
        is_int = 0;
        p->pos++;
        if (peek(p) == '+' || peek(p) == '-')
            p->pos++;
        if (!(peek(p) >= '0' && peek(p) <= '9'))
            return fail(p, "invalid number: digit expected in exponent");
        while (peek(p) >= '0' && peek(p) <= '9')
            p->pos++;
    }
    if (p->pos - s > MAX_NUMBER_CHARS)
        return fail(p, "number literal too long");
    if (is_int) {
        /* Exact int64 with overflow check; larger integers keep only the double. */
        uint64_t v = 0;
        uint64_t limit = p->text[s] == '-' ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
        int fits = 1;
        for (size_t i = digits_begin; i < p->pos; i++) {
            unsigned d = (unsigned)(p->text[i] - '0');
            if (v > (limit - d) / 10) {
                fits = 0;
                break;
            }
            v = v * 10 + d;
        }
        if (fits) {
            n->is_int = 1;
            if (p->text[s] != '-')
                n->integer = (int64_t)v;
            else if (v == (uint64_t)INT64_MAX + 1)
                n->integer = INT64_MIN;
            else
                n->integer = -(int64_t)v;
            n->number = (double)n->integer;
            return MOE_STATUS_SUCCESS;
        }
    }
    /* strtod honours the locale's decimal point: write that one instead of '.'. */
    memcpy(buf, p->text + s, p->pos - s);
    buf[p->pos - s] = '\0';
    dp = localeconv()->decimal_point;
    if (dp && dp[0] && dp[0] != '.' && !dp[1]) {
        char *dot = strchr(buf, '.');
        if (dot)
            *dot = dp[0];
    }
    n->number = strtod(buf, &end);
    return MOE_STATUS_SUCCESS;
}

static moe_status_t parse_value(parser_t *p, int depth, moe_json_t **out);

/* Byte order of keys (shorter first on a common prefix); one order for sorting and lookup. */
static int key_cmp(const char *a, size_t an, const char *b, size_t bn)
{
    int c = memcmp(a, b, an < bn ? an : bn);
    if (c)
        return c;
    return an < bn ? -1 : an > bn;
}

static int member_cmp(const void *x, const void *y)
{
    const moe_json_t *a = *(const moe_json_t *const *)x, *b = *(const moe_json_t *const *)y;
    return key_cmp(a->key, a->key_len, b->key, b->key_len);
}

/* Duplicate keys make a header ambiguous: reject them. Small objects compare pairwise; larger
 * ones sort their members (O(n log n) whatever the keys, unlike a hash set that crafted
 * colliding keys turn quadratic), compare neighbours, and keep the sorted array for
 * moe_json_get's binary search. */
static moe_status_t check_duplicates(parser_t *p, moe_json_t *obj)
{
    const moe_json_t *a, *b;
    member_index_t *ix;
    size_t i = 0;

    if (obj->count <= SMALL_OBJECT) {
        for (a = obj->child; a; a = a->next)
            for (b = a->next; b; b = b->next)
                if (a->key_len == b->key_len && !memcmp(a->key, b->key, a->key_len))
                    return fail_key(p, "duplicate key", a->key);
        return MOE_STATUS_SUCCESS;
    }
    ix = malloc(sizeof(*ix) + obj->count * sizeof(ix->members[0]));
    if (!ix)
        return p->status = moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory", p->what);
    ix->next = p->doc->indexes;
    p->doc->indexes = ix;
    for (a = obj->child; a; a = a->next)
        ix->members[i++] = a;
    qsort(ix->members, obj->count, sizeof(ix->members[0]), member_cmp);
    for (i = 1; i < obj->count; i++) {
        a = ix->members[i - 1];
        b = ix->members[i];
        if (a->key_len == b->key_len && !memcmp(a->key, b->key, a->key_len))
            return fail_key(p, "duplicate key", a->key);
    }
    obj->sorted = ix->members;
    return MOE_STATUS_SUCCESS;
}

static moe_status_t parse_container(parser_t *p, int depth, moe_json_t *n)
{
    int is_obj = n->type == MOE_JSON_OBJECT;
    char close = is_obj ? '}' : ']';
    moe_json_t **tail = &n->child;

    p->pos++; /* '{' or '[' */
    skip_ws(p);
    if (peek(p) == close) {
        p->pos++;
        return MOE_STATUS_SUCCESS;
    }
    for (;;) {
        const char *key = NULL;
        size_t key_len = 0;
        moe_json_t *v = NULL;

        skip_ws(p);
        if (is_obj) {
            if (peek(p) != '"')
                return fail(p, "expected a string key in object");
            if (n->count >= MOE_JSON_MAX_MEMBERS)
                return fail_limit(p, "object has more members than the limit of %d",
                                  MOE_JSON_MAX_MEMBERS);
            MOE_CHECK(parse_string(p, &key, &key_len));
            if (key_len > MOE_JSON_MAX_KEY_BYTES)
                return fail_limit(p, "object key longer than the limit of %d bytes",
                                  MOE_JSON_MAX_KEY_BYTES);
            skip_ws(p);
            if (peek(p) != ':')
                return fail(p, "expected ':' after object key");
            p->pos++;
            skip_ws(p);
        }
        MOE_CHECK(parse_value(p, depth + 1, &v));
        v->key = key;
        v->key_len = key_len;
        *tail = v;
        tail = &v->next;
        n->count++;
        skip_ws(p);
        if (peek(p) == ',') {
            p->pos++;
            continue;
        }
        if (peek(p) == close) {
            p->pos++;
            break;
        }
        return fail(p, is_obj ? "expected ',' or '}' in object" : "expected ',' or ']' in array");
    }
    return is_obj ? check_duplicates(p, n) : MOE_STATUS_SUCCESS;
}

static moe_status_t parse_value(parser_t *p, int depth, moe_json_t **out)
{
    moe_json_t *n;
    int c;

    if (depth > MOE_JSON_MAX_DEPTH)
        return fail(p, "nesting too deep");
    skip_ws(p);
    c = peek(p);
    if (c < 0)
        return fail(p, "unexpected end of input, expected a value");
    switch (c) {
    case '{':
    case '[':
        n = new_node(p, c == '{' ? MOE_JSON_OBJECT : MOE_JSON_ARRAY);
        if (!n)
            return p->status;
        *out = n;
        return parse_container(p, depth, n);
    case '"':
        n = new_node(p, MOE_JSON_STRING);
        if (!n)
            return p->status;
        *out = n;
        return parse_string(p, &n->string, &n->string_len);
    case 't':
    case 'f':
    case 'n':
        n = new_node(p, c == 'n' ? MOE_JSON_NULL : MOE_JSON_BOOL);
        if (!n)
            return p->status;
        *out = n;
        if (literal(p, c == 't' ? "true" : c == 'f' ? "false" : "null")) {
            n->boolean = c == 't';
            return MOE_STATUS_SUCCESS;
        }
        return fail(p, "invalid literal (expected true, false or null)");
    default:
        if (c == '-' || (c >= '0' && c <= '9')) {
            n = new_node(p, MOE_JSON_NUMBER);
            if (!n)
                return p->status;
            *out = n;
            return parse_number(p, n);
        }
        return fail(p, "unexpected character, expected a value");
    }
}

moe_status_t moe_json_parse(const char *text, size_t len, size_t max_nodes, const char *what,
                            moe_json_doc_t **doc)
{
    parser_t p;
    moe_json_doc_t *d;
    moe_status_t st;

    *doc = NULL;
    if (!what)
        what = "JSON";
    if (!text && len)
        return moe_error(MOE_STATUS_INVALID_ARGUMENT, "%s: NULL text", what);
    d = calloc(1, sizeof(*d));
    if (!d || !(d->strings = malloc(len + 1))) {
        free(d);
        return moe_error(MOE_STATUS_OUT_OF_MEMORY, "%s: out of memory for %zu bytes", what, len);
    }
    memset(&p, 0, sizeof(p));
    p.text = text;
    p.len = len;
    p.max_nodes = max_nodes ? max_nodes : MOE_JSON_DEFAULT_MAX_NODES;
    p.str_out = d->strings;
    p.doc = d;
    p.what = what;
    p.status = MOE_STATUS_SUCCESS;

    st = parse_value(&p, 0, &d->root);
    if (st == MOE_STATUS_SUCCESS) {
        skip_ws(&p);
        if (p.pos != p.len)
            st = fail(&p, "trailing characters after the value");
    }
    if (st != MOE_STATUS_SUCCESS) {
        moe_json_free(d);
        return st;
    }
    *doc = d;
    return MOE_STATUS_SUCCESS;
}

void moe_json_free(moe_json_doc_t *doc)
{
    node_chunk_t *c, *next;

    if (!doc)
        return;
    for (c = doc->chunks; c; c = next) {
        next = c->next;
        free(c);
    }
    while (doc->indexes) {
        member_index_t *ix = doc->indexes;
        doc->indexes = ix->next;
        free(ix);
    }
    free(doc->strings);
    free(doc);
}

const moe_json_t *moe_json_root(const moe_json_doc_t *doc)
{
    return doc ? doc->root : NULL;
}

const moe_json_t *moe_json_get(const moe_json_t *obj, const char *key)
{
    size_t n;

    if (!obj || obj->type != MOE_JSON_OBJECT || !key)
        return NULL;
    n = strlen(key);
    if (obj->sorted) {
        size_t lo = 0, hi = obj->count;
        while (lo < hi) {
            size_t mid = lo + (hi - lo) / 2;
            const moe_json_t *m = obj->sorted[mid];
            int c = key_cmp(m->key, m->key_len, key, n);
            if (c == 0)
                return m;
            if (c < 0)
                lo = mid + 1;
            else
                hi = mid;
        }
        return NULL;
    }
    for (const moe_json_t *m = obj->child; m; m = m->next)
        if (m->key_len == n && memcmp(m->key, key, n) == 0)
            return m;
    return NULL;
}

const moe_json_t *moe_json_at(const moe_json_t *arr, size_t i)
{
    const moe_json_t *e;

    if (!arr || arr->type != MOE_JSON_ARRAY || i >= arr->count)
        return NULL;
    for (e = arr->child; i; i--)
        e = e->next;
    return e;
}

int moe_json_member_int(const moe_json_t *obj, const char *key, int64_t *out)
{
    const moe_json_t *v = moe_json_get(obj, key);
    if (!v || v->type == MOE_JSON_NULL)
        return 0;
    if (v->type != MOE_JSON_NUMBER || !v->is_int)
        return -1;
    *out = v->integer;
    return 1;
}

int moe_json_member_number(const moe_json_t *obj, const char *key, double *out)
{
    const moe_json_t *v = moe_json_get(obj, key);
    if (!v || v->type == MOE_JSON_NULL)
        return 0;
    if (v->type != MOE_JSON_NUMBER)
        return -1;
    *out = v->number;
    return 1;
}

int moe_json_member_bool(const moe_json_t *obj, const char *key, int *out)
{
    const moe_json_t *v = moe_json_get(obj, key);
    if (!v || v->type == MOE_JSON_NULL)
        return 0;
    if (v->type != MOE_JSON_BOOL)
        return -1;
    *out = v->boolean;
    return 1;
}

int moe_json_member_string(const moe_json_t *obj, const char *key, const char **out)
{
    const moe_json_t *v = moe_json_get(obj, key);
    if (!v || v->type == MOE_JSON_NULL)
        return 0;
    if (v->type != MOE_JSON_STRING)
        return -1;
    *out = v->string;
    return 1;
}

size_t moe_json_escape_byte(unsigned char c, char out[7])
{
    if (c == '"' || c == '\\') {
        out[0] = '\\', out[1] = (char)c, out[2] = '\0';
        return 2;
    }
    if (c < 0x20)
        return (size_t)snprintf(out, 7, "\\u%04x", c);
    out[0] = (char)c, out[1] = '\0';
    return 1;
}

const char *moe_json_type_name(moe_json_type_t type)
{
    static const char *const names[] = {"null", "boolean", "number", "string", "array", "object"};
    return (unsigned)type < 6 ? names[type] : "invalid";
}
