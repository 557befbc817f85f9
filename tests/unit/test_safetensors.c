/* SPDX-License-Identifier: Apache-2.0 */
/* The JSON parser and the safetensors reader/writer, on good files and on malformed ones. */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/json.h"
#include "runtime/formats/safetensors.h"

static char g_dir[256];

static void path_in(char *out, size_t n, const char *name)
{
    snprintf(out, n, "%s/%s", g_dir, name);
}

/* Writes a raw file: 8-byte length (from `len_field`, or the header's length if UINT64_MAX),
 * the header text, then `data_len` bytes of data (a byte pattern). */
static void write_raw(const char *name, const char *header, uint64_t len_field, size_t data_len)
{
    char path[512];
    unsigned char len8[8];
    uint64_t n = len_field == UINT64_MAX ? strlen(header) : len_field;
    FILE *fp;

    path_in(path, sizeof(path), name);
    fp = fopen(path, "wb");
    assert_non_null(fp);
    for (int i = 0; i < 8; i++)
        len8[i] = (unsigned char)(n >> (8 * i));
    assert_int_equal(fwrite(len8, 1, 8, fp), 8);
    assert_int_equal(fwrite(header, 1, strlen(header), fp), strlen(header));
    for (size_t i = 0; i < data_len; i++)
        fputc((int)(i & 0xff), fp);
    fclose(fp);
}

static void write_bytes(const char *name, const void *bytes, size_t n)
{
    char path[512];
    FILE *fp;

    path_in(path, sizeof(path), name);
    fp = fopen(path, "wb");
    assert_non_null(fp);
    if (n)
        assert_int_equal(fwrite(bytes, 1, n, fp), n);
    fclose(fp);
}

/* Opening `name` fails with `status` and a message containing `needle`. */
static void expect_open_error(const char *name, moe_status_t status, const char *needle)
{
    char path[512];
    moe_st_file_t *f = (moe_st_file_t *)0x1;
    moe_status_t st;

    path_in(path, sizeof(path), name);
    st = moe_st_open(path, &f);
    if (st != status || !strstr(moe_last_error(), needle))
        fail_msg("%s: got %s \"%s\", expected %s containing \"%s\"", name, moe_status_string(st),
                 moe_last_error(), moe_status_string(status), needle);
    assert_null(f);
}

static int setup(void **state)
{
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof(g_dir), "%s/moe_st_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    assert_non_null(mkdtemp(g_dir));
    return 0;
}

static int teardown(void **state)
{
    char cmd[300];
    /* Only our own mkdtemp folder. */
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* ---- JSON --------------------------------------------------------------------------------- */

static void expect_json_error(const char *text, const char *needle)
{
    moe_json_doc_t *doc = (moe_json_doc_t *)0x1;
    moe_status_t st = moe_json_parse(text, strlen(text), 0, "t.json", &doc);
    if (st != MOE_STATUS_FORMAT_ERROR || !strstr(moe_last_error(), needle))
        fail_msg("json %.60s: got %s \"%s\", expected FORMAT_ERROR with \"%s\"", text,
                 moe_status_string(st), moe_last_error(), needle);
    assert_null(doc);
}

static void test_json_values(void **state)
{
    const char *text = "{\"a\": [1, -2, 9223372036854775807, -9223372036854775808, 2.5, 1e3,"
                       " 18446744073709551616], \"s\": \"x\\u00e9\\ud83d\\ude00\\n\\\"\","
                       " \"t\": true, \"f\": false, \"n\": null, \"o\": {}}";
    moe_json_doc_t *doc = NULL;
    const moe_json_t *root, *a, *s;
    int64_t i64 = 0;
    int b = 0;
    double d = 0;

    assert_int_equal(moe_json_parse(text, strlen(text), 0, "t", &doc), MOE_STATUS_SUCCESS);
    root = moe_json_root(doc);
    assert_int_equal(root->type, MOE_JSON_OBJECT);
    assert_int_equal(root->count, 6);
    a = moe_json_get(root, "a");
    assert_int_equal(a->count, 7);
    assert_true(moe_json_at(a, 0)->is_int && moe_json_at(a, 0)->integer == 1);
    assert_true(moe_json_at(a, 1)->integer == -2);
    assert_true(moe_json_at(a, 2)->is_int && moe_json_at(a, 2)->integer == INT64_MAX);
    assert_true(moe_json_at(a, 3)->is_int && moe_json_at(a, 3)->integer == INT64_MIN);
    assert_true(!moe_json_at(a, 4)->is_int && moe_json_at(a, 4)->number == 2.5);
    assert_true(!moe_json_at(a, 5)->is_int && moe_json_at(a, 5)->number == 1000.0);
    assert_true(!moe_json_at(a, 6)->is_int && moe_json_at(a, 6)->number > 1.8e19);
    assert_null(moe_json_at(a, 7));
    s = moe_json_get(root, "s");
    assert_string_equal(s->string, "x\xc3\xa9\xf0\x9f\x98\x80\n\"");
    assert_int_equal(moe_json_member_bool(root, "t", &b), 1);
    assert_int_equal(b, 1);
    assert_int_equal(moe_json_member_bool(root, "n", &b), 0);
    assert_int_equal(moe_json_member_int(root, "s", &i64), -1);
    assert_int_equal(moe_json_member_number(root, "missing", &d), 0);
    assert_int_equal(moe_json_get(root, "o")->count, 0);
    moe_json_free(doc);
}

/* The writers' escape rule: every ASCII byte, escaped and quoted, parses back to itself; the
 * three kinds of output by length. */
static void test_json_escape_byte(void **state)
{
    char e[7], text[16];
    (void)state;
    assert_int_equal(moe_json_escape_byte('a', e), 1);
    assert_string_equal(e, "a");
    assert_int_equal(moe_json_escape_byte('"', e), 2);
    assert_string_equal(e, "\\\"");
    assert_int_equal(moe_json_escape_byte('\\', e), 2);
    assert_string_equal(e, "\\\\");
    assert_int_equal(moe_json_escape_byte('\n', e), 6);
    assert_string_equal(e, "\\u000a");
    for (int c = 1; c < 0x80; c++) {
        moe_json_doc_t *doc = NULL;
        const size_t n = moe_json_escape_byte((unsigned char)c, e);
        assert_int_equal(n, strlen(e));
        snprintf(text, sizeof(text), "\"%s\"", e);
        assert_int_equal(moe_json_parse(text, strlen(text), 0, "t", &doc), MOE_STATUS_SUCCESS);
        assert_int_equal(moe_json_root(doc)->type, MOE_JSON_STRING);
        assert_int_equal((unsigned char)moe_json_root(doc)->string[0], c);
        assert_int_equal(moe_json_root(doc)->string[1], '\0');
        moe_json_free(doc);
    }
}

static void test_json_errors(void **state)
{
    char deep[4096];
    size_t i;

    expect_json_error("", "unexpected end of input");
    expect_json_error("{\"a\" 1}", "expected ':'");
    expect_json_error("{\"a\": 1,}", "expected a string key");
    expect_json_error("[1, 2", "expected ',' or ']'");
    expect_json_error("{\"a\": 1} x", "trailing characters");
    expect_json_error("{\"a\": 1, \"a\": 2}", "duplicate key \"a\"");
    expect_json_error("[01]", "expected ',' or ']'");
    expect_json_error("[1.]", "digit expected after '.'");
    expect_json_error("[-]", "invalid number");
    expect_json_error("[NaN]", "expected a value");
    expect_json_error("[tru]", "invalid literal");
    expect_json_error("[\"a\\q\"]", "invalid escape");
    expect_json_error("[\"\\ud800\"]", "unpaired UTF-16 surrogate");
    expect_json_error("[\"\\u0000\"]", "\\u0000");
    expect_json_error("[\"a\x01\"]", "control character");
    expect_json_error("[\"\xc0\xaf\"]", "invalid UTF-8");
    expect_json_error("[\"abc", "unterminated string");
    for (i = 0; i < 100; i++)
        deep[i] = '[';
    deep[i] = '\0';
    expect_json_error(deep, "nesting too deep");
    expect_json_error("{\"x\": [[[[1]]]]}\n\n  }", "line 3 column 3");
}

static void test_json_many_keys_and_node_limit(void **state)
{
    /* 2000 distinct keys (hash path) then one duplicate far apart. */
    size_t cap = 2000 * 16 + 64, n = 0;
    char *text = malloc(cap);
    moe_json_doc_t *doc = NULL;

    n += (size_t)sprintf(text + n, "{");
    for (int i = 0; i < 2000; i++)
        n += (size_t)sprintf(text + n, "%s\"k%d\":%d", i ? "," : "", i, i);
    n += (size_t)sprintf(text + n, "}");
    assert_int_equal(moe_json_parse(text, n, 0, "t", &doc), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_json_root(doc)->count, 2000);
    moe_json_free(doc);
    assert_int_equal(moe_json_parse(text, n, 100, "t", &doc), MOE_STATUS_FORMAT_ERROR);
    assert_non_null(strstr(moe_last_error(), "too many values"));
    sprintf(text + n - 1, ",\"k7\":1}");
    assert_int_equal(moe_json_parse(text, strlen(text), 0, "t", &doc), MOE_STATUS_FORMAT_ERROR);
    assert_non_null(strstr(moe_last_error(), "duplicate key \"k7\""));
    free(text);
}

/* ---- safetensors: good files -------------------------------------------------------------- */

static void test_write_read_roundtrip(void **state)
{
    char path[512];
    float a[6] = {1, 2, 3, 4, 5, 6};
    uint16_t b[2 * 3 * 4];
    uint8_t c[5] = {1, 2, 3, 4, 5};
    int64_t z = 42;
    const char *meta[] = {"format", "pt", "note", "a \"quoted\" \\ value"};
    moe_st_entry_t e[4] = {
        {"a", MOE_ST_F32, 2, {2, 3}, a},
        {"layers.0.b \"weird\" name", MOE_ST_BF16, 3, {2, 3, 4}, b},
        {"c", MOE_ST_F8_E4M3, 1, {5}, c},
        {"scalar", MOE_ST_I64, 0, {0}, &z},
    };
    moe_st_file_t *f = NULL;
    const moe_st_tensor_t *t;
    float got[6];
    uint16_t gotb[24];
    int64_t gz = 0;
    uint64_t bytes, reads;
    struct stat sb;

    for (int i = 0; i < 24; i++)
        b[i] = (uint16_t)(1000 + i);
    path_in(path, sizeof(path), "rt.safetensors");
    assert_int_equal(moe_st_write(path, e, 4, meta, 2), MOE_STATUS_SUCCESS);
    assert_int_equal(stat(path, &sb), 0);
    assert_int_equal(moe_st_open(path, &f), MOE_STATUS_SUCCESS);
    assert_string_equal(moe_st_header_metadata(moe_st_file_header(f), "format"), "pt");
    assert_string_equal(moe_st_header_metadata(moe_st_file_header(f), "note"),
                        "a \"quoted\" \\ value");
    assert_int_equal(moe_st_file_header(f)->num_tensors, 4);
    /* The data section starts 8-byte aligned. */
    assert_int_equal((sb.st_size - (off_t)moe_st_file_header(f)->data_bytes) % 8, 0);

    t = moe_st_find(f, "a");
    assert_non_null(t);
    assert_int_equal(t->dtype, MOE_ST_F32);
    assert_int_equal(t->rows, 2);
    assert_int_equal(t->cols, 3);
    assert_int_equal(moe_st_read_block(f, t, 0, 2, 0, 3, got), MOE_STATUS_SUCCESS);
    assert_memory_equal(got, a, sizeof(a));
    moe_st_file_stats(f, &bytes, &reads);
    assert_int_equal(bytes, sizeof(a));
    assert_int_equal(reads, 1);

    t = moe_st_find(f, "layers.0.b \"weird\" name");
    assert_non_null(t);
    assert_int_equal(t->ndim, 3);
    assert_int_equal(t->rows, 2);
    assert_int_equal(t->cols, 12);
    assert_int_equal(moe_st_read_block(f, t, 1, 2, 0, 12, gotb), MOE_STATUS_SUCCESS);
    assert_memory_equal(gotb, b + 12, 24);

    t = moe_st_find(f, "c");
    assert_int_equal(t->rows, 5);
    assert_int_equal(t->cols, 1);
    t = moe_st_find(f, "scalar");
    assert_int_equal(t->ndim, 0);
    assert_int_equal(moe_st_read_block(f, t, 0, 1, 0, 1, &gz), MOE_STATUS_SUCCESS);
    assert_int_equal(gz, 42);
    assert_null(moe_st_find(f, "nope"));
    assert_int_equal(moe_st_read_block(f, t, 0, 2, 0, 1, &gz), MOE_STATUS_INVALID_ARGUMENT);
    moe_st_close(f);
}

/* Column slices: per-row preads of exactly the slice where the gaps are long, one coalesced
 * read where they are short. */
static void test_column_slices(void **state)
{
    enum { R = 64, C = 4096 };
    char path[512];
    uint16_t *m = malloc(sizeof(uint16_t) * R * C), *out = malloc(sizeof(uint16_t) * R * C);
    moe_st_entry_t e = {"m", MOE_ST_BF16, 2, {R, C}, m};
    moe_st_file_t *f = NULL;
    const moe_st_tensor_t *t;
    uint64_t bytes, reads, b0, r0;

    for (int i = 0; i < R * C; i++)
        m[i] = (uint16_t)(i * 7 + 3);
    path_in(path, sizeof(path), "m.safetensors");
    assert_int_equal(moe_st_write(path, &e, 1, NULL, 0), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_st_open(path, &f), MOE_STATUS_SUCCESS);
    t = moe_st_find(f, "m");

    /* Narrow slice (cols 1000..1100 of 4096; gaps of 7.8 KiB): one pread per row, exactly the
     * slice's bytes. */
    assert_int_equal(moe_st_read_block(f, t, 3, 50, 1000, 1100, out), MOE_STATUS_SUCCESS);
    for (int r = 0; r < 47; r++)
        for (int c = 0; c < 100; c++)
            assert_int_equal(out[r * 100 + c], m[(r + 3) * C + 1000 + c]);
    moe_st_file_stats(f, &bytes, &reads);
    assert_int_equal(bytes, 47 * 100 * 2);
    assert_int_equal(reads, 47);

    /* Wide slice (cols 100..3996: gaps of 400 bytes): one read from the first segment's start
     * to the last one's end. */
    b0 = bytes;
    r0 = reads;
    assert_int_equal(moe_st_read_block(f, t, 0, R, 100, 3996, out), MOE_STATUS_SUCCESS);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 3896; c++)
            assert_int_equal(out[r * 3896 + c], m[r * C + 100 + c]);
    moe_st_file_stats(f, &bytes, &reads);
    assert_int_equal(reads - r0, 1);
    assert_int_equal(bytes - b0, (uint64_t)((R - 1) * C + 3896) * 2);

    /* Full rows: one read of exactly those rows. */
    b0 = bytes;
    r0 = reads;
    assert_int_equal(moe_st_read_block(f, t, 10, 12, 0, C, out), MOE_STATUS_SUCCESS);
    assert_memory_equal(out, m + 10 * C, 2 * C * 2);
    moe_st_file_stats(f, &bytes, &reads);
    assert_int_equal(reads - r0, 1);
    assert_int_equal(bytes - b0, 2 * C * 2);
    moe_st_close(f);
    free(m);
    free(out);
}

static void test_zero_sized_and_empty(void **state)
{
    char path[512];
    moe_st_entry_t e[2] = {{"empty", MOE_ST_F32, 2, {0, 4}, NULL}, {"one", MOE_ST_U8, 1, {1}, "x"}};
    moe_st_file_t *f = NULL;

    path_in(path, sizeof(path), "z.safetensors");
    assert_int_equal(moe_st_write(path, e, 2, NULL, 0), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_st_open(path, &f), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_st_find(f, "empty")->rows, 0);
    moe_st_close(f);
    /* A file with no tensors at all is valid. */
    assert_int_equal(moe_st_write(path, NULL, 0, NULL, 0), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_st_open(path, &f), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_st_file_header(f)->num_tensors, 0);
    moe_st_close(f);
}

/* A header padded with spaces (as the reference writes) and one written by hand. */
static void test_handwritten_header(void **state)
{
    moe_st_file_t *f = NULL;
    char path[512];

    write_raw("hand.safetensors",
              "{\"w\":{\"dtype\":\"F16\",\"shape\":[2,2],\"data_offsets\":[0,8],"
              "\"extra\":1}}   ",
              UINT64_MAX, 8);
    path_in(path, sizeof(path), "hand.safetensors");
    assert_int_equal(moe_st_open(path, &f), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_st_find(f, "w")->dtype, MOE_ST_F16);
    moe_st_close(f);
}

/* ---- safetensors: malformed files --------------------------------------------------------- */

#define T1(dt, shape, offs)                                                                        \
    "{\"t\":{\"dtype\":\"" dt "\",\"shape\":" shape ",\"data_offsets\":" offs "}}"

static void test_malformed(void **state)
{
    char deep[600];
    int n = 0;

    /* 1-2: truncated before/inside the length field */
    write_bytes("empty", "", 0);
    expect_open_error("empty", MOE_STATUS_FORMAT_ERROR, "shorter than the 8-byte header length");
    write_bytes("five", "\x10\0\0\0\0", 5);
    expect_open_error("five", MOE_STATUS_FORMAT_ERROR, "shorter than the 8-byte header length");
    /* 3: header length past the end of the file */
    write_raw("pastend", T1("F32", "[1]", "[0,4]"), 1000, 4);
    expect_open_error("pastend", MOE_STATUS_FORMAT_ERROR, "runs past the end of the file");
    /* 4: a huge header length (no allocation of it) */
    write_raw("hugelen", T1("F32", "[1]", "[0,4]"), UINT64_C(0x7fffffffffffffff), 4);
    expect_open_error("hugelen", MOE_STATUS_FORMAT_ERROR, "exceeds the limit");
    /* 5: header is not an object */
    write_raw("notobj", "[1, 2, 3]", UINT64_MAX, 0);
    expect_open_error("notobj", MOE_STATUS_FORMAT_ERROR, "does not start with '{'");
    /* 6: bad JSON */
    write_raw("badjson", "{\"t\":{\"dtype\":\"F32\",\"shape\":[1] \"data_offsets\":[0,4]}}",
              UINT64_MAX, 4);
    expect_open_error("badjson", MOE_STATUS_FORMAT_ERROR, "line 1 column");
    /* 7: unknown dtype */
    write_raw("dtype", T1("F17", "[1]", "[0,4]"), UINT64_MAX, 4);
    expect_open_error("dtype", MOE_STATUS_FORMAT_ERROR, "unknown or unsupported dtype \"F17\"");
    /* 8: non-numeric shape */
    write_raw("shape_str", T1("F32", "[\"4\"]", "[0,16]"), UINT64_MAX, 16);
    expect_open_error("shape_str", MOE_STATUS_FORMAT_ERROR,
                      "shape[0] is not a non-negative integer");
    /* 9: negative and fractional dims */
    write_raw("shape_neg", T1("F32", "[2,-2]", "[0,16]"), UINT64_MAX, 16);
    expect_open_error("shape_neg", MOE_STATUS_FORMAT_ERROR, "shape[1]");
    write_raw("shape_frac", T1("F32", "[2.5]", "[0,10]"), UINT64_MAX, 10);
    expect_open_error("shape_frac", MOE_STATUS_FORMAT_ERROR, "shape[0]");
    /* 10: huge dims whose product overflows */
    write_raw("huge", T1("BF16", "[4294967296,4294967296,4]", "[0,8]"), UINT64_MAX, 8);
    expect_open_error("huge", MOE_STATUS_FORMAT_ERROR, "shape overflows");
    /* 11: huge dims that do not overflow but exceed the data */
    write_raw("big", T1("BF16", "[1048576,1048576]", "[0,8]"), UINT64_MAX, 8);
    expect_open_error("big", MOE_STATUS_FORMAT_ERROR, "need 2199023255552");
    /* 12: too many dimensions */
    write_raw("ndim", T1("U8", "[1,1,1,1,1,1,1,1,1]", "[0,1]"), UINT64_MAX, 1);
    expect_open_error("ndim", MOE_STATUS_FORMAT_ERROR, "9 dimensions");
    /* 13: offsets past the end of the data */
    write_raw("range", T1("F32", "[4]", "[0,16]"), UINT64_MAX, 8);
    expect_open_error("range", MOE_STATUS_FORMAT_ERROR, "run past the end of the data");
    /* 14: end before begin */
    write_raw("backwards", T1("F32", "[0]", "[8,0]"), UINT64_MAX, 8);
    expect_open_error("backwards", MOE_STATUS_FORMAT_ERROR, "end before begin");
    /* 15: wrong byte count for dtype x shape */
    write_raw("wrongsize", T1("F32", "[3]", "[0,8]"), UINT64_MAX, 8);
    expect_open_error("wrongsize", MOE_STATUS_FORMAT_ERROR, "holds 8 bytes but its dtype F32");
    /* 16: overlapping tensors */
    write_raw("overlap",
              "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
              "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
              UINT64_MAX, 12);
    expect_open_error("overlap", MOE_STATUS_FORMAT_ERROR, "overlap tensor \"a\"");
    /* 17: a gap between tensors */
    write_raw("gap",
              "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
              "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
              UINT64_MAX, 12);
    expect_open_error("gap", MOE_STATUS_FORMAT_ERROR, "gap in the data before tensor \"b\"");
    /* 18: bytes after the last tensor */
    write_raw("trailing", T1("F32", "[1]", "[0,4]"), UINT64_MAX, 9);
    expect_open_error("trailing", MOE_STATUS_FORMAT_ERROR, "tensors cover 4 bytes");
    /* 19: duplicate tensor names */
    write_raw("dup",
              "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
              "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
              UINT64_MAX, 2);
    expect_open_error("dup", MOE_STATUS_FORMAT_ERROR, "duplicate key \"a\"");
    /* 20: deep nesting */
    n = sprintf(deep, "{\"__metadata__\":");
    for (int i = 0; i < 200; i++)
        deep[n++] = '[';
    deep[n] = '\0';
    write_raw("deep", deep, UINT64_MAX, 0);
    expect_open_error("deep", MOE_STATUS_FORMAT_ERROR, "nesting too deep");
    /* 21: metadata value not a string */
    write_raw("meta", "{\"__metadata__\":{\"format\":1}}", UINT64_MAX, 0);
    expect_open_error("meta", MOE_STATUS_FORMAT_ERROR, "__metadata__ value of \"format\"");
    /* 22: missing fields / wrong types */
    write_raw("nodtype", "{\"t\":{\"shape\":[1],\"data_offsets\":[0,1]}}", UINT64_MAX, 1);
    expect_open_error("nodtype", MOE_STATUS_FORMAT_ERROR, "has no dtype");
    write_raw("offs3", T1("U8", "[1]", "[0,1,2]"), UINT64_MAX, 1);
    expect_open_error("offs3", MOE_STATUS_FORMAT_ERROR, "data_offsets must be an array");
    write_raw("tensor_num", "{\"t\":3}", UINT64_MAX, 0);
    expect_open_error("tensor_num", MOE_STATUS_FORMAT_ERROR, "is a number, expected an object");
    /* 23: invalid UTF-8 in a name */
    write_raw("utf8", "{\"\xff\":{}}", UINT64_MAX, 0);
    expect_open_error("utf8", MOE_STATUS_FORMAT_ERROR, "invalid UTF-8");
    /* 24: offsets that do not fit int64 */
    write_raw("offbig", T1("U8", "[1]", "[0,99999999999999999999999]"), UINT64_MAX, 1);
    expect_open_error("offbig", MOE_STATUS_FORMAT_ERROR, "not non-negative integers");
    /* 25: I/O errors: a missing file and a folder */
    expect_open_error("does_not_exist", MOE_STATUS_IO_ERROR, "cannot open");
    {
        char sub[512];
        path_in(sub, sizeof(sub), "subdir");
        assert_int_equal(mkdir(sub, 0700), 0);
        expect_open_error("subdir", MOE_STATUS_IO_ERROR, "not a regular file");
        rmdir(sub);
    }
}

/* A file cut short after open: reads fail with an IO error instead of returning garbage. */
static void test_truncated_after_open(void **state)
{
    char path[512];
    float a[256];
    moe_st_entry_t e = {"a", MOE_ST_F32, 2, {16, 16}, a};
    moe_st_file_t *f = NULL;
    const moe_st_tensor_t *t;

    memset(a, 0, sizeof(a));
    path_in(path, sizeof(path), "shrink.safetensors");
    assert_int_equal(moe_st_write(path, &e, 1, NULL, 0), MOE_STATUS_SUCCESS);
    assert_int_equal(moe_st_open(path, &f), MOE_STATUS_SUCCESS);
    t = moe_st_find(f, "a");
    assert_int_equal(truncate(path, 200), 0);
    assert_int_equal(moe_st_read_block(f, t, 0, 16, 0, 16, a), MOE_STATUS_IO_ERROR);
    assert_non_null(strstr(moe_last_error(), "unexpected end of file"));
    moe_st_close(f);
}

/* The in-memory entry point (used by the fuzz target) agrees with the file reader. */
static void test_parse_buffer(void **state)
{
    const char *hdr = T1("U8", "[2]", "[0,2]");
    unsigned char buf[128];
    size_t n = strlen(hdr);
    moe_st_header_t *h = NULL;

    memset(buf, 0, sizeof(buf));
    buf[0] = (unsigned char)n;
    memcpy(buf + 8, hdr, n);
    assert_int_equal(moe_st_parse_buffer(buf, 8 + n + 2, "mem", &h), MOE_STATUS_SUCCESS);
    assert_int_equal(h->num_tensors, 1);
    moe_st_header_free(h);
    assert_int_equal(moe_st_parse_buffer(buf, 8 + n + 3, "mem", &h), MOE_STATUS_FORMAT_ERROR);
    assert_int_equal(moe_st_parse_buffer(buf, 8 + n - 1, "mem", &h), MOE_STATUS_FORMAT_ERROR);
    assert_int_equal(moe_st_parse_buffer(buf, 3, "mem", &h), MOE_STATUS_FORMAT_ERROR);
    assert_null(h);
    {
        /* found by the fuzzer: a 0 dimension must not hide the overflow of the others */
        const char *big = T1("F32", "[0,292267440737095516,4,16]", "[0,0]");
        unsigned char b2[256];
        size_t m = strlen(big);
        memset(b2, 0, sizeof(b2));
        b2[0] = (unsigned char)m;
        memcpy(b2 + 8, big, m);
        assert_int_equal(moe_st_parse_buffer(b2, 8 + m, "mem", &h), MOE_STATUS_FORMAT_ERROR);
        assert_non_null(strstr(moe_last_error(), "overflows"));
        assert_null(h);
    }
}

static void test_writer_rejects(void **state)
{
    char path[512];
    moe_st_entry_t bad[2] = {{"x", MOE_ST_INVALID, 1, {1}, "a"},
                             {"__metadata__", MOE_ST_U8, 1, {1}, "a"}};

    path_in(path, sizeof(path), "bad.safetensors");
    assert_int_equal(moe_st_write(path, &bad[0], 1, NULL, 0), MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(moe_st_write(path, &bad[1], 1, NULL, 0), MOE_STATUS_INVALID_ARGUMENT);
    assert_int_equal(access(path, F_OK), -1);
    path_in(path, sizeof(path), "no_such_dir/x.safetensors");
    bad[0].dtype = MOE_ST_U8;
    assert_int_equal(moe_st_write(path, &bad[0], 1, NULL, 0), MOE_STATUS_IO_ERROR);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_values),
        cmocka_unit_test(test_json_escape_byte),
        cmocka_unit_test(test_json_errors),
        cmocka_unit_test(test_json_many_keys_and_node_limit),
        cmocka_unit_test(test_write_read_roundtrip),
        cmocka_unit_test(test_column_slices),
        cmocka_unit_test(test_zero_sized_and_empty),
        cmocka_unit_test(test_handwritten_header),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_truncated_after_open),
        cmocka_unit_test(test_parse_buffer),
        cmocka_unit_test(test_writer_rejects),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
